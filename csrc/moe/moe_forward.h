// The routed-expert computation of every weight format, ISA-free: routing
// plan, task split, phases. One driver; the per-format, per-ISA work is the
// kernels' (kernels/kernel_api.h), SwiGLU and the routing weights are this
// driver's epilogue.
#pragma once

#include <ATen/core/Tensor.h>

#include "kernels/isa.h"
#include "moe/moe_layer.h"

namespace kt::moe {

// What the quantized formats multiply the activations with, per (expert,
// projection) (docs/formats.md, "Compute paths"):
//   kQ8:   each format's own kernel: q8 integer dot products for the qint
//          formats (w8a8 / w4a8), codes decoded in registers for fp8;
//   kFp32: every format decodes each block once to fp32 W (scale * q - zero)
//          and multiplies fp32 activations (weight-only, the w4a16 path);
//   kAuto: kFp32 when the expert has at least fp32_min_tokens(format, isa)
//          tokens (the format row's threshold for the tier's kernel class),
//          else kQ8.
// bf16 has one path (fp32 activations). Process-wide; kAuto by default.
enum class QuantActivations { kAuto, kQ8, kFp32 };
void set_quant_activations(QuantActivations mode);
QuantActivations quant_activations();

// Which kernels compute an expert's products (docs/formats.md, "Compute paths"):
//   kStreaming: the per-ISA kernels of kernels/kernel_api.h (decode kernels
//               that stream each 16-row block once, register-tiled over tokens);
//   kBrgemm:    oneDNN's brgemm ukernel (kernels/brgemm.h) on tiles of the
//               packed blocks, at any token count, for the formats and CPUs on
//               which it runs (kernels::brgemm::runs); the others stream;
//   kAuto:      kBrgemm for experts with at least the format row's
//               brgemm.min_tokens for this CPU class, else kStreaming; bf16
//               and fp8 only for bf16 activations (fp32 / fp16 activations
//               stream: bf16 brgemm would round them); the u8s8 kernel (int8, q8_0)
//               for any activations (it reproduces the q8 kernels' bits).
// The u8s8 kernel needs q8 activations: never under QuantActivations::kFp32.
// Process-wide; kAuto by default.
enum class ComputePath { kAuto, kStreaming, kBrgemm };
void set_compute_path(ComputePath path);
ComputePath compute_path();

// Tokens per expert from which 'auto' sends projections of `format` to the
// weight-only fp32 path on tier `isa` (the row's Fp32Policy for the class of
// the tier's kernels); formats::kNoFp32Path: never.
int fp32_min_tokens(const formats::FormatRow& format, kernels::Isa isa);

// Tokens per expert from which projections of `format` run on brgemm in this
// process under the current compute path and tier `isa`; formats::kNoBrgemm
// where brgemm never runs.
int brgemm_min_tokens(const formats::FormatRow& format, kernels::Isa isa);

// out[t] = sum_k topk_weights[t,k] * down_e(act(gate_e(x[t])) * up_e(x[t])),
// e = topk_ids[t,k], skipping ids of -1 (the LoRA-free layer; act: layer.activation). Writes `out`
// ([T, H], dtype of x, contiguous). Arguments validated by parse_moe_layer;
// the ids are checked as the routing plan reads them.
//
// Phases (each a pool job; each output value is produced by one kernel call
// whose reduction order is fixed, so results are bit-identical for any
// thread count):
//   1. x -> fp32 rows padded to Kp (and q8 records where a qint projection
//      needs them); routing plan (rows grouped per expert, tokens ascending);
//      for the experts whose gate/up run on brgemm, their rows gathered as bf16
//   2. tasks (expert, 16-row block of I): h = act(x Wg^T) * (x Wu^T)
//      (h -> q8 records where the down projection needs them; h -> bf16 rows
//      for the experts whose down projection runs on brgemm)
//   3. tasks (expert, 16-row block of H): y[t,k] = w[t,k] * h Wd^T
//   4. tasks (token range): out[t] = sum over k (ascending) of y[t,k]
void moe_forward_experts(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                         const at::Tensor& topk_weights, const MoeLayer& layer, kernels::Isa isa,
                         at::Tensor& out);

// THE forward of kt.moe_forward on a parsed layer: the ATen LoRA path
// (moe/moe_lora.h) when the layer has LoRA factors, else moe_forward_experts on
// ISA tier `isa`. Writes `out` when given ([T, H], the dtype of hidden_states,
// contiguous) and returns it, else returns a new tensor (the LoRA path's own
// result, uncopied). The CPU op and its out variant, the CUDA bridge's host
// function and the prepared layer (kt.moe_forward_prepared) all run this one
// body. Callers wake the pool (ThreadPool::prewake) as early as they can when
// the layer has no LoRA (the ATen path's ops run on torch's threads), so the
// wake-up overlaps their checks.
at::Tensor moe_forward_layer(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                             const at::Tensor& topk_weights, const MoeLayer& layer,
                             kernels::Isa isa, const at::Tensor* out = nullptr);

// Bytes of scratch the calling thread keeps between calls of
// moe_forward_experts (activations, SwiGLU outputs, slot outputs). At most
// 64 MiB: a larger call frees its buffers when it returns.
size_t retained_scratch_bytes();

}  // namespace kt::moe
