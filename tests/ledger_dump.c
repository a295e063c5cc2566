/* SPDX-License-Identifier: Apache-2.0 */
/* Fills a ledger with a fixed scenario (tenant names with quotes,
 * backslashes, newlines and UTF-8; a session cap that evicts; two rejected
 * records) and prints it for tests/test_ledger_prom.sh:
 *   ledger_dump prom   Prometheus text
 *   ledger_dump json   one receipt per accepted record, then all totals */
#include <stdio.h>
#include <string.h>

#include "kvplane.h"

#define T_WEIRD "we\"ird\\back\\slash,x=\"}{"
#define T_MULTI "multi\nline"
#define T_UNI "ünïcødé-テナント"

typedef struct spec {
  const char *tenant, *session, *request;
  int32_t worker;
  uint64_t tier[KVP_TIER_COUNT_];      /* reused by tier */
  uint64_t pclass[KVP_CLASS_COUNT_];   /* volatile, semi, stable */
  uint64_t rclass[KVP_CLASS_COUNT_];
  uint64_t miss[KVP_MISS_COUNT_];
  uint64_t bytes[KVP_TIER_COUNT_];
  double flops, seconds;
} spec;

/* Expected sums are written out by hand in test_ledger_prom.sh. */
static const spec scenario[] = {
    {"acme", "s1", "r1", 0, {512, 288, 0, 0}, {188, 300, 512}, {0, 288, 512},
     {184, 0, 0, 16, 0, 0, 0, 0}, {0, 4718592, 0, 0}, 1.6e12, 0.004},
    {"acme", "s1", "r2", 0, {1024, 0, 0, 0}, {176, 512, 512}, {0, 512, 512},
     {0, 0, 0, 16, 0, 160, 0, 0}, {0}, 2.048e12, 0.005},
    {T_WEIRD, "s\"2", "r\\3", 1, {0}, {64, 0, 0}, {0},
     {48, 0, 0, 16, 0, 0, 0, 0}, {0}, 0, 0},
    {T_MULTI, "s\n4", "r4", 2, {0, 0, 1024, 1024}, {0, 0, 2048}, {0, 0, 2048},
     {0}, {0, 0, 16777216, 16777216}, 4.096e12, 0.01},
    {T_UNI, "émoji-😀\t", "r5", 3, {0, 256, 0, 0}, {244, 0, 256}, {0, 0, 256},
     {0, 128, 100, 0, 16, 0, 0, 0}, {0, 4194304, 0, 0}, 0.5e12, 0.00125},
    {NULL, NULL, "r6", -1, {0}, {100, 0, 0}, {0},
     {0, 0, 0, 0, 0, 0, 50, 50}, {0}, 0, 0},
};

static kvp_ledger_record to_record(const spec *s) {
  kvp_ledger_record r = {0};
  r.tenant = s->tenant, r.session = s->session, r.request_id = s->request;
  r.worker = s->worker;
  r.unix_time_ns = 1700000000000000000ull;
  for (int i = 0; i < KVP_TIER_COUNT_; i++) {
    r.reused_by_tier[i] = s->tier[i];
    r.reused_tokens += s->tier[i];
    r.load_bytes[i] = s->bytes[i];
  }
  for (int i = 0; i < KVP_MISS_COUNT_; i++) {
    r.miss_tokens[i] = s->miss[i];
    r.recomputed_tokens += s->miss[i];
  }
  r.prompt_tokens = r.reused_tokens + r.recomputed_tokens;
  memcpy(r.prompt_by_class, s->pclass, sizeof r.prompt_by_class);
  memcpy(r.reused_by_class, s->rclass, sizeof r.reused_by_class);
  r.avoided_flops = s->flops;
  r.avoided_gpu_seconds = s->seconds;
  return r;
}

static int to_stdout(void *opaque, const char *d, size_t n) {
  (void)opaque;
  return fwrite(d, 1, n, stdout) == n ? 0 : KVP_EIO;
}

static int print_receipts(void) {
  char buf[8192];
  for (size_t i = 0; i < sizeof scenario / sizeof scenario[0]; i++) {
    kvp_ledger_record r = to_record(&scenario[i]);
    int n = kvp_ledger_receipt_json(&r, buf, sizeof buf);
    if (n < 0 || (size_t)n >= sizeof buf)
      return n < 0 ? n : KVP_ENOSPC;
    fputs(buf, stdout);
  }
  return 0;
}

static int fill(kvp_ledger *l) {
  for (size_t i = 0; i < sizeof scenario / sizeof scenario[0]; i++) {
    kvp_ledger_record r = to_record(&scenario[i]);
    int rc = kvp_ledger_add(l, &r);
    if (rc < 0)
      return rc;
  }
  /* two rejected records: a broken sum and a name that is not UTF-8 */
  kvp_ledger_record bad = to_record(&scenario[0]);
  bad.prompt_tokens++;
  if (kvp_ledger_add(l, &bad) != KVP_EINVAL)
    return KVP_ESTATE;
  bad = to_record(&scenario[0]);
  bad.tenant = "\xff\xfe";
  return kvp_ledger_add(l, &bad) == KVP_EINVAL ? 0 : KVP_ESTATE;
}

int main(int argc, char **argv) {
  int json = argc == 2 && strcmp(argv[1], "json") == 0;
  if (argc != 2 || (!json && strcmp(argv[1], "prom") != 0)) {
    fprintf(stderr, "usage: ledger_dump prom|json\n");
    return 2;
  }
  kvp_ledger_opts o = {.max_sessions = 3}; /* the 4th session evicts s1 */
  kvp_ledger *l = NULL;
  int rc = kvp_ledger_create(&o, NULL, &l);
  if (rc == 0)
    rc = fill(l);
  if (rc == 0 && json)
    rc = print_receipts();
  if (rc == 0)
    rc = json ? kvp_ledger_json_write(l, 7u, to_stdout, NULL)
              : kvp_ledger_prometheus_write(l, to_stdout, NULL);
  kvp_ledger_destroy(l);
  if (rc < 0 || fflush(stdout) != 0) {
    fprintf(stderr, "ledger_dump: %s\n", kvp_strerror(rc));
    return 1;
  }
  return 0;
}
