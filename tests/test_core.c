/* SPDX-License-Identifier: Apache-2.0 */
/* core: error table, allocator hooks, logging, clock, histogram accuracy. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "core_internal.h"
#include "test_harness.h"

TEST(error_table) {
  ASSERT_STR_EQ(kvp_err_name(KVP_EINVAL), "KVP_EINVAL");
  ASSERT_STR_EQ(kvp_strerror(KVP_EINVAL), "invalid argument");
  ASSERT_STR_EQ(kvp_err_name(KVP_ECORRUPT), "KVP_ECORRUPT");
  ASSERT_STR_EQ(kvp_err_name(-ENOENT), "ENOENT");
  ASSERT_STR_EQ(kvp_strerror(-ENOENT), "No such file or directory");
  ASSERT_STR_EQ(kvp_err_name(0), "OK");
  ASSERT_STR_EQ(kvp_err_name(-99999), "UNKNOWN");
  ASSERT_STR_EQ(kvp_strerror(-99999), "unknown error");
  /* every library code is below -4000 and has distinct name and text */
#define CHECK_ROW_(name, code, msg)                                             \
  ASSERT_LT(code, -4000);                                                       \
  ASSERT_STR_EQ(kvp_err_name(code), "KVP_" #name);                              \
  ASSERT_STR_EQ(kvp_strerror(code), msg);
  KVP_ERRNO_MAP(CHECK_ROW_)
#undef CHECK_ROW_
}

TEST(version) {
  ASSERT_STR_EQ(kvp_version(), KVP_VERSION_STR);
  ASSERT_EQ(kvp_version_number(), KVP_VERSION_NUM);
  ASSERT_EQ(KVP_VERSION_NUM, 100u); /* 0.1.0 */
  ASSERT_TRUE(KVP_VERSION_AT_LEAST(0, 1, 0));
  ASSERT_FALSE(KVP_VERSION_AT_LEAST(0, 2, 0));
}

typedef struct counting_alloc {
  size_t live_bytes, allocs, frees;
} counting_alloc;
static void *ca_alloc(void *o, size_t n) {
  counting_alloc *c = o;
  c->live_bytes += n;
  c->allocs++;
  return malloc(n);
}
static void ca_free(void *o, void *p, size_t n) {
  counting_alloc *c = o;
  c->live_bytes -= n;
  c->frees++;
  free(p);
}

TEST(allocator_hooks) {
  counting_alloc c = {0};
  kvp_allocator a = {ca_alloc, ca_free, &c};
  kvp_hist *h = NULL;
  ASSERT_OK(kvp_hist_create(&a, &h));
  ASSERT_EQ(c.allocs, 1u);
  ASSERT_GT(c.live_bytes, 0u);
  kvp_hist_destroy(h);
  ASSERT_EQ(c.frees, 1u);
  ASSERT_EQ(c.live_bytes, 0u); /* freed with the size it was allocated with */
  kvp_hist_destroy(NULL);      /* NULL is a no-op */
  ASSERT_ERR(kvp_hist_create(NULL, NULL), KVP_EINVAL);
  size_t out;
  ASSERT_FALSE(kvp__mul_ok(SIZE_MAX / 2, 3, &out));
  ASSERT_NULL(kvp__calloc(NULL, SIZE_MAX / 2, 3));
}

/* AnonHugePages (KiB) of the mapping holding p, from /proc/self/smaps;
 * -1 when it cannot be read. */
static long anon_huge_kb(const void *p) {
  FILE *f = fopen("/proc/self/smaps", "r");
  if (f == NULL)
    return -1;
  char line[512];
  long kb = -1;
  bool in = false;
  while (fgets(line, sizeof line, f) != NULL) {
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx ", &lo, &hi) == 2) /* a mapping's first line */
      in = (uintptr_t)p >= lo && (uintptr_t)p < hi;
    else if (in && sscanf(line, "AnonHugePages: %ld kB", &kb) == 1)
      break;
  }
  fclose(f);
  return kb;
}

/* Whether the kernel gives transparent huge pages to memory that asks. */
static bool thp_on_advice(void) {
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  char buf[128] = "";
  if (f == NULL)
    return false;
  bool ok = fgets(buf, sizeof buf, f) != NULL && strstr(buf, "[never]") == NULL;
  fclose(f);
  return ok;
}

/* kvp__huge_calloc: zeroed even where malloc hands back dirty memory, on a
 * 2 MiB boundary from 2 MiB up, calloc's below; overflow refused.  A 2 MiB
 * page all in memory is cleared in place (still in memory after, no fault
 * to come); one partly or not in memory is dropped, and huge where the
 * kernel offers huge pages on advice. */
TEST(huge_calloc) {
  const size_t mib = (size_t)1 << 20;
  ASSERT_EQ(kvp__huge_size(2 * mib - 1), 0u);
  ASSERT_EQ(kvp__huge_size(2 * mib), 4 * mib);
  ASSERT_EQ(kvp__huge_size(2 * mib + 1), 6 * mib);
  ASSERT_EQ(kvp__huge_size(SIZE_MAX - mib), 0u);
  void *raw;
  ASSERT_NULL(kvp__huge_calloc(SIZE_MAX / 2, 3, &raw));
  ASSERT_NULL(raw);
  /* blocks made dirty by hand, all (round 0) or their first half (1), then
   * kvp__huge_calloc over and under 2 MiB */
  const size_t sizes[4] = {9 * mib, 9 * mib, 17 * mib + 4096, mib + 123};
  for (int round = 0; round < 4; round++) {
    size_t bytes = sizes[round];
    unsigned char *p;
    size_t huge = kvp__huge_size(bytes);
    if (round < 2) { /* memory faulted in already (mapped fresh, so none
                        but what is written here is in memory): dirty */
      raw = mmap(NULL, huge, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      ASSERT_TRUE(raw != MAP_FAILED);
      memset(raw, 0xa5, round == 0 ? huge : huge / 2);
      p = kvp__huge_place(raw, bytes);
      size_t whole = (bytes + 2 * mib - 1) / (2 * mib) * (2 * mib);
      size_t pg = (size_t)sysconf(_SC_PAGESIZE);
      size_t dirty = (unsigned char *)raw + huge / 2 - p; /* round 1 */
      size_t full = dirty / (2 * mib) * (2 * mib);   /* all in memory */
      size_t clean = (dirty + 2 * mib - 1) / (2 * mib) * (2 * mib);
      if (round == 0) {
        ASSERT_EQ(kvt_resident_pages(p, whole), whole / pg); /* none dropped */
      } else {
        ASSERT_TRUE(full >= 2 * mib && clean < whole);
        ASSERT_EQ(kvt_resident_pages(p, full), full / pg);
        ASSERT_EQ(kvt_resident_pages(p + clean, whole - clean), 0u);
      }
    } else {
      p = kvp__huge_calloc(bytes, 1, &raw);
    }
    ASSERT_NOT_NULL(p);
    ASSERT_TRUE((unsigned char *)raw <= p);
    if (bytes >= 2 * mib) {
      ASSERT_EQ((uintptr_t)p % (2 * mib), 0u);
      ASSERT_TRUE(p + bytes <= (unsigned char *)raw + kvp__huge_size(bytes));
    }
    size_t nonzero = 0;
    for (size_t i = 0; i < bytes; i++)
      nonzero += p[i] != 0;
    ASSERT_EQ(nonzero, 0u);
    memset(p, 0x5a, bytes); /* all of it is ours */
    if (round == 2 && thp_on_advice()) { /* dropped: faulted in huge */
      long kb = anon_huge_kb(p);
      if (kb >= 0)
        ASSERT_GE(kb, 2048); /* at least one huge page */
    }
    if (round < 2)
      ASSERT_EQ(munmap(raw, huge), 0);
    else
      free(raw);
  }
}

TEST(utf8) {
  ASSERT_TRUE(kvp__utf8_valid("t3nant-\xc3\xa9", 9));
  ASSERT_TRUE(kvp__utf8_valid("\xf0\x9f\x98\x80", 4)); /* emoji */
  ASSERT_FALSE(kvp__utf8_valid("\xc3", 1));            /* truncated */
  ASSERT_FALSE(kvp__utf8_valid("\xc0\xaf", 2));        /* overlong '/' */
  ASSERT_FALSE(kvp__utf8_valid("\xed\xa0\x80", 3));    /* surrogate */
  ASSERT_FALSE(kvp__utf8_valid("\xf4\x90\x80\x80", 4)); /* > U+10FFFF */
  ASSERT_FALSE(kvp__utf8_valid("\xff", 1));
  ASSERT_FALSE(kvp__utf8_valid("a\x80", 2));
}

static int sink_calls;
static char sink_last[256];
static void test_sink(void *o, kvp_log_level lv, const char *mod,
                      const char *msg) {
  (void)o;
  (void)lv;
  sink_calls++;
  snprintf(sink_last, sizeof sink_last, "%s:%s", mod, msg);
}

TEST(logging) {
  kvp_log_set_sink(test_sink, NULL);
  kvp_log_set_level(KVP_LOG_WARN);
  kvp_log(KVP_LOG_INFO, "t", "hidden %d", 1);
  ASSERT_EQ(sink_calls, 0);
  kvp_log(KVP_LOG_WARN, "t", "shown %d", 2);
  ASSERT_EQ(sink_calls, 1);
  ASSERT_STR_EQ(sink_last, "t:shown 2");
  kvp_log_set_level(KVP_LOG_OFF);
  kvp_log(KVP_LOG_ERROR, "t", "off");
  ASSERT_EQ(sink_calls, 1);
  kvp_log_set_level((kvp_log_level)99); /* clamps to trace */
  ASSERT_EQ(kvp_log_get_level(), KVP_LOG_TRACE);
  kvp_log_set_sink(NULL, NULL);
  kvp_log_set_level(KVP_LOG_ERROR);
}

TEST(clock_monotonic) {
  uint64_t a = kvp_now_ns(), b = kvp_now_ns();
  ASSERT_LE(a, b);
  ASSERT_GT(a, 0u);
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return (x > y) - (x < y);
}

/* Exact nearest-rank quantile of sorted values. */
static uint64_t exact_q(const uint64_t *v, size_t n, double q) {
  size_t rank = (size_t)ceil(q * (double)n);
  if (rank == 0)
    rank = 1;
  return v[rank - 1];
}

TEST(hist_accuracy_random) {
  /* Log-uniform values over 1 ns .. 10 s, three shapes; every reported
   * percentile must be within 1% of the exact nearest-rank value. */
  enum { N = 200000 };
  uint64_t *v = malloc(N * sizeof *v);
  ASSERT_NOT_NULL(v);
  kvp_hist *h = NULL;
  ASSERT_OK(kvp_hist_create(NULL, &h));
  for (int shape = 0; shape < 3; shape++) {
    kvp_hist_reset(h);
    for (size_t i = 0; i < N; i++) {
      double u = (double)(kvt_rand() >> 11) / 9007199254740992.0;
      double x = shape == 0   ? exp(u * log(1e10))
                 : shape == 1 ? 1000.0 + 50.0 * u /* narrow band */
                              : (u < 0.999 ? 2e4 * u : 5e9 * u); /* tail */
      v[i] = (uint64_t)x;
      kvp_hist_record(h, v[i]);
    }
    qsort(v, N, sizeof *v, cmp_u64);
    const double qs[] = {0.5, 0.9, 0.99, 0.999, 0.0001, 1.0};
    for (size_t k = 0; k < sizeof qs / sizeof qs[0]; k++) {
      double want = (double)exact_q(v, N, qs[k]);
      double got = (double)kvp_hist_quantile(h, qs[k]);
      double tol = want < 128 ? 0.0 : want * 0.01;
      ASSERT_DOUBLE_NEAR(got, want, tol);
    }
    ASSERT_EQ(kvp_hist_count(h), (uint64_t)N);
    ASSERT_EQ(kvp_hist_min(h), v[0]);
    ASSERT_EQ(kvp_hist_max(h), v[N - 1]);
  }
  free(v);
  kvp_hist_destroy(h);
}

TEST(hist_edges_and_merge) {
  kvp_hist *a = NULL, *b = NULL;
  ASSERT_OK(kvp_hist_create(NULL, &a));
  ASSERT_OK(kvp_hist_create(NULL, &b));
  ASSERT_EQ(kvp_hist_quantile(a, 0.5), 0u); /* empty */
  ASSERT_EQ(kvp_hist_min(a), 0u);
  kvp_hist_record(a, 0);
  kvp_hist_record(a, UINT64_MAX);
  ASSERT_EQ(kvp_hist_quantile(a, 0.5), 0u);
  ASSERT_EQ(kvp_hist_quantile(a, 1.0), UINT64_MAX);
  ASSERT_EQ(kvp_hist_quantile(a, NAN), 0u);
  /* small values are exact */
  kvp_hist_reset(a);
  for (uint64_t i = 1; i <= 100; i++)
    kvp_hist_record(a, i);
  ASSERT_EQ(kvp_hist_quantile(a, 0.5), 50u);
  ASSERT_EQ(kvp_hist_quantile(a, 0.99), 99u);
  ASSERT_DOUBLE_NEAR(kvp_hist_mean(a), 50.5, 1e-9);
  kvp_hist_record_n(b, 1000000, 100);
  ASSERT_OK(kvp_hist_merge(a, b));
  ASSERT_EQ(kvp_hist_count(a), 200u);
  ASSERT_EQ(kvp_hist_max(a), 1000000u);
  ASSERT_DOUBLE_NEAR((double)kvp_hist_quantile(a, 0.75), 1e6, 1e4);
  kvp_hist_summary s;
  kvp_hist_summarize(a, &s);
  ASSERT_EQ(s.count, 200u);
  ASSERT_EQ(s.p50, 100u);
  ASSERT_ERR(kvp_hist_merge(a, NULL), KVP_EINVAL);
  kvp_hist_destroy(a);
  kvp_hist_destroy(b);
}

TEST_MAIN(TEST_ENTRY(error_table), TEST_ENTRY(version),
          TEST_ENTRY(allocator_hooks), TEST_ENTRY(huge_calloc),
          TEST_ENTRY(utf8), TEST_ENTRY(logging),
          TEST_ENTRY(clock_monotonic), TEST_ENTRY(hist_accuracy_random),
          TEST_ENTRY(hist_edges_and_merge))
