/* SPDX-License-Identifier: Apache-2.0 */
/* One worker's HBM / DRAM / NVMe block cache and the engine timing model
 * (harness_cache.h), shared by the simulator and the emulated engines. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "harness_cache.h"

#define NONE BH_NONE
typedef bh_cache cache;
typedef bh_cache_node node;


int bh_cache_init(cache *c, const bh_cluster *cl, bool policies) {
  memset(c, 0, sizeof *c);
  c->mask = 1023;
  c->tab = calloc(c->mask + 1, sizeof *c->tab);
  c->free_list = NONE;
  c->classes = !cl->tier_no_classes;
  c->cap[0] = cl->hbm_blocks;
  c->cap[1] = cl->dram_blocks;
  c->cap[2] = cl->nvme_blocks;
  if (!policies)
    c->cap[0] = UINT64_MAX, c->cap[1] = c->cap[2] = 0;
  for (int k = 0; k < 3 && policies; k++) {
    int rc = kvp_tier_policy_create(cl->tier_policy[k], NULL, &c->pol[k]);
    if (rc < 0)
      return rc;
  }
  if (policies && cl->nvme_admit_on && c->cap[2] > 0) {
    kvp_tier_admit_opts ao = cl->nvme_admit;
    if (ao.ghost_slots == 0) /* remember about as many rejects as NVMe holds */
      ao.ghost_slots = c->cap[2] < (1u << 20) ? (uint32_t)c->cap[2] : 1u << 20;
    int rc = kvp_tier_admit_create(&ao, NULL, &c->adm);
    if (rc < 0)
      return rc;
  }
  return c->tab ? 0 : KVP_ENOMEM;
}

void bh_cache_free(cache *c) {
  free(c->tab);
  free(c->nodes);
  for (int k = 0; k < 3; k++)
    kvp_tier_policy_destroy(c->pol[k]);
  kvp_tier_admit_destroy(c->adm);
}

static size_t slot_of(const cache *c, uint64_t fp) {
  return (size_t)(fp * 0x9E3779B97F4A7C15ull >> 20) & c->mask;
}

uint32_t bh_cache_find(const cache *c, kvp_key k) {
  for (size_t i = slot_of(c, k.lo);; i = (i + 1) & c->mask) {
    uint32_t v = c->tab[i];
    if (v == 0)
      return NONE;
    if (kvp_key_eq(c->nodes[v - 1].key, k))
      return v - 1;
  }
}

static int tab_grow(cache *c) {
  size_t nm = c->mask * 2 + 1;
  uint32_t *nt = calloc(nm + 1, sizeof *nt);
  if (nt == NULL)
    return KVP_ENOMEM;
  for (size_t i = 0; i <= c->mask; i++) {
    uint32_t v = c->tab[i];
    if (v == 0)
      continue;
    size_t j = (size_t)(c->nodes[v - 1].key.lo * 0x9E3779B97F4A7C15ull >> 20) & nm;
    while (nt[j] != 0)
      j = (j + 1) & nm;
    nt[j] = v;
  }
  free(c->tab);
  c->tab = nt;
  c->mask = nm;
  return 0;
}

/* Backward-shift deletion (linear probing). */
static void tab_del(cache *c, uint32_t idx) {
  size_t i = slot_of(c, c->nodes[idx].key.lo);
  while (c->tab[i] != idx + 1)
    i = (i + 1) & c->mask;
  for (size_t j = i;;) {
    j = (j + 1) & c->mask;
    uint32_t v = c->tab[j];
    if (v == 0)
      break;
    size_t home = slot_of(c, c->nodes[v - 1].key.lo);
    /* move v into the hole at i if its home is not in (i, j] */
    if ((j > i && (home <= i || home > j)) || (j < i && home <= i && home > j)) {
      c->tab[i] = v;
      i = j;
    }
  }
  c->tab[i] = 0;
  c->used--;
}

/* Takes x off its tier.  evicted: pushed out by pressure (S3-FIFO keeps a
 * ghost of it), not moved up by a hit. */
static void tier_remove(cache *c, uint32_t x, bool evicted) {
  node *n = &c->nodes[x];
  int k = n->tier;
  if (c->pol[k] != NULL) {
    int rc = kvp_tier_policy_remove(c->pol[k], x, evicted);
    assert(rc == 0);
    (void)rc;
  }
  c->count[k]--;
}

/* Puts x into tier k (newest).  The reuses it had since it last entered a
 * tier travel with it as policy touches: in this exclusive hierarchy a
 * block leaves DRAM/NVMe when it is hit, so this is how the lower tiers
 * learn about its reuse (an inclusive store like kvtier sees those hits
 * directly).  A touch right after an insert changes nothing for LRU. */
int bh_cache_tier_insert(cache *c, uint32_t x, int k) {
  node *n = &c->nodes[x];
  n->tier = (uint8_t)k;
  if (c->pol[k] != NULL) {
    kvp_class cls = c->classes ? (kvp_class)n->cls : KVP_CLASS_VOLATILE;
    int rc = kvp_tier_policy_insert(c->pol[k], x, n->key.lo, 1, cls);
    if (rc < 0)
      return rc;
    for (uint8_t h = 0; h < n->hits; h++)
      kvp_tier_policy_touch(c->pol[k], x);
  }
  n->hits = 0;
  c->count[k]++;
  return 0;
}

int bh_cache_node_new(cache *c, kvp_key k, uint32_t *out) {
  uint32_t x;
  if (c->free_list != NONE) {
    x = c->free_list;
    c->free_list = c->nodes[x].next;
  } else {
    if (c->n_nodes == c->cap_nodes) {
      uint32_t nc = c->cap_nodes ? c->cap_nodes * 2 : 1024;
      node *nn = realloc(c->nodes, (size_t)nc * sizeof *nn);
      if (nn == NULL)
        return KVP_ENOMEM;
      c->nodes = nn;
      c->cap_nodes = nc;
    }
    x = c->n_nodes++;
  }
  if ((c->used + 1) * 4 > (c->mask + 1) * 3 && tab_grow(c) < 0)
    return KVP_ENOMEM;
  c->nodes[x].key = k;
  c->nodes[x].cls = KVP_CLASS_VOLATILE;
  c->nodes[x].hits = 0;
  c->nodes[x].reuses = 0;
  c->nodes[x].adm = 0;
  size_t i = slot_of(c, k.lo);
  while (c->tab[i] != 0)
    i = (i + 1) & c->mask;
  c->tab[i] = x + 1;
  c->used++;
  *out = x;
  return 0;
}

static void node_del(cache *c, uint32_t x) {
  tab_del(c, x);
  c->nodes[x].next = c->free_list;
  c->free_list = x;
}

static int publish(cache *c, int tier, bool stored, const kvp_key *key) {
  return c->publish ? c->publish(c->publish_ctx, c->publish_id, tier, stored, key)
                    : 0;
}

/* ---- placement: kvtier's policy per tier, demotion down the tiers ------------- */
static int next_tier(const cache *c, int k) {
  for (int j = k + 1; j < 3; j++)
    if (c->cap[j] > 0)
      return j;
  return -1;
}

/* The NVMe gate for victim v about to be demoted into NVMe: true admits
 * (its cell is kept for the outcome), false rejects (remembered as a
 * ghost). */
static bool nvme_admit(cache *c, uint32_t v) {
  node *n = &c->nodes[v];
  kvp_class cls = c->classes ? (kvp_class)n->cls : KVP_CLASS_VOLATILE;
  if (!kvp_tier_admit_decide(c->adm, cls, n->reuses, &c->adm_cost)) {
    kvp_tier_admit_reject(c->adm, n->key.lo, cls, n->reuses);
    c->st.nvme_rejected++;
    return false;
  }
  unsigned b = n->reuses < KVP_TIER_ADMIT_BUCKETS ? n->reuses
                                                  : KVP_TIER_ADMIT_BUCKETS - 1;
  n->adm = (uint8_t)(cls * KVP_TIER_ADMIT_BUCKETS + b + 1);
  c->st.nvme_admitted++;
  return true;
}

/* Block x leaves NVMe: read back (reused) or evicted unread. */
static void nvme_outcome(cache *c, uint32_t x, bool reused) {
  node *n = &c->nodes[x];
  if (c->adm == NULL || n->adm == 0)
    return;
  unsigned cell = n->adm - 1u;
  kvp_tier_admit_note(c->adm, (kvp_class)(cell / KVP_TIER_ADMIT_BUCKETS),
                      cell % KVP_TIER_ADMIT_BUCKETS, reused);
  n->adm = 0;
}

/* Makes room for one more block in tier k. */
static int make_room(cache *c, int k) {
  uint32_t v;
  while (c->count[k] >= c->cap[k] &&
         kvp_tier_policy_victim(c->pol[k], &v) == 0) {
    kvp_key key = c->nodes[v].key;
    int j = next_tier(c, k);
    int rc;
    if (j == KVP_TIER_NVME && c->adm != NULL && !nvme_admit(c, v))
      j = -1; /* rejected: dropped as if NVMe were not there */
    if (j < 0 && k == KVP_TIER_NVME)
      nvme_outcome(c, v, false);
    if (j >= 0 && (rc = make_room(c, j)) < 0)
      return rc;
    tier_remove(c, v, true);
    if ((rc = publish(c, k, false, &key)) < 0)
      return rc;
    if (j >= 0) {
      if ((rc = bh_cache_tier_insert(c, v, j)) < 0)
        return rc;
      c->st.demoted_bytes[j] += c->block_bytes;
      if ((rc = publish(c, j, true, &key)) < 0)
        return rc;
    } else {
      node_del(c, v);
      c->st.evicted_blocks++;
    }
  }
  return 0;
}

/* A cached block seen again as class cls: the most stable view wins (the
 * classifier learns, so a system prompt's first request saw it volatile).
 * Re-filed in its tier's queues of that class, as the newest entry. */
static int reclassify(cache *c, uint32_t x, kvp_class cls) {
  node *n = &c->nodes[x];
  if (!c->classes || cls <= (kvp_class)n->cls)
    return 0;
  int k = n->tier;
  uint8_t hits = n->hits;
  tier_remove(c, x, false);
  n->cls = (uint8_t)cls;
  n->hits = 0;
  int rc = bh_cache_tier_insert(c, x, k);
  n->hits = hits;
  return rc;
}

/* Block now in HBM (loaded, recomputed or new), of class cls for the
 * request at hand.  *fresh: it was not cached. */
int bh_cache_to_hbm(cache *c, kvp_key key, kvp_class cls, bool *fresh) {
  uint32_t x = bh_cache_find(c, key);
  int rc;
  *fresh = false;
  if (x != NONE && c->nodes[x].reuses < 255)
    c->nodes[x].reuses++;
  if (x != NONE && c->nodes[x].tier == KVP_TIER_HBM) {
    if (c->pol[KVP_TIER_HBM] == NULL)
      return 0;
    if (c->nodes[x].hits < 3)
      c->nodes[x].hits++;
    if ((rc = reclassify(c, x, cls)) < 0)
      return rc;
    return kvp_tier_policy_touch(c->pol[KVP_TIER_HBM], x);
  }
  if (x != NONE) {
    /* off its tier first, so making room below cannot pick it as a victim
     * (the cascade may evict the last tier's victim) */
    int from = c->nodes[x].tier;
    if (from == KVP_TIER_NVME)
      nvme_outcome(c, x, true);
    tier_remove(c, x, false);
    if ((rc = publish(c, from, false, &key)) < 0 ||
        (rc = make_room(c, KVP_TIER_HBM)) < 0)
      return rc;
    node *n = &c->nodes[x];
    if (c->classes && cls > (kvp_class)n->cls)
      n->cls = (uint8_t)cls;
    n->hits = 1; /* this reuse: HBM's policy sees it as a touch */
    if ((rc = bh_cache_tier_insert(c, x, KVP_TIER_HBM)) < 0)
      return rc;
    n->hits = 1; /* ... and travels down with it when it is demoted */
    return publish(c, KVP_TIER_HBM, true, &key);
  }
  if ((rc = make_room(c, KVP_TIER_HBM)) < 0)
    return rc;
  kvp_tier_admit_seen(c->adm, key.lo); /* recomputed after a reject? */
  if ((rc = bh_cache_node_new(c, key, &x)) < 0)
    return rc;
  c->nodes[x].cls = (uint8_t)(c->classes ? cls : KVP_CLASS_VOLATILE);
  if ((rc = bh_cache_tier_insert(c, x, KVP_TIER_HBM)) < 0)
    return rc;
  *fresh = true;
  return 0;
}

/* ---- engine timing -------------------------------------------------------------- */
void bh_timing_setup(bh_timing *t, bh_cluster *cl, uint32_t block_size,
                     const kvp_router *rt) {
  /* the resolved GPU spec (defaults filled) drives the engine model too */
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    cl->gpu.bw[k] = kvp_router_bandwidth(rt, (kvp_tier)k);
  if (cl->gpu.latency_s[1] == 0)
    cl->gpu.latency_s[1] = 10e-6;
  if (cl->gpu.latency_s[2] == 0)
    cl->gpu.latency_s[2] = 100e-6;
  t->cl = *cl;
  t->bs = block_size;
  t->kvb = kvp_model_kv_bytes_per_token(&cl->model);
  t->flops_s = (cl->gpu.flops > 0 ? cl->gpu.flops : 989e12) *
               (cl->gpu.efficiency > 0 ? cl->gpu.efficiency : 0.5);
}

double bh_timing_load_s(const bh_timing *t, const uint64_t blocks[3]) {
  double s = 0;
  for (int k = 1; k < 3; k++) /* HBM hits are read in place */
    if (blocks[k] > 0)
      s += (double)blocks[k] * t->bs * t->kvb / t->cl.gpu.bw[k] +
           t->cl.gpu.latency_s[k];
  return s;
}

double bh_timing_prefill_s(const bh_timing *t, uint64_t from, uint64_t to) {
  return kvp_model_prefill_flops(&t->cl.model, from, to) / t->flops_s;
}

double bh_timing_decode_s(const bh_timing *t, uint32_t decoding,
                          uint64_t decode_tokens, uint64_t in_tokens,
                          uint32_t out_tokens) {
  double batch = decoding + 1.0;
  if (batch > t->cl.max_batch)
    batch = t->cl.max_batch;
  double weights = 2.0 * (t->cl.model.params > 0 ? t->cl.model.params : 8.03e9);
  double kv = (double)(decode_tokens + in_tokens) * t->kvb;
  double step = t->cl.decode_base_s + (weights + kv) / t->cl.hbm_bw;
  /* beyond the batch limit, requests share steps */
  double share = (decoding + 1.0) / batch;
  return (double)out_tokens * step * share;
}

uint64_t bh_timing_cut(const bh_timing *t, const uint8_t *tiers, uint64_t m,
                       uint64_t in_tokens) {
  uint64_t cnt[3] = {0, 0, 0}, cut = 0;
  double best = bh_timing_prefill_s(t, 0, in_tokens);
  for (uint64_t j = 0; j < m; j++) {
    cnt[tiers[j]]++;
    if (j + 1 < m && tiers[j + 1] == tiers[j])
      continue;
    double cost = bh_timing_load_s(t, cnt) +
                  bh_timing_prefill_s(t, (j + 1) * t->bs, in_tokens);
    if (cost <= best) {
      best = cost;
      cut = j + 1;
    }
  }
  return cut;
}
