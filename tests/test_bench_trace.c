/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-bench trace readers: good, truncated, malformed and wrongly typed
 * input for every format; skip vs stop; zstd transparency (and a truncated
 * frame); key chains keep the prefix property; agentic sub-agents and the
 * shared system+tools namespace; Bailian sessions; kvplane-format round
 * trip; the bundled traces read completely. */
#include <unistd.h>

#include <zstd.h>

#include "harness.h"
#include "test_harness.h"

static bh_read_opts quiet_skip = {.on_error = BH_ERR_SKIP, .quiet = true};
static bh_read_opts quiet_stop = {.on_error = BH_ERR_STOP, .quiet = true};

/* Reads `text` as format f into t (initialised here). */
static int read_str(const char *text, size_t n, bh_format f,
                    const bh_read_opts *o, bh_trace *t, char *err, size_t cap) {
  bh_src *s;
  bh_trace_init(t);
  ASSERT_OK(bh_src_open_mem(text, n, "mem", &s));
  int rc = bh_read(s, f, o, t, err, cap);
  bh_src_close(s);
  return rc;
}

static const kvp_key *keys_of(const bh_trace *t, size_t i) {
  return t->keys + t->reqs[i].key_off;
}

#define MOON_GOOD                                                              \
  "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 5, "          \
  "\"hash_ids\": [1, 2, 3]}\n"                                                 \
  "\n"                                                                         \
  "{\"timestamp\": 1500, \"input_length\": 1024, \"output_length\": 7, "       \
  "\"hash_ids\": [1, 2]}\r\n"                                                  \
  "{\"timestamp\": 2000.5, \"input_length\": 600, \"output_length\": 0, "      \
  "\"hash_ids\": [1, 9]}"

TEST(mooncake_good) {
  bh_trace t;
  char err[512];
  ASSERT_OK(read_str(MOON_GOOD, strlen(MOON_GOOD), BH_FMT_MOONCAKE,
                     &quiet_stop, &t, err, sizeof err));
  ASSERT_EQ(t.n_reqs, 3u);
  ASSERT_EQ(t.block_size, 512u);
  ASSERT_EQ(t.records_ok, 3u);
  ASSERT_EQ(t.records_bad, 0u);
  /* 1100 tokens: 2 full blocks keyed (the third id is the partial tail) */
  ASSERT_EQ(t.reqs[0].n_blocks, 2u);
  ASSERT_EQ(t.reqs[1].n_blocks, 2u);
  ASSERT_EQ(t.reqs[2].n_blocks, 1u);
  ASSERT_EQ(t.reqs[0].in_tokens, 1100u);
  ASSERT_EQ(t.reqs[1].out_tokens, 7u);
  ASSERT_DOUBLE_NEAR(t.reqs[1].t, 1.5, 1e-12);
  ASSERT_DOUBLE_NEAR(t.reqs[2].t, 2.0005, 1e-12);
  /* prefix property: equal ids through i <=> equal key i */
  ASSERT_KEY_EQ(keys_of(&t, 0)[0], keys_of(&t, 1)[0]);
  ASSERT_KEY_EQ(keys_of(&t, 0)[1], keys_of(&t, 1)[1]);
  ASSERT_KEY_EQ(keys_of(&t, 0)[0], keys_of(&t, 2)[0]);
  ASSERT_FALSE(kvp_key_eq(keys_of(&t, 0)[0], keys_of(&t, 0)[1]));
  bh_trace_free(&t);
}

TEST(mooncake_bad_records) {
  static const char *const bad[] = {
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}",
      "{\"timestamp\": 0, \"input_length\": \"10\", \"output_length\": 1, "
      "\"hash_ids\": []}",
      "{\"timestamp\": -1, \"input_length\": 10, \"output_length\": 1, "
      "\"hash_ids\": []}",
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, "
      "\"hash_ids\": [1.5]}",
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, "
      "\"hash_ids\": [-3]}",
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, "
      "\"hash_ids\": {}}",
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, "
      "\"hash_ids\": [1, 2]}", /* 2 ids for 10 tokens */
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, "
      "\"hash_ids\": [1], \"hash_ids\": [2]}", /* duplicate key */
      "[1, 2, 3]",
      "{\"timestamp\": 0, \"input_length\": 10, \"outp",  /* truncated */
      "not json at all",
      "{\"timestamp\": 0, \"input_length\": 10000000, \"output_length\": 1, "
      "\"hash_ids\": [1, 2]}", /* 2 ids for 10M tokens (19531 blocks) */
      "{\"timestamp\": 0, \"input_length\": 99999999999999, "
      "\"output_length\": 1, \"hash_ids\": []}",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    char text[1024], err[512];
    bh_trace t;
    /* the bad line sits between two good ones, on line 2 */
    snprintf(text, sizeof text,
             "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 1, "
             "\"hash_ids\": [1]}\n%s\n{\"timestamp\": 1, \"input_length\": "
             "512, \"output_length\": 1, \"hash_ids\": [1]}\n",
             bad[i]);
    ASSERT_OK(read_str(text, strlen(text), BH_FMT_MOONCAKE, &quiet_skip, &t,
                       err, sizeof err));
    ASSERT_EQ(t.n_reqs, 2u);
    ASSERT_EQ(t.records_bad, 1u);
    ASSERT_TRUE(strncmp(t.first_error, "mem:2: ", 7) == 0);
    bh_trace_free(&t);
    ASSERT_ERR(read_str(text, strlen(text), BH_FMT_MOONCAKE, &quiet_stop, &t,
                        err, sizeof err),
               KVP_ECORRUPT);
    ASSERT_TRUE(strncmp(err, "mem:2: ", 7) == 0);
    ASSERT_EQ(t.n_reqs, 1u); /* stopped at line 2 */
    bh_trace_free(&t);
  }
}

/* Ids must cover the prompt's full blocks in Mooncake (and Bailian): the
 * rest would replay as never-cached prefill (TTFTs in hours). */
TEST(mooncake_ids_cover_prompt) {
  const char *text =
      "{\"timestamp\": 0, \"input_length\": 1100, \"output_length\": 1, "
      "\"hash_ids\": [1, 2]}\n" /* floor(1100 / 512) = 2: fine */
      "{\"timestamp\": 1, \"input_length\": 10000000, \"output_length\": 1, "
      "\"hash_ids\": [1, 2]}\n";
  bh_trace t;
  char err[512];
  ASSERT_OK(read_str(text, strlen(text), BH_FMT_MOONCAKE, &quiet_skip, &t, err,
                     sizeof err));
  ASSERT_EQ(t.n_reqs, 1u);
  ASSERT_EQ(t.records_bad, 1u);
  ASSERT_TRUE(strstr(t.first_error, "mem:2: 2 hash_ids for 10000000 tokens: "
                                    "fewer than floor(tokens / 512) = 19531") ==
              t.first_error);
  bh_trace_free(&t);
}

/* zstd is read transparently; a cut frame is an error, never a short read. */
TEST(zstd_transparent_and_truncated) {
  size_t n = strlen(MOON_GOOD), bound = ZSTD_compressBound(n);
  char *z = malloc(bound), err[512];
  size_t zn = ZSTD_compress(z, bound, MOON_GOOD, n, 3);
  ASSERT_FALSE(ZSTD_isError(zn));
  bh_trace t;
  ASSERT_OK(read_str(z, zn, BH_FMT_MOONCAKE, &quiet_stop, &t, err, sizeof err));
  ASSERT_EQ(t.n_reqs, 3u);
  bh_trace_free(&t);
  for (size_t cut = 5; cut < zn; cut += (zn / 7) + 1) {
    int rc = read_str(z, cut, BH_FMT_MOONCAKE, &quiet_skip, &t, err, sizeof err);
    ASSERT_LT(rc, 0);
    ASSERT_TRUE(strstr(err, "mem") != NULL);
    bh_trace_free(&t);
  }
  /* garbage after the magic: a zstd error */
  z[zn / 2] ^= 0x5a;
  z[zn / 2 + 1] ^= 0xa5;
  int rc = read_str(z, zn, BH_FMT_MOONCAKE, &quiet_skip, &t, err, sizeof err);
  bh_trace_free(&t);
  (void)rc; /* may decode to other bytes; must not crash (ASan) */
  free(z);
}

#define AGENTIC                                                                \
  "{\"id\": \"s1\", \"block_size\": 4, \"hash_id_scope\": \"local\", "         \
  "\"system_tokens\": 5, \"tool_tokens\": 4, \"requests\": ["                  \
  "{\"t\": 0.0, \"type\": \"n\", \"in\": 13, \"out\": 2, "                     \
  "\"hash_ids\": [1, 2, 3, 4], \"input_types\": [\"text\"]},"                  \
  "{\"type\": \"subagent\", \"t\": 3.0, \"agent_id\": \"a1\", "                \
  "\"subagent_type\": \"Explore\", \"system_tokens\": 4, \"tool_tokens\": 0, " \
  "\"requests\": [{\"t\": 1.0, \"type\": \"n\", \"in\": 8, \"out\": 1, "       \
  "\"hash_ids\": [50, 51]}]},"                                                 \
  "{\"t\": 10.0, \"type\": \"s\", \"in\": 17, \"out\": 2, \"think_time\": 2, " \
  "\"hash_ids\": [1, 2, 3, 4, 5], \"input_types\": [\"tool_result\"]}]}"

TEST(agentic_sessions) {
  bh_trace t;
  char err[512];
  ASSERT_OK(read_str(AGENTIC, strlen(AGENTIC), BH_FMT_AGENTIC, &quiet_stop, &t,
                     err, sizeof err));
  /* a second session file with the same local ids */
  bh_src *s;
  ASSERT_OK(bh_src_open_mem(AGENTIC, strlen(AGENTIC), "mem2", &s));
  ASSERT_OK(bh_read(s, BH_FMT_AGENTIC, &quiet_stop, &t, err, sizeof err));
  bh_src_close(s);
  ASSERT_EQ(t.n_reqs, 6u);
  ASSERT_EQ(t.block_size, 4u);
  ASSERT_OK(bh_trace_finish(&t));
  /* order: 0 (s1), 0 (s1'), sub at 3+1 twice, then 10 twice */
  ASSERT_DOUBLE_NEAR(t.reqs[2].t, 4.0, 1e-12);
  ASSERT_DOUBLE_NEAR(t.reqs[4].t, 10.0, 1e-12);
  ASSERT_STR_EQ(t.names[t.reqs[2].session], "s1/a1");
  /* shared namespace: (5 + 4) / 4 = 2 leading blocks equal across files,
   * block 2 onwards private to each file */
  const kvp_key *a = keys_of(&t, 0), *b = keys_of(&t, 1);
  ASSERT_KEY_EQ(a[0], b[0]);
  ASSERT_KEY_EQ(a[1], b[1]);
  ASSERT_FALSE(kvp_key_eq(a[2], b[2]));
  /* within a file the next turn extends the prefix */
  ASSERT_KEY_EQ(keys_of(&t, 4)[2], a[2]);
  /* marks: system [0,5) tools [5,9) history [9,13) tool output [13,17) */
  const bh_req *q = &t.reqs[4];
  ASSERT_EQ(q->n_marks, 4u);
  ASSERT_EQ(t.marks[q->mark_off + 3].offset, 13u);
  ASSERT_EQ(t.marks[q->mark_off + 3].role, KVP_ROLE_TOOL_OUTPUT);
  ASSERT_EQ(t.marks[q->mark_off + 2].role, KVP_ROLE_HISTORY);
  /* classification through the production classifier: marks decide.
   * Block 0 and 1 (tokens 0..8) are system/tools = stable; block 2 [8,12)
   * overlaps tools and history -> semi (least reusable) */
  ASSERT_EQ(q->stable_end, 2u);
  ASSERT_EQ(q->semi_end, 3u);
  bh_trace_free(&t);
  /* without the shared namespace nothing is shared across files */
  bh_read_opts o = quiet_stop;
  o.no_shared_prefix = true;
  ASSERT_OK(read_str(AGENTIC, strlen(AGENTIC), BH_FMT_AGENTIC, &o, &t, err,
                     sizeof err));
  ASSERT_OK(bh_src_open_mem(AGENTIC, strlen(AGENTIC), "mem2", &s));
  ASSERT_OK(bh_read(s, BH_FMT_AGENTIC, &o, &t, err, sizeof err));
  bh_src_close(s);
  ASSERT_FALSE(kvp_key_eq(keys_of(&t, 0)[0], keys_of(&t, 3)[0]));
  bh_trace_free(&t);
}

TEST(agentic_bad) {
  static const char *const fatal_docs[] = {
      "",
      "[]",
      "{\"block_size\": 4, \"requests\": {}}",
      "{\"block_size\": \"4\", \"requests\": []}",
      "{\"block_size\": 0, \"requests\": []}",
      "{\"block_size\": 4, \"hash_id_scope\": \"weird\", \"requests\": []}",
      "{\"block_size\": 4, \"requests\": [",
  };
  bh_trace t;
  char err[512];
  for (size_t i = 0; i < sizeof fatal_docs / sizeof *fatal_docs; i++) {
    ASSERT_LT(read_str(fatal_docs[i], strlen(fatal_docs[i]), BH_FMT_AGENTIC,
                       &quiet_skip, &t, err, sizeof err),
              0);
    ASSERT_TRUE(strncmp(err, "mem:", 4) == 0);
    bh_trace_free(&t);
  }
  /* bad records: skipped and counted, with their path */
  const char *doc =
      "{\"block_size\": 4, \"requests\": ["
      "{\"t\": 0, \"type\": \"n\", \"in\": 8, \"out\": 1, \"hash_ids\": [1]},"
      "{\"t\": \"x\", \"type\": \"n\", \"in\": 8, \"out\": 1, \"hash_ids\": []},"
      "{\"t\": 1, \"in\": 8, \"out\": 1, \"hash_ids\": []},"
      "{\"type\": \"subagent\", \"t\": 2, \"requests\": []},"
      "{\"type\": \"subagent\", \"t\": 2, \"agent_id\": \"a\", \"requests\": ["
      "{\"t\": 0, \"type\": \"n\", \"in\": 4, \"out\": 1, \"hash_ids\": [1, "
      "2, 3]}]}]}";
  ASSERT_OK(read_str(doc, strlen(doc), BH_FMT_AGENTIC, &quiet_skip, &t, err,
                     sizeof err));
  ASSERT_EQ(t.n_reqs, 1u);
  ASSERT_EQ(t.records_bad, 4u);
  ASSERT_TRUE(strstr(t.first_error, "requests[1]") != NULL);
  bh_trace_free(&t);
  ASSERT_ERR(read_str(doc, strlen(doc), BH_FMT_AGENTIC, &quiet_stop, &t, err,
                      sizeof err),
             KVP_ECORRUPT);
  ASSERT_TRUE(strstr(err, "mem:requests[1]: field 't'") != NULL);
  bh_trace_free(&t);
  /* a time past 1e9 s (its nanoseconds would not fit the simulator's clock;
   * found by fuzz_trace_agentic) is a bad record, in a sub-agent too */
  const char *far =
      "{\"block_size\": 4, \"requests\": ["
      "{\"t\": 0, \"type\": \"n\", \"in\": 8, \"out\": 1, \"hash_ids\": [1]},"
      "{\"type\": \"subagent\", \"t\": 3, \"agent_id\": \"a\", \"requests\": ["
      "{\"t\": 111111111111.0, \"type\": \"n\", \"in\": 4, \"out\": 1, "
      "\"hash_ids\": [1]}]}]}";
  ASSERT_ERR(read_str(far, strlen(far), BH_FMT_AGENTIC, &quiet_stop, &t, err,
                      sizeof err),
             KVP_ECORRUPT);
  ASSERT_TRUE(strstr(err, "field 't': expected a number in [0, 1e+09]") !=
              NULL);
  bh_trace_free(&t);
}

TEST(bailian_sessions) {
  const char *text =
      "{\"chat_id\": 10, \"parent_chat_id\": -1, \"timestamp\": 0.5, "
      "\"input_length\": 40, \"output_length\": 3, \"type\": \"text\", "
      "\"turn\": 1, \"hash_ids\": [7, 8, 9]}\n"
      "{\"chat_id\": 11, \"parent_chat_id\": 10, \"timestamp\": 2, "
      "\"input_length\": 70, \"output_length\": 3, \"type\": \"text\", "
      "\"turn\": 2, \"hash_ids\": [7, 8, 9, 12, 13]}\n"
      "{\"chat_id\": 20, \"parent_chat_id\": -1, \"timestamp\": 3, "
      "\"input_length\": 16, \"output_length\": 3, \"type\": 1, "
      "\"turn\": 1, \"hash_ids\": [7]}\n"
      "{\"chat_id\": 21, \"parent_chat_id\": \"x\", \"timestamp\": 3, "
      "\"input_length\": 16, \"output_length\": 3, \"hash_ids\": [7]}\n";
  bh_trace t;
  char err[512];
  ASSERT_OK(read_str(text, strlen(text), BH_FMT_BAILIAN, &quiet_skip, &t, err,
                     sizeof err));
  ASSERT_EQ(t.block_size, 16u);
  ASSERT_EQ(t.n_reqs, 3u);
  ASSERT_EQ(t.records_bad, 1u);
  ASSERT_TRUE(strncmp(t.first_error, "mem:4: field 'parent_chat_id'", 29) == 0);
  ASSERT_EQ(t.reqs[0].n_blocks, 2u); /* 40 tokens: 2 full blocks */
  ASSERT_EQ(t.reqs[1].n_blocks, 4u);
  ASSERT_EQ(t.reqs[0].session, t.reqs[1].session); /* child joins the root */
  ASSERT_NE(t.reqs[0].session, t.reqs[2].session);
  ASSERT_KEY_EQ(keys_of(&t, 0)[1], keys_of(&t, 1)[1]);
  bh_trace_free(&t);
}

TEST(kvplane_format_roundtrip) {
  const char *text =
      "{\"format\": \"kvplane-trace\", \"version\": 1, \"block_size\": 8}\n"
      "{\"t\": 0, \"in\": 20, \"out\": 4, \"tenant\": \"acme\", \"session\": "
      "\"s\\\"1\", \"segments\": [{\"offset\": 0, \"length\": 8, \"role\": "
      "\"system\"}, {\"offset\": 8, \"length\": 12, \"role\": \"user\", "
      "\"class\": \"semi\"}], \"hash_ids\": [3, 4]}\n"
      "{\"t\": 1.25, \"in\": 24, \"out\": 4, \"tenant\": \"acme\", "
      "\"session\": \"s\\\"1\", \"hash_ids\": [3, 4, 5]}\n";
  bh_trace t, u;
  char err[512];
  ASSERT_OK(read_str(text, strlen(text), BH_FMT_KVPLANE, &quiet_stop, &t, err,
                     sizeof err));
  ASSERT_EQ(t.n_reqs, 2u);
  ASSERT_EQ(t.reqs[0].n_marks, 2u);
  ASSERT_EQ(t.marks[1].class_hint, KVP_CLASS_SEMI);
  ASSERT_STR_EQ(t.names[t.reqs[0].tenant], "acme");
  ASSERT_STR_EQ(t.names[t.reqs[0].session], "s\"1");
  char *buf = NULL;
  size_t n = 0;
  FILE *m = open_memstream(&buf, &n);
  ASSERT_OK(bh_trace_write_kvplane(&t, m));
  fclose(m);
  ASSERT_OK(read_str(buf, n, BH_FMT_KVPLANE, &quiet_stop, &u, err, sizeof err));
  ASSERT_EQ(u.n_reqs, t.n_reqs);
  for (size_t i = 0; i < t.n_reqs; i++) {
    ASSERT_EQ(u.reqs[i].in_tokens, t.reqs[i].in_tokens);
    ASSERT_EQ(u.reqs[i].n_blocks, t.reqs[i].n_blocks);
    ASSERT_EQ(u.reqs[i].n_marks, t.reqs[i].n_marks);
    ASSERT_DOUBLE_NEAR(u.reqs[i].t, t.reqs[i].t, 1e-6);
  }
  /* the prefix structure survives (keys differ: ids are re-chained) */
  ASSERT_KEY_EQ(keys_of(&u, 0)[1], keys_of(&u, 1)[1]);
  ASSERT_STR_EQ(u.names[u.reqs[1].session], "s\"1");
  free(buf);
  bh_trace_free(&u);
  bh_trace_free(&t);
  /* header problems are fatal */
  static const char *const bad[] = {
      "{\"t\": 0, \"in\": 1, \"out\": 1, \"hash_ids\": []}\n",
      "{\"format\": \"kvplane-trace\", \"version\": 2, \"block_size\": 8}\n",
      "{\"format\": \"kvplane-trace\", \"version\": 1, \"block_size\": 0}\n",
      "\n\n",
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    ASSERT_LT(read_str(bad[i], strlen(bad[i]), BH_FMT_KVPLANE, &quiet_skip,
                       &t, err, sizeof err),
              0);
    ASSERT_TRUE(err[0] != '\0');
    bh_trace_free(&t);
  }
  /* a segment past the prompt, a bad role: record errors */
  const char *recs =
      "{\"format\": \"kvplane-trace\", \"version\": 1, \"block_size\": 8}\n"
      "{\"t\": 0, \"in\": 8, \"out\": 1, \"hash_ids\": [1], \"segments\": "
      "[{\"offset\": 4, \"length\": 8, \"role\": \"system\"}]}\n"
      "{\"t\": 0, \"in\": 8, \"out\": 1, \"hash_ids\": [1], \"segments\": "
      "[{\"offset\": 0, \"length\": 8, \"role\": \"boss\"}]}\n"
      "{\"t\": 0, \"in\": 8, \"out\": 1, \"hash_ids\": [1], \"tenant\": 5}\n";
  ASSERT_OK(read_str(recs, strlen(recs), BH_FMT_KVPLANE, &quiet_skip, &t, err,
                     sizeof err));
  ASSERT_EQ(t.n_reqs, 0u);
  ASSERT_EQ(t.records_bad, 3u);
  bh_trace_free(&t);
}

/* The bundled traces read whole, with the counts ../shared/README.md gives. */
TEST(bundled_traces) {
  char p[4096], err[512];
  bh_trace t;
  bh_trace_init(&t);
  kvt_shared_path("traces/mooncake_conversation.jsonl.zst", p, sizeof p);
  if (access(p, R_OK) != 0)
    KVT_SKIP_BECAUSE("%s not found", p);
  ASSERT_OK(bh_read_path(p, BH_FMT_AUTO, &quiet_stop, &t, err, sizeof err));
  ASSERT_EQ(t.n_reqs, 12031u);
  ASSERT_EQ(t.records_bad, 0u);
  bh_trace_free(&t);
  bh_trace_init(&t);
  kvt_shared_path("traces/cc_agentic", p, sizeof p);
  ASSERT_OK(bh_read_path(p, BH_FMT_AUTO, &quiet_stop, &t, err, sizeof err));
  ASSERT_EQ(t.sources, 37u);
  ASSERT_EQ(t.n_reqs, 3244u); /* parents and sub-agents, all turns */
  ASSERT_EQ(t.block_size, 64u);
  bh_trace_free(&t);
}

/* The generator is deterministic by seed and its output reads back. */
TEST(generator) {
  bh_gen_opts o = {.seed = 42, .sessions = 6, .drift = 0.1, .subagent_p = 0.3};
  char *a = NULL, *b = NULL, err[512];
  size_t na = 0, nb = 0;
  FILE *m = open_memstream(&a, &na);
  ASSERT_OK(bh_gen(&o, m));
  fclose(m);
  m = open_memstream(&b, &nb);
  ASSERT_OK(bh_gen(&o, m));
  fclose(m);
  ASSERT_EQ(na, nb);
  ASSERT_MEM_EQ(a, b, na);
  bh_trace t;
  ASSERT_OK(read_str(a, na, BH_FMT_KVPLANE, &quiet_stop, &t, err, sizeof err));
  ASSERT_GT(t.n_reqs, 6u);
  ASSERT_EQ(t.records_bad, 0u);
  ASSERT_OK(bh_trace_finish(&t));
  /* marks present: the shared system+tools blocks are stable */
  ASSERT_EQ(t.reqs[0].stable_end, (3000u + 12000u) / 64u);
  bh_trace_free(&t);
  free(a);
  free(b);
}

/* bh_trace_finish numbers the distinct keys: equal numbers exactly where
 * the keys are equal, 0..n_kids-1 in order of first arrival; checked by
 * sorting every (key, number) pair, on sessions whose prompts drift (the
 * shared prefix with the last turn ends early), sub-agents and a Mooncake
 * trace without sessions. */
typedef struct key_num {
  kvp_key k;
  uint32_t id;
} key_num;

static int key_num_cmp(const void *a, const void *b) {
  const key_num *x = a, *y = b;
  if (x->k.hi != y->k.hi)
    return x->k.hi < y->k.hi ? -1 : 1;
  if (x->k.lo != y->k.lo)
    return x->k.lo < y->k.lo ? -1 : 1;
  return 0;
}

/* The prompts' blocks: t->n_keys counts the keys stored, which requests
 * that extend the last one added share. */
static size_t all_blocks(const bh_trace *t) {
  size_t n = 0;
  for (size_t i = 0; i < t->n_reqs; i++)
    n += t->reqs[i].n_blocks;
  return n;
}

static void check_key_numbers(const bh_trace *t) {
  ASSERT_TRUE(t->kid != NULL);
  key_num *v = malloc((all_blocks(t) + 1) * sizeof *v);
  ASSERT_TRUE(v != NULL);
  size_t n = 0;
  uint32_t next = 0;
  for (size_t i = 0; i < t->n_reqs; i++) /* arrival order */
    for (uint32_t j = 0; j < t->reqs[i].n_blocks; j++) {
      uint32_t id = t->kid[t->reqs[i].key_off + j];
      ASSERT_LE(id, next); /* a new number is the next one */
      next += id == next;
      v[n++] = (key_num){keys_of(t, i)[j], id};
    }
  ASSERT_EQ((size_t)next, t->n_kids);
  qsort(v, n, sizeof *v, key_num_cmp);
  size_t distinct = 0;
  for (size_t i = 0; i < n; i++) {
    bool same = i > 0 && kvp_key_eq(v[i].k, v[i - 1].k);
    distinct += !same;
    if (same)
      ASSERT_EQ(v[i].id, v[i - 1].id);
  }
  ASSERT_EQ(distinct, t->n_kids); /* so different keys, different numbers */
  free(v);
}

TEST(key_numbers) {
  bh_gen_opts o = {.seed = 7, .sessions = 12, .drift = 0.3, .subagent_p = 0.3};
  char *a = NULL, err[512];
  size_t na = 0;
  FILE *m = open_memstream(&a, &na);
  ASSERT_OK(bh_gen(&o, m));
  fclose(m);
  bh_trace t;
  ASSERT_OK(read_str(a, na, BH_FMT_KVPLANE, &quiet_stop, &t, err, sizeof err));
  ASSERT_OK(bh_trace_finish(&t));
  ASSERT_GT(t.n_kids, 100u);
  ASSERT_LT(t.n_kids, all_blocks(&t)); /* turns share blocks */
  check_key_numbers(&t);
  bh_trace_free(&t);
  free(a);
  ASSERT_OK(read_str(MOON_GOOD, strlen(MOON_GOOD), BH_FMT_MOONCAKE,
                     &quiet_stop, &t, err, sizeof err));
  ASSERT_OK(bh_trace_finish(&t));
  /* full blocks [1 2], [1 2] and [1]: the keys of 1 and of 1 2 */
  ASSERT_EQ(t.n_kids, 2u);
  ASSERT_EQ(t.kid[t.reqs[1].key_off + 1], 1u);
  ASSERT_EQ(t.kid[t.reqs[2].key_off], 0u);
  check_key_numbers(&t);
  bh_trace_free(&t);
}

/* keys[0..n) of ids chained from block size bs's seed, computed apart: a
 * trace of that one request. */
static void keys_alone(uint32_t bs, const uint64_t *ids, size_t n,
                       kvp_key *out) {
  bh_trace u;
  bh_trace_init(&u);
  u.block_size = bs;
  bh_req r = {0};
  ASSERT_OK(bh_trace_add(&u, &r, ids, n, NULL, 0));
  ASSERT_EQ(u.n_keys, n);
  memcpy(out, u.keys, n * sizeof *out);
  bh_trace_free(&u);
}

/* A request that starts with every block of the last one added shares its
 * keys (same key_off, only the new blocks stored); any other is stored
 * apart; either way each request's keys are its own chain's. */
TEST(shared_keys) {
  static const uint64_t a[] = {1, 2, 3}, b[] = {1, 2, 3, 4, 5},
                        c[] = {1, 2, 9}, e[] = {7},
                        g[] = {1, 2, 3, 4, 5, 6};
  const struct {
    const uint64_t *ids;
    size_t n;
    uint32_t bs;
  } q[] = {{a, 3, 16}, {b, 5, 16}, {c, 3, 16}, {c, 3, 16},
           {e, 1, 16}, {b, 5, 16}, {b, 2, 16}, {g, 6, 32}};
  /* b extends a; c diverges at its third block; c again extends c whole;
   * e and b start over; b's first 2 blocks are a prefix of b but not all
   * of it; g extends b's first 2 blocks under another block size */
  const uint64_t off[] = {0, 0, 5, 5, 8, 9, 14, 16}, stored = 22;
  bh_trace t;
  bh_trace_init(&t);
  for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
    t.block_size = q[i].bs;
    bh_req r = {.session = 0};
    ASSERT_OK(bh_trace_add(&t, &r, q[i].ids, q[i].n, NULL, 0));
  }
  ASSERT_EQ(t.n_keys, stored);
  for (size_t i = 0; i < sizeof q / sizeof q[0]; i++) {
    kvp_key want[8];
    ASSERT_EQ(t.reqs[i].key_off, off[i]);
    ASSERT_EQ(t.reqs[i].n_blocks, q[i].n);
    keys_alone(q[i].bs, q[i].ids, q[i].n, want);
    for (size_t j = 0; j < q[i].n; j++)
      ASSERT_KEY_EQ(keys_of(&t, i)[j], want[j]);
  }
  ASSERT_OK(bh_trace_finish(&t));
  /* distinct: 1 .. 1-5 (5), 1 2 9 (1), 7 (1), the 32-token chain (6) */
  ASSERT_EQ(t.n_kids, 13u);
  check_key_numbers(&t);
  bh_trace_free(&t);
}

TEST_MAIN(TEST_ENTRY(mooncake_good), TEST_ENTRY(mooncake_bad_records),
          TEST_ENTRY(mooncake_ids_cover_prompt),
          TEST_ENTRY(zstd_transparent_and_truncated),
          TEST_ENTRY(agentic_sessions), TEST_ENTRY(agentic_bad),
          TEST_ENTRY(bailian_sessions), TEST_ENTRY(kvplane_format_roundtrip),
          TEST_ENTRY(generator), TEST_ENTRY(key_numbers),
          TEST_ENTRY(shared_keys), TEST_ENTRY(bundled_traces))
