/* SPDX-License-Identifier: Apache-2.0 */
/* The HIP backend: libamdhip64.so through dlopen, the embedded offload
 * bundle (gfx90a, gfx942 where the build's clang knows it) loaded with
 * hipModuleLoadData, launches with hipModuleLaunchKernel, the copy-engine
 * path through hipMemcpy2DAsync.  Same structure as cuda/cuda_backend.c;
 * calibrated by kernels_calibrate.c like it.
 *
 * Not yet run on AMD hardware (none here): the test suite skips it with the
 * reason kvp_backend_available gives. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "kernels_args.h"
#include "kernels_internal.h"
#include "kernels_ring.h"

/* generated: one raw code object per gfx target (hip_code_objects.c) */
struct kvp__hip_co {
  const char *arch;
  const unsigned char *data;
  const size_t *size;
};
extern const struct kvp__hip_co kvp__hip_code_objects[];
extern const size_t kvp__hip_n_code_objects;

typedef int hipError_t;
typedef struct ihipStream_t *hipStream_t;
typedef struct ihipEvent_t *hipEvent_t;
typedef struct ihipModule_t *hipModule_t;
typedef struct ihipModuleSymbol_t *hipFunction_t;
#define hipSuccess 0
#define hipErrorNotReady 600
#define hipMemcpyDefault 4
#define hipHostRegisterPortable 0x1
#define hipHostRegisterMapped 0x2
#define hipHostMallocPortable 0x1
#define hipHostMallocMapped 0x2
#define hipStreamNonBlocking 0x1
#define hipEventDisableTiming 0x2
/* HIP_POINTER_ATTRIBUTE_* mirror CUDA's numbering; hipMemoryType changed
 * between ROCm 5 and 6, so the device check relies on ordinal + range. */
#define HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define HIP_POINTER_ATTRIBUTE_RANGE_START_ADDR 11
#define HIP_POINTER_ATTRIBUTE_RANGE_SIZE 12

#define KVP_HIP_FUNCS(X)                                                        \
  X(hipInit, (unsigned))                                                        \
  X(hipGetDeviceCount, (int *))                                                 \
  X(hipSetDevice, (int))                                                        \
  X(hipDeviceGetName, (char *, int, int))                                       \
  X(hipModuleLoadData, (hipModule_t *, const void *))                           \
  X(hipModuleUnload, (hipModule_t))                                             \
  X(hipModuleGetFunction, (hipFunction_t *, hipModule_t, const char *))         \
  X(hipModuleLaunchKernel,                                                      \
    (hipFunction_t, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, \
     unsigned, hipStream_t, void **, void **))                                  \
  X(hipMalloc, (void **, size_t))                                               \
  X(hipFree, (void *))                                                          \
  X(hipHostMalloc, (void **, size_t, unsigned))                                 \
  X(hipHostFree, (void *))                                                      \
  X(hipHostRegister, (void *, size_t, unsigned))                                \
  X(hipHostUnregister, (void *))                                                \
  X(hipHostGetDevicePointer, (void **, void *, unsigned))                       \
  X(hipPointerGetAttribute, (void *, int, void *))                              \
  X(hipMemcpy, (void *, const void *, size_t, int))                             \
  X(hipMemcpyAsync, (void *, const void *, size_t, int, hipStream_t))           \
  X(hipMemcpy2DAsync, (void *, size_t, const void *, size_t, size_t, size_t,    \
                       int, hipStream_t))                                       \
  X(hipStreamCreateWithFlags, (hipStream_t *, unsigned))                        \
  X(hipStreamDestroy, (hipStream_t))                                            \
  X(hipStreamSynchronize, (hipStream_t))                                        \
  X(hipStreamQuery, (hipStream_t))                                              \
  X(hipStreamWaitEvent, (hipStream_t, hipEvent_t, unsigned))                    \
  X(hipEventCreateWithFlags, (hipEvent_t *, unsigned))                          \
  X(hipEventDestroy, (hipEvent_t))                                              \
  X(hipEventRecord, (hipEvent_t, hipStream_t))                                  \
  X(hipEventSynchronize, (hipEvent_t))                                          \
  X(hipEventQuery, (hipEvent_t))                                                \
  X(hipEventElapsedTime, (float *, hipEvent_t, hipEvent_t))

static struct {
#define KVP_HIP_FIELD_(name, args) hipError_t(*name) args;
  KVP_HIP_FUNCS(KVP_HIP_FIELD_)
#undef KVP_HIP_FIELD_
  const char *(*hipGetErrorName)(hipError_t);
} hip;

int kvp__hip_probe(char *why, size_t cap) {
  if (!kvp__have_hip_kernels) {
    snprintf(why, cap, "built without HIP code objects (%s)", kvp__hip_build_note);
    return 0;
  }
  static const char *const libs[] = {"libamdhip64.so", "libamdhip64.so.6",
                                     "libamdhip64.so.5"};
  void *lib = NULL;
  for (size_t i = 0; !lib && i < sizeof libs / sizeof libs[0]; i++)
    lib = dlopen(libs[i], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(why, cap, "no ROCm runtime: %s", dlerror());
    return 0;
  }
#define KVP_HIP_LOAD_(name, args)                                               \
  *(void **)&hip.name = dlsym(lib, #name);                                      \
  if (!hip.name) {                                                              \
    snprintf(why, cap, "libamdhip64 lacks %s", #name);                          \
    return 0;                                                                   \
  }
  KVP_HIP_FUNCS(KVP_HIP_LOAD_)
#undef KVP_HIP_LOAD_
  *(void **)&hip.hipGetErrorName = dlsym(lib, "hipGetErrorName");
  int n = 0;
  if (hip.hipInit(0) != hipSuccess || hip.hipGetDeviceCount(&n) != hipSuccess ||
      n == 0) {
    snprintf(why, cap, "no AMD GPU (hipGetDeviceCount: %d devices)", n);
    return 0;
  }
  snprintf(why, cap, "%d HIP device(s); code objects for %s", n, kvp__hip_archs);
  return 1;
}

#define RING KVP__RING
static const unsigned widths[5] = {16, 8, 4, 2, 1};

typedef struct hip_dev {
  int ordinal;
  hipModule_t mod;
  hipFunction_t fn[5];
  hipStream_t own;
  kvp__ring ring;        /* launch-argument slots (kernels_ring.h) */
  hipEvent_t done[RING]; /* recorded after each slot's last launch */
} hip_dev;

#define HD(d) ((hip_dev *)(d)->priv)

static int fail(kvp_device *d, hipError_t r, const char *what) {
  return kvp__dev_native_fail(d, r, hip.hipGetErrorName ? hip.hipGetErrorName(r)
                                                        : NULL, what);
}
#define HK(d, call)                                                             \
  do {                                                                          \
    hipError_t r_ = (call);                                                     \
    if (r_ != hipSuccess)                                                       \
      return fail(d, r_, #call);                                                \
  } while (0)

static int set_dev(kvp_device *d) {
  HK(d, hip.hipSetDevice(HD(d)->ordinal));
  return 0;
}

static const kvp__ring_ops ring_ops;

static void hip_close(kvp_device *d) {
  hip_dev *h = HD(d);
  if (!h)
    return;
  hip.hipSetDevice(h->ordinal);
  if (h->own)
    hip.hipStreamSynchronize(h->own);
  for (int i = 0; i < RING; i++)
    if (h->done[i])
      hip.hipEventDestroy(h->done[i]);
  kvp__ring_free(d, &h->ring, &ring_ops, false);
  if (h->own)
    hip.hipStreamDestroy(h->own);
  if (h->mod)
    hip.hipModuleUnload(h->mod);
  kvp__free(&d->alloc, h, sizeof *h);
  d->priv = NULL;
}

static int hip_open(kvp_device *d, const kvp_device_opts *o) {
  hip_dev *h = kvp__calloc(&d->alloc, 1, sizeof *h);
  if (!h)
    return KVP_ENOMEM;
  d->priv = h;
  int n = 0, rc = 0;
  hip.hipGetDeviceCount(&n);
  if (o->ordinal >= n) {
    rc = KVP_ERANGE;
    goto out;
  }
  h->ordinal = o->ordinal;
  char name[96] = "?";
  hipError_t r;
  if ((r = hip.hipSetDevice(h->ordinal))) {
    rc = fail(d, r, "hipSetDevice");
    goto out;
  }
  /* the first embedded code object this GPU accepts */
  const char *arch = NULL;
  r = 1;
  for (size_t i = 0; r != hipSuccess && i < kvp__hip_n_code_objects; i++) {
    r = hip.hipModuleLoadData(&h->mod, kvp__hip_code_objects[i].data);
    arch = kvp__hip_code_objects[i].arch;
  }
  if (r != hipSuccess) {
    rc = fail(d, r, "hipModuleLoadData (no code object for this GPU)");
    goto out;
  }
  if ((r = hip.hipStreamCreateWithFlags(&h->own, hipStreamNonBlocking))) {
    rc = fail(d, r, "hipStreamCreateWithFlags");
    goto out;
  }
  for (int i = 0; i < 5 && rc >= 0; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "kvp_copy_w%u", widths[i]);
    if ((r = hip.hipModuleGetFunction(&h->fn[i], h->mod, nm)))
      rc = fail(d, r, "hipModuleGetFunction");
  }
  for (int i = 0; i < RING && rc >= 0; i++)
    if ((r = hip.hipEventCreateWithFlags(&h->done[i], hipEventDisableTiming)))
      rc = fail(d, r, "hipEventCreateWithFlags");
  hip.hipDeviceGetName(name, sizeof name, h->ordinal);
  snprintf(d->name, sizeof d->name, "%s (HIP, %s code object)", name, arch);
out:
  if (rc < 0)
    hip_close(d);
  return rc;
}

static int hip_alloc(kvp_device *d, size_t n, uint64_t *out) {
  void *p = NULL;
  int rc = set_dev(d);
  if (rc < 0)
    return rc;
  HK(d, hip.hipMalloc(&p, n));
  *out = (uint64_t)(uintptr_t)p;
  return 0;
}
static void hip_free(kvp_device *d, uint64_t p) {
  if (set_dev(d) == 0)
    hip.hipFree((void *)(uintptr_t)p);
}
static int hip_host_register(kvp_device *d, void *p, size_t n, uint64_t *dp) {
  int rc = set_dev(d);
  if (rc < 0)
    return rc;
  HK(d, hip.hipHostRegister(p, n, hipHostRegisterPortable | hipHostRegisterMapped));
  void *dptr = NULL;
  hipError_t r = hip.hipHostGetDevicePointer(&dptr, p, 0);
  if (r != hipSuccess) {
    hip.hipHostUnregister(p);
    return fail(d, r, "hipHostGetDevicePointer");
  }
  *dp = (uint64_t)(uintptr_t)dptr;
  return 0;
}
static int hip_host_unregister(kvp_device *d, void *p) {
  int rc = set_dev(d);
  if (rc < 0)
    return rc;
  HK(d, hip.hipHostUnregister(p));
  return 0;
}
static int hip_check_range(kvp_device *d, uint64_t a, uint64_t n) {
  int ord = -1;
  void *start = NULL;
  size_t size = 0;
  void *p = (void *)(uintptr_t)a;
  if (set_dev(d) < 0 ||
      hip.hipPointerGetAttribute(&ord, HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) ||
      ord != HD(d)->ordinal ||
      hip.hipPointerGetAttribute(&start, HIP_POINTER_ATTRIBUTE_RANGE_START_ADDR, p) ||
      hip.hipPointerGetAttribute(&size, HIP_POINTER_ATTRIBUTE_RANGE_SIZE, p))
    return KVP_EINVAL;
  uint64_t off = a - (uint64_t)(uintptr_t)start;
  return (off <= size && n <= size - off) ? 0 : KVP_EINVAL;
}
static int hip_memcpy(kvp_device *d, void *dst, const void *src, size_t n) {
  int rc = set_dev(d);
  if (rc < 0)
    return rc;
  HK(d, hip.hipMemcpyAsync(dst, src, n, hipMemcpyDefault, HD(d)->own));
  HK(d, hip.hipStreamSynchronize(HD(d)->own));
  return 0;
}

static hipStream_t S(kvp_device *d, void *s) { return s ? s : HD(d)->own; }

static int hip_stream_create(kvp_device *d, void **out) {
  hipStream_t s;
  int rc = set_dev(d);
  if (rc < 0)
    return rc;
  HK(d, hip.hipStreamCreateWithFlags(&s, hipStreamNonBlocking));
  *out = s;
  return 0;
}
static void hip_stream_destroy(kvp_device *d, void *s) {
  (void)d;
  hip.hipStreamDestroy(s);
}
static int hip_stream_sync(kvp_device *d, void *s) {
  HK(d, hip.hipStreamSynchronize(S(d, s)));
  return 0;
}
static int hip_stream_query(kvp_device *d, void *s) {
  hipError_t r = hip.hipStreamQuery(S(d, s));
  return r == hipSuccess ? 0 : r == hipErrorNotReady ? KVP_EBUSY
                                 : fail(d, r, "hipStreamQuery");
}
static int hip_stream_wait(kvp_device *d, void *s, void *e) {
  HK(d, hip.hipStreamWaitEvent(S(d, s), e, 0));
  return 0;
}
static int hip_event_create(kvp_device *d, void **out) {
  hipEvent_t e;
  HK(d, hip.hipEventCreateWithFlags(&e, 0));
  *out = e;
  return 0;
}
static void hip_event_destroy(kvp_device *d, void *e) {
  (void)d;
  hip.hipEventDestroy(e);
}
static int hip_event_record(kvp_device *d, void *e, void *s) {
  HK(d, hip.hipEventRecord(e, S(d, s)));
  return 0;
}
static int hip_event_sync(kvp_device *d, void *e) {
  HK(d, hip.hipEventSynchronize(e));
  return 0;
}
static int hip_event_query(kvp_device *d, void *e) {
  hipError_t r = hip.hipEventQuery(e);
  return r == hipSuccess ? 0 : r == hipErrorNotReady ? KVP_EBUSY
                                 : fail(d, r, "hipEventQuery");
}
static int hip_event_elapsed(kvp_device *d, void *a, void *b, uint64_t *ns) {
  float ms = 0;
  HK(d, hip.hipEventElapsedTime(&ms, a, b));
  *ns = ms > 0 ? (uint64_t)((double)ms * 1e6) : 0;
  return 0;
}

static int hip_layout_upload(kvp_device *d, kvp_kv_layout *l) {
  size_t n = l->info.n_chunks * sizeof(uint64_t);
  void *p = NULL;
  int rc = set_dev(d);
  if (rc < 0)
    return rc;
  HK(d, hip.hipMalloc(&p, n));
  hipError_t r = hip.hipMemcpy(p, l->chunk_base, n, hipMemcpyDefault);
  if (r != hipSuccess) {
    hip.hipFree(p);
    return fail(d, r, "hipMemcpy(chunk table)");
  }
  l->chunk_table_dev = (uint64_t)(uintptr_t)p;
  return 0;
}
static void hip_layout_release(kvp_device *d, kvp_kv_layout *l) {
  if (l->chunk_table_dev && set_dev(d) == 0)
    hip.hipFree((void *)(uintptr_t)l->chunk_table_dev);
}

static int slot_wait(kvp_device *d, unsigned i) {
  hip_dev *h = HD(d);
  HK(d, hip.hipEventSynchronize(h->done[i]));
  h->ring.slot[i].pending = false;
  return 0;
}

static int slot_host_alloc(kvp_device *d, size_t bytes, uint32_t **host,
                           uint64_t *dev) {
  void *p = NULL;
  HK(d, hip.hipHostMalloc((void **)host, bytes,
                          hipHostMallocPortable | hipHostMallocMapped));
  HK(d, hip.hipHostGetDevicePointer(&p, *host, 0));
  *dev = (uint64_t)(uintptr_t)p;
  return 0;
}

static void slot_host_free(kvp_device *d, uint32_t *host) {
  (void)d;
  hip.hipHostFree(host);
}

static const kvp__ring_ops ring_ops = {.wait = slot_wait,
                                       .host_alloc = slot_host_alloc,
                                       .host_free = slot_host_free};

static int hip_args_take(kvp_device *d, size_t entries, uint32_t **host,
                         void **slot) {
  int rc = set_dev(d);
  return rc < 0 ? rc
                : kvp__ring_args_take(d, &HD(d)->ring, &ring_ops, entries, host,
                                      slot);
}

static int hip_run_kernel(kvp_device *d, const kvp__plan *p) {
  hip_dev *h = HD(d);
  unsigned i; /* the slot validation filled, or one filled now (calibration) */
  int rc = set_dev(d);
  if (rc < 0 || (rc = kvp__ring_plan_slot(d, &h->ring, &ring_ops, p, &i)) < 0)
    return rc;
  kvp__ring_slot *s = &h->ring.slot[i];
  hipStream_t st = S(d, p->stream);
  kvp__launch L;
  kvp__launch_plan(d, p, s->dev, p->slots ? s->dev + (uint64_t)p->n * 4 : 0, &L);
  void *params[] = {&L.args};
  HK(d, hip.hipModuleLaunchKernel(h->fn[L.width_index], L.ctas, 1, 1,
                                  L.threads, 1, 1, 0, st, params, NULL));
  HK(d, hip.hipEventRecord(h->done[i], st));
  s->pending = true;
  return 0;
}

/* One run of adjacent blocks of one chunk (kvp__copy_runs). */
static int hip_copy2d(kvp_device *d, void *stream, uint64_t dst,
                      uint64_t dpitch, uint64_t src, uint64_t spitch,
                      uint64_t width, uint32_t rows) {
  HK(d, hip.hipMemcpy2DAsync((void *)(uintptr_t)dst, dpitch,
                             (const void *)(uintptr_t)src, spitch, width, rows,
                             hipMemcpyDefault, stream));
  return 0;
}

static int hip_run_copy_engine(kvp_device *d, const kvp__plan *p) {
  int rc = set_dev(d);
  return rc < 0 ? rc : kvp__copy_runs(d, p, S(d, p->stream), hip_copy2d);
}

const kvp__dev_ops kvp__hip_ops = {
    .open = hip_open,
    .close = hip_close,
    .alloc = hip_alloc,
    .free = hip_free,
    .host_register = hip_host_register,
    .host_unregister = hip_host_unregister,
    .check_device_range = hip_check_range,
    .memcpy = hip_memcpy,
    .stream_create = hip_stream_create,
    .stream_destroy = hip_stream_destroy,
    .stream_sync = hip_stream_sync,
    .stream_query = hip_stream_query,
    .stream_wait = hip_stream_wait,
    .event_create = hip_event_create,
    .event_destroy = hip_event_destroy,
    .event_record = hip_event_record,
    .event_sync = hip_event_sync,
    .event_query = hip_event_query,
    .event_elapsed = hip_event_elapsed,
    .layout_upload = hip_layout_upload,
    .layout_release = hip_layout_release,
    .args_take = hip_args_take,
    .run_kernel = hip_run_kernel,
    .run_copy_engine = hip_run_copy_engine,
    .calibrate = true,
};
