// What the CPU/GPU bridge needs from a device runtime, on the calling thread.
//
// The bridge (bridge.h) runs the kt:: ops on device tensors as a stream-ordered
// sequence: copy the inputs into host staging memory, run the CPU experts in a
// host function, copy the results back. A Transport supplies those three steps
// for one device stream. cuda_transport.cpp implements it with the CUDA runtime
// (cudaMemcpyAsync, cudaLaunchHostFunc); host_transport.cpp implements it with
// plain memcpy and a direct call, so that everything above the transport is
// tested on machines without a GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace kt::hybrid {

class Transport {
 public:
  virtual ~Transport() = default;

  // Names the device side in error messages ("cuda:0").
  virtual std::string device_name() const = 0;
  // The stream the sequence is ordered on: the key of its staging memory.
  virtual uint64_t stream_key() const = 0;
  // True while the stream is being captured into a graph: nothing may
  // allocate or synchronise, and every buffer must outlive the graph.
  virtual bool capturing() const = 0;

  // Page-locked host memory of `bytes` (64-byte aligned), and its release.
  // free_host_after_stream frees it once the work queued on the stream so far
  // has finished, without blocking the calling thread.
  virtual void* alloc_host(size_t bytes) = 0;
  virtual void free_host_after_stream(void* p) = 0;
  // The function that frees alloc_host's memory at once, for blocks that no
  // queued work uses any more (captured graphs released).
  using HostDeleter = void (*)(void*);
  virtual HostDeleter host_deleter() const = 0;

  // Stream-ordered copies between a contiguous device tensor and host memory.
  virtual void copy_to_host(void* dst, const at::Tensor& src) = 0;
  virtual void copy_to_device(const at::Tensor& dst, const void* src) = 0;
  // Enqueue fn(arg) on the stream after the work queued so far. fn must not
  // call the device runtime (CUDA forbids it in host functions).
  virtual void launch_host_func(void (*fn)(void*), void* arg) = 0;
};

}  // namespace kt::hybrid
