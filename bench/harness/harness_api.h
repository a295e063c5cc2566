/* SPDX-License-Identifier: Apache-2.0 */
/* The OpenAI API as vLLM 0.33 serves it, for the emulated workers
 * (harness_engine.c): request parsing and validation, the deterministic
 * byte-level tokenizer, the fixed chat template and OpenAI error bodies.
 * No I/O here: the request parser is a pure function (tests/fuzz/fuzz_api.c).
 *
 * Tokenizer: token id = byte value (0..255) of the UTF-8 text; ids up to
 * the vocabulary size are accepted in token-id prompts; they detokenize to
 * the byte when printable ASCII or newline, else to "<|id|>" (the text is
 * always valid UTF-8).  Chat template (fixed, ChatML-like):
 *   for each message: "<|" role "|>\n" content "\n"; then "<|assistant|>\n". */
#ifndef KVP_BENCH_HARNESS_API_H
#define KVP_BENCH_HARNESS_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef enum bh_api_kind {
  BH_API_COMPLETIONS = 0, /* POST /v1/completions */
  BH_API_CHAT,            /* POST /v1/chat/completions */
  BH_API_COMPLETIONS_RENDER, /* POST /v1/completions/render */
  BH_API_CHAT_RENDER,     /* POST /v1/chat/completions/render */
  BH_API_TOKENIZE,        /* POST /tokenize (prompt or messages) */
  BH_API_KIND_COUNT_
} bh_api_kind;

#define BH_API_LORA_MAX 8

typedef struct bh_api_cfg {
  const char *model;      /* the served model name */
  uint32_t vocab;         /* token ids must be below (>= 256) */
  uint32_t max_model_len; /* prompt + max_tokens must fit */
  /* LoRA adapters served beside the base model (vLLM --lora-modules): a
   * request whose "model" names one runs on it */
  const char *lora[BH_API_LORA_MAX];
  size_t n_lora;
} bh_api_cfg;

/* kv_transfer_params (vLLM's disaggregated prefill, the NIXL connector's
 * keys): which leg of a P/D request this is.  REMOTE_DECODE: the prefill
 * leg ("do_remote_decode": true): prefill, one token, answer with the
 * parameters the decode leg needs.  REMOTE_PREFILL: the decode leg
 * ("do_remote_prefill": true): remote_engine_id, remote_host, remote_port
 * and remote_block_ids name where the prompt's KV is to be pulled from. */
typedef enum bh_api_kvx_mode {
  BH_KVX_NONE = 0,
  BH_KVX_REMOTE_DECODE,
  BH_KVX_REMOTE_PREFILL
} bh_api_kvx_mode;

#define BH_API_KVX_ID_MAX 128      /* remote_engine_id, remote_host */
#define BH_API_KVX_BLOCKS_MAX (1u << 20) /* remote_block_ids' length */

typedef struct bh_api_kvx {
  bh_api_kvx_mode mode;
  char engine_id[BH_API_KVX_ID_MAX], host[BH_API_KVX_ID_MAX];
  uint32_t port;
  /* remote_block_ids' length: a flat list of ids, or (vLLM >= 0.11, one
   * list per KV cache group) the first group's */
  uint32_t n_blocks;
} bh_api_kvx;

typedef struct bh_api_req {
  bh_api_kind kind;
  uint32_t *tokens; /* malloc'd prompt token ids */
  size_t n_tokens;
  uint32_t max_tokens;  /* completion tokens to generate (ignore_eos) */
  bool stream, include_usage;
  bool max_tokens_set;
  char request_id[96]; /* "request_id" field when given, else "" */
  /* "cache_salt" (vLLM's tenant isolation): malloc'd UTF-8, non-empty, at
   * most BH_API_SALT_MAX code points, none of '@' '/' '\\' NUL; NULL when
   * absent or null.  It enters block 0's hash (kvp_extras.cache_salt). */
  char *cache_salt;
  /* the adapter the "model" field names (cfg's string), NULL = the base
   * model: it enters every block's hash (kvp_extras.lora_name), as vLLM */
  const char *lora_name;
  bh_api_kvx kvx; /* "kv_transfer_params"; mode NONE when absent or null */
} bh_api_req;

#define BH_API_SALT_MAX 128 /* vLLM 0.33's _MAX_CACHE_SALT_LENGTH */

typedef struct bh_api_err {
  int status;        /* 400, 404 */
  char type[32];     /* "BadRequestError", "NotFoundError" */
  char param[32];    /* "" = null */
  char message[320];
} bh_api_err;

/* Parses and validates one request body.  Returns 0 (out filled; free with
 * bh_api_req_free) or -1 with *err filled (out empty).  Never reads past
 * body[len); any bytes are safe. */
int bh_api_parse(const bh_api_cfg *cfg, bh_api_kind kind, const char *body,
                 size_t len, bh_api_req *out, bh_api_err *err);
void bh_api_req_free(bh_api_req *r);
/* The vLLM 0.33 error body {"error": {"message", "type", "param", "code"}},
 * malloc'd NUL-terminated JSON (NULL on ENOMEM). */
char *bh_api_error_json(const bh_api_err *e);
/* Detokenizes ids[0..n) into a malloc'd NUL-terminated string. */
char *bh_api_detok(const uint32_t *ids, size_t n);
/* The i-th generated token (deterministic: lowercase letters and spaces). */
uint32_t bh_api_gen_token(uint64_t seed, uint32_t i);

#endif /* KVP_BENCH_HARNESS_API_H */
