/* SPDX-License-Identifier: Apache-2.0 */
/* Engine integration, end to end (kvtier + kernels): a random paged KV cache
 * in vLLM's layout (per layer K and V) on a kvp_device (KVP_TEST_BACKEND=
 * cpu|cuda|hip; 77 + the reason when absent), a prompt's blocks saved through
 * kvp_tier_save, forced to NVMe (demotion under DRAM pressure + idle
 * write-back, or durable puts), the store destroyed and re-created from its
 * slab files (real O_DIRECT files under the build tree, io_uring and
 * pread/pwrite), the cache poisoned with NaN, the blocks loaded into OTHER
 * block ids: byte-equal to what was saved, nothing else in the cache touched,
 * and a slot tampered on disk is a miss (its block left poisoned), never
 * wrong bytes. */
#include <dirent.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "tier_test_util.h"
#include "device_test_util.h"

#define KB 1024u
#define MB (1024u * 1024u)
#define POISON 0xff /* NaN in bf16 / fp16 / fp32 */
#define LAYERS 4
#define NT (2 * LAYERS) /* K and V per layer */
#define NBLOCKS 128
#define BS 16           /* tokens per block */

static kvp_device *g_dev;
static kvp_backend g_backend;

static void open_device(void) {
  if (g_dev)
    return;
  char why[256];
  g_backend = kvt_backend_from_env(why, sizeof why);
  kvp_device_opts o = {.backend = g_backend, .flags = KVP_DEVICE_NO_CALIBRATE};
  ASSERT_OK(kvp_device_create(&o, NULL, &g_dev));
  printf("# device %s: %s\n", kvp_backend_name(g_backend),
         kvp_device_name(g_dev));
}

/* ---- the engine's paged cache: vLLM NHD, [NBLOCKS, BS, heads, head_dim] per
 * layer for K and for V, bf16-sized elements ------------------------------- */
typedef struct cache {
  void *t[NT];              /* device tensors: K0 V0 K1 V1 ... */
  uint8_t *img[NT];         /* host copies */
  size_t stride, tbytes;    /* bytes per block in one tensor; per tensor */
  kvp_kv_layout *lay;
  uint64_t bb;              /* staged block bytes */
} cache;

static void cache_init(cache *c, uint32_t heads, uint32_t head_dim) {
  memset(c, 0, sizeof *c);
  c->stride = (size_t)BS * heads * head_dim * 2;
  c->tbytes = c->stride * NBLOCKS;
  void *k[LAYERS], *v[LAYERS];
  for (int i = 0; i < NT; i++) {
    ASSERT_OK(kvp_device_alloc(g_dev, c->tbytes, &c->t[i]));
    c->img[i] = malloc(c->tbytes);
    ASSERT_NOT_NULL(c->img[i]);
    for (size_t j = 0; j < c->tbytes; j += 8) {
      uint64_t r = kvt_rand();
      memcpy(c->img[i] + j, &r, 8);
    }
    ASSERT_OK(kvp_device_memcpy(g_dev, c->t[i], c->img[i], c->tbytes));
    if (i % 2 == 0)
      k[i / 2] = c->t[i];
    else
      v[i / 2] = c->t[i];
  }
  kvp_kv_layout_desc d = {.kind = KVP_LAYOUT_VLLM_NHD, .num_layers = LAYERS,
                          .num_blocks = NBLOCKS, .block_size = BS,
                          .num_kv_heads = heads, .head_dim = head_dim,
                          .elem_size = 2, .k_layers = k, .v_layers = v};
  ASSERT_OK(kvp_kv_layout_create(g_dev, &d, &c->lay));
  kvp_kv_layout_info info;
  ASSERT_OK(kvp_kv_layout_info_get(c->lay, &info));
  c->bb = info.block_bytes;
  ASSERT_EQ(c->bb, (uint64_t)NT * c->stride);
}

static void cache_free(cache *c) {
  kvp_kv_layout_destroy(c->lay);
  for (int i = 0; i < NT; i++) {
    kvp_device_free(g_dev, c->t[i]);
    free(c->img[i]);
  }
}

/* Blocks ids[0..n) of every tensor := POISON (device and host image). */
static void poison_blocks(cache *c, const uint32_t *ids, size_t n) {
  uint8_t *p = malloc(c->stride);
  ASSERT_NOT_NULL(p);
  memset(p, POISON, c->stride);
  for (int i = 0; i < NT; i++)
    for (size_t j = 0; j < n; j++) {
      memset(c->img[i] + ids[j] * c->stride, POISON, c->stride);
      ASSERT_OK(kvp_device_memcpy(g_dev, (uint8_t *)c->t[i] + ids[j] * c->stride,
                                  p, c->stride));
    }
  free(p);
}

static void poison_all(cache *c) {
  for (int i = 0; i < NT; i++) {
    memset(c->img[i], POISON, c->tbytes);
    ASSERT_OK(kvp_device_memcpy(g_dev, c->t[i], c->img[i], c->tbytes));
  }
}

/* The device's blocks ids[0..n) of every tensor equal the host image. */
static void check_blocks(const cache *c, const uint32_t *ids, size_t n) {
  uint8_t *p = malloc(c->stride);
  ASSERT_NOT_NULL(p);
  for (int i = 0; i < NT; i++)
    for (size_t j = 0; j < n; j++) {
      ASSERT_OK(kvp_device_memcpy(g_dev, p,
                                  (uint8_t *)c->t[i] + ids[j] * c->stride,
                                  c->stride));
      ASSERT_MEM_EQ(p, c->img[i] + ids[j] * c->stride, c->stride);
    }
  free(p);
}

/* Block `from` of the image copied to block `to` (what a load must do). */
static void img_move(cache *c, const uint8_t *const *saved, uint32_t from,
                     uint32_t to) {
  for (int i = 0; i < NT; i++)
    memcpy(c->img[i] + to * c->stride, saved[i] + from * c->stride, c->stride);
}

/* The staged bytes of one block, through the device (the tamper needle). */
static uint8_t *staged_block(cache *c, uint32_t id) {
  void *dstage;
  ASSERT_OK(kvp_device_alloc(g_dev, c->bb, &dstage));
  kvp_xfer x = {.layout = c->lay, .block_ids = &id, .n = 1,
                .staging = dstage, .staging_bytes = c->bb};
  ASSERT_OK(kvp_device_gather(g_dev, NULL, &x));
  ASSERT_OK(kvp_device_synchronize(g_dev));
  uint8_t *h = malloc(c->bb);
  ASSERT_NOT_NULL(h);
  ASSERT_OK(kvp_device_memcpy(g_dev, h, dstage, c->bb));
  kvp_device_free(g_dev, dstage);
  return h;
}

static void keys_for(const kvp_namespace *ns, uint32_t salt, kvp_key *keys,
                     size_t n) {
  uint32_t *tok = malloc(n * BS * sizeof *tok);
  ASSERT_NOT_NULL(tok);
  for (size_t i = 0; i < n * BS; i++)
    tok[i] = (uint32_t)(kvt_rand() % 128000) ^ salt;
  kvp_hasher *h;
  ASSERT_OK(kvp_hasher_create(ns, NULL, NULL, &h));
  ASSERT_EQ(kvp_hasher_hash(h, tok, n * BS, NULL, keys, n, NULL), (int)n);
  kvp_hasher_destroy(h);
  free(tok);
}

static void shuffle(uint32_t *a, size_t n) {
  for (size_t i = n; i > 1; i--) {
    size_t j = kvt_rand_below(i);
    uint32_t x = a[i - 1];
    a[i - 1] = a[j];
    a[j] = x;
  }
}

static kvp_namespace ns_for(uint32_t heads, uint32_t head_dim) {
  char layout[64];
  snprintf(layout, sizeof layout, "vllm-nhd:bf16:l%d:h%ux%u", LAYERS, heads,
           head_dim);
  kvp_namespace_desc d = {.model_id = "test/random-decoder",
                          .tokenizer_id = "t", .kv_layout = layout,
                          .block_size = BS};
  kvp_namespace ns;
  ASSERT_OK(kvp_namespace_init(&d, &ns));
  return ns;
}

/* Flips one byte of the slab file slot holding `needle` (the block's bytes:
 * searched as plaintext, so this does not depend on the slot format).
 * Returns how many slab files held it. */
static int tamper(const char *dir, const uint8_t *needle, size_t n) {
  DIR *d = opendir(dir);
  ASSERT_NOT_NULL(d);
  struct dirent *de;
  int found = 0;
  while ((de = readdir(d)) != NULL) {
    if (strncmp(de->d_name, "kvtier-", 7) != 0)
      continue;
    char f[512];
    snprintf(f, sizeof f, "%s/%s", dir, de->d_name);
    int fd = open(f, O_RDWR);
    ASSERT_GE(fd, 0);
    off_t sz = lseek(fd, 0, SEEK_END);
    uint8_t *img = malloc((size_t)sz + 1);
    ASSERT_NOT_NULL(img);
    ASSERT_EQ(pread(fd, img, (size_t)sz, 0), sz);
    /* 4 KiB from the middle of the block: random bytes, unique */
    const uint8_t *probe = needle + n / 2;
    uint8_t *hit = memmem(img, (size_t)sz, probe, 4096);
    if (hit != NULL) {
      ASSERT_NULL(memmem(hit + 1, (size_t)sz - (size_t)(hit + 1 - img), probe,
                         4096));
      uint8_t b = (uint8_t)(hit[100] ^ 0x20);
      ASSERT_EQ(pwrite(fd, &b, 1, hit + 100 - img), 1);
      ASSERT_OK(fsync(fd));
      found++;
    }
    free(img);
    close(fd);
  }
  closedir(d);
  return found;
}

/* ---- the reuse round trip ---------------------------------------------------- */
#define NPROMPT 40 /* blocks in the prompt */

typedef struct run {
  kvp_tier_io_backend io;
  bool durable; /* durable puts; else DRAM pressure + idle write-back */
} run;

/* A store whose DRAM tier holds `dram_blocks` blocks of bb bytes (the region
 * is at least 4 MiB; the capacity is set below it). */
static kvp_tier_store *store_open(kvp_tier_opts *o, const kvp_namespace *ns,
                                  uint64_t bb, uint32_t dram_blocks) {
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(o, NULL, &t));
  ASSERT_OK(kvp_tier_set(t, KVP_TIER_OPT_DRAM_BYTES,
                         (int64_t)(dram_blocks * bb)));
  ASSERT_OK(kvp_tier_ns_add(t, ns, &(kvp_tier_ns_opts){.block_bytes = bb}));
  /* the DRAM region is registered with the device: overlapping it fails */
  void *base;
  size_t len;
  ASSERT_OK(kvp_tier_dram_region(t, &base, &len));
  ASSERT_ERR(kvp_device_host_register(g_dev, (uint8_t *)base + len / 2, 4096),
             KVP_EEXIST);
  return t;
}

static void reuse_once(run r) {
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  if (!dir[0])
    KVT_SKIP_BECAUSE("no directory here takes O_DIRECT (tmpfs?)");
  uint32_t heads = 1u << (1 + kvt_rand_below(2));      /* 2 or 4 */
  uint32_t head_dim = kvt_rand_below(2) ? 128 : 64;
  cache c;
  cache_init(&c, heads, head_dim);
  kvp_namespace ns = ns_for(heads, head_dim);
  kvp_key keys[NPROMPT];
  keys_for(&ns, 0, keys, NPROMPT);
  uint32_t perm[NBLOCKS], *src = perm, *dst = perm + NPROMPT;
  for (uint32_t i = 0; i < NBLOCKS; i++)
    perm[i] = i;
  shuffle(perm, NBLOCKS);
  uint8_t *saved[NT]; /* the cache as it was saved */
  for (int i = 0; i < NT; i++) {
    saved[i] = malloc(c.tbytes);
    memcpy(saved[i], c.img[i], c.tbytes);
  }
  size_t victim = kvt_rand_below(NPROMPT);
  uint8_t *needle = staged_block(&c, src[victim]);
  printf("# %s, %s: %u heads x %u, block %" PRIu64 " KiB, tamper block %zu\n",
         tt_backend_name(r.io), r.durable ? "durable puts" : "DRAM pressure",
         heads, head_dim, c.bb / KB, victim);

  /* prompt bytes > DRAM: pressure demotes to NVMe */
  kvp_tier_opts o = {.dram_bytes = 4 * MB, .nvme_dir = dir,
                     .nvme_bytes = 64 * MB, .io_backend = r.io,
                     .queue_depth = 8};
  ASSERT_OK(kvp_tier_opts_set_device(&o, g_dev));
  ASSERT_ERR(kvp_tier_opts_set_device(&o, g_dev), KVP_EINVAL);
  kvp_tier_store *t = store_open(&o, &ns, c.bb, NPROMPT / 4);
  kvp_tier_link *l;
  ASSERT_OK(kvp_tier_link_create(t, g_dev, c.lay, &ns,
                                 &(kvp_tier_link_opts){.staging_blocks = 16},
                                 NULL, &l));
  int res[NPROMPT];
  kvp_tier_put_opts po = {.cls = KVP_CLASS_STABLE,
                          .flags = r.durable ? KVP_TIER_PUT_DURABLE : 0};
  ASSERT_EQ(kvp_tier_save(l, NULL, keys, src, NPROMPT, &po, res), NPROMPT);
  for (int i = 0; i < NPROMPT; i++)
    ASSERT_EQ(res[i], 1);
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  if (!r.durable) {
    ASSERT_GT(st.demotions, 0);           /* pressure wrote some ... */
    ASSERT_LT(st.nvme_blocks, NPROMPT);
    ASSERT_GT(kvp_tier_idle(t, UINT64_MAX), 0); /* ... idle the rest */
    ASSERT_OK(kvp_tier_sync(t));
    ASSERT_OK(kvp_tier_stats_get(t, &st));
  }
  ASSERT_EQ(st.nvme_blocks, NPROMPT);
  kvp_tier_link_stats ls;
  ASSERT_OK(kvp_tier_link_stats_get(l, &ls));
  ASSERT_EQ(ls.blocks_saved, NPROMPT);
  ASSERT_EQ(ls.gathers, 3); /* 16 + 16 + 8 */
  void *old_base;
  size_t old_len;
  ASSERT_OK(kvp_tier_dram_region(t, &old_base, &old_len));
  kvp_tier_link_destroy(l);
  kvp_tier_destroy(t);
  if (g_backend == KVP_BACKEND_CPU) { /* destroy unregistered the region */
    ASSERT_OK(kvp_device_host_register(g_dev, old_base, 4096));
    ASSERT_OK(kvp_device_host_unregister(g_dev, old_base));
  }

  /* the engine drops everything; one slot rots on disk */
  poison_all(&c);
  ASSERT_EQ(tamper(dir, needle, c.bb), 1);

  t = store_open(&o, &ns, c.bb, NPROMPT / 4);
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.recovered_slots, NPROMPT);
  ASSERT_EQ(st.dram_blocks, 0);
  ASSERT_OK(kvp_tier_link_create(t, g_dev, c.lay, &ns,
                                 &(kvp_tier_link_opts){.staging_blocks = 16},
                                 NULL, &l));
  ASSERT_EQ(kvp_tier_load(l, NULL, keys, dst, NPROMPT, res), NPROMPT - 1);
  for (size_t i = 0; i < NPROMPT; i++) {
    if (i == victim) {
      ASSERT_ERR(res[i], KVP_ENOENT); /* recompute; dst[i] stays poisoned */
      continue;
    }
    ASSERT_EQ(res[i], KVP_TIER_NVME);
    img_move(&c, (const uint8_t *const *)saved, src[i], dst[i]);
  }
  check_blocks(&c, perm, NBLOCKS); /* loaded blocks exact, all else NaN */
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_EQ(st.checksum_failures, 1);
  ASSERT_GT(st.promotions, 0);
  ASSERT_OK(kvp_tier_link_stats_get(l, &ls));
  ASSERT_EQ(ls.blocks_loaded, NPROMPT - 1);
  ASSERT_EQ(ls.blocks_missed, 1);

  /* again, into the saved-from ids: first the blocks promoted to DRAM (all
   * DRAM hits), then all of them (DRAM and NVMe) */
  poison_all(&c);
  kvp_key dk[NPROMPT];
  uint32_t did[NPROMPT], nd = 0;
  for (size_t i = 0; i < NPROMPT; i++)
    if (kvp_tier_contains(t, &ns, keys[i]) == KVP_TIER_DRAM)
      dk[nd] = keys[i], did[nd++] = src[i];
  ASSERT_GT(nd, 0);
  ASSERT_EQ(kvp_tier_load(l, NULL, dk, did, nd, res), (int)nd);
  for (size_t i = 0; i < nd; i++)
    ASSERT_EQ(res[i], KVP_TIER_DRAM);
  ASSERT_EQ(kvp_tier_load(l, NULL, keys, src, NPROMPT, res), NPROMPT - 1);
  for (size_t i = 0; i < NPROMPT; i++) {
    if (i == victim) {
      ASSERT_ERR(res[i], KVP_ENOENT); /* dropped: still a miss */
      continue;
    }
    ASSERT_GE(res[i], 0);
    img_move(&c, (const uint8_t *const *)saved, src[i], src[i]);
  }
  check_blocks(&c, perm, NBLOCKS);

  kvp_tier_link_destroy(l);
  kvp_tier_destroy(t);
  tt_rmdir(dir);
  free(needle);
  for (int i = 0; i < NT; i++)
    free(saved[i]);
  cache_free(&c);
}

TEST(reuse_nvme) {
  open_device();
  kvp_tier_io_backend bs[2];
  int nb = tt_backends(bs);
  for (int i = 0; i < nb; i++) {
    reuse_once((run){.io = bs[i], .durable = false});
    reuse_once((run){.io = bs[i], .durable = true});
  }
}

/* ---- API edges: bad arguments copy nothing -------------------------------------- */
TEST(link_api) {
  open_device();
  cache c;
  cache_init(&c, 2, 64);
  kvp_namespace ns = ns_for(2, 64), other = ns_for(2, 128);
  kvp_tier_opts o = {.dram_bytes = 8 * MB};
  ASSERT_ERR(kvp_tier_opts_set_device(NULL, g_dev), KVP_EINVAL);
  ASSERT_ERR(kvp_tier_opts_set_device(&o, NULL), KVP_EINVAL);
  ASSERT_OK(kvp_tier_opts_set_device(&o, g_dev));
  kvp_tier_store *t = store_open(&o, &ns, c.bb, 64);
  kvp_tier_link *l = NULL;
  ASSERT_ERR(kvp_tier_link_create(t, g_dev, c.lay, &other, NULL, NULL, &l),
             KVP_ENOENT);
  ASSERT_ERR(kvp_tier_link_create(t, NULL, c.lay, &ns, NULL, NULL, &l),
             KVP_EINVAL);
  kvp_tier_link_opts lo = {.staging_blocks = 4, .reserved = {1}};
  ASSERT_ERR(kvp_tier_link_create(t, g_dev, c.lay, &ns, &lo, NULL, &l),
             KVP_EINVAL);
  ASSERT_NULL(l);
  lo.reserved[0] = 0;
  ASSERT_OK(kvp_tier_link_create(t, g_dev, c.lay, &ns, &lo, NULL, &l));

  enum { N = 10 };
  kvp_key keys[N];
  keys_for(&ns, 1, keys, N);
  uint32_t src[N], dst[N];
  int res[N];
  for (uint32_t i = 0; i < N; i++)
    src[i] = i, dst[i] = 100 + i;
  uint32_t all[NBLOCKS];
  for (uint32_t i = 0; i < NBLOCKS; i++)
    all[i] = i;

  /* nothing saved yet: every load misses and nothing is written */
  ASSERT_EQ(kvp_tier_load(l, NULL, keys, dst, N, res), 0);
  for (int i = 0; i < N; i++)
    ASSERT_ERR(res[i], KVP_ENOENT);
  check_blocks(&c, all, NBLOCKS);

  /* a block id out of range: the round is refused, nothing stored */
  src[7] = NBLOCKS;
  ASSERT_LT(kvp_tier_save(l, NULL, keys, src, N, NULL, res), 0);
  ASSERT_LT(res[4], 0); /* the failing round: blocks 4..7 */
  src[7] = 7;
  ASSERT_EQ(kvp_tier_contains(t, &ns, keys[5]), KVP_ENOENT);
  ASSERT_EQ(kvp_tier_save(l, NULL, keys, src, N, NULL, res), N);
  ASSERT_EQ(kvp_tier_save(l, NULL, keys, src, N, NULL, res), N); /* dup */

  /* repeated or out-of-range target ids: refused before anything moves */
  dst[9] = dst[2];
  ASSERT_ERR(kvp_tier_load(l, NULL, keys, dst, N, res), KVP_EINVAL);
  ASSERT_ERR(res[0], KVP_EINVAL);
  dst[9] = NBLOCKS + 5;
  ASSERT_ERR(kvp_tier_load(l, NULL, keys, dst, N, res), KVP_EINVAL);
  check_blocks(&c, all, NBLOCKS);
  dst[9] = 109;

  /* a block of another size under one of the keys: a miss, not a scatter */
  ASSERT_EQ(kvp_tier_evict(t, &ns, keys[3]), 1);
  uint8_t small[100] = {0};
  ASSERT_EQ(kvp_tier_put(t, &ns, keys[3], small, sizeof small, NULL), 1);
  uint8_t *saved[NT];
  for (int i = 0; i < NT; i++) {
    saved[i] = malloc(c.tbytes);
    memcpy(saved[i], c.img[i], c.tbytes);
  }
  ASSERT_EQ(kvp_tier_load(l, NULL, keys, dst, N, res), N - 1);
  ASSERT_ERR(res[3], KVP_ECORRUPT);
  for (int i = 0; i < N; i++)
    if (i != 3)
      img_move(&c, (const uint8_t *const *)saved, src[i], dst[i]);
  check_blocks(&c, all, NBLOCKS);
  kvp_tier_link_stats ls;
  ASSERT_OK(kvp_tier_link_stats_get(l, &ls));
  ASSERT_EQ(ls.wrong_length, 1);
  ASSERT_EQ(ls.scatters, 3); /* rounds of 4: 4 + 4 + 2 blocks */
  /* the store's region is registered with this device: every hit came
   * straight out of its DRAM slot; the block of another size did not */
  ASSERT_EQ(ls.blocks_direct, N - 1);
  ASSERT_EQ(ls.blocks_loaded, N - 1);
  ASSERT_EQ(kvp_tier_load(l, NULL, keys, dst, 0, res), 0);

  kvp_tier_link_destroy(l);
  kvp_tier_link_destroy(NULL);
  kvp_tier_destroy(t);
  for (int i = 0; i < NT; i++)
    free(saved[i]);
  cache_free(&c);
}

/* A store whose DRAM region is not registered with the link's device: its
 * loads copy through the link's staging buffer (blocks_direct 0), and move
 * the same bytes. */
TEST(load_unregistered_store) {
  open_device();
  cache c;
  cache_init(&c, 2, 64);
  kvp_namespace ns = ns_for(2, 64);
  kvp_tier_opts o = {.dram_bytes = 8 * MB};
  kvp_tier_store *t;
  ASSERT_OK(kvp_tier_create(&o, NULL, &t));
  ASSERT_OK(kvp_tier_ns_add(t, &ns, &(kvp_tier_ns_opts){.block_bytes = c.bb}));
  kvp_tier_link *l;
  ASSERT_OK(kvp_tier_link_create(t, g_dev, c.lay, &ns,
                                 &(kvp_tier_link_opts){.staging_blocks = 4},
                                 NULL, &l));
  enum { N = 10 };
  kvp_key keys[N];
  keys_for(&ns, 2, keys, N);
  uint32_t perm[NBLOCKS], all[NBLOCKS];
  for (uint32_t i = 0; i < NBLOCKS; i++)
    perm[i] = all[i] = i;
  shuffle(perm, NBLOCKS);
  const uint32_t *src = perm, *dst = perm + N;
  int res[N];
  ASSERT_EQ(kvp_tier_save(l, NULL, keys, src, N, NULL, res), N);
  uint8_t *saved[NT];
  for (int i = 0; i < NT; i++) {
    saved[i] = malloc(c.tbytes);
    ASSERT_NOT_NULL(saved[i]);
    memcpy(saved[i], c.img[i], c.tbytes);
  }
  poison_blocks(&c, dst, N);
  ASSERT_EQ(kvp_tier_load(l, NULL, keys, dst, N, res), N);
  for (int i = 0; i < N; i++) {
    ASSERT_EQ(res[i], KVP_TIER_DRAM);
    img_move(&c, (const uint8_t *const *)saved, src[i], dst[i]);
  }
  check_blocks(&c, all, NBLOCKS);
  kvp_tier_link_stats ls;
  ASSERT_OK(kvp_tier_link_stats_get(l, &ls));
  ASSERT_EQ(ls.blocks_loaded, N);
  ASSERT_EQ(ls.blocks_direct, 0);
  kvp_tier_link_destroy(l);
  kvp_tier_destroy(t);
  for (int i = 0; i < NT; i++)
    free(saved[i]);
  cache_free(&c);
}

/* ---- several engine threads on one store and device (tsan) ---------------------- */
#define THREADS 3
#define TBLK 12 /* blocks per thread and prompt */

typedef struct worker {
  kvp_tier_store *t;
  cache *c;
  const kvp_namespace *ns;
  uint32_t k;
  uint64_t seed;
} worker;

static void *worker_main(void *arg) {
  worker *w = arg;
  kvp_tier_link *l;
  ASSERT_OK(kvp_tier_link_create(w->t, g_dev, w->c->lay, w->ns,
                                 &(kvp_tier_link_opts){.staging_blocks = 5},
                                 NULL, &l));
  /* thread k owns blocks [k * 40, k * 40 + 40): src, then two targets */
  uint32_t base = w->k * 40, src[TBLK], dst[TBLK];
  uint8_t *got = malloc(w->c->stride);
  ASSERT_NOT_NULL(got);
  for (int round = 0; round < 6; round++) {
    kvp_key keys[TBLK];
    for (uint32_t i = 0; i < TBLK; i++) {
      keys[i] = (kvp_key){w->seed ^ (uint64_t)round, w->k * 1000u + i};
      src[i] = base + i;
      dst[i] = base + TBLK + (i + (uint32_t)round) % TBLK + TBLK * (round & 1);
    }
    int res[TBLK];
    kvp_tier_put_opts po = {.cls = KVP_CLASS_SEMI};
    ASSERT_EQ(kvp_tier_save(l, NULL, keys, src, TBLK, &po, res), TBLK);
    poison_blocks(w->c, dst, TBLK);
    int n = kvp_tier_load(l, NULL, keys, dst, TBLK, res);
    ASSERT_GE(n, 0);
    for (uint32_t i = 0; i < TBLK; i++) {
      /* a miss (evicted by the others' pressure) leaves the poison */
      uint32_t from = res[i] < 0 ? dst[i] : src[i];
      for (int t = 0; t < NT; t++) {
        ASSERT_OK(kvp_device_memcpy(g_dev, got,
                                    (uint8_t *)w->c->t[t] + dst[i] * w->c->stride,
                                    w->c->stride));
        ASSERT_MEM_EQ(got, w->c->img[t] + from * w->c->stride, w->c->stride);
      }
    }
  }
  free(got);
  kvp_tier_link_destroy(l);
  return NULL;
}

TEST(threads) {
  open_device();
  char dir[256];
  tt_mkdir(dir, sizeof dir);
  if (!dir[0])
    KVT_SKIP_BECAUSE("no directory here takes O_DIRECT (tmpfs?)");
  cache c;
  cache_init(&c, 2, 64);
  kvp_namespace ns = ns_for(2, 64);
  kvp_tier_io_backend bs[2];
  tt_backends(bs);
  kvp_tier_opts o = {.dram_bytes = 4 * MB, .nvme_dir = dir,
                     .nvme_bytes = 64 * MB, .io_backend = bs[0],
                     .queue_depth = 8};
  ASSERT_OK(kvp_tier_opts_set_device(&o, g_dev));
  kvp_tier_store *t = store_open(&o, &ns, c.bb, TBLK);
  pthread_t th[THREADS];
  worker w[THREADS];
  for (uint32_t k = 0; k < THREADS; k++) {
    w[k] = (worker){.t = t, .c = &c, .ns = &ns, .k = k, .seed = kvt_rand()};
    ASSERT_EQ(pthread_create(&th[k], NULL, worker_main, &w[k]), 0);
  }
  for (int k = 0; k < THREADS; k++)
    ASSERT_EQ(pthread_join(th[k], NULL), 0);
  kvp_tier_stats st;
  ASSERT_OK(kvp_tier_stats_get(t, &st));
  ASSERT_GT(st.demotions, 0);
  ASSERT_EQ(st.checksum_failures + st.key_mismatch + st.io_errors, 0);
  kvp_tier_destroy(t);
  tt_rmdir(dir);
  cache_free(&c);
}

TEST_MAIN(TEST_ENTRY(reuse_nvme), TEST_ENTRY(link_api),
          TEST_ENTRY(load_unregistered_store), TEST_ENTRY(threads))
