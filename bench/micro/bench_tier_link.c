/* SPDX-License-Identifier: Apache-2.0 */
/* The engine save/load path (kvp_tier_save: a gather straight into reserved
 * DRAM slots of a store registered with the device; kvp_tier_load: a scatter straight out of the DRAM slots when
 * the store's region is registered with the device) on the CPU backend or
 * a GPU (--backend cuda), against, in the same run: the same load from a
 * store whose region is not registered with the device (get -> staging ->
 * scatter: the path before loads went in place), the straightforward loop
 * an engine would write (one gather + kvp_tier_put per block; one
 * kvp_tier_get + scatter per block), the kernels' gather alone into
 * registered host memory (the ceiling of a save) and one memcpy of the same bytes.  DRAM
 * tier only (NVMe reads: see bench_tier).  --quick checks that every load
 * returns the saved bytes. */
#include <stdbool.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"

#define LAYERS 8
#define BS 16

typedef struct fx {
  kvp_device *dev;
  kvp_kv_layout *lay;
  void *k[LAYERS], *v[LAYERS];
  size_t tbytes, stride;
  uint64_t bb;
  uint32_t nblocks;
} fx;

static void fx_init(fx *f, kvp_device *dev, uint32_t heads, uint32_t nblocks) {
  memset(f, 0, sizeof *f);
  f->dev = dev;
  f->nblocks = nblocks;
  f->stride = (size_t)BS * heads * 128 * 2;
  f->tbytes = f->stride * nblocks;
  uint64_t s = 0x9E3779B97F4A7C15ull;
  for (int l = 0; l < LAYERS; l++) {
    void **p[2] = {&f->k[l], &f->v[l]};
    for (int j = 0; j < 2; j++) {
      int rc = kvp_device_alloc(dev, f->tbytes, p[j]);
      if (rc < 0)
        bench_die("kvp_device_alloc", rc);
      uint64_t *w = malloc(f->tbytes);
      if (w == NULL)
        bench_die("malloc", KVP_ENOMEM);
      for (size_t i = 0; i < f->tbytes / 8; i++)
        w[i] = (s += 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
      if ((rc = kvp_device_memcpy(dev, *p[j], w, f->tbytes)) < 0)
        bench_die("kvp_device_memcpy", rc);
      free(w);
    }
  }
  kvp_kv_layout_desc d = {.kind = KVP_LAYOUT_VLLM_NHD, .num_layers = LAYERS,
                          .num_blocks = nblocks, .block_size = BS,
                          .num_kv_heads = heads, .head_dim = 128,
                          .elem_size = 2, .k_layers = f->k, .v_layers = f->v};
  int rc = kvp_kv_layout_create(dev, &d, &f->lay);
  if (rc < 0)
    bench_die("kvp_kv_layout_create", rc);
  kvp_kv_layout_info info;
  kvp_kv_layout_info_get(f->lay, &info);
  f->bb = info.block_bytes;
}

static void fx_free(fx *f) {
  kvp_kv_layout_destroy(f->lay);
  for (int l = 0; l < LAYERS; l++) {
    kvp_device_free(f->dev, f->k[l]);
    kvp_device_free(f->dev, f->v[l]);
  }
}

typedef struct res {
  double save, load, staged_load, naive_save, naive_load, memcpy_; /* GB/s, best of reps */
  double gather; /* the kernels alone: one gather into registered host memory */
} res;

/* A store of dram bytes with the bench namespace, registered with dev or
 * not, and a link to it. */
static void store_open(kvp_device *dev, fx *f, uint64_t dram, bool reg,
                       const kvp_namespace *ns, kvp_tier_store **t,
                       kvp_tier_link **l) {
  kvp_tier_opts o = {.dram_bytes = dram};
  if (reg)
    kvp_tier_opts_set_device(&o, dev);
  int rc = kvp_tier_create(&o, NULL, t);
  if (rc < 0)
    bench_die("kvp_tier_create", rc);
  kvp_tier_ns_add(*t, ns, &(kvp_tier_ns_opts){.block_bytes = f->bb});
  if ((rc = kvp_tier_link_create(*t, dev, f->lay, ns, NULL, NULL, l)) < 0)
    bench_die("kvp_tier_link_create", rc);
}

/* Block dst[i] of every tensor == block src[i]; dies otherwise. */
static void check_loaded(kvp_device *dev, const fx *f, const uint32_t *src,
                         const uint32_t *dst, uint32_t n, const char *what) {
  uint8_t *a = malloc(f->stride), *b = malloc(f->stride);
  if (a == NULL || b == NULL)
    bench_die("malloc", KVP_ENOMEM);
  for (int lyr = 0; lyr < 2 * LAYERS; lyr++) {
    const uint8_t *t = lyr < LAYERS ? f->k[lyr] : f->v[lyr - LAYERS];
    for (uint32_t i = 0; i < n; i++) {
      if (kvp_device_memcpy(dev, a, t + (size_t)dst[i] * f->stride, f->stride) < 0 ||
          kvp_device_memcpy(dev, b, t + (size_t)src[i] * f->stride, f->stride) < 0)
        bench_die("kvp_device_memcpy", KVP_EIO);
      if (memcmp(a, b, f->stride)) {
        fprintf(stderr, "%s: %s: block %u loaded wrong bytes\n", bench_name, what, i);
        exit(1);
      }
    }
  }
  free(a), free(b);
}

static double best(double a, double b) { return a > b ? a : b; }

/* GB/s of the kernels alone: blocks src[0..n) in one gather into host
 * memory registered with the device (the ceiling a save into DRAM slots
 * has to meet). */
static double gather_alone(kvp_device *dev, const fx *f, const uint32_t *src,
                           uint32_t n, uint8_t *host, double gb) {
  int rc = kvp_device_host_register(dev, host, (size_t)n * f->bb);
  if (rc < 0)
    bench_die("kvp_device_host_register", rc);
  kvp_xfer x = {.layout = f->lay, .block_ids = src, .n = n,
                .staging = host, .staging_bytes = (uint64_t)n * f->bb};
  uint64_t t0 = kvp_now_ns();
  if ((rc = kvp_device_gather(dev, NULL, &x)) < 0 ||
      (rc = kvp_device_synchronize(dev)) < 0)
    bench_die("kvp_device_gather", rc);
  double v = gb / bench_secs_since(t0);
  kvp_device_host_unregister(dev, host);
  return v;
}

static void run_size(kvp_device *dev, uint32_t heads, uint64_t total,
                     int reps, bool quick, res *r) {
  fx f;
  /* half the cache is saved, loaded into the other half */
  uint32_t n = (uint32_t)(total / ((uint64_t)BS * heads * 128 * 2 * 2 * LAYERS));
  n = n < 4 ? 4 : n;
  fx_init(&f, dev, heads, 2 * n);
  double gb = (double)n * (double)f.bb / 1e9;
  kvp_namespace_desc nd = {.model_id = "bench", .tokenizer_id = "t",
                           .kv_layout = "vllm-nhd:bf16", .block_size = BS};
  kvp_namespace ns;
  kvp_namespace_init(&nd, &ns);
  const uint64_t dram = (uint64_t)(reps + 2) * n * f.bb * 2 + (8u << 20);
  kvp_tier_store *t, *t2; /* t: region registered (in-place loads); t2: not */
  kvp_tier_link *l, *l2;
  store_open(dev, &f, dram, true, &ns, &t, &l);
  store_open(dev, &f, (uint64_t)n * f.bb + (8u << 20), false, &ns, &t2, &l2);
  uint32_t *src = malloc(n * sizeof *src), *dst = malloc(n * sizeof *dst);
  kvp_key *keys = malloc(n * sizeof *keys);
  int *out = malloc(n * sizeof *out);
  uint8_t *a = malloc(n * f.bb), *b = malloc(n * f.bb);
  void *one = aligned_alloc(4096, (f.bb + 4095) / 4096 * 4096);
  if (!src || !dst || !keys || !out || !a || !b || !one ||
      kvp_device_host_register(dev, one, (f.bb + 4095) / 4096 * 4096) < 0)
    bench_die("malloc", KVP_ENOMEM);
  int rc;
  for (uint32_t i = 0; i < n; i++)
    src[i] = (i * 7919u) % n, dst[i] = n + (i * 104729u) % n;
  memset(a, 1, n * f.bb), memset(b, 2, n * f.bb);
  memset(r, 0, sizeof *r);
  for (int rep = 0; rep < reps; rep++) {
    /* fresh keys: a re-put of a stored key is a no-op */
    for (uint32_t i = 0; i < n; i++)
      keys[i] = (kvp_key){(uint64_t)rep * 2 + 1, i};
    uint64_t t0 = kvp_now_ns();
    if ((rc = kvp_tier_save(l, NULL, keys, src, n, NULL, out)) != (int)n)
      bench_die("kvp_tier_save", rc < 0 ? rc : KVP_ENOSPC);
    r->save = best(r->save, gb / bench_secs_since(t0));
    t0 = kvp_now_ns();
    if ((rc = kvp_tier_load(l, NULL, keys, dst, n, out)) != (int)n)
      bench_die("kvp_tier_load", rc < 0 ? rc : KVP_ENOENT);
    r->load = best(r->load, gb / bench_secs_since(t0));
    if (quick)
      check_loaded(dev, &f, src, dst, n, "in-place load");
    /* the same through the staging buffer: a store not registered */
    if ((rc = kvp_tier_save(l2, NULL, keys, src, n, NULL, out)) != (int)n)
      bench_die("kvp_tier_save (unregistered store)", rc < 0 ? rc : KVP_ENOSPC);
    t0 = kvp_now_ns();
    if ((rc = kvp_tier_load(l2, NULL, keys, dst, n, out)) != (int)n)
      bench_die("kvp_tier_load (unregistered store)", rc < 0 ? rc : KVP_ENOENT);
    r->staged_load = best(r->staged_load, gb / bench_secs_since(t0));
    for (uint32_t i = 0; i < n; i++) /* room for the next rep */
      kvp_tier_evict(t2, &ns, keys[i]);
    /* the straightforward loop: a launch and a store call per block */
    for (uint32_t i = 0; i < n; i++)
      keys[i] = (kvp_key){(uint64_t)rep * 2 + 2, i};
    t0 = kvp_now_ns();
    for (uint32_t i = 0; i < n; i++) {
      kvp_xfer x = {.layout = f.lay, .block_ids = &src[i], .n = 1,
                    .staging = one, .staging_bytes = f.bb};
      if (kvp_device_gather(dev, NULL, &x) < 0 || kvp_device_synchronize(dev) < 0 ||
          kvp_tier_put(t, &ns, keys[i], one, f.bb, NULL) != 1)
        bench_die("naive save", KVP_EIO);
    }
    r->naive_save = best(r->naive_save, gb / bench_secs_since(t0));
    t0 = kvp_now_ns();
    for (uint32_t i = 0; i < n; i++) {
      size_t len;
      kvp_xfer x = {.layout = f.lay, .block_ids = &dst[i], .n = 1,
                    .staging = one, .staging_bytes = f.bb};
      if (kvp_tier_get(t, &ns, keys[i], one, f.bb, &len) < 0 ||
          kvp_device_scatter(dev, NULL, &x) < 0 || kvp_device_synchronize(dev) < 0)
        bench_die("naive load", KVP_EIO);
    }
    r->naive_load = best(r->naive_load, gb / bench_secs_since(t0));
    r->gather = best(r->gather, gather_alone(dev, &f, src, n, a, gb));
    t0 = kvp_now_ns();
    memcpy(b, a, n * f.bb);
    r->memcpy_ = best(r->memcpy_, gb / bench_secs_since(t0));
    a[rep] = b[n * f.bb - 1 - (size_t)rep]; /* keep the copy */
  }
  if (quick) /* the last load: the per-block loop's */
    check_loaded(dev, &f, src, dst, n, "per-block load");
  kvp_device_host_unregister(dev, one);
  free(one);
  free(src), free(dst), free(keys), free(out), free(a), free(b);
  kvp_tier_link_destroy(l);
  kvp_tier_destroy(t);
  kvp_tier_link_destroy(l2);
  kvp_tier_destroy(t2);
  fx_free(&f);
}

static const bench_col cols[] = {
    {"block", 0},          {"link save", 0},
    {"gather alone", 0},   {"**save / gather**", 0},
    {"per-block save", 0}, {"**ratio**", 0},
    {"link load (in place)", 0}, {"load through staging", 0},
    {"**in place / staging**", 0}, {"per-block load", 0},
    {"**ratio**", 0},      {"memcpy", 0},
    {"save / memcpy", 0},  {"load / memcpy", 0}};
static const bench_table table = {BENCH_MARKDOWN, 0, cols, 14};

static void report(uint64_t block_bytes, const res *r) {
  bench_row w = bench_row_start(&table);
  bench_cell(&w, "%" PRIu64 " KiB", block_bytes >> 10);
  bench_cell(&w, "%.2f", r->save);
  bench_cell(&w, "%.2f", r->gather);
  bench_cell_ratio(&w, r->save, r->gather, 2, false);
  bench_cell(&w, "%.2f", r->naive_save);
  bench_cell_ratio(&w, r->save, r->naive_save, 2, true);
  bench_cell(&w, "%.2f", r->load);
  bench_cell(&w, "%.2f", r->staged_load);
  bench_cell_ratio(&w, r->load, r->staged_load, 2, true);
  bench_cell(&w, "%.2f", r->naive_load);
  bench_cell_ratio(&w, r->load, r->naive_load, 2, true);
  bench_cell(&w, "%.2f", r->memcpy_);
  bench_cell_ratio(&w, r->save, r->memcpy_, 2, false);
  bench_cell_ratio(&w, r->load, r->memcpy_, 2, false);
  bench_row_end(&w, NULL);
  fflush(stdout);
}

typedef struct opts {
  bool quick;
  int cpu, reps;
  uint64_t mb;
  const char *backend;
} opts;

/* Returns the backend, or -1 after the usage. */
static int parse(int argc, char **argv, opts *o) {
  *o = (opts){.cpu = 0, .reps = 5, .mb = 32, .backend = "cpu"};
  bench_opt t[] = {
      BENCH_OPT("quick", BENCH_FLAG, &o->quick, NULL,
                "1 rep of 4 MiB; checks that every loaded block equals its "
                "saved one"),
      BENCH_OPT("cpu", BENCH_INT, &o->cpu, "N",
                "pin to this CPU (-1: unpinned)"),
      BENCH_OPT("reps", BENCH_INT, &o->reps, "N", "reps (the best is kept)"),
      BENCH_OPT("mb", BENCH_U64, &o->mb, "MiB", "bytes saved per rep"),
      BENCH_OPT("backend", BENCH_STR, &o->backend, "cpu|cuda|hip",
                "the device backend"),
      BENCH_OPT_END};
  if (bench_parse("bench_tier_link",
                  "kvp_tier_save/load against the load through staging, the "
                  "per-block loop and\none memcpy (DRAM tier).  Options given "
                  "explicitly win over --quick's.\n",
                  t, argc, argv) < 0)
    return -1;
  if (o->quick && !bench_given(t, "reps"))
    o->reps = 1;
  if (o->quick && !bench_given(t, "mb"))
    o->mb = 4;
  if (o->reps < 1)
    o->reps = 1;
  const char *b = o->backend;
  int backend = !strcmp(b, "cpu") ? KVP_BACKEND_CPU : !strcmp(b, "cuda") ? KVP_BACKEND_CUDA
                : !strcmp(b, "hip") ? KVP_BACKEND_HIP : -1;
  if (backend < 0)
    fprintf(stderr, "%s: --backend cpu|cuda|hip\n", bench_name);
  return backend;
}

int main(int argc, char **argv) {
  opts o;
  int backend = parse(argc, argv, &o);
  if (backend < 0)
    return 2;
  uint64_t total = o.mb << 20;
  char why[256];
  if (!kvp_backend_available((kvp_backend)backend, why, sizeof why)) {
    printf("SKIP: %s backend: %s\n", kvp_backend_name((kvp_backend)backend), why);
    return 77;
  }
  kvp_device *dev;
  int rc = kvp_device_create(&(kvp_device_opts){.backend = (kvp_backend)backend},
                             NULL, &dev);
  if (rc < 0)
    bench_die("kvp_device_create", rc);
  bench_pin_cpu(o.cpu); /* after the driver's threads exist */
  printf("# kvp_tier_save/load vs the load through staging (store not registered)\n"
         "# vs per-block gather+put / get+scatter vs one memcpy;\n"
         "# %s, DRAM tier, vLLM NHD %d layers x K/V, head_dim 128, bf16;\n"
         "# %" PRIu64 " MiB saved per rep, best of %d reps, GB/s = 1e9 B/s\n",
         kvp_device_name(dev), LAYERS, total >> 20, o.reps);
  bench_table_head(&table, NULL);
  static const uint32_t heads[] = {1, 4, 8, 32}; /* 64 KiB .. 2 MiB blocks */
  for (size_t i = 0; i < sizeof heads / sizeof heads[0]; i++) {
    res r;
    run_size(dev, heads[i], total, o.reps, o.quick, &r);
    report((uint64_t)BS * heads[i] * 128 * 2 * 2 * LAYERS, &r);
  }
  kvp_device_destroy(dev);
  if (o.quick)
    printf("# quick: every loaded block equals its saved block\n");
  return 0;
}
