/* SPDX-License-Identifier: Apache-2.0 */
/* What the GPU backends (CUDA, HIP) share around a launch: the ring of
 * launch-argument slots and the copy-engine method's runs.
 *
 * The ring: KVP__RING slots of mapped pinned memory, each holding one
 * launch's block ids and then its staging slots, which the kernel reads in
 * place; taken round robin.  A slot its last launch may still read is
 * waited for the backend's way (CUDA: per-CTA release words; HIP: an event
 * recorded after the launch), then grown when too small.  Callers hold the
 * device lock. */
#ifndef KVP_KERNELS_RING_H
#define KVP_KERNELS_RING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels_internal.h"

#define KVP__RING 8

typedef struct kvp__ring_slot {
  bool pending;   /* launched, maybe still read: ops.wait clears it */
  uint32_t *host; /* mapped pinned: ids then slots */
  uint64_t dev;   /* its device address */
  size_t cap;     /* uint32 entries */
} kvp__ring_slot;

typedef struct kvp__ring {
  kvp__ring_slot slot[KVP__RING];
  unsigned next;
} kvp__ring;

typedef struct kvp__ring_ops {
  /* Returns once slot i's last launch no longer reads it (pending cleared),
   * or a library error. */
  int (*wait)(kvp_device *d, unsigned i);
  /* Optional: slot i is about to be reused (after any wait). */
  void (*reuse)(kvp_device *d, unsigned i);
  /* `bytes` of mapped pinned memory and its device address; on failure
   * *host may be set (it is freed with the slot). */
  int (*host_alloc)(kvp_device *d, size_t bytes, uint32_t **host,
                    uint64_t *dev);
  void (*host_free)(kvp_device *d, uint32_t *host);
} kvp__ring_ops;

/* The next slot, free of earlier work and holding at least `need` entries;
 * *i gets its index. */
int kvp__ring_take(kvp_device *d, kvp__ring *r, const kvp__ring_ops *o,
                   size_t need, unsigned *i);
/* kvp__dev_ops.args_take over the ring (after the backend made its device
 * current): a slot for `entries`, its host memory and the slot itself. */
int kvp__ring_args_take(kvp_device *d, kvp__ring *r, const kvp__ring_ops *o,
                        size_t entries, uint32_t **host, void **slot);
/* The plan's slot index: the one validation filled (p->arg_slot), or one
 * taken and filled now with the plan's ids and slots (calibration). */
int kvp__ring_plan_slot(kvp_device *d, kvp__ring *r, const kvp__ring_ops *o,
                        const kvp__plan *p, unsigned *i);
/* Frees every slot's memory; wait: first wait for those still pending
 * (on an error, free anyway). */
void kvp__ring_free(kvp_device *d, kvp__ring *r, const kvp__ring_ops *o,
                    bool wait);

/* One asynchronous 2D copy on `stream`: `rows` rows of `width` bytes. */
typedef int (*kvp__copy2d_fn)(kvp_device *d, void *stream, uint64_t dst,
                              uint64_t dpitch, uint64_t src, uint64_t spitch,
                              uint64_t width, uint32_t rows);
/* The copy-engine method: one copy per run of adjacent blocks (adjacent ids
 * and slots) and chunk, a row per block, pitches = the two strides. */
int kvp__copy_runs(kvp_device *d, const kvp__plan *p, void *stream,
                   kvp__copy2d_fn copy);

#endif /* KVP_KERNELS_RING_H */
