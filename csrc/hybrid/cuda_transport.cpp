#include "hybrid/cuda_transport.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <mutex>
#include <utility>
#include <vector>

#include "hybrid/cuda_runtime_subset.h"

namespace kt::hybrid {

namespace {

#define KT_CUDA_CHECK(expr)                                           \
  do {                                                                \
    const cudaError_t kt_err = (expr);                                \
    TORCH_CHECK(kt_err == cudaSuccess, "kt_ops CUDA bridge: ", #expr, \
                " failed: ", cudaGetErrorString(kt_err));             \
  } while (0)

cudaStream_t as_stream(void* handle) { return static_cast<cudaStream_t>(handle); }

// Host blocks waiting for their stream to pass an event before cudaFreeHost.
std::mutex g_retired_mu;
std::vector<std::pair<cudaEvent_t, void*>> g_retired;

// Frees the retired blocks whose event has completed; never blocks. A query
// that fails (e.g. refused while another thread captures in global mode)
// keeps the block for a later poll: freeing memory a copy may still read
// would be worse than holding it.
void free_completed_locked() {
  for (size_t i = 0; i < g_retired.size();) {
    const cudaError_t q = cudaEventQuery(g_retired[i].first);
    if (q != cudaSuccess) {
      if (q != cudaErrorNotReady) (void)cudaGetLastError();
      ++i;
      continue;
    }
    cudaFreeHost(g_retired[i].second);
    cudaEventDestroy(g_retired[i].first);
    g_retired[i] = g_retired.back();
    g_retired.pop_back();
  }
}

void cuda_free_host(void* p) { cudaFreeHost(p); }  // a deleter: nothing to raise to

// cudaHostAlloc is not allowed in a global-mode capture; the allocation is
// not part of the captured work, so the thread's capture mode is relaxed
// around it (what PyTorch's own allocators do).
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { KT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode_)); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }

 private:
  int mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace

CudaTransport::CudaTransport(const c10::Device& device)
    : device_(device),
      stream_(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(device)),
      handle_(stream_.native_handle()) {}

std::string CudaTransport::device_name() const { return device_.str(); }

uint64_t CudaTransport::stream_key() const {
  // The legacy default stream is the same handle on every device.
  return reinterpret_cast<uint64_t>(handle_) ^ (static_cast<uint64_t>(device_.index()) << 56);
}

bool CudaTransport::capturing() const {
  int status = cudaStreamCaptureStatusNone;
  KT_CUDA_CHECK(cudaStreamIsCapturing(as_stream(handle_), &status));
  return status == cudaStreamCaptureStatusActive;
}

void* CudaTransport::alloc_host(size_t bytes) {
  RelaxedCaptureMode relaxed;
  {
    std::lock_guard<std::mutex> lock(g_retired_mu);
    free_completed_locked();
  }
  void* p = nullptr;
  const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
  TORCH_CHECK(err == cudaSuccess, "kt_ops CUDA bridge: cudaHostAlloc of ", bytes,
              " bytes of staging memory failed: ", cudaGetErrorString(err));
  return p;
}

void CudaTransport::free_host_after_stream(void* p) {
  RelaxedCaptureMode relaxed;  // event calls are not part of any capture
  cudaEvent_t ev = nullptr;
  KT_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  KT_CUDA_CHECK(cudaEventRecord(ev, as_stream(handle_)));
  std::lock_guard<std::mutex> lock(g_retired_mu);
  g_retired.emplace_back(ev, p);
  free_completed_locked();
}

Transport::HostDeleter CudaTransport::host_deleter() const { return &cuda_free_host; }

void CudaTransport::copy_to_host(void* dst, const at::Tensor& src) {
  KT_CUDA_CHECK(cudaMemcpyAsync(dst, src.data_ptr(), src.numel() * src.element_size(),
                                cudaMemcpyDeviceToHost, as_stream(handle_)));
}

void CudaTransport::copy_to_device(const at::Tensor& dst, const void* src) {
  KT_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src, dst.numel() * dst.element_size(),
                                cudaMemcpyHostToDevice, as_stream(handle_)));
}

void CudaTransport::launch_host_func(void (*fn)(void*), void* arg) {
  KT_CUDA_CHECK(cudaLaunchHostFunc(as_stream(handle_), fn, arg));
}

}  // namespace kt::hybrid
