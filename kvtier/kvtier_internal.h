/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier internals shared by the store, the DRAM region, the slab format
 * and the I/O backends.  The placement objects (kvtier_place.h), the index
 * (kvtier_table.h) and the NVMe tier (kvtier_nvme.h) have headers of their
 * own.  Not installed. */
#ifndef KVP_KVTIER_INTERNAL_H
#define KVP_KVTIER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <sys/uio.h>

#include "kvplane/tier.h"
#include "kvtier_place.h"
#include "kvtier_table.h"

/* ---- on-disk slot header (golden vectors in tests/test_tier_format.c) -----
 * Every slab slot starts with a header sector (hdr_bytes = max(512, the
 * file's O_DIRECT alignment)) whose first 128 bytes are, little-endian:
 *   0  u32 magic "KVPS"          4  u16 version (1)    6  u16 flags
 *   8  u32 header bytes (128)    12 u32 zero
 *   16 u64 ns.hi  24 u64 ns.lo   32 u64 key.hi  40 u64 key.lo
 *   48 u64 payload length        56 u64 epoch (store-wide, increasing)
 *   64 u8[12] GCM IV             76 u32 zero
 *   80 u8[16] GCM tag            96 u64 XXH3-64 of the stored payload
 *   104 16 zero bytes            120 u64 XXH3-64 of bytes [0,120)
 * The rest of the sector is zero; the payload (ciphertext when encrypted)
 * follows, zero-padded to the slot's payload capacity. */
#define TIER_HDR_BYTES 128u
#define TIER_HDR_MAGIC 0x5350564bu /* "KVPS" little-endian */
#define TIER_HDR_VERSION 1u
#define TIER_HDR_F_AESGCM 1u

typedef struct tier_slot_hdr {
  uint16_t flags;
  kvp_key ns, key;
  uint64_t len, epoch;
  uint8_t iv[12];
  uint8_t tag[16];
  uint64_t payload_sum;
} tier_slot_hdr;

void kvp__tier_hdr_encode(const tier_slot_hdr *h, uint8_t out[TIER_HDR_BYTES]);
/* 0, KVP_ETRUNC (n < 128), KVP_ECORRUPT (bad magic/version/size/flags/
 * reserved bytes/checksum, zero length).  Never reads past n. */
int kvp__tier_hdr_decode(const uint8_t *buf, size_t n, tier_slot_hdr *out);
uint64_t kvp__tier_payload_sum(const void *p, size_t n);
/* Payload capacity (size class) of a block of len bytes: multiples of 4 KiB,
 * four classes per power of two above 16 KiB (<= 25% padding). */
uint64_t kvp__tier_class_bytes(uint64_t len);

/* Recovery scan of a slab image already in memory (the fuzz target's entry):
 * calls fn for every slot whose header decodes; returns slots scanned. */
typedef void (*tier_scan_fn)(void *arg, uint64_t slot, const tier_slot_hdr *h);
uint64_t kvp__tier_scan_image(const uint8_t *img, size_t n, uint64_t slot_bytes,
                              tier_scan_fn fn, void *arg);

/* ---- DRAM region --------------------------------------------------------- */
typedef struct tier_dram tier_dram;
int kvp__tier_dram_create(uint64_t bytes, kvp_tier_huge huge,
                          const kvp_allocator *a, tier_dram **out);
void kvp__tier_dram_destroy(tier_dram *d);
/* A block of len bytes: a fixed-size slot when len == fixed (> 0), else a
 * size class's slot (up to 256 KiB) or a run of 64 KiB pages; 64-byte
 * aligned.  Sets *pool and *charged (bytes counted against the DRAM
 * capacity).  NULL when the region has no room. */
void *kvp__tier_dram_alloc(tier_dram *d, size_t len, uint64_t fixed,
                           uint32_t *pool, uint64_t *charged);
void kvp__tier_dram_free(tier_dram *d, void *p, uint32_t pool);
void kvp__tier_dram_region(const tier_dram *d, void **base, size_t *len);
int kvp__tier_dram_huge(const tier_dram *d);
uint64_t kvp__tier_dram_slot_bytes(const tier_dram *d);

/* ---- the host's default DRAM budget (tier_host.c) ------------------------
 * claim: this store's share of fraction x avail (bytes), recorded in the
 * host registry (*registered: release it at destroy).  0, or KVP_ENOSPC
 * (logged: the budget is taken).  A registry that cannot be opened is
 * logged and the store sized alone, as before. */
int kvp__tier_host_claim(double fraction, uint32_t stores, uint64_t avail,
                         uint64_t *bytes, bool *registered);
void kvp__tier_host_release(uint64_t bytes);

/* ---- I/O: io_uring or POSIX behind one streaming batch call -------------*/
enum { TIO_READ = 0, TIO_WRITE = 1, TIO_SYNC = 2 };
typedef struct tio_op {
  uint8_t op;
  bool needs_buf; /* take a staging buffer before prep */
  bool skipped;   /* set by the layer: prep failed or the ring broke */
  bool inflight;  /* set by the layer */
  bool prepped;   /* the layer's: buffer taken and prep run ahead, while
                     the queue was full */
  int fd;         /* real descriptor */
  int file;       /* registered file index, -1 none */
  void *buf;
  uint32_t len;
  int buf_index;  /* registered buffer index, -1 none (set by the layer) */
  int user_buf;   /* buf lies in registered buffer user_buf - 1, a caller
                     range (kvp_tier_register_buffers); 0: none */
  int pool_idx;   /* staging buffer held, -1 none (set by the layer) */
  uint64_t off;
  /* reads only: a second segment (the caller's buffer, so the payload is
   * not copied); the op then reads len + len2 bytes */
  void *buf2;
  uint32_t len2;
  struct iovec iov[2]; /* the layer's */
  uint64_t t_start;    /* the layer's: submission time */
  int res;        /* bytes or -errno, after the filter; prep may preset an
                     error (< 0) to skip the I/O */
} tio_op;

/* Staging buffers ops borrow while in flight (registered with io_uring when
 * possible). */
typedef struct tio_pool {
  uint8_t *base;
  size_t each;
  uint32_t n;
  bool fixed;
} tio_pool;

/* prep(arg, i, op): op i got its buffer and is about to be submitted (fill
 * the buffer for a write; set op->res < 0 to skip it).  done(arg, i, op):
 * op i completed (res final); its buffer is reused after done returns. */
typedef void (*tio_cb)(void *arg, size_t i, tio_op *op);

typedef struct tier_io tier_io;
int kvp__tier_io_create(kvp_tier_io_backend b, uint32_t qd,
                        kvp_tier_io_filter filter, void *fopaque,
                        const kvp_allocator *a, tier_io **out);
void kvp__tier_io_destroy(tier_io *io);
bool kvp__tier_io_is_uring(const tier_io *io);
/* Operations slower than slow_ns so far (the store's stats.slow_io). */
void kvp__tier_io_set_slow(tier_io *io, uint64_t slow_ns);
uint64_t kvp__tier_io_slow_count(const tier_io *io);
/* Registered buffers/files (io_uring only; false / -1 when not possible). */
bool kvp__tier_io_register_buffers(tier_io *io, void *base, size_t each,
                                   uint32_t n);
int kvp__tier_io_register_file(tier_io *io, int fd);
/* Caller ranges (io_uring only): KVP_ENOTSUP on POSIX; else as
 * kvp__tier_uring_set_user_buffers. */
int kvp__tier_io_set_user_buffers(tier_io *io, const struct iovec *iov,
                                  uint32_t n, uint32_t *first);
/* Runs ops[0..n) with up to qd in flight (and no more than the pool's
 * buffers), refilling the queue as completions arrive.  With a buffer to
 * spare (a pool of qd + 1), the next op is prepped while the queue is full,
 * so a write's staging (copy, checksum, encryption) overlaps the writes in
 * flight even at depth 1.  Returns 0, or a ring error after which the
 * unfinished ops carry that error. */
int kvp__tier_io_run(tier_io *io, tio_op *ops, size_t n, uint32_t qd,
                     const tio_pool *pool, tio_cb prep, tio_cb done, void *arg);

/* io_uring backend (kvtier/uring/); KVP_ENOTSUP when built without it. */
typedef struct tier_uring tier_uring;
int kvp__tier_uring_create(uint32_t entries, const kvp_allocator *a,
                           tier_uring **out);
void kvp__tier_uring_destroy(tier_uring *u);
bool kvp__tier_uring_register_buffers(tier_uring *u, void *base, size_t each,
                                      uint32_t n);
/* Replaces the caller's registered ranges (kvp_tier_register_buffers) by
 * iov[0, n) (n 0: none); the staging buffers stay.  *first: the buffer
 * index of iov[0].  0, KVP_ERANGE (table full), or the kernel's -errno
 * (then no caller range is registered). */
#define TIER_URING_BUFS_MAX 16384u /* the kernel's IORING_MAX_REG_BUFFERS */
int kvp__tier_uring_set_user_buffers(tier_uring *u, const struct iovec *iov,
                                     uint32_t n, uint32_t *first);
int kvp__tier_uring_register_file(tier_uring *u, int fd);
/* Queues op (tag comes back with its completion); KVP_EBUSY: ring full. */
int kvp__tier_uring_queue(tier_uring *u, tio_op *op, uint64_t tag);
/* Submits what is queued without waiting (errors show at the next reap). */
void kvp__tier_uring_submit(tier_uring *u);
/* Submits what is queued, waits for >= 1 completion (unless some are
 * already there), hands each to cb.
 * Returns completions seen or a negative ring error. */
typedef void (*tier_uring_cb)(void *arg, uint64_t tag, int res);
int kvp__tier_uring_reap(tier_uring *u, tier_uring_cb cb, void *arg);

/* ---- the store (tier_store.c; its index: kvtier_table.h; its NVMe tier:
 * kvtier_nvme.h) ----------------------------------------------------------- */
#include <pthread.h>
#include <stdatomic.h>

typedef struct tier_ns {
  kvp_key seed;
  uint64_t block_bytes;
  bool enc;
  uint8_t key[32];
  double prefill_bps; /* kvp_tier_ns_opts.prefill_kv_bytes_per_s */
} tier_ns;

typedef struct tier_job tier_job;
typedef struct tier_nvme tier_nvme; /* kvtier_nvme.h */

/* A DRAM slot whose entry left DRAM while in-place loads still read it:
 * returned to the region when the last of them unpins it. */
typedef struct tier_dfree {
  void *p;
  uint64_t charge;
  uint32_t pool, pins;
} tier_dfree;

/* Locks: mu guards the store (index, DRAM, the NVMe tier's calls); the NVMe
 * tier's read lock guards its read ring.  Order: mu before the read lock;
 * whoever holds the read lock alone (a batch's NVMe reads, run with mu
 * released) never takes mu.  jmu (the job queue) is taken after mu or
 * alone. */
struct kvp_tier_store {
  kvp_allocator a;
  pthread_mutex_t mu; /* everything below but the job queue; before jmu; a
                       * link's zero-copy load holds it over a kvp_device
                       * scatter: link mu, then mu, then the device's */
  kvp_tier_opts o;
  char *dir;
  /* DRAM */
  tier_dram *dram;
  uint64_t dram_cap, dram_used, dram_region; /* dram_cap: the cascade's */
  tier_cascade *cas; /* DRAM's policy, its victims' way to NVMe, the gate */
  bool registered; /* dram_register succeeded: unregister at destroy */
  bool host_claimed; /* dram_cap's first value is a claim in the host
                        registry (tier_host.c): release at destroy */
  uint64_t host_bytes;
  /* NVMe (NULL: none) and the options its calls take */
  tier_nvme *nv;
  uint32_t qd, qd_max;
  uint64_t nvme_cap;   /* KVP_TIER_OPT_NVME_BYTES (the tier's, when there) */
  bool reads_locked;   /* KVP_TIER_OPT_READ_UNLOCKED 0: keep mu during reads */
  bool no_stage_ahead; /* KVP_TIER_OPT_STAGE_AHEAD 0 */
  bool scatter_locked; /* KVP_TIER_OPT_LOAD_UNLOCKED 0 */
  tier_table tbl; /* (ns, key) -> entry */
  tier_ns *nss;
  uint32_t nns;
  uint64_t ev_epoch; /* the events' epoch (kvp_tier_epoch): creation time */
  uint64_t seq;      /* the last event's number in ev_epoch */
  /* pinned DRAM slots: npinned pins outstanding (on entries' dpin or on
   * dfree); dfree_cap >= npinned, so a release never allocates */
  uint32_t npinned, ndfree, dfree_cap;
  tier_dfree *dfree;
  kvp_tier_stats st;
  double bw[KVP_TIER_COUNT_];
  double bw_write;     /* NVMe writes, bytes/s (EWMA); 0: none yet */
  /* async */
  pthread_mutex_t jmu;
  pthread_cond_t jcv, dcv;
  tier_job *jhead, *jtail;
  pthread_t thr;
  bool thr_on, stop;
};

/* tier_store.c, used by tier_device.c (store lock held) */
const tier_ns *kvp__tier_ns_find(const kvp_tier_store *t, kvp_key seed);

/* In-place loads: pins keep DRAM slots from being reused (an entry that
 * leaves DRAM meanwhile hands its slot to dfree) while a device reads them
 * with the store lock released.  pin_room: room for n more pins (false: out
 * of memory; pin nothing).  unpin takes the pointer the pin was taken on. */
bool kvp__tier_pin_room(kvp_tier_store *t, uint32_t n);
void kvp__tier_pin(kvp_tier_store *t, uint32_t id);
void kvp__tier_unpin(kvp_tier_store *t, uint32_t id, const void *p);

/* Saves straight into DRAM: reserve slots, fill them (a device gather) with
 * the lock released, commit.  A reserved slot is in no index, policy or
 * event until commit, so readers never see it and eviction never takes it;
 * cancel returns it.  res[i] after reserve: 0 reserved (r[i].p), 1 already
 * stored (put's duplicate rules ran: class, durable), or put's error. */
typedef struct tier_resv {
  void *p;
  uint64_t charge;
  uint32_t pool;
} tier_resv;
void kvp__tier_reserve(kvp_tier_store *t, kvp_key ns, const kvp_key *keys,
                       size_t n, uint64_t len, const kvp_tier_put_opts *po,
                       tier_resv *r, int *res);
/* Publishes the reserved blocks (res[i] 0) as puts of keys[i] would, and
 * sets res[i] as put's result (1 or an error: the slot is then returned). */
void kvp__tier_commit(kvp_tier_store *t, kvp_key ns, const kvp_key *keys,
                      size_t n, uint64_t len, const kvp_tier_put_opts *po,
                      tier_resv *r, int *res);
void kvp__tier_cancel(kvp_tier_store *t, tier_resv *r, const int *res,
                      size_t n);

#endif /* KVP_KVTIER_INTERNAL_H */
