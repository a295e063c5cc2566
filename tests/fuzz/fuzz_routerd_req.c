/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: kvplane-routerd's OpenAI request parser
 * (connectors/routerd/rd_req.c) on arbitrary bytes.  The first byte picks
 * completions or chat, the rest is the body.  Checks what the router relies
 * on: a parsed request has a token-id prompt (ids < 2^31) or a text of the
 * stated length; a rejection is a 400 with a message whose JSON error body
 * parses back; a tenant salt added to a parsed body keeps it an object with
 * that salt. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rd_req.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_ok(const rd_req *r, const char *body, size_t len) {
  if ((r->tokens == NULL) == (r->text == NULL) && r->tokens != NULL)
    abort(); /* one or the other, never both */
  if (r->tokens == NULL && r->text == NULL)
    abort();
  for (size_t i = 0; r->tokens && i < r->n_tokens; i++)
    if (r->tokens[i] > INT32_MAX)
      abort();
  if (r->text && strlen(r->text) > r->text_len)
    abort();
  size_t n = 0;
  char *s = rd_req_with_salt(body, len, "kvp1-t_S-0", &n);
  if (s == NULL) /* the splice walks every object jansson took (ENOMEM
                    aside, which a fuzz run does not meet) */
    abort();
  json_t *o = json_loads(s, 0, NULL);
  const char *v = json_string_value(json_object_get(o, "cache_salt"));
  if (o == NULL || v == NULL || strcmp(v, "kvp1-t_S-0") != 0 ||
      strlen(s) != n)
    abort();
  json_decref(o);
  free(s);
}

static void check_err(const rd_req_err *e) {
  if (e->status != 400 || e->message[0] == '\0')
    abort();
  char *s = rd_error_json(e->status, e->param, e->message);
  if (s == NULL)
    return;
  json_t *o = json_loads(s, 0, NULL);
  json_t *code = json_object_get(json_object_get(o, "error"), "code");
  if (o == NULL || json_integer_value(code) != 400)
    abort();
  json_decref(o);
  free(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0)
    return 0;
  rd_kind k = data[0] & 1 ? RD_CHAT : RD_COMPLETIONS;
  const char *body = (const char *)data + 1;
  rd_req r, b;
  rd_req_err e, be;
  /* the 64-byte id scan and the byte-by-byte one read alike */
  rd_req_wide_scan = false;
  int brc = rd_req_parse(k, body, size - 1, &b, &be);
  rd_req_wide_scan = true;
  int rc = rd_req_parse(k, body, size - 1, &r, &e);
  if (rc != brc || (rc == 0 && (r.n_tokens != b.n_tokens ||
                                (r.tokens == NULL) != (b.tokens == NULL) ||
                                (r.tokens && memcmp(r.tokens, b.tokens,
                                                    r.n_tokens * 4) != 0))))
    abort();
  if (brc == 0)
    rd_req_free(&b);
  if (rc == 0) {
    check_ok(&r, body, size - 1);
    rd_req_free(&r);
  } else {
    if (r.tokens != NULL || r.text != NULL)
      abort(); /* a failed parse leaves nothing to free */
    check_err(&e);
  }
  return 0;
}
