/* SPDX-License-Identifier: Apache-2.0 */
/* connectors/events internals: the decoder's scratch, the re-key map, the
 * per-source state machine.  Only the public headers are included: this
 * module is a client of libkvplane (docs/architecture.md). */
#ifndef KVP_EVENTS_INTERNAL_H
#define KVP_EVENTS_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvplane.h"
#include "kvplane/events.h"

#define EV_MOD "events"

/* ---- allocation through the caller's allocator (or libc) ------------------ */
void *kvp__ev_alloc(const kvp_allocator *a, size_t n);
void *kvp__ev_calloc(const kvp_allocator *a, size_t n, size_t size);
void kvp__ev_free(const kvp_allocator *a, void *p, size_t n);
/* A copy of s through a (NULL when out of memory), and its release (NULL
 * allowed): the size handed to a->free is strlen + 1. */
char *kvp__ev_strdup(const kvp_allocator *a, const char *s);
void kvp__ev_strfree(const kvp_allocator *a, char *s);
/* Grows *p (an array of *cap elements of `size` bytes) to hold at least
 * `need`; 0 or KVP_ENOMEM (then *p is untouched). */
int kvp__ev_grow(const kvp_allocator *a, void **p, size_t *cap, size_t need,
                 size_t size);

/* Bytes-level check that a msgpack value fits its buffer before msgpack-c
 * allocates for it: every container's declared element count must fit in
 * the bytes left (each element takes at least one), so a 5-byte header
 * cannot make the unpacker reserve gigabytes.  Returns 0 or KVP_ECORRUPT. */
int kvp__mp_check(const uint8_t *p, size_t len);

/* ---- the re-key map: one source's engine hash -> kvplane key --------------
 * Open addressing, linear probing, backward-shift deletion; keyed by kvp_ehash.u64 (the
 * int form, or the low 64 bits of a digest: the same block either way). */
typedef struct rk_slot {
  uint64_t ehash;
  kvp_key key;
  uint8_t tiers; /* bit 1 << kvp_tier where the engine holds it; 0 = free */
  uint8_t state; /* 0 empty, 1 used */
  uint8_t pad[6];
} rk_slot;

typedef struct rk_map {
  rk_slot *slots;
  size_t cap; /* power of two, or 0 */
  size_t used;
  size_t limit; /* most entries */
} rk_map;

void kvp__rk_init(rk_map *m, size_t limit);
void kvp__rk_free(const kvp_allocator *a, rk_map *m);
void kvp__rk_clear(const kvp_allocator *a, rk_map *m);
rk_slot *kvp__rk_find(const rk_map *m, uint64_t ehash);
/* The slot of ehash, inserted (tiers 0) if absent.  NULL: at the limit
 * (KVP_ERANGE in *err) or out of memory (KVP_ENOMEM). */
rk_slot *kvp__rk_upsert(const kvp_allocator *a, rk_map *m, uint64_t ehash,
                        int *err);
void kvp__rk_erase(rk_map *m, rk_slot *s);
/* Starts loading the home slots of n hashes: an event's lookups then miss
 * the cache in parallel instead of one after the other. */
void kvp__rk_prefetch(const rk_map *m, const kvp_ehash *h, size_t n);
size_t kvp__rk_bytes(const rk_map *m);

/* ---- statistics: one set per source, updated by the applying thread,
 * read by anyone (relaxed atomics) -------------------------------------- */
#define EV_STATS(X)                                                            \
  X(batches) X(events) X(blocks_stored) X(blocks_removed) X(clears) X(gaps)    \
  X(batches_missed) X(replays) X(batches_replayed) X(replay_failures)          \
  X(residency_drops) X(restarts) X(duplicates) X(decode_errors)                \
  X(unknown_events) X(unknown_fields) X(other_groups) X(block_size_mismatch)   \
  X(rekey_orphans) X(rekey_full) X(rekey_entries) X(rekey_bytes)               \
  X(queue_drops) X(index_errors) X(topic_mismatch) X(unknown_media) X(stale)  \
  X(connects) X(disconnects) X(replaying)

typedef struct ev_counters {
#define EV_FIELD_(n) _Atomic uint64_t n;
  EV_STATS(EV_FIELD_)
#undef EV_FIELD_
  /* doubles, as bits: the last batch applied's lag at its delivery (wall
   * clock then - its ts), and when it was applied (wall clock, s) */
  _Atomic uint64_t last_lag_bits, last_applied_bits;
} ev_counters;

static inline void ev_add(_Atomic uint64_t *c, uint64_t v) {
  atomic_fetch_add_explicit(c, v, memory_order_relaxed);
}
static inline void ev_set(_Atomic uint64_t *c, uint64_t v) {
  atomic_store_explicit(c, v, memory_order_relaxed);
}

/* ---- applying one decoded batch to the index (events_apply.c) ------------- */
typedef struct ev_apply {
  kvp_index *ix;
  const kvp_allocator *alloc;
  kvp_index_src src;      /* worker, stream, epoch; seq = last applied */
  kvp_events_keying keying;
  kvp_hasher *hasher;     /* REKEY, or ENGINE_HASH with a namespace */
  uint32_t block_size;    /* 0 = any */
  uint8_t digest_len;     /* the hasher's digest length */
  rk_map map;
  uint64_t other_groups;  /* bit g: group g is not full attention */
  uint64_t full_groups;   /* bit g: group g is full attention */
  kvp_key *keys;          /* scratch */
  size_t keys_cap;
  ev_counters *ctr;
} ev_apply;

int kvp__ev_apply_init(ev_apply *a, kvp_index *ix, const kvp_allocator *alloc,
                       const kvp_events_source *s, ev_counters *ctr);
void kvp__ev_apply_fini(ev_apply *a);
/* Applies every event of b (already in order).  Returns 0 or a negative
 * index error (counted; the batch is still consumed). */
int kvp__ev_apply_batch(ev_apply *a, const kvp_kv_batch *b);
/* Drops everything the source announced: index residency (src_cleared) and
 * the re-key map. */
void kvp__ev_apply_drop(ev_apply *a);
/* The publisher restarted: a new epoch (the index drops the old one's
 * residency on its first event; the map is cleared now). */
void kvp__ev_apply_new_epoch(ev_apply *a);

/* ---- for the JetStream reader (events_nats.c) ---------------------------- */
size_t kvp__ev_source_count(const kvp_events *ev);
/* the allocator ev was created with (NULL: libc) */
const kvp_allocator *kvp__ev_allocator(const kvp_events *ev);
bool kvp__ev_source_external(const kvp_events *ev, uint32_t source);
/* External source `source` starts over, as if it had never been fed (its
 * JetStream stream was made again): its residency dropped now (counted as
 * a residency drop), its sequence state forgotten -- the next batch fed
 * applies whatever its number.  On the feeding thread; 0, KVP_ERANGE (not
 * an external source) or KVP_ESTATE (ev's I/O thread runs). */
int kvp__ev_source_restart(kvp_events *ev, uint32_t source);

#endif /* KVP_EVENTS_INTERNAL_H */
