/* SPDX-License-Identifier: Apache-2.0 */
/* The NVMe tier: log-structured slab files, one per payload size class
 * ("kvtier-<payload>.slab"), grown with fallocate, opened with O_DIRECT.
 * A slot = header sector + payload, written in ONE write from a staging
 * buffer (registered with io_uring when allowed).  A slot is reused only
 * after its previous block left the index, so a torn write can only damage
 * a block nobody may read any more; recovery verifies the headers, and the
 * index keeps each block's payload checksum: a plaintext read moves only
 * the payload and checks it against that (an encrypted one reads header +
 * payload: IV and tag).  What fails is a miss and dropped.  All calls run
 * under the store's lock, except the I/O and checks of reads: they run on
 * a ring of their own with the lock released, on pinned slots. */
#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "core_internal.h"
#include "kvtier_internal.h"

#define GROW_BYTES (UINT64_C(64) << 20)

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/* ---- slab classes ---------------------------------------------------------*/
static int class_open(kvp_tier_store *t, uint64_t cap, bool create,
                      int32_t *out) {
  for (uint32_t i = 0; i < t->ncls; i++)
    if (t->cls[i].cap == cap) {
      *out = (int32_t)i;
      return 0;
    }
  char name[64];
  snprintf(name, sizeof name, "kvtier-%" PRIu64 ".slab", cap);
  int fd = openat(t->dirfd, name,
                  O_RDWR | O_DIRECT | O_CLOEXEC | (create ? O_CREAT : 0), 0600);
  if (fd < 0)
    return -errno;
  if (create)
    fsync(t->dirfd); /* the new file's name survives a crash */
  tier_nclass *n = kvp__realloc(&t->a, t->cls, t->ncls * sizeof *n,
                                (t->ncls + 1) * sizeof *n);
  if (n == NULL) {
    close(fd);
    return KVP_ENOMEM;
  }
  t->cls = n;
  tier_nclass *c = &n[t->ncls];
  *c = (tier_nclass){.cap = cap, .slot_bytes = t->hdr_bytes + cap, .fd = fd};
  c->file_idx = kvp__tier_io_register_file(t->io, fd);
  pthread_mutex_lock(&t->rmu); /* mu -> rmu: no read is using the ring */
  c->rfile_idx = kvp__tier_io_register_file(t->rio, fd);
  pthread_mutex_unlock(&t->rmu);
  int rc = kvp__tier_policy_create(t->o.policy, &t->a, &c->pol);
  if (rc < 0) {
    close(fd);
    return rc;
  }
  *out = (int32_t)t->ncls++;
  return 0;
}

/* Make room for more slots: fallocate (ftruncate where unsupported). */
static int class_grow(kvp_tier_store *t, tier_nclass *c, uint64_t slots) {
  if (slots == 0) /* e.g. a slab file created just before a crash */
    return 0;
  uint64_t add = slots * c->slot_bytes, off = c->nslots * c->slot_bytes;
  int rc = fallocate(c->fd, 0, (off_t)off, (off_t)add);
  if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS))
    rc = ftruncate(c->fd, (off_t)(off + add));
  if (rc != 0)
    return -errno;
  uint64_t n = c->nslots + slots;
  uint32_t *ow = kvp__realloc(&t->a, c->owner, c->nslots * sizeof *ow, n * sizeof *ow);
  if (ow == NULL)
    return KVP_ENOMEM;
  c->owner = ow;
  uint64_t *fr = kvp__realloc(&t->a, c->free, c->nslots * sizeof *fr, n * sizeof *fr);
  if (fr == NULL)
    return KVP_ENOMEM;
  c->free = fr;
  uint16_t *pn = kvp__realloc(&t->a, c->pins, c->nslots * sizeof *pn, n * sizeof *pn);
  if (pn == NULL)
    return KVP_ENOMEM;
  c->pins = pn;
  uint8_t *zb = kvp__realloc(&t->a, c->zombie, c->nslots, n);
  if (zb == NULL)
    return KVP_ENOMEM;
  c->zombie = zb;
  for (uint64_t s = n; s-- > c->nslots;) {
    ow[s] = TIER_NIL;
    pn[s] = 0;
    zb[s] = 0;
    fr[c->nfree++] = s;
  }
  c->nslots = n;
  t->nvme_alloc += add;
  return 0;
}

static void slot_release(kvp_tier_store *t, tier_nclass *c, uint64_t slot) {
  c->owner[slot] = TIER_NIL;
  if (c->pins[slot] > 0)
    c->zombie[slot] = 1; /* freed by its last reader (slot_unpin) */
  else
    c->free[c->nfree++] = slot;
  t->nvme_used -= c->cap;
}

static void slot_unpin(tier_nclass *c, uint64_t slot) {
  assert(c->pins[slot] > 0);
  if (--c->pins[slot] == 0 && c->zombie[slot]) {
    c->zombie[slot] = 0;
    c->free[c->nfree++] = slot;
  }
}

/* Gives back the trailing free slots of every other class's file, so a
 * class that needs room can grow (capacity counts allocated file bytes). */
static void reclaim_tails(kvp_tier_store *t, int32_t keep) {
  for (uint32_t i = 0; i < t->ncls; i++) {
    tier_nclass *c = &t->cls[i];
    uint64_t n = c->nslots;
    if ((int32_t)i == keep)
      continue;
    while (n > 0 && c->owner[n - 1] == TIER_NIL && c->pins[n - 1] == 0)
      n--; /* a pinned slot is being read: the file keeps it */
    if (n == c->nslots || ftruncate(c->fd, (off_t)(n * c->slot_bytes)) != 0)
      continue;
    uint64_t k = 0; /* the free stack without the cut slots */
    for (uint64_t j = 0; j < c->nfree; j++)
      if (c->free[j] < n)
        c->free[k++] = c->free[j];
    c->nfree = k;
    t->nvme_alloc -= (c->nslots - n) * c->slot_bytes;
    c->nslots = n;
  }
}

static int try_grow(kvp_tier_store *t, tier_nclass *c) {
  if (t->nvme_alloc + c->slot_bytes > t->nvme_cap)
    return KVP_ENOSPC;
  uint64_t room = (t->nvme_cap - t->nvme_alloc) / c->slot_bytes;
  uint64_t step = t->nvme_cap / 32 < GROW_BYTES ? t->nvme_cap / 32 : GROW_BYTES;
  uint64_t want = step / c->slot_bytes;
  want = want == 0 ? 1 : want;
  int rc = class_grow(t, c, want < room ? want : room);
  if (rc == -ENOSPC)
    t->st.io_errors++; /* the file system is fuller than the capacity says */
  return rc;
}

/* A free slot in class ci: free list, growth within capacity, trailing
 * space of other classes, or eviction of the class's policy victim.
 * Returns 0 or KVP_ENOSPC. */
static int slot_take(kvp_tier_store *t, int32_t ci, uint64_t *slot) {
  tier_nclass *c = &t->cls[ci];
  if (c->nfree == 0 && try_grow(t, c) < 0 &&
      kvp__tier_policy_count(c->pol) == 0) {
    reclaim_tails(t, ci);
    try_grow(t, c);
  }
  if (c->nfree == 0) {
    uint32_t v;
    if (kvp__tier_policy_victim(c->pol, &v) < 0)
      return KVP_ENOSPC;
    t->st.evictions[KVP_TIER_NVME]++;
    kvp__tier_nvme_drop(t, v, false, true);
    kvp__tier_entry_gc(t, v);
  }
  *slot = c->free[--c->nfree];
  return 0;
}

/* ---- encryption (AES-256-GCM, AAD = the block's identity) -----------------*/
static void aad_of(const tier_slot_hdr *h, uint8_t aad[48]) {
  uint64_t v[6] = {h->ns.hi, h->ns.lo, h->key.hi, h->key.lo, h->len, h->epoch};
  for (int i = 0; i < 6; i++)
    for (int b = 0; b < 8; b++)
      aad[i * 8 + b] = (uint8_t)(v[i] >> (8 * b));
}

static int gcm(void *ctx, bool enc, const uint8_t key[32], tier_slot_hdr *h,
               const uint8_t *in, uint8_t *out) {
  EVP_CIPHER_CTX *x = ctx;
  uint8_t aad[48];
  int l, ok;
  aad_of(h, aad);
  if (h->len > INT32_MAX)
    return KVP_ERANGE;
  if (enc) {
    ok = EVP_EncryptInit_ex(x, EVP_aes_256_gcm(), NULL, key, h->iv) &&
         EVP_EncryptUpdate(x, NULL, &l, aad, sizeof aad) &&
         EVP_EncryptUpdate(x, out, &l, in, (int)h->len) &&
         EVP_EncryptFinal_ex(x, out + l, &l) &&
         EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_GET_TAG, 16, h->tag);
  } else {
    ok = EVP_DecryptInit_ex(x, EVP_aes_256_gcm(), NULL, key, h->iv) &&
         EVP_DecryptUpdate(x, NULL, &l, aad, sizeof aad) &&
         EVP_DecryptUpdate(x, out, &l, in, (int)h->len) &&
         EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_SET_TAG, 16, h->tag) &&
         EVP_DecryptFinal_ex(x, out + l, &l) > 0;
  }
  return ok ? 0 : KVP_ECORRUPT;
}

/* ---- writes -----------------------------------------------------------------*/
static tio_pool pool_of(const kvp_tier_store *t) {
  /* qd_max + 1: one block is staged while the queue is full */
  return (tio_pool){.base = t->stage, .each = t->stage_each, .n = t->qd_max + 1,
                    .fixed = t->fixed_bufs};
}

static tio_op op_of(int kind, const tier_nclass *c, uint64_t slot,
                    uint32_t len) {
  return (tio_op){.op = (uint8_t)kind, .needs_buf = kind != TIO_SYNC,
                  .fd = c->fd, .file = c->file_idx, .len = len,
                  .off = slot * c->slot_bytes};
}

static uint32_t io_len(const kvp_tier_store *t, uint64_t len) {
  return (uint32_t)(t->hdr_bytes + round_up(len, t->hdr_bytes));
}

/* Builds entry id's slot image (header sector + payload) in b. */
static int stage_slot(kvp_tier_store *t, uint32_t id, uint8_t *b) {
  tier_entry *e = &t->ents[id];
  const tier_ns *ns = kvp__tier_ns_find(t, e->ns);
  tier_slot_hdr h = {.ns = e->ns, .key = e->key, .len = e->len,
                     .epoch = ++t->epoch};
  uint8_t *pay = b + t->hdr_bytes;
  if (ns != NULL && ns->enc) {
    h.flags = TIER_HDR_F_AESGCM;
    if (RAND_bytes(h.iv, sizeof h.iv) != 1 || gcm(t->cctx, true, ns->key, &h, e->dram, pay) < 0)
      return KVP_EIO;
  } else {
    memcpy(pay, e->dram, e->len);
  }
  memset(pay + e->len, 0, round_up(e->len, t->hdr_bytes) - e->len);
  h.payload_sum = kvp__tier_payload_sum(pay, e->len);
  e->nsum = h.payload_sum; /* what a payload-only read must find */
  e->nenc = h.flags & TIER_HDR_F_AESGCM ? 1 : 0;
  memset(b, 0, t->hdr_bytes);
  kvp__tier_hdr_encode(&h, b);
  return 0;
}

typedef struct wctx {
  kvp_tier_store *t;
  const uint32_t *ids;
  int *res;
  uint64_t *slots;
  uint64_t bytes; /* payload bytes written */
} wctx;

static void wprep(void *arg, size_t i, tio_op *op) {
  wctx *w = arg;
  op->res = w->res[i] < 0 ? w->res[i] : stage_slot(w->t, w->ids[i], op->buf);
}

static void wdone(void *arg, size_t i, tio_op *op) {
  wctx *w = arg;
  kvp_tier_store *t = w->t;
  tier_entry *e = &t->ents[w->ids[i]];
  if (e->nclass < 0) /* no slot was taken */
    return;
  tier_nclass *c = &t->cls[e->nclass];
  if (!op->skipped)
    t->st.nvme_writes++;
  if (op->res != (int)op->len) {
    if (op->skipped)
      w->res[i] = op->res;
    else if (op->res >= 0)
      t->st.short_io++, w->res[i] = KVP_EIO;
    else
      t->st.io_errors++, w->res[i] = op->res;
    c->free[c->nfree++] = w->slots[i];
    e->nclass = -1;
    return;
  }
  t->st.nvme_bytes_written += op->len;
  w->bytes += e->len;
  /* the admission cell it was written in, for its outcome */
  e->adm = kvp__tier_admit_cell((kvp_class)e->cls, e->hits);
  c->owner[w->slots[i]] = w->ids[i];
  e->nslot = w->slots[i];
  t->nvme_used += c->cap;
  t->st.nvme_blocks++;
  kvp__tier_policy_insert(c->pol, w->ids[i], e->key.lo ^ e->ns.lo, c->cap, e->cls);
  kvp__tier_emit(t, KVP_TIER_NVME, 1, e);
}

void kvp__tier_nvme_write(kvp_tier_store *t, const uint32_t *ids, size_t n,
                          bool durable, int *res) {
  if (n == 0)
    return;
  tio_op *ops = kvp__calloc(&t->a, n, sizeof *ops);
  uint64_t *slots = kvp__calloc(&t->a, n, sizeof *slots);
  for (size_t i = 0; i < n; i++)
    res[i] = t->io == NULL ? KVP_ENOTSUP : ops == NULL || slots == NULL ? KVP_ENOMEM : 0;
  if (res[0] < 0)
    goto out;
  for (size_t i = 0; i < n; i++) { /* metadata first: classes and slots */
    tier_entry *e = &t->ents[ids[i]];
    uint64_t cap = kvp__tier_class_bytes(e->len);
    int32_t ci = -1;
    res[i] = cap + t->hdr_bytes > t->stage_each ? KVP_ERANGE : class_open(t, cap, true, &ci);
    if (res[i] == 0)
      res[i] = slot_take(t, ci, &slots[i]);
    if (res[i] == 0)
      e->nclass = ci; /* provisional: the slot is taken, not yet owned */
    ops[i] = res[i] == 0 ? op_of(TIO_WRITE, &t->cls[ci], slots[i], io_len(t, e->len))
                         : (tio_op){.op = TIO_WRITE, .fd = -1};
  }
  wctx w = {t, ids, res, slots, 0};
  tio_pool pool = pool_of(t);
  if (t->no_stage_ahead) /* no spare buffer: staged only into a free slot */
    pool.n = t->qd < pool.n ? t->qd : pool.n;
  uint64_t t0 = kvp_now_ns(), dt;
  kvp__tier_io_run(t->io, ops, n, t->qd, &pool, wprep, wdone, &w);
  if (w.bytes > 0 && (dt = kvp_now_ns() - t0) > 0) {
    double bps = (double)w.bytes * 1e9 / (double)dt;
    t->bw_write = t->bw_write == 0 ? bps : 0.75 * t->bw_write + 0.25 * bps;
  }
  if (durable) {
    int rc = kvp__tier_nvme_sync(t);
    for (size_t i = 0; rc < 0 && i < n; i++)
      if (res[i] == 0)
        res[i] = rc; /* on NVMe, but not acknowledged durable */
  }
out:
  kvp__free(&t->a, ops, n * sizeof *ops);
  kvp__free(&t->a, slots, n * sizeof *slots);
}

int kvp__tier_nvme_sync(kvp_tier_store *t) {
  int rc = 0;
  if (t->ncls == 0)
    return 0;
  tio_op *ops = kvp__calloc(&t->a, t->ncls, sizeof *ops);
  if (ops == NULL)
    return KVP_ENOMEM;
  for (uint32_t i = 0; i < t->ncls; i++)
    ops[i] = op_of(TIO_SYNC, &t->cls[i], 0, 0);
  kvp__tier_io_run(t->io, ops, t->ncls, t->qd, NULL, NULL, NULL, NULL);
  for (uint32_t j = 0; j < t->ncls; j++)
    if (ops[j].res < 0) {
      t->st.io_errors++;
      rc = ops[j].res;
    }
  kvp__free(&t->a, ops, t->ncls * sizeof *ops);
  return rc;
}

/* ---- reads ------------------------------------------------------------------*/
/* One read as its I/O phase sees it: copied from the index under mu, so the
 * I/O and the checks run without the store's lock (the slot is pinned). */
typedef struct rsnap {
  kvp_key ns, key;
  uint64_t len, nsum, slot;
  int32_t ci;
  bool ns_ok, ns_enc, alone;
  uint8_t nenc;
  uint8_t aes[32];
} rsnap;

/* What the read phase saw; merged into the stats under mu. */
enum { RF_NONE, RF_IO, RF_SHORT, RF_SUM, RF_KEY, RF_AUTH };

typedef struct rctx {
  kvp_tier_store *t;
  const rsnap *sn;
  void *const *dst;
  int *res;
  uint8_t *fail; /* RF_* per op */
  uint64_t bytes, io_bytes, reads, reads_reg;
} rctx;

/* Checks a slot read as header sector hb + payload pay (the staging buffer
 * right after hb, or dst itself for a direct read) and leaves the payload
 * in dst: RF_NONE or the failure. */
static int verify_slot(rctx *r, const rsnap *e, const uint8_t *hb,
                       const uint8_t *pay, void *dst) {
  tier_slot_hdr h;
  if (kvp__tier_hdr_decode(hb, TIER_HDR_BYTES, &h) < 0 || h.len != e->len ||
      h.payload_sum != kvp__tier_payload_sum(pay, h.len))
    return RF_SUM;
  if (!kvp_key_eq(h.ns, e->ns) || !kvp_key_eq(h.key, e->key))
    return RF_KEY;
  bool enc = (h.flags & TIER_HDR_F_AESGCM) != 0;
  if (!e->ns_ok || enc != e->ns_enc)
    return RF_AUTH; /* an encrypted namespace never reads plaintext */
  if (!enc) {
    if (pay != dst)
      memcpy(dst, pay, h.len);
    return RF_NONE;
  }
  return gcm(r->t->rcctx, false, e->aes, &h, pay, dst) < 0 ? RF_AUTH : RF_NONE;
}

/* A plaintext payload read alone (no header sector): checked against the
 * checksum its header carried when it was written or recovered (e->nsum);
 * the key, namespace and length are those of the index entry that the
 * header established.  From staging, the checksum and the copy to dst run
 * chunk by chunk in one pass over the cold buffer. */
static int verify_payload(const rsnap *e, const uint8_t *pay, void *dst) {
  uint64_t sum;
  if (pay == dst) {
    sum = kvp__tier_payload_sum(pay, e->len);
  } else {
    XXH3_state_t st;
    XXH3_64bits_reset(&st);
    for (uint64_t o = 0; o < e->len; o += 32768) {
      size_t k = e->len - o < 32768 ? (size_t)(e->len - o) : 32768;
      memcpy((uint8_t *)dst + o, pay + o, k);
      XXH3_64bits_update(&st, (uint8_t *)dst + o, k);
    }
    sum = XXH3_64bits_digest(&st);
  }
  return sum == e->nsum ? RF_NONE : RF_SUM;
}

static void rdone(void *arg, size_t i, tio_op *op) { /* rmu held, not mu */
  rctx *r = arg;
  const rsnap *e = &r->sn[i];
  r->reads++;
  r->reads_reg += op->user_buf > 0;
  if (op->res != (int)(op->len + op->len2)) {
    r->fail[i] = op->res >= 0 ? RF_SHORT : RF_IO;
  } else {
    r->io_bytes += (uint64_t)op->len + op->len2;
    if (e->alone)
      r->fail[i] = (uint8_t)verify_payload(e, op->buf, r->dst[i]);
    else
      r->fail[i] = (uint8_t)verify_slot(
          r, e, op->buf, op->buf2 ? op->buf2 : (uint8_t *)op->buf + r->t->hdr_bytes,
          r->dst[i]);
    if (r->fail[i] == RF_NONE)
      r->bytes += e->len; /* payload: what the caller gets */
  }
  r->res[i] = r->fail[i] == RF_NONE ? KVP_TIER_NVME : KVP_ENOENT;
}

/* The ring's buffer index + 1 of the registered caller range holding
 * [p, p + len), 0 when none does (then a plain read pins the pages).
 * Caller holds rmu (or mu and rmu). */
static int ubuf_find(const kvp_tier_store *t, uintptr_t p, size_t len) {
  uint32_t lo = 0, hi = t->nubuf; /* first range with base > p */
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (t->ubuf[mid].base <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == 0)
    return 0;
  const tier_ubuf *u = &t->ubuf[lo - 1];
  return p - u->base <= u->len && len <= u->len - (p - u->base)
             ? (int)u->idx + 1
             : 0;
}

/* Snapshot of entry id for its read, and the read: plaintext slots read
 * their payload only, exactly the block rounded up to the sector: straight
 * into an aligned caller buffer when it holds whole sectors (no copy), else
 * into the read ring's staging.  Encrypted slots read header + payload (the IV
 * and tag live in the header).  mu held. */
static tio_op read_prep(const kvp_tier_store *t, uint32_t id, void *dst,
                        rsnap *sn) {
  const tier_entry *e = &t->ents[id];
  const tier_nclass *c = &t->cls[e->nclass];
  const tier_ns *ns = kvp__tier_ns_find(t, e->ns);
  *sn = (rsnap){.ns = e->ns, .key = e->key, .len = e->len, .nsum = e->nsum,
                .slot = e->nslot, .ci = e->nclass, .ns_ok = ns != NULL,
                .ns_enc = ns != NULL && ns->enc, .nenc = e->nenc};
  if (sn->ns_enc)
    memcpy(sn->aes, ns->key, 32);
  tio_op op = op_of(TIO_READ, c, e->nslot, io_len(t, e->len));
  op.file = c->rfile_idx;
  sn->alone = ns != NULL && !ns->enc && !e->nenc;
  if (!sn->alone)
    return op;
  op.off += t->hdr_bytes;
  op.len -= t->hdr_bytes;
  if (((uintptr_t)dst % t->hdr_bytes) == 0 && e->len % t->hdr_bytes == 0) {
    op.needs_buf = false;
    op.buf = dst; /* on a miss dst holds whatever was read */
  }
  return op;
}

/* The entry still names the block that was read, in the same slot. */
static bool still_ours(const kvp_tier_store *t, uint32_t id, const rsnap *sn) {
  const tier_entry *e = &t->ents[id];
  return id < t->nents && e->live && e->nclass == sn->ci &&
         e->nslot == sn->slot && kvp_key_eq(e->key, sn->key) &&
         kvp_key_eq(e->ns, sn->ns);
}

/* mu held: merges what the read phase saw, unpins, and drops the slots
 * that failed their checks (when still the entry's). */
static void read_finish(kvp_tier_store *t, const uint32_t *ids, size_t n,
                        const rsnap *sn, const rctx *r, uint64_t ns) {
  t->st.nvme_reads += r->reads;
  t->st.nvme_reads_registered += r->reads_reg;
  t->st.nvme_bytes_read += r->io_bytes;
  if (r->bytes > 0)
    kvp__tier_bw_note(t, KVP_TIER_NVME, r->bytes, ns);
  for (size_t i = 0; i < n; i++) {
    slot_unpin(&t->cls[sn[i].ci], sn[i].slot);
    bool ours = still_ours(t, ids[i], &sn[i]);
    switch (r->fail[i]) {
    case RF_IO: t->st.io_errors++; break;
    case RF_SHORT: t->st.short_io++; break;
    /* a check that failed because the block was evicted (header wiped)
     * under the read is a race, not damage: not counted */
    case RF_SUM: t->st.checksum_failures += ours; break;
    case RF_KEY: t->st.key_mismatch += ours; break;
    case RF_AUTH: t->st.auth_failures += ours; break;
    default: break;
    }
    t->st.nvme_read_races += !ours && r->fail[i] >= RF_SUM;
    if (!ours)
      continue;
    if (r->fail[i] == RF_NONE) /* read back: the gate's admission paid */
      kvp__tier_admit_outcome(t, &t->ents[ids[i]], true);
    else /* a miss; the slot is not trusted again */
      kvp__tier_nvme_drop(t, ids[i], false, false);
  }
}

void kvp__tier_nvme_read(kvp_tier_store *t, const uint32_t *ids, size_t n,
                         void *const *dst, int *res) {
  tio_op *ops = kvp__calloc(&t->a, n, sizeof *ops);
  rsnap *sn = kvp__calloc(&t->a, n, sizeof *sn);
  uint8_t *fail = kvp__calloc(&t->a, n, 1);
  if (ops == NULL || sn == NULL || fail == NULL) {
    for (size_t i = 0; i < n; i++)
      res[i] = KVP_ENOENT;
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    ops[i] = read_prep(t, ids[i], dst[i], &sn[i]);
    t->cls[sn[i].ci].pins[sn[i].slot]++; /* no write lands in it now */
    assert(t->cls[sn[i].ci].pins[sn[i].slot] != 0);
  }
  uint32_t qd = t->qd;
  bool unlock = !t->reads_locked;
  if (unlock)
    pthread_mutex_unlock(&t->mu); /* the I/O and the checks run without it */
  pthread_mutex_lock(&t->rmu);
  for (size_t i = 0; i < n; i++)
    if (!ops[i].needs_buf)
      ops[i].user_buf = ubuf_find(t, (uintptr_t)dst[i], ops[i].len);
  rctx r = {.t = t, .sn = sn, .dst = dst, .res = res, .fail = fail};
  tio_pool pool = {.base = t->rstage, .each = t->stage_each, .n = t->qd_max,
                   .fixed = t->rfixed};
  uint64_t t0 = kvp_now_ns();
  kvp__tier_io_run(t->rio, ops, n, qd, &pool, NULL, rdone, &r);
  uint64_t dt = kvp_now_ns() - t0;
  pthread_mutex_unlock(&t->rmu);
  if (unlock)
    pthread_mutex_lock(&t->mu);
  read_finish(t, ids, n, sn, &r, dt);
out:
  kvp__free(&t->a, ops, n * sizeof *ops);
  kvp__free(&t->a, sn, n * sizeof *sn);
  kvp__free(&t->a, fail, n);
}

static int ubuf_cmp(const void *a, const void *b) {
  uintptr_t x = ((const tier_ubuf *)a)->base, y = ((const tier_ubuf *)b)->base;
  return (x > y) - (x < y);
}

/* The caller's ranges cut into pieces of at most 1 GiB (the kernel's limit
 * per registered buffer), sorted; KVP_EINVAL on an empty or overlapping
 * range. */
static int ubuf_build(kvp_tier_store *t, const struct iovec *iov, unsigned n,
                      tier_ubuf **out, uint32_t *np) {
  const size_t piece = (size_t)1 << 30;
  uint64_t cnt = 0;
  for (unsigned i = 0; i < n; i++) {
    if (iov[i].iov_base == NULL || iov[i].iov_len == 0 ||
        (uintptr_t)iov[i].iov_base + iov[i].iov_len < (uintptr_t)iov[i].iov_base)
      return KVP_EINVAL;
    cnt += (iov[i].iov_len + piece - 1) / piece;
  }
  if (cnt > TIER_URING_BUFS_MAX)
    return KVP_ERANGE;
  tier_ubuf *u = kvp__calloc(&t->a, (size_t)cnt, sizeof *u);
  if (u == NULL)
    return KVP_ENOMEM;
  uint32_t k = 0;
  for (unsigned i = 0; i < n; i++)
    for (size_t o = 0; o < iov[i].iov_len; o += piece) {
      size_t l = iov[i].iov_len - o < piece ? iov[i].iov_len - o : piece;
      u[k++] = (tier_ubuf){(uintptr_t)iov[i].iov_base + o, l, 0};
    }
  qsort(u, k, sizeof *u, ubuf_cmp);
  for (uint32_t i = 1; i < k; i++)
    if (u[i - 1].base + u[i - 1].len > u[i].base) {
      kvp__free(&t->a, u, (size_t)cnt * sizeof *u);
      return KVP_EINVAL;
    }
  *out = u;
  *np = k;
  return 0;
}

static void ubuf_clear(kvp_tier_store *t) {
  kvp__free(&t->a, t->ubuf, (size_t)t->nubuf * sizeof *t->ubuf);
  t->ubuf = NULL;
  t->nubuf = 0;
}

int kvp__tier_nvme_register(kvp_tier_store *t, const struct iovec *iov,
                            unsigned n) {
  tier_ubuf *u = NULL;
  uint32_t k = 0, first = 0;
  int rc = n > 0 ? ubuf_build(t, iov, n, &u, &k) : 0;
  if (rc < 0)
    return rc;
  if (t->rio == NULL || !kvp__tier_io_is_uring(t->rio)) {
    kvp__free(&t->a, u, (size_t)k * sizeof *u);
    return 0; /* pread/pwrite: nothing to register, nothing changes */
  }
  ubuf_clear(t);
  struct iovec *v = k > 0 ? kvp__calloc(&t->a, k, sizeof *v) : NULL;
  if (k > 0 && v == NULL)
    rc = KVP_ENOMEM;
  for (uint32_t i = 0; v != NULL && i < k; i++)
    v[i] = (struct iovec){(void *)u[i].base, u[i].len};
  if (rc == 0)
    rc = kvp__tier_io_set_user_buffers(t->rio, v, k, &first); /* reads */
  kvp__free(&t->a, v, (size_t)k * sizeof *v);
  if (rc < 0) {
    KVP_LOGW("kvtier", "registering %u caller buffer ranges failed (%s): "
             "reads into them stay unregistered", n, kvp_strerror(rc));
    kvp__free(&t->a, u, (size_t)k * sizeof *u);
    return rc;
  }
  for (uint32_t i = 0; i < k; i++)
    u[i].idx = first + i;
  t->ubuf = u;
  t->nubuf = k;
  return (int)n;
}

static void zprep(void *arg, size_t i, tio_op *op) {
  (void)i;
  memset(op->buf, 0, ((kvp_tier_store *)arg)->hdr_bytes);
}

void kvp__tier_nvme_drop(kvp_tier_store *t, uint32_t id, bool wipe,
                         bool evicted) {
  tier_entry *e = &t->ents[id];
  if (e->nclass < 0)
    return;
  tier_nclass *c = &t->cls[e->nclass];
  if (wipe) { /* so recovery does not bring an evicted block back */
    tio_op op = op_of(TIO_WRITE, c, e->nslot, t->hdr_bytes);
    tio_pool pool = pool_of(t);
    kvp__tier_io_run(t->io, &op, 1, 1, &pool, zprep, NULL, t);
    if (op.res != (int)t->hdr_bytes)
      t->st.io_errors++;
  }
  kvp__tier_admit_outcome(t, e, false); /* left unread */
  kvp__tier_policy_remove(c->pol, id, evicted);
  slot_release(t, c, e->nslot);
  e->nclass = -1;
  t->st.nvme_blocks--;
  kvp__tier_emit(t, KVP_TIER_NVME, 0, e);
}

/* ---- open / recovery ---------------------------------------------------------*/
static void recover_slot(kvp_tier_store *t, int32_t ci, uint64_t slot,
                         const tier_slot_hdr *h) {
  tier_nclass *c = &t->cls[ci];
  if (kvp__tier_class_bytes(h->len) != c->cap) {
    t->st.recovery_bad_slots++;
    return;
  }
  if (h->epoch > t->epoch)
    t->epoch = h->epoch;
  uint32_t id = kvp__tier_entry_find(t, h->ns, h->key);
  if (id != TIER_NIL) { /* the same block twice: keep one slot */
    t->st.recovery_dup_slots++;
    return;
  }
  id = kvp__tier_entry_new(t, h->ns, h->key);
  if (id == TIER_NIL)
    return;
  tier_entry *e = &t->ents[id];
  e->len = h->len;
  e->nsum = h->payload_sum;
  e->nenc = h->flags & TIER_HDR_F_AESGCM ? 1 : 0;
  e->cls = KVP_CLASS_SEMI; /* admitted to NVMe once: at least reused */
  e->nclass = ci;
  e->nslot = slot;
  c->owner[slot] = id;
  t->nvme_used += c->cap;
  t->st.nvme_blocks++;
  t->st.recovered_slots++;
  kvp__tier_policy_insert(c->pol, id, h->key.lo ^ h->ns.lo, c->cap, e->cls);
  kvp__tier_emit(t, KVP_TIER_NVME, 1, e);
}

typedef struct scanctx {
  kvp_tier_store *t;
  int32_t ci;
  uint64_t base;
} scanctx;

static void sdone(void *arg, size_t i, tio_op *op) {
  scanctx *s = arg;
  tier_slot_hdr h;
  if (op->res != (int)op->len) {
    s->t->st.io_errors++;
  } else if (kvp__tier_hdr_decode(op->buf, TIER_HDR_BYTES, &h) == 0) {
    recover_slot(s->t, s->ci, s->base + i, &h);
  } else if (((uint8_t *)op->buf)[0] != 0) {
    s->t->st.recovery_bad_slots++; /* not a wiped or never-written slot */
  }
}

static int recover_class(kvp_tier_store *t, int32_t ci) {
  tier_nclass *c = &t->cls[ci];
  struct stat sb;
  if (fstat(c->fd, &sb) != 0)
    return -errno;
  uint64_t slots = (uint64_t)sb.st_size / c->slot_bytes;
  c->nslots = 0;
  int rc = class_grow(t, c, slots); /* adopts the existing slots */
  if (rc < 0 || slots == 0)
    return rc;
  enum { CHUNK = 1024 };
  tio_op *ops = kvp__calloc(&t->a, CHUNK, sizeof *ops);
  if (ops == NULL)
    return KVP_ENOMEM;
  tio_pool pool = pool_of(t);
  for (uint64_t at = 0; at < slots; at += CHUNK) {
    size_t n = slots - at < CHUNK ? (size_t)(slots - at) : CHUNK;
    for (size_t i = 0; i < n; i++)
      ops[i] = op_of(TIO_READ, c, at + i, t->hdr_bytes);
    scanctx sc = {t, ci, at};
    kvp__tier_io_run(t->io, ops, n, t->qd_max, &pool, NULL, sdone, &sc);
  }
  kvp__free(&t->a, ops, CHUNK * sizeof *ops);
  c = &t->cls[ci];
  c->nfree = 0; /* rebuild the free stack from the owners */
  for (uint64_t s = slots; s-- > 0;)
    if (c->owner[s] == TIER_NIL)
      c->free[c->nfree++] = s;
  return 0;
}

static int recover(kvp_tier_store *t) {
  DIR *d = fdopendir(dup(t->dirfd));
  if (d == NULL)
    return -errno;
  struct dirent *de;
  int rc = 0;
  while (rc == 0 && (de = readdir(d)) != NULL) {
    uint64_t cap;
    char tail[8];
    if (sscanf(de->d_name, "kvtier-%" SCNu64 ".sla%1s", &cap, tail) != 2 ||
        strcmp(tail, "b") != 0 || cap == 0 || cap % 4096 != 0 ||
        kvp__tier_class_bytes(cap) != cap)
      continue;
    if (cap + t->hdr_bytes > t->stage_each) {
      KVP_LOGW("kvtier", "%s/%s: blocks larger than max_block_bytes; not "
               "recovered (raise max_block_bytes to read them)", t->dir,
               de->d_name);
      continue;
    }
    int32_t ci;
    rc = class_open(t, cap, false, &ci);
    if (rc == 0)
      rc = recover_class(t, ci);
  }
  closedir(d);
  return rc;
}

static uint64_t fs_free(int dirfd) {
  struct statvfs v;
  return fstatvfs(dirfd, &v) == 0 ? (uint64_t)v.f_bavail * v.f_frsize : 0;
}

/* O_DIRECT on the directory's file system (tmpfs refuses it). */
static int probe_direct(kvp_tier_store *t) {
  int fd = openat(t->dirfd, ".", O_TMPFILE | O_RDWR | O_DIRECT, 0600);
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR))
    return 0; /* no O_TMPFILE here: class files will tell */
  if (fd < 0) {
    KVP_LOGE("kvtier", "nvme_dir %s: O_DIRECT refused (%s); tmpfs cannot hold "
             "the NVMe tier: use a directory on a disk (e.g. /var/tmp)",
             t->dir, strerror(errno));
    return KVP_ENOTSUP;
  }
  struct statx sx;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
      (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align > 4096)
    t->hdr_bytes = sx.stx_dio_offset_align;
  close(fd);
  return 0;
}

int kvp__tier_nvme_open(kvp_tier_store *t) {
  int rc;
  t->hdr_bytes = 4096;
  t->dirfd = open(t->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (t->dirfd < 0) {
    rc = -errno;
    KVP_LOGE("kvtier", "nvme_dir %s: %s", t->dir, strerror(errno));
    return rc;
  }
  if ((rc = probe_direct(t)) < 0)
    return rc;
  t->nvme_cap = t->o.nvme_bytes;
  if (t->nvme_cap == 0) {
    double f = t->o.nvme_fraction > 0 ? t->o.nvme_fraction : 0.5;
    t->nvme_cap = (uint64_t)(f * (double)fs_free(t->dirfd));
  }
  uint64_t maxb = t->o.max_block_bytes ? t->o.max_block_bytes : (UINT64_C(4) << 20);
  t->stage_each = round_up(t->hdr_bytes + kvp__tier_class_bytes(maxb), 4096);
  t->stage_len = round_up(t->stage_each * (t->qd_max + 1), UINT64_C(2) << 20);
  void *p = mmap(NULL, t->stage_len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return KVP_ENOMEM;
  t->stage = p;
  if ((rc = kvp__tier_io_create(t->o.io_backend, t->qd_max, t->o.io_filter,
                                t->o.io_filter_opaque, &t->a, &t->io)) < 0)
    return rc;
  kvp__tier_io_set_slow(t->io, (t->o.slow_io_us ? t->o.slow_io_us : 100000) * UINT64_C(1000));
  t->fixed_bufs = kvp__tier_io_register_buffers(t->io, t->stage, t->stage_each,
                                                t->qd_max + 1);
  /* the read ring: same backend as the write ring, its own staging */
  p = mmap(NULL, t->stage_len, PROT_READ | PROT_WRITE,
           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return KVP_ENOMEM;
  t->rstage = p;
  kvp_tier_io_backend rb = kvp__tier_io_is_uring(t->io) ? KVP_TIER_IO_URING
                                                         : KVP_TIER_IO_POSIX;
  if ((rc = kvp__tier_io_create(rb, t->qd_max, t->o.io_filter,
                                t->o.io_filter_opaque, &t->a, &t->rio)) < 0)
    return rc;
  kvp__tier_io_set_slow(t->rio, (t->o.slow_io_us ? t->o.slow_io_us : 100000) * UINT64_C(1000));
  /* Its staging is NOT registered: that would pin another qd x max block
   * bytes (128 MiB by default) for the reads only unaligned or encrypted
   * blocks take (registered caller buffers and fio's --fixedbufs changed
   * nothing measurable on this VM: README; this path itself not
   * measured).  Caller ranges (kvp_tier_register_buffers) are registered. */
  t->rfixed = false;
  if ((t->cctx = EVP_CIPHER_CTX_new()) == NULL ||
      (t->rcctx = EVP_CIPHER_CTX_new()) == NULL)
    return KVP_ENOMEM;
  return recover(t);
}

void kvp__tier_nvme_close(kvp_tier_store *t) {
  for (uint32_t i = 0; i < t->ncls; i++) {
    tier_nclass *c = &t->cls[i];
    close(c->fd);
    kvp__tier_policy_destroy(c->pol);
    kvp__free(&t->a, c->owner, c->nslots * sizeof *c->owner);
    kvp__free(&t->a, c->free, c->nslots * sizeof *c->free);
    kvp__free(&t->a, c->pins, c->nslots * sizeof *c->pins);
    kvp__free(&t->a, c->zombie, c->nslots);
  }
  kvp__free(&t->a, t->cls, t->ncls * sizeof *t->cls);
  kvp__tier_io_destroy(t->io);
  kvp__tier_io_destroy(t->rio);
  ubuf_clear(t);
  if (t->stage != NULL)
    munmap(t->stage, t->stage_len);
  if (t->rstage != NULL)
    munmap(t->rstage, t->stage_len);
  EVP_CIPHER_CTX_free(t->cctx);
  EVP_CIPHER_CTX_free(t->rcctx);
  if (t->dirfd > 0)
    close(t->dirfd);
}

int kvp__tier_nvme_set_policy(kvp_tier_store *t, kvp_tier_policy_kind k) {
  for (uint32_t i = 0; i < t->ncls; i++) {
    tier_nclass *c = &t->cls[i];
    tier_policy *np;
    int rc = kvp__tier_policy_create(k, &t->a, &np);
    if (rc < 0)
      return rc;
    for (uint64_t s = 0; s < c->nslots; s++)
      if (c->owner[s] != TIER_NIL) {
        tier_entry *e = &t->ents[c->owner[s]];
        kvp__tier_policy_insert(np, c->owner[s], e->key.lo ^ e->ns.lo, c->cap, e->cls);
      }
    kvp__tier_policy_destroy(c->pol);
    c->pol = np;
  }
  return 0;
}
