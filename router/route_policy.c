/* SPDX-License-Identifier: Apache-2.0 */
/* Routing: the TTFT cost model, kvplane's policy (guard, affinity, herd-free
 * ties) and the six peer policies, over a per-worker prefix match array.
 * The receipt's words and JSON live in route_receipt.c. */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core_internal.h"
#include "route_internal.h"

#define MOD "route"

/* ---- policy names -------------------------------------------------------- */
static const char *const policy_names[KVP_POLICY_COUNT_] = {
    "kvplane_cost",       "round_robin",   "least_loaded", "prefix_greedy",
    "sglang_cache_aware", "llmd_weighted", "dynamo_cost"};

const char *kvp_policy_name(kvp_policy p) {
  return (unsigned)p < KVP_POLICY_COUNT_ ? policy_names[p] : "unknown";
}

/* Case-insensitive compare where '-' matches '_'. */
static bool name_eq(const char *a, const char *b) {
  for (; *a && *b; a++, b++) {
    char x = *a == '-' ? '_' : *a, y = *b == '-' ? '_' : *b;
    if (x >= 'A' && x <= 'Z')
      x = (char)(x - 'A' + 'a');
    if (x != y)
      return false;
  }
  return *a == *b;
}

int kvp_policy_reads_matches(kvp_policy p) {
  return p != KVP_POLICY_ROUND_ROBIN; /* pick_round_robin: rr_next, online() */
}

int kvp_policy_compares_matches(kvp_policy p) {
  /* pick_round_robin, pick_least_loaded: load and rotation only */
  return p != KVP_POLICY_ROUND_ROBIN && p != KVP_POLICY_LEAST_LOADED;
}

int kvp_policy_parse(const char *name, kvp_policy *out) {
  if (name == NULL || out == NULL)
    return KVP_EINVAL;
  for (int p = 0; p < KVP_POLICY_COUNT_; p++)
    if (name_eq(name, policy_names[p])) {
      *out = (kvp_policy)p;
      return 0;
    }
  return KVP_EINVAL;
}

/* ---- model --------------------------------------------------------------- */
/* Llama-3.1-8B: the default when the caller names no model. */
static const kvp_model_spec default_model = {32, 32, 8,      128,
                                             2,  0,  8.03e9, {0, 0, 0, 0}};
static const double default_bw[KVP_TIER_COUNT_] = {3.35e12, 50e9, 6e9, 25e9};
static const double default_lat[KVP_TIER_COUNT_] = {0.0, 10e-6, 100e-6, 50e-6};
/* Dynamo's overlap_score_credit, host_cache_hit_weight,
 * disk_cache_hit_weight and shared-cache multiplier (off) defaults. */
static const double default_credit[KVP_TIER_COUNT_] = {1.0, 0.75, 0.25, 0.0};

static bool model_is_zero(const kvp_model_spec *m) {
  return m->layers == 0 && m->heads == 0 && m->kv_heads == 0 &&
         m->head_dim == 0 && m->dtype_bytes == 0 && m->params == 0.0;
}

/* The first insane field of a spec that is not all zero, or NULL. */
static const char *model_bad_field(const kvp_model_spec *m) {
  const uint32_t lim = 1u << 16;
  if (m->layers == 0 || m->layers > lim)
    return "layers";
  if (m->heads == 0 || m->heads > lim)
    return "heads";
  if (m->kv_heads == 0 || m->kv_heads > m->heads)
    return "kv_heads";
  if (m->head_dim == 0 || m->head_dim > lim)
    return "head_dim";
  if (m->dtype_bytes == 0 || m->dtype_bytes > 16)
    return "dtype_bytes";
  if (!isfinite(m->params) || !(m->params > 0.0) || m->params > 1e16)
    return "params";
  return NULL;
}

/* NULL or all-zero -> the default; otherwise every field must be sane. */
static int model_resolve(const kvp_model_spec *in, kvp_model_spec *out) {
  if (in == NULL || model_is_zero(in)) {
    *out = default_model;
    return 0;
  }
  if (model_bad_field(in) != NULL)
    return KVP_EINVAL;
  *out = *in;
  return 0;
}

double kvp_model_kv_bytes_per_token(const kvp_model_spec *m) {
  kvp_model_spec s;
  if (model_resolve(m, &s) < 0)
    return 0.0;
  return 2.0 * s.layers * s.kv_heads * s.head_dim * s.dtype_bytes;
}

/* sum_{t=from}^{to-1} (lin + att * t), in double (exact enough: < 2^53 per
 * factor for any accepted prompt). */
static double flops_range(double lin, double att, uint64_t from, uint64_t to) {
  if (from >= to)
    return 0.0;
  double n = (double)(to - from);
  double ctx = ((double)from + (double)to - 1.0) * 0.5 * n;
  return lin * n + att * ctx;
}

double kvp_model_prefill_flops(const kvp_model_spec *m, uint64_t from,
                               uint64_t to) {
  kvp_model_spec s;
  if (model_resolve(m, &s) < 0)
    return 0.0;
  double att = 4.0 * s.layers * s.heads * s.head_dim;
  return flops_range(2.0 * s.params, att, from, to);
}

/* ---- options ---------------------------------------------------------------
 * Each check logs the first bad field with its value, so a caller sees
 * "create: opts.gpu.bw[nvme] = -1: ..." rather than a bare KVP_EINVAL (`op`
 * is the call that checks: "create" or "set_opts"). */
/* A double option: finite, in [0, max]; 0 selects `def`.  `k` >= 0 names a
 * tier element of an array option. */
static bool dbl_opt(const char *op, const char *f, int k, double *v,
                    double def, double max) {
  if (!isfinite(*v) || *v < 0.0 || *v > max) {
    KVP_LOGW(MOD, "%s: opts.%s%s%s%s = %g: must be finite, in [0, %g]", op, f,
             k >= 0 ? "[" : "", k >= 0 ? kvp_tier_name((kvp_tier)k) : "",
             k >= 0 ? "]" : "", *v, max);
    return false;
  }
  if (*v == 0.0)
    *v = def;
  return true;
}
#define DBL_(o, f, def, max) dbl_opt(op, #f, -1, &(o)->f, def, max)

static bool u32_opt(const char *op, const char *f, uint32_t v, uint32_t lo,
                    uint32_t hi) {
  if (v >= lo && v <= hi)
    return true;
  KVP_LOGW(MOD, "%s: opts.%s = %u: must be in %u .. %u", op, f, v, lo, hi);
  return false;
}

static bool gpu_resolve(const char *op, kvp_gpu_spec *g) {
  bool ok = dbl_opt(op, "gpu.flops", -1, &g->flops, 989e12, 1e20) &&
            dbl_opt(op, "gpu.efficiency", -1, &g->efficiency, 0.5, 1.0) &&
            dbl_opt(op, "gpu.prefill_overhead_s", -1, &g->prefill_overhead_s,
                    0.0, 60.0);
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    ok = ok && dbl_opt(op, "gpu.bw", k, &g->bw[k], default_bw[k], 1e16) &&
         dbl_opt(op, "gpu.latency_s", k, &g->latency_s[k], default_lat[k],
                 10.0);
  return ok;
}

static bool policy_opts_resolve(const char *op, kvp_router_opts *o) {
  bool ok = DBL_(o, guard, 2.0, 1e6) && DBL_(o, affinity_eps_rel, 0.05, 1e3) &&
            DBL_(o, affinity_eps_s, 2e-3, 1e3) && DBL_(o, tie_rel, 0.01, 1.0) &&
            DBL_(o, uncertain_confidence, 0.8, 1.0) &&
            DBL_(o, sglang_balance_abs, 64.0, 1e12) &&
            DBL_(o, sglang_balance_rel, 1.5, 1e6) &&
            DBL_(o, sglang_cache_threshold, 0.3, 1.0) &&
            DBL_(o, llmd_w_prefix, 3.0, 1e6) && DBL_(o, llmd_w_kv, 2.0, 1e6) &&
            DBL_(o, llmd_w_queue, 2.0, 1e6) &&
            DBL_(o, dynamo_prefill_scale, 1.0, 1e6) &&
            DBL_(o, dynamo_temperature, 0.0, 1e6) &&
            DBL_(o, bw_ewma_alpha, 0.25, 1.0);
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    ok = ok && dbl_opt(op, "dynamo_credit", k, &o->dynamo_credit[k],
                       default_credit[k], 1e3);
  return ok;
}

static uint32_t u32_default(uint32_t v, uint32_t def) { return v ? v : def; }

/* Reserved fields must stay zero, so that a later version can give them a
 * meaning without old callers' garbage turning it on. */
static bool zeros(const void *p, size_t n) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++)
    if (b[i])
      return false;
  return true;
}

static bool reserved_clear(const char *op, const kvp_router_opts *o) {
  const char *f = !zeros(o->reserved, sizeof o->reserved) ? "reserved"
                  : !zeros(o->model.reserved, sizeof o->model.reserved) ||
                          o->model.reserved0 != 0
                      ? "model.reserved"
                  : !zeros(o->gpu.reserved, sizeof o->gpu.reserved)
                      ? "gpu.reserved"
                      : NULL;
  if (f != NULL)
    KVP_LOGW(MOD, "%s: opts.%s: must be zero", op, f);
  return f == NULL;
}

static bool model_opt(const char *op, const kvp_model_spec *m) {
  const char *f = model_is_zero(m) ? NULL : model_bad_field(m);
  if (f != NULL)
    KVP_LOGW(MOD,
             "%s: opts.model.%s out of range (layers %u, heads %u, "
             "kv_heads %u, head_dim %u, dtype_bytes %u, params %g): a model "
             "that is not all zero must be complete and sane",
             op, f, m->layers, m->heads, m->kv_heads, m->head_dim,
             m->dtype_bytes, m->params);
  return f == NULL;
}

/* Integer options: ranges, then the required fields. */
static bool ints_ok(const char *op, const kvp_router_opts *o) {
  if (o->block_size == 0) {
    KVP_LOGW(MOD, "%s: opts.block_size = 0: required, the tokens per "
                  "block of the keys routed (kvp_hasher_block_size)", op);
    return false;
  }
  return u32_opt(op, "policy", (uint32_t)o->policy, 0,
                 KVP_POLICY_COUNT_ - 1) &&
         u32_opt(op, "n_workers", o->n_workers, 1, KVP_WORKERS_MAX) &&
         u32_opt(op, "block_size", o->block_size, 1, KVP_BLOCK_SIZE_MAX) &&
         u32_opt(op, "guard_ref", o->guard_ref, 0, KVP_GUARD_MIN) &&
         u32_opt(op, "guard_load", o->guard_load, 0, KVP_GUARD_LOAD_REQUESTS) &&
         u32_opt(op, "max_inflight", o->max_inflight, 1, 1u << 24) &&
         u32_opt(op, "max_sessions", o->max_sessions, 1, 1u << 24) &&
         u32_opt(op, "max_blocks", o->max_blocks, 1, 1u << 28) &&
         u32_opt(op, "pending_ms", o->pending_ms, 0, 3600000) &&
         u32_opt(op, "inflight_decay", o->inflight_decay, 0, 1);
}

static int opts_resolve(const char *op, const kvp_router_opts *in,
                        kvp_router_opts *o) {
  if (in == NULL) {
    KVP_LOGW(MOD, "%s: opts is NULL", op);
    return KVP_EINVAL;
  }
  *o = *in;
  o->guard_min_load = u32_default(o->guard_min_load, 4);
  o->max_inflight = u32_default(o->max_inflight, 65536);
  o->max_sessions = u32_default(o->max_sessions, 65536);
  o->max_blocks = u32_default(o->max_blocks, 1u << 20);
  if (!ints_ok(op, o) || !reserved_clear(op, o) || !model_opt(op, &o->model) ||
      !gpu_resolve(op, &o->gpu) || !policy_opts_resolve(op, o))
    return KVP_EINVAL;
  kvp_model_spec m;
  model_resolve(&o->model, &m);
  o->model = m;
  return 0;
}

/* ---- create / destroy ---------------------------------------------------- */
static size_t pow2_at_least(size_t v) {
  size_t p = 1;
  while (p < v)
    p <<= 1;
  return p;
}

static double bits_to_dbl(uint64_t b) {
  double d;
  memcpy(&d, &b, sizeof d);
  return d;
}

static uint64_t dbl_to_bits(double d) {
  uint64_t b;
  memcpy(&b, &d, sizeof b);
  return b;
}

/* The cost model's constants from r->o's model and GPU. */
static void router_set_model(kvp_router *r) {
  const kvp_model_spec *m = &r->o.model;
  r->kvb = kvp_model_kv_bytes_per_token(m);
  r->f_lin = 2.0 * m->params;
  r->f_att = 4.0 * m->layers * m->heads * m->head_dim;
  r->f_eff = r->o.gpu.flops * r->o.gpu.efficiency;
  r->inv_f_eff = 1.0 / r->f_eff;
}

static void router_init_model(kvp_router *r) {
  r->n = r->o.n_workers;
  r->bs = r->o.block_size;
  router_set_model(r);
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    atomic_init(&r->bw_bits[k], dbl_to_bits(r->o.gpu.bw[k]));
  atomic_init(&r->bw_measured, 0u);
  r->next_id = 1;
}

static int router_alloc_tables(kvp_router *r) {
  const kvp_allocator *a = &r->alloc;
  size_t n = r->o.n_workers;
  r->inflight_mask = pow2_at_least(2 * (size_t)r->o.max_inflight) - 1;
  r->session_mask = pow2_at_least(r->o.max_sessions) - 1;
  r->load = kvp__calloc(a, n, sizeof *r->load);
  r->ws = kvp__calloc(a, n, sizeof *r->ws);
  r->cand = kvp__calloc(a, n, sizeof *r->cand);
  r->inflight = kvp__calloc(a, r->inflight_mask + 1, sizeof *r->inflight);
  r->sessions = kvp__calloc(a, r->session_mask + 1, sizeof *r->sessions);
  r->ixm = kvp__calloc(a, n, sizeof *r->ixm);
  r->wm = kvp__calloc(a, n, sizeof *r->wm);
  if (!r->load || !r->ws || !r->cand || !r->inflight || !r->sessions ||
      !r->ixm || !r->wm)
    return KVP_ENOMEM;
  return 0;
}

int kvp_router_create(const kvp_router_opts *opts, const kvp_allocator *alloc,
                      kvp_router **out) {
  if (out == NULL)
    return KVP_EINVAL;
  *out = NULL;
  kvp_router_opts o;
  int rc = opts_resolve("create", opts, &o); /* logs the field */
  if (rc < 0)
    return rc;
  kvp_allocator a = kvp__allocator(alloc);
  kvp_router *r = kvp__calloc(&a, 1, sizeof *r);
  if (r == NULL)
    return KVP_ENOMEM;
  r->alloc = a;
  r->o = o;
  rc = router_alloc_tables(r);
  if (rc < 0)
    goto fail;
  router_init_model(r);
  *out = r;
  return 0;
fail:
  kvp_router_destroy(r);
  return rc;
}

void kvp_router_destroy(kvp_router *r) {
  if (r == NULL)
    return;
  kvp_allocator a = r->alloc;
  size_t n = r->o.n_workers;
  kvp__free(&a, r->wm, n * sizeof *r->wm);
  kvp__free(&a, r->ixm, n * sizeof *r->ixm);
  kvp__free(&a, r->sessions, (r->session_mask + 1) * sizeof *r->sessions);
  kvp__free(&a, r->inflight, (r->inflight_mask + 1) * sizeof *r->inflight);
  kvp__free(&a, r->cand, n * sizeof *r->cand);
  kvp__free(&a, r->ws, n * sizeof *r->ws);
  kvp__free(&a, r->load, n * sizeof *r->load);
  kvp__free(&a, r, sizeof *r);
}

/* ---- live options -------------------------------------------------------- */
/* What sizes the tables (workers, in-flight and session slots) or gives the
 * keys their meaning (tokens per block): a change takes a new router. */
static bool same_structure(const kvp_router *r, const kvp_router_opts *o) {
  static const char *const names[] = {"n_workers", "block_size",
                                      "max_inflight", "max_sessions"};
  const uint32_t was[] = {r->o.n_workers, r->o.block_size, r->o.max_inflight,
                          r->o.max_sessions};
  const uint32_t now[] = {o->n_workers, o->block_size, o->max_inflight,
                          o->max_sessions};
  for (size_t i = 0; i < sizeof was / sizeof *was; i++)
    if (was[i] != now[i]) {
      KVP_LOGW(MOD, "set_opts: opts.%s = %u (running %u): it sizes the "
               "router; a change takes a new one (kvp_router_create)",
               names[i], now[i], was[i]);
      return false;
    }
  return true;
}

int kvp_router_set_opts(kvp_router *r, const kvp_router_opts *opts) {
  if (r == NULL)
    return KVP_EINVAL;
  kvp_router_opts o;
  int rc = opts_resolve("set_opts", opts, &o); /* logs the field */
  if (rc < 0)
    return rc;
  if (!same_structure(r, &o))
    return KVP_EINVAL;
  /* a measured bandwidth outranks any configured one (report_bandwidth) */
  uint32_t measured =
      atomic_load_explicit(&r->bw_measured, memory_order_relaxed);
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    if (!(measured & (1u << k)))
      atomic_store_explicit(&r->bw_bits[k], dbl_to_bits(o.gpu.bw[k]),
                            memory_order_relaxed);
  r->o = o;
  router_set_model(r);
  return 0;
}

/* ---- load and bandwidth -------------------------------------------------- */
int kvp_router_set_load(kvp_router *r, uint32_t worker,
                        const kvp_worker_load *load) {
  if (r == NULL || load == NULL || worker >= r->n)
    return KVP_EINVAL;
  if (!(load->kv_util >= 0.0 && load->kv_util <= 1.0) ||
      load->prefill_tokens > KVP_ROUTE_COUNT_MAX ||
      load->decode_blocks > KVP_ROUTE_COUNT_MAX ||
      (load->flags & ~KVP_WORKER_OFFLINE) != 0 ||
      !zeros(load->reserved, sizeof load->reserved))
    return KVP_EINVAL;
  r->load[worker] = *load;
  return 0;
}

double kvp_router_bandwidth(const kvp_router *r, kvp_tier tier) {
  if (r == NULL || (unsigned)tier >= KVP_TIER_COUNT_)
    return 0.0;
  /* relaxed: pairs with the relaxed stores in report_bandwidth; the value
   * carries no other data. */
  return bits_to_dbl(atomic_load_explicit(&((kvp_router *)r)->bw_bits[tier],
                                          memory_order_relaxed));
}

int kvp_router_report_bandwidth(kvp_router *r, kvp_tier tier,
                                double bytes_per_s) {
  if (r == NULL || (unsigned)tier >= KVP_TIER_COUNT_ ||
      !(bytes_per_s > 0.0 && bytes_per_s <= 1e16)) /* NaN fails too */
    return KVP_EINVAL;
  uint32_t bit = 1u << tier;
  uint32_t seen =
      atomic_fetch_or_explicit(&r->bw_measured, bit, memory_order_relaxed);
  /* The first measurement replaces the configuration.  (Two first reports
   * racing may blend one into the configured value before the other's store
   * lands: one sample lost, harmless for an EWMA.) */
  if (!(seen & bit)) {
    atomic_store_explicit(&r->bw_bits[tier], dbl_to_bits(bytes_per_s),
                          memory_order_relaxed);
    return 0;
  }
  double alpha = r->o.bw_ewma_alpha;
  uint64_t old = atomic_load_explicit(&r->bw_bits[tier], memory_order_relaxed);
  uint64_t nu;
  do { /* concurrent reporters: each CAS folds one sample into the latest */
    nu = dbl_to_bits(alpha * bytes_per_s + (1.0 - alpha) * bits_to_dbl(old));
  } while (!atomic_compare_exchange_weak_explicit(
      &r->bw_bits[tier], &old, nu, memory_order_relaxed, memory_order_relaxed));
  return 0;
}

/* ---- in-flight table: open addressing, linear probing, id 0 = empty ------ */
static size_t if_home(const kvp_router *r, uint64_t id) {
  return (size_t)kvp__mix64(id) & r->inflight_mask;
}

static kvp__inflight *if_find(kvp_router *r, uint64_t id) {
  for (size_t i = if_home(r, id);; i = (i + 1) & r->inflight_mask) {
    if (r->inflight[i].id == id)
      return &r->inflight[i];
    if (r->inflight[i].id == 0)
      return NULL;
  }
}

/* The in-flight prefill seconds still ahead on worker w at now (has_now:
 * the caller gave its clock): what was left at the last routing less the
 * time since, at most all of it. */
static double ws_left(const kvp__route_ws *w, uint64_t now, bool has_now) {
  if (!has_now)
    return w->seconds;
  double left = w->work - (now > w->work_t ? (double)(now - w->work_t) * 1e-9
                                           : 0.0);
  return left <= 0.0 ? 0.0 : left < w->seconds ? left : w->seconds;
}

/* sign > 0: e routed; has_clock: at the caller's time now; decay: its
 * in-flight seconds run down (else they are kept whole, and the time they
 * were last added, so that a reload turning decay on starts from there). */
static void ws_apply(kvp_router *r, const kvp__inflight *e, int sign,
                     uint64_t now, bool has_clock, bool decay) {
  kvp__route_ws *w = &r->ws[e->worker];
  if (sign > 0) {
    if (has_clock) { /* the work left now, then this request's */
      w->work = decay ? ws_left(w, now, true) : w->work;
      w->work_t = now;
    }
    w->requests++, w->tokens += e->tokens, w->blocks += e->blocks;
    w->seconds += e->seconds;
    w->work += e->seconds;
    return;
  }
  w->requests--, w->tokens -= e->tokens, w->blocks -= e->blocks;
  w->seconds -= e->seconds;
  if (w->requests == 0 || w->seconds < 0.0) /* no rounding residue */
    w->seconds = 0.0;
  if (w->work > w->seconds) /* done: what is left is at most the rest */
    w->work = w->seconds;
}

/* Backward-shift deletion keeps every probe chain gap-free (no tombstones). */
static void if_remove(kvp_router *r, kvp__inflight *e) {
  size_t mask = r->inflight_mask, i = (size_t)(e - r->inflight);
  ws_apply(r, e, -1, 0, false, false);
  for (size_t j = (i + 1) & mask; r->inflight[j].id != 0; j = (j + 1) & mask) {
    size_t home = if_home(r, r->inflight[j].id);
    if (((j - home) & mask) >= ((j - i) & mask)) {
      r->inflight[i] = r->inflight[j];
      i = j;
    }
  }
  r->inflight[i].id = 0;
  r->inflight_count--;
}

/* false when the table is at max_inflight (the request goes untracked). */
static bool if_insert(kvp_router *r, const kvp__inflight *e, uint64_t now,
                      bool has_clock, bool decay) {
  if (r->inflight_count >= r->o.max_inflight)
    return false;
  size_t i = if_home(r, e->id);
  while (r->inflight[i].id != 0)
    i = (i + 1) & r->inflight_mask;
  r->inflight[i] = *e;
  r->inflight_count++;
  ws_apply(r, e, +1, now, has_clock, decay);
  return true;
}

int kvp_router_complete(kvp_router *r, uint32_t worker, uint64_t request_id) {
  if (r == NULL || worker >= r->n)
    return KVP_EINVAL;
  kvp__inflight *e = request_id ? if_find(r, request_id) : NULL;
  if (e == NULL || e->worker != worker)
    return KVP_ENOENT;
  if_remove(r, e);
  return 0;
}

int kvp_router_inflight(const kvp_router *r, uint32_t worker,
                        uint64_t *requests, uint64_t *tokens, double *seconds) {
  if (r == NULL || worker >= r->n)
    return KVP_EINVAL;
  const kvp__route_ws *w = &r->ws[worker];
  if (requests)
    *requests = w->requests;
  if (tokens)
    *tokens = w->tokens;
  if (seconds)
    *seconds = w->seconds;
  return 0;
}

/* ---- sessions: direct-mapped; a collision forgets the older session ------ */
static kvp__session *session_slot(kvp_router *r, uint64_t id) {
  return &r->sessions[(size_t)kvp__mix64(id ^ 0x5e55u) & r->session_mask];
}

static uint32_t session_worker(kvp_router *r, uint64_t id) {
  kvp__session *s = id ? session_slot(r, id) : NULL;
  return s && s->id == id ? s->worker : KVP_WORKER_NONE;
}

int kvp_router_session_set(kvp_router *r, uint64_t session_id,
                           uint32_t worker) {
  if (r == NULL || session_id == 0 || worker >= r->n)
    return KVP_EINVAL;
  kvp__session *s = session_slot(r, session_id);
  s->id = session_id, s->worker = worker;
  return 0;
}

/* ---- one decision -------------------------------------------------------- */
typedef struct route_ctx {
  const kvp_route_request *req;
  uint64_t n_tokens;   /* N */
  uint64_t req_blocks; /* ceil(N / block_size) */
  uint64_t id;         /* request id (the caller's or the next assigned) */
  uint64_t tie_key;    /* session id, else request id */
  uint32_t n_online;
  uint32_t session_w;                  /* the session's last worker, or NONE */
  bool decay; /* in-flight seconds run down to req->now_ns */
  double s_per_block[KVP_TIER_COUNT_]; /* load time of one block per tier */
} route_ctx;

typedef struct pick {
  uint32_t chosen;
  uint8_t reason;
  uint8_t flags; /* KVP_DECISION_* */
  uint32_t best_unguarded;
  uint32_t n_tied;
  char detail[128];
} pick;

/* Routable now: not offline and, during a decision whose request names
 * its eligible workers, one of them. */
static bool online(const kvp_router *r, uint32_t w) {
  if (r->load[w].flags & KVP_WORKER_OFFLINE)
    return false;
  return r->elig == NULL ||
         (w / 64 < r->elig_words && ((r->elig[w / 64] >> (w % 64)) & 1));
}

/* Each failure logs the field (a request is the caller's bug to find). */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 1, 2)))
#endif
static int
req_bad(const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  KVP_LOGW(MOD, "%s", msg); /* "request.<field> ..." */
  return KVP_EINVAL;
}

static int cls_validate(const kvp_route_request *q) {
  const kvp_classification *c = q->cls;
  if (c == NULL)
    return 0;
  if (c->n_blocks != q->n_blocks)
    return req_bad("request.cls->n_blocks = %u but request.n_blocks = %zu: "
                   "the classification must be of the same key chain",
                   c->n_blocks, q->n_blocks);
  if (c->stable_end > c->semi_end || c->semi_end > c->n_blocks)
    return req_bad("request.cls: stable_end %u <= semi_end %u <= n_blocks "
                   "%u does not hold",
                   c->stable_end, c->semi_end, c->n_blocks);
  return 0;
}

static int ctx_validate(const kvp_router *r, const kvp_route_request *q) {
  uint64_t hashed = (uint64_t)q->n_blocks * r->bs;
  if (q->keys == NULL && q->n_blocks > 0)
    return req_bad("request.keys is NULL with n_blocks = %zu", q->n_blocks);
  if (q->n_blocks > r->o.max_blocks)
    return req_bad("request.n_blocks = %zu > opts.max_blocks %u", q->n_blocks,
                   r->o.max_blocks);
  if (q->block_size != 0 && q->block_size != r->bs)
    return req_bad("request.block_size = %u but the router's opts.block_size "
                   "= %u: the keys come from another namespace",
                   q->block_size, r->bs);
  if (q->prompt_tokens != 0 &&
      (q->prompt_tokens < hashed ||
       q->prompt_tokens > ((uint64_t)r->o.max_blocks + 1) * r->bs))
    return req_bad("request.prompt_tokens = %" PRIu64 ": fewer than n_blocks "
                   "x block_size = %" PRIu64 " or beyond max_blocks",
                   q->prompt_tokens, hashed);
  if (q->flags & ~(KVP_ROUTE_SEEN | KVP_ROUTE_NOW))
    return req_bad("request.flags = 0x%x: unknown bits", q->flags);
  if ((q->eligible == NULL) != (q->n_eligible_words == 0) ||
      q->n_eligible_words > (r->n + 63) / 64)
    return req_bad("request.eligible / n_eligible_words = %u: both or "
                   "neither, at most %u words for %u workers",
                   q->n_eligible_words, (r->n + 63) / 64, r->n);
  return cls_validate(q);
}

static int ctx_init(kvp_router *r, const kvp_route_request *q, route_ctx *x) {
  int rc = ctx_validate(r, q);
  if (rc < 0)
    return rc;
  memset(x, 0, sizeof *x);
  x->req = q;
  x->n_tokens =
      q->prompt_tokens ? q->prompt_tokens : (uint64_t)q->n_blocks * r->bs;
  x->req_blocks = (x->n_tokens + r->bs - 1) / r->bs;
  /* assigned ids carry the top bit so they never meet a caller's */
  x->id = q->request_id ? q->request_id : (r->next_id | (1ull << 63));
  x->tie_key = q->session_id ? q->session_id : x->id;
  x->session_w = session_worker(r, q->session_id);
  x->decay = r->o.inflight_decay && (q->flags & KVP_ROUTE_NOW);
  for (int k = 0; k < KVP_TIER_COUNT_; k++) /* divide once per decision */
    x->s_per_block[k] = r->bs * r->kvb / kvp_router_bandwidth(r, (kvp_tier)k);
  for (uint32_t w = 0; w < r->n; w++)
    x->n_online += online(r, w);
  return 0;
}

/* Copies the caller's matches into the scratch of this decision's epoch. */
static int load_matches(kvp_router *r, const route_ctx *x,
                        const kvp_worker_match *m, size_t n) {
  if (n > 0 && m == NULL)
    return KVP_EINVAL;
  r->epoch++;
  for (size_t i = 0; i < n; i++) {
    uint64_t sum = 0;
    for (int k = 0; k < KVP_TIER_COUNT_; k++)
      sum += m[i].blocks[k];
    if (m[i].worker >= r->n || r->cand[m[i].worker].epoch == r->epoch ||
        sum > x->req->n_blocks || (m[i].flags & ~KVP_MATCH_UNCERTAIN))
      return KVP_EINVAL;
    kvp__route_cand *c = &r->cand[m[i].worker];
    c->epoch = r->epoch;
    memcpy(c->m, m[i].blocks, sizeof c->m);
    c->mflags = m[i].flags;
  }
  return 0;
}

/* Prefill seconds of prompt tokens [from, to). */
static double prefill_s(const kvp_router *r, uint64_t from, uint64_t to) {
  return flops_range(r->f_lin, r->f_att, from, to) * r->inv_f_eff;
}

static double tier_load_s(const kvp_router *r, const route_ctx *x, int k,
                          uint32_t blocks) {
  if (blocks == 0)
    return 0.0;
  return (double)blocks * x->s_per_block[k] + r->o.gpu.latency_s[k];
}

/* Payoff, not hits: of the matched prefix (fastest tier first), reuse the
 * tier-boundary prefix that minimises load + recompute; ties reuse more. */
static void reuse_cut(const kvp_router *r, const route_ctx *x,
                      kvp__route_cand *c) {
  uint64_t p = 0, best_p = 0;
  double load = 0.0, best_load = 0.0;
  double best_rec = prefill_s(r, 0, x->n_tokens);
  for (int k = 0; k < KVP_TIER_COUNT_; k++) {
    if (c->m[k] == 0)
      continue;
    p += c->m[k];
    load += tier_load_s(r, x, k, c->m[k]);
    double rec = prefill_s(r, p * r->bs, x->n_tokens);
    if (load + rec <= best_load + best_rec)
      best_p = p, best_load = load, best_rec = rec;
  }
  c->matched_blocks = p;
  c->reused_blocks = best_p;
  c->load_s = best_load;
  c->recompute_s = best_rec;
}

/* kvplane's TTFT terms for worker w (every policy reports them). */
static void cand_terms(kvp_router *r, const route_ctx *x, uint32_t w) {
  kvp__route_cand *c = &r->cand[w];
  const kvp_worker_load *l = &r->load[w];
  if (c->epoch != r->epoch) { /* not in the match array: matches nothing */
    memset(c->m, 0, sizeof c->m);
    c->mflags = 0;
    c->epoch = r->epoch;
  }
  c->cflags = (c->mflags & KVP_MATCH_UNCERTAIN) ? KVP_CAND_UNCERTAIN : 0;
  c->cflags |= (w == x->session_w) ? KVP_CAND_AFFINE : 0;
  /* the queue's prefill, then each request's fixed cost, its own included */
  c->queue_s =
      (double)l->prefill_tokens * r->f_lin * r->inv_f_eff +
      ws_left(&r->ws[w], x->req->now_ns, x->decay) +
      (double)((uint64_t)l->queued_requests + r->ws[w].requests + 1) *
          r->o.gpu.prefill_overhead_s;
  reuse_cut(r, x, c);
  if (c->cflags & KVP_CAND_UNCERTAIN) { /* expectation over a predicted hit */
    double p = r->o.uncertain_confidence;
    c->recompute_s =
        p * c->recompute_s + (1.0 - p) * prefill_s(r, 0, x->n_tokens);
    c->load_s *= p;
  }
  c->total_s = c->queue_s + c->recompute_s + c->load_s;
  c->load_req =
      (uint64_t)l->queued_requests + l->running_requests + r->ws[w].requests;
  c->load_guard = r->o.guard_load == KVP_GUARD_LOAD_REQUESTS
                      ? c->load_req
                      : (uint64_t)l->queued_requests + r->ws[w].requests;
  c->guard_ref = 0.0;
  c->score = c->total_s;
  c->key[0] = c->total_s, c->key[1] = 0.0, c->key[2] = 0.0;
}

/* a before b in the policy's order (ties: lower index). */
static bool key_less(const kvp__route_cand *a, const kvp__route_cand *b) {
  for (int i = 0; i < 3; i++)
    if (a->key[i] != b->key[i])
      return a->key[i] < b->key[i];
  return false;
}

/* First online worker minimal by key, over all (*all) and over those the
 * guard left (return value); `all` may be NULL. */
static uint32_t argmin_key2(const kvp_router *r, uint32_t *all) {
  uint32_t best = KVP_WORKER_NONE, any = KVP_WORKER_NONE;
  for (uint32_t w = 0; w < r->n; w++) {
    const kvp__route_cand *c = &r->cand[w];
    if (!online(r, w))
      continue;
    if (any == KVP_WORKER_NONE || key_less(c, &r->cand[any]))
      any = w;
    if (!(c->cflags & KVP_CAND_GUARDED) &&
        (best == KVP_WORKER_NONE || key_less(c, &r->cand[best])))
      best = w;
  }
  if (all != NULL)
    *all = any;
  return best;
}

static uint32_t argmin_key(const kvp_router *r) {
  uint32_t all;
  argmin_key2(r, &all);
  return all;
}

/* Herd-free tie-break: replicas with identical state pick differently. */
static uint64_t tie_hash(const kvp_router *r, const route_ctx *x, uint32_t w) {
  uint64_t h = kvp__mix64(x->tie_key ^ 0x7469655f6b6579ull);
  h = kvp__mix64(h ^ ((uint64_t)w << 32 | r->o.replica_id));
  return kvp__mix64(h ^ r->o.seed);
}

/* Among online (unguarded) workers whose key[0] is within `lim`, the one with
 * the highest tie hash.  Returns the count in *n_tied. */
static uint32_t tie_pick(const kvp_router *r, const route_ctx *x, double lim,
                         bool higher_is_better, uint32_t *n_tied) {
  uint32_t pick_w = KVP_WORKER_NONE, n = 0;
  uint64_t top = 0;
  for (uint32_t w = 0; w < r->n; w++) {
    const kvp__route_cand *c = &r->cand[w];
    if (!online(r, w) || (c->cflags & KVP_CAND_GUARDED))
      continue;
    if (higher_is_better ? c->score < lim : c->key[0] > lim)
      continue;
    uint64_t h = tie_hash(r, x, w);
    if (n++ == 0 || h > top)
      top = h, pick_w = w;
  }
  *n_tied = n;
  return pick_w;
}

/* ---- kvplane_cost -------------------------------------------------------- */
typedef struct guard_stats {
  uint64_t sum, n, min1, min2;
  uint32_t min1_w;
} guard_stats;

static void guard_collect(const kvp_router *r, guard_stats *g) {
  memset(g, 0, sizeof *g);
  g->min1 = g->min2 = UINT64_MAX;
  g->min1_w = KVP_WORKER_NONE;
  for (uint32_t w = 0; w < r->n; w++) {
    if (!online(r, w))
      continue;
    uint64_t l = r->cand[w].load_guard;
    g->sum += l, g->n++;
    if (l < g->min1)
      g->min2 = g->min1, g->min1 = l, g->min1_w = w;
    else if (l < g->min2)
      g->min2 = l;
  }
}

/* Marks workers whose request load exceeds guard x (mean|min of the others)
 * and the absolute floor, unless every unmarked worker's predicted queue is
 * longer than the marked one's (the brake would only add wait: measured on
 * real vLLM, a turn sent from a 2.4 s queue to a 6.7 s one); clears all
 * marks if every worker is marked. */
static void guard_apply(kvp_router *r, pick *p) {
  guard_stats g;
  guard_collect(r, &g);
  if (g.n < 2)
    return;
  uint32_t n_ex = 0;
  double inv_others = 1.0 / (double)(g.n - 1);
  for (uint32_t w = 0; w < r->n; w++) {
    kvp__route_cand *c = &r->cand[w];
    if (!online(r, w))
      continue;
    c->guard_ref = r->o.guard_ref == KVP_GUARD_MIN
                       ? (double)(w == g.min1_w ? g.min2 : g.min1)
                       : (double)(g.sum - c->load_guard) * inv_others;
    if ((double)c->load_guard > r->o.guard * c->guard_ref &&
        c->load_guard > r->o.guard_min_load)
      c->cflags |= KVP_CAND_GUARDED, n_ex++;
  }
  if (n_ex > 0 && n_ex < g.n) {
    double q_free = INFINITY; /* the shortest queue the guard leaves */
    for (uint32_t w = 0; w < r->n; w++)
      if (online(r, w) && !(r->cand[w].cflags & KVP_CAND_GUARDED))
        q_free = fmin(q_free, r->cand[w].queue_s);
    for (uint32_t w = 0; w < r->n; w++) {
      kvp__route_cand *c = &r->cand[w];
      if (online(r, w) && (c->cflags & KVP_CAND_GUARDED) && c->queue_s < q_free)
        c->cflags &= ~KVP_CAND_GUARDED, n_ex--;
    }
  }
  if (n_ex < g.n)
    return;
  for (uint32_t w = 0; w < r->n; w++)
    r->cand[w].cflags &= ~KVP_CAND_GUARDED;
  p->flags |= KVP_DECISION_ALL_GUARDED;
}

/* The session stays put while its worker costs at most epsilon more. */
static bool affinity_keep(const kvp_router *r, const route_ctx *x,
                          uint32_t best, pick *p) {
  uint32_t s = x->session_w;
  if (s == KVP_WORKER_NONE || s >= r->n || !online(r, s) ||
      (r->cand[s].cflags & KVP_CAND_GUARDED))
    return false;
  double b = r->cand[best].total_s;
  double eps = fmax(r->o.affinity_eps_s, r->o.affinity_eps_rel * b);
  if (r->cand[s].total_s > b + eps)
    return false;
  p->chosen = s;
  p->reason = s == best ? KVP_REASON_COST : KVP_REASON_AFFINITY;
  return true;
}

static void pick_kvplane(kvp_router *r, const route_ctx *x, pick *p) {
  guard_apply(r, p);
  uint32_t best = argmin_key2(r, &p->best_unguarded);
  if (x->n_online == 1) {
    p->chosen = best, p->reason = KVP_REASON_ONLY;
    return;
  }
  if (!affinity_keep(r, x, best, p)) {
    double b = r->cand[best].total_s;
    double lim = b * (1.0 + r->o.tie_rel) + 1e-12;
    p->chosen = tie_pick(r, x, lim, false, &p->n_tied);
    p->reason = p->n_tied > 1 ? KVP_REASON_TIE : KVP_REASON_COST;
  }
  if (p->chosen != p->best_unguarded &&
      (r->cand[p->best_unguarded].cflags & KVP_CAND_GUARDED))
    p->reason = KVP_REASON_GUARD;
}

/* ---- peers --------------------------------------------------------------- */
static void set_keys(kvp__route_cand *c, double score, double k0, double k1,
                     double k2) {
  c->score = score;
  c->key[0] = k0, c->key[1] = k1, c->key[2] = k2;
}

static double pending_tokens(const kvp_router *r, uint32_t w) {
  return (double)r->load[w].prefill_tokens + (double)r->ws[w].tokens;
}

static void pick_round_robin(kvp_router *r, const route_ctx *x, pick *p) {
  (void)x;
  uint32_t start = (uint32_t)(r->rr_next % r->n), w = start;
  while (!online(r, w))
    w = (w + 1) % r->n;
  p->chosen = w;
  p->reason = KVP_REASON_ROUND_ROBIN;
  for (uint32_t v = 0; v < r->n; v++) { /* receipt order: the rotation */
    double d = (double)((v + r->n - w) % r->n);
    set_keys(&r->cand[v], d, d, 0.0, 0.0);
  }
}

/* least_loaded: fewest pending prefill tokens (reported + the router's own
 * in flight), then fewest requests (queued + running + in flight), then the
 * lowest index. */
static void pick_least_loaded(kvp_router *r, const route_ctx *x, pick *p) {
  (void)x;
  for (uint32_t w = 0; w < r->n; w++) {
    double t = pending_tokens(r, w);
    set_keys(&r->cand[w], t, t, (double)r->cand[w].load_req, 0.0);
  }
  p->chosen = argmin_key(r);
  p->reason = KVP_REASON_LEAST_LOADED;
}

/* prefix_greedy: longest matched prefix (any tier); ties as least_loaded. */
static void pick_prefix_greedy(kvp_router *r, const route_ctx *x, pick *p) {
  for (uint32_t w = 0; w < r->n; w++) {
    kvp__route_cand *c = &r->cand[w];
    double t = (double)(c->matched_blocks * r->bs);
    set_keys(c, t, -t, pending_tokens(r, w), (double)c->load_req);
  }
  p->chosen = argmin_key(r);
  p->reason = KVP_REASON_PREFIX;
  if (r->cand[p->chosen].matched_blocks == 0)
    p->reason = KVP_REASON_LEAST_LOADED;
  (void)x;
}

/* SGLang cache_aware: load = queued + running + in-flight requests. */
static void pick_sglang(kvp_router *r, const route_ctx *x, pick *p) {
  double lo = INFINITY, hi = -INFINITY;
  for (uint32_t w = 0; w < r->n; w++) {
    double l = (double)r->cand[w].load_req;
    set_keys(&r->cand[w], l, l, 0.0, 0.0);
    if (online(r, w))
      lo = fmin(lo, l), hi = fmax(hi, l);
  }
  const kvp_router_opts *o = &r->o;
  if (hi - lo > o->sglang_balance_abs && hi > o->sglang_balance_rel * lo) {
    p->chosen = argmin_key(r), p->reason = KVP_REASON_LEAST_LOADED;
    snprintf(p->detail, sizeof p->detail,
             "imbalanced (max load %.0f - min %.0f > %.0f and > %.2gx); "
             "shortest queue",
             hi, lo, o->sglang_balance_abs, o->sglang_balance_rel);
    return;
  }
  for (uint32_t w = 0; w < r->n; w++) {
    double t = (double)(r->cand[w].matched_blocks * r->bs);
    double rate = x->n_tokens ? t / (double)x->n_tokens : 0.0;
    set_keys(&r->cand[w], rate, -rate, 0.0, 0.0);
  }
  uint32_t best = argmin_key(r);
  double rate = r->cand[best].score;
  if (rate > o->sglang_cache_threshold) {
    p->chosen = best, p->reason = KVP_REASON_PREFIX;
    snprintf(p->detail, sizeof p->detail, "match rate %.3f > %.2g", rate,
             o->sglang_cache_threshold);
    return;
  }
  for (uint32_t w = 0; w < r->n; w++) {
    double l = (double)r->cand[w].load_req;
    set_keys(&r->cand[w], l, l, 0.0, 0.0);
  }
  p->chosen = argmin_key(r), p->reason = KVP_REASON_LEAST_LOADED;
  snprintf(p->detail, sizeof p->detail,
           "best match rate %.3f <= %.2g; least loaded", rate,
           o->sglang_cache_threshold);
}

/* llm-d: 3 x prefix + 2 x (1 - kv util) + 2 x queue score, max wins. */
static void pick_llmd(kvp_router *r, const route_ctx *x, pick *p) {
  double qlo = INFINITY, qhi = -INFINITY;
  for (uint32_t w = 0; w < r->n; w++)
    if (online(r, w)) {
      double q = (double)r->load[w].queued_requests;
      qlo = fmin(qlo, q), qhi = fmax(qhi, q);
    }
  double best = -INFINITY;
  for (uint32_t w = 0; w < r->n; w++) {
    kvp__route_cand *c = &r->cand[w];
    double q = (double)r->load[w].queued_requests;
    double prefix = x->req->n_blocks
                        ? (double)c->matched_blocks / (double)x->req->n_blocks
                        : 0.0;
    double qs = qhi > qlo ? (qhi - q) / (qhi - qlo) : 1.0;
    double s = r->o.llmd_w_prefix * prefix +
               r->o.llmd_w_kv * (1.0 - r->load[w].kv_util) +
               r->o.llmd_w_queue * qs;
    set_keys(c, s, -s, 0.0, 0.0);
    if (online(r, w))
      best = fmax(best, s);
  }
  p->chosen =
      tie_pick(r, x, best - 1e-12 * fmax(1.0, fabs(best)), true, &p->n_tied);
  p->reason = KVP_REASON_SCORE;
  const kvp__route_cand *c = &r->cand[p->chosen];
  double q = (double)r->load[p->chosen].queued_requests;
  snprintf(p->detail, sizeof p->detail,
           "score %.4g = %g x prefix %.3f + %g x kv %.3f + %g x queue %.3f",
           c->score, r->o.llmd_w_prefix,
           x->req->n_blocks ? (double)c->matched_blocks / x->req->n_blocks
                            : 0.0,
           r->o.llmd_w_kv, 1.0 - r->load[p->chosen].kv_util, r->o.llmd_w_queue,
           qhi > qlo ? (qhi - q) / (qhi - qlo) : 1.0);
}

/* Dynamo: prefill_load_scale x max(prefill blocks - tier credits, 0) + decode
 * blocks; argmin at temperature 0, else softmax over min-max normalised
 * costs, sampled from hash(seed, replica, request). */
static double dynamo_cost(const kvp_router *r, const route_ctx *x, uint32_t w,
                          double *prefill_out) {
  const kvp__route_cand *c = &r->cand[w];
  double raw = (pending_tokens(r, w) + (double)x->n_tokens) / r->bs;
  double credit = 0.0;
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    credit += r->o.dynamo_credit[k] * c->m[k];
  double prefill = fmax(raw - credit, 0.0);
  double decode = (double)r->load[w].decode_blocks + (double)r->ws[w].blocks +
                  (double)x->req_blocks;
  *prefill_out = prefill;
  return r->o.dynamo_prefill_scale * prefill + decode;
}

static uint32_t softmax_pick(const kvp_router *r, const route_ctx *x, double lo,
                             double hi) {
  double t = r->o.dynamo_temperature, total = 0.0;
  for (uint32_t w = 0; w < r->n; w++)
    if (online(r, w))
      total += exp(-(hi > lo ? (r->cand[w].score - lo) / (hi - lo) : 0.0) / t);
  uint64_t h =
      kvp__mix64(tie_hash(r, x, KVP_WORKER_NONE) ^ 0x736f66746d6178ull);
  double u = (double)(h >> 11) * 0x1.0p-53 * total, acc = 0.0;
  uint32_t last = KVP_WORKER_NONE;
  for (uint32_t w = 0; w < r->n; w++) {
    if (!online(r, w))
      continue;
    acc += exp(-(hi > lo ? (r->cand[w].score - lo) / (hi - lo) : 0.0) / t);
    last = w;
    if (u < acc)
      return w;
  }
  return last; /* u rounded up to total */
}

static void pick_dynamo(kvp_router *r, const route_ctx *x, pick *p) {
  double lo = INFINITY, hi = -INFINITY, prefill;
  for (uint32_t w = 0; w < r->n; w++) {
    double cost = dynamo_cost(r, x, w, &prefill);
    set_keys(&r->cand[w], cost, cost, 0.0, 0.0);
    if (online(r, w))
      lo = fmin(lo, cost), hi = fmax(hi, cost);
  }
  p->reason = KVP_REASON_SAMPLED;
  if (r->o.dynamo_temperature > 0.0) {
    p->chosen = softmax_pick(r, x, lo, hi);
    snprintf(p->detail, sizeof p->detail, "softmax at temperature %.3g",
             r->o.dynamo_temperature);
    return;
  }
  p->chosen = tie_pick(r, x, lo + 1e-12 * fmax(1.0, lo), false, &p->n_tied);
  dynamo_cost(r, x, p->chosen, &prefill);
  snprintf(p->detail, sizeof p->detail,
           "lowest cost %.4g = %.3g x prefill %.4g + decode %.4g blocks",
           r->cand[p->chosen].score, r->o.dynamo_prefill_scale, prefill,
           r->cand[p->chosen].score - r->o.dynamo_prefill_scale * prefill);
}

typedef void (*pick_fn)(kvp_router *r, const route_ctx *x, pick *p);
static const pick_fn pickers[KVP_POLICY_COUNT_] = {
    pick_kvplane, pick_round_robin, pick_least_loaded, pick_prefix_greedy,
    pick_sglang,  pick_llmd,        pick_dynamo};

/* ---- the decision -------------------------------------------------------- */
static void cand_out(const kvp_router *r, uint32_t w, kvp_route_candidate *o) {
  const kvp__route_cand *c = &r->cand[w];
  o->worker = w;
  o->flags = c->cflags;
  o->matched_tokens = c->matched_blocks * r->bs;
  o->reused_tokens = c->reused_blocks * r->bs;
  o->queue_s = c->queue_s, o->recompute_s = c->recompute_s;
  o->load_s = c->load_s, o->total_s = c->total_s;
  o->score = c->score;
}

/* One pass over the online workers other than the chosen one: the best
 * KVP_ROUTE_TOP - 1 in the policy's order (insertion into a tiny sorted
 * array) and the longest match among them.  out[0] is the runner-up. */
static uint32_t rank_others(const kvp_router *r, uint32_t chosen,
                            uint32_t out[KVP_ROUTE_TOP - 1],
                            uint64_t *elsewhere_blocks) {
  uint32_t n = 0;
  *elsewhere_blocks = 0;
  for (uint32_t w = 0; w < r->n; w++) {
    if (w == chosen || !online(r, w))
      continue;
    const kvp__route_cand *c = &r->cand[w];
    if (c->matched_blocks > *elsewhere_blocks)
      *elsewhere_blocks = c->matched_blocks;
    uint32_t i = n < KVP_ROUTE_TOP - 1 ? n++ : KVP_ROUTE_TOP - 1;
    for (; i > 0 && key_less(c, &r->cand[out[i - 1]]); i--)
      if (i < KVP_ROUTE_TOP - 1)
        out[i] = out[i - 1];
    if (i < KVP_ROUTE_TOP - 1)
      out[i] = w;
  }
  for (uint32_t i = n; i < KVP_ROUTE_TOP - 1; i++)
    out[i] = KVP_WORKER_NONE;
  return n;
}

/* top[0] = chosen, then the next best online workers in the policy's order. */
static void fill_top(const kvp_router *r, uint32_t chosen,
                     const uint32_t others[KVP_ROUTE_TOP - 1], uint32_t n,
                     kvp_decision *d) {
  cand_out(r, chosen, &d->top[0]);
  for (uint32_t i = 0; i < n; i++)
    cand_out(r, others[i], &d->top[i + 1]);
  d->n_top = (uint8_t)(n + 1);
}

/* Split the reused prefix by tier (fastest first) and by class. */
static void fill_reuse(const kvp_router *r, const route_ctx *x,
                       const kvp__route_cand *c, kvp_decision *d) {
  uint64_t left = c->reused_blocks;
  for (int k = 0; k < KVP_TIER_COUNT_; k++) {
    uint64_t b = c->m[k] < left ? c->m[k] : left;
    d->matched_tokens[k] = (uint64_t)c->m[k] * r->bs;
    d->reused_tier_tokens[k] = b * r->bs;
    left -= b;
  }
  uint64_t u = c->reused_blocks, st = 0, se = 0;
  const kvp_classification *cls = x->req->cls;
  if (cls) {
    st = u < cls->stable_end ? u : cls->stable_end;
    se = (u < cls->semi_end ? u : cls->semi_end) - st;
  }
  d->reused_class_tokens[KVP_CLASS_STABLE] = st * r->bs;
  d->reused_class_tokens[KVP_CLASS_SEMI] = se * r->bs;
  d->reused_class_tokens[KVP_CLASS_VOLATILE] = (u - st - se) * r->bs;
  /* the prompt by class, blocks as the reuse split counts them; tail and
   * unclassified blocks volatile */
  uint64_t pst = cls ? (uint64_t)cls->stable_end * r->bs : 0;
  uint64_t pse = cls ? (uint64_t)(cls->semi_end - cls->stable_end) * r->bs : 0;
  d->prompt_class_tokens[KVP_CLASS_STABLE] = pst;
  d->prompt_class_tokens[KVP_CLASS_SEMI] = pse;
  d->prompt_class_tokens[KVP_CLASS_VOLATILE] = x->n_tokens - pst - pse;
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    d->load_bytes[k] = (uint64_t)((double)d->reused_tier_tokens[k] * r->kvb);
}

/* Returns the runner-up (or KVP_WORKER_NONE), which the reason quotes. */
static uint32_t fill_decision(const kvp_router *r, const route_ctx *x,
                              const pick *p, kvp_decision *d) {
  const kvp__route_cand *c = &r->cand[p->chosen];
  memset(d, 0, sizeof *d);
  d->worker = p->chosen;
  d->policy = (uint8_t)r->o.policy;
  d->reason = p->reason;
  d->flags = p->flags;
  d->n_eligible = x->n_online;
  d->block_size = r->bs;
  d->hashed_tokens = (uint64_t)x->req->n_blocks * r->bs;
  if (x->req->flags & KVP_ROUTE_SEEN) {
    d->flags |= KVP_DECISION_SEEN;
    d->seen_blocks = x->req->seen_blocks;
  }
  d->request_id = x->id;
  d->session_id = x->req->session_id;
  d->tenant = x->req->tenant;
  d->prompt_tokens = x->n_tokens;
  fill_reuse(r, x, c, d);
  d->avoided_tokens = c->reused_blocks * r->bs;
  d->uncached_tokens = x->n_tokens - d->avoided_tokens;
  d->avoided_flops = flops_range(r->f_lin, r->f_att, 0, d->avoided_tokens);
  d->avoided_s = d->avoided_flops * r->inv_f_eff;
  d->load_s = c->load_s;
  uint32_t others[KVP_ROUTE_TOP - 1];
  uint64_t elsewhere;
  uint32_t n = rank_others(r, p->chosen, others, &elsewhere);
  d->matched_elsewhere_tokens = elsewhere * r->bs;
  fill_top(r, p->chosen, others, n, d);
  return others[0];
}

/* After success only: in flight, session memory, round robin, id counter. */
static void commit(kvp_router *r, const route_ctx *x, kvp_decision *d) {
  kvp__inflight *old = if_find(r, d->request_id);
  if (old != NULL) { /* a retry of a request still in flight moves it */
    if_remove(r, old);
    d->flags |= KVP_DECISION_REPLACED;
  }
  kvp__inflight e = {
      d->request_id,      d->worker,     0,
      d->uncached_tokens, x->req_blocks, r->cand[d->worker].recompute_s};
  if (!if_insert(r, &e, x->req->now_ns,
                 (x->req->flags & KVP_ROUTE_NOW) != 0, x->decay))
    d->flags |= KVP_DECISION_UNTRACKED;
  if (x->req->session_id) {
    kvp__session *s = session_slot(r, x->req->session_id);
    s->id = x->req->session_id, s->worker = d->worker;
  }
  r->rr_next = (uint64_t)d->worker + 1;
  if (x->req->request_id == 0)
    r->next_id++;
}

static void decision_none(kvp_decision *out) {
  if (out != NULL) {
    memset(out, 0, sizeof *out);
    out->worker = KVP_WORKER_NONE;
  }
}

/* The chosen worker's match from fn (kvp_router_route_chosen), its terms
 * recomputed with it; the picker runs again so that its keys and score for
 * the chosen are those of that match (its choice reads no match: the same
 * worker).  A failing fn leaves the worker matching nothing, flagged as a
 * failed index query; a match out of range is the caller's error. */
static int chosen_match(kvp_router *r, const route_ctx *x, kvp_match_fn fn,
                        void *ctx, pick *p) {
  kvp_worker_match m = {.worker = p->chosen};
  if (fn(ctx, p->chosen, &m) < 0) {
    p->flags |= KVP_DECISION_NO_INDEX;
    return 0;
  }
  uint64_t sum = 0;
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    sum += m.blocks[k];
  if (sum > x->req->n_blocks || (m.flags & ~KVP_MATCH_UNCERTAIN))
    return req_bad("match_fn(worker %u): %" PRIu64 " blocks of a %zu-block "
                   "chain, flags 0x%x", p->chosen, sum, x->req->n_blocks,
                   m.flags);
  kvp__route_cand *c = &r->cand[p->chosen];
  memcpy(c->m, m.blocks, sizeof c->m);
  c->mflags = m.flags;
  cand_terms(r, x, p->chosen);
  pick again = *p;
  pickers[r->o.policy](r, x, &again);
  if (again.chosen != p->chosen)
    return KVP_ESTATE; /* unreachable: the picker reads no match */
  *p = again;
  return 0;
}

/* The decision itself; r, req and out are not NULL.  fn non-NULL: no
 * matches given, the chosen worker's asked for after the choice
 * (kvp_router_route_chosen). */
static int route_pick(kvp_router *r, const kvp_route_request *req,
                      const kvp_worker_match *matches, size_t n_matches,
                      kvp_match_fn fn, void *ctx, uint8_t flags,
                      kvp_decision *out) {
  route_ctx x;
  int rc = ctx_init(r, req, &x);
  if (rc == 0)
    rc = load_matches(r, &x, matches, n_matches);
  if (rc < 0)
    return rc;
  if (x.n_online == 0)
    return KVP_ESTATE;
  for (uint32_t w = 0; w < r->n; w++)
    cand_terms(r, &x, w);
  pick p = {KVP_WORKER_NONE, 0, flags, KVP_WORKER_NONE, 0, {0}};
  pickers[r->o.policy](r, &x, &p);
  if (p.chosen >= r->n || !online(r, p.chosen))
    return KVP_ESTATE; /* unreachable: every picker returns an online worker */
  if (fn != NULL && (rc = chosen_match(r, &x, fn, ctx, &p)) < 0)
    return rc;
  uint32_t second = fill_decision(r, &x, &p, out);
  uint32_t g =
      p.best_unguarded == KVP_WORKER_NONE ? p.chosen : p.best_unguarded;
  kvp__route_why why = {r,
                        req,
                        p.best_unguarded,
                        second,
                        p.n_tied,
                        r->cand[g].guard_ref,
                        p.detail[0] ? p.detail : NULL};
  kvp__route_reason(&why, out); /* before commit: the figures it quotes */
  commit(r, &x, out);
  return 0;
}

/* route_pick with the request's eligible workers in force (online()). */
static int route_core(kvp_router *r, const kvp_route_request *req,
                      const kvp_worker_match *matches, size_t n_matches,
                      kvp_match_fn fn, void *ctx, uint8_t flags,
                      kvp_decision *out) {
  r->elig = req->n_eligible_words ? req->eligible : NULL;
  r->elig_words = req->n_eligible_words;
  int rc = route_pick(r, req, matches, n_matches, fn, ctx, flags, out);
  r->elig = NULL;
  r->elig_words = 0;
  return rc;
}

int kvp_router_route_matches(kvp_router *r, const kvp_route_request *req,
                             const kvp_worker_match *matches, size_t n_matches,
                             kvp_decision *out) {
  decision_none(out);
  if (r == NULL || req == NULL || out == NULL)
    return KVP_EINVAL;
  return route_core(r, req, matches, n_matches, NULL, NULL, 0, out);
}

int kvp_router_route_chosen(kvp_router *r, const kvp_route_request *req,
                            kvp_match_fn fn, void *ctx, kvp_decision *out) {
  decision_none(out);
  if (r == NULL || req == NULL || out == NULL || fn == NULL)
    return KVP_EINVAL;
  if (kvp_policy_compares_matches(r->o.policy))
    return KVP_ENOTSUP;
  return route_core(r, req, NULL, 0, fn, ctx, KVP_DECISION_CHOSEN_ONLY, out);
}

int kvp_router_match(kvp_index *ix, const kvp_key *keys, size_t n_blocks,
                     uint64_t now_ns, uint32_t n_workers,
                     kvp_index_match *scratch, kvp_worker_match *out,
                     size_t cap) {
  if (ix == NULL || (cap > 0 && (scratch == NULL || out == NULL)))
    return KVP_EINVAL;
  size_t nq = n_blocks < KVP_INDEX_CHAIN_MAX ? n_blocks : KVP_INDEX_CHAIN_MAX;
  int got = kvp_index_query(ix, keys, nq, now_ns, scratch, cap);
  if (got < 0)
    return got;
  size_t k = 0;
  for (size_t i = 0; i < (size_t)got && i < cap; i++) {
    const kvp_index_match *im = &scratch[i];
    if (im->worker >= n_workers) /* workers the caller cannot route to */
      continue;
    kvp_worker_match *m = &out[k++];
    memset(m, 0, sizeof *m);
    m->worker = im->worker;
    memcpy(m->blocks, im->tier_blocks, sizeof m->blocks);
    m->blocks[KVP_TIER_HBM] += im->routed_blocks; /* where the prefill left them */
    m->flags = (im->uncertain || im->routed_blocks) ? KVP_MATCH_UNCERTAIN : 0;
  }
  return (int)k;
}

int kvp_router_record_pending(kvp_index *ix, const kvp_route_request *req,
                              const kvp_decision *d, uint32_t pending_ms,
                              uint64_t now_ns) {
  if (ix == NULL || req == NULL || d == NULL ||
      (req->keys == NULL && req->n_blocks > 0))
    return KVP_EINVAL;
  if (pending_ms == 0 || d->worker == KVP_WORKER_NONE || d->n_top == 0 ||
      d->top[0].worker != d->worker || d->block_size == 0)
    return 0;
  size_t nq =
      req->n_blocks < KVP_INDEX_CHAIN_MAX ? req->n_blocks : KVP_INDEX_CHAIN_MAX;
  uint64_t held = d->top[0].matched_tokens / d->block_size;
  if (held >= nq)
    return 0;
  double life_s = d->top[0].total_s + pending_ms * 1e-3;
  uint64_t life_ns = life_s < 3600.0 ? (uint64_t)(life_s * 1e9) + 1
                                     : 3600000000000ull;
  int rc = kvp_index_record_pending(ix, d->worker, req->keys + held, nq - held,
                                    now_ns, life_ns);
  if (rc < 0)
    KVP_LOGW(MOD, "record_pending(worker %u): %s", d->worker,
             kvp_err_name(rc));
  return rc < 0 ? rc : 0;
}

int kvp_router_route(kvp_router *r, kvp_index *ix, const kvp_route_request *req,
                     uint64_t now_ns, kvp_decision *out) {
  decision_none(out);
  if (r == NULL || ix == NULL || req == NULL || out == NULL)
    return KVP_EINVAL;
  int rc = ctx_validate(r, req);
  if (rc < 0)
    return rc;
  size_t nq =
      req->n_blocks < KVP_INDEX_CHAIN_MAX ? req->n_blocks : KVP_INDEX_CHAIN_MAX;
  int got = kvp_router_match(ix, req->keys, req->n_blocks, now_ns, r->n, r->ixm,
                             r->wm, r->n);
  uint8_t flags = got < 0 ? KVP_DECISION_NO_INDEX : 0;
  if (got < 0) /* fail open: a miss, never a failed request */
    KVP_LOGW(MOD, "index query failed (%s): routing on load only",
             kvp_err_name(got));
  rc = route_core(r, req, r->wm, got > 0 ? (size_t)got : 0, NULL, NULL, flags,
                  out);
  if (rc < 0)
    return rc;
  if (!r->o.record_routed) {
    if (kvp_router_record_pending(ix, req, out, r->o.pending_ms, now_ns) < 0)
      out->flags |= KVP_DECISION_NOT_RECORDED;
    return 0;
  }
  rc = kvp_index_record_routed(ix, out->worker, req->keys, nq, now_ns);
  if (rc < 0) {
    KVP_LOGW(MOD, "record_routed(worker %u): %s", out->worker,
             kvp_err_name(rc));
    out->flags |= KVP_DECISION_NOT_RECORDED;
  }
  return 0;
}
