/* SPDX-License-Identifier: Apache-2.0 */
/* bench_kernels: kvplane's gather/scatter against the ways engines move
 * paged KV today, in the same process, same pages, same buffers:
 *   per-page cuMemcpyAsync (what most offload code does), one
 *   cuMemcpyBatchAsync call (CUDA 12.8+, looked up with cuGetProcAddress),
 *   the bulk pinned copy of the same bytes (the link's ceiling), and for
 *   device-to-device the bulk D2D memcpy.
 * 8,192 random pages (of a cache twice as large: few adjacent runs), page
 * sizes 2..256 KiB, both directions; median of --reps timed runs after
 * --warmup untimed ones (CUDA events); host submit time per call from the
 * host clock.  Every method's staging is compared with the kernel's.
 *
 *   bench_kernels [--pages 8192] [--reps 15] [--warmup 3] [--ctas 16]
 *                 [--threads 512] [--sizes 2,4,16,64,256] [--cpu N] [--help]
 * Needs the CUDA backend (exits 77 saying why without it). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_api.h"
#include "kernels_internal.h"
#include "bench_util.h"
#include "kvplane.h"

#define CHECK(x)                                                                \
  do {                                                                          \
    int rc_ = (x);                                                              \
    if (rc_ < 0) {                                                              \
      fprintf(stderr, "bench_kernels: %s:%d: %s: %s\n", __FILE__, __LINE__,     \
              #x, kvp_strerror(rc_));                                           \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)
#define CU(x)                                                                   \
  do {                                                                          \
    CUresult r_ = (x);                                                          \
    if (r_ != CUDA_SUCCESS) {                                                   \
      const char *nm_ = "?";                                                    \
      cu->cuGetErrorName(r_, &nm_);                                             \
      fprintf(stderr, "bench_kernels: %s:%d: %s: %s\n", __FILE__, __LINE__,     \
              #x, nm_);                                                         \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

static const kvp_cuda_api *cu;
static CUstream st;
static CUevent ev0, ev1;
static int reps = 15, warmup = 3;
static int g_sms;

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

typedef void (*op_fn)(void *ctx);
typedef struct timing {
  double gpu_ms;    /* median, events */
  double submit_us; /* median host time of the submitting call(s) */
  double submit_p90_us;
} timing;

static double p90(double *v, int n) { /* v sorted by median() */
  return v[(n * 9) / 10 < n ? (n * 9) / 10 : n - 1];
}

/* The gate: the stream waits on a mapped host word before the start event,
 * and the host opens it once the operation is submitted, so the events
 * time the device's work and not the host's submission (reported apart).
 * Only for operations of a few commands: thousands queued behind a closed
 * gate could fill the driver's queue and block the submitting thread. */
static CUresult (*wait_value32)(CUstream, CUdeviceptr, uint32_t, unsigned);
static volatile uint32_t *gate;
static CUdeviceptr gate_dev;
static uint32_t gate_gen;

/* Watchdog: should a submission block behind the closed gate (the driver's
 * queue full), it opens the gate after 200 ms and the run is flagged. */
static _Atomic uint64_t gate_armed_at; /* 0: not armed */
static _Atomic int gate_forced, watchdog_stop;
static void *watchdog(void *arg) {
  (void)arg;
  while (!atomic_load(&watchdog_stop)) {
    uint64_t t = atomic_load(&gate_armed_at);
    if (t && kvp_now_ns() - t > 200000000ull) {
      __atomic_store_n(gate, gate_gen, __ATOMIC_RELEASE);
      atomic_store(&gate_forced, 1);
      atomic_store(&gate_armed_at, 0);
    }
    usleep(1000);
  }
  return NULL;
}

/* The caller's id list is rewritten (untimed) right before each timed call,
 * as an engine builds its block list just before it transfers: the submit
 * time is the library's, not that of reloading a list last touched one
 * kernel (up to 40 ms of other work) ago. */
static op_fn pre_op; /* untimed, before each rep (submit_breakdown) */
static void *pre_ctx;
static uint32_t *ids_live;
static const uint32_t *ids_master;
static size_t ids_count;

static timing run_gated(op_fn op, void *ctx, bool gated) {
  double g[256], s[256];
  gated = gated && wait_value32;
  for (int i = 0; i < warmup + reps; i++) {
    if (pre_op)
      pre_op(pre_ctx);
    if (ids_live)
      memcpy(ids_live, ids_master, ids_count * sizeof *ids_live);
    if (gated) {
      CU(wait_value32(st, gate_dev, ++gate_gen, 0 /* GEQ */));
      atomic_store(&gate_armed_at, kvp_now_ns());
    }
    CU(cu->cuEventRecord(ev0, st));
    uint64_t t0 = kvp_now_ns();
    op(ctx);
    uint64_t t1 = kvp_now_ns();
    CU(cu->cuEventRecord(ev1, st));
    if (gated) {
      atomic_store(&gate_armed_at, 0);
      __atomic_store_n(gate, gate_gen, __ATOMIC_RELEASE);
    }
    CU(cu->cuEventSynchronize(ev1));
    float ms;
    CU(cu->cuEventElapsedTime(&ms, ev0, ev1));
    if (i >= warmup)
      g[i - warmup] = ms, s[i - warmup] = (t1 - t0) / 1e3;
  }
  if (gated && atomic_exchange(&gate_forced, 0))
    printf("(gate forced open by the watchdog: this figure includes submission)\n");
  double ms = median(g, reps), su = median(s, reps);
  return (timing){ms, su, p90(s, reps)};
}
static timing run(op_fn op, void *ctx) { return run_gated(op, ctx, true); }
static timing run_e2e(op_fn op, void *ctx) { return run_gated(op, ctx, false); }

/* ---- the operations ---------------------------------------------------------------------- */
typedef struct bctx {
  kvp_device *dev;
  kvp_stream *kst;
  kvp_kv_layout *lay;
  uint32_t *ids, n;
  uint64_t page;
  CUdeviceptr cache;  /* device: 2n pages */
  unsigned char *host; /* registered host staging: n pages */
  CUdeviceptr dstage; /* device staging: n pages */
  bool to_host;       /* D2H (gather) vs H2D (scatter) */
  bool d2d;
  uint32_t flags;     /* kvp_xfer.flags of op_kernel */
  CUdeviceptr *srcs, *dsts;
  size_t *sizes;
} bctx;

static void op_kernel(void *p) {
  bctx *b = p;
  kvp_xfer x = {.layout = b->lay, .block_ids = b->ids, .n = b->n,
                .method = KVP_XFER_KERNEL,
                .staging = b->d2d ? (void *)(uintptr_t)b->dstage : b->host,
                .staging_bytes = (uint64_t)b->n * b->page, .flags = b->flags};
  CHECK(b->to_host ? kvp_device_gather(b->dev, b->kst, &x)
                   : kvp_device_scatter(b->dev, b->kst, &x));
}
static void op_ours_ce(void *p) {
  bctx *b = p;
  kvp_xfer x = {.layout = b->lay, .block_ids = b->ids, .n = b->n,
                .method = KVP_XFER_COPY_ENGINE, .staging = b->host,
                .staging_bytes = (uint64_t)b->n * b->page};
  CHECK(b->to_host ? kvp_device_gather(b->dev, b->kst, &x)
                   : kvp_device_scatter(b->dev, b->kst, &x));
}
static void op_per_page(void *p) {
  bctx *b = p;
  for (uint32_t i = 0; i < b->n; i++) {
    CUdeviceptr dv = b->cache + (uint64_t)b->ids[i] * b->page;
    CUdeviceptr hv = (CUdeviceptr)(uintptr_t)(b->host + (uint64_t)i * b->page);
    CU(cu->cuMemcpyAsync(b->to_host ? hv : dv, b->to_host ? dv : hv, b->page, st));
  }
}
static void op_batch(void *p) {
  bctx *b = p;
  for (uint32_t i = 0; i < b->n; i++) {
    CUdeviceptr dv = b->cache + (uint64_t)b->ids[i] * b->page;
    CUdeviceptr hv = (CUdeviceptr)(uintptr_t)(b->host + (uint64_t)i * b->page);
    b->srcs[i] = b->to_host ? dv : hv;
    b->dsts[i] = b->to_host ? hv : dv;
    b->sizes[i] = b->page;
  }
  CUmemcpyAttributes at = {.srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM};
  size_t idx = 0, fail_idx = 0;
  if (cu->cuMemcpyBatchAsync13)
    CU(cu->cuMemcpyBatchAsync13(b->dsts, b->srcs, b->sizes, b->n, &at, &idx, 1, st));
  else
    CU(cu->cuMemcpyBatchAsync128(b->dsts, b->srcs, b->sizes, b->n, &at, &idx, 1,
                                 &fail_idx, st));
}
static void op_bulk(void *p) {
  bctx *b = p;
  CUdeviceptr h = (CUdeviceptr)(uintptr_t)b->host;
  uint64_t n = (uint64_t)b->n * b->page;
  if (b->d2d)
    CU(cu->cuMemcpyAsync(b->dstage, b->cache, n, st));
  else
    CU(cu->cuMemcpyAsync(b->to_host ? h : b->cache, b->to_host ? b->cache : h, n, st));
}

static double gbps(const bctx *b, timing t) {
  return (double)b->n * b->page / (t.gpu_ms * 1e6);
}

/* Host cost of one kvp_device_gather/scatter call, split: a 1-page call
 * (fixed costs: lock, launch, ids upload), a call rejected by its last id
 * (the validation pass over n ids), the full call. */
static void reject_with(bctx *b, uint32_t bad) {
  uint32_t keep = b->ids[b->n - 1];
  b->ids[b->n - 1] = bad;
  kvp_xfer x = {.layout = b->lay, .block_ids = b->ids, .n = b->n,
                .method = KVP_XFER_KERNEL, .staging = b->host,
                .staging_bytes = (uint64_t)b->n * b->page};
  int rc = b->to_host ? kvp_device_gather(b->dev, b->kst, &x)
                      : kvp_device_scatter(b->dev, b->kst, &x);
  b->ids[b->n - 1] = keep;
  if (rc != KVP_EINVAL) {
    fprintf(stderr, "bench_kernels: bad id not rejected\n");
    exit(1);
  }
}
/* rejected by the range check (the pass that copies ids + max) */
static void op_reject(void *p) { reject_with(p, 0xffffffffu); }
/* scatter rejected by the repeat check (range pass + stamp pass) */
static void op_reject_repeat(void *p) {
  bctx *b = p;
  reject_with(b, b->ids[0]);
}

/* Where a call's host time goes, each piece timed right after a full
 * transfer of this size (untimed, finished), as the real call is: a 1-page
 * call (lock, launch, event), a call refused by the range check (the pass
 * that copies the ids into the launch slot), for scatters one refused by
 * the repeat check (range pass + stamps), and the full call. */
static uint32_t full_n;
static void op_full_sync(void *p) {
  bctx *b = p;
  uint32_t n = b->n;
  b->n = full_n;
  op_kernel(b);
  b->n = n;
  CHECK(kvp_stream_synchronize(b->kst));
}

static void submit_breakdown(bctx *b) {
  for (int dir = 0; dir < 2; dir++) {
    b->to_host = dir == 0;
    uint32_t n = b->n;
    full_n = n;
    pre_op = op_full_sync, pre_ctx = b;
    timing full = run(op_kernel, b);
    b->n = 1;
    timing one = run(op_kernel, b);
    b->n = n;
    timing rej = run(op_reject, b);
    timing rr = {0, 0, 0};
    if (!b->to_host)
      rr = run(op_reject_repeat, b);
    pre_op = NULL, pre_ctx = NULL;
    printf("  %s submit us after a full transfer (median / p90): 1 page %.1f / %.1f, "
           "validation of %u ids %.1f / %.1f",
           b->to_host ? "D2H" : "H2D", one.submit_us, one.submit_p90_us, n,
           rej.submit_us, rej.submit_p90_us);
    if (!b->to_host)
      printf(", validation + repeat check %.1f / %.1f", rr.submit_us, rr.submit_p90_us);
    printf(", full call %.1f / %.1f\n", full.submit_us, full.submit_p90_us);
  }
}

/* The full call's host time in the three places an engine makes it, each
 * rep a fresh transfer of this size first:
 *   sync:   right after cuStreamSynchronize returned on it (the table's
 *           column is measured this way);
 *   later:  1 ms of other host work after that (no driver call): whether a
 *           slow call right after the sync is a passing state of the driver;
 *   spin:   right after the host waited for it by spinning on a mapped word
 *           the stream wrote behind it (no driver call, no pause while
 *           waiting): whether the driver's own wait is what costs;
 *   flight: while it still runs (an engine queues its next transfer behind
 *           the current one without waiting; the thread is warm).
 * And the CPU-only id pass (copy + max of n ids into a pinned buffer, the
 * dispatching build) in the same three places: how much of a slow call is
 * a cold CPU rather than the driver. */
static CUresult (*write_value32)(CUstream, CUdeviceptr, uint32_t, unsigned);
static volatile uint32_t *spin_word;
static CUdeviceptr spin_word_dev;
static uint32_t spin_gen;
static uint32_t *pin_ids; /* pinned, n entries: the CPU-only pass's target */

enum { COND_SYNC, COND_LATER, COND_SPIN, COND_FLIGHT, COND_N };
static const char *const cond_names[COND_N] = {
    "after cuStreamSynchronize", "1 ms after it", "after a spin on a mapped word",
    "while the previous transfer runs"};

static void cond_enter(bctx *b, int c) {
  op_kernel(b);
  if (c == COND_SYNC || c == COND_LATER) {
    CHECK(kvp_stream_synchronize(b->kst));
    for (uint64_t t0 = kvp_now_ns(); c == COND_LATER && kvp_now_ns() - t0 < 1000000;)
      ;
  } else if (c == COND_SPIN) {
    CU(write_value32(st, spin_word_dev, ++spin_gen, 0));
    uint64_t t0 = kvp_now_ns();
    while (__atomic_load_n(spin_word, __ATOMIC_ACQUIRE) != spin_gen)
      if (kvp_now_ns() - t0 > 10000000000ull) {
        fprintf(stderr, "bench_kernels: the stream never wrote the spin word\n");
        exit(1);
      }
  }
  memcpy(ids_live, ids_master, ids_count * sizeof *ids_live);
}

#ifdef KVP_SUBMIT_TRACE
/* a trace build (-DKVP_SUBMIT_TRACE): the call's stages, medians */
static const char *const stage_names[KVP_TR_N - 1] = {
    "lock", "slot", "ids", "repeats", "staging", "plan", "launch", "unlock"};
static double stage_us[KVP_TR_N - 1][256];
static void stages_print(int c) {
  printf("    stages %s (us):", cond_names[c]);
  for (int k = 0; k < KVP_TR_N - 1; k++)
    printf(" %s %.1f", stage_names[k], median(stage_us[k], reps));
  printf("\n");
}
#endif

/* dir 2: the scatter again with KVP_XFER_IDS_UNIQUE (the repeat check on
 * the GPU instead of the host), and its GB/s end to end against the plain
 * scatter's, same run. */
static void submit_conditions(bctx *b) {
  if (!write_value32 || !pin_ids)
    return;
  for (int dir = 0; dir < 3; dir++) {
    b->to_host = dir == 0;
    b->flags = dir == 2 ? KVP_XFER_IDS_UNIQUE : 0;
    double call[COND_N][2], pass[COND_N];
    for (int c = 0; c < COND_N; c++) {
      double tc[256], tp[256];
      for (int i = 0; i < warmup + reps; i++) {
        cond_enter(b, c);
        uint64_t t0 = kvp_now_ns();
        op_kernel(b);
        uint64_t t1 = kvp_now_ns();
#ifdef KVP_SUBMIT_TRACE
        if (i >= warmup)
          for (int k = 0; k < KVP_TR_N - 1; k++)
            stage_us[k][i - warmup] =
                (double)(kvp__submit_trace[k + 1] - kvp__submit_trace[k]) / 1e3;
#endif
        CHECK(kvp_stream_synchronize(b->kst));
        cond_enter(b, c);
        uint64_t t2 = kvp_now_ns();
        volatile uint32_t m = kvp__ids_copy_max(pin_ids, b->ids, b->n);
        uint64_t t3 = kvp_now_ns();
        (void)m;
        CHECK(kvp_stream_synchronize(b->kst));
        if (i >= warmup)
          tc[i - warmup] = (t1 - t0) / 1e3, tp[i - warmup] = (t3 - t2) / 1e3;
      }
      call[c][0] = median(tc, reps), call[c][1] = p90(tc, reps);
      pass[c] = median(tp, reps);
#ifdef KVP_SUBMIT_TRACE
      stages_print(c);
#endif
    }
    printf("  %s full call, host us (median / p90):",
           dir == 0 ? "D2H" : dir == 1 ? "H2D" : "H2D with KVP_XFER_IDS_UNIQUE");
    for (int c = 0; c < COND_N; c++)
      printf("%s %s %.1f / %.1f", c ? ";" : "", cond_names[c], call[c][0], call[c][1]);
    printf(" | the id pass alone (copy + max of %u ids into pinned memory) in the "
           "same places: %.1f / %.1f / %.1f / %.1f\n", b->n, pass[0], pass[1], pass[2],
           pass[3]);
    if (dir == 2) { /* what the GPU check costs the transfer, end to end */
      double g1 = gbps(b, run(op_kernel, b));
      b->flags = 0;
      double g0 = gbps(b, run(op_kernel, b));
      printf("  H2D kernel GB/s e2e with KVP_XFER_IDS_UNIQUE %.1f, without %.1f (%.2fx)\n",
             g1, g0, g1 / g0);
    }
  }
  b->flags = 0;
}

/* CTA budget x threads per CTA at small pages, both directions. */
static void sweep(bctx *b, uint32_t ctas0, uint32_t threads0) {
  static const uint32_t cs[] = {8, 16}, ts[] = {256, 512, 1024};
  printf("\n%llu KiB pages, kernel by CTA budget x threads (bulk ceiling in "
         "brackets):\n", (unsigned long long)b->page / 1024);
  for (int dir = 0; dir < 2; dir++) {
    b->to_host = dir == 0;
    double gu = gbps(b, run(op_bulk, b));
    printf("  %s [%.1f GB/s]:", b->to_host ? "D2H" : "H2D", gu);
    for (int i = 0; i < 2; i++)
      for (int j = 0; j < 3; j++) {
        CHECK(kvp_device_set(b->dev, KVP_DEVOPT_CTA_BUDGET, cs[i]));
        CHECK(kvp_device_set(b->dev, KVP_DEVOPT_THREADS_PER_CTA, ts[j]));
        double g = gbps(b, run(op_kernel, b));
        printf("  %ux%u %.1f (%.2fx)", cs[i], ts[j], g, g / gu);
      }
    printf("\n");
  }
  /* device to device: whole-GPU grids */
  b->d2d = true, b->to_host = true;
  double gu = gbps(b, run(op_bulk, b));
  printf("  D2D [%.1f GB/s]:", gu);
  for (uint32_t m = 1; m <= 4; m *= 2)
    for (uint32_t t = 256; t <= 1024; t *= 2) {
      CHECK(kvp_device_set(b->dev, KVP_DEVOPT_CTA_BUDGET, m * (uint32_t)g_sms));
      CHECK(kvp_device_set(b->dev, KVP_DEVOPT_THREADS_PER_CTA, t));
      double g = gbps(b, run(op_kernel, b));
      printf("  %ux%u %.1f (%.2fx)", m * g_sms, t, g, g / gu);
    }
  b->d2d = false;
  CHECK(kvp_device_set(b->dev, KVP_DEVOPT_CTA_BUDGET, ctas0));
  CHECK(kvp_device_set(b->dev, KVP_DEVOPT_THREADS_PER_CTA, threads0));
  printf("\n\n");
}

static void fill(unsigned char *p, size_t n, uint64_t seed) {
  for (size_t i = 0; i + 8 <= n; i += 8) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    memcpy(p + i, &seed, 8);
  }
}

/* D2H staging of one method must equal the kernel's. */
static void cross_check(bctx *b, op_fn op, const unsigned char *ref,
                        const char *name) {
  memset(b->host, 0xff, (size_t)b->n * b->page);
  op(b);
  CU(cu->cuStreamSynchronize(st));
  CHECK(kvp_stream_synchronize(b->kst));
  if (memcmp(b->host, ref, (size_t)b->n * b->page)) {
    fprintf(stderr, "bench_kernels: %s moved different bytes than the kernel\n", name);
    exit(1);
  }
}

/* What the submit path's pieces cost on this host: a pass over 8192 ids,
 * 32 KiB copied into pageable, cuMemHostAlloc'd and cuMemHostRegister'ed
 * memory (the launch-argument slot is the second kind). */
static double per_us(uint64_t t0, int n) { return (kvp_now_ns() - t0) / 1e3 / n; }
static void host_costs(void) {
  enum { N = 8192, R = 200 };
  uint32_t *src = malloc(N * 4), *pg = malloc(N * 4), *reg = aligned_alloc(4096, N * 4);
  void *pin = NULL;
  CU(cu->cuMemHostAlloc(&pin, N * 4, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP));
  CU(cu->cuMemHostRegister(reg, N * 4, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP));
  for (int i = 0; i < N; i++)
    src[i] = (uint32_t)i * 2654435761u;
  volatile uint32_t sink = 0;
  uint64_t t0 = kvp_now_ns();
  for (int r = 0; r < R; r++) memcpy(pg, src, N * 4), sink = pg[r];
  double tpg = per_us(t0, R);
  t0 = kvp_now_ns();
  for (int r = 0; r < R; r++) memcpy(pin, src, N * 4), sink = ((uint32_t *)pin)[r];
  double tpin = per_us(t0, R);
  t0 = kvp_now_ns();
  for (int r = 0; r < R; r++) memcpy(reg, src, N * 4), sink = reg[r];
  double treg = per_us(t0, R);
  /* the submit path's two id passes, each build side by side (the library
   * dispatches to AVX2 where the CPU has it) */
  double tmax[2] = {-1, -1}, tcm[2] = {-1, -1};
  for (int v = 0; v < 2; v++) {
#if defined(__x86_64__)
    if (v == 1 && !kvp__ids_have_avx2())
      continue;
    uint32_t (*mx)(const uint32_t *, uint32_t) = v ? kvp__ids_max_avx2 : kvp__ids_max_generic;
    uint32_t (*cm)(uint32_t *restrict, const uint32_t *restrict, uint32_t) =
        v ? kvp__ids_copy_max_avx2 : kvp__ids_copy_max_generic;
#else
    if (v == 1)
      continue;
    uint32_t (*mx)(const uint32_t *, uint32_t) = kvp__ids_max_generic;
    uint32_t (*cm)(uint32_t *restrict, const uint32_t *restrict, uint32_t) =
        kvp__ids_copy_max_generic;
#endif
    t0 = kvp_now_ns();
    for (int r = 0; r < R; r++) sink = mx(src, N);
    tmax[v] = per_us(t0, R);
    t0 = kvp_now_ns();
    for (int r = 0; r < R; r++) sink = cm(pin, src, N);
    tcm[v] = per_us(t0, R);
  }
  t0 = kvp_now_ns();
  for (int r = 0; r < R; r++) CU(cu->cuEventRecord(ev0, st));
  double trec = per_us(t0, R);
  CU(cu->cuStreamSynchronize(st));
  t0 = kvp_now_ns();
  for (int r = 0; r < R; r++) (void)kvp_now_ns();
  double tclk = per_us(t0, R);
  (void)sink;
  printf("\nhost costs (us, warm): copy 32 KiB into pageable %.2f, cuMemHostAlloc'd "
         "%.2f, cuMemHostRegister'ed %.2f; max over 8192 ids: generic %.2f, AVX2 "
         "%.2f; copy + max of 8192 ids into cuMemHostAlloc'd: generic %.2f, AVX2 "
         "%.2f (%.2fx); cuEventRecord %.2f; clock read %.3f\n", tpg, tpin, treg,
         tmax[0], tmax[1], tcm[0], tcm[1], tcm[1] > 0 ? tcm[0] / tcm[1] : 0.0,
         trec, tclk);
  CU(cu->cuMemHostUnregister(reg));
  CU(cu->cuMemFreeHost(pin));
  free(src), free(pg), free(reg);
}

/* ---- driver ------------------------------------------------------------------------------ */
typedef struct kopts {
  uint32_t pages, ctas, threads;
  int cpu;
  const char *sizes;
} kopts;

static int parse(int argc, char **argv, kopts *o) {
  *o = (kopts){.pages = 8192, .ctas = 16, .threads = 512, .cpu = -1,
               .sizes = "2,4,16,64,256"};
  bench_opt t[] = {
      BENCH_OPT("pages", BENCH_U32, &o->pages, "N",
                "random pages per transfer (of a cache twice as large)"),
      BENCH_OPT("reps", BENCH_INT, &reps, "N", "timed runs (median), 1..200"),
      BENCH_OPT("warmup", BENCH_INT, &warmup, "N", "untimed runs first, 0..50"),
      BENCH_OPT("ctas", BENCH_U32, &o->ctas, "N", "the kernels' CTA budget"),
      BENCH_OPT("threads", BENCH_U32, &o->threads, "N", "threads per CTA"),
      BENCH_OPT("sizes", BENCH_STR, &o->sizes, "2,4,16,64,256",
                "page sizes, KiB"),
      BENCH_OPT("cpu", BENCH_INT, &o->cpu, "N",
                "pin to this CPU once the driver's threads exist (-1: no)"),
      BENCH_OPT_END};
  if (bench_parse("bench_kernels",
                  "kvplane's gather/scatter against per-page cuMemcpyAsync, "
                  "cuMemcpyBatchAsync and\nthe bulk pinned copy.  Needs the "
                  "CUDA backend (exits 77 saying why without it).\n",
                  t, argc, argv) < 0)
    return -1;
  if (reps < 1 || reps > 200 || warmup < 0 || warmup > 50 || o->pages < 1) {
    fprintf(stderr, "bench_kernels: bad --reps/--warmup/--pages\n");
    return -1;
  }
  return 0;
}

/* The device measures its calibration (cache neither read nor written),
 * then a second device reads that calibration back from a cache file of
 * its own: both creation times, cached_ms < 0 when not read from it. */
static kvp_device *device_open(const kopts *o, double *create_ms,
                               double *cached_ms) {
  kvp_device *dev;
  kvp_device_opts d = {.backend = KVP_BACKEND_CUDA, .cta_budget = o->ctas,
                       .flags = KVP_DEVICE_NO_CALIBRATION_CACHE};
  uint64_t c0 = kvp_now_ns();
  CHECK(kvp_device_create(&d, NULL, &dev));
  *create_ms = (kvp_now_ns() - c0) / 1e6, *cached_ms = -1;
  char dir[] = "/tmp/kvp-bench-cal-XXXXXX", path[80];
  if (!mkdtemp(dir))
    return dev;
  snprintf(path, sizeof path, "%s/cal.txt", dir);
  kvp_device_opts oc = {.backend = KVP_BACKEND_CUDA, .cta_budget = o->ctas,
                        .calibration_cache = path};
  kvp_device *d2;
  CHECK(kvp_device_create(&oc, NULL, &d2)); /* measures, writes */
  kvp_device_destroy(d2);
  uint64_t c1 = kvp_now_ns();
  CHECK(kvp_device_create(&oc, NULL, &d2)); /* reads */
  *cached_ms = (kvp_now_ns() - c1) / 1e6;
  if (kvp_device_calibration_source(d2) != 2)
    *cached_ms = -1;
  kvp_device_destroy(d2);
  unlink(path);
  rmdir(dir);
  return dev;
}

/* The gate (cuStreamWaitValue32 on a mapped word) and its watchdog. */
static void gate_open(void) {
  void *fn = NULL;
  int status = 0;
  void *g = NULL;
  if (cu->cuGetProcAddress("cuStreamWaitValue32", &fn, 12000, 0, &status) ==
          CUDA_SUCCESS && fn &&
      cu->cuMemHostAlloc(&g, 64, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP) ==
          CUDA_SUCCESS &&
      cu->cuMemHostGetDevicePointer(&gate_dev, g, 0) == CUDA_SUCCESS) {
    *(void **)&wait_value32 = fn;
    gate = g;
    *gate = 0;
    pthread_t th;
    if (pthread_create(&th, NULL, watchdog, NULL) == 0)
      pthread_detach(th);
    else
      wait_value32 = NULL;
  }
}

/* The spin word (cuStreamWriteValue32) and the pinned id buffer of the
 * submit-conditions lines. */
static void spin_open(uint32_t pages) {
  void *fn = NULL, *w = NULL, *pi = NULL;
  int status = 0;
  if (cu->cuGetProcAddress("cuStreamWriteValue32", &fn, 12000, 0, &status) ==
          CUDA_SUCCESS && fn &&
      cu->cuMemHostAlloc(&w, 64, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP) ==
          CUDA_SUCCESS &&
      cu->cuMemHostGetDevicePointer(&spin_word_dev, w, 0) == CUDA_SUCCESS &&
      cu->cuMemHostAlloc(&pi, (size_t)pages * 4, CU_MEMHOSTALLOC_PORTABLE) ==
          CUDA_SUCCESS) {
    *(void **)&write_value32 = fn;
    spin_word = w;
    *spin_word = 0;
    pin_ids = pi;
  } else {
    printf("(cuStreamWriteValue32 or pinned memory unavailable: no submit-conditions lines)\n");
  }
}

/* The driver API, the bench's stream, events, gate and spin word; returns
 * kvplane's handle on the stream. */
static kvp_stream *cuda_open(kvp_device *dev, const kopts *o) {
  CHECK(kvp_device_set(dev, KVP_DEVOPT_THREADS_PER_CTA, o->threads));
  cu = kvp__cuda_api();
  CUcontext ctx;
  kvp__cuda_native(dev, &ctx, NULL, &g_sms);
  CU(cu->cuCtxSetCurrent(ctx));
  CU(cu->cuStreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CU(cu->cuEventCreate(&ev0, 0));
  CU(cu->cuEventCreate(&ev1, 0));
  kvp_stream *kst;
  CHECK(kvp_stream_wrap(dev, st, &kst));
  gate_open();
  spin_open(o->pages);
  return kst;
}

static void print_header(kvp_device *dev, const kopts *o, bool have_batch,
                         double create_ms, double cached_ms) {
  printf("device: %s, driver API %d, cuMemcpyBatchAsync: %s\n",
         kvp_device_name(dev), cu->driver_version,
         have_batch ? (cu->cuMemcpyBatchAsync13 ? "yes (CUDA 13 ABI)" : "yes (12.8 ABI)")
                    : "no");
  printf("kvp_device_create measuring its calibration: %.1f ms; reading it from "
         "the calibration cache: %.1f ms%s\n", create_ms, cached_ms,
         cached_ms < 0 ? " (FAILED: not read from the cache)" : "");
  printf("%u random pages of a %u-page cache; median of %d runs after %d warm-up; "
         "kernel: %u CTAs x %u threads\n", o->pages, 2 * o->pages, reps, warmup,
         o->ctas, o->threads);
  printf("GB/s from CUDA events; 'device': the stream held at a gate until the call "
         "was submitted (%s), so host submit time is apart (last column); 'e2e': "
         "no gate, the device waits for the submission too\n\n",
         wait_value32 ? "cuStreamWaitValue32" : "NOT AVAILABLE: device = e2e here");
}

/* ---- one page size: workload ----------------------------------------------------------- */
typedef struct sized {
  bctx b;
  unsigned char *ref, *tmp; /* the kernel's staging; the whole cache */
  uint32_t *master;         /* the shuffled ids, restored before each rep */
  size_t hbytes;
} sized;

static void *host_or_die(size_t n) {
  void *p = malloc(n);
  if (p == NULL) {
    fprintf(stderr, "bench_kernels: out of host memory\n");
    exit(1);
  }
  return p;
}

/* A 2n-page cache of random bytes on the device, n pages of registered host
 * staging, a shuffled id list and the layout over the cache. */
static void sized_open(sized *z, kvp_device *dev, kvp_stream *kst, uint32_t pages,
                       uint64_t page) {
  bctx *b = &z->b;
  *b = (bctx){.dev = dev, .kst = kst, .n = pages, .page = page};
  size_t nb = 2 * (size_t)pages;
  z->hbytes = (size_t)pages * page;
  CU(cu->cuMemAlloc(&b->cache, nb * page));
  CU(cu->cuMemAlloc(&b->dstage, z->hbytes));
  b->host = aligned_alloc(4096, z->hbytes);
  if (b->host == NULL) {
    fprintf(stderr, "bench_kernels: out of host memory\n");
    exit(1);
  }
  z->ref = host_or_die(z->hbytes), z->tmp = host_or_die(nb * page);
  b->ids = host_or_die(nb * sizeof *b->ids);
  b->srcs = host_or_die(pages * sizeof *b->srcs);
  b->dsts = host_or_die(pages * sizeof *b->dsts);
  b->sizes = host_or_die(pages * sizeof *b->sizes);
  fill(z->tmp, nb * page, page);
  CU(cu->cuMemcpy(b->cache, (CUdeviceptr)(uintptr_t)z->tmp, nb * page));
  fill(b->host, z->hbytes, page + 1);
  CHECK(kvp_device_host_register(dev, b->host, z->hbytes));
  uint64_t rng = page * 7919;
  for (uint32_t i = 0; i < nb; i++)
    b->ids[i] = i;
  for (uint32_t i = (uint32_t)nb - 1; i > 0; i--) {
    rng = rng * 6364136223846793005ull + 1442695040888963407ull;
    uint32_t j = (uint32_t)(((rng >> 32) * (i + 1)) >> 32), t = b->ids[i];
    b->ids[i] = b->ids[j], b->ids[j] = t;
  }
  z->master = host_or_die(nb * sizeof *z->master);
  memcpy(z->master, b->ids, nb * sizeof *z->master);
  ids_live = b->ids, ids_master = z->master, ids_count = nb;
  /* one 2-byte-element cross-layer page per block: 2 * bs * 64 * 2 = page */
  kvp_kv_layout_desc d = {.kind = KVP_LAYOUT_CROSS_LAYER, .num_layers = 1,
                          .num_blocks = (uint32_t)nb,
                          .block_size = (uint32_t)(page / 256),
                          .num_kv_heads = 1, .head_dim = 64, .elem_size = 2,
                          .base = (void *)(uintptr_t)b->cache};
  CHECK(kvp_kv_layout_create(dev, &d, &b->lay));
}

static void sized_close(sized *z) {
  bctx *b = &z->b;
  kvp_kv_layout_destroy(b->lay);
  CHECK(kvp_device_host_unregister(b->dev, b->host));
  CU(cu->cuMemFree(b->cache));
  CU(cu->cuMemFree(b->dstage));
  ids_live = NULL, ids_master = NULL, ids_count = 0;
  free(b->host), free(z->ref), free(z->tmp), free(b->ids), free(z->master),
      free(b->srcs), free(b->dsts), free(b->sizes);
}

/* Correctness first: the kernel's D2H bytes are the cache's pages, and
 * every other method's equal the kernel's. */
static void sized_check(sized *z, bool have_batch) {
  bctx *b = &z->b;
  b->to_host = true;
  memset(b->host, 0xff, z->hbytes);
  op_kernel(b);
  CHECK(kvp_stream_synchronize(b->kst));
  memcpy(z->ref, b->host, z->hbytes);
  for (uint32_t i = 0; i < b->n; i++)
    if (memcmp(z->ref + (uint64_t)i * b->page, z->tmp + (uint64_t)b->ids[i] * b->page,
               b->page)) {
      fprintf(stderr, "bench_kernels: kernel gathered wrong bytes (page %u)\n", i);
      exit(1);
    }
  cross_check(b, op_per_page, z->ref, "per-page cuMemcpyAsync");
  cross_check(b, op_ours_ce, z->ref, "kvplane copy engine");
  if (have_batch)
    cross_check(b, op_batch, z->ref, "cuMemcpyBatchAsync");
}

/* ---- one page size: measure + report ----------------------------------------------------- */
static const bench_col table_cols[] = {
    {"page", 0}, {"dir", 0}, {"kernel GB/s device", 0}, {"kernel GB/s e2e", 0},
    {"bulk pinned copy GB/s device", 0}, {"kernel / bulk", 0},
    {"per-page cuMemcpyAsync GB/s e2e", 0}, {"kernel / per-page (e2e)", 0},
    {"cuMemcpyBatchAsync GB/s device / e2e", 0},
    {"kernel / batch device / e2e", 0}, {"kvplane copy-engine path GB/s e2e", 0},
    {"host submit us: kernel / per-page / batch", 0}};
static const bench_table table = {BENCH_MARKDOWN, 0, table_cols, 12};

/* Both directions: the kernel (gated and e2e) against per-page copies,
 * the bulk copy, one batch call and kvplane's copy-engine path. */
static void measure_dirs(bctx *b, bool have_batch) {
  bench_table_head(&table, NULL);
  for (int dir = 0; dir < 2; dir++) {
    b->to_host = dir == 0;
    timing tk = run(op_kernel, b), tke = run_e2e(op_kernel, b);
    timing tp = run_e2e(op_per_page, b), tc = run_e2e(op_ours_ce, b);
    timing tu = run(op_bulk, b);
    timing tb = {0, 0, 0}, tbe = {0, 0, 0};
    if (have_batch)
      tb = run(op_batch, b), tbe = run_e2e(op_batch, b);
    double gk = gbps(b, tk), gke = gbps(b, tke), gu = gbps(b, tu);
    bench_row w = bench_row_start(&table);
    bench_cell(&w, "%llu KiB", (unsigned long long)b->page / 1024);
    bench_cell(&w, "%s", b->to_host ? "D2H" : "H2D");
    bench_cell(&w, "%.1f", gk);
    bench_cell(&w, "%.1f", gke);
    bench_cell(&w, "%.1f", gu);
    bench_cell_ratio(&w, gk, gu, 2, true);
    bench_cell(&w, "%.2f", gbps(b, tp));
    bench_cell_ratio(&w, gke, gbps(b, tp), 1, true);
    if (have_batch) {
      bench_cell(&w, "%.1f / %.1f", gbps(b, tb), gbps(b, tbe));
      bench_cell(&w, "%.1fx / **%.1fx**", gk / gbps(b, tb), gke / gbps(b, tbe));
    } else {
      bench_cell(&w, "n/a");
      bench_cell(&w, "n/a");
    }
    bench_cell(&w, "%.1f", gbps(b, tc));
    bench_cell(&w, "%.1f (p90 %.1f) / %.0f / %.0f", tk.submit_us,
               tk.submit_p90_us, tp.submit_us, tb.submit_us);
    bench_row_end(&w, NULL);
    fflush(stdout);
  }
}

/* D2D gather into device staging with the whole GPU vs the D2D memcpy. */
static void measure_d2d(sized *z, const kopts *o) {
  bctx *b = &z->b;
  b->d2d = true, b->to_host = true;
  CHECK(kvp_device_set(b->dev, KVP_DEVOPT_CTA_BUDGET, 2 * g_sms));
  CHECK(kvp_device_set(b->dev, KVP_DEVOPT_THREADS_PER_CTA, 512));
  timing tk = run(op_kernel, b);
  CU(cu->cuMemcpy((CUdeviceptr)(uintptr_t)z->ref, b->dstage, z->hbytes));
  CU(cu->cuMemcpy((CUdeviceptr)(uintptr_t)z->tmp, b->cache, 2 * (size_t)b->n * b->page));
  for (uint32_t i = 0; i < b->n; i++)
    if (memcmp(z->ref + (uint64_t)i * b->page, z->tmp + (uint64_t)b->ids[i] * b->page,
               b->page)) {
      fprintf(stderr, "bench_kernels: D2D gather moved wrong bytes (page %u)\n", i);
      exit(1);
    }
  timing tu = run(op_bulk, b);
  timing tke = run_e2e(op_kernel, b);
  bench_row w = bench_row_start(&table);
  bench_cell(&w, "%llu KiB", (unsigned long long)b->page / 1024);
  bench_cell(&w, "D2D");
  bench_cell(&w, "%.1f", gbps(b, tk));
  bench_cell(&w, "%.1f", gbps(b, tke));
  bench_cell(&w, "%.1f (D2D memcpy)", gbps(b, tu));
  bench_cell_ratio(&w, gbps(b, tk), gbps(b, tu), 2, true);
  for (int i = 0; i < 5; i++)
    bench_cell(&w, "%s", "");
  bench_cell(&w, "%.1f (%d CTAs)", tk.submit_us, 2 * g_sms);
  bench_row_end(&w, NULL);
  CHECK(kvp_device_set(b->dev, KVP_DEVOPT_CTA_BUDGET, o->ctas));
  CHECK(kvp_device_set(b->dev, KVP_DEVOPT_THREADS_PER_CTA, o->threads));
  fflush(stdout);
}

static void run_size(kvp_device *dev, kvp_stream *kst, const kopts *o,
                     uint64_t page, bool have_batch) {
  sized z;
  sized_open(&z, dev, kst, o->pages, page);
  sized_check(&z, have_batch);
  if (page <= 4096)
    sweep(&z.b, o->ctas, o->threads);
  submit_breakdown(&z.b);
  submit_conditions(&z.b);
  measure_dirs(&z.b, have_batch);
  measure_d2d(&z, o);
  sized_close(&z);
}

static void report_crossover(kvp_device *dev) {
  printf("\ncalibrated crossover (kvp_device_bandwidth_get):\n");
  for (uint64_t pg = 4096; pg <= (1u << 20); pg *= 4) {
    kvp_device_bandwidth h, dd;
    CHECK(kvp_device_bandwidth_get(dev, KVP_DIR_H2D, pg, &h));
    CHECK(kvp_device_bandwidth_get(dev, KVP_DIR_D2H, pg, &dd));
    printf("  %7llu B: H2D kernel %.1f / copy engine %.1f GB/s (auto: %s); "
           "D2H %.1f / %.1f (auto: %s)\n", (unsigned long long)pg,
           h.kernel_gbps, h.copy_engine_gbps,
           h.auto_method == KVP_XFER_KERNEL ? "kernel" : "copy engine",
           dd.kernel_gbps, dd.copy_engine_gbps,
           dd.auto_method == KVP_XFER_KERNEL ? "kernel" : "copy engine");
  }
}

int main(int argc, char **argv) {
  kopts o;
  if (parse(argc, argv, &o) < 0)
    return 2;
  char why[256];
  if (!kvp_backend_available(KVP_BACKEND_CUDA, why, sizeof why)) {
    printf("SKIP: bench_kernels needs the CUDA backend: %s\n", why);
    return 77;
  }
  double create_ms, cached_ms;
  kvp_device *dev = device_open(&o, &create_ms, &cached_ms);
  kvp_stream *kst = cuda_open(dev, &o);
  /* after the driver's and the watchdog's threads exist: they keep their
   * own CPUs */
  bench_pin_cpu(o.cpu);
  bool have_batch = cu->cuMemcpyBatchAsync13 || cu->cuMemcpyBatchAsync128;
  print_header(dev, &o, have_batch, create_ms, cached_ms);
  char sizes[128], *save = NULL;
  snprintf(sizes, sizeof sizes, "%s", o.sizes);
  for (char *tok = strtok_r(sizes, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
    run_size(dev, kst, &o, (uint64_t)atoi(tok) * 1024, have_batch);
  host_costs();
  report_crossover(dev);
  kvp_stream_destroy(kst);
  cu->cuEventDestroy(ev0);
  cu->cuEventDestroy(ev1);
  cu->cuStreamDestroy(st);
  kvp_device_destroy(dev);
  return 0;
}
