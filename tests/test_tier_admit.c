/* SPDX-License-Identifier: Apache-2.0 */
/* kvtier's NVMe admission gate (pure): the inequality on hand-computed
 * cases on both sides, the cold-start rule, the online estimator moving
 * with outcomes (NVMe read-backs and ghosts of rejected blocks), decay,
 * modes, bad options. */
#include <math.h>
#include <stdlib.h>

#include "kvtier_place.h"
#include "test_harness.h"

static const tier_admit_cost C431 = {4e-3, 1e-3, 1e-3}; /* rec, rd, wr */

static tier_admit *mk(uint32_t min_samples, uint32_t window,
                      uint32_t ghosts) {
  tier_admit_opts o = {.min_samples = min_samples, .window = window,
                       .ghost_slots = ghosts};
  tier_admit *a;
  ASSERT_OK(kvp__tier_admit_create(&o, NULL, &a));
  return a;
}

/* p * (recompute - read) >= weight * write, by hand. */
TEST(pays) {
  ASSERT_EQ(kvp__tier_admit_pays(0.5, &C431, 1), 1);  /* 1.5 ms >= 1 ms */
  ASSERT_EQ(kvp__tier_admit_pays(0.5, &C431, 2), 0);  /* 1.5 ms < 2 ms */
  ASSERT_EQ(kvp__tier_admit_pays(0.5, &C431, 0), 1);  /* weight 0 = 1 */
  ASSERT_EQ(kvp__tier_admit_pays(0.3, &C431, 1), 0);  /* 0.9 ms < 1 ms */
  ASSERT_EQ(kvp__tier_admit_pays(0.34, &C431, 1), 1); /* 1.02 ms */
  tier_admit_cost eq = {3, 1, 1};                /* exactly equal */
  ASSERT_EQ(kvp__tier_admit_pays(0.5, &eq, 1), 1);
  ASSERT_EQ(kvp__tier_admit_pays(0.49, &eq, 1), 0);
  tier_admit_cost slow_read = {1e-3, 2e-3, 1e-9}; /* loading loses */
  ASSERT_EQ(kvp__tier_admit_pays(1.0, &slow_read, 1), 0);
  ASSERT_EQ(kvp__tier_admit_pays(0, &C431, 1), 0);
  ASSERT_EQ(kvp__tier_admit_pays(NAN, &C431, 1), 0);
  ASSERT_EQ(kvp__tier_admit_pays(1, NULL, 1), 0);
}

/* Before a cell has min_samples outcomes (or without a recompute cost)
 * the rule is kvtier's old one whatever the costs say. */
TEST(cold_start_rule) {
  tier_admit *a = mk(0, 0, 0);
  tier_admit_cost never = {1e-6, 1e-3, 1e-3}; /* the model would say no */
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 0, &C431), 0);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 1, &never), 1);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_SEMI, 0, &never), 1);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_STABLE, 0, &never), 1);
  tier_admit_opts o;
  kvp__tier_admit_opts_get(a, &o);
  ASSERT_EQ(o.min_samples, 32u);
  ASSERT_EQ(o.window, 1024u);
  ASSERT_EQ(o.ghost_slots, 65536u);
  o.volatile_min_hits = 3;
  ASSERT_OK(kvp__tier_admit_opts_set(a, &o));
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 2, &C431), 0);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 3, &C431), 1);
  double n = -1;
  ASSERT_DOUBLE_NEAR(kvp__tier_admit_p(a, KVP_CLASS_SEMI, 0, &n), 0.5, 1e-12);
  ASSERT_DOUBLE_NEAR(n, 0, 0);
  kvp__tier_admit_destroy(a);
  kvp__tier_admit_destroy(NULL);
}

/* Outcomes move the estimate; past min_samples the inequality decides, in
 * both directions, and an unknown recompute cost keeps the old rule. */
TEST(estimator_moves) {
  tier_admit *a = mk(32, 1024, 0);
  for (int i = 0; i < 31; i++)
    kvp__tier_admit_note(a, KVP_CLASS_SEMI, 0, 0);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_SEMI, 0, &C431), 1); /* 31 */
  kvp__tier_admit_note(a, KVP_CLASS_SEMI, 0, 0);
  double n;
  double p = kvp__tier_admit_p(a, KVP_CLASS_SEMI, 0, &n);
  ASSERT_DOUBLE_NEAR(n, 32, 1e-12);
  ASSERT_DOUBLE_NEAR(p, 1.0 / 34, 1e-12); /* (0 + 1) / (32 + 2) */
  /* 1/34 * 3 ms = 0.088 ms < 1 ms: no longer admitted */
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_SEMI, 0, &C431), 0);
  tier_admit_cost unknown = {0, 1e-3, 1e-3};
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_SEMI, 0, &unknown), 1);
  /* other cells did not move: semi with 1 reuse, stable */
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_SEMI, 1, &C431), 1);
  ASSERT_DOUBLE_NEAR(kvp__tier_admit_p(a, KVP_CLASS_STABLE, 0, &n), 0.5, 0);
  /* reuses bring it back once (r + 1) / (n + 2) * 3 ms >= 1 ms */
  for (int i = 0; i < 10; i++)
    kvp__tier_admit_note(a, KVP_CLASS_SEMI, 0, 1);
  ASSERT_DOUBLE_NEAR(kvp__tier_admit_p(a, KVP_CLASS_SEMI, 0, &n), 11.0 / 44,
                     1e-12);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_SEMI, 0, &C431), 0);
  kvp__tier_admit_note(a, KVP_CLASS_SEMI, 0, 1); /* 12 / 45 * 3 = 0.8 */
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_SEMI, 0, &C431), 0);
  kvp__tier_admit_note(a, KVP_CLASS_SEMI, 0, 1);
  kvp__tier_admit_note(a, KVP_CLASS_SEMI, 0, 1); /* 14 / 47 * 3 = 0.89 */
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_SEMI, 0, &C431), 0);
  for (int i = 0; i < 3; i++)
    kvp__tier_admit_note(a, KVP_CLASS_SEMI, 0, 1); /* 17 / 50 * 3 = 1.02 */
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_SEMI, 0, &C431), 1);
  /* hit counts bucket as 0, 1, 2+ */
  for (int i = 0; i < 40; i++)
    kvp__tier_admit_note(a, KVP_CLASS_VOLATILE, 7, 0);
  ASSERT_DOUBLE_NEAR(kvp__tier_admit_p(a, KVP_CLASS_VOLATILE, 2, &n), 1.0 / 42,
                     1e-12);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 100, &C431), 0);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 1, &C431), 1);
  kvp__tier_admit_destroy(a);
}

/* Counts halve past the window, so old outcomes fade. */
TEST(decay) {
  tier_admit *a = mk(4, 8, 0);
  for (int i = 0; i < 8; i++)
    kvp__tier_admit_note(a, KVP_CLASS_STABLE, 0, 0);
  double n;
  kvp__tier_admit_p(a, KVP_CLASS_STABLE, 0, &n);
  ASSERT_DOUBLE_NEAR(n, 8, 0);
  kvp__tier_admit_note(a, KVP_CLASS_STABLE, 0, 1); /* 9 > 8: halve */
  double p = kvp__tier_admit_p(a, KVP_CLASS_STABLE, 0, &n);
  ASSERT_DOUBLE_NEAR(n, 4.5, 1e-12);
  ASSERT_DOUBLE_NEAR(p, (0.5 + 1) / (4.5 + 2), 1e-12);
  for (int i = 0; i < 100; i++)
    kvp__tier_admit_note(a, KVP_CLASS_STABLE, 0, 1);
  p = kvp__tier_admit_p(a, KVP_CLASS_STABLE, 0, &n);
  ASSERT_TRUE(n <= 8);
  ASSERT_TRUE(p > 0.8); /* the 8 early misses are forgotten */
  kvp__tier_admit_destroy(a);
}

/* Rejected blocks teach their cell through ghosts: asked for again ->
 * reused; displaced by a newer reject -> not reused.  Volatile blocks
 * without a reuse get in only once enough ghosts came back. */
TEST(ghosts) {
  tier_admit *a = mk(4, 64, 1); /* one ghost slot: every reject collides */
  double n;
  kvp__tier_admit_reject(a, 0x1230, KVP_CLASS_VOLATILE, 0);
  ASSERT_EQ(kvp__tier_admit_seen(a, 0x4560), 0);
  ASSERT_EQ(kvp__tier_admit_seen(a, 0x1230), 1);
  ASSERT_EQ(kvp__tier_admit_seen(a, 0x1230), 0); /* once */
  ASSERT_DOUBLE_NEAR(kvp__tier_admit_p(a, KVP_CLASS_VOLATILE, 0, &n), 2.0 / 3,
                     1e-12);
  ASSERT_DOUBLE_NEAR(n, 1, 0);
  kvp__tier_admit_reject(a, 0x7770, KVP_CLASS_SEMI, 1);
  kvp__tier_admit_reject(a, 0x8880, KVP_CLASS_SEMI, 1); /* displaces 0x777 */
  ASSERT_DOUBLE_NEAR(kvp__tier_admit_p(a, KVP_CLASS_SEMI, 1, &n), 1.0 / 3,
                     1e-12);
  ASSERT_DOUBLE_NEAR(n, 1, 0);
  ASSERT_EQ(kvp__tier_admit_seen(a, 0x7770), 0);
  /* volatile, no reuse: rejected until 4 outcomes, then the model */
  tier_admit_cost big = {10e-3, 1e-3, 1e-3};
  for (uint64_t k = 1; k <= 3; k++) {
    ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 0, &big), 0);
    kvp__tier_admit_reject(a, k << 8, KVP_CLASS_VOLATILE, 0);
    ASSERT_EQ(kvp__tier_admit_seen(a, k << 8), 1);
  }
  /* 4 outcomes, all reused: p = 5/6; 5/6 * 9 ms >= 1 ms */
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 0, &big), 1);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 0, &C431), 1);
  kvp__tier_admit_destroy(a);
}

TEST(modes_and_bad_opts) {
  kvp_tier_admission m;
  ASSERT_OK(kvp_tier_admission_parse("gate", &m));
  ASSERT_EQ((int)m, (int)KVP_TIER_ADMIT_GATE);
  ASSERT_OK(kvp_tier_admission_parse("all", &m));
  ASSERT_EQ((int)m, (int)KVP_TIER_ADMIT_ALL);
  ASSERT_ERR(kvp_tier_admission_parse("Gate", &m), KVP_EINVAL);
  ASSERT_STR_EQ(kvp_tier_admission_name(KVP_TIER_ADMIT_HITS), "hits");
  ASSERT_STR_EQ(kvp_tier_admission_name((kvp_tier_admission)9), "unknown");
  tier_admit *a = mk(1, 0, 0);
  kvp__tier_admit_note(a, KVP_CLASS_STABLE, 0, 0);
  tier_admit_cost never = {1e-6, 1e-3, 1e-3};
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_STABLE, 0, &never), 0);
  tier_admit_opts o = {.mode = KVP_TIER_ADMIT_HITS, .min_samples = 1};
  ASSERT_OK(kvp__tier_admit_opts_set(a, &o));
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_STABLE, 0, &never), 1);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 0, &C431), 0);
  o.mode = KVP_TIER_ADMIT_ALL;
  ASSERT_OK(kvp__tier_admit_opts_set(a, &o));
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 0, &never), 1);
  tier_admit_opts bad[] = {
      {.write_weight = -1}, {.write_weight = NAN}, {.write_weight = INFINITY},
      {.mode = (kvp_tier_admission)3}, {.min_samples = 600, .window = 1000},
      {.ghost_slots = (1u << 24) + 1}};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    tier_admit *b = NULL;
    ASSERT_ERR(kvp__tier_admit_create(&bad[i], NULL, &b), KVP_EINVAL);
    ASSERT_NULL(b);
    ASSERT_ERR(kvp__tier_admit_opts_set(a, &bad[i]), KVP_EINVAL);
  }
  ASSERT_ERR(kvp__tier_admit_create(NULL, NULL, NULL), KVP_EINVAL);
  kvp__tier_admit_destroy(a);
}

/* Mode all never rejects, so a gate in it keeps no ghost table (8 bytes a
 * slot: kvplane-bench's default `nvme_admission: all` had allocated,
 * cleared and probed per new block 512 KiB a simulated worker for
 * nothing).  Leaving mode all allocates it; a failed allocation leaves
 * the options as they were. */
typedef struct ghost_acct {
  size_t live;
  bool fail;
} ghost_acct;

static void *acct_alloc(void *o, size_t n) {
  ghost_acct *c = o;
  if (c->fail)
    return NULL;
  void *p = malloc(n);
  if (p != NULL)
    c->live += n;
  return p;
}

static void acct_free(void *o, void *p, size_t n) {
  ghost_acct *c = o;
  if (p != NULL)
    c->live -= n;
  free(p);
}

TEST(mode_all_keeps_no_ghosts) {
  const size_t ghosts = (size_t)8 << 20; /* 1 << 20 slots of 8 bytes */
  ghost_acct ac = {0};
  kvp_allocator al = {acct_alloc, acct_free, &ac};
  tier_admit_opts o = {.mode = KVP_TIER_ADMIT_ALL, .ghost_slots = 1u << 20};
  tier_admit *a;
  ASSERT_OK(kvp__tier_admit_create(&o, &al, &a));
  ASSERT_TRUE(ac.live > 0 && ac.live < ghosts);
  tier_admit_cost never = {1e-6, 1e-3, 1e-3};
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 0, &never), 1);
  kvp__tier_admit_reject(a, 0x1230, KVP_CLASS_VOLATILE, 0); /* nowhere */
  ASSERT_EQ(kvp__tier_admit_seen(a, 0x1230), 0);
  /* to gate, the allocation failing: still mode all, still no ghosts */
  ac.fail = true;
  tier_admit_opts g = {.mode = KVP_TIER_ADMIT_GATE, .ghost_slots = 1u << 20};
  ASSERT_ERR(kvp__tier_admit_opts_set(a, &g), KVP_ENOMEM);
  tier_admit_opts got;
  kvp__tier_admit_opts_get(a, &got);
  ASSERT_EQ((int)got.mode, (int)KVP_TIER_ADMIT_ALL);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 0, &never), 1);
  ASSERT_TRUE(ac.live < ghosts);
  /* to gate: the ghosts are there and remember a reject */
  ac.fail = false;
  ASSERT_OK(kvp__tier_admit_opts_set(a, &g));
  ASSERT_TRUE(ac.live >= ghosts);
  ASSERT_EQ(kvp__tier_admit_decide(a, KVP_CLASS_VOLATILE, 0, &never), 0);
  kvp__tier_admit_reject(a, 0x1230, KVP_CLASS_VOLATILE, 0);
  ASSERT_EQ(kvp__tier_admit_seen(a, 0x1230), 1);
  /* back to all: the table stays, and its ghosts still teach */
  ASSERT_OK(kvp__tier_admit_opts_set(a, &o));
  kvp__tier_admit_reject(a, 0x4560, KVP_CLASS_SEMI, 0); /* by hand */
  ASSERT_EQ(kvp__tier_admit_seen(a, 0x4560), 1);
  kvp__tier_admit_destroy(a);
  ASSERT_EQ(ac.live, (size_t)0);
  /* created in gate mode: the table from the start */
  ASSERT_OK(kvp__tier_admit_create(&g, &al, &a));
  ASSERT_TRUE(ac.live >= ghosts);
  kvp__tier_admit_destroy(a);
  ASSERT_EQ(ac.live, (size_t)0);
}

/* The cascade: a victim only while the tier is full, its destination the
 * next tier present, the gate on the way into NVMe (a reject is a ghost, an
 * admit carries its cell), a victim held below already just leaves. */
typedef struct vinfo {
  kvp_class cls[8];
  bool below[8];
} vinfo;

static void info(void *arg, uint32_t id, tier_victim *v) {
  const vinfo *vi = arg;
  *v = (tier_victim){.fp = 0x1000 + id, .cls = vi->cls[id], .hits = 0,
                     .cost = C431, .below = vi->below[id]};
}

TEST(cascade) {
  tier_cascade_opts co = {.with_policy = 3, .cap = {2, 0, 4}, .gate = true,
                          .gate_opts = {.mode = KVP_TIER_ADMIT_HITS}};
  tier_cascade *c;
  ASSERT_OK(kvp__tier_cascade_create(&co, NULL, &c));
  tier_policy *hbm = kvp__tier_cascade_policy(c, KVP_TIER_HBM);
  ASSERT_NULL(kvp__tier_cascade_policy(c, KVP_TIER_NVME)); /* external */
  vinfo vi = {.cls = {KVP_CLASS_VOLATILE, KVP_CLASS_SEMI, KVP_CLASS_SEMI}};
  for (uint32_t id = 0; id < 3; id++) /* LRU: 0 oldest; all volatile queue */
    ASSERT_OK(kvp__tier_policy_insert(hbm, id, 0x1000 + id, 1, 0));
  tier_move m;
  /* 3 held, room for 2: 0 goes (DRAM absent: to NVMe), the gate says no */
  ASSERT_EQ(kvp__tier_cascade_next(c, KVP_TIER_HBM, 0, false, info, &vi, &m), 1);
  ASSERT_EQ(m.id, 0);
  ASSERT_EQ(m.to, -1);
  ASSERT_EQ(m.gate, TIER_GATE_REJECT);
  ASSERT_EQ(kvp__tier_admit_seen(kvp__tier_cascade_gate(c), 0x1000), 1);
  ASSERT_EQ(kvp__tier_cascade_next(c, KVP_TIER_HBM, 0, false, info, &vi, &m), 0);
  /* one more must fit: 1 goes, semi-stable: admitted with its cell */
  ASSERT_EQ(kvp__tier_cascade_next(c, KVP_TIER_HBM, 1, false, info, &vi, &m), 1);
  ASSERT_EQ(m.id, 1);
  ASSERT_EQ(m.to, KVP_TIER_NVME);
  ASSERT_EQ(m.gate, TIER_GATE_ADMIT);
  ASSERT_EQ(m.cell, kvp__tier_admit_cell(KVP_CLASS_SEMI, 0));
  ASSERT_EQ(kvp__tier_policy_count(hbm), 1);
  /* held below already: it only leaves, the gate is not asked */
  vi.below[2] = true;
  ASSERT_EQ(kvp__tier_cascade_next(c, KVP_TIER_HBM, 0, true, info, &vi, &m), 1);
  ASSERT_EQ(m.id, 2);
  ASSERT_TRUE(m.below);
  ASSERT_EQ(m.to, KVP_TIER_NVME);
  ASSERT_EQ(m.gate, TIER_GATE_NONE);
  ASSERT_EQ(kvp__tier_cascade_next(c, KVP_TIER_HBM, 0, true, info, &vi, &m), 0);
  /* no NVMe: dropped, no gate */
  kvp__tier_cascade_set_cap(c, KVP_TIER_NVME, 0);
  ASSERT_OK(kvp__tier_policy_insert(hbm, 3, 0x1003, 1, 0));
  ASSERT_EQ(kvp__tier_cascade_next(c, KVP_TIER_HBM, 0, true, info, &vi, &m), 1);
  ASSERT_EQ(m.to, -1);
  ASSERT_EQ(m.gate, TIER_GATE_NONE);
  kvp__tier_cascade_destroy(c);
}

/* The cell token names the cell kvp__tier_admit_note counts in. */
TEST(cell_token) {
  ASSERT_EQ(kvp__tier_admit_cell(KVP_CLASS_VOLATILE, 0), 1);
  ASSERT_EQ(kvp__tier_admit_cell(KVP_CLASS_STABLE, 99),
            KVP_CLASS_COUNT_ * TIER_ADMIT_BUCKETS);
  tier_admit *a = mk(1, 0, 0), *b = mk(1, 0, 0);
  for (int i = 0; i < 5; i++) {
    kvp__tier_admit_note(a, KVP_CLASS_SEMI, 7, i & 1);
    kvp__tier_admit_note_cell(b, kvp__tier_admit_cell(KVP_CLASS_SEMI, 7), i & 1);
  }
  kvp__tier_admit_note_cell(b, 0, true); /* none: nothing noted */
  double na, nb;
  ASSERT_EQ(kvp__tier_admit_p(a, KVP_CLASS_SEMI, 2, &na),
            kvp__tier_admit_p(b, KVP_CLASS_SEMI, 2, &nb));
  ASSERT_EQ(na, 5);
  ASSERT_EQ(nb, 5);
  kvp__tier_admit_destroy(a);
  kvp__tier_admit_destroy(b);
}

TEST_MAIN(TEST_ENTRY(pays), TEST_ENTRY(cold_start_rule),
          TEST_ENTRY(estimator_moves), TEST_ENTRY(decay), TEST_ENTRY(ghosts),
          TEST_ENTRY(modes_and_bad_opts), TEST_ENTRY(mode_all_keeps_no_ghosts),
          TEST_ENTRY(cascade),
          TEST_ENTRY(cell_token))
