/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier under concurrency: threads put, get, evict, prefetch and retune the
 * same store (DRAM small enough that blocks move to NVMe and back) while
 * every returned block is checked byte for byte.  Labelled tsan: `make
 * test-tsan` runs it under ThreadSanitizer. */
#include <pthread.h>

#include "tier_test_util.h"

#define THREADS 4
#define NKEYS 400
#define OPS 3000

static kvp_tier_store *store;
static kvp_namespace ns;

static size_t size_of(uint64_t k) { return 2000 + (k * 7919) % 30000; }
static kvp_key key_of(uint64_t k) { return (kvp_key){k + 1, k % 7}; }

typedef struct targ {
  uint64_t seed;
  uint64_t hits, wrong;
} targ;

static void *worker(void *p) {
  targ *a = p;
  static _Thread_local uint8_t buf[32768], out[32768];
  uint64_t s = a->seed;
  for (int i = 0; i < OPS; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t k = (s >> 33) % NKEYS, op = (s >> 20) % 10;
    kvp_key key = key_of(k);
    size_t n = size_of(k), len;
    if (op < 4) {
      tt_fill(&ns, key, buf, n);
      kvp_tier_put_opts po = {.cls = (kvp_class)(k % 3),
                              .flags = op == 0 ? KVP_TIER_PUT_DURABLE : 0};
      int rc = kvp_tier_put(store, &ns, key, buf, n, &po);
      if (rc < 0 && rc != KVP_ENOSPC) {
        fprintf(stderr, "put %" PRIu64 ": %s\n", k, kvp_err_name(rc));
        a->wrong++;
      }
    } else if (op < 8) {
      memset(out, 0x5A, n);
      int rc = kvp_tier_get(store, &ns, key, out, sizeof out, &len);
      if (rc >= 0) {
        a->hits++;
        if (len != n || !tt_check(&ns, key, out, n)) {
          fprintf(stderr, "get %" PRIu64 " from tier %d: wrong bytes\n", k, rc);
          a->wrong++;
        }
      }
    } else if (op == 8) {
      kvp_tier_evict(store, &ns, key);
    } else {
      kvp_key keys[4] = {key_of(k), key_of((k + 1) % NKEYS),
                         key_of((k + 2) % NKEYS), key_of((k + 3) % NKEYS)};
      kvp_ticket *tk;
      if (kvp_tier_prefetch(store, &ns, keys, 4, &tk) == 0) {
        kvp_ticket_wait(tk, 0);
        kvp_ticket_free(tk);
      }
      kvp_tier_stats st;
      kvp_tier_stats_get(store, &st);
      (void)kvp_tier_bandwidth(store, KVP_TIER_NVME);
    }
  }
  return NULL;
}

static void *tuner(void *p) {
  (void)p;
  for (int i = 0; i < 50; i++) {
    kvp_tier_set(store, KVP_TIER_OPT_DRAM_BYTES, (int64_t)(4 + i % 4) << 20);
    kvp_tier_set(store, KVP_TIER_OPT_POLICY, i % 2);
    kvp_tier_idle(store, 256 << 10);
    struct timespec ts = {0, 2000000};
    nanosleep(&ts, NULL);
  }
  return NULL;
}

TEST(threads_put_get_evict) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  if (!dir[0])
    KVT_SKIP_BECAUSE("no directory takes O_DIRECT");
  kvp_tier_io_backend be[2];
  int nbe = tt_backends(be);
  ns = tt_ns("stress", 16);
  for (int b = 0; b < nbe; b++) {
    kvp_tier_opts o = {.dram_bytes = 8u << 20, .nvme_dir = dir,
                       .nvme_bytes = 64u << 20, .io_backend = be[b],
                       .queue_depth = 16, .max_block_bytes = 32768};
    ASSERT_OK(kvp_tier_create(&o, NULL, &store));
    ASSERT_OK(kvp_tier_ns_add(store, &ns, &(kvp_tier_ns_opts){.block_bytes = 2000}));
    pthread_t th[THREADS + 1];
    targ a[THREADS];
    for (int i = 0; i < THREADS; i++) {
      a[i] = (targ){.seed = kvt_rand()};
      ASSERT_EQ(pthread_create(&th[i], NULL, worker, &a[i]), 0);
    }
    ASSERT_EQ(pthread_create(&th[THREADS], NULL, tuner, NULL), 0);
    uint64_t hits = 0;
    for (int i = 0; i <= THREADS; i++)
      ASSERT_EQ(pthread_join(th[i], NULL), 0);
    for (int i = 0; i < THREADS; i++) {
      ASSERT_EQ(a[i].wrong, 0);
      hits += a[i].hits;
    }
    kvp_tier_stats st;
    ASSERT_OK(kvp_tier_stats_get(store, &st));
    printf("%s: %" PRIu64 " verified hits (%" PRIu64 " DRAM, %" PRIu64
           " NVMe), %" PRIu64 " demotions\n", tt_backend_name(be[b]), hits,
           st.hits[KVP_TIER_DRAM], st.hits[KVP_TIER_NVME], st.demotions);
    ASSERT_GT(hits, 100);
    ASSERT_GT(st.hits[KVP_TIER_NVME], 0);
    ASSERT_EQ(st.checksum_failures + st.key_mismatch, 0);
    kvp_tier_destroy(store);
  }
  tt_rmdir(dir);
}

TEST_MAIN(TEST_ENTRY(threads_put_get_evict))
