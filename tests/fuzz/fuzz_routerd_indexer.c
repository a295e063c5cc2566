/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: kvplane-routerd's KV-indexer request parser
 * (connectors/routerd/rd_idx_req.c) on arbitrary bytes.  The first byte picks
 * the endpoint (register, unregister, query, query_by_hash), the rest is the
 * body.  Checks what rd_indexer.c relies on: a parsed request has its
 * endpoint's required fields, NUL-terminated strings and arrays as long as
 * their counts; a rejection is a 400 with a message. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rd_idx_req.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_str(const char *s, size_t cap) {
  if (memchr(s, '\0', cap) == NULL)
    abort();
}

static void check_ok(const rd_ix_req *r) {
  check_str(r->instance, sizeof r->instance);
  check_str(r->endpoint, sizeof r->endpoint);
  check_str(r->model, sizeof r->model);
  check_str(r->tenant, sizeof r->tenant);
  check_str(r->cache_salt, sizeof r->cache_salt);
  if (r->op != RD_IX_UNREGISTER && r->model[0] == '\0')
    abort();
  if ((r->op == RD_IX_REGISTER || r->op == RD_IX_UNREGISTER) &&
      r->instance[0] == '\0')
    abort();
  if (r->op == RD_IX_REGISTER && (r->endpoint[0] == '\0' || r->block_size == 0))
    abort();
  if (r->op == RD_IX_QUERY && (r->tokens == NULL || r->n_tokens > RD_IX_TOKENS_MAX))
    abort();
  if (r->op == RD_IX_QUERY_HASH && (r->hashes == NULL || r->has_salt))
    abort();
  if (r->dp_rank < -1 || r->dp_rank > 65535)
    abort();
  for (size_t i = 0; i < r->n_tokens; i++) /* touch every element */
    if (r->tokens[i] == 0xffffffffu && i == SIZE_MAX)
      abort();
  for (size_t i = 0; i < r->n_hashes; i++)
    if (r->hashes[i] == 1 && i == SIZE_MAX)
      abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1)
    return 0;
  rd_ix_op op = (rd_ix_op)(data[0] % 4);
  rd_ix_req r;
  rd_req_err e;
  if (rd_ix_parse(op, (const char *)data + 1, size - 1, &r, &e) == 0) {
    check_ok(&r);
    rd_ix_free(&r);
  } else if (e.status != 400 || e.message[0] == '\0' || r.tokens || r.hashes) {
    abort();
  }
  static const unsigned char key[RD_SALT_KEY_LEN] = {1};
  char salt[RD_SALT_MAX];
  if (rd_salt_for(key, size > 2 ? "t" : "", "", salt, sizeof salt) < 0)
    abort();
  return 0;
}
