// The CPU/GPU bridge: the kt:: ops on device (CUDA) tensors, stream-ordered.
//
// hidden_states, topk_ids, topk_weights, the LoRA factors, gpu_experts_mask,
// grad_output and the saved pre-activations live on the device; the packed
// expert weights live in host memory, where the CPU experts read them. One
// call enqueues on the transport's stream, without blocking the caller:
//   1. device -> host copies of the inputs into staging memory (StagingPool),
//   2. a host function that runs the CPU op (the same driver as the CPU
//      kernels: moe_forward_experts, or the LoRA/training path) on the staged
//      tensors, writing staged outputs,
//   3. host -> device copies of the outputs into tensors allocated here.
// Every argument is validated on the calling thread before anything is
// enqueued (parse_moe_layer over the staged views), so errors raise as on the
// CPU. The one check that needs values, the expert-id range, runs in the host
// function: a failure there fills the call's outputs with NaN and is raised by
// the next bridged call (deferred, like a CUDA device-side assert).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "hybrid/staging_pool.h"
#include "hybrid/transport.h"
#include "moe/moe_layer.h"

namespace kt::hybrid {

// kt.moe_forward / kt.moe_forward.out (out: a device tensor, written in stream order).
at::Tensor bridge_moe_forward(Transport& t, const at::Tensor& hidden_states,
                              const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                              KT_LAYER_PARAMS, const at::Tensor* out);

// kt.moe_forward_train: (out, gate_pre, up_pre), all on the device.
std::tuple<at::Tensor, at::Tensor, at::Tensor> bridge_moe_forward_train(
    Transport& t, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
    const at::Tensor& topk_weights, KT_LAYER_PARAMS);

// kt.moe_backward: (grad_hidden_states, grad_topk_weights, grad_lora), on the device.
std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> bridge_moe_backward(
    Transport& t, const at::Tensor& grad_output, const at::Tensor& hidden_states,
    const at::Tensor& topk_ids, const at::Tensor& topk_weights, KT_LAYER_PARAMS,
    const std::optional<at::Tensor>& gate_pre, const std::optional<at::Tensor>& up_pre,
    bool compute_grad_hidden_states);

// The message of a bridged call whose CPU part failed in its host function
// and that no later call has raised yet ("" if none); clears it.
std::string take_deferred_error();

// Whether a bridged call's host function leaves the computing to the pool's
// workers (true, the default: runtime::CallerWaitsScope says why) or computes
// its share too (false). Returns the previous setting; for A/B measurements
// (benchmarks/bench_hybrid_cuda.py) and tests.
bool set_caller_waits(bool waits);

}  // namespace kt::hybrid
