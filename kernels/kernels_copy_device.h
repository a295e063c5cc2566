/* SPDX-License-Identifier: Apache-2.0 */
/* The gather/scatter kernel body, shared by kernels/cuda/cuda_copy.cu (nvcc)
 * and kernels/hip/hip_copy.hip (clang, HIP device-only): device C++ only.
 * The includer defines KVP_GLOBAL, KVP_DEVICE_INLINE, KVP_SHARED,
 * KVP_SYNC_THREADS(), KVP_THREAD_X, KVP_BLOCK_X, KVP_BLOCK_DIM_X,
 * KVP_GRID_DIM_X, KVP_FENCE_SYSTEM(), and the global-memory
 * accessors kvp_ld<V>(address) / kvp_st<V>(address, value): addresses arrive
 * as integers, so a plain dereference would compile to generic (flat)
 * accesses; the accessors force global ones (LDG/STG on NVIDIA).
 *
 * Work is split in items = (block i of the list, chunk c, segment s of
 * seg_bytes, so that few large pages still spread over every group).  Each
 * CTA owns a contiguous range of items; a group of 32 threads copies one
 * item at a time with accesses of sizeof(V) bytes, U
 * independent loads in flight per thread before the first store (the bus
 * latency of mapped host memory needs many bytes in flight).  Any grid size
 * (the CTA budget) covers any list. */
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

/* ids (and slots) a CTA stages in shared memory; beyond it, it reads them
 * from the argument arrays directly (correct, slower). */
#define KVP_SH_IDS 2048u

/* The release word (kernels_args.h): thread 0 stores done_gen into this
 * CTA's word once no thread of the CTA will read the argument slot again.
 * The caller has made sure of that (a barrier after the last reads, or no
 * reads at all); the reads' values are in registers or shared memory by
 * then, so a host that sees the word and rewrites the slot cannot change
 * them.  A plain posted store: no atomic, no fence, nothing to wait for. */
KVP_DEVICE_INLINE void kvp_release(const kvp_copy_args &a) {
  if (a.done_word && KVP_THREAD_X == 0)
    ((volatile unsigned *)a.done_word)[KVP_BLOCK_X] = a.done_gen;
}

/* The repeat gate (kernels_args.h): true when kvp_repeat_check found a
 * repeated id; then this CTA releases the slot (CTA 0 first reports the
 * repeat) and copies nothing.  The flag was written by the kernel before
 * this one on the stream, so a plain load sees it. */
KVP_DEVICE_INLINE bool kvp_repeat_stop(const kvp_copy_args &a) {
  if (!a.repeat_flag || kvp_ld<kvp_vec8>(a.repeat_flag) != a.repeat_tag)
    return false;
  if (KVP_BLOCK_X == 0 && KVP_THREAD_X == 0) {
    *(volatile unsigned long long *)a.repeat_err = a.repeat_tag;
    KVP_FENCE_SYSTEM(); /* the report before the release that frees the slot */
  }
  kvp_release(a);
  return true;
}

template <typename V, int U>
KVP_DEVICE_INLINE void kvp_copy_body(const kvp_copy_args &a) {
  KVP_SHARED unsigned sh_ids[KVP_SH_IDS], sh_slots[KVP_SH_IDS];
  if (kvp_repeat_stop(a))
    return;
  const unsigned per_id = a.n_chunks * a.n_segs;
  const unsigned items = a.n_ids * per_id;
  const unsigned long long *bases = (const unsigned long long *)a.chunk_base;
  const unsigned *ids = (const unsigned *)a.ids;
  const unsigned *slots = (const unsigned *)a.slots;
  /* Each CTA takes a contiguous range of items, so the ids it needs are one
   * contiguous range too: read once, coalesced, into shared memory.  (They
   * live in mapped host memory: one wide read per CTA instead of one bus
   * round trip per item.) */
  const unsigned per_cta = (items + KVP_GRID_DIM_X - 1) / KVP_GRID_DIM_X;
  const unsigned it0 = KVP_BLOCK_X * per_cta;
  const unsigned it1 = items - it0 < per_cta ? items : it0 + per_cta;
  if (it0 >= items) { /* nothing to copy, nothing read */
    kvp_release(a);
    return;
  }
  const unsigned i0 = it0 / per_id, cnt = (it1 - 1) / per_id + 1 - i0;
  const bool staged = cnt <= KVP_SH_IDS;
  if (staged) {
    for (unsigned k = KVP_THREAD_X; k < cnt; k += KVP_BLOCK_DIM_X) {
      sh_ids[k] = ids[i0 + k];
      sh_slots[k] = slots ? slots[i0 + k] : i0 + k;
    }
    KVP_SYNC_THREADS();
    kvp_release(a); /* the copy below reads the shared copies only */
  }
  const unsigned group = KVP_THREAD_X / KVP_GROUP, lane = KVP_THREAD_X % KVP_GROUP;
  const unsigned ngroups = KVP_BLOCK_DIM_X / KVP_GROUP;
  for (unsigned it = it0 + group; it < it1; it += ngroups) {
    const unsigned i = it / per_id, rem = it - i * per_id;
    const unsigned id = staged ? sh_ids[i - i0] : ids[i];
    const unsigned long long slot =
        staged ? sh_slots[i - i0] : (slots ? slots[i] : i);
    const unsigned c = rem / a.n_segs, sg = rem - c * a.n_segs;
    const unsigned long long off = (unsigned long long)sg * a.seg_bytes;
    const unsigned long long left = a.chunk_bytes - off;
    const unsigned long long nvec =
        (left < a.seg_bytes ? left : a.seg_bytes) / sizeof(V);
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
  if (!staged) { /* the loop above read the slot: every thread past it */
    KVP_SYNC_THREADS();
    kvp_release(a);
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
