/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane routing (router/route): which worker serves the next request, and a
 * receipt that says why.
 *
 * One interface over seven policies.  The default, KVP_POLICY_KVPLANE_COST,
 * estimates each worker's time to first token (TTFT):
 *
 *   total_s(w)     = queue_s(w) + recompute_s(w) + load_s(w)
 *   queue_s(w)     = reported_prefill_tokens(w) * 2P / F  +  inflight_s(w)
 *                    + (queued(w) + inflight_requests(w) + 1) * overhead
 *   recompute_s(w) = sum over the uncached tokens t in [u, N) of
 *                    (2P + 4 * layers * heads * head_dim * t) / F
 *   load_s(w)      = sum over tiers k of the reused blocks resident on k:
 *                    blocks_k * block_size * kv_bytes_per_token / bw_k + lat_k
 *
 * with N the prompt's tokens, P the parameter count, F = FLOP/s x efficiency,
 * overhead = gpu.prefill_overhead_s (a prefill's fixed cost; 0 by default),
 * inflight_s the estimated prefill time of what this router sent to w and has
 * not seen complete, and u the reused prefix (tokens): of the worker's matched
 * prefix, laid out fastest tier first, the router reuses the prefix cut at the
 * tier boundary that minimises load_s + recompute_s, so a hit is used only
 * when loading it beats recomputing it ("payoff, not hits").  The cheapest
 * worker wins, except that (1) a worker whose request load (opts.guard_load:
 * by default the requests before their first token, queued + this router's
 * in flight) exceeds guard x the mean (or min) of the others' and
 * guard_min_load is excluded unless every worker is, or every worker left
 * has a longer predicted queue than it (the brake would only add wait), (2) a session
 * stays on its last worker while that worker is within epsilon of the best
 * (affinity that costs nothing), and (3) workers within the tie band are
 * broken by a hash of (session or request id, worker, replica id), so router
 * replicas that see the same state do not herd onto one worker.  A stable
 * prefix cached on every worker adds the same load_s everywhere and so drops
 * out of the comparison: only what differs (the semi-stable history, the
 * queue) decides.
 *
 * The six peer policies (round robin, least loaded, prefix greedy, SGLang's
 * cache-aware router, llm-d's weighted scorer, Dynamo's KV router cost) are
 * implemented as their projects publish them so that the benchmark harness
 * compares policies on identical work; their receipts carry the same TTFT
 * terms as kvplane_cost's, next to the policy's own score.
 *
 * Invariants: a failed call changes nothing (no in-flight, affinity or round
 * robin state moves); a decision never names a worker outside [0, n_workers)
 * nor an offline one (all offline: the call fails with KVP_ESTATE).
 *
 * Thread safety: a kvp_router is NOT thread-safe (one per routing thread, or
 * serialise calls), except kvp_router_report_bandwidth(), which may be called
 * from any thread concurrently with everything but destroy.  Several replicas
 * are several routers with distinct replica ids. */
#ifndef KVPLANE_ROUTE_H
#define KVPLANE_ROUTE_H

#include "kvplane/common.h"
#include "kvplane/config.h"
#include "kvplane/index.h"
#include "kvplane/ledger.h"
#include "kvplane/prefix.h"

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __cplusplus
#define KVP_ROUTE_STATIC_ASSERT_(c, m) static_assert(c, m)
#else
#define KVP_ROUTE_STATIC_ASSERT_(c, m) _Static_assert(c, m)
#endif

/* ---- policies ------------------------------------------------------------
 * Exact rules ("requests" = queued + running as reported + this router's in
 * flight; "pending tokens" = reported prefill_tokens + this router's in-flight
 * uncached tokens; matched = the index's prefix, any tier; only online
 * workers take part):
 *   round_robin   next online worker after the last one chosen.
 *   least_loaded  fewest pending tokens; ties: fewest requests, lowest index.
 *   prefix_greedy longest match; ties: as least_loaded.
 *   sglang_cache_aware  load = requests.  Imbalanced if max - min > 64 and
 *                 max > 1.5 x min: lowest load.  Else if the best match rate
 *                 (matched tokens / prompt tokens) > 0.3: that worker (first
 *                 of equals).  Else lowest load.  (SGLang's own last branch
 *                 picks the worker with the smallest radix tree; kvplane has
 *                 no tree sizes and takes the least loaded.)
 *   llmd_weighted 3 x matched/total blocks + 2 x (1 - kv_util) + 2 x
 *                 (max_q - q)/(max_q - min_q) (1 when all equal; q = reported
 *                 queued requests); highest wins; ties by the tie hash.
 *   dynamo_cost   prefill_load_scale x max((pending tokens + prompt tokens) /
 *                 block_size - sum_k credit_k x matched_blocks_k, 0) + decode
 *                 blocks (reported + in flight + the prompt's); lowest wins,
 *                 ties by the tie hash; temperature T > 0: softmax sampling,
 *                 p ~ exp(-((c - min)/(max - min)) / T), drawn from a hash of
 *                 (seed, replica, request), so deterministic given the seed.
 * Thresholds and weights are options (kvp_router_opts). */
typedef enum kvp_policy {
  KVP_POLICY_KVPLANE_COST = 0, /* "kvplane_cost": TTFT cost model (default) */
  KVP_POLICY_ROUND_ROBIN,      /* "round_robin" */
  KVP_POLICY_LEAST_LOADED,     /* "least_loaded" */
  KVP_POLICY_PREFIX_GREEDY,    /* "prefix_greedy" */
  KVP_POLICY_SGLANG,           /* "sglang_cache_aware" */
  KVP_POLICY_LLMD,             /* "llmd_weighted" */
  KVP_POLICY_DYNAMO,           /* "dynamo_cost" */
  KVP_POLICY_COUNT_
} kvp_policy;

/* Parses a policy name (above; '-' may stand for '_', case ignored).
 * Returns 0 or KVP_EINVAL (NULL or unknown). */
KVP_API int kvp_policy_parse(const char *name, kvp_policy *out);
/* The policy's name; "unknown" outside the enum.  Never NULL. */
KVP_API const char *kvp_policy_name(kvp_policy p);
/* Whether the policy's choice of worker depends on the prefix matches (the
 * index's view, directly or through the in-flight tokens they leave
 * uncached).  0 for round_robin alone: it rotates over the online
 * workers whatever they hold, so a caller routing with it may keep no index
 * and pass no matches (kvp_router_route_matches(r, req, NULL, 0, out)): the
 * same worker, in the same order (its receipts then quote no matches).
 * Returns 1 or 0; 1 outside the enum. */
KVP_API int kvp_policy_reads_matches(kvp_policy p);
/* Whether the policy weighs every worker's match in its choice.  0 for
 * round_robin and least_loaded, which choose on load alone: of the matches
 * they read only the chosen worker's, which sizes the decision's reuse and
 * the uncached tokens it leaves in flight (kvp_router_route_chosen asks for
 * that one alone).  Returns 1 or 0; 1 outside the enum. */
KVP_API int kvp_policy_compares_matches(kvp_policy p);

/* ---- model and GPU ----------------------------------------------------------
 * Zero value = the defaults named per field.  A spec that is not all zero must
 * be complete and sane (positive, finite; kv_heads <= heads): KVP_EINVAL. */
typedef struct kvp_model_spec {
  uint32_t layers;      /* 0 (all zero) = Llama-3.1-8B: 32 */
  uint32_t heads;       /* attention (query) heads: 32 */
  uint32_t kv_heads;    /* KV heads (GQA): 8 */
  uint32_t head_dim;    /* 128 */
  uint32_t dtype_bytes; /* KV element size: 2 (bf16) */
  uint32_t reserved0;
  double params;        /* parameter count: 8.03e9 */
  uint32_t reserved[4];
} kvp_model_spec;

/* Per-field zero = default.  Tier arrays are indexed by kvp_tier. */
typedef struct kvp_gpu_spec {
  double flops;      /* peak dense FLOP/s at the model dtype; 0 = 989e12
                        (H100 SXM bf16) */
  double efficiency; /* achieved fraction of peak in prefill, (0,1]; 0 = 0.5 */
  /* bytes/s into the GPU's KV from each tier; 0 = HBM 3.35e12, host link
   * (DRAM) 50e9, NVMe 6e9, remote 25e9.  Measured values reported through
   * kvp_router_report_bandwidth() override these. */
  double bw[KVP_TIER_COUNT_];
  /* seconds of setup per transfer from a tier; 0 = HBM 0 (none), DRAM 10e-6,
   * NVMe 100e-6, remote 50e-6.  (To model exactly none on a slower tier, pass
   * a tiny positive value.) */
  double latency_s[KVP_TIER_COUNT_];
  /* seconds a prefill costs beyond its FLOPs, per request (the engine's
   * scheduling, tokenising, its API round; measured on a CPU vLLM worker:
   * ~0.17 s): each request queued or in flight on a worker waits on it, so
   * it enters queue_s once per such request and once for the request
   * routed; 0 = none (a GPU engine's is milliseconds) */
  double prefill_overhead_s;
  uint32_t reserved[2];
} kvp_gpu_spec;

/* Bytes of K and V per token: 2 * layers * kv_heads * head_dim * dtype_bytes
 * (defaults applied).  0 when the spec is invalid. */
KVP_API double kvp_model_kv_bytes_per_token(const kvp_model_spec *m);
/* FLOPs to prefill tokens [from, to) of a prompt: sum over t of
 * 2 * params + 4 * layers * heads * head_dim * t (token t attends over the t
 * tokens before it).  0 when the spec is invalid or from >= to. */
KVP_API double kvp_model_prefill_flops(const kvp_model_spec *m, uint64_t from,
                                       uint64_t to);

/* ---- worker load, as reported by the caller ---------------------------------
 * A snapshot from the engine.  The router adds its own in-flight assignments
 * (routed, not yet kvp_router_complete()d) on top: report the engine's view
 * WITHOUT those when you can tell them apart; a report that includes them
 * counts them twice until completion, which only makes routing more cautious.
 * Counts above KVP_ROUTE_COUNT_MAX are rejected (negatives cast to unsigned).
 */
#define KVP_ROUTE_COUNT_MAX ((uint64_t)1 << 40)
#define KVP_WORKER_OFFLINE 0x1u /* flags: never route here */

typedef struct kvp_worker_load {
  uint32_t queued_requests;       /* waiting, not yet scheduled */
  uint32_t running_requests;      /* scheduled (prefill or decode) */
  uint64_t prefill_tokens;        /* uncached prompt tokens still to prefill,
                                     queued + running */
  uint64_t decode_blocks;         /* KV blocks held by running requests */
  double kv_util;                 /* HBM KV in use, [0, 1] */
  uint32_t flags;                 /* KVP_WORKER_* */
  uint32_t reserved[5];
} kvp_worker_load;
KVP_ROUTE_STATIC_ASSERT_(sizeof(kvp_worker_load) == 56,
                         "kvp_worker_load is ABI: grow into reserved");

/* ---- per-worker prefix match ------------------------------------------------
 * What the locality index says one worker holds of a request's key chain: the
 * longest matched prefix, split by the tier each block lives on (sum = prefix
 * length in blocks).  The router assumes faster tiers hold the earlier blocks
 * (prefixes are hotter than their continuations). */
/* flags: predicted (approximate index, lost events), not reported */
#define KVP_MATCH_UNCERTAIN 0x1u

typedef struct kvp_worker_match {
  uint32_t worker;
  uint32_t flags;                   /* KVP_MATCH_* */
  uint32_t blocks[KVP_TIER_COUNT_]; /* matched prefix blocks per tier */
} kvp_worker_match;

/* ---- router -------------------------------------------------------------- */
typedef struct kvp_router kvp_router;

typedef enum kvp_guard_ref {
  KVP_GUARD_MEAN = 0, /* compare with the mean load of the other workers */
  KVP_GUARD_MIN = 1   /* ... with their minimum */
} kvp_guard_ref;

/* What the guard counts as a worker's load. */
typedef enum kvp_guard_load {
  /* requests before their first token: queued (reported) + this router's in
   * flight -- what delays a new request's prefill.  A worker busy decoding
   * is not overloaded for TTFT: continuous batching schedules a new prefill
   * at the next step. */
  KVP_GUARD_LOAD_PREFILL = 0,
  /* queued + running (prefill or decode) + in flight: every request the
   * worker holds (the rule before 2026-11-29; SGLang's load) */
  KVP_GUARD_LOAD_REQUESTS = 1
} kvp_guard_load;

/* Zero value = defaults, except n_workers and block_size (required).
 * Doubles must be finite and non-negative; 0 selects the default given.
 * Reserved fields (here and in every struct of this header) must be zero.
 * kvp_router_create logs the first bad field with its value. */
typedef struct kvp_router_opts {
  kvp_policy policy;   /* 0 = KVP_POLICY_KVPLANE_COST */
  uint32_t n_workers;  /* 1 .. KVP_WORKERS_MAX, required */
  /* tokens per block of the keys it will route, required: the namespace's
   * block size, i.e. kvp_hasher_block_size() of the hasher that makes the
   * keys (every token count in decisions and receipts is blocks x this) */
  uint32_t block_size;
  uint32_t replica_id; /* this router replica; feeds the tie-break hash */
  uint64_t seed;       /* tie-break and softmax sampling; any value */
  kvp_model_spec model;
  kvp_gpu_spec gpu;

  /* kvplane_cost */
  double guard;             /* exclude load > guard x ref; 0 = 2.0 */
  uint32_t guard_ref;       /* kvp_guard_ref; 0 = mean of the others */
  uint32_t guard_min_load;  /* ... and load > this many requests; 0 = 4 */
  double affinity_eps_rel;  /* keep the session's worker within best x (1 +
                               this) ...; 0 = 0.05 */
  double affinity_eps_s;    /* ... or best + this many seconds; 0 = 2e-3 */
  double tie_rel;           /* tie band: within best x (1 + this); 0 = 0.01 */
  double uncertain_confidence; /* weight of a predicted match, (0,1]; 0 = 0.8 */

  /* sglang_cache_aware (SGLang router's cache_aware policy) */
  double sglang_balance_abs;     /* 0 = 64 */
  double sglang_balance_rel;     /* 0 = 1.5 */
  double sglang_cache_threshold; /* 0 = 0.3 */

  /* llmd_weighted (llm-d inference scheduler's default scorers) */
  double llmd_w_prefix; /* 0 = 3 */
  double llmd_w_kv;     /* 0 = 2 */
  double llmd_w_queue;  /* 0 = 2 */

  /* dynamo_cost (Dynamo KV router) */
  double dynamo_prefill_scale; /* prefill_load_scale; 0 = 1.0 */
  /* overlap credit per matched block, by tier; 0 = Dynamo's defaults: HBM
   * (overlap_score_credit) 1.0, DRAM (host_cache_hit_weight) 0.75, NVMe
   * (disk_cache_hit_weight) 0.25, remote 0 (shared cache off). */
  double dynamo_credit[KVP_TIER_COUNT_];
  double dynamo_temperature; /* softmax temperature; 0 = argmin */

  double bw_ewma_alpha;  /* weight of a new bandwidth report; 0 = 0.25 */
  uint32_t max_inflight; /* tracked in-flight requests; 0 = 65536 */
  uint32_t max_sessions; /* remembered session -> worker; 0 = 65536 */
  uint32_t max_blocks;   /* longest key chain accepted; 0 = 1 << 20 */
  /* kvp_router_route(): record each routed chain in the index as routed to
   * the chosen worker (approximate mode, for engines without KV events). */
  uint32_t record_routed;
  uint32_t guard_load; /* kvp_guard_load; 0 = prefill-stage requests */
  /* kvp_router_route() without record_routed (an engine with events): record
   * the blocks of each routed chain the chosen worker does not hold as
   * pending on it (kvp_index_record_pending) for the decision's predicted
   * TTFT plus this many milliseconds (the events' delay), so that requests
   * arriving during that prefill see it.  0 = off.  At most 3,600,000. */
  uint32_t pending_ms;
  /* 1: a request given the time (KVP_ROUTE_NOW) sees each worker's in-flight
   * prefill seconds run down as time passes, as the cost model predicts
   * them (for a calibrated model: gpu.* measured on the engines, e.g. by
   * make live; an uncalibrated one that predicts prefills faster than they
   * run would count busy workers as idle).  0 = off: in-flight requests
   * count whole until kvp_router_complete(). */
  uint32_t inflight_decay;
  uint32_t reserved[11];
} kvp_router_opts;

/* ---- the YAML config's `model:`, `gpu:` and `routing:` sections -----------
 * (include/kvplane/config.h; the router binds them as kvtier binds `tiers:`,
 * so kvplane-bench and a router daemon read one file alike.)  Keys:
 *   model:   layers, heads, kv_heads, head_dim, dtype_bytes, params_billion
 *            (all six or none) -> o->model; block_size (tokens per block,
 *            1..65536; must match the hasher's) -> o->block_size
 *   gpu:     tflops (1e12 FLOP/s), efficiency (0.01..1) -> flops, efficiency;
 *            hbm_ / dram_ / nvme_bandwidth_gbps (GB/s, 1e9 bytes/s) -> bw[];
 *            dram_ / nvme_latency_us (a bare number is microseconds; 10us,
 *            0.1ms, ... take their unit) -> latency_s[]
 *   routing: guard, guard_min_load, affinity_eps_rel, tie_rel,
 *            dynamo_temperature, llmd_w_prefix, llmd_w_kv, llmd_w_queue ->
 *            the fields of the same names; guard_load: prefill | requests;
 *            pending: a duration (0 = off, 2s, 500ms; a bare number is
 *            seconds) -> pending_ms; inflight_decay: a boolean;
 *            policies: a non-empty list of
 *            policy names, copied joined with ',' into policies[policies_cap]
 *            for a caller that compares several (kvplane-bench checks the
 *            names: its bounds random and infinite are no kvp_policy); a
 *            NULL policies with the key present is an error.
 * All or nothing: *o and policies change only on success; a field without a
 * key keeps its value.  Returns the number of keys set (0: none of the three
 * sections), or KVP_EINVAL with "file:line: section.key: ..." in err.  Marks
 * the three sections bound (kvp_config_check_unbound). */
KVP_API int kvp_router_opts_from_config(kvp_config *c, kvp_router_opts *o,
                                        char *policies, size_t policies_cap,
                                        char *err, size_t cap);

/* Returns 0, KVP_EINVAL (bad options: logged at KVP_LOG_WARN as
 * "create: opts.<field> = <value>: <rule>") or KVP_ENOMEM.  *out is NULL on
 * failure.  Memory: O(n_workers + max_inflight + max_sessions). */
KVP_API int kvp_router_create(const kvp_router_opts *opts,
                              const kvp_allocator *alloc, kvp_router **out);
/* NULL is a no-op. */
KVP_API void kvp_router_destroy(kvp_router *r);

/* Applies new options to a live router (a daemon's config reload): the
 * policy and its thresholds and weights, guard, affinity, tie band, model
 * and GPU specs, seed, replica_id, max_blocks, record_routed, pending_ms,
 * inflight_decay.  Kept as they
 * are: requests in flight (their tokens and the prefill time estimated when
 * they were routed), session affinities, the round robin position, the
 * reported loads and every measured bandwidth (a tier never measured takes
 * the new gpu.bw).  opts is checked as kvp_router_create checks it (the
 * same log lines, "set_opts:" for "create:"); in addition n_workers,
 * block_size, max_inflight and max_sessions (defaults resolved) must equal
 * the running ones: they size the router or give its keys their meaning, so
 * a change takes a new router (KVP_EINVAL, logged at KVP_LOG_WARN as
 * "set_opts: opts.<field> = <new> (running <old>): ...").  All or nothing:
 * on failure r is unchanged.  Returns 0 or KVP_EINVAL (NULL r or opts, bad
 * or structural options).  Thread safety: as every call on r, and not
 * concurrently with kvp_router_report_bandwidth() either. */
KVP_API int kvp_router_set_opts(kvp_router *r, const kvp_router_opts *opts);

/* Replace worker `worker`'s reported load (copied).  Returns 0 or KVP_EINVAL
 * (worker out of range, kv_util not in [0,1] or NaN, counts above
 * KVP_ROUTE_COUNT_MAX, unknown flags, reserved not zero); on failure the old
 * load stays. */
KVP_API int kvp_router_set_load(kvp_router *r, uint32_t worker,
                                const kvp_worker_load *load);

/* A measured bandwidth (bytes/s) for a tier, e.g. from completed transfers.
 * The first report replaces the configured value; later ones are blended in
 * as an EWMA (bw_ewma_alpha).  Returns 0 or KVP_EINVAL (tier out of range,
 * bytes_per_s not in (0, 1e16]).  Thread-safe (lock-free). */
KVP_API int kvp_router_report_bandwidth(kvp_router *r, kvp_tier tier,
                                        double bytes_per_s);
/* The bandwidth the cost model uses now for `tier` (0 for a bad tier). */
KVP_API double kvp_router_bandwidth(const kvp_router *r, kvp_tier tier);

/* One request to route.  The zero value of the optional fields means absent. */
typedef struct kvp_route_request {
  const kvp_key *keys; /* the prompt's block keys (kvp_chain_keys) */
  size_t n_blocks;     /* 0 .. max_blocks; keys may be NULL only when 0 */
  uint64_t prompt_tokens; /* all prompt tokens, >= n_blocks * block_size;
                             0 = n_blocks * block_size */
  const kvp_classification *cls; /* optional stable/semi/volatile split of the
                                    same blocks (n_blocks must agree) */
  /* Ids: uint64 here, the caller's strings in the ledger and receipts; use
   * kvp_id64(name) so that the two agree (kvp_ledger_add_decision checks). */
  uint64_t session_id; /* 0 = no session (no affinity) */
  uint64_t request_id; /* 0 = the router assigns one (see decision) */
  uint64_t tenant;     /* carried into the receipt */
  /* tokens per block of `keys` (kvp_hasher_block_size): 0 = not checked;
   * else must equal the router's block_size (KVP_EINVAL, logged) */
  uint32_t block_size;
  /* Which workers may serve this request (e.g. those with the LoRA adapter
   * it names loaded): bit w % 64 of eligible[w / 64] set = worker w may.
   * NULL with n_eligible_words 0 = every worker; a worker past the words
   * given may not; at most ceil(n_workers / 64) words.  Offline workers stay
   * out either way; none eligible and online = KVP_ESTATE, as with none
   * online.  Read only during the call. */
  uint32_t n_eligible_words;
  const uint64_t *eligible;
  /* With KVP_ROUTE_SEEN in flags: how many leading blocks of keys some
   * worker ever held (kvp_index_seen_prefix).  The ledger then splits the
   * blocks no online worker holds into evicted (before it) and never_seen
   * (past it), instead of unknown. */
  uint32_t seen_blocks;
  uint32_t flags; /* KVP_ROUTE_* */
  /* With KVP_ROUTE_NOW in flags: the caller's monotonic time (the clock of
   * kvp_router_route's now_ns).  With opts.inflight_decay the in-flight
   * prefill time the router adds to each worker's queue then runs down as
   * time passes: a worker's estimate is the in-flight seconds routed to it
   * less the time elapsed since (work-conserving), never more than their
   * sum, which is what a request without it is charged; a completion never
   * raises it.  Times before the last one given count no time elapsed. */
  uint64_t now_ns;
} kvp_route_request;
#define KVP_ROUTE_SEEN 0x1u /* seen_blocks is given */
#define KVP_ROUTE_NOW 0x2u  /* now_ns is given */

/* ---- decision and receipt ------------------------------------------------ */
#define KVP_ROUTE_TOP 4
#define KVP_WORKER_NONE UINT32_MAX

typedef enum kvp_reason {
  KVP_REASON_COST = 0,     /* cheapest estimated TTFT */
  KVP_REASON_AFFINITY,     /* session's last worker, within epsilon of best */
  KVP_REASON_GUARD,        /* the cheapest was overloaded; next cheapest */
  KVP_REASON_TIE,          /* tie band broken by hash */
  KVP_REASON_ONLY,         /* a single eligible worker */
  KVP_REASON_ROUND_ROBIN,
  KVP_REASON_LEAST_LOADED, /* fewest pending prefill tokens / shortest queue */
  KVP_REASON_PREFIX,       /* longest prefix match */
  KVP_REASON_SCORE,        /* llm-d: highest weighted score */
  KVP_REASON_SAMPLED,      /* dynamo: lowest cost, or softmax sample */
  KVP_REASON_COUNT_
} kvp_reason;

/* The reason's name as receipts write it ("cost", "affinity", "guard",
 * "tie", "only", "round_robin", "least_loaded", "prefix", "score",
 * "sampled"); "unknown" outside the enum.  Never NULL. */
KVP_API const char *kvp_reason_name(kvp_reason r);

#define KVP_CAND_GUARDED 0x1u   /* excluded by the load guard */
#define KVP_CAND_UNCERTAIN 0x2u /* its match was predicted, not reported */
#define KVP_CAND_AFFINE 0x4u    /* the session's last worker */

/* One worker's figures.  The TTFT terms are kvplane's estimate whatever the
 * policy; `score` is the policy's own number (kvplane/dynamo: cost, lower is
 * better; llm-d: score, higher is better; others: the key they sort on). */
typedef struct kvp_route_candidate {
  uint32_t worker;
  uint32_t flags;           /* KVP_CAND_* */
  uint64_t matched_tokens;  /* index's matched prefix */
  uint64_t reused_tokens;   /* of it, reused by the cost model */
  double queue_s, recompute_s, load_s, total_s;
  double score;
} kvp_route_candidate;

#define KVP_DECISION_UNTRACKED 0x1u /* in-flight table full: not tracked */
#define KVP_DECISION_ALL_GUARDED 0x2u /* every worker over the guard */
#define KVP_DECISION_REPLACED 0x4u /* request id was in flight (retry): moved */
#define KVP_DECISION_NO_INDEX 0x8u /* index query failed: routed on load only */
#define KVP_DECISION_NOT_RECORDED 0x10u /* record_routed / record_pending
                                          failed (see log) */
#define KVP_DECISION_SEEN 0x40u /* seen_blocks given (KVP_ROUTE_SEEN) */
#define KVP_DECISION_CHOSEN_ONLY 0x20u /* kvp_router_route_chosen: only the
                                          chosen worker's match was read */

typedef struct kvp_decision {
  uint32_t worker;     /* chosen, or KVP_WORKER_NONE on failure */
  uint8_t policy;      /* kvp_policy */
  uint8_t reason;      /* kvp_reason */
  uint8_t n_top;       /* valid entries of top[] (chosen first) */
  uint8_t flags;       /* KVP_DECISION_* */
  uint32_t n_eligible; /* workers considered (online) */
  uint32_t block_size; /* the router's: token counts below are blocks x it */
  uint64_t request_id; /* the caller's, or the one assigned: pass it to
                          kvp_router_complete() */
  uint64_t session_id;
  uint64_t tenant;
  uint64_t prompt_tokens;
  /* On the chosen worker: matched prefix tokens per tier (index view), and
   * of them the reused prefix per tier (the ledger's reused_by_tier). */
  uint64_t matched_tokens[KVP_TIER_COUNT_];
  uint64_t reused_tier_tokens[KVP_TIER_COUNT_];
  /* Longest matched prefix on any other online worker (tokens): what a miss
   * "on another worker" could have reused. */
  uint64_t matched_elsewhere_tokens;
  /* Of the reused prefix: tokens per class (needs request.cls; else all
   * counted volatile). */
  uint64_t reused_class_tokens[KVP_CLASS_COUNT_];
  uint64_t uncached_tokens; /* prefill tokens the chosen worker computes */
  /* Prefill avoided on the chosen worker versus recomputing the prompt: */
  uint64_t avoided_tokens; /* reused prefix, whole blocks */
  double avoided_flops;    /* kvp_model_prefill_flops(0, avoided_tokens) */
  double avoided_s;        /* avoided_flops / (flops x efficiency) */
  double load_s;           /* spent loading it instead (chosen's load_s) */
  kvp_route_candidate top[KVP_ROUTE_TOP];
  char reason_text[256];   /* NUL-terminated, ASCII */
  /* What the ledger needs beyond the above (kvp_ledger_add_decision): */
  uint64_t hashed_tokens; /* n_blocks x block_size (the rest: tail) */
  uint64_t prompt_class_tokens[KVP_CLASS_COUNT_]; /* needs request.cls;
                                                     else all volatile */
  uint64_t load_bytes[KVP_TIER_COUNT_]; /* KV bytes of the reuse per tier */
  uint32_t seen_blocks; /* the request's, with KVP_DECISION_SEEN */
  uint8_t reserved[4];
} kvp_decision;
KVP_ROUTE_STATIC_ASSERT_(sizeof(kvp_decision) == 768,
                         "kvp_decision is ABI: grow into reserved");

/* Route one request.  Per-worker matches come from the caller: `matches`
 * lists the workers holding a prefix of req->keys (any order, each worker at
 * most once; absent workers match nothing); n_matches may be 0.  On success
 * fills *out, records the request as in flight on the chosen worker (its
 * uncached tokens and their prefill time count into that worker's queue until
 * kvp_router_complete()) and remembers the session's worker.
 * Returns 0; KVP_EINVAL (NULL r/req/out, keys NULL with n_blocks > 0,
 * n_blocks > max_blocks, prompt_tokens < n_blocks * block_size, cls that
 * disagrees with n_blocks, a match naming a worker out of range or twice, a
 * match longer than the chain); KVP_ESTATE (every worker offline).  On
 * failure *out has worker = KVP_WORKER_NONE and nothing else changed. */
KVP_API int kvp_router_route_matches(kvp_router *r,
                                     const kvp_route_request *req,
                                     const kvp_worker_match *matches,
                                     size_t n_matches, kvp_decision *out);

/* The chosen worker's match, asked for by kvp_router_route_chosen: fill
 * out->blocks and out->flags (worker is set; blocks zero, flags zero on
 * entry).  Return 0, or a negative error: the decision then reuses nothing
 * on it, as a failed index query (KVP_DECISION_NO_INDEX).  Called once,
 * inside the decision: it must not call the router. */
typedef int (*kvp_match_fn)(void *ctx, uint32_t worker, kvp_worker_match *out);

/* Routes with a policy that chooses on load alone
 * (kvp_policy_compares_matches() == 0), reading one match: the chosen
 * worker's, from fn, after the choice.  The decision equals
 * kvp_router_route_matches' given every worker's match (the same worker,
 * reuse, uncached tokens and in-flight record), except that the others'
 * matches are not known: matched_elsewhere_tokens and their entries in
 * top[] quote none, and flags has KVP_DECISION_CHOSEN_ONLY.  For a caller
 * that can answer one worker's match cheaply and keeps no index for these
 * policies (the simulator: each worker's own cache).  Returns as
 * kvp_router_route_matches; KVP_EINVAL also for a NULL fn or a match fn
 * filled out of range (more blocks than the chain, unknown flags), and
 * KVP_ENOTSUP for a policy that compares matches. */
KVP_API int kvp_router_route_chosen(kvp_router *r,
                                    const kvp_route_request *req,
                                    kvp_match_fn fn, void *ctx,
                                    kvp_decision *out);

/* Step one of two (match, then decide): the per-worker matches that
 * kvp_router_route would route on, for a caller that serialises the
 * decision itself -- a daemon whose event loops share one router under a
 * lock runs this lock-free step outside it, then
 * kvp_router_route_matches(r, req, out, returned count, ...) inside.
 * Queries the index over keys[0 .. min(n_blocks, KVP_INDEX_CHAIN_MAX)) with
 * routed records valid at now_ns into scratch[cap] and converts: index
 * workers >= n_workers dropped; a worker the index flags uncertain, or
 * whose match rests on routed records, is KVP_MATCH_UNCERTAIN (routed
 * blocks counted in HBM).  cap: n_workers gets every match.  Returns the
 * number of matches written to out[cap], or the query's error (KVP_EINVAL:
 * NULL ix/scratch/out with cap > 0, keys NULL with n_blocks > 0; KVP_ENOMEM):
 * route on load alone then, as kvp_router_route does, and say so
 * (KVP_DECISION_NO_INDEX).  Thread-safe: the index's rules. */
KVP_API int kvp_router_match(kvp_index *ix, const kvp_key *keys,
                             size_t n_blocks, uint64_t now_ns,
                             uint32_t n_workers, kvp_index_match *scratch,
                             kvp_worker_match *out, size_t cap);

/* kvp_router_route_matches with the per-worker matches taken from the index:
 * kvp_index_query() over req->keys (at most KVP_INDEX_CHAIN_MAX blocks: a
 * prefix of a prefix match is still one) with routed records valid at
 * now_ns.  Index workers >= n_workers are ignored; a worker the index flags
 * uncertain, or whose match rests on routed records, counts as predicted
 * (KVP_MATCH_UNCERTAIN; routed blocks are taken to be in HBM, where the
 * routed prefill left them).  Fails open: if the query fails (KVP_ENOMEM) the
 * request is routed on load alone and the decision says so
 * (KVP_DECISION_NO_INDEX).  With opts.record_routed, the chain is then
 * recorded as routed to the chosen worker (failure: KVP_DECISION_NOT_RECORDED,
 * the decision stands); without it, with opts.pending_ms, what the chosen
 * worker lacks is recorded as pending (kvp_router_record_pending).  Returns as kvp_router_route_matches; KVP_EINVAL also
 * for a NULL index.  Thread safety: the router's rules; the index is
 * thread-safe on its own. */
KVP_API int kvp_router_route(kvp_router *r, kvp_index *ix,
                             const kvp_route_request *req, uint64_t now_ns,
                             kvp_decision *out);

/* An engine with events (opts.pending_ms): records the blocks of req's
 * chain (at most KVP_INDEX_CHAIN_MAX) past what decision d's worker matched
 * (d->top[0].matched_tokens) as pending on it (kvp_index_record_pending)
 * for d->top[0].total_s + pending_ms.  For a caller of the two-step
 * kvp_router_match / kvp_router_route_matches (pass its opts.pending_ms);
 * kvp_router_route does it itself.  Nothing with pending_ms 0, a decision
 * without top[] or a chain the worker holds.  Returns 0, KVP_EINVAL or the
 * index's error (logged; the decision stands).  Thread-safe (the index's
 * rules; reads no router). */
KVP_API int kvp_router_record_pending(kvp_index *ix,
                                      const kvp_route_request *req,
                                      const kvp_decision *d,
                                      uint32_t pending_ms, uint64_t now_ns);

/* The request finished its prefill (or was cancelled) on `worker`: drop its
 * in-flight tokens.  Returns 0, KVP_EINVAL (worker out of range) or
 * KVP_ENOENT (not in flight on that worker). */
KVP_API int kvp_router_complete(kvp_router *r, uint32_t worker,
                                uint64_t request_id);

/* Remember that session `session_id`'s last worker is `worker`, as a routed
 * request does: another router replica routed it there (the affinity rule
 * then applies to the session's next request here too).  A collision in the
 * session table forgets the older session, as routing does.  Returns 0 or
 * KVP_EINVAL (NULL r, session 0, worker out of range). */
KVP_API int kvp_router_session_set(kvp_router *r, uint64_t session_id,
                                   uint32_t worker);

/* In-flight figures the router tracks for `worker` (any out pointer may be
 * NULL).  Returns 0 or KVP_EINVAL. */
KVP_API int kvp_router_inflight(const kvp_router *r, uint32_t worker,
                                uint64_t *requests, uint64_t *tokens,
                                double *seconds);

/* ---- decisions into the ledger and receipts ------------------------------
 * The caller's names for a routed request's ids.  The ledger keys tenants
 * and sessions by these strings; the router took their kvp_id64() hashes.
 * Each name given must hash to the decision's id (KVP_EINVAL, logged,
 * naming the field); a name left NULL is taken from the id instead: its
 * decimal string ("42"), or none when the id is 0. */
typedef struct kvp_route_names {
  const char *tenant;
  const char *session;
  const char *request_id;
  uint64_t unix_time_ns; /* receipts; 0 = unknown */
  uint64_t reserved[4];
} kvp_route_names;

/* Records a decision (kvp_router_route*) in the ledger: prompt, reused and
 * recomputed tokens, reused tokens by tier (reused_tier_tokens) and class,
 * KV bytes per tier, the avoided prefill estimate, and the recomputed
 * tokens by cause: the tail past the hashed blocks partial_block, the
 * matched prefix the cost model chose not to load not_worth_loading, the
 * longer prefix held by another online worker on_other_worker, the rest
 * (held by no online worker in the index): with KVP_DECISION_SEEN, evicted
 * within the request's seen_blocks and never_seen past them; else unknown.  Such a record always passes kvp_ledger_check.
 * names may be NULL.  Returns kvp_ledger_add's result, or KVP_EINVAL (NULL
 * l or d, a failed decision, a name that does not hash to its id).
 * Thread safety: the ledger's (any thread); d is only read. */
KVP_API int kvp_ledger_add_decision(kvp_ledger *l, const kvp_decision *d,
                                    const kvp_route_names *names);

/* The receipt of a decision: the ledger's receipt object
 * (kvp_ledger_receipt_json: ids, tokens, reuse by tier and class, miss
 * causes, bytes, prefill avoided -- the record kvp_ledger_add_decision
 * would add) plus a "route" member: policy, reason, reason_text, the
 * index's matched tokens per tier, matched_elsewhere_tokens, load_s, flags,
 * n_eligible and the top candidates.  One JSON object without a newline,
 * into buf with snprintf semantics: returns the length the full text needs
 * (excluding the NUL) and writes at most cap bytes, NUL-terminated when cap >
 * 0; buf may be NULL when cap is 0.  names may be NULL.  Returns KVP_EINVAL
 * for a NULL or failed decision or a name that does not hash to its id.
 * Thread-safe. */
KVP_API int kvp_router_receipt_json(const kvp_decision *d,
                                    const kvp_route_names *names, char *buf,
                                    size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_ROUTE_H */
