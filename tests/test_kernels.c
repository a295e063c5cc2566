/* SPDX-License-Identifier: Apache-2.0 */
/* kernels: every backend (KVP_TEST_BACKEND=cpu|cuda|hip; CTest runs one
 * entry per backend) against an element-wise oracle written from the
 * layouts' tensor shapes, and the GPU backends also against the CPU
 * reference backend, on fresh random data each check, destinations poisoned
 * with NaN (0xff bytes: NaN in fp8 e4m3, fp16, bf16 and fp32), random block
 * ids with repeats, every layout kind, element sizes 1/2/4, odd head dims,
 * device and registered-host (zero-copy) staging, both transfer methods.
 * Exits 77 saying why when the backend is not available here. */
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "test_harness.h"
#include "device_test_util.h"

#define POISON 0xff
#define MAXT 16 /* tensors per layout */

static kvp_backend g_backend;
static kvp_device *g_dev, *g_cpu;
static bool g_calibrated;

static void open_devices(void) {
  if (g_dev)
    return;
  char why[256];
  g_backend = kvt_backend_from_env(why, sizeof why);
  /* KVP_TEST_NO_CALIBRATE=1: skip the start-up measurement (sanitizer runs) */
  const char *nc = getenv("KVP_TEST_NO_CALIBRATE");
  g_calibrated = !(nc && *nc == '1');
  /* measured here, never read from (or written to) the user's cache */
  kvp_device_opts o = {.backend = g_backend,
                       .flags = g_calibrated ? KVP_DEVICE_NO_CALIBRATION_CACHE
                                             : KVP_DEVICE_NO_CALIBRATE};
  ASSERT_OK(kvp_device_create(&o, NULL, &g_dev));
  ASSERT_OK(kvp_device_create(NULL, NULL, &g_cpu));
  printf("# backend %s: %s (%s)\n", kvp_backend_name(g_backend),
         kvp_device_name(g_dev), why);
}

static bool gpu(void) { return g_backend != KVP_BACKEND_CPU; }

static void fill_random(unsigned char *p, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t r = kvt_rand();
    memcpy(p + i, &r, 8);
  }
  for (; i < n; i++)
    p[i] = (unsigned char)kvt_rand();
}

/* ---- a layout with its tensors -------------------------------------------------- */
typedef struct fx {
  kvp_kv_layout_desc d;
  kvp_device *dev;
  int nt;          /* tensors */
  size_t tbytes;   /* bytes per tensor */
  bool host_mem;   /* tensors in registered host memory */
  void *t[MAXT];   /* tensor pointers given to the layout */
  unsigned char *img[MAXT]; /* host images: what the tensors must hold */
  void *kp[MAXT], *vp[MAXT];
  kvp_kv_layout *lay;
  kvp_kv_layout_info info;
} fx;

static bool one_tensor(kvp_layout_kind k) {
  return k == KVP_LAYOUT_CROSS_LAYER || k >= KVP_LAYOUT_SGLANG_LAYER_FIRST;
}
static bool mla(kvp_layout_kind k) {
  return k == KVP_LAYOUT_MLA || k == KVP_LAYOUT_SGLANG_MLA_LAYER_FIRST ||
         k == KVP_LAYOUT_SGLANG_MLA_PAGE_FIRST;
}

/* Where element (l, kv, b, t, h, x) of the cache lives: tensor, element
 * offset in it, and its element offset inside a staged block -- written
 * from the shapes in device.h, independently of the library's chunks. */
static void locate(const kvp_kv_layout_desc *d, uint64_t l, uint64_t kv,
                   uint64_t b, uint64_t t, uint64_t h, uint64_t x, int *tensor,
                   uint64_t *off, uint64_t *stage) {
  const uint64_t L = d->num_layers, NB = d->num_blocks, bs = d->block_size,
                 H = d->num_kv_heads, D = d->head_dim, page = bs * H * D;
  switch (d->kind) {
  case KVP_LAYOUT_VLLM_NHD:
    *tensor = (int)(2 * l + kv);
    *off = ((b * bs + t) * H + h) * D + x;
    *stage = (2 * l + kv) * page + (t * H + h) * D + x;
    return;
  case KVP_LAYOUT_VLLM_NHD_KV:
    *tensor = (int)l;
    *off = (((kv * NB + b) * bs + t) * H + h) * D + x;
    *stage = (2 * l + kv) * page + (t * H + h) * D + x;
    return;
  case KVP_LAYOUT_VLLM_HND:
    *tensor = (int)(2 * l + kv);
    *off = ((b * H + h) * bs + t) * D + x;
    *stage = (2 * l + kv) * page + (h * bs + t) * D + x;
    return;
  case KVP_LAYOUT_VLLM_HND_KV:
    *tensor = (int)l;
    *off = (((kv * NB + b) * H + h) * bs + t) * D + x;
    *stage = (2 * l + kv) * page + (h * bs + t) * D + x;
    return;
  case KVP_LAYOUT_CROSS_LAYER:
    *tensor = 0;
    *off = ((((b * L + l) * 2 + kv) * bs + t) * H + h) * D + x;
    *stage = (((l * 2 + kv) * bs + t) * H + h) * D + x;
    return;
  case KVP_LAYOUT_MLA:
    *tensor = (int)l;
    *off = (b * bs + t) * D + x;
    *stage = l * page + t * D + x;
    return;
  case KVP_LAYOUT_SGLANG_LAYER_FIRST:
    *tensor = 0;
    *off = (((kv * L + l) * NB * bs + b * bs + t) * H + h) * D + x;
    *stage = (2 * l + kv) * page + (t * H + h) * D + x;
    return;
  case KVP_LAYOUT_SGLANG_PAGE_FIRST:
    *tensor = 0;
    *off = (((kv * NB * bs + b * bs + t) * L + l) * H + h) * D + x;
    *stage = kv * L * page + ((t * L + l) * H + h) * D + x;
    return;
  case KVP_LAYOUT_SGLANG_MLA_LAYER_FIRST:
    *tensor = 0;
    *off = (l * NB * bs + b * bs + t) * D + x;
    *stage = l * page + t * D + x;
    return;
  case KVP_LAYOUT_SGLANG_MLA_PAGE_FIRST:
    *tensor = 0;
    *off = ((b * bs + t) * L + l) * D + x;
    *stage = (t * L + l) * D + x;
    return;
  default: ASSERT_TRUE(0);
  }
}

/* Calls fn(tensor, byte offset, byte offset in block) for each element of
 * block b. */
typedef void (*elem_fn)(void *ctx, int tensor, uint64_t off, uint64_t st);
static void for_block(const kvp_kv_layout_desc *d, uint32_t b, elem_fn fn,
                      void *ctx) {
  uint64_t planes = mla(d->kind) ? 1 : 2, es = d->elem_size;
  for (uint64_t l = 0; l < d->num_layers; l++)
    for (uint64_t kv = 0; kv < planes; kv++)
      for (uint64_t t = 0; t < d->block_size; t++)
        for (uint64_t h = 0; h < d->num_kv_heads; h++)
          for (uint64_t x = 0; x < d->head_dim; x++) {
            int tn;
            uint64_t off, st;
            locate(d, l, kv, b, t, h, x, &tn, &off, &st);
            fn(ctx, tn, off * es, st * es);
          }
}

static void *mem_alloc(kvp_device *dev, size_t n, bool host) {
  void *p;
  if (host) {
    ASSERT_EQ(posix_memalign(&p, 4096, n), 0);
    ASSERT_OK(kvp_device_host_register(dev, p, n));
  } else {
    ASSERT_OK(kvp_device_alloc(dev, n, &p));
  }
  return p;
}
static void mem_free(kvp_device *dev, void *p, bool host) {
  if (host) {
    ASSERT_OK(kvp_device_host_unregister(dev, p));
    free(p);
  } else {
    kvp_device_free(dev, p);
  }
}

static void fx_upload(fx *f) {
  for (int i = 0; i < f->nt; i++)
    ASSERT_OK(kvp_device_memcpy(f->dev, f->t[i], f->img[i], f->tbytes));
}

/* Creates tensors (random contents) and the layout on dev. */
static void fx_make(fx *f, kvp_device *dev, const kvp_kv_layout_desc *d,
                    bool host_mem) {
  memset(f, 0, sizeof *f);
  f->d = *d, f->dev = dev, f->host_mem = host_mem;
  uint64_t L = d->num_layers, es = d->elem_size,
           page = (uint64_t)d->block_size * d->num_kv_heads * d->head_dim * es;
  switch (d->kind) {
  case KVP_LAYOUT_VLLM_NHD:
  case KVP_LAYOUT_VLLM_HND: f->nt = (int)(2 * L), f->tbytes = d->num_blocks * page; break;
  case KVP_LAYOUT_VLLM_NHD_KV:
  case KVP_LAYOUT_VLLM_HND_KV: f->nt = (int)L, f->tbytes = 2 * d->num_blocks * page; break;
  case KVP_LAYOUT_MLA: f->nt = (int)L, f->tbytes = d->num_blocks * page; break;
  default:
    f->nt = 1;
    f->tbytes = (mla(d->kind) ? 1 : 2) * L * d->num_blocks * page;
  }
  ASSERT_LE(f->nt, MAXT);
  for (int i = 0; i < f->nt; i++) {
    f->t[i] = mem_alloc(dev, f->tbytes, host_mem);
    f->img[i] = malloc(f->tbytes);
    ASSERT_NOT_NULL(f->img[i]);
    fill_random(f->img[i], f->tbytes);
  }
  fx_upload(f);
  if (one_tensor(d->kind)) {
    f->d.base = f->t[0];
  } else if (d->kind == KVP_LAYOUT_VLLM_NHD || d->kind == KVP_LAYOUT_VLLM_HND) {
    for (uint64_t l = 0; l < L; l++)
      f->kp[l] = f->t[2 * l], f->vp[l] = f->t[2 * l + 1];
    f->d.k_layers = f->kp, f->d.v_layers = f->vp;
  } else {
    for (uint64_t l = 0; l < L; l++)
      f->kp[l] = f->t[l];
    f->d.k_layers = f->kp;
  }
  ASSERT_OK(kvp_kv_layout_create(dev, &f->d, &f->lay));
  ASSERT_OK(kvp_kv_layout_info_get(f->lay, &f->info));
}

static void fx_free(fx *f) {
  kvp_kv_layout_destroy(f->lay);
  for (int i = 0; i < f->nt; i++) {
    mem_free(f->dev, f->t[i], f->host_mem);
    free(f->img[i]);
  }
}

/* Reads every tensor back and compares it with its image. */
static void fx_check_tensors(const fx *f) {
  for (int i = 0; i < f->nt; i++) {
    unsigned char *got = malloc(f->tbytes);
    ASSERT_NOT_NULL(got);
    ASSERT_OK(kvp_device_memcpy(f->dev, got, f->t[i], f->tbytes));
    ASSERT_MEM_EQ(got, f->img[i], f->tbytes);
    free(got);
  }
}

typedef struct copy_ctx {
  fx *f;
  unsigned char *stage; /* host image of the staging slot */
  bool scatter;
} copy_ctx;

static void copy_elem(void *c, int tn, uint64_t off, uint64_t st) {
  copy_ctx *x = c;
  if (x->scatter)
    memcpy(x->f->img[tn] + off, x->stage + st, x->f->d.elem_size);
  else
    memcpy(x->stage + st, x->f->img[tn] + off, x->f->d.elem_size);
}

/* ---- random shapes ----------------------------------------------------------------- */
static const uint32_t odd_dims[] = {1, 3, 5, 7, 9, 13, 63, 65, 127};
static const uint32_t even_dims[] = {2, 6, 8, 64, 128};

static kvp_kv_layout_desc rand_desc(kvp_layout_kind k, uint32_t es) {
  kvp_kv_layout_desc d = {.kind = k, .elem_size = es};
  d.num_layers = 1 + (uint32_t)kvt_rand_below(3);
  d.num_blocks = 3 + (uint32_t)kvt_rand_below(40);
  static const uint32_t bss[] = {1, 2, 3, 16};
  d.block_size = bss[kvt_rand_below(4)];
  d.num_kv_heads = mla(k) ? 1 : 1 + (uint32_t)kvt_rand_below(3);
  d.head_dim = kvt_rand_below(2) ? odd_dims[kvt_rand_below(9)]
                                 : even_dims[kvt_rand_below(5)];
  if (mla(k) && kvt_rand_below(3) == 0)
    d.head_dim = 576; /* DeepSeek: kv_lora_rank 512 + rope 64 */
  return d;
}

static uint32_t *rand_ids(uint32_t n, uint32_t nb, bool unique) {
  uint32_t *ids = malloc((n ? n : 1) * sizeof *ids);
  ASSERT_NOT_NULL(ids);
  if (unique) {
    uint32_t *perm = malloc(nb * sizeof *perm);
    ASSERT_NOT_NULL(perm);
    for (uint32_t i = 0; i < nb; i++)
      perm[i] = i;
    for (uint32_t i = nb - 1; i > 0; i--) {
      uint32_t j = (uint32_t)kvt_rand_below(i + 1), t = perm[i];
      perm[i] = perm[j], perm[j] = t;
    }
    memcpy(ids, perm, n * sizeof *ids);
    free(perm);
  } else {
    for (uint32_t i = 0; i < n; i++)
      ids[i] = (uint32_t)kvt_rand_below(nb);
    if (n >= 2)
      ids[n - 1] = ids[0]; /* at least one repeat */
  }
  return ids;
}

/* ---- the checks ---------------------------------------------------------------------- */
/* Gather n random ids (repeats) of f into staging (device or registered
 * host, `extra` poisoned spare slots, optional random slots), check against
 * the oracle; on GPU backends also against the CPU backend. */
static void check_gather(fx *f, bool host_staging, uint32_t method,
                         bool use_slots, fx *cpu_twin) {
  const uint64_t bb = f->info.block_bytes;
  uint32_t n = 1 + (uint32_t)kvt_rand_below(2 * f->d.num_blocks);
  uint32_t extra = 1 + (uint32_t)kvt_rand_below(4), cap = n + extra;
  uint32_t *ids = rand_ids(n, f->d.num_blocks, false);
  uint32_t *slots = use_slots ? rand_ids(n, cap, true) : NULL;
  size_t sbytes = cap * bb;
  void *stage = mem_alloc(f->dev, sbytes, host_staging);
  unsigned char *want = malloc(sbytes), *got = malloc(sbytes);
  ASSERT_TRUE(want && got);
  memset(want, POISON, sbytes);
  ASSERT_OK(kvp_device_memcpy(f->dev, stage, want, sbytes)); /* poison */
  for (uint32_t i = 0; i < n; i++) {
    copy_ctx c = {f, want + (uint64_t)(slots ? slots[i] : i) * bb, false};
    for_block(&f->d, ids[i], copy_elem, &c);
  }
  kvp_xfer x = {.layout = f->lay, .block_ids = ids, .n = n, .method = method,
                .staging = stage, .staging_bytes = sbytes,
                .staging_slots = slots};
  int rc = kvp_device_gather(f->dev, NULL, &x);
  ASSERT_OK(rc);
  ASSERT_TRUE(rc == KVP_XFER_KERNEL || rc == KVP_XFER_COPY_ENGINE);
  if (method)
    ASSERT_EQ(rc, (int)method);
  ASSERT_OK(kvp_device_synchronize(f->dev));
  ASSERT_OK(kvp_device_memcpy(f->dev, got, stage, sbytes));
  ASSERT_MEM_EQ(got, want, sbytes);
  if (cpu_twin) { /* the CPU reference on the same bytes */
    unsigned char *ref = malloc(sbytes);
    ASSERT_NOT_NULL(ref);
    memset(ref, POISON, sbytes);
    kvp_xfer xc = x;
    xc.layout = cpu_twin->lay, xc.staging = ref, xc.method = KVP_XFER_AUTO;
    ASSERT_OK(kvp_device_gather(g_cpu, NULL, &xc));
    ASSERT_MEM_EQ(got, ref, sbytes);
    free(ref);
  }
  mem_free(f->dev, stage, host_staging);
  free(want), free(got), free(ids), free(slots);
}

/* Scatter fresh random staging into a poisoned cache at unique random ids;
 * every byte of every tensor is checked (nothing else written). */
static void check_scatter(fx *f, bool host_staging, uint32_t method,
                          bool use_slots, fx *cpu_twin) {
  const uint64_t bb = f->info.block_bytes;
  uint32_t n = 1 + (uint32_t)kvt_rand_below(f->d.num_blocks);
  uint32_t cap = n + (uint32_t)kvt_rand_below(3);
  uint32_t *ids = rand_ids(n, f->d.num_blocks, true);
  uint32_t *slots = use_slots ? rand_ids(n, cap, true) : NULL;
  size_t sbytes = cap * bb;
  void *stage = mem_alloc(f->dev, sbytes, host_staging);
  unsigned char *src = malloc(sbytes);
  ASSERT_NOT_NULL(src);
  fill_random(src, sbytes);
  ASSERT_OK(kvp_device_memcpy(f->dev, stage, src, sbytes));
  for (int i = 0; i < f->nt; i++)
    memset(f->img[i], POISON, f->tbytes);
  fx_upload(f);
  for (uint32_t i = 0; i < n; i++) {
    copy_ctx c = {f, src + (uint64_t)(slots ? slots[i] : i) * bb, true};
    for_block(&f->d, ids[i], copy_elem, &c);
  }
  kvp_xfer x = {.layout = f->lay, .block_ids = ids, .n = n, .method = method,
                .staging = stage, .staging_bytes = sbytes,
                .staging_slots = slots,
                /* unique ids: the GPU checks them (CUDA) half the time */
                .flags = kvt_rand_below(2) ? KVP_XFER_IDS_UNIQUE : 0};
  ASSERT_OK(kvp_device_scatter(f->dev, NULL, &x));
  ASSERT_OK(kvp_device_synchronize(f->dev));
  fx_check_tensors(f);
  if (cpu_twin) {
    for (int i = 0; i < cpu_twin->nt; i++)
      memset(cpu_twin->t[i], POISON, cpu_twin->tbytes);
    kvp_xfer xc = x;
    xc.layout = cpu_twin->lay, xc.staging = src, xc.method = KVP_XFER_AUTO;
    ASSERT_OK(kvp_device_scatter(g_cpu, NULL, &xc));
    for (int i = 0; i < f->nt; i++)
      ASSERT_MEM_EQ(cpu_twin->t[i], f->img[i], f->tbytes);
  }
  mem_free(f->dev, stage, host_staging);
  free(src), free(ids), free(slots);
}

/* The CPU twin of f: same shape, host tensors holding f's images. */
static void twin_make(fx *tw, const fx *f) {
  kvp_kv_layout_desc d = f->d;
  d.base = NULL, d.k_layers = d.v_layers = NULL;
  fx_make(tw, g_cpu, &d, false);
  for (int i = 0; i < f->nt; i++)
    memcpy(tw->t[i], f->img[i], f->tbytes);
}

static const kvp_layout_kind all_kinds[] = {
    KVP_LAYOUT_VLLM_NHD,           KVP_LAYOUT_VLLM_NHD_KV,
    KVP_LAYOUT_VLLM_HND,           KVP_LAYOUT_VLLM_HND_KV,
    KVP_LAYOUT_CROSS_LAYER,        KVP_LAYOUT_MLA,
    KVP_LAYOUT_SGLANG_LAYER_FIRST, KVP_LAYOUT_SGLANG_PAGE_FIRST,
    KVP_LAYOUT_SGLANG_MLA_LAYER_FIRST, KVP_LAYOUT_SGLANG_MLA_PAGE_FIRST};
#define N_KINDS (sizeof all_kinds / sizeof all_kinds[0])

static bool sglang(kvp_layout_kind k) { return k >= KVP_LAYOUT_SGLANG_LAYER_FIRST; }

/* Every kind x element size, several random shapes each; SGLang pools live
 * in registered host memory (as in SGLang), the rest in device memory. */
TEST(gather_scatter_all_layouts) {
  open_devices();
  int rounds = gpu() ? 3 : 4;
  for (size_t k = 0; k < N_KINDS; k++)
    for (uint32_t es = 1; es <= 4; es *= 2)
      for (int r = 0; r < rounds; r++) {
        kvp_kv_layout_desc d = rand_desc(all_kinds[k], es);
        fx f, tw;
        fx_make(&f, g_dev, &d, sglang(d.kind));
        fx *twin = NULL;
        if (gpu()) {
          twin_make(&tw, &f);
          twin = &tw;
        }
        bool hs = kvt_rand_below(2);
        check_gather(&f, hs, KVP_XFER_AUTO, kvt_rand_below(2), twin);
        check_scatter(&f, hs, KVP_XFER_AUTO, kvt_rand_below(2), twin);
        if (twin)
          fx_free(twin);
        fx_free(&f);
      }
}

/* Both methods, both staging kinds, explicitly. */
TEST(methods_and_staging) {
  open_devices();
  for (int r = 0; r < 6; r++) {
    kvp_layout_kind k = all_kinds[kvt_rand_below(N_KINDS)];
    kvp_kv_layout_desc d = rand_desc(k, 1u << kvt_rand_below(3));
    fx f;
    fx_make(&f, g_dev, &d, false);
    for (int hs = 0; hs < 2; hs++)
      for (uint32_t m = KVP_XFER_KERNEL; m <= KVP_XFER_COPY_ENGINE; m++) {
        check_gather(&f, hs, m, kvt_rand_below(2), NULL);
        check_scatter(&f, hs, m, kvt_rand_below(2), NULL);
      }
    fx_free(&f);
  }
}

/* Widths: odd shapes fall back to narrow accesses, never wrong bytes;
 * staging at odd offsets inside its buffer too. */
TEST(vector_width_fallback) {
  open_devices();
  kvp_kv_layout_desc d = {.kind = KVP_LAYOUT_VLLM_NHD, .num_layers = 2,
                          .num_blocks = 9, .block_size = 16, .num_kv_heads = 2,
                          .head_dim = 64, .elem_size = 2};
  fx f;
  fx_make(&f, g_dev, &d, false);
  ASSERT_EQ(f.info.vector_bytes, 16u);
  ASSERT_EQ(f.info.n_chunks, 4u);
  ASSERT_EQ(f.info.chunk_bytes, 16u * 2 * 64 * 2);
  fx_free(&f);
  d.head_dim = 7, d.elem_size = 1, d.block_size = 1, d.num_kv_heads = 1;
  fx_make(&f, g_dev, &d, false);
  ASSERT_EQ(f.info.vector_bytes, 1u);
  fx_free(&f);
  d.head_dim = 6, d.elem_size = 2; /* 12-byte chunks: 4-byte accesses */
  fx_make(&f, g_dev, &d, false);
  ASSERT_EQ(f.info.vector_bytes, 4u);
  fx_free(&f);
  /* staging at +2, +4, +8 bytes into its allocation */
  d.head_dim = 128, d.block_size = 4;
  fx_make(&f, g_dev, &d, false);
  uint32_t ids[5] = {3, 1, 4, 1, 5};
  size_t sb = 5 * f.info.block_bytes;
  unsigned char *base, *want = malloc(sb + 16), *got = malloc(sb + 16);
  ASSERT_TRUE(want && got);
  ASSERT_OK(kvp_device_alloc(g_dev, sb + 16, (void **)&base));
  for (int sh = 1; sh <= 8; sh *= 2) {
    memset(want, POISON, sb + 16);
    ASSERT_OK(kvp_device_memcpy(g_dev, base, want, sb + 16));
    for (int i = 0; i < 5; i++) {
      copy_ctx c = {&f, want + sh + (uint64_t)i * f.info.block_bytes, false};
      for_block(&f.d, ids[i], copy_elem, &c);
    }
    kvp_xfer x = {.layout = f.lay, .block_ids = ids, .n = 5,
                  .staging = base + sh, .staging_bytes = sb};
    ASSERT_OK(kvp_device_gather(g_dev, NULL, &x));
    ASSERT_OK(kvp_device_synchronize(g_dev));
    ASSERT_OK(kvp_device_memcpy(g_dev, got, base, sb + 16));
    ASSERT_MEM_EQ(got, want, sb + 16);
  }
  kvp_device_free(g_dev, base);
  free(want), free(got);
  fx_free(&f);
}

/* Bad transfers are refused before anything is copied. */
TEST(validation_nothing_copied) {
  open_devices();
  kvp_kv_layout_desc d = {.kind = KVP_LAYOUT_CROSS_LAYER, .num_layers = 2,
                          .num_blocks = 16, .block_size = 4, .num_kv_heads = 2,
                          .head_dim = 8, .elem_size = 2};
  fx f;
  fx_make(&f, g_dev, &d, false);
  const uint64_t bb = f.info.block_bytes;
  void *stage;
  ASSERT_OK(kvp_device_alloc(g_dev, 8 * bb, &stage));
  unsigned char *poison = malloc(8 * bb), *got = malloc(8 * bb);
  ASSERT_TRUE(poison && got);
  memset(poison, POISON, 8 * bb);
  ASSERT_OK(kvp_device_memcpy(g_dev, stage, poison, 8 * bb));
  uint32_t bad_id[4] = {1, 2, 16, 3};        /* 16 out of range */
  uint32_t rep[4] = {1, 2, 1, 3};            /* repeat: fine in gather only */
  uint32_t slots_rep[4] = {0, 1, 0, 2};
  uint32_t slots_big[4] = {0, 1, 8, 2};
  kvp_xfer x = {.layout = f.lay, .block_ids = bad_id, .n = 4, .staging = stage,
                .staging_bytes = 8 * bb};
  ASSERT_ERR(kvp_device_gather(g_dev, NULL, &x), KVP_EINVAL);
  ASSERT_ERR(kvp_device_scatter(g_dev, NULL, &x), KVP_EINVAL);
  x.block_ids = rep;
  ASSERT_ERR(kvp_device_scatter(g_dev, NULL, &x), KVP_EINVAL);
  x.staging_slots = slots_rep;
  ASSERT_ERR(kvp_device_gather(g_dev, NULL, &x), KVP_EINVAL);
  x.staging_slots = slots_big;
  ASSERT_ERR(kvp_device_gather(g_dev, NULL, &x), KVP_EINVAL);
  x.staging_slots = NULL, x.staging_bytes = 3 * bb; /* 4 blocks, room for 3 */
  ASSERT_ERR(kvp_device_gather(g_dev, NULL, &x), KVP_EINVAL);
  x.staging_bytes = 8 * bb, x.method = 7;
  ASSERT_ERR(kvp_device_gather(g_dev, NULL, &x), KVP_EINVAL);
  x.method = 0, x.reserved[0] = 1;
  ASSERT_ERR(kvp_device_gather(g_dev, NULL, &x), KVP_EINVAL);
  ASSERT_OK(kvp_device_synchronize(g_dev));
  ASSERT_OK(kvp_device_memcpy(g_dev, got, stage, 8 * bb));
  ASSERT_MEM_EQ(got, poison, 8 * bb); /* nothing copied */
  fx_check_tensors(&f);               /* cache untouched by the scatters */
  if (gpu()) { /* plain (unregistered) host memory is refused as staging */
    x.reserved[0] = 0, x.block_ids = rep, x.staging = got;
    ASSERT_ERR(kvp_device_gather(g_dev, NULL, &x), KVP_EINVAL);
  }
  /* the repeat check survives its stamp counter wrapping (every 255 calls) */
  uint32_t one[2] = {5, 6}, two[2] = {7, 7};
  kvp_xfer xo = {.layout = f.lay, .block_ids = one, .n = 2, .staging = stage,
                 .staging_bytes = 8 * bb};
  for (int i = 0; i < 600; i++) {
    ASSERT_OK(kvp_device_scatter(g_dev, NULL, &xo));
    if (i % 97 == 0) {
      xo.block_ids = two;
      ASSERT_ERR(kvp_device_scatter(g_dev, NULL, &xo), KVP_EINVAL);
      xo.block_ids = one;
    }
  }
  ASSERT_OK(kvp_device_synchronize(g_dev));
  /* an empty list is fine and copies nothing */
  x.reserved[0] = 0, x.n = 0, x.staging = stage;
  ASSERT_OK(kvp_device_gather(g_dev, NULL, &x));
  kvp_device_free(g_dev, stage);
  free(poison), free(got);
  fx_free(&f);
}

TEST(layout_validation) {
  open_devices();
  void *t[2] = {NULL, NULL};
  ASSERT_OK(kvp_device_alloc(g_dev, 1 << 16, &t[0]));
  ASSERT_OK(kvp_device_alloc(g_dev, 1 << 16, &t[1]));
  kvp_kv_layout *l = NULL;
  kvp_kv_layout_desc ok = {.kind = KVP_LAYOUT_VLLM_NHD, .num_layers = 1,
                           .num_blocks = 4, .block_size = 4, .num_kv_heads = 2,
                           .head_dim = 8, .elem_size = 2,
                           .k_layers = &t[0], .v_layers = &t[1]};
  ASSERT_OK(kvp_kv_layout_create(g_dev, &ok, &l));
  kvp_kv_layout_destroy(l);
  kvp_kv_layout_desc d = ok;
  d.elem_size = 3;
  ASSERT_ERR(kvp_kv_layout_create(g_dev, &d, &l), KVP_EINVAL);
  d = ok, d.v_layers = NULL;
  ASSERT_ERR(kvp_kv_layout_create(g_dev, &d, &l), KVP_EINVAL);
  d = ok, d.head_dim = 0;
  ASSERT_ERR(kvp_kv_layout_create(g_dev, &d, &l), KVP_EINVAL);
  d = ok, d.kind = (kvp_layout_kind)99;
  ASSERT_ERR(kvp_kv_layout_create(g_dev, &d, &l), KVP_EINVAL);
  d = ok, d.kind = KVP_LAYOUT_CROSS_LAYER; /* needs base */
  ASSERT_ERR(kvp_kv_layout_create(g_dev, &d, &l), KVP_EINVAL);
  d = ok, d.kind = KVP_LAYOUT_MLA, d.v_layers = NULL; /* kv_heads must be 1 */
  ASSERT_ERR(kvp_kv_layout_create(g_dev, &d, &l), KVP_EINVAL);
  d = ok, d.num_blocks = 0xffffffffu, d.head_dim = 0xffffffu;
  ASSERT_TRUE(kvp_kv_layout_create(g_dev, &d, &l) < 0);
  d = ok, d.reserved[0] = 1;
  ASSERT_ERR(kvp_kv_layout_create(g_dev, &d, &l), KVP_EINVAL);
  if (gpu()) {
    d = ok, d.num_blocks = 4096; /* tensors larger than their allocation */
    ASSERT_ERR(kvp_kv_layout_create(g_dev, &d, &l), KVP_EINVAL);
    char host[64];
    void *hp[1] = {host};
    d = ok, d.k_layers = hp; /* plain host memory */
    ASSERT_ERR(kvp_kv_layout_create(g_dev, &d, &l), KVP_EINVAL);
  }
  kvp_device_free(g_dev, t[0]);
  kvp_device_free(g_dev, t[1]);
}

/* Registration bookkeeping. */
TEST(host_registration) {
  open_devices();
  char *p = malloc(1 << 20);
  ASSERT_NOT_NULL(p);
  ASSERT_OK(kvp_device_host_register(g_dev, p, 1 << 19));
  ASSERT_ERR(kvp_device_host_register(g_dev, p + 4096, 4096), KVP_EEXIST);
  ASSERT_OK(kvp_device_host_register(g_dev, p + (1 << 19), 1 << 19));
  ASSERT_ERR(kvp_device_host_unregister(g_dev, p + 1), KVP_ENOENT);
  ASSERT_OK(kvp_device_host_unregister(g_dev, p));
  ASSERT_OK(kvp_device_host_unregister(g_dev, p + (1 << 19)));
  ASSERT_ERR(kvp_device_host_unregister(g_dev, p), KVP_ENOENT);
  free(p);
}

/* Big lists (many iterations per thread group, all CTAs busy), gathered on
 * one stream while a scatter runs on another, joined with events. */
TEST(two_streams_large) {
  open_devices();
  kvp_kv_layout_desc d = {.kind = KVP_LAYOUT_CROSS_LAYER, .num_layers = 4,
                          .num_blocks = gpu() ? 8192 : 1024, .block_size = 16,
                          .num_kv_heads = 1, .head_dim = 16, .elem_size = 2};
  fx f;
  fx_make(&f, g_dev, &d, false); /* 4 KiB pages */
  const uint64_t bb = f.info.block_bytes;
  ASSERT_EQ(bb, 4096u);
  uint32_t n = d.num_blocks / 2;
  uint32_t *all = rand_ids(d.num_blocks, d.num_blocks, true);
  uint32_t *gids = all, *sids = all + n; /* disjoint halves */
  size_t sb = (size_t)n * bb;
  void *hs = mem_alloc(g_dev, sb, true), *hg = mem_alloc(g_dev, sb, true);
  fill_random(hs, sb);
  memset(hg, POISON, sb);
  kvp_stream *up, *down;
  kvp_event *e0, *e1, *done;
  ASSERT_OK(kvp_stream_create(g_dev, &up));
  ASSERT_OK(kvp_stream_create(g_dev, &down));
  ASSERT_OK(kvp_event_create(g_dev, &e0));
  ASSERT_OK(kvp_event_create(g_dev, &e1));
  ASSERT_OK(kvp_event_create(g_dev, &done));
  kvp_xfer xs = {.layout = f.lay, .block_ids = sids, .n = n, .staging = hs,
                 .staging_bytes = sb, .method = KVP_XFER_KERNEL};
  kvp_xfer xg = {.layout = f.lay, .block_ids = gids, .n = n, .staging = hg,
                 .staging_bytes = sb, .method = KVP_XFER_KERNEL};
  ASSERT_OK(kvp_event_record(e0, down));
  ASSERT_OK(kvp_device_scatter(g_dev, up, &xs));
  ASSERT_OK(kvp_device_gather(g_dev, down, &xg));
  ASSERT_OK(kvp_event_record(done, up));
  ASSERT_OK(kvp_stream_wait_event(down, done)); /* join */
  ASSERT_OK(kvp_event_record(e1, down));
  ASSERT_OK(kvp_event_synchronize(e1));
  ASSERT_OK(kvp_event_query(e1));
  ASSERT_OK(kvp_stream_query(up));
  uint64_t ns = 0;
  ASSERT_OK(kvp_event_elapsed_ns(e0, e1, &ns));
  printf("# %u + %u 4 KiB pages both ways at once: %.1f us\n", n, n, ns / 1e3);
  unsigned char *want = malloc(sb);
  ASSERT_NOT_NULL(want);
  for (uint32_t i = 0; i < n; i++) {
    copy_ctx c = {&f, want + (uint64_t)i * bb, false};
    for_block(&f.d, gids[i], copy_elem, &c);
  }
  ASSERT_MEM_EQ(hg, want, sb);
  for (uint32_t i = 0; i < n; i++) {
    copy_ctx c = {&f, (unsigned char *)hs + (uint64_t)i * bb, true};
    for_block(&f.d, sids[i], copy_elem, &c);
  }
  fx_check_tensors(&f);
  kvp_event_destroy(e0), kvp_event_destroy(e1), kvp_event_destroy(done);
  kvp_stream_destroy(up), kvp_stream_destroy(down);
  mem_free(g_dev, hs, true), mem_free(g_dev, hg, true);
  free(want), free(all);
  fx_free(&f);
}

/* More ids per CTA than it stages in shared memory (2048): the kernel reads
 * the rest straight from the argument slot.  One CTA, 5000 ids. */
TEST(many_ids_per_cta) {
  open_devices();
  kvp_kv_layout_desc d = {.kind = KVP_LAYOUT_CROSS_LAYER, .num_layers = 1,
                          .num_blocks = 6000, .block_size = 1, .num_kv_heads = 1,
                          .head_dim = 63, .elem_size = 2}; /* 252-byte pages */
  fx f;
  fx_make(&f, g_dev, &d, false);
  ASSERT_OK(kvp_device_set(g_dev, KVP_DEVOPT_CTA_BUDGET, 1));
  ASSERT_OK(kvp_device_set(g_dev, KVP_DEVOPT_THREADS_PER_CTA, 256));
  for (int r = 0; r < 2; r++) {
    check_gather(&f, r, KVP_XFER_KERNEL, r, NULL);
    check_scatter(&f, !r, KVP_XFER_KERNEL, r, NULL);
  }
  uint32_t n = 5000, *ids = rand_ids(n, d.num_blocks, false);
  size_t sb = (size_t)n * f.info.block_bytes;
  unsigned char *stage, *want = malloc(sb), *got = malloc(sb);
  ASSERT_TRUE(want && got);
  ASSERT_OK(kvp_device_alloc(g_dev, sb, (void **)&stage));
  for (uint32_t i = 0; i < n; i++) {
    copy_ctx c = {&f, want + (uint64_t)i * f.info.block_bytes, false};
    for_block(&f.d, ids[i], copy_elem, &c);
  }
  kvp_xfer x = {.layout = f.lay, .block_ids = ids, .n = n, .staging = stage,
                .staging_bytes = sb};
  ASSERT_OK(kvp_device_gather(g_dev, NULL, &x));
  ASSERT_OK(kvp_device_synchronize(g_dev));
  ASSERT_OK(kvp_device_memcpy(g_dev, got, stage, sb));
  ASSERT_MEM_EQ(got, want, sb);
  ASSERT_OK(kvp_device_set(g_dev, KVP_DEVOPT_CTA_BUDGET, 16));
  ASSERT_OK(kvp_device_set(g_dev, KVP_DEVOPT_THREADS_PER_CTA, 512));
  kvp_device_free(g_dev, stage);
  free(want), free(got), free(ids);
  fx_free(&f);
}

/* More transfers queued on one stream than the backend has launch-argument
 * slots (8 on CUDA): later calls reuse slots whose kernels may still be
 * queued, so each must wait for its slot's release words (the slow-start
 * calls with 1 CTA keep the queue behind the host).  The caller's id list is
 * overwritten as soon as each call returns, as an engine reuses its buffer:
 * every transfer must still move the blocks it was given.  CTA budgets vary
 * along the queue (the host must wait for every CTA's word of each grid). */
TEST(launch_slots_reused_in_flight) {
  open_devices();
  enum { CALLS = 27 };
  kvp_kv_layout_desc d = {.kind = KVP_LAYOUT_CROSS_LAYER, .num_layers = 2,
                          .num_blocks = gpu() ? 4096 : 512, .block_size = 16,
                          .num_kv_heads = 1, .head_dim = 16, .elem_size = 2};
  fx f;
  fx_make(&f, g_dev, &d, false);
  const uint64_t bb = f.info.block_bytes;
  const uint32_t n = d.num_blocks / 2;
  const size_t sb = (size_t)n * bb;
  static const uint32_t budgets[] = {1, 1, 1, 3, 16, 64, 7, 132, 2};
  unsigned char *stage[CALLS];
  uint32_t *want_ids[CALLS], *live[CALLS];
  kvp_stream *s;
  ASSERT_OK(kvp_stream_create(g_dev, &s));
  for (int c = 0; c < CALLS; c++) { /* everything ready before the first call */
    stage[c] = mem_alloc(g_dev, sb, true);
    memset(stage[c], POISON, sb);
    want_ids[c] = rand_ids(n, d.num_blocks, false); /* repeats allowed */
    live[c] = malloc(n * sizeof *live[c]);
    ASSERT_NOT_NULL(live[c]);
    memcpy(live[c], want_ids[c], n * sizeof *live[c]);
  }
  for (int c = 0; c < CALLS; c++) { /* then back to back, nothing in between */
    ASSERT_OK(kvp_device_set(g_dev, KVP_DEVOPT_CTA_BUDGET,
                             budgets[c % (sizeof budgets / sizeof budgets[0])]));
    kvp_xfer x = {.layout = f.lay, .block_ids = live[c], .n = n,
                  .staging = stage[c], .staging_bytes = sb,
                  .method = KVP_XFER_KERNEL};
    ASSERT_OK(kvp_device_gather(g_dev, s, &x));
    memset(live[c], 0, n * sizeof *live[c]); /* the caller reuses its buffer */
  }
  ASSERT_OK(kvp_stream_synchronize(s));
  unsigned char *want = malloc(sb);
  ASSERT_NOT_NULL(want);
  for (int c = 0; c < CALLS; c++) {
    for (uint32_t i = 0; i < n; i++) {
      copy_ctx cc = {&f, want + (uint64_t)i * bb, false};
      for_block(&f.d, want_ids[c][i], copy_elem, &cc);
    }
    ASSERT_MEM_EQ(stage[c], want, sb);
    mem_free(g_dev, stage[c], true);
    free(want_ids[c]), free(live[c]);
  }
  ASSERT_OK(kvp_device_set(g_dev, KVP_DEVOPT_CTA_BUDGET, 16));
  kvp_stream_destroy(s);
  free(want);
  fx_free(&f);
}

/* KVP_XFER_IDS_UNIQUE with a repeat anyway: nothing of that scatter is
 * copied.  The CUDA backend finds it on the GPU and reports it once per bad
 * scatter at the next synchronizes; the CPU and HIP backends, and the
 * copy-engine method, refuse the call itself.  Three scatters queued back to
 * back on one stream (repeat, unique, repeat; disjoint ids): only the middle
 * one's blocks change. */
static int scatter_flagged(const fx *f, kvp_stream *s, const uint32_t *ids,
                           uint32_t n, void *stage, size_t sb, uint32_t method) {
  kvp_xfer x = {.layout = f->lay, .block_ids = ids, .n = n, .method = method,
                .staging = stage, .staging_bytes = sb,
                .flags = KVP_XFER_IDS_UNIQUE};
  return kvp_device_scatter(g_dev, s, &x);
}

TEST(scatter_ids_unique_flag) {
  open_devices();
  kvp_kv_layout_desc d = {.kind = KVP_LAYOUT_CROSS_LAYER, .num_layers = 2,
                          .num_blocks = gpu() ? 3000 : 300, .block_size = 16,
                          .num_kv_heads = 1, .head_dim = 24, .elem_size = 2};
  fx f;
  fx_make(&f, g_dev, &d, false);
  const uint64_t bb = f.info.block_bytes;
  const uint32_t n = d.num_blocks / 3;
  const size_t sb = (size_t)n * bb;
  const bool on_gpu = g_backend == KVP_BACKEND_CUDA;
  for (int i = 0; i < f.nt; i++)
    memset(f.img[i], POISON, f.tbytes);
  fx_upload(&f);
  uint32_t *perm = rand_ids(3 * n, d.num_blocks, true), *ids[3];
  unsigned char *src[3];
  void *stage[3];
  kvp_stream *s;
  ASSERT_OK(kvp_stream_create(g_dev, &s));
  for (int k = 0; k < 3; k++) {
    ids[k] = perm + k * n;
    if (k != 1) /* a repeat, far apart */
      ids[k][n - 1 - kvt_rand_below(n / 2)] = ids[k][kvt_rand_below(n / 2)];
    src[k] = malloc(sb);
    ASSERT_NOT_NULL(src[k]);
    fill_random(src[k], sb);
    stage[k] = mem_alloc(g_dev, sb, true);
    ASSERT_OK(kvp_device_memcpy(g_dev, stage[k], src[k], sb));
  }
  for (int k = 0; k < 3; k++) {
    int rc = scatter_flagged(&f, s, ids[k], n, stage[k], sb, KVP_XFER_KERNEL);
    if (k == 1 || on_gpu)
      ASSERT_EQ(rc, KVP_XFER_KERNEL);
    else
      ASSERT_ERR(rc, KVP_EINVAL);
  }
  if (on_gpu) { /* the two bad ones, one per synchronize, then clean */
    ASSERT_ERR(kvp_stream_synchronize(s), KVP_EINVAL);
    ASSERT_ERR(kvp_device_synchronize(g_dev), KVP_EINVAL);
  }
  ASSERT_OK(kvp_stream_synchronize(s));
  ASSERT_OK(kvp_device_synchronize(g_dev));
  for (uint32_t i = 0; i < n; i++) {
    copy_ctx c = {&f, src[1] + (uint64_t)i * bb, true};
    for_block(&f.d, ids[1][i], copy_elem, &c);
  }
  fx_check_tensors(&f); /* the middle scatter's blocks, poison elsewhere */
  if (on_gpu) { /* a bad one whose slot is reused (9 more calls, 8 slots)
                 * before any synchronize: still reported, once */
    for (int k = 0; k < 10; k++) {
      int j = k == 0 ? 0 : 1;
      ASSERT_EQ(scatter_flagged(&f, s, ids[j], n, stage[j], sb, KVP_XFER_KERNEL),
                KVP_XFER_KERNEL);
    }
    ASSERT_ERR(kvp_stream_synchronize(s), KVP_EINVAL);
    ASSERT_OK(kvp_stream_synchronize(s));
    fx_check_tensors(&f); /* the middle blocks again: same bytes */
  }
  /* the copy engine never checks on the GPU: the call is refused */
  ASSERT_ERR(scatter_flagged(&f, s, ids[0], n, stage[0], sb, KVP_XFER_COPY_ENGINE),
             KVP_EINVAL);
  kvp_xfer x = {.layout = f.lay, .block_ids = ids[1], .n = n,
                .method = KVP_XFER_KERNEL, .staging = stage[1],
                .staging_bytes = sb, .flags = 2}; /* unknown flag */
  ASSERT_ERR(kvp_device_scatter(g_dev, s, &x), KVP_EINVAL);
  x.flags = 0, x.reserved32 = 1;
  ASSERT_ERR(kvp_device_scatter(g_dev, s, &x), KVP_EINVAL);
  ASSERT_OK(kvp_stream_synchronize(s));
  fx_check_tensors(&f);
  kvp_stream_destroy(s);
  for (int k = 0; k < 3; k++) {
    mem_free(g_dev, stage[k], true);
    free(src[k]);
  }
  free(perm);
  fx_free(&f);
}

/* The engine's default stream (NULL, as PyTorch hands it out) wraps to the
 * legacy stream: work on it is complete once that stream is synchronized. */
TEST(default_stream_wrap) {
  open_devices();
  kvp_kv_layout_desc d = rand_desc(KVP_LAYOUT_VLLM_NHD, 2);
  fx f;
  fx_make(&f, g_dev, &d, false);
  uint32_t n = f.d.num_blocks;
  uint32_t *ids = rand_ids(n, f.d.num_blocks, false);
  size_t sb = (size_t)n * f.info.block_bytes;
  unsigned char *stage = mem_alloc(g_dev, sb, true), *want = malloc(sb);
  ASSERT_NOT_NULL(want);
  memset(stage, POISON, sb);
  for (uint32_t i = 0; i < n; i++) {
    copy_ctx c = {&f, want + (uint64_t)i * f.info.block_bytes, false};
    for_block(&f.d, ids[i], copy_elem, &c);
  }
  kvp_stream *s;
  ASSERT_OK(kvp_stream_wrap(g_dev, NULL, &s));
  kvp_xfer x = {.layout = f.lay, .block_ids = ids, .n = n, .staging = stage,
                .staging_bytes = sb, .method = KVP_XFER_KERNEL};
  ASSERT_OK(kvp_device_gather(g_dev, s, &x));
  ASSERT_OK(kvp_stream_synchronize(s));
  ASSERT_MEM_EQ(stage, want, sb);
  kvp_stream_destroy(s);
  mem_free(g_dev, stage, true);
  free(want), free(ids);
  fx_free(&f);
}

TEST(options_and_bandwidth) {
  open_devices();
  int64_t v, lo, hi;
  ASSERT_OK(kvp_device_get(g_dev, KVP_DEVOPT_CTA_BUDGET, &v));
  ASSERT_EQ(v, 16);
  ASSERT_OK(kvp_device_opt_bounds(KVP_DEVOPT_CTA_BUDGET, &lo, &hi));
  ASSERT_ERR(kvp_device_set(g_dev, KVP_DEVOPT_CTA_BUDGET, hi + 1), KVP_ERANGE);
  ASSERT_ERR(kvp_device_set(g_dev, KVP_DEVOPT_THREADS_PER_CTA, 100), KVP_ERANGE);
  ASSERT_ERR(kvp_device_set(g_dev, (kvp_device_opt)42, 1), KVP_EINVAL);
  /* one CTA of 64 threads still moves everything right */
  ASSERT_OK(kvp_device_set(g_dev, KVP_DEVOPT_CTA_BUDGET, 1));
  ASSERT_OK(kvp_device_set(g_dev, KVP_DEVOPT_THREADS_PER_CTA, 64));
  kvp_kv_layout_desc d = rand_desc(KVP_LAYOUT_VLLM_NHD_KV, 2);
  fx f;
  fx_make(&f, g_dev, &d, false);
  check_gather(&f, false, KVP_XFER_KERNEL, true, NULL);
  check_scatter(&f, true, KVP_XFER_KERNEL, false, NULL);
  fx_free(&f);
  ASSERT_OK(kvp_device_set(g_dev, KVP_DEVOPT_CTA_BUDGET, 16));
  ASSERT_OK(kvp_device_set(g_dev, KVP_DEVOPT_THREADS_PER_CTA, 512));
  kvp_device_bandwidth bw;
  ASSERT_ERR(kvp_device_bandwidth_get(g_dev, (kvp_xfer_dir)9, 4096, &bw), KVP_EINVAL);
  for (int dir = KVP_DIR_H2D; dir <= KVP_DIR_D2H; dir++)
    for (uint64_t pg = 2048; pg <= (1u << 20); pg *= 8) {
      ASSERT_OK(kvp_device_bandwidth_get(g_dev, (kvp_xfer_dir)dir, pg, &bw));
      if (g_calibrated && g_backend == KVP_BACKEND_CUDA) {
        ASSERT_EQ(bw.measured, 1u);
        ASSERT_GT(bw.kernel_gbps, 0.1);
        ASSERT_GT(bw.copy_engine_gbps, 0.01);
        printf("# %s %7llu B pages: kernel %.1f GB/s, copy engine %.1f GB/s, "
               "auto: %s\n", dir ? "D2H" : "H2D", (unsigned long long)pg,
               bw.kernel_gbps, bw.copy_engine_gbps,
               bw.auto_method == KVP_XFER_KERNEL ? "kernel" : "copy engine");
      } else if (!gpu() || !g_calibrated) {
        ASSERT_EQ(bw.measured, 0u);
      }
    }
  const char *nm = NULL;
  ASSERT_EQ(kvp_device_native_error(g_dev, &nm), 0);
  ASSERT_NOT_NULL(nm);
  /* a failure inside the driver: KVP_EGPU, the native code kept (GPU only:
   * a 1 TiB host allocation would abort the sanitizer builds) */
  const char *msan = getenv("KVP_TEST_UNDER_SANITIZER"); /* compute-sanitizer
                                    counts every failed driver call as an error */
  if (gpu() && !(msan && *msan == '1')) {
    void *p = NULL;
    ASSERT_ERR(kvp_device_alloc(g_dev, (size_t)1 << 40, &p), KVP_EGPU);
    ASSERT_NULL(p);
    ASSERT_NE(kvp_device_native_error(g_dev, &nm), 0);
    printf("# native error kept: %s\n", nm);
    ASSERT_TRUE(strncmp(nm, "CUDA_ERROR_", 11) == 0 || strncmp(nm, "hipError", 8) == 0);
  }
}

/* GPU: a second device on the same GPU reads the first one's calibration
 * from the cache file (same figures, bit for bit); another
 * CTA budget, a damaged file or KVP_DEVICE_RECALIBRATE measure again and
 * rewrite it. */
static double bw_of(kvp_device *d, kvp_xfer_dir dir, uint64_t pg, bool kernel) {
  kvp_device_bandwidth b;
  ASSERT_OK(kvp_device_bandwidth_get(d, dir, pg, &b));
  return kernel ? b.kernel_gbps : b.copy_engine_gbps;
}

static void same_figures(kvp_device *a, kvp_device *b) {
  for (int dir = KVP_DIR_H2D; dir <= KVP_DIR_D2H; dir++)
    for (uint64_t pg = 4096; pg <= (1u << 20); pg *= 2)
      for (int k = 0; k < 2; k++) {
        double x = bw_of(a, (kvp_xfer_dir)dir, pg, k), y = bw_of(b, (kvp_xfer_dir)dir, pg, k);
        ASSERT_MEM_EQ(&x, &y, sizeof x);
      }
}

TEST(calibration_cache) {
  open_devices();
  if (!gpu() || !g_calibrated) {
    printf("# calibration cache: GPU with calibration only (test_calcache covers the file)\n");
    return;
  }
  char dir[] = "/tmp/kvp-cal-XXXXXX", path[128];
  ASSERT_NOT_NULL(mkdtemp(dir));
  snprintf(path, sizeof path, "%s/sub/cal.txt", dir);
  kvp_device_opts o = {.backend = g_backend, .calibration_cache = path};
  kvp_device *a, *b, *c;
  uint64_t t0 = kvp_now_ns();
  ASSERT_OK(kvp_device_create(&o, NULL, &a));
  uint64_t t1 = kvp_now_ns();
  ASSERT_EQ(kvp_device_calibration_source(a), 1); /* no file yet: measured */
  ASSERT_TRUE(access(path, R_OK) == 0);
  ASSERT_OK(kvp_device_create(&o, NULL, &b));
  uint64_t t2 = kvp_now_ns();
  ASSERT_EQ(kvp_device_calibration_source(b), 2); /* read back */
  same_figures(a, b);
  /* reported, not asserted (timed tests are not benchmarks; bench_kernels
   * prints the same two figures): source 2 and equal figures are the check */
  printf("# create: measuring %.1f ms, from the cache %.1f ms\n", (t1 - t0) / 1e6,
         (t2 - t1) / 1e6);
  kvp_device_destroy(b);
  /* another CTA budget: the kernel figures do not apply, measured again */
  o.cta_budget = 8;
  ASSERT_OK(kvp_device_create(&o, NULL, &c));
  ASSERT_EQ(kvp_device_calibration_source(c), 1);
  kvp_device_destroy(c);
  o.cta_budget = 0; /* the file now holds budget 8's: 16 measures again */
  ASSERT_OK(kvp_device_create(&o, NULL, &c));
  ASSERT_EQ(kvp_device_calibration_source(c), 1);
  kvp_device_destroy(c);
  /* damaged: refused (warn), measured, rewritten */
  FILE *f = fopen(path, "r+b");
  ASSERT_NOT_NULL(f);
  ASSERT_EQ(fseek(f, 40, SEEK_SET), 0);
  fputc('\n', f);
  fclose(f);
  ASSERT_OK(kvp_device_create(&o, NULL, &c));
  ASSERT_EQ(kvp_device_calibration_source(c), 1);
  kvp_device_destroy(c);
  ASSERT_OK(kvp_device_create(&o, NULL, &c));
  ASSERT_EQ(kvp_device_calibration_source(c), 2);
  kvp_device_destroy(c);
  o.flags = KVP_DEVICE_RECALIBRATE;
  ASSERT_OK(kvp_device_create(&o, NULL, &c));
  ASSERT_EQ(kvp_device_calibration_source(c), 1);
  kvp_device_destroy(c);
  o.flags = KVP_DEVICE_NO_CALIBRATE;
  ASSERT_OK(kvp_device_create(&o, NULL, &c));
  ASSERT_EQ(kvp_device_calibration_source(c), 0);
  kvp_device_destroy(c);
  kvp_device_destroy(a);
  char cmd[200];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  ASSERT_EQ(system(cmd), 0);
}

TEST(names) {
  ASSERT_STR_EQ(kvp_backend_name(KVP_BACKEND_CUDA), "cuda");
  ASSERT_STR_EQ(kvp_layout_kind_name(KVP_LAYOUT_SGLANG_PAGE_FIRST), "sglang_page_first");
  ASSERT_NULL(kvp_layout_kind_name((kvp_layout_kind)0));
  char why[128];
  ASSERT_EQ(kvp_backend_available(KVP_BACKEND_CPU, why, sizeof why), 1);
  ASSERT_EQ(kvp_backend_available((kvp_backend)7, why, sizeof why), 0);
  kvp_device *d;
  kvp_device_opts o = {.backend = (kvp_backend)7};
  ASSERT_ERR(kvp_device_create(&o, NULL, &d), KVP_EINVAL);
  o = (kvp_device_opts){.reserved = {1}};
  ASSERT_ERR(kvp_device_create(&o, NULL, &d), KVP_EINVAL);
  for (int b = KVP_BACKEND_CUDA; b <= KVP_BACKEND_HIP; b++)
    if (!kvp_backend_available((kvp_backend)b, why, sizeof why)) {
      o = (kvp_device_opts){.backend = (kvp_backend)b};
      ASSERT_ERR(kvp_device_create(&o, NULL, &d), KVP_ENOTSUP);
      printf("# %s unavailable: %s\n", kvp_backend_name((kvp_backend)b), why);
    }
}

static void teardown(void) {
  kvp_device_destroy(g_dev);
  kvp_device_destroy(g_cpu);
}

TEST(destroy_all) {
  open_devices();
  teardown();
  g_dev = g_cpu = NULL;
}

TEST_MAIN(TEST_ENTRY(names), TEST_ENTRY(gather_scatter_all_layouts),
          TEST_ENTRY(methods_and_staging), TEST_ENTRY(vector_width_fallback),
          TEST_ENTRY(validation_nothing_copied), TEST_ENTRY(layout_validation),
          TEST_ENTRY(host_registration), TEST_ENTRY(two_streams_large),
          TEST_ENTRY(default_stream_wrap), TEST_ENTRY(many_ids_per_cta),
          TEST_ENTRY(launch_slots_reused_in_flight), TEST_ENTRY(scatter_ids_unique_flag),
          TEST_ENTRY(options_and_bandwidth), TEST_ENTRY(calibration_cache),
          TEST_ENTRY(destroy_all))
