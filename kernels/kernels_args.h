/* SPDX-License-Identifier: Apache-2.0 */
/* The gather/scatter kernels' one parameter, shared by the host code (C) and
 * the device code (CUDA, HIP): plain fixed-width fields, 8-byte ones first,
 * so both compilers lay it out alike (checked by _Static_assert / static_assert). */
#ifndef KVP_KERNELS_ARGS_H
#define KVP_KERNELS_ARGS_H

#ifdef __cplusplus
#define KVP_ARGS_STATIC_ASSERT static_assert
#else
#include <stdint.h>
#define KVP_ARGS_STATIC_ASSERT _Static_assert
#endif

typedef struct kvp_copy_args {
  unsigned long long chunk_base;   /* device array of n_chunks uint64 addresses */
  unsigned long long ids;          /* device array of n_ids uint32 block ids */
  unsigned long long slots;        /* device array of n_ids uint32 slots, or 0 */
  unsigned long long staging;      /* staging base address */
  unsigned long long block_stride; /* bytes between blocks inside a chunk tensor */
  unsigned long long chunk_bytes;  /* multiple of the kernel's vector width */
  /* Release words (CUDA; 0 = none, as on HIP): an array of one uint32 per
   * CTA in mapped host memory; CTA b stores done_gen into done_word[b] once
   * it will not read the argument slot (ids, slots) again, which tells the
   * host the slot may be reused without an event. */
  unsigned long long done_word;
  unsigned int n_chunks;
  unsigned int n_ids;              /* n_ids * n_chunks * n_segs < 2^32 */
  unsigned int scatter;            /* 0: cache -> staging, 1: staging -> cache */
  unsigned int seg_bytes;          /* a chunk is split in segments of this */
  unsigned int n_segs;             /* ceil(chunk_bytes / seg_bytes) */
  unsigned int done_gen;           /* never 0 when done_word is set */
} kvp_copy_args;

KVP_ARGS_STATIC_ASSERT(sizeof(kvp_copy_args) == 80, "kvp_copy_args layout");

/* Kernel entry points, one per access width (bytes). */
#define KVP_KERNEL_NAMES(X) X(16) X(8) X(4) X(2) X(1)

#endif /* KVP_KERNELS_ARGS_H */
