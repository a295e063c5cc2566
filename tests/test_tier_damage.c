/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier: damage on disk is visible and does not come back -- a tampered
 * payload fails its checksum at the read, a damaged header is found by
 * recovery: each file's first damage is logged at warn level with its path,
 * every damaged slot is counted and its header zeroed, and the next restart
 * finds nothing to fail; a slab file cut short counts its lost last block
 * and drops the tail.  The stats as Prometheus text (kvp_tier_prometheus).
 * Both I/O backends. */
#include <fcntl.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "kvtier_internal.h"
#include "tier_test_util.h"

#define KB 1024u
#define MB (1024u * 1024u)
#define HDR 4096u /* the header sector on a 4 KiB-block file system */
#define SLOT (HDR + 8 * KB)

static _Alignas(4096) uint8_t buf[64 * KB], out[64 * KB];
static int n_warn_file; /* warnings naming the slab file's path */
static char slab[512];

static void count_log(void *opaque, kvp_log_level level, const char *module,
                      const char *msg) {
  (void)opaque, (void)module;
  if (level == KVP_LOG_WARN && strstr(msg, slab) != NULL)
    n_warn_file++;
}

static kvp_tier_store *open_store(const char *dir, kvp_tier_io_backend be,
                                  const kvp_namespace *ns) {
  kvp_tier_opts o = {.dram_bytes = 4 * MB, .nvme_dir = dir,
                     .nvme_bytes = 64 * MB, .io_backend = be,
                     .queue_depth = 8, .max_block_bytes = 1 * MB};
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  ASSERT_OK(kvp_tier_ns_add(t, ns, NULL));
  return t;
}

static kvp_key K(uint64_t i) { return (kvp_key){i, 1}; }

/* Four durable 8 KiB blocks in slots 0..3 of kvtier-8192.slab. */
static void write_four(const char *dir, kvp_tier_io_backend be,
                       const kvp_namespace *ns) {
  kvp_tier_store *t = open_store(dir, be, ns);
  kvp_tier_put_opts po = {.flags = KVP_TIER_PUT_DURABLE};
  for (uint64_t i = 0; i < 4; i++) {
    tt_fill(ns, K(i), buf, 8 * KB);
    ASSERT_EQ(kvp_tier_put(t, ns, K(i), buf, 8 * KB, &po), 1);
  }
  kvp_tier_destroy(t);
  snprintf(slab, sizeof slab, "%s/kvtier-8192.slab", dir);
}

static void flip(uint64_t off) {
  int fd = open(slab, O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t x = 0;
  ASSERT_EQ(pread(fd, &x, 1, (off_t)off), 1);
  x ^= 0x10;
  ASSERT_EQ(pwrite(fd, &x, 1, (off_t)off), 1);
  close(fd);
}

static int get(kvp_tier_store *t, const kvp_namespace *ns, uint64_t i) {
  size_t len;
  int rc = kvp_tier_get(t, ns, K(i), out, sizeof out, &len);
  if (rc >= 0)
    ASSERT_TRUE(tt_check(ns, K(i), out, 8 * KB));
  return rc;
}

static kvp_tier_stats stats(kvp_tier_store *t) {
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  return st;
}

/* What damage() left, as Prometheus text. */
static void prom_check(kvp_tier_store *t) {
  static char text[32768];
  size_t need = 0;
  ASSERT_ERR(kvp_tier_prometheus(t, text, 64, &need), KVP_ENOSPC);
  ASSERT_GT(need, 64);
  ASSERT_EQ(strlen(text), 63);
  ASSERT_OK(kvp_tier_prometheus(t, text, sizeof text, &need));
  ASSERT_EQ(strlen(text), need);
  static const char *const want[] = {
      "\nkvplane_tier_slots_wiped_total 3\n",
      "\nkvplane_tier_checksum_failures_total 2\n",
      "\nkvplane_tier_recovery_bad_slots_total 1\n",
      "\nkvplane_tier_recovery_truncated_blocks_total 0\n",
      "\nkvplane_tier_hits_total{tier=\"nvme\"} 1\n",
      "\nkvplane_tier_hits_total{tier=\"dram\"} 0\n",
      "\nkvplane_tier_admit_accepted_total{class=\"stable\"} 0\n",
      "\n# TYPE kvplane_tier_slots_wiped_total counter\n",
      "\n# TYPE kvplane_tier_nvme_blocks gauge\n",
      "\nkvplane_tier_nvme_blocks 1\n",
      "\nkvplane_tier_read_bandwidth_bytes_per_second{tier=\"nvme\"} "};
  for (size_t i = 0; i < sizeof want / sizeof *want; i++)
    if (strstr(text, want[i]) == NULL) {
      fprintf(stderr, "missing: %s\n%s", want[i], text);
      ASSERT_TRUE(false);
    }
  /* every sample line: a kvplane_tier_ name, a space, a number */
  for (char *l = strtok(text, "\n"); l != NULL; l = strtok(NULL, "\n"))
    if (l[0] != '#') {
      ASSERT_EQ(strncmp(l, "kvplane_tier_", 13), 0);
      char *sp = strrchr(l, ' ');
      ASSERT_NOT_NULL(sp);
      char *end;
      strtod(sp + 1, &end);
      ASSERT_TRUE(*end == '\0' && end > sp + 1);
    }
  ASSERT_ERR(kvp_tier_prometheus(NULL, text, sizeof text, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_tier_prometheus(t, NULL, 5, NULL), KVP_EINVAL);
}

static void damage(kvp_tier_io_backend be) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  kvp_namespace ns = tt_ns("a", 16);
  write_four(dir, be, &ns);
  flip(0 * SLOT + HDR + 100); /* payload of 0 and of 3: checksum at read */
  flip(3 * SLOT + HDR + 7000);
  flip(1 * SLOT + 50);        /* header of 1: recovery */
  n_warn_file = 0;
  kvp_tier_store *t = open_store(dir, be, &ns);
  kvp_tier_stats st = stats(t);
  ASSERT_EQ(st.recovered_slots, 3);
  ASSERT_EQ(st.recovery_bad_slots, 1);
  ASSERT_EQ(st.slots_wiped, 1);
  ASSERT_EQ(n_warn_file, 1); /* logged, with the path */
  ASSERT_EQ(get(t, &ns, 0), KVP_ENOENT);
  ASSERT_EQ(get(t, &ns, 1), KVP_ENOENT);
  ASSERT_EQ(get(t, &ns, 2), KVP_TIER_NVME);
  ASSERT_EQ(get(t, &ns, 3), KVP_ENOENT);
  st = stats(t);
  ASSERT_EQ(st.checksum_failures, 2);
  ASSERT_EQ(st.slots_wiped, 3);
  ASSERT_EQ(n_warn_file, 1); /* once per file */
  prom_check(t);
  kvp_tier_destroy(t);
  /* restart: the wiped slots are gone for good, nothing fails again */
  n_warn_file = 0;
  t = open_store(dir, be, &ns);
  st = stats(t);
  ASSERT_EQ(st.recovered_slots, 1);
  ASSERT_EQ(st.recovery_bad_slots, 0);
  ASSERT_EQ(st.slots_wiped, 0);
  for (uint64_t i = 0; i < 4; i++)
    ASSERT_EQ(get(t, &ns, i), i == 2 ? KVP_TIER_NVME : KVP_ENOENT);
  st = stats(t);
  ASSERT_EQ(st.checksum_failures, 0);
  ASSERT_EQ(n_warn_file, 0);
  kvp_tier_destroy(t);
  tt_rmdir(dir);
}

static void truncated(kvp_tier_io_backend be) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  kvp_namespace ns = tt_ns("a", 16);
  write_four(dir, be, &ns);
  ASSERT_OK(truncate(slab, 3 * SLOT + HDR + 100)); /* block 3 cut short */
  n_warn_file = 0;
  kvp_tier_store *t = open_store(dir, be, &ns);
  kvp_tier_stats st = stats(t);
  ASSERT_EQ(st.recovery_truncated_blocks, 1);
  ASSERT_EQ(st.recovered_slots, 3);
  ASSERT_EQ(n_warn_file, 1);
  for (uint64_t i = 0; i < 4; i++)
    ASSERT_EQ(get(t, &ns, i), i < 3 ? KVP_TIER_NVME : KVP_ENOENT);
  kvp_tier_destroy(t);
  n_warn_file = 0; /* the cut tail was dropped: not counted again */
  t = open_store(dir, be, &ns);
  st = stats(t);
  ASSERT_EQ(st.recovery_truncated_blocks, 0);
  ASSERT_EQ(st.recovered_slots, 3);
  ASSERT_EQ(n_warn_file, 0);
  kvp_tier_destroy(t);
  tt_rmdir(dir);
}

#define ON_BACKENDS(fn)                                                         \
  TEST(fn##_all) {                                                              \
    char d[256];                                                                \
    tt_mkdir(d, sizeof d);                                                      \
    if (!d[0])                                                                  \
      KVT_SKIP_BECAUSE("no directory here takes O_DIRECT (tmpfs?)");            \
    tt_rmdir(d);                                                                \
    kvp_log_set_sink(count_log, NULL);                                          \
    kvp_tier_io_backend b[2];                                                   \
    int n = tt_backends(b);                                                     \
    for (int i = 0; i < n; i++) {                                               \
      fprintf(stderr, "  %s on %s\n", #fn, tt_backend_name(b[i]));              \
      fn(b[i]);                                                                 \
    }                                                                           \
    kvp_log_set_sink(NULL, NULL);                                               \
  }
ON_BACKENDS(damage)
ON_BACKENDS(truncated)

TEST_MAIN(TEST_ENTRY(damage_all), TEST_ENTRY(truncated_all))
