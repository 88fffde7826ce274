// The CUDA Runtime API functions that the bridge calls, declared here rather
// than taken from <cuda_runtime_api.h>.
//
// Why: the runtime wheels that CUDA builds of torch install (nvidia-cuda-runtime
// 12.x in nvidia/cuda_runtime/, 13.x in nvidia/cu13/) ship cuda_runtime_api.h
// without the crt/ headers it includes (those come with nvcc or the separate
// nvidia-cuda-crt wheel), so the official header does not compile on the
// machines this targets: a CUDA torch and no toolkit. These declarations are
// the documented C API (CUDA Runtime API reference, "Stream Management",
// "Event Management", "Memory Management", "Execution Control"), whose ABI is
// unchanged since CUDA 10 (cudaLaunchHostFunc), and the library is the
// libcudart.so.N that torch itself loads. Enum arguments are int-sized in the
// C ABI, so they are declared as int with the values of the CUDA headers.
#pragma once

#include <cstddef>

extern "C" {

typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef int cudaError_t;
typedef void (*cudaHostFn_t)(void* user_data);

enum : int {
  cudaSuccess = 0,
  cudaErrorNotReady = 600,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureModeRelaxed = 2,
};
constexpr unsigned int cudaHostAllocPortable = 0x01;
constexpr unsigned int cudaEventDisableTiming = 0x02;

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, int kind,
                            cudaStream_t stream);
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* user_data);
cudaError_t cudaHostAlloc(void** ptr, size_t size, unsigned int flags);
cudaError_t cudaFreeHost(void* ptr);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, int* capture_status);
cudaError_t cudaThreadExchangeStreamCaptureMode(int* mode);
cudaError_t cudaGetLastError(void);
const char* cudaGetErrorString(cudaError_t error);

}  // extern "C"
