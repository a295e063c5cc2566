/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane ledger (core/ledger): how much prefill was avoided, for which
 * request, session and tenant, and why the rest missed.  Exported as
 * Prometheus text (globals + per tenant) and JSON lines (receipts, totals).
 *
 * Invariants, checked on every record (a record that breaks one is rejected
 * with KVP_EINVAL, counted by reason, and changes no total):
 *   reused + recomputed  == prompt
 *   sum(reused_by_tier)  == reused
 *   sum(prompt_by_class) == prompt
 *   sum(reused_by_class) == reused, reused_by_class[c] <= prompt_by_class[c]
 *   sum(miss_tokens)     == recomputed (every recomputed token has a cause)
 * so every total below satisfies them too.
 *
 * Identity: tenants and sessions are the caller's strings (what operators see
 * in labels and logs), NUL-terminated UTF-8 of 1..KVP_LEDGER_NAME_MAX bytes;
 * NULL or "" means "none".  A session is the pair (tenant, session), so two
 * tenants may reuse session names.  Memory is bounded: least recently
 * recorded sessions and tenants beyond the caps are dropped (counted); the
 * global totals always include every accepted record. */
#ifndef KVPLANE_LEDGER_H
#define KVPLANE_LEDGER_H

#include "kvplane/common.h"
#include "kvplane/text.h" /* kvp_write_fn */

#ifdef __cplusplus
extern "C" {
#endif

/* Longest tenant, session or request id, in bytes (without the NUL). */
#define KVP_LEDGER_NAME_MAX 256u

/* Why a prompt token was recomputed instead of loaded. */
typedef enum kvp_miss_cause {
  KVP_MISS_NEVER_SEEN = 0,    /* no worker ever held the block */
  KVP_MISS_EVICTED = 1,       /* it was cached, then evicted everywhere */
  KVP_MISS_OTHER_WORKER = 2,  /* cached, but on a worker not chosen */
  KVP_MISS_PARTIAL_BLOCK = 3, /* the tail shorter than one block */
  KVP_MISS_NAMESPACE = 4,     /* cached under another namespace (model,
                                 tokenizer, layout, salt) */
  KVP_MISS_DRIFT = 5,         /* the prompt changed before this token */
  KVP_MISS_NOT_WORTH_LOADING = 6, /* cached, but loading cost more than
                                     recomputing */
  KVP_MISS_UNKNOWN = 7,       /* the caller could not tell */
  KVP_MISS_COUNT_ = 8
} kvp_miss_cause;

/* "never_seen", "evicted", "on_other_worker", "partial_block", "namespace",
 * "prompt_drift", "not_worth_loading", "unknown" (Prometheus `cause` label);
 * "invalid" out of range. */
KVP_API const char *kvp_miss_cause_name(kvp_miss_cause c);

/* Why a record was rejected (kvp_ledger_check, per-reason counters). */
typedef enum kvp_ledger_reject {
  KVP_LEDGER_REJECT_NAME = 0,     /* tenant/session/request id not UTF-8 or
                                     longer than KVP_LEDGER_NAME_MAX */
  KVP_LEDGER_REJECT_TOKENS = 1,   /* reused + recomputed != prompt */
  KVP_LEDGER_REJECT_TIER = 2,     /* per-tier reuse does not sum to reused */
  KVP_LEDGER_REJECT_CLASS = 3,    /* per-class sums inconsistent */
  KVP_LEDGER_REJECT_MISS = 4,     /* miss causes do not sum to recomputed */
  KVP_LEDGER_REJECT_ESTIMATE = 5, /* FLOPs/seconds negative, not finite, or
                                     non-zero with nothing reused */
  KVP_LEDGER_REJECT_BYTES = 6,    /* bytes loaded from a tier nothing was
                                     reused from */
  KVP_LEDGER_REJECT_FIELD = 7,    /* worker out of range, reserved not zero */
  KVP_LEDGER_REJECT_COUNT_ = 8
} kvp_ledger_reject;

/* "name", "tokens", "tier", "class", "miss", "estimate", "bytes", "field"
 * (Prometheus `reason` label); "invalid" out of range. */
KVP_API const char *kvp_ledger_reject_name(kvp_ledger_reject r);

/* One request's outcome, as the router/worker saw it.  Zero-initialise it
 * (reserved fields must stay zero), fill what applies.  The strings are only
 * read during the call that takes the record. */
typedef struct kvp_ledger_record {
  const char *tenant;     /* NULL/"" = no tenant (global totals only) */
  const char *session;    /* NULL/"" = no session */
  const char *request_id; /* receipts only; NULL/"" = none */
  int32_t worker;         /* serving worker, or -1 = unknown */
  uint32_t reserved0;
  uint64_t unix_time_ns;  /* wall clock, receipts only; 0 = unknown */

  uint64_t prompt_tokens;
  uint64_t reused_tokens;     /* = prefill avoided, in tokens */
  uint64_t recomputed_tokens; /* prefilled */
  uint64_t reused_by_tier[KVP_TIER_COUNT_];    /* tier the KV came from */
  uint64_t prompt_by_class[KVP_CLASS_COUNT_];  /* unclassified: VOLATILE */
  uint64_t reused_by_class[KVP_CLASS_COUNT_];
  uint64_t miss_tokens[KVP_MISS_COUNT_];       /* recomputed, by cause */
  uint64_t load_bytes[KVP_TIER_COUNT_]; /* KV bytes to move from each tier
                                           toward the GPU for the reuse */
  double avoided_flops;       /* estimated prefill FLOPs not spent */
  double avoided_gpu_seconds; /* estimated GPU-seconds not spent */
  uint64_t reserved[8];
} kvp_ledger_record;

/* Sums over accepted records (global, one tenant or one session). */
typedef struct kvp_ledger_totals {
  uint64_t requests;
  uint64_t prompt_tokens;
  uint64_t reused_tokens; /* = prefill avoided, in tokens */
  uint64_t recomputed_tokens;
  uint64_t reused_by_tier[KVP_TIER_COUNT_];
  uint64_t prompt_by_class[KVP_CLASS_COUNT_];
  uint64_t reused_by_class[KVP_CLASS_COUNT_];
  uint64_t miss_tokens[KVP_MISS_COUNT_];
  uint64_t load_bytes[KVP_TIER_COUNT_];
  double avoided_flops;
  double avoided_gpu_seconds;
  uint64_t reserved[8];
} kvp_ledger_totals;

/* The ledger's own health. */
typedef struct kvp_ledger_stats {
  uint64_t rejected[KVP_LEDGER_REJECT_COUNT_]; /* by reason */
  uint64_t rejected_total;
  uint64_t alloc_failures;    /* kvp_ledger_add that returned KVP_ENOMEM */
  uint64_t sessions, tenants; /* tracked now */
  uint64_t max_sessions, max_tenants;
  uint64_t session_evictions, tenant_evictions;
  uint64_t reserved[8];
} kvp_ledger_stats;

#if defined(__cplusplus)
#define KVP_LEDGER_ASSERT_(c, m) static_assert(c, m)
#else
#define KVP_LEDGER_ASSERT_(c, m) _Static_assert(c, m)
#endif
/* The record and totals are ABI: grow them only into `reserved`. */
KVP_LEDGER_ASSERT_(sizeof(kvp_ledger_totals) == 288, "kvp_ledger_totals ABI");
KVP_LEDGER_ASSERT_(sizeof(kvp_ledger_stats) == 192, "kvp_ledger_stats ABI");
#if UINTPTR_MAX == UINT64_MAX
KVP_LEDGER_ASSERT_(sizeof(kvp_ledger_record) == 320, "kvp_ledger_record ABI");
#endif

/* Zero value = defaults. */
typedef struct kvp_ledger_opts {
  uint32_t max_sessions; /* 0 = 65536; at most 1<<24 */
  uint32_t max_tenants;  /* 0 = 4096; at most 65536 (each one is ~30
                            Prometheus series) */
  uint32_t reserved[6];
} kvp_ledger_opts;

/* Thread safety: every function taking a kvp_ledger may be called from any
 * thread concurrently (one internal mutex, held only for bookkeeping and
 * copying; never while a caller's writer runs). */
typedef struct kvp_ledger kvp_ledger;

/* opts and alloc may be NULL.  Returns 0, KVP_EINVAL (out NULL, reserved not
 * zero), KVP_ERANGE (a cap too large) or KVP_ENOMEM. */
KVP_API int kvp_ledger_create(const kvp_ledger_opts *opts,
                              const kvp_allocator *alloc, kvp_ledger **out);
KVP_API void kvp_ledger_destroy(kvp_ledger *l); /* NULL is a no-op */

/* Validates a record without recording it.  Returns 0 or KVP_EINVAL, with the
 * first broken rule in *why (may be NULL).  Thread-safe (no state). */
KVP_API int kvp_ledger_check(const kvp_ledger_record *r,
                             kvp_ledger_reject *why);
/* The same, in words: which rule broke, naming the fields and their values
 * ("miss: miss_tokens sums to 90 (never_seen 90 + evicted 0 + ...), not
 * recomputed_tokens 100"; "ok" for a valid record) into buf, snprintf-like
 * (buf may be NULL when cap is 0).  Returns 0 (valid) or KVP_EINVAL (invalid
 * or NULL record, or buf NULL with cap > 0).  Thread-safe (no state).
 * kvp_ledger_add logs the same text at KVP_LOG_DEBUG when it rejects. */
KVP_API int kvp_ledger_explain(const kvp_ledger_record *r, char *buf,
                               size_t cap);

/* Records one request into the global, tenant and session totals.  Returns 0;
 * KVP_EINVAL (NULL, or a broken invariant: counted under its reason, totals
 * unchanged); KVP_ENOMEM (a new tenant/session could not be tracked: counted,
 * totals unchanged, retrying is safe). */
KVP_API int kvp_ledger_add(kvp_ledger *l, const kvp_ledger_record *r);

/* Copies totals.  Return 0, KVP_EINVAL, or KVP_ENOENT (never seen, or
 * evicted). */
KVP_API int kvp_ledger_global_totals(kvp_ledger *l, kvp_ledger_totals *out);
KVP_API int kvp_ledger_tenant_totals(kvp_ledger *l, const char *tenant,
                                     kvp_ledger_totals *out);
KVP_API int kvp_ledger_session_totals(kvp_ledger *l, const char *tenant,
                                      const char *session,
                                      kvp_ledger_totals *out);
KVP_API int kvp_ledger_stats_get(kvp_ledger *l, kvp_ledger_stats *out);

/* Hit rate of a class: reused_by_class[c] / prompt_by_class[c].  NaN when no
 * prompt token of that class was recorded (0/0, as PromQL would say) or c is
 * out of range. */
KVP_API double kvp_ledger_hit_rate(const kvp_ledger_totals *t, kvp_class c);

/* Prometheus text exposition format 0.0.4 (metric table: README.md
 * "Metrics"): global families, then per-tenant families with a `tenant`
 * label, sorted by tenant.  Sessions are not exported here (cardinality): use
 * kvp_ledger_json_write.  Takes a snapshot, then writes it with the lock
 * released.  Returns 0, KVP_EINVAL, KVP_ENOMEM or the writer's error. */
KVP_API int kvp_ledger_prometheus_write(kvp_ledger *l, kvp_write_fn fn,
                                        void *opaque);
/* The same into buf (snprintf-like: at most cap-1 bytes and a NUL when
 * cap > 0; buf may be NULL when cap is 0).  *needed (may be NULL) receives the
 * full length without the NUL.  Returns 0, KVP_ENOSPC (truncated; grow the
 * buffer past *needed with headroom: each call takes a new snapshot, which
 * may be longer), KVP_EINVAL or KVP_ENOMEM. */
KVP_API int kvp_ledger_prometheus(kvp_ledger *l, char *buf, size_t cap,
                                  size_t *needed);

/* One JSON-lines receipt for a record, ending in '\n', into buf
 * (snprintf-like).  Returns the full length without the NUL (output was
 * truncated if it is >= cap), or KVP_EINVAL when kvp_ledger_check rejects
 * the record.  Thread-safe (no state); does not record anything. */
KVP_API int kvp_ledger_receipt_json(const kvp_ledger_record *r, char *buf,
                                    size_t cap);
/* One JSON line for totals, scope "session" (session given), "tenant"
 * (tenant given) or "global"; snprintf-like as above.  Returns the length or
 * KVP_EINVAL (NULL t, names invalid as in records). */
KVP_API int kvp_ledger_totals_json(const kvp_ledger_totals *t,
                                   const char *tenant, const char *session,
                                   char *buf, size_t cap);

/* What kvp_ledger_json_write dumps (bit set). */
#define KVP_LEDGER_JSON_GLOBAL 1u
#define KVP_LEDGER_JSON_TENANTS 2u
#define KVP_LEDGER_JSON_SESSIONS 4u
/* JSON lines as kvp_ledger_totals_json writes them: the global totals, every
 * tracked tenant (sorted), every tracked session (in hash order).  Sessions
 * are copied out in 64 slices, so the lock is never held for the whole table
 * and a session recorded during the dump may or may not appear.  Returns 0,
 * KVP_EINVAL (no known bit in `what`, NULL), KVP_ENOMEM or the writer's
 * error. */
KVP_API int kvp_ledger_json_write(kvp_ledger *l, unsigned what,
                                  kvp_write_fn fn, void *opaque);

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_LEDGER_H */
