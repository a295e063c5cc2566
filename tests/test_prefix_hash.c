/* SPDX-License-Identifier: Apache-2.0 */
/* router/prefix block hashing: golden vectors (native algorithms from an
 * independent Python implementation, vLLM modes from vLLM's own scheme), the
 * prefix property, incremental == one-shot, block by block == the chain,
 * isolation, NONE_HASH seeds, the extra keys of each vLLM release, bad input
 * and the allocator hooks.  The full vLLM vector files are
 * test_prefix_vectors.c's; the pickle writer against CPython is
 * test_prefix_pickle.py's. */
#include <xxhash.h>

#include "core_internal.h"
#include "data/native_chain_vectors.h"
#include "prefix_internal.h"
#include "test_harness.h"

#define N_ALGOS 6
#define N_COMPAT 3 /* kvp_vllm_compat values */

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

static kvp_hasher *mk_hasher_c(const kvp_namespace *ns, kvp_hash_algo algo,
                               const char *py_seed, uint32_t compat) {
  kvp_hasher_opts o = {
      .algo = algo, .python_hash_seed = py_seed, .vllm_compat = compat};
  kvp_hasher *h = NULL;
  ASSERT_OK(kvp_hasher_create(ns, &o, NULL, &h));
  ASSERT_NOT_NULL(h);
  return h;
}

static kvp_hasher *mk_hasher_ns(const kvp_namespace *ns, kvp_hash_algo algo,
                                const char *py_seed) {
  return mk_hasher_c(ns, algo, py_seed, KVP_VLLM_COMPAT_LATEST);
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

/* Random extras: maybe a LoRA (with or without a path), maybe a salt, 0-4
 * sorted placeholders that may start before, straddle or end on or past
 * block boundaries (or be empty), maybe prompt-embeddings digests for up to
 * EMBEDS_MAX blocks. */
#define EMBEDS_MAX 2048
typedef struct rand_ex {
  kvp_extras ex;
  kvp_mm_span mm[4];
  char ids[4][16];
  uint8_t embeds[EMBEDS_MAX][32];
} rand_ex;

static void rand_extras(rand_ex *r, size_t n_tokens) {
  memset(&r->ex, 0, sizeof r->ex);
  if (kvt_rand_below(3) == 0)
    r->ex.lora_name = kvt_rand_below(2) ? "lora-a" : "lora-\xc3\xa9";
  if (kvt_rand_below(2) == 0)
    r->ex.lora_path = kvt_rand_below(2) ? "/lora/a" : "";
  if (kvt_rand_below(3) == 0)
    r->ex.cache_salt = "salt-1";
  size_t n_mm = kvt_rand_below(5);
  uint64_t off = 0;
  for (size_t i = 0; i < n_mm; i++) {
    off += kvt_rand_below(n_tokens / 2 + 2);
    snprintf(r->ids[i], sizeof r->ids[i], "img-%zu", i);
    /* some end on a multiple of 16 (where the vLLM releases differ) */
    uint64_t len = kvt_rand_below(4) == 0 ? 16 - off % 16 : kvt_rand_below(40);
    r->mm[i] = (kvp_mm_span){r->ids[i], off, len};
  }
  r->ex.mm = r->mm;
  r->ex.n_mm = n_mm;
  if (kvt_rand_below(4) == 0) {
    for (size_t i = 0; i < EMBEDS_MAX; i++)
      for (size_t k = 0; k < 32; k++)
        r->embeds[i][k] = (uint8_t)kvt_rand_below(256);
    r->ex.prompt_embeds = (const uint8_t(*)[32])r->embeds;
    r->ex.n_prompt_embeds = EMBEDS_MAX;
  }
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
  static const char *const names[N_ALGOS] = {
      "xxh3_128",    "sha256",      "sha256_cbor",
      "xxhash_cbor", "vllm_sha256", "vllm_xxhash"};
  static const size_t lens[N_ALGOS] = {16, 32, 32, 16, 32, 16};
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
  ASSERT_STR_EQ(kvp_hash_algo_name((kvp_hash_algo)N_ALGOS), "unknown");
  ASSERT_STR_EQ(kvp_hash_algo_name((kvp_hash_algo)-1), "unknown");
  ASSERT_EQ(kvp_hash_algo_digest_len((kvp_hash_algo)N_ALGOS), 0u);
  /* vLLM's --prefix-caching-hash-algo names: its "sha256" is the pickle mode,
   * not kvplane's native sha256 */
  static const struct {
    const char *vllm;
    kvp_hash_algo algo;
  } from[] = {{"sha256", KVP_HASH_VLLM_SHA256},
              {"sha256_cbor", KVP_HASH_SHA256_CBOR},
              {"xxhash", KVP_HASH_VLLM_XXHASH},
              {"xxhash_cbor", KVP_HASH_XXHASH_CBOR}};
  for (size_t i = 0; i < 4; i++) {
    ASSERT_OK(kvp_hash_algo_from_vllm(from[i].vllm, &out));
    ASSERT_EQ((int)out, (int)from[i].algo);
  }
  log_begin();
  ASSERT_ERR(kvp_hash_algo_from_vllm("xxh3_128", &out), KVP_EINVAL);
  ASSERT_LOGGED("\"xxh3_128\"");
  ASSERT_ERR(kvp_hash_algo_from_vllm("vllm_sha256", &out), KVP_EINVAL);
  ASSERT_LOGGED("unknown vLLM hash algorithm");
  ASSERT_ERR(kvp_hash_algo_from_vllm(NULL, &out), KVP_EINVAL);
  ASSERT_LOGGED("NULL name");
  ASSERT_ERR(kvp_hash_algo_from_vllm("sha256", NULL), KVP_EINVAL);
  ASSERT_LOGGED("NULL out");
  log_end();
  ASSERT_EQ((int)out, (int)KVP_HASH_XXHASH_CBOR); /* untouched */
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
  kvp_hasher *h = mk_hasher_c(&ns, algo, c->python_hash_seed, c->vllm_compat);
  kvp_extras ex = {.lora_name = c->lora_name,
                   .cache_salt = c->cache_salt,
                   .mm = c->mm,
                   .n_mm = c->n_mm,
                   .lora_path = c->lora_path,
                   .prompt_embeds = c->embeds,
                   .n_prompt_embeds = c->n_embeds};
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
  ASSERT_GE(n, 28u);
  for (size_t i = 0; i < n; i++)
    check_nv_case(&nv_cases[i]);
}

/* Literal cases of ../shared/vectors/vllm_block_hashes.json (vLLM before
 * 0.33), so the vLLM modes are checked even without that file. */
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
    kvp_hasher *h = mk_hasher_c(&ns, algo, c->seed, KVP_VLLM_COMPAT_PRE_0_33);
    kvp_extras ex = {
        .lora_name = c->lora, .cache_salt = c->salt, .mm = c->mm,
        .n_mm = c->n_mm};
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
  kvp_extras ex = {.lora_name = "l", .cache_salt = "s", .mm = mm, .n_mm = 3};
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
    kvp_key *k1 = oneshot(
        h, t, n,
        &(kvp_extras){.lora_name = "", .cache_salt = "", .mm = mm5, .n_mm = 0},
        &n1);
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
    kvp_extras e2 = {
        .lora_name = "lora", .cache_salt = "salt", .mm = mm, .n_mm = 1};
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


/* ---- vLLM 0.33: NONE_HASH seeds, extra keys, block by block --------------- */
/* NONE_HASH without PYTHONHASHSEED, from ../shared/vectors/
 * vllm033_block_hashes.json (none_hash_hex of cases 9 and 0). */
#define NONE_HASH_SHA256_DEFAULT                                               \
  "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"
#define NONE_HASH_SHA256_CBOR_DEFAULT                                          \
  "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"

TEST(none_hash_seed_rules) {
  kvp_namespace ns = mk_ns("m", 16, NULL);
  log_begin();
  for (int a = KVP_HASH_SHA256_CBOR; a < N_ALGOS; a++) {
    bool sha = kvp_hash_algo_digest_len((kvp_hash_algo)a) == 32;
    for (uint32_t c = 0; c < N_COMPAT; c++) {
      kvp_hasher_opts o = {.algo = (kvp_hash_algo)a, .vllm_compat = c};
      kvp_hasher *h = (kvp_hasher *)&ns;
      int rc = kvp_hasher_create(&ns, &o, NULL, &h);
      bool v033 = c != KVP_VLLM_COMPAT_PRE_0_33;
      if (!(sha && v033)) {
        /* vLLM draws random bytes there: nothing to reproduce */
        ASSERT_ERR(rc, KVP_EINVAL);
        ASSERT_NULL(h);
        ASSERT_LOGGED(v033 ? "random per-process" : "before vLLM 0.33");
        continue;
      }
      /* vLLM 0.33, sha256 / sha256_cbor: the fixed "vllm-none-hash" */
      ASSERT_OK(rc);
      uint8_t r[32], want[32];
      ASSERT_EQ(kvp__hasher_root(h, r), 32u);
      hex_decode(a == KVP_HASH_VLLM_SHA256 ? NONE_HASH_SHA256_DEFAULT
                                           : NONE_HASH_SHA256_CBOR_DEFAULT,
                 want, 32);
      ASSERT_MEM_EQ(r, want, 32);
      kvp_hasher *named = mk_hasher_c(&ns, (kvp_hash_algo)a, "vllm-none-hash",
                                      c);
      kvp_hasher *empty = mk_hasher_c(&ns, (kvp_hash_algo)a, "", c);
      ASSERT_EQ(kvp__hasher_root(named, want), 32u);
      ASSERT_MEM_EQ(r, want, 32);
      ASSERT_EQ(kvp__hasher_root(empty, want), 32u); /* "" is a seed */
      ASSERT_FALSE(memcmp(r, want, 32) == 0);
      kvp_hasher_destroy(named);
      kvp_hasher_destroy(empty);
      kvp_hasher_destroy(h);
    }
  }
  ASSERT_EQ(log_count, 0);
  log_end();
}

/* Literal cases of ../shared/vectors/vllm033_block_hashes.json (vLLM
 * 0.33.0's own functions), so the pickle modes are checked without it. */
/* case 40: xxhash (pickle), block 16, PYTHONHASHSEED 1560358459, lora +
 * path, mm, salt; extra keys [("lora", "adapter-36", "/models/lora/13"),
 * ("mm", "5d0f3b6de8b8d3c5", 3), ("cache_salt", "tenant-616")], then
 * [("lora", ...)] */
static const uint32_t v3_tok_xxh[] = {
    92374,  63666,  17309,  96083,  140061, 81430,  11267,  149321,
    92830,  135890, 3276,   100945, 25165,  585,    598,    150422,
    46936,  121150, 28594,  56762,  97817,  17408,  134224, 36160,
    105039, 48312,  114770, 24837,  135132, 71407,  125620, 47754,
    98173,  39581,  31702,  34987,  20367,  103846, 42275,  47816};
static const kvp_mm_span v3_mm_xxh[] = {{"5d0f3b6de8b8d3c5", 3, 1}};
static const char *const v3_hex_xxh[] = {"d4a43995a6636f5cc1225e7208ffd93c",
                                         "43941e076c39252130ec660872a99a11"};
static const uint64_t v3_ext_xxh[] = {13916789642398521660u,
                                      3525304794793744913u};
/* case 9: sha256 (pickle), block 16, PYTHONHASHSEED unset, no extras */
static const uint32_t v3_tok_sha[] = {
    137443, 45433,  9202,   138453, 52494,  54902,  116127, 75697,
    63706,  128577, 132616, 97354,  85170,  102755, 19261,  51181,
    47579,  49158,  77847,  111736, 124261, 95283,  6073,   127753,
    5414,   27464,  151509, 113369, 90073,  88838,  19414,  110149,
    51195,  134800, 129587, 147748, 144275};
static const char *const v3_hex_sha[] = {
    "9d142dcb9e28d9c97b2b46bfdc4e5706ef46300c6c45394283e6b8b46486c646",
    "2fe668a4c36323c9d55980c2e6becbf7293f9d40903f2d08f749682ad2ae8dea"};
static const uint64_t v3_ext_sha[] = {9504487148532188742u,
                                      17818887933800648170u};

static void check_v3(kvp_hash_algo algo, const char *seed,
                     const kvp_extras *ex, const uint32_t *t, size_t n,
                     const char *const *hex, const uint64_t *ext) {
  kvp_namespace ns = mk_ns("any", 16, NULL);
  kvp_hasher *h = mk_hasher_c(&ns, algo, seed, KVP_VLLM_COMPAT_0_33);
  size_t nb, dlen = kvp_hash_algo_digest_len(algo);
  kvp_key *k = oneshot(h, t, n, ex, &nb);
  ASSERT_EQ(nb, 2u);
  uint8_t want[32], got[32];
  for (size_t i = 0; i < nb; i++) {
    hex_decode(hex[i], want, dlen);
    ASSERT_EQ(k[i].lo, ext[i]);
    ASSERT_EQ(k[i].hi, be64(want + dlen - 16));
    /* block by block, as a KV-event consumer would (parent = full digest) */
    kvp_block_extras bx;
    kvp_mm_key mm[2];
    int n_mm = ex != NULL && i == 0 ? (int)ex->n_mm : 0; /* mm at 3..4 */
    ASSERT_EQ(kvp_hasher_block_extras(h, ex, i, &bx, mm, 2), n_mm);
    ASSERT_EQ(kvp_hasher_block(h, i ? got : NULL, dlen, t + 16 * i, &bx, got,
                               sizeof got, NULL),
              (int)dlen);
    ASSERT_MEM_EQ(got, want, dlen);
  }
  /* the default compat is 0.33 */
  kvp_hasher *d = mk_hasher_ns(&ns, algo, seed);
  kvp_key kd[2];
  ASSERT_EQ(kvp_hasher_hash(d, t, n, ex, kd, 2, NULL), 2);
  ASSERT_KEY_EQ(kd[1], k[1]);
  kvp_hasher_destroy(d);
  kvp_hasher_destroy(h);
  free(k);
}

TEST(vllm033_golden) {
  kvp_extras ex = {.lora_name = "adapter-36",
                   .lora_path = "/models/lora/13",
                   .cache_salt = "tenant-616",
                   .mm = v3_mm_xxh,
                   .n_mm = 1};
  check_v3(KVP_HASH_VLLM_XXHASH, "1560358459", &ex, v3_tok_xxh, 40,
           v3_hex_xxh, v3_ext_xxh);
  check_v3(KVP_HASH_VLLM_SHA256, NULL, NULL, v3_tok_sha, 37, v3_hex_sha,
           v3_ext_sha);
  /* vLLM's own digest, not only the same chain: the path is hashed */
  ex.lora_path = "/models/lora/14";
  kvp_namespace ns = mk_ns("any", 16, NULL);
  kvp_hasher *h = mk_hasher_ns(&ns, KVP_HASH_VLLM_XXHASH, "1560358459");
  kvp_key k[2];
  ASSERT_EQ(kvp_hasher_hash(h, v3_tok_xxh, 40, &ex, k, 2, NULL), 2);
  ASSERT_FALSE(k[0].lo == v3_ext_xxh[0]);
  kvp_hasher_destroy(h);
}

/* Expected extra keys of one block: lora (1/0), mm ids and offsets, salt. */
typedef struct want_keys {
  int lora;
  size_t n_mm;
  const char *ids[3];
  int64_t offs[3];
  int salt;
} want_keys;

static void check_block_keys(const kvp_hasher *h, const kvp_extras *ex,
                             size_t block, const want_keys *w) {
  kvp_block_extras bx;
  kvp_mm_key mm[3];
  ASSERT_EQ(kvp_hasher_block_extras(h, ex, block, &bx, mm, 3), (int)w->n_mm);
  ASSERT_EQ(bx.n_mm, w->n_mm);
  for (size_t i = 0; i < w->n_mm; i++) {
    ASSERT_STR_EQ(bx.mm[i].id, w->ids[i]);
    ASSERT_EQ(bx.mm[i].offset, w->offs[i]);
  }
  ASSERT_TRUE((bx.lora_name == ex->lora_name) == (w->lora != 0));
  ASSERT_TRUE(bx.lora_path == ex->lora_path); /* always handed through */
  ASSERT_TRUE((bx.cache_salt == ex->cache_salt) == (w->salt != 0));
  ASSERT_TRUE(bx.prompt_embeds == ex->prompt_embeds[block]);
}

TEST(extra_keys_per_release) {
  /* z: zero length at 16, where block 1 starts; big/small: nested, small
   * ending at 96 where block 6 starts while big holds the index */
  kvp_mm_span mm[] = {
      {"z", 16, 0}, {"b", 20, 12}, {"big", 40, 60}, {"small", 50, 46}};
  uint8_t emb[8][32] = {{1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}};
  kvp_extras ex = {.lora_name = "l", .lora_path = "/p", .cache_salt = "s",
                   .mm = mm, .n_mm = 4,
                   .prompt_embeds = (const uint8_t(*)[32])emb,
                   .n_prompt_embeds = 8};
  /* before 0.33: a placeholder ending where a block starts still keys it;
   * 0.33 passes it.  Native algorithms follow vllm_compat too: the events
   * subscriber re-keys blocks from the per-block keys a 0.33 engine
   * publishes, and a request hashed natively must key them alike. */
  const want_keys pre[8] = {
      {1, 0, {0}, {0}, 1},
      {1, 2, {"z", "b"}, {0, 4}, 0},
      {1, 1, {"big"}, {8}, 0},
      {1, 1, {"big"}, {-8}, 0}, /* [48, 64): small hides behind big */
      {1, 1, {"big"}, {-24}, 0},
      {1, 1, {"big"}, {-40}, 0},
      {1, 2, {"big", "small"}, {-56, -46}, 0}, /* [96, 112) */
      {1, 0, {0}, {0}, 0}};
  want_keys v33[8];
  memcpy(v33, pre, sizeof v33);
  v33[1] = (want_keys){1, 1, {"b"}, {4}, 0};
  /* vLLM 0.33's early exit looks at the last placeholder only: small ends
   * where block 6 starts, so big, still running, keys no more blocks */
  v33[6] = (want_keys){1, 0, {0}, {0}, 0};
  kvp_namespace ns = mk_ns("m", 16, NULL);
  for (int a = 0; a < N_ALGOS; a++)
    for (uint32_t c = 0; c < N_COMPAT; c++) {
      kvp_hasher *h = mk_hasher_c(&ns, (kvp_hash_algo)a, "0", c);
      bool r033 = c != KVP_VLLM_COMPAT_PRE_0_33;
      for (size_t b = 0; b < 8; b++)
        check_block_keys(h, &ex, b, r033 ? &v33[b] : &pre[b]);
      kvp_hasher_destroy(h);
    }
  /* too little room: the count, nothing written (block 1 has two keys
   * under the rule before 0.33) */
  kvp_hasher *h = mk_hasher_c(&ns, KVP_HASH_XXH3_128, "0",
                              KVP_VLLM_COMPAT_PRE_0_33);
  kvp_block_extras bx = {.n_mm = 77};
  kvp_mm_key one[1] = {{"untouched", 5}};
  ASSERT_EQ(kvp_hasher_block_extras(h, &ex, 1, &bx, one, 1), 2);
  ASSERT_EQ(bx.n_mm, 77u);
  ASSERT_STR_EQ(one[0].id, "untouched");
  ASSERT_EQ(kvp_hasher_block_extras(h, &ex, 0, &bx, NULL, 0), 0);
  ASSERT_EQ(bx.n_mm, 0u);
  ASSERT_NULL(bx.mm);
  log_begin();
  ASSERT_ERR(kvp_hasher_block_extras(h, &ex, 8, &bx, one, 1), KVP_EINVAL);
  ASSERT_LOGGED("prompt_embeds holds 8 block digests");
  ASSERT_ERR(kvp_hasher_block_extras(NULL, &ex, 0, &bx, one, 1), KVP_EINVAL);
  ASSERT_LOGGED("NULL hasher");
  ASSERT_ERR(kvp_hasher_block_extras(h, &ex, 0, NULL, one, 1), KVP_EINVAL);
  ASSERT_LOGGED("NULL out");
  ASSERT_ERR(kvp_hasher_block_extras(h, &ex, 0, &bx, NULL, 1), KVP_EINVAL);
  ASSERT_LOGGED("NULL mm");
  kvp_extras bad = {.cache_salt = "\xff"};
  ASSERT_ERR(kvp_hasher_block_extras(h, &bad, 0, &bx, one, 1), KVP_EINVAL);
  ASSERT_LOGGED("cache_salt");
  ASSERT_ERR(kvp_hasher_block_extras(h, NULL, SIZE_MAX, &bx, one, 1),
             KVP_EINVAL);
  ASSERT_LOGGED("past any prompt");
  log_end();
  /* far blocks are cheap: no walk past the last placeholder */
  ASSERT_EQ(kvp_hasher_block_extras(h, NULL, SIZE_MAX / 32, &bx, one, 1), 0);
  ex.n_prompt_embeds = 0;
  ASSERT_EQ(kvp_hasher_block_extras(h, &ex, SIZE_MAX / 32, &bx, one, 1), 0);
  ASSERT_TRUE(bx.lora_name == ex.lora_name && bx.cache_salt == NULL);
  kvp_hasher_destroy(h);
}

/* A copy of `bx` as a KV event carries it: no LoRA path, "" for absent
 * strings where NULL was. */
static kvp_block_extras as_event(const kvp_block_extras *bx) {
  kvp_block_extras e = *bx;
  e.lora_path = NULL;
  if (e.lora_name == NULL)
    e.lora_name = "";
  if (e.cache_salt == NULL)
    e.cache_salt = "";
  return e;
}

/* kvp_hasher_block along the prompt, fed kvp_hasher_block_extras, gives the
 * chain's digests; native keys also from event-shaped extras. */
static void check_block_api(kvp_hash_algo algo, uint32_t compat, uint32_t bs) {
  kvp_namespace ns = mk_ns("model-a", bs, NULL);
  kvp_hasher *h = mk_hasher_c(&ns, algo, "0", compat);
  size_t n = kvt_rand_below(12 * bs + 1), dlen = kvp_hash_algo_digest_len(algo);
  uint32_t *t = rand_tokens(n);
  static rand_ex rx;
  rand_extras(&rx, n);
  kvp_chain_opts co = {.keep_digests = 1};
  kvp_chain *c = NULL;
  ASSERT_OK(kvp_chain_create(h, &co, &rx.ex, NULL, &c));
  extend_random(c, t, n);
  bool native = algo < KVP_HASH_SHA256_CBOR;
  uint8_t prev[32], d[32], want[32];
  for (size_t i = 0; i < kvp_chain_len(c); i++) {
    kvp_block_extras bx;
    kvp_mm_key mm[4];
    kvp_key key, ek;
    ASSERT_GE(kvp_hasher_block_extras(h, &rx.ex, i, &bx, mm, 4), 0);
    ASSERT_EQ(kvp_hasher_block(h, i ? prev : NULL, dlen, t + i * bs, &bx, d,
                               sizeof d, &key),
              (int)dlen);
    ASSERT_EQ(kvp_chain_digest(c, i, want, sizeof want), (int)dlen);
    ASSERT_MEM_EQ(d, want, dlen);
    ASSERT_KEY_EQ(key, kvp_chain_keys(c)[i]);
    kvp_block_extras ev = as_event(&bx);
    ASSERT_EQ(kvp_hasher_block(h, i ? prev : NULL, dlen, t + i * bs, &ev,
                               NULL, 0, &ek),
              (int)dlen);
    /* native keys and the pre-0.33 modes ignore the path; 0.33 hashes it */
    bool path_counts = !native && compat != KVP_VLLM_COMPAT_PRE_0_33 &&
                       bx.lora_name != NULL && bx.lora_path != NULL &&
                       bx.lora_path[0] != '\0';
    ASSERT_EQ(kvp_key_eq(ek, key), !path_counts);
    if (native && i > 0) { /* the 16-byte key as parent, too */
      ASSERT_EQ(kvp_hasher_block(h, prev + dlen - 16, 16, t + i * bs, &bx,
                                 NULL, 0, &ek),
                (int)dlen);
      ASSERT_KEY_EQ(ek, key);
    }
    memcpy(prev, d, dlen);
  }
  kvp_chain_destroy(c);
  kvp_hasher_destroy(h);
  free(t);
}

TEST(block_api_equals_chain) {
  for (int a = 0; a < N_ALGOS; a++)
    for (uint32_t c = 0; c < N_COMPAT; c++)
      for (int it = 0; it < 20; it++)
        check_block_api((kvp_hash_algo)a, c, prop_bs[kvt_rand_below(4)]);
}

TEST(bad_block_input) {
  kvp_hasher *h = mk_hasher(KVP_HASH_VLLM_SHA256, 4);
  kvp_hasher *x = mk_hasher(KVP_HASH_XXH3_128, 4);
  uint32_t t[4] = {1, 2, 3, 4};
  uint8_t p[32] = {0}, d[32];
  kvp_key k;
  log_begin();
  ASSERT_ERR(kvp_hasher_block(NULL, NULL, 0, t, NULL, d, 32, &k), KVP_EINVAL);
  ASSERT_LOGGED("NULL hasher");
  ASSERT_ERR(kvp_hasher_block(h, NULL, 0, NULL, NULL, d, 32, &k), KVP_EINVAL);
  ASSERT_LOGGED("NULL tokens");
  ASSERT_ERR(kvp_hasher_block(h, p, 16, t, NULL, d, 32, &k), KVP_EINVAL);
  ASSERT_LOGGED("parent_len 16");
  ASSERT_ERR(kvp_hasher_block(x, p, 32, t, NULL, d, 32, &k), KVP_EINVAL);
  ASSERT_LOGGED("parent_len 32");
  kvp_mm_key nul[] = {{NULL, 1}}, bad[] = {{"ok", 1}, {"\xed\xa0\x80", 2}};
  const struct {
    kvp_block_extras bx;
    const char *what;
  } cases[] = {
      {{.lora_name = "\xc3"}, "lora_name"},
      {{.lora_name = "l", .lora_path = "\xff"}, "lora_path"},
      {{.cache_salt = "\xe0\x80\x80"}, "cache_salt"},
      {{.n_mm = 1}, "mm is NULL"},
      {{.mm = nul, .n_mm = 1}, "mm[0].id is NULL"},
      {{.mm = bad, .n_mm = 2}, "an mm id"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    ASSERT_ERR(kvp_hasher_block(h, NULL, 0, t, &cases[i].bx, d, 32, &k),
               KVP_EINVAL);
    ASSERT_LOGGED(cases[i].what);
  }
  ASSERT_EQ(log_count, 0);
  log_end();
  /* room, and outputs that may be left out */
  ASSERT_ERR(kvp_hasher_block(h, NULL, 0, t, NULL, d, 31, &k), KVP_ENOSPC);
  ASSERT_EQ(kvp_hasher_block(h, NULL, 0, t, NULL, NULL, 0, NULL), 32);
  ASSERT_EQ(kvp_hasher_block(x, NULL, 99, t, NULL, d, 16, NULL), 16);
  kvp_key k0;
  ASSERT_EQ(kvp_hasher_block(x, NULL, 0, t, NULL, NULL, 0, &k0), 16);
  kvp_hasher_hash(x, t, 4, NULL, &k, 1, NULL);
  ASSERT_KEY_EQ(k0, k);
  /* "" strings are no keys at all */
  kvp_block_extras empty = {.lora_name = "", .lora_path = "/p",
                            .cache_salt = ""};
  ASSERT_EQ(kvp_hasher_block(x, NULL, 0, t, &empty, NULL, 0, &k0), 16);
  ASSERT_KEY_EQ(k0, k);
  kvp_hasher_destroy(h);
  kvp_hasher_destroy(x);
}

TEST(prompt_embeds) {
  uint8_t emb[3][32];
  memset(emb, 0x5a, sizeof emb);
  emb[2][31] = 1;
  kvp_extras ex = {.prompt_embeds = (const uint8_t(*)[32])emb,
                   .n_prompt_embeds = 3};
  uint32_t *t = rand_tokens(16 * 4);
  for (int a = 0; a < N_ALGOS; a++) {
    kvp_hasher *h = mk_hasher((kvp_hash_algo)a, 16);
    kvp_key k0[4], k1[4], k2[4];
    ASSERT_EQ(kvp_hasher_hash(h, t, 48, NULL, k0, 4, NULL), 3);
    ASSERT_EQ(kvp_hasher_hash(h, t, 48, &ex, k1, 4, NULL), 3);
    for (size_t i = 0; i < 3; i++) /* every block carries its digest */
      ASSERT_FALSE(kvp_key_eq(k0[i], k1[i]));
    emb[2][31] = 2; /* only the last block's digest moves */
    ASSERT_EQ(kvp_hasher_hash(h, t, 48, &ex, k2, 4, NULL), 3);
    emb[2][31] = 1;
    ASSERT_KEY_EQ(k1[1], k2[1]);
    ASSERT_FALSE(kvp_key_eq(k1[2], k2[2]));
    /* a block without a digest is refused; cap limits what is hashed */
    log_begin();
    ASSERT_ERR(kvp_hasher_hash(h, t, 64, &ex, k2, 4, NULL), KVP_EINVAL);
    ASSERT_LOGGED("prompt_embeds holds 3 block digests, block 3 has none");
    ASSERT_EQ(kvp_hasher_hash(h, t, 64, &ex, k2, 3, NULL), 4);
    ASSERT_KEY_EQ(k2[2], k1[2]);
    /* a chain copies them, and stops where they stop, unchanged */
    kvp_chain *c = NULL;
    ASSERT_OK(kvp_chain_create(h, NULL, &ex, NULL, &c));
    ASSERT_EQ(kvp_chain_extend(c, t, 40), 2);
    memset(emb, 0, sizeof emb); /* the chain holds its own copy */
    ASSERT_ERR(kvp_chain_extend(c, t + 40, 24), KVP_EINVAL);
    ASSERT_LOGGED("block 3 has none");
    log_end();
    ASSERT_EQ(kvp_chain_len(c), 2u);
    ASSERT_EQ(kvp_chain_tokens(c), 40u);
    ASSERT_EQ(kvp_chain_extend(c, t + 40, 20), 1);
    memset(emb, 0x5a, sizeof emb);
    emb[2][31] = 1;
    for (size_t i = 0; i < 3; i++)
      ASSERT_KEY_EQ(kvp_chain_keys(c)[i], k1[i]);
    kvp_chain_destroy(c);
    kvp_hasher_destroy(h);
  }
  free(t);
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
  kvp_hasher_opts o = {.algo = (kvp_hash_algo)N_ALGOS};
  ASSERT_ERR(kvp_hasher_create(NULL, NULL, NULL, &h), KVP_EINVAL);
  ASSERT_NULL(h);
  ASSERT_LOGGED("NULL");
  ASSERT_ERR(kvp_hasher_create(&ns, NULL, NULL, NULL), KVP_EINVAL);
  ASSERT_LOGGED("NULL");
  ASSERT_ERR(kvp_hasher_create(&ns, &o, NULL, &h), KVP_EINVAL);
  ASSERT_LOGGED("algo");
  ASSERT_ERR(kvp_hasher_create(&zero, NULL, NULL, &h), KVP_EINVAL);
  ASSERT_LOGGED("block_size");
  o = (kvp_hasher_opts){.algo = KVP_HASH_SHA256_CBOR,
                        .vllm_compat = KVP_VLLM_COMPAT_PRE_0_33};
  ASSERT_ERR(kvp_hasher_create(&ns, &o, NULL, &h), KVP_EINVAL);
  ASSERT_LOGGED("python_hash_seed");
  o = (kvp_hasher_opts){.algo = KVP_HASH_XXHASH_CBOR,
                        .python_hash_seed = "\x80"};
  ASSERT_ERR(kvp_hasher_create(&ns, &o, NULL, &h), KVP_EINVAL);
  ASSERT_LOGGED("python_hash_seed");
  for (int a = 0; a < N_ALGOS; a++) { /* checked for every algorithm */
    o = (kvp_hasher_opts){.algo = (kvp_hash_algo)a,
                          .python_hash_seed = "0",
                          .vllm_compat = KVP_VLLM_COMPAT_COUNT_};
    ASSERT_ERR(kvp_hasher_create(&ns, &o, NULL, &h), KVP_EINVAL);
    ASSERT_LOGGED("vllm_compat");
  }
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
      {{.lora_name = "lo\xe0\x80\x80ra"}, "lora_name"},
      {{.cache_salt = "\xf8"}, "cache_salt"},
      {{.mm = null_id, .n_mm = 2}, "mm[1].id"},
      {{.mm = bad_id, .n_mm = 1}, "mm[0].id"},
      {{.mm = unsorted, .n_mm = 2}, "sorted"},
      {{.n_mm = 1}, "mm is NULL"},
      {{.mm = overflow, .n_mm = 1}, "overflow"},
      {{.lora_name = "l", .lora_path = "\xc0\x80"}, "lora_path"},
      {{.n_prompt_embeds = 3}, "prompt_embeds is NULL"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    ASSERT_ERR(kvp_hasher_hash(h, t, 40, &bad[i].e, k, 3, NULL), KVP_EINVAL);
    ASSERT_LOGGED(bad[i].what);
    kvp_chain *c = (kvp_chain *)h;
    ASSERT_ERR(kvp_chain_create(h, NULL, &bad[i].e, NULL, &c), KVP_EINVAL);
    ASSERT_LOGGED(bad[i].what);
    ASSERT_NULL(c);
  }
  kvp_extras good = {.mm = ok_mm, .n_mm = 2}; /* equal offsets are sorted */
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
  kvp_extras ex = {
      .lora_name = "lora", .cache_salt = "salt", .mm = mm, .n_mm = 1};
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
  kvp_extras ex = {
      .lora_name = "lora", .cache_salt = "salt", .mm = mm, .n_mm = 1};
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
          TEST_ENTRY(chains_share_hasher), TEST_ENTRY(none_hash_seed_rules),
          TEST_ENTRY(vllm033_golden), TEST_ENTRY(extra_keys_per_release),
          TEST_ENTRY(block_api_equals_chain), TEST_ENTRY(bad_block_input),
          TEST_ENTRY(prompt_embeds), TEST_ENTRY(bad_namespace),
          TEST_ENTRY(bad_hasher), TEST_ENTRY(bad_hash_input),
          TEST_ENTRY(bad_chain_input), TEST_ENTRY(allocator_hooks),
          TEST_ENTRY(out_of_memory))
