// The only TORCH_LIBRARY(kt, m) block: every kt:: schema (and the one custom
// class, PreparedLayer) lives here. Implementations register per dispatch key
// in their own files (moe_ops.cpp, moe_train_ops.cpp, prepared_layer.cpp for
// CPU; moe_autograd.cpp, prepared_layer.cpp for Autograd); the fake kernels
// live in kt_ops/ops.py.
#include <torch/library.h>

#include <string>

#include "ops/prepared_layer.h"

namespace {

// The layer arguments every op takes, written once (csrc/moe/moe_layer.h
// documents each; kt_ops/layer.py builds them from PackedProjections):
//   weights: gate, up, down x (weight, scales, zeros), None where absent; then
//   optionally the 3 biases, then the 3 backward panels;
//   lora: [] or 6 tensors (gate A, B, up A, B, down A, B), [0]-shaped where a
//   projection has none (autograd needs every entry of a list to be a tensor);
//   gpu_experts_mask: bool [E], True for the experts served elsewhere (on the
//   GPU): the op skips them as it skips id -1.
const std::string kLayer =
    "Tensor?[] weights, str weight_format, int[] sizes, int[] group_sizes, Tensor[] lora, "
    "float lora_scaling=1.0, str activation='silu', Tensor? gpu_experts_mask=None";
const std::string kRouted = "Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, ";

c10::FunctionSchema schema(const std::string& text) {
  return torch::schema(text.c_str(), c10::AliasAnalysisKind::FROM_SCHEMA);
}

}  // namespace

TORCH_LIBRARY(kt, m) {
  // Routed experts of one MoE layer: [T, H] in the dtype of hidden_states.
  // See kt_ops/ops.py::moe_forward for the argument reference.
  m.def(schema("moe_forward(" + kRouted + kLayer + ") -> Tensor"));
  // The same, into a caller-owned contiguous [T, H] tensor of the dtype of
  // hidden_states (static buffers: CUDA graphs, serving engines). Returns
  // nothing: AOTAutograd (torch.compile) refuses custom ops whose outputs
  // alias an input, and a mutated argument with no return is the form it
  // functionalizes.
  m.def(schema("moe_forward.out(" + kRouted + kLayer + ", *, Tensor(a!) out) -> ()"));

  // moe_forward for training: the same output plus the gate and up
  // pre-activations (LoRA terms included), fp32 [T*K, I], row t*K + k for
  // slot (t, k), zero rows where the id is -1. moe_backward takes them back
  // instead of recomputing two of its five base GEMMs.
  m.def(schema("moe_forward_train(" + kRouted + kLayer +
               ") -> (Tensor out, Tensor gate_pre, Tensor up_pre)"));

  // Gradients of moe_forward with respect to hidden_states, topk_weights and
  // the LoRA factors (base weights are frozen). grad_lora has one entry per
  // entry of `lora` (an empty [0] tensor where the factor is absent), and
  // grad_hidden_states is empty [0] when compute_grad_hidden_states=False.
  m.def(schema("moe_backward(Tensor grad_output, " + kRouted + kLayer +
               ", Tensor? gate_pre=None, Tensor? up_pre=None, "
               "bool compute_grad_hidden_states=True) "
               "-> (Tensor grad_hidden_states, Tensor grad_topk_weights, Tensor[] grad_lora)"));

  // A layer parsed once (torch.classes.kt.PreparedLayer: the layer arguments
  // above without LoRA, plus an optional GPU-experts mask read at every call)
  // and the inference forward on it: moe_forward's output for the routed
  // tensors, without the layer arguments' conversion and checks per call (the
  // eager decode path of kt_ops.nn.MoEExperts, kt_ops.moe_forward and
  // KTMoEWrapper; csrc/ops/prepared_layer.cpp). No autograd.
  kt::ops::register_prepared_layer_class(m);
  m.def(schema(
      "moe_forward_prepared(__torch__.torch.classes.kt.PreparedLayer layer, Tensor hidden_states, "
      "Tensor topk_ids, Tensor topk_weights) -> Tensor"));
  kt::ops::register_prepared_layer_kernels(m);
}
