/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane-routerd: a worker's /metrics text (rd_prom.h). */
#include "rd_prom.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Sums the samples of metric `name` (any labels) in Prometheus text; a
 * value that is not a finite number (NaN, +-Inf: +Inf and -Inf would sum
 * to NaN) is skipped. */
static double prom_sum(const char *text, size_t len, const char *name,
                       bool *found) {
  size_t nl = strlen(name);
  double sum = 0;
  for (const char *p = text, *end = text + len; p < end;) {
    const char *eol = memchr(p, '\n', (size_t)(end - p));
    const char *le = eol ? eol : end;
    if ((size_t)(le - p) > nl && memcmp(p, name, nl) == 0 &&
        (p[nl] == '{' || p[nl] == ' ')) {
      const char *v = memrchr(p, ' ', (size_t)(le - p));
      char num[64];
      size_t n = v ? (size_t)(le - v - 1) : 0;
      if (n > 0 && n < sizeof num) {
        memcpy(num, v + 1, n);
        num[n] = '\0';
        char *e;
        double d = strtod(num, &e);
        if (e != num && isfinite(d)) {
          sum += d;
          *found = true;
        }
      }
    }
    p = le + 1;
  }
  return sum;
}

/* A label's value in the first sample of metric `name` (vLLM's info
 * gauges: cache_config_info{...,num_gpu_blocks="N",...} 1.0), as a number;
 * -1: no such sample or label, or not a number. */
static double prom_label(const char *text, size_t len, const char *name,
                         const char *label) {
  size_t nl = strlen(name), ll = strlen(label);
  for (const char *p = text, *end = text + len; p < end;) {
    const char *eol = memchr(p, '\n', (size_t)(end - p));
    const char *le = eol ? eol : end, *q = p + nl + 1;
    if ((size_t)(le - p) <= nl || memcmp(p, name, nl) != 0 || p[nl] != '{') {
      p = le + 1;
      continue;
    }
    while (q < le && *q != '}') { /* key="value", ... */
      const char *eq = memchr(q, '=', (size_t)(le - q)), *v1;
      if (eq == NULL || eq + 1 >= le || eq[1] != '"')
        return -1;
      for (v1 = eq + 2; v1 < le && *v1 != '"'; v1 += *v1 == '\\' ? 2 : 1)
        ;
      if (v1 >= le)
        return -1;
      if ((size_t)(eq - q) == ll && memcmp(q, label, ll) == 0) {
        char num[32];
        size_t n = (size_t)(v1 - eq - 2);
        if (n == 0 || n >= sizeof num)
          return -1;
        memcpy(num, eq + 2, n);
        num[n] = '\0';
        char *e;
        double d = strtod(num, &e);
        return *e == '\0' && d >= 0 && d < 1e15 ? d : -1;
      }
      q = v1 + 1 + (v1 + 1 < le && v1[1] == ',');
    }
    return -1;
  }
  return -1;
}

void rd_scrape_parse(const char *t, size_t n, rd_scrape *out) {
  memset(out, 0, sizeof *out);
  out->running = prom_sum(t, n, "vllm:num_requests_running", &out->has_running);
  out->waiting = prom_sum(t, n, "vllm:num_requests_waiting", &out->has_waiting);
  out->kv_use = prom_sum(t, n, "vllm:kv_cache_usage_perc", &out->has_kv_use);
  double gb = prom_label(t, n, "vllm:cache_config_info", "num_gpu_blocks");
  double bs = prom_label(t, n, "vllm:cache_config_info", "block_size");
  double cap = gb > 0 && bs > 0 ? gb * bs : 0; /* absurd sizes: unknown */
  out->kv_cap_tokens = cap >= 1 && cap < 1e18 ? (uint64_t)cap : 0;
}
