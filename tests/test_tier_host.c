/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier: default-sized DRAM tiers share one budget per host (tier_host.c):
 * several stores in one process and in several processes take
 * budget / host_stores each, the next one is refused with KVP_ENOSPC, a
 * destroyed store's or a killed process's share comes back, and stores given
 * dram_bytes are not counted.  Uses its own registry file
 * (KVP_TIER_HOST_REGISTRY). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tier_test_util.h"

static char g_reg[256];

static void reg_fresh(void) {
  snprintf(g_reg, sizeof g_reg, "/tmp/kvp-host-registry.%ld", (long)getpid());
  unlink(g_reg);
  ASSERT_OK(setenv("KVP_TIER_HOST_REGISTRY", g_reg, 1));
}

/* 1% of MemAvailable, 4 KiB pages (no huge page is taken: the region is
 * mapped, not touched). */
static int open_default(uint32_t host_stores, kvp_tier_store **t) {
  kvp_tier_opts o = {.dram_fraction = 0.01, .host_stores = host_stores,
                     .huge_pages = KVP_TIER_HUGE_NONE};
  return kvp_tier_create(&o, NULL, t);
}

static uint64_t dram_of(kvp_tier_store *t) {
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  return st.dram_bytes;
}

/* The budget line of the registry. */
static uint64_t reg_budget(void) {
  FILE *f = fopen(g_reg, "r");
  ASSERT_NOT_NULL(f);
  uint64_t b = 0;
  ASSERT_EQ(fscanf(f, "kvtier-host %" SCNu64, &b), 1);
  fclose(f);
  return b;
}

TEST(one_process) {
  reg_fresh();
  kvp_tier_store *s[4] = {0}, *x;
  for (int i = 0; i < 3; i++)
    ASSERT_OK(open_default(3, &s[i]));
  uint64_t budget = reg_budget();
  ASSERT_GT(budget, 0);
  for (int i = 0; i < 3; i++) /* equal shares, together within the budget */
    ASSERT_EQ(dram_of(s[i]), budget / 3);
  ASSERT_ERR(open_default(3, &s[3]), KVP_ENOSPC); /* a fourth: refused */
  /* an explicitly sized store is the caller's choice: not counted */
  kvp_tier_opts o = {.dram_bytes = 4u << 20};
  ASSERT_OK(kvp_tier_create(&o, NULL, &x));
  kvp_tier_destroy(s[1]); /* its share comes back */
  ASSERT_OK(open_default(3, &s[3]));
  ASSERT_EQ(dram_of(s[3]), budget / 3);
  kvp_tier_destroy(x);
  kvp_tier_destroy(s[0]);
  kvp_tier_destroy(s[2]);
  kvp_tier_destroy(s[3]);
  /* host_stores 0 (default): the first store takes the whole budget */
  ASSERT_OK(open_default(0, &s[0]));
  ASSERT_ERR(open_default(0, &s[1]), KVP_ENOSPC);
  ASSERT_ERR(open_default(4, &s[1]), KVP_ENOSPC);
  kvp_tier_destroy(s[0]);
  /* coordination off: each store sizes itself, as before */
  ASSERT_OK(setenv("KVP_TIER_HOST_REGISTRY", "", 1));
  ASSERT_OK(open_default(0, &s[0]));
  ASSERT_OK(open_default(0, &s[1]));
  ASSERT_DOUBLE_NEAR((double)dram_of(s[0]), (double)dram_of(s[1]),
                     0.2 * (double)dram_of(s[0]));
  kvp_tier_destroy(s[0]);
  kvp_tier_destroy(s[1]);
  unlink(g_reg);
}

/* A child holds a store until told to exit, or is killed. */
static pid_t child_store(uint32_t host_stores, int *go) {
  int up[2], down[2];
  ASSERT_OK(pipe(up));
  ASSERT_OK(pipe(down));
  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    kvp_tier_store *t;
    char ok = open_default(host_stores, &t) == 0 ? 'y' : 'n';
    ASSERT_EQ(write(up[1], &ok, 1), 1);
    char c;
    (void)!read(down[0], &c, 1);
    if (ok == 'y')
      kvp_tier_destroy(t);
    _exit(0);
  }
  char ok = 0;
  ASSERT_EQ(read(up[0], &ok, 1), 1);
  ASSERT_EQ(ok, 'y');
  close(up[0]), close(up[1]), close(down[0]);
  *go = down[1];
  return pid;
}

TEST(across_processes) {
  reg_fresh();
  int go1, go2;
  pid_t a = child_store(3, &go1), b = child_store(3, &go2);
  kvp_tier_store *s, *x;
  ASSERT_OK(open_default(3, &s)); /* the third */
  ASSERT_EQ(dram_of(s), reg_budget() / 3);
  ASSERT_ERR(open_default(3, &x), KVP_ENOSPC);
  /* a crashed process's share is reclaimed at the next create */
  ASSERT_OK(kill(a, SIGKILL));
  ASSERT_EQ(waitpid(a, NULL, 0), a);
  ASSERT_OK(open_default(3, &x));
  ASSERT_ERR(open_default(3, &s), KVP_ENOSPC);
  kvp_tier_destroy(x);
  /* a clean exit releases too */
  ASSERT_EQ(write(go2, "x", 1), 1);
  ASSERT_EQ(waitpid(b, NULL, 0), b);
  ASSERT_OK(open_default(3, &x));
  kvp_tier_store *y;
  ASSERT_OK(open_default(3, &y));
  kvp_tier_destroy(x);
  kvp_tier_destroy(y);
  kvp_tier_destroy(s);
  close(go1), close(go2);
  unlink(g_reg);
}

static void reg_put(const char *text) {
  FILE *f = fopen(g_reg, "w");
  ASSERT_NOT_NULL(f);
  fputs(text, f);
  fclose(f);
}

/* The registry is a file anyone on the host may write: one that does not
 * parse is taken as empty (the store opens and rewrites it), dead and
 * non-positive pids are dropped, and claims whose sum would wrap refuse
 * rather than hand out memory that live stores hold. */
TEST(bad_registry) {
  kvp_tier_store *t;
  reg_fresh();
  reg_put("garbage\n\x01\x02 not a registry\n");
  ASSERT_OK(open_default(1, &t));
  ASSERT_GT(reg_budget(), 0); /* rewritten */
  kvp_tier_destroy(t);
  char buf[256];
  snprintf(buf, sizeof buf, "kvtier-host %" PRIu64 "\n0 1\n-5 1\n%ld 1\nxx yy\n",
           (uint64_t)1 << 40, (long)INT32_MAX); /* no such live pids */
  reg_put(buf);
  ASSERT_OK(open_default(1, &t)); /* nothing live: the whole share */
  ASSERT_EQ(dram_of(t), reg_budget());
  kvp_tier_destroy(t);
  snprintf(buf, sizeof buf, "kvtier-host %" PRIu64 "\n1 %" PRIu64 "\n1 %" PRIu64 "\n",
           (uint64_t)1 << 40, UINT64_MAX, (uint64_t)4096); /* pid 1 lives */
  reg_put(buf);
  ASSERT_ERR(open_default(1, &t), KVP_ENOSPC);
  unlink(g_reg);
}

TEST_MAIN(TEST_ENTRY(one_process), TEST_ENTRY(across_processes),
          TEST_ENTRY(bad_registry))
