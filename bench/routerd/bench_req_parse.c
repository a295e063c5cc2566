/* SPDX-License-Identifier: Apache-2.0 */
/* bench_req_parse: kvplane-routerd reading a 32K-token token-id prompt (the
 * body bench_routerd sends, ~220 KB of JSON) -- its fast path with the
 * 64-byte id scan, the same fast path one byte at a time, and the
 * straightforward baseline: jansson parsing the whole body into a tree and
 * the ids read off it.  Six rounds on the same body, the two scans' order
 * swapped each round, jansson (30x slower) at a fifth of the reps; all must
 * give the same ids.  Ratios hold; absolute times drift. */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kvplane.h"
#include "rd_req.h"

typedef struct ctx {
  char *body;
  size_t len;
  uint32_t n_ids;
  uint32_t *want;
  bool wide;
  int bad;
} ctx;

static char *make_body(uint32_t n, size_t *len, uint32_t *want) {
  char *s = bench_calloc((size_t)n * 8 + 128, 1), *p = s;
  uint64_t st = 1;
  p += sprintf(p, "{\"model\":\"bench\",\"prompt\":[");
  for (uint32_t i = 0; i < n; i++) { /* bench_routerd's ids: 256..120255 */
    want[i] = 256 + (uint32_t)(bench_splitmix(&st) % 120000);
    p += sprintf(p, "%s%" PRIu32, i ? "," : "", want[i]);
  }
  p += sprintf(p, "],\"max_tokens\":1,\"temperature\":0}");
  *len = (size_t)(p - s);
  return s;
}

static void run_router(void *arg, int rep) {
  (void)rep;
  ctx *c = arg;
  rd_req r;
  rd_req_err e;
  rd_req_wide_scan = c->wide;
  if (rd_req_parse(RD_COMPLETIONS, c->body, c->len, &r, &e) < 0 ||
      r.n_tokens != c->n_ids ||
      memcmp(r.tokens, c->want, c->n_ids * sizeof *c->want) != 0)
    c->bad++;
  rd_req_free(&r);
}

static void run_jansson(void *arg, int rep) {
  (void)rep;
  ctx *c = arg;
  json_t *o = json_loadb(c->body, c->len, JSON_REJECT_DUPLICATES, NULL);
  json_t *a = json_object_get(o, "prompt");
  uint32_t *t = malloc(c->n_ids * sizeof *t);
  size_t n = json_array_size(a);
  for (size_t i = 0; t != NULL && i < n && i < c->n_ids; i++)
    t[i] = (uint32_t)json_integer_value(json_array_get(a, i));
  if (t == NULL || n != c->n_ids ||
      memcmp(t, c->want, c->n_ids * sizeof *t) != 0)
    c->bad++;
  free(t);
  json_decref(o);
}

static const bench_col cols[] = {
    {"", 30}, {"p50", 9}, {"p99", 9}, {"p99.9", 9}, {"mean", 9}};
static const bench_table table = {BENCH_TEXT, 2, cols, 5};

int main(int argc, char **argv) {
  uint32_t tokens = 32768;
  int reps = 300, cpu = -1;
  bool quick = false;
  bench_opt o[] = {
      BENCH_OPT("tokens", BENCH_U32, &tokens, "N", "token ids in the prompt"),
      BENCH_OPT("reps", BENCH_INT, &reps, "N", "timed parses per path"),
      BENCH_OPT("cpu", BENCH_INT, &cpu, "N|-1", "pin to this CPU"),
      BENCH_OPT("quick", BENCH_FLAG, &quick, NULL,
                "20 reps: checks only that the paths agree (exit 1 if not)"),
      BENCH_OPT_END};
  if (bench_parse("bench_req_parse",
                  "Times kvplane-routerd's request parser on a token-id "
                  "prompt: the 64-byte id scan,\nthe byte-by-byte scan and "
                  "jansson's whole tree (the baseline).\n",
                  o, argc, argv) < 0)
    return 2;
  if (quick && !bench_given(o, "reps"))
    reps = 20;
  if (tokens == 0 || reps <= 0) {
    fprintf(stderr, "bench_req_parse: tokens and reps must be > 0\n");
    return 2;
  }
  bench_pin_cpu(cpu);
  ctx c = {.n_ids = tokens};
  c.want = bench_calloc(tokens, sizeof *c.want);
  c.body = make_body(tokens, &c.len, c.want);
  kvp_hist *h[3] = {bench_hist(), bench_hist(), bench_hist()};
  /* six rounds, the two scans' order swapped every round: drift and the
   * first-runs-slower bias (methodology.md) hit both alike */
  for (int round = 0; round < 6; round++) {
    for (int k = 0; k < 2; k++) {
      c.wide = (k == 0) == (round % 2 == 0);
      bench_loop(&(bench_fn){.run = run_router, .ctx = &c}, 2, reps / 6 + 1,
                 h[c.wide ? 0 : 1]);
    }
    bench_loop(&(bench_fn){.run = run_jansson, .ctx = &c}, 1, reps / 30 + 1,
               h[2]);
  }
  printf("bench_req_parse: a %" PRIu32 "-token token-id prompt, %zu bytes "
         "of JSON\n",
         tokens, c.len);
  bench_table_head(&table, "   (us)");
  bench_row_hist(&table, "routerd, 64-byte id scan", h[0]);
  bench_row_hist(&table, "routerd, byte-by-byte scan", h[1]);
  bench_row_hist(&table, "jansson tree (baseline)", h[2]);
  kvp_hist_summary s[3];
  for (int i = 0; i < 3; i++)
    kvp_hist_summarize(h[i], &s[i]);
  printf("  jansson / 64-byte scan: p50 %.1fx; byte scan / 64-byte scan: "
         "p50 %.2fx; per id %.2f ns\n",
         (double)s[2].p50 / s[0].p50, (double)s[1].p50 / s[0].p50,
         (double)s[0].p50 / tokens);
  printf("  all paths read the same ids: %s\n", c.bad ? "NO" : "yes");
  for (int i = 0; i < 3; i++)
    kvp_hist_destroy(h[i]);
  free(c.body);
  free(c.want);
  return c.bad ? 1 : 0;
}
