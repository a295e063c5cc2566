/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier <-> kernels: the DRAM region registered with a kvp_device, and the
 * worker's save and load path between an engine's paged KV cache and the
 * store.  When the region is registered with the link's device and the
 * namespace has fixed-size slots of the layout's block size at block-size
 * multiples of the region, a save gathers straight into reserved DRAM slots
 * (reserve -> gather -> commit; kvtier_internal.h) and a load scatters DRAM
 * hits straight out of their slots, pinned, with the store lock released.
 * Otherwise a save goes gather -> staging -> put, and a load's other blocks
 * (NVMe reads, other slots) get -> staging -> scatter. */
#include <inttypes.h>
#include <string.h>

#include <sys/mman.h>

#include "core_internal.h"
#include "kernels_internal.h"
#include "kvtier_internal.h"

/* ---- DRAM region registration ----------------------------------------------*/
static int dev_register(void *opaque, void *base, size_t len) {
  int rc = kvp_device_host_register(opaque, base, len);
  if (rc < 0)
    KVP_LOGE("kvtier", "registering the DRAM region (%zu bytes) with the %s "
             "device: %s", len, kvp_backend_name(kvp_device_backend(opaque)),
             kvp_strerror(rc));
  return rc;
}

static void dev_unregister(void *opaque, void *base, size_t len) {
  (void)len;
  int rc = kvp_device_host_unregister(opaque, base);
  if (rc < 0)
    KVP_LOGW("kvtier", "unregistering the DRAM region: %s", kvp_strerror(rc));
}

int kvp_tier_opts_set_device(kvp_tier_opts *o, kvp_device *dev) {
  if (o == NULL || dev == NULL || o->dram_register != NULL ||
      o->dram_unregister != NULL)
    return KVP_EINVAL;
  o->dram_register = dev_register;
  o->dram_unregister = dev_unregister;
  o->register_opaque = dev;
  return 0;
}

/* ---- the link ------------------------------------------------------------- */
struct kvp_tier_link {
  kvp_allocator a;
  pthread_mutex_t mu; /* serialises calls: the staging buffer and arrays */
  kvp_tier_store *t;
  kvp_device *dev;
  const kvp_kv_layout *lay;
  kvp_namespace ns;
  uint64_t bb;        /* block bytes */
  uint32_t nstage;    /* blocks per round */
  uint32_t nblocks;   /* the layout's num_blocks */
  uint8_t *stage;     /* mmap'ed, registered with dev */
  size_t stage_len;
  /* per round, nstage entries each */
  void **ptr;
  size_t *len, *cap;
  uint32_t *ids, *slots; /* two rounds' sets (direct saves use both) */
  uint32_t *pins;     /* load: the pinned entries' ids */
  tier_resv *resv;    /* save: the reserved slots (two rounds' sets) */
  int *res;
  uint64_t *seen;     /* load: repeat check over block ids, a bit per block */
  /* zero-copy loads (and saves: direct_save): the store's DRAM region,
   * registered with dev */
  bool direct, direct_save;
  uint8_t *dram_base;
  size_t dram_len;
  uint32_t *gi;       /* per round: entries that take the staged path */
  kvp_key *gkeys;
  uint32_t *gids;
  int *gres;
  kvp_event *ev[2];   /* direct saves: each in-flight round's gather done */
  kvp_tier_link_stats st;
};

static size_t words(uint32_t nblocks) { return ((size_t)nblocks + 63) / 64; }

static void link_free(kvp_tier_link *l) {
  size_t n = l->nstage;
  if (l->stage != NULL) {
    if (l->dev != NULL)
      kvp_device_host_unregister(l->dev, l->stage);
    munmap(l->stage, l->stage_len);
  }
  kvp__free(&l->a, l->ptr, n * sizeof *l->ptr);
  kvp__free(&l->a, l->len, n * sizeof *l->len);
  kvp__free(&l->a, l->cap, n * sizeof *l->cap);
  kvp__free(&l->a, l->ids, 2 * n * sizeof *l->ids);
  kvp__free(&l->a, l->slots, 2 * n * sizeof *l->slots);
  kvp__free(&l->a, l->res, n * sizeof *l->res);
  kvp__free(&l->a, l->pins, n * sizeof *l->pins);
  kvp__free(&l->a, l->resv, 2 * n * sizeof *l->resv);
  for (int i = 0; i < 2; i++)
    kvp_event_destroy(l->ev[i]);
  kvp__free(&l->a, l->gi, n * sizeof *l->gi);
  kvp__free(&l->a, l->gkeys, n * sizeof *l->gkeys);
  kvp__free(&l->a, l->gids, n * sizeof *l->gids);
  kvp__free(&l->a, l->gres, n * sizeof *l->gres);
  kvp__free(&l->a, l->seen, words(l->nblocks) * sizeof *l->seen);
  pthread_mutex_destroy(&l->mu);
  kvp_allocator a = l->a;
  kvp__free(&a, l, sizeof *l);
}

/* The namespace is registered and the block fits the store. */
static int check_store(kvp_tier_store *t, const kvp_namespace *ns,
                       uint64_t bb) {
  pthread_mutex_lock(&t->mu);
  bool known = kvp__tier_ns_find(t, ns->seed) != NULL;
  uint64_t max = t->o.max_block_bytes ? t->o.max_block_bytes : 4u << 20;
  bool fits = bb <= t->dram_region && (t->nv == NULL || bb <= max);
  pthread_mutex_unlock(&t->mu);
  if (!known) {
    KVP_LOGE("kvtier", "link: namespace not registered (kvp_tier_ns_add)");
    return KVP_ENOENT;
  }
  if (!fits) {
    KVP_LOGE("kvtier", "link: a block of %" PRIu64 " bytes is larger than the "
             "DRAM region or max_block_bytes", bb);
    return KVP_ERANGE;
  }
  return 0;
}

static int link_alloc(kvp_tier_link *l) {
  size_t n = l->nstage;
  l->ptr = kvp__calloc(&l->a, n, sizeof *l->ptr);
  l->len = kvp__calloc(&l->a, n, sizeof *l->len);
  l->cap = kvp__calloc(&l->a, n, sizeof *l->cap);
  l->ids = kvp__calloc(&l->a, 2 * n, sizeof *l->ids);
  l->slots = kvp__calloc(&l->a, 2 * n, sizeof *l->slots);
  l->res = kvp__calloc(&l->a, n, sizeof *l->res);
  l->pins = kvp__calloc(&l->a, n, sizeof *l->pins);
  l->resv = kvp__calloc(&l->a, 2 * n, sizeof *l->resv);
  l->seen = kvp__calloc(&l->a, words(l->nblocks), sizeof *l->seen);
  l->gi = kvp__calloc(&l->a, n, sizeof *l->gi);
  l->gkeys = kvp__calloc(&l->a, n, sizeof *l->gkeys);
  l->gids = kvp__calloc(&l->a, n, sizeof *l->gids);
  l->gres = kvp__calloc(&l->a, n, sizeof *l->gres);
  if (!l->ptr || !l->len || !l->cap || !l->ids || !l->slots || !l->res ||
      !l->pins || !l->resv || !l->seen || !l->gi || !l->gkeys || !l->gids || !l->gres)
    return KVP_ENOMEM;
  l->stage_len = (size_t)l->nstage * l->bb;
  void *p = mmap(NULL, l->stage_len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return KVP_ENOMEM;
  l->stage = p;
  for (size_t i = 0; i < n; i++) {
    l->ptr[i] = l->stage + i * l->bb;
    l->cap[i] = l->bb;
  }
  int rc = kvp_device_host_register(l->dev, l->stage, l->stage_len);
  if (rc < 0) {
    KVP_LOGE("kvtier", "link: registering %zu bytes of staging: %s",
             l->stage_len, kvp_strerror(rc));
    munmap(l->stage, l->stage_len);
    l->stage = NULL;
  }
  return rc;
}

/* The store registered its DRAM region with this very device
 * (kvp_tier_opts_set_device): scatters may read the slots in place; and
 * when the namespace's fixed-size slots are the layout's blocks, at
 * block-size multiples of the region (the block size divides the region's
 * 2 MiB chunks and is a multiple of the slots' 64-byte stride), gathers may
 * write them in place. */
static void link_direct(kvp_tier_link *l) {
  kvp_tier_store *t = l->t;
  pthread_mutex_lock(&t->mu);
  l->direct = t->registered && t->o.dram_register == dev_register &&
              t->o.register_opaque == l->dev;
  const tier_ns *ns = kvp__tier_ns_find(t, l->ns.seed);
  l->direct_save = l->direct && ns != NULL && ns->block_bytes == l->bb &&
                   l->bb % 64 == 0 && (UINT64_C(2) << 20) % l->bb == 0;
  pthread_mutex_unlock(&t->mu);
  void *base;
  if (l->direct && kvp_tier_dram_region(t, &base, &l->dram_len) == 0)
    l->dram_base = base;
  else
    l->direct = l->direct_save = false;
}

int kvp_tier_link_create(kvp_tier_store *t, kvp_device *dev,
                         const kvp_kv_layout *layout, const kvp_namespace *ns,
                         const kvp_tier_link_opts *o, const kvp_allocator *alloc,
                         kvp_tier_link **out) {
  kvp_kv_layout_info info;
  if (t == NULL || dev == NULL || layout == NULL || ns == NULL || out == NULL ||
      layout->dev != dev || kvp_kv_layout_info_get(layout, &info) < 0)
    return KVP_EINVAL;
  if (o != NULL)
    for (size_t i = 0; i < sizeof o->reserved / sizeof o->reserved[0]; i++)
      if (o->reserved[i] != 0)
        return KVP_EINVAL;
  int rc = check_store(t, ns, info.block_bytes);
  if (rc < 0)
    return rc;
  uint64_t n = o != NULL ? o->staging_blocks : 0;
  if (n == 0) { /* GPUs: few large launches; CPU: staging that stays in L2 */
    uint64_t cap = kvp_device_backend(dev) == KVP_BACKEND_CPU ? UINT64_C(1) << 20
                                                              : UINT64_C(64) << 20;
    n = cap / info.block_bytes;
    n = n > 256 ? 256 : n < 1 ? 1 : n;
  }
  if (n * info.block_bytes > SIZE_MAX / 2)
    return KVP_ERANGE;
  kvp_tier_link *l = kvp__calloc(alloc, 1, sizeof *l);
  if (l == NULL)
    return KVP_ENOMEM;
  l->a = kvp__allocator(alloc);
  pthread_mutex_init(&l->mu, NULL);
  l->t = t, l->dev = dev, l->lay = layout, l->ns = *ns;
  l->bb = info.block_bytes;
  l->nstage = (uint32_t)n;
  l->nblocks = info.num_blocks;
  if ((rc = link_alloc(l)) < 0) {
    link_free(l);
    return rc;
  }
  link_direct(l);
  /* without events a direct save runs its rounds one after the other */
  for (int i = 0; l->direct_save && i < 2; i++)
    if (kvp_event_create(dev, &l->ev[i]) < 0)
      l->ev[i] = NULL;
  *out = l;
  return 0;
}

void kvp_tier_link_destroy(kvp_tier_link *l) {
  if (l != NULL)
    link_free(l);
}

static int sync_stream(kvp_tier_link *l, kvp_stream *s) {
  return s != NULL ? kvp_stream_synchronize(s) : kvp_device_synchronize(l->dev);
}

static void fill(int *res, size_t n, int rc) {
  for (size_t i = 0; i < n; i++)
    res[i] = rc;
}

/* One round of a save through the staging buffer: ids/keys[0..m),
 * m <= nstage. */
static int save_staged(kvp_tier_link *l, kvp_stream *s, const kvp_key *keys,
                       const uint32_t *ids, uint32_t m,
                       const kvp_tier_put_opts *po, int *res) {
  kvp_xfer x = {.layout = l->lay, .block_ids = ids, .n = m,
                .method = KVP_XFER_AUTO, .staging = l->stage,
                .staging_bytes = l->stage_len};
  int rc = kvp_device_gather(l->dev, s, &x);
  if (rc >= 0)
    rc = sync_stream(l, s);
  if (rc < 0)
    return rc;
  l->st.gathers++;
  for (uint32_t i = 0; i < m; i++)
    l->len[i] = l->bb;
  return kvp_tier_put_batch(l->t, &l->ns, keys, m, (const void *const *)l->ptr,
                            l->len, po, res);
}

/* The region slot (block-size units) of a reserved block, or -1. */
static int64_t region_slot(const kvp_tier_link *l, const void *p) {
  uint64_t off = (uint64_t)((const uint8_t *)p - l->dram_base);
  if (off % l->bb != 0 || off / l->bb >= UINT32_MAX || off + l->bb > l->dram_len)
    return -1;
  return (int64_t)(off / l->bb);
}

/* A round of a direct save: keys/ids/res[0..m), its reservations, gather
 * targets and event in set `set` of two, so that the next round reserves
 * (under the store's lock) while this round's gather runs, and this round
 * commits while the next one's runs (docs/kvtier.md#saves). */
typedef struct save_rd {
  const kvp_key *keys;
  const uint32_t *ids;
  int *res;
  uint32_t m, h; /* blocks, of which gathered */
  unsigned set;
  bool ev;       /* its gather's end is recorded in l->ev[set] */
} save_rd;

static tier_resv *rd_resv(const kvp_tier_link *l, const save_rd *r) {
  return l->resv + (size_t)r->set * l->nstage;
}

/* The reserved blocks of r as gather targets (its set of l->ids/l->slots);
 * false when a slot is not at a block-size multiple (never, by link_direct's
 * conditions: then the round is staged). */
static bool save_targets(kvp_tier_link *l, save_rd *r) {
  const tier_resv *rv = rd_resv(l, r);
  uint32_t *ti = l->ids + (size_t)r->set * l->nstage;
  uint32_t *ts = l->slots + (size_t)r->set * l->nstage;
  r->h = 0;
  for (uint32_t i = 0; i < r->m; i++) {
    if (r->res[i] != 0)
      continue;
    int64_t slot = region_slot(l, rv[i].p);
    if (slot < 0)
      return false;
    ti[r->h] = r->ids[i];
    ts[r->h++] = (uint32_t)slot;
  }
  return true;
}

/* Reserves r's slots (the keys already stored need no gather) and submits
 * its gather into them.  0 submitted (or nothing to gather); 1 a slot not
 * at a block multiple: nothing reserved, stage the round; < 0 failed,
 * nothing reserved. */
static int round_begin(kvp_tier_link *l, kvp_stream *s, save_rd *r,
                       const kvp_tier_put_opts *po) {
  kvp_tier_store *t = l->t;
  tier_resv *rv = rd_resv(l, r);
  pthread_mutex_lock(&t->mu);
  kvp__tier_reserve(t, l->ns.seed, r->keys, r->m, l->bb, po, rv, r->res);
  bool ok = save_targets(l, r);
  if (!ok)
    kvp__tier_cancel(t, rv, r->res, r->m);
  pthread_mutex_unlock(&t->mu);
  if (!ok)
    return 1;
  kvp_xfer x = {.layout = l->lay,
                .block_ids = l->ids + (size_t)r->set * l->nstage,
                .n = r->h, .method = KVP_XFER_AUTO, .staging = l->dram_base,
                .staging_bytes = l->dram_len,
                .staging_slots = l->slots + (size_t)r->set * l->nstage};
  int rc = r->h == 0 ? 0 : kvp_device_gather(l->dev, s, &x);
  r->ev = rc >= 0 && r->h > 0 && l->ev[r->set] != NULL &&
          kvp_event_record(l->ev[r->set], s) == 0;
  if (rc < 0) { /* nothing was submitted */
    pthread_mutex_lock(&t->mu);
    kvp__tier_cancel(t, rv, r->res, r->m);
    pthread_mutex_unlock(&t->mu);
  }
  return rc < 0 ? rc : 0;
}

/* Waits for r's gather, then commits it -- or cancels on a failed gather:
 * the reservations go back and nothing stored before is touched.  The
 * blocks stored, or the error. */
static int round_end(kvp_tier_link *l, kvp_stream *s, save_rd *r,
                     const kvp_tier_put_opts *po) {
  kvp_tier_store *t = l->t;
  int rc = 0;
  if (r->h > 0)
    rc = r->ev ? kvp_event_synchronize(l->ev[r->set]) : sync_stream(l, s);
  pthread_mutex_lock(&t->mu);
  if (rc < 0)
    kvp__tier_cancel(t, rd_resv(l, r), r->res, r->m);
  else
    kvp__tier_commit(t, l->ns.seed, r->keys, r->m, l->bb, po, rd_resv(l, r),
                     r->res);
  pthread_mutex_unlock(&t->mu);
  if (rc < 0)
    return rc;
  l->st.gathers += r->h > 0;
  l->st.blocks_saved_direct += r->h;
  int done = 0;
  for (uint32_t i = 0; i < r->m; i++)
    done += r->res[i] > 0;
  return done;
}

/* Two rounds in flight only where the DRAM budget holds them with room to
 * spare (reserved slots cannot be evicted to make room for the next). */
static bool save_pipelined(kvp_tier_link *l) {
  if (l->ev[0] == NULL || l->ev[1] == NULL)
    return false;
  pthread_mutex_lock(&l->t->mu);
  bool room = l->t->dram_cap / 4 >= (uint64_t)l->nstage * l->bb;
  pthread_mutex_unlock(&l->t->mu);
  return room;
}

/* Counts a finished round into *done (its blocks) or *err (the first
 * error; the round's results are set). */
static void round_done(kvp_tier_link *l, save_rd *r, int rc, int *done,
                       int *err) {
  if (rc < 0) {
    fill(r->res, r->m, rc);
    if (*err == 0)
      *err = rc;
    return;
  }
  l->st.blocks_saved += (uint64_t)rc;
  l->st.blocks_save_failed += r->m - (uint64_t)rc;
  *done += rc;
}

/* A save straight into DRAM, round by round; with two rounds in flight
 * (save_pipelined) round k+1 is reserved and submitted before round k is
 * waited for and committed.  A key twice in one call: the later round may
 * gather it too, and its commit is then the duplicate (commit_one). */
static int save_direct(kvp_tier_link *l, kvp_stream *s, const kvp_key *keys,
                       const uint32_t *ids, size_t n,
                       const kvp_tier_put_opts *po, int *results) {
  const bool pipe = save_pipelined(l);
  save_rd rd[2];
  save_rd *live = NULL; /* the round whose gather is in flight */
  int done = 0, err = 0;
  size_t off = 0;
  for (unsigned k = 0; off < n && err == 0; off += l->nstage, k++) {
    save_rd *r = &rd[k & 1];
    *r = (save_rd){.keys = keys + off, .ids = ids + off, .res = results + off,
                   .m = n - off < l->nstage ? (uint32_t)(n - off) : l->nstage,
                   .set = pipe ? (k & 1) : 0};
    if (!pipe && live != NULL) {
      round_done(l, live, round_end(l, s, live, po), &done, &err);
      live = NULL;
      if (err < 0)
        break;
    }
    int rc = round_begin(l, s, r, po);
    l->st.rounds_overlapped += rc == 0 && live != NULL;
    if (live != NULL) { /* the previous round, while this one's gather runs */
      round_done(l, live, round_end(l, s, live, po), &done, &err);
      live = NULL;
    }
    if (rc == 0) {
      live = r;
      continue;
    }
    if (rc == 1) /* staged: nothing of this round is reserved */
      rc = err == 0 ? save_staged(l, s, r->keys, r->ids, r->m, po, r->res)
                    : err;
    round_done(l, r, rc, &done, &err);
  }
  if (live != NULL)
    round_done(l, live, round_end(l, s, live, po), &done, &err);
  if (err < 0) {
    fill(results + off, n - off, err);
    return err;
  }
  return done;
}

/* Every id of a save in range: checked before any slot is reserved (a
 * reservation may evict), as the gather would fail on it anyway. */
static int save_ids_ok(const kvp_tier_link *l, const uint32_t *ids, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (ids[i] >= l->nblocks) {
      KVP_LOGW("kvtier", "save: block id %" PRIu32 " out of range", ids[i]);
      return KVP_EINVAL;
    }
  return 0;
}

int kvp_tier_save(kvp_tier_link *l, kvp_stream *s, const kvp_key *keys,
                  const uint32_t *block_ids, size_t n,
                  const kvp_tier_put_opts *po, int *results) {
  if (l == NULL || (n > 0 && (keys == NULL || block_ids == NULL ||
                              results == NULL)) || n > INT32_MAX)
    return KVP_EINVAL;
  pthread_mutex_lock(&l->mu);
  l->st.saves++;
  int done = save_ids_ok(l, block_ids, n);
  if (done < 0)
    fill(results, n, done);
  else if (l->direct_save)
    done = save_direct(l, s, keys, block_ids, n, po, results);
  for (size_t off = 0; !l->direct_save && done >= 0 && off < n;
       off += l->nstage) {
    uint32_t m = n - off < l->nstage ? (uint32_t)(n - off) : l->nstage;
    int rc = save_staged(l, s, keys + off, block_ids + off, m, po,
                         results + off);
    if (rc < 0) {
      fill(results + off, n - off, rc);
      done = rc;
      break;
    }
    l->st.blocks_saved += (uint64_t)rc;
    l->st.blocks_save_failed += m - (uint64_t)rc;
    done += rc;
  }
  pthread_mutex_unlock(&l->mu);
  return done;
}

/* Every id in range and no id twice (the scatter would race on it).  Checked
 * over the whole call before any block is read. */
static int check_ids(kvp_tier_link *l, const uint32_t *ids, size_t n) {
  int rc = 0;
  size_t i = 0;
  for (; i < n; i++) {
    uint32_t b = ids[i];
    if (b >= l->nblocks || (l->seen[b / 64] >> (b % 64)) & 1) {
      rc = KVP_EINVAL;
      KVP_LOGW("kvtier", "load: block id %" PRIu32 " %s", b,
               b >= l->nblocks ? "out of range" : "given twice");
      break;
    }
    l->seen[b / 64] |= UINT64_C(1) << (b % 64);
  }
  for (size_t j = 0; j < i; j++) /* clear what was set */
    l->seen[ids[j] / 64] &= ~(UINT64_C(1) << (ids[j] % 64));
  return rc;
}

/* Scatters staging slots l->slots[0..h) into the engine's blocks
 * l->ids[0..h) and waits for it.  The ids are distinct (check_ids ran over
 * the whole call), so the device may skip its own repeat check. */
static int scatter_sync(kvp_tier_link *l, kvp_stream *s, uint32_t h,
                        void *staging, uint64_t staging_bytes) {
  kvp_xfer x = {.layout = l->lay, .block_ids = l->ids, .n = h,
                .method = KVP_XFER_AUTO, .staging = staging,
                .staging_bytes = staging_bytes, .staging_slots = l->slots,
                .flags = KVP_XFER_IDS_UNIQUE};
  int rc = kvp_device_scatter(l->dev, s, &x);
  return rc < 0 ? rc : sync_stream(l, s);
}

/* A DRAM hit that can be scattered in place: its slot index in the region
 * (block-size units), or -1 (not in DRAM, another length, a slot not at a
 * multiple of the block size).  Counts the hit as a get does, and pins the
 * slot (*id: the entry).  t->mu held, kvp__tier_pin_room done. */
static int64_t dram_pin_locked(kvp_tier_link *l, kvp_key key, uint32_t *id) {
  kvp_tier_store *t = l->t;
  *id = kvp__tier_table_find(&t->tbl, l->ns.seed, key);
  if (*id == TIER_NIL)
    return -1;
  tier_entry *e = &t->tbl.ents[*id];
  if (e->dram == NULL || e->len != l->bb)
    return -1;
  int64_t slot = region_slot(l, e->dram);
  if (slot < 0)
    return -1;
  e->hits++;
  kvp__tier_policy_touch(kvp__tier_cascade_policy(t->cas, KVP_TIER_DRAM), *id);
  t->st.hits[KVP_TIER_DRAM]++;
  kvp__tier_pin(t, *id);
  return slot;
}

/* Pins the DRAM hits of keys[0..m) (their scatter targets to l->ids/l->slots,
 * entries to l->pins[0..h)); the others' indices go to l->gi[0..*g).
 * Returns with the store's lock held when *hold (KVP_TIER_OPT_LOAD_UNLOCKED
 * 0: the scatter runs under it, as before pins). */
static uint32_t pin_hits(kvp_tier_link *l, const kvp_key *keys,
                         const uint32_t *ids, uint32_t m, int *res,
                         uint32_t *g, bool *hold) {
  kvp_tier_store *t = l->t;
  uint32_t h = 0;
  pthread_mutex_lock(&t->mu);
  *hold = t->scatter_locked;
  bool room = kvp__tier_pin_room(t, m);
  for (uint32_t i = 0; i < m; i++) {
    int64_t slot = room ? dram_pin_locked(l, keys[i], &l->pins[h]) : -1;
    if (slot < 0) {
      l->gi[(*g)++] = i;
      continue;
    }
    res[i] = KVP_TIER_DRAM;
    l->ids[h] = ids[i];
    l->slots[h++] = (uint32_t)slot;
  }
  if (!*hold)
    pthread_mutex_unlock(&t->mu);
  return h;
}

/* Unpins l->pins[0..h) and releases the store's lock. */
static void unpin_hits(kvp_tier_link *l, uint32_t h, bool held) {
  kvp_tier_store *t = l->t;
  if (!held)
    pthread_mutex_lock(&t->mu);
  for (uint32_t j = 0; j < h; j++)
    kvp__tier_unpin(t, l->pins[j], l->dram_base + (size_t)l->slots[j] * l->bb);
  pthread_mutex_unlock(&t->mu);
}

/* The DRAM hits of keys[0..m) scattered straight from their slots, in one
 * scatter with the store's lock released: the slots are pinned (an entry
 * evicted meanwhile leaves its slot unreused until the unpin; blocks are
 * immutable, so the bytes read are the block's).  The stream is drained
 * first.  The other entries' indices go to l->gi[0..*g).  Returns the number
 * scattered or a negative code (then the hits' results hold it). */
static int load_direct(kvp_tier_link *l, kvp_stream *s, const kvp_key *keys,
                       const uint32_t *ids, uint32_t m, int *res,
                       uint32_t *g) {
  *g = 0;
  int rc = sync_stream(l, s);
  if (rc < 0) {
    for (uint32_t i = 0; i < m; i++)
      l->gi[(*g)++] = i; /* nothing was tried */
    return rc;
  }
  bool held;
  uint32_t h = pin_hits(l, keys, ids, m, res, g, &held);
  if (h > 0)
    rc = scatter_sync(l, s, h, l->dram_base, l->dram_len);
  if (h > 0 || held)
    unpin_hits(l, h, held);
  if (rc < 0) {
    for (uint32_t i = 0, j = 0; i < m; i++) /* the hits: not in gi */
      if (j < *g && l->gi[j] == i)
        j++;
      else
        res[i] = rc;
    return rc;
  }
  if (h > 0) {
    l->st.scatters++;
    l->st.blocks_loaded += h;
    l->st.blocks_direct += h;
  }
  return (int)h;
}

/* One round of a load through the staging buffer: the hits go to their
 * block ids in one scatter. */
static int load_staged(kvp_tier_link *l, kvp_stream *s, const kvp_key *keys,
                       const uint32_t *ids, uint32_t m, int *res) {
  int rc = kvp_tier_get_batch(l->t, &l->ns, keys, m, l->ptr, l->cap, l->len,
                              res);
  if (rc < 0) {
    fill(res, m, rc);
    return rc;
  }
  uint32_t h = 0;
  for (uint32_t i = 0; i < m; i++) {
    /* stored under this key with another size: never scatter it */
    if ((res[i] >= 0 && l->len[i] != l->bb) || res[i] == KVP_ERANGE) {
      res[i] = KVP_ECORRUPT;
      l->st.wrong_length++;
    }
    if (res[i] < 0) {
      l->st.blocks_missed++;
      continue;
    }
    l->ids[h] = ids[i];
    l->slots[h++] = i;
  }
  if (h == 0)
    return 0;
  rc = scatter_sync(l, s, h, l->stage, l->stage_len);
  if (rc < 0) {
    for (uint32_t j = 0; j < h; j++)
      res[l->slots[j]] = rc;
    return rc;
  }
  l->st.scatters++;
  l->st.blocks_loaded += h;
  return (int)h;
}

/* One round: DRAM hits in place where the link can, the rest staged. */
static int load_round(kvp_tier_link *l, kvp_stream *s, const kvp_key *keys,
                      const uint32_t *ids, uint32_t m, int *res) {
  if (!l->direct)
    return load_staged(l, s, keys, ids, m, res);
  uint32_t g = 0;
  int d = load_direct(l, s, keys, ids, m, res, &g);
  if (d < 0 || g == 0) {
    if (d < 0) /* the staged entries were not tried */
      for (uint32_t j = 0; j < g; j++)
        res[l->gi[j]] = d;
    return d;
  }
  for (uint32_t j = 0; j < g; j++) {
    l->gkeys[j] = keys[l->gi[j]];
    l->gids[j] = ids[l->gi[j]];
  }
  int rc = load_staged(l, s, l->gkeys, l->gids, g, l->gres);
  for (uint32_t j = 0; j < g; j++)
    res[l->gi[j]] = l->gres[j];
  return rc < 0 ? rc : d + rc;
}

int kvp_tier_load(kvp_tier_link *l, kvp_stream *s, const kvp_key *keys,
                  const uint32_t *block_ids, size_t n, int *results) {
  if (l == NULL || (n > 0 && (keys == NULL || block_ids == NULL ||
                              results == NULL)) || n > INT32_MAX)
    return KVP_EINVAL;
  pthread_mutex_lock(&l->mu);
  l->st.loads++;
  int done = check_ids(l, block_ids, n);
  if (done < 0)
    fill(results, n, done);
  for (size_t off = 0; done >= 0 && off < n; off += l->nstage) {
    uint32_t m = n - off < l->nstage ? (uint32_t)(n - off) : l->nstage;
    int rc = load_round(l, s, keys + off, block_ids + off, m, results + off);
    if (rc < 0) {
      if (off + m < n)
        fill(results + off + m, n - off - m, rc);
      done = rc;
      break;
    }
    done += rc;
  }
  pthread_mutex_unlock(&l->mu);
  return done;
}

int kvp_tier_link_stats_get(kvp_tier_link *l, kvp_tier_link_stats *out) {
  if (l == NULL || out == NULL)
    return KVP_EINVAL;
  pthread_mutex_lock(&l->mu);
  *out = l->st;
  pthread_mutex_unlock(&l->mu);
  return 0;
}
