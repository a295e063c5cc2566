/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd P/D: the two legs' bodies and the prefill worker's
 * kv_transfer_params (rd_pd_msg.h). */
#include "rd_pd_msg.h"
#include "rd_req.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(char *err, size_t cap, const char *msg) {
  snprintf(err, cap, "%s", msg);
  return -1;
}

/* ---- the bodies: top-level members dropped and appended, every other
 * byte kept as sent (a prompt of token ids is never re-encoded) --------- */
/* Index in drop[] of the key b[0..n) (its bytes as sent), or -1. */
static int key_index(const char *b, size_t n, const char *const *drop,
                     size_t nd) {
  for (size_t j = 0; j < nd; j++)
    if (strlen(drop[j]) == n && memcmp(b, drop[j], n) == 0)
      return (int)j;
  return -1;
}

/* The object body[0..len) without its top-level members named in drop
 * (bit j of *seen: drop[j] was there), with `add` (members' text, may be
 * "") appended: malloc'd into *out.  A key spelled with escapes is not
 * recognised: kept, and then overridden by the appended member (JSON
 * readers -- Python's, jansson -- keep the last).  0 or -1 (not an object
 * this scan can walk; the caller parsed it first) / out of memory. */
static int rewrite(const char *body, size_t len, const char *const *drop,
                   size_t nd, const char *add, unsigned *seen, char **out,
                   size_t *out_len) {
  size_t i = rd_json_skip_ws(body, 0, len), al = strlen(add), k = 1;
  char *o = malloc(len + al + 3);
  *seen = 0;
  if (o == NULL || i >= len || body[i] != '{')
    goto bad;
  o[0] = '{';
  for (i = rd_json_skip_ws(body, i + 1, len); i < len && body[i] == '"';) {
    size_t k0 = i, k1 = rd_json_skip_str(body, i, len);
    size_t c = rd_json_skip_ws(body, k1, len);
    if (c >= len || body[c] != ':')
      goto bad;
    size_t e =
        rd_json_skip_value(body, rd_json_skip_ws(body, c + 1, len), len);
    int j = key_index(body + k0 + 1, k1 - k0 - 2, drop, nd);
    if (j >= 0)
      *seen |= 1u << j;
    else {
      if (k > 1)
        o[k++] = ',';
      memcpy(o + k, body + k0, e - k0);
      k += e - k0;
    }
    i = rd_json_skip_ws(body, e, len);
    if (i < len && body[i] == ',') /* a comma between members, or the end */
      i = rd_json_skip_ws(body, i + 1, len);
    else if (i < len && body[i] != '}')
      goto bad;
  }
  if (i >= len || body[i] != '}')
    goto bad;
  if (al && k > 1)
    o[k++] = ',';
  memcpy(o + k, add, al);
  k += al;
  o[k++] = '}';
  o[k] = '\0';
  *out = o;
  *out_len = k;
  return 0;
bad:
  free(o);
  return -1;
}

static uint32_t read_count(const char *b, size_t i, size_t n) {
  uint64_t v = 0;
  size_t d = 0;
  for (; i < n && b[i] >= '0' && b[i] <= '9' && d < 10; i++, d++)
    v = v * 10 + (uint64_t)(b[i] - '0');
  return v > UINT32_MAX ? UINT32_MAX : (uint32_t)v;
}

uint32_t rd_pd_max_tokens(const char *body, size_t len) {
  uint32_t mt = 0, mct = 0;
  size_t i = rd_json_skip_ws(body, 0, len);
  if (i >= len || body[i] != '{')
    return 0;
  for (i = rd_json_skip_ws(body, i + 1, len); i < len && body[i] == '"';) {
    size_t k0 = i, k1 = rd_json_skip_str(body, i, len);
    size_t c = rd_json_skip_ws(body, k1, len);
    if (c >= len || body[c] != ':')
      return 0;
    size_t v = rd_json_skip_ws(body, c + 1, len);
    size_t e = rd_json_skip_value(body, v, len);
    size_t kl = k1 - k0 - 2;
    if (kl == 10 && memcmp(body + k0 + 1, "max_tokens", 10) == 0)
      mt = read_count(body, v, e);
    else if (kl == 21 &&
             memcmp(body + k0 + 1, "max_completion_tokens", 21) == 0)
      mct = read_count(body, v, e);
    i = rd_json_skip_ws(body, e, len);
    if (i < len && body[i] == ',')
      i = rd_json_skip_ws(body, i + 1, len);
    else
      break;
  }
  return mct ? mct : mt;
}

int rd_pd_prefill_body(const char *body, size_t len, char **out,
                       size_t *out_len, char *err, size_t cap) {
  static const char *const drop[] = {
      "max_completion_tokens", "kv_transfer_params", "stream", "max_tokens",
      "stream_options", "min_tokens", "min_completion_tokens"};
  char *tmp = NULL;
  size_t n;
  unsigned seen;
  *out = NULL;
  if (rewrite(body, len, drop, sizeof drop / sizeof *drop,
              "\"kv_transfer_params\":{\"do_remote_decode\":true,"
              "\"do_remote_prefill\":false,\"remote_engine_id\":null,"
              "\"remote_block_ids\":null,\"remote_host\":null,"
              "\"remote_port\":null},\"stream\":false,\"max_tokens\":1",
              &seen, &tmp, &n) < 0)
    return fail(err, cap, "the request body is not a JSON object");
  if (!(seen & 1)) { /* max_completion_tokens only where it was given */
    *out = tmp;
    *out_len = n;
    return 0;
  }
  *out = malloc(n + 32);
  if (*out == NULL) {
    free(tmp);
    return fail(err, cap, "out of memory");
  }
  memcpy(*out, tmp, n - 1); /* its closing brace replaced */
  *out_len = n - 1 + (size_t)sprintf(*out + n - 1,
                                     ",\"max_completion_tokens\":1}");
  free(tmp);
  return 0;
}

static bool is_block_id(json_t *v) {
  return json_is_integer(v) && json_integer_value(v) >= 0;
}

static bool all_ids(json_t *a) {
  for (size_t i = 0; i < json_array_size(a); i++)
    if (!is_block_id(json_array_get(a, i)))
      return false;
  return json_is_array(a);
}

/* remote_block_ids: a list of ids, or a list of such lists (one per KV
 * cache group, vLLM >= 0.11) */
static int take_blocks(json_t *ids, rd_pd_params *p, char *err, size_t cap) {
  bool grouped = json_is_array(json_array_get(ids, 0));
  bool ok = grouped || all_ids(ids);
  for (size_t i = 0; grouped && ok && i < json_array_size(ids); i++)
    ok = all_ids(json_array_get(ids, i));
  if (!ok)
    return fail(err, cap, "remote_block_ids is not a list of block ids "
                "(non-negative integers) nor a list of such lists");
  json_t *first = grouped ? json_array_get(ids, 0) : ids;
  if (json_array_size(first) > RD_PD_BLOCKS_MAX)
    return fail(err, cap, "remote_block_ids holds more than 1048576 ids");
  p->n_blocks = (uint32_t)json_array_size(first);
  p->n_groups = grouped ? (uint32_t)json_array_size(ids) : 0;
  return 0;
}

static int take_str(json_t *kv, const char *key, char *dst, char *err,
                    size_t cap) {
  json_t *v = json_object_get(kv, key);
  size_t n = json_string_length(v);
  if (!json_is_string(v) || n == 0 || n >= RD_PD_ID_MAX ||
      strlen(json_string_value(v)) != n) {
    snprintf(err, cap, "%s is not a non-empty string of at most %d bytes "
             "without NUL", key, RD_PD_ID_MAX - 1);
    return -1;
  }
  memcpy(dst, json_string_value(v), n + 1);
  return 0;
}

static int check_params(json_t *kv, rd_pd_params *p, char *err, size_t cap) {
  if (!json_is_object(kv))
    return fail(err, cap, kv && !json_is_null(kv)
                              ? "kv_transfer_params is not an object"
                              : "the answer has no kv_transfer_params (is "
                                "the worker started with a KV connector, "
                                "kv_role kv_producer or kv_both?)");
  if (!json_is_true(json_object_get(kv, "do_remote_prefill")))
    return fail(err, cap, "kv_transfer_params.do_remote_prefill is not true");
  if (json_is_true(json_object_get(kv, "do_remote_decode")))
    return fail(err, cap, "kv_transfer_params.do_remote_decode is true in a "
                "prefill's answer");
  json_t *port = json_object_get(kv, "remote_port");
  if (take_str(kv, "remote_engine_id", p->engine_id, err, cap) < 0 ||
      take_str(kv, "remote_host", p->host, err, cap) < 0)
    return -1;
  if (!json_is_integer(port) || json_integer_value(port) < 1 ||
      json_integer_value(port) > 65535)
    return fail(err, cap, "remote_port is not an integer in [1, 65535]");
  p->port = (uint32_t)json_integer_value(port);
  return take_blocks(json_object_get(kv, "remote_block_ids"), p, err, cap);
}

/* Where the answer's top-level kv_transfer_params value is: 1 ([*v0,
 * *v1)), 0 (absent), -1 (not an object the scanners can walk), -2 (the
 * member twice).  The answer is not parsed whole: a real vLLM's logprobs
 * can hold a token that decodes to NUL as an object key ("\u0000"), which
 * jansson refuses (test_vllm_pd met it); only the parameters are parsed. */
static int find_params(const char *b, size_t n, size_t *v0, size_t *v1) {
  int found = 0;
  size_t i = rd_json_skip_ws(b, 0, n);
  if (i >= n || b[i] != '{')
    return -1;
  for (i = rd_json_skip_ws(b, i + 1, n); i < n && b[i] == '"';) {
    size_t k0 = i, k1 = rd_json_skip_str(b, i, n);
    size_t c = rd_json_skip_ws(b, k1, n);
    if (c >= n || b[c] != ':')
      return -1;
    size_t v = rd_json_skip_ws(b, c + 1, n), e = rd_json_skip_value(b, v, n);
    if (k1 - k0 == 20 && memcmp(b + k0 + 1, "kv_transfer_params", 18) == 0) {
      if (found++)
        return -2;
      *v0 = v;
      *v1 = e;
    }
    i = rd_json_skip_ws(b, e, n);
    if (i < n && b[i] == ',')
      i = rd_json_skip_ws(b, i + 1, n);
    else
      break;
  }
  return i < n && b[i] == '}' ? found : -1;
}

int rd_pd_take_params(const char *reply, size_t len, rd_pd_params *p,
                      char **params, char *err, size_t cap) {
  size_t v0 = 0, v1 = 0;
  json_t *kv = NULL;
  json_error_t je;
  memset(p, 0, sizeof *p);
  *params = NULL;
  int f = find_params(reply, len, &v0, &v1);
  if (f < 0)
    return fail(err, cap, f == -2 ? "the prefill's answer has two "
                "kv_transfer_params members" : "the prefill's answer is not "
                "a JSON object");
  if (f == 1 && (kv = json_loadb(reply + v0, v1 - v0, JSON_REJECT_DUPLICATES |
                                 JSON_DECODE_ANY | JSON_ALLOW_NUL, &je)) == NULL) {
    snprintf(err, cap, "kv_transfer_params is not valid JSON (%s)", je.text);
    return -1;
  }
  int rc = check_params(kv, p, err, cap);
  if (rc == 0 &&
      (*params = json_dumps(kv, JSON_COMPACT | JSON_REAL_PRECISION(17))) == NULL)
    rc = fail(err, cap, "out of memory");
  json_decref(kv);
  if (rc < 0)
    memset(p, 0, sizeof *p);
  return rc;
}

int rd_pd_decode_body(const char *body, size_t len, const char *params,
                      char **out, size_t *out_len, char *err, size_t cap) {
  static const char *const drop[] = {"kv_transfer_params"};
  unsigned seen;
  char *add = malloc(strlen(params) + 32);
  *out = NULL;
  if (add == NULL)
    return fail(err, cap, "out of memory");
  sprintf(add, "\"kv_transfer_params\":%s", params);
  int rc = rewrite(body, len, drop, 1, add, &seen, out, out_len);
  free(add);
  return rc < 0 ? fail(err, cap, "the request body is not a JSON object") : 0;
}
