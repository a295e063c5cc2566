/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier: the block store on DRAM and NVMe (every NVMe case on io_uring and
 * on pread/pwrite), full-key checks under forced fingerprint collisions,
 * namespace isolation, checksum and AES-GCM tamper detection, recovery,
 * fault injection, async tickets, policies, options, events. */
#include <errno.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>

#include "kvtier_internal.h"
#include "tier_test_util.h"

#define KB 1024u
#define MB (1024u * 1024u)
#define HDR 4096u /* the header sector on a 4 KiB-block file system */

/* out is page-aligned: NVMe reads of whole-sector blocks go straight into it */
static uint8_t buf[4 << 20];
static _Alignas(4096) uint8_t out[4 << 20];

static kvp_tier_store *mk(const char *dir, kvp_tier_io_backend b,
                          uint64_t dram, uint64_t nvme) {
  kvp_tier_opts o = {.dram_bytes = dram, .nvme_dir = dir, .nvme_bytes = nvme,
                     .io_backend = b, .queue_depth = 8,
                     .max_block_bytes = 1 * MB};
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  return t;
}

static kvp_key K(uint64_t hi, uint64_t lo) { return (kvp_key){hi, lo}; }

static void put_k(kvp_tier_store *t, const kvp_namespace *ns, kvp_key k,
                  size_t n, uint32_t flags, kvp_class cls) {
  tt_fill(ns, k, buf, n);
  kvp_tier_put_opts po = {.cls = cls, .flags = flags};
  ASSERT_EQ(kvp_tier_put(t, ns, k, buf, n, &po), 1);
}

static int get_k(kvp_tier_store *t, const kvp_namespace *ns, kvp_key k,
                 size_t n) {
  size_t len = 0;
  memset(out, 0xA5, n); /* poisoned */
  int rc = kvp_tier_get(t, ns, k, out, sizeof out, &len);
  if (rc >= 0) {
    ASSERT_EQ(len, n);
    ASSERT_TRUE(tt_check(ns, k, out, n));
  }
  return rc;
}

TEST(dram_basic) {
  kvp_tier_store *t = mk(NULL, 0, 8 * MB, 0);
  kvp_namespace ns = tt_ns("a", 16);
  ASSERT_ERR(kvp_tier_put(t, &ns, K(1, 1), buf, 10, NULL), KVP_ENOENT);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, &(kvp_tier_ns_opts){.block_bytes = 16 * KB}));
  ASSERT_ERR(kvp_tier_ns_add(t, &ns, NULL), KVP_EEXIST);
  put_k(t, &ns, K(1, 1), 16 * KB, 0, 0);   /* fixed slot */
  put_k(t, &ns, K(1, 2), 5000, 0, 0);      /* jemalloc arena */
  put_k(t, &ns, K(1, 1), 16 * KB, 0, 0);   /* duplicate: no-op */
  ASSERT_EQ(get_k(t, &ns, K(1, 1), 16 * KB), KVP_TIER_DRAM);
  ASSERT_EQ(get_k(t, &ns, K(1, 2), 5000), KVP_TIER_DRAM);
  ASSERT_EQ(kvp_tier_contains(t, &ns, K(1, 2)), KVP_TIER_DRAM);
  size_t len;
  ASSERT_ERR(kvp_tier_get(t, &ns, K(1, 2), out, 100, &len), KVP_ERANGE);
  ASSERT_EQ(len, 5000);
  ASSERT_ERR(kvp_tier_put(t, &ns, K(9, 9), buf, 0, NULL), KVP_ERANGE);
  ASSERT_EQ(kvp_tier_evict(t, &ns, K(1, 2)), 1);
  ASSERT_EQ(kvp_tier_evict(t, &ns, K(1, 2)), 0);
  ASSERT_ERR(kvp_tier_get(t, &ns, K(1, 2), out, sizeof out, &len), KVP_ENOENT);
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.puts_dup, 1);
  ASSERT_EQ(st.dram_blocks, 1);
  ASSERT_EQ(st.dram_slot_bytes, 16 * KB);
  ASSERT_GT(kvp_tier_bandwidth(t, KVP_TIER_DRAM), 0);
  void *base;
  size_t rlen;
  ASSERT_OK(kvp_tier_dram_region(t, &base, &rlen));
  ASSERT_GE(rlen, 8 * MB);
  kvp_tier_destroy(t);
}

/* The DRAM region's own allocator (tier_dram.c): fixed slots, size classes
 * (<= 1.25x, 64-byte aligned) and page runs, all inside the region; every
 * byte of it holds blocks (no allocator metadata there); empty slabs go back
 * to the pages, so a region filled with one class, emptied, takes a block
 * of nearly its whole size. */
TEST(dram_size_classes) {
  tier_dram *d;
  ASSERT_ERR(kvp__tier_dram_create(2 * MB, KVP_TIER_HUGE_NONE, NULL, &d), KVP_ERANGE);
  ASSERT_OK(kvp__tier_dram_create(8 * MB, KVP_TIER_HUGE_NONE, NULL, &d));
  void *base;
  size_t rlen;
  kvp__tier_dram_region(d, &base, &rlen);
  ASSERT_EQ(rlen, 8 * MB);
  static const size_t lens[] = {1, 63, 64, 65, 511, 512, 513, 1000, 4096, 5000,
                                65536, 200000, 262144, 262145, 300000, 2 * MB + 1};
  void *p[16];
  uint32_t pool[16];
  uint64_t ch[16];
  for (int i = 0; i < 16; i++) {
    p[i] = kvp__tier_dram_alloc(d, lens[i], 0, &pool[i], &ch[i]);
    ASSERT_TRUE(p[i] != NULL);
    ASSERT_EQ((uintptr_t)p[i] % 64, 0);
    ASSERT_TRUE((uint8_t *)p[i] >= (uint8_t *)base &&
                (uint8_t *)p[i] + lens[i] <= (uint8_t *)base + rlen);
    ASSERT_GE(ch[i], lens[i]);
    if (lens[i] <= 256 * KB) {
      ASSERT_TRUE(pool[i] != TIER_POOL_RUN);
      ASSERT_LE(ch[i], lens[i] < 512 ? 512 : lens[i] + lens[i] / 4);
    } else {
      ASSERT_EQ(pool[i], TIER_POOL_RUN);
      ASSERT_LT(ch[i], lens[i] + 64 * KB);
    }
    memset(p[i], i + 1, lens[i]);
  }
  for (int i = 0; i < 16; i++) { /* no block overlaps another */
    ASSERT_EQ(((uint8_t *)p[i])[0], i + 1);
    ASSERT_EQ(((uint8_t *)p[i])[lens[i] - 1], i + 1);
    kvp__tier_dram_free(d, p[i], pool[i]);
  }
  ASSERT_EQ(kvp__tier_dram_slot_bytes(d), 0);
  /* fixed slots count as slot bytes; a full region of 3000-byte blocks */
  void *f = kvp__tier_dram_alloc(d, 16 * KB, 16 * KB, &pool[0], &ch[0]);
  ASSERT_TRUE(f != NULL);
  ASSERT_EQ(kvp__tier_dram_slot_bytes(d), 16 * KB);
  kvp__tier_dram_free(d, f, pool[0]);
  static void *many[8 * MB / 3072];
  uint32_t mp;
  uint64_t mc, n = 0;
  while (n < sizeof many / sizeof many[0] &&
         (many[n] = kvp__tier_dram_alloc(d, 3000, 0, &mp, &mc)) != NULL)
    memcpy(many[n], &n, sizeof n), n++;
  ASSERT_EQ(mc, 3072);
  /* every 64 KiB page: the fixed pool's kept empty slab was taken back */
  ASSERT_EQ(n, (8 * MB / (64 * KB)) * (64 * KB / 3072));
  ASSERT_TRUE(kvp__tier_dram_alloc(d, 3 * MB, 0, &mp, &mc) == NULL);
  for (uint64_t i = 0; i < n; i++) {
    uint64_t v;
    memcpy(&v, many[i], sizeof v);
    ASSERT_EQ(v, i);
    kvp__tier_dram_free(d, many[i], mp);
  }
  void *big = kvp__tier_dram_alloc(d, 8 * MB, 0, &mp, &mc); /* every page */
  ASSERT_TRUE(big != NULL);
  ASSERT_TRUE(big == base);
  ASSERT_EQ(mc, 8 * MB);
  kvp__tier_dram_free(d, big, mp);
  kvp__tier_dram_destroy(d);
}

/* The GPU backend's registration hook sees the whole region once, before any
 * block, and its failure fails create with its code. */
typedef struct reg {
  void *base;
  size_t len;
  int calls, uncalls, fail;
} reg;
static int reg_fn(void *o, void *base, size_t len) {
  reg *r = o;
  r->base = base, r->len = len, r->calls++;
  return r->fail;
}
static void unreg_fn(void *o, void *base, size_t len) {
  reg *r = o;
  ASSERT_TRUE(base == r->base && len == r->len);
  r->uncalls++;
}

TEST(dram_register_hook) {
  reg r = {0};
  kvp_tier_opts o = {.dram_bytes = 8 * MB, .dram_register = reg_fn,
                     .dram_unregister = unreg_fn, .register_opaque = &r};
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  void *base;
  size_t len;
  ASSERT_OK(kvp_tier_dram_region(t, &base, &len));
  ASSERT_TRUE(base == r.base);
  ASSERT_EQ(len, r.len);
  ASSERT_EQ(((uintptr_t)base) % (2 * MB), 0); /* huge-page aligned */
  kvp_namespace ns = tt_ns("a", 16);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, &(kvp_tier_ns_opts){.block_bytes = 64 * KB}));
  put_k(t, &ns, K(1, 1), 64 * KB, 0, 0);
  put_k(t, &ns, K(1, 2), 3000, 0, 0); /* the jemalloc arena lives there too */
  kvp_tier_destroy(t);
  ASSERT_EQ(r.calls, 1);
  ASSERT_EQ(r.uncalls, 1);
  r = (reg){.fail = KVP_EGPU};
  ASSERT_ERR(kvp_tier_create(&o, NULL, &t), KVP_EGPU);
  ASSERT_EQ(r.calls, 1);
  ASSERT_EQ(r.uncalls, 0); /* a failed registration is not undone */
}

/* DRAM capacity from MemAvailable when none is given. */
TEST(dram_default_capacity) {
  kvp_tier_opts o = {.dram_fraction = 0.01};
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_GT(st.dram_bytes, 2 * MB);
  kvp_tier_destroy(t);
  o.dram_fraction = 2;
  ASSERT_ERR(kvp_tier_create(&o, NULL, &t), KVP_EINVAL);
}

/* Keys sharing the 64-bit fingerprint (key.lo, which also picks the hash
 * bucket) must never be served for each other; so must equal keys of
 * different namespaces. */
TEST(fingerprint_collision) {
  kvp_tier_store *t = mk(NULL, 0, 8 * MB, 0);
  kvp_namespace a = tt_ns("a", 16), b = tt_ns("b", 16);
  ASSERT_OK(kvp_tier_ns_add(t, &a, NULL));
  ASSERT_OK(kvp_tier_ns_add(t, &b, NULL));
  for (uint64_t hi = 1; hi <= 50; hi++)
    put_k(t, &a, K(hi, 77), 4 * KB + hi, 0, 0);
  for (uint64_t hi = 1; hi <= 50; hi++)
    ASSERT_EQ(get_k(t, &a, K(hi, 77), 4 * KB + hi), KVP_TIER_DRAM);
  size_t len;
  ASSERT_ERR(kvp_tier_get(t, &a, K(51, 77), out, sizeof out, &len), KVP_ENOENT);
  ASSERT_ERR(kvp_tier_get(t, &b, K(3, 77), out, sizeof out, &len), KVP_ENOENT);
  ASSERT_ERR(kvp_tier_contains(t, &b, K(3, 77)), KVP_ENOENT);
  ASSERT_EQ(kvp_tier_evict(t, &b, K(3, 77)), 0);
  ASSERT_EQ(get_k(t, &a, K(3, 77), 4 * KB + 3), KVP_TIER_DRAM);
  kvp_tier_destroy(t);
}

/* DRAM pressure demotes to NVMe (stable and reused blocks), drops volatile
 * blocks never reused; NVMe hits verify and promote. */
static void nvme_demote_promote(kvp_tier_io_backend be) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  if (!dir[0])
    KVT_SKIP_BECAUSE("no directory takes O_DIRECT");
  kvp_tier_store *t = mk(dir, be, 4 * MB, 64 * MB);
  kvp_namespace ns = tt_ns("a", 16);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, &(kvp_tier_ns_opts){.block_bytes = 64 * KB}));
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.io_uring, be == KVP_TIER_IO_URING);
  for (uint64_t i = 0; i < 200; i++)
    put_k(t, &ns, K(i, i), 64 * KB, 0, i % 2 ? KVP_CLASS_STABLE : KVP_CLASS_VOLATILE);
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  /* 64 blocks fit the 4 MiB region (all of it holds blocks: the jemalloc
   * arena's metadata no longer takes a chunk), volatile ones go first: of
   * the 100 stable ones 36 are demoted */
  ASSERT_EQ(st.dram_blocks, 64);
  ASSERT_GE(st.demotions, 36);
  ASSERT_GT(st.drops_volatile, 50);
  ASSERT_LE(st.dram_used_bytes, 4 * MB);
  int nv = 0;
  for (uint64_t i = 1; i < 120; i += 2) { /* stable: all still there */
    int rc = get_k(t, &ns, K(i, i), 64 * KB);
    ASSERT_GE(rc, 0);
    nv += rc == KVP_TIER_NVME;
  }
  ASSERT_GT(nv, 10);
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_GT(st.promotions, 10);
  ASSERT_EQ(st.checksum_failures, 0);
  ASSERT_GT(kvp_tier_bandwidth(t, KVP_TIER_NVME), 0);
  ASSERT_ERR(get_k(t, &ns, K(0, 0), 64 * KB), KVP_ENOENT); /* volatile, gone */
  kvp_tier_destroy(t);
  tt_rmdir(dir);
}

/* Durable puts survive a restart; the index comes back from the headers;
 * evicted blocks do not; variable sizes land in their size classes. */
static void nvme_recovery(kvp_tier_io_backend be) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  kvp_namespace ns = tt_ns("a", 16);
  char f[512]; /* an empty slab file, as a crash right after creating it leaves */
  snprintf(f, sizeof f, "%s/kvtier-8192.slab", dir);
  close(open(f, O_CREAT | O_WRONLY, 0600));
  kvp_tier_store *t = mk(dir, be, 16 * MB, 64 * MB);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  for (uint64_t i = 0; i < 40; i++)
    put_k(t, &ns, K(i, 5), 1000 + i * 3000, KVP_TIER_PUT_DURABLE, 0);
  ASSERT_EQ(kvp_tier_evict(t, &ns, K(7, 5)), 1);
  ASSERT_OK(kvp_tier_sync(t));
  kvp_tier_destroy(t);
  t = mk(dir, be, 16 * MB, 64 * MB);
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.recovered_slots, 39);
  ASSERT_EQ(st.nvme_blocks, 39);
  size_t len;
  ASSERT_ERR(kvp_tier_get(t, &ns, K(1, 5), out, sizeof out, &len), KVP_ENOENT);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL)); /* recovered slots wait for it */
  for (uint64_t i = 0; i < 40; i++)
    ASSERT_EQ(get_k(t, &ns, K(i, 5), 1000 + i * 3000),
              i == 7 ? KVP_ENOENT : KVP_TIER_NVME);
  kvp_tier_destroy(t);
  tt_rmdir(dir);
}

/* Bit rot in a payload or a header: a miss, counted, the slot dropped. */
static void nvme_corruption(kvp_tier_io_backend be) {
  char dir[256], f[512];
  tt_mkdir(dir, sizeof dir);
  kvp_namespace ns = tt_ns("a", 16);
  kvp_tier_store *t = mk(dir, be, 4 * MB, 64 * MB);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  for (uint64_t i = 0; i < 3; i++)
    put_k(t, &ns, K(i, 1), 8 * KB, KVP_TIER_PUT_DURABLE, 0);
  kvp_tier_destroy(t);
  snprintf(f, sizeof f, "%s/kvtier-8192.slab", dir);
  int fd = open(f, O_RDWR);
  ASSERT_GE(fd, 0);
  uint64_t slot = HDR + 8192;
  uint8_t x = 0;
  ASSERT_EQ(pread(fd, &x, 1, (off_t)(slot * 0 + HDR + 100)), 1);
  x ^= 0x10;
  ASSERT_EQ(pwrite(fd, &x, 1, (off_t)(slot * 0 + HDR + 100)), 1); /* payload */
  ASSERT_EQ(pread(fd, &x, 1, (off_t)(slot * 1 + 50)), 1);
  x ^= 0x01;
  ASSERT_EQ(pwrite(fd, &x, 1, (off_t)(slot * 1 + 50)), 1); /* header */
  close(fd);
  t = mk(dir, be, 4 * MB, 64 * MB);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.recovered_slots, 2);
  ASSERT_EQ(st.recovery_bad_slots, 1);
  int r0 = get_k(t, &ns, K(0, 1), 8 * KB);
  int r2 = get_k(t, &ns, K(2, 1), 8 * KB);
  ASSERT_EQ(r0, KVP_ENOENT);
  ASSERT_EQ(r2, KVP_TIER_NVME);
  ASSERT_EQ(get_k(t, &ns, K(1, 1), 8 * KB), KVP_ENOENT);
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.checksum_failures, 1);
  ASSERT_ERR(kvp_tier_contains(t, &ns, K(0, 1)), KVP_ENOENT); /* dropped */
  kvp_tier_destroy(t);
  tt_rmdir(dir);
}

/* Plaintext reads move the payload only and check it against the checksum
 * the block's header carried (kept in memory): another block's payload in
 * the slot is a miss, never that block's bytes; a header damaged while the
 * store runs does not matter to a read (recovery drops it later); an
 * unaligned destination takes the staged path (checksum + copy). */
static void nvme_payload_only(kvp_tier_io_backend be) {
  char dir[256], f[512];
  tt_mkdir(dir, sizeof dir);
  kvp_namespace ns = tt_ns("a", 16);
  kvp_tier_store *t = mk(dir, be, 4 * MB, 64 * MB);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  for (uint64_t i = 0; i < 4; i++)
    put_k(t, &ns, K(i, 3), 8 * KB, KVP_TIER_PUT_DURABLE, 0);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0));
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_PROMOTE, 0));
  snprintf(f, sizeof f, "%s/kvtier-8192.slab", dir);
  int fd = open(f, O_RDWR);
  ASSERT_GE(fd, 0);
  uint64_t slot = HDR + 8192;
  static uint8_t p1[8192];
  ASSERT_EQ(pread(fd, p1, sizeof p1, (off_t)(slot * 1 + HDR)), (ssize_t)sizeof p1);
  ASSERT_EQ(pwrite(fd, p1, sizeof p1, (off_t)(slot * 0 + HDR)), (ssize_t)sizeof p1);
  uint8_t x = 0;
  ASSERT_EQ(pread(fd, &x, 1, (off_t)(slot * 2 + 40)), 1);
  x ^= 0x01; /* the key field of block 2's header */
  ASSERT_EQ(pwrite(fd, &x, 1, (off_t)(slot * 2 + 40)), 1);
  ASSERT_OK(fsync(fd));
  close(fd);
  kvp_tier_stats st0, st;
  ASSERT_OK(kvp_tier_stats_get(t, &st0));
  ASSERT_EQ(get_k(t, &ns, K(0, 3), 8 * KB), KVP_ENOENT); /* block 1's bytes */
  ASSERT_EQ(get_k(t, &ns, K(2, 3), 8 * KB), KVP_TIER_NVME);
  ASSERT_EQ(get_k(t, &ns, K(1, 3), 8 * KB), KVP_TIER_NVME);
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.checksum_failures - st0.checksum_failures, 1);
  ASSERT_EQ(st.nvme_bytes_read - st0.nvme_bytes_read, 3 * 8 * KB);
  size_t len = 0; /* unaligned destination: staged read, same checks */
  memset(out, 0xA5, 8 * KB + 1);
  ASSERT_EQ(kvp_tier_get(t, &ns, K(3, 3), out + 1, 8 * KB, &len), KVP_TIER_NVME);
  ASSERT_EQ(len, 8 * KB);
  ASSERT_TRUE(tt_check(&ns, K(3, 3), out + 1, 8 * KB));
  kvp_tier_destroy(t);
  t = mk(dir, be, 4 * MB, 64 * MB); /* recovery drops the damaged header */
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.recovery_bad_slots, 1);
  kvp_tier_destroy(t);
  tt_rmdir(dir);
}

/* Caller memory registered with the ring (kvp_tier_register_buffers): reads
 * into it are fixed-buffer reads on io_uring (counted), return exactly the
 * written bytes, and a tampered payload or another block's payload in the
 * slot is still a miss; a destination crossing two ranges, and every read
 * after unregistering, is a plain read with the same result.  pread/pwrite
 * ignores registration (returns 0, nothing counted). */
static void nvme_registered(kvp_tier_io_backend be) {
  char dir[256], f[512];
  tt_mkdir(dir, sizeof dir);
  kvp_namespace ns = tt_ns("a", 16);
  kvp_tier_store *t = mk(dir, be, 4 * MB, 64 * MB);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  for (uint64_t i = 0; i < 6; i++)
    put_k(t, &ns, K(i, 5), 8 * KB, KVP_TIER_PUT_DURABLE, 0);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0));
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_PROMOTE, 0));
  uint8_t *pool = mmap(NULL, 2 * MB, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_TRUE(pool != MAP_FAILED);
  /* given out of order: the store sorts them */
  struct iovec iov[2] = {{pool + MB, MB}, {pool, MB}};
  struct iovec bad[2] = {{pool, MB}, {pool + MB - 4 * KB, MB}};
  ASSERT_ERR(kvp_tier_register_buffers(t, NULL, 1), KVP_EINVAL);
  ASSERT_ERR(kvp_tier_register_buffers(t, &(struct iovec){pool, 0}, 1), KVP_EINVAL);
  bool uring = be == KVP_TIER_IO_URING;
  ASSERT_ERR(kvp_tier_register_buffers(t, bad, 2), KVP_EINVAL); /* overlap */
  ASSERT_EQ(kvp_tier_register_buffers(t, iov, 2), uring ? 2 : 0);
  kvp_tier_stats st0, st;
  ASSERT_OK(kvp_tier_stats_get(t, &st0));
  kvp_key keys[4] = {K(0, 5), K(1, 5), K(2, 5), K(3, 5)};
  void *dst[4] = {pool, pool + 64 * KB, pool + MB, pool + MB + 8 * KB};
  size_t cap[4] = {8 * KB, 8 * KB, 8 * KB, 8 * KB}, len[4];
  int res[4];
  memset(pool, 0xA5, 2 * MB); /* poisoned */
  ASSERT_EQ(kvp_tier_get_batch(t, &ns, keys, 4, dst, cap, len, res), 4);
  for (int i = 0; i < 4; i++) {
    ASSERT_EQ(res[i], KVP_TIER_NVME);
    ASSERT_EQ(len[i], 8 * KB);
    ASSERT_TRUE(tt_check(&ns, keys[i], dst[i], 8 * KB));
  }
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.nvme_reads_registered - st0.nvme_reads_registered, uring ? 4 : 0);
  /* crossing the two ranges: a plain read, same bytes */
  size_t l = 0;
  ASSERT_EQ(kvp_tier_get(t, &ns, K(4, 5), pool + MB - 4 * KB, 8 * KB, &l),
            KVP_TIER_NVME);
  ASSERT_TRUE(tt_check(&ns, K(4, 5), pool + MB - 4 * KB, 8 * KB));
  /* tamper: a payload bit of block 0, block 2's payload in block 1's slot */
  snprintf(f, sizeof f, "%s/kvtier-8192.slab", dir);
  int fd = open(f, O_RDWR);
  ASSERT_GE(fd, 0);
  uint64_t slot = HDR + 8192;
  static uint8_t p2[8192];
  uint8_t x = 0;
  ASSERT_EQ(pread(fd, &x, 1, (off_t)(slot * 0 + HDR + 100)), 1);
  x ^= 0x10;
  ASSERT_EQ(pwrite(fd, &x, 1, (off_t)(slot * 0 + HDR + 100)), 1);
  ASSERT_EQ(pread(fd, p2, sizeof p2, (off_t)(slot * 2 + HDR)), (ssize_t)sizeof p2);
  ASSERT_EQ(pwrite(fd, p2, sizeof p2, (off_t)(slot * 1 + HDR)), (ssize_t)sizeof p2);
  ASSERT_OK(fsync(fd));
  close(fd);
  ASSERT_OK(kvp_tier_stats_get(t, &st0));
  ASSERT_EQ(kvp_tier_get_batch(t, &ns, keys, 3, dst, cap, len, res), 1);
  ASSERT_EQ(res[0], KVP_ENOENT);
  ASSERT_EQ(res[1], KVP_ENOENT);
  ASSERT_EQ(res[2], KVP_TIER_NVME);
  ASSERT_TRUE(tt_check(&ns, keys[2], dst[2], 8 * KB));
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.checksum_failures - st0.checksum_failures, 2);
  ASSERT_EQ(st.nvme_reads_registered - st0.nvme_reads_registered, uring ? 3 : 0);
  ASSERT_EQ(kvp_tier_get(t, &ns, K(0, 5), pool, 8 * KB, &l), KVP_ENOENT);
  /* unregistered: plain reads into the same memory */
  ASSERT_OK(kvp_tier_unregister_buffers(t));
  memset(pool, 0xA5, 2 * MB);
  ASSERT_EQ(kvp_tier_get(t, &ns, K(3, 5), pool + MB, 8 * KB, &l), KVP_TIER_NVME);
  ASSERT_TRUE(tt_check(&ns, K(3, 5), pool + MB, 8 * KB));
  ASSERT_OK(kvp_tier_stats_get(t, &st0));
  ASSERT_EQ(st0.nvme_reads_registered, st.nvme_reads_registered);
  /* registered again and left registered at destroy */
  ASSERT_EQ(kvp_tier_register_buffers(t, iov, 1), uring ? 1 : 0);
  ASSERT_EQ(kvp_tier_get(t, &ns, K(5, 5), pool + MB, 8 * KB, &l), KVP_TIER_NVME);
  ASSERT_TRUE(tt_check(&ns, K(5, 5), pool + MB, 8 * KB));
  kvp_tier_destroy(t);
  munmap(pool, 2 * MB);
  tt_rmdir(dir);
}

/* AES-256-GCM at rest: correct round trip; a ciphertext byte flipped with
 * both XXH3 checksums recomputed (a deliberate attacker) fails the tag; a
 * plaintext slot never satisfies an encrypted namespace; another tenant's key
 * cannot read it. */
static void nvme_encryption(kvp_tier_io_backend be) {
  char dir[256], f[512];
  tt_mkdir(dir, sizeof dir);
  uint8_t key[32], key2[32];
  for (int i = 0; i < 32; i++)
    key[i] = (uint8_t)i, key2[i] = (uint8_t)(i + 1);
  kvp_namespace ns = tt_ns("enc", 16);
  kvp_tier_store *t = mk(dir, be, 4 * MB, 64 * MB);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, &(kvp_tier_ns_opts){.aes256_key = key}));
  for (uint64_t i = 0; i < 3; i++)
    put_k(t, &ns, K(i, 1), 8 * KB, KVP_TIER_PUT_DURABLE, 0);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0)); /* all out of DRAM */
  ASSERT_EQ(get_k(t, &ns, K(2, 1), 8 * KB), KVP_TIER_NVME);
  kvp_tier_destroy(t);
  /* the plaintext is not on disk */
  snprintf(f, sizeof f, "%s/kvtier-8192.slab", dir);
  int fd = open(f, O_RDWR);
  ASSERT_GE(fd, 0);
  uint64_t slot = HDR + 8192;
  static uint8_t img[HDR + 8192];
  ASSERT_EQ(pread(fd, img, sizeof img, 0), (ssize_t)sizeof img);
  tt_fill(&ns, K(0, 1), buf, 8 * KB);
  ASSERT_TRUE(memcmp(img + HDR, buf, 64) != 0);
  /* tamper slot 0 and fix both checksums, as a deliberate attacker would */
  tier_slot_hdr h;
  ASSERT_OK(kvp__tier_hdr_decode(img, sizeof img, &h));
  ASSERT_EQ(h.flags, TIER_HDR_F_AESGCM);
  img[HDR + 9] ^= 0x80;
  h.payload_sum = kvp__tier_payload_sum(img + HDR, 8 * KB);
  kvp__tier_hdr_encode(&h, img);
  ASSERT_EQ(pwrite(fd, img, sizeof img, 0), (ssize_t)sizeof img);
  (void)slot;
  close(fd);
  t = mk(dir, be, 4 * MB, 64 * MB);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, &(kvp_tier_ns_opts){.aes256_key = key}));
  ASSERT_EQ(get_k(t, &ns, K(0, 1), 8 * KB), KVP_ENOENT);
  ASSERT_EQ(get_k(t, &ns, K(1, 1), 8 * KB), KVP_TIER_NVME);
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.auth_failures, 1);
  ASSERT_EQ(st.checksum_failures, 0);
  kvp_tier_destroy(t);
  /* wrong key (another tenant's): authentication fails, a miss */
  t = mk(dir, be, 4 * MB, 64 * MB);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, &(kvp_tier_ns_opts){.aes256_key = key2}));
  ASSERT_EQ(get_k(t, &ns, K(2, 1), 8 * KB), KVP_ENOENT);
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.auth_failures, 1);
  kvp_tier_destroy(t);
  /* no key at all: an encrypted slot is not served as plaintext */
  t = mk(dir, be, 4 * MB, 64 * MB);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  ASSERT_EQ(get_k(t, &ns, K(1, 1), 8 * KB), KVP_ENOENT);
  kvp_tier_destroy(t);
  tt_rmdir(dir);
}

/* ---- fault injection through the I/O filter --------------------------------*/
typedef struct faults {
  int mode; /* 0 none, 1 EIO reads, 2 ENOSPC writes, 3 short reads, 4 short
               writes, 5 slow, 6 corrupt reads, 7 EIO fdatasync */
  int hits;
} faults;

static int filter(void *opaque, int op, void *b, size_t len, uint64_t off,
                  int res) {
  faults *f = opaque;
  (void)off;
  switch (f->mode) {
  case 1: if (op == 0 && len > 512) { f->hits++; return -EIO; } break;
  case 2: if (op == 1) { f->hits++; return -ENOSPC; } break;
  case 3: if (op == 0 && res > 0 && len > 512) { f->hits++; return res / 2; } break;
  case 4: if (op == 1 && res > 0) { f->hits++; return res - 512; } break;
  case 5: {
    struct timespec ts = {0, 2000000};
    nanosleep(&ts, NULL);
    f->hits++;
    break;
  }
  case 6: if (op == 0 && res > 8192) { ((uint8_t *)b)[res / 2] ^= 1; f->hits++; } break;
  case 7: if (op == 2) { f->hits++; return -EIO; } break;
  }
  return res;
}

static void nvme_faults(kvp_tier_io_backend be) {
  for (int mode = 1; mode <= 7; mode++) {
    char dir[256];
    tt_mkdir(dir, sizeof dir);
    faults fl = {0};
    kvp_tier_opts o = {.dram_bytes = 4 * MB, .nvme_dir = dir,
                       .nvme_bytes = 64 * MB, .io_backend = be,
                       .io_filter = filter, .io_filter_opaque = &fl,
                       .slow_io_us = 1000};
    kvp_tier_store *t;
    ASSERT_OK(kvp_tier_create(&o, NULL, &t));
    kvp_namespace ns = tt_ns("a", 16);
    ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
    fl.mode = mode;
    int durable_fail = 0;
    for (uint64_t i = 0; i < 20; i++) {
      tt_fill(&ns, K(i, 2), buf, 16 * KB);
      kvp_tier_put_opts po = {.flags = KVP_TIER_PUT_DURABLE};
      int rc = kvp_tier_put(t, &ns, K(i, 2), buf, 16 * KB, &po);
      if (rc < 0) {
        durable_fail++;
        ASSERT_TRUE(rc == -ENOSPC || rc == -EIO || rc == KVP_EIO);
      }
    }
    ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0));
    int hits = 0, miss = 0;
    for (uint64_t i = 0; i < 20; i++) {
      int rc = get_k(t, &ns, K(i, 2), 16 * KB); /* asserts the bytes */
      hits += rc >= 0;
      miss += rc == KVP_ENOENT;
    }
    kvp_tier_stats st;
    ASSERT_OK(kvp_tier_stats_get(t, &st));
    ASSERT_GT(fl.hits, 0);
    switch (mode) {
    case 1: case 3: case 6:
      ASSERT_EQ(miss, 20);
      ASSERT_GT(mode == 6 ? st.checksum_failures
                          : mode == 3 ? st.short_io : st.io_errors, 0);
      break;
    case 2: case 4:
      ASSERT_EQ(durable_fail, 20);
      ASSERT_EQ(miss, 20); /* never written, DRAM emptied: not wrong bytes */
      ASSERT_GT(mode == 4 ? st.short_io : st.io_errors, 0);
      break;
    case 5:
      ASSERT_EQ(hits, 20);
      ASSERT_GE(st.slow_io, 20); /* every write and read took >= 2 ms */
      break;
    case 7:
      ASSERT_EQ(durable_fail, 20); /* on NVMe but never acknowledged */
      ASSERT_EQ(hits, 20);
      break;
    }
    kvp_tier_destroy(t);
    tt_rmdir(dir);
  }
}

/* NVMe capacity is a hard limit: the class evicts its own victims. */
static void nvme_capacity(kvp_tier_io_backend be) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  kvp_tier_store *t = mk(dir, be, 4 * MB, 4 * MB);
  kvp_namespace ns = tt_ns("a", 16);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  for (uint64_t i = 0; i < 200; i++)
    put_k(t, &ns, K(i, 3), 64 * KB, 0, KVP_CLASS_STABLE);
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_LE(st.nvme_used_bytes, 4 * MB);
  ASSERT_GT(st.evictions[KVP_TIER_NVME], 50);
  int present = 0;
  for (uint64_t i = 0; i < 200; i++)
    present += get_k(t, &ns, K(i, 3), 64 * KB) >= 0;
  ASSERT_GT(present, 40);
  ASSERT_LT(present, 200);
  kvp_tier_destroy(t);
  tt_rmdir(dir);
}

/* Async tickets and prefetch. */
static void nvme_async(kvp_tier_io_backend be) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  kvp_tier_store *t = mk(dir, be, 8 * MB, 64 * MB);
  kvp_namespace ns = tt_ns("a", 16);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  enum { N = 16 };
  static uint8_t src[N][32 * KB], dstb[N][32 * KB];
  kvp_key keys[N];
  const void *data[N];
  void *dst[N];
  size_t len[N], cap[N], got[N];
  int res[N];
  for (int i = 0; i < N; i++) {
    keys[i] = K(100 + (uint64_t)i, 9);
    tt_fill(&ns, keys[i], src[i], sizeof src[i]);
    data[i] = src[i];
    dst[i] = dstb[i];
    len[i] = cap[i] = sizeof src[i];
  }
  kvp_ticket *tk;
  kvp_tier_put_opts po = {.cls = KVP_CLASS_SEMI, .flags = KVP_TIER_PUT_DURABLE};
  ASSERT_OK(kvp_tier_put_async(t, &ns, keys, N, data, len, &po, res, &tk));
  ASSERT_EQ(kvp_ticket_wait(tk, 0), N);
  ASSERT_EQ(kvp_ticket_poll(tk), N);
  kvp_ticket_free(tk);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0));
  ASSERT_EQ(kvp_tier_contains(t, &ns, keys[3]), KVP_TIER_NVME);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 8 * MB));
  ASSERT_OK(kvp_tier_prefetch(t, &ns, keys, N / 2, &tk));
  ASSERT_EQ(kvp_ticket_wait(tk, 0), N / 2);
  kvp_ticket_free(tk);
  ASSERT_EQ(kvp_tier_contains(t, &ns, keys[3]), KVP_TIER_DRAM);
  ASSERT_EQ(kvp_tier_contains(t, &ns, keys[N - 1]), KVP_TIER_NVME);
  memset(dstb, 0xA5, sizeof dstb);
  ASSERT_OK(kvp_tier_get_async(t, &ns, keys, N, dst, cap, got, res, &tk));
  int r = kvp_ticket_wait(tk, 5000000000ull);
  ASSERT_EQ(r, N);
  for (int i = 0; i < N; i++) {
    ASSERT_EQ(res[i], i < N / 2 ? KVP_TIER_DRAM : KVP_TIER_NVME);
    ASSERT_MEM_EQ(dstb[i], src[i], sizeof src[i]);
  }
  kvp_ticket_free(tk);
  ASSERT_OK(kvp_tier_prefetch(t, &ns, keys, N, NULL)); /* fire and forget */
  kvp_tier_destroy(t); /* drains it */
  tt_rmdir(dir);
}

/* Idle windows pre-write blocks so pressure later evicts without I/O. */
static void nvme_idle(kvp_tier_io_backend be) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  kvp_tier_store *t = mk(dir, be, 8 * MB, 64 * MB);
  kvp_namespace ns = tt_ns("a", 16);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  for (uint64_t i = 0; i < 10; i++)
    put_k(t, &ns, K(i, 4), 64 * KB, 0, i < 5 ? KVP_CLASS_VOLATILE : KVP_CLASS_SEMI);
  ASSERT_EQ(kvp_tier_idle(t, 1 * MB), 5); /* only the admitted ones */
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.nvme_blocks, 5);
  ASSERT_EQ(kvp_tier_contains(t, &ns, K(7, 4)), KVP_TIER_DRAM);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0));
  ASSERT_EQ(get_k(t, &ns, K(7, 4), 64 * KB), KVP_TIER_NVME);
  ASSERT_EQ(get_k(t, &ns, K(1, 4), 64 * KB), KVP_ENOENT);
  kvp_tier_destroy(t);
  tt_rmdir(dir);
}

/* The admission gate in the store.  Cold start (no
 * recompute rate) is the class + reuse rule; NVMe read-backs, evictions
 * and ghosts of rejected blocks are the outcomes it learns from; once a
 * cell has admit_min_samples of them, a block the gate rejects is not
 * written (a stable one too, when recomputing beats loading), and volatile
 * blocks whose ghosts came back are written without a reuse. */
/* malloc, or NULL while *opaque (a bool) is set */
static void *may_fail_alloc(void *opaque, size_t n) {
  return *(bool *)opaque ? NULL : malloc(n);
}

static void may_fail_free(void *opaque, void *p, size_t n) {
  (void)opaque, (void)n;
  free(p);
}

static void nvme_admission(kvp_tier_io_backend be) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  if (!dir[0])
    KVT_SKIP_BECAUSE("no directory takes O_DIRECT");
  kvp_tier_opts o = {.dram_bytes = 8 * MB, .nvme_dir = dir,
                     .nvme_bytes = 64 * MB, .io_backend = be,
                     .queue_depth = 8, .max_block_bytes = 1 * MB,
                     .admit_min_samples = 4};
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  kvp_namespace ns = tt_ns("a", 16);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, &(kvp_tier_ns_opts){.block_bytes = 64 * KB}));
  kvp_tier_stats st;
#define S(i) K(11, 100 + (i)) /* distinct fingerprints (key.lo) */
#define V(i) K(12, 200 + (i))
  /* 1. cold start: stable in, volatile only after a reuse */
  for (uint64_t i = 0; i < 4; i++) {
    put_k(t, &ns, S(i), 64 * KB, 0, KVP_CLASS_STABLE);
    put_k(t, &ns, V(i), 64 * KB, 0, KVP_CLASS_VOLATILE);
  }
  ASSERT_EQ(get_k(t, &ns, V(3), 64 * KB), KVP_TIER_DRAM);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0));
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 8 * MB));
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.admit_accepted[KVP_CLASS_STABLE], 4);
  ASSERT_EQ(st.admit_accepted[KVP_CLASS_VOLATILE], 1);
  ASSERT_EQ(st.admit_rejected[KVP_CLASS_VOLATILE], 3);
  ASSERT_EQ(st.admit_rejected[KVP_CLASS_STABLE], 0);
  ASSERT_EQ(st.nvme_blocks, 5);
  ASSERT_EQ(st.nvme_writes, 5);
  /* 2. outcomes: two read back, one evicted unread, two ghosts come back
   * (a get that misses, a put of the recomputed block) */
  ASSERT_EQ(get_k(t, &ns, S(0), 64 * KB), KVP_TIER_NVME);
  ASSERT_EQ(get_k(t, &ns, S(1), 64 * KB), KVP_TIER_NVME);
  ASSERT_EQ(kvp_tier_evict(t, &ns, S(2)), 1);
  ASSERT_ERR(get_k(t, &ns, V(0), 64 * KB), KVP_ENOENT);
  put_k(t, &ns, V(1), 64 * KB, 0, KVP_CLASS_VOLATILE);
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.admit_reused, 2);
  ASSERT_EQ(st.admit_unused, 1);
  ASSERT_EQ(st.admit_ghost_hits, 2);
  ASSERT_EQ(kvp_tier_evict(t, &ns, S(3)), 1); /* stable cell: 4 outcomes */
  /* 3. recomputing is cheaper than loading: stable blocks are rejected */
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_PREFILL_KV_BPS, INT64_C(1000000000000000)));
  put_k(t, &ns, S(4), 64 * KB, 0, KVP_CLASS_STABLE);
  put_k(t, &ns, S(5), 64 * KB, 0, KVP_CLASS_STABLE);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0));
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 8 * MB));
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.admit_rejected[KVP_CLASS_STABLE], 2);
  ASSERT_EQ(st.admit_rejected[KVP_CLASS_VOLATILE], 4); /* V1 again */
  ASSERT_EQ(st.nvme_writes, 5);                        /* nothing written */
  ASSERT_ERR(get_k(t, &ns, S(4), 64 * KB), KVP_ENOENT);
  ASSERT_EQ(get_k(t, &ns, S(0), 64 * KB), KVP_TIER_NVME); /* still there */
  /* 4. recomputing is dear and rejected volatile blocks keep coming back:
   * after 4 such outcomes a volatile block without a reuse is written */
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_PREFILL_KV_BPS, 1000000));
  ASSERT_ERR(get_k(t, &ns, V(1), 64 * KB), KVP_ENOENT); /* ghost: 3 */
  put_k(t, &ns, V(4), 64 * KB, 0, KVP_CLASS_VOLATILE);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0));
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 8 * MB));
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.admit_accepted[KVP_CLASS_VOLATILE], 1); /* V4: 3 < 4 */
  ASSERT_ERR(get_k(t, &ns, V(4), 64 * KB), KVP_ENOENT); /* ghost: 4 */
  put_k(t, &ns, V(5), 64 * KB, 0, KVP_CLASS_VOLATILE);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0));
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 8 * MB));
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.admit_accepted[KVP_CLASS_VOLATILE], 2);
  ASSERT_EQ(st.admit_ghost_hits, 5); /* + S4 (stable cell) */
  ASSERT_EQ(st.nvme_writes, 6);
  ASSERT_EQ(get_k(t, &ns, V(5), 64 * KB), KVP_TIER_NVME);
  /* the rule alone again: volatile without a reuse stays out */
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_ADMISSION, KVP_TIER_ADMIT_HITS));
  put_k(t, &ns, V(6), 64 * KB, 0, KVP_CLASS_VOLATILE);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0));
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.admit_rejected[KVP_CLASS_VOLATILE], 6); /* V0-2, V1, V4, V6 */
  ASSERT_EQ(st.nvme_writes, 6);
  /* bounds */
  ASSERT_ERR(kvp_tier_set(t, KVP_TIER_OPT_ADMISSION, 3), KVP_ERANGE);
  ASSERT_ERR(kvp_tier_set(t, KVP_TIER_OPT_ADMIT_WRITE_WEIGHT_MILLI, 0),
             KVP_ERANGE);
  ASSERT_ERR(kvp_tier_set(t, KVP_TIER_OPT_ADMIT_MIN_SAMPLES, 513), KVP_ERANGE);
  ASSERT_ERR(kvp_tier_set(t, KVP_TIER_OPT_PREFILL_KV_BPS, -1), KVP_ERANGE);
  kvp_namespace ns2 = tt_ns("b", 16);
  ASSERT_ERR(kvp_tier_ns_add(t, &ns2, &(kvp_tier_ns_opts){.prefill_kv_bytes_per_s = -1}),
             KVP_EINVAL);
  kvp_tier_destroy(t);
  kvp_log_set_level(KVP_LOG_OFF);
  o.admission = (kvp_tier_admission)3;
  ASSERT_ERR(kvp_tier_create(&o, NULL, &t), KVP_EINVAL);
  o.admission = KVP_TIER_ADMIT_GATE;
  o.admit_write_weight = -1;
  ASSERT_ERR(kvp_tier_create(&o, NULL, &t), KVP_EINVAL);
  kvp_log_set_level(KVP_LOG_ERROR);
  /* admission all keeps no ghost table; leaving it allocates one, and when
   * that fails the store stays on all, reporting KVP_ENOMEM */
  bool fail = false;
  kvp_allocator fa = {may_fail_alloc, may_fail_free, &fail};
  o.admit_write_weight = 0;
  o.admission = KVP_TIER_ADMIT_ALL;
  ASSERT_OK(kvp_tier_create(&o, &fa, &t));
  int64_t v = -1;
  fail = true;
  ASSERT_ERR(kvp_tier_set(t, KVP_TIER_OPT_ADMISSION, KVP_TIER_ADMIT_GATE),
             KVP_ENOMEM);
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_ADMISSION, &v));
  ASSERT_EQ(v, (int64_t)KVP_TIER_ADMIT_ALL);
  fail = false;
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_ADMISSION, KVP_TIER_ADMIT_GATE));
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_ADMISSION, &v));
  ASSERT_EQ(v, (int64_t)KVP_TIER_ADMIT_GATE);
  kvp_tier_destroy(t);
#undef S
#undef V
  tt_rmdir(dir);
}

/* Write-back with the next block staged while the queue is full (the
 * default) and without, at queue depth 1 and 4, plain and AES-GCM, one
 * write in five failing with EIO: every block that reached NVMe reads back
 * exactly (from NVMe only), the failed ones are clean misses, and both
 * settings write the same set. */
static int fail_every_5th_write(void *opaque, int op, void *b, size_t len,
                                uint64_t off, int res) {
  (void)b, (void)len, (void)off;
  int *n = opaque;
  return op == 1 && ++*n % 5 == 0 ? -EIO : res;
}

static void nvme_stage_ahead(kvp_tier_io_backend be) {
  static const uint8_t key[32] = {7, 1, 2, 3};
  for (int qd = 1; qd <= 4; qd *= 4)
    for (int ahead = 0; ahead < 2; ahead++)
      for (int enc = 0; enc < 2; enc++) {
        char dir[256];
        tt_mkdir(dir, sizeof dir);
        int writes = 0;
        kvp_tier_opts o = {.dram_bytes = 16 * MB, .nvme_dir = dir,
                           .nvme_bytes = 64 * MB, .io_backend = be,
                           .queue_depth = (uint32_t)qd, .max_block_bytes = 1 * MB,
                           .io_filter = fail_every_5th_write,
                           .io_filter_opaque = &writes};
        kvp_tier_store *t;
        ASSERT_OK(kvp_tier_create(&o, NULL, &t));
        int64_t v;
        ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_STAGE_AHEAD, &v));
        ASSERT_EQ(v, 1); /* the default */
        ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_STAGE_AHEAD, ahead));
        kvp_namespace ns = tt_ns(enc ? "enc" : "plain", 16);
        ASSERT_OK(kvp_tier_ns_add(t, &ns, &(kvp_tier_ns_opts){
                                              .aes256_key = enc ? key : NULL}));
        for (uint64_t i = 0; i < 40; i++) /* mixed sizes: several classes */
          put_k(t, &ns, K(i, 9), 8 * KB + i * 5000, 0, KVP_CLASS_STABLE);
        int w = kvp_tier_idle(t, 64 * MB);
        ASSERT_EQ(w, 40 - 40 / 5); /* every fifth write failed */
        ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 0));
        int hits = 0;
        for (uint64_t i = 0; i < 40; i++) {
          int rc = get_k(t, &ns, K(i, 9), 8 * KB + i * 5000); /* checks bytes */
          ASSERT_TRUE(rc == KVP_TIER_NVME || rc == KVP_ENOENT);
          hits += rc == KVP_TIER_NVME;
        }
        /* the DRAM shrink wrote the 8 back again (one in five failing) */
        kvp_tier_stats st;
        ASSERT_OK(kvp_tier_stats_get(t, &st));
        ASSERT_EQ(st.io_errors, (uint64_t)writes / 5);
        ASSERT_EQ(st.nvme_writes, (uint64_t)writes);
        ASSERT_EQ((uint64_t)hits, st.nvme_writes - st.io_errors);
        ASSERT_GE(hits, 32);
        ASSERT_EQ(st.checksum_failures, 0);
        kvp_tier_destroy(t);
        tt_rmdir(dir);
      }
}

#define ON_BACKENDS(fn)                                                         \
  TEST(fn##_all) {                                                              \
    kvp_tier_io_backend b[2];                                                   \
    int n = tt_backends(b);                                                     \
    for (int i = 0; i < n; i++) {                                               \
      fprintf(stderr, "  %s on %s\n", #fn, tt_backend_name(b[i]));              \
      fn(b[i]);                                                                 \
    }                                                                           \
  }
ON_BACKENDS(nvme_demote_promote)
ON_BACKENDS(nvme_recovery)
ON_BACKENDS(nvme_corruption)
ON_BACKENDS(nvme_payload_only)
ON_BACKENDS(nvme_encryption)
ON_BACKENDS(nvme_registered)
ON_BACKENDS(nvme_faults)
ON_BACKENDS(nvme_capacity)
ON_BACKENDS(nvme_async)
ON_BACKENDS(nvme_idle)
ON_BACKENDS(nvme_admission)
ON_BACKENDS(nvme_stage_ahead)

static char last_log[512];
static void keep_log(void *opaque, kvp_log_level level, const char *module,
                     const char *msg) {
  (void)opaque;
  (void)level;
  snprintf(last_log, sizeof last_log, "%s: %s", module, msg);
}

/* tmpfs: accepted with a warning that names the directory where the kernel
 * takes O_DIRECT there (Linux >= 6.6), else KVP_ENOTSUP, logged with it. */
TEST(tmpfs_warned_or_refused) {
  kvp_tier_store *t;
  kvp_tier_opts o = {.dram_bytes = 4 * MB, .nvme_dir = "/dev/shm"};
  struct statfs fs;
  if (statfs("/dev/shm", &fs) != 0 || fs.f_type != TMPFS_MAGIC)
    KVT_SKIP_BECAUSE("/dev/shm is not tmpfs here");
  last_log[0] = '\0';
  kvp_log_set_sink(keep_log, NULL);
  kvp_log_set_level(KVP_LOG_WARN);
  int rc = kvp_tier_create(&o, NULL, &t);
  kvp_log_set_sink(NULL, NULL);
  kvp_log_set_level(KVP_LOG_ERROR);
  ASSERT_NOT_NULL(strstr(last_log, "nvme_dir /dev/shm"));
  if (rc == 0) {
    ASSERT_NOT_NULL(strstr(last_log, "is on tmpfs: accepted"));
    kvp_tier_destroy(t);
  } else {
    ASSERT_ERR(rc, KVP_ENOTSUP);
  }
  o.nvme_dir = "/nonexistent/kvtier";
  kvp_log_set_level(KVP_LOG_OFF);
  ASSERT_ERR(kvp_tier_create(&o, NULL, &t), -ENOENT);
  kvp_log_set_level(KVP_LOG_ERROR);
}

/* A slab file that cannot be opened (here: a directory with a slab file's
 * name) fails the store with -errno and a message naming its path. */
TEST(slab_path_named) {
  char dir[256], slab[512];
  tt_mkdir(dir, sizeof dir);
  if (dir[0] == '\0')
    KVT_SKIP_BECAUSE("no directory here takes O_DIRECT");
  snprintf(slab, sizeof slab, "%s/kvtier-65536.slab", dir);
  ASSERT_OK(mkdir(slab, 0700));
  kvp_tier_opts o = {.dram_bytes = 4 * MB, .nvme_dir = dir};
  kvp_tier_store *t = NULL;
  last_log[0] = '\0';
  kvp_log_set_sink(keep_log, NULL);
  int rc = kvp_tier_create(&o, NULL, &t);
  kvp_log_set_sink(NULL, NULL);
  rmdir(slab);
  tt_rmdir(dir);
  ASSERT_ERR(rc, -EISDIR);
  ASSERT_NULL(t);
  if (strstr(last_log, slab) == NULL)
    fprintf(stderr, "log: %s\n", last_log);
  ASSERT_NOT_NULL(strstr(last_log, slab));
}

/* ---- policies -----------------------------------------------------------------*/
TEST(policy_lru) {
  tier_policy *p;
  ASSERT_OK(kvp__tier_policy_create(KVP_TIER_POLICY_LRU, NULL, &p));
  for (uint32_t i = 0; i < 5; i++)
    ASSERT_OK(kvp__tier_policy_insert(p, i, i, 10, KVP_CLASS_VOLATILE));
  ASSERT_ERR(kvp__tier_policy_insert(p, 2, 2, 10, 0), KVP_EEXIST);
  ASSERT_OK(kvp__tier_policy_touch(p, 0));
  uint32_t v;
  ASSERT_OK(kvp__tier_policy_victim(p, &v));
  ASSERT_EQ(v, 1);
  ASSERT_OK(kvp__tier_policy_remove(p, 1, 1));
  ASSERT_OK(kvp__tier_policy_victim(p, &v));
  ASSERT_EQ(v, 2);
  ASSERT_EQ(kvp__tier_policy_bytes(p), 40);
  ASSERT_EQ(kvp__tier_policy_count(p), 4);
  ASSERT_ERR(kvp__tier_policy_touch(p, 1), KVP_ENOENT);
  /* stability: a stable entry goes after every volatile/semi one */
  ASSERT_OK(kvp__tier_policy_insert(p, 9, 9, 10, KVP_CLASS_STABLE));
  ASSERT_OK(kvp__tier_policy_insert(p, 8, 8, 10, KVP_CLASS_SEMI));
  static const uint32_t order[6] = {2, 3, 4, 0, 8, 9};
  for (int n = 0; n < 6; n++) {
    ASSERT_OK(kvp__tier_policy_victim(p, &v));
    ASSERT_EQ(v, order[n]);
    ASSERT_OK(kvp__tier_policy_remove(p, v, 1));
  }
  ASSERT_ERR(kvp__tier_policy_victim(p, &v), KVP_ENOENT);
  kvp__tier_policy_destroy(p);
  kvp_tier_policy_kind k;
  ASSERT_OK(kvp_tier_policy_parse("s3fifo", &k));
  ASSERT_EQ(k, KVP_TIER_POLICY_S3FIFO);
  ASSERT_STR_EQ(kvp_tier_policy_name(KVP_TIER_POLICY_LRU), "lru");
  ASSERT_ERR(kvp_tier_policy_parse("arc", &k), KVP_EINVAL);
}

/* kvp__tier_policy_peek: LRU's next victims, read without a change.  Random
 * inserts (three classes), touches and removals of 300 ids; every so often
 * the peek chain from the first victim through its class is the order
 * kvp__tier_policy_victim then gives them out, removed one by one.  S3-FIFO,
 * an untracked id and an empty policy: none. */
TEST(policy_lru_peek) {
  enum { IDS = 300 };
  tier_policy *p;
  ASSERT_OK(kvp__tier_policy_create(KVP_TIER_POLICY_LRU, NULL, &p));
  ASSERT_EQ(kvp__tier_policy_peek(p, UINT32_MAX), UINT32_MAX);
  static uint8_t in[IDS];
  memset(in, 0, sizeof in);
  uint32_t chain[IDS];
  size_t checked = 0;
  for (int step = 1; step <= 20000; step++) {
    uint32_t id = kvt_rand_below(IDS);
    int op = (int)kvt_rand_below(3);
    if (!in[id]) {
      ASSERT_OK(kvp__tier_policy_insert(p, id, id, 1, kvt_rand_below(3)));
      in[id] = 1;
    } else if (op == 0) {
      ASSERT_OK(kvp__tier_policy_touch(p, id));
    } else if (op == 1) {
      ASSERT_EQ(kvp__tier_policy_peek(p, id) == UINT32_MAX ||
                    in[kvp__tier_policy_peek(p, id)],
                true);
      ASSERT_OK(kvp__tier_policy_remove(p, id, 1));
      in[id] = 0;
      ASSERT_EQ(kvp__tier_policy_peek(p, id), UINT32_MAX);
    }
    if (step % 500)
      continue;
    size_t n = 0;
    for (uint32_t v = kvp__tier_policy_peek(p, UINT32_MAX); v != UINT32_MAX;
         v = kvp__tier_policy_peek(p, v)) {
      ASSERT_LT(n, (size_t)IDS);
      chain[n++] = v;
    }
    ASSERT_GT(n, 0u);
    for (size_t i = 0; i < n; i++) {
      uint32_t v;
      ASSERT_OK(kvp__tier_policy_victim(p, &v));
      ASSERT_EQ(v, chain[i]);
      ASSERT_OK(kvp__tier_policy_remove(p, v, 1));
      in[v] = 0;
    }
    checked += n;
  }
  ASSERT_GT(checked, 1000u);
  kvp__tier_policy_destroy(p);
  ASSERT_OK(kvp__tier_policy_create(KVP_TIER_POLICY_S3FIFO, NULL, &p));
  ASSERT_OK(kvp__tier_policy_insert(p, 1, 1, 1, KVP_CLASS_VOLATILE));
  ASSERT_OK(kvp__tier_policy_insert(p, 2, 2, 1, KVP_CLASS_VOLATILE));
  ASSERT_EQ(kvp__tier_policy_peek(p, UINT32_MAX), UINT32_MAX);
  ASSERT_EQ(kvp__tier_policy_peek(p, 2), UINT32_MAX);
  kvp__tier_policy_destroy(p);
  ASSERT_EQ(kvp__tier_policy_peek(NULL, UINT32_MAX), UINT32_MAX);
}

/* Cache simulation: a hot set re-read between one-time scans.  S3-FIFO keeps
 * the hot set through the scans; LRU loses it every scan. */
static double sim_hit_rate(kvp_tier_policy_kind kind) {
  tier_policy *p;
  ASSERT_OK(kvp__tier_policy_create(kind, NULL, &p));
  enum { CAP = 100, HOT = 60, IDS = 100000 };
  static uint8_t in[IDS];
  memset(in, 0, sizeof in);
  uint64_t hits = 0, refs = 0, scan_next = 1000;
  for (int round = 0; round < 200; round++) {
    for (int pass = 0; pass < 2; pass++)
      for (uint32_t h = 0; h < HOT; h++) {
        refs++;
        if (in[h]) {
          hits++;
          kvp__tier_policy_touch(p, h);
          continue;
        }
        while (kvp__tier_policy_count(p) >= CAP) {
          uint32_t v;
          ASSERT_OK(kvp__tier_policy_victim(p, &v));
          ASSERT_OK(kvp__tier_policy_remove(p, v, 1));
          in[v] = 0;
        }
        ASSERT_OK(kvp__tier_policy_insert(p, h, h * 31 + 7, 1, 0));
        in[h] = 1;
      }
    for (int s = 0; s < 80; s++) { /* a scan of new ids */
      uint32_t id = (uint32_t)(scan_next++ % IDS);
      if (id < HOT)
        continue;
      while (kvp__tier_policy_count(p) >= CAP) {
        uint32_t v;
        ASSERT_OK(kvp__tier_policy_victim(p, &v));
        ASSERT_OK(kvp__tier_policy_remove(p, v, 1));
        in[v] = 0;
      }
      if (!in[id]) {
        ASSERT_OK(kvp__tier_policy_insert(p, id, id * 31 + 7, 1, 0));
        in[id] = 1;
      }
    }
  }
  kvp__tier_policy_destroy(p);
  return (double)hits / (double)refs;
}

TEST(policy_scan_resistance) {
  double lru = sim_hit_rate(KVP_TIER_POLICY_LRU);
  double s3 = sim_hit_rate(KVP_TIER_POLICY_S3FIFO);
  printf("hot-set hit rate under scans: lru %.3f s3fifo %.3f\n", lru, s3);
  ASSERT_TRUE(lru < 0.6);
  ASSERT_TRUE(s3 > 0.9);
}

/* A reserved policy (no growth) decides exactly as one that grows by
 * doubling, over random inserts, touches, removals and evictions; charges
 * up to 2^32 - 1 are summed in 64 bits, larger ones refused. */
TEST(policy_reserve) {
  for (int kind = 0; kind < 2; kind++) {
    kvp_tier_policy_kind k = kind ? KVP_TIER_POLICY_S3FIFO : KVP_TIER_POLICY_LRU;
    tier_policy *a, *b;
    ASSERT_OK(kvp__tier_policy_create(k, NULL, &a));
    ASSERT_OK(kvp__tier_policy_create(k, NULL, &b));
    enum { IDS = 5000 };
    ASSERT_OK(kvp__tier_policy_reserve(a, IDS));
    ASSERT_OK(kvp__tier_policy_reserve(a, 10)); /* never shrinks */
    static uint8_t in[IDS];
    memset(in, 0, sizeof in);
    uint64_t x = 0x9E3779B97F4A7C15ull, victims = 0;
    for (int op = 0; op < 200000; op++) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      uint32_t id = (uint32_t)(x % IDS);
      kvp__tier_policy_prefetch(a, id); /* a hint: no effect */
      kvp__tier_policy_prefetch(b, id);
      if (in[id] && (x >> 40) % 3 == 0) {
        ASSERT_OK(kvp__tier_policy_touch(a, id));
        ASSERT_OK(kvp__tier_policy_touch(b, id));
      } else if (in[id] && (x >> 40) % 3 == 1) {
        ASSERT_OK(kvp__tier_policy_remove(a, id, 0));
        ASSERT_OK(kvp__tier_policy_remove(b, id, 0));
        in[id] = 0;
      } else if (!in[id]) {
        while (kvp__tier_policy_count(a) >= 700) {
          uint32_t va, vb;
          ASSERT_OK(kvp__tier_policy_victim(a, &va));
          ASSERT_OK(kvp__tier_policy_victim(b, &vb));
          ASSERT_EQ(va, vb);
          ASSERT_OK(kvp__tier_policy_remove(a, va, 1));
          ASSERT_OK(kvp__tier_policy_remove(b, vb, 1));
          in[va] = 0;
          victims++;
        }
        kvp_class c = (kvp_class)((x >> 20) % KVP_CLASS_COUNT_);
        ASSERT_OK(kvp__tier_policy_insert(a, id, x, 1 + (x >> 50), c));
        ASSERT_OK(kvp__tier_policy_insert(b, id, x, 1 + (x >> 50), c));
        in[id] = 1;
      }
      ASSERT_EQ(kvp__tier_policy_count(a), kvp__tier_policy_count(b));
      ASSERT_EQ(kvp__tier_policy_bytes(a), kvp__tier_policy_bytes(b));
    }
    ASSERT_GT(victims, 10000);
    kvp__tier_policy_destroy(a);
    kvp__tier_policy_destroy(b);
  }
  tier_policy *p;
  ASSERT_OK(kvp__tier_policy_create(KVP_TIER_POLICY_LRU, NULL, &p));
  for (uint32_t i = 0; i < 3; i++)
    ASSERT_OK(kvp__tier_policy_insert(p, i, i, UINT32_MAX, 0));
  ASSERT_EQ(kvp__tier_policy_bytes(p), 3ull * UINT32_MAX);
  ASSERT_ERR(kvp__tier_policy_insert(p, 3, 3, 1ull << 32, 0), KVP_EINVAL);
  ASSERT_ERR(kvp__tier_policy_reserve(NULL, 8), KVP_EINVAL);
  kvp__tier_policy_destroy(p);
}

/* Two tiers as an exclusive hierarchy (a victim of the first moves to the
 * second, a hit in the second moves back): policies sharing one array of
 * entries decide exactly as two with their own.  Sharing's rules: an id is
 * tracked by one sharer at a time, a policy shares only while empty, three
 * at most. */
TEST(policy_share) {
  tier_policy *s[2], *u[2];
  for (int t = 0; t < 2; t++) {
    kvp_tier_policy_kind k = t ? KVP_TIER_POLICY_S3FIFO : KVP_TIER_POLICY_LRU;
    ASSERT_OK(kvp__tier_policy_create(k, NULL, &s[t]));
    ASSERT_OK(kvp__tier_policy_create(k, NULL, &u[t]));
  }
  ASSERT_OK(kvp__tier_policy_share(s[1], s[0]));
  enum { IDS = 3000, CAP0 = 300, CAP1 = 900 };
  static uint8_t where[IDS]; /* 0 none, 1 first tier, 2 second */
  memset(where, 0, sizeof where);
  uint64_t x = 0x2545F4914F6CDD1Dull, moved = 0;
  for (int op = 0; op < 100000; op++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    uint32_t id = (uint32_t)(x % IDS), v[2];
    if (where[id] == 1) { /* a hit */
      ASSERT_OK(kvp__tier_policy_touch(s[0], id));
      ASSERT_OK(kvp__tier_policy_touch(u[0], id));
      ASSERT_ERR(kvp__tier_policy_touch(s[1], id), KVP_ENOENT);
      continue;
    }
    if (where[id] == 2) { /* back up from the second tier */
      ASSERT_ERR(kvp__tier_policy_remove(s[0], id, 0), KVP_ENOENT);
      ASSERT_OK(kvp__tier_policy_remove(s[1], id, 0));
      ASSERT_OK(kvp__tier_policy_remove(u[1], id, 0));
    }
    while (kvp__tier_policy_count(s[0]) >= CAP0) { /* demote */
      ASSERT_OK(kvp__tier_policy_victim(s[0], &v[0]));
      ASSERT_OK(kvp__tier_policy_victim(u[0], &v[1]));
      ASSERT_EQ(v[0], v[1]);
      ASSERT_OK(kvp__tier_policy_remove(s[0], v[0], 1));
      ASSERT_OK(kvp__tier_policy_remove(u[0], v[0], 1));
      while (kvp__tier_policy_count(s[1]) >= CAP1) { /* drop */
        uint32_t w[2];
        ASSERT_OK(kvp__tier_policy_victim(s[1], &w[0]));
        ASSERT_OK(kvp__tier_policy_victim(u[1], &w[1]));
        ASSERT_EQ(w[0], w[1]);
        ASSERT_OK(kvp__tier_policy_remove(s[1], w[0], 1));
        ASSERT_OK(kvp__tier_policy_remove(u[1], w[0], 1));
        where[w[0]] = 0;
      }
      ASSERT_OK(kvp__tier_policy_insert(s[1], v[0], v[0] * 77, 1, 0));
      ASSERT_OK(kvp__tier_policy_insert(u[1], v[0], v[0] * 77, 1, 0));
      where[v[0]] = 2;
      moved++;
    }
    kvp_class c = (kvp_class)((x >> 30) % KVP_CLASS_COUNT_);
    ASSERT_OK(kvp__tier_policy_insert(s[0], id, id * 77, 1, c));
    ASSERT_OK(kvp__tier_policy_insert(u[0], id, id * 77, 1, c));
    ASSERT_ERR(kvp__tier_policy_insert(s[1], id, id * 77, 1, c), KVP_EEXIST);
    where[id] = 1;
  }
  ASSERT_GT(moved, 10000);
  ASSERT_EQ(kvp__tier_policy_count(s[1]), kvp__tier_policy_count(u[1]));
  tier_policy *t3, *t4, *busy;
  ASSERT_OK(kvp__tier_policy_create(KVP_TIER_POLICY_LRU, NULL, &t3));
  ASSERT_OK(kvp__tier_policy_create(KVP_TIER_POLICY_LRU, NULL, &t4));
  ASSERT_OK(kvp__tier_policy_create(KVP_TIER_POLICY_LRU, NULL, &busy));
  ASSERT_OK(kvp__tier_policy_insert(busy, 1, 1, 1, 0));
  ASSERT_ERR(kvp__tier_policy_share(busy, s[0]), KVP_EINVAL); /* not empty */
  ASSERT_ERR(kvp__tier_policy_share(s[1], s[0]), KVP_EINVAL); /* already */
  ASSERT_ERR(kvp__tier_policy_share(t3, t3), KVP_EINVAL);
  ASSERT_OK(kvp__tier_policy_share(t3, s[0]));
  ASSERT_ERR(kvp__tier_policy_share(t4, s[0]), KVP_ERANGE); /* a fourth */
  kvp__tier_policy_destroy(s[0]); /* the others keep the entries */
  ASSERT_OK(kvp__tier_policy_insert(t3, IDS + 5, 1, 1, 0));
  ASSERT_OK(kvp__tier_policy_touch(t3, IDS + 5));
  kvp__tier_policy_destroy(t3);
  kvp__tier_policy_destroy(s[1]);
  for (tier_policy **q = (tier_policy *[]){u[0], u[1], t4, busy, NULL}; *q; q++)
    kvp__tier_policy_destroy(*q);
}

/* ---- options and events ------------------------------------------------------*/
TEST(options) {
  kvp_tier_store *t = mk(NULL, 0, 8 * MB, 0);
  int64_t lo, hi, v;
  ASSERT_OK(kvp_tier_opt_bounds(t, KVP_TIER_OPT_DRAM_BYTES, &lo, &hi));
  ASSERT_EQ(lo, 0);
  ASSERT_GE(hi, 8 * MB);
  ASSERT_ERR(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, hi + 1), KVP_ERANGE);
  ASSERT_ERR(kvp_tier_set(t, (kvp_tier_opt)99, 1), KVP_EINVAL);
  ASSERT_ERR(kvp_tier_set(t, KVP_TIER_OPT_POLICY, 5), KVP_ERANGE);
  kvp_namespace ns = tt_ns("a", 16);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  for (uint64_t i = 0; i < 20; i++)
    put_k(t, &ns, K(i, 6), 64 * KB, 0, 0);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_POLICY, KVP_TIER_POLICY_LRU));
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_POLICY, &v));
  ASSERT_EQ(v, KVP_TIER_POLICY_LRU);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES, 512 * KB));
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_LE(st.dram_used_bytes, 512 * KB);
  ASSERT_GT(st.dram_blocks, 0);
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_QUEUE_DEPTH, 1));
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_QUEUE_DEPTH, &v));
  ASSERT_EQ(v, 1);
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_READ_UNLOCKED, &v));
  ASSERT_EQ(v, 1); /* the default */
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_READ_UNLOCKED, 0));
  ASSERT_OK(kvp_tier_opt_get(t, KVP_TIER_OPT_READ_UNLOCKED, &v));
  ASSERT_EQ(v, 0);
  ASSERT_ERR(kvp_tier_set(t, KVP_TIER_OPT_READ_UNLOCKED, 2), KVP_ERANGE);
  ASSERT_ERR(kvp_tier_set(t, KVP_TIER_OPT_STAGE_AHEAD, 2), KVP_ERANGE);
  kvp_tier_destroy(t);
}

typedef struct evlog {
  kvp_index *ix;
  int stored[KVP_TIER_COUNT_], removed[KVP_TIER_COUNT_];
  uint64_t last_seq;
} evlog;

static void on_event(void *opaque, const kvp_tier_event *ev) {
  evlog *l = opaque;
  ASSERT_EQ(ev->seq, l->last_seq + 1);
  l->last_seq = ev->seq;
  if (ev->stored) {
    l->stored[ev->tier]++;
    ASSERT_GE(kvp_index_stored(l->ix, 0, ev->seq, ev->tier, NULL, &ev->key, 1), 0);
  } else {
    l->removed[ev->tier]++;
    ASSERT_GE(kvp_index_removed(l->ix, 0, ev->seq, ev->tier, &ev->key, 1), 0);
  }
}

/* Events feed a real locality index: it ends up with the store's contents. */
TEST(events_feed_index) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  evlog l = {0};
  ASSERT_OK(kvp_index_create(NULL, NULL, &l.ix));
  ASSERT_OK(kvp_index_worker_add(l.ix, 0));
  kvp_tier_opts o = {.dram_bytes = 4 * MB, .nvme_dir = dir, .nvme_bytes = 64 * MB,
                     .on_event = on_event, .event_opaque = &l};
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  kvp_namespace ns = tt_ns("a", 16);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  for (uint64_t i = 0; i < 96; i++) /* 64 fit the region */
    put_k(t, &ns, K(i, 8), 64 * KB, 0, KVP_CLASS_STABLE);
  ASSERT_EQ(kvp_tier_evict(t, &ns, K(95, 8)), 1);
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(l.stored[KVP_TIER_DRAM] - l.removed[KVP_TIER_DRAM], (int)st.dram_blocks);
  ASSERT_EQ(l.stored[KVP_TIER_NVME] - l.removed[KVP_TIER_NVME], (int)st.nvme_blocks);
  ASSERT_GT(st.nvme_blocks, 20);
  kvp_index_stats is;
  ASSERT_OK(kvp_index_stats_get(l.ix, &is));
  ASSERT_EQ(is.events_stale + is.seq_gaps, 0);
  kvp_tier_destroy(t);
  kvp_index_destroy(l.ix);
  tt_rmdir(dir);
}

/* ---- event epochs and the resident key walk -------------------------------
 * A connector feeds a store's events into locality indexes as stream 1 of
 * worker 0.  The store restarts on its slab files: its events number from 1
 * again in a larger epoch, and the indexes must end with what the store
 * holds (before epochs, the restarted store's events were dropped as stale
 * and a block put after the restart was found on no worker). */
#define EB 64u           /* blocks */
#define EKEY0 0x50000ull /* block i: key lo EKEY0 + i, the index fingerprint */
#define EBYTES (128 * KB)

static kvp_key ekey(size_t i) { return K(i + 1, EKEY0 + i); }

typedef struct conn {
  /* [0] follows every event; [1] only while attached (a connector that
   * restarted and resyncs); [2] the per-worker calls, without epochs */
  kvp_index *ix[3];
  bool attached;
  uint64_t epoch, seq;  /* the last event's */
  uint8_t held[EB];     /* tier mask per block, as the events say */
  uint64_t legacy_stale;
} conn;

static void conn_feed(kvp_index *ix, const kvp_tier_event *ev) {
  kvp_index_src src = {.worker = 0, .stream = 1, .epoch = ev->epoch,
                       .seq = ev->seq};
  int rc = ev->stored
               ? kvp_index_src_stored(ix, &src, ev->tier, NULL, &ev->key, 1)
               : kvp_index_src_removed(ix, &src, ev->tier, &ev->key, 1);
  ASSERT_EQ(rc, 1);
}

static void conn_event(void *opaque, const kvp_tier_event *ev) {
  conn *c = opaque;
  if (ev->epoch != c->epoch) { /* a new store: numbered from 1 */
    ASSERT_GT(ev->epoch, c->epoch);
    ASSERT_EQ(ev->seq, 1u);
    c->epoch = ev->epoch;
    c->seq = 0;
    memset(c->held, 0, sizeof c->held);
  }
  ASSERT_EQ(ev->seq, c->seq + 1);
  c->seq = ev->seq;
  uint64_t i = ev->key.lo - EKEY0;
  ASSERT_LT(i, (uint64_t)EB);
  ASSERT_EQ(ev->bytes, (uint64_t)EBYTES);
  uint8_t bit = (uint8_t)(1u << ev->tier), had = c->held[i] & bit;
  ASSERT_EQ(had != 0, !ev->stored); /* each event changes one residency */
  c->held[i] = (uint8_t)(ev->stored ? c->held[i] | bit : c->held[i] & ~bit);
  conn_feed(c->ix[0], ev);
  if (c->attached)
    conn_feed(c->ix[1], ev);
  int rc = ev->stored
               ? kvp_index_stored(c->ix[2], 0, ev->seq, ev->tier, NULL,
                                  &ev->key, 1)
               : kvp_index_removed(c->ix[2], 0, ev->seq, ev->tier, &ev->key,
                                   1);
  c->legacy_stale += rc == KVP_EEXIST;
}

static int res_add(void *opaque, const kvp_tier_resident *r) {
  uint8_t *m = opaque;
  uint64_t i = r->key.lo - EKEY0;
  ASSERT_LT(i, (uint64_t)EB);
  ASSERT_KEY_EQ(r->key, ekey(i));
  ASSERT_EQ(r->bytes, (uint64_t)EBYTES);
  ASSERT_TRUE(r->tier == KVP_TIER_DRAM || r->tier == KVP_TIER_NVME);
  ASSERT_EQ(m[i] & (1u << r->tier), 0u); /* once per tier */
  m[i] |= (uint8_t)(1u << r->tier);
  return 0;
}

/* What kvp_tier_keys_each lists, as tier masks; *seq its seq. */
static void store_keys(kvp_tier_store *t, uint8_t m[EB], uint64_t *seq) {
  memset(m, 0, EB);
  ASSERT_OK(kvp_tier_keys_each(t, res_add, m, seq));
}

static int ix_add(void *opaque, uint64_t fp, uint32_t mask) {
  uint8_t *m = opaque;
  ASSERT_LT(fp - EKEY0, (uint64_t)EB);
  m[fp - EKEY0] = (uint8_t)mask;
  return 0;
}

static void index_keys(kvp_index *ix, uint8_t m[EB]) {
  memset(m, 0, EB);
  ASSERT_OK(kvp_index_worker_keys(ix, 0, ix_add, m));
}

/* The store's listing, the events' account and the indexes agree. */
static void expect_same(kvp_tier_store *t, const conn *c, int nix) {
  uint8_t st[EB], ix[EB];
  uint64_t seq;
  store_keys(t, st, &seq);
  ASSERT_EQ(seq, c->seq);
  ASSERT_MEM_EQ(st, c->held, EB);
  for (int k = 0; k < nix; k++) {
    index_keys(c->ix[k], ix);
    ASSERT_MEM_EQ(ix, st, EB);
  }
}

/* The worker's match for block i in index ix: its tier, -1 when none. */
static int found_in(kvp_index *ix, size_t i) {
  kvp_key k = ekey(i);
  kvp_index_match m[2];
  int n = kvp_index_query(ix, &k, 1, 0, m, 2);
  ASSERT_GE(n, 0);
  if (n == 0)
    return -1;
  ASSERT_EQ(n, 1);
  for (int t = 0; t < KVP_TIER_COUNT_; t++)
    if (m[0].tier_blocks[t])
      return t;
  return -1;
}

static kvp_tier_store *conn_store(const char *dir, kvp_tier_io_backend be,
                                  conn *c) {
  kvp_tier_opts o = {.dram_bytes = 4 * MB, .nvme_dir = dir,
                     .nvme_bytes = 64 * MB, .io_backend = be,
                     .queue_depth = 8, .max_block_bytes = 1 * MB,
                     .on_event = conn_event, .event_opaque = c};
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  return t;
}

static void put_e(kvp_tier_store *t, const kvp_namespace *ns, size_t i,
                  uint32_t flags) {
  put_k(t, ns, ekey(i), EBYTES, flags, KVP_CLASS_STABLE);
}

/* The snapshot a restarted connector rebuilds index ix from. */
static int resync_from(kvp_tier_store *t, kvp_index *ix) {
  static kvp_key keys[2 * EB];
  static uint8_t tiers[2 * EB];
  uint8_t m[EB];
  uint64_t seq;
  store_keys(t, m, &seq);
  size_t n = 0;
  for (size_t i = 0; i < EB; i++)
    for (unsigned b = 0; b < KVP_TIER_COUNT_; b++)
      if (m[i] & (1u << b)) {
        keys[n] = ekey(i);
        tiers[n++] = (uint8_t)b;
      }
  kvp_index_src src = {.worker = 0, .stream = 1, .epoch = kvp_tier_epoch(t),
                       .seq = seq};
  return kvp_index_src_resync(
      ix, &src, (1u << KVP_TIER_DRAM) | (1u << KVP_TIER_NVME), keys, tiers, n);
}

static void epoch_restart(kvp_tier_io_backend be) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  kvp_namespace ns = tt_ns("a", 16);
  static conn c;
  memset(&c, 0, sizeof c);
  for (int k = 0; k < 3; k++) {
    ASSERT_OK(kvp_index_create(&(kvp_index_opts){.max_workers = 8}, NULL,
                               &c.ix[k]));
    ASSERT_OK(kvp_index_worker_add(c.ix[k], 0));
  }
  c.attached = true;
  /* life 1: 48 blocks through a 4 MiB DRAM tier, some durable */
  kvp_tier_store *t = conn_store(dir, be, &c);
  uint64_t e1 = kvp_tier_epoch(t);
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  for (size_t i = 0; i < 48; i++)
    put_e(t, &ns, i, i % 4 == 0 ? KVP_TIER_PUT_DURABLE : 0);
  ASSERT_EQ(kvp_tier_evict(t, &ns, ekey(0)), 1);
  ASSERT_EQ(kvp_tier_evict(t, &ns, ekey(47)), 1);
  ASSERT_EQ(c.epoch, e1);
  expect_same(t, &c, 3);
  uint8_t nvme[EB], st[EB];
  size_t n_nvme = 0;
  for (size_t i = 0; i < EB; i++) {
    nvme[i] = c.held[i] & (1u << KVP_TIER_NVME);
    n_nvme += nvme[i] != 0;
  }
  ASSERT_GT(n_nvme, 10u);
  ASSERT_OK(kvp_tier_sync(t));
  kvp_tier_destroy(t);
  uint64_t life1_seq = c.seq;
  /* life 2 on the same files; the restarted connector misses its start */
  c.attached = false;
  t = conn_store(dir, be, &c);
  uint64_t e2 = kvp_tier_epoch(t);
  ASSERT_GT(e2, e1);
  kvp_tier_stats ts;
  ASSERT_OK(kvp_tier_stats_get(t, &ts));
  ASSERT_EQ(ts.recovered_slots, (uint64_t)n_nvme);
  ASSERT_EQ(c.epoch, e2); /* recovery's events: 1 .. n_nvme */
  ASSERT_EQ(c.seq, (uint64_t)n_nvme);
  uint64_t seq;
  store_keys(t, st, &seq); /* exactly what was on NVMe */
  ASSERT_MEM_EQ(st, nvme, EB);
  ASSERT_EQ(seq, (uint64_t)n_nvme);
  expect_same(t, &c, 1); /* ix[0]: life 1's DRAM went with its epoch */
  kvp_index_stats is;
  ASSERT_OK(kvp_index_stats_get(c.ix[0], &is));
  ASSERT_EQ(is.epochs, 1u);
  ASSERT_GT(is.epoch_drops, 0u);
  ASSERT_EQ(is.events_stale, 0u);
  /* ix[1] rebuilds from the listing, then follows the events */
  ASSERT_EQ(resync_from(t, c.ix[1]), (int)n_nvme);
  c.attached = true;
  expect_same(t, &c, 2);
  /* life 2 goes on: recovered blocks read back (promoted to DRAM), new
   * blocks put, one evicted */
  ASSERT_OK(kvp_tier_ns_add(t, &ns, NULL));
  for (size_t i = 0; i < 8; i++)
    if (nvme[i])
      ASSERT_EQ(get_k(t, &ns, ekey(i), EBYTES), KVP_TIER_NVME);
  for (size_t i = 48; i < 56; i++)
    put_e(t, &ns, i, 0);
  ASSERT_EQ(kvp_tier_evict(t, &ns, ekey(4)), 1);
  ASSERT_LT(c.seq, life1_seq); /* life 2's numbers are all "old" ones */
  expect_same(t, &c, 2);
  kvp_index_worker_info wi;
  ASSERT_OK(kvp_index_worker_get(c.ix[1], 0, &wi));
  ASSERT_EQ(wi.uncertain, 0); /* the snapshot's seq + 1 came next */
  /* the end-to-end case: a block put after the restart is found */
  ASSERT_EQ(found_in(c.ix[0], 50), KVP_TIER_DRAM);
  ASSERT_EQ(found_in(c.ix[1], 50), KVP_TIER_DRAM);
  ASSERT_EQ(found_in(c.ix[0], 4), -1);
  /* without epochs, every event of life 2 was stale: found nowhere */
  ASSERT_EQ(found_in(c.ix[2], 50), -1);
  ASSERT_EQ(c.legacy_stale, c.seq);
  kvp_tier_destroy(t);
  for (int k = 0; k < 3; k++)
    kvp_index_destroy(c.ix[k]);
  tt_rmdir(dir);
}
ON_BACKENDS(epoch_restart)

/* Epochs are creation times, increasing within the process too, and every
 * event carries its store's. */
static uint64_t seen_epoch;
static void note_epoch(void *opaque, const kvp_tier_event *ev) {
  (void)opaque;
  ASSERT_EQ(ev->epoch, seen_epoch);
}

static int stop_walk(void *opaque, const kvp_tier_resident *r) {
  (void)r;
  return ++*(int *)opaque == 2 ? 5 : 0;
}

TEST(epoch_and_keys_each) {
  ASSERT_EQ(kvp_tier_epoch(NULL), 0u);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t now = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
  kvp_tier_opts o = {.dram_bytes = 4 * MB, .on_event = note_epoch};
  kvp_tier_store *t[4];
  for (int i = 0; i < 4; i++) {
    ASSERT_OK(kvp_tier_create(&o, NULL, &t[i]));
    if (i > 0) /* created within the same nanosecond or not */
      ASSERT_GT(kvp_tier_epoch(t[i]), kvp_tier_epoch(t[i - 1]));
  }
  ASSERT_GE(kvp_tier_epoch(t[0]), now);
  ASSERT_LT(kvp_tier_epoch(t[0]) - now, 60ull * 1000000000u);
  kvp_namespace ns = tt_ns("a", 16);
  ASSERT_OK(kvp_tier_ns_add(t[2], &ns, NULL));
  seen_epoch = kvp_tier_epoch(t[2]);
  for (size_t i = 0; i < 3; i++)
    put_k(t[2], &ns, ekey(i), 1000, 0, 0);
  uint64_t seq = 99;
  int calls = 0;
  ASSERT_EQ(kvp_tier_keys_each(t[2], stop_walk, &calls, &seq), 5);
  ASSERT_EQ(calls, 2);
  ASSERT_EQ(seq, 3u);
  ASSERT_ERR(kvp_tier_keys_each(NULL, stop_walk, &calls, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_tier_keys_each(t[2], NULL, NULL, NULL), KVP_EINVAL);
  ASSERT_OK(kvp_tier_keys_each(t[1], stop_walk, &calls, &seq)); /* empty */
  ASSERT_EQ(seq, 0u);
  for (int i = 0; i < 4; i++)
    kvp_tier_destroy(t[i]);
}

TEST_MAIN(TEST_ENTRY(dram_basic), TEST_ENTRY(dram_size_classes),
          TEST_ENTRY(dram_register_hook),
          TEST_ENTRY(dram_default_capacity),
          TEST_ENTRY(fingerprint_collision), TEST_ENTRY(nvme_demote_promote_all),
          TEST_ENTRY(nvme_recovery_all), TEST_ENTRY(nvme_corruption_all),
          TEST_ENTRY(nvme_payload_only_all), TEST_ENTRY(nvme_registered_all),
          TEST_ENTRY(nvme_encryption_all), TEST_ENTRY(nvme_faults_all),
          TEST_ENTRY(nvme_capacity_all), TEST_ENTRY(nvme_async_all),
          TEST_ENTRY(nvme_idle_all), TEST_ENTRY(nvme_admission_all),
          TEST_ENTRY(nvme_stage_ahead_all),
          TEST_ENTRY(tmpfs_warned_or_refused), TEST_ENTRY(slab_path_named),
          TEST_ENTRY(policy_lru), TEST_ENTRY(policy_lru_peek), TEST_ENTRY(policy_scan_resistance),
          TEST_ENTRY(policy_reserve), TEST_ENTRY(policy_share),
          TEST_ENTRY(options), TEST_ENTRY(events_feed_index),
          TEST_ENTRY(epoch_restart_all), TEST_ENTRY(epoch_and_keys_each))
