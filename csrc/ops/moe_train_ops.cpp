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
#include "runtime/thread_pool.h"

namespace kt::ops {

namespace {

using TrainOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Grads = std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>>;

// A saved pre-activation: fp32 [T*K, I], contiguous, on the CPU.
void check_pre(const at::Tensor& t, const char* name, int64_t rows, int64_t I) {
  TORCH_CHECK(t.device().is_cpu(), "kt.moe_backward: ", name, " is on ", t.device(),
              "; it must be the CPU tensor that kt.moe_forward_train returned");
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == rows &&
                  t.size(1) == I && t.is_contiguous(),
              "kt.moe_backward: ", name, " must be a contiguous fp32 [T*K=", rows, ", I=", I,
              "] tensor as returned by kt.moe_forward_train, got ", t.scalar_type(), " ",
              t.sizes());
}

}  // namespace

TrainOut moe_forward_train_cpu(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                               const at::Tensor& topk_weights, KT_LAYER_PARAMS) {
  runtime::ThreadPool::global().prewake();
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
  runtime::ThreadPool::global().prewake();
  const moe::MoeLayer layer =
      moe::parse_moe_layer("kt.moe_backward", hidden_states, topk_ids, topk_weights, KT_LAYER_ARGS);
  TORCH_CHECK(grad_output.device().is_cpu(), "kt.moe_backward: grad_output is on ",
              grad_output.device(), "; the kt_ops experts run on the CPU");
  TORCH_CHECK(grad_output.sizes() == hidden_states.sizes(),
              "kt.moe_backward: grad_output must have the shape of hidden_states ",
              hidden_states.sizes(), ", got ", grad_output.sizes());
  TORCH_CHECK(
      grad_output.scalar_type() == at::kFloat || grad_output.scalar_type() == at::kBFloat16 ||
          grad_output.scalar_type() == at::kHalf,
      "kt.moe_backward: grad_output must be fp32, bf16 or fp16, got ", grad_output.scalar_type());
  TORCH_CHECK(gate_pre.has_value() == up_pre.has_value(),
              "kt.moe_backward: ", gate_pre.has_value() ? "gate_pre" : "up_pre",
              " was given without ", gate_pre.has_value() ? "up_pre" : "gate_pre",
              "; pass both saved pre-activations of kt.moe_forward_train (or neither)");
  const int64_t rows = topk_ids.size(0) * topk_ids.size(1);
  if (gate_pre.has_value()) {
    check_pre(*gate_pre, "gate_pre", rows, layer.intermediate_size);
    check_pre(*up_pre, "up_pre", rows, layer.intermediate_size);
  }
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
