/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd P/D: the two legs' bodies and the prefill worker's
 * kv_transfer_params (rd_pd_msg.h). */
#include "rd_pd_msg.h"

#include <jansson.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(char *err, size_t cap, const char *msg) {
  snprintf(err, cap, "%s", msg);
  return -1;
}

static json_t *load_object(const char *b, size_t n, char *err, size_t cap,
                           const char *what) {
  json_error_t je;
  json_t *o = json_loadb(b, n, JSON_REJECT_DUPLICATES, &je);
  if (o != NULL && json_is_object(o))
    return o;
  snprintf(err, cap, "%s is not a JSON object (%s)", what,
           o ? "another JSON value" : je.text);
  json_decref(o);
  return NULL;
}

static int dump(json_t *o, char **out, size_t *out_len, char *err,
                size_t cap) {
  *out = json_dumps(o, JSON_COMPACT | JSON_REAL_PRECISION(17));
  json_decref(o);
  if (*out == NULL)
    return fail(err, cap, "out of memory");
  *out_len = strlen(*out);
  return 0;
}

int rd_pd_prefill_body(const char *body, size_t len, char **out,
                       size_t *out_len, char *err, size_t cap) {
  json_t *o = load_object(body, len, err, cap, "the request body");
  json_t *kv = json_pack("{s:b, s:b, s:n, s:n, s:n, s:n}", "do_remote_decode",
                         1, "do_remote_prefill", 0, "remote_engine_id",
                         "remote_block_ids", "remote_host", "remote_port");
  if (o == NULL || kv == NULL) {
    json_decref(o);
    json_decref(kv);
    return o ? fail(err, cap, "out of memory") : -1;
  }
  int rc = json_object_set_new(o, "kv_transfer_params", kv) |
           json_object_set_new(o, "stream", json_false()) |
           json_object_set_new(o, "max_tokens", json_integer(1));
  if (json_object_get(o, "max_completion_tokens"))
    rc |= json_object_set_new(o, "max_completion_tokens", json_integer(1));
  static const char *const drop[] = {"stream_options", "min_tokens",
                                     "min_completion_tokens"};
  for (size_t i = 0; i < sizeof drop / sizeof *drop; i++)
    json_object_del(o, drop[i]); /* -1: it was not there */
  if (rc != 0) {
    json_decref(o);
    return fail(err, cap, "out of memory");
  }
  return dump(o, out, out_len, err, cap);
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

int rd_pd_take_params(const char *reply, size_t len, rd_pd_params *p,
                      char **params, char *err, size_t cap) {
  memset(p, 0, sizeof *p);
  *params = NULL;
  json_t *o = load_object(reply, len, err, cap, "the prefill's answer");
  if (o == NULL)
    return -1;
  json_t *kv = json_object_get(o, "kv_transfer_params");
  int rc = check_params(kv, p, err, cap);
  if (rc == 0 &&
      (*params = json_dumps(kv, JSON_COMPACT | JSON_REAL_PRECISION(17))) == NULL)
    rc = fail(err, cap, "out of memory");
  json_decref(o);
  if (rc < 0)
    memset(p, 0, sizeof *p);
  return rc;
}

int rd_pd_decode_body(const char *body, size_t len, const char *params,
                      char **out, size_t *out_len, char *err, size_t cap) {
  json_t *o = load_object(body, len, err, cap, "the request body");
  json_t *kv = o ? load_object(params, strlen(params), err, cap,
                               "kv_transfer_params")
                 : NULL;
  if (kv == NULL) {
    json_decref(o);
    return -1;
  }
  if (json_object_set_new(o, "kv_transfer_params", kv) != 0) {
    json_decref(o);
    return fail(err, cap, "out of memory");
  }
  return dump(o, out, out_len, err, cap);
}
