// The routed-expert computation, ISA-free: routing plan, task split, phases.
#pragma once

#include <ATen/core/Tensor.h>

#include "formats/qint.h"
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

enum class QuantKind { kNone, kQint, kFp8 };  // kNone: bf16

// One projection of every expert in a quantized format (validated by the op).
// Each projection has its own format: GGUF files mix them (Q4_K_M keeps
// ffn_down in q6_k in some layers and gate/up in q4_k).
struct QuantProjection {
  QuantKind kind = QuantKind::kNone;
  formats::QintFormat format;       // kQint only (also gives the scale / zero dtypes)
  const uint8_t* weight = nullptr;  // [E, NB, block_bytes]
  const void* scales = nullptr;     // qint: [E, NB, G, 16]; fp8: [E, ceil(N/128), ceil(K/128)]
  const void* zeros = nullptr;      // qint with explicit zeros: [E, NB, G, 16]; else nullptr
};

struct QuantExperts {
  QuantKind kind = QuantKind::kNone;  // kNone when all three are bf16; else kQint or kFp8
  QuantProjection gate, up, down;
};

// What the quantized formats multiply the activations with, per (expert,
// 16-row block) kernel call (docs/formats.md, "Compute paths"):
//   kQ8:   qint formats quantize activations to q8 and multiply integer codes
//          (w8a8 / w4a8); fp8 multiplies decoded codes with fp32 activations
//          in registers;
//   kFp32: every format decodes the block once to fp32 W (scale * q - zero)
//          and multiplies fp32 activations (weight-only, the w4a16 path),
//          which pays off when many tokens share the block;
//   kAuto: per call, kFp32 when the expert has at least
//          fp32_path_min_tokens(format) tokens, else kQ8.
// Process-wide; kAuto by default.
enum class QuantActivations { kAuto, kQ8, kFp32 };
void set_quant_activations(QuantActivations mode);
QuantActivations quant_activations();
// The token count per expert from which kAuto takes the fp32 path, for a
// format of `kind` (and `format`, for kQint).
int fp32_path_min_tokens(QuantKind kind, const formats::QintFormat& format);

// The same computation for the quantized formats (docs/formats.md): qint
// formats quantize each activation row to q8 (formats/q8_activations.h), fp8
// keeps fp32 activations. Phases as above, with a q8 pass over the SwiGLU
// outputs between 2 and 3 for qint.
at::Tensor moe_forward_quant(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                             const at::Tensor& topk_weights, const QuantExperts& experts,
                             int64_t num_experts, int64_t intermediate_size,
                             const kernels::QuantKernels& kernels);

}  // namespace kt::moe
