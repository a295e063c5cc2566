/* SPDX-License-Identifier: Apache-2.0 */
/* The NVMe admission gate: "store a block only when its expected reuse pays
 * for the write", with the reuse probability learned online per (stability
 * class, reuse count) cell from NVMe outcomes and from ghosts of rejected
 * blocks.  Pure in-memory: no I/O, no clock (kvplane-bench runs it as is).
 * The rule is documented in include/kvplane/tier.h. */
#include <assert.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "core_internal.h"
#include "kvtier_place.h"

#define NCELL (KVP_CLASS_COUNT_ * TIER_ADMIT_BUCKETS)
#define GHOST_MAX (UINT32_C(1) << 24)

typedef struct cell {
  double reused, n; /* decayed counts */
} cell;

struct tier_admit {
  kvp_allocator a;
  tier_admit_opts o; /* resolved: no zero means-default left */
  cell c[NCELL];
  /* fingerprint with the low 4 bits = cell + 1; 0 empty.  Only a gate
   * that can reject keeps one: mode all never rejects, so it has none
   * (NULL) until its mode changes (ghosts_need). */
  uint64_t *ghost;
  uint32_t ghost_mask;
};

/* a's ghost table, allocated the first time its mode can reject. */
static int ghosts_need(tier_admit *a) {
  if (a->ghost != NULL || a->o.mode == KVP_TIER_ADMIT_ALL)
    return 0;
  a->ghost = kvp__calloc(&a->a, (size_t)a->ghost_mask + 1, sizeof *a->ghost);
  return a->ghost != NULL ? 0 : KVP_ENOMEM;
}

int kvp_tier_admission_parse(const char *name, kvp_tier_admission *out) {
  static const char *const names[] = {"gate", "hits", "all"};
  if (name == NULL || out == NULL)
    return KVP_EINVAL;
  for (int i = 0; i < KVP_TIER_ADMIT_COUNT_; i++)
    if (strcmp(name, names[i]) == 0) {
      *out = (kvp_tier_admission)i;
      return 0;
    }
  return KVP_EINVAL;
}

const char *kvp_tier_admission_name(kvp_tier_admission a) {
  switch (a) {
  case KVP_TIER_ADMIT_GATE: return "gate";
  case KVP_TIER_ADMIT_HITS: return "hits";
  case KVP_TIER_ADMIT_ALL: return "all";
  default: return "unknown";
  }
}

/* Fills the defaults of o into r; KVP_EINVAL when o is out of range. */
static int resolve(const tier_admit_opts *o, tier_admit_opts *r) {
  static const tier_admit_opts zero;
  *r = o ? *o : zero;
  if ((unsigned)r->mode >= KVP_TIER_ADMIT_COUNT_ || !isfinite(r->write_weight) ||
      r->write_weight < 0 || r->ghost_slots > GHOST_MAX)
    return KVP_EINVAL;
  r->volatile_min_hits = r->volatile_min_hits ? r->volatile_min_hits : 1;
  r->write_weight = r->write_weight > 0 ? r->write_weight : 1.0;
  r->min_samples = r->min_samples ? r->min_samples : 32;
  r->window = r->window ? r->window : 1024;
  if ((uint64_t)r->window < 2 * (uint64_t)r->min_samples)
    return KVP_EINVAL;
  uint32_t g = 1;
  while (g < (r->ghost_slots ? r->ghost_slots : 65536))
    g *= 2;
  r->ghost_slots = g;
  return 0;
}

int kvp__tier_admit_create(const tier_admit_opts *o,
                           const kvp_allocator *alloc, tier_admit **out) {
  tier_admit_opts r;
  if (out == NULL || resolve(o, &r) < 0)
    return KVP_EINVAL;
  tier_admit *a = kvp__calloc(alloc, 1, sizeof *a);
  if (a == NULL)
    return KVP_ENOMEM;
  a->a = kvp__allocator(alloc);
  a->o = r;
  a->ghost_mask = r.ghost_slots - 1;
  if (ghosts_need(a) < 0) {
    kvp__free(&a->a, a, sizeof *a);
    return KVP_ENOMEM;
  }
  *out = a;
  return 0;
}

void kvp__tier_admit_destroy(tier_admit *a) {
  if (a == NULL)
    return;
  if (a->ghost != NULL)
    kvp__free(&a->a, a->ghost, ((size_t)a->ghost_mask + 1) * sizeof *a->ghost);
  kvp_allocator al = a->a;
  kvp__free(&al, a, sizeof *a);
}

int kvp__tier_admit_opts_set(tier_admit *a, const tier_admit_opts *o) {
  tier_admit_opts r;
  if (a == NULL || resolve(o, &r) < 0)
    return KVP_EINVAL;
  r.ghost_slots = a->o.ghost_slots;
  tier_admit_opts was = a->o;
  a->o = r;
  if (ghosts_need(a) < 0) { /* left as it was */
    a->o = was;
    return KVP_ENOMEM;
  }
  return 0;
}

void kvp__tier_admit_opts_get(const tier_admit *a, tier_admit_opts *o) {
  if (a != NULL && o != NULL)
    *o = a->o;
}

static int cell_of(kvp_class cls, uint32_t hits) {
  unsigned c = (unsigned)cls < KVP_CLASS_COUNT_ ? (unsigned)cls : 0;
  unsigned b = hits < TIER_ADMIT_BUCKETS ? hits : TIER_ADMIT_BUCKETS - 1;
  return (int)(c * TIER_ADMIT_BUCKETS + b);
}

tier_cell kvp__tier_admit_cell(kvp_class cls, uint32_t hits) {
  return (tier_cell)(cell_of(cls, hits) + 1);
}

int kvp__tier_admit_pays(double p, const tier_admit_cost *c,
                         double write_weight) {
  if (c == NULL || !(p > 0))
    return 0;
  double w = write_weight > 0 ? write_weight : 1.0;
  return p * (c->recompute_s - c->read_s) >= w * c->write_s;
}

static double estimate(const cell *c) { return (c->reused + 1) / (c->n + 2); }

int kvp__tier_admit_decide(const tier_admit *a, kvp_class cls, uint32_t hits,
                           const tier_admit_cost *c) {
  if (a == NULL || a->o.mode == KVP_TIER_ADMIT_ALL)
    return 1;
  const cell *ce = &a->c[cell_of(cls, hits)];
  bool model = a->o.mode == KVP_TIER_ADMIT_GATE && c != NULL &&
               c->recompute_s > 0 && ce->n >= a->o.min_samples;
  if (!model) /* rule 1: write-through-selective */
    return cls >= KVP_CLASS_SEMI || hits >= a->o.volatile_min_hits;
  return kvp__tier_admit_pays(estimate(ce), c, a->o.write_weight);
}

double kvp__tier_admit_p(const tier_admit *a, kvp_class cls, uint32_t hits,
                         double *outcomes) {
  if (a == NULL)
    return 0;
  const cell *ce = &a->c[cell_of(cls, hits)];
  if (outcomes != NULL)
    *outcomes = ce->n;
  return estimate(ce);
}

static void note_cell(tier_admit *a, int ci, int reused) {
  cell *c = &a->c[ci];
  c->n += 1;
  c->reused += reused != 0;
  if (c->n > a->o.window) {
    c->n *= 0.5;
    c->reused *= 0.5;
  }
}

void kvp__tier_admit_note(tier_admit *a, kvp_class cls, uint32_t hits,
                          int reused) {
  if (a != NULL)
    note_cell(a, cell_of(cls, hits), reused);
}

void kvp__tier_admit_note_cell(tier_admit *a, tier_cell tok, bool reused) {
  assert(tok <= NCELL);
  if (a != NULL && tok != 0)
    note_cell(a, tok - 1, reused);
}

/* Ghost slots hold the fingerprint's high 60 bits and cell + 1 (1..9) in
 * the low 4: a nonzero word is a ghost. */
static uint32_t ghost_idx(const tier_admit *a, uint64_t fp) {
  return (uint32_t)((fp * 0x9E3779B97F4A7C15ull) >> 40) & a->ghost_mask;
}

void kvp__tier_admit_reject(tier_admit *a, uint64_t fp, kvp_class cls,
                            uint32_t hits) {
  if (a == NULL || a->ghost == NULL) /* mode all: decide never says no */
    return;
  uint64_t *g = &a->ghost[ghost_idx(a, fp)];
  uint64_t v = (fp & ~UINT64_C(15)) | kvp__tier_admit_cell(cls, hits);
  if (*g != 0 && *g != v) /* displaced before it came back: not reused */
    kvp__tier_admit_note_cell(a, (tier_cell)(*g & 15), false);
  *g = v;
}

int kvp__tier_admit_seen(tier_admit *a, uint64_t fp) {
  if (a == NULL || a->ghost == NULL) /* no gate, or one that never rejected */
    return 0;
  uint64_t *g = &a->ghost[ghost_idx(a, fp)];
  if (*g == 0 || (*g & ~UINT64_C(15)) != (fp & ~UINT64_C(15)))
    return 0;
  kvp__tier_admit_note_cell(a, (tier_cell)(*g & 15), true);
  *g = 0;
  return 1;
}
