/* SPDX-License-Identifier: Apache-2.0 */
/* Eviction policies over caller-chosen ids: LRU and S3-FIFO (small FIFO +
 * main FIFO with 2-bit frequencies + ghost fingerprints), one set of queues
 * per stability class; victims come from the least stable non-empty class.
 * Pure in-memory: no I/O, no clock (kvplane-bench reuses it as is). */
#include <stdbool.h>
#include <string.h>

#include "core_internal.h"
#include "kvtier_place.h"

#define NIL UINT32_MAX
enum { Q_NONE = 0, Q_SMALL = 1, Q_MAIN = 2 };

typedef struct qlist {
  uint32_t head, tail; /* head = newest */
  uint64_t bytes, count;
} qlist;

/* 16 bytes, four to a cache line: an array holds one per id the caller
 * may use, so its size is most of a simulated worker's memory.  Policies
 * that share their array (kvp__tier_policy_share) tell their entries apart
 * by `own`. */
#define TAG_BITS 24u
typedef struct node {
  uint32_t prev, next;
  uint32_t bytes;          /* < 2^32 (kvp__tier_policy_insert) */
  unsigned tag : TAG_BITS; /* ghost tag of the fingerprint (S3-FIFO) */
  unsigned cls : 2, q : 2, freq : 2;
  unsigned own : 2; /* the tracking policy's mark (1..3), while q != 0 */
} node;
_Static_assert(sizeof(node) == 16, "tier_policy node: 16 bytes");
_Static_assert(KVP_CLASS_COUNT_ <= 4, "cls: 2 bits");

/* The entries of one policy, or of up to three that share them. */
typedef struct entries {
  node *v;   /* in the block raw (2 MiB pages: ids_calloc) */
  void *raw;
  uint32_t cap;
  uint8_t refs, marks; /* policies using it; marks handed out */
} entries;

struct tier_policy {
  kvp_allocator a;
  kvp_tier_policy_kind kind;
  entries *e;
  uint32_t span; /* ids this policy grew or reserved to (<= e->cap): sizes
                    its ghost, as its own array's capacity would */
  uint8_t own;   /* this policy's mark in its entries */
  qlist small[KVP_CLASS_COUNT_], main[KVP_CLASS_COUNT_];
  uint64_t bytes, count;
  uint32_t *ghost; /* direct-mapped set of ghost tags + 1 (0 = empty), */
  void *ghost_raw; /* ... in this block (ids_calloc) */
  uint32_t ghost_mask;
};

int kvp_tier_policy_parse(const char *name, kvp_tier_policy_kind *out) {
  if (name == NULL || out == NULL)
    return KVP_EINVAL;
  if (strcmp(name, "s3fifo") == 0)
    *out = KVP_TIER_POLICY_S3FIFO;
  else if (strcmp(name, "lru") == 0)
    *out = KVP_TIER_POLICY_LRU;
  else
    return KVP_EINVAL;
  return 0;
}

const char *kvp_tier_policy_name(kvp_tier_policy_kind kind) {
  switch (kind) {
  case KVP_TIER_POLICY_S3FIFO: return "s3fifo";
  case KVP_TIER_POLICY_LRU: return "lru";
  default: return "unknown";
  }
}

static void qinit(qlist *q) {
  q->head = q->tail = NIL;
  q->bytes = q->count = 0;
}

int kvp__tier_policy_create(kvp_tier_policy_kind kind, const kvp_allocator *alloc,
                            tier_policy **out) {
  if (out == NULL || (unsigned)kind >= KVP_TIER_POLICY_COUNT_)
    return KVP_EINVAL;
  tier_policy *p = kvp__calloc(alloc, 1, sizeof *p);
  if (p == NULL)
    return KVP_ENOMEM;
  p->a = kvp__allocator(alloc);
  p->kind = kind;
  if ((p->e = kvp__calloc(&p->a, 1, sizeof *p->e)) == NULL) {
    kvp__free(&p->a, p, sizeof *p);
    return KVP_ENOMEM;
  }
  p->e->refs = p->e->marks = 1;
  p->own = 1;
  for (int c = 0; c < KVP_CLASS_COUNT_; c++) {
    qinit(&p->small[c]);
    qinit(&p->main[c]);
  }
  *out = p;
  return 0;
}

/* Arrays indexed by id are read at random, a line per operation: from
 * libc's memory, those of 2 MiB or more lie in 2 MiB pages
 * (kvp__huge_calloc).  ids_bytes: what the block of bytes took. */
static size_t ids_bytes(const kvp_allocator *a, size_t bytes) {
  size_t huge = kvp__allocator_libc(a) ? kvp__huge_size(bytes) : 0;
  return huge ? huge : bytes;
}

static void *ids_calloc(const kvp_allocator *a, size_t bytes, void **raw) {
  if (kvp__allocator_libc(a))
    return kvp__huge_calloc(bytes, 1, raw);
  return *raw = kvp__calloc(a, bytes, 1);
}

static void ghost_free(tier_policy *p) {
  if (p->ghost != NULL)
    kvp__free(&p->a, p->ghost_raw,
              ids_bytes(&p->a, ((size_t)p->ghost_mask + 1) * sizeof *p->ghost));
}

static void entries_drop(tier_policy *p) {
  if (--p->e->refs > 0)
    return;
  kvp__free(&p->a, p->e->raw, ids_bytes(&p->a, (size_t)p->e->cap * sizeof(node)));
  kvp__free(&p->a, p->e, sizeof *p->e);
}

void kvp__tier_policy_destroy(tier_policy *p) {
  if (p == NULL)
    return;
  entries_drop(p);
  ghost_free(p);
  kvp__free(&p->a, p, sizeof *p);
}

/* Ids 0..ncap-1 usable (ncap > e->cap); new ones untracked (Q_NONE is 0). */
static int resize(tier_policy *p, uint32_t ncap) {
  entries *e = p->e;
  void *raw;
  node *n = ids_calloc(&p->a, (size_t)ncap * sizeof(node), &raw);
  if (n == NULL)
    return KVP_ENOMEM;
  if (e->v != NULL)
    memcpy(n, e->v, (size_t)e->cap * sizeof(node));
  kvp__free(&p->a, e->raw, ids_bytes(&p->a, (size_t)e->cap * sizeof(node)));
  e->v = n;
  e->raw = raw;
  e->cap = ncap;
  return 0;
}

/* S3-FIFO's ghost holds about as many fingerprints as there are ids. */
static int ghost_fit(tier_policy *p) {
  if (p->kind != KVP_TIER_POLICY_S3FIFO)
    return 0; /* LRU keeps no ghosts */
  uint32_t gsz = 1;
  while (gsz < p->span && gsz < (1u << TAG_BITS))
    gsz *= 2;
  if (p->ghost == NULL || gsz > p->ghost_mask + 1) {
    void *raw;
    uint32_t *g = ids_calloc(&p->a, (size_t)gsz * sizeof *g, &raw);
    if (g == NULL)
      return KVP_ENOMEM;
    ghost_free(p);
    p->ghost = g; /* old ghosts are forgotten: a hint, not state */
    p->ghost_raw = raw;
    p->ghost_mask = gsz - 1;
  }
  return 0;
}

/* Span and entries (when shorter) to ncap, the ghost to fit. */
static int span_to(tier_policy *p, uint32_t ncap) {
  int rc = ncap > p->e->cap ? resize(p, ncap) : 0;
  if (rc < 0)
    return rc;
  p->span = ncap;
  return ghost_fit(p);
}

static int grow(tier_policy *p, uint32_t id) {
  uint32_t ncap = p->span ? p->span : 64;
  while (ncap <= id)
    ncap = ncap > UINT32_MAX / 2 ? UINT32_MAX : ncap * 2;
  return span_to(p, ncap);
}

int kvp__tier_policy_reserve(tier_policy *p, uint32_t ids) {
  if (p == NULL)
    return KVP_EINVAL;
  return ids > p->span ? span_to(p, ids) : 0;
}

int kvp__tier_policy_share(tier_policy *p, tier_policy *with) {
  if (p == NULL || with == NULL || p == with || p->e == with->e ||
      p->count != 0 || p->e->refs != 1 ||
      p->a.alloc != with->a.alloc || p->a.free != with->a.free ||
      p->a.opaque != with->a.opaque) /* one allocator frees the entries */
    return KVP_EINVAL;
  if (with->e->marks == 3)
    return KVP_ERANGE;
  entries_drop(p);
  p->e = with->e;
  p->e->refs++;
  p->own = ++p->e->marks;
  p->span = 0; /* grows as before, now without copies below e->cap */
  return 0;
}

void kvp__tier_policy_prefetch(const tier_policy *p, uint32_t id) {
  if (p != NULL && id < p->e->cap)
    __builtin_prefetch(&p->e->v[id], 1);
}

static bool tracks(const tier_policy *p, uint32_t id) {
  return id < p->e->cap && p->e->v[id].q != Q_NONE &&
         p->e->v[id].own == p->own;
}

static qlist *qof(tier_policy *p, const node *n) {
  return n->q == Q_SMALL ? &p->small[n->cls] : &p->main[n->cls];
}

static void unlink_node(tier_policy *p, uint32_t id) {
  node *n = &p->e->v[id];
  qlist *q = qof(p, n);
  if (n->prev != NIL)
    p->e->v[n->prev].next = n->next;
  else
    q->head = n->next;
  if (n->next != NIL)
    p->e->v[n->next].prev = n->prev;
  else
    q->tail = n->prev;
  q->bytes -= n->bytes;
  q->count--;
}

static void push_head(tier_policy *p, uint32_t id, uint8_t qk) {
  node *n = &p->e->v[id];
  n->q = qk;
  n->own = p->own;
  qlist *q = qof(p, n);
  n->prev = NIL;
  n->next = q->head;
  if (q->head != NIL)
    p->e->v[q->head].prev = id;
  q->head = id;
  if (q->tail == NIL)
    q->tail = id;
  q->bytes += n->bytes;
  q->count++;
}

/* A fingerprint's ghost tag: TAG_BITS of a mix of all its bits.  The
 * ghost slot is tag & ghost_mask and holds tag + 1: a tag that matches a
 * slot by chance sends a block to main instead of small (a hint). */
static uint32_t ghost_tag(uint64_t fp) {
  return (uint32_t)((fp * 0x9E3779B97F4A7C15ull) >> (64 - TAG_BITS));
}

int kvp__tier_policy_insert(tier_policy *p, uint32_t id, uint64_t fp,
                            uint64_t bytes, kvp_class cls) {
  if (p == NULL || id == NIL || (unsigned)cls >= KVP_CLASS_COUNT_ ||
      bytes > UINT32_MAX)
    return KVP_EINVAL;
  if (id >= p->span && grow(p, id) < 0)
    return KVP_ENOMEM;
  node *n = &p->e->v[id];
  if (n->q != Q_NONE) /* here, or in a policy sharing the entries */
    return KVP_EEXIST;
  n->bytes = (uint32_t)bytes;
  n->tag = ghost_tag(fp);
  n->cls = (unsigned)cls;
  n->freq = 0;
  uint8_t q = Q_MAIN;
  if (p->kind == KVP_TIER_POLICY_S3FIFO) {
    uint32_t *g = &p->ghost[n->tag & p->ghost_mask];
    q = *g == n->tag + 1u ? Q_MAIN : Q_SMALL; /* a ghost hit goes to main */
    if (*g == n->tag + 1u)
      *g = 0;
  }
  push_head(p, id, q);
  p->bytes += bytes;
  p->count++;
  return 0;
}

int kvp__tier_policy_touch(tier_policy *p, uint32_t id) {
  if (p == NULL || !tracks(p, id))
    return KVP_ENOENT;
  node *n = &p->e->v[id];
  if (p->kind == KVP_TIER_POLICY_LRU) {
    unlink_node(p, id);
    push_head(p, id, Q_MAIN);
  } else if (n->freq < 3) {
    n->freq++;
  }
  return 0;
}

int kvp__tier_policy_remove(tier_policy *p, uint32_t id, int evicted) {
  if (p == NULL || !tracks(p, id))
    return KVP_ENOENT;
  node *n = &p->e->v[id];
  unlink_node(p, id);
  if (evicted && p->kind == KVP_TIER_POLICY_S3FIFO && n->q == Q_SMALL)
    p->ghost[n->tag & p->ghost_mask] = n->tag + 1u;
  n->q = Q_NONE;
  p->bytes -= n->bytes;
  p->count--;
  return 0;
}

static uint32_t s3fifo_victim(tier_policy *p, int c) {
  qlist *s = &p->small[c], *m = &p->main[c];
  for (;;) {
    uint64_t total = s->bytes + m->bytes;
    if (s->count > 0 && (m->count == 0 || s->bytes * 10 > total)) {
      uint32_t id = s->tail;
      node *n = &p->e->v[id];
      if (n->freq == 0)
        return id;
      unlink_node(p, id); /* accessed while small: promote to main */
      n->freq = 0;
      push_head(p, id, Q_MAIN);
    } else {
      uint32_t id = m->tail;
      node *n = &p->e->v[id];
      if (n->freq == 0)
        return id;
      n->freq--; /* second chance, aged */
      unlink_node(p, id);
      push_head(p, id, Q_MAIN);
    }
  }
}

int kvp__tier_policy_victim(tier_policy *p, uint32_t *id) {
  if (p == NULL || id == NULL)
    return KVP_EINVAL;
  for (int c = 0; c < KVP_CLASS_COUNT_; c++) {
    if (p->small[c].count + p->main[c].count == 0)
      continue;
    *id = p->kind == KVP_TIER_POLICY_LRU ? p->main[c].tail : s3fifo_victim(p, c);
    return 0;
  }
  return KVP_ENOENT;
}

uint32_t kvp__tier_policy_peek(const tier_policy *p, uint32_t after) {
  if (p == NULL || p->kind != KVP_TIER_POLICY_LRU)
    return NIL;
  if (after != NIL)
    return tracks(p, after) ? p->e->v[after].prev : NIL;
  for (int c = 0; c < KVP_CLASS_COUNT_; c++)
    if (p->main[c].count != 0)
      return p->main[c].tail;
  return NIL;
}

uint64_t kvp__tier_policy_bytes(const tier_policy *p) {
  return p ? p->bytes : 0;
}
uint64_t kvp__tier_policy_count(const tier_policy *p) {
  return p ? p->count : 0;
}
