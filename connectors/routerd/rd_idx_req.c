/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd KV-indexer request bodies (jansson): Dynamo's and
 * Mooncake's field names, checked and copied; unknown fields are ignored as
 * both servers ignore them. */
#include "rd_idx_req.h"

#include <ctype.h>
#include <jansson.h>
#include <openssl/core_names.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static int fail(rd_req_err *e, const char *param, const char *msg) {
  e->status = 400;
  snprintf(e->param, sizeof e->param, "%s", param);
  snprintf(e->message, sizeof e->message, "%s%s%s", param, *param ? ": " : "",
           msg);
  return -1;
}

/* the first of the NULL-terminated names present (not null), or NULL */
static json_t *field(json_t *o, const char *const *names, const char **which) {
  for (; *names; names++) {
    json_t *v = json_object_get(o, *names);
    if (v != NULL && !json_is_null(v)) {
      *which = *names;
      return v;
    }
  }
  return NULL;
}

static int take_str(json_t *o, const char *const *names, char *dst, size_t cap,
                    bool required, rd_req_err *e) {
  const char *name = names[0];
  json_t *v = field(o, names, &name);
  if (v == NULL)
    return required ? fail(e, name, "is required") : 0;
  if (!json_is_string(v))
    return fail(e, name, "must be a string");
  size_t n = json_string_length(v);
  if (n >= cap)
    return fail(e, name, "is too long");
  if (strlen(json_string_value(v)) != n)
    return fail(e, name, "contains a NUL character");
  if (required && n == 0) /* found by fuzz_routerd_indexer */
    return fail(e, name, "must not be empty");
  memcpy(dst, json_string_value(v), n + 1);
  return 0;
}

static int take_uint(json_t *o, const char *name, int64_t lo, int64_t hi,
                     int64_t *out, rd_req_err *e) {
  json_t *v = json_object_get(o, name);
  if (v == NULL || json_is_null(v))
    return 0;
  json_int_t x = json_is_integer(v) ? json_integer_value(v) : lo - 1;
  if (x < lo || x > hi) {
    char m[96];
    snprintf(m, sizeof m, "must be an integer in [%lld, %lld]", (long long)lo,
             (long long)hi);
    return fail(e, name, m);
  }
  *out = x;
  return 0;
}

/* instance_id: Dynamo's u64 or Mooncake's string */
static int take_instance(json_t *o, rd_ix_req *r, bool required,
                         rd_req_err *e) {
  json_t *v = json_object_get(o, "instance_id");
  if (v == NULL || json_is_null(v))
    return required ? fail(e, "instance_id", "is required") : 0;
  if (json_is_integer(v) && json_integer_value(v) >= 0) {
    snprintf(r->instance, sizeof r->instance, "%lld",
             (long long)json_integer_value(v));
    r->instance_int = true;
    return 0;
  }
  static const char *const n[] = {"instance_id", NULL};
  if (!json_is_string(v) || json_string_length(v) == 0)
    return fail(e, "instance_id", "must be a non-negative integer or a "
                                  "non-empty string");
  return take_str(o, n, r->instance, sizeof r->instance, true, e);
}

static int take_tokens(json_t *a, rd_ix_req *r, rd_req_err *e) {
  size_t n = json_array_size(a);
  if (!json_is_array(a))
    return fail(e, "token_ids", "must be a list of token ids");
  if (n > RD_IX_TOKENS_MAX)
    return fail(e, "token_ids", "too many tokens");
  r->tokens = malloc((n ? n : 1) * sizeof *r->tokens);
  if (r->tokens == NULL)
    return fail(e, "token_ids", "out of memory");
  for (size_t i = 0; i < n; i++) {
    json_t *v = json_array_get(a, i);
    json_int_t t = json_is_integer(v) ? json_integer_value(v) : -1;
    if (t < 0 || t > (json_int_t)UINT32_MAX)
      return fail(e, "token_ids", "token ids must be integers in [0, 2^32)");
    r->tokens[i] = (uint32_t)t;
  }
  r->n_tokens = n;
  return 0;
}

/* "123", "0x1f..." (up to 64 hex digits: a digest's low 64 bits) */
static int hash_of_string(const char *s, uint64_t *out) {
  uint64_t x = 0;
  if (s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) {
    size_t n = strlen(s + 2);
    if (n == 0 || n > 64)
      return -1;
    for (const char *p = s + 2; *p; p++) {
      if (!isxdigit((unsigned char)*p))
        return -1;
      x = (x << 4) | (uint64_t)(isdigit((unsigned char)*p)
                                    ? *p - '0'
                                    : tolower((unsigned char)*p) - 'a' + 10);
    }
  } else {
    if (*s == '\0' || strlen(s) > 20)
      return -1;
    for (const char *p = s; *p; p++) {
      uint64_t d = (uint64_t)(*p - '0');
      if (!isdigit((unsigned char)*p) || x > (UINT64_MAX - d) / 10)
        return -1;
      x = x * 10 + d;
    }
  }
  *out = x;
  return 0;
}

static int take_hashes(json_t *o, rd_ix_req *r, rd_req_err *e) {
  static const char *const names[] = {"block_hashes", "seq_hashes",
                                      "block_hash", NULL};
  const char *name = names[0];
  json_t *a = field(o, names, &name);
  if (a == NULL)
    return fail(e, name, "is required (or seq_hashes)");
  size_t n = json_array_size(a);
  if (!json_is_array(a))
    return fail(e, name, "must be a list of block hashes");
  if (n > RD_IX_HASHES_MAX)
    return fail(e, name, "too many hashes");
  r->hashes = malloc((n ? n : 1) * sizeof *r->hashes);
  if (r->hashes == NULL)
    return fail(e, name, "out of memory");
  for (size_t i = 0; i < n; i++) {
    json_t *v = json_array_get(a, i);
    if (json_is_integer(v)) /* i64 as Dynamo reads it, bits kept */
      r->hashes[i] = (uint64_t)json_integer_value(v);
    else if (!json_is_string(v) ||
             hash_of_string(json_string_value(v), &r->hashes[i]) < 0)
      return fail(e, name, "hashes must be integers or decimal / 0x-hex "
                           "strings");
  }
  r->n_hashes = n;
  return 0;
}

static int take_type(json_t *o, rd_req_err *e) {
  static const char *const n[] = {"type", NULL};
  char t[32] = "";
  if (take_str(o, n, t, sizeof t, false, e) < 0)
    return -1;
  if (*t && strcasecmp(t, "vllm") != 0 && strcasecmp(t, "sglang") != 0)
    return fail(e, "type", "kvplane-routerd consumes vLLM / SGLang ZMQ KV "
                           "events only");
  return 0;
}

static void pick_dialect(json_t *o, rd_ix_req *r) {
  bool mc = json_object_get(o, "modelname") || json_object_get(o, "model") ||
            json_object_get(o, "type") || json_object_get(o, "seq_hashes") ||
            json_object_get(o, "block_hash");
  r->dialect = json_object_get(o, "model_name") || !mc ? RD_IX_DYNAMO
                                                       : RD_IX_MOONCAKE;
}

static int parse_common(json_t *o, rd_ix_req *r, rd_req_err *e) {
  static const char *const model[] = {"model_name", "modelname", "model", NULL};
  static const char *const tenant[] = {"tenant_id", NULL};
  static const char *const group[] = {"routing_group", NULL};
  static const char *const lora[] = {"lora_name", NULL};
  static const char *const salt[] = {"cache_salt", NULL};
  bool need_model = r->op != RD_IX_UNREGISTER;
  int64_t bs = 0;
  if (take_str(o, model, r->model, sizeof r->model, need_model, e) < 0 ||
      take_str(o, tenant, r->tenant, sizeof r->tenant, false, e) < 0 ||
      take_str(o, group, r->group, sizeof r->group, false, e) < 0 ||
      take_str(o, lora, r->lora_name, sizeof r->lora_name, false, e) < 0 ||
      take_str(o, salt, r->cache_salt, sizeof r->cache_salt, false, e) < 0 ||
      take_uint(o, "block_size", 1, INT32_MAX, &bs, e) < 0 ||
      take_uint(o, "dp_rank", 0, 65535, &r->dp_rank, e) < 0 || take_type(o, e) < 0)
    return -1;
  r->block_size = (uint32_t)bs;
  json_t *s = json_object_get(o, "cache_salt");
  r->has_salt = s != NULL && !json_is_null(s);
  return 0;
}

static int parse_register(json_t *o, rd_ix_req *r, rd_req_err *e) {
  static const char *const ep[] = {"endpoint", NULL};
  static const char *const rp[] = {"replay_endpoint", NULL};
  static const char *const url[] = {"url", NULL};
  if (take_instance(o, r, true, e) < 0 ||
      take_str(o, ep, r->endpoint, sizeof r->endpoint, true, e) < 0 ||
      take_str(o, rp, r->replay, sizeof r->replay, false, e) < 0 ||
      take_str(o, url, r->url, sizeof r->url, false, e) < 0)
    return -1;
  if (r->block_size == 0)
    return fail(e, "block_size", "is required");
  if (*r->endpoint == '\0')
    return fail(e, "endpoint", "must not be empty");
  return 0;
}

static int parse_query(json_t *o, rd_ix_req *r, rd_req_err *e) {
  if (take_instance(o, r, false, e) < 0)
    return -1;
  json_t *t = json_object_get(o, "token_ids");
  return t ? take_tokens(t, r, e) : fail(e, "token_ids", "is required");
}

static int parse_obj(json_t *o, rd_ix_req *r, rd_req_err *e) {
  pick_dialect(o, r);
  if (parse_common(o, r, e) < 0)
    return -1;
  switch (r->op) {
  case RD_IX_REGISTER:
    return parse_register(o, r, e);
  case RD_IX_UNREGISTER:
    return take_instance(o, r, true, e);
  case RD_IX_QUERY:
    return parse_query(o, r, e);
  case RD_IX_QUERY_HASH:
    if (r->has_salt) /* the hashes are opaque: a salt cannot apply */
      return fail(e, "cache_salt", "must be omitted or null: hash the salt "
                                   "into block_hashes, or use /query");
    return take_instance(o, r, false, e) < 0 ? -1 : take_hashes(o, r, e);
  }
  return fail(e, "", "unknown operation");
}

int rd_ix_parse(rd_ix_op op, const char *body, size_t len, rd_ix_req *out,
                rd_req_err *err) {
  memset(out, 0, sizeof *out);
  out->op = op;
  out->dp_rank = -1;
  json_error_t je;
  json_t *o = json_loadb(body, len, JSON_REJECT_DUPLICATES, &je);
  if (o == NULL || !json_is_object(o)) {
    json_decref(o);
    char m[200];
    snprintf(m, sizeof m, "the body is not a JSON object (%s)",
             o ? "another JSON value" : je.text);
    return fail(err, "", m);
  }
  int rc = parse_obj(o, out, err);
  json_decref(o);
  if (rc < 0)
    rd_ix_free(out);
  return rc;
}

void rd_ix_free(rd_ix_req *r) {
  free(r->tokens);
  free(r->hashes);
  r->tokens = NULL;
  r->hashes = NULL;
  r->n_tokens = r->n_hashes = 0;
}

static void put_len(unsigned char *p, uint64_t n) {
  for (int i = 7; i >= 0; i--, n >>= 8)
    p[i] = (unsigned char)(n & 0xff);
}

/* base64url without padding: 32 bytes -> 43 characters */
static size_t b64url(const unsigned char *in, size_t n, char *out) {
  static const char a[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                          "0123456789-_";
  size_t k = 0;
  for (size_t i = 0; i < n; i += 3) {
    uint32_t v = (uint32_t)in[i] << 16;
    v |= i + 1 < n ? (uint32_t)in[i + 1] << 8 : 0;
    v |= i + 2 < n ? in[i + 2] : 0;
    size_t chars = i + 2 < n ? 4 : i + 1 < n ? 3 : 2;
    for (size_t j = 0; j < chars; j++)
      out[k++] = a[(v >> (18 - 6 * j)) & 63];
  }
  out[k] = '\0';
  return k;
}

/* HMAC, fetched once (a provider lookup per request otherwise); kept to
 * the process's end */
static EVP_MAC *hmac;
static pthread_once_t hmac_once = PTHREAD_ONCE_INIT;
static void hmac_fetch(void) { hmac = EVP_MAC_fetch(NULL, "HMAC", NULL); }

int rd_salt_for(const unsigned char key[RD_SALT_KEY_LEN], const char *tenant,
                const char *cache_salt, char *out, size_t cap) {
  size_t nt = tenant ? strlen(tenant) : 0;
  size_t ns = cache_salt ? strlen(cache_salt) : 0;
  unsigned char mac[EVP_MAX_MD_SIZE], len[8];
  if (cap == 0)
    return -1;
  *out = '\0';
  if (nt == 0 && ns == 0)
    return 0;
  if (cap < RD_SALT_MAX)
    return -1;
  pthread_once(&hmac_once, hmac_fetch);
  EVP_MAC_CTX *x = hmac ? EVP_MAC_CTX_new(hmac) : NULL;
  OSSL_PARAM ps[] = {OSSL_PARAM_construct_utf8_string("digest", "SHA256", 0),
                     OSSL_PARAM_construct_end()};
  size_t got = 0;
  int ok = x && EVP_MAC_init(x, key, RD_SALT_KEY_LEN, ps) == 1;
  put_len(len, nt);
  ok = ok && EVP_MAC_update(x, len, 8) == 1 &&
       EVP_MAC_update(x, (const unsigned char *)(nt ? tenant : ""), nt) == 1;
  put_len(len, ns);
  ok = ok && EVP_MAC_update(x, len, 8) == 1 &&
       EVP_MAC_update(x, (const unsigned char *)(ns ? cache_salt : ""), ns) == 1 &&
       EVP_MAC_final(x, mac, &got, sizeof mac) == 1 && got == 32;
  EVP_MAC_CTX_free(x);
  if (!ok)
    return -1;
  memcpy(out, "kvp1-", 5);
  return 5 + (int)b64url(mac, 32, out + 5);
}
