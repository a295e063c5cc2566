/* SPDX-License-Identifier: Apache-2.0 */
/* bench_tier: kvtier's DRAM and NVMe paths against their baselines, in one
 * run: DRAM put/get against memcpy over the same blocks; NVMe random reads
 * and writes at 16 KiB / 256 KiB / 2 MiB and queue depth 1 / 8 / 32 against
 * fio (io_uring engine, O_DIRECT, fixed buffers + registered files, same
 * file size, block size and depth; run as a subprocess, JSON parsed) and a
 * plain pread/pwrite loop (QD 1).  Reads are also compared with fio reading
 * kvtier's own slab file at its payload offsets (same file, same blocks,
 * same depth: what the file layout costs is then on both sides).  Prints
 * ratios.  kvtier's figures are payload bytes and include the checksum and,
 * for unaligned caller buffers, the copy; writes also move the slot's 4 KiB
 * header sector, plaintext reads move only the payload.
 *
 * Each cell alternates kvtier and its baselines --reps times (default 2)
 * and keeps the best of each.
 *
 *   bench_tier [--dir D] [--file-mb N] [--seconds S] [--cpu C] [--reps R]
 *              [--bs KiB] [--qd N] [--batch M] [--async] [--small-pages]
 *              [--quick]
 *
 * --batch M: M x QD keys per kvp_tier_get_batch (default 16, at most 256
 * keys): each batch uses that many distinct destination buffers and drains
 * the queue at its end.  Reads are run twice per rep: into plain buffers,
 * and with the same buffers registered (kvp_tier_register_buffers).
 * --async: each batch is two kvp_tier_get_async calls of half the keys,
 * both kept in flight (one is refilled while the other runs).
 * --contention: only the tables of what a caller of DRAM gets sees while
 * another thread's get_batch reads NVMe, with the reads releasing the
 * store's lock and holding it (bench_contention), and while another
 * thread's kvp_tier_load scatters DRAM blocks in place, pinned with the lock
 * released or under it (bench_link_contention).
 */
#include <dirent.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bench_util.h"
#include "kvplane.h"

typedef struct cfg {
  const char *dir;
  uint64_t file_bytes;
  double seconds;
  int cpu;
  bool quick;
  int reps;
  size_t only_bs;
  int only_qd;
  bool small_pages; /* read buffers of 4 KiB pages */
  int batch_mult;   /* keys per get_batch = batch_mult x QD (<= 256) */
  bool async;       /* reads as two kvp_tier_get_async halves in flight */
  bool contention;  /* only the --contention table */
} cfg;

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return rng;
}

static kvp_namespace bench_ns(void) {
  kvp_namespace_desc d = {.model_id = "bench", .block_size = 16};
  kvp_namespace ns;
  int rc = kvp_namespace_init(&d, &ns);
  if (rc < 0)
    bench_die("namespace", rc);
  return ns;
}

static void fill(uint8_t *b, size_t n, uint64_t k) {
  for (size_t i = 0; i + 8 <= n; i += 8) {
    uint64_t v = k * 0x9E3779B97F4A7C15ull + i;
    memcpy(b + i, &v, 8);
  }
}

/* ---- DRAM ----------------------------------------------------------------- */
static const bench_col dram_cols[] = {{"tier", 0},   {"block", 0},
                                      {"op", 0},     {"kvtier", 0},
                                      {"baseline", 0}, {"ratio", 0}};
static const bench_table dram_table = {BENCH_MARKDOWN, 0, dram_cols, 6};

static void dram_row(size_t bs, const char *op, double gbs, double memcpy_gbs) {
  bench_row w = bench_row_start(&dram_table);
  bench_cell(&w, "DRAM");
  bench_cell(&w, "%7zu KiB", bs >> 10);
  bench_cell(&w, "%s", op);
  bench_cell(&w, "%6.2f GB/s", gbs);
  bench_cell(&w, "memcpy %6.2f GB/s", memcpy_gbs);
  bench_cell_ratio(&w, gbs, memcpy_gbs, 2, false);
  bench_row_end(&w, NULL);
}

static void bench_dram(const cfg *c, size_t bs) {
  kvp_namespace ns = bench_ns();
  uint64_t region = c->quick ? (64u << 20) : (512u << 20);
  size_t n = (size_t)(region / 2 / bs);
  kvp_tier_opts o = {.dram_bytes = region};
  kvp_tier_store *t;
  int rc = kvp_tier_create(&o, NULL, &t);
  if (rc < 0)
    bench_die("kvp_tier_create", rc);
  kvp_tier_ns_add(t, &ns, &(kvp_tier_ns_opts){.block_bytes = bs});
  uint8_t *src = aligned_alloc(4096, bs), *dst = aligned_alloc(4096, bs);
  uint8_t **base = malloc(n * sizeof *base);
  for (size_t i = 0; i < n; i++)
    base[i] = aligned_alloc(64, bs);
  fill(src, bs, 1);
  /* put: kvtier (fixed slot) vs memcpy into preallocated blocks.  Both
   * first run once untimed: first-touch page faults (with THP, compaction)
   * are a warm-up cost, not the steady state measured here. */
  for (size_t i = 0; i < n; i++) {
    if ((rc = kvp_tier_put(t, &ns, (kvp_key){1, i}, src, bs, NULL)) != 1)
      bench_die("put", rc);
    memcpy(base[i], src, bs);
  }
  for (size_t i = 0; i < n; i++)
    kvp_tier_evict(t, &ns, (kvp_key){1, i});
  uint64_t t0 = kvp_now_ns();
  for (size_t i = 0; i < n; i++)
    if ((rc = kvp_tier_put(t, &ns, (kvp_key){1, i}, src, bs, NULL)) != 1)
      bench_die("put", rc);
  uint64_t tput = kvp_now_ns() - t0;
  t0 = kvp_now_ns();
  for (size_t i = 0; i < n; i++)
    memcpy(base[i], src, bs);
  uint64_t tcpy = kvp_now_ns() - t0;
  /* get: random blocks, kvtier vs memcpy */
  size_t gets = c->quick ? n : 4 * n;
  uint64_t tget = 0, tbase = 0;
  size_t len;
  for (int pass = 0; pass < 2; pass++) {
    rng = 12345;
    t0 = kvp_now_ns();
    for (size_t i = 0; i < gets; i++) {
      size_t k = rnd() % n;
      if (pass == 0) {
        if ((rc = kvp_tier_get(t, &ns, (kvp_key){1, k}, dst, bs, &len)) < 0)
          bench_die("get", rc);
      } else {
        memcpy(dst, base[k], bs);
      }
    }
    *(pass == 0 ? &tget : &tbase) = kvp_now_ns() - t0;
  }
  if (memcmp(dst, src, bs) != 0)
    bench_die("get returned wrong bytes", KVP_ECORRUPT);
  double gput = (double)n * bs / bench_secs(tput) / 1e9, gcpy = (double)n * bs / bench_secs(tcpy) / 1e9;
  double gget = (double)gets * bs / bench_secs(tget) / 1e9, gbase = (double)gets * bs / bench_secs(tbase) / 1e9;
  dram_row(bs, "put", gput, gcpy);
  dram_row(bs, "get", gget, gbase);
  for (size_t i = 0; i < n; i++)
    free(base[i]);
  free(base);
  free(src);
  free(dst);
  kvp_tier_destroy(t);
}

/* ---- fio ------------------------------------------------------------------- */
typedef struct result {
  double bps, iops;
  double cpu; /* kvtier: CPU seconds per wall second of the cell */
  int ok;
} result;

static double cpu_secs(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)ru.ru_utime.tv_sec + (double)ru.ru_stime.tv_sec +
         ((double)ru.ru_utime.tv_usec + (double)ru.ru_stime.tv_usec) / 1e6;
}

/* fio over [off, off + bytes) of file, random offsets on align boundaries
 * (from off): the whole fio file, or the payloads of a slab file's slots. */
static result run_fio(const cfg *c, const char *file, uint64_t bytes,
                      uint64_t off, uint64_t align, size_t bs, int qd,
                      int write) {
  char cmd[2048];
  result r = {0};
  char cpus[32] = "";
  if (c->cpu >= 0)
    snprintf(cpus, sizeof cpus, "--cpus_allowed=%d", c->cpu);
  snprintf(cmd, sizeof cmd,
           "fio --name=kvtier --filename=%s --size=%" PRIu64 " --offset=%" PRIu64
           " --blockalign=%" PRIu64 " --bs=%zu --iodepth=%d --rw=%s --ioengine=io_uring --direct=1 --fixedbufs "
           "--registerfiles --time_based --runtime=%.1f --ramp_time=0.2 "
           "--numjobs=1 --thread %s --randrepeat=0 --norandommap "
           "--output-format=json 2>/dev/null",
           file, bytes, off, align, bs, qd, write ? "randwrite" : "randread",
           c->seconds, cpus);
  FILE *p = popen(cmd, "r");
  if (p == NULL)
    return r;
  static char out[1 << 20];
  size_t n = fread(out, 1, sizeof out - 1, p);
  out[n] = 0;
  if (pclose(p) != 0)
    return r;
  json_error_t err;
  const char *brace = strchr(out, '{'); /* fio may print notes first */
  json_t *root = brace ? json_loads(brace, 0, &err) : NULL;
  json_t *job = root ? json_array_get(json_object_get(root, "jobs"), 0) : NULL;
  json_t *side = job ? json_object_get(job, write ? "write" : "read") : NULL;
  if (side != NULL) {
    r.bps = json_number_value(json_object_get(side, "bw_bytes"));
    r.iops = json_number_value(json_object_get(side, "iops"));
    r.ok = r.bps > 0;
  }
  json_decref(root);
  return r;
}

/* ---- pread/pwrite loop (QD 1) ------------------------------------------------*/
static result run_posix(const cfg *c, const char *file, size_t bs, int write) {
  result r = {0};
  int fd = open(file, O_RDWR | O_DIRECT);
  if (fd < 0)
    return r;
  uint8_t *b = aligned_alloc(4096, bs);
  fill(b, bs, 7);
  uint64_t blocks = c->file_bytes / bs, ops = 0, t0 = kvp_now_ns(), end;
  end = t0 + (uint64_t)(c->seconds * 1e9);
  while (kvp_now_ns() < end) {
    off_t off = (off_t)((rnd() % blocks) * bs);
    ssize_t k = write ? pwrite(fd, b, bs, off) : pread(fd, b, bs, off);
    if (k != (ssize_t)bs)
      break;
    ops++;
  }
  double s = bench_secs_since(t0);
  r.iops = (double)ops / s;
  r.bps = r.iops * (double)bs;
  r.ok = ops > 0;
  free(b);
  close(fd);
  return r;
}

/* ---- kvtier ---------------------------------------------------------------------*/
typedef struct kvt {
  kvp_tier_store *t;
  kvp_namespace ns;
  uint64_t next_key, blocks_cap;
} kvt;

static kvt kvt_open(const cfg *c, const char *dir, size_t bs, int qd) {
  kvt k = {.ns = bench_ns()};
  uint64_t slot = 512 + bs;
  kvp_tier_opts o = {.dram_bytes = c->quick ? (32u << 20) : (288u << 20),
                     .nvme_dir = dir, .nvme_bytes = c->file_bytes / bs * slot,
                     .queue_depth = (uint32_t)qd, .max_block_bytes = bs,
                     .no_promote = 1, .io_backend = KVP_TIER_IO_URING};
  int rc = kvp_tier_create(&o, NULL, &k.t);
  if (rc < 0)
    bench_die("kvp_tier_create (io_uring, nvme)", rc);
  kvp_tier_ns_add(k.t, &k.ns, &(kvp_tier_ns_opts){.block_bytes = bs});
  k.blocks_cap = c->file_bytes / bs;
  return k;
}

/* Writes: blocks put in DRAM (untimed), then written to NVMe by an idle
 * window (timed: header, checksum, staging copy, O_DIRECT writes at qd). */
static result kvt_write(const cfg *c, kvt *k, size_t bs, uint64_t min_blocks) {
  static uint8_t *src;
  static size_t src_bs;
  if (src_bs != bs) {
    free(src);
    src = aligned_alloc(4096, bs);
    src_bs = bs;
  }
  uint64_t dram = c->quick ? (24u << 20) : (256u << 20);
  uint64_t round = dram / bs < 256 ? dram / bs : 256, done = 0, tns = 0;
  uint64_t t_end = kvp_now_ns() + (uint64_t)(c->seconds * 1e9);
  kvp_tier_put_opts po = {.cls = KVP_CLASS_STABLE};
  while (kvp_now_ns() < t_end || done < min_blocks) {
    for (uint64_t i = 0; i < round; i++) {
      fill(src, bs, k->next_key);
      int rc = kvp_tier_put(k->t, &k->ns, (kvp_key){2, k->next_key++}, src, bs, &po);
      if (rc != 1)
        bench_die("put", rc);
    }
    uint64_t t0 = kvp_now_ns();
    int w = kvp_tier_idle(k->t, round * bs);
    tns += kvp_now_ns() - t0;
    if (w < 0 || (uint64_t)w != round) {
      kvp_tier_stats st;
      kvp_tier_stats_get(k->t, &st);
      fprintf(stderr, "bench_tier: idle wrote %d of %" PRIu64 " (io_errors %" PRIu64
              " short %" PRIu64 " nvme_blocks %" PRIu64 " dram_blocks %" PRIu64
              " nvme_used %" PRIu64 " of %" PRIu64 ")\n", w, round, st.io_errors,
              st.short_io, st.nvme_blocks, st.dram_blocks, st.nvme_used_bytes,
              st.nvme_bytes);
      bench_die("idle write-back wrote fewer blocks", w < 0 ? w : KVP_EIO);
    }
    done += round;
    kvp_tier_set(k->t, KVP_TIER_OPT_DRAM_BYTES, 0); /* on NVMe: no I/O */
    kvp_tier_set(k->t, KVP_TIER_OPT_DRAM_BYTES, (int64_t)dram);
  }
  result r = {.iops = (double)done / bench_secs(tns), .ok = 1};
  r.bps = r.iops * (double)bs;
  return r;
}

/* The caller's read buffers: like an engine's pinned host staging memory
 * (and kvtier's own DRAM region), 2 MiB-aligned and huge-page backed
 * (THP, madvise); --small-pages: 4 KiB pages.  On this VM, 4 KiB-page
 * destinations cost the device path up to ~1/3 of a 2 MiB read's
 * bandwidth (README), for any reader that uses many of them. */
static uint8_t *read_buf(const cfg *c, size_t bs) {
  size_t huge = 2u << 20, len = (bs + huge - 1) / huge * huge;
  if (c->small_pages) {
    uint8_t *q = aligned_alloc(4096, bs);
    if (q != NULL)
      memset(q, 0, bs);
    return q;
  }
  uint8_t *p = aligned_alloc(huge, len);
  if (p != NULL)
    madvise(p, len, MADV_HUGEPAGE); /* advisory: 4 KiB pages if refused */
  if (p != NULL) /* faulted in untimed, like a pinned pool (and fio's) */
    memset(p, 0, len);
  return p;
}

enum { READ_BUFS = 256 }; /* read buffers (and keys per batch at most) */

/* The read buffers, registered with the store's ring (untimed). */
static void register_bufs(kvt *k, uint8_t *const *bufs, size_t bs) {
  struct iovec iov[READ_BUFS];
  for (int i = 0; i < READ_BUFS; i++)
    iov[i] = (struct iovec){bufs[i], bs};
  int rc = kvp_tier_register_buffers(k->t, iov, READ_BUFS);
  if (rc != READ_BUFS)
    bench_die("kvp_tier_register_buffers", rc < 0 ? rc : KVP_ENOTSUP);
}

/* --quick: every block read from NVMe in [from, to) holds its bytes. */
static void check_reads(const kvp_key *keys, const int *res,
                        uint8_t *const *bufs, size_t from, size_t to,
                        size_t bs) {
  static uint8_t want[2 << 20];
  for (size_t i = from; i < to; i++) {
    fill(want, bs, keys[i].lo);
    if (res[i] == KVP_TIER_NVME && memcmp(want, bufs[i], bs) != 0)
      bench_die("NVMe get returned wrong bytes", KVP_ECORRUPT);
  }
}

/* reg: the read buffers (the engine's staging pool) are registered with
 * the store's ring (kvp_tier_register_buffers) before the timed loop and
 * unregistered after it, untimed: an engine registers its pool once. */
static result kvt_read(const cfg *c, kvt *k, size_t bs, int qd, int reg) {
  size_t bm = (size_t)c->batch_mult;
  size_t batch = (size_t)qd * bm < READ_BUFS ? (size_t)qd * bm : READ_BUFS;
  static uint8_t *bufs[READ_BUFS];
  static size_t bufs_bs;
  if (bufs_bs < bs) {
    for (int i = 0; i < READ_BUFS; i++) {
      free(bufs[i]);
      bufs[i] = read_buf(c, bs);
    }
    bufs_bs = bs;
  }
  kvp_key keys[READ_BUFS];
  size_t cap[READ_BUFS], len[READ_BUFS];
  int res[READ_BUFS];
  for (size_t i = 0; i < batch; i++)
    cap[i] = bs;
  if (reg)
    register_bufs(k, bufs, bs);
  kvp_tier_stats st;
  kvp_tier_stats_get(k->t, &st);
  uint64_t reg0 = st.nvme_reads_registered;
  uint64_t live = st.nvme_blocks; /* the newest ones: eviction is FIFO-like */
  uint64_t lo = k->next_key - live, ops = 0, misses = 0, t0 = kvp_now_ns();
  double c0 = cpu_secs();
  uint64_t end = t0 + (uint64_t)(c->seconds * 1e9);
  kvp_tier_set(k->t, KVP_TIER_OPT_DRAM_BYTES, 0);
  /* --async: the batch's two halves are two kvp_tier_get_async calls kept in
   * flight (the I/O thread runs one while this thread waits on the other);
   * else one kvp_tier_get_batch per batch */
  size_t nh = c->async ? 2 : 1, hn = batch / nh;
  kvp_ticket *tk[2] = {NULL, NULL};
  for (size_t s = 0;; s = (s + 1) % nh) {
    size_t o = s * hn;
    int h = 0;
    if (c->async && tk[s] != NULL) {
      h = kvp_ticket_wait(tk[s], 0);
      kvp_ticket_free(tk[s]);
      tk[s] = NULL;
      if (h < 0)
        bench_die("get_async", h);
      ops += (uint64_t)h, misses += hn - (size_t)h;
    }
    if (c->quick && h > 0)
      check_reads(keys, res, bufs, o, o + hn, bs);
    if (kvp_now_ns() >= end) {
      if (tk[(s + 1) % nh] == NULL)
        break;
      continue; /* collect the other half */
    }
    for (size_t i = o; i < o + hn; i++)
      keys[i] = (kvp_key){2, lo + rnd() % live};
    if (c->async) {
      int rc = kvp_tier_get_async(k->t, &k->ns, keys + o, hn,
                                  (void *const *)bufs + o, cap + o, len + o,
                                  res + o, &tk[s]);
      if (rc < 0)
        bench_die("get_async", rc);
      continue;
    }
    h = kvp_tier_get_batch(k->t, &k->ns, keys, batch, (void *const *)bufs,
                           cap, len, res);
    if (h < 0)
      bench_die("get_batch", h);
    ops += (uint64_t)h;
    misses += batch - (size_t)h;
    if (c->quick)
      check_reads(keys, res, bufs, 0, batch, bs);
  }
  if (misses * 20 > ops + misses)
    fprintf(stderr, "bench_tier: %" PRIu64 " misses of %" PRIu64 " reads (capacity evictions)\n",
            misses, ops + misses);
  double s = bench_secs_since(t0);
  result r = {.iops = (double)ops / s, .ok = ops > 0, .cpu = (cpu_secs() - c0) / s};
  r.bps = r.iops * (double)bs;
  kvp_tier_stats_get(k->t, &st);
  if (reg && st.nvme_reads_registered - reg0 < ops) /* every hit: fixed */
    bench_die("registered reads were not all fixed-buffer reads", KVP_EINVAL);
  if (!reg && st.nvme_reads_registered != reg0)
    bench_die("unregistered reads used fixed buffers", KVP_EINVAL);
  if (reg)
    kvp_tier_unregister_buffers(k->t);
  return r;
}

static void best(result *b, result r) {
  if (r.ok && r.bps > b->bps)
    *b = r;
}

static const bench_col nvme_cols[] = {
    {"NVMe op", 0}, {"block", 0}, {"QD", 0}, {"kvtier (payload)", 0},
    {"fio io_uring", 0}, {"kvtier/fio", 0}, {"fio on kvtier's slab file", 0},
    {"kvtier/fio-slab", 0}, {"pread/pwrite loop", 0}, {"kvtier/loop", 0},
    {"kvtier, registered buffers", 0}, {"registered/fio", 0}};
static const bench_table nvme_table = {BENCH_MARKDOWN, 0, nvme_cols, 12};

/* a measured rate, or `none` when the run did not happen */
static void cell_mbs(bench_row *w, result r, const char *none) {
  if (r.ok)
    bench_cell(w, "%7.0f MB/s", r.bps / 1e6);
  else
    bench_cell(w, "%s", none);
}

static void row(const char *what, size_t bs, int qd, result kv, result fio,
                result px, result slab, result kreg) {
  char cpu[16] = "";
  if (kv.cpu > 0)
    snprintf(cpu, sizeof cpu, " %3.0f%% cpu", kv.cpu * 100);
  bench_row w = bench_row_start(&nvme_table);
  bench_cell(&w, "NVMe %-5s", what);
  bench_cell(&w, "%5zu KiB", bs >> 10);
  bench_cell(&w, "%2d", qd);
  bench_cell(&w, "%7.0f MB/s %7.0f IOPS%s", kv.bps / 1e6, kv.iops, cpu);
  if (fio.ok)
    bench_cell(&w, "%7.0f MB/s %7.0f IOPS", fio.bps / 1e6, fio.iops);
  else
    bench_cell(&w, "n/a");
  bench_cell_ratio(&w, kv.bps, fio.ok ? fio.bps : 0, 2, false);
  cell_mbs(&w, slab, "-");
  bench_cell_ratio(&w, kv.bps, slab.ok ? slab.bps : 0, 2, false);
  cell_mbs(&w, px, "-");
  bench_cell_ratio(&w, kv.bps, px.ok ? px.bps : 0, 2, false);
  if (kreg.ok)
    bench_cell(&w, "%7.0f MB/s %3.0f%% cpu", kreg.bps / 1e6, kreg.cpu * 100);
  else
    bench_cell(&w, "-");
  bench_cell_ratio(&w, kreg.bps, kreg.ok && fio.ok ? fio.bps : 0, 2, false);
  bench_row_end(&w, NULL);
  fflush(stdout);
}

static void bench_nvme(const cfg *c, size_t bs, const int *qds, int nqd,
                       int have_fio) {
  char kdir[512], ffile[512];
  snprintf(kdir, sizeof kdir, "%s/kvtier-%zu", c->dir, bs);
  snprintf(ffile, sizeof ffile, "%s/fio-%" PRIu64 ".dat", c->dir, c->file_bytes);
  mkdir(kdir, 0700);
  char rm[600];
  snprintf(rm, sizeof rm, "rm -f %s/*.slab", kdir);
  for (int q = 0; q < nqd; q++) {
    if (system(rm) != 0) /* a fresh store: no recovered blocks */
      fprintf(stderr, "bench_tier: could not clean %s\n", kdir);
    kvt k = kvt_open(c, kdir, bs, qds[q]);
    if (q == 0) {
      kvp_tier_stats st;
      kvp_tier_stats_get(k.t, &st);
      if (!st.io_uring)
        bench_die("io_uring unavailable", KVP_ENOTSUP);
    }
    /* fill the slab file once, untimed: the first write into fallocated
     * space also converts its extents; the timed pass rewrites slots */
    kvt_write(&(cfg){.quick = c->quick, .seconds = 0}, &k, bs, k.blocks_cap);
    /* kvtier and its baselines alternate, c->reps times each, and the best
     * of each is kept: on a shared, noisy machine a slow second hits both */
    result kw = {0}, fw = {0}, pw = {0}, kr = {0}, fr = {0}, pr = {0};
    result none = {0}, sr = {0}, kg = {0};
    char sfile[600];
    struct stat sb;
    uint64_t slot = 4096 + bs; /* header sector + payload (class = bs) */
    snprintf(sfile, sizeof sfile, "%s/kvtier-%zu.slab", kdir, bs);
    result kw0 = {0}; /* KVP_TIER_OPT_STAGE_AHEAD 0: the write path before */
    for (int rep = 0; rep < c->reps; rep++) {
      best(&kw, kvt_write(c, &k, bs, 0));
      if (kvp_tier_set(k.t, KVP_TIER_OPT_STAGE_AHEAD, 0) < 0)
        bench_die("KVP_TIER_OPT_STAGE_AHEAD", KVP_EINVAL);
      best(&kw0, kvt_write(c, &k, bs, 0));
      kvp_tier_set(k.t, KVP_TIER_OPT_STAGE_AHEAD, 1);
      if (have_fio)
        best(&fw, run_fio(c, ffile, c->file_bytes, 0, bs, bs, qds[q], 1));
      if (qds[q] == 1)
        best(&pw, run_posix(c, ffile, bs, 1));
    }
    row("write", bs, qds[q], kw, fw, pw, none, none);
    printf("|  write, next block staged only into a free queue slot (stage-ahead off): "
           "%.0f MB/s, %.2fx fio; stage-ahead / off %.2fx |\n", kw0.bps / 1e6,
           fw.ok ? kw0.bps / fw.bps : 0, kw.bps / kw0.bps);
    bool slab_ok = have_fio && stat(sfile, &sb) == 0 && (uint64_t)sb.st_size > slot;
    for (int rep = 0; rep < c->reps; rep++) {
      best(&kr, kvt_read(c, &k, bs, qds[q], 0));
      best(&kg, kvt_read(c, &k, bs, qds[q], 1));
      if (have_fio)
        best(&fr, run_fio(c, ffile, c->file_bytes, 0, bs, bs, qds[q], 0));
      if (slab_ok) /* the payloads kvtier reads: 4096 + k * slot */
        best(&sr, run_fio(c, sfile, (uint64_t)sb.st_size - 4096, 4096, slot,
                          bs, qds[q], 0));
      if (qds[q] == 1)
        best(&pr, run_posix(c, ffile, bs, 0));
    }
    row("read", bs, qds[q], kr, fr, pr, sr, kg);
    if (q == nqd - 1)
      printf("|  measured NVMe read bandwidth the router gets (kvp_tier_bandwidth): %.0f MB/s |\n",
             kvp_tier_bandwidth(k.t, KVP_TIER_NVME) / 1e6);
    kvp_tier_destroy(k.t);
  }
  if (system(rm) != 0)
    fprintf(stderr, "bench_tier: could not clean %s\n", kdir);
  rmdir(kdir);
}

static int lay_out_fio_file(const cfg *c) {
  char file[512], cmd[1024];
  snprintf(file, sizeof file, "%s/fio-%" PRIu64 ".dat", c->dir, c->file_bytes);
  /* written through once: reads of never-written extents would cost the
   * baselines no device I/O at all */
  int fd = open(file, O_RDWR | O_CREAT | O_DIRECT, 0600);
  uint8_t *b = aligned_alloc(4096, 1u << 20);
  if (fd < 0 || b == NULL) {
    fprintf(stderr, "bench_tier: cannot create %s\n", file);
    exit(1);
  }
  fill(b, 1u << 20, 3);
  for (uint64_t off = 0; off < c->file_bytes; off += 1u << 20)
    if (pwrite(fd, b, 1u << 20, (off_t)off) != 1 << 20) {
      fprintf(stderr, "bench_tier: cannot write %s\n", file);
      exit(1);
    }
  fsync(fd);
  close(fd);
  free(b);
  snprintf(cmd, sizeof cmd, "fio --version >/dev/null 2>&1");
  return system(cmd) == 0;
}

/* ---- --contention: other callers while a batch's NVMe reads run ------------
 * One thread loops kvp_tier_get_batch over blocks that live only on NVMe
 * (promotion off); the main thread meanwhile times kvp_tier_get of blocks in
 * DRAM.  Once with the NVMe reads holding the store's lock (the behaviour
 * before, KVP_TIER_OPT_READ_UNLOCKED 0) and once releasing it (the
 * default), alternated --reps times; the best of each is kept. */
typedef struct cont {
  kvp_tier_store *t;
  const kvp_namespace *ns;
  uint32_t ncold, batch;
  size_t bs;
  int cpu;
  uint32_t gap_us; /* pause between batches (0: back to back) */
  _Atomic int stop;
  uint64_t blocks; /* NVMe blocks read by the batch thread */
  /* what the other thread runs, and the option that says whether it holds
   * the store's lock: cont_reader + KVP_TIER_OPT_READ_UNLOCKED, or
   * cont_loader (kvp_tier_load through link) + KVP_TIER_OPT_LOAD_UNLOCKED */
  void *(*fn)(void *);
  kvp_tier_opt opt;
  kvp_tier_link *link;
} cont;

static kvp_key cold_key(uint64_t i) { return (kvp_key){0xC01D, i}; }
static kvp_key hot_key(uint64_t i) { return (kvp_key){0x407, i}; }

static void *cont_reader(void *p) {
  cont *c = p;
  if (c->cpu >= 0)
    bench_pin_cpu(c->cpu);
  enum { MAXB = 64 };
  void *dst[MAXB];
  size_t cap[MAXB], len[MAXB];
  int res[MAXB];
  kvp_key keys[MAXB];
  uint8_t *bufs = mmap(NULL, (size_t)MAXB * c->bs, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (bufs == MAP_FAILED)
    bench_die("mmap", KVP_ENOMEM);
  memset(bufs, 1, (size_t)MAXB * c->bs); /* faulted in, untimed */
  uint64_t s = 0x1234567;
  while (!c->stop) {
    for (uint32_t i = 0; i < c->batch; i++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      keys[i] = cold_key((s >> 33) % c->ncold);
      dst[i] = bufs + (size_t)i * c->bs;
      cap[i] = c->bs;
    }
    int n = kvp_tier_get_batch(c->t, c->ns, keys, c->batch, dst, cap, len, res);
    if (n < 0)
      bench_die("get_batch", n);
    c->blocks += (uint64_t)n;
    if (c->gap_us)
      usleep(c->gap_us);
  }
  munmap(bufs, (size_t)MAXB * c->bs);
  return NULL;
}

typedef struct cont_res {
  double gets_s, p99_us, max_us, nvme_s;
} cont_res;

static cont_res cont_run(const cfg *cf, cont *c, uint32_t nhot, int locked) {
  int rc = kvp_tier_set(c->t, c->opt, !locked);
  if (rc < 0)
    bench_die("kvp_tier_set (lock option)", rc);
  kvp_hist *h = bench_hist();
  static _Alignas(4096) uint8_t out[64 << 10];
  c->stop = 0;
  c->blocks = 0;
  pthread_t th;
  if (pthread_create(&th, NULL, c->fn, c) != 0)
    bench_die("pthread_create", KVP_ENOMEM);
  usleep(20000); /* the batch thread is reading */
  uint64_t t0 = kvp_now_ns(), end = t0 + (uint64_t)(cf->seconds * 1e9), n = 0;
  uint64_t s = 0x9876543, now = t0;
  while (now < end) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    size_t len;
    uint64_t a = kvp_now_ns();
    rc = kvp_tier_get(c->t, c->ns, hot_key((s >> 33) % nhot), out, sizeof out, &len);
    now = kvp_now_ns();
    if (rc != KVP_TIER_DRAM)
      bench_die("DRAM get", rc < 0 ? rc : KVP_ESTATE);
    kvp_hist_record(h, now - a); /* ns */
    n++;
  }
  uint64_t blocks0 = c->blocks;
  c->stop = 1;
  pthread_join(th, NULL);
  kvp_hist_summary sm;
  kvp_hist_summarize(h, &sm);
  kvp_hist_destroy(h);
  double dt = bench_secs(now - t0);
  return (cont_res){(double)n / dt, (double)sm.p99 / 1e3, (double)sm.max / 1e3,
                    (double)blocks0 / dt};
}

static void report_contention(const cfg *cf, const cont *c,
                              const uint32_t gaps[2], cont_res best[2][2]) {
  bool link = c->fn != cont_reader;
  bench_col cols[] = {
      {"batches", 0},      {link ? "in-place scatter" : "NVMe reads", 0},
      {"DRAM gets/s", 0},  {"DRAM get p99", 0}, {"DRAM get max", 0},
      {link ? "blocks/s loaded (load thread)" : "NVMe blocks/s (batch thread)", 0}};
  const bench_table table = {BENCH_MARKDOWN, 0, cols, 6};
  static const char *const names[2] = {"release the store lock (now)",
                                       "hold the store lock (before)"};
  if (link)
    printf("\nContention: DRAM kvp_tier_get (64 KiB) on cpu %d while another "
           "thread (cpu %d) runs kvp_tier_load of %u x %zu KiB DRAM blocks "
           "(CPU device, in-place scatter), best of %d x %.1f s\n\n",
           cf->cpu, c->cpu, c->batch, c->bs >> 10, cf->reps, cf->seconds);
  else
    printf("\nContention: DRAM kvp_tier_get (64 KiB) on cpu %d while another "
           "thread (cpu %d) runs kvp_tier_get_batch of 32 x 256 KiB NVMe-only "
           "blocks (QD 8), best of %d x %.1f s\n\n",
           cf->cpu, c->cpu, cf->reps, cf->seconds);
  bench_table_head(&table, NULL);
  for (int g = 0; g < 2; g++) {
    char gap[32];
    if (gaps[g])
      snprintf(gap, sizeof gap, "%u ms apart", gaps[g] / 1000);
    else
      snprintf(gap, sizeof gap, "back to back");
    const cont_res *bb = best[g];
    for (int l = 1; l >= 0; l--) {
      bench_row w = bench_row_start(&table);
      bench_cell(&w, "%s", gap);
      bench_cell(&w, "%s", names[l]);
      bench_cell(&w, "%.0f", bb[l].gets_s);
      bench_cell(&w, "%.1f us", bb[l].p99_us);
      bench_cell(&w, "%.1f us", bb[l].max_us);
      bench_cell(&w, "%.0f", bb[l].nvme_s);
      bench_row_end(&w, NULL);
    }
    bench_row w = bench_row_start(&table);
    bench_cell(&w, "%s", gap);
    bench_cell(&w, "ratio now/before");
    bench_cell(&w, "%.3gx", bb[0].gets_s / bb[1].gets_s);
    bench_cell(&w, "%.3gx", bb[0].p99_us / (bb[1].p99_us > 0 ? bb[1].p99_us : 1));
    bench_cell(&w, "%.3gx", bb[0].max_us / (bb[1].max_us > 0 ? bb[1].max_us : 1));
    bench_cell_ratio(&w, bb[0].nvme_s, bb[1].nvme_s, 2, false);
    bench_row_end(&w, NULL);
  }
}

static const uint32_t gaps[2] = {0, 2000};

static int other_cpu(const cfg *cf) {
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  return cf->cpu >= 0 && ncpu > 1 ? (int)((cf->cpu + 1) % ncpu) : -1;
}

/* Both gaps, lock held and released, alternated --reps times: the best. */
static void cont_best(const cfg *cf, cont *c, uint32_t nhot,
                      cont_res best[2][2]) {
  memset(best, 0, 4 * sizeof best[0][0]);
  for (int r = 0; r < cf->reps; r++)
    for (int g = 0; g < 2; g++)
      for (int locked = 1; locked >= 0; locked--) {
        c->gap_us = gaps[g];
        cont_res x = cont_run(cf, c, nhot, locked);
        if (x.gets_s > best[g][locked].gets_s)
          best[g][locked] = x;
      }
}

/* ---- the same with a link's in-place loads (CPU device) --------------------
 * The other thread loops kvp_tier_load of `batch` DRAM blocks through a link
 * whose store's region is registered with the device: each load's scatter
 * reads the slots in place, pinned with the lock released (now) or under
 * the store's lock (KVP_TIER_OPT_LOAD_UNLOCKED 0, before). */
#define LINK_LAYERS 4
static void *cont_loader(void *p) {
  cont *c = p;
  if (c->cpu >= 0)
    bench_pin_cpu(c->cpu);
  kvp_key keys[64];
  uint32_t ids[64];
  int res[64];
  for (uint32_t i = 0; i < c->batch; i++)
    keys[i] = cold_key(i), ids[i] = i;
  while (!c->stop) {
    int n = kvp_tier_load(c->link, NULL, keys, ids, c->batch, res);
    if (n != (int)c->batch)
      bench_die("kvp_tier_load", n < 0 ? n : KVP_ESTATE);
    c->blocks += (uint64_t)n;
    if (c->gap_us)
      usleep(c->gap_us);
  }
  return NULL;
}

/* A CPU device's paged cache of `nblocks` blocks (LINK_LAYERS layers, K and
 * V: 8 tensors) of 256 KiB. */
static kvp_kv_layout *link_cache(kvp_device *dev, uint32_t nblocks,
                                 void *tens[2 * LINK_LAYERS]) {
  size_t stride = 16 * 8 * 128 * 2; /* 16 tokens x 8 heads x 128 x bf16 */
  for (int i = 0; i < 2 * LINK_LAYERS; i++) {
    int rc = kvp_device_alloc(dev, stride * nblocks, &tens[i]);
    if (rc < 0)
      bench_die("kvp_device_alloc", rc);
    memset(tens[i], 7, stride * nblocks); /* the CPU device: host memory */
  }
  kvp_kv_layout_desc d = {.kind = KVP_LAYOUT_VLLM_NHD, .num_layers = LINK_LAYERS,
                          .num_blocks = nblocks, .block_size = 16,
                          .num_kv_heads = 8, .head_dim = 128, .elem_size = 2,
                          .k_layers = tens, .v_layers = tens + LINK_LAYERS};
  kvp_kv_layout *lay;
  int rc = kvp_kv_layout_create(dev, &d, &lay);
  if (rc < 0)
    bench_die("kvp_kv_layout_create", rc);
  return lay;
}

static void bench_link_contention(const cfg *cf) {
  const uint32_t nblk = 64, nhot = 64;
  kvp_device *dev;
  kvp_device_opts dop = {.backend = KVP_BACKEND_CPU,
                         .flags = KVP_DEVICE_NO_CALIBRATE};
  int rc = kvp_device_create(&dop, NULL, &dev);
  if (rc < 0)
    bench_die("kvp_device_create", rc);
  void *tens[2 * LINK_LAYERS];
  kvp_kv_layout *lay = link_cache(dev, nblk, tens);
  kvp_tier_opts o = {.dram_bytes = 64u << 20};
  kvp_tier_opts_set_device(&o, dev);
  kvp_tier_store *t;
  if ((rc = kvp_tier_create(&o, NULL, &t)) < 0)
    bench_die("kvp_tier_create", rc);
  kvp_namespace ns = bench_ns();
  const size_t bs = 256u << 10;
  kvp_tier_ns_add(t, &ns, &(kvp_tier_ns_opts){.block_bytes = bs});
  kvp_tier_link *l;
  if ((rc = kvp_tier_link_create(t, dev, lay, &ns, NULL, NULL, &l)) < 0)
    bench_die("kvp_tier_link_create", rc);
  kvp_key keys[64];
  uint32_t ids[64];
  int res[64];
  for (uint32_t i = 0; i < nblk; i++)
    keys[i] = cold_key(i), ids[i] = i;
  if ((rc = kvp_tier_save(l, NULL, keys, ids, nblk, NULL, res)) != (int)nblk)
    bench_die("kvp_tier_save", rc < 0 ? rc : KVP_ESTATE);
  uint8_t *b = malloc(64u << 10);
  for (uint32_t i = 0; i < nhot; i++) { /* 64 x 64 KiB in DRAM */
    fill(b, 64u << 10, i);
    if ((rc = kvp_tier_put(t, &ns, hot_key(i), b, 64u << 10, NULL)) < 0)
      bench_die("put", rc);
  }
  free(b);
  cont c = {.t = t, .ns = &ns, .batch = nblk, .bs = bs, .cpu = other_cpu(cf),
            .fn = cont_loader, .opt = KVP_TIER_OPT_LOAD_UNLOCKED, .link = l};
  cont_res best[2][2];
  cont_best(cf, &c, nhot, best);
  report_contention(cf, &c, gaps, best);
  kvp_tier_link_destroy(l);
  kvp_tier_destroy(t);
  kvp_kv_layout_destroy(lay);
  for (int i = 0; i < 2 * LINK_LAYERS; i++)
    kvp_device_free(dev, tens[i]);
  kvp_device_destroy(dev);
}

static void bench_contention(const cfg *cf) {
  char dir[512];
  snprintf(dir, sizeof dir, "%s/contention", cf->dir);
  mkdir(dir, 0700);
  const size_t bs = 256u << 10;
  const uint32_t ncold = cf->quick ? 64 : 512, nhot = 64;
  kvp_tier_opts o = {.dram_bytes = 64u << 20, .nvme_dir = dir,
                     .nvme_bytes = (uint64_t)ncold * bs * 2 + (64u << 20),
                     .queue_depth = 8, .max_block_bytes = bs, .no_promote = 1};
  kvp_tier_store *t;
  int rc = kvp_tier_create(&o, NULL, &t);
  if (rc < 0)
    bench_die("kvp_tier_create", rc);
  kvp_namespace ns = bench_ns();
  if ((rc = kvp_tier_ns_add(t, &ns, NULL)) < 0)
    bench_die("ns_add", rc);
  uint8_t *b = malloc(bs);
  kvp_tier_put_opts stable = {.cls = KVP_CLASS_STABLE}; /* admitted */
  for (uint32_t i = 0; i < ncold; i++) { /* pressure demotes them */
    fill(b, bs, i);
    if ((rc = kvp_tier_put(t, &ns, cold_key(i), b, bs, &stable)) < 0)
      bench_die("put", rc);
  }
  kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0); /* the rest too: NVMe only */
  kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 64u << 20);
  for (uint32_t i = 0; i < nhot; i++) { /* 64 x 64 KiB in DRAM */
    fill(b, 64u << 10, i);
    if ((rc = kvp_tier_put(t, &ns, hot_key(i), b, 64u << 10, NULL)) < 0)
      bench_die("put", rc);
  }
  free(b);
  cont c = {.t = t, .ns = &ns, .ncold = ncold, .batch = 32, .bs = bs,
            .cpu = other_cpu(cf), .fn = cont_reader,
            .opt = KVP_TIER_OPT_READ_UNLOCKED};
  cont_res best[2][2];
  cont_best(cf, &c, nhot, best);
  kvp_tier_stats st;
  kvp_tier_stats_get(t, &st);
  if (st.hits[KVP_TIER_NVME] == 0 || st.promotions != 0)
    bench_die("contention: the batch thread did not read NVMe-only blocks", KVP_ESTATE);
  report_contention(cf, &c, gaps, best);
  kvp_tier_destroy(t);
  DIR *d = opendir(dir); /* the slab files */
  struct dirent *de;
  char f[1024];
  while (d != NULL && (de = readdir(d)) != NULL)
    if (de->d_name[0] != '.') {
      snprintf(f, sizeof f, "%s/%s", dir, de->d_name);
      unlink(f);
    }
  if (d != NULL)
    closedir(d);
  rmdir(dir);
}

static int parse(int argc, char **argv, cfg *c) {
  uint64_t file_mb = 1024, bs_kib = 0;
  *c = (cfg){.dir = "bench-tier-data", .seconds = 1, .cpu = 0, .reps = 2,
             .batch_mult = 16};
  bench_opt t[] = {
      BENCH_OPT("dir", BENCH_STR, &c->dir, "D", "directory of the data files"),
      BENCH_OPT("file-mb", BENCH_U64, &file_mb, "N", "file size, MiB"),
      BENCH_OPT("seconds", BENCH_DOUBLE, &c->seconds, "S", "seconds per cell"),
      BENCH_OPT("cpu", BENCH_INT, &c->cpu, "C|-1",
                "pin to this CPU (-1: unpinned)"),
      BENCH_OPT("reps", BENCH_INT, &c->reps, "R",
                "alternations of kvtier and its baselines (best kept)"),
      BENCH_OPT("bs", BENCH_U64, &bs_kib, "KiB",
                "only this block size (16, 256, 2048; 0: all)"),
      BENCH_OPT("qd", BENCH_INT, &c->only_qd, "N",
                "only this queue depth (0: 1, 8, 32)"),
      BENCH_OPT("batch", BENCH_INT, &c->batch_mult, "M",
                "M x QD keys per kvp_tier_get_batch (<= 256 keys)"),
      BENCH_OPT("async", BENCH_FLAG, &c->async, NULL,
                "reads as two kvp_tier_get_async halves in flight"),
      BENCH_OPT("small-pages", BENCH_FLAG, &c->small_pages, NULL,
                "read buffers of 4 KiB pages (default: 2 MiB THP)"),
      BENCH_OPT("contention", BENCH_FLAG, &c->contention, NULL,
                "only the tables of DRAM gets while another thread reads "
                "NVMe, and while it loads DRAM blocks through a link"),
      BENCH_OPT("quick", BENCH_FLAG, &c->quick, NULL,
                "32 MiB file, 0.2 s cells, 1 rep, no fio; checks that every "
                "NVMe read returns the bytes written"),
      BENCH_OPT_END};
  if (bench_parse("bench_tier",
                  "kvtier's DRAM path against memcpy, its NVMe path against "
                  "fio and a pread/pwrite\nloop.  Options given explicitly "
                  "win over --quick's.\n",
                  t, argc, argv) < 0)
    return -1;
  c->file_bytes = file_mb << 20;
  c->only_bs = (size_t)bs_kib << 10;
  c->batch_mult = c->batch_mult > 0 ? c->batch_mult : 1;
  c->reps = c->reps > 0 ? c->reps : 1;
  if (c->quick && !bench_given(t, "file-mb"))
    c->file_bytes = 32u << 20;
  if (c->quick && !bench_given(t, "seconds"))
    c->seconds = 0.2;
  if (c->quick && !bench_given(t, "reps"))
    c->reps = 1;
  return 0;
}

int main(int argc, char **argv) {
  cfg c;
  if (parse(argc, argv, &c) < 0)
    return 2;
  bench_pin_cpu(c.cpu);
  mkdir(c.dir, 0700);
  if (c.contention) {
    bench_contention(&c);
    bench_link_contention(&c);
    rmdir(c.dir);
    return 0;
  }
  int have_fio = lay_out_fio_file(&c) && !c.quick;
  printf("bench_tier: dir %s, file %" PRIu64 " MiB, best of %d x %.1f s per cell, cpu %d, "
         "read buffers %s, get_batch of %d x QD keys%s\n\n",
         c.dir, c.file_bytes >> 20, c.reps, c.seconds, c.cpu,
         c.small_pages ? "4 KiB pages" : "2 MiB-aligned THP", c.batch_mult,
         have_fio ? "" : c.quick ? " (quick: fio skipped)" : " (fio not found)");
  bench_table_head(&dram_table, NULL);
  static const size_t sizes[] = {16u << 10, 256u << 10, 2u << 20};
  int nsizes = c.quick ? 2 : 3;
  for (int s = 0; s < nsizes; s++)
    if (!c.only_bs || c.only_bs == sizes[s])
      bench_dram(&c, sizes[s]);
  printf("\n");
  bench_table_head(&nvme_table, NULL);
  static const int qds[] = {1, 8, 32};
  for (int s = 0; s < nsizes; s++)
    if (!c.only_bs || c.only_bs == sizes[s])
      bench_nvme(&c, sizes[s], c.only_qd ? &c.only_qd : qds,
                 c.only_qd ? 1 : c.quick ? 2 : 3, have_fio);
  if (c.quick) { /* keeps the --contention paths exercised */
    bench_contention(&c);
    bench_link_contention(&c);
  }
  char file[512];
  snprintf(file, sizeof file, "%s/fio-%" PRIu64 ".dat", c.dir, c.file_bytes);
  unlink(file);
  rmdir(c.dir);
  return 0;
}
