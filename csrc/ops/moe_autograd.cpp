// Autograd kernels of kt::moe_forward, kt::moe_forward_train and
// kt::moe_backward (one Autograd registration per op, every backend).
//
// In C++ rather than torch.library.register_autograd: an inference call (grad
// mode off, or nothing that requires grad) must reach the CPU kernel without
// a trip through Python. Measured on the 2-core Zen 4 host, the Python
// autograd kernel cost 8 us per call on warm caches and about 100 us on the
// cold caches of a decode step (the weight stream of the previous layer
// evicts the interpreter's code and data), against a decode call of 0.6-1 ms.
//
// The gradient: kt::moe_backward computes d hidden_states, d topk_weights and
// d LoRA factors; the packed base weights are frozen (refused when they
// require grad under grad mode), the ids and the gpu_experts_mask have none.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "moe/moe_layer.h"

namespace kt::ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using WeightList = c10::List<std::optional<at::Tensor>>;
using Grads = std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>>;

// The packed base weights have no gradient: refuse one that requires grad
// (it would silently get none). Under grad mode only, as torch's own frozen
// checks: no_grad / inference calls never look.
void check_frozen(const char* op, const WeightList& weights) {
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::optional<at::Tensor> t = weights.get(i);
    if (!t.has_value() || !t->defined() || !t->requires_grad()) continue;
    TORCH_CHECK(false, op, ": ",
                i < moe::kNumWeightArgsPanels ? moe::kWeightNames[i] : "an entry of weights",
                " requires grad, but the base expert weights are frozen (kt.moe_backward "
                "computes gradients only for hidden_states, topk_weights and the LoRA factors); "
                "call .requires_grad_(False) on it, or pass LoRA factors to fine-tune the experts");
  }
}

bool any_requires_grad(const at::Tensor& x, const at::Tensor& w, at::TensorList lora) {
  if (x.requires_grad() || w.requires_grad()) return true;
  for (const at::Tensor& t : lora)
    if (t.requires_grad()) return true;
  return false;
}

using ForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              KT_LAYER_TYPES);
using TrainSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&,
                                                                const at::Tensor&,
                                                                const at::Tensor&, KT_LAYER_TYPES);
using BackwardSig = Grads(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, KT_LAYER_TYPES, const std::optional<at::Tensor>&,
                          const std::optional<at::Tensor>&, bool);

const c10::TypedOperatorHandle<ForwardSig>& forward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kt::moe_forward", "").typed<ForwardSig>();
  return op;
}
const c10::TypedOperatorHandle<TrainSig>& train_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kt::moe_forward_train", "").typed<TrainSig>();
  return op;
}
const c10::TypedOperatorHandle<BackwardSig>& backward_op() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("kt::moe_backward", "").typed<BackwardSig>();
  return op;
}

// The layer arguments that are not autograd inputs, kept for backward.
void save_layer(AutogradContext* ctx, const WeightList& weights, c10::string_view weight_format,
                at::IntArrayRef sizes, at::IntArrayRef group_sizes, double lora_scaling,
                c10::string_view activation) {
  ctx->saved_data["weights"] = weights;
  ctx->saved_data["weight_format"] = std::string(weight_format);
  ctx->saved_data["sizes"] = sizes.vec();
  ctx->saved_data["group_sizes"] = group_sizes.vec();
  ctx->saved_data["lora_scaling"] = lora_scaling;
  ctx->saved_data["activation"] = std::string(activation);
}

// Saved tensors, in order: x, ids, w, lora..., [mask], [gate_pre, up_pre].
// Autograd frees them after the first backward: a second one raises
// PyTorch's "backward through the graph a second time" error.
void save_tensors(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& ids,
                  const at::Tensor& w, at::TensorList lora, const std::optional<at::Tensor>& mask,
                  const at::Tensor& gate_pre, const at::Tensor& up_pre) {
  variable_list saved = {x, ids, w};
  saved.insert(saved.end(), lora.begin(), lora.end());
  const bool has_mask = mask.has_value() && mask->defined();
  if (has_mask) saved.push_back(*mask);
  if (gate_pre.defined()) {
    saved.push_back(gate_pre);
    saved.push_back(up_pre);
  }
  ctx->save_for_backward(saved);
  ctx->saved_data["num_lora"] = static_cast<int64_t>(lora.size());
  ctx->saved_data["has_mask"] = has_mask;
  ctx->saved_data["has_pre"] = gate_pre.defined();
}

// Gradients of x, ids, w and each LoRA tensor, from kt::moe_backward;
// undefined where none is needed, and all undefined when grad_output is (no gradient
// reached the output: materialize_grads is off), which autograd reads as zero.
variable_list backward_of(AutogradContext* ctx, const at::Tensor& grad_output) {
  const int64_t num_lora = ctx->saved_data["num_lora"].toInt();
  if (!grad_output.defined()) return variable_list(3 + num_lora);
  const variable_list saved = ctx->get_saved_variables();
  const bool has_mask = ctx->saved_data["has_mask"].toBool();
  const bool has_pre = ctx->saved_data["has_pre"].toBool();
  const at::Tensor& x = saved[0];
  const at::Tensor& ids = saved[1];
  const at::Tensor& w = saved[2];
  const std::vector<at::Tensor> lora(saved.begin() + 3, saved.begin() + 3 + num_lora);
  size_t next = 3 + num_lora;
  std::optional<at::Tensor> mask, gate_pre, up_pre;
  if (has_mask) mask = saved[next++];
  if (has_pre) {
    gate_pre = saved[next];
    up_pre = saved[next + 1];
  }
  const bool needs_x = ctx->needs_input_grad(0);
  const std::vector<int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
  const std::vector<int64_t> group_sizes = ctx->saved_data["group_sizes"].toIntVector();
  const std::string& weight_format = ctx->saved_data["weight_format"].toStringRef();
  const std::string& activation = ctx->saved_data["activation"].toStringRef();
  auto [gx, gw, grad_lora] = backward_op().call(
      grad_output, x, ids, w, ctx->saved_data["weights"].toOptionalTensorList(), weight_format,
      sizes, group_sizes, lora, ctx->saved_data["lora_scaling"].toDouble(), activation, mask,
      gate_pre, up_pre, needs_x);

  variable_list grads(3 + num_lora);
  if (needs_x) grads[0] = gx;
  if (ctx->needs_input_grad(2)) grads[2] = gw;
  for (int64_t i = 0; i < num_lora; ++i) {
    // An absent factor (a 1-D [0] placeholder; factors are 3-D) has no gradient.
    // dim(), not numel(): sizes are symbolic under torch.compile.
    if (ctx->needs_input_grad(3 + i) && lora[i].dim() > 1) grads[3 + i] = grad_lora[i];
  }
  return grads;
}

// The autograd Function of both forwards: kTrain also returns the gate and
// up pre-activations (non-differentiable) that moe_backward then reuses.
// Autograd inputs: x, ids, w, each LoRA tensor, the mask when defined.
template <class Self, bool kTrain>
struct MoeForwardNode : public torch::autograd::Function<Self> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& ids,
                               const at::Tensor& w, const at::TensorList& lora,
                               const std::optional<at::Tensor>& mask, const WeightList& weights,
                               c10::string_view weight_format, at::IntArrayRef sizes,
                               at::IntArrayRef group_sizes, double lora_scaling,
                               c10::string_view activation) {
    at::AutoDispatchBelowADInplaceOrView below;
    // Undefined output gradients stay undefined: by default autograd passes a zero tensor
    // for each, and the pre-activations (which never get one) are [T*K, I] fp32 each:
    // 100 MB of zeros, on fresh pages, per backward at T = 2048 (Qwen3-30B-A3B layer).
    ctx->set_materialize_grads(false);
    save_layer(ctx, weights, weight_format, sizes, group_sizes, lora_scaling, activation);
    if (!kTrain) {
      at::Tensor out = forward_op().call(x, ids, w, weights, weight_format, sizes, group_sizes,
                                         lora, lora_scaling, activation, mask);
      save_tensors(ctx, x, ids, w, lora, mask, at::Tensor(), at::Tensor());
      return {out};
    }
    auto [out, gate_pre, up_pre] =
        train_op().call(x, ids, w, weights, weight_format, sizes, group_sizes, lora, lora_scaling,
                        activation, mask);
    ctx->mark_non_differentiable({gate_pre, up_pre});
    save_tensors(ctx, x, ids, w, lora, mask, gate_pre, up_pre);
    return {out, gate_pre, up_pre};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    // The gradients of the saved pre-activations (non-differentiable) are ignored.
    variable_list grads = backward_of(ctx, grad_outputs[0]);
    grads.resize(grads.size() + 7);  // the mask and the six other arguments: none
    return grads;
  }
};

}  // namespace

// Named types: grad_fn.name() is "torch::autograd::CppNode<kt::ops::MoeForwardBackward>"
// (or ...TrainBackward>).
struct MoeForwardBackward : MoeForwardNode<MoeForwardBackward, false> {};
struct MoeForwardTrainBackward : MoeForwardNode<MoeForwardTrainBackward, true> {};

namespace {

at::Tensor moe_forward_autograd(c10::DispatchKeySet ks, const at::Tensor& hidden_states,
                                const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                KT_LAYER_PARAMS) {
  if (at::GradMode::is_enabled()) {
    check_frozen("kt.moe_forward", weights);
    if (any_requires_grad(hidden_states, topk_weights, lora)) {
      return MoeForwardBackward::apply(hidden_states, topk_ids, topk_weights, lora,
                                       gpu_experts_mask, weights, weight_format, sizes, group_sizes,
                                       lora_scaling, activation)[0];
    }
  }
  return forward_op().redispatch(ks & c10::after_autograd_keyset, hidden_states, topk_ids,
                                 topk_weights, KT_LAYER_ARGS);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_forward_train_autograd(
    c10::DispatchKeySet ks, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
    const at::Tensor& topk_weights, KT_LAYER_PARAMS) {
  if (at::GradMode::is_enabled()) {
    check_frozen("kt.moe_forward_train", weights);
    if (any_requires_grad(hidden_states, topk_weights, lora)) {
      variable_list r = MoeForwardTrainBackward::apply(
          hidden_states, topk_ids, topk_weights, lora, gpu_experts_mask, weights, weight_format,
          sizes, group_sizes, lora_scaling, activation);
      return {r[0], r[1], r[2]};
    }
  }
  return train_op().redispatch(ks & c10::after_autograd_keyset, hidden_states, topk_ids,
                               topk_weights, KT_LAYER_ARGS);
}

}  // namespace

// kt::moe_backward under autograd (backward with create_graph=True): its
// results are recorded, and differentiating them again raises instead of
// silently giving no gradient.
struct MoeBackwardBackward : public torch::autograd::Function<MoeBackwardBackward> {
  // The inputs only link the results to the graph; the results are computed.
  static variable_list forward(AutogradContext*, const at::Tensor& /*grad_output*/,
                               const at::Tensor& /*x*/, const at::Tensor& /*ids*/,
                               const at::Tensor& /*w*/, at::TensorList /*lora*/,
                               const Grads& grads) {
    variable_list out = {std::get<0>(grads), std::get<1>(grads)};
    out.insert(out.end(), std::get<2>(grads).begin(), std::get<2>(grads).end());
    return out;
  }
  static variable_list backward(AutogradContext*, variable_list) {
    TORCH_CHECK(false,
                "kt.moe_backward: double backward (gradients of gradients, e.g. "
                "torch.autograd.grad(..., create_graph=True) followed by another backward) "
                "through kt.moe_forward is not supported");
    return {};
  }
};

namespace {

Grads moe_backward_autograd(c10::DispatchKeySet ks, const at::Tensor& grad_output,
                            const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, KT_LAYER_PARAMS,
                            const std::optional<at::Tensor>& gate_pre,
                            const std::optional<at::Tensor>& up_pre,
                            bool compute_grad_hidden_states) {
  Grads grads;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    grads = backward_op().redispatch(ks & c10::after_autograd_keyset, grad_output, hidden_states,
                                     topk_ids, topk_weights, KT_LAYER_ARGS, gate_pre, up_pre,
                                     compute_grad_hidden_states);
  }
  if (!at::GradMode::is_enabled() ||
      !(grad_output.requires_grad() || any_requires_grad(hidden_states, topk_weights, lora)))
    return grads;
  // Recorded: the results get a grad_fn whose backward refuses.
  variable_list r =
      MoeBackwardBackward::apply(grad_output, hidden_states, topk_ids, topk_weights, lora, grads);
  std::vector<at::Tensor> grad_lora(r.begin() + 2, r.end());
  return {r[0], r[1], grad_lora};
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, Autograd, m) {
  m.impl("moe_forward", &moe_forward_autograd);
  m.impl("moe_forward_train", &moe_forward_train_autograd);
  m.impl("moe_backward", &moe_backward_autograd);
}

}  // namespace kt::ops
