/* SPDX-License-Identifier: Apache-2.0 */
/* router/prefix_stability internals exposed to tests and benchmarks: the
 * session sketch's hashing and estimator, and the table's geometry.  Not
 * installed; nothing outside router/, tests/ and bench/ may include it. */
#ifndef KVP_PREFIX_STABILITY_INTERNAL_H
#define KVP_PREFIX_STABILITY_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvplane/prefix.h"

/* Bit (0..63) of the 64-bit per-key session sketch that `session` sets.  Two
 * sessions with the same bit count as one (the sketch under-counts). */
uint32_t kvp__stability_session_bit(uint64_t session);

/* Linear-counting estimate of the distinct sessions behind `bits_set` (0..64)
 * set bits: -64 ln(1 - k/64); +inf at 64. */
double kvp__stability_sessions_estimate(uint32_t bits_set);

/* Slots in the open-addressing table (a power of two >= capacity / 0.75). */
size_t kvp__stability_slots(const kvp_stability *s);

/* Walks the whole table: 0 if every invariant holds (size matches the
 * occupied slots and is <= capacity; every entry is reachable from its home
 * slot without crossing an empty one; no tag is stored twice), else
 * KVP_ECORRUPT.  O(slots * probe length): for tests. */
int kvp__stability_check(const kvp_stability *s);

/* The fast path (binary search over what this session already sent) on or
 * off; on at create.  Off, every observe takes the per-block path: the
 * reference the fast path is tested against. */
void kvp__stability_set_fast(kvp_stability *s, bool on);

/* Observes the fast path served since create. */
uint64_t kvp__stability_fast_calls(const kvp_stability *s);

/* Session hints (which of the fast path's probes to prefetch) on or off; on
 * at create.  They change speed only: tests compare tables with and without. */
void kvp__stability_set_hints(kvp_stability *s, bool on);

/* Observes whose session hint matched the request (a prefix of it ended at
 * the hinted block) since create. */
uint64_t kvp__stability_hint_calls(const kvp_stability *s);

/* Whether two classifiers of the same capacity hold byte-identical tables
 * (every entry's tag, sketch, sightings, flags, reference bit and stamp, in
 * the same slots) and the same CLOCK hand and epoch clock. */
bool kvp__stability_same(const kvp_stability *a, const kvp_stability *b);

/* One tracked key's state, as learned so far. */
typedef struct kvp__stability_entry {
  uint64_t sessions;  /* the sketch */
  uint32_t sightings; /* saturating at semi_repeats - 1 */
  bool stable;        /* the sketch reached stable_sessions */
  bool referenced;    /* CLOCK reference bit */
} kvp__stability_entry;

/* The entry of fingerprint fp (a key's lo): 0, or KVP_ENOENT. */
int kvp__stability_lookup(const kvp_stability *s, uint64_t fp,
                          kvp__stability_entry *out);

/* Drops fp's entry as an eviction would (backward shift): 0, or KVP_ENOENT.
 * Tests use it to punch a hole into the middle of a learned chain. */
int kvp__stability_forget(kvp_stability *s, uint64_t fp);

/* Moves the stamp clock by one epoch (a quarter revolution of the CLOCK
 * hand) without evicting: every stamp is now stale, so the next observe of
 * any chain takes the per-block path, as it would after real churn. */
void kvp__stability_advance_epoch(kvp_stability *s);

#endif /* KVP_PREFIX_STABILITY_INTERNAL_H */
