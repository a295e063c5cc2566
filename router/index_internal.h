/* SPDX-License-Identifier: Apache-2.0 */
/* router/index internals shared with the tests and the benchmark: the writer
 * spinlock and a consistency check.  Not installed. */
#ifndef KVP_INDEX_INTERNAL_H
#define KVP_INDEX_INTERNAL_H

#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "kvplane/index.h"

/* Writers-only lock (readers never take one).  Held for one block update, or
 * for one shard's scan/rehash (milliseconds at most), so waiters spin briefly
 * and then yield the CPU instead of sleeping in the kernel. */
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

/* Recomputes, from the tables, every worker's digest and residency count and
 * the key counts, and compares them with the incrementally kept ones; also
 * checks every holder set's encoding.  Call only while no writer runs.
 * Returns 0 or KVP_ECORRUPT (and logs what differs). */
int kvp__index_verify(kvp_index *ix);

/* Turns kvp_index_opts.prefix_closed on or off on a live index (tests and the
 * benchmark compare both query plans on one index).  No query in flight. */
void kvp__index_set_prefix_closed(kvp_index *ix, bool on);

#endif /* KVP_INDEX_INTERNAL_H */
