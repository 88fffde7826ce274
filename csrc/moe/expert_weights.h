// Access to one expert's base weights as dense fp32, for the ATen paths (LoRA
// forward, backward). This is the ONE place that knows how a weight format
// stores a projection: a new format extends dense_expert_weight_out and
// nothing else in csrc/moe changes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace kt::moe {

// One projection (gate, up or down) of every expert, as kt::moe_forward
// receives it: the packed tensor plus the format's side data.
struct ProjectionWeights {
  at::Tensor weight;  // packed, layout chosen by `format` (bf16: [E, ceil(n/16), ceil(k/2), 16, 2])
  at::Tensor scales;  // per-format scales; undefined for bf16
  at::Tensor zeros;   // per-format zero points; undefined for bf16
  std::string format;  // weight_format name ("bf16")
  int64_t group_size = 0;
  int64_t n = 0;  // output rows of the dense projection (nn.Linear convention [n, k])
  int64_t k = 0;  // inputs

  int64_t num_experts() const { return weight.size(0); }
};

// Writes expert `expert`'s dense weights W[expert] ([n, k], fp32, row-major)
// into `out`, a contiguous fp32 tensor of n * k elements. Reads only that
// expert's bytes; touches no ATen parallelism, so pool tasks may call it.
// Throws c10::Error for a format it cannot decode.
void dense_expert_weight_out(const ProjectionWeights& p, int64_t expert, const at::Tensor& out);

// Convenience form: a fresh fp32 [n, k] tensor.
at::Tensor dense_expert_weight(const ProjectionWeights& p, int64_t expert);

}  // namespace kt::moe
