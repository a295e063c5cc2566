/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: the locality index.  Block fingerprint -> holder set of
 * (worker, tier mask), fed by KV events (stored/removed/cleared/resync) or by
 * the router's own routing records; answers longest-prefix queries per worker.
 *
 * Layout.  64 shards chosen by the key hash; each is an open-addressing table
 * of 16-byte slots {fingerprint, holder word}, four to a 64-byte bucket,
 * linear probing over buckets; a deleted key leaves a tombstone unless no
 * probe path crosses its slot (see slot_kill).  A table is rebuilt (x1.4
 * when growing) when live + tombstones pass 7/8 of its slots, to 5/8, so
 * the load stays in [0.625, 0.875]: ~21 bytes per key.
 * The holder word keeps up to 4 holders inline, 16 bits each (worker id:12,
 * tier mask:4), slot 0 first; a key held by <= 4 workers costs nothing more.
 * A 5th holder spills the set to a `wset`: one word per tier for each group
 * of 64 workers that holds the key (40 bytes, + 16-byte header), so a spilled
 * key costs <= 11 more bytes per holder at 5 holders and < 1 at 64.  With 64
 * workers or fewer every wset has one group: per-tier u64 worker bitmaps, the
 * fast path.  Bytes per (key, worker) residency are therefore ~21 when no key
 * is shared and fall as keys are shared.  A holder word whose low 4 bits are
 * zero and that is not 0 is a wset pointer (16-byte aligned); 0 is "no
 * holder".  Per-worker state is 128 bytes per worker id: a line of digest,
 * counts, lock and flags (queries read some), and in a side array the four
 * stream positions (epoch, sequence number; index_stream.c) only events use.
 * Measured by bench_index at 10M residencies (95% of keys on one worker):
 * 19.7 bytes per residency with 64 workers, 20.2 with 1,024.  Tables of
 * 2 MiB or more ask for transparent huge pages (libc allocator only).
 *
 * Reads.  A query walks its chain through a software pipeline (see qctx):
 * the bucket pair of block i+24 is prefetched, the holder word of block i+8
 * read and its spilled set prefetched, then block i is folded into per-tier
 * bit-sliced counters of the workers still matching; the walk stops when
 * none is left.  With opts.prefix_closed (one worker group only) a query
 * bisects the chain instead, per (cumulative tier, worker) boundary (see
 * "bisection" below): ~22 probes instead of ~1,000 blocks in bench_index.
 * Probes compare a bucket's four fingerprints without
 * branching on them: a branch on a line still in flight would mispredict and
 * throw the pipeline's later loads away.
 *
 * Invariants.  A live slot's holder word is never 0 (the last holder leaving
 * turns the slot into a tombstone).  Inline slots are packed from slot 0 and
 * hold distinct workers with non-zero masks.  A worker's digest is the
 * wrapping sum of mix(fp, tier) over its residencies and its residency count
 * the number of keys it holds in any tier (kvp__index_verify recomputes both).
 *
 * Concurrency: epoch-based reclamation (EBR) for readers, per-shard spinlocks
 * for writers.  A query pins one of 128 reader slots (a CAS, one load, one
 * store for the whole query), then reads tables through atomic pointers with
 * acquire loads and never takes a lock, retries or waits on a writer.
 * Writers serialize per shard (a key's update locks only its shard) and per
 * worker (its sequence check, digest and counts); they publish every change
 * as one atomic store of a 64-bit word (holder word, fingerprint, table
 * pointer, group count), so a reader sees each block's holder set before or
 * after an update, never torn.  Memory a reader may still hold (a replaced
 * table, a replaced wset, an evicted routing record) is retired with the
 * current epoch and freed only once the epoch has advanced twice, which needs
 * every pinned reader to have re-pinned since.  Why not the alternatives:
 * per-shard reader-writer locks make a 2,048-block query take up to 64 shared
 * lock words that every other reader also writes (the readers then contend
 * with each other), and a shard rebuild (milliseconds) would stall them;
 * seqlocks let a hot shard's write stream starve readers (they retry), and a
 * rebuild still needs a reclamation scheme.  The price of EBR: freed memory
 * lags by two epochs, and readers see per-block, not per-event, atomicity.
 * Lock order: worker -> shard -> retire; approx -> retire; worker -> approx.
 * Each shard keeps what readers read (table pointer, geometry) and what
 * writers write (lock, counters) on separate cache lines.
 *
 * The reader slot protocol (crossbeam's, with seq_cst RMWs instead of fences
 * so ThreadSanitizer follows it): pin = CAS the slot from 0 to the global
 * epoch, then re-read the global epoch until it matches what the slot holds;
 * unpin = store 0 (release).  The epoch advances from g to g+1 only when no
 * pinned slot holds another value than g.  A retirement reads its tag with an
 * acq_rel RMW on the global epoch, after the unlinking store. */
#include <limits.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>

#include "core_internal.h"
#include "index_internal.h"

#define SHARDS 64u
#define BUCKET_SLOTS 4u
#define EBR_SLOTS 128u
#define PLANES 21u /* vertical counter bits */
#define NTIERS ((unsigned)KVP_TIER_COUNT_)
#define NCLS (NTIERS + 1u) /* a matched block counts in a tier or */
#define CLS_ROUTED NTIERS  /* ... as routed only */
#define GROUPS_MAX (KVP_WORKERS_MAX / 64u)
#define INLINE_MAX 4u
#define SHRINK_AT 3u /* wset -> inline at <= 3 holders */
#define PF_DIST 16u  /* writers: prefetch this many blocks ahead */
#define PF_FAR 24u   /* query: prefetch a block's bucket this far ahead, */
#define PF_NEAR 8u   /* ... read its holder word and prefetch its set here */
#define PIPE 32u     /* query pipeline ring (power of two > PF_FAR) */
#define FP_EMPTY 0u
#define FP_TOMB 1u
#define MIN_BUCKETS 4u
#define STACK_GROUPS 4u
#define APPROX_CHUNK 1024u
#define APPROX_CAP_DEFAULT (1u << 20)
#define APPROX_CAP_MAX (1u << 26)
#define APPROX_SPARE (1u << 16)
#define TTL_DEFAULT_NS (120ull * 1000000000ull)
#define RECLAIM_BATCH 32u
#define RECLAIM_BYTES (1u << 20)
#define HUGE_BYTES (2u << 20)

_Static_assert(KVP_INDEX_CHAIN_MAX < (1u << PLANES), "counters hold any count");
_Static_assert(KVP_WORKERS_MAX <= 4096u, "inline slots keep 12-bit worker ids");
_Static_assert(_Alignof(max_align_t) >= 16, "wset pointers keep 4 free bits");
_Static_assert(NTIERS == 4u, "inline slots keep a 4-bit tier mask");

enum { W_ABSENT = KVP__W_ABSENT, W_ACTIVE = KVP__W_ACTIVE };
#define ALL_TIERS ((1u << NTIERS) - 1u)

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
  char pad0_[40];
  kvp__spin lock; /* writers of this shard */
  uint32_t pad1_;
  _Atomic uint64_t keys; /* live keys, for stats (relaxed) */
  char pad1b_[48];
} shard;
_Static_assert(sizeof(shard) == 128, "shard: one line read, one written");

typedef kvp__worker worker; /* index_internal.h: index_stream.c uses it */

typedef struct ebr_slot { /* 64 bytes */
  _Atomic uint64_t epoch; /* 0 = free, else the epoch its reader pinned */
  _Atomic uint64_t queries, blocks; /* stats, kept in the reader's line */
  char pad_[40];
} ebr_slot;

typedef struct retired {
  void *p;
  size_t size;
  uint64_t epoch;
} retired;

typedef struct arec {     /* a routing record: key routed to worker at touch */
  _Atomic uint64_t touch; /* caller's ns of the latest routing (relaxed) */
  _Atomic uint32_t next;  /* next record of the same key, 0 = end */
  uint32_t worker;        /* written before the record is linked */
  uint64_t fp;            /* writer-only from here on */
  uint32_t lru_prev, lru_next; /* lru_next also links the free list */
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
  shard *shards;   /* SHARDS, line-aligned inside shards_raw */
  worker *workers; /* max_workers, line-aligned inside workers_raw */
  kvp__stream *streams; /* KVP_INDEX_STREAMS per worker id */
  ebr_slot *slots;      /* EBR_SLOTS, line-aligned inside slots_raw */
  void *shards_raw, *workers_raw, *streams_raw, *slots_raw;
  _Atomic uint64_t epoch; /* global epoch, starts at 1 */
  _Atomic uint64_t bytes;
  counters c;

  kvp__spin retire_lock; /* retired memory, freed two epochs later */
  retired *rl;
  size_t rl_n, rl_cap, rl_bytes;

  /* approximate mode: fp -> list of routing records; LRU over records */
  kvp__spin alock;
  _Atomic(ktab *) atab;    /* see tab_rebuild */
  _Atomic uint64_t acount; /* linked records (relaxed) */
  uint64_t acap, attl;
  _Atomic(arec *) *adir; /* record chunks; see arec_at */
  uint32_t adir_n, aused, afree, lru_head, lru_tail;
  aretired *aret;
  size_t aret_n, aret_cap;
};

/* ---- small helpers ------------------------------------------------------- */

static inline uint64_t mix64(uint64_t x) { /* murmur3 fmix64 */
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return x ^ (x >> 33);
}

/* 0 and 1 mark empty and dead slots, so they alias 2 and 3. */
static inline uint64_t fp_of(kvp_key k) {
  return k.lo > FP_TOMB ? k.lo : k.lo + 2;
}

static inline uint64_t dig_mix(uint64_t fp, unsigned tier) {
  return mix64(fp ^ (0x9E3779B97F4A7C15ull * (tier + 1u)));
}

/* Digest change when a worker's mask on fp goes from `from` to `to`. */
static uint64_t dig_delta(uint64_t fp, uint32_t from, uint32_t to) {
  uint64_t d = 0;
  for (uint32_t x = from ^ to; x != 0; x &= x - 1) { /* the tiers that moved */
    unsigned t = (unsigned)__builtin_ctz(x);
    uint64_t m = dig_mix(fp, t);
    d += (to >> t) & 1 ? m : 0 - m;
  }
  return d;
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

static void ctr_inc(_Atomic uint64_t *c) {
  atomic_fetch_add_explicit(c, 1, memory_order_relaxed);
}

/* ---- memory -------------------------------------------------------------- */

static void *ix_alloc(kvp_index *ix, size_t size) {
  void *p = kvp__malloc(&ix->alloc, size);
  if (p != NULL)
    atomic_fetch_add_explicit(&ix->bytes, size, memory_order_relaxed);
  return p;
}

/* Zeroed: libc's calloc skips the memset for fresh pages, which the kernel
 * zeroed already (tables are the index's bulk). */
static void *ix_calloc(kvp_index *ix, size_t size) {
  void *p = kvp__calloc(&ix->alloc, 1, size);
  if (p != NULL)
    atomic_fetch_add_explicit(&ix->bytes, size, memory_order_relaxed);
  return p;
}

static void ix_free(kvp_index *ix, void *p, size_t size) {
  if (p == NULL)
    return;
  atomic_fetch_sub_explicit(&ix->bytes, size, memory_order_relaxed);
  kvp__free(&ix->alloc, p, size);
}

static inline void *align64(void *p) {
  return (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
}

/* Cache-line aligned zeroed array; *raw is what to free (size + 63). */
static void *ix_alloc_lines(kvp_index *ix, size_t size, void **raw) {
  *raw = ix_alloc(ix, size + 63);
  if (*raw == NULL)
    return NULL;
  void *p = align64(*raw);
  memset(p, 0, size);
  return p;
}

/* Big tables are read at random: 2 MiB pages spare most TLB misses.  Only
 * for libc's memory, whose large blocks are private anonymous mappings. */
static void advise_huge(const kvp_index *ix, void *p, size_t size) {
#ifdef MADV_HUGEPAGE
  if (!ix->default_alloc || size < (size_t)HUGE_BYTES)
    return;
  uintptr_t a = ((uintptr_t)p + HUGE_BYTES - 1) & ~(uintptr_t)(HUGE_BYTES - 1);
  uintptr_t e = ((uintptr_t)p + size) & ~(uintptr_t)(HUGE_BYTES - 1);
  if (e > a)
    (void)madvise((void *)a, e - a, MADV_HUGEPAGE);
#else
  (void)ix, (void)p, (void)size;
#endif
}

/* ---- epochs -------------------------------------------------------------- */

static atomic_uint ebr_thread_seq;
static _Thread_local unsigned ebr_hint = UINT_MAX;

static unsigned ebr_pin(kvp_index *ix) {
  if (ebr_hint == UINT_MAX)
    ebr_hint =
        atomic_fetch_add_explicit(&ebr_thread_seq, 1, memory_order_relaxed) %
        EBR_SLOTS;
  for (;;) {
    for (unsigned k = 0; k < EBR_SLOTS; k++) {
      unsigned i = (ebr_hint + k) % EBR_SLOTS;
      _Atomic uint64_t *slot = &ix->slots[i].epoch;
      uint64_t e = atomic_load_explicit(&ix->epoch, memory_order_relaxed);
      uint64_t free_ = 0;
      /* seq_cst CAS: pairs with the slot loads of ebr_advance; it continues
       * the release sequence of the unpin store that freed the slot */
      if (atomic_load_explicit(slot, memory_order_relaxed) != 0 ||
          !atomic_compare_exchange_strong_explicit(
              slot, &free_, e, memory_order_seq_cst, memory_order_relaxed))
        continue;
      /* seq_cst: ordered with ebr_advance's slot scan and epoch CAS */
      for (uint64_t g;
           (g = atomic_load_explicit(&ix->epoch, memory_order_seq_cst)) != e;)
        e = g, (void)atomic_exchange_explicit(slot, e, memory_order_seq_cst);
      ebr_hint = i;
      return i;
    }
    sched_yield(); /* more than EBR_SLOTS readers at once */
  }
}

static void ebr_unpin(kvp_index *ix, unsigned i) {
  /* release: pairs with the seq_cst slot loads in ebr_advance, so every read
   * of this query happens before whatever that writer then frees */
  atomic_store_explicit(&ix->slots[i].epoch, 0, memory_order_release);
}

/* Moves the global epoch on if every pinned reader has seen it. */
static void ebr_advance(kvp_index *ix) {
  /* seq_cst: pairs with the pin's re-read of the epoch */
  uint64_t g = atomic_load_explicit(&ix->epoch, memory_order_seq_cst);
  for (unsigned i = 0; i < EBR_SLOTS; i++) {
    /* seq_cst: pairs with the pin CAS/exchange and the unpin release */
    uint64_t e =
        atomic_load_explicit(&ix->slots[i].epoch, memory_order_seq_cst);
    if (e != 0 && e != g)
      return;
  }
  /* seq_cst (a release): pairs with the acquire in ebr_safe and with the
   * pin's seq_cst re-read of the epoch */
  atomic_compare_exchange_strong_explicit(
      &ix->epoch, &g, g + 1, memory_order_seq_cst, memory_order_relaxed);
}

/* The epoch a retirement is tagged with.  An RMW (acq_rel) so that the epoch
 * CASes after it continue its release sequence: a reader that pins a later
 * epoch also sees the unlinking store made before this call. */
static uint64_t ebr_tag(kvp_index *ix) {
  return atomic_fetch_add_explicit(&ix->epoch, 0, memory_order_acq_rel);
}

static bool ebr_safe(kvp_index *ix, uint64_t tag) {
  /* acquire: pairs with the epoch CAS of ebr_advance (its slot scan saw every
   * reader of the retired memory unpinned) */
  return atomic_load_explicit(&ix->epoch, memory_order_acquire) >= tag + 2;
}

/* Waits until nothing retired at `tag` can still be read. */
static void ebr_wait(kvp_index *ix, uint64_t tag) {
  while (!ebr_safe(ix, tag)) {
    ebr_advance(ix);
    if (!ebr_safe(ix, tag))
      sched_yield();
  }
}

static void reclaim_locked(kvp_index *ix) {
  ebr_advance(ix);
  size_t k = 0;
  for (size_t i = 0; i < ix->rl_n; i++) {
    retired r = ix->rl[i];
    if (ebr_safe(ix, r.epoch)) {
      ix->rl_bytes -= r.size;
      ix_free(ix, r.p, r.size);
    } else {
      ix->rl[k++] = r;
    }
  }
  ix->rl_n = k;
}

/* Frees p (size bytes) once no reader can hold it.  Call after the store
 * that made it unreachable. */
static void retire(kvp_index *ix, void *p, size_t size) {
  uint64_t tag = ebr_tag(ix);
  kvp__spin_lock(&ix->retire_lock);
  if (ix->rl_n == ix->rl_cap) {
    size_t cap = ix->rl_cap ? 2 * ix->rl_cap : 64;
    retired *rl = kvp__realloc(&ix->alloc, ix->rl, ix->rl_cap * sizeof *rl,
                               cap * sizeof *rl);
    if (rl == NULL) { /* no room to defer: wait out the readers instead */
      kvp__spin_unlock(&ix->retire_lock);
      ebr_wait(ix, tag);
      ix_free(ix, p, size);
      return;
    }
    atomic_fetch_add_explicit(&ix->bytes, (cap - ix->rl_cap) * sizeof *rl,
                              memory_order_relaxed);
    ix->rl = rl;
    ix->rl_cap = cap;
  }
  ix->rl[ix->rl_n++] = (retired){p, size, tag};
  ix->rl_bytes += size;
  if (ix->rl_n >= RECLAIM_BATCH || ix->rl_bytes >= RECLAIM_BYTES)
    reclaim_locked(ix);
  kvp__spin_unlock(&ix->retire_lock);
}

/* ---- tables -------------------------------------------------------------- */

static ktab *tab_new(kvp_index *ix, uint64_t nbuckets) {
  size_t bytes, size;
  if (!kvp__mul_ok(nbuckets, BUCKET_SLOTS * sizeof(kslot), &bytes) ||
      __builtin_add_overflow(bytes, sizeof(ktab) + 63, &size))
    return NULL;
  ktab *t = ix_calloc(ix, size); /* FP_EMPTY, holder 0 */
  if (t == NULL)
    return NULL;
  advise_huge(ix, align64(t + 1), bytes); /* before the pages are touched */
  t->nbuckets = nbuckets;
  t->slots = align64(t + 1);
  t->live = t->tomb = 0;
  t->raw_size = size;
  return t;
}

static uint64_t buckets_for(uint64_t live) {
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
 * sits after an empty slot on its probe path (slot_kill empties only slots
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

/* The reader's half of bucket_scan: hits and empty slots of two buckets. */
static inline unsigned scan_hits(kslot *s, uint64_t fp) {
  /* acquire: pairs with the release of fp in slot_claim */
  uint64_t f0 = atomic_load_explicit(&s[0].fp, memory_order_acquire);
  uint64_t f1 = atomic_load_explicit(&s[1].fp, memory_order_acquire);
  uint64_t f2 = atomic_load_explicit(&s[2].fp, memory_order_acquire);
  uint64_t f3 = atomic_load_explicit(&s[3].fp, memory_order_acquire);
  return (unsigned)(f0 == fp) | (unsigned)(f1 == fp) << 1 |
         (unsigned)(f2 == fp) << 2 | (unsigned)(f3 == fp) << 3;
}

/* The writer's: its own stores need no ordering. */
static inline unsigned scan_hits_relaxed(kslot *s, uint64_t fp) {
  uint64_t f0 = atomic_load_explicit(&s[0].fp, memory_order_relaxed);
  uint64_t f1 = atomic_load_explicit(&s[1].fp, memory_order_relaxed);
  uint64_t f2 = atomic_load_explicit(&s[2].fp, memory_order_relaxed);
  uint64_t f3 = atomic_load_explicit(&s[3].fp, memory_order_relaxed);
  return (unsigned)(f0 == fp) | (unsigned)(f1 == fp) << 1 |
         (unsigned)(f2 == fp) << 2 | (unsigned)(f3 == fp) << 3;
}

typedef enum { PROBE_MISS, PROBE_HIT, PROBE_RACE } probe_rc;

/* The general probe scans two buckets at a time (the query prefetched
 * both): an fp is in the table once, so a hit in either is the key. */
static probe_rc probe_once(ktab *t, uint64_t fp, uint64_t h, uint64_t *val) {
  uint64_t nb = t->nbuckets, b = bucket_of(h, nb);
  for (uint64_t n = 0; n < nb; n += 2) {
    uint64_t b2 = b + 1 == nb ? 0 : b + 1;
    kslot *s = &t->slots[b * BUCKET_SLOTS], *s2 = &t->slots[b2 * BUCKET_SLOTS];
    unsigned hit = scan_hits(s, fp) | scan_hits(s2, fp) << BUCKET_SLOTS;
    if (KVP_LIKELY(hit != 0)) {
      unsigned k = ctz64(hit);
      kslot *x = k < BUCKET_SLOTS ? &s[k] : &s2[k - BUCKET_SLOTS];
      /* acquire: pairs with the releases of val in slot_set/slot_kill;
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

static uint64_t tab_get_slow(ktab *t, uint64_t fp, uint64_t h) {
  uint64_t v = 0;
  for (unsigned tries = 0; tries < 16; tries++) {
    probe_rc rc = probe_once(t, fp, h, &v);
    if (rc != PROBE_RACE)
      return rc == PROBE_HIT ? v : 0;
  }
  return 0; /* a slot recycled 16 times under us: report a miss (fail open) */
}

/* Reader lookup: fp's holder word, 0 when absent.  Inline for the common
 * case, a key found in its home bucket (three times in four). */
static inline uint64_t tab_get(ktab *t, uint64_t fp, uint64_t h) {
  kslot *s = &t->slots[bucket_of(h, t->nbuckets) * BUCKET_SLOTS];
  unsigned hit = scan_hits(s, fp);
  if (KVP_LIKELY(hit != 0)) {
    kslot *x = &s[ctz64(hit)];
    /* acquire: pairs with the releases of val in slot_set/slot_kill */
    uint64_t v = atomic_load_explicit(&x->val, memory_order_acquire);
    if (KVP_LIKELY(atomic_load_explicit(&x->fp, memory_order_relaxed) == fp))
      return v;
  }
  return tab_get_slow(t, fp, h);
}

/* Writer lookup (caller holds the table's lock): fp's slot or NULL, and in
 * *ins the first reusable slot of its probe path. */
static kslot *tab_find(ktab *t, uint64_t fp, uint64_t h, kslot **ins) {
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

static void slot_set(kslot *s, uint64_t val) {
  /* release: pairs with the acquire of val in probe_once */
  atomic_store_explicit(&s->val, val, memory_order_release);
}

/* Publishes a new key: holder word first, then the fingerprint. */
static void slot_claim(ktab *t, kslot *s, uint64_t fp, uint64_t val) {
  if (atomic_load_explicit(&s->fp, memory_order_relaxed) == FP_TOMB)
    t->tomb--;
  t->live++;
  slot_set(s, val);
  /* release: pairs with the acquire of fp in probe_once */
  atomic_store_explicit(&s->fp, fp, memory_order_release);
}

static inline kslot *slot_step(ktab *t, kslot *s, int dir) {
  uint64_t n = t->nbuckets * BUCKET_SLOTS, i = (uint64_t)(s - t->slots);
  return &t->slots[dir > 0 ? (i + 1) % n : (i + n - 1) % n];
}

/* A key leaves.  No key sits past an empty slot on its probe path, so a
 * slot followed by an empty one is on nobody's path: it becomes empty, and
 * so do the dead slots just before it.  Churn then does not fill the table
 * with tombstones (each rebuild to purge them moves the whole shard). */
static void slot_kill(ktab *t, kslot *s) {
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

static void geometry_note(shard *sh, const ktab *t) {
  if (sh == NULL)
    return;
  atomic_store_explicit(&sh->pf_slots, t->slots, memory_order_relaxed);
  atomic_store_explicit(&sh->pf_nbuckets, t->nbuckets, memory_order_relaxed);
}

/* Rebuilds *where's table for `live` keys; the old one is retired. */
static int tab_rebuild(kvp_index *ix, _Atomic(ktab *) *where, shard *sh,
                       uint64_t live) {
  ktab *old = atomic_load_explicit(where, memory_order_relaxed);
  ktab *t = tab_new(ix, buckets_for(live));
  if (t == NULL)
    return KVP_ENOMEM;
  for (uint64_t i = 0; i < old->nbuckets * BUCKET_SLOTS; i++) {
    uint64_t f = atomic_load_explicit(&old->slots[i].fp, memory_order_relaxed);
    if (f <= FP_TOMB)
      continue;
    kslot *ins = NULL;
    (void)tab_find(t, f, mix64(f), &ins);
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
  geometry_note(sh, t);
  retire(ix, old, old->raw_size);
  return 0;
}

/* Makes room for one more key in *where's table.  Returns the table. */
static int tab_reserve(kvp_index *ix, _Atomic(ktab *) *where, shard *sh,
                       ktab **out) {
  ktab *t = atomic_load_explicit(where, memory_order_relaxed);
  if (tab_full(t, 1)) {
    int rc = tab_rebuild(ix, where, sh, t->live + 1);
    if (rc < 0)
      return rc;
    t = atomic_load_explicit(where, memory_order_relaxed);
  }
  *out = t;
  return 0;
}

/* After deletions: give memory back when the table is mostly empty. */
static void tab_maybe_shrink(kvp_index *ix, shard *sh) {
  ktab *t = atomic_load_explicit(&sh->tab, memory_order_relaxed);
  uint64_t slots = t->nbuckets * BUCKET_SLOTS;
  if (t->nbuckets > MIN_BUCKETS && t->live * 6 < slots)
    (void)tab_rebuild(ix, &sh->tab, sh, t->live); /* ENOMEM: keep the big one */
}

/* ---- holder sets --------------------------------------------------------- */

typedef struct upd {
  uint32_t worker;
  uint32_t add, del;           /* tier masks to set and to clear */
  uint32_t old_mask, new_mask; /* out: the worker's mask before/after */
} upd;

static size_t wset_size(uint32_t cap) {
  return sizeof(wset) + (size_t)cap * sizeof(wgroup);
}

static wset *wset_new(kvp_index *ix, uint32_t cap) {
  wset *ws = ix_alloc(ix, wset_size(cap));
  if (ws == NULL)
    return NULL;
  memset(ws, 0, wset_size(cap));
  ws->cap = cap;
  return ws;
}

static int wset_find(wset *ws, uint32_t ng, uint64_t gid) {
  for (uint32_t i = 0; i < ng; i++)
    if (ws->g[i].gid == gid)
      return (int)i;
  return -1;
}

static uint32_t group_mask(wgroup *g, uint64_t bit) {
  uint32_t m = 0;
  for (unsigned t = 0; t < NTIERS; t++)
    if (atomic_load_explicit(&g->tier[t], memory_order_relaxed) & bit)
      m |= 1u << t;
  return m;
}

/* Sets worker w's bits in group g to `mask`.  Relaxed: each word stands
 * alone (readers take a block's words one by one). */
static void group_set(wgroup *g, uint32_t w, uint32_t mask) {
  uint64_t bit = 1ull << (w & 63);
  for (unsigned t = 0; t < NTIERS; t++) {
    uint64_t v = atomic_load_explicit(&g->tier[t], memory_order_relaxed);
    uint64_t nv = (mask >> t) & 1 ? v | bit : v & ~bit;
    if (nv != v)
      atomic_store_explicit(&g->tier[t], nv, memory_order_relaxed);
  }
}

/* Adds (w, mask) to a set not yet published (room guaranteed). */
static void wset_put(wset *ws, uint32_t w, uint32_t mask) {
  uint32_t ng = atomic_load_explicit(&ws->ngroups, memory_order_relaxed);
  int gi = wset_find(ws, ng, w >> 6);
  if (gi < 0) {
    gi = (int)ng;
    ws->g[ng].gid = w >> 6;
    atomic_store_explicit(&ws->ngroups, ng + 1, memory_order_relaxed);
  }
  group_set(&ws->g[gi], w, mask);
  ws->nworkers++;
}

static uint64_t in_pack(const uint16_t *sl, unsigned n) {
  uint64_t p = 0;
  for (unsigned k = 0; k < n; k++)
    p |= (uint64_t)sl[k] << (16u * k);
  return p;
}

/* Five holders: the inline four and the newcomer, into a wset. */
static int spill(kvp_index *ix, const uint16_t *sl, const upd *u,
                 uint64_t *out) {
  uint64_t gids[INLINE_MAX + 1];
  uint32_t ng = 0;
  for (unsigned k = 0; k <= INLINE_MAX; k++) {
    uint64_t gid = (k < INLINE_MAX ? (uint32_t)(sl[k] >> 4) : u->worker) >> 6;
    bool seen = false;
    for (uint32_t j = 0; j < ng; j++)
      seen |= gids[j] == gid;
    if (!seen)
      gids[ng++] = gid;
  }
  wset *ws = wset_new(ix, ng);
  if (ws == NULL)
    return KVP_ENOMEM;
  for (unsigned k = 0; k < INLINE_MAX; k++)
    wset_put(ws, sl[k] >> 4, sl[k] & 0xFu);
  wset_put(ws, u->worker, u->new_mask);
  *out = (uint64_t)(uintptr_t)ws;
  return 0;
}

static int inl_update(kvp_index *ix, uint64_t p, upd *u, uint64_t *out) {
  if (p == 0) { /* a new key: the common case of ingest */
    u->old_mask = 0;
    u->new_mask = u->add & ~u->del & 0xFu;
    *out = u->new_mask ? (uint64_t)(u->worker << 4 | u->new_mask) : 0;
    return 0;
  }
  uint16_t sl[INLINE_MAX];
  unsigned n = 0, at = INLINE_MAX;
  for (; n < INLINE_MAX && (in_slot(p, n) & 0xFu); n++) {
    sl[n] = in_slot(p, n);
    if ((uint32_t)(sl[n] >> 4) == u->worker)
      at = n;
  }
  u->old_mask = at < n ? sl[at] & 0xFu : 0;
  u->new_mask = (u->old_mask | u->add) & ~u->del & 0xFu;
  *out = p;
  if (u->new_mask == u->old_mask)
    return 0;
  uint16_t s = (uint16_t)(u->worker << 4 | u->new_mask);
  if (at < n && u->new_mask != 0) {
    sl[at] = s;
  } else if (at < n) { /* drop slot `at`, keep the rest packed */
    memmove(&sl[at], &sl[at + 1], (n - at - 1) * sizeof sl[0]);
    n--;
  } else if (n < INLINE_MAX) {
    sl[n++] = s;
  } else {
    return spill(ix, sl, u, out);
  }
  *out = in_pack(sl, n);
  return 0;
}

/* <= SHRINK_AT holders left: back to the inline form. */
static uint64_t wset_to_inline(wset *ws) {
  uint16_t sl[INLINE_MAX];
  unsigned n = 0;
  uint32_t ng = atomic_load_explicit(&ws->ngroups, memory_order_relaxed);
  for (uint32_t i = 0; i < ng; i++) {
    uint64_t any = 0;
    for (unsigned t = 0; t < NTIERS; t++)
      any |= atomic_load_explicit(&ws->g[i].tier[t], memory_order_relaxed);
    for (; any != 0 && n < INLINE_MAX; any &= any - 1) {
      uint32_t w = (uint32_t)(ws->g[i].gid * 64 + ctz64(any));
      sl[n++] = (uint16_t)(w << 4 | group_mask(&ws->g[i], 1ull << (w & 63)));
    }
  }
  return in_pack(sl, n);
}

/* A new group for u->worker: in place when there is room, else a copy
 * without the empty groups. */
static int wset_add_group(kvp_index *ix, wset *ws, uint32_t ng, const upd *u,
                          uint64_t *out) {
  if (ng < ws->cap) {
    ws->g[ng].gid = u->worker >> 6;
    group_set(&ws->g[ng], u->worker, u->new_mask);
    ws->nworkers++;
    /* release: pairs with the acquire of ngroups in readers; the group's gid
     * and words are visible before it is counted */
    atomic_store_explicit(&ws->ngroups, ng + 1, memory_order_release);
    *out = (uint64_t)(uintptr_t)ws;
    return 0;
  }
  uint32_t cap = ws->cap * 2 > GROUPS_MAX ? GROUPS_MAX : ws->cap * 2;
  wset *nw = wset_new(ix, cap > ng + 1 ? cap : ng + 1);
  if (nw == NULL)
    return KVP_ENOMEM;
  for (uint32_t i = 0; i < ng; i++) {
    uint64_t any = 0;
    for (unsigned t = 0; t < NTIERS; t++)
      any |= atomic_load_explicit(&ws->g[i].tier[t], memory_order_relaxed);
    for (; any != 0; any &= any - 1) {
      uint32_t w = (uint32_t)(ws->g[i].gid * 64 + ctz64(any));
      wset_put(nw, w, group_mask(&ws->g[i], 1ull << (w & 63)));
    }
  }
  wset_put(nw, u->worker, u->new_mask);
  *out = (uint64_t)(uintptr_t)nw;
  return 0;
}

static int wset_update(kvp_index *ix, wset *ws, upd *u, uint64_t *out) {
  uint32_t ng = atomic_load_explicit(&ws->ngroups, memory_order_relaxed);
  int gi = wset_find(ws, ng, u->worker >> 6);
  u->old_mask = gi >= 0 ? group_mask(&ws->g[gi], 1ull << (u->worker & 63)) : 0;
  u->new_mask = (u->old_mask | u->add) & ~u->del & 0xFu;
  *out = (uint64_t)(uintptr_t)ws;
  if (u->new_mask == u->old_mask)
    return 0;
  if (gi < 0)
    return wset_add_group(ix, ws, ng, u, out);
  group_set(&ws->g[gi], u->worker, u->new_mask);
  ws->nworkers += (u->new_mask != 0) - (u->old_mask != 0);
  if (ws->nworkers <= SHRINK_AT)
    *out = wset_to_inline(ws);
  return 0;
}

/* Applies u to holder word p; *out is the word to publish (== p when the
 * change was made in place or nothing changed). */
static int set_update(kvp_index *ix, uint64_t p, upd *u, uint64_t *out) {
  if (is_wset(p))
    return wset_update(ix, (wset *)(uintptr_t)p, u, out);
  return inl_update(ix, p, u, out);
}

/* Worker w's tier mask in holder word p. */
static uint32_t mask_of(uint64_t p, uint32_t w) {
  if (!is_wset(p)) {
    for (unsigned k = 0; k < INLINE_MAX && (in_slot(p, k) & 0xFu); k++)
      if ((uint32_t)(in_slot(p, k) >> 4) == w)
        return in_slot(p, k) & 0xFu;
    return 0;
  }
  wset *ws = (wset *)(uintptr_t)p;
  /* acquire: pairs with the release in wset_add_group */
  uint32_t ng = atomic_load_explicit(&ws->ngroups, memory_order_acquire);
  int gi = wset_find(ws, ng, w >> 6);
  return gi < 0 ? 0 : group_mask(&ws->g[gi], 1ull << (w & 63));
}

/* ---- block updates ------------------------------------------------------- */

typedef kvp__acc acc; /* an event's effect on its worker */

/* Publishes holder word np in place of p at slot s. */
static void slot_replace(kvp_index *ix, shard *sh, ktab *t, kslot *s,
                         uint64_t p, uint64_t np) {
  if (np == p)
    return;
  if (np == 0) {
    slot_kill(t, s);
    atomic_store_explicit(&sh->keys, t->live, memory_order_relaxed);
  } else {
    slot_set(s, np);
  }
  if (is_wset(p) && (uint64_t)(uintptr_t)p != np) {
    wset *ws = (wset *)(uintptr_t)p;
    retire(ix, ws, wset_size(ws->cap));
  }
}

static void acc_note(acc *a, uint64_t fp, const upd *u) {
  if (u->old_mask == u->new_mask)
    return;
  a->digest += dig_delta(fp, u->old_mask, u->new_mask);
  a->nres += (u->new_mask != 0) - (u->old_mask != 0);
  a->changed++;
  a->dropped += (uint64_t)__builtin_popcount(u->old_mask & ~u->new_mask);
}

/* One key's update on its shard (locked by the caller). */
static int shard_update(kvp_index *ix, shard *sh, uint64_t fp, uint64_t h,
                        upd *u, acc *a) {
  ktab *t = atomic_load_explicit(&sh->tab, memory_order_relaxed);
  kslot *ins = NULL, *s = tab_find(t, fp, h, &ins);
  uint64_t np;
  if (s == NULL) {
    if (u->add == 0)
      return 0;
    (void)inl_update(ix, 0, u, &np); /* never allocates from empty */
    if (np == 0)
      return 0;
    ktab *before = t;
    int rc = tab_reserve(ix, &sh->tab, sh, &t);
    if (rc < 0)
      return rc;
    if (t != before) /* rebuilt: find the slot again */
      (void)tab_find(t, fp, h, &ins);
    slot_claim(t, ins, fp, np);
    atomic_store_explicit(&sh->keys, t->live, memory_order_relaxed);
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
  __builtin_prefetch(b + BUCKET_SLOTS, 1, 3); /* past the end: harmless */
  return h;
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
  kslot *s = tab_find(atomic_load_explicit(&sh->tab, memory_order_relaxed), fp,
                      h, NULL);
  uint32_t m =
      s ? mask_of(atomic_load_explicit(&s->val, memory_order_relaxed), w) : 0;
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
    uint32_t m = mask_of(p, w) & tiers;
    uint32_t del = m != 0 && keep != NULL ? m & ~keep_get(keep, fp) : m;
    if (del == 0)
      continue;
    upd u = {.worker = w, .del = del};
    uint64_t np;
    (void)set_update(ix, p, &u, &np); /* removals never allocate */
    slot_replace(ix, sh, t, s, p, np);
    acc_note(a, fp, &u);
  }
  tab_maybe_shrink(ix, sh);
  kvp__spin_unlock(&sh->lock);
}

static void scan_worker(kvp_index *ix, uint32_t w, uint32_t tiers,
                        const keepset *keep, acc *a) {
  for (unsigned i = 0; i < SHARDS; i++)
    scan_shard(ix, &ix->shards[i], w, tiers, keep, a);
}

/* ---- approximate mode ---------------------------------------------------- */

static arec *arec_at(kvp_index *ix, uint32_t idx) {
  /* acquire: pairs with the release in arec_alloc that published the chunk */
  arec *c = atomic_load_explicit(&ix->adir[(idx - 1) / APPROX_CHUNK],
                                 memory_order_acquire);
  return &c[(idx - 1) % APPROX_CHUNK];
}

static void lru_unlink(kvp_index *ix, arec *r) {
  if (r->lru_prev)
    arec_at(ix, r->lru_prev)->lru_next = r->lru_next;
  else
    ix->lru_head = r->lru_next;
  if (r->lru_next)
    arec_at(ix, r->lru_next)->lru_prev = r->lru_prev;
  else
    ix->lru_tail = r->lru_prev;
}

static void lru_push(kvp_index *ix, uint32_t idx, arec *r) {
  r->lru_prev = 0;
  r->lru_next = ix->lru_head;
  if (ix->lru_head)
    arec_at(ix, ix->lru_head)->lru_prev = idx;
  else
    ix->lru_tail = idx;
  ix->lru_head = idx;
}

/* Retired records whose readers are gone go back to the free list. */
static void arec_reclaim(kvp_index *ix) {
  ebr_advance(ix);
  size_t k = 0;
  for (size_t i = 0; i < ix->aret_n; i++) {
    if (ebr_safe(ix, ix->aret[i].epoch)) {
      arec_at(ix, ix->aret[i].idx)->lru_next = ix->afree;
      ix->afree = ix->aret[i].idx;
    } else {
      ix->aret[k++] = ix->aret[i];
    }
  }
  ix->aret_n = k;
}

static uint32_t arec_pop_free(kvp_index *ix) {
  uint32_t idx = ix->afree;
  if (idx)
    ix->afree = arec_at(ix, idx)->lru_next;
  return idx;
}

/* A record index, 0 when out of memory. */
static uint32_t arec_alloc(kvp_index *ix) {
  uint32_t idx = arec_pop_free(ix);
  if (idx == 0 && ix->aret_n >= RECLAIM_BATCH)
    arec_reclaim(ix), idx = arec_pop_free(ix);
  if (idx != 0)
    return idx;
  if (ix->aused < ix->adir_n * APPROX_CHUNK) {
    uint32_t c = ix->aused / APPROX_CHUNK;
    if (ix->aused % APPROX_CHUNK == 0) {
      arec *chunk = ix_alloc(ix, APPROX_CHUNK * sizeof(arec));
      if (chunk == NULL)
        return 0;
      memset(chunk, 0, APPROX_CHUNK * sizeof(arec));
      /* release: pairs with the acquire in arec_at */
      atomic_store_explicit(&ix->adir[c], chunk, memory_order_release);
    }
    return ++ix->aused;
  }
  while (ix->aret_n > 0 && ix->afree == 0) { /* all slots wait for readers */
    ebr_wait(ix, ix->aret[0].epoch);
    arec_reclaim(ix);
  }
  return arec_pop_free(ix);
}

/* Unlinks record idx from its key's list and retires it. */
static int arec_evict(kvp_index *ix, uint32_t idx) {
  arec *r = arec_at(ix, idx);
  ktab *t = atomic_load_explicit(&ix->atab, memory_order_relaxed);
  kslot *s = tab_find(t, r->fp, mix64(r->fp), NULL);
  uint32_t next = atomic_load_explicit(&r->next, memory_order_relaxed);
  uint32_t head =
      s ? (uint32_t)atomic_load_explicit(&s->val, memory_order_relaxed) : 0;
  if (s == NULL) { /* not linked (cannot happen): only the LRU holds it */
  } else if (head == idx && next == 0) {
    slot_kill(t, s);
  } else if (head == idx) {
    slot_set(s, next);
  } else {
    arec *q = arec_at(ix, head);
    uint32_t qn;
    while ((qn = atomic_load_explicit(&q->next, memory_order_relaxed)) != idx &&
           qn != 0)
      q = arec_at(ix, qn);
    /* release: pairs with the acquire of next in routed_walk */
    atomic_store_explicit(&q->next, next, memory_order_release);
  }
  lru_unlink(ix, r);
  atomic_store_explicit(
      &ix->acount, atomic_load_explicit(&ix->acount, memory_order_relaxed) - 1,
      memory_order_relaxed);
  uint64_t tag = ebr_tag(ix);
  if (ix->aret_n == ix->aret_cap) {
    size_t cap = ix->aret_cap ? 2 * ix->aret_cap : 64;
    aretired *a = kvp__realloc(&ix->alloc, ix->aret, ix->aret_cap * sizeof *a,
                               cap * sizeof *a);
    if (a == NULL) { /* wait out the readers and free it now */
      ebr_wait(ix, tag);
      r->lru_next = ix->afree;
      ix->afree = idx;
      return 0;
    }
    atomic_fetch_add_explicit(&ix->bytes, (cap - ix->aret_cap) * sizeof *a,
                              memory_order_relaxed);
    ix->aret = a;
    ix->aret_cap = cap;
  }
  ix->aret[ix->aret_n++] = (aretired){idx, tag};
  return 0;
}

static bool routed_live(uint64_t touch, uint64_t now, uint64_t ttl) {
  return now < touch || now - touch < ttl;
}

static size_t approx_expire_locked(kvp_index *ix, uint64_t now) {
  size_t n = 0;
  while (ix->lru_tail != 0) {
    arec *r = arec_at(ix, ix->lru_tail);
    if (routed_live(atomic_load_explicit(&r->touch, memory_order_relaxed), now,
                    ix->attl))
      break;
    (void)arec_evict(ix, ix->lru_tail);
    n++;
  }
  atomic_fetch_add_explicit(&ix->c.expired, n, memory_order_relaxed);
  return n;
}

/* Drops every record of worker w (approx lock held). */
static void approx_purge_locked(kvp_index *ix, uint32_t w) {
  for (uint32_t idx = ix->lru_head; idx != 0;) {
    arec *r = arec_at(ix, idx);
    uint32_t next = r->lru_next;
    if (r->worker == w)
      (void)arec_evict(ix, idx);
    idx = next;
  }
}

static void approx_purge(kvp_index *ix, uint32_t w) {
  kvp__spin_lock(&ix->alock);
  approx_purge_locked(ix, w);
  kvp__spin_unlock(&ix->alock);
}

/* Records (fp -> w at now); 1 when a record was created. */
static int approx_record(kvp_index *ix, uint64_t fp, uint32_t w, uint64_t now) {
  uint64_t h = mix64(fp);
  ktab *t = atomic_load_explicit(&ix->atab, memory_order_relaxed);
  kslot *ins = NULL, *s = tab_find(t, fp, h, &ins);
  uint32_t head =
      s ? (uint32_t)atomic_load_explicit(&s->val, memory_order_relaxed) : 0;
  for (uint32_t idx = head; idx != 0;) {
    arec *r = arec_at(ix, idx);
    if (r->worker == w) {
      atomic_store_explicit(&r->touch, now, memory_order_relaxed);
      lru_unlink(ix, r);
      lru_push(ix, idx, r);
      return 0;
    }
    idx = atomic_load_explicit(&r->next, memory_order_relaxed);
  }
  if (s == NULL) {
    int rc = tab_reserve(ix, &ix->atab, NULL, &t);
    if (rc < 0)
      return rc;
  }
  uint32_t idx = arec_alloc(ix);
  if (idx == 0)
    return KVP_ENOMEM;
  arec *r = arec_at(ix, idx);
  r->worker = w;
  r->fp = fp;
  atomic_store_explicit(&r->touch, now, memory_order_relaxed);
  atomic_store_explicit(&r->next, head, memory_order_relaxed);
  if (s != NULL) {
    slot_set(s, idx); /* release: the record is complete before it is seen */
  } else {
    (void)tab_find(t, fp, h, &ins);
    slot_claim(t, ins, fp, idx);
  }
  lru_push(ix, idx, r);
  atomic_store_explicit(
      &ix->acount, atomic_load_explicit(&ix->acount, memory_order_relaxed) + 1,
      memory_order_relaxed);
  return 1;
}

/* ---- queries ------------------------------------------------------------- */

typedef struct qgroup { /* per 64-worker group: who is still matching */
  uint64_t alive, seen;
  uint32_t gid, pad_;
  uint32_t prefix[64];       /* set when the worker drops out */
  uint64_t vc[NCLS][PLANES]; /* vertical counters: blocks per class */
} qgroup;

typedef struct qblk { /* one block's holders by group (wide path) */
  uint64_t m[GROUPS_MAX][NCLS];
  uint8_t touched[GROUPS_MAX];
  uint8_t mark[GROUPS_MAX];
  unsigned nt;
} qblk;

/* A query reads its chain through a software pipeline: PF_FAR blocks ahead
 * it prefetches the bucket, PF_NEAR blocks ahead it reads the holder word
 * (the block's one read) and prefetches a spilled set, so the walk itself
 * finds everything in cache. */
typedef struct qctx {
  kvp_index *ix;
  ktab *atab; /* NULL when no routing record exists */
  uint64_t now, ttl;
  size_t nread; /* blocks looked up */
  const kvp_key *keys;
  size_t n;
  uint64_t fp[PIPE], h[PIPE], p[PIPE];
} qctx;

/* counts[w] += 1 for every bit w of x, on bit-sliced counters. */
static inline void vc_add(uint64_t *planes, uint64_t x) {
  for (unsigned k = 0; x != 0; k++) {
    uint64_t carry = planes[k] & x;
    planes[k] ^= x;
    x = carry;
  }
}

/* Block i: m[c] = workers of the group holding it in class c. */
static inline void q_step(qgroup *q, const uint64_t *m, uint32_t i) {
  uint64_t any = m[0] | m[1] | m[2] | m[3] | m[4];
  for (uint64_t d = q->alive & ~any; d != 0; d &= d - 1)
    q->prefix[ctz64(d)] = i;
  uint64_t a = q->alive & any;
  q->alive = a;
  for (unsigned c = 0; c < NCLS && a != 0; c++) { /* fastest class first */
    uint64_t x = a & m[c];
    if (x != 0) {
      vc_add(q->vc[c], x);
      a &= ~x;
    }
  }
}

static uint64_t event_holders(qctx *c, uint64_t fp, uint64_t h) {
  /* acquire: pairs with the release in tab_rebuild */
  ktab *t =
      atomic_load_explicit(&shard_of(c->ix, h)->tab, memory_order_acquire);
  return tab_get(t, fp, h);
}

/* Prefetches the bucket pair of fingerprint fp (hash h), and its routing
 * records' bucket when there are any. */
static void probe_prefetch(const qctx *c, uint64_t h) {
  shard *sh = shard_of(c->ix, h);
  kslot *s = atomic_load_explicit(&sh->pf_slots, memory_order_relaxed);
  uint64_t nb = atomic_load_explicit(&sh->pf_nbuckets, memory_order_relaxed);
  kslot *b = s + bucket_of(h, nb) * BUCKET_SLOTS;
  __builtin_prefetch(b, 0, 3);
  __builtin_prefetch(b + BUCKET_SLOTS, 0, 3); /* probe_once reads two */
  if (c->atab != NULL)
    __builtin_prefetch(
        &c->atab->slots[bucket_of(h, c->atab->nbuckets) * BUCKET_SLOTS], 0, 3);
}

/* Reads fp's holder word and prefetches its spilled set, if any. */
static uint64_t probe_read(qctx *c, uint64_t fp, uint64_t h) {
  uint64_t p = event_holders(c, fp, h);
  if (is_wset(p)) { /* the header and group 0 may straddle two lines */
    __builtin_prefetch((const char *)(uintptr_t)p, 0, 3);
    __builtin_prefetch(
        (const char *)(uintptr_t)p + sizeof(wset) + sizeof(wgroup) - 1, 0, 3);
  }
  return p;
}

static void pipe_far(qctx *c, size_t j) {
  uint64_t fp = fp_of(c->keys[j]), h = mix64(fp);
  c->fp[j % PIPE] = fp;
  c->h[j % PIPE] = h;
  probe_prefetch(c, h);
}

static void pipe_near(qctx *c, size_t j) {
  c->p[j % PIPE] = probe_read(c, c->fp[j % PIPE], c->h[j % PIPE]);
}

static void pipe_start(qctx *c, const kvp_key *keys, size_t n) {
  c->keys = keys;
  c->n = n;
  for (size_t j = 0; j < n && j < PF_FAR; j++)
    pipe_far(c, j);
  for (size_t j = 0; j < n && j < PF_NEAR; j++)
    pipe_near(c, j);
}

/* Before block i is walked. */
static inline void pipe_step(qctx *c, size_t i) {
  if (i + PF_FAR < c->n)
    pipe_far(c, i + PF_FAR);
  if (i + PF_NEAR < c->n)
    pipe_near(c, i + PF_NEAR);
}

/* Walks a key's routing records from *idx (its list head): the worker of
 * the next one not expired, or UINT32_MAX at the end. */
static uint32_t routed_next(qctx *c, uint32_t *idx) {
  while (*idx != 0) {
    arec *r = arec_at(c->ix, *idx);
    uint32_t w = r->worker;
    bool live = routed_live(
        atomic_load_explicit(&r->touch, memory_order_relaxed), c->now, c->ttl);
    /* acquire: pairs with the releases of next in arec_evict and of the head
     * in approx_record */
    *idx = atomic_load_explicit(&r->next, memory_order_acquire);
    if (live)
      return w;
  }
  return UINT32_MAX;
}

/* m[c] = the workers holding fp (holder word p) in class c. */
static void gather_fast_at(qctx *c, uint64_t fp, uint64_t h, uint64_t p,
                           uint64_t m[NCLS]) {
  uint64_t m0 = 0, m1 = 0, m2 = 0, m3 = 0; /* in registers, stored once */
  if (p & 0xFu) {
    for (uint64_t q = p; q & 0xFu; q >>= 16) { /* the occupied slots */
      uint64_t bit = 1ull << ((q >> 4) & 63);
      m0 |= q & 1 ? bit : 0;
      m1 |= q & 2 ? bit : 0;
      m2 |= q & 4 ? bit : 0;
      m3 |= q & 8 ? bit : 0;
    }
  } else if (p != 0) {
    wset *ws = (wset *)(uintptr_t)p;
    /* acquire: pairs with the release in wset_add_group */
    if (atomic_load_explicit(&ws->ngroups, memory_order_acquire) != 0) {
      m0 = atomic_load_explicit(&ws->g[0].tier[0], memory_order_relaxed);
      m1 = atomic_load_explicit(&ws->g[0].tier[1], memory_order_relaxed);
      m2 = atomic_load_explicit(&ws->g[0].tier[2], memory_order_relaxed);
      m3 = atomic_load_explicit(&ws->g[0].tier[3], memory_order_relaxed);
    }
  }
  m[0] = m0, m[1] = m1, m[2] = m2, m[3] = m3, m[CLS_ROUTED] = 0;
  if (c->atab == NULL)
    return;
  uint32_t idx = (uint32_t)tab_get(c->atab, fp, h);
  for (uint32_t w; (w = routed_next(c, &idx)) != UINT32_MAX;)
    m[CLS_ROUTED] |= 1ull << (w & 63);
}

static void gather_fast(qctx *c, size_t i, uint64_t m[NCLS]) {
  gather_fast_at(c, c->fp[i % PIPE], c->h[i % PIPE], c->p[i % PIPE], m);
}

static inline uint64_t *blk_group(qblk *b, uint32_t gid) {
  if (!b->mark[gid]) {
    b->mark[gid] = 1;
    b->touched[b->nt++] = (uint8_t)gid;
  }
  return b->m[gid];
}

static void blk_clear(qblk *b) {
  for (unsigned k = 0; k < b->nt; k++) {
    memset(b->m[b->touched[k]], 0, sizeof b->m[0]);
    b->mark[b->touched[k]] = 0;
  }
  b->nt = 0;
}

static void gather_wide(qctx *c, size_t i, qblk *b) {
  uint64_t fp = c->fp[i % PIPE], h = c->h[i % PIPE], p = c->p[i % PIPE];
  if (p & 0xFu) {
    for (unsigned k = 0; k < INLINE_MAX && (in_slot(p, k) & 0xFu); k++) {
      uint32_t s = in_slot(p, k), w = s >> 4;
      uint64_t *m = blk_group(b, w >> 6);
      for (unsigned t = 0; t < NTIERS; t++)
        if ((s >> t) & 1)
          m[t] |= 1ull << (w & 63);
    }
  } else if (p != 0) {
    wset *ws = (wset *)(uintptr_t)p;
    /* acquire: pairs with the release in wset_add_group */
    uint32_t ng = atomic_load_explicit(&ws->ngroups, memory_order_acquire);
    for (uint32_t g = 0; g < ng; g++) {
      uint64_t v[NTIERS], any = 0;
      for (unsigned t = 0; t < NTIERS; t++)
        any |= v[t] =
            atomic_load_explicit(&ws->g[g].tier[t], memory_order_relaxed);
      if (any == 0)
        continue;
      uint64_t *m = blk_group(b, (uint32_t)ws->g[g].gid);
      for (unsigned t = 0; t < NTIERS; t++)
        m[t] |= v[t];
    }
  }
  if (c->atab == NULL)
    return;
  uint32_t idx = (uint32_t)tab_get(c->atab, fp, h);
  for (uint32_t w; (w = routed_next(c, &idx)) != UINT32_MAX;)
    blk_group(b, w >> 6)[CLS_ROUTED] |= 1ull << (w & 63);
}

/* Appends group q's matches (workers still added) to out. */
static size_t emit_group(qctx *c, const qgroup *q, kvp_index_match *out,
                         size_t cap, size_t k) {
  uint32_t cnt[64][NCLS];
  memset(cnt, 0, sizeof cnt);
  for (unsigned cl = 0; cl < NCLS; cl++)
    for (unsigned b = 0; b < PLANES; b++)
      for (uint64_t x = q->vc[cl][b]; x != 0; x &= x - 1)
        cnt[ctz64(x)][cl] += 1u << b;
  for (uint64_t s = q->seen; s != 0; s &= s - 1) {
    uint32_t bit = ctz64(s), w = q->gid * 64 + bit;
    worker *wk = &c->ix->workers[w];
    /* acquire: pairs with the release in kvp_index_worker_remove */
    if (atomic_load_explicit(&wk->state, memory_order_acquire) != W_ACTIVE)
      continue;
    if (k < cap) {
      kvp_index_match *o = &out[k];
      memset(o, 0, sizeof *o);
      o->worker = w;
      o->prefix_blocks = q->prefix[bit];
      memcpy(o->tier_blocks, cnt[bit], sizeof o->tier_blocks);
      o->routed_blocks = cnt[bit][CLS_ROUTED];
      o->uncertain =
          atomic_load_explicit(&wk->uncertain, memory_order_relaxed) != 0;
    }
    k++;
  }
  return k;
}

static void q_finish(qgroup *q, uint32_t nproc) {
  for (uint64_t a = q->alive; a != 0; a &= a - 1)
    q->prefix[ctz64(a)] = nproc;
}

static int query_fast(qctx *c, const kvp_key *keys, size_t n,
                      kvp_index_match *out, size_t cap) {
  qgroup q;
  uint64_t m[NCLS];
  size_t i;
  memset(&q, 0, sizeof q);
  pipe_start(c, keys, n);
  for (i = 0; i < n; i++) {
    pipe_step(c, i);
    gather_fast(c, i, m);
    if (i == 0)
      q.alive = q.seen = m[0] | m[1] | m[2] | m[3] | m[4];
    q_step(&q, m, (uint32_t)i);
    if (q.alive == 0)
      break;
  }
  c->nread = i < n ? i + 1 : n;
  q_finish(&q, (uint32_t)i);
  return (int)emit_group(c, &q, out, cap, 0);
}

/* ---- bisection (kvp_index_opts.prefix_closed) ----------------------------
 * Cumulative class c of a worker = held in one of classes 0..c (HBM first,
 * routed last).  Under the contract each (cumulative class, worker) bit is
 * set on a prefix of the chain, so it has one boundary: the first block where
 * it is clear, and tier c's count is boundary(c) - boundary(c-1).  A span
 * (a, b) carries bits known set at block a and clear at block b (b = n: past
 * the end) and the masks probed at both ends; probing its midpoint splits it
 * in two, and a span one block wide resolves its bits.  A round probes every
 * open span: all midpoints' buckets prefetched, then all holder words read
 * (their sets prefetched), then all gathered, so a round costs about one
 * memory latency however many spans it has.  Each probe checks the contract
 * against both ends of its span, for workers still alive there: a bit clear
 * at a and set at the midpoint, or clear at the midpoint and set at b, is a
 * violation; the query then walks.  (A worker that no longer holds any class
 * at a point has its answer fixed before it, so what it holds later does not
 * matter.) */
#define BSPANS 128u /* open spans per round; more -> walk (no violation) */

typedef struct bspan {
  uint32_t a, b;
  uint64_t bits[NCLS]; /* bits whose boundary lies in (a, b] */
  uint64_t ma[NCLS];   /* cumulative masks at block a */
  uint64_t mb[NCLS];   /* ... at block b (all 0 at b = n) */
} bspan;

typedef enum { BIS_OK, BIS_VIOLATION, BIS_WIDE } bis_rc;

typedef struct bstate {
  uint32_t L[NCLS][64]; /* boundary per cumulative class and worker */
  size_t nspans, nnext;
  bspan *cur, *next;
} bstate;

static void cumulate(uint64_t m[NCLS]) {
  for (unsigned k = 1; k < NCLS; k++)
    m[k] |= m[k - 1];
}

static void bits_resolve(bstate *st, const uint64_t bits[NCLS], uint32_t at) {
  for (unsigned k = 0; k < NCLS; k++)
    for (uint64_t x = bits[k]; x != 0; x &= x - 1)
      st->L[k][ctz64(x)] = at;
}

/* Opens span (a, b) over bits, or resolves them when it is one block wide. */
static bis_rc span_push(bstate *st, uint32_t a, uint32_t b,
                        const uint64_t bits[NCLS], const uint64_t ma[NCLS],
                        const uint64_t mb[NCLS]) {
  uint64_t any = 0;
  for (unsigned k = 0; k < NCLS; k++)
    any |= bits[k];
  if (any == 0)
    return BIS_OK;
  if (b - a == 1) {
    bits_resolve(st, bits, b);
    return BIS_OK;
  }
  if (st->nnext == BSPANS)
    return BIS_WIDE;
  bspan *sp = &st->next[st->nnext++];
  sp->a = a, sp->b = b;
  memcpy(sp->bits, bits, sizeof sp->bits);
  memcpy(sp->ma, ma, sizeof sp->ma);
  memcpy(sp->mb, mb, sizeof sp->mb);
  return BIS_OK;
}

/* Splits span sp at its midpoint, whose cumulative masks are cm. */
static bis_rc span_split(bstate *st, const bspan *sp, uint32_t mid,
                         const uint64_t cm[NCLS]) {
  uint64_t left[NCLS], right[NCLS], bad = 0;
  uint64_t alive_a = sp->ma[NCLS - 1], alive_m = cm[NCLS - 1];
  for (unsigned k = 0; k < NCLS; k++) {
    bad |= cm[k] & ~sp->ma[k] & alive_a;
    bad |= sp->mb[k] & ~cm[k] & alive_m;
    left[k] = sp->bits[k] & ~cm[k];
    right[k] = sp->bits[k] & cm[k];
  }
  if (bad != 0)
    return BIS_VIOLATION;
  bis_rc rc = span_push(st, sp->a, mid, left, sp->ma, cm);
  return rc != BIS_OK ? rc : span_push(st, mid, sp->b, right, cm, sp->mb);
}

/* One round: probes every open span's midpoint and splits it. */
static bis_rc bisect_round(qctx *c, bstate *st) {
  uint64_t fp[BSPANS], h[BSPANS], p[BSPANS];
  for (size_t j = 0; j < st->nspans; j++) {
    const bspan *sp = &st->cur[j];
    fp[j] = fp_of(c->keys[sp->a + (sp->b - sp->a) / 2]);
    h[j] = mix64(fp[j]);
    probe_prefetch(c, h[j]);
  }
  for (size_t j = 0; j < st->nspans; j++)
    p[j] = probe_read(c, fp[j], h[j]);
  st->nnext = 0;
  for (size_t j = 0; j < st->nspans; j++) {
    const bspan *sp = &st->cur[j];
    uint64_t cm[NCLS];
    gather_fast_at(c, fp[j], h[j], p[j], cm);
    cumulate(cm);
    bis_rc rc = span_split(st, sp, sp->a + (sp->b - sp->a) / 2, cm);
    if (rc != BIS_OK)
      return rc;
  }
  c->nread += st->nspans;
  bspan *t = st->cur;
  st->cur = st->next, st->next = t;
  st->nspans = st->nnext;
  return BIS_OK;
}

/* Appends the matches of the workers in seen (still added) to out. */
static size_t emit_bisect(qctx *c, const bstate *st, uint64_t seen,
                          kvp_index_match *out, size_t cap) {
  size_t k = 0;
  for (; seen != 0; seen &= seen - 1) {
    uint32_t w = ctz64(seen);
    worker *wk = &c->ix->workers[w];
    /* acquire: pairs with the release in kvp_index_worker_remove */
    if (atomic_load_explicit(&wk->state, memory_order_acquire) != W_ACTIVE)
      continue;
    if (k < cap) {
      kvp_index_match *o = &out[k];
      uint32_t lo = 0, cnt[NCLS];
      for (unsigned cl = 0; cl < NCLS; cl++) { /* boundaries never fall */
        uint32_t hi = st->L[cl][w] > lo ? st->L[cl][w] : lo;
        cnt[cl] = hi - lo;
        lo = hi;
      }
      memset(o, 0, sizeof *o);
      o->worker = w;
      o->prefix_blocks = lo;
      memcpy(o->tier_blocks, cnt, sizeof o->tier_blocks);
      o->routed_blocks = cnt[CLS_ROUTED];
      o->uncertain =
          atomic_load_explicit(&wk->uncertain, memory_order_relaxed) != 0;
    }
    k++;
  }
  return k;
}

/* The fast path's query by bisection; KVP_EBUSY: walk instead (*violation
 * says whether the contract was seen broken). */
static int query_bisect(qctx *c, const kvp_key *keys, size_t n,
                        kvp_index_match *out, size_t cap, bool *violation) {
  bspan a[BSPANS], b[BSPANS];
  bstate st = {.cur = a, .next = b};
  uint64_t cm0[NCLS], none[NCLS] = {0};
  c->keys = keys;
  c->n = n;
  uint64_t fp = fp_of(keys[0]), h = mix64(fp);
  gather_fast_at(c, fp, h, event_holders(c, fp, h), cm0);
  cumulate(cm0);
  c->nread = 1;
  uint64_t seen = cm0[NCLS - 1];
  if (seen == 0)
    return 0;
  memset(st.L, 0, sizeof st.L);
  bis_rc rc = span_push(&st, 0, (uint32_t)n, cm0, cm0, none);
  st.cur = b, st.next = a, st.nspans = st.nnext; /* the first span is open */
  while (rc == BIS_OK && st.nspans != 0)
    rc = bisect_round(c, &st);
  *violation = rc == BIS_VIOLATION;
  if (rc != BIS_OK)
    return KVP_EBUSY;
  return (int)emit_bisect(c, &st, seen, out, cap);
}

static void sort_gids(uint8_t *g, unsigned n) {
  for (unsigned i = 1; i < n; i++)
    for (unsigned j = i; j > 0 && g[j - 1] > g[j]; j--) {
      uint8_t t = g[j];
      g[j] = g[j - 1];
      g[j - 1] = t;
    }
}

/* Runs the chain over the groups that hold block 0 (gathered in b). */
static void wide_walk(qctx *c, qblk *b, qgroup *qs, unsigned ng) {
  uint8_t live[GROUPS_MAX];
  unsigned nlive = ng;
  for (unsigned j = 0; j < ng; j++)
    live[j] = (uint8_t)j;
  size_t i;
  for (i = 0; i < c->n && nlive != 0; i++) {
    pipe_step(c, i);
    if (i > 0)
      gather_wide(c, i, b);
    unsigned k = 0;
    for (unsigned j = 0; j < nlive; j++) {
      qgroup *q = &qs[live[j]];
      q_step(q, b->mark[q->gid] ? b->m[q->gid] : (const uint64_t[NCLS]){0},
             (uint32_t)i);
      if (q->alive != 0)
        live[k++] = live[j];
    }
    nlive = k;
    blk_clear(b);
  }
  c->nread = i != 0 ? i : 1; /* block 0 was read before the walk */
  for (unsigned j = 0; j < ng; j++)
    q_finish(&qs[j], (uint32_t)i);
}

static int query_wide(qctx *c, const kvp_key *keys, size_t n,
                      kvp_index_match *out, size_t cap) {
  qblk b;
  qgroup stackq[STACK_GROUPS], *qs = stackq;
  memset(&b, 0, sizeof b);
  pipe_start(c, keys, n);
  gather_wide(c, 0, &b);
  unsigned ng = b.nt;
  c->nread = 1;
  uint8_t gids[GROUPS_MAX];
  memcpy(gids, b.touched, ng);
  sort_gids(gids, ng);
  size_t qbytes = (size_t)ng * sizeof(qgroup);
  if (ng > STACK_GROUPS && (qs = kvp__malloc(&c->ix->alloc, qbytes)) == NULL)
    return KVP_ENOMEM;
  memset(qs, 0, qbytes);
  for (unsigned j = 0; j < ng; j++) {
    const uint64_t *m = b.m[gids[j]];
    qs[j].gid = gids[j];
    qs[j].alive = qs[j].seen = m[0] | m[1] | m[2] | m[3] | m[4];
  }
  wide_walk(c, &b, qs, ng);
  size_t k = 0;
  for (unsigned j = 0; j < ng; j++)
    k = emit_group(c, &qs[j], out, cap, k);
  if (qs != stackq)
    kvp__free(&c->ix->alloc, qs, qbytes);
  return (int)k;
}

int kvp_index_query(kvp_index *ix, const kvp_key *keys, size_t n,
                    uint64_t now_ns, kvp_index_match *out, size_t cap) {
  if (ix == NULL || (keys == NULL && n > 0) || (out == NULL && cap > 0))
    return KVP_EINVAL;
  if (n > KVP_INDEX_CHAIN_MAX)
    return KVP_ERANGE;
  if (n == 0)
    return 0;
  unsigned slot = ebr_pin(ix);
  qctx c = {.ix = ix, .now = now_ns, .ttl = ix->attl};
  if (atomic_load_explicit(&ix->acount, memory_order_relaxed) != 0)
    /* acquire: pairs with the release in tab_rebuild */
    c.atab = atomic_load_explicit(&ix->atab, memory_order_acquire);
  int rc = KVP_EBUSY;
  bool violation = false;
  if (ix->fast && ix->closed)
    rc = query_bisect(&c, keys, n, out, cap, &violation);
  if (violation)
    ctr_inc(&ix->c.closure);
  if (rc == KVP_EBUSY) /* no bisection, or it gave up: walk */
    rc = ix->fast ? query_fast(&c, keys, n, out, cap)
                  : query_wide(&c, keys, n, out, cap);
  ebr_slot *es = &ix->slots[slot];
  atomic_fetch_add_explicit(&es->queries, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&es->blocks, c.nread, memory_order_relaxed);
  ebr_unpin(ix, slot);
  return rc;
}

/* ---- the tables' side of events (index_internal.h) ---------------------- */

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
    scan_worker(ix, w, tiers, NULL, a);
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
    scan_worker(ix, w, tiers, &keep, a);
  size_t distinct = keep.n;
  keep_free(ix, &keep);
  return rc < 0 ? rc : (int)(distinct > INT_MAX ? INT_MAX : distinct);
}

void kvp__index_purge_routed(kvp_index *ix, uint32_t w) {
  approx_purge(ix, w);
}

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
  acc a = {0};
  scan_worker(ix, worker_id, ALL_TIERS, NULL, &a);
  approx_purge(ix, worker_id);
  atomic_store_explicit(&wk->digest, 0, memory_order_relaxed);
  atomic_store_explicit(&wk->nres, 0, memory_order_relaxed);
  kvp__spin_unlock(&wk->lock);
  return 0;
}

/* ---- approximate mode API ------------------------------------------------ */

int kvp_index_record_routed(kvp_index *ix, uint32_t worker_id,
                            const kvp_key *keys, size_t n, uint64_t now_ns) {
  int rc = kvp__index_args(ix, 0, keys, n);
  if (rc < 0)
    return rc;
  if (worker_id >= ix->max_workers) {
    ctr_inc(&ix->c.ev[KVP__C_UNKNOWN]);
    return KVP_ERANGE;
  }
  int created = 0;
  kvp__spin_lock(&ix->alock);
  /* acquire: pairs with the release in kvp_index_worker_remove; a removal
   * that purged before we took the lock is seen here */
  if (atomic_load_explicit(&ix->workers[worker_id].state,
                           memory_order_acquire) != W_ACTIVE) {
    rc = KVP_ENOENT;
    ctr_inc(&ix->c.ev[KVP__C_UNKNOWN]);
  }
  if (rc == 0)
    (void)approx_expire_locked(ix, now_ns);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    rc = approx_record(ix, fp_of(keys[i]), worker_id, now_ns);
    created += rc > 0;
    rc = rc > 0 ? 0 : rc;
    while (atomic_load_explicit(&ix->acount, memory_order_relaxed) > ix->acap) {
      (void)arec_evict(ix, ix->lru_tail);
      ctr_inc(&ix->c.evicted);
    }
  }
  kvp__spin_unlock(&ix->alock);
  return rc < 0 ? rc : created;
}

int kvp_index_expire(kvp_index *ix, uint64_t now_ns) {
  if (ix == NULL)
    return KVP_EINVAL;
  kvp__spin_lock(&ix->alock);
  size_t n = approx_expire_locked(ix, now_ns);
  kvp__spin_unlock(&ix->alock);
  return n > INT_MAX ? INT_MAX : (int)n;
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
    uint32_t m = mask_of(
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
  for (unsigned i = 0; i < EBR_SLOTS; i++) {
    out->queries += LOAD_(ix->slots[i].queries);
    out->query_blocks += LOAD_(ix->slots[i].blocks);
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
  ix->slots = ix_alloc_lines(ix, EBR_SLOTS * sizeof(ebr_slot), &ix->slots_raw);
  if (ix->shards == NULL || ix->workers == NULL || ix->streams == NULL ||
      ix->slots == NULL)
    return KVP_ENOMEM;
  for (unsigned i = 0; i < SHARDS; i++) {
    ktab *t = tab_new(ix, buckets_for(expected_keys / SHARDS));
    if (t == NULL)
      return KVP_ENOMEM;
    atomic_store_explicit(&ix->shards[i].tab, t, memory_order_relaxed);
    geometry_note(&ix->shards[i], t);
  }
  /* Room for the records retired but not yet reusable (a reader preempted
   * while pinned holds the epoch back for a time slice): chunks are
   * allocated only when used, so the spare costs one pointer per chunk. */
  ix->adir_n = (uint32_t)((4 * ix->acap + APPROX_SPARE) / APPROX_CHUNK + 1);
  ix->adir = ix_alloc(ix, ix->adir_n * sizeof *ix->adir);
  if (ix->adir == NULL)
    return KVP_ENOMEM;
  memset(ix->adir, 0, ix->adir_n * sizeof *ix->adir);
  ktab *t = tab_new(ix, MIN_BUCKETS);
  if (t == NULL)
    return KVP_ENOMEM;
  atomic_store_explicit(&ix->atab, t, memory_order_relaxed);
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
  ix->acap = o.approx_capacity ? o.approx_capacity : APPROX_CAP_DEFAULT;
  ix->attl = o.approx_ttl_ns ? o.approx_ttl_ns : TTL_DEFAULT_NS;
  atomic_store_explicit(&ix->epoch, 1, memory_order_relaxed);
  atomic_store_explicit(&ix->bytes, sizeof *ix, memory_order_relaxed);
  if ((rc = create_tables(ix, o.expected_keys)) < 0) {
    kvp_index_destroy(ix);
    return rc;
  }
  *out = ix;
  return 0;
}

static void free_table(kvp_index *ix, _Atomic(ktab *) *where, bool sets) {
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

void kvp_index_destroy(kvp_index *ix) {
  if (ix == NULL)
    return;
  for (unsigned i = 0; ix->shards != NULL && i < SHARDS; i++)
    free_table(ix, &ix->shards[i].tab, true);
  free_table(ix, &ix->atab, false);
  for (uint32_t c = 0; ix->adir != NULL && c < ix->adir_n; c++)
    ix_free(ix, atomic_load_explicit(&ix->adir[c], memory_order_relaxed),
            APPROX_CHUNK * sizeof(arec));
  ix_free(ix, ix->adir, ix->adir_n * sizeof *ix->adir);
  for (size_t i = 0; i < ix->rl_n; i++)
    ix_free(ix, ix->rl[i].p, ix->rl[i].size);
  kvp__free(&ix->alloc, ix->rl, ix->rl_cap * sizeof *ix->rl);
  kvp__free(&ix->alloc, ix->aret, ix->aret_cap * sizeof *ix->aret);
  ix_free(ix, ix->shards_raw, SHARDS * sizeof(shard) + 63);
  ix_free(ix, ix->workers_raw, ix->max_workers * sizeof(worker) + 63);
  ix_free(ix, ix->streams_raw, streams_bytes(ix) + 63);
  ix_free(ix, ix->slots_raw, EBR_SLOTS * sizeof(ebr_slot) + 63);
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
  v->digest[w] += dig_delta(fp, 0, m);
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

void kvp__index_set_prefix_closed(kvp_index *ix, bool on) {
  ix->closed = on;
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
