// The bridge's transport on a CUDA stream: cudaMemcpyAsync between device
// tensors and page-locked staging memory, cudaLaunchHostFunc for the CPU
// experts. Plain C++ with no CUDA header (cuda_runtime_subset.h says why),
// linked to the libcudart that a CUDA build of torch installs; the stream is
// torch's current CUDA stream, through c10's device-generic stream API.
// Compiled only against a CUDA build of torch (cmake/cuda_bridge.cmake).
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Stream.h>

#include "hybrid/transport.h"

namespace kt::hybrid {

class CudaTransport final : public Transport {
 public:
  // The current stream of `device` (a CUDA device).
  explicit CudaTransport(const c10::Device& device);

  std::string device_name() const override;
  uint64_t stream_key() const override;
  bool capturing() const override;
  void* alloc_host(size_t bytes) override;
  void free_host_after_stream(void* p) override;
  HostDeleter host_deleter() const override;
  void copy_to_host(void* dst, const at::Tensor& src) override;
  void copy_to_device(const at::Tensor& dst, const void* src) override;
  void launch_host_func(void (*fn)(void*), void* arg) override;

 private:
  c10::Device device_;
  c10::Stream stream_;
  void* handle_;  // the stream's cudaStream_t
};

}  // namespace kt::hybrid
