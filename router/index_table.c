/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: the fingerprint table.  One per shard (and one for the
 * routing records): open addressing over 16-byte slots {fingerprint, holder
 * word}, four to a 64-byte bucket, linear probing over buckets; a deleted key
 * leaves a tombstone unless no probe path crosses its slot (see
 * kvp__slot_kill).  A table is rebuilt (x1.4 when growing) when live +
 * tombstones pass 7/8 of its slots, to 5/8, so the load stays in
 * [0.625, 0.875]: ~21 bytes per key.  Tables of 2 MiB or more lie in 2 MiB
 * pages (libc allocator only: kvp__huge_place, which also turns pages
 * malloc faulted in before into huge ones).  Readers probe with acquire
 * loads (tab_get in index_impl.h); writers hold the owner's lock and publish
 * a replaced table by one release store, the old one retired. */
#include "index_impl.h"

ktab *kvp__tab_new(kvp_index *ix, uint64_t nbuckets) {
  size_t bytes, size;
  if (!kvp__mul_ok(nbuckets, BUCKET_SLOTS * sizeof(kslot), &bytes) ||
      __builtin_add_overflow(bytes, sizeof(ktab) + 63, &size))
    return NULL;
  /* big tables in 2 MiB pages (kvp__huge_place), from libc's memory only */
  size_t huge = ix->default_alloc ? kvp__huge_size(bytes) : 0;
  if (huge != 0 && __builtin_add_overflow(huge, sizeof(ktab), &size))
    return NULL;
  ktab *t = huge ? ix_alloc(ix, size) : ix_calloc(ix, size);
  if (t == NULL)
    return NULL;
  t->nbuckets = nbuckets;
  /* zeroed either way: FP_EMPTY, holder 0 */
  t->slots = huge ? kvp__huge_place(t + 1, bytes) : align64(t + 1);
  t->live = t->tomb = 0;
  t->raw_size = size;
  return t;
}

uint64_t kvp__tab_buckets_for(uint64_t live) {
  uint64_t slots = live + live / 2 + live / 10 + 1; /* live / 0.625 */
  uint64_t b = (slots + BUCKET_SLOTS - 1) / BUCKET_SLOTS;
  return b < MIN_BUCKETS ? MIN_BUCKETS : b;
}

static inline bool tab_full(const ktab *t, uint64_t adding) {
  return (t->live + t->tomb + adding) * 8 > t->nbuckets * BUCKET_SLOTS * 7;
}

/* Which slots of a bucket hold fp, are free (empty or dead), are empty
 * (bit k = slot k), computed without branching on the loaded values: a
 * bucket still on its way from memory then costs no mispredicted branch,
 * which would throw away the loads and prefetches issued after it.  No key
 * sits after an empty slot on its probe path (kvp__slot_kill empties only slots
 * no path crosses), so a hit is valid wherever the empty slots are. */
typedef struct bmask {
  unsigned hit, free, empty; /* free: empty or dead */
} bmask;

static inline bmask bucket_scan(kslot *s, uint64_t fp, memory_order mo) {
  _Static_assert(BUCKET_SLOTS == 4, "unrolled for four slots");
  uint64_t f0 = atomic_load_explicit(&s[0].fp, mo);
  uint64_t f1 = atomic_load_explicit(&s[1].fp, mo);
  uint64_t f2 = atomic_load_explicit(&s[2].fp, mo);
  uint64_t f3 = atomic_load_explicit(&s[3].fp, mo);
  bmask m;
  m.hit = (unsigned)(f0 == fp) | (unsigned)(f1 == fp) << 1 |
          (unsigned)(f2 == fp) << 2 | (unsigned)(f3 == fp) << 3;
  m.free = (unsigned)(f0 <= FP_TOMB) | (unsigned)(f1 <= FP_TOMB) << 1 |
           (unsigned)(f2 <= FP_TOMB) << 2 | (unsigned)(f3 <= FP_TOMB) << 3;
  m.empty = (unsigned)(f0 == FP_EMPTY) | (unsigned)(f1 == FP_EMPTY) << 1 |
            (unsigned)(f2 == FP_EMPTY) << 2 | (unsigned)(f3 == FP_EMPTY) << 3;
  return m;
}

/* scan_hits (index_impl.h) for writers: their own stores need no ordering. */
static inline unsigned scan_hits_relaxed(kslot *s, uint64_t fp) {
  uint64_t f0 = atomic_load_explicit(&s[0].fp, memory_order_relaxed);
  uint64_t f1 = atomic_load_explicit(&s[1].fp, memory_order_relaxed);
  uint64_t f2 = atomic_load_explicit(&s[2].fp, memory_order_relaxed);
  uint64_t f3 = atomic_load_explicit(&s[3].fp, memory_order_relaxed);
  return (unsigned)(f0 == fp) | (unsigned)(f1 == fp) << 1 |
         (unsigned)(f2 == fp) << 2 | (unsigned)(f3 == fp) << 3;
}

typedef enum { PROBE_MISS, PROBE_HIT, PROBE_RACE } probe_rc;

/* The general probe, from bucket b on, scans two buckets at a time (the
 * query prefetched both): an fp is in the table once, so a hit in either is
 * the key. */
static probe_rc probe_once(ktab *t, uint64_t fp, uint64_t b, uint64_t *val) {
  uint64_t nb = t->nbuckets;
  for (uint64_t n = 0; n < nb; n += 2) {
    uint64_t b2 = b + 1 == nb ? 0 : b + 1;
    kslot *s = &t->slots[b * BUCKET_SLOTS], *s2 = &t->slots[b2 * BUCKET_SLOTS];
    unsigned hit = scan_hits(s, fp) | scan_hits(s2, fp) << BUCKET_SLOTS;
    if (KVP_LIKELY(hit != 0)) {
      unsigned k = ctz64(hit);
      kslot *x = k < BUCKET_SLOTS ? &s[k] : &s2[k - BUCKET_SLOTS];
      /* acquire: pairs with the releases of val in slot_set/kvp__slot_kill;
       * re-reading fp after it rejects a value of a key that took the slot
       * meanwhile */
      *val = atomic_load_explicit(&x->val, memory_order_acquire);
      return atomic_load_explicit(&x->fp, memory_order_relaxed) == fp
                 ? PROBE_HIT
                 : PROBE_RACE;
    }
    if ((scan_hits(s, FP_EMPTY) | scan_hits(s2, FP_EMPTY)) != 0)
      return PROBE_MISS;
    b = b2 + 1 == nb ? 0 : b2 + 1;
  }
  return PROBE_MISS;
}

uint64_t kvp__tab_get_slow(ktab *t, uint64_t fp, uint64_t h) {
  uint64_t v = 0, home = bucket_of(h, t->nbuckets);
  for (unsigned tries = 0; tries < 16; tries++) {
    probe_rc rc = probe_once(t, fp, home, &v);
    if (rc != PROBE_RACE)
      return rc == PROBE_HIT ? v : 0;
  }
  return 0; /* a slot recycled 16 times under us: report a miss (fail open) */
}

uint64_t kvp__tab_get_from(ktab *t, uint64_t fp, uint64_t h, uint64_t from) {
  uint64_t v = 0;
  probe_rc rc = probe_once(t, fp, from, &v);
  if (rc == PROBE_RACE)
    return kvp__tab_get_slow(t, fp, h);
  return rc == PROBE_HIT ? v : 0;
}

/* Writer lookup (caller holds the table's lock): fp's slot or NULL, and in
 * *ins the first reusable slot of its probe path. */
kslot *kvp__tab_find(ktab *t, uint64_t fp, uint64_t h, kslot **ins) {
  uint64_t nb = t->nbuckets, b = bucket_of(h, nb);
  kslot *reuse = NULL;
  for (uint64_t n = 0; n < nb; n++) {
    kslot *s = &t->slots[b * BUCKET_SLOTS];
    unsigned hit = scan_hits_relaxed(s, fp);
    if (hit != 0)
      return &s[ctz64(hit)];
    bmask m = bucket_scan(s, fp, memory_order_relaxed);
    if (reuse == NULL && m.free != 0)
      reuse = &s[ctz64(m.free)]; /* the first one on the path */
    if (m.empty != 0) {
      if (ins != NULL)
        *ins = reuse;
      return NULL;
    }
    if (++b == nb)
      b = 0;
  }
  if (ins != NULL)
    *ins = reuse; /* unreachable while the load stays below 7/8 */
  return NULL;
}

static inline kslot *slot_step(ktab *t, kslot *s, int dir) {
  uint64_t n = t->nbuckets * BUCKET_SLOTS, i = (uint64_t)(s - t->slots);
  return &t->slots[dir > 0 ? (i + 1) % n : (i + n - 1) % n];
}

/* A key leaves.  No key sits past an empty slot on its probe path, so a
 * slot followed by an empty one is on nobody's path: it becomes empty, and
 * so do the dead slots just before it.  Churn then does not fill the table
 * with tombstones (each rebuild to purge them moves the whole shard). */
void kvp__slot_kill(ktab *t, kslot *s) {
  slot_set(s, 0);
  t->live--;
  if (atomic_load_explicit(&slot_step(t, s, 1)->fp, memory_order_relaxed) !=
      FP_EMPTY) {
    /* release: pairs with the acquire of fp in probe_once */
    atomic_store_explicit(&s->fp, FP_TOMB, memory_order_release);
    t->tomb++;
    return;
  }
  /* release (here and below): pairs with the acquire of fp in probe_once */
  atomic_store_explicit(&s->fp, FP_EMPTY, memory_order_release);
  for (kslot *p = slot_step(t, s, -1);
       atomic_load_explicit(&p->fp, memory_order_relaxed) == FP_TOMB;
       p = slot_step(t, p, -1)) {
    atomic_store_explicit(&p->fp, FP_EMPTY, memory_order_release);
    t->tomb--;
  }
}

/* shard.pf_one for t: at most half its slots taken (live or dead). */
static void note_load(shard *sh, const ktab *t) {
  uint32_t one = (t->live + t->tomb) * 2 <= t->nbuckets * BUCKET_SLOTS;
  if (atomic_load_explicit(&sh->pf_one, memory_order_relaxed) != one)
    atomic_store_explicit(&sh->pf_one, one, memory_order_relaxed);
}

void kvp__geometry_note(shard *sh, const ktab *t) {
  if (sh == NULL)
    return;
  atomic_store_explicit(&sh->pf_slots, t->slots, memory_order_relaxed);
  atomic_store_explicit(&sh->pf_nbuckets, t->nbuckets, memory_order_relaxed);
  note_load(sh, t);
}

/* Rebuilds *where's table for `live` keys; the old one is retired. */
static int tab_rebuild(kvp_index *ix, _Atomic(ktab *) *where, shard *sh,
                       uint64_t live) {
  ktab *old = atomic_load_explicit(where, memory_order_relaxed);
  ktab *t = kvp__tab_new(ix, kvp__tab_buckets_for(live));
  if (t == NULL)
    return KVP_ENOMEM;
  for (uint64_t i = 0; i < old->nbuckets * BUCKET_SLOTS; i++) {
    uint64_t f = atomic_load_explicit(&old->slots[i].fp, memory_order_relaxed);
    if (f <= FP_TOMB)
      continue;
    kslot *ins = NULL;
    (void)kvp__tab_find(t, f, mix64(f), &ins);
    atomic_store_explicit(&ins->fp, f, memory_order_relaxed);
    atomic_store_explicit(
        &ins->val,
        atomic_load_explicit(&old->slots[i].val, memory_order_relaxed),
        memory_order_relaxed);
    t->live++;
  }
  /* release: pairs with the acquire loads of the table pointer in queries;
   * the slots above are visible before the table is */
  atomic_store_explicit(where, t, memory_order_release);
  kvp__geometry_note(sh, t);
  kvp__ebr_retire(&ix->ebr, old, old->raw_size);
  return 0;
}

/* Makes room for one more key in *where's table.  Returns the table. */
int kvp__tab_reserve(kvp_index *ix, _Atomic(ktab *) *where, shard *sh,
                     ktab **out) {
  ktab *t = atomic_load_explicit(where, memory_order_relaxed);
  if (tab_full(t, 1)) {
    int rc = tab_rebuild(ix, where, sh, t->live + 1);
    if (rc < 0)
      return rc;
    t = atomic_load_explicit(where, memory_order_relaxed);
  }
  if (sh != NULL)
    note_load(sh, t);
  *out = t;
  return 0;
}

/* After deletions: give memory back when the table is mostly empty. */
void kvp__tab_maybe_shrink(kvp_index *ix, shard *sh) {
  ktab *t = atomic_load_explicit(&sh->tab, memory_order_relaxed);
  uint64_t slots = t->nbuckets * BUCKET_SLOTS;
  if (t->nbuckets > MIN_BUCKETS && t->live * 6 < slots)
    (void)tab_rebuild(ix, &sh->tab, sh, t->live); /* ENOMEM: keep the big one */
}

void kvp__tab_free(kvp_index *ix, _Atomic(ktab *) *where, bool sets) {
  ktab *t = atomic_load_explicit(where, memory_order_relaxed);
  if (t == NULL)
    return;
  for (uint64_t i = 0; sets && i < t->nbuckets * BUCKET_SLOTS; i++) {
    uint64_t p = atomic_load_explicit(&t->slots[i].val, memory_order_relaxed);
    if (atomic_load_explicit(&t->slots[i].fp, memory_order_relaxed) > FP_TOMB &&
        is_wset(p))
      ix_free(ix, (wset *)(uintptr_t)p, wset_size(((wset *)(uintptr_t)p)->cap));
  }
  ix_free(ix, t, t->raw_size);
}
