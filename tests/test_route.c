/* SPDX-License-Identifier: Apache-2.0 */
/* router/route: the agentic worked example (reuse, avoided prefill, the load
 * guard), each peer policy on a hand-computed case, the cost model's terms by
 * hand, segment classes, herd-free ties across replicas, measured bandwidth,
 * in-flight bookkeeping, JSON receipts and bad input. */
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>

#include "core_internal.h"
#include "route_internal.h"
#include "test_harness.h"

#define BS 16u

/* ---- helpers ------------------------------------------------------------- */
/* Synthetic block keys: chain `c`, block i.  Chains sharing a prefix are
 * built by copying (the router never hashes; it only passes keys through). */
static kvp_key key_of(uint64_t c, size_t i) {
  return (kvp_key){kvp__mix64(c * 0x9E3779B97F4A7C15ull + i),
                   kvp__mix64(c ^ (i << 20) ^ 0xabcdefull)};
}

static kvp_key *keys_new(size_t n, uint64_t c) {
  kvp_key *k = malloc((n ? n : 1) * sizeof *k);
  ASSERT_NOT_NULL(k);
  for (size_t i = 0; i < n; i++)
    k[i] = key_of(c, i);
  return k;
}

static kvp_router *router_new(kvp_policy p, uint32_t n, uint32_t replica) {
  kvp_router_opts o = {0};
  o.block_size = 16; /* required: the hasher's */
  o.policy = p;
  o.n_workers = n;
  o.replica_id = replica;
  o.seed = 12345;
  kvp_router *r = NULL;
  ASSERT_OK(kvp_router_create(&o, NULL, &r));
  return r;
}

static kvp_route_request req_of(const kvp_key *keys, size_t nb, uint64_t tokens,
                                uint64_t session, uint64_t id) {
  kvp_route_request q = {0};
  q.keys = keys;
  q.n_blocks = nb;
  q.prompt_tokens = tokens;
  q.session_id = session;
  q.request_id = id;
  return q;
}

static kvp_worker_match hbm(uint32_t w, uint32_t blocks) {
  kvp_worker_match m = {0};
  m.worker = w;
  m.blocks[KVP_TIER_HBM] = blocks;
  return m;
}

static void set_load(kvp_router *r, uint32_t w, uint32_t queued,
                     uint32_t running, uint64_t prefill, uint64_t decode,
                     double util) {
  kvp_worker_load l = {0};
  l.queued_requests = queued;
  l.running_requests = running;
  l.prefill_tokens = prefill;
  l.decode_blocks = decode;
  l.kv_util = util;
  ASSERT_OK(kvp_router_set_load(r, w, &l));
}

static const kvp_route_candidate *cand_for(const kvp_decision *d, uint32_t w) {
  for (unsigned i = 0; i < d->n_top; i++)
    if (d->top[i].worker == w)
      return &d->top[i];
  return NULL;
}

static json_t *receipt(const kvp_decision *d) {
  char buf[8192];
  int n = kvp_router_receipt_json(d, NULL, buf, sizeof buf);
  ASSERT_GT(n, 0);
  ASSERT_LT(n, (int)sizeof buf);
  json_error_t err;
  json_t *j = json_loads(buf, 0, &err);
  if (j == NULL)
    fprintf(stderr, "bad JSON (%s): %s\n", err.text, buf);
  ASSERT_NOT_NULL(j);
  return j;
}

/* A member of the receipt's "route" object. */
static json_t *route_get(json_t *j, const char *key) {
  return json_object_get(json_object_get(j, "route"), key);
}

/* Default model/GPU (Llama-3.1-8B on an H100 at 50%): FLOPs for tokens
 * [a, b) = 2 * 8.03e9 * n + 4*32*32*128 * sum(t), achieved 4.945e14 FLOP/s. */
static double hand_flops(double a, double b) {
  return 1.606e10 * (b - a) + 524288.0 * (b - a) * (a + b - 1.0) / 2.0;
}
#define F_EFF 4.945e14

TEST(policy_names_and_model_math) {
  kvp_policy p;
  for (int i = 0; i < KVP_POLICY_COUNT_; i++) {
    ASSERT_OK(kvp_policy_parse(kvp_policy_name((kvp_policy)i), &p));
    ASSERT_EQ((int)p, i);
  }
  ASSERT_OK(kvp_policy_parse("SGLang-Cache-Aware", &p));
  ASSERT_EQ((int)p, (int)KVP_POLICY_SGLANG);
  ASSERT_ERR(kvp_policy_parse("sglang", &p), KVP_EINVAL);
  ASSERT_ERR(kvp_policy_parse(NULL, &p), KVP_EINVAL);
  ASSERT_STR_EQ(kvp_policy_name(KVP_POLICY_COUNT_), "unknown");
  /* 2 * 32 layers * 8 KV heads * 128 * 2 bytes */
  ASSERT_DOUBLE_NEAR(kvp_model_kv_bytes_per_token(NULL), 131072.0, 0.0);
  /* tokens 0 and 1: 2 * 1.606e10 + 524288 * (0 + 1) */
  ASSERT_DOUBLE_NEAR(kvp_model_prefill_flops(NULL, 0, 2), 3.212e10 + 524288.0,
                     1.0);
  ASSERT_DOUBLE_NEAR(kvp_model_prefill_flops(NULL, 5, 5), 0.0, 0.0);
  kvp_model_spec bad = {32, 32, 8, 128, 2, 0, -1.0, {0}};
  ASSERT_DOUBLE_NEAR(kvp_model_kv_bytes_per_token(&bad), 0.0, 0.0);
}

/* ---- THE AGENTIC WORKED EXAMPLE ------------------------------------------ */
/* Token i of a conversation: turn 2 repeats turn 1's tokens, then adds. */
static uint32_t conv_tok(uint64_t conv, size_t i) {
  return (uint32_t)(kvp__mix64(conv * 0x9E3779B97F4A7C15ull + i) % 128256u);
}

typedef struct convo {
  kvp_hasher *h;
  uint32_t *tok;
  kvp_key *keys;
  size_t cap;
} convo;

static void convo_init(convo *c, size_t cap) {
  kvp_namespace_desc nd = {.model_id = "test/route", .block_size = BS};
  kvp_namespace ns;
  ASSERT_OK(kvp_namespace_init(&nd, &ns));
  ASSERT_OK(kvp_hasher_create(&ns, NULL, NULL, &c->h));
  c->tok = malloc(cap * sizeof *c->tok);
  c->keys = malloc(cap / BS * sizeof *c->keys);
  ASSERT_NOT_NULL(c->tok);
  ASSERT_NOT_NULL(c->keys);
  for (size_t i = 0; i < cap; i++)
    c->tok[i] = conv_tok(42, i);
  c->cap = cap;
}

/* The first n tokens of the conversation, hashed as the router would. */
static kvp_route_request convo_turn(convo *c, size_t n, uint64_t id) {
  size_t tail = 99;
  int nb = kvp_hasher_hash(c->h, c->tok, n, NULL, c->keys, c->cap / BS, &tail);
  ASSERT_EQ(nb, (int)(n / BS));
  ASSERT_EQ(tail, n % BS);
  return req_of(c->keys, (size_t)nb, n, 42, id);
}

static kvp_index *index_new(uint32_t workers) {
  kvp_index_opts io = {0};
  io.max_workers = workers;
  kvp_index *ix = NULL;
  ASSERT_OK(kvp_index_create(&io, NULL, &ix));
  for (uint32_t w = 0; w < workers; w++)
    ASSERT_OK(kvp_index_worker_add(ix, w));
  return ix;
}

/* Turn 1 prefills 60,000 tokens on some worker A, whose KV events then put
 * its 3,750 blocks in the index (HBM).  Turn 2 (the same 60,000 + 1,000 new
 * tokens) must go to A with a receipt showing 60,000 tokens of prefill
 * avoided; with A overloaded past the guard, turn 3 goes elsewhere and the
 * receipt says so. */
TEST(agentic_worked_example) {
  enum { W = 8 };
  kvp_router *r = router_new(KVP_POLICY_KVPLANE_COST, W, 0);
  kvp_index *ix = index_new(W);
  convo c;
  convo_init(&c, 64000);
  kvp_decision d;

  kvp_route_request t1 = convo_turn(&c, 60000, 1); /* 3,750 blocks, no tail */
  ASSERT_OK(kvp_router_route(r, ix, &t1, 0, &d));
  uint32_t a = d.worker;
  ASSERT_LT(a, (uint32_t)W);
  ASSERT_EQ(d.reason, KVP_REASON_TIE); /* all idle and cold: hash decides */
  ASSERT_EQ(d.avoided_tokens, 0u);
  ASSERT_EQ(d.uncached_tokens, 60000u);
  uint64_t inflight_tokens = 0;
  ASSERT_OK(kvp_router_inflight(r, a, NULL, &inflight_tokens, NULL));
  ASSERT_EQ(inflight_tokens, 60000u);
  /* A prefilled turn 1: its stored event, then the prefill completes */
  ASSERT_EQ(kvp_index_stored(ix, a, 1, KVP_TIER_HBM, NULL, c.keys, 3750), 3750);
  ASSERT_OK(kvp_router_complete(r, a, 1));

  kvp_route_request t2 = convo_turn(&c, 61000, 2); /* 3,812 blocks + 8 */
  ASSERT_OK(kvp_router_route(r, ix, &t2, 0, &d));
  ASSERT_EQ(d.worker, a);
  ASSERT_EQ(d.reason, KVP_REASON_COST);
  ASSERT_EQ(d.avoided_tokens, 60000u); /* 3,750 whole blocks */
  ASSERT_EQ(d.uncached_tokens, 1000u);
  ASSERT_EQ(d.matched_tokens[KVP_TIER_HBM], 60000u);
  ASSERT_EQ(d.reused_tier_tokens[KVP_TIER_HBM], 60000u);
  ASSERT_EQ(d.matched_elsewhere_tokens, 0u);
  /* 9.636e14 + 9.437e14 = 1.907e15 FLOPs, 3.857 s at 4.945e14 FLOP/s */
  ASSERT_DOUBLE_NEAR(d.avoided_flops, hand_flops(0, 60000), 1e6);
  ASSERT_DOUBLE_NEAR(d.avoided_flops, 1.90733e15, 1e11);
  ASSERT_DOUBLE_NEAR(d.avoided_s, d.avoided_flops / F_EFF, 1e-9);
  ASSERT_TRUE(d.avoided_s > 3.8);
  /* here: 1,000 tokens at context 60,000 = 0.0966 s + 7.86e9 B / 3.35e12
   * B/s = 2.3 ms; elsewhere: the whole 61,000 = 3.95 s */
  ASSERT_DOUBLE_NEAR(d.top[0].recompute_s, hand_flops(60000, 61000) / F_EFF,
                     1e-9);
  ASSERT_DOUBLE_NEAR(d.top[0].load_s, 60000.0 * 131072.0 / 3.35e12, 1e-9);
  ASSERT_DOUBLE_NEAR(d.load_s, d.top[0].load_s, 0.0);
  ASSERT_EQ(d.n_top, 4u);
  ASSERT_DOUBLE_NEAR(d.top[1].recompute_s, hand_flops(0, 61000) / F_EFF, 1e-9);
  ASSERT_NOT_NULL(
      strstr(d.reason_text, "holds 60,000 of 61,000 tokens (HBM 60,000)"));
  json_t *j = receipt(&d);
  json_t *av = json_object_get(j, "prefill_avoided");
  ASSERT_EQ(json_integer_value(json_object_get(av, "tokens")), 60000);
  ASSERT_DOUBLE_NEAR(json_real_value(json_object_get(av, "flops")),
                     d.avoided_flops, 0.0); /* shortest round-trip form */
  ASSERT_EQ(json_integer_value(
                json_object_get(json_object_get(j, "reused_by_tier"), "hbm")),
            60000);
  ASSERT_STR_EQ(json_string_value(route_get(j, "reason")), "cost");
  json_decref(j);
  ASSERT_EQ(kvp_index_stored(ix, a, 2, KVP_TIER_HBM, &c.keys[3749],
                             c.keys + 3750, 62),
            62);
  ASSERT_OK(kvp_router_complete(r, a, 2));

  /* A now has 40 queued requests, the others 1 each: 40 > 2.0 x mean 1. */
  for (uint32_t w = 0; w < W; w++)
    set_load(r, w, w == a ? 40 : 1, 0, 0, 0, 0.5);
  kvp_route_request t3 = convo_turn(&c, 62024, 3);
  ASSERT_OK(kvp_router_route(r, ix, &t3, 0, &d));
  ASSERT_NE(d.worker, a);
  ASSERT_EQ(d.reason, KVP_REASON_GUARD);
  char want[96];
  snprintf(want, sizeof want,
           "guard: worker %u overloaded (load 40 > 2x mean 1", a);
  ASSERT_NOT_NULL(strstr(d.reason_text, want));
  const kvp_route_candidate *ca = cand_for(&d, a);
  ASSERT_NOT_NULL(ca);
  ASSERT_TRUE(ca->flags & KVP_CAND_GUARDED);
  ASSERT_EQ(ca->reused_tokens, 61000u - 8u);   /* 3,812 blocks */
  ASSERT_TRUE(ca->total_s < d.top[0].total_s); /* cost alone keeps A */
  ASSERT_EQ(d.avoided_tokens, 0u);
  ASSERT_EQ(d.matched_elsewhere_tokens, 61000u - 8u);
  j = receipt(&d);
  ASSERT_STR_EQ(json_string_value(route_get(j, "reason")), "guard");
  json_decref(j);
  kvp_hasher_destroy(c.h);
  free(c.tok);
  free(c.keys);
  kvp_index_destroy(ix);
  kvp_router_destroy(r);
}

/* Engines without KV events: the router records what it routed (approximate
 * mode), so the next turn finds it, as a predicted (uncertain) match. */
TEST(approximate_index_records_routes) {
  kvp_router_opts o = {0};
  o.block_size = 16; /* required: the hasher's */
  o.n_workers = 4;
  o.record_routed = 1;
  kvp_router *r = NULL;
  ASSERT_OK(kvp_router_create(&o, NULL, &r));
  kvp_index *ix = index_new(6); /* the index knows workers 4, 5 too */
  convo c;
  convo_init(&c, 8192);
  kvp_decision d;
  kvp_route_request t1 = convo_turn(&c, 4096, 1);
  ASSERT_OK(kvp_router_route(r, ix, &t1, 1000, &d));
  uint32_t a = d.worker;
  ASSERT_FALSE(d.flags & KVP_DECISION_NOT_RECORDED);
  ASSERT_OK(kvp_router_complete(r, a, 1));
  /* a worker the router does not know holds more: ignored, not an error */
  ASSERT_EQ(kvp_index_stored(ix, 5, 1, KVP_TIER_HBM, NULL, c.keys, 256), 256);
  kvp_route_request t2 = convo_turn(&c, 5000, 2);
  ASSERT_OK(kvp_router_route(r, ix, &t2, 2000, &d));
  ASSERT_EQ(d.worker, a);
  ASSERT_EQ(d.avoided_tokens, 4096u);
  ASSERT_EQ(d.matched_elsewhere_tokens, 0u); /* worker 5 is not ours */
  ASSERT_TRUE(d.top[0].flags & KVP_CAND_UNCERTAIN);
  /* 0.8 x (recompute the new 904 tokens + load) + 0.2 x recompute all */
  double want =
      0.8 * hand_flops(4096, 5000) / F_EFF + 0.2 * hand_flops(0, 5000) / F_EFF;
  ASSERT_DOUBLE_NEAR(d.top[0].recompute_s, want, 1e-12);
  ASSERT_ERR(kvp_router_route(r, NULL, &t2, 0, &d), KVP_EINVAL);
  ASSERT_EQ(d.worker, KVP_WORKER_NONE);
  kvp_hasher_destroy(c.h);
  free(c.tok);
  free(c.keys);
  kvp_index_destroy(ix);
  kvp_router_destroy(r);
}

/* ---- the cost model by hand ---------------------------------------------- */
/* A toy model so every term is checkable: 2 layers, 2 heads, 1 KV head, head
 * dim 4, 2-byte KV, 1,000 parameters -> 32 B/token, 128 B per 4-token block;
 * FLOPs/token = 2,000 + 64 * context; achieved 1e6 x 0.5 = 5e5 FLOP/s. */
static kvp_router_opts toy_opts(uint32_t n) {
  kvp_router_opts o = {0};
  o.n_workers = n;
  o.block_size = 4;
  o.model = (kvp_model_spec){2, 2, 1, 4, 2, 0, 1000.0, {0}};
  o.gpu.flops = 1e6;
  o.gpu.efficiency = 0.5;
  o.gpu.bw[KVP_TIER_HBM] = 1e5;
  o.gpu.bw[KVP_TIER_DRAM] = 1e4;
  o.gpu.latency_s[KVP_TIER_DRAM] = 1e-3;
  return o;
}

static kvp_router *toy_router_of(const kvp_router_opts *o) {
  kvp_router *r = NULL;
  ASSERT_OK(kvp_router_create(o, NULL, &r));
  return r;
}

static kvp_router *toy_router_with(uint32_t n, double overhead_s) {
  kvp_router_opts o = toy_opts(n);
  o.gpu.prefill_overhead_s = overhead_s;
  return toy_router_of(&o);
}

static kvp_router *toy_router(uint32_t n) { return toy_router_with(n, 0.0); }

static kvp_router *toy_router_decaying(uint32_t n) {
  kvp_router_opts o = toy_opts(n);
  o.inflight_decay = 1;
  return toy_router_of(&o);
}

TEST(cost_terms_by_hand_and_bandwidth_override) {
  kvp_router *r = toy_router(2);
  kvp_key *keys = keys_new(4, 1);
  kvp_worker_match m[2] = {hbm(0, 2), {0}};
  m[1].worker = 1;
  m[1].blocks[KVP_TIER_DRAM] = 3;
  kvp_route_request q = req_of(keys, 4, 16, 0, 0);
  kvp_decision d;
  /* w0: recompute [8,16) = 16,000 + 64 * 92 = 21,888 -> 0.043776 s;
   *     load 256 B / 1e5 = 0.00256 s; total 0.046336 s.
   * w1: recompute [12,16) = 8,000 + 64 * 54 = 11,456 -> 0.022912 s;
   *     load 384 B / 1e4 + 1 ms = 0.0394 s; total 0.062312 s. */
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 2, &d));
  ASSERT_EQ(d.worker, 0u);
  ASSERT_DOUBLE_NEAR(d.top[0].recompute_s, 0.043776, 1e-12);
  ASSERT_DOUBLE_NEAR(d.top[0].load_s, 0.00256, 1e-12);
  ASSERT_DOUBLE_NEAR(d.top[0].total_s, 0.046336, 1e-12);
  ASSERT_DOUBLE_NEAR(d.top[1].total_s, 0.062312, 1e-12);
  ASSERT_EQ(d.top[1].reused_tokens, 12u);
  ASSERT_OK(kvp_router_complete(r, 0, d.request_id));

  /* measured host link 1e6 B/s: w1 load = 0.000384 + 0.001 -> 0.024296 s */
  ASSERT_DOUBLE_NEAR(kvp_router_bandwidth(r, KVP_TIER_DRAM), 1e4, 0.0);
  ASSERT_OK(kvp_router_report_bandwidth(r, KVP_TIER_DRAM, 1e6));
  ASSERT_DOUBLE_NEAR(kvp_router_bandwidth(r, KVP_TIER_DRAM), 1e6, 0.0);
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 2, &d));
  ASSERT_EQ(d.worker, 1u);
  ASSERT_DOUBLE_NEAR(d.top[0].total_s, 0.024296, 1e-12);
  ASSERT_EQ(d.reused_tier_tokens[KVP_TIER_DRAM], 12u);
  ASSERT_OK(kvp_router_complete(r, 1, d.request_id));

  /* later reports blend (EWMA 0.25): 0.25 * 100 + 0.75 * 1e6 */
  ASSERT_OK(kvp_router_report_bandwidth(r, KVP_TIER_DRAM, 100.0));
  ASSERT_DOUBLE_NEAR(kvp_router_bandwidth(r, KVP_TIER_DRAM), 750025.0, 1e-6);
  for (int i = 0; i < 60; i++) /* converge to a slow link: 100 B/s */
    ASSERT_OK(kvp_router_report_bandwidth(r, KVP_TIER_DRAM, 100.0));
  /* payoff, not hits: loading 384 B at ~100 B/s (3.8 s) loses to recomputing
   * all 16 tokens: 32,000 + 64 * 120 = 39,680 -> 0.07936 s */
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 2, &d));
  ASSERT_EQ(d.worker, 0u);
  const kvp_route_candidate *c1 = cand_for(&d, 1);
  ASSERT_NOT_NULL(c1);
  ASSERT_EQ(c1->matched_tokens, 12u);
  ASSERT_EQ(c1->reused_tokens, 0u);
  ASSERT_DOUBLE_NEAR(c1->total_s, 0.07936, 1e-12);
  ASSERT_OK(kvp_router_complete(r, 0, d.request_id));

  /* queue: 10 reported prefill tokens x 2,000 / 5e5 = 0.04 s on w0 */
  set_load(r, 0, 1, 0, 10, 0, 0.0);
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 2, &d));
  ASSERT_DOUBLE_NEAR(cand_for(&d, 0)->queue_s, 0.04, 1e-12);
  free(keys);
  kvp_router_destroy(r);
}

/* gpu.prefill_overhead_s: each queued or in-flight request, and the routed
 * one, adds it to queue_s -- a worker with few queued tokens but many short
 * prompts waiting is slower than its FLOPs say (CPU vLLM: ~0.17 s each). */
TEST(prefill_overhead_counts_per_request) {
  kvp_router *r = toy_router_with(2, 0.1);
  kvp_key *keys = keys_new(4, 1);
  kvp_worker_match m[2] = {hbm(0, 3), hbm(1, 0)};
  kvp_route_request q = req_of(keys, 4, 16, 0, 0);
  kvp_decision d;
  /* w0 holds 12 of 16: recompute [12,16) 0.022912 s; load 384 B / 1e5 =
   * 0.00384 s; queue: its own overhead 0.1 s.  w1: recompute all 16:
   * 0.07936 s + 0.1 s. */
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 2, &d));
  ASSERT_EQ(d.worker, 0u);
  ASSERT_DOUBLE_NEAR(cand_for(&d, 0)->queue_s, 0.1, 1e-12);
  ASSERT_DOUBLE_NEAR(cand_for(&d, 0)->total_s, 0.1 + 0.022912 + 0.00384, 1e-12);
  ASSERT_DOUBLE_NEAR(cand_for(&d, 1)->total_s, 0.1 + 0.07936, 1e-12);
  /* now w0 has that request in flight: its recompute 0.022912 s + its
   * overhead; and two reported queued requests of 0 tokens: 2 x 0.1 more.
   * w0's queue 0.022912 + (2 + 1 + 1) x 0.1 = 0.422912 s; total 0.449664 s
   * > w1's 0.17936 s: the short prompts' fixed costs move the third away */
  set_load(r, 0, 2, 0, 0, 0, 0.0);
  kvp_decision d2;
  q.request_id = 77;
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 2, &d2));
  ASSERT_DOUBLE_NEAR(cand_for(&d2, 0)->queue_s, 0.022912 + 0.4, 1e-12);
  ASSERT_EQ(d2.worker, 1u);
  /* with no overhead modelled w0 stays the cheaper (0.049664 s) */
  kvp_router *z = toy_router(2);
  set_load(z, 0, 2, 0, 0, 0, 0.0);
  ASSERT_OK(kvp_router_route_matches(z, &q, m, 2, &d2));
  ASSERT_EQ(d2.worker, 0u);
  free(keys);
  kvp_router_destroy(z);
  kvp_router_destroy(r);
}

/* KVP_ROUTE_NOW: the in-flight prefill seconds run down with the caller's
 * clock (one toy worker; a cold 16-token prompt is 0.07936 s). */
TEST(inflight_runs_down_with_the_clock) {
  kvp_router *r = toy_router_decaying(1);
  kvp_router *off = toy_router(1); /* opts.inflight_decay 0: the clock is
                                      ignored, A counts whole */
  kvp_key *keys = keys_new(4, 1);
  kvp_decision d;
  kvp_route_request q = req_of(keys, 4, 16, 0, 1);
  q.flags = KVP_ROUTE_NOW;
  q.now_ns = 1000000000; /* A at 1.00 s: nothing ahead */
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  ASSERT_DOUBLE_NEAR(d.top[0].queue_s, 0.0, 1e-12);
  ASSERT_OK(kvp_router_route_matches(off, &q, NULL, 0, &d));
  q.request_id = 2, q.now_ns = 9000000000ull;
  ASSERT_OK(kvp_router_route_matches(off, &q, NULL, 0, &d));
  ASSERT_DOUBLE_NEAR(d.top[0].queue_s, 0.07936, 1e-12);
  kvp_router_destroy(off);
  q.request_id = 1;
  q.request_id = 2, q.now_ns = 1050000000; /* B at 1.05 s: A's 0.02936 left */
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  ASSERT_DOUBLE_NEAR(d.top[0].queue_s, 0.07936 - 0.05, 1e-9);
  /* without the clock: every in-flight second, as before (A + B) */
  q.request_id = 3, q.flags = 0;
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  ASSERT_DOUBLE_NEAR(d.top[0].queue_s, 2 * 0.07936, 1e-12);
  /* C completes: what is left never rises above what is in flight (A + B),
   * and runs down from the last routing with the clock (1.05 s) */
  ASSERT_OK(kvp_router_complete(r, 0, 3));
  q.request_id = 4, q.flags = KVP_ROUTE_NOW, q.now_ns = 1100000000;
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  ASSERT_DOUBLE_NEAR(d.top[0].queue_s, 2 * 0.07936 - 0.05, 1e-9);
  /* a clock behind the last routing counts no time elapsed */
  q.request_id = 5, q.now_ns = 900000000;
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  ASSERT_DOUBLE_NEAR(d.top[0].queue_s, 3 * 0.07936 - 0.05, 1e-9);
  /* long after: nothing left, though four are still in flight */
  q.request_id = 6, q.now_ns = 9000000000ull;
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  ASSERT_DOUBLE_NEAR(d.top[0].queue_s, 0.0, 1e-12);
  double sec;
  uint64_t n;
  ASSERT_OK(kvp_router_inflight(r, 0, &n, NULL, &sec));
  ASSERT_EQ(n, 5u); /* A, B, 4, 5, 6 */
  ASSERT_DOUBLE_NEAR(sec, 5 * 0.07936, 1e-12);
  q.flags = 0x4; /* unknown flag bits */
  ASSERT_ERR(kvp_router_route_matches(r, &q, NULL, 0, &d), KVP_EINVAL);
  kvp_router_destroy(r);

  /* decay turned on by a reload: what was routed meanwhile runs down from
   * its latest routing (3.0 s), not from the router's start */
  kvp_router_opts o = toy_opts(1);
  r = toy_router_of(&o);
  q = req_of(keys, 4, 16, 0, 1);
  q.flags = KVP_ROUTE_NOW, q.now_ns = 3000000000ull;
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  o.inflight_decay = 1;
  ASSERT_OK(kvp_router_set_opts(r, &o));
  q.request_id = 2, q.now_ns = 3010000000ull;
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  ASSERT_DOUBLE_NEAR(d.top[0].queue_s, 0.07936 - 0.01, 1e-9);
  free(keys);
  kvp_router_destroy(r);
}

static kvp_router *toy_pending_router(uint32_t pending_ms) {
  kvp_router_opts o = toy_opts(2);
  o.pending_ms = pending_ms;
  o.inflight_decay = 1;
  return toy_router_of(&o);
}

/* opts.pending_ms: a prefill in progress on an engine with events is seen
 * (as a predicted match) by the requests that arrive before its events.
 * Turn A (16 tokens, 0.07936 s cold) goes to X at 1.00 s; B (A + 4 tokens)
 * arrives at t.  On X: A's prefill left, then B's 4 new tokens with the
 * pending 16 discounted as predicted: 0.8 x 0.02496 + 0.2 x 0.10432 + 0.8 x
 * 512 B / 1e5; on the idle Y: 0.10432 s cold. */
TEST(pending_prefill_seen_before_events) {
  kvp_key *keys = keys_new(5, 7);
  for (int pass = 0; pass < 3; pass++) {
    /* pass 0: B at 1.06 s -> X (0.01936 + 0.044928 < 0.10432);
     * pass 1: B at 1.001 s -> Y (0.07836 + 0.044928 > 0.10432);
     * pass 2: pending off, B at 1.06 s -> Y (X matches nothing) */
    kvp_router *r = toy_pending_router(pass == 2 ? 0 : 100);
    kvp_index *ix = index_new(2);
    kvp_decision d;
    kvp_route_request a = req_of(keys, 4, 16, 0, 1);
    a.flags = KVP_ROUTE_NOW, a.now_ns = 1000000000;
    ASSERT_OK(kvp_router_route(r, ix, &a, a.now_ns, &d));
    ASSERT_FALSE(d.flags & KVP_DECISION_NOT_RECORDED);
    uint32_t x = d.worker, y = 1 - x;
    kvp_index_match m[2];
    int got = kvp_index_query(ix, keys, 5, 1010000000, m, 2);
    if (pass == 2) {
      ASSERT_EQ(got, 0);
    } else { /* A's 4 blocks pending on X for 0.07936 + 0.1 s */
      ASSERT_EQ(got, 1);
      ASSERT_EQ(m[0].worker, x);
      ASSERT_EQ(m[0].routed_blocks, 4u);
      ASSERT_EQ(kvp_index_query(ix, keys, 5, 1179350000, m, 2), 1);
      ASSERT_EQ(kvp_index_query(ix, keys, 5, 1179370000, m, 2), 0);
    }
    kvp_route_request b = req_of(keys, 5, 20, 0, 2);
    b.flags = KVP_ROUTE_NOW, b.now_ns = pass == 1 ? 1001000000 : 1060000000;
    ASSERT_OK(kvp_router_route(r, ix, &b, b.now_ns, &d));
    const kvp_route_candidate *cx = cand_for(&d, x), *cy = cand_for(&d, y);
    ASSERT_NOT_NULL(cx);
    ASSERT_NOT_NULL(cy);
    ASSERT_DOUBLE_NEAR(cy->total_s, 0.10432, 1e-9);
    double q = 0.07936 - (pass == 1 ? 0.001 : 0.06);
    ASSERT_DOUBLE_NEAR(cx->queue_s, q, 1e-9);
    if (pass < 2) {
      ASSERT_EQ(cx->matched_tokens, 16u);
      ASSERT_TRUE(cx->flags & KVP_CAND_UNCERTAIN);
      ASSERT_DOUBLE_NEAR(cx->total_s, q + 0.8 * 0.02496 + 0.2 * 0.10432 +
                                          0.8 * 0.00512, 1e-9);
    }
    ASSERT_EQ(d.worker, pass == 0 ? x : y);
    /* B went to X: only its block past A's is recorded; to Y: all five */
    ASSERT_EQ(kvp_index_query(ix, keys, 5, b.now_ns + 1000, m, 2),
              (pass == 2 ? 0 : pass == 0 ? 1 : 2));
    kvp_index_destroy(ix);
    kvp_router_destroy(r);
  }
  free(keys);
}

/* ---- segment classes ----------------------------------------------------- */
/* A stable prefix cached on every worker must not pull new sessions onto one
 * worker: kvplane spreads them (the prefix costs the same everywhere), while
 * SGLang's cache-aware rule (match rate 0.67 > 0.3, first best match) sends
 * them all to worker 0. */
TEST(stable_prefix_everywhere_does_not_pull) {
  enum { W = 4, STABLE = 128, OWN = 64, S = 8 };
  int count[2][W] = {{0}};
  for (int pol = 0; pol < 2; pol++) {
    kvp_router *r =
        router_new(pol ? KVP_POLICY_SGLANG : KVP_POLICY_KVPLANE_COST, W, 0);
    kvp_worker_match m[W];
    for (uint32_t w = 0; w < W; w++)
      m[w] = hbm(w, STABLE);
    for (uint64_t s = 1; s <= S; s++) {
      kvp_key *keys = keys_new(STABLE + OWN, 99);
      for (size_t i = STABLE; i < STABLE + OWN; i++)
        keys[i] = key_of(1000 + s, i); /* each session's own turn */
      kvp_route_request q = req_of(keys, STABLE + OWN, 0, s, s);
      kvp_decision d;
      ASSERT_OK(kvp_router_route_matches(r, &q, m, W, &d));
      count[pol][d.worker]++;
      ASSERT_EQ(d.avoided_tokens, (uint64_t)STABLE * BS);
      free(keys);
    }
    kvp_router_destroy(r);
  }
  for (uint32_t w = 0; w < W; w++)
    ASSERT_EQ(count[0][w], S / W); /* kvplane: 2 each */
  ASSERT_EQ(count[1][0], S);       /* SGLang: all on worker 0 */
}

/* The semi-stable history is what affinity is for: all workers hold the
 * stable part, worker 2 also holds this session's history.  The cost model
 * compares only what differs; no special case in the code. */
TEST(semi_stable_history_drives_affinity) {
  enum { W = 4, STABLE = 128, SEMI = 256, NEW = 32, NB = STABLE + SEMI + NEW };
  kvp_router *r = router_new(KVP_POLICY_KVPLANE_COST, W, 0);
  kvp_key *keys = keys_new(NB, 5);
  kvp_worker_match m[W];
  for (uint32_t w = 0; w < W; w++)
    m[w] = hbm(w, w == 2 ? STABLE + SEMI : STABLE);
  kvp_classification cls = {0};
  cls.stable_end = STABLE, cls.semi_end = STABLE + SEMI, cls.n_blocks = NB;
  kvp_route_request q = req_of(keys, NB, 0, 77, 0);
  q.cls = &cls;
  set_load(r, 2, 2, 1, 2000, 0, 0.3); /* worker 2 is a little busier */
  kvp_decision d;
  ASSERT_OK(kvp_router_route_matches(r, &q, m, W, &d));
  ASSERT_EQ(d.worker, 2u);
  ASSERT_EQ(d.reason, KVP_REASON_COST);
  ASSERT_EQ(d.reused_class_tokens[KVP_CLASS_STABLE], (uint64_t)STABLE * BS);
  ASSERT_EQ(d.reused_class_tokens[KVP_CLASS_SEMI], (uint64_t)SEMI * BS);
  ASSERT_EQ(d.reused_class_tokens[KVP_CLASS_VOLATILE], 0u);
  for (unsigned i = 1; i < d.n_top; i++) /* the others reuse the stable part */
    ASSERT_EQ(d.top[i].reused_tokens, (uint64_t)STABLE * BS);
  ASSERT_OK(kvp_router_complete(r, 2, d.request_id));
  /* Busy enough that the history no longer pays: 200,000 queued tokens are
   * 6.5 s of prefill, the history 0.6 s. */
  set_load(r, 2, 2, 1, 200000, 0, 0.3);
  ASSERT_OK(kvp_router_route_matches(r, &q, m, W, &d));
  ASSERT_NE(d.worker, 2u);
  ASSERT_NE(d.reason, KVP_REASON_GUARD); /* the cost model moved it */
  ASSERT_EQ(d.reused_class_tokens[KVP_CLASS_STABLE], (uint64_t)STABLE * BS);
  ASSERT_EQ(d.reused_class_tokens[KVP_CLASS_SEMI], 0u);
  free(keys);
  kvp_router_destroy(r);
}

/* The guard counts requests before their first token (queued + in flight):
 * a holder busy decoding keeps its prompts (measured in make live: the
 * request count guard sent turns away from holders with nothing queued,
 * bench/live/breakdown.py); guard_load "requests" is the old rule. */
TEST(guard_counts_requests_before_first_token) {
  enum { W = 4, NB = 64 };
  kvp_key *keys = keys_new(NB, 11);
  kvp_worker_match m[W];
  for (uint32_t w = 0; w < W; w++)
    m[w] = hbm(w, w == 1 ? NB : 0);
  kvp_route_request q = req_of(keys, NB, 0, 0, 0);
  kvp_decision d;
  for (int mode = 0; mode < 2; mode++) {
    kvp_router_opts o = {0};
    o.block_size = 16, o.n_workers = W, o.seed = 1;
    o.guard_load = mode ? KVP_GUARD_LOAD_REQUESTS : 0;
    kvp_router *r = NULL;
    ASSERT_OK(kvp_router_create(&o, NULL, &r));
    for (uint32_t w = 0; w < W; w++) /* worker 1: twelve decoding */
      set_load(r, w, 0, w == 1 ? 12 : 1, 0, 0, 0.5);
    ASSERT_OK(kvp_router_route_matches(r, &q, m, W, &d));
    const kvp_route_candidate *c1 = cand_for(&d, 1);
    ASSERT_NOT_NULL(c1);
    if (mode == 0) {
      ASSERT_EQ(d.worker, 1u);
      ASSERT_EQ(d.reason, KVP_REASON_COST);
      ASSERT_FALSE(c1->flags & KVP_CAND_GUARDED);
    } else {
      ASSERT_NE(d.worker, 1u);
      ASSERT_EQ(d.reason, KVP_REASON_GUARD);
      ASSERT_TRUE(c1->flags & KVP_CAND_GUARDED);
      ASSERT_NOT_NULL(strstr(d.reason_text, "overloaded (load 12 > 2x mean 1"));
    }
    ASSERT_OK(kvp_router_complete(r, d.worker, d.request_id));
    /* twelve waiting for their prefill: overloaded in either mode */
    for (uint32_t w = 0; w < W; w++)
      set_load(r, w, w == 1 ? 12 : 0, 1, 0, 0, 0.5);
    ASSERT_OK(kvp_router_route_matches(r, &q, m, W, &d));
    ASSERT_NE(d.worker, 1u);
    ASSERT_EQ(d.reason, KVP_REASON_GUARD);
    ASSERT_OK(kvp_router_complete(r, d.worker, d.request_id));
    /* ... unless every other worker's predicted queue is longer (100,000
     * reported prefill tokens each): the brake would only add wait */
    for (uint32_t w = 0; w < W; w++)
      set_load(r, w, w == 1 ? 12 : 0, 1, w == 1 ? 0 : 100000, 0, 0.5);
    ASSERT_OK(kvp_router_route_matches(r, &q, m, W, &d));
    ASSERT_EQ(d.worker, 1u);
    ASSERT_EQ(d.reason, KVP_REASON_COST);
    ASSERT_FALSE(cand_for(&d, 1)->flags & KVP_CAND_GUARDED);
    ASSERT_OK(kvp_router_complete(r, d.worker, d.request_id));
    /* and this router's own prompts in flight count: twelve short ones sent
     * to worker 1 (the only eligible one), nothing reported yet */
    for (uint32_t w = 0; w < W; w++)
      set_load(r, w, 0, 0, 0, 0, 0.0);
    uint64_t only1 = 1u << 1;
    kvp_route_request tiny = req_of(keys, 1, 0, 0, 0);
    tiny.eligible = &only1, tiny.n_eligible_words = 1;
    kvp_worker_match m1 = hbm(1, 1);
    for (int i = 0; i < 12; i++) {
      tiny.request_id = 1000 + (uint64_t)i;
      ASSERT_OK(kvp_router_route_matches(r, &tiny, &m1, 1, &d));
      ASSERT_EQ(d.worker, 1u);
    }
    ASSERT_OK(kvp_router_route_matches(r, &q, m, W, &d));
    ASSERT_NE(d.worker, 1u);
    ASSERT_EQ(d.reason, KVP_REASON_GUARD);
    kvp_router_destroy(r);
  }
  free(keys);
}

/* ---- affinity and herding ------------------------------------------------ */
TEST(affinity_within_epsilon) {
  kvp_router *r = router_new(KVP_POLICY_KVPLANE_COST, 4, 0);
  kvp_key *keys = keys_new(64, 3);
  kvp_route_request q = req_of(keys, 64, 0, 9, 0);
  kvp_decision d;
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  uint32_t s = d.worker;
  ASSERT_OK(kvp_router_complete(r, s, d.request_id));
  /* 1,024 tokens cost 0.0347 s; 20 queued tokens on s add 0.65 ms (< 2 ms) */
  set_load(r, s, 0, 1, 20, 0, 0.0);
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  ASSERT_EQ(d.worker, s);
  ASSERT_EQ(d.reason, KVP_REASON_AFFINITY);
  ASSERT_NOT_NULL(strstr(d.reason_text, "affinity: session stays on worker"));
  size_t len = strlen(d.reason_text); /* nothing reused: no dangling "; " */
  ASSERT_TRUE(len > 2 && d.reason_text[len - 1] == ')' &&
              strstr(d.reason_text, "; ") == NULL);
  ASSERT_OK(kvp_router_complete(r, s, d.request_id));
  /* 2,000 queued tokens add 65 ms: beyond epsilon, the session moves */
  set_load(r, s, 0, 1, 2000, 0, 0.0);
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  ASSERT_NE(d.worker, s);
  free(keys);
  kvp_router_destroy(r);
}

/* Router replicas seeing identical state must not all pick one worker. */
TEST(no_herding_across_replicas) {
  enum { W = 8, R = 64 };
  int count[W] = {0};
  kvp_key *keys = keys_new(32, 11);
  for (uint32_t rep = 0; rep < R; rep++) {
    kvp_router *r = router_new(KVP_POLICY_KVPLANE_COST, W, rep);
    kvp_route_request q = req_of(keys, 32, 0, 5, 1000);
    kvp_decision d, d2;
    ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
    ASSERT_EQ(d.reason, KVP_REASON_TIE);
    count[d.worker]++;
    kvp_router_destroy(r);
    r = router_new(KVP_POLICY_KVPLANE_COST, W, rep); /* deterministic */
    ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d2));
    ASSERT_EQ(d2.worker, d.worker);
    kvp_router_destroy(r);
  }
  int distinct = 0, most = 0;
  for (int w = 0; w < W; w++)
    distinct += count[w] > 0, most = count[w] > most ? count[w] : most;
  ASSERT_GE(distinct, 7); /* lowest-index ties would give 1 */
  ASSERT_LE(most, 18);    /* 64 / 8 = 8 expected */
  free(keys);
}

/* ---- peer policies on hand-computed cases -------------------------------- */
/* Match, then decide (kvp_router_match + kvp_router_route_matches), as a
 * daemon runs them around its own lock: the matches are the index's, by
 * hand, and the decision is kvp_router_route's on a twin router. */
TEST(two_step_match_then_decide) {
  kvp_router_opts o = {0};
  o.block_size = 16;
  o.n_workers = 4;
  kvp_router *r1 = NULL, *r2 = NULL;
  ASSERT_OK(kvp_router_create(&o, NULL, &r1));
  ASSERT_OK(kvp_router_create(&o, NULL, &r2));
  kvp_index *ix = index_new(6); /* workers 4, 5: not the router's */
  convo c;
  convo_init(&c, 8192);
  kvp_route_request t = convo_turn(&c, 4096, 1); /* 256 blocks */
  ASSERT_EQ(kvp_index_stored(ix, 1, 1, KVP_TIER_HBM, NULL, c.keys, 100), 100);
  ASSERT_EQ(kvp_index_stored(ix, 2, 1, KVP_TIER_HBM, NULL, c.keys, 50), 50);
  ASSERT_EQ(kvp_index_stored(ix, 2, 2, KVP_TIER_DRAM, &c.keys[49], &c.keys[50],
                             30), 30);
  ASSERT_EQ(kvp_index_stored(ix, 5, 1, KVP_TIER_HBM, NULL, c.keys, 200), 200);
  ASSERT_EQ(kvp_index_record_routed(ix, 3, c.keys, 30, 1000), 30);
  kvp_index_match scratch[6];
  kvp_worker_match m[6];
  int n = kvp_router_match(ix, c.keys, t.n_blocks, 2000, 4, scratch, m, 6);
  ASSERT_EQ(n, 3);
  uint32_t seen = 0;
  for (int i = 0; i < n; i++) {
    uint32_t hb = m[i].blocks[KVP_TIER_HBM], dr = m[i].blocks[KVP_TIER_DRAM];
    seen |= 1u << m[i].worker;
    if (m[i].worker == 1)
      ASSERT_TRUE(hb == 100 && dr == 0 && m[i].flags == 0);
    else if (m[i].worker == 2)
      ASSERT_TRUE(hb == 50 && dr == 30 && m[i].flags == 0);
    else /* routed, not stored: predicted HBM, uncertain */
      ASSERT_TRUE(m[i].worker == 3 && hb == 30 && dr == 0 &&
                  m[i].flags == KVP_MATCH_UNCERTAIN);
  }
  ASSERT_EQ(seen, 0xEu);
  kvp_decision d1, d2;
  ASSERT_OK(kvp_router_route(r1, ix, &t, 2000, &d1));
  ASSERT_OK(kvp_router_route_matches(r2, &t, m, (size_t)n, &d2));
  ASSERT_EQ(d1.worker, 1u);
  ASSERT_EQ(d2.worker, d1.worker);
  ASSERT_EQ(d2.avoided_tokens, d1.avoided_tokens);
  ASSERT_EQ(d2.matched_elsewhere_tokens, d1.matched_elsewhere_tokens);
  ASSERT_EQ(d2.n_top, d1.n_top);
  for (uint32_t i = 0; i < d1.n_top; i++) {
    ASSERT_EQ(d2.top[i].worker, d1.top[i].worker);
    ASSERT_DOUBLE_NEAR(d2.top[i].recompute_s, d1.top[i].recompute_s, 0);
  }
  /* a prefix of the chain, a smaller cap, bad arguments */
  ASSERT_EQ(kvp_router_match(ix, c.keys, 40, 2000, 4, scratch, m, 6), 3);
  for (int i = 0; i < 3; i++)
    ASSERT_TRUE(m[i].blocks[KVP_TIER_HBM] + m[i].blocks[KVP_TIER_DRAM] <= 40);
  ASSERT_EQ(kvp_router_match(ix, c.keys, t.n_blocks, 2000, 2, scratch, m, 6),
            1); /* only worker 1 is below 2 */
  ASSERT_EQ(m[0].worker, 1u);
  ASSERT_ERR(kvp_router_match(NULL, c.keys, 1, 0, 4, scratch, m, 6), KVP_EINVAL);
  ASSERT_ERR(kvp_router_match(ix, c.keys, 1, 0, 4, NULL, m, 6), KVP_EINVAL);
  ASSERT_ERR(kvp_router_match(ix, NULL, 1, 0, 4, scratch, m, 6), KVP_EINVAL);
  kvp_hasher_destroy(c.h);
  free(c.tok);
  free(c.keys);
  kvp_index_destroy(ix);
  kvp_router_destroy(r1);
  kvp_router_destroy(r2);
}

TEST(round_robin_skips_offline) {
  kvp_router *r = router_new(KVP_POLICY_ROUND_ROBIN, 3, 0);
  kvp_worker_load off = {0};
  off.flags = KVP_WORKER_OFFLINE;
  ASSERT_OK(kvp_router_set_load(r, 1, &off));
  const uint32_t want[] = {0, 2, 0, 2};
  for (int i = 0; i < 4; i++) {
    kvp_route_request q = req_of(NULL, 0, 10, 0, 0);
    kvp_decision d;
    ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
    ASSERT_EQ(d.worker, want[i]);
    ASSERT_EQ(d.reason, KVP_REASON_ROUND_ROBIN);
    ASSERT_EQ(d.n_eligible, 2u);
  }
  kvp_router_destroy(r);
}

/* kvp_policy_reads_matches: round_robin's choices are the same with the
 * index's matches as without, through offline workers and completions;
 * least_loaded's are not (the in-flight tokens the matches leave uncached
 * steer it), which is why it reads them. */
TEST(round_robin_reads_no_matches) {
  enum { W = 5 };
  ASSERT_EQ(kvp_policy_reads_matches(KVP_POLICY_ROUND_ROBIN), 0);
  ASSERT_EQ(kvp_policy_reads_matches(KVP_POLICY_LEAST_LOADED), 1);
  ASSERT_EQ(kvp_policy_reads_matches((kvp_policy)KVP_POLICY_COUNT_), 1);
  kvp_key *keys = keys_new(40, 3);
  const kvp_policy pols[] = {KVP_POLICY_ROUND_ROBIN, KVP_POLICY_LEAST_LOADED};
  for (int p = 0; p < 2; p++) {
    kvp_router *a = router_new(pols[p], W, 0), *b = router_new(pols[p], W, 0);
    int differ = 0;
    for (uint64_t i = 1; i <= 2000; i++) {
      if (kvt_rand_below(10) == 0) { /* the same load news to both */
        kvp_worker_load l = {0};
        uint32_t w = kvt_rand_below(W);
        l.flags = w != 0 && kvt_rand_below(3) == 0 ? KVP_WORKER_OFFLINE : 0;
        l.prefill_tokens = kvt_rand_below(5000);
        ASSERT_OK(kvp_router_set_load(a, w, &l));
        ASSERT_OK(kvp_router_set_load(b, w, &l));
      }
      kvp_worker_match m[W];
      size_t nm = kvt_rand_below(W + 1);
      for (size_t k = 0; k < nm; k++)
        m[k] = hbm((uint32_t)k, kvt_rand_below(41));
      kvp_route_request q = req_of(keys, 40, 640, 0, i);
      kvp_decision da, db;
      ASSERT_OK(kvp_router_route_matches(a, &q, m, nm, &da));
      ASSERT_OK(kvp_router_route_matches(b, &q, NULL, 0, &db));
      if (pols[p] == KVP_POLICY_ROUND_ROBIN)
        ASSERT_EQ(da.worker, db.worker);
      differ += da.worker != db.worker;
      if (kvt_rand_below(2)) {
        ASSERT_OK(kvp_router_complete(a, da.worker, i));
        ASSERT_OK(kvp_router_complete(b, db.worker, i));
      }
    }
    if (pols[p] == KVP_POLICY_LEAST_LOADED)
      ASSERT_GT(differ, 100);
    kvp_router_destroy(a);
    kvp_router_destroy(b);
  }
  free(keys);
}

/* kvp_router_route_chosen's match: the chosen worker's entry of the array
 * the twin router gets whole; counts the calls and checks the worker. */
typedef struct chosen_ctx {
  const kvp_worker_match *m;
  size_t n;
  int calls, fail;
  uint32_t asked;
} chosen_ctx;

static int chosen_fn(void *ctx, uint32_t w, kvp_worker_match *out) {
  chosen_ctx *c = ctx;
  c->calls++;
  c->asked = w;
  if (c->fail)
    return KVP_EIO;
  for (size_t i = 0; i < c->n; i++)
    if (c->m[i].worker == w) {
      memcpy(out->blocks, c->m[i].blocks, sizeof out->blocks);
      out->flags = c->m[i].flags;
    }
  return 0;
}

/* round_robin and least_loaded choose on load: asked for the chosen
 * worker's match alone they decide as a twin given every worker's (random
 * matches over all tiers, some uncertain; loads, offline workers and
 * completions the same to both), reuse and in-flight tokens included; only
 * the others' matches are unknown.  The policies that compare matches
 * refuse; a failing fn reuses nothing; a match longer than the chain is
 * refused with nothing recorded. */
TEST(chosen_match_only) {
  enum { W = 6, NB = 40 };
  ASSERT_EQ(kvp_policy_compares_matches(KVP_POLICY_ROUND_ROBIN), 0);
  ASSERT_EQ(kvp_policy_compares_matches(KVP_POLICY_LEAST_LOADED), 0);
  for (int p = 0; p < KVP_POLICY_COUNT_; p++)
    if (p != KVP_POLICY_ROUND_ROBIN && p != KVP_POLICY_LEAST_LOADED)
      ASSERT_EQ(kvp_policy_compares_matches((kvp_policy)p), 1);
  ASSERT_EQ(kvp_policy_compares_matches((kvp_policy)KVP_POLICY_COUNT_), 1);
  kvp_key *keys = keys_new(NB, 9);
  const kvp_policy pols[] = {KVP_POLICY_ROUND_ROBIN, KVP_POLICY_LEAST_LOADED};
  for (int p = 0; p < 2; p++) {
    kvp_router *a = router_new(pols[p], W, 0), *b = router_new(pols[p], W, 0);
    int reused = 0;
    for (uint64_t i = 1; i <= 3000; i++) {
      if (kvt_rand_below(8) == 0) {
        kvp_worker_load l = {0};
        uint32_t w = kvt_rand_below(W);
        l.flags = w != 0 && kvt_rand_below(3) == 0 ? KVP_WORKER_OFFLINE : 0;
        l.prefill_tokens = kvt_rand_below(5000);
        l.queued_requests = kvt_rand_below(4);
        ASSERT_OK(kvp_router_set_load(a, w, &l));
        ASSERT_OK(kvp_router_set_load(b, w, &l));
      }
      kvp_worker_match m[W];
      size_t nm = 0;
      for (uint32_t w = 0; w < W; w++) {
        if (kvt_rand_below(4) == 0)
          continue; /* holds nothing */
        kvp_worker_match x = {.worker = w};
        uint32_t left = NB;
        for (int k = 0; k < KVP_TIER_COUNT_; k++) {
          x.blocks[k] = kvt_rand_below(left / 2 + 1);
          left -= x.blocks[k];
        }
        x.flags = kvt_rand_below(5) == 0 ? KVP_MATCH_UNCERTAIN : 0;
        m[nm++] = x;
      }
      kvp_route_request q =
          req_of(keys, NB, NB * BS + kvt_rand_below(BS), 0, i);
      chosen_ctx c = {m, nm, 0, 0, 0};
      kvp_decision da, db;
      ASSERT_OK(kvp_router_route_matches(a, &q, m, nm, &da));
      ASSERT_OK(kvp_router_route_chosen(b, &q, chosen_fn, &c, &db));
      ASSERT_EQ(c.calls, 1);
      ASSERT_EQ(c.asked, da.worker);
      ASSERT_EQ(db.worker, da.worker);
      ASSERT_EQ(db.reason, da.reason);
      ASSERT_EQ(db.flags, da.flags | KVP_DECISION_CHOSEN_ONLY);
      ASSERT_EQ(db.uncached_tokens, da.uncached_tokens);
      ASSERT_EQ(db.avoided_tokens, da.avoided_tokens);
      ASSERT_TRUE(db.avoided_s == da.avoided_s && db.load_s == da.load_s);
      ASSERT_MEM_EQ(db.matched_tokens, da.matched_tokens,
                    sizeof da.matched_tokens);
      ASSERT_MEM_EQ(db.reused_tier_tokens, da.reused_tier_tokens,
                    sizeof da.reused_tier_tokens);
      ASSERT_MEM_EQ(db.load_bytes, da.load_bytes, sizeof da.load_bytes);
      ASSERT_EQ(db.matched_elsewhere_tokens, 0u);
      ASSERT_EQ(db.n_top, da.n_top);
      ASSERT_MEM_EQ(&db.top[0], &da.top[0], sizeof da.top[0]);
      for (unsigned k = 1; k < da.n_top; k++) /* same order, no matches */
        ASSERT_EQ(db.top[k].worker, da.top[k].worker);
      reused += da.avoided_tokens > 0;
      if (i == 1) { /* the receipt says whose match was read */
        json_t *ja = receipt(&da), *jb = receipt(&db);
        json_t *fa = route_get(ja, "flags"), *fb = route_get(jb, "flags");
        ASSERT_EQ(json_array_size(fb), json_array_size(fa) + 1);
        ASSERT_STR_EQ(json_string_value(json_array_get(
                          fb, json_array_size(fb) - 1)),
                      "chosen_only");
        json_decref(ja);
        json_decref(jb);
      }
      for (uint32_t w = 0; w < W; w++) {
        uint64_t na, ta, nb2, tb;
        ASSERT_OK(kvp_router_inflight(a, w, &na, &ta, NULL));
        ASSERT_OK(kvp_router_inflight(b, w, &nb2, &tb, NULL));
        ASSERT_EQ(na, nb2);
        ASSERT_EQ(ta, tb);
      }
      if (kvt_rand_below(2)) {
        ASSERT_OK(kvp_router_complete(a, da.worker, i));
        ASSERT_OK(kvp_router_complete(b, db.worker, i));
      }
    }
    ASSERT_GT(reused, 300);
    /* fn fails: the chosen worker reuses nothing, said as a failed query */
    kvp_worker_match all = hbm(0, NB);
    chosen_ctx f = {&all, 1, 0, 1, 0};
    kvp_route_request q = req_of(keys, NB, NB * BS, 0, 0);
    kvp_decision d;
    ASSERT_OK(kvp_router_route_chosen(b, &q, chosen_fn, &f, &d));
    ASSERT_EQ(f.calls, 1);
    ASSERT_EQ(d.avoided_tokens, 0u);
    ASSERT_EQ(d.uncached_tokens, (uint64_t)NB * BS);
    ASSERT_TRUE((d.flags & KVP_DECISION_NO_INDEX) != 0);
    /* a match longer than the chain: refused, nothing put in flight */
    uint64_t before[W];
    for (uint32_t w = 0; w < W; w++)
      ASSERT_OK(kvp_router_inflight(b, w, &before[w], NULL, NULL));
    kvp_worker_match too_long[W];
    for (uint32_t w = 0; w < W; w++)
      too_long[w] = hbm(w, NB + 1);
    chosen_ctx t = {too_long, W, 0, 0, 0};
    ASSERT_EQ(kvp_router_route_chosen(b, &q, chosen_fn, &t, &d), KVP_EINVAL);
    ASSERT_EQ(d.worker, KVP_WORKER_NONE);
    for (uint32_t w = 0; w < W; w++) {
      uint64_t n;
      ASSERT_OK(kvp_router_inflight(b, w, &n, NULL, NULL));
      ASSERT_EQ(n, before[w]);
    }
    ASSERT_EQ(kvp_router_route_chosen(b, &q, NULL, NULL, &d), KVP_EINVAL);
    kvp_router_destroy(a);
    kvp_router_destroy(b);
  }
  /* the policies that compare matches need them all */
  for (int p = 0; p < KVP_POLICY_COUNT_; p++) {
    if (!kvp_policy_compares_matches((kvp_policy)p))
      continue;
    kvp_router *r = router_new((kvp_policy)p, W, 0);
    kvp_route_request q = req_of(keys, NB, NB * BS, 0, 1);
    chosen_ctx c = {NULL, 0, 0, 0, 0};
    kvp_decision d;
    ASSERT_EQ(kvp_router_route_chosen(r, &q, chosen_fn, &c, &d), KVP_ENOTSUP);
    ASSERT_EQ(c.calls, 0);
    ASSERT_EQ(d.worker, KVP_WORKER_NONE);
    uint64_t n;
    ASSERT_OK(kvp_router_inflight(r, 0, &n, NULL, NULL));
    ASSERT_EQ(n, 0u);
    kvp_router_destroy(r);
  }
  free(keys);
}

TEST(least_loaded_counts_inflight) {
  kvp_router *r = router_new(KVP_POLICY_LEAST_LOADED, 3, 0);
  set_load(r, 0, 0, 1, 1000, 0, 0.0);
  set_load(r, 1, 0, 5, 500, 0, 0.0);
  set_load(r, 2, 0, 3, 500, 0, 0.0);
  kvp_key *keys = keys_new(20, 2);
  kvp_route_request q = req_of(keys, 20, 0, 0, 0);
  kvp_decision d;
  /* 1,000 / 500 / 500 tokens; tie -> fewer requests: 3 < 5 -> worker 2 */
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  ASSERT_EQ(d.worker, 2u);
  ASSERT_DOUBLE_NEAR(d.top[0].score, 500.0, 0.0);
  /* worker 2 now 500 + 320 in flight = 820 > 500 -> worker 1 */
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
  ASSERT_EQ(d.worker, 1u);
  ASSERT_NOT_NULL(strstr(d.reason_text, "least_loaded: worker 1 is least"));
  free(keys);
  kvp_router_destroy(r);
}

TEST(prefix_greedy_ties_to_least_loaded) {
  kvp_router *r = router_new(KVP_POLICY_PREFIX_GREEDY, 3, 0);
  kvp_key *keys = keys_new(10, 4);
  kvp_route_request q = req_of(keys, 10, 0, 0, 0);
  kvp_worker_match m[3] = {hbm(0, 5), hbm(1, 7), hbm(2, 7)};
  m[1].blocks[KVP_TIER_HBM] = 3, m[1].blocks[KVP_TIER_NVME] = 4; /* any tier */
  set_load(r, 1, 0, 0, 800, 0, 0.0);
  set_load(r, 2, 0, 0, 100, 0, 0.0);
  kvp_decision d;
  /* 7 blocks on 1 and 2; pending 800 vs 100 -> worker 2 */
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 3, &d));
  ASSERT_EQ(d.worker, 2u);
  ASSERT_EQ(d.reason, KVP_REASON_PREFIX);
  ASSERT_EQ(d.top[1].worker, 1u); /* then worker 1 (7 blocks), then 0 */
  ASSERT_EQ(d.top[2].worker, 0u);
  free(keys);
  kvp_router_destroy(r);
}

TEST(sglang_cache_aware_branches) {
  kvp_router *r = router_new(KVP_POLICY_SGLANG, 4, 0);
  kvp_key *keys = keys_new(62, 6);
  kvp_route_request q = req_of(keys, 62, 1000, 0, 0); /* 992 + 8 tokens */
  kvp_worker_match m = hbm(1, 40);                    /* 640 tokens */
  const uint32_t loads[4] = {10, 12, 8, 9};
  for (uint32_t w = 0; w < 4; w++)
    set_load(r, w, loads[w], 0, 0, 0, 0.0);
  kvp_decision d;
  /* balanced (12 - 8 <= 64); match rate 640 / 1000 = 0.64 > 0.3 -> 1 */
  ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
  ASSERT_EQ(d.worker, 1u);
  ASSERT_EQ(d.reason, KVP_REASON_PREFIX);
  ASSERT_DOUBLE_NEAR(d.top[0].score, 0.64, 1e-12);
  ASSERT_OK(kvp_router_complete(r, 1, d.request_id));
  /* 10 blocks = 160 tokens: rate 0.16 <= 0.3 -> least loaded: 2 (load 8) */
  m.blocks[KVP_TIER_HBM] = 10;
  ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
  ASSERT_EQ(d.worker, 2u);
  ASSERT_EQ(d.reason, KVP_REASON_LEAST_LOADED);
  ASSERT_OK(kvp_router_complete(r, 2, d.request_id));
  /* imbalanced: 100 - 8 = 92 > 64 and 100 > 1.5 x 8 -> shortest queue (2),
   * whatever the match (worker 0 holds everything) */
  set_load(r, 0, 100, 0, 0, 0, 0.0);
  m = hbm(0, 62);
  ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
  ASSERT_EQ(d.worker, 2u);
  ASSERT_NOT_NULL(strstr(d.reason_text, "imbalanced"));
  ASSERT_OK(kvp_router_complete(r, 2, d.request_id));
  /* 200/150/140/170: difference 60 <= 64 -> not imbalanced -> match (0) */
  const uint32_t high[4] = {200, 150, 140, 170};
  for (uint32_t w = 0; w < 4; w++)
    set_load(r, w, high[w], 0, 0, 0, 0.0);
  ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
  ASSERT_EQ(d.worker, 0u);
  free(keys);
  kvp_router_destroy(r);
}

TEST(llmd_weighted_scores) {
  kvp_router *r = router_new(KVP_POLICY_LLMD, 3, 0);
  kvp_key *keys = keys_new(10, 8);
  kvp_route_request q = req_of(keys, 10, 0, 0, 0);
  kvp_worker_match m[2] = {hbm(0, 10), hbm(1, 5)};
  set_load(r, 0, 5, 0, 0, 0, 0.9);
  set_load(r, 1, 1, 0, 0, 0, 0.2);
  set_load(r, 2, 0, 0, 0, 0, 0.0);
  /* queue scores (5-q)/5: 0, 0.8, 1.
   * w0 = 3 x 1.0 + 2 x 0.1 + 2 x 0   = 3.2
   * w1 = 3 x 0.5 + 2 x 0.8 + 2 x 0.8 = 4.7   <- max
   * w2 = 3 x 0   + 2 x 1.0 + 2 x 1   = 4.0 */
  kvp_decision d;
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 2, &d));
  ASSERT_EQ(d.worker, 1u);
  ASSERT_DOUBLE_NEAR(d.top[0].score, 4.7, 1e-12);
  ASSERT_EQ(d.top[1].worker, 2u);
  ASSERT_DOUBLE_NEAR(d.top[1].score, 4.0, 1e-12);
  ASSERT_DOUBLE_NEAR(d.top[2].score, 3.2, 1e-12);
  /* all queues equal -> queue score 1 for all: w0 = 3 + 0.2 + 2 = 5.2 */
  for (uint32_t w = 0; w < 3; w++)
    set_load(r, w, 3, 0, 0, 0, w == 0 ? 0.9 : (w == 1 ? 0.2 : 0.0));
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 2, &d));
  ASSERT_EQ(d.worker, 0u);
  ASSERT_DOUBLE_NEAR(d.top[0].score, 5.2, 1e-12);
  free(keys);
  kvp_router_destroy(r);
}

static kvp_router *dynamo_router(double temperature, uint64_t seed) {
  kvp_router_opts o = {0};
  o.block_size = 16; /* required: the hasher's */
  o.policy = KVP_POLICY_DYNAMO;
  o.n_workers = 3;
  o.dynamo_temperature = temperature;
  o.seed = seed;
  kvp_router *r = NULL;
  ASSERT_OK(kvp_router_create(&o, NULL, &r));
  set_load(r, 0, 0, 1, 320, 10, 0.0);
  set_load(r, 1, 0, 1, 0, 30, 0.0);
  set_load(r, 2, 0, 1, 0, 25, 0.0);
  return r;
}

TEST(dynamo_cost_and_softmax) {
  kvp_key *keys = keys_new(10, 9);
  kvp_route_request q = req_of(keys, 10, 0, 0, 0); /* 160 tokens, 10 blocks */
  kvp_worker_match m[2] = {hbm(0, 8), {0}};
  m[1].worker = 1;
  m[1].blocks[KVP_TIER_DRAM] = 10;
  /* w0: (320 + 160) / 16 = 30 - 8 x 1.0 = 22;   + decode 10 + 10 = 42
   * w1: 160 / 16 = 10 - 10 x 0.75 = 2.5;        + decode 30 + 10 = 42.5
   * w2: 10 - 0 = 10;                            + decode 25 + 10 = 45 */
  kvp_router *r = dynamo_router(0.0, 1);
  kvp_decision d;
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 2, &d));
  ASSERT_EQ(d.worker, 0u);
  ASSERT_DOUBLE_NEAR(d.top[0].score, 42.0, 1e-12);
  ASSERT_DOUBLE_NEAR(d.top[1].score, 42.5, 1e-12);
  ASSERT_DOUBLE_NEAR(d.top[2].score, 45.0, 1e-12);
  kvp_router_destroy(r);
  /* temperature 1: normalised 0, 1/6, 1 -> p = e^0, e^-1/6, e^-1 over their
   * sum = 0.452, 0.382, 0.166; same seed -> same samples. */
  int count[3] = {0};
  kvp_router *r1 = dynamo_router(1.0, 77), *r2 = dynamo_router(1.0, 77);
  for (uint64_t i = 1; i <= 3000; i++) {
    kvp_decision d1, d2;
    q.request_id = i;
    ASSERT_OK(kvp_router_route_matches(r1, &q, m, 2, &d1));
    ASSERT_OK(kvp_router_route_matches(r2, &q, m, 2, &d2));
    ASSERT_EQ(d1.worker, d2.worker);
    ASSERT_OK(kvp_router_complete(r1, d1.worker, i)); /* keep loads fixed */
    ASSERT_OK(kvp_router_complete(r2, d2.worker, i));
    count[d1.worker]++;
  }
  ASSERT_DOUBLE_NEAR(count[0] / 3000.0, 0.452, 0.04);
  ASSERT_DOUBLE_NEAR(count[1] / 3000.0, 0.382, 0.04);
  ASSERT_DOUBLE_NEAR(count[2] / 3000.0, 0.166, 0.04);
  kvp_router_destroy(r1);
  kvp_router_destroy(r2);
  free(keys);
}

/* report_bandwidth is the one call other threads may make while routing. */
typedef struct bw_job {
  kvp_router *r;
  atomic_int stop;
  atomic_int reports;
} bw_job;

static void *bw_reporter(void *arg) {
  bw_job *j = arg;
  /* relaxed: a plain stop flag, no data rides on it */
  while (!atomic_load_explicit(&j->stop, memory_order_relaxed)) {
    double bw = (atomic_load_explicit(&j->reports, memory_order_relaxed) & 1)
                    ? 40e9
                    : 60e9;
    if (kvp_router_report_bandwidth(j->r, KVP_TIER_DRAM, bw) == 0)
      atomic_fetch_add_explicit(&j->reports, 1, memory_order_relaxed);
  }
  return NULL;
}

TEST(bandwidth_reports_race_routing) {
  bw_job j = {router_new(KVP_POLICY_KVPLANE_COST, 4, 0), 0, 0};
  kvp_key *keys = keys_new(64, 5);
  kvp_worker_match m = {0};
  m.worker = 1;
  m.blocks[KVP_TIER_DRAM] = 48;
  pthread_t t;
  ASSERT_EQ(pthread_create(&t, NULL, bw_reporter, &j), 0);
  for (uint64_t i = 1; i <= 2000; i++) {
    kvp_route_request q = req_of(keys, 64, 0, 0, i);
    kvp_decision d;
    ASSERT_OK(kvp_router_route_matches(j.r, &q, &m, 1, &d));
    ASSERT_EQ(d.worker, 1u); /* 100 MB at 40-60 GB/s beats recomputing */
    ASSERT_OK(kvp_router_complete(j.r, d.worker, i));
  }
  /* on a loaded machine the reporter may not have run yet: let it report
   * at least twice before stopping it, so the race really happened */
  while (atomic_load_explicit(&j.reports, memory_order_relaxed) < 2)
    sched_yield();
  atomic_store_explicit(&j.stop, 1, memory_order_relaxed);
  ASSERT_EQ(pthread_join(t, NULL), 0);
  ASSERT_GE(atomic_load(&j.reports), 2);
  double bw = kvp_router_bandwidth(j.r, KVP_TIER_DRAM);
  ASSERT_TRUE(bw >= 40e9 && bw <= 60e9); /* an EWMA of the two values */
  free(keys);
  kvp_router_destroy(j.r);
}

/* ---- in flight, predicted matches, offline workers ----------------------- */
TEST(inflight_bookkeeping) {
  kvp_router_opts o = {0};
  o.block_size = 16; /* required: the hasher's */
  o.n_workers = 2;
  o.max_inflight = 2;
  kvp_router *r = NULL;
  ASSERT_OK(kvp_router_create(&o, NULL, &r));
  kvp_key *keys = keys_new(8, 1);
  kvp_route_request q = req_of(keys, 8, 0, 0, 0);
  kvp_decision d1, d2, d3;
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d1));
  ASSERT_TRUE(d1.request_id >> 63); /* assigned ids carry the top bit */
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d2));
  ASSERT_NE(d1.request_id, d2.request_id);
  ASSERT_NE(d1.worker, d2.worker); /* the first one's queue repels */
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d3));
  ASSERT_TRUE(d3.flags & KVP_DECISION_UNTRACKED); /* table holds 2 */
  uint64_t n = 0, t = 0;
  double s = 0;
  ASSERT_OK(kvp_router_inflight(r, d1.worker, &n, &t, &s));
  ASSERT_EQ(n, 1u);
  ASSERT_EQ(t, 128u);
  ASSERT_DOUBLE_NEAR(s, hand_flops(0, 128) / F_EFF, 1e-15);
  ASSERT_ERR(kvp_router_complete(r, d2.worker, d1.request_id), KVP_ENOENT);
  ASSERT_OK(kvp_router_complete(r, d1.worker, d1.request_id));
  ASSERT_ERR(kvp_router_complete(r, d1.worker, d1.request_id), KVP_ENOENT);
  ASSERT_OK(kvp_router_inflight(r, d1.worker, &n, &t, &s));
  ASSERT_EQ(n, 0u);
  ASSERT_EQ(t, 0u);
  ASSERT_DOUBLE_NEAR(s, 0.0, 0.0);
  /* a retry of a request still in flight moves it */
  q.request_id = d2.request_id;
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d3));
  ASSERT_TRUE(d3.flags & KVP_DECISION_REPLACED);
  ASSERT_EQ(d3.worker, d1.worker); /* d2's worker was busy with d2 itself */
  ASSERT_OK(kvp_router_inflight(r, d2.worker, &n, NULL, NULL));
  ASSERT_EQ(n, 0u);
  ASSERT_OK(kvp_router_complete(r, d3.worker, d2.request_id));
  free(keys);
  kvp_router_destroy(r);
}

/* Many requests in and out, random order: the per-worker sums always equal
 * what is still outstanding (backward-shift deletion keeps lookups right). */
TEST(inflight_random_churn) {
  kvp_router_opts o = {0};
  o.block_size = 16; /* required: the hasher's */
  o.n_workers = 5;
  o.max_inflight = 64;
  o.policy = KVP_POLICY_ROUND_ROBIN;
  kvp_router *r = NULL;
  ASSERT_OK(kvp_router_create(&o, NULL, &r));
  uint64_t ids[64], toks[64];
  uint32_t wk[64];
  size_t live = 0;
  for (int step = 0; step < 20000; step++) {
    if (live < 64 && (live == 0 || kvt_rand_below(2))) {
      kvp_route_request q = req_of(NULL, 0, 1 + kvt_rand_below(500), 0,
                                   1 + kvt_rand_below(1u << 30));
      kvp_decision d;
      ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d));
      if (d.flags & KVP_DECISION_REPLACED) { /* same random id drawn twice */
        for (size_t i = 0; i < live; i++)
          if (ids[i] == d.request_id)
            ids[i] = ids[--live], toks[i] = toks[live], wk[i] = wk[live];
      }
      ids[live] = d.request_id, toks[live] = q.prompt_tokens,
      wk[live++] = d.worker;
    } else {
      size_t i = kvt_rand_below(live);
      ASSERT_OK(kvp_router_complete(r, wk[i], ids[i]));
      ids[i] = ids[--live], toks[i] = toks[live], wk[i] = wk[live];
    }
    if (step % 997 == 0)
      for (uint32_t w = 0; w < 5; w++) {
        uint64_t n = 0, t = 0, wn = 0, wt = 0;
        ASSERT_OK(kvp_router_inflight(r, w, &n, &t, NULL));
        for (size_t i = 0; i < live; i++)
          if (wk[i] == w)
            wn++, wt += toks[i];
        ASSERT_EQ(n, wn);
        ASSERT_EQ(t, wt);
      }
  }
  kvp_router_destroy(r);
}

TEST(uncertain_match_is_discounted) {
  kvp_router *r = toy_router(2);
  kvp_key *keys = keys_new(4, 1);
  kvp_worker_match m = hbm(0, 2);
  m.flags = KVP_MATCH_UNCERTAIN;
  kvp_route_request q = req_of(keys, 4, 16, 0, 0);
  kvp_decision d;
  ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
  const kvp_route_candidate *c = cand_for(&d, 0);
  ASSERT_NOT_NULL(c);
  ASSERT_TRUE(c->flags & KVP_CAND_UNCERTAIN);
  /* 0.8 x (0.043776 + 0.00256) + 0.2 x 0.07936 */
  ASSERT_DOUBLE_NEAR(c->total_s, 0.8 * 0.046336 + 0.2 * 0.07936, 1e-12);
  free(keys);
  kvp_router_destroy(r);
}

TEST(offline_workers_never_chosen) {
  for (int pol = 0; pol < KVP_POLICY_COUNT_; pol++) {
    kvp_router *r = router_new((kvp_policy)pol, 4, 0);
    kvp_worker_load off = {0};
    off.flags = KVP_WORKER_OFFLINE;
    ASSERT_OK(kvp_router_set_load(r, 0, &off));
    ASSERT_OK(kvp_router_set_load(r, 2, &off));
    kvp_key *keys = keys_new(16, 3);
    kvp_worker_match m = hbm(0, 16); /* the best match is offline */
    for (int i = 0; i < 20; i++) {
      kvp_route_request q = req_of(keys, 16, 0, (uint64_t)i + 1, 0);
      kvp_decision d;
      ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
      ASSERT_TRUE(d.worker == 1 || d.worker == 3);
      for (unsigned k = 0; k < d.n_top; k++)
        ASSERT_TRUE(d.top[k].worker == 1 || d.top[k].worker == 3);
    }
    ASSERT_OK(kvp_router_set_load(r, 1, &off));
    ASSERT_OK(kvp_router_set_load(r, 3, &off));
    kvp_route_request q = req_of(keys, 16, 0, 0, 0);
    kvp_decision d;
    ASSERT_ERR(kvp_router_route_matches(r, &q, &m, 1, &d), KVP_ESTATE);
    ASSERT_EQ(d.worker, KVP_WORKER_NONE);
    free(keys);
    kvp_router_destroy(r);
  }
}

/* kvp_route_request.eligible: every policy keeps to the workers it names
 * (a LoRA adapter loaded on some), the best match and a session's last
 * worker outside it included; nothing is left after an eligible worker
 * goes offline. */
TEST(eligible_workers_only) {
  for (int pol = 0; pol < KVP_POLICY_COUNT_; pol++) {
    kvp_router *r = router_new((kvp_policy)pol, 70, 0);
    kvp_key *keys = keys_new(16, 4);
    kvp_worker_match m = hbm(0, 16); /* the best match: not eligible */
    uint64_t el[2] = {1ull << 5, 1ull << (66 - 64)}; /* workers 5 and 66 */
    for (int i = 0; i < 20; i++) {
      kvp_route_request q = req_of(keys, 16, 0, 7, 0); /* one session */
      if (i % 2) {
        kvp_decision d0; /* unrestricted: the session sticks where it can */
        ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d0));
        ASSERT_OK(kvp_router_complete(r, d0.worker, d0.request_id));
        continue;
      }
      q.eligible = el, q.n_eligible_words = 2;
      kvp_decision d;
      ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
      ASSERT_TRUE(d.worker == 5 || d.worker == 66);
      ASSERT_EQ(d.n_eligible, 2u);
      for (unsigned k = 0; k < d.n_top; k++)
        ASSERT_TRUE(d.top[k].worker == 5 || d.top[k].worker == 66);
      ASSERT_OK(kvp_router_complete(r, d.worker, d.request_id));
    }
    kvp_worker_load off = {0};
    off.flags = KVP_WORKER_OFFLINE;
    ASSERT_OK(kvp_router_set_load(r, 5, &off));
    ASSERT_OK(kvp_router_set_load(r, 66, &off));
    kvp_route_request q = req_of(keys, 16, 0, 0, 0);
    q.eligible = el, q.n_eligible_words = 2;
    kvp_decision d;
    ASSERT_ERR(kvp_router_route_matches(r, &q, &m, 1, &d), KVP_ESTATE);
    q.n_eligible_words = 1; /* worker 66 is past the words given */
    el[0] |= 1ull << 9;
    ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
    ASSERT_EQ(d.worker, 9u);
    ASSERT_OK(kvp_router_complete(r, d.worker, d.request_id));
    q.n_eligible_words = 3; /* 70 workers: 2 words at most */
    ASSERT_ERR(kvp_router_route_matches(r, &q, &m, 1, &d), KVP_EINVAL);
    q.n_eligible_words = 0; /* a mask without its length */
    ASSERT_ERR(kvp_router_route_matches(r, &q, &m, 1, &d), KVP_EINVAL);
    q.eligible = NULL, q.n_eligible_words = 1;
    ASSERT_ERR(kvp_router_route_matches(r, &q, &m, 1, &d), KVP_EINVAL);
    q.n_eligible_words = 0; /* neither: every online worker again */
    ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
    ASSERT_EQ(d.n_eligible, 68u);
    free(keys);
    kvp_router_destroy(r);
  }
}

/* ---- receipts ------------------------------------------------------------ */
TEST(receipt_json_snprintf_and_escaping) {
  kvp_router *r = router_new(KVP_POLICY_KVPLANE_COST, 3, 0);
  kvp_key *keys = keys_new(16, 2);
  kvp_route_request q = req_of(keys, 16, 0, 4, 0);
  q.tenant = 17;
  kvp_worker_match m = hbm(1, 12);
  kvp_decision d;
  ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
  json_t *j = receipt(&d);
  ASSERT_EQ(json_integer_value(json_object_get(j, "worker")), 1);
  ASSERT_STR_EQ(json_string_value(route_get(j, "policy")), "kvplane_cost");
  ASSERT_STR_EQ(json_string_value(route_get(j, "reason_text")), d.reason_text);
  ASSERT_STR_EQ(json_string_value(json_object_get(j, "tenant")), "17");
  char id[32];
  snprintf(id, sizeof id, "%" PRIu64, d.request_id); /* > 2^63: a string */
  ASSERT_STR_EQ(json_string_value(json_object_get(j, "request_id")), id);
  ASSERT_EQ(json_array_size(route_get(j, "top")), 3u);
  ASSERT_EQ(json_integer_value(
                json_object_get(route_get(j, "matched_tokens"), "hbm")),
            192);
  json_decref(j);

  char full[8192], small[40];
  int n = kvp_router_receipt_json(&d, NULL, full, sizeof full);
  ASSERT_EQ(kvp_router_receipt_json(&d, NULL, NULL, 0), n);
  ASSERT_EQ(kvp_router_receipt_json(&d, NULL, small, sizeof small), n);
  ASSERT_EQ(strlen(small), sizeof small - 1);
  ASSERT_MEM_EQ(small, full, sizeof small - 1);
  ASSERT_ERR(kvp_router_receipt_json(NULL, NULL, full, sizeof full),
             KVP_EINVAL);
  ASSERT_ERR(kvp_router_receipt_json(&d, NULL, NULL, 10), KVP_EINVAL);

  /* hostile text and non-finite numbers still give valid JSON */
  snprintf(d.reason_text, sizeof d.reason_text, "a\"b\\c\n\x01\x7f");
  d.top[0].total_s = NAN;
  d.avoided_s = INFINITY;
  j = receipt(&d);
  ASSERT_STR_EQ(json_string_value(route_get(j, "reason_text")),
                "a\"b\\c\n\x01\x7f");
  ASSERT_TRUE(json_is_null(
      json_object_get(json_array_get(route_get(j, "top"), 0), "total_s")));
  ASSERT_TRUE(json_is_null(
      json_object_get(json_object_get(j, "prefill_avoided"), "gpu_seconds")));
  json_decref(j);
  free(keys);
  kvp_router_destroy(r);
}

/* Every policy's receipt is valid JSON with a reason naming the worker. */
TEST(every_policy_has_a_receipt) {
  for (int pol = 0; pol < KVP_POLICY_COUNT_; pol++) {
    kvp_router *r = router_new((kvp_policy)pol, 5, 0);
    kvp_key *keys = keys_new(40, 2);
    kvp_route_request q = req_of(keys, 40, 0, 3, 0);
    kvp_worker_match m[2] = {hbm(3, 30), hbm(1, 10)};
    kvp_decision d;
    ASSERT_OK(kvp_router_route_matches(r, &q, m, 2, &d));
    ASSERT_EQ((int)d.policy, pol);
    char want[32];
    snprintf(want, sizeof want, "worker %u", d.worker);
    if (strstr(d.reason_text, want) == NULL)
      fprintf(stderr, "%s: %s\n", kvp_policy_name((kvp_policy)pol),
              d.reason_text);
    ASSERT_NOT_NULL(strstr(d.reason_text, want));
    json_t *j = receipt(&d);
    ASSERT_STR_EQ(json_string_value(route_get(j, "policy")),
                  kvp_policy_name((kvp_policy)pol));
    json_decref(j);
    free(keys);
    kvp_router_destroy(r);
  }
}

/* ---- bad input ----------------------------------------------------------- */
TEST(bad_options) {
  kvp_router *r = (kvp_router *)&r; /* must be reset to NULL on failure */
  kvp_router_opts o = {0};
  o.block_size = 16; /* required: the hasher's */
  ASSERT_ERR(kvp_router_create(&o, NULL, &r), KVP_EINVAL); /* 0 workers */
  ASSERT_NULL(r);
  ASSERT_ERR(kvp_router_create(NULL, NULL, &r), KVP_EINVAL);
  o.n_workers = KVP_WORKERS_MAX + 1;
  ASSERT_ERR(kvp_router_create(&o, NULL, &r), KVP_EINVAL);
  o.n_workers = 2;
  ASSERT_ERR(kvp_router_create(&o, NULL, NULL), KVP_EINVAL);
  kvp_router_opts b;
#define BAD_OPT(...)                                                           \
  do {                                                                         \
    b = o;                                                                     \
    __VA_ARGS__;                                                               \
    ASSERT_ERR(kvp_router_create(&b, NULL, &r), KVP_EINVAL);                   \
  } while (0)
  BAD_OPT(b.policy = KVP_POLICY_COUNT_);
  BAD_OPT(b.model.params = -8e9); /* negative */
  BAD_OPT(b.model = (kvp_model_spec){32, 32, 8, 128, 2, 0, NAN, {0}});
  BAD_OPT(b.model = (kvp_model_spec){32, 8, 16, 128, 2, 0, 8e9, {0}}); /* GQA */
  BAD_OPT(b.model.layers = 32); /* incomplete */
  BAD_OPT(b.gpu.flops = NAN);
  BAD_OPT(b.gpu.flops = -1.0);
  BAD_OPT(b.gpu.efficiency = 1.5);
  BAD_OPT(b.gpu.bw[KVP_TIER_NVME] = INFINITY);
  BAD_OPT(b.gpu.latency_s[KVP_TIER_DRAM] = -1e-6);
  BAD_OPT(b.guard = -2.0);
  BAD_OPT(b.guard_ref = 7);
  BAD_OPT(b.dynamo_credit[KVP_TIER_DRAM] = NAN);
  BAD_OPT(b.uncertain_confidence = 2.0);
  BAD_OPT(b.block_size = KVP_BLOCK_SIZE_MAX + 1);
  BAD_OPT(b.reserved[3] = 1);
  BAD_OPT(b.gpu.reserved[0] = 1);
#undef BAD_OPT
  ASSERT_OK(kvp_router_create(&o, NULL, &r));
  kvp_router_destroy(r);
  kvp_router_destroy(NULL);
}

/* Bad calls fail with KVP_EINVAL, leave *out naming no worker, and change
 * nothing: the next good decision is the one a fresh router would make. */
TEST(bad_input_changes_nothing) {
  kvp_router *r = router_new(KVP_POLICY_KVPLANE_COST, 4, 0);
  kvp_router *fresh = router_new(KVP_POLICY_KVPLANE_COST, 4, 0);
  kvp_key *keys = keys_new(64, 1);
  kvp_route_request q = req_of(keys, 64, 0, 5, 0);
  kvp_worker_match m[2] = {hbm(1, 10), hbm(1, 20)};
  kvp_decision d;
#define BAD_ROUTE(req, mm, nm)                                                 \
  do {                                                                         \
    d.worker = 0;                                                              \
    ASSERT_ERR(kvp_router_route_matches(r, req, mm, nm, &d), KVP_EINVAL);      \
    ASSERT_EQ(d.worker, KVP_WORKER_NONE);                                      \
  } while (0)
  BAD_ROUTE(&q, m, 2); /* worker 1 twice */
  m[1].worker = 4;
  BAD_ROUTE(&q, m, 2); /* unknown worker */
  m[1].worker = 2, m[1].blocks[KVP_TIER_HBM] = 65;
  BAD_ROUTE(&q, m, 2); /* longer than the chain */
  m[1].blocks[KVP_TIER_HBM] = 20, m[1].flags = 0x80;
  BAD_ROUTE(&q, m, 2); /* unknown flag */
  BAD_ROUTE(&q, NULL, 1);
  BAD_ROUTE(NULL, NULL, 0);
  kvp_route_request b = q;
  b.keys = NULL;
  BAD_ROUTE(&b, NULL, 0);
  b = q, b.n_blocks = (1u << 20) + 1; /* oversized chain */
  BAD_ROUTE(&b, NULL, 0);
  b = q, b.prompt_tokens = 64 * BS - 1; /* fewer tokens than hashed */
  BAD_ROUTE(&b, NULL, 0);
  b = q, b.prompt_tokens = UINT64_MAX;
  BAD_ROUTE(&b, NULL, 0);
  kvp_classification cls = {0};
  cls.n_blocks = 63;
  b = q, b.cls = &cls;
  BAD_ROUTE(&b, NULL, 0);
  cls.n_blocks = 64, cls.stable_end = 10, cls.semi_end = 5;
  BAD_ROUTE(&b, NULL, 0);
  b = q, b.flags = 0x80; /* unknown flag bits */
  BAD_ROUTE(&b, NULL, 0);
#undef BAD_ROUTE
  ASSERT_ERR(kvp_router_route_matches(NULL, &q, NULL, 0, &d), KVP_EINVAL);
  ASSERT_ERR(kvp_router_route_matches(r, &q, NULL, 0, NULL), KVP_EINVAL);

  kvp_worker_load l = {0};
  l.kv_util = NAN;
  ASSERT_ERR(kvp_router_set_load(r, 0, &l), KVP_EINVAL);
  l.kv_util = -0.1;
  ASSERT_ERR(kvp_router_set_load(r, 0, &l), KVP_EINVAL);
  l.kv_util = 1.5;
  ASSERT_ERR(kvp_router_set_load(r, 0, &l), KVP_EINVAL);
  l.kv_util = 0.5, l.prefill_tokens = (uint64_t)-5; /* a negative, cast */
  ASSERT_ERR(kvp_router_set_load(r, 0, &l), KVP_EINVAL);
  l.prefill_tokens = 0, l.flags = 0x10;
  ASSERT_ERR(kvp_router_set_load(r, 0, &l), KVP_EINVAL);
  l.flags = 0, l.reserved[2] = 9;
  ASSERT_ERR(kvp_router_set_load(r, 0, &l), KVP_EINVAL);
  l.reserved[2] = 0;
  l.flags = 0;
  ASSERT_ERR(kvp_router_set_load(r, 4, &l), KVP_EINVAL);
  ASSERT_ERR(kvp_router_set_load(r, 0, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_router_set_load(NULL, 0, &l), KVP_EINVAL);
  ASSERT_ERR(kvp_router_report_bandwidth(r, KVP_TIER_DRAM, NAN), KVP_EINVAL);
  ASSERT_ERR(kvp_router_report_bandwidth(r, KVP_TIER_DRAM, -1.0), KVP_EINVAL);
  ASSERT_ERR(kvp_router_report_bandwidth(r, KVP_TIER_DRAM, 0.0), KVP_EINVAL);
  ASSERT_ERR(kvp_router_report_bandwidth(r, KVP_TIER_DRAM, INFINITY),
             KVP_EINVAL);
  ASSERT_ERR(kvp_router_report_bandwidth(r, KVP_TIER_COUNT_, 1e9), KVP_EINVAL);
  ASSERT_ERR(kvp_router_report_bandwidth(NULL, KVP_TIER_DRAM, 1e9), KVP_EINVAL);
  ASSERT_DOUBLE_NEAR(kvp_router_bandwidth(r, KVP_TIER_DRAM), 50e9, 0.0);
  ASSERT_ERR(kvp_router_complete(r, 4, 1), KVP_EINVAL);
  ASSERT_ERR(kvp_router_complete(r, 0, 1), KVP_ENOENT);
  ASSERT_ERR(kvp_router_complete(r, 0, 0), KVP_ENOENT);
  ASSERT_ERR(kvp_router_inflight(r, 4, NULL, NULL, NULL), KVP_EINVAL);

  /* nothing moved: same decision, same id, no in-flight residue */
  kvp_decision a, f;
  m[1].flags = 0;
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 2, &a));
  ASSERT_OK(kvp_router_route_matches(fresh, &q, m, 2, &f));
  ASSERT_EQ(a.worker, f.worker);
  ASSERT_EQ(a.request_id, f.request_id);
  ASSERT_STR_EQ(a.reason_text, f.reason_text);
  for (uint32_t w = 0; w < 4; w++) {
    uint64_t n = 0;
    ASSERT_OK(kvp_router_inflight(r, w, &n, NULL, NULL));
    ASSERT_EQ(n, w == a.worker ? 1u : 0u);
  }
  free(keys);
  kvp_router_destroy(r);
  kvp_router_destroy(fresh);
}

typedef struct counting_alloc {
  size_t live, allocs;
} counting_alloc;
static void *ca_alloc(void *o, size_t n) {
  counting_alloc *c = o;
  c->live += n, c->allocs++;
  return malloc(n);
}
static void ca_free(void *o, void *p, size_t n) {
  ((counting_alloc *)o)->live -= n;
  free(p);
}

TEST(allocator_is_used_and_balanced) {
  counting_alloc c = {0, 0};
  kvp_allocator a = {ca_alloc, ca_free, &c};
  kvp_router_opts o = {0};
  o.block_size = 16; /* required: the hasher's */
  o.n_workers = 64;
  kvp_router *r = NULL;
  ASSERT_OK(kvp_router_create(&o, &a, &r));
  ASSERT_GT(c.allocs, 1u);
  ASSERT_GT(c.live, 0u);
  kvp_router_destroy(r);
  ASSERT_EQ(c.live, 0u);
}

/* ---- errors that name the field ------------------------------------------ */
static char g_log[1024];
static void log_sink(void *opaque, kvp_log_level lv, const char *mod,
                     const char *msg) {
  (void)opaque, (void)lv, (void)mod;
  snprintf(g_log, sizeof g_log, "%s", msg);
}

/* Captures WARN and above into g_log (cleared), or restores the default. */
static void log_capture(bool on) {
  g_log[0] = '\0';
  kvp_log_set_sink(on ? log_sink : NULL, NULL);
  kvp_log_set_level(on ? KVP_LOG_WARN : KVP_LOG_ERROR);
}

#define ASSERT_LOGGED(text)                                                    \
  do {                                                                         \
    if (strstr(g_log, text) == NULL)                                           \
      fprintf(stderr, "log was: %s\n", g_log);                                 \
    ASSERT_NOT_NULL(strstr(g_log, text));                                      \
  } while (0)

TEST(options_errors_name_the_field) {
  kvp_router *r = NULL;
  kvp_router_opts o = {0};
  o.n_workers = 2;
  log_capture(true);
  ASSERT_ERR(kvp_router_create(&o, NULL, &r), KVP_EINVAL); /* block_size 0 */
  ASSERT_LOGGED("opts.block_size = 0: required");
  o.block_size = 16;
  o.gpu.bw[KVP_TIER_NVME] = INFINITY;
  ASSERT_ERR(kvp_router_create(&o, NULL, &r), KVP_EINVAL);
  ASSERT_LOGGED("opts.gpu.bw[nvme] = inf");
  o.gpu.bw[KVP_TIER_NVME] = 0, o.guard = -2.0;
  ASSERT_ERR(kvp_router_create(&o, NULL, &r), KVP_EINVAL);
  ASSERT_LOGGED("opts.guard = -2");
  o.guard = 0, o.n_workers = 0;
  ASSERT_ERR(kvp_router_create(&o, NULL, &r), KVP_EINVAL);
  ASSERT_LOGGED("opts.n_workers = 0");
  o.n_workers = 2, o.model.layers = 32;
  ASSERT_ERR(kvp_router_create(&o, NULL, &r), KVP_EINVAL);
  ASSERT_LOGGED("opts.model.heads out of range");
  log_capture(false);
}

/* The scheduler author's bug: 32-token blocks hashed, the router left at a
 * block size of its own.  Refused, naming both; with the block size taken
 * from the hasher, 10 matched blocks are 320 tokens avoided. */
TEST(block_size_mismatch_refused) {
  kvp_namespace_desc nd = {.model_id = "test/bs", .block_size = 32};
  kvp_namespace ns;
  kvp_hasher *h = NULL;
  ASSERT_OK(kvp_namespace_init(&nd, &ns));
  ASSERT_OK(kvp_hasher_create(&ns, NULL, NULL, &h));
  uint32_t tok[32 * 12];
  for (size_t i = 0; i < sizeof tok / sizeof tok[0]; i++)
    tok[i] = (uint32_t)i;
  kvp_key keys[12];
  ASSERT_EQ(kvp_hasher_hash(h, tok, 32 * 12, NULL, keys, 12, NULL), 12);
  kvp_route_request q = req_of(keys, 12, 32 * 12, 0, 0);
  q.block_size = kvp_hasher_block_size(h);
  kvp_worker_match m = hbm(1, 10);
  kvp_decision d;
  kvp_router_opts o = {0};
  o.n_workers = 2, o.block_size = 16; /* not the hasher's */
  kvp_router *r = NULL;
  ASSERT_OK(kvp_router_create(&o, NULL, &r));
  log_capture(true);
  ASSERT_ERR(kvp_router_route_matches(r, &q, &m, 1, &d), KVP_EINVAL);
  ASSERT_LOGGED("request.block_size = 32 but the router's opts.block_size "
                "= 16");
  log_capture(false);
  kvp_router_destroy(r);
  o.block_size = kvp_hasher_block_size(h);
  ASSERT_OK(kvp_router_create(&o, NULL, &r));
  ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
  ASSERT_EQ(d.worker, 1u);
  ASSERT_EQ(d.avoided_tokens, 320u);
  ASSERT_EQ(d.block_size, 32u);
  json_t *j = receipt(&d);
  ASSERT_EQ(json_integer_value(json_object_get(
                json_object_get(j, "prefill_avoided"), "tokens")),
            320);
  json_decref(j);
  kvp_router_destroy(r);
  kvp_hasher_destroy(h);
}

TEST(bad_cls_is_logged) {
  kvp_router *r = router_new(KVP_POLICY_KVPLANE_COST, 2, 0);
  kvp_key *keys = keys_new(8, 4);
  kvp_route_request q = req_of(keys, 8, 0, 0, 0);
  kvp_classification cls = {{0}, 2, 4, 6, 0, {0}}; /* 6 blocks, not 8 */
  q.cls = &cls;
  kvp_decision d;
  log_capture(true);
  ASSERT_ERR(kvp_router_route_matches(r, &q, NULL, 0, &d), KVP_EINVAL);
  ASSERT_LOGGED("request.cls->n_blocks = 6 but request.n_blocks = 8");
  cls.n_blocks = 8, cls.stable_end = 5;
  ASSERT_ERR(kvp_router_route_matches(r, &q, NULL, 0, &d), KVP_EINVAL);
  ASSERT_LOGGED("request.cls: stable_end 5 <= semi_end 4");
  log_capture(false);
  free(keys);
  kvp_router_destroy(r);
}

/* ---- decisions into the ledger ------------------------------------------- */
typedef struct expect {
  kvp_ledger_totals t;
} expect;

/* What the ledger must hold for d, computed from the request and matches
 * (not from the decision's own split). */
static void expect_add(expect *e, const kvp_decision *d,
                       const kvp_route_request *q, const kvp_worker_match *m,
                       size_t nm, uint32_t bs) {
  kvp_ledger_totals *t = &e->t;
  uint64_t hashed = (uint64_t)q->n_blocks * bs, mine = 0, other = 0;
  for (size_t i = 0; i < nm; i++) {
    uint64_t b = 0;
    for (int k = 0; k < KVP_TIER_COUNT_; k++)
      b += m[i].blocks[k];
    if (m[i].worker == d->worker)
      mine = b * bs;
    else if (b * bs > other)
      other = b * bs;
  }
  t->requests++;
  t->prompt_tokens += d->prompt_tokens;
  t->reused_tokens += d->avoided_tokens;
  t->recomputed_tokens += d->prompt_tokens - d->avoided_tokens;
  uint64_t held = mine > other ? mine : other;
  t->miss_tokens[KVP_MISS_PARTIAL_BLOCK] += d->prompt_tokens - hashed;
  t->miss_tokens[KVP_MISS_NOT_WORTH_LOADING] += mine - d->avoided_tokens;
  t->miss_tokens[KVP_MISS_OTHER_WORKER] += held - mine;
  if (q->flags & KVP_ROUTE_SEEN) {
    /* what no worker holds: evicted up to the seen prefix, never seen
     * past it (the seen prefix may be shorter than held: a race) */
    uint64_t seen = (uint64_t)q->seen_blocks * bs;
    uint64_t ev = seen > held ? (seen < hashed ? seen : hashed) - held : 0;
    t->miss_tokens[KVP_MISS_EVICTED] += ev;
    t->miss_tokens[KVP_MISS_NEVER_SEEN] += hashed - held - ev;
  } else {
    t->miss_tokens[KVP_MISS_UNKNOWN] += hashed - held;
  }
  for (int k = 0; k < KVP_TIER_COUNT_; k++) {
    t->reused_by_tier[k] += d->reused_tier_tokens[k];
    t->load_bytes[k] += d->reused_tier_tokens[k] * 131072u;
  }
  uint64_t st = q->cls ? (uint64_t)q->cls->stable_end * bs : 0;
  uint64_t se =
      q->cls ? (uint64_t)(q->cls->semi_end - q->cls->stable_end) * bs : 0;
  t->prompt_by_class[KVP_CLASS_STABLE] += st;
  t->prompt_by_class[KVP_CLASS_SEMI] += se;
  t->prompt_by_class[KVP_CLASS_VOLATILE] += d->prompt_tokens - st - se;
  for (int c = 0; c < KVP_CLASS_COUNT_; c++)
    t->reused_by_class[c] += d->reused_class_tokens[c];
  t->avoided_flops += d->avoided_flops;
  t->avoided_gpu_seconds += d->avoided_s;
}

static void totals_match(const kvp_ledger_totals *got,
                         const kvp_ledger_totals *want) {
  ASSERT_EQ(got->requests, want->requests);
  ASSERT_EQ(got->prompt_tokens, want->prompt_tokens);
  ASSERT_EQ(got->reused_tokens, want->reused_tokens);
  ASSERT_EQ(got->recomputed_tokens, want->recomputed_tokens);
  for (int k = 0; k < KVP_TIER_COUNT_; k++) {
    ASSERT_EQ(got->reused_by_tier[k], want->reused_by_tier[k]);
    ASSERT_EQ(got->load_bytes[k], want->load_bytes[k]);
  }
  for (int c = 0; c < KVP_CLASS_COUNT_; c++) {
    ASSERT_EQ(got->prompt_by_class[c], want->prompt_by_class[c]);
    ASSERT_EQ(got->reused_by_class[c], want->reused_by_class[c]);
  }
  for (int i = 0; i < KVP_MISS_COUNT_; i++)
    ASSERT_EQ(got->miss_tokens[i], want->miss_tokens[i]);
  ASSERT_DOUBLE_NEAR(got->avoided_flops, want->avoided_flops,
                     1e-9 * want->avoided_flops);
}

/* One random request with random multi-tier matches on random workers. */
static void random_route(kvp_router *r, uint32_t n, uint32_t bs,
                         const kvp_key *keys, kvp_classification *cls,
                         kvp_route_request *q, kvp_worker_match *m, size_t *nm,
                         kvp_decision *d) {
  size_t nb = 1 + kvt_rand_below(200);
  *q = req_of(keys, nb, nb * bs + kvt_rand_below(bs), kvt_rand_below(4), 0);
  q->tenant = kvp_id64(kvt_rand_below(2) ? "acme" : "initech");
  q->block_size = bs;
  uint32_t s = (uint32_t)kvt_rand_below(nb + 1);
  uint32_t e = s + (uint32_t)kvt_rand_below(nb - s + 1);
  *cls = (kvp_classification){{0}, s, e, (uint32_t)nb, 0, {0}};
  q->cls = kvt_rand_below(4) ? cls : NULL;
  *nm = 0;
  for (uint32_t w = 0; w < n; w++) {
    if (kvt_rand_below(3) == 0)
      continue;
    kvp_worker_match x = {0};
    x.worker = w;
    uint64_t left = kvt_rand_below(nb + 1);
    for (int k = 0; k < 3; k++) {
      x.blocks[k] = (uint32_t)kvt_rand_below(left + 1);
      left -= x.blocks[k];
    }
    m[(*nm)++] = x;
  }
  if (kvt_rand_below(2)) { /* the caller knows what was ever seen */
    q->flags |= KVP_ROUTE_SEEN;
    q->seen_blocks = (uint32_t)kvt_rand_below(nb + 1);
  }
  ASSERT_OK(kvp_router_route_matches(r, q, m, *nm, d));
  ASSERT_OK(kvp_router_complete(r, d->worker, d->request_id));
}

TEST(decisions_into_the_ledger) {
  static const uint32_t sizes[] = {1, 4, 16, 32};
  kvp_key *keys = keys_new(200, 21);
  kvp_ledger *l = NULL;
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &l));
  expect all = {{0}}, acme = {{0}};
  for (int round = 0; round < 40; round++) {
    kvp_router_opts o = {0};
    o.policy = (kvp_policy)kvt_rand_below(KVP_POLICY_COUNT_);
    o.n_workers = 2 + (uint32_t)kvt_rand_below(5);
    o.block_size = sizes[kvt_rand_below(4)];
    kvp_router *r = NULL;
    ASSERT_OK(kvp_router_create(&o, NULL, &r));
    for (int i = 0; i < 25; i++) {
      kvp_route_request q;
      kvp_classification cls;
      kvp_worker_match m[8];
      size_t nm;
      kvp_decision d;
      random_route(r, o.n_workers, o.block_size, keys, &cls, &q, m, &nm, &d);
      bool is_acme = q.tenant == kvp_id64("acme");
      kvp_route_names names = {
          is_acme ? "acme" : "initech", NULL, NULL, 0, {0}};
      ASSERT_OK(kvp_ledger_add_decision(l, &d, &names));
      expect_add(&all, &d, &q, m, nm, o.block_size);
      if (is_acme)
        expect_add(&acme, &d, &q, m, nm, o.block_size);
    }
    kvp_router_destroy(r);
  }
  kvp_ledger_totals got;
  ASSERT_OK(kvp_ledger_global_totals(l, &got));
  totals_match(&got, &all.t);
  ASSERT_OK(kvp_ledger_tenant_totals(l, "acme", &got));
  totals_match(&got, &acme.t);
  kvp_ledger_stats st;
  ASSERT_OK(kvp_ledger_stats_get(l, &st));
  ASSERT_EQ(st.rejected_total, 0u);
  kvp_ledger_destroy(l);
  free(keys);
}

TEST(decision_names_must_match_ids) {
  kvp_router *r = router_new(KVP_POLICY_KVPLANE_COST, 3, 0);
  kvp_key *keys = keys_new(16, 5);
  kvp_route_request q = req_of(keys, 16, 0, kvp_id64("s-9"), kvp_id64("r-1"));
  q.tenant = kvp_id64("acme");
  kvp_worker_match m = hbm(2, 16);
  kvp_decision d;
  ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, &d));
  kvp_ledger *l = NULL;
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &l));
  kvp_route_names bad = {"other", "s-9", "r-1", 0, {0}};
  log_capture(true);
  ASSERT_ERR(kvp_ledger_add_decision(l, &d, &bad), KVP_EINVAL);
  ASSERT_LOGGED("names.tenant \"other\" hashes to");
  char buf[8192];
  ASSERT_ERR(kvp_router_receipt_json(&d, &bad, buf, sizeof buf), KVP_EINVAL);
  kvp_decision none = d;
  none.worker = KVP_WORKER_NONE;
  ASSERT_ERR(kvp_ledger_add_decision(l, &none, NULL), KVP_EINVAL);
  ASSERT_LOGGED("KVP_WORKER_NONE");
  log_capture(false);
  kvp_route_names good = {"acme", "s-9", "r-1", 1700000000000000000ull, {0}};
  ASSERT_OK(kvp_ledger_add_decision(l, &d, &good));
  kvp_ledger_totals t;
  ASSERT_OK(kvp_ledger_session_totals(l, "acme", "s-9", &t));
  ASSERT_EQ(t.reused_tokens, 256u);
  int n = kvp_router_receipt_json(&d, &good, buf, sizeof buf);
  ASSERT_GT(n, 0);
  json_t *j = json_loads(buf, 0, NULL);
  ASSERT_NOT_NULL(j);
  ASSERT_STR_EQ(json_string_value(json_object_get(j, "kind")), "receipt");
  ASSERT_STR_EQ(json_string_value(json_object_get(j, "tenant")), "acme");
  ASSERT_STR_EQ(json_string_value(json_object_get(j, "session")), "s-9");
  ASSERT_STR_EQ(json_string_value(json_object_get(j, "request_id")), "r-1");
  ASSERT_EQ(json_integer_value(json_object_get(j, "worker")), 2);
  ASSERT_EQ(json_integer_value(json_object_get(j, "unix_time_ns")),
            1700000000000000000ll);
  json_decref(j);
  /* the same fields, in the same order, as the ledger's own receipt */
  kvp_route_names anon = {NULL, NULL, NULL, 0, {0}};
  n = kvp_router_receipt_json(&d, &anon, buf, sizeof buf);
  ASSERT_GT(n, 0);
  ASSERT_EQ(strncmp(buf, "{\"kind\":\"receipt\",\"request_id\":\"", 32), 0);
  kvp_ledger_destroy(l);
  free(keys);
  kvp_router_destroy(r);
}

/* A config reload: the policy, weights and GPU change on a live router;
 * in-flight accounting and sessions stay; what sizes the router is refused,
 * and a refused call changes nothing. */
TEST(set_opts_live) {
  kvp_router_opts o = {0};
  o.block_size = BS;
  o.n_workers = 3;
  kvp_router *r = NULL;
  ASSERT_OK(kvp_router_create(&o, NULL, &r));
  ASSERT_OK(kvp_router_session_set(r, 99, 1));
  kvp_key *keys = keys_new(8, 3);
  kvp_worker_match m[3] = {hbm(0, 0), hbm(1, 0), hbm(2, 8)};
  kvp_route_request q = req_of(keys, 8, 0, 77, 0);
  kvp_decision d1, d2;
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 3, &d1));
  ASSERT_EQ(d1.worker, 2u); /* all of it cached there */
  ASSERT_EQ(d1.reason, KVP_REASON_COST);
  double rec = cand_for(&d1, 0)->recompute_s;
  uint64_t n0 = 0, t0 = 0, n1 = 0, t1 = 0;
  double s0 = 0, s1 = 0;
  ASSERT_OK(kvp_router_inflight(r, 2, &n0, &t0, &s0));
  ASSERT_EQ(n0, 1u);
  /* round robin, and a GPU twice as fast */
  o.policy = KVP_POLICY_ROUND_ROBIN;
  o.gpu.flops = 2 * 989e12;
  ASSERT_OK(kvp_router_set_opts(r, &o));
  ASSERT_OK(kvp_router_inflight(r, 2, &n1, &t1, &s1));
  ASSERT_EQ(n1, n0);
  ASSERT_EQ(t1, t0);
  ASSERT_DOUBLE_NEAR(s1, s0, 0.0); /* estimated when routed */
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 3, &d2));
  ASSERT_EQ(d2.policy, KVP_POLICY_ROUND_ROBIN);
  ASSERT_EQ(d2.reason, KVP_REASON_ROUND_ROBIN);
  ASSERT_EQ(d2.worker, 0u);
  ASSERT_DOUBLE_NEAR(cand_for(&d2, 0)->recompute_s, rec / 2, rec * 1e-12);
  ASSERT_OK(kvp_router_complete(r, 0, d2.request_id));
  /* back to the cost model: session 99, set before, still holds worker 1
   * (a little queue there: best is worker 0, affinity keeps 1) */
  o.policy = KVP_POLICY_KVPLANE_COST;
  ASSERT_OK(kvp_router_set_opts(r, &o));
  set_load(r, 1, 0, 1, 20, 0, 0.0);
  q.session_id = 99;
  ASSERT_OK(kvp_router_route_matches(r, &q, NULL, 0, &d2));
  ASSERT_EQ(d2.worker, 1u);
  ASSERT_EQ(d2.reason, KVP_REASON_AFFINITY);
  ASSERT_OK(kvp_router_complete(r, 1, d2.request_id));
  ASSERT_OK(kvp_router_complete(r, 2, d1.request_id)); /* still tracked */
  ASSERT_OK(kvp_router_inflight(r, 2, &n1, NULL, NULL));
  ASSERT_EQ(n1, 0u);
  /* structural changes and bad values are refused, naming the field */
  log_capture(true);
  kvp_router_opts bad = o;
  bad.policy = KVP_POLICY_ROUND_ROBIN, bad.block_size = 2 * BS;
  ASSERT_ERR(kvp_router_set_opts(r, &bad), KVP_EINVAL);
  ASSERT_LOGGED("set_opts: opts.block_size = 32 (running 16)");
  bad.block_size = BS, bad.n_workers = 4;
  ASSERT_ERR(kvp_router_set_opts(r, &bad), KVP_EINVAL);
  ASSERT_LOGGED("set_opts: opts.n_workers = 4 (running 3)");
  bad.n_workers = 3, bad.max_inflight = 16;
  ASSERT_ERR(kvp_router_set_opts(r, &bad), KVP_EINVAL);
  ASSERT_LOGGED("opts.max_inflight = 16 (running 65536)");
  bad.max_inflight = 0, bad.max_sessions = 16;
  ASSERT_ERR(kvp_router_set_opts(r, &bad), KVP_EINVAL);
  ASSERT_LOGGED("opts.max_sessions = 16 (running 65536)");
  bad.max_sessions = 0, bad.guard = -1;
  ASSERT_ERR(kvp_router_set_opts(r, &bad), KVP_EINVAL);
  ASSERT_LOGGED("set_opts: opts.guard = -1");
  log_capture(false);
  ASSERT_ERR(kvp_router_set_opts(r, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_router_set_opts(NULL, &o), KVP_EINVAL);
  ASSERT_OK(kvp_router_route_matches(r, &q, m, 3, &d2)); /* none applied */
  ASSERT_EQ(d2.policy, KVP_POLICY_KVPLANE_COST);
  free(keys);
  kvp_router_destroy(r);
}

TEST_MAIN(TEST_ENTRY(policy_names_and_model_math),
          TEST_ENTRY(agentic_worked_example),
          TEST_ENTRY(approximate_index_records_routes),
          TEST_ENTRY(cost_terms_by_hand_and_bandwidth_override),
          TEST_ENTRY(stable_prefix_everywhere_does_not_pull),
          TEST_ENTRY(semi_stable_history_drives_affinity),
          TEST_ENTRY(guard_counts_requests_before_first_token),
          TEST_ENTRY(prefill_overhead_counts_per_request),
          TEST_ENTRY(inflight_runs_down_with_the_clock),
          TEST_ENTRY(pending_prefill_seen_before_events),
          TEST_ENTRY(affinity_within_epsilon),
          TEST_ENTRY(no_herding_across_replicas),
          TEST_ENTRY(round_robin_skips_offline), TEST_ENTRY(round_robin_reads_no_matches),
          TEST_ENTRY(chosen_match_only),
          TEST_ENTRY(least_loaded_counts_inflight),
          TEST_ENTRY(prefix_greedy_ties_to_least_loaded),
          TEST_ENTRY(sglang_cache_aware_branches),
          TEST_ENTRY(llmd_weighted_scores), TEST_ENTRY(dynamo_cost_and_softmax),
          TEST_ENTRY(bandwidth_reports_race_routing),
          TEST_ENTRY(inflight_bookkeeping), TEST_ENTRY(inflight_random_churn),
          TEST_ENTRY(uncertain_match_is_discounted),
          TEST_ENTRY(offline_workers_never_chosen),
          TEST_ENTRY(eligible_workers_only),
          TEST_ENTRY(receipt_json_snprintf_and_escaping),
          TEST_ENTRY(every_policy_has_a_receipt), TEST_ENTRY(bad_options),
          TEST_ENTRY(bad_input_changes_nothing),
          TEST_ENTRY(allocator_is_used_and_balanced),
          TEST_ENTRY(options_errors_name_the_field),
          TEST_ENTRY(block_size_mismatch_refused),
          TEST_ENTRY(bad_cls_is_logged), TEST_ENTRY(decisions_into_the_ledger),
          TEST_ENTRY(decision_names_must_match_ids),
          TEST_ENTRY(set_opts_live), TEST_ENTRY(two_step_match_then_decide))
