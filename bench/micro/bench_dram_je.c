/* SPDX-License-Identifier: Apache-2.0 */
/* bench_dram_alloc's baseline: kvtier's DRAM region as it was before the
 * size classes (kvtier/tier_dram.c at d77d67e: fixed-size slot pools that
 * never give slabs back, and a private jemalloc arena over the region's
 * 2 MiB chunks for every other size), renamed je_dram_*.  Kept verbatim
 * so the bench compares the two in one run. */
#include <errno.h>
#include <jemalloc/jemalloc.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "core_internal.h"
#include "bench_dram_je.h"
#include "kvtier_internal.h"

#define CHUNK (UINT64_C(2) << 20)
#define POOLS_MAX 16u

typedef struct pool {
  uint64_t stride;
  void *free_head; /* intrusive free list through free slots */
  uint64_t slots, used;
} pool;

typedef struct hooks_box {
  extent_hooks_t hooks; /* first: jemalloc passes &hooks back to us */
  je_dram *d;
} hooks_box;

struct je_dram {
  kvp_allocator a;
  uint8_t *map, *base; /* base: map rounded up to CHUNK */
  size_t map_len, len;
  uint32_t nchunks;
  uint8_t *chunk_used;
  int huge;
  pool pools[POOLS_MAX];
  uint32_t npools;
  uint64_t slot_bytes;
  unsigned arena;
  bool arena_ok;
  hooks_box box;
};

/* First-fit run of n free chunks; index or UINT32_MAX. */
static uint32_t chunks_take(je_dram *d, uint32_t n) {
  uint32_t run = 0;
  for (uint32_t i = 0; i < d->nchunks; i++) {
    run = d->chunk_used[i] ? 0 : run + 1;
    if (run == n) {
      uint32_t first = i + 1 - n;
      memset(d->chunk_used + first, 1, n);
      return first;
    }
  }
  return UINT32_MAX;
}

static void *hook_alloc(extent_hooks_t *h, void *new_addr, size_t size,
                        size_t alignment, bool *zero, bool *commit,
                        unsigned arena_ind) {
  (void)arena_ind;
  je_dram *d = ((hooks_box *)h)->d;
  if (new_addr != NULL || alignment > CHUNK || size == 0)
    return NULL;
  uint64_t n = (size + CHUNK - 1) / CHUNK;
  if (n > d->nchunks)
    return NULL;
  uint32_t first = chunks_take(d, (uint32_t)n);
  if (first == UINT32_MAX)
    return NULL;
  void *p = d->base + (uint64_t)first * CHUNK;
  if (*zero)
    memset(p, 0, size);
  *commit = true;
  return p;
}
/* Opt out of unmapping: jemalloc retains the extent and reuses it. */
static bool hook_dalloc(extent_hooks_t *h, void *addr, size_t size,
                        bool committed, unsigned arena_ind) {
  (void)h, (void)addr, (void)size, (void)committed, (void)arena_ind;
  return true;
}
static void hook_destroy(extent_hooks_t *h, void *addr, size_t size,
                         bool committed, unsigned arena_ind) {
  (void)h, (void)addr, (void)size, (void)committed, (void)arena_ind;
}
/* The region is contiguous: splitting and merging are always fine. */
static bool hook_split(extent_hooks_t *h, void *addr, size_t size,
                       size_t size_a, size_t size_b, bool committed,
                       unsigned arena_ind) {
  (void)h, (void)addr, (void)size, (void)size_a, (void)size_b,
      (void)committed, (void)arena_ind;
  return false;
}
static bool hook_merge(extent_hooks_t *h, void *addr_a, size_t size_a,
                       void *addr_b, size_t size_b, bool committed,
                       unsigned arena_ind) {
  (void)h, (void)addr_a, (void)size_a, (void)addr_b, (void)size_b,
      (void)committed, (void)arena_ind;
  return false;
}

static int map_region(je_dram *d, uint64_t bytes, kvp_tier_huge huge) {
  d->len = (size_t)((bytes + CHUNK - 1) / CHUNK * CHUNK);
  /* no MAP_NORESERVE: the kernel reserves the huge pages now or refuses,
   * instead of SIGBUS on first touch */
  if (huge == KVP_TIER_HUGE_AUTO) {
    void *p = mmap(NULL, d->len, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (p != MAP_FAILED) {
      d->map = d->base = p;
      d->map_len = d->len;
      d->huge = 2;
      return 0;
    }
  }
  d->map_len = d->len + CHUNK; /* room to align the base to 2 MiB */
  void *p = mmap(NULL, d->map_len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED)
    return -errno;
  d->map = p;
  d->base = (uint8_t *)(((uintptr_t)p + CHUNK - 1) & ~(uintptr_t)(CHUNK - 1));
  if (huge != KVP_TIER_HUGE_NONE && madvise(d->base, d->len, MADV_HUGEPAGE) == 0)
    d->huge = 1;
  return 0;
}

static int make_arena(je_dram *d) {
  d->box.hooks = (extent_hooks_t){.alloc = hook_alloc,
                                  .dalloc = hook_dalloc,
                                  .destroy = hook_destroy,
                                  .split = hook_split,
                                  .merge = hook_merge};
  d->box.d = d;
  extent_hooks_t *hp = &d->box.hooks;
  size_t sz = sizeof d->arena;
  int rc = mallctl("arenas.create", &d->arena, &sz, &hp, sizeof hp);
  if (rc != 0) {
    KVP_LOGE("kvtier", "jemalloc arenas.create failed: %s", strerror(rc));
    return KVP_ENOMEM;
  }
  d->arena_ok = true;
  return 0;
}

int je_dram_create(uint64_t bytes, kvp_tier_huge huge,
                          const kvp_allocator *a, je_dram **out) {
  if (bytes < 2 * CHUNK || bytes > (UINT64_C(1) << 46)) /* arena metadata takes a chunk */
    return KVP_ERANGE;
  je_dram *d = kvp__calloc(a, 1, sizeof *d);
  if (d == NULL)
    return KVP_ENOMEM;
  d->a = kvp__allocator(a);
  int rc = map_region(d, bytes, huge);
  if (rc < 0)
    goto fail_free;
  d->nchunks = (uint32_t)(d->len / CHUNK);
  d->chunk_used = kvp__calloc(a, d->nchunks, 1);
  if (d->chunk_used == NULL) {
    rc = KVP_ENOMEM;
    goto fail_unmap;
  }
  if ((rc = make_arena(d)) < 0)
    goto fail_chunks;
  *out = d;
  return 0;
fail_chunks:
  kvp__free(a, d->chunk_used, d->nchunks);
fail_unmap:
  munmap(d->map, d->map_len);
fail_free:
  kvp__free(a, d, sizeof *d);
  return rc;
}

void je_dram_destroy(je_dram *d) {
  if (d == NULL)
    return;
  if (d->arena_ok) {
    char name[64];
    snprintf(name, sizeof name, "arena.%u.destroy", d->arena);
    mallctl(name, NULL, NULL, NULL, 0);
  }
  munmap(d->map, d->map_len);
  kvp__free(&d->a, d->chunk_used, d->nchunks);
  kvp__free(&d->a, d, sizeof *d);
}

static pool *pool_for(je_dram *d, uint64_t stride, uint32_t *idx) {
  for (uint32_t i = 0; i < d->npools; i++)
    if (d->pools[i].stride == stride) {
      *idx = i;
      return &d->pools[i];
    }
  if (d->npools == POOLS_MAX)
    return NULL;
  *idx = d->npools;
  pool *p = &d->pools[d->npools++];
  *p = (pool){.stride = stride};
  return p;
}

/* A slab for the pool: enough chunks for >= 8 slots when slots are large. */
static bool pool_grow(je_dram *d, pool *p) {
  uint64_t want = p->stride >= CHUNK / 8 ? 8 * p->stride : CHUNK;
  uint64_t n = (want + CHUNK - 1) / CHUNK;
  uint32_t first = n <= d->nchunks ? chunks_take(d, (uint32_t)n) : UINT32_MAX;
  if (first == UINT32_MAX && n > 1) { /* fragmented: one slot's worth */
    n = (p->stride + CHUNK - 1) / CHUNK;
    first = n <= d->nchunks ? chunks_take(d, (uint32_t)n) : UINT32_MAX;
  }
  if (first == UINT32_MAX)
    return false;
  uint8_t *s = d->base + (uint64_t)first * CHUNK;
  uint64_t k = n * CHUNK / p->stride;
  for (uint64_t i = k; i-- > 0;) {
    void **slot = (void **)(s + i * p->stride);
    *slot = p->free_head;
    p->free_head = slot;
  }
  p->slots += k;
  return true;
}

void *je_dram_alloc(je_dram *d, size_t len, uint64_t fixed,
                           uint32_t *pool_idx, uint64_t *charged) {
  if (len == 0)
    return NULL;
  if (fixed != 0 && len == fixed) {
    uint64_t stride = (len + 63) & ~UINT64_C(63);
    pool *p = pool_for(d, stride, pool_idx);
    if (p != NULL) {
      if (p->free_head == NULL && !pool_grow(d, p))
        return NULL;
      void **slot = p->free_head;
      p->free_head = *slot;
      p->used++;
      d->slot_bytes += stride;
      *charged = stride;
      return slot;
    }
  }
  void *r = mallocx(len, MALLOCX_ARENA(d->arena) | MALLOCX_TCACHE_NONE |
                             MALLOCX_ALIGN(64));
  if (r == NULL)
    return NULL;
  *pool_idx = JE_POOL_ARENA;
  *charged = sallocx(r, MALLOCX_ARENA(d->arena) | MALLOCX_TCACHE_NONE);
  return r;
}

void je_dram_free(je_dram *d, void *ptr, uint32_t pool_idx) {
  if (ptr == NULL)
    return;
  if (pool_idx == JE_POOL_ARENA) {
    dallocx(ptr, MALLOCX_ARENA(d->arena) | MALLOCX_TCACHE_NONE);
    return;
  }
  pool *p = &d->pools[pool_idx];
  void **slot = ptr;
  *slot = p->free_head;
  p->free_head = slot;
  p->used--;
  d->slot_bytes -= p->stride;
}
