/* SPDX-License-Identifier: Apache-2.0 */
/* The `kvplane` command-line tool: block keys of a token stream read from
 * stdin, and checks of vLLM vector files against the library.
 * Exit status: 0 ok, 1 check failures, 2 bad usage or bad input. */
#include <getopt.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_events.h"
#include "cli_tokens.h"
#include "cli_vectors.h"
#include "kvplane.h"

#define EXIT_MISMATCH 1
#define EXIT_USAGE 2
#define MM_MAX 64

static const char usage_text[] =
    "usage: kvplane <command> [options]\n"
    "\n"
    "commands:\n"
    "  hash --check FILE    recompute every case of a vLLM vector file (the\n"
    "                       format of shared/vectors/vllm_block_hashes.json\n"
    "                       and vllm033_block_hashes.json): extra keys per\n"
    "                       block, digests, event hashes; prints each\n"
    "                       failure, then 'N passed, M failed'\n"
    "  hash [options]       read token ids from stdin (separated by blanks or\n"
    "                       commas, or one JSON array) and print one line per\n"
    "                       full block -- INDEX KEY(32 hex) EXTERNAL_U64 --\n"
    "                       then 'tail N': tokens after the last full block\n"
    "  events tail [options] ENDPOINT\n"
    "                       subscribe to a vLLM KV-event stream and print it\n"
    "                       (kvplane events tail --help)\n"
    "  events relay --nats URL --worker NAME=PUB[,REPLAY] ...\n"
    "                       relay engines' KV events into NATS JetStream\n"
    "                       (kvplane events relay --help)\n"
    "  help, --help         this text\n"
    "  --version            the library version\n"
    "\n"
    "hash options:\n"
    "  -a, --algo A         kvplane's own: xxh3_128 (default) or sha256;\n"
    "                       vLLM's own hashes: vllm_sha256 and vllm_xxhash\n"
    "                       (what vLLM calls sha256 and xxhash: pickle),\n"
    "                       sha256_cbor or xxhash_cbor\n"
    "      --vllm-version V vLLM algorithms: the engine's release, e.g. 0.33.0\n"
    "                       (default: the newest scheme kvplane knows, 0.33)\n"
    "  -b, --block-size N   tokens per block, 1..4096 (default 16)\n"
    "      --seed S         vLLM algorithms: the engine's PYTHONHASHSEED\n"
    "                       (default: $PYTHONHASHSEED; without either, vLLM\n"
    "                       >= 0.33 seeds sha256* with \"vllm-none-hash\" and\n"
    "                       xxhash* with random bytes: not reproducible)\n"
    "      --salt S         cache salt (vLLM cache_salt; enters block 0)\n"
    "      --lora NAME      LoRA adapter name (enters every block)\n"
    "      --lora-path P    its path (vLLM >= 0.33 hashes it too)\n"
    "      --mm ID:OFFSET:LENGTH\n"
    "                       a multimodal placeholder, in token coordinates;\n"
    "                       repeat in order of offset (at most 64)\n"
    "      --model ID       native algorithms (required): the namespace's\n"
    "      --tokenizer ID   model, tokenizer, KV layout/dtype and tenant salt;\n"
    "      --layout L       keys of different namespaces never collide.\n"
    "      --tenant T       vLLM algorithms ignore them, as vLLM does\n"
    "      --chunks LIST    also print chunk keys for these granularities in\n"
    "                       tokens, e.g. 64,256,512 (at most 4): lines\n"
    "                       'chunk TOKENS INDEX KEY EXTERNAL_U64'\n"
    "  -f, --format F       hex (default) | u64: INDEX EXTERNAL_U64 |\n"
    "                       json: one JSON object a line (with full digests)\n"
    "\n"
    "exit status: 0 ok, 1 check failures, 2 bad usage or bad input\n";

typedef enum out_format { FMT_HEX, FMT_U64, FMT_JSON } out_format;

typedef struct hash_opts {
  const char *check;
  kvp_hash_algo algo;
  const char *seed;
  uint32_t block_size;
  const char *salt, *lora, *lora_path;
  uint32_t vllm_compat;
  const char *model, *tokenizer, *layout, *tenant;
  uint32_t chunks[4];
  kvp_mm_span mm[MM_MAX];
  size_t n_mm;
  out_format fmt;
  int n_opts; /* options given, --check included */
} hash_opts;

#if defined(__GNUC__) || defined(__clang__)
#define PRINTF_LIKE(f, a) __attribute__((format(printf, f, a)))
#else
#define PRINTF_LIKE(f, a)
#endif

PRINTF_LIKE(1, 2)
static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("kvplane: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs("\n\n", stderr);
  fputs(usage_text, stderr);
  va_end(ap);
  return EXIT_USAGE;
}

/* An error in what the user asked for, not in how: no usage text. */
PRINTF_LIKE(1, 2)
static int hash_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("kvplane hash: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return EXIT_USAGE;
}

static int lib_error(const char *what, int rc) {
  return hash_error("%s: %s (%s)", what, kvp_strerror(rc), kvp_err_name(rc));
}

/* Strict decimal s[0..len) in [min, max]: no sign, blanks or other text. */
static bool parse_dec(const char *s, size_t len, uint64_t min, uint64_t max,
                      uint64_t *out) {
  uint64_t x = 0;
  if (len == 0)
    return false;
  for (size_t k = 0; k < len; k++) {
    unsigned d = (unsigned)(s[k] - '0');
    if (d > 9 || x > (UINT64_MAX - d) / 10)
      return false;
    x = x * 10 + d;
  }
  *out = x;
  return x >= min && x <= max;
}

static bool parse_u64(const char *s, uint64_t min, uint64_t max,
                      uint64_t *out) {
  return parse_dec(s, strlen(s), min, max, out);
}

static bool parse_u32(const char *s, uint32_t min, uint32_t max,
                      uint32_t *out) {
  uint64_t x;
  if (!parse_u64(s, min, max, &x))
    return false;
  *out = (uint32_t)x;
  return true;
}

/* "64,256,512" */
static bool parse_chunks(char *s, uint32_t chunks[4]) {
  size_t n = 0;
  for (char *save = NULL, *t = strtok_r(s, ",", &save); t != NULL;
       t = strtok_r(NULL, ",", &save)) {
    if (n == 4 || !parse_u32(t, 1, UINT32_MAX, &chunks[n++]))
      return false;
  }
  return n > 0;
}

/* "ID:OFFSET:LENGTH", split at the last two colons (ids may hold colons).
 * argv strings are writable: the id is cut in place, once all of it parsed
 * (so that an error message still shows the whole argument). */
static bool parse_mm(char *s, kvp_mm_span *m) {
  char *c2 = strrchr(s, ':');
  char *c1 = c2 != NULL ? memrchr(s, ':', (size_t)(c2 - s)) : NULL;
  if (c1 == NULL ||
      !parse_dec(c1 + 1, (size_t)(c2 - c1 - 1), 0, UINT64_MAX, &m->offset) ||
      !parse_u64(c2 + 1, 0, UINT64_MAX, &m->length))
    return false;
  *c1 = '\0';
  m->id = s;
  return true;
}

enum { OPT_SEED = 256, OPT_SALT, OPT_LORA, OPT_MM, OPT_MODEL, OPT_TOKENIZER,
       OPT_LAYOUT, OPT_TENANT, OPT_CHUNKS, OPT_LORA_PATH, OPT_VLLM_VERSION };

static const struct option long_opts[] = {
    {"check", required_argument, NULL, 'c'},
    {"algo", required_argument, NULL, 'a'},
    {"block-size", required_argument, NULL, 'b'},
    {"format", required_argument, NULL, 'f'},
    {"help", no_argument, NULL, 'h'},
    {"seed", required_argument, NULL, OPT_SEED},
    {"salt", required_argument, NULL, OPT_SALT},
    {"lora", required_argument, NULL, OPT_LORA},
    {"lora-path", required_argument, NULL, OPT_LORA_PATH},
    {"vllm-version", required_argument, NULL, OPT_VLLM_VERSION},
    {"mm", required_argument, NULL, OPT_MM},
    {"model", required_argument, NULL, OPT_MODEL},
    {"tokenizer", required_argument, NULL, OPT_TOKENIZER},
    {"layout", required_argument, NULL, OPT_LAYOUT},
    {"tenant", required_argument, NULL, OPT_TENANT},
    {"chunks", required_argument, NULL, OPT_CHUNKS},
    {NULL, 0, NULL, 0}};

static bool parse_format(const char *s, out_format *f) {
  static const char *const names[] = {"hex", "u64", "json"};
  for (int k = 0; k < 3; k++)
    if (strcmp(s, names[k]) == 0) {
      *f = (out_format)k;
      return true;
    }
  return false;
}

/* One option with a value; false when the value is bad. */
static bool set_valued(hash_opts *o, int opt, char *arg) {
  switch (opt) {
  case 'c': o->check = arg; return true;
  case 'a': return kvp_hash_algo_parse(arg, &o->algo) == 0;
  case 'b': return parse_u32(arg, 1, KVP_BLOCK_SIZE_MAX, &o->block_size);
  case 'f': return parse_format(arg, &o->fmt);
  case OPT_SEED: o->seed = arg; return true;
  case OPT_SALT: o->salt = arg; return true;
  case OPT_LORA: o->lora = arg; return true;
  case OPT_LORA_PATH: o->lora_path = arg; return true;
  case OPT_VLLM_VERSION: return cli_vllm_compat(arg, &o->vllm_compat) == 0;
  case OPT_MM: return o->n_mm < MM_MAX && parse_mm(arg, &o->mm[o->n_mm++]);
  case OPT_MODEL: o->model = arg; return true;
  case OPT_TOKENIZER: o->tokenizer = arg; return true;
  case OPT_LAYOUT: o->layout = arg; return true;
  case OPT_TENANT: o->tenant = arg; return true;
  case OPT_CHUNKS: return parse_chunks(arg, o->chunks);
  }
  return false;
}

static const char *hint_of(int opt) {
  switch (opt) {
  case 'a': return "xxh3_128, sha256, vllm_sha256, vllm_xxhash, sha256_cbor "
                   "or xxhash_cbor";
  case OPT_VLLM_VERSION: return "a vLLM release like 0.33.0";
  case 'b': return "an integer 1..4096";
  case 'f': return "hex, u64 or json";
  case OPT_MM: return "ID:OFFSET:LENGTH, at most 64 times";
  case OPT_CHUNKS: return "1 to 4 token counts separated by commas";
  }
  return "a value";
}

static const char *name_of(int opt) {
  for (const struct option *lo = long_opts; lo->name != NULL; lo++)
    if (lo->val == opt)
      return lo->name;
  return "?";
}

/* Returns -1 to go on, else the exit status (help printed, or an error). */
static int parse_hash_args(int argc, char **argv, hash_opts *o) {
  int opt;
  opterr = 0; /* our messages, with the usage text */
  while ((opt = getopt_long(argc, argv, ":c:a:b:f:h", long_opts, NULL)) != -1) {
    const char *given = argv[optind - 1];
    if (opt == 'h') {
      fputs(usage_text, stdout);
      return 0;
    }
    if (opt == '?')
      return optopt ? usage_error("hash: unknown option '-%c'", optopt)
                    : usage_error("hash: unknown option '%s'", given);
    if (opt == ':')
      return usage_error("hash: option '%s' needs a value", given);
    if (!set_valued(o, opt, optarg))
      return usage_error("hash: --%s: bad value '%s' (expected %s)",
                         name_of(opt), optarg, hint_of(opt));
    o->n_opts++;
  }
  if (optind < argc)
    return usage_error("hash: unexpected argument '%s'", argv[optind]);
  if (o->check != NULL && o->n_opts > 1)
    return usage_error("hash: --check %s takes no other option", o->check);
  return -1;
}

/* ---- hash --check FILE ---------------------------------------------------- */
static int run_check(const char *path) {
  char why[512];
  cli_vectors *v = NULL;
  size_t passed = 0, failed = 0;
  if (cli_vectors_load(path, NULL, &v, why, sizeof why) < 0) {
    fprintf(stderr, "kvplane: %s\n", why);
    return EXIT_USAGE;
  }
  for (size_t i = 0; i < v->n_cases; i++) {
    if (cli_vectors_check(&v->cases[i], why, sizeof why) == 0) {
      passed++;
    } else {
      printf("FAIL %s\n", why);
      failed++;
    }
  }
  printf("%zu passed, %zu failed\n", passed, failed);
  cli_vectors_destroy(v);
  return failed > 0 ? EXIT_MISMATCH : 0;
}

/* ---- token ids from stdin ------------------------------------------------- */
/* The chain, and the library's error if it refused a batch: the reader says
 * only that its callback stopped it, the tool names the call that failed. */
typedef struct feed {
  kvp_chain *ch;
  int rc;
} feed;

static int extend(void *arg, const uint32_t *ids, size_t n) {
  feed *fd = arg;
  int rc = kvp_chain_extend(fd->ch, ids, n);
  if (rc < 0)
    fd->rc = rc;
  return rc;
}

/* Streams every token into the chain.  Returns 0 or an exit status. */
static int read_tokens(kvp_chain *ch) {
  char why[512];
  feed fd = {.ch = ch};
  if (cli_tokens_read(stdin, "stdin", extend, &fd, why, sizeof why) == 0)
    return 0;
  if (fd.rc < 0)
    return lib_error("kvp_chain_extend", fd.rc);
  return hash_error("%s", why);
}

/* ---- hash: printing ------------------------------------------------------- */
static void print_hex(const uint8_t *b, size_t n) {
  for (size_t k = 0; k < n; k++)
    printf("%02x", b[k]);
}

static void print_block(const hash_opts *o, const kvp_chain *ch, size_t i,
                        kvp_key k) {
  if (o->fmt == FMT_U64) {
    printf("%zu %" PRIu64 "\n", i, k.lo);
  } else if (o->fmt == FMT_HEX) {
    printf("%zu %016" PRIx64 "%016" PRIx64 " %" PRIu64 "\n", i, k.hi, k.lo,
           k.lo);
  } else {
    uint8_t d[32];
    int len = kvp_chain_digest(ch, i, d, sizeof d);
    printf("{\"index\":%zu,\"key\":\"%016" PRIx64 "%016" PRIx64
           "\",\"external_u64\":%" PRIu64 ",\"digest\":\"", i, k.hi, k.lo,
           k.lo);
    print_hex(d, len > 0 ? (size_t)len : 0);
    printf("\"}\n");
  }
}

static void print_chunk(const hash_opts *o, uint32_t tokens, size_t i,
                        kvp_key k) {
  if (o->fmt == FMT_U64)
    printf("chunk %" PRIu32 " %zu %" PRIu64 "\n", tokens, i, k.lo);
  else if (o->fmt == FMT_HEX)
    printf("chunk %" PRIu32 " %zu %016" PRIx64 "%016" PRIx64 " %" PRIu64 "\n",
           tokens, i, k.hi, k.lo, k.lo);
  else
    printf("{\"chunk_tokens\":%" PRIu32 ",\"index\":%zu,\"key\":\"%016" PRIx64
           "%016" PRIx64 "\",\"external_u64\":%" PRIu64 "}\n",
           tokens, i, k.hi, k.lo, k.lo);
}

static int print_keys(const hash_opts *o, const kvp_chain *ch) {
  const kvp_key *keys = kvp_chain_keys(ch);
  for (size_t i = 0; i < kvp_chain_len(ch); i++)
    print_block(o, ch, i, keys[i]);
  for (int g = 0; g < 4 && o->chunks[g] != 0; g++) {
    size_t n = 0;
    const kvp_key *ck = kvp_chain_chunk_keys(ch, o->chunks[g], &n);
    for (size_t i = 0; ck != NULL && i < n; i++)
      print_chunk(o, o->chunks[g], i, ck[i]);
  }
  if (o->fmt == FMT_JSON)
    printf("{\"tail\":%zu,\"tokens\":%zu,\"blocks\":%zu}\n",
           kvp_chain_tail(ch), kvp_chain_tokens(ch), kvp_chain_len(ch));
  else
    printf("tail %zu\n", kvp_chain_tail(ch));
  if (fflush(stdout) != 0 || ferror(stdout)) {
    perror("kvplane hash: stdout");
    return EXIT_USAGE;
  }
  return 0;
}

/* ---- hash: from stdin ----------------------------------------------------- */
static bool is_vllm(kvp_hash_algo a) {
  return a != KVP_HASH_XXH3_128 && a != KVP_HASH_SHA256;
}

/* The namespace and hasher options, with the errors a user can fix.  A
 * missing seed is the library's call (vLLM 0.33 has a default for sha256*):
 * run_hash explains its refusal. */
static int resolve(const hash_opts *o, kvp_namespace *ns,
                   kvp_hasher_opts *ho) {
  const char *seed = o->seed != NULL ? o->seed : getenv("PYTHONHASHSEED");
  const char *algo = kvp_hash_algo_name(o->algo);
  if (!is_vllm(o->algo) && o->model == NULL)
    return hash_error("%s keys are namespaced: pass --model (and "
                      "--tokenizer, --layout, --tenant as the router does)",
                      algo);
  kvp_namespace_desc nd = {
      .model_id = o->model != NULL ? o->model : "vllm",
      .tokenizer_id = o->tokenizer, .kv_layout = o->layout,
      .block_size = o->block_size, .tenant_salt = o->tenant};
  int rc = kvp_namespace_init(&nd, ns);
  if (rc < 0)
    return lib_error("namespace (--model, --tokenizer, --layout, --tenant)",
                     rc);
  *ho = (kvp_hasher_opts){.algo = o->algo, .python_hash_seed = seed,
                          .vllm_compat = o->vllm_compat};
  return -1;
}

static int run_hash(const hash_opts *o) {
  kvp_namespace ns;
  kvp_hasher_opts ho;
  kvp_hasher *h = NULL;
  kvp_chain *ch = NULL;
  kvp_chain_opts co = {.keep_digests = o->fmt == FMT_JSON};
  kvp_extras ex = {.lora_name = o->lora, .cache_salt = o->salt,
                   .mm = o->mm, .n_mm = o->n_mm, .lora_path = o->lora_path};
  int rc, status = resolve(o, &ns, &ho);
  if (status >= 0)
    return status;
  memcpy(co.chunk_tokens, o->chunks, sizeof co.chunk_tokens);
  if ((rc = kvp_hasher_create(&ns, &ho, NULL, &h)) < 0) {
    status = rc == KVP_EINVAL && is_vllm(o->algo) && ho.python_hash_seed == NULL
                 ? hash_error("%s needs the engine's PYTHONHASHSEED here (vLLM "
                              "draws NONE_HASH's seed at random without it): "
                              "pass --seed or set PYTHONHASHSEED",
                              kvp_hash_algo_name(o->algo))
                 : lib_error("hasher (--algo, --seed, --vllm-version)", rc);
    goto out;
  }
  if ((rc = kvp_chain_create(h, &co, &ex, NULL, &ch)) < 0) {
    status = lib_error("chain (--chunks, --salt, --lora, --mm)", rc);
    goto out;
  }
  status = read_tokens(ch);
  if (status == 0)
    status = print_keys(o, ch);
out:
  kvp_chain_destroy(ch);
  kvp_hasher_destroy(h);
  return status;
}

static int cmd_hash(int argc, char **argv) {
  hash_opts o = {.algo = KVP_HASH_XXH3_128, .block_size = 16};
  int status = parse_hash_args(argc, argv, &o);
  if (status >= 0)
    return status;
  return o.check != NULL ? run_check(o.check) : run_hash(&o);
}

int main(int argc, char **argv) {
  const char *cmd = argc > 1 ? argv[1] : NULL;
  if (cmd == NULL)
    return usage_error("a command is required");
  if (strcmp(cmd, "hash") == 0)
    return cmd_hash(argc - 1, argv + 1);
  if (strcmp(cmd, "events") == 0)
    return kvp_cli_events(argc - 1, argv + 1);
  if (strcmp(cmd, "--version") == 0 || strcmp(cmd, "version") == 0) {
    printf("kvplane %s\n", kvp_version());
    return 0;
  }
  if (strcmp(cmd, "help") == 0 || strcmp(cmd, "--help") == 0 ||
      strcmp(cmd, "-h") == 0) {
    fputs(usage_text, stdout);
    return 0;
  }
  return usage_error(cmd[0] == '-' ? "unknown option '%s'"
                                   : "unknown command '%s'", cmd);
}
