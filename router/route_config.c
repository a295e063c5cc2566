/* SPDX-License-Identifier: Apache-2.0 */
/* The YAML `model:`, `gpu:` and `routing:` sections bound to kvp_router_opts
 * (core's config loader parses; this file owns the keys, their units, bounds
 * and messages), shared by kvplane-bench and a router daemon. */
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "core_internal.h"
#include "kvplane/config.h"
#include "kvplane/route.h"

#define NFIELDS(a) (sizeof(a) / sizeof *(a))

/* Everything a binding collects before *o changes (all or nothing). */
typedef struct route_cfg {
  uint64_t layers, heads, kv_heads, head_dim, dtype, block_size;
  double params_b;
  double tflops, eff, bw_gbps[KVP_TIER_COUNT_], lat_s[KVP_TIER_COUNT_];
  double overhead_s;
  double guard, aff, tie, temp, w_prefix, w_kv, w_queue;
  uint64_t gmin;
  double pending_s;
  bool decay;
  char guard_load[16];
} route_cfg;

#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 5, 6)))
#endif
static int bad(const kvp_config *c, const char *sec, char *err, size_t cap,
               const char *fmt, ...) {
  static const char *const keys[] = {"layers", "heads", "kv_heads",
                                     "head_dim", "dtype_bytes",
                                     "params_billion"};
  const char *name = "";
  int line = 0;
  for (size_t i = 0; i < NFIELDS(keys) && line <= 0; i++)
    line = kvp_config_key_line(c, sec, keys[i], &name);
  va_list ap;
  va_start(ap, fmt);
  int rc = kvp__config_verr(err, cap, name, line, sec, NULL, fmt, ap);
  va_end(ap);
  return rc;
}

static int bind_model(kvp_config *c, route_cfg *r, char *err, size_t cap) {
  const kvp_config_field f[] = {
      KVP_CFG_U64("layers", &r->layers, 1, 65536),
      KVP_CFG_U64("heads", &r->heads, 1, 65536),
      KVP_CFG_U64("kv_heads", &r->kv_heads, 1, 65536),
      KVP_CFG_U64("head_dim", &r->head_dim, 1, 65536),
      KVP_CFG_U64("dtype_bytes", &r->dtype, 1, 16),
      KVP_CFG_F64("params_billion", &r->params_b, 0.001, 1e5),
      KVP_CFG_U64("block_size", &r->block_size, 1, 1u << 16)};
  const kvp_config_section s = {"model", f, NFIELDS(f)};
  return kvp_config_bind(c, &s, err, cap);
}

static int bind_gpu(kvp_config *c, route_cfg *r, char *err, size_t cap) {
  const kvp_config_field f[] = {
      KVP_CFG_F64("tflops", &r->tflops, 0.001, 1e8),
      KVP_CFG_F64("efficiency", &r->eff, 0.01, 1),
      KVP_CFG_F64("hbm_bandwidth_gbps", &r->bw_gbps[KVP_TIER_HBM], 1, 1e7),
      KVP_CFG_F64("dram_bandwidth_gbps", &r->bw_gbps[KVP_TIER_DRAM], 0.001,
                  1e6),
      KVP_CFG_F64("nvme_bandwidth_gbps", &r->bw_gbps[KVP_TIER_NVME], 0.001,
                  1e6),
      KVP_CFG_DURATION("dram_latency_us", &r->lat_s[KVP_TIER_DRAM], 1e-9, 1,
                       1000000),
      KVP_CFG_DURATION("nvme_latency_us", &r->lat_s[KVP_TIER_NVME], 1e-9, 1,
                       1000000),
      KVP_CFG_DURATION("prefill_overhead_s", &r->overhead_s, 0, 60, 1)};
  const kvp_config_section s = {"gpu", f, NFIELDS(f)};
  return kvp_config_bind(c, &s, err, cap);
}

/* routing.guard_load: "prefill" | "requests" -> kvp_guard_load, or -1. */
static int guard_load_of(const char *v) {
  return strcmp(v, "prefill") == 0    ? KVP_GUARD_LOAD_PREFILL
         : strcmp(v, "requests") == 0 ? KVP_GUARD_LOAD_REQUESTS
                                      : -1;
}

static int bind_routing(kvp_config *c, route_cfg *r, char *pol, size_t pcap,
                        char *err, size_t cap) {
  const kvp_config_field f[] = {
      KVP_CFG_LIST("policies", pol, pcap, 1, 64),
      KVP_CFG_F64("guard", &r->guard, 1, 1000),
      KVP_CFG_U64("guard_min_load", &r->gmin, 1, 1u << 20),
      KVP_CFG_STR("guard_load", r->guard_load, sizeof r->guard_load),
      KVP_CFG_DURATION("pending", &r->pending_s, 0, 3600, 1),
      KVP_CFG_BOOL("inflight_decay", &r->decay),
      KVP_CFG_F64("affinity_eps_rel", &r->aff, 0, 10),
      KVP_CFG_F64("tie_rel", &r->tie, 0, 10),
      KVP_CFG_F64("dynamo_temperature", &r->temp, 0, 100),
      KVP_CFG_F64("llmd_w_prefix", &r->w_prefix, 0, 1000),
      KVP_CFG_F64("llmd_w_kv", &r->w_kv, 0, 1000),
      KVP_CFG_F64("llmd_w_queue", &r->w_queue, 0, 1000)};
  const kvp_config_section s = {"routing", f, NFIELDS(f)};
  int n = kvp_config_bind(c, &s, err, cap);
  if (n >= 0 && r->guard_load[0] != '\0' && guard_load_of(r->guard_load) < 0) {
    const char *name = "";
    int line = kvp_config_key_line(c, "routing", "guard_load", &name);
    if (cap > 0)
      snprintf(err, cap, "%s:%d: routing.guard_load: '%s': expected prefill "
               "or requests", name, line, r->guard_load);
    return KVP_EINVAL;
  }
  return n;
}

/* The six model keys come together or not at all; then the spec must be
 * one the cost model accepts. */
static int model_spec(const kvp_config *c, const route_cfg *r,
                      kvp_model_spec *m, char *err, size_t cap) {
  bool any = r->layers || r->heads || r->kv_heads || r->head_dim ||
             r->dtype || r->params_b;
  bool all = r->layers && r->heads && r->kv_heads && r->head_dim &&
             r->dtype && r->params_b;
  if (!any)
    return 0;
  if (!all)
    return bad(c, "model", err, cap, "needs all of layers, heads, kv_heads, "
               "head_dim, dtype_bytes, params_billion (or none of them)");
  *m = (kvp_model_spec){(uint32_t)r->layers,   (uint32_t)r->heads,
                        (uint32_t)r->kv_heads, (uint32_t)r->head_dim,
                        (uint32_t)r->dtype,    0,
                        r->params_b * 1e9,     {0, 0, 0, 0}};
  if (kvp_model_kv_bytes_per_token(m) <= 0)
    return bad(c, "model", err, cap, "kv_heads must be <= heads");
  return 1;
}

/* A key present in the config: its value replaces the caller's. */
static bool has(const kvp_config *c, const char *sec, const char *key) {
  return kvp_config_key_line(c, sec, key, NULL) > 0;
}

static void apply_gpu(const kvp_config *c, const route_cfg *r,
                      kvp_gpu_spec *g) {
  static const char *const bw_keys[KVP_TIER_COUNT_] = {
      "hbm_bandwidth_gbps", "dram_bandwidth_gbps", "nvme_bandwidth_gbps",
      NULL};
  static const char *const lat_keys[KVP_TIER_COUNT_] = {
      NULL, "dram_latency_us", "nvme_latency_us", NULL};
  if (has(c, "gpu", "tflops"))
    g->flops = r->tflops * 1e12;
  if (has(c, "gpu", "efficiency"))
    g->efficiency = r->eff;
  if (has(c, "gpu", "prefill_overhead_s"))
    g->prefill_overhead_s = r->overhead_s;
  for (int k = 0; k < KVP_TIER_COUNT_; k++) {
    if (bw_keys[k] != NULL && has(c, "gpu", bw_keys[k]))
      g->bw[k] = r->bw_gbps[k] * 1e9;
    if (lat_keys[k] != NULL && has(c, "gpu", lat_keys[k]))
      g->latency_s[k] = r->lat_s[k];
  }
}

static void apply_routing(const kvp_config *c, const route_cfg *r,
                          kvp_router_opts *o) {
  if (has(c, "routing", "guard"))
    o->guard = r->guard;
  if (has(c, "routing", "guard_min_load"))
    o->guard_min_load = (uint32_t)r->gmin;
  if (r->guard_load[0] != '\0')
    o->guard_load = (uint32_t)guard_load_of(r->guard_load);
  if (has(c, "routing", "pending")) /* whole ms; a positive value >= 1 ms */
    o->pending_ms = r->pending_s > 0 && r->pending_s < 1e-3
                        ? 1u : (uint32_t)(r->pending_s * 1e3 + 0.5);
  if (has(c, "routing", "inflight_decay"))
    o->inflight_decay = r->decay;
  if (has(c, "routing", "affinity_eps_rel"))
    o->affinity_eps_rel = r->aff;
  if (has(c, "routing", "tie_rel"))
    o->tie_rel = r->tie;
  if (has(c, "routing", "dynamo_temperature"))
    o->dynamo_temperature = r->temp;
  if (has(c, "routing", "llmd_w_prefix"))
    o->llmd_w_prefix = r->w_prefix;
  if (has(c, "routing", "llmd_w_kv"))
    o->llmd_w_kv = r->w_kv;
  if (has(c, "routing", "llmd_w_queue"))
    o->llmd_w_queue = r->w_queue;
}

int kvp_router_opts_from_config(kvp_config *c, kvp_router_opts *o,
                                char *policies, size_t policies_cap,
                                char *err, size_t cap) {
  if (c == NULL || o == NULL || (policies == NULL && policies_cap > 0)) {
    if (cap > 0)
      snprintf(err, cap, "kvp_router_opts_from_config: invalid arguments");
    return KVP_EINVAL;
  }
  route_cfg r = {0};
  char pol[1024] = "";
  int n[3];
  if ((n[0] = bind_model(c, &r, err, cap)) < 0 ||
      (n[1] = bind_gpu(c, &r, err, cap)) < 0 ||
      (n[2] = bind_routing(c, &r, pol, sizeof pol, err, cap)) < 0)
    return KVP_EINVAL;
  kvp_model_spec m = o->model;
  int rc = model_spec(c, &r, &m, err, cap);
  if (rc < 0)
    return rc;
  if (pol[0] != '\0' && strlen(pol) >= policies_cap) {
    const char *name = "";
    int line = kvp_config_key_line(c, "routing", "policies", &name);
    if (cap > 0)
      snprintf(err, cap, "%s:%d: routing.policies: longer than %zu bytes",
               name, line, policies_cap ? policies_cap - 1 : 0);
    return KVP_EINVAL;
  }
  o->model = m;
  if (r.block_size != 0)
    o->block_size = (uint32_t)r.block_size;
  apply_gpu(c, &r, &o->gpu);
  apply_routing(c, &r, o);
  if (pol[0] != '\0')
    memcpy(policies, pol, strlen(pol) + 1);
  return n[0] + n[1] + n[2];
}
