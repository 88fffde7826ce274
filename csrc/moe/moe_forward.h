// The routed-expert computation, ISA-free: routing plan, task split, phases.
#pragma once

#include <ATen/core/Tensor.h>

#include "kernels/kernel_api.h"

namespace kt::moe {

// out[t] = sum_k topk_weights[t,k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),
// e = topk_ids[t,k], skipping ids of -1. Arguments are validated by the op
// layer (csrc/ops/moe_ops.cpp): x [T,H] contiguous bf16/fp16/fp32, ids [T,K]
// int32/int64 in [-1,E), weights [T,K] float, packed bf16 weights.
//
// Phases (each a pool job; each output value is produced by one kernel call
// whose reduction order is fixed, so results are bit-identical for any
// thread count):
//   1. x -> fp32 rows padded to an even H; routing plan (rows grouped per
//      expert, tokens ascending)
//   2. tasks (expert, 16-row block of I): h = silu(x Wg^T) * (x Wu^T)
//   3. tasks (expert, 16-row block of H): y[t,k] = w[t,k] * h Wd^T
//   4. tasks (token range): out[t] = sum over k (ascending) of y[t,k]
at::Tensor moe_forward_bf16(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& gate_weight,
                            const at::Tensor& up_weight, const at::Tensor& down_weight,
                            int64_t intermediate_size, const kernels::Bf16Kernels& kernels);

}  // namespace kt::moe
