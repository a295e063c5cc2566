/* SPDX-License-Identifier: Apache-2.0 */
/* core/ledger: totals worked out by hand and as sums of their records,
 * every rejection rule, LRU caps folding into global, hit rate per class by hand, receipts
 * and totals as JSON (parsed back by python3 when present), Prometheus
 * buffer/writer semantics, allocation failure, concurrent use. */
#include <locale.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#include "core_internal.h"
#include "test_harness.h"

/* A valid record: `hbm` + `dram` tokens reused (all of them stable),
 * `recomputed` tokens volatile and never seen. */
static kvp_ledger_record good(const char *tenant, const char *session,
                              uint64_t hbm, uint64_t dram, uint64_t recomputed) {
  kvp_ledger_record r = {0};
  r.tenant = tenant;
  r.session = session;
  r.worker = -1;
  r.reused_tokens = hbm + dram;
  r.recomputed_tokens = recomputed;
  r.prompt_tokens = hbm + dram + recomputed;
  r.reused_by_tier[KVP_TIER_HBM] = hbm;
  r.reused_by_tier[KVP_TIER_DRAM] = dram;
  r.prompt_by_class[KVP_CLASS_STABLE] = hbm + dram;
  r.prompt_by_class[KVP_CLASS_VOLATILE] = recomputed;
  r.reused_by_class[KVP_CLASS_STABLE] = hbm + dram;
  r.miss_tokens[KVP_MISS_NEVER_SEEN] = recomputed;
  r.load_bytes[KVP_TIER_DRAM] = dram * 1024;
  r.avoided_flops = (double)(hbm + dram) * 1e9; /* integers: sums are exact */
  r.avoided_gpu_seconds = (double)(hbm + dram);
  return r;
}

static void assert_consistent(const kvp_ledger_totals *t) {
  uint64_t s = 0;
  ASSERT_EQ(t->reused_tokens + t->recomputed_tokens, t->prompt_tokens);
  for (int i = 0; i < KVP_TIER_COUNT_; i++)
    s += t->reused_by_tier[i];
  ASSERT_EQ(s, t->reused_tokens);
  s = 0;
  for (int i = 0; i < KVP_CLASS_COUNT_; i++)
    s += t->prompt_by_class[i];
  ASSERT_EQ(s, t->prompt_tokens);
  s = 0;
  for (int i = 0; i < KVP_CLASS_COUNT_; i++)
    s += t->reused_by_class[i];
  ASSERT_EQ(s, t->reused_tokens);
  s = 0;
  for (int i = 0; i < KVP_MISS_COUNT_; i++)
    s += t->miss_tokens[i];
  ASSERT_EQ(s, t->recomputed_tokens);
}

/* Sums without naming fields: from prompt_tokens up to reserved, a record's
 * counters and a totals struct's lie in the same order (asserted below), the
 * 64-bit integers first, then the doubles.  A counter the ledger forgot to add
 * -- including one added to both structs later -- makes these sums differ
 * from the ledger's, where a field-by-field copy of its arithmetic would
 * forget the same field. */
#define SPAN_(T) (offsetof(T, reserved) - offsetof(T, prompt_tokens))
#define INTS_(T) (offsetof(T, avoided_flops) - offsetof(T, prompt_tokens))
_Static_assert(SPAN_(kvp_ledger_totals) == SPAN_(kvp_ledger_record),
               "the record's counters and the totals' line up");
_Static_assert(INTS_(kvp_ledger_totals) == INTS_(kvp_ledger_record),
               "the integer counters come first in both");
_Static_assert(offsetof(kvp_ledger_totals, prompt_tokens) == sizeof(uint64_t),
               "requests is the totals' only other counter");

static void span_add(kvp_ledger_totals *t, const kvp_ledger_record *r) {
  char *dst = (char *)&t->prompt_tokens;
  const char *src = (const char *)&r->prompt_tokens;
  size_t off = 0;
  t->requests++;
  for (; off < INTS_(kvp_ledger_record); off += sizeof(uint64_t)) {
    uint64_t a, b;
    memcpy(&a, dst + off, sizeof a), memcpy(&b, src + off, sizeof b);
    a += b;
    memcpy(dst + off, &a, sizeof a);
  }
  for (; off < SPAN_(kvp_ledger_record); off += sizeof(double)) {
    double a, b;
    memcpy(&a, dst + off, sizeof a), memcpy(&b, src + off, sizeof b);
    a += b;
    memcpy(dst + off, &a, sizeof a);
  }
}

/* t += u, counter by counter (requests included). */
static void totals_add(kvp_ledger_totals *t, const kvp_ledger_totals *u) {
  kvp_ledger_record r;
  memcpy(&r.prompt_tokens, &u->prompt_tokens, SPAN_(kvp_ledger_totals));
  span_add(t, &r);
  t->requests += u->requests - 1;
}

/* Splits n into k random parts. */
static void rand_split(uint64_t n, uint64_t *parts, int k) {
  for (int i = 0; i < k - 1; i++) {
    parts[i] = kvt_rand_below(n + 1);
    n -= parts[i];
  }
  parts[k - 1] = n;
}

static kvp_ledger_record random_record(const char *t, const char *s) {
  kvp_ledger_record r = {0};
  uint64_t pc[KVP_CLASS_COUNT_];
  r.tenant = t, r.session = s, r.worker = (int32_t)kvt_rand_below(8);
  r.prompt_tokens = kvt_rand_below(20000);
  rand_split(r.prompt_tokens, pc, KVP_CLASS_COUNT_);
  for (int c = 0; c < KVP_CLASS_COUNT_; c++) {
    r.prompt_by_class[c] = pc[c];
    r.reused_by_class[c] = kvt_rand_below(pc[c] + 1);
    r.reused_tokens += r.reused_by_class[c];
  }
  r.recomputed_tokens = r.prompt_tokens - r.reused_tokens;
  rand_split(r.reused_tokens, r.reused_by_tier, KVP_TIER_COUNT_);
  rand_split(r.recomputed_tokens, r.miss_tokens, KVP_MISS_COUNT_);
  for (int i = 0; i < KVP_TIER_COUNT_; i++)
    r.load_bytes[i] = r.reused_by_tier[i] * 2048;
  r.avoided_flops = (double)r.reused_tokens * 3e6;
  r.avoided_gpu_seconds = (double)r.reused_tokens;
  return r;
}

TEST(create_destroy) {
  kvp_ledger *l = NULL;
  kvp_ledger_stats st;
  ASSERT_ERR(kvp_ledger_create(NULL, NULL, NULL), KVP_EINVAL);
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &l));
  ASSERT_OK(kvp_ledger_stats_get(l, &st));
  ASSERT_EQ(st.max_sessions, 65536u);
  ASSERT_EQ(st.max_tenants, 4096u);
  ASSERT_EQ(st.sessions, 0u);
  kvp_ledger_destroy(l);
  kvp_ledger_destroy(NULL);

  kvp_ledger_opts o = {0};
  o.reserved[2] = 1;
  ASSERT_ERR(kvp_ledger_create(&o, NULL, &l), KVP_EINVAL);
  ASSERT_NULL(l);
  o = (kvp_ledger_opts){.max_sessions = (1u << 24) + 1};
  ASSERT_ERR(kvp_ledger_create(&o, NULL, &l), KVP_ERANGE);
  o = (kvp_ledger_opts){.max_tenants = 65537};
  ASSERT_ERR(kvp_ledger_create(&o, NULL, &l), KVP_ERANGE);
  o = (kvp_ledger_opts){.max_sessions = 7, .max_tenants = 65536};
  ASSERT_OK(kvp_ledger_create(&o, NULL, &l));
  ASSERT_OK(kvp_ledger_stats_get(l, &st));
  ASSERT_EQ(st.max_sessions, 7u);
  ASSERT_EQ(st.max_tenants, 65536u);
  kvp_ledger_totals t;
  ASSERT_ERR(kvp_ledger_add(l, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_ledger_add(NULL, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_ledger_global_totals(l, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_ledger_tenant_totals(l, "", &t), KVP_EINVAL);
  ASSERT_ERR(kvp_ledger_tenant_totals(l, "nobody", &t), KVP_ENOENT);
  ASSERT_ERR(kvp_ledger_session_totals(l, "x", NULL, &t), KVP_EINVAL);
  ASSERT_STR_EQ(kvp_miss_cause_name(KVP_MISS_DRIFT), "prompt_drift");
  ASSERT_STR_EQ(kvp_miss_cause_name((kvp_miss_cause)99), "invalid");
  ASSERT_STR_EQ(kvp_ledger_reject_name(KVP_LEDGER_REJECT_MISS), "miss");
  kvp_ledger_destroy(l);
}

/* Fixed records, the totals worked out by hand: a ledger that drops any
 * field's update, or adds one to the wrong scope, fails here. */
static kvp_ledger_record rec(const char *tenant, const char *session,
                             const uint64_t tier[4], const uint64_t miss[8],
                             const uint64_t pbc[3], const uint64_t rbc[3],
                             const uint64_t bytes[4], double flops, double secs) {
  kvp_ledger_record r = {.tenant = tenant, .session = session, .worker = -1};
  for (int i = 0; i < 4; i++) {
    r.reused_by_tier[i] = tier[i], r.load_bytes[i] = bytes[i];
    r.reused_tokens += tier[i];
  }
  for (int i = 0; i < 8; i++)
    r.miss_tokens[i] = miss[i], r.recomputed_tokens += miss[i];
  for (int i = 0; i < 3; i++)
    r.prompt_by_class[i] = pbc[i], r.reused_by_class[i] = rbc[i];
  r.prompt_tokens = r.reused_tokens + r.recomputed_tokens;
  r.avoided_flops = flops, r.avoided_gpu_seconds = secs;
  return r;
}

TEST(hand_computed_totals) {
  _Static_assert(KVP_TIER_COUNT_ == 4 && KVP_CLASS_COUNT_ == 3 &&
                     KVP_MISS_COUNT_ == 8,
                 "the hand-computed figures below assume these counts");
  /* tiers HBM DRAM NVMe remote; classes volatile semi stable */
  kvp_ledger_record a = rec("acme", "s1", (uint64_t[4]){100, 20, 3, 0},
                            (uint64_t[8]){40, 5, 0, 1, 0, 0, 0, 0},
                            (uint64_t[3]){50, 19, 100}, (uint64_t[3]){4, 19, 100},
                            (uint64_t[4]){0, 20480, 3072, 0}, 1230.0, 0.5);
  kvp_ledger_record b = rec("acme", "s2", (uint64_t[4]){0, 0, 7, 9},
                            (uint64_t[8]){0, 0, 0, 0, 2, 3, 4, 5},
                            (uint64_t[3]){10, 10, 10}, (uint64_t[3]){1, 5, 10},
                            (uint64_t[4]){0, 0, 700, 900}, 160.0, 0.25);
  kvp_ledger_record c = rec("globex", NULL, (uint64_t[4]){1000, 0, 0, 0},
                            (uint64_t[8]){0}, (uint64_t[3]){0, 0, 1000},
                            (uint64_t[3]){0, 0, 1000}, (uint64_t[4]){0}, 10000.0,
                            2.0);
  kvp_ledger_record d = rec(NULL, NULL, (uint64_t[4]){0},
                            (uint64_t[8]){0, 0, 0, 0, 0, 0, 0, 77},
                            (uint64_t[3]){77, 0, 0}, (uint64_t[3]){0},
                            (uint64_t[4]){0}, 0.0, 0.0);
  const kvp_ledger_record *all[] = {&a, &b, &a, &c, &d};
  kvp_ledger *l;
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &l));
  for (size_t i = 0; i < 5; i++) {
    ASSERT_OK(kvp_ledger_check(all[i], NULL));
    ASSERT_OK(kvp_ledger_add(l, all[i]));
  }
  const kvp_ledger_totals want_global = {
      .requests = 5, .prompt_tokens = 1445, .reused_tokens = 1262,
      .recomputed_tokens = 183, .reused_by_tier = {1200, 40, 13, 9},
      .prompt_by_class = {187, 48, 1210}, .reused_by_class = {9, 43, 1210},
      .miss_tokens = {80, 10, 0, 2, 2, 3, 4, 82},
      .load_bytes = {0, 40960, 6844, 900}, .avoided_flops = 12620.0,
      .avoided_gpu_seconds = 3.25};
  const kvp_ledger_totals want_acme = {
      .requests = 3, .prompt_tokens = 368, .reused_tokens = 262,
      .recomputed_tokens = 106, .reused_by_tier = {200, 40, 13, 9},
      .prompt_by_class = {110, 48, 210}, .reused_by_class = {9, 43, 210},
      .miss_tokens = {80, 10, 0, 2, 2, 3, 4, 5},
      .load_bytes = {0, 40960, 6844, 900}, .avoided_flops = 2620.0,
      .avoided_gpu_seconds = 1.25};
  const kvp_ledger_totals want_acme_s1 = {
      .requests = 2, .prompt_tokens = 338, .reused_tokens = 246,
      .recomputed_tokens = 92, .reused_by_tier = {200, 40, 6, 0},
      .prompt_by_class = {100, 38, 200}, .reused_by_class = {8, 38, 200},
      .miss_tokens = {80, 10, 0, 2, 0, 0, 0, 0},
      .load_bytes = {0, 40960, 6144, 0}, .avoided_flops = 2460.0,
      .avoided_gpu_seconds = 1.0};
  const kvp_ledger_totals want_acme_s2 = {
      .requests = 1, .prompt_tokens = 30, .reused_tokens = 16,
      .recomputed_tokens = 14, .reused_by_tier = {0, 0, 7, 9},
      .prompt_by_class = {10, 10, 10}, .reused_by_class = {1, 5, 10},
      .miss_tokens = {0, 0, 0, 0, 2, 3, 4, 5}, .load_bytes = {0, 0, 700, 900},
      .avoided_flops = 160.0, .avoided_gpu_seconds = 0.25};
  const kvp_ledger_totals want_globex = {
      .requests = 1, .prompt_tokens = 1000, .reused_tokens = 1000,
      .reused_by_tier = {1000, 0, 0, 0}, .prompt_by_class = {0, 0, 1000},
      .reused_by_class = {0, 0, 1000}, .avoided_flops = 10000.0,
      .avoided_gpu_seconds = 2.0};
  kvp_ledger_totals got;
  ASSERT_OK(kvp_ledger_global_totals(l, &got));
  ASSERT_MEM_EQ(&got, &want_global, sizeof got);
  ASSERT_OK(kvp_ledger_tenant_totals(l, "acme", &got));
  ASSERT_MEM_EQ(&got, &want_acme, sizeof got);
  ASSERT_OK(kvp_ledger_session_totals(l, "acme", "s1", &got));
  ASSERT_MEM_EQ(&got, &want_acme_s1, sizeof got);
  ASSERT_OK(kvp_ledger_session_totals(l, "acme", "s2", &got));
  ASSERT_MEM_EQ(&got, &want_acme_s2, sizeof got);
  ASSERT_OK(kvp_ledger_tenant_totals(l, "globex", &got));
  ASSERT_MEM_EQ(&got, &want_globex, sizeof got);
  ASSERT_ERR(kvp_ledger_session_totals(l, "globex", "s1", &got), KVP_ENOENT);
  kvp_ledger_destroy(l);
}

/* Random records over 4 tenants x 3 sessions, plus records without a tenant
 * or a session.  Properties, not a copy of the ledger's arithmetic: every
 * scope's totals are the sums of its records' counters (span_add, which
 * names no field; the same additions in the same order give the same
 * doubles), each is internally consistent, and the scopes partition: global
 * = the tenants' totals + the tenantless records, a tenant = its sessions'
 * totals + its records without a session. */
TEST(totals_are_sums_of_records) {
  static const char *tenants[] = {"acme", "globex", "initech", "umbrella", NULL};
  static const char *sessions[] = {"s0", "s1", "s2", NULL};
  kvp_ledger_totals want_g = {0}, want_t[5] = {{0}}, want_s[5][4] = {{{0}}};
  kvp_ledger *l;
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &l));
  for (int i = 0; i < 3000; i++) {
    size_t ti = kvt_rand_below(5), si = kvt_rand_below(4);
    kvp_ledger_record r = random_record(tenants[ti], sessions[si]);
    ASSERT_OK(kvp_ledger_check(&r, NULL));
    ASSERT_OK(kvp_ledger_add(l, &r));
    span_add(&want_g, &r);
    span_add(&want_t[ti], &r);
    span_add(&want_s[ti][si], &r);
  }
  kvp_ledger_totals got, parts = want_t[4]; /* the tenantless records */
  ASSERT_OK(kvp_ledger_global_totals(l, &got));
  assert_consistent(&got);
  ASSERT_EQ(got.requests, 3000u);
  ASSERT_MEM_EQ(&got, &want_g, sizeof got);
  for (size_t ti = 0; ti < 5; ti++) {
    kvp_ledger_totals tenant = want_t[ti], sum = want_s[ti][3];
    if (tenants[ti] != NULL) {
      ASSERT_OK(kvp_ledger_tenant_totals(l, tenants[ti], &tenant));
      assert_consistent(&tenant);
      ASSERT_MEM_EQ(&tenant, &want_t[ti], sizeof tenant);
      totals_add(&parts, &tenant);
    }
    for (size_t si = 0; si < 3; si++) {
      ASSERT_OK(kvp_ledger_session_totals(l, tenants[ti], sessions[si], &got));
      assert_consistent(&got);
      ASSERT_MEM_EQ(&got, &want_s[ti][si], sizeof got);
      totals_add(&sum, &got);
    }
    /* integers only: the doubles were added in another order */
    ASSERT_MEM_EQ(&sum, &tenant, offsetof(kvp_ledger_totals, avoided_flops));
  }
  ASSERT_OK(kvp_ledger_global_totals(l, &got));
  ASSERT_MEM_EQ(&parts, &got, offsetof(kvp_ledger_totals, avoided_flops));
  kvp_ledger_stats st;
  ASSERT_OK(kvp_ledger_stats_get(l, &st));
  ASSERT_EQ(st.tenants, 4u);
  ASSERT_EQ(st.sessions, 15u); /* 5 tenant values (none included) x 3 */
  ASSERT_EQ(st.rejected_total, 0u);
  kvp_ledger_destroy(l);
}

typedef void (*breaker)(kvp_ledger_record *r);
static void b_tenant_utf8(kvp_ledger_record *r) { r->tenant = "t\xff"; }
static void b_session_long(kvp_ledger_record *r) {
  static char s[KVP_LEDGER_NAME_MAX + 2];
  memset(s, 's', KVP_LEDGER_NAME_MAX + 1); /* one byte too long */
  r->session = s;
}
static void b_request_overlong(kvp_ledger_record *r) { r->request_id = "\xc0\xaf"; }
static void b_worker_high(kvp_ledger_record *r) { r->worker = KVP_WORKERS_MAX; }
static void b_worker_low(kvp_ledger_record *r) { r->worker = -2; }
static void b_reserved(kvp_ledger_record *r) { r->reserved[7] = 1; }
static void b_reserved0(kvp_ledger_record *r) { r->reserved0 = 1; }
static void b_tokens(kvp_ledger_record *r) { r->prompt_tokens++; }
/* reused + recomputed wraps around to prompt */
static void b_tokens_wrap(kvp_ledger_record *r) {
  *r = good("t", "s", 0, 0, 0);
  r->reused_tokens = UINT64_MAX, r->recomputed_tokens = 2, r->prompt_tokens = 1;
}
static void b_tier(kvp_ledger_record *r) { r->reused_by_tier[KVP_TIER_HBM]--; }
/* tier parts wrap around to the reused total */
static void b_tier_wrap(kvp_ledger_record *r) {
  r->reused_by_tier[KVP_TIER_NVME] = UINT64_MAX;
  r->reused_by_tier[KVP_TIER_HBM]++;
}
static void b_class_prompt(kvp_ledger_record *r) {
  r->prompt_by_class[KVP_CLASS_SEMI] = 1;
}
/* sums right, but a class reuses more than it had */
static void b_class_over(kvp_ledger_record *r) {
  r->reused_by_class[KVP_CLASS_STABLE] -= 5;
  r->reused_by_class[KVP_CLASS_SEMI] += 5; /* semi had no prompt tokens */
}
static void b_miss(kvp_ledger_record *r) { r->miss_tokens[KVP_MISS_DRIFT] = 1; }
static void b_flops_nan(kvp_ledger_record *r) { r->avoided_flops = NAN; }
static void b_secs_neg(kvp_ledger_record *r) { r->avoided_gpu_seconds = -1; }
static void b_flops_inf(kvp_ledger_record *r) { r->avoided_flops = INFINITY; }
static void b_flops_no_reuse(kvp_ledger_record *r) {
  *r = good("t", "s", 0, 0, 40);
  r->avoided_flops = 1;
}
static void b_bytes(kvp_ledger_record *r) { r->load_bytes[KVP_TIER_NVME] = 1; }

TEST(rejects_broken_records) {
  static const struct {
    breaker fn;
    kvp_ledger_reject why;
  } cases[] = {
      {b_tenant_utf8, KVP_LEDGER_REJECT_NAME},
      {b_session_long, KVP_LEDGER_REJECT_NAME},
      {b_request_overlong, KVP_LEDGER_REJECT_NAME},
      {b_worker_high, KVP_LEDGER_REJECT_FIELD},
      {b_worker_low, KVP_LEDGER_REJECT_FIELD},
      {b_reserved, KVP_LEDGER_REJECT_FIELD},
      {b_reserved0, KVP_LEDGER_REJECT_FIELD},
      {b_tokens, KVP_LEDGER_REJECT_TOKENS},
      {b_tokens_wrap, KVP_LEDGER_REJECT_TOKENS},
      {b_tier, KVP_LEDGER_REJECT_TIER},
      {b_tier_wrap, KVP_LEDGER_REJECT_TIER},
      {b_class_prompt, KVP_LEDGER_REJECT_CLASS},
      {b_class_over, KVP_LEDGER_REJECT_CLASS},
      {b_miss, KVP_LEDGER_REJECT_MISS},
      {b_flops_nan, KVP_LEDGER_REJECT_ESTIMATE},
      {b_secs_neg, KVP_LEDGER_REJECT_ESTIMATE},
      {b_flops_inf, KVP_LEDGER_REJECT_ESTIMATE},
      {b_flops_no_reuse, KVP_LEDGER_REJECT_ESTIMATE},
      {b_bytes, KVP_LEDGER_REJECT_BYTES},
  };
  uint64_t want[KVP_LEDGER_REJECT_COUNT_] = {0};
  kvp_ledger *l;
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &l));
  kvp_ledger_record ok = good("keep", "s", 30, 10, 20);
  ASSERT_OK(kvp_ledger_add(l, &ok));
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    kvp_ledger_record r = good("t", "s", 30, 10, 20);
    kvp_ledger_reject why = KVP_LEDGER_REJECT_COUNT_;
    ASSERT_OK(kvp_ledger_check(&r, &why)); /* the base is valid */
    cases[i].fn(&r);
    ASSERT_ERR(kvp_ledger_check(&r, &why), KVP_EINVAL);
    ASSERT_EQ(why, cases[i].why);
    ASSERT_ERR(kvp_ledger_add(l, &r), KVP_EINVAL);
    ASSERT_ERR(kvp_ledger_receipt_json(&r, NULL, 0), KVP_EINVAL);
    want[cases[i].why]++;
  }
  /* counted per reason; nothing of them reached any total */
  kvp_ledger_stats st;
  kvp_ledger_totals g, t;
  ASSERT_OK(kvp_ledger_stats_get(l, &st));
  for (int i = 0; i < KVP_LEDGER_REJECT_COUNT_; i++)
    ASSERT_EQ(st.rejected[i], want[i]);
  ASSERT_EQ(st.rejected_total, sizeof cases / sizeof cases[0]);
  ASSERT_EQ(st.tenants, 1u);
  ASSERT_OK(kvp_ledger_global_totals(l, &g));
  ASSERT_OK(kvp_ledger_tenant_totals(l, "keep", &t));
  ASSERT_MEM_EQ(&g, &t, sizeof g);
  ASSERT_EQ(g.requests, 1u);
  ASSERT_EQ(g.prompt_tokens, 60u);
  ASSERT_ERR(kvp_ledger_tenant_totals(l, "t", &t), KVP_ENOENT);
  /* the longest valid name is accepted */
  char longest[KVP_LEDGER_NAME_MAX + 1];
  memset(longest, 'n', KVP_LEDGER_NAME_MAX);
  longest[KVP_LEDGER_NAME_MAX] = '\0';
  kvp_ledger_record r = good(longest, longest, 1, 0, 0);
  r.request_id = longest;
  ASSERT_OK(kvp_ledger_add(l, &r));
  ASSERT_OK(kvp_ledger_session_totals(l, longest, longest, &t));
  ASSERT_EQ(t.requests, 1u);
  kvp_ledger_destroy(l);
}

static uint64_t requests_of(kvp_ledger *l, const char *t, const char *s) {
  kvp_ledger_totals x;
  int rc = s ? kvp_ledger_session_totals(l, t, s, &x)
             : kvp_ledger_tenant_totals(l, t, &x);
  return rc == 0 ? x.requests : 0;
}

/* Caps hold, the least recently *recorded* entry goes (queries do not
 * refresh), evictions are counted and the global totals keep everything. */
TEST(lru_caps_fold_into_global) {
  kvp_ledger_opts o = {.max_sessions = 3, .max_tenants = 2};
  kvp_ledger *l;
  kvp_ledger_stats st;
  ASSERT_OK(kvp_ledger_create(&o, NULL, &l));
  const char *order[] = {"a", "b", "c", "a", "d"}; /* b is LRU when d comes */
  for (size_t i = 0; i < 5; i++) {
    kvp_ledger_record r = good("T1", order[i], 10, 0, 5);
    ASSERT_OK(kvp_ledger_add(l, &r));
  }
  ASSERT_EQ(requests_of(l, "T1", "b"), 0u); /* evicted */
  ASSERT_EQ(requests_of(l, "T1", "a"), 2u);
  ASSERT_EQ(requests_of(l, "T1", "c"), 1u);
  ASSERT_EQ(requests_of(l, "T1", "d"), 1u);
  ASSERT_EQ(requests_of(l, "T2", "a"), 0u); /* (tenant, session) pairs */
  ASSERT_OK(kvp_ledger_stats_get(l, &st));
  ASSERT_EQ(st.sessions, 3u);
  ASSERT_EQ(st.session_evictions, 1u);
  /* a query of c does not save it: c is now the LRU */
  ASSERT_EQ(requests_of(l, "T1", "c"), 1u);
  kvp_ledger_record r = good("T1", "e", 10, 0, 5);
  ASSERT_OK(kvp_ledger_add(l, &r));
  ASSERT_EQ(requests_of(l, "T1", "c"), 0u);
  /* tenants: T2, T1 (touch), T3 -> T2 goes */
  r = good("T2", NULL, 1, 0, 0);
  ASSERT_OK(kvp_ledger_add(l, &r));
  r = good("T1", NULL, 1, 0, 0);
  ASSERT_OK(kvp_ledger_add(l, &r));
  r = good("T3", NULL, 1, 0, 0);
  ASSERT_OK(kvp_ledger_add(l, &r));
  ASSERT_EQ(requests_of(l, "T2", NULL), 0u);
  ASSERT_EQ(requests_of(l, "T1", NULL), 7u);
  ASSERT_EQ(requests_of(l, "T3", NULL), 1u);
  ASSERT_OK(kvp_ledger_stats_get(l, &st));
  ASSERT_EQ(st.tenants, 2u);
  ASSERT_EQ(st.tenant_evictions, 1u);
  ASSERT_EQ(st.session_evictions, 2u);
  kvp_ledger_totals g;
  ASSERT_OK(kvp_ledger_global_totals(l, &g));
  ASSERT_EQ(g.requests, 9u);
  ASSERT_EQ(g.prompt_tokens, 6u * 15u + 3u);
  assert_consistent(&g);
  /* an evicted tenant comes back from zero */
  r = good("T2", NULL, 1, 0, 0);
  ASSERT_OK(kvp_ledger_add(l, &r));
  ASSERT_EQ(requests_of(l, "T2", NULL), 1u);
  kvp_ledger_destroy(l);
}

/* Many sessions through a small cap: the bucket array grows, the table never
 * holds more than the cap, exactly the most recent ones survive. */
TEST(lru_many_sessions) {
  kvp_ledger_opts o = {.max_sessions = 1000};
  kvp_ledger *l;
  kvp_ledger_stats st;
  char name[32];
  ASSERT_OK(kvp_ledger_create(&o, NULL, &l));
  for (int i = 0; i < 5000; i++) {
    snprintf(name, sizeof name, "sess-%d", i);
    kvp_ledger_record r = good("t", name, 1, 1, 1);
    ASSERT_OK(kvp_ledger_add(l, &r));
    if (i % 997 == 0) {
      ASSERT_OK(kvp_ledger_stats_get(l, &st));
      ASSERT_LE(st.sessions, 1000u);
    }
  }
  ASSERT_OK(kvp_ledger_stats_get(l, &st));
  ASSERT_EQ(st.sessions, 1000u);
  ASSERT_EQ(st.session_evictions, 4000u);
  for (int i = 0; i < 5000; i++) {
    snprintf(name, sizeof name, "sess-%d", i);
    ASSERT_EQ(requests_of(l, "t", name), i >= 4000 ? 1u : 0u);
  }
  ASSERT_EQ(requests_of(l, "t", NULL), 5000u);
  kvp_ledger_destroy(l);
}

/* Hit rate per class, computed by hand. */
TEST(hit_rate_per_class) {
  kvp_ledger *l;
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &l));
  /* R1: stable 90/100, semi 20/50, volatile 0/30 */
  kvp_ledger_record r = {0};
  r.tenant = "hr", r.worker = 2;
  r.prompt_tokens = 180, r.reused_tokens = 110, r.recomputed_tokens = 70;
  r.prompt_by_class[KVP_CLASS_STABLE] = 100, r.reused_by_class[KVP_CLASS_STABLE] = 90;
  r.prompt_by_class[KVP_CLASS_SEMI] = 50, r.reused_by_class[KVP_CLASS_SEMI] = 20;
  r.prompt_by_class[KVP_CLASS_VOLATILE] = 30;
  r.reused_by_tier[KVP_TIER_HBM] = 110;
  r.miss_tokens[KVP_MISS_EVICTED] = 30, r.miss_tokens[KVP_MISS_DRIFT] = 40;
  ASSERT_OK(kvp_ledger_add(l, &r));
  /* R2: stable 100/100, semi 40/50, volatile 0/20 */
  r.prompt_tokens = 170, r.reused_tokens = 140, r.recomputed_tokens = 30;
  r.prompt_by_class[KVP_CLASS_STABLE] = 100, r.reused_by_class[KVP_CLASS_STABLE] = 100;
  r.prompt_by_class[KVP_CLASS_SEMI] = 50, r.reused_by_class[KVP_CLASS_SEMI] = 40;
  r.prompt_by_class[KVP_CLASS_VOLATILE] = 20;
  r.reused_by_tier[KVP_TIER_HBM] = 140;
  r.miss_tokens[KVP_MISS_EVICTED] = 10, r.miss_tokens[KVP_MISS_DRIFT] = 20;
  ASSERT_OK(kvp_ledger_add(l, &r));
  kvp_ledger_totals t;
  ASSERT_OK(kvp_ledger_tenant_totals(l, "hr", &t));
  ASSERT_DOUBLE_NEAR(kvp_ledger_hit_rate(&t, KVP_CLASS_STABLE), 190.0 / 200.0, 1e-15);
  ASSERT_DOUBLE_NEAR(kvp_ledger_hit_rate(&t, KVP_CLASS_SEMI), 60.0 / 100.0, 1e-15);
  ASSERT_DOUBLE_NEAR(kvp_ledger_hit_rate(&t, KVP_CLASS_VOLATILE), 0.0, 0.0);
  ASSERT_EQ(t.miss_tokens[KVP_MISS_EVICTED], 40u);
  ASSERT_EQ(t.miss_tokens[KVP_MISS_DRIFT], 60u);
  ASSERT_TRUE(isnan(kvp_ledger_hit_rate(&t, (kvp_class)3)));
  kvp_ledger_totals empty = {0};
  ASSERT_TRUE(isnan(kvp_ledger_hit_rate(&empty, KVP_CLASS_STABLE)));
  ASSERT_TRUE(isnan(kvp_ledger_hit_rate(NULL, KVP_CLASS_STABLE)));
  /* the same numbers in the exposition */
  static char text[1 << 16];
  ASSERT_OK(kvp_ledger_prometheus(l, text, sizeof text, NULL));
  ASSERT_NOT_NULL(strstr(text, "\nkvplane_class_hit_ratio{class=\"stable\"} 0.95\n"));
  ASSERT_NOT_NULL(strstr(text, "\nkvplane_class_hit_ratio{class=\"semi\"} 0.6\n"));
  ASSERT_NOT_NULL(strstr(text, "\nkvplane_class_hit_ratio{class=\"volatile\"} 0\n"));
  ASSERT_NOT_NULL(strstr(text, "\nkvplane_miss_tokens_total{cause=\"prompt_drift\"} 60\n"));
  kvp_ledger_destroy(l);
}

TEST(receipt_json_exact) {
  kvp_ledger_record r = good("acme", "s1", 16, 0, 4);
  r.request_id = "r-1", r.worker = 3, r.unix_time_ns = 1700000000000000000ull;
  static const char want[] =
      "{\"kind\":\"receipt\",\"request_id\":\"r-1\",\"tenant\":\"acme\","
      "\"session\":\"s1\",\"worker\":3,\"unix_time_ns\":1700000000000000000,"
      "\"reuse_ratio\":0.8,\"prompt_tokens\":20,\"reused_tokens\":16,"
      "\"recomputed_tokens\":4,\"prefill_avoided\":{\"tokens\":16,"
      "\"flops\":16000000000,\"gpu_seconds\":16},"
      "\"reused_by_tier\":{\"hbm\":16,\"dram\":0,\"nvme\":0,\"remote\":0},"
      "\"prompt_by_class\":{\"volatile\":4,\"semi\":0,\"stable\":16},"
      "\"reused_by_class\":{\"volatile\":0,\"semi\":0,\"stable\":16},"
      "\"miss_tokens\":{\"never_seen\":4,\"evicted\":0,\"on_other_worker\":0,"
      "\"partial_block\":0,\"namespace\":0,\"prompt_drift\":0,"
      "\"not_worth_loading\":0,\"unknown\":0},"
      "\"load_bytes\":{\"hbm\":0,\"dram\":0,\"nvme\":0,\"remote\":0}}\n";
  char buf[2048];
  int n = kvp_ledger_receipt_json(&r, buf, sizeof buf);
  ASSERT_EQ(n, (int)strlen(want));
  ASSERT_STR_EQ(buf, want);
  /* snprintf semantics */
  ASSERT_EQ(kvp_ledger_receipt_json(&r, NULL, 0), n);
  char small[11];
  memset(small, 'x', sizeof small);
  ASSERT_EQ(kvp_ledger_receipt_json(&r, small, sizeof small), n);
  ASSERT_EQ(strlen(small), 10u);
  ASSERT_MEM_EQ(small, want, 10);
  ASSERT_ERR(kvp_ledger_receipt_json(&r, NULL, 5), KVP_EINVAL);
  small[0] = 'x'; /* cap 0: the buffer is not touched, not even for a NUL */
  ASSERT_EQ(kvp_ledger_receipt_json(&r, small, 0), n);
  ASSERT_EQ(small[0], 'x');
  ASSERT_ERR(kvp_ledger_receipt_json(NULL, buf, sizeof buf), KVP_EINVAL);
  /* absent names, unknown worker/time, empty prompt: null */
  kvp_ledger_record e = good(NULL, "", 0, 0, 0);
  ASSERT_GT(kvp_ledger_receipt_json(&e, buf, sizeof buf), 0);
  ASSERT_NOT_NULL(strstr(buf, "{\"kind\":\"receipt\",\"request_id\":null,"
                              "\"tenant\":null,\"session\":null,\"worker\":null,"
                              "\"unix_time_ns\":null,\"reuse_ratio\":null,"));
}

TEST(json_escaping) {
  /* quote, backslash, the short escapes, other controls, DEL; UTF-8 as is */
  kvp_ledger_record r = good("q\"b\\n\nt\tc\x01\x1f\x7f\r\b\f \xc3\xa9", "s", 1, 0, 0);
  char buf[2048];
  ASSERT_GT(kvp_ledger_receipt_json(&r, buf, sizeof buf), 0);
  ASSERT_NOT_NULL(strstr(buf, "\"tenant\":\"q\\\"b\\\\n\\nt\\tc\\u0001\\u001f"
                              "\\u007f\\r\\u0008\\u000c \xc3\xa9\","));
  kvp_ledger_totals t = {0};
  ASSERT_ERR(kvp_ledger_totals_json(&t, "\xed\xa0\x80", NULL, buf, sizeof buf),
             KVP_EINVAL); /* surrogate */
  ASSERT_ERR(kvp_ledger_totals_json(NULL, NULL, NULL, buf, sizeof buf), KVP_EINVAL);
  int n = kvp_ledger_totals_json(&t, NULL, NULL, buf, sizeof buf);
  ASSERT_EQ(n, (int)strlen(buf));
  ASSERT_NOT_NULL(strstr(buf, "{\"kind\":\"totals\",\"scope\":\"global\","
                              "\"tenant\":null,\"session\":null,\"requests\":0,"));
  ASSERT_NOT_NULL(strstr(buf, ",\"hit_rate_by_class\":{\"volatile\":null,"
                              "\"semi\":null,\"stable\":null}}\n"));
  ASSERT_GT(kvp_ledger_totals_json(&t, "ten", NULL, buf, sizeof buf), 0);
  ASSERT_NOT_NULL(strstr(buf, "\"scope\":\"tenant\",\"tenant\":\"ten\",\"session\":null"));
  ASSERT_GT(kvp_ledger_totals_json(&t, NULL, "ses", buf, sizeof buf), 0);
  ASSERT_NOT_NULL(strstr(buf, "\"scope\":\"session\",\"tenant\":null,\"session\":\"ses\""));
}

static void hex(const char *s, char *out) {
  for (; *s; s++, out += 2)
    sprintf(out, "%02x", (unsigned char)*s);
  *out = '\0';
}

/* Receipts through a real JSON parser (strict: NaN/Infinity refused). */
TEST(receipts_parse_with_python) {
  if (access("/usr/bin/python3", X_OK) != 0) {
    printf("# python3 missing: receipts_parse_with_python checks nothing\n");
    return;
  }
  static const char *names[] = {
      "plain", "q\"b\\n\nt\tc\x01\x1f\x7f\r", "\xe2\x80\xa8line-sep",
      "</script>", "\xf0\x9f\x98\x80 \xe3\x83\x86\xe3\x83\x8a\xe3\x83\xb3\xe3\x83\x88"};
  char path[] = "/tmp/kvp_ledger_receipts_XXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  FILE *f = fdopen(fd, "w");
  ASSERT_NOT_NULL(f);
  const size_t n = sizeof names / sizeof names[0];
  for (size_t i = 0; i < n; i++) {
    char buf[4096];
    kvp_ledger_record r = good(names[i], names[n - 1 - i], 10 * i, 3, 7);
    r.request_id = names[i];
    ASSERT_GT(kvp_ledger_receipt_json(&r, buf, sizeof buf), 0);
    fputs(buf, f);
  }
  ASSERT_EQ(fclose(f), 0);
  char cmd[512];
  snprintf(cmd, sizeof cmd,
           "/usr/bin/python3 -c 'import json,sys\n"
           "for line in open(sys.argv[1], encoding=\"utf-8\"):\n"
           "  d = json.loads(line, parse_constant=lambda c: sys.exit(c))\n"
           "  print(d[\"tenant\"].encode().hex(), d[\"session\"].encode().hex(),"
           " d[\"request_id\"].encode().hex(), d[\"prompt_tokens\"])' %s",
           path);
  FILE *p = popen(cmd, "r");
  ASSERT_NOT_NULL(p);
  for (size_t i = 0; i < n; i++) {
    char line[2048], want[2048], h1[600], h2[600];
    ASSERT_NOT_NULL(fgets(line, sizeof line, p));
    hex(names[i], h1);
    hex(names[n - 1 - i], h2);
    snprintf(want, sizeof want, "%s %s %s %zu\n", h1, h2, h1, 10 * i + 10);
    ASSERT_STR_EQ(line, want);
  }
  ASSERT_EQ(pclose(p), 0);
  unlink(path);
}

typedef struct sink {
  char *buf;
  size_t len, cap;
  int calls, fail_at; /* fail_at: 1-based call that returns KVP_EIO; 0 never */
} sink;

static int sink_write(void *opaque, const char *d, size_t n) {
  sink *s = opaque;
  if (++s->calls == s->fail_at)
    return KVP_EIO;
  if (s->len + n + 1 > s->cap) {
    s->cap = 2 * (s->len + n + 1);
    s->buf = realloc(s->buf, s->cap);
    ASSERT_NOT_NULL(s->buf);
  }
  memcpy(s->buf + s->len, d, n);
  s->len += n;
  s->buf[s->len] = '\0';
  return 0;
}

static size_t count_str(const char *hay, const char *needle) {
  size_t n = 0;
  for (const char *p = hay; (p = strstr(p, needle)) != NULL; p++)
    n++;
  return n;
}

TEST(prometheus_buffer_and_writer) {
  kvp_ledger *l;
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &l));
  kvp_ledger_record r = good("plain", "s", 5, 7, 1);
  ASSERT_OK(kvp_ledger_add(l, &r));
  r = good("a\"b\\c\nd", NULL, 1, 0, 0);
  ASSERT_OK(kvp_ledger_add(l, &r));
  size_t need = 0, need2 = 0;
  ASSERT_ERR(kvp_ledger_prometheus(l, NULL, 0, &need), KVP_ENOSPC);
  ASSERT_GT(need, (size_t)4096); /* several writer chunks */
  char *buf = malloc(need + 1);
  ASSERT_NOT_NULL(buf);
  ASSERT_OK(kvp_ledger_prometheus(l, buf, need + 1, &need2));
  ASSERT_EQ(need2, need);
  ASSERT_EQ(strlen(buf), need);
  ASSERT_EQ(buf[need - 1], '\n');
  ASSERT_NOT_NULL(strstr(buf, "\nkvplane_tenant_requests_total{tenant=\"a\\\"b\\\\c\\nd\"} 1\n"));
  ASSERT_NOT_NULL(strstr(buf, "\nkvplane_tenant_reused_tokens_total{tenant=\"plain\",tier=\"dram\"} 7\n"));
  ASSERT_NOT_NULL(strstr(buf, "\nkvplane_reused_tokens_total{tier=\"hbm\"} 6\n"));
  ASSERT_NOT_NULL(strstr(buf, "\nkvplane_load_bytes_total{tier=\"dram\"} 7168\n"));
  ASSERT_NOT_NULL(strstr(buf, "\n# TYPE kvplane_request_reuse_ratio histogram\n"));
  ASSERT_NOT_NULL(strstr(buf, "\nkvplane_request_prefill_avoided_tokens_bucket{le=\"+Inf\"} 2\n"));
  ASSERT_NOT_NULL(strstr(buf, "\nkvplane_request_prefill_avoided_tokens_bucket{le=\"16\"} 2\n"));
  ASSERT_NOT_NULL(strstr(buf, "\nkvplane_request_prefill_avoided_tokens_bucket{le=\"0\"} 0\n"));
  ASSERT_NOT_NULL(strstr(buf, "\nkvplane_ledger_sessions 1\n"));
  /* sorted tenants: '"'-named before "plain" */
  const char *quoted = strstr(buf, "kvplane_tenant_requests_total{tenant=\"a");
  const char *plain = strstr(buf, "kvplane_tenant_requests_total{tenant=\"plain\"}");
  ASSERT_TRUE(quoted != NULL && plain != NULL && quoted < plain);
  ASSERT_EQ(count_str(buf, "# HELP "), count_str(buf, "# TYPE "));
  ASSERT_EQ(count_str(buf, "\nkvplane_tenant_requests_total{"), 2u);
  /* truncation: NUL-terminated prefix, ENOSPC; cap == need leaves no room */
  char small[100];
  ASSERT_ERR(kvp_ledger_prometheus(l, small, sizeof small, &need2), KVP_ENOSPC);
  ASSERT_EQ(need2, need);
  ASSERT_EQ(strlen(small), sizeof small - 1);
  ASSERT_MEM_EQ(small, buf, sizeof small - 1);
  ASSERT_ERR(kvp_ledger_prometheus(l, buf, need, NULL), KVP_ENOSPC);
  ASSERT_EQ(strlen(buf), need - 1);
  ASSERT_ERR(kvp_ledger_prometheus(l, NULL, 5, NULL), KVP_EINVAL);
  small[0] = 'x';
  ASSERT_ERR(kvp_ledger_prometheus(l, small, 0, NULL), KVP_ENOSPC);
  ASSERT_EQ(small[0], 'x');
  ASSERT_ERR(kvp_ledger_prometheus(NULL, buf, need, NULL), KVP_EINVAL);
  /* the writer form produces the same text; its error stops the export */
  ASSERT_OK(kvp_ledger_prometheus(l, buf, need + 1, NULL));
  sink s = {0};
  ASSERT_OK(kvp_ledger_prometheus_write(l, sink_write, &s));
  ASSERT_EQ(s.len, need);
  ASSERT_STR_EQ(s.buf, buf);
  ASSERT_GT(s.calls, 1);
  sink f = {.fail_at = 1};
  ASSERT_ERR(kvp_ledger_prometheus_write(l, sink_write, &f), KVP_EIO);
  ASSERT_EQ(f.calls, 1);
  ASSERT_ERR(kvp_ledger_prometheus_write(l, NULL, NULL), KVP_EINVAL);
  free(s.buf);
  free(f.buf);
  free(buf);
  kvp_ledger_destroy(l);
}

static uint64_t field_u64(const char *line, const char *key) {
  const char *p = strstr(line, key);
  ASSERT_NOT_NULL(p);
  return strtoull(p + strlen(key), NULL, 10);
}

TEST(json_dump_all_scopes) {
  static const char *tenants[] = {"t0", "t1", "t2"};
  kvp_ledger *l;
  char name[32];
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &l));
  for (int i = 0; i < 300; i++) {
    snprintf(name, sizeof name, "s%d", i % 200);
    kvp_ledger_record r = good(tenants[i % 3], name, 2, 1, 1);
    ASSERT_OK(kvp_ledger_add(l, &r));
  }
  kvp_ledger_record r = good(NULL, "lonely", 1, 0, 0);
  ASSERT_OK(kvp_ledger_add(l, &r));
  kvp_ledger_stats st;
  ASSERT_OK(kvp_ledger_stats_get(l, &st));
  sink s = {0};
  ASSERT_OK(kvp_ledger_json_write(l, KVP_LEDGER_JSON_GLOBAL | KVP_LEDGER_JSON_TENANTS |
                                         KVP_LEDGER_JSON_SESSIONS,
                                  sink_write, &s));
  size_t lines = 0, per_scope[3] = {0};
  uint64_t session_requests = 0;
  for (char *line = s.buf, *nl; (nl = strchr(line, '\n')) != NULL; line = nl + 1) {
    *nl = '\0';
    lines++;
    ASSERT_TRUE(strncmp(line, "{\"kind\":\"totals\",\"scope\":\"", 26) == 0);
    if (strncmp(line + 26, "global\"", 7) == 0) {
      per_scope[0]++;
      ASSERT_EQ(field_u64(line, "\"requests\":"), 301u);
    } else if (strncmp(line + 26, "tenant\"", 7) == 0) {
      per_scope[1]++;
      ASSERT_EQ(field_u64(line, "\"requests\":"), 100u);
    } else {
      ASSERT_TRUE(strncmp(line + 26, "session\"", 8) == 0);
      per_scope[2]++;
      session_requests += field_u64(line, "\"requests\":");
    }
  }
  ASSERT_EQ(lines, s.len > 0 ? 1u + 3u + st.sessions : 0u);
  ASSERT_EQ(per_scope[0], 1u);
  ASSERT_EQ(per_scope[1], 3u);
  ASSERT_EQ(per_scope[2], st.sessions);
  /* (t<i%3>, s<i%200>) are 300 distinct pairs (200 = 2 mod 3), + lonely */
  ASSERT_EQ(st.sessions, 301u);
  ASSERT_EQ(session_requests, 301u);
  free(s.buf);
  sink only = {0};
  ASSERT_OK(kvp_ledger_json_write(l, KVP_LEDGER_JSON_SESSIONS, sink_write, &only));
  ASSERT_NOT_NULL(strstr(only.buf, "\"scope\":\"session\",\"tenant\":null,\"session\":\"lonely\","));
  ASSERT_NULL(strstr(only.buf, "\"scope\":\"global\""));
  free(only.buf);
  sink f = {.fail_at = 1};
  ASSERT_ERR(kvp_ledger_json_write(l, KVP_LEDGER_JSON_SESSIONS, sink_write, &f), KVP_EIO);
  ASSERT_EQ(f.calls, 1);
  free(f.buf);
  ASSERT_ERR(kvp_ledger_json_write(l, 0, sink_write, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_ledger_json_write(l, 8, sink_write, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_ledger_json_write(l, 1, NULL, NULL), KVP_EINVAL);
  kvp_ledger_destroy(l);
}

static int discard(void *o, const char *d, size_t n) {
  (void)o, (void)d, (void)n;
  return 0;
}

/* ---- allocation failure ------------------------------------------------- */
typedef struct budget_alloc {
  size_t live, budget, fail_size; /* budget: allocations left */
  size_t refused;
} budget_alloc;

static void *ba_alloc(void *o, size_t n) {
  budget_alloc *b = o;
  if (b->budget == 0 || n == b->fail_size) {
    b->refused++;
    return NULL;
  }
  b->budget--;
  b->live += n;
  return malloc(n);
}

static void ba_free(void *o, void *p, size_t n) {
  budget_alloc *b = o;
  b->live -= n;
  free(p);
}

TEST(allocation_failure_changes_nothing) {
  budget_alloc b = {.budget = SIZE_MAX};
  kvp_allocator a = {ba_alloc, ba_free, &b};
  kvp_ledger *l;
  kvp_ledger_stats st;
  kvp_ledger_totals g, t;
  ASSERT_OK(kvp_ledger_create(NULL, &a, &l));
  size_t base = b.live;
  b.budget = 0;
  kvp_ledger_record r = good("new-tenant", NULL, 4, 0, 1);
  ASSERT_ERR(kvp_ledger_add(l, &r), KVP_ENOMEM);
  r = good(NULL, NULL, 4, 0, 1); /* needs no allocation */
  ASSERT_OK(kvp_ledger_add(l, &r));
  b.budget = 1; /* the tenant fits, its session does not */
  r = good("new-tenant", "new-session", 4, 0, 1);
  ASSERT_ERR(kvp_ledger_add(l, &r), KVP_ENOMEM);
  ASSERT_EQ(b.live, base); /* the tenant entry was given back */
  ASSERT_ERR(kvp_ledger_tenant_totals(l, "new-tenant", &t), KVP_ENOENT);
  ASSERT_OK(kvp_ledger_stats_get(l, &st));
  ASSERT_EQ(st.alloc_failures, 2u);
  ASSERT_EQ(st.tenants, 0u);
  ASSERT_EQ(st.sessions, 0u);
  ASSERT_OK(kvp_ledger_global_totals(l, &g));
  ASSERT_EQ(g.requests, 1u);
  b.budget = 0;
  ASSERT_ERR(kvp_ledger_prometheus(l, NULL, 0, NULL), KVP_ENOMEM);
  ASSERT_ERR(kvp_ledger_json_write(l, KVP_LEDGER_JSON_TENANTS, sink_write, NULL),
             KVP_ENOMEM);
  /* the bucket array cannot grow: chains get longer, nothing is lost */
  b.budget = SIZE_MAX;
  b.fail_size = 128 * sizeof(void *);
  char name[32];
  for (int i = 0; i < 300; i++) {
    snprintf(name, sizeof name, "g%d", i);
    r = good("new-tenant", name, 1, 0, 0);
    ASSERT_OK(kvp_ledger_add(l, &r));
  }
  for (int i = 0; i < 300; i++) {
    snprintf(name, sizeof name, "g%d", i);
    ASSERT_EQ(requests_of(l, "new-tenant", name), 1u);
  }
  ASSERT_GT(b.refused, 4u); /* growth was tried (and refused) */
  /* snapshots (empty slices included) free what they allocate, same size */
  size_t before = b.live;
  ASSERT_OK(kvp_ledger_json_write(l, 7u, discard, NULL));
  ASSERT_OK(kvp_ledger_prometheus_write(l, discard, NULL));
  ASSERT_EQ(b.live, before);
  kvp_ledger_destroy(l);
  ASSERT_EQ(b.live, 0u);
  /* and create itself unwinds */
  for (size_t k = 0; k < 3; k++) {
    b = (budget_alloc){.budget = k};
    ASSERT_ERR(kvp_ledger_create(NULL, &a, &l), KVP_ENOMEM);
    ASSERT_EQ(b.live, 0u);
  }
}

/* A host program's LC_NUMERIC (e.g. de_DE: "0,95") must not leak into the
 * exports, whose grammars want '.'. */
TEST(numbers_ignore_locale) {
  static const char *comma[] = {"de_DE.UTF-8", "de_DE.utf8", "fr_FR.UTF-8",
                                "de_DE", "fr_FR"};
  const char *set = NULL;
  for (size_t i = 0; i < sizeof comma / sizeof comma[0] && !set; i++)
    if (setlocale(LC_NUMERIC, comma[i]) != NULL)
      set = comma[i];
  if (set == NULL)
    printf("# no comma-decimal locale installed: only the C locale checked\n");
  char probe[16];
  snprintf(probe, sizeof probe, "%.2f", 0.5);
  ASSERT_STR_EQ(probe, set ? "0,50" : "0.50"); /* the locale took effect */
  kvp_ledger_record r = good("loc", "s", 8, 0, 2);
  char buf[2048];
  ASSERT_GT(kvp_ledger_receipt_json(&r, buf, sizeof buf), 0);
  ASSERT_NOT_NULL(strstr(buf, "\"reuse_ratio\":0.8,"));
  kvp_ledger *l;
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &l));
  ASSERT_OK(kvp_ledger_add(l, &r));
  static char text[1 << 16];
  ASSERT_OK(kvp_ledger_prometheus(l, text, sizeof text, NULL));
  ASSERT_NOT_NULL(strstr(text, "\nkvplane_request_reuse_ratio_bucket{le=\"0.9\"} 1\n"));
  ASSERT_NOT_NULL(strstr(text, "\nkvplane_request_reuse_ratio_sum 0.8\n"));
  kvp_ledger_destroy(l);
  setlocale(LC_NUMERIC, "C");
}

/* ---- concurrency ---------------------------------------------------------- */
#define N_THREADS 4
#define N_PER_THREAD 4000
static kvp_ledger *g_ledger;
static _Atomic int g_done;

static void *adder(void *arg) {
  static const char *tenants[] = {"c0", "c1", "c2", "c3", "c4"};
  char s[32];
  for (int i = 0; i < N_PER_THREAD; i++) {
    snprintf(s, sizeof s, "w%d-%d", (int)(intptr_t)arg, i % 50);
    kvp_ledger_record r = good(tenants[i % 5], s, 3, 2, 1);
    ASSERT_OK(kvp_ledger_add(g_ledger, &r));
  }
  return NULL;
}

static void *exporter(void *arg) {
  (void)arg;
  while (!atomic_load_explicit(&g_done, memory_order_relaxed)) {
    ASSERT_OK(kvp_ledger_prometheus_write(g_ledger, discard, NULL));
    ASSERT_OK(kvp_ledger_json_write(g_ledger, 7u, discard, NULL));
  }
  return NULL;
}

TEST(concurrent_add_and_export) {
  pthread_t th[N_THREADS], ex;
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &g_ledger));
  atomic_store(&g_done, 0);
  ASSERT_EQ(pthread_create(&ex, NULL, exporter, NULL), 0);
  for (intptr_t i = 0; i < N_THREADS; i++)
    ASSERT_EQ(pthread_create(&th[i], NULL, adder, (void *)i), 0);
  for (int i = 0; i < N_THREADS; i++)
    ASSERT_EQ(pthread_join(th[i], NULL), 0);
  atomic_store(&g_done, 1);
  ASSERT_EQ(pthread_join(ex, NULL), 0);
  kvp_ledger_totals g, t;
  ASSERT_OK(kvp_ledger_global_totals(g_ledger, &g));
  ASSERT_EQ(g.requests, (uint64_t)N_THREADS * N_PER_THREAD);
  ASSERT_EQ(g.prompt_tokens, 6u * N_THREADS * N_PER_THREAD);
  assert_consistent(&g);
  ASSERT_OK(kvp_ledger_tenant_totals(g_ledger, "c3", &t));
  ASSERT_EQ(t.requests, (uint64_t)N_THREADS * N_PER_THREAD / 5);
  ASSERT_OK(kvp_ledger_session_totals(g_ledger, "c1", "w2-11", &t));
  ASSERT_EQ(t.requests, (uint64_t)N_PER_THREAD / 50);
  kvp_ledger_stats st;
  ASSERT_OK(kvp_ledger_stats_get(g_ledger, &st));
  ASSERT_EQ(st.sessions, (uint64_t)N_THREADS * 50);
  kvp_ledger_destroy(g_ledger);
}

/* kvp_ledger_explain names the broken rule with its fields and values. */
static const char *explain(const kvp_ledger_record *r, int want_rc) {
  static char buf[512];
  ASSERT_EQ(kvp_ledger_explain(r, buf, sizeof buf), want_rc);
  return buf;
}

TEST(explain_names_field_and_sum) {
  kvp_ledger_record r = good("t", "s", 30, 10, 20);
  ASSERT_STR_EQ(explain(&r, 0), "ok");
  r.miss_tokens[KVP_MISS_EVICTED] = 5;
  ASSERT_STR_EQ(explain(&r, KVP_EINVAL),
                "miss: miss_tokens sums to 25 (never_seen 20 + evicted 5 + "
                "on_other_worker 0 + partial_block 0 + namespace 0 + "
                "prompt_drift 0 + not_worth_loading 0 + unknown 0), not "
                "recomputed_tokens 20");
  r = good("t", "s", 30, 10, 20);
  r.reused_by_tier[KVP_TIER_NVME] = 1;
  ASSERT_STR_EQ(explain(&r, KVP_EINVAL),
                "tier: reused_by_tier sums to 41 (hbm 30 + dram 10 + nvme 1 + "
                "remote 0), not reused_tokens 40");
  r = good("t", "s", 30, 10, 20);
  r.reused_by_class[KVP_CLASS_SEMI] = 3;
  ASSERT_STR_EQ(explain(&r, KVP_EINVAL),
                "class: reused_by_class[semi] 3 > prompt_by_class[semi] 0");
  r = good("t", "s", 30, 10, 20);
  r.prompt_tokens = 61;
  ASSERT_STR_EQ(explain(&r, KVP_EINVAL),
                "tokens: reused_tokens 40 + recomputed_tokens 20 != "
                "prompt_tokens 61");
  r = good("t", "s", 30, 10, 20);
  r.worker = 5000;
  ASSERT_STR_EQ(explain(&r, KVP_EINVAL), "field: worker = 5000: not in -1 .. 4095");
  r = good("t", "s", 30, 10, 20);
  r.load_bytes[KVP_TIER_NVME] = 7;
  ASSERT_STR_EQ(explain(&r, KVP_EINVAL),
                "bytes: load_bytes[nvme] = 7 with reused_by_tier[nvme] = 0");
  r = good("t", "s", 30, 10, 20);
  r.avoided_gpu_seconds = NAN;
  ASSERT_NOT_NULL(strstr(explain(&r, KVP_EINVAL),
                         "estimate: avoided_gpu_seconds = NaN: must be finite"));
  r = good("t", "\xff", 30, 10, 20);
  ASSERT_STR_EQ(explain(&r, KVP_EINVAL),
                "name: session: not UTF-8 or longer than 256 bytes");
  ASSERT_STR_EQ(explain(NULL, KVP_EINVAL), "record is NULL");
  char small[8];
  r = good("t", "s", 30, 10, 20);
  r.prompt_tokens = 61;
  ASSERT_EQ(kvp_ledger_explain(&r, small, sizeof small), KVP_EINVAL);
  ASSERT_STR_EQ(small, "tokens:"); /* snprintf-like truncation */
  ASSERT_EQ(kvp_ledger_explain(&r, NULL, 0), KVP_EINVAL);
}

TEST_MAIN(TEST_ENTRY(create_destroy), TEST_ENTRY(hand_computed_totals),
          TEST_ENTRY(totals_are_sums_of_records),
          TEST_ENTRY(rejects_broken_records), TEST_ENTRY(lru_caps_fold_into_global),
          TEST_ENTRY(lru_many_sessions), TEST_ENTRY(hit_rate_per_class),
          TEST_ENTRY(receipt_json_exact), TEST_ENTRY(json_escaping),
          TEST_ENTRY(receipts_parse_with_python),
          TEST_ENTRY(prometheus_buffer_and_writer), TEST_ENTRY(json_dump_all_scopes),
          TEST_ENTRY(allocation_failure_changes_nothing),
          TEST_ENTRY(numbers_ignore_locale),
          TEST_ENTRY(concurrent_add_and_export),
          TEST_ENTRY(explain_names_field_and_sum))
