/* SPDX-License-Identifier: Apache-2.0 */
/* A trace's offered load, for `--workers auto`: the prefill GPU-seconds an
 * ideal shared cache would still leave (every token after the longest prefix
 * sent before is computed: the infinite bound's work, the least any policy
 * does) per second of arrivals, in windows of BH_LOAD_WINDOW_S, weighted by
 * each window's work.  Prefill is the simulated engine's serial resource
 * (one prefill at a time per worker, decode batched beside it), so that load
 * is the number of GPUs kept busy; dividing by a target utilisation sizes
 * the cluster. */
#include <math.h>
#include <stdlib.h>

#include "harness.h"

#define FP_AHEAD 8 /* keys prefetched ahead: the set outgrows the caches */

/* Fingerprints seen so far (open addressing; 0 = empty, so fp | 1). */
typedef struct fpset {
  uint64_t *v;
  size_t mask, n;
} fpset;

static size_t fp_home(uint64_t fp, size_t mask) {
  return (size_t)(fp * 0x9E3779B97F4A7C15ull >> 17) & mask;
}

static int fp_grow(fpset *s) {
  size_t nm = s->mask ? s->mask * 2 + 1 : 4095;
  uint64_t *nv = calloc(nm + 1, sizeof *nv);
  if (nv == NULL)
    return KVP_ENOMEM;
  for (size_t i = 0; s->v != NULL && i <= s->mask; i++) {
    if (s->v[i] == 0)
      continue;
    size_t j = fp_home(s->v[i], nm);
    while (nv[j] != 0)
      j = (j + 1) & nm;
    nv[j] = s->v[i];
  }
  free(s->v);
  s->v = nv;
  s->mask = nm;
  return 0;
}

/* Adds fp; returns 1 if it was there already, 0 if new, < 0 on error. */
static int fp_add(fpset *s, uint64_t fp) {
  if ((s->n + 1) * 2 > s->mask + 1 && fp_grow(s) < 0)
    return KVP_ENOMEM;
  fp |= 1;
  size_t i = fp_home(fp, s->mask);
  while (s->v[i] != 0 && s->v[i] != fp)
    i = (i + 1) & s->mask;
  if (s->v[i] == fp)
    return 1;
  s->v[i] = fp;
  s->n++;
  return 0;
}

/* Prefill FLOP/s as the simulator times it (bh_sim_run's defaults). */
static double flops_per_s(const bh_cluster *cl) {
  return (cl->gpu.flops > 0 ? cl->gpu.flops : 989e12) *
         (cl->gpu.efficiency > 0 ? cl->gpu.efficiency : 0.5);
}

/* Prefill GPU-seconds left by the ideal shared cache, in arrival order,
 * added into win[] by arrival window (window_s wide, from the first). */
static int ideal_prefill_s(const bh_trace *t, const bh_cluster *cl,
                           double sp, double window_s, double *win,
                           size_t n_win) {
  fpset seen = {0};
  double fs = flops_per_s(cl), t0 = t->reqs[0].t / sp;
  int rc = fp_grow(&seen);
  for (size_t i = 0; i < t->n_reqs && rc >= 0; i++) {
    const bh_req *q = &t->reqs[i];
    const kvp_key *k = t->keys + q->key_off;
    uint64_t m = 0;
    bool prefix = true;
    for (uint32_t j = 0; j < q->n_blocks && rc >= 0; j++) {
      if (j + FP_AHEAD < q->n_blocks) /* a hint: the slot a later key probes first */
        __builtin_prefetch(&seen.v[fp_home(k[j + FP_AHEAD].lo | 1, seen.mask)]);
      rc = fp_add(&seen, k[j].lo);
      prefix = prefix && rc == 1;
      m += prefix;
    }
    size_t b = (size_t)((q->t / sp - t0) / window_s);
    win[b < n_win ? b : n_win - 1] +=
        kvp_model_prefill_flops(&cl->model, m * t->block_size, q->in_tokens) /
        fs;
  }
  free(seen.v);
  return rc < 0 ? rc : 0;
}

/* The load the average unit of work sees: windows weighted by their work
 * (a trace idle for days after a busy hour is sized for the hour). */
static double work_weighted_load(const double *win, size_t n, double window_s,
                                 double *total) {
  double sum = 0, sq = 0;
  for (size_t b = 0; b < n; b++) {
    sum += win[b];
    sq += win[b] * win[b];
  }
  *total = sum;
  return sum > 0 ? sq / sum / window_s : 0;
}

int bh_load_estimate(const bh_trace *t, const bh_cluster *cl, double speed,
                     double util, bh_load *out) {
  *out = (bh_load){0};
  if (t->n_reqs == 0 || !(util > 0 && util <= 1))
    return KVP_EINVAL;
  double sp = speed > 0 ? speed : 1.0;
  out->span_s = (t->reqs[t->n_reqs - 1].t - t->reqs[0].t) / sp;
  out->window_s = BH_LOAD_WINDOW_S;
  if (out->span_s / out->window_s > 1e6) /* at most a million windows */
    out->window_s = out->span_s / 1e6;
  size_t n_win = (size_t)(out->span_s / out->window_s) + 1;
  double *win = calloc(n_win, sizeof *win);
  if (win == NULL)
    return KVP_ENOMEM;
  int rc = ideal_prefill_s(t, cl, sp, out->window_s, win, n_win);
  if (rc >= 0)
    out->busy = work_weighted_load(win, n_win, out->window_s,
                                   &out->prefill_gpu_s);
  free(win);
  double w = ceil(out->busy / util);
  out->workers = !(w <= 4096) ? 4096 : w < 1 ? 1 : (uint32_t)w;
  return rc < 0 ? rc : 0;
}
