/* SPDX-License-Identifier: Apache-2.0 */
/* One worker's KV block cache and the engine timing model, shared by the
 * offline simulator (harness_sim.c) and the emulated vLLM workers
 * (harness_engine.c): the same placement and the same arithmetic, so a live
 * replay and the simulator differ only in what the wire adds.
 *
 * The cache: HBM / DRAM / NVMe placed by kvtier's own cascade (a policy
 * per tier, demotion down the tiers, the NVMe admission gate optional).
 * Every change of residency is reported through the
 * publish hook (the simulator feeds its index, the engine its ZMQ stream).
 * Not thread-safe: one cache per worker, used by one thread. */
#ifndef KVP_BENCH_HARNESS_CACHE_H
#define KVP_BENCH_HARNESS_CACHE_H

#include "harness.h"
#include "kvtier_place.h"

#define BH_NONE UINT32_MAX
#define BH_TIER_FREE 0xFF /* bh_cache_node.tier of a node on the free list */

/* Called for every residency change of `key` in tier `tier` (stored or
 * removed); `id` is the cache's publish_id.  A negative return aborts the
 * operation and is passed up. */
typedef int (*bh_cache_publish_fn)(void *ctx, uint32_t id, int tier,
                                   bool stored, const kvp_key *key);

typedef struct bh_cache_node {
  kvp_key key;
  uint32_t next; /* free list */
  uint8_t tier;
  uint8_t cls;  /* kvp_class: the most stable any request saw it as */
  uint8_t hits; /* reuses since it last entered its tier (saturates at 3) */
  uint8_t reuses; /* reuses since it was first cached (saturates at 255) */
  uint8_t adm;    /* NVMe admission cell + 1 while on NVMe, else 0 */
  uint8_t unannounced; /* 1: new in HBM (bh_cache_to_hbm_at, *fresh), its
                          store not yet published by the caller
                          (bh_cache_announce): leaving HBM first, it is not
                          published as removed (what was never stored) */
} bh_cache_node;

typedef struct bh_cache_stats {
  uint64_t demoted_bytes[3]; /* bytes written into each tier by demotion */
  uint64_t evicted_blocks;
  uint64_t nvme_admitted, nvme_rejected;
} bh_cache_stats;

/* Node ids are the policies' ids.  pol[k] NULL: no policy (the infinite
 * bound's cache, which never evicts). */
/* A slot of the open-addressing table: the node and its key's home hash, so
 * probing, growing and deleting compare and move slots without touching the
 * nodes (one cache line per probe run instead of a random node read per
 * step: what keeps large clusters' replays from being memory bound). */
typedef struct bh_cache_slot {
  uint32_t idx; /* node index + 1; 0 = empty */
  uint32_t h;   /* bh_cache_hash32 of the key: home = h & mask (< 2^32) */
} bh_cache_slot;

/* How far slot i's entry v lies past its home (mask: the table's).  The
 * table keeps Robin Hood order: along a probe run no entry lies nearer its
 * home than the one before it, less one; so a probe for a key at distance d
 * that meets an entry at a smaller distance has passed where the key would
 * be: not cached.  A lookup that misses ends after about as many slots as
 * one that hits (linear probing at 3/4 load reads ~8.5 slots to miss). */
static inline size_t bh_cache_slot_dist(bh_cache_slot v, size_t i,
                                        size_t mask) {
  return (i - (v.h & mask)) & mask;
}

/* n zeroed elements of size bytes, *raw the block to free: in 2 MiB pages
 * (kvp__huge_calloc) when bh_huge_arrays is set (bh_batch_memory) and
 * they are that big, else calloc's. */
extern bool bh_huge_arrays;
void *bh_big_calloc(size_t n, size_t size, void **raw);

typedef struct bh_cache {
  bh_cache_slot *tab; /* open addressing, linear probing, Robin Hood order
                         (bh_cache_slot_dist) */
  size_t mask, used;
  bh_cache_node *nodes;
  void *tab_raw, *nodes_raw; /* the blocks tab and nodes lie in */
  uint32_t n_nodes, cap_nodes, free_list;
  kvp_allocator alloc; /* the arrays' and kvtier's (alloc NULL: malloc's,
                          2 MiB pages by bh_big_calloc) */
  tier_cascade *cas; /* kvtier's placement: a policy per tier and the NVMe
                        gate (or none: every demotion is written); NULL: no
                        placement (the infinite bound's cache) */
  tier_policy *hot;  /* HBM's policy (NULL: none), for bh_cache_prefetch */
  bool classes; /* stability-aware: insert with the block's class */
  bool hbm_lru; /* HBM's policy keeps a recency order (LRU) */
  uint64_t count[3], cap[3];
  tier_admit_cost adm_cost;     /* one block's costs, for the gate */
  uint64_t block_bytes;         /* KV bytes of one block (demoted_bytes) */
  bh_cache_publish_fn publish;  /* NULL: nothing published */
  void *publish_ctx;
  uint32_t publish_id;
  bh_cache_stats st;
} bh_cache;

/* policies false: one unbounded HBM tier without a policy.  The caller sets
 * adm_cost, block_bytes and the publish hook after init.  Returns 0 or
 * KVP_ENOMEM / a kvtier error. */
int bh_cache_init(bh_cache *c, const bh_cluster *cl, bool policies);
/* About what bh_cache_init_in takes from its allocator for a worker of cl
 * with policies (more rather than less). */
size_t bh_cache_reserve_bytes(const bh_cluster *cl);
/* The same, the arrays and kvtier's placement from `alloc` (NULL: as
 * bh_cache_init): a batch simulation's region (harness_region.h). */
int bh_cache_init_in(bh_cache *c, const bh_cluster *cl, bool policies,
                     const kvp_allocator *alloc);
void bh_cache_free(bh_cache *c);
/* Node of key k, or BH_NONE. */
uint32_t bh_cache_find(const bh_cache *c, kvp_key k);

static inline uint32_t bh_cache_hash32(uint64_t fp) {
  return (uint32_t)(fp * 0x9E3779B97F4A7C15ull >> 20);
}

/* Loads, ahead of bh_cache_find(keys[j]), the slot of keys[j + 2A] and,
 * its line already in, the node of keys[j + A]: a request's blocks are
 * looked up in a loop whose keys are known in advance, so the probes' cache
 * misses overlap instead of queueing one after another.  A loop from j0
 * calls bh_cache_prefetch_begin(j0) first, for the slots of its first 2A
 * keys (else they would come one miss at a time).  The node is the first
 * of the key's probe run (up to 4 slots) whose hash matches. */
#define BH_PREFETCH_AHEAD 8
static inline void bh_cache_prefetch_begin(const bh_cache *c,
                                           const kvp_key *keys, uint64_t j0,
                                           uint64_t n) {
  for (uint64_t j = j0; j < n && j < j0 + 2 * BH_PREFETCH_AHEAD; j++)
    __builtin_prefetch(&c->tab[bh_cache_hash32(keys[j].lo) & c->mask]);
}

static inline void bh_cache_prefetch(const bh_cache *c, const kvp_key *keys,
                                     uint64_t j, uint64_t n) {
  if (j + 2 * BH_PREFETCH_AHEAD < n) /* first the slot ... */
    __builtin_prefetch(
        &c->tab[bh_cache_hash32(keys[j + 2 * BH_PREFETCH_AHEAD].lo) & c->mask]);
  if (j + BH_PREFETCH_AHEAD >= n)
    return;
  uint32_t h = bh_cache_hash32(keys[j + BH_PREFETCH_AHEAD].lo);
  size_t i = h & c->mask; /* ... then the node */
  for (size_t k = 0; k < 4; k++, i = (i + 1) & c->mask) {
    bh_cache_slot v = c->tab[i];
    if (v.idx == 0 || bh_cache_slot_dist(v, i, c->mask) < k)
      return;
    if (v.h == h) {
      __builtin_prefetch(&c->nodes[v.idx - 1]);
      kvp__tier_policy_prefetch(c->hot, v.idx - 1);
      return;
    }
  }
}
/* The cached prefix of keys[0..n): its length m, and for j < m the tier
 * (tiers[j]) and node (nodes[j]) of block j.  The same answer as calling
 * bh_cache_find block by block, through a pipeline: each key's slot line
 * is loaded 2 * BH_PREFETCH_AHEAD blocks ahead and its probe run read
 * BH_PREFETCH_AHEAD ahead, where the node whose hash matches is noted
 * (and prefetched); at the block itself only that node is compared, so
 * the slot line is read once, not twice. */
uint64_t bh_cache_match(const bh_cache *c, const kvp_key *keys, uint64_t n,
                        uint8_t *tiers, uint32_t *nodes);
/* The same answer, given hints[0..nh): the nodes that held keys[0..nh)
 * some time ago (a session's previous turn on this worker).  While a hint's
 * node still holds its key, the block is found in that node, one line read
 * (prefetched from the hint array, no table probe first); from the first
 * hint that no longer does (freed, or reused for another key), or past the
 * hints, the table decides as in bh_cache_match.  A key has one node at a
 * time, so a hint that still holds its key is the block's node. */
uint64_t bh_cache_match_hinted(const bh_cache *c, const kvp_key *keys,
                               uint64_t n, const uint32_t *hints, uint64_t nh,
                               uint8_t *tiers, uint32_t *nodes);
/* A new node for k (not yet on a tier: bh_cache_tier_insert next). */
int bh_cache_node_new(bh_cache *c, kvp_key k, uint32_t *out);
int bh_cache_tier_insert(bh_cache *c, uint32_t x, int k);
/* Block key now in HBM (hit there, loaded from below, or new), seen as
 * class cls by the request at hand; *fresh: it was not cached (the caller
 * publishes its store, batched into runs as engines do, and then calls
 * bh_cache_announce; until it does, the block is unannounced: should it
 * leave HBM first, its removal from HBM is not published either, its
 * demotion's store below is). */
int bh_cache_to_hbm(bh_cache *c, kvp_key key, kvp_class cls, bool *fresh);
/* The same, with hint = the node bh_cache_find returned for key earlier
 * (BH_NONE: none): used when it still holds key, which saves the table
 * probe; any other node (freed or reused since) is ignored.  *out (NULL:
 * not wanted): the block's node, now in HBM. */
int bh_cache_to_hbm_at(bh_cache *c, uint32_t hint, kvp_key key, kvp_class cls,
                       bool *fresh, uint32_t *out);
/* Whether node v still holds the key whose 64-bit hash (key.lo, what KV
 * events carry) is lo, new in HBM and unannounced: the caller's pending
 * store of it stands (else it left HBM before it was announced, and the
 * node may hold another key since). */
static inline bool bh_cache_unannounced(const bh_cache *c, uint32_t v,
                                        uint64_t lo) {
  return v < c->n_nodes && c->nodes[v].unannounced && c->nodes[v].key.lo == lo;
}
/* Node v's store was published: from now on its moves are. */
static inline void bh_cache_announce(bh_cache *c, uint32_t v) {
  c->nodes[v].unannounced = 0;
}
/* A request's blocks keys[0..n) released as vLLM frees them, tail first:
 * each one still in HBM becomes the most recently used there, the last
 * block first, so the chain's head goes last.  With the stability classes
 * (tail classes evicted first) this keeps each worker's HBM, and HBM + DRAM,
 * a prefix of every chain: the contract kvp_index_opts.prefix_closed lets
 * the router bisect under.  No counters change (not a hit).  hints (NULL:
 * none): the nodes bh_cache_match gave for keys, used where they still
 * hold them (saves the table probes).  LRU only: S3-FIFO keeps no recency
 * order. */
void bh_cache_release(bh_cache *c, const kvp_key *keys, const uint32_t *hints,
                      uint64_t n);

/* ---- the engine timing model ------------------------------------------------ */
typedef struct bh_timing {
  bh_cluster cl;  /* resolved: bandwidths, latencies filled */
  double kvb;     /* KV bytes per token */
  double flops_s; /* FLOP/s achieved in prefill */
  uint32_t bs;    /* block size, tokens */
} bh_timing;

/* From a resolved cluster (bh_cluster_resolve) and the router that reads the
 * same spec (its defaults for the tier bandwidths).  Writes the filled-in
 * GPU spec back into *cl too. */
void bh_timing_setup(bh_timing *t, bh_cluster *cl, uint32_t block_size,
                     const kvp_router *rt);
/* Seconds to load blocks[k] blocks from tier k (HBM hits are read in place). */
double bh_timing_load_s(const bh_timing *t, const uint64_t blocks[3]);
/* Seconds to prefill tokens [from, to) of a prompt. */
double bh_timing_prefill_s(const bh_timing *t, uint64_t from, uint64_t to);
/* A whole prefill step: the cluster's fixed prefill_base_s, blocks[0] HBM
 * hits at cached_token_s a token, the loads of blocks[1..2] and the
 * compute of tokens [from, to). */
double bh_timing_step_s(const bh_timing *t, const uint64_t blocks[3],
                        uint64_t from, uint64_t to);
/* Seconds to decode out_tokens for a prompt of in_tokens joining a batch of
 * `decoding` requests holding decode_tokens KV tokens. */
double bh_timing_decode_s(const bh_timing *t, uint32_t decoding,
                          uint64_t decode_tokens, uint64_t in_tokens,
                          uint32_t out_tokens);
/* ---- the P/D link (kvplane-bench engine --prefill/--decode, and run's) ----
 * A decode leg pulls the prompt blocks it lacks from the prefill worker over
 * one modelled link: latency + bytes / bandwidth, bytes = blocks x block
 * size x the model's KV bytes per token; no contention between pulls.  The
 * units are kvplane-routerd's pd.link_gbps (GB/s, 1e9 bytes) and
 * pd.link_latency_us. */
#define BH_LINK_GBPS_DEFAULT 25.0
#define BH_LINK_LATENCY_US_DEFAULT 50.0
/* KV bytes of `blocks` blocks. */
double bh_timing_link_bytes(const bh_timing *t, uint64_t blocks);
/* Seconds to pull `blocks` blocks over a link of gbps GB/s and latency_us
 * (0 for no blocks: nothing crosses). */
double bh_timing_link_s(const bh_timing *t, double gbps, double latency_us,
                        uint64_t blocks);
/* The payoff cut: of the m matched blocks (tiers[j] = tier of block j), the
 * prefix whose load plus the rest's prefill is cheapest. */
uint64_t bh_timing_cut(const bh_timing *t, const uint8_t *tiers, uint64_t m,
                       uint64_t in_tokens);

#endif /* KVP_BENCH_HARNESS_CACHE_H */
