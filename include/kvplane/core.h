/* SPDX-License-Identifier: Apache-2.0 */
/* kvplane core: logging, the monotonic clock and the latency histogram that
 * every benchmark and the ledger report percentiles from. */
#ifndef KVPLANE_CORE_H
#define KVPLANE_CORE_H

#include "kvplane/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- logging ------------------------------------------------------------ */
typedef enum kvp_log_level {
  KVP_LOG_OFF = 0,
  KVP_LOG_ERROR = 1,
  KVP_LOG_WARN = 2, /* default */
  KVP_LOG_INFO = 3,
  KVP_LOG_DEBUG = 4,
  KVP_LOG_TRACE = 5
} kvp_log_level;

/* Receives every message at or below the current level; `msg` has no trailing
 * newline and is only valid during the call.  May be called from any thread. */
typedef void (*kvp_log_sink)(void *opaque, kvp_log_level level,
                             const char *module, const char *msg);

/* Current level.  Initialised once from the environment variable KVP_LOG
 * ("off", "error", "warn", "info", "debug", "trace" or 0..5); an unparsable
 * value keeps the default (warn) and says so once.  Thread-safe. */
KVP_API kvp_log_level kvp_log_get_level(void);
/* Override the level (wins over KVP_LOG).  Thread-safe. */
KVP_API void kvp_log_set_level(kvp_log_level level);
/* Replace the sink (NULL = stderr, "kvplane[level] module: message").  Not
 * synchronised with concurrent logging: set it once at start-up. */
KVP_API void kvp_log_set_sink(kvp_log_sink sink, void *opaque);
/* printf-style logging; a no-op when `level` is above the current level. */
KVP_API void kvp_log(kvp_log_level level, const char *module, const char *fmt,
                     ...)
#if defined(__GNUC__) || defined(__clang__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* ---- clock -------------------------------------------------------------- */
/* Monotonic nanoseconds (CLOCK_MONOTONIC); only differences are meaningful. */
KVP_API uint64_t kvp_now_ns(void);

/* ---- latency histogram -------------------------------------------------- */
/* Log-linear buckets (128 sub-buckets per power of two), so any reported
 * quantile is within 0.4% of a recorded value's true rank position; values
 * below 128 are exact.  Covers the whole uint64_t range.  ~60 KiB each.
 * Not thread-safe: keep one per thread and kvp_hist_merge() them. */
typedef struct kvp_hist kvp_hist;

KVP_API int kvp_hist_create(const kvp_allocator *alloc, kvp_hist **out);
KVP_API void kvp_hist_destroy(kvp_hist *h); /* NULL is a no-op */
KVP_API void kvp_hist_reset(kvp_hist *h);
KVP_API void kvp_hist_record(kvp_hist *h, uint64_t value);
KVP_API void kvp_hist_record_n(kvp_hist *h, uint64_t value, uint64_t n);
/* dst += src.  Returns 0 or KVP_EINVAL. */
KVP_API int kvp_hist_merge(kvp_hist *dst, const kvp_hist *src);
KVP_API uint64_t kvp_hist_count(const kvp_hist *h);
KVP_API uint64_t kvp_hist_min(const kvp_hist *h); /* 0 when empty */
KVP_API uint64_t kvp_hist_max(const kvp_hist *h); /* 0 when empty */
KVP_API double kvp_hist_mean(const kvp_hist *h);  /* exact; 0 when empty */
/* Value at quantile q in [0,1] (nearest rank: the smallest recorded value v
 * with at least ceil(q*count) values <= v), reported as the midpoint of its
 * bucket clamped to [min,max].  0 when empty. */
KVP_API uint64_t kvp_hist_quantile(const kvp_hist *h, double q);

/* Summary used by benchmarks and reports. */
typedef struct kvp_hist_summary {
  uint64_t count, min, max, p50, p90, p99, p999;
  double mean;
} kvp_hist_summary;
KVP_API void kvp_hist_summarize(const kvp_hist *h, kvp_hist_summary *out);

#ifdef __cplusplus
}
#endif
#endif /* KVPLANE_CORE_H */
