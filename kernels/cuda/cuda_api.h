/* SPDX-License-Identifier: Apache-2.0 */
/* The slice of the CUDA driver API kvplane uses, declared here so the build
 * needs no CUDA headers and the library no libcuda at link time: the driver
 * is dlopen()ed and every entry point resolved by its versioned symbol name
 * (the ABI this file describes; cuda.h's #defines map the plain names to the
 * same symbols). */
#ifndef KVP_CUDA_API_H
#define KVP_CUDA_API_H

#include <stddef.h>
#include <stdint.h>

struct kvp_device;

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT 16
#define CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY 19
#define CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING 41
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR 75
#define CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR 76
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_POINTER_ATTRIBUTE_RANGE_START_ADDR 11
#define CU_POINTER_ATTRIBUTE_RANGE_SIZE 12
#define CU_MEMORYTYPE_HOST 1
#define CU_MEMORYTYPE_DEVICE 2
#define CU_MEMORYTYPE_UNIFIED 4
#define CU_MEMHOSTREGISTER_PORTABLE 0x01
#define CU_MEMHOSTREGISTER_DEVICEMAP 0x02
#define CU_MEMHOSTALLOC_PORTABLE 0x01
#define CU_MEMHOSTALLOC_DEVICEMAP 0x02
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DEFAULT 0x0
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES 3
#define CU_FUNC_ATTRIBUTE_NUM_REGS 4
#define CU_GET_PROC_ADDRESS_DEFAULT 0

typedef struct CUDA_MEMCPY2D {
  size_t srcXInBytes, srcY;
  int srcMemoryType;
  const void *srcHost;
  CUdeviceptr srcDevice;
  void *srcArray;
  size_t srcPitch;
  size_t dstXInBytes, dstY;
  int dstMemoryType;
  void *dstHost;
  CUdeviceptr dstDevice;
  void *dstArray;
  size_t dstPitch;
  size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;

/* cuMemcpyBatchAsync (CUDA 12.8+) */
typedef struct CUmemLocation {
  int type;
  int id;
} CUmemLocation;
typedef struct CUmemcpyAttributes {
  int srcAccessOrder; /* CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1 */
  CUmemLocation srcLocHint, dstLocHint;
  unsigned int flags;
} CUmemcpyAttributes;
#define CU_MEMCPY_SRC_ACCESS_ORDER_STREAM 1

typedef struct CUuuid {
  char bytes[16];
} CUuuid;

/* X(return, symbol, field, params) */
#define KVP_CUDA_FUNCS(X)                                                       \
  X(cuInit, "cuInit", (unsigned int))                                           \
  X(cuDriverGetVersion, "cuDriverGetVersion", (int *))                          \
  X(cuDeviceGetCount, "cuDeviceGetCount", (int *))                              \
  X(cuDeviceGet, "cuDeviceGet", (CUdevice *, int))                              \
  X(cuDeviceGetName, "cuDeviceGetName", (char *, int, CUdevice))                \
  X(cuDeviceGetUuid, "cuDeviceGetUuid_v2", (CUuuid *, CUdevice))                \
  X(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId", (char *, int, CUdevice))        \
  X(cuDeviceGetAttribute, "cuDeviceGetAttribute", (int *, int, CUdevice))       \
  X(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain",                       \
    (CUcontext *, CUdevice))                                                    \
  X(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", (CUdevice))      \
  X(cuCtxSetCurrent, "cuCtxSetCurrent", (CUcontext))                            \
  X(cuCtxGetCurrent, "cuCtxGetCurrent", (CUcontext *))                          \
  X(cuModuleLoadData, "cuModuleLoadData", (CUmodule *, const void *))           \
  X(cuModuleUnload, "cuModuleUnload", (CUmodule))                               \
  X(cuModuleGetFunction, "cuModuleGetFunction",                                 \
    (CUfunction *, CUmodule, const char *))                                     \
  X(cuFuncGetAttribute, "cuFuncGetAttribute", (int *, int, CUfunction))         \
  X(cuLaunchKernel, "cuLaunchKernel",                                           \
    (CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,    \
     unsigned, CUstream, void **, void **))                                     \
  X(cuMemAlloc, "cuMemAlloc_v2", (CUdeviceptr *, size_t))                       \
  X(cuMemFree, "cuMemFree_v2", (CUdeviceptr))                                   \
  X(cuMemAllocHost, "cuMemAllocHost_v2", (void **, size_t))                     \
  X(cuMemFreeHost, "cuMemFreeHost", (void *))                                   \
  X(cuMemHostAlloc, "cuMemHostAlloc", (void **, size_t, unsigned))              \
  X(cuMemHostRegister, "cuMemHostRegister_v2", (void *, size_t, unsigned))      \
  X(cuMemHostUnregister, "cuMemHostUnregister", (void *))                       \
  X(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2",                  \
    (CUdeviceptr *, void *, unsigned))                                          \
  X(cuPointerGetAttribute, "cuPointerGetAttribute",                             \
    (void *, int, CUdeviceptr))                                                 \
  X(cuPointerGetAttributes, "cuPointerGetAttributes",                           \
    (unsigned, int *, void **, CUdeviceptr))                                    \
  X(cuMemcpy, "cuMemcpy", (CUdeviceptr, CUdeviceptr, size_t))                   \
  X(cuMemcpyAsync, "cuMemcpyAsync",                                             \
    (CUdeviceptr, CUdeviceptr, size_t, CUstream))                               \
  X(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2",                                  \
    (CUdeviceptr, const void *, size_t, CUstream))                              \
  X(cuMemcpy2DAsync, "cuMemcpy2DAsync_v2", (const CUDA_MEMCPY2D *, CUstream))   \
  X(cuMemsetD8, "cuMemsetD8_v2", (CUdeviceptr, unsigned char, size_t))          \
  X(cuMemsetD8Async, "cuMemsetD8Async",                                         \
    (CUdeviceptr, unsigned char, size_t, CUstream))                             \
  X(cuStreamCreate, "cuStreamCreate", (CUstream *, unsigned))                   \
  X(cuStreamDestroy, "cuStreamDestroy_v2", (CUstream))                          \
  X(cuStreamSynchronize, "cuStreamSynchronize", (CUstream))                     \
  X(cuStreamQuery, "cuStreamQuery", (CUstream))                                 \
  X(cuStreamWaitEvent, "cuStreamWaitEvent", (CUstream, CUevent, unsigned))      \
  X(cuEventCreate, "cuEventCreate", (CUevent *, unsigned))                      \
  X(cuEventDestroy, "cuEventDestroy_v2", (CUevent))                             \
  X(cuEventRecord, "cuEventRecord", (CUevent, CUstream))                        \
  X(cuEventSynchronize, "cuEventSynchronize", (CUevent))                        \
  X(cuEventQuery, "cuEventQuery", (CUevent))                                    \
  X(cuEventElapsedTime, "cuEventElapsedTime", (float *, CUevent, CUevent))      \
  X(cuGetErrorName, "cuGetErrorName", (CUresult, const char **))                \
  X(cuGetProcAddress, "cuGetProcAddress_v2",                                    \
    (const char *, void **, int, uint64_t, int *))

typedef struct kvp_cuda_api {
#define KVP_CUDA_FIELD_(name, sym, args) CUresult(*name) args;
  KVP_CUDA_FUNCS(KVP_CUDA_FIELD_)
#undef KVP_CUDA_FIELD_
  /* Optional (NULL when the driver lacks it): CUDA 13 ABI (no failIdx) or
   * CUDA 12.8 ABI (with failIdx). */
  CUresult (*cuMemcpyBatchAsync13)(CUdeviceptr *, CUdeviceptr *, size_t *,
                                   size_t, CUmemcpyAttributes *, size_t *,
                                   size_t, CUstream);
  CUresult (*cuMemcpyBatchAsync128)(CUdeviceptr *, CUdeviceptr *, size_t *,
                                    size_t, CUmemcpyAttributes *, size_t *,
                                    size_t, size_t *, CUstream);
  int driver_version;
} kvp_cuda_api;

/* The loaded driver (after a successful kvp__cuda_probe), else NULL.  Also
 * for the benchmark's baselines, which call the driver directly. */
const kvp_cuda_api *kvp__cuda_api(void);
/* Native handles of a CUDA device (for benchmarks and engine glue). */
void kvp__cuda_native(const struct kvp_device *d, CUcontext *ctx,
                      CUstream *own_stream, int *sm_count);

#endif /* KVP_CUDA_API_H */
