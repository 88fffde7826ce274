// The only TORCH_LIBRARY(kt, m) block: every kt:: schema lives here (style
// rule 1). Implementations register per dispatch key in their own files
// (moe_ops.cpp for CPU); fake/meta kernels and autograd live in kt_ops/ops.py.
#include <torch/library.h>

TORCH_LIBRARY(kt, m) {
  // Routed experts of one MoE layer; see kt_ops/ops.py::moe_forward for the
  // argument reference. The schema already has room for every weight format
  // (per-projection scales and zero points, group size) and for LoRA on the
  // gate, up and down projections.
  m.def(
      "moe_forward(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, "
      "Tensor gate_weight, Tensor up_weight, Tensor down_weight, int intermediate_size, "
      "str weight_format='bf16', "
      "Tensor? gate_scales=None, Tensor? up_scales=None, Tensor? down_scales=None, "
      "Tensor? gate_zeros=None, Tensor? up_zeros=None, Tensor? down_zeros=None, "
      "int group_size=0, "
      "Tensor? gate_lora_a=None, Tensor? gate_lora_b=None, "
      "Tensor? up_lora_a=None, Tensor? up_lora_b=None, "
      "Tensor? down_lora_a=None, Tensor? down_lora_b=None, "
      "float lora_scaling=1.0, str activation='silu') -> Tensor");
}
