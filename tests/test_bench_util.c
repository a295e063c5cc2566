/* SPDX-License-Identifier: Apache-2.0 */
/* The microbenchmarks' common layer (bench/micro/bench_util.c): the option
 * table, the timed loop, the per-worker hash-set baseline against a plain
 * reference, and the row printer's two styles. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "bench_util.h"
#include "test_harness.h"

typedef struct vals {
  bool quick;
  int cpu;
  uint32_t workers;
  uint64_t residencies, reps, seed;
  double secs;
  const char *dir;
} vals;

static int parse(vals *v, int argc, const char **argv, bench_opt *t) {
  bench_opt tab[] = {
      BENCH_OPT("quick", BENCH_FLAG, &v->quick, NULL, "q"),
      BENCH_OPT("cpu", BENCH_INT, &v->cpu, "N", "c"),
      BENCH_OPT("workers", BENCH_U32, &v->workers, "N", "w"),
      BENCH_OPT("residencies", BENCH_U64, &v->residencies, "N", "r"),
      BENCH_OPT("reps", BENCH_U64, &v->reps, "N", "n"),
      BENCH_OPT("seed", BENCH_U64, &v->seed, "S", "s"),
      BENCH_OPT("seconds", BENCH_DOUBLE, &v->secs, "S", "t"),
      BENCH_OPT("dir", BENCH_STR, &v->dir, "D", "d"),
      BENCH_OPT_END};
  int rc = bench_parse("test_bench", NULL, tab, argc, (char **)argv);
  memcpy(t, tab, sizeof tab);
  return rc;
}

TEST(options_parse) {
  vals v = {.cpu = 0, .workers = 64, .dir = "x"};
  bench_opt t[9];
  const char *argv[] = {"prog",   "--workers", "7",     "--seed=0x10",
                        "--resi", "5",         "--cpu", "-1",
                        "--quick", "--seconds", "2.5",  "--dir=/tmp/y"};
  ASSERT_EQ(parse(&v, 12, argv, t), 0);
  ASSERT_STR_EQ(bench_name, "test_bench");
  ASSERT_EQ(v.workers, 7u);
  ASSERT_EQ(v.seed, 16u);
  ASSERT_EQ(v.residencies, 5u); /* a unique prefix */
  ASSERT_EQ(v.cpu, -1);
  ASSERT_TRUE(v.quick);
  ASSERT_DOUBLE_NEAR(v.secs, 2.5, 1e-12);
  ASSERT_STR_EQ(v.dir, "/tmp/y");
  ASSERT_TRUE(bench_given(t, "residencies"));
  ASSERT_TRUE(bench_given(t, "quick"));
  ASSERT_FALSE(bench_given(t, "reps"));
  ASSERT_FALSE(bench_given(t, "no-such-option"));
}

TEST(options_reject) {
  static const char *const bad[][3] = {
      {"prog", "--nope", "1"},      /* unknown */
      {"prog", "--re", "1"},        /* ambiguous: residencies, reps */
      {"prog", "--workers", "abc"}, /* not a number */
      {"prog", "--workers", "-3"},  /* negative into unsigned */
      {"prog", "--cpu", "1x"},      /* trailing junk */
      {"prog", "--quick=1", ""},    /* a flag takes no value */
      {"prog", "positional", ""},   /* not an option */
      {"prog", "--seconds", "fast"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    vals v = {0};
    bench_opt t[9];
    const char *argv[3] = {bad[i][0], bad[i][1], bad[i][2]};
    int argc = bad[i][2][0] ? 3 : 2;
    ASSERT_EQ(parse(&v, argc, argv, t), -1);
  }
  vals v = {0};
  bench_opt t[9];
  const char *missing[] = {"prog", "--workers"}; /* no value */
  ASSERT_EQ(parse(&v, 2, missing, t), -1);
}

typedef struct loop_log {
  int preps, runs, afters, first, last, stop_at;
} loop_log;

static void log_prep(void *ctx, int rep) {
  loop_log *l = ctx;
  if (l->preps++ == 0)
    l->first = rep;
}
static void log_run(void *ctx, int rep) {
  loop_log *l = ctx;
  l->runs++;
  l->last = rep;
}
static bool log_after(void *ctx, int rep) {
  loop_log *l = ctx;
  l->afters++;
  return rep != l->stop_at;
}

TEST(timed_loop) {
  kvp_hist *h = bench_hist();
  loop_log l = {.stop_at = -100};
  bench_fn fn = {log_prep, log_run, log_after, &l};
  ASSERT_EQ(bench_loop(&fn, 3, 5, h), 5);
  ASSERT_EQ(l.preps, 8);
  ASSERT_EQ(l.runs, 8);
  ASSERT_EQ(l.afters, 8);
  ASSERT_EQ(l.first, -3); /* warm-up reps are negative */
  ASSERT_EQ(l.last, 4);
  ASSERT_EQ(kvp_hist_count(h), 5u); /* only the timed reps */
  kvp_hist_reset(h);
  l = (loop_log){.stop_at = 1};
  ASSERT_EQ(bench_loop(&fn, 2, 10, h), 2); /* reps 0 and 1, then stop */
  ASSERT_EQ(kvp_hist_count(h), 2u);
  bench_fn bare = {.run = log_run, .ctx = &l};
  ASSERT_EQ(bench_loop(&bare, 0, 3, NULL), 3);
  kvp_hist_destroy(h);
}

/* The reference: a flat array of (worker, fp, mask). */
enum { NW = 5, NK = 3000 };
static uint8_t ref_mask[NW][NK];

/* never 0 or 1: bench_fp leaves these keys as they are */
static uint64_t fp_of(unsigned k) { return (uint64_t)k * 0x9E3779B97F4A7C15ull | 4; }

static void ref_prefix(const unsigned *chain, size_t n, kvp_index_match *want,
                       int *nwant) {
  *nwant = 0;
  for (uint32_t w = 0; w < NW; w++) {
    kvp_index_match m = {.worker = w};
    for (size_t i = 0; i < n && ref_mask[w][chain[i]]; i++) {
      m.prefix_blocks++;
      m.tier_blocks[__builtin_ctz(ref_mask[w][chain[i]])]++;
    }
    if (m.prefix_blocks)
      want[(*nwant)++] = m;
  }
}

static void check_query(const bench_set *sets, const unsigned *chain, size_t n) {
  kvp_key keys[64];
  for (size_t i = 0; i < n; i++)
    keys[i] = (kvp_key){0, fp_of(chain[i])};
  kvp_index_match want[NW], got[NW];
  int nwant;
  ref_prefix(chain, n, want, &nwant);
  for (int all = 0; all < 2; all++) {
    memset(got, 0, sizeof got);
    ASSERT_EQ(bench_sets_query(sets, NW, keys, n, all, got, NW), nwant);
    for (int i = 0; i < nwant; i++) {
      ASSERT_EQ(got[i].worker, want[i].worker);
      ASSERT_EQ(got[i].prefix_blocks, want[i].prefix_blocks);
      ASSERT_MEM_EQ(got[i].tier_blocks, want[i].tier_blocks,
                    sizeof want[i].tier_blocks);
    }
  }
}

TEST(baseline_sets) {
  memset(ref_mask, 0, sizeof ref_mask);
  bench_set *sets = bench_calloc(NW, sizeof *sets);
  sets[0].load_pct = 50;
  for (int op = 0; op < 40000; op++) {
    uint32_t w = (uint32_t)kvt_rand_below(NW);
    unsigned k = (unsigned)kvt_rand_below(NK);
    uint8_t bit = (uint8_t)(1u << kvt_rand_below(4));
    bool del = kvt_rand_below(4) == 0;
    bench_set_update(&sets[w], fp_of(k), del ? 0 : bit, del ? bit : 0);
    ref_mask[w][k] = (uint8_t)(del ? ref_mask[w][k] & ~bit : ref_mask[w][k] | bit);
  }
  for (uint32_t w = 0; w < NW; w++) {
    for (unsigned k = 0; k < NK; k++)
      ASSERT_EQ(bench_set_get(&sets[w], fp_of(k)), ref_mask[w][k]);
    unsigned load = sets[w].load_pct ? sets[w].load_pct : 75;
    ASSERT_LE(sets[w].n * 100, sets[w].cap * load);
  }
  /* 50% load: a table at least twice its slots in use */
  ASSERT_GE(sets[0].cap, 2 * sets[0].n);
  for (int q = 0; q < 200; q++) { /* chains: runs of held keys, then any */
    unsigned chain[64];
    size_t n = 1 + kvt_rand_below(64);
    for (size_t i = 0; i < n; i++)
      chain[i] = (unsigned)(i < n / 2 ? i : kvt_rand_below(NK));
    check_query(sets, chain, n);
  }
  ASSERT_EQ(bench_fp((kvp_key){0, 0}), 2u); /* remapped as the index does */
  ASSERT_EQ(bench_fp((kvp_key){0, 1}), 3u);
  ASSERT_EQ(bench_fp((kvp_key){0, 7}), 7u);
  bench_sets_free(sets, NW);
}

/* What the block prints, read back from stdout. */
static void capture(void (*print)(void), char *out, size_t cap) {
  fflush(stdout);
  int saved = dup(1);
  FILE *tmp = tmpfile();
  ASSERT_NOT_NULL(tmp);
  ASSERT_GE(dup2(fileno(tmp), 1), 0);
  print();
  fflush(stdout);
  ASSERT_GE(dup2(saved, 1), 0);
  close(saved);
  rewind(tmp);
  size_t n = fread(out, 1, cap - 1, tmp);
  out[n] = '\0';
  fclose(tmp);
}

static const bench_col cols[] = {{"name", 8}, {"x", 6}, {"ratio", 7}};

static void print_text(void) {
  bench_table t = {BENCH_TEXT, 2, cols, 3};
  bench_table_head(&t, " (us)");
  bench_row r = bench_row_start(&t);
  bench_cell(&r, "%s", "ab");
  bench_cell(&r, "%.1f", 1.25);
  bench_cell_ratio(&r, 3, 2, 2, true); /* bold only in markdown */
  bench_row_end(&r, " tail");
}

static void print_md(void) {
  bench_table t = {BENCH_MARKDOWN, 0, cols, 3};
  bench_table_head(&t, NULL);
  bench_row r = bench_row_start(&t);
  bench_cell(&r, "%s", "ab");
  bench_cell_ratio(&r, 3, 2, 2, true);
  bench_cell_ratio(&r, 3, 0, 2, false); /* no baseline: "-" */
  bench_row_end(&r, NULL);
}

TEST(row_printer) {
  char out[512];
  capture(print_text, out, sizeof out);
  ASSERT_STR_EQ(out, "  name          x   ratio (us)\n"
                     "  ab          1.2   1.50x tail\n");
  capture(print_md, out, sizeof out);
  ASSERT_STR_EQ(out, "| name | x | ratio |\n"
                     "|---|---|---|\n"
                     "| ab | **1.50x** | - |\n");
}

TEST_MAIN(TEST_ENTRY(options_parse), TEST_ENTRY(options_reject),
          TEST_ENTRY(timed_loop), TEST_ENTRY(baseline_sets),
          TEST_ENTRY(row_printer))
