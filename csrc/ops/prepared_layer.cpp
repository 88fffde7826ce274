// torch.classes.kt.PreparedLayer and kt::moe_forward_prepared: a layer parsed
// once for the eager inference calls of kt_ops.nn.MoEExperts,
// kt_ops.moe_forward and kt_ops.compat.KTMoEWrapper (a decode step calls the
// same layer thousands of times with the same packed tensors).
//
// Why it exists: a T = 1 decode call streams its experts in well under a
// millisecond, and on the cold caches between two decode steps the way into
// the kernel through kt::moe_forward (argument conversion of the 11 layer
// arguments, the autograd kernel, the layer's checks) costs about a tenth of
// that. The prepared op takes the parsed layer and the three routed tensors.
//
// It is a real dispatcher op over a registered custom class (one schema site:
// csrc/ops/registration.cpp; fake kernel and fake class: kt_ops/ops.py), so
// modes, subclasses, the profiler, autocast and torch.compile see it as they
// see any op. Earlier kt_ops reached the driver from pybind11 after
// re-deciding the dispatcher's choice itself (key sets, TLS, function modes,
// RecordFunction): any change of torch's dispatch semantics would have
// broken it silently.
//
// Inference only: its Autograd kernel refuses inputs that require grad (the
// callers use kt::moe_forward there). Results are kt::moe_forward's, bit for
// bit: the same forward body (moe::moe_forward_layer) on the same parsed layer.
#include "ops/prepared_layer.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/jit/python/pybind_utils.h>  // toIValue: a torch.ScriptObject as its holder
#include <torch/csrc/utils/pybind.h>             // at::Tensor <-> torch.Tensor casters
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/dispatch.h"
#include "moe/moe_forward.h"
#include "runtime/thread_pool.h"

namespace kt::ops {

namespace {

// The messages of the routed arguments are kt.moe_forward's: callers fall back
// to it on any error, and users read the op they called.
constexpr const char* kOp = "kt.moe_forward";

}  // namespace

PreparedLayer::PreparedLayer(const c10::List<std::optional<at::Tensor>>& weights,
                             const std::string& weight_format, const std::vector<int64_t>& sizes,
                             const std::vector<int64_t>& group_sizes, const std::string& activation,
                             const std::optional<at::Tensor>& gpu_experts_mask, int64_t top_k)
    : state_(weights.copy(), weight_format, sizes, group_sizes, activation, gpu_experts_mask,
             top_k) {
  // A contiguous mask is kept as the tensor itself (MoeLayer::skip_experts), so
  // in-place updates of it take effect at the next call, as with the op.
  TORCH_CHECK(!gpu_experts_mask.has_value() || gpu_experts_mask->is_contiguous(),
              "kt.PreparedLayer: gpu_experts_mask must be contiguous (it is read live)");
  parsed_ = parse();
  num_experts_ = parsed_->layer.num_experts;
  hidden_size_ = parsed_->layer.hidden_size;
}

std::shared_ptr<const PreparedLayer::Parsed> PreparedLayer::parse() const {
  const auto& [weights, weight_format, sizes, group_sizes, activation, mask, top_k] = state_;
  auto p = std::make_shared<Parsed>();
  const std::vector<at::Tensor> no_lora;
  p->layer = moe::parse_layer(kOp, nullptr, weights, weight_format, sizes, group_sizes, no_lora,
                              1.0, activation, mask);
  for (const std::optional<at::Tensor>& t : weights) {
    if (t.has_value() && t->defined())
      p->made_from.push_back({t->data_ptr(), t->sizes().vec(), t->strides().vec()});
  }
  return p;
}

// The parsed layer of the packed tensors as they are now. The layer holds raw
// pointers into their storage: a tensor given new storage in place (`.data = t`,
// set_(), resize_(), share_memory_()) would leave them dangling, so each call
// compares the storage with what was parsed (a few ns a tensor) and parses again
// where it changed, with the op's checks (a resized tensor: the op's error).
std::shared_ptr<const PreparedLayer::Parsed> PreparedLayer::current() const {
  std::lock_guard<std::mutex> lock(refresh_);
  size_t i = 0;
  bool same = true;
  for (const std::optional<at::Tensor>& t : std::get<0>(state_)) {
    if (!t.has_value() || !t->defined()) continue;
    const Storage& s = parsed_->made_from[i++];
    same = same && t->data_ptr() == s.data && t->sizes() == at::IntArrayRef(s.sizes) &&
           t->strides() == at::IntArrayRef(s.strides);
  }
  if (!same) parsed_ = parse();
  return parsed_;
}

at::Tensor PreparedLayer::forward(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                                  const at::Tensor& topk_weights) const {
  runtime::ThreadPool::global().prewake();  // the expert kernels run next
  moe::check_routed_args(kOp, hidden_states, topk_ids, topk_weights);
  // The snapshot stays alive for this call even if another thread parses again.
  const std::shared_ptr<const Parsed> parsed = current();
  moe::check_hidden_size(kOp, hidden_states, parsed->layer);
  const int64_t k = top_k();
  TORCH_CHECK(k <= 0 || topk_ids.size(1) == k, "kt.moe_forward_prepared: topk_ids has ",
              topk_ids.size(1), " columns, but the layer was prepared for top_k=", k);
  return moe::moe_forward_layer(hidden_states, topk_ids, topk_weights, parsed->layer,
                                kernels::active_isa());
}

std::tuple<std::tuple<std::string, int64_t>, std::tuple<std::string, int64_t>,
           std::tuple<std::string, int64_t>>
PreparedLayer::flatten() const {
  return {{"num_experts", num_experts_}, {"hidden_size", hidden_size_}, {"top_k", top_k()}};
}

namespace {

using Holder = c10::intrusive_ptr<PreparedLayer>;

// The op's typed handle, for the autograd kernel's redispatch and the C++ entry.
const c10::TypedOperatorHandle<at::Tensor(const Holder&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&)>&
prepared_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kt::moe_forward_prepared", "")
                             .typed<at::Tensor(const Holder&, const at::Tensor&, const at::Tensor&,
                                               const at::Tensor&)>();
  return op;
}

at::Tensor moe_forward_prepared_cpu(const Holder& layer, const at::Tensor& hidden_states,
                                    const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  return layer->forward(hidden_states, topk_ids, topk_weights);
}

// Inference only: a call that autograd would record is refused, by name.
at::Tensor moe_forward_prepared_autograd(c10::DispatchKeySet ks, const Holder& layer,
                                         const at::Tensor& hidden_states,
                                         const at::Tensor& topk_ids,
                                         const at::Tensor& topk_weights) {
  TORCH_CHECK(!(at::GradMode::is_enabled() &&
                (hidden_states.requires_grad() || topk_weights.requires_grad())),
              "kt.moe_forward_prepared: hidden_states or topk_weights requires grad; the prepared "
              "layer is for inference (torch.no_grad / inference_mode): call kt.moe_forward "
              "(kt_ops.moe_forward) to differentiate");
  at::AutoDispatchBelowADInplaceOrView below;
  return prepared_op().redispatch(ks & c10::after_autograd_keyset, layer, hidden_states, topk_ids,
                                  topk_weights);
}

}  // namespace

void register_prepared_layer_class(torch::Library& m) {
  // torch.classes.kt.PreparedLayer(weights, weight_format, sizes, group_sizes,
  // activation, gpu_experts_mask, top_k): the op's layer arguments (no LoRA),
  // checked as the op checks them (RuntimeError naming the argument).
  // __obj_flatten__: what its fake class needs (kt_ops/ops.py).
  m.class_<PreparedLayer>("PreparedLayer")
      .def(torch::init<c10::List<std::optional<at::Tensor>>, std::string, std::vector<int64_t>,
                       std::vector<int64_t>, std::string, std::optional<at::Tensor>, int64_t>())
      .def("__obj_flatten__", [](const Holder& self) { return self->flatten(); })
      // torch's SchemaCheckMode (torch.library.opcheck) calls len() on every
      // argument to find lists of tensors; a script object without __len__
      // raises NotImplementedError there instead of TypeError. Not a container: 0.
      .def("__len__", [](const Holder&) { return int64_t{0}; })
      .def_pickle([](const Holder& self) { return self->state(); },
                  [](PreparedLayer::State s) {
                    return c10::make_intrusive<PreparedLayer>(
                        std::get<0>(s), std::get<1>(s), std::get<2>(s), std::get<3>(s),
                        std::get<4>(s), std::get<5>(s), std::get<6>(s));
                  })
      .def("num_experts", [](const Holder& self) { return self->num_experts(); })
      .def("hidden_size", [](const Holder& self) { return self->hidden_size(); })
      .def("top_k", [](const Holder& self) { return self->top_k(); });
}

void register_prepared_layer_call(pybind11::module& m) {
  namespace py = pybind11;
  // kt.moe_forward_prepared through the dispatcher, entered from C++. Calling
  // torch.ops.kt.moe_forward_prepared from Python costs about 8 us more per
  // call: torch's __torch_function__ scan asks the script object for a
  // __torch_function__ attribute it lacks, which raises and unwinds a C++
  // exception each time (measured on Zen 4: 17.5 -> 9.3 us hot at T = 1). This
  // entry skips only that Python layer; the caller (kt_ops.ops.PreparedLayer)
  // takes it for exact torch.Tensor arguments with no torch function mode, where
  // that layer has nothing to do. Dispatch keys, dispatch modes, autocast and the
  // profiler are the dispatcher's, as for any op call.
  m.def(
      "moe_forward_prepared",
      [](py::handle layer, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
         const at::Tensor& topk_weights) {
        static const c10::ClassTypePtr type = c10::getCustomClassType<Holder>();
        const Holder holder = torch::jit::toIValue(layer, type).toCustomClass<PreparedLayer>();
        py::gil_scoped_release no_gil;  // as torch.ops calls do
        return prepared_op().call(holder, hidden_states, topk_ids, topk_weights);
      },
      py::arg("layer"), py::arg("hidden_states"), py::arg("topk_ids"), py::arg("topk_weights"),
      "torch.ops.kt.moe_forward_prepared(layer, hidden_states, topk_ids, topk_weights) without "
      "the __torch_function__ layer (kt_ops.ops.PreparedLayer.forward's fast entry)");
}

void register_prepared_layer_kernels(torch::Library& m) {
  m.impl("moe_forward_prepared",
         torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(moe_forward_prepared_cpu)));
  m.impl("moe_forward_prepared",
         torch::dispatch(c10::DispatchKey::Autograd, TORCH_FN(moe_forward_prepared_autograd)));
}

}  // namespace kt::ops
