/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-bench internals: traces in memory (harness_trace.c), their readers
 * (Mooncake, cc_agentic, Qwen-Bailian, kvplane's own format), the
 * discrete-event cluster simulator (harness_sim.c) and the reports
 * (harness_report.c).  The simulator drives the production prefix, index,
 * router and ledger code; nothing here re-implements them.
 *
 * Invariant of a loaded trace: every request's keys are a chain (key i
 * commits to ids 0..i), so equal keys at block i mean equal prefixes through
 * block i, as the index and the stability classifier require. */
#ifndef KVP_BENCH_HARNESS_H
#define KVP_BENCH_HARNESS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "kvplane.h"
/* kvtier's placement (policies, admission gate, cascade): the simulator
 * runs the objects kvtier's store runs (bench/CMakeLists.txt links the
 * kvtier internals for this header alone). */
#include "kvtier_place.h"

/* ---- byte sources: a file (zstd or plain, by magic) or memory ------------ */
typedef struct bh_src bh_src;

/* Opens `path`; zstd frames are decompressed transparently (streaming).
 * Returns 0 or -errno / KVP_ENOMEM with a message in err. */
int bh_src_open_file(const char *path, bh_src **out, char *err, size_t cap);
/* Reads from data[0..size) (not copied: must outlive the source); zstd
 * transparently as above. */
int bh_src_open_mem(const void *data, size_t size, const char *name,
                    bh_src **out);
void bh_src_close(bh_src *s); /* NULL ok */
/* Up to cap bytes; returns the count (0 at the end) or KVP_ECORRUPT /
 * -errno (the message in bh_src_error). */
long bh_src_read(bh_src *s, void *buf, size_t cap);
/* Next line without its '\n' (NUL-terminated; valid until the next call).
 * Returns 1 with the line and its length, 0 at the end, < 0 on error.  Lines longer than
 * 256 MiB are an error (KVP_ERANGE). */
int bh_src_getline(bh_src *s, char **line, size_t *len);
const char *bh_src_name(const bh_src *s);
uint64_t bh_src_lineno(const bh_src *s);
const char *bh_src_error(const bh_src *s);

/* ---- traces ------------------------------------------------------------- */
typedef enum bh_format {
  BH_FMT_AUTO = 0,
  BH_FMT_MOONCAKE,  /* {timestamp ms, input_length, output_length, hash_ids} */
  BH_FMT_AGENTIC,   /* cc_agentic session files (kv-cache-tester) */
  BH_FMT_BAILIAN,   /* Qwen-Bailian: chat_id, parent_chat_id, timestamp s... */
  BH_FMT_KVPLANE,   /* kvplane's own JSONL (header line + requests) */
  BH_FMT_COUNT_
} bh_format;

const char *bh_format_name(bh_format f);
int bh_format_parse(const char *s, bh_format *out);

typedef struct bh_req {
  double t;            /* arrival, seconds from the trace's start */
  double think_s;      /* think time before it (agentic), informational */
  uint64_t in_tokens;  /* prompt tokens */
  uint32_t out_tokens; /* output tokens */
  uint32_t n_blocks;   /* full blocks keyed: min(ids, in_tokens / block) */
  uint64_t key_off;    /* keys[key_off .. key_off + n_blocks): shared with
                          the request added before it when this one
                          extends it (bh_trace_add); read-only */
  uint32_t mark_off;   /* marks[mark_off .. mark_off + n_marks) */
  uint32_t n_marks;
  uint32_t session;    /* index into names (0 = none) */
  uint32_t tenant;     /* index into names (0 = none) */
  uint32_t seq;        /* order read (stable sort tie-break) */
  uint64_t session_id; /* hash of the session's name (bh_trace_finish): the
                          same across formats, unlike the index */
  /* the production stability classifier's split (bh_trace_finish) */
  uint32_t stable_end, semi_end;
  uint64_t cls_tokens[KVP_CLASS_COUNT_];
} bh_req;

typedef enum bh_on_error { BH_ERR_SKIP = 0, BH_ERR_STOP = 1 } bh_on_error;

typedef struct bh_read_opts {
  bh_on_error on_error;
  uint32_t max_messages;  /* printed per source; 0 = 10 */
  bool quiet;             /* print nothing (fuzzers, tests) */
  bool no_shared_prefix;  /* agentic: keep system+tools per session */
  uint64_t max_requests;  /* 0 = no limit */
} bh_read_opts;

typedef struct bh_trace {
  uint32_t block_size; /* 0 until the first source says */
  bh_req *reqs;
  size_t n_reqs, cap_reqs;
  kvp_key *keys;
  size_t n_keys, cap_keys; /* keys stored, fewer than the prompts' blocks */
  bool keys_mapped; /* keys lie in their own mapping (bh_trace_add grows
                       them by mremap past 64 MiB), freed by munmap */
  /* bh_trace_add's note of the last request added: its ids (a request
   * that starts with all of them shares its keys) and the block size its
   * keys were chained under */
  uint64_t *last_ids;
  size_t n_last_ids, cap_last_ids;
  uint32_t last_bs;
  /* kid[i]: keys[i]'s number among the trace's distinct keys, 0..n_kids-1
   * (bh_trace_finish numbers them): what a simulator tracks per distinct
   * block in a bitmap of n_kids bits, not a hash set of keys (which at 20x
   * the bundled agentic sessions is a random DRAM line per block; the
   * bitmap stays in the CPU's caches) */
  uint32_t *kid;
  size_t n_kids;
  kvp_segment_mark *marks;
  size_t n_marks, cap_marks;
  char **names; /* names[0] = "" */
  size_t n_names, cap_names;
  /* reading statistics (the report prints them) */
  uint64_t records_ok, records_bad, sources;
  char first_error[512];
  char label[256]; /* what was read, for reports */
  uint64_t next_session_ns; /* agentic: one id space per session file */
} bh_trace;

void bh_trace_init(bh_trace *t);
void bh_trace_free(bh_trace *t);
/* Reads one source into t.  Errors in a record: "name:line: message" on
 * stderr (first max_messages), counted in records_bad; skip goes on, stop
 * returns KVP_ECORRUPT.  Unreadable source / wrong block size: an error
 * always.  err receives the first fatal message. */
int bh_read(bh_src *s, bh_format f, const bh_read_opts *o, bh_trace *t,
            char *err, size_t cap);
/* A file or a directory (every *.json, *.json.zst, *.jsonl, *.jsonl.zst in
 * name order), format detected when BH_FMT_AUTO. */
int bh_read_path(const char *path, bh_format f, const bh_read_opts *o,
                 bh_trace *t, char *err, size_t cap);
/* Sorts by arrival (stable), classifies every request with the production
 * kvp_stability (marks where present) and numbers the distinct keys (kid).
 * Call once after reads; KVP_ERANGE past 2^32 - 1 distinct keys. */
int bh_trace_finish(bh_trace *t);
/* How many blocks two prompts' chained keys share from the start: equal
 * keys at j mean equal prefixes up to j, so a binary search. */
uint64_t bh_keys_common_prefix(const kvp_key *a, uint64_t na,
                               const kvp_key *b, uint64_t nb);
/* Adds a request from global block ids (chained into keys here). */
int bh_trace_add(bh_trace *t, const bh_req *r, const uint64_t *ids,
                 size_t n_ids, const kvp_segment_mark *marks, size_t n_marks);
int bh_trace_name(bh_trace *t, const char *s, uint32_t *out);
/* Writes the trace in kvplane's JSONL format (hash ids = the block keys'
 * fingerprints, which chain again to the same prefix structure). */
int bh_trace_write_kvplane(const bh_trace *t, FILE *f);
uint64_t bh_trace_prompt_tokens(const bh_trace *t);

/* ---- cluster and simulator ---------------------------------------------- */
#define BH_POLICY_RANDOM (KVP_POLICY_COUNT_ + 0)   /* lower bound */
#define BH_POLICY_INFINITE (KVP_POLICY_COUNT_ + 1) /* upper bound */
#define BH_POLICY_COUNT (KVP_POLICY_COUNT_ + 2)
const char *bh_policy_name(int p);
int bh_policy_parse(const char *s, int *out);

typedef struct bh_cluster {
  uint32_t workers;
  double hbm_gb, dram_gb, nvme_gb; /* per worker, for KV (GB = 1e9 bytes) */
  uint64_t hbm_blocks, dram_blocks, nvme_blocks; /* derived, or explicit */
  kvp_model_spec model;
  kvp_gpu_spec gpu;
  double hbm_bw;         /* decode: weight + KV reads, bytes/s; 0 = 3.35e12 */
  double decode_base_s;  /* per decode step overhead; 0 = 2e-3 */
  /* Per prefill, on top of the compute: a fixed step (HTTP, scheduling,
   * the forward pass's launch) and a cost per token read from the prefix
   * cache (HBM hits).  0 = none (an H100's are small beside 8B-model
   * compute); calibrated from a measured engine (bench/live/vllm/fleet.py:
   * a CPU vLLM's are not). */
  double prefill_base_s, cached_token_s;
  double max_batch;      /* continuous batching limit; 0 = 256 */
  /* Placement per tier (HBM, DRAM, NVMe): kvtier's tier_policy, the
   * code its store runs.  bh_cluster_defaults: HBM lru (the engine's own
   * prefix cache, as vLLM's), DRAM and NVMe BH_TIER_POLICY_DEFAULT. */
  kvp_tier_policy_kind tier_policy[3];
  bool tier_no_classes;  /* true: stability-blind (every block volatile) */
  /* NVMe admission for blocks demoted out of DRAM: kvtier's gate
   * (kvp__tier_admit_*, the code its store runs).  nvme_admit_on false:
   * every demotion is written (the simulator's behaviour before the gate:
   * "all").  Costs per block: recompute = prefill of a block at the
   * trace's mean prompt (per-block share); read = block / NVMe bandwidth +
   * latency; write = block / nvme_write_bw (0: the NVMe bandwidth). */
  bool nvme_admit_on;
  tier_admit_opts nvme_admit;
  double nvme_write_bw;
  /* P/D (`run --prefill N --decode M`, the config's pd: section): workers
   * [0, pd_prefill) take the prefill legs, the next pd_decode the decode
   * legs, as `engine --prefill N --decode M` names them; 0 0 = no split.
   * workers must be their sum.  The decode leg pulls the blocks it lacks
   * over a link of link_gbps GB/s and link_latency_us a pull (0: the
   * engine's defaults, BH_LINK_*_DEFAULT in harness_cache.h). */
  uint32_t pd_prefill, pd_decode;
  double link_gbps, link_latency_us;
} bh_cluster;

/* The simulated workers' DRAM / NVMe policy unless configured (README,
 * "Which eviction policy": chosen from replays of the bundled traces). */
#define BH_TIER_POLICY_DEFAULT KVP_TIER_POLICY_LRU

typedef struct bh_sim_opts {
  bh_cluster cl;
  int policy;            /* kvp_policy or BH_POLICY_* */
  kvp_router_opts router; /* tuning (guard, weights): policy/n_workers/model
                             are set by the simulator */
  double speed;          /* arrivals at t / speed; 0 = 1 */
  uint32_t closed_loop;  /* > 0: at most this many requests in flight,
                            ignoring timestamps */
  double drop_events;    /* probability an index event is lost */
  double delay_events_s; /* index events arrive this late */
  uint64_t seed;
  uint32_t buckets;      /* time-series points; 0 = 48 */
  bool progress;         /* progress bar on stderr */
  /* non-NULL: the requests simulated so far, stored (relaxed) at every 1 %
   * and at the end, for a caller drawing one bar over several runs */
  _Atomic uint64_t *progress_at;
  FILE *req_log;         /* non-NULL: one JSON line per request at its
                            prefill's end, as `engine --req-log` writes */
  bool verify_index;     /* at the end, each worker's index digest against
                            its cache's (bh_result.index_mismatches); tests */
  bool index_walk;       /* the router's index walks every query instead of
                            bisecting (kvp_index_opts.prefix_closed = 0): the
                            same answers while the caches keep the contract,
                            only slower; tests.  An S3-FIFO HBM (no
                            tail-first release) always walks */
  bool verify_causes;    /* every "on another worker" miss cause recounted
                            block by block on every worker
                            (bh_result.cause_mismatches); tests */
} bh_sim_opts;

/* The router's model / GPU spec (kvp_router_opts_from_config) as the
 * simulated cluster's: the same numbers a router daemon reads from the file;
 * gpu.bw[HBM] is also the simulated decode's HBM bandwidth (hbm_bw). */
void bh_cluster_from_router(bh_cluster *c, const kvp_router_opts *ro);
/* The options bh_sim_run creates its router with, for a trace of
 * block_size-token blocks. */
void bh_sim_router_opts(const bh_sim_opts *o, uint32_t block_size,
                        kvp_router_opts *out);

/* Per bucket of 1/n of the requests, in arrival order. */
typedef struct bh_series {
  uint32_t n;
  double t_end;          /* simulated seconds of the last arrival (0: closed
                            loop, no arrival times) */
  double *t;             /* simulated seconds of the latest arrival among
                            each bucket's requests */
  double *hit;           /* reused / prompt tokens per bucket (NaN: none) */
  double *occ[3];        /* HBM/DRAM/NVMe blocks in use (all workers) /
                            capacity, at each bucket's end */
} bh_series;

/* P/D: one role's share of the work (bh_result.role[]). */
typedef struct bh_role_load {
  uint32_t workers;
  uint64_t legs;           /* prefills run there (one per leg) */
  uint64_t prefill_tokens; /* prompt tokens computed there */
  uint64_t out_tokens;     /* tokens decoded there (prefill legs: none) */
  double prefill_s;        /* prefill GPU seconds */
  double decode_s;         /* decode seconds, summed over its requests */
  /* max / mean per worker: prefill tokens computed (prefill role), decode
   * seconds (decode role); 1 when the role did nothing */
  double imbalance;
} bh_role_load;

enum { BH_ROLE_PREFILL = 0, BH_ROLE_DECODE = 1 };

typedef struct bh_result {
  int policy;
  char name[32];
  kvp_ledger_totals tot;    /* from the production ledger */
  uint64_t requests, ledger_rejects;
  kvp_hist *ttft_us;        /* TTFT, microseconds */
  kvp_hist_summary ttft;
  double ttft_p95_s;
  double imbalance;         /* max / mean assigned prefill tokens */
  uint64_t demoted_bytes[KVP_TIER_COUNT_]; /* bytes written into the tier */
  uint64_t evicted_blocks;
  uint64_t nvme_admitted, nvme_rejected; /* admission gate decisions */
  uint64_t events_published, events_dropped, events_delayed;
  /* the router's index: queries, blocks they read, queries that saw the
   * prefix-closed contract broken (and walked), and with verify_index the
   * workers whose residency in it differs from their cache's */
  uint64_t index_queries, index_query_blocks, index_closure_violations;
  uint64_t index_mismatches;
  /* with verify_causes: requests whose "on another worker" run differed
   * from the block-by-block count, and those read from the session's last
   * worker's nodes first */
  uint64_t cause_mismatches, cause_hinted;
  uint64_t event_blocks;    /* blocks in the events published: residency
                               changes (a tier move is two), the simulated
                               work bench_harness_scale normalises by */
  kvp_index_stats ix;
  /* time per output token of each request with more than one, us: its
   * decode time / (output tokens - 1), as `live` measures (e2e - TTFT) /
   * (tokens - 1) */
  kvp_hist *tpot_us;
  kvp_hist_summary tpot;
  /* P/D (cl.pd_prefill > 0): TTFT above is the decode leg's first token
   * (prefill leg + transfer + the decode worker's queue and prefill of what
   * was not offered); the ledger holds the prefill legs (the hit rate is
   * the prefill workers'); blocks and KV bytes that crossed the link, and
   * offered blocks the decode worker held already */
  bool pd;
  uint64_t xfer_blocks, xfer_bytes, local_blocks;
  bh_role_load role[2]; /* BH_ROLE_PREFILL, BH_ROLE_DECODE */
  double sim_seconds;       /* simulated makespan */
  double wall_seconds;      /* host time to simulate */
  bh_series series;
} bh_result;

void bh_cluster_defaults(bh_cluster *c);
/* Derives the block capacities from GB for the trace's block size. */
int bh_cluster_resolve(bh_cluster *c, uint32_t block_size);
/* For batch simulations (run, sweep, bench_harness_scale; not the engine
 * or live, which run for days):
 * - jemalloc keeps the pages of freed memory instead of returning them to
 *   the kernel after its 10 s decay.  A large simulation frees and
 *   allocates GBs as its tables grow; each page given back and taken again
 *   is a page fault and a zeroed page (on this VM 2-8 us apiece, ~10 % of a
 *   20x run's CPU).  The peak footprint is the same; a no-op where malloc
 *   is not jemalloc (sanitizer builds).
 * - Every jemalloc arena gets extent hooks that forward to jemalloc's own
 *   and ask for transparent huge pages on each new mapping (what jemalloc's
 *   thp:always does, which only MALLOC_CONF could set).  calloc then clears
 *   memory it reuses with memset: with jemalloc's own hooks it drops it and
 *   every page faults in again.  Runs after the first fault in almost
 *   nothing, and a 20x replay's index, tables and holder sets lie in 2 MiB
 *   pages (docs/performance.md, "Tried").
 * - The simulated workers' cache tables and node arrays and the "ever
 *   cached" set, read at random a line per block, lie in 2 MiB pages when
 *   they are that big (bh_big_calloc).  Not in the engine: a huge page's
 *   first touch zeroes 2 MiB at once, a stall its real-time timing would
 *   show. */
void bh_batch_memory(void);
int bh_sim_run(const bh_trace *t, const bh_sim_opts *o, bh_result *r,
               char *err, size_t cap);
void bh_result_free(bh_result *r);

/* ---- offered load (harness_load.c) -------------------------------------- */
#define BH_LOAD_WINDOW_S 10.0 /* offered load per 10 s: the TTFT time scale */

typedef struct bh_load {
  double span_s;        /* first to last arrival, at the replay speed */
  double window_s;      /* BH_LOAD_WINDOW_S (wider past a million windows) */
  double prefill_gpu_s; /* prefill left by an ideal shared cache (every
                           token after the longest prefix sent before) */
  double busy;          /* GPUs that work keeps busy: per-window prefill
                           GPU-s / window_s, mean weighted by window work */
  uint32_t workers;     /* ceil(busy / util), clamped to 1..4096 */
} bh_load;

/* The trace's offered prefill load on cl's model and GPU (the simulator's
 * timing) and the workers that carry it at utilisation util in (0, 1]:
 * `kvplane-bench --workers auto`.  Prefill is the engine's serial resource
 * (decode is batched beside it), so busy is about the least cluster any
 * policy needs where the work is; bursts inside a window still queue. */
int bh_load_estimate(const bh_trace *t, const bh_cluster *cl, double speed,
                     double util, bh_load *out);

/* ---- reports ------------------------------------------------------------ */
typedef struct bh_run {
  const char *label;      /* "mooncake", "agentic", ... */
  const bh_trace *trace;
  const bh_cluster *cl;
  bh_result *res;
  size_t n_res;
} bh_run;

/* The terminal table: a compact one (under 120 columns) by default;
 * BH_TABLE_WIDE every column (the layout before the compact one). */
#define BH_TABLE_WIDE 1u
void bh_report_table(FILE *f, const bh_run *run);
void bh_report_table_opts(FILE *f, const bh_run *run, unsigned flags);
/* The policy a report is about (kvplane_cost if present, else the first
 * that is not a bound) and its best peer (lowest TTFT p95 among the other
 * real policies); indices into run->res, or -1. */
int bh_report_focus(const bh_run *run, int *peer);
int bh_report_csv(FILE *f, const bh_run *runs, size_t n, bool header);
int bh_report_json(FILE *f, const bh_run *runs, size_t n);
/* One self-contained HTML file (inline SVG, no scripts): per run what was
 * simulated, a verdict (the focus policy against its best peer and the
 * bounds), the table with a glossary, and four plots: where the prompt
 * tokens went, hit rate over the replay, TTFT CCDF (log-log), tier
 * occupancy of the focus policy.  Any run's results: offline or live. */
int bh_report_html(FILE *f, const bh_run *runs, size_t n);
/* A sweep: avoided GPU-seconds and TTFT p95 (with the bound) against the
 * first parameter, one line per value of the second. */
int bh_report_sweep_html(FILE *f, const char *title, const char *xname,
                         size_t n_lines, const char *const *line_names,
                         const double *x, uint32_t nx,
                         const double *const *avoided,
                         const double *const *p95, double bound);

/* ---- synthetic agentic generator (harness_gen.c) ------------------------ */
typedef struct bh_gen_opts {
  uint64_t seed;
  uint32_t tenants;        /* 0 = 4 */
  uint32_t sessions;       /* 0 = 64 */
  uint32_t turns;          /* mean turns per session; 0 = 20 */
  uint32_t block_size;     /* 0 = 64 */
  uint32_t system_tokens;  /* per tenant; 0 = 3000 */
  uint32_t tools_tokens;   /* 0 = 12000 */
  uint32_t repo_tokens;    /* semi-stable repo context; 0 = 20000 */
  uint32_t turn_tokens;    /* mean new tokens per turn; 0 = 1500 */
  double think_s;          /* mean think time; 0 = 8 */
  double session_gap_s;    /* mean gap between session starts; 0 = 5 */
  double subagent_p;       /* chance a turn spawns sub-agents; 0 = 0.05 */
  double zipf_s;           /* tenant popularity exponent; 0 = 1.1 */
  double drift;            /* chance a turn perturbs the system prompt */
} bh_gen_opts;

int bh_gen(const bh_gen_opts *o, FILE *out);

#endif /* KVP_BENCH_HARNESS_H */
