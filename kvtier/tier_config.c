/* SPDX-License-Identifier: Apache-2.0 */
/* The YAML `tiers:` section bound to kvp_tier_opts (core's config loader
 * parses; this file owns the keys, their bounds and their messages). */
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "core_internal.h"
#include "kvplane/config.h"
#include "kvplane/tier.h"

#define SEC "tiers"
#define DIR_MAX 4096

#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 5, 6)))
#endif
static int bad(kvp_config *c, const char *key, char *err, size_t cap,
               const char *fmt, ...) {
  const char *name = "";
  int line = kvp_config_key_line(c, SEC, key, &name);
  va_list ap;
  va_start(ap, fmt);
  int rc = kvp__config_verr(err, cap, name, line, SEC, key, fmt, ap);
  va_end(ap);
  return rc;
}

/* v among names[0..n) -> its index; else the error. */
static int pick(kvp_config *c, const char *key, const char *v,
                const char *const *names, int n, int *out, char *err,
                size_t cap) {
  if (v[0] == '\0')
    return 0;
  for (int i = 0; i < n; i++)
    if (strcmp(v, names[i]) == 0) {
      *out = i;
      return 0;
    }
  char list[128] = "";
  for (int i = 0, l = 0; i < n && l >= 0 && (size_t)l < sizeof list; i++)
    l += snprintf(list + l, sizeof list - (size_t)l, "%s%s", i ? ", " : "",
                  names[i]);
  return bad(c, key, err, cap, "expected one of %s, got '%.64s'", list, v);
}

static double hi_of(kvp_tier_opt opt) {
  int64_t lo, hi;
  return kvp_tier_opt_bounds(NULL, opt, &lo, &hi) == 0 ? (double)hi : 0;
}

static double lo_of(kvp_tier_opt opt) {
  int64_t lo, hi;
  return kvp_tier_opt_bounds(NULL, opt, &lo, &hi) == 0 ? (double)lo : 0;
}

int kvp_tier_opts_from_config(kvp_config *c, kvp_tier_opts *o, char *dir,
                              size_t dir_cap, char *err, size_t cap) {
  if (c == NULL || o == NULL) {
    if (cap > 0)
      snprintf(err, cap, "kvp_tier_opts_from_config: invalid arguments");
    return KVP_EINVAL;
  }
  uint64_t dram = o->dram_bytes, nvme = o->nvme_bytes, qd = o->queue_depth,
           maxb = o->max_block_bytes, slow = o->slow_io_us,
           vmin = o->volatile_nvme_min_hits, amin = o->admit_min_samples,
           hosts = o->host_stores;
  double dfrac = o->dram_fraction, nfrac = o->nvme_fraction,
         aww = o->admit_write_weight, pre = o->prefill_kv_bytes_per_s,
         rbw = o->nvme_read_bytes_per_s, wbw = o->nvme_write_bytes_per_s;
  bool promote = !o->no_promote;
  char huge[16] = "", io[16] = "", pol[16] = "", adm[16] = "", d[DIR_MAX] = "";
  const kvp_config_field f[] = {
      KVP_CFG_SIZE("dram_bytes", &dram, lo_of(KVP_TIER_OPT_DRAM_BYTES),
                  hi_of(KVP_TIER_OPT_DRAM_BYTES)),
      KVP_CFG_F64("dram_fraction", &dfrac, 0, 0.9),
      KVP_CFG_U64("host_stores", &hosts, 0, 256),
      KVP_CFG_STR("huge_pages", huge, sizeof huge),
      KVP_CFG_STR("nvme_dir", d, sizeof d),
      KVP_CFG_SIZE("nvme_bytes", &nvme, lo_of(KVP_TIER_OPT_NVME_BYTES),
                  hi_of(KVP_TIER_OPT_NVME_BYTES)),
      KVP_CFG_F64("nvme_fraction", &nfrac, 0, 0.95),
      KVP_CFG_U64("queue_depth", &qd, lo_of(KVP_TIER_OPT_QUEUE_DEPTH),
                  hi_of(KVP_TIER_OPT_QUEUE_DEPTH)),
      KVP_CFG_SIZE("max_block_bytes", &maxb, 4096, 256u << 20),
      KVP_CFG_STR("io_backend", io, sizeof io),
      KVP_CFG_U64("slow_io_us", &slow, 1, UINT32_MAX),
      KVP_CFG_STR("policy", pol, sizeof pol),
      KVP_CFG_U64("volatile_nvme_min_hits", &vmin,
                  lo_of(KVP_TIER_OPT_VOLATILE_NVME_MIN_HITS),
                  hi_of(KVP_TIER_OPT_VOLATILE_NVME_MIN_HITS)),
      KVP_CFG_BOOL("promote", &promote),
      KVP_CFG_STR("admission", adm, sizeof adm),
      KVP_CFG_F64("admit_write_weight", &aww, 0.001, 1000),
      KVP_CFG_U64("admit_min_samples", &amin,
                  lo_of(KVP_TIER_OPT_ADMIT_MIN_SAMPLES),
                  hi_of(KVP_TIER_OPT_ADMIT_MIN_SAMPLES)),
      KVP_CFG_F64("prefill_kv_bytes_per_s", &pre, 0, 1e15),
      KVP_CFG_F64("nvme_read_bytes_per_s", &rbw, 0, 1e13),
      KVP_CFG_F64("nvme_write_bytes_per_s", &wbw, 0, 1e13)};
  const kvp_config_section s = {SEC, f, sizeof f / sizeof *f};
  int n = kvp_config_bind(c, &s, err, cap);
  if (n <= 0)
    return n;
  static const char *const huge_names[] = {"auto", "thp", "none"};
  static const char *const io_names[] = {"auto", "uring", "posix"};
  static const char *const adm_names[] = {"gate", "hits", "all"};
  int hk = (int)o->huge_pages, ik = (int)o->io_backend, pk = (int)o->policy,
      ak = (int)o->admission;
  int rc = pick(c, "huge_pages", huge, huge_names, 3, &hk, err, cap);
  if (rc == 0)
    rc = pick(c, "io_backend", io, io_names, 3, &ik, err, cap);
  if (rc == 0)
    rc = pick(c, "admission", adm, adm_names, KVP_TIER_ADMIT_COUNT_, &ak, err,
              cap);
  if (rc == 0 && pol[0] != '\0') {
    kvp_tier_policy_kind k;
    if (kvp_tier_policy_parse(pol, &k) < 0)
      rc = bad(c, "policy", err, cap, "expected s3fifo or lru, got '%.64s'",
               pol);
    pk = (int)k;
  }
  if (rc == 0 && d[0] != '\0' && (dir == NULL || strlen(d) >= dir_cap))
    rc = bad(c, "nvme_dir", err, cap, "longer than %zu bytes",
             dir ? (dir_cap ? dir_cap - 1 : 0) : 0);
  if (rc < 0)
    return rc;
  o->dram_bytes = dram;
  o->dram_fraction = dfrac;
  o->host_stores = (uint32_t)hosts;
  o->huge_pages = (kvp_tier_huge)hk;
  if (d[0] != '\0') {
    memcpy(dir, d, strlen(d) + 1);
    o->nvme_dir = dir;
  }
  o->nvme_bytes = nvme;
  o->nvme_fraction = nfrac;
  o->queue_depth = (uint32_t)qd;
  o->max_block_bytes = maxb;
  o->io_backend = (kvp_tier_io_backend)ik;
  o->slow_io_us = (uint32_t)slow;
  o->policy = (kvp_tier_policy_kind)pk;
  o->volatile_nvme_min_hits = (uint32_t)vmin;
  o->no_promote = !promote;
  o->admission = (kvp_tier_admission)ak;
  o->admit_write_weight = aww;
  o->admit_min_samples = (uint32_t)amin;
  o->prefill_kv_bytes_per_s = pre;
  o->nvme_read_bytes_per_s = rbw;
  o->nvme_write_bytes_per_s = wbw;
  return n;
}
