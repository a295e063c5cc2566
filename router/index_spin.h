/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: the writers' spinlock.  Readers never take one.  Held for
 * one block update, or for one shard's scan/rehash (milliseconds at most), so
 * waiters spin briefly and then yield the CPU instead of sleeping in the
 * kernel.  Not installed. */
#ifndef KVP_INDEX_SPIN_H
#define KVP_INDEX_SPIN_H

#include <sched.h>
#include <stdatomic.h>

typedef struct kvp__spin {
  atomic_uint v;
} kvp__spin;

static inline void kvp__spin_lock(kvp__spin *l) {
  unsigned spins = 0;
  /* acquire: pairs with the release in kvp__spin_unlock */
  while (atomic_exchange_explicit(&l->v, 1u, memory_order_acquire) != 0) {
    while (atomic_load_explicit(&l->v, memory_order_relaxed) != 0)
      if (++spins > 64)
        sched_yield();
  }
}

static inline void kvp__spin_unlock(kvp__spin *l) {
  /* release: pairs with the acquire in kvp__spin_lock */
  atomic_store_explicit(&l->v, 0u, memory_order_release);
}

#endif /* KVP_INDEX_SPIN_H */
