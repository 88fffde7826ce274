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

// Expert `expert`'s dense weights W[expert] as an fp32 [n, k] tensor. The
// memory layout is the format's choice (bf16: column-major, strides (1, n):
// its 16-row blocks then decode with contiguous 64-byte writes); at::mm
// takes either layout at the same speed. `scratch`, when defined, is a
// contiguous fp32 tensor of at least n * k elements to decode into (reused
// across experts: no allocation, no page faults); otherwise a new tensor is
// allocated. Reads only that expert's bytes and uses no ATen parallelism, so
// pool tasks may call it. Throws c10::Error for a format it cannot decode.
at::Tensor dense_expert_weight(const ProjectionWeights& p, int64_t expert,
                               const at::Tensor& scratch = at::Tensor());

}  // namespace kt::moe
