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
 * a ring of their own under rmu, on pinned slots (kvtier_nvme.h).  This
 * file touches no store field: blocks come in as copies and go back as
 * per-block results. */
#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <linux/magic.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

#include "core_internal.h"
#include "kvtier_nvme.h"

#define GROW_BYTES (UINT64_C(64) << 20)

typedef struct tier_nclass { /* one slab file per payload size class */
  uint64_t cap, slot_bytes;
  int fd, file_idx;
  int rfile_idx;   /* the fd's index in the read ring's file table */
  uint64_t nslots;
  uint32_t *owner; /* entry id per slot, TIER_NIL: free */
  uint64_t *free;  /* stack of free slots */
  uint64_t nfree;
  /* Reads in flight per slot (taken and dropped under the store's lock;
   * the reads run without it).  A slot released while pinned is a zombie:
   * off the free stack until its last reader unpins it, so no write can
   * land in a slot under a read. */
  uint16_t *pins;
  uint8_t *zombie;
  tier_policy *pol;
  bool damage_logged; /* this file's first damage was logged */
} tier_nclass;

typedef struct tier_ubuf { /* a registered caller range (piece <= 1 GiB) */
  uintptr_t base;
  size_t len;
  uint32_t idx; /* the ring's buffer index */
} tier_ubuf;

/* rmu guards the read ring rio, its staging, rcctx and the caller ranges
 * (ubuf); the store's lock guards the rest (kvtier_nvme.h). */
struct tier_nvme {
  kvp_allocator a;
  kvp_tier_policy_kind policy;
  const char *dir; /* the store's copy, for messages */
  int dirfd;
  uint32_t qd_max, hdr_bytes;
  tier_io *io; /* the write ring */
  uint8_t *stage;
  size_t stage_len;
  uint64_t stage_each;
  bool fixed_bufs;
  tier_nclass *cls;
  uint32_t ncls;
  uint64_t cap, alloc, used; /* bytes: capacity, slab files, slots held */
  uint64_t epoch;            /* slab header write counter (recovery keeps
                                the max) */
  void *cctx;                /* EVP_CIPHER_CTX (writes) */
  kvp_tier_stats st;         /* this tier's counters only */
  /* the read ring (under rmu) */
  pthread_mutex_t rmu;
  tier_io *rio;
  uint8_t *rstage;
  bool rfixed;
  void *rcctx; /* EVP_CIPHER_CTX (read verification) */
  tier_ubuf *ubuf; /* kvp_tier_register_buffers, sorted by base */
  uint32_t nubuf;
};

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

/* ---- slab classes ---------------------------------------------------------*/
static int class_open(tier_nvme *nv, uint64_t cap, bool create,
                      int32_t *out) {
  for (uint32_t i = 0; i < nv->ncls; i++)
    if (nv->cls[i].cap == cap) {
      *out = (int32_t)i;
      return 0;
    }
  char name[64];
  snprintf(name, sizeof name, "kvtier-%" PRIu64 ".slab", cap);
  int fd = openat(nv->dirfd, name,
                  O_RDWR | O_DIRECT | O_CLOEXEC | (create ? O_CREAT : 0), 0600);
  if (fd < 0) {
    int e = errno;
    KVP_LOGE("kvtier", "slab file %s/%s: %s", nv->dir, name, strerror(e));
    return -e;
  }
  if (create)
    fsync(nv->dirfd); /* the new file's name survives a crash */
  tier_nclass *n = kvp__realloc(&nv->a, nv->cls, nv->ncls * sizeof *n,
                                (nv->ncls + 1) * sizeof *n);
  if (n == NULL) {
    close(fd);
    return KVP_ENOMEM;
  }
  nv->cls = n;
  tier_nclass *c = &n[nv->ncls];
  *c = (tier_nclass){.cap = cap, .slot_bytes = nv->hdr_bytes + cap, .fd = fd};
  c->file_idx = kvp__tier_io_register_file(nv->io, fd);
  pthread_mutex_lock(&nv->rmu); /* mu -> rmu: no read is using the ring */
  c->rfile_idx = kvp__tier_io_register_file(nv->rio, fd);
  pthread_mutex_unlock(&nv->rmu);
  int rc = kvp__tier_policy_create(nv->policy, &nv->a, &c->pol);
  if (rc < 0) {
    close(fd);
    return rc;
  }
  *out = (int32_t)nv->ncls++;
  return 0;
}

/* Make room for more slots: fallocate (ftruncate where unsupported). */
static int class_grow(tier_nvme *nv, tier_nclass *c, uint64_t slots) {
  if (slots == 0) /* e.g. a slab file created just before a crash */
    return 0;
  uint64_t add = slots * c->slot_bytes, off = c->nslots * c->slot_bytes;
  int rc = fallocate(c->fd, 0, (off_t)off, (off_t)add);
  if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS))
    rc = ftruncate(c->fd, (off_t)(off + add));
  if (rc != 0)
    return -errno;
  uint64_t n = c->nslots + slots;
  uint32_t *ow = kvp__realloc(&nv->a, c->owner, c->nslots * sizeof *ow, n * sizeof *ow);
  if (ow == NULL)
    return KVP_ENOMEM;
  c->owner = ow;
  uint64_t *fr = kvp__realloc(&nv->a, c->free, c->nslots * sizeof *fr, n * sizeof *fr);
  if (fr == NULL)
    return KVP_ENOMEM;
  c->free = fr;
  uint16_t *pn = kvp__realloc(&nv->a, c->pins, c->nslots * sizeof *pn, n * sizeof *pn);
  if (pn == NULL)
    return KVP_ENOMEM;
  c->pins = pn;
  uint8_t *zb = kvp__realloc(&nv->a, c->zombie, c->nslots, n);
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
  nv->alloc += add;
  return 0;
}

static void slot_release(tier_nvme *nv, tier_nclass *c, uint64_t slot) {
  c->owner[slot] = TIER_NIL;
  if (c->pins[slot] > 0)
    c->zombie[slot] = 1; /* freed by its last reader (slot_unpin) */
  else
    c->free[c->nfree++] = slot;
  nv->used -= c->cap;
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
static void reclaim_tails(tier_nvme *nv, int32_t keep) {
  for (uint32_t i = 0; i < nv->ncls; i++) {
    tier_nclass *c = &nv->cls[i];
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
    nv->alloc -= (c->nslots - n) * c->slot_bytes;
    c->nslots = n;
  }
}

static int try_grow(tier_nvme *nv, tier_nclass *c) {
  if (nv->alloc + c->slot_bytes > nv->cap)
    return KVP_ENOSPC;
  uint64_t room = (nv->cap - nv->alloc) / c->slot_bytes;
  uint64_t step = nv->cap / 32 < GROW_BYTES ? nv->cap / 32 : GROW_BYTES;
  uint64_t want = step / c->slot_bytes;
  want = want == 0 ? 1 : want;
  int rc = class_grow(nv, c, want < room ? want : room);
  if (rc == -ENOSPC)
    nv->st.io_errors++; /* the file system is fuller than the capacity says */
  return rc;
}

/* A free slot in class ci: free list, growth within capacity, trailing
 * space of other classes; 1 with *victim, the class's policy victim, when
 * none is left (the caller frees it and asks again).  Else KVP_ENOSPC. */
static int slot_take(tier_nvme *nv, int32_t ci, uint64_t *slot,
                     uint32_t *victim) {
  tier_nclass *c = &nv->cls[ci];
  if (c->nfree == 0 && try_grow(nv, c) < 0 &&
      kvp__tier_policy_count(c->pol) == 0) {
    reclaim_tails(nv, ci);
    try_grow(nv, c);
  }
  if (c->nfree == 0)
    return kvp__tier_policy_victim(c->pol, victim) < 0 ? KVP_ENOSPC : 1;
  *slot = c->free[--c->nfree];
  return 0;
}

int kvp__tier_nvme_reserve(tier_nvme *nv, uint64_t len, int32_t *ci,
                           uint64_t *slot, uint32_t *victim) {
  uint64_t cap = kvp__tier_class_bytes(len);
  int rc = cap + nv->hdr_bytes > nv->stage_each ? KVP_ERANGE
                                                 : class_open(nv, cap, true, ci);
  return rc < 0 ? rc : slot_take(nv, *ci, slot, victim);
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
static tio_pool pool_of(const tier_nvme *nv) {
  /* qd_max + 1: one block is staged while the queue is full */
  return (tio_pool){.base = nv->stage, .each = nv->stage_each, .n = nv->qd_max + 1,
                    .fixed = nv->fixed_bufs};
}

static tio_op op_of(int kind, const tier_nclass *c, uint64_t slot,
                    uint32_t len) {
  return (tio_op){.op = (uint8_t)kind, .needs_buf = kind != TIO_SYNC,
                  .fd = c->fd, .file = c->file_idx, .len = len,
                  .off = slot * c->slot_bytes};
}

static uint32_t io_len(const tier_nvme *nv, uint64_t len) {
  return (uint32_t)(nv->hdr_bytes + round_up(len, nv->hdr_bytes));
}

/* Builds block w's slot image (header sector + payload) in b. */
static int stage_slot(tier_nvme *nv, tier_nwrite *w, uint8_t *b) {
  tier_slot_hdr h = {.ns = w->ns, .key = w->key, .len = w->len,
                     .epoch = ++nv->epoch};
  uint8_t *pay = b + nv->hdr_bytes;
  if (w->enc) {
    h.flags = TIER_HDR_F_AESGCM;
    if (RAND_bytes(h.iv, sizeof h.iv) != 1 ||
        gcm(nv->cctx, true, w->aes, &h, w->src, pay) < 0)
      return KVP_EIO;
  } else {
    memcpy(pay, w->src, w->len);
  }
  memset(pay + w->len, 0, round_up(w->len, nv->hdr_bytes) - w->len);
  h.payload_sum = kvp__tier_payload_sum(pay, w->len);
  w->sum = h.payload_sum; /* what a payload-only read must find */
  w->nenc = h.flags & TIER_HDR_F_AESGCM ? 1 : 0;
  memset(b, 0, nv->hdr_bytes);
  kvp__tier_hdr_encode(&h, b);
  return 0;
}

typedef struct wctx {
  tier_nvme *nv;
  tier_nwrite *w;
  uint64_t bytes; /* payload bytes written */
} wctx;

static void wprep(void *arg, size_t i, tio_op *op) {
  wctx *x = arg;
  tier_nwrite *w = &x->w[i];
  op->res = w->res < 0 ? w->res : stage_slot(x->nv, w, op->buf);
}

static void wdone(void *arg, size_t i, tio_op *op) {
  wctx *x = arg;
  tier_nvme *nv = x->nv;
  tier_nwrite *w = &x->w[i];
  if (w->ci < 0) /* no slot was taken */
    return;
  tier_nclass *c = &nv->cls[w->ci];
  if (!op->skipped)
    nv->st.nvme_writes++;
  if (op->res != (int)op->len) {
    if (op->skipped)
      w->res = op->res;
    else if (op->res >= 0)
      nv->st.short_io++, w->res = KVP_EIO;
    else
      nv->st.io_errors++, w->res = op->res;
    c->free[c->nfree++] = w->slot;
    w->ci = -1;
    return;
  }
  nv->st.nvme_bytes_written += op->len;
  x->bytes += w->len;
  c->owner[w->slot] = w->id;
  nv->used += c->cap;
  kvp__tier_policy_insert(c->pol, w->id, w->key.lo ^ w->ns.lo, c->cap, w->cls);
}

void kvp__tier_nvme_write(tier_nvme *nv, tier_nwrite *w, size_t n, uint32_t qd,
                          bool stage_ahead, bool durable, tier_nvme_batch *b) {
  *b = (tier_nvme_batch){0};
  if (n == 0)
    return;
  tio_op *ops = kvp__calloc(&nv->a, n, sizeof *ops);
  for (size_t i = 0; i < n; i++) {
    if (ops == NULL && w[i].res == 0)
      w[i].res = KVP_ENOMEM;
    if (w[i].res < 0 && w[i].ci >= 0) { /* the slot goes back */
      tier_nclass *c = &nv->cls[w[i].ci];
      c->free[c->nfree++] = w[i].slot;
      w[i].ci = -1;
    }
  }
  if (ops == NULL)
    return;
  for (size_t i = 0; i < n; i++)
    ops[i] = w[i].ci >= 0 ? op_of(TIO_WRITE, &nv->cls[w[i].ci], w[i].slot,
                                  io_len(nv, w[i].len))
                          : (tio_op){.op = TIO_WRITE, .fd = -1};
  wctx x = {nv, w, 0};
  tio_pool pool = pool_of(nv);
  if (!stage_ahead) /* no spare buffer: staged only into a free slot */
    pool.n = qd < pool.n ? qd : pool.n;
  uint64_t t0 = kvp_now_ns();
  kvp__tier_io_run(nv->io, ops, n, qd, &pool, wprep, wdone, &x);
  b->ns = kvp_now_ns() - t0;
  b->bytes = x.bytes;
  if (durable) {
    int rc = kvp__tier_nvme_sync(nv, qd);
    for (size_t i = 0; rc < 0 && i < n; i++)
      if (w[i].res == 0)
        w[i].res = rc; /* on NVMe, but not acknowledged durable */
  }
  kvp__free(&nv->a, ops, n * sizeof *ops);
}

int kvp__tier_nvme_sync(tier_nvme *nv, uint32_t qd) {
  int rc = 0;
  if (nv->ncls == 0)
    return 0;
  tio_op *ops = kvp__calloc(&nv->a, nv->ncls, sizeof *ops);
  if (ops == NULL)
    return KVP_ENOMEM;
  for (uint32_t i = 0; i < nv->ncls; i++)
    ops[i] = op_of(TIO_SYNC, &nv->cls[i], 0, 0);
  kvp__tier_io_run(nv->io, ops, nv->ncls, qd, NULL, NULL, NULL, NULL);
  for (uint32_t j = 0; j < nv->ncls; j++)
    if (ops[j].res < 0) {
      nv->st.io_errors++;
      rc = ops[j].res;
    }
  kvp__free(&nv->a, ops, nv->ncls * sizeof *ops);
  return rc;
}

/* ---- reads ------------------------------------------------------------------*/
/* What the read phase counted; merged into the stats under the store's
 * lock. */
typedef struct rctx {
  tier_nvme *nv;
  tier_nread *r;
  uint64_t bytes, io_bytes, reads, reads_reg;
} rctx;

/* A plaintext slot of a registered namespace reads its payload alone. */
static bool alone(const tier_nread *e) {
  return e->ns_ok && !e->ns_enc && !e->enc;
}

/* Checks a slot read as header sector hb + payload pay (the staging buffer
 * right after hb, or dst itself for a direct read) and leaves the payload
 * in dst: TIER_RF_NONE or the failure. */
static int verify_slot(rctx *r, const tier_nread *e, const uint8_t *hb,
                       const uint8_t *pay, void *dst) {
  tier_slot_hdr h;
  if (kvp__tier_hdr_decode(hb, TIER_HDR_BYTES, &h) < 0 || h.len != e->len ||
      h.payload_sum != kvp__tier_payload_sum(pay, h.len))
    return TIER_RF_SUM;
  if (!kvp_key_eq(h.ns, e->ns) || !kvp_key_eq(h.key, e->key))
    return TIER_RF_KEY;
  bool enc = (h.flags & TIER_HDR_F_AESGCM) != 0;
  if (!e->ns_ok || enc != e->ns_enc)
    return TIER_RF_AUTH; /* an encrypted namespace never reads plaintext */
  if (!enc) {
    if (pay != dst)
      memcpy(dst, pay, h.len);
    return TIER_RF_NONE;
  }
  return gcm(r->nv->rcctx, false, e->aes, &h, pay, dst) < 0 ? TIER_RF_AUTH : TIER_RF_NONE;
}

/* A plaintext payload read alone (no header sector): checked against the
 * checksum its header carried when it was written or recovered (e->sum);
 * the key, namespace and length are those of the index entry that the
 * header established.  From staging, the checksum and the copy to dst run
 * chunk by chunk in one pass over the cold buffer. */
static int verify_payload(const tier_nread *e, const uint8_t *pay, void *dst) {
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
  return sum == e->sum ? TIER_RF_NONE : TIER_RF_SUM;
}

static void rdone(void *arg, size_t i, tio_op *op) { /* rmu held only */
  rctx *r = arg;
  tier_nread *e = &r->r[i];
  r->reads++;
  r->reads_reg += op->user_buf > 0;
  if (op->res != (int)(op->len + op->len2)) {
    e->fail = op->res >= 0 ? TIER_RF_SHORT : TIER_RF_IO;
  } else {
    r->io_bytes += (uint64_t)op->len + op->len2;
    if (alone(e))
      e->fail = (uint8_t)verify_payload(e, op->buf, e->dst);
    else
      e->fail = (uint8_t)verify_slot(
          r, e, op->buf,
          op->buf2 ? op->buf2 : (uint8_t *)op->buf + r->nv->hdr_bytes, e->dst);
    if (e->fail == TIER_RF_NONE)
      r->bytes += e->len; /* payload: what the caller gets */
  }
  e->res = e->fail == TIER_RF_NONE ? KVP_TIER_NVME : KVP_ENOENT;
}

/* The ring's buffer index + 1 of the registered caller range holding
 * [p, p + len), 0 when none does (then a plain read pins the pages).
 * Caller holds rmu. */
static int ubuf_find(const tier_nvme *nv, uintptr_t p, size_t len) {
  uint32_t lo = 0, hi = nv->nubuf; /* first range with base > p */
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (nv->ubuf[mid].base <= p)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo == 0)
    return 0;
  const tier_ubuf *u = &nv->ubuf[lo - 1];
  return p - u->base <= u->len && len <= u->len - (p - u->base)
             ? (int)u->idx + 1
             : 0;
}

/* Block e's read: plaintext slots read their payload only, exactly the
 * block rounded up to the sector: straight into an aligned caller buffer
 * when it holds whole sectors (no copy), else into the read ring's staging.
 * Encrypted slots read header + payload (the IV and tag live in the
 * header).  Store lock held: the class's file is read from the table. */
static tio_op read_prep(const tier_nvme *nv, const tier_nread *e) {
  const tier_nclass *c = &nv->cls[e->ci];
  tio_op op = op_of(TIO_READ, c, e->slot, io_len(nv, e->len));
  op.file = c->rfile_idx;
  if (!alone(e))
    return op;
  op.off += nv->hdr_bytes;
  op.len -= nv->hdr_bytes;
  if (((uintptr_t)e->dst % nv->hdr_bytes) == 0 && e->len % nv->hdr_bytes == 0) {
    op.needs_buf = false;
    op.buf = e->dst; /* on a miss dst holds whatever was read */
  }
  return op;
}

void kvp__tier_nvme_unpin(tier_nvme *nv, int32_t ci, uint64_t slot) {
  slot_unpin(&nv->cls[ci], slot);
}

/* The I/O phase: under rmu alone (outer released unless the caller keeps
 * it); counts what it saw into r.  Returns the time the I/O took. */
static uint64_t read_run(tier_nvme *nv, tio_op *ops, size_t n, uint32_t qd,
                         rctx *r) {
  pthread_mutex_lock(&nv->rmu);
  for (size_t i = 0; i < n; i++)
    if (!ops[i].needs_buf)
      ops[i].user_buf = ubuf_find(nv, (uintptr_t)r->r[i].dst, ops[i].len);
  tio_pool pool = {.base = nv->rstage, .each = nv->stage_each, .n = nv->qd_max,
                   .fixed = nv->rfixed};
  uint64_t t0 = kvp_now_ns();
  kvp__tier_io_run(nv->rio, ops, n, qd, &pool, NULL, rdone, r);
  uint64_t dt = kvp_now_ns() - t0;
  pthread_mutex_unlock(&nv->rmu);
  return dt;
}

int kvp__tier_nvme_read(tier_nvme *nv, tier_nread *r, size_t n, uint32_t qd,
                        pthread_mutex_t *outer, tier_nvme_batch *b) {
  *b = (tier_nvme_batch){0};
  tio_op *ops = kvp__calloc(&nv->a, n, sizeof *ops);
  if (ops == NULL)
    return KVP_ENOMEM;
  for (size_t i = 0; i < n; i++) {
    r[i].fail = TIER_RF_NONE;
    ops[i] = read_prep(nv, &r[i]);
    nv->cls[r[i].ci].pins[r[i].slot]++; /* no write lands in it now */
    assert(nv->cls[r[i].ci].pins[r[i].slot] != 0);
  }
  if (outer != NULL)
    pthread_mutex_unlock(outer); /* the I/O and the checks run without it */
  rctx x = {.nv = nv, .r = r};
  b->ns = read_run(nv, ops, n, qd, &x);
  if (outer != NULL)
    pthread_mutex_lock(outer);
  nv->st.nvme_reads += x.reads;
  nv->st.nvme_reads_registered += x.reads_reg;
  nv->st.nvme_bytes_read += x.io_bytes;
  b->bytes = x.bytes;
  kvp__free(&nv->a, ops, n * sizeof *ops);
  return 0;
}

static int ubuf_cmp(const void *a, const void *b) {
  uintptr_t x = ((const tier_ubuf *)a)->base, y = ((const tier_ubuf *)b)->base;
  return (x > y) - (x < y);
}

/* The caller's ranges cut into pieces of at most 1 GiB (the kernel's limit
 * per registered buffer), sorted; KVP_EINVAL on an empty or overlapping
 * range. */
static int ubuf_build(tier_nvme *nv, const struct iovec *iov, unsigned n,
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
  tier_ubuf *u = kvp__calloc(&nv->a, (size_t)cnt, sizeof *u);
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
      kvp__free(&nv->a, u, (size_t)cnt * sizeof *u);
      return KVP_EINVAL;
    }
  *out = u;
  *np = k;
  return 0;
}

static void ubuf_clear(tier_nvme *nv) {
  kvp__free(&nv->a, nv->ubuf, (size_t)nv->nubuf * sizeof *nv->ubuf);
  nv->ubuf = NULL;
  nv->nubuf = 0;
}

static int register_locked(tier_nvme *nv, const struct iovec *iov,
                           unsigned n) {
  tier_ubuf *u = NULL;
  uint32_t k = 0, first = 0;
  int rc = n > 0 ? ubuf_build(nv, iov, n, &u, &k) : 0;
  if (rc < 0)
    return rc;
  if (nv->rio == NULL || !kvp__tier_io_is_uring(nv->rio)) {
    kvp__free(&nv->a, u, (size_t)k * sizeof *u);
    return 0; /* pread/pwrite: nothing to register, nothing changes */
  }
  ubuf_clear(nv);
  struct iovec *v = k > 0 ? kvp__calloc(&nv->a, k, sizeof *v) : NULL;
  if (k > 0 && v == NULL)
    rc = KVP_ENOMEM;
  for (uint32_t i = 0; v != NULL && i < k; i++)
    v[i] = (struct iovec){(void *)u[i].base, u[i].len};
  if (rc == 0)
    rc = kvp__tier_io_set_user_buffers(nv->rio, v, k, &first); /* reads */
  kvp__free(&nv->a, v, (size_t)k * sizeof *v);
  if (rc < 0) {
    KVP_LOGW("kvtier", "registering %u caller buffer ranges failed (%s): "
             "reads into them stay unregistered", n, kvp_strerror(rc));
    kvp__free(&nv->a, u, (size_t)k * sizeof *u);
    return rc;
  }
  for (uint32_t i = 0; i < k; i++)
    u[i].idx = first + i;
  nv->ubuf = u;
  nv->nubuf = k;
  return (int)n;
}

int kvp__tier_nvme_register(tier_nvme *nv, const struct iovec *iov,
                            unsigned n) {
  pthread_mutex_lock(&nv->rmu); /* no read runs: the read ring is idle */
  int rc = register_locked(nv, iov, n);
  pthread_mutex_unlock(&nv->rmu);
  return rc;
}

static void zprep(void *arg, size_t i, tio_op *op) {
  (void)i;
  memset(op->buf, 0, ((tier_nvme *)arg)->hdr_bytes);
}

void kvp__tier_nvme_free(tier_nvme *nv, uint32_t id, int32_t ci, uint64_t slot,
                         bool wipe, bool evicted) {
  tier_nclass *c = &nv->cls[ci];
  assert(c->owner[slot] == id);
  if (wipe) { /* so recovery does not bring an evicted block back */
    tio_op op = op_of(TIO_WRITE, c, slot, nv->hdr_bytes);
    tio_pool pool = pool_of(nv);
    kvp__tier_io_run(nv->io, &op, 1, 1, &pool, zprep, NULL, nv);
    if (op.res != (int)nv->hdr_bytes)
      nv->st.io_errors++;
  }
  kvp__tier_policy_remove(c->pol, id, evicted);
  slot_release(nv, c, slot);
}

/* Logs class c's first damage (what, at slot), once per slab file. */
static void damage_log(tier_nvme *nv, tier_nclass *c, uint64_t slot,
                       const char *what) {
  if (c->damage_logged)
    return;
  c->damage_logged = true;
  KVP_LOGW("kvtier", "%s/kvtier-%" PRIu64 ".slab: slot %" PRIu64 " %s; "
           "its header is zeroed (a miss, never wrong bytes; later damage in "
           "this file is counted in kvp_tier_stats, not logged)", nv->dir,
           c->cap, slot, what);
}

void kvp__tier_nvme_damaged(tier_nvme *nv, int32_t ci, uint64_t slot,
                            int fail) {
  static const char *const what[] = {
      [TIER_RF_SUM] = "failed its checksum",
      [TIER_RF_KEY] = "holds another block than the index says",
      [TIER_RF_AUTH] = "failed its AES-GCM tag (tampered, or the namespace's "
                       "key changed)"};
  assert(fail >= TIER_RF_SUM && fail <= TIER_RF_AUTH);
  damage_log(nv, &nv->cls[ci], slot, what[fail]);
  nv->st.slots_wiped++;
}

/* Zeroes the headers of class c's slots[0..n) (damaged, found by
 * recovery). */
static void wipe_slots(tier_nvme *nv, tier_nclass *c, const uint64_t *slots,
                       size_t n, tio_op *ops) {
  for (size_t i = 0; i < n; i++)
    ops[i] = op_of(TIO_WRITE, c, slots[i], nv->hdr_bytes);
  tio_pool pool = pool_of(nv);
  kvp__tier_io_run(nv->io, ops, n, nv->qd_max, &pool, zprep, NULL, nv);
  for (size_t i = 0; i < n; i++)
    if (ops[i].res == (int)nv->hdr_bytes)
      nv->st.slots_wiped++;
    else
      nv->st.io_errors++;
}

void kvp__tier_nvme_touch(tier_nvme *nv, int32_t ci, uint32_t id) {
  kvp__tier_policy_touch(nv->cls[ci].pol, id);
}

/* ---- open / recovery ---------------------------------------------------------*/
typedef struct scanctx {
  tier_nvme *nv;
  int32_t ci;
  uint64_t base;
  tier_nvme_found_fn fn;
  void *arg;
  uint64_t *bad; /* slots to wipe (this chunk's) */
  size_t nbad;
} scanctx;

/* A slot whose header is damaged: counted, logged once per file, wiped
 * after the chunk -- unless it is a newer format's (not ours to judge). */
static void recover_bad(scanctx *s, uint64_t slot, const uint8_t *hb) {
  tier_nvme *nv = s->nv;
  uint32_t magic;
  uint16_t ver;
  memcpy(&magic, hb, 4); /* little-endian hosts only (the format's order) */
  memcpy(&ver, hb + 4, 2);
  nv->st.recovery_bad_slots++;
  if (magic == TIER_HDR_MAGIC && ver > TIER_HDR_VERSION)
    return;
  damage_log(nv, &nv->cls[s->ci], slot, "has a damaged header (recovery)");
  s->bad[s->nbad++] = slot;
}

static void recover_slot(scanctx *s, uint64_t slot, const tier_slot_hdr *h,
                         const uint8_t *hb) {
  tier_nvme *nv = s->nv;
  tier_nclass *c = &nv->cls[s->ci];
  if (kvp__tier_class_bytes(h->len) != c->cap) {
    recover_bad(s, slot, hb);
    return;
  }
  if (h->epoch > nv->epoch)
    nv->epoch = h->epoch;
  kvp_class cls = KVP_CLASS_VOLATILE;
  uint32_t id = s->fn(s->arg, h, s->ci, slot, &cls);
  if (id == TIER_NIL)
    return; /* the same block twice (one slot kept), or no memory */
  c->owner[slot] = id;
  nv->used += c->cap;
  kvp__tier_policy_insert(c->pol, id, h->key.lo ^ h->ns.lo, c->cap, cls);
}

static void sdone(void *arg, size_t i, tio_op *op) {
  scanctx *s = arg;
  tier_slot_hdr h;
  if (op->res != (int)op->len) {
    s->nv->st.io_errors++;
  } else if (kvp__tier_hdr_decode(op->buf, TIER_HDR_BYTES, &h) == 0) {
    recover_slot(s, s->base + i, &h, op->buf);
  } else if (((uint8_t *)op->buf)[0] != 0) {
    recover_bad(s, s->base + i, op->buf); /* not wiped or never written */
  }
}

/* A file whose size is not a whole number of slots was cut short: a last
 * slot whose header is intact is a lost block (counted, logged); the cut
 * tail is dropped, so the next open does not count it again. */
static void recover_tail(tier_nvme *nv, tier_nclass *c, uint64_t slots,
                         uint64_t size) {
  if (size % c->slot_bytes == 0)
    return;
  tio_op op = op_of(TIO_READ, c, slots, nv->hdr_bytes);
  tio_pool pool = pool_of(nv);
  kvp__tier_io_run(nv->io, &op, 1, 1, &pool, NULL, NULL, NULL);
  tier_slot_hdr h;
  bool lost = op.res == (int)nv->hdr_bytes &&
              kvp__tier_hdr_decode(op.buf, TIER_HDR_BYTES, &h) == 0;
  nv->st.recovery_truncated_blocks += lost;
  KVP_LOGW("kvtier", "%s/kvtier-%" PRIu64 ".slab: truncated (%" PRIu64
           " bytes past its last whole slot%s); the tail is dropped", nv->dir,
           c->cap, size % c->slot_bytes, lost ? ": 1 block lost" : "");
  if (ftruncate(c->fd, (off_t)(slots * c->slot_bytes)) != 0)
    nv->st.io_errors++;
}

static int recover_class(tier_nvme *nv, int32_t ci, tier_nvme_found_fn fn,
                         void *arg) {
  tier_nclass *c = &nv->cls[ci];
  struct stat sb;
  if (fstat(c->fd, &sb) != 0)
    return -errno;
  uint64_t slots = (uint64_t)sb.st_size / c->slot_bytes;
  recover_tail(nv, c, slots, (uint64_t)sb.st_size);
  c->nslots = 0;
  int rc = class_grow(nv, c, slots); /* adopts the existing slots */
  if (rc < 0 || slots == 0)
    return rc;
  enum { CHUNK = 1024 };
  tio_op *ops = kvp__calloc(&nv->a, CHUNK, sizeof *ops);
  uint64_t *bad = kvp__calloc(&nv->a, CHUNK, sizeof *bad);
  if (ops == NULL || bad == NULL)
    rc = KVP_ENOMEM;
  tio_pool pool = pool_of(nv);
  for (uint64_t at = 0; rc == 0 && at < slots; at += CHUNK) {
    size_t n = slots - at < CHUNK ? (size_t)(slots - at) : CHUNK;
    for (size_t i = 0; i < n; i++)
      ops[i] = op_of(TIO_READ, c, at + i, nv->hdr_bytes);
    scanctx sc = {nv, ci, at, fn, arg, bad, 0};
    kvp__tier_io_run(nv->io, ops, n, nv->qd_max, &pool, NULL, sdone, &sc);
    wipe_slots(nv, &nv->cls[ci], bad, sc.nbad, ops);
  }
  kvp__free(&nv->a, ops, ops ? CHUNK * sizeof *ops : 0);
  kvp__free(&nv->a, bad, bad ? CHUNK * sizeof *bad : 0);
  if (rc < 0)
    return rc;
  c = &nv->cls[ci];
  c->nfree = 0; /* rebuild the free stack from the owners */
  for (uint64_t s = slots; s-- > 0;)
    if (c->owner[s] == TIER_NIL)
      c->free[c->nfree++] = s;
  return 0;
}

static int recover(tier_nvme *nv, tier_nvme_found_fn fn, void *arg) {
  DIR *d = fdopendir(dup(nv->dirfd));
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
    if (cap + nv->hdr_bytes > nv->stage_each) {
      KVP_LOGW("kvtier", "%s/%s: blocks larger than max_block_bytes; not "
               "recovered (raise max_block_bytes to read them)", nv->dir,
               de->d_name);
      continue;
    }
    int32_t ci;
    rc = class_open(nv, cap, false, &ci);
    if (rc == 0)
      rc = recover_class(nv, ci, fn, arg);
  }
  closedir(d);
  return rc;
}

static uint64_t fs_free(int dirfd) {
  struct statvfs v;
  return fstatvfs(dirfd, &v) == 0 ? (uint64_t)v.f_bavail * v.f_frsize : 0;
}

/* O_DIRECT on the directory's file system (tmpfs refuses it). */
static int probe_direct(tier_nvme *nv) {
  int fd = openat(nv->dirfd, ".", O_TMPFILE | O_RDWR | O_DIRECT, 0600);
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR))
    return 0; /* no O_TMPFILE here: class files will tell */
  if (fd < 0) {
    KVP_LOGE("kvtier", "nvme_dir %s: O_DIRECT refused (%s); tmpfs cannot hold "
             "the NVMe tier: use a directory on a disk (e.g. /var/tmp)",
             nv->dir, strerror(errno));
    return KVP_ENOTSUP;
  }
  struct statfs fs;
  if (fstatfs(fd, &fs) == 0 && fs.f_type == TMPFS_MAGIC)
    KVP_LOGW("kvtier", "nvme_dir %s is on tmpfs: accepted (this kernel takes "
             "O_DIRECT there), but the NVMe tier then lives in RAM / swap, "
             "not on a disk", nv->dir);
  struct statx sx;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 &&
      (sx.stx_mask & STATX_DIOALIGN) && sx.stx_dio_offset_align > 4096)
    nv->hdr_bytes = sx.stx_dio_offset_align;
  close(fd);
  return 0;
}

static uint64_t slow_ns(const kvp_tier_opts *o) {
  return (o->slow_io_us ? o->slow_io_us : 100000) * UINT64_C(1000);
}

/* Both rings and their staging (the write ring's registered when allowed). */
static int open_rings(tier_nvme *nv, const kvp_tier_opts *o) {
  int rc;
  uint64_t maxb = o->max_block_bytes ? o->max_block_bytes : (UINT64_C(4) << 20);
  nv->stage_each = round_up(nv->hdr_bytes + kvp__tier_class_bytes(maxb), 4096);
  nv->stage_len = round_up(nv->stage_each * (nv->qd_max + 1), UINT64_C(2) << 20);
  void *p = mmap(NULL, nv->stage_len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return KVP_ENOMEM;
  nv->stage = p;
  if ((rc = kvp__tier_io_create(o->io_backend, nv->qd_max, o->io_filter,
                                o->io_filter_opaque, &nv->a, &nv->io)) < 0)
    return rc;
  kvp__tier_io_set_slow(nv->io, slow_ns(o));
  nv->fixed_bufs = kvp__tier_io_register_buffers(nv->io, nv->stage,
                                                 nv->stage_each, nv->qd_max + 1);
  /* the read ring: same backend as the write ring, its own staging */
  p = mmap(NULL, nv->stage_len, PROT_READ | PROT_WRITE,
           MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return KVP_ENOMEM;
  nv->rstage = p;
  kvp_tier_io_backend rb = kvp__tier_io_is_uring(nv->io) ? KVP_TIER_IO_URING
                                                         : KVP_TIER_IO_POSIX;
  if ((rc = kvp__tier_io_create(rb, nv->qd_max, o->io_filter,
                                o->io_filter_opaque, &nv->a, &nv->rio)) < 0)
    return rc;
  kvp__tier_io_set_slow(nv->rio, slow_ns(o));
  /* Its staging is NOT registered: that would pin another qd x max block
   * bytes (128 MiB by default) for the reads only unaligned or encrypted
   * blocks take (registered caller buffers and fio's --fixedbufs changed
   * nothing measurable on this VM: README; this path itself not
   * measured).  Caller ranges (kvp_tier_register_buffers) are registered. */
  nv->rfixed = false;
  return 0;
}

static int open_dir(tier_nvme *nv, const kvp_tier_opts *o) {
  int rc;
  nv->hdr_bytes = 4096;
  nv->dirfd = open(nv->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (nv->dirfd < 0) {
    rc = -errno;
    KVP_LOGE("kvtier", "nvme_dir %s: %s", nv->dir, strerror(errno));
    return rc;
  }
  if ((rc = probe_direct(nv)) < 0)
    return rc;
  nv->cap = o->nvme_bytes;
  if (nv->cap == 0) {
    double f = o->nvme_fraction > 0 ? o->nvme_fraction : 0.5;
    nv->cap = (uint64_t)(f * (double)fs_free(nv->dirfd));
  }
  return 0;
}

int kvp__tier_nvme_open(const kvp_tier_opts *o, const char *dir,
                        uint32_t qd_max, const kvp_allocator *a,
                        tier_nvme_found_fn fn, void *arg, tier_nvme **out) {
  tier_nvme *nv = kvp__calloc(a, 1, sizeof *nv);
  if (nv == NULL)
    return KVP_ENOMEM;
  *nv = (tier_nvme){.a = kvp__allocator(a), .policy = o->policy, .dir = dir,
                    .dirfd = -1, .qd_max = qd_max};
  pthread_mutex_init(&nv->rmu, NULL);
  int rc = open_dir(nv, o);
  if (rc == 0)
    rc = open_rings(nv, o);
  if (rc == 0 && ((nv->cctx = EVP_CIPHER_CTX_new()) == NULL ||
                  (nv->rcctx = EVP_CIPHER_CTX_new()) == NULL))
    rc = KVP_ENOMEM;
  if (rc == 0)
    rc = recover(nv, fn, arg);
  if (rc < 0) {
    kvp__tier_nvme_close(nv);
    return rc;
  }
  *out = nv;
  return 0;
}

void kvp__tier_nvme_close(tier_nvme *nv) {
  if (nv == NULL)
    return;
  for (uint32_t i = 0; i < nv->ncls; i++) {
    tier_nclass *c = &nv->cls[i];
    close(c->fd);
    kvp__tier_policy_destroy(c->pol);
    kvp__free(&nv->a, c->owner, c->nslots * sizeof *c->owner);
    kvp__free(&nv->a, c->free, c->nslots * sizeof *c->free);
    kvp__free(&nv->a, c->pins, c->nslots * sizeof *c->pins);
    kvp__free(&nv->a, c->zombie, c->nslots);
  }
  kvp__free(&nv->a, nv->cls, nv->ncls * sizeof *nv->cls);
  kvp__tier_io_destroy(nv->io);
  kvp__tier_io_destroy(nv->rio);
  ubuf_clear(nv);
  if (nv->stage != NULL)
    munmap(nv->stage, nv->stage_len);
  if (nv->rstage != NULL)
    munmap(nv->rstage, nv->stage_len);
  EVP_CIPHER_CTX_free(nv->cctx);
  EVP_CIPHER_CTX_free(nv->rcctx);
  if (nv->dirfd > 0)
    close(nv->dirfd);
  pthread_mutex_destroy(&nv->rmu);
  kvp_allocator a = nv->a;
  kvp__free(&a, nv, sizeof *nv);
}

int kvp__tier_nvme_set_policy(tier_nvme *nv, kvp_tier_policy_kind k,
                              tier_nvme_info_fn fn, void *arg) {
  nv->policy = k; /* classes opened from now on */
  for (uint32_t i = 0; i < nv->ncls; i++) {
    tier_nclass *c = &nv->cls[i];
    tier_policy *np;
    int rc = kvp__tier_policy_create(k, &nv->a, &np);
    if (rc < 0)
      return rc;
    for (uint64_t s = 0; s < c->nslots; s++)
      if (c->owner[s] != TIER_NIL) {
        uint64_t fp;
        kvp_class cls;
        fn(arg, c->owner[s], &fp, &cls);
        kvp__tier_policy_insert(np, c->owner[s], fp, c->cap, cls);
      }
    kvp__tier_policy_destroy(c->pol);
    c->pol = np;
  }
  return 0;
}

void kvp__tier_nvme_set_cap(tier_nvme *nv, uint64_t bytes) { nv->cap = bytes; }

uint64_t kvp__tier_nvme_cap(const tier_nvme *nv) { return nv->cap; }

void kvp__tier_nvme_stats(tier_nvme *nv, kvp_tier_stats *out) {
  const kvp_tier_stats *s = &nv->st;
  out->nvme_writes += s->nvme_writes;
  out->nvme_reads += s->nvme_reads;
  out->nvme_reads_registered += s->nvme_reads_registered;
  out->nvme_bytes_written += s->nvme_bytes_written;
  out->nvme_bytes_read += s->nvme_bytes_read;
  out->io_errors += s->io_errors;
  out->short_io += s->short_io;
  out->recovery_bad_slots += s->recovery_bad_slots;
  out->slots_wiped += s->slots_wiped;
  out->recovery_truncated_blocks += s->recovery_truncated_blocks;
  out->nvme_used_bytes = nv->used;
  out->nvme_bytes = nv->cap;
  out->io_uring = kvp__tier_io_is_uring(nv->io);
  out->fixed_buffers = nv->fixed_bufs;
  out->slow_io = kvp__tier_io_slow_count(nv->io);
  pthread_mutex_lock(&nv->rmu); /* the read ring's counter */
  out->slow_io += kvp__tier_io_slow_count(nv->rio);
  pthread_mutex_unlock(&nv->rmu);
}
