/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane locality index (router/index): block key -> the (worker, tier)
 * pairs holding it, fed by the workers' KV events or, for engines that publish
 * none, by the router's own routing decisions.  Answers, per request: for this
 * chain of block keys, how long a prefix does every worker hold, and where.
 *
 * Keys are kept as 64-bit fingerprints (kvp_key.lo): two keys with equal `lo`
 * are the same key to the index (docs/architecture.md: indexes may store a
 * fingerprint; tier stores check the full key).  Fingerprints 0 and 1 are reserved
 * internally and alias 2 and 3.
 *
 * Consistency: every event is applied block by block; a concurrent query sees
 * each block's holder set at some instant between the start and the end of
 * the query, never a torn one, and never blocks behind a writer. */
#ifndef KVPLANE_INDEX_H
#define KVPLANE_INDEX_H

#include "kvplane/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Longest chain accepted by stored/removed/record_routed/query (blocks);
 * longer -> KVP_ERANGE.  At 16 tokens per block that is 16M tokens. */
#define KVP_INDEX_CHAIN_MAX (1u << 20)

typedef struct kvp_index kvp_index;

/* Zero value = defaults. */
typedef struct kvp_index_opts {
  /* Worker ids are 0 .. max_workers-1; 0 = KVP_WORKERS_MAX (the limit).
   * <= 64 selects the single-word fast path in queries. */
  uint32_t max_workers;
  /* Approximate mode: (key, worker) records kept from record_routed; the
   * least recently routed are evicted beyond it.  0 = 1<<20, max 1<<26. */
  uint32_t approx_capacity;
  /* Approximate mode: a routed record stops matching approx_ttl_ns after it
   * was last routed.  0 = 120 s. */
  uint64_t approx_ttl_ns;
  /* Presize for this many distinct keys (avoids rehashing while warming up);
   * 0 = start small and grow. */
  uint64_t expected_keys;
  /* 1: the caller promises every worker's cache is prefix-closed tier by
   * tier: for each t, the blocks a worker holds in its t+1 fastest tiers
   * (HBM, then + DRAM, + NVMe, + remote, + routed records) form, along any
   * chain, a prefix.  Engines that evict leaves first keep it: vLLM frees a
   * request's blocks tail first and touches shared prefixes with every use;
   * SGLang's radix cache evicts leaves only; a tier manager that demotes what
   * HBM evicts keeps HBM a prefix and HBM+DRAM a longer one.  Queries whose
   * first block is held in at most 4 groups of 64 worker ids (0-63, 64-127,
   * ...; so every query when max_workers <= 64) then bisect the chain
   * instead of walking it: about d log2(n) probes for d distinct per-tier
   * prefix lengths, issued a round at a time so their memory misses
   * overlap.  Every probe also checks the contract
   * against the probes around it; a violation seen is counted
   * (stats.closure_violations) and that query walks the chain instead.  A
   * hole between probes is not seen: the answer then over-counts that
   * worker's prefix (a routing hint only: the engine's own cache decides
   * what is reused; a wrong index never serves wrong KV).  0 = walk every
   * query (exact for any residency pattern). */
  uint32_t prefix_closed;
  uint32_t reserved[7];
} kvp_index_opts;

/* Creates an empty index with no workers.  opts may be NULL (defaults); the
 * allocator (NULL = libc) is copied and serves every allocation.  Returns 0,
 * KVP_EINVAL (out NULL, reserved fields not zero), KVP_ERANGE (max_workers >
 * KVP_WORKERS_MAX, approx_capacity > 1<<26) or KVP_ENOMEM. */
KVP_API int kvp_index_create(const kvp_index_opts *opts,
                             const kvp_allocator *alloc, kvp_index **out);
/* Frees everything.  NULL is a no-op.  No other call may be in flight. */
KVP_API void kvp_index_destroy(kvp_index *ix);

/* ---- workers ----------------------------------------------------------------
 * A worker must be added before its events are accepted.  Its event sequence
 * numbers start at 1 (a resync sets another base).  Both are thread-safe; they
 * serialize with that worker's events. */

/* Returns 0, KVP_ERANGE (worker >= max_workers), KVP_EEXIST (already added). */
KVP_API int kvp_index_worker_add(kvp_index *ix, uint32_t worker);
/* Forgets the worker: queries stop reporting it at once, then every residency
 * and routed record of it is dropped (a scan of the index).  Its later events
 * are rejected with KVP_ENOENT until it is added again.  Returns 0,
 * KVP_ERANGE or KVP_ENOENT (not added). */
KVP_API int kvp_index_worker_remove(kvp_index *ix, uint32_t worker);

/* ---- events -----------------------------------------------------------------
 * One worker's events carry consecutive sequence numbers.  seq <= the last
 * applied one: the event is dropped, counted (stats.events_stale) and
 * KVP_EEXIST is returned.  seq > last + 1: events were lost, the event is
 * applied, the gap counted and the worker marked uncertain: queries flag its
 * matches until a resync replaces its key set (with streams, below: until
 * that stream is resynced or begins a new epoch).
 *
 * Common errors, counted in stats and leaving the index unchanged:
 * KVP_ERANGE (worker >= max_workers, or n > KVP_INDEX_CHAIN_MAX), KVP_ENOENT
 * (worker not added, or removed), KVP_EINVAL (ix NULL, keys NULL with n > 0,
 * tier out of range).  KVP_ENOMEM part way through leaves the event partly
 * applied and the worker uncertain.
 *
 * Thread-safe: events of one worker serialize on that worker, events of
 * different workers run in parallel; none ever blocks a query.  Keys are read
 * during the call only. */

/* `keys[0..n)` (a run of one chain) are now in `tier` on `worker`; `parent` is
 * the key before keys[0] in the chain, NULL at the chain's root.  A parent not
 * resident on the worker is counted (stats.orphan_stores): a sign of a lost
 * event.  Returns the number of keys newly resident in that tier (>= 0). */
KVP_API int kvp_index_stored(kvp_index *ix, uint32_t worker, uint64_t seq,
                             kvp_tier tier, const kvp_key *parent,
                             const kvp_key *keys, size_t n);
/* `keys[0..n)` left `tier` on `worker` (other tiers are untouched).  Returns
 * the number of keys that were resident in that tier (>= 0). */
KVP_API int kvp_index_removed(kvp_index *ix, uint32_t worker, uint64_t seq,
                              kvp_tier tier, const kvp_key *keys, size_t n);
/* The worker dropped its whole cache (every tier) and the routed records of
 * it.  Scans the index.  Returns 0. */
KVP_API int kvp_index_cleared(kvp_index *ix, uint32_t worker, uint64_t seq);
/* Replace the worker's whole key set with `keys[i]` in `tiers[i]` (tiers NULL:
 * all HBM), its state as of sequence number `seq`: events with seq' <= seq are
 * dropped afterwards, seq + 1 is expected next.  Always accepted (a snapshot
 * is authoritative); clears the uncertain mark.  Keys in both the old and the
 * new set stay visible to queries throughout; the others come and go during
 * the call.  (As stream 0 at epoch 0: stale once stream 0 is at a larger
 * epoch.)  n is not capped by KVP_INDEX_CHAIN_MAX.  Returns the number of
 * distinct keys now resident on the worker, or an error as above (an invalid
 * tier -> KVP_EINVAL before anything changes). */
KVP_API int kvp_index_resync(kvp_index *ix, uint32_t worker, uint64_t seq,
                             const kvp_key *keys, const uint8_t *tiers,
                             size_t n);

/* A hint for a caller holding a batch of events (a KVEventBatch, a
 * simulator's queue): loads into the CPU cache the table lines an event on
 * keys[0..n) reads first (each key's bucket pair), so that, issued a few
 * events ahead of the one being applied, the next events' memory misses
 * overlap with the current one's work instead of following it.  Changes
 * nothing and takes no lock.  Returns 0, or KVP_EINVAL (ix NULL, keys NULL
 * with n > 0).  Thread-safe. */
KVP_API int kvp_index_prefetch(kvp_index *ix, const kvp_key *keys, size_t n);

/* ---- event streams and epochs ----------------------------------------------
 * A worker's residency may come from several publishers, each numbering its
 * events on its own: the engine (HBM, CPU offload), a kvtier store (DRAM,
 * NVMe).  Each is a stream: (worker, stream < KVP_INDEX_STREAMS), with its
 * own sequence numbers and an epoch.  The calls above are stream 0 at
 * epoch 0.
 *
 * Epoch: a publisher that restarts numbers its events from the start again;
 * it (or the connector that notices the restart) passes a larger epoch.  The
 * first event of a larger epoch first drops what the stream made resident
 * in its old epoch -- the worker's residencies in every tier the stream
 * stored into since its epoch began (stats.epoch_drops) -- then starts the
 * sequence again: seq 1 is expected next, a larger one is a gap (the worker
 * turns uncertain).  An event of a smaller epoch is stale: dropped, counted
 * (stats.events_stale), KVP_EEXIST.  Streams of one worker should feed
 * disjoint tiers: a restart of one drops the tiers it fed for all streams of
 * that worker (a lost routing hint, never a wrong one).  Within an epoch the
 * sequence rules above hold per stream.  kvp_index_worker_add starts every
 * stream of the worker afresh (epoch 0, nothing applied).
 *
 * Same errors, counting and thread safety as the calls above, plus
 * KVP_ERANGE for stream >= KVP_INDEX_STREAMS. */
#define KVP_INDEX_STREAMS 4u

typedef struct kvp_index_src {
  uint32_t worker;
  uint32_t stream; /* < KVP_INDEX_STREAMS */
  uint64_t epoch;  /* the publisher's life; larger = newer */
  uint64_t seq;    /* 1, 2, ... within the epoch */
} kvp_index_src;

KVP_API int kvp_index_src_stored(kvp_index *ix, const kvp_index_src *src,
                                 kvp_tier tier, const kvp_key *parent,
                                 const kvp_key *keys, size_t n);
KVP_API int kvp_index_src_removed(kvp_index *ix, const kvp_index_src *src,
                                  kvp_tier tier, const kvp_key *keys, size_t n);
/* The stream's publisher dropped everything it held: the worker's
 * residencies in the tiers the stream stored into this epoch go (routed
 * records stay; kvp_index_cleared, stream 0, drops every tier and them).
 * Returns the number of (key, tier) residencies dropped. */
KVP_API int kvp_index_src_cleared(kvp_index *ix, const kvp_index_src *src);
/* Snapshot of the stream's state as of (epoch, seq): the worker's
 * residencies in the tiers set in `tier_mask` (bit 1 << kvp_tier) become
 * exactly keys[i] in tiers[i] (tiers NULL: the lowest tier in the mask);
 * other tiers are untouched; the stream's epoch and sequence are set (a
 * smaller epoch than the stream's is still stale) and its uncertain mark
 * cleared (every stream's when the mask holds every tier).  At a larger
 * epoch the old epoch's tiers outside the mask are dropped too, in the same
 * sweep: keys in both the old residency and the snapshot stay visible.  A
 * tier outside the mask, or a mask bit >= KVP_TIER_COUNT_ -> KVP_EINVAL
 * (before anything changes); n is not capped.  This is how a connector
 * rebuilds a restarted kvtier store's residency from kvp_tier_keys_each().
 * Returns the number of distinct keys now resident in those tiers. */
KVP_API int kvp_index_src_resync(kvp_index *ix, const kvp_index_src *src,
                                 uint32_t tier_mask, const kvp_key *keys,
                                 const uint8_t *tiers, size_t n);

typedef struct kvp_index_stream_info {
  uint64_t epoch;
  uint64_t last_seq;  /* 0: none in this epoch yet */
  /* tiers stored into this epoch, a snapshot's mask included (bit
   * 1 << kvp_tier): what a larger epoch will drop */
  uint32_t tier_mask;
  uint32_t reserved32;
  uint64_t reserved[2];
} kvp_index_stream_info;
/* Returns 0, KVP_EINVAL, KVP_ERANGE or KVP_ENOENT (worker not added). */
KVP_API int kvp_index_stream_get(kvp_index *ix, uint32_t worker,
                                 uint32_t stream, kvp_index_stream_info *out);

/* Calls fn(opaque, fingerprint, tier_mask) once per key resident on `worker`
 * from events (tier_mask: bit 1 << kvp_tier; routed records are not listed),
 * shard by shard, in no particular order; a key stored or removed during the
 * walk may or may not be listed, any other is listed once, with its mask.
 * Each shard's keys are copied under its lock (a scan, as worker_remove's)
 * and fn runs with no lock held.  fn returning non-zero stops the walk and
 * that value is returned.  fn must not call into the index.  Returns 0,
 * fn's value, KVP_EINVAL (ix or fn NULL), KVP_ERANGE, KVP_ENOENT or
 * KVP_ENOMEM (the copy).  Fingerprints 0 and 1 come back as 2 and 3 (see
 * above).  Thread-safe. */
typedef int (*kvp_index_key_fn)(void *opaque, uint64_t fp, uint32_t tier_mask);
KVP_API int kvp_index_worker_keys(kvp_index *ix, uint32_t worker,
                                  kvp_index_key_fn fn, void *opaque);

/* ---- approximate mode
 * --------------------------------------------------------- For engines that
 * publish no events (SGLang's gateway, Dynamo's approximate mode): the router
 * records each chain it routed to a worker; those records match for
 * approx_ttl_ns after the latest routing, and the least recently routed go
 * first beyond approx_capacity.  Time is the caller's (any monotonic nanosecond
 * clock, e.g. kvp_now_ns() or a simulator's), never read by the index.
 * Thread-safe; the calls serialize with each other, never with queries. */

/* Records keys[0..n) as routed to `worker` at now_ns (refreshing records that
 * exist).  Also drops records expired at now_ns.  Returns the number of new
 * records, KVP_EINVAL, KVP_ERANGE, KVP_ENOENT or KVP_ENOMEM (some keys may be
 * recorded). */
KVP_API int kvp_index_record_routed(kvp_index *ix, uint32_t worker,
                                    const kvp_key *keys, size_t n,
                                    uint64_t now_ns);
/* A prefill in progress on an engine WITH events: records keys[0..n) as
 * routed to `worker` at now_ns for life_ns only (at most the index TTL,
 * approx_ttl_ns), so that queries see the chain on that worker before the
 * engine's events report its blocks (they do once the prefill ran: a
 * request arriving meanwhile would otherwise find no holder).  Pass what
 * the worker does not already hold, for about the predicted time to first
 * token plus the events' delay.  Such records are routed records in every
 * other way (routed_blocks, stats.routed, capacity, purge); a routed record
 * still live that one refreshes stays routed (the index TTL).  life_ns 0
 * records nothing.  Returns as kvp_index_record_routed. */
KVP_API int kvp_index_record_pending(kvp_index *ix, uint32_t worker,
                                     const kvp_key *keys, size_t n,
                                     uint64_t now_ns, uint64_t life_ns);
/* Drops every routed record expired at now_ns (they no longer match anyway;
 * this returns their memory).  Returns how many, or KVP_EINVAL. */
KVP_API int kvp_index_expire(kvp_index *ix, uint64_t now_ns);
/* Changes approx_ttl_ns (kvp_index_opts; 0 = the default, 120 s) of a live
 * index, e.g. on a config reload: from the next query, record_routed or
 * expire on, a routed record matches for ttl_ns after its latest routing
 * (records already kept are judged by the new TTL).  Returns 0 or
 * KVP_EINVAL (NULL ix).  Thread-safe; a query running meanwhile uses the
 * old TTL or the new one. */
KVP_API int kvp_index_set_approx_ttl(kvp_index *ix, uint64_t ttl_ns);

/* ---- query
 * ------------------------------------------------------------------- */

/* One worker's match for a chain.  prefix_blocks = the longest prefix of the
 * chain resident on the worker (any tier, or routed); each of those blocks is
 * counted once, in the fastest tier holding it (tier_blocks[KVP_TIER_HBM]
 * first), or in routed_blocks when only a routing record holds it, so
 * prefix_blocks == sum(tier_blocks) + routed_blocks. */
typedef struct kvp_index_match {
  uint32_t worker;
  uint32_t prefix_blocks;
  uint32_t tier_blocks[KVP_TIER_COUNT_]; /* indexed by kvp_tier */
  uint32_t routed_blocks;
  /* 1: the worker lost events (a sequence gap) and has not been resynced
   * since; its residencies may be wrong either way: weigh them down. */
  uint8_t uncertain;
  uint8_t reserved8[3];
  uint32_t reserved[2];
} kvp_index_match;
#if defined(__cplusplus)
static_assert(sizeof(kvp_index_match) == 40, "kvp_index_match is ABI");
#else
_Static_assert(sizeof(kvp_index_match) == 40, "kvp_index_match is ABI");
#endif

/* How many leading keys of keys[0..n) some worker has ever held (any tier,
 * any time since the index was made) or been routed to
 * (kvp_index_record_routed), into *out: for a chained prompt, the blocks past
 * it were never seen, those before it and held by no worker now were
 * evicted (kvp_route_request.seen_blocks).  A Bloom filter of two probes,
 * 16 bits per expected_key (1 MiB at least): a key never seen reads as seen
 * with ~1.4 % probability at that load, more beyond it; a key seen always
 * reads as seen.  Returns 0 or KVP_EINVAL.  Thread-safe (relaxed reads: a
 * key stored concurrently may read either way). */
KVP_API int kvp_index_seen_prefix(kvp_index *ix, const kvp_key *keys,
                                  size_t n, size_t *out);

/* For the chain keys[0..n) (block 0 first), every worker holding at least its
 * first block, in increasing worker id, with the match defined above; routed
 * records count if not expired at now_ns (pass any value when approximate
 * mode is unused).  Stops reading the chain as soon as no worker still holds
 * every block so far; with opts.prefix_closed bisects it instead when
 * block 0's holders fall in at most 4 groups of 64 worker ids (see
 * kvp_index_opts).  Writes min(count, cap) matches to out and returns the
 * count (which may exceed cap: size out for max_workers to get all), or
 * KVP_EINVAL (ix NULL, keys NULL with n > 0, out NULL with cap > 0),
 * KVP_ERANGE (n > KVP_INDEX_CHAIN_MAX), KVP_ENOMEM (more than 4 worker groups
 * of 64 hold block 0 and scratch could not be allocated).
 * Thread-safe and lock-free: never waits for a writer (it claims one of 128
 * reader slots for the call; a 129th concurrent reader spins until one
 * frees). */
KVP_API int kvp_index_query(kvp_index *ix, const kvp_key *keys, size_t n,
                            uint64_t now_ns, kvp_index_match *out, size_t cap);

/* ---- divergence digest ---------------------------------------------------
 * A worker's digest
 * is the wrapping sum over its (key, tier) residencies of a 64-bit mix of
 * (fingerprint, tier): order-independent, updated with every event, computable
 * by the worker from its own key list.  Equal sets give equal digests; a
 * difference is missed with probability ~2^-64 per comparison.  Routed records
 * are not part of it. */

/* The index's digest of `worker` (waits for that worker's event in flight).
 * Returns 0, KVP_EINVAL, KVP_ERANGE or KVP_ENOENT. */
KVP_API int kvp_index_digest(kvp_index *ix, uint32_t worker, uint64_t *digest);
/* The digest of a key list as a worker would compute it: keys[i] in tiers[i]
 * (tiers NULL: all HBM).  The list is a set: a (key, tier) pair listed twice
 * counts twice.  Returns 0 or KVP_EINVAL (digest NULL, keys NULL with n > 0,
 * tier out of range).  Thread-safe (pure). */
KVP_API int kvp_index_digest_of(const kvp_key *keys, const uint8_t *tiers,
                                size_t n, uint64_t *digest);

/* ---- introspection
 * ---------------------------------------------------------------- */
typedef struct kvp_index_worker_info {
  uint64_t last_seq;    /* stream 0's last sequence number (0: none yet) */
  uint64_t digest;      /* as kvp_index_digest */
  uint64_t residencies; /* keys resident on the worker (any tier) */
  uint8_t uncertain;    /* some stream of it */
  uint8_t reserved8[7];
  uint64_t reserved[3];
} kvp_index_worker_info;

/* One consistent view of a worker (waits for its event in flight).  Returns
 * 0, KVP_EINVAL, KVP_ERANGE or KVP_ENOENT. */
KVP_API int kvp_index_worker_get(kvp_index *ix, uint32_t worker,
                                 kvp_index_worker_info *out);

typedef struct kvp_index_stats {
  uint64_t keys;        /* distinct fingerprints resident on some worker */
  uint64_t residencies; /* (key, worker) pairs from events, any tier */
  uint64_t routed;      /* (key, worker) routed records held (some expired) */
  uint64_t bytes;       /* memory the index holds, all of it */
  uint32_t workers;     /* added */
  uint32_t uncertain_workers;
  uint64_t events_applied;
  uint64_t events_stale;          /* seq <= last: dropped */
  uint64_t seq_gaps;              /* events after lost ones */
  uint64_t events_unknown_worker; /* worker >= max, never added or removed */
  uint64_t events_invalid;        /* bad arguments, oversized chains */
  uint64_t orphan_stores;         /* stored with a parent not resident */
  uint64_t resyncs;
  uint64_t routed_expired; /* routed records dropped by TTL */
  uint64_t routed_evicted; /* routed records dropped by the capacity */
  uint64_t queries;
  uint64_t query_blocks; /* blocks queries looked up (early stop shows) */
  /* prefix_closed queries whose probes contradicted the contract (they
   * walked the chain instead) */
  uint64_t closure_violations;
  /* epochs begun by a stream that had accepted an event or snapshot since
   * its worker was added (restarts) */
  uint64_t epochs;
  /* (key, tier) residencies dropped by the event that began an epoch (a
   * snapshot: by its whole sweep) */
  uint64_t epoch_drops;
  uint64_t reserved[2];
} kvp_index_stats;

/* Counters, each read atomically but not all at one instant.  Thread-safe,
 * lock-free.  Returns 0 or KVP_EINVAL. */
KVP_API int kvp_index_stats_get(kvp_index *ix, kvp_index_stats *out);

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_INDEX_H */
