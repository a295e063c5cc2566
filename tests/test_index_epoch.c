/* SPDX-License-Identifier: Apache-2.0 */
/* router/index epoch-based reclamation (index_epoch.h) on its own: what a
 * pinned reader holds back and in which order retirements are freed, that
 * the retired list stays bounded, that waiting waits for the reader, and
 * (run under ThreadSanitizer by `make test-tsan`) readers dereferencing a
 * pointer that a writer keeps replacing and retiring: freed memory is
 * poisoned first, so a reclamation too early fails the check (and is a race
 * TSan reports). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "index_epoch.h"
#include "test_harness.h"

#define MAGIC 0x5AFEC0DEull
#define POISON 0xDEADBEEFull

/* ---- an allocator that poisons and records what it frees ---------------- */

#define FREED_CAP 4096

static struct {
  atomic_ulong allocs, frees;
  void *freed[FREED_CAP]; /* single-threaded cases only */
  size_t nfreed;
} heap;

static void *t_alloc(void *opaque, size_t size) {
  (void)opaque;
  atomic_fetch_add(&heap.allocs, 1);
  return malloc(size);
}

static void t_free(void *opaque, void *p, size_t size) {
  (void)opaque;
  if (p == NULL)
    return;
  if (size >= sizeof(uint64_t))
    *(uint64_t *)p = POISON;
  if (heap.nfreed < FREED_CAP)
    heap.freed[heap.nfreed++] = p;
  atomic_fetch_add(&heap.frees, 1);
  free(p);
}

static const kvp_allocator talloc = {t_alloc, t_free, NULL};

static void heap_reset(void) {
  atomic_store(&heap.allocs, 0);
  atomic_store(&heap.frees, 0);
  heap.nfreed = 0;
}

static bool was_freed(const void *p) {
  for (size_t i = 0; i < heap.nfreed; i++)
    if (heap.freed[i] == p)
      return true;
  return false;
}

typedef struct obj {
  uint64_t magic;
  uint64_t payload[7];
} obj;

/* An object counted in *bytes, as the index counts what it allocates. */
static obj *obj_new(_Atomic uint64_t *bytes) {
  obj *o = kvp__malloc(&talloc, sizeof *o);
  ASSERT_NOT_NULL(o);
  o->magic = MAGIC;
  atomic_fetch_add(bytes, sizeof *o);
  return o;
}

static uint64_t epoch_of(kvp__ebr *e) { return atomic_load(&e->epoch); }

/* ---- cases --------------------------------------------------------------- */

/* A retired at epoch 1, B at 2 with a reader pinned at 2: A goes once the
 * epoch reaches 3; B waits for the reader, however often reclaim runs. */
TEST(pinned_reader_orders_reclaim) {
  heap_reset();
  _Atomic uint64_t bytes = 0;
  kvp__ebr e;
  ASSERT_OK(kvp__ebr_init(&e, &talloc, &bytes));
  uint64_t base = atomic_load(&bytes);
  obj *a = obj_new(&bytes), *b = obj_new(&bytes);
  ASSERT_EQ(epoch_of(&e), 1u);
  kvp__ebr_retire(&e, a, sizeof *a);
  ASSERT_EQ(kvp__ebr_reclaim(&e), 1u); /* epoch 2: A needs 3 */
  ASSERT_EQ(epoch_of(&e), 2u);
  ASSERT_FALSE(was_freed(a));
  unsigned r = kvp__ebr_pin(&e);
  ASSERT_EQ(atomic_load(&e.slots[r].epoch), 2u);
  kvp__ebr_retire(&e, b, sizeof *b);
  ASSERT_EQ(kvp__ebr_reclaim(&e), 1u); /* epoch 3: A goes, B stays */
  ASSERT_TRUE(was_freed(a));
  ASSERT_FALSE(was_freed(b));
  for (int i = 0; i < 10; i++)
    ASSERT_EQ(kvp__ebr_reclaim(&e), 1u);
  ASSERT_EQ(epoch_of(&e), 3u); /* the reader at 2 holds the epoch */
  ASSERT_FALSE(was_freed(b));
  kvp__ebr_unpin(&e, r);
  ASSERT_EQ(kvp__ebr_reclaim(&e), 0u); /* epoch 4: B goes */
  ASSERT_TRUE(was_freed(b));
  ASSERT_EQ(atomic_load(&bytes), base + e.rl_cap * sizeof *e.rl);
  kvp__ebr_fini(&e);
  ASSERT_EQ(atomic_load(&bytes), 0u);
  ASSERT_EQ(atomic_load(&heap.allocs), atomic_load(&heap.frees));
}

/* A reader pinned before a retirement blocks it even if it pinned at the
 * epoch the retirement is tagged with; one pinned after does not. */
TEST(reader_pinned_later_does_not_block) {
  heap_reset();
  _Atomic uint64_t bytes = 0;
  kvp__ebr e;
  ASSERT_OK(kvp__ebr_init(&e, &talloc, &bytes));
  obj *a = obj_new(&bytes);
  kvp__ebr_retire(&e, a, sizeof *a); /* tag 1 */
  ASSERT_EQ(kvp__ebr_reclaim(&e), 1u);
  ASSERT_EQ(kvp__ebr_reclaim(&e), 0u); /* epoch 3 */
  ASSERT_TRUE(was_freed(a));
  heap.nfreed = 0; /* b may reuse a's address */
  unsigned r = kvp__ebr_pin(&e); /* at 3 */
  obj *b = obj_new(&bytes);
  kvp__ebr_retire(&e, b, sizeof *b);   /* tag 3 */
  ASSERT_EQ(kvp__ebr_reclaim(&e), 1u); /* epoch 4, reader at 3 */
  ASSERT_EQ(kvp__ebr_reclaim(&e), 1u);
  ASSERT_FALSE(was_freed(b));
  kvp__ebr_unpin(&e, r);
  unsigned r2 = kvp__ebr_pin(&e); /* a later reader, at 4 */
  ASSERT_EQ(atomic_load(&e.slots[r2].epoch), 4u);
  ASSERT_EQ(kvp__ebr_reclaim(&e), 0u); /* epoch 5: B goes */
  ASSERT_TRUE(was_freed(b));
  kvp__ebr_unpin(&e, r2);
  kvp__ebr_fini(&e);
  ASSERT_EQ(atomic_load(&bytes), 0u);
}

/* Without readers the list reclaims itself: it never holds much more than
 * two batches, and what is left goes at fini. */
TEST(retired_list_stays_bounded) {
  heap_reset();
  _Atomic uint64_t bytes = 0;
  kvp__ebr e;
  ASSERT_OK(kvp__ebr_init(&e, &talloc, &bytes));
  for (int i = 0; i < 1000; i++) {
    obj *o = obj_new(&bytes);
    kvp__ebr_retire(&e, o, sizeof *o);
    ASSERT_LE(e.rl_n, 2 * KVP__EBR_BATCH);
  }
  ASSERT_GE(atomic_load(&heap.frees), 1000u - 2 * KVP__EBR_BATCH);
  kvp__ebr_fini(&e);
  ASSERT_EQ(atomic_load(&bytes), 0u);
  ASSERT_EQ(atomic_load(&heap.allocs), atomic_load(&heap.frees));
}

/* ---- threads ------------------------------------------------------------- */

typedef struct wctx {
  kvp__ebr *e;
  atomic_int pinned, release, unpinned;
} wctx;

static void *pin_and_hold(void *arg) {
  wctx *w = arg;
  unsigned r = kvp__ebr_pin(w->e);
  atomic_store(&w->pinned, 1);
  while (!atomic_load(&w->release))
    sched_yield();
  atomic_store(&w->unpinned, 1); /* before the unpin: wait must see it */
  kvp__ebr_unpin(w->e, r);
  return NULL;
}

/* kvp__ebr_wait returns only once the reader pinned before the tag left. */
TEST(wait_waits_for_the_reader) {
  _Atomic uint64_t bytes = 0;
  kvp__ebr e;
  ASSERT_OK(kvp__ebr_init(&e, &talloc, &bytes));
  wctx w = {.e = &e};
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, pin_and_hold, &w), 0);
  while (!atomic_load(&w.pinned))
    sched_yield();
  uint64_t tag = kvp__ebr_tag(&e);
  kvp__ebr_advance(&e);
  kvp__ebr_advance(&e);
  ASSERT_FALSE(kvp__ebr_safe(&e, tag));
  atomic_store(&w.release, 1);
  kvp__ebr_wait(&e, tag);
  ASSERT_EQ(atomic_load(&w.unpinned), 1);
  ASSERT_TRUE(kvp__ebr_safe(&e, tag));
  ASSERT_EQ(pthread_join(t, NULL), 0);
  kvp__ebr_fini(&e);
}

#define NREADERS 3
#define SWAPS 20000

typedef struct sctx {
  kvp__ebr e;
  _Atomic uint64_t bytes;
  _Atomic(obj *) cur;
  atomic_int stop;
  atomic_int started; /* readers that have read once */
  atomic_ulong reads;
} sctx;

static void *reader(void *arg) {
  sctx *s = arg;
  unsigned long n = 0;
  while (!atomic_load_explicit(&s->stop, memory_order_relaxed)) {
    unsigned r = kvp__ebr_pin(&s->e);
    /* acquire: pairs with the release exchange in writer */
    obj *o = atomic_load_explicit(&s->cur, memory_order_acquire);
    uint64_t m = o->magic, sum = 0;
    for (unsigned k = 0; k < 7; k++)
      sum += o->payload[k];
    kvp__ebr_unpin(&s->e, r);
    if (m != MAGIC || sum != 7 * m) {
      fprintf(stderr, "FAIL: reader saw %#llx (freed under it)\n",
              (unsigned long long)m);
      exit(1);
    }
    if (n++ == 0)
      atomic_fetch_add(&s->started, 1);
  }
  atomic_fetch_add(&s->reads, n);
  return NULL;
}

static obj *obj_full(sctx *s) {
  obj *o = obj_new(&s->bytes);
  for (unsigned k = 0; k < 7; k++)
    o->payload[k] = MAGIC;
  return o;
}

/* Readers keep dereferencing the current object while a writer replaces
 * it and retires the old one SWAPS times. */
TEST(readers_never_see_freed_memory) {
  heap_reset();
  static sctx s;
  ASSERT_OK(kvp__ebr_init(&s.e, &talloc, &s.bytes));
  atomic_store(&s.cur, obj_full(&s));
  pthread_t t[NREADERS];
  for (int i = 0; i < NREADERS; i++)
    ASSERT_EQ(pthread_create(&t[i], NULL, reader, &s), 0);
  /* every reader in its loop before the swaps (on a loaded machine the
   * writer could otherwise finish before a reader ran) */
  while (atomic_load(&s.started) < NREADERS)
    sched_yield();
  for (int i = 0; i < SWAPS; i++) {
    /* release: pairs with the acquire load in reader */
    obj *old =
        atomic_exchange_explicit(&s.cur, obj_full(&s), memory_order_acq_rel);
    kvp__ebr_retire(&s.e, old, sizeof *old);
  }
  atomic_store(&s.stop, 1);
  for (int i = 0; i < NREADERS; i++)
    ASSERT_EQ(pthread_join(t[i], NULL), 0);
  ASSERT_GT(atomic_load(&s.reads), 0u);
  ASSERT_GE(atomic_load(&heap.frees), SWAPS / 2u); /* reclaimed as it went */
  obj *last = atomic_load(&s.cur);
  kvp__free(&talloc, last, sizeof *last);
  atomic_fetch_sub(&s.bytes, sizeof *last);
  kvp__ebr_fini(&s.e);
  ASSERT_EQ(atomic_load(&s.bytes), 0u); /* everything given back */
  ASSERT_EQ(atomic_load(&heap.allocs), atomic_load(&heap.frees));
}

TEST_MAIN(TEST_ENTRY(pinned_reader_orders_reclaim),
          TEST_ENTRY(reader_pinned_later_does_not_block),
          TEST_ENTRY(retired_list_stays_bounded),
          TEST_ENTRY(wait_waits_for_the_reader),
          TEST_ENTRY(readers_never_see_freed_memory))
