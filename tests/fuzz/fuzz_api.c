/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the emulated vLLM workers' OpenAI request parser
 * (bench/harness_api.c) on arbitrary bytes.  The first byte picks the
 * endpoint, the rest is the body.  Checks what the engine relies on: a
 * request that parses has a non-empty prompt of in-vocabulary ids and fits
 * the context, and its cache salt, if any, is one vLLM accepts; a
 * rejection is 400/404 with a message and a JSON error body that parses
 * back with the same code; a request naming the adapter runs on it (the
 * cfg's own string), any other runs on the base model.  The engine's fast
 * path for token-id prompts (bh_api_parse_fast) returns exactly what
 * bh_api_parse does, errors included. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "harness_api.h"
#include "harness_api_ids.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const bh_api_cfg cfg = {"m", 1000, 4096, {"m-lora"}, 1};

static void check_ok(const bh_api_req *r, bh_api_kind k) {
  if (r->n_tokens == 0 || r->tokens == NULL || r->max_tokens == 0)
    abort();
  for (size_t i = 0; i < r->n_tokens; i++)
    if (r->tokens[i] >= cfg.vocab)
      abort();
  if (k != BH_API_TOKENIZE &&
      (uint64_t)r->n_tokens + r->max_tokens > cfg.max_model_len)
    abort();
  if (r->include_usage && !r->stream)
    abort();
  if (r->lora_name != NULL && r->lora_name != cfg.lora[0])
    abort();
  if (r->cache_salt != NULL) { /* vLLM's validate_cache_salt held */
    size_t chars = 0;
    for (const char *c = r->cache_salt; *c; c++) {
      if (*c == '@' || *c == '/' || *c == '\\')
        abort();
      chars += ((unsigned char)*c & 0xC0) != 0x80;
    }
    if (chars == 0 || chars > BH_API_SALT_MAX || k == BH_API_TOKENIZE)
      abort();
  }
  const bh_api_kvx *x = &r->kvx; /* kv_transfer_params (P/D legs) */
  if (x->mode > BH_KVX_REMOTE_PREFILL || x->n_blocks > BH_API_KVX_BLOCKS_MAX)
    abort();
  if (x->mode == BH_KVX_REMOTE_PREFILL &&
      (x->engine_id[0] == '\0' || x->host[0] == '\0' || x->port == 0 ||
       x->port > 65535))
    abort();
  if (x->mode != BH_KVX_REMOTE_PREFILL && (x->n_blocks || x->port))
    abort();
}

static void check_err(const bh_api_err *e) {
  if ((e->status != 400 && e->status != 404) || e->message[0] == '\0')
    abort();
  char *s = bh_api_error_json(e);
  if (s == NULL)
    return; /* out of memory */
  json_t *o = json_loads(s, 0, NULL);
  json_t *code = json_object_get(json_object_get(o, "error"), "code");
  if (!json_is_integer(code) || json_integer_value(code) != e->status)
    abort();
  json_decref(o);
  free(s);
}

static void check_same(const bh_api_req *a, const bh_api_err *ea, int ra,
                       const bh_api_req *b, const bh_api_err *eb, int rb) {
  if (ra != rb)
    abort();
  if (ra < 0) {
    if (ea->status != eb->status || strcmp(ea->type, eb->type) ||
        strcmp(ea->param, eb->param) || strcmp(ea->message, eb->message))
      abort();
    return;
  }
  if (a->kind != b->kind || a->n_tokens != b->n_tokens ||
      memcmp(a->tokens, b->tokens, a->n_tokens * sizeof *a->tokens) ||
      a->max_tokens != b->max_tokens || a->stream != b->stream ||
      a->include_usage != b->include_usage ||
      a->max_tokens_set != b->max_tokens_set ||
      strcmp(a->request_id, b->request_id) || a->lora_name != b->lora_name ||
      (a->cache_salt == NULL) != (b->cache_salt == NULL) ||
      (a->cache_salt && strcmp(a->cache_salt, b->cache_salt)) ||
      memcmp(&a->kvx, &b->kvx, sizeof a->kvx))
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0 || size > (1u << 20))
    return 0;
  bh_api_kind k = (bh_api_kind)(data[0] % BH_API_KIND_COUNT_);
  bh_api_req r, f;
  bh_api_err e, fe;
  int rc = bh_api_parse(&cfg, k, (const char *)data + 1, size - 1, &r, &e);
  if (rc == 0)
    check_ok(&r, k);
  else
    check_err(&e);
  int fr = bh_api_parse_fast(&cfg, k, (const char *)data + 1, size - 1, &f,
                             &fe);
  check_same(&r, &e, rc, &f, &fe, fr);
  bh_api_req_free(&r);
  bh_api_req_free(&f);
  return 0;
}
