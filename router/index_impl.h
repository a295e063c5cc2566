/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: the locality index's structure, shared by the files that
 * implement it.  Block fingerprint -> holder set of (worker, tier mask), fed
 * by KV events (stored/removed/cleared/resync) or by the router's own routing
 * records; answers longest-prefix queries per worker.  index_stream.c, the
 * tests and the benchmark see index_internal.h only.  Not installed.
 *
 *   index_epoch.c    epoch-based reclamation (index_epoch.h)
 *   index_table.c    the fingerprint table: one shard's open addressing
 *   index_holders.c  holder words and spilled holder sets (wset)
 *   index_update.c   block updates, whole-worker scans, digest bookkeeping
 *   index_approx.c   approximate mode: routing records and their LRU
 *   index_query.c    the query pipeline and bisection
 *   index_api.c      create/destroy, workers, stats, key listing, verify
 *
 * Layout.  64 shards chosen by the key hash, each an open-addressing table
 * of {fingerprint, holder word} slots (index_table.c).  The holder word keeps
 * up to 4 holders inline, 16 bits each (worker id:12, tier mask:4), slot 0
 * first; a key held by <= 4 workers costs nothing more.  A 5th holder spills
 * the set to a `wset`: one word per tier for each group of 64 workers that
 * holds the key (40 bytes, + 16-byte header), so a spilled key costs <= 11
 * more bytes per holder at 5 holders and < 1 at 64.  With 64 workers or
 * fewer every wset has one group: per-tier u64 worker bitmaps, the fast
 * path.  Bytes per (key, worker) residency are therefore ~21 when no key is
 * shared and fall as keys are shared.  A holder word whose low 4 bits are
 * zero and that is not 0 is a wset pointer (16-byte aligned); 0 is "no
 * holder".  Per-worker state is 128 bytes per worker id: a line of digest,
 * counts, lock and flags (queries read some), and in a side array the four
 * stream positions (epoch, sequence number; index_stream.c) only events use.
 * Measured by bench_index at 10M residencies (95% of keys on one worker):
 * 19.7 bytes per residency with 64 workers, 20.2 with 1,024.
 *
 * Invariants.  A live slot's holder word is never 0 (the last holder leaving
 * turns the slot into a tombstone).  Inline slots are packed from slot 0 and
 * hold distinct workers with non-zero masks.  A worker's digest is the
 * wrapping sum of mix(fp, tier) over its residencies and its residency count
 * the number of keys it holds in any tier (kvp__index_verify recomputes both).
 *
 * Concurrency: epoch-based reclamation (EBR, index_epoch.h) for readers,
 * per-shard spinlocks for writers.  A query pins one reader slot for its
 * whole walk, reads tables through atomic pointers with acquire loads and
 * never takes a lock, retries or waits on a writer.  Writers serialize per
 * shard (a key's update locks only its shard) and per worker (its sequence
 * check, digest and counts); they publish every change as one atomic store
 * of a 64-bit word (holder word, fingerprint, table pointer, group count), so
 * a reader sees each block's holder set before or after an update, never
 * torn.  Memory a reader may still hold (a replaced table, a replaced wset,
 * an evicted routing record) is retired and freed two epochs later.  Why not
 * the alternatives: per-shard reader-writer locks make a 2,048-block query
 * take up to 64 shared lock words that every other reader also writes (the
 * readers then contend with each other), and a shard rebuild (milliseconds)
 * would stall them; seqlocks let a hot shard's write stream starve readers
 * (they retry), and a rebuild still needs a reclamation scheme.  The price of
 * EBR: freed memory lags by two epochs, and readers see per-block, not
 * per-event, atomicity.
 * Lock order: worker -> shard -> retire; approx -> retire; worker -> approx.
 * Each shard keeps what readers read (table pointer, geometry) and what
 * writers write (lock, counters) on separate cache lines. */
#ifndef KVP_INDEX_IMPL_H
#define KVP_INDEX_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "core_internal.h"
#include "index_epoch.h"
#include "index_internal.h"

#define SHARDS 64u
#define BUCKET_SLOTS 4u
#define PLANES 21u /* vertical counter bits */
#define NTIERS ((unsigned)KVP_TIER_COUNT_)
#define NCLS (NTIERS + 1u) /* a matched block counts in a tier or */
#define CLS_ROUTED NTIERS  /* ... as routed only */
#define GROUPS_MAX (KVP_WORKERS_MAX / 64u)
#define INLINE_MAX 4u
#define SHRINK_AT 3u /* wset -> inline at <= 3 holders */
#define FP_EMPTY 0u
#define FP_TOMB 1u
#define MIN_BUCKETS 4u
#define APPROX_CHUNK 1024u

_Static_assert(KVP_INDEX_CHAIN_MAX < (1u << PLANES), "counters hold any count");
_Static_assert(KVP_WORKERS_MAX <= 4096u, "inline slots keep 12-bit worker ids");
_Static_assert(_Alignof(max_align_t) >= 16, "wset pointers keep 4 free bits");
_Static_assert(NTIERS == 4u, "inline slots keep a 4-bit tier mask");

enum { W_ABSENT = KVP__W_ABSENT, W_ACTIVE = KVP__W_ACTIVE };
#define ALL_TIERS ((1u << NTIERS) - 1u)

/* ---- structures ---------------------------------------------------------- */

typedef struct kslot {
  _Atomic uint64_t fp;  /* FP_EMPTY, FP_TOMB or a (remapped) fingerprint */
  _Atomic uint64_t val; /* holder word (shards) or head record (approx) */
} kslot;

typedef struct ktab {
  uint64_t nbuckets; /* fixed once the table is published */
  kslot *slots;      /* 64-byte aligned, nbuckets * BUCKET_SLOTS */
  uint64_t live;     /* writer-only (under the owner's lock) */
  uint64_t tomb;     /* writer-only */
  size_t raw_size;   /* this header and the slots are one allocation */
} ktab;

typedef struct wgroup {
  uint64_t gid; /* worker id / 64; written once, before the group is counted */
  _Atomic uint64_t tier[KVP_TIER_COUNT_]; /* bit w%64: worker holds it there */
} wgroup;

typedef struct wset {
  _Atomic uint32_t ngroups; /* groups in use; see wset_add_group */
  uint32_t cap;             /* groups allocated */
  uint32_t nworkers;        /* writer-only: workers with a non-zero mask */
  uint32_t pad_;
  wgroup g[];
} wset;

typedef struct shard { /* two cache lines: what readers read, what writers write
                        */
  _Atomic(ktab *) tab; /* see tab_rebuild */
  /* The table's geometry again, for prefetching without dereferencing a
   * table that a writer (who pins no epoch) may see freed: relaxed, a stale
   * pair only prefetches a useless line. */
  _Atomic(kslot *) pf_slots;
  _Atomic uint64_t pf_nbuckets;
  /* 1 while the table is at most half full (kvp__tab_reserve): a key then
   * nearly always sits in its home bucket, so lookups prefetch and read
   * that one line, not the pair (a second line per key, mostly unused,
   * takes a slot in the core's queue of misses in flight) */
  _Atomic uint32_t pf_one;
  char pad0_[36];
  kvp__spin lock; /* writers of this shard */
  uint32_t pad1_;
  _Atomic uint64_t keys; /* live keys, for stats (relaxed) */
  char pad1b_[48];
} shard;
_Static_assert(sizeof(shard) == 128, "shard: one line read, one written");

typedef kvp__worker worker; /* index_internal.h: index_stream.c uses it */

typedef struct arec {     /* a routing record: key routed to worker at touch */
  _Atomic uint64_t touch; /* caller's ns of the latest routing (relaxed) */
  _Atomic uint32_t next;  /* next record of the same key, 0 = end */
  uint32_t worker;        /* written before the record is linked */
  uint64_t fp;            /* writer-only from here on */
  uint32_t lru_prev, lru_next; /* lru_next also links the free list */
  /* a pending record's own lifetime in microseconds (record_pending), 0 =
   * a routed record's (the index TTL); relaxed, read beside touch */
  _Atomic uint32_t life_us;
  uint32_t pad_;
} arec;

typedef struct aretired {
  uint32_t idx;
  uint64_t epoch;
} aretired;

typedef struct counters {
  _Atomic uint64_t ev[KVP__C_COUNT_]; /* events: indexed by kvp__ctr */
  _Atomic uint64_t expired, evicted, closure;
} counters;

struct kvp_index {
  kvp_allocator alloc;
  bool default_alloc;
  bool fast;   /* max_workers <= 64: one worker group */
  bool closed; /* opts.prefix_closed: fast-path queries bisect */
  uint32_t max_workers;
  shard *shards;        /* SHARDS, line-aligned inside shards_raw */
  worker *workers;      /* max_workers, line-aligned inside workers_raw */
  kvp__stream *streams; /* KVP_INDEX_STREAMS per worker id */
  void *shards_raw, *workers_raw, *streams_raw;
  kvp__ebr ebr; /* reader slots and retired memory */
  _Atomic uint64_t bytes;
  counters c;

  /* approximate mode: fp -> list of routing records; LRU over records */
  kvp__spin alock;
  _Atomic(ktab *) atab;    /* see tab_rebuild */
  _Atomic uint64_t acount; /* linked records (relaxed) */
  uint64_t acap;
  /* relaxed: a value alone; a query racing kvp_index_set_approx_ttl uses
   * the old TTL or the new one */
  _Atomic uint64_t attl;
  _Atomic(arec *) *adir; /* record chunks; see arec_at */
  uint32_t adir_n, aused, afree, lru_head, lru_tail;
  bool arec_pf; /* record() prefetches keys ahead (off: benchmark baseline) */
  aretired *aret;
  size_t aret_n, aret_cap;

  /* every key ever resident or routed to (a Bloom filter of 2 probes: bits
   * set relaxed, never cleared): kvp_index_seen_prefix */
  _Atomic uint64_t *seen;
  uint64_t seen_bits; /* a power of two */
};

/* A change to one worker's mask on one key (index_holders.c). */
typedef struct upd {
  uint32_t worker;
  uint32_t add, del;           /* tier masks to set and to clear */
  uint32_t old_mask, new_mask; /* out: the worker's mask before/after */
} upd;

/* ---- small helpers ------------------------------------------------------- */

static inline uint64_t mix64(uint64_t x) { /* murmur3 fmix64 */
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

/* The filter's two bits for fp. */
static inline void seen_bits_of(const kvp_index *ix, uint64_t fp,
                                uint64_t b[2]) {
  uint64_t h = mix64(fp ^ 0x5EE45EE45EE45EE4ull), m = ix->seen_bits - 1;
  b[0] = h & m;
  b[1] = (h >> 32 | h << 32) * 0x9E3779B97F4A7C15ull & m;
}

static inline void seen_note(kvp_index *ix, uint64_t fp) {
  if (ix->seen == NULL)
    return;
  uint64_t b[2];
  seen_bits_of(ix, fp, b);
  for (int i = 0; i < 2; i++) {
    _Atomic uint64_t *w = &ix->seen[b[i] >> 6];
    uint64_t bit = 1ull << (b[i] & 63);
    /* relaxed: a hint for the ledger, ordered with nothing */
    if (!(atomic_load_explicit(w, memory_order_relaxed) & bit))
      atomic_fetch_or_explicit(w, bit, memory_order_relaxed);
  }
}

/* 0 and 1 mark empty and dead slots, so they alias 2 and 3. */
static inline uint64_t fp_of(kvp_key k) {
  return k.lo > FP_TOMB ? k.lo : k.lo + 2;
}

static inline uint64_t dig_mix(uint64_t fp, unsigned tier) {
  return mix64(fp ^ (0x9E3779B97F4A7C15ull * (tier + 1u)));
}

static inline uint64_t bucket_of(uint64_t h, uint64_t nbuckets) {
  return (uint64_t)(((unsigned __int128)h * nbuckets) >> 64);
}

static inline shard *shard_of(kvp_index *ix, uint64_t h) {
  return &ix->shards[h & (SHARDS - 1)]; /* low bits; buckets use high bits */
}

static inline unsigned ctz64(uint64_t x) {
  return (unsigned)__builtin_ctzll(x);
}

static inline bool is_wset(uint64_t p) { return p != 0 && (p & 0xFu) == 0; }

static inline uint16_t in_slot(uint64_t p, unsigned k) {
  return (uint16_t)(p >> (16u * k));
}

static inline void ctr_inc(_Atomic uint64_t *c) {
  atomic_fetch_add_explicit(c, 1, memory_order_relaxed);
}

static inline void *align64(void *p) {
  return (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
}

/* ---- memory: through the index's allocator, counted in stats.bytes ------- */

static inline void *ix_alloc(kvp_index *ix, size_t size) {
  void *p = kvp__malloc(&ix->alloc, size);
  if (p != NULL)
    atomic_fetch_add_explicit(&ix->bytes, size, memory_order_relaxed);
  return p;
}

/* Zeroed: libc's calloc skips the memset for fresh pages, which the kernel
 * zeroed already (tables are the index's bulk). */
static inline void *ix_calloc(kvp_index *ix, size_t size) {
  void *p = kvp__calloc(&ix->alloc, 1, size);
  if (p != NULL)
    atomic_fetch_add_explicit(&ix->bytes, size, memory_order_relaxed);
  return p;
}

static inline void ix_free(kvp_index *ix, void *p, size_t size) {
  if (p == NULL)
    return;
  atomic_fetch_sub_explicit(&ix->bytes, size, memory_order_relaxed);
  kvp__free(&ix->alloc, p, size);
}

/* ---- the fingerprint table (index_table.c) ------------------------------- */

/* Which slots of a bucket hold fp (bit k = slot k), computed without
 * branching on the loaded values: a bucket still on its way from memory then
 * costs no mispredicted branch, which would throw away the loads and
 * prefetches issued after it.  The reader's: acquire loads. */
static inline unsigned scan_hits(kslot *s, uint64_t fp) {
  /* acquire: pairs with the release of fp in slot_claim */
  uint64_t f0 = atomic_load_explicit(&s[0].fp, memory_order_acquire);
  uint64_t f1 = atomic_load_explicit(&s[1].fp, memory_order_acquire);
  uint64_t f2 = atomic_load_explicit(&s[2].fp, memory_order_acquire);
  uint64_t f3 = atomic_load_explicit(&s[3].fp, memory_order_acquire);
  return (unsigned)(f0 == fp) | (unsigned)(f1 == fp) << 1 |
         (unsigned)(f2 == fp) << 2 | (unsigned)(f3 == fp) << 3;
}

/* Reader lookup past fp's home bucket; 0 when absent. */
uint64_t kvp__tab_get_slow(ktab *t, uint64_t fp, uint64_t h);
/* Reader lookup that goes on from bucket `from` (where tab_get_near stopped);
 * 0 when absent.  A slot recycled under it restarts from the home bucket. */
uint64_t kvp__tab_get_from(ktab *t, uint64_t fp, uint64_t h, uint64_t from);

/* Slot x's holder word for fp, which scan_hits found there.  Acquire: pairs
 * with the releases of val in slot_set/kvp__slot_kill; re-reading fp rejects
 * a value of a key that took the slot meanwhile (then the slow path). */
static inline uint64_t slot_read(ktab *t, kslot *x, uint64_t fp, uint64_t h) {
  uint64_t v = atomic_load_explicit(&x->val, memory_order_acquire);
  if (KVP_LIKELY(atomic_load_explicit(&x->fp, memory_order_relaxed) == fp))
    return v;
  return kvp__tab_get_slow(t, fp, h);
}

/* Reader lookup: fp's holder word, 0 when absent.  Inline for the common
 * case, a key found in its home bucket (three times in four). */
static inline uint64_t tab_get(ktab *t, uint64_t fp, uint64_t h) {
  kslot *s = &t->slots[bucket_of(h, t->nbuckets) * BUCKET_SLOTS];
  unsigned hit = scan_hits(s, fp);
  if (KVP_LIKELY(hit != 0))
    return slot_read(t, &s[ctz64(hit)], fp, h);
  return kvp__tab_get_slow(t, fp, h);
}

/* The bucket after b, wrapping. */
static inline uint64_t bucket_next(uint64_t b, uint64_t nbuckets) {
  return b + 1 == nbuckets ? 0 : b + 1;
}

/* Reader lookup within fp's bucket pair (pair: the home bucket and the
 * next, which the query prefetches together: a key sits there 96-98 times
 * in 100 at the loads of a grown table) or its home bucket alone (!pair: a
 * table at most half full, shard.pf_one).  Scanned without branching on
 * their contents, so a key in the second bucket costs no mispredicted
 * branch.  Returns fp's holder word with *more = 0 (0: absent), or 0 with
 * *more = 1 + the bucket where the probe goes on, when those buckets are
 * full and do not hold fp: the caller prefetches it and finishes with
 * kvp__tab_get_from. */
static inline uint64_t tab_get_near(ktab *t, uint64_t fp, uint64_t h,
                                    bool pair, uint64_t *more) {
  uint64_t nb = t->nbuckets, b = bucket_of(h, nb), last = b;
  kslot *s = &t->slots[b * BUCKET_SLOTS], *s2 = s;
  if (pair) {
    last = bucket_next(b, nb);
    s2 = &t->slots[last * BUCKET_SLOTS];
  }
  unsigned hit = scan_hits(s, fp);
  if (pair)
    hit |= scan_hits(s2, fp) << BUCKET_SLOTS;
  *more = 0;
  if (KVP_LIKELY(hit != 0)) {
    unsigned k = ctz64(hit);
    return slot_read(t, k < BUCKET_SLOTS ? &s[k] : &s2[k - BUCKET_SLOTS], fp,
                     h);
  }
  if ((scan_hits(s, FP_EMPTY) | scan_hits(s2, FP_EMPTY)) != 0)
    return 0; /* no key lies past an empty slot on its path */
  *more = 1 + bucket_next(last, nb);
  return 0;
}

static inline void slot_set(kslot *s, uint64_t val) {
  /* release: pairs with the acquire of val in tab_get/probe_once */
  atomic_store_explicit(&s->val, val, memory_order_release);
}

/* Publishes a new key: holder word first, then the fingerprint. */
static inline void slot_claim(ktab *t, kslot *s, uint64_t fp, uint64_t val) {
  if (atomic_load_explicit(&s->fp, memory_order_relaxed) == FP_TOMB)
    t->tomb--;
  t->live++;
  slot_set(s, val);
  /* release: pairs with the acquire of fp in scan_hits */
  atomic_store_explicit(&s->fp, fp, memory_order_release);
}

/* A table of nbuckets empty buckets; NULL when out of memory. */
ktab *kvp__tab_new(kvp_index *ix, uint64_t nbuckets);
/* Buckets for `live` keys at the load a rebuild leaves (5/8). */
uint64_t kvp__tab_buckets_for(uint64_t live);
/* Writer lookup (caller holds the table's lock): fp's slot or NULL, and in
 * *ins (unless NULL) the first reusable slot of its probe path. */
kslot *kvp__tab_find(ktab *t, uint64_t fp, uint64_t h, kslot **ins);
/* A key leaves its slot (the holder word becomes 0). */
void kvp__slot_kill(ktab *t, kslot *s);
/* Makes room for one more key in *where's table (rebuilding it, the old one
 * retired); the table in *out.  sh: the shard whose geometry to note, or
 * NULL.  Returns 0 or KVP_ENOMEM. */
int kvp__tab_reserve(kvp_index *ix, _Atomic(ktab *) *where, shard *sh,
                     ktab **out);
/* After deletions: gives memory back when sh's table is mostly empty. */
void kvp__tab_maybe_shrink(kvp_index *ix, shard *sh);
/* Notes t's geometry in sh for prefetching. */
void kvp__geometry_note(shard *sh, const ktab *t);
/* Frees *where's table (none pinned), and its keys' wsets when `sets`. */
void kvp__tab_free(kvp_index *ix, _Atomic(ktab *) *where, bool sets);

/* ---- holder sets (index_holders.c) --------------------------------------- */

static inline size_t wset_size(uint32_t cap) {
  return sizeof(wset) + (size_t)cap * sizeof(wgroup);
}

/* The tiers of the worker at `bit` of group g. */
static inline uint32_t group_mask(wgroup *g, uint64_t bit) {
  uint32_t m = 0;
  for (unsigned t = 0; t < NTIERS; t++)
    if (atomic_load_explicit(&g->tier[t], memory_order_relaxed) & bit)
      m |= 1u << t;
  return m;
}

/* Applies u to an inline holder word p (0: none) or to the set ws; *out is the
 * word to publish (== the old one when the change was made in place or
 * nothing changed).  KVP_ENOMEM leaves everything as it was.  Removals and
 * updates from an empty word never allocate. */
int kvp__inl_update(kvp_index *ix, uint64_t p, upd *u, uint64_t *out);
int kvp__wset_update(kvp_index *ix, wset *ws, upd *u, uint64_t *out);

static inline int set_update(kvp_index *ix, uint64_t p, upd *u, uint64_t *out) {
  if (is_wset(p))
    return kvp__wset_update(ix, (wset *)(uintptr_t)p, u, out);
  return kvp__inl_update(ix, p, u, out);
}

/* Worker w's tier mask in holder word p. */
uint32_t kvp__mask_of(uint64_t p, uint32_t w);

/* ---- block updates and scans (index_update.c) ---------------------------- */

/* Digest change when a worker's mask on fp goes from `from` to `to`. */
uint64_t kvp__dig_delta(uint64_t fp, uint32_t from, uint32_t to);
/* Clears worker w's residencies in `tiers` from every shard, except what
 * keep lists (NULL: nothing kept). */
struct keepset;
void kvp__scan_worker(kvp_index *ix, uint32_t w, uint32_t tiers,
                      const struct keepset *keep, kvp__acc *a);

/* ---- approximate mode (index_approx.c) ----------------------------------- */

static inline arec *arec_at(kvp_index *ix, uint32_t idx) {
  /* acquire: pairs with the release in arec_alloc that published the chunk */
  arec *c = atomic_load_explicit(&ix->adir[(idx - 1) / APPROX_CHUNK],
                                 memory_order_acquire);
  return &c[(idx - 1) % APPROX_CHUNK];
}

/* A record touched at `touch` matches at `now` for its own life (life_us,
 * a pending record's) or else the index TTL, never beyond the TTL. */
static inline bool routed_live(uint64_t touch, uint32_t life_us, uint64_t now,
                               uint64_t ttl) {
  uint64_t life = (uint64_t)life_us * 1000u;
  return now < touch || now - touch < (life_us && life < ttl ? life : ttl);
}

/* The record directory and table for ix->acap records; KVP_ENOMEM. */
int kvp__approx_init(kvp_index *ix);
/* Frees them (no reader pinned); accepts a partly set up ix. */
void kvp__approx_fini(kvp_index *ix);

#endif /* KVP_INDEX_IMPL_H */
