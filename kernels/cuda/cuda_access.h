/* SPDX-License-Identifier: Apache-2.0 */
/* Global-memory accessors for the CUDA kernels: explicit ld.global /
 * st.global, so that integer addresses give LDG/STG (not generic LD/ST). */
template <> __device__ __forceinline__ kvp_vec16 kvp_ld<kvp_vec16>(unsigned long long a) {
  kvp_vec16 v;
  asm("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(a));
  return v;
}
template <> __device__ __forceinline__ void kvp_st<kvp_vec16>(unsigned long long a, kvp_vec16 v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};"
               :: "l"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}
template <> __device__ __forceinline__ kvp_vec8 kvp_ld<kvp_vec8>(unsigned long long a) {
  kvp_vec8 v;
  asm("ld.global.u64 %0, [%1];" : "=l"(v) : "l"(a));
  return v;
}
template <> __device__ __forceinline__ void kvp_st<kvp_vec8>(unsigned long long a, kvp_vec8 v) {
  asm volatile("st.global.u64 [%0], %1;" :: "l"(a), "l"(v) : "memory");
}
template <> __device__ __forceinline__ kvp_vec4 kvp_ld<kvp_vec4>(unsigned long long a) {
  kvp_vec4 v;
  asm("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(a));
  return v;
}
template <> __device__ __forceinline__ void kvp_st<kvp_vec4>(unsigned long long a, kvp_vec4 v) {
  asm volatile("st.global.u32 [%0], %1;" :: "l"(a), "r"(v) : "memory");
}
template <> __device__ __forceinline__ kvp_vec2 kvp_ld<kvp_vec2>(unsigned long long a) {
  kvp_vec2 v;
  asm("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(a));
  return v;
}
template <> __device__ __forceinline__ void kvp_st<kvp_vec2>(unsigned long long a, kvp_vec2 v) {
  asm volatile("st.global.u16 [%0], %1;" :: "l"(a), "h"(v) : "memory");
}
template <> __device__ __forceinline__ kvp_vec1 kvp_ld<kvp_vec1>(unsigned long long a) {
  unsigned int v;
  asm("ld.global.u8 %0, [%1];" : "=r"(v) : "l"(a));
  return (kvp_vec1)v;
}
template <> __device__ __forceinline__ void kvp_st<kvp_vec1>(unsigned long long a, kvp_vec1 v) {
  asm volatile("st.global.u8 [%0], %1;" :: "l"(a), "r"((unsigned int)v) : "memory");
}
