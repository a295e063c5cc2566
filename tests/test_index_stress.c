/* SPDX-License-Identifier: Apache-2.0 */
/* router/index under concurrency (run under ThreadSanitizer by `make
 * test-tsan`): event writers store, remove, clear, resync, remove and re-add
 * workers and record routes; stream writers feed streams 1..3 of one worker
 * with restarts (epoch bumps), clears, snapshots and late events of old
 * epochs; meanwhile readers query, and an observer walks that worker's keys,
 * each checking what must hold.  A few seconds; KVP_STRESS_MS sets the time
 * per configuration. */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "index_internal.h"
#include "test_harness.h"

#define PIN 48  /* the pinned chain: stored before readers start */
#define POOL 256 /* churn chains: keys enough to grow and shrink tables */
#define PLEN 32
#define NWRITERS 2
#define NREADERS 2
#define NSTREAMW 3 /* stream writers: streams 1..3 of workers[1] */

typedef struct ctx {
  kvp_index *ix;
  uint32_t workers[8]; /* ids in the index; [0] and [1] hold the pinned chain */
  kvp_key pin[PIN];
  kvp_key pool[POOL][PLEN];
  atomic_int stop;
  atomic_ulong queries, events, restarts, late, walks;
  atomic_ullong clock; /* the router's time, for queries */
} ctx;

static uint64_t ms_budget(void) {
  const char *e = getenv("KVP_STRESS_MS");
  return e ? strtoull(e, NULL, 10) : 1200;
}

/* Thread-local splitmix64 (the harness's generator is not thread-safe). */
static uint64_t next(uint64_t *s) {
  uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

typedef struct wstate {
  ctx *c;
  int id;
  uint64_t rng;
  uint64_t seq[8];
} wstate;

/* Worker slot i's events: seq numbers from this thread only. */
static void churn(wstate *s, int i) {
  ctx *c = s->c;
  uint32_t w = c->workers[i];
  /* a quarter of the events on one hot chain: its keys gather > 4 holders,
   * so holder sets spill, grow and shrink under the readers */
  const kvp_key *ch = c->pool[next(&s->rng) % 4 ? next(&s->rng) % POOL : 0];
  size_t a = next(&s->rng) % PLEN, n = 1 + next(&s->rng) % (PLEN - a);
  kvp_tier t = (kvp_tier)(next(&s->rng) % 4);
  uint64_t r = next(&s->rng) % 1000;
  int rc;
  if (r < 550) {
    rc = kvp_index_stored(c->ix, w, ++s->seq[i], t, NULL, ch + a, n);
  } else if (r < 900) {
    rc = kvp_index_removed(c->ix, w, ++s->seq[i], t, ch + a, n);
  } else if (r < 960 && i >= 2) {
    rc = kvp_index_cleared(c->ix, w, ++s->seq[i]);
  } else if (r < 985) {
    /* slots 0 and 1 keep their pinned chain through resyncs */
    kvp_key keys[PIN + PLEN];
    size_t m = 0;
    if (i < 2)
      for (; m < PIN; m++)
        keys[m] = c->pin[m];
    for (size_t k = 0; k < n; k++)
      keys[m++] = ch[a + k];
    s->seq[i] += 5; /* a resync may jump */
    rc = kvp_index_resync(c->ix, w, s->seq[i], keys, NULL, m);
  } else if (i >= 2) {
    ASSERT_OK(kvp_index_worker_remove(c->ix, w));
    ASSERT_OK(kvp_index_worker_add(c->ix, w));
    s->seq[i] = 0;
    rc = 0;
  } else {
    rc = kvp_index_stored(c->ix, w, s->seq[i] += 2, t, NULL, ch + a,
                          n); /* gap */
  }
  ASSERT_TRUE(rc >= 0);
  atomic_fetch_add_explicit(&c->events, 1, memory_order_relaxed);
}

static void *writer(void *arg) {
  wstate *s = arg;
  /* one sure gap per writer (the random ones may not come in a short run) */
  ASSERT_TRUE(kvp_index_stored(s->c->ix, s->c->workers[s->id],
                               s->seq[s->id] += 2, KVP_TIER_HBM, NULL,
                               s->c->pool[0], 1) >= 0);
  while (!atomic_load_explicit(&s->c->stop, memory_order_relaxed))
    for (int i = s->id; i < 8; i += NWRITERS) /* slots owned by this writer */
      churn(s, i);
  return NULL;
}

/* Stream s of workers[1] feeds tier s (DRAM, NVMe, remote): never HBM,
 * where the worker keeps the pinned chain. */
typedef struct swriter {
  ctx *c;
  uint32_t stream;
  uint64_t rng, epoch, seq;
} swriter;

static kvp_index_src src_of(const swriter *s, uint64_t epoch, uint64_t seq) {
  return (kvp_index_src){.worker = s->c->workers[1], .stream = s->stream,
                         .epoch = epoch, .seq = seq};
}

/* The publisher restarts: a larger epoch, numbered from 1, its first event
 * a snapshot half the time (as a connector rebuilding a kvtier store). */
static int restart(swriter *s, const kvp_key *k, size_t n) {
  ctx *c = s->c;
  s->epoch += 1 + next(&s->rng) % 3;
  s->seq = 1;
  atomic_fetch_add_explicit(&c->restarts, 1, memory_order_relaxed);
  kvp_index_src src = src_of(s, s->epoch, 1);
  if (next(&s->rng) % 2)
    return kvp_index_src_resync(c->ix, &src, 1u << s->stream, k, NULL, n);
  return kvp_index_src_stored(c->ix, &src, (kvp_tier)s->stream, NULL, k, n);
}

static void stream_event(swriter *s) {
  ctx *c = s->c;
  const kvp_key *ch = c->pool[next(&s->rng) % POOL];
  size_t a = next(&s->rng) % PLEN, n = 1 + next(&s->rng) % (PLEN - a);
  uint64_t r = next(&s->rng) % 1000;
  kvp_index_src src = src_of(s, s->epoch, s->seq + 1);
  int rc;
  if (r < 30) {
    rc = restart(s, ch + a, n);
  } else if (r < 45) { /* a late event of the previous life: stale */
    src.epoch--;
    rc = kvp_index_src_stored(c->ix, &src, (kvp_tier)s->stream, NULL, ch + a,
                              n);
    ASSERT_ERR(rc, KVP_EEXIST);
    atomic_fetch_add_explicit(&c->late, 1, memory_order_relaxed);
    rc = 0;
  } else if (r < 60) {
    s->seq++;
    rc = kvp_index_src_cleared(c->ix, &src);
  } else if (r < 650) {
    s->seq++;
    rc = kvp_index_src_stored(c->ix, &src, (kvp_tier)s->stream, NULL, ch + a,
                              n);
  } else {
    s->seq++;
    rc = kvp_index_src_removed(c->ix, &src, (kvp_tier)s->stream, ch + a, n);
  }
  ASSERT_TRUE(rc >= 0);
}

static void *stream_writer(void *arg) {
  swriter *s = arg;
  ctx *c = s->c;
  while (!atomic_load_explicit(&c->stop, memory_order_relaxed)) {
    stream_event(s);
    /* this thread is the stream's only writer, and workers[1] is never
     * removed: the index's position is exactly ours */
    kvp_index_stream_info si;
    ASSERT_OK(kvp_index_stream_get(c->ix, c->workers[1], s->stream, &si));
    ASSERT_EQ(si.epoch, s->epoch);
    ASSERT_EQ(si.last_seq, s->seq);
    ASSERT_EQ(si.tier_mask & ~(1u << s->stream), 0u);
    atomic_fetch_add_explicit(&c->events, 1, memory_order_relaxed);
  }
  return NULL;
}

static void *router(void *arg) { /* approximate mode, its own clock */
  ctx *c = arg;
  uint64_t rng = 99, now = 1;
  while (!atomic_load_explicit(&c->stop, memory_order_relaxed)) {
    uint32_t w = c->workers[2 + next(&rng) % 6];
    int rc = kvp_index_record_routed(c->ix, w, c->pool[next(&rng) % POOL],
                                     1 + next(&rng) % PLEN, now += 1000);
    atomic_store_explicit(&c->clock, now, memory_order_relaxed);
    ASSERT_TRUE(rc >= 0 || rc == KVP_ENOENT); /* removed for a moment */
    if (next(&rng) % 16 == 0)
      ASSERT_TRUE(kvp_index_expire(c->ix, now) >= 0);
  }
  return NULL;
}

/* What every answer satisfies, whatever the writers do. */
static void check_shape(ctx *c, const kvp_index_match *m, int n, size_t len) {
  ASSERT_TRUE(n >= 0 && n <= 8);
  for (int i = 0; i < n; i++) {
    uint32_t sum = m[i].routed_blocks;
    for (int t = 0; t < 4; t++)
      sum += m[i].tier_blocks[t];
    ASSERT_EQ(sum, m[i].prefix_blocks);
    ASSERT_GE(m[i].prefix_blocks, 1u);
    ASSERT_LE(m[i].prefix_blocks, len);
    if (i > 0)
      ASSERT_LT(m[i - 1].worker, m[i].worker);
    int known = 0;
    for (int k = 0; k < 8; k++)
      known |= c->workers[k] == m[i].worker;
    ASSERT_TRUE(known);
  }
}

static void *reader(void *arg) {
  ctx *c = arg;
  uint64_t rng = (uint64_t)(uintptr_t)&rng;
  kvp_index_match m[8];
  while (!atomic_load_explicit(&c->stop, memory_order_relaxed)) {
    /* the pinned chain: never removed; slots 0 and 1 keep it through
     * resyncs (keys in the old and the new set never disappear) */
    uint64_t now = atomic_load_explicit(&c->clock, memory_order_relaxed);
    int n = kvp_index_query(c->ix, c->pin, PIN, now, m, 8);
    check_shape(c, m, n, PIN);
    int seen = 0;
    for (int i = 0; i < n; i++)
      if (m[i].worker == c->workers[0] || m[i].worker == c->workers[1]) {
        ASSERT_EQ(m[i].prefix_blocks, (uint32_t)PIN);
        ASSERT_EQ(m[i].tier_blocks[KVP_TIER_HBM], (uint32_t)PIN);
        seen++;
      }
    ASSERT_EQ(seen, 2);
    const kvp_key *ch = c->pool[next(&rng) % POOL];
    n = kvp_index_query(c->ix, ch, PLEN, now, m, 8);
    check_shape(c, m, n, PLEN);
    atomic_fetch_add_explicit(&c->queries, 2, memory_order_relaxed);
  }
  return NULL;
}

typedef struct pinwalk {
  const ctx *c;
  int hbm; /* pinned keys listed in HBM */
} pinwalk;

static int pin_seen(void *opaque, uint64_t fp, uint32_t mask) {
  pinwalk *p = opaque;
  ASSERT_TRUE(mask != 0 && mask <= 0xFu);
  for (int i = 0; i < PIN; i++)
    if (p->c->pin[i].lo == fp)
      p->hbm += (mask & (1u << KVP_TIER_HBM)) != 0;
  return 0;
}

/* workers[1] never loses its pinned chain from HBM, whatever its streams
 * do: a walk racing the writers lists each of those keys once, in HBM. */
static void walk_pinned(ctx *c) {
  pinwalk p = {c, 0};
  ASSERT_OK(kvp_index_worker_keys(c->ix, c->workers[1], pin_seen, &p));
  ASSERT_EQ(p.hbm, PIN);
  atomic_fetch_add_explicit(&c->walks, 1, memory_order_relaxed);
}

static void *observer(void *arg) { /* stats and digests, lock-free or not */
  ctx *c = arg;
  while (!atomic_load_explicit(&c->stop, memory_order_relaxed)) {
    walk_pinned(c);
    kvp_index_stats s;
    ASSERT_OK(kvp_index_stats_get(c->ix, &s));
    ASSERT_GE(s.keys, (uint64_t)PIN);
    uint64_t d;
    ASSERT_OK(kvp_index_digest(c->ix, c->workers[1], &d));
    ASSERT_NE(d, 0u);
    nanosleep(&(struct timespec){0, 100000}, NULL); /* leave writers CPU */
  }
  return NULL;
}

static void stress(uint32_t max_workers, const uint32_t *ids, bool closed) {
  ctx *c = calloc(1, sizeof *c);
  ASSERT_NOT_NULL(c);
  kvp_index_opts o = {.max_workers = max_workers,
                      .approx_capacity = 500,
                      .prefix_closed = closed};
  ASSERT_OK(kvp_index_create(&o, NULL, &c->ix));
  for (int i = 0; i < 8; i++) {
    c->workers[i] = ids[i];
    ASSERT_OK(kvp_index_worker_add(c->ix, ids[i]));
  }
  for (int i = 0; i < PIN; i++)
    c->pin[i] = (kvp_key){0, kvt_rand() | 4};
  for (int p = 0; p < POOL; p++) /* chains share prefixes with pool[0..7] */
    for (int i = 0; i < PLEN; i++)
      c->pool[p][i] = p >= 8 && i < 2 * (p % 8) ? c->pool[p % 8][i]
                                                : (kvp_key){0, kvt_rand() | 4};
  wstate ws[NWRITERS];
  memset(ws, 0, sizeof ws);
  for (int i = 0; i < 2; i++) {
    ASSERT_EQ(
        kvp_index_stored(c->ix, ids[i], 1, KVP_TIER_HBM, NULL, c->pin, PIN),
        PIN);
    ws[i % NWRITERS].seq[i] = 1;
  }
  swriter sw[NSTREAMW];
  for (int i = 0; i < NSTREAMW; i++) { /* epoch 1 begun: later ones restart */
    sw[i] = (swriter){.c = c, .stream = 1u + (uint32_t)i, .rng = kvt_rand(),
                      .epoch = 1, .seq = 1};
    kvp_index_src src = src_of(&sw[i], 1, 1);
    ASSERT_GE(kvp_index_src_stored(c->ix, &src, (kvp_tier)sw[i].stream, NULL,
                                   c->pool[i], PLEN),
              0);
  }
  pthread_t th[NWRITERS + NSTREAMW + NREADERS + 2];
  int nt = 0;
  for (int i = 0; i < NWRITERS; i++) {
    ws[i].c = c, ws[i].id = i, ws[i].rng = kvt_rand();
    ASSERT_EQ(pthread_create(&th[nt++], NULL, writer, &ws[i]), 0);
  }
  for (int i = 0; i < NSTREAMW; i++)
    ASSERT_EQ(pthread_create(&th[nt++], NULL, stream_writer, &sw[i]), 0);
  for (int i = 0; i < NREADERS; i++)
    ASSERT_EQ(pthread_create(&th[nt++], NULL, reader, c), 0);
  ASSERT_EQ(pthread_create(&th[nt++], NULL, router, c), 0);
  ASSERT_EQ(pthread_create(&th[nt++], NULL, observer, c), 0);
  uint64_t end = kvp_now_ns() + ms_budget() * 1000000ull;
  while (kvp_now_ns() < end)
    nanosleep(&(struct timespec){0, 20000000}, NULL);
  atomic_store(&c->stop, 1);
  for (int i = 0; i < nt; i++)
    ASSERT_EQ(pthread_join(th[i], NULL), 0);
  ASSERT_GT(atomic_load(&c->queries), 0u);
  ASSERT_GT(atomic_load(&c->events), 0u);
  ASSERT_OK(kvp__index_verify(c->ix)); /* digests, counts, encodings */
  walk_pinned(c);
  kvp_index_stats s;
  ASSERT_OK(kvp_index_stats_get(c->ix, &s));
  ASSERT_GE(s.seq_gaps, (uint64_t)NWRITERS);
  ASSERT_EQ(s.epochs, (uint64_t)atomic_load(&c->restarts));
  ASSERT_GE(s.events_stale, (uint64_t)atomic_load(&c->late));
  ASSERT_GT(atomic_load(&c->walks), 0u);
  printf("  %u workers max: %lu events (%lu restarts), %lu queries, %lu "
         "walks, %llu keys\n",
         max_workers, (unsigned long)atomic_load(&c->events),
         (unsigned long)atomic_load(&c->restarts),
         (unsigned long)atomic_load(&c->queries),
         (unsigned long)atomic_load(&c->walks), (unsigned long long)s.keys);
  kvp_index_destroy(c->ix);
  free(c);
}

TEST(stress_fast_path) {
  const uint32_t ids[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  stress(8, ids, false);
}

/* Bisecting readers: the churn breaks the contract on the pool chains (the
 * violations seen make those queries walk), the pinned chain keeps it. */
TEST(stress_fast_path_bisect) {
  const uint32_t ids[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  stress(8, ids, true);
}

TEST(stress_wide_path) {
  const uint32_t ids[8] = {5, 4000, 64, 700, 1300, 2047, 2048, 3333};
  stress(0, ids, false);
}

/* The same over 8 worker groups: the pinned chain's two holders (two groups)
 * bisect, pool chains held in more than 4 groups walk. */
TEST(stress_wide_path_bisect) {
  const uint32_t ids[8] = {5, 4000, 64, 700, 1300, 2047, 2048, 3333};
  stress(0, ids, true);
}

TEST_MAIN(TEST_ENTRY(stress_fast_path), TEST_ENTRY(stress_fast_path_bisect),
          TEST_ENTRY(stress_wide_path), TEST_ENTRY(stress_wide_path_bisect))
