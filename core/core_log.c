/* SPDX-License-Identifier: Apache-2.0 */
/* Logging with a level from KVP_LOG and a replaceable sink; the monotonic
 * clock. */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "core_internal.h"

/* -1 = not yet read from the environment. */
static _Atomic int g_level = -1;
static kvp_log_sink g_sink;
static void *g_sink_opaque;

static const char *const level_names[] = {"off",  "error", "warn",
                                          "info", "debug", "trace"};

static int parse_level(const char *v) {
  for (int i = 0; i <= KVP_LOG_TRACE; i++)
    if (strcasecmp(v, level_names[i]) == 0)
      return i;
  if (v[0] >= '0' && v[0] <= '5' && v[1] == '\0')
    return v[0] - '0';
  return -1;
}

kvp_log_level kvp_log_get_level(void) {
  /* relaxed: the level is a standalone value, nothing is published with it */
  int lv = atomic_load_explicit(&g_level, memory_order_relaxed);
  if (KVP_LIKELY(lv >= 0))
    return (kvp_log_level)lv;
  const char *env = getenv("KVP_LOG");
  int parsed = KVP_LOG_WARN;
  int bad = 0;
  if (env != NULL && env[0] != '\0') {
    int p = parse_level(env);
    if (p >= 0)
      parsed = p;
    else
      bad = 1;
  }
  int expected = -1;
  if (atomic_compare_exchange_strong_explicit(&g_level, &expected, parsed,
                                              memory_order_relaxed,
                                              memory_order_relaxed) &&
      bad)
    kvp_log(KVP_LOG_WARN, "core",
            "KVP_LOG=%s is not one of off|error|warn|info|debug|trace|0..5; "
            "using warn",
            env);
  return (kvp_log_level)atomic_load_explicit(&g_level, memory_order_relaxed);
}

void kvp_log_set_level(kvp_log_level level) {
  if ((int)level < KVP_LOG_OFF)
    level = KVP_LOG_OFF;
  if (level > KVP_LOG_TRACE)
    level = KVP_LOG_TRACE;
  atomic_store_explicit(&g_level, (int)level, memory_order_relaxed);
}

void kvp_log_set_sink(kvp_log_sink sink, void *opaque) {
  g_sink = sink;
  g_sink_opaque = opaque;
}

void kvp_log(kvp_log_level level, const char *module, const char *fmt, ...) {
  if (level == KVP_LOG_OFF || (int)level > (int)kvp_log_get_level())
    return;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  if (module == NULL)
    module = "kvplane";
  if (g_sink != NULL) {
    g_sink(g_sink_opaque, level, module, buf);
    return;
  }
  /* one fprintf per message so concurrent lines do not interleave */
  fprintf(stderr, "kvplane[%s] %s: %s\n", level_names[level], module, buf);
}

uint64_t kvp_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
