/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers every microbenchmark shares: fatal errors with the kvplane code
 * explained, and pinning to one CPU (the targets are per core). */
#ifndef KVP_BENCH_UTIL_H
#define KVP_BENCH_UTIL_H

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvplane.h"

/* Set by each benchmark's main(): the name its messages start with. */
static const char *bench_name = "bench";

static inline void die(const char *what, int rc) {
  fprintf(stderr, "%s: %s: %s\n", bench_name, what, kvp_strerror(rc));
  exit(1);
}

/* cpu < 0: leave the scheduler alone. */
static inline void pin_cpu(int cpu) {
  if (cpu < 0)
    return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0)
    fprintf(stderr, "%s: cannot pin to CPU %d (%s); running unpinned\n",
            bench_name, cpu, strerror(errno));
}

#endif /* KVP_BENCH_UTIL_H */
