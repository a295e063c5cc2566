/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd: what it reads of a worker's /metrics (Prometheus text,
 * vLLM's names).  A pure function over untrusted bytes
 * (tests/fuzz/fuzz_routerd_scrape.c): malformed lines are skipped, a value
 * that does not parse is not found; nothing is read past len. */
#ifndef KVP_RD_PROM_H
#define KVP_RD_PROM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct rd_scrape {
  bool has_running, has_waiting, has_kv_use;
  double running, waiting; /* vllm:num_requests_running / _waiting, summed */
  double kv_use;           /* vllm:kv_cache_usage_perc (0..1 as vLLM says) */
  /* vllm:cache_config_info's num_gpu_blocks x block_size labels: the KV
   * cache in tokens; 0 when either is missing or not a number */
  uint64_t kv_cap_tokens;
} rd_scrape;

void rd_scrape_parse(const char *text, size_t len, rd_scrape *out);

#endif
