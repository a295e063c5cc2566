/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA backend: the driver API through dlopen("libcuda.so.1"), the
 * embedded fatbin (sm_80 + sm_90 cubins, compute_90 PTX) loaded with
 * cuModuleLoadData, the gather/scatter launches, the copy-engine path
 * (cuMemcpy2DAsync over merged runs of adjacent blocks); the start-up
 * calibration that picks between them is kernels_calibrate.c. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

#include "cuda_api.h"
#include "kernels_args.h"
#include "kernels_internal.h"
#include "kernels_ring.h"

extern const unsigned char kvp__cuda_fatbin[];
extern const size_t kvp__cuda_fatbin_size;

/* ---- the driver, loaded once --------------------------------------------------- */
static kvp_cuda_api cu;
static bool cu_ok;

const kvp_cuda_api *kvp__cuda_api(void) { return cu_ok ? &cu : NULL; }

static void load_batch(void) {
  void *fn = NULL;
  int status = 0;
  /* Ask for the CUDA 13 flavour first, then 12.8's (it takes failIdx). */
  if (cu.cuGetProcAddress("cuMemcpyBatchAsync", &fn, 13000, 0, &status) ==
          CUDA_SUCCESS && fn && cu.driver_version >= 13000)
    cu.cuMemcpyBatchAsync13 = (CUresult(*)(CUdeviceptr *, CUdeviceptr *,
                                           size_t *, size_t,
                                           CUmemcpyAttributes *, size_t *,
                                           size_t, CUstream))fn;
  else if (cu.cuGetProcAddress("cuMemcpyBatchAsync", &fn, 12080, 0,
                               &status) == CUDA_SUCCESS && fn)
    cu.cuMemcpyBatchAsync128 =
        (CUresult(*)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t,
                     CUmemcpyAttributes *, size_t *, size_t, size_t *,
                     CUstream))fn;
}

int kvp__cuda_probe(char *why, size_t cap) {
  if (!kvp__have_cuda_kernels) {
    snprintf(why, cap, "built without CUDA kernels (%s)", kvp__cuda_build_note);
    return 0;
  }
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(why, cap, "no NVIDIA driver: %s", dlerror());
    return 0;
  }
#define KVP_CUDA_LOAD_(name, sym, args)                                         \
  *(void **)&cu.name = dlsym(lib, sym);                                         \
  if (!cu.name) {                                                               \
    snprintf(why, cap, "libcuda.so.1 lacks %s (driver too old)", sym);          \
    return 0;                                                                   \
  }
  KVP_CUDA_FUNCS(KVP_CUDA_LOAD_)
#undef KVP_CUDA_LOAD_
  CUresult r = cu.cuInit(0);
  int n = 0;
  if (r == CUDA_SUCCESS)
    r = cu.cuDeviceGetCount(&n);
  if (r != CUDA_SUCCESS || n == 0) {
    const char *nm = "?";
    cu.cuGetErrorName(r, &nm);
    snprintf(why, cap, "no CUDA device (cuInit/cuDeviceGetCount: %s, %d devices)",
             nm ? nm : "?", n);
    return 0;
  }
  cu.cuDriverGetVersion(&cu.driver_version);
  load_batch();
  cu_ok = true;
  snprintf(why, cap, "%d CUDA device(s), driver API %d", n, cu.driver_version);
  return 1;
}

/* ---- per device ---------------------------------------------------------------- */
#define RING KVP__RING
static const unsigned widths[5] = {16, 8, 4, 2, 1};

/* A launch-argument slot.  Its kernel tells the host it is done with it
 * through release words (kernels_args.h): one per CTA, done_host[i *
 * MAX_CTAS + b] == gen for every CTA b of its launch.  No event is recorded
 * per launch, and reusing a finished slot makes no driver call
 * (bench_kernels' stage trace: the event record and the event wait on reuse
 * cost 2-4 us per call on the H100 host, 7-20 us right after the GPU went
 * idle).  One word per CTA rather than a grid-wide counter: the counter's
 * atomic and fences at the kernel's tail cost ~10% of a 16 MiB D2D gather
 * (0.77x of memcpy at 2 KiB pages against 0.87x with these words). */
#define MAX_CTAS KVP__MAX_CTAS
/* What CUDA keeps per ring slot beside kvp__ring_slot (pending there:
 * launched, release words not all seen yet). */
typedef struct slot_state {
  uint32_t gen;    /* the value its last launch publishes; never 0 */
  uint32_t ctas;   /* its last launch's grid */
  uint64_t rep_tag; /* its last launch had a GPU repeat check with this tag,
                     * not settled yet (kvp__dev_ops.async_error); 0: none */
} slot_state;

typedef struct cuda_dev {
  CUdevice dev;
  int ordinal;
  CUcontext ctx;
  CUmodule mod;
  CUfunction fn[5];
  CUfunction fn_repeat; /* kvp_repeat_check */
  CUstream own;
  int sms, cc_major, cc_minor;
  kvp__ring ring;       /* launch-argument slots (kernels_ring.h) */
  slot_state sx[RING];  /* and what CUDA keeps per slot */
  volatile uint32_t *done_host; /* RING x MAX_CTAS release words, mapped pinned */
  CUdeviceptr done_dev;        /* their device address */
  /* GPU repeat checks (KVP_XFER_IDS_UNIQUE): per slot a device flag the
   * check sets and a mapped word the aborted copy reports through */
  CUdeviceptr rep_flag;             /* RING uint64, device memory */
  volatile uint64_t *rep_err_host;  /* RING uint64, mapped pinned */
  CUdeviceptr rep_err_dev;
  uint64_t rep_next;                /* the last tag handed out */
  bool rep_found;                   /* a repeat seen at slot reuse, unreported */
} cuda_dev;

#define CD(d) ((cuda_dev *)(d)->priv)

static int fail(kvp_device *d, CUresult r, const char *what) {
  const char *nm = NULL;
  if (cu.cuGetErrorName(r, &nm) != CUDA_SUCCESS)
    nm = NULL;
  return kvp__dev_native_fail(d, r, nm, what);
}

#define CK(d, call)                                                             \
  do {                                                                          \
    CUresult r_ = (call);                                                       \
    if (r_ != CUDA_SUCCESS)                                                     \
      return fail(d, r_, #call);                                                \
  } while (0)

/* Makes the device's context current on this thread.  Asking first is the
 * cheap path: a submit calls this up to three times, and the context is
 * usually current already (the caller's, shared primary context). */
static int set_ctx(kvp_device *d) {
  CUcontext cur = NULL;
  if (cu.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur == CD(d)->ctx)
    return 0;
  CK(d, cu.cuCtxSetCurrent(CD(d)->ctx));
  return 0;
}

static int load_module(kvp_device *d) {
  cuda_dev *c = CD(d);
  CK(d, cu.cuModuleLoadData(&c->mod, kvp__cuda_fatbin));
  for (int i = 0; i < 5; i++) {
    char nm[32];
    snprintf(nm, sizeof nm, "kvp_copy_w%u", widths[i]);
    CK(d, cu.cuModuleGetFunction(&c->fn[i], c->mod, nm));
    int local = 0;
    CK(d, cu.cuFuncGetAttribute(&local, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES,
                                c->fn[i]));
    if (local)
      KVP_LOGW(KVP_KERNELS_MOD, "%s uses %d bytes of local memory", nm, local);
  }
  CK(d, cu.cuModuleGetFunction(&c->fn_repeat, c->mod, "kvp_repeat_check"));
  return 0;
}

static const kvp__ring_ops ring_ops;

static void cuda_close(kvp_device *d) {
  cuda_dev *c = CD(d);
  if (!c)
    return;
  if (c->ctx) {
    cu.cuCtxSetCurrent(c->ctx);
    if (c->own)
      cu.cuStreamSynchronize(c->own);
    /* a kernel may still read a slot: wait (on an error, free anyway; a
     * caller's stream that never runs again would hang here, as the
     * transfer it queued never completes either) */
    kvp__ring_free(d, &c->ring, &ring_ops, true);
    if (c->done_host)
      cu.cuMemFreeHost((void *)c->done_host);
    if (c->rep_err_host)
      cu.cuMemFreeHost((void *)c->rep_err_host);
    if (c->rep_flag)
      cu.cuMemFree(c->rep_flag);
    if (c->own)
      cu.cuStreamDestroy(c->own);
    if (c->mod)
      cu.cuModuleUnload(c->mod);
    cu.cuDevicePrimaryCtxRelease(c->dev);
  }
  kvp__free(&d->alloc, c, sizeof *c);
  d->priv = NULL;
}

static int cuda_open(kvp_device *d, const kvp_device_opts *o) {
  cuda_dev *c = kvp__calloc(&d->alloc, 1, sizeof *c);
  if (!c)
    return KVP_ENOMEM;
  d->priv = c;
  int n = 0, rc;
  cu.cuDeviceGetCount(&n);
  if (o->ordinal >= n) {
    rc = KVP_ERANGE;
    goto fail;
  }
  c->ordinal = o->ordinal;
  CUresult r;
  if ((r = cu.cuDeviceGet(&c->dev, o->ordinal)) ||
      (r = cu.cuDevicePrimaryCtxRetain(&c->ctx, c->dev))) {
    rc = fail(d, r, "cuDevicePrimaryCtxRetain");
    c->ctx = NULL;
    goto fail;
  }
  char name[96] = "?";
  cu.cuDeviceGetName(name, sizeof name, c->dev);
  cu.cuDeviceGetAttribute(&c->sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, c->dev);
  cu.cuDeviceGetAttribute(&c->cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, c->dev);
  cu.cuDeviceGetAttribute(&c->cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, c->dev);
  snprintf(d->name, sizeof d->name, "%s (sm_%d%d, %d SMs)", name, c->cc_major,
           c->cc_minor, c->sms);
  if ((rc = set_ctx(d)) < 0 || (rc = load_module(d)) < 0)
    goto fail;
  if ((r = cu.cuStreamCreate(&c->own, CU_STREAM_NON_BLOCKING))) {
    rc = fail(d, r, "cuStreamCreate");
    goto fail;
  }
  void *words = NULL;
  const size_t wbytes = (size_t)RING * MAX_CTAS * sizeof(uint32_t);
  if ((r = cu.cuMemHostAlloc(&words, wbytes,
                             CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP))) {
    rc = fail(d, r, "release words");
    goto fail;
  }
  c->done_host = words;
  memset(words, 0, wbytes);
  if ((r = cu.cuMemHostGetDevicePointer(&c->done_dev, words, 0))) {
    rc = fail(d, r, "release words");
    goto fail;
  }
  void *errw = NULL;
  if ((r = cu.cuMemAlloc(&c->rep_flag, RING * sizeof(uint64_t))) ||
      (r = cu.cuMemsetD8Async(c->rep_flag, 0, RING * sizeof(uint64_t), c->own)) ||
      (r = cu.cuMemHostAlloc(&errw, RING * sizeof(uint64_t),
                             CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP))) {
    rc = fail(d, r, "repeat-check words");
    goto fail;
  }
  c->rep_err_host = errw;
  memset(errw, 0, RING * sizeof(uint64_t));
  if ((r = cu.cuMemHostGetDevicePointer(&c->rep_err_dev, errw, 0)) ||
      (r = cu.cuStreamSynchronize(c->own))) {
    rc = fail(d, r, "repeat-check words");
    goto fail;
  }
  return 0;
fail:
  cuda_close(d);
  return rc;
}

/* UUID, PCI bus, driver version, name and the fatbin's hash: what a cached
 * calibration must have been measured with. */
static int cuda_identity(kvp_device *d, char *key, size_t key_cap, char *tag,
                         size_t tag_cap) {
  cuda_dev *c = CD(d);
  CUuuid u;
  char bus[32] = "?", hex[33];
  if (cu.cuDeviceGetUuid(&u, c->dev) != CUDA_SUCCESS)
    return KVP_EGPU;
  cu.cuDeviceGetPCIBusId(bus, (int)sizeof bus, c->dev);
  bus[sizeof bus - 1] = 0;
  for (int i = 0; i < 16; i++)
    snprintf(hex + 2 * i, 3, "%02x", (unsigned char)u.bytes[i]);
  int k = snprintf(key, key_cap, "cuda uuid=%s pci=%s driver=%d kernels=%016llx name=%s",
                   hex, bus, cu.driver_version,
                   (unsigned long long)XXH3_64bits(kvp__cuda_fatbin,
                                                   kvp__cuda_fatbin_size),
                   d->name);
  int t = snprintf(tag, tag_cap, "cuda-%s", hex);
  return k > 0 && (size_t)k < key_cap && t > 0 && (size_t)t < tag_cap ? 0
                                                                     : KVP_ERANGE;
}

static int cuda_alloc(kvp_device *d, size_t n, uint64_t *out) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CUdeviceptr p;
  CK(d, cu.cuMemAlloc(&p, n));
  *out = p;
  return 0;
}
static void cuda_free(kvp_device *d, uint64_t p) {
  if (set_ctx(d) == 0)
    cu.cuMemFree(p);
}
static int cuda_host_register(kvp_device *d, void *p, size_t n, uint64_t *dp) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CK(d, cu.cuMemHostRegister(p, n, CU_MEMHOSTREGISTER_PORTABLE |
                                        CU_MEMHOSTREGISTER_DEVICEMAP));
  CUdeviceptr dptr;
  CUresult r = cu.cuMemHostGetDevicePointer(&dptr, p, 0);
  if (r != CUDA_SUCCESS) {
    cu.cuMemHostUnregister(p);
    return fail(d, r, "cuMemHostGetDevicePointer");
  }
  *dp = dptr;
  return 0;
}
static int cuda_host_unregister(kvp_device *d, void *p) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CK(d, cu.cuMemHostUnregister(p));
  return 0;
}
/* [a, a+n) inside one device allocation of this GPU.  cuPointerGetAttributes
 * (unlike cuPointerGetAttribute) answers for any address without an error. */
static int cuda_check_range(kvp_device *d, uint64_t a, uint64_t n) {
  if (set_ctx(d) < 0)
    return KVP_EINVAL;
  unsigned type = 0;
  int ord = -1;
  CUdeviceptr start = 0;
  size_t size = 0;
  int attrs[4] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                  CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE};
  void *data[4] = {&type, &ord, &start, &size};
  if (cu.cuPointerGetAttributes(4, attrs, data, a) != CUDA_SUCCESS ||
      type != CU_MEMORYTYPE_DEVICE || ord != CD(d)->ordinal)
    return KVP_EINVAL;
  return (a - start <= size && n <= size - (a - start)) ? 0 : KVP_EINVAL;
}
static int cuda_memcpy(kvp_device *d, void *dst, const void *src, size_t n) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  /* On the own stream and waited for: cuMemcpy from pageable memory may
   * return before its DMA lands, and would not order with that stream. */
  CUstream own = CD(d)->own;
  CK(d, cu.cuMemcpyAsync((CUdeviceptr)(uintptr_t)dst, (CUdeviceptr)(uintptr_t)src,
                         n, own));
  CK(d, cu.cuStreamSynchronize(own));
  return 0;
}

static CUstream S(kvp_device *d, void *s) { return s ? s : CD(d)->own; }

static int cuda_stream_create(kvp_device *d, void **out) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CUstream s;
  CK(d, cu.cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
  *out = s;
  return 0;
}
static void cuda_stream_destroy(kvp_device *d, void *s) {
  if (set_ctx(d) == 0)
    cu.cuStreamDestroy(s);
}
static int cuda_stream_sync(kvp_device *d, void *s) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CK(d, cu.cuStreamSynchronize(S(d, s)));
  return 0;
}
static int cuda_stream_query(kvp_device *d, void *s) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CUresult r = cu.cuStreamQuery(S(d, s));
  return r == CUDA_SUCCESS ? 0 : r == CUDA_ERROR_NOT_READY ? KVP_EBUSY
                                   : fail(d, r, "cuStreamQuery");
}
static int cuda_stream_wait(kvp_device *d, void *s, void *e) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CK(d, cu.cuStreamWaitEvent(S(d, s), e, 0));
  return 0;
}
static int cuda_event_create(kvp_device *d, void **out) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CUevent e;
  CK(d, cu.cuEventCreate(&e, CU_EVENT_DEFAULT));
  *out = e;
  return 0;
}
static void cuda_event_destroy(kvp_device *d, void *e) {
  if (set_ctx(d) == 0)
    cu.cuEventDestroy(e);
}
static int cuda_event_record(kvp_device *d, void *e, void *s) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CK(d, cu.cuEventRecord(e, S(d, s)));
  return 0;
}
static int cuda_event_sync(kvp_device *d, void *e) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CK(d, cu.cuEventSynchronize(e));
  return 0;
}
static int cuda_event_query(kvp_device *d, void *e) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CUresult r = cu.cuEventQuery(e);
  return r == CUDA_SUCCESS ? 0 : r == CUDA_ERROR_NOT_READY ? KVP_EBUSY
                                   : fail(d, r, "cuEventQuery");
}
static int cuda_event_elapsed(kvp_device *d, void *a, void *b, uint64_t *ns) {
  float ms = 0;
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  CK(d, cu.cuEventElapsedTime(&ms, a, b));
  *ns = ms > 0 ? (uint64_t)((double)ms * 1e6) : 0;
  return 0;
}

static int cuda_layout_upload(kvp_device *d, kvp_kv_layout *l) {
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  size_t n = l->info.n_chunks * sizeof(uint64_t);
  CUdeviceptr p;
  CK(d, cu.cuMemAlloc(&p, n));
  CUresult r = cu.cuMemcpy(p, (CUdeviceptr)(uintptr_t)l->chunk_base, n);
  if (r != CUDA_SUCCESS) {
    cu.cuMemFree(p);
    return fail(d, r, "cuMemcpy(chunk table)");
  }
  l->chunk_table_dev = p;
  return 0;
}
static void cuda_layout_release(kvp_device *d, kvp_kv_layout *l) {
  if (set_ctx(d) < 0)
    return;
  if (l->chunk_table_dev)
    cu.cuMemFree(l->chunk_table_dev);
  if (l->repeat_owner_dev)
    cu.cuMemFree(l->repeat_owner_dev);
}

/* ---- launches ------------------------------------------------------------------------ */
/* True when every CTA of slot i's last launch has stored its release word
 * (acquire: pairs with the device's store, after its last slot read). */
static bool slot_released(const cuda_dev *c, unsigned i) {
  const slot_state *x = &c->sx[i];
  const volatile uint32_t *w = c->done_host + (size_t)i * MAX_CTAS;
  uint32_t off = 0;
  for (uint32_t b = 0; b < x->ctas; b++)
    off |= __atomic_load_n(&w[b], __ATOMIC_ACQUIRE) ^ x->gen;
  return off == 0;
}

/* Waits until slot i's last kernel has published its release words.  They
 * usually are there already (8 launches ago); otherwise spin briefly,
 * then sleep in growing steps, asking the driver every ~100 us whether the
 * context is still alive (a failed kernel never publishes: its error
 * surfaces here instead of a hang). */
static int slot_wait(kvp_device *d, unsigned i) {
  cuda_dev *c = CD(d);
  kvp__ring_slot *s = &c->ring.slot[i];
  uint64_t t0 = 0, last_check = 0, nap = 1000;
  for (unsigned spin = 0;; spin++) {
    if (slot_released(c, i)) {
      s->pending = false;
      return 0;
    }
    if (spin < 256)
      continue;
    uint64_t now = kvp_now_ns();
    if (!t0)
      t0 = last_check = now;
    if (now - last_check >= 100000) {
      last_check = now;
      CUresult r = cu.cuStreamQuery(c->own);
      if (r != CUDA_SUCCESS && r != CUDA_ERROR_NOT_READY) {
        s->pending = false;
        return fail(d, r, "waiting for a launch-argument slot");
      }
    }
    if (now - t0 > 50000) { /* past 50 us: sleep, 1 us doubling to 1 ms */
      struct timespec ts = {0, (long)nap};
      nanosleep(&ts, NULL);
      nap = nap < 1000000 ? nap * 2 : nap;
    }
  }
}

/* A slot about to be reused: its repeat check is over, so keep a finding
 * for the next sync. */
static void slot_reuse(kvp_device *d, unsigned i) {
  cuda_dev *c = CD(d);
  slot_state *x = &c->sx[i];
  if (x->rep_tag) {
    c->rep_found |= c->rep_err_host[i] == x->rep_tag;
    x->rep_tag = 0;
  }
}

/* Slots are mapped pinned memory the kernel reads directly. */
static int slot_host_alloc(kvp_device *d, size_t bytes, uint32_t **host,
                           uint64_t *dev) {
  CUdeviceptr p;
  CK(d, cu.cuMemHostAlloc((void **)host, bytes,
                          CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
  CK(d, cu.cuMemHostGetDevicePointer(&p, *host, 0));
  *dev = p;
  return 0;
}

static void slot_host_free(kvp_device *d, uint32_t *host) {
  (void)d;
  cu.cuMemFreeHost(host);
}

static const kvp__ring_ops ring_ops = {.wait = slot_wait,
                                       .reuse = slot_reuse,
                                       .host_alloc = slot_host_alloc,
                                       .host_free = slot_host_free};

static int cuda_args_take(kvp_device *d, size_t entries, uint32_t **host,
                          void **slot) {
  int rc = set_ctx(d);
  return rc < 0 ? rc
                : kvp__ring_args_take(d, &CD(d)->ring, &ring_ops, entries, host,
                                      slot);
}

/* Queues kvp_repeat_check over the slot's ids on st and arms the copy's
 * gate (kernels_args.h).  The layout's owner entries are made (zeroed, on
 * st) on first use; tags are never reused, so they are never cleared. */
static int launch_repeat_check(kvp_device *d, const kvp__plan *p, unsigned i,
                               CUstream st, kvp__launch *L) {
  cuda_dev *c = CD(d);
  kvp_kv_layout *l = (kvp_kv_layout *)p->layout;
  if (!l->repeat_owner_dev) {
    CUdeviceptr o;
    size_t bytes = (size_t)l->info.num_blocks * sizeof(uint64_t);
    CK(d, cu.cuMemAlloc(&o, bytes));
    CUresult r = cu.cuMemsetD8Async(o, 0, bytes, st);
    if (r != CUDA_SUCCESS) {
      cu.cuMemFree(o);
      return fail(d, r, "cuMemsetD8Async (repeat owners)");
    }
    l->repeat_owner_dev = o;
  }
  kvp_repeat_args ra = {.ids = L->args.ids, .owner = l->repeat_owner_dev,
                        .flag = c->rep_flag + i * sizeof(uint64_t),
                        .tag = ++c->rep_next, .n = p->n};
  void *params[] = {&ra};
  unsigned ctas = (p->n + 255) / 256;
  CK(d, cu.cuLaunchKernel(c->fn_repeat, ctas < 64 ? ctas : 64, 1, 1, 256, 1, 1,
                          0, st, params, NULL));
  L->args.repeat_flag = ra.flag;
  L->args.repeat_tag = ra.tag;
  L->args.repeat_err = c->rep_err_dev + i * sizeof(uint64_t);
  c->sx[i].rep_tag = ra.tag;
  return 0;
}

/* A repeat found by a finished GPU check, reported once (device lock held). */
static int cuda_async_error(kvp_device *d) {
  cuda_dev *c = CD(d);
  if (c->rep_found) {
    c->rep_found = false;
    return KVP_EINVAL;
  }
  for (unsigned i = 0; i < RING; i++) {
    slot_state *x = &c->sx[i];
    if (!x->rep_tag || !slot_released(c, i))
      continue; /* none, or its copy has not run yet */
    bool found = c->rep_err_host[i] == x->rep_tag; /* ordered before the words */
    x->rep_tag = 0;
    if (found)
      return KVP_EINVAL;
  }
  return 0;
}

static int cuda_run_kernel(kvp_device *d, const kvp__plan *p) {
  cuda_dev *c = CD(d);
  int rc = set_ctx(d);
  if (rc < 0)
    return rc;
  unsigned i; /* the slot validation filled, or one filled now (calibration) */
  if ((rc = kvp__ring_plan_slot(d, &c->ring, &ring_ops, p, &i)) < 0)
    return rc;
  kvp__ring_slot *s = &c->ring.slot[i];
  slot_state *x = &c->sx[i];
  CUstream st = S(d, p->stream);
  kvp__launch L;
  kvp__launch_plan(d, p, s->dev, p->slots ? s->dev + (uint64_t)p->n * 4 : 0, &L);
  x->gen = x->gen + 1 ? x->gen + 1 : 1;
  L.args.done_word = c->done_dev + (uint64_t)i * MAX_CTAS * sizeof(uint32_t);
  L.args.done_gen = x->gen;
  KVP_TRACE(KVP_TR_LAUNCH0); /* the launch stage: both kernels' launches */
  if (p->gpu_repeat_check && (rc = launch_repeat_check(d, p, i, st, &L)) < 0)
    return rc;
  void *params[] = {&L.args};
  CK(d, cu.cuLaunchKernel(c->fn[L.width_index], L.ctas, 1, 1, L.threads, 1, 1,
                          0, st, params, NULL));
  KVP_TRACE(KVP_TR_LAUNCHED);
  x->ctas = L.ctas;
  s->pending = true;
  return 0;
}

/* One run of adjacent blocks of one chunk (kvp__copy_runs): one
 * cuMemcpyAsync when its rows are contiguous, else a cuMemcpy2DAsync. */
static int cuda_copy2d(kvp_device *d, void *stream, uint64_t dst,
                       uint64_t dpitch, uint64_t src, uint64_t spitch,
                       uint64_t width, uint32_t rows) {
  CUstream st = stream;
  if (rows == 1 || (spitch == width && dpitch == width)) {
    CK(d, cu.cuMemcpyAsync(dst, src, rows * width, st));
    return 0;
  }
  CUDA_MEMCPY2D m = {.srcMemoryType = CU_MEMORYTYPE_UNIFIED,
                     .srcDevice = src, .srcPitch = spitch,
                     .dstMemoryType = CU_MEMORYTYPE_UNIFIED,
                     .dstDevice = dst, .dstPitch = dpitch,
                     .WidthInBytes = width, .Height = rows};
  CK(d, cu.cuMemcpy2DAsync(&m, st));
  return 0;
}

static int cuda_run_copy_engine(kvp_device *d, const kvp__plan *p) {
  int rc = set_ctx(d);
  return rc < 0 ? rc : kvp__copy_runs(d, p, S(d, p->stream), cuda_copy2d);
}

void kvp__cuda_native(const kvp_device *d, CUcontext *ctx, CUstream *own,
                      int *sms) {
  const cuda_dev *c = d->backend == KVP_BACKEND_CUDA ? d->priv : NULL;
  if (ctx)
    *ctx = c ? c->ctx : NULL;
  if (own)
    *own = c ? c->own : NULL;
  if (sms)
    *sms = c ? c->sms : 0;
}

const kvp__dev_ops kvp__cuda_ops = {
    .legacy_stream = (void *)0x1, /* CU_STREAM_LEGACY */
    .open = cuda_open,
    .close = cuda_close,
    .alloc = cuda_alloc,
    .free = cuda_free,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .check_device_range = cuda_check_range,
    .memcpy = cuda_memcpy,
    .stream_create = cuda_stream_create,
    .stream_destroy = cuda_stream_destroy,
    .stream_sync = cuda_stream_sync,
    .stream_query = cuda_stream_query,
    .stream_wait = cuda_stream_wait,
    .event_create = cuda_event_create,
    .event_destroy = cuda_event_destroy,
    .event_record = cuda_event_record,
    .event_sync = cuda_event_sync,
    .event_query = cuda_event_query,
    .event_elapsed = cuda_event_elapsed,
    .layout_upload = cuda_layout_upload,
    .layout_release = cuda_layout_release,
    .args_take = cuda_args_take,
    .run_kernel = cuda_run_kernel,
    .gpu_repeat_check = true,
    .async_error = cuda_async_error,
    .run_copy_engine = cuda_run_copy_engine,
    .calibrate = true,
    .identity = cuda_identity,
};
