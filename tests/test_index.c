/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: query semantics per tier, sequence gaps and resync, digests,
 * approximate mode (TTL, LRU cap), bad input, allocation failure, and the
 * <= 64 and > 64 worker paths against a naive per-worker hash-set model. */
#include "index_internal.h"
#include "test_harness.h"

#define MAXM 64 /* matches asked for per query */

static kvp_key K(uint64_t lo) { return (kvp_key){.hi = lo * 3, .lo = lo}; }

static kvp_index *mk_sized(uint32_t max_workers, uint32_t nworkers,
                           uint64_t expected_keys) {
  kvp_index_opts o = {.max_workers = max_workers,
                      .expected_keys = expected_keys};
  kvp_index *ix = NULL;
  ASSERT_OK(kvp_index_create(&o, NULL, &ix));
  for (uint32_t w = 0; w < nworkers; w++)
    ASSERT_OK(kvp_index_worker_add(ix, w));
  return ix;
}

static kvp_index *mk(uint32_t max_workers, uint32_t nworkers) {
  return mk_sized(max_workers, nworkers, 0);
}

/* keys lo = base .. base+n-1 */
static void run(kvp_key *k, uint64_t base, size_t n) {
  for (size_t i = 0; i < n; i++)
    k[i] = K(base + i);
}

static const kvp_index_match *find_match(const kvp_index_match *m, int n,
                                         uint32_t w) {
  for (int i = 0; i < n; i++)
    if (m[i].worker == w)
      return &m[i];
  return NULL;
}

static uint64_t stat_blocks(kvp_index *ix) {
  kvp_index_stats s;
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  return s.query_blocks;
}

/* kvp_index_prefetch is a hint: bad arguments are refused, and prefetching
 * keys present, absent or in a table being grown changes no answer, digest or
 * counter. */
TEST(prefetch_changes_nothing) {
  kvp_index *ix = mk(0, 3); /* over 64 worker ids: the wide query path */
  kvp_key k[64];
  run(k, 500, 64);
  ASSERT_ERR(kvp_index_prefetch(NULL, k, 1), KVP_EINVAL);
  ASSERT_ERR(kvp_index_prefetch(ix, NULL, 1), KVP_EINVAL);
  ASSERT_OK(kvp_index_prefetch(ix, NULL, 0));
  ASSERT_OK(kvp_index_prefetch(ix, k, 64)); /* an empty index */
  for (uint32_t w = 0; w < 3; w++)
    ASSERT_EQ(kvp_index_stored(ix, w, 1, KVP_TIER_HBM, NULL, k, 16u << w),
              16 << w);
  kvp_index_match before[MAXM], after[MAXM];
  kvp_index_stats s0, s1;
  uint64_t d0, d1;
  int n0 = kvp_index_query(ix, k, 64, 0, before, MAXM);
  ASSERT_EQ(n0, 3);
  ASSERT_OK(kvp_index_digest(ix, 2, &d0));
  ASSERT_OK(kvp_index_stats_get(ix, &s0));
  ASSERT_OK(kvp_index_prefetch(ix, k, 64));
  ASSERT_OK(kvp_index_stats_get(ix, &s1));
  ASSERT_OK(kvp_index_digest(ix, 2, &d1));
  ASSERT_EQ(d1, d0);
  ASSERT_EQ(s1.keys, s0.keys);
  ASSERT_EQ(s1.residencies, s0.residencies);
  ASSERT_EQ(s1.events_applied, s0.events_applied);
  ASSERT_EQ(s1.queries, s0.queries);
  ASSERT_EQ(kvp_index_query(ix, k, 64, 0, after, MAXM), n0);
  ASSERT_TRUE(memcmp(before, after, (size_t)n0 * sizeof *before) == 0);
  kvp_index_destroy(ix);
}

/* Keys past their bucket pair: the query reads the pair PF_NEAR blocks ahead
 * and finishes these lookups when it walks the block (pipe_take).  Many
 * chains at the tables' top load, on both query paths: every key is found,
 * absent keys are not, and removals in the middle of probe paths (tombstones)
 * change nothing else.  `half`: the tables presized (expected_keys) to stay
 * at most half full, where lookups read the home bucket alone and finish
 * keys past it (already 1 in ~10 at that load) the same way. */
static void check_long_probes(uint32_t max_workers, bool half) {
  enum { CHAINS = 120, LEN = 500 };
  kvp_index *ix = mk_sized(max_workers, 3, half ? CHAINS * LEN * 3 / 2 : 0);
  static kvp_key k[LEN];
  uint64_t seq[3] = {0};
  for (uint32_t c = 0; c < CHAINS; c++) {
    run(k, 1000000u * (c + 1), LEN);
    ASSERT_EQ(kvp_index_stored(ix, c % 3, ++seq[c % 3], KVP_TIER_HBM, NULL, k,
                               LEN),
              LEN);
  }
  if (half) {
    ASSERT_EQ(kvp__index_home_only_shards(ix), 64u);
    ASSERT_GT(kvp__index_keys_past(ix, 1), 1000u);
  } else {
    ASSERT_EQ(kvp__index_home_only_shards(ix), 0u);
    ASSERT_GT(kvp__index_keys_past(ix, 2), 100u);
  }
  kvp_index_match m[MAXM];
  for (int pass = 0; pass < 2; pass++) {
    for (uint32_t c = 0; c < CHAINS; c++) {
      run(k, 1000000u * (c + 1), LEN);
      ASSERT_EQ(kvp_index_query(ix, k, LEN, 0, m, MAXM), 1);
      ASSERT_EQ(m[0].worker, c % 3);
      /* after the removals below: even chains keep 0..249 only */
      ASSERT_EQ(m[0].prefix_blocks, pass && c % 2 == 0 ? LEN / 2 : LEN);
      ASSERT_EQ(m[0].tier_blocks[KVP_TIER_HBM], m[0].prefix_blocks);
      run(k, 1000000u * (c + 1) + 500000u, LEN); /* nobody holds these */
      ASSERT_EQ(kvp_index_query(ix, k, LEN, 0, m, MAXM), 0);
    }
    for (uint32_t c = 0; pass == 0 && c < CHAINS; c += 2) {
      run(k, 1000000u * (c + 1) + LEN / 2, LEN / 2);
      ASSERT_EQ(kvp_index_removed(ix, c % 3, ++seq[c % 3], KVP_TIER_HBM, k,
                                  LEN / 2),
                LEN / 2);
    }
  }
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

TEST(long_probes_fast) { check_long_probes(8, false); }
TEST(long_probes_wide) { check_long_probes(0, false); }
TEST(long_probes_half_fast) { check_long_probes(8, true); }
TEST(long_probes_half_wide) { check_long_probes(0, true); }

/* ---- query semantics ------------------------------------------------------
 */

/* Worker 0: HBM 0..4, DRAM 0..7, NVMe 8; worker 1: remote 0..2, HBM 4..9;
 * worker 2: HBM 1..9 (not block 0). */
static void load_tiers(kvp_index *ix) {
  kvp_key k[16];
  run(k, 100, 16);
  ASSERT_EQ(kvp_index_stored(ix, 0, 1, KVP_TIER_HBM, NULL, k, 5), 5);
  ASSERT_EQ(kvp_index_stored(ix, 0, 2, KVP_TIER_DRAM, NULL, k, 8), 8);
  ASSERT_EQ(kvp_index_stored(ix, 0, 3, KVP_TIER_NVME, &k[7], &k[8], 1), 1);
  ASSERT_EQ(kvp_index_stored(ix, 1, 1, KVP_TIER_REMOTE, NULL, k, 3), 3);
  ASSERT_EQ(kvp_index_stored(ix, 1, 2, KVP_TIER_HBM, &k[3], &k[4], 6), 6);
  ASSERT_EQ(kvp_index_stored(ix, 2, 1, KVP_TIER_HBM, &k[0], &k[1], 9), 9);
}

static void check_tiers(uint32_t max_workers) {
  kvp_index *ix = mk(max_workers, 3);
  load_tiers(ix);
  kvp_key chain[1000];
  run(chain, 100, 10);
  run(&chain[10], 5000, 990);
  kvp_index_match m[MAXM];
  int n = kvp_index_query(ix, chain, 10, 0, m, MAXM);
  ASSERT_EQ(n, 2); /* worker 2 lacks block 0 */
  ASSERT_EQ(m[0].worker, 0u);
  ASSERT_EQ(m[0].prefix_blocks, 9u);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_HBM], 5u); /* fastest tier wins */
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_DRAM], 3u);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_NVME], 1u);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_REMOTE], 0u);
  ASSERT_EQ(m[0].routed_blocks, 0u);
  ASSERT_EQ(m[0].uncertain, 0);
  ASSERT_EQ(m[1].worker, 1u);
  ASSERT_EQ(m[1].prefix_blocks, 3u); /* block 3 is a hole */
  ASSERT_EQ(m[1].tier_blocks[KVP_TIER_REMOTE], 3u);
  ASSERT_EQ(m[1].tier_blocks[KVP_TIER_HBM], 0u);
  /* cap smaller than the count: the count, the first matches */
  kvp_index_match one[2] = {{0}};
  ASSERT_EQ(kvp_index_query(ix, chain, 10, 0, one, 1), 2);
  ASSERT_EQ(one[0].worker, 0u);
  ASSERT_EQ(one[1].prefix_blocks, 0u); /* untouched */
  ASSERT_EQ(kvp_index_query(ix, chain, 10, 0, NULL, 0), 2);
  /* early stop: after block 9 nobody holds the chain, 990 blocks unread */
  ASSERT_EQ(kvp_index_stored(ix, 2, 2, KVP_TIER_HBM, NULL, &chain[500], 400),
            400);
  uint64_t before = stat_blocks(ix);
  ASSERT_EQ(kvp_index_query(ix, chain, 1000, 0, m, MAXM), 2);
  ASSERT_EQ(stat_blocks(ix) - before, 10u);
  ASSERT_EQ(m[0].prefix_blocks, 9u);
  /* from block 1 on, worker 2 matches too; block 10 stops the walk */
  before = stat_blocks(ix);
  ASSERT_EQ(kvp_index_query(ix, &chain[1], 999, 0, m, MAXM), 3);
  ASSERT_EQ(m[0].prefix_blocks, 8u);
  ASSERT_EQ(m[1].prefix_blocks, 2u);
  ASSERT_EQ(m[2].worker, 2u);
  ASSERT_EQ(m[2].prefix_blocks, 9u);
  ASSERT_EQ(stat_blocks(ix) - before, 10u);
  /* a chain nobody starts: one block read */
  before = stat_blocks(ix);
  ASSERT_EQ(kvp_index_query(ix, &chain[10], 990, 0, m, MAXM), 0);
  ASSERT_EQ(stat_blocks(ix) - before, 1u);
  /* removals: DRAM 5..7 gone -> worker 0 holds 0..4 only */
  ASSERT_EQ(kvp_index_removed(ix, 0, 4, KVP_TIER_DRAM, &chain[5], 3), 3);
  ASSERT_EQ(kvp_index_removed(ix, 0, 5, KVP_TIER_DRAM, &chain[5], 3), 0);
  ASSERT_EQ(kvp_index_query(ix, chain, 10, 0, m, MAXM), 2);
  ASSERT_EQ(m[0].prefix_blocks, 5u);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_HBM], 5u);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_DRAM], 0u);
  /* an HBM copy leaving exposes the DRAM copy underneath */
  ASSERT_EQ(kvp_index_removed(ix, 0, 6, KVP_TIER_HBM, &chain[2], 1), 1);
  ASSERT_EQ(kvp_index_query(ix, chain, 10, 0, m, MAXM), 2);
  ASSERT_EQ(m[0].prefix_blocks, 5u);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_HBM], 4u);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_DRAM], 1u);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

TEST(query_tiers_fast) { check_tiers(8); }
TEST(query_tiers_wide) { check_tiers(0); }

TEST(worker_ids_across_groups) {
  kvp_index *ix = mk(0, 0);
  const uint32_t ws[] = {4095, 0, 64, 63, 1000, 2048, 127};
  kvp_key k[4];
  run(k, 7, 4);
  for (unsigned i = 0; i < 7; i++) {
    ASSERT_OK(kvp_index_worker_add(ix, ws[i]));
    /* worker ws[i] holds i % 4 + 1 blocks */
    ASSERT_EQ(kvp_index_stored(ix, ws[i], 1, KVP_TIER_DRAM, NULL, k, i % 4 + 1),
              (int)(i % 4 + 1));
  }
  kvp_index_match m[MAXM];
  ASSERT_EQ(kvp_index_query(ix, k, 4, 0, m, MAXM), 7);
  for (int i = 1; i < 7; i++)
    ASSERT_LT(m[i - 1].worker, m[i].worker); /* increasing ids */
  for (unsigned i = 0; i < 7; i++) {
    const kvp_index_match *x = find_match(m, 7, ws[i]);
    ASSERT_NOT_NULL(x);
    ASSERT_EQ(x->prefix_blocks, i % 4 + 1);
    ASSERT_EQ(x->tier_blocks[KVP_TIER_DRAM], i % 4 + 1);
  }
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

/* A walk on the wide path where one group is left alive after the others
 * drop out (it then gathers that group alone): holders of later blocks in
 * other groups, at the same bit (w % 64) and in a faster tier, count for
 * nobody; inline holders and spilled sets (> 4 holders) alike. */
TEST(wide_one_group_left) {
  for (int spill = 0; spill < 2; spill++) {
    kvp_index *ix = mk(0, 0);
    const uint32_t ws[] = {5, 69, 133, 197, 261}; /* groups 0-4, bit 5 */
    for (unsigned i = 0; i < 5; i++)
      ASSERT_OK(kvp_index_worker_add(ix, ws[i]));
    static kvp_key k[100];
    run(k, 9000, 100);
    uint64_t seq[5] = {0};
    /* worker 5: blocks 0..19 in HBM, 20..99 in DRAM (the longest) */
    ASSERT_EQ(kvp_index_stored(ix, 5, ++seq[0], KVP_TIER_HBM, NULL, k, 20), 20);
    ASSERT_EQ(kvp_index_stored(ix, 5, ++seq[0], KVP_TIER_DRAM, &k[19], &k[20],
                               80),
              80);
    /* the others: blocks 0..9, then (not a prefix) 20..99 in HBM */
    for (unsigned i = 1; i < (spill ? 5u : 2u); i++) {
      ASSERT_EQ(kvp_index_stored(ix, ws[i], ++seq[i], KVP_TIER_HBM, NULL, k,
                                 10),
                10);
      ASSERT_EQ(kvp_index_stored(ix, ws[i], ++seq[i], KVP_TIER_HBM, &k[19],
                                 &k[20], 80),
                80);
    }
    kvp_index_match m[MAXM];
    int n = kvp_index_query(ix, k, 100, 0, m, MAXM);
    ASSERT_EQ(n, spill ? 5 : 2);
    const kvp_index_match *x = find_match(m, (size_t)n, 5);
    ASSERT_NOT_NULL(x);
    ASSERT_EQ(x->prefix_blocks, 100u);
    ASSERT_EQ(x->tier_blocks[KVP_TIER_HBM], 20u);
    ASSERT_EQ(x->tier_blocks[KVP_TIER_DRAM], 80u);
    x = find_match(m, (size_t)n, 69);
    ASSERT_NOT_NULL(x);
    ASSERT_EQ(x->prefix_blocks, 10u);
    ASSERT_OK(kvp__index_verify(ix));
    kvp_index_destroy(ix);
  }
}

/* ---- sequence numbers, gaps, resync -----------------------------------------
 */

static kvp_index_worker_info info_of(kvp_index *ix, uint32_t w) {
  kvp_index_worker_info i;
  ASSERT_OK(kvp_index_worker_get(ix, w, &i));
  return i;
}

TEST(gap_and_resync) {
  kvp_index *ix = mk(16, 2);
  kvp_key k[8];
  run(k, 40, 8);
  ASSERT_EQ(kvp_index_stored(ix, 0, 1, KVP_TIER_HBM, NULL, k, 4), 4);
  ASSERT_EQ(info_of(ix, 0).uncertain, 0);
  /* seq 2 lost: applied, but the worker is uncertain */
  ASSERT_EQ(kvp_index_stored(ix, 0, 3, KVP_TIER_HBM, &k[3], &k[4], 2), 2);
  ASSERT_EQ(info_of(ix, 0).uncertain, 1);
  ASSERT_EQ(info_of(ix, 0).last_seq, 3u);
  ASSERT_EQ(info_of(ix, 1).uncertain, 0); /* per worker */
  kvp_index_match m[MAXM];
  ASSERT_EQ(kvp_index_query(ix, k, 8, 0, m, MAXM), 1);
  ASSERT_EQ(m[0].prefix_blocks, 6u);
  ASSERT_EQ(m[0].uncertain, 1);
  /* late and duplicate events are dropped and counted */
  ASSERT_ERR(kvp_index_stored(ix, 0, 2, KVP_TIER_HBM, NULL, &k[6], 2),
             KVP_EEXIST);
  ASSERT_ERR(kvp_index_removed(ix, 0, 3, KVP_TIER_HBM, k, 1), KVP_EEXIST);
  ASSERT_ERR(kvp_index_cleared(ix, 0, 1), KVP_EEXIST);
  ASSERT_EQ(kvp_index_query(ix, k, 8, 0, m, MAXM), 1);
  ASSERT_EQ(m[0].prefix_blocks, 6u); /* nothing of them applied */
  kvp_index_stats s;
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.seq_gaps, 1u);
  ASSERT_EQ(s.events_stale, 3u);
  ASSERT_EQ(s.uncertain_workers, 1u);
  /* resync at seq 10: keys 1, 2 (HBM) and 7 (NVMe) replace the set */
  kvp_key nk[3] = {k[1], k[2], k[7]};
  uint8_t nt[3] = {KVP_TIER_HBM, KVP_TIER_HBM, KVP_TIER_NVME};
  ASSERT_EQ(kvp_index_resync(ix, 0, 10, nk, nt, 3), 3);
  kvp_index_worker_info i0 = info_of(ix, 0);
  ASSERT_EQ(i0.uncertain, 0);
  ASSERT_EQ(i0.last_seq, 10u);
  ASSERT_EQ(i0.residencies, 3u);
  ASSERT_EQ(kvp_index_query(ix, k, 8, 0, m, MAXM), 0); /* block 0 gone */
  ASSERT_EQ(kvp_index_query(ix, &k[1], 2, 0, m, MAXM), 1);
  ASSERT_EQ(m[0].prefix_blocks, 2u);
  ASSERT_EQ(m[0].uncertain, 0);
  ASSERT_ERR(kvp_index_stored(ix, 0, 10, KVP_TIER_HBM, NULL, k, 1), KVP_EEXIST);
  ASSERT_EQ(kvp_index_stored(ix, 0, 11, KVP_TIER_HBM, NULL, k, 1), 1);
  ASSERT_EQ(info_of(ix, 0).uncertain, 0); /* 11 follows 10: no gap */
  /* an empty resync clears; a resync may also move the base backwards */
  ASSERT_EQ(kvp_index_resync(ix, 0, 5, NULL, NULL, 0), 0);
  ASSERT_EQ(info_of(ix, 0).residencies, 0u);
  ASSERT_EQ(kvp_index_stored(ix, 0, 6, KVP_TIER_HBM, NULL, k, 2), 2);
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.resyncs, 2u);
  ASSERT_EQ(s.seq_gaps, 1u);
  /* cleared: everything of the worker, in every tier */
  ASSERT_EQ(kvp_index_stored(ix, 0, 7, KVP_TIER_REMOTE, NULL, k, 8), 8);
  ASSERT_OK(kvp_index_cleared(ix, 0, 8));
  ASSERT_EQ(info_of(ix, 0).residencies, 0u);
  ASSERT_EQ(kvp_index_query(ix, k, 8, 0, m, MAXM), 0);
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.keys, 0u);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

TEST(resync_keeps_common_keys) {
  /* keys in both the old and the new set are never absent: they are added
   * before the sweep (checked here through the final state and counts) */
  kvp_index *ix = mk(16, 1);
  kvp_key k[64];
  run(k, 900, 64);
  ASSERT_EQ(kvp_index_stored(ix, 0, 1, KVP_TIER_DRAM, NULL, k, 40), 40);
  uint8_t t[64];
  for (int i = 0; i < 64; i++)
    t[i] = (uint8_t)(i % 2 ? KVP_TIER_DRAM : KVP_TIER_HBM);
  /* duplicates in the snapshot are harmless */
  kvp_key dup[66];
  uint8_t dt[66];
  memcpy(dup, &k[20], 44 * sizeof(kvp_key));
  memcpy(dt, &t[20], 44);
  dup[44] = k[20], dt[44] = t[20];
  ASSERT_EQ(kvp_index_resync(ix, 0, 2, dup, dt, 45), 44);
  ASSERT_EQ(info_of(ix, 0).residencies, 44u);
  uint64_t want, got;
  ASSERT_OK(kvp_index_digest_of(&k[20], &t[20], 44, &want));
  ASSERT_OK(kvp_index_digest(ix, 0, &got));
  ASSERT_EQ(got, want);
  kvp_index_match m[MAXM];
  ASSERT_EQ(kvp_index_query(ix, &k[20], 44, 0, m, MAXM), 1);
  ASSERT_EQ(m[0].prefix_blocks, 44u);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_HBM], 22u);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_DRAM], 22u);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

/* ---- digests
 * ------------------------------------------------------------------ */

TEST(digest_equality_and_divergence) {
  kvp_index *ix = mk(8, 2);
  kvp_key k[32];
  uint8_t t[32];
  run(k, 7000, 32);
  for (int i = 0; i < 32; i++)
    t[i] = (uint8_t)(i < 16 ? KVP_TIER_HBM : KVP_TIER_NVME);
  uint64_t d0, d1, ref, empty;
  ASSERT_OK(kvp_index_digest_of(NULL, NULL, 0, &empty));
  ASSERT_EQ(empty, 0u);
  ASSERT_OK(kvp_index_digest(ix, 0, &d0));
  ASSERT_EQ(d0, empty);
  /* same set, different event order and batching -> same digest */
  ASSERT_OK(kvp_index_stored(ix, 0, 1, KVP_TIER_HBM, NULL, k, 16));
  ASSERT_OK(kvp_index_stored(ix, 0, 2, KVP_TIER_NVME, NULL, &k[16], 16));
  for (int i = 31, s = 1; i >= 0; i--, s++)
    ASSERT_OK(
        kvp_index_stored(ix, 1, (uint64_t)s, (kvp_tier)t[i], NULL, &k[i], 1));
  ASSERT_OK(kvp_index_digest(ix, 0, &d0));
  ASSERT_OK(kvp_index_digest(ix, 1, &d1));
  ASSERT_OK(kvp_index_digest_of(k, t, 32, &ref));
  ASSERT_EQ(d0, ref);
  ASSERT_EQ(d1, ref);
  ASSERT_NE(ref, 0u);
  /* storing what is there changes nothing */
  ASSERT_EQ(kvp_index_stored(ix, 0, 3, KVP_TIER_HBM, NULL, k, 16), 0);
  ASSERT_OK(kvp_index_digest(ix, 0, &d0));
  ASSERT_EQ(d0, ref);
  /* a tier is part of the digest */
  ASSERT_OK(kvp_index_stored(ix, 0, 4, KVP_TIER_DRAM, NULL, k, 1));
  ASSERT_OK(kvp_index_removed(ix, 0, 5, KVP_TIER_HBM, k, 1));
  ASSERT_OK(kvp_index_digest(ix, 0, &d0));
  ASSERT_NE(d0, ref);
  t[0] = KVP_TIER_DRAM;
  ASSERT_OK(kvp_index_digest_of(k, t, 32, &ref));
  ASSERT_EQ(d0, ref);
  /* a lost removal: silent divergence that the digest shows */
  ASSERT_OK(kvp_index_removed(ix, 0, 7, KVP_TIER_NVME, &k[31], 1)); /* gap */
  ASSERT_OK(kvp_index_digest(ix, 0, &d0));
  ASSERT_OK(kvp_index_digest_of(k, t, 30, &ref)); /* worker also dropped 30 */
  ASSERT_NE(d0, ref);
  ASSERT_OK(kvp_index_digest_of(k, t, 31, &ref));
  ASSERT_EQ(d0, ref);
  ASSERT_ERR(kvp_index_digest_of(k, NULL, 1, NULL), KVP_EINVAL);
  uint8_t bad = 4;
  ASSERT_ERR(kvp_index_digest_of(k, &bad, 1, &ref), KVP_EINVAL);
  ASSERT_ERR(kvp_index_digest_of(NULL, NULL, 1, &ref), KVP_EINVAL);
  ASSERT_ERR(kvp_index_digest(ix, 8, &d0), KVP_ERANGE);
  ASSERT_ERR(kvp_index_digest(ix, 5, &d0), KVP_ENOENT);
  kvp_index_destroy(ix);
}

/* ---- approximate mode
 * ------------------------------------------------------------ */

/* An index of 8 worker ids, workers 1 and 2 added, routed records living
 * ttl_ns; k[0..8) a chain from seed. */
static kvp_index *approx_index(uint64_t ttl_ns, kvp_key k[8], uint64_t seed) {
  kvp_index_opts o = {.max_workers = 8, .approx_ttl_ns = ttl_ns};
  kvp_index *ix = NULL;
  ASSERT_OK(kvp_index_create(&o, NULL, &ix));
  ASSERT_OK(kvp_index_worker_add(ix, 1));
  ASSERT_OK(kvp_index_worker_add(ix, 2));
  run(k, seed, 8);
  return ix;
}

TEST(approx_ttl) {
  kvp_key k[8];
  kvp_index *ix = approx_index(100, k, 300);
  ASSERT_EQ(kvp_index_record_routed(ix, 1, k, 4, 1000), 4);
  kvp_index_match m[MAXM];
  ASSERT_EQ(kvp_index_query(ix, k, 8, 1099, m, MAXM), 1);
  ASSERT_EQ(m[0].worker, 1u);
  ASSERT_EQ(m[0].prefix_blocks, 4u);
  ASSERT_EQ(m[0].routed_blocks, 4u);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_HBM], 0u);
  ASSERT_EQ(kvp_index_query(ix, k, 8, 1100, m, MAXM), 0); /* expired */
  ASSERT_EQ(kvp_index_query(ix, k, 8, 999, m, MAXM), 1);  /* time < touch */
  /* refresh the first two only: they match, the chain stops at block 2 */
  ASSERT_EQ(kvp_index_record_routed(ix, 1, k, 2, 1060), 0); /* refreshed */
  ASSERT_EQ(kvp_index_query(ix, k, 8, 1120, m, MAXM), 1);
  ASSERT_EQ(m[0].prefix_blocks, 2u);
  /* an event residency counts in its tier, a routed-only block as routed */
  ASSERT_OK(kvp_index_stored(ix, 1, 1, KVP_TIER_DRAM, NULL, k, 1));
  ASSERT_EQ(kvp_index_query(ix, k, 8, 1120, m, MAXM), 1);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_DRAM], 1u);
  ASSERT_EQ(m[0].routed_blocks, 1u);
  ASSERT_EQ(m[0].prefix_blocks, 2u);
  /* expire() returns the memory of what no longer matches */
  kvp_index_stats s;
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.routed, 4u);
  ASSERT_EQ(kvp_index_expire(ix, 1120), 2); /* blocks 2, 3 (touched 1000) */
  ASSERT_EQ(kvp_index_expire(ix, 1120), 0);
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.routed, 2u);
  ASSERT_EQ(s.routed_expired, 2u);
  /* record_routed expires too */
  ASSERT_EQ(kvp_index_record_routed(ix, 2, &k[4], 1, 5000), 1);
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.routed, 1u);
  ASSERT_EQ(s.routed_expired, 4u);
  /* the TTL changed live (a config reload): the kept record is judged anew */
  ASSERT_EQ(kvp_index_query(ix, &k[4], 1, 5200, m, MAXM), 0);
  ASSERT_OK(kvp_index_set_approx_ttl(ix, 1000));
  ASSERT_EQ(kvp_index_query(ix, &k[4], 1, 5200, m, MAXM), 1);
  ASSERT_EQ(kvp_index_expire(ix, 5999), 0);
  ASSERT_EQ(kvp_index_query(ix, &k[4], 1, 6000, m, MAXM), 0);
  ASSERT_OK(kvp_index_set_approx_ttl(ix, 0)); /* the default: 120 s */
  ASSERT_EQ(kvp_index_query(ix, &k[4], 1, 119000005000ull, m, MAXM), 1);
  ASSERT_ERR(kvp_index_set_approx_ttl(NULL, 1), KVP_EINVAL);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

/* Pending records (an engine with events, a prefill in progress): their
 * own lifetime, never beyond the TTL; a live routed record keeps its TTL. */
TEST(approx_pending_life) {
  kvp_key k[8];
  kvp_index *ix = approx_index(100000, k, 400);
  kvp_index_match m[MAXM];
  /* 5 us of life from t = 1 ms */
  ASSERT_EQ(kvp_index_record_pending(ix, 1, k, 4, 1000000, 5000), 4);
  ASSERT_EQ(kvp_index_query(ix, k, 8, 1004999, m, MAXM), 1);
  ASSERT_EQ(m[0].worker, 1u);
  ASSERT_EQ(m[0].routed_blocks, 4u);
  ASSERT_EQ(kvp_index_query(ix, k, 8, 1005000, m, MAXM), 0); /* its life */
  /* a life beyond the TTL is the TTL */
  ASSERT_EQ(kvp_index_record_pending(ix, 2, k, 2, 2000000, 10000000000ull), 2);
  ASSERT_EQ(kvp_index_query(ix, k, 8, 2099999, m, MAXM), 1);
  ASSERT_EQ(kvp_index_query(ix, k, 8, 2100000, m, MAXM), 0);
  /* a live routed record refreshed by a pending one stays routed */
  ASSERT_EQ(kvp_index_record_routed(ix, 1, &k[4], 1, 3000000), 1);
  ASSERT_EQ(kvp_index_record_pending(ix, 1, &k[4], 1, 3000010, 1000), 0);
  ASSERT_EQ(kvp_index_query(ix, &k[4], 1, 3050000, m, MAXM), 1);
  /* a pending record refreshed as routed gets the TTL */
  ASSERT_EQ(kvp_index_record_pending(ix, 1, &k[6], 1, 3000020, 1000), 1);
  ASSERT_EQ(kvp_index_record_routed(ix, 1, &k[6], 1, 3000500), 0);
  ASSERT_EQ(kvp_index_query(ix, &k[6], 1, 3090000, m, MAXM), 1);
  /* life 0 records nothing; bad arguments as record_routed */
  kvp_index_stats s0, s1;
  ASSERT_OK(kvp_index_stats_get(ix, &s0));
  ASSERT_EQ(kvp_index_record_pending(ix, 1, &k[5], 3, 4000000, 0), 0);
  ASSERT_OK(kvp_index_stats_get(ix, &s1));
  ASSERT_EQ(s1.routed, s0.routed);
  ASSERT_ERR(kvp_index_record_pending(ix, 9, k, 1, 1, 1), KVP_ERANGE);
  ASSERT_ERR(kvp_index_record_pending(ix, 3, k, 1, 1, 1), KVP_ENOENT);
  ASSERT_ERR(kvp_index_record_pending(NULL, 1, k, 1, 1, 1), KVP_EINVAL);
  ASSERT_ERR(kvp_index_record_pending(NULL, 1, k, 1, 1, 0), KVP_EINVAL);
  /* expire() drops the pending records past their life */
  ASSERT_EQ(kvp_index_expire(ix, 200000000), (int)s1.routed);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

TEST(approx_lru_cap) {
  kvp_index_opts o = {.max_workers = 100, .approx_capacity = 8};
  kvp_index *ix = NULL;
  ASSERT_OK(kvp_index_create(&o, NULL, &ix));
  ASSERT_OK(kvp_index_worker_add(ix, 1));
  ASSERT_OK(kvp_index_worker_add(ix, 70));
  kvp_key a[8], b[4];
  run(a, 10, 8);
  run(b, 50, 4);
  ASSERT_EQ(kvp_index_record_routed(ix, 1, a, 8, 1), 8);
  kvp_index_match m[MAXM];
  ASSERT_EQ(kvp_index_query(ix, a, 8, 2, m, MAXM), 1);
  ASSERT_EQ(m[0].prefix_blocks, 8u);
  /* refresh a[0]: now the most recent; a[1..4] go first */
  ASSERT_EQ(kvp_index_record_routed(ix, 1, a, 1, 3), 0);
  ASSERT_EQ(kvp_index_record_routed(ix, 70, b, 4, 4), 4);
  kvp_index_stats s;
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.routed, 8u);
  ASSERT_EQ(s.routed_evicted, 4u);
  ASSERT_EQ(kvp_index_query(ix, a, 8, 5, m, MAXM), 1);
  ASSERT_EQ(m[0].worker, 1u);
  ASSERT_EQ(m[0].prefix_blocks, 1u); /* a[0] kept, a[1] evicted */
  ASSERT_EQ(kvp_index_query(ix, b, 4, 5, m, MAXM), 1);
  ASSERT_EQ(m[0].worker, 70u);
  ASSERT_EQ(m[0].routed_blocks, 4u);
  /* a chain longer than the cap keeps its newest blocks */
  kvp_key c[20];
  run(c, 500, 20);
  ASSERT_EQ(kvp_index_record_routed(ix, 70, c, 20, 6), 20);
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.routed, 8u);
  ASSERT_EQ(kvp_index_query(ix, &c[12], 8, 7, m, MAXM), 1);
  ASSERT_EQ(m[0].prefix_blocks, 8u);
  ASSERT_EQ(kvp_index_query(ix, c, 20, 7, m, MAXM), 0);
  /* removing a worker drops its records */
  ASSERT_OK(kvp_index_worker_remove(ix, 70));
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.routed, 0u);
  ASSERT_ERR(kvp_index_record_routed(ix, 70, c, 2, 8), KVP_ENOENT);
  ASSERT_ERR(kvp_index_record_routed(ix, 100, c, 2, 8), KVP_ERANGE);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

/* kvp_index_record_routed fetches keys ahead (REC_FAR / REC_NEAR in
 * index_approx.c): hints only.  Two indexes fed the same random routings --
 * long chains sharing prefixes, refreshes, pending records, a capacity that
 * evicts and a TTL that expires -- one with the prefetching off, answer
 * every query alike and keep the same counts. */
TEST(approx_prefetch_changes_nothing) {
  kvp_index *ix[2];
  for (int v = 0; v < 2; v++) {
    kvp_index_opts o = {.max_workers = 8, .approx_capacity = 3000,
                        .approx_ttl_ns = 5000};
    ASSERT_OK(kvp_index_create(&o, NULL, &ix[v]));
    for (uint32_t w = 0; w < 8; w++)
      ASSERT_OK(kvp_index_worker_add(ix[v], w));
  }
  kvp__index_set_record_prefetch(ix[1], false);
  static kvp_key ch[16][300];
  for (int c = 0; c < 16; c++) /* 4 families: the first 40 keys shared */
    for (int i = 0; i < 300; i++)
      ch[c][i] = K(i < 40 ? 100000u * (unsigned)(c % 4) + (unsigned)i
                          : 1000000u * (unsigned)(c + 1) + (unsigned)i);
  kvp_index_match m[2][MAXM];
  for (uint64_t t = 1; t < 4000; t++) {
    int c = (int)kvt_rand_below(16);
    size_t n = 1 + kvt_rand_below(300);
    uint32_t w = (uint32_t)kvt_rand_below(8);
    bool pend = kvt_rand_below(4) == 0;
    int r0 = pend ? kvp_index_record_pending(ix[0], w, ch[c], n, t * 10, 700)
                  : kvp_index_record_routed(ix[0], w, ch[c], n, t * 10);
    int r1 = pend ? kvp_index_record_pending(ix[1], w, ch[c], n, t * 10, 700)
                  : kvp_index_record_routed(ix[1], w, ch[c], n, t * 10);
    ASSERT_EQ(r0, r1);
    int q = (int)kvt_rand_below(16);
    int a = kvp_index_query(ix[0], ch[q], 300, t * 10 + 5, m[0], MAXM);
    int b = kvp_index_query(ix[1], ch[q], 300, t * 10 + 5, m[1], MAXM);
    ASSERT_EQ(a, b);
    ASSERT_TRUE(a >= 0);
    ASSERT_MEM_EQ(m[0], m[1], (size_t)a * sizeof m[0][0]);
  }
  kvp_index_stats s0, s1;
  ASSERT_OK(kvp_index_stats_get(ix[0], &s0));
  ASSERT_OK(kvp_index_stats_get(ix[1], &s1));
  ASSERT_EQ(s0.routed, s1.routed);
  ASSERT_EQ(s0.routed_evicted, s1.routed_evicted);
  ASSERT_GT(s0.routed_evicted, 0u); /* the capacity was reached */
  for (int v = 0; v < 2; v++) {
    ASSERT_OK(kvp__index_verify(ix[v]));
    kvp_index_destroy(ix[v]);
  }
}

/* ---- bad input
 * -------------------------------------------------------------------- */

/* kvp_index_seen_prefix: a key once held (then removed everywhere) or
 * routed to stays seen; one never stored is not (the filter's false
 * positives aside: 64 fresh keys in a 1 MiB filter read as seen with
 * probability ~1e-9 each). */
TEST(seen_prefix) {
  kvp_index *ix = mk(0, 2);
  kvp_key k[8], fresh[64];
  run(k, 9000, 8);
  run(fresh, 77000, 64);
  size_t n = 99;
  ASSERT_OK(kvp_index_seen_prefix(ix, k, 8, &n));
  ASSERT_EQ(n, 0u);
  ASSERT_EQ(kvp_index_stored(ix, 0, 1, KVP_TIER_HBM, NULL, k, 3), 3);
  ASSERT_OK(kvp_index_seen_prefix(ix, k, 8, &n));
  ASSERT_EQ(n, 3u);
  ASSERT_EQ(kvp_index_removed(ix, 0, 2, KVP_TIER_HBM, k, 3), 3);
  ASSERT_OK(kvp_index_seen_prefix(ix, k, 8, &n)); /* evicted, not unseen */
  ASSERT_EQ(n, 3u);
  ASSERT_GE(kvp_index_record_routed(ix, 1, k, 5, 1000), 0);
  ASSERT_OK(kvp_index_seen_prefix(ix, k, 8, &n));
  ASSERT_EQ(n, 5u);
  for (size_t i = 0; i < 64; i++) {
    ASSERT_OK(kvp_index_seen_prefix(ix, &fresh[i], 1, &n));
    ASSERT_EQ(n, 0u);
  }
  ASSERT_OK(kvp_index_seen_prefix(ix, NULL, 0, &n));
  ASSERT_EQ(n, 0u);
  ASSERT_ERR(kvp_index_seen_prefix(NULL, k, 1, &n), KVP_EINVAL);
  ASSERT_ERR(kvp_index_seen_prefix(ix, NULL, 1, &n), KVP_EINVAL);
  ASSERT_ERR(kvp_index_seen_prefix(ix, k, 1, NULL), KVP_EINVAL);
  kvp_index_destroy(ix);
}

TEST(bad_input) {
  kvp_index *ix = NULL;
  kvp_index_opts o = {0};
  ASSERT_ERR(kvp_index_create(NULL, NULL, NULL), KVP_EINVAL);
  o.reserved[3] = 1;
  ASSERT_ERR(kvp_index_create(&o, NULL, &ix), KVP_EINVAL);
  o.reserved[3] = 0;
  o.max_workers = KVP_WORKERS_MAX + 1;
  ASSERT_ERR(kvp_index_create(&o, NULL, &ix), KVP_ERANGE);
  ASSERT_NULL(ix);
  o.max_workers = 0;
  o.approx_capacity = (1u << 26) + 1;
  ASSERT_ERR(kvp_index_create(&o, NULL, &ix), KVP_ERANGE);
  kvp_index_destroy(NULL);

  ix = mk(64, 0);
  kvp_key k[4];
  run(k, 4, 4);
  k[0].lo = 0; /* a legal key, kept as fingerprint 2 */
  ASSERT_ERR(kvp_index_worker_add(ix, 64), KVP_ERANGE);
  ASSERT_OK(kvp_index_worker_add(ix, 63));
  ASSERT_ERR(kvp_index_worker_add(ix, 63), KVP_EEXIST);
  ASSERT_ERR(kvp_index_worker_remove(ix, 5), KVP_ENOENT);
  ASSERT_ERR(kvp_index_worker_remove(ix, 64), KVP_ERANGE);
  ASSERT_ERR(kvp_index_stored(ix, 64, 1, KVP_TIER_HBM, NULL, k, 4), KVP_ERANGE);
  ASSERT_ERR(kvp_index_stored(ix, UINT32_MAX, 1, KVP_TIER_HBM, NULL, k, 4),
             KVP_ERANGE);
  ASSERT_ERR(kvp_index_stored(ix, 5, 1, KVP_TIER_HBM, NULL, k, 4), KVP_ENOENT);
  ASSERT_ERR(kvp_index_removed(ix, 5, 1, KVP_TIER_HBM, k, 4), KVP_ENOENT);
  ASSERT_ERR(kvp_index_cleared(ix, 5, 1), KVP_ENOENT);
  ASSERT_ERR(kvp_index_resync(ix, 5, 1, k, NULL, 4), KVP_ENOENT);
  ASSERT_ERR(kvp_index_stored(ix, 63, 1, (kvp_tier)4, NULL, k, 4), KVP_EINVAL);
  ASSERT_ERR(kvp_index_stored(ix, 63, 1, (kvp_tier)-1, NULL, k, 4), KVP_EINVAL);
  ASSERT_ERR(kvp_index_stored(ix, 63, 1, KVP_TIER_HBM, NULL, NULL, 4),
             KVP_EINVAL);
  ASSERT_ERR(kvp_index_stored(NULL, 63, 1, KVP_TIER_HBM, NULL, k, 4),
             KVP_EINVAL);
  /* oversized chains: rejected before a key is read */
  ASSERT_ERR(kvp_index_stored(ix, 63, 1, KVP_TIER_HBM, NULL, k,
                              KVP_INDEX_CHAIN_MAX + 1),
             KVP_ERANGE);
  ASSERT_ERR(kvp_index_record_routed(ix, 63, k, KVP_INDEX_CHAIN_MAX + 1, 0),
             KVP_ERANGE);
  kvp_index_match m[MAXM];
  ASSERT_ERR(kvp_index_query(ix, k, KVP_INDEX_CHAIN_MAX + 1, 0, m, MAXM),
             KVP_ERANGE);
  ASSERT_ERR(kvp_index_query(ix, NULL, 3, 0, m, MAXM), KVP_EINVAL);
  ASSERT_ERR(kvp_index_query(ix, k, 3, 0, NULL, 2), KVP_EINVAL);
  ASSERT_ERR(kvp_index_query(NULL, k, 3, 0, m, MAXM), KVP_EINVAL);
  ASSERT_EQ(kvp_index_query(ix, k, 0, 0, m, MAXM), 0);
  uint8_t bad[4] = {0, 1, 9, 0};
  ASSERT_ERR(kvp_index_resync(ix, 63, 1, k, bad, 4), KVP_EINVAL);
  ASSERT_ERR(kvp_index_resync(ix, 63, 1, NULL, NULL, 4), KVP_EINVAL);
  /* none of the above changed anything or consumed a sequence number */
  ASSERT_EQ(info_of(ix, 63).last_seq, 0u);
  ASSERT_EQ(info_of(ix, 63).residencies, 0u);
  kvp_index_stats s;
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.events_unknown_worker, 6u);
  ASSERT_EQ(s.events_invalid, 7u);
  ASSERT_EQ(s.events_applied, 0u);
  ASSERT_EQ(s.keys, 0u);
  /* key lo 0 is stored (aliasing lo 2, as documented) */
  ASSERT_EQ(kvp_index_stored(ix, 63, 1, KVP_TIER_HBM, NULL, k, 4), 4);
  kvp_key alias = K(2);
  ASSERT_EQ(kvp_index_query(ix, &alias, 1, 0, m, MAXM), 1);
  /* events after removal are rejected; a new incarnation starts afresh */
  ASSERT_OK(kvp_index_worker_remove(ix, 63));
  ASSERT_EQ(kvp_index_query(ix, k, 4, 0, m, MAXM), 0);
  ASSERT_ERR(kvp_index_stored(ix, 63, 2, KVP_TIER_HBM, NULL, k, 4), KVP_ENOENT);
  ASSERT_ERR(kvp_index_worker_get(ix, 63, &(kvp_index_worker_info){0}),
             KVP_ENOENT);
  ASSERT_OK(kvp_index_worker_add(ix, 63));
  ASSERT_EQ(kvp_index_query(ix, k, 4, 0, m, MAXM), 0);
  ASSERT_EQ(kvp_index_stored(ix, 63, 1, KVP_TIER_HBM, NULL, k, 2), 2);
  ASSERT_EQ(info_of(ix, 63).uncertain, 0);
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.keys, 2u);
  ASSERT_EQ(s.workers, 1u);
  ASSERT_ERR(kvp_index_stats_get(ix, NULL), KVP_EINVAL);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

/* ---- allocation
 * ------------------------------------------------------------------- */

typedef struct counting_alloc {
  size_t live, allocs, fail_after; /* fail_after 0 = never */
} counting_alloc;

static void *ca_alloc(void *o, size_t n) {
  counting_alloc *c = o;
  if (c->fail_after != 0 && c->allocs >= c->fail_after)
    return NULL;
  c->allocs++;
  void *p = malloc(n);
  if (p != NULL)
    c->live += n;
  return p;
}

static void ca_free(void *o, void *p, size_t n) {
  counting_alloc *c = o;
  c->live -= n;
  free(p);
}

TEST(allocator_accounting) {
  counting_alloc c = {0};
  kvp_allocator a = {ca_alloc, ca_free, &c};
  kvp_index_opts o = {.max_workers = 128};
  kvp_index *ix = NULL;
  ASSERT_OK(kvp_index_create(&o, &a, &ix));
  static kvp_key k[20000];
  run(k, 1000, 20000);
  for (uint32_t w = 0; w < 12; w++) {
    ASSERT_OK(kvp_index_worker_add(ix, w * 10));
    ASSERT_OK(
        kvp_index_stored(ix, w * 10, 1, KVP_TIER_HBM, NULL, k,
                         2000 * (w + 1) > 20000 ? 20000 : 2000 * (w + 1)));
    ASSERT_OK(kvp_index_record_routed(ix, w * 10, k, 100, 5));
  }
  ASSERT_OK(kvp_index_removed(ix, 0, 2, KVP_TIER_HBM, k, 1000));
  ASSERT_OK(kvp_index_cleared(ix, 10, 2));
  kvp_index_stats s;
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  ASSERT_EQ(s.bytes, c.live); /* stats.bytes is all the memory held */
  ASSERT_GT(s.bytes, 20000u * 16);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
  ASSERT_EQ(c.live, 0u);
}

TEST(out_of_memory) {
  /* every allocation budget: calls fail cleanly, state stays consistent */
  static kvp_key k[3000];
  run(k, 77, 3000);
  int saw_enomem = 0;
  for (size_t budget = 1; budget < 200; budget += 7) {
    counting_alloc c = {.fail_after = budget};
    kvp_allocator a = {ca_alloc, ca_free, &c};
    kvp_index_opts o = {.max_workers = 200};
    kvp_index *ix = NULL;
    int rc = kvp_index_create(&o, &a, &ix);
    if (rc < 0) {
      ASSERT_ERR(rc, KVP_ENOMEM);
      ASSERT_NULL(ix);
      ASSERT_EQ(c.live, 0u);
      continue;
    }
    for (uint32_t w = 0; w < 8; w++) {
      ASSERT_OK(kvp_index_worker_add(ix, w * 25));
      rc = kvp_index_stored(ix, w * 25, 1, KVP_TIER_HBM, NULL, k, 3000);
      if (rc == KVP_ENOMEM) {
        saw_enomem = 1;
        ASSERT_EQ(info_of(ix, w * 25).uncertain, 1);
      } else {
        ASSERT_EQ(rc, 3000);
      }
      rc = kvp_index_record_routed(ix, w * 25, k, 1500, 1);
      ASSERT_TRUE(rc == 1500 || rc == KVP_ENOMEM);
    }
    kvp_index_match m[8];
    rc = kvp_index_query(ix, k, 3000, 1, m, 8);
    ASSERT_TRUE(rc >= 0 || rc == KVP_ENOMEM);
    ASSERT_OK(kvp__index_verify(ix));
    kvp_index_destroy(ix);
    ASSERT_EQ(c.live, 0u);
  }
  ASSERT_TRUE(saw_enomem);
}

/* ---- the two paths against a naive model
 * ------------------------------------------ */

/* One worker's key set: fp -> tier mask (0 = absent), linear probing. */
typedef struct rset {
  uint64_t fp[8192];
  uint8_t m[8192];
  uint8_t routed[8192];
} rset;

static size_t rs_slot(rset *r, uint64_t fp) {
  size_t i = (size_t)(fp * 0x9E3779B97F4A7C15ull >> 51);
  while (r->fp[i] != 0 && r->fp[i] != fp)
    i = (i + 1) & 8191;
  r->fp[i] = fp;
  return i;
}

#define NW 64
#define NCHAIN 48
#define CLEN 40

typedef struct model {
  rset w[NW];
  int added[NW];
  uint64_t seq[NW];
  uint64_t chain[NCHAIN][CLEN]; /* key lo */
} model;

static uint32_t phys(uint32_t w) { return (w * 613u + 17u) % 4096u; }

static void model_chains(model *md) {
  for (int c = 0; c < NCHAIN; c++) {
    /* chains share prefixes with an earlier chain (a tree of prompts) */
    int parent = c > 0 ? (int)kvt_rand_below((uint64_t)c) : -1;
    int shared = parent >= 0 ? (int)kvt_rand_below(CLEN) : 0;
    for (int i = 0; i < CLEN; i++)
      md->chain[c][i] = i < shared ? md->chain[parent][i] : (kvt_rand() | 4);
  }
}

/* The reference answer for worker w: 0 when it lacks block 0. */
static kvp_index_match model_match(model *md, uint32_t w, const kvp_key *k,
                                   size_t n) {
  kvp_index_match x = {0};
  x.worker = w;
  for (size_t i = 0; i < n && md->added[w]; i++) {
    size_t s = rs_slot(&md->w[w], k[i].lo);
    uint8_t m = md->w[w].m[s];
    if (m == 0 && !md->w[w].routed[s])
      break;
    x.prefix_blocks++;
    if (m == 0)
      x.routed_blocks++;
    else
      x.tier_blocks[__builtin_ctz(m)]++;
  }
  return x;
}

static void model_apply(model *md, uint32_t w, uint8_t add, uint8_t del,
                        const kvp_key *k, size_t n) {
  for (size_t i = 0; i < n; i++) {
    size_t s = rs_slot(&md->w[w], k[i].lo);
    md->w[w].m[s] = (uint8_t)((md->w[w].m[s] | add) & ~del);
  }
}

static void model_clear(model *md, uint32_t w, int routed_too) {
  for (size_t s = 0; s < 8192; s++) {
    md->w[w].m[s] = 0;
    if (routed_too)
      md->w[w].routed[s] = 0;
  }
}

/* Both indexes answer an event alike. */
static void both(int rca, int rcb) { ASSERT_EQ(rca, rcb); }

/* One random operation on worker w, applied to the model and both indexes. */
static void random_op(model *md, kvp_index *ia, kvp_index *ib, uint32_t w) {
  kvp_key k[CLEN];
  int c = (int)kvt_rand_below(NCHAIN);
  size_t lo = kvt_rand_below(CLEN), hi = lo + 1 + kvt_rand_below(CLEN - lo);
  for (size_t i = lo; i < hi; i++)
    k[i - lo] = K(md->chain[c][i]);
  size_t n = hi - lo;
  kvp_tier t = (kvp_tier)kvt_rand_below(4);
  uint64_t r = kvt_rand_below(100);
  if (!md->added[w]) {
    ASSERT_OK(kvp_index_worker_add(ia, w));
    ASSERT_OK(kvp_index_worker_add(ib, phys(w)));
    md->added[w] = 1;
    md->seq[w] = 0;
    return;
  }
  uint64_t sq = ++md->seq[w];
  if (r < 50) {
    model_apply(md, w, (uint8_t)(1u << t), 0, k, n);
    both(kvp_index_stored(ia, w, sq, t, NULL, k, n),
         kvp_index_stored(ib, phys(w), sq, t, NULL, k, n));
  } else if (r < 80) {
    model_apply(md, w, 0, (uint8_t)(1u << t), k, n);
    both(kvp_index_removed(ia, w, sq, t, k, n),
         kvp_index_removed(ib, phys(w), sq, t, k, n));
  } else if (r < 90) {
    md->seq[w]--;
    for (size_t i = 0; i < n; i++)
      md->w[w].routed[rs_slot(&md->w[w], k[i].lo)] = 1;
    both(kvp_index_record_routed(ia, w, k, n, 1),
         kvp_index_record_routed(ib, phys(w), k, n, 1));
  } else if (r < 94) {
    model_clear(md, w, 1);
    ASSERT_OK(kvp_index_cleared(ia, w, sq));
    ASSERT_OK(kvp_index_cleared(ib, phys(w), sq));
  } else if (r < 98) {
    uint8_t tiers[CLEN];
    for (size_t i = 0; i < n; i++)
      tiers[i] = (uint8_t)kvt_rand_below(4);
    model_clear(md, w, 0);
    for (size_t i = 0; i < n; i++)
      model_apply(md, w, (uint8_t)(1u << tiers[i]), 0, &k[i], 1);
    both(kvp_index_resync(ia, w, sq, k, tiers, n),
         kvp_index_resync(ib, phys(w), sq, k, tiers, n));
  } else {
    model_clear(md, w, 1);
    md->added[w] = 0;
    ASSERT_OK(kvp_index_worker_remove(ia, w));
    ASSERT_OK(kvp_index_worker_remove(ib, phys(w)));
  }
}

static int by_worker(const void *x, const void *y) {
  uint32_t a = ((const kvp_index_match *)x)->worker;
  uint32_t b = ((const kvp_index_match *)y)->worker;
  return (a > b) - (a < b);
}

static void expect_match(const kvp_index_match *got,
                         const kvp_index_match *want) {
  ASSERT_EQ(got->worker, want->worker);
  ASSERT_EQ(got->prefix_blocks, want->prefix_blocks);
  for (int t = 0; t < 4; t++)
    ASSERT_EQ(got->tier_blocks[t], want->tier_blocks[t]);
  ASSERT_EQ(got->routed_blocks, want->routed_blocks);
  ASSERT_EQ(got->uncertain, 0);
}

static void random_query(model *md, kvp_index *ia, kvp_index *ib) {
  kvp_key k[CLEN + 1];
  int c = (int)kvt_rand_below(NCHAIN);
  size_t n = 1 + kvt_rand_below(CLEN);
  for (size_t i = 0; i < n; i++)
    k[i] = K(md->chain[c][i]);
  if (kvt_rand_below(4) == 0) /* a new turn: one block nobody has */
    k[n++] = K(kvt_rand() | 4);
  kvp_index_match want[NW], ga[NW], gb[NW];
  int nw = 0;
  for (uint32_t w = 0; w < NW; w++) {
    kvp_index_match x = model_match(md, w, k, n);
    if (x.prefix_blocks > 0)
      want[nw++] = x;
  }
  int na = kvp_index_query(ia, k, n, 1, ga, NW);
  int nb = kvp_index_query(ib, k, n, 1, gb, NW);
  ASSERT_EQ(na, nw);
  ASSERT_EQ(nb, nw);
  for (int i = 0; i < nb; i++) /* back to model ids */
    for (uint32_t w = 0; w < NW; w++)
      if (phys(w) == gb[i].worker) {
        gb[i].worker = w;
        break;
      }
  qsort(gb, (size_t)nb, sizeof gb[0], by_worker);
  for (int i = 0; i < nw; i++) {
    expect_match(&ga[i], &want[i]);
    expect_match(&gb[i], &want[i]);
  }
}

static void check_digests(model *md, kvp_index *ia, kvp_index *ib) {
  static kvp_key keys[8192 * 4];
  static uint8_t tiers[8192 * 4];
  for (uint32_t w = 0; w < NW; w++) {
    if (!md->added[w])
      continue;
    size_t n = 0;
    for (size_t s = 0; s < 8192; s++)
      for (unsigned t = 0; t < 4; t++)
        if (md->w[w].m[s] & (1u << t)) {
          keys[n] = K(md->w[w].fp[s]);
          tiers[n++] = (uint8_t)t;
        }
    uint64_t want, da, db;
    ASSERT_OK(kvp_index_digest_of(keys, tiers, n, &want));
    ASSERT_OK(kvp_index_digest(ia, w, &da));
    ASSERT_OK(kvp_index_digest(ib, phys(w), &db));
    ASSERT_EQ(da, want);
    ASSERT_EQ(db, want);
  }
}

TEST(paths_agree_with_model) {
  model *md = calloc(1, sizeof *md);
  ASSERT_NOT_NULL(md);
  model_chains(md);
  kvp_index *ia = mk(64, 0), *ib = mk(0, 0);
  for (int round = 0; round < 40; round++) {
    /* skew: a few workers take most events, so keys gather > 4 holders */
    for (int op = 0; op < 400; op++) {
      uint32_t w = kvt_rand_below(3) ? (uint32_t)kvt_rand_below(12)
                                     : (uint32_t)kvt_rand_below(NW);
      random_op(md, ia, ib, w);
    }
    for (int q = 0; q < 100; q++)
      random_query(md, ia, ib);
    check_digests(md, ia, ib);
    ASSERT_OK(kvp__index_verify(ia));
    ASSERT_OK(kvp__index_verify(ib));
  }
  kvp_index_stats sa, sb;
  ASSERT_OK(kvp_index_stats_get(ia, &sa));
  ASSERT_OK(kvp_index_stats_get(ib, &sb));
  ASSERT_EQ(sa.keys, sb.keys);
  ASSERT_EQ(sa.residencies, sb.residencies);
  ASSERT_GT(sa.residencies, 0u);
  kvp_index_destroy(ia);
  kvp_index_destroy(ib);
  free(md);
}

TEST(many_holders_spill_and_shrink) {
  /* one key held by 0..N workers and back: inline <-> spilled sets, groups
   * appended, grown and compacted */
  for (int wide = 0; wide < 2; wide++) {
    kvp_index *ix = mk(wide ? 0 : 64, 0);
    uint32_t n = wide ? 4096 : 64;
    kvp_key k[2];
    run(k, 42, 2);
    kvp_index_match *m = calloc(n, sizeof *m);
    ASSERT_NOT_NULL(m);
    for (uint32_t i = 0; i < n; i++) {
      uint32_t w = wide ? (i * 2741u) % 4096u : i;
      ASSERT_OK(kvp_index_worker_add(ix, w));
      ASSERT_EQ(kvp_index_stored(ix, w, 1, (kvp_tier)(i % 4), NULL, k, 2), 2);
      if (i % 97 == 0 || i < 8)
        ASSERT_EQ(kvp_index_query(ix, k, 2, 0, m, n), (int)i + 1);
    }
    ASSERT_EQ(kvp_index_query(ix, k, 2, 0, m, n), (int)n);
    for (uint32_t i = 0; i < n; i++) {
      ASSERT_EQ(m[i].worker, i); /* every id, in order */
      ASSERT_EQ(m[i].prefix_blocks, 2u);
    }
    for (uint32_t i = 0; i < n; i++) {
      uint32_t w = wide ? (i * 2741u) % 4096u : i;
      ASSERT_EQ(kvp_index_removed(ix, w, 2, (kvp_tier)(i % 4), &k[1], 1), 1);
      if (i % 97 == 0 || i + 8 > n)
        ASSERT_EQ(kvp_index_query(ix, &k[1], 1, 0, m, n), (int)(n - i - 1));
    }
    ASSERT_OK(kvp__index_verify(ix));
    free(m);
    kvp_index_destroy(ix);
  }
}

/* ---- prefix_closed: bisection against the walk ---------------------------
 * Random clusters that keep the contract (each worker's t+1 fastest classes
 * hold a prefix of every chain): chains share family prefixes, tier t holds
 * [s_t, a_t) with a_0 <= a_1 <= ... and s_t <= a_{t-1}, some prefixes also
 * routed (approximate mode), some top tiers removed again.  Bisection must
 * give the walk's answer, byte for byte, and see no violation. */
enum { PC_FAM = 4, PC_CHAINS = 24, PC_LEN = 300 };

static size_t pc_fam_len(int chain) { /* the shared family prefix */
  return 40 + (size_t)(chain % PC_FAM) * 30;
}

static uint64_t pc_key(int chain, size_t i) {
  int fam = chain % PC_FAM;
  return i < pc_fam_len(chain) ? 0x10000000ull + (uint64_t)fam * 4096 + i
                     : 0x20000000ull + (uint64_t)chain * 4096 + i;
}

static void pc_chain(int chain, size_t n, kvp_key *k) {
  for (size_t i = 0; i < n; i++)
    k[i] = K(pc_key(chain, i));
}

/* Stores chain c on worker w keeping the contract; returns the next seq. */
static uint64_t pc_place(kvp_index *ix, uint32_t w, uint64_t seq, int c,
                         bool remove_top) {
  kvp_key k[PC_LEN];
  pc_chain(c, PC_LEN, k);
  size_t a[4], st[4], prev = 0;
  for (int t = 0; t < 4; t++) {
    size_t grow = kvt_rand_below(3) == 0 ? 0 : kvt_rand_below(PC_LEN / 3);
    a[t] = prev + grow > PC_LEN ? PC_LEN : prev + grow;
    st[t] = t == 0 ? 0 : kvt_rand_below(prev + 1); /* starts inside */
    prev = a[t];
  }
  for (int t = 0; t < 4; t++)
    if (a[t] > st[t])
      ASSERT_GE(kvp_index_stored(ix, w, seq++, (kvp_tier)t,
                                 st[t] ? &k[st[t] - 1] : NULL, &k[st[t]],
                                 a[t] - st[t]),
                0);
  /* The slowest tier drops the top of its part, beyond the family prefix
   * (other chains' placements share that): a suffix of this placement's
   * only, so the contract holds. */
  size_t cut = st[3] > pc_fam_len(c) ? st[3] : pc_fam_len(c);
  if (remove_top && a[3] > cut)
    ASSERT_GE(kvp_index_removed(ix, w, seq++, KVP_TIER_REMOTE, &k[cut],
                                a[3] - cut),
              0);
  if (kvt_rand_below(5) == 0) /* a routing record over a prefix */
    ASSERT_GE(kvp_index_record_routed(ix, w, k, kvt_rand_below(PC_LEN) + 1, 1),
              0);
  return seq;
}

enum { PC_MAXW = 320 };
static uint64_t pc_walk_blocks, pc_bis_blocks; /* read by pc_compare's */

static uint64_t pc_blocks(kvp_index *ix) {
  kvp_index_stats st;
  ASSERT_OK(kvp_index_stats_get(ix, &st));
  return st.query_blocks;
}

static void pc_compare(kvp_index *ix, uint32_t nw) {
  kvp_key k[PC_LEN + 1];
  int c = (int)kvt_rand_below(PC_CHAINS);
  size_t n = 1 + kvt_rand_below(PC_LEN);
  pc_chain(c, n, k);
  if (kvt_rand_below(4) == 0) /* a new turn nobody holds */
    k[n++] = K(kvt_rand() | 4);
  static kvp_index_match walk[PC_MAXW], bis[PC_MAXW];
  uint64_t b0 = pc_blocks(ix);
  kvp__index_set_prefix_closed(ix, false);
  int nwk = kvp_index_query(ix, k, n, 1, walk, nw);
  uint64_t b1 = pc_blocks(ix);
  kvp__index_set_prefix_closed(ix, true);
  int nbs = kvp_index_query(ix, k, n, 1, bis, nw);
  pc_walk_blocks += b1 - b0;
  pc_bis_blocks += pc_blocks(ix) - b1;
  ASSERT_GE(nwk, 0);
  ASSERT_EQ(nbs, nwk);
  ASSERT_MEM_EQ(bis, walk, (size_t)nwk * sizeof walk[0]);
}

/* Random contract-keeping clusters of nw workers with ids id[0..nw) in an
 * index of max_workers, queried by walk and by bisection. */
static void pc_cluster(uint32_t max_workers, const uint32_t *id,
                           uint32_t nw) {
  kvp_index_opts o = {.max_workers = max_workers, .prefix_closed = 1};
  kvp_index *ix = NULL;
  ASSERT_OK(kvp_index_create(&o, NULL, &ix));
  uint64_t *seq = calloc(nw, sizeof *seq);
  bool *placed = calloc((size_t)nw * PC_CHAINS, 1); /* each chain once */
  ASSERT_NOT_NULL(seq);
  ASSERT_NOT_NULL(placed);
  for (uint32_t w = 0; w < nw; w++) {
    ASSERT_OK(kvp_index_worker_add(ix, id[w]));
    seq[w] = 1;
  }
  for (int p = 0; p < 6 * (int)nw; p++) {
    uint32_t w = (uint32_t)kvt_rand_below(nw);
    int c = (int)kvt_rand_below(PC_CHAINS);
    if (!placed[(size_t)w * PC_CHAINS + c])
      seq[w] = pc_place(ix, id[w], seq[w], c, kvt_rand_below(4) == 0);
    placed[(size_t)w * PC_CHAINS + c] = true;
  }
  for (int q = 0; q < 300; q++)
    pc_compare(ix, nw);
  kvp_index_stats st;
  ASSERT_OK(kvp_index_stats_get(ix, &st));
  ASSERT_EQ(st.closure_violations, 0u);
  ASSERT_GT(st.queries, 0u);
  free(placed);
  free(seq);
  kvp_index_destroy(ix);
}

TEST(prefix_closed_bisect_matches_walk) {
  uint32_t id[64];
  for (uint32_t w = 0; w < 64; w++)
    id[w] = w;
  pc_walk_blocks = pc_bis_blocks = 0;
  for (int round = 0; round < 12; round++)
    pc_cluster(64, id, 1 + (uint32_t)kvt_rand_below(64));
  ASSERT_LT(pc_bis_blocks, pc_walk_blocks); /* it did bisect */
}

/* Beyond 64 workers: ids drawn from 1-4 worker groups of 64 spread over the
 * id space (bisection takes up to 4 groups holding block 0); then 5 groups,
 * where the query walks. */
TEST(prefix_closed_bisect_matches_walk_wide) {
  static uint32_t id[PC_MAXW];
  pc_walk_blocks = pc_bis_blocks = 0;
  for (int round = 0; round < 10; round++) {
    uint32_t groups = 1 + (uint32_t)kvt_rand_below(4);
    uint32_t gid[4], nw = 1 + (uint32_t)kvt_rand_below(groups * 48);
    for (uint32_t g = 0; g < groups; g++)
      gid[g] = g * 11 + (uint32_t)kvt_rand_below(11); /* distinct, < 64 */
    for (uint32_t w = 0; w < nw; w++) { /* distinct: group, then slot */
      uint32_t g = w % groups, slot = w / groups;
      id[w] = gid[g] * 64 + (slot * 37 + (uint32_t)round) % 64;
    }
    pc_cluster(0, id, nw);
  }
  ASSERT_LT(pc_bis_blocks, pc_walk_blocks); /* it did bisect */
  /* 5 groups hold block 0: the bisection gives up there, the query walks
   * (and reads what the walk reads) */
  pc_walk_blocks = pc_bis_blocks = 0;
  for (uint32_t w = 0; w < 300; w++)
    id[w] = w;
  pc_cluster(0, id, 300);
  ASSERT_EQ(pc_bis_blocks, pc_walk_blocks);
}

/* One worker (id w; worker 0 of another group also holds block 0 on a wide
 * index) with a hole in HBM. */
static void pc_violation(uint32_t max_workers, uint32_t w) {
  kvp_index_opts o = {.max_workers = max_workers, .prefix_closed = 2};
  kvp_index *ix = NULL;
  ASSERT_ERR(kvp_index_create(&o, NULL, &ix), KVP_ERANGE);
  o.prefix_closed = 1;
  ASSERT_OK(kvp_index_create(&o, NULL, &ix));
  ASSERT_OK(kvp_index_worker_add(ix, w));
  kvp_key k[8];
  run(k, 700, 8);
  if (w >= 64) {
    ASSERT_OK(kvp_index_worker_add(ix, 0));
    ASSERT_EQ(kvp_index_stored(ix, 0, 1, KVP_TIER_HBM, NULL, k, 1), 1);
  }
  ASSERT_EQ(kvp_index_stored(ix, w, 1, KVP_TIER_DRAM, NULL, k, 8), 8);
  ASSERT_EQ(kvp_index_stored(ix, w, 2, KVP_TIER_HBM, NULL, k, 4), 4);
  ASSERT_EQ(kvp_index_stored(ix, w, 3, KVP_TIER_HBM, &k[5], &k[6], 1), 1);
  kvp_index_match m[2];
  size_t me = w >= 64; /* worker 0 first */
  ASSERT_EQ(kvp_index_query(ix, k, 8, 0, m, 2), 1 + (int)me);
  ASSERT_EQ(m[me].worker, w);
  ASSERT_EQ(m[me].prefix_blocks, 8u);
  ASSERT_EQ(m[me].tier_blocks[KVP_TIER_HBM], 5u); /* 0..3 and 6 */
  ASSERT_EQ(m[me].tier_blocks[KVP_TIER_DRAM], 3u);
  kvp_index_stats st;
  ASSERT_OK(kvp_index_stats_get(ix, &st));
  ASSERT_EQ(st.closure_violations, 1u);
  /* the contract kept again (HBM 0..3 only): bisection answers alone */
  ASSERT_EQ(kvp_index_removed(ix, w, 4, KVP_TIER_HBM, &k[6], 1), 1);
  ASSERT_EQ(kvp_index_query(ix, k, 8, 0, m, 2), 1 + (int)me);
  ASSERT_EQ(m[me].tier_blocks[KVP_TIER_HBM], 4u);
  ASSERT_EQ(m[me].tier_blocks[KVP_TIER_DRAM], 4u);
  if (me) {
    ASSERT_EQ(m[0].worker, 0u);
    ASSERT_EQ(m[0].prefix_blocks, 1u);
  }
  ASSERT_OK(kvp_index_stats_get(ix, &st));
  ASSERT_EQ(st.closure_violations, 1u);
  ASSERT_LT(st.query_blocks, 2u * 8u); /* the second read < 8 blocks */
  kvp_index_destroy(ix);
}

/* A hole a probe lands on: counted, and the query walks (the exact answer).
 * The worker: HBM blocks 0..3 and 6, DRAM 0..7.  Bisection over 8 blocks
 * probes 0, 4 (HBM clear), then 2 and 6: HBM set at 6 after clear at 4. */
TEST(prefix_closed_violation_walks) {
  pc_violation(8, 0);
  pc_violation(0, 1000); /* wide index, two groups */
}

/* ---- event streams and epochs ---------------------------------------------
 * A worker fed by several publishers: stream 0 (the engine, HBM) and
 * kvtier stores (DRAM, NVMe) numbering their events on their own, each
 * restart a larger epoch. */

#define SRC(w, s, e, q)                                                        \
  (&(kvp_index_src){.worker = (w), .stream = (s), .epoch = (e), .seq = (q)})
#define TB(t) (1u << (t))

static kvp_index_stream_info sinfo(kvp_index *ix, uint32_t w, uint32_t s) {
  kvp_index_stream_info i;
  ASSERT_OK(kvp_index_stream_get(ix, w, s, &i));
  return i;
}

static kvp_index_stats stats_of(kvp_index *ix) {
  kvp_index_stats s;
  ASSERT_OK(kvp_index_stats_get(ix, &s));
  return s;
}

/* A worker's keys as kvp_index_worker_keys lists them. */
typedef struct klist {
  uint64_t fp[4096];
  uint32_t mask[4096];
  size_t n;
} klist;

static int klist_add(void *o, uint64_t fp, uint32_t mask) {
  klist *l = o;
  ASSERT_LT(l->n, (size_t)4096);
  ASSERT_NE(mask, 0u);
  ASSERT_EQ(mask & ~0xFu, 0u);
  l->fp[l->n] = fp;
  l->mask[l->n++] = mask;
  return 0;
}

static klist *keys_of(kvp_index *ix, uint32_t w) {
  static klist l;
  l.n = 0;
  ASSERT_OK(kvp_index_worker_keys(ix, w, klist_add, &l));
  for (size_t i = 0; i < l.n; i++) /* each key once */
    for (size_t j = i + 1; j < l.n; j++)
      ASSERT_NE(l.fp[i], l.fp[j]);
  return &l;
}

/* fp's mask in l (0: not listed). */
static uint32_t klist_mask(const klist *l, uint64_t fp) {
  for (size_t i = 0; i < l->n; i++)
    if (l->fp[i] == fp)
      return l->mask[i];
  return 0;
}

/* The worker's digest is kvp_index_digest_of over what it lists. */
static void digest_matches_keys(kvp_index *ix, uint32_t w) {
  static kvp_key k[4096 * 4];
  static uint8_t t[4096 * 4];
  const klist *l = keys_of(ix, w);
  size_t n = 0;
  for (size_t i = 0; i < l->n; i++)
    for (unsigned b = 0; b < 4; b++)
      if (l->mask[i] & TB(b)) {
        k[n] = K(l->fp[i]);
        t[n++] = (uint8_t)b;
      }
  uint64_t want, got;
  ASSERT_OK(kvp_index_digest_of(k, t, n, &want));
  ASSERT_OK(kvp_index_digest(ix, w, &got));
  ASSERT_EQ(got, want);
  ASSERT_EQ(info_of(ix, w).residencies, (uint64_t)l->n);
}

/* keys[0..n) are listed on w with exactly `mask`. */
static void expect_keys(const klist *l, const kvp_key *k, size_t n,
                        uint32_t mask) {
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(klist_mask(l, k[i].lo), mask);
}

TEST(stream_sequences_independent) {
  kvp_index *ix = mk(8, 2);
  kvp_key k[16];
  run(k, 500, 16);
  for (uint64_t q = 1; q <= 5; q++)
    ASSERT_EQ(kvp_index_stored(ix, 0, q, KVP_TIER_HBM, NULL, &k[q - 1], 1), 1);
  /* stream 1 numbers on its own: its seq 1 after stream 0's 5 */
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 1, 0, 1), KVP_TIER_DRAM, NULL,
                                 &k[8], 2),
            2);
  /* stream 0 through the src calls is the per-worker stream */
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 0, 0, 6), KVP_TIER_HBM, NULL,
                                 &k[5], 1),
            1);
  ASSERT_EQ(kvp_index_stored(ix, 0, 7, KVP_TIER_HBM, NULL, &k[6], 1), 1);
  ASSERT_ERR(kvp_index_src_stored(ix, SRC(0, 1, 0, 1), KVP_TIER_DRAM, NULL,
                                  &k[10], 1),
             KVP_EEXIST); /* stale on stream 1 */
  ASSERT_EQ(info_of(ix, 0).uncertain, 0);
  ASSERT_EQ(info_of(ix, 0).last_seq, 7u); /* stream 0's */
  kvp_index_stream_info s0 = sinfo(ix, 0, 0), s1 = sinfo(ix, 0, 1),
                        s2 = sinfo(ix, 0, 2);
  ASSERT_EQ(s0.last_seq, 7u);
  ASSERT_EQ(s0.tier_mask, TB(KVP_TIER_HBM));
  ASSERT_EQ(s1.last_seq, 1u);
  ASSERT_EQ(s1.tier_mask, TB(KVP_TIER_DRAM));
  ASSERT_EQ(s1.epoch, 0u);
  ASSERT_EQ(s2.last_seq + s2.epoch + s2.tier_mask, 0u);
  /* a gap on stream 2, then one on stream 1: applied, worker uncertain */
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 2, 0, 3), KVP_TIER_NVME, NULL,
                                 &k[10], 1),
            1);
  ASSERT_EQ(info_of(ix, 0).uncertain, 1);
  ASSERT_EQ(kvp_index_src_removed(ix, SRC(0, 1, 0, 4), KVP_TIER_DRAM, &k[8],
                                  1),
            1);
  kvp_index_match m[MAXM];
  ASSERT_EQ(kvp_index_query(ix, k, 7, 0, m, MAXM), 1);
  ASSERT_EQ(m[0].prefix_blocks, 7u);
  ASSERT_EQ(m[0].uncertain, 1);
  kvp_index_stats st = stats_of(ix);
  ASSERT_EQ(st.seq_gaps, 2u);
  ASSERT_EQ(st.events_stale, 1u);
  ASSERT_EQ(st.uncertain_workers, 1u);
  /* resyncing stream 1 clears its mark, not stream 2's */
  ASSERT_EQ(kvp_index_src_resync(ix, SRC(0, 1, 0, 9), TB(KVP_TIER_DRAM),
                                 &k[8], NULL, 1),
            1);
  ASSERT_EQ(info_of(ix, 0).uncertain, 1);
  ASSERT_EQ(sinfo(ix, 0, 1).last_seq, 9u);
  ASSERT_EQ(kvp_index_src_resync(ix, SRC(0, 2, 0, 3), TB(KVP_TIER_NVME),
                                 &k[10], NULL, 1),
            1);
  ASSERT_EQ(info_of(ix, 0).uncertain, 0);
  klist *l = keys_of(ix, 0);
  ASSERT_EQ(l->n, 9u); /* HBM 0..6, DRAM 8, NVMe 10 */
  expect_keys(l, k, 7, TB(KVP_TIER_HBM));
  expect_keys(l, &k[8], 1, TB(KVP_TIER_DRAM));
  expect_keys(l, &k[9], 1, 0); /* the snapshot dropped it */
  expect_keys(l, &k[10], 1, TB(KVP_TIER_NVME));
  digest_matches_keys(ix, 0);
  /* bad streams and sources, counted, changing nothing */
  uint64_t inv = stats_of(ix).events_invalid;
  ASSERT_ERR(kvp_index_src_stored(ix, SRC(0, KVP_INDEX_STREAMS, 0, 10),
                                  KVP_TIER_HBM, NULL, k, 1),
             KVP_ERANGE);
  ASSERT_ERR(kvp_index_src_removed(ix, SRC(0, 7, 0, 10), KVP_TIER_HBM, k, 1),
             KVP_ERANGE);
  ASSERT_ERR(kvp_index_src_cleared(ix, SRC(0, UINT32_MAX, 0, 10)),
             KVP_ERANGE);
  ASSERT_ERR(kvp_index_src_resync(ix, SRC(0, 4, 0, 10), 1, NULL, NULL, 0),
             KVP_ERANGE);
  ASSERT_ERR(kvp_index_src_stored(ix, NULL, KVP_TIER_HBM, NULL, k, 1),
             KVP_EINVAL);
  ASSERT_ERR(kvp_index_src_cleared(ix, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_index_src_stored(NULL, SRC(0, 1, 0, 10), KVP_TIER_HBM, NULL,
                                  k, 1),
             KVP_EINVAL);
  ASSERT_EQ(stats_of(ix).events_invalid, inv + 6);
  ASSERT_ERR(kvp_index_src_stored(ix, SRC(8, 1, 0, 10), KVP_TIER_HBM, NULL, k,
                                  1),
             KVP_ERANGE);
  ASSERT_ERR(kvp_index_src_stored(ix, SRC(5, 1, 0, 10), KVP_TIER_HBM, NULL, k,
                                  1),
             KVP_ENOENT);
  kvp_index_stream_info si;
  ASSERT_ERR(kvp_index_stream_get(ix, 0, KVP_INDEX_STREAMS, &si), KVP_ERANGE);
  ASSERT_ERR(kvp_index_stream_get(ix, 8, 0, &si), KVP_ERANGE);
  ASSERT_ERR(kvp_index_stream_get(ix, 5, 0, &si), KVP_ENOENT);
  ASSERT_ERR(kvp_index_stream_get(ix, 0, 0, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_index_stream_get(NULL, 0, 0, &si), KVP_EINVAL);
  ASSERT_EQ(keys_of(ix, 0)->n, 9u);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

/* A kvtier store restarts (a larger epoch on its stream): exactly the tiers
 * it fed in the old epoch go, on that worker only. */
TEST(epoch_drops_old_tiers) {
  kvp_index *ix = mk(8, 2);
  kvp_key a[8], b[8], c[8], d[8], x[2];
  run(a, 1000, 8), run(b, 2000, 8), run(c, 3000, 8), run(d, 4000, 8);
  run(x, 5000, 2);
  const uint64_t T1 = 1700000000000000000ull, T2 = T1 + 5;
  /* worker 0: engine HBM a; store (stream 1, T1) DRAM b, NVMe c and b[0..3];
   * stream 2 (epoch 7) remote d.  Worker 1: its own store's DRAM b. */
  ASSERT_EQ(kvp_index_stored(ix, 0, 1, KVP_TIER_HBM, NULL, a, 8), 8);
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 1, T1, 1), KVP_TIER_DRAM, NULL, b,
                                 8),
            8);
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 1, T1, 2), KVP_TIER_NVME, NULL, c,
                                 8),
            8);
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 1, T1, 3), KVP_TIER_NVME, NULL, b,
                                 4),
            4);
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 2, 7, 1), KVP_TIER_REMOTE, NULL,
                                 d, 8),
            8);
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(1, 1, T1, 1), KVP_TIER_DRAM, NULL, b,
                                 8),
            8);
  ASSERT_EQ(stats_of(ix).epochs, 0u); /* first epochs are no restarts */
  kvp_index_stream_info si = sinfo(ix, 0, 1);
  ASSERT_EQ(si.epoch, T1);
  ASSERT_EQ(si.last_seq, 3u);
  ASSERT_EQ(si.tier_mask, TB(KVP_TIER_DRAM) | TB(KVP_TIER_NVME));
  digest_matches_keys(ix, 0);
  /* the store restarts: its first event at T2 drops DRAM and NVMe first */
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 1, T2, 1), KVP_TIER_DRAM, NULL, x,
                                 2),
            2);
  kvp_index_stats st = stats_of(ix);
  ASSERT_EQ(st.epochs, 1u);
  ASSERT_EQ(st.epoch_drops, 20u); /* 8 DRAM, 8 + 4 NVMe */
  si = sinfo(ix, 0, 1);
  ASSERT_EQ(si.epoch, T2);
  ASSERT_EQ(si.last_seq, 1u);
  ASSERT_EQ(si.tier_mask, TB(KVP_TIER_DRAM));
  klist *l = keys_of(ix, 0);
  ASSERT_EQ(l->n, 18u);
  expect_keys(l, a, 8, TB(KVP_TIER_HBM));
  expect_keys(l, d, 8, TB(KVP_TIER_REMOTE));
  expect_keys(l, x, 2, TB(KVP_TIER_DRAM));
  expect_keys(l, b, 8, 0);
  expect_keys(l, c, 8, 0);
  digest_matches_keys(ix, 0);
  l = keys_of(ix, 1); /* another worker's store: untouched */
  ASSERT_EQ(l->n, 8u);
  expect_keys(l, b, 8, TB(KVP_TIER_DRAM));
  digest_matches_keys(ix, 1);
  kvp_index_match m[MAXM];
  ASSERT_EQ(kvp_index_query(ix, b, 8, 0, m, MAXM), 1);
  ASSERT_EQ(m[0].worker, 1u);
  ASSERT_EQ(m[0].prefix_blocks, 8u);
  ASSERT_EQ(kvp_index_query(ix, x, 2, 0, m, MAXM), 1);
  ASSERT_EQ(m[0].tier_blocks[KVP_TIER_DRAM], 2u);
  /* the old epoch's late events: stale, counted, nothing applied */
  uint64_t stale = st.events_stale;
  ASSERT_ERR(kvp_index_src_stored(ix, SRC(0, 1, T1, 4), KVP_TIER_NVME, NULL,
                                  c, 8),
             KVP_EEXIST);
  ASSERT_ERR(kvp_index_src_removed(ix, SRC(0, 1, T1, 4), KVP_TIER_DRAM, x, 2),
             KVP_EEXIST);
  ASSERT_ERR(kvp_index_src_cleared(ix, SRC(0, 1, T1, 4)), KVP_EEXIST);
  ASSERT_ERR(kvp_index_src_resync(ix, SRC(0, 1, T1, 9), TB(KVP_TIER_DRAM),
                                  NULL, NULL, 0),
             KVP_EEXIST);
  /* seq 0 is never next, in a new epoch either: nothing dropped */
  ASSERT_ERR(kvp_index_src_stored(ix, SRC(0, 1, T2 + 1, 0), KVP_TIER_DRAM,
                                  NULL, x, 1),
             KVP_EEXIST);
  ASSERT_EQ(stats_of(ix).events_stale, stale + 5);
  ASSERT_EQ(sinfo(ix, 0, 1).epoch, T2);
  ASSERT_EQ(keys_of(ix, 0)->n, 18u);
  /* a new epoch starting past seq 1 lost events: a gap */
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 1, T2 + 1, 3), KVP_TIER_NVME,
                                 NULL, c, 2),
            2);
  ASSERT_EQ(info_of(ix, 0).uncertain, 1);
  st = stats_of(ix);
  ASSERT_EQ(st.epochs, 2u);
  ASSERT_EQ(st.epoch_drops, 22u); /* x in DRAM */
  /* the next epoch takes what the lost events did with it */
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 1, T2 + 2, 1), KVP_TIER_NVME,
                                 NULL, c, 1),
            1);
  ASSERT_EQ(info_of(ix, 0).uncertain, 0);
  ASSERT_EQ(stats_of(ix).epoch_drops, 24u);
  l = keys_of(ix, 0);
  ASSERT_EQ(l->n, 17u);
  expect_keys(l, c, 1, TB(KVP_TIER_NVME));
  expect_keys(l, &c[1], 1, 0);
  digest_matches_keys(ix, 0);
  /* the per-worker calls are stream 0 at epoch 0: stale once it moved on */
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 0, 1, 1), KVP_TIER_HBM, NULL, x,
                                 1),
            1);
  l = keys_of(ix, 0); /* HBM a went with stream 0's epoch 0 */
  expect_keys(l, a, 8, 0);
  expect_keys(l, x, 1, TB(KVP_TIER_HBM));
  expect_keys(l, d, 8, TB(KVP_TIER_REMOTE));
  ASSERT_ERR(kvp_index_stored(ix, 0, 2, KVP_TIER_HBM, NULL, a, 1), KVP_EEXIST);
  ASSERT_ERR(kvp_index_resync(ix, 0, 9, NULL, NULL, 0), KVP_EEXIST);
  ASSERT_ERR(kvp_index_cleared(ix, 0, 9), KVP_EEXIST);
  digest_matches_keys(ix, 0);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

TEST(src_cleared_and_resync) {
  kvp_index *ix = mk(8, 1);
  kvp_key a[8], b[8], c[8], d[4];
  run(a, 100, 8), run(b, 200, 8), run(c, 300, 8), run(d, 400, 4);
  const uint32_t DN = TB(KVP_TIER_DRAM) | TB(KVP_TIER_NVME);
  ASSERT_EQ(kvp_index_stored(ix, 0, 1, KVP_TIER_HBM, NULL, a, 8), 8);
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 1, 5, 1), KVP_TIER_DRAM, NULL, b,
                                 8),
            8);
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 1, 5, 2), KVP_TIER_NVME, NULL, c,
                                 8),
            8);
  ASSERT_EQ(kvp_index_record_routed(ix, 0, d, 4, 1), 4);
  /* the store dropped everything: its tiers go; HBM and routing records
   * stay */
  ASSERT_EQ(kvp_index_src_cleared(ix, SRC(0, 1, 5, 3)), 16);
  klist *l = keys_of(ix, 0);
  ASSERT_EQ(l->n, 8u);
  expect_keys(l, a, 8, TB(KVP_TIER_HBM));
  kvp_index_match m[MAXM];
  ASSERT_EQ(kvp_index_query(ix, d, 4, 1, m, MAXM), 1);
  ASSERT_EQ(m[0].routed_blocks, 4u);
  ASSERT_EQ(sinfo(ix, 0, 1).tier_mask, DN); /* where the epoch stored */
  ASSERT_EQ(kvp_index_src_cleared(ix, SRC(0, 1, 5, 4)), 0);
  digest_matches_keys(ix, 0);
  /* a snapshot of DRAM + NVMe: those tiers become it, HBM untouched */
  kvp_key snap[9];
  uint8_t tiers[9];
  for (int i = 0; i < 4; i++) {
    snap[i] = b[i], tiers[i] = KVP_TIER_DRAM;
    snap[4 + i] = c[i], tiers[4 + i] = KVP_TIER_NVME;
  }
  snap[8] = a[0], tiers[8] = KVP_TIER_DRAM; /* in HBM too */
  ASSERT_EQ(kvp_index_src_resync(ix, SRC(0, 1, 5, 10), DN, snap, tiers, 9), 9);
  l = keys_of(ix, 0);
  ASSERT_EQ(l->n, 16u);
  expect_keys(l, a, 1, TB(KVP_TIER_HBM) | TB(KVP_TIER_DRAM));
  expect_keys(l, &a[1], 7, TB(KVP_TIER_HBM));
  expect_keys(l, b, 4, TB(KVP_TIER_DRAM));
  expect_keys(l, c, 4, TB(KVP_TIER_NVME));
  digest_matches_keys(ix, 0);
  kvp_index_stream_info si = sinfo(ix, 0, 1);
  ASSERT_EQ(si.last_seq, 10u);
  ASSERT_EQ(si.epoch, 5u);
  ASSERT_EQ(kvp_index_src_removed(ix, SRC(0, 1, 5, 11), KVP_TIER_DRAM, b, 1),
            1);
  ASSERT_EQ(info_of(ix, 0).uncertain, 0); /* 11 follows the snapshot's 10 */
  /* tiers NULL: the lowest tier in the mask (DRAM); NVMe empties */
  ASSERT_EQ(kvp_index_src_resync(ix, SRC(0, 1, 5, 12), DN, b, NULL, 2), 2);
  l = keys_of(ix, 0);
  ASSERT_EQ(l->n, 10u);
  expect_keys(l, a, 8, TB(KVP_TIER_HBM));
  expect_keys(l, b, 2, TB(KVP_TIER_DRAM));
  expect_keys(l, c, 8, 0);
  /* a tier outside the mask, a bad mask: EINVAL before anything changes */
  uint64_t resyncs = stats_of(ix).resyncs;
  uint8_t hbm = KVP_TIER_HBM, bad = 4;
  ASSERT_ERR(kvp_index_src_resync(ix, SRC(0, 1, 5, 13), TB(KVP_TIER_DRAM), a,
                                  &hbm, 1),
             KVP_EINVAL);
  ASSERT_ERR(kvp_index_src_resync(ix, SRC(0, 1, 5, 13), 0xFFu, a, &bad, 1),
             KVP_EINVAL);
  ASSERT_ERR(kvp_index_src_resync(ix, SRC(0, 1, 5, 13), 0x10u, NULL, NULL, 0),
             KVP_EINVAL);
  ASSERT_ERR(kvp_index_src_resync(ix, SRC(0, 1, 5, 13), 0, a, NULL, 1),
             KVP_EINVAL);
  ASSERT_ERR(kvp_index_src_resync(ix, SRC(0, 1, 5, 13), DN, NULL, NULL, 1),
             KVP_EINVAL);
  ASSERT_EQ(stats_of(ix).resyncs, resyncs);
  ASSERT_EQ(sinfo(ix, 0, 1).last_seq, 12u);
  ASSERT_EQ(keys_of(ix, 0)->n, 10u);
  /* a snapshot in a larger epoch also drops the old epoch's tiers outside
   * its mask (remote d here), in the same sweep: b[0..1] never leave */
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(0, 1, 5, 13), KVP_TIER_REMOTE, NULL,
                                 d, 4),
            4);
  uint64_t drops = stats_of(ix).epoch_drops;
  ASSERT_EQ(kvp_index_src_resync(ix, SRC(0, 1, 6, 2), TB(KVP_TIER_DRAM), b,
                                 NULL, 2),
            2);
  ASSERT_EQ(stats_of(ix).epoch_drops, drops + 4);
  si = sinfo(ix, 0, 1);
  ASSERT_EQ(si.epoch, 6u);
  ASSERT_EQ(si.last_seq, 2u);
  ASSERT_EQ(si.tier_mask, TB(KVP_TIER_DRAM));
  l = keys_of(ix, 0);
  ASSERT_EQ(l->n, 10u);
  expect_keys(l, d, 4, 0);
  expect_keys(l, b, 2, TB(KVP_TIER_DRAM));
  digest_matches_keys(ix, 0);
  /* kvp_index_cleared (stream 0): every tier and the routing records */
  ASSERT_OK(kvp_index_cleared(ix, 0, 2));
  ASSERT_EQ(keys_of(ix, 0)->n, 0u);
  ASSERT_EQ(kvp_index_query(ix, d, 4, 1, m, MAXM), 0);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

static int stop_at_three(void *o, uint64_t fp, uint32_t mask) {
  (void)fp, (void)mask;
  return ++*(int *)o == 3 ? 7 : 0;
}

TEST(worker_add_resets_streams) {
  kvp_index *ix = mk(0, 0); /* the wide path: ids across groups */
  const uint32_t w = 3000;
  kvp_key k[8];
  run(k, 60, 8);
  klist l = {.n = 0};
  ASSERT_ERR(kvp_index_worker_keys(ix, w, klist_add, &l), KVP_ENOENT);
  ASSERT_ERR(kvp_index_worker_keys(ix, 4096, klist_add, &l), KVP_ERANGE);
  ASSERT_ERR(kvp_index_worker_keys(ix, w, NULL, &l), KVP_EINVAL);
  ASSERT_ERR(kvp_index_worker_keys(NULL, w, klist_add, &l), KVP_EINVAL);
  ASSERT_OK(kvp_index_worker_add(ix, w));
  ASSERT_EQ(keys_of(ix, w)->n, 0u);
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(w, 3, 99, 1), KVP_TIER_NVME, NULL, k,
                                 8),
            8);
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(w, 1, 42, 5), KVP_TIER_DRAM, NULL, k,
                                 2),
            2);
  ASSERT_EQ(info_of(ix, w).uncertain, 1);
  int calls = 0; /* fn's non-zero return stops the walk */
  ASSERT_EQ(kvp_index_worker_keys(ix, w, stop_at_three, &calls), 7);
  ASSERT_EQ(calls, 3);
  ASSERT_OK(kvp_index_worker_remove(ix, w));
  ASSERT_ERR(kvp_index_stream_get(ix, w, 3, &(kvp_index_stream_info){0}),
             KVP_ENOENT);
  ASSERT_OK(kvp_index_worker_add(ix, w));
  for (uint32_t s = 0; s < KVP_INDEX_STREAMS; s++) {
    kvp_index_stream_info si = sinfo(ix, w, s);
    ASSERT_EQ(si.epoch + si.last_seq + si.tier_mask, 0u);
  }
  ASSERT_EQ(info_of(ix, w).uncertain, 0);
  ASSERT_EQ(keys_of(ix, w)->n, 0u);
  /* epoch 0 again: not stale, seq 1 is next, and no restart is counted */
  ASSERT_EQ(kvp_index_src_stored(ix, SRC(w, 3, 0, 1), KVP_TIER_NVME, NULL, k,
                                 1),
            1);
  ASSERT_EQ(info_of(ix, w).uncertain, 0);
  ASSERT_EQ(stats_of(ix).epochs, 0u);
  digest_matches_keys(ix, w);
  ASSERT_OK(kvp__index_verify(ix));
  kvp_index_destroy(ix);
}

/* ---- streams against a reference model --------------------------------------
 * Random events on a few workers' streams (any tier, epoch bumps, stale and
 * lost events, clears, snapshots, removals): return values, worker_keys,
 * digests, uncertain marks, stream positions and the epoch counters must
 * match a plain per-(worker, key) tier-mask array. */
#define SWK 6
#define SKEYS 300

typedef struct smodel {
  uint8_t m[SWK][SKEYS];
  uint64_t epoch[SWK][KVP_INDEX_STREAMS], last[SWK][KVP_INDEX_STREAMS];
  uint8_t smask[SWK][KVP_INDEX_STREAMS];
  uint32_t unc[SWK];
  int added[SWK];
  uint64_t epochs, drops;
} smodel;

static kvp_key skey(size_t i) { return K(10000 + i); }

/* Drops w's tiers `tiers` except keep[i]; returns residencies dropped. */
static uint64_t sm_drop(smodel *md, uint32_t w, uint32_t tiers,
                        const uint8_t *keep) {
  uint64_t n = 0;
  for (size_t i = 0; i < SKEYS; i++) {
    uint8_t d = (uint8_t)(md->m[w][i] & tiers & ~(keep ? keep[i] : 0));
    n += (uint64_t)__builtin_popcount(d);
    md->m[w][i] &= (uint8_t)~d;
  }
  return n;
}

static void sm_begin(smodel *md, uint32_t w, uint32_t s, uint64_t e,
                     uint64_t dropped) {
  if (md->epoch[w][s] || md->last[w][s] || md->smask[w][s])
    md->epochs++;
  md->drops += dropped;
  md->epoch[w][s] = e;
  md->last[w][s] = 0;
  md->smask[w][s] = 0;
  md->unc[w] &= ~(1u << s);
}

/* The epoch/sequence rules: false = stale. */
static bool sm_enter(smodel *md, uint32_t w, uint32_t s, uint64_t e,
                     uint64_t q, bool resync) {
  bool nw = e > md->epoch[w][s];
  if (e < md->epoch[w][s] || (!resync && q <= (nw ? 0 : md->last[w][s])))
    return false;
  if (resync)
    return true;
  if (nw)
    sm_begin(md, w, s, e, sm_drop(md, w, md->smask[w][s], NULL));
  if (q != md->last[w][s] + 1)
    md->unc[w] |= 1u << s;
  md->last[w][s] = q;
  return true;
}

static int sm_resync(smodel *md, kvp_index *ix, uint32_t w, uint32_t s,
                     uint64_t e, uint64_t q) {
  kvp_key k[40];
  uint8_t t[40], keep[SKEYS] = {0};
  uint32_t mask = kvt_rand_below(8) == 0 ? 0xFu : 1u + kvt_rand_below(15);
  bool null_tiers = kvt_rand_below(4) == 0;
  size_t n = kvt_rand_below(40), distinct = 0;
  for (size_t i = 0; i < n; i++) {
    size_t ki = kvt_rand_below(SKEYS);
    uint32_t bits[4], nb = 0;
    for (uint32_t b = 0; b < 4; b++)
      if (mask & TB(b))
        bits[nb++] = b;
    k[i] = skey(ki);
    t[i] = (uint8_t)(null_tiers ? bits[0] : bits[kvt_rand_below(nb)]);
    distinct += keep[ki] == 0;
    keep[ki] |= (uint8_t)TB(t[i]);
  }
  int rc = s == 0 && e == 0 && mask == 0xFu
               ? kvp_index_resync(ix, w, q, k, null_tiers ? NULL : t, n)
               : kvp_index_src_resync(ix, SRC(w, s, e, q), mask, k,
                                      null_tiers ? NULL : t, n);
  if (!sm_enter(md, w, s, e, q, true)) {
    ASSERT_ERR(rc, KVP_EEXIST);
    return rc;
  }
  bool nw = e > md->epoch[w][s];
  uint64_t dropped =
      sm_drop(md, w, mask | (nw ? md->smask[w][s] : 0u), keep);
  for (size_t i = 0; i < SKEYS; i++)
    md->m[w][i] |= keep[i];
  if (nw)
    sm_begin(md, w, s, e, dropped);
  md->smask[w][s] |= (uint8_t)mask;
  md->last[w][s] = q;
  md->unc[w] &= mask == 0xFu ? 0u : ~(1u << s);
  ASSERT_EQ(rc, (int)distinct);
  return rc;
}

/* stored / removed: a run of distinct keys in one tier. */
static void sm_event(smodel *md, kvp_index *ix, uint32_t w, uint32_t s,
                     uint64_t e, uint64_t q, bool store) {
  kvp_key k[20];
  size_t n = 1 + kvt_rand_below(20), at = kvt_rand_below(SKEYS);
  kvp_tier t = (kvp_tier)kvt_rand_below(4);
  for (size_t i = 0; i < n; i++)
    k[i] = skey((at + i) % SKEYS);
  bool legacy = s == 0 && e == 0 && kvt_rand_below(2);
  int rc = store ? legacy ? kvp_index_stored(ix, w, q, t, NULL, k, n)
                          : kvp_index_src_stored(ix, SRC(w, s, e, q), t, NULL,
                                                 k, n)
           : legacy ? kvp_index_removed(ix, w, q, t, k, n)
                    : kvp_index_src_removed(ix, SRC(w, s, e, q), t, k, n);
  if (!sm_enter(md, w, s, e, q, false)) {
    ASSERT_ERR(rc, KVP_EEXIST);
    return;
  }
  int want = 0;
  for (size_t i = 0; i < n; i++) {
    uint8_t *m = &md->m[w][(at + i) % SKEYS];
    want += store ? (*m & TB(t)) == 0 : (*m & TB(t)) != 0;
    *m = (uint8_t)(store ? *m | TB(t) : *m & ~TB(t));
  }
  if (store)
    md->smask[w][s] |= (uint8_t)TB(t);
  ASSERT_EQ(rc, want);
}

static void sm_cleared(smodel *md, kvp_index *ix, uint32_t w, uint32_t s,
                       uint64_t e, uint64_t q) {
  bool legacy = s == 0 && e == 0 && kvt_rand_below(2);
  int rc = legacy ? kvp_index_cleared(ix, w, q)
                  : kvp_index_src_cleared(ix, SRC(w, s, e, q));
  if (!sm_enter(md, w, s, e, q, false)) {
    ASSERT_ERR(rc, KVP_EEXIST);
    return;
  }
  uint64_t d = sm_drop(md, w, legacy ? 0xFu : md->smask[w][s], NULL);
  ASSERT_EQ(rc, legacy ? 0 : (int)d);
}

static void sm_op(smodel *md, kvp_index *ix, uint32_t w) {
  if (!md->added[w] || kvt_rand_below(200) == 0) { /* (re)incarnations */
    if (md->added[w])
      ASSERT_OK(kvp_index_worker_remove(ix, w));
    ASSERT_OK(kvp_index_worker_add(ix, w));
    memset(md->m[w], 0, sizeof md->m[w]);
    memset(md->epoch[w], 0, sizeof md->epoch[w]);
    memset(md->last[w], 0, sizeof md->last[w]);
    memset(md->smask[w], 0, sizeof md->smask[w]);
    md->unc[w] = 0;
    md->added[w] = 1;
    return;
  }
  uint32_t s = (uint32_t)kvt_rand_below(KVP_INDEX_STREAMS);
  uint64_t cur = md->epoch[w][s], e = cur, r = kvt_rand_below(100);
  if (r < 8)
    e = cur + 1 + kvt_rand_below(3); /* a restart */
  else if (r < 11 && cur > 0)
    e = cur - 1; /* a late event of an old life */
  uint64_t base = e > cur ? 0 : md->last[w][s], q = base + 1;
  r = kvt_rand_below(100);
  if (r < 6)
    q = base + 2; /* lost one */
  else if (r < 12)
    q = base; /* a duplicate (0: never valid) */
  r = kvt_rand_below(100);
  if (r < 50)
    sm_event(md, ix, w, s, e, q, true);
  else if (r < 80)
    sm_event(md, ix, w, s, e, q, false);
  else if (r < 88)
    sm_cleared(md, ix, w, s, e, q);
  else
    (void)sm_resync(md, ix, w, s, e, q + kvt_rand_below(3));
}

static void sm_compare(smodel *md, kvp_index *ix) {
  for (uint32_t w = 0; w < SWK; w++) {
    if (!md->added[w])
      continue;
    const klist *l = keys_of(ix, w);
    size_t want = 0;
    for (size_t i = 0; i < SKEYS; i++) {
      want += md->m[w][i] != 0;
      ASSERT_EQ(klist_mask(l, skey(i).lo), (uint32_t)md->m[w][i]);
    }
    ASSERT_EQ(l->n, want);
    digest_matches_keys(ix, w);
    ASSERT_EQ(info_of(ix, w).uncertain, md->unc[w] != 0);
    for (uint32_t s = 0; s < KVP_INDEX_STREAMS; s++) {
      kvp_index_stream_info si = sinfo(ix, w, s);
      ASSERT_EQ(si.epoch, md->epoch[w][s]);
      ASSERT_EQ(si.last_seq, md->last[w][s]);
      ASSERT_EQ(si.tier_mask, (uint32_t)md->smask[w][s]);
    }
  }
  kvp_index_stats st = stats_of(ix);
  ASSERT_EQ(st.epochs, md->epochs);
  ASSERT_EQ(st.epoch_drops, md->drops);
  ASSERT_OK(kvp__index_verify(ix));
}

TEST(streams_agree_with_model) {
  for (int wide = 0; wide < 2; wide++) {
    smodel *md = calloc(1, sizeof *md);
    ASSERT_NOT_NULL(md);
    kvp_index *ix = mk(wide ? 0 : 8, 0);
    for (int round = 0; round < 30; round++) {
      for (int op = 0; op < 200; op++)
        sm_op(md, ix, (uint32_t)kvt_rand_below(SWK));
      sm_compare(md, ix);
    }
    ASSERT_GT(md->epochs, 0u);
    ASSERT_GT(md->drops, 0u);
    kvp_index_destroy(ix);
    free(md);
  }
}

TEST_MAIN(TEST_ENTRY(prefetch_changes_nothing), TEST_ENTRY(long_probes_fast),
          TEST_ENTRY(long_probes_wide), TEST_ENTRY(long_probes_half_fast),
          TEST_ENTRY(long_probes_half_wide), TEST_ENTRY(wide_one_group_left),
          TEST_ENTRY(query_tiers_fast), TEST_ENTRY(query_tiers_wide),
          TEST_ENTRY(worker_ids_across_groups), TEST_ENTRY(gap_and_resync),
          TEST_ENTRY(resync_keeps_common_keys),
          TEST_ENTRY(digest_equality_and_divergence), TEST_ENTRY(approx_ttl), TEST_ENTRY(approx_pending_life),
          TEST_ENTRY(approx_lru_cap), TEST_ENTRY(approx_prefetch_changes_nothing),
          TEST_ENTRY(seen_prefix), TEST_ENTRY(bad_input),
          TEST_ENTRY(allocator_accounting), TEST_ENTRY(out_of_memory),
          TEST_ENTRY(paths_agree_with_model),
          TEST_ENTRY(many_holders_spill_and_shrink),
          TEST_ENTRY(prefix_closed_bisect_matches_walk),
          TEST_ENTRY(prefix_closed_bisect_matches_walk_wide),
          TEST_ENTRY(prefix_closed_violation_walks),
          TEST_ENTRY(stream_sequences_independent),
          TEST_ENTRY(epoch_drops_old_tiers), TEST_ENTRY(src_cleared_and_resync),
          TEST_ENTRY(worker_add_resets_streams),
          TEST_ENTRY(streams_agree_with_model))
