/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: epoch-based reclamation (index_epoch.h): the global epoch,
 * the reader slots and the list of retired memory. */
#include <string.h>

#include "index_epoch.h"

#define RECLAIM_BYTES (1u << 20)
#define SLOTS_BYTES (KVP__EBR_SLOTS * sizeof(kvp__ebr_slot))

_Thread_local unsigned kvp__ebr_hint = UINT_MAX;
atomic_uint kvp__ebr_thread_seq;

static void bytes_add(kvp__ebr *e, size_t n) {
  atomic_fetch_add_explicit(e->bytes, n, memory_order_relaxed);
}

static void ebr_free(kvp__ebr *e, void *p, size_t size) {
  if (p == NULL)
    return;
  atomic_fetch_sub_explicit(e->bytes, size, memory_order_relaxed);
  kvp__free(e->alloc, p, size);
}

int kvp__ebr_init(kvp__ebr *e, const kvp_allocator *alloc,
                  _Atomic uint64_t *bytes) {
  memset(e, 0, sizeof *e);
  e->alloc = alloc;
  e->bytes = bytes;
  atomic_store_explicit(&e->epoch, 1, memory_order_relaxed);
  e->slots_raw = kvp__malloc(alloc, SLOTS_BYTES + 63);
  if (e->slots_raw == NULL)
    return KVP_ENOMEM;
  bytes_add(e, SLOTS_BYTES + 63);
  e->slots = (void *)(((uintptr_t)e->slots_raw + 63) & ~(uintptr_t)63);
  memset(e->slots, 0, SLOTS_BYTES);
  return 0;
}

void kvp__ebr_fini(kvp__ebr *e) {
  if (e->alloc == NULL)
    return; /* never set up */
  for (size_t i = 0; i < e->rl_n; i++)
    ebr_free(e, e->rl[i].p, e->rl[i].size);
  ebr_free(e, e->rl, e->rl_cap * sizeof *e->rl);
  ebr_free(e, e->slots_raw, SLOTS_BYTES + 63);
}

void kvp__ebr_advance(kvp__ebr *e) {
  /* seq_cst: pairs with the pin's re-read of the epoch */
  uint64_t g = atomic_load_explicit(&e->epoch, memory_order_seq_cst);
  for (unsigned i = 0; i < KVP__EBR_SLOTS; i++) {
    /* seq_cst: pairs with the pin CAS/exchange and the unpin release */
    uint64_t s = atomic_load_explicit(&e->slots[i].epoch, memory_order_seq_cst);
    if (s != 0 && s != g)
      return;
  }
  /* seq_cst (a release): pairs with the acquire in kvp__ebr_safe and with the
   * pin's seq_cst re-read of the epoch */
  atomic_compare_exchange_strong_explicit(
      &e->epoch, &g, g + 1, memory_order_seq_cst, memory_order_relaxed);
}

void kvp__ebr_wait(kvp__ebr *e, uint64_t tag) {
  while (!kvp__ebr_safe(e, tag)) {
    kvp__ebr_advance(e);
    if (!kvp__ebr_safe(e, tag))
      sched_yield();
  }
}

static void reclaim_locked(kvp__ebr *e) {
  kvp__ebr_advance(e);
  size_t k = 0;
  for (size_t i = 0; i < e->rl_n; i++) {
    kvp__ebr_retired r = e->rl[i];
    if (kvp__ebr_safe(e, r.epoch)) {
      e->rl_bytes -= r.size;
      ebr_free(e, r.p, r.size);
    } else {
      e->rl[k++] = r;
    }
  }
  e->rl_n = k;
}

size_t kvp__ebr_reclaim(kvp__ebr *e) {
  kvp__spin_lock(&e->lock);
  reclaim_locked(e);
  size_t left = e->rl_n;
  kvp__spin_unlock(&e->lock);
  return left;
}

/* Room for one more retirement; false when the list cannot grow. */
static bool rl_reserve(kvp__ebr *e) {
  if (e->rl_n < e->rl_cap)
    return true;
  size_t cap = e->rl_cap ? 2 * e->rl_cap : 64;
  kvp__ebr_retired *rl =
      kvp__realloc(e->alloc, e->rl, e->rl_cap * sizeof *rl, cap * sizeof *rl);
  if (rl == NULL)
    return false;
  bytes_add(e, (cap - e->rl_cap) * sizeof *rl);
  e->rl = rl;
  e->rl_cap = cap;
  return true;
}

void kvp__ebr_retire(kvp__ebr *e, void *p, size_t size) {
  uint64_t tag = kvp__ebr_tag(e);
  kvp__spin_lock(&e->lock);
  if (!rl_reserve(e)) { /* no room to defer: wait out the readers instead */
    kvp__spin_unlock(&e->lock);
    kvp__ebr_wait(e, tag);
    ebr_free(e, p, size);
    return;
  }
  e->rl[e->rl_n++] = (kvp__ebr_retired){p, size, tag};
  e->rl_bytes += size;
  if (e->rl_n >= KVP__EBR_BATCH || e->rl_bytes >= RECLAIM_BYTES)
    reclaim_locked(e);
  kvp__spin_unlock(&e->lock);
}
