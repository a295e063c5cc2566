/* SPDX-License-Identifier: Apache-2.0 */
/* router/prefix_stability internals exposed to tests and benchmarks: the
 * session sketch's hashing and estimator, and the table's geometry.  Not
 * installed; nothing outside router/, tests/ and bench/ may include it. */
#ifndef KVP_PREFIX_STABILITY_INTERNAL_H
#define KVP_PREFIX_STABILITY_INTERNAL_H

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

#endif /* KVP_PREFIX_STABILITY_INTERNAL_H */
