/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier saves straight into DRAM (reserve -> gather -> commit) and in-place
 * loads from pinned slots, on the CPU device backend (KVP_TEST_BACKEND):
 * a reserved slot is invisible until commit and a cancel loses nothing; a
 * save racing evictions of its own keys, and a save racing loads of the
 * same keys, never yield wrong or partial bytes and leak no slot.  The race
 * cases run in the ThreadSanitizer job too. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "device_test_util.h"
#include "kvtier_internal.h"
#include "tier_test_util.h"

#define MB (1024u * 1024u)
#define NBLOCKS 96
#define BS 16
#define HEADS 2
#define HDIM 64
#define NT 2 /* one layer: K and V */

static kvp_device *g_dev;

typedef struct cache {
  void *t[NT];
  uint8_t *img[NT]; /* what the device holds */
  size_t stride, tbytes;
  kvp_kv_layout *lay;
  uint64_t bb;
} cache;

static void cache_init(cache *c) {
  char why[256];
  if (g_dev == NULL) {
    kvp_device_opts o = {.backend = kvt_backend_from_env(why, sizeof why),
                         .flags = KVP_DEVICE_NO_CALIBRATE};
    ASSERT_OK(kvp_device_create(&o, NULL, &g_dev));
  }
  memset(c, 0, sizeof *c);
  c->stride = (size_t)BS * HEADS * HDIM * 2;
  c->tbytes = c->stride * NBLOCKS;
  for (int i = 0; i < NT; i++) {
    ASSERT_OK(kvp_device_alloc(g_dev, c->tbytes, &c->t[i]));
    c->img[i] = malloc(c->tbytes);
    ASSERT_NOT_NULL(c->img[i]);
    for (size_t j = 0; j < c->tbytes; j += 8) {
      uint64_t r = kvt_rand();
      memcpy(c->img[i] + j, &r, 8);
    }
    ASSERT_OK(kvp_device_memcpy(g_dev, c->t[i], c->img[i], c->tbytes));
  }
  kvp_kv_layout_desc d = {.kind = KVP_LAYOUT_VLLM_NHD, .num_layers = 1,
                          .num_blocks = NBLOCKS, .block_size = BS,
                          .num_kv_heads = HEADS, .head_dim = HDIM,
                          .elem_size = 2, .k_layers = &c->t[0],
                          .v_layers = &c->t[1]};
  ASSERT_OK(kvp_kv_layout_create(g_dev, &d, &c->lay));
  kvp_kv_layout_info info;
  ASSERT_OK(kvp_kv_layout_info_get(c->lay, &info));
  c->bb = info.block_bytes;
}

static void cache_free(cache *c) {
  kvp_kv_layout_destroy(c->lay);
  for (int i = 0; i < NT; i++) {
    kvp_device_free(g_dev, c->t[i]);
    free(c->img[i]);
  }
}

/* Block dst of the device equals block src of the image (or, with poison,
 * is still all 0xff). */
static bool block_is(const cache *c, uint32_t dst, uint32_t src, bool poison) {
  uint8_t *p = malloc(c->stride), ff[4096];
  ASSERT_NOT_NULL(p);
  memset(ff, 0xff, sizeof ff);
  bool ok = true;
  for (int i = 0; i < NT && ok; i++) {
    ASSERT_OK(kvp_device_memcpy(g_dev, p, (uint8_t *)c->t[i] + dst * c->stride,
                                c->stride));
    for (size_t o = 0; o < c->stride && ok; o += sizeof ff)
      ok = memcmp(p + o, poison ? ff : c->img[i] + src * c->stride + o,
                  c->stride - o < sizeof ff ? c->stride - o : sizeof ff) == 0;
  }
  free(p);
  return ok;
}

static void poison(const cache *c, uint32_t id) {
  uint8_t *p = malloc(c->stride);
  ASSERT_NOT_NULL(p);
  memset(p, 0xff, c->stride);
  for (int i = 0; i < NT; i++)
    ASSERT_OK(kvp_device_memcpy(g_dev, (uint8_t *)c->t[i] + id * c->stride, p,
                                c->stride));
  free(p);
}

static kvp_namespace g_ns = {.seed = {0x5a5e, 0x1}};

static kvp_tier_store *store_open(const cache *c, uint32_t dram_blocks) {
  kvp_tier_opts o = {.dram_bytes = 8 * MB};
  ASSERT_OK(kvp_tier_opts_set_device(&o, g_dev));
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES,
                         (int64_t)(dram_blocks * c->bb)));
  ASSERT_OK(kvp_tier_ns_add(t, &g_ns,
                            &(kvp_tier_ns_opts){.block_bytes = c->bb}));
  return t;
}

static kvp_key key_of(uint32_t i) { return (kvp_key){0x5a5e, 1000 + i}; }

/* Every DRAM byte charged belongs to a resident block: no reservation or
 * deferred slot was left behind. */
static void check_no_leak(kvp_tier_store *t, uint64_t bb) {
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.dram_used_bytes, st.dram_slot_bytes);
  ASSERT_EQ(st.dram_used_bytes, st.dram_blocks * bb);
  ASSERT_EQ(t->npinned, 0);
  ASSERT_EQ(t->ndfree, 0);
}

static int n_events;
static void on_event(void *opaque, const kvp_tier_event *ev) {
  (void)opaque;
  n_events += ev->stored && ev->tier == KVP_TIER_DRAM;
}

/* ---- reserve / commit / cancel under the store's lock -------------------------- */
TEST(reserve_visibility) {
  kvp_tier_opts o = {.dram_bytes = 8 * MB, .on_event = on_event};
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  ASSERT_OK(kvp_tier_ns_add(t, &g_ns,
                            &(kvp_tier_ns_opts){.block_bytes = 8192}));
  uint8_t a[8192], b[8192], got[8192];
  memset(a, 0xa1, sizeof a);
  memset(b, 0xb2, sizeof b);
  ASSERT_EQ(kvp_tier_put(t, &g_ns, key_of(0), a, sizeof a, NULL), 1);
  kvp_tier_stats s0, s1;
  ASSERT_OK(kvp_tier_stats_get(t, &s0));
  kvp_key keys[2] = {key_of(1), key_of(0)};
  tier_resv r[2];
  int res[2];
  pthread_mutex_lock(&t->mu);
  kvp__tier_reserve(t, g_ns.seed, keys, 2, 8192, NULL, r, res);
  pthread_mutex_unlock(&t->mu);
  ASSERT_EQ(res[0], 0);
  ASSERT_EQ(res[1], 1); /* already stored: no slot */
  ASSERT_NULL(r[1].p);
  memset(r[0].p, 0xcc, 8192);
  /* reserved: charged, but invisible to every reader */
  ASSERT_OK(kvp_tier_stats_get(t, &s1));
  ASSERT_GT(s1.dram_used_bytes, s0.dram_used_bytes);
  ASSERT_EQ(s1.dram_blocks, s0.dram_blocks);
  ASSERT_ERR(kvp_tier_contains(t, &g_ns, keys[0]), KVP_ENOENT);
  ASSERT_ERR(kvp_tier_get(t, &g_ns, keys[0], got, sizeof got, NULL), KVP_ENOENT);
  ASSERT_EQ(n_events, 1);
  /* cancel: the slot goes back, the stored block is untouched */
  pthread_mutex_lock(&t->mu);
  kvp__tier_cancel(t, r, res, 2);
  pthread_mutex_unlock(&t->mu);
  ASSERT_OK(kvp_tier_stats_get(t, &s1));
  ASSERT_EQ(s1.dram_used_bytes, s0.dram_used_bytes);
  ASSERT_ERR(kvp_tier_contains(t, &g_ns, keys[0]), KVP_ENOENT);
  ASSERT_EQ(kvp_tier_get(t, &g_ns, key_of(0), got, sizeof got, NULL),
            KVP_TIER_DRAM);
  ASSERT_MEM_EQ(got, a, sizeof a);
  /* a put of the same key commits first: the commit is its duplicate and
   * returns its slot; the put's bytes stay */
  pthread_mutex_lock(&t->mu);
  kvp__tier_reserve(t, g_ns.seed, keys, 1, 8192, NULL, r, res);
  pthread_mutex_unlock(&t->mu);
  ASSERT_EQ(res[0], 0);
  memset(r[0].p, 0xcc, 8192);
  ASSERT_EQ(kvp_tier_put(t, &g_ns, keys[0], b, sizeof b, NULL), 1);
  pthread_mutex_lock(&t->mu);
  kvp__tier_commit(t, g_ns.seed, keys, 1, 8192, NULL, r, res);
  pthread_mutex_unlock(&t->mu);
  ASSERT_EQ(res[0], 1);
  ASSERT_EQ(kvp_tier_get(t, &g_ns, keys[0], got, sizeof got, NULL),
            KVP_TIER_DRAM);
  ASSERT_MEM_EQ(got, b, sizeof b);
  ASSERT_EQ(n_events, 2);
  /* a commit publishes the gathered bytes, with its event */
  keys[0] = key_of(2);
  pthread_mutex_lock(&t->mu);
  kvp__tier_reserve(t, g_ns.seed, keys, 1, 8192, NULL, r, res);
  memset(r[0].p, 0xdd, 8192);
  kvp__tier_commit(t, g_ns.seed, keys, 1, 8192, NULL, r, res);
  pthread_mutex_unlock(&t->mu);
  ASSERT_EQ(res[0], 1);
  ASSERT_EQ(n_events, 3);
  ASSERT_EQ(kvp_tier_get(t, &g_ns, keys[0], got, sizeof got, NULL),
            KVP_TIER_DRAM);
  memset(b, 0xdd, sizeof b);
  ASSERT_MEM_EQ(got, b, sizeof b);
  check_no_leak(t, 8192);
  kvp_tier_destroy(t);
}

/* ---- the link: saves land in DRAM slots directly; bad ids store nothing ---------- */
TEST(save_direct) {
  cache c;
  cache_init(&c);
  kvp_tier_store *t = store_open(&c, 64);
  kvp_tier_link *l;
  ASSERT_OK(kvp_tier_link_create(t, g_dev, c.lay, &g_ns,
                                 &(kvp_tier_link_opts){.staging_blocks = 8},
                                 NULL, &l));
  enum { N = 20 };
  kvp_key keys[N];
  uint32_t src[N], dst[N];
  int res[N];
  for (uint32_t i = 0; i < N; i++)
    keys[i] = key_of(i), src[i] = i, dst[i] = 50 + i;
  src[13] = NBLOCKS; /* out of range: nothing stored, nothing reserved */
  ASSERT_ERR(kvp_tier_save(l, NULL, keys, src, N, NULL, res), KVP_EINVAL);
  ASSERT_ERR(kvp_tier_contains(t, &g_ns, keys[0]), KVP_ENOENT);
  check_no_leak(t, c.bb);
  src[13] = 13;
  ASSERT_EQ(kvp_tier_save(l, NULL, keys, src, N, NULL, res), N);
  ASSERT_EQ(kvp_tier_save(l, NULL, keys, src, N, NULL, res), N); /* dups */
  for (uint32_t i = 0; i < N; i++)
    poison(&c, dst[i]);
  ASSERT_EQ(kvp_tier_load(l, NULL, keys, dst, N, res), N);
  for (uint32_t i = 0; i < N; i++)
    ASSERT_TRUE(block_is(&c, dst[i], src[i], false));
  kvp_tier_link_stats ls;
  ASSERT_OK(kvp_tier_link_stats_get(l, &ls));
  ASSERT_EQ(ls.blocks_saved_direct, N); /* the dups gathered nothing */
  ASSERT_EQ(ls.blocks_saved, 2 * N);
  ASSERT_EQ(ls.blocks_direct, N);
  ASSERT_EQ(ls.gathers, 3);
  /* the scatter under the store's lock (the way before pins): same bytes */
  ASSERT_ERR(kvp_tier_set(t, KVP_TIER_OPT_LOAD_UNLOCKED, 2), KVP_ERANGE);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_LOAD_UNLOCKED, 0));
  int64_t v;
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_LOAD_UNLOCKED, &v));
  ASSERT_EQ(v, 0);
  for (uint32_t i = 0; i < N; i++)
    poison(&c, dst[i]);
  ASSERT_EQ(kvp_tier_load(l, NULL, keys, dst, N, res), N);
  for (uint32_t i = 0; i < N; i++)
    ASSERT_TRUE(block_is(&c, dst[i], src[i], false));
  check_no_leak(t, c.bb);
  kvp_tier_link_destroy(l);
  kvp_tier_destroy(t);
  cache_free(&c);
}

/* Two rounds in flight (a DRAM budget of >= 4 rounds): every round after
 * the first is reserved and submitted while the one before gathers; a key
 * given twice in one call, in two rounds, keeps the first round's bytes (the
 * later commit is its duplicate and returns its slot).  With a budget under
 * four rounds the rounds run one after the other, same results. */
static void save_rounds(uint32_t dram_blocks, bool overlap) {
  cache c;
  cache_init(&c);
  kvp_tier_store *t = store_open(&c, dram_blocks);
  kvp_tier_link *l;
  ASSERT_OK(kvp_tier_link_create(t, g_dev, c.lay, &g_ns,
                                 &(kvp_tier_link_opts){.staging_blocks = 4},
                                 NULL, &l));
  enum { N = 14 }; /* rounds of 4, 4, 4, 2 */
  kvp_key keys[N];
  uint32_t src[N], dst[N];
  int res[N];
  for (uint32_t i = 0; i < N; i++)
    keys[i] = key_of(100 + i), src[i] = i, dst[i] = 60 + i;
  keys[5] = keys[1]; /* round 1 repeats a key of round 0 */
  ASSERT_EQ(kvp_tier_save(l, NULL, keys, src, N, NULL, res), N);
  for (uint32_t i = 0; i < N; i++)
    ASSERT_EQ(res[i], 1);
  kvp_tier_link_stats ls;
  ASSERT_OK(kvp_tier_link_stats_get(l, &ls));
  ASSERT_EQ(ls.gathers, 4);
  ASSERT_EQ(ls.rounds_overlapped, overlap ? 3 : 0);
  ASSERT_EQ(ls.blocks_saved, N);
  /* the repeat was gathered only when its round ran beside the first */
  ASSERT_EQ(ls.blocks_saved_direct, overlap ? N : N - 1);
  uint32_t uk[N - 1], ud[N - 1];
  for (uint32_t i = 0, j = 0; i < N; i++)
    if (i != 5) {
      uk[j] = i, ud[j] = dst[i];
      poison(&c, dst[i]);
      j++;
    }
  kvp_key lk[N - 1];
  for (uint32_t j = 0; j < N - 1; j++)
    lk[j] = keys[uk[j]];
  ASSERT_EQ(kvp_tier_load(l, NULL, lk, ud, N - 1, res), N - 1);
  for (uint32_t j = 0; j < N - 1; j++)
    ASSERT_TRUE(block_is(&c, ud[j], src[uk[j]], false));
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.dram_blocks, N - 1);
  check_no_leak(t, c.bb);
  kvp_tier_link_destroy(l);
  kvp_tier_destroy(t);
  cache_free(&c);
}

TEST(save_rounds_overlap) { save_rounds(64, true); }
TEST(save_rounds_serial) { save_rounds(15, false); }

/* ---- races -------------------------------------------------------------------- */
#define RKEYS 16
#define ROUNDS 150

typedef struct racer {
  kvp_tier_store *t;
  cache *c;
  uint32_t base; /* the thread's block ids: [base, base + RKEYS) */
  _Atomic int *stop;
  _Atomic uint64_t *hit_all; /* all loaders' hits */
  _Atomic uint32_t *loaders_ran; /* loaders that finished a round */
  uint32_t loaders;              /* how many loaders race */
  uint64_t hits, misses;
} racer;

static void *saver(void *arg) {
  racer *r = arg;
  kvp_tier_link *l;
  ASSERT_OK(kvp_tier_link_create(r->t, g_dev, r->c->lay, &g_ns,
                                 &(kvp_tier_link_opts){.staging_blocks = 5},
                                 NULL, &l));
  kvp_key keys[RKEYS];
  uint32_t src[RKEYS];
  int res[RKEYS];
  for (uint32_t i = 0; i < RKEYS; i++)
    keys[i] = key_of(i), src[i] = i; /* key i is always block i's bytes */
  /* at least ROUNDS, until every loader ran a round beside the saves (on a
   * loaded machine a loader thread may not have been scheduled yet), and
   * until the loaders saw hits (bounded) */
  for (int round = 0;
       round < ROUNDS || ((*r->hit_all < 64 || *r->loaders_ran < r->loaders) &&
                          round < 50000);
       round++) {
    for (uint32_t i = round % 2 ? 0 : RKEYS; i < RKEYS; i++)
      ASSERT_GE(kvp_tier_evict(r->t, &g_ns, keys[i]), 0); /* save again */
    int n = kvp_tier_save(l, NULL, keys, src, RKEYS, NULL, res);
    ASSERT_GE(n, 0);
    for (uint32_t i = 0; i < RKEYS; i++) /* stored, or no room left */
      ASSERT_TRUE(res[i] == 1 || res[i] == KVP_ENOSPC);
  }
  *r->stop = 1;
  kvp_tier_link_destroy(l);
  return NULL;
}

/* Evicts the saver's keys and pushes other blocks through DRAM. */
static void *evicter(void *arg) {
  racer *r = arg;
  uint8_t *junk = calloc(1, r->c->bb);
  ASSERT_NOT_NULL(junk);
  for (uint32_t k = 0; !*r->stop; k++) {
    ASSERT_GE(kvp_tier_evict(r->t, &g_ns, key_of(k % RKEYS)), 0);
    ASSERT_EQ(kvp_tier_put(r->t, &g_ns, key_of(5000 + k % 64), junk, r->c->bb,
                           NULL), 1);
  }
  free(junk);
  return NULL;
}

/* Loads the saver's keys into its own blocks: a hit is exactly the saved
 * block, a miss leaves the poison. */
static void *loader(void *arg) {
  racer *r = arg;
  kvp_tier_link *l;
  ASSERT_OK(kvp_tier_link_create(r->t, g_dev, r->c->lay, &g_ns,
                                 &(kvp_tier_link_opts){.staging_blocks = 7},
                                 NULL, &l));
  kvp_key keys[RKEYS];
  uint32_t dst[RKEYS];
  int res[RKEYS];
  for (uint32_t i = 0; i < RKEYS; i++)
    keys[i] = key_of(i), dst[i] = r->base + i;
  for (bool first = true; !*r->stop; first = false) {
    for (uint32_t i = 0; i < RKEYS; i++)
      poison(r->c, dst[i]);
    ASSERT_GE(kvp_tier_load(l, NULL, keys, dst, RKEYS, res), 0);
    for (uint32_t i = 0; i < RKEYS; i++) {
      ASSERT_TRUE(block_is(r->c, dst[i], i, res[i] < 0));
      r->hits += res[i] >= 0;
      *r->hit_all += res[i] >= 0;
      r->misses += res[i] < 0;
    }
    if (first)
      ++*r->loaders_ran;
  }
  kvp_tier_link_destroy(l);
  return NULL;
}

static void race(void *(*other)(void *), uint32_t dram_blocks, bool hits) {
  cache c;
  cache_init(&c);
  kvp_tier_store *t = store_open(&c, dram_blocks);
  _Atomic int stop = 0;
  _Atomic uint64_t hit_all = 0;
  _Atomic uint32_t loaders_ran = 0;
  racer rs = {.t = t, .c = &c, .stop = &stop, .hit_all = &hit_all,
              .loaders_ran = &loaders_ran, .loaders = other == loader ? 2 : 1};
  racer ro = rs, rl = rs;
  ro.base = 40, rl.base = 70;
  pthread_t ts, to, tl;
  ASSERT_EQ(pthread_create(&ts, NULL, saver, &rs), 0);
  ASSERT_EQ(pthread_create(&to, NULL, other, &ro), 0);
  ASSERT_EQ(pthread_create(&tl, NULL, loader, &rl), 0);
  ASSERT_EQ(pthread_join(ts, NULL), 0);
  ASSERT_EQ(pthread_join(to, NULL), 0);
  ASSERT_EQ(pthread_join(tl, NULL), 0);
  printf("# loads: %" PRIu64 " hits, %" PRIu64 " misses\n", rl.hits, rl.misses);
  ASSERT_GT(rl.hits + rl.misses, 0);
  if (hits) /* the loads raced saves of blocks they then found */
    ASSERT_GE(hit_all, 64);
  check_no_leak(t, c.bb);
  kvp_tier_destroy(t);
  cache_free(&c);
}

/* A save racing evictions (explicit, and by pressure) of its own keys, and
 * loads of them into another thread's blocks. */
TEST(save_race_evict) { race(evicter, RKEYS + 8, false); }

/* A save racing loads of the same keys (two loaders; DRAM holds them all;
 * every other round the saver evicts its keys first, so the loads race
 * fresh gathers into fresh slots and evictions of pinned slots). */
TEST(save_race_load) { race(loader, 64, true); }

TEST_MAIN(TEST_ENTRY(reserve_visibility), TEST_ENTRY(save_direct),
          TEST_ENTRY(save_rounds_overlap), TEST_ENTRY(save_rounds_serial),
          TEST_ENTRY(save_race_evict), TEST_ENTRY(save_race_load))
