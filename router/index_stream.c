/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: the event protocol.  A worker's events come in streams, one
 * per publisher, each numbered 1, 2, ... within an epoch (index.h).  This
 * file checks and books the sequence numbers and epochs, and applies the
 * events through the table calls of index_internal.h (index_update.c).
 *
 * A stream's state: its epoch and last sequence number (kvp__stream, a side
 * array), the tiers it stored into during the epoch (kvp__worker.smask[s])
 * and whether it lost events (bit s of kvp__worker.uncertain).  A larger
 * epoch ends the old one: the worker's residencies in the old epoch's tiers
 * go, whoever stored them (streams should feed disjoint tiers), and the
 * sequence restarts with its uncertainty cleared: what the lost events
 * would have changed went with the old epoch.  The tier mask only grows
 * within an epoch (removals and clears leave it): it says where the epoch
 * may have left residencies.
 *
 * Every event of a worker, whatever its stream, runs under the worker's
 * lock (taken first; lock order in index_impl.h), so one worker's streams
 * serialize with each other and with worker_add/remove. */
#include <limits.h>
#include <stdatomic.h>
#include <string.h>

#include "index_internal.h"

#define NTIERS ((unsigned)KVP_TIER_COUNT_)
#define ALL_TIERS ((1u << NTIERS) - 1u)

typedef enum { EV_SEQ, EV_RESYNC } ev_kind;

typedef struct ev { /* an event in flight; its worker is locked */
  kvp_index *ix;
  kvp_index_src src;
  kvp__worker *wk;
  kvp__stream *st;
  kvp__acc a;
  bool new_epoch; /* src.epoch > the stream's (a resync switches itself) */
} ev;

static int clamp_int(uint64_t n) { return n > INT_MAX ? INT_MAX : (int)n; }

/* Relaxed: the marks are hints for queries; they are written under the
 * worker's lock, so the RMWs never race with each other. */
static void uncertain_set(kvp__worker *wk, uint32_t bits) {
  atomic_fetch_or_explicit(&wk->uncertain, bits, memory_order_relaxed);
}

static void uncertain_clear(kvp__worker *wk, uint32_t bits) {
  atomic_fetch_and_explicit(&wk->uncertain, ~bits, memory_order_relaxed);
}

/* Something was accepted on the stream since its worker was added: a new
 * epoch is then a restart (stats.epochs), not the stream's first. */
static bool stream_begun(const ev *e) {
  return e->st->epoch != 0 || e->st->last_seq != 0 ||
         e->wk->smask[e->src.stream] != 0;
}

/* The stream enters src.epoch; `dropped` residencies went with the old. */
static void epoch_begin(ev *e, uint64_t dropped) {
  if (stream_begun(e))
    kvp__index_count(e->ix, KVP__C_EPOCHS, 1);
  kvp__index_count(e->ix, KVP__C_EPOCH_DROPS, dropped);
  e->st->epoch = e->src.epoch;
  e->st->last_seq = 0;
  e->wk->smask[e->src.stream] = 0;
  uncertain_clear(e->wk, 1u << e->src.stream);
}

/* An event's epoch and sequence number against its stream's.  A resync
 * only has its epoch checked: the snapshot sets the rest. */
static int ev_check(ev *e, ev_kind kind) {
  if (atomic_load_explicit(&e->wk->state, memory_order_relaxed) !=
      KVP__W_ACTIVE) {
    kvp__index_count(e->ix, KVP__C_UNKNOWN, 1);
    return KVP_ENOENT;
  }
  e->new_epoch = e->src.epoch > e->st->epoch;
  uint64_t last = e->new_epoch ? 0 : e->st->last_seq;
  if (e->src.epoch < e->st->epoch || (kind == EV_SEQ && e->src.seq <= last)) {
    kvp__index_count(e->ix, KVP__C_STALE, 1);
    return KVP_EEXIST;
  }
  if (kind == EV_RESYNC)
    return 0;
  if (e->new_epoch) {
    kvp__index_drop(e->ix, e->src.worker, e->wk->smask[e->src.stream], &e->a);
    epoch_begin(e, e->a.dropped);
  }
  if (e->src.seq != e->st->last_seq + 1) {
    kvp__index_count(e->ix, KVP__C_GAPS, 1);
    uncertain_set(e->wk, 1u << e->src.stream);
  }
  e->st->last_seq = e->src.seq;
  return 0;
}

/* Locks the event's worker and checks the event against its stream; on
 * success the caller ends with ev_leave. */
static int ev_enter(ev *e, kvp_index *ix, const kvp_index_src *src,
                    ev_kind kind) {
  memset(e, 0, sizeof *e);
  e->ix = ix;
  e->src = *src;
  if (src->stream >= KVP_INDEX_STREAMS) {
    kvp__index_count(ix, KVP__C_INVALID, 1);
    return KVP_ERANGE;
  }
  if ((e->wk = kvp__index_worker(ix, src->worker)) == NULL) {
    kvp__index_count(ix, KVP__C_UNKNOWN, 1);
    return KVP_ERANGE;
  }
  e->st = &kvp__index_streams(ix, src->worker)[src->stream];
  kvp__spin_lock(&e->wk->lock);
  int rc = ev_check(e, kind);
  if (rc < 0)
    kvp__spin_unlock(&e->wk->lock);
  return rc;
}

/* Books the event's effect and unlocks.  A failure with `mark` leaves the
 * worker's set unknown, hence the stream uncertain. */
static int ev_leave(ev *e, int rc, bool mark) {
  kvp__worker *wk = e->wk;
  uint64_t d = atomic_load_explicit(&wk->digest, memory_order_relaxed);
  uint64_t r = atomic_load_explicit(&wk->nres, memory_order_relaxed);
  atomic_store_explicit(&wk->digest, d + e->a.digest, memory_order_relaxed);
  atomic_store_explicit(&wk->nres, r + (uint64_t)e->a.nres,
                        memory_order_relaxed);
  if (rc < 0 && mark)
    uncertain_set(wk, 1u << e->src.stream);
  kvp__spin_unlock(&wk->lock);
  if (rc >= 0)
    kvp__index_count(e->ix, KVP__C_APPLIED, 1);
  return rc;
}

static int src_args(kvp_index *ix, const kvp_index_src *src, int tier,
                    const kvp_key *keys, size_t n) {
  int rc = kvp__index_args(ix, tier, keys, n);
  if (rc == 0 && src == NULL) {
    kvp__index_count(ix, KVP__C_INVALID, 1);
    rc = KVP_EINVAL;
  }
  return rc;
}

/* ---- events ------------------------------------------------------------- */

int kvp_index_src_stored(kvp_index *ix, const kvp_index_src *src,
                         kvp_tier tier, const kvp_key *parent,
                         const kvp_key *keys, size_t n) {
  ev e;
  int rc = src_args(ix, src, (int)tier, keys, n);
  if (rc < 0 || (rc = ev_enter(&e, ix, src, EV_SEQ)) < 0)
    return rc;
  if (parent != NULL && !kvp__index_holds(ix, src->worker, *parent))
    kvp__index_count(ix, KVP__C_ORPHAN, 1);
  /* before the keys: a failure part way leaves some in that tier */
  e.wk->smask[src->stream] |= (uint8_t)(1u << tier);
  uint64_t before = e.a.changed; /* an epoch switch may have changed some */
  rc = kvp__index_apply(ix, src->worker, 1u << tier, 0, keys, n, &e.a);
  return ev_leave(&e, rc < 0 ? rc : clamp_int(e.a.changed - before), true);
}

int kvp_index_src_removed(kvp_index *ix, const kvp_index_src *src,
                          kvp_tier tier, const kvp_key *keys, size_t n) {
  ev e;
  int rc = src_args(ix, src, (int)tier, keys, n);
  if (rc < 0 || (rc = ev_enter(&e, ix, src, EV_SEQ)) < 0)
    return rc;
  uint64_t before = e.a.changed;
  rc = kvp__index_apply(ix, src->worker, 0, 1u << tier, keys, n, &e.a);
  return ev_leave(&e, rc < 0 ? rc : clamp_int(e.a.changed - before), true);
}

/* whole: every tier and the routed records (kvp_index_cleared), else the
 * tiers the stream stored into this epoch. */
static int cleared(kvp_index *ix, const kvp_index_src *src, bool whole) {
  ev e;
  int rc = src_args(ix, src, 0, NULL, 0);
  if (rc < 0 || (rc = ev_enter(&e, ix, src, EV_SEQ)) < 0)
    return rc;
  uint64_t before = e.a.dropped;
  kvp__index_drop(ix, src->worker, whole ? ALL_TIERS : e.wk->smask[src->stream],
                  &e.a);
  if (whole)
    kvp__index_purge_routed(ix, src->worker);
  return ev_leave(&e, clamp_int(e.a.dropped - before), true);
}

int kvp_index_src_cleared(kvp_index *ix, const kvp_index_src *src) {
  return cleared(ix, src, false);
}

/* ---- snapshots ---------------------------------------------------------- */

static int resync_args(kvp_index *ix, const kvp_index_src *src,
                       uint32_t tier_mask, const kvp_key *keys,
                       const uint8_t *tiers, size_t n) {
  int rc = src_args(ix, src, 0, keys, 0); /* n is not capped */
  if (rc < 0)
    return rc;
  if ((keys == NULL && n > 0) || (tier_mask & ~ALL_TIERS) != 0 ||
      (tiers == NULL && n > 0 && tier_mask == 0))
    rc = KVP_EINVAL;
  for (size_t i = 0; rc == 0 && tiers != NULL && i < n; i++)
    if (tiers[i] >= NTIERS || ((tier_mask >> tiers[i]) & 1u) == 0)
      rc = KVP_EINVAL;
  if (rc < 0)
    kvp__index_count(ix, KVP__C_INVALID, 1);
  return rc;
}

/* The snapshot is in: the stream is at (src.epoch, src.seq) and certain;
 * one that covers every tier replaced what every stream put there. */
static void resync_done(ev *e, uint32_t tier_mask) {
  if (e->new_epoch)
    epoch_begin(e, e->a.dropped);
  e->wk->smask[e->src.stream] |= (uint8_t)tier_mask;
  e->st->last_seq = e->src.seq;
  uncertain_clear(e->wk,
                  tier_mask == ALL_TIERS ? UINT32_MAX : 1u << e->src.stream);
  kvp__index_count(e->ix, KVP__C_RESYNCS, 1);
}

int kvp_index_src_resync(kvp_index *ix, const kvp_index_src *src,
                         uint32_t tier_mask, const kvp_key *keys,
                         const uint8_t *tiers, size_t n) {
  ev e;
  int rc = resync_args(ix, src, tier_mask, keys, tiers, n);
  if (rc < 0 || (rc = ev_enter(&e, ix, src, EV_RESYNC)) < 0)
    return rc;
  /* A new epoch's first event drops the old epoch's tiers: folded into the
   * snapshot's sweep, so keys in both the old residency and the snapshot
   * never disappear from queries. */
  uint32_t old = e.new_epoch ? e.wk->smask[src->stream] : 0;
  unsigned dflt = tier_mask != 0 ? (unsigned)__builtin_ctz(tier_mask) : 0;
  rc = kvp__index_replace(ix, src->worker, tier_mask | old, keys, tiers, dflt,
                          n, &e.a);
  if (rc < 0) /* the stream stays where it was; uncertain if changed */
    return ev_leave(&e, rc, e.a.changed != 0);
  resync_done(&e, tier_mask);
  return ev_leave(&e, rc, false);
}

/* ---- the per-worker calls: stream 0 at epoch 0 -------------------------- */

int kvp_index_stored(kvp_index *ix, uint32_t worker_id, uint64_t seq,
                     kvp_tier tier, const kvp_key *parent, const kvp_key *keys,
                     size_t n) {
  kvp_index_src src = {.worker = worker_id, .seq = seq};
  return kvp_index_src_stored(ix, &src, tier, parent, keys, n);
}

int kvp_index_removed(kvp_index *ix, uint32_t worker_id, uint64_t seq,
                      kvp_tier tier, const kvp_key *keys, size_t n) {
  kvp_index_src src = {.worker = worker_id, .seq = seq};
  return kvp_index_src_removed(ix, &src, tier, keys, n);
}

int kvp_index_cleared(kvp_index *ix, uint32_t worker_id, uint64_t seq) {
  kvp_index_src src = {.worker = worker_id, .seq = seq};
  int rc = cleared(ix, &src, true);
  return rc < 0 ? rc : 0;
}

int kvp_index_resync(kvp_index *ix, uint32_t worker_id, uint64_t seq,
                     const kvp_key *keys, const uint8_t *tiers, size_t n) {
  kvp_index_src src = {.worker = worker_id, .seq = seq};
  return kvp_index_src_resync(ix, &src, ALL_TIERS, keys, tiers, n);
}

/* ---- introspection ------------------------------------------------------ */

int kvp_index_stream_get(kvp_index *ix, uint32_t worker_id, uint32_t stream,
                         kvp_index_stream_info *out) {
  if (ix == NULL || out == NULL)
    return KVP_EINVAL;
  kvp__worker *wk = kvp__index_worker(ix, worker_id);
  if (wk == NULL || stream >= KVP_INDEX_STREAMS)
    return KVP_ERANGE;
  const kvp__stream *st = &kvp__index_streams(ix, worker_id)[stream];
  int rc = 0;
  kvp__spin_lock(&wk->lock);
  if (atomic_load_explicit(&wk->state, memory_order_relaxed) !=
      KVP__W_ACTIVE) {
    rc = KVP_ENOENT;
  } else {
    memset(out, 0, sizeof *out);
    out->epoch = st->epoch;
    out->last_seq = st->last_seq;
    out->tier_mask = wk->smask[stream];
  }
  kvp__spin_unlock(&wk->lock);
  return rc;
}
