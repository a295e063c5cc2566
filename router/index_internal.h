/* SPDX-License-Identifier: Apache-2.0 */
/* router/index internals: what the event protocol (index_stream.c) uses of
 * the tables, and, for the tests and the benchmark, a consistency check.
 * The index's own structure is in index_impl.h.  Not installed. */
#ifndef KVP_INDEX_INTERNAL_H
#define KVP_INDEX_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "index_spin.h"
#include "kvplane/index.h"

/* ---- the tables' side of the event protocol --------------------------------
 * index_update.c and index_api.c keep the tables' side (index_impl.h lists
 * the files); index_stream.c applies events to them: per (worker, stream)
 * sequence numbers and epochs.  What the second needs of the first is
 * below.  All of it is called with the worker's lock held (lock order:
 * worker -> shard -> retire; worker -> approx). */

enum { KVP__W_ABSENT = 0, KVP__W_ACTIVE = 1 };

/* One per worker id, one cache line (queries read state and uncertain). */
typedef struct kvp__worker {
  kvp__spin lock;         /* this worker's events, add/remove, get */
  _Atomic uint32_t state; /* KVP__W_*; see kvp_index_worker_add */
  /* Bit s: stream s lost events (or failed to apply one) since its last
   * resync or epoch.  Queries flag the worker while any bit is set; written
   * under lock, read relaxed (a hint). */
  _Atomic uint32_t uncertain;
  uint8_t smask[KVP_INDEX_STREAMS]; /* under lock: tiers stream s stored into
                                       in its epoch (bit 1 << kvp_tier) */
  _Atomic uint64_t digest; /* written under lock; relaxed */
  _Atomic uint64_t nres;   /* written under lock; relaxed */
  char pad_[32];
} kvp__worker;
_Static_assert(sizeof(kvp__worker) == 64, "one line per worker");

/* A stream's position, in a side array (KVP_INDEX_STREAMS per worker id, so
 * the worker's line stays what queries read).  Under the worker's lock. */
typedef struct kvp__stream {
  uint64_t epoch;
  uint64_t last_seq; /* 0: none in this epoch */
} kvp__stream;

/* An event's effect on its worker, accumulated by the table updates. */
typedef struct kvp__acc {
  uint64_t digest;  /* wrapping delta */
  int64_t nres;     /* keys gained - keys lost (any tier) */
  uint64_t changed; /* keys whose mask changed */
  uint64_t dropped; /* (key, tier) residencies removed */
} kvp__acc;

typedef enum kvp__ctr {
  KVP__C_APPLIED,
  KVP__C_STALE,
  KVP__C_GAPS,
  KVP__C_UNKNOWN,
  KVP__C_INVALID,
  KVP__C_ORPHAN,
  KVP__C_RESYNCS,
  KVP__C_EPOCHS,
  KVP__C_EPOCH_DROPS,
  KVP__C_COUNT_
} kvp__ctr;

/* Checks an event's common arguments: KVP_EINVAL (ix NULL, tier out of
 * range, keys NULL with n > 0), KVP_ERANGE (n > KVP_INDEX_CHAIN_MAX); counts
 * them (stats.events_invalid) unless ix is NULL. */
int kvp__index_args(kvp_index *ix, int tier, const kvp_key *keys, size_t n);
/* Adds n to a stats counter (relaxed). */
void kvp__index_count(kvp_index *ix, kvp__ctr c, uint64_t n);
/* Worker w's record and its streams, or NULL when w >= max_workers. */
kvp__worker *kvp__index_worker(kvp_index *ix, uint32_t w);
kvp__stream *kvp__index_streams(kvp_index *ix, uint32_t w);
/* keys[0..n) on worker w: tier bits `add` set, then `del` cleared.
 * KVP_ENOMEM part way leaves the keys before it applied. */
int kvp__index_apply(kvp_index *ix, uint32_t w, uint32_t add, uint32_t del,
                     const kvp_key *keys, size_t n, kvp__acc *a);
/* Worker w holds k in some tier. */
bool kvp__index_holds(kvp_index *ix, uint32_t w, kvp_key k);
/* Drops worker w's residencies in `tiers` (a scan of every shard). */
void kvp__index_drop(kvp_index *ix, uint32_t w, uint32_t tiers, kvp__acc *a);
/* Worker w's residencies in `tiers` become exactly keys[i] in kt[i] (kt
 * NULL: tier dflt); every kt[i] must be in `tiers`.  New keys go in first,
 * then a sweep drops the rest, so keys in both sets stay visible.  Returns
 * the number of distinct keys, or KVP_ENOMEM (a->changed == 0: nothing
 * changed). */
int kvp__index_replace(kvp_index *ix, uint32_t w, uint32_t tiers,
                       const kvp_key *keys, const uint8_t *kt, unsigned dflt,
                       size_t n, kvp__acc *a);
/* Drops worker w's routing records (approximate mode). */
void kvp__index_purge_routed(kvp_index *ix, uint32_t w);

/* Recomputes, from the tables, every worker's digest and residency count and
 * the key counts, and compares them with the incrementally kept ones; also
 * checks every holder set's encoding.  Call only while no writer runs.
 * Returns 0 or KVP_ECORRUPT (and logs what differs). */
int kvp__index_verify(kvp_index *ix);

/* Keys that sit `buckets` or more buckets past their home bucket (2: past
 * the pair), whose lookups the query finishes later (pipe_take): tests
 * check they exist.  Call only while no writer runs. */
uint64_t kvp__index_keys_past(kvp_index *ix, uint64_t buckets);
/* Shards whose table is at most half full, where lookups read the home
 * bucket alone (shard.pf_one). */
unsigned kvp__index_home_only_shards(kvp_index *ix);

/* Turns kvp_index_opts.prefix_closed on or off on a live index (tests and the
 * benchmark compare both query plans on one index).  No query in flight. */
void kvp__index_set_prefix_closed(kvp_index *ix, bool on);

/* Turns the prefetching of kvp_index_record_routed/_pending on (the
 * default) or off: bench_route compares both on one index.  No writer in
 * flight. */
void kvp__index_set_record_prefetch(kvp_index *ix, bool on);

#endif /* KVP_INDEX_INTERNAL_H */
