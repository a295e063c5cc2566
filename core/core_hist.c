/* SPDX-License-Identifier: Apache-2.0 */
/* Log-linear latency histogram (HdrHistogram's layout with 7 significant
 * bits): values < 256 are exact, above that every power of two is split into
 * 128 equal sub-buckets, so a bucket is at most 1/128 of its values wide and
 * its midpoint is within 0.4% of any value in it. */
#include <string.h>

#include "core_internal.h"

#define SUB_BITS 7u
#define SUB_COUNT (1u << SUB_BITS)        /* 128 */
#define EXACT_LIMIT (2u * SUB_COUNT)      /* 256 */
#define N_BUCKETS (EXACT_LIMIT + (64u - (SUB_BITS + 1u)) * SUB_COUNT) /* 7424 */

struct kvp_hist {
  kvp_allocator alloc;
  uint64_t count, min, max;
  unsigned __int128 sum;
  uint64_t counts[N_BUCKETS];
};

static inline uint32_t bucket_of(uint64_t v) {
  if (v < EXACT_LIMIT)
    return (uint32_t)v;
  uint32_t e = 63u - (uint32_t)__builtin_clzll(v); /* >= 8 */
  uint32_t shift = e - SUB_BITS;
  uint32_t mant = (uint32_t)(v >> shift); /* in [128, 255] */
  return EXACT_LIMIT + (e - (SUB_BITS + 1u)) * SUB_COUNT + (mant - SUB_COUNT);
}

/* Lowest value of bucket i and its width. */
static inline void bucket_range(uint32_t i, uint64_t *lo, uint64_t *width) {
  if (i < EXACT_LIMIT) {
    *lo = i;
    *width = 1;
    return;
  }
  uint32_t e = (SUB_BITS + 1u) + (i - EXACT_LIMIT) / SUB_COUNT;
  uint64_t mant = SUB_COUNT + (i - EXACT_LIMIT) % SUB_COUNT;
  uint32_t shift = e - SUB_BITS;
  *lo = mant << shift;
  *width = (uint64_t)1 << shift;
}

int kvp_hist_create(const kvp_allocator *alloc, kvp_hist **out) {
  if (out == NULL)
    return KVP_EINVAL;
  *out = NULL;
  kvp_allocator a = kvp__allocator(alloc);
  kvp_hist *h = kvp__calloc(&a, 1, sizeof *h);
  if (h == NULL)
    return KVP_ENOMEM;
  h->alloc = a;
  kvp_hist_reset(h);
  *out = h;
  return 0;
}

void kvp_hist_destroy(kvp_hist *h) {
  if (h == NULL)
    return;
  kvp_allocator a = h->alloc;
  kvp__free(&a, h, sizeof *h);
}

void kvp_hist_reset(kvp_hist *h) {
  if (h == NULL)
    return;
  memset(h->counts, 0, sizeof h->counts);
  h->count = 0;
  h->sum = 0;
  h->min = UINT64_MAX;
  h->max = 0;
}

void kvp_hist_record_n(kvp_hist *h, uint64_t v, uint64_t n) {
  if (h == NULL || n == 0)
    return;
  h->counts[bucket_of(v)] += n;
  h->count += n;
  h->sum += (unsigned __int128)v * n;
  if (v < h->min)
    h->min = v;
  if (v > h->max)
    h->max = v;
}

void kvp_hist_record(kvp_hist *h, uint64_t v) { kvp_hist_record_n(h, v, 1); }

int kvp_hist_merge(kvp_hist *dst, const kvp_hist *src) {
  if (dst == NULL || src == NULL)
    return KVP_EINVAL;
  for (uint32_t i = 0; i < N_BUCKETS; i++)
    dst->counts[i] += src->counts[i];
  dst->count += src->count;
  dst->sum += src->sum;
  if (src->count) {
    if (src->min < dst->min)
      dst->min = src->min;
    if (src->max > dst->max)
      dst->max = src->max;
  }
  return 0;
}

uint64_t kvp_hist_count(const kvp_hist *h) { return h ? h->count : 0; }
uint64_t kvp_hist_min(const kvp_hist *h) {
  return h && h->count ? h->min : 0;
}
uint64_t kvp_hist_max(const kvp_hist *h) { return h ? h->max : 0; }

double kvp_hist_mean(const kvp_hist *h) {
  if (h == NULL || h->count == 0)
    return 0.0;
  return (double)h->sum / (double)h->count;
}

uint64_t kvp_hist_quantile(const kvp_hist *h, double q) {
  if (h == NULL || h->count == 0)
    return 0;
  if (!(q > 0.0)) /* also NaN */
    return h->min;
  if (q >= 1.0)
    return h->max;
  double r = q * (double)h->count;
  uint64_t rank = (uint64_t)r;
  if ((double)rank < r)
    rank++;
  if (rank == 0)
    rank = 1;
  uint64_t seen = 0;
  for (uint32_t i = 0; i < N_BUCKETS; i++) {
    seen += h->counts[i];
    if (seen >= rank) {
      uint64_t lo, width;
      bucket_range(i, &lo, &width);
      uint64_t mid = lo + (width - 1) / 2;
      if (mid < h->min)
        mid = h->min;
      if (mid > h->max)
        mid = h->max;
      return mid;
    }
  }
  return h->max;
}

void kvp_hist_summarize(const kvp_hist *h, kvp_hist_summary *out) {
  if (out == NULL)
    return;
  memset(out, 0, sizeof *out);
  if (h == NULL)
    return;
  out->count = h->count;
  out->min = kvp_hist_min(h);
  out->max = kvp_hist_max(h);
  out->mean = kvp_hist_mean(h);
  out->p50 = kvp_hist_quantile(h, 0.50);
  out->p90 = kvp_hist_quantile(h, 0.90);
  out->p99 = kvp_hist_quantile(h, 0.99);
  out->p999 = kvp_hist_quantile(h, 0.999);
}
