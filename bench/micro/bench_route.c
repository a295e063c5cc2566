/* SPDX-License-Identifier: Apache-2.0 */
/* bench_route: one full routing decision -- hash a 32K-token prompt (xxh3_128,
 * 16-token blocks), look its chain up in a populated locality index, route
 * with kvplane_cost -- over 64 workers, against a straightforward baseline in
 * the same run: per-worker hash sets probed for every block (no chain early
 * stop) and the same cost model over the resulting matches.  Both paths must
 * reach the same decision; timings are printed as percentiles and ratios
 * (absolute times on shared machines drift; ratios hold). */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <sched.h>
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

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n, size);
  if (p == NULL) {
    fprintf(stderr, "bench_route: out of memory (%zu x %zu)\n", n, size);
    exit(1);
  }
  return p;
}

static uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* Token i of session s's conversation; session 0 is the shared prefix. */
static uint32_t tok(uint64_t seed, uint64_t s, uint64_t i) {
  return (uint32_t)(mix64(seed ^ (s * 0x9E3779B97F4A7C15ull) ^ mix64(i)) %
                    128256u);
}

static void fill_prompt(const opts *o, uint64_t s, uint32_t *t, size_t n) {
  for (size_t i = 0; i < n; i++)
    t[i] = i < SYS_BLOCKS * BS ? tok(o->seed, 0, i) : tok(o->seed, s, i);
}

/* ---- the baseline's residency store: a hash set per worker --------------- */
typedef struct wset {
  uint64_t *fp; /* 0 = empty; fingerprints 0/1 are remapped like the index */
  uint8_t *tier;
  size_t mask, n;
} wset;

static uint64_t fp_of(kvp_key k) { return k.lo < 2 ? k.lo + 2 : k.lo; }

static void wset_grow(wset *s);

static void wset_put(wset *s, kvp_key k, uint8_t tier) {
  if (2 * (s->n + 1) > s->mask + 1)
    wset_grow(s);
  uint64_t f = fp_of(k);
  size_t i = (size_t)mix64(f) & s->mask;
  while (s->fp[i] != 0 && s->fp[i] != f)
    i = (i + 1) & s->mask;
  if (s->fp[i] == 0)
    s->n++, s->fp[i] = f, s->tier[i] = tier;
  else if (tier < s->tier[i])
    s->tier[i] = tier; /* the fastest tier holding it, as the index counts */
}

static void wset_grow(wset *s) {
  wset t = {0};
  t.mask = s->mask ? 2 * s->mask + 1 : 1023;
  t.fp = xcalloc(t.mask + 1, sizeof *t.fp);
  t.tier = xcalloc(t.mask + 1, 1);
  for (size_t i = 0; s->fp && i <= s->mask; i++)
    if (s->fp[i])
      wset_put(&t, (kvp_key){0, s->fp[i]}, s->tier[i]);
  free(s->fp);
  free(s->tier);
  *s = t;
}

/* -1 when absent, else the tier. */
static int wset_get(const wset *s, kvp_key k) {
  uint64_t f = fp_of(k);
  if (s->fp == NULL) /* a worker that never held anything */
    return -1;
  for (size_t i = (size_t)mix64(f) & s->mask;; i = (i + 1) & s->mask) {
    if (s->fp[i] == f)
      return s->tier[i];
    if (s->fp[i] == 0)
      return -1;
  }
}

/* ---- population ---------------------------------------------------------- */
typedef struct world {
  kvp_index *ix;
  wset *sets;
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
    die("kvp_index_stored", rc);
  for (size_t i = from; i < to; i++)
    wset_put(&w->sets[worker], keys[i], (uint8_t)tier);
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
    die("kvp_hasher_hash", n < 0 ? n : KVP_EIO);
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
    die("kvp_index_create", rc);
  w->sets = xcalloc(o->workers, sizeof *w->sets);
  w->seq = xcalloc(o->workers, sizeof *w->seq);
  for (uint32_t i = 0; i < o->workers; i++)
    if ((rc = kvp_index_worker_add(w->ix, i)) < 0)
      die("kvp_index_worker_add", rc);
  uint32_t *toks = xcalloc((size_t)STORED_BLOCKS * BS, sizeof *toks);
  kvp_key *keys = xcalloc(STORED_BLOCKS, sizeof *keys);
  /* residencies a session adds: its chain on two workers, less the shared
   * prefix those workers already hold */
  uint64_t per = STORED_BLOCKS + STORED_BLOCKS / 2 - 2 * SYS_BLOCKS;
  w->sessions = o->residencies / per + 1;
  for (uint64_t s = 1; s <= w->sessions; s++)
    populate_session(w, o, s, toks, keys);
  free(toks);
  free(keys);
}

/* ---- the two decision paths ---------------------------------------------- */
typedef struct paths {
  kvp_router *fast, *naive;
  kvp_worker_match *m;
  uint32_t *toks;
  kvp_key *keys;
  kvp_index_match *im;
  kvp_hist *h_hash, *h_query, *h_full, *h_base, *h_ix, *h_core;
} paths;

/* The baseline's matches: every worker, every block, no early stop. */
static size_t naive_matches(const world *w, const opts *o, const kvp_key *keys,
                            size_t nb, kvp_worker_match *m) {
  size_t k = 0;
  for (uint32_t wk = 0; wk < o->workers; wk++) {
    kvp_worker_match x = {0};
    bool prefix = true;
    for (size_t i = 0; i < nb; i++) {
      int t = wset_get(&w->sets[wk], keys[i]);
      prefix = prefix && t >= 0;
      if (prefix)
        x.blocks[t]++;
    }
    if (x.blocks[0] + x.blocks[1] + x.blocks[2] + x.blocks[3] > 0)
      x.worker = wk, m[k++] = x;
  }
  return k;
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

static kvp_route_request request_of(const paths *p, uint64_t s, uint64_t id) {
  kvp_route_request q = {0};
  q.keys = p->keys, q.n_blocks = PROMPT_TOKENS / BS;
  q.session_id = s, q.request_id = id;
  return q;
}

/* kvplane's decision for request `id` of session s (timed into the hash,
 * query + route and full histograms when rec). */
static void kvplane_request(const world *w, const opts *o, paths *p,
                            uint64_t s, uint64_t id, bool rec,
                            kvp_decision *d) {
  fill_prompt(o, s, p->toks, PROMPT_TOKENS);
  kvp_route_request q = request_of(p, s, id);
  uint64_t t0 = kvp_now_ns();
  int n = kvp_hasher_hash(w->h, p->toks, PROMPT_TOKENS, NULL, p->keys,
                          PROMPT_TOKENS / BS, NULL);
  uint64_t t1 = kvp_now_ns();
  int rc = kvp_router_route(p->fast, w->ix, &q, 0, d);
  uint64_t t2 = kvp_now_ns();
  if (n != (int)(PROMPT_TOKENS / BS) || rc < 0)
    die("kvplane decision", rc < 0 ? rc : n);
  if (rec) {
    kvp_hist_record(p->h_hash, t1 - t0);
    kvp_hist_record(p->h_query, t2 - t1);
    kvp_hist_record(p->h_full, t2 - t0);
  }
  kvp_router_complete(p->fast, d->worker, id);
}

/* The index query alone on session s's prompt, for the breakdown. */
static void query_request(const world *w, const opts *o, paths *p, uint64_t s,
                          bool rec) {
  fill_prompt(o, s, p->toks, PROMPT_TOKENS);
  int n = kvp_hasher_hash(w->h, p->toks, PROMPT_TOKENS, NULL, p->keys,
                          PROMPT_TOKENS / BS, NULL);
  uint64_t t0 = kvp_now_ns();
  int rc =
      kvp_index_query(w->ix, p->keys, PROMPT_TOKENS / BS, 0, p->im, o->workers);
  uint64_t t1 = kvp_now_ns();
  if (n != (int)(PROMPT_TOKENS / BS) || rc < 0)
    die("kvp_index_query", rc < 0 ? rc : n);
  if (rec)
    kvp_hist_record(p->h_ix, t1 - t0);
}

/* The baseline's decision for the same request; returns whether it agrees
 * with kvplane's (both routers see the same completes, so their states stay
 * equal as long as they agree). */
static bool baseline_request(const world *w, const opts *o, paths *p,
                             uint64_t s, uint64_t id, bool rec,
                             const kvp_decision *d1) {
  kvp_decision d2;
  fill_prompt(o, s, p->toks, PROMPT_TOKENS);
  kvp_route_request q = request_of(p, s, id);
  uint64_t t0 = kvp_now_ns();
  int n = kvp_hasher_hash(w->h, p->toks, PROMPT_TOKENS, NULL, p->keys,
                          PROMPT_TOKENS / BS, NULL);
  size_t nm = naive_matches(w, o, p->keys, PROMPT_TOKENS / BS, p->m);
  uint64_t t1 = kvp_now_ns();
  int rc = kvp_router_route_matches(p->naive, &q, p->m, nm, &d2);
  uint64_t t2 = kvp_now_ns();
  if (n != (int)(PROMPT_TOKENS / BS) || rc < 0)
    die("baseline decision", rc < 0 ? rc : n);
  if (rec) {
    kvp_hist_record(p->h_base, t2 - t0);
    kvp_hist_record(p->h_core, t2 - t1);
  }
  kvp_router_complete(p->naive, d2.worker, id);
  return same_decision(d1, &d2);
}

static kvp_router *make_router(const opts *o) {
  kvp_router_opts ro = {0};
  ro.n_workers = o->workers;
  ro.seed = o->seed;
  kvp_router *r = NULL;
  int rc = kvp_router_create(&ro, NULL, &r);
  if (rc < 0)
    die("kvp_router_create", rc);
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

/* ---- report -------------------------------------------------------------- */
static void row(const char *name, const kvp_hist *h) {
  kvp_hist_summary s;
  kvp_hist_summarize(h, &s);
  printf("  %-26s %9.2f %9.2f %9.2f %9.2f\n", name, s.p50 / 1e3, s.p99 / 1e3,
         s.p999 / 1e3, s.mean / 1e3);
}

static void report(const world *w, const opts *o, const paths *p, int agree,
                   int total) {
  kvp_index_stats st;
  kvp_index_stats_get(w->ix, &st);
  printf("bench_route: %u workers, %" PRIu64 " residencies (%" PRIu64
         " keys, %.0f MiB index), %" PRIu64 " sessions; %u-token prompts "
         "(%u blocks of %u, xxh3_128), kvplane_cost\n",
         o->workers, st.residencies, st.keys, st.bytes / 1048576.0, w->sessions,
         PROMPT_TOKENS, PROMPT_TOKENS / BS, BS);
  printf("  %-26s %9s %9s %9s %9s   (us)\n", "", "p50", "p99", "p99.9", "mean");
  row("hash 32K tokens", p->h_hash);
  row("index query + route", p->h_query);
  row("  index query alone", p->h_ix);
  row("  cost model + policy alone", p->h_core);
  row("full decision (kvplane)", p->h_full);
  row("full decision (baseline)", p->h_base);
  kvp_hist_summary a, b;
  kvp_hist_summarize(p->h_full, &a);
  kvp_hist_summarize(p->h_base, &b);
  printf("  baseline / kvplane: p50 %.1fx, p99 %.1fx, p99.9 %.1fx\n",
         (double)b.p50 / a.p50, (double)b.p99 / a.p99, (double)b.p999 / a.p999);
  if (!o->quick)
    printf("  target full decision p99 <= 50 us: %s (%.1f us)\n",
           a.p99 <= 50000 ? "met" : "MISSED", a.p99 / 1e3);
  printf("  decisions agree with the baseline: %d / %d%s\n", agree, total,
         agree == total ? "" : "  DISAGREE");
}

/* ---- driver -------------------------------------------------------------- */
static void usage(FILE *f) {
  fprintf(f,
          "usage: bench_route [--workers N] [--residencies N] [--reps N]\n"
          "                   [--cpu N|-1] [--seed S] [--quick]\n"
          "Populates a locality index (default 64 workers, 10M residencies),\n"
          "then times full routing decisions on 32K-token prompts against a\n"
          "naive baseline.  --quick: small index, few reps; checks only that\n"
          "both paths decide alike (exit 1 if not).\n");
}

static int parse(int argc, char **argv, opts *o) {
  static const struct option lo[] = {{"workers", required_argument, 0, 'w'},
                                     {"residencies", required_argument, 0, 'n'},
                                     {"reps", required_argument, 0, 'r'},
                                     {"cpu", required_argument, 0, 'c'},
                                     {"seed", required_argument, 0, 's'},
                                     {"quick", no_argument, 0, 'q'},
                                     {"help", no_argument, 0, 'h'},
                                     {0, 0, 0, 0}};
  *o = (opts){64, 10000000, 3000, 0, 1, false};
  for (int c; (c = getopt_long(argc, argv, "", lo, NULL)) != -1;) {
    switch (c) {
    case 'w':
      o->workers = (uint32_t)strtoul(optarg, NULL, 10);
      break;
    case 'n':
      o->residencies = strtoull(optarg, NULL, 10);
      break;
    case 'r':
      o->reps = atoi(optarg);
      break;
    case 'c':
      o->cpu = atoi(optarg);
      break;
    case 's':
      o->seed = strtoull(optarg, NULL, 0);
      break;
    case 'q':
      o->quick = true;
      break;
    case 'h':
      usage(stdout);
      exit(0);
    default:
      usage(stderr);
      return -1;
    }
  }
  if (o->quick)
    o->residencies = 100000, o->reps = 100;
  if (o->workers < 2 || o->workers > KVP_WORKERS_MAX || o->reps <= 0 ||
      o->residencies == 0) {
    fprintf(stderr, "bench_route: bad sizes (workers 2..4096, reps > 0)\n");
    return -1;
  }
  return 0;
}

static kvp_hasher *make_hasher(void) {
  kvp_namespace_desc d = {0};
  d.model_id = "bench/route";
  d.block_size = BS;
  kvp_namespace ns;
  kvp_hasher *h = NULL;
  int rc = kvp_namespace_init(&d, &ns);
  if (rc < 0 || (rc = kvp_hasher_create(&ns, NULL, NULL, &h)) < 0)
    die("hasher", rc);
  return h;
}

int main(int argc, char **argv) {
  bench_name = "bench_route";
  opts o;
  if (parse(argc, argv, &o) < 0)
    return 2;
  pin_cpu(o.cpu);
  world w = {0};
  w.h = make_hasher();
  uint64_t t0 = kvp_now_ns();
  populate(&w, &o);
  printf("populated the index and the baseline in %.1f s\n",
         (kvp_now_ns() - t0) / 1e9);
  paths p = {make_router(&o),
             make_router(&o),
             xcalloc(o.workers, sizeof(kvp_worker_match)),
             xcalloc(PROMPT_TOKENS, sizeof(uint32_t)),
             xcalloc(PROMPT_TOKENS / BS, sizeof(kvp_key)),
             xcalloc(o.workers, sizeof(kvp_index_match)),
             NULL,
             NULL,
             NULL,
             NULL,
             NULL,
             NULL};
  kvp_hist **hs[] = {&p.h_hash, &p.h_query, &p.h_full,
                     &p.h_base, &p.h_ix,    &p.h_core};
  for (size_t i = 0; i < 6; i++)
    if (kvp_hist_create(NULL, hs[i]) < 0)
      die("kvp_hist_create", KVP_ENOMEM);
  /* Both query plans of the index, on the same index and requests.  Each
   * path runs in a loop of its own, as a router thread would (interleaving
   * them would have the baseline's sweep over every worker's set evict the
   * router's state before each kvplane decision); the decisions are kept and
   * compared request by request. */
  int agree = 0, total = 0, warm = o.reps / 10 + 1;
  kvp_decision *dec = xcalloc((size_t)(o.reps + warm), sizeof *dec);
  for (int plan = 0; plan < 2; plan++) {
    int ag = 0;
    kvp__index_set_prefix_closed(w.ix, plan == 1);
    printf("\nindex query plan: %s\n",
           plan ? "bisect (prefix_closed = 1)" : "walk (prefix_closed = 0)");
    for (size_t k = 0; k < 6; k++)
      kvp_hist_reset(*hs[k]);
    for (int pass = 0; pass < 3; pass++)
      for (int i = -warm; i < o.reps; i++) {
        uint64_t s = 1 + mix64(o.seed + (uint64_t)i + 1000) % w.sessions;
        uint64_t id = (uint64_t)plan * 1000000000ull + (uint64_t)(i + warm + 1);
        kvp_decision *d = &dec[i + warm];
        if (pass == 0)
          kvplane_request(&w, &o, &p, s, id, i >= 0, d);
        else if (pass == 1)
          query_request(&w, &o, &p, s, i >= 0);
        else
          ag += baseline_request(&w, &o, &p, s, id, i >= 0, d) && i >= 0;
      }
    report(&w, &o, &p, ag, o.reps);
    agree += ag, total += o.reps;
  }
  free(dec);
  for (size_t i = 0; i < 6; i++)
    kvp_hist_destroy(*hs[i]);
  kvp_router_destroy(p.fast);
  kvp_router_destroy(p.naive);
  kvp_index_destroy(w.ix);
  kvp_hasher_destroy(w.h);
  for (uint32_t i = 0; i < o.workers; i++)
    free(w.sets[i].fp), free(w.sets[i].tier);
  free(w.sets), free(w.seq), free(p.m), free(p.toks), free(p.keys), free(p.im);
  return agree == total ? 0 : 1;
}
