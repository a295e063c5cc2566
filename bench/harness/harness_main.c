/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-bench: replay request traces through the production kvplane
 * router / index / ledger on a simulated cluster and compare policies.
 *   kvplane-bench run [options] TRACE...      (the default command)
 *   kvplane-bench convert [options] IN OUT    (to kvplane's JSONL format)
 *   kvplane-bench gen [options] OUT           (synthetic agentic trace)
 *   kvplane-bench sweep [options] TRACE       (one or two parameters)
 *   kvplane-bench engine [options]            (emulated vLLM workers)
 *   kvplane-bench live [options] TRACE...     (the trace over HTTP) */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <zstd.h>

#include "harness.h"
#include "harness_live.h"
#include "kvplane/config.h"

typedef struct cli {
  bh_cluster cl;
  kvp_router_opts router;
  int policies[BH_POLICY_COUNT];
  size_t n_policies;
  bh_format format;
  bh_read_opts ro;
  double speed, drop, delay;
  uint32_t closed_loop;
  double auto_util; /* --workers auto[:U]: target utilisation; 0 = off */
  bool workers_given; /* --workers N on the command line */
  uint64_t seed;
  const char *out_dir;
  bool quiet, progress, wide;
  uint32_t jobs; /* --jobs: simulations at once; 0 = auto */
  /* sweep */
  const char *param[2];
  double ttft_p95_max;
} cli;

static void usage(FILE *f) {
  fputs(
      "usage: kvplane-bench [run] [options] TRACE...\n"
      "       kvplane-bench convert [--format F] IN OUT[.zst]\n"
      "       kvplane-bench engine [--workers N] [--time-scale X] ...  (emulated\n"
      "                         vLLM workers; engine --help, docs/live.md)\n"
      "       kvplane-bench live --target URL [--direct] ... TRACE...  (the trace\n"
      "                         as HTTP traffic; live --help)\n"
      "       kvplane-bench gen [--seed N] [--sessions N] [--tenants N] "
      "[--turns N]\n"
      "                         [--drift P] [--subagents P] OUT|-\n"
      "       kvplane-bench sweep --param NAME=V1,V2,.. [--param NAME=..] "
      "[--ttft-p95-max S] TRACE\n"
      "TRACE: a file or a directory of *.json[l][.zst] (zstd read "
      "transparently)\n"
      "gen: a synthetic agentic trace: --sessions (default 64), --tenants (4),\n"
      "     --turns (mean turns per session, 20), --drift P (prompt drift, "
      "0),\n"
      "     --subagents P (chance a turn fans out sub-agents, 0.05); counts "
      "and P > 0\n"
      "options:\n"
      "  --config FILE        YAML: cluster, replay (kvplane-bench's); model, "
      "gpu,\n"
      "                       routing (the router's); tiers (kvtier's) "
      "(bench/configs/default.yaml)\n"
      "  --format F           auto|mooncake|agentic|bailian|kvplane "
      "(default auto)\n"
      "  --policies LIST      comma-separated; default: all seven + random + "
      "infinite\n"
      "  --workers N --hbm-gb X --dram-gb X --nvme-gb X   cluster (per "
      "worker)\n"
      "  --workers auto[:U]   size the cluster to the trace's offered prefill "
      "load at\n"
      "                       utilisation U (default 0.7; docs/harness.md)\n"
      "  --prefill N --decode M   P/D: N prefill + M decode workers (the\n"
      "                       workers: N + M), as `engine --prefill N --decode M`;\n"
      "                       the decode leg pulls the KV it lacks over a link of\n"
      "  --link-gbps X        GB/s (default 25) and --link-latency-us X a pull\n"
      "                       (default 50); config: pd.prefill, pd.decode,\n"
      "                       pd.link_gbps, pd.link_latency_us (docs/harness.md)\n"
      "  --tier-policy P      DRAM and NVMe placement: lru|s3fifo (kvtier's "
      "policies;\n"
      "                       default lru); --hbm-policy, --dram-policy, "
      "--nvme-policy: one tier\n"
      "  --no-tier-classes    stability-blind placement (every block "
      "volatile)\n"
      "  --nvme-admission M   blocks demoted into NVMe: all | hits (class +\n"
      "                       reuse rule) | gate (kvtier's cost gate); "
      "--admit-write-weight X.\n"
      "                       Default all: the simulator's behaviour before "
      "the gate, kept so\n"
      "                       results stay comparable; a kvtier store "
      "defaults to gate\n"
      "  --speed X            arrivals at trace time / X (default 1)\n"
      "  --closed-loop N      ignore timestamps, keep N requests in flight\n"
      "  --drop-events P      lose each KV event with probability P\n"
      "  --delay-events S     deliver KV events S seconds late\n"
      "  --seed N             routing/drop randomness (default 1)\n"
      "  --on-error skip|stop malformed records (default skip)\n"
      "  --no-shared-prefix   agentic: keep system+tools blocks per session\n"
      "  --limit N            read at most N requests per trace\n"
      "  --out DIR            report.html, results.csv, results.json "
      "(default kvplane-bench-report)\n"
      "  --jobs N|auto        simulations run at once, one thread each (default\n"
      "                       auto: the CPUs, at most the runs, and as many as\n"
      "                       MemAvailable holds; env KVP_BENCH_JOBS sets the default)\n"
      "  --quiet              no table; --no-progress: no progress bar\n"
      "  --wide               every column in the table (default: a compact "
      "one)\n",
      f);
}

static int die_usage(const char *msg, const char *arg) {
  fprintf(stderr, "kvplane-bench: %s%s%s\n", msg, arg ? ": " : "",
          arg ? arg : "");
  usage(stderr);
  return 2;
}

static bool parse_double(const char *s, double lo, double hi, double *out) {
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || end == s || *end || !isfinite(v) || v < lo || v > hi)
    return false;
  *out = v;
  return true;
}

static bool parse_u64(const char *s, uint64_t hi, uint64_t *out) {
  char *end;
  errno = 0;
  if (*s == '-')
    return false;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || end == s || *end || v > hi)
    return false;
  *out = v;
  return true;
}

#define POLICY_NAMES                                                           \
  "round_robin, least_loaded, prefix_greedy, sglang_cache_aware, "             \
  "llmd_weighted, dynamo_cost, kvplane_cost, random, infinite"

/* A comma-separated list of policies; `where` prefixes messages ("--policies"
 * or "file:line: routing.policies"). */
static int set_policies(cli *c, const char *list, const char *where) {
  char buf[1024];
  int p[BH_POLICY_COUNT];
  size_t n = 0;
  snprintf(buf, sizeof buf, "%s", list);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
       tok = strtok_r(NULL, ",", &save)) {
    if (bh_policy_parse(tok, &p[n]) < 0 || n == BH_POLICY_COUNT) {
      fprintf(stderr, "kvplane-bench: %s: %s policy '%s' (" POLICY_NAMES ")\n",
              where, n == BH_POLICY_COUNT ? "too many, at" : "unknown", tok);
      return KVP_EINVAL;
    }
    n++;
  }
  if (n == 0) {
    fprintf(stderr, "kvplane-bench: %s: no policy named in '%s' (one or more "
                    "of " POLICY_NAMES ")\n", where, list);
    return KVP_EINVAL;
  }
  memcpy(c->policies, p, n * sizeof *p);
  c->n_policies = n;
  return 0;
}

static void cli_defaults(cli *c) {
  memset(c, 0, sizeof *c);
  bh_cluster_defaults(&c->cl);
  static const int order[] = {KVP_POLICY_ROUND_ROBIN,   KVP_POLICY_LEAST_LOADED,
                              KVP_POLICY_PREFIX_GREEDY, KVP_POLICY_SGLANG,
                              KVP_POLICY_LLMD,          KVP_POLICY_DYNAMO,
                              KVP_POLICY_KVPLANE_COST,  BH_POLICY_RANDOM,
                              BH_POLICY_INFINITE};
  memcpy(c->policies, order, sizeof order);
  c->n_policies = sizeof order / sizeof *order;
  c->seed = 1;
  c->speed = 1;
  c->out_dir = "kvplane-bench-report";
  c->progress = isatty(2);
  const char *j = getenv("KVP_BENCH_JOBS");
  uint64_t u;
  if (j != NULL && strcmp(j, "auto") != 0) {
    if (parse_u64(j, 1024, &u) && u > 0)
      c->jobs = (uint32_t)u;
    else
      fprintf(stderr, "kvplane-bench: KVP_BENCH_JOBS=%s: not 1..1024 or auto; "
                      "using auto\n", j);
  }
}

/* "lru" | "s3fifo" into tier_policy[from..to]. */
static int set_tier_policy(cli *c, const char *v, int from, int to) {
  kvp_tier_policy_kind k;
  if (kvp_tier_policy_parse(v, &k) < 0)
    return KVP_EINVAL;
  for (int t = from; t <= to; t++)
    c->cl.tier_policy[t] = k;
  return 0;
}

/* cluster.<tier>_policy: "file:line: ..." for a bad name. */
static int cfg_tier_policy(cli *c, kvp_config *cfg, const char *key,
                           const char *v, int tier) {
  if (v[0] == '\0' || set_tier_policy(c, v, tier, tier) == 0)
    return 0;
  const char *name = "";
  int line = kvp_config_key_line(cfg, "cluster", key, &name);
  fprintf(stderr, "kvplane-bench: %s:%d: cluster.%s: expected lru or s3fifo, "
                  "got '%.64s'\n",
          name, line, key, v);
  return KVP_EINVAL;
}

/* ---- the YAML config: sections bound to the option structs ------------------
 * kvplane-bench binds only its own sections, `cluster:` (the simulated
 * workers) and `replay:`; the router binds `model:`, `gpu:` and `routing:`
 * (kvp_router_opts_from_config), kvtier `tiers:`. */
typedef struct cluster_keys {
  uint64_t workers;
  char pol[3][16], adm[16];
  bool classes;
} cluster_keys;

static int bind_cluster(cli *c, kvp_config *cfg, cluster_keys *k, char *err,
                        size_t cap) {
  const kvp_config_field f[] = {
      KVP_CFG_U64("workers", &k->workers, 1, 4096),
      KVP_CFG_F64("hbm_gb", &c->cl.hbm_gb, 0.001, 1e6),
      KVP_CFG_F64("dram_gb", &c->cl.dram_gb, 0, 1e7),
      KVP_CFG_F64("nvme_gb", &c->cl.nvme_gb, 0, 1e8),
      KVP_CFG_F64("decode_step_overhead_s", &c->cl.decode_base_s, 0, 10),
      KVP_CFG_F64("prefill_overhead_s", &c->cl.prefill_base_s, 0, 10),
      KVP_CFG_F64("cached_token_s", &c->cl.cached_token_s, 0, 1),
      KVP_CFG_F64("max_batch", &c->cl.max_batch, 1, 1e6),
      KVP_CFG_STR("hbm_policy", k->pol[0], sizeof k->pol[0]),
      KVP_CFG_STR("dram_policy", k->pol[1], sizeof k->pol[1]),
      KVP_CFG_STR("nvme_policy", k->pol[2], sizeof k->pol[2]),
      KVP_CFG_BOOL("tier_classes", &k->classes),
      KVP_CFG_STR("nvme_admission", k->adm, sizeof k->adm)};
  const kvp_config_section s = {"cluster", f, sizeof f / sizeof *f};
  return kvp_config_bind(cfg, &s, err, cap);
}

/* `pd:` (P/D): the split, and the link under routerd's names and units. */
static int bind_pd(cli *c, kvp_config *cfg, char *err, size_t cap) {
  uint64_t pre = c->cl.pd_prefill, dec = c->cl.pd_decode;
  double lat_s = c->cl.link_latency_us * 1e-6;
  const kvp_config_field f[] = {
      KVP_CFG_U64("prefill", &pre, 1, 4096),
      KVP_CFG_U64("decode", &dec, 1, 4096),
      KVP_CFG_F64("link_gbps", &c->cl.link_gbps, 0.001, 1e6),
      KVP_CFG_DURATION("link_latency_us", &lat_s, 1e-9, 60, 1000000)};
  const kvp_config_section s = {"pd", f, sizeof f / sizeof *f};
  int rc = kvp_config_bind(cfg, &s, err, cap);
  c->cl.pd_prefill = (uint32_t)pre;
  c->cl.pd_decode = (uint32_t)dec;
  c->cl.link_latency_us = lat_s * 1e6;
  return rc;
}

typedef struct replay_keys {
  uint64_t seed, closed;
  char on_error[16], fmt[16];
  bool no_shared;
} replay_keys;

static int bind_replay(cli *c, kvp_config *cfg, replay_keys *k, char *err,
                       size_t cap) {
  const kvp_config_field f[] = {
      KVP_CFG_STR("format", k->fmt, sizeof k->fmt),
      KVP_CFG_F64("speed", &c->speed, 1e-6, 1e9),
      KVP_CFG_U64("closed_loop", &k->closed, 0, 1u << 24),
      KVP_CFG_F64("drop_events", &c->drop, 0, 1),
      KVP_CFG_F64("delay_events_s", &c->delay, 0, 1e6),
      KVP_CFG_U64("seed", &k->seed, 0, UINT64_MAX),
      KVP_CFG_STR("on_error", k->on_error, sizeof k->on_error),
      KVP_CFG_BOOL("no_shared_prefix", &k->no_shared)};
  const kvp_config_section s = {"replay", f, sizeof f / sizeof *f};
  return kvp_config_bind(cfg, &s, err, cap);
}

/* `tiers:` is kvtier's (a real store's options), checked by kvtier's own
 * binding; its policy is the simulated DRAM / NVMe policy unless the cluster
 * section names one, and its admit_* keys tune the simulated gate. */
static int bind_tiers(cli *c, kvp_config *cfg, char *err, size_t cap) {
  kvp_tier_opts to = {0};
  char dir[1024];
  int rc = kvp_tier_opts_from_config(cfg, &to, dir, sizeof dir, err, cap);
  if (rc < 0)
    return rc;
  if (kvp_config_key_line(cfg, "tiers", "policy", NULL) > 0)
    for (int t = KVP_TIER_DRAM; t <= KVP_TIER_NVME; t++)
      c->cl.tier_policy[t] = to.policy;
  c->cl.nvme_admit.write_weight = to.admit_write_weight;
  c->cl.nvme_admit.min_samples = to.admit_min_samples;
  c->cl.nvme_admit.volatile_min_hits = to.volatile_nvme_min_hits;
  c->cl.nvme_write_bw = to.nvme_write_bytes_per_s;
  return rc;
}

/* The cluster keys that need a check beyond their type. */
static int apply_cluster(cli *c, kvp_config *cfg, const cluster_keys *k,
                         char *err, size_t cap) {
  if (k->adm[0] != '\0') {
    if (kvp_tier_admission_parse(k->adm, &c->cl.nvme_admit.mode) < 0) {
      const char *name = "";
      int line = kvp_config_key_line(cfg, "cluster", "nvme_admission", &name);
      snprintf(err, cap, "%s:%d: cluster.nvme_admission: expected all, hits "
               "or gate, got '%.32s'", name, line, k->adm);
      return KVP_EINVAL;
    }
    c->cl.nvme_admit_on = true;
  }
  static const char *const keys[] = {"hbm_policy", "dram_policy",
                                     "nvme_policy"};
  for (int t = 0; t < 3; t++)
    if (cfg_tier_policy(c, cfg, keys[t], k->pol[t], t) < 0)
      return KVP_EINVAL; /* printed */
  c->cl.tier_no_classes = !k->classes;
  c->cl.workers = (uint32_t)k->workers;
  return 0;
}

/* The router's model / GPU spec feeds the simulated cluster: the same
 * numbers a router daemon would read from this file. */
static int apply_router(cli *c, kvp_config *cfg, const char *policies) {
  bh_cluster_from_router(&c->cl, &c->router);
  if (policies[0] == '\0')
    return 0;
  char where[512];
  const char *name = "";
  int line = kvp_config_key_line(cfg, "routing", "policies", &name);
  snprintf(where, sizeof where, "%s:%d: routing.policies", name, line);
  return set_policies(c, policies, where);
}

static int apply_replay(cli *c, const char *path, const replay_keys *k) {
  c->closed_loop = (uint32_t)k->closed;
  c->seed = k->seed;
  c->ro.no_shared_prefix = k->no_shared;
  if (k->fmt[0] && bh_format_parse(k->fmt, &c->format) < 0) {
    fprintf(stderr, "kvplane-bench: %s: replay.format: unknown '%s'\n", path,
            k->fmt);
    return KVP_EINVAL;
  }
  if (k->on_error[0]) {
    if (strcmp(k->on_error, "skip") && strcmp(k->on_error, "stop")) {
      fprintf(stderr, "kvplane-bench: %s: replay.on_error: skip or stop\n",
              path);
      return KVP_EINVAL;
    }
    c->ro.on_error = k->on_error[1] == 't' ? BH_ERR_STOP : BH_ERR_SKIP;
  }
  return 0;
}

static int load_config(cli *c, const char *path) {
  kvp_config *cfg;
  char err[512] = "", policies[1024] = "";
  int rc = kvp_config_load_file(path, NULL, &cfg, err, sizeof err);
  if (rc < 0) {
    fprintf(stderr, "kvplane-bench: %s\n", err);
    return rc;
  }
  cluster_keys ck = {.workers = c->cl.workers, .classes = !c->cl.tier_no_classes};
  replay_keys rk = {.seed = c->seed, .closed = c->closed_loop,
                    .no_shared = c->ro.no_shared_prefix};
  if ((rc = bind_cluster(c, cfg, &ck, err, sizeof err)) >= 0 &&
      (rc = kvp_router_opts_from_config(cfg, &c->router, policies,
                                        sizeof policies, err,
                                        sizeof err)) >= 0 &&
      (rc = bind_replay(c, cfg, &rk, err, sizeof err)) >= 0 &&
      (rc = bind_tiers(c, cfg, err, sizeof err)) >= 0 &&
      (rc = bind_pd(c, cfg, err, sizeof err)) >= 0 &&
      (rc = apply_cluster(c, cfg, &ck, err, sizeof err)) >= 0)
    rc = kvp_config_check_unbound(cfg, NULL, 0, err, sizeof err);
  if (rc >= 0)
    rc = apply_router(c, cfg, policies);
  else if (err[0] != '\0')
    fprintf(stderr, "kvplane-bench: %s\n", err);
  kvp_config_destroy(cfg);
  return rc < 0 ? rc : apply_replay(c, path, &rk);
}

/* --workers N | auto | auto:U. */
static bool parse_workers(cli *c, const char *v) {
  uint64_t u;
  if (strncmp(v, "auto", 4) == 0) {
    c->auto_util = 0.7;
    return v[4] == '\0' ||
           (v[4] == ':' && parse_double(v + 5, 1e-3, 1, &c->auto_util));
  }
  if (!parse_u64(v, 4096, &u) || u == 0)
    return false;
  c->cl.workers = (uint32_t)u;
  c->auto_util = 0;
  c->workers_given = true;
  return true;
}

/* P/D after every option: both counts or neither, the workers their sum;
 * the infinite bound is left out (one shared cache moves no KV).  2 on a
 * conflict (printed). */
static int pd_finish(cli *c) {
  bh_cluster *cl = &c->cl;
  if (cl->pd_prefill == 0 && cl->pd_decode == 0)
    return 0;
  if (cl->pd_prefill == 0 || cl->pd_decode == 0)
    return die_usage("--prefill and --decode go together (P/D needs both "
                     "roles)", NULL);
  uint32_t sum = cl->pd_prefill + cl->pd_decode;
  if (sum > 4096)
    return die_usage("P/D: --prefill + --decode: at most 4096 workers", NULL);
  if (c->auto_util > 0)
    return die_usage("--workers auto does not size a P/D cluster: give "
                     "--prefill N --decode M", NULL);
  if (c->workers_given && cl->workers != sum) {
    fprintf(stderr, "kvplane-bench: --workers %u but --prefill %u + --decode "
                    "%u = %u: leave --workers out with P/D\n", cl->workers,
            cl->pd_prefill, cl->pd_decode, sum);
    return 2;
  }
  cl->workers = sum;
  size_t n = 0;
  for (size_t p = 0; p < c->n_policies; p++)
    if (c->policies[p] != BH_POLICY_INFINITE)
      c->policies[n++] = c->policies[p];
  if (n < c->n_policies && !c->quiet)
    fprintf(stderr, "kvplane-bench: P/D: the infinite bound is not modelled; "
                    "left out\n");
  if (n == 0)
    return die_usage("P/D: no policy left to run (infinite is not modelled)",
                     NULL);
  c->n_policies = n;
  return 0;
}

/* Parses options; positional arguments are collected into pos. */
static int parse_opts(cli *c, int argc, char **argv, const char **pos,
                      int *n_pos) {
  *n_pos = 0;
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    double d;
    uint64_t u;
#define NEED()                                                                 \
  do {                                                                         \
    if (v == NULL)                                                             \
      return die_usage("missing value for", a);                                \
    i++;                                                                       \
  } while (0)
    if (a[0] != '-' || strcmp(a, "-") == 0) {
      pos[(*n_pos)++] = a;
    } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      exit(0);
    } else if (!strcmp(a, "--config")) {
      NEED();
      if (load_config(c, v) < 0)
        return 2;
    } else if (!strcmp(a, "--format")) {
      NEED();
      if (bh_format_parse(v, &c->format) < 0)
        return die_usage("unknown format", v);
    } else if (!strcmp(a, "--policies")) {
      NEED();
      if (set_policies(c, v, "--policies") < 0)
        return 2;
    } else if (!strcmp(a, "--workers")) {
      NEED();
      if (!parse_workers(c, v))
        return die_usage("--workers: 1..4096, auto or auto:U (0 < U <= 1)",
                         v);
    } else if (!strcmp(a, "--hbm-gb") || !strcmp(a, "--dram-gb") ||
               !strcmp(a, "--nvme-gb")) {
      NEED();
      if (!parse_double(v, a[2] == 'h' ? 0.001 : 0, 1e8, &d))
        return die_usage("bad size (GB)", v);
      *(a[2] == 'h' ? &c->cl.hbm_gb : a[2] == 'd' ? &c->cl.dram_gb
                                                  : &c->cl.nvme_gb) = d;
    } else if (!strcmp(a, "--prefill") || !strcmp(a, "--decode")) {
      NEED();
      if (!parse_u64(v, 4096, &u) || u == 0)
        return die_usage(a[2] == 'p' ? "--prefill: prefill workers, 1..4096"
                                     : "--decode: decode workers, 1..4096",
                         v);
      *(a[2] == 'p' ? &c->cl.pd_prefill : &c->cl.pd_decode) = (uint32_t)u;
    } else if (!strcmp(a, "--link-gbps")) {
      NEED();
      if (!parse_double(v, 0.001, 1e6, &c->cl.link_gbps))
        return die_usage("--link-gbps: GB/s, 0.001..1e6", v);
    } else if (!strcmp(a, "--link-latency-us")) {
      NEED();
      if (!parse_double(v, 0.001, 6e7, &c->cl.link_latency_us))
        return die_usage("--link-latency-us: microseconds, 0.001..6e7", v);
    } else if (!strcmp(a, "--tier-policy") || !strcmp(a, "--hbm-policy") ||
               !strcmp(a, "--dram-policy") || !strcmp(a, "--nvme-policy")) {
      NEED();
      int t = a[2] == 'h' ? 0 : a[2] == 'd' ? 1 : 2, t1 = a[2] == 't' ? 1 : t;
      if (set_tier_policy(c, v, t1, t) < 0)
        return die_usage("expected lru or s3fifo", v);
    } else if (!strcmp(a, "--no-tier-classes")) {
      c->cl.tier_no_classes = true;
    } else if (!strcmp(a, "--nvme-admission")) {
      NEED();
      if (kvp_tier_admission_parse(v, &c->cl.nvme_admit.mode) < 0)
        return die_usage("--nvme-admission: all, hits or gate", v);
      c->cl.nvme_admit_on = true;
    } else if (!strcmp(a, "--admit-write-weight")) {
      NEED();
      if (!parse_double(v, 0.001, 1000, &c->cl.nvme_admit.write_weight))
        return die_usage("--admit-write-weight: 0.001..1000", v);
    } else if (!strcmp(a, "--speed")) {
      NEED();
      if (!parse_double(v, 1e-6, 1e9, &c->speed))
        return die_usage("--speed: a positive number", v);
    } else if (!strcmp(a, "--closed-loop")) {
      NEED();
      if (!parse_u64(v, 1u << 24, &u))
        return die_usage("--closed-loop: a count", v);
      c->closed_loop = (uint32_t)u;
    } else if (!strcmp(a, "--drop-events")) {
      NEED();
      if (!parse_double(v, 0, 1, &c->drop))
        return die_usage("--drop-events: a probability in [0,1]", v);
    } else if (!strcmp(a, "--delay-events")) {
      NEED();
      if (!parse_double(v, 0, 1e6, &c->delay))
        return die_usage("--delay-events: seconds >= 0", v);
    } else if (!strcmp(a, "--seed")) {
      NEED();
      if (!parse_u64(v, UINT64_MAX, &c->seed))
        return die_usage("--seed: an unsigned integer", v);
    } else if (!strcmp(a, "--on-error")) {
      NEED();
      if (strcmp(v, "skip") && strcmp(v, "stop"))
        return die_usage("--on-error: skip or stop", v);
      c->ro.on_error = v[1] == 't' ? BH_ERR_STOP : BH_ERR_SKIP;
    } else if (!strcmp(a, "--no-shared-prefix")) {
      c->ro.no_shared_prefix = true;
    } else if (!strcmp(a, "--limit")) {
      NEED();
      if (!parse_u64(v, UINT64_MAX, &c->ro.max_requests))
        return die_usage("--limit: a count", v);
    } else if (!strcmp(a, "--out")) {
      NEED();
      c->out_dir = v;
    } else if (!strcmp(a, "--quiet")) {
      c->quiet = true;
    } else if (!strcmp(a, "--wide")) {
      c->wide = true;
    } else if (!strcmp(a, "--no-progress")) {
      c->progress = false;
    } else if (!strcmp(a, "--jobs")) {
      NEED();
      if (!strcmp(v, "auto"))
        c->jobs = 0;
      else if (!parse_u64(v, 1024, &u) || u == 0)
        return die_usage("--jobs: 1..1024 or auto", v);
      else
        c->jobs = (uint32_t)u;
    } else if (!strcmp(a, "--param")) {
      NEED();
      if (c->param[1] != NULL)
        return die_usage("at most two --param", v);
      c->param[c->param[0] != NULL] = v;
    } else if (!strcmp(a, "--ttft-p95-max")) {
      NEED();
      if (!parse_double(v, 0, 1e6, &c->ttft_p95_max))
        return die_usage("--ttft-p95-max: seconds", v);
    } else {
      return die_usage("unknown option", a);
    }
#undef NEED
  }
  return 0;
}

static const char *base_label(const char *path, char *buf, size_t cap) {
  size_t l = strlen(path);
  while (l > 1 && path[l - 1] == '/')
    l--;
  const char *b = path;
  for (size_t i = 0; i < l; i++)
    if (path[i] == '/')
      b = path + i + 1;
  size_t n = (size_t)(path + l - b);
  snprintf(buf, cap, "%.*s", (int)n, b);
  char *dot = strchr(buf, '.');
  if (dot && dot != buf)
    *dot = '\0';
  return buf;
}

static int load_trace(const cli *c, const char *path, bh_trace *t) {
  char err[512];
  bh_trace_init(t);
  bh_read_opts ro = c->ro;
  ro.quiet = false;
  uint64_t t0 = kvp_now_ns();
  int rc = bh_read_path(path, c->format, &ro, t, err, sizeof err);
  if (rc < 0) {
    fprintf(stderr, "kvplane-bench: %s\n", err);
    return rc;
  }
  if (t->n_reqs == 0) {
    fprintf(stderr, "kvplane-bench: %s: no valid requests\n", path);
    return KVP_EINVAL;
  }
  if (c->router.block_size != 0 && t->block_size != c->router.block_size) {
    fprintf(stderr, "kvplane-bench: %s: blocks of %u tokens, but the config's "
                    "model.block_size is %u\n",
            path, t->block_size, c->router.block_size);
    return KVP_EINVAL;
  }
  if ((rc = bh_trace_finish(t)) < 0) {
    fprintf(stderr, "kvplane-bench: %s: classifying: %s\n", path,
            kvp_strerror(rc));
    return rc;
  }
  snprintf(t->label, sizeof t->label, "%s", path);
  uint64_t blocks = 0; /* the prompts' (t->n_keys: the distinct runs stored) */
  for (size_t i = 0; i < t->n_reqs; i++)
    blocks += t->reqs[i].n_blocks;
  if (!c->quiet)
    fprintf(stderr,
            "kvplane-bench: read %s: %zu requests (%llu malformed skipped), "
            "%llu blocks of %u tokens in %.2f s\n",
            path, t->n_reqs, (unsigned long long)t->records_bad,
            (unsigned long long)blocks, t->block_size,
            (double)(kvp_now_ns() - t0) / 1e9);
  return 0;
}

/* --workers auto: the trace's offered load decides cl->workers. */
static int auto_workers(const cli *c, const char *path, const bh_trace *t,
                        bh_cluster *cl) {
  if (c->auto_util <= 0)
    return 0;
  if (c->closed_loop) {
    fprintf(stderr, "kvplane-bench: --workers auto sizes to arrival times; "
                    "not with --closed-loop\n");
    return KVP_EINVAL;
  }
  bh_load l;
  int rc = bh_load_estimate(t, cl, c->speed, c->auto_util, &l);
  if (rc < 0) {
    fprintf(stderr, "kvplane-bench: %s: offered load: %s\n", path,
            kvp_strerror(rc));
    return rc;
  }
  cl->workers = l.workers;
  if (!c->quiet)
    fprintf(stderr, "kvplane-bench: %s: offered prefill %.0f GPU-s over "
                    "%.0f s, %.2f GPUs busy where the work is (per %.0f s); "
                    "--workers auto at %.0f%%: %u\n",
            path, l.prefill_gpu_s, l.span_s, l.busy, l.window_s,
            100 * c->auto_util, l.workers);
  return 0;
}

static bh_sim_opts sim_opts(const cli *c, int policy) {
  bh_sim_opts o = {.cl = c->cl,
                   .policy = policy,
                   .router = c->router,
                   .speed = c->speed,
                   .closed_loop = c->closed_loop,
                   .drop_events = c->drop,
                   .delay_events_s = c->delay,
                   .seed = c->seed,
                   .progress = c->progress};
  return o;
}

/* ---- several simulations at once ---------------------------------------------
 * Each run is independent (its own router, index, ledger and caches over the
 * read-only trace) and deterministic, so runs on threads give the results
 * the same runs give one after another; only their wall-clock rates feel
 * the neighbours.  One bar on stderr counts the requests of all of them. */
typedef struct sim_task {
  const bh_trace *t;
  bh_sim_opts o;
  bh_result *res;
  int rc;
  char err[512];
  _Atomic uint64_t at; /* requests simulated so far */
} sim_task;

typedef struct sim_pool {
  sim_task *tk;
  size_t n, done;
  _Atomic size_t next;
  pthread_mutex_t mu;
  pthread_cond_t cv;
} sim_pool;

static void *sim_thread(void *arg) {
  sim_pool *p = arg;
  for (size_t i; (i = atomic_fetch_add(&p->next, 1)) < p->n;) {
    sim_task *k = &p->tk[i];
    k->rc = bh_sim_run(k->t, &k->o, k->res, k->err, sizeof k->err);
    pthread_mutex_lock(&p->mu);
    p->done++;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
  }
  return NULL;
}

/* bytes of memory the kernel says it can give without swapping, or 0 */
static uint64_t mem_available(void) {
  FILE *f = fopen("/proc/meminfo", "r");
  char line[128];
  unsigned long long kb = 0;
  while (f != NULL && fgets(line, sizeof line, f) != NULL)
    if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1)
      break;
  if (f != NULL)
    fclose(f);
  return (uint64_t)kb << 10;
}

/* A run's peak memory, roughly: ~300 bytes per block of simulated capacity
 * (the per-worker tables and policy lists, the index; measured: 3.8 GB for
 * 165 workers of 81 K blocks at 20x the agentic set). */
static uint64_t sim_bytes(const bh_sim_opts *o, uint32_t block_size) {
  bh_cluster cl = o->cl;
  if (bh_cluster_resolve(&cl, block_size) < 0)
    return 0;
  return (uint64_t)cl.workers * (cl.hbm_blocks + cl.dram_blocks + cl.nvme_blocks) * 300;
}

static unsigned jobs_for(const cli *c, const sim_task *tk, size_t n) {
  long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  uint64_t j = c->jobs ? c->jobs : (uint64_t)(cpus > 0 ? cpus : 1);
  if (j > n)
    j = n;
  if (c->jobs == 0 && j > 1) { /* auto: no more than memory holds */
    uint64_t need = 0, avail = mem_available();
    for (size_t i = 0; i < n; i++) {
      uint64_t b = sim_bytes(&tk[i].o, tk[i].t->block_size);
      need = b > need ? b : need;
    }
    if (need > 0 && avail > 0 && j > (avail / 10 * 7) / need)
      j = (avail / 10 * 7) / need ? (avail / 10 * 7) / need : 1;
  }
  return j ? (unsigned)j : 1;
}

static void pool_bar(const sim_pool *p, unsigned jobs, bool end) {
  uint64_t at = 0, all = 0;
  for (size_t i = 0; i < p->n; i++) {
    at += atomic_load_explicit(&p->tk[i].at, memory_order_relaxed);
    all += p->tk[i].t->n_reqs;
  }
  int pct = end ? 100 : all ? (int)(100.0 * (double)at / (double)all) : 0;
  char bar[41];
  for (int j = 0; j < 40; j++)
    bar[j] = j < pct * 40 / 100 ? '#' : '.';
  bar[40] = '\0';
  fprintf(stderr, "\r  %zu runs, %u at once [%s] %3d%% (%zu done)%s", p->n,
          jobs, bar, pct, p->done, end ? "\n" : "");
}

/* Runs tk[0..n) (their rc and err filled), c->jobs at a time. */
static void run_tasks(const cli *c, sim_task *tk, size_t n) {
  unsigned jobs = jobs_for(c, tk, n);
  sim_pool p = {.tk = tk, .n = n, .mu = PTHREAD_MUTEX_INITIALIZER,
                .cv = PTHREAD_COND_INITIALIZER};
  atomic_init(&p.next, 0);
  for (size_t i = 0; i < n; i++) {
    atomic_init(&tk[i].at, 0);
    if (jobs > 1) { /* one bar for all of them, drawn here */
      tk[i].o.progress = false;
      tk[i].o.progress_at = &tk[i].at;
    }
  }
  pthread_t th[64];
  unsigned started = 0;
  if (jobs > sizeof th / sizeof *th)
    jobs = sizeof th / sizeof *th;
  while (jobs > 1 && started < jobs &&
         pthread_create(&th[started], NULL, sim_thread, &p) == 0)
    started++;
  pthread_mutex_lock(&p.mu);
  while (started > 0 && p.done < n) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 250000000;
    if (ts.tv_nsec >= 1000000000) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&p.cv, &p.mu, &ts);
    if (c->progress)
      pool_bar(&p, started, false);
  }
  pthread_mutex_unlock(&p.mu);
  for (unsigned i = 0; i < started; i++)
    pthread_join(th[i], NULL);
  if (c->progress && started > 0)
    pool_bar(&p, started, true);
  if (started == 0) /* one at a time (or no thread could start) */
    sim_thread(&p);
}

static FILE *open_out(const cli *c, const char *name, char *path, size_t cap) {
  snprintf(path, cap, "%s/%s", c->out_dir, name);
  FILE *f = fopen(path, "w");
  if (f == NULL)
    fprintf(stderr, "kvplane-bench: %s: %s\n", path, strerror(errno));
  return f;
}

static int write_reports(const cli *c, const bh_run *runs, size_t n) {
  char p[4096];
  if (mkdir(c->out_dir, 0777) != 0 && errno != EEXIST) {
    fprintf(stderr, "kvplane-bench: %s: %s\n", c->out_dir, strerror(errno));
    return -errno;
  }
  FILE *f;
  int rc = 0;
  if ((f = open_out(c, "results.csv", p, sizeof p)) == NULL)
    return KVP_EIO;
  rc = bh_report_csv(f, runs, n, true);
  fclose(f);
  if (rc >= 0 && (f = open_out(c, "results.json", p, sizeof p)) != NULL) {
    rc = bh_report_json(f, runs, n);
    fclose(f);
  }
  if (rc >= 0 && (f = open_out(c, "report.html", p, sizeof p)) != NULL) {
    rc = bh_report_html(f, runs, n);
    fclose(f);
  }
  if (rc < 0)
    fprintf(stderr, "kvplane-bench: writing reports: %s\n", kvp_strerror(rc));
  else {
    char *abs = realpath(p, NULL);
    printf("\nHTML report: %s\nCSV: %s/results.csv  JSON: %s/results.json\n",
           abs ? abs : p, c->out_dir, c->out_dir);
    free(abs);
  }
  return rc;
}

static int cmd_run(cli *c, const char **pos, int n_pos) {
  if (n_pos == 0)
    return die_usage("no trace given", NULL);
  bh_batch_memory();
  bh_trace *traces = calloc((size_t)n_pos, sizeof *traces);
  bh_run *runs = calloc((size_t)n_pos, sizeof *runs);
  bh_cluster *cls = calloc((size_t)n_pos, sizeof *cls);
  char (*labels)[128] = calloc((size_t)n_pos, sizeof *labels);
  int rc = traces && runs && cls && labels ? 0 : KVP_ENOMEM;
  int done = 0;
  for (int i = 0; i < n_pos && rc >= 0; i++, done++) {
    if ((rc = load_trace(c, pos[i], &traces[i])) < 0)
      break;
    cls[i] = c->cl;
    if ((rc = auto_workers(c, pos[i], &traces[i], &cls[i])) < 0)
      break;
    bh_cluster_resolve(&cls[i], traces[i].block_size);
    runs[i] = (bh_run){base_label(pos[i], labels[i], sizeof labels[i]),
                       &traces[i], &cls[i],
                       calloc(c->n_policies, sizeof(bh_result)), 0};
    if (runs[i].res == NULL) {
      rc = KVP_ENOMEM;
      break;
    }
    sim_task *tk = calloc(c->n_policies, sizeof *tk);
    if (tk == NULL) {
      rc = KVP_ENOMEM;
      break;
    }
    for (size_t p = 0; p < c->n_policies; p++) {
      tk[p].t = &traces[i];
      tk[p].o = sim_opts(c, c->policies[p]);
      tk[p].o.cl.workers = cls[i].workers; /* --workers auto */
      tk[p].res = &runs[i].res[p];
    }
    run_tasks(c, tk, c->n_policies);
    for (size_t p = 0; p < c->n_policies; p++) { /* in order */
      if (tk[p].rc < 0) {
        fprintf(stderr, "kvplane-bench: %s / %s: %s\n", pos[i],
                bh_policy_name(c->policies[p]), tk[p].err);
        rc = rc < 0 ? rc : tk[p].rc;
      } else if (rc >= 0)
        runs[i].n_res++;
      else /* after a failed one: not reported */
        bh_result_free(&runs[i].res[p]);
    }
    free(tk);
    if (!c->quiet)
      bh_report_table_opts(stdout, &runs[i], c->wide ? BH_TABLE_WIDE : 0);
    fflush(stdout);
  }
  if (rc >= 0)
    rc = write_reports(c, runs, (size_t)n_pos);
  for (int i = 0; i < done + (done < n_pos); i++) {
    if (runs == NULL)
      break;
    for (size_t p = 0; runs[i].res && p < runs[i].n_res; p++)
      bh_result_free(&runs[i].res[p]);
    free(runs[i].res);
    bh_trace_free(&traces[i]);
  }
  free(traces);
  free(runs);
  free(cls);
  free(labels);
  return rc < 0 ? 1 : 0;
}

/* ---- convert ------------------------------------------------------------------- */
static int write_maybe_zstd(const char *path, const bh_trace *t) {
  size_t l = strlen(path);
  bool z = l > 4 && strcmp(path + l - 4, ".zst") == 0;
  FILE *out = fopen(path, "wb");
  if (out == NULL) {
    fprintf(stderr, "kvplane-bench: %s: %s\n", path, strerror(errno));
    return -errno;
  }
  int rc;
  if (!z) {
    rc = bh_trace_write_kvplane(t, out);
  } else {
    char *buf = NULL;
    size_t n = 0;
    FILE *m = open_memstream(&buf, &n);
    rc = m ? bh_trace_write_kvplane(t, m) : KVP_ENOMEM;
    if (m)
      fclose(m);
    if (rc >= 0) {
      size_t bound = ZSTD_compressBound(n);
      void *zb = malloc(bound);
      size_t zn = zb ? ZSTD_compress(zb, bound, buf, n, 9) : 0;
      if (zb == NULL || ZSTD_isError(zn) ||
          fwrite(zb, 1, zn, out) != zn)
        rc = KVP_EIO;
      free(zb);
    }
    free(buf);
  }
  if (fclose(out) != 0 || rc < 0) {
    fprintf(stderr, "kvplane-bench: %s: write failed\n", path);
    return rc < 0 ? rc : KVP_EIO;
  }
  return 0;
}

static int cmd_convert(cli *c, const char **pos, int n_pos) {
  if (n_pos != 2)
    return die_usage("convert needs IN and OUT", NULL);
  bh_trace t;
  c->quiet = false;
  int rc = load_trace(c, pos[0], &t);
  if (rc >= 0)
    rc = write_maybe_zstd(pos[1], &t);
  if (rc >= 0)
    fprintf(stderr, "kvplane-bench: wrote %s (%zu requests, kvplane format)\n",
            pos[1], t.n_reqs);
  bh_trace_free(&t);
  return rc < 0 ? 1 : 0;
}

/* ---- gen ------------------------------------------------------------------------ */
/* One gen option; false with the message printed.  Counts and the sub-agent
 * probability refuse 0, which bh_gen would silently read as its default. */
static bool gen_opt(bh_gen_opts *o, const char *a, const char *v) {
  uint64_t u;
  double d;
  const char *why = NULL;
  if (!strcmp(a, "--seed") && parse_u64(v, UINT64_MAX, &u))
    o->seed = u;
  else if (!strcmp(a, "--sessions") && parse_u64(v, 1u << 20, &u) && u > 0)
    o->sessions = (uint32_t)u;
  else if (!strcmp(a, "--tenants") && parse_u64(v, 1u << 16, &u) && u > 0)
    o->tenants = (uint32_t)u;
  else if (!strcmp(a, "--turns") && parse_u64(v, 1u << 16, &u) && u > 0)
    o->turns = (uint32_t)u;
  else if (!strcmp(a, "--drift") && parse_double(v, 0, 1, &d))
    o->drift = d;
  else if (!strcmp(a, "--subagents") && parse_double(v, 1e-9, 1, &d))
    o->subagent_p = d;
  else if (!strcmp(a, "--sessions"))
    why = "a count in 1..1048576";
  else if (!strcmp(a, "--tenants") || !strcmp(a, "--turns"))
    why = "a count in 1..65536";
  else if (!strcmp(a, "--drift"))
    why = "a probability in [0, 1]";
  else if (!strcmp(a, "--subagents"))
    why = "a probability in (0, 1]";
  else if (!strcmp(a, "--seed"))
    why = "an unsigned integer";
  if (why != NULL)
    fprintf(stderr, "kvplane-bench: gen %s: %s, got '%s'\n", a, why, v);
  return why == NULL;
}

static int cmd_gen(int argc, char **argv) {
  bh_gen_opts o = {.seed = 1};
  const char *out = NULL;
  static const char *const known[] = {"--seed", "--sessions", "--tenants",
                                      "--turns", "--drift", "--subagents"};
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (a[0] != '-' || strcmp(a, "-") == 0) {
      out = a;
      continue;
    }
    bool ok = false;
    for (size_t k = 0; k < sizeof known / sizeof *known; k++)
      ok |= strcmp(a, known[k]) == 0;
    if (!ok)
      return die_usage("unknown gen option", a);
    if (v == NULL)
      return die_usage("missing value for", a);
    i++;
    if (!gen_opt(&o, a, v))
      return 2;
  }
  if (out == NULL)
    return die_usage("gen needs OUT", NULL);
  FILE *f = strcmp(out, "-") ? fopen(out, "w") : stdout;
  if (f == NULL) {
    fprintf(stderr, "kvplane-bench: %s: %s\n", out, strerror(errno));
    return 1;
  }
  int rc = bh_gen(&o, f);
  if (f != stdout && fclose(f) != 0)
    rc = KVP_EIO;
  if (rc < 0)
    fprintf(stderr, "kvplane-bench: gen: %s\n", kvp_strerror(rc));
  return rc < 0;
}

/* ---- sweep ---------------------------------------------------------------------- */
typedef struct sweep_param {
  char name[32];
  double v[16];
  int n;
} sweep_param;

static bool is_policy_param(const sweep_param *p) {
  size_t l = strlen(p->name);
  return l > 7 && strcmp(p->name + l - 7, "_policy") == 0;
}

/* A value as the user wrote it: a policy name or a number. */
static const char *param_str(const sweep_param *p, double v, char *buf,
                             size_t cap) {
  if (is_policy_param(p))
    snprintf(buf, cap, "%s", kvp_tier_policy_name((kvp_tier_policy_kind)v));
  else
    snprintf(buf, cap, "%g", v);
  return buf;
}

static int parse_param(const char *s, sweep_param *p) {
  const char *eq = strchr(s, '=');
  static const char *const known[] = {
      "dram_gb",          "hbm_gb",       "nvme_gb",     "workers",
      "guard",            "speed",        "affinity_eps_rel",
      "dynamo_temperature", "llmd_w_prefix", "llmd_w_kv", "llmd_w_queue",
      "tier_policy", "hbm_policy", "dram_policy", "nvme_policy",
      "tier_classes"};
  if (eq == NULL || eq - s >= (long)sizeof p->name)
    return KVP_EINVAL;
  snprintf(p->name, sizeof p->name, "%.*s", (int)(eq - s), s);
  bool ok = false;
  for (size_t i = 0; i < sizeof known / sizeof *known; i++)
    ok |= strcmp(p->name, known[i]) == 0;
  if (!ok) {
    fprintf(stderr, "kvplane-bench: sweep: unknown parameter '%s' (dram_gb, "
                    "hbm_gb, nvme_gb, workers, guard, speed, affinity_eps_rel, "
                    "dynamo_temperature, llmd_w_prefix, llmd_w_kv, "
                    "llmd_w_queue, tier_policy, hbm_policy, dram_policy, "
                    "nvme_policy, tier_classes)\n",
            p->name);
    return KVP_EINVAL;
  }
  char buf[512];
  snprintf(buf, sizeof buf, "%s", eq + 1);
  p->n = 0;
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
       tok = strtok_r(NULL, ",", &save)) {
    kvp_tier_policy_kind k;
    if (p->n == 16)
      return KVP_EINVAL;
    if (is_policy_param(p)) { /* names; the value is the kind */
      if (kvp_tier_policy_parse(tok, &k) < 0)
        return KVP_EINVAL;
      p->v[p->n] = (double)k;
    } else if (!parse_double(tok, 0, 1e9, &p->v[p->n])) {
      return KVP_EINVAL;
    }
    p->n++;
  }
  return p->n ? 0 : KVP_EINVAL;
}

static void apply_param(cli *c, const sweep_param *p, double v) {
  if (!strcmp(p->name, "dram_gb"))
    c->cl.dram_gb = v;
  else if (!strcmp(p->name, "hbm_gb"))
    c->cl.hbm_gb = v;
  else if (!strcmp(p->name, "nvme_gb"))
    c->cl.nvme_gb = v;
  else if (!strcmp(p->name, "workers"))
    c->cl.workers = (uint32_t)v;
  else if (!strcmp(p->name, "guard"))
    c->router.guard = v;
  else if (!strcmp(p->name, "affinity_eps_rel"))
    c->router.affinity_eps_rel = v;
  else if (!strcmp(p->name, "dynamo_temperature"))
    c->router.dynamo_temperature = v;
  else if (!strcmp(p->name, "llmd_w_prefix"))
    c->router.llmd_w_prefix = v;
  else if (!strcmp(p->name, "llmd_w_kv"))
    c->router.llmd_w_kv = v;
  else if (!strcmp(p->name, "llmd_w_queue"))
    c->router.llmd_w_queue = v;
  else if (!strcmp(p->name, "tier_policy"))
    c->cl.tier_policy[KVP_TIER_DRAM] = c->cl.tier_policy[KVP_TIER_NVME] =
        (kvp_tier_policy_kind)v;
  else if (is_policy_param(p))
    c->cl.tier_policy[p->name[0] == 'h'   ? KVP_TIER_HBM
                      : p->name[0] == 'd' ? KVP_TIER_DRAM
                                          : KVP_TIER_NVME] =
        (kvp_tier_policy_kind)v;
  else if (!strcmp(p->name, "tier_classes"))
    c->cl.tier_no_classes = v == 0;
  else
    c->speed = v;
}

static int cmd_sweep(cli *c, const char **pos, int n_pos) {
  sweep_param ps[2] = {0};
  int np = 0;
  if (n_pos != 1 || c->param[0] == NULL)
    return die_usage("sweep needs --param NAME=V1,V2,... and one TRACE", NULL);
  for (; np < 2 && c->param[np]; np++)
    if (parse_param(c->param[np], &ps[np]) < 0)
      return die_usage("bad --param", c->param[np]);
  if (np == 1)
    ps[1] = (sweep_param){"-", {0}, 1};
  bh_batch_memory();
  bh_trace t;
  if (load_trace(c, pos[0], &t) < 0)
    return 1;
  if (auto_workers(c, pos[0], &t, &c->cl) < 0) {
    bh_trace_free(&t);
    return 1;
  }
  int policy = c->n_policies == BH_POLICY_COUNT || c->n_policies == 9
                   ? KVP_POLICY_KVPLANE_COST
                   : c->policies[0];
  printf("\nsweep of %s (%s) on %s; recommendation: most avoided prefill with "
         "TTFT p95 <= %g s\n",
         np == 2 ? "two parameters" : ps[0].name, bh_policy_name(policy),
         pos[0], c->ttft_p95_max > 0 ? c->ttft_p95_max : INFINITY);
  printf("%-12s %-12s %8s %12s %10s %10s\n", ps[0].name,
         np == 2 ? ps[1].name : "", "hit%", "avoided_s", "p95_s", "p99_s");
  double best = -1;
  double bv[2] = {0, 0};
  double av[16][16], p9[16][16];
  int rc = 0;
  /* every setting first (c->jobs at a time), then the table in order */
  size_t nt = (size_t)ps[0].n * (size_t)ps[1].n;
  sim_task *tk = calloc(nt, sizeof *tk);
  bh_result *res = calloc(nt, sizeof *res);
  if (tk == NULL || res == NULL) {
    free(tk);
    free(res);
    bh_trace_free(&t);
    fprintf(stderr, "kvplane-bench: sweep: %s\n", kvp_strerror(KVP_ENOMEM));
    return 1;
  }
  for (int i = 0; i < ps[0].n; i++)
    for (int j = 0; j < ps[1].n; j++) {
      cli cc = *c;
      apply_param(&cc, &ps[0], ps[0].v[i]);
      if (np == 2)
        apply_param(&cc, &ps[1], ps[1].v[j]);
      cc.progress = false;
      sim_task *k = &tk[(size_t)i * (size_t)ps[1].n + (size_t)j];
      k->t = &t;
      k->o = sim_opts(&cc, policy);
      k->res = &res[k - tk];
    }
  run_tasks(c, tk, nt); /* one bar over the settings when they run at once */
  for (size_t k = 0; k < nt; k++)
    if (tk[k].rc < 0 && rc >= 0) {
      fprintf(stderr, "kvplane-bench: sweep: %s\n", tk[k].err);
      rc = tk[k].rc;
    }
  for (int i = 0; i < ps[0].n && rc >= 0; i++)
    for (int j = 0; j < ps[1].n && rc >= 0; j++) {
      bh_result r = res[(size_t)i * (size_t)ps[1].n + (size_t)j];
      double p95 = (double)kvp_hist_quantile(r.ttft_us, 0.95) / 1e6;
      double p99 = (double)kvp_hist_quantile(r.ttft_us, 0.99) / 1e6;
      bool ok = c->ttft_p95_max <= 0 || p95 <= c->ttft_p95_max;
      char v1[32], v2[32] = "";
      if (np == 2)
        param_str(&ps[1], ps[1].v[j], v2, sizeof v2);
      printf("%-12s %-12s %8.2f %12.1f %10.4f %10.4f%s\n",
             param_str(&ps[0], ps[0].v[i], v1, sizeof v1), v2,
             100.0 * (double)r.tot.reused_tokens /
                 (double)(r.tot.prompt_tokens ? r.tot.prompt_tokens : 1),
             r.tot.avoided_gpu_seconds, p95, p99, ok ? "" : "  (over bound)");
      av[j][i] = r.tot.avoided_gpu_seconds;
      p9[j][i] = p95;
      if (ok && r.tot.avoided_gpu_seconds > best) {
        best = r.tot.avoided_gpu_seconds;
        bv[0] = ps[0].v[i];
        bv[1] = ps[1].v[j];
      }
    }
  for (size_t k = 0; k < nt; k++)
    if (tk[k].rc >= 0)
      bh_result_free(&res[k]);
  free(tk);
  free(res);
  if (rc >= 0) {
    char lab[16][48], path[4096], title[256];
    const char *ln[16];
    const double *pa[16], *pp[16];
    for (int j = 0; j < ps[1].n; j++) {
      char vb[32];
      if (np == 2)
        snprintf(lab[j], sizeof lab[j], "%s=%s", ps[1].name,
                 param_str(&ps[1], ps[1].v[j], vb, sizeof vb));
      else
        snprintf(lab[j], sizeof lab[j], "%s", bh_policy_name(policy));
      ln[j] = lab[j];
      pa[j] = av[j];
      pp[j] = p9[j];
    }
    snprintf(title, sizeof title, "Sweep of %s on %s", ps[0].name, pos[0]);
    FILE *f = NULL;
    if (mkdir(c->out_dir, 0777) == 0 || errno == EEXIST)
      f = open_out(c, "sweep.html", path, sizeof path);
    if (f != NULL) {
      rc = bh_report_sweep_html(f, title, ps[0].name, (size_t)ps[1].n, ln,
                                ps[0].v, (uint32_t)ps[0].n, pa, pp,
                                c->ttft_p95_max);
      fclose(f);
      printf("plot: %s\n", path);
    }
    if (best < 0)
      printf("recommendation: none: no setting keeps TTFT p95 under %g s\n",
             c->ttft_p95_max);
    else if (np == 2)
      printf("recommendation: %s=%s %s=%s (avoided %.1f GPU-s)\n",
             ps[0].name, param_str(&ps[0], bv[0], lab[0], sizeof lab[0]),
             ps[1].name, param_str(&ps[1], bv[1], lab[1], sizeof lab[1]),
             best);
    else
      printf("recommendation: %s=%s (avoided %.1f GPU-s)\n", ps[0].name,
             param_str(&ps[0], bv[0], lab[0], sizeof lab[0]), best);
  }
  bh_trace_free(&t);
  return rc < 0;
}

int main(int argc, char **argv) {
  cli c;
  cli_defaults(&c);
  if (argc > 1 && !strcmp(argv[1], "engine"))
    return bh_engine_main(argc - 1, argv + 1);
  if (argc > 1 && !strcmp(argv[1], "live"))
    return bh_live_main(argc - 1, argv + 1);
  const char *cmd = "run";
  int first = 1;
  if (argc > 1 && argv[1][0] != '-' &&
      (!strcmp(argv[1], "run") || !strcmp(argv[1], "convert") ||
       !strcmp(argv[1], "gen") || !strcmp(argv[1], "sweep") ||
       !strcmp(argv[1], "help"))) {
    cmd = argv[1];
    first = 2;
  }
  if (!strcmp(cmd, "help")) {
    usage(stdout);
    return 0;
  }
  if (!strcmp(cmd, "gen"))
    return cmd_gen(argc - first, argv + first);
  const char **pos = calloc((size_t)argc + 1, sizeof *pos);
  int n_pos;
  if (pos == NULL)
    return 1;
  int rc = parse_opts(&c, argc - first, argv + first, pos, &n_pos);
  if (rc == 0 && strcmp(cmd, "convert") != 0)
    rc = pd_finish(&c);
  if (rc == 0) {
    if (!strcmp(cmd, "convert"))
      rc = cmd_convert(&c, pos, n_pos);
    else if (!strcmp(cmd, "sweep"))
      rc = cmd_sweep(&c, pos, n_pos);
    else
      rc = cmd_run(&c, pos, n_pos);
  }
  free(pos);
  return rc;
}
