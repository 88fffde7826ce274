// kt_ops._C.check_layer_shapes: the op's own checks of its arguments
// (moe::parse_moe_layer) in shape-only mode, for the fake kernels of
// kt_ops/ops.py. They pass meta stand-ins of the traced tensors and get the
// eager op's error, word for word, at trace time; devices they check themselves.
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor casters

#include <optional>
#include <string>
#include <vector>

#include "moe/moe_layer.h"

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

}  // namespace

void register_layer_checks(py::module& m) { m.def("check_layer_shapes", &check_layer_shapes); }

}  // namespace kt::ops
