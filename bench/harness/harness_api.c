/* SPDX-License-Identifier: Apache-2.0 */
/* OpenAI request parsing for the emulated vLLM workers (harness_api.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "harness_api.h"

#define DEFAULT_MAX_TOKENS 16

typedef struct tokbuf {
  uint32_t *v;
  size_t n, cap;
} tokbuf;

static int tb_push(tokbuf *b, uint32_t t) {
  if (b->n == b->cap) {
    size_t nc = b->cap ? b->cap * 2 : 256;
    uint32_t *nv = realloc(b->v, nc * sizeof *nv);
    if (nv == NULL)
      return -1;
    b->v = nv;
    b->cap = nc;
  }
  b->v[b->n++] = t;
  return 0;
}

static int tb_text(tokbuf *b, const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (tb_push(b, (uint8_t)s[i]) < 0)
      return -1;
  return 0;
}

/* message = a b c (b, c may be NULL) */
static int fail(bh_api_err *e, int status, const char *param, const char *a,
                const char *b, const char *c) {
  e->status = status;
  snprintf(e->type, sizeof e->type, "%s",
           status == 404 ? "NotFoundError" : "BadRequestError");
  snprintf(e->param, sizeof e->param, "%s", param ? param : "");
  snprintf(e->message, sizeof e->message, "%s%s%s", a, b ? b : "",
           c ? c : "");
  return -1;
}

/* A token-id array: every element an integer in [0, vocab). */
static int parse_ids(const bh_api_cfg *c, json_t *a, tokbuf *b, bh_api_err *e) {
  size_t i;
  json_t *v;
  json_array_foreach(a, i, v) {
    if (!json_is_integer(v))
      return fail(e, 400, "prompt", "prompt must be a string, an array of "
                  "token ids or a one-element array of either", NULL, NULL);
    json_int_t t = json_integer_value(v);
    if (t < 0 || (uint64_t)t >= c->vocab) {
      char num[32];
      snprintf(num, sizeof num, "%lld", (long long)t);
      return fail(e, 400, "prompt", "Token id ", num, " is out of vocabulary");
    }
    if (tb_push(b, (uint32_t)t) < 0)
      return fail(e, 400, NULL, "out of memory", NULL, NULL);
  }
  return 0;
}

static int parse_prompt(const bh_api_cfg *c, json_t *p, tokbuf *b,
                        bh_api_err *e) {
  if (json_is_array(p) && json_array_size(p) == 1 &&
      (json_is_string(json_array_get(p, 0)) ||
       json_is_array(json_array_get(p, 0))))
    p = json_array_get(p, 0); /* one prompt in a batch of one */
  if (json_is_string(p))
    return tb_text(b, json_string_value(p), json_string_length(p)) < 0
               ? fail(e, 400, NULL, "out of memory", NULL, NULL)
               : 0;
  if (json_is_array(p) && json_array_size(p) > 0 &&
      (json_is_string(json_array_get(p, 0)) ||
       json_is_array(json_array_get(p, 0))))
    return fail(e, 400, "prompt", "batched prompts are not emulated: send "
                "one prompt per request", NULL, NULL);
  if (json_is_array(p))
    return parse_ids(c, p, b, e);
  return fail(e, 400, "prompt", "prompt must be a string, an array of token "
              "ids or a one-element array of either", NULL, NULL);
}

/* content: a string or an array of {"type": "text", "text": ...} parts. */
static int parse_content(json_t *ct, tokbuf *b, bh_api_err *e) {
  if (json_is_string(ct))
    return tb_text(b, json_string_value(ct), json_string_length(ct));
  if (json_is_null(ct))
    return 0;
  if (!json_is_array(ct))
    return fail(e, 400, "messages", "message content must be a string or "
                "an array of text parts", NULL, NULL);
  size_t i;
  json_t *part;
  json_array_foreach(ct, i, part) {
    json_t *ty = json_object_get(part, "type"), *tx = json_object_get(part, "text");
    if (!json_is_string(ty) || strcmp(json_string_value(ty), "text") != 0 ||
        !json_is_string(tx))
      return fail(e, 400, "messages", "only text content parts are "
                  "emulated", NULL, NULL);
    if (tb_text(b, json_string_value(tx), json_string_length(tx)) < 0)
      return -1;
  }
  return 0;
}

/* The fixed chat template (harness_api.h). */
static int parse_messages(json_t *m, tokbuf *b, bh_api_err *e) {
  if (!json_is_array(m) || json_array_size(m) == 0)
    return fail(e, 400, "messages", "messages must be a non-empty array",
                NULL, NULL);
  size_t i;
  json_t *msg;
  json_array_foreach(m, i, msg) {
    json_t *role = json_object_get(msg, "role");
    if (!json_is_string(role))
      return fail(e, 400, "messages", "every message needs a string role",
                  NULL, NULL);
    if (tb_text(b, "<|", 2) < 0 ||
        tb_text(b, json_string_value(role), json_string_length(role)) < 0 ||
        tb_text(b, "|>\n", 3) < 0 ||
        parse_content(json_object_get(msg, "content"), b, e) < 0 ||
        tb_text(b, "\n", 1) < 0)
      return e->status ? -1 : fail(e, 400, NULL, "out of memory", NULL, NULL);
  }
  return tb_text(b, "<|assistant|>\n", 14) < 0
             ? fail(e, 400, NULL, "out of memory", NULL, NULL)
             : 0;
}

static int parse_max_tokens(json_t *o, bh_api_kind k, bh_api_req *r,
                            bh_api_err *e) {
  json_t *mt = NULL;
  if (k == BH_API_CHAT || k == BH_API_CHAT_RENDER)
    mt = json_object_get(o, "max_completion_tokens");
  if (mt == NULL || json_is_null(mt))
    mt = json_object_get(o, "max_tokens");
  r->max_tokens = DEFAULT_MAX_TOKENS;
  if (mt == NULL || json_is_null(mt))
    return 0;
  if (!json_is_integer(mt) || json_integer_value(mt) < 1 ||
      json_integer_value(mt) > UINT32_MAX)
    return fail(e, 400, "max_tokens", "max_tokens must be an integer of at "
                "least 1", NULL, NULL);
  r->max_tokens = (uint32_t)json_integer_value(mt);
  r->max_tokens_set = true;
  return 0;
}

static int parse_stream(json_t *o, bh_api_req *r, bh_api_err *e) {
  json_t *st = json_object_get(o, "stream");
  json_t *so = json_object_get(o, "stream_options");
  if (st != NULL && !json_is_boolean(st) && !json_is_null(st))
    return fail(e, 400, "stream", "stream must be a boolean", NULL, NULL);
  r->stream = json_is_true(st);
  if (so != NULL && !json_is_null(so)) {
    if (!r->stream)
      return fail(e, 400, "stream_options", "Stream options can only be "
                  "defined when `stream=True`.", NULL, NULL);
    if (!json_is_object(so))
      return fail(e, 400, "stream_options", "stream_options must be an "
                  "object", NULL, NULL);
    r->include_usage = json_is_true(json_object_get(so, "include_usage"));
  }
  return 0;
}

/* vLLM 0.33's validate_cache_salt: absent or null is no salt; anything but
 * a non-empty string of at most 128 characters (code points) without '@',
 * '/', '\\' or NUL is a 400. */
static int parse_salt(json_t *o, bh_api_req *r, bh_api_err *e) {
  json_t *v = json_object_get(o, "cache_salt");
  if (v == NULL || json_is_null(v))
    return 0;
  if (!json_is_string(v) || json_string_length(v) == 0)
    return fail(e, 400, "cache_salt", "Parameter 'cache_salt' must be a "
                "non-empty string if provided.", NULL, NULL);
  const char *s = json_string_value(v);
  size_t n = json_string_length(v), chars = 0;
  bool bad = false;
  for (size_t i = 0; i < n; i++) {
    chars += ((uint8_t)s[i] & 0xC0) != 0x80; /* jansson: valid UTF-8 */
    bad |= s[i] == '@' || s[i] == '/' || s[i] == '\\' || s[i] == '\0';
  }
  if (bad || chars > BH_API_SALT_MAX)
    return fail(e, 400, "cache_salt", "Parameter 'cache_salt' must be at "
                "most 128 characters and must not contain '@', '/', "
                "'\\\\', or NUL.", NULL, NULL);
  r->cache_salt = strdup(s);
  return r->cache_salt ? 0 : fail(e, 400, NULL, "out of memory", NULL, NULL);
}

static bool is_block_id(json_t *v) {
  return json_is_integer(v) && json_integer_value(v) >= 0;
}

/* A list of block ids: 1, a list of lists of them: 2, else 0. */
static int id_list_depth(json_t *a) {
  size_t i;
  json_t *v;
  int depth = json_is_array(json_array_get(a, 0)) ? 2 : 1;
  if (!json_is_array(a))
    return 0;
  json_array_foreach(a, i, v) {
    if (depth == 1 && !is_block_id(v))
      return 0;
    for (size_t j = 0; depth == 2 && j < json_array_size(v); j++)
      if (!is_block_id(json_array_get(v, j)))
        return 0;
    if (depth == 2 && !json_is_array(v))
      return 0;
  }
  return depth;
}

/* remote_block_ids: non-negative integers, flat or one list per KV cache
 * group (the first group's length counts) */
static int kvx_blocks(json_t *ids, bh_api_kvx *k, bh_api_err *e) {
  int depth = id_list_depth(ids);
  json_t *flat = depth == 2 ? json_array_get(ids, 0) : ids;
  if (depth == 0)
    return fail(e, 400, "kv_transfer_params", "remote_block_ids must be a "
                "list of block ids (non-negative integers) or a list of "
                "such lists", NULL, NULL);
  if (json_array_size(flat) > BH_API_KVX_BLOCKS_MAX)
    return fail(e, 400, "kv_transfer_params", "remote_block_ids holds more "
                "than 1048576 block ids", NULL, NULL);
  k->n_blocks = (uint32_t)json_array_size(flat);
  return 0;
}

static int kvx_str(json_t *p, const char *key, char *dst, size_t cap,
                   bh_api_err *e) {
  json_t *v = json_object_get(p, key);
  if (!json_is_string(v) || json_string_length(v) == 0 ||
      json_string_length(v) >= cap)
    return fail(e, 400, "kv_transfer_params", key, " must be a non-empty "
                "string of at most 127 bytes for do_remote_prefill", NULL);
  memcpy(dst, json_string_value(v), json_string_length(v) + 1);
  return 0;
}

/* "kv_transfer_params" as the NIXL connector reads them: absent or null is
 * an ordinary request; an object with do_remote_decode (the prefill leg)
 * or do_remote_prefill (the decode leg: the remote_* keys required);
 * anything else is refused.  Other keys pass (vLLM hands them to the
 * connector). */
static int parse_kvx(json_t *o, bh_api_req *r, bh_api_err *e) {
  json_t *p = json_object_get(o, "kv_transfer_params");
  if (p == NULL || json_is_null(p))
    return 0;
  if (!json_is_object(p))
    return fail(e, 400, "kv_transfer_params", "kv_transfer_params must be "
                "an object", NULL, NULL);
  json_t *d = json_object_get(p, "do_remote_decode"),
         *f = json_object_get(p, "do_remote_prefill");
  if ((d && !json_is_boolean(d) && !json_is_null(d)) ||
      (f && !json_is_boolean(f) && !json_is_null(f)))
    return fail(e, 400, "kv_transfer_params", "do_remote_decode and "
                "do_remote_prefill must be booleans", NULL, NULL);
  if (json_is_true(d) && json_is_true(f))
    return fail(e, 400, "kv_transfer_params", "do_remote_decode and "
                "do_remote_prefill are both true", NULL, NULL);
  bh_api_kvx *k = &r->kvx;
  if (json_is_true(d))
    k->mode = BH_KVX_REMOTE_DECODE;
  if (!json_is_true(f))
    return 0;
  k->mode = BH_KVX_REMOTE_PREFILL;
  json_t *port = json_object_get(p, "remote_port");
  if (kvx_str(p, "remote_engine_id", k->engine_id, sizeof k->engine_id, e) < 0 ||
      kvx_str(p, "remote_host", k->host, sizeof k->host, e) < 0)
    return -1;
  if (!json_is_integer(port) || json_integer_value(port) < 1 ||
      json_integer_value(port) > 65535)
    return fail(e, 400, "kv_transfer_params", "remote_port must be an "
                "integer in [1, 65535]", NULL, NULL);
  k->port = (uint32_t)json_integer_value(port);
  return kvx_blocks(json_object_get(p, "remote_block_ids"), k, e);
}

static int parse_common(const bh_api_cfg *c, json_t *o, bh_api_req *r,
                        bh_api_err *e) {
  json_t *model = json_object_get(o, "model");
  const char *m = json_is_string(model) ? json_string_value(model) : NULL;
  for (size_t i = 0; m != NULL && i < c->n_lora; i++)
    if (strcmp(m, c->lora[i]) == 0)
      r->lora_name = c->lora[i];
  if (model != NULL && !json_is_null(model) && r->lora_name == NULL &&
      (m == NULL || strcmp(m, c->model)))
    return fail(e, 404, "model", "The model `", m ? m : "?",
                "` does not exist.");
  json_t *n = json_object_get(o, "n");
  if (n != NULL && !json_is_null(n) &&
      !(json_is_integer(n) && json_integer_value(n) == 1))
    return fail(e, 400, "n", "only n = 1 is emulated", NULL, NULL);
  json_t *id = json_object_get(o, "request_id");
  if (json_is_string(id))
    snprintf(r->request_id, sizeof r->request_id, "%s", json_string_value(id));
  if (parse_max_tokens(o, r->kind, r, e) < 0 || parse_stream(o, r, e) < 0)
    return -1;
  /* /tokenize has no cache_salt field (vLLM ignores it there) */
  if (r->kind == BH_API_TOKENIZE)
    return 0;
  return parse_salt(o, r, e) < 0 ? -1 : parse_kvx(o, r, e);
}

static int parse_body(const bh_api_cfg *c, json_t *o, bh_api_req *r,
                      tokbuf *b, bh_api_err *e) {
  bool chat = r->kind == BH_API_CHAT || r->kind == BH_API_CHAT_RENDER;
  if (r->kind == BH_API_TOKENIZE)
    chat = json_object_get(o, "messages") != NULL;
  if (parse_common(c, o, r, e) < 0)
    return -1;
  int rc = chat ? parse_messages(json_object_get(o, "messages"), b, e)
                : parse_prompt(c, json_object_get(o, "prompt"), b, e);
  if (rc < 0)
    return e->status ? -1 : fail(e, 400, NULL, "out of memory", NULL, NULL);
  if (b->n == 0)
    return fail(e, 400, "prompt", "The prompt cannot be empty", NULL, NULL);
  if (r->kind == BH_API_TOKENIZE)
    return 0;
  if ((uint64_t)b->n + r->max_tokens > c->max_model_len) {
    char msg[160];
    snprintf(msg, sizeof msg, "%u tokens. However, you requested %llu tokens "
             "(%zu in the messages, %u in the completion)", c->max_model_len,
             (unsigned long long)b->n + r->max_tokens, b->n, r->max_tokens);
    return fail(e, 400, "max_tokens", "This model's maximum context length "
                "is ", msg, ". Please reduce the length of the messages or "
                "completion.");
  }
  return 0;
}

int bh_api_parse(const bh_api_cfg *cfg, bh_api_kind kind, const char *body,
                 size_t len, bh_api_req *out, bh_api_err *err) {
  memset(out, 0, sizeof *out);
  memset(err, 0, sizeof *err);
  out->kind = kind;
  if (kind < 0 || kind >= BH_API_KIND_COUNT_)
    return fail(err, 400, NULL, "unknown endpoint", NULL, NULL);
  json_error_t je;
  json_t *o = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
  if (o == NULL)
    return fail(err, 400, NULL, "Invalid JSON body: ", je.text, NULL);
  tokbuf b = {0};
  int rc = json_is_object(o)
               ? parse_body(cfg, o, out, &b, err)
               : fail(err, 400, NULL, "the request body must be a JSON "
                      "object", NULL, NULL);
  json_decref(o);
  if (rc < 0) {
    free(b.v);
    free(out->cache_salt);
    memset(out, 0, sizeof *out);
    return -1;
  }
  out->tokens = b.v;
  out->n_tokens = b.n;
  return 0;
}

void bh_api_req_free(bh_api_req *r) {
  if (r == NULL)
    return;
  free(r->tokens);
  free(r->cache_salt);
  r->tokens = NULL;
  r->cache_salt = NULL;
  r->lora_name = NULL;
  r->n_tokens = 0;
}

char *bh_api_error_json(const bh_api_err *e) {
  json_t *in = json_pack("{s:s, s:s, s:o, s:i}", "message", e->message, "type",
                         e->type, "param",
                         e->param[0] ? json_string(e->param) : json_null(),
                         "code", e->status);
  json_t *o = in ? json_pack("{s:o}", "error", in) : NULL;
  char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
  json_decref(o);
  return s;
}

char *bh_api_detok(const uint32_t *ids, size_t n) {
  size_t cap = n * 12 + 1, k = 0;
  char *s = malloc(cap);
  if (s == NULL)
    return NULL;
  for (size_t i = 0; i < n; i++) {
    if ((ids[i] >= 0x20 && ids[i] < 0x7f) || ids[i] == '\n')
      s[k++] = (char)ids[i]; /* printable ASCII: always valid UTF-8 */
    else
      k += (size_t)snprintf(s + k, cap - k, "<|%u|>", ids[i]);
  }
  s[k] = '\0';
  return s;
}

uint32_t bh_api_gen_token(uint64_t seed, uint32_t i) {
  uint64_t z = seed + (uint64_t)i * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 31)) * 0xBF58476D1CE4E5B9ull;
  z ^= z >> 29;
  return z % 6 == 0 ? ' ' : 'a' + (uint32_t)(z % 26);
}
