/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-bench simulator: a tiny hand-computed trace whose hit rates,
 * avoided prefill, miss causes, tier loads and TTFT are asserted exactly;
 * routing through the production index (events) and what dropping them
 * does; invariants on the bundled traces (no policy above the infinite
 * bound, reused + recomputed = prompt, nothing rejected by the ledger);
 * identical output for identical seeds. */
#include <errno.h>
#include <math.h>
#include <unistd.h>

#include <jemalloc/jemalloc.h>
#ifdef KVP_JEMALLOC_WEAK /* sanitizer builds link no jemalloc (bench/harness) */
#pragma weak mallctl
#endif

#include "harness.h"
#if defined(__SANITIZE_ADDRESS__)
#define KVT_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVT_ASAN 1
#endif
#endif
#ifdef KVT_ASAN
#include <sanitizer/asan_interface.h>
#else
#define KVT_ASAN 0
#endif

#include "core_internal.h"
#include "harness_cache.h"
#include "harness_region.h"
#include "test_harness.h"

/* mallctl, or ENOENT where jemalloc is not linked. */
static int je_mallctl(const char *name, void *old, size_t *oldlen, void *new_,
                      size_t newlen) {
  int (*volatile fn)(const char *, void *, size_t *, void *, size_t) = mallctl;
  return fn != NULL ? fn(name, old, oldlen, new_, newlen) : ENOENT;
}

static const bh_read_opts stop = {.on_error = BH_ERR_STOP, .quiet = true};

static void load(const char *text, bh_trace *t) {
  bh_src *s;
  char err[512];
  bh_trace_init(t);
  ASSERT_OK(bh_src_open_mem(text, strlen(text), "mem", &s));
  int rc = bh_read(s, BH_FMT_KVPLANE, &stop, t, err, sizeof err);
  if (rc < 0)
    fprintf(stderr, "%s\n", err);
  ASSERT_OK(rc);
  bh_src_close(s);
  ASSERT_OK(bh_trace_finish(t));
}

static void run(const bh_trace *t, const bh_sim_opts *o, bh_result *r) {
  char err[512];
  int rc = bh_sim_run(t, o, r, err, sizeof err);
  if (rc < 0)
    fprintf(stderr, "%s\n", err);
  ASSERT_OK(rc);
  ASSERT_EQ(r->ledger_rejects, 0u);
  ASSERT_EQ(r->requests, t->n_reqs);
}

/* bh_cache_to_hbm_at: a hint still naming its key's node is used; one whose
 * node was freed and reused for another key since is ignored (HBM of 2
 * blocks, no lower tier: C evicts A and takes A's node). */
TEST(cache_hint_stale) {
  bh_cluster cl;
  bh_cluster_defaults(&cl);
  cl.hbm_blocks = 2;
  bh_cache c;
  ASSERT_OK(bh_cache_init(&c, &cl, true));
  kvp_key a = {1, 11}, b = {2, 22}, k3 = {3, 33};
  bool fresh;
  ASSERT_OK(bh_cache_to_hbm(&c, a, KVP_CLASS_VOLATILE, &fresh));
  ASSERT_TRUE(fresh);
  uint32_t xa = bh_cache_find(&c, a);
  ASSERT_NE(xa, BH_NONE);
  uint32_t out = BH_NONE;
  ASSERT_OK(bh_cache_to_hbm_at(&c, xa, a, KVP_CLASS_VOLATILE, &fresh, &out));
  ASSERT_FALSE(fresh); /* the hint holds a: a hit */
  ASSERT_EQ(out, xa);
  ASSERT_OK(bh_cache_to_hbm(&c, b, KVP_CLASS_VOLATILE, &fresh));
  ASSERT_OK(bh_cache_to_hbm(&c, k3, KVP_CLASS_VOLATILE, &fresh));
  ASSERT_EQ(bh_cache_find(&c, a), BH_NONE); /* a was the LRU: evicted */
  ASSERT_EQ(bh_cache_find(&c, k3), xa);     /* ... its node now holds k3 */
  ASSERT_OK(bh_cache_to_hbm_at(&c, xa, a, KVP_CLASS_VOLATILE, &fresh, &out));
  ASSERT_TRUE(fresh); /* not taken for k3's node: a is cached anew */
  ASSERT_NE(bh_cache_find(&c, a), BH_NONE);
  ASSERT_NE(bh_cache_find(&c, a), xa);
  ASSERT_EQ(out, bh_cache_find(&c, a));
  ASSERT_EQ(c.count[KVP_TIER_HBM], 2u);
  ASSERT_EQ(c.st.evicted_blocks, 2u);
  bh_cache_free(&c);
}

/* A cache of `hbm` blocks of HBM and no lower tier. */
static void cache_hbm_only(bh_cache *c, uint64_t hbm) {
  bh_cluster cl;
  bh_cluster_defaults(&cl);
  cl.hbm_blocks = hbm;
  cl.dram_blocks = cl.nvme_blocks = 0;
  ASSERT_OK(bh_cache_init(c, &cl, true));
}

/* bh_cache_release: a request's chain released tail first keeps HBM a prefix
 * of it as other blocks push it out (vLLM's free order; the contract of
 * kvp_index_opts.prefix_closed).  Without the release, the order of use
 * evicts the head first.  HBM of 40 blocks, DRAM 0: a 30-block chain, then
 * 25 other blocks. */
static uint64_t release_kept_prefix(int release, uint64_t *held) {
  bh_cache c;
  cache_hbm_only(&c, 40);
  kvp_key k[30];
  bool fresh;
  for (int j = 0; j < 30; j++) {
    k[j] = (kvp_key){7, 1000 + (uint64_t)j};
    ASSERT_OK(bh_cache_to_hbm(&c, k[j], KVP_CLASS_VOLATILE, &fresh));
  }
  uint8_t tiers[30];
  uint32_t nodes[30];
  ASSERT_EQ(bh_cache_match(&c, k, 30, tiers, nodes), 30u);
  nodes[3] = BH_NONE; /* a hint gone stale: looked up */
  nodes[4] = nodes[5];
  if (release)
    bh_cache_release(&c, k, release == 2 ? nodes : NULL, 30);
  for (int j = 0; j < 25; j++)
    ASSERT_OK(bh_cache_to_hbm(&c, (kvp_key){8, 5000 + (uint64_t)j},
                              KVP_CLASS_VOLATILE, &fresh));
  uint64_t m = 0;
  *held = 0;
  for (int j = 0; j < 30; j++)
    *held += bh_cache_find(&c, k[j]) != BH_NONE;
  while (m < 30 && bh_cache_find(&c, k[m]) != BH_NONE)
    m++;
  ASSERT_EQ(c.count[KVP_TIER_HBM], 40u);
  bh_cache_free(&c);
  return m;
}

TEST(cache_release_tail_first) {
  uint64_t held;
  ASSERT_EQ(release_kept_prefix(1, &held), 15u); /* blocks 0..14 */
  ASSERT_EQ(held, 15u);
  ASSERT_EQ(release_kept_prefix(2, &held), 15u); /* the same, by hints */
  ASSERT_EQ(held, 15u);
  ASSERT_EQ(release_kept_prefix(0, &held), 0u); /* 15..29: no prefix */
  ASSERT_EQ(held, 15u);
}

/* The cache's table in Robin Hood order (bh_cache_slot_dist): 20,000 random
 * uses of a 3,000-block HBM (no lower tier; its table ~3/4 full, entries
 * leaving as LRU evicts them) over 6,000 keys, a quarter of them in pairs
 * whose 32-bit table hash collides.  After every 1,000: each key is found
 * exactly when a live node holds it, at that node; along the table no entry
 * lies more than one slot further from its home than the one before it. */
TEST(cache_table_robin_hood) {
  enum { U = 6000 };
  bh_cache c;
  cache_hbm_only(&c, 3000);
  static kvp_key keys[U];
  for (uint64_t j = 0; j < U; j++) /* j % 8 == 1: j - 1's lo, so its hash */
    keys[j] = (kvp_key){.lo = j % 8 == 1 ? 77 * (j - 1) : 77 * j, .hi = j};
  static uint32_t holder[U];
  size_t max_dist = 0;
  for (int step = 1; step <= 20000; step++) {
    bool fresh;
    ASSERT_OK(bh_cache_to_hbm(&c, keys[kvt_rand_below(U)], KVP_CLASS_VOLATILE,
                              &fresh));
    if (step % 1000)
      continue;
    for (uint64_t j = 0; j < U; j++)
      holder[j] = BH_NONE;
    for (uint32_t x = 0; x < c.n_nodes; x++)
      if (c.nodes[x].tier != BH_TIER_FREE)
        holder[c.nodes[x].key.hi] = x;
    for (uint64_t j = 0; j < U; j++)
      ASSERT_EQ(bh_cache_find(&c, keys[j]), holder[j]);
    size_t used = 0;
    for (size_t i = 0; i <= c.mask; i++) {
      bh_cache_slot v = c.tab[i], u = c.tab[(i + 1) & c.mask];
      if (v.idx == 0)
        continue;
      used++;
      size_t d = bh_cache_slot_dist(v, i, c.mask);
      max_dist = d > max_dist ? d : max_dist;
      ASSERT_EQ(v.h, bh_cache_hash32(c.nodes[v.idx - 1].key.lo));
      if (u.idx != 0)
        ASSERT_LE(bh_cache_slot_dist(u, (i + 1) & c.mask, c.mask), d + 1);
    }
    ASSERT_EQ(used, c.used);
    ASSERT_EQ(used, (size_t)c.count[KVP_TIER_HBM]);
  }
  ASSERT_EQ(c.count[KVP_TIER_HBM], 3000u);
  ASSERT_GT(c.st.evicted_blocks, 5000u);
  ASSERT_GT(max_dist, 3u); /* runs long enough to order */
  bh_cache_free(&c);
}

/* bh_cache_match agrees with bh_cache_find block by block, including keys
 * whose 32-bit table hash collides (same lo, or lo 2^52 apart): the first
 * hash match in the probe run is then another key's node. */
TEST(cache_match_agrees) {
  bh_cluster cl;
  bh_cluster_defaults(&cl);
  cl.hbm_blocks = 1000;
  bh_cache c;
  ASSERT_OK(bh_cache_init(&c, &cl, true));
  kvp_key keys[60];
  for (uint64_t j = 0; j < 60; j++) /* pairs 2j, 2j+1 collide */
    keys[j] = (kvp_key){.lo = 1000 + j / 2 + (j % 4 == 3 ? 1ull << 52 : 0),
                        .hi = j};
  bool fresh;
  for (uint64_t j = 0; j < 60; j++)
    if (j != 45) /* a hole: the match ends there */
      ASSERT_OK(bh_cache_to_hbm(&c, keys[60 - 1 - j], KVP_CLASS_VOLATILE,
                                &fresh));
  uint8_t tiers[60];
  uint32_t nodes[60];
  ASSERT_EQ(bh_cache_match(&c, keys, 60, tiers, nodes), 60u - 1 - 45);
  for (uint64_t j = 0; j < 60 - 1 - 45; j++) {
    ASSERT_EQ(nodes[j], bh_cache_find(&c, keys[j]));
    ASSERT_EQ(tiers[j], KVP_TIER_HBM);
  }
  ASSERT_EQ(bh_cache_match(&c, keys + 15, 0, tiers, nodes), 0u);
  bh_cache_free(&c);
}

/* bh_cache_match_hinted gives bh_cache_match's answer whatever the hints:
 * 8 chains of 40 blocks (shared heads) through a 64-block HBM over a
 * 32-block DRAM, used and released at random; each use matches with the
 * nodes its chain's last use found as hints (some since evicted, their
 * nodes freed or reused for other keys, some of their keys cached anew in
 * other nodes), with hints cut short, run long, out of range or garbled. */
TEST(cache_match_hinted) {
  bh_cluster cl;
  bh_cluster_defaults(&cl);
  cl.hbm_blocks = 64;
  cl.dram_blocks = 32;
  cl.nvme_blocks = 0;
  bh_cache c;
  ASSERT_OK(bh_cache_init(&c, &cl, true));
  enum { CH = 8, LEN = 40 };
  kvp_key keys[CH][LEN];
  uint32_t hint[CH][LEN + 8];
  uint64_t nh[CH] = {0};
  for (int k = 0; k < CH; k++)
    for (int j = 0; j < LEN; j++) /* chains 2i, 2i+1 share 10 blocks */
      keys[k][j] = j < 10 ? (kvp_key){.lo = 7000 + (uint64_t)(k / 2) * 100 + j,
                                     .hi = 1}
                          : (kvp_key){.lo = 9000 + (uint64_t)k * 100 + j,
                                      .hi = 2};
  uint64_t rng = 12345, stale = 0, moved = 0, hinted_found = 0;
  uint8_t t1[LEN], t2[LEN];
  uint32_t n1[LEN], n2[LEN];
  for (int it = 0; it < 3000; it++) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    int k = (int)(rng >> 33) % CH;
    uint64_t len = 1 + (rng >> 40) % LEN, h = nh[k];
    uint32_t hs[LEN + 8];
    memcpy(hs, hint[k], sizeof hs);
    switch ((rng >> 20) % 5) { /* the hints as a caller might hold them */
    case 0: break;
    case 1: h = h / 2; break;                          /* cut short */
    case 2: for (uint64_t j = h; j < LEN + 8; j++) hs[j] = (uint32_t)j;
            h = LEN + 8; break;                        /* run long */
    case 3: if (h > 3) hs[h / 3] = c.n_nodes + 7, hs[h / 2] = BH_NONE;
            break;                                     /* out of range */
    case 4: if (h > 1) { uint32_t x = hs[0]; hs[0] = hs[h - 1]; hs[h - 1] = x; }
            break;                                     /* garbled */
    }
    for (uint64_t j = 0; j < h && j < len; j++) {
      uint32_t f = bh_cache_find(&c, keys[k][j]);
      if (hs[j] < c.n_nodes && f != hs[j])
        *(f == BH_NONE ? &stale : &moved) += 1;
    }
    uint64_t m1 = bh_cache_match(&c, keys[k], len, t1, n1);
    uint64_t m2 = bh_cache_match_hinted(&c, keys[k], len, hs, h, t2, n2);
    ASSERT_EQ(m2, m1);
    ASSERT_EQ(memcmp(t1, t2, m1), 0);
    ASSERT_EQ(memcmp(n1, n2, m1 * sizeof *n1), 0);
    hinted_found += m1 > 0 && h > 0 && hs[0] == n1[0];
    /* the use: its blocks into HBM tail first, nodes noted, released */
    bool fresh;
    for (uint64_t j = len; j-- > 0;)
      ASSERT_OK(bh_cache_to_hbm_at(&c, j < m1 ? n1[j] : BH_NONE, keys[k][j],
                                   KVP_CLASS_VOLATILE, &fresh, &hint[k][j]));
    for (uint64_t j = 0; j < len; j++)
      ASSERT_EQ(hint[k][j], bh_cache_find(&c, keys[k][j]));
    nh[k] = len;
    bh_cache_release(&c, keys[k], hint[k], len);
  }
  /* every kind of hint was met: still right, freed, and its key elsewhere */
  ASSERT_TRUE(hinted_found > 100);
  ASSERT_TRUE(stale > 100);
  ASSERT_TRUE(moved > 10);
  bh_cache_free(&c);
}

/* Block 4 tokens, Llama-3.1-8B defaults.  Requests 100 s apart (no
 * queueing):
 *   r1 in=10 ids [1,2]   -> nothing cached: 8 never seen + 2 partial
 *   r2 in=12 ids [1,2,3] -> reuses [1,2] = 8 tokens, 4 never seen
 *   r3 in=8  ids [1,5]   -> reuses [1] = 4 tokens, 4 never seen */
#define TINY                                                                   \
  "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":4}\n"            \
  "{\"t\":0,\"in\":10,\"out\":2,\"hash_ids\":[1,2]}\n"                         \
  "{\"t\":100,\"in\":12,\"out\":2,\"hash_ids\":[1,2,3]}\n"                     \
  "{\"t\":200,\"in\":8,\"out\":2,\"hash_ids\":[1,5]}\n"

static double flops(uint64_t from, uint64_t to) { /* by hand */
  double s = 0;
  for (uint64_t t = from; t < to; t++)
    s += 2 * 8.03e9 + 4.0 * 32 * 32 * 128 * (double)t;
  return s;
}

static bh_sim_opts tiny_opts(int policy, uint32_t workers) {
  bh_sim_opts o = {.policy = policy, .seed = 7};
  bh_cluster_defaults(&o.cl);
  o.cl.workers = workers;
  return o;
}

TEST(tiny_exact) {
  bh_trace t;
  load(TINY, &t);
  const int pols[] = {KVP_POLICY_KVPLANE_COST, KVP_POLICY_PREFIX_GREEDY,
                      BH_POLICY_INFINITE};
  for (size_t p = 0; p < 3; p++) {
    bh_sim_opts o = tiny_opts(pols[p], 1);
    bh_result r;
    run(&t, &o, &r);
    const kvp_ledger_totals *x = &r.tot;
    ASSERT_EQ(x->prompt_tokens, 30u);
    ASSERT_EQ(x->reused_tokens, 12u);
    ASSERT_EQ(x->recomputed_tokens, 18u);
    ASSERT_EQ(x->reused_by_tier[KVP_TIER_HBM], 12u);
    ASSERT_EQ(x->miss_tokens[KVP_MISS_NEVER_SEEN], 16u);
    ASSERT_EQ(x->miss_tokens[KVP_MISS_PARTIAL_BLOCK], 2u);
    ASSERT_DOUBLE_NEAR(x->avoided_flops, flops(0, 8) + flops(0, 4),
                       1e-9 * x->avoided_flops);
    ASSERT_DOUBLE_NEAR(x->avoided_gpu_seconds,
                       (flops(0, 8) + flops(0, 4)) / (989e12 * 0.5), 1e-15);
    /* TTFT = prefill of the uncached tokens (no queue, HBM hits free):
     * r1 flops(0,10), r2 flops(8,12), r3 flops(4,8) */
    double f1 = flops(0, 10) / 494.5e12, f3 = flops(4, 8) / 494.5e12;
    ASSERT_DOUBLE_NEAR(r.ttft.max / 1e6, f1, 1e-6);
    ASSERT_DOUBLE_NEAR(r.ttft.min / 1e6, f3, 1e-6);
    ASSERT_EQ(r.imbalance, 1.0);
    bh_result_free(&r);
  }
  bh_trace_free(&t);
}

/* HBM of 3 blocks, released tail first (vLLM's order: bh_cache_release):
 *   r1 [1,2], r2 [1,2,3]   -> HBM [1] [1,2] [1,2,3], the head most recent
 *   r3 [7,8] (two new)     -> evicts [1,2,3], then [1,2]: the chain's tail
 *   r4 [1,2,3]             -> [1] hits, [1,2] and [1,2,3] miss as evicted
 * With a DRAM tier the evicted blocks are demoted instead, and loading them
 * beats recomputing. */
#define TIERS                                                                  \
  "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":4}\n"            \
  "{\"t\":0,\"in\":10,\"out\":2,\"hash_ids\":[1,2]}\n"                         \
  "{\"t\":100,\"in\":12,\"out\":2,\"hash_ids\":[1,2,3]}\n"                     \
  "{\"t\":200,\"in\":8,\"out\":2,\"hash_ids\":[7,8]}\n"                        \
  "{\"t\":300,\"in\":12,\"out\":2,\"hash_ids\":[1,2,3]}\n"

TEST(tiny_tiers) {
  bh_trace t;
  load(TIERS, &t);
  bh_sim_opts o = tiny_opts(KVP_POLICY_KVPLANE_COST, 1);
  o.cl.hbm_blocks = 3;
  o.cl.dram_gb = 0;
  o.cl.nvme_gb = 0;
  bh_result r;
  run(&t, &o, &r);
  ASSERT_EQ(r.tot.reused_tokens, 12u); /* r2 8, r4 4 */
  ASSERT_EQ(r.tot.miss_tokens[KVP_MISS_EVICTED], 8u);
  ASSERT_EQ(r.tot.miss_tokens[KVP_MISS_NEVER_SEEN], 20u);
  /* [1,2,3], [1,2] by r3; [7,8], [7] by r4 */
  ASSERT_EQ(r.evicted_blocks, 4u);
  bh_result_free(&r);

  o.cl.dram_blocks = 10;
  run(&t, &o, &r);
  ASSERT_EQ(r.tot.reused_tokens, 20u); /* r4: all 12 */
  ASSERT_EQ(r.tot.reused_by_tier[KVP_TIER_DRAM], 8u);
  ASSERT_EQ(r.tot.reused_by_tier[KVP_TIER_HBM], 12u);
  ASSERT_EQ(r.tot.load_bytes[KVP_TIER_DRAM], 8u * 131072u);
  /* demoted: [1,2,3] and [1,2] by r3; r4's loads (last block first) then
   * push out [1] (its own head, loaded back last), [7,8] and [7] */
  ASSERT_EQ(r.demoted_bytes[KVP_TIER_DRAM], 5u * 4u * 131072u);
  ASSERT_EQ(r.evicted_blocks, 0u);
  bh_result_free(&r);
  bh_trace_free(&t);
}

/* A generated agentic trace (24 sessions of 8 turns, subagents 0.2). */
static void load_generated(uint64_t seed, bh_trace *t) {
  bh_gen_opts g = {.seed = seed, .sessions = 24, .turns = 8,
                   .subagent_p = 0.2};
  char *buf = NULL;
  size_t nb = 0;
  FILE *m = open_memstream(&buf, &nb);
  ASSERT_NOT_NULL(m);
  ASSERT_OK(bh_gen(&g, m));
  fclose(m);
  load(buf, t);
  free(buf);
}

/* P/D: 1 prefill + 2 decode workers, a 1 GB/s link of 1 ms a pull; block 4
 * tokens of 131072 KV bytes each (Llama-3.1-8B): 524288 bytes a block.
 *   r1 in=10 ids [1,2], out 3: prefill leg on p0 computes 10 tokens; the
 *      decode leg pulls both offered blocks (1 ms + 2 x 524288 B / 1 GB/s)
 *      to whichever decode worker (D), which computes the partial 2 tokens
 *   r2 in=12 ids [1,2,3], out 3: p0 reuses 8 and computes 4; D holds [1,2]
 *      from r1's pull: it lacks 1 block (1.52 ms), the other decode worker 3
 *      (2.57 ms, past rd_pd.c's 5 % + 0.1 ms): D alone is a candidate, and
 *      pulls one block; its prefill has nothing left to compute.
 * Expectations computed here, not by the simulator's functions. */
#define PD_TINY                                                                \
  "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":4}\n"            \
  "{\"t\":0,\"in\":10,\"out\":3,\"hash_ids\":[1,2]}\n"                         \
  "{\"t\":100,\"in\":12,\"out\":3,\"hash_ids\":[1,2,3]}\n"

static bh_sim_opts pd_opts(int policy) {
  bh_sim_opts o = tiny_opts(policy, 3);
  o.cl.pd_prefill = 1;
  o.cl.pd_decode = 2;
  o.cl.link_gbps = 1;
  o.cl.link_latency_us = 1000;
  return o;
}

TEST(pd_exact) {
  bh_trace t;
  load(PD_TINY, &t);
  const int pols[] = {KVP_POLICY_KVPLANE_COST, KVP_POLICY_PREFIX_GREEDY,
                      KVP_POLICY_LEAST_LOADED, KVP_POLICY_ROUND_ROBIN};
  const double F = 989e12 * 0.5, blk = 4 * 131072.0;
  for (size_t p = 0; p < sizeof pols / sizeof *pols; p++) {
    bh_sim_opts o = pd_opts(pols[p]);
    bh_result r;
    run(&t, &o, &r);
    ASSERT_TRUE(r.pd);
    /* the ledger holds the prefill legs: p0's reuse */
    ASSERT_EQ(r.tot.prompt_tokens, 22u);
    ASSERT_EQ(r.tot.reused_tokens, 8u);
    /* transfer: r1 both blocks, r2 the one D lacks; r2's two local */
    ASSERT_EQ(r.xfer_blocks, 3u);
    ASSERT_EQ(r.xfer_bytes, (uint64_t)(3 * blk));
    ASSERT_EQ(r.local_blocks, 2u);
    /* TTFT = prefill leg + latency + bytes / link + the decode worker's
     * prefill of what was not offered */
    double t1 = flops(0, 10) / F + 1e-3 + 2 * blk / 1e9 + flops(8, 10) / F;
    double t2 = flops(8, 12) / F + 1e-3 + 1 * blk / 1e9;
    ASSERT_EQ(r.ttft.count, 2u);
    ASSERT_DOUBLE_NEAR(r.ttft.max / 1e6, t1, 2e-6);
    ASSERT_DOUBLE_NEAR(r.ttft.min / 1e6, t2, 2e-6);
    /* TPOT = out x step / (out - 1), a step = 2 ms + (weights + KV) / HBM,
     * alone in the batch */
    double s1 = 2e-3 + (2 * 8.03e9 + 10 * 131072.0) / 3.35e12;
    double s2 = 2e-3 + (2 * 8.03e9 + 12 * 131072.0) / 3.35e12;
    ASSERT_EQ(r.tpot.count, 2u);
    ASSERT_DOUBLE_NEAR(r.tpot.min / 1e6, 3 * s1 / 2, 2e-6);
    ASSERT_DOUBLE_NEAR(r.tpot.max / 1e6, 3 * s2 / 2, 2e-6);
    /* per role: p0 ran both prefill legs (10 + 4 tokens), D both decode
     * legs (2 + 0 tokens computed, 6 decoded): decode imbalance 2 */
    const bh_role_load *pr = &r.role[BH_ROLE_PREFILL];
    const bh_role_load *de = &r.role[BH_ROLE_DECODE];
    ASSERT_EQ(pr->workers, 1u);
    ASSERT_EQ(pr->legs, 2u);
    ASSERT_EQ(pr->prefill_tokens, 14u);
    ASSERT_EQ(pr->out_tokens, 0u);
    ASSERT_EQ(de->workers, 2u);
    ASSERT_EQ(de->legs, 2u);
    ASSERT_EQ(de->prefill_tokens, 2u);
    ASSERT_EQ(de->out_tokens, 6u);
    ASSERT_DOUBLE_NEAR(de->decode_s, 3 * s1 + 3 * s2, 1e-9);
    ASSERT_DOUBLE_NEAR(de->imbalance, 2.0, 1e-9);
    ASSERT_DOUBLE_NEAR(pr->imbalance, 1.0, 1e-12);
    bh_result_free(&r);
  }
  bh_trace_free(&t);
}

/* P/D: the decode holder wins over the policy's own choice.  least_loaded
 * over 1 prefill + 2 decode workers: the first request's decode leg goes to
 * decode worker 1 (both idle: the lowest) and decodes for ~200 s; the
 * second's would go to idle decode worker 2 (fewer requests), but worker 1
 * holds [1,2] from the first pull, so only it is within rd_pd.c's 5 % +
 * 0.1 ms (one block to pull, 1.52 ms, against three, 2.57 ms; its decode
 * batch adds ~1 us): 2 + 1 blocks cross (2 + 3 if load had its way). */
TEST(pd_holder_over_load) {
  bh_trace t;
  load("{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":4}\n"
       "{\"t\":0,\"in\":8,\"out\":100000,\"hash_ids\":[1,2]}\n"
       "{\"t\":100,\"in\":12,\"out\":2,\"hash_ids\":[1,2,3]}\n", &t);
  bh_sim_opts o = pd_opts(KVP_POLICY_LEAST_LOADED);
  bh_result r;
  run(&t, &o, &r);
  ASSERT_EQ(r.xfer_blocks, 3u);
  ASSERT_EQ(r.local_blocks, 2u);
  bh_result_free(&r);
  bh_trace_free(&t);
}

/* P/D on a generated trace: every request runs both legs, prefill legs only
 * on prefill workers and decode legs only on decode workers (random too);
 * the bytes are the blocks x 524288; a split the cluster does not add up to,
 * or the infinite bound, is refused with a message. */
TEST(pd_roles) {
  bh_trace t;
  load_generated(3, &t);
  const int pols[] = {KVP_POLICY_KVPLANE_COST, BH_POLICY_RANDOM};
  for (size_t p = 0; p < 2; p++) {
    bh_sim_opts o = tiny_opts(pols[p], 5);
    o.cl.pd_prefill = 2;
    o.cl.pd_decode = 3;
    bh_result r;
    run(&t, &o, &r);
    ASSERT_EQ(r.role[BH_ROLE_PREFILL].legs, t.n_reqs);
    ASSERT_EQ(r.role[BH_ROLE_DECODE].legs, t.n_reqs);
    ASSERT_EQ(r.role[BH_ROLE_PREFILL].out_tokens, 0u);
    ASSERT_EQ(r.ttft.count, t.n_reqs);
    ASSERT_EQ(r.xfer_bytes, r.xfer_blocks * (uint64_t)t.block_size * 131072u);
    ASSERT_EQ(r.role[BH_ROLE_PREFILL].prefill_tokens,
              r.tot.recomputed_tokens);
    ASSERT_GT(r.local_blocks, 0u); /* sessions decode where they did */
    bh_result_free(&r);
  }
  char err[512];
  bh_result r;
  bh_sim_opts o = tiny_opts(KVP_POLICY_KVPLANE_COST, 5);
  o.cl.pd_prefill = 2;
  o.cl.pd_decode = 2; /* 4 != 5 workers */
  ASSERT_EQ(bh_sim_run(&t, &o, &r, err, sizeof err), KVP_EINVAL);
  ASSERT_TRUE(strstr(err, "P/D") != NULL);
  bh_result_free(&r);
  o.cl.pd_decode = 3;
  o.policy = BH_POLICY_INFINITE;
  ASSERT_EQ(bh_sim_run(&t, &o, &r, err, sizeof err), KVP_EINVAL);
  ASSERT_TRUE(strstr(err, "infinite") != NULL);
  bh_result_free(&r);
  bh_trace_free(&t);
}


/* A generated agentic trace on small caches (every tier evicting): each
 * worker's residency in the router's index ends equal to its cache's (the
 * pending run's unannounced blocks included), its caches keep the
 * prefix-closed contract (released tail first) so queries bisect with
 * few violations, and bisecting gives the walk's simulation exactly. */
TEST(index_bisects_as_it_walks) {
  bh_trace t;
  load_generated(5, &t);
  const int pols[] = {KVP_POLICY_KVPLANE_COST, KVP_POLICY_ROUND_ROBIN};
  for (int p = 0; p < 2; p++)
    for (int tp = 0; tp < 2; tp++) {
      bh_sim_opts o = tiny_opts(pols[p], 6);
      o.cl.hbm_blocks = 3000; /* ~4 prompts per worker */
      o.cl.dram_blocks = 3000;
      o.cl.nvme_blocks = 3000;
      o.cl.tier_policy[KVP_TIER_DRAM] = o.cl.tier_policy[KVP_TIER_NVME] =
          tp ? KVP_TIER_POLICY_S3FIFO : KVP_TIER_POLICY_LRU;
      o.verify_index = true;
      bh_result b, w;
      run(&t, &o, &b);
      ASSERT_EQ(b.index_mismatches, 0u);
      ASSERT_GT(b.evicted_blocks, 0u);
      ASSERT_GT(b.index_queries, 0u);
      ASSERT_LT(b.index_closure_violations * 20, b.index_queries);
      o.index_walk = true;
      run(&t, &o, &w);
      ASSERT_EQ(w.index_mismatches, 0u);
      ASSERT_EQ(w.index_closure_violations, 0u);
      ASSERT_LT(b.index_query_blocks * 4, w.index_query_blocks);
      ASSERT_MEM_EQ(&b.tot, &w.tot, sizeof b.tot);
      ASSERT_EQ(b.evicted_blocks, w.evicted_blocks);
      printf("  %s, lower tiers %s: %llu queries, %llu violations, blocks "
             "read %llu (walk %llu), %llu evicted\n",
             p ? "round_robin" : "kvplane_cost", tp ? "s3fifo" : "lru",
             (unsigned long long)b.index_queries,
             (unsigned long long)b.index_closure_violations,
             (unsigned long long)b.index_query_blocks,
             (unsigned long long)w.index_query_blocks,
             (unsigned long long)b.evicted_blocks);
      bh_result_free(&b);
      bh_result_free(&w);
    }
  /* S3-FIFO in HBM keeps no recency order to release tail first: the index
   * walks every query; the events still match the caches (its FIFO evicts
   * a request's pending blocks first-in first, the run's front) */
  bh_sim_opts o = tiny_opts(KVP_POLICY_KVPLANE_COST, 6);
  o.cl.hbm_blocks = o.cl.dram_blocks = o.cl.nvme_blocks = 3000;
  o.cl.tier_policy[KVP_TIER_HBM] = KVP_TIER_POLICY_S3FIFO;
  o.verify_index = true;
  bh_result b, w;
  run(&t, &o, &b);
  o.index_walk = true;
  run(&t, &o, &w);
  ASSERT_EQ(b.index_mismatches, 0u);
  ASSERT_GT(b.evicted_blocks, 0u);
  ASSERT_EQ(b.index_closure_violations, 0u);
  ASSERT_EQ(b.index_query_blocks, w.index_query_blocks);
  ASSERT_MEM_EQ(&b.tot, &w.tot, sizeof b.tot);
  bh_result_free(&b);
  bh_result_free(&w);
  /* ... and where requests fill HBM and evict their own new blocks before
   * they are announced (round_robin): S3-FIFO sends a ghost hit to its main
   * queue, so those need not be the first added; the announced pieces and
   * the removals left out still match the caches */
  bh_trace_free(&t);
  load_generated(13, &t);
  o = tiny_opts(KVP_POLICY_ROUND_ROBIN, 6);
  o.cl.hbm_blocks = o.cl.dram_blocks = o.cl.nvme_blocks = 3000;
  for (int k = 0; k < 3; k++)
    o.cl.tier_policy[k] = KVP_TIER_POLICY_S3FIFO;
  o.verify_index = true;
  run(&t, &o, &b);
  ASSERT_EQ(b.index_mismatches, 0u);
  ASSERT_GT(b.evicted_blocks, 0u);
  bh_result_free(&b);
  bh_trace_free(&t);
}

/* Two runs of the same trace and settings, one keeping the index and one
 * not: every outcome equal. */
static void assert_same_outcome(const bh_result *a, const bh_result *b) {
  ASSERT_MEM_EQ(&a->tot, &b->tot, sizeof a->tot);
  ASSERT_MEM_EQ(&a->ttft, &b->ttft, sizeof a->ttft);
  ASSERT_EQ(a->evicted_blocks, b->evicted_blocks);
  ASSERT_MEM_EQ(a->demoted_bytes, b->demoted_bytes, sizeof a->demoted_bytes);
  ASSERT_EQ(a->events_published, b->events_published);
  ASSERT_EQ(a->events_dropped, b->events_dropped);
  ASSERT_EQ(a->events_delayed, b->events_delayed);
  ASSERT_EQ(a->event_blocks, b->event_blocks);
  ASSERT_TRUE(a->imbalance == b->imbalance);
  ASSERT_TRUE(a->sim_seconds == b->sim_seconds);
}

/* least_loaded compares no matches (kvp_policy_compares_matches): with
 * every event applied at once its run reads the chosen worker's match from
 * that worker's cache (kvp_router_route_chosen) and keeps no index, with
 * every answer the run that feeds the index and queries it (verify_index)
 * gives, tiers evicting (LRU, and S3-FIFO in every tier).  Dropped or delayed events, or routed records,
 * leave the index behind the caches: those runs keep it. */
TEST(least_loaded_without_index) {
  bh_trace t;
  load_generated(13, &t);
  for (int mode = 0; mode < 5; mode++) {
    bh_sim_opts o = tiny_opts(KVP_POLICY_LEAST_LOADED, 6);
    o.cl.hbm_blocks = o.cl.dram_blocks = o.cl.nvme_blocks = 3000;
    if (mode == 4) /* S3-FIFO everywhere: no tail-first release, the
                      index walks every query; the caches still answer */
      for (int k = 0; k < 3; k++)
        o.cl.tier_policy[k] = KVP_TIER_POLICY_S3FIFO;
    o.drop_events = mode == 1 ? 0.3 : 0;
    o.delay_events_s = mode == 2 ? 0.5 : 0;
    o.router.record_routed = mode == 3;
    bh_result a, b;
    run(&t, &o, &a);
    ASSERT_GT(a.evicted_blocks, 0u);
    ASSERT_GT(a.tot.reused_tokens, 0u);
    ASSERT_GT(a.events_published, 0u);
    if (mode > 0 && mode < 4) { /* the index kept and queried */
      ASSERT_GT(a.ix.events_applied, 0u);
      ASSERT_GT(a.index_queries, 0u);
      bh_result_free(&a);
      continue;
    }
    ASSERT_EQ(a.ix.events_applied, 0u);
    ASSERT_EQ(a.index_queries, 0u);
    o.verify_index = true;
    run(&t, &o, &b);
    ASSERT_GT(b.ix.events_applied, 0u);
    ASSERT_GT(b.index_queries, 0u);
    ASSERT_EQ(b.index_mismatches, 0u);
    assert_same_outcome(&a, &b);
    bh_result_free(&a);
    bh_result_free(&b);
  }
  bh_trace_free(&t);
}

/* round_robin and random read no matches (kvp_policy_reads_matches), so
 * their runs keep no index: every answer equals the run that feeds it
 * (verify_index), with tiers evicting and events dropped and delayed; the
 * fed run's index did the work (and matched the caches), the other none. */
TEST(unread_index_not_fed) {
  bh_trace t;
  load_generated(11, &t);
  ASSERT_EQ(kvp_policy_reads_matches(KVP_POLICY_ROUND_ROBIN), 0);
  for (int p = 0; p < KVP_POLICY_COUNT_; p++)
    if (p != KVP_POLICY_ROUND_ROBIN)
      ASSERT_EQ(kvp_policy_reads_matches((kvp_policy)p), 1);
  const int pols[] = {KVP_POLICY_ROUND_ROBIN, BH_POLICY_RANDOM};
  for (int p = 0; p < 2; p++)
    for (int mode = 0; mode < 3; mode++) {
      bh_sim_opts o = tiny_opts(pols[p], 6);
      o.cl.hbm_blocks = o.cl.dram_blocks = o.cl.nvme_blocks = 3000;
      o.drop_events = mode == 1 ? 0.3 : 0;
      o.delay_events_s = mode == 2 ? 0.5 : 0;
      bh_result a, b;
      run(&t, &o, &a);
      o.verify_index = true;
      run(&t, &o, &b);
      ASSERT_GT(a.evicted_blocks, 0u);
      ASSERT_GT(a.tot.reused_tokens, 0u);
      ASSERT_GT(a.events_published, 0u);
      ASSERT_EQ(a.ix.events_applied, 0u);
      ASSERT_EQ(a.index_queries, 0u);
      ASSERT_GT(b.ix.events_applied, 0u);
      if (mode == 0) /* dropped events leave it behind, as they should */
        ASSERT_EQ(b.index_mismatches, 0u);
      assert_same_outcome(&a, &b);
      if (mode == 1)
        ASSERT_GT(a.events_dropped, 0u);
      if (mode == 2)
        ASSERT_GT(a.events_delayed, 0u);
      bh_result_free(&a);
      bh_result_free(&b);
    }
  bh_trace_free(&t);
}

/* The "on another worker" miss cause (the longest run from the first miss
 * that one other worker holds, read from the session's last worker's nodes
 * first) equals a block-by-block count over every worker, on a generated
 * agentic trace with every tier evicting, for the policies that scatter
 * sessions and the one that keeps them. */
TEST(other_worker_cause_brute_force) {
  bh_trace t;
  load_generated(13, &t);
  const int pols[] = {KVP_POLICY_ROUND_ROBIN, BH_POLICY_RANDOM,
                      KVP_POLICY_KVPLANE_COST};
  for (int p = 0; p < 3; p++) {
    bh_sim_opts o = tiny_opts(pols[p], 6);
    o.cl.hbm_blocks = o.cl.dram_blocks = o.cl.nvme_blocks = 1500;
    o.verify_causes = true;
    bh_result r;
    run(&t, &o, &r);
    ASSERT_EQ(r.cause_mismatches, 0u);
    ASSERT_GT(r.evicted_blocks, 0u);
    if (p < 2) {
      ASSERT_GT(r.cause_hinted, 50u);
      ASSERT_GT(r.tot.miss_tokens[KVP_MISS_OTHER_WORKER], 0u);
    }
    printf("  %s: %llu runs read from the last worker's nodes first, %llu "
           "tokens missed on another worker\n",
           bh_policy_name(pols[p]), (unsigned long long)r.cause_hinted,
           (unsigned long long)r.tot.miss_tokens[KVP_MISS_OTHER_WORKER]);
    bh_result_free(&r);
  }
  bh_trace_free(&t);
}

/* Two workers: round robin sends r2 away from r1's cache (its 8 tokens
 * miss "on another worker"); prefix_greedy follows the index, which only
 * knows because worker 0 published its stored events. */
TEST(routing_follows_events) {
  const char *text =
      "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":4}\n"
      "{\"t\":0,\"in\":10,\"out\":2,\"hash_ids\":[1,2]}\n"
      "{\"t\":50,\"in\":8,\"out\":2,\"hash_ids\":[9,9]}\n"
      "{\"t\":100,\"in\":12,\"out\":2,\"hash_ids\":[1,2,3]}\n";
  bh_trace t;
  load(text, &t);
  bh_result r;
  bh_sim_opts o = tiny_opts(KVP_POLICY_ROUND_ROBIN, 2);
  run(&t, &o, &r); /* r1 -> w0, r2 -> w1, r3 -> w0: hits */
  ASSERT_EQ(r.tot.reused_tokens, 8u);
  bh_result_free(&r);
  const char *text2 =
      "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":4}\n"
      "{\"t\":0,\"in\":10,\"out\":2,\"hash_ids\":[1,2]}\n"
      "{\"t\":100,\"in\":12,\"out\":2,\"hash_ids\":[1,2,3]}\n";
  bh_trace u;
  load(text2, &u);
  run(&u, &o, &r); /* r1 -> w0, r2 -> w1: miss on the other worker */
  ASSERT_EQ(r.tot.reused_tokens, 0u);
  ASSERT_EQ(r.tot.miss_tokens[KVP_MISS_OTHER_WORKER], 8u);
  bh_result_free(&r);
  /* prefix_greedy: r2 follows r1's blocks to worker 0 although worker 0 is
   * busy with a 200K-token prefill -- because worker 0 published them */
  const char *text3 =
      "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":4}\n"
      "{\"t\":0,\"in\":10,\"out\":2,\"hash_ids\":[1,2]}\n"
      "{\"t\":1,\"in\":200000,\"out\":2,\"hash_ids\":[]}\n"
      "{\"t\":1.5,\"in\":12,\"out\":2,\"hash_ids\":[1,2,3]}\n";
  bh_trace v;
  load(text3, &v);
  o = tiny_opts(KVP_POLICY_PREFIX_GREEDY, 2);
  run(&v, &o, &r);
  ASSERT_EQ(r.tot.reused_tokens, 8u);
  ASSERT_GT(r.events_published, 0u);
  ASSERT_EQ(r.ix.events_applied, r.events_published);
  ASSERT_GT(r.ttft.max, 1000000u); /* r2 waited behind the long prefill */
  bh_result_free(&r);
  /* every event lost: the index knows nothing, r2 goes to the idle worker
   * and its 8 tokens miss on the other worker */
  o.drop_events = 1.0;
  run(&v, &o, &r);
  ASSERT_EQ(r.ix.events_applied, 0u);
  ASSERT_EQ(r.events_dropped, r.events_published);
  ASSERT_EQ(r.tot.reused_tokens, 0u);
  ASSERT_EQ(r.tot.miss_tokens[KVP_MISS_OTHER_WORKER], 8u);
  bh_result_free(&r);
  /* delayed past r2's arrival: the same miss; delayed less: the hit */
  o.drop_events = 0;
  o.delay_events_s = 5.0;
  run(&v, &o, &r);
  ASSERT_EQ(r.tot.reused_tokens, 0u);
  ASSERT_EQ(r.events_delayed, r.events_published);
  bh_result_free(&r);
  o.delay_events_s = 0.1;
  run(&v, &o, &r);
  ASSERT_EQ(r.tot.reused_tokens, 8u);
  bh_result_free(&r);
  bh_trace_free(&v);
  bh_trace_free(&t);
  bh_trace_free(&u);
}

/* One block per tier.  r4 brings [1] back from NVMe (recomputed: loading 4
 * tokens from NVMe costs more than computing them) and the cascade that
 * makes room in HBM must not evict the very block being promoted (it once
 * did: a freed node was reused and the LRU lists looped forever). */
TEST(promote_from_last_tier) {
  const char *text =
      "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":4}\n"
      "{\"t\":0,\"in\":4,\"out\":1,\"hash_ids\":[1]}\n"
      "{\"t\":1,\"in\":4,\"out\":1,\"hash_ids\":[2]}\n"
      "{\"t\":2,\"in\":4,\"out\":1,\"hash_ids\":[3]}\n"
      "{\"t\":3,\"in\":4,\"out\":1,\"hash_ids\":[1]}\n"
      "{\"t\":4,\"in\":4,\"out\":1,\"hash_ids\":[1]}\n";
  bh_trace t;
  load(text, &t);
  bh_sim_opts o = tiny_opts(KVP_POLICY_KVPLANE_COST, 1);
  o.cl.hbm_blocks = o.cl.dram_blocks = o.cl.nvme_blocks = 1;
  bh_result r;
  run(&t, &o, &r);
  ASSERT_EQ(r.tot.miss_tokens[KVP_MISS_NOT_WORTH_LOADING], 4u);
  ASSERT_EQ(r.tot.reused_tokens, 4u); /* r5: [1] is back in HBM */
  ASSERT_EQ(r.evicted_blocks, 0u);
  ASSERT_EQ(r.ix.residencies, 3u); /* the index agrees: 3 blocks, 3 tiers */
  bh_result_free(&r);
  bh_trace_free(&t);
}

/* The DRAM tier runs kvtier's placement policy (kvp_tier_policy).  HBM 1
 * block (LRU), DRAM 4, no NVMe, one block per request, 100 s apart:
 *   r1 [A]; r2 [A]: HBM hit (A reused once); r3 [B] demotes A (its reuse
 *   travels with it: one policy touch); r4..r7 [C],[D],[E],[F] demote B..E.
 *   r7 makes room in the full DRAM tier:
 *     LRU evicts A (the oldest);
 *     S3-FIFO finds A in its small FIFO with a hit, moves it to the main
 *     FIFO, and evicts B (small FIFO tail, never reused).
 *   r8 [A]: LRU misses it (evicted; recomputing it demotes F, which evicts
 *   B too); S3-FIFO loads it from DRAM. */
TEST(dram_policy_exact) {
  const char *text =
      "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":4}\n"
      "{\"t\":0,\"in\":4,\"out\":1,\"hash_ids\":[1]}\n"
      "{\"t\":100,\"in\":4,\"out\":1,\"hash_ids\":[1]}\n"
      "{\"t\":200,\"in\":4,\"out\":1,\"hash_ids\":[2]}\n"
      "{\"t\":300,\"in\":4,\"out\":1,\"hash_ids\":[3]}\n"
      "{\"t\":400,\"in\":4,\"out\":1,\"hash_ids\":[4]}\n"
      "{\"t\":500,\"in\":4,\"out\":1,\"hash_ids\":[5]}\n"
      "{\"t\":600,\"in\":4,\"out\":1,\"hash_ids\":[6]}\n"
      "{\"t\":700,\"in\":4,\"out\":1,\"hash_ids\":[1]}\n";
  bh_trace t;
  load(text, &t);
  bh_sim_opts o = tiny_opts(KVP_POLICY_KVPLANE_COST, 1);
  o.cl.hbm_blocks = 1;
  o.cl.dram_blocks = 4;
  o.cl.nvme_gb = 0;
  o.cl.tier_no_classes = true;
  ASSERT_EQ((int)o.cl.tier_policy[KVP_TIER_DRAM], (int)KVP_TIER_POLICY_LRU);
  bh_result r;
  run(&t, &o, &r);
  ASSERT_EQ(r.tot.reused_tokens, 4u); /* r2 */
  ASSERT_EQ(r.tot.reused_by_tier[KVP_TIER_HBM], 4u);
  ASSERT_EQ(r.tot.miss_tokens[KVP_MISS_EVICTED], 4u); /* r8 */
  ASSERT_EQ(r.evicted_blocks, 2u);                    /* A, then B */
  ASSERT_EQ(r.demoted_bytes[KVP_TIER_DRAM], 6u * 4u * 131072u);
  bh_result_free(&r);

  o.cl.tier_policy[KVP_TIER_DRAM] = KVP_TIER_POLICY_S3FIFO;
  run(&t, &o, &r);
  ASSERT_EQ(r.tot.reused_tokens, 8u); /* r2 from HBM, r8 from DRAM */
  ASSERT_EQ(r.tot.reused_by_tier[KVP_TIER_HBM], 4u);
  ASSERT_EQ(r.tot.reused_by_tier[KVP_TIER_DRAM], 4u);
  ASSERT_EQ(r.tot.load_bytes[KVP_TIER_DRAM], 4u * 131072u);
  ASSERT_EQ(r.tot.miss_tokens[KVP_MISS_EVICTED], 0u);
  ASSERT_EQ(r.evicted_blocks, 1u); /* B */
  ASSERT_EQ(r.demoted_bytes[KVP_TIER_DRAM], 6u * 4u * 131072u);
  bh_result_free(&r);

  /* without the reuse travelling down (A demoted as never reused) S3-FIFO
   * would evict A first as well: the HBM hit is what saves it.  Same trace
   * minus r2: both policies lose A. */
  bh_trace u;
  const char *no_r2 = strstr(text, "{\"t\":200");
  char buf[1024];
  snprintf(buf, sizeof buf,
           "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":4}\n"
           "{\"t\":0,\"in\":4,\"out\":1,\"hash_ids\":[1]}\n"
           "{\"t\":100,\"in\":4,\"out\":1,\"hash_ids\":[9]}\n%s",
           no_r2);
  load(buf, &u);
  for (int k = 0; k < 2; k++) {
    o.cl.tier_policy[KVP_TIER_DRAM] =
        k ? KVP_TIER_POLICY_S3FIFO : KVP_TIER_POLICY_LRU;
    run(&u, &o, &r);
    ASSERT_EQ(r.tot.reused_tokens, 0u);
    ASSERT_EQ(r.tot.miss_tokens[KVP_MISS_EVICTED], 4u);
    bh_result_free(&r);
  }
  bh_trace_free(&u);
  bh_trace_free(&t);
}

/* A session whose system prompt changed (block 0): the blocks its last
 * turn had are prompt drift, the new one never seen; another session's
 * change is not drift. */
TEST(prompt_drift) {
  const char *text =
      "{\"format\":\"kvplane-trace\",\"version\":1,\"block_size\":4}\n"
      "{\"t\":0,\"in\":12,\"out\":2,\"session\":\"a\",\"hash_ids\":[1,2,3]}\n"
      "{\"t\":10,\"in\":16,\"out\":2,\"session\":\"a\",\"hash_ids\":[9,2,3,4]}\n"
      "{\"t\":20,\"in\":8,\"out\":2,\"session\":\"b\",\"hash_ids\":[7,7]}\n";
  bh_trace t;
  load(text, &t);
  bh_sim_opts o = tiny_opts(KVP_POLICY_KVPLANE_COST, 1);
  bh_result r;
  run(&t, &o, &r);
  ASSERT_EQ(r.tot.reused_tokens, 0u);
  ASSERT_EQ(r.tot.miss_tokens[KVP_MISS_DRIFT], 12u);
  ASSERT_EQ(r.tot.miss_tokens[KVP_MISS_NEVER_SEEN], 12u + 4u + 8u);
  bh_result_free(&r);
  bh_trace_free(&t);
}

static void read_shared(const char *rel, uint64_t limit, bh_trace *t) {
  char p[4096], err[512];
  kvt_shared_path(rel, p, sizeof p);
  if (access(p, R_OK) != 0)
    KVT_SKIP_BECAUSE("%s not found", p);
  bh_read_opts o = stop;
  o.max_requests = limit;
  bh_trace_init(t);
  ASSERT_OK(bh_read_path(p, BH_FMT_AUTO, &o, t, err, sizeof err));
  ASSERT_OK(bh_trace_finish(t));
}

static void invariants(const bh_trace *t) {
  bh_result res[BH_POLICY_COUNT];
  uint64_t prompt = bh_trace_prompt_tokens(t);
  for (int p = 0; p < BH_POLICY_COUNT; p++) {
    bh_sim_opts o = tiny_opts(p, 8);
    o.speed = 4; /* some queueing */
    run(t, &o, &res[p]);
    const kvp_ledger_totals *x = &res[p].tot;
    ASSERT_EQ(x->prompt_tokens, prompt);
    ASSERT_EQ(x->reused_tokens + x->recomputed_tokens, prompt);
    uint64_t m = 0, tiers = 0;
    for (int c = 0; c < KVP_MISS_COUNT_; c++)
      m += x->miss_tokens[c];
    for (int k = 0; k < KVP_TIER_COUNT_; k++)
      tiers += x->reused_by_tier[k];
    ASSERT_EQ(m, x->recomputed_tokens);
    ASSERT_EQ(tiers, x->reused_tokens);
    ASSERT_EQ(kvp_hist_count(res[p].ttft_us), t->n_reqs);
    ASSERT_GE(res[p].imbalance, 1.0);
  }
  for (int p = 0; p < BH_POLICY_COUNT; p++) {
    ASSERT_LE(res[p].tot.reused_tokens, res[BH_POLICY_INFINITE].tot.reused_tokens);
    bh_result_free(&res[p]);
  }
}

TEST(invariants_mooncake) {
  bh_trace t;
  read_shared("traces/mooncake_conversation.jsonl.zst", 3000, &t);
  invariants(&t);
  bh_trace_free(&t);
}

TEST(invariants_agentic) {
  bh_trace t;
  read_shared("traces/cc_agentic", 400, &t);
  invariants(&t);
  bh_trace_free(&t);
}

/* The infinite bound reuses, per request, the longest prefix of its blocks
 * all sent by earlier requests: computed here block by block over a plain
 * set, against the simulator's (which starts past the session's previous
 * prompt and looks up the rest).  Agentic sessions: turns extend, and
 * sessions share the system + tools prefix. */
TEST(infinite_brute_force) {
  bh_trace t;
  read_shared("traces/cc_agentic", 400, &t);
  size_t cap = 1;
  while (cap < 2 * t.n_keys + 2)
    cap *= 2;
  kvp_key *set = calloc(cap, sizeof *set);
  ASSERT_TRUE(set != NULL);
  uint64_t want = 0, extend = 0;
  for (size_t i = 0; i < t.n_reqs; i++) {
    const bh_req *q = &t.reqs[i];
    const kvp_key *k = t.keys + q->key_off;
    uint64_t m = 0;
    bool prefix = true;
    for (uint32_t j = 0; j < q->n_blocks; j++) {
      size_t h = (size_t)(k[j].lo * 0x9E3779B97F4A7C15ull >> 20) & (cap - 1);
      while ((set[h].lo | set[h].hi) != 0 && !kvp_key_eq(set[h], k[j]))
        h = (h + 1) & (cap - 1);
      bool had = (set[h].lo | set[h].hi) != 0;
      prefix = prefix && had;
      m += prefix;
      set[h] = k[j];
    }
    want += m * t.block_size;
    extend += m > 0 && q->session != 0;
  }
  free(set);
  ASSERT_TRUE(extend > 100); /* later turns of sessions: the new path */
  bh_sim_opts o = tiny_opts(BH_POLICY_INFINITE, 8);
  bh_result r;
  run(&t, &o, &r);
  ASSERT_EQ(r.tot.reused_tokens, want);
  bh_result_free(&r);
  bh_trace_free(&t);
}

static void same(const bh_result *a, const bh_result *b) {
  ASSERT_MEM_EQ(&a->tot, &b->tot, sizeof a->tot);
  ASSERT_EQ(a->ttft.p50, b->ttft.p50);
  ASSERT_EQ(a->ttft.p99, b->ttft.p99);
  ASSERT_EQ(a->ttft.max, b->ttft.max);
  ASSERT_EQ(a->events_published, b->events_published);
  ASSERT_EQ(a->events_dropped, b->events_dropped);
  ASSERT_EQ(a->sim_seconds, b->sim_seconds);
  for (uint32_t i = 0; i < a->series.n; i++) {
    ASSERT_TRUE(a->series.hit[i] == b->series.hit[i] ||
                (isnan(a->series.hit[i]) && isnan(b->series.hit[i])));
  }
}

TEST(deterministic) {
  bh_trace t;
  read_shared("traces/mooncake_conversation.jsonl.zst", 2000, &t);
  const int pols[] = {KVP_POLICY_KVPLANE_COST, KVP_POLICY_DYNAMO,
                      BH_POLICY_RANDOM};
  for (size_t i = 0; i < 3; i++) {
    bh_sim_opts o = tiny_opts(pols[i], 8);
    o.speed = 8;
    o.drop_events = 0.05; /* randomness on the event path too */
    o.router.dynamo_temperature = 0.5;
    bh_result a, b;
    run(&t, &o, &a);
    run(&t, &o, &b);
    same(&a, &b);
    ASSERT_GT(a.events_dropped, 0u);
    bh_result_free(&a);
    bh_result_free(&b);
  }
  /* closed loop too */
  bh_sim_opts o = tiny_opts(KVP_POLICY_KVPLANE_COST, 4);
  o.closed_loop = 16;
  bh_result a, b;
  run(&t, &o, &a);
  run(&t, &o, &b);
  same(&a, &b);
  bh_result_free(&a);
  bh_result_free(&b);
  bh_trace_free(&t);
}

/* The harness and a router built straight from the config agree: every
 * model:, gpu: and routing: key reaches the router the simulator creates
 * (bh_sim_router_opts) unchanged, and the simulated decode's HBM bandwidth
 * is the config's. */
TEST(config_router_agrees) {
  static const char y[] =
      "model:\n  layers: 40\n  heads: 40\n  kv_heads: 8\n  head_dim: 128\n"
      "  dtype_bytes: 2\n  params_billion: 13\n"
      "gpu:\n  tflops: 400\n  efficiency: 0.4\n  hbm_bandwidth_gbps: 2000\n"
      "  dram_bandwidth_gbps: 25\n  nvme_bandwidth_gbps: 3\n"
      "  dram_latency_us: 15\n  nvme_latency_us: 150\n"
      "routing:\n  guard: 1.5\n  guard_min_load: 2\n  affinity_eps_rel: 0.1\n"
      "  tie_rel: 0.02\n  dynamo_temperature: 0.5\n  llmd_w_prefix: 2\n"
      "  llmd_w_kv: 1\n  llmd_w_queue: 3\n";
  char err[256];
  kvp_config *c;
  ASSERT_OK(kvp_config_load_mem(y, strlen(y), "a.yaml", NULL, &c, err,
                                sizeof err));
  kvp_router_opts direct = {0}, tuning = {0}, used;
  ASSERT_EQ(kvp_router_opts_from_config(c, &direct, NULL, 0, err, sizeof err),
            21);
  ASSERT_EQ(kvp_router_opts_from_config(c, &tuning, NULL, 0, err, sizeof err),
            21);
  kvp_config_destroy(c);
  bh_sim_opts so = {.policy = KVP_POLICY_DYNAMO, .router = tuning, .seed = 5};
  bh_cluster_defaults(&so.cl);
  bh_cluster_from_router(&so.cl, &tuning);
  bh_sim_router_opts(&so, 32, &used);
  direct.policy = KVP_POLICY_DYNAMO;
  direct.n_workers = so.cl.workers;
  direct.block_size = 32;
  direct.seed = 5;
  ASSERT_EQ(memcmp(&used, &direct, sizeof used), 0);
  ASSERT_DOUBLE_NEAR(so.cl.hbm_bw, 2000e9, 0);
  ASSERT_DOUBLE_NEAR(so.cl.gpu.latency_s[KVP_TIER_NVME], 150e-6, 0);
}

/* Regions (harness_region.h): big allocations carved in order, 64-byte
 * aligned and apart; small ones and those past the end from malloc; a
 * region given back is the one taken next for as much or less, its pages
 * still in memory; a bigger request maps a new one. */
TEST(region_carves_and_keeps) {
  bh_region_drain();
  bh_region *r = NULL;
  ASSERT_EQ(bh_region_take(0, &r), KVP_EINVAL);
  ASSERT_EQ(bh_region_take(1, NULL), KVP_EINVAL);
  ASSERT_OK(bh_region_take((size_t)3 << 20, &r));
  ASSERT_EQ(bh_region_size(r), (size_t)4 << 20); /* whole 2 MiB pages */
  ASSERT_EQ((uintptr_t)bh_region_base(r) % ((size_t)2 << 20), 0u);
  kvp_allocator a = bh_region_allocator(r);
  unsigned char *small = kvp__malloc(&a, 100);
  unsigned char *p1 = kvp__malloc(&a, BH_REGION_MIN + 1);
  unsigned char *p2 = kvp__calloc(&a, (size_t)1 << 20, 1);
  ASSERT_NOT_NULL(small);
  ASSERT_FALSE(bh_region_has(r, small));
  ASSERT_TRUE(bh_region_has(r, p1));
  ASSERT_TRUE(bh_region_has(r, p2));
  ASSERT_EQ((uintptr_t)p1 % 64, 0u);
  ASSERT_EQ((uintptr_t)p2 % 64, 0u);
  ASSERT_GE((uintptr_t)p2, (uintptr_t)p1 + BH_REGION_MIN + 1);
  ASSERT_EQ(bh_region_used(r), (size_t)(p2 - p1) + ((size_t)1 << 20));
  memset(p1, 0x5a, BH_REGION_MIN + 1);
  memset(p2, 0x5a, (size_t)1 << 20);
#if KVT_ASAN
  /* under ASan: the padding after p1 and the uncarved rest are poisoned */
  ASSERT_TRUE(__asan_address_is_poisoned(p1 + BH_REGION_MIN + 1));
  ASSERT_TRUE(__asan_address_is_poisoned(p2 + ((size_t)1 << 20)));
  ASSERT_FALSE(__asan_address_is_poisoned(p1 + BH_REGION_MIN));
#endif
  unsigned char *big = kvp__malloc(&a, (size_t)3 << 20); /* no room left */
  ASSERT_NOT_NULL(big);
  ASSERT_FALSE(bh_region_has(r, big));
  kvp__free(&a, big, (size_t)3 << 20);
  kvp__free(&a, small, 100);
  kvp__free(&a, p1, BH_REGION_MIN + 1); /* nothing: the region's */
  size_t peak = bh_region_peak(r);
  ASSERT_EQ(peak, bh_region_used(r));
  bh_region_give(r);
#if KVT_ASAN
  ASSERT_TRUE(__asan_address_is_poisoned(p2)); /* given back: poisoned */
#endif
  bh_region *again = NULL;
  ASSERT_OK(bh_region_take((size_t)1 << 20, &again));
  ASSERT_TRUE(again == r); /* the kept one: big enough */
  ASSERT_EQ(bh_region_used(again), 0u);
  ASSERT_EQ(bh_region_peak(again), peak);
  ASSERT_EQ(kvt_resident_pages(bh_region_base(again), peak),
            kvt_pages(bh_region_base(again), peak)); /* still in memory */
  a = bh_region_allocator(again);
  unsigned char *q = kvp__calloc(&a, BH_REGION_MIN, 1);
  ASSERT_TRUE(q == p1); /* the same offsets again, cleared by calloc */
  size_t nonzero = 0;
  for (size_t i = 0; i < BH_REGION_MIN; i++)
    nonzero += q[i] != 0;
  ASSERT_EQ(nonzero, 0u);
  bh_region *other = NULL;
  ASSERT_OK(bh_region_take((size_t)1 << 20, &other)); /* again is taken */
  ASSERT_FALSE(other == again);
  bh_region_give(other);
  bh_region_give(again);
  bh_region *bigger = NULL;
  ASSERT_OK(bh_region_take((size_t)9 << 20, &bigger));
  ASSERT_GE(bh_region_size(bigger), (size_t)9 << 20);
  ASSERT_EQ(bh_region_peak(bigger), 0u); /* a new mapping */
  bh_region_give(bigger);
  bh_region_give(NULL);
  bh_region_drain();
}

/* Batch simulations carve their workers' arrays from a region the process
 * keeps: one run without, one with a fresh region, one with the region the
 * run before left dirty give the same results, with kvtier's placement
 * (LRU and S3-FIFO, whose ghosts come from the region too) evicting down
 * all three tiers and every worker's index digest checked. */
TEST(region_sims_agree) {
  bh_trace t;
  read_shared("traces/mooncake_conversation.jsonl.zst", 2000, &t);
  const int pols[] = {KVP_POLICY_KVPLANE_COST, BH_POLICY_RANDOM};
  for (int k = 0; k < 2; k++)
    for (size_t i = 0; i < 2; i++) {
      bh_region_drain();
      bh_sim_opts o = tiny_opts(pols[i], 4);
      o.cl.hbm_blocks = 2048;
      o.cl.dram_blocks = 2048;
      o.cl.nvme_blocks = 4096;
      for (int j = 0; j < 3; j++)
        o.cl.tier_policy[j] =
            k ? KVP_TIER_POLICY_S3FIFO : KVP_TIER_POLICY_LRU;
      o.verify_index = true;
      bh_result a, b, c;
      run(&t, &o, &a);
      bh_huge_arrays = true; /* what bh_batch_memory sets */
      run(&t, &o, &b);
      run(&t, &o, &c);
      bh_huge_arrays = false;
      same(&a, &b);
      same(&a, &c);
      ASSERT_MEM_EQ(a.demoted_bytes, c.demoted_bytes, sizeof a.demoted_bytes);
      ASSERT_EQ(a.evicted_blocks, c.evicted_blocks);
      ASSERT_GT(a.evicted_blocks, 0u); /* NVMe full: down every tier */
      ASSERT_EQ(a.index_mismatches, 0u);
      ASSERT_EQ(c.index_mismatches, 0u);
      bh_region *r = NULL; /* the simulations gave theirs back */
      ASSERT_OK(bh_region_take(1, &r));
      ASSERT_GE(bh_region_size(r),
                (size_t)o.cl.workers * bh_cache_reserve_bytes(&o.cl));
      ASSERT_GT(bh_region_peak(r), (size_t)o.cl.workers * 4096 * 16);
      bh_region_give(r);
      bh_result_free(&a);
      bh_result_free(&b);
      bh_result_free(&c);
    }
  bh_region_drain();
  bh_trace_free(&t);
}

/* bh_batch_memory: memory calloc hands back again is cleared in place
 * (still in memory: no page to fault in again), below jemalloc's oversize
 * threshold and above it, and calling it twice changes nothing.  Where
 * malloc is not jemalloc's (sanitizer builds) only the clearing is
 * checked.  Runs last: it sets the process's allocator up for batches. */
TEST(batch_memory) {
  bh_batch_memory();
  bh_batch_memory(); /* not hooks that forward to themselves */
  uint64_t a0 = 0, a1 = 0;
  size_t sz = sizeof a0;
  void *probe = NULL;
  bool je = je_mallctl("thread.allocated", &a0, &sz, NULL, 0) == 0 &&
            (probe = malloc(1u << 20)) != NULL &&
            je_mallctl("thread.allocated", &a1, &sz, NULL, 0) == 0 && a1 > a0;
  free(probe);
  const size_t sizes[2] = {(size_t)6 << 20, (size_t)24 << 20};
  for (int round = 0; round < 4; round++) {
    size_t size = sizes[round % 2];
    unsigned char *p = malloc(size);
    ASSERT_NOT_NULL(p);
    memset(p, 0xa5, size);
    free(p);
    unsigned char *q = calloc(size, 1);
    ASSERT_NOT_NULL(q);
    if (je) /* freed memory reused, none faulted in again */
      ASSERT_EQ(kvt_resident_pages(q, size), kvt_pages(q, size));
    size_t nonzero = 0;
    for (size_t i = 0; i < size; i++)
      nonzero += q[i] != 0;
    ASSERT_EQ(nonzero, 0u);
    free(q);
  }
}

TEST_MAIN(TEST_ENTRY(config_router_agrees), TEST_ENTRY(cache_hint_stale), TEST_ENTRY(cache_table_robin_hood), TEST_ENTRY(cache_release_tail_first), TEST_ENTRY(index_bisects_as_it_walks), TEST_ENTRY(unread_index_not_fed), TEST_ENTRY(least_loaded_without_index), TEST_ENTRY(other_worker_cause_brute_force),
          TEST_ENTRY(cache_match_agrees), TEST_ENTRY(cache_match_hinted), TEST_ENTRY(tiny_exact), TEST_ENTRY(tiny_tiers), TEST_ENTRY(pd_exact), TEST_ENTRY(pd_holder_over_load), TEST_ENTRY(pd_roles),
          TEST_ENTRY(routing_follows_events), TEST_ENTRY(prompt_drift),
          TEST_ENTRY(promote_from_last_tier), TEST_ENTRY(dram_policy_exact),
          TEST_ENTRY(deterministic),
          TEST_ENTRY(invariants_mooncake), TEST_ENTRY(invariants_agentic),
          TEST_ENTRY(infinite_brute_force), TEST_ENTRY(region_carves_and_keeps),
          TEST_ENTRY(region_sims_agree), TEST_ENTRY(batch_memory))
