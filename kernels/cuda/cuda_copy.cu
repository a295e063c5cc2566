// SPDX-License-Identifier: Apache-2.0
// The CUDA gather/scatter kernels (built by nvcc into a fatbin: cubins for
// sm_80 and sm_90 plus compute_90 PTX, embedded in libkvplane).
// (1024, 1): up to 1024 threads, one CTA per SM is enough.  With the bare
// (1024) ptxas capped sm_90's w2/w4 kernels at 32 registers and spilled 4
// bytes once the early release (kernels_copy_device.h) was added; this
// gives 40 registers and no spill (check_cuda_ptxas).
#define KVP_GLOBAL __global__ __launch_bounds__(1024, 1)
#define KVP_DEVICE_INLINE __device__ __forceinline__
#define KVP_SHARED __shared__
#define KVP_SYNC_THREADS() __syncthreads()
#define KVP_THREAD_X threadIdx.x
#define KVP_BLOCK_X blockIdx.x
#define KVP_BLOCK_DIM_X blockDim.x
#define KVP_GRID_DIM_X gridDim.x
#define KVP_FENCE_SYSTEM() __threadfence_system()
#define KVP_ACCESSORS "cuda_access.h"
#include "kernels_copy_device.h"

// The GPU repeat check for scatters with KVP_XFER_IDS_UNIQUE (kernels_args.h):
// one thread per id; atomicExch on the owner entry returns the tag when an
// earlier id of this list already took it.
extern "C" __global__ void kvp_repeat_check(kvp_repeat_args a) {
  const unsigned *ids = (const unsigned *)a.ids;
  unsigned long long *owner = (unsigned long long *)a.owner;
  for (unsigned k = blockIdx.x * blockDim.x + threadIdx.x; k < a.n;
       k += gridDim.x * blockDim.x)
    if (atomicExch(owner + ids[k], a.tag) == a.tag)
      *(volatile unsigned long long *)a.flag = a.tag;
}
