/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: the public API around the tables: create/destroy, workers
 * (add, remove, get), digests, a worker's keys, stats, and for the tests a
 * consistency check. */
#include <limits.h>

#include "index_impl.h"

#define APPROX_CAP_DEFAULT (1u << 20)
#define APPROX_CAP_MAX (1u << 26)
#define TTL_DEFAULT_NS (120ull * 1000000000ull)

/* Cache-line aligned zeroed array; *raw is what to free (size + 63). */
static void *ix_alloc_lines(kvp_index *ix, size_t size, void **raw) {
  *raw = ix_alloc(ix, size + 63);
  if (*raw == NULL)
    return NULL;
  void *p = align64(*raw);
  memset(p, 0, size);
  return p;
}

/* ---- what index_stream.c reads of the index (index_internal.h) ---------- */

int kvp__index_args(kvp_index *ix, int tier, const kvp_key *keys, size_t n) {
  if (ix == NULL)
    return KVP_EINVAL;
  int rc = 0;
  if (tier < 0 || tier >= (int)NTIERS || (keys == NULL && n > 0))
    rc = KVP_EINVAL;
  else if (n > KVP_INDEX_CHAIN_MAX)
    rc = KVP_ERANGE;
  if (rc < 0)
    ctr_inc(&ix->c.ev[KVP__C_INVALID]);
  return rc;
}

void kvp__index_count(kvp_index *ix, kvp__ctr c, uint64_t n) {
  atomic_fetch_add_explicit(&ix->c.ev[c], n, memory_order_relaxed);
}

kvp__worker *kvp__index_worker(kvp_index *ix, uint32_t w) {
  return w < ix->max_workers ? &ix->workers[w] : NULL;
}

kvp__stream *kvp__index_streams(kvp_index *ix, uint32_t w) {
  return &ix->streams[(size_t)w * KVP_INDEX_STREAMS];
}

/* ---- workers ------------------------------------------------------------ */

int kvp_index_worker_add(kvp_index *ix, uint32_t worker_id) {
  if (ix == NULL)
    return KVP_EINVAL;
  if (worker_id >= ix->max_workers)
    return KVP_ERANGE;
  worker *wk = &ix->workers[worker_id];
  int rc = 0;
  kvp__spin_lock(&wk->lock);
  if (atomic_load_explicit(&wk->state, memory_order_relaxed) == W_ACTIVE) {
    rc = KVP_EEXIST;
  } else { /* a new incarnation: every stream starts afresh */
    memset(kvp__index_streams(ix, worker_id), 0,
           KVP_INDEX_STREAMS * sizeof(kvp__stream));
    memset(wk->smask, 0, sizeof wk->smask);
    atomic_store_explicit(&wk->uncertain, 0, memory_order_relaxed);
    /* release: pairs with the acquire in emit_group */
    atomic_store_explicit(&wk->state, W_ACTIVE, memory_order_release);
  }
  kvp__spin_unlock(&wk->lock);
  return rc;
}

int kvp_index_worker_remove(kvp_index *ix, uint32_t worker_id) {
  if (ix == NULL)
    return KVP_EINVAL;
  if (worker_id >= ix->max_workers)
    return KVP_ERANGE;
  worker *wk = &ix->workers[worker_id];
  kvp__spin_lock(&wk->lock);
  if (atomic_load_explicit(&wk->state, memory_order_relaxed) != W_ACTIVE) {
    kvp__spin_unlock(&wk->lock);
    return KVP_ENOENT;
  }
  /* release: pairs with the acquire in emit_group and record_routed; queries
   * stop reporting the worker before its residencies go */
  atomic_store_explicit(&wk->state, W_ABSENT, memory_order_release);
  kvp__acc a = {0};
  kvp__scan_worker(ix, worker_id, ALL_TIERS, NULL, &a);
  kvp__index_purge_routed(ix, worker_id);
  atomic_store_explicit(&wk->digest, 0, memory_order_relaxed);
  atomic_store_explicit(&wk->nres, 0, memory_order_relaxed);
  kvp__spin_unlock(&wk->lock);
  return 0;
}

/* ---- digests and introspection ------------------------------------------- */

int kvp_index_digest_of(const kvp_key *keys, const uint8_t *tiers, size_t n,
                        uint64_t *digest) {
  if (digest == NULL || (keys == NULL && n > 0))
    return KVP_EINVAL;
  uint64_t d = 0;
  for (size_t i = 0; i < n; i++) {
    unsigned t = tiers ? tiers[i] : KVP_TIER_HBM;
    if (t >= NTIERS)
      return KVP_EINVAL;
    d += dig_mix(fp_of(keys[i]), t);
  }
  *digest = d;
  return 0;
}

int kvp_index_worker_get(kvp_index *ix, uint32_t worker_id,
                         kvp_index_worker_info *out) {
  if (ix == NULL || out == NULL)
    return KVP_EINVAL;
  if (worker_id >= ix->max_workers)
    return KVP_ERANGE;
  worker *wk = &ix->workers[worker_id];
  int rc = 0;
  kvp__spin_lock(&wk->lock);
  if (atomic_load_explicit(&wk->state, memory_order_relaxed) != W_ACTIVE) {
    rc = KVP_ENOENT;
  } else {
    memset(out, 0, sizeof *out);
    out->last_seq = kvp__index_streams(ix, worker_id)[0].last_seq;
    out->digest = atomic_load_explicit(&wk->digest, memory_order_relaxed);
    out->residencies = atomic_load_explicit(&wk->nres, memory_order_relaxed);
    out->uncertain =
        atomic_load_explicit(&wk->uncertain, memory_order_relaxed) != 0;
  }
  kvp__spin_unlock(&wk->lock);
  return rc;
}

int kvp_index_digest(kvp_index *ix, uint32_t worker_id, uint64_t *digest) {
  if (digest == NULL)
    return KVP_EINVAL;
  kvp_index_worker_info info;
  int rc = kvp_index_worker_get(ix, worker_id, &info);
  if (rc == 0)
    *digest = info.digest;
  return rc;
}

/* ---- one worker's keys ----------------------------------------------------
 * kvp_index_worker_keys copies a shard's (fingerprint, mask) pairs of the
 * worker under the shard's lock and calls fn on the copy once the lock is
 * released.  Why not walk lock-free, pinned as queries are: a key removed
 * and stored again during the walk may come back in another slot of the
 * same table and be listed twice, and a reader pinned while fn runs holds
 * back the reclamation of every table and set retired meanwhile.  Why not
 * call fn under the lock: the shard's writers would spin on the caller's
 * code.  The copy is one scan of the shard under its lock, as a
 * worker_remove makes; each key sits in one shard, so it is listed once,
 * with its mask as of that shard's scan. */
typedef struct wkey {
  uint64_t fp;
  uint32_t mask;
} wkey;

typedef struct wkeys {
  wkey *v;
  size_t n, cap;
} wkeys;

/* Copies worker w's pairs of shard sh into b; false when b filled up. */
static bool shard_keys(shard *sh, uint32_t w, wkeys *b) {
  bool fit = true;
  b->n = 0;
  kvp__spin_lock(&sh->lock);
  ktab *t = atomic_load_explicit(&sh->tab, memory_order_relaxed);
  for (uint64_t i = 0; fit && i < t->nbuckets * BUCKET_SLOTS; i++) {
    uint64_t fp = atomic_load_explicit(&t->slots[i].fp, memory_order_relaxed);
    if (fp <= FP_TOMB)
      continue;
    uint32_t m = kvp__mask_of(
        atomic_load_explicit(&t->slots[i].val, memory_order_relaxed), w);
    if (m != 0 && (fit = b->n < b->cap))
      b->v[b->n++] = (wkey){fp, m};
  }
  kvp__spin_unlock(&sh->lock);
  return fit;
}

static int wkeys_grow(kvp_index *ix, wkeys *b, size_t cap) {
  wkey *v = kvp__realloc(&ix->alloc, b->v, b->cap * sizeof *v, cap * sizeof *v);
  if (v == NULL)
    return KVP_ENOMEM;
  b->v = v;
  b->cap = cap;
  return 0;
}

/* Lists shard sh's keys of worker w to fn; grows b until they fit. */
static int shard_walk(kvp_index *ix, shard *sh, uint32_t w, wkeys *b,
                      kvp_index_key_fn fn, void *opaque) {
  int rc;
  while (!shard_keys(sh, w, b))
    if ((rc = wkeys_grow(ix, b, 2 * b->cap)) < 0)
      return rc;
  for (size_t i = 0; i < b->n; i++)
    if ((rc = fn(opaque, b->v[i].fp, b->v[i].mask)) != 0)
      return rc;
  return 0;
}

int kvp_index_worker_keys(kvp_index *ix, uint32_t worker_id,
                          kvp_index_key_fn fn, void *opaque) {
  if (ix == NULL || fn == NULL)
    return KVP_EINVAL;
  if (worker_id >= ix->max_workers)
    return KVP_ERANGE;
  worker *wk = &ix->workers[worker_id];
  /* acquire: pairs with the release in kvp_index_worker_add */
  if (atomic_load_explicit(&wk->state, memory_order_acquire) != W_ACTIVE)
    return KVP_ENOENT;
  /* a shard holds about 1/SHARDS of the worker's keys: room for twice that */
  uint64_t nres = atomic_load_explicit(&wk->nres, memory_order_relaxed);
  wkeys b = {0};
  int rc = wkeys_grow(ix, &b, 64 + 2 * (size_t)(nres / SHARDS));
  for (unsigned i = 0; rc == 0 && i < SHARDS; i++)
    rc = shard_walk(ix, &ix->shards[i], worker_id, &b, fn, opaque);
  kvp__free(&ix->alloc, b.v, b.cap * sizeof *b.v);
  return rc;
}

#define LOAD_(x) atomic_load_explicit(&(x), memory_order_relaxed)

int kvp_index_stats_get(kvp_index *ix, kvp_index_stats *out) {
  if (ix == NULL || out == NULL)
    return KVP_EINVAL;
  memset(out, 0, sizeof *out);
  for (unsigned i = 0; i < SHARDS; i++)
    out->keys += LOAD_(ix->shards[i].keys);
  for (uint32_t w = 0; w < ix->max_workers; w++) {
    worker *wk = &ix->workers[w];
    if (LOAD_(wk->state) != W_ACTIVE)
      continue;
    out->workers++;
    out->uncertain_workers += LOAD_(wk->uncertain) != 0;
    out->residencies += LOAD_(wk->nres);
  }
  for (unsigned i = 0; i < KVP__EBR_SLOTS; i++) {
    out->queries += LOAD_(ix->ebr.slots[i].queries);
    out->query_blocks += LOAD_(ix->ebr.slots[i].blocks);
  }
  out->routed = LOAD_(ix->acount);
  out->bytes = LOAD_(ix->bytes);
  out->events_applied = LOAD_(ix->c.ev[KVP__C_APPLIED]);
  out->events_stale = LOAD_(ix->c.ev[KVP__C_STALE]);
  out->seq_gaps = LOAD_(ix->c.ev[KVP__C_GAPS]);
  out->events_unknown_worker = LOAD_(ix->c.ev[KVP__C_UNKNOWN]);
  out->events_invalid = LOAD_(ix->c.ev[KVP__C_INVALID]);
  out->orphan_stores = LOAD_(ix->c.ev[KVP__C_ORPHAN]);
  out->resyncs = LOAD_(ix->c.ev[KVP__C_RESYNCS]);
  out->routed_expired = LOAD_(ix->c.expired);
  out->routed_evicted = LOAD_(ix->c.evicted);
  out->closure_violations = LOAD_(ix->c.closure);
  out->epochs = LOAD_(ix->c.ev[KVP__C_EPOCHS]);
  out->epoch_drops = LOAD_(ix->c.ev[KVP__C_EPOCH_DROPS]);
  return 0;
}

/* ---- create / destroy ---------------------------------------------------- */

static int opts_check(const kvp_index_opts *o) {
  for (size_t i = 0; i < sizeof o->reserved / sizeof o->reserved[0]; i++)
    if (o->reserved[i] != 0)
      return KVP_EINVAL;
  if (o->max_workers > KVP_WORKERS_MAX || o->approx_capacity > APPROX_CAP_MAX ||
      o->prefix_closed > 1)
    return KVP_ERANGE;
  return 0;
}

static size_t streams_bytes(const kvp_index *ix) {
  return (size_t)ix->max_workers * KVP_INDEX_STREAMS * sizeof(kvp__stream);
}

static int create_tables(kvp_index *ix, uint64_t expected_keys) {
  ix->shards = ix_alloc_lines(ix, SHARDS * sizeof(shard), &ix->shards_raw);
  ix->workers =
      ix_alloc_lines(ix, ix->max_workers * sizeof(worker), &ix->workers_raw);
  ix->streams = ix_alloc_lines(ix, streams_bytes(ix), &ix->streams_raw);
  if (ix->shards == NULL || ix->workers == NULL || ix->streams == NULL ||
      kvp__ebr_init(&ix->ebr, &ix->alloc, &ix->bytes) < 0)
    return KVP_ENOMEM;
  for (unsigned i = 0; i < SHARDS; i++) {
    ktab *t = kvp__tab_new(ix, kvp__tab_buckets_for(expected_keys / SHARDS));
    if (t == NULL)
      return KVP_ENOMEM;
    atomic_store_explicit(&ix->shards[i].tab, t, memory_order_relaxed);
    kvp__geometry_note(&ix->shards[i], t);
  }
  return kvp__approx_init(ix);
}

/* The seen filter: 16 bits per expected key (two probes: ~1.4 % of keys
 * never seen read as seen at that load), 2^23 at least (1 MiB), 2^31 at
 * most (256 MiB). */
static int create_seen(kvp_index *ix, uint64_t expected_keys) {
  uint64_t bits = 1ull << 23;
  while (bits < (1ull << 31) && bits / 16 < expected_keys)
    bits <<= 1;
  ix->seen = ix_calloc(ix, bits / 8);
  if (ix->seen == NULL)
    return KVP_ENOMEM;
  ix->seen_bits = bits;
  return 0;
}

int kvp_index_create(const kvp_index_opts *opts, const kvp_allocator *alloc,
                     kvp_index **out) {
  kvp_index_opts o = {0};
  if (out == NULL)
    return KVP_EINVAL;
  *out = NULL;
  if (opts != NULL)
    o = *opts;
  int rc = opts_check(&o);
  if (rc < 0)
    return rc;
  kvp_allocator a = kvp__allocator(alloc);
  kvp_index *ix = kvp__calloc(&a, 1, sizeof *ix);
  if (ix == NULL)
    return KVP_ENOMEM;
  ix->alloc = a;
  ix->default_alloc = alloc == NULL || alloc->alloc == NULL;
  ix->max_workers = o.max_workers ? o.max_workers : KVP_WORKERS_MAX;
  ix->fast = ix->max_workers <= 64;
  ix->closed = o.prefix_closed != 0;
  ix->arec_pf = true;
  ix->acap = o.approx_capacity ? o.approx_capacity : APPROX_CAP_DEFAULT;
  atomic_init(&ix->attl, o.approx_ttl_ns ? o.approx_ttl_ns : TTL_DEFAULT_NS);
  atomic_store_explicit(&ix->bytes, sizeof *ix, memory_order_relaxed);
  if ((rc = create_tables(ix, o.expected_keys)) < 0 ||
      (rc = create_seen(ix, o.expected_keys)) < 0) {
    kvp_index_destroy(ix);
    return rc;
  }
  *out = ix;
  return 0;
}

/* How many leading keys some worker ever held or was routed to. */
int kvp_index_seen_prefix(kvp_index *ix, const kvp_key *keys, size_t n,
                          size_t *out) {
  if (ix == NULL || out == NULL || (keys == NULL && n > 0))
    return KVP_EINVAL;
  size_t i = 0;
  for (; i < n; i++) {
    uint64_t b[2];
    seen_bits_of(ix, fp_of(keys[i]), b);
    if (!(atomic_load_explicit(&ix->seen[b[0] >> 6], memory_order_relaxed) &
          1ull << (b[0] & 63)) ||
        !(atomic_load_explicit(&ix->seen[b[1] >> 6], memory_order_relaxed) &
          1ull << (b[1] & 63)))
      break;
  }
  *out = i;
  return 0;
}

int kvp_index_set_approx_ttl(kvp_index *ix, uint64_t ttl_ns) {
  if (ix == NULL)
    return KVP_EINVAL;
  /* relaxed: see attl (index_impl.h); the LRU walk in expire stays right
   * under any TTL: records leave in the order they were last routed */
  atomic_store_explicit(&ix->attl, ttl_ns ? ttl_ns : TTL_DEFAULT_NS,
                        memory_order_relaxed);
  return 0;
}

void kvp_index_destroy(kvp_index *ix) {
  if (ix == NULL)
    return;
  for (unsigned i = 0; ix->shards != NULL && i < SHARDS; i++)
    kvp__tab_free(ix, &ix->shards[i].tab, true);
  kvp__approx_fini(ix);
  kvp__ebr_fini(&ix->ebr);
  ix_free(ix, ix->shards_raw, SHARDS * sizeof(shard) + 63);
  ix_free(ix, ix->workers_raw, ix->max_workers * sizeof(worker) + 63);
  ix_free(ix, ix->streams_raw, streams_bytes(ix) + 63);
  if (ix->seen)
    ix_free(ix, (void *)ix->seen, ix->seen_bits / 8);
  kvp_allocator a = ix->alloc;
  kvp__free(&a, ix, sizeof *ix);
}

/* ---- consistency check (tests) ------------------------------------------- */

typedef struct vstate {
  uint64_t *digest, *nres;
  int bad;
} vstate;

static void verify_holder(kvp_index *ix, uint64_t fp, uint32_t w, uint32_t m,
                          vstate *v) {
  if (w >= ix->max_workers || m == 0 || m > 0xFu) {
    v->bad = 1;
    KVP_LOGE("index", "key %016llx: bad holder %u mask %u",
             (unsigned long long)fp, w, m);
    return;
  }
  v->digest[w] += kvp__dig_delta(fp, 0, m);
  v->nres[w]++;
}

static void verify_word(kvp_index *ix, uint64_t fp, uint64_t p, vstate *v) {
  if (p == 0) {
    v->bad = 1;
    KVP_LOGE("index", "live key %016llx without holders",
             (unsigned long long)fp);
    return;
  }
  if (is_wset(p)) {
    wset *ws = (wset *)(uintptr_t)p;
    uint32_t ng = atomic_load_explicit(&ws->ngroups, memory_order_relaxed),
             nw = 0;
    for (uint32_t i = 0; i < ng; i++) {
      uint64_t any = 0;
      for (unsigned t = 0; t < NTIERS; t++)
        any |= atomic_load_explicit(&ws->g[i].tier[t], memory_order_relaxed);
      for (; any != 0; any &= any - 1, nw++) {
        uint32_t w = (uint32_t)(ws->g[i].gid * 64 + ctz64(any));
        verify_holder(ix, fp, w, group_mask(&ws->g[i], 1ull << (w & 63)), v);
      }
    }
    if (ng > ws->cap || nw != ws->nworkers || nw <= SHRINK_AT)
      v->bad = 1, KVP_LOGE("index", "wset: %u groups of %u, %u workers (%u)",
                           ng, ws->cap, nw, ws->nworkers);
    return;
  }
  for (unsigned k = 0; k < INLINE_MAX && (in_slot(p, k) & 0xFu); k++)
    verify_holder(ix, fp, in_slot(p, k) >> 4, in_slot(p, k) & 0xFu, v);
  {
    unsigned n = 0;
    while (n < INLINE_MAX && (in_slot(p, n) & 0xFu))
      n++;
    if (n < INLINE_MAX && (p >> (16u * n)) != 0)
      v->bad = 1, KVP_LOGE("index", "inline slots not packed");
  }
}

uint64_t kvp__index_keys_past(kvp_index *ix, uint64_t buckets) {
  uint64_t n = 0;
  for (unsigned i = 0; i < SHARDS; i++) {
    ktab *t = atomic_load_explicit(&ix->shards[i].tab, memory_order_relaxed);
    for (uint64_t k = 0; k < t->nbuckets * BUCKET_SLOTS; k++) {
      uint64_t fp = atomic_load_explicit(&t->slots[k].fp, memory_order_relaxed);
      if (fp <= FP_TOMB)
        continue;
      uint64_t home = bucket_of(mix64(fp), t->nbuckets), at = k / BUCKET_SLOTS;
      n += (at + t->nbuckets - home) % t->nbuckets >= buckets;
    }
  }
  return n;
}

unsigned kvp__index_home_only_shards(kvp_index *ix) {
  unsigned n = 0;
  for (unsigned i = 0; i < SHARDS; i++)
    n += atomic_load_explicit(&ix->shards[i].pf_one, memory_order_relaxed) != 0;
  return n;
}

int kvp__index_verify(kvp_index *ix) {
  vstate v = {kvp__calloc(NULL, ix->max_workers, 8),
              kvp__calloc(NULL, ix->max_workers, 8), 0};
  if (v.digest == NULL || v.nres == NULL)
    v.bad = 1;
  for (unsigned i = 0; !v.bad && i < SHARDS; i++) {
    shard *sh = &ix->shards[i];
    ktab *t = atomic_load_explicit(&sh->tab, memory_order_relaxed);
    uint64_t live = 0, tomb = 0;
    for (uint64_t k = 0; k < t->nbuckets * BUCKET_SLOTS; k++) {
      uint64_t fp = atomic_load_explicit(&t->slots[k].fp, memory_order_relaxed);
      tomb += fp == FP_TOMB;
      if (fp <= FP_TOMB)
        continue;
      live++;
      verify_word(ix, fp,
                  atomic_load_explicit(&t->slots[k].val, memory_order_relaxed),
                  &v);
    }
    if (live != t->live || live != LOAD_(sh->keys) || tomb != t->tomb)
      v.bad = 1,
      KVP_LOGE("index", "shard %u: %llu keys, counted %llu", i,
               (unsigned long long)live, (unsigned long long)t->live);
  }
  for (uint32_t w = 0; !v.bad && w < ix->max_workers; w++) {
    worker *wk = &ix->workers[w];
    if (LOAD_(wk->digest) != v.digest[w] || LOAD_(wk->nres) != v.nres[w])
      v.bad = 1, KVP_LOGE("index", "worker %u: digest/residencies differ", w);
  }
  uint64_t nlru = 0;
  for (uint32_t idx = ix->lru_head; idx != 0; idx = arec_at(ix, idx)->lru_next)
    nlru++;
  if (nlru != LOAD_(ix->acount))
    v.bad = 1,
    KVP_LOGE("index", "routed records: %llu linked, %llu counted",
             (unsigned long long)nlru, (unsigned long long)LOAD_(ix->acount));
  kvp__free(NULL, v.digest, ix->max_workers * 8);
  kvp__free(NULL, v.nres, ix->max_workers * 8);
  return v.bad ? KVP_ECORRUPT : 0;
}
