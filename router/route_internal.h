/* SPDX-License-Identifier: Apache-2.0 */
/* router/route internals: the router object, its per-worker state and the
 * per-decision scratch that route_policy.c fills and route_receipt.c turns
 * into words.  Not installed.
 *
 * Invariants: ws[w] sums exactly the in-flight table's entries on worker w
 * (requests, tokens, blocks; seconds up to rounding, reset to 0 when the
 * worker's last request completes); scratch[w] is meaningful only while
 * scratch[w].epoch == router->epoch (the decision in progress). */
#ifndef KVP_ROUTE_INTERNAL_H
#define KVP_ROUTE_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvplane/route.h"

/* What the router itself has sent to a worker and not seen complete. */
typedef struct kvp__route_ws {
  uint64_t requests;
  uint64_t tokens; /* uncached prefill tokens */
  uint64_t blocks; /* prompt blocks (Dynamo's active blocks) */
  double seconds;  /* their estimated prefill time */
  /* with the callers' clock (KVP_ROUTE_NOW): the part of `seconds` left at
   * work_t, running down from then; never read above `seconds` */
  double work;
  uint64_t work_t;
} kvp__route_ws;

/* One worker's figures for the decision in progress. */
typedef struct kvp__route_cand {
  uint64_t epoch;              /* == router epoch: match below is set */
  uint32_t m[KVP_TIER_COUNT_]; /* matched prefix blocks per tier */
  uint32_t mflags;             /* KVP_MATCH_* */
  uint32_t cflags;             /* KVP_CAND_* */
  uint64_t matched_blocks, reused_blocks;
  uint64_t load_req; /* requests: queued + running + in flight */
  uint64_t load_guard; /* the guard's load (opts.guard_load) */
  double guard_ref;  /* the load it was compared with */
  double queue_s, recompute_s, load_s, total_s;
  double score;  /* policy's own number, as in the receipt */
  double key[3]; /* policy's order, lexicographic, lower first; ties go to
                    the lower index (or the tie hash where the policy says) */
} kvp__route_cand;

typedef struct kvp__inflight {
  uint64_t id; /* 0 = empty slot */
  uint32_t worker;
  uint32_t pad_;
  uint64_t tokens, blocks;
  double seconds;
} kvp__inflight;

typedef struct kvp__session {
  uint64_t id; /* 0 = empty */
  uint32_t worker;
  uint32_t pad_;
} kvp__session;

struct kvp_router {
  kvp_allocator alloc;
  kvp_router_opts o; /* defaults resolved */
  uint32_t n;
  uint32_t bs;
  double kvb;   /* KV bytes per token */
  double f_lin; /* 2 * params: FLOPs per token before attention */
  double f_att; /* 4 * layers * heads * head_dim: attention FLOPs per token
                   per token of context */
  double f_eff; /* achieved FLOP/s */
  double inv_f_eff;
  /* Tier bandwidths as double bit patterns, written by report_bandwidth from
   * any thread and read by route.  Relaxed: each value stands alone (no other
   * data is published with it) and a stale read only delays a better
   * estimate by one decision. */
  _Atomic uint64_t bw_bits[KVP_TIER_COUNT_];
  _Atomic uint32_t bw_measured; /* bit k: tier k has had a report */
  kvp_worker_load *load;
  kvp__route_ws *ws;
  kvp__route_cand *cand;
  uint64_t epoch;
  kvp__inflight *inflight;
  size_t inflight_mask, inflight_count;
  kvp__session *sessions;
  size_t session_mask;
  kvp_index_match *ixm; /* [n]: kvp_router_route's query scratch */
  kvp_worker_match *wm; /* [n]: ... converted */
  uint64_t rr_next;
  uint64_t next_id;
  /* the decision in progress's kvp_route_request.eligible (NULL: all) */
  const uint64_t *elig;
  uint32_t elig_words;
};

/* The context the receipt writer needs beyond the decision itself. */
typedef struct kvp__route_why {
  const kvp_router *r;
  const kvp_route_request *req;
  uint32_t best_unguarded; /* cheapest ignoring the guard */
  uint32_t runner_up;      /* best alternative to the chosen, or NONE */
  uint32_t n_tied;         /* workers in the tie band (TIE) */
  double guard_ref;        /* guard: load reference of best_unguarded */
  const char *detail;      /* policy-specific clause, may be NULL */
} kvp__route_why;

/* Writes out->reason_text from the decision and `why`. */
void kvp__route_reason(const kvp__route_why *why, kvp_decision *out);

/* "60,000": thousands separators; returns buf. */
const char *kvp__fmt_count(uint64_t v, char buf[32]);

/* Strong 64-bit mix (splitmix64 finaliser). */
static inline uint64_t kvp__mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

#endif /* KVP_ROUTE_INTERNAL_H */
