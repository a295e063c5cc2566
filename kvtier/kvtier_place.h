/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier's placement decisions: the eviction policies (tier_policy.c), the
 * NVMe admission gate (tier_admit.c) and the cascade that runs them down the
 * tiers (tier_cascade.c).  Pure: no I/O, no locks, no clock -- callers
 * serialise their calls.  The store runs them under its lock; kvplane-bench's
 * simulator runs the same objects (its CMake target kvp_harness links
 * kvtier's internals for this header alone: bench/CMakeLists.txt,
 * tests/check_layering.sh).  Not installed. */
#ifndef KVP_KVTIER_PLACE_H
#define KVP_KVTIER_PLACE_H

#include <stdbool.h>
#include <stdint.h>

#include "kvplane/tier.h"

/* ---- policies ---------------------------------------------------------------
 * Eviction order over ids 0..n chosen by the caller (the store uses its
 * entry ids; kvplane-bench's simulated workers use their own).  Stability
 * aware: every victim comes from the least stable class that has entries
 * (volatile, then semi-stable, then stable), so stable blocks are the last to
 * go. */
typedef struct tier_policy tier_policy;

/* Returns 0, KVP_EINVAL (bad kind) or KVP_ENOMEM. */
int kvp__tier_policy_create(kvp_tier_policy_kind kind,
                            const kvp_allocator *alloc, tier_policy **out);
void kvp__tier_policy_destroy(tier_policy *p); /* NULL ok */
/* Track id (not tracked yet) of `bytes` (< 2^32) in class `cls`; `fp` is
 * a fingerprint of the block's key (S3-FIFO's ghost queue remembers 24-bit
 * tags of recently evicted fingerprints).  Ids are an array's indexes: a
 * new largest id doubles it (see reserve).  Returns 0, KVP_EEXIST,
 * KVP_EINVAL, KVP_ENOMEM. */
int kvp__tier_policy_insert(tier_policy *p, uint32_t id, uint64_t fp,
                            uint64_t bytes, kvp_class cls);
/* Makes ids 0..ids-1 usable without growing (16 bytes each, allocated
 * zeroed: pages of ids never used are never touched).  A caller that knows
 * how many ids it will use saves the doublings' copies and their unused
 * half.  Returns 0, KVP_EINVAL or KVP_ENOMEM. */
int kvp__tier_policy_reserve(tier_policy *p, uint32_t ids);
/* p (empty, its entries not shared yet) uses with's entries from now on:
 * an id is then tracked by at most one of them (inserting it in another is
 * KVP_EEXIST), and the array serves all (an exclusive hierarchy, where a
 * block is in one tier at a time, keeps one entry per block instead of one
 * per tier).  Up to three policies share one array; both use the same
 * allocator.  Returns 0, KVP_EINVAL, KVP_ERANGE (three share it already)
 * or KVP_ENOMEM. */
int kvp__tier_policy_share(tier_policy *p, tier_policy *with);
/* Prefetches id's entry for writing (a touch, insert or remove soon); an
 * LRU touch also writes its neighbours', which in a chain replayed in order
 * are its neighbours in the chain. */
void kvp__tier_policy_prefetch(const tier_policy *p, uint32_t id);
/* A hit on id.  Returns 0 or KVP_ENOENT. */
int kvp__tier_policy_touch(tier_policy *p, uint32_t id);
/* Stop tracking id (evicted or deleted).  `evicted` != 0 records its
 * fingerprint as a ghost.  Returns 0 or KVP_ENOENT. */
int kvp__tier_policy_remove(tier_policy *p, uint32_t id, int evicted);
/* The id to evict next (still tracked: the caller removes it).  May reorder
 * internal queues (S3-FIFO promotes and ages on the way).  Returns 0 or
 * KVP_ENOENT (empty). */
int kvp__tier_policy_victim(tier_policy *p, uint32_t *id);
/* For prefetching an eviction stream: LRU's next victims, without changing
 * anything.  after == UINT32_MAX: the id kvp__tier_policy_victim would
 * return; else the one LRU takes after `after` in its class (a tracked id),
 * UINT32_MAX at the class's end.  UINT32_MAX also for S3-FIFO (whose victim
 * search reorders its queues) and an empty policy. */
uint32_t kvp__tier_policy_peek(const tier_policy *p, uint32_t after);
uint64_t kvp__tier_policy_bytes(const tier_policy *p);
uint64_t kvp__tier_policy_count(const tier_policy *p);

/* ---- the NVMe admission gate ------------------------------------------------
 * The rule is in include/kvplane/tier.h ("policies and admission"); exactly
 * (kvp__tier_admit_decide):
 *  1. recompute_s <= 0 (unknown), or the cell has fewer than `min_samples`
 *     (decayed) outcomes: admit semi-stable and stable blocks, volatile ones
 *     only after `volatile_min_hits` reuses.  Cold start therefore behaves as
 *     kvtier always did.
 *  2. Otherwise p_reuse * (recompute_s - read_s) >= write_weight * write_s
 *     with p_reuse the cell's estimate.  Volatile blocks without a reuse get
 *     in only this way: their cell learns only from ghosts, so they reach
 *     NVMe once min_samples rejected volatile blocks showed that enough of
 *     them come back. */
typedef struct tier_admit tier_admit;

/* Zero value = defaults. */
typedef struct tier_admit_opts {
  kvp_tier_admission mode;
  uint32_t volatile_min_hits; /* rule 1; 0 = 1 */
  double write_weight;        /* > 0; 0 = 1.0 (NVMe wear and write
                                 bandwidth weighed against reads) */
  uint32_t min_samples;       /* outcomes before a cell uses the model;
                                 0 = 32 */
  uint32_t window;            /* counts halve past this; 0 = 1024 (>= 2 *
                                 min_samples) */
  uint32_t ghost_slots;       /* rejected fingerprints remembered; 0 =
                                 65536; rounded up to a power of two,
                                 <= 1 << 24; 8 bytes each, allocated
                                 only once the mode is not all (all
                                 never rejects) */
} tier_admit_opts;

/* One block's costs, in seconds. */
typedef struct tier_admit_cost {
  double recompute_s; /* prefill of the block; <= 0: unknown (rule 1) */
  double read_s;      /* NVMe read of the block */
  double write_s;     /* NVMe write of the block */
} tier_admit_cost;

#define TIER_ADMIT_BUCKETS 3 /* reuses 0, 1, 2+ */

/* The cell a block of class cls reused `hits` times is judged in, as a
 * token a caller keeps with the block while it is on NVMe, for its outcome:
 * cell + 1 (1..9); 0 means none. */
typedef uint8_t tier_cell;
tier_cell kvp__tier_admit_cell(kvp_class cls, uint32_t hits);

/* Returns 0, KVP_EINVAL (bad opts: write_weight < 0 or not finite, mode out
 * of range, window < 2 * min_samples, ghost_slots > 1 << 24) or
 * KVP_ENOMEM. */
int kvp__tier_admit_create(const tier_admit_opts *o, const kvp_allocator *alloc,
                           tier_admit **out);
void kvp__tier_admit_destroy(tier_admit *a); /* NULL ok */
/* Changes the options; the learned counts stay (ghost_slots is fixed at
 * create and ignored here).  0, KVP_EINVAL as for create, or KVP_ENOMEM
 * (the ghosts of a gate leaving mode all: the options are left as they
 * were). */
int kvp__tier_admit_opts_set(tier_admit *a, const tier_admit_opts *o);
void kvp__tier_admit_opts_get(const tier_admit *a, tier_admit_opts *o);
/* The pure inequality: 1 when p * (recompute_s - read_s) >= write_weight *
 * write_s (write_weight <= 0 counts as 1), else 0. */
int kvp__tier_admit_pays(double p, const tier_admit_cost *c,
                         double write_weight);
/* 1 admit, 0 reject, for a block of class cls that was reused `hits` times,
 * under the mode and rule above. */
int kvp__tier_admit_decide(const tier_admit *a, kvp_class cls, uint32_t hits,
                           const tier_admit_cost *c);
/* The cell's estimate and its (decayed) outcome count. */
double kvp__tier_admit_p(const tier_admit *a, kvp_class cls, uint32_t hits,
                         double *outcomes);
/* An outcome of a block written to NVMe as (cls, hits): reused != 0 when
 * it was read back from NVMe before it left NVMe. */
void kvp__tier_admit_note(tier_admit *a, kvp_class cls, uint32_t hits,
                          int reused);
/* The same by the block's token (0: nothing to note; a NULL gate ok). */
void kvp__tier_admit_note_cell(tier_admit *a, tier_cell cell, bool reused);
/* A block (fingerprint fp of its key) the gate rejected: remembered; a
 * ghost it displaces counts as not reused.  A gate that was always in mode
 * all has no ghosts: nothing is remembered. */
void kvp__tier_admit_reject(tier_admit *a, uint64_t fp, kvp_class cls,
                            uint32_t hits);
/* A key not held was asked for (a miss, or a put of a new block): if fp is
 * a remembered reject, its cell counts a reuse and the ghost is cleared.
 * Returns 1 when it was a ghost, else 0 (also for a NULL gate). */
int kvp__tier_admit_seen(tier_admit *a, uint64_t fp);

/* ---- the placement cascade ---------------------------------------------------
 * Tiers indexed by kvp_tier (HBM, DRAM, NVMe), fastest first.  Each tier with
 * a policy here has a capacity in the caller's units (bytes; blocks when
 * every block counts 1) and is full when its policy's bytes plus what must
 * fit exceed it.  A tier may be present without a policy here (external:
 * the store's NVMe tier, whose slab classes make room for themselves).
 * A full tier's victim goes to the next tier that is present (capacity > 0)
 * -- through the admission gate when that is NVMe and the cascade has a gate
 * -- or is dropped.  Decisions only: the caller moves the bytes (and makes
 * room in the destination first: the victim is already off its tier's
 * policy), publishes, counts, and inserts it where it lands.
 *
 * kvtier's store runs one (DRAM with a policy, NVMe external, the gate);
 * kvplane-bench's simulated engines run one each (all three tiers, the gate
 * when configured). */
#define TIER_CASCADE_TIERS 3 /* KVP_TIER_HBM .. KVP_TIER_NVME */

typedef struct tier_cascade tier_cascade;

typedef struct tier_cascade_opts {
  kvp_tier_policy_kind policy[TIER_CASCADE_TIERS];
  uint64_t cap[TIER_CASCADE_TIERS]; /* 0: absent (no victim goes there) */
  uint8_t with_policy;  /* bit k: tier k has a policy here */
  uint32_t ids;         /* ids each policy reserves (0: grow as used) */
  bool exclusive;       /* an id is in one tier's policy at a time: the
                           policies share their entries (policy_share) */
  bool gate;            /* admission into NVMe passes the gate */
  tier_admit_opts gate_opts;
} tier_cascade_opts;

/* What the caller knows of a victim, for its destination. */
typedef struct tier_victim {
  uint64_t fp;          /* the gate's ghost fingerprint */
  kvp_class cls;        /* the gate's cell */
  uint32_t hits;
  tier_admit_cost cost; /* the gate's costs (rule 2) */
  bool below;           /* already held by the next tier (an inclusive
                           store): it only leaves this one */
} tier_victim;
typedef void (*tier_victim_fn)(void *arg, uint32_t id, tier_victim *out);

enum { TIER_GATE_NONE = 0, TIER_GATE_ADMIT = 1, TIER_GATE_REJECT = 2 };

typedef struct tier_move {
  uint32_t id;
  int from, to;   /* to -1: dropped */
  bool below;     /* to already holds it (nothing to move) */
  uint8_t gate;   /* TIER_GATE_*: what the gate said, if it was asked */
  tier_cell cell; /* TIER_GATE_ADMIT: the block's token for its outcome */
} tier_move;

/* 0, KVP_EINVAL or KVP_ENOMEM. */
int kvp__tier_cascade_create(const tier_cascade_opts *o,
                             const kvp_allocator *alloc, tier_cascade **out);
void kvp__tier_cascade_destroy(tier_cascade *c); /* NULL ok */
/* Tier k's policy (NULL: none here) and the gate (NULL: none). */
tier_policy *kvp__tier_cascade_policy(const tier_cascade *c, int k);
tier_admit *kvp__tier_cascade_gate(const tier_cascade *c);
/* Replaces tier k's policy by p (which the cascade then owns; p shares
 * no entries unless the caller shared them: kvp__tier_policy_share). */
void kvp__tier_cascade_set_policy(tier_cascade *c, int k, tier_policy *p);
void kvp__tier_cascade_set_cap(tier_cascade *c, int k, uint64_t cap);
uint64_t kvp__tier_cascade_cap(const tier_cascade *c, int k);
/* The next victim of tier k while `need` more units do not fit under its
 * capacity (with force: one even if they fit): taken off k's policy (as
 * evicted) and given its destination, asking fn about it.  1 with *m, 0 when
 * the units fit or tier k holds nothing. */
int kvp__tier_cascade_next(tier_cascade *c, int k, uint64_t need, bool force,
                           tier_victim_fn fn, void *arg, tier_move *m);

#endif /* KVP_KVTIER_PLACE_H */
