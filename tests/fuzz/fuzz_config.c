/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the YAML config loader and binder (core/config) on
 * arbitrary bytes.  Failures must explain themselves; a loaded config binds
 * a section of every field type and checks for unbound sections. */
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
  uint64_t u = 0;
  double d = 0;
  bool b = false;
  char s[32] = "";
  const kvp_config_field f[] = {KVP_CFG_U64("workers", &u, 1, 4096),
                                KVP_CFG_F64("hbm_gb", &d, 0, 1e6),
                                KVP_CFG_BOOL("no_shared_prefix", &b),
                                KVP_CFG_STR("policies", s, sizeof s)};
  const char *names[] = {"cluster", "replay", "routing"};
  for (size_t i = 0; i < 3; i++) {
    kvp_config_section sec = {names[i], f, 4};
    err[0] = '\0';
    if (kvp_config_bind(c, &sec, err, sizeof err) < 0)
      need_reason(err, sizeof err);
  }
  if (u > 4096 || (d < 0 || d > 1e6) || strnlen(s, sizeof s) == sizeof s)
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
