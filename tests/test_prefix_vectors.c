/* SPDX-License-Identifier: Apache-2.0 */
/* vLLM block-hash vectors: the reader (exact u64s, every malformed input
 * named by case and field, bounded memory) and the library against all of
 * ../shared/vectors/vllm_block_hashes.json (before vLLM 0.33) and
 * vllm033_block_hashes.json (0.33: pickle, tagged extra keys) through the
 * checker, which must also be able to fail -- by digest and by the extra
 * keys of each block; plus golden pickle bytes of a few objects, from
 * CPython.  Bad inputs live in tests/data/vectors_bad_*.json. */
#include <dirent.h>
#include <errno.h>
#include <libgen.h>

#include "cli_vectors.h"
#include "prefix_internal.h"
#include "test_harness.h"

#define SHARED_VECTORS "vectors/vllm_block_hashes.json"
#define SHARED_CASES 48u
#define SHARED_BLOCKS 288u
#define SHARED_BIG_U64 142u /* blocks whose external_u64 > INT64_MAX */
#define SHARED033_VECTORS "vectors/vllm033_block_hashes.json"
#define SHARED033_CASES 48u
#define SHARED033_BLOCKS 214u

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

/* A 0.33 case (vLLM's sha256: pickle) of block size 1. */
static const char *case033(const char *fields, const char *blocks) {
  snprintf(doc, sizeof doc,
           "{\"cases\":[{\"algo\":\"sha256\",\"vllm_version\":\"0.33.0\","
           "\"pythonhashseed\":null,\"none_hash_hex\":\"" HEX32 HEX32 "\","
           "\"block_size\":1,\"lora_name\":\"l\",\"cache_salt\":null,"
           "%s\"mm_placeholders\":[],\"token_ids\":[5],\"blocks\":%s}]}",
           fields, blocks);
  return doc;
}
#define BLK033(x) "[{\"hash_hex\":\"" HEX32 HEX32 "\",\"external_u64\":1," x "}]"

TEST(fields_033) {
  cli_vectors *v = parse_ok(case033(
      "\"lora_path\":\"/p\",\"none_hash_seed\":\"vllm-none-hash\",",
      BLK033("\"extra_keys\":[[\"lora\",\"l\",\"/p\"]],"
             "\"event_extra_keys\": [ \"l\" ]")));
  const cli_vector_case *c = &v->cases[0];
  ASSERT_EQ(c->algo, KVP_HASH_VLLM_SHA256);
  ASSERT_EQ(c->digest_len, 32u);
  ASSERT_EQ(c->vllm_compat, KVP_VLLM_COMPAT_0_33);
  ASSERT_NULL(c->python_hash_seed);
  ASSERT_STR_EQ(c->none_hash_seed, "vllm-none-hash");
  ASSERT_STR_EQ(c->lora_path, "/p");
  /* kept as compact JSON text, as the checker renders kvplane's keys */
  ASSERT_STR_EQ(c->blocks[0].extra_keys, "[[\"lora\",\"l\",\"/p\"]]");
  ASSERT_STR_EQ(c->blocks[0].event_keys, "[\"l\"]");
  cli_vectors_destroy(v);
  /* optional fields absent; versions with suffixes; the old scheme */
  v = parse_ok(case033("", BLK033("\"extra_keys\":null")));
  ASSERT_NULL(v->cases[0].lora_path);
  ASSERT_NULL(v->cases[0].none_hash_seed);
  ASSERT_NULL(v->cases[0].blocks[0].event_keys);
  ASSERT_STR_EQ(v->cases[0].blocks[0].extra_keys, "null");
  cli_vectors_destroy(v);
  static const struct {
    const char *version;
    int rc;
    uint32_t compat;
  } versions[] = {{"0.33.0", 0, KVP_VLLM_COMPAT_0_33},
                  {"0.33", 0, KVP_VLLM_COMPAT_0_33},
                  {"0.34.1rc2", 0, KVP_VLLM_COMPAT_0_33},
                  {"1.0.0+cu128", 0, KVP_VLLM_COMPAT_0_33},
                  {"0.32.9", 0, KVP_VLLM_COMPAT_PRE_0_33},
                  {"0.10.1.1", 0, KVP_VLLM_COMPAT_PRE_0_33},
                  {"0.9-dev", 0, KVP_VLLM_COMPAT_PRE_0_33},
                  {"0", -1, 0},
                  {"0.", -1, 0},
                  {".33", -1, 0},
                  {"v0.33.0", -1, 0},
                  {"0.33_0", -1, 0},
                  {"99999999999.1", -1, 0}};
  for (size_t k = 0; k < sizeof versions / sizeof versions[0]; k++) {
    uint32_t compat = 77;
    ASSERT_EQ(cli_vllm_compat(versions[k].version, &compat), versions[k].rc);
    ASSERT_EQ(compat, versions[k].rc == 0 ? versions[k].compat : 77u);
  }
  ASSERT_EQ(cli_vllm_compat(NULL, NULL), -1);
}

TEST(fields_033_named) {
  static const struct {
    const char *from, *to, *needle;
  } edits[] = {
      {"\"vllm_version\":\"0.33.0\"", "\"vllm_version\":\"latest\"",
       "case 0: vllm_version: \"latest\" is not a version like \"0.33.0\""},
      {"\"vllm_version\":\"0.33.0\"", "\"vllm_version\":33",
       "case 0: vllm_version: expected a string or null, got an integer"},
      /* before 0.33 the seed is required: vLLM had no default */
      {"\"vllm_version\":\"0.33.0\"", "\"vllm_version\":\"0.32.0\"",
       "case 0: pythonhashseed: expected a string, got null"},
      {"\"algo\":\"sha256\"", "\"algo\":\"vllm_sha256\"",
       "case 0: algo: unknown algorithm \"vllm_sha256\" (expected vLLM's"},
      {"\"mm_placeholders\"", "\"lora_path\":7,\"mm_placeholders\"",
       "case 0: lora_path: expected a string or null, got an integer"},
      {"\"mm_placeholders\"", "\"none_hash_seed\":[],\"mm_placeholders\"",
       "case 0: none_hash_seed: expected a string or null, got an array"},
      {"\"extra_keys\":null", "\"extra_keys\":null,\"event_extra_keys\":\"l\"",
       "case 0: blocks[0].event_extra_keys: expected an array or null, got a "
       "string"},
      {"\"extra_keys\":null", "\"extra\":null",
       "case 0: blocks[0].extra_keys: missing"},
  };
  for (size_t k = 0; k < sizeof edits / sizeof edits[0]; k++) {
    char text[sizeof doc];
    const char *base = case033("", BLK033("\"extra_keys\":null"));
    const char *at = strstr(base, edits[k].from);
    ASSERT_NOT_NULL(at);
    snprintf(text, sizeof text, "%.*s%s%s", (int)(at - base), base,
             edits[k].to, at + strlen(edits[k].from));
    parse_err(text, KVP_ECORRUPT, edits[k].needle);
  }
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
static cli_vectors *load_file(const char *name) {
  char path[4096];
  kvt_shared_path(name, path, sizeof path);
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

static cli_vectors *load_shared(void) { return load_file(SHARED_VECTORS); }
static cli_vectors *load_033(void) { return load_file(SHARED033_VECTORS); }

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

static void all_cases_pass(cli_vectors *v, size_t n_cases, size_t n_blocks) {
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
  ASSERT_EQ(passed, n_cases);
  ASSERT_EQ(blocks, n_blocks);
  cli_vectors_destroy(v);
}

TEST(shared_all_cases_pass) {
  cli_vectors *v = load_shared();
  for (size_t i = 0; i < v->n_cases; i++) /* the scheme before 0.33 */
    ASSERT_EQ(v->cases[i].vllm_compat, KVP_VLLM_COMPAT_PRE_0_33);
  all_cases_pass(v, SHARED_CASES, SHARED_BLOCKS);
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
      expect_failure(c, 1, "block 0: extra keys ");
      c->lora_name = keep;
      with_lora++;
    }
    if (c->cache_salt != NULL) {
      char *keep = c->cache_salt;
      c->cache_salt = NULL;
      expect_failure(c, 1, "block 0: extra keys ");
      c->cache_salt = keep;
      with_salt++;
    }
    if (c->n_mm > 0 && c->mm[0].offset < c->n_blocks * c->block_size) {
      c->mm[0].offset++;
      expect_failure(c, 1, ": extra keys ");
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


/* ---- vLLM 0.33 (../shared/vectors/vllm033_block_hashes.json) ------------ */
TEST(shared033_all_cases_pass) {
  cli_vectors *v = load_033();
  size_t no_seed = 0, pickle = 0, event = 0;
  for (size_t i = 0; i < v->n_cases; i++) {
    const cli_vector_case *c = &v->cases[i];
    ASSERT_EQ(c->vllm_compat, KVP_VLLM_COMPAT_0_33);
    no_seed += c->python_hash_seed == NULL;
    pickle += c->algo == KVP_HASH_VLLM_SHA256 || c->algo == KVP_HASH_VLLM_XXHASH;
    for (size_t b = 0; b < c->n_blocks; b++) {
      ASSERT_NOT_NULL(c->blocks[b].extra_keys);
      ASSERT_NOT_NULL(c->blocks[b].event_keys);
      event++;
      ASSERT_EQ(c->blocks[b].external_u64,
                be64(c->blocks[b].digest + c->digest_len - 8));
    }
  }
  ASSERT_GT(no_seed, 0u); /* the library's "vllm-none-hash" is exercised */
  ASSERT_EQ(pickle, 24u);
  ASSERT_EQ(event, SHARED033_BLOCKS);
  all_cases_pass(v, SHARED033_CASES, SHARED033_BLOCKS);
}

/* NONE_HASH, which the public API hides: the library's root against the
 * file's none_hash_hex, for every case. */
TEST(shared033_none_hash) {
  cli_vectors *v = load_033();
  for (size_t i = 0; i < v->n_cases; i++) {
    const cli_vector_case *c = &v->cases[i];
    kvp_namespace_desc nd = {.model_id = "m", .block_size = c->block_size};
    kvp_namespace ns;
    ASSERT_OK(kvp_namespace_init(&nd, &ns));
    kvp_hasher_opts o = {.algo = c->algo,
                         .python_hash_seed = c->python_hash_seed};
    kvp_hasher *h = NULL;
    ASSERT_OK(kvp_hasher_create(&ns, &o, NULL, &h));
    uint8_t r[KVP__DIGEST_MAX];
    ASSERT_EQ(kvp__hasher_root(h, r), c->digest_len);
    ASSERT_MEM_EQ(r, c->none_hash, c->digest_len);
    kvp_hasher_destroy(h);
  }
  cli_vectors_destroy(v);
}

/* Every case, hashed by an older release's scheme: wherever it has extra
 * keys the checker names them, before any digest. */
TEST(shared033_scheme_mismatch_named) {
  cli_vectors *v = load_033();
  size_t named = 0;
  for (size_t i = 0; i < v->n_cases; i++) {
    cli_vector_case *c = &v->cases[i];
    if (c->python_hash_seed == NULL) /* nothing to reproduce before 0.33 */
      continue;
    bool extras = c->lora_name != NULL || c->cache_salt != NULL || c->n_mm > 0;
    c->vllm_compat = KVP_VLLM_COMPAT_PRE_0_33;
    int rc = cli_vectors_check(c, why, sizeof why);
    c->vllm_compat = KVP_VLLM_COMPAT_0_33;
    if (!extras) { /* None hashes alike, and so does the seed */
      ASSERT_EQ(rc, 0);
      continue;
    }
    if (rc != 1 || strstr(why, ": extra keys ") == NULL)
      fprintf(stderr, "case %zu: %s\n", i, why);
    ASSERT_EQ(rc, 1);
    ASSERT_NOT_NULL(strstr(why, ": extra keys "));
    named++;
  }
  ASSERT_GT(named, 10u);
  cli_vectors_destroy(v);
}

TEST(shared033_mutations_fail) {
  cli_vectors *v = load_033();
  char needle[160];
  cli_vector_case *c = NULL;
  for (size_t i = 0; i < v->n_cases && c == NULL; i++)
    if (v->cases[i].lora_path != NULL && v->cases[i].n_blocks >= 2 &&
        v->cases[i].algo == KVP_HASH_VLLM_SHA256)
      c = &v->cases[i];
  ASSERT_NOT_NULL(c);
  ASSERT_EQ(cli_vectors_check(c, why, sizeof why), 0);
  /* the LoRA path is hashed (tagged keys carry it) */
  c->lora_path[0] ^= 1;
  snprintf(needle, sizeof needle, "case %zu: block 0: extra keys [[\"lora\"",
           c->index);
  expect_failure(c, 1, needle);
  c->lora_path[0] ^= 1;
  /* the file's own keys: hashed form, then event form, block 1 only */
  char *keep = c->blocks[1].extra_keys;
  c->blocks[1].extra_keys = "null";
  expect_failure(c, 1, "block 1: extra keys [[\"lora\"");
  expect_failure(c, 1, "expected null (1 of");
  c->blocks[1].extra_keys = keep;
  keep = c->blocks[1].event_keys;
  c->blocks[1].event_keys = "[[\"lora\",\"x\"]]";
  expect_failure(c, 1, "block 1: event extra keys [\"adapter-");
  c->blocks[1].event_keys = keep;
  /* the digest, with the keys right */
  c->blocks[1].digest[0] ^= 1;
  expect_failure(c, 1, "block 1: digest ");
  c->blocks[1].digest[0] ^= 1;
  /* none_hash_seed must follow from pythonhashseed */
  char bad_seed[] = "vllm-none-hash";
  char *ks = c->none_hash_seed;
  c->none_hash_seed = bad_seed;
  expect_failure(c, 1, "none_hash_seed \"vllm-none-hash\" is not the seed");
  c->none_hash_seed = ks;
  ASSERT_EQ(cli_vectors_check(c, why, sizeof why), 0);
  /* an xxhash case without PYTHONHASHSEED: vLLM's seed is random */
  for (size_t i = 0; i < v->n_cases; i++) {
    cli_vector_case *x = &v->cases[i];
    if (x->algo != KVP_HASH_VLLM_XXHASH)
      continue;
    char *seed = x->python_hash_seed, *nseed = x->none_hash_seed;
    x->python_hash_seed = NULL;
    x->none_hash_seed = NULL;
    ASSERT_ERR(cli_vectors_check(x, why, sizeof why), KVP_EINVAL);
    ASSERT_NOT_NULL(strstr(why, "kvp_hasher_create: KVP_EINVAL"));
    x->python_hash_seed = seed;
    x->none_hash_seed = nseed;
    break;
  }
  cli_vectors_destroy(v);
}

/* ---- golden pickle bytes --------------------------------------------------
 * pickle.dumps(obj, protocol=5) as CPython 3.11.2 writes it, for
 *   parent = bytes([0xab]) * 32, tokens = (1, 300, 70000, 2**31) and
 *   0.33:  (("lora", "a", "/p"), ("mm", "a", -1), ("mm", "img", 2**40),
 *           ("cache_salt", "s"))
 *   older: ("a", ("a", -1), ("img", 2**40), "s")
 * with vLLM's objects: tag literals shared, other strs fresh (decoded) --
 * which CPython still makes one object for "a" -- so that LoRA name and mm
 * id are one memo entry (BINGET 3 / 2), and so is the second "mm" (BINGET
 * 6).  Taken with
 *   python3 -c 'import pickle; print(pickle.dumps(OBJ, protocol=5).hex())'
 * and read with pickletools.dis: FRAME 130, SHORT_BINBYTES, MEMOIZE, MARK,
 * BININT1 1, BININT2 300, BININT 70000, LONG1 2**31 (5 bytes), TUPLE ... */
#define GOLDEN_PARENT                                                          \
  "4320abababababababababababababababababababababababababababababababab94"
#define GOLDEN_TOKENS "284b014d2c014a701101008a050000008000" "7494"
static const char golden_033[] =
    "8005958200000000000000" GOLDEN_PARENT GOLDEN_TOKENS
    "288c046c6f7261948c0161948c022f709487948c026d6d9468034affffffff87946806"
    "8c03696d67948a0600000000000187948c0a63616368655f73616c74948c0173948694"
    "749487942e";
static const char golden_pre[] =
    "8005955e00000000000000" GOLDEN_PARENT GOLDEN_TOKENS
    "288c01619468024affffffff86948c03696d67948a0600000000000186948c01739474"
    "9487942e";
/* (parent, (7,), None): TUPLE1, NONE */
static const char golden_none[] =
    "8005952b00000000000000" GOLDEN_PARENT "4b0785944e87942e";
/* the NONE_HASH input: pickle.dumps("vllm-none-hash", protocol=5) */
static const char golden_seed[] =
    "80059512000000000000008c0e766c6c6d2d6e6f6e652d68617368942e";

static size_t unhex(const char *hex, uint8_t *out) {
  size_t n = strlen(hex) / 2;
  for (size_t i = 0; i < n; i++) {
    unsigned x;
    ASSERT_EQ(sscanf(hex + 2 * i, "%2x", &x), 1);
    out[i] = (uint8_t)x;
  }
  return n;
}

static void expect_bytes(kvp_hasher *h, const uint32_t *t,
                         const kvp_block_extras *bx, const char *hex) {
  static uint8_t want[256], got[256];
  uint8_t parent[32];
  memset(parent, 0xab, sizeof parent);
  size_t n = unhex(hex, want), len = 0;
  ASSERT_EQ(kvp__hasher_block_bytes(h, parent, 32, t, bx, got, sizeof got,
                                    &len),
            32);
  ASSERT_EQ(len, n);
  ASSERT_MEM_EQ(got, want, n);
  /* and the digest is SHA-256 of exactly those bytes */
  uint8_t d[32];
  ASSERT_EQ(kvp_hasher_block(h, parent, 32, t, bx, d, sizeof d, NULL), 32);
  ASSERT_EQ(kvp__hasher_block_bytes(h, parent, 32, t, bx, got, 10, &len),
            KVP_ENOSPC); /* too small a buffer says so, with the length */
  ASSERT_EQ(len, n);
}

TEST(golden_pickle_bytes) {
  kvp_namespace_desc nd = {.model_id = "m", .block_size = 4};
  kvp_namespace ns;
  ASSERT_OK(kvp_namespace_init(&nd, &ns));
  static const uint32_t tokens[4] = {1, 300, 70000, 1u << 31};
  kvp_mm_key mm[] = {{"a", -1}, {"img", 1ll << 40}};
  kvp_block_extras bx = {.lora_name = "a", .lora_path = "/p", .mm = mm,
                         .n_mm = 2, .cache_salt = "s"};
  for (uint32_t compat = KVP_VLLM_COMPAT_PRE_0_33;
       compat <= KVP_VLLM_COMPAT_0_33; compat++) {
    kvp_hasher_opts o = {.algo = KVP_HASH_VLLM_SHA256,
                         .python_hash_seed = "0", .vllm_compat = compat};
    kvp_hasher *h = NULL;
    ASSERT_OK(kvp_hasher_create(&ns, &o, NULL, &h));
    expect_bytes(h, tokens, &bx,
                 compat == KVP_VLLM_COMPAT_0_33 ? golden_033 : golden_pre);
    kvp_hasher_destroy(h);
  }
  kvp_namespace_desc n1 = {.model_id = "m", .block_size = 1};
  ASSERT_OK(kvp_namespace_init(&n1, &ns));
  kvp_hasher_opts o = {.algo = KVP_HASH_VLLM_XXHASH, .python_hash_seed = "0"};
  kvp_hasher *h = NULL;
  ASSERT_OK(kvp_hasher_create(&ns, &o, NULL, &h));
  uint8_t want[64], got[64], parent[16];
  size_t len;
  /* xxhash's parent is 16 bytes: the golden's 32 do not apply; its None */
  memset(parent, 0xab, sizeof parent);
  ASSERT_EQ(kvp__hasher_block_bytes(h, parent, 16, (const uint32_t[]){7},
                                    NULL, got, sizeof got, &len),
            16);
  size_t n = unhex(golden_none, want);
  ASSERT_EQ(len, n - 16); /* SHORT_BINBYTES of 16, not 32; FRAME 27 */
  ASSERT_EQ(got[2], 0x95);
  ASSERT_EQ(got[3], 27);
  ASSERT_MEM_EQ(got + 11 + 2 + 16, want + 11 + 2 + 32, n - 11 - 2 - 32);
  n = unhex(golden_seed, want);
  ASSERT_EQ(kvp__hasher_seed_bytes(h, "vllm-none-hash", got, sizeof got,
                                   &len),
            0);
  ASSERT_EQ(len, n);
  ASSERT_MEM_EQ(got, want, n);
  kvp_hasher_destroy(h);
}

TEST_MAIN(TEST_ENTRY(u64_beyond_int64_exact), TEST_ENTRY(u64_out_of_range_named),
          TEST_ENTRY(big_literals_only_where_values_go),
          TEST_ENTRY(field_errors_named), TEST_ENTRY(fields_033),
          TEST_ENTRY(fields_033_named), TEST_ENTRY(case_fields_named),
          TEST_ENTRY(golden_pickle_bytes),
          TEST_ENTRY(limits), TEST_ENTRY(bad_files_named),
          TEST_ENTRY(every_bad_file_listed), TEST_ENTRY(load_errors),
          TEST_ENTRY(allocation_failures),
          /* these skip (77) without ../shared: keep them last */
          TEST_ENTRY(shared_counts_and_exact_u64),
          TEST_ENTRY(shared_all_cases_pass), TEST_ENTRY(shared_mutations_fail),
          TEST_ENTRY(shared_extras_matter),
          TEST_ENTRY(shared_library_errors_reported),
          TEST_ENTRY(shared033_all_cases_pass), TEST_ENTRY(shared033_none_hash),
          TEST_ENTRY(shared033_scheme_mismatch_named),
          TEST_ENTRY(shared033_mutations_fail))
