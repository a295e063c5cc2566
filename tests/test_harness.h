/* SPDX-License-Identifier: Apache-2.0 */
/* The tiny shared test harness (libuv task.h, liburing helpers.h): typed
 * asserts that print both sides, exit 0 pass / 1 fail / 77 skip, seeded
 * randomness that prints its seed.  Header-only; one TEST_MAIN per binary. */
#ifndef KVP_TEST_HARNESS_H
#define KVP_TEST_HARNESS_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kvplane.h"

#define KVT_SKIP 77

static inline void kvt_fail_(const char *file, int line, const char *what) {
  fprintf(stderr, "FAIL %s:%d: %s\n", file, line, what);
  exit(1);
}

#define KVT_IS_UNSIGNED_(x)                                                     \
  _Generic((x), unsigned char: 1, unsigned short: 1, unsigned int: 1,           \
           unsigned long: 1, unsigned long long: 1, default: 0)

#define ASSERT_CMP_(a, op, b)                                                   \
  do {                                                                          \
    if (KVT_IS_UNSIGNED_((a) + (b))) {                                          \
      uintmax_t a_ = (uintmax_t)(a), b_ = (uintmax_t)(b);                       \
      if (!(a_ op b_)) {                                                        \
        fprintf(stderr, "FAIL %s:%d: %s %s %s  (%ju %s %ju)\n", __FILE__,       \
                __LINE__, #a, #op, #b, a_, #op, b_);                            \
        exit(1);                                                                \
      }                                                                         \
    } else {                                                                    \
      intmax_t a_ = (intmax_t)(a), b_ = (intmax_t)(b);                          \
      if (!(a_ op b_)) {                                                        \
        fprintf(stderr, "FAIL %s:%d: %s %s %s  (%jd %s %jd)\n", __FILE__,       \
                __LINE__, #a, #op, #b, a_, #op, b_);                            \
        exit(1);                                                                \
      }                                                                         \
    }                                                                           \
  } while (0)

#define ASSERT_EQ(a, b) ASSERT_CMP_(a, ==, b)
#define ASSERT_NE(a, b) ASSERT_CMP_(a, !=, b)
#define ASSERT_LT(a, b) ASSERT_CMP_(a, <, b)
#define ASSERT_LE(a, b) ASSERT_CMP_(a, <=, b)
#define ASSERT_GT(a, b) ASSERT_CMP_(a, >, b)
#define ASSERT_GE(a, b) ASSERT_CMP_(a, >=, b)

#define ASSERT_TRUE(x)                                                          \
  do {                                                                          \
    if (!(x))                                                                   \
      kvt_fail_(__FILE__, __LINE__, "expected true: " #x);                      \
  } while (0)
#define ASSERT_FALSE(x)                                                         \
  do {                                                                          \
    if (x)                                                                      \
      kvt_fail_(__FILE__, __LINE__, "expected false: " #x);                     \
  } while (0)
#define ASSERT_NULL(x) ASSERT_TRUE((x) == NULL)
#define ASSERT_NOT_NULL(x) ASSERT_TRUE((x) != NULL)

/* kvplane return codes: print the symbolic names. */
#define ASSERT_OK(rc)                                                           \
  do {                                                                          \
    int rc_ = (rc);                                                             \
    if (rc_ < 0) {                                                              \
      fprintf(stderr, "FAIL %s:%d: %s returned %d (%s: %s)\n", __FILE__,        \
              __LINE__, #rc, rc_, kvp_err_name(rc_), kvp_strerror(rc_));        \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)
#define ASSERT_ERR(rc, want)                                                    \
  do {                                                                          \
    int rc_ = (rc), w_ = (want);                                                \
    if (rc_ != w_) {                                                            \
      fprintf(stderr, "FAIL %s:%d: %s returned %d (%s), want %s\n", __FILE__,   \
              __LINE__, #rc, rc_, kvp_err_name(rc_), kvp_err_name(w_));         \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

#define ASSERT_STR_EQ(a, b)                                                     \
  do {                                                                          \
    const char *a_ = (a), *b_ = (b);                                            \
    if (a_ == NULL || b_ == NULL || strcmp(a_, b_) != 0) {                      \
      fprintf(stderr, "FAIL %s:%d: %s == %s  (\"%s\" vs \"%s\")\n", __FILE__,   \
              __LINE__, #a, #b, a_ ? a_ : "(null)", b_ ? b_ : "(null)");        \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

#define ASSERT_DOUBLE_NEAR(a, b, tol)                                           \
  do {                                                                          \
    double a_ = (a), b_ = (b), t_ = (tol);                                      \
    if (!(a_ - b_ <= t_ && b_ - a_ <= t_)) {                                    \
      fprintf(stderr, "FAIL %s:%d: |%s - %s| <= %s  (%.9g vs %.9g)\n",          \
              __FILE__, __LINE__, #a, #b, #tol, a_, b_);                        \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

#define ASSERT_MEM_EQ(a, b, n)                                                  \
  do {                                                                          \
    const unsigned char *a_ = (const unsigned char *)(a);                       \
    const unsigned char *b_ = (const unsigned char *)(b);                       \
    size_t n_ = (n);                                                            \
    for (size_t i_ = 0; i_ < n_; i_++)                                          \
      if (a_[i_] != b_[i_]) {                                                   \
        fprintf(stderr,                                                         \
                "FAIL %s:%d: %s == %s over %zu bytes; byte %zu: %02x vs %02x\n",\
                __FILE__, __LINE__, #a, #b, n_, i_, a_[i_], b_[i_]);            \
        exit(1);                                                                \
      }                                                                         \
  } while (0)

#define ASSERT_KEY_EQ(a, b)                                                     \
  do {                                                                          \
    kvp_key a_ = (a), b_ = (b);                                                 \
    if (!kvp_key_eq(a_, b_)) {                                                  \
      fprintf(stderr,                                                           \
              "FAIL %s:%d: %s == %s  (%016" PRIx64 "%016" PRIx64                \
              " vs %016" PRIx64 "%016" PRIx64 ")\n",                            \
              __FILE__, __LINE__, #a, #b, a_.hi, a_.lo, b_.hi, b_.lo);          \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

/* Skip the whole binary (CTest SKIP_RETURN_CODE 77), saying why. */
#define KVT_SKIP_BECAUSE(...)                                                   \
  do {                                                                          \
    fprintf(stderr, "SKIP: ");                                                  \
    fprintf(stderr, __VA_ARGS__);                                               \
    fprintf(stderr, "\n");                                                      \
    exit(KVT_SKIP);                                                             \
  } while (0)

/* ---- seeded randomness (splitmix64) --------------------------------------- */
static uint64_t kvt_rng_state;
static inline uint64_t kvt_rand(void) {
  uint64_t z = (kvt_rng_state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
/* Uniform in [0, n). */
static inline uint64_t kvt_rand_below(uint64_t n) {
  return n ? kvt_rand() % n : 0;
}
/* KVP_TEST_SEED=<n> reproduces a run; otherwise time-based.  Printed. */
static inline uint64_t kvt_seed_init(void) {
  const char *e = getenv("KVP_TEST_SEED");
  uint64_t seed = e ? strtoull(e, NULL, 0) : (uint64_t)kvp_now_ns();
  kvt_rng_state = seed;
  fprintf(stderr, "seed: KVP_TEST_SEED=%" PRIu64 "\n", seed);
  return seed;
}

/* Path of a file under ../shared (KVP_SHARED_DIR from CTest). */
static inline const char *kvt_shared_path(const char *rel, char *buf,
                                          size_t cap) {
  const char *dir = getenv("KVP_SHARED_DIR");
  snprintf(buf, cap, "%s/%s", dir ? dir : "../shared", rel);
  return buf;
}

/* kvt_pages: how many pages [p, p + bytes) lies in; kvt_resident_pages:
 * how many of those are in memory (mincore), SIZE_MAX when unreadable. */
static inline size_t kvt_pages(const void *p, size_t bytes) {
  size_t pg = (size_t)sysconf(_SC_PAGESIZE);
  uintptr_t lo = (uintptr_t)p / pg * pg;
  return ((uintptr_t)p + bytes - lo + pg - 1) / pg;
}
static inline size_t kvt_resident_pages(const void *p, size_t bytes) {
  size_t pg = (size_t)sysconf(_SC_PAGESIZE), n = kvt_pages(p, bytes), in = 0;
  unsigned char *v = malloc(n);
  if (v == NULL ||
      mincore((void *)((uintptr_t)p / pg * pg), n * pg, v) != 0) {
    free(v);
    return SIZE_MAX;
  }
  for (size_t i = 0; i < n; i++)
    in += v[i] & 1;
  free(v);
  return in;
}

/* ---- test table --------------------------------------------------------- */
typedef void (*kvt_fn)(void);
typedef struct kvt_case {
  const char *name;
  kvt_fn fn;
} kvt_case;

#define TEST(name) static void name(void)
#define TEST_ENTRY(name) {#name, name}

/* Runs every case (or only those named on the command line); a failing
 * assert exits with 1 at once, naming file and line. */
#define TEST_MAIN(...)                                                          \
  int main(int argc, char **argv) {                                             \
    static const kvt_case cases_[] = {__VA_ARGS__};                             \
    kvt_seed_init();                                                            \
    size_t ran_ = 0;                                                            \
    for (size_t i_ = 0; i_ < sizeof cases_ / sizeof cases_[0]; i_++) {         \
      int want_ = argc < 2;                                                     \
      for (int a_ = 1; a_ < argc; a_++)                                         \
        if (strcmp(argv[a_], cases_[i_].name) == 0)                             \
          want_ = 1;                                                            \
      if (!want_)                                                               \
        continue;                                                               \
      cases_[i_].fn();                                                          \
      printf("ok - %s\n", cases_[i_].name);                                     \
      ran_++;                                                                   \
    }                                                                           \
    if (ran_ == 0) {                                                            \
      fprintf(stderr, "no test matched\n");                                     \
      return 1;                                                                 \
    }                                                                           \
    return 0;                                                                   \
  }

#endif /* KVP_TEST_HARNESS_H */
