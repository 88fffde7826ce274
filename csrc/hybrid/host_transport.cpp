// The bridge on a host "device": the same staging, host function and pool as
// the CUDA transport, with memcpy for the copies and a direct call for the
// host function. It exists so that everything above the transport is tested
// on machines without a GPU (tests/test_cuda_bridge_host.py): eager calls,
// and capture (the steps are recorded instead of run, and replay() runs them
// again, as a CUDA graph replays its memcpy and host nodes).
//
// Exposed as kt_ops._C._testing.HostBridge (test use only) with the
// bridge_caller_waits switch; kt_ops._C holds the pool's stats and release and
// the deferred error, which the CUDA path shares (kt_ops.hybrid wraps them).
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor casters

#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "hybrid/bridge.h"
#include "hybrid/staging_pool.h"
#include "hybrid/transport.h"

namespace kt::hybrid {

namespace {

void free_host(void* p) { std::free(p); }

class HostTransport final : public Transport {
 public:
  explicit HostTransport(std::vector<std::function<void()>>* recording) : recording_(recording) {}

  std::string device_name() const override { return "cpu (host transport)"; }
  // Disjoint from CUDA stream keys (those are stream handles of one process).
  uint64_t stream_key() const override { return ~uint64_t{0}; }
  bool capturing() const override { return recording_ != nullptr; }

  void* alloc_host(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    TORCH_CHECK(p != nullptr, "kt_ops host bridge: cannot allocate ", bytes, " bytes");
    return p;
  }
  void free_host_after_stream(void* p) override { std::free(p); }  // nothing is queued
  HostDeleter host_deleter() const override { return &free_host; }

  void copy_to_host(void* dst, const at::Tensor& src) override {
    run([dst, src] { std::memcpy(dst, src.data_ptr(), src.numel() * src.element_size()); });
  }
  void copy_to_device(const at::Tensor& dst, const void* src) override {
    run([dst, src] { std::memcpy(dst.data_ptr(), src, dst.numel() * dst.element_size()); });
  }
  void launch_host_func(void (*fn)(void*), void* arg) override {
    run([fn, arg] { fn(arg); });
  }

 private:
  void run(std::function<void()> step) {
    if (recording_ != nullptr) {
      recording_->push_back(std::move(step));
    } else {
      step();
    }
  }
  std::vector<std::function<void()>>* recording_;
};

// A test handle: eager (capture=false) or recording a "graph" (capture=true).
class HostBridge {
 public:
  explicit HostBridge(bool capture) : capture_(capture) {}

  at::Tensor moe_forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w,
                         const std::vector<std::optional<at::Tensor>>& weights,
                         const std::string& weight_format, const std::vector<int64_t>& sizes,
                         const std::vector<int64_t>& group_sizes,
                         const std::vector<at::Tensor>& lora, double lora_scaling,
                         const std::string& activation,
                         const std::optional<at::Tensor>& gpu_experts_mask,
                         const std::optional<at::Tensor>& out) {
    HostTransport t(capture_ ? &steps_ : nullptr);
    const c10::List<std::optional<at::Tensor>> wl(weights);
    return bridge_moe_forward(t, x, ids, w, wl, weight_format, sizes, group_sizes, lora,
                              lora_scaling, activation, gpu_experts_mask,
                              out.has_value() ? &*out : nullptr);
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_forward_train(
      const at::Tensor& x, const at::Tensor& ids, const at::Tensor& w,
      const std::vector<std::optional<at::Tensor>>& weights, const std::string& weight_format,
      const std::vector<int64_t>& sizes, const std::vector<int64_t>& group_sizes,
      const std::vector<at::Tensor>& lora, double lora_scaling, const std::string& activation,
      const std::optional<at::Tensor>& gpu_experts_mask) {
    HostTransport t(capture_ ? &steps_ : nullptr);
    const c10::List<std::optional<at::Tensor>> wl(weights);
    return bridge_moe_forward_train(t, x, ids, w, wl, weight_format, sizes, group_sizes, lora,
                                    lora_scaling, activation, gpu_experts_mask);
  }

  std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> moe_backward(
      const at::Tensor& grad_output, const at::Tensor& x, const at::Tensor& ids,
      const at::Tensor& w, const std::vector<std::optional<at::Tensor>>& weights,
      const std::string& weight_format, const std::vector<int64_t>& sizes,
      const std::vector<int64_t>& group_sizes, const std::vector<at::Tensor>& lora,
      double lora_scaling, const std::string& activation,
      const std::optional<at::Tensor>& gpu_experts_mask, const std::optional<at::Tensor>& gate_pre,
      const std::optional<at::Tensor>& up_pre, bool compute_grad_hidden_states) {
    HostTransport t(capture_ ? &steps_ : nullptr);
    const c10::List<std::optional<at::Tensor>> wl(weights);
    return bridge_moe_backward(t, grad_output, x, ids, w, wl, weight_format, sizes, group_sizes,
                               lora, lora_scaling, activation, gpu_experts_mask, gate_pre, up_pre,
                               compute_grad_hidden_states);
  }

  // Runs the recorded steps once (a graph replay); returns how many ran.
  int64_t replay() {
    for (auto& step : steps_) step();
    return static_cast<int64_t>(steps_.size());
  }

 private:
  bool capture_;
  std::vector<std::function<void()>> steps_;
};

}  // namespace

void register_host_bridge(pybind11::module& m, pybind11::module& testing) {
  namespace py = pybind11;
  py::class_<HostBridge>(testing, "HostBridge")
      .def(py::init<bool>(), py::arg("capture") = false)
      .def("moe_forward", &HostBridge::moe_forward)
      .def("moe_forward_train", &HostBridge::moe_forward_train)
      .def("moe_backward", &HostBridge::moe_backward)
      .def("replay", &HostBridge::replay);
  testing.def("bridge_caller_waits", &set_caller_waits, py::arg("waits"),
              "Whether bridged calls' host functions leave the computing to the pool's workers "
              "(default True); returns the previous setting (A/B switch for benchmarks and tests)");
  m.def("cuda_bridge_built", [] {
#ifdef KT_OPS_HAS_CUDA_BRIDGE
    return true;
#else
    return false;
#endif
  });
  // Behind kt_ops.hybrid's staging_stats(), release_graph_staging(), take_bridge_error().
  m.def("staging_stats", [] {
    const StagingStats s = StagingPool::global().stats();
    py::dict d;
    d["eager_blocks"] = s.eager_blocks;
    d["eager_bytes"] = s.eager_bytes;
    d["captured_blocks"] = s.captured_blocks;
    d["captured_bytes"] = s.captured_bytes;
    return d;
  });
  m.def("release_captured_staging", [] { StagingPool::global().release_captured(); });
  m.def("take_bridge_error", &take_deferred_error);
}

}  // namespace kt::hybrid
