// kt_ops._C.check_layer_shapes: the op's own checks of its arguments
// (moe::parse_moe_layer) in shape-only mode, for the fake kernels of
// kt_ops/ops.py. They pass meta stand-ins of the traced tensors and get the
// eager op's error, word for word, at trace time; devices they check themselves.
// And kt_ops._C._testing.dense_expert_weights: the backward's dense decoder
// (moe/expert_weights.h) for the tests to compare with dequantize_weights.
// And kt_ops._C._testing.plan_kernels: the kernel the compute plan picks per expert token
// count (kernels::ProjectionPlan), where the output bits cannot tell the paths apart.
// And kt_ops._C.make_backward_panels: the LoRA backward's transposed weights
// (moe/backward_panels.h), for kt_ops.ExpertWeights.with_backward_panels.
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor casters

#include <optional>
#include <string>
#include <vector>

#include "kernels/dispatch.h"
#include "kernels/plan.h"
#include "moe/backward_panels.h"
#include "moe/expert_weights.h"
#include "moe/moe_layer.h"
#include "moe/moe_lora.h"

namespace py = pybind11;

namespace kt::ops {

namespace {

void check_layer_shapes(const std::string& op, const at::Tensor& hidden_states,
                        const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                        const std::vector<std::optional<at::Tensor>>& weights,
                        const std::string& weight_format, const std::vector<int64_t>& sizes,
                        const std::vector<int64_t>& group_sizes,
                        const std::vector<at::Tensor>& lora, double lora_scaling,
                        const std::string& activation,
                        const std::optional<at::Tensor>& gpu_experts_mask) {
  c10::List<std::optional<at::Tensor>> list;
  for (const auto& w : weights) list.push_back(w);
  const moe::ShapeOnlyScope shape_only;
  moe::parse_moe_layer(op.c_str(), hidden_states, topk_ids, topk_weights, list, weight_format,
                       sizes, group_sizes, lora, lora_scaling, activation, gpu_experts_mask);
}

// kt.moe_backward's checks of its own arguments (moe::check_backward_args) in shape-only
// mode, on meta stand-ins: the fake kernel's, word for word the eager op's.
void check_backward_shapes(int64_t intermediate_size, const at::Tensor& grad_output,
                           const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                           const std::optional<at::Tensor>& gate_pre,
                           const std::optional<at::Tensor>& up_pre) {
  const moe::ShapeOnlyScope shape_only;
  moe::check_backward_args(intermediate_size, grad_output, hidden_states, topk_ids, gate_pre,
                           up_pre);
}

// The experts of the op's layer arguments `weights` ... `group_sizes` (no LoRA), parsed
// with the op's checks; `op` names the caller in their messages.
moe::MoeLayer parse_experts(const char* op, const std::vector<std::optional<at::Tensor>>& weights,
                            const std::string& weight_format, const std::vector<int64_t>& sizes,
                            const std::vector<int64_t>& group_sizes) {
  c10::List<std::optional<at::Tensor>> list;
  for (const auto& w : weights) list.push_back(w);
  return moe::parse_layer(op, nullptr, list, weight_format, sizes, group_sizes, {}, 1.0,
                          kernels::activation_name(kernels::Activation::kSilu), std::nullopt);
}

// Projection `proj` (0 gate, 1 up, 2 down) of every expert as dense fp32 [E, n, k].
at::Tensor dense_expert_weights(const std::vector<std::optional<at::Tensor>>& weights,
                                const std::string& weight_format, const std::vector<int64_t>& sizes,
                                const std::vector<int64_t>& group_sizes, int64_t proj) {
  const moe::MoeLayer layer = parse_experts("kt_ops._C._testing.dense_expert_weights", weights,
                                            weight_format, sizes, group_sizes);
  const moe::Projection& p = proj == 0 ? layer.gate : proj == 1 ? layer.up : layer.down;
  at::Tensor scratch = at::empty({moe::dense_expert_weight_numel(p)}, at::kFloat);
  std::vector<at::Tensor> experts;
  for (int64_t e = 0; e < p.num_experts(); ++e)
    experts.push_back(moe::dense_expert_weight(p, e, scratch).clone());
  return at::stack(experts);
}

// Per token count m in `counts`: the kernels that compute an expert of m tokens of gate,
// up and down under the current modes on the active ISA path, as the driver plans them
// (kernels::ProjectionPlan::kernel_name).
std::vector<std::vector<std::string>> plan_kernels(
    const std::vector<std::optional<at::Tensor>>& weights, const std::string& weight_format,
    const std::vector<int64_t>& sizes, const std::vector<int64_t>& group_sizes,
    bool bf16_activations, const std::vector<int64_t>& counts) {
  const moe::MoeLayer layer =
      parse_experts("kt_ops._C._testing.plan_kernels", weights, weight_format, sizes, group_sizes);
  const kernels::Isa isa = kernels::active_isa();
  const kernels::Modes modes = kernels::Modes::current();
  std::vector<std::vector<std::string>> out;
  for (const int64_t m : counts) {
    std::vector<std::string> names;
    for (const moe::Projection* p : {&layer.gate, &layer.up, &layer.down}) {
      const kernels::ProjectionPlan plan(*p->format, p->view, isa, modes, bf16_activations);
      names.emplace_back(plan.kernel_name(static_cast<int>(m)));
    }
    out.push_back(std::move(names));
  }
  return out;
}

// The backward panels of gate, up and down (moe::make_backward_panels), `width` columns
// wide (16 or 64; None: the backward kernel's), None where a projection has none on this
// CPU and build.
std::vector<std::optional<at::Tensor>> make_backward_panels(
    const std::vector<std::optional<at::Tensor>>& weights, const std::string& weight_format,
    const std::vector<int64_t>& sizes, const std::vector<int64_t>& group_sizes,
    std::optional<int64_t> width) {
  const moe::MoeLayer layer = parse_experts("kt_ops.ExpertWeights.with_backward_panels", weights,
                                            weight_format, sizes, group_sizes);
  std::vector<std::optional<at::Tensor>> out;
  for (const moe::Projection* p : {&layer.gate, &layer.up, &layer.down}) {
    at::Tensor t = moe::make_backward_panels(*p, width.value_or(0));
    out.push_back(t.defined() ? std::optional<at::Tensor>(t) : std::nullopt);
  }
  return out;
}

}  // namespace

void register_layer_checks(py::module& m, py::module& testing) {
  m.def("check_layer_shapes", &check_layer_shapes);
  m.def("check_backward_shapes", &check_backward_shapes);
  m.def("make_backward_panels", &make_backward_panels, py::arg("weights"), py::arg("weight_format"),
        py::arg("sizes"), py::arg("group_sizes"), py::arg("width") = std::nullopt,
        py::call_guard<py::gil_scoped_release>());  // ~0.35 s per large layer
  testing.def("dense_expert_weights", &dense_expert_weights);
  testing.def("plan_kernels", &plan_kernels);
}

}  // namespace kt::ops
