/* SPDX-License-Identifier: Apache-2.0 */
/* The one allocation helper, UTF-8 validation and the version query. */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core_internal.h"

static void *libc_alloc(void *opaque, size_t size) {
  (void)opaque;
  return malloc(size);
}

static void libc_free(void *opaque, void *p, size_t size) {
  (void)opaque;
  (void)size;
  free(p);
}

kvp_allocator kvp__allocator(const kvp_allocator *a) {
  if (a != NULL && a->alloc != NULL && a->free != NULL)
    return *a;
  return (kvp_allocator){libc_alloc, libc_free, NULL};
}

void *kvp__malloc(const kvp_allocator *a, size_t size) {
  if (size == 0)
    size = 1;
  if (a == NULL || a->alloc == NULL)
    return malloc(size);
  return a->alloc(a->opaque, size);
}

void *kvp__calloc(const kvp_allocator *a, size_t n, size_t size) {
  size_t total;
  if (!kvp__mul_ok(n, size, &total))
    return NULL;
  if (a == NULL || a->alloc == NULL)
    return calloc(total ? total : 1, 1);
  void *p = kvp__malloc(a, total);
  if (p != NULL)
    memset(p, 0, total);
  return p;
}

void kvp__free(const kvp_allocator *a, void *p, size_t size) {
  if (p == NULL)
    return;
  if (size == 0) /* kvp__malloc asked the hook for 1 byte */
    size = 1;
  if (a == NULL || a->free == NULL)
    free(p);
  else
    a->free(a->opaque, p, size);
}

void *kvp__realloc(const kvp_allocator *a, void *p, size_t old_size,
                   size_t new_size) {
  if (a == NULL || a->alloc == NULL) /* malloc's own: may grow in place */
    return realloc(p, new_size ? new_size : 1);
  void *q = kvp__malloc(a, new_size);
  if (q == NULL)
    return NULL;
  if (p != NULL) {
    memcpy(q, p, old_size < new_size ? old_size : new_size);
    kvp__free(a, p, old_size);
  }
  return q;
}

#define HUGE_PAGE ((size_t)2 << 20)

bool kvp__allocator_libc(const kvp_allocator *a) {
  return a == NULL || a->alloc == NULL || a->alloc == libc_alloc;
}

size_t kvp__huge_size(size_t bytes) {
  if (bytes < HUGE_PAGE || bytes > SIZE_MAX - 2 * HUGE_PAGE)
    return 0;
  return ((bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)) + HUGE_PAGE;
}

#ifdef MADV_HUGEPAGE
/* Zeroes [a, a + whole), whole 2 MiB pages from a 2 MiB boundary: one whose
 * every page is in memory (mincore) is cleared in place; runs of the others
 * are dropped (MADV_DONTNEED) and read as zero, faulted in when touched. */
static int huge_zero(unsigned char *a, size_t whole) {
  long ps = sysconf(_SC_PAGESIZE);
  size_t pg = ps >= 4096 && (size_t)ps <= HUGE_PAGE ? (size_t)ps : 4096;
  size_t np = HUGE_PAGE / pg, drop = 0; /* [a + drop, a + i): to drop */
  unsigned char v[HUGE_PAGE / 4096];
  for (size_t i = 0; i < whole; i += HUGE_PAGE) {
    size_t in = 0;
    if (mincore(a + i, HUGE_PAGE, v) == 0)
      for (size_t k = 0; k < np; k++)
        in += v[k] & 1;
    if (in < np)
      continue;
    if (drop < i && madvise(a + drop, i - drop, MADV_DONTNEED) != 0)
      return -1;
    memset(a + i, 0, HUGE_PAGE);
    drop = i + HUGE_PAGE;
  }
  return drop < whole ? madvise(a + drop, whole - drop, MADV_DONTNEED) : 0;
}
#endif

void *kvp__huge_place(void *block, size_t bytes) {
  uintptr_t a = ((uintptr_t)block + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
#ifdef MADV_HUGEPAGE
  size_t whole = (bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
  if (madvise((void *)a, whole, MADV_HUGEPAGE) == 0 &&
      huge_zero((unsigned char *)a, whole) == 0)
    return (void *)a;
#endif
  memset((void *)a, 0, bytes); /* not memory that takes advice */
  return (void *)a;
}

void *kvp__huge_calloc(size_t n, size_t size, void **block) {
  size_t bytes, huge;
  if (!kvp__mul_ok(n, size, &bytes))
    return *block = NULL;
  if ((huge = kvp__huge_size(bytes)) == 0)
    return *block = calloc(bytes ? bytes : 1, 1);
  *block = malloc(huge);
  return *block != NULL ? kvp__huge_place(*block, bytes) : NULL;
}

bool kvp__utf8_valid(const char *str, size_t len) {
  const unsigned char *s = (const unsigned char *)str;
  size_t i = 0;
  while (i < len) {
    unsigned c = s[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t need;
    uint32_t cp, min;
    if ((c & 0xE0) == 0xC0) {
      need = 1, cp = c & 0x1F, min = 0x80;
    } else if ((c & 0xF0) == 0xE0) {
      need = 2, cp = c & 0x0F, min = 0x800;
    } else if ((c & 0xF8) == 0xF0) {
      need = 3, cp = c & 0x07, min = 0x10000;
    } else {
      return false;
    }
    if (len - i <= need)
      return false;
    for (size_t k = 1; k <= need; k++) {
      if ((s[i + k] & 0xC0) != 0x80)
        return false;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += need + 1;
  }
  return true;
}

const char *kvp_version(void) { return KVP_VERSION_STR; }
uint32_t kvp_version_number(void) { return KVP_VERSION_NUM; }
