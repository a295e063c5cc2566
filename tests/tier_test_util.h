/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers shared by the kvtier tests: a scratch directory on a file system
 * that takes O_DIRECT (the build tree, else /var/tmp), namespaces, block
 * contents that are a pure function of (namespace, key), the backends to run
 * every NVMe test on. */
#ifndef KVP_TIER_TEST_UTIL_H
#define KVP_TIER_TEST_UTIL_H

#include <dirent.h>
#include <fcntl.h>
#include <stdbool.h>
#include <unistd.h>

#include "test_harness.h"

/* A fresh directory for slab files; "" when none takes O_DIRECT. */
static inline void tt_mkdir(char *out, size_t cap) {
  const char *bases[] = {".", "/var/tmp"};
  for (size_t i = 0; i < 2; i++) {
    snprintf(out, cap, "%s/kvtier-test-XXXXXX", bases[i]);
    if (mkdtemp(out) == NULL)
      continue;
    char f[512];
    snprintf(f, sizeof f, "%s/probe", out);
    int fd = open(f, O_RDWR | O_CREAT | O_DIRECT, 0600);
    if (fd >= 0) {
      close(fd);
      unlink(f);
      return;
    }
    fprintf(stderr, "note: %s refuses O_DIRECT, trying the next place\n", out);
    rmdir(out);
  }
  out[0] = 0;
}

static inline void tt_rmdir(const char *dir) {
  DIR *d = opendir(dir);
  struct dirent *de;
  char f[512];
  while (d != NULL && (de = readdir(d)) != NULL) {
    if (de->d_name[0] == '.')
      continue;
    snprintf(f, sizeof f, "%s/%s", dir, de->d_name);
    unlink(f);
  }
  if (d)
    closedir(d);
  rmdir(dir);
}

static inline kvp_namespace tt_ns(const char *tenant, uint32_t bs) {
  kvp_namespace_desc d = {.model_id = "m", .tokenizer_id = "t",
                          .kv_layout = "l:bf16", .block_size = bs,
                          .tenant_salt = tenant};
  kvp_namespace ns;
  ASSERT_OK(kvp_namespace_init(&d, &ns));
  return ns;
}

/* Deterministic bytes for (ns, key): fill writes them, check compares
 * (thread-safe, no buffer). */
static inline bool tt_gen_(const kvp_namespace *ns, kvp_key k, uint8_t *b,
                           size_t n, bool fill) {
  uint64_t s = k.hi * 0x9E3779B97F4A7C15ull ^ k.lo ^ ns->seed.lo;
  for (size_t i = 0; i < n; i++) {
    if (i % 8 == 0) {
      s += 0x9E3779B97F4A7C15ull;
      uint64_t z = s;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      s = z ^ (z >> 31);
    }
    uint8_t v = (uint8_t)(s >> (8 * (i % 8)));
    if (fill)
      b[i] = v;
    else if (b[i] != v)
      return false;
  }
  return true;
}
static inline void tt_fill(const kvp_namespace *ns, kvp_key k, void *buf,
                           size_t n) {
  tt_gen_(ns, k, buf, n, true);
}
static inline bool tt_check(const kvp_namespace *ns, kvp_key k,
                            const void *buf, size_t n) {
  return tt_gen_(ns, k, (uint8_t *)(uintptr_t)buf, n, false);
}

/* io_uring first when the kernel lets us (else said once), then POSIX. */
static inline int tt_backends(kvp_tier_io_backend out[2]) {
  static int probed = -1;
  if (probed < 0) {
    kvp_tier_opts o = {.dram_bytes = 4u << 20, .io_backend = KVP_TIER_IO_URING};
    char dir[256];
    tt_mkdir(dir, sizeof dir);
    o.nvme_dir = dir;
    o.nvme_bytes = 64u << 20;
    kvp_tier_store *t = NULL;
    kvp_log_level lv = kvp_log_get_level();
    kvp_log_set_level(KVP_LOG_OFF);
    probed = dir[0] && kvp_tier_create(&o, NULL, &t) == 0;
    kvp_log_set_level(lv);
    kvp_tier_destroy(t);
    if (dir[0])
      tt_rmdir(dir);
    if (!probed)
      fprintf(stderr, "note: io_uring unavailable here: NVMe tests run on "
                      "the POSIX path only\n");
  }
  int n = 0;
  if (probed)
    out[n++] = KVP_TIER_IO_URING;
  out[n++] = KVP_TIER_IO_POSIX;
  return n;
}

static inline const char *tt_backend_name(kvp_tier_io_backend b) {
  return b == KVP_TIER_IO_URING ? "io_uring" : "posix";
}

#endif
