/* SPDX-License-Identifier: Apache-2.0 */
/* bench_route: one full routing decision -- hash a 32K-token prompt (xxh3_128,
 * 16-token blocks), look its chain up in a populated locality index, route
 * with kvplane_cost -- over 64 workers, against a straightforward baseline in
 * the same run: per-worker hash sets probed for every block (no chain early
 * stop) and the same cost model over the resulting matches.  Both paths must
 * reach the same decision; timings are printed as percentiles and ratios
 * (absolute times on shared machines drift; ratios hold). */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "index_internal.h"
#include "kvplane.h"

#define BS 16u
#define SYS_BLOCKS 256u      /* shared system prompt + tools: on every worker */
#define NEW_BLOCKS 64u       /* a turn's new tokens: 1,024 */
#define PROMPT_TOKENS 32768u /* the measured prompt */
#define STORED_BLOCKS (PROMPT_TOKENS / BS - NEW_BLOCKS) /* 1,984 */

typedef struct opts {
  uint32_t workers;
  uint64_t residencies;
  int reps;
  int cpu;
  uint64_t seed;
  bool quick;
} opts;

static uint64_t mix64(uint64_t z) { return bench_mix64(z); }

/* Token i of session s's conversation; session 0 is the shared prefix. */
static uint32_t tok(uint64_t seed, uint64_t s, uint64_t i) {
  return (uint32_t)(mix64(seed ^ (s * 0x9E3779B97F4A7C15ull) ^ mix64(i)) %
                    128256u);
}

static void fill_prompt(const opts *o, uint64_t s, uint32_t *t, size_t n) {
  for (size_t i = 0; i < n; i++)
    t[i] = i < SYS_BLOCKS * BS ? tok(o->seed, 0, i) : tok(o->seed, s, i);
}

/* ---- workload: the index and the baseline's sets, populated alike ------- */
typedef struct world {
  kvp_index *ix;
  bench_set *sets; /* the baseline: a hash set per worker */
  uint64_t *seq;
  uint64_t sessions;
  kvp_hasher *h;
} world;

static void store(world *w, uint32_t worker, kvp_tier tier, const kvp_key *keys,
                  size_t from, size_t to) {
  if (from >= to)
    return;
  const kvp_key *parent = from ? &keys[from - 1] : NULL;
  int rc = kvp_index_stored(w->ix, worker, ++w->seq[worker], tier, parent,
                            keys + from, to - from);
  if (rc < 0)
    bench_die("kvp_index_stored", rc);
  for (size_t i = from; i < to; i++)
    bench_set_update(&w->sets[worker], bench_fp(keys[i]),
                     (uint8_t)(1u << tier), 0);
}

/* Session s lives on a primary worker (60% of its chain in HBM, the rest
 * spilled to DRAM) and half of it on a secondary one (an earlier placement);
 * every worker that ever served anyone holds the shared prefix. */
static void populate_session(world *w, const opts *o, uint64_t s,
                             uint32_t *toks, kvp_key *keys) {
  fill_prompt(o, s, toks, (size_t)STORED_BLOCKS * BS);
  int n = kvp_hasher_hash(w->h, toks, (size_t)STORED_BLOCKS * BS, NULL, keys,
                          STORED_BLOCKS, NULL);
  if (n != (int)STORED_BLOCKS)
    bench_die("kvp_hasher_hash", n < 0 ? n : KVP_EIO);
  uint32_t p = (uint32_t)(mix64(s) % o->workers);
  uint32_t q =
      (uint32_t)((p + 1 + mix64(s + 1) % (o->workers - 1)) % o->workers);
  size_t hbm = STORED_BLOCKS * 6 / 10;
  store(w, p, KVP_TIER_HBM, keys, 0, hbm);
  store(w, p, KVP_TIER_DRAM, keys, hbm, STORED_BLOCKS);
  store(w, q, KVP_TIER_HBM, keys, 0, STORED_BLOCKS / 2);
}

static void populate(world *w, const opts *o) {
  kvp_index_opts io = {0};
  io.max_workers = o->workers;
  io.expected_keys = o->residencies / 2 + 1024;
  io.prefix_closed = 1; /* populate_session keeps the contract */
  int rc = kvp_index_create(&io, NULL, &w->ix);
  if (rc < 0)
    bench_die("kvp_index_create", rc);
  w->sets = bench_calloc(o->workers, sizeof *w->sets);
  for (uint32_t i = 0; i < o->workers; i++)
    w->sets[i].load_pct = 50;
  w->seq = bench_calloc(o->workers, sizeof *w->seq);
  for (uint32_t i = 0; i < o->workers; i++)
    if ((rc = kvp_index_worker_add(w->ix, i)) < 0)
      bench_die("kvp_index_worker_add", rc);
  uint32_t *toks = bench_calloc((size_t)STORED_BLOCKS * BS, sizeof *toks);
  kvp_key *keys = bench_calloc(STORED_BLOCKS, sizeof *keys);
  /* residencies a session adds: its chain on two workers, less the shared
   * prefix those workers already hold */
  uint64_t per = STORED_BLOCKS + STORED_BLOCKS / 2 - 2 * SYS_BLOCKS;
  w->sessions = o->residencies / per + 1;
  for (uint64_t s = 1; s <= w->sessions; s++)
    populate_session(w, o, s, toks, keys);
  free(toks);
  free(keys);
}

static kvp_hasher *make_hasher(void) {
  kvp_namespace_desc d = {0};
  d.model_id = "bench/route";
  d.block_size = BS;
  kvp_namespace ns;
  kvp_hasher *h = NULL;
  int rc = kvp_namespace_init(&d, &ns);
  if (rc < 0 || (rc = kvp_hasher_create(&ns, NULL, NULL, &h)) < 0)
    bench_die("hasher", rc);
  return h;
}

static kvp_router *make_router(const opts *o) {
  kvp_router_opts ro = {0};
  ro.n_workers = o->workers;
  ro.block_size = BS;
  ro.seed = o->seed;
  kvp_router *r = NULL;
  int rc = kvp_router_create(&ro, NULL, &r);
  if (rc < 0)
    bench_die("kvp_router_create", rc);
  for (uint32_t i = 0; i < o->workers; i++) { /* a busy, uneven cluster */
    kvp_worker_load l = {0};
    l.queued_requests = (uint32_t)(mix64(i) % 8);
    l.running_requests = 8;
    l.prefill_tokens = mix64(i + 99) % 20000;
    l.decode_blocks = 4000 + mix64(i + 7) % 4000;
    l.kv_util = 0.5;
    kvp_router_set_load(r, i, &l);
  }
  return r;
}

/* ---- measure: the two decision paths ------------------------------------- */
enum { H_HASH, H_QUERY, H_FULL, H_BASE, H_IX, H_CORE, H_N };

typedef struct paths {
  const world *w;
  const opts *o;
  kvp_router *fast, *naive;
  kvp_index_match *bm; /* the baseline's matches */
  kvp_worker_match *m;
  uint32_t *toks;
  kvp_key *keys;
  kvp_index_match *im;
  kvp_hist *h[H_N];
  kvp_decision *dec; /* kvplane's decisions, by rep + warm */
  int plan, warm, agree;
} paths;

/* The baseline's matches: every worker, every block, no early stop. */
static size_t naive_matches(paths *p, size_t nb) {
  int n = bench_sets_query(p->w->sets, p->o->workers, p->keys, nb, true, p->bm,
                           p->o->workers);
  for (int k = 0; k < n; k++) {
    p->m[k] = (kvp_worker_match){.worker = p->bm[k].worker};
    memcpy(p->m[k].blocks, p->bm[k].tier_blocks, sizeof p->m[k].blocks);
  }
  return (size_t)n;
}

static bool same_decision(const kvp_decision *a, const kvp_decision *b) {
  if (a->worker != b->worker || a->n_top != b->n_top ||
      a->avoided_tokens != b->avoided_tokens)
    return false;
  for (unsigned i = 0; i < a->n_top; i++)
    if (a->top[i].worker != b->top[i].worker ||
        a->top[i].matched_tokens != b->top[i].matched_tokens)
      return false;
  return true;
}

/* Request rep of the current plan: its session and its id. */
static uint64_t session_of(const paths *p, int rep) {
  return 1 + mix64(p->o->seed + (uint64_t)rep + 1000) % p->w->sessions;
}

static kvp_route_request request_of(const paths *p, int rep) {
  kvp_route_request q = {0};
  q.keys = p->keys, q.n_blocks = PROMPT_TOKENS / BS;
  q.session_id = session_of(p, rep);
  q.request_id = (uint64_t)p->plan * 1000000000ull + (uint64_t)(rep + p->warm + 1);
  return q;
}

static void prep_prompt(void *ctx, int rep) {
  paths *p = ctx;
  fill_prompt(p->o, session_of(p, rep), p->toks, PROMPT_TOKENS);
}

/* kvplane's decision (timed into the hash, query + route and full
 * histograms past the warm-up). */
static void kvplane_request(void *ctx, int rep) {
  paths *p = ctx;
  kvp_route_request q = request_of(p, rep);
  kvp_decision *d = &p->dec[rep + p->warm];
  uint64_t t0 = kvp_now_ns();
  int n = kvp_hasher_hash(p->w->h, p->toks, PROMPT_TOKENS, NULL, p->keys,
                          PROMPT_TOKENS / BS, NULL);
  uint64_t t1 = kvp_now_ns();
  int rc = kvp_router_route(p->fast, p->w->ix, &q, 0, d);
  uint64_t t2 = kvp_now_ns();
  if (n != (int)(PROMPT_TOKENS / BS) || rc < 0)
    bench_die("kvplane decision", rc < 0 ? rc : n);
  if (rep >= 0) {
    kvp_hist_record(p->h[H_HASH], t1 - t0);
    kvp_hist_record(p->h[H_QUERY], t2 - t1);
    kvp_hist_record(p->h[H_FULL], t2 - t0);
  }
  kvp_router_complete(p->fast, d->worker, q.request_id);
}

/* The index query alone on the same prompt, for the breakdown. */
static void query_request(void *ctx, int rep) {
  paths *p = ctx;
  int n = kvp_hasher_hash(p->w->h, p->toks, PROMPT_TOKENS, NULL, p->keys,
                          PROMPT_TOKENS / BS, NULL);
  uint64_t t0 = kvp_now_ns();
  int rc = kvp_index_query(p->w->ix, p->keys, PROMPT_TOKENS / BS, 0, p->im,
                           p->o->workers);
  uint64_t t1 = kvp_now_ns();
  if (n != (int)(PROMPT_TOKENS / BS) || rc < 0)
    bench_die("kvp_index_query", rc < 0 ? rc : n);
  if (rep >= 0)
    kvp_hist_record(p->h[H_IX], t1 - t0);
}

/* The baseline's decision for the same request, compared with kvplane's
 * (both routers see the same completes, so their states stay equal as long
 * as they agree). */
static void baseline_request(void *ctx, int rep) {
  paths *p = ctx;
  kvp_decision d2;
  kvp_route_request q = request_of(p, rep);
  uint64_t t0 = kvp_now_ns();
  int n = kvp_hasher_hash(p->w->h, p->toks, PROMPT_TOKENS, NULL, p->keys,
                          PROMPT_TOKENS / BS, NULL);
  size_t nm = naive_matches(p, PROMPT_TOKENS / BS);
  uint64_t t1 = kvp_now_ns();
  int rc = kvp_router_route_matches(p->naive, &q, p->m, nm, &d2);
  uint64_t t2 = kvp_now_ns();
  if (n != (int)(PROMPT_TOKENS / BS) || rc < 0)
    bench_die("baseline decision", rc < 0 ? rc : n);
  if (rep >= 0) {
    kvp_hist_record(p->h[H_BASE], t2 - t0);
    kvp_hist_record(p->h[H_CORE], t2 - t1);
  }
  kvp_router_complete(p->naive, d2.worker, q.request_id);
  p->agree += same_decision(&p->dec[rep + p->warm], &d2) && rep >= 0;
}

/* One query plan of the index: each path runs in a loop of its own, as a
 * router thread would (interleaving them would have the baseline's sweep
 * over every worker's set evict the router's state before each kvplane
 * decision); the decisions are kept and compared request by request. */
static void measure_plan(paths *p, int plan) {
  p->plan = plan, p->agree = 0;
  kvp__index_set_prefix_closed(p->w->ix, plan == 1);
  for (int k = 0; k < H_N; k++)
    kvp_hist_reset(p->h[k]);
  void (*const pass[3])(void *, int) = {kvplane_request, query_request,
                                        baseline_request};
  for (int i = 0; i < 3; i++) {
    bench_fn fn = {.prep = prep_prompt, .run = pass[i], .ctx = p};
    bench_loop(&fn, p->warm, p->o->reps, NULL); /* they time their parts */
  }
}

/* ---- report -------------------------------------------------------------- */
static const bench_col cols[] = {
    {"", 26}, {"p50", 9}, {"p99", 9}, {"p99.9", 9}, {"mean", 9}};
static const bench_table table = {BENCH_TEXT, 2, cols, 5};

static void report(const paths *p) {
  const world *w = p->w;
  const opts *o = p->o;
  kvp_index_stats st;
  kvp_index_stats_get(w->ix, &st);
  printf("bench_route: %u workers, %" PRIu64 " residencies (%" PRIu64
         " keys, %.0f MiB index), %" PRIu64 " sessions; %u-token prompts "
         "(%u blocks of %u, xxh3_128), kvplane_cost\n",
         o->workers, st.residencies, st.keys, st.bytes / 1048576.0, w->sessions,
         PROMPT_TOKENS, PROMPT_TOKENS / BS, BS);
  bench_table_head(&table, "   (us)");
  bench_row_hist(&table, "hash 32K tokens", p->h[H_HASH]);
  bench_row_hist(&table, "index query + route", p->h[H_QUERY]);
  bench_row_hist(&table, "  index query alone", p->h[H_IX]);
  bench_row_hist(&table, "  cost model + policy alone", p->h[H_CORE]);
  bench_row_hist(&table, "full decision (kvplane)", p->h[H_FULL]);
  bench_row_hist(&table, "full decision (baseline)", p->h[H_BASE]);
  kvp_hist_summary a, b;
  kvp_hist_summarize(p->h[H_FULL], &a);
  kvp_hist_summarize(p->h[H_BASE], &b);
  printf("  baseline / kvplane: p50 %.1fx, p99 %.1fx, p99.9 %.1fx\n",
         (double)b.p50 / a.p50, (double)b.p99 / a.p99, (double)b.p999 / a.p999);
  if (!o->quick)
    printf("  target full decision p99 <= 50 us: %s (%.1f us)\n",
           a.p99 <= 50000 ? "met" : "MISSED", a.p99 / 1e3);
  printf("  decisions agree with the baseline: %d / %d%s\n", p->agree, o->reps,
         p->agree == o->reps ? "" : "  DISAGREE");
}

/* ---- approximate mode: recording where a chain was routed ---------------
 * Without KV events (kvplane-routerd in front of workers that publish none)
 * every decision records the chosen worker for each block of the prompt
 * (kvp_index_record_routed): 2,048 keys for a 32K-token prompt.  Timed on
 * an approximate index of ~2M routing records, kvplane's prefetching
 * record against the same code with prefetching off (the baseline),
 * alternating request by request; both must leave the same answers. */
typedef struct approx_run {
  kvp_index *ix;
  const opts *o;
  kvp_key *keys;  /* chains, PROMPT_TOKENS / BS keys each */
  uint32_t chains;
  kvp_hist *h[2]; /* [0] prefetch on, [1] off */
  uint64_t now;
} approx_run;

static void approx_chain(const approx_run *a, uint32_t c, kvp_key *k) {
  for (uint32_t i = 0; i < PROMPT_TOKENS / BS; i++) /* distinct keys */
    k[i] = (kvp_key){.hi = mix64(c + 1),
                     .lo = mix64(a->o->seed ^ ((uint64_t)c << 32 | i))};
}

static void approx_measure(const opts *o) {
  const uint32_t nb = PROMPT_TOKENS / BS;
  approx_run a = {.o = o, .chains = o->quick ? 16 : 1024};
  kvp_index_opts io = {0};
  io.max_workers = o->workers;
  io.approx_capacity = (uint64_t)a.chains * nb + nb;
  io.approx_ttl_ns = 3600ull * 1000000000ull;
  int rc = kvp_index_create(&io, NULL, &a.ix);
  if (rc < 0)
    bench_die("kvp_index_create (approximate)", rc);
  for (uint32_t i = 0; i < o->workers; i++)
    if ((rc = kvp_index_worker_add(a.ix, i)) < 0)
      bench_die("kvp_index_worker_add", rc);
  a.keys = bench_calloc((size_t)a.chains * nb, sizeof *a.keys);
  uint64_t t0 = kvp_now_ns();
  for (uint32_t c = 0; c < a.chains; c++) {
    approx_chain(&a, c, a.keys + (size_t)c * nb);
    rc = kvp_index_record_routed(a.ix, c % o->workers, a.keys + (size_t)c * nb,
                                 nb, ++a.now);
    if (rc < 0)
      bench_die("kvp_index_record_routed", rc);
  }
  printf("\napproximate mode (no KV events): %u chains of %u keys routed "
         "over %u workers (%.1f s)\n",
         a.chains, nb, o->workers, bench_secs_since(t0));
  a.h[0] = bench_hist(), a.h[1] = bench_hist();
  int reps = o->quick ? 40 : o->reps, warm = reps / 10 + 1;
  for (int r = -warm; r < reps; r++) { /* a returning prompt: a refresh */
    uint32_t c = (uint32_t)(mix64(o->seed + (uint64_t)r + 77) % a.chains);
    int off = (r & 1);
    kvp__index_set_record_prefetch(a.ix, !off);
    uint64_t s = kvp_now_ns();
    rc = kvp_index_record_routed(a.ix, c % o->workers,
                                 a.keys + (size_t)c * nb, nb, ++a.now);
    uint64_t e = kvp_now_ns();
    if (rc != 0) /* every key was there: none created */
      bench_die("kvp_index_record_routed (refresh)", rc < 0 ? rc : KVP_EIO);
    if (r >= 0)
      kvp_hist_record(a.h[off], e - s);
  }
  kvp__index_set_record_prefetch(a.ix, true);
  /* the same answers: every chain still matches in full on its worker */
  int agree = 0, checks = o->quick ? 16 : 64;
  kvp_index_match m[4];
  for (int i = 0; i < checks; i++) {
    uint32_t c = (uint32_t)(mix64(o->seed + (uint64_t)i + 5) % a.chains);
    int n = kvp_index_query(a.ix, a.keys + (size_t)c * nb, nb, ++a.now, m, 4);
    agree += n >= 1 && m[0].worker == c % o->workers &&
             m[0].prefix_blocks == nb;
  }
  bench_table_head(&table, "   (us)");
  bench_row_hist(&table, "record 2,048 (prefetch)", a.h[0]);
  bench_row_hist(&table, "record 2,048 (baseline)", a.h[1]);
  kvp_hist_summary x, y;
  kvp_hist_summarize(a.h[0], &x);
  kvp_hist_summarize(a.h[1], &y);
  printf("  baseline / prefetch: p50 %.2fx, p99 %.2fx\n",
         (double)y.p50 / x.p50, (double)y.p99 / x.p99);
  printf("  chains found whole on their worker after: %d / %d%s\n", agree,
         checks, agree == checks ? "" : "  WRONG");
  kvp_hist_destroy(a.h[0]);
  kvp_hist_destroy(a.h[1]);
  free(a.keys);
  kvp_index_destroy(a.ix);
  if (agree != checks)
    exit(1);
}

/* ---- driver -------------------------------------------------------------- */
static int parse(int argc, char **argv, opts *o) {
  *o = (opts){64, 10000000, 3000, 0, 1, false};
  bench_opt t[] = {
      BENCH_OPT("workers", BENCH_U32, &o->workers, "N", "workers in the index"),
      BENCH_OPT("residencies", BENCH_U64, &o->residencies, "N",
                "(worker, block) residencies populated"),
      BENCH_OPT("reps", BENCH_INT, &o->reps, "N",
                "timed decisions per path and plan"),
      BENCH_OPT("cpu", BENCH_INT, &o->cpu, "N|-1",
                "pin to this CPU (-1: unpinned)"),
      BENCH_OPT("seed", BENCH_U64, &o->seed, "S", "workload seed"),
      BENCH_OPT("quick", BENCH_FLAG, &o->quick, NULL,
                "100,000 residencies, 100 reps; checks only that both paths "
                "decide alike (exit 1 if not)"),
      BENCH_OPT_END};
  if (bench_parse("bench_route",
                  "Populates a locality index, then times full routing "
                  "decisions on 32K-token\nprompts against a naive baseline "
                  "(per-worker hash sets).  Options given\nexplicitly win "
                  "over --quick's sizes.\n",
                  t, argc, argv) < 0)
    return -1;
  if (o->quick && !bench_given(t, "residencies"))
    o->residencies = 100000;
  if (o->quick && !bench_given(t, "reps"))
    o->reps = 100;
  if (o->workers < 2 || o->workers > KVP_WORKERS_MAX || o->reps <= 0 ||
      o->residencies == 0) {
    fprintf(stderr, "bench_route: bad sizes (workers 2..4096, reps > 0)\n");
    return -1;
  }
  return 0;
}

static paths paths_make(const world *w, const opts *o) {
  paths p = {.w = w, .o = o, .fast = make_router(o), .naive = make_router(o)};
  p.bm = bench_calloc(o->workers, sizeof *p.bm);
  p.m = bench_calloc(o->workers, sizeof *p.m);
  p.toks = bench_calloc(PROMPT_TOKENS, sizeof *p.toks);
  p.keys = bench_calloc(PROMPT_TOKENS / BS, sizeof *p.keys);
  p.im = bench_calloc(o->workers, sizeof *p.im);
  for (int k = 0; k < H_N; k++)
    p.h[k] = bench_hist();
  p.warm = o->reps / 10 + 1;
  p.dec = bench_calloc((size_t)(o->reps + p.warm), sizeof *p.dec);
  return p;
}

static void paths_free(paths *p) {
  for (int k = 0; k < H_N; k++)
    kvp_hist_destroy(p->h[k]);
  kvp_router_destroy(p->fast);
  kvp_router_destroy(p->naive);
  free(p->dec), free(p->bm), free(p->m), free(p->toks), free(p->keys);
  free(p->im);
}

int main(int argc, char **argv) {
  opts o;
  if (parse(argc, argv, &o) < 0)
    return 2;
  bench_pin_cpu(o.cpu);
  world w = {0};
  w.h = make_hasher();
  uint64_t t0 = kvp_now_ns();
  populate(&w, &o);
  printf("populated the index and the baseline in %.1f s\n",
         bench_secs_since(t0));
  paths p = paths_make(&w, &o);
  int agree = 0, total = 0;
  for (int plan = 0; plan < 2; plan++) { /* both query plans of the index */
    printf("\nindex query plan: %s\n",
           plan ? "bisect (prefix_closed = 1)" : "walk (prefix_closed = 0)");
    measure_plan(&p, plan);
    report(&p);
    agree += p.agree, total += o.reps;
  }
  paths_free(&p);
  approx_measure(&o);
  kvp_index_destroy(w.ix);
  kvp_hasher_destroy(w.h);
  bench_sets_free(w.sets, o.workers);
  free(w.seq);
  return agree == total ? 0 : 1;
}
