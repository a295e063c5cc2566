/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane device (kernels/): one interface over the device backends -- the CPU
 * reference (always there, the correctness oracle), CUDA (driver API loaded at
 * run time from libcuda.so.1, kernels embedded as cubin + PTX) and HIP
 * (libamdhip64.so at run time, embedded code objects) -- and the two
 * operations that move an engine's paged KV cache:
 *
 *   gather:  blocks named by a list of block ids, all layers, one launch
 *            -> a contiguous staging buffer (device memory, or host memory
 *               registered with kvp_device_host_register: zero-copy)
 *   scatter: the same in reverse.
 *
 * Every layout reduces to "chunks": a block is n_chunks contiguous runs of
 * chunk_bytes (one per layer and K/V plane for vLLM's per-layer tensors, one
 * per block for the cross-layer layout, ...), chunk c of block b starting at
 * chunk_base[c] + b * block_stride.  The staging buffer holds block i of the
 * list at slot i (or staging_slots[i]): slot s occupies bytes
 * [s * block_bytes, (s+1) * block_bytes), chunks in chunk order, each chunk
 * byte-for-byte as the engine stores it.  Staging therefore keeps the
 * engine's own layout and dtype: restoring needs the same layout kind and
 * shape (the block key namespace includes both, see prefix.h).
 *
 * Pointers: on the CPU backend all pointers are host pointers.  On GPU
 * backends engine tensors and staging are device pointers (as returned by
 * cudaMalloc / torch's data_ptr()) or host pointers inside a range
 * registered with kvp_device_host_register (read and written over the bus by
 * the kernel, or by the copy engines).  Device pointers travel as void *.
 *
 * Thread safety: a kvp_device may be used from several threads; calls on one
 * device are serialized by an internal mutex except where stated.  A
 * kvp_kv_layout may be shared by threads using its device (its only mutable
 * state, the scatter repeat check, is guarded by the device's mutex). */
#ifndef KVPLANE_DEVICE_H
#define KVPLANE_DEVICE_H

#include <stdbool.h>

#include "kvplane/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum kvp_backend {
  KVP_BACKEND_CPU = 0,
  KVP_BACKEND_CUDA = 1,
  KVP_BACKEND_HIP = 2,
  KVP_BACKEND_COUNT_ = 3
} kvp_backend;

/* "cpu", "cuda", "hip"; "?" for anything else. */
KVP_API const char *kvp_backend_name(kvp_backend b);

/* Whether backend b can be used here: compiled in (KVP_WITH_CUDA/HIP and a
 * device compiler at build time), its runtime library loadable, and at least
 * one device present.  Returns 1 (available) or 0 (not; `why`, if not NULL,
 * receives a one-line reason such as "libcuda.so.1: cannot open shared
 * object file"), never negative.  Probes once and caches the answer.
 * Thread-safe. */
KVP_API int kvp_backend_available(kvp_backend b, char *why, size_t why_cap);

typedef struct kvp_device kvp_device;

/* Zero value = the CPU backend with defaults. */
typedef struct kvp_device_opts {
  kvp_backend backend;
  int32_t ordinal; /* which GPU (0-based); ignored by the CPU backend */
  /* Most CTAs (thread blocks) one gather/scatter launch may occupy, so that
   * transfers leave the SMs to the forward pass.  0 = 16.  Settable later
   * with KVP_DEVOPT_CTA_BUDGET. */
  uint32_t cta_budget;
  /* KVP_DEVICE_NO_CALIBRATE: skip the start-up measurement of kernel vs copy
   * engine bandwidths (AUTO then always picks the kernel).
   * KVP_DEVICE_NO_CALIBRATION_CACHE: measure, neither read nor write the
   * calibration cache.  KVP_DEVICE_RECALIBRATE: measure and rewrite it. */
  uint32_t flags;
  /* The calibration cache file (GPU backends).  NULL = one file per GPU
   * (named by its UUID) in $KVP_CALIBRATION_CACHE, else
   * $XDG_CACHE_HOME/kvplane, else $HOME/.cache/kvplane (created 0700).  A
   * file is used only if it was measured on this GPU (UUID, PCI bus), driver
   * version, kvplane version, embedded kernels and CTA budget / threads per
   * CTA; otherwise, or when it is malformed, the device measures and
   * rewrites it (atomically; a symbolic link at the file's own path is not
   * followed, it is replaced).  Failing to read or write it never fails
   * kvp_device_create (logged at info / warn). */
  const char *calibration_cache;
  uint32_t reserved[6];
} kvp_device_opts;

#define KVP_DEVICE_NO_CALIBRATE 0x1u
#define KVP_DEVICE_NO_CALIBRATION_CACHE 0x2u
#define KVP_DEVICE_RECALIBRATE 0x4u

/* Opens a backend on one device.  GPU backends retain the device's primary
 * context (shared with the CUDA runtime / PyTorch in the same process), load
 * the embedded kernels and, unless KVP_DEVICE_NO_CALIBRATE, take the
 * crossover between the gather kernel and the copy engines for H2D and D2H
 * from the calibration cache (see calibration_cache) or measure it (~0.3 s
 * on an H100; 16 MiB of pinned host and 32 MiB of device memory, freed
 * after).  kvp_device_calibration_source() says which.
 * Returns 0; KVP_EINVAL (bad opts, reserved not zero); KVP_ENOTSUP (backend
 * not available: see kvp_backend_available); KVP_ERANGE (no such ordinal);
 * KVP_EGPU (the driver failed: kvp_device_native_error says how);
 * KVP_ENOMEM. */
KVP_API int kvp_device_create(const kvp_device_opts *opts,
                              const kvp_allocator *alloc, kvp_device **out);
/* Waits for all work the device queued, releases everything.  NULL is a
 * no-op.  Every layout, stream and event of the device must be destroyed
 * first. */
KVP_API void kvp_device_destroy(kvp_device *dev);

/* Where this device's calibration came from: 0 none (CPU backend,
 * KVP_DEVICE_NO_CALIBRATE), 1 measured at creation, 2 read from the
 * calibration cache. */
KVP_API int kvp_device_calibration_source(const kvp_device *dev);

KVP_API kvp_backend kvp_device_backend(const kvp_device *dev);
/* "cpu", "NVIDIA H100 80GB HBM3 (sm_90, cubin)", ...; lives as long as dev. */
KVP_API const char *kvp_device_name(const kvp_device *dev);

/* The backend's own code behind the last KVP_EGPU this device returned (a
 * CUresult or hipError_t; 0 if none) and, when name is not NULL, its symbolic
 * name ("CUDA_ERROR_OUT_OF_MEMORY").  Returns that code.  Per device, not per
 * thread: read it right after the failing call. */
KVP_API int kvp_device_native_error(const kvp_device *dev, const char **name);

/* ---- tunables (zstd ZSTD_CCtx_setParameter style) -------------------------- */
typedef enum kvp_device_opt {
  KVP_DEVOPT_CTA_BUDGET = 1,    /* 1 .. 1024; default 16 */
  KVP_DEVOPT_THREADS_PER_CTA = 2 /* 64 .. 1024, multiple of 32; default 512 */
} kvp_device_opt;
/* Returns 0, KVP_EINVAL (unknown option) or KVP_ERANGE (out of bounds). */
KVP_API int kvp_device_set(kvp_device *dev, kvp_device_opt opt, int64_t value);
KVP_API int kvp_device_get(const kvp_device *dev, kvp_device_opt opt,
                           int64_t *value);
KVP_API int kvp_device_opt_bounds(kvp_device_opt opt, int64_t *lo, int64_t *hi);

/* ---- memory ------------------------------------------------------------------ */
/* Device memory (CPU backend: host memory, 64-byte aligned).  Free with
 * kvp_device_free.  Returns 0, KVP_EINVAL, KVP_ENOMEM or KVP_EGPU. */
KVP_API int kvp_device_alloc(kvp_device *dev, size_t bytes, void **out);
KVP_API void kvp_device_free(kvp_device *dev, void *ptr); /* NULL: no-op */

/* Pins [ptr, ptr+bytes) of ordinary host memory (any allocator: malloc,
 * mmap, a DRAM pool) and maps it into the device, so it can serve as staging
 * or as an engine tensor (SGLang's host pools).  The memory must stay
 * allocated until kvp_device_host_unregister.  Ranges must not overlap.  A
 * no-op on the CPU backend.  Returns 0, KVP_EINVAL, KVP_EEXIST (overlaps a
 * registered range), KVP_EGPU (e.g. CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
 * when another library pinned it). */
KVP_API int kvp_device_host_register(kvp_device *dev, void *ptr, size_t bytes);
/* ptr as given to register.  Returns 0 or KVP_ENOENT. */
KVP_API int kvp_device_host_unregister(kvp_device *dev, void *ptr);

/* Copy between any two of: host memory, registered host memory, device
 * memory.  Queued after the work on the device's own stream and complete
 * when it returns.  For tests and set-up, not the hot path. */
KVP_API int kvp_device_memcpy(kvp_device *dev, void *dst, const void *src,
                              size_t bytes);

/* Blocks until the work queued on the device's own stream (the NULL
 * kvp_stream) is done.  0, KVP_EGPU, or KVP_EINVAL once for a scatter with
 * KVP_XFER_IDS_UNIQUE whose ids repeated (found on the GPU; it copied
 * nothing). */
KVP_API int kvp_device_synchronize(kvp_device *dev);

/* ---- streams and events ------------------------------------------------------ */
typedef struct kvp_stream kvp_stream;
typedef struct kvp_event kvp_event;

/* A new non-blocking stream (CPU: operations complete before they return). */
KVP_API int kvp_stream_create(kvp_device *dev, kvp_stream **out);
/* Wraps an engine's stream (a CUstream / cudaStream_t / hipStream_t) without
 * owning it, so transfers order with the engine's own kernels.  NULL is the
 * default stream (what torch.cuda.current_stream().cuda_stream returns by
 * default): CUDA's legacy stream; KVP_ENOTSUP on HIP (pass a real stream). */
KVP_API int kvp_stream_wrap(kvp_device *dev, void *native, kvp_stream **out);
KVP_API void kvp_stream_destroy(kvp_stream *s); /* waits for it; NULL: no-op */
/* Blocks until the stream's work is done.  0, KVP_EGPU, or KVP_EINVAL as
 * kvp_device_synchronize. */
KVP_API int kvp_stream_synchronize(kvp_stream *s);
/* 0 when done, KVP_EBUSY while work is pending, KVP_EGPU on failure. */
KVP_API int kvp_stream_query(kvp_stream *s);

KVP_API int kvp_event_create(kvp_device *dev, kvp_event **out);
KVP_API void kvp_event_destroy(kvp_event *e);
/* Records e at the current tail of s (NULL s = the device's own stream). */
KVP_API int kvp_event_record(kvp_event *e, kvp_stream *s);
/* Makes s wait for e (both directions at once: one stream per direction,
 * joined by events). */
KVP_API int kvp_stream_wait_event(kvp_stream *s, kvp_event *e);
KVP_API int kvp_event_synchronize(kvp_event *e);
KVP_API int kvp_event_query(kvp_event *e); /* 0 done, KVP_EBUSY pending */
/* Nanoseconds between two completed events.  0 or KVP_EGPU. */
KVP_API int kvp_event_elapsed_ns(kvp_event *start, kvp_event *end,
                                 uint64_t *ns);

/* ---- KV layouts ------------------------------------------------------------- */
typedef enum kvp_layout_kind {
  /* vLLM flash-attention, one tensor per layer and per K/V:
   * k_layers[l], v_layers[l] = [num_blocks, block_size, kv_heads, head_dim] */
  KVP_LAYOUT_VLLM_NHD = 1,
  /* vLLM flash-attention, one tensor per layer holding both:
   * k_layers[l] = [2, num_blocks, block_size, kv_heads, head_dim] */
  KVP_LAYOUT_VLLM_NHD_KV = 2,
  /* heads-major: [num_blocks, kv_heads, block_size, head_dim] per K and V */
  KVP_LAYOUT_VLLM_HND = 3,
  /* [2, num_blocks, kv_heads, block_size, head_dim] per layer */
  KVP_LAYOUT_VLLM_HND_KV = 4,
  /* one tensor, block-major across layers (vLLM's cross-layer / LMCache):
   * base = [num_blocks, layers, 2, block_size, kv_heads, head_dim] */
  KVP_LAYOUT_CROSS_LAYER = 5,
  /* MLA latent cache (DeepSeek): k_layers[l] = [num_blocks, block_size,
   * head_dim]; head_dim = latent dim (kv_lora_rank + rope dim), kv_heads = 1 */
  KVP_LAYOUT_MLA = 6,
  /* SGLang host pool, layer first (MHATokenToKVPoolHost "layer_first"):
   * base = [2, layers, num_blocks * block_size, kv_heads, head_dim] */
  KVP_LAYOUT_SGLANG_LAYER_FIRST = 7,
  /* SGLang host pool, page first ("page_first"):
   * base = [2, num_blocks * block_size, layers, kv_heads, head_dim] */
  KVP_LAYOUT_SGLANG_PAGE_FIRST = 8,
  /* SGLang MLA host pool: [layers, num_blocks * block_size, 1, head_dim] */
  KVP_LAYOUT_SGLANG_MLA_LAYER_FIRST = 9,
  /* SGLang MLA host pool: [num_blocks * block_size, layers, 1, head_dim] */
  KVP_LAYOUT_SGLANG_MLA_PAGE_FIRST = 10
} kvp_layout_kind;

/* Short name ("vllm_nhd", "cross_layer", ...), NULL when unknown. */
KVP_API const char *kvp_layout_kind_name(kvp_layout_kind k);

/* Describes an engine's paged KV cache.  Tensors are dense row-major with the
 * shapes above.  k_layers / v_layers are arrays of num_layers pointers,
 * copied at kvp_kv_layout_create; `base` is the single tensor of the
 * one-tensor kinds. */
typedef struct kvp_kv_layout_desc {
  kvp_layout_kind kind;
  uint32_t num_layers;
  uint32_t num_blocks;   /* pages in the cache; block ids are 0 .. num_blocks-1 */
  uint32_t block_size;   /* tokens per page */
  uint32_t num_kv_heads; /* 1 for the MLA kinds */
  uint32_t head_dim;     /* elements; the latent dim for the MLA kinds */
  uint32_t elem_size;    /* bytes per element: 1 (fp8), 2 (bf16/fp16), 4 */
  uint32_t reserved0;
  void *const *k_layers; /* VLLM_NHD, VLLM_HND: K per layer; *_KV, MLA: the tensor */
  void *const *v_layers; /* VLLM_NHD, VLLM_HND: V per layer; else NULL */
  void *base;            /* CROSS_LAYER, SGLANG_*: the one tensor; else NULL */
  uint64_t reserved[6];
} kvp_kv_layout_desc;

typedef struct kvp_kv_layout kvp_kv_layout;

/* Validates desc against the device (sizes overflow-checked, pointers not
 * NULL, every tensor inside device memory or a registered host range on GPU
 * backends) and uploads its chunk table.  Returns 0, KVP_EINVAL (with a
 * warning logged naming the field), KVP_ERANGE (sizes beyond 2^32 chunks or
 * 2^48 bytes), KVP_ENOMEM, KVP_EGPU. */
KVP_API int kvp_kv_layout_create(kvp_device *dev, const kvp_kv_layout_desc *desc,
                                 kvp_kv_layout **out);
KVP_API void kvp_kv_layout_destroy(kvp_kv_layout *l); /* NULL: no-op */

/* What the layout reduces to (see the top of this file). */
typedef struct kvp_kv_layout_info {
  uint64_t block_bytes;  /* staging bytes per block = n_chunks * chunk_bytes */
  uint64_t chunk_bytes;  /* contiguous bytes per chunk */
  uint64_t block_stride; /* bytes between block b and b+1 inside a chunk's tensor */
  uint32_t n_chunks;
  uint32_t num_blocks;
  uint32_t vector_bytes; /* widest access all chunks allow: 16, 8, 4, 2 or 1 */
  uint32_t reserved[5];
} kvp_kv_layout_info;
KVP_API int kvp_kv_layout_info_get(const kvp_kv_layout *l,
                                   kvp_kv_layout_info *out);

/* ---- gather / scatter ------------------------------------------------------- */
typedef enum kvp_xfer_method {
  KVP_XFER_AUTO = 0,        /* per page size, from the calibrated crossover */
  KVP_XFER_KERNEL = 1,      /* the gather/scatter kernel (zero-copy for host) */
  KVP_XFER_COPY_ENGINE = 2  /* cuMemcpy2DAsync over runs of adjacent blocks */
} kvp_xfer_method;

/* kvp_xfer.flags.
 * KVP_XFER_IDS_UNIQUE: the caller knows block_ids holds no id twice (an
 * engine's block table is unique by construction), so a scatter skips the
 * host's repeat check (7-12 us of a call for 8,192 ids on the H100
 * machine's CPU).  On the CUDA backend with the kernel method, a small
 * kernel queued before the copy checks on the GPU instead: if an id does
 * repeat, NOTHING is copied and the error arrives later, once: the next
 * kvp_stream_synchronize or kvp_device_synchronize (of any stream of the
 * device) returns KVP_EINVAL.  The check is exact unless another flagged
 * scatter into the same layout runs at the same time on another stream.
 * Other backends, and the copy-engine method, check on the host as without
 * the flag (the call itself returns KVP_EINVAL).  Gathers ignore it. */
#define KVP_XFER_IDS_UNIQUE 1u

typedef struct kvp_xfer {
  const kvp_kv_layout *layout;
  const uint32_t *block_ids; /* host array of n ids, < layout's num_blocks;
                              * repeats allowed in gather, rejected in scatter */
  uint32_t n;
  uint32_t method; /* kvp_xfer_method */
  void *staging;   /* device pointer or registered host memory */
  uint64_t staging_bytes; /* capacity; must hold every slot used */
  /* Optional: block i goes to staging slot staging_slots[i] (a DRAM pool's
   * slots); NULL = slot i.  Repeated slots are rejected in gather. */
  const uint32_t *staging_slots;
  uint32_t flags;  /* KVP_XFER_* */
  uint32_t reserved32;
  uint64_t reserved[3];
} kvp_xfer;

/* Queue a gather (engine cache -> staging) or scatter (staging -> engine
 * cache) on stream s (NULL = the device's own stream).  Everything is
 * validated before anything is queued: an out-of-range id or slot, a repeat
 * where forbidden, a short staging buffer -> KVP_EINVAL / KVP_ERANGE and
 * nothing is copied.  The host arrays may be reused when the call returns;
 * staging and the cache must stay valid until the stream reaches this point.
 * Returns the method used (KVP_XFER_KERNEL or KVP_XFER_COPY_ENGINE, > 0) or
 * a negative code (KVP_EGPU: kvp_device_native_error). */
KVP_API int kvp_device_gather(kvp_device *dev, kvp_stream *s,
                              const kvp_xfer *x);
KVP_API int kvp_device_scatter(kvp_device *dev, kvp_stream *s,
                               const kvp_xfer *x);

/* ---- measured bandwidths ------------------------------------------------------ */
typedef enum kvp_xfer_dir {
  KVP_DIR_H2D = 0, /* host staging -> device cache (scatter)  */
  KVP_DIR_D2H = 1, /* device cache -> host staging (gather)   */
  KVP_DIR_D2D = 2, /* device <-> device                       */
  KVP_DIR_COUNT_ = 3
} kvp_xfer_dir;

/* Bandwidths measured at start-up (16 MiB of random pages per sample, best
 * of two after a warm-up, kernel with the device's CTA budget at creation),
 * for the router's cost model and kvtier's admission gate. */
typedef struct kvp_device_bandwidth {
  double kernel_gbps;      /* gather/scatter kernel, GB/s (1e9 B/s) */
  double copy_engine_gbps; /* cuMemcpy2DAsync over merged runs */
  double best_gbps;        /* of the method AUTO picks at this size */
  uint32_t auto_method;    /* kvp_xfer_method AUTO picks at this size */
  uint32_t measured;       /* 1 if measured, 0 if not calibrated (CPU,
                            * KVP_DEVICE_NO_CALIBRATE): figures are 0 */
  uint32_t reserved[4];
} kvp_device_bandwidth;

/* Interpolated in log(page size) between the calibrated sizes (4 KiB ..
 * 1 MiB), clamped outside.  D2D is not calibrated (measured = 0).
 * Returns 0 or KVP_EINVAL.  Thread-safe. */
KVP_API int kvp_device_bandwidth_get(const kvp_device *dev, kvp_xfer_dir dir,
                                     uint64_t page_bytes,
                                     kvp_device_bandwidth *out);

/* The public records are ABI: their sizes are fixed (LP64). */
#ifdef __cplusplus
#define KVP_DEVICE_STATIC_ASSERT_(c, m) static_assert(c, m)
#else
#define KVP_DEVICE_STATIC_ASSERT_(c, m) _Static_assert(c, m)
#endif
#if UINTPTR_MAX == 0xffffffffffffffffu
KVP_DEVICE_STATIC_ASSERT_(sizeof(kvp_device_opts) == 48, "kvp_device_opts is ABI");
KVP_DEVICE_STATIC_ASSERT_(sizeof(kvp_kv_layout_desc) == 104, "kvp_kv_layout_desc is ABI");
KVP_DEVICE_STATIC_ASSERT_(sizeof(kvp_kv_layout_info) == 56, "kvp_kv_layout_info is ABI");
KVP_DEVICE_STATIC_ASSERT_(sizeof(kvp_xfer) == 80, "kvp_xfer is ABI");
KVP_DEVICE_STATIC_ASSERT_(sizeof(kvp_device_bandwidth) == 48, "kvp_device_bandwidth is ABI");
#endif

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_DEVICE_H */
