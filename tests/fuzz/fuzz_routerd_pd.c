/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: kvplane-routerd's P/D bodies and the prefill worker's
 * answer (connectors/routerd/rd_pd_msg.c) on arbitrary bytes.  The first
 * byte picks what the rest is: a prefill worker's answer (its
 * kv_transfer_params taken), or a client's body (both legs' bodies made).
 * Checks: a refusal says why; accepted parameters are within the limits
 * and re-read to the same fields; of a client's JSON object, a prefill body
 * asks for one token, unstreamed, with do_remote_decode, a decode body
 * carries the parameters given, and both keep every other member equal. */
#include <jansson.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rd_pd_msg.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_params(const char *b, size_t n) {
  rd_pd_params p, q;
  char err[256] = "", *params = NULL;
  if (rd_pd_take_params(b, n, &p, &params, err, sizeof err) < 0) {
    if (err[0] == '\0' || params != NULL || p.n_blocks || p.port)
      abort();
    return;
  }
  if (p.port < 1 || p.port > 65535 || p.n_blocks > RD_PD_BLOCKS_MAX ||
      p.engine_id[0] == '\0' || p.host[0] == '\0' ||
      strlen(p.engine_id) >= RD_PD_ID_MAX || strlen(p.host) >= RD_PD_ID_MAX)
    abort();
  /* the parameters as forwarded read back the same */
  size_t m = strlen(params) + 32;
  char *again = malloc(m);
  char *q_params = NULL;
  if (again == NULL)
    abort();
  snprintf(again, m, "{\"kv_transfer_params\":%s}", params);
  if (rd_pd_take_params(again, strlen(again), &q, &q_params, err,
                        sizeof err) < 0 ||
      memcmp(&p, &q, sizeof p) != 0 || strcmp(params, q_params) != 0)
    abort();
  free(q_params);
  free(again);
  free(params);
}

static bool ours(const char *key) {
  static const char *const k[] = {"max_completion_tokens", "kv_transfer_params",
                                  "stream", "max_tokens", "stream_options",
                                  "min_tokens", "min_completion_tokens"};
  for (size_t i = 0; i < sizeof k / sizeof *k; i++)
    if (strcmp(key, k[i]) == 0)
      return true;
  return false;
}

/* every member of `in` but the legs' own kept, equal, in out */
static void same_rest(json_t *in, json_t *out) {
  const char *key;
  json_t *v;
  json_object_foreach(in, key, v) if (!ours(key) &&
                                      !json_equal(v, json_object_get(out, key)))
      abort();
}

static void check_bodies(const char *b, size_t n) {
  char err[256] = "", *pre = NULL, *dec = NULL;
  size_t pn = 0, dn = 0;
  json_t *in = json_loadb(b, n, JSON_REJECT_DUPLICATES, NULL);
  int rc = rd_pd_prefill_body(b, n, &pre, &pn, err, sizeof err);
  if (rc < 0 && (err[0] == '\0' || pre != NULL))
    abort();
  if (!json_is_object(in)) { /* what the router never passes: any result */
    json_decref(in);
    free(pre);
    return;
  }
  if (rc < 0)
    abort(); /* a JSON object the scan could not walk */
  json_t *o = json_loadb(pre, pn, 0, NULL);
  json_t *kv = json_object_get(o, "kv_transfer_params");
  if (o == NULL || !json_is_false(json_object_get(o, "stream")) ||
      json_integer_value(json_object_get(o, "max_tokens")) != 1 ||
      !json_is_true(json_object_get(kv, "do_remote_decode")) ||
      json_object_get(o, "stream_options") != NULL ||
      json_object_get(o, "min_tokens") != NULL ||
      (json_object_get(in, "max_completion_tokens") &&
       json_integer_value(json_object_get(o, "max_completion_tokens")) != 1))
    abort();
  same_rest(in, o);
  json_decref(o);
  static const char params[] = "{\"do_remote_prefill\":true,\"x\":[1]}";
  if (rd_pd_decode_body(b, n, params, &dec, &dn, err, sizeof err) < 0)
    abort(); /* the same body made a prefill leg */
  o = json_loadb(dec, dn, 0, NULL);
  kv = json_object_get(o, "kv_transfer_params");
  if (!json_is_true(json_object_get(kv, "do_remote_prefill")) ||
      !json_is_array(json_object_get(kv, "x")))
    abort();
  same_rest(in, o);
  json_decref(o);
  json_decref(in);
  free(pre);
  free(dec);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0 || size > (1u << 20))
    return 0;
  const char *b = (const char *)data + 1;
  if (data[0] & 1)
    check_params(b, size - 1);
  else
    check_bodies(b, size - 1);
  return 0;
}
