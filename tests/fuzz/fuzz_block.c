/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: router/prefix's per-block hashing (kvp_hasher_block,
 * kvp_hasher_block_extras) against the chain, on extras drawn from the
 * input: every algorithm (the pickle writer with its memo and 64 KiB frames,
 * CBOR, native) and vllm_compat, LoRA names and paths, salts, placeholders
 * (sorted, overlapping, on block boundaries), embeddings digests, tokens of
 * every width.  Some strings are stretched around pickle's frame target.
 * Aborts when a block's digest from kvp_hasher_block_extras +
 * kvp_hasher_block differs from the chain's, or a valid call fails. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvplane.h"

#define MAX_MM 8
#define MAX_BLOCKS 12
#define STR_CAP (70 * 1024)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct rd {
  const uint8_t *p;
  size_t n;
} rd;

static uint8_t u8(rd *r) {
  if (r->n == 0)
    return 0;
  r->n--;
  return *r->p++;
}

static uint32_t u32(rd *r) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++)
    v = v << 8 | u8(r);
  return v;
}

/* A string from the input: short and ASCII mostly (else the library just
 * refuses it), raw bytes sometimes, or one byte stretched to 65472..65727
 * bytes (pickle's frame target is 65536). */
static const char *str(rd *r, char *buf) {
  uint8_t mode = u8(r), len = u8(r);
  size_t n = len % 24;
  if (mode % 7 == 0)
    return NULL;
  if (mode % 11 == 1) {
    n = 65472 + len;
    memset(buf, 'a' + mode % 26, n);
  } else {
    for (size_t i = 0; i < n; i++) {
      uint8_t c = u8(r);
      buf[i] = (char)(mode % 5 == 0 ? c : (c % 94) + 33);
      if (buf[i] == '\0')
        buf[i] = '0';
    }
  }
  buf[n] = '\0';
  return buf;
}

typedef struct input {
  kvp_hash_algo algo;
  uint32_t compat, bs;
  const char *seed;
  kvp_extras ex;
  kvp_mm_span mm[MAX_MM];
  uint8_t embeds[MAX_BLOCKS][32];
  uint32_t tokens[MAX_BLOCKS * 16 + 15];
  size_t n_tokens;
} input;

static void read_extras(rd *r, input *in, char (*strs)[STR_CAP]) {
  in->ex.lora_name = str(r, strs[0]);
  in->ex.lora_path = str(r, strs[1]);
  in->ex.cache_salt = str(r, strs[2]);
  size_t n_mm = u8(r) % (MAX_MM + 1);
  uint64_t off = 0;
  for (size_t i = 0; i < n_mm; i++) {
    off += u8(r) % 40;
    uint8_t id = u8(r) % 4; /* few ids: repeats within a block */
    static const char *const ids[] = {"a", "img", "\xc3\xa9", ""};
    in->mm[i] = (kvp_mm_span){ids[id], off, u8(r) % 48};
  }
  in->ex.mm = in->mm;
  in->ex.n_mm = n_mm;
  if (u8(r) % 3 == 0) {
    for (size_t b = 0; b < MAX_BLOCKS; b++)
      for (size_t k = 0; k < 32; k++)
        in->embeds[b][k] = u8(r);
    in->ex.prompt_embeds = (const uint8_t(*)[32])in->embeds;
    in->ex.n_prompt_embeds = MAX_BLOCKS;
  }
}

static void read_input(rd *r, input *in, char (*strs)[STR_CAP]) {
  memset(in, 0, sizeof *in);
  in->algo = (kvp_hash_algo)(u8(r) % 6);
  in->compat = u8(r) % 3;
  in->bs = 1 + u8(r) % 16;
  in->seed = u8(r) % 4 == 0 ? NULL : str(r, strs[3]);
  read_extras(r, in, strs);
  in->n_tokens = u8(r) % (MAX_BLOCKS * in->bs + 1);
  for (size_t i = 0; i < in->n_tokens; i++) {
    uint8_t w = u8(r);
    in->tokens[i] = w < 128 ? w : w < 192 ? u32(r) % 65536 : u32(r);
  }
}

/* Block by block == the chain, digest for digest. */
static void check(kvp_hasher *h, const input *in, const kvp_chain *c) {
  size_t dlen = kvp_hash_algo_digest_len(in->algo);
  uint8_t prev[32], d[32], want[32];
  kvp_mm_key mm[MAX_MM];
  for (size_t i = 0; i < kvp_chain_len(c); i++) {
    kvp_block_extras bx;
    kvp_key key;
    if (kvp_hasher_block_extras(h, &in->ex, i, &bx, mm, MAX_MM) < 0 ||
        kvp_hasher_block(h, i ? prev : NULL, dlen, in->tokens + i * in->bs,
                         &bx, d, sizeof d, &key) != (int)dlen ||
        kvp_chain_digest(c, i, want, sizeof want) != (int)dlen ||
        memcmp(d, want, dlen) != 0 || !kvp_key_eq(key, kvp_chain_keys(c)[i]))
      abort();
    memcpy(prev, d, dlen);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static char strs[4][STR_CAP];
  static input in;
  rd r = {data, size};
  read_input(&r, &in, strs);
  kvp_namespace_desc nd = {.model_id = "m", .block_size = in.bs};
  kvp_namespace ns;
  kvp_hasher_opts o = {
      .algo = in.algo, .python_hash_seed = in.seed, .vllm_compat = in.compat};
  kvp_hasher *h = NULL;
  kvp_chain *c = NULL;
  kvp_chain_opts co = {.keep_digests = 1};
  if (kvp_namespace_init(&nd, &ns) < 0)
    abort();
  if (kvp_hasher_create(&ns, &o, NULL, &h) < 0)
    return 0; /* no seed where vLLM draws one at random, invalid UTF-8 */
  /* invalid extras are refused by both paths alike */
  int rc = kvp_chain_create(h, &co, &in.ex, NULL, &c);
  kvp_block_extras bx;
  kvp_mm_key mm[MAX_MM];
  int rb = kvp_hasher_block_extras(h, &in.ex, 0, &bx, mm, MAX_MM);
  if ((rc < 0) != (rb < 0))
    abort();
  size_t cut = in.n_tokens / 2;
  if (rc == 0 && (kvp_chain_extend(c, in.tokens, cut) < 0 ||
                  kvp_chain_extend(c, in.tokens + cut, in.n_tokens - cut) < 0))
    abort();
  if (rc == 0)
    check(h, &in, c);
  kvp_chain_destroy(c);
  kvp_hasher_destroy(h);
  return 0;
}
