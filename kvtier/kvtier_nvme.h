/* SPDX-License-Identifier: Apache-2.0 */
/* The NVMe tier as the store sees it: an opaque object owning its slab
 * classes (one file per payload size class, with their policies, slot
 * owners and pins), its two rings (writes; reads, with their staging and
 * the caller's registered ranges), its ciphers and the read ring's lock.
 * It knows no entry: calls carry what it needs of each block (copied from
 * the index by the store) and return per-block results -- the slot a block
 * got, the entry a full class gives up, what a write or a read found --
 * which the store turns into index updates, events, bandwidth notes and
 * admission outcomes.
 *
 * Locks: the store's lock serialises every call; kvp__tier_nvme_read may
 * release it (outer) while its I/O and checks run under the object's own
 * read lock (rmu), on pinned slots.  Order: the store's lock, then rmu;
 * whoever holds rmu alone never takes the store's.  Not installed. */
#ifndef KVP_KVTIER_NVME_H
#define KVP_KVTIER_NVME_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include <sys/uio.h>

#include "kvplane/tier.h"
#include "kvtier_internal.h"

typedef struct tier_nvme tier_nvme;

/* A slot recovery found with a valid header (h), in class ci: the caller
 * returns the id of the entry that now owns it and the class its policy
 * files it under, or TIER_NIL to leave the slot free (a duplicate). */
typedef uint32_t (*tier_nvme_found_fn)(void *arg, const tier_slot_hdr *h,
                                       int32_t ci, uint64_t slot,
                                       kvp_class *cls);

/* Opens the tier in dir (o: nvme_bytes/fraction, max_block_bytes,
 * io_backend, io_filter, slow_io_us, policy): probes O_DIRECT, sizes the
 * staging for qd_max, recovers every slab file, calling fn per slot found.
 * 0 or a negative code (nothing left open). */
int kvp__tier_nvme_open(const kvp_tier_opts *o, const char *dir,
                        uint32_t qd_max, const kvp_allocator *a,
                        tier_nvme_found_fn fn, void *arg, tier_nvme **out);
void kvp__tier_nvme_close(tier_nvme *nv); /* NULL ok */

/* A slot for a block of len bytes.  0: (*ci, *slot) taken, for the write
 * that follows (kvp__tier_nvme_write gives it back if the write fails).
 * 1: the class is full and *victim is the entry its policy gives up: the
 * caller frees that entry's slot (kvp__tier_nvme_free, evicted) and asks
 * again.  Else KVP_ERANGE (larger than max_block_bytes), KVP_ENOSPC or
 * -errno. */
int kvp__tier_nvme_reserve(tier_nvme *nv, uint64_t len, int32_t *ci,
                           uint64_t *slot, uint32_t *victim);

/* One block to write: in, from the index and kvp__tier_nvme_reserve; out,
 * the result. */
typedef struct tier_nwrite {
  uint32_t id;        /* the entry that will own the slot */
  kvp_key ns, key;
  uint64_t len;
  const void *src;    /* len bytes (the DRAM copy) */
  kvp_class cls;      /* for the class's policy */
  bool enc;           /* AES-256-GCM with aes */
  const uint8_t *aes;
  int32_t ci;         /* the reserved slot (in); -1 after a failed write */
  uint64_t slot;
  /* out */
  int res;            /* in: < 0 skips the block; out: 0 or the error
                         (durable: not acknowledged, the block stays) */
  uint64_t sum;       /* the payload checksum in its header */
  bool nenc;          /* the slot is encrypted */
} tier_nwrite;

/* What a batch moved: payload bytes and the time its I/O took (the
 * bandwidth note; bytes 0: nothing to note). */
typedef struct tier_nvme_batch {
  uint64_t bytes, ns;
} tier_nvme_batch;

/* Writes w[0..n) with up to qd in flight (stage_ahead: one more block staged
 * while the queue is full); a written block's slot is owned by w[i].id.
 * With durable, fdatasyncs the touched files and fails the batch (w[i].res)
 * on error -- the blocks stay on NVMe (w[i].ci >= 0). */
void kvp__tier_nvme_write(tier_nvme *nv, tier_nwrite *w, size_t n, uint32_t qd,
                          bool stage_ahead, bool durable, tier_nvme_batch *b);

/* One block to read, copied from the index under the store's lock: its
 * identity, slot, checksum, the namespace's key (if any) and where to. */
typedef struct tier_nread {
  kvp_key ns, key;
  uint64_t len, sum, slot;
  int32_t ci;
  bool ns_ok, ns_enc; /* the namespace is registered / encrypted */
  bool enc;           /* the slot is encrypted */
  uint8_t aes[32];
  void *dst;
  /* out */
  int res;            /* KVP_TIER_NVME, or KVP_ENOENT (a miss) */
  uint8_t fail;       /* TIER_RF_* */
} tier_nread;

/* What a read found wrong (tier_nread.fail). */
enum { TIER_RF_NONE, TIER_RF_IO, TIER_RF_SHORT, TIER_RF_SUM, TIER_RF_KEY,
       TIER_RF_AUTH };

/* Reads r[0..n) into r[i].dst; a hit is the block's bytes as of the call.
 * Called with the store's lock held; releases outer (when not NULL) while
 * the I/O and the checks run and retakes it before returning.  The slots
 * stay pinned (no write lands in them, a released one is freed by its last
 * reader) until the caller unpins each, having looked at its entry.
 * 0, or KVP_ENOMEM (nothing read, nothing pinned). */
int kvp__tier_nvme_read(tier_nvme *nv, tier_nread *r, size_t n, uint32_t qd,
                        pthread_mutex_t *outer, tier_nvme_batch *b);
void kvp__tier_nvme_unpin(tier_nvme *nv, int32_t ci, uint64_t slot);

/* Entry id (in class ci, slot slot) leaves NVMe: its slot is released
 * (header zeroed first with wipe, so recovery does not bring it back;
 * evicted: its policy keeps a ghost). */
void kvp__tier_nvme_free(tier_nvme *nv, uint32_t id, int32_t ci, uint64_t slot,
                         bool wipe, bool evicted);
/* A read of class ci's slot found damage (fail: TIER_RF_SUM, _KEY or
 * _AUTH): counted and logged (once per slab file, with its path); the
 * caller then frees the slot with wipe. */
void kvp__tier_nvme_damaged(tier_nvme *nv, int32_t ci, uint64_t slot,
                            int fail);
/* A hit on entry id in class ci (its policy). */
void kvp__tier_nvme_touch(tier_nvme *nv, int32_t ci, uint32_t id);
/* fdatasync every slab file.  0 or the error. */
int kvp__tier_nvme_sync(tier_nvme *nv, uint32_t qd);
/* kvp_tier_register_buffers for reads (n 0: unregister); takes rmu. */
int kvp__tier_nvme_register(tier_nvme *nv, const struct iovec *iov,
                            unsigned n);
/* New policies of kind k, the slots' owners refiled (fn: an entry's
 * fingerprint and class).  0 or KVP_ENOMEM. */
typedef void (*tier_nvme_info_fn)(void *arg, uint32_t id, uint64_t *fp,
                                  kvp_class *cls);
int kvp__tier_nvme_set_policy(tier_nvme *nv, kvp_tier_policy_kind k,
                              tier_nvme_info_fn fn, void *arg);
void kvp__tier_nvme_set_cap(tier_nvme *nv, uint64_t bytes);
uint64_t kvp__tier_nvme_cap(const tier_nvme *nv);
/* Adds the tier's own counters (I/O, recovery of bad slots) to out and
 * sets its gauges (nvme_used_bytes, nvme_bytes, io_uring, slow_io,
 * fixed_buffers).  Takes rmu. */
void kvp__tier_nvme_stats(tier_nvme *nv, kvp_tier_stats *out);

#endif /* KVP_KVTIER_NVME_H */
