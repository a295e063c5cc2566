/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd's request parser (connectors/routerd/rd_req.c): the
 * token-id fast path (a top-level "prompt": [ids] read from the bytes, the
 * rest through jansson) must read what jansson reads and reject what
 * jansson rejects -- fixed cases, seeded random bodies and mutations of
 * them, each checked against jansson's own view of the body. */
#include <jansson.h>

#include "rd_idx_req.h"
#include "rd_prom.h"
#include "rd_req.h"
#include "test_harness.h"

static int parse(const char *body, rd_req *r, rd_req_err *e) {
  return rd_req_parse(RD_COMPLETIONS, body, strlen(body), r, e);
}

static void expect_ids(const char *body, const uint32_t *ids, size_t n) {
  rd_req r;
  rd_req_err e;
  ASSERT_OK(parse(body, &r, &e));
  ASSERT_EQ(r.n_tokens, n);
  ASSERT_NOT_NULL(r.tokens);
  ASSERT_MEM_EQ(r.tokens, ids, n * sizeof *ids);
  rd_req_free(&r);
}

static void expect_reject(const char *body, const char *param) {
  rd_req r;
  rd_req_err e = {0};
  ASSERT_EQ(parse(body, &r, &e), -1);
  ASSERT_EQ(e.status, 400);
  ASSERT_NULL(r.tokens);
  if (param)
    ASSERT_STR_EQ(e.param, param);
}

TEST(fast_path_reads_ids) {
  static const uint32_t a[] = {1, 2, 3}, big[] = {0, 2147483647};
  static const uint32_t seven[] = {7, 8}, batch[] = {1, 2};
  expect_ids("{\"prompt\":[1,2,3]}", a, 3);
  expect_ids(" {\n \"model\" : \"m\" ,\t\"prompt\" : [ 1 ,2 , 3 ] , "
             "\"max_tokens\":1}\r\n", a, 3);
  expect_ids("{\"prompt\":[0,2147483647]}", big, 2);
  /* "prompt" inside a string or a nested object is not the prompt */
  expect_ids("{\"a\":\"\\\"prompt\\\":[5]\",\"x\":{\"prompt\":[5]},"
             "\"l\":[{\"prompt\":[5]}],\"prompt\":[7,8]}", seven, 2);
  expect_ids("{\"prompt\":[[1,2],[3]]}", batch, 2); /* a batch: jansson's */
  rd_req r;
  rd_req_err e;
  ASSERT_OK(parse("{\"stream\":true,\"model\":\"m1\",\"user\":\"u\","
                  "\"prompt\":[4],\"cache_salt\":\"s\"}", &r, &e));
  ASSERT_TRUE(r.stream);
  ASSERT_STR_EQ(r.model, "m1");
  ASSERT_STR_EQ(r.user, "u");
  ASSERT_STR_EQ(r.cache_salt, "s");
  ASSERT_EQ(r.n_tokens, 1u);
  rd_req_free(&r);
}

TEST(fast_path_rejects_as_jansson) {
  expect_reject("{\"prompt\":[1,2],\"prompt\":[3]}", NULL); /* duplicate */
  expect_reject("{\"prompt\":[1,-2]}", "prompt");
  expect_reject("{\"prompt\":[2147483648]}", "prompt");
  expect_reject("{\"prompt\":[1.0]}", "prompt");
  expect_reject("{\"prompt\":[1e2]}", "prompt");
  expect_reject("{\"prompt\":[]}", "prompt");
  expect_reject("{\"prompt\":[01,2]}", NULL);  /* not JSON */
  expect_reject("{\"prompt\":[1,]}", NULL);
  expect_reject("{\"prompt\":[1,2]", NULL);
  expect_reject("{\"prompt\":[1,2]}x", NULL);
  expect_reject("{\"prompt\":[1,2].5}", NULL); /* the splice must not */
  expect_reject("{\"prompt\":[1,2]e5}", NULL); /* make a number of it */
  expect_reject("{\"prompt\":[1,2]0}", NULL);
  expect_reject("{\"prompt\":[1,2]l}", NULL);
  expect_reject("{\"a\":tru,\"prompt\":[1]}", NULL);
  expect_reject("{\"prompt\":[1],\"stream\":\"yes\"}", "stream");
  expect_reject("{\"x\":{\"prompt\":[5]}}", "prompt"); /* none at the top */
}

/* jansson 2.14 takes a NUL right after a number; the router never does
 * (fuzz_routerd_req found the fast path and the salt splice disagreeing) */
TEST(nul_bytes_rejected) {
  static const char a[] = "{\"prompt\":[0,2]\0,\"max_tokens\":4}";
  static const char b[] = "{\"prompt\":\"hi\",\"max_tokens\":4\0}";
  static const char c[] = "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                          "\"n\":1\0}";
  rd_req r;
  rd_req_err e = {0};
  ASSERT_EQ(rd_req_parse(RD_COMPLETIONS, a, sizeof a - 1, &r, &e), -1);
  ASSERT_EQ(e.status, 400);
  ASSERT_NULL(r.tokens);
  ASSERT_EQ(rd_req_parse(RD_COMPLETIONS, b, sizeof b - 1, &r, &e), -1);
  ASSERT_NULL(r.text);
  ASSERT_EQ(rd_req_parse(RD_CHAT, c, sizeof c - 1, &r, &e), -1);
  ASSERT_EQ(e.status, 400);
  ASSERT_NOT_NULL(strstr(e.message, "NUL"));
}

/* ---- random bodies against jansson ----------------------------------------- */
static const char *const k_noise[] = {
    "\"prompt\"", "\"\\\"prompt\\\":[1]\"", "{\"prompt\":[9,9]}", "[1,[2,{}]]",
    "\"a\\\\\"", "null", "true", "-1.5e3", "{}", "[]", "\"\\u0041}\""};

static size_t put_ws(char *p) {
  static const char ws[] = " \t\n\r";
  size_t n = kvt_rand_below(3);
  for (size_t i = 0; i < n; i++)
    p[i] = ws[kvt_rand_below(4)];
  return n;
}

/* a body with noise fields around a token-id prompt, random whitespace */
static size_t gen_body(char *b, uint32_t *ids, size_t *n_ids) {
  size_t n = 0, fields = kvt_rand_below(4), at = kvt_rand_below(fields + 1);
  n += put_ws(b + n);
  b[n++] = '{';
  for (size_t f = 0; f <= fields; f++) {
    n += put_ws(b + n);
    if (f == at) {
      n += (size_t)sprintf(b + n, "\"prompt\"%s:[", kvt_rand_below(2) ? " " : "");
      *n_ids = 1 + kvt_rand_below(40);
      for (size_t i = 0; i < *n_ids; i++) {
        ids[i] = (uint32_t)kvt_rand_below(kvt_rand_below(2) ? 10 : 1u << 31);
        n += put_ws(b + n);
        n += (size_t)sprintf(b + n, "%s%u", i ? "," : "", ids[i]);
      }
      n += put_ws(b + n);
      b[n++] = ']';
    } else
      n += (size_t)sprintf(b + n, "\"k%zu\":%s", f,
                           k_noise[kvt_rand_below(sizeof k_noise / sizeof *k_noise)]);
    n += put_ws(b + n);
    b[n++] = f < fields ? ',' : '}';
  }
  b[n] = '\0';
  return n;
}

/* jansson's view: the top-level prompt's ids, or -1 when the body is not a
 * JSON object with such a prompt */
static int reference(const char *b, size_t n, uint32_t *ids, size_t *n_ids) {
  json_t *o = json_loadb(b, n, JSON_REJECT_DUPLICATES, NULL);
  json_t *p = json_object_get(o, "prompt");
  int rc = json_is_object(o) && json_is_array(p) && json_array_size(p) > 0 ? 0 : -1;
  for (size_t i = 0; rc == 0 && i < json_array_size(p); i++) {
    json_t *v = json_array_get(p, i);
    if (!json_is_integer(v) || json_integer_value(v) < 0 ||
        json_integer_value(v) > INT32_MAX)
      rc = -1;
    else
      ids[i] = (uint32_t)json_integer_value(v);
  }
  *n_ids = rc == 0 ? json_array_size(p) : 0;
  json_decref(o);
  return rc;
}

/* a body the parser took: the salt spliced in reads back (jansson) as the
 * same object with cache_salt set to it */
static void check_splice(const char *b, size_t n) {
  size_t out_n = 0;
  char *s = rd_req_with_salt(b, n, "kvp1-Zz_9", &out_n);
  ASSERT_NOT_NULL(s);
  json_t *a = json_loadb(b, n, 0, NULL), *o = json_loadb(s, out_n, 0, NULL);
  ASSERT_NOT_NULL(a);
  ASSERT_NOT_NULL(o);
  ASSERT_STR_EQ(json_string_value(json_object_get(o, "cache_salt")), "kvp1-Zz_9");
  json_object_del(a, "cache_salt");
  json_object_del(o, "cache_salt");
  ASSERT_TRUE(json_equal(a, o));
  json_decref(a);
  json_decref(o);
  free(s);
}

static void check_against_jansson(const char *b, size_t n) {
  uint32_t want[256];
  size_t n_want = 0;
  rd_req r;
  rd_req_err e;
  int ref = reference(b, n, want, &n_want);
  int rc = rd_req_parse(RD_COMPLETIONS, b, n, &r, &e);
  if (ref < 0) { /* jansson rejects it, or its prompt is no id list */
    ASSERT_TRUE(rc < 0 || r.tokens == NULL);
  } else {
    ASSERT_OK(rc);
    ASSERT_EQ(r.n_tokens, n_want);
    ASSERT_MEM_EQ(r.tokens, want, n_want * sizeof *want);
  }
  if (rc == 0) {
    check_splice(b, n);
    rd_req_free(&r);
  }
}

TEST(random_bodies_match_jansson) {
  static char b[8192];
  uint32_t ids[64];
  size_t n_ids = 0, took = 0;
  for (int it = 0; it < 20000; it++) {
    size_t n = gen_body(b, ids, &n_ids);
    uint32_t want[256];
    size_t n_want;
    took += reference(b, n, want, &n_want) == 0;
    check_against_jansson(b, n);
    for (int m = 0; m < 4; m++) { /* one byte changed, or the body cut */
      char save = b[0];
      size_t at = kvt_rand_below(n);
      static const char alpha[] = "{}[],:\" \\0123-.e";
      save = b[at];
      b[at] = alpha[kvt_rand_below(sizeof alpha - 1)];
      check_against_jansson(b, n);
      check_against_jansson(b, at);
      b[at] = save;
    }
  }
  ASSERT_GT(took, 19000u); /* the generator makes valid bodies */
}

/* ---- the wide id scan against the byte scan and jansson --------------------
 * Long arrays (the 64-byte scan needs 80 bytes ahead) with every separator
 * JSON allows, ids of 1-11 digits, and now and then a leading zero, an id
 * past 2^31 (in about one body in four), a stray byte or a cut: both scans give jansson's answer. */
static size_t gen_long(char *b, size_t cap, size_t *n_ids, bool *plain) {
  static const char *const sep[] = {",", ",", ",", ", ", " , ", ",\n  ",
                                    ",\t"};
  size_t n = (size_t)sprintf(b, "{\"model\":\"m\",\"prompt\":[");
  size_t ids = 1 + kvt_rand_below(kvt_rand_below(2) ? 64 : 3000);
  unsigned style = (unsigned)kvt_rand_below(3); /* 0: ",", 1: mixed, 2: ", " */
  *plain = true;
  for (size_t i = 0; i < ids && n + 64 < cap; i++) {
    if (i > 0) {
      const char *s = style == 0 ? ","
                      : style == 2 ? ", "
                                   : sep[kvt_rand_below(7)];
      n += (size_t)sprintf(b + n, "%s", s);
    }
    uint64_t v = kvt_rand_below(5) == 0 ? kvt_rand_below(10)
                                        : kvt_rand_below(200000);
    if (kvt_rand_below(ids * 6) == 0) /* ~1 body in 6 has one */
      v = (uint64_t)INT32_MAX + kvt_rand_below(3) - 1; /* 2^31 - 2 .. 2^31 */
    if (kvt_rand_below(ids * 12) == 0)
      v = 10000000000ull + kvt_rand_below(1000); /* 11 digits */
    if (kvt_rand_below(ids * 12) == 0)
      b[n++] = '0', *plain = false; /* a leading zero */
    n += (size_t)sprintf(b + n, "%llu", (unsigned long long)v);
    *plain = *plain && v <= INT32_MAX;
  }
  n += (size_t)sprintf(b + n, "]%s,\"max_tokens\":1}",
                       kvt_rand_below(2) ? " " : "");
  *n_ids = ids;
  return n;
}

static void parse_both(const char *b, size_t n) {
  rd_req r1, r2;
  rd_req_err e1, e2;
  rd_req_wide_scan = true;
  int a = rd_req_parse(RD_COMPLETIONS, b, n, &r1, &e1);
  rd_req_wide_scan = false;
  int c = rd_req_parse(RD_COMPLETIONS, b, n, &r2, &e2);
  rd_req_wide_scan = true;
  ASSERT_EQ(a, c);
  if (a == 0) {
    ASSERT_EQ(r1.n_tokens, r2.n_tokens);
    ASSERT_EQ(r1.tokens == NULL, r2.tokens == NULL);
    if (r1.tokens)
      ASSERT_MEM_EQ(r1.tokens, r2.tokens, r1.n_tokens * sizeof *r1.tokens);
    rd_req_free(&r1);
    rd_req_free(&r2);
  }
}

TEST(wide_scan_matches_byte_scan) {
  static char b[64 << 10];
  static uint32_t t[64 << 10], want[64 << 10];
  size_t plain_n = 0;
  for (int it = 0; it < 3000; it++) {
    size_t n_ids, nw = 0;
    bool plain;
    size_t n = gen_long(b, sizeof b - 64, &n_ids, &plain);
    /* jansson's ids; then the wide scan alone from the first id */
    json_t *o = json_loadb(b, n, 0, NULL), *p = json_object_get(o, "prompt");
    if (plain)
      ASSERT_NOT_NULL(o);
    for (size_t i = 0; plain && i < json_array_size(p); i++)
      want[nw++] = (uint32_t)json_integer_value(json_array_get(p, i));
    json_decref(o);
    size_t at = (size_t)(strchr(b, '[') - b) + 1, k = 0, end = 0;
    size_t go = rd_ids_wide(b, at, n, t, &k, sizeof t / sizeof *t, &end);
    if (plain) { /* what it read is jansson's, and it read all but the tail
                    (the 64-byte scan stops 80 bytes before the end) */
      ASSERT_TRUE(end != 0 || go != 0);
      ASSERT_TRUE(end != 0 ? k == nw : k <= nw);
      ASSERT_MEM_EQ(t, want, k * sizeof *t);
      if (end != 0)
        ASSERT_EQ(b[end - 1], ']');
      ASSERT_TRUE(end != 0 || go + 100 >= n);
      plain_n += n_ids > 64;
    }
    parse_both(b, n);
    for (int m = 0; m < 3; m++) { /* a stray byte, or the body cut */
      static const char alpha[] = "{}[],:\" \\0123-.e\n";
      size_t pos = kvt_rand_below(n);
      char save = b[pos];
      b[pos] = alpha[kvt_rand_below(sizeof alpha - 1)];
      parse_both(b, n);
      b[pos] = save;
      parse_both(b, pos);
    }
  }
  ASSERT_GT(plain_n, 500u); /* the generator makes long plain arrays */
}

/* The derived cache salt: no client-chosen (tenant, salt) pair collides
 * with another, none names another tenant's salt, and every salt is made
 * of the characters vLLM takes, at most 128 of them. */
static void salt_of(const unsigned char *key, const char *t, const char *s,
                    char *out) {
  ASSERT_TRUE(rd_salt_for(key, t, s, out, RD_SALT_MAX) >= 0);
}

static bool vllm_ok(const char *s) {
  size_t n = strlen(s);
  return n > 0 && n <= 128 && strspn(s, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghij"
                                        "klmnopqrstuvwxyz0123456789_-") == n;
}

TEST(salt_cannot_collide_or_be_forged) {
  static const unsigned char k1[RD_SALT_KEY_LEN] = {1}, k2[RD_SALT_KEY_LEN] = {2};
  static const char *const pairs[][2] = {
      {"a|b", ""}, {"a", "b"}, {"a", "|b"}, {"", "kvplane-tenant:a|b"},
      {"", "a"}, {"a", ""}, {"t@x/y\\z", ""}, {"", "t@x/y\\z"}, {"ab", ""},
      {"a", "b\x01"}, {"a\x01", "b"}};
  size_t n = sizeof pairs / sizeof *pairs;
  char got[16][RD_SALT_MAX];
  for (size_t i = 0; i < n; i++) {
    salt_of(k1, pairs[i][0], pairs[i][1], got[i]);
    ASSERT_TRUE(vllm_ok(got[i]));
    for (size_t j = 0; j < i; j++)
      ASSERT_TRUE(strcmp(got[i], got[j]) != 0);
  }
  char again[RD_SALT_MAX], other[RD_SALT_MAX], none[RD_SALT_MAX];
  salt_of(k1, "a|b", "", again); /* deterministic for one key */
  ASSERT_STR_EQ(again, got[0]);
  salt_of(k2, "a|b", "", other); /* another router secret: another salt */
  ASSERT_TRUE(strcmp(other, got[0]) != 0);
  salt_of(k1, "", "", none); /* nothing to salt: no salt */
  ASSERT_STR_EQ(none, "");
  char longt[4096];
  memset(longt, 'x', sizeof longt - 1);
  longt[sizeof longt - 1] = '\0';
  salt_of(k1, longt, longt, again); /* any length: still 48 characters */
  ASSERT_TRUE(vllm_ok(again));
  ASSERT_EQ(rd_salt_for(k1, "a", "", again, 10), -1); /* too small: refused */
}

/* rd_req_with_salt splices: every byte but the salt's is the client's */
static void expect_splice(const char *in, const char *out) {
  size_t n = 0;
  char *s = rd_req_with_salt(in, strlen(in), "kvp1-X_y", &n);
  ASSERT_NOT_NULL(s);
  ASSERT_STR_EQ(s, out);
  ASSERT_EQ(n, strlen(out));
  free(s);
}

TEST(salt_spliced_not_reserialised) {
  expect_splice("{\"temperature\":0.10000000000000001,\"prompt\":[1,2]}",
                "{\"temperature\":0.10000000000000001,\"prompt\":[1,2],"
                "\"cache_salt\":\"kvp1-X_y\"}");
  expect_splice(" { \"cache_salt\" : \"mine\" , \"x\":1e-7 } ",
                " { \"cache_salt\" : \"kvp1-X_y\" , \"x\":1e-7 } ");
  expect_splice("{\"a\":{\"cache_salt\":\"inner\"},\"cache_salt\":null}",
                "{\"a\":{\"cache_salt\":\"inner\"},\"cache_salt\":\"kvp1-X_y\"}");
  expect_splice("{}", "{\"cache_salt\":\"kvp1-X_y\"}");
  /* an escaped spelling of the key: ours is appended last, JSON readers
   * (jansson, Python's json) keep the last */
  const char *esc = "{\"cache\\u005fsalt\":\"forged\"}";
  size_t n = 0;
  char *s = rd_req_with_salt(esc, strlen(esc), "kvp1-X_y", &n);
  ASSERT_NOT_NULL(s);
  json_t *o = json_loads(s, 0, NULL);
  ASSERT_STR_EQ(json_string_value(json_object_get(o, "cache_salt")), "kvp1-X_y");
  json_decref(o);
  free(s);
  ASSERT_NULL(rd_req_with_salt("[1]", 3, "kvp1-X_y", &n));
}

/* a worker's /metrics as vLLM 0.32 writes it: load, KV usage, and the KV
 * capacity from cache_config_info's labels (P/D's free-KV check) */
TEST(scrape_reads_vllm_metrics) {
  const char *t =
      "# HELP vllm:num_requests_running x\n"
      "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 2.0\n"
      "vllm:num_requests_running{engine=\"1\",model_name=\"m\"} 1.0\n"
      "vllm:num_requests_waiting{engine=\"0\"} 4\n"
      "vllm:kv_cache_usage_perc{engine=\"0\"} 0.25\n"
      "vllm:cache_config_info{block_size=\"32\",cache_dtype=\"auto\","
      "note=\"a \\\"quoted\\\" ,num_gpu_blocks=\\\"9\",num_cpu_blocks=\"None\","
      "num_gpu_blocks=\"72\"} 1.0\n";
  rd_scrape m;
  rd_scrape_parse(t, strlen(t), &m);
  ASSERT_TRUE(m.has_running && m.has_waiting && m.has_kv_use);
  ASSERT_DOUBLE_NEAR(m.running, 3.0, 0);
  ASSERT_DOUBLE_NEAR(m.waiting, 4.0, 0);
  ASSERT_DOUBLE_NEAR(m.kv_use, 0.25, 0);
  ASSERT_EQ(m.kv_cap_tokens, 72u * 32u); /* not the quoted label's 9 */
  static const char *const unknown[] = {
      "vllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"None\"} 1\n",
      "vllm:cache_config_info{block_size=\"32\"} 1\n",
      "vllm:cache_config_info{num_gpu_blocks=\"72\",block_size=\"-1\"} 1\n",
      "vllm:cache_config_info{num_gpu_blocks=\"1e20\",block_size=\"32\"} 1\n",
      "vllm:cache_config_info{num_gpu_blocks=72,block_size=\"32\"} 1\n",
      "vllm:cache_config_info{num_gpu_blocks=\"72",
      "vllm:cache_config_info_x{num_gpu_blocks=\"72\",block_size=\"32\"} 1\n"};
  for (size_t i = 0; i < sizeof unknown / sizeof *unknown; i++) {
    rd_scrape_parse(unknown[i], strlen(unknown[i]), &m);
    ASSERT_EQ(m.kv_cap_tokens, 0u);
    ASSERT_FALSE(m.has_running);
  }
  /* +Inf and -Inf would sum to NaN: values that are not finite are skipped */
  const char *inf = "vllm:num_requests_running +Inf\nvllm:num_requests_running -Inf\n"
                    "vllm:num_requests_running 2\nvllm:kv_cache_usage_perc NaN\n";
  rd_scrape_parse(inf, strlen(inf), &m);
  ASSERT_TRUE(m.has_running && !m.has_kv_use);
  ASSERT_DOUBLE_NEAR(m.running, 2.0, 0);
  /* the length bounds the read: the same text cut before the labels */
  rd_scrape_parse(t, strlen(t) - 20, &m);
  ASSERT_EQ(m.kv_cap_tokens, 0u);
  ASSERT_TRUE(m.has_running);
}

TEST_MAIN(TEST_ENTRY(salt_cannot_collide_or_be_forged),
          TEST_ENTRY(salt_spliced_not_reserialised),
          TEST_ENTRY(fast_path_reads_ids), TEST_ENTRY(fast_path_rejects_as_jansson),
          TEST_ENTRY(random_bodies_match_jansson), TEST_ENTRY(nul_bytes_rejected),
          TEST_ENTRY(wide_scan_matches_byte_scan),
          TEST_ENTRY(scrape_reads_vllm_metrics))
