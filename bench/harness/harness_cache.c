/* SPDX-License-Identifier: Apache-2.0 */
/* One worker's HBM / DRAM / NVMe block cache and the engine timing model
 * (harness_cache.h), shared by the simulator and the emulated engines. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "harness_cache.h"
#include "core_internal.h"

#define NONE BH_NONE
typedef bh_cache cache;
typedef bh_cache_node node;


static tier_policy *pol_of(const cache *c, int k) {
  return c->cas != NULL ? kvp__tier_cascade_policy(c->cas, k) : NULL;
}

static tier_admit *gate_of(const cache *c) {
  return c->cas != NULL ? kvp__tier_cascade_gate(c->cas) : NULL;
}

/* Nodes reserved up front: a worker holds at most its three tiers'
 * capacity of blocks, so with placement its node ids stay below that sum;
 * up to this many are reserved at init (allocated, touched only when used)
 * instead of grown by doubling, which copied every array and left pages of
 * unused ids behind (most of a 20x replay's page faults). */
#define RESERVE_MAX (1u << 20)

#define TAB_RESERVE_MAX (1u << 18) /* ... and the table sized for this many */

bool bh_huge_arrays;

void *bh_big_calloc(size_t n, size_t size, void **raw) {
  if (bh_huge_arrays)
    return kvp__huge_calloc(n, size, raw);
  return *raw = calloc(n ? n : 1, size);
}

/* The cache's arrays: from its allocator when it has one (a region's, in
 * batch simulations: not zeroed unless `zero`), else bh_big_calloc's. */
static void *arr_alloc(cache *c, size_t n, size_t size, bool zero,
                       void **raw) {
  if (c->alloc.alloc == NULL)
    return bh_big_calloc(n, size, raw);
  size_t bytes;
  if (__builtin_mul_overflow(n ? n : 1, size, &bytes))
    return *raw = NULL;
  void *p = *raw = kvp__malloc(&c->alloc, bytes);
  if (p != NULL && zero)
    memset(p, 0, bytes);
  return p;
}

static void arr_free(cache *c, void *raw, size_t bytes) {
  if (c->alloc.alloc == NULL)
    free(raw);
  else
    kvp__free(&c->alloc, raw, bytes);
}

/* The table's slots for ids (reserved up to TAB_RESERVE_MAX): a power of
 * two, at least 1024, at a load of at most 3/4. */
static uint64_t tab_slots(uint64_t ids) {
  uint64_t tab_ids = ids < TAB_RESERVE_MAX ? ids : TAB_RESERVE_MAX, n = 1024;
  while (n * 3 < tab_ids * 4)
    n *= 2;
  return n;
}

size_t bh_cache_reserve_bytes(const bh_cluster *cl) {
  uint64_t ids = cl->hbm_blocks + cl->dram_blocks + cl->nvme_blocks + 1;
  uint64_t tab = tab_slots(ids);
  if (ids > RESERVE_MAX)
    ids = RESERVE_MAX;
  /* the table and nodes, kvtier's entries (16 bytes an id) and S3-FIFO
   * ghosts (4 bytes an id, rounded up to a power of two, a tier each) with
   * room to spare: what is not carved is only address space */
  return (size_t)(tab * sizeof(bh_cache_slot) + ids * sizeof(bh_cache_node) +
                  ids * 48 + ((size_t)1 << 20));
}

int bh_cache_init(cache *c, const bh_cluster *cl, bool policies) {
  return bh_cache_init_in(c, cl, policies, NULL);
}

int bh_cache_init_in(cache *c, const bh_cluster *cl, bool policies,
                     const kvp_allocator *alloc) {
  memset(c, 0, sizeof *c);
  if (alloc != NULL && alloc->alloc != NULL && alloc->free != NULL)
    c->alloc = *alloc;
  c->free_list = NONE;
  c->classes = !cl->tier_no_classes;
  c->cap[0] = cl->hbm_blocks;
  c->cap[1] = cl->dram_blocks;
  c->cap[2] = cl->nvme_blocks;
  if (!policies)
    c->cap[0] = UINT64_MAX, c->cap[1] = c->cap[2] = 0;
  uint64_t ids = policies ? c->cap[0] + c->cap[1] + c->cap[2] + 1 : 0;
  c->mask = tab_slots(ids) - 1;
  /* the table and the nodes are read at random, a line per block: 2 MiB
   * pages in batch simulations (their region, or bh_big_calloc when they
   * are that big) */
  c->tab = arr_alloc(c, c->mask + 1, sizeof *c->tab, true, &c->tab_raw);
  if (c->tab == NULL)
    return KVP_ENOMEM;
  if (policies) {
    ids = ids < RESERVE_MAX ? ids : RESERVE_MAX;
    /* not cleared: a node is read only once bh_cache_node_new set it */
    c->nodes = arr_alloc(c, ids, sizeof *c->nodes, false, &c->nodes_raw);
    if (c->nodes == NULL)
      return KVP_ENOMEM;
    c->cap_nodes = (uint32_t)ids;
    tier_cascade_opts co = {.with_policy = 7, .ids = (uint32_t)ids,
                            .exclusive = true, /* a block is in one tier */
                            .gate = cl->nvme_admit_on && c->cap[2] > 0,
                            .gate_opts = cl->nvme_admit};
    for (int k = 0; k < 3; k++) {
      co.policy[k] = cl->tier_policy[k];
      co.cap[k] = c->cap[k];
    }
    if (co.gate_opts.ghost_slots == 0) /* about as many rejects as NVMe holds */
      co.gate_opts.ghost_slots =
          c->cap[2] < (1u << 20) ? (uint32_t)c->cap[2] : 1u << 20;
    int rc = kvp__tier_cascade_create(
        &co, c->alloc.alloc != NULL ? &c->alloc : NULL, &c->cas);
    if (rc < 0)
      return rc;
    c->hot = pol_of(c, KVP_TIER_HBM);
    c->hbm_lru = cl->tier_policy[KVP_TIER_HBM] == KVP_TIER_POLICY_LRU;
  }
  return 0;
}

void bh_cache_free(cache *c) {
  arr_free(c, c->tab_raw, (c->mask + 1) * sizeof *c->tab);
  arr_free(c, c->nodes_raw, (size_t)c->cap_nodes * sizeof *c->nodes);
  kvp__tier_cascade_destroy(c->cas);
}

typedef bh_cache_slot slot;

/* Whether node x (< n_nodes, or BH_NONE) is key's: a hint taken before
 * other blocks moved may name a node freed since (tier BH_TIER_FREE) or
 * reused for another key. */
static bool node_is(const cache *c, uint32_t x, kvp_key key) {
  return x < c->n_nodes && c->nodes[x].tier != BH_TIER_FREE &&
         kvp_key_eq(c->nodes[x].key, key);
}

uint32_t bh_cache_find(const cache *c, kvp_key k) {
  uint32_t h = bh_cache_hash32(k.lo);
  for (size_t i = h & c->mask, d = 0;; i = (i + 1) & c->mask, d++) {
    slot v = c->tab[i];
    if (v.idx == 0 || bh_cache_slot_dist(v, i, c->mask) < d)
      return NONE; /* Robin Hood order: the key would lie before v */
    if (v.h == h && kvp_key_eq(c->nodes[v.idx - 1].key, k))
      return v.idx - 1;
  }
}

/* Puts v into table t (mask) in Robin Hood order: past every entry at
 * least as far from its home, displacing the first nearer one, which moves
 * on likewise.  Room guaranteed. */
static void tab_put(slot *t, size_t mask, slot v) {
  size_t i = v.h & mask;
  for (size_t d = 0;; i = (i + 1) & mask, d++) {
    slot u = t[i];
    if (u.idx == 0) {
      t[i] = v;
      return;
    }
    size_t du = bh_cache_slot_dist(u, i, mask);
    if (du < d) {
      t[i] = v;
      v = u;
      d = du;
    }
  }
}

/* Stage 2 of bh_cache_match: key's node by its probe run's first hash
 * match (prefetched), BH_NONE when the run ends first (not cached), or
 * MATCH_UNSURE when 4 slots decided nothing (bh_cache_find then). */
#define MATCH_UNSURE (BH_NONE - 1)
#define MATCH_RING (2 * BH_PREFETCH_AHEAD)

static uint32_t match_candidate(const cache *c, kvp_key key) {
  uint32_t h = bh_cache_hash32(key.lo);
  size_t i = h & c->mask;
  for (size_t k = 0; k < 4; k++, i = (i + 1) & c->mask) {
    slot v = c->tab[i];
    if (v.idx == 0 || bh_cache_slot_dist(v, i, c->mask) < k)
      return NONE;
    if (v.h == h) {
      __builtin_prefetch(&c->nodes[v.idx - 1]);
      return v.idx - 1;
    }
  }
  return MATCH_UNSURE;
}

/* Stage 3: key's node given its candidate x. */
static uint32_t match_resolve(const cache *c, kvp_key key, uint32_t x) {
  if (x == NONE)
    return NONE;
  if (x != MATCH_UNSURE && kvp_key_eq(c->nodes[x].key, key))
    return x;
  return bh_cache_find(c, key); /* a 32-bit hash collision, or a long run */
}

uint64_t bh_cache_match(const cache *c, const kvp_key *keys, uint64_t n,
                        uint8_t *tiers, uint32_t *nodes) {
  const uint64_t A = BH_PREFETCH_AHEAD;
  uint32_t cand[MATCH_RING];
  bh_cache_prefetch_begin(c, keys, 0, n);
  for (uint64_t j = 0; j < n && j < A; j++)
    cand[j % MATCH_RING] = match_candidate(c, keys[j]);
  uint64_t m = 0;
  for (; m < n; m++) {
    if (m + 2 * A < n)
      __builtin_prefetch(&c->tab[bh_cache_hash32(keys[m + 2 * A].lo) & c->mask]);
    if (m + A < n)
      cand[(m + A) % MATCH_RING] = match_candidate(c, keys[m + A]);
    uint32_t x = match_resolve(c, keys[m], cand[m % MATCH_RING]);
    if (x == NONE)
      break;
    tiers[m] = c->nodes[x].tier;
    nodes[m] = x;
  }
  return m;
}

/* The hints' nodes are read 2A blocks ahead: one line each, and their
 * addresses known without a dependent read. */
uint64_t bh_cache_match_hinted(const cache *c, const kvp_key *keys, uint64_t n,
                               const uint32_t *hints, uint64_t nh,
                               uint8_t *tiers, uint32_t *nodes) {
  const uint64_t D = 2 * BH_PREFETCH_AHEAD;
  uint64_t lim = nh < n ? nh : n, m = 0;
  for (uint64_t j = 0; j < lim && j < D; j++)
    if (hints[j] < c->n_nodes)
      __builtin_prefetch(&c->nodes[hints[j]]);
  for (; m < lim; m++) {
    if (m + D < lim && hints[m + D] < c->n_nodes)
      __builtin_prefetch(&c->nodes[hints[m + D]]);
    uint32_t x = hints[m];
    if (!node_is(c, x, keys[m]))
      break;
    tiers[m] = c->nodes[x].tier;
    nodes[m] = x;
  }
  return m + bh_cache_match(c, keys + m, n - m, tiers + m, nodes + m);
}

static int tab_grow(cache *c) {
  size_t nm = c->mask * 2 + 1;
  if (nm > UINT32_MAX)
    return KVP_ENOMEM;
  void *raw;
  slot *nt = arr_alloc(c, nm + 1, sizeof *nt, true, &raw);
  if (nt == NULL)
    return KVP_ENOMEM;
  for (size_t i = 0; i <= c->mask; i++) {
    slot v = c->tab[i];
    if (v.idx != 0)
      tab_put(nt, nm, v);
  }
  arr_free(c, c->tab_raw, (c->mask + 1) * sizeof *c->tab);
  c->tab = nt;
  c->tab_raw = raw;
  c->mask = nm;
  return 0;
}

/* Backward-shift deletion: the entries after the hole that are not at
 * their homes move back one (Robin Hood order kept). */
static void tab_del(cache *c, uint32_t idx) {
  size_t i = bh_cache_hash32(c->nodes[idx].key.lo) & c->mask;
  while (c->tab[i].idx != idx + 1)
    i = (i + 1) & c->mask;
  for (;;) {
    size_t j = (i + 1) & c->mask;
    slot v = c->tab[j];
    if (v.idx == 0 || bh_cache_slot_dist(v, j, c->mask) == 0)
      break;
    c->tab[i] = v;
    i = j;
  }
  c->tab[i] = (slot){0, 0};
  c->used--;
}

/* Takes x off its tier, moved up by a hit or re-filed (a victim of the
 * cascade is already off its tier's policy: only its count goes). */
static void tier_remove(cache *c, uint32_t x) {
  node *n = &c->nodes[x];
  int k = n->tier;
  if (pol_of(c, k) != NULL) {
    int rc = kvp__tier_policy_remove(pol_of(c, k), x, 0);
    assert(rc == 0);
    (void)rc;
  }
  c->count[k]--;
}

static kvp_class node_class(const cache *c, const node *n) {
  return c->classes ? (kvp_class)n->cls : KVP_CLASS_VOLATILE;
}

/* Puts x into tier k (newest).  The reuses it had since it last entered a
 * tier travel with it as policy touches: in this exclusive hierarchy a
 * block leaves DRAM/NVMe when it is hit, so this is how the lower tiers
 * learn about its reuse (an inclusive store like kvtier sees those hits
 * directly).  A touch right after an insert changes nothing for LRU. */
int bh_cache_tier_insert(cache *c, uint32_t x, int k) {
  node *n = &c->nodes[x];
  n->tier = (uint8_t)k;
  tier_policy *p = pol_of(c, k);
  if (p != NULL) {
    int rc = kvp__tier_policy_insert(p, x, n->key.lo, 1, node_class(c, n));
    if (rc < 0)
      return rc;
    for (uint8_t h = 0; h < n->hits; h++)
      kvp__tier_policy_touch(p, x);
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
      node *nn;
      if (c->alloc.alloc == NULL && c->nodes_raw == c->nodes) {
        /* malloc's own: may grow in place */
        if ((nn = realloc(c->nodes, (size_t)nc * sizeof *nn)) == NULL)
          return KVP_ENOMEM;
        c->nodes_raw = nn;
      } else { /* in 2 MiB pages (past RESERVE_MAX), or the allocator's */
        void *raw;
        if ((nn = arr_alloc(c, nc, sizeof *nn, false, &raw)) == NULL)
          return KVP_ENOMEM;
        memcpy(nn, c->nodes, (size_t)c->cap_nodes * sizeof *nn);
        arr_free(c, c->nodes_raw, (size_t)c->cap_nodes * sizeof *nn);
        c->nodes_raw = raw;
      }
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
  c->nodes[x].unannounced = 0;
  tab_put(c->tab, c->mask, (slot){x + 1, bh_cache_hash32(k.lo)});
  c->used++;
  *out = x;
  return 0;
}

static void node_del(cache *c, uint32_t x) {
  tab_del(c, x);
  c->nodes[x].tier = BH_TIER_FREE;
  c->nodes[x].next = c->free_list;
  c->free_list = x;
}

static int publish(cache *c, int tier, bool stored, const kvp_key *key) {
  return c->publish ? c->publish(c->publish_ctx, c->publish_id, tier, stored, key)
                    : 0;
}

/* ---- placement: kvtier's cascade, demotion down the tiers ------------------- */
/* What the cascade asks about victim v (this hierarchy is exclusive: a
 * victim is never in the next tier already). */
static void node_victim(void *arg, uint32_t v, tier_victim *out) {
  const cache *c = arg;
  const node *n = &c->nodes[v];
  *out = (tier_victim){.fp = n->key.lo, .cls = node_class(c, n),
                       .hits = n->reuses, .cost = c->adm_cost};
}

/* Block x leaves NVMe: read back (reused) or evicted unread. */
static void nvme_outcome(cache *c, uint32_t x, bool reused) {
  node *n = &c->nodes[x];
  kvp__tier_admit_note_cell(gate_of(c), n->adm, reused);
  n->adm = 0;
}

/* Victim m->id went where the cascade sent it (room was made there). */
static int land(cache *c, const tier_move *m) {
  kvp_key key = c->nodes[m->id].key;
  int rc;
  c->count[m->from]--; /* off its tier's policy already */
  if (c->nodes[m->id].unannounced) /* its store never went out */
    c->nodes[m->id].unannounced = 0;
  else if ((rc = publish(c, m->from, false, &key)) < 0)
    return rc;
  if (m->to < 0) {
    node_del(c, m->id);
    c->st.evicted_blocks++;
    return 0;
  }
  if ((rc = bh_cache_tier_insert(c, m->id, m->to)) < 0)
    return rc;
  c->st.demoted_bytes[m->to] += c->block_bytes;
  return publish(c, m->to, true, &key);
}

/* Tier k's victims come one per block that enters it, each a cold node,
 * policy entry and (when evicted) table slot.  After one is taken, the next
 * two are known (an LRU tier: kvp__tier_policy_peek): the next one's slot,
 * from its node prefetched a victim ago, and the one after's node and entry
 * are prefetched, so the next block's make_room finds them in cache. */
static void victims_prefetch(const cache *c, int k, bool evicting) {
  tier_policy *p = pol_of(c, k);
  uint32_t v1 = kvp__tier_policy_peek(p, UINT32_MAX);
  if (v1 >= c->n_nodes)
    return;
  if (evicting)
    __builtin_prefetch(
        &c->tab[bh_cache_hash32(c->nodes[v1].key.lo) & c->mask], 1);
  uint32_t v2 = kvp__tier_policy_peek(p, v1);
  if (v2 < c->n_nodes) {
    __builtin_prefetch(&c->nodes[v2]);
    kvp__tier_policy_prefetch(p, v2);
  }
}

/* Makes room for one more block in tier k. */
static int make_room(cache *c, int k) {
  tier_move m;
  int rc;
  while (kvp__tier_cascade_next(c->cas, k, 1, false, node_victim, c, &m) > 0) {
    victims_prefetch(c, k, m.to < 0);
    if (m.gate == TIER_GATE_ADMIT) { /* its cell, for the outcome */
      c->nodes[m.id].adm = m.cell;
      c->st.nvme_admitted++;
    } else if (m.gate == TIER_GATE_REJECT) { /* remembered as a ghost */
      c->st.nvme_rejected++;
    }
    if (m.to < 0 && k == KVP_TIER_NVME)
      nvme_outcome(c, m.id, false);
    if (m.to >= 0 && (rc = make_room(c, m.to)) < 0)
      return rc;
    if ((rc = land(c, &m)) < 0)
      return rc;
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
  tier_remove(c, x);
  n->cls = (uint8_t)cls;
  n->hits = 0;
  int rc = bh_cache_tier_insert(c, x, k);
  n->hits = hits;
  return rc;
}

/* Block x, cached below HBM, hit: moved up into HBM. */
static int promote(cache *c, uint32_t x, kvp_key key, kvp_class cls) {
  /* off its tier first, so making room below cannot pick it as a victim
   * (the cascade may evict the last tier's victim) */
  int from = c->nodes[x].tier, rc;
  if (from == KVP_TIER_NVME)
    nvme_outcome(c, x, true);
  tier_remove(c, x);
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

/* Block now in HBM (loaded, recomputed or new), of class cls for the
 * request at hand.  *fresh: it was not cached. */
int bh_cache_to_hbm(cache *c, kvp_key key, kvp_class cls, bool *fresh) {
  return bh_cache_to_hbm_at(c, NONE, key, cls, fresh, NULL);
}

int bh_cache_to_hbm_at(cache *c, uint32_t hint, kvp_key key, kvp_class cls,
                       bool *fresh, uint32_t *out) {
  uint32_t x = node_is(c, hint, key) ? hint : bh_cache_find(c, key);
  uint32_t dummy;
  int rc;
  *fresh = false;
  if (out == NULL)
    out = &dummy;
  *out = x; /* a node keeps its id through touches and promotion */
  if (x != NONE && c->nodes[x].reuses < 255)
    c->nodes[x].reuses++;
  if (x != NONE && c->nodes[x].tier == KVP_TIER_HBM) {
    if (pol_of(c, KVP_TIER_HBM) == NULL)
      return 0;
    if (c->nodes[x].hits < 3)
      c->nodes[x].hits++;
    if ((rc = reclassify(c, x, cls)) < 0)
      return rc;
    return kvp__tier_policy_touch(pol_of(c, KVP_TIER_HBM), x);
  }
  if (x != NONE)
    return promote(c, x, key, cls);
  if ((rc = make_room(c, KVP_TIER_HBM)) < 0)
    return rc;
  kvp__tier_admit_seen(gate_of(c), key.lo); /* recomputed after a reject? */
  if ((rc = bh_cache_node_new(c, key, &x)) < 0)
    return rc;
  *out = x;
  c->nodes[x].cls = (uint8_t)(c->classes ? cls : KVP_CLASS_VOLATILE);
  if ((rc = bh_cache_tier_insert(c, x, KVP_TIER_HBM)) < 0)
    return rc;
  c->nodes[x].unannounced = 1;
  *fresh = true;
  return 0;
}

void bh_cache_release(cache *c, const kvp_key *keys, const uint32_t *hints,
                      uint64_t n) {
  const uint64_t A = BH_PREFETCH_AHEAD;
  uint32_t cand[MATCH_RING];
  if (c->hot == NULL || !c->hbm_lru || n == 0)
    return;
  if (hints != NULL) { /* the nodes and their policy entries, A ahead */
    for (uint64_t j = n; j-- > 0;) {
      if (j >= A && hints[j - A] < c->n_nodes) {
        __builtin_prefetch(&c->nodes[hints[j - A]]);
        kvp__tier_policy_prefetch(c->hot, hints[j - A]);
      }
      uint32_t x = node_is(c, hints[j], keys[j]) ? hints[j]
                                                 : bh_cache_find(c, keys[j]);
      if (x != NONE && c->nodes[x].tier == KVP_TIER_HBM)
        (void)kvp__tier_policy_touch(c->hot, x);
    }
    return;
  }
  /* bh_cache_match's pipeline, backwards: slot lines 2A blocks ahead, then
   * the candidate node and its policy entry A ahead */
  for (uint64_t j = n; j-- > 0 && j + 2 * A >= n;)
    __builtin_prefetch(&c->tab[bh_cache_hash32(keys[j].lo) & c->mask]);
  for (uint64_t j = n; j-- > 0 && j + A >= n;)
    cand[j % MATCH_RING] = match_candidate(c, keys[j]);
  for (uint64_t j = n; j-- > 0;) {
    if (j >= 2 * A)
      __builtin_prefetch(&c->tab[bh_cache_hash32(keys[j - 2 * A].lo) & c->mask]);
    if (j >= A) {
      uint32_t y = cand[(j - A) % MATCH_RING] = match_candidate(c, keys[j - A]);
      if (y < c->n_nodes)
        kvp__tier_policy_prefetch(c->hot, y);
    }
    uint32_t x = match_resolve(c, keys[j], cand[j % MATCH_RING]);
    if (x != NONE && c->nodes[x].tier == KVP_TIER_HBM)
      (void)kvp__tier_policy_touch(c->hot, x);
  }
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

double bh_timing_step_s(const bh_timing *t, const uint64_t blocks[3],
                        uint64_t from, uint64_t to) {
  return t->cl.prefill_base_s +
         (double)blocks[0] * t->bs * t->cl.cached_token_s +
         bh_timing_load_s(t, blocks) + bh_timing_prefill_s(t, from, to);
}

double bh_timing_link_bytes(const bh_timing *t, uint64_t blocks) {
  return (double)blocks * (double)t->bs * t->kvb;
}

double bh_timing_link_s(const bh_timing *t, double gbps, double latency_us,
                        uint64_t blocks) {
  assert(gbps > 0);
  return blocks ? latency_us * 1e-6 + bh_timing_link_bytes(t, blocks) /
                                          (gbps * 1e9)
                : 0;
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
