/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: the tables' side of events.  Block updates (one key on its
 * shard, the next keys' buckets prefetched), whole-worker scans (clear,
 * resync), and what each changes of its worker: the digest (the wrapping sum
 * of mix(fp, tier) over its residencies), the residency count, the keys
 * changed and the residencies dropped (kvp__acc).  index_stream.c calls the
 * kvp__index_* entry points with the worker's lock held. */
#include <limits.h>

#include "index_impl.h"

#define PF_DIST 16u /* prefetch this many blocks ahead */

/* Digest change when a worker's mask on fp goes from `from` to `to`. */
uint64_t kvp__dig_delta(uint64_t fp, uint32_t from, uint32_t to) {
  uint64_t d = 0;
  for (uint32_t x = from ^ to; x != 0; x &= x - 1) { /* the tiers that moved */
    unsigned t = (unsigned)__builtin_ctz(x);
    uint64_t m = dig_mix(fp, t);
    d += (to >> t) & 1 ? m : 0 - m;
  }
  return d;
}

/* ---- block updates ------------------------------------------------------- */

typedef kvp__acc acc; /* an event's effect on its worker */

/* Publishes holder word np in place of p at slot s. */
static void slot_replace(kvp_index *ix, shard *sh, ktab *t, kslot *s,
                         uint64_t p, uint64_t np) {
  if (np == p)
    return;
  if (np == 0) {
    kvp__slot_kill(t, s);
    atomic_store_explicit(&sh->keys, t->live, memory_order_relaxed);
  } else {
    slot_set(s, np);
  }
  if (is_wset(p) && (uint64_t)(uintptr_t)p != np) {
    wset *ws = (wset *)(uintptr_t)p;
    kvp__ebr_retire(&ix->ebr, ws, wset_size(ws->cap));
  }
}

static void acc_note(acc *a, uint64_t fp, const upd *u) {
  if (u->old_mask == u->new_mask)
    return;
  a->digest += kvp__dig_delta(fp, u->old_mask, u->new_mask);
  a->nres += (u->new_mask != 0) - (u->old_mask != 0);
  a->changed++;
  a->dropped += (uint64_t)__builtin_popcount(u->old_mask & ~u->new_mask);
}

/* One key's update on its shard (locked by the caller). */
static int shard_update(kvp_index *ix, shard *sh, uint64_t fp, uint64_t h,
                        upd *u, acc *a) {
  ktab *t = atomic_load_explicit(&sh->tab, memory_order_relaxed);
  kslot *ins = NULL, *s = kvp__tab_find(t, fp, h, &ins);
  uint64_t np;
  if (s == NULL) {
    if (u->add == 0)
      return 0;
    (void)kvp__inl_update(ix, 0, u, &np); /* never allocates from empty */
    if (np == 0)
      return 0;
    ktab *before = t;
    int rc = kvp__tab_reserve(ix, &sh->tab, sh, &t);
    if (rc < 0)
      return rc;
    if (t != before) /* rebuilt: find the slot again */
      (void)kvp__tab_find(t, fp, h, &ins);
    slot_claim(t, ins, fp, np);
    atomic_store_explicit(&sh->keys, t->live, memory_order_relaxed);
    seen_note(ix, fp); /* a key made resident: ever seen */
    acc_note(a, fp, u);
    return 0;
  }
  uint64_t p = atomic_load_explicit(&s->val, memory_order_relaxed);
  int rc = set_update(ix, p, u, &np);
  if (rc < 0)
    return rc;
  slot_replace(ix, sh, t, s, p, np);
  acc_note(a, fp, u);
  return 0;
}

static int key_update_h(kvp_index *ix, uint64_t fp, uint64_t h, upd *u,
                        acc *a) {
  shard *sh = shard_of(ix, h);
  kvp__spin_lock(&sh->lock);
  int rc = shard_update(ix, sh, fp, h, u, a);
  kvp__spin_unlock(&sh->lock);
  return rc;
}

static int key_update(kvp_index *ix, uint64_t fp, upd *u, acc *a) {
  return key_update_h(ix, fp, mix64(fp), u, a);
}

/* Prefetches fp's bucket pair for writing; returns fp's hash. */
static uint64_t prefetch_key(kvp_index *ix, uint64_t fp) {
  uint64_t h = mix64(fp);
  shard *sh = shard_of(ix, h);
  kslot *s = atomic_load_explicit(&sh->pf_slots, memory_order_relaxed);
  uint64_t nb = atomic_load_explicit(&sh->pf_nbuckets, memory_order_relaxed);
  kslot *b = s + bucket_of(h, nb) * BUCKET_SLOTS;
  __builtin_prefetch(b, 1, 3);
  if (!atomic_load_explicit(&sh->pf_one, memory_order_relaxed))
    __builtin_prefetch(b + BUCKET_SLOTS, 1, 3); /* past the end: harmless */
  return h;
}

int kvp_index_prefetch(kvp_index *ix, const kvp_key *keys, size_t n) {
  if (ix == NULL || (keys == NULL && n > 0))
    return KVP_EINVAL;
  for (size_t i = 0; i < n; i++)
    (void)prefetch_key(ix, fp_of(keys[i]));
  return 0;
}

/* An event's keys, with the next buckets prefetched while one is updated. */
static int apply_keys(kvp_index *ix, uint32_t w, uint32_t add, uint32_t del,
                      const kvp_key *keys, size_t n, acc *a) {
  uint64_t hs[PF_DIST]; /* the hashes computed for the prefetches */
  for (size_t i = 0; i < n && i < PF_DIST; i++)
    hs[i] = prefetch_key(ix, fp_of(keys[i]));
  for (size_t i = 0; i < n; i++) {
    uint64_t h = hs[i % PF_DIST];
    if (i + PF_DIST < n)
      hs[i % PF_DIST] = prefetch_key(ix, fp_of(keys[i + PF_DIST]));
    upd u = {.worker = w, .add = add, .del = del};
    int rc = key_update_h(ix, fp_of(keys[i]), h, &u, a);
    if (rc < 0)
      return rc;
  }
  return 0;
}

/* Worker w's mask on fp, read under the shard lock. */
static uint32_t resident_mask(kvp_index *ix, uint64_t fp, uint32_t w) {
  uint64_t h = mix64(fp);
  shard *sh = shard_of(ix, h);
  kvp__spin_lock(&sh->lock);
  kslot *s = kvp__tab_find(atomic_load_explicit(&sh->tab, memory_order_relaxed),
                           fp, h, NULL);
  uint32_t m =
      s ? kvp__mask_of(atomic_load_explicit(&s->val, memory_order_relaxed), w)
        : 0;
  kvp__spin_unlock(&sh->lock);
  return m;
}

/* ---- whole-worker scans -------------------------------------------------- */

/* The key set a resync keeps: fp -> tier mask, open addressing. */
typedef struct keepset {
  uint64_t *fp;
  uint8_t *mask;
  size_t cap; /* power of two */
  size_t n;   /* distinct fps */
} keepset;

static uint8_t *keep_slot(const keepset *k, uint64_t fp, bool *found) {
  size_t i = (size_t)mix64(fp) & (k->cap - 1);
  while (k->fp[i] != FP_EMPTY && k->fp[i] != fp)
    i = (i + 1) & (k->cap - 1);
  *found = k->fp[i] == fp;
  return &k->mask[i];
}

static uint32_t keep_get(const keepset *k, uint64_t fp) {
  bool found;
  uint8_t *m = keep_slot(k, fp, &found);
  return found ? *m : 0;
}

static void keep_free(kvp_index *ix, keepset *k) {
  kvp__free(&ix->alloc, k->fp, k->cap * sizeof *k->fp);
  kvp__free(&ix->alloc, k->mask, k->cap);
}

static int keep_build(kvp_index *ix, const kvp_key *keys, const uint8_t *tiers,
                      unsigned dflt, size_t n, keepset *k) {
  memset(k, 0, sizeof *k);
  k->cap = 16;
  while (k->cap < 2 * n)
    k->cap *= 2;
  k->fp = kvp__calloc(&ix->alloc, k->cap, sizeof *k->fp);
  k->mask = kvp__calloc(&ix->alloc, k->cap, 1);
  if (k->fp == NULL || k->mask == NULL) {
    keep_free(ix, k);
    return KVP_ENOMEM;
  }
  for (size_t i = 0; i < n; i++) {
    uint64_t fp = fp_of(keys[i]);
    bool found;
    uint8_t *m = keep_slot(k, fp, &found);
    if (!found) {
      k->fp[m - k->mask] = fp;
      k->n++;
    }
    *m |= (uint8_t)(1u << (tiers ? tiers[i] : dflt));
  }
  return 0;
}

/* Clears worker w's residencies in `tiers` from one shard, except what
 * `keep` lists. */
static void scan_shard(kvp_index *ix, shard *sh, uint32_t w, uint32_t tiers,
                       const keepset *keep, acc *a) {
  kvp__spin_lock(&sh->lock);
  ktab *t = atomic_load_explicit(&sh->tab, memory_order_relaxed);
  for (uint64_t i = 0; i < t->nbuckets * BUCKET_SLOTS; i++) {
    kslot *s = &t->slots[i];
    uint64_t fp = atomic_load_explicit(&s->fp, memory_order_relaxed);
    if (fp <= FP_TOMB)
      continue;
    uint64_t p = atomic_load_explicit(&s->val, memory_order_relaxed);
    uint32_t m = kvp__mask_of(p, w) & tiers;
    uint32_t del = m != 0 && keep != NULL ? m & ~keep_get(keep, fp) : m;
    if (del == 0)
      continue;
    upd u = {.worker = w, .del = del};
    uint64_t np;
    (void)set_update(ix, p, &u, &np); /* removals never allocate */
    slot_replace(ix, sh, t, s, p, np);
    acc_note(a, fp, &u);
  }
  kvp__tab_maybe_shrink(ix, sh);
  kvp__spin_unlock(&sh->lock);
}

void kvp__scan_worker(kvp_index *ix, uint32_t w, uint32_t tiers,
                      const keepset *keep, acc *a) {
  for (unsigned i = 0; i < SHARDS; i++)
    scan_shard(ix, &ix->shards[i], w, tiers, keep, a);
}

/* ---- what index_stream.c calls (index_internal.h) ----------------------- */

int kvp__index_apply(kvp_index *ix, uint32_t w, uint32_t add, uint32_t del,
                     const kvp_key *keys, size_t n, kvp__acc *a) {
  return apply_keys(ix, w, add, del, keys, n, a);
}

bool kvp__index_holds(kvp_index *ix, uint32_t w, kvp_key k) {
  return resident_mask(ix, fp_of(k), w) != 0;
}

void kvp__index_drop(kvp_index *ix, uint32_t w, uint32_t tiers, kvp__acc *a) {
  if (tiers != 0 &&
      atomic_load_explicit(&ix->workers[w].nres, memory_order_relaxed) != 0)
    kvp__scan_worker(ix, w, tiers, NULL, a);
}

int kvp__index_replace(kvp_index *ix, uint32_t w, uint32_t tiers,
                       const kvp_key *keys, const uint8_t *kt, unsigned dflt,
                       size_t n, kvp__acc *a) {
  keepset keep;
  int rc = keep_build(ix, keys, kt, dflt, n, &keep);
  if (rc < 0)
    return rc; /* nothing changed */
  /* new keys first, then the sweep: keys in both sets never disappear */
  for (size_t i = 0; i < n && rc == 0; i++) {
    upd u = {.worker = w, .add = 1u << (kt ? kt[i] : dflt)};
    rc = key_update(ix, fp_of(keys[i]), &u, a);
  }
  if (rc == 0)
    kvp__scan_worker(ix, w, tiers, &keep, a);
  size_t distinct = keep.n;
  keep_free(ix, &keep);
  return rc < 0 ? rc : (int)(distinct > INT_MAX ? INT_MAX : distinct);
}
