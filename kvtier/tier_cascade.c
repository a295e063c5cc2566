/* SPDX-License-Identifier: Apache-2.0 */
/* The placement cascade: a full tier's victims, each with its destination
 * (the next tier present, through the NVMe admission gate, or dropped).
 * Pure: no I/O, no locks, no clock (kvtier_place.h); kvtier's store and
 * kvplane-bench's simulated engines run it. */
#include <assert.h>

#include "core_internal.h"
#include "kvtier_place.h"

struct tier_cascade {
  kvp_allocator a;
  tier_policy *pol[TIER_CASCADE_TIERS];
  uint64_t cap[TIER_CASCADE_TIERS];
  tier_admit *gate;
};

void kvp__tier_cascade_destroy(tier_cascade *c) {
  if (c == NULL)
    return;
  for (int k = 0; k < TIER_CASCADE_TIERS; k++)
    kvp__tier_policy_destroy(c->pol[k]);
  kvp__tier_admit_destroy(c->gate);
  kvp_allocator a = c->a;
  kvp__free(&a, c, sizeof *c);
}

int kvp__tier_cascade_create(const tier_cascade_opts *o,
                             const kvp_allocator *alloc, tier_cascade **out) {
  if (o == NULL || out == NULL)
    return KVP_EINVAL;
  tier_cascade *c = kvp__calloc(alloc, 1, sizeof *c);
  if (c == NULL)
    return KVP_ENOMEM;
  c->a = kvp__allocator(alloc);
  tier_policy *first = NULL; /* opts.exclusive: the others share its entries */
  int rc = 0;
  for (int k = 0; k < TIER_CASCADE_TIERS && rc == 0; k++) {
    c->cap[k] = o->cap[k];
    if (o->with_policy & (1u << k))
      rc = kvp__tier_policy_create(o->policy[k], &c->a, &c->pol[k]);
    if (rc == 0 && c->pol[k] != NULL && o->exclusive && first != NULL)
      rc = kvp__tier_policy_share(c->pol[k], first);
    if (rc == 0 && c->pol[k] != NULL && o->ids > 0)
      rc = kvp__tier_policy_reserve(c->pol[k], o->ids);
    if (first == NULL)
      first = c->pol[k];
  }
  if (rc == 0 && o->gate)
    rc = kvp__tier_admit_create(&o->gate_opts, &c->a, &c->gate);
  if (rc < 0) {
    kvp__tier_cascade_destroy(c);
    return rc;
  }
  *out = c;
  return 0;
}

tier_policy *kvp__tier_cascade_policy(const tier_cascade *c, int k) {
  return c->pol[k];
}

tier_admit *kvp__tier_cascade_gate(const tier_cascade *c) { return c->gate; }

void kvp__tier_cascade_set_policy(tier_cascade *c, int k, tier_policy *p) {
  kvp__tier_policy_destroy(c->pol[k]);
  c->pol[k] = p;
}

void kvp__tier_cascade_set_cap(tier_cascade *c, int k, uint64_t cap) {
  c->cap[k] = cap;
}

uint64_t kvp__tier_cascade_cap(const tier_cascade *c, int k) {
  return c->cap[k];
}

static int next_present(const tier_cascade *c, int k) {
  for (int j = k + 1; j < TIER_CASCADE_TIERS; j++)
    if (c->cap[j] > 0)
      return j;
  return -1;
}

/* Where victim id of tier k goes: the next tier present, unless the gate
 * guards it and turns the block away (then remembered as a ghost). */
static void destination(tier_cascade *c, int k, const tier_victim *v,
                        tier_move *m) {
  m->to = next_present(c, k);
  m->below = m->to >= 0 && v->below;
  if (m->to != KVP_TIER_NVME || m->below || c->gate == NULL)
    return;
  if (kvp__tier_admit_decide(c->gate, v->cls, v->hits, &v->cost)) {
    m->gate = TIER_GATE_ADMIT;
    m->cell = kvp__tier_admit_cell(v->cls, v->hits);
  } else {
    m->gate = TIER_GATE_REJECT;
    m->to = -1; /* dropped as if NVMe were not there */
    kvp__tier_admit_reject(c->gate, v->fp, v->cls, v->hits);
  }
}

int kvp__tier_cascade_next(tier_cascade *c, int k, uint64_t need, bool force,
                           tier_victim_fn fn, void *arg, tier_move *m) {
  tier_policy *p = c->pol[k];
  uint32_t id;
  assert(p != NULL); /* only a tier with a policy here has victims */
  if (!force && kvp__tier_policy_bytes(p) + need <= c->cap[k])
    return 0;
  if (kvp__tier_policy_victim(p, &id) < 0)
    return 0;
  kvp__tier_policy_remove(p, id, 1);
  tier_victim v = {0};
  fn(arg, id, &v);
  *m = (tier_move){.id = id, .from = k};
  destination(c, k, &v, m);
  return 1;
}
