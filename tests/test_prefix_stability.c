/* SPDX-License-Identifier: Apache-2.0 */
/* router/prefix_stability: role/class names, the learned classifier on
 * agentic-session prompts hashed for real, marks, bounded memory, drift
 * reports, bad input, and randomized checks against straightforward models. */
#include <math.h>

#include "core_internal.h"
#include "prefix_stability_internal.h"
#include "test_harness.h"

#define BS 16u

/* ---- prompts built from named contents ----------------------------------- */
/* Token i of content c: the same (c, i) gives the same token in every prompt,
 * so a system prompt shared by sessions is one content id.  Vocabulary-sized
 * random tokens: two different 16-token windows never coincide by chance. */
static uint64_t content_salt; /* from the printed seed: runs differ */

static uint32_t tok(uint64_t content, size_t i) {
  if (content_salt == 0)
    content_salt = kvt_rand() | 1;
  uint64_t z = content_salt ^ (content * 0x9E3779B97F4A7C15ull) ^
               (i * 0xD6E8FEB86659FD93ull);
  z = (z ^ (z >> 32)) * 0xD6E8FEB86659FD93ull;
  z = (z ^ (z >> 32)) * 0xD6E8FEB86659FD93ull;
  return (uint32_t)((z ^ (z >> 32)) % 151936u);
}

enum { MAX_TOK = 4096, MAX_MARKS = 16 };

typedef struct prompt {
  uint32_t tok[MAX_TOK];
  size_t n;
  kvp_segment_mark marks[MAX_MARKS];
  size_t n_marks;
  kvp_key keys[MAX_TOK / BS];
  size_t nb, tail;
} prompt;

/* Appends content[start, start + len) as one segment marked with role/hint. */
static void add(prompt *p, uint64_t content, size_t start, size_t len,
                kvp_role role, uint8_t hint) {
  ASSERT_LE(p->n + len, (size_t)MAX_TOK);
  ASSERT_LT(p->n_marks, (size_t)MAX_MARKS);
  p->marks[p->n_marks++] = (kvp_segment_mark){
      (uint32_t)p->n, (uint32_t)len, (uint8_t)role, hint, {0}};
  for (size_t i = 0; i < len; i++)
    p->tok[p->n++] = tok(content, start + i);
}

static void seg(prompt *p, uint64_t content, size_t len, kvp_role role) {
  add(p, content, 0, len, role, KVP_CLASS_AUTO);
}

/* One XXH3-128 hasher with 16-token blocks for the whole binary. */
static kvp_hasher *hasher(void) {
  static kvp_hasher *h;
  if (h != NULL)
    return h;
  kvp_namespace_desc d = {.model_id = "test/stability", .block_size = BS};
  kvp_namespace ns;
  ASSERT_OK(kvp_namespace_init(&d, &ns));
  ASSERT_OK(kvp_hasher_create(&ns, NULL, NULL, &h));
  return h;
}

static void hash_prompt(prompt *p) {
  int nb = kvp_hasher_hash(hasher(), p->tok, p->n, NULL, p->keys, MAX_TOK / BS,
                           &p->tail);
  ASSERT_OK(nb);
  p->nb = (size_t)nb;
  ASSERT_EQ(p->nb, p->n / BS);
}

static kvp_classification observe(kvp_stability *s, uint64_t session, prompt *p,
                                  bool with_marks) {
  kvp_classification c;
  hash_prompt(p);
  ASSERT_OK(kvp_stability_observe(s, session, p->keys, p->nb, BS, p->tail,
                                  with_marks ? p->marks : NULL,
                                  with_marks ? p->n_marks : 0, &c));
  ASSERT_EQ(c.tokens[0] + c.tokens[1] + c.tokens[2], (uint64_t)p->n);
  ASSERT_EQ(c.n_blocks, p->nb);
  ASSERT_LE(c.stable_end, c.semi_end); /* [stable][semi][volatile] */
  ASSERT_LE(c.semi_end, c.n_blocks);
  return c;
}

/* Asserts the layout [stable][semi][volatile] of a classification. */
#define ASSERT_CLASSES(c, stable, semi, nblk, tail_)                           \
  do {                                                                         \
    ASSERT_EQ((c).stable_end, (uint32_t)(stable));                             \
    ASSERT_EQ((c).semi_end, (uint32_t)(semi));                                 \
    ASSERT_EQ((c).n_blocks, (uint32_t)(nblk));                                 \
    ASSERT_EQ((c).tokens[KVP_CLASS_STABLE], BS * (uint64_t)(stable));          \
    ASSERT_EQ((c).tokens[KVP_CLASS_SEMI], (uint64_t)((semi) - (stable)) * BS); \
    ASSERT_EQ((c).tokens[KVP_CLASS_VOLATILE],                                  \
              (uint64_t)((nblk) - (semi)) * BS + (tail_));                     \
  } while (0)

/* n session ids on distinct sketch bits: distinct sessions count exactly. */
static void pick_sessions(uint64_t *ids, size_t n, uint64_t from) {
  uint64_t used = 0;
  ASSERT_LE(n, (size_t)64);
  for (size_t k = 0; k < n; from++) {
    uint64_t bit = 1ull << kvp__stability_session_bit(from);
    if (used & bit)
      continue;
    used |= bit;
    ids[k++] = from;
  }
}

/* ---- names --------------------------------------------------------------- */
TEST(role_and_class_names) {
  static const char *const roles[] = {"other",      "system",  "tools",
                                      "documents",  "history", "user",
                                      "tool_output"};
  for (int r = 0; r < KVP_ROLE_COUNT_; r++) {
    kvp_role got = KVP_ROLE_COUNT_;
    ASSERT_STR_EQ(kvp_role_name((kvp_role)r), roles[r]);
    ASSERT_OK(kvp_role_parse(roles[r], &got));
    ASSERT_EQ((int)got, r);
  }
  kvp_role out = KVP_ROLE_USER;
  ASSERT_ERR(kvp_role_parse("System", &out), KVP_EINVAL); /* exact names */
  ASSERT_ERR(kvp_role_parse("tool-output", &out), KVP_EINVAL);
  ASSERT_ERR(kvp_role_parse("", &out), KVP_EINVAL);
  ASSERT_ERR(kvp_role_parse("systems", &out), KVP_EINVAL);
  ASSERT_ERR(kvp_role_parse(NULL, &out), KVP_EINVAL);
  ASSERT_ERR(kvp_role_parse("user", NULL), KVP_EINVAL);
  ASSERT_EQ((int)out, KVP_ROLE_USER); /* untouched on failure */
  ASSERT_STR_EQ(kvp_role_name(KVP_ROLE_COUNT_), "unknown");

  ASSERT_STR_EQ(kvp_class_name(KVP_CLASS_VOLATILE), "volatile");
  ASSERT_STR_EQ(kvp_class_name(KVP_CLASS_SEMI), "semi");
  ASSERT_STR_EQ(kvp_class_name(KVP_CLASS_STABLE), "stable");
  ASSERT_STR_EQ(kvp_class_name(KVP_CLASS_AUTO), "auto");
  ASSERT_STR_EQ(kvp_class_name((kvp_class)7), "unknown");

  ASSERT_EQ(kvp_role_default_class(KVP_ROLE_SYSTEM), KVP_CLASS_STABLE);
  ASSERT_EQ(kvp_role_default_class(KVP_ROLE_TOOLS), KVP_CLASS_STABLE);
  ASSERT_EQ(kvp_role_default_class(KVP_ROLE_DOCUMENTS), KVP_CLASS_SEMI);
  ASSERT_EQ(kvp_role_default_class(KVP_ROLE_HISTORY), KVP_CLASS_SEMI);
  ASSERT_EQ(kvp_role_default_class(KVP_ROLE_USER), KVP_CLASS_VOLATILE);
  ASSERT_EQ(kvp_role_default_class(KVP_ROLE_TOOL_OUTPUT), KVP_CLASS_VOLATILE);
  ASSERT_EQ(kvp_role_default_class(KVP_ROLE_OTHER), KVP_CLASS_VOLATILE);
  ASSERT_EQ(kvp_role_default_class(KVP_ROLE_COUNT_), KVP_CLASS_VOLATILE);
}

/* ---- the agentic layout ----------------------------------------------------
 * system 300 + tools 700 (shared by all sessions: 1,000 tokens = blocks 0..61
 * plus 8 tokens of block 62), repo context 800 (per session), user 50:
 * 1,850 tokens = 115 full blocks + a 10-token tail. */
enum {
  C_SYSTEM = 1,
  C_TOOLS = 2,
  C_REPO = 100,
  C_USER = 200,
  C_ASSIST = 300,
  C_TOOLOUT = 400
};
enum { SHARED_BLOCKS = 62, TURN1_BLOCKS = 115, TURN1_TAIL = 10 };

static void turn1(prompt *p, uint64_t s) {
  p->n = p->n_marks = 0;
  seg(p, C_SYSTEM, 300, KVP_ROLE_SYSTEM);
  seg(p, C_TOOLS, 700, KVP_ROLE_TOOLS);
  seg(p, C_REPO + s, 800, KVP_ROLE_DOCUMENTS);
  seg(p, C_USER + 1000 * s, 50, KVP_ROLE_USER);
}

/* Turn t >= 2 of session s: the previous turn re-sent, then the assistant's
 * reply, a tool result and the next user message. */
static void next_turn(prompt *p, uint64_t s, int t) {
  seg(p, C_ASSIST + 1000 * s + (uint64_t)t, 120, KVP_ROLE_HISTORY);
  seg(p, C_TOOLOUT + 1000 * s + (uint64_t)t, 300, KVP_ROLE_TOOL_OUTPUT);
  seg(p, C_USER + 1000 * s + (uint64_t)t, 40, KVP_ROLE_USER);
}

TEST(shared_prefix_becomes_stable) {
  kvp_stability *s = NULL;
  ASSERT_OK(kvp_stability_create(NULL, NULL, &s));
  uint64_t ids[9];
  pick_sessions(ids, 9, 1000);
  static prompt p;
  for (size_t k = 0; k < 9; k++) {
    turn1(&p, ids[k]);
    kvp_classification c = observe(s, ids[k], &p, false);
    /* the 4th session on finds system + tools seen by 3 distinct sessions;
     * block 62 mixes in the session's repo context: never shared */
    size_t stable = k >= 3 ? SHARED_BLOCKS : 0;
    ASSERT_CLASSES(c, stable, stable, TURN1_BLOCKS, TURN1_TAIL);
    ASSERT_EQ(c.learned_blocks, (uint32_t)TURN1_BLOCKS);
  }
  /* 62 shared keys + 9 * 53 private ones */
  ASSERT_EQ(kvp_stability_size(s), (size_t)(SHARED_BLOCKS + 9 * 53));
  kvp_stability_destroy(s);
}

TEST(session_resends_context_semi) {
  kvp_stability *s = NULL;
  ASSERT_OK(kvp_stability_create(NULL, NULL, &s));
  uint64_t ids[8];
  pick_sessions(ids, 8, 77);
  static prompt p;
  /* session 0 alone first: its re-sent turn is semi, system + tools included
   * (one session has seen them: not stable) */
  turn1(&p, ids[0]);
  kvp_classification c = observe(s, ids[0], &p, false);
  ASSERT_CLASSES(c, 0, 0, TURN1_BLOCKS, TURN1_TAIL);
  next_turn(&p, ids[0], 2); /* 2,310 tokens: 144 blocks + 6 */
  c = observe(s, ids[0], &p, false);
  ASSERT_CLASSES(c, 0, TURN1_BLOCKS, 144, 6);
  /* seven more sessions share system + tools */
  static prompt q;
  for (size_t k = 1; k < 8; k++) {
    turn1(&q, ids[k]);
    observe(s, ids[k], &q, false);
  }
  /* turn 3: shared prefix stable, turns 1-2 semi, the new reply, tool
   * result and user message (and the block turn 2's tail lands in) volatile */
  next_turn(&p, ids[0], 3); /* 2,770 tokens: 173 blocks + 2 */
  c = observe(s, ids[0], &p, false);
  ASSERT_CLASSES(c, SHARED_BLOCKS, 144, 173, 2);
  /* another session's turn 2: its own turn 1 is semi, not stable */
  turn1(&q, ids[5]);
  next_turn(&q, ids[5], 2);
  c = observe(s, ids[5], &q, false);
  ASSERT_CLASSES(c, SHARED_BLOCKS, TURN1_BLOCKS, 144, 6);
  /* a different session sending session 0's exact turn 3: it never saw the
   * private part, one other session did: volatile after the shared prefix */
  c = observe(s, ids[6], &p, false);
  ASSERT_CLASSES(c, SHARED_BLOCKS, SHARED_BLOCKS, 173, 2);
  kvp_stability_destroy(s);
}

/* Returns the stable_end a fresh session sees after `warm` sessions sent the
 * shared prefix. */
static uint32_t stable_after(kvp_stability *s, size_t warm, uint64_t from) {
  uint64_t ids[16];
  pick_sessions(ids, warm + 1, from);
  static prompt p;
  for (size_t k = 0; k < warm; k++) {
    turn1(&p, ids[k]);
    observe(s, ids[k], &p, false);
  }
  turn1(&p, ids[warm]);
  return observe(s, ids[warm], &p, false).stable_end;
}

TEST(thresholds_configurable) {
  for (uint32_t need = 1; need <= 6; need++) {
    kvp_stability_opts o = {.stable_sessions = need};
    kvp_stability *a = NULL, *b = NULL;
    ASSERT_OK(kvp_stability_create(&o, NULL, &a));
    ASSERT_OK(kvp_stability_create(&o, NULL, &b));
    ASSERT_EQ(stable_after(a, need - 1, 5), 0u);
    ASSERT_EQ(stable_after(b, need, 5), (uint32_t)SHARED_BLOCKS);
    kvp_stability_destroy(a);
    kvp_stability_destroy(b);
  }
  /* semi_repeats = 3: semi only from the third sighting in the session */
  kvp_stability_opts o = {.semi_repeats = 3};
  kvp_stability *s = NULL;
  ASSERT_OK(kvp_stability_create(&o, NULL, &s));
  static prompt p;
  turn1(&p, 9);
  kvp_classification c = observe(s, 9, &p, false);
  ASSERT_CLASSES(c, 0, 0, TURN1_BLOCKS, TURN1_TAIL);
  next_turn(&p, 9, 2);
  c = observe(s, 9, &p, false); /* turn 1's blocks: 2nd sighting */
  ASSERT_CLASSES(c, 0, 0, 144, 6);
  next_turn(&p, 9, 3);
  c = observe(s, 9, &p, false); /* turn 1's: 3rd; turn 2's: 2nd */
  ASSERT_CLASSES(c, 0, TURN1_BLOCKS, 173, 2);
  kvp_stability_destroy(s);
}

TEST(session_sketch) {
  ASSERT_DOUBLE_NEAR(kvp__stability_sessions_estimate(0), 0.0, 0.0);
  ASSERT_DOUBLE_NEAR(kvp__stability_sessions_estimate(3), 3.07, 0.01);
  ASSERT_DOUBLE_NEAR(kvp__stability_sessions_estimate(32), 64.0 * log(2.0),
                     1e-9);
  ASSERT_TRUE(isinf(kvp__stability_sessions_estimate(64)));
  for (uint32_t k = 1; k < 64; k++) /* never below the popcount */
    ASSERT_GE(kvp__stability_sessions_estimate(k), (double)k);
  /* two sessions on the same sketch bit count as one: the sketch
   * under-counts, never over-counts */
  uint64_t a = 1, b = 2;
  while (kvp__stability_session_bit(b) != kvp__stability_session_bit(a))
    b++;
  kvp_stability_opts o = {.stable_sessions = 2};
  kvp_stability *s = NULL;
  ASSERT_OK(kvp_stability_create(&o, NULL, &s));
  static prompt p;
  turn1(&p, a);
  observe(s, a, &p, false);
  turn1(&p, b);
  kvp_classification c = observe(s, b, &p, false);
  ASSERT_EQ(c.stable_end, 0u);
  ASSERT_EQ(c.semi_end, (uint32_t)SHARED_BLOCKS); /* looks like a's repeat */
  kvp_stability_destroy(s);
}

/* ---- marks --------------------------------------------------------------- */
TEST(marks_override) {
  kvp_stability *s = NULL;
  ASSERT_OK(kvp_stability_create(NULL, NULL, &s));
  static prompt p;
  /* nothing learned yet: marks alone decide.  system, tools stable; repo
   * (documents) semi; block 62 straddles tools/repo: semi; block 112
   * (1,792..1,808) straddles repo/user: volatile */
  turn1(&p, 1);
  kvp_classification c = observe(s, 1, &p, true);
  ASSERT_CLASSES(c, SHARED_BLOCKS, 112, TURN1_BLOCKS, TURN1_TAIL);
  ASSERT_EQ(c.learned_blocks, 0u);
  /* a hint beats the role default: shared documents marked stable */
  p.marks[2].class_hint = KVP_CLASS_STABLE;
  c = observe(s, 1, &p, true);
  ASSERT_CLASSES(c, 112, 112, TURN1_BLOCKS, TURN1_TAIL);
  /* a volatile hint on the system prompt (a timestamp in it) makes the whole
   * chain volatile: nothing after a volatile block can be reused */
  p.marks[0].class_hint = KVP_CLASS_VOLATILE;
  c = observe(s, 1, &p, true);
  ASSERT_CLASSES(c, 0, 0, TURN1_BLOCKS, TURN1_TAIL);
  kvp_stability_destroy(s);
}

TEST(marks_with_learning) {
  kvp_stability *s = NULL;
  ASSERT_OK(kvp_stability_create(NULL, NULL, &s));
  uint64_t ids[4];
  pick_sessions(ids, 4, 300);
  static prompt p;
  for (size_t k = 0; k < 3; k++) {
    turn1(&p, ids[k]);
    observe(s, ids[k], &p, false);
  }
  turn1(&p, ids[3]);
  /* only the user message marked: learned blocks stay learned */
  kvp_segment_mark user = p.marks[3];
  p.marks[0] = user;
  p.n_marks = 1;
  kvp_classification c = observe(s, ids[3], &p, true);
  ASSERT_CLASSES(c, SHARED_BLOCKS, SHARED_BLOCKS, TURN1_BLOCKS, TURN1_TAIL);
  ASSERT_EQ(c.learned_blocks, 112u); /* blocks 112..114 touch the user mark */
  /* a volatile mark on block 20 of the learned-stable prefix, and one far
   * past the end of the prompt (clipped, not an error) */
  p.marks[1] =
      (kvp_segment_mark){20 * BS + 3, 2, KVP_ROLE_USER, KVP_CLASS_AUTO, {0}};
  p.marks[2] =
      (kvp_segment_mark){5000, 100000, KVP_ROLE_SYSTEM, KVP_CLASS_AUTO, {0}};
  p.n_marks = 3;
  c = observe(s, ids[3], &p, true);
  ASSERT_CLASSES(c, 20, 20, TURN1_BLOCKS, TURN1_TAIL);
  ASSERT_EQ(c.learned_blocks, 111u);
  /* a stable mark raises what learning calls volatile: tools mark stretched
   * over the repo context makes blocks 62..111 stable; overlapping marks
   * take the least reusable (block 112 also touches the user mark) */
  p.marks[1] =
      (kvp_segment_mark){300, 1500, KVP_ROLE_TOOLS, KVP_CLASS_AUTO, {0}};
  p.n_marks = 2;
  c = observe(s, ids[3], &p, true);
  ASSERT_CLASSES(c, 112, 112, TURN1_BLOCKS, TURN1_TAIL);
  ASSERT_EQ(c.learned_blocks, 18u); /* blocks 0..17 (0..288) */
  kvp_stability_destroy(s);
}

/* ---- bounded memory ------------------------------------------------------ */
typedef struct counting_alloc {
  size_t live, allocs, fail_after;
} counting_alloc;
static void *ca_alloc(void *o, size_t n) {
  counting_alloc *c = o;
  if (c->fail_after && c->allocs + 1 >= c->fail_after)
    return NULL;
  c->live += n;
  c->allocs++;
  return malloc(n);
}
static void ca_free(void *o, void *p, size_t n) {
  counting_alloc *c = o;
  c->live -= n;
  free(p);
}

static kvp_key rand_key(void) { return (kvp_key){kvt_rand(), kvt_rand()}; }

TEST(bounded_memory_clock) {
  enum { CAP = 1000, BATCH = 100, HOT = 10, ROUNDS = 1000, SETTLED = 20 };
  counting_alloc ca = {0};
  kvp_allocator a = {ca_alloc, ca_free, &ca};
  kvp_stability_opts o = {.capacity = CAP};
  kvp_stability *s = NULL;
  ASSERT_OK(kvp_stability_create(&o, &a, &s));
  size_t allocs = ca.allocs, live = ca.live;
  ASSERT_EQ(kvp__stability_slots(s), (size_t)2048); /* >= 1000 / 0.75 */
  ASSERT_LE(live, (size_t)CAP * 40);
  kvp_key hot[HOT], first[BATCH], batch[BATCH];
  for (int i = 0; i < HOT; i++)
    hot[i] = rand_key();
  kvp_classification c;
  ASSERT_OK(kvp_stability_observe(s, 7, hot, HOT, BS, 0, NULL, 0, &c));
  /* 100,000 distinct keys, the hot chain re-used after every 100.  The table
   * fills in round 9 with every entry referenced: CLOCK's degenerate moment
   * (the hand clears everything and evicts by position), which may take a
   * hot key once; from then on a key touched every round is never the one
   * evicted. */
  for (int r = 0; r < ROUNDS; r++) {
    for (int i = 0; i < BATCH; i++)
      batch[i] = rand_key();
    if (r == 0)
      memcpy(first, batch, sizeof batch);
    ASSERT_OK(kvp_stability_observe(s, 1000 + (uint64_t)r, batch, BATCH, BS,
                                    0, NULL, 0, &c));
    ASSERT_LE(kvp_stability_size(s), (size_t)CAP);
    ASSERT_OK(kvp_stability_observe(s, 7, hot, HOT, BS, 0, NULL, 0, &c));
    if (r >= SETTLED)
      ASSERT_CLASSES(c, 0, HOT, HOT, 0); /* state kept: still a repeat */
  }
  ASSERT_EQ(kvp_stability_size(s), (size_t)CAP);
  /* the latest batch is remembered, the first long forgotten */
  ASSERT_OK(kvp_stability_observe(s, 1999, batch, BATCH, BS, 0, NULL, 0, &c));
  ASSERT_CLASSES(c, 0, BATCH, BATCH, 0);
  ASSERT_OK(kvp_stability_observe(s, 1000, first, BATCH, BS, 0, NULL, 0, &c));
  ASSERT_CLASSES(c, 0, 0, BATCH, 0);
  ASSERT_EQ(ca.allocs, allocs); /* observe never allocates */
  ASSERT_EQ(ca.live, live);
  kvp_stability_destroy(s);
  ASSERT_EQ(ca.live, 0u);
}

/* Small tables under churn: after every call the table's invariants hold
 * (kvp__stability_check), and a key just observed is found again. */
TEST(eviction_stress_invariants) {
  static const uint32_t caps[] = {1, 2, 7, 8, 50};
  for (size_t ci = 0; ci < sizeof caps / sizeof caps[0]; ci++) {
    kvp_stability_opts o = {.capacity = caps[ci]};
    kvp_stability *s = NULL;
    ASSERT_OK(kvp_stability_create(&o, NULL, &s));
    kvp_key recent[4] = {{0, 0}};
    for (uint64_t step = 0; step < 20000; step++) {
      kvp_key k = recent[kvt_rand_below(4)];
      if (kvt_rand_below(2)) /* a new key: random, or a counter (structured) */
        k = kvt_rand_below(2) ? rand_key()
                              : (kvp_key){0, step << kvt_rand_below(40)};
      recent[step % 4] = k;
      uint64_t session = kvt_rand_below(5);
      kvp_classification c;
      ASSERT_OK(kvp_stability_observe(s, session, &k, 1, BS, 0, NULL, 0, &c));
      ASSERT_OK(kvp__stability_check(s));
      ASSERT_OK(kvp_stability_observe(s, session, &k, 1, BS, 0, NULL, 0, &c));
      ASSERT_EQ(c.semi_end, 1u); /* just seen by this session: semi or stable */
      ASSERT_LE(kvp_stability_size(s), (size_t)caps[ci]);
    }
    ASSERT_EQ(kvp_stability_size(s), (size_t)caps[ci]);
    kvp_stability_destroy(s);
  }
}

TEST(create_errors) {
  kvp_stability *s = (kvp_stability *)&s;
  ASSERT_ERR(kvp_stability_create(NULL, NULL, NULL), KVP_EINVAL);
  kvp_stability_opts o = {.stable_sessions = 257};
  ASSERT_ERR(kvp_stability_create(&o, NULL, &s), KVP_EINVAL);
  ASSERT_NULL(s); /* *out cleared on failure */
  o = (kvp_stability_opts){.semi_repeats = 1};
  ASSERT_ERR(kvp_stability_create(&o, NULL, &s), KVP_EINVAL);
  o = (kvp_stability_opts){.semi_repeats = 129};
  ASSERT_ERR(kvp_stability_create(&o, NULL, &s), KVP_EINVAL);
  o = (kvp_stability_opts){
      .stable_sessions = 256, .semi_repeats = 128, .capacity = 1};
  ASSERT_OK(kvp_stability_create(&o, NULL, &s));
  ASSERT_EQ(kvp__stability_slots(s), (size_t)8);
  kvp_stability_destroy(s);
  /* either allocation failing: KVP_ENOMEM and nothing leaked */
  for (size_t fail = 1; fail <= 2; fail++) {
    counting_alloc ca = {.fail_after = fail};
    kvp_allocator a = {ca_alloc, ca_free, &ca};
    ASSERT_ERR(kvp_stability_create(NULL, &a, &s), KVP_ENOMEM);
    ASSERT_EQ(ca.live, 0u);
    ASSERT_NULL(s);
  }
  kvp_stability_destroy(NULL);
  ASSERT_EQ(kvp_stability_size(NULL), 0u);
}

TEST(observe_bad_input) {
  kvp_stability *s = NULL;
  ASSERT_OK(kvp_stability_create(NULL, NULL, &s));
  kvp_key k[4] = {{1, 2}, {3, 4}, {5, 6}, {7, 8}};
  kvp_classification c;
  kvp_segment_mark ok = {0, 64, KVP_ROLE_SYSTEM, KVP_CLASS_AUTO, {0}};
  ASSERT_ERR(kvp_stability_observe(NULL, 1, k, 4, BS, 0, NULL, 0, &c),
             KVP_EINVAL);
  ASSERT_ERR(kvp_stability_observe(s, 1, k, 4, BS, 0, NULL, 0, NULL),
             KVP_EINVAL);
  ASSERT_ERR(kvp_stability_observe(s, 1, NULL, 4, BS, 0, NULL, 0, &c),
             KVP_EINVAL);
  ASSERT_ERR(kvp_stability_observe(s, 1, k, 4, 0, 0, NULL, 0, &c), KVP_EINVAL);
  ASSERT_ERR(kvp_stability_observe(s, 1, k, 4, 4097, 0, NULL, 0, &c),
             KVP_EINVAL);
  ASSERT_ERR(kvp_stability_observe(s, 1, k, 4, BS, 0, NULL, 1, &c), KVP_EINVAL);
  const kvp_segment_mark bad[] = {
      {UINT32_MAX, 1, KVP_ROLE_USER, KVP_CLASS_AUTO, {0}}, /* end overflows */
      {1u << 31, 1u << 31, KVP_ROLE_USER, KVP_CLASS_AUTO, {0}},
      {0, 16, KVP_ROLE_COUNT_, KVP_CLASS_AUTO, {0}},
      {0, 16, 200, KVP_CLASS_AUTO, {0}},
      {0, 16, KVP_ROLE_USER, 3, {0}},
      {0, 16, KVP_ROLE_USER, 254, {0}},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    kvp_segment_mark two[2] = {ok, bad[i]};
    ASSERT_ERR(kvp_stability_observe(s, 1, k, 4, BS, 0, two, 2, &c),
               KVP_EINVAL);
  }
  /* more blocks than the u32 boundaries can report: rejected before any
   * key is read */
  ASSERT_ERR(kvp_stability_observe(s, 1, k, (size_t)UINT32_MAX + 1, BS, 0, NULL,
                                   0, &c),
             KVP_EINVAL);
  ASSERT_EQ(kvp_stability_size(s), 0u); /* rejected calls learn nothing */
  /* edges that are valid */
  ASSERT_OK(kvp_stability_observe(s, 1, NULL, 0, BS, 7, NULL, 0, &c));
  ASSERT_CLASSES(c, 0, 0, 0, 7);
  ASSERT_OK(
      kvp_stability_observe(s, 1, k, 4, KVP_BLOCK_SIZE_MAX, 0, &ok, 1, &c));
  ASSERT_EQ(c.stable_end, 1u); /* 64 tokens touch block 0 only */
  const kvp_segment_mark edge[] = {
      {UINT32_MAX - 1, 1, KVP_ROLE_USER, KVP_CLASS_VOLATILE, {0}}, /* far out */
      {10, 0, KVP_ROLE_USER, KVP_CLASS_VOLATILE, {0}},             /* empty */
  };
  ASSERT_OK(kvp_stability_observe(s, 1, k, 4, BS, 0, edge, 2, &c));
  ASSERT_EQ(c.learned_blocks, 4u);
  kvp_stability_destroy(s);
}

/* ---- randomized: the classifier against a straightforward model ---------- */
/* Exact model: every key's set of sessions (indices < 32) and sightings. */
typedef struct model_entry {
  kvp_key key;
  uint32_t sessions, sightings;
} model_entry;

enum { MODEL_SLOTS = 1 << 16 };
static model_entry model[MODEL_SLOTS];

static model_entry *model_get(kvp_key k) {
  size_t i = (size_t)(k.lo & (MODEL_SLOTS - 1));
  while (model[i].sightings != 0 && !kvp_key_eq(model[i].key, k))
    i = (i + 1) & (MODEL_SLOTS - 1);
  model[i].key = k;
  return &model[i];
}

/* Model class of every block: marks (least reusable overlapping) or learned,
 * then the running minimum.  Returns the per-class block counts. */
static void model_classify(const prompt *p, uint32_t sess_idx, uint32_t need,
                           uint32_t semi_repeats, const kvp_segment_mark *mks,
                           size_t n_mks, uint32_t out[3], uint32_t *learned) {
  uint8_t run = KVP_CLASS_STABLE;
  *learned = 0;
  out[0] = out[1] = out[2] = 0;
  for (size_t b = 0; b < p->nb; b++) {
    model_entry *e = model_get(p->keys[b]);
    uint8_t c = KVP_CLASS_VOLATILE;
    if ((uint32_t)__builtin_popcount(e->sessions) >= need)
      c = KVP_CLASS_STABLE;
    else if ((e->sessions >> sess_idx & 1) && e->sightings + 1 >= semi_repeats)
      c = KVP_CLASS_SEMI;
    e->sessions |= 1u << sess_idx;
    e->sightings++;
    uint8_t mk = 255;
    for (size_t m = 0; m < n_mks; m++) {
      const kvp_segment_mark *k = &mks[m];
      if (k->length == 0 || k->offset >= (b + 1) * BS ||
          (uint64_t)k->offset + k->length <= b * BS)
        continue;
      uint8_t mc = k->class_hint != KVP_CLASS_AUTO
                       ? k->class_hint
                       : (uint8_t)kvp_role_default_class((kvp_role)k->role);
      mk = mc < mk ? mc : mk;
    }
    if (mk != 255)
      c = mk;
    else
      ++*learned;
    run = c < run ? c : run;
    out[run]++;
  }
}

/* The property: for random sessions (shared system prompts, growing turns,
 * retries, random thresholds and marks) classes are non-increasing along
 * every chain, and exactly where the model's running minimum puts them. */
TEST(random_sessions_match_model) {
  enum { SESSIONS = 24, REQUESTS = 600 };
  memset(model, 0, sizeof model);
  uint64_t ids[SESSIONS];
  pick_sessions(ids, SESSIONS, kvt_rand());
  uint32_t need = 1 + (uint32_t)kvt_rand_below(6);
  uint32_t semi = 2 + (uint32_t)kvt_rand_below(3);
  kvp_stability_opts o = {.stable_sessions = need, .semi_repeats = semi};
  kvp_stability *s = NULL;
  ASSERT_OK(kvp_stability_create(&o, NULL, &s));
  static prompt p[SESSIONS];
  for (int i = 0; i < SESSIONS; i++) { /* a system prompt from a small pool */
    p[i].n = p[i].n_marks = 0;
    seg(&p[i], 50 + kvt_rand_below(3), 100 + 37 * kvt_rand_below(4),
        KVP_ROLE_SYSTEM);
  }
  for (int r = 0; r < REQUESTS; r++) {
    uint32_t i = (uint32_t)kvt_rand_below(SESSIONS);
    prompt *q = &p[i];
    uint64_t what = kvt_rand_below(10);
    if (what == 0 || q->n > MAX_TOK - 600 || q->n_marks >= MAX_MARKS - 2) {
      q->n = q->n_marks = 0; /* a new conversation */
      seg(q, 50 + kvt_rand_below(3), 100 + 37 * kvt_rand_below(4),
          KVP_ROLE_SYSTEM);
    } else if (what == 1 && q->n_marks > 1) { /* retry: drop the last turn */
      q->n = q->marks[--q->n_marks].offset;
    }
    add(q, kvt_rand(), 0, 1 + kvt_rand_below(300),
        (kvp_role)kvt_rand_below(KVP_ROLE_COUNT_),
        kvt_rand_below(3) ? KVP_CLASS_AUTO : (uint8_t)kvt_rand_below(3));
    /* marks on a third of the requests: some of the segments' own, some
     * arbitrary spans (unaligned, overlapping, past the end) */
    kvp_segment_mark mk[MAX_MARKS];
    size_t n_mk = 0;
    bool marked = kvt_rand_below(3) == 0;
    for (size_t m = 0; marked && m < q->n_marks; m++) {
      if (kvt_rand_below(2))
        mk[n_mk++] = q->marks[m];
      else if (kvt_rand_below(2))
        mk[n_mk++] = (kvp_segment_mark){
            (uint32_t)kvt_rand_below(q->n + 64), (uint32_t)kvt_rand_below(400),
            (uint8_t)kvt_rand_below(KVP_ROLE_COUNT_),
            kvt_rand_below(2) ? KVP_CLASS_AUTO : (uint8_t)kvt_rand_below(3),
            {0}};
    }
    uint32_t want[3], learned;
    kvp_classification c;
    hash_prompt(q);
    model_classify(q, i, need, semi, mk, n_mk, want, &learned);
    ASSERT_OK(kvp_stability_observe(s, ids[i], q->keys, q->nb, BS, q->tail,
                                    mk, n_mk, &c));
    ASSERT_CLASSES(c, want[2], want[2] + want[1], q->nb, q->tail);
    ASSERT_EQ(c.learned_blocks, learned);
  }
  kvp_stability_destroy(s);
}

/* ---- the fast path against the per-block reference ------------------------
 * A request's blocks that its session already sent are found by binary search
 * (router/prefix_stability.c, "Fast path"); only the rest is walked.  These
 * pin it: identical to the per-block path while nothing is evicted, never more
 * reusable than an exact model when things are, and self-healing. */

/* Both tables hold the same state for p's keys (reference bits aside: the
 * fast path sets fewer). */
static void assert_same_state(const kvp_stability *a, const kvp_stability *b,
                              const prompt *p) {
  for (size_t i = 0; i < p->nb; i++) {
    kvp__stability_entry x, y;
    int ra = kvp__stability_lookup(a, p->keys[i].lo, &x);
    ASSERT_EQ(ra, kvp__stability_lookup(b, p->keys[i].lo, &y));
    if (ra < 0)
      continue;
    ASSERT_EQ(x.sessions, y.sessions);
    ASSERT_EQ(x.sightings, y.sightings);
    ASSERT_EQ(x.stable, y.stable);
  }
  ASSERT_EQ(kvp_stability_size(a), kvp_stability_size(b));
}

#define ASSERT_SAME_CLASSES(x, y)                                              \
  do {                                                                         \
    ASSERT_EQ((x).stable_end, (y).stable_end);                                 \
    ASSERT_EQ((x).semi_end, (y).semi_end);                                     \
    ASSERT_EQ((x).n_blocks, (y).n_blocks);                                     \
    ASSERT_EQ((x).learned_blocks, (y).learned_blocks);                         \
    for (int k_ = 0; k_ < KVP_CLASS_COUNT_; k_++)                              \
      ASSERT_EQ((x).tokens[k_], (y).tokens[k_]);                               \
  } while (0)

/* One random agentic request of session i: a new conversation, a retry (the
 * last turn dropped and redone), a fork (another session's prompt sent
 * as-is), a plain re-send, or the next turn appended.  Random marks on a
 * third of the requests go to mk. */
static void agentic_step(prompt *p, size_t n_sess, uint32_t i,
                         kvp_segment_mark *mk, size_t *n_mk) {
  prompt *q = &p[i];
  uint64_t what = kvt_rand_below(20);
  if (what == 0 || q->n > MAX_TOK - 450 || q->n_marks >= MAX_MARKS - 2) {
    q->n = q->n_marks = 0; /* a long shared system prompt from a small pool */
    seg(q, 60 + kvt_rand_below(3), 500 + 250 * kvt_rand_below(4),
        KVP_ROLE_SYSTEM);
  } else if (what == 1 && q->n_marks > 1) {
    q->n = q->marks[--q->n_marks].offset;
  } else if (what == 2) {
    const prompt *from = &p[kvt_rand_below(n_sess)];
    /* started, with room to grow (tokens and marks) */
    if (from->n <= MAX_TOK - 450 && from->n_marks < MAX_MARKS - 2)
      *q = *from;
  }
  if (what != 3) /* 3: the same prompt again */
    add(q, kvt_rand(), 0, 1 + kvt_rand_below(400),
        (kvp_role)kvt_rand_below(KVP_ROLE_COUNT_),
        kvt_rand_below(3) ? KVP_CLASS_AUTO : (uint8_t)kvt_rand_below(3));
  *n_mk = 0;
  bool marked = kvt_rand_below(3) == 0;
  for (size_t m = 0; marked && m < q->n_marks; m++) {
    if (kvt_rand_below(2))
      mk[(*n_mk)++] = q->marks[m];
    else if (kvt_rand_below(2))
      mk[(*n_mk)++] = (kvp_segment_mark){
          (uint32_t)kvt_rand_below(q->n + 64), (uint32_t)kvt_rand_below(400),
          (uint8_t)kvt_rand_below(KVP_ROLE_COUNT_),
          kvt_rand_below(2) ? KVP_CLASS_AUTO : (uint8_t)kvt_rand_below(3),
          {0}};
  }
  hash_prompt(q);
}

/* Long multi-turn sessions, nothing evicted: the fast path classifies every
 * request exactly as the per-block path and leaves the same state behind. */
TEST(fast_path_matches_reference) {
  enum { SESSIONS = 16, REQUESTS = 1500 };
  for (int round = 0; round < 4; round++) {
    uint64_t ids[SESSIONS];
    pick_sessions(ids, SESSIONS, kvt_rand());
    kvp_stability_opts o = {.stable_sessions = 1 + (uint32_t)kvt_rand_below(6),
                            .semi_repeats = 2 + (uint32_t)kvt_rand_below(4)};
    if (round == 0) /* the defaults at least once */
      o = (kvp_stability_opts){0};
    kvp_stability *fast = NULL, *ref = NULL;
    ASSERT_OK(kvp_stability_create(&o, NULL, &fast));
    ASSERT_OK(kvp_stability_create(&o, NULL, &ref));
    kvp__stability_set_fast(ref, false);
    static prompt p[SESSIONS];
    for (int i = 0; i < SESSIONS; i++)
      p[i].n = p[i].n_marks = MAX_TOK; /* forces a new conversation */
    for (int r = 0; r < REQUESTS; r++) {
      uint32_t i = (uint32_t)kvt_rand_below(SESSIONS);
      kvp_segment_mark mk[MAX_MARKS];
      size_t n_mk;
      agentic_step(p, SESSIONS, i, mk, &n_mk);
      kvp_classification cf, cr;
      ASSERT_OK(kvp_stability_observe(fast, ids[i], p[i].keys, p[i].nb, BS,
                                      p[i].tail, mk, n_mk, &cf));
      ASSERT_OK(kvp_stability_observe(ref, ids[i], p[i].keys, p[i].nb, BS,
                                      p[i].tail, mk, n_mk, &cr));
      ASSERT_SAME_CLASSES(cf, cr);
      assert_same_state(fast, ref, &p[i]);
    }
    ASSERT_OK(kvp__stability_check(fast));
    ASSERT_EQ(kvp__stability_fast_calls(ref), 0u);
    /* most requests re-send a settled prefix: the fast path served them */
    ASSERT_GE(kvp__stability_fast_calls(fast), (uint64_t)REQUESTS / 2);
    kvp_stability_destroy(fast);
    kvp_stability_destroy(ref);
  }
}

/* A chain learned by four sessions (stable), then a hole punched into its
 * middle, as a forced CLOCK eviction would.  While the prefix's stamps are
 * fresh the fast path may not look at the hole: it reports what block b-1
 * proves (every request with b-1 held the hole's block too), never more.
 * Once the epoch moves the whole request is walked: the hole is re-learned as
 * the per-block path would (volatile from it for that request), and inherits
 * what its successor proves (four sessions: stable again at once; the last
 * block has no successor and waits for three sessions to re-send it).  From
 * then on both paths agree. */
TEST(fast_path_hole_self_heals) {
  static const size_t holes[] = {0, 1, 40, 57, 113, 114};
  for (size_t h = 0; h < sizeof holes / sizeof holes[0]; h++) {
    kvp_stability *fast = NULL, *ref = NULL;
    ASSERT_OK(kvp_stability_create(NULL, NULL, &fast));
    ASSERT_OK(kvp_stability_create(NULL, NULL, &ref));
    kvp__stability_set_fast(ref, false);
    uint64_t ids[8];
    pick_sessions(ids, 8, 500 + h);
    static prompt p;
    turn1(&p, 1); /* one prompt for all: 115 blocks shared */
    hash_prompt(&p);
    kvp_classification cf, cr;
    for (size_t k = 0; k < 4; k++)
      for (int t = 0; t < 2; t++) {
        ASSERT_OK(kvp_stability_observe(fast, ids[k], p.keys, p.nb, BS, p.tail,
                                        NULL, 0, &cf));
        ASSERT_OK(kvp_stability_observe(ref, ids[k], p.keys, p.nb, BS, p.tail,
                                        NULL, 0, &cr));
        ASSERT_SAME_CLASSES(cf, cr);
      }
    ASSERT_CLASSES(cf, TURN1_BLOCKS, TURN1_BLOCKS, TURN1_BLOCKS, TURN1_TAIL);
    uint64_t fast_before = kvp__stability_fast_calls(fast);
    ASSERT_GE(fast_before, 4u);

    size_t j = holes[h];
    bool last = j + 1 == TURN1_BLOCKS;
    ASSERT_OK(kvp__stability_forget(fast, p.keys[j].lo));
    ASSERT_OK(kvp__stability_forget(ref, p.keys[j].lo));
    ASSERT_OK(kvp__stability_check(fast));
    /* fresh stamps: the fast path may or may not meet the hole; either way
     * nothing is reported more reusable than before, and a hole it met is
     * re-learned at once */
    ASSERT_OK(kvp_stability_observe(fast, ids[0], p.keys, p.nb, BS, p.tail,
                                    NULL, 0, &cf));
    ASSERT_OK(kvp_stability_observe(ref, ids[0], p.keys, p.nb, BS, p.tail,
                                    NULL, 0, &cr));
    ASSERT_CLASSES(cr, j, j, TURN1_BLOCKS, TURN1_TAIL); /* re-learned at j */
    kvp__stability_entry e;
    bool met = kvp__stability_lookup(fast, p.keys[j].lo, &e) == 0;
    if (met)
      ASSERT_SAME_CLASSES(cf, cr);
    else /* b-1 = 114 was seen by four sessions, so was block j */
      ASSERT_CLASSES(cf, TURN1_BLOCKS, TURN1_BLOCKS, TURN1_BLOCKS, TURN1_TAIL);
    ASSERT_TRUE(met || !last); /* the last block is the first probed */
    /* the epoch moves (churn would move it): the next request is walked */
    kvp__stability_advance_epoch(fast);
    ASSERT_OK(kvp_stability_observe(fast, ids[0], p.keys, p.nb, BS, p.tail,
                                    NULL, 0, &cf));
    ASSERT_OK(kvp_stability_observe(ref, ids[0], p.keys, p.nb, BS, p.tail,
                                    NULL, 0, &cr));
    ASSERT_OK(kvp__stability_lookup(fast, p.keys[j].lo, &e));
    if (!met) /* this walk re-learned it: what ref said one request ago */
      ASSERT_CLASSES(cf, j, j, TURN1_BLOCKS, TURN1_TAIL);
    else
      ASSERT_SAME_CLASSES(cf, cr);
    ASSERT_EQ(e.stable, !last); /* inherited from block j+1 */
    assert_same_state(fast, ref, &p);
    /* healed: the same from here on, and stable again (at once, or once
     * three sessions have re-sent the last block) */
    for (size_t k = 1; k < 4; k++) {
      ASSERT_OK(kvp_stability_observe(fast, ids[k], p.keys, p.nb, BS, p.tail,
                                      NULL, 0, &cf));
      ASSERT_OK(kvp_stability_observe(ref, ids[k], p.keys, p.nb, BS, p.tail,
                                      NULL, 0, &cr));
      ASSERT_SAME_CLASSES(cf, cr);
      assert_same_state(fast, ref, &p);
      if (!last)
        ASSERT_CLASSES(cf, TURN1_BLOCKS, TURN1_BLOCKS, TURN1_BLOCKS,
                       TURN1_TAIL);
    }
    ASSERT_CLASSES(cf, TURN1_BLOCKS, TURN1_BLOCKS, TURN1_BLOCKS, TURN1_TAIL);
    ASSERT_GT(kvp__stability_fast_calls(fast), fast_before);
    ASSERT_OK(kvp__stability_check(fast));
    kvp_stability_destroy(fast);
    kvp_stability_destroy(ref);
  }
}

/* The conservative direction under churn: a table far too small (CLOCK
 * evicting all the time, forced evictions included), random holes and epoch
 * moves.  Against the exact model (every key's sessions and sightings, never
 * forgetting), no block is ever reported more reusable; a stable block was
 * always sent by >= stable_sessions sessions. */
TEST(fast_path_conservative_under_churn) {
  enum { SESSIONS = 16, REQUESTS = 3000 };
  memset(model, 0, sizeof model);
  uint64_t ids[SESSIONS];
  pick_sessions(ids, SESSIONS, kvt_rand());
  uint32_t need = 1 + (uint32_t)kvt_rand_below(4);
  uint32_t semi = 2 + (uint32_t)kvt_rand_below(3);
  kvp_stability_opts o = {.capacity = 300 + (uint32_t)kvt_rand_below(700),
                          .stable_sessions = need, .semi_repeats = semi};
  kvp_stability *s = NULL;
  ASSERT_OK(kvp_stability_create(&o, NULL, &s));
  static prompt p[SESSIONS];
  for (int i = 0; i < SESSIONS; i++)
    p[i].n = p[i].n_marks = MAX_TOK;
  uint32_t below = 0;
  for (int r = 0; r < REQUESTS; r++) {
    uint32_t i = (uint32_t)kvt_rand_below(SESSIONS);
    kvp_segment_mark mk[MAX_MARKS];
    size_t n_mk;
    agentic_step(p, SESSIONS, i, mk, &n_mk);
    if (kvt_rand_below(8) == 0 && p[i].nb > 0) /* a hole somewhere */
      (void)kvp__stability_forget(s, p[i].keys[kvt_rand_below(p[i].nb)].lo);
    if (kvt_rand_below(50) == 0)
      kvp__stability_advance_epoch(s);
    uint32_t want[3], learned;
    model_classify(&p[i], i, need, semi, mk, n_mk, want, &learned);
    kvp_classification c;
    ASSERT_OK(kvp_stability_observe(s, ids[i], p[i].keys, p[i].nb, BS,
                                    p[i].tail, mk, n_mk, &c));
    ASSERT_LE(c.stable_end, want[2]);
    ASSERT_LE(c.semi_end, want[2] + want[1]);
    ASSERT_EQ(c.learned_blocks, learned);
    ASSERT_LE(kvp_stability_size(s), (size_t)o.capacity);
    below += c.semi_end < want[2] + want[1];
    if (r % 100 == 0)
      ASSERT_OK(kvp__stability_check(s));
  }
  ASSERT_GT(kvp__stability_fast_calls(s), 0u);
  ASSERT_GT(below, 0u); /* the table really was forgetting */
  kvp_stability_destroy(s);
}

/* Hot chains under churn keep their entries although the fast path no longer
 * touches every block per request: a stale stamp sends the chain through the
 * per-block path once per epoch (a quarter revolution of the CLOCK hand),
 * often enough for CLOCK.  A session's history grows turn by turn amid a
 * stream of new keys; every earlier turn stays semi (an eviction in it would
 * make it volatile).  Both paths, same assertion, at a churn where the chain
 * comes back several times per epoch (the fast path serves most requests) and
 * at one where it comes back about once per epoch (mostly per-block). */
static void hot_chain_rounds(void) {
  enum { CAP = 2000, ROUNDS = 600, SETTLED = 20, MAXB = 100 + ROUNDS };
  static const int batches[] = {25, 300};
  kvp_key *hot = malloc(sizeof(kvp_key) * MAXB), batch[300];
  ASSERT_NOT_NULL(hot);
  for (int bi = 0; bi < 2; bi++)
    for (int fast = 0; fast <= 1; fast++) {
      kvp_stability_opts o = {.capacity = CAP};
      kvp_stability *s = NULL;
      ASSERT_OK(kvp_stability_create(&o, NULL, &s));
      kvp__stability_set_fast(s, fast);
      for (int i = 0; i < MAXB; i++)
        hot[i] = rand_key(); /* always sent as a prefix: nests as a chain */
      size_t len = 100;
      kvp_classification c;
      ASSERT_OK(kvp_stability_observe(s, 7, hot, len, BS, 0, NULL, 0, &c));
      /* the table fills with every entry referenced (CLOCK's degenerate
       * moment, see bounded_memory_clock) about here: */
      int settled = (CAP - 100) / (batches[bi] + 1) + SETTLED;
      size_t lost = 0;
      for (int r = 0; r < ROUNDS; r++) {
        for (int i = 0; i < batches[bi]; i++)
          batch[i] = rand_key();
        ASSERT_OK(kvp_stability_observe(s, 1000 + (uint64_t)r, batch,
                                        (size_t)batches[bi], BS, 0, NULL, 0,
                                        &c));
        ASSERT_OK(kvp_stability_observe(s, 7, hot, len + 1, BS, 0, NULL, 0,
                                        &c)); /* the next turn: one block */
        if (r >= settled)
          lost += c.semi_end < len;
        len++;
      }
      ASSERT_EQ(lost, 0u);
      if (fast && bi == 0)
        ASSERT_GT(kvp__stability_fast_calls(s), (uint64_t)ROUNDS / 2);
      printf("# hot chain, %d new keys per turn, %s path: %" PRIu64
             " of %d turns took the fast path\n",
             batches[bi], fast ? "fast" : "per-block",
             kvp__stability_fast_calls(s), ROUNDS);
      ASSERT_OK(kvp__stability_check(s));
      kvp_stability_destroy(s);
    }
  free(hot);
}

TEST(fast_path_keeps_hot_chain) { hot_chain_rounds(); }

/* Streams under which a forced eviction (a CLOCK sweep finding every entry
 * referenced) used to take whatever entry the hand reached -- once a block of
 * the hot chain that the request had just touched, so its next turn lost
 * the semi-stable prefix (these seeds failed hot_chain_rounds' lost == 0
 * before the sweep evicted the oldest stamp instead). */
TEST(forced_eviction_spares_hot_chain) {
  static const uint64_t seeds[] = {82, 135, 206};
  uint64_t saved = kvt_rng_state;
  for (size_t i = 0; i < sizeof seeds / sizeof *seeds; i++) {
    kvt_rng_state = seeds[i];
    hot_chain_rounds();
  }
  kvt_rng_state = saved;
}

/* Session hints only steer prefetches (router/prefix_stability.c, "session
 * hints"): with them on and off, random agentic traffic gets the same
 * classes and leaves byte-identical tables after every request -- reference
 * bits, stamps and CLOCK hand included.  Rounds with a table large enough to
 * forget nothing and with tables small enough to churn (forced evictions,
 * holes punched, epochs moved, many sessions on few hint slots), under random
 * thresholds and marks. */
TEST(session_hints_change_nothing) {
  enum { SESSIONS = 16, REQUESTS = 1200 };
  for (int round = 0; round < 4; round++) {
    uint64_t ids[SESSIONS];
    pick_sessions(ids, SESSIONS, kvt_rand());
    kvp_stability_opts o = {.capacity = 1u << 16};
    if (round > 0)
      o = (kvp_stability_opts){
          .capacity = 300 + (uint32_t)kvt_rand_below(round == 1 ? 700 : 6000),
          .stable_sessions = 1 + (uint32_t)kvt_rand_below(6),
          .semi_repeats = 2 + (uint32_t)kvt_rand_below(4)};
    kvp_stability *on = NULL, *off = NULL;
    ASSERT_OK(kvp_stability_create(&o, NULL, &on));
    ASSERT_OK(kvp_stability_create(&o, NULL, &off));
    kvp__stability_set_hints(off, false);
    static prompt p[SESSIONS];
    for (int i = 0; i < SESSIONS; i++)
      p[i].n = p[i].n_marks = MAX_TOK; /* forces a new conversation */
    for (int r = 0; r < REQUESTS; r++) {
      uint32_t i = (uint32_t)kvt_rand_below(SESSIONS);
      kvp_segment_mark mk[MAX_MARKS];
      size_t n_mk;
      agentic_step(p, SESSIONS, i, mk, &n_mk);
      if (round > 1 && kvt_rand_below(8) == 0 && p[i].nb > 0) {
        uint64_t fp = p[i].keys[kvt_rand_below(p[i].nb)].lo;
        int rc = kvp__stability_forget(on, fp);
        ASSERT_EQ(rc, kvp__stability_forget(off, fp));
      }
      if (round > 1 && kvt_rand_below(50) == 0) {
        kvp__stability_advance_epoch(on);
        kvp__stability_advance_epoch(off);
      }
      kvp_classification con, coff;
      ASSERT_OK(kvp_stability_observe(on, ids[i], p[i].keys, p[i].nb, BS,
                                      p[i].tail, mk, n_mk, &con));
      ASSERT_OK(kvp_stability_observe(off, ids[i], p[i].keys, p[i].nb, BS,
                                       p[i].tail, mk, n_mk, &coff));
      ASSERT_SAME_CLASSES(con, coff);
      ASSERT_TRUE(kvp__stability_same(on, off));
    }
    ASSERT_OK(kvp__stability_check(on));
    ASSERT_EQ(kvp__stability_fast_calls(on), kvp__stability_fast_calls(off));
    ASSERT_EQ(kvp__stability_hint_calls(off), 0u);
    /* most requests extend or re-send the session's last one */
    if (round == 0)
      ASSERT_GE(kvp__stability_hint_calls(on), (uint64_t)REQUESTS / 2);
    ASSERT_GT(kvp__stability_hint_calls(on), 0u);
    printf("# hints, capacity %u: %" PRIu64 " of %d requests matched, %" PRIu64
           " took the fast path\n",
           o.capacity, kvp__stability_hint_calls(on), REQUESTS,
           kvp__stability_fast_calls(on));
    kvp_stability_destroy(on);
    kvp_stability_destroy(off);
  }
}

/* ---- drift --------------------------------------------------------------- */
/* The turn a session sent last: system 200, tools 400, documents F0 100 (a
 * README always first), F1 300, F2 400, F3 100, history 600, user 50:
 * 2,150 tokens = 134 blocks + 6. */
enum {
  D_SYS = 11,
  D_TOOLS = 12,
  D_F0 = 20,
  D_F1 = 21,
  D_F2 = 22,
  D_F3 = 23,
  D_HIST = 30,
  D_USER = 31,
  D_NEW = 40
};

static void base_head(prompt *p) {
  p->n = p->n_marks = 0;
  seg(p, D_SYS, 200, KVP_ROLE_SYSTEM);
  seg(p, D_TOOLS, 400, KVP_ROLE_TOOLS);
  seg(p, D_F0, 100, KVP_ROLE_DOCUMENTS);
}

static void base_tail(prompt *p) {
  seg(p, D_F3, 100, KVP_ROLE_DOCUMENTS);
  seg(p, D_HIST, 600, KVP_ROLE_HISTORY);
  seg(p, D_USER, 50, KVP_ROLE_USER);
}

static void base_turn(prompt *p) {
  base_head(p);
  seg(p, D_F1, 300, KVP_ROLE_DOCUMENTS);
  seg(p, D_F2, 400, KVP_ROLE_DOCUMENTS);
  base_tail(p);
  hash_prompt(p);
  ASSERT_EQ(p->nb, 134u);
}

static kvp_turn_view view(const prompt *p, bool marks) {
  return (kvp_turn_view){p->keys,
                         p->nb,
                         p->tok,
                         p->n,
                         marks ? p->marks : NULL,
                         marks ? p->n_marks : 0};
}

static kvp_drift_report drift(const prompt *prev, const prompt *cur) {
  kvp_turn_view a = view(prev, true), b = view(cur, true);
  kvp_drift_report r;
  ASSERT_OK(kvp_drift_compare(&a, &b, BS, NULL, &r));
  return r;
}

#define ASSERT_DRIFT(r, block, role_, lost, reap, shift)                       \
  do {                                                                         \
    ASSERT_EQ((r).first_diverging_block, (int64_t)(block));                    \
    ASSERT_EQ((r).common_prefix_tokens,                                        \
              (uint64_t)((block) < 0 ? 134 : (block)) * BS);                   \
    ASSERT_EQ((int)(r).role, (int)(role_));                                    \
    ASSERT_EQ((r).lost_tokens, (uint64_t)(lost));                              \
    ASSERT_EQ((r).reappearing_tokens, (uint64_t)(reap));                       \
    ASSERT_EQ((r).shifted_tokens, (uint64_t)(shift));                          \
  } while (0)

TEST(drift_history_inserted) {
  static prompt prev, cur;
  base_turn(&prev);
  base_head(&cur);
  seg(&cur, D_F1, 300, KVP_ROLE_DOCUMENTS);
  seg(&cur, D_F2, 400, KVP_ROLE_DOCUMENTS);
  seg(&cur, D_F3, 100, KVP_ROLE_DOCUMENTS);
  add(&cur, D_HIST, 0, 300, KVP_ROLE_HISTORY, KVP_CLASS_AUTO);
  seg(&cur, D_NEW, 40, KVP_ROLE_HISTORY); /* a summary inserted at 1,800 */
  add(&cur, D_HIST, 300, 300, KVP_ROLE_HISTORY, KVP_CLASS_AUTO);
  seg(&cur, D_USER, 50, KVP_ROLE_USER);
  hash_prompt(&cur);
  /* diverges in block 112 (1,792..1,808); blocks 113..133 reappear 40 tokens
   * later; block 112 itself is split by the insertion */
  kvp_drift_report r = drift(&prev, &cur);
  ASSERT_DRIFT(r, 112, KVP_ROLE_HISTORY, 22 * BS, 21 * BS, 21 * BS);
}

TEST(drift_reordered_files) {
  static prompt prev, cur;
  base_turn(&prev);
  base_head(&cur);
  seg(&cur, D_F2, 400, KVP_ROLE_DOCUMENTS); /* F1 and F2 swapped */
  seg(&cur, D_F1, 300, KVP_ROLE_DOCUMENTS);
  base_tail(&cur);
  hash_prompt(&cur);
  /* diverges in block 43 (688..704, starts in F0); F1's whole blocks 44..61
   * and F2's 63..86 reappear moved; 62 and 87 straddle the swapped files and
   * are gone; 88..133 (from 1,408) sit where they were */
  kvp_drift_report r = drift(&prev, &cur);
  ASSERT_DRIFT(r, 43, KVP_ROLE_DOCUMENTS, 91 * BS, (18 + 24 + 46) * BS,
               (18 + 24) * BS);
}

TEST(drift_tool_schema_edit) {
  static prompt prev, cur;
  base_turn(&prev);
  for (int grow = 0; grow <= 1; grow++) {
    cur.n = cur.n_marks = 0;
    seg(&cur, D_SYS, 200, KVP_ROLE_SYSTEM);
    add(&cur, D_TOOLS, 0, 200, KVP_ROLE_TOOLS, KVP_CLASS_AUTO);
    seg(&cur, D_NEW, grow ? 8 : 5,
        KVP_ROLE_TOOLS); /* replaces tokens 400..405 */
    add(&cur, D_TOOLS, 205, 195, KVP_ROLE_TOOLS, KVP_CLASS_AUTO);
    seg(&cur, D_F0, 100, KVP_ROLE_DOCUMENTS);
    seg(&cur, D_F1, 300, KVP_ROLE_DOCUMENTS);
    seg(&cur, D_F2, 400, KVP_ROLE_DOCUMENTS);
    base_tail(&cur);
    hash_prompt(&cur);
    /* block 25 (400..416) holds the edit; 26..133 reappear, moved by 3 tokens
     * when the edit grew the schema */
    kvp_drift_report r = drift(&prev, &cur);
    ASSERT_DRIFT(r, 25, KVP_ROLE_TOOLS, 109 * BS, 108 * BS,
                 grow ? 108 * BS : 0);
  }
}

TEST(drift_system_timestamp) {
  static prompt prev, cur;
  base_turn(&prev);
  cur.n = cur.n_marks = 0;
  add(&cur, D_SYS, 0, 10, KVP_ROLE_SYSTEM, KVP_CLASS_AUTO);
  seg(&cur, D_NEW, 4, KVP_ROLE_SYSTEM); /* "2025-06-01T12:00" */
  add(&cur, D_SYS, 14, 186, KVP_ROLE_SYSTEM, KVP_CLASS_AUTO);
  seg(&cur, D_TOOLS, 400, KVP_ROLE_TOOLS);
  seg(&cur, D_F0, 100, KVP_ROLE_DOCUMENTS);
  seg(&cur, D_F1, 300, KVP_ROLE_DOCUMENTS);
  seg(&cur, D_F2, 400, KVP_ROLE_DOCUMENTS);
  base_tail(&cur);
  hash_prompt(&cur);
  kvp_drift_report r = drift(&prev, &cur);
  ASSERT_DRIFT(r, 0, KVP_ROLE_SYSTEM, 134 * BS, 133 * BS, 0);
}

TEST(drift_no_divergence) {
  static prompt prev, cur;
  base_turn(&prev);
  base_turn(&cur);
  kvp_drift_report r = drift(&prev, &cur);
  ASSERT_DRIFT(r, -1, KVP_ROLE_OTHER, 0, 0, 0);
  seg(&cur, D_NEW, 100, KVP_ROLE_USER); /* the next turn extends this one */
  hash_prompt(&cur);
  r = drift(&prev, &cur);
  ASSERT_DRIFT(r, -1, KVP_ROLE_OTHER, 0, 0, 0);
  /* the other way round, cur is the shorter: diverges where it ends (block
   * 134; its first token is prev's user message, cur's tail) */
  r = drift(&cur, &prev);
  ASSERT_EQ(r.first_diverging_block, 134);
  ASSERT_EQ(r.common_prefix_tokens, 134u * BS);
  ASSERT_EQ((int)r.role, KVP_ROLE_USER);
  ASSERT_EQ(r.lost_tokens, (uint64_t)(cur.nb - 134) * BS);
  ASSERT_EQ(r.reappearing_tokens, 0u);
}

TEST(drift_role_fallback) {
  static prompt prev, cur;
  base_turn(&prev);
  cur = prev;
  cur.tok[700] ^= 1; /* first token of F1, in block 43 (688..704) */
  hash_prompt(&cur);
  kvp_turn_view a = view(&prev, true), b = view(&cur, false);
  kvp_drift_report r;
  ASSERT_OK(kvp_drift_compare(&a, &b, BS, NULL, &r)); /* prev's marks */
  ASSERT_DRIFT(r, 43, KVP_ROLE_DOCUMENTS, 91 * BS, 90 * BS, 0);
  a = view(&prev, false);
  ASSERT_OK(kvp_drift_compare(&a, &b, BS, NULL, &r)); /* no marks at all */
  ASSERT_EQ((int)r.role, KVP_ROLE_OTHER);
  /* nested marks: the narrowest covering the divergence names it */
  kvp_segment_mark nested[2] = {
      {0, 2150, KVP_ROLE_HISTORY, KVP_CLASS_AUTO, {0}},
      {680, 40, KVP_ROLE_TOOL_OUTPUT, KVP_CLASS_AUTO, {0}}};
  b.marks = nested;
  b.n_marks = 2;
  ASSERT_OK(kvp_drift_compare(&a, &b, BS, NULL, &r));
  ASSERT_EQ((int)r.role, KVP_ROLE_TOOL_OUTPUT);
}

TEST(drift_memory_and_errors) {
  static prompt prev, cur;
  base_turn(&prev);
  cur = prev;
  cur.tok[0] ^= 1;
  hash_prompt(&cur);
  kvp_turn_view a = view(&prev, true), b = view(&cur, true);
  kvp_drift_report r;
  counting_alloc ca = {0};
  kvp_allocator al = {ca_alloc, ca_free, &ca};
  ASSERT_OK(kvp_drift_compare(&a, &b, BS, &al, &r));
  ASSERT_EQ(ca.allocs, 1u);
  ASSERT_EQ(ca.live, 0u); /* freed before returning */
  ca = (counting_alloc){.fail_after = 1};
  ASSERT_ERR(kvp_drift_compare(&a, &b, BS, &al, &r), KVP_ENOMEM);
  ASSERT_EQ(ca.live, 0u);

  ASSERT_ERR(kvp_drift_compare(NULL, &b, BS, NULL, &r), KVP_EINVAL);
  ASSERT_ERR(kvp_drift_compare(&a, NULL, BS, NULL, &r), KVP_EINVAL);
  ASSERT_ERR(kvp_drift_compare(&a, &b, BS, NULL, NULL), KVP_EINVAL);
  ASSERT_ERR(kvp_drift_compare(&a, &b, 0, NULL, &r), KVP_EINVAL);
  ASSERT_ERR(kvp_drift_compare(&a, &b, 4097, NULL, &r), KVP_EINVAL);
  kvp_turn_view bad = b;
  bad.n_tokens = b.n_blocks * BS - 1; /* fewer tokens than its blocks */
  ASSERT_ERR(kvp_drift_compare(&a, &bad, BS, NULL, &r), KVP_EINVAL);
  bad = b;
  bad.tokens = NULL;
  ASSERT_ERR(kvp_drift_compare(&a, &bad, BS, NULL, &r), KVP_EINVAL);
  bad = b;
  bad.keys = NULL;
  ASSERT_ERR(kvp_drift_compare(&bad, &b, BS, NULL, &r), KVP_EINVAL);
  bad = b;
  bad.marks = NULL; /* n_marks > 0 */
  ASSERT_ERR(kvp_drift_compare(&a, &bad, BS, NULL, &r), KVP_EINVAL);
  kvp_segment_mark m = {UINT32_MAX, 2, KVP_ROLE_USER, KVP_CLASS_AUTO, {0}};
  bad = b;
  bad.marks = &m;
  bad.n_marks = 1;
  ASSERT_ERR(kvp_drift_compare(&bad, &b, BS, NULL, &r), KVP_EINVAL);
  m = (kvp_segment_mark){0, 2, KVP_ROLE_COUNT_, KVP_CLASS_AUTO, {0}};
  ASSERT_ERR(kvp_drift_compare(&a, &bad, BS, NULL, &r), KVP_EINVAL);
  bad = b;
  bad.n_blocks = (size_t)UINT32_MAX + 1;
  bad.n_tokens = SIZE_MAX;
  ASSERT_ERR(kvp_drift_compare(&a, &bad, BS, NULL, &r), KVP_EINVAL);
  /* empty turns are fine */
  kvp_turn_view empty = {0};
  ASSERT_OK(kvp_drift_compare(&empty, &empty, BS, NULL, &r));
  ASSERT_EQ(r.first_diverging_block, -1);
  ASSERT_OK(kvp_drift_compare(&a, &empty, BS, NULL, &r));
  ASSERT_EQ(r.first_diverging_block, 0);
  ASSERT_EQ(r.lost_tokens, 134u * BS);
  ASSERT_EQ(r.reappearing_tokens, 0u);
}

/* ---- randomized: drift against brute force ------------------------------- */
/* Test-local chain keys (any injective-enough chain will do: drift only
 * compares keys for equality). */
static size_t local_keys(const uint32_t *t, size_t n, uint32_t bs, kvp_key *k) {
  uint64_t h = 0x243F6A8885A308D3ull, g = 0x13198A2E03707344ull;
  for (size_t b = 0; b < n / bs; b++) {
    for (size_t i = 0; i < bs; i++) {
      h = (h ^ t[b * bs + i]) * 0x100000001B3ull;
      g = (g + t[b * bs + i] + 1) * 0x9E3779B97F4A7C15ull;
      g ^= g >> 29;
    }
    k[b] = (kvp_key){g, h};
  }
  return n / bs;
}

static void brute_drift(const uint32_t *pt, size_t pn, const uint32_t *ct,
                        size_t cn, uint32_t bs, kvp_drift_report *r) {
  size_t np = pn / bs, nc = cn / bs, d = 0;
  memset(r, 0, sizeof *r);
  while (d < np && d < nc && memcmp(pt, ct, (d + 1) * bs * 4) == 0)
    d++;
  r->first_diverging_block = d == np ? -1 : (int64_t)d;
  r->common_prefix_tokens = d * bs;
  if (d == np)
    return;
  r->lost_tokens = (np - d) * bs;
  for (size_t j = d; j < np; j++) {
    bool any = false, same = false;
    for (size_t p = d * bs; p + bs <= cn; p++)
      if (memcmp(pt + j * bs, ct + p, bs * 4) == 0) {
        any = true;
        same |= p == j * bs;
      }
    r->reappearing_tokens += any ? bs : 0;
    r->shifted_tokens += any && !same ? bs : 0;
  }
}

TEST(random_drift_matches_brute_force) {
  enum { N = 160 };
  uint32_t pt[N], ct[2 * N];
  kvp_key pk[N], ck[2 * N];
  for (int iter = 0; iter < 3000; iter++) {
    uint32_t bs = 1 + (uint32_t)kvt_rand_below(6);
    uint32_t alphabet = 2 + (uint32_t)kvt_rand_below(3); /* lots of repeats */
    size_t pn = kvt_rand_below(N), cn = 0;
    for (size_t i = 0; i < pn; i++)
      pt[i] = (uint32_t)kvt_rand_below(alphabet);
    /* cur = prev with random cuts, copies and insertions */
    for (size_t i = 0; i < pn && cn < N;) {
      uint64_t op = kvt_rand_below(8);
      size_t len = 1 + kvt_rand_below(12);
      if (op == 0)
        i += len; /* deletion */
      else if (op == 1)
        for (size_t k = 0; k < len && cn < 2 * N; k++) /* insertion */
          ct[cn++] = (uint32_t)kvt_rand_below(alphabet);
      else if (op == 2) { /* copy from anywhere in prev */
        size_t from = kvt_rand_below(pn);
        for (size_t k = 0; k < len && from + k < pn && cn < 2 * N; k++)
          ct[cn++] = pt[from + k];
      } else
        for (size_t k = 0; k < len && i < pn && cn < 2 * N; k++)
          ct[cn++] = pt[i++];
    }
    size_t np = local_keys(pt, pn, bs, pk), nc = local_keys(ct, cn, bs, ck);
    kvp_turn_view a = {pk, np, pt, pn, NULL, 0}, b = {ck, nc, ct, cn, NULL, 0};
    kvp_drift_report got, want;
    ASSERT_OK(kvp_drift_compare(&a, &b, bs, NULL, &got));
    brute_drift(pt, pn, ct, cn, bs, &want);
    ASSERT_EQ(got.first_diverging_block, want.first_diverging_block);
    ASSERT_EQ(got.common_prefix_tokens, want.common_prefix_tokens);
    ASSERT_EQ(got.lost_tokens, want.lost_tokens);
    ASSERT_EQ(got.reappearing_tokens, want.reappearing_tokens);
    ASSERT_EQ(got.shifted_tokens, want.shifted_tokens);
  }
}

/* ---- speed (printed, not asserted: shared machines drift) ---------------- */
/* Best of `rounds` timings of `reps` observes: the least disturbed run on a
 * shared machine. */
static uint64_t speed_ids[8];

static double ns_per_block(kvp_stability *s, const kvp_key *keys, size_t nb,
                           size_t chains, int reps, int rounds) {
  double best = INFINITY;
  kvp_classification c;
  for (int k = 0; k < rounds; k++) {
    uint64_t t0 = kvp_now_ns();
    for (int r = 0; r < reps; r++)
      ASSERT_OK(kvp_stability_observe(s, speed_ids[r % 8],
                                      keys + (size_t)(r % chains) * nb, nb, BS,
                                      0, NULL, 0, &c));
    double ns = (double)(kvp_now_ns() - t0) / ((double)reps * (double)nb);
    best = ns < best ? ns : best;
    ASSERT_EQ(c.stable_end, (uint32_t)nb); /* 8 sessions: all of it stable */
  }
  return best;
}

static double hash_ns_per_block(const uint32_t *tokens, size_t n,
                                kvp_key *keys) {
  double best = INFINITY;
  for (int k = 0; k < 15; k++) {
    uint64_t t0 = kvp_now_ns();
    for (int r = 0; r < 100; r++)
      ASSERT_EQ(kvp_hasher_hash(hasher(), tokens, n, NULL, keys, n / BS, NULL),
                (int)(n / BS));
    double ns = (double)(kvp_now_ns() - t0) / (100.0 * (double)(n / BS));
    best = ns < best ? ns : best;
  }
  return best;
}

TEST(classify_speed) {
  enum { NB = 2048, CHAINS = 512 };
  kvp_key *keys = malloc(sizeof(kvp_key) * NB * CHAINS);
  uint32_t *tokens = malloc(sizeof(uint32_t) * NB * BS);
  ASSERT_NOT_NULL(keys);
  ASSERT_NOT_NULL(tokens);
  /* the table keeps 50 bits of a key's lo (tag_of): 2^20 random keys
   * would share them about once in 2,000 runs and the size check below
   * would count one fewer, so the low 20 bits are the index (distinct) */
  for (size_t i = 0; i < (size_t)NB * CHAINS; i++) {
    keys[i] = rand_key();
    keys[i].lo = (keys[i].lo & ~(uint64_t)0xFFFFF) | i;
  }
  for (size_t i = 0; i < (size_t)NB * BS; i++)
    tokens[i] = tok(7, i);
  pick_sessions(speed_ids, 8, 1);
  kvp_stability *s = NULL;
  ASSERT_OK(kvp_stability_create(NULL, NULL, &s)); /* default 1<<20 keys */
  kvp_classification c;
  for (int r = 0; r < 8 * CHAINS; r++) /* learn: every chain, 8 sessions */
    ASSERT_OK(kvp_stability_observe(s, speed_ids[r / CHAINS],
                                    keys + (size_t)(r % CHAINS) * NB, NB, BS, 0,
                                    NULL, 0, &c));
  ASSERT_EQ(kvp_stability_size(s), (size_t)NB * CHAINS);
  /* every chain re-sent by a session that sent it before: the fast path;
   * then the same with it off (the per-block reference) */
  double hot = ns_per_block(s, keys, NB, 1, 200, 20);
  double cold = ns_per_block(s, keys, NB, CHAINS, CHAINS, 3);
  kvp__stability_set_fast(s, false);
  double hot_ref = ns_per_block(s, keys, NB, 1, 200, 20);
  double cold_ref = ns_per_block(s, keys, NB, CHAINS, CHAINS, 3);
  double hash = hash_ns_per_block(tokens, (size_t)NB * BS, keys);
  printf("# classify, re-sent 2,048-block chains on a full 1M-key table: "
         "%.2f ns/block hot (one chain), %.2f cold (%d chains round robin); "
         "per-block path %.2f hot, %.2f cold; xxh3_128 hashing %.2f ns/block: "
         "hot classification = %.1f%% of hashing (per-block %.0f%%)\n",
         hot, cold, CHAINS, hot_ref, cold_ref, hash, 100.0 * hot / hash,
         100.0 * hot_ref / hash);
  kvp_stability_destroy(s);
  free(tokens);
  free(keys);
}

TEST_MAIN(
    TEST_ENTRY(role_and_class_names), TEST_ENTRY(shared_prefix_becomes_stable),
    TEST_ENTRY(session_resends_context_semi),
    TEST_ENTRY(thresholds_configurable), TEST_ENTRY(session_sketch),
    TEST_ENTRY(marks_override), TEST_ENTRY(marks_with_learning),
    TEST_ENTRY(bounded_memory_clock), TEST_ENTRY(eviction_stress_invariants),
    TEST_ENTRY(create_errors), TEST_ENTRY(observe_bad_input),
    TEST_ENTRY(random_sessions_match_model),
    TEST_ENTRY(fast_path_matches_reference),
    TEST_ENTRY(fast_path_hole_self_heals),
    TEST_ENTRY(fast_path_conservative_under_churn),
    TEST_ENTRY(fast_path_keeps_hot_chain),
    TEST_ENTRY(forced_eviction_spares_hot_chain),
    TEST_ENTRY(session_hints_change_nothing),
    TEST_ENTRY(drift_history_inserted),
    TEST_ENTRY(drift_reordered_files), TEST_ENTRY(drift_tool_schema_edit),
    TEST_ENTRY(drift_system_timestamp), TEST_ENTRY(drift_no_divergence),
    TEST_ENTRY(drift_role_fallback), TEST_ENTRY(drift_memory_and_errors),
    TEST_ENTRY(random_drift_matches_brute_force), TEST_ENTRY(classify_speed))
