// CUDA kernels of the kt:: ops: the CPU/GPU bridge (csrc/hybrid/bridge.h).
// hidden_states and the other activations on a CUDA device, the packed expert
// weights in host memory: the call is enqueued on the current CUDA stream
// (copies to pinned staging memory, the CPU experts in a host function,
// copies back) and returns at once; it is captured by torch.cuda.graph like
// any other stream work. Compiled only against a CUDA build of torch with
// its runtime headers (KT_OPS_CUDA_BRIDGE); cuda_unsupported.cpp otherwise.
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "hybrid/bridge.h"
#include "hybrid/cuda_transport.h"
#include "moe/moe_layer.h"

namespace kt::ops {

namespace {

// The arguments of a CPU-hidden-states call that sit on a CUDA device, by name.
std::string cuda_arguments(const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                           KT_LAYER_PARAMS) {
  std::string names;
  const auto add = [&](const at::Tensor& t, const char* name) {
    if (t.defined() && t.is_cuda()) names += (names.empty() ? "" : ", ") + std::string(name);
  };
  add(topk_ids, "topk_ids");
  add(topk_weights, "topk_weights");
  for (size_t i = 0; i < weights.size() && i < moe::kNumWeightArgsPanels; ++i) {
    const std::optional<at::Tensor> w = weights.get(i);
    if (w.has_value()) add(*w, moe::kWeightNames[i]);
  }
  for (size_t i = 0; i < lora.size() && i < 6; ++i) add(lora[i], moe::kLoraFactorNames[i]);
  if (gpu_experts_mask.has_value()) add(*gpu_experts_mask, "gpu_experts_mask");
  return names.empty() ? "other arguments" : names;
}

// The CUDA kernels run with CUDA hidden states; a call whose hidden_states is on the
// CPU got here through another argument on a CUDA device: name it.
void check_cuda_hidden(const char* op, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights, KT_LAYER_PARAMS) {
  if (hidden_states.is_cuda()) return;
  const bool weight_on_cuda = [&] {
    for (size_t i = 0; i < weights.size(); ++i) {
      const std::optional<at::Tensor> w = weights.get(i);
      if (w.has_value() && w->is_cuda()) return true;
    }
    return false;
  }();
  TORCH_CHECK(false, op, ": hidden_states is on ", hidden_states.device(), " but ",
              cuda_arguments(topk_ids, topk_weights, KT_LAYER_ARGS), " on a CUDA device; ",
              weight_on_cuda ? "the packed expert weights must stay in host (CPU) memory; " : "",
              "pass hidden_states, topk_ids, topk_weights (and LoRA factors, gpu_experts_mask) "
              "all on the CPU or all on one CUDA device (the packed expert weights stay on the "
              "CPU)");
}

at::Tensor moe_forward_cuda(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, KT_LAYER_PARAMS) {
  check_cuda_hidden("kt.moe_forward", hidden_states, topk_ids, topk_weights, KT_LAYER_ARGS);
  const c10::DeviceGuard guard(hidden_states.device());
  hybrid::CudaTransport t(hidden_states.device());
  return hybrid::bridge_moe_forward(t, hidden_states, topk_ids, topk_weights, KT_LAYER_ARGS,
                                    nullptr);
}

void moe_forward_out_cuda(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                          const at::Tensor& topk_weights, KT_LAYER_PARAMS, at::Tensor& out) {
  check_cuda_hidden("kt.moe_forward", hidden_states, topk_ids, topk_weights, KT_LAYER_ARGS);
  const c10::DeviceGuard guard(hidden_states.device());
  hybrid::CudaTransport t(hidden_states.device());
  hybrid::bridge_moe_forward(t, hidden_states, topk_ids, topk_weights, KT_LAYER_ARGS, &out);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_forward_train_cuda(
    const at::Tensor& hidden_states, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    KT_LAYER_PARAMS) {
  check_cuda_hidden("kt.moe_forward_train", hidden_states, topk_ids, topk_weights, KT_LAYER_ARGS);
  const c10::DeviceGuard guard(hidden_states.device());
  hybrid::CudaTransport t(hidden_states.device());
  return hybrid::bridge_moe_forward_train(t, hidden_states, topk_ids, topk_weights, KT_LAYER_ARGS);
}

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> moe_backward_cuda(
    const at::Tensor& grad_output, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
    const at::Tensor& topk_weights, KT_LAYER_PARAMS, const std::optional<at::Tensor>& gate_pre,
    const std::optional<at::Tensor>& up_pre, bool compute_grad_hidden_states) {
  check_cuda_hidden("kt.moe_backward", hidden_states, topk_ids, topk_weights, KT_LAYER_ARGS);
  const c10::DeviceGuard guard(hidden_states.device());
  hybrid::CudaTransport t(hidden_states.device());
  return hybrid::bridge_moe_backward(t, grad_output, hidden_states, topk_ids, topk_weights,
                                     KT_LAYER_ARGS, gate_pre, up_pre, compute_grad_hidden_states);
}

}  // namespace

TORCH_LIBRARY_IMPL(kt, CUDA, m) {
  m.impl("moe_forward", &moe_forward_cuda);
  m.impl("moe_forward.out", &moe_forward_out_cuda);
  m.impl("moe_forward_train", &moe_forward_train_cuda);
  m.impl("moe_backward", &moe_backward_cuda);
}

}  // namespace kt::ops
