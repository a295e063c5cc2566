/* SPDX-License-Identifier: Apache-2.0 */
/* The discrete-event cluster simulator.  W workers, each an engine with an
 * HBM / DRAM / NVMe block cache placed by kvtier's cascade (kvtier_place.h,
 * the code kvtier's store runs: one policy per tier, LRU or S3-FIFO,
 * stability aware; demotion HBM -> DRAM -> NVMe through the NVMe admission
 * gate, eviction from the last tier), one
 * prefill at a time, decode under continuous batching.  Workers publish stored/removed events into the
 * production kvp_index (per-worker sequence numbers; optionally dropped or
 * delayed); requests are routed by the production kvp_router; outcomes go
 * into the production kvp_ledger.  Deterministic: one event heap ordered by
 * (time, insertion order), one seeded generator.
 *
 * Two bounds run through the same engine model: "infinite" (one shared cache
 * of unbounded size that holds every block from the moment its request
 * arrives; no policy can reuse more) and "random" (uniform routing). */
#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <jemalloc/jemalloc.h>
#include <xxhash.h>

#include "harness.h"
#include "harness_cache.h"
#include "harness_region.h"

#define NONE UINT32_MAX

/* ---- policies ------------------------------------------------------------ */
const char *bh_policy_name(int p) {
  if (p == BH_POLICY_RANDOM)
    return "random";
  if (p == BH_POLICY_INFINITE)
    return "infinite";
  return kvp_policy_name((kvp_policy)p);
}

int bh_policy_parse(const char *s, int *out) {
  kvp_policy p;
  if (strcmp(s, "random") == 0) {
    *out = BH_POLICY_RANDOM;
    return 0;
  }
  if (strcmp(s, "infinite") == 0) {
    *out = BH_POLICY_INFINITE;
    return 0;
  }
  if (kvp_policy_parse(s, &p) < 0)
    return KVP_EINVAL;
  *out = (int)p;
  return 0;
}

void bh_cluster_defaults(bh_cluster *c) {
  memset(c, 0, sizeof *c);
  c->workers = 8;
  c->hbm_gb = 40;   /* H100 80 GB - 16 GB weights - activations */
  c->dram_gb = 128; /* pinned host DRAM per GPU */
  c->nvme_gb = 512; /* local NVMe per GPU */
  c->tier_policy[KVP_TIER_HBM] = KVP_TIER_POLICY_LRU;
  c->tier_policy[KVP_TIER_DRAM] = BH_TIER_POLICY_DEFAULT;
  c->tier_policy[KVP_TIER_NVME] = BH_TIER_POLICY_DEFAULT;
}

void bh_cluster_from_router(bh_cluster *c, const kvp_router_opts *ro) {
  c->model = ro->model;
  c->gpu = ro->gpu;
  c->hbm_bw = ro->gpu.bw[KVP_TIER_HBM];
}

void bh_sim_router_opts(const bh_sim_opts *o, uint32_t block_size,
                        kvp_router_opts *out) {
  *out = o->router;
  out->policy = o->policy == BH_POLICY_INFINITE || o->policy == BH_POLICY_RANDOM
                    ? KVP_POLICY_LEAST_LOADED
                    : (kvp_policy)o->policy;
  out->n_workers = o->cl.workers;
  out->block_size = block_size;
  out->model = o->cl.model;
  out->gpu = o->cl.gpu;
  out->seed = o->seed;
  if (o->cl.pd_prefill > 0) { /* the decode leg's price, as routerd's pd: */
    out->gpu.bw[KVP_TIER_REMOTE] =
        (o->cl.link_gbps > 0 ? o->cl.link_gbps : BH_LINK_GBPS_DEFAULT) * 1e9;
    out->gpu.latency_s[KVP_TIER_REMOTE] =
        (o->cl.link_latency_us > 0 ? o->cl.link_latency_us
                                   : BH_LINK_LATENCY_US_DEFAULT) * 1e-6;
  }
}

int bh_cluster_resolve(bh_cluster *c, uint32_t block_size) {
  double kvb = kvp_model_kv_bytes_per_token(&c->model);
  if (kvb <= 0 || block_size == 0 || c->workers == 0 || c->workers > 4096)
    return KVP_EINVAL;
  double blk = kvb * block_size;
  if (c->hbm_blocks == 0)
    c->hbm_blocks = (uint64_t)(c->hbm_gb * 1e9 / blk);
  if (c->dram_blocks == 0)
    c->dram_blocks = (uint64_t)(c->dram_gb * 1e9 / blk);
  if (c->nvme_blocks == 0)
    c->nvme_blocks = (uint64_t)(c->nvme_gb * 1e9 / blk);
  if (c->hbm_blocks == 0)
    return KVP_EINVAL;
  if ((c->pd_prefill > 0 || c->pd_decode > 0) &&
      (c->pd_prefill == 0 || c->pd_decode == 0 ||
       (uint64_t)c->pd_prefill + c->pd_decode != c->workers ||
       c->link_gbps < 0 || c->link_latency_us < 0))
    return KVP_EINVAL;
  if (c->pd_prefill > 0 && c->link_gbps == 0)
    c->link_gbps = BH_LINK_GBPS_DEFAULT;
  if (c->pd_prefill > 0 && c->link_latency_us == 0)
    c->link_latency_us = BH_LINK_LATENCY_US_DEFAULT;
  if (c->hbm_bw == 0)
    c->hbm_bw = 3.35e12;
  if (c->decode_base_s == 0)
    c->decode_base_s = 2e-3;
  if (c->max_batch == 0)
    c->max_batch = 256;
  return 0;
}

typedef bh_cache cache;
#define PREFETCH_AHEAD BH_PREFETCH_AHEAD

/* ---- sets of the trace's distinct keys -----------------------------------------
 * A bit per key number (bh_trace.kid): the infinite bound's "sent before"
 * and every run's "ever cached" are read and set a block at a time, and the
 * bitmap of 20x the bundled agentic sessions' 5M distinct keys is 0.6 MiB,
 * in the CPU's caches, where a hash set of the keys was a random DRAM line
 * per block (docs/performance.md, "Tried"). */
static uint64_t *bits_new(const bh_trace *t) {
  return calloc(t->n_kids / 64 + 1, sizeof(uint64_t));
}

static bool bit_has(const uint64_t *b, uint32_t id) {
  return b[id >> 6] >> (id & 63) & 1u;
}

static void bit_set(uint64_t *b, uint32_t id) {
  b[id >> 6] |= 1ull << (id & 63);
}

/* ---- the simulation ---------------------------------------------------------- */
enum { EV_ARRIVE, EV_PREFILL_DONE, EV_DECODE_DONE, EV_DELIVER, EV_PULLED };

/* P/D: which leg a request is in (sim.leg).  Outside P/D every request
 * stays LEG_FLAT. */
enum { LEG_FLAT, LEG_PREFILL, LEG_DECODE };

typedef struct ev {
  double t;
  uint64_t order;
  uint32_t type, a;
  uint64_t b;
  void *p;
} ev;

typedef struct delayed {
  uint32_t worker;
  uint64_t seq;
  uint8_t tier, stored, has_parent;
  kvp_key parent;
  size_t n;
  kvp_key keys[];
} delayed;

/* A session's last turn's nodes on its worker, block by block, kept for
 * its next turn there (bh_cache_match_hinted: a node read per matched block
 * instead of a table slot and then the node), while the session has
 * requests left to start. */
typedef struct sess_hint {
  uint32_t worker; /* whose nodes */
  uint32_t left;   /* the session's requests not past prefill yet */
  uint64_t n;
  size_t cap;
  uint32_t *nodes;
} sess_hint;

typedef struct worker {
  cache c;
  uint32_t *q; /* FIFO of request indices */
  size_t q_head, q_len, q_cap;
  uint64_t q_uncached; /* sum of est_uncached over q (the infinite bound's
                          routing key, kept rather than summed per arrival) */
  uint32_t cur; /* request in prefill, or NONE */
  double cur_start; /* when cur's prefill began */
  uint64_t seq; /* last event sequence number */
  uint32_t decoding;
  uint64_t decode_blocks, decode_tokens;
  uint64_t assigned; /* prefill tokens computed */
  /* P/D: prompt tokens of the decode legs routed here and not done
   * (routerd's pd_decode_tokens); per-role figures (bh_role_load) */
  uint64_t pd_kv;
  uint64_t legs, out_tokens;
  double prefill_s, decode_s;
  uint32_t *found; /* cur's matched nodes (bh_cache_to_hbm_at's hints) */
  size_t found_cap;
  /* pending stored run (HBM): see flush_run */
  kvp_key *run;
  uint32_t *run_node; /* run[i]'s node */
  size_t run_n, run_cap;
  kvp_key run_parent;
  bool run_has_parent;
  kvp_ledger_record rec; /* of cur */
} worker;

struct sim {
  bh_region *region; /* the workers' arrays, in batch simulations (NULL:
                        malloc's) */
  kvp_allocator ralloc; /* over region */
  const bh_trace *t;
  const bh_sim_opts *o;
  bh_cluster cl;
  bh_result *res;
  kvp_index *ix;
  bool ix_fed; /* events reach ix: its policy reads matches, or verify_index
                  (kvp_policy_reads_matches; round_robin and random do not) */
  bool chosen_only; /* least_loaded, every event at once: the chosen
                       worker's match read from its cache, no index (route) */
  const kvp_route_request *rq; /* the request being routed (chosen_only) */
  kvp_router *rt;
  kvp_ledger *led;
  worker *w;
  uint32_t nw;
  cache inf; /* BH_POLICY_INFINITE: the one shared cache (its counts) */
  uint64_t *inf_keys; /* ... and what it holds: a bit per key sent so far
                         (bits_new) */
  bool infinite;
  ev *heap;
  size_t heap_n, heap_cap;
  uint64_t order;
  uint64_t rng;
  double now;
  bh_timing tm;   /* the engine model (harness_cache.c) */
  double kvb;     /* KV bytes per token (tm.kvb) */
  double flops_s; /* FLOP/s achieved in prefill */
  uint32_t bs;
  tier_admit_cost adm_cost; /* one block's, for the NVMe gate */
  /* per request */
  uint32_t *req_worker;
  uint32_t *inf_reuse;
  double *arrive;
  uint64_t *est_uncached;
  uint32_t *prev_req;  /* the session's request before this one, or NONE */
  uint32_t *sess_last; /* per session name: its latest arrival */
  struct sess_hint *hint; /* per session name: see sess_hint */
  uint32_t *q_seen;    /* req_log: requests ahead of it on arrival */
  double t_first;      /* req_log: the first arrival (the log's zero) */
  /* P/D (cl.pd_prefill > 0): per request its leg and the blocks its decode
   * leg pulls, [pull_from, pull_to); scratch for the decode choice */
  bool pd;
  uint8_t *leg;
  uint32_t *pull_from, *pull_to;
  kvp_worker_match *wm;
  kvp_index_match *ixm;
  uint64_t *elig; /* 2 x (nw + 63) / 64 words: decode leg's, prefill's */
  double *pd_cost; /* per worker: decode_candidates' */
  /* index events published but not applied yet (see "index events") */
  struct pending *pend;
  size_t pend_n, pend_cap;
  kvp_key *pend_keys;
  size_t pend_nkeys, pend_kcap;
  /* global "ever cached", a bit per key number, for miss causes */
  uint64_t *seen;
  uint8_t *tiers; /* scratch: tier of each matched block */
  uint8_t *xtiers; /* scratch: another worker's match (held_run) */
  uint32_t *xnodes;
  kvp_key *rkeys;  /* scratch: a request's new blocks, last first */
  /* series */
  double *s_prompt, *s_reused;
  uint32_t s_last;
  double t_span;
  size_t next_arrival; /* closed loop */
  size_t done;
  int err;
};

static uint64_t rng_next(struct sim *s) {
  uint64_t z = (s->rng += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static double rng_unit(struct sim *s) {
  return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0);
}

static bool ev_less(const ev *a, const ev *b) {
  return a->t < b->t || (a->t == b->t && a->order < b->order);
}

static int ev_push(struct sim *s, double t, uint32_t type, uint32_t a,
                   uint64_t b, void *p) {
  if (s->heap_n == s->heap_cap) {
    size_t nc = s->heap_cap ? s->heap_cap * 2 : 1024;
    ev *nh = realloc(s->heap, nc * sizeof *nh);
    if (nh == NULL)
      return KVP_ENOMEM;
    s->heap = nh;
    s->heap_cap = nc;
  }
  ev e = {t, s->order++, type, a, b, p};
  size_t i = s->heap_n++;
  while (i > 0 && ev_less(&e, &s->heap[(i - 1) / 2])) {
    s->heap[i] = s->heap[(i - 1) / 2];
    i = (i - 1) / 2;
  }
  s->heap[i] = e;
  return 0;
}

static ev ev_pop(struct sim *s) {
  ev top = s->heap[0], last = s->heap[--s->heap_n];
  size_t i = 0;
  for (;;) {
    size_t l = 2 * i + 1, m = i;
    const ev *best = &last;
    if (l < s->heap_n && ev_less(&s->heap[l], best))
      best = &s->heap[m = l];
    if (l + 1 < s->heap_n && ev_less(&s->heap[l + 1], best))
      m = l + 1;
    if (m == i)
      break;
    s->heap[i] = s->heap[m];
    i = m;
  }
  if (s->heap_n > 0)
    s->heap[i] = last;
  return top;
}

/* ---- index events ------------------------------------------------------------
 * A worker's residency changes come one block at a time (a tier move is two
 * events), each a random read of an index table that outgrows the CPU's
 * caches with the cluster.  Events delivered at once are therefore queued,
 * in publication order, and applied in a batch right before anything reads
 * the index (a routing query, a late event, the final statistics), with
 * the index's lines for the events PEND_AHEAD further prefetched
 * (kvp_index_prefetch): the same events in the same order, so every query
 * sees what it saw when each was applied at once, without the misses
 * queueing one after another. */
#define PEND_AHEAD 8
#define PEND_MAX 65536 /* queued events flushed past this, to bound memory */

typedef struct pending {
  uint32_t worker;
  uint8_t tier, stored, has_parent;
  uint64_t seq;
  kvp_key parent;
  size_t off, n; /* keys: pend_keys[off .. off + n) */
} pending;

static void apply_event(struct sim *s, uint32_t w, uint64_t seq, int tier,
                        bool stored, const kvp_key *parent, const kvp_key *k,
                        size_t n) {
  if (!s->ix_fed) /* nobody reads it; a delayed event still arrives (its
                     delivery moves the clock, as in a run that feeds it) */
    return;
  int rc = stored ? kvp_index_stored(s->ix, w, seq, (kvp_tier)tier, parent, k, n)
                  : kvp_index_removed(s->ix, w, seq, (kvp_tier)tier, k, n);
  (void)rc; /* stale/gap outcomes are counted by the index itself */
}

/* Applies the queued events in order, prefetching ahead. */
static void pend_flush(struct sim *s) {
  for (size_t i = 0; i < s->pend_n; i++) {
    if (i + PEND_AHEAD < s->pend_n) {
      const pending *f = &s->pend[i + PEND_AHEAD];
      (void)kvp_index_prefetch(s->ix, s->pend_keys + f->off,
                               f->n < 4 ? f->n : 4);
    }
    const pending *e = &s->pend[i];
    apply_event(s, e->worker, e->seq, e->tier, e->stored,
                e->has_parent ? &e->parent : NULL, s->pend_keys + e->off, e->n);
  }
  s->pend_n = s->pend_nkeys = 0;
}

/* *p (of *cap elements of size bytes) holds at least need: doubled from
 * 256 as needed.  KVP_ENOMEM leaves it as it was. */
static int grow_array(void **p, size_t *cap, size_t need, size_t size) {
  if (need <= *cap)
    return 0;
  size_t nc = *cap ? *cap : 256;
  while (nc < need)
    nc *= 2;
  void *np = realloc(*p, nc * size);
  if (np == NULL)
    return KVP_ENOMEM;
  *p = np;
  *cap = nc;
  return 0;
}

/* Queues an event for the next pend_flush. */
static int pend_push(struct sim *s, uint32_t w, uint64_t seq, int tier,
                     bool stored, const kvp_key *parent, const kvp_key *k,
                     size_t n) {
  if (!s->ix_fed) /* counted by publish_now: nobody reads the index */
    return 0;
  if (s->pend_n == PEND_MAX)
    pend_flush(s);
  if (grow_array((void **)&s->pend, &s->pend_cap, s->pend_n + 1,
                sizeof *s->pend) < 0 ||
      grow_array((void **)&s->pend_keys, &s->pend_kcap, s->pend_nkeys + n,
                sizeof *s->pend_keys) < 0)
    return KVP_ENOMEM;
  s->pend[s->pend_n++] = (pending){w, (uint8_t)tier, stored, parent != NULL,
                                   seq, parent ? *parent : (kvp_key){0, 0},
                                   s->pend_nkeys, n};
  memcpy(s->pend_keys + s->pend_nkeys, k, n * sizeof *k);
  s->pend_nkeys += n;
  return 0;
}

static int publish_now(struct sim *s, uint32_t w, int tier, bool stored,
                       const kvp_key *parent, const kvp_key *k, size_t n) {
  if (s->infinite || n == 0)
    return 0;
  uint64_t seq = ++s->w[w].seq;
  s->res->events_published++;
  s->res->event_blocks += n;
  if (s->o->drop_events > 0 && rng_unit(s) < s->o->drop_events) {
    s->res->events_dropped++;
    return 0;
  }
  if (s->o->delay_events_s > 0) {
    delayed *d = malloc(sizeof *d + n * sizeof(kvp_key));
    if (d == NULL)
      return KVP_ENOMEM;
    *d = (delayed){w, seq, (uint8_t)tier, stored, parent != NULL,
                   parent ? *parent : (kvp_key){0, 0}, n};
    memcpy(d->keys, k, n * sizeof *k);
    s->res->events_delayed++;
    return ev_push(s, s->now + s->o->delay_events_s, EV_DELIVER, 0, 0, d);
  }
  return pend_push(s, w, seq, tier, stored, parent, k, n);
}

/* A worker's pending stored run: the new blocks of the request at hand,
 * added as its loop meets them, the last block first (a request's blocks
 * enter HBM tail first: see prefill_done), announced in chain order when a
 * resident block (its parent) or the loop's end closes it.  Other keys'
 * events go out meanwhile: their order against the run's does not matter.
 * But a pending block may leave HBM before it is announced (once a request
 * fills HBM it evicts its own blocks): its store and its removal from HBM
 * are then never published (the cache knows it unannounced), its demotion
 * is.  So the run goes out as the pieces of it still pending, each one
 * event whose parent is the chain block before it: under LRU the blocks
 * that left are the first added, the chain's tail, and the rest is one
 * event; S3-FIFO can take any (a ghost hit enters the main queue). */
static int flush_run(struct sim *s, uint32_t w) {
  worker *x = &s->w[w];
  size_t n = x->run_n;
  x->run_n = 0;
  if (n == 0)
    return 0;
  for (size_t i = 0, j = n - 1; i < j; i++, j--) { /* chain order */
    kvp_key t = x->run[i];
    x->run[i] = x->run[j];
    x->run[j] = t;
    uint32_t u = x->run_node[i];
    x->run_node[i] = x->run_node[j];
    x->run_node[j] = u;
  }
  cache *c = &x->c;
  for (size_t i = 0; i < n;) {
    if (!bh_cache_unannounced(c, x->run_node[i], x->run[i].lo)) {
      i++;
      continue;
    }
    size_t a = i;
    for (; i < n && bh_cache_unannounced(c, x->run_node[i], x->run[i].lo); i++)
      bh_cache_announce(c, x->run_node[i]);
    const kvp_key *parent = a > 0             ? &x->run[a - 1]
                            : x->run_has_parent ? &x->run_parent
                                                : NULL;
    int rc = publish_now(s, w, KVP_TIER_HBM, true, parent, x->run + a, i - a);
    if (rc < 0)
      return rc;
  }
  return 0;
}

/* The cache's residency changes, as events. */
static int cache_publish(void *ctx, uint32_t w, int tier, bool stored,
                         const kvp_key *key) {
  return publish_now(ctx, w, tier, stored, NULL, key, 1);
}

/* Block now in HBM (loaded, recomputed or new), of class cls for the
 * request at hand, met last block first; a new block extends the worker's
 * pending stored run (flush_run), a resident one ends it.  *fresh: it was
 * not cached. */
static int to_hbm(struct sim *s, uint32_t w, cache *c, uint32_t hint,
                  kvp_key key, uint32_t kid, const kvp_key *parent,
                  kvp_class cls, bool *fresh, uint32_t *node) {
  uint32_t v;
  int rc = bh_cache_to_hbm_at(c, hint, key, cls, fresh, &v);
  if (node != NULL)
    *node = v;
  if (rc < 0 || s->infinite)
    return rc;
  if (!*fresh) /* the run's parent: resident */
    return flush_run(s, w);
  bit_set(s->seen, kid);
  worker *wk = &s->w[w];
  wk->run_has_parent = parent != NULL; /* the run's first block's */
  if (parent)
    wk->run_parent = *parent;
  if (wk->run_n == wk->run_cap) {
    size_t nc = wk->run_cap ? wk->run_cap * 2 : 256;
    kvp_key *nr = realloc(wk->run, nc * sizeof *nr);
    if (nr == NULL)
      return KVP_ENOMEM;
    wk->run = nr;
    uint32_t *nn = realloc(wk->run_node, nc * sizeof *nn);
    if (nn == NULL)
      return KVP_ENOMEM;
    wk->run_node = nn;
    wk->run_cap = nc;
  }
  wk->run_node[wk->run_n] = v;
  wk->run[wk->run_n++] = key;
  return 0;
}

/* Class of block j of request q (the production classifier's split). */
static kvp_class blk_class(const bh_req *q, uint64_t j) {
  return j < q->stable_end ? KVP_CLASS_STABLE
         : j < q->semi_end ? KVP_CLASS_SEMI
                           : KVP_CLASS_VOLATILE;
}

/* ---- engine timing -------------------------------------------------------------- */
static double prefill_s(const struct sim *s, uint64_t from, uint64_t to) {
  return bh_timing_prefill_s(&s->tm, from, to);
}

static cache *cache_of(struct sim *s, uint32_t w) {
  return s->infinite ? &s->inf : &s->w[w].c;
}

static void set_load(struct sim *s, uint32_t w) {
  if (s->rt == NULL)
    return;
  worker *x = &s->w[w];
  cache *c = cache_of(s, w);
  /* Token terms come from the router's own in-flight table (exact); the
   * request counts are what an engine reports (queued includes routed). */
  kvp_worker_load l = {
      .queued_requests = (uint32_t)x->q_len,
      .running_requests = x->decoding + (x->cur != NONE),
      .decode_blocks = x->decode_blocks,
      .kv_util = c->cap[0] ? (double)c->count[0] / (double)c->cap[0] : 0};
  if (l.kv_util > 1)
    l.kv_util = 1;
  kvp_router_set_load(s->rt, w, &l);
}

/* Prefill start: what this worker actually holds decides the reuse (the
 * engine's own prefix match; loading only what pays off). */
/* Time-series bucket of request i: by arrival order, so each bucket holds
 * as many requests (a trace busy for an hour and idle for days still has a
 * point per 1/n of its work, and no empty buckets); series.t says when. */
static uint32_t bucket_of(const struct sim *s, uint32_t i) {
  uint32_t n = s->res->series.n;
  uint32_t b = (uint32_t)((double)i / (double)s->t->n_reqs * n);
  return b < n ? b : n - 1;
}

/* How many of keys[from..to) worker v holds from `from` on, in a row (any
 * tier): bh_cache_match's pipeline, its answers in the scratch arrays. */
static uint64_t held_run(const struct sim *s, uint32_t v, const kvp_key *keys,
                         uint64_t from, uint64_t to) {
  return from < to ? bh_cache_match(&s->w[v].c, keys + from, to - from,
                                    s->xtiers, s->xnodes)
                   : 0;
}

/* The furthest end of a run keys[m..end) that one worker other than w holds
 * (m if none): the "on another worker" miss cause.  The answer is the
 * longest run of any one worker, in whatever order they are read.  The
 * session's last worker (h) first, through its nodes (bh_cache_match_hinted:
 * one node line per block): its run is most often the answer.  Then a
 * worker can only beat the best end so far by holding the block at it, so
 * that one probe rules most workers out and the rest of the run is read only
 * for candidates: per request O(workers + run) probes, not O(workers x run).
 * Those probes are prefetched together: one cold line per worker, fetched in
 * parallel rather than one after another. */
static uint64_t run_elsewhere(const struct sim *s, uint32_t w,
                              const kvp_key *keys, const uint32_t *kid,
                              uint64_t m, uint64_t n, const sess_hint *h) {
  uint64_t best = m;
  if (m >= n || !bit_has(s->seen, kid[m]))
    return m; /* never cached anywhere: no worker holds it (most prompts'
                 first miss is new content), so no probe of every worker */
  uint32_t first = NONE;
  if (h != NULL && h->n > m && h->worker != w) {
    first = h->worker;
    best += bh_cache_match_hinted(&s->w[first].c, keys + m, n - m,
                                  h->nodes + m, h->n - m, s->xtiers,
                                  s->xnodes);
  }
  /* the first probes of all: their misses overlap */
  for (uint32_t v = 0; v < s->nw && best < n; v++)
    bh_cache_prefetch_begin(&s->w[v].c, keys, best, best + 1);
  for (uint32_t v = 0; v < s->nw && best < n; v++) {
    if (v == w || v == first ||
        bh_cache_find(&s->w[v].c, keys[best]) == NONE ||
        held_run(s, v, keys, m, best) < best - m)
      continue;
    best += 1 + held_run(s, v, keys, best + 1, n);
  }
  return best;
}

/* bh_sim_opts.verify_causes: run_elsewhere's answer against the longest
 * run from m of any other worker, block by block. */
static void verify_cause(struct sim *s, uint32_t w, const kvp_key *keys,
                         const uint32_t *kid, uint64_t m, uint64_t n,
                         const sess_hint *h, uint64_t got) {
  uint64_t want = m;
  for (uint32_t v = 0; v < s->nw; v++) {
    uint64_t e = m;
    while (v != w && e < n && bh_cache_find(&s->w[v].c, keys[e]) != NONE)
      e++;
    want = e > want ? e : want;
  }
  s->res->cause_mismatches += got != want;
  s->res->cause_hinted += h != NULL && h->n > m && h->worker != w && m < n &&
                          bit_has(s->seen, kid[m]);
}

/* The router's id of request i's leg: a P/D decode leg has its own. */
static uint64_t leg_id(const struct sim *s, uint32_t i) {
  return (s->pd && s->leg[i] == LEG_DECODE ? s->t->n_reqs : 0) +
         (uint64_t)i + 1;
}

static int decode_leg(struct sim *s, uint32_t p, uint32_t i);

static int start_prefill(struct sim *s, uint32_t w) {
  worker *x = &s->w[w];
  if (x->cur != NONE || x->q_len == 0)
    return 0;
  uint32_t i = x->q[x->q_head];
  x->q_head = (x->q_head + 1) % x->q_cap;
  x->q_len--;
  x->q_uncached -= s->est_uncached[i];
  x->cur = i;
  x->cur_start = s->now;
  /* a P/D decode leg's prefill (of what it did not pull) is not the
   * ledger's: the prefill leg's is */
  bool ledger = !s->pd || s->leg[i] != LEG_DECODE;
  const bh_req *q = &s->t->reqs[i];
  const kvp_key *keys = s->t->keys + q->key_off;
  const uint32_t *kid = s->t->kid + q->key_off;
  cache *c = cache_of(s, w);
  uint64_t n = q->n_blocks, m = 0, cut = 0, bs = s->bs;
  if (s->infinite) {
    m = cut = s->inf_reuse[i];
    for (uint64_t j = 0; j < m; j++)
      s->tiers[j] = KVP_TIER_HBM;
  } else {
    if (grow_array((void **)&x->found, &x->found_cap, n, sizeof *x->found) < 0)
      return KVP_ENOMEM;
    const sess_hint *h = q->session ? &s->hint[q->session] : NULL;
    if (h != NULL && h->n > 0 && h->worker == w)
      m = bh_cache_match_hinted(c, keys, n, h->nodes, h->n, s->tiers,
                                x->found);
    else
      m = bh_cache_match(c, keys, n, s->tiers, x->found);
    /* payoff cut: the prefix whose load + the rest's prefill is cheapest */
    cut = bh_timing_cut(&s->tm, s->tiers, m, q->in_tokens);
  }
  kvp_ledger_record *r = &x->rec;
  memset(r, 0, sizeof *r);
  r->tenant = s->t->names && q->tenant ? s->t->names[q->tenant] : NULL;
  r->session = s->t->names && q->session ? s->t->names[q->session] : NULL;
  r->worker = (int32_t)w;
  r->prompt_tokens = q->in_tokens;
  r->reused_tokens = cut * bs;
  r->recomputed_tokens = q->in_tokens - cut * bs;
  uint64_t cnt[3] = {0, 0, 0};
  for (uint64_t j = 0; j < cut; j++)
    cnt[s->tiers[j]]++;
  for (int k = 0; k < 3; k++) {
    r->reused_by_tier[k] = cnt[k] * bs;
    if (k > 0)
      r->load_bytes[k] = (uint64_t)((double)cnt[k] * bs * s->kvb);
  }
  memcpy(r->prompt_by_class, q->cls_tokens, sizeof r->prompt_by_class);
  uint64_t st = cut < q->stable_end ? cut : q->stable_end;
  uint64_t se = cut < q->semi_end ? cut : q->semi_end;
  r->reused_by_class[KVP_CLASS_STABLE] = st * bs;
  r->reused_by_class[KVP_CLASS_SEMI] = (se - st) * bs;
  r->reused_by_class[KVP_CLASS_VOLATILE] = (cut - se) * bs;
  /* why the rest was recomputed */
  r->miss_tokens[KVP_MISS_PARTIAL_BLOCK] = q->in_tokens - n * bs;
  r->miss_tokens[KVP_MISS_NOT_WORTH_LOADING] = (m - cut) * bs;
  const sess_hint *h = q->session ? &s->hint[q->session] : NULL;
  uint64_t other = s->infinite || !ledger
                       ? m : run_elsewhere(s, w, keys, kid, m, n, h);
  if (s->o->verify_causes && !s->infinite && ledger)
    verify_cause(s, w, keys, kid, m, n, h, other);
  uint64_t ev_end = other;
  if (!s->infinite)
    while (ev_end < n && bit_has(s->seen, kid[ev_end]))
      ev_end++;
  /* never-seen blocks where the session's previous turn had a block:
   * the prompt changed under them (prompt drift), not new content */
  uint64_t d0 = ev_end, d1 = ev_end;
  if (s->prev_req[i] != NONE) {
    const bh_req *p = &s->t->reqs[s->prev_req[i]];
    const kvp_key *pk = s->t->keys + p->key_off;
    uint64_t lo = bh_keys_common_prefix(pk, p->n_blocks, keys, n);
    /* blocks equal to the last turn's but not cached yet are in flight
     * (never seen); the ones after the divergence are drift */
    d0 = lo > ev_end ? lo : ev_end;
    d1 = p->n_blocks < n ? p->n_blocks : n;
    if (d1 < d0)
      d1 = d0;
  }
  r->miss_tokens[KVP_MISS_OTHER_WORKER] = (other - m) * bs;
  r->miss_tokens[KVP_MISS_EVICTED] = (ev_end - other) * bs;
  r->miss_tokens[KVP_MISS_DRIFT] = (d1 - d0) * bs;
  r->miss_tokens[KVP_MISS_NEVER_SEEN] = (n - ev_end - (d1 - d0)) * bs;
  if (cut > 0) {
    r->avoided_flops = kvp_model_prefill_flops(&s->cl.model, 0, cut * bs);
    r->avoided_gpu_seconds = r->avoided_flops / s->flops_s;
  }
  /* the loaded prefix is now in HBM, most recently used, its head last
   * (so a request that fills HBM evicts its own blocks tail first) */
  bool fresh;
  int rc = 0;
  for (uint64_t j = cut; j-- > 0 && rc == 0 && !s->infinite;) {
    if (j >= PREFETCH_AHEAD) /* the policy entry the touch moves */
      kvp__tier_policy_prefetch(c->hot, x->found[j - PREFETCH_AHEAD]);
    rc = to_hbm(s, w, c, x->found[j], keys[j], kid[j], j ? &keys[j - 1] : NULL,
                blk_class(q, j), &fresh, NULL);
  }
  if (rc == 0)
    rc = flush_run(s, w);
  if (rc < 0)
    return rc;
  double dur = bh_timing_step_s(&s->tm, cnt, cut * bs, q->in_tokens);
  x->assigned += r->recomputed_tokens;
  x->prefill_s += dur;
  x->legs++;
  if (!ledger)
    return ev_push(s, s->now + dur, EV_PREFILL_DONE, w, i, NULL);
  /* time series: by arrival bucket */
  uint32_t b = bucket_of(s, i);
  s->s_prompt[b] += (double)q->in_tokens;
  if (s->arrive[i] > s->res->series.t[b])
    s->res->series.t[b] = s->arrive[i];
  s->s_reused[b] += (double)r->reused_tokens;
  return ev_push(s, s->now + dur, EV_PREFILL_DONE, w, i, NULL);
}

static double decode_s(const struct sim *s, const worker *x,
                       const bh_req *q) {
  return bh_timing_decode_s(&s->tm, x->decoding, x->decode_tokens,
                            q->in_tokens, q->out_tokens);
}

/* req_log: the request's schedule in seconds since the first arrival (the
 * fields of `engine --req-log`, harness_engine.c's log_req). */
static void log_req(const struct sim *s, uint32_t w, uint32_t i) {
  const worker *x = &s->w[w];
  const bh_req *q = &s->t->reqs[i];
  fprintf(s->o->req_log,
          "{\"i\":%u,\"w\":%u,\"arrive\":%.6f,\"start\":%.6f,"
          "\"end\":%.6f,\"tokens\":%llu,\"cached\":%llu,\"queue\":%u,"
          "\"decoding\":%u}\n",
          i, w, s->arrive[i] - s->t_first, x->cur_start - s->t_first,
          s->now - s->t_first, (unsigned long long)q->in_tokens,
          (unsigned long long)x->rec.reused_tokens, s->q_seen[i],
          x->decoding);
}

static int prefill_done(struct sim *s, uint32_t w, uint32_t i) {
  worker *x = &s->w[w];
  const bh_req *q = &s->t->reqs[i];
  const kvp_key *keys = s->t->keys + q->key_off;
  const uint32_t *kid = s->t->kid + q->key_off;
  cache *c = cache_of(s, w);
  int rc = 0;
  bool fresh;
  int leg = s->pd ? s->leg[i] : LEG_FLAT;
  double ttft = s->now - s->arrive[i];
  if (s->q_seen)
    log_req(s, w, i);
  if (leg != LEG_PREFILL) /* the client's first token */
    kvp_hist_record(s->res->ttft_us, (uint64_t)(ttft * 1e6 + 0.5));
  /* The engine keeps every full block of the prompt in HBM, and frees
   * them as vLLM does, tail first: the blocks past the reused prefix enter
   * HBM last block first (a request that fills HBM evicts its own tail
   * first), then the whole chain is released (bh_cache_release: head most
   * recently used).  So each worker's HBM, and HBM + DRAM, stays a prefix
   * of every chain: the router's index bisects (kvp_index_opts.
   * prefix_closed).  rkeys: the keys last first, for bh_cache_prefetch's
   * forward pipeline. */
  uint64_t from = x->rec.reused_tokens / s->bs, n = q->n_blocks;
  uint64_t nn = s->infinite ? 0 : n - from;
  for (uint64_t r = 0; r < nn; r++)
    s->rkeys[r] = keys[n - 1 - r];
  /* the session's next turn starts from these nodes (sess_hint) */
  sess_hint *h = q->session && !s->infinite && leg != LEG_DECODE
                    ? &s->hint[q->session] : NULL;
  uint32_t *hn = NULL;
  if (h != NULL && --h->left == 0) { /* its last request: no next turn */
    free(h->nodes);
    *h = (sess_hint){0};
    h = NULL;
  }
  if (h != NULL) {
    if (grow_array((void **)&h->nodes, &h->cap, n, sizeof *h->nodes) < 0)
      return KVP_ENOMEM;
    if (from > 0) /* n == 0 leaves both arrays NULL */
      memcpy(h->nodes, x->found, from * sizeof *h->nodes);
    h->worker = w;
    h->n = n;
    hn = h->nodes;
  }
  bh_cache_prefetch_begin(c, s->rkeys, 0, nn);
  for (uint64_t r = 0; r < nn && rc == 0; r++) {
    uint64_t j = n - 1 - r;
    bh_cache_prefetch(c, s->rkeys, r, nn);
    rc = to_hbm(s, w, c, NONE, keys[j], kid[j], j ? &keys[j - 1] : NULL,
                blk_class(q, j), &fresh, hn ? &hn[j] : NULL);
  }
  if (rc == 0)
    rc = flush_run(s, w);
  if (rc < 0)
    return rc;
  if (!s->infinite)
    bh_cache_release(c, keys, x->found, from);
  if (leg != LEG_DECODE && kvp_ledger_add(s->led, &x->rec) < 0)
    s->res->ledger_rejects++;
  if (s->rt)
    kvp_router_complete(s->rt, w, leg_id(s, i));
  x->cur = NONE;
  if (leg == LEG_PREFILL) { /* its answer: the decode leg goes out */
    if ((rc = decode_leg(s, w, i)) < 0)
      return rc;
    rc = start_prefill(s, w);
    set_load(s, w);
    return rc;
  }
  double d = decode_s(s, x, q);
  if (q->out_tokens > 1)
    kvp_hist_record(s->res->tpot_us,
                    (uint64_t)(d / (q->out_tokens - 1) * 1e6 + 0.5));
  x->decode_s += d;
  x->out_tokens += q->out_tokens;
  x->decoding++;
  x->decode_blocks += q->n_blocks;
  x->decode_tokens += q->in_tokens;
  if ((rc = ev_push(s, s->now + d, EV_DECODE_DONE, w, i, NULL)) < 0)
    return rc;
  rc = start_prefill(s, w);
  set_load(s, w);
  return rc;
}

static int decode_done(struct sim *s, uint32_t w, uint32_t i) {
  worker *x = &s->w[w];
  const bh_req *q = &s->t->reqs[i];
  x->decoding--;
  x->decode_blocks -= q->n_blocks;
  x->decode_tokens -= q->in_tokens;
  if (s->pd) /* a decode leg: its KV leaves the decode batch */
    x->pd_kv -= q->in_tokens;
  s->done++;
  set_load(s, w);
  if (s->o->closed_loop && s->next_arrival < s->t->n_reqs)
    return ev_push(s, s->now, EV_ARRIVE, (uint32_t)s->next_arrival++, 0, NULL);
  return 0;
}

static void sample_occupancy(struct sim *s, uint32_t upto) {
  bh_series *se = &s->res->series;
  while (s->s_last < upto && s->s_last < se->n) {
    for (int k = 0; k < 3; k++) {
      double used = 0, cap = 0;
      for (uint32_t v = 0; v < s->nw && !s->infinite; v++) {
        used += (double)s->w[v].c.count[k];
        cap += (double)s->w[v].c.cap[k];
      }
      se->occ[k][s->s_last] = cap > 0 ? used / cap : NAN;
    }
    s->s_last++;
  }
}

/* Simulated seconds as the router's nanosecond clock, saturating: traces are
 * bounded (harness_trace.c) but a speed factor or long runs may still go
 * past 2^64 ns. */
static uint64_t sec_to_ns(double sec) {
  if (!(sec > 0))
    return 0;
  return sec >= 18e9 ? UINT64_MAX : (uint64_t)(sec * 1e9);
}

/* kvp_router_route_chosen's match (sim.chosen_only): what worker w's own
 * cache holds of the chain, within the index's query length.  With every
 * event applied at once, none lost and no routed records, the index holds
 * exactly what the caches do, so this is the answer its query would give
 * (test_bench_sim least_loaded_without_index); read from one cache, it
 * spares a policy that compares no matches the index's upkeep (an update
 * per residency change, a random line of a table that outgrows the CPU's
 * caches with the cluster). */
static int cache_match(void *ctx, uint32_t w, kvp_worker_match *out) {
  struct sim *s = ctx;
  size_t n = s->rq->n_blocks < KVP_INDEX_CHAIN_MAX ? s->rq->n_blocks
                                                   : KVP_INDEX_CHAIN_MAX;
  uint64_t m = bh_cache_match(&s->w[w].c, s->rq->keys, n, s->xtiers, s->xnodes);
  for (uint64_t j = 0; j < m; j++)
    out->blocks[s->xtiers[j]]++;
  return 0;
}

/* rd_proxy.c's RD_PD_PREFILL_SESSION: a session's prefill legs keep an
 * affinity of their own, apart from its decode legs' */
#define PD_PREFILL_SESSION 0x9e3779b97f4a7c15ull

/* Request i as the router sees it (cls: its classification's storage). */
static kvp_route_request route_request(const struct sim *s, uint32_t i,
                                       kvp_classification *cls) {
  const bh_req *q = &s->t->reqs[i];
  *cls = (kvp_classification){.stable_end = q->stable_end,
                              .semi_end = q->semi_end,
                              .n_blocks = q->n_blocks};
  memcpy(cls->tokens, q->cls_tokens, sizeof cls->tokens);
  return (kvp_route_request){.keys = s->t->keys + q->key_off,
                             .n_blocks = q->n_blocks,
                             .prompt_tokens = q->in_tokens,
                             .cls = cls,
                             .session_id = q->session_id,
                             .request_id = leg_id(s, i),
                             .tenant = q->tenant,
                             .flags = KVP_ROUTE_NOW,
                             .now_ns = sec_to_ns(s->now)};
}

static int route(struct sim *s, uint32_t i, uint32_t *out) {
  const bh_req *q = &s->t->reqs[i];
  if (s->o->policy == BH_POLICY_RANDOM) {
    *out = (uint32_t)(rng_next(s) % (s->pd ? s->cl.pd_prefill : s->nw));
    return 0;
  }
  if (s->infinite) { /* least pending prefill tokens, then lowest id */
    uint32_t best = 0;
    uint64_t bl = UINT64_MAX;
    for (uint32_t v = 0; v < s->nw; v++) {
      uint64_t l = s->w[v].q_uncached;
      if (l < bl) {
        bl = l;
        best = v;
      }
    }
    *out = best;
    return 0;
  }
  kvp_classification cls;
  kvp_route_request rq = route_request(s, i, &cls);
  if (s->pd) { /* the prefill leg: over the prefill workers */
    rq.session_id ^= q->session_id ? PD_PREFILL_SESSION : 0;
    rq.eligible = s->elig + (s->nw + 63) / 64; /* the prefill mask */
    rq.n_eligible_words = (s->nw + 63) / 64;
  }
  kvp_decision d;
  int rc;
  if (s->chosen_only) {
    s->rq = &rq;
    rc = kvp_router_route_chosen(s->rt, &rq, cache_match, s, &d);
  } else if (s->ix_fed) {
    pend_flush(s); /* the query sees every event published before it */
    rc = kvp_router_route(s->rt, s->ix, &rq, sec_to_ns(s->now), &d);
  } else { /* the same worker without the index's matches */
    rc = kvp_router_route_matches(s->rt, &rq, NULL, 0, &d);
  }
  if (rc < 0)
    return rc;
  *out = d.worker;
  s->est_uncached[i] = d.uncached_tokens;
  return 0;
}

static int enqueue(struct sim *s, uint32_t w, uint32_t i);

static int arrive(struct sim *s, uint32_t i) {
  const bh_req *q = &s->t->reqs[i];
  s->arrive[i] = s->now;
  s->est_uncached[i] = q->in_tokens;
  s->prev_req[i] = q->session ? s->sess_last[q->session] : NONE;
  if (q->session)
    s->sess_last[q->session] = i;
  if (s->infinite) { /* everything sent before is cached, at once */
    const uint32_t *kid = s->t->kid + q->key_off;
    uint32_t m = 0, n = q->n_blocks;
    if (s->prev_req[i] != NONE) { /* the session's last prompt: all sent */
      const bh_req *p = &s->t->reqs[s->prev_req[i]];
      m = (uint32_t)bh_keys_common_prefix(s->t->keys + p->key_off,
                                          p->n_blocks, s->t->keys + q->key_off,
                                          n);
    }
    while (m < n && bit_has(s->inf_keys, kid[m]))
      m++;
    s->inf_reuse[i] = m;
    s->est_uncached[i] = q->in_tokens - (uint64_t)m * s->bs;
    /* chained keys: none after the first new one was sent before */
    for (uint32_t j = m; j < n; j++)
      bit_set(s->inf_keys, kid[j]);
    s->inf.count[KVP_TIER_HBM] += q->n_blocks - m;
  }
  sample_occupancy(s, bucket_of(s, i));
  uint32_t w;
  int rc = route(s, i, &w);
  if (rc < 0)
    return rc;
  if (s->pd)
    s->leg[i] = LEG_PREFILL;
  return enqueue(s, w, i);
}

/* Request i (either leg) joins worker w's queue. */
static int enqueue(struct sim *s, uint32_t w, uint32_t i) {
  worker *x = &s->w[w];
  if (s->q_seen)
    s->q_seen[i] = (uint32_t)x->q_len + (x->cur != NONE);
  if (x->q_len == x->q_cap) {
    size_t nc = x->q_cap ? x->q_cap * 2 : 64;
    uint32_t *nq = malloc(nc * sizeof *nq);
    if (nq == NULL)
      return KVP_ENOMEM;
    for (size_t k = 0; k < x->q_len; k++)
      nq[k] = x->q[(x->q_head + k) % x->q_cap];
    free(x->q);
    x->q = nq;
    x->q_head = 0;
    x->q_cap = nc;
  }
  x->q[(x->q_head + x->q_len) % x->q_cap] = i;
  x->q_len++;
  x->q_uncached += s->est_uncached[i];
  s->req_worker[i] = w;
  int rc = start_prefill(s, w);
  set_load(s, w);
  return rc;
}

/* ---- P/D: the decode leg (kvplane-routerd's rd_pd.c, the engine's pull) ----- */
/* The decode workers' matches of keys[0..nq) into s->wm: the index's, as
 * routerd queries it; where no index is kept (round_robin, least_loaded
 * with every event at once), each decode worker's cache, which is what
 * such an index would answer. */
static size_t decode_matches(struct sim *s, const kvp_key *keys, size_t nq) {
  if (s->ix_fed) {
    pend_flush(s);
    int got = kvp_router_match(s->ix, keys, nq, sec_to_ns(s->now), s->nw,
                               s->ixm, s->wm, s->nw);
    return got > 0 ? (size_t)got : 0; /* failed: on load alone, as routerd */
  }
  size_t nm = 0;
  for (uint32_t v = s->cl.pd_prefill; v < s->nw; v++) {
    uint64_t m = bh_cache_match(&s->w[v].c, keys, nq, s->xtiers, s->xnodes);
    kvp_worker_match *wm = &s->wm[nm];
    memset(wm, 0, sizeof *wm);
    wm->worker = v;
    for (uint64_t j = 0; j < m; j++)
      wm->blocks[s->xtiers[j]]++;
    nm += m > 0;
  }
  return nm;
}

/* v's entry in s->wm[0..*nm), appended (matching nothing) if absent. */
static kvp_worker_match *match_of(struct sim *s, size_t *nm, uint32_t v) {
  for (size_t k = 0; k < *nm; k++)
    if (s->wm[k].worker == v)
      return &s->wm[k];
  kvp_worker_match *m = &s->wm[(*nm)++];
  memset(m, 0, sizeof *m);
  m->worker = v;
  return m;
}

static uint64_t own_blocks(const kvp_worker_match *m) {
  uint64_t own = 0;
  for (int k = 0; k < KVP_TIER_COUNT_; k++)
    own += k == KVP_TIER_REMOTE ? 0 : m->blocks[k];
  return own;
}

/* rd_pd_decode_eligible: of the decode workers, those whose pull of the
 * n_pull offered blocks they lack plus decode load (out steps, each
 * reading the KV of the decode legs there and this one's at the cost
 * model's HBM bandwidth) is within 5 % (+ 0.1 ms) of the best, into the
 * mask s->elig; then rd_pd_decode_matches: the blocks each decode worker
 * lacks are its match on the remote tier. */
static void decode_candidates(struct sim *s, const bh_req *q, size_t *nm,
                              uint64_t n_pull) {
  double hbm = kvp_router_bandwidth(s->rt, KVP_TIER_HBM), best = -1;
  uint32_t out = q->out_tokens ? q->out_tokens : 16; /* routerd's default */
  double *cost = s->pd_cost;
  for (uint32_t v = s->cl.pd_prefill; v < s->nw; v++) {
    uint64_t own = own_blocks(match_of(s, nm, v));
    uint64_t lack = own < n_pull ? n_pull - own : 0;
    double step = hbm > 0 ? (double)(s->w[v].pd_kv + q->in_tokens) * s->kvb /
                                hbm : 0;
    cost[v] = bh_timing_link_s(&s->tm, s->cl.link_gbps, s->cl.link_latency_us,
                               lack) + (double)out * step;
    best = best < 0 || cost[v] < best ? cost[v] : best;
  }
  uint32_t words = (s->nw + 63) / 64;
  memset(s->elig, 0, words * sizeof *s->elig);
  for (uint32_t v = s->cl.pd_prefill; v < s->nw; v++) {
    if (cost[v] <= best * 1.05 + 1e-4)
      s->elig[v / 64] |= 1ull << (v % 64);
    kvp_worker_match *m = match_of(s, nm, v);
    uint64_t own = own_blocks(m);
    if (own < n_pull)
      m->blocks[KVP_TIER_REMOTE] += (uint32_t)(n_pull - own);
  }
}

/* The decode leg's worker for request i, n_pull blocks offered. */
static int route_decode(struct sim *s, uint32_t i, uint64_t n_pull,
                        uint32_t *out) {
  const bh_req *q = &s->t->reqs[i];
  if (s->o->policy == BH_POLICY_RANDOM) {
    *out = s->cl.pd_prefill + (uint32_t)(rng_next(s) % s->cl.pd_decode);
    return 0;
  }
  size_t nq = q->n_blocks < KVP_INDEX_CHAIN_MAX ? q->n_blocks
                                                : KVP_INDEX_CHAIN_MAX;
  n_pull = n_pull < nq ? n_pull : nq; /* routerd's pull_blocks */
  size_t nm = decode_matches(s, s->t->keys + q->key_off, nq);
  decode_candidates(s, q, &nm, n_pull);
  kvp_classification cls;
  kvp_route_request rq = route_request(s, i, &cls);
  rq.eligible = s->elig;
  rq.n_eligible_words = (s->nw + 63) / 64;
  kvp_decision d;
  int rc = kvp_router_route_matches(s->rt, &rq, s->wm, nm, &d);
  if (rc < 0)
    return rc;
  *out = d.worker;
  s->est_uncached[i] = d.uncached_tokens;
  return 0;
}

/* Request i's prefill leg ended on worker p: its answer offers the
 * prompt's full blocks p holds now (the engine's keep_kv_ids); the decode
 * leg is routed and pulls, as the engine's pull_kv, the offered blocks past
 * its worker's own cached prefix over the link (EV_PULLED). */
static int decode_leg(struct sim *s, uint32_t p, uint32_t i) {
  const bh_req *q = &s->t->reqs[i];
  const kvp_key *keys = s->t->keys + q->key_off;
  uint64_t offered = bh_cache_match(&s->w[p].c, keys, q->n_blocks, s->xtiers,
                                    s->xnodes);
  s->leg[i] = LEG_DECODE;
  uint32_t d;
  int rc = route_decode(s, i, offered, &d);
  if (rc < 0)
    return rc;
  uint64_t own = bh_cache_match(&s->w[d].c, keys, offered, s->xtiers,
                                s->xnodes);
  uint64_t lack = offered - own;
  s->res->xfer_blocks += lack;
  s->res->xfer_bytes += (uint64_t)bh_timing_link_bytes(&s->tm, lack);
  s->res->local_blocks += own;
  s->pull_from[i] = (uint32_t)own;
  s->pull_to[i] = (uint32_t)offered;
  s->w[d].pd_kv += q->in_tokens; /* routerd counts it from the dispatch */
  double x = bh_timing_link_s(&s->tm, s->cl.link_gbps, s->cl.link_latency_us,
                              lack);
  return ev_push(s, s->now + x, EV_PULLED, d, i, NULL);
}

/* The pulled blocks are in decode worker d's HBM (published as its own,
 * last first as a prefill stores them); the leg joins d's queue, where its
 * prefill finds them cached and computes the rest (the engine's on_pulled). */
static int pulled(struct sim *s, uint32_t d, uint32_t i) {
  const bh_req *q = &s->t->reqs[i];
  const kvp_key *keys = s->t->keys + q->key_off;
  const uint32_t *kid = s->t->kid + q->key_off;
  cache *c = &s->w[d].c;
  bool fresh;
  int rc = 0;
  for (uint64_t j = s->pull_to[i]; j-- > s->pull_from[i] && rc == 0;)
    rc = to_hbm(s, d, c, NONE, keys[j], kid[j], j ? &keys[j - 1] : NULL,
                blk_class(q, j), &fresh, NULL);
  if (rc == 0)
    rc = flush_run(s, d);
  return rc < 0 ? rc : enqueue(s, d, i);
}

static void progress(struct sim *s, size_t k, size_t n, bool end) {
  if (!s->o->progress && s->o->progress_at == NULL)
    return;
  if (!end && (n < 100 || k % (n / 100) != 0))
    return;
  if (s->o->progress_at != NULL)
    atomic_store_explicit(s->o->progress_at, end ? n : k, memory_order_relaxed);
  if (!s->o->progress)
    return;
  int pct = n ? (int)(100.0 * (double)k / (double)n) : 100;
  if (end)
    pct = 100;
  char bar[41];
  for (int j = 0; j < 40; j++)
    bar[j] = j < pct * 40 / 100 ? '#' : '.';
  bar[40] = '\0';
  fprintf(stderr, "\r  %-20s [%s] %3d%%%s", bh_policy_name(s->o->policy), bar,
          pct, end ? "\n" : "");
}

/* P/D's per-request legs, the decode choice's scratch, and the prefill
 * workers' mask (s->elig's second half; the first is the decode leg's). */
static int pd_setup(struct sim *s) {
  size_t n = s->t->n_reqs, words = (s->nw + 63) / 64;
  s->leg = calloc(n + 1, sizeof *s->leg);
  s->pull_from = calloc(n + 1, sizeof *s->pull_from);
  s->pull_to = calloc(n + 1, sizeof *s->pull_to);
  s->wm = calloc(s->nw, sizeof *s->wm);
  s->ixm = calloc(s->nw, sizeof *s->ixm);
  s->elig = calloc(2 * words, sizeof *s->elig);
  s->pd_cost = calloc(s->nw, sizeof *s->pd_cost);
  if (s->leg == NULL || s->pull_from == NULL || s->pull_to == NULL ||
      s->wm == NULL || s->ixm == NULL || s->elig == NULL ||
      s->pd_cost == NULL)
    return KVP_ENOMEM;
  for (uint32_t v = 0; v < s->cl.pd_prefill; v++)
    s->elig[words + v / 64] |= 1ull << (v % 64);
  return 0;
}

static int sim_setup(struct sim *s, const bh_trace *t, const bh_sim_opts *o,
                     bh_result *r, char *err, size_t cap) {
  s->t = t;
  s->o = o;
  s->res = r;
  s->cl = o->cl;
  s->bs = t->block_size;
  s->infinite = o->policy == BH_POLICY_INFINITE;
  /* round_robin's and random's choices read no matches: their runs keep no
   * index (the same answers, without its work), unless it is verified */
  /* least_loaded compares no matches: with every event reaching the index
   * at once and intact, the chosen worker's cache answers for it
   * (cache_match); delayed or dropped events, routed records or
   * verify_index keep the index */
  s->chosen_only =
      o->policy < KVP_POLICY_COUNT_ &&
      kvp_policy_reads_matches((kvp_policy)o->policy) &&
      !kvp_policy_compares_matches((kvp_policy)o->policy) &&
      !o->verify_index && o->drop_events == 0 && o->delay_events_s == 0 &&
      !o->router.record_routed && !o->router.pending_ms;
  s->ix_fed = !s->infinite && !s->chosen_only &&
              (o->verify_index ||
               (o->policy < KVP_POLICY_COUNT_ &&
                kvp_policy_reads_matches((kvp_policy)o->policy)));
  s->rng = o->seed ^ 0x6b76706c616e6562ull;
  int rc = bh_cluster_resolve(&s->cl, t->block_size);
  if (rc < 0) {
    snprintf(err, cap, "bad cluster (workers 1..4096, HBM >= one block; "
             "P/D: prefill and decode workers both > 0, their sum the "
             "workers, the link > 0)");
    return rc;
  }
  s->pd = s->cl.pd_prefill > 0;
  if (s->pd && s->infinite) {
    snprintf(err, cap, "P/D: the infinite bound is not modelled (its one "
             "shared cache would move no KV)");
    return KVP_EINVAL;
  }
  s->nw = s->cl.workers;
  s->kvb = kvp_model_kv_bytes_per_token(&s->cl.model);
  kvp_router_opts ro;
  bh_sim_router_opts(o, s->bs, &ro);
  if ((rc = kvp_router_create(&ro, NULL, &s->rt)) < 0) {
    snprintf(err, cap, "router options rejected: %s", kvp_strerror(rc));
    return rc;
  }
  bh_timing_setup(&s->tm, &s->cl, s->bs, s->rt);
  s->flops_s = s->tm.flops_s;
  { /* the NVMe gate's per-block costs */
    double blk = s->kvb * s->bs, mean = 0;
    if (t->n_reqs > 0)
      mean = (double)bh_trace_prompt_tokens(t) / (double)t->n_reqs;
    uint64_t nb = mean >= s->bs ? (uint64_t)(mean / s->bs) : 1;
    s->adm_cost.recompute_s = prefill_s(s, 0, nb * s->bs) / (double)nb;
    s->adm_cost.read_s = blk / s->cl.gpu.bw[2] + s->cl.gpu.latency_s[2];
    s->adm_cost.write_s =
        blk / (s->cl.nvme_write_bw > 0 ? s->cl.nvme_write_bw : s->cl.gpu.bw[2]);
  }
  /* The index's tables sized up front for the most keys it can hold: the
   * cluster's blocks, or the trace's distinct keys if fewer (bh_trace_finish
   * numbers them: the index holds one entry per key, however many workers
   * hold it).  Grown from small they were rebuilt ~20 times on
   * the way (x1.4, every key copied) and ran at loads up to 7/8; sized
   * so, they stay about half full or less, where a lookup reads one line
   * (kvp_index_opts.expected_keys).  bench_harness_scale: 1x ~15 % more
   * requests/s, 20x 0-9 % (within this VM's noise; docs/performance.md,
   * "Tried"). */
  uint64_t most = (uint64_t)s->nw * (s->cl.hbm_blocks + s->cl.dram_blocks +
                                     s->cl.nvme_blocks);
  kvp_index_opts io = {.max_workers = s->nw,
                       .expected_keys = !s->ix_fed ? 0
                                        : most < t->n_kids ? most
                                                           : t->n_kids,
                       .prefix_closed = !o->index_walk && s->cl.tier_policy
                                                          [KVP_TIER_HBM] ==
                                                      KVP_TIER_POLICY_LRU};
  if ((rc = kvp_index_create(&io, NULL, &s->ix)) < 0 ||
      (rc = kvp_ledger_create(NULL, NULL, &s->led)) < 0 ||
      (rc = kvp_hist_create(NULL, &r->ttft_us)) < 0 ||
      (rc = kvp_hist_create(NULL, &r->tpot_us)) < 0)
    return rc;
  s->w = calloc(s->nw, sizeof *s->w);
  size_t n = t->n_reqs;
  s->req_worker = calloc(n + 1, sizeof *s->req_worker);
  s->inf_reuse = calloc(n + 1, sizeof *s->inf_reuse);
  s->arrive = calloc(n + 1, sizeof *s->arrive);
  s->est_uncached = calloc(n + 1, sizeof *s->est_uncached);
  s->prev_req = malloc((n + 1) * sizeof *s->prev_req);
  s->sess_last = malloc((t->n_names + 1) * sizeof *s->sess_last);
  s->hint = calloc(t->n_names + 1, sizeof *s->hint);
  if (s->prev_req == NULL || s->sess_last == NULL || s->hint == NULL)
    return KVP_ENOMEM;
  for (size_t i = 0; i < n; i++)
    if (t->reqs[i].session)
      s->hint[t->reqs[i].session].left++;
  memset(s->sess_last, 0xff, (t->n_names + 1) * sizeof *s->sess_last);
  if (t->kid == NULL && n > 0) { /* bh_trace_finish numbers the keys */
    snprintf(err, cap, "trace not finished: call bh_trace_finish first");
    return KVP_EINVAL;
  }
  s->seen = bits_new(t);
  if (s->infinite && (s->inf_keys = bits_new(t)) == NULL)
    return KVP_ENOMEM;
  uint32_t maxb = 1;
  for (size_t i = 0; i < n; i++)
    if (t->reqs[i].n_blocks > maxb)
      maxb = t->reqs[i].n_blocks;
  s->tiers = malloc(maxb);
  s->xtiers = malloc(maxb);
  s->xnodes = malloc((size_t)maxb * sizeof *s->xnodes);
  s->rkeys = malloc((size_t)maxb * sizeof *s->rkeys);
  if (s->w == NULL || s->req_worker == NULL || s->inf_reuse == NULL ||
      s->arrive == NULL || s->est_uncached == NULL || s->seen == NULL ||
      s->tiers == NULL || s->rkeys == NULL ||
      s->xtiers == NULL || s->xnodes == NULL)
    return KVP_ENOMEM;
  if (s->pd && (rc = pd_setup(s)) < 0)
    return rc;
  /* batch simulations: the workers' arrays from a region the process keeps
   * between simulations (harness_region.h), so each after the first finds
   * their pages in memory */
  if (bh_huge_arrays &&
      bh_region_take((size_t)s->nw * bh_cache_reserve_bytes(&s->cl),
                     &s->region) == 0)
    s->ralloc = bh_region_allocator(s->region);
  for (uint32_t v = 0; v < s->nw; v++) {
    s->w[v].cur = NONE;
    if ((rc = kvp_index_worker_add(s->ix, v)) < 0 ||
        (rc = bh_cache_init_in(&s->w[v].c, &s->cl, true,
                               s->region ? &s->ralloc : NULL)) < 0)
      return rc;
    bh_cache *c = &s->w[v].c;
    c->adm_cost = s->adm_cost;
    c->block_bytes = (uint64_t)(s->kvb * s->bs);
    c->publish = cache_publish;
    c->publish_ctx = s;
    c->publish_id = v;
  }
  if (s->infinite &&
      (rc = bh_cache_init(&s->inf, &s->cl, false)) < 0)
    return rc;
  bh_series *se = &r->series;
  se->n = o->buckets ? o->buckets : 48;
  se->hit = calloc(se->n, sizeof *se->hit);
  se->t = calloc(se->n, sizeof *se->t);
  s->s_prompt = calloc(se->n, sizeof *s->s_prompt);
  s->s_reused = calloc(se->n, sizeof *s->s_reused);
  for (int k = 0; k < 3; k++)
    se->occ[k] = calloc(se->n, sizeof *se->occ[k]);
  if (se->hit == NULL || se->t == NULL || s->s_prompt == NULL || s->s_reused == NULL ||
      se->occ[0] == NULL || se->occ[1] == NULL || se->occ[2] == NULL)
    return KVP_ENOMEM;
  double speed = o->speed > 0 ? o->speed : 1.0;
  s->t_span = n ? t->reqs[n - 1].t / speed : 0;
  if (o->closed_loop)
    s->t_span = 0; /* bucket by arrival order (bucket_of) */
  s->t_first = n && !o->closed_loop ? t->reqs[0].t / speed : 0;
  if (o->req_log && (s->q_seen = calloc(n + 1, sizeof *s->q_seen)) == NULL)
    return KVP_ENOMEM;
  return 0;
}

static void sim_teardown(struct sim *s) {
  while (s->heap_n > 0) {
    ev e = ev_pop(s);
    free(e.p);
  }
  free(s->heap);
  for (uint32_t v = 0; s->w && v < s->nw; v++) {
    bh_cache_free(&s->w[v].c);
    free(s->w[v].q);
    free(s->w[v].run);
    free(s->w[v].run_node);
    free(s->w[v].found);
  }
  if (s->infinite)
    bh_cache_free(&s->inf);
  free(s->inf_keys);
  free(s->w);
  free(s->req_worker);
  free(s->inf_reuse);
  free(s->arrive);
  free(s->est_uncached);
  free(s->prev_req);
  free(s->sess_last);
  for (size_t k = 0; s->hint && k <= s->t->n_names; k++)
    free(s->hint[k].nodes);
  free(s->hint);
  free(s->q_seen);
  free(s->leg);
  free(s->pull_from);
  free(s->pull_to);
  free(s->wm);
  free(s->ixm);
  free(s->elig);
  free(s->pd_cost);
  free(s->seen);
  free(s->pend);
  free(s->pend_keys);
  free(s->tiers);
  free(s->xtiers);
  free(s->xnodes);
  free(s->rkeys);
  free(s->s_prompt);
  free(s->s_reused);
  kvp_router_destroy(s->rt);
  kvp_index_destroy(s->ix);
  kvp_ledger_destroy(s->led);
  bh_region_give(s->region); /* after every cache carved from it */
}

static int sim_loop(struct sim *s) {
  const bh_trace *t = s->t;
  size_t n = t->n_reqs;
  double speed = s->o->speed > 0 ? s->o->speed : 1.0;
  int rc = 0;
  if (s->o->closed_loop) {
    for (; s->next_arrival < n && s->next_arrival < s->o->closed_loop;
         s->next_arrival++)
      if ((rc = ev_push(s, 0.0, EV_ARRIVE, (uint32_t)s->next_arrival, 0,
                        NULL)) < 0)
        return rc;
  } else {
    for (size_t i = 0; i < n; i++)
      if ((rc = ev_push(s, t->reqs[i].t / speed, EV_ARRIVE, (uint32_t)i, 0,
                        NULL)) < 0)
        return rc;
  }
  size_t arrived = 0;
  while (s->heap_n > 0 && rc >= 0) {
    ev e = ev_pop(s);
    s->now = e.t;
    switch (e.type) {
    case EV_ARRIVE:
      progress(s, arrived++, n, false);
      rc = arrive(s, e.a);
      break;
    case EV_PREFILL_DONE:
      rc = prefill_done(s, e.a, (uint32_t)e.b);
      break;
    case EV_DECODE_DONE:
      rc = decode_done(s, e.a, (uint32_t)e.b);
      break;
    case EV_PULLED:
      rc = pulled(s, e.a, (uint32_t)e.b);
      break;
    default: {
      delayed *d = e.p;
      pend_flush(s); /* published before it: applied before it */
      apply_event(s, d->worker, d->seq, d->tier, d->stored,
                  d->has_parent ? &d->parent : NULL, d->keys, d->n);
      free(d);
    }
    }
  }
  progress(s, n, n, true);
  return rc;
}

/* Workers [lo, hi)'s share (one P/D role). */
static void role_sum(const struct sim *s, bh_role_load *r, uint32_t lo,
                     uint32_t hi) {
  double mx = 0;
  r->workers = hi - lo;
  for (uint32_t v = lo; v < hi; v++) {
    const worker *x = &s->w[v];
    r->legs += x->legs;
    r->prefill_tokens += x->assigned;
    r->out_tokens += x->out_tokens;
    r->prefill_s += x->prefill_s;
    r->decode_s += x->decode_s;
    double load = lo == 0 ? (double)x->assigned : x->decode_s;
    mx = load > mx ? load : mx;
  }
  double sum = lo == 0 ? (double)r->prefill_tokens : r->decode_s;
  r->imbalance = sum > 0 ? mx / (sum / r->workers) : 1.0;
}

static void summarize(struct sim *s) {
  bh_result *r = s->res;
  pend_flush(s);
  kvp_ledger_global_totals(s->led, &r->tot);
  kvp_index_stats_get(s->ix, &r->ix);
  r->requests = r->tot.requests;
  kvp_hist_summarize(r->ttft_us, &r->ttft);
  r->ttft_p95_s = (double)kvp_hist_quantile(r->ttft_us, 0.95) / 1e6;
  double mx = 0, sum = 0;
  for (uint32_t v = 0; v < s->nw; v++) {
    const bh_cache_stats *st = &s->w[v].c.st;
    for (int k = 0; k < 3; k++)
      r->demoted_bytes[k] += st->demoted_bytes[k];
    r->evicted_blocks += st->evicted_blocks;
    r->nvme_admitted += st->nvme_admitted;
    r->nvme_rejected += st->nvme_rejected;
    sum += (double)s->w[v].assigned;
    if ((double)s->w[v].assigned > mx)
      mx = (double)s->w[v].assigned;
  }
  r->imbalance = sum > 0 ? mx / (sum / s->nw) : 1.0;
  kvp_hist_summarize(r->tpot_us, &r->tpot);
  r->pd = s->pd;
  if (s->pd) {
    role_sum(s, &r->role[BH_ROLE_PREFILL], 0, s->cl.pd_prefill);
    role_sum(s, &r->role[BH_ROLE_DECODE], s->cl.pd_prefill, s->nw);
    r->imbalance = r->role[BH_ROLE_PREFILL].imbalance;
  }
  r->sim_seconds = s->now;
  bh_series *se = &r->series;
  sample_occupancy(s, se->n);
  se->t_end = s->t_span;
  for (uint32_t b = 0; b < se->n; b++)
    se->hit[b] = s->s_prompt[b] > 0 ? s->s_reused[b] / s->s_prompt[b] : NAN;
}

/* mallctl, or ENOENT where jemalloc is not linked (sanitizer builds:
 * KVP_JEMALLOC_WEAK, bench/harness/CMakeLists.txt). */
#ifdef KVP_JEMALLOC_WEAK
#pragma weak mallctl
#endif
static int je_mallctl(const char *name, void *old, size_t *oldlen, void *new_,
                      size_t newlen) {
  int (*volatile fn)(const char *, void *, size_t *, void *, size_t) = mallctl;
  return fn != NULL ? fn(name, old, oldlen, new_, newlen) : ENOENT;
}

/* Batch memory: every jemalloc arena's extent hooks forward to jemalloc's
 * own (je_own), and each new mapping asks for transparent huge pages.  An
 * arena whose hooks are not jemalloc's own clears the memory it hands back
 * to calloc with memset; with its own it drops it (MADV_DONTNEED) and
 * every page faults in again (jemalloc 5.3, ehooks_zero). */
static extent_hooks_t *je_own;

static void *hk_alloc(extent_hooks_t *h, void *at, size_t size, size_t align,
                      bool *zero, bool *commit, unsigned ind) {
  (void)h;
  void *p = je_own->alloc(je_own, at, size, align, zero, commit, ind);
#ifdef MADV_HUGEPAGE
  if (p != NULL) /* whole pages: what jemalloc maps */
    (void)madvise(p, size, MADV_HUGEPAGE);
#endif
  return p;
}

static bool hk_dalloc(extent_hooks_t *h, void *at, size_t size, bool commit,
                      unsigned ind) {
  (void)h;
  return je_own->dalloc(je_own, at, size, commit, ind);
}

static void hk_destroy(extent_hooks_t *h, void *at, size_t size, bool commit,
                       unsigned ind) {
  (void)h;
  je_own->destroy(je_own, at, size, commit, ind);
}

static bool hk_commit(extent_hooks_t *h, void *at, size_t size, size_t off,
                      size_t len, unsigned ind) {
  (void)h;
  return je_own->commit(je_own, at, size, off, len, ind);
}

static bool hk_decommit(extent_hooks_t *h, void *at, size_t size, size_t off,
                        size_t len, unsigned ind) {
  (void)h;
  return je_own->decommit(je_own, at, size, off, len, ind);
}

static bool hk_purge_lazy(extent_hooks_t *h, void *at, size_t size,
                          size_t off, size_t len, unsigned ind) {
  (void)h;
  return je_own->purge_lazy(je_own, at, size, off, len, ind);
}

static bool hk_purge_forced(extent_hooks_t *h, void *at, size_t size,
                            size_t off, size_t len, unsigned ind) {
  (void)h;
  return je_own->purge_forced(je_own, at, size, off, len, ind);
}

static bool hk_split(extent_hooks_t *h, void *at, size_t size, size_t a,
                     size_t b, bool commit, unsigned ind) {
  (void)h;
  return je_own->split(je_own, at, size, a, b, commit, ind);
}

static bool hk_merge(extent_hooks_t *h, void *a, size_t na, void *b,
                     size_t nb, bool commit, unsigned ind) {
  (void)h;
  return je_own->merge(je_own, a, na, b, nb, commit, ind);
}

static extent_hooks_t hk; /* filled from je_own: NULL where it has none */

static void batch_hooks(void) {
  extent_hooks_t *own = NULL;
  size_t sz = sizeof own;
  if (je_mallctl("arena.0.extent_hooks", &own, &sz, NULL, 0) != 0 ||
      own == NULL || own == &hk)
    return; /* not jemalloc's malloc, or done already */
  je_own = own;
  hk = (extent_hooks_t){
      hk_alloc,
      je_own->dalloc ? hk_dalloc : NULL,
      je_own->destroy ? hk_destroy : NULL,
      je_own->commit ? hk_commit : NULL,
      je_own->decommit ? hk_decommit : NULL,
      je_own->purge_lazy ? hk_purge_lazy : NULL,
      je_own->purge_forced ? hk_purge_forced : NULL,
      je_own->split ? hk_split : NULL,
      je_own->merge ? hk_merge : NULL};
  size_t over = 0; /* an allocation this big makes the huge arena: now */
  sz = sizeof over;
  if (je_mallctl("opt.oversize_threshold", &over, &sz, NULL, 0) == 0 && over) {
    void *volatile big = malloc(over);
    free(big);
  }
  unsigned n = 0;
  sz = sizeof n;
  extent_hooks_t *mine = &hk;
  if (je_mallctl("arenas.narenas", &n, &sz, NULL, 0) == 0)
    for (unsigned a = 0; a < n; a++) {
      char key[64];
      snprintf(key, sizeof key, "arena.%u.extent_hooks", a);
      (void)je_mallctl(key, NULL, NULL, &mine, sizeof mine); /* none: EFAULT */
    }
}

void bh_batch_memory(void) {
  bh_huge_arrays = true;
  ssize_t never = -1; /* decay time -1: freed pages are never purged */
  (void)je_mallctl("arenas.dirty_decay_ms", NULL, NULL, &never, sizeof never);
  (void)je_mallctl("arenas.muzzy_decay_ms", NULL, NULL, &never, sizeof never);
  batch_hooks();
  unsigned n = 0; /* the arenas made already: one by one */
  size_t sz = sizeof n;
  if (je_mallctl("arenas.narenas", &n, &sz, NULL, 0) != 0)
    return; /* not jemalloc's malloc */
  for (unsigned a = 0; a < n; a++)
    for (int k = 0; k < 2; k++) {
      char key[64];
      snprintf(key, sizeof key, "arena.%u.%s_decay_ms", a,
               k ? "muzzy" : "dirty");
      (void)je_mallctl(key, NULL, NULL, &never, sizeof never); /* unused: -1 */
    }
}

/* bh_sim_opts.verify_index: every worker's residency in the index (its
 * digest: keys and tiers) against its cache's. */
static int verify_index(struct sim *s) {
  pend_flush(s);
  for (uint32_t v = 0; v < s->nw && !s->infinite; v++) {
    const cache *c = &s->w[v].c;
    kvp_key *k = malloc((c->n_nodes + 1) * sizeof *k);
    uint8_t *tr = malloc(c->n_nodes + 1);
    if (k == NULL || tr == NULL) {
      free(k);
      free(tr);
      return KVP_ENOMEM;
    }
    size_t n = 0;
    for (uint32_t x = 0; x < c->n_nodes; x++)
      if (c->nodes[x].tier != BH_TIER_FREE) {
        k[n] = c->nodes[x].key;
        tr[n++] = c->nodes[x].tier;
      }
    uint64_t want = 0, got = 1;
    int rc = kvp_index_digest_of(k, tr, n, &want);
    if (rc == 0)
      rc = kvp_index_digest(s->ix, v, &got);
    free(k);
    free(tr);
    if (rc < 0)
      return rc;
    s->res->index_mismatches += want != got;
  }
  return 0;
}

int bh_sim_run(const bh_trace *t, const bh_sim_opts *o, bh_result *r,
               char *err, size_t cap) {
  struct sim s;
  memset(&s, 0, sizeof s);
  memset(r, 0, sizeof *r);
  r->policy = o->policy;
  snprintf(r->name, sizeof r->name, "%s", bh_policy_name(o->policy));
  if (cap > 0)
    err[0] = '\0';
  if (t->block_size == 0 || t->n_reqs == 0) {
    snprintf(err, cap, "empty trace");
    return KVP_EINVAL;
  }
  if (o->policy < 0 || o->policy >= BH_POLICY_COUNT) {
    snprintf(err, cap, "unknown policy");
    return KVP_EINVAL;
  }
  uint64_t t0 = kvp_now_ns();
  int rc = sim_setup(&s, t, o, r, err, cap);
  if (rc >= 0)
    rc = sim_loop(&s);
  if (rc >= 0 && s.ix != NULL) {
    kvp_index_stats st;
    if (kvp_index_stats_get(s.ix, &st) == 0) {
      r->index_queries = st.queries;
      r->index_query_blocks = st.query_blocks;
      r->index_closure_violations = st.closure_violations;
    }
    if (o->verify_index)
      rc = verify_index(&s);
  }
  if (rc >= 0) {
    summarize(&s);
    r->wall_seconds = (double)(kvp_now_ns() - t0) / 1e9;
  } else if (err[0] == '\0') {
    snprintf(err, cap, "simulation failed: %s", kvp_strerror(rc));
  }
  sim_teardown(&s);
  return rc;
}

void bh_result_free(bh_result *r) {
  if (r == NULL)
    return;
  kvp_hist_destroy(r->ttft_us);
  kvp_hist_destroy(r->tpot_us);
  free(r->series.hit);
  free(r->series.t);
  for (int k = 0; k < 3; k++)
    free(r->series.occ[k]);
  memset(r, 0, sizeof *r);
}
