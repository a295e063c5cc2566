/* SPDX-License-Identifier: Apache-2.0 */
/* bench_harness_scale: kvplane-bench run's simulated requests/s as a trace
 * grows.  Factor k reads the trace k times, each copy's sessions relabelled
 * (copy c of session S is "S#c"; agentic copies get their own id space per
 * session file, the shared system+tools prefix stays shared), and sizes the
 * cluster with --workers auto (or a fixed count), so the load per worker
 * stays that of the original.  Prints each policy's simulated requests/s
 * (simulation wall time only, not reading) and the slowdown against 1x,
 * measured in the same run:
 *   bench_harness_scale [--factors 1,2,5,10,20] [--policies LIST]
 *                       [--workers N|auto[:U]] [--check X] [--cpu]
 *                       [--quick] [TRACE]
 * TRACE defaults to $KVP_SHARED_DIR/traces/cc_agentic.  --check X: exit 1
 * if any factor is more than X times slower than 1x (all policies).  --cpu:
 * requests per second of the simulation's CPU time (this thread's) instead
 * of its wall time: on a shared machine, time spent waiting for a core is
 * then not counted (caches shared with other jobs still are).  A second
 * table gives each policy's simulated work per request (index block
 * updates) and its slowdown per unit of that work, a third its page faults
 * and kernel CPU per request.  A policy's simulation runs 3 times at
 * every factor, and more while those add up to less than 10 s (9 runs at
 * most), and its median rate is printed: short runs are the noisy ones
 * (--quick: one run each, the smoke test bench_harness_scale_quick).  The
 * first factor (the baseline) is run again after each run of a larger one,
 * its trace kept: memory bandwidth on a shared machine drifts over the
 * minutes a 20x replay takes.  Three slowdowns are printed: all runs'
 * requests over all their seconds (each policy's mean run, as one run of
 * every policy would take), the ratio of medians per policy, and
 * (the headline, and what --check tests) "paired": each larger-factor run
 * against the baseline runs just before and after it, the median of those
 * ratios. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/resource.h>

#include "harness.h"

#define MAX_F 16

typedef struct opts {
  uint32_t factor[MAX_F];
  size_t n_factors;
  int policy[BH_POLICY_COUNT];
  size_t n_policies;
  uint32_t workers; /* 0 = auto */
  double util, check;
  bool cpu;   /* --cpu: rates per CPU second of the simulation */
  bool quick; /* --quick: one run each, no repeats (the smoke test) */
  const char *trace;
} opts;

static int parse_list(const char *s, opts *o, bool policies) {
  char buf[512];
  snprintf(buf, sizeof buf, "%s", s);
  size_t *n = policies ? &o->n_policies : &o->n_factors;
  *n = 0;
  for (char *sv = NULL, *t = strtok_r(buf, ",", &sv); t;
       t = strtok_r(NULL, ",", &sv)) {
    if (*n == (policies ? (size_t)BH_POLICY_COUNT : MAX_F))
      return -1;
    if (policies && bh_policy_parse(t, &o->policy[*n]) < 0)
      return -1;
    if (!policies) {
      char *e;
      unsigned long v = strtoul(t, &e, 10);
      if (*e || v == 0 || v > 1000)
        return -1;
      o->factor[*n] = (uint32_t)v;
    }
    (*n)++;
  }
  return *n > 0 ? 0 : -1;
}

static int parse(int argc, char **argv, opts *o) {
  static char def[4096];
  *o = (opts){.factor = {1, 2, 5, 10, 20}, .n_factors = 5,
              .policy = {KVP_POLICY_ROUND_ROBIN, KVP_POLICY_KVPLANE_COST,
                         BH_POLICY_INFINITE},
              .n_policies = 3, .util = 0.7};
  const char *sh = getenv("KVP_SHARED_DIR");
  snprintf(def, sizeof def, "%s/traces/cc_agentic", sh ? sh : "../shared");
  o->trace = def;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
    int rc = 0;
    if (a[0] != '-') {
      o->trace = a;
      continue;
    }
    if (!strcmp(a, "--cpu") || !strcmp(a, "--quick")) {
      *(a[2] == 'c' ? &o->cpu : &o->quick) = true;
      continue;
    }
    i++;
    if (!strcmp(a, "--factors"))
      rc = parse_list(v, o, false);
    else if (!strcmp(a, "--policies"))
      rc = parse_list(v, o, true);
    else if (!strcmp(a, "--check"))
      rc = (o->check = strtod(v, NULL)) > 0 ? 0 : -1;
    else if (!strcmp(a, "--workers") && !strncmp(v, "auto", 4))
      rc = v[4] == ':' ? ((o->util = strtod(v + 5, NULL)) > 0 && o->util <= 1
                              ? 0 : -1)
                       : v[4] ? -1 : 0;
    else if (!strcmp(a, "--workers"))
      rc = (o->workers = (uint32_t)strtoul(v, NULL, 10)) > 0 ? 0 : -1;
    else
      rc = -1;
    if (rc < 0) {
      fprintf(stderr, "usage: bench_harness_scale [--factors 1,2,5,10,20] "
                      "[--policies LIST] [--workers N|auto[:U]] [--check X] "
                      "[--cpu] [--quick] [TRACE]\nbad option: %s %s\n", a, v);
      return -1;
    }
  }
  return 0;
}

/* Copy c's sessions renamed "S#c" (one new name per old one). */
static int relabel(bh_trace *t, size_t from, uint32_t c) {
  size_t n0 = t->n_names; /* the reads' names; renamed ones come after */
  uint32_t *map = calloc(n0 + 1, sizeof *map);
  if (map == NULL)
    return KVP_ENOMEM;
  int rc = 0;
  for (size_t i = from; i < t->n_reqs && rc >= 0; i++) {
    uint32_t s = t->reqs[i].session;
    if (s == 0 || s >= n0)
      continue;
    if (map[s] == 0) {
      char name[512];
      snprintf(name, sizeof name, "%s#%u", t->names[s], c);
      rc = bh_trace_name(t, name, &map[s]);
    }
    t->reqs[i].session = map[s];
  }
  free(map);
  return rc;
}

static int read_scaled(const opts *o, uint32_t k, bh_trace *t) {
  bh_read_opts ro = {.quiet = true};
  char err[512];
  bh_trace_init(t);
  for (uint32_t c = 0; c < k; c++) {
    size_t from = t->n_reqs;
    int rc = bh_read_path(o->trace, BH_FMT_AUTO, &ro, t, err, sizeof err);
    if (rc >= 0 && c > 0)
      rc = relabel(t, from, c);
    if (rc < 0) {
      fprintf(stderr, "bench_harness_scale: %s: %s\n", o->trace, err);
      return rc;
    }
  }
  return bh_trace_finish(t);
}

static double thread_cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* One policy at one factor's run: rates and what the kernel took. */
typedef struct prun {
  double rps;    /* requests per second (CPU or wall) */
  double req, s; /* requests, seconds */
  double faults; /* page faults per request (this thread's) */
  double sys_us; /* kernel CPU microseconds per request (faults, mostly) */
} prun;

static double tv_s(struct timeval tv) {
  return (double)tv.tv_sec + (double)tv.tv_usec * 1e-6;
}

static int cmp_prun(const void *a, const void *b) {
  double x = ((const prun *)a)->rps, y = ((const prun *)b)->rps;
  return (x > y) - (x < y);
}

#define REPEAT_S 10.0
#define REPEAT_MIN 3 /* every factor: its first run alone pays the faults */
#define REPEAT_MAX 9
#define RUNS_MAX (REPEAT_MAX * (1 + REPEAT_MIN * MAX_F))

/* A policy's runs at one factor (the first factor's: before and after
 * each larger one). */
typedef struct runs {
  prun v[RUNS_MAX];
  int n;
  double work; /* simulated work per request */
} runs;

/* The median run by rate (the mean of the middle two's rates). */
static prun runs_median(const runs *r) {
  prun v[RUNS_MAX];
  memcpy(v, r->v, (size_t)r->n * sizeof v[0]);
  qsort(v, (size_t)r->n, sizeof v[0], cmp_prun);
  prun m = v[r->n / 2];
  if (r->n % 2 == 0)
    m.rps = (v[r->n / 2 - 1].rps + v[r->n / 2].rps) / 2;
  return m;
}

/* One policy at one factor, its runs appended to *out: `least` runs, and
 * more while they add up to less than REPEAT_S (REPEAT_MAX runs at most;
 * one with --quick): a one-second simulation's rate moved by up to 50 %
 * from one run to the next on a shared machine, a 20x one's by 20 %.
 * Repeats reuse the memory the first run faulted in (freed pages are
 * kept), so the median run pays few page faults, at every factor alike (as
 * kvplane-bench run replaying several policies in one process does); the
 * fault columns say so. */
static int run_policy(const opts *o, const bh_trace *t, const bh_sim_opts *so,
                      int least, runs *out) {
  double secs = 0;
  int most = o->quick ? 1 : REPEAT_MAX;
  for (int k = 0; k < most && (k < least || secs < REPEAT_S) &&
                  out->n < RUNS_MAX;
       k++) {
    bh_result r;
    char err[512];
    struct rusage u0, u1;
    double cpu0 = thread_cpu_s();
    getrusage(RUSAGE_THREAD, &u0);
    int rc = bh_sim_run(t, so, &r, err, sizeof err);
    getrusage(RUSAGE_THREAD, &u1);
    if (rc < 0) {
      fprintf(stderr, "bench_harness_scale: %s\n", err);
      return rc;
    }
    double sec = o->cpu ? thread_cpu_s() - cpu0 : r.wall_seconds;
    double nreq = r.requests ? (double)r.requests : 1;
    out->v[out->n++] = (prun){
        .rps = (double)r.requests / sec,
        .req = (double)r.requests,
        .s = sec,
        .faults = (double)(u1.ru_minflt - u0.ru_minflt) / nreq,
        .sys_us = (tv_s(u1.ru_stime) - tv_s(u0.ru_stime)) * 1e6 / nreq};
    out->work = r.requests ? (double)r.event_blocks / (double)r.requests : 0;
    secs += sec;
    bh_result_free(&r);
  }
  return 0;
}

/* One factor's trace and cluster. */
typedef struct factor {
  bh_trace t;
  bh_sim_opts so;
} factor;

static int factor_load(const opts *o, uint32_t k, factor *f) {
  int rc = read_scaled(o, k, &f->t);
  f->so = (bh_sim_opts){.seed = 1};
  bh_cluster_defaults(&f->so.cl);
  bh_load l = {.workers = o->workers};
  if (rc >= 0 && o->workers == 0)
    rc = bh_load_estimate(&f->t, &f->so.cl, 1.0, o->util, &l);
  f->so.cl.workers = l.workers;
  return rc;
}

/* Every policy at factor f, its runs appended to r[] (`least` each). */
static int factor_run(const opts *o, factor *f, int least, runs *r) {
  for (size_t p = 0; p < o->n_policies; p++) {
    f->so.policy = o->policy[p];
    int rc = run_policy(o, &f->t, &f->so, least, &r[p]);
    if (rc < 0)
      return rc;
  }
  return 0;
}

/* Requests per second over r[p]'s runs from[p] .. to[p] - 1, all policies
 * together (NULL from/to: all runs), as one run of each policy would see
 * it: each policy's mean requests over its mean seconds per run, summed.
 * (A fast policy runs more often in the same time: summing runs would
 * weigh it more.) */
static double runs_span(const opts *o, const runs *r, const int *from,
                        const int *to) {
  double req = 0, s = 0;
  for (size_t p = 0; p < o->n_policies; p++) {
    int k0 = from ? from[p] : 0, k1 = to ? to[p] : r[p].n;
    double pq = 0, ps = 0;
    for (int k = k0; k < k1; k++)
      pq += r[p].v[k].req, ps += r[p].v[k].s;
    if (k1 > k0)
      req += pq / (k1 - k0), s += ps / (k1 - k0);
  }
  return s > 0 ? req / s : 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Work per request and the slowdown per unit of work: a policy whose
 * requests do more simulated work on a larger cluster (round_robin's hit
 * rate falls as its sessions spread) is slower for that reason alone.
 * Then the kernel's share: page faults and kernel CPU per request. */
static void print_work(const opts *o, double work[][BH_POLICY_COUNT],
                       prun pr[][BH_POLICY_COUNT]) {
  printf("\nsimulated work per request (index block updates: blocks stored "
         "+ removed; a tier move is two)\nand the slowdown per unit of work "
         "(slowdown / (work / work at %ux)):\n%7s",
         o->factor[0], "factor");
  for (size_t p = 0; p < o->n_policies; p++)
    printf(" %21.21s", bh_policy_name(o->policy[p]));
  printf("\n");
  for (size_t f = 0; f < o->n_factors; f++) {
    printf("%6ux", o->factor[f]);
    for (size_t p = 0; p < o->n_policies; p++) {
      double w0 = work[0][p], w = work[f][p];
      double slow = pr[f][p].rps > 0 ? pr[0][p].rps / pr[f][p].rps : 0;
      if (w > 0 && w0 > 0)
        printf(" %10.0f %9.2fx", w, slow / (w / w0));
      else /* no events (the infinite bound) */
        printf(" %10s %10s", "-", "-");
    }
    printf("\n");
  }
  printf("\npage faults and kernel CPU microseconds per request (the median "
         "run's;\na repeated factor's median run reuses memory faulted in "
         "by its first):\n%7s", "factor");
  for (size_t p = 0; p < o->n_policies; p++)
    printf(" %21.21s", bh_policy_name(o->policy[p]));
  printf("\n");
  for (size_t f = 0; f < o->n_factors; f++) {
    printf("%6ux", o->factor[f]);
    for (size_t p = 0; p < o->n_policies; p++)
      printf(" %8.1f flt %8.1f us", pr[f][p].faults, pr[f][p].sys_us);
    printf("\n");
  }
}

int main(int argc, char **argv) {
  opts o;
  if (parse(argc, argv, &o) < 0)
    return 2;
  bh_batch_memory(); /* as kvplane-bench run does */
  printf("simulated requests/s%s of %s replayed at 1x..%ux (workers %s)\n",
         o.cpu ? " (per CPU second)" : "", o.trace, o.factor[o.n_factors - 1],
         o.workers ? "fixed" : "auto");
  printf("%7s %9s %7s", "factor", "requests", "workers");
  for (size_t p = 0; p < o.n_policies; p++)
    printf(" %13.13s", bh_policy_name(o.policy[p]));
  printf(" %12s %9s %9s\n", "all", "slowdown", "paired");
  /* The first factor is measured before the others and again after each
   * run of a larger one (its trace kept): on a shared machine the speed of
   * memory drifts over the minutes a large factor takes.  A larger
   * factor's run k is paired with the baseline runs just before and just
   * after it (a minute or less apart); the paired slowdown is the median
   * of those runs' ratios, next to the ratio of all runs and of medians. */
  static runs base[BH_POLICY_COUNT], cur[BH_POLICY_COUNT];
  prun pr[MAX_F][BH_POLICY_COUNT];
  double work[MAX_F][BH_POLICY_COUNT];
  double worst = 0, worst_all = 0;
  int least = o.quick ? 1 : REPEAT_MIN;
  factor f0;
  if (factor_load(&o, o.factor[0], &f0) < 0 ||
      factor_run(&o, &f0, least, base) < 0)
    return 1;
  int before[BH_POLICY_COUNT] = {0}; /* the baseline window before a run */
  for (size_t f = 0; f < o.n_factors; f++) {
    runs *r = f == 0 ? base : cur;
    size_t nreq = f0.t.n_reqs;
    uint32_t nw = f0.so.cl.workers;
    double pair[REPEAT_MIN];
    int npair = 0;
    if (f > 0) {
      factor fk;
      memset(cur, 0, sizeof cur);
      if (factor_load(&o, o.factor[f], &fk) < 0)
        return 1;
      for (int k = 0; k < least; k++) {
        int from[BH_POLICY_COUNT], mid[BH_POLICY_COUNT], end[BH_POLICY_COUNT];
        for (size_t p = 0; p < o.n_policies; p++)
          from[p] = cur[p].n;
        if (factor_run(&o, &fk, 1, cur) < 0)
          return 1;
        for (size_t p = 0; p < o.n_policies; p++)
          end[p] = cur[p].n, mid[p] = base[p].n;
        if (factor_run(&o, &f0, least, base) < 0) /* the baseline, after */
          return 1;
        double b = runs_span(&o, base, before, NULL);
        double c = runs_span(&o, cur, from, end);
        pair[npair++] = c > 0 ? b / c : 0;
        memcpy(before, mid, sizeof before);
      }
      nreq = fk.t.n_reqs, nw = fk.so.cl.workers;
      bh_trace_free(&fk.t);
    }
    printf("%6ux %9zu %7u", o.factor[f], nreq, nw);
    for (size_t p = 0; p < o.n_policies; p++) {
      pr[f][p] = runs_median(&r[p]);
      work[f][p] = r[p].work;
      printf(" %13.0f", pr[f][p].rps);
    }
    double all = runs_span(&o, r, NULL, NULL);
    double base_all = runs_span(&o, base, NULL, NULL);
    double slow_all = all > 0 ? base_all / all : 0, slow = 1;
    double sorted[REPEAT_MIN];
    if (npair > 0) { /* pair[] stays in run order, for the line's end */
      memcpy(sorted, pair, (size_t)npair * sizeof sorted[0]);
      qsort(sorted, (size_t)npair, sizeof sorted[0], cmp_double);
      slow = npair % 2 ? sorted[npair / 2]
                       : (sorted[npair / 2 - 1] + sorted[npair / 2]) / 2;
    }
    printf(" %12.0f %8.2fx %8.2fx  (per policy:", all, slow_all, slow);
    for (size_t p = 0; p < o.n_policies; p++) {
      prun b = runs_median(&base[p]);
      printf(" %.2fx", pr[f][p].rps > 0 ? b.rps / pr[f][p].rps : 0);
    }
    printf(")");
    for (int k = 0; k < npair; k++)
      printf("%s%.2f", k ? " " : "  paired runs: ", pair[k]);
    printf("\n");
    fflush(stdout);
    if (slow > worst)
      worst = slow;
    if (slow_all > worst_all)
      worst_all = slow_all;
  }
  printf("(the %ux baseline, measured before and after each run of a "
         "larger factor: %d runs per policy; medians",
         o.factor[0], base[0].n);
  for (size_t p = 0; p < o.n_policies; p++) { /* the baseline, all its runs */
    pr[0][p] = runs_median(&base[p]);
    printf(" %.0f", pr[0][p].rps);
  }
  printf(" req/s)\n");
  bh_trace_free(&f0.t);
  print_work(&o, work, pr);
  printf("largest slowdown against %ux: %.2fx paired (%.2fx over all "
         "runs)\n", o.factor[0], worst, worst_all);
  if (o.check > 0 && worst > o.check) {
    printf("FAIL: more than %.2fx\n", o.check);
    return 1;
  }
  return 0;
}
