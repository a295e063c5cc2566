/* SPDX-License-Identifier: Apache-2.0 */
/* The submit path's id passes (kernels/kernels_ids.c): every build (generic
 * vectors, AVX2 where the CPU has it, and the dispatching entry points)
 * against a scalar loop, on random ids with the high bit set or not, every
 * length from 0 to 300 and a few large ones, every destination alignment,
 * the maximum at the head, the middle or the tail, guard words around the
 * destination poisoned and checked untouched; and the scatter repeat check
 * against the list's truth. */
#include "kernels_internal.h"
#include "test_harness.h"

typedef uint32_t (*max_fn)(const uint32_t *, uint32_t);
typedef uint32_t (*copy_fn)(uint32_t *restrict, const uint32_t *restrict, uint32_t);

typedef struct build {
  const char *name;
  max_fn max;
  copy_fn copy;
} build;

enum { CAP = 9000, GUARD = 16, POISON = 0xa5a5a5a5u };

static uint32_t ref_max(const uint32_t *v, uint32_t n) {
  uint32_t r = 0;
  for (uint32_t i = 0; i < n; i++)
    r = v[i] > r ? v[i] : r;
  return r;
}

/* n random ids; shape 0: any 32-bit value, 1: below 2^20 (block ids),
 * 2: all small but one huge at a random place (head/tail remainders). */
static void fill_ids(uint32_t *v, uint32_t n, int shape) {
  for (uint32_t i = 0; i < n; i++)
    v[i] = shape == 0 ? (uint32_t)kvt_rand() : (uint32_t)kvt_rand_below(1u << 20);
  if (shape == 2 && n)
    v[kvt_rand_below(n)] = 0x80000000u + (uint32_t)kvt_rand_below(1u << 30);
}

static void check_build(const build *b) {
  static uint32_t src[CAP];
  static uint32_t dst_buf[CAP + 2 * GUARD + 16] __attribute__((aligned(64)));
  uint32_t lens[320], nl = 0;
  for (uint32_t n = 0; n <= 300; n++)
    lens[nl++] = n;
  lens[nl++] = 8191, lens[nl++] = 8192, lens[nl++] = 8193, lens[nl++] = CAP - 16;
  for (uint32_t k = 0; k < nl; k++)
    for (int shape = 0; shape < 3; shape++) {
      uint32_t n = lens[k], off = (uint32_t)kvt_rand_below(16);
      fill_ids(src, n, shape);
      uint32_t want = ref_max(src, n);
      ASSERT_EQ(b->max(src, n), want);
      for (size_t i = 0; i < sizeof dst_buf / sizeof dst_buf[0]; i++)
        dst_buf[i] = POISON;
      uint32_t *dst = dst_buf + GUARD + off;
      ASSERT_EQ(b->copy(dst, src, n), want);
      if (n)
        ASSERT_MEM_EQ(dst, src, n * sizeof *src);
      for (uint32_t *p = dst_buf; p < dst; p++)
        ASSERT_EQ(*p, POISON);
      for (uint32_t *p = dst + n; p < dst_buf + sizeof dst_buf / sizeof dst_buf[0]; p++)
        ASSERT_EQ(*p, POISON);
    }
}

TEST(generic_build) {
  build b = {"generic", kvp__ids_max_generic, kvp__ids_copy_max_generic};
  check_build(&b);
}

TEST(avx2_build) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (!kvp__ids_have_avx2()) {
    printf("# avx2 build not run: this CPU has no AVX2\n");
    return;
  }
  build b = {"avx2", kvp__ids_max_avx2, kvp__ids_copy_max_avx2};
  check_build(&b);
#else
  printf("# avx2 build not run: not x86-64\n");
#endif
}

TEST(dispatch) {
  build b = {"dispatch", kvp__ids_max, kvp__ids_copy_max};
  check_build(&b);
}

/* The scatter repeat check: unique lists pass, a list with one id repeated
 * (any two positions: the same interleaved walk, different walks, the
 * tail) fails, stamps of earlier generations never count, and every id of
 * the list ends stamped with this generation. */
TEST(stamp_repeat_check) {
  enum { NB = 5000 };
  static uint8_t st[NB];
  static uint32_t perm[NB], ids[NB];
  memset(st, 0, sizeof st);
  uint8_t gen = 0;
  for (int round = 0; round < 3000; round++) {
    gen = (uint8_t)(gen + 1) ? (uint8_t)(gen + 1) : 1;
    if (gen == 1)
      memset(st, 0, sizeof st); /* as the library does when gen wraps */
    for (uint32_t i = 0; i < NB; i++)
      perm[i] = i;
    uint32_t n = round < 40 ? (uint32_t)round : (uint32_t)kvt_rand_below(NB + 1);
    for (uint32_t i = 0; i < n; i++) { /* n distinct ids: partial shuffle */
      uint32_t j = i + (uint32_t)kvt_rand_below(NB - i), t = perm[i];
      perm[i] = perm[j], perm[j] = t;
      ids[i] = perm[i];
    }
    bool repeat = n >= 2 && kvt_rand_below(2);
    if (repeat) {
      uint32_t a = (uint32_t)kvt_rand_below(n), b = (uint32_t)kvt_rand_below(n - 1);
      b += b >= a; /* b != a */
      ids[b] = ids[a];
    }
    ASSERT_EQ(kvp__ids_stamp_unique(st, gen, ids, n), !repeat);
    for (uint32_t i = 0; i < n; i++)
      ASSERT_EQ(st[ids[i]], gen);
  }
}

TEST_MAIN(TEST_ENTRY(generic_build), TEST_ENTRY(avx2_build), TEST_ENTRY(dispatch),
          TEST_ENTRY(stamp_repeat_check))
