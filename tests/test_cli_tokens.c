/* SPDX-License-Identifier: Apache-2.0 */
/* The token-id text reader of `kvplane hash` (connectors/cli/cli_tokens.h):
 * exact ids for every accepted form, and every error's exact message with
 * its position; the CLI test checks the same through the tool. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "cli_tokens.h"

#include "test_harness.h"

#define NOT_AN_ID "is not a token id (expected an integer 0..4294967295)"

typedef struct got {
  uint32_t ids[16384];
  size_t n, calls, max_batch;
  int fail_with; /* the callback's answer: 0 takes the batch */
} got;

static got g;

static int collect(void *arg, const uint32_t *ids, size_t n) {
  got *o = arg;
  ASSERT_GT(n, 0);
  ASSERT_LE(o->n + n, sizeof o->ids / sizeof o->ids[0]);
  memcpy(o->ids + o->n, ids, n * sizeof *ids);
  o->n += n;
  o->calls++;
  o->max_batch = n > o->max_batch ? n : o->max_batch;
  return o->fail_with;
}

/* Reads `text` (len bytes) as the input named "t", into the fresh `g`. */
static int read_mem(const char *text, size_t len, char *why, size_t cap) {
  memset(&g, 0, sizeof g);
  /* "r" mode never writes to the buffer: the cast only meets the prototype */
  FILE *f = fmemopen((void *)text, len, "r");
  ASSERT_NOT_NULL(f);
  int rc = cli_tokens_read(f, "t", collect, &g, why, cap);
  fclose(f);
  return rc;
}

static int read_str(const char *text, char *why, size_t cap) {
  return read_mem(text, strlen(text), why, cap);
}

TEST(accepts_every_form) {
  static const struct {
    const char *text;
    size_t n;
    uint32_t ids[4];
  } cases[] = {
      {"1 2 3\n", 3, {1, 2, 3}},
      {"1,2, 3 ,4", 4, {1, 2, 3, 4}},
      {"[1, 2,\n 3]\n", 3, {1, 2, 3}},
      {"[ 7 ]", 1, {7}},
      {"\n\n 5\n\n\t6\n\n", 2, {5, 6}},
      {"1\r\n2\r\n3\r\n", 3, {1, 2, 3}},
      {"0 4294967295 007", 3, {0, 4294967295u, 7}},
      {"", 0, {0}},
      {" \n\r\n", 0, {0}},
      {"[]", 0, {0}},
      {"[\n]\n\n", 0, {0}},
  };
  char why[256];
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ASSERT_EQ(read_str(cases[i].text, why, sizeof why), 0);
    ASSERT_STR_EQ(why, "");
    ASSERT_EQ(g.n, cases[i].n);
    ASSERT_MEM_EQ(g.ids, cases[i].ids, cases[i].n * sizeof(uint32_t));
    ASSERT_EQ(g.calls, cases[i].n > 0 ? 1u : 0u); /* no empty batches */
  }
}

TEST(batches_in_order) {
  static char text[10000 * 6];
  size_t len = 0;
  char why[256];
  for (uint32_t i = 0; i < 10000; i++)
    len += (size_t)snprintf(text + len, sizeof text - len, "%u\n", i);
  ASSERT_EQ(read_mem(text, len, why, sizeof why), 0);
  ASSERT_EQ(g.n, 10000u);
  ASSERT_EQ(g.calls, 3u);
  ASSERT_EQ(g.max_batch, CLI_TOKENS_BATCH);
  for (uint32_t i = 0; i < 10000; i++)
    ASSERT_EQ(g.ids[i], i);
}

TEST(errors_name_their_place) {
  static const struct {
    const char *text, *why;
  } cases[] = {
      {"1 2 x", "t:1:5: token 3 \"x\" " NOT_AN_ID},
      {"1\n -5\n", "t:2:2: token 2 \"-5\" " NOT_AN_ID},
      {"1 4294967296", "t:1:3: token 2 \"4294967296\" " NOT_AN_ID},
      {"3.5", "t:1:1: token 1 \"3.5\" " NOT_AN_ID},
      {"1 +2", "t:1:3: token 2 \"+2\" " NOT_AN_ID},
      {"1\r\n2\r\nzz\r\n", "t:3:1: token 3 \"zz\" " NOT_AN_ID},
      {"1 2 3 00000000000000000000000000000000000000001",
       "t:1:7: token 4 \"000000000000000000000000...\" " NOT_AN_ID},
      {"1 ]", "t:1:3: token 2 \"]\" " NOT_AN_ID}, /* not JSON: no array */
      {"1,,2", "t:1:3: ',' without a token id before it"},
      {"\n  ,1", "t:2:3: ',' without a token id before it"},
      {"[,]", "t:1:2: ',' without a token id before it"},
      {"[1, 2] 3", "t:1:8: unexpected text after ']'"},
      {"[1,\n 2]\n\n  z", "t:4:3: unexpected text after ']'"},
      {"[1]]", "t:1:4: unexpected text after ']'"},
      /* at end of input: no position, as the tool always printed them */
      {"1,2,", "t: a token id must follow the last ','"},
      {"[1,]", "t: a token id must follow the last ','"},
      {"[1, 2", "t: the JSON array lacks its closing ']'"},
      {"[", "t: the JSON array lacks its closing ']'"},
  };
  char why[256];
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ASSERT_ERR(read_str(cases[i].text, why, sizeof why), KVP_ECORRUPT);
    ASSERT_STR_EQ(why, cases[i].why);
    ASSERT_EQ(g.calls, 0u); /* a short input fails before its only batch */
  }
}

TEST(error_after_a_batch) {
  static char text[5000 * 6];
  size_t len = 0;
  char why[256];
  for (uint32_t i = 0; i < 5000; i++)
    len += (size_t)snprintf(text + len, sizeof text - len, "%u\n", i);
  len += (size_t)snprintf(text + len, sizeof text - len, "-1\n");
  ASSERT_ERR(read_mem(text, len, why, sizeof why), KVP_ECORRUPT);
  ASSERT_STR_EQ(why, "t:5001:1: token 5001 \"-1\" " NOT_AN_ID);
  ASSERT_EQ(g.n, CLI_TOKENS_BATCH); /* delivered before the error: discard */
}

TEST(callback_stops_the_reader) {
  static char text[5000 * 2];
  char why[256];
  for (size_t i = 0; i < 5000; i++)
    memcpy(text + 2 * i, "7 ", 2);
  memset(&g, 0, sizeof g);
  FILE *f = fmemopen(text, sizeof text, "r");
  ASSERT_NOT_NULL(f);
  g.fail_with = KVP_ENOMEM;
  ASSERT_ERR(cli_tokens_read(f, "t", collect, &g, why, sizeof why),
             KVP_ENOMEM);
  fclose(f);
  ASSERT_EQ(g.calls, 1u);
  ASSERT_TRUE(strncmp(why, "t: stopped after token 4096: ", 29) == 0);
}

/* A NUL inside a token is an error, not the end of the token's text. */
TEST(nul_byte_is_an_error) {
  char why[256];
  static const char text[] = "1 12\0x 3";
  ASSERT_ERR(read_mem(text, sizeof text - 1, why, sizeof why), KVP_ECORRUPT);
  ASSERT_TRUE(strstr(why, "t:1:3: token 2 \"12?x\"") != NULL);
}

/* A read error is reported, never hashed as a shorter prompt. */
TEST(read_error_is_reported) {
  char why[256];
  memset(&g, 0, sizeof g);
  FILE *f = fopen("/", "r"); /* a directory: fopen works, reads fail EISDIR */
  ASSERT_NOT_NULL(f);
  ASSERT_ERR(cli_tokens_read(f, "t", collect, &g, why, sizeof why), -EIO);
  fclose(f);
  ASSERT_TRUE(strstr(why, "read error") != NULL);
  ASSERT_EQ(g.n, 0u);
}

TEST(small_or_no_buffer) {
  char why[8];
  ASSERT_ERR(read_str("1 2 x", why, sizeof why), KVP_ECORRUPT);
  ASSERT_STR_EQ(why, "t:1:5: "); /* cut, still a string */
  ASSERT_ERR(read_str("1,2,", why, 3), KVP_ECORRUPT);
  ASSERT_STR_EQ(why, "t:");
  ASSERT_ERR(read_str("1 2 x", NULL, 0), KVP_ECORRUPT);
  ASSERT_EQ(read_str("1 2", NULL, 0), 0);
}

TEST_MAIN(TEST_ENTRY(accepts_every_form), TEST_ENTRY(nul_byte_is_an_error),
          TEST_ENTRY(read_error_is_reported), TEST_ENTRY(batches_in_order),
          TEST_ENTRY(errors_name_their_place), TEST_ENTRY(error_after_a_batch),
          TEST_ENTRY(callback_stops_the_reader), TEST_ENTRY(small_or_no_buffer))
