/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the token-id text reader of `kvplane hash` on arbitrary
 * bytes, feeding a real chain (xxh3_128, 16-token blocks, model "m") as the
 * tool does.  Work per input is capped: inputs up to 256 KiB, so at most
 * 128 Ki ids are hashed. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_tokens.h"
#include "kvplane.h"

#define MAX_INPUT (256u << 10)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

typedef struct sink {
  kvp_chain *ch;
  size_t ids;
  int rc; /* the chain's error, if any */
} sink;

static int extend(void *arg, const uint32_t *ids, size_t n) {
  sink *s = arg;
  if (n == 0 || n > CLI_TOKENS_BATCH) /* what the reader promises */
    abort();
  s->ids += n;
  int rc = kvp_chain_extend(s->ch, ids, n);
  if (rc < 0)
    s->rc = rc;
  return rc;
}

static kvp_chain *make_chain(kvp_hasher **h) {
  kvp_namespace_desc nd = {.model_id = "m", .block_size = 16};
  kvp_hasher_opts ho = {.algo = KVP_HASH_XXH3_128};
  kvp_namespace ns;
  kvp_chain *ch = NULL;
  if (kvp_namespace_init(&nd, &ns) < 0 ||
      kvp_hasher_create(&ns, &ho, NULL, h) < 0 ||
      kvp_chain_create(*h, NULL, NULL, NULL, &ch) < 0)
    abort(); /* fixed, valid options: only a broken build gets here */
  return ch;
}

/* Failure: the chain's own error passed through, or malformed text with a
 * one-line reason naming the input. */
static void check_failure(const sink *s, int rc, const char *why) {
  if (s->rc < 0 ? rc != s->rc : rc != KVP_ECORRUPT)
    abort();
  if (strncmp(why, "input:", 6) != 0 || strchr(why, '\n') != NULL)
    abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char why[256];
  kvp_hasher *h = NULL;
  if (size > MAX_INPUT)
    return 0;
  /* "r" mode never writes to the buffer: the cast only meets the prototype */
  FILE *f = fmemopen((void *)(uintptr_t)data, size, "r");
  if (f == NULL)
    abort();
  sink s = {.ch = make_chain(&h)};
  int rc = cli_tokens_read(f, "input", extend, &s, why, sizeof why);
  if (rc < 0)
    check_failure(&s, rc, why);
  else if (rc != 0 || why[0] != '\0' || 2 * s.ids > size + 1)
    abort(); /* an id takes a digit and a separator, bar the last */
  if (kvp_chain_tokens(s.ch) != s.ids ||
      kvp_chain_len(s.ch) != s.ids / 16)
    abort();
  fclose(f);
  kvp_chain_destroy(s.ch);
  kvp_hasher_destroy(h);
  return 0;
}
