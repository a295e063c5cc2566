/* SPDX-License-Identifier: Apache-2.0 */
/* vLLM block-hash vectors: the reader (exact u64s, every malformed input
 * named by case and field, bounded memory) and the library against all of
 * ../shared/vectors/vllm_block_hashes.json through the checker, which must
 * also be able to fail.  Bad inputs live in tests/data/vectors_bad_*.json. */
#include <dirent.h>
#include <errno.h>
#include <libgen.h>

#include "cli_vectors.h"
#include "test_harness.h"

#define SHARED_VECTORS "vectors/vllm_block_hashes.json"
#define SHARED_CASES 48u
#define SHARED_BLOCKS 288u
#define SHARED_BIG_U64 142u /* blocks whose external_u64 > INT64_MAX */

static char why[1024];

/* tests/data, next to this source file (CMake compiles it by absolute path)
 * unless KVP_TEST_DATA_DIR says otherwise. */
static const char *data_path(const char *name, char *buf, size_t cap) {
  const char *dir = getenv("KVP_TEST_DATA_DIR");
  char src[4096];
  snprintf(src, sizeof src, "%s", __FILE__);
  if (dir != NULL)
    snprintf(buf, cap, "%s/%s", dir, name);
  else
    snprintf(buf, cap, "%s/data/%s", dirname(src), name);
  return buf;
}

static uint64_t be64(const uint8_t *p) {
  uint64_t x = 0;
  for (int k = 0; k < 8; k++)
    x = x << 8 | p[k];
  return x;
}

static cli_vectors *parse_ok(const char *json) {
  cli_vectors *v = NULL;
  int rc = cli_vectors_parse(json, strlen(json), NULL, &v, why, sizeof why);
  if (rc < 0)
    fprintf(stderr, "unexpected error: %s\n", why);
  ASSERT_OK(rc);
  ASSERT_NOT_NULL(v);
  ASSERT_STR_EQ(why, "");
  return v;
}

static void parse_err(const char *json, int want, const char *needle) {
  cli_vectors *v = (cli_vectors *)1;
  int rc = cli_vectors_parse(json, strlen(json), NULL, &v, why, sizeof why);
  if (rc != want || strstr(why, needle) == NULL)
    fprintf(stderr, "input: %.200s\nwhy: %s\nwant: %s\n", json, why, needle);
  ASSERT_ERR(rc, want);
  ASSERT_NULL(v);
  ASSERT_NOT_NULL(strstr(why, needle));
}

/* ---- in-memory documents ---------------------------------------------------- */
#define HEX32 "00112233445566778899aabbccddeeff"
#define BLK(u64) "{\"hash_hex\":\"" HEX32 "\",\"external_u64\":" u64 ",\"extra_keys\":null}"

static char doc[16384];

/* One xxhash_cbor case of block size 1, with the given arrays. */
static const char *one_case(const char *tokens, const char *blocks) {
  snprintf(doc, sizeof doc,
           "{\"about\":\"t\",\"cases\":[{\"algo\":\"xxhash_cbor\","
           "\"pythonhashseed\":\"0\",\"none_hash_hex\":\"" HEX32 "\","
           "\"block_size\":1,\"lora_name\":null,\"cache_salt\":null,"
           "\"mm_placeholders\":[],\"token_ids\":%s,\"blocks\":%s}]}",
           tokens, blocks);
  return doc;
}

TEST(u64_beyond_int64_exact) {
  /* jansson alone refuses these ("too big integer"); a double would round
   * 2^64-1 to 2^64 and 2^63+1 to 2^63 */
  cli_vectors *v = parse_ok(one_case(
      "[0,4294967295,7,8]",
      "[" BLK("18446744073709551615") "," BLK("9223372036854775809") ","
      BLK("9223372036854775807") "," BLK("0") "]"));
  ASSERT_EQ(v->n_cases, 1u);
  const cli_vector_case *c = &v->cases[0];
  ASSERT_EQ(c->n_blocks, 4u);
  ASSERT_EQ(c->blocks[0].external_u64, UINT64_MAX);
  ASSERT_EQ(c->blocks[1].external_u64, (1ull << 63) + 1);
  ASSERT_EQ(c->blocks[2].external_u64, (uint64_t)INT64_MAX);
  ASSERT_EQ(c->blocks[3].external_u64, 0u);
  ASSERT_EQ(c->tokens[1], UINT32_MAX);
  ASSERT_EQ(c->algo, KVP_HASH_XXHASH_CBOR);
  ASSERT_EQ(c->digest_len, 16u);
  ASSERT_EQ(c->blocks[0].digest[15], 0xffu);
  ASSERT_NULL(c->lora_name);
  ASSERT_NULL(c->cache_salt);
  cli_vectors_destroy(v);
  cli_vectors_destroy(NULL);
}

TEST(u64_out_of_range_named) {
  parse_err(one_case("[1]", "[" BLK("18446744073709551616") "]"),
            KVP_ECORRUPT, "case 0: blocks[0].external_u64: "
            "18446744073709551616 is out of range 0..18446744073709551615");
  parse_err(one_case("[1]", "[" BLK("-9223372036854775809") "]"),
            KVP_ECORRUPT, "blocks[0].external_u64: -9223372036854775809 is "
            "out of range");
  parse_err(one_case("[1]", "[" BLK("-1") "]"), KVP_ECORRUPT,
            "blocks[0].external_u64: -1 is out of range");
  parse_err(one_case("[1]", "[" BLK("1.0") "]"), KVP_ECORRUPT,
            "blocks[0].external_u64: expected an integer, got a real number");
  parse_err(one_case("[1]", "[" BLK("1e19") "]"), KVP_ECORRUPT,
            "expected an integer, got a real number");
  /* a decimal string is not a number, even one that looks like the mark */
  parse_err(one_case("[1]", "[" BLK("\"18446744073709551615\"") "]"),
            KVP_ECORRUPT, "blocks[0].external_u64: expected an integer, got "
            "a string");
  parse_err(one_case("[1]", "[" BLK("\"\\u000012\"") "]"), KVP_ECORRUPT,
            "\\u0000 (NUL) in a string is not supported");
  parse_err(one_case("[99999999999999999999999999]", "[" BLK("1") "]"),
            KVP_ECORRUPT, "token_ids[0]: 999999999999999999999999... is "
            "out of range 0..4294967295"); /* long literals are cut */
}

TEST(big_literals_only_where_values_go) {
  /* big literals inside strings and ignored fields are fine */
  cli_vectors *v = parse_ok(
      "{\"about\":[18446744073709551616, \"x99999999999999999999\", "
      "{\"k\":-99999999999999999999}],\"cases\":[{\"algo\":\"xxhash_cbor\","
      "\"pythonhashseed\":\"0\",\"none_hash_hex\":\"" HEX32 "\","
      "\"block_size\":2,\"lora_name\":null,\"cache_salt\":null,"
      "\"mm_placeholders\":[{\"identifier\":\"i\",\"offset\":"
      "18446744073709551615,\"length\":3}],\"token_ids\":[1,2,3],\"blocks\":"
      "[{\"hash_hex\":\"" HEX32 "\",\"external_u64\":12345678901234567890,"
      "\"extra_keys\":[\"i\",[12345678901234567890,-1]]}]}]}");
  ASSERT_EQ(v->cases[0].mm[0].offset, UINT64_MAX);
  ASSERT_STR_EQ(v->cases[0].mm[0].id, "i");
  ASSERT_EQ(v->cases[0].blocks[0].external_u64, 12345678901234567890ull);
  ASSERT_EQ(v->n_blocks, 1u);
  cli_vectors_destroy(v);
  /* where a key belongs the literal stays a (bad) number: no new keys */
  parse_err("{\"cases\":[], 12345678901234567890: 1}", KVP_ECORRUPT,
            "not valid JSON");
  parse_err("{12345678901234567890: 1}", KVP_ECORRUPT, "not valid JSON");
  /* error positions are those of the caller's text, before the rewrite */
  parse_err("{\"a\":[12345678901234567890, 1 2]}", KVP_ECORRUPT,
            "not valid JSON at line 1, byte 31");
  /* nesting beyond jansson's limit, refused before jansson recurses */
  static char deep[5000];
  memset(deep, '[', 3000);
  deep[3000] = '\0';
  parse_err(deep, KVP_ECORRUPT, "nested deeper than 2048 levels");
}

TEST(field_errors_named) {
  parse_err("", KVP_ECORRUPT, "not valid JSON");
  parse_err("{\"cases\":[]}", KVP_ECORRUPT, "cases: empty");
  parse_err("{\"cases\":{}}", KVP_ECORRUPT,
            "cases: expected an array, got an object");
  parse_err("{\"about\":1}", KVP_ECORRUPT, "cases: missing");
  parse_err("{\"cases\":[1]}", KVP_ECORRUPT,
            "case 0: expected an object, got an integer");
  parse_err(one_case("[1,-2]", "[]"), KVP_ECORRUPT,
            "case 0: token_ids[1]: -2 is out of range 0..4294967295");
  parse_err(one_case("[1,4294967296]", "[]"), KVP_ECORRUPT,
            "case 0: token_ids[1]: 4294967296 is out of range");
  parse_err(one_case("[1,\"2\"]", "[]"), KVP_ECORRUPT,
            "case 0: token_ids[1]: expected an integer, got a string");
  parse_err(one_case("{}", "[]"), KVP_ECORRUPT,
            "case 0: token_ids: expected an array, got an object");
  parse_err(one_case("[1,2]", "[" BLK("1") "]"), KVP_ECORRUPT,
            "case 0: blocks: 1 entries, but token_ids holds 2 full blocks");
  parse_err(one_case("[1]", "[7]"), KVP_ECORRUPT,
            "case 0: blocks[0]: expected an object, got an integer");
  parse_err(one_case("[1]", "[{\"hash_hex\":\"" HEX32 "0\"}]"),
            KVP_ECORRUPT, "case 0: blocks[0].hash_hex: expected 32 hex "
            "digits, got 33 characters");
  parse_err(one_case("[1]", "[{\"hash_hex\":\"" HEX32 "\","
                     "\"external_u64\":1,\"extra_keys\":7}]"),
            KVP_ECORRUPT, "case 0: blocks[0].extra_keys: expected an array "
            "or null, got an integer");
  parse_err(one_case("[1]", "[{\"hash_hex\":null}]"), KVP_ECORRUPT,
            "blocks[0].hash_hex: expected a string of 32 hex digits, got "
            "null");
}

TEST(case_fields_named) {
  static const struct {
    const char *from, *to, *needle;
  } edits[] = {
      {"\"algo\":\"xxhash_cbor\"", "\"algo\":\"xxh3_128\"",
       "case 0: algo: unknown algorithm \"xxh3_128\""},
      {"\"algo\":\"xxhash_cbor\"", "\"algo\":3", "algo: expected a string"},
      {"\"block_size\":1", "\"block_size\":4097",
       "case 0: block_size: 4097 is out of range 1..4096"},
      {"\"block_size\":1", "\"block_size\":0", "block_size: 0 is out of range"},
      {"\"block_size\":1", "\"block_size\":true",
       "block_size: expected an integer, got true"},
      {"\"pythonhashseed\":\"0\"", "\"pythonhashseed\":null",
       "pythonhashseed: expected a string, got null"},
      {"\"lora_name\":null", "\"lora_name\":[]",
       "lora_name: expected a string or null, got an array"},
      {"\"cache_salt\":null,", "", "case 0: cache_salt: missing"},
      {"\"none_hash_hex\":\"0011", "\"none_hash_hex\":\"0x11",
       "none_hash_hex: character 1 is not a hex digit"},
      {"\"mm_placeholders\":[]", "\"mm_placeholders\":[{\"identifier\":1}]",
       "case 0: mm_placeholders[0].identifier: expected a string, got an "
       "integer"},
      {"\"mm_placeholders\":[]", "\"mm_placeholders\":[[]]",
       "case 0: mm_placeholders[0]: expected an object, got an array"},
  };
  for (size_t k = 0; k < sizeof edits / sizeof edits[0]; k++) {
    char text[sizeof doc];
    const char *base = one_case("[5]", "[" BLK("1") "]");
    const char *at = strstr(base, edits[k].from);
    ASSERT_NOT_NULL(at);
    snprintf(text, sizeof text, "%.*s%s%s", (int)(at - base), base,
             edits[k].to, at + strlen(edits[k].from));
    parse_err(text, KVP_ECORRUPT, edits[k].needle);
  }
}

TEST(limits) {
  /* token count: one past the limit, without blocks (checked after) */
  size_t n = CLI_VECTORS_MAX_TOKENS + 1, cap = 2 * n + 64;
  char *tokens = malloc(cap);
  ASSERT_NOT_NULL(tokens);
  tokens[0] = '[';
  for (size_t i = 0; i < n; i++)
    memcpy(tokens + 1 + 2 * i, i + 1 < n ? "0," : "0]", 2);
  tokens[1 + 2 * n] = '\0';
  char *text = malloc(cap + 512);
  ASSERT_NOT_NULL(text);
  snprintf(text, cap + 512,
           "{\"cases\":[{\"algo\":\"xxhash_cbor\",\"pythonhashseed\":\"0\","
           "\"none_hash_hex\":\"" HEX32 "\",\"block_size\":1,"
           "\"lora_name\":null,\"cache_salt\":null,\"token_ids\":%s}]}",
           tokens);
  parse_err(text, KVP_ERANGE, "case 0: token_ids: 1048577 entries, more "
            "than the limit 1048576");
  free(text);
  free(tokens);
  /* file size: refused before a byte is read */
  size_t big = (size_t)CLI_VECTORS_MAX_BYTES + 1;
  char *huge = calloc(big, 1);
  ASSERT_NOT_NULL(huge);
  cli_vectors *v = NULL;
  ASSERT_ERR(cli_vectors_parse(huge, big, NULL, &v, why, sizeof why),
             KVP_ERANGE);
  ASSERT_NOT_NULL(strstr(why, "more than the limit"));
  free(huge);
  ASSERT_ERR(cli_vectors_parse(NULL, 1, NULL, &v, why, sizeof why),
             KVP_EINVAL);
  ASSERT_ERR(cli_vectors_parse("{}", 2, NULL, NULL, NULL, 0), KVP_EINVAL);
  /* a NULL reason buffer is allowed */
  ASSERT_ERR(cli_vectors_parse("{}", 2, NULL, &v, NULL, 0), KVP_ECORRUPT);
  /* a tiny one is truncated, never overrun */
  char small[8];
  ASSERT_ERR(cli_vectors_parse("{}", 2, NULL, &v, small, sizeof small),
             KVP_ECORRUPT);
  ASSERT_EQ(strlen(small), sizeof small - 1);
}

/* ---- the files in tests/data --------------------------------------------- */
static const struct {
  const char *file;
  int rc;
  const char *needle;
} bad_files[] = {
    {"vectors_bad_algo.json", KVP_ECORRUPT,
     "case 1: algo: unknown algorithm \"md5\""},
    {"vectors_bad_block_size_big.json", KVP_ECORRUPT,
     "case 1: block_size: 8192 is out of range 1..4096"},
    {"vectors_bad_block_size_type.json", KVP_ECORRUPT,
     "case 1: block_size: expected an integer, got a string"},
    {"vectors_bad_block_size_zero.json", KVP_ECORRUPT,
     "case 1: block_size: 0 is out of range 1..4096"},
    {"vectors_bad_blocks_count.json", KVP_ECORRUPT,
     "case 1: blocks: 2 entries, but token_ids holds 3 full blocks of 16"},
    {"vectors_bad_duplicate_key.json", KVP_ECORRUPT,
     "not valid JSON at line 2, byte 190: duplicate object key"},
    {"vectors_bad_empty.json", KVP_ECORRUPT, "cases: empty"},
    {"vectors_bad_garbage.json", KVP_ECORRUPT, "not valid JSON at line 1"},
    {"vectors_bad_hex_digit.json", KVP_ECORRUPT,
     "case 1: none_hash_hex: character 5 is not a hex digit"},
    {"vectors_bad_hex_length.json", KVP_ECORRUPT,
     "case 1: blocks[2].hash_hex: expected 64 hex digits, got 63 characters"},
    {"vectors_bad_missing_external.json", KVP_ECORRUPT,
     "case 1: blocks[0].external_u64: missing"},
    {"vectors_bad_missing_seed.json", KVP_ECORRUPT,
     "case 1: pythonhashseed: missing"},
    {"vectors_bad_mm_missing.json", KVP_ECORRUPT,
     "case 1: mm_placeholders[0].offset: missing"},
    {"vectors_bad_nul.json", KVP_ECORRUPT,
     "\\u0000 (NUL) in a string is not supported"},
    {"vectors_bad_salt_type.json", KVP_ECORRUPT,
     "case 1: cache_salt: expected a string or null, got an integer"},
    {"vectors_bad_token_negative.json", KVP_ECORRUPT,
     "case 1: token_ids[0]: -3 is out of range 0..4294967295"},
    {"vectors_bad_token_range.json", KVP_ECORRUPT,
     "case 1: token_ids[7]: 4294967296 is out of range 0..4294967295"},
    {"vectors_bad_token_real.json", KVP_ECORRUPT,
     "case 1: token_ids[3]: expected an integer, got a real number"},
    {"vectors_bad_top_level.json", KVP_ECORRUPT,
     "top level: expected an object, got an array"},
    /* the byte offset is the file's own, past the rewritten big u64s */
    {"vectors_bad_truncated.json", KVP_ECORRUPT,
     "not valid JSON at line 3, byte 1036"},
    {"vectors_bad_u64_huge.json", KVP_ECORRUPT,
     "case 1: blocks[1].external_u64: 100000000000000000000000... is out of "
     "range 0..18446744073709551615"},
    {"vectors_bad_u64_negative.json", KVP_ECORRUPT,
     "case 1: blocks[0].external_u64: -1 is out of range"},
    {"vectors_bad_u64_overflow.json", KVP_ECORRUPT,
     "case 1: blocks[1].external_u64: 18446744073709551616 is out of range "
     "0..18446744073709551615"},
};
#define N_BAD (sizeof bad_files / sizeof bad_files[0])

TEST(bad_files_named) {
  char path[4096];
  for (size_t k = 0; k < N_BAD; k++) {
    cli_vectors *v = NULL;
    data_path(bad_files[k].file, path, sizeof path);
    int rc = cli_vectors_load(path, NULL, &v, why, sizeof why);
    if (rc != bad_files[k].rc || strstr(why, bad_files[k].needle) == NULL)
      fprintf(stderr, "%s\n  why: %s\n  want: %s\n", path, why,
              bad_files[k].needle);
    ASSERT_ERR(rc, bad_files[k].rc);
    ASSERT_NULL(v);
    ASSERT_NOT_NULL(strstr(why, bad_files[k].needle));
    ASSERT_NOT_NULL(strstr(why, bad_files[k].file)); /* names the path */
  }
}

TEST(every_bad_file_listed) {
  /* a new vectors_bad_*.json must get its expected message above */
  char path[4096];
  const char *dir = data_path("", path, sizeof path);
  DIR *d = opendir(dir);
  ASSERT_NOT_NULL(d);
  size_t seen = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (strncmp(e->d_name, "vectors_bad_", 12) != 0)
      continue;
    size_t k = 0;
    while (k < N_BAD && strcmp(bad_files[k].file, e->d_name) != 0)
      k++;
    if (k == N_BAD)
      fprintf(stderr, "not in bad_files[]: %s\n", e->d_name);
    ASSERT_LT(k, N_BAD);
    seen++;
  }
  closedir(d);
  ASSERT_EQ(seen, N_BAD);
}

TEST(load_errors) {
  cli_vectors *v = NULL;
  char path[4096];
  ASSERT_ERR(cli_vectors_load("/nonexistent/x.json", NULL, &v, why,
                              sizeof why), -ENOENT);
  ASSERT_NOT_NULL(strstr(why, "/nonexistent/x.json: "));
  ASSERT_ERR(cli_vectors_load(data_path("", path, sizeof path), NULL, &v, why,
                              sizeof why), -EISDIR);
  ASSERT_NULL(v);
}

/* ---- allocation: every failure point is handled, nothing leaks ------------- */
typedef struct budget {
  long left; /* allocations that may still succeed; <0 = unlimited */
  size_t live;
} budget;

static void *b_alloc(void *o, size_t n) {
  budget *b = o;
  if (b->left == 0)
    return NULL;
  if (b->left > 0)
    b->left--;
  b->live += n;
  return malloc(n);
}
static void b_free(void *o, void *p, size_t n) {
  ((budget *)o)->live -= n;
  free(p);
}

TEST(allocation_failures) {
  const char *text = one_case("[1,2]", "[" BLK("18446744073709551615") ","
                              BLK("2") "]");
  int ok_at = -1;
  for (long fail_after = 0; fail_after < 64 && ok_at < 0; fail_after++) {
    budget b = {.left = fail_after};
    kvp_allocator a = {b_alloc, b_free, &b};
    cli_vectors *v = NULL;
    int rc = cli_vectors_parse(text, strlen(text), &a, &v, why, sizeof why);
    if (rc == 0) {
      ok_at = (int)fail_after;
      ASSERT_EQ(v->cases[0].blocks[0].external_u64, UINT64_MAX);
      cli_vectors_destroy(v);
    } else {
      ASSERT_ERR(rc, KVP_ENOMEM);
      ASSERT_NULL(v);
      ASSERT_NOT_NULL(strstr(why, "out of memory"));
    }
    ASSERT_EQ(b.live, 0u); /* freed with the sizes it was allocated with */
  }
  ASSERT_GT(ok_at, 0);
}

/* ---- the shared vectors (skip when ../shared is absent) --------------------- */
static cli_vectors *load_shared(void) {
  char path[4096];
  kvt_shared_path(SHARED_VECTORS, path, sizeof path);
  FILE *f = fopen(path, "rb");
  if (f == NULL)
    KVT_SKIP_BECAUSE("%s: %s (set KVP_SHARED_DIR to ../shared)", path,
                     strerror(errno));
  fclose(f);
  cli_vectors *v = NULL;
  int rc = cli_vectors_load(path, NULL, &v, why, sizeof why);
  if (rc < 0)
    fprintf(stderr, "%s\n", why);
  ASSERT_OK(rc);
  return v;
}

TEST(shared_counts_and_exact_u64) {
  cli_vectors *v = load_shared();
  ASSERT_EQ(v->n_cases, SHARED_CASES);
  ASSERT_EQ(v->n_blocks, SHARED_BLOCKS);
  size_t blocks = 0, big = 0;
  for (size_t i = 0; i < v->n_cases; i++) {
    const cli_vector_case *c = &v->cases[i];
    ASSERT_EQ(c->index, i);
    ASSERT_EQ(c->n_blocks, c->n_tokens / c->block_size);
    for (size_t b = 0; b < c->n_blocks; b++) {
      /* the file's external u64 is the digest's last 8 bytes, big-endian:
       * read independently, they must agree exactly, 2^63 and above too */
      uint64_t x = c->blocks[b].external_u64;
      ASSERT_EQ(x, be64(c->blocks[b].digest + c->digest_len - 8));
      big += x > (uint64_t)INT64_MAX;
    }
    blocks += c->n_blocks;
  }
  ASSERT_EQ(blocks, SHARED_BLOCKS);
  ASSERT_EQ(big, SHARED_BIG_U64);
  cli_vectors_destroy(v);
}

TEST(shared_all_cases_pass) {
  cli_vectors *v = load_shared();
  size_t passed = 0, blocks = 0;
  for (size_t i = 0; i < v->n_cases; i++) {
    int rc = cli_vectors_check(&v->cases[i], why, sizeof why);
    if (rc != 0)
      fprintf(stderr, "%s\n", why);
    ASSERT_EQ(rc, 0);
    ASSERT_STR_EQ(why, "");
    passed++;
    blocks += v->cases[i].n_blocks;
  }
  ASSERT_EQ(passed, SHARED_CASES);
  ASSERT_EQ(blocks, SHARED_BLOCKS);
  cli_vectors_destroy(v);
}

/* The check fails, naming the block, when one thing is off. */
static void expect_failure(const cli_vector_case *c, int want,
                           const char *needle) {
  int rc = cli_vectors_check(c, why, sizeof why);
  if (rc != want || strstr(why, needle) == NULL)
    fprintf(stderr, "why: %s\nwant: %s\n", why, needle);
  ASSERT_EQ(rc, want);
  ASSERT_NOT_NULL(strstr(why, needle));
}

static cli_vector_case *find_case(cli_vectors *v, size_t min_blocks,
                                  kvp_hash_algo algo) {
  for (size_t i = 0; i < v->n_cases; i++)
    if (v->cases[i].n_blocks >= min_blocks && v->cases[i].algo == algo)
      return &v->cases[i];
  ASSERT_TRUE(0);
  return NULL;
}

TEST(shared_mutations_fail) {
  cli_vectors *v = load_shared();
  char needle[128];
  for (int algo = KVP_HASH_SHA256_CBOR; algo <= KVP_HASH_XXHASH_CBOR; algo++) {
    cli_vector_case *c = find_case(v, 4, (kvp_hash_algo)algo);
    ASSERT_EQ(cli_vectors_check(c, why, sizeof why), 0);
    /* one hex digit of block 2's digest: only block 2 differs */
    c->blocks[2].digest[3] ^= 0x10;
    snprintf(needle, sizeof needle, "case %zu: block 2: digest ", c->index);
    expect_failure(c, 1, needle);
    snprintf(needle, sizeof needle, "(1 of %zu blocks differ)", c->n_blocks);
    expect_failure(c, 1, needle);
    c->blocks[2].digest[3] ^= 0x10;
    /* the external u64 alone */
    c->blocks[1].external_u64 ^= 1u << 20;
    expect_failure(c, 1, "block 1: external u64 (key.lo)");
    c->blocks[1].external_u64 ^= 1u << 20;
    /* a token of block 1: the chain differs from block 1 on */
    c->tokens[c->block_size + 1] ^= 1;
    snprintf(needle, sizeof needle, "block 1: digest");
    expect_failure(c, 1, needle);
    snprintf(needle, sizeof needle, "(%zu of %zu blocks differ)",
             c->n_blocks - 1, c->n_blocks);
    expect_failure(c, 1, needle);
    c->tokens[c->block_size + 1] ^= 1;
    /* the seed moves NONE_HASH, hence every block */
    c->python_hash_seed[0] ^= 1;
    expect_failure(c, 1, "block 0: digest");
    c->python_hash_seed[0] ^= 1;
    /* the block count */
    c->n_blocks--;
    expect_failure(c, 1, "the chain has");
    c->n_blocks++;
    ASSERT_EQ(cli_vectors_check(c, why, sizeof why), 0);
  }
  cli_vectors_destroy(v);
}

TEST(shared_extras_matter) {
  cli_vectors *v = load_shared();
  size_t with_lora = 0, with_salt = 0, with_mm = 0;
  for (size_t i = 0; i < v->n_cases; i++) {
    cli_vector_case *c = &v->cases[i];
    if (c->lora_name != NULL) {
      /* dropping an extra changes block 0 (salt, lora, mm at offset 0) or a
       * later block (mm): the check must notice */
      char *keep = c->lora_name;
      c->lora_name = NULL;
      expect_failure(c, 1, "digest");
      c->lora_name = keep;
      with_lora++;
    }
    if (c->cache_salt != NULL) {
      char *keep = c->cache_salt;
      c->cache_salt = NULL;
      expect_failure(c, 1, "block 0: digest");
      c->cache_salt = keep;
      with_salt++;
    }
    if (c->n_mm > 0 && c->mm[0].offset < c->n_blocks * c->block_size) {
      c->mm[0].offset++;
      expect_failure(c, 1, "digest");
      c->mm[0].offset--;
      with_mm++;
    }
    ASSERT_EQ(cli_vectors_check(c, why, sizeof why), 0);
  }
  ASSERT_GT(with_lora, 0u);
  ASSERT_GT(with_salt, 0u);
  ASSERT_GT(with_mm, 0u);
  cli_vectors_destroy(v);
}

TEST(shared_library_errors_reported) {
  cli_vectors *v = load_shared();
  cli_vector_case *c = &v->cases[0];
  /* vLLM modes need the seed: the library refuses, the checker says where */
  char *keep = c->python_hash_seed;
  c->python_hash_seed = NULL;
  int rc = cli_vectors_check(c, why, sizeof why);
  c->python_hash_seed = keep;
  ASSERT_ERR(rc, KVP_EINVAL);
  ASSERT_NOT_NULL(strstr(why, "case 0: kvp_hasher_create: KVP_EINVAL"));
  cli_vectors_destroy(v);
}

TEST_MAIN(TEST_ENTRY(u64_beyond_int64_exact), TEST_ENTRY(u64_out_of_range_named),
          TEST_ENTRY(big_literals_only_where_values_go),
          TEST_ENTRY(field_errors_named), TEST_ENTRY(case_fields_named),
          TEST_ENTRY(limits), TEST_ENTRY(bad_files_named),
          TEST_ENTRY(every_bad_file_listed), TEST_ENTRY(load_errors),
          TEST_ENTRY(allocation_failures),
          /* these skip (77) without ../shared: keep them last */
          TEST_ENTRY(shared_counts_and_exact_u64),
          TEST_ENTRY(shared_all_cases_pass), TEST_ENTRY(shared_mutations_fail),
          TEST_ENTRY(shared_extras_matter),
          TEST_ENTRY(shared_library_errors_reported))
