// SPDX-License-Identifier: Apache-2.0
// The CUDA gather/scatter kernels (built by nvcc into a fatbin: cubins for
// sm_80 and sm_90 plus compute_90 PTX, embedded in libkvplane).
#define KVP_GLOBAL __global__ __launch_bounds__(1024)
#define KVP_DEVICE_INLINE __device__ __forceinline__
#define KVP_SHARED __shared__
#define KVP_SYNC_THREADS() __syncthreads()
#define KVP_THREAD_X threadIdx.x
#define KVP_BLOCK_X blockIdx.x
#define KVP_BLOCK_DIM_X blockDim.x
#define KVP_GRID_DIM_X gridDim.x
#define KVP_FENCE_DEVICE() __threadfence()
#define KVP_FENCE_SYSTEM() __threadfence_system()
#define KVP_ATOMIC_ADD_U32(p, v) atomicAdd((p), (v))
#define KVP_ACCESSORS "cuda_access.h"
#include "kernels_copy_device.h"
