/* SPDX-License-Identifier: Apache-2.0 */
/* Crash safety: a child process puts (durable and not), reads and evicts
 * blocks under load and is SIGKILLed at a random moment; the parent then
 * recovers the store from the slab files and checks that every block it
 * returns is exactly what was written for that key and that every block
 * acknowledged durable (and not being evicted) is there.  KVP_CRASH_CYCLES
 * (default 200) cycles, alternating io_uring and pread/pwrite. */
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>

#include "tier_test_util.h"

#define NKEYS 256
enum { ST_NONE = 0, ST_DURABLE = 1, ST_EVICTING = 2 };

static _Atomic int *state; /* shared with the child: one word per key */
static uint8_t buf[64 << 10], out[64 << 10];

static size_t size_of(uint64_t k) { return 1000 + (k * 2654435761u) % 15000; }
static kvp_key key_of(uint64_t k) { return (kvp_key){k * 0x9E37u + 1, k}; }

static kvp_tier_store *open_store(const char *dir, kvp_tier_io_backend be,
                                  const kvp_namespace *ns) {
  kvp_tier_opts o = {.dram_bytes = 4u << 20, .nvme_dir = dir,
                     .nvme_bytes = 32u << 20, .io_backend = be,
                     .queue_depth = 8, .max_block_bytes = 64u << 10};
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  ASSERT_OK(kvp_tier_ns_add(t, ns, NULL));
  return t;
}

static void child(const char *dir, kvp_tier_io_backend be, uint64_t seed) {
  kvp_namespace ns = tt_ns("crash", 16);
  kvp_tier_store *t = open_store(dir, be, &ns);
  kvt_rng_state = seed;
  for (;;) {
    uint64_t k = kvt_rand_below(NKEYS), op = kvt_rand_below(10);
    kvp_key key = key_of(k);
    size_t n = size_of(k), len;
    if (op < 5) {
      tt_fill(&ns, key, buf, n);
      kvp_tier_put_opts po = {.cls = (kvp_class)(k % 3),
                              .flags = op < 3 ? KVP_TIER_PUT_DURABLE : 0};
      int rc = kvp_tier_put(t, &ns, key, buf, n, &po);
      if (rc == 1 && op < 3 &&
          atomic_load_explicit(&state[k], memory_order_relaxed) != ST_EVICTING)
        atomic_store_explicit(&state[k], ST_DURABLE, memory_order_release);
    } else if (op < 8) {
      if (kvp_tier_get(t, &ns, key, out, sizeof out, &len) >= 0 &&
          (len != n || !tt_check(&ns, key, out, n)))
        _exit(3); /* wrong bytes: the parent sees the status */
    } else {
      /* evicting: from now on the block may or may not survive */
      atomic_store_explicit(&state[k], ST_EVICTING, memory_order_release);
      kvp_tier_evict(t, &ns, key);
      atomic_store_explicit(&state[k], ST_NONE, memory_order_release);
    }
  }
}

static void verify(const char *dir, kvp_tier_io_backend be, int cycle,
                   uint64_t *present_total) {
  kvp_namespace ns = tt_ns("crash", 16);
  kvp_tier_store *t = open_store(dir, be, &ns);
  for (uint64_t k = 0; k < NKEYS; k++) {
    size_t len = 0, n = size_of(k);
    memset(out, 0xA5, sizeof out);
    int rc = kvp_tier_get(t, &ns, key_of(k), out, sizeof out, &len);
    int st = atomic_load_explicit(&state[k], memory_order_acquire);
    if (rc >= 0) {
      ASSERT_EQ(len, n);
      if (!tt_check(&ns, key_of(k), out, n)) {
        fprintf(stderr, "cycle %d: key %" PRIu64 " returned wrong bytes\n",
                cycle, k);
        exit(1);
      }
      (*present_total)++;
    } else if (st == ST_DURABLE) {
      fprintf(stderr, "cycle %d: durable key %" PRIu64 " lost (%s)\n", cycle,
              k, kvp_err_name(rc));
      exit(1);
    }
    if (st == ST_EVICTING) /* resolved: whatever recovery kept is the truth */
      atomic_store_explicit(&state[k], rc >= 0 ? ST_DURABLE : ST_NONE,
                            memory_order_relaxed);
  }
  kvp_tier_stats s;
  ASSERT_OK(kvp_tier_stats_get(t, &s));
  ASSERT_EQ(s.key_mismatch, 0);
  kvp_tier_destroy(t);
}

TEST(crash_cycles) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  if (!dir[0])
    KVT_SKIP_BECAUSE("no directory takes O_DIRECT");
  const char *e = getenv("KVP_CRASH_CYCLES");
  int cycles = e ? atoi(e) : 200;
  state = mmap(NULL, NKEYS * sizeof *state, PROT_READ | PROT_WRITE,
               MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  ASSERT_TRUE(state != MAP_FAILED);
  kvp_tier_io_backend be[2];
  int nbe = tt_backends(be);
  uint64_t present = 0, t0 = kvp_now_ns();
  for (int c = 0; c < cycles; c++) {
    kvp_tier_io_backend b = be[c % nbe];
    uint64_t seed = kvt_rand();
    fflush(NULL);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0)
      child(dir, b, seed);
    struct timespec ts = {0, (long)(1 + kvt_rand_below(30)) * 1000000L};
    nanosleep(&ts, NULL);
    kill(pid, SIGKILL);
    int status;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    if (!WIFSIGNALED(status)) {
      fprintf(stderr, "cycle %d: child exited with %d before the kill\n", c,
              WEXITSTATUS(status));
      exit(1);
    }
    verify(dir, b, c, &present);
    if ((c + 1) % 50 == 0)
      fprintf(stderr, "  %d/%d cycles, %.1f s\n", c + 1, cycles,
              (double)(kvp_now_ns() - t0) / 1e9);
  }
  int durable = 0;
  for (int k = 0; k < NKEYS; k++)
    durable += state[k] == ST_DURABLE;
  printf("%d cycles on %d backend(s): %" PRIu64 " blocks verified after "
         "restarts, %d durable at the end\n", cycles, nbe, present, durable);
  ASSERT_GT(present, 0);
  ASSERT_GT(durable, 0);
  munmap((void *)state, NKEYS * sizeof *state);
  tt_rmdir(dir);
}

TEST_MAIN(TEST_ENTRY(crash_cycles))
