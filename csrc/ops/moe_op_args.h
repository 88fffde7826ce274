// Argument checks and conversions shared by the kt:: ops that take the
// arguments of kt::moe_forward (moe_forward, moe_forward_train, moe_backward).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <string>
#include <vector>

#include "moe/moe_forward.h"
#include "moe/moe_lora.h"

namespace kt::ops {

using OptTensor = std::optional<at::Tensor>;

// The per-projection format names of weight_format: one name for all three
// projections, or "gate,up,down". Throws c10::Error for any other count.
std::vector<std::string> split_weight_format(const std::string& weight_format);

// The group size of projection `proj` (0 gate, 1 up, 2 down) of the split
// weight_format `names`: `group_size`, except that with mixed formats a format
// with a single group size (the GGUF types, int8, fp8) uses its own.
int64_t projection_group_size(const std::vector<std::string>& names, int proj, int64_t group_size);

// Every check of kt::moe_forward's arguments, LoRA tensors included (errors
// name the argument). Defined in moe_ops.cpp, next to the op. Returns the
// quantized projections (kind kNone for bf16).
moe::QuantExperts check_moe_forward_args(
    const at::Tensor& hidden_states, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& gate_weight, const at::Tensor& up_weight, const at::Tensor& down_weight,
    int64_t intermediate_size, c10::string_view weight_format, const OptTensor& gate_scales,
    const OptTensor& up_scales, const OptTensor& down_scales, const OptTensor& gate_zeros,
    const OptTensor& up_zeros, const OptTensor& down_zeros, int64_t group_size,
    const OptTensor& gate_lora_a, const OptTensor& gate_lora_b, const OptTensor& up_lora_a,
    const OptTensor& up_lora_b, const OptTensor& down_lora_a, const OptTensor& down_lora_b,
    double lora_scaling, c10::string_view activation);

// LoRA tensors against E experts, hidden size H, intermediate size I:
// A and B of a projection come together; gate/up A [E, r, H], B [E, I, r];
// down A [E, r, I], B [E, H, r]; r >= 1 agrees between A and B; one float
// dtype (fp32/bf16/fp16) for all; CPU; contiguous; finite scaling.
// `op` prefixes the messages ("kt.moe_forward").
void check_lora_args(const char* op, int64_t E, int64_t H, int64_t I, const OptTensor& gate_lora_a,
                     const OptTensor& gate_lora_b, const OptTensor& up_lora_a,
                     const OptTensor& up_lora_b, const OptTensor& down_lora_a,
                     const OptTensor& down_lora_b, double lora_scaling);

bool has_lora(const OptTensor& gate_lora_a, const OptTensor& gate_lora_b,
              const OptTensor& up_lora_a, const OptTensor& up_lora_b, const OptTensor& down_lora_a,
              const OptTensor& down_lora_b);

moe::LoraParams lora_params(const OptTensor& gate_lora_a, const OptTensor& gate_lora_b,
                            const OptTensor& up_lora_a, const OptTensor& up_lora_b,
                            const OptTensor& down_lora_a, const OptTensor& down_lora_b,
                            double lora_scaling);

// The three projections as csrc/moe sees them (validated arguments).
moe::ExpertWeights expert_weights(const at::Tensor& gate_weight, const at::Tensor& up_weight,
                                  const at::Tensor& down_weight, int64_t hidden_size,
                                  int64_t intermediate_size, c10::string_view weight_format,
                                  const OptTensor& gate_scales, const OptTensor& up_scales,
                                  const OptTensor& down_scales, const OptTensor& gate_zeros,
                                  const OptTensor& up_zeros, const OptTensor& down_zeros,
                                  int64_t group_size);

}  // namespace kt::ops
