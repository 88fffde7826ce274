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

  // moe_forward for training: the same arguments and output, plus the gate
  // and up pre-activations (LoRA terms included), fp32 [T*K, I], row t*K + k
  // for slot (t, k), zero rows where the id is -1. moe_backward takes them
  // back instead of recomputing two of its five base GEMMs (kt_ops/ops.py:
  // activation checkpointing off).
  m.def(
      "moe_forward_train(Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, "
      "Tensor gate_weight, Tensor up_weight, Tensor down_weight, int intermediate_size, "
      "str weight_format='bf16', "
      "Tensor? gate_scales=None, Tensor? up_scales=None, Tensor? down_scales=None, "
      "Tensor? gate_zeros=None, Tensor? up_zeros=None, Tensor? down_zeros=None, "
      "int group_size=0, "
      "Tensor? gate_lora_a=None, Tensor? gate_lora_b=None, "
      "Tensor? up_lora_a=None, Tensor? up_lora_b=None, "
      "Tensor? down_lora_a=None, Tensor? down_lora_b=None, "
      "float lora_scaling=1.0, str activation='silu') "
      "-> (Tensor out, Tensor gate_pre, Tensor up_pre)");

  // Gradients of moe_forward with respect to hidden_states, topk_weights and
  // the LoRA factors (base weights are frozen). Takes moe_forward's arguments
  // after grad_output, and optionally the pre-activations of
  // moe_forward_train (None: recomputed). Always returns eight plain tensors
  // (opcheck- and compile-friendly): an absent LoRA factor's gradient, and
  // grad_hidden_states when compute_grad_hidden_states=False, are empty [0]
  // tensors in the dtype of hidden_states.
  m.def(
      "moe_backward(Tensor grad_output, Tensor hidden_states, Tensor topk_ids, "
      "Tensor topk_weights, Tensor gate_weight, Tensor up_weight, Tensor down_weight, "
      "int intermediate_size, str weight_format='bf16', "
      "Tensor? gate_scales=None, Tensor? up_scales=None, Tensor? down_scales=None, "
      "Tensor? gate_zeros=None, Tensor? up_zeros=None, Tensor? down_zeros=None, "
      "int group_size=0, "
      "Tensor? gate_lora_a=None, Tensor? gate_lora_b=None, "
      "Tensor? up_lora_a=None, Tensor? up_lora_b=None, "
      "Tensor? down_lora_a=None, Tensor? down_lora_b=None, "
      "float lora_scaling=1.0, str activation='silu', "
      "Tensor? gate_pre=None, Tensor? up_pre=None, bool compute_grad_hidden_states=True) "
      "-> (Tensor grad_hidden_states, Tensor grad_topk_weights, "
      "Tensor grad_gate_lora_a, Tensor grad_gate_lora_b, "
      "Tensor grad_up_lora_a, Tensor grad_up_lora_b, "
      "Tensor grad_down_lora_a, Tensor grad_down_lora_b)");
}
