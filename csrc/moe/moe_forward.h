// The routed-expert computation of every weight format, ISA-free: routing
// plan, task split, phases. One driver; which kernel computes an expert's
// products is the compute plan's (kernels/plan.h), the per-format, per-ISA
// work the kernels' (kernels/kernel_api.h); the GLU activation and the
// routing weights are this driver's epilogue.
#pragma once

#include <ATen/core/Tensor.h>

#include "kernels/isa.h"
#include "kernels/plan.h"
#include "moe/moe_layer.h"

namespace kt::moe {

// The process-wide modes (compute path, quantized activations) and the
// plan's reports belong to the compute plan (kernels/plan.h); these names
// stay for kt_ops._C (csrc/ops/python_bindings.cpp).
using kernels::compute_path;
using kernels::ComputePath;
using kernels::fp32_min_tokens;
using kernels::quant_activations;
using kernels::QuantActivations;
using kernels::set_compute_path;
using kernels::set_quant_activations;

// out[t] = sum_k topk_weights[t,k] * down_e(act(gate_e(x[t])) * up_e(x[t])),
// e = topk_ids[t,k], skipping ids of -1 (act: layer.activation), plus the layer's LoRA
// terms when it has them (added in the block epilogues, as the exact forward adds
// them; moe_forward_layer sends LoRA here only under QuantActivations::kQ8). Writes `out`
// ([T, H], dtype of x, contiguous). Arguments validated by parse_moe_layer;
// the ids are checked as the routing plan reads them.
//
// Phases (moe_forward.cpp, one function each; each a pool job; each output
// value is produced by one kernel call whose reduction order is fixed, so
// results are bit-identical for any thread count):
//   route        the routing plan: rows grouped per expert, tokens ascending
//   plan         the compute plan of gate, up and down (kernels/plan.h) and the
//                forms of the activations its kernels read
//   activations  x -> fp32 rows padded to Kp, and q8 records / bf16 rows where
//                a plan reads them; the tables of every row's forms (rows)
//   gate/up      tasks (expert, 16-row block of I): x Wg^T and x Wu^T, then the
//   epilogue     GLU h = act(g) * u (h -> bf16 rows where down reads them;
//                h -> q8 records per expert, once its blocks are done)
//   down         tasks (expert, 16-row block of H): y[t,k] = w[t,k] * h Wd^T
//   combine      tasks (token range): out[t] = sum over k (ascending) of y[t,k]
// gate/up and down run as one pool job (one NUMA part) or one job each.
void moe_forward_experts(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                         const at::Tensor& topk_weights, const MoeLayer& layer, kernels::Isa isa,
                         at::Tensor& out);

// The exact forward of the LoRA and training paths (moe/moe_lora.h): the same
// driver with the layer's LoRA terms, fp32 activations times the exact weights
// (the streaming kernels under QuantActivations::kFp32: no q8 rounding, no bf16
// tile kernel), and the gate and up pre-activations (bias and LoRA included)
// written to gate_pre / up_pre (fp32 [T*K, I], contiguous, any values on entry: every
// row is written, zero for the slots without an expert). The LoRA terms are kt_ops'
// rank-r products per expert (moe/lora_products.h: x A^T B^T before gate/up, h Ad^T Bd^T
// between the phases). `out` nullptr:
// the pre-activations alone (no down phase; the backward's recompute).
// `path`: kStreaming (the above), or kAuto for bf16 activations on bf16 weights: the
// tile kernel's gate/up products are exact too (they fit fp32, the sums are fp32), and
// its down projection reads the GLU outputs rounded to bf16, as inference does.
void moe_forward_experts_exact(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                               const at::Tensor& topk_weights, const MoeLayer& layer,
                               kernels::Isa isa, at::Tensor* out, at::Tensor& gate_pre,
                               at::Tensor& up_pre,
                               kernels::ComputePath path = kernels::ComputePath::kStreaming);

// THE forward of kt.moe_forward on a parsed layer: the exact LoRA forward
// (moe/moe_lora.h) when the layer has LoRA factors and quant_activations is not pinned
// to kQ8, else moe_forward_experts on ISA tier `isa` (with the LoRA terms, if any). Writes `out`
// when given ([T, H], the dtype of hidden_states, contiguous) and returns it, else returns a new
// tensor (the LoRA path's own result, uncopied). The CPU op and its out variant, the CUDA bridge's
// host function and the prepared layer (kt.moe_forward_prepared) all run this one body. Callers
// wake the pool (ThreadPool::prewake) as early as they can when the layer has no LoRA (the ATen
// path's ops run on torch's threads), so the wake-up overlaps their checks.
at::Tensor moe_forward_layer(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                             const at::Tensor& topk_weights, const MoeLayer& layer,
                             kernels::Isa isa, const at::Tensor* out = nullptr);

// Bytes of scratch the calling thread keeps between calls of
// moe_forward_experts (activations, GLU outputs, slot outputs, and the
// kernel families' per-thread scratch of its calls, kernels::CallScratch). At
// most scratch_keep_bytes(): a larger call frees its buffers when it returns.
size_t retained_scratch_bytes();
// KT_OPS_SCRATCH_KEEP_MB (default 512) in bytes, read once; an invalid value throws.
size_t scratch_keep_bytes();

// Size (bytes) from which a call writes the buffers it reads back only after a pool
// barrier (the per-slot outputs, the saved pre-activations) with non-temporal stores,
// past the caches; default 16 MiB. Tests set it (kt_ops._C._testing.set_stream_bytes) to
// run that path on small layers; returns the previous value.
int64_t set_stream_bytes(int64_t bytes);

}  // namespace kt::moe
