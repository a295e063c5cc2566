/* SPDX-License-Identifier: Apache-2.0 */
/* The submit path's passes over a transfer's ids: max (range check), copy +
 * max into the launch-argument slot, and the scatter repeat check.  The
 * first two have two builds each: generic
 * vector code (GCC / clang vector extensions, any target; SSE2 on x86-64)
 * and, on x86-64, AVX2 (8 lanes, a native unsigned max, 32-byte streaming
 * stores), picked per call from the CPU's features.  The results are the
 * same whichever runs (test_kernels_ids checks every build against a scalar
 * loop, and the repeat check against the list's truth). */
#include <string.h>

#include "kernels_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVP_IDS_X86 1
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Explicit vector registers: a scalar or array-of-lanes loop carries its max
 * through memory or one register and ran 3x slower on the GPU machine's host
 * (bench_kernels' host-cost line). */
typedef uint32_t kvp_u32x4 __attribute__((vector_size(16)));

static kvp_u32x4 vmax(kvp_u32x4 a, kvp_u32x4 b) {
  kvp_u32x4 gt = a > b; /* all-ones lanes where a > b */
  return (a & gt) | (b & ~gt);
}

static uint32_t vmax_fold(kvp_u32x4 a, kvp_u32x4 b, uint32_t r) {
  a = vmax(a, b);
  for (int k = 0; k < 4; k++)
    r = a[k] > r ? a[k] : r;
  return r;
}

uint32_t kvp__ids_max_generic(const uint32_t *v, uint32_t n) {
  kvp_u32x4 m0 = {0, 0, 0, 0}, m1 = m0, a, b;
  uint32_t i = 0, r = 0;
  for (; i + 8 <= n; i += 8) {
    memcpy(&a, v + i, 16), memcpy(&b, v + i + 4, 16);
    m0 = vmax(m0, a), m1 = vmax(m1, b);
  }
  for (; i < n; i++)
    r = v[i] > r ? v[i] : r;
  return vmax_fold(m0, m1, r);
}

/* A 16-byte store into the launch-argument slot.  On x86 a non-temporal
 * (streaming) store: the slot is read by the GPU, not by this CPU, and after
 * a large transfer it is no longer in the CPU's caches, so ordinary stores
 * would first read every line back (bench_kernels: the cold copy of 8192 ids
 * dropped from ~4 to ~1.5 us on the development VM).  dst 16-byte aligned. */
#if defined(__SSE2__)
static inline void arg_store16(uint32_t *dst, kvp_u32x4 v) {
  _mm_stream_si128((__m128i *)(void *)dst, (__m128i)v);
}
static inline void arg_fence(void) { _mm_sfence(); }
#else
static inline void arg_store16(uint32_t *dst, kvp_u32x4 v) { memcpy(dst, &v, 16); }
static inline void arg_fence(void) {}
#endif

uint32_t kvp__ids_copy_max_generic(uint32_t *restrict dst,
                                   const uint32_t *restrict src, uint32_t n) {
  kvp_u32x4 m0 = {0, 0, 0, 0}, m1 = m0, a, b;
  uint32_t i = 0, r = 0;
  for (; i < n && ((uintptr_t)(dst + i) & 15); i++) { /* to 16-byte alignment */
    dst[i] = src[i];
    r = src[i] > r ? src[i] : r;
  }
  for (; i + 8 <= n; i += 8) {
    memcpy(&a, src + i, 16), memcpy(&b, src + i + 4, 16);
    arg_store16(dst + i, a), arg_store16(dst + i + 4, b);
    m0 = vmax(m0, a), m1 = vmax(m1, b);
  }
  for (; i < n; i++) {
    dst[i] = src[i];
    r = src[i] > r ? src[i] : r;
  }
  arg_fence();
  return vmax_fold(m0, m1, r);
}

#ifdef KVP_IDS_X86
#define KVP_AVX2 __attribute__((target("avx2")))

KVP_AVX2 static uint32_t fold8(__m256i m, uint32_t r) {
  __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4e));
  h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xb1));
  uint32_t v = (uint32_t)_mm_cvtsi128_si32(h);
  return v > r ? v : r;
}

KVP_AVX2 uint32_t kvp__ids_max_avx2(const uint32_t *v, uint32_t n) {
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  uint32_t i = 0, r = 0;
  for (; i + 16 <= n; i += 16) {
    m0 = _mm256_max_epu32(m0, _mm256_loadu_si256((const __m256i *)(const void *)(v + i)));
    m1 = _mm256_max_epu32(m1, _mm256_loadu_si256((const __m256i *)(const void *)(v + i + 8)));
  }
  for (; i < n; i++)
    r = v[i] > r ? v[i] : r;
  return fold8(_mm256_max_epu32(m0, m1), r);
}

KVP_AVX2 uint32_t kvp__ids_copy_max_avx2(uint32_t *restrict dst,
                                         const uint32_t *restrict src, uint32_t n) {
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  uint32_t i = 0, r = 0;
  for (; i < n && ((uintptr_t)(dst + i) & 31); i++) { /* to 32-byte alignment */
    dst[i] = src[i];
    r = src[i] > r ? src[i] : r;
  }
  for (; i + 16 <= n; i += 16) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)(src + i));
    __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(src + i + 8));
    _mm256_stream_si256((__m256i *)(void *)(dst + i), a);
    _mm256_stream_si256((__m256i *)(void *)(dst + i + 8), b);
    m0 = _mm256_max_epu32(m0, a), m1 = _mm256_max_epu32(m1, b);
  }
  for (; i < n; i++) {
    dst[i] = src[i];
    r = src[i] > r ? src[i] : r;
  }
  _mm_sfence();
  return fold8(_mm256_max_epu32(m0, m1), r);
}

bool kvp__ids_have_avx2(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}
#else
bool kvp__ids_have_avx2(void) { return false; }
#endif

/* Scatter repeat check over per-layout byte stamps (stamp[id] == gen: seen
 * in this call).  Eight interleaved walks over the list (n/8 apart): each
 * id is still checked, then stamped, in one program order, so a repeat
 * anywhere in the list is found; the independent walks keep more stamp
 * loads in flight.  In a standalone side-by-side program the GPU machine's
 * host ran this 1.4-1.7x faster than one walk (8192 ids over 16384 blocks:
 * 7-8 us against 11-13 us; the development VM 2.4 against 3.2 us), but
 * inside a submit the stage still measured 12-14 us there (bench_kernels'
 * trace build), no better than one walk did.  ids must be < the stamp
 * array's length.  True when no id repeats. */
bool kvp__ids_stamp_unique(uint8_t *restrict st, uint8_t gen,
                           const uint32_t *restrict ids, uint32_t n) {
  const uint32_t q = n / 8;
  unsigned rep = 0;
  for (uint32_t i = 0; i < q; i++)
    for (uint32_t k = 0; k < 8; k++) { /* unrolled by the compiler */
      uint32_t a = ids[i + k * q];
      rep |= st[a] == gen;
      st[a] = gen;
    }
  for (uint32_t i = 8 * q; i < n; i++) {
    rep |= st[ids[i]] == gen;
    st[ids[i]] = gen;
  }
  return !rep;
}

/* Resolved once; a race only computes the same answer twice. */
static int have_avx2 = -1;

static bool use_avx2(void) {
  int h = __atomic_load_n(&have_avx2, __ATOMIC_RELAXED);
  if (h < 0) {
    h = kvp__ids_have_avx2();
    __atomic_store_n(&have_avx2, h, __ATOMIC_RELAXED);
  }
  return h;
}

uint32_t kvp__ids_max(const uint32_t *v, uint32_t n) {
#ifdef KVP_IDS_X86
  if (use_avx2())
    return kvp__ids_max_avx2(v, n);
#endif
  return kvp__ids_max_generic(v, n);
}

uint32_t kvp__ids_copy_max(uint32_t *restrict dst, const uint32_t *restrict src,
                           uint32_t n) {
#ifdef KVP_IDS_X86
  if (use_avx2())
    return kvp__ids_copy_max_avx2(dst, src, n);
#endif
  return kvp__ids_copy_max_generic(dst, src, n);
}
