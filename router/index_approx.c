/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: approximate mode.  Without KV events the router records
 * where it sent each block (kvp_index_record_routed): fp -> list of routing
 * records in a table of its own, an LRU over the records bounded by
 * opts.approx_capacity, and a TTL.  Records live in chunks of APPROX_CHUNK
 * that are never freed while the index lives; an evicted record is retired
 * and reused once no reader can still walk it.  Writers hold the approx lock
 * (lock order: worker -> approx -> retire); queries read the lists lock-free
 * (routed_next in index_query.c). */
#include <limits.h>

#include "index_impl.h"

#define APPROX_SPARE (1u << 16)

static void lru_unlink(kvp_index *ix, arec *r) {
  if (r->lru_prev)
    arec_at(ix, r->lru_prev)->lru_next = r->lru_next;
  else
    ix->lru_head = r->lru_next;
  if (r->lru_next)
    arec_at(ix, r->lru_next)->lru_prev = r->lru_prev;
  else
    ix->lru_tail = r->lru_prev;
}

static void lru_push(kvp_index *ix, uint32_t idx, arec *r) {
  r->lru_prev = 0;
  r->lru_next = ix->lru_head;
  if (ix->lru_head)
    arec_at(ix, ix->lru_head)->lru_prev = idx;
  else
    ix->lru_tail = idx;
  ix->lru_head = idx;
}

/* Retired records whose readers are gone go back to the free list. */
static void arec_reclaim(kvp_index *ix) {
  kvp__ebr_advance(&ix->ebr);
  size_t k = 0;
  for (size_t i = 0; i < ix->aret_n; i++) {
    if (kvp__ebr_safe(&ix->ebr, ix->aret[i].epoch)) {
      arec_at(ix, ix->aret[i].idx)->lru_next = ix->afree;
      ix->afree = ix->aret[i].idx;
    } else {
      ix->aret[k++] = ix->aret[i];
    }
  }
  ix->aret_n = k;
}

static uint32_t arec_pop_free(kvp_index *ix) {
  uint32_t idx = ix->afree;
  if (idx)
    ix->afree = arec_at(ix, idx)->lru_next;
  return idx;
}

/* A record index, 0 when out of memory. */
static uint32_t arec_alloc(kvp_index *ix) {
  uint32_t idx = arec_pop_free(ix);
  if (idx == 0 && ix->aret_n >= KVP__EBR_BATCH)
    arec_reclaim(ix), idx = arec_pop_free(ix);
  if (idx != 0)
    return idx;
  if (ix->aused < ix->adir_n * APPROX_CHUNK) {
    uint32_t c = ix->aused / APPROX_CHUNK;
    if (ix->aused % APPROX_CHUNK == 0) {
      arec *chunk = ix_alloc(ix, APPROX_CHUNK * sizeof(arec));
      if (chunk == NULL)
        return 0;
      memset(chunk, 0, APPROX_CHUNK * sizeof(arec));
      /* release: pairs with the acquire in arec_at */
      atomic_store_explicit(&ix->adir[c], chunk, memory_order_release);
    }
    return ++ix->aused;
  }
  while (ix->aret_n > 0 && ix->afree == 0) { /* all slots wait for readers */
    kvp__ebr_wait(&ix->ebr, ix->aret[0].epoch);
    arec_reclaim(ix);
  }
  return arec_pop_free(ix);
}

/* Unlinks record idx from its key's list and retires it. */
static int arec_evict(kvp_index *ix, uint32_t idx) {
  arec *r = arec_at(ix, idx);
  ktab *t = atomic_load_explicit(&ix->atab, memory_order_relaxed);
  kslot *s = kvp__tab_find(t, r->fp, mix64(r->fp), NULL);
  uint32_t next = atomic_load_explicit(&r->next, memory_order_relaxed);
  uint32_t head =
      s ? (uint32_t)atomic_load_explicit(&s->val, memory_order_relaxed) : 0;
  if (s == NULL) { /* not linked (cannot happen): only the LRU holds it */
  } else if (head == idx && next == 0) {
    kvp__slot_kill(t, s);
  } else if (head == idx) {
    slot_set(s, next);
  } else {
    arec *q = arec_at(ix, head);
    uint32_t qn;
    while ((qn = atomic_load_explicit(&q->next, memory_order_relaxed)) != idx &&
           qn != 0)
      q = arec_at(ix, qn);
    /* release: pairs with the acquire of next in routed_walk */
    atomic_store_explicit(&q->next, next, memory_order_release);
  }
  lru_unlink(ix, r);
  atomic_store_explicit(
      &ix->acount, atomic_load_explicit(&ix->acount, memory_order_relaxed) - 1,
      memory_order_relaxed);
  uint64_t tag = kvp__ebr_tag(&ix->ebr);
  if (ix->aret_n == ix->aret_cap) {
    size_t cap = ix->aret_cap ? 2 * ix->aret_cap : 64;
    aretired *a = kvp__realloc(&ix->alloc, ix->aret, ix->aret_cap * sizeof *a,
                               cap * sizeof *a);
    if (a == NULL) { /* wait out the readers and free it now */
      kvp__ebr_wait(&ix->ebr, tag);
      r->lru_next = ix->afree;
      ix->afree = idx;
      return 0;
    }
    atomic_fetch_add_explicit(&ix->bytes, (cap - ix->aret_cap) * sizeof *a,
                              memory_order_relaxed);
    ix->aret = a;
    ix->aret_cap = cap;
  }
  ix->aret[ix->aret_n++] = (aretired){idx, tag};
  return 0;
}

static size_t approx_expire_locked(kvp_index *ix, uint64_t now) {
  size_t n = 0;
  uint64_t ttl = atomic_load_explicit(&ix->attl, memory_order_relaxed);
  while (ix->lru_tail != 0) {
    arec *r = arec_at(ix, ix->lru_tail);
    if (routed_live(atomic_load_explicit(&r->touch, memory_order_relaxed),
                    atomic_load_explicit(&r->life_us, memory_order_relaxed),
                    now, ttl))
      break;
    (void)arec_evict(ix, ix->lru_tail);
    n++;
  }
  atomic_fetch_add_explicit(&ix->c.expired, n, memory_order_relaxed);
  return n;
}

/* Drops every record of worker w (approx lock held). */
static void approx_purge_locked(kvp_index *ix, uint32_t w) {
  for (uint32_t idx = ix->lru_head; idx != 0;) {
    arec *r = arec_at(ix, idx);
    uint32_t next = r->lru_next;
    if (r->worker == w)
      (void)arec_evict(ix, idx);
    idx = next;
  }
}

/* Records (fp -> w at now) for life_us (0: a routed record, the index
 * TTL); 1 when a record was created.  A routed record still live stays
 * routed when a pending one refreshes it. */
static int approx_record(kvp_index *ix, uint64_t fp, uint32_t w, uint64_t now,
                         uint32_t life_us) {
  uint64_t h = mix64(fp);
  ktab *t = atomic_load_explicit(&ix->atab, memory_order_relaxed);
  kslot *ins = NULL, *s = kvp__tab_find(t, fp, h, &ins);
  uint32_t head =
      s ? (uint32_t)atomic_load_explicit(&s->val, memory_order_relaxed) : 0;
  for (uint32_t idx = head; idx != 0;) {
    arec *r = arec_at(ix, idx);
    if (r->worker == w) {
      uint32_t was = atomic_load_explicit(&r->life_us, memory_order_relaxed);
      if (life_us != 0 && was == 0 &&
          routed_live(atomic_load_explicit(&r->touch, memory_order_relaxed),
                      0, now,
                      atomic_load_explicit(&ix->attl, memory_order_relaxed)))
        life_us = 0;
      atomic_store_explicit(&r->touch, now, memory_order_relaxed);
      atomic_store_explicit(&r->life_us, life_us, memory_order_relaxed);
      lru_unlink(ix, r);
      lru_push(ix, idx, r);
      return 0;
    }
    idx = atomic_load_explicit(&r->next, memory_order_relaxed);
  }
  if (s == NULL) {
    int rc = kvp__tab_reserve(ix, &ix->atab, NULL, &t);
    if (rc < 0)
      return rc;
  }
  uint32_t idx = arec_alloc(ix);
  if (idx == 0)
    return KVP_ENOMEM;
  arec *r = arec_at(ix, idx);
  r->worker = w;
  r->fp = fp;
  atomic_store_explicit(&r->touch, now, memory_order_relaxed);
  atomic_store_explicit(&r->life_us, life_us, memory_order_relaxed);
  atomic_store_explicit(&r->next, head, memory_order_relaxed);
  if (s != NULL) {
    slot_set(s, idx); /* release: the record is complete before it is seen */
  } else {
    (void)kvp__tab_find(t, fp, h, &ins);
    slot_claim(t, ins, fp, idx);
  }
  lru_push(ix, idx, r);
  atomic_store_explicit(
      &ix->acount, atomic_load_explicit(&ix->acount, memory_order_relaxed) + 1,
      memory_order_relaxed);
  return 1;
}

/* ---- the API ------------------------------------------------------------- */

void kvp__index_purge_routed(kvp_index *ix, uint32_t w) {
  kvp__spin_lock(&ix->alock);
  approx_purge_locked(ix, w);
  kvp__spin_unlock(&ix->alock);
}

/* Recording a chain is a string of dependent cache misses per key -- its
 * bucket, its record, its two Bloom words -- ~200 ns a key, a quarter of
 * kvplane-routerd's CPU on a 32K-token prompt routed in approximate mode
 * (bench_routerd).  The keys are known up front, so they are fetched ahead:
 * REC_FAR keys ahead the bucket and the Bloom words, REC_NEAR ahead the
 * head record the (by then cached) bucket names.  Only hints: a record
 * evicted or a table rebuilt meanwhile costs a miss, not a wrong answer. */
#define REC_FAR 16u
#define REC_NEAR 6u

static void rec_prefetch_far(kvp_index *ix, uint64_t fp) {
  ktab *t = atomic_load_explicit(&ix->atab, memory_order_relaxed);
  __builtin_prefetch(
      &t->slots[bucket_of(mix64(fp), t->nbuckets) * BUCKET_SLOTS], 1, 3);
  if (ix->seen != NULL) {
    uint64_t b[2];
    seen_bits_of(ix, fp, b);
    __builtin_prefetch(&ix->seen[b[0] >> 6], 1, 3);
    __builtin_prefetch(&ix->seen[b[1] >> 6], 1, 3);
  }
}

static void rec_prefetch_near(kvp_index *ix, uint64_t fp) {
  ktab *t = atomic_load_explicit(&ix->atab, memory_order_relaxed);
  kslot *s = kvp__tab_find(t, fp, mix64(fp), NULL);
  uint32_t head =
      s ? (uint32_t)atomic_load_explicit(&s->val, memory_order_relaxed) : 0;
  if (head != 0)
    __builtin_prefetch(arec_at(ix, head), 1, 3);
}

static int record(kvp_index *ix, uint32_t worker_id, const kvp_key *keys,
                  size_t n, uint64_t now_ns, uint32_t life_us) {
  int rc = kvp__index_args(ix, 0, keys, n);
  if (rc < 0)
    return rc;
  if (worker_id >= ix->max_workers) {
    ctr_inc(&ix->c.ev[KVP__C_UNKNOWN]);
    return KVP_ERANGE;
  }
  int created = 0;
  kvp__spin_lock(&ix->alock);
  /* acquire: pairs with the release in kvp_index_worker_remove; a removal
   * that purged before we took the lock is seen here */
  if (atomic_load_explicit(&ix->workers[worker_id].state,
                           memory_order_acquire) != W_ACTIVE) {
    rc = KVP_ENOENT;
    ctr_inc(&ix->c.ev[KVP__C_UNKNOWN]);
  }
  if (rc == 0)
    (void)approx_expire_locked(ix, now_ns);
  bool pf = ix->arec_pf;
  for (size_t i = 0; pf && rc == 0 && i < REC_FAR && i < n; i++)
    rec_prefetch_far(ix, fp_of(keys[i]));
  for (size_t i = 0; pf && rc == 0 && i < REC_NEAR && i < n; i++)
    rec_prefetch_near(ix, fp_of(keys[i]));
  for (size_t i = 0; rc == 0 && i < n; i++) {
    if (pf && i + REC_FAR < n)
      rec_prefetch_far(ix, fp_of(keys[i + REC_FAR]));
    if (pf && i + REC_NEAR < n)
      rec_prefetch_near(ix, fp_of(keys[i + REC_NEAR]));
    seen_note(ix, fp_of(keys[i]));
    rc = approx_record(ix, fp_of(keys[i]), worker_id, now_ns, life_us);
    created += rc > 0;
    rc = rc > 0 ? 0 : rc;
    while (atomic_load_explicit(&ix->acount, memory_order_relaxed) > ix->acap) {
      (void)arec_evict(ix, ix->lru_tail);
      ctr_inc(&ix->c.evicted);
    }
  }
  kvp__spin_unlock(&ix->alock);
  return rc < 0 ? rc : created;
}

void kvp__index_set_record_prefetch(kvp_index *ix, bool on) {
  ix->arec_pf = on;
}

int kvp_index_record_routed(kvp_index *ix, uint32_t worker_id,
                            const kvp_key *keys, size_t n, uint64_t now_ns) {
  return record(ix, worker_id, keys, n, now_ns, 0);
}

int kvp_index_record_pending(kvp_index *ix, uint32_t worker_id,
                             const kvp_key *keys, size_t n, uint64_t now_ns,
                             uint64_t life_ns) {
  if (life_ns == 0)
    return ix == NULL ? KVP_EINVAL : 0;
  uint64_t us = (life_ns + 999u) / 1000u; /* at least 1 us */
  return record(ix, worker_id, keys, n, now_ns,
                us > UINT32_MAX ? UINT32_MAX : (uint32_t)us);
}

int kvp_index_expire(kvp_index *ix, uint64_t now_ns) {
  if (ix == NULL)
    return KVP_EINVAL;
  kvp__spin_lock(&ix->alock);
  size_t n = approx_expire_locked(ix, now_ns);
  kvp__spin_unlock(&ix->alock);
  return n > INT_MAX ? INT_MAX : (int)n;
}

int kvp__approx_init(kvp_index *ix) {
  /* Room for the records retired but not yet reusable (a reader preempted
   * while pinned holds the epoch back for a time slice): chunks are
   * allocated only when used, so the spare costs one pointer per chunk. */
  ix->adir_n = (uint32_t)((4 * ix->acap + APPROX_SPARE) / APPROX_CHUNK + 1);
  ix->adir = ix_alloc(ix, ix->adir_n * sizeof *ix->adir);
  if (ix->adir == NULL)
    return KVP_ENOMEM;
  memset(ix->adir, 0, ix->adir_n * sizeof *ix->adir);
  ktab *t = kvp__tab_new(ix, MIN_BUCKETS);
  if (t == NULL)
    return KVP_ENOMEM;
  atomic_store_explicit(&ix->atab, t, memory_order_relaxed);
  return 0;
}

void kvp__approx_fini(kvp_index *ix) {
  kvp__tab_free(ix, &ix->atab, false);
  for (uint32_t c = 0; ix->adir != NULL && c < ix->adir_n; c++)
    ix_free(ix, atomic_load_explicit(&ix->adir[c], memory_order_relaxed),
            APPROX_CHUNK * sizeof(arec));
  ix_free(ix, ix->adir, ix->adir_n * sizeof *ix->adir);
  kvp__free(&ix->alloc, ix->aret, ix->aret_cap * sizeof *ix->aret);
}
