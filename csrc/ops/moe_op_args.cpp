#include "ops/moe_op_args.h"

#include <ATen/ATen.h>

#include <cmath>
#include <string>
#include <vector>

namespace kt::ops {

namespace {

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

struct LoraArg {
  const char* name;
  const OptTensor& t;
};

// One projection's A [E, r, k] and B [E, n, r].
void check_lora_pair(const char* op, const char* proj, const OptTensor& a, const OptTensor& b,
                     int64_t E, int64_t n, int64_t k, const char* n_name, const char* k_name) {
  const std::string a_name = std::string(proj) + "_lora_a";
  const std::string b_name = std::string(proj) + "_lora_b";
  TORCH_CHECK(a.has_value() == b.has_value(), op, ": ", a.has_value() ? a_name : b_name,
              " was given without ", a.has_value() ? b_name : a_name,
              "; LoRA on a projection needs both A and B (or neither)");
  if (!a.has_value()) return;
  auto check_one = [&](const std::string& name, const at::Tensor& t, const std::string& layout) {
    TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " is on ", t.device(),
                "; this kt_ops build runs experts on the CPU only: move it to the CPU");
    TORCH_CHECK(is_float_dtype(t.scalar_type()), op, ": ", name,
                " must be fp32, bf16 or fp16, got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 3, op, ": ", name, " must be 3-D ", layout,
                " (one LoRA factor per expert), got shape ", t.sizes());
  };
  check_one(a_name, *a, std::string("[E, r, ") + k_name + "]");
  check_one(b_name, *b, std::string("[E, ") + n_name + ", r]");
  const int64_t r = a->size(1);
  TORCH_CHECK(a->size(0) == E && a->size(2) == k && r > 0, op, ": ", a_name, " must be [E=", E,
              ", r, ", k_name, "=", k, "] with LoRA rank r >= 1, got ", a->sizes());
  TORCH_CHECK(b->size(0) == E && b->size(1) == n && b->size(2) == r, op, ": ", b_name,
              " must be [E=", E, ", ", n_name, "=", n, ", r=", r, "] (r = rank of ", a_name,
              "), got ", b->sizes());
  TORCH_CHECK(a->is_contiguous(), op, ": ", a_name, " must be contiguous (call .contiguous())");
  TORCH_CHECK(b->is_contiguous(), op, ": ", b_name, " must be contiguous (call .contiguous())");
}

}  // namespace

bool has_lora(const OptTensor& gate_lora_a, const OptTensor& gate_lora_b,
              const OptTensor& up_lora_a, const OptTensor& up_lora_b, const OptTensor& down_lora_a,
              const OptTensor& down_lora_b) {
  return gate_lora_a || gate_lora_b || up_lora_a || up_lora_b || down_lora_a || down_lora_b;
}

void check_lora_args(const char* op, int64_t E, int64_t H, int64_t I, const OptTensor& gate_lora_a,
                     const OptTensor& gate_lora_b, const OptTensor& up_lora_a,
                     const OptTensor& up_lora_b, const OptTensor& down_lora_a,
                     const OptTensor& down_lora_b, double lora_scaling) {
  if (!has_lora(gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b)) return;
  check_lora_pair(op, "gate", gate_lora_a, gate_lora_b, E, I, H, "I", "H");
  check_lora_pair(op, "up", up_lora_a, up_lora_b, E, I, H, "I", "H");
  check_lora_pair(op, "down", down_lora_a, down_lora_b, E, H, I, "H", "I");
  // One dtype for all six: PEFT keeps a layer's adapters in one dtype, and a
  // mix is almost always an accidental cast.
  const std::vector<LoraArg> args = {{"gate_lora_a", gate_lora_a}, {"gate_lora_b", gate_lora_b},
                                     {"up_lora_a", up_lora_a},     {"up_lora_b", up_lora_b},
                                     {"down_lora_a", down_lora_a}, {"down_lora_b", down_lora_b}};
  const LoraArg* first = nullptr;
  for (const LoraArg& a : args) {
    if (!a.t.has_value()) continue;
    if (first == nullptr) {
      first = &a;
      continue;
    }
    TORCH_CHECK(a.t->scalar_type() == first->t->scalar_type(), op,
                ": all LoRA tensors must have one dtype, but ", first->name, " is ",
                first->t->scalar_type(), " and ", a.name, " is ", a.t->scalar_type());
  }
  TORCH_CHECK(std::isfinite(lora_scaling), op, ": lora_scaling must be finite, got ", lora_scaling);
}

moe::LoraParams lora_params(const OptTensor& gate_lora_a, const OptTensor& gate_lora_b,
                            const OptTensor& up_lora_a, const OptTensor& up_lora_b,
                            const OptTensor& down_lora_a, const OptTensor& down_lora_b,
                            double lora_scaling) {
  moe::LoraParams p;
  p.gate = {gate_lora_a.value_or(at::Tensor()), gate_lora_b.value_or(at::Tensor())};
  p.up = {up_lora_a.value_or(at::Tensor()), up_lora_b.value_or(at::Tensor())};
  p.down = {down_lora_a.value_or(at::Tensor()), down_lora_b.value_or(at::Tensor())};
  p.scaling = lora_scaling;
  return p;
}

moe::ExpertWeights expert_weights(const at::Tensor& gate_weight, const at::Tensor& up_weight,
                                  const at::Tensor& down_weight, int64_t hidden_size,
                                  int64_t intermediate_size, c10::string_view weight_format,
                                  const OptTensor& gate_scales, const OptTensor& up_scales,
                                  const OptTensor& down_scales, const OptTensor& gate_zeros,
                                  const OptTensor& up_zeros, const OptTensor& down_zeros,
                                  int64_t group_size) {
  const std::vector<std::string> names =
      split_weight_format(std::string(weight_format.data(), weight_format.size()));
  const int64_t H = hidden_size, I = intermediate_size;
  auto proj = [&](int i, const at::Tensor& w, const OptTensor& sc, const OptTensor& z, int64_t n,
                  int64_t k) {
    return moe::ProjectionWeights{w,
                                  sc.value_or(at::Tensor()),
                                  z.value_or(at::Tensor()),
                                  names[i],
                                  projection_group_size(names, i, group_size),
                                  n,
                                  k};
  };
  return {proj(0, gate_weight, gate_scales, gate_zeros, I, H),
          proj(1, up_weight, up_scales, up_zeros, I, H),
          proj(2, down_weight, down_scales, down_zeros, H, I)};
}

}  // namespace kt::ops
