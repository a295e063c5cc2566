/* SPDX-License-Identifier: Apache-2.0 */
/* kernels internals: the device object, the backend operations table every
 * backend (kernels_cpu.c, cuda/, hip/) fills, layouts reduced to chunk
 * tables, and the transfer plan handed to a backend after validation.
 *
 * Invariants: a plan reaching a backend is valid (every id < num_blocks,
 * every slot inside the staging buffer, no scatter repeat, pointers
 * translated to device addresses); backends never validate again.  Device
 * addresses are uint64_t everywhere below the public API. */
#ifndef KVP_KERNELS_INTERNAL_H
#define KVP_KERNELS_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "core_internal.h"
#include "kernels_args.h"
#include "kernels_config.h"
#include "kvplane/device.h"

#define KVP_KERNELS_MOD "kernels"
/* The CTA budget's bound (KVP_DEVOPT_CTA_BUDGET); the CUDA backend keeps
 * a release word per CTA for each launch-argument slot. */
#define KVP__MAX_CTAS 1024u

/* Submit-path trace points (a build with -DKVP_SUBMIT_TRACE only; nothing
 * otherwise): the clock at each stage of the last gather / scatter call, for
 * bench_kernels' per-stage breakdown.  Written with the device lock held. */
enum {
  KVP_TR_ENTRY,    /* xfer() entered */
  KVP_TR_LOCKED,   /* device lock taken */
  KVP_TR_SLOT,     /* launch-argument slot taken (backend) */
  KVP_TR_IDS,      /* ids copied + range-checked (and slots) */
  KVP_TR_REPEATS,  /* repeat checks done */
  KVP_TR_VALID,    /* validation done (staging translated) */
  KVP_TR_LAUNCH0,  /* backend: about to launch */
  KVP_TR_LAUNCHED, /* backend: launch call returned */
  KVP_TR_DONE,     /* lock released */
  KVP_TR_N
};
#ifdef KVP_SUBMIT_TRACE
extern uint64_t kvp__submit_trace[KVP_TR_N];
#define KVP_TRACE(i) (kvp__submit_trace[i] = kvp_now_ns())
#else
#define KVP_TRACE(i) ((void)0)
#endif

/* Calibrated page sizes: 4 KiB << i, i < KVP_CAL_SIZES (4 KiB .. 1 MiB). */
#define KVP_CAL_SIZES 9

typedef struct kvp__host_reg {
  uintptr_t host;
  uint64_t bytes;
  uint64_t dptr; /* device address of host */
} kvp__host_reg;

/* One validated transfer, addresses already on the device side. */
typedef struct kvp__plan {
  const struct kvp_kv_layout *layout;
  const uint32_t *ids;   /* host array */
  const uint32_t *slots; /* host array or NULL */
  uint32_t n;
  bool scatter;
  bool staging_is_host; /* registered host memory (kernel reads it mapped) */
  uint64_t staging;     /* device address */
  void *stream;         /* backend stream handle (NULL = device's own) */
  /* GPU backends: the launch-argument slot the ids (then the slots) were
   * copied into while being validated; NULL = run_kernel copies them. */
  void *arg_slot;
  /* scatter with KVP_XFER_IDS_UNIQUE, host check skipped: run_kernel queues
   * the GPU repeat check before the copy */
  bool gpu_repeat_check;
} kvp__plan;

typedef struct kvp__dev_ops {
  /* The handle kvp_stream_wrap(dev, NULL) stands for: the runtime's legacy
   * default stream (CUDA: CU_STREAM_LEGACY).  NULL: not wrappable. */
  void *legacy_stream;
  int (*open)(struct kvp_device *d, const kvp_device_opts *o);
  void (*close)(struct kvp_device *d);
  int (*alloc)(struct kvp_device *d, size_t bytes, uint64_t *out);
  void (*free)(struct kvp_device *d, uint64_t p);
  int (*host_register)(struct kvp_device *d, void *p, size_t bytes,
                       uint64_t *dptr);
  int (*host_unregister)(struct kvp_device *d, void *p);
  /* 0 if [addr, addr+bytes) is device memory of this device, KVP_EINVAL if not */
  int (*check_device_range)(struct kvp_device *d, uint64_t addr, uint64_t bytes);
  int (*memcpy)(struct kvp_device *d, void *dst, const void *src, size_t n);
  int (*stream_create)(struct kvp_device *d, void **out);
  void (*stream_destroy)(struct kvp_device *d, void *s);
  int (*stream_sync)(struct kvp_device *d, void *s);
  int (*stream_query)(struct kvp_device *d, void *s);
  int (*stream_wait)(struct kvp_device *d, void *s, void *e);
  int (*event_create)(struct kvp_device *d, void **out);
  void (*event_destroy)(struct kvp_device *d, void *e);
  int (*event_record)(struct kvp_device *d, void *e, void *s);
  int (*event_sync)(struct kvp_device *d, void *e);
  int (*event_query)(struct kvp_device *d, void *e);
  int (*event_elapsed)(struct kvp_device *d, void *a, void *b, uint64_t *ns);
  /* Upload the layout's chunk table; sets l->chunk_table_dev. */
  int (*layout_upload)(struct kvp_device *d, struct kvp_kv_layout *l);
  void (*layout_release)(struct kvp_device *d, struct kvp_kv_layout *l);
  /* Optional: a launch-argument slot of `entries` uint32 (mapped pinned
   * memory the kernel reads), free of earlier work. */
  int (*args_take)(struct kvp_device *d, size_t entries, uint32_t **host,
                   void **slot);
  int (*run_kernel)(struct kvp_device *d, const kvp__plan *p);
  /* Whether run_kernel can check a scatter's ids for repeats on the GPU
   * (kvp__plan.gpu_repeat_check). */
  bool gpu_repeat_check;
  /* Optional, device lock held: a repeat the GPU found in a finished
   * scatter not reported yet -> KVP_EINVAL (once), else 0.  Called after
   * every successful stream/device synchronize. */
  int (*async_error)(struct kvp_device *d);
  int (*run_copy_engine)(struct kvp_device *d, const kvp__plan *p);
  /* Whether kvp__calibrate measures this backend at creation. */
  bool calibrate;
  /* Optional: the device's identity for the calibration cache: *key gets
   * what must match for a cached calibration to be used (UUID, PCI bus,
   * driver version, name, XXH3 of the device code it loads), *tag a short
   * file-name-safe id (the UUID).
   * 0 or an error (then nothing is cached). */
  int (*identity)(struct kvp_device *d, char *key, size_t key_cap, char *tag,
                  size_t tag_cap);
} kvp__dev_ops;

struct kvp_device {
  kvp_backend backend;
  const kvp__dev_ops *ops;
  kvp_allocator alloc;
  pthread_mutex_t mu; /* serializes every call on the device */
  char name[160];
  uint32_t cta_budget;
  uint32_t threads_per_cta;
  int native_err;              /* last CUresult / hipError_t */
  const char *native_err_name; /* static string from the driver or ours */
  /* registered host ranges, sorted by host address */
  kvp__host_reg *regs;
  size_t n_regs, cap_regs;
  /* scratch bitmap for repeat checks (bits), grown on demand */
  uint64_t *bitmap;
  size_t bitmap_words;
  /* calibration: [dir][size][method-1] GB/s; dir H2D/D2H */
  double bw[2][KVP_CAL_SIZES][2];
  bool calibrated;
  int calibration_source; /* kvp_device_calibration_source() */
  void *priv; /* the backend's state */
};

struct kvp_kv_layout {
  kvp_device *dev;
  kvp_kv_layout_desc desc; /* k_layers/v_layers point into our copies */
  kvp_kv_layout_info info;
  uint64_t *chunk_base;     /* host copy: n_chunks device addresses */
  bool *chunk_is_host;      /* chunk tensor lives in registered host memory */
  bool any_host;
  uint64_t chunk_table_dev; /* device copy (GPU backends) */
  /* GPU repeat check (KVP_XFER_IDS_UNIQUE): num_blocks uint64 owner entries
   * in device memory, zeroed, made on first use (CUDA) */
  uint64_t repeat_owner_dev;
  /* scatter repeat check: stamp[id] == stamp_gen means seen in this call */
  uint8_t *stamp;
  uint8_t stamp_gen;
};

/* The calibration cache (kernels_calcache.c). */
#define KVP_CALCACHE_KEY_MAX 511
int kvp__calcache_format(const char *key, const double bw[2][KVP_CAL_SIZES][2],
                         char *out, size_t cap);
/* 0 (bw filled), KVP_ENOENT (valid file, other key or sizes: stale),
 * KVP_EINVAL (malformed; why says where). */
int kvp__calcache_parse(const char *text, size_t len, const char *key,
                        double bw[2][KVP_CAL_SIZES][2], char *why, size_t cap);
/* As parse, from a file; KVP_ENOENT also when it does not exist, -errno. */
int kvp__calcache_load(const char *path, const char *key,
                       double bw[2][KVP_CAL_SIZES][2], char *why, size_t cap);
/* Writes atomically (temporary file + rename; creates the directory).
 * 0 or -errno / KVP_EINVAL. */
int kvp__calcache_save(const char *path, const char *key,
                       const double bw[2][KVP_CAL_SIZES][2]);
/* The file for a device: explicit_path as is, else
 * $KVP_CALIBRATION_CACHE/calibration-<tag>.txt, else
 * $XDG_CACHE_HOME/kvplane/..., else $HOME/.cache/kvplane/...; KVP_ENOENT
 * when none is set. */
int kvp__calcache_path(const char *explicit_path, const char *device_tag,
                       char *out, size_t cap);

/* Backends. */
extern const kvp__dev_ops kvp__cpu_ops;
extern const kvp__dev_ops kvp__cuda_ops;
extern const kvp__dev_ops kvp__hip_ops;
/* Probe: 1 available, 0 not (why filled). */
int kvp__cuda_probe(char *why, size_t cap);
int kvp__hip_probe(char *why, size_t cap);

/* Kernel vs copy engine per page size and direction (kernels_calibrate.c):
 * fills d->bw, sets d->calibrated. */
int kvp__calibrate(struct kvp_device *d);

/* Record a native error on the device and return KVP_EGPU. */
int kvp__dev_native_fail(kvp_device *d, int code, const char *name,
                         const char *what);

/* The kernel launch for plan p: its argument (ids/slots at device addresses
 * ids_dev / slots_dev), the kernel index by access width (0: 16 bytes ..
 * 4: 1 byte) and the grid size within the device's CTA budget. */
typedef struct kvp__launch {
  kvp_copy_args args;
  unsigned width_index;
  unsigned ctas, threads;
} kvp__launch;
void kvp__launch_plan(const kvp_device *d, const kvp__plan *p, uint64_t ids_dev,
                      uint64_t slots_dev, kvp__launch *out);

/* Widest power-of-two access (<= 16) dividing every value given. */
uint32_t kvp__vector_width(const uint64_t *vals, size_t n);

/* The submit path's passes over n ids (kernels_ids.c): the max, and dst = src
 * returning the max (dst is a launch-argument slot: streaming stores, fenced
 * before return).  The dispatching entry points pick the build for this CPU;
 * the builds themselves are here for test_kernels_ids. */
uint32_t kvp__ids_max(const uint32_t *v, uint32_t n);
uint32_t kvp__ids_copy_max(uint32_t *restrict dst, const uint32_t *restrict src,
                           uint32_t n);
uint32_t kvp__ids_max_generic(const uint32_t *v, uint32_t n);
uint32_t kvp__ids_copy_max_generic(uint32_t *restrict dst,
                                   const uint32_t *restrict src, uint32_t n);
bool kvp__ids_have_avx2(void); /* false off x86-64 */
/* Repeat check against byte stamps: stamps every id with gen, true when no
 * id of the list repeats (st[id] != gen for each first sighting). */
bool kvp__ids_stamp_unique(uint8_t *restrict st, uint8_t gen,
                           const uint32_t *restrict ids, uint32_t n);
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
uint32_t kvp__ids_max_avx2(const uint32_t *v, uint32_t n);
uint32_t kvp__ids_copy_max_avx2(uint32_t *restrict dst,
                                const uint32_t *restrict src, uint32_t n);
#endif

#endif /* KVP_KERNELS_INTERNAL_H */
