/* SPDX-License-Identifier: Apache-2.0 */
/* The device front end: backend choice, layouts reduced to chunk tables,
 * validation of every transfer before anything is queued, the registered
 * host ranges, the kernel / copy-engine choice and the bandwidth getter. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kernels_internal.h"

/* ---- names ------------------------------------------------------------------ */
const char *kvp_backend_name(kvp_backend b) {
  switch (b) {
  case KVP_BACKEND_CPU: return "cpu";
  case KVP_BACKEND_CUDA: return "cuda";
  case KVP_BACKEND_HIP: return "hip";
  default: return "?";
  }
}

static const char *const kind_names[] = {
    NULL,          "vllm_nhd",           "vllm_nhd_kv",
    "vllm_hnd",    "vllm_hnd_kv",        "cross_layer",
    "mla",         "sglang_layer_first", "sglang_page_first",
    "sglang_mla_layer_first", "sglang_mla_page_first"};

const char *kvp_layout_kind_name(kvp_layout_kind k) {
  if ((unsigned)k >= sizeof kind_names / sizeof kind_names[0])
    return NULL;
  return kind_names[k];
}

/* ---- availability (probed once) ------------------------------------------- */
static pthread_once_t probe_once[KVP_BACKEND_COUNT_] = {
    PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT};
static int probe_ok[KVP_BACKEND_COUNT_];
static char probe_why[KVP_BACKEND_COUNT_][256];

static void probe_cuda(void) {
  probe_ok[KVP_BACKEND_CUDA] =
      kvp__cuda_probe(probe_why[KVP_BACKEND_CUDA], sizeof probe_why[0]);
}
static void probe_hip(void) {
  probe_ok[KVP_BACKEND_HIP] =
      kvp__hip_probe(probe_why[KVP_BACKEND_HIP], sizeof probe_why[0]);
}

int kvp_backend_available(kvp_backend b, char *why, size_t why_cap) {
  switch (b) {
  case KVP_BACKEND_CPU:
    if (why && why_cap)
      snprintf(why, why_cap, "the CPU reference is always available");
    return 1;
  case KVP_BACKEND_CUDA: pthread_once(&probe_once[b], probe_cuda); break;
  case KVP_BACKEND_HIP: pthread_once(&probe_once[b], probe_hip); break;
  default:
    if (why && why_cap)
      snprintf(why, why_cap, "unknown backend %d", (int)b);
    return 0;
  }
  if (why && why_cap)
    snprintf(why, why_cap, "%s", probe_why[b]);
  return probe_ok[b];
}

int kvp__dev_native_fail(kvp_device *d, int code, const char *name,
                         const char *what) {
  d->native_err = code;
  d->native_err_name = name ? name : "UNKNOWN";
  KVP_LOGW(KVP_KERNELS_MOD, "%s: %s failed: %s (%d)", d->name, what,
           d->native_err_name, code);
  return KVP_EGPU;
}

uint32_t kvp__vector_width(const uint64_t *vals, size_t n) {
  uint32_t w = 16;
  for (size_t i = 0; i < n; i++)
    while (w > 1 && vals[i] % w)
      w >>= 1;
  return w;
}

#define SEG_BYTES 8192u /* segment of a chunk per thread group (4 x 2 KiB) */

void kvp__launch_plan(const kvp_device *d, const kvp__plan *p, uint64_t ids_dev,
                      uint64_t slots_dev, kvp__launch *out) {
  const kvp_kv_layout_info *in = &p->layout->info;
  uint64_t seg = SEG_BYTES;
  while ((uint64_t)p->n * in->n_chunks * ((in->chunk_bytes + seg - 1) / seg) >=
         (1ull << 32))
    seg *= 2; /* validation keeps n * n_chunks < 2^32, so this ends */
  if (seg > in->chunk_bytes)
    seg = in->chunk_bytes;
  uint32_t n_segs = (uint32_t)((in->chunk_bytes + seg - 1) / seg);
  uint64_t wv[2] = {in->vector_bytes, p->staging};
  unsigned w = kvp__vector_width(wv, 2), wi = 0;
  while ((16u >> wi) != w)
    wi++;
  out->args = (kvp_copy_args){.chunk_base = p->layout->chunk_table_dev,
                              .ids = ids_dev,
                              .slots = slots_dev,
                              .staging = p->staging,
                              .block_stride = in->block_stride,
                              .chunk_bytes = in->chunk_bytes,
                              .n_chunks = in->n_chunks,
                              .n_ids = p->n,
                              .scatter = p->scatter,
                              .seg_bytes = (uint32_t)seg,
                              .n_segs = n_segs};
  out->width_index = wi;
  out->threads = d->threads_per_cta;
  uint64_t items = (uint64_t)p->n * in->n_chunks * n_segs;
  uint64_t per_cta = d->threads_per_cta / 32;
  uint64_t ctas = (items + per_cta - 1) / per_cta;
  out->ctas = (unsigned)(ctas < d->cta_budget ? ctas : d->cta_budget);
}

/* ---- device ------------------------------------------------------------------ */
static bool reserved_zero(const void *p, size_t n) {
  const unsigned char *c = p;
  for (size_t i = 0; i < n; i++)
    if (c[i])
      return false;
  return true;
}

/* The calibration cache key: the backend's device identity, this library,
 * the kernels it launches and the launch shape the kernel was measured with.
 * Returns 0 or KVP_ENOENT (the backend cannot say which device it is). */
static int calcache_key(kvp_device *d, char *key, size_t cap, char *tag,
                        size_t tag_cap) {
  char id[320];
  if (!d->ops->identity || d->ops->identity(d, id, sizeof id, tag, tag_cap) < 0)
    return KVP_ENOENT;
  int k = snprintf(key, cap, "%s kvplane=%s ctas=%u threads=%u", id,
                   kvp_version(), d->cta_budget, d->threads_per_cta);
  return k > 0 && (size_t)k < cap ? 0 : KVP_ENOENT;
}

/* Calibration from the cache when it holds this device's, else measured
 * (and the cache rewritten).  Only the measurement's errors fail. */
static int calibrate_cached(kvp_device *d, const kvp_device_opts *o) {
  char key[KVP_CALCACHE_KEY_MAX + 1], tag[80], path[4096], why[160] = "";
  bool cache = !(o->flags & KVP_DEVICE_NO_CALIBRATION_CACHE) &&
               calcache_key(d, key, sizeof key, tag, sizeof tag) == 0 &&
               kvp__calcache_path(o->calibration_cache, tag, path, sizeof path) == 0;
  if (cache && !(o->flags & KVP_DEVICE_RECALIBRATE)) {
    int rc = kvp__calcache_load(path, key, d->bw, why, sizeof why);
    if (rc == 0) {
      d->calibrated = true;
      d->calibration_source = 2;
      KVP_LOGI(KVP_KERNELS_MOD, "%s: calibration read from %s", d->name, path);
      return 0;
    }
    if (rc == KVP_EINVAL)
      KVP_LOGW(KVP_KERNELS_MOD, "%s: calibration cache %s ignored (%s); measuring",
               d->name, path, why);
    else
      KVP_LOGI(KVP_KERNELS_MOD, "%s: no usable calibration in %s (%s); measuring",
               d->name, path, why);
  }
  int rc = kvp__calibrate(d);
  if (rc < 0)
    return rc;
  d->calibration_source = 1;
  if (cache) {
    int sr = kvp__calcache_save(path, key, d->bw);
    if (sr < 0)
      KVP_LOGW(KVP_KERNELS_MOD, "%s: cannot write calibration cache %s (%s)",
               d->name, path, kvp_strerror(sr));
    else
      KVP_LOGI(KVP_KERNELS_MOD, "%s: calibration written to %s", d->name, path);
  }
  return 0;
}

int kvp_device_calibration_source(const kvp_device *d) {
  return d ? d->calibration_source : 0;
}

int kvp_device_create(const kvp_device_opts *opts, const kvp_allocator *alloc,
                      kvp_device **out) {
  static const kvp_device_opts zero;
  if (!out)
    return KVP_EINVAL;
  *out = NULL;
  const kvp_device_opts *o = opts ? opts : &zero;
  if (!reserved_zero(o->reserved, sizeof o->reserved) ||
      (o->flags & ~(KVP_DEVICE_NO_CALIBRATE | KVP_DEVICE_NO_CALIBRATION_CACHE |
                    KVP_DEVICE_RECALIBRATE)) || o->ordinal < 0 ||
      o->cta_budget > KVP__MAX_CTAS)
    return KVP_EINVAL;
  const kvp__dev_ops *ops;
  switch (o->backend) {
  case KVP_BACKEND_CPU: ops = &kvp__cpu_ops; break;
  case KVP_BACKEND_CUDA: ops = &kvp__cuda_ops; break;
  case KVP_BACKEND_HIP: ops = &kvp__hip_ops; break;
  default: return KVP_EINVAL;
  }
  char why[256];
  if (!kvp_backend_available(o->backend, why, sizeof why)) {
    KVP_LOGI(KVP_KERNELS_MOD, "%s backend unavailable: %s",
             kvp_backend_name(o->backend), why);
    return KVP_ENOTSUP;
  }
  kvp_device *d = kvp__calloc(alloc, 1, sizeof *d);
  if (!d)
    return KVP_ENOMEM;
  d->alloc = kvp__allocator(alloc);
  d->backend = o->backend;
  d->ops = ops;
  d->cta_budget = o->cta_budget ? o->cta_budget : 16;
  d->threads_per_cta = 512;
  d->native_err_name = "SUCCESS";
  pthread_mutex_init(&d->mu, NULL);
  int rc = ops->open(d, o);
  if (rc < 0)
    goto fail;
  if (!(o->flags & KVP_DEVICE_NO_CALIBRATE) && ops->calibrate) {
    rc = calibrate_cached(d, o);
    if (rc < 0) {
      ops->close(d);
      goto fail;
    }
  }
  *out = d;
  return 0;
fail:
  pthread_mutex_destroy(&d->mu);
  kvp__free(&d->alloc, d, sizeof *d);
  return rc;
}

void kvp_device_destroy(kvp_device *d) {
  if (!d)
    return;
  for (size_t i = d->n_regs; i-- > 0;)
    d->ops->host_unregister(d, (void *)d->regs[i].host);
  d->ops->close(d);
  kvp__free(&d->alloc, d->regs, d->cap_regs * sizeof *d->regs);
  kvp__free(&d->alloc, d->bitmap, d->bitmap_words * sizeof *d->bitmap);
  pthread_mutex_destroy(&d->mu);
  kvp_allocator a = d->alloc;
  kvp__free(&a, d, sizeof *d);
}

kvp_backend kvp_device_backend(const kvp_device *d) { return d->backend; }
const char *kvp_device_name(const kvp_device *d) { return d->name; }

int kvp_device_native_error(const kvp_device *d, const char **name) {
  if (name)
    *name = d ? d->native_err_name : "UNKNOWN";
  return d ? d->native_err : 0;
}

int kvp_device_opt_bounds(kvp_device_opt opt, int64_t *lo, int64_t *hi) {
  switch (opt) {
  case KVP_DEVOPT_CTA_BUDGET: *lo = 1, *hi = KVP__MAX_CTAS; return 0;
  case KVP_DEVOPT_THREADS_PER_CTA: *lo = 64, *hi = 1024; return 0;
  default: return KVP_EINVAL;
  }
}

int kvp_device_set(kvp_device *d, kvp_device_opt opt, int64_t v) {
  int64_t lo, hi;
  if (!d || kvp_device_opt_bounds(opt, &lo, &hi) < 0)
    return KVP_EINVAL;
  if (v < lo || v > hi || (opt == KVP_DEVOPT_THREADS_PER_CTA && v % 32))
    return KVP_ERANGE;
  pthread_mutex_lock(&d->mu);
  if (opt == KVP_DEVOPT_CTA_BUDGET)
    d->cta_budget = (uint32_t)v;
  else
    d->threads_per_cta = (uint32_t)v;
  pthread_mutex_unlock(&d->mu);
  return 0;
}

int kvp_device_get(const kvp_device *d, kvp_device_opt opt, int64_t *v) {
  if (!d || !v)
    return KVP_EINVAL;
  switch (opt) {
  case KVP_DEVOPT_CTA_BUDGET: *v = d->cta_budget; return 0;
  case KVP_DEVOPT_THREADS_PER_CTA: *v = d->threads_per_cta; return 0;
  default: return KVP_EINVAL;
  }
}

/* ---- memory ------------------------------------------------------------------ */
int kvp_device_alloc(kvp_device *d, size_t bytes, void **out) {
  if (!d || !out || !bytes)
    return KVP_EINVAL;
  uint64_t p = 0;
  pthread_mutex_lock(&d->mu);
  int rc = d->ops->alloc(d, bytes, &p);
  pthread_mutex_unlock(&d->mu);
  *out = rc < 0 ? NULL : (void *)(uintptr_t)p;
  return rc;
}

void kvp_device_free(kvp_device *d, void *p) {
  if (!d || !p)
    return;
  pthread_mutex_lock(&d->mu);
  d->ops->free(d, (uint64_t)(uintptr_t)p);
  pthread_mutex_unlock(&d->mu);
}

/* Index of the first registration with host > p (caller holds mu). */
static size_t reg_upper(const kvp_device *d, uintptr_t p) {
  size_t lo = 0, hi = d->n_regs;
  while (lo < hi) {
    size_t mid = lo + (hi - lo) / 2;
    if (d->regs[mid].host <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/* The registration holding [p, p+bytes), or NULL. */
static const kvp__host_reg *reg_find(const kvp_device *d, uintptr_t p,
                                     uint64_t bytes) {
  size_t i = reg_upper(d, p);
  if (i == 0)
    return NULL;
  const kvp__host_reg *r = &d->regs[i - 1];
  if (p - r->host >= r->bytes || bytes > r->bytes - (p - r->host))
    return NULL;
  return r;
}

int kvp_device_host_register(kvp_device *d, void *ptr, size_t bytes) {
  if (!d || !ptr || !bytes || (uintptr_t)ptr + bytes < (uintptr_t)ptr)
    return KVP_EINVAL;
  uintptr_t p = (uintptr_t)ptr;
  int rc = 0;
  pthread_mutex_lock(&d->mu);
  size_t i = reg_upper(d, p);
  if ((i > 0 && d->regs[i - 1].host + d->regs[i - 1].bytes > p) ||
      (i < d->n_regs && d->regs[i].host < p + bytes)) {
    rc = KVP_EEXIST;
    goto out;
  }
  if (d->n_regs == d->cap_regs) {
    size_t nc = d->cap_regs ? 2 * d->cap_regs : 8;
    kvp__host_reg *nr = kvp__realloc(&d->alloc, d->regs,
                                     d->cap_regs * sizeof *nr, nc * sizeof *nr);
    if (!nr) {
      rc = KVP_ENOMEM;
      goto out;
    }
    d->regs = nr, d->cap_regs = nc;
  }
  uint64_t dptr = 0;
  rc = d->ops->host_register(d, ptr, bytes, &dptr);
  if (rc < 0)
    goto out;
  memmove(&d->regs[i + 1], &d->regs[i], (d->n_regs - i) * sizeof *d->regs);
  d->regs[i] = (kvp__host_reg){.host = p, .bytes = bytes, .dptr = dptr};
  d->n_regs++;
out:
  pthread_mutex_unlock(&d->mu);
  return rc;
}

int kvp_device_host_unregister(kvp_device *d, void *ptr) {
  if (!d || !ptr)
    return KVP_EINVAL;
  int rc = KVP_ENOENT;
  pthread_mutex_lock(&d->mu);
  size_t i = reg_upper(d, (uintptr_t)ptr);
  if (i > 0 && d->regs[i - 1].host == (uintptr_t)ptr) {
    rc = d->ops->host_unregister(d, ptr);
    memmove(&d->regs[i - 1], &d->regs[i], (d->n_regs - i) * sizeof *d->regs);
    d->n_regs--;
  }
  pthread_mutex_unlock(&d->mu);
  return rc;
}

int kvp_device_memcpy(kvp_device *d, void *dst, const void *src, size_t n) {
  if (!d || (n && (!dst || !src)))
    return KVP_EINVAL;
  if (!n)
    return 0;
  pthread_mutex_lock(&d->mu);
  int rc = d->ops->memcpy(d, dst, src, n);
  pthread_mutex_unlock(&d->mu);
  return rc;
}

/* After a successful synchronize: a repeat the GPU found (KVP_XFER_IDS_UNIQUE)
 * in a scatter that has finished, reported once. */
static int synced(kvp_device *d, int rc) {
  if (rc < 0 || !d->ops->async_error)
    return rc;
  pthread_mutex_lock(&d->mu);
  rc = d->ops->async_error(d);
  pthread_mutex_unlock(&d->mu);
  if (rc < 0)
    KVP_LOGW(KVP_KERNELS_MOD, "a scatter with KVP_XFER_IDS_UNIQUE had a "
             "repeated block id (found on the GPU): nothing was copied");
  return rc;
}

int kvp_device_synchronize(kvp_device *d) {
  return d ? synced(d, d->ops->stream_sync(d, NULL)) : KVP_EINVAL;
}

/* ---- streams and events ------------------------------------------------------ */
struct kvp_stream {
  kvp_device *dev;
  void *native;
  bool owned;
};
struct kvp_event {
  kvp_device *dev;
  void *native;
};

static int stream_new(kvp_device *d, void *native, bool owned,
                      kvp_stream **out) {
  kvp_stream *s = kvp__calloc(&d->alloc, 1, sizeof *s);
  if (!s)
    return KVP_ENOMEM;
  s->dev = d, s->native = native, s->owned = owned;
  *out = s;
  return 0;
}

int kvp_stream_create(kvp_device *d, kvp_stream **out) {
  if (!d || !out)
    return KVP_EINVAL;
  void *native = NULL;
  pthread_mutex_lock(&d->mu);
  int rc = d->ops->stream_create(d, &native);
  pthread_mutex_unlock(&d->mu);
  if (rc < 0)
    return rc;
  rc = stream_new(d, native, true, out);
  if (rc < 0)
    d->ops->stream_destroy(d, native);
  return rc;
}

int kvp_stream_wrap(kvp_device *d, void *native, kvp_stream **out) {
  if (!d || !out)
    return KVP_EINVAL;
  /* NULL is the engine's default stream (PyTorch's current_stream() is 0
   * unless set), not the device's own one: map it to the legacy handle. */
  if (!native && d->backend != KVP_BACKEND_CPU) {
    if (!d->ops->legacy_stream)
      return KVP_ENOTSUP;
    native = d->ops->legacy_stream;
  }
  return stream_new(d, native, false, out);
}

void kvp_stream_destroy(kvp_stream *s) {
  if (!s)
    return;
  kvp_device *d = s->dev;
  d->ops->stream_sync(d, s->native);
  if (s->owned)
    d->ops->stream_destroy(d, s->native);
  kvp__free(&d->alloc, s, sizeof *s);
}

int kvp_stream_synchronize(kvp_stream *s) {
  return s ? synced(s->dev, s->dev->ops->stream_sync(s->dev, s->native))
           : KVP_EINVAL;
}
int kvp_stream_query(kvp_stream *s) {
  return s ? s->dev->ops->stream_query(s->dev, s->native) : KVP_EINVAL;
}

int kvp_event_create(kvp_device *d, kvp_event **out) {
  if (!d || !out)
    return KVP_EINVAL;
  kvp_event *e = kvp__calloc(&d->alloc, 1, sizeof *e);
  if (!e)
    return KVP_ENOMEM;
  e->dev = d;
  int rc = d->ops->event_create(d, &e->native);
  if (rc < 0) {
    kvp__free(&d->alloc, e, sizeof *e);
    return rc;
  }
  *out = e;
  return 0;
}

void kvp_event_destroy(kvp_event *e) {
  if (!e)
    return;
  e->dev->ops->event_destroy(e->dev, e->native);
  kvp__free(&e->dev->alloc, e, sizeof *e);
}

int kvp_event_record(kvp_event *e, kvp_stream *s) {
  if (!e || (s && s->dev != e->dev))
    return KVP_EINVAL;
  return e->dev->ops->event_record(e->dev, e->native, s ? s->native : NULL);
}
int kvp_stream_wait_event(kvp_stream *s, kvp_event *e) {
  if (!s || !e || s->dev != e->dev)
    return KVP_EINVAL;
  return s->dev->ops->stream_wait(s->dev, s->native, e->native);
}
int kvp_event_synchronize(kvp_event *e) {
  return e ? e->dev->ops->event_sync(e->dev, e->native) : KVP_EINVAL;
}
int kvp_event_query(kvp_event *e) {
  return e ? e->dev->ops->event_query(e->dev, e->native) : KVP_EINVAL;
}
int kvp_event_elapsed_ns(kvp_event *a, kvp_event *b, uint64_t *ns) {
  if (!a || !b || !ns || a->dev != b->dev)
    return KVP_EINVAL;
  return a->dev->ops->event_elapsed(a->dev, a->native, b->native, ns);
}

/* ---- layouts ------------------------------------------------------------------ */
#define LAYOUT_BYTES_MAX (1ull << 48)

static int layout_bad(const char *what) {
  KVP_LOGW(KVP_KERNELS_MOD, "kv layout: %s", what);
  return KVP_EINVAL;
}

/* a*b*... with overflow and a 2^48 cap. */
static bool mul3(uint64_t a, uint64_t b, uint64_t c, uint64_t *out) {
  uint64_t t;
  if (__builtin_mul_overflow(a, b, &t) || __builtin_mul_overflow(t, c, &t) ||
      t > LAYOUT_BYTES_MAX)
    return false;
  *out = t;
  return true;
}

/* Translates one tensor [p, p+bytes) to a device address (caller holds mu). */
static int tensor_addr(kvp_device *d, const void *p, uint64_t bytes,
                       uint64_t *addr, bool *is_host) {
  const kvp__host_reg *r = reg_find(d, (uintptr_t)p, bytes);
  if (r) {
    *addr = r->dptr + ((uintptr_t)p - r->host);
    *is_host = d->backend != KVP_BACKEND_CPU;
    return 0;
  }
  *is_host = false;
  *addr = (uint64_t)(uintptr_t)p;
  return d->ops->check_device_range(d, *addr, bytes);
}

typedef struct chunk_geom {
  uint32_t n_chunks;
  uint64_t chunk_bytes, block_stride, tensor_bytes;
  bool per_layer; /* pointers from k_layers / v_layers, else base */
  bool separate_kv;
} chunk_geom;

static int layout_geometry(const kvp_kv_layout_desc *s, chunk_geom *g) {
  const uint64_t L = s->num_layers, NB = s->num_blocks, es = s->elem_size;
  uint64_t page; /* elements of one K (or V) page */
  if (!mul3(s->block_size, s->num_kv_heads, s->head_dim, &page))
    return KVP_ERANGE;
  uint64_t pb; /* bytes of one K page */
  if (!mul3(page, es, 1, &pb))
    return KVP_ERANGE;
  memset(g, 0, sizeof *g);
  switch (s->kind) {
  case KVP_LAYOUT_VLLM_NHD:
  case KVP_LAYOUT_VLLM_HND:
    *g = (chunk_geom){(uint32_t)(2 * L), pb, pb, 0, true, true};
    return mul3(NB, pb, 1, &g->tensor_bytes) ? 0 : KVP_ERANGE;
  case KVP_LAYOUT_VLLM_NHD_KV:
  case KVP_LAYOUT_VLLM_HND_KV:
    *g = (chunk_geom){(uint32_t)(2 * L), pb, pb, 0, true, false};
    return mul3(2 * NB, pb, 1, &g->tensor_bytes) ? 0 : KVP_ERANGE;
  case KVP_LAYOUT_MLA:
    *g = (chunk_geom){(uint32_t)L, pb, pb, 0, true, false};
    return mul3(NB, pb, 1, &g->tensor_bytes) ? 0 : KVP_ERANGE;
  case KVP_LAYOUT_CROSS_LAYER:
    if (!mul3(L, 2, pb, &g->chunk_bytes))
      return KVP_ERANGE;
    g->n_chunks = 1, g->block_stride = g->chunk_bytes;
    return mul3(NB, g->chunk_bytes, 1, &g->tensor_bytes) ? 0 : KVP_ERANGE;
  case KVP_LAYOUT_SGLANG_LAYER_FIRST:
    *g = (chunk_geom){(uint32_t)(2 * L), pb, pb, 0, false, false};
    return mul3(2 * L, NB, pb, &g->tensor_bytes) ? 0 : KVP_ERANGE;
  case KVP_LAYOUT_SGLANG_PAGE_FIRST:
    if (!mul3(L, pb, 1, &g->chunk_bytes))
      return KVP_ERANGE;
    g->n_chunks = 2, g->block_stride = g->chunk_bytes;
    return mul3(2 * NB, g->chunk_bytes, 1, &g->tensor_bytes) ? 0 : KVP_ERANGE;
  case KVP_LAYOUT_SGLANG_MLA_LAYER_FIRST:
    *g = (chunk_geom){(uint32_t)L, pb, pb, 0, false, false};
    return mul3(L, NB, pb, &g->tensor_bytes) ? 0 : KVP_ERANGE;
  case KVP_LAYOUT_SGLANG_MLA_PAGE_FIRST:
    if (!mul3(L, pb, 1, &g->chunk_bytes))
      return KVP_ERANGE;
    g->n_chunks = 1, g->block_stride = g->chunk_bytes;
    return mul3(NB, g->chunk_bytes, 1, &g->tensor_bytes) ? 0 : KVP_ERANGE;
  default: return layout_bad("unknown kind");
  }
}

static bool is_mla(kvp_layout_kind k) {
  return k == KVP_LAYOUT_MLA || k == KVP_LAYOUT_SGLANG_MLA_LAYER_FIRST ||
         k == KVP_LAYOUT_SGLANG_MLA_PAGE_FIRST;
}

static int desc_check(const kvp_kv_layout_desc *s, const chunk_geom *g) {
  if (!reserved_zero(s->reserved, sizeof s->reserved) || s->reserved0)
    return layout_bad("reserved fields must be zero");
  if (!s->num_layers || !s->num_blocks || !s->block_size ||
      !s->num_kv_heads || !s->head_dim)
    return layout_bad("num_layers, num_blocks, block_size, num_kv_heads and "
                      "head_dim must be > 0");
  if (s->elem_size != 1 && s->elem_size != 2 && s->elem_size != 4)
    return layout_bad("elem_size must be 1, 2 or 4");
  if (is_mla(s->kind) && s->num_kv_heads != 1)
    return layout_bad("MLA layouts have num_kv_heads = 1");
  if (g->per_layer) {
    if (!s->k_layers || (g->separate_kv != (s->v_layers != NULL)) || s->base)
      return layout_bad(g->separate_kv
                            ? "this kind needs k_layers and v_layers"
                            : "this kind needs k_layers only");
    for (uint32_t l = 0; l < s->num_layers; l++)
      if (!s->k_layers[l] || (g->separate_kv && !s->v_layers[l]))
        return layout_bad("NULL layer tensor");
  } else if (!s->base || s->k_layers || s->v_layers) {
    return layout_bad("this kind needs base only");
  }
  return 0;
}

/* Chunk c's base pointer (host view) and the tensor it lies in. */
static void chunk_ptr(const kvp_kv_layout_desc *s, const chunk_geom *g,
                      uint32_t c, const char **tensor, uint64_t *off) {
  const uint64_t NB = s->num_blocks;
  const uint32_t L = s->num_layers;
  *off = 0;
  switch (s->kind) {
  case KVP_LAYOUT_VLLM_NHD:
  case KVP_LAYOUT_VLLM_HND:
    *tensor = (c & 1) ? s->v_layers[c / 2] : s->k_layers[c / 2];
    return;
  case KVP_LAYOUT_VLLM_NHD_KV:
  case KVP_LAYOUT_VLLM_HND_KV:
    *tensor = s->k_layers[c / 2];
    *off = (c & 1) * NB * g->chunk_bytes;
    return;
  case KVP_LAYOUT_MLA: *tensor = s->k_layers[c]; return;
  case KVP_LAYOUT_SGLANG_LAYER_FIRST: /* [2, L, NB*bs, ...], chunks [l][kv] */
    *tensor = s->base;
    *off = ((uint64_t)(c & 1) * L + c / 2) * NB * g->chunk_bytes;
    return;
  case KVP_LAYOUT_SGLANG_PAGE_FIRST:
  case KVP_LAYOUT_SGLANG_MLA_LAYER_FIRST:
    *tensor = s->base;
    *off = (uint64_t)c * NB * g->chunk_bytes;
    return;
  default: *tensor = s->base; return;
  }
}

static void layout_free(kvp_kv_layout *l) {
  kvp_device *d = l->dev;
  const kvp_allocator *a = &d->alloc;
  uint32_t L = l->desc.num_layers, n = l->info.n_chunks;
  kvp__free(a, (void *)l->desc.k_layers, L * sizeof(void *));
  kvp__free(a, (void *)l->desc.v_layers, L * sizeof(void *));
  kvp__free(a, l->chunk_base, n * sizeof *l->chunk_base);
  kvp__free(a, l->chunk_is_host, n * sizeof *l->chunk_is_host);
  kvp__free(a, l->stamp, l->info.num_blocks);
  kvp__free(a, l, sizeof *l);
}

static int layout_copy_ptrs(kvp_kv_layout *l, const kvp_kv_layout_desc *s) {
  size_t sz = s->num_layers * sizeof(void *);
  l->desc.k_layers = l->desc.v_layers = NULL;
  if (s->k_layers) {
    void **k = kvp__malloc(&l->dev->alloc, sz);
    if (!k)
      return KVP_ENOMEM;
    memcpy(k, s->k_layers, sz);
    l->desc.k_layers = k;
  }
  if (s->v_layers) {
    void **v = kvp__malloc(&l->dev->alloc, sz);
    if (!v)
      return KVP_ENOMEM;
    memcpy(v, s->v_layers, sz);
    l->desc.v_layers = v;
  }
  return 0;
}

/* Chunk table: translate and range-check every chunk's tensor (mu held). */
static int layout_chunks(kvp_kv_layout *l, const chunk_geom *g) {
  kvp_device *d = l->dev;
  uint32_t n = g->n_chunks;
  l->chunk_base = kvp__calloc(&d->alloc, n, sizeof *l->chunk_base);
  l->chunk_is_host = kvp__calloc(&d->alloc, n, sizeof *l->chunk_is_host);
  if (!l->chunk_base || !l->chunk_is_host)
    return KVP_ENOMEM;
  uint64_t vals[3] = {g->chunk_bytes, g->block_stride, 0};
  uint32_t width = kvp__vector_width(vals, 2);
  for (uint32_t c = 0; c < n; c++) {
    const char *t;
    uint64_t off, addr;
    bool host;
    chunk_ptr(&l->desc, g, c, &t, &off);
    int rc = tensor_addr(d, t, g->tensor_bytes, &addr, &host);
    if (rc < 0) {
      KVP_LOGW(KVP_KERNELS_MOD,
               "kv layout: chunk %u: tensor %p (+%llu bytes) is neither "
               "device memory nor a registered host range", c, (void *)t,
               (unsigned long long)g->tensor_bytes);
      return rc;
    }
    l->chunk_base[c] = addr + off;
    l->chunk_is_host[c] = host;
    l->any_host |= host;
    vals[2] = l->chunk_base[c];
    width = kvp__vector_width(vals, 3) < width ? kvp__vector_width(vals, 3)
                                               : width;
  }
  l->info.vector_bytes = width;
  return 0;
}

int kvp_kv_layout_create(kvp_device *d, const kvp_kv_layout_desc *s,
                         kvp_kv_layout **out) {
  if (!d || !s || !out)
    return KVP_EINVAL;
  *out = NULL;
  if (!kvp_layout_kind_name(s->kind))
    return layout_bad("unknown kind");
  chunk_geom g;
  if (!s->num_layers || !s->elem_size)
    return desc_check(s, &(chunk_geom){0});
  int rc = layout_geometry(s, &g);
  if (rc < 0)
    return rc;
  if ((rc = desc_check(s, &g)) < 0)
    return rc;
  kvp_kv_layout *l = kvp__calloc(&d->alloc, 1, sizeof *l);
  if (!l)
    return KVP_ENOMEM;
  l->dev = d;
  l->desc = *s;
  l->info = (kvp_kv_layout_info){.block_bytes = g.chunk_bytes * g.n_chunks,
                                 .chunk_bytes = g.chunk_bytes,
                                 .block_stride = g.block_stride,
                                 .n_chunks = g.n_chunks,
                                 .num_blocks = s->num_blocks};
  pthread_mutex_lock(&d->mu);
  if ((rc = layout_copy_ptrs(l, s)) < 0 || (rc = layout_chunks(l, &g)) < 0 ||
      (rc = d->ops->layout_upload(d, l)) < 0) {
    pthread_mutex_unlock(&d->mu);
    layout_free(l);
    return rc;
  }
  pthread_mutex_unlock(&d->mu);
  *out = l;
  return 0;
}

void kvp_kv_layout_destroy(kvp_kv_layout *l) {
  if (!l)
    return;
  kvp_device *d = l->dev;
  pthread_mutex_lock(&d->mu);
  d->ops->layout_release(d, l);
  pthread_mutex_unlock(&d->mu);
  layout_free(l);
}

int kvp_kv_layout_info_get(const kvp_kv_layout *l, kvp_kv_layout_info *out) {
  if (!l || !out)
    return KVP_EINVAL;
  *out = l->info;
  return 0;
}

/* ---- gather / scatter ---------------------------------------------------------- */
/* Sets bits of vals[i] in the scratch bitmap; false on a repeat.  Leaves the
 * bitmap all zero either way (mu held). */
static int no_repeats(kvp_device *d, const uint32_t *vals, uint32_t n,
                      uint64_t universe) {
  size_t words = (size_t)((universe + 63) / 64);
  if (words > d->bitmap_words) {
    uint64_t *b = kvp__calloc(&d->alloc, words, sizeof *b);
    if (!b)
      return KVP_ENOMEM;
    kvp__free(&d->alloc, d->bitmap, d->bitmap_words * sizeof *b);
    d->bitmap = b, d->bitmap_words = words;
  }
  uint32_t i = 0;
  bool rep = false;
  for (; i < n; i++) {
    uint64_t bit = 1ull << (vals[i] & 63), *w = &d->bitmap[vals[i] >> 6];
    if (*w & bit) {
      rep = true;
      break;
    }
    *w |= bit;
  }
  for (uint32_t j = 0; j < i; j++)
    d->bitmap[vals[j] >> 6] = 0;
  return rep ? KVP_EINVAL : 0;
}

/* Scatter: repeated block ids would race (two slots into one block: a mix of
 * both).  Per-layout byte stamps (stamp[id] == gen: seen in this call), so
 * nothing is cleared between calls but every 255th; bytes keep the array in
 * L1/L2 (16 KiB for 16K blocks).  ids must be in range (checked before).
 * Returns 0, KVP_EINVAL (repeat), KVP_ENOMEM. */
static int scatter_no_repeats(kvp_kv_layout *l, const uint32_t *ids, uint32_t n) {
  if (!l->stamp) {
    l->stamp = kvp__calloc(&l->dev->alloc, l->info.num_blocks, 1);
    if (!l->stamp)
      return KVP_ENOMEM;
  }
  if (++l->stamp_gen == 0) { /* wrapped: forget every old stamp */
    memset(l->stamp, 0, l->info.num_blocks);
    l->stamp_gen = 1;
  }
  /* When the ids will touch most of the array's lines, fetch it in order
   * first: after a large transfer it is out of the caches, and a sequential
   * sweep is cheaper than n random misses (~2 us of ~6 for 8192 ids). */
  if (l->info.num_blocks / 64 <= n)
    for (uint32_t k = 0; k < l->info.num_blocks; k += 64)
      __builtin_prefetch(l->stamp + k, 1, 3);
  return kvp__ids_stamp_unique(l->stamp, l->stamp_gen, ids, n) ? 0 : KVP_EINVAL;
}

static int xfer_fail(const char *why, uint32_t i, uint64_t v) {
  KVP_LOGI(KVP_KERNELS_MOD, "transfer rejected: %s (entry %u: %llu)", why, i,
           (unsigned long long)v);
  return KVP_EINVAL;
}

#ifdef KVP_SUBMIT_TRACE
uint64_t kvp__submit_trace[KVP_TR_N];
#endif

/* Everything checked before anything is queued (mu held). */
static int xfer_validate(kvp_device *d, const kvp_xfer *x, bool scatter,
                         kvp__plan *p) {
  const kvp_kv_layout *l = x->layout;
  if (!l || l->dev != d || (x->n && !x->block_ids) || !x->staging ||
      x->method > KVP_XFER_COPY_ENGINE || (x->flags & ~KVP_XFER_IDS_UNIQUE) ||
      x->reserved32 || !reserved_zero(x->reserved, sizeof x->reserved))
    return KVP_EINVAL;
  if ((uint64_t)x->n * l->info.n_chunks >= (1ull << 32))
    return KVP_ERANGE;
  const uint64_t bb = l->info.block_bytes;
  const uint64_t slots_cap = x->staging_bytes / bb;
  uint32_t max_id, max_slot = x->n ? x->n - 1 : 0;
  /* GPU backends: copy the ids into the launch-argument slot in the same
   * pass that range-checks them (the submit path reads them once). */
  uint32_t *arg = NULL;
  void *slot = NULL;
  int rc;
  if (d->ops->args_take && x->n &&
      (rc = d->ops->args_take(d, x->staging_slots ? 2 * (size_t)x->n : x->n,
                              &arg, &slot)) < 0)
    return rc;
  KVP_TRACE(KVP_TR_SLOT);
  max_id = arg ? kvp__ids_copy_max(arg, x->block_ids, x->n)
               : kvp__ids_max(x->block_ids, x->n);
  if (x->n && max_id >= l->info.num_blocks) {
    uint32_t i = 0;
    while (x->block_ids[i] < l->info.num_blocks)
      i++;
    return xfer_fail("block id out of range", i, x->block_ids[i]);
  }
  if (x->staging_slots)
    max_slot = arg ? kvp__ids_copy_max(arg + x->n, x->staging_slots, x->n)
                   : kvp__ids_max(x->staging_slots, x->n);
  if (x->n && max_slot >= slots_cap)
    return xfer_fail("staging buffer too small for slot", 0, max_slot);
  KVP_TRACE(KVP_TR_IDS);
  /* the caller vouches for unique ids and the GPU checks them: not here
   * (xfer() checks after all if the copy engine is chosen) */
  const bool gpu_check = scatter && (x->flags & KVP_XFER_IDS_UNIQUE) &&
                         d->ops->gpu_repeat_check &&
                         x->method != KVP_XFER_COPY_ENGINE;
  if (scatter && !gpu_check &&
      (rc = scatter_no_repeats((kvp_kv_layout *)l, x->block_ids, x->n)) < 0)
    return rc == KVP_EINVAL ? xfer_fail("repeated block id in scatter", 0, 0) : rc;
  if (!scatter && x->staging_slots &&
      (rc = no_repeats(d, x->staging_slots, x->n, slots_cap)) < 0)
    return rc == KVP_EINVAL ? xfer_fail("repeated staging slot in gather", 0, 0)
                            : rc;
  KVP_TRACE(KVP_TR_REPEATS);
  uint64_t need = x->n ? ((uint64_t)max_slot + 1) * bb : 0;
  bool host = false;
  uint64_t addr = (uint64_t)(uintptr_t)x->staging;
  if (need && (rc = tensor_addr(d, x->staging, need, &addr, &host)) < 0)
    return xfer_fail("staging is neither device memory nor registered host "
                     "memory", 0, (uintptr_t)x->staging);
  *p = (kvp__plan){.layout = l, .ids = x->block_ids, .slots = x->staging_slots,
                   .n = x->n, .scatter = scatter, .staging_is_host = host,
                   .staging = addr, .arg_slot = slot,
                   .gpu_repeat_check = gpu_check && x->n > 1};
  return 0;
}

/* Index of the calibrated size nearest to bytes (log scale). */
static int cal_index(uint64_t bytes) {
  int i = 0;
  while (i + 1 < KVP_CAL_SIZES && (4096ull << i) * 3 / 2 < bytes)
    i++;
  return i;
}

static int choose_method(const kvp_device *d, const kvp__plan *p,
                         uint32_t want) {
  if (want != KVP_XFER_AUTO)
    return (int)want;
  bool host = p->staging_is_host || p->layout->any_host;
  if (!d->calibrated || !host)
    return KVP_XFER_KERNEL;
  int dir = p->scatter ? KVP_DIR_H2D : KVP_DIR_D2H;
  int i = cal_index(p->layout->info.chunk_bytes);
  return d->bw[dir][i][1] > d->bw[dir][i][0] ? KVP_XFER_COPY_ENGINE
                                              : KVP_XFER_KERNEL;
}

static int xfer(kvp_device *d, kvp_stream *s, const kvp_xfer *x, bool scatter) {
  if (!d || !x || (s && s->dev != d))
    return KVP_EINVAL;
  kvp__plan p;
  KVP_TRACE(KVP_TR_ENTRY);
  pthread_mutex_lock(&d->mu);
  KVP_TRACE(KVP_TR_LOCKED);
  int rc = xfer_validate(d, x, scatter, &p);
  if (rc < 0)
    goto out;
  KVP_TRACE(KVP_TR_VALID);
  p.stream = s ? s->native : NULL;
  int m = choose_method(d, &p, x->method);
  if (p.n == 0) {
    rc = m;
    goto out;
  }
  if (p.gpu_repeat_check && m != KVP_XFER_KERNEL) { /* AUTO chose the copy engine */
    p.gpu_repeat_check = false;
    if ((rc = scatter_no_repeats((kvp_kv_layout *)p.layout, p.ids, p.n)) < 0) {
      if (rc == KVP_EINVAL)
        rc = xfer_fail("repeated block id in scatter", 0, 0);
      goto out;
    }
  }
  rc = m == KVP_XFER_KERNEL ? d->ops->run_kernel(d, &p)
                            : d->ops->run_copy_engine(d, &p);
  if (rc >= 0)
    rc = m;
out:
  pthread_mutex_unlock(&d->mu);
  KVP_TRACE(KVP_TR_DONE);
  return rc;
}

int kvp_device_gather(kvp_device *d, kvp_stream *s, const kvp_xfer *x) {
  return xfer(d, s, x, false);
}
int kvp_device_scatter(kvp_device *d, kvp_stream *s, const kvp_xfer *x) {
  return xfer(d, s, x, true);
}

/* ---- bandwidth ------------------------------------------------------------------- */
static double interp(const double *v, uint64_t bytes, size_t stride) {
  double x = log2((double)(bytes ? bytes : 1) / 4096.0);
  if (x <= 0)
    return v[0];
  if (x >= KVP_CAL_SIZES - 1)
    return v[(KVP_CAL_SIZES - 1) * stride];
  int i = (int)x;
  double f = x - i;
  return v[i * stride] * (1 - f) + v[(i + 1) * stride] * f;
}

int kvp_device_bandwidth_get(const kvp_device *d, kvp_xfer_dir dir,
                             uint64_t page_bytes, kvp_device_bandwidth *out) {
  if (!d || !out || (unsigned)dir >= KVP_DIR_COUNT_)
    return KVP_EINVAL;
  memset(out, 0, sizeof *out);
  out->auto_method = KVP_XFER_KERNEL;
  if (!d->calibrated || dir == KVP_DIR_D2D)
    return 0;
  out->measured = 1;
  out->kernel_gbps = interp(&d->bw[dir][0][0], page_bytes, 2);
  out->copy_engine_gbps = interp(&d->bw[dir][0][1], page_bytes, 2);
  int i = cal_index(page_bytes);
  bool ce = d->bw[dir][i][1] > d->bw[dir][i][0];
  out->auto_method = ce ? KVP_XFER_COPY_ENGINE : KVP_XFER_KERNEL;
  out->best_gbps = ce ? out->copy_engine_gbps : out->kernel_gbps;
  return 0;
}
