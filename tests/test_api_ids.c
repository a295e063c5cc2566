/* SPDX-License-Identifier: Apache-2.0 */
/* The emulated workers' fast path for token-id prompts (bench/harness/
 * harness_api_ids.c) against the parser it shortcuts (harness_api.c): for
 * fixed cases, seeded random completions bodies and their byte mutations,
 * bh_api_parse_fast returns what bh_api_parse returns -- the request, or
 * the error's status, type, param and message. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness_api.h"
#include "harness_api_ids.h"

static const bh_api_cfg cfg = {"m", 1000, 4096, {"m-lora"}, 1};
static unsigned long n_fast_ok, n_checked;

static int same(const char *body, size_t len, bh_api_kind k) {
  bh_api_req a, b;
  bh_api_err ea, eb;
  int ra = bh_api_parse(&cfg, k, body, len, &a, &ea);
  int rb = bh_api_parse_fast(&cfg, k, body, len, &b, &eb);
  int bad = ra != rb;
  if (!bad && ra < 0)
    bad = ea.status != eb.status || strcmp(ea.type, eb.type) ||
          strcmp(ea.param, eb.param) || strcmp(ea.message, eb.message);
  else if (!bad)
    bad = a.n_tokens != b.n_tokens ||
          memcmp(a.tokens, b.tokens, a.n_tokens * sizeof *a.tokens) ||
          a.max_tokens != b.max_tokens || a.stream != b.stream ||
          a.include_usage != b.include_usage ||
          a.max_tokens_set != b.max_tokens_set ||
          strcmp(a.request_id, b.request_id) || a.lora_name != b.lora_name ||
          (a.cache_salt == NULL) != (b.cache_salt == NULL) ||
          (a.cache_salt && strcmp(a.cache_salt, b.cache_salt));
  n_fast_ok += ra == 0;
  n_checked++;
  bh_api_req_free(&a);
  bh_api_req_free(&b);
  if (bad)
    fprintf(stderr, "FAIL: fast %d / slow %d (%s | %s) on: %.*s\n", rb, ra,
            rb < 0 ? eb.message : "-", ra < 0 ? ea.message : "-",
            (int)(len > 300 ? 300 : len), body);
  return bad;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(uint32_t n) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (uint32_t)(rng % n);
}

static const char *const wsp[] = {"", "", " ", "\n", "\t ", "\r\n"};
#define WS wsp[rnd(6)]

/* A completions body: a few of the fields in random order, the prompt an
 * id array (sometimes with an out-of-vocab id, a sign, a leading zero, a
 * fraction) or something else. */
static size_t gen(char *b, size_t cap) {
  char parts[8][4096];
  int np = 0;
  size_t n_ids = rnd(8) == 0 ? 0 : 1 + rnd(rnd(4) == 0 ? 5000 : 40);
  char *p = parts[np++];
  size_t k = (size_t)snprintf(p, 4096, "\"prompt\"%s:%s[%s", WS, WS, WS);
  uint32_t odd = rnd(6);
  for (size_t i = 0; i < n_ids && k < 4000; i++) {
    uint32_t v = rnd(1000);
    const char *pre = "";
    if (odd == 1 && rnd(50) == 0)
      v = 1000 + rnd(3000000000u);
    if (odd == 2 && rnd(50) == 0)
      pre = rnd(2) ? "-" : "0";
    k += (size_t)snprintf(p + k, 4096 - k, "%s%s%u%s%s%s", i ? "," : "", pre,
                          v, odd == 3 && rnd(60) == 0 ? ".0" : "",
                          odd == 4 && rnd(60) == 0 ? "e0" : "", WS);
  }
  snprintf(p + k, 4096 - k, "]");
  if (rnd(10) == 0)
    snprintf(p, 4096, "\"prompt\": %s",
             rnd(2) ? "\"some text\"" : "[[1, 2, 3]]");
  if (rnd(2))
    snprintf(parts[np++], 4096, "\"max_tokens\":%s%d", WS,
             rnd(8) == 0 ? 4000 : (int)rnd(64));
  if (rnd(2))
    snprintf(parts[np++], 4096, "\"stream\": %s, \"stream_options\": "
             "{\"include_usage\": true}", rnd(2) ? "true" : "false");
  if (rnd(3) == 0)
    snprintf(parts[np++], 4096, "\"model\": \"%s\"",
             rnd(3) == 0 ? "m-lora" : rnd(2) ? "m" : "other");
  if (rnd(4) == 0)
    snprintf(parts[np++], 4096, "\"cache_salt\": \"%s\"",
             rnd(4) ? "tenant-a" : "bad/salt");
  if (rnd(5) == 0) /* a nested "prompt" that is not the prompt */
    snprintf(parts[np++], 4096, "\"x\": {\"prompt\": [1, \"]\\\"\", {}]}");
  if (rnd(8) == 0)
    snprintf(parts[np++], 4096, "\"pr\\u006fmpt\": [7]");
  if (rnd(10) == 0)
    snprintf(parts[np++], 4096, "\"prompt\": [9, 9]");
  if (rnd(6) == 0)
    snprintf(parts[np++], 4096, "\"request_id\": \"r-%u\"", rnd(100));
  for (int i = np - 1; i > 0; i--) { /* shuffle */
    int j = (int)rnd((uint32_t)i + 1);
    char t[4096];
    memcpy(t, parts[i], sizeof t);
    memcpy(parts[i], parts[j], sizeof t);
    memcpy(parts[j], t, sizeof t);
  }
  size_t n = (size_t)snprintf(b, cap, "%s{%s", WS, WS);
  for (int i = 0; i < np; i++)
    n += (size_t)snprintf(b + n, cap - n, "%s%s%s", i ? "," : "", parts[i],
                          WS);
  n += (size_t)snprintf(b + n, cap - n, "}%s", rnd(20) ? "" : " x");
  return n;
}

int main(void) {
  static const char *const fixed[] = {
      "{\"prompt\": [1, 2, 3]}",
      "{\"prompt\":[0]}",
      "{\"prompt\": []}",
      "{\"prompt\": [999]}",
      "{\"prompt\": [1000]}",
      "{\"prompt\": [01]}",
      "{\"prompt\": [-1]}",
      "{\"prompt\": [1.5]}",
      "{\"prompt\": [1e2]}",
      "{\"prompt\": [1,]}",
      "{\"prompt\": [,1]}",
      "{\"prompt\": [1 2]}",
      "{\"prompt\": [1], \"prompt\": [2]}",
      "{\"prompt\": [1], \"pr\\u006fmpt\": [2]}",
      "{\"pr\\u006fmpt\": [2]}",
      "{\"a\": \"\\\"prompt\\\": [5]\", \"prompt\": [6]}",
      "{\"prompt\": [1, 2], \"max_tokens\": 4095}",
      "{\"prompt\": [1, 2], \"max_tokens\": 4094}",
      "{\"prompt\": [1, 2], \"max_tokens\": 4094} trailing",
      "[\"prompt\", [1]]",
      "{\"prompt\": [1, 2], \"model\": \"nope\"}",
      "{\"prompt\": [1, 2], \"n\": 2}",
      "{\"prompt\": [99999999999999999999999]}",
      "{\"prompt\": [1, 2]",
      "{\"prompt\": [1, 2], }",
      "{\"max_tokens\": 3, \"prompt\": [4, 5, 6], \"stream\": true}",
      "{\"prompt\": [1], \"cache_salt\": \"x\", \"model\": \"m-lora\"}",
  };
  int bad = 0;
  for (size_t i = 0; i < sizeof fixed / sizeof *fixed; i++)
    for (int k = 0; k < BH_API_KIND_COUNT_; k++)
      bad |= same(fixed[i], strlen(fixed[i]), (bh_api_kind)k);
  /* a prompt of exactly max_model_len ids, and one more */
  static char big[64 << 10];
  for (uint32_t n = 4094; n <= 4097; n++) {
    size_t k = (size_t)snprintf(big, sizeof big, "{\"max_tokens\": 1, "
                                "\"prompt\": [");
    for (uint32_t i = 0; i < n; i++)
      k += (size_t)snprintf(big + k, sizeof big - k, "%s%u", i ? "," : "",
                            i % 1000);
    k += (size_t)snprintf(big + k, sizeof big - k, "]}");
    bad |= same(big, k, BH_API_COMPLETIONS);
  }
  static char b[1 << 16];
  for (int i = 0; i < 4000 && !bad; i++) {
    size_t n = gen(b, sizeof b);
    bad |= same(b, n, BH_API_COMPLETIONS);
    for (int m = 0; m < 4 && !bad; m++) { /* byte mutations of it */
      static char c[1 << 16];
      memcpy(c, b, n);
      size_t cn = n;
      static const char pick[] = "[]{},:\" 0123456789-.e\\x";
      for (int j = 0, nm = 1 + (int)rnd(3); j < nm; j++) {
        size_t at = rnd((uint32_t)cn);
        if (rnd(4) == 0 && cn > 1)
          cn = at + 1; /* truncated */
        else
          c[at] = pick[rnd(sizeof pick - 1)];
      }
      bad |= same(c, cn, BH_API_COMPLETIONS);
    }
  }
  printf("test_api_ids: %lu bodies, %lu parsed, %s\n", n_checked, n_fast_ok,
         bad ? "FAIL" : "ok");
  return bad;
}
