/* SPDX-License-Identifier: Apache-2.0 */
/* Locality index microbenchmark: ingest rate (one writer), lookup latency of
 * 2,048-block chains over 64 and 1,024 workers at 10M residencies, bytes per
 * residency; each next to a straightforward baseline run in the same process
 * (per-worker hash sets + a linear scan over workers), whose answers must
 * agree with the index's.  --quick: small sizes, agreement only (CTest). */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "index_internal.h"
#include "kvplane.h"

#define FAMILIES 32 /* system prompts shared across sessions */
#define FAMILY_BLOCKS 256
#define RUN 32 /* blocks per stored event */

typedef struct cfg {
  uint32_t workers;
  uint64_t residencies;
  uint64_t churn; /* residencies of new sessions for the steady-state phase */
  uint32_t chain; /* blocks per session chain (the query length) */
  uint32_t queries, base_queries;
  double base_seconds; /* baseline query time budget */
} cfg;

/* ---- workload ---------------------------------------------------------------
 */

typedef struct session {
  uint32_t worker, family, len; /* resident prefix length */
  uint8_t pattern;              /* tier layout, see sess_events */
  uint64_t id;
  size_t ev_first, ev_end; /* its events */
} session;

typedef struct event {
  uint32_t worker;
  uint8_t tier;
  uint32_t n;
  uint64_t off; /* into keys */
  bool has_parent;
} event;

typedef struct workload {
  session *s;
  size_t ns, cap_s;
  size_t ns_init, nev_init; /* the first residencies; the rest is churn */
  event *ev;
  size_t nev, cap_ev;
  kvp_key *keys;
  size_t nkeys, cap_keys;
  uint64_t residencies;
} workload;

static uint64_t rng_state = 42;
static uint64_t rnd(void) { return bench_splitmix(&rng_state); }

static uint64_t mix(uint64_t x) {
  x ^= x >> 31;
  x *= 0x7fb5d329728ea185ull;
  x ^= x >> 27;
  x *= 0x81dadef4bc2dd44dull;
  return x ^ (x >> 33);
}

/* Block i of a session's chain: the family's prompt, then its own blocks. */
static kvp_key block_key(const session *s, uint32_t i) {
  uint64_t v = i < FAMILY_BLOCKS
                   ? mix(0xFA00000000ull + s->family * 65536ull + i)
                   : mix(s->id * 4096 + i + 0x5E55000000000000ull);
  return (kvp_key){.hi = mix(v), .lo = v | 4};
}

static void *grow(void *p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap)
    return p;
  size_t c = *cap ? *cap : 1024;
  while (c < need)
    c *= 2;
  void *q = realloc(p, c * elem);
  if (q == NULL) {
    fprintf(stderr, "bench_index: out of memory\n");
    exit(1);
  }
  *cap = c;
  return q;
}

/* Events storing blocks [a, b) of s in tier t, RUN blocks each. */
static void add_run(workload *w, const session *s, uint32_t a, uint32_t b,
                    uint8_t t) {
  for (uint32_t i = a; i < b; i += RUN) {
    uint32_t n = b - i < RUN ? b - i : RUN;
    w->ev = grow(w->ev, &w->cap_ev, w->nev + 1, sizeof *w->ev);
    w->keys = grow(w->keys, &w->cap_keys, w->nkeys + n + 1, sizeof *w->keys);
    event *e = &w->ev[w->nev++];
    *e = (event){s->worker, t, n, w->nkeys, i > 0};
    if (i > 0) /* the parent key sits just before the run */
      w->keys[w->nkeys++] = block_key(s, i - 1), e->off++;
    for (uint32_t k = 0; k < n; k++)
      w->keys[w->nkeys++] = block_key(s, i + k);
  }
}

/* Tier layouts: 70% all in HBM; 20% first half HBM + all DRAM; 10% first
 * quarter DRAM + all NVMe.  The family prompt is in HBM. */
static void sess_events(workload *w, const session *s, bool family_new) {
  uint32_t L = s->len, F = FAMILY_BLOCKS;
  if (family_new)
    add_run(w, s, 0, F, KVP_TIER_HBM);
  if (s->pattern == 0) {
    add_run(w, s, F, L, KVP_TIER_HBM);
  } else if (s->pattern == 1) {
    add_run(w, s, F, L / 2 > F ? L / 2 : F, KVP_TIER_HBM);
    add_run(w, s, F, L, KVP_TIER_DRAM);
  } else {
    add_run(w, s, F, L / 4 > F ? L / 4 : F, KVP_TIER_DRAM);
    add_run(w, s, F, L, KVP_TIER_NVME);
  }
}

static void build(workload *w, const cfg *c) {
  memset(w, 0, sizeof *w);
  uint8_t *has_family = calloc((size_t)c->workers * FAMILIES, 1);
  while (w->residencies < c->residencies + c->churn) {
    if (w->residencies >= c->residencies && w->ns_init == 0)
      w->ns_init = w->ns, w->nev_init = w->nev;
    w->s = grow(w->s, &w->cap_s, w->ns + 1, sizeof *w->s);
    session *s = &w->s[w->ns];
    s->id = w->ns++;
    s->worker = (uint32_t)(rnd() % c->workers);
    s->family = (uint32_t)(rnd() % FAMILIES);
    s->len = FAMILY_BLOCKS + (uint32_t)(rnd() % (c->chain - FAMILY_BLOCKS + 1));
    uint64_t r = rnd() % 10;
    s->pattern = r < 7 ? 0 : r < 9 ? 1 : 2;
    uint8_t *hf = &has_family[(size_t)s->worker * FAMILIES + s->family];
    s->ev_first = w->nev;
    sess_events(w, s, !*hf);
    s = &w->s[s->id]; /* w->ev grew, not w->s: still valid */
    s->ev_end = w->nev;
    w->residencies += s->len - FAMILY_BLOCKS + (*hf ? 0 : FAMILY_BLOCKS);
    *hf = 1;
  }
  if (w->ns_init == 0)
    w->ns_init = w->ns, w->nev_init = w->nev;
  free(has_family);
}

static void unbuild(workload *w) {
  free(w->s);
  free(w->ev);
  free(w->keys);
}

/* ---- the baseline: per-worker hash sets, a scan over workers ------------ */

typedef struct baseline {
  bench_set *w;
  uint32_t nw;
} baseline;

static void bl_event(baseline *bl, const event *e, const kvp_key *keys,
                     bool remove) {
  bench_set *b = &bl->w[e->worker];
  for (uint32_t i = 0; i < e->n; i++)
    bench_set_update(b, bench_fp(keys[e->off + i]),
                     remove ? 0 : (uint8_t)(1u << e->tier),
                     remove ? (uint8_t)(1u << e->tier) : 0);
}

static int bl_query(const baseline *bl, const kvp_key *k, size_t n,
                    kvp_index_match *out, size_t cap) {
  return bench_sets_query(bl->w, bl->nw, k, n, false, out, cap);
}

static uint64_t bl_bytes(const baseline *bl) {
  uint64_t b = bl->nw * sizeof(bench_set);
  for (uint32_t w = 0; w < bl->nw; w++)
    b += bl->w[w].cap * 9;
  return b;
}

/* ---- measurements
 * --------------------------------------------------------------- */

static int ingest_index(kvp_index *ix, const workload *w, uint64_t *seq,
                        size_t from, size_t to, bool remove) {
  for (size_t i = from; i < to; i++) {
    const event *e = &w->ev[i];
    const kvp_key *k = &w->keys[e->off];
    int rc = remove ? kvp_index_removed(ix, e->worker, ++seq[e->worker],
                                        (kvp_tier)e->tier, k, e->n)
                    : kvp_index_stored(ix, e->worker, ++seq[e->worker],
                                       (kvp_tier)e->tier,
                                       e->has_parent ? k - 1 : NULL, k, e->n);
    if (rc < 0) {
      fprintf(stderr, "bench_index: event %zu: %s\n", i, kvp_strerror(rc));
      return rc;
    }
  }
  return 0;
}

static uint64_t blocks_of(const workload *w, size_t from, size_t to) {
  uint64_t b = 0;
  for (size_t i = from; i < to; i++)
    b += w->ev[i].n;
  return b;
}

/* A query chain: an existing session's full chain (its resident prefix and
 * the blocks nobody holds after it), or 1 in 10 a new session of a family. */
static void make_query(const workload *w, const cfg *c, kvp_key *k) {
  session s = w->s[rnd() % w->ns_init];
  if (rnd() % 10 == 0)
    s.id = w->ns + rnd() % 1000000; /* a session nobody has seen */
  for (uint32_t i = 0; i < c->chain; i++)
    k[i] = block_key(&s, i);
}

static int same(const kvp_index_match *a, int na, const kvp_index_match *b,
                int nb) {
  if (na != nb)
    return 0;
  for (int i = 0; i < na; i++)
    if (a[i].worker != b[i].worker ||
        a[i].prefix_blocks != b[i].prefix_blocks ||
        memcmp(a[i].tier_blocks, b[i].tier_blocks, sizeof a[i].tier_blocks) !=
            0)
      return 0;
  return 1;
}

typedef struct qres { /* one query plan's lookups */
  kvp_hist_summary q;
  uint64_t agree, compared, violations;
  double blocks_per_query;
} qres;

typedef struct result {
  double warm_ix, warm_bl;   /* block events / s from empty to full */
  double churn_ix, churn_bl; /* at full size: new sessions in, old out */
  double bpr_ix, bpr_bl;     /* bytes / residency */
  qres walk, bisect;         /* bisect: prefix_closed (<= 64 workers) */
  kvp_hist_summary q_bl;
  uint64_t residencies, keys;
} result;

/* One plan's lookups: the query chain k, answered by the index into mi and
 * by the baseline into mb. */
typedef struct lookup {
  kvp_index *ix;
  const baseline *bl;
  const workload *w;
  const cfg *c;
  kvp_key *k;
  kvp_index_match *mi, *mb;
  int nb;
  qres *r;
  uint64_t start; /* of the baseline's loop */
} lookup;

static void lk_prep(void *ctx, int rep) {
  lookup *l = ctx;
  (void)rep;
  make_query(l->w, l->c, l->k);
}

static void lk_index(void *ctx, int rep) {
  lookup *l = ctx;
  (void)rep;
  if (kvp_index_query(l->ix, l->k, l->c->chain, 0, l->mi, l->c->workers) < 0)
    exit(1);
}

static void lk_base(void *ctx, int rep) {
  lookup *l = ctx;
  (void)rep;
  l->nb = bl_query(l->bl, l->k, l->c->chain, l->mb, l->c->workers);
}

/* The index's answer to the same chain, compared; stops at the budget. */
static bool lk_compare(void *ctx, int rep) {
  lookup *l = ctx;
  (void)rep;
  int ni = kvp_index_query(l->ix, l->k, l->c->chain, 0, l->mi, l->c->workers);
  l->r->agree += same(l->mi, ni, l->mb, l->nb);
  l->r->compared++;
  return (double)(kvp_now_ns() - l->start) <= l->c->base_seconds * 1e9;
}

/* Times c->queries lookups with the index's current query plan (the first
 * tenth more warms up), then checks up to c->base_queries of its answers
 * against the baseline (timed when hb != NULL: the baseline's latency). */
static void lookups(kvp_index *ix, const baseline *bl, const workload *w,
                    const cfg *c, qres *r, kvp_hist *hb) {
  lookup l = {ix, bl, w, c, malloc(c->chain * sizeof *l.k),
              malloc(c->workers * sizeof *l.mi),
              malloc(c->workers * sizeof *l.mb), 0, r, 0};
  kvp_hist *hi = bench_hist();
  if (!l.k || !l.mi || !l.mb)
    exit(1);
  kvp_index_stats s0, s1;
  kvp_index_stats_get(ix, &s0);
  bench_fn fi = {.prep = lk_prep, .run = lk_index, .ctx = &l};
  bench_loop(&fi, (int)(c->queries / 10), (int)c->queries, hi);
  kvp_index_stats_get(ix, &s1);
  r->blocks_per_query = (double)(s1.query_blocks - s0.query_blocks) /
                        (double)(s1.queries - s0.queries);
  r->violations = s1.closure_violations - s0.closure_violations;
  l.start = kvp_now_ns();
  bench_fn fb = {.prep = lk_prep, .run = lk_base, .after = lk_compare,
                 .ctx = &l};
  bench_loop(&fb, 0, (int)c->base_queries, hb);
  kvp_hist_summarize(hi, &r->q);
  kvp_hist_destroy(hi);
  free(l.k);
  free(l.mi);
  free(l.mb);
}

/* Both query plans on the same index (bisection only where it applies). */
static void lookups_all(kvp_index *ix, const baseline *bl, const workload *w,
                        const cfg *c, result *r) {
  kvp_hist *hb = bench_hist();
  kvp__index_set_prefix_closed(ix, false);
  lookups(ix, bl, w, c, &r->walk, hb);
  kvp_hist_summarize(hb, &r->q_bl);
  kvp_hist_destroy(hb);
  if (c->workers <= 64) {
    kvp__index_set_prefix_closed(ix, true);
    lookups(ix, bl, w, c, &r->bisect, NULL);
    kvp__index_set_prefix_closed(ix, false);
  }
}

/* Every worker's digest against the baseline's key set. */
static uint64_t digests_agree(kvp_index *ix, const baseline *bl) {
  uint64_t bad = 0;
  for (uint32_t w = 0; w < bl->nw; w++) {
    const bench_set *b = &bl->w[w];
    kvp_key *keys = malloc((b->n * 4 + 1) * sizeof *keys);
    uint8_t *tiers = malloc(b->n * 4 + 1);
    size_t n = 0;
    for (size_t i = 0; i < b->cap; i++)
      for (unsigned t = 0; t < 4; t++)
        if (b->fp[i] != 0 && (b->mask[i] & (1u << t))) {
          keys[n] = (kvp_key){0, b->fp[i]};
          tiers[n++] = (uint8_t)t;
        }
    uint64_t want = 0, got = 1;
    kvp_index_digest_of(keys, tiers, n, &want);
    kvp_index_digest(ix, w, &got);
    bad += want != got;
    free(keys);
    free(tiers);
  }
  return bad;
}

/* Steady state: each new session's events in, then an old session's out
 * (the same number of sessions), on the index or on the baseline. */
static int churn(kvp_index *ix, baseline *bl, const workload *w, uint64_t *seq,
                 uint64_t *blocks) {
  size_t nnew = w->ns - w->ns_init;
  for (size_t j = 0; j < nnew; j++) {
    const session *in = &w->s[w->ns_init + j], *out = &w->s[j];
    for (int dir = 0; dir < 2; dir++) {
      const session *x = dir ? out : in;
      if (ix != NULL &&
          ingest_index(ix, w, seq, x->ev_first, x->ev_end, dir == 1) < 0)
        return -1;
      for (size_t e = x->ev_first; bl != NULL && e < x->ev_end; e++)
        bl_event(bl, &w->ev[e], w->keys, dir == 1);
      *blocks += blocks_of(w, x->ev_first, x->ev_end);
    }
  }
  return 0;
}

static double rate(uint64_t blocks, uint64_t t0, uint64_t t1) {
  return (double)blocks / ((double)(t1 - t0) / 1e9);
}

/* Warm-up ingest into empty structures, for the index then the baseline. */
static int warm(kvp_index *ix, baseline *bl, const workload *w, uint64_t *seq,
                result *r) {
  uint64_t blocks = blocks_of(w, 0, w->nev_init);
  uint64_t t0 = kvp_now_ns();
  if (ingest_index(ix, w, seq, 0, w->nev_init, false) < 0)
    return -1;
  uint64_t t1 = kvp_now_ns();
  for (size_t i = 0; i < w->nev_init; i++)
    bl_event(bl, &w->ev[i], w->keys, false);
  r->warm_ix = rate(blocks, t0, t1);
  r->warm_bl = rate(blocks, t1, kvp_now_ns());
  return 0;
}

static int steady(kvp_index *ix, baseline *bl, const workload *w, uint64_t *seq,
                  result *r) {
  uint64_t bi = 0, bb = 0, t0 = kvp_now_ns();
  if (churn(ix, NULL, w, seq, &bi) < 0)
    return -1;
  uint64_t t1 = kvp_now_ns();
  (void)churn(NULL, bl, w, seq, &bb);
  r->churn_ix = rate(bi, t0, t1);
  r->churn_bl = rate(bb, t1, kvp_now_ns());
  return 0;
}

static int run_cfg(const cfg *c, result *r, bool quick) {
  workload w;
  build(&w, c);
  memset(r, 0, sizeof *r);
  kvp_index_opts o = {.max_workers = c->workers};
  kvp_index *ix = NULL;
  if (kvp_index_create(&o, NULL, &ix) < 0)
    return 1;
  baseline bl = {bench_calloc(c->workers, sizeof(bench_set)), c->workers};
  uint64_t *seq = calloc(c->workers, sizeof *seq);
  for (uint32_t i = 0; i < c->workers; i++)
    kvp_index_worker_add(ix, i);
  if (warm(ix, &bl, &w, seq, r) < 0)
    return 1;
  kvp_index_stats st;
  kvp_index_stats_get(ix, &st);
  r->residencies = st.residencies;
  r->keys = st.keys;
  r->bpr_ix = (double)st.bytes / (double)st.residencies;
  r->bpr_bl = (double)bl_bytes(&bl) / (double)st.residencies;
  lookups_all(ix, &bl, &w, c, r);
  if (steady(ix, &bl, &w, seq, r) < 0)
    return 1;
  int bad = r->walk.agree != r->walk.compared ||
            r->bisect.agree != r->bisect.compared;
  if (quick) { /* after the churn too: answers, digests, invariants */
    result r2 = *r;
    memset(&r2.walk, 0, sizeof r2.walk);
    memset(&r2.bisect, 0, sizeof r2.bisect);
    lookups_all(ix, &bl, &w, c, &r2);
    bad |= r2.walk.agree != r2.walk.compared;
    bad |= r2.bisect.agree != r2.bisect.compared;
    bad |= digests_agree(ix, &bl) != 0;
    bad |= kvp__index_verify(ix) != 0;
  }
  kvp_index_destroy(ix);
  bench_sets_free(bl.w, bl.nw);
  free(seq);
  unbuild(&w);
  return bad;
}

/* The machine's floor: random 64-byte reads from 256 MiB, 32 prefetched
 * ahead, as a table walk at best does them (ns per line). */
static double line_floor_ns(void) {
  size_t lines = (256u << 20) / 64, n = 4000000;
  uint64_t *m = malloc(lines * 64), acc = 0;
  if (m == NULL)
    return 0;
  memset(m, 1, lines * 64);
  uint64_t t0 = kvp_now_ns();
  for (size_t i = 0; i < n; i++) {
    __builtin_prefetch(&m[(mix(i + 32) % lines) * 8]);
    acc += m[(mix(i) % lines) * 8];
  }
  double ns = (double)(kvp_now_ns() - t0) / (double)n;
  free(m);
  return acc == 0 ? 0 : ns;
}

/* ---- report
 * ---------------------------------------------------------------------- */

static uint64_t peak_rss_kib(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  uint64_t v = 0;
  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "VmHWM: %" SCNu64, &v) == 1)
      break;
  if (f != NULL)
    fclose(f);
  return v;
}

static const char *met(bool ok) { return ok ? "MET" : "NOT MET"; }

static const bench_col cols[] = {
    {"", 22}, {"index", 12}, {"baseline", 12}, {"ratio", 9}};
static const bench_table table = {BENCH_TEXT, 2, cols, 4};

/* label, index, baseline, index / baseline; the text after it */
static void row(const char *label, int digits, double ix, double bl,
                const char *tail) {
  bench_row w = bench_row_start(&table);
  bench_cell(&w, "%s", label);
  bench_cell(&w, "%.*f", digits, ix);
  bench_cell(&w, "%.*f", digits, bl);
  bench_cell_ratio(&w, ix, bl, 2, false);
  bench_row_end(&w, tail);
}

/* One query plan's latencies (and the baseline's) as ratios. */
static void report_lookups(const cfg *c, const result *r, const qres *q,
                           const char *pname) {
  static const char *const names[3] = {"p50, us", "p99, us", "p99.9, us"};
  uint64_t ix[3] = {q->q.p50, q->q.p99, q->q.p999};
  uint64_t bl[3] = {r->q_bl.p50, r->q_bl.p99, r->q_bl.p999};
  for (int i = 0; i < 3; i++) {
    char name[64], tail[64] = " faster";
    snprintf(name, sizeof name, "%s %s", pname, names[i]);
    if (i == 1 && c->workers == 64)
      snprintf(tail, sizeof tail, " faster   target <= 10 us: %s",
               met(ix[i] <= 10000));
    bench_row w = bench_row_start(&table);
    bench_cell(&w, "%s", name);
    bench_cell(&w, "%.2f", (double)ix[i] / 1e3);
    bench_cell(&w, "%.1f", (double)bl[i] / 1e3);
    bench_cell_ratio(&w, (double)bl[i], (double)(ix[i] ? ix[i] : 1), 1, false);
    bench_row_end(&w, tail);
  }
  char tail[256];
  snprintf(tail, sizeof tail, " blocks read per query; %" PRIu64 " index, %"
           PRIu64 " baseline queries; answers agree on %" PRIu64 "/%" PRIu64
           "; contract violations seen %" PRIu64, q->q.count, r->q_bl.count,
           q->agree, q->compared, q->violations);
  bench_row w = bench_row_start(&table);
  bench_cell(&w, "%s", pname);
  bench_cell(&w, "%.1f", q->blocks_per_query);
  bench_row_end(&w, tail);
}

static void report(const cfg *c, const result *r, double floor_ns) {
  printf("\n%u workers, %" PRIu64 " residencies, %" PRIu64 " keys, %u-block "
         "chains\n",
         c->workers, r->residencies, r->keys, c->chain);
  bench_table_head(&table, NULL);
  char tail[64];
  row("ingest from empty, M/s", 2, r->warm_ix / 1e6, r->warm_bl / 1e6,
      NULL);
  snprintf(tail, sizeof tail, "   target >= 10 M/s per core: %s",
           met(r->churn_ix >= 10e6));
  row("ingest steady, M/s", 2, r->churn_ix / 1e6, r->churn_bl / 1e6, tail);
  snprintf(tail, sizeof tail, "   target <= 24: %s", met(r->bpr_ix <= 24.0));
  row("bytes per residency", 1, r->bpr_ix, r->bpr_bl, tail);
  report_lookups(c, r, &r->walk, "lookup, walk");
  if (c->workers <= 64)
    report_lookups(c, r, &r->bisect, "lookup, bisect");
  if (floor_ns > 0)
    printf("  memory floor here: %.1f ns per random line (prefetched), so a "
           "walk reading one line per block needs >= %.1f us for %u blocks, "
           ">= %.1f us for the mean %.0f\n",
           floor_ns, floor_ns * c->chain / 1e3, c->chain,
           floor_ns * r->walk.blocks_per_query / 1e3,
           r->walk.blocks_per_query);
}

int main(int argc, char **argv) {
  bool quick = false;
  uint32_t only = 0; /* run only the configuration with this many workers */
  bench_opt opts[] = {
      BENCH_OPT("quick", BENCH_FLAG, &quick, NULL,
                "small sizes (64 and 300 workers, 200,000 residencies); "
                "checks only agreement (answers, digests, invariants)"),
      BENCH_OPT("only", BENCH_U32, &only, "WORKERS",
                "run only the configuration with this many workers (0: all)"),
      BENCH_OPT_END};
  if (bench_parse("bench_index",
                  "The locality index (ingest, bytes per residency, lookups "
                  "of 2,048-block chains\nat 10M residencies over 64 and "
                  "1,024 workers) against per-worker hash sets.\n",
                  opts, argc, argv) < 0)
    return 2;
  cfg full[2] = {{64, 10000000, 1000000, 2048, 20000, 3000, 4.0},
                 {1024, 10000000, 1000000, 2048, 5000, 1000, 6.0}};
  cfg small[2] = {{64, 200000, 40000, 512, 300, 300, 60.0},
                  {300, 200000, 40000, 512, 300, 300, 60.0}};
  cfg *cs = quick ? small : full;
  printf("kvplane bench_index%s: block events in runs of %d, %d shared "
         "prompts of %d blocks; one thread\n",
         quick ? " --quick (agreement only)" : "", RUN, FAMILIES,
         FAMILY_BLOCKS);
  double floor_ns = quick ? 0 : line_floor_ns();
  int bad = 0;
  for (int i = 0; i < 2; i++) {
    if (only != 0 && cs[i].workers != only)
      continue;
    result r;
    int b = run_cfg(&cs[i], &r, quick);
    report(&cs[i], &r, floor_ns);
    if (b)
      printf("  DISAGREEMENT between index and baseline\n");
    bad |= b;
  }
  printf("\npeak RSS %.2f GiB\n", (double)peak_rss_kib() / (1024.0 * 1024.0));
  return bad ? 1 : 0;
}
