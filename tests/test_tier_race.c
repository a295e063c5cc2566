/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier: NVMe reads run without the store's lock (docs/kvtier.md, "batch
 * calls").  Reader threads get_batch blocks that live only on NVMe
 * (promotion off) while other threads evict and re-put the SAME keys and
 * churn DRAM so demotions keep taking NVMe slots.  Every returned byte is
 * checked; a slot reused under a read would show as a failed payload check
 * of a block evicted meanwhile (stats.nvme_read_races) on the plaintext
 * namespace, so that must stay 0.  One plaintext and one AES-GCM namespace,
 * both I/O backends.  Labelled tsan. */
#include <pthread.h>

#include "tier_test_util.h"

#define NKEYS 48
#define READERS 2
#define WRITERS 2
#define ROUNDS 400

static kvp_tier_store *store;
static kvp_namespace nsp, nse; /* plaintext, encrypted */
static _Atomic int stop;

/* 16 KiB (direct reads into an aligned caller buffer) and odd sizes (read
 * through staging). */
static size_t size_of(uint64_t k) { /* <= 18435 */
  return k % 2 ? 16384 : 9000 + (k % 256) * 37;
}
static kvp_key key_of(uint64_t k) { return (kvp_key){0xABCD, 1000 + k}; }
static bool with_enc; /* a third of the keys in the encrypted namespace */
static const kvp_namespace *ns_of(uint64_t k) {
  return with_enc && k % 3 == 0 ? &nse : &nsp;
}

typedef struct targ {
  uint64_t seed, nvme_hits, hits, wrong, puts;
} targ;

static void put_key(uint64_t k, uint8_t *buf) {
  tt_fill(ns_of(k), key_of(k), buf, size_of(k));
  kvp_tier_put_opts po = {.cls = KVP_CLASS_STABLE}; /* always admitted */
  int rc = kvp_tier_put(store, ns_of(k), key_of(k), buf, size_of(k), &po);
  if (rc < 0 && rc != KVP_ENOSPC) {
    fprintf(stderr, "put %" PRIu64 ": %s\n", k, kvp_err_name(rc));
    abort();
  }
}

static void *reader(void *p) {
  targ *a = p;
  enum { B = 8 };
  static _Thread_local _Alignas(4096) uint8_t out[B][20480];
  uint64_t s = a->seed;
  for (int r = 0; r < ROUNDS * 4 && !stop; r++) {
    kvp_key keys[B];
    uint64_t ks[B];
    void *dst[B];
    size_t cap[B], len[B];
    int res[B];
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const kvp_namespace *ns = ns_of((s >> 40) % 3 == 0 ? 0 : 1);
    for (int i = 0; i < B; i++) { /* keys of the one namespace, distinct */
      uint64_t k = ((s >> 33) + (uint64_t)i * 5) % NKEYS;
      while (ns_of(k) != ns)
        k = (k + 1) % NKEYS;
      ks[i] = k;
      keys[i] = key_of(k);
      dst[i] = out[i];
      cap[i] = sizeof out[i];
      memset(out[i], 0xA5, sizeof out[i]); /* poisoned */
    }
    int n = kvp_tier_get_batch(store, ns, keys, B, dst, cap, len, res);
    if (n < 0) {
      fprintf(stderr, "get_batch: %s\n", kvp_err_name(n));
      a->wrong++;
      continue;
    }
    for (int i = 0; i < B; i++) {
      if (res[i] < 0)
        continue;
      a->hits++;
      a->nvme_hits += res[i] == KVP_TIER_NVME;
      if (len[i] != size_of(ks[i]) || !tt_check(ns, keys[i], out[i], len[i])) {
        fprintf(stderr, "key %" PRIu64 " from tier %d: wrong bytes\n", ks[i],
                res[i]);
        a->wrong++;
      }
    }
  }
  return NULL;
}

/* Evicts and re-puts the readers' keys; the re-put lands in DRAM, and the
 * churn of filler keys demotes it into a (possibly just freed) NVMe slot. */
static void *writer(void *p) {
  targ *a = p;
  static _Thread_local uint8_t buf[20480];
  uint64_t s = a->seed;
  for (int r = 0; r < ROUNDS && !stop; r++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    uint64_t k = (s >> 33) % NKEYS;
    kvp_tier_evict(store, ns_of(k), key_of(k));
    put_key(k, buf);
    for (int f = 0; f < 3; f++) { /* filler: DRAM pressure */
      uint64_t fk = NKEYS + (s >> 20) % 4096 + (uint64_t)f;
      put_key(fk, buf);
      a->puts++;
    }
    if (r % 16 == 0) /* idle write-back too */
      kvp_tier_idle(store, 256 * 1024);
  }
  return NULL;
}

/* locked: KVP_TIER_OPT_READ_UNLOCKED 0, reads keep the store's lock (the
 * behaviour before): then no evict can meet a read, encrypted or not. */
static void run(kvp_tier_io_backend be, bool enc, bool locked) {
  with_enc = enc;
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  if (!dir[0])
    KVT_SKIP_BECAUSE("no directory takes O_DIRECT");
  /* DRAM holds ~12 blocks: the readers' keys live on NVMe */
  kvp_tier_opts o = {.dram_bytes = 4u << 20, .nvme_dir = dir,
                     .nvme_bytes = 64u << 20, .io_backend = be,
                     .queue_depth = 8, .max_block_bytes = 1u << 20,
                     .no_promote = 1};
  ASSERT_OK(kvp_tier_create(&o, NULL, &store));
  ASSERT_OK(kvp_tier_set(store, KVP_TIER_OPT_DRAM_BYTES, 192 * 1024));
  ASSERT_OK(kvp_tier_set(store, KVP_TIER_OPT_READ_UNLOCKED, !locked));
  nsp = tt_ns("plain", 16);
  nse = tt_ns("sealed", 16);
  uint8_t aes[32];
  for (int i = 0; i < 32; i++)
    aes[i] = (uint8_t)(i * 7 + 1);
  ASSERT_OK(kvp_tier_ns_add(store, &nsp, NULL));
  ASSERT_OK(kvp_tier_ns_add(store, &nse, &(kvp_tier_ns_opts){.aes256_key = aes}));
  static uint8_t buf[20480];
  for (uint64_t k = 0; k < NKEYS; k++)
    put_key(k, buf);
  pthread_t th[READERS + WRITERS];
  targ ta[READERS + WRITERS];
  uint64_t seed = kvt_rand();
  stop = 0;
  for (int i = 0; i < READERS + WRITERS; i++) {
    ta[i] = (targ){.seed = seed + (uint64_t)i * 7919};
    ASSERT_EQ(pthread_create(&th[i], NULL, i < READERS ? reader : writer,
                             &ta[i]),
              0);
  }
  for (int i = READERS; i < READERS + WRITERS; i++)
    pthread_join(th[i], NULL);
  stop = 1;
  for (int i = 0; i < READERS; i++)
    pthread_join(th[i], NULL);
  uint64_t nvme_hits = 0, hits = 0, wrong = 0;
  for (int i = 0; i < READERS; i++) {
    nvme_hits += ta[i].nvme_hits;
    hits += ta[i].hits;
    wrong += ta[i].wrong;
  }
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(store, &st));
  fprintf(stderr,
          "  %s%s%s: %" PRIu64 " hits (%" PRIu64 " from NVMe), %" PRIu64
          " NVMe reads, %" PRIu64 " races, %" PRIu64
          " demotions, %" PRIu64 " evictions\n",
          tt_backend_name(be), enc ? " + AES-GCM" : "",
          locked ? " (reads locked)" : "", hits, nvme_hits, st.nvme_reads,
          st.nvme_read_races, st.demotions, st.evictions[KVP_TIER_DRAM]);
  ASSERT_EQ(wrong, 0);
  ASSERT_GT(nvme_hits, 100); /* the reads under test did happen */
  ASSERT_GT(st.demotions, 200); /* and slots were retaken meanwhile */
  ASSERT_EQ(st.checksum_failures, 0);
  ASSERT_EQ(st.key_mismatch, 0);
  ASSERT_EQ(st.auth_failures, 0);
  ASSERT_EQ(st.io_errors + st.short_io, 0);
  if (!enc || locked) /* payload-only reads of pinned slots cannot race */
    ASSERT_EQ(st.nvme_read_races, 0);
  kvp_tier_destroy(store);
  tt_rmdir(dir);
}

TEST(nvme_reads_unlocked) {
  kvp_tier_io_backend b[2];
  int n = tt_backends(b);
  for (int i = 0; i < n; i++) {
    run(b[i], false, false);
    run(b[i], true, false);
    run(b[i], true, true);
  }
}

TEST_MAIN(TEST_ENTRY(nvme_reads_unlocked))
