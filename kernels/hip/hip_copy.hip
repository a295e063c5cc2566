// SPDX-License-Identifier: Apache-2.0
// The HIP gather/scatter kernels: clang -x hip --cuda-device-only -nogpuinc
// -nogpulib (no ROCm headers or device libraries needed), one code object per
// gfx target, embedded in libkvplane.  Thread geometry from the AMDGPU
// builtins; the grid size from the HSA dispatch packet (as HIP itself does).
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define KVP_GLOBAL __global__ __attribute__((amdgpu_flat_work_group_size(1, 1024)))
#define KVP_DEVICE_INLINE __device__ __attribute__((always_inline)) inline
#define KVP_SHARED __attribute__((shared))
#define KVP_SYNC_THREADS()                                                      \
  (__builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup"),                       \
   __builtin_amdgcn_s_barrier(),                                                \
   __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup"))
#define KVP_THREAD_X __builtin_amdgcn_workitem_id_x()
#define KVP_BLOCK_X __builtin_amdgcn_workgroup_id_x()
#define KVP_BLOCK_DIM_X kvp_hip_block_dim_x()
#define KVP_GRID_DIM_X kvp_hip_grid_dim_x()
// The release words and the repeat gate are not used by the HIP backend yet
// (done_word = repeat_flag = 0: it keeps its events and checks repeats on the
// host), but the kernel body compiles them for every target.
#define KVP_FENCE_SYSTEM() __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "")

// hsa_kernel_dispatch_packet_t: workgroup_size_x (u16) at byte 4,
// grid_size_x (u32, in work-items) at byte 12.
__device__ static inline unsigned kvp_hip_block_dim_x(void) {
  const unsigned short *p =
      (const unsigned short *)__builtin_amdgcn_dispatch_ptr();
  return p[2];
}
__device__ static inline unsigned kvp_hip_grid_dim_x(void) {
  const unsigned *p = (const unsigned *)__builtin_amdgcn_dispatch_ptr();
  return p[3] / kvp_hip_block_dim_x();
}
#define KVP_ACCESSORS "hip_access.h"
#include "kernels_copy_device.h"
