/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: what kvplane-routerd reads of a worker's /metrics
 * (connectors/routerd/rd_prom.c) on arbitrary bytes: no read past the end
 * (the input is copied to an exact-size buffer, ASan watches), found values
 * are numbers, a KV capacity is a whole number of tokens below 1e18, and
 * the same text parses the same way twice. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "rd_prom.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *t = malloc(size ? size : 1);
  if (t == NULL)
    return 0;
  memcpy(t, data, size);
  rd_scrape a, b;
  rd_scrape_parse(t, size, &a);
  rd_scrape_parse(t, size, &b);
  if ((a.has_running && isnan(a.running)) || (a.has_waiting && isnan(a.waiting)) ||
      (a.has_kv_use && isnan(a.kv_use)) || a.kv_cap_tokens >= 1000000000000000000ull)
    abort();
  if (memcmp(&a, &b, sizeof a) != 0)
    abort();
  free(t);
  return 0;
}
