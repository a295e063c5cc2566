/* SPDX-License-Identifier: Apache-2.0 */
/* core/text (kvplane/text.h) and the shared names (kvplane/common.h):
 * escaping, numbers, snprintf semantics, chunked writers, kvp_id64. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvplane.h"
#include "test_harness.h"

/* The JSON text of one string. */
static const char *json_of(const char *s, char *buf, size_t cap) {
  kvp_text t;
  kvp_text_init(&t, buf, cap);
  kvp_text_json_str(&t, s);
  ASSERT_LT(kvp_text_len(&t), cap);
  return buf;
}

TEST(json_escapes_controls_and_quotes) {
  char b[256];
  ASSERT_STR_EQ(json_of("plain", b, sizeof b), "\"plain\"");
  ASSERT_STR_EQ(json_of("", b, sizeof b), "\"\"");
  ASSERT_STR_EQ(json_of(NULL, b, sizeof b), "null");
  ASSERT_STR_EQ(json_of("a\"b\\c", b, sizeof b), "\"a\\\"b\\\\c\"");
  ASSERT_STR_EQ(json_of("\n\r\t", b, sizeof b), "\"\\n\\r\\t\"");
  /* every other control and DEL as \u00XX (\b and \f included) */
  ASSERT_STR_EQ(json_of("\x01\x08\x0c\x1f\x7f", b, sizeof b),
                "\"\\u0001\\u0008\\u000c\\u001f\\u007f\"");
  ASSERT_STR_EQ(json_of("/<>'", b, sizeof b), "\"/<>'\"");
}

TEST(json_utf8_kept_invalid_replaced) {
  char b[256];
  /* valid 2, 3 and 4 byte sequences pass through unchanged */
  ASSERT_STR_EQ(
      json_of("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", b, sizeof b),
      "\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"");
  /* a lone continuation, an overlong, a surrogate, > U+10FFFF, a truncated
   * sequence at the end: each bad byte is U+FFFD */
  ASSERT_STR_EQ(json_of("a\x80z", b, sizeof b), "\"a\\ufffdz\"");
  ASSERT_STR_EQ(json_of("\xc0\xaf", b, sizeof b), "\"\\ufffd\\ufffd\"");
  ASSERT_STR_EQ(json_of("\xed\xa0\x80", b, sizeof b),
                "\"\\ufffd\\ufffd\\ufffd\"");
  ASSERT_STR_EQ(json_of("\xf4\x90\x80\x80", b, sizeof b),
                "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");
  ASSERT_STR_EQ(json_of("x\xe2\x82", b, sizeof b), "\"x\\ufffd\\ufffd\"");
}

static const char *num_of(double v, int json, char *buf, size_t cap) {
  kvp_text t;
  kvp_text_init(&t, buf, cap);
  if (json)
    kvp_text_json_num(&t, v);
  else
    kvp_text_prom_num(&t, v);
  return buf;
}

TEST(numbers_round_trip_and_non_finite) {
  char b[64];
  ASSERT_STR_EQ(num_of(0.5, 1, b, sizeof b), "0.5");
  ASSERT_STR_EQ(num_of(0.1, 1, b, sizeof b), "0.1"); /* %.15g suffices */
  ASSERT_STR_EQ(num_of(1e300, 1, b, sizeof b), "1e+300");
  ASSERT_STR_EQ(num_of(-0.0, 1, b, sizeof b), "-0");
  ASSERT_STR_EQ(num_of(NAN, 1, b, sizeof b), "null");
  ASSERT_STR_EQ(num_of(INFINITY, 1, b, sizeof b), "null");
  ASSERT_STR_EQ(num_of(-INFINITY, 1, b, sizeof b), "null");
  ASSERT_STR_EQ(num_of(NAN, 0, b, sizeof b), "NaN");
  ASSERT_STR_EQ(num_of(INFINITY, 0, b, sizeof b), "+Inf");
  ASSERT_STR_EQ(num_of(-INFINITY, 0, b, sizeof b), "-Inf");
  for (int i = 0; i < 1000; i++) { /* every finite value reads back exactly */
    uint64_t bits = kvt_rand();
    double v;
    memcpy(&v, &bits, sizeof v);
    if (!isfinite(v))
      continue;
    ASSERT_TRUE(strtod(num_of(v, 1, b, sizeof b), NULL) == v);
  }
  kvp_text t;
  kvp_text_init(&t, b, sizeof b);
  kvp_text_u64(&t, 0), kvp_text_puts(&t, " ");
  kvp_text_u64(&t, UINT64_MAX);
  ASSERT_STR_EQ(b, "0 18446744073709551615");
}

TEST(prom_label_escaping) {
  char b[64];
  kvp_text t;
  kvp_text_init(&t, b, sizeof b);
  kvp_text_prom_label(&t, "a\\b\"c\nd\t\xc3\xa9");
  ASSERT_STR_EQ(b, "a\\\\b\\\"c\\nd\t\xc3\xa9");
}

/* snprintf semantics: truncated output is a prefix of the full text, always
 * NUL-terminated, and the length is the full one. */
TEST(buffer_snprintf_semantics) {
  char full[128], small[8];
  kvp_text t;
  kvp_text_init(&t, full, sizeof full);
  kvp_text_printf(&t, "%s=%d;", "alpha", 42);
  kvp_text_json_str(&t, "q\"");
  size_t n = kvp_text_len(&t);
  ASSERT_STR_EQ(full, "alpha=42;\"q\\\"\"");
  ASSERT_EQ(n, strlen(full));
  for (size_t cap = 0; cap <= sizeof small; cap++) {
    memset(small, 'X', sizeof small);
    kvp_text_init(&t, cap ? small : NULL, cap);
    kvp_text_printf(&t, "%s=%d;", "alpha", 42);
    kvp_text_json_str(&t, "q\"");
    ASSERT_EQ(kvp_text_len(&t), n);
    if (cap > 0) {
      ASSERT_EQ(strlen(small), cap - 1);
      ASSERT_MEM_EQ(small, full, cap - 1);
    }
  }
  /* a printf longer than any internal scratch buffer */
  static char big[2048];
  kvp_text_init(&t, big, sizeof big);
  kvp_text_printf(&t, "%1000s|%600s", "x", "y");
  ASSERT_EQ(kvp_text_len(&t), 1601u);
  ASSERT_EQ(big[999], 'x');
  ASSERT_EQ(big[1600], 'y');
}

typedef struct sink {
  char buf[4096];
  size_t len;
  int calls, fail_at;
} sink;

static int sink_write(void *opaque, const char *d, size_t n) {
  sink *s = opaque;
  if (++s->calls == s->fail_at)
    return KVP_EIO;
  ASSERT_LE(s->len + n, sizeof s->buf);
  memcpy(s->buf + s->len, d, n);
  s->len += n;
  return 0;
}

TEST(writer_chunks_and_stops_on_error) {
  char chunk[7];
  sink s = {{0}, 0, 0, 0};
  kvp_text t;
  kvp_text_init_writer(&t, sink_write, &s, chunk, sizeof chunk);
  for (int i = 0; i < 50; i++)
    kvp_text_printf(&t, "%d,", i);
  kvp_text_printf(&t, "%1000s", "!"); /* longer than the stack scratch */
  ASSERT_OK(kvp_text_flush(&t));
  ASSERT_EQ(kvp_text_len(&t), s.len);
  ASSERT_EQ(strncmp(s.buf, "0,1,2,3,", 8), 0);
  ASSERT_EQ(s.buf[s.len - 1], '!');
  ASSERT_GT(s.calls, 20); /* 7-byte chunks: many calls */

  sink f = {{0}, 0, 0, 3};
  kvp_text_init_writer(&t, sink_write, &f, chunk, sizeof chunk);
  for (int i = 0; i < 50; i++)
    kvp_text_puts(&t, "abcdef");
  ASSERT_ERR(kvp_text_flush(&t), KVP_EIO);
  ASSERT_EQ(f.calls, 3); /* nothing after the failing call */
  ASSERT_EQ(f.len, 2 * sizeof chunk);
}

TEST(shared_names_and_ids) {
  kvp_tier t;
  kvp_class c;
  for (int i = 0; i < KVP_TIER_COUNT_; i++) {
    ASSERT_OK(kvp_tier_parse(kvp_tier_name((kvp_tier)i), &t));
    ASSERT_EQ((int)t, i);
  }
  for (int i = 0; i < KVP_CLASS_COUNT_; i++) {
    ASSERT_OK(kvp_class_parse(kvp_class_name((kvp_class)i), &c));
    ASSERT_EQ((int)c, i);
  }
  ASSERT_STR_EQ(kvp_tier_name(KVP_TIER_NVME), "nvme");
  ASSERT_STR_EQ(kvp_tier_label(KVP_TIER_NVME), "NVMe");
  ASSERT_STR_EQ(kvp_tier_name(KVP_TIER_COUNT_), "unknown");
  ASSERT_STR_EQ(kvp_class_name(KVP_CLASS_SEMI), "semi");
  ASSERT_STR_EQ(kvp_class_name(KVP_CLASS_AUTO), "auto");
  ASSERT_STR_EQ(kvp_class_name((kvp_class)7), "unknown");
  ASSERT_ERR(kvp_tier_parse("HBM", &t), KVP_EINVAL); /* names are exact */
  ASSERT_ERR(kvp_class_parse("auto", &c), KVP_EINVAL);
  ASSERT_ERR(kvp_class_parse(NULL, &c), KVP_EINVAL);
  /* kvp_id64: fixed forever (golden values), 0 only for "none" */
  ASSERT_EQ(kvp_id64(NULL), 0u);
  ASSERT_EQ(kvp_id64(""), 0u);
  ASSERT_EQ(kvp_id64("acme"), UINT64_C(0x130a76222d4427ef));
  ASSERT_EQ(kvp_id64("session-1"), UINT64_C(0x8f9d4a83e2384785));
  ASSERT_NE(kvp_id64("session-1"), kvp_id64("session-2"));
}

TEST_MAIN(TEST_ENTRY(json_escapes_controls_and_quotes),
          TEST_ENTRY(json_utf8_kept_invalid_replaced),
          TEST_ENTRY(numbers_round_trip_and_non_finite),
          TEST_ENTRY(prom_label_escaping),
          TEST_ENTRY(buffer_snprintf_semantics),
          TEST_ENTRY(writer_chunks_and_stops_on_error),
          TEST_ENTRY(shared_names_and_ids))
