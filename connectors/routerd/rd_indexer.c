/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd KV-indexer service: placeholder until the indexer API
 * lands (docs/routerd.md). */
#include "rd.h"

#include <stdio.h>

int rd_indexer_start(rd_server *s, const char *listen, char *err, size_t cap) {
  (void)s;
  snprintf(err, cap, "the indexer service (%s) is not built yet", listen);
  return -1;
}

void rd_indexer_stop(rd_server *s) { (void)s; }
