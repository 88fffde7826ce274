// CPU implementations of kt::moe_forward_train and kt::moe_backward: the
// training half of the routed experts (LoRA through the experts). Both parse
// the layer with moe_forward's own checks (moe::parse_moe_layer), then run
// csrc/moe/moe_lora.cpp.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "moe/moe_layer.h"
#include "moe/moe_lora.h"

namespace kt::ops {

namespace {

using TrainOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Grads = std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>>;

}  // namespace

TrainOut moe_forward_train_cpu(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                               const at::Tensor& topk_weights, KT_LAYER_PARAMS) {
  const moe::MoeLayer layer = moe::parse_moe_layer("kt.moe_forward_train", hidden_states, topk_ids,
                                                   topk_weights, KT_LAYER_ARGS);
  moe::LoraForwardResult r = moe::moe_forward_lora(hidden_states.contiguous(), topk_ids,
                                                   topk_weights, layer, /*save_pre=*/true);
  return {r.out, r.gate_pre, r.up_pre};
}

Grads moe_backward_cpu(const at::Tensor& grad_output, const at::Tensor& hidden_states,
                       const at::Tensor& topk_ids, const at::Tensor& topk_weights, KT_LAYER_PARAMS,
                       const std::optional<at::Tensor>& gate_pre,
                       const std::optional<at::Tensor>& up_pre, bool compute_grad_hidden_states) {
  const moe::MoeLayer layer =
      moe::parse_moe_layer("kt.moe_backward", hidden_states, topk_ids, topk_weights, KT_LAYER_ARGS);
  moe::check_backward_args(layer.intermediate_size, grad_output, hidden_states, topk_ids, gate_pre,
                           up_pre);
  moe::MoeGrads g = moe::moe_backward_lora(
      grad_output, hidden_states.contiguous(), topk_ids, topk_weights, layer,
      gate_pre.value_or(at::Tensor()), up_pre.value_or(at::Tensor()), compute_grad_hidden_states);
  // Absent results are empty [0] tensors in the dtype of hidden_states (schema: plain tensors).
  const auto or_empty = [&](const at::Tensor& t) {
    return t.defined() ? t : at::empty({0}, hidden_states.options());
  };
  std::vector<at::Tensor> grad_lora;
  if (!lora.empty()) {
    for (const at::Tensor& t : {g.gate_a, g.gate_b, g.up_a, g.up_b, g.down_a, g.down_b})
      grad_lora.push_back(or_empty(t));
  }
  return {or_empty(g.hidden_states), g.topk_weights, grad_lora};
}

TORCH_LIBRARY_IMPL(kt, CPU, m) {
  m.impl("moe_forward_train", &moe_forward_train_cpu);
  m.impl("moe_backward", &moe_backward_cpu);
}

}  // namespace kt::ops
