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
  /* Repeat gate (CUDA scatters with KVP_XFER_IDS_UNIQUE; 0 = none): a
   * device uint64 that kvp_repeat_check, queued just before, sets to
   * repeat_tag when an id repeats.  Then the kernel copies nothing: every
   * CTA releases the slot and CTA 0 stores repeat_tag into repeat_err
   * (mapped host memory) for the host to report. */
  unsigned long long repeat_flag;
  unsigned long long repeat_tag;
  unsigned long long repeat_err;
  unsigned int n_chunks;
  unsigned int n_ids;              /* n_ids * n_chunks * n_segs < 2^32 */
  unsigned int scatter;            /* 0: cache -> staging, 1: staging -> cache */
  unsigned int seg_bytes;          /* a chunk is split in segments of this */
  unsigned int n_segs;             /* ceil(chunk_bytes / seg_bytes) */
  unsigned int done_gen;           /* never 0 when done_word is set */
} kvp_copy_args;

KVP_ARGS_STATIC_ASSERT(sizeof(kvp_copy_args) == 104, "kvp_copy_args layout");

/* The GPU repeat check (CUDA): every id of the list exchanges repeat_tag
 * into its owner entry (a device uint64 per block of the layout); finding
 * the tag already there means the id repeats, and the flag gets the tag. */
typedef struct kvp_repeat_args {
  unsigned long long ids;   /* device address of n uint32 ids (the slot) */
  unsigned long long owner; /* device array of num_blocks uint64 */
  unsigned long long flag;  /* device uint64 */
  unsigned long long tag;   /* never 0, never reused by this device */
  unsigned int n;
  unsigned int pad_;
} kvp_repeat_args;

KVP_ARGS_STATIC_ASSERT(sizeof(kvp_repeat_args) == 40, "kvp_repeat_args layout");

/* Kernel entry points, one per access width (bytes). */
#define KVP_KERNEL_NAMES(X) X(16) X(8) X(4) X(2) X(1)

#endif /* KVP_KERNELS_ARGS_H */
