// kt_ops._C.PreparedLayer: a layer parsed once for the eager inference calls
// of kt_ops.nn.MoEExperts (a decode step calls the same layer thousands of
// times with the same packed tensors).
//
// Why it exists: a T = 1 decode call streams its experts in well under a
// millisecond, and on the cold caches between two decode steps the way into
// the kernel through torch.ops (argument conversion of the 11 layer
// arguments, the dispatcher, the autograd kernel, the layer's checks) costs
// about as much as a tenth of that. forward() takes only the three routed
// tensors and reuses the parsed layer.
//
// kt_ops.compat.KTMoEWrapper uses it too (with its GPU-expert mask): kt-kernel's
// API is called per layer per decode step by serving engines.
//
// It is taken only where the dispatcher would do exactly what it does:
// grad mode off (so the autograd kernel would only redispatch); plain
// torch.Tensor arguments whose dispatch keys, with the thread's included and
// excluded keys applied, are CPU, BackendSelect, ADInplaceOrView and
// AutogradCPU alone (no Python or functorch modes, no autocast, no
// subclasses, no other device); no torch function mode; no RecordFunction
// observer (the profiler sees the op); and guards that hold (the module's
// packed buffers are still the tensors the layer was parsed from, and it
// still has no LoRA). Otherwise, and on any error, forward() returns None and
// the caller calls the op, which then raises its own error with its own type
// and message. Results are the op's, bit for bit: the same driver on the same
// parsed layer.
#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/record_function.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor casters

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/dispatch.h"
#include "moe/moe_forward.h"
#include "moe/moe_layer.h"
#include "runtime/thread_pool.h"

namespace py = pybind11;

namespace kt::ops {

namespace {

constexpr const char* kOp = "kt.moe_forward";

// True where the dispatcher would route a call on these tensors to the
// Autograd kernel and then the CPU kernel, and nothing else.
bool plain_cpu_dispatch(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  const c10::impl::LocalDispatchKeySet tls = c10::impl::tls_local_dispatch_key_set();
  const c10::DispatchKeySet keys =
      (a.key_set() | b.key_set() | c.key_set() | tls.included_) - tls.excluded_;
  for (const c10::DispatchKey k : keys) {
    switch (k) {
      case c10::DispatchKey::CPU:
      case c10::DispatchKey::BackendSelect:  // always included; no kernel for kt ops
      case c10::DispatchKey::ADInplaceOrView:
      case c10::DispatchKey::AutogradCPU:
        continue;
      default:
        return false;
    }
  }
  return true;
}

// One guard: dict[key] must still be `expected` (identity).
struct Guard {
  py::dict dict;
  py::str key;
  py::object expected;
};

class PreparedLayer {
 public:
  PreparedLayer(const std::vector<std::optional<at::Tensor>>& weights,
                const std::string& weight_format, const std::vector<int64_t>& sizes,
                const std::vector<int64_t>& group_sizes,
                const std::vector<std::tuple<py::dict, py::str, py::object>>& guards,
                const std::optional<at::Tensor>& gpu_experts_mask, int64_t top_k,
                const std::string& activation)
      : top_k_(top_k) {
    c10::List<std::optional<at::Tensor>> list;
    list.reserve(weights.size());
    for (const auto& w : weights) list.push_back(w);
    const std::vector<at::Tensor> no_lora;
    // A contiguous mask is kept as the tensor itself (MoeLayer::skip_experts), so
    // in-place updates of it take effect at the next call, as with the op.
    TORCH_CHECK(!gpu_experts_mask.has_value() || gpu_experts_mask->is_contiguous(),
                "kt_ops._C.PreparedLayer: gpu_experts_mask must be contiguous (it is read live)");
    layer_ = moe::parse_layer(kOp, nullptr, list, weight_format, sizes, group_sizes, no_lora, 1.0,
                              activation, gpu_experts_mask);
    for (const auto& [dict, key, expected] : guards) guards_.push_back({dict, key, expected});
  }

  // Whether every guard holds (the module's tensors are the parsed ones).
  bool guards_hold() const {
    for (const Guard& g : guards_) {
      PyObject* v = PyDict_GetItemWithError(g.dict.ptr(), g.key.ptr());  // borrowed
      if (v != g.expected.ptr()) {
        if (v == nullptr) PyErr_Clear();
        return false;
      }
    }
    return true;
  }

  // out [T, H] in hidden_states' dtype, or None (the caller then calls the op).
  py::object forward(py::handle hidden_states, py::handle topk_ids, py::handle topk_weights) {
    if (c10::GradMode::is_enabled()) return py::none();
    if (!THPVariable_CheckExact(hidden_states.ptr()) || !THPVariable_CheckExact(topk_ids.ptr()) ||
        !THPVariable_CheckExact(topk_weights.ptr()))
      return py::none();
    if (at::impl::torch_function_mode_enabled() || at::hasCallbacks() || !guards_hold())
      return py::none();
    const at::Tensor& x = THPVariable_Unpack(hidden_states.ptr());
    const at::Tensor& ids = THPVariable_Unpack(topk_ids.ptr());
    const at::Tensor& w = THPVariable_Unpack(topk_weights.ptr());
    if (!plain_cpu_dispatch(x, ids, w)) return py::none();
    at::Tensor out;
    {
      py::gil_scoped_release no_gil;  // as torch.ops calls do
      try {
        runtime::ThreadPool::global().prewake();  // the expert kernels run next
        moe::check_routed_args(kOp, x, ids, w);
        moe::check_hidden_size(kOp, x, layer_);
        // A caller that requires K slots per token raises its own error otherwise.
        TORCH_CHECK(top_k_ <= 0 || ids.size(1) == top_k_, "top_k");
        out = at::empty(x.sizes(), x.options());
        moe::moe_forward_experts(x.contiguous(), ids, w, layer_, kernels::active_isa(), out);
      } catch (const c10::Error&) {
        out = at::Tensor();  // the op raises it again, as the op's error
      }
    }
    if (!out.defined()) return py::none();
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out)));
  }

 private:
  moe::MoeLayer layer_;
  std::vector<Guard> guards_;
  int64_t top_k_ = 0;  // > 0: topk_ids must have this many columns
};

}  // namespace

void register_prepared_layer(py::module& m) {
  py::class_<PreparedLayer>(m, "PreparedLayer", R"doc(
A layer's packed experts parsed once, for repeated eager inference calls.

``PreparedLayer(weights, weight_format, sizes, group_sizes, guards,
gpu_experts_mask=None, top_k=0, activation='silu')`` takes the layer arguments
of ``torch.ops.kt.moe_forward`` (the 9 packed tensors or None, the format
name(s), ``[hidden_size, intermediate_size]``, the 3 group sizes, the
activation; no LoRA) and checks
them as the op does (RuntimeError naming the argument). ``guards`` is a list of
``(dict, key, object)``: the layer is only used while ``dict[key] is object``
for each. ``gpu_experts_mask``: None, or the op's contiguous CPU bool ``[E]``
mask of experts to skip, read at every call (in-place updates take effect).
``top_k`` > 0: ``forward`` returns None unless ``topk_ids`` has that many
columns (for a caller that raises its own error there).

``forward(hidden_states, topk_ids, topk_weights)`` returns the op's output,
bit for bit, or ``None`` where the op must be called instead: grad mode on,
tensor subclasses, a dispatch or function mode, another device or dispatch
key, a profiler or other RecordFunction observer, a guard that no longer
holds, or any error (the op then raises it). Used by
``kt_ops.nn.MoEExperts`` and ``kt_ops.compat.KTMoEWrapper``; see
csrc/ops/prepared_layer.cpp.
)doc")
      .def(py::init<const std::vector<std::optional<at::Tensor>>&, const std::string&,
                    const std::vector<int64_t>&, const std::vector<int64_t>&,
                    const std::vector<std::tuple<py::dict, py::str, py::object>>&,
                    const std::optional<at::Tensor>&, int64_t, const std::string&>(),
           py::arg("weights"), py::arg("weight_format"), py::arg("sizes"), py::arg("group_sizes"),
           py::arg("guards"), py::arg("gpu_experts_mask") = py::none(), py::arg("top_k") = 0,
           py::arg("activation") = kernels::activation_name(kernels::Activation::kSilu))
      .def("forward", &PreparedLayer::forward, py::arg("hidden_states"), py::arg("topk_ids"),
           py::arg("topk_weights"))
      .def("guards_hold", &PreparedLayer::guards_hold);
}

}  // namespace kt::ops
