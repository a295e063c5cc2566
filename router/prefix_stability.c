/* SPDX-License-Identifier: Apache-2.0 */
/* Segments (role/class names), the learned stability classifier and the
 * prompt-drift detector of prefix.h.
 *
 * Classifier.  One open-addressing table (linear probing, power-of-two slots
 * >= capacity / 0.75, backward-shift deletion, no tombstones) of 16-byte
 * entries keyed by the block key's 64-bit fingerprint `lo`:
 *   meta     = tag (fingerprint bits 0..49; bit 13 set) | stamp | flags |
 *              sightings
 *   sessions = 64-bit sketch, one bit per hash(session) % 64
 * A block's class is read from its entry BEFORE this sighting is learned:
 * stable once the sketch's linear-counting estimate -64 ln(1 - k/64) of k set
 * bits reaches stable_sessions (latched in STABLE_BIT when a bit is added, so
 * the per-block path never counts bits); semi when this session's bit is set
 * and the sightings (all sessions, saturating at semi_repeats - 1) reached
 * semi_repeats - 1; volatile otherwise.  Then the running minimum along the
 * chain, with marks folded in, turns classes into [stable][semi][volatile].
 * Invariants:
 *   - meta == 0 <=> the slot is empty; size <= capacity < slots, so every
 *     probe run ends at an empty slot;
 *   - every entry is reachable from its home slot without crossing an empty
 *     slot (backward shift keeps this on delete, so no tombstones), and no
 *     tag is stored twice (kvp__stability_check verifies all three);
 *   - memory is allocated once, at create; observe never allocates.
 * Only `lo` is looked at, and only its low 50 bits are stored: two keys with
 * the same tag share an entry and may be mis-classified, which costs at most
 * a retention or routing preference.  Nothing here ever returns KV bytes, so a
 * fingerprint collision can never serve the wrong KV (tiers check all 128
 * bits).
 * Eviction is CLOCK, not a linked LRU: a touch sets one bit in the entry the
 * probe already loaded, with no list splicing and no 16 bytes of pointers per
 * entry; on this read-mostly, per-block hot path that is the difference
 * between one cache line and three per block.  A new key enters referenced,
 * so it lives at least until the hand has passed it twice: long enough, at
 * any realistic capacity, for another session to send it again.
 *
 * Fast path: a request re-sending what its session sent before.  Chained keys
 * nest: a request holding block i holds every block < i, so along a chain
 * the sketch only loses bits, sightings only go down, and "settled" (this
 * session's bit set and sightings saturated: learning it again changes
 * nothing but the reference bit) is true on a prefix [0, b) and false after.
 * Same for stable.  So observe binary-searches b and the stable boundary
 * (O(log n) probes, read-only) and runs the per-block path on [b, n) only:
 * in multi-turn traffic, the new turn.  Exact when the prefix's entries are
 * all still there -- which untouched entries need not be, CLOCK being driven
 * by touches.  Hence the stamp: every touch writes the current epoch (a
 * quarter revolution of the CLOCK hand; every write of one request uses the
 * epoch it started in), so an entry stamped e proves that its whole prefix
 * was touched since epoch e began (the per-block path touches all of it, or
 * the fast path ran under a prefix proving the same).  The fast path runs
 * only when block b-1's stamp is the current epoch: then the hand has moved
 * less than a quarter of the table since [0, b) was touched, and CLOCK needs a
 * full revolution after a touch to evict non-forcibly.  Otherwise (and for
 * short requests, and on any sign of a missing entry) the per-block path runs
 * over the whole request and re-stamps it: a chain sent at least every three
 * epochs is re-walked before CLOCK can take anything from it, and what a
 * forced eviction (the bounded sweep) took from the middle of a prefix is
 * re-learned at the chain's first request of the next epoch.  Until then the
 * fast path can only report what the block at b-1 proves for all blocks
 * before it: never more reusable than a table that had forgotten nothing (see
 * prefix.h).  The binary search needs the table nested along chains again
 * after such a re-learning, so the per-block walk restores it: when block i's
 * entry holds a session or sightings that block i-1's lacks, i-1 inherits
 * them (true of i-1: every request with key i held key i-1).
 * The searches' probes depend on each other, a memory miss each in
 * multi-turn traffic; a small direct-mapped table of per-session hints
 * (where the session's last request ended) predicts where they will end, so
 * their whole paths, and the new turn's first slots, are prefetched at once.
 * Hints steer prefetches only, never a decision (see "session hints").
 *
 * Drift.  Compares two turns' chains for the first differing block, then finds
 * which of the previous turn's later blocks still occur anywhere in the new
 * turn with a Rabin-Karp rolling hash over block-sized windows, each candidate
 * confirmed by memcmp (so a hash collision can never inflate a count). */
#include <assert.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>
#include <sys/mman.h>

#include "core_internal.h"
#include "kvplane/prefix.h"
#include "prefix_stability_internal.h"

/* ---- names -------------------------------------------------------------- */
static const char *const role_names[KVP_ROLE_COUNT_] = {
    "other", "system", "tools", "documents", "history", "user", "tool_output"};

const char *kvp_role_name(kvp_role r) {
  return (unsigned)r < KVP_ROLE_COUNT_ ? role_names[r] : "unknown";
}

int kvp_role_parse(const char *s, kvp_role *out) {
  if (s == NULL || out == NULL)
    return KVP_EINVAL;
  for (unsigned r = 0; r < KVP_ROLE_COUNT_; r++)
    if (strcmp(s, role_names[r]) == 0) {
      *out = (kvp_role)r;
      return 0;
    }
  return KVP_EINVAL;
}

kvp_class kvp_role_default_class(kvp_role r) {
  switch (r) {
  case KVP_ROLE_SYSTEM:
  case KVP_ROLE_TOOLS:
    return KVP_CLASS_STABLE;
  case KVP_ROLE_DOCUMENTS:
  case KVP_ROLE_HISTORY:
    return KVP_CLASS_SEMI;
  default: /* user, tool output, other, and anything unknown: least reusable */
    return KVP_CLASS_VOLATILE;
  }
}

/* ---- marks, shared by the classifier and drift --------------------------- */
static bool mark_valid(const kvp_segment_mark *m) {
  if ((uint64_t)m->offset + m->length > UINT32_MAX)
    return false;
  if (m->role >= KVP_ROLE_COUNT_)
    return false;
  return m->class_hint < KVP_CLASS_COUNT_ || m->class_hint == KVP_CLASS_AUTO;
}

static bool marks_valid(const kvp_segment_mark *m, size_t n) {
  if (n > 0 && m == NULL)
    return false;
  for (size_t i = 0; i < n; i++)
    if (!mark_valid(&m[i]))
      return false;
  return true;
}

static uint8_t mark_class(const kvp_segment_mark *m) {
  if (m->class_hint != KVP_CLASS_AUTO)
    return m->class_hint;
  return (uint8_t)kvp_role_default_class((kvp_role)m->role);
}

/* ---- classifier table --------------------------------------------------- */
#define SIGHT_MASK 0x7Full    /* bits 0..6: saturating sightings, 0..127 */
#define REF_BIT 0x80ull       /* bit 7: CLOCK reference bit */
#define STABLE_BIT 0x100ull   /* bit 8: the sketch reached stable_sessions */
#define STAMP_SHIFT 9         /* bits 9..12: epoch of the last touch, mod 16 */
#define STAMP_MASK 0x1E00ull
#define EPOCHS 16u
#define TAG_MASK (~0x1FFFull) /* bits 13..63: the tag */
#define TAG_ONE 0x2000ull
#define FAST_MIN 32u /* blocks: below, two probes are a good part of the walk */
#define FIB 0x9E3779B97F4A7C15ull
#define CHUNK 256u  /* blocks per coverage bitmap (on the stack) */
#define PREFETCH 8u /* blocks ahead (8..32 measured alike on a cold table) */
#define CLOCK_SWEEP 256u /* slots the CLOCK hand clears per eviction, at most */
#define SEMI_REPEATS_MAX (SIGHT_MASK + 1)
#define STABLE_SESSIONS_MAX 256u /* the 64-bit sketch saturates near 266 */
#define KEYS_PER_HINT 64u /* hint slots: capacity / this (16 bytes each) */
#define WALK_AHEAD 32u    /* blocks of a hinted new turn prefetched up front */

#if defined(__GNUC__) || defined(__clang__)
#define ALWAYS_INLINE inline __attribute__((always_inline))
#define NOINLINE __attribute__((noinline))
#else
#define ALWAYS_INLINE inline
#define NOINLINE
#endif

typedef struct entry {
  uint64_t meta;
  uint64_t sessions;
} entry;
_Static_assert(sizeof(entry) == 16, "four entries per cache line");

struct kvp_stability {
  entry *slots;
  size_t mask;    /* slots - 1 */
  unsigned shift; /* 64 - log2(slots): Fibonacci hashing's top bits */
  size_t size;    /* entries in use, <= capacity */
  size_t capacity;
  size_t hand;          /* CLOCK hand */
  uint64_t swept;       /* slots the hand has ever moved: the clock of stamps */
  unsigned epoch_shift; /* log2(slots / 4): swept >> it = epoch */
  uint64_t stamp;       /* this call's epoch, in meta position */
  uint32_t stable_bits; /* sketch bits set for stable: 1..64 */
  uint32_t semi_seen;   /* sightings before this call for semi: 1..127 */
  bool fast;            /* the fast path is allowed (tests turn it off) */
  bool hinted;          /* session hints steer its prefetches (likewise) */
  uint64_t fast_calls;  /* observes served by it (tests) */
  uint64_t hint_calls;  /* observes whose session hint matched (tests) */
  struct hint *hints;   /* direct-mapped by session hash */
  size_t hint_mask;     /* hint slots - 1 */
  kvp_allocator alloc;
};

/* The fingerprint's low 50 bits above the flags and stamp, bit 13 forced on
 * so that a tag is never 0 (0 = empty slot).  A false match per probe:
 * ~2^-50.  Low bits rather than high: structured fingerprints (counters)
 * differ there. */
static inline uint64_t tag_of(uint64_t fp) { return (fp << 14) | TAG_ONE; }

/* The home slot depends on the stored tag only, so deletion can recompute it.
 * Multiplying spreads structured fingerprints (test keys, counters). */
static inline size_t home_of(uint64_t tag, unsigned shift) {
  return (size_t)((tag * FIB) >> shift);
}

/* murmur3 fmix64: session ids are often small consecutive integers.  Bits
 * 58..63 pick the sketch bit, low bits a hint slot, bits 26..57 check it. */
static inline uint64_t session_mix(uint64_t session) {
  session ^= session >> 33;
  session *= 0xFF51AFD7ED558CCDull;
  session ^= session >> 33;
  session *= 0xC4CEB9FE1A85EC53ull;
  session ^= session >> 33;
  return session;
}

uint32_t kvp__stability_session_bit(uint64_t session) {
  return (uint32_t)(session_mix(session) >> 58);
}

double kvp__stability_sessions_estimate(uint32_t bits_set) {
  if (bits_set >= 64)
    return INFINITY;
  return -64.0 * log1p(-(double)bits_set / 64.0);
}

size_t kvp__stability_slots(const kvp_stability *s) { return s->mask + 1; }

int kvp__stability_check(const kvp_stability *s) {
  size_t used = 0;
  for (size_t i = 0; i <= s->mask; i++) {
    uint64_t m = s->slots[i].meta;
    if (m == 0)
      continue;
    used++;
    /* from home to i: no empty slot, and no other entry with this tag */
    for (size_t k = home_of(m & TAG_MASK, s->shift); k != i;
         k = (k + 1) & s->mask)
      if (s->slots[k].meta == 0 ||
          (s->slots[k].meta & TAG_MASK) == (m & TAG_MASK))
        return KVP_ECORRUPT;
  }
  return used == s->size && used <= s->capacity ? 0 : KVP_ECORRUPT;
}

/* Fewest sketch bits whose linear-counting estimate reaches `sessions`.  For
 * small counts the estimate is the popcount itself (est(k) in [k, k+1) for
 * k <= 8), so "3 sessions" means "3 bits". */
static uint32_t bits_for_sessions(uint32_t sessions) {
  uint32_t k = 1;
  while (k < 64 && kvp__stability_sessions_estimate(k) < (double)sessions)
    k++;
  return k;
}

/* Fills hole by backward shift: each later entry of the run moves into the
 * hole unless its home lies cyclically in (hole, j], where a probe from its
 * home would meet the hole first and stop. */
static void remove_at(kvp_stability *s, size_t hole) {
  for (size_t j = (hole + 1) & s->mask; s->slots[j].meta != 0;
       j = (j + 1) & s->mask) {
    size_t home = home_of(s->slots[j].meta & TAG_MASK, s->shift);
    if (((j - home) & s->mask) >= ((j - hole) & s->mask)) {
      s->slots[hole] = s->slots[j];
      hole = j;
    }
  }
  s->slots[hole] = (entry){0, 0};
  s->size--;
}

/* Epochs since an entry's last touch (stamps count modulo 16; a referenced
 * entry was touched since the hand last passed it, at most a revolution --
 * four epochs -- ago, so the age of one is exact). */
static inline unsigned stamp_age(const kvp_stability *s, uint64_t meta) {
  return (unsigned)(((s->stamp - (meta & STAMP_MASK)) & STAMP_MASK) >>
                    STAMP_SHIFT);
}

/* CLOCK with a bounded sweep: clear reference bits under the hand until an
 * unreferenced entry turns up, and evict it; but after CLOCK_SWEEP slots evict
 * the least recently touched entry the sweep passed (the oldest stamp; the
 * first of equals).  Unbounded, one eviction could sweep the whole table
 * (every entry is referenced the first time it fills): a millisecond on the
 * hot path.  Bounded, the worst case is CLOCK_SWEEP slots (4 KiB,
 * sequential), and a referenced entry is evicted only after a run of
 * CLOCK_SWEEP slots with no unreferenced one, when nearly everything is
 * recent (measured on a stream of new keys at 1,000 entries: ~1 sweep in 200
 * passes 32 slots).  "Nearly" is why the victim is the oldest: taking
 * whatever the hand reached could take an entry of a chain touched by this
 * very request, while keys seen once epochs ago sat in the run (a hot
 * session then lost its semi-stable prefix for a turn).  The hand stays on
 * the evicted slot, or where the sweep stopped: backward shift may have moved
 * an entry there that this sweep has not looked at yet. */
static void clock_evict(kvp_stability *s) {
  assert(s->size > 0);
  size_t victim = SIZE_MAX;
  unsigned oldest = 0;
  for (uint32_t swept = 0;; swept++) {
    entry *e = &s->slots[s->hand];
    if (e->meta != 0) {
      if (!(e->meta & REF_BIT)) {
        remove_at(s, s->hand);
        return;
      }
      unsigned age = stamp_age(s, e->meta);
      if (victim == SIZE_MAX || age > oldest)
        victim = s->hand, oldest = age;
      if (swept >= CLOCK_SWEEP) {
        remove_at(s, victim);
        return;
      }
    }
    e->meta &= ~REF_BIT;
    s->hand = (s->hand + 1) & s->mask;
    s->swept++;
  }
}

/* First sighting of a key: it enters referenced, so the hand gives it one
 * sweep to be seen again.  `slot` is the empty slot its probe ended on. */
static entry *insert(kvp_stability *s, uint64_t tag, uint64_t bit,
                     size_t slot) {
  if (s->size == s->capacity) {
    clock_evict(s);
    slot = home_of(tag, s->shift); /* the shift may have opened a nearer slot */
    while (s->slots[slot].meta != 0)
      slot = (slot + 1) & s->mask;
  }
  uint64_t stable = s->stable_bits <= 1 ? STABLE_BIT : 0;
  s->slots[slot] = (entry){tag | s->stamp | stable | REF_BIT | 1u, bit};
  s->size++;
  return &s->slots[slot];
}

/* A session new to this key (at most 64 times per key): the sketch grows and
 * may reach the stable threshold, latched in meta so that the per-block path
 * never counts bits.  Returns the new meta. */
static uint64_t add_session(const kvp_stability *s, entry *e, uint64_t meta,
                            uint64_t bit) {
  e->sessions |= bit;
  if ((uint32_t)__builtin_popcountll(e->sessions) >= s->stable_bits)
    meta |= STABLE_BIT;
  return meta;
}

/* The table as the per-block loop sees it, copied into the caller's locals:
 * read through *s it would be reloaded after every entry store, which may
 * alias it.  Slots are addressed by byte offset (entries are 16 bytes, past
 * what an x86 address can scale by). */
typedef struct probe_ctx {
  char *base;         /* the slots */
  size_t off_mask;    /* (slots - 1) * sizeof(entry) */
  unsigned shift;     /* home_of's shift less log2(sizeof(entry)) */
  uint32_t semi_seen; /* as in kvp_stability */
  uint64_t bit;       /* this session's sketch bit */
  uint64_t touch;     /* REF_BIT | this call's stamp */
} probe_ctx;

static inline size_t home_off(const probe_ctx *p, uint64_t tag) {
  return (size_t)((tag * FIB) >> p->shift) & ~(sizeof(entry) - 1);
}

/* The previous block's entry in a walk and what it holds after this call's
 * learning (kept in registers: comparing needs no load).  {NULL, ~0, ~0}
 * before the first block: it lacks nothing. */
typedef struct link {
  entry *e;
  uint64_t sessions, seen;
} link;

/* The rest of a probe whose home slot held another key: walks the run, and
 * inserts the key at its end if absent.  Returns the entry, its address + 1
 * if it was just inserted (entries are 16-byte aligned).  Out of line: the
 * per-block path stays straight for the common hit at home. */
#define ADDED ((uintptr_t)1)
static uintptr_t probe_on(kvp_stability *s, const probe_ctx *p, uint64_t tag,
                          size_t off) {
  for (;;) {
    entry *e = (entry *)(p->base + off);
    if ((e->meta & TAG_MASK) == tag)
      return (uintptr_t)e;
    if (e->meta == 0)
      return (uintptr_t)insert(s, tag, p->bit, off / sizeof(entry)) | ADDED;
    off = (off + sizeof(entry)) & p->off_mask;
  }
}

/* Restores nesting between the entries of consecutive blocks of a chain:
 * every request that held block i's key held block i-1's, so what i's entry
 * proves (sessions, sightings, hence stable) is true of i-1.  A pair out of
 * order means i-1 was evicted and is being re-learned (or a fingerprint
 * collided); the fast path's binary search needs the order back. */
static NOINLINE void inherit(const kvp_stability *s, entry *prev,
                             const entry *e) {
  uint64_t m = prev->meta, seen = m & SIGHT_MASK;
  if ((e->meta & SIGHT_MASK) > seen)
    seen = e->meta & SIGHT_MASK;
  prev->sessions |= e->sessions;
  m = (m & ~SIGHT_MASK) | seen;
  if ((uint32_t)__builtin_popcountll(prev->sessions) >= s->stable_bits)
    m |= STABLE_BIT;
  prev->meta = m;
}

/* The learned class of one block from what was known before this sighting,
 * then this sighting learned; off is the tag's home slot.  One probe,
 * normally one cache line.  Sightings saturate at semi_seen: counting further
 * would change nothing.  *lk is the previous block's entry and becomes this
 * one's.  Only a hit uses its pointer: nothing moved since it was set (an
 * insert may move entries, but a new entry, holding this session alone,
 * proves nothing its predecessor lacks: this call just learned it there). */
static ALWAYS_INLINE uint8_t learn_one(kvp_stability *s, const probe_ctx *p,
                                       uint64_t tag, size_t off, link *lk) {
  entry *e = (entry *)(p->base + off);
  if (KVP_UNLIKELY((e->meta & TAG_MASK) != tag)) {
    uintptr_t r = probe_on(s, p, tag, off);
    e = (entry *)(r & ~ADDED);
    if (r & ADDED) { /* first sighting */
      *lk = (link){e, p->bit, 1};
      return KVP_CLASS_VOLATILE;
    }
  }
  uint64_t m = e->meta, sess = e->sessions;
  uint32_t seen = (uint32_t)(m & SIGHT_MASK);
  uint8_t c = (sess & p->bit) != 0 && seen >= p->semi_seen;
  if (m & STABLE_BIT)
    c = KVP_CLASS_STABLE;
  if (KVP_UNLIKELY((sess & p->bit) == 0))
    m = add_session(s, e, m, p->bit);
  m = ((m & ~STAMP_MASK) | p->touch) + (seen < p->semi_seen);
  e->meta = m;
  uint64_t now_sess = sess | p->bit, now_seen = m & SIGHT_MASK;
  if (KVP_UNLIKELY(((now_sess & ~lk->sessions) | (now_seen > lk->seen)) != 0))
    inherit(s, lk->e, e);
  *lk = (link){e, now_sess, now_seen};
  return c;
}

/* ---- one request's walk down its chain ----------------------------------- */
/* Classes only go down along a chain, so the walk keeps the running minimum
 * and where it first fell below stable and below semi. */
typedef struct walk {
  size_t stable_end, semi_end;
  uint8_t run;
} walk;

static inline void walk_step(walk *w, uint8_t c, size_t b) {
  if (KVP_LIKELY(c >= w->run))
    return;
  if (w->run == KVP_CLASS_STABLE)
    w->stable_end = b;
  if (c == KVP_CLASS_VOLATILE)
    w->semi_end = b;
  w->run = c;
}

/* How a run of blocks meets the marks: none cover it (learned classes
 * count), all do (learned classes are ignored: only learning happens), or
 * some do (a coverage bitmap says which). */
typedef enum cover { COVER_NONE, COVER_ALL, COVER_SOME } cover;

/* One block of a walk: learn it, then (unless the marks decide alone) fold
 * its class into the running minimum.  With COVER_SOME, bit (i - base) of
 * cov says block i is covered; a covered block's class becomes 3, which
 * never lowers the minimum (the marks' own classes enter through the plan,
 * at the block where each mark starts). */
static ALWAYS_INLINE walk walk_one(kvp_stability *s, const probe_ctx *p,
                                   link *lk, uint64_t fp, size_t off, size_t i,
                                   cover how, const uint64_t *cov, size_t base,
                                   walk w) {
  uint8_t c = learn_one(s, p, tag_of(fp), off, lk);
  if (how == COVER_ALL)
    return w;
  if (how == COVER_SOME)
    c |= (uint8_t)(((cov[(i - base) >> 6] >> ((i - base) & 63)) & 1u) * 3u);
  walk_step(&w, c, i);
  return w;
}

/* Learns and walks blocks [a, b) of n.  Always inlined, so each call site
 * gets loops specialised for its `how`.  Home slots are computed once,
 * PREFETCH blocks ahead, prefetched, and kept in a ring until their block
 * comes up; the request's last PREFETCH blocks take a second loop, so the
 * first needs no bounds test. */
static ALWAYS_INLINE walk walk_blocks(kvp_stability *s, link *lk,
                                      const kvp_key *keys, size_t n, size_t a,
                                      size_t b, uint64_t bit, cover how,
                                      const uint64_t *cov, size_t base,
                                      walk w) {
  link l = *lk;
  const probe_ctx p = {(char *)s->slots, s->mask * sizeof(entry),
                       s->shift - 4u, s->semi_seen, bit, REF_BIT | s->stamp};
  _Static_assert(sizeof(entry) == 16, "shift - 4 is log2(sizeof(entry))");
  size_t ring[PREFETCH];
  for (size_t i = a; i < a + PREFETCH && i < n; i++) {
    ring[i % PREFETCH] = home_off(&p, tag_of(keys[i].lo));
    __builtin_prefetch(p.base + ring[i % PREFETCH], 1, 3);
  }
  size_t pf_end = n > PREFETCH ? n - PREFETCH : 0, i = a;
  for (; i < b && i < pf_end; i++) {
    size_t off = ring[i % PREFETCH];
    size_t ahead = home_off(&p, tag_of(keys[i + PREFETCH].lo));
    ring[i % PREFETCH] = ahead;
    __builtin_prefetch(p.base + ahead, 1, 3); /* written: ask ownership */
    w = walk_one(s, &p, &l, keys[i].lo, off, i, how, cov, base, w);
  }
  for (; i < b; i++)
    w = walk_one(s, &p, &l, keys[i].lo, ring[i % PREFETCH], i, how, cov, base,
                 w);
  *lk = l;
  return w;
}

/* ---- marks over blocks --------------------------------------------------- */
/* Classes only go down along a chain, so a mark of class c whose first block
 * is f bounds every block >= f by c: two thresholds say it all, injected into
 * the walk at those blocks. */
typedef struct mark_plan {
  size_t semi_from; /* first block touched by a mark of class <= semi */
  size_t vol_from;  /* first block touched by a volatile mark */
} mark_plan;

/* Blocks [*fb, *lb] overlapped by m, clipped to n_blocks; false if none. */
static bool mark_blocks(const kvp_segment_mark *m, uint32_t bs, size_t n_blocks,
                        size_t *fb, size_t *lb) {
  if (m->length == 0 || m->offset / bs >= n_blocks)
    return false;
  *fb = m->offset / bs;
  size_t last = ((size_t)m->offset + m->length - 1) / bs;
  *lb = last < n_blocks ? last : n_blocks - 1;
  return true;
}

static mark_plan plan_marks(const kvp_segment_mark *marks, size_t n_marks,
                            uint32_t bs, size_t n_blocks) {
  mark_plan p = {SIZE_MAX, SIZE_MAX};
  for (size_t k = 0; k < n_marks; k++) {
    size_t fb, lb;
    if (!mark_blocks(&marks[k], bs, n_blocks, &fb, &lb))
      continue;
    uint8_t c = mark_class(&marks[k]);
    if (c <= KVP_CLASS_SEMI && fb < p.semi_from)
      p.semi_from = fb;
    if (c == KVP_CLASS_VOLATILE && fb < p.vol_from)
      p.vol_from = fb;
  }
  return p;
}

/* Sets bits [lo, hi) of a chunk's coverage bitmap. */
static void set_bits(uint64_t *cov, size_t lo, size_t hi) {
  for (size_t k = lo >> 6; k <= (hi - 1) >> 6; k++) {
    uint64_t m = ~0ull;
    if (k == lo >> 6)
      m &= ~0ull << (lo & 63);
    if (k == (hi - 1) >> 6)
      m &= ~0ull >> (63 - ((hi - 1) & 63));
    cov[k] |= m;
  }
}

/* Coverage bitmap of blocks [c0, c0 + len); returns how many are covered.
 * O(n_marks) word operations, however much the marks overlap. */
static size_t cover_chunk(const kvp_segment_mark *marks, size_t n_marks,
                          uint32_t bs, size_t n_blocks, size_t c0, size_t len,
                          uint64_t cov[CHUNK / 64]) {
  memset(cov, 0, CHUNK / 8);
  for (size_t k = 0; k < n_marks; k++) {
    size_t fb, lb;
    if (!mark_blocks(&marks[k], bs, n_blocks, &fb, &lb) || lb < c0 ||
        fb >= c0 + len)
      continue;
    size_t hi = lb < c0 + len - 1 ? lb + 1 : c0 + len;
    set_bits(cov, (fb > c0 ? fb : c0) - c0, hi - c0);
  }
  size_t covered = 0;
  for (size_t k = 0; k < CHUNK / 64; k++)
    covered += (size_t)__builtin_popcountll(cov[k]);
  return covered;
}

/* The marks' caps that start at block a, then the next block where one does
 * (or end). */
static size_t apply_plan(const mark_plan *p, size_t a, size_t end, walk *w) {
  if (a == p->semi_from)
    walk_step(w, KVP_CLASS_SEMI, a);
  if (a == p->vol_from)
    walk_step(w, KVP_CLASS_VOLATILE, a);
  size_t next = end;
  if (p->semi_from > a && p->semi_from < next)
    next = p->semi_from;
  if (p->vol_from > a && p->vol_from < next)
    next = p->vol_from;
  return next;
}

/* The walk with marks over blocks [from, n): chunk by chunk (the coverage
 * bitmap lives on the stack), each chunk split where the plan's caps start
 * (caps starting before `from` are the caller's).  Adds the uncovered blocks
 * to *learned. */
static walk walk_marked(kvp_stability *s, link *lk, const kvp_key *keys,
                        size_t n, size_t from, uint64_t bit,
                        const mark_plan *pl,
                        const kvp_segment_mark *marks, size_t n_marks,
                        uint32_t bs, size_t *learned, walk w) {
  const mark_plan plan = *pl;
  uint64_t cov[CHUNK / 64];
  for (size_t c0 = from; c0 < n; c0 += CHUNK) {
    size_t len = n - c0 < CHUNK ? n - c0 : CHUNK, end = c0 + len;
    size_t covered = cover_chunk(marks, n_marks, bs, n, c0, len, cov);
    *learned += len - covered;
    for (size_t a = c0, b; a < end; a = b) {
      b = apply_plan(&plan, a, end, &w);
      if (covered == len)
        w = walk_blocks(s, lk, keys, n, a, b, bit, COVER_ALL, NULL, c0, w);
      else if (covered == 0)
        w = walk_blocks(s, lk, keys, n, a, b, bit, COVER_NONE, NULL, c0, w);
      else
        w = walk_blocks(s, lk, keys, n, a, b, bit, COVER_SOME, cov, c0, w);
    }
  }
  return w;
}

/* ---- fast path ----------------------------------------------------------- */
/* Read-only lookup; NULL if absent. */
static entry *find(const kvp_stability *s, uint64_t fp) {
  uint64_t tag = tag_of(fp);
  for (size_t i = home_of(tag, s->shift);; i = (i + 1) & s->mask) {
    entry *e = &s->slots[i];
    if ((e->meta & TAG_MASK) == tag)
      return e;
    if (e->meta == 0)
      return NULL;
  }
}

/* Learning this block again would change nothing but its reference bit and
 * stamp: this session's bit is set and the sightings are saturated. */
static inline bool settled(const kvp_stability *s, const entry *e,
                           uint64_t bit) {
  return e != NULL && (e->sessions & bit) != 0 &&
         (e->meta & SIGHT_MASK) >= s->semi_seen;
}

/* Where the fast path may start: blocks [0, b) settled, [b, n) to walk, and
 * [0, stable_end) of them stable. */
typedef struct fast_plan {
  size_t b, stable_end;
  entry *anchor; /* block b-1's entry */
} fast_plan;

/* First block of (lo, hi) where pred fails, given that it holds at lo and
 * fails at hi (hi itself if it never fails in between); *last = the entry
 * at the returned index - 1.  Binary search: pred is monotone along a chain
 * whose entries are all present. */
#define BSEARCH(s, keys, lo, hi, last, pred)                                   \
  do {                                                                         \
    while ((hi) - (lo) > 1) {                                                  \
      size_t mid_ = (lo) + ((hi) - (lo)) / 2;                                  \
      entry *e_ = find((s), (keys)[mid_].lo);                                  \
      if (pred) {                                                              \
        (lo) = mid_;                                                           \
        (last) = e_;                                                           \
      } else {                                                                 \
        (hi) = mid_;                                                           \
      }                                                                        \
    }                                                                          \
  } while (0)

/* Finds b and the stable boundary by binary search, read-only but for block
 * b-1's reference bit.  False when the per-block path must run over the whole
 * request: nothing settled (b = 0), b-1 not touched in this epoch (its prefix
 * may have lost entries to CLOCK), or a missing entry inside [0, b) seen on
 * the way (a forced eviction: re-learn it now). */
static bool plan_fast(kvp_stability *s, const kvp_key *keys, size_t n,
                      uint64_t bit, fast_plan *fp) {
  entry *anchor = find(s, keys[n - 1].lo), *first = NULL;
  size_t lo = n - 1, hi = n;
  if (!settled(s, anchor, bit)) {
    first = find(s, keys[0].lo);
    if (!settled(s, first, bit))
      return false;
    lo = 0, hi = n - 1, anchor = first;
    BSEARCH(s, keys, lo, hi, anchor, settled(s, e_, bit));
  }
  if ((anchor->meta & STAMP_MASK) != s->stamp)
    return false;
  anchor->meta |= REF_BIT;
  fp->anchor = anchor;
  fp->b = hi;
  fp->stable_end = hi;
  if (anchor->meta & STABLE_BIT)
    return true;
  if (first == NULL && (first = find(s, keys[0].lo)) == NULL)
    return false;
  if (!(first->meta & STABLE_BIT)) {
    fp->stable_end = 0;
    return true;
  }
  /* stable at 0, not at b-1; a missing or unsettled entry in between is a
   * hole in the prefix */
  lo = 0, hi = fp->b - 1;
  bool hole = false;
  entry *unused = NULL;
  BSEARCH(s, keys, lo, hi, unused,
          (hole |= !settled(s, e_, bit), e_ && (e_->meta & STABLE_BIT)));
  (void)unused;
  fp->stable_end = hi;
  return !hole;
}

/* ---- session hints ------------------------------------------------------- */
/* plan_fast's binary searches are ~2 log2(n) dependent probes, nearly all
 * memory misses in multi-turn traffic (each turn moves the midpoints onto
 * keys not probed before): ~20 serial misses for 2,048 blocks, more than the
 * new turn's prefetched walk.  But a conversation's next request re-sends
 * its last one and appends, so its searches most likely end where the last
 * request ended (settled up to its length, stable up to the same block).
 * Knowing the answer, the path a binary search takes to it is known, so all
 * its probes are prefetched at once (with the new turn's first WALK_AHEAD
 * slots, which the walk would otherwise meet cold) and the searches then run
 * as before and hit cache.  A hint only chooses what to prefetch: the
 * searches take the same steps whatever it says, so results and table state
 * never depend on hints (tests compare the tables byte for byte), and a hint
 * needs no epoch or verification; a stale or wrong one, or two sessions on
 * one slot, costs a few wasted prefetches.  Direct-mapped,
 * one slot per KEYS_PER_HINT tracked keys: about the number of long
 * conversations the table can hold at once. */
typedef struct hint {
  uint32_t check;      /* session_mix bits 26..57, | 1; 0: empty slot */
  uint32_t last;       /* low 32 bits of the request's last fingerprint */
  uint32_t n;          /* the request's blocks */
  uint32_t stable_end; /* the stable boundary it found, or its walk did */
} hint;
_Static_assert(sizeof(hint) == 16, "four hints per cache line");

static inline uint32_t hint_check(uint64_t mix) {
  return (uint32_t)(mix >> 26) | 1u;
}

static inline void prefetch_key(const kvp_stability *s, uint64_t fp) {
  __builtin_prefetch(&s->slots[home_of(tag_of(fp), s->shift)], 0, 3);
}

/* Prefetches the probes of BSEARCH over (lo, hi) if it ends at `want`. */
static void prefetch_path(const kvp_stability *s, const kvp_key *keys,
                          size_t lo, size_t hi, size_t want) {
  while (hi - lo > 1) {
    size_t mid = lo + (hi - lo) / 2;
    prefetch_key(s, keys[mid].lo);
    if (mid < want)
      lo = mid;
    else
      hi = mid;
  }
}

/* Prefetches what plan_fast will probe: its two opening probes, then, if the
 * session's hint says this request extends its last one, both searches'
 * paths to where they ended last time.  Returns whether the hint matched. */
static bool prefetch_plan(const kvp_stability *s, const kvp_key *keys,
                          size_t n, const hint *h, uint32_t check) {
  prefetch_key(s, keys[n - 1].lo);
  prefetch_key(s, keys[0].lo);
  if (h->check != check || h->n == 0 || h->n > n ||
      (uint32_t)keys[h->n - 1].lo != h->last)
    return false;
  size_t b = h->n, st = h->stable_end;
  if (b < n) /* keys[n-1] new: settled is searched in (0, n-1) */
    prefetch_path(s, keys, 0, n - 1, b);
  if (st > 0 && st < b) /* first stable, b-1 not: searched in (0, b-1) */
    prefetch_path(s, keys, 0, b - 1, st);
  for (size_t i = b; i < n && i < b + WALK_AHEAD; i++) /* the new turn: */
    __builtin_prefetch(&s->slots[home_of(tag_of(keys[i].lo), s->shift)], 1,
                       3); /* written: ask ownership */
  return true;
}

/* The walk over the settled blocks [0, b) without probing them: learned
 * class stable below stable_end, semi from there; marks cap as in the plan.
 * Events applied in block order, as the per-block walk would meet them. */
static walk walk_settled(const fast_plan *fp, const mark_plan *pl,
                         const kvp_segment_mark *marks, size_t n_marks,
                         uint32_t bs, size_t n, size_t *learned, walk w) {
  size_t drop = fp->b; /* first uncovered block >= stable_end */
  uint64_t cov[CHUNK / 64];
  for (size_t c0 = 0; c0 < fp->b; c0 += CHUNK) {
    size_t len = fp->b - c0 < CHUNK ? fp->b - c0 : CHUNK;
    size_t covered = n_marks ? cover_chunk(marks, n_marks, bs, n, c0, len, cov)
                             : 0;
    *learned += len - covered;
    for (size_t i = fp->stable_end > c0 ? fp->stable_end - c0 : 0;
         drop == fp->b && i < len; i++)
      if (covered == 0 || !((cov[i >> 6] >> (i & 63)) & 1u))
        drop = c0 + i;
  }
  size_t at[3] = {drop, pl->semi_from, pl->vol_from};
  uint8_t cls[3] = {KVP_CLASS_SEMI, KVP_CLASS_SEMI, KVP_CLASS_VOLATILE};
  for (;;) { /* smallest event below b first */
    int k = -1;
    for (int j = 0; j < 3; j++)
      if (at[j] < fp->b && (k < 0 || at[j] < at[k]))
        k = j;
    if (k < 0)
      return w;
    walk_step(&w, cls[k], at[k]);
    at[k] = SIZE_MAX;
  }
}

/* ---- internals for tests ------------------------------------------------- */
void kvp__stability_set_fast(kvp_stability *s, bool on) { s->fast = on; }

void kvp__stability_set_hints(kvp_stability *s, bool on) { s->hinted = on; }

uint64_t kvp__stability_hint_calls(const kvp_stability *s) {
  return s->hint_calls;
}

uint64_t kvp__stability_fast_calls(const kvp_stability *s) {
  return s->fast_calls;
}

bool kvp__stability_same(const kvp_stability *a, const kvp_stability *b) {
  return a->mask == b->mask && a->size == b->size && a->hand == b->hand &&
         a->swept == b->swept &&
         memcmp(a->slots, b->slots, (a->mask + 1) * sizeof(entry)) == 0;
}

int kvp__stability_lookup(const kvp_stability *s, uint64_t fp,
                          kvp__stability_entry *out) {
  const entry *e = find(s, fp);
  if (e == NULL)
    return KVP_ENOENT;
  *out = (kvp__stability_entry){e->sessions, (uint32_t)(e->meta & SIGHT_MASK),
                                (e->meta & STABLE_BIT) != 0,
                                (e->meta & REF_BIT) != 0};
  return 0;
}

int kvp__stability_forget(kvp_stability *s, uint64_t fp) {
  entry *e = find(s, fp);
  if (e == NULL)
    return KVP_ENOENT;
  remove_at(s, (size_t)(e - s->slots));
  return 0;
}

void kvp__stability_advance_epoch(kvp_stability *s) {
  s->swept += (uint64_t)1 << s->epoch_shift;
}

/* ---- classifier API ------------------------------------------------------ */
/* The table is probed at random: with 4 KiB pages nearly every block of a
 * long prompt lands on its own page and misses the TLB, which costs more than
 * the probe (measured: 2,048 blocks on a 32 MiB table, ~2x).  Ask for
 * transparent huge pages; only on memory from the default allocator (what a
 * caller's allocator hands out is not ours to re-advise), and only as a hint:
 * failure changes nothing but speed.  The table is then zeroed by writing,
 * not by calloc's untouched pages: a first READ maps the shared zero page,
 * and the write fault after it gets 4 KiB pages, advice or not.  So the
 * whole table is resident from create on -- it is sized to be filled. */
static void advise_huge(void *p, size_t bytes) {
#if defined(MADV_HUGEPAGE)
  const uintptr_t huge = (uintptr_t)2 << 20;
  uintptr_t lo = ((uintptr_t)p + huge - 1) & ~(huge - 1);
  uintptr_t hi = ((uintptr_t)p + bytes) & ~(huge - 1);
  if (hi > lo)
    (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

int kvp_stability_create(const kvp_stability_opts *opts,
                         const kvp_allocator *alloc, kvp_stability **out) {
  if (out == NULL)
    return KVP_EINVAL;
  *out = NULL;
  kvp_stability_opts o = opts ? *opts : (kvp_stability_opts){0};
  uint64_t capacity = o.capacity ? o.capacity : (1u << 20);
  uint32_t stable = o.stable_sessions ? o.stable_sessions : 3;
  uint32_t semi = o.semi_repeats ? o.semi_repeats : 2;
  if (stable > STABLE_SESSIONS_MAX || semi < 2 || semi > SEMI_REPEATS_MAX)
    return KVP_EINVAL;
  uint64_t want = (capacity * 4 + 2) / 3, slots = 8;
  while (slots < want)
    slots <<= 1;
  if (slots > SIZE_MAX / sizeof(entry))
    return KVP_ENOMEM;
  size_t hints = 8;
  while (hints < capacity / KEYS_PER_HINT)
    hints <<= 1;

  kvp_allocator a = kvp__allocator(alloc);
  kvp_stability *s = kvp__calloc(&a, 1, sizeof *s);
  if (s == NULL)
    goto fail_struct;
  size_t bytes = (size_t)slots * sizeof(entry);
  s->slots = kvp__malloc(&a, bytes);
  if (s->slots == NULL)
    goto fail_slots;
  if (alloc == NULL || alloc->alloc == NULL)
    advise_huge(s->slots, bytes);
  memset(s->slots, 0, bytes); /* written, not calloc'd: see advise_huge */
  s->hints = kvp__calloc(&a, hints, sizeof(hint));
  if (s->hints == NULL)
    goto fail_hints;
  s->hint_mask = hints - 1;
  s->alloc = a;
  s->mask = (size_t)slots - 1;
  s->shift = 64u - (unsigned)__builtin_ctzll(slots);
  s->capacity = (size_t)capacity;
  s->epoch_shift = (unsigned)__builtin_ctzll(slots) - 2; /* slots >= 8 */
  s->stable_bits = bits_for_sessions(stable);
  s->semi_seen = semi - 1;
  s->fast = true;
  s->hinted = true;
  *out = s;
  return 0;

fail_hints:
  kvp__free(&a, s->slots, bytes);
fail_slots:
  kvp__free(&a, s, sizeof *s);
fail_struct:
  return KVP_ENOMEM;
}

void kvp_stability_destroy(kvp_stability *s) {
  if (s == NULL)
    return;
  kvp_allocator a = s->alloc;
  kvp__free(&a, s->hints, (s->hint_mask + 1) * sizeof(hint));
  kvp__free(&a, s->slots, (s->mask + 1) * sizeof(entry));
  kvp__free(&a, s, sizeof *s);
}

size_t kvp_stability_size(const kvp_stability *s) {
  return s != NULL ? s->size : 0;
}

static bool observe_args_ok(const kvp_stability *s, const kvp_key *keys,
                            size_t n_blocks, uint32_t block_size,
                            const kvp_segment_mark *marks, size_t n_marks,
                            const kvp_classification *out) {
  if (s == NULL || out == NULL || (keys == NULL && n_blocks > 0))
    return false;
  if (block_size == 0 || block_size > KVP_BLOCK_SIZE_MAX)
    return false;
  if (n_blocks > UINT32_MAX) /* the block boundaries are reported as u32 */
    return false;
  return marks_valid(marks, n_marks);
}

int kvp_stability_observe(kvp_stability *s, uint64_t session,
                          const kvp_key *keys, size_t n_blocks,
                          uint32_t block_size, size_t tail,
                          const kvp_segment_mark *marks, size_t n_marks,
                          kvp_classification *out) {
  if (!observe_args_ok(s, keys, n_blocks, block_size, marks, n_marks, out))
    return KVP_EINVAL;
  uint64_t mix = session_mix(session), bit = 1ull << (mix >> 58);
  s->stamp = ((s->swept >> s->epoch_shift) % EPOCHS) << STAMP_SHIFT;
  walk w = {n_blocks, n_blocks, KVP_CLASS_STABLE};
  size_t learned = 0;
  fast_plan fp = {0, 0, NULL};
  bool fast = s->fast && n_blocks >= FAST_MIN;
  hint *h = fast && s->hinted ? &s->hints[mix & s->hint_mask] : NULL;
  if (h != NULL && prefetch_plan(s, keys, n_blocks, h, hint_check(mix)))
    s->hint_calls++;
  if (!fast || !plan_fast(s, keys, n_blocks, bit, &fp))
    fp = (fast_plan){0, 0, NULL};
  else
    s->fast_calls++;
  link lk = {NULL, ~0ull, ~0ull}; /* the walk from b goes on from b-1 */
  if (fp.anchor != NULL)
    lk = (link){fp.anchor, fp.anchor->sessions, fp.anchor->meta & SIGHT_MASK};
  mark_plan plan = {SIZE_MAX, SIZE_MAX};
  if (n_marks > 0)
    plan = plan_marks(marks, n_marks, block_size, n_blocks);
  if (fp.b > 0)
    w = walk_settled(&fp, &plan, marks, n_marks, block_size, n_blocks, &learned,
                     w);
  if (n_marks == 0) {
    w = walk_blocks(s, &lk, keys, n_blocks, fp.b, n_blocks, bit, COVER_NONE,
                    NULL, 0, w);
    learned += n_blocks - fp.b;
  } else {
    w = walk_marked(s, &lk, keys, n_blocks, fp.b, bit, &plan, marks, n_marks,
                    block_size, &learned, w);
  }
  if (h != NULL) /* the walk's stable_end if no fast plan: a guess is fine */
    *h = (hint){hint_check(mix), (uint32_t)keys[n_blocks - 1].lo,
                (uint32_t)n_blocks,
                (uint32_t)(fp.b > 0 ? fp.stable_end : w.stable_end)};
  memset(out, 0, sizeof *out);
  out->tokens[KVP_CLASS_STABLE] = (uint64_t)w.stable_end * block_size;
  out->tokens[KVP_CLASS_SEMI] =
      (uint64_t)(w.semi_end - w.stable_end) * block_size;
  out->tokens[KVP_CLASS_VOLATILE] =
      (uint64_t)(n_blocks - w.semi_end) * block_size + tail;
  out->stable_end = (uint32_t)w.stable_end;
  out->semi_end = (uint32_t)w.semi_end;
  out->n_blocks = (uint32_t)n_blocks;
  out->learned_blocks = (uint32_t)learned;
  return 0;
}

/* ---- drift --------------------------------------------------------------- */
/* Polynomial hash of token windows modulo the Mersenne prime 2^61 - 1: unlike
 * arithmetic mod 2^64 it has no Thue-Morse blind spot, so crafted prompts
 * cannot make every window collide (memcmp would still keep counts exact, but
 * the scan would go quadratic). */
#define RK_P ((1ull << 61) - 1)
#define RK_BASE 0x16A09E667F3BCC9ull /* < RK_P, > any token id + 1 */
#define FOUND 1u /* on a group representative: its content occurs in cur */
#define SAME 2u  /* on a block: its content occurs in cur at its own offset */

static inline uint64_t rk_mul(uint64_t a, uint64_t b) {
  unsigned __int128 p = (unsigned __int128)a * b;
  uint64_t r = ((uint64_t)p & RK_P) + (uint64_t)(p >> 61);
  return r >= RK_P ? r - RK_P : r;
}

static inline uint64_t rk_add(uint64_t a, uint64_t b) {
  uint64_t r = a + b;
  return r >= RK_P ? r - RK_P : r;
}

static uint64_t rk_hash(const uint32_t *t, size_t n) {
  uint64_t h = 0;
  for (size_t i = 0; i < n; i++)
    h = rk_add(rk_mul(h, RK_BASE), (uint64_t)t[i] + 1);
  return h;
}

/* The previous turn's blocks [d, np) grouped by content: blocks with equal
 * tokens share a representative, so a window is confirmed against each
 * distinct content once and repeated blocks cost nothing extra. */
typedef struct rk_set {
  const uint32_t *prev;
  size_t d, m, bs; /* first block, block count, block size */
  uint64_t *hash;  /* [m] window hash of each block */
  uint32_t *group; /* [m] local index of the block's representative */
  uint8_t *flags;  /* [m] FOUND / SAME */
  uint32_t *table; /* [tmask + 1] representative + 1; 0 = empty */
  size_t tmask;
  unsigned tshift;
} rk_set;

static inline const uint32_t *rk_block(const rk_set *r, size_t l) {
  return r->prev + (r->d + l) * r->bs;
}

static void rk_insert(rk_set *r, size_t l) {
  const size_t bytes = r->bs * sizeof(uint32_t);
  size_t i = (size_t)((r->hash[l] * FIB) >> r->tshift);
  for (; r->table[i] != 0; i = (i + 1) & r->tmask) {
    uint32_t rep = r->table[i] - 1;
    if (r->hash[rep] == r->hash[l] &&
        memcmp(rk_block(r, rep), rk_block(r, l), bytes) == 0) {
      r->group[l] = rep;
      return;
    }
  }
  r->table[i] = (uint32_t)l + 1;
  r->group[l] = (uint32_t)l;
}

/* The window at token p of cur, with hash h: marks the content group it
 * equals as found, and the block of prev at the same offset as SAME if that
 * block is in the group.  Confirms by memcmp only when it can change a flag,
 * which bounds the memcmp work by O(n) outside of hash collisions. */
static void rk_probe(rk_set *r, const uint32_t *window, size_t p, uint64_t h) {
  const size_t bytes = r->bs * sizeof(uint32_t);
  size_t q = p / r->bs; /* prev block at this offset, if aligned */
  bool aligned = p % r->bs == 0 && q >= r->d && q - r->d < r->m;
  size_t i = (size_t)((h * FIB) >> r->tshift);
  for (; r->table[i] != 0; i = (i + 1) & r->tmask) {
    uint32_t rep = r->table[i] - 1;
    if (r->hash[rep] != h)
      continue;
    bool same = aligned && r->group[q - r->d] == rep;
    if ((r->flags[rep] & FOUND) && !same)
      continue; /* nothing to learn from this group; a colliding one may */
    if (memcmp(rk_block(r, rep), window, bytes) != 0)
      continue; /* a true hash collision: another group may still match */
    r->flags[rep] |= FOUND;
    if (same)
      r->flags[q - r->d] |= SAME;
    return;
  }
}

static void rk_scan(rk_set *r, const kvp_turn_view *cur, size_t from) {
  const size_t bs = r->bs;
  if (cur->n_tokens < bs || from > cur->n_tokens - bs)
    return;
  uint64_t top = 1; /* RK_BASE^(bs-1): weight of the token leaving */
  for (size_t i = 1; i < bs; i++)
    top = rk_mul(top, RK_BASE);
  const uint32_t *t = cur->tokens;
  uint64_t h = rk_hash(t + from, bs);
  for (size_t p = from;; p++) {
    rk_probe(r, t + p, p, h);
    if (p + bs >= cur->n_tokens)
      break;
    uint64_t out = rk_mul((uint64_t)t[p] + 1, top);
    h = rk_add(rk_mul(rk_add(h, RK_P - out), RK_BASE), (uint64_t)t[p + bs] + 1);
  }
}

/* One allocation for all of rk_set's arrays, largest alignment first. */
static int rk_alloc(rk_set *r, const kvp_allocator *a, size_t *bytes) {
  size_t tslots = 8;
  while (tslots < 2 * r->m)
    tslots <<= 1;
  size_t total = r->m * (sizeof(uint64_t) + sizeof(uint32_t) + 1) +
                 tslots * sizeof(uint32_t);
  uint8_t *p = kvp__calloc(a, 1, total);
  if (p == NULL)
    return KVP_ENOMEM;
  r->hash = (uint64_t *)p;
  r->group = (uint32_t *)(p + r->m * sizeof(uint64_t));
  r->table = r->group + r->m;
  r->flags = (uint8_t *)(r->table + tslots);
  r->tmask = tslots - 1;
  r->tshift = 64u - (unsigned)__builtin_ctzll(tslots);
  *bytes = total;
  return 0;
}

/* Fills reappearing/shifted tokens for prev's blocks [d, np). */
static int find_reappearing(const kvp_turn_view *prev, const kvp_turn_view *cur,
                            size_t d, uint32_t bs, const kvp_allocator *alloc,
                            kvp_drift_report *out) {
  rk_set r = {.prev = prev->tokens, .d = d, .m = prev->n_blocks - d, .bs = bs};
  if (r.m == 0)
    return 0;
  size_t bytes;
  int rc = rk_alloc(&r, alloc, &bytes);
  if (rc < 0)
    return rc;
  for (size_t l = 0; l < r.m; l++) {
    r.hash[l] = rk_hash(rk_block(&r, l), bs);
    rk_insert(&r, l);
  }
  rk_scan(&r, cur, d * bs);
  for (size_t l = 0; l < r.m; l++) {
    if (!(r.flags[r.group[l]] & FOUND))
      continue;
    out->reappearing_tokens += bs;
    if (!(r.flags[l] & SAME))
      out->shifted_tokens += bs;
  }
  kvp__free(alloc, r.hash, bytes);
  return 0;
}

/* Role of the narrowest mark covering token t (the most specific segment);
 * -1 if none. */
static int role_at(const kvp_segment_mark *marks, size_t n, uint64_t t) {
  int role = -1;
  uint64_t best = UINT64_MAX;
  for (size_t k = 0; k < n; k++) {
    const kvp_segment_mark *m = &marks[k];
    if (t >= m->offset && t - m->offset < m->length && m->length < best) {
      best = m->length;
      role = m->role;
    }
  }
  return role;
}

static bool turn_valid(const kvp_turn_view *t, uint32_t bs) {
  size_t need;
  if (t == NULL || (t->keys == NULL && t->n_blocks > 0) ||
      (t->tokens == NULL && t->n_tokens > 0))
    return false;
  if (t->n_blocks > UINT32_MAX || !kvp__mul_ok(t->n_blocks, bs, &need) ||
      t->n_tokens < need)
    return false;
  return marks_valid(t->marks, t->n_marks);
}

int kvp_drift_compare(const kvp_turn_view *prev, const kvp_turn_view *cur,
                      uint32_t block_size, const kvp_allocator *alloc,
                      kvp_drift_report *out) {
  if (out == NULL || block_size == 0 || block_size > KVP_BLOCK_SIZE_MAX ||
      !turn_valid(prev, block_size) || !turn_valid(cur, block_size))
    return KVP_EINVAL;
  memset(out, 0, sizeof *out);
  out->first_diverging_block = -1;
  out->role = KVP_ROLE_OTHER;
  size_t n = prev->n_blocks < cur->n_blocks ? prev->n_blocks : cur->n_blocks;
  size_t d = 0;
  while (d < n && kvp_key_eq(prev->keys[d], cur->keys[d]))
    d++;
  out->common_prefix_tokens = (uint64_t)d * block_size;
  if (d == prev->n_blocks) /* equal, or cur extends prev block for block */
    return 0;
  out->first_diverging_block = (int64_t)d;
  uint64_t t = (uint64_t)d * block_size;
  int role = role_at(cur->marks, cur->n_marks, t);
  if (role < 0)
    role = role_at(prev->marks, prev->n_marks, t);
  out->role = (uint8_t)(role < 0 ? KVP_ROLE_OTHER : role);
  out->lost_tokens = (uint64_t)(prev->n_blocks - d) * block_size;
  kvp_allocator a = kvp__allocator(alloc);
  int rc = find_reappearing(prev, cur, d, block_size, &a, out);
  return rc < 0 ? rc : 0;
}
