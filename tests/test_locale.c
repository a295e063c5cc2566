/* SPDX-License-Identifier: Apache-2.0 */
/* Text output under a comma-decimal locale: a host program that calls
 * setlocale(LC_ALL, "") under de_DE (or sets one per thread with uselocale)
 * still gets valid JSON receipts, JSON lines and Prometheus text with '.'.
 * Skips (77) only when the machine has no comma-decimal locale at all. */
#include <inttypes.h>
#include <langinfo.h>
#include <locale.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "kvplane.h"
#include "test_harness.h"

static char g_name[256]; /* the comma-decimal locale found */

static bool is_comma_locale(const char *name) {
  locale_t l = newlocale(LC_ALL_MASK, name, (locale_t)0);
  if (l == (locale_t)0)
    return false;
  bool comma = strcmp(nl_langinfo_l(RADIXCHAR, l), ",") == 0;
  freelocale(l);
  return comma;
}

/* The usual names first, then whatever `locale -a` lists. */
static bool find_comma_locale(void) {
  static const char *const usual[] = {"de_DE.UTF-8", "de_DE.utf8",
                                      "fr_FR.UTF-8", "fr_FR.utf8",
                                      "de_DE",       "fr_FR"};
  for (size_t i = 0; i < sizeof usual / sizeof usual[0]; i++)
    if (is_comma_locale(usual[i])) {
      snprintf(g_name, sizeof g_name, "%s", usual[i]);
      return true;
    }
  FILE *p = popen("locale -a 2>/dev/null", "r");
  bool found = false;
  while (p != NULL && !found && fgets(g_name, sizeof g_name, p) != NULL) {
    g_name[strcspn(g_name, "\n")] = '\0';
    found = is_comma_locale(g_name);
  }
  if (p != NULL)
    pclose(p);
  return found;
}

/* A routed decision with reuse from two tiers, so every number is
 * fractional. */
static void route_one(kvp_decision *d) {
  kvp_router_opts o = {0};
  o.n_workers = 2;
  o.block_size = 16;
  kvp_router *r = NULL;
  ASSERT_OK(kvp_router_create(&o, NULL, &r));
  kvp_key keys[64];
  for (size_t i = 0; i < 64; i++)
    keys[i] = (kvp_key){i + 1, i * 7 + 3};
  kvp_route_request q = {0};
  q.keys = keys, q.n_blocks = 64, q.prompt_tokens = 64 * 16 + 5;
  q.tenant = kvp_id64("acme"), q.session_id = kvp_id64("s1");
  kvp_worker_match m = {0};
  m.worker = 1, m.blocks[KVP_TIER_HBM] = 20, m.blocks[KVP_TIER_DRAM] = 30;
  ASSERT_OK(kvp_router_route_matches(r, &q, &m, 1, d));
  ASSERT_EQ(d->worker, 1u);
  kvp_router_destroy(r);
}

static double real_at(json_t *o, const char *a, const char *b) {
  json_t *v = json_object_get(a ? json_object_get(o, a) : o, b);
  ASSERT_TRUE(json_is_number(v));
  return json_number_value(v);
}

static void check_receipt(const kvp_decision *d) {
  char buf[8192];
  kvp_route_names nm = {"acme", "s1", NULL, 0, {0}};
  int n = kvp_router_receipt_json(d, &nm, buf, sizeof buf);
  ASSERT_GT(n, 0);
  ASSERT_LT(n, (int)sizeof buf);
  json_error_t err;
  json_t *j = json_loads(buf, 0, &err);
  if (j == NULL)
    fprintf(stderr, "invalid JSON under %s (%s): %s\n", g_name, err.text, buf);
  ASSERT_NOT_NULL(j);
  ASSERT_TRUE(real_at(j, "route", "load_s") == d->load_s);
  ASSERT_TRUE(real_at(j, "prefill_avoided", "flops") == d->avoided_flops);
  ASSERT_TRUE(real_at(j, "prefill_avoided", "gpu_seconds") == d->avoided_s);
  ASSERT_TRUE(real_at(j, NULL, "reuse_ratio") ==
              (double)d->avoided_tokens / (double)d->prompt_tokens);
  json_decref(j);
}

static void check_ledger(const kvp_decision *d) {
  kvp_ledger *l = NULL;
  ASSERT_OK(kvp_ledger_create(NULL, NULL, &l));
  kvp_route_names nm = {"acme", "s1", NULL, 0, {0}};
  ASSERT_OK(kvp_ledger_add_decision(l, d, &nm));
  static char text[1 << 16];
  ASSERT_OK(kvp_ledger_prometheus(l, text, sizeof text, NULL));
  const char *p = strstr(text, "\nkvplane_request_reuse_ratio_sum ");
  ASSERT_NOT_NULL(p);
  p += strlen("\nkvplane_request_reuse_ratio_sum ");
  ASSERT_EQ(p[strcspn(p, ".,\n")], '.'); /* a fraction, with its '.' */
  locale_t c = newlocale(LC_ALL_MASK, "C", (locale_t)0);
  ASSERT_TRUE(strtod_l(p, NULL, c) ==
              (double)d->avoided_tokens / (double)d->prompt_tokens);
  freelocale(c);
  kvp_ledger_destroy(l);
}

/* setlocale(LC_ALL, <comma locale>), as a host program's setlocale(LC_ALL,
 * "") does under LANG=de_DE.UTF-8. */
TEST(global_comma_locale) {
  kvp_decision in_c, in_de;
  route_one(&in_c); /* the C locale's reason text, for comparison */
  ASSERT_NOT_NULL(setlocale(LC_ALL, g_name));
  char probe[16];
  snprintf(probe, sizeof probe, "%.2f", 0.5);
  ASSERT_STR_EQ(probe, "0,50"); /* the locale took effect */
  route_one(&in_de);
  ASSERT_STR_EQ(in_de.reason_text, in_c.reason_text);
  ASSERT_NOT_NULL(strstr(in_de.reason_text, "TTFT "));
  check_receipt(&in_de);
  check_ledger(&in_de);
  char b[64];
  kvp_text t;
  kvp_text_init(&t, b, sizeof b);
  kvp_text_printf(&t, "%.3g|", 1.5);
  kvp_text_json_num(&t, 0.25);
  ASSERT_STR_EQ(b, "1.5|0.25");
  setlocale(LC_ALL, "C");
}

/* uselocale in one thread: the writer switches and restores it. */
TEST(thread_comma_locale) {
  locale_t de = newlocale(LC_ALL_MASK, g_name, (locale_t)0);
  ASSERT_TRUE(de != (locale_t)0);
  locale_t old = uselocale(de);
  char b[64];
  kvp_text t;
  kvp_text_init(&t, b, sizeof b);
  kvp_text_json_num(&t, 2.5);
  kvp_text_printf(&t, "|%.2f", 0.75);
  ASSERT_STR_EQ(b, "2.5|0.75");
  ASSERT_TRUE(uselocale((locale_t)0) == de); /* the thread's locale stays */
  kvp_decision d;
  route_one(&d);
  check_receipt(&d);
  uselocale(old);
  freelocale(de);
}

int main(int argc, char **argv) {
  if (!find_comma_locale())
    KVT_SKIP_BECAUSE("no comma-decimal locale on this machine (locale -a); "
                     "generate one, e.g. localedef -i de_DE -f UTF-8 "
                     "de_DE.UTF-8");
  printf("# comma-decimal locale: %s\n", g_name);
  kvt_seed_init();
  (void)argc, (void)argv;
  global_comma_locale();
  printf("ok - global_comma_locale\n");
  thread_comma_locale();
  printf("ok - thread_comma_locale\n");
  return 0;
}
