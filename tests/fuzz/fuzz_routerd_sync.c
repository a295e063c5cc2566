/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: kvplane-routerd's replica sync messages
 * (connectors/routerd/rd_sync_msg.c) on arbitrary bytes.  A message that
 * decodes re-encodes to bytes that decode to the same message (fields,
 * keys, loads); a decode never reports more keys or loads than the limits. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rd_sync_msg.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void same(const rd_sync_msg *a, const rd_sync_msg *b) {
  if (a->type != b->type || a->replica != b->replica ||
      a->wall_ns != b->wall_ns || strcmp(a->url, b->url) != 0 ||
      a->request_id != b->request_id || a->tokens != b->tokens ||
      a->session_id != b->session_id ||
      a->n_keys != b->n_keys || a->n_loads != b->n_loads)
    abort();
  if (a->n_keys && memcmp(a->keys, b->keys, a->n_keys * sizeof *a->keys))
    abort();
  for (size_t i = 0; i < a->n_loads; i++)
    if (strcmp(a->loads[i].url, b->loads[i].url) != 0 ||
        a->loads[i].requests != b->loads[i].requests ||
        a->loads[i].tokens != b->loads[i].tokens)
      abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  rd_sync_msg m, back;
  int rc = rd_sync_decode(data, size, &m);
  if (rc != 0) {
    if (m.keys != NULL || m.loads != NULL)
      abort(); /* nothing left to free */
    return 0;
  }
  if (m.n_keys > RD_SYNC_KEYS_MAX || m.n_loads > RD_SYNC_SNAP_MAX)
    abort();
  char *enc = NULL;
  size_t n = 0;
  if (rd_sync_encode(&m, &enc, &n) == 0) {
    if (rd_sync_decode(enc, n, &back) != 0)
      abort();
    same(&m, &back);
    rd_sync_msg_free(&back);
    free(enc);
  }
  rd_sync_msg_free(&m);
  return 0;
}
