/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the vector-file reader on arbitrary bytes, then the
 * checker (hence the library's vLLM hashing) on whatever parses.  Work per
 * input is capped: inputs up to 1 MiB, up to 64 Ki tokens hashed. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cli_vectors.h"

#define MAX_INPUT (1u << 20)
#define MAX_HASHED_TOKENS (1u << 16)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Every failure must explain itself in a NUL-terminated reason. */
static void need_reason(const char *why, size_t cap) {
  if (why[0] == '\0' || memchr(why, '\0', cap) == NULL)
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char why[256];
  cli_vectors *v = NULL;
  if (size > MAX_INPUT)
    return 0;
  int rc = cli_vectors_parse(data, size, NULL, &v, why, sizeof why);
  if (rc < 0) {
    if (v != NULL)
      abort();
    need_reason(why, sizeof why);
    return 0;
  }
  size_t budget = MAX_HASHED_TOKENS, blocks = 0;
  for (size_t i = 0; i < v->n_cases; i++) {
    const cli_vector_case *c = &v->cases[i];
    /* what the reader promises the checker */
    if (c->block_size == 0 || c->block_size > KVP_BLOCK_SIZE_MAX ||
        c->n_blocks != c->n_tokens / c->block_size)
      abort();
    blocks += c->n_blocks;
    if (c->n_tokens > budget)
      continue;
    budget -= c->n_tokens;
    if (cli_vectors_check(c, why, sizeof why) != 0)
      need_reason(why, sizeof why);
  }
  if (blocks != v->n_blocks)
    abort();
  cli_vectors_destroy(v);
  return 0;
}
