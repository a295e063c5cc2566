/* SPDX-License-Identifier: Apache-2.0 */
/* router/prefix block hashing: golden vectors (native algorithms from an
 * independent Python implementation, vLLM modes from vLLM's own scheme), the
 * prefix property, incremental == one-shot, isolation, bad input and the
 * allocator hooks.  The full vLLM vector file is test_prefix_vectors.c's. */
#include <xxhash.h>

#include "core_internal.h"
#include "data/native_chain_vectors.h"
#include "prefix_internal.h"
#include "test_harness.h"

#define N_ALGOS 4

/* ---- helpers ------------------------------------------------------------- */
static void hex_decode(const char *hex, uint8_t *out, size_t n) {
  ASSERT_EQ(strlen(hex), 2 * n);
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    ASSERT_EQ(sscanf(hex + 2 * i, "%2x", &v), 1);
    out[i] = (uint8_t)v;
  }
}

static uint64_t be64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++)
    v = (v << 8) | p[i];
  return v;
}

static kvp_namespace mk_ns(const char *model, uint32_t bs, const char *salt) {
  kvp_namespace_desc d = {.model_id = model,
                          .tokenizer_id = "tok@1",
                          .kv_layout = "vllm-nhd:bf16",
                          .block_size = bs,
                          .tenant_salt = salt};
  kvp_namespace ns;
  ASSERT_OK(kvp_namespace_init(&d, &ns));
  return ns;
}

static kvp_hasher *mk_hasher_ns(const kvp_namespace *ns, kvp_hash_algo algo,
                                const char *py_seed) {
  kvp_hasher_opts o = {.algo = algo, .python_hash_seed = py_seed};
  kvp_hasher *h = NULL;
  ASSERT_OK(kvp_hasher_create(ns, &o, NULL, &h));
  ASSERT_NOT_NULL(h);
  return h;
}

static kvp_hasher *mk_hasher(kvp_hash_algo algo, uint32_t bs) {
  kvp_namespace ns = mk_ns("model-a", bs, NULL);
  return mk_hasher_ns(&ns, algo, "0");
}

/* One-shot keys of tokens[0..n); *nb receives the block count. */
static kvp_key *oneshot(kvp_hasher *h, const uint32_t *t, size_t n,
                        const kvp_extras *ex, size_t *nb) {
  size_t want = n / kvp_hasher_block_size(h), tail = 99;
  kvp_key *k = calloc(want + 1, sizeof *k);
  ASSERT_NOT_NULL(k);
  ASSERT_EQ(kvp_hasher_hash(h, t, n, ex, k, want, &tail), (int)want);
  ASSERT_EQ(tail, n % kvp_hasher_block_size(h));
  *nb = want;
  return k;
}

/* Extends c with tokens[0..n) in random pieces (empty ones included). */
static void extend_random(kvp_chain *c, const uint32_t *t, size_t n) {
  size_t pos = 0;
  while (pos < n) {
    size_t k = kvt_rand_below(4) == 0 ? 0 : kvt_rand_below(3 * 16 + 1);
    if (kvt_rand_below(16) == 0)
      k = kvt_rand_below(n + 1);
    if (k > n - pos)
      k = n - pos;
    size_t before = kvp_chain_len(c);
    int rc = kvp_chain_extend(c, t + pos, k);
    ASSERT_OK(rc);
    ASSERT_EQ(kvp_chain_len(c), before + (size_t)rc);
    pos += k;
    ASSERT_EQ(kvp_chain_tokens(c), pos);
  }
}

static uint32_t *rand_tokens(size_t n) {
  uint32_t *t = malloc((n + 1) * sizeof *t);
  ASSERT_NOT_NULL(t);
  for (size_t i = 0; i < n; i++)
    t[i] = (uint32_t)kvt_rand_below(160000);
  return t;
}

/* Random extras: maybe a LoRA, maybe a salt, 0-4 sorted placeholders that may
 * start before, straddle or end past block boundaries (or be empty). */
typedef struct rand_ex {
  kvp_extras ex;
  kvp_mm_span mm[4];
  char ids[4][16];
} rand_ex;

static void rand_extras(rand_ex *r, size_t n_tokens) {
  memset(r, 0, sizeof *r);
  if (kvt_rand_below(3) == 0)
    r->ex.lora_name = kvt_rand_below(2) ? "lora-a" : "lora-\xc3\xa9";
  if (kvt_rand_below(3) == 0)
    r->ex.cache_salt = "salt-1";
  size_t n_mm = kvt_rand_below(5);
  uint64_t off = 0;
  for (size_t i = 0; i < n_mm; i++) {
    off += kvt_rand_below(n_tokens / 2 + 2);
    snprintf(r->ids[i], sizeof r->ids[i], "img-%zu", i);
    r->mm[i] = (kvp_mm_span){r->ids[i], off, kvt_rand_below(40)};
  }
  r->ex.mm = r->mm;
  r->ex.n_mm = n_mm;
}

/* Chunk key recomputed here from its definition, with libxxhash. */
static kvp_key chunk_key_ref(kvp_key fine, uint32_t g) {
  uint8_t b[25];
  for (int i = 0; i < 8; i++) {
    b[i] = (uint8_t)(fine.hi >> (56 - 8 * i));
    b[8 + i] = (uint8_t)(fine.lo >> (56 - 8 * i));
  }
  for (int i = 0; i < 4; i++)
    b[16 + i] = (uint8_t)(g >> (8 * i));
  memcpy(b + 20, "chunk", 5);
  XXH128_hash_t r = XXH3_128bits(b, sizeof b);
  return (kvp_key){r.high64, r.low64};
}

/* Log capture, to check that bad input names the bad field. */
static char log_last[512];
static int log_count;
static void log_capture(void *o, kvp_log_level lv, const char *mod,
                        const char *msg) {
  (void)o;
  (void)lv;
  log_count++;
  snprintf(log_last, sizeof log_last, "%s: %s", mod, msg);
}
static void log_begin(void) {
  log_count = 0;
  log_last[0] = '\0';
  kvp_log_set_sink(log_capture, NULL);
  kvp_log_set_level(KVP_LOG_WARN);
}
static void log_end(void) {
  kvp_log_set_sink(NULL, NULL);
  kvp_log_set_level(KVP_LOG_ERROR);
}
/* The last call logged exactly one line that mentions `what`. */
#define ASSERT_LOGGED(what)                                                    \
  do {                                                                         \
    ASSERT_EQ(log_count, 1);                                                   \
    if (strstr(log_last, (what)) == NULL) {                                    \
      fprintf(stderr, "FAIL %s:%d: log \"%s\" does not mention \"%s\"\n",      \
              __FILE__, __LINE__, log_last, (what));                           \
      exit(1);                                                                 \
    }                                                                          \
    log_count = 0;                                                             \
  } while (0)

/* ---- algorithms ---------------------------------------------------------- */
TEST(algo_names) {
  static const char *const names[N_ALGOS] = {"xxh3_128", "sha256",
                                             "sha256_cbor", "xxhash_cbor"};
  static const size_t lens[N_ALGOS] = {16, 32, 32, 16};
  for (int a = 0; a < N_ALGOS; a++) {
    kvp_hash_algo got = (kvp_hash_algo)99;
    ASSERT_STR_EQ(kvp_hash_algo_name((kvp_hash_algo)a), names[a]);
    ASSERT_OK(kvp_hash_algo_parse(names[a], &got));
    ASSERT_EQ((int)got, a);
    ASSERT_EQ(kvp_hash_algo_digest_len((kvp_hash_algo)a), lens[a]);
  }
  kvp_hash_algo out = KVP_HASH_SHA256;
  log_begin();
  ASSERT_ERR(kvp_hash_algo_parse("XXH3_128", &out), KVP_EINVAL);
  ASSERT_LOGGED("\"XXH3_128\"");
  ASSERT_ERR(kvp_hash_algo_parse("sha256 ", &out), KVP_EINVAL);
  ASSERT_LOGGED("\"sha256 \"");
  ASSERT_ERR(kvp_hash_algo_parse("", &out), KVP_EINVAL);
  ASSERT_LOGGED("unknown hash algorithm");
  ASSERT_ERR(kvp_hash_algo_parse(NULL, &out), KVP_EINVAL);
  ASSERT_LOGGED("NULL name");
  ASSERT_ERR(kvp_hash_algo_parse("sha256", NULL), KVP_EINVAL);
  ASSERT_LOGGED("NULL out");
  log_end();
  ASSERT_EQ((int)out, (int)KVP_HASH_SHA256); /* untouched on failure */
  ASSERT_STR_EQ(kvp_hash_algo_name((kvp_hash_algo)4), "unknown");
  ASSERT_STR_EQ(kvp_hash_algo_name((kvp_hash_algo)-1), "unknown");
  ASSERT_EQ(kvp_hash_algo_digest_len((kvp_hash_algo)4), 0u);
}

/* ---- golden vectors ------------------------------------------------------ */
TEST(namespace_golden) {
  size_t n = sizeof nv_namespaces / sizeof nv_namespaces[0];
  for (size_t i = 0; i < n; i++) {
    kvp_namespace ns;
    ASSERT_OK(kvp_namespace_init(&nv_namespaces[i].desc, &ns));
    ASSERT_KEY_EQ(ns.seed, nv_namespaces[i].seed);
    ASSERT_EQ(ns.block_size, nv_namespaces[i].desc.block_size);
    for (size_t j = 0; j < i; j++) /* the vectors include "a"|"b" vs "ab" */
      ASSERT_FALSE(kvp_key_eq(nv_namespaces[j].seed, ns.seed));
  }
  /* NULL and "" are the same string, tenant_salt included */
  kvp_namespace_desc a = {.model_id = "m", .block_size = 16};
  kvp_namespace_desc b = {.model_id = "m",
                          .tokenizer_id = "",
                          .kv_layout = "",
                          .block_size = 16,
                          .tenant_salt = ""};
  kvp_namespace na, nb;
  ASSERT_OK(kvp_namespace_init(&a, &na));
  ASSERT_OK(kvp_namespace_init(&b, &nb));
  ASSERT_KEY_EQ(na.seed, nb.seed);
}

static uint32_t *nv_tokens(const nv_case *c) {
  uint32_t *t = malloc((c->n_tokens + 1) * sizeof *t);
  ASSERT_NOT_NULL(t);
  for (size_t i = 0; i < c->n_tokens; i++)
    t[i] = c->tokens ? c->tokens[i] : c->tok_mul * (uint32_t)i + c->tok_add;
  return t;
}

static void check_nv_case(const nv_case *c) {
  fprintf(stderr, "  case %s\n", c->name);
  const nv_ns *nsv = &nv_namespaces[c->ns];
  kvp_namespace ns;
  ASSERT_OK(kvp_namespace_init(&nsv->desc, &ns));
  kvp_hash_algo algo;
  ASSERT_OK(kvp_hash_algo_parse(c->algo, &algo));
  kvp_hasher *h = mk_hasher_ns(&ns, algo, c->python_hash_seed);
  kvp_extras ex = {c->lora_name, c->cache_salt, c->mm, c->n_mm};
  uint32_t *t = nv_tokens(c);
  size_t nb;
  kvp_key *k = oneshot(h, t, c->n_tokens, &ex, &nb);
  ASSERT_EQ(nb, c->n_blocks);
  for (size_t i = 0; i < nb; i++)
    ASSERT_KEY_EQ(k[i], c->keys[i]);
  /* the chain, built in random pieces, keeps the full digests */
  kvp_chain_opts co = {.chunk_tokens = {c->chunk_tokens}, .keep_digests = 1};
  kvp_chain *ch = NULL;
  ASSERT_OK(kvp_chain_create(h, &co, &ex, NULL, &ch));
  extend_random(ch, t, c->n_tokens);
  ASSERT_EQ(kvp_chain_len(ch), nb);
  size_t dlen = kvp_hash_algo_digest_len(algo);
  for (size_t i = 0; i < nb; i++) {
    uint8_t want[32], got[32];
    hex_decode(c->digest_hex[i], want, dlen);
    ASSERT_EQ(kvp_chain_digest(ch, i, got, sizeof got), (int)dlen);
    ASSERT_MEM_EQ(got, want, dlen);
    ASSERT_KEY_EQ(kvp_chain_keys(ch)[i], c->keys[i]);
    /* the key is the digest's last 16 bytes, big-endian */
    ASSERT_EQ(c->keys[i].hi, be64(want + dlen - 16));
    ASSERT_EQ(c->keys[i].lo, be64(want + dlen - 8));
  }
  size_t n_chunks = 99;
  const kvp_key *ck = kvp_chain_chunk_keys(ch, c->chunk_tokens, &n_chunks);
  if (c->chunk_tokens != 0) {
    ASSERT_NOT_NULL(ck);
    ASSERT_EQ(n_chunks, c->n_chunks);
    for (size_t j = 0; j < n_chunks; j++)
      ASSERT_KEY_EQ(ck[j], c->chunk_keys[j]);
  } else {
    ASSERT_NULL(ck);
    ASSERT_EQ(n_chunks, 0u);
  }
  kvp_chain_destroy(ch);
  kvp_hasher_destroy(h);
  free(k);
  free(t);
}

TEST(native_chain_golden) {
  size_t n = sizeof nv_cases / sizeof nv_cases[0];
  ASSERT_GE(n, 12u);
  for (size_t i = 0; i < n; i++)
    check_nv_case(&nv_cases[i]);
}

/* Literal cases of ../shared/vectors/vllm_block_hashes.json, so the vLLM
 * modes are checked even without that file. */
typedef struct vl_case {
  const char *algo, *seed;
  uint32_t block_size;
  const char *lora, *salt;
  const kvp_mm_span *mm;
  size_t n_mm;
  const uint32_t *tokens;
  size_t n_tokens;
  const char *const *hex;
  const uint64_t *external;
  size_t n_blocks;
} vl_case;

/* vllm_block_hashes.json case 4: sha256_cbor, block 32, seed "0", lora, salt,
 * mm */
static const uint32_t vl_tok_sha_mm_salt_lora[] = {
    8218,  29445, 25230, 4694,  22321, 18809, 1344,  11370, 2535,  3008,  23754,
    3381,  9829,  10388, 8157,  8825,  17354, 1630,  11854, 1021,  2566,  4555,
    30335, 13085, 12191, 30595, 23594, 20918, 22652, 7931,  3075,  22270, 10774,
    8966,  260,   16883, 29104, 10545, 31422, 31086, 3676,  11546, 30255, 26331,
    25919, 21010, 23729, 27634, 4125,  19862, 30383, 28520, 8882,  13276, 2984,
    22249, 18895, 20337, 23769, 17292, 15583, 18495, 13720, 17555, 30601, 12903,
    9866,  29436, 7189,  20733, 9917,  17993, 4362,  1767,  19663, 16663, 3600,
    5739,  7883,  7045,  29400, 14241, 8994,  17889, 654,   8205,  17656, 8877,
    30960, 17371, 8576,  15506, 4131,  13214, 23228, 3399,  24409, 12238, 2263,
    21444, 17832, 11899, 17850, 18202, 27650, 26360, 23696, 16625, 22432, 19032,
    996,   20284, 10096, 14597, 22361, 4332,  5104,  2436,  29932, 18981, 4650,
    22171, 28807, 27094, 7086,  15862, 27577, 26246, 27794, 25145, 10992, 11963,
    29117, 9579,  5235,  5098,  27823, 26054, 12508, 27300, 14408, 13292, 3862,
    19693, 4756,  8839,  9676,  21852, 22510, 26194, 20934, 19781, 31231, 268,
    17605, 31206, 317,   30136, 26713, 21067, 4344,  12435, 24477, 18412, 30877,
    28927, 3314,  15057, 995,   25533, 14154, 19613, 22257, 13837, 9046,  30589,
    12128, 13383, 13308, 19850, 15138, 1745,  3250,  15425, 25530, 1225,  21170,
    23073, 22851, 19,    26613, 1378,  27255, 3641,  19247, 4573,  17381, 16648,
    25008, 11674};
static const kvp_mm_span vl_mm_sha_mm_salt_lora[] = {
    {"img-e52d9c508c502347", 60, 32}};
static const char *const vl_hex_sha_mm_salt_lora[] = {
    "c5fdb300f60fdcba2336555ff43a4271a5d9d16dcc7f073b80d5b8f68e2b4dee",
    "73dd84623786c8174301e98541c4a98d447cbd17c5214b6f1164a7c0df52ac99",
    "ea1b3ed75b88886ffadd98518d0731d1f8b2cce15d91c4f38484c3bba0fcc83d",
    "386a94ee5c31e71be8215c6fcf8241703951fed0d127424700afe8dd69847b90",
    "95fed21c2bdcb9edf277219580fe11a1bd94c3e6db88cfce8f45ee939141db19",
    "f15163c995b649e119fe65febe881e8337f3f322c26b97f3d0ea160099c62f56"};
static const uint64_t vl_ext_sha_mm_salt_lora[] = {
    9283529575980813806u, 1253311043138137241u,  9548972320559515709u,
    49514158580071312u,   10323920038381345561u, 15053868896275017558u};
/* vllm_block_hashes.json case 9: xxhash_cbor, block 32, seed "1", salt, mm */
static const uint32_t vl_tok_xxh_mm_salt[] = {
    40598,  10126,  56145,  20187,  72085,  46302,  116175, 58940,  120111,
    14080,  110728, 20421,  89720,  41398,  9068,   89798,  24482,  62859,
    70071,  4583,   6143,   95177,  125176, 25121,  85127,  46661,  96387,
    126152, 47983,  66551,  122472, 114074, 46570,  112459, 111583, 102467,
    66008,  82187,  106201, 87273,  49090,  44836,  85746,  15783,  24200,
    124329, 49210,  4276,   128065, 35505,  116031, 80464,  93271,  126475,
    104641, 27547,  8176,   32370,  109804, 111136, 39898,  42869,  73837,
    52816,  32026,  47151,  101245, 6481,   30376,  123446, 38080,  91452,
    74508,  894,    25602,  12732,  127903, 17754,  29197,  48350,  66343,
    116696, 34935,  18462,  21282,  29894,  9882,   40821,  75157,  66937,
    66750,  118107, 116603, 70707,  78678,  118430, 113164, 71031,  103450,
    56639,  113077, 114224, 57587,  76131,  67076,  62256,  23970,  67167,
    113268, 46613,  25620,  56767,  105442};
static const kvp_mm_span vl_mm_xxh_mm_salt[] = {
    {"img-2b4c342f5433ebe5", 13, 30}};
static const char *const vl_hex_xxh_mm_salt[] = {
    "a55a16156840b8f9037de4a4a1374fc5", "55cdbd41e97e87312a4ce552139c16de",
    "a5f91bcdc5fd74df08603882d5602190"};
static const uint64_t vl_ext_xxh_mm_salt[] = {
    251608549933141957u, 3048063188502058718u, 603544484644397456u};
/* vllm_block_hashes.json case 18: sha256_cbor, block 16, seed "1234567" */
static const uint32_t vl_tok_sha_plain[] = {
    19403,  82888,  101206, 55319,  41505,  10140,  116843, 56624, 105046,
    29524,  81474,  57623,  75936,  134091, 116875, 88210,  21868, 17972,
    18469,  60529,  31409,  137253, 121521, 145785, 120160, 2562,  43938,
    120104, 113429, 141647, 28759,  50386,  4069,   63803,  80685, 56145,
    136054, 77115,  80745,  69236,  91607,  69643,  75363,  12458, 7624,
    2753,   115684, 11112,  54076,  20162,  82751,  118529, 79751};
static const char *const vl_hex_sha_plain[] = {
    "98e1aa760730a31c49b2585ebedfde58abced908c96c4e3ec34f421178945b16",
    "bb69578d21f445dd5790748faa5cd92b2fd2cff19f7b85f401ff3871170c66ac",
    "44b9bc167152b46c6b530489a6dd27015b632fba5e91b207b05d9ae220e23308"};
static const uint64_t vl_ext_sha_plain[] = {
    14073540003360955158u, 143895771468293804u, 12708484019514389256u};
/* vllm_block_hashes.json case 45: xxhash_cbor, block 16, seed "1", salt */
static const uint32_t vl_tok_xxh_utf8_salt[] = {
    23,     24,     255,    256,    65535,  65536,  139008, 96972,  111237,
    29812,  117459, 90986,  121198, 91383,  108148, 18330,  11215,  86357,
    147695, 41250,  74007,  57375,  33396,  40206,  222,    134849, 151749,
    115829, 6680,   54341,  111915, 41292,  130233, 24584,  26287,  66513,
    100173, 55867,  118840, 20153,  110024, 99790,  111111, 75043,  124283,
    121374, 99786,  151319, 140898, 148946, 32114,  90355,  11636,  127477,
    61735,  96980,  55179};
static const char *const vl_hex_xxh_utf8_salt[] = {
    "1401dba88abd33f74ba87405e72a0aa6", "908a5db78066e4f70a336326bd8f42c3",
    "b4f687f7952d106b12725266cca5be9f"};
static const uint64_t vl_ext_xxh_utf8_salt[] = {
    5451734917633936038u, 735040182231712451u, 1329215441501273759u};
static const vl_case vl_cases[] = {
    {"sha256_cbor", "0", 32u, "sql-adapter", "tenant-a", vl_mm_sha_mm_salt_lora,
     1, vl_tok_sha_mm_salt_lora, 200, vl_hex_sha_mm_salt_lora,
     vl_ext_sha_mm_salt_lora, 6},
    {"xxhash_cbor", "1", 32u, NULL, "tenant-a", vl_mm_xxh_mm_salt, 1,
     vl_tok_xxh_mm_salt, 113, vl_hex_xxh_mm_salt, vl_ext_xxh_mm_salt, 3},
    {"sha256_cbor", "1234567", 16u, NULL, NULL, NULL, 0, vl_tok_sha_plain, 53,
     vl_hex_sha_plain, vl_ext_sha_plain, 3},
    {"xxhash_cbor", "1", 16u, NULL, "t3nant-\303\251", NULL, 0,
     vl_tok_xxh_utf8_salt, 57, vl_hex_xxh_utf8_salt, vl_ext_xxh_utf8_salt, 3},
};

TEST(vllm_golden) {
  for (size_t ci = 0; ci < sizeof vl_cases / sizeof vl_cases[0]; ci++) {
    const vl_case *c = &vl_cases[ci];
    kvp_hash_algo algo;
    ASSERT_OK(kvp_hash_algo_parse(c->algo, &algo));
    kvp_namespace ns = mk_ns("any", c->block_size, NULL);
    kvp_hasher *h = mk_hasher_ns(&ns, algo, c->seed);
    kvp_extras ex = {c->lora, c->salt, c->mm, c->n_mm};
    size_t nb, dlen = kvp_hash_algo_digest_len(algo);
    kvp_key *k = oneshot(h, c->tokens, c->n_tokens, &ex, &nb);
    ASSERT_EQ(nb, c->n_blocks);
    kvp_chain_opts co = {.keep_digests = 1};
    kvp_chain *ch = NULL;
    ASSERT_OK(kvp_chain_create(h, &co, &ex, NULL, &ch));
    extend_random(ch, c->tokens, c->n_tokens);
    for (size_t i = 0; i < nb; i++) {
      uint8_t want[32], got[32];
      hex_decode(c->hex[i], want, dlen);
      ASSERT_EQ(kvp_chain_digest(ch, i, got, sizeof got), (int)dlen);
      ASSERT_MEM_EQ(got, want, dlen);
      ASSERT_EQ(k[i].lo, c->external[i]); /* vLLM's 64-bit external form */
      ASSERT_EQ(k[i].hi, be64(want + dlen - 16));
      ASSERT_KEY_EQ(kvp_chain_keys(ch)[i], k[i]);
    }
    kvp_chain_destroy(ch);
    kvp_hasher_destroy(h);
    free(k);
  }
}

/* ---- properties ---------------------------------------------------------- */
static const uint32_t prop_bs[] = {1, 3, 16, 32};

TEST(prefix_property_random) {
  for (int a = 0; a < N_ALGOS; a++) {
    for (int it = 0; it < 25; it++) {
      uint32_t bs = prop_bs[kvt_rand_below(4)];
      kvp_hasher *h = mk_hasher((kvp_hash_algo)a, bs);
      size_t na = kvt_rand_below(300) + 1;
      uint32_t *ta = rand_tokens(na);
      rand_ex rx;
      rand_extras(&rx, na);
      /* b = a[0..d) ++ one different token ++ random tail */
      size_t d = kvt_rand_below(na), nb_tok = d + 1 + kvt_rand_below(200);
      uint32_t *tb = rand_tokens(nb_tok);
      memcpy(tb, ta, d * sizeof *ta);
      tb[d] = ta[d] + 1 + (uint32_t)kvt_rand_below(1000);
      size_t nka, nkb;
      kvp_key *ka = oneshot(h, ta, na, &rx.ex, &nka);
      kvp_key *kb = oneshot(h, tb, nb_tok, &rx.ex, &nkb);
      for (size_t i = 0; i < nka && i < nkb; i++) {
        if ((i + 1) * bs <= d)
          ASSERT_KEY_EQ(ka[i], kb[i]);
        else
          ASSERT_FALSE(kvp_key_eq(ka[i], kb[i]));
      }
      /* a pure prefix of a has a's first keys */
      size_t np = kvt_rand_below(na + 1), nkp;
      kvp_key *kp = oneshot(h, ta, np, &rx.ex, &nkp);
      for (size_t i = 0; i < nkp; i++)
        ASSERT_KEY_EQ(kp[i], ka[i]);
      free(kp);
      free(ka);
      free(kb);
      free(ta);
      free(tb);
      kvp_hasher_destroy(h);
    }
  }
}

static void check_incremental(kvp_hash_algo algo, uint32_t bs) {
  kvp_hasher *h = mk_hasher(algo, bs);
  size_t n = kvt_rand_below(1500);
  uint32_t *t = rand_tokens(n);
  rand_ex rx;
  rand_extras(&rx, n);
  uint32_t g[2] = {bs * (uint32_t)(1 + kvt_rand_below(4)),
                   bs * (uint32_t)(5 + kvt_rand_below(8))};
  kvp_chain_opts co = {.chunk_tokens = {g[0], g[1]},
                       .keep_digests = (int)kvt_rand_below(2)};
  kvp_chain *c = NULL;
  ASSERT_OK(kvp_chain_create(h, &co, &rx.ex, NULL, &c));
  size_t nb;
  kvp_key *k = oneshot(h, t, n, &rx.ex, &nb);
  for (int round = 0; round < 2; round++) { /* then again after a reset */
    extend_random(c, t, n);
    ASSERT_EQ(kvp_chain_len(c), nb);
    ASSERT_EQ(kvp_chain_tail(c), n % bs);
    for (size_t i = 0; i < nb; i++)
      ASSERT_KEY_EQ(kvp_chain_keys(c)[i], k[i]);
    for (int j = 0; j < 2; j++) {
      size_t nc = 99;
      const kvp_key *ck = kvp_chain_chunk_keys(c, g[j], &nc);
      ASSERT_NOT_NULL(ck);
      ASSERT_EQ(nc, n / g[j]);
      for (size_t q = 0; q < nc; q++)
        ASSERT_KEY_EQ(ck[q], chunk_key_ref(k[(q + 1) * (g[j] / bs) - 1], g[j]));
    }
    kvp_chain_reset(c);
    ASSERT_EQ(kvp_chain_len(c), 0u);
    ASSERT_EQ(kvp_chain_tokens(c), 0u);
    ASSERT_EQ(kvp_chain_tail(c), 0u);
  }
  kvp_chain_destroy(c);
  kvp_hasher_destroy(h);
  free(k);
  free(t);
}

TEST(incremental_equals_oneshot) {
  for (int a = 0; a < N_ALGOS; a++)
    for (int it = 0; it < 12; it++)
      check_incremental((kvp_hash_algo)a, prop_bs[kvt_rand_below(4)]);
  /* one token at a time, with a placeholder crossing every boundary */
  kvp_mm_span mm[] = {{"i", 5, 40}, {"j", 45, 0}, {"k", 46, 3}};
  kvp_extras ex = {"l", "s", mm, 3};
  for (int a = 0; a < N_ALGOS; a++) {
    kvp_hasher *h = mk_hasher((kvp_hash_algo)a, 16);
    uint32_t *t = rand_tokens(100);
    size_t nb;
    kvp_key *k = oneshot(h, t, 100, &ex, &nb);
    kvp_chain *c = NULL;
    ASSERT_OK(kvp_chain_create(h, NULL, &ex, NULL, &c));
    for (size_t i = 0; i < 100; i++)
      ASSERT_EQ(kvp_chain_extend(c, t + i, 1), (i + 1) % 16 == 0 ? 1 : 0);
    ASSERT_EQ(kvp_chain_len(c), nb);
    for (size_t i = 0; i < nb; i++)
      ASSERT_KEY_EQ(kvp_chain_keys(c)[i], k[i]);
    kvp_chain_destroy(c);
    kvp_hasher_destroy(h);
    free(k);
    free(t);
  }
}

/* Every key of `a` differs from the same block of `b`. */
static void assert_all_differ(const kvp_key *a, const kvp_key *b, size_t n) {
  for (size_t i = 0; i < n; i++)
    ASSERT_FALSE(kvp_key_eq(a[i], b[i]));
}

static kvp_key *keys_for_desc(const kvp_namespace_desc *d, kvp_hash_algo algo,
                              const uint32_t *t, size_t n, size_t *nb) {
  kvp_namespace ns;
  ASSERT_OK(kvp_namespace_init(d, &ns));
  kvp_hasher *h = mk_hasher_ns(&ns, algo, "0");
  kvp_key *k = oneshot(h, t, n, NULL, nb);
  kvp_hasher_destroy(h);
  return k;
}

TEST(namespace_isolation) {
  const size_t n = 16 * 20;
  uint32_t *t = rand_tokens(n);
  const kvp_namespace_desc base = {"model-a", "tok@1", "nhd:bf16", 16, NULL};
  kvp_namespace_desc v[5];
  for (int i = 0; i < 5; i++)
    v[i] = base;
  v[0].model_id = "model-b";
  v[1].tokenizer_id = "tok@2";
  v[2].kv_layout = "nhd:fp8";
  v[3].tenant_salt = "tenant-1";
  v[4].tokenizer_id = NULL;     /* "" */
  for (int a = 0; a < 2; a++) { /* native modes mix the namespace in */
    size_t nb, nv;
    kvp_key *kb = keys_for_desc(&base, (kvp_hash_algo)a, t, n, &nb);
    ASSERT_EQ(nb, 20u);
    for (int i = 0; i < 5; i++) {
      kvp_key *kv = keys_for_desc(&v[i], (kvp_hash_algo)a, t, n, &nv);
      assert_all_differ(kb, kv, nb);
      free(kv);
    }
    /* tenants isolate one another, not only from the shared space */
    kvp_namespace_desc t2 = v[3];
    t2.tenant_salt = "tenant-2";
    kvp_key *k1 = keys_for_desc(&v[3], (kvp_hash_algo)a, t, n, &nv);
    kvp_key *k2 = keys_for_desc(&t2, (kvp_hash_algo)a, t, n, &nv);
    assert_all_differ(k1, k2, nv);
    free(k1);
    free(k2);
    free(kb);
  }
  /* block size is in the namespace too */
  kvp_namespace_desc b8 = base;
  b8.block_size = 8;
  kvp_namespace n16, n8;
  ASSERT_OK(kvp_namespace_init(&base, &n16));
  ASSERT_OK(kvp_namespace_init(&b8, &n8));
  ASSERT_FALSE(kvp_key_eq(n16.seed, n8.seed));
  /* vLLM modes reproduce vLLM: the namespace is NOT mixed in */
  for (int a = 2; a < N_ALGOS; a++) {
    size_t nb, nv;
    kvp_key *kb = keys_for_desc(&base, (kvp_hash_algo)a, t, n, &nb);
    kvp_key *kv = keys_for_desc(&v[3], (kvp_hash_algo)a, t, n, &nv);
    for (size_t i = 0; i < nb; i++)
      ASSERT_KEY_EQ(kb[i], kv[i]);
    free(kb);
    free(kv);
  }
  free(t);
}

/* Keys of t under `ex` against keys under no extras: blocks < first_diff
 * equal, the rest all differ. */
static void check_extras_effect(kvp_hasher *h, const uint32_t *t, size_t n,
                                const kvp_extras *ex, size_t first_diff) {
  size_t nb0, nb1;
  kvp_key *k0 = oneshot(h, t, n, NULL, &nb0);
  kvp_key *k1 = oneshot(h, t, n, ex, &nb1);
  ASSERT_EQ(nb0, nb1);
  ASSERT_LT(first_diff, nb0);
  for (size_t i = 0; i < nb0; i++) {
    if (i < first_diff)
      ASSERT_KEY_EQ(k0[i], k1[i]);
    else
      ASSERT_FALSE(kvp_key_eq(k0[i], k1[i]));
  }
  free(k0);
  free(k1);
}

TEST(extras_change_keys) {
  const size_t n = 16 * 12;
  uint32_t *t = rand_tokens(n);
  kvp_mm_span mm5[] = {{"img", 5 * 16 + 3, 20}};   /* blocks 5-6 */
  kvp_mm_span mm_end[] = {{"img", 4 * 16 - 8, 8}}; /* ends at block 4's start */
  for (int a = 0; a < N_ALGOS; a++) {
    kvp_hasher *h = mk_hasher((kvp_hash_algo)a, 16);
    check_extras_effect(h, t, n, &(kvp_extras){.lora_name = "lora"}, 0);
    /* salt enters block 0 only; chaining carries it to every block */
    check_extras_effect(h, t, n, &(kvp_extras){.cache_salt = "s"}, 0);
    check_extras_effect(h, t, n, &(kvp_extras){.mm = mm5, .n_mm = 1}, 5);
    /* vLLM keys the block that starts where a placeholder ends, too */
    check_extras_effect(h, t, n, &(kvp_extras){.mm = mm_end, .n_mm = 1}, 3);
    /* "" is no extra at all */
    size_t n0, n1;
    kvp_key *k0 = oneshot(h, t, n, NULL, &n0);
    kvp_key *k1 = oneshot(h, t, n, &(kvp_extras){"", "", mm5, 0}, &n1);
    for (size_t i = 0; i < n0; i++)
      ASSERT_KEY_EQ(k0[i], k1[i]);
    free(k0);
    free(k1);
    kvp_hasher_destroy(h);
  }
  free(t);
}

TEST(python_hash_seed_changes_vllm_keys) {
  const size_t n = 16 * 6;
  uint32_t *t = rand_tokens(n);
  kvp_namespace ns = mk_ns("m", 16, NULL);
  for (int a = 2; a < N_ALGOS; a++) {
    kvp_hasher *h0 = mk_hasher_ns(&ns, (kvp_hash_algo)a, "0");
    kvp_hasher *h1 = mk_hasher_ns(&ns, (kvp_hash_algo)a, "1");
    size_t n0, n1;
    kvp_key *k0 = oneshot(h0, t, n, NULL, &n0);
    kvp_key *k1 = oneshot(h1, t, n, NULL, &n1);
    assert_all_differ(k0, k1, n0);
    free(k0);
    free(k1);
    kvp_hasher_destroy(h0);
    kvp_hasher_destroy(h1);
  }
  /* native modes ignore it */
  kvp_hasher *h0 = mk_hasher_ns(&ns, KVP_HASH_XXH3_128, "0");
  kvp_hasher *h1 = mk_hasher_ns(&ns, KVP_HASH_XXH3_128, NULL);
  size_t n0, n1;
  kvp_key *k0 = oneshot(h0, t, n, NULL, &n0);
  kvp_key *k1 = oneshot(h1, t, n, NULL, &n1);
  for (size_t i = 0; i < n0; i++)
    ASSERT_KEY_EQ(k0[i], k1[i]);
  free(k0);
  free(k1);
  kvp_hasher_destroy(h0);
  kvp_hasher_destroy(h1);
  free(t);
}

TEST(chains_share_hasher) {
  /* chain state lives in the chain: interleaved chains on one hasher */
  for (int a = 0; a < N_ALGOS; a++) {
    kvp_hasher *h = mk_hasher((kvp_hash_algo)a, 16);
    uint32_t *t1 = rand_tokens(400), *t2 = rand_tokens(400);
    kvp_mm_span mm[] = {{"x", 30, 50}};
    kvp_extras e2 = {"lora", "salt", mm, 1};
    kvp_chain *c1 = NULL, *c2 = NULL;
    ASSERT_OK(kvp_chain_create(h, NULL, NULL, NULL, &c1));
    ASSERT_OK(kvp_chain_create(h, NULL, &e2, NULL, &c2));
    for (size_t pos = 0; pos < 400; pos += 40) {
      ASSERT_OK(kvp_chain_extend(c1, t1 + pos, 40));
      ASSERT_OK(kvp_chain_extend(c2, t2 + pos, 40));
    }
    size_t n1, n2;
    kvp_key *k1 = oneshot(h, t1, 400, NULL, &n1);
    kvp_key *k2 = oneshot(h, t2, 400, &e2, &n2);
    ASSERT_EQ(kvp_chain_len(c1), n1);
    ASSERT_EQ(kvp_chain_len(c2), n2);
    for (size_t i = 0; i < n1; i++) {
      ASSERT_KEY_EQ(kvp_chain_keys(c1)[i], k1[i]);
      ASSERT_KEY_EQ(kvp_chain_keys(c2)[i], k2[i]);
    }
    kvp_chain_destroy(c1);
    kvp_chain_destroy(c2);
    kvp_hasher_destroy(h);
    free(k1);
    free(k2);
    free(t1);
    free(t2);
  }
}

/* ---- bad input ----------------------------------------------------------- */
TEST(bad_namespace) {
  log_begin();
  kvp_namespace ns;
  kvp_namespace_desc d = {.model_id = "m", .block_size = 16};
  ASSERT_ERR(kvp_namespace_init(NULL, &ns), KVP_EINVAL);
  ASSERT_LOGGED("NULL");
  ASSERT_ERR(kvp_namespace_init(&d, NULL), KVP_EINVAL);
  ASSERT_LOGGED("NULL");
  const struct {
    kvp_namespace_desc d;
    const char *field;
  } bad[] = {
      {{NULL, "t", "l", 16, NULL}, "model_id"},
      {{"", "t", "l", 16, NULL}, "model_id"},
      {{"m", "t", "l", 0, NULL}, "block_size"},
      {{"m", "t", "l", KVP_BLOCK_SIZE_MAX + 1, NULL}, "block_size"},
      {{"m\xc3", "t", "l", 16, NULL}, "model_id"},
      {{"m", "t\xed\xa0\x80", "l", 16, NULL}, "tokenizer_id"},
      {{"m", "t", "\xff", 16, NULL}, "kv_layout"},
      {{"m", "t", "l", 16,
        "ten\xc0\xaf"
        "ant"},
       "tenant_salt"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ASSERT_ERR(kvp_namespace_init(&bad[i].d, &ns), KVP_EINVAL);
    ASSERT_LOGGED(bad[i].field);
  }
  d.block_size = KVP_BLOCK_SIZE_MAX;
  ASSERT_OK(kvp_namespace_init(&d, &ns));
  ASSERT_EQ(log_count, 0);
  log_end();
}

TEST(bad_hasher) {
  log_begin();
  kvp_namespace ns = mk_ns("m", 16, NULL), zero = {{0, 0}, 0, 0};
  kvp_hasher *h = (kvp_hasher *)&ns; /* must be reset to NULL on failure */
  kvp_hasher_opts o = {.algo = (kvp_hash_algo)4};
  ASSERT_ERR(kvp_hasher_create(NULL, NULL, NULL, &h), KVP_EINVAL);
  ASSERT_NULL(h);
  ASSERT_LOGGED("NULL");
  ASSERT_ERR(kvp_hasher_create(&ns, NULL, NULL, NULL), KVP_EINVAL);
  ASSERT_LOGGED("NULL");
  ASSERT_ERR(kvp_hasher_create(&ns, &o, NULL, &h), KVP_EINVAL);
  ASSERT_LOGGED("algo");
  ASSERT_ERR(kvp_hasher_create(&zero, NULL, NULL, &h), KVP_EINVAL);
  ASSERT_LOGGED("block_size");
  o = (kvp_hasher_opts){.algo = KVP_HASH_SHA256_CBOR};
  ASSERT_ERR(kvp_hasher_create(&ns, &o, NULL, &h), KVP_EINVAL);
  ASSERT_LOGGED("python_hash_seed");
  o = (kvp_hasher_opts){.algo = KVP_HASH_XXHASH_CBOR,
                        .python_hash_seed = "\x80"};
  ASSERT_ERR(kvp_hasher_create(&ns, &o, NULL, &h), KVP_EINVAL);
  ASSERT_LOGGED("python_hash_seed");
  ASSERT_NULL(h);
  kvp_hasher_destroy(NULL);
  ASSERT_EQ(kvp_hasher_block_size(NULL), 0u);
  ASSERT_EQ((int)kvp_hasher_algo(NULL), (int)KVP_HASH_XXH3_128);
  log_end();
}

TEST(bad_hash_input) {
  log_begin();
  kvp_hasher *h = mk_hasher(KVP_HASH_XXH3_128, 16);
  ASSERT_EQ((int)kvp_hasher_algo(h), (int)KVP_HASH_XXH3_128);
  ASSERT_EQ(kvp_hasher_block_size(h), 16u);
  uint32_t t[40] = {1, 2, 3};
  kvp_key k[3];
  size_t tail = 99;
  ASSERT_ERR(kvp_hasher_hash(NULL, t, 40, NULL, k, 3, &tail), KVP_EINVAL);
  ASSERT_LOGGED("hasher");
  ASSERT_ERR(kvp_hasher_hash(h, NULL, 40, NULL, k, 3, &tail), KVP_EINVAL);
  ASSERT_LOGGED("tokens");
  ASSERT_ERR(kvp_hasher_hash(h, t, 40, NULL, NULL, 3, &tail), KVP_EINVAL);
  ASSERT_LOGGED("keys");
  ASSERT_EQ(tail, 99u);
  /* zero tokens, short input, count-only queries are fine */
  ASSERT_EQ(kvp_hasher_hash(h, NULL, 0, NULL, NULL, 0, &tail), 0);
  ASSERT_EQ(tail, 0u);
  ASSERT_EQ(kvp_hasher_hash(h, t, 15, NULL, k, 3, &tail), 0);
  ASSERT_EQ(tail, 15u);
  ASSERT_EQ(kvp_hasher_hash(h, t, 40, NULL, NULL, 0, NULL), 2);
  /* cap < blocks: the full count, only cap keys written */
  kvp_key full[2], part[3] = {{7, 7}, {7, 7}, {7, 7}};
  ASSERT_EQ(kvp_hasher_hash(h, t, 40, NULL, full, 2, NULL), 2);
  ASSERT_EQ(kvp_hasher_hash(h, t, 40, NULL, part, 1, &tail), 2);
  ASSERT_KEY_EQ(part[0], full[0]);
  ASSERT_KEY_EQ(part[1], ((kvp_key){7, 7}));
  ASSERT_EQ(tail, 8u);
  ASSERT_EQ(log_count, 0);
  /* extras */
  kvp_mm_span ok_mm[] = {{"a", 0, 4}, {"b", 4, 4}};
  kvp_mm_span null_id[] = {{"a", 0, 4}, {NULL, 8, 4}};
  kvp_mm_span bad_id[] = {{"\xc3\x28", 0, 4}};
  kvp_mm_span unsorted[] = {{"a", 9, 4}, {"b", 8, 4}};
  kvp_mm_span overflow[] = {{"a", UINT64_MAX - 2, 4}};
  const struct {
    kvp_extras e;
    const char *what;
  } bad[] = {
      {{"lo\xe0\x80\x80ra", NULL, NULL, 0}, "lora_name"},
      {{NULL, "\xf8", NULL, 0}, "cache_salt"},
      {{NULL, NULL, null_id, 2}, "mm[1].id"},
      {{NULL, NULL, bad_id, 1}, "mm[0].id"},
      {{NULL, NULL, unsorted, 2}, "sorted"},
      {{NULL, NULL, NULL, 1}, "mm is NULL"},
      {{NULL, NULL, overflow, 1}, "overflow"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ASSERT_ERR(kvp_hasher_hash(h, t, 40, &bad[i].e, k, 3, NULL), KVP_EINVAL);
    ASSERT_LOGGED(bad[i].what);
    kvp_chain *c = (kvp_chain *)h;
    ASSERT_ERR(kvp_chain_create(h, NULL, &bad[i].e, NULL, &c), KVP_EINVAL);
    ASSERT_LOGGED(bad[i].what);
    ASSERT_NULL(c);
  }
  kvp_extras good = {NULL, NULL, ok_mm, 2}; /* equal offsets are sorted */
  ok_mm[1].offset = 0;
  ASSERT_EQ(kvp_hasher_hash(h, t, 40, &good, k, 3, NULL), 2);
  ASSERT_EQ(log_count, 0);
  kvp_hasher_destroy(h);
  log_end();
}

TEST(bad_chain_input) {
  log_begin();
  kvp_hasher *h = mk_hasher(KVP_HASH_SHA256, 16);
  kvp_chain *c = NULL;
  ASSERT_ERR(kvp_chain_create(NULL, NULL, NULL, NULL, &c), KVP_EINVAL);
  ASSERT_LOGGED("NULL");
  ASSERT_ERR(kvp_chain_create(h, NULL, NULL, NULL, NULL), KVP_EINVAL);
  ASSERT_LOGGED("NULL");
  kvp_chain_opts o = {.chunk_tokens = {64, 24}};
  ASSERT_ERR(kvp_chain_create(h, &o, NULL, NULL, &c), KVP_EINVAL);
  ASSERT_LOGGED("chunk_tokens[1] = 24");
  o = (kvp_chain_opts){.chunk_tokens = {64, 32, 64}};
  ASSERT_ERR(kvp_chain_create(h, &o, NULL, NULL, &c), KVP_EINVAL);
  ASSERT_LOGGED("twice");
  ASSERT_NULL(c);
  /* 0 ends the list: 48 is not asked for */
  o = (kvp_chain_opts){.chunk_tokens = {32, 0, 48}};
  ASSERT_OK(kvp_chain_create(h, &o, NULL, NULL, &c));
  size_t n = 99;
  ASSERT_NULL(kvp_chain_chunk_keys(c, 48, &n));
  ASSERT_EQ(n, 0u);
  ASSERT_NOT_NULL(kvp_chain_chunk_keys(c, 32, &n)); /* asked, none yet */
  ASSERT_EQ(n, 0u);
  ASSERT_NOT_NULL(kvp_chain_keys(c));
  uint32_t t[40] = {5};
  ASSERT_EQ(kvp_chain_extend(c, t, 20), 1);
  ASSERT_ERR(kvp_chain_extend(c, NULL, 20), KVP_EINVAL);
  ASSERT_LOGGED("tokens");
  ASSERT_ERR(kvp_chain_extend(NULL, t, 20), KVP_EINVAL);
  ASSERT_LOGGED("chain");
  ASSERT_EQ(kvp_chain_extend(c, NULL, 0), 0);
  ASSERT_EQ(kvp_chain_len(c), 1u);
  ASSERT_EQ(kvp_chain_tokens(c), 20u);
  ASSERT_EQ(kvp_chain_tail(c), 4u);
  /* digests: off by default */
  uint8_t d[32];
  ASSERT_ERR(kvp_chain_digest(c, 0, d, sizeof d), KVP_ESTATE);
  ASSERT_ERR(kvp_chain_digest(c, 0, NULL, sizeof d), KVP_EINVAL);
  ASSERT_LOGGED("buf");
  ASSERT_ERR(kvp_chain_digest(NULL, 0, d, sizeof d), KVP_EINVAL);
  ASSERT_LOGGED("chain");
  kvp_chain_destroy(c);
  o = (kvp_chain_opts){.keep_digests = 1};
  ASSERT_OK(kvp_chain_create(h, &o, NULL, NULL, &c));
  ASSERT_EQ(kvp_chain_extend(c, t, 40), 2);
  ASSERT_EQ(kvp_chain_digest(c, 1, d, sizeof d), 32);
  ASSERT_EQ(kvp_chain_keys(c)[1].lo, be64(d + 24)); /* sha256: last 16 bytes */
  ASSERT_EQ(kvp_chain_keys(c)[1].hi, be64(d + 16));
  ASSERT_ERR(kvp_chain_digest(c, 2, d, sizeof d), KVP_ERANGE);
  ASSERT_ERR(kvp_chain_digest(c, 0, d, 31), KVP_ENOSPC);
  kvp_chain_reset(c);
  ASSERT_ERR(kvp_chain_digest(c, 0, d, sizeof d), KVP_ERANGE);
  kvp_chain_destroy(c);
  /* NULL everywhere else */
  kvp_chain_destroy(NULL);
  kvp_chain_reset(NULL);
  ASSERT_EQ(kvp_chain_len(NULL), 0u);
  ASSERT_EQ(kvp_chain_tokens(NULL), 0u);
  ASSERT_EQ(kvp_chain_tail(NULL), 0u);
  ASSERT_NULL(kvp_chain_keys(NULL));
  ASSERT_NULL(kvp_chain_chunk_keys(NULL, 32, NULL));
  kvp_hasher_destroy(h);
  log_end();
}

/* ---- allocator hooks ----------------------------------------------------- */
typedef struct track_alloc {
  size_t live_bytes, allocs, frees;
  long fail_from; /* allocations with this index and later fail; -1: none */
  void *ptr[64];
  size_t size[64];
} track_alloc;

static void *ta_alloc(void *o, size_t n) {
  track_alloc *t = o;
  if (t->fail_from >= 0 && (long)t->allocs >= t->fail_from)
    return NULL;
  void *p = malloc(n);
  ASSERT_NOT_NULL(p);
  size_t i = 0;
  while (i < 64 && t->ptr[i] != NULL)
    i++;
  ASSERT_LT(i, 64u);
  t->ptr[i] = p;
  t->size[i] = n;
  t->allocs++;
  t->live_bytes += n;
  return p;
}

static void ta_free(void *o, void *p, size_t n) {
  track_alloc *t = o;
  size_t i = 0;
  while (i < 64 && t->ptr[i] != p)
    i++;
  ASSERT_LT(i, 64u);        /* freed what it allocated */
  ASSERT_EQ(t->size[i], n); /* with the size it asked for */
  t->ptr[i] = NULL;
  t->frees++;
  t->live_bytes -= n;
  free(p);
}

TEST(allocator_hooks) {
  kvp_namespace ns = mk_ns("m", 16, NULL);
  kvp_mm_span mm[] = {{"img", 100, 300}};
  kvp_extras ex = {"lora", "salt", mm, 1};
  for (int a = 0; a < N_ALGOS; a++) {
    track_alloc ta = {.fail_from = -1};
    kvp_allocator al = {ta_alloc, ta_free, &ta};
    kvp_hasher_opts o = {.algo = (kvp_hash_algo)a, .python_hash_seed = "0"};
    kvp_hasher *h = NULL;
    ASSERT_OK(kvp_hasher_create(&ns, &o, &al, &h));
    ASSERT_GE(ta.allocs, 2u); /* the hasher and its scratch */
    size_t after_hasher = ta.allocs;
    kvp_chain_opts co = {.chunk_tokens = {64, 256}, .keep_digests = 1};
    kvp_chain *c = NULL;
    ASSERT_OK(kvp_chain_create(h, &co, &ex, &al, &c));
    ASSERT_GE(ta.allocs, after_hasher + 3); /* chain, tail, extras copy */
    uint32_t *t = rand_tokens(5000);
    extend_random(c, t, 5000);
    ASSERT_GE(ta.allocs, after_hasher + 3 + 4); /* keys, digests, chunks grew */
    ASSERT_EQ(ta.allocs - ta.frees,
              after_hasher + 3 + 4); /* grown, not leaked */
    kvp_chain_destroy(c);
    kvp_hasher_destroy(h);
    ASSERT_EQ(ta.live_bytes, 0u);
    ASSERT_EQ(ta.allocs, ta.frees);
    free(t);
  }
}

TEST(out_of_memory) {
  kvp_namespace ns = mk_ns("m", 16, NULL);
  kvp_mm_span mm[] = {{"img", 10, 30}};
  kvp_extras ex = {"lora", "salt", mm, 1};
  for (int a = 0; a < N_ALGOS; a++) {
    kvp_hasher_opts o = {.algo = (kvp_hash_algo)a, .python_hash_seed = "0"};
    /* every allocation of create fails in turn, and nothing leaks */
    int failures = 0;
    for (long k = 0;; k++) {
      track_alloc ta = {.fail_from = k};
      kvp_allocator al = {ta_alloc, ta_free, &ta};
      kvp_hasher *h = NULL;
      int rc = kvp_hasher_create(&ns, &o, &al, &h);
      if (rc == 0) {
        kvp_hasher_destroy(h);
        ASSERT_EQ(ta.live_bytes, 0u);
        break;
      }
      ASSERT_ERR(rc, KVP_ENOMEM);
      ASSERT_NULL(h);
      ASSERT_EQ(ta.live_bytes, 0u);
      failures++;
    }
    ASSERT_GE(failures, 2);
    kvp_hasher *h = mk_hasher_ns(&ns, (kvp_hash_algo)a, "0");
    kvp_chain_opts co = {.chunk_tokens = {32}, .keep_digests = 1};
    failures = 0;
    for (long k = 0;; k++) {
      track_alloc ta = {.fail_from = k};
      kvp_allocator al = {ta_alloc, ta_free, &ta};
      kvp_chain *c = NULL;
      int rc = kvp_chain_create(h, &co, &ex, &al, &c);
      if (rc == 0) {
        kvp_chain_destroy(c);
        ASSERT_EQ(ta.live_bytes, 0u);
        break;
      }
      ASSERT_ERR(rc, KVP_ENOMEM);
      ASSERT_NULL(c);
      ASSERT_EQ(ta.live_bytes, 0u);
      failures++;
    }
    ASSERT_EQ(failures, 3);
    /* a failed extend leaves the chain as it was, tail included: the k-th
     * allocation of the extend fails (keys, digests, chunk keys), then none */
    uint32_t *t = rand_tokens(5100);
    size_t nb;
    kvp_key *k = oneshot(h, t, 5100, &ex, &nb);
    failures = 0;
    for (long nth = 0;; nth++) {
      track_alloc ta = {.fail_from = -1};
      kvp_allocator al = {ta_alloc, ta_free, &ta};
      kvp_chain *c = NULL;
      ASSERT_OK(kvp_chain_create(h, &co, &ex, &al, &c));
      ASSERT_EQ(kvp_chain_extend(c, t, 100), 6);
      ta.fail_from = (long)ta.allocs + nth;
      int rc = kvp_chain_extend(c, t + 100, 5000);
      bool failed = rc == KVP_ENOMEM;
      if (failed) {
        failures++;
        ASSERT_EQ(kvp_chain_len(c), 6u);
        ASSERT_EQ(kvp_chain_tail(c), 4u);
        ASSERT_EQ(kvp_chain_tokens(c), 100u);
        size_t nc = 0;
        ASSERT_NOT_NULL(kvp_chain_chunk_keys(c, 32, &nc));
        ASSERT_EQ(nc, 3u);
        ta.fail_from = -1; /* and it carries on from where it was */
        rc = kvp_chain_extend(c, t + 100, 5000);
      }
      ASSERT_EQ(rc, (int)(nb - 6));
      ASSERT_EQ(kvp_chain_len(c), nb);
      for (size_t i = 0; i < nb; i++)
        ASSERT_KEY_EQ(kvp_chain_keys(c)[i], k[i]);
      kvp_chain_destroy(c);
      ASSERT_EQ(ta.live_bytes, 0u);
      if (!failed)
        break; /* the nth allocation was past the last one extend makes */
    }
    ASSERT_EQ(failures, 3);
    kvp_hasher_destroy(h);
    free(k);
    free(t);
  }
}

TEST_MAIN(TEST_ENTRY(algo_names), TEST_ENTRY(namespace_golden),
          TEST_ENTRY(native_chain_golden), TEST_ENTRY(vllm_golden),
          TEST_ENTRY(prefix_property_random),
          TEST_ENTRY(incremental_equals_oneshot),
          TEST_ENTRY(namespace_isolation), TEST_ENTRY(extras_change_keys),
          TEST_ENTRY(python_hash_seed_changes_vllm_keys),
          TEST_ENTRY(chains_share_hasher), TEST_ENTRY(bad_namespace),
          TEST_ENTRY(bad_hasher), TEST_ENTRY(bad_hash_input),
          TEST_ENTRY(bad_chain_input), TEST_ENTRY(allocator_hooks),
          TEST_ENTRY(out_of_memory))
