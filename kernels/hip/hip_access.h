/* SPDX-License-Identifier: Apache-2.0 */
/* Global-memory accessors for the HIP kernels: address space 1 pointers give
 * global_load/global_store (not flat_*). */
#define KVP_HIP_GLOBAL __attribute__((address_space(1)))
#define KVP_HIP_ACCESS(T)                                                       \
  template <> KVP_DEVICE_INLINE T kvp_ld<T>(unsigned long long a) {             \
    return *(const KVP_HIP_GLOBAL T *)a;                                        \
  }                                                                             \
  template <> KVP_DEVICE_INLINE void kvp_st<T>(unsigned long long a, T v) {     \
    *(KVP_HIP_GLOBAL T *)a = v;                                                 \
  }
typedef unsigned int kvp_u32x4 __attribute__((ext_vector_type(4)));
template <> KVP_DEVICE_INLINE kvp_vec16 kvp_ld<kvp_vec16>(unsigned long long a) {
  kvp_u32x4 t = *(const KVP_HIP_GLOBAL kvp_u32x4 *)a;
  kvp_vec16 v;
  v.x = t.x, v.y = t.y, v.z = t.z, v.w = t.w;
  return v;
}
template <> KVP_DEVICE_INLINE void kvp_st<kvp_vec16>(unsigned long long a, kvp_vec16 v) {
  kvp_u32x4 t = {v.x, v.y, v.z, v.w};
  *(KVP_HIP_GLOBAL kvp_u32x4 *)a = t;
}
KVP_HIP_ACCESS(kvp_vec8)
KVP_HIP_ACCESS(kvp_vec4)
KVP_HIP_ACCESS(kvp_vec2)
KVP_HIP_ACCESS(kvp_vec1)
