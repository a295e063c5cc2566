/* SPDX-License-Identifier: Apache-2.0 */
/* The ledger's private parts shared by its accounting (core_ledger.c: tables,
 * validation, totals, snapshots) and its export (core_ledger_export.c:
 * Prometheus text, JSON lines, receipts).  Not installed.
 *
 * Invariants and lock: see core_ledger.c. */
#ifndef KVP_CORE_LEDGER_INTERNAL_H
#define KVP_CORE_LEDGER_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvplane/ledger.h"

#define MIN_BITS 6u /* 64 buckets: also the number of dump slices */

/* ---- per-request histograms ----------------------------------------------
 * Fixed Prometheus buckets; counts are per bucket (not cumulative), the last
 * slot is +Inf. */
#define HIST_SLOTS 16
static const double tokens_le[] = {0,    16,    64,    256,    1024,
                                   4096, 16384, 65536, 262144, 1048576};
static const double ratio_le[] = {0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1};
#define N_TOKENS_LE (sizeof tokens_le / sizeof tokens_le[0])
#define N_RATIO_LE (sizeof ratio_le / sizeof ratio_le[0])
_Static_assert(N_TOKENS_LE < HIST_SLOTS && N_RATIO_LE < HIST_SLOTS,
               "histogram slots");

typedef struct hist {
  uint64_t counts[HIST_SLOTS];
  uint64_t count;
  double sum;
} hist;

/* ---- tables: hash chains + LRU list -------------------------------------- */
typedef struct entry {
  struct entry *hnext;       /* hash chain */
  struct entry *prev, *next; /* LRU list, most recently recorded first */
  uint64_t hash;
  kvp_ledger_totals t;
  uint16_t tlen, slen;
  char names[]; /* tenant NUL session NUL */
} entry;

/* Buckets are indexed by the hash's top bits, so bucket ranges are hash
 * ranges at every size and the 64 dump slices stay fixed while it grows. */
typedef struct table {
  entry **buckets;
  unsigned bits, max_bits; /* doubles up to the first 2^bits >= cap */
  size_t count, cap;
  entry *head, *tail;
  uint64_t evictions;
} table;

struct kvp_ledger {
  kvp_allocator alloc;
  pthread_mutex_t mu;
  uint64_t sip[2]; /* hash key; constant after create, read without mu */
  /* everything below is guarded by mu */
  table tenants, sessions;
  kvp_ledger_totals global;
  hist avoided_tokens, reuse_ratio;
  uint64_t rejected[KVP_LEDGER_REJECT_COUNT_];
  uint64_t alloc_failures;
};

/* ---- snapshots: rows copied out under the lock (one allocation: rows, then
 * names), written without it. */
typedef struct row {
  kvp_ledger_totals t;
  const char *tenant, *session;
} row;

typedef struct snap {
  row *rows;
  size_t n, size;
} snap;

/* Rows of slice `slice` (0..63: 1/64 of the hash space) or, for -1, all;
 * call with l->mu held.  0 or KVP_ENOMEM. */
int kvp__ledger_snap_take(const table *tb, const kvp_allocator *a, int slice,
                          snap *s);
void kvp__ledger_snap_free(const kvp_allocator *a, snap *s);
/* qsort order: tenant, then session. */
int kvp__ledger_row_cmp(const void *a, const void *b);
/* Call with l->mu held. */
void kvp__ledger_stats_locked(const kvp_ledger *l, kvp_ledger_stats *s);

/* NULL, or UTF-8 of at most KVP_LEDGER_NAME_MAX bytes. */
bool kvp__ledger_name_ok(const char *s);
/* The first broken rule (kvp_ledger_reject), or -1. */
int kvp__ledger_check_reason(const kvp_ledger_record *r);
void kvp__ledger_totals_add(kvp_ledger_totals *t, const kvp_ledger_record *r);

#endif /* KVP_CORE_LEDGER_INTERNAL_H */
