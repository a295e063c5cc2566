/* SPDX-License-Identifier: Apache-2.0 */
/* Regions kept between batch simulations (harness_region.h). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "harness_region.h"

/* Under AddressSanitizer the region is poisoned but for what is carved (the
 * 64-byte padding between carvings stays poisoned) and all of it again when
 * given back: what malloc'd arrays had, an overflow or a use after the
 * simulation caught. */
#if defined(__SANITIZE_ADDRESS__)
#define BH_REGION_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define BH_REGION_ASAN 1
#endif
#endif
#ifdef BH_REGION_ASAN
#include <sanitizer/asan_interface.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION((p), (n))
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION((p), (n))
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#define HUGE_PAGE ((size_t)2 << 20)
#define KEEP_MAX 8 /* regions kept at most (one per simulation at a time) */

struct bh_region {
  unsigned char *map; /* the mapping: map_len bytes */
  size_t map_len;
  unsigned char *base; /* 2 MiB aligned, size bytes */
  size_t size, used;
  size_t peak; /* most ever carved at once */
};

static pthread_mutex_t keep_mu = PTHREAD_MUTEX_INITIALIZER;
static bh_region *kept[KEEP_MAX];
static unsigned n_kept;

static void region_unmap(bh_region *r) {
  UNPOISON(r->base, r->size); /* the next mapping there starts clean */
  munmap(r->map, r->map_len);
  free(r);
}

static bh_region *region_map(size_t size) {
  bh_region *r = calloc(1, sizeof *r);
  if (r == NULL)
    return NULL;
  r->map_len = size + HUGE_PAGE; /* room to align the start */
  void *m = mmap(NULL, r->map_len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    free(r);
    return NULL;
  }
  r->map = m;
  uintptr_t a = ((uintptr_t)m + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1);
  r->base = (unsigned char *)a;
  r->size = size;
#ifdef MADV_HUGEPAGE
  (void)madvise(r->base, size, MADV_HUGEPAGE); /* a hint: fine without */
#endif
  POISON(r->base, size);
  return r;
}

int bh_region_take(size_t bytes, bh_region **out) {
  if (out == NULL || bytes == 0)
    return KVP_EINVAL;
  *out = NULL;
  if (bytes > SIZE_MAX / 2)
    return KVP_ENOMEM;
  size_t size = (bytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
  bh_region *r = NULL, *drop[KEEP_MAX];
  unsigned n_drop = 0;
  pthread_mutex_lock(&keep_mu);
  unsigned best = n_kept;
  for (unsigned i = 0; i < n_kept; i++)
    if (kept[i]->size >= size &&
        (best == n_kept || kept[i]->size < kept[best]->size))
      best = i;
  if (best < n_kept) {
    r = kept[best];
    kept[best] = kept[--n_kept];
  } else { /* none fits: the smaller ones would only keep pages in memory */
    while (n_kept > 0)
      drop[n_drop++] = kept[--n_kept];
  }
  pthread_mutex_unlock(&keep_mu);
  for (unsigned i = 0; i < n_drop; i++)
    region_unmap(drop[i]);
  if (r == NULL && (r = region_map(size)) == NULL)
    return KVP_ENOMEM;
  r->used = 0;
  *out = r;
  return 0;
}

void bh_region_give(bh_region *r) {
  if (r == NULL)
    return;
  POISON(r->base, r->used);
  r->used = 0;
  pthread_mutex_lock(&keep_mu);
  bool keep = n_kept < KEEP_MAX;
  if (keep)
    kept[n_kept++] = r;
  pthread_mutex_unlock(&keep_mu);
  if (!keep)
    region_unmap(r);
}

void bh_region_drain(void) {
  pthread_mutex_lock(&keep_mu);
  while (n_kept > 0)
    region_unmap(kept[--n_kept]);
  pthread_mutex_unlock(&keep_mu);
}

bool bh_region_has(const bh_region *r, const void *p) {
  const unsigned char *c = p;
  return r != NULL && c >= r->base && c < r->base + r->size;
}

size_t bh_region_used(const bh_region *r) { return r != NULL ? r->used : 0; }

size_t bh_region_size(const bh_region *r) { return r != NULL ? r->size : 0; }

size_t bh_region_peak(const bh_region *r) { return r != NULL ? r->peak : 0; }

void *bh_region_base(const bh_region *r) { return r != NULL ? r->base : NULL; }

static void *region_alloc(void *opaque, size_t size) {
  bh_region *r = opaque;
  size_t need = (size + 63) & ~(size_t)63;
  if (size >= BH_REGION_MIN && need >= size && need <= r->size - r->used) {
    void *p = r->base + r->used;
    UNPOISON(p, size);
    r->used += need;
    if (r->used > r->peak)
      r->peak = r->used;
    return p;
  }
  return malloc(size);
}

static void region_free(void *opaque, void *p, size_t size) {
  (void)size;
  if (!bh_region_has(opaque, p))
    free(p); /* the region's own go back together (bh_region_give) */
}

kvp_allocator bh_region_allocator(bh_region *r) {
  return (kvp_allocator){region_alloc, region_free, r};
}
