// CPU implementations of kt::moe_forward_train and kt::moe_backward: the
// training half of the routed experts (LoRA through the experts). Both check
// their moe_forward arguments with moe_forward's own checks, then run
// csrc/moe/moe_lora.cpp.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>

#include "moe/moe_lora.h"
#include "ops/moe_op_args.h"
#include "runtime/thread_pool.h"

namespace kt::ops {

namespace {

using TrainOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                         at::Tensor, at::Tensor>;

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

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

TrainOut moe_forward_train_cpu(
    const at::Tensor& hidden_states, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& gate_weight, const at::Tensor& up_weight, const at::Tensor& down_weight,
    int64_t intermediate_size, c10::string_view weight_format, const OptTensor& gate_scales,
    const OptTensor& up_scales, const OptTensor& down_scales, const OptTensor& gate_zeros,
    const OptTensor& up_zeros, const OptTensor& down_zeros, int64_t group_size,
    const OptTensor& gate_lora_a, const OptTensor& gate_lora_b, const OptTensor& up_lora_a,
    const OptTensor& up_lora_b, const OptTensor& down_lora_a, const OptTensor& down_lora_b,
    double lora_scaling, c10::string_view activation) {
  runtime::ThreadPool::global().prewake();
  check_moe_forward_args(hidden_states, topk_ids, topk_weights, gate_weight, up_weight, down_weight,
                         intermediate_size, weight_format, gate_scales, up_scales, down_scales,
                         gate_zeros, up_zeros, down_zeros, group_size, gate_lora_a, gate_lora_b,
                         up_lora_a, up_lora_b, down_lora_a, down_lora_b, lora_scaling, activation);
  const at::Tensor x = hidden_states.contiguous();
  const moe::ExpertWeights w = expert_weights(
      gate_weight, up_weight, down_weight, x.size(1), intermediate_size, weight_format, gate_scales,
      up_scales, down_scales, gate_zeros, up_zeros, down_zeros, group_size);
  const moe::LoraParams lora = lora_params(gate_lora_a, gate_lora_b, up_lora_a, up_lora_b,
                                           down_lora_a, down_lora_b, lora_scaling);
  moe::LoraForwardResult r =
      moe::moe_forward_lora(x, topk_ids, topk_weights, w, lora, /*save_pre=*/true);
  return {r.out, r.gate_pre, r.up_pre};
}

Grads moe_backward_cpu(
    const at::Tensor& grad_output, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
    const at::Tensor& topk_weights, const at::Tensor& gate_weight, const at::Tensor& up_weight,
    const at::Tensor& down_weight, int64_t intermediate_size, c10::string_view weight_format,
    const OptTensor& gate_scales, const OptTensor& up_scales, const OptTensor& down_scales,
    const OptTensor& gate_zeros, const OptTensor& up_zeros, const OptTensor& down_zeros,
    int64_t group_size, const OptTensor& gate_lora_a, const OptTensor& gate_lora_b,
    const OptTensor& up_lora_a, const OptTensor& up_lora_b, const OptTensor& down_lora_a,
    const OptTensor& down_lora_b, double lora_scaling, c10::string_view activation,
    const OptTensor& gate_pre, const OptTensor& up_pre, bool compute_grad_hidden_states) {
  runtime::ThreadPool::global().prewake();
  check_moe_forward_args(hidden_states, topk_ids, topk_weights, gate_weight, up_weight, down_weight,
                         intermediate_size, weight_format, gate_scales, up_scales, down_scales,
                         gate_zeros, up_zeros, down_zeros, group_size, gate_lora_a, gate_lora_b,
                         up_lora_a, up_lora_b, down_lora_a, down_lora_b, lora_scaling, activation);
  TORCH_CHECK(grad_output.device().is_cpu(), "kt.moe_backward: grad_output is on ",
              grad_output.device(), "; this kt_ops build runs experts on the CPU only");
  TORCH_CHECK(grad_output.sizes() == hidden_states.sizes(),
              "kt.moe_backward: grad_output must have the shape of hidden_states ",
              hidden_states.sizes(), ", got ", grad_output.sizes());
  TORCH_CHECK(is_float_dtype(grad_output.scalar_type()),
              "kt.moe_backward: grad_output must be fp32, bf16 or fp16, got ",
              grad_output.scalar_type());
  TORCH_CHECK(gate_pre.has_value() == up_pre.has_value(),
              "kt.moe_backward: ", gate_pre.has_value() ? "gate_pre" : "up_pre",
              " was given without ", gate_pre.has_value() ? "up_pre" : "gate_pre",
              "; pass both saved pre-activations of kt.moe_forward_train (or neither)");
  const int64_t rows = topk_ids.size(0) * topk_ids.size(1);
  if (gate_pre.has_value()) {
    check_pre(*gate_pre, "gate_pre", rows, intermediate_size);
    check_pre(*up_pre, "up_pre", rows, intermediate_size);
  }

  const at::Tensor x = hidden_states.contiguous();
  const moe::ExpertWeights w = expert_weights(
      gate_weight, up_weight, down_weight, x.size(1), intermediate_size, weight_format, gate_scales,
      up_scales, down_scales, gate_zeros, up_zeros, down_zeros, group_size);
  const moe::LoraParams lora = lora_params(gate_lora_a, gate_lora_b, up_lora_a, up_lora_b,
                                           down_lora_a, down_lora_b, lora_scaling);
  moe::MoeGrads g = moe::moe_backward_lora(
      grad_output, x, topk_ids, topk_weights, w, lora, gate_pre.value_or(at::Tensor()),
      up_pre.value_or(at::Tensor()), compute_grad_hidden_states);
  // Absent results are empty tensors in the dtype of hidden_states (schema: plain tensors).
  const auto or_empty = [&](const at::Tensor& t) {
    return t.defined() ? t : at::empty({0}, hidden_states.options());
  };
  return {or_empty(g.hidden_states), g.topk_weights,   or_empty(g.gate_a), or_empty(g.gate_b),
          or_empty(g.up_a),          or_empty(g.up_b), or_empty(g.down_a), or_empty(g.down_b)};
}

TORCH_LIBRARY_IMPL(kt, CPU, m) {
  m.impl("moe_forward_train", &moe_forward_train_cpu);
  m.impl("moe_backward", &moe_backward_cpu);
}

}  // namespace kt::ops
