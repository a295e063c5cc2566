/* SPDX-License-Identifier: Apache-2.0 */
/* The DRAM tier's memory: one mmap region (explicit huge pages when
 * reserved, else transparent huge pages advised), cut into 64 KiB pages.
 * Runs of pages are slabs of slot pools or, for large blocks, the block
 * itself.  A pool is a namespace's fixed block size or one of 44 size
 * classes (64 B apart up to 512 B, then four a doubling up to 256 KiB, as
 * jemalloc's) for variable-size blocks; larger blocks take their own page
 * run.  So every block is inside the region (registered with the GPU,
 * huge-page backed), internal waste stays under a quarter of a block, and
 * no allocator with process-wide state (jemalloc's initial-exec TLS) comes
 * into the library (docs/kvtier.md "DRAM allocation").  An empty slab goes
 * back to the pages, except the one a pool keeps for the next block.
 * Callers serialise (the store's lock). */
#include <assert.h>
#include <errno.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>

#include "core_internal.h"
#include "kvtier_internal.h"

#define CHUNK (UINT64_C(2) << 20) /* huge page; the region's granularity */
#define PAGE (UINT64_C(64) << 10) /* slab and run granularity */
#define FIXED_MAX 16u             /* fixed-size pools (namespaces' sizes) */
#define NCLASS 44u                /* size classes, 64 B .. 256 KiB */
#define CLASS_MAX (UINT64_C(256) << 10)
#define NIL UINT32_MAX

/* A run of pages cut into slots of one pool's stride. */
typedef struct slab {
  void *free_head; /* intrusive free list through free slots */
  uint32_t used, slots, first, npages;
  uint32_t pool;
  uint32_t prev, next; /* the pool's list of slabs with a free slot */
} slab;

typedef struct pool {
  uint64_t stride;
  uint32_t partial; /* slabs with a free slot; NIL: none */
  uint32_t empty;   /* slabs in that list with no block */
  uint64_t used;
} pool;

struct tier_dram {
  kvp_allocator a;
  uint8_t *map, *base; /* base: map rounded up to CHUNK */
  size_t map_len, len;
  uint32_t npages;
  uint32_t hint;        /* no free page below */
  uint8_t *page_used;   /* 1: in a slab or a run */
  uint32_t *page_owner; /* slab id of each slab page; a run's length at its
                           first page */
  int huge;
  pool pools[FIXED_MAX + NCLASS];
  uint32_t nfixed;
  uint64_t slot_bytes; /* charged to fixed-size slots */
  slab *slabs;
  uint32_t nslabs, slabs_cap, slab_free; /* slab_free: unused records,
                                            through .next */
};

/* ---- pages -------------------------------------------------------------- */

static uint32_t pages_of(uint64_t bytes) {
  return (uint32_t)((bytes + PAGE - 1) / PAGE);
}

/* First fit: n free pages in a row; their first index or NIL. */
static uint32_t pages_find(tier_dram *d, uint32_t n) {
  uint32_t i = d->hint;
  bool first_free = true;
  while (i < d->npages && d->npages - i >= n) {
    const uint8_t *f = memchr(d->page_used + i, 0, d->npages - i);
    if (f == NULL) {
      if (first_free)
        d->hint = d->npages;
      break;
    }
    i = (uint32_t)(f - d->page_used);
    if (first_free) /* every page below i is in use */
      d->hint = i, first_free = false;
    uint32_t j = i;
    while (j < d->npages && j - i < n && d->page_used[j] == 0)
      j++;
    if (j - i == n)
      return i;
    i = j;
  }
  return NIL;
}

static void pages_mark(tier_dram *d, uint32_t first, uint32_t n, uint8_t v) {
  memset(d->page_used + first, v, n);
  if (v == 0 && first < d->hint)
    d->hint = first;
  else if (v != 0 && first == d->hint)
    d->hint = first + n;
}

/* ---- slabs ---------------------------------------------------------------- */

static void list_push(tier_dram *d, pool *p, uint32_t sid) {
  slab *s = &d->slabs[sid];
  s->prev = NIL;
  s->next = p->partial;
  if (p->partial != NIL)
    d->slabs[p->partial].prev = sid;
  p->partial = sid;
}

static void list_unlink(tier_dram *d, pool *p, uint32_t sid) {
  slab *s = &d->slabs[sid];
  if (s->prev != NIL)
    d->slabs[s->prev].next = s->next;
  else
    p->partial = s->next;
  if (s->next != NIL)
    d->slabs[s->next].prev = s->prev;
}

/* A slab record; NIL when they cannot grow. */
static uint32_t slab_record(tier_dram *d) {
  if (d->slab_free != NIL) {
    uint32_t sid = d->slab_free;
    d->slab_free = d->slabs[sid].next;
    return sid;
  }
  if (d->nslabs == d->slabs_cap) {
    uint32_t cap = d->slabs_cap ? 2 * d->slabs_cap : 64;
    slab *s = kvp__realloc(&d->a, d->slabs, d->slabs_cap * sizeof *s,
                           cap * sizeof *s);
    if (s == NULL)
      return NIL;
    d->slabs = s;
    d->slabs_cap = cap;
  }
  return d->nslabs++;
}

/* An empty slab's pages go back; its record is reused. */
static void slab_release(tier_dram *d, pool *p, uint32_t sid) {
  slab *s = &d->slabs[sid];
  assert(s->used == 0);
  list_unlink(d, p, sid);
  p->empty--;
  pages_mark(d, s->first, s->npages, 0);
  s->next = d->slab_free;
  d->slab_free = sid;
}

/* Every pool's kept empty slab back to the pages: the region is full. */
static bool reclaim(tier_dram *d) {
  bool any = false;
  for (uint32_t i = 0; i < FIXED_MAX + NCLASS; i++) {
    pool *p = &d->pools[i];
    for (uint32_t sid = p->partial; sid != NIL && p->empty > 0;) {
      uint32_t next = d->slabs[sid].next;
      if (d->slabs[sid].used == 0)
        slab_release(d, p, sid), any = true;
      sid = next;
    }
  }
  return any;
}

/* n free pages, reclaiming kept empty slabs when there are none. */
static uint32_t pages_take(tier_dram *d, uint32_t n) {
  uint32_t first = pages_find(d, n);
  if (first == NIL && reclaim(d))
    first = pages_find(d, n);
  if (first != NIL)
    pages_mark(d, first, n, 1);
  return first;
}

/* A new slab for pool pi: room for >= 8 slots when they are large (fixed
 * sizes keep the huge-page multiples they had), else one slot's worth. */
static bool slab_new(tier_dram *d, uint32_t pi) {
  pool *p = &d->pools[pi];
  uint64_t unit = pi < FIXED_MAX ? CHUNK : PAGE;
  uint64_t want = p->stride >= unit / 8 ? 8 * p->stride : unit;
  uint32_t n = pages_of((want + unit - 1) / unit * unit);
  uint32_t first = n <= d->npages ? pages_take(d, n) : NIL;
  if (first == NIL && n > pages_of(p->stride)) { /* fragmented */
    n = pages_of(p->stride);
    first = n <= d->npages ? pages_take(d, n) : NIL;
  }
  if (first == NIL)
    return false;
  uint32_t sid = slab_record(d);
  if (sid == NIL) {
    pages_mark(d, first, n, 0);
    return false;
  }
  slab *s = &d->slabs[sid];
  *s = (slab){.first = first, .npages = n, .pool = pi,
              .slots = (uint32_t)(n * PAGE / p->stride)};
  uint8_t *b = d->base + (uint64_t)first * PAGE;
  for (uint64_t i = s->slots; i-- > 0;) {
    void **slot = (void **)(b + i * p->stride);
    *slot = s->free_head;
    s->free_head = slot;
  }
  for (uint32_t i = 0; i < n; i++)
    d->page_owner[first + i] = sid;
  list_push(d, p, sid);
  p->empty++;
  return true;
}

static void *pool_alloc(tier_dram *d, uint32_t pi) {
  pool *p = &d->pools[pi];
  if (p->partial == NIL && !slab_new(d, pi))
    return NULL;
  uint32_t sid = p->partial;
  slab *s = &d->slabs[sid];
  void **slot = s->free_head;
  s->free_head = *slot;
  if (s->used++ == 0)
    p->empty--;
  if (s->used == s->slots)
    list_unlink(d, p, sid);
  p->used++;
  return slot;
}

static void pool_free(tier_dram *d, void *ptr) {
  uint32_t sid = d->page_owner[((uint8_t *)ptr - d->base) / PAGE];
  slab *s = &d->slabs[sid];
  pool *p = &d->pools[s->pool];
  void **slot = ptr;
  *slot = s->free_head;
  s->free_head = slot;
  if (s->used-- == s->slots)
    list_push(d, p, sid);
  p->used--;
  if (s->used == 0 && p->empty++ > 0) /* keep one empty slab a pool */
    slab_release(d, p, sid);
}

/* ---- size classes ----------------------------------------------------------- */

/* 64 B apart up to 512 B, then four a doubling: waste under 20 %. */
static uint32_t class_of(uint64_t len) {
  assert(len > 0 && len <= CLASS_MAX);
  if (len <= 512)
    return (uint32_t)((len + 63) / 64 - 1);
  unsigned lg = 63u - (unsigned)__builtin_clzll(len - 1); /* 2^lg < len */
  uint64_t q = (len + (UINT64_C(1) << (lg - 2)) - 1) >> (lg - 2); /* 5..8 */
  return 8u + (lg - 9u) * 4u + (uint32_t)(q - 5);
}

static uint64_t class_stride(uint32_t c) {
  if (c < 8)
    return (uint64_t)(c + 1) * 64;
  unsigned lg = 9u + (c - 8u) / 4u;
  return (uint64_t)(5u + (c - 8u) % 4u) << (lg - 2);
}

/* The fixed-size pool of stride, made on first use; NIL when all are. */
static uint32_t fixed_pool(tier_dram *d, uint64_t stride) {
  for (uint32_t i = 0; i < d->nfixed; i++)
    if (d->pools[i].stride == stride)
      return i;
  if (d->nfixed == FIXED_MAX)
    return NIL;
  d->pools[d->nfixed] = (pool){.stride = stride, .partial = NIL};
  return d->nfixed++;
}

/* ---- the region ------------------------------------------------------------- */

static int map_region(tier_dram *d, uint64_t bytes, kvp_tier_huge huge) {
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

int kvp__tier_dram_create(uint64_t bytes, kvp_tier_huge huge,
                          const kvp_allocator *a, tier_dram **out) {
  if (bytes < 2 * CHUNK || bytes > (UINT64_C(1) << 46))
    return KVP_ERANGE;
  tier_dram *d = kvp__calloc(a, 1, sizeof *d);
  if (d == NULL)
    return KVP_ENOMEM;
  d->a = kvp__allocator(a);
  int rc = map_region(d, bytes, huge);
  if (rc < 0)
    goto fail_free;
  d->npages = (uint32_t)(d->len / PAGE);
  d->page_used = kvp__calloc(a, d->npages, 1);
  d->page_owner = kvp__calloc(a, d->npages, sizeof *d->page_owner);
  if (d->page_used == NULL || d->page_owner == NULL) {
    rc = KVP_ENOMEM;
    goto fail_maps;
  }
  for (uint32_t c = 0; c < NCLASS; c++)
    d->pools[FIXED_MAX + c] = (pool){.stride = class_stride(c), .partial = NIL};
  d->slab_free = NIL;
  *out = d;
  return 0;
fail_maps:
  kvp__free(a, d->page_owner, d->page_owner ? d->npages * sizeof *d->page_owner : 0);
  kvp__free(a, d->page_used, d->page_used ? d->npages : 0);
  munmap(d->map, d->map_len);
fail_free:
  kvp__free(a, d, sizeof *d);
  return rc;
}

void kvp__tier_dram_destroy(tier_dram *d) {
  if (d == NULL)
    return;
  munmap(d->map, d->map_len);
  kvp__free(&d->a, d->slabs, d->slabs_cap * sizeof *d->slabs);
  kvp__free(&d->a, d->page_owner, d->npages * sizeof *d->page_owner);
  kvp__free(&d->a, d->page_used, d->npages);
  kvp__free(&d->a, d, sizeof *d);
}

void *kvp__tier_dram_alloc(tier_dram *d, size_t len, uint64_t fixed,
                           uint32_t *pool_idx, uint64_t *charged) {
  if (len == 0)
    return NULL;
  uint32_t pi = NIL;
  if (fixed != 0 && len == fixed)
    pi = fixed_pool(d, (len + 63) & ~UINT64_C(63));
  if (pi == NIL && len <= CLASS_MAX)
    pi = FIXED_MAX + class_of(len);
  if (pi != NIL) {
    void *p = pool_alloc(d, pi);
    if (p == NULL)
      return NULL;
    *pool_idx = pi;
    *charged = d->pools[pi].stride;
    if (pi < FIXED_MAX)
      d->slot_bytes += *charged;
    return p;
  }
  /* large: a run of its own pages */
  uint32_t n = pages_of(len);
  uint32_t first = n <= d->npages ? pages_take(d, n) : NIL;
  if (first == NIL)
    return NULL;
  d->page_owner[first] = n;
  *pool_idx = TIER_POOL_RUN;
  *charged = (uint64_t)n * PAGE;
  return d->base + (uint64_t)first * PAGE;
}

void kvp__tier_dram_free(tier_dram *d, void *ptr, uint32_t pool_idx) {
  if (ptr == NULL)
    return;
  if (pool_idx == TIER_POOL_RUN) {
    uint32_t first = (uint32_t)(((uint8_t *)ptr - d->base) / PAGE);
    pages_mark(d, first, d->page_owner[first], 0);
    return;
  }
  assert(d->page_owner[((uint8_t *)ptr - d->base) / PAGE] < d->nslabs &&
         d->slabs[d->page_owner[((uint8_t *)ptr - d->base) / PAGE]].pool == pool_idx);
  if (pool_idx < FIXED_MAX)
    d->slot_bytes -= d->pools[pool_idx].stride;
  pool_free(d, ptr);
}

void kvp__tier_dram_region(const tier_dram *d, void **base, size_t *len) {
  *base = d->base;
  *len = d->len;
}
int kvp__tier_dram_huge(const tier_dram *d) { return d->huge; }
uint64_t kvp__tier_dram_slot_bytes(const tier_dram *d) { return d->slot_bytes; }
