/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane kvtier: the engine-side KV block store.  A serving engine keeps
 * the KV blocks it can no longer hold in HBM here: warm in one host DRAM
 * region (mmap, huge pages, registrable as pinned memory), cold in
 * log-structured slab files on NVMe (io_uring + O_DIRECT, pread/pwrite
 * fallback), evicted when dead.
 *
 * Invariants:
 * - A block is named by (namespace seed, 128-bit key).  Everything that
 *   returns bytes compares BOTH in full; a fingerprint collision is a miss,
 *   never another block's bytes.
 * - Blocks are immutable: a key names one content (it hashes its whole
 *   prefix), so a put of a key already stored is a no-op.
 * - Every NVMe read verifies the slot header and the payload checksum
 *   (XXH3-64) and, for encrypted namespaces, the AES-256-GCM tag.  Any
 *   failure is a miss; the slot is dropped and the failure counted.
 * - Durability: a block is durable once (a) kvp_tier_put() with
 *   KVP_TIER_PUT_DURABLE returned 1 (the slot -- header and payload in one
 *   O_DIRECT write -- was written and the slab file fdatasync'ed before
 *   returning), or (b) it was on NVMe when kvp_tier_sync() returned 0.
 *   Durable blocks survive a crash (SIGKILL, power loss with honest
 *   flushes) until they are evicted.  DRAM-only blocks never survive.
 */
#ifndef KVPLANE_TIER_H
#define KVPLANE_TIER_H

#include <sys/uio.h> /* struct iovec (kvp_tier_register_buffers) */

#include "kvplane/common.h"
#include "kvplane/config.h"
#include "kvplane/device.h"
#include "kvplane/prefix.h"
#include "kvplane/text.h" /* kvp_write_fn (kvp_tier_prometheus_write) */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvp_tier_store kvp_tier_store; /* the store (DESIGN: kvp_tier) */
typedef struct kvp_ticket kvp_ticket;         /* an asynchronous completion */

/* ---- policies and admission: the values kvp_tier_opts names --------------
 * The eviction policies (over the store's entry ids; stability aware: every
 * victim comes from the least stable class that has entries -- volatile,
 * then semi-stable, then stable -- so stable blocks are the last to go) and
 * the NVMe admission gate are kvtier internals (kvtier/kvtier_place.h),
 * which kvplane-bench's simulator links. */
typedef enum kvp_tier_policy_kind {
  /* default: on kvplane-bench's replays of the bundled multi-turn and
   * agentic traces LRU reuses as much or more than S3-FIFO at every DRAM
   * size (README, "Which eviction policy") */
  KVP_TIER_POLICY_LRU = 0,
  KVP_TIER_POLICY_S3FIFO = 1, /* scan resistant (Yang et al. 2023) */
  KVP_TIER_POLICY_COUNT_ = 2
} kvp_tier_policy_kind;

/* "s3fifo" | "lru" <-> kind.  parse: 0 or KVP_EINVAL.  name: "unknown" for a
 * bad value. */
KVP_API int kvp_tier_policy_parse(const char *name, kvp_tier_policy_kind *out);
KVP_API const char *kvp_tier_policy_name(kvp_tier_policy_kind kind);

/* The NVMe admission gate decides whether a block leaving DRAM (demotion
 * under pressure, or an idle write-back) is written to NVMe: only when its
 * expected reuse pays for the write,
 *
 *     p_reuse(cls, hits) * (recompute_s - read_s) >= write_weight * write_s
 *
 * recompute_s: the block's prefill time; read_s / write_s: its NVMe read /
 * write time (bytes / bandwidth).  p_reuse is learned online per cell =
 * (stability class, reuses so far: 0, 1, 2 or more) from outcomes: a block
 * written to NVMe counts 1 when it is read back before it leaves NVMe, 0
 * when it leaves unread; a rejected block is remembered by fingerprint (a
 * ghost) and counts 1 when its key is asked for again while remembered (a
 * miss, or a put: it was recomputed), 0 when a newer reject takes its place.
 * Counts decay (halved past a window of 1024); the estimate is
 * (reused + 1) / (outcomes + 2).  Until a cell has admit_min_samples
 * outcomes, or while recompute_s is unknown, the class rule
 * decides: semi-stable and stable blocks, volatile ones only after
 * volatile_nvme_min_hits reuses (write-through-selective).  The exact rule
 * is kvp__tier_admit_decide in kvtier/kvtier_place.h. */
typedef enum kvp_tier_admission {
  KVP_TIER_ADMIT_GATE = 0, /* default: the gate above */
  KVP_TIER_ADMIT_HITS = 1, /* rule 1 always (semi/stable, volatile after
                              volatile_nvme_min_hits reuses) */
  KVP_TIER_ADMIT_ALL = 2,  /* every block (baseline: no selection) */
  KVP_TIER_ADMIT_COUNT_ = 3
} kvp_tier_admission;

/* "gate" | "hits" | "all" <-> kind; parse: 0 or KVP_EINVAL; name:
 * "unknown" for a bad value. */
KVP_API int kvp_tier_admission_parse(const char *name, kvp_tier_admission *out);
KVP_API const char *kvp_tier_admission_name(kvp_tier_admission a);

/* ---- events (the schema include/kvplane/index.h ingests) -------------------
 * One per block entering or leaving a tier; `seq` numbers this store's
 * events consecutively from 1 within its `epoch`, so a connector can pass
 * them straight to kvp_index_src_stored(ix, &(kvp_index_src){worker, stream,
 * epoch, seq}, tier, NULL, &key, 1) / kvp_index_src_removed().  The epoch is
 * the store's creation time (CLOCK_REALTIME, ns; larger than the previous
 * store's on this host unless the clock went back, and strictly increasing
 * across the stores of one process): a store reopened on the
 * same files after a restart numbers its events from 1 again in a new epoch,
 * and the index drops the old epoch's residency instead of dropping the new
 * events as stale.  kvp_tier_keys_each() then lists what the reopened store
 * holds, to rebuild its residency (kvp_index_src_resync).  Called with the
 * store's lock held: do not call back into the store; `ev` is valid during
 * the call only. */
typedef struct kvp_tier_event {
  uint64_t seq;
  kvp_tier tier;    /* KVP_TIER_DRAM or KVP_TIER_NVME */
  int stored;       /* 1 stored, 0 removed */
  kvp_key ns;       /* namespace seed */
  kvp_key key;
  uint64_t bytes;
  uint64_t epoch;   /* this store's epoch (kvp_tier_epoch) */
} kvp_tier_event;
typedef void (*kvp_tier_event_fn)(void *opaque, const kvp_tier_event *ev);

/* ---- injectable I/O filter (fault injection, tracing) ----------------------
 * Called after every NVMe read/write/sync completes, on both backends, with
 * the kernel's result (bytes or -errno); returns the result the store acts
 * on (e.g. -EIO, -ENOSPC, fewer bytes, or the same after a sleep).  May
 * corrupt `buf` on reads.  op: 0 read, 1 write, 2 fdatasync.  Reads and
 * writes run on two rings: the filter may be called from two threads at
 * once. */
typedef int (*kvp_tier_io_filter)(void *opaque, int op, void *buf,
                                  size_t len, uint64_t off, int result);

typedef enum kvp_tier_io_backend {
  KVP_TIER_IO_AUTO = 0,  /* io_uring when the kernel allows it, else POSIX */
  KVP_TIER_IO_URING = 1, /* io_uring or KVP_ENOTSUP */
  KVP_TIER_IO_POSIX = 2  /* pread/pwrite */
} kvp_tier_io_backend;

typedef enum kvp_tier_huge {
  KVP_TIER_HUGE_AUTO = 0,     /* explicit huge pages if reserved, else THP */
  KVP_TIER_HUGE_THP = 1,      /* madvise(MADV_HUGEPAGE) only */
  KVP_TIER_HUGE_NONE = 2
} kvp_tier_huge;

/* Zero value = defaults. */
typedef struct kvp_tier_opts {
  /* DRAM tier.  dram_bytes 0: a share of dram_fraction of MemAvailable
   * (read from /proc/meminfo), fraction 0 = 0.25, shared by the host's
   * default-sized stores (host_stores below). */
  uint64_t dram_bytes;
  double dram_fraction;
  kvp_tier_huge huge_pages;
  /* GPU registration hook (cuMemHostRegister): called once with the whole
   * DRAM region after mmap, before any block lands in it; a negative return
   * fails kvp_tier_create with that code.  unregister runs at destroy. */
  int (*dram_register)(void *opaque, void *base, size_t len);
  void (*dram_unregister)(void *opaque, void *base, size_t len);
  void *register_opaque;

  /* NVMe tier: NULL = none.  The directory must exist; slab files
   * "kvtier-<payload>.slab" are created in it and recovered at create.
   * nvme_bytes 0: nvme_fraction of the file system's free space at create,
   * fraction 0 = 0.5. */
  const char *nvme_dir;
  uint64_t nvme_bytes;
  double nvme_fraction;
  uint32_t queue_depth;       /* 0 = 32; 1..4096 */
  uint64_t max_block_bytes;   /* largest NVMe block; 0 = 4 MiB */
  kvp_tier_io_backend io_backend;
  kvp_tier_io_filter io_filter; /* NULL = none */
  void *io_filter_opaque;
  /* An NVMe operation slower than this (microseconds, 0 = 100000) is
   * counted in kvp_tier_stats.slow_io. */
  uint32_t slow_io_us;

  kvp_tier_policy_kind policy;
  /* Admission to NVMe: volatile blocks go to NVMe only after this many hits
   * (0 = 1: write-through-selective); semi/stable always. */
  uint32_t volatile_nvme_min_hits;
  /* 0 (default): a hit on an NVMe-only block is promoted (copied back into
   * DRAM); 1: it is served from NVMe and stays there only (YAML `promote:
   * false`; KVP_TIER_OPT_PROMOTE 0).  Other values: KVP_EINVAL. */
  uint32_t no_promote;

  kvp_tier_event_fn on_event; /* NULL = none */
  void *event_opaque;

  /* The NVMe admission gate ("policies and admission" above) for blocks
   * leaving DRAM.  admission: gate (default), hits (the class + reuse rule
   * only) or all.  The gate needs a block's recompute time: len /
   * prefill_kv_bytes_per_s (KV bytes one prefill produces per second =
   * prefill tokens/s x KV bytes per token; kvp_tier_ns_opts may set it per
   * namespace); 0 = unknown: the class + reuse rule decides (so the
   * default behaves as volatile_nvme_min_hits always did).  NVMe read and
   * write times use the measured bandwidths once there are any, before
   * that nvme_read_bytes_per_s (0 = 2e9) and nvme_write_bytes_per_s
   * (0 = 1e9).  admit_write_weight: > 0, 0 = 1.0; admit_min_samples:
   * outcomes a cell needs before the model decides it, 1..512, 0 = 32. */
  kvp_tier_admission admission;
  uint32_t admit_min_samples;
  double admit_write_weight;
  double prefill_kv_bytes_per_s;
  double nvme_read_bytes_per_s;
  double nvme_write_bytes_per_s;
  /* Default-sized DRAM tiers (dram_bytes 0) share one budget per host:
   * dram_fraction of MemAvailable when the first of them opened, kept in a
   * registry file (KVP_TIER_HOST_REGISTRY, default
   * /dev/shm/kvplane-tier-dram; "" = no sharing, each store takes its
   * fraction as before) with the live stores' claims; a dead process's claim
   * is dropped at the next create.  Each store takes budget / host_stores
   * (0 = 1: the first store takes it all), or what is left when that is at
   * least half of it; otherwise kvp_tier_create fails with KVP_ENOSPC and
   * logs who holds the budget.  Stores given dram_bytes are not counted. */
  uint32_t host_stores;
  uint32_t reserved[5];
} kvp_tier_opts;

/* Per namespace: block_bytes > 0 gives the namespace fixed-size DRAM slots
 * of that size (blocks of any other size still go through the variable-size
 * arena); aes256_key (32 bytes, copied) encrypts its NVMe slots at rest with
 * AES-256-GCM and makes unencrypted slots of it unreadable.  Returns
 * KVP_EINVAL also for a negative or non-finite prefill_kv_bytes_per_s. */
typedef struct kvp_tier_ns_opts {
  uint64_t block_bytes;
  const uint8_t *aes256_key;
  /* the admission gate's recompute rate for this namespace's blocks
   * (kvp_tier_opts.prefill_kv_bytes_per_s); 0 = the store's */
  double prefill_kv_bytes_per_s;
  uint32_t reserved[6];
} kvp_tier_ns_opts;

/* Creates the store: maps the DRAM region, probes the I/O backend, recovers
 * the slab files of nvme_dir (index rebuilt from the slot headers).  Returns
 * 0, KVP_EINVAL (bad option), KVP_ENOTSUP (io_uring asked for but refused;
 * O_DIRECT refused by nvme_dir's file system, e.g. tmpfs before Linux 6.6 --
 * logged with the path), KVP_ENOMEM, -errno (a slab file that cannot be
 * opened, e.g. a directory named like one: logged with its path).  *out is
 * set only on success.  A tmpfs nvme_dir that takes O_DIRECT (Linux >= 6.6)
 * is accepted with a warning: the "NVMe" tier then lives in RAM / swap. */
KVP_API int kvp_tier_create(const kvp_tier_opts *opts,
                            const kvp_allocator *alloc, kvp_tier_store **out);
/* Runs the queued asynchronous calls to completion, unmaps, closes.  Free
 * every ticket (kvp_ticket_free) BEFORE destroy: a ticket refers to its
 * store.  Does NOT sync (call kvp_tier_sync first for durability).  NULL ok. */
KVP_API void kvp_tier_destroy(kvp_tier_store *t);

/* Registers a namespace (by its seed).  Returns 0, KVP_EEXIST, KVP_EINVAL,
 * KVP_ENOMEM.  Blocks of a namespace that is not registered cannot be put or
 * read (KVP_ENOENT); recovered slots wait for their namespace. */
KVP_API int kvp_tier_ns_add(kvp_tier_store *t, const kvp_namespace *ns,
                            const kvp_tier_ns_opts *o);

/* ---- synchronous block calls (thread-safe; one store lock, which a
 * batch's NVMe reads release while they run: kvp_tier_get_batch) -------*/
#define KVP_TIER_PUT_DURABLE 1u /* write through to NVMe + fdatasync */

typedef struct kvp_tier_put_opts {
  kvp_class cls;  /* stability class; 0 = volatile */
  uint32_t flags; /* KVP_TIER_PUT_* */
  uint32_t reserved[6];
} kvp_tier_put_opts;

/* Stores `len` bytes (copied) under (ns, key).  po NULL = volatile, not
 * durable.  Returns 1 stored (or already present), KVP_ENOENT (namespace not
 * registered), KVP_ERANGE (len 0 or larger than the DRAM region /
 * max_block_bytes for durable puts), KVP_ENOSPC (no room even after
 * eviction), or for durable puts the NVMe error (-EIO, -ENOSPC, ...): the
 * block is then not durable (it may still be in DRAM). */
KVP_API int kvp_tier_put(kvp_tier_store *t, const kvp_namespace *ns,
                         kvp_key key, const void *data, size_t len,
                         const kvp_tier_put_opts *po);
/* Copies the block into dst (cap bytes) and sets *len.  Returns the tier it
 * was served from (KVP_TIER_DRAM / KVP_TIER_NVME, >= 0), KVP_ENOENT (miss:
 * absent, or dropped for a failed check), KVP_ERANGE (cap too small; *len
 * says how much is needed). */
KVP_API int kvp_tier_get(kvp_tier_store *t, const kvp_namespace *ns,
                         kvp_key key, void *dst, size_t cap, size_t *len);
/* The fastest tier holding the block (>= 0) or KVP_ENOENT.  No I/O. */
KVP_API int kvp_tier_contains(kvp_tier_store *t, const kvp_namespace *ns,
                              kvp_key key);
/* Removes the block from every tier (its NVMe slot header is zeroed).
 * Returns 1 removed, 0 absent, or an error. */
KVP_API int kvp_tier_evict(kvp_tier_store *t, const kvp_namespace *ns,
                           kvp_key key);
/* fdatasync every slab file.  Returns 0 or -errno. */
KVP_API int kvp_tier_sync(kvp_tier_store *t);
/* An idle window: writes up to `budget_bytes` of the coldest DRAM blocks
 * that are not yet on NVMe (and pass admission) to NVMe, so later pressure
 * evicts them without I/O.  Returns the number of blocks written. */
KVP_API int kvp_tier_idle(kvp_tier_store *t, uint64_t budget_bytes);

/* Batch forms: results[i] is what the single call returns for item i.
 * NVMe reads of one batch are submitted together (up to queue_depth in
 * flight), and run -- I/O and checks -- WITHOUT the store's lock: other
 * calls (puts, DRAM hits, evicts, demotions) proceed meanwhile; concurrent
 * batches' NVMe reads share one read ring and take turns.  The slots being
 * read are pinned, so an evict or put meanwhile cannot reuse them: a hit
 * returns the block's bytes as of the call, a block evicted during its read
 * may be a hit or a miss.  The dst buffers of one get_batch must not overlap: a later read
 * may be landing in its buffer while an earlier one is being verified.
 * Return the number of hits/stored items, or an error that applies to the
 * whole call (KVP_EINVAL). */
KVP_API int kvp_tier_get_batch(kvp_tier_store *t, const kvp_namespace *ns,
                               const kvp_key *keys, size_t n, void *const *dst,
                               const size_t *cap, size_t *len, int *results);
KVP_API int kvp_tier_put_batch(kvp_tier_store *t, const kvp_namespace *ns,
                               const kvp_key *keys, size_t n,
                               const void *const *data, const size_t *len,
                               const kvp_tier_put_opts *po, int *results);

/* Registers caller memory -- typically the engine's pinned host staging
 * pool, once at start -- with the store's io_uring ring, so NVMe reads whose
 * destination lies wholly inside one range use registered (fixed) buffers:
 * the kernel does not look up and pin the destination pages on every read
 * (IORING_OP_READ_FIXED).  A destination outside every range, unaligned, or
 * crossing a range (or a 1 GiB piece of a larger range) is read as before;
 * checks are unchanged: the checksum (and GCM tag) runs on the bytes in dst.
 * Replaces the ranges of any earlier call; n 0 = kvp_tier_unregister_buffers.
 * Ownership: the store keeps no pointer into iov (copied); the memory stays
 * the caller's, and must stay mapped (not munmap'ed or remapped) until
 * kvp_tier_unregister_buffers() or kvp_tier_destroy() returns, because the
 * kernel holds the pages, not the addresses (a read into a range remapped
 * meanwhile lands in the old pages: dst then fails its checksum -- a miss,
 * never wrong bytes).  Anonymous or huge-page memory; pages count against
 * RLIMIT_MEMLOCK unless CAP_IPC_LOCK.
 * Returns the number of ranges now used for registered reads (n; 0 when the
 * store ignores registration: pread/pwrite backend, no NVMe tier),
 * KVP_EINVAL (iov NULL with n > 0, a zero-length or overlapping range),
 * KVP_ERANGE (more than 16384 - queue_depth pieces of 1 GiB), KVP_ENOMEM,
 * or the kernel's -errno (-ENOMEM: memlock limit; -EFAULT: not mapped or
 * file-backed); on error no caller range is registered and reads work as
 * without one.  Thread-safe (takes the store's lock and the read ring's:
 * waits for running batches' reads).  Registered ranges serve reads only
 * (the read ring's table). */
KVP_API int kvp_tier_register_buffers(kvp_tier_store *t,
                                      const struct iovec *iov, unsigned n);
/* Forgets the ranges of kvp_tier_register_buffers (the kernel unpins
 * them); later reads into them work as into any memory.  0, or KVP_EINVAL
 * (t NULL).  Thread-safe. */
KVP_API int kvp_tier_unregister_buffers(kvp_tier_store *t);

/* ---- asynchronous calls -----------------------------------------------------
 * Queued to the store's I/O thread (started on first use).  Every array and
 * buffer must stay valid until the ticket completes.  *ticket must be freed
 * with kvp_ticket_free (after completion; free waits for it). */
KVP_API int kvp_tier_get_async(kvp_tier_store *t, const kvp_namespace *ns,
                               const kvp_key *keys, size_t n, void *const *dst,
                               const size_t *cap, size_t *len, int *results,
                               kvp_ticket **ticket);
KVP_API int kvp_tier_put_async(kvp_tier_store *t, const kvp_namespace *ns,
                               const kvp_key *keys, size_t n,
                               const void *const *data, const size_t *len,
                               const kvp_tier_put_opts *po, int *results,
                               kvp_ticket **ticket);
/* A hint ("this session's next turn is coming here"): loads the blocks that
 * are only on NVMe into DRAM.  ticket NULL = fire and forget. */
KVP_API int kvp_tier_prefetch(kvp_tier_store *t, const kvp_namespace *ns,
                              const kvp_key *keys, size_t n,
                              kvp_ticket **ticket);
/* KVP_EBUSY while pending, else the call's result.  Thread-safe. */
KVP_API int kvp_ticket_poll(kvp_ticket *k);
/* Blocks until done (timeout_ns 0 = forever); the result, or KVP_EBUSY on
 * timeout. */
KVP_API int kvp_ticket_wait(kvp_ticket *k, uint64_t timeout_ns);
KVP_API void kvp_ticket_free(kvp_ticket *k); /* waits; NULL ok */

/* ---- runtime options (zstd setParameter style) ----------------------------*/
typedef enum kvp_tier_opt {
  KVP_TIER_OPT_DRAM_BYTES = 1,     /* shrink demotes at once; <= region */
  KVP_TIER_OPT_NVME_BYTES = 2,     /* growth limit of the slab files */
  KVP_TIER_OPT_POLICY = 3,         /* kvp_tier_policy_kind (new inserts) */
  KVP_TIER_OPT_VOLATILE_NVME_MIN_HITS = 4,
  KVP_TIER_OPT_PROMOTE = 5,        /* 1 on, 0 off */
  KVP_TIER_OPT_QUEUE_DEPTH = 6,    /* max in flight per batch, <= created */
  KVP_TIER_OPT_ADMISSION = 7,      /* kvp_tier_admission */
  KVP_TIER_OPT_ADMIT_WRITE_WEIGHT_MILLI = 8, /* write_weight x 1000, 1..1e6 */
  KVP_TIER_OPT_PREFILL_KV_BPS = 9, /* prefill_kv_bytes_per_s, 0 = unknown */
  KVP_TIER_OPT_ADMIT_MIN_SAMPLES = 10, /* 1..512 */
  /* 1 (default): a batch's NVMe reads run without the store's lock (see
   * kvp_tier_get_batch); 0: they hold it, as kvtier did before (for
   * side-by-side comparisons, bench_tier --contention) */
  KVP_TIER_OPT_READ_UNLOCKED = 11,
  /* 1 (default): NVMe writes stage (copy, checksum, encrypt) the next block
   * while the queue is full, into one spare staging buffer, so staging
   * overlaps the writes in flight even at queue depth 1; 0: a block is
   * staged only when a queue slot is free, as before (for side-by-side
   * comparisons, bench_tier) */
  KVP_TIER_OPT_STAGE_AHEAD = 12,
  /* 1 (default): a link's in-place load (kvp_tier_load) pins the DRAM slots
   * it scatters from and runs the scatter without the store's lock; 0: the
   * scatter holds the lock, as before (for side-by-side comparisons,
   * bench_tier --contention) */
  KVP_TIER_OPT_LOAD_UNLOCKED = 13
} kvp_tier_opt;
/* Returns 0, KVP_EINVAL (unknown option), KVP_ERANGE (outside bounds) or
 * KVP_ENOMEM (KVP_TIER_OPT_ADMISSION leaving all, which keeps no ghost
 * table, and the table cannot be allocated: the admission stays all). */
KVP_API int kvp_tier_set(kvp_tier_store *t, kvp_tier_opt opt, int64_t value);
KVP_API int kvp_tier_opt_get(kvp_tier_store *t, kvp_tier_opt opt,
                             int64_t *value);
/* Inclusive bounds of an option for this store; t NULL: what
 * kvp_tier_create accepts (no store yet: DRAM bytes up to INT64_MAX, queue
 * depth up to 1024).  0 or KVP_EINVAL. */
KVP_API int kvp_tier_opt_bounds(kvp_tier_store *t, kvp_tier_opt opt,
                                int64_t *lo, int64_t *hi);

/* ---- the YAML config's `tiers:` section (include/kvplane/config.h) ---------
 * Binds section `tiers` to *o, key by key (README, "The KV block store":
 * dram_bytes, dram_fraction, host_stores, huge_pages auto|thp|none, nvme_dir (one path;
 * a list is refused), nvme_bytes, nvme_fraction, queue_depth,
 * max_block_bytes (the three byte sizes take units: 64G, 512MiB, 1T; see
 * kvp_config_parse_size), io_backend auto|uring|posix, slow_io_us, policy
 * s3fifo|lru, volatile_nvme_min_hits, promote true|false (-> no_promote),
 * admission gate|hits|all, admit_write_weight, admit_min_samples,
 * prefill_kv_bytes_per_s, nvme_read_bytes_per_s, nvme_write_bytes_per_s), each
 * checked against kvp_tier_opt_bounds(NULL, ...) or kvp_tier_create's
 * limits.  nvme_dir is copied into dir[dir_cap] and o->nvme_dir points to
 * it (dir must outlive *o's use; a key present with dir NULL is an error).
 * All or nothing: *o and dir change only on success; fields without a key
 * keep their value.  Returns the number of keys set (0: no section), or
 * KVP_EINVAL with "file:line: tiers.key: ..." / "file:line: unknown key
 * ..." in err.  Marks the section bound (kvp_config_check_unbound). */
KVP_API int kvp_tier_opts_from_config(kvp_config *c, kvp_tier_opts *o,
                                      char *dir, size_t dir_cap, char *err,
                                      size_t cap);

/* ---- observability ---------------------------------------------------------*/
typedef struct kvp_tier_stats {
  uint64_t puts, puts_dup, puts_rejected;
  uint64_t hits[KVP_TIER_COUNT_]; /* by tier served from */
  uint64_t misses, key_mismatch;  /* key_mismatch: NVMe header named another
                                     key (never served) */
  uint64_t demotions, promotions, drops_volatile, evictions[KVP_TIER_COUNT_];
  uint64_t nvme_writes, nvme_reads, nvme_bytes_written, nvme_bytes_read;
  uint64_t checksum_failures, auth_failures, io_errors, short_io, slow_io;
  uint64_t recovered_slots, recovery_bad_slots, recovery_dup_slots;
  uint64_t dram_blocks, nvme_blocks, dram_used_bytes, nvme_used_bytes;
  uint64_t dram_bytes, nvme_bytes; /* capacities in force */
  uint64_t dram_slot_bytes;        /* of dram_used_bytes: fixed-size slots */
  int io_uring;                    /* 1 when the io_uring backend is used */
  int huge_pages;                  /* 2 explicit, 1 THP advised, 0 none */
  int fixed_buffers;               /* io_uring registered buffers in use */
  int reserved_;
  uint64_t nvme_reads_registered;  /* of nvme_reads: into a range of
                                      kvp_tier_register_buffers */
  /* The admission gate, by stability class, for blocks not yet on NVMe
   * leaving DRAM (demotion) or written back by kvp_tier_idle (accepted
   * only: a block idle leaves in DRAM is not counted as rejected). */
  uint64_t admit_accepted[KVP_CLASS_COUNT_];
  uint64_t admit_rejected[KVP_CLASS_COUNT_];
  /* outcomes the gate learned from: NVMe blocks read back / left unread,
   * rejected blocks asked for again while remembered */
  uint64_t admit_reused, admit_unused, admit_ghost_hits;
  /* NVMe reads whose check failed because the block was evicted (its
   * header wiped) while the read ran without the lock: a miss, not counted
   * as damage above.  Plaintext reads check the payload only, which a
   * pinned slot keeps: for them this stays 0. */
  uint64_t nvme_read_races;
  /* Damage made visible (each file's first is logged at warn level with its
   * path): slots whose header was zeroed because they failed a read's check
   * (checksum, key, GCM tag) or recovery found a header that does not
   * decode, so they do not fail again after a restart; and blocks lost to a
   * truncated slab file (a last slot cut short, its header intact; the cut
   * part is dropped from the file).  A file cut exactly at a slot boundary
   * leaves nothing to count. */
  uint64_t slots_wiped, recovery_truncated_blocks;
} kvp_tier_stats;
/* Thread-safe snapshot.  Returns 0 or KVP_EINVAL. */
KVP_API int kvp_tier_stats_get(kvp_tier_store *t, kvp_tier_stats *out);

/* The stats as Prometheus text exposition format 0.0.4, families
 * kvplane_tier_* (counters *_total, gauges; a `tier` label dram|nvme or a
 * `class` label volatile|semi|stable on the per-tier and per-class fields;
 * read bandwidths from kvp_tier_bandwidth), to serve beside
 * kvp_ledger_prometheus.  Takes one snapshot (kvp_tier_stats_get), then
 * writes with the store's lock released.  Returns 0, KVP_EINVAL or the
 * writer's error.  Thread-safe. */
KVP_API int kvp_tier_prometheus_write(kvp_tier_store *t, kvp_write_fn fn,
                                      void *opaque);
/* The same into buf, snprintf-like (at most cap-1 bytes and a NUL when
 * cap > 0; buf may be NULL when cap is 0); *needed (may be NULL) gets the
 * full length without the NUL.  0, KVP_ENOSPC (truncated: grow past
 * *needed), KVP_EINVAL. */
KVP_API int kvp_tier_prometheus(kvp_tier_store *t, char *buf, size_t cap,
                                size_t *needed);

/* The epoch this store's events carry (see kvp_tier_event).  0 for NULL. */
KVP_API uint64_t kvp_tier_epoch(const kvp_tier_store *t);
/* One resident block, as kvp_tier_keys_each lists it. */
typedef struct kvp_tier_resident {
  kvp_key ns;     /* namespace seed */
  kvp_key key;
  kvp_tier tier;  /* KVP_TIER_DRAM or KVP_TIER_NVME (a block in both: twice) */
  uint32_t reserved32;
  uint64_t bytes;
} kvp_tier_resident;
typedef int (*kvp_tier_resident_fn)(void *opaque, const kvp_tier_resident *r);
/* Lists every block the store holds, once per tier holding it, under the
 * store's lock (no event is emitted during the walk), and writes the seq of
 * the store's last event to *seq (may be NULL): the listing is the store's
 * state as of (kvp_tier_epoch(t), *seq), ready for kvp_index_src_resync.
 * fn must not call into the store; a non-zero return stops the walk and is
 * returned.  Returns 0, fn's value or KVP_EINVAL.  Thread-safe (blocks the
 * store's other calls for the length of the walk). */
KVP_API int kvp_tier_keys_each(kvp_tier_store *t, kvp_tier_resident_fn fn,
                               void *opaque, uint64_t *seq);
/* Measured bandwidth (bytes/s, exponentially weighted over completed
 * transfers) of reads from `tier` into caller memory; 0 before the first
 * measurement.  Feed it to kvp_router_report_bandwidth().  Thread-safe. */
KVP_API double kvp_tier_bandwidth(kvp_tier_store *t, kvp_tier tier);
/* The DRAM region (for a GPU backend that registers it itself).  0. */
KVP_API int kvp_tier_dram_region(kvp_tier_store *t, void **base, size_t *len);

/* ---- engine integration: a kvp_device (kernels/) plugged into the store ----
 * The worker's save/load path between the engine's paged KV cache (HBM, or
 * any memory a kvp_device reaches) and this store:
 *
 *   save: when the store's region is registered with the link's device
 *         and the namespace has fixed-size slots of the layout's block_bytes
 *         (a size that divides 2 MiB, a multiple of 64), one DRAM slot is
 *         reserved per new key under the store's lock (keys already stored
 *         are put's duplicates and are not gathered), the blocks are
 *         gathered straight into their slots (one launch per round) with
 *         the lock released, and committed: a reserved slot is in no index,
 *         policy or event until its commit (readers miss it, eviction
 *         cannot take it), and a failed gather returns every reservation of
 *         the round, storing nothing (stats blocks_saved_direct).  With
 *         a DRAM budget of at least four rounds, two rounds are in flight:
 *         the next round is reserved and its gather submitted before this
 *         one's is waited for and committed (rounds_overlapped).
 *         Otherwise kvp_device_gather into a staging buffer registered with
 *         the device, then kvp_tier_put_batch of each staged block.  DRAM
 *         holds plaintext either way; an encrypted namespace's blocks are
 *         encrypted when they are written to NVMe (demotion, write-back,
 *         durable puts), as for kvp_tier_put;
 *   load: blocks in DRAM are scattered straight out of their DRAM slots
 *         when the store's region is registered with the link's device
 *         (kvp_tier_opts_set_device with that device) and the slot sits at
 *         a multiple of block_bytes from the region's start (fixed-size
 *         slots of a block size that divides 2 MiB): one scatter per round,
 *         run with the store's lock released -- the slots are pinned, so an
 *         eviction meanwhile leaves its slot unreused until the scatter is
 *         done (KVP_TIER_OPT_LOAD_UNLOCKED 0: under the lock, as before;
 *         stats blocks_direct).  Other
 *         blocks go through kvp_tier_get_batch into the staging buffer
 *         (DRAM copies, NVMe reads in one batch, every read verified: see
 *         the top of this file), then kvp_device_scatter of the HITS ONLY.
 *         Either way into the engine's block ids (which need not be the
 *         ones saved from).  A block that misses (absent, or dropped for a
 *         failed check) is not written: the engine recomputes it.
 *
 * A staged block is the layout's block_bytes (kvp_kv_layout_info), chunks
 * in the engine's own layout and dtype, so the namespace must name that
 * layout (kvp_namespace_desc.kv_layout): a block saved from one layout is
 * never scattered into another.  The DRAM region registration below keeps
 * the region pinned for the device and io_uring. */

/* Fills o->dram_register / dram_unregister / register_opaque so that
 * kvp_tier_create(o) registers the whole DRAM region with dev
 * (kvp_device_host_register: pinned and mapped into the device; a no-op on
 * the CPU backend, which still records the range) and kvp_tier_destroy
 * unregisters it.  dev must outlive every store created from o.  Returns 0
 * or KVP_EINVAL (NULL, or a register hook already set).  A failed
 * registration (e.g. KVP_EGPU: memory already pinned by another library)
 * fails kvp_tier_create with that code. */
KVP_API int kvp_tier_opts_set_device(kvp_tier_opts *o, kvp_device *dev);

typedef struct kvp_tier_link kvp_tier_link;

/* Zero value = defaults. */
typedef struct kvp_tier_link_opts {
  /* Blocks staged per round (one gather or scatter launch each); the
   * staging buffer is staging_blocks * block_bytes of host memory
   * registered with the device.  0 = 64 MiB / block_bytes on a GPU, 1 MiB /
   * block_bytes on the CPU backend (staging stays in cache), clamped to
   * 1..256. */
  uint32_t staging_blocks;
  uint32_t reserved[7];
} kvp_tier_link_opts;

typedef struct kvp_tier_link_stats {
  uint64_t saves, loads;          /* calls */
  uint64_t blocks_saved;          /* put returned 1 */
  uint64_t blocks_save_failed;    /* put returned an error */
  uint64_t blocks_loaded;         /* scattered into the cache */
  uint64_t blocks_missed;         /* load misses: recompute */
  uint64_t wrong_length;          /* of blocks_missed: stored length is not
                                     the layout's block_bytes */
  uint64_t gathers, scatters;     /* device launches */
  uint64_t blocks_direct;         /* of blocks_loaded: scattered straight
                                     out of their DRAM slots (no staging copy) */
  uint64_t blocks_saved_direct;   /* gathered straight into reserved DRAM
                                     slots (no staging copy) */
  uint64_t rounds_overlapped;     /* direct-save rounds reserved and submitted
                                     while the round before was gathering */
  uint64_t reserved[4];
} kvp_tier_link_stats;

/* Links store t, device dev and the engine's layout (made on dev) for the
 * blocks of namespace ns, which must be registered in t (kvp_tier_ns_add,
 * with its AES key if any; block_bytes = the layout's block_bytes gives it
 * fixed DRAM slots).  Allocates and registers the staging buffer.  t, dev
 * and layout must outlive the link.  Returns 0, KVP_EINVAL (NULL, layout of
 * another device, bad opts), KVP_ENOENT (ns not registered), KVP_ERANGE
 * (block_bytes beyond the store's largest block), KVP_ENOMEM, or the
 * registration's error (KVP_EGPU). */
KVP_API int kvp_tier_link_create(kvp_tier_store *t, kvp_device *dev,
                                 const kvp_kv_layout *layout,
                                 const kvp_namespace *ns,
                                 const kvp_tier_link_opts *o,
                                 const kvp_allocator *alloc,
                                 kvp_tier_link **out);
/* Unregisters and frees the staging buffer.  NULL ok. */
KVP_API void kvp_tier_link_destroy(kvp_tier_link *l);

/* Saves the engine's blocks block_ids[0..n) under keys[0..n) (po as for
 * kvp_tier_put: class, KVP_TIER_PUT_DURABLE).  The gathers run on stream s
 * (NULL = the device's own stream), ordered after the engine's work on s
 * when s wraps the engine's stream; the call returns once the blocks are in
 * the store (the cache may then be overwritten).  results[i] is the put's
 * result (1 stored or already present, or an error: the block was not
 * saved).  Returns the number stored, or a negative code for the whole call
 * (KVP_EINVAL: NULL, n > 0 without arrays, a block id out of range -- checked
 * before anything is reserved or stored; a gather's KVP_EGPU): the rounds
 * before the failing one are stored and their results set, the rest of
 * results[] holds the code.
 * Thread-safe (calls on one link are serialised; use one link per thread
 * for parallel transfers). */
KVP_API int kvp_tier_save(kvp_tier_link *l, kvp_stream *s,
                          const kvp_key *keys, const uint32_t *block_ids,
                          size_t n, const kvp_tier_put_opts *po,
                          int *results);
/* Loads keys[0..n) into the engine's blocks block_ids[0..n) (distinct ids;
 * a repeat -> KVP_EINVAL before anything is read or copied).  results[i]:
 * the tier the block came from (KVP_TIER_DRAM / KVP_TIER_NVME, >= 0: block
 * block_ids[i] now holds it), or a miss (KVP_ENOENT: absent or dropped for
 * a failed check; KVP_ECORRUPT: stored length is not block_bytes): block
 * block_ids[i] was NOT written -- recompute it.  Scatters run on stream s
 * and are complete when the call returns.  Returns the number of blocks
 * loaded (prefix users: stop at the first results[i] < 0), or a negative
 * code for the whole call as for kvp_tier_save (KVP_EGPU: the blocks of the
 * failing round have results[i] = KVP_EGPU and hold undefined bytes).
 * Thread-safe as kvp_tier_save. */
KVP_API int kvp_tier_load(kvp_tier_link *l, kvp_stream *s,
                          const kvp_key *keys, const uint32_t *block_ids,
                          size_t n, int *results);
/* Thread-safe snapshot.  0 or KVP_EINVAL. */
KVP_API int kvp_tier_link_stats_get(kvp_tier_link *l, kvp_tier_link_stats *out);

#if UINTPTR_MAX == 0xffffffffffffffffu
KVP_DEVICE_STATIC_ASSERT_(sizeof(kvp_tier_link_opts) == 32, "kvp_tier_link_opts is ABI");
KVP_DEVICE_STATIC_ASSERT_(sizeof(kvp_tier_link_stats) == 128, "kvp_tier_link_stats is ABI");
#endif

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_TIER_H */
