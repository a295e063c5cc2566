/* SPDX-License-Identifier: Apache-2.0 */
/* router/index: epoch-based reclamation (EBR) for the index's lock-free
 * readers.  A reader pins one of KVP__EBR_SLOTS slots for a whole query (a
 * CAS, one load, one store) and never waits on a writer.  Memory a pinned
 * reader may still hold is retired, after the store that unlinked it, with
 * the current epoch as its tag, and freed once the epoch is >= tag + 2:
 * advancing twice needs every pinned reader to have re-pinned since.
 *
 * The reader slot protocol (crossbeam's, with seq_cst RMWs instead of fences
 * so ThreadSanitizer follows it): pin = CAS the slot from 0 to the global
 * epoch, then re-read the global epoch until it matches what the slot holds;
 * unpin = store 0 (release).  The epoch advances from g to g+1 only when no
 * pinned slot holds another value than g.  A retirement reads its tag with an
 * acq_rel RMW on the global epoch, after the unlinking store.
 *
 * Pin/unpin from any thread; retire/reclaim from any thread (the retired list
 * has its own lock, taken last in the index's lock order).  Not installed. */
#ifndef KVP_INDEX_EPOCH_H
#define KVP_INDEX_EPOCH_H

#include <limits.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core_internal.h"
#include "index_spin.h"

#define KVP__EBR_SLOTS 128u
#define KVP__EBR_BATCH 32u /* waiting retirements that start a reclaim */

typedef struct kvp__ebr_slot { /* 64 bytes */
  _Atomic uint64_t epoch;      /* 0 = free, else the epoch its reader pinned */
  /* The reader's own counters, kept in its line: the index counts queries
   * and blocks read here (relaxed). */
  _Atomic uint64_t queries, blocks;
  char pad_[40];
} kvp__ebr_slot;
_Static_assert(sizeof(kvp__ebr_slot) == 64, "one line per reader slot");

typedef struct kvp__ebr_retired {
  void *p;
  size_t size;
  uint64_t epoch;
} kvp__ebr_retired;

typedef struct kvp__ebr {
  _Atomic uint64_t epoch; /* global epoch, starts at 1 */
  kvp__ebr_slot *slots;   /* KVP__EBR_SLOTS, line-aligned inside slots_raw */
  void *slots_raw;
  const kvp_allocator *alloc; /* the owner's; frees retired memory */
  _Atomic uint64_t *bytes;    /* the owner's byte count (relaxed) */
  kvp__spin lock;             /* the retired list */
  kvp__ebr_retired *rl;
  size_t rl_n, rl_cap, rl_bytes;
} kvp__ebr;

/* Sets e up, epoch 1, no reader pinned.  alloc and bytes must outlive e;
 * what e allocates and frees is added to and taken from *bytes.  Returns 0
 * or KVP_ENOMEM. */
int kvp__ebr_init(kvp__ebr *e, const kvp_allocator *alloc,
                  _Atomic uint64_t *bytes);
/* Frees everything still retired and the slots.  No reader may be pinned.
 * Accepts an e whose init failed or never ran (zeroed). */
void kvp__ebr_fini(kvp__ebr *e);

/* Moves the global epoch on if every pinned reader has seen it. */
void kvp__ebr_advance(kvp__ebr *e);
/* Waits (spinning, yielding) until nothing retired at `tag` can be read. */
void kvp__ebr_wait(kvp__ebr *e, uint64_t tag);
/* Frees p (size bytes, from e's allocator) once no reader can hold it.  Call
 * after the store that made it unreachable.  Once KVP__EBR_BATCH
 * retirements (or 1 MiB) wait, it reclaims what is safe; if the list cannot
 * grow it waits out the readers and frees p at once. */
void kvp__ebr_retire(kvp__ebr *e, void *p, size_t size);
/* Advances the epoch once and frees what is then safe; returns how many
 * retirements are still waiting. */
size_t kvp__ebr_reclaim(kvp__ebr *e);

/* The thread's preferred slot (UINT_MAX: none yet) and the counter that
 * spreads threads over the slots; index_epoch.c defines them. */
extern _Thread_local unsigned kvp__ebr_hint;
extern atomic_uint kvp__ebr_thread_seq;

/* Pins a slot for the calling thread's reads; returns it for unpin.  Inline:
 * the query path pins once per query. */
static inline unsigned kvp__ebr_pin(kvp__ebr *e) {
  if (kvp__ebr_hint == UINT_MAX)
    kvp__ebr_hint = atomic_fetch_add_explicit(&kvp__ebr_thread_seq, 1,
                                              memory_order_relaxed) %
                    KVP__EBR_SLOTS;
  for (;;) {
    for (unsigned k = 0; k < KVP__EBR_SLOTS; k++) {
      unsigned i = (kvp__ebr_hint + k) % KVP__EBR_SLOTS;
      _Atomic uint64_t *slot = &e->slots[i].epoch;
      uint64_t ep = atomic_load_explicit(&e->epoch, memory_order_relaxed);
      uint64_t free_ = 0;
      /* seq_cst CAS: pairs with the slot loads of kvp__ebr_advance; it
       * continues the release sequence of the unpin store that freed it */
      if (atomic_load_explicit(slot, memory_order_relaxed) != 0 ||
          !atomic_compare_exchange_strong_explicit(
              slot, &free_, ep, memory_order_seq_cst, memory_order_relaxed))
        continue;
      /* seq_cst: ordered with kvp__ebr_advance's slot scan and epoch CAS */
      for (uint64_t g;
           (g = atomic_load_explicit(&e->epoch, memory_order_seq_cst)) != ep;)
        ep = g, (void)atomic_exchange_explicit(slot, ep, memory_order_seq_cst);
      kvp__ebr_hint = i;
      return i;
    }
    sched_yield(); /* more than KVP__EBR_SLOTS readers at once */
  }
}

static inline void kvp__ebr_unpin(kvp__ebr *e, unsigned i) {
  /* release: pairs with the seq_cst slot loads in kvp__ebr_advance, so every
   * read of this reader happens before whatever a writer then frees */
  atomic_store_explicit(&e->slots[i].epoch, 0, memory_order_release);
}

/* The epoch a retirement is tagged with.  An RMW (acq_rel) so that the epoch
 * CASes after it continue its release sequence: a reader that pins a later
 * epoch also sees the unlinking store made before this call. */
static inline uint64_t kvp__ebr_tag(kvp__ebr *e) {
  return atomic_fetch_add_explicit(&e->epoch, 0, memory_order_acq_rel);
}

/* Nothing retired at `tag` can still be read. */
static inline bool kvp__ebr_safe(kvp__ebr *e, uint64_t tag) {
  /* acquire: pairs with the epoch CAS of kvp__ebr_advance (its slot scan saw
   * every reader of the retired memory unpinned) */
  return atomic_load_explicit(&e->epoch, memory_order_acquire) >= tag + 2;
}

#endif /* KVP_INDEX_EPOCH_H */
