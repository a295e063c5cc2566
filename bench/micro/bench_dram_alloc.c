/* SPDX-License-Identifier: Apache-2.0 */
/* bench_dram_alloc: kvtier's DRAM region allocator (size classes over the
 * region's pages, kvtier/tier_dram.c) against the one it replaced (a private
 * jemalloc arena over the same kind of region, bench_dram_je.c), in one run
 * on the same size streams.  Per workload: how much payload fits before the
 * first refusal (fill), the cost of a free + alloc pair in steady state at
 * three quarters of that (churn), and what is still held after the churn.
 * Every block carries a stamp checked when it is freed, so overlapping
 * blocks fail the run.  Alternates the two --reps times, keeps the best.
 *
 *   bench_dram_alloc [--mb N] [--ops N] [--reps R] [--cpu C] [--quick]
 *
 * --quick (CTest): a 64 MiB region and few operations; checks only.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_dram_je.h"
#include "bench_util.h"
#include "kvtier_internal.h"

#define KB (UINT64_C(1) << 10)
#define MB (UINT64_C(1) << 20)

typedef struct wl {
  const char *name;
  uint64_t fixed; /* the namespace's block size; 0: none */
  uint64_t lo, hi;
  int shape; /* 0 uniform in [lo, hi], 1 log-uniform, 2 fixed with 10 %
                variable tails in [lo, hi] */
} wl;

static const wl wls[] = {
    {"fixed 64 KiB", 64 * KB, 64 * KB, 64 * KB, 0},
    {"fixed 2 MiB", 2 * MB, 2 * MB, 2 * MB, 0},
    {"fixed 64 KiB + 10 % tails 1 B-64 KiB", 64 * KB, 1, 64 * KB, 2},
    {"variable 64 B-4 KiB", 0, 64, 4 * KB, 0},
    {"variable 1-256 KiB", 0, 1 * KB, 256 * KB, 0},
    {"variable 4 KiB-2 MiB (log)", 0, 4 * KB, 2 * MB, 1},
};

typedef struct blk {
  void *p;
  uint64_t len;
  uint32_t pool;
} blk;

typedef struct impl {
  const char *name;
  void *(*alloc)(void *d, size_t len, uint64_t fixed, uint32_t *pool,
                 uint64_t *charged);
  void (*free)(void *d, void *p, uint32_t pool);
} impl;

static void *kv_alloc(void *d, size_t len, uint64_t fixed, uint32_t *pool,
                      uint64_t *charged) {
  return kvp__tier_dram_alloc(d, len, fixed, pool, charged);
}
static void kv_free(void *d, void *p, uint32_t pool) {
  kvp__tier_dram_free(d, p, pool);
}
static void *je_alloc(void *d, size_t len, uint64_t fixed, uint32_t *pool,
                      uint64_t *charged) {
  return je_dram_alloc(d, len, fixed, pool, charged);
}
static void je_free(void *d, void *p, uint32_t pool) { je_dram_free(d, p, pool); }

static const impl impls[2] = {{"kvtier size classes", kv_alloc, kv_free},
                              {"jemalloc arena (before)", je_alloc, je_free}};

static uint64_t rng;
static uint64_t rnd(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return rng;
}

static uint64_t draw(const wl *w, uint64_t *fixed) {
  *fixed = w->fixed;
  switch (w->shape) {
  case 1: { /* log-uniform */
    double f = (double)(rnd() >> 11) / 9007199254740992.0;
    double lg = __builtin_log((double)w->lo) +
                f * (__builtin_log((double)w->hi) - __builtin_log((double)w->lo));
    return (uint64_t)__builtin_exp(lg);
  }
  case 2:
    if (rnd() % 10 != 0)
      return w->fixed;
    return w->lo + rnd() % (w->hi - w->lo + 1); /* a tail */
  default:
    return w->lo + rnd() % (w->hi - w->lo + 1);
  }
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* A block's first and last 8 bytes hold its stamp. */
static void stamp(blk *b, uint64_t v) {
  memcpy(b->p, &v, 8);
  if (b->len >= 16)
    memcpy((uint8_t *)b->p + b->len - 8, &v, 8);
}
static void check(const blk *b, uint64_t v) {
  uint64_t x, y = v;
  memcpy(&x, b->p, 8);
  if (b->len >= 16)
    memcpy(&y, (const uint8_t *)b->p + b->len - 8, 8);
  if (x != v || y != v) {
    fprintf(stderr, "bench_dram_alloc: block %" PRIu64 " overwritten\n", v);
    exit(1);
  }
}

typedef struct res {
  double fill, held; /* payload / region */
  double ns;         /* per free + alloc pair */
  uint64_t refused;  /* allocs refused in the churn */
} res;

static bool take(const impl *im, void *d, const wl *w, blk *b) {
  uint64_t fixed, charged;
  b->len = draw(w, &fixed);
  if (b->len < 8)
    b->len = 8;
  b->p = im->alloc(d, b->len, fixed, &b->pool, &charged);
  return b->p != NULL;
}

static res run(const impl *im, void *d, uint64_t region, const wl *w,
               uint64_t ops, blk *bl, uint64_t cap, uint64_t seed) {
  res r = {0};
  rng = seed;
  uint64_t n = 0, payload = 0;
  while (n < cap && take(im, d, w, &bl[n])) { /* fill to the first refusal */
    stamp(&bl[n], n);
    payload += bl[n].len;
    n++;
  }
  r.fill = (double)payload / (double)region;
  uint64_t live = n * 3 / 4;
  while (n > live) { /* free a random quarter */
    uint64_t i = rnd() % n;
    check(&bl[i], i);
    im->free(d, bl[i].p, bl[i].pool);
    payload -= bl[i].len;
    if (i < --n) {
      check(&bl[n], n);
      bl[i] = bl[n];
      stamp(&bl[i], i);
    }
  }
  uint64_t t0 = now_ns();
  for (uint64_t k = 0; k < ops && n > 0; k++) {
    uint64_t i = rnd() % n;
    check(&bl[i], i);
    im->free(d, bl[i].p, bl[i].pool);
    payload -= bl[i].len;
    while (!take(im, d, w, &bl[i])) { /* no room: drop another block */
      r.refused++;
      if (--n == i)
        goto done;
      check(&bl[n], n);
      im->free(d, bl[n].p, bl[n].pool);
      payload -= bl[n].len;
    }
    stamp(&bl[i], i);
    payload += bl[i].len;
  }
done:
  r.ns = (double)(now_ns() - t0) / (double)ops;
  r.held = (double)payload / (double)region;
  for (uint64_t i = 0; i < n; i++) {
    check(&bl[i], i);
    im->free(d, bl[i].p, bl[i].pool);
  }
  return r;
}

static void *mk(int which, uint64_t bytes) {
  void *d = NULL;
  int rc = which == 0 ? kvp__tier_dram_create(bytes, KVP_TIER_HUGE_THP, NULL,
                                              (tier_dram **)&d)
                      : je_dram_create(bytes, KVP_TIER_HUGE_THP, NULL,
                                       (je_dram **)&d);
  if (rc < 0)
    bench_die("dram create", rc);
  return d;
}

static void rm(int which, void *d) {
  if (which == 0)
    kvp__tier_dram_destroy(d);
  else
    je_dram_destroy(d);
}

int main(int argc, char **argv) {
  uint64_t mb = 1024, ops = 2000000;
  int reps = 2, cpu = -1;
  bool quick = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick"))
      quick = true;
    else if (i + 1 < argc && !strcmp(argv[i], "--mb"))
      mb = strtoull(argv[++i], NULL, 10);
    else if (i + 1 < argc && !strcmp(argv[i], "--ops"))
      ops = strtoull(argv[++i], NULL, 10);
    else if (i + 1 < argc && !strcmp(argv[i], "--reps"))
      reps = atoi(argv[++i]);
    else if (i + 1 < argc && !strcmp(argv[i], "--cpu"))
      cpu = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: bench_dram_alloc [--mb N] [--ops N] [--reps R] "
                      "[--cpu C] [--quick]\n");
      return 2;
    }
  }
  if (quick)
    mb = 64, ops = 20000, reps = 1;
  if (mb < 8) {
    fprintf(stderr, "bench_dram_alloc: --mb must be at least 8\n");
    return 2;
  }
  if (cpu >= 0)
    bench_pin_cpu(cpu);
  uint64_t region = mb * MB, cap = region / 64 + 1;
  blk *bl = bench_calloc(cap, sizeof *bl);
  printf("bench_dram_alloc: region %" PRIu64 " MiB (THP), %" PRIu64
         " free+alloc pairs at 3/4 of the fill, best of %d, cpu %d\n\n",
         mb, ops, reps, cpu);
  printf("| workload | allocator | fill | churn ns/pair | held after | refused "
         "| time vs jemalloc |\n|---|---|---:|---:|---:|---:|---:|\n");
  for (size_t w = 0; w < sizeof wls / sizeof wls[0]; w++) {
    res best[2];
    for (int rep = 0; rep < reps; rep++)
      for (int k = 0; k < 2; k++) {
        void *d = mk(k, region);
        res r = run(&impls[k], d, region, &wls[w], ops, bl, cap, 0x9E37 + w);
        rm(k, d);
        if (rep == 0 || r.ns < best[k].ns)
          best[k] = r;
      }
    for (int k = 0; k < 2; k++)
      printf("| %s | %s | %.1f %% | %.1f | %.1f %% | %" PRIu64 " | %s%.2fx |\n",
             wls[w].name, impls[k].name, 100 * best[k].fill, best[k].ns,
             100 * best[k].held, best[k].refused, "", best[k].ns / best[1].ns);
  }
  free(bl);
  return 0;
}
