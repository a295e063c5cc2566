/* SPDX-License-Identifier: Apache-2.0 */
/* The gather/scatter kernel body, shared by kernels/cuda/cuda_copy.cu (nvcc)
 * and kernels/hip/hip_copy.hip (clang, HIP device-only): device C++ only.
 * The includer defines KVP_GLOBAL, KVP_DEVICE_INLINE, KVP_THREAD_X,
 * KVP_BLOCK_X, KVP_BLOCK_DIM_X, KVP_GRID_DIM_X, and the global-memory
 * accessors kvp_ld<V>(address) / kvp_st<V>(address, value): addresses arrive
 * as integers, so a plain dereference would compile to generic (flat)
 * accesses; the accessors force global ones (LDG/STG on NVIDIA).
 *
 * Work is split in items = (block i of the list, chunk c, segment s of
 * seg_bytes, so that few large pages still spread over every group); a
 * group of 32 consecutive threads copies one item with accesses of sizeof(V) bytes, U
 * independent loads in flight per thread before the first store (the bus
 * latency of mapped host memory needs many bytes in flight).  Groups stride
 * over the items, so any grid size (the CTA budget) covers any list. */
#ifndef KVP_KERNELS_COPY_DEVICE_H
#define KVP_KERNELS_COPY_DEVICE_H

#include "kernels_args.h"

struct alignas(16) kvp_vec16 {
  unsigned int x, y, z, w;
};
typedef unsigned long long kvp_vec8;
typedef unsigned int kvp_vec4;
typedef unsigned short kvp_vec2;
typedef unsigned char kvp_vec1;

#define KVP_GROUP 32u

template <typename V> KVP_DEVICE_INLINE V kvp_ld(unsigned long long addr);
template <typename V>
KVP_DEVICE_INLINE void kvp_st(unsigned long long addr, V v);
#include KVP_ACCESSORS

template <typename V, int U>
KVP_DEVICE_INLINE void kvp_copy_body(const kvp_copy_args &a) {
  const unsigned gtid = KVP_BLOCK_X * KVP_BLOCK_DIM_X + KVP_THREAD_X;
  const unsigned group = gtid / KVP_GROUP, lane = gtid % KVP_GROUP;
  const unsigned ngroups = (KVP_GRID_DIM_X * KVP_BLOCK_DIM_X) / KVP_GROUP;
  const unsigned per_id = a.n_chunks * a.n_segs;
  const unsigned items = a.n_ids * per_id;
  const unsigned long long *bases = (const unsigned long long *)a.chunk_base;
  const unsigned *ids = (const unsigned *)a.ids;
  const unsigned *slots = (const unsigned *)a.slots;
  /* ids and slots live in mapped host memory (zero-copy, no upload before
   * the launch): each group loads the next item's id and slot while it
   * copies the current one, so the bus latency stays off the chain. */
  unsigned next_id = 0, next_slot = 0;
  if (group < items) {
    next_id = ids[group / per_id];
    next_slot = slots ? slots[group / per_id] : group / per_id;
  }
  for (unsigned it = group; it < items; it += ngroups) {
    const unsigned i = it / per_id, rem = it - i * per_id;
    const unsigned id = next_id, slot32 = next_slot;
    const unsigned nit = it + ngroups;
    if (nit < items) {
      const unsigned ni = nit / per_id;
      if (ni != i) {
        next_id = ids[ni];
        next_slot = slots ? slots[ni] : ni;
      }
    }
    const unsigned c = rem / a.n_segs, sg = rem - c * a.n_segs;
    const unsigned long long off = (unsigned long long)sg * a.seg_bytes;
    const unsigned long long left = a.chunk_bytes - off;
    const unsigned long long nvec =
        (left < a.seg_bytes ? left : a.seg_bytes) / sizeof(V);
    const unsigned long long slot = slot32;
    const unsigned long long paged =
        bases[c] + (unsigned long long)id * a.block_stride + off;
    const unsigned long long stage =
        a.staging + (slot * a.n_chunks + c) * a.chunk_bytes + off;
    const unsigned long long src = a.scatter ? stage : paged;
    const unsigned long long dst = a.scatter ? paged : stage;
    unsigned long long v = lane;
    for (; v + (U - 1) * KVP_GROUP < nvec; v += U * KVP_GROUP) {
      V r[U];
#pragma unroll
      for (int u = 0; u < U; u++)
        r[u] = kvp_ld<V>(src + (v + u * KVP_GROUP) * sizeof(V));
#pragma unroll
      for (int u = 0; u < U; u++)
        kvp_st<V>(dst + (v + u * KVP_GROUP) * sizeof(V), r[u]);
    }
    for (; v < nvec; v += KVP_GROUP)
      kvp_st<V>(dst + v * sizeof(V), kvp_ld<V>(src + v * sizeof(V)));
  }
}

#define KVP_DEFINE_COPY_KERNEL(W, U)                                            \
  extern "C" KVP_GLOBAL void kvp_copy_w##W(kvp_copy_args a) {                   \
    kvp_copy_body<kvp_vec##W, U>(a);                                            \
  }

KVP_DEFINE_COPY_KERNEL(16, 4)
KVP_DEFINE_COPY_KERNEL(8, 8)
KVP_DEFINE_COPY_KERNEL(4, 8)
KVP_DEFINE_COPY_KERNEL(2, 8)
KVP_DEFINE_COPY_KERNEL(1, 8)

#endif /* KVP_KERNELS_COPY_DEVICE_H */
