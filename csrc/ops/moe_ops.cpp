// CPU implementation of kt::moe_forward and its out variant: the layer is
// parsed and validated once (moe::parse_moe_layer, errors naming the
// argument), then computed by the one forward body, moe::moe_forward_layer
// (the expert kernels, or the ATen LoRA path when LoRA factors are given).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels/dispatch.h"
#include "moe/moe_forward.h"
#include "moe/moe_layer.h"
#include "moe/moe_lora.h"
#include "runtime/thread_pool.h"

namespace kt::ops {

namespace {

constexpr const char* kOp = "kt.moe_forward";

void check_out(const at::Tensor& out, const at::Tensor& hidden_states) {
  TORCH_CHECK(out.device().is_cpu(), kOp, ": out is on ", out.device(),
              "; the kt_ops experts write a CPU tensor");
  moe::check_out(kOp, out, hidden_states);
}

}  // namespace

at::Tensor moe_forward_cpu(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                           const at::Tensor& topk_weights, KT_LAYER_PARAMS) {
  if (lora.empty()) runtime::ThreadPool::global().prewake();  // the expert kernels run next
  const moe::MoeLayer layer =
      moe::parse_moe_layer(kOp, hidden_states, topk_ids, topk_weights, KT_LAYER_ARGS);
  return moe::moe_forward_layer(hidden_states, topk_ids, topk_weights, layer,
                                kernels::active_isa());
}

void moe_forward_out_cpu(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                         const at::Tensor& topk_weights, KT_LAYER_PARAMS, at::Tensor& out) {
  if (lora.empty()) runtime::ThreadPool::global().prewake();
  const moe::MoeLayer layer =
      moe::parse_moe_layer(kOp, hidden_states, topk_ids, topk_weights, KT_LAYER_ARGS);
  check_out(out, hidden_states);
  moe::moe_forward_layer(hidden_states, topk_ids, topk_weights, layer, kernels::active_isa(), &out);
}

TORCH_LIBRARY_IMPL(kt, CPU, m) {
  m.impl("moe_forward", &moe_forward_cpu);
  m.impl("moe_forward.out", &moe_forward_out_cpu);
}

}  // namespace kt::ops
