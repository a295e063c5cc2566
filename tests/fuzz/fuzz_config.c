/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the YAML config loader and binder (core/config) on
 * arbitrary bytes.  Failures must explain themselves; a loaded config binds
 * a section of every field type, the router's and kvtier's sections, and
 * checks for unbound sections. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvplane.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void need_reason(const char *err, size_t cap) {
  if (err[0] == '\0' || memchr(err, '\0', cap) == NULL)
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char err[256] = "";
  kvp_config *c = NULL;
  int rc = kvp_config_load_mem(data, size, "fuzz.yaml", NULL, &c, err,
                               sizeof err);
  if (rc < 0) {
    if (c != NULL)
      abort();
    need_reason(err, sizeof err);
    return 0;
  }
  uint64_t u = 0, sz = 0;
  double d = 0, dur = 0;
  bool b = false;
  char s[32] = "", l[32] = "";
  const kvp_config_field f[] = {KVP_CFG_U64("workers", &u, 1, 4096),
                                KVP_CFG_F64("hbm_gb", &d, 0, 1e6),
                                KVP_CFG_BOOL("no_shared_prefix", &b),
                                KVP_CFG_STR("format", s, sizeof s),
                                KVP_CFG_LIST("policies", l, sizeof l, 1, 4),
                                KVP_CFG_SIZE("bytes", &sz, 4096, 1e12),
                                KVP_CFG_DURATION("delay", &dur, 0, 10, 1000)};
  const char *names[] = {"cluster", "replay"};
  for (size_t i = 0; i < 2; i++) {
    kvp_config_section sec = {names[i], f, sizeof f / sizeof *f};
    err[0] = '\0';
    if (kvp_config_bind(c, &sec, err, sizeof err) < 0)
      need_reason(err, sizeof err);
  }
  if (u > 4096 || (d < 0 || d > 1e6) || strnlen(s, sizeof s) == sizeof s ||
      strnlen(l, sizeof l) == sizeof l || (sz != 0 && sz < 4096) ||
      sz > (uint64_t)1e12 || dur < 0 || dur > 10 * (1 + 1e-12))
    abort();
  /* the router's model:, gpu:, routing: */
  kvp_router_opts ro = {0};
  char pol[64];
  err[0] = '\0';
  if (kvp_router_opts_from_config(c, &ro, pol, sizeof pol, err, sizeof err) < 0)
    need_reason(err, sizeof err);
  else if (ro.model.kv_heads > ro.model.heads || ro.block_size > 65536 ||
           ro.gpu.latency_s[KVP_TIER_DRAM] > 1 + 1e-9 || ro.guard > 1000)
    abort();
  /* kvtier's `tiers:` binding: refusals explain themselves; what binds is
   * inside kvp_tier_create's limits */
  kvp_tier_opts to = {0};
  char dir[64];
  err[0] = '\0';
  if (kvp_tier_opts_from_config(c, &to, dir, sizeof dir, err, sizeof err) < 0)
    need_reason(err, sizeof err);
  if (to.queue_depth > 1024 || to.dram_fraction > 0.9 ||
      to.nvme_fraction > 0.95 || to.no_promote > 1 ||
      (unsigned)to.policy >= KVP_TIER_POLICY_COUNT_ ||
      (unsigned)to.io_backend > KVP_TIER_IO_POSIX ||
      (unsigned)to.huge_pages > KVP_TIER_HUGE_NONE ||
      (to.nvme_dir != NULL && strnlen(to.nvme_dir, sizeof dir) == sizeof dir))
    abort();
  err[0] = '\0';
  if (kvp_config_check_unbound(c, NULL, 0, err, sizeof err) < 0)
    need_reason(err, sizeof err);
  kvp_config_destroy(c);
  return 0;
}
