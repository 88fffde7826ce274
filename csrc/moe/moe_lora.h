// The routed experts with LoRA, forward and backward.
//
// LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models";
// PEFT convention): projection p of expert e computes
//     y = W_p[e] x + scaling * B_p[e] (A_p[e] x)
// with A_p[e] [r, K] and B_p[e] [N, r], so the stacked tensors are
//     gate/up: A [E, r, H], B [E, I, r];   down: A [E, r, I], B [E, H, r].
// Any subset of the three projections may carry LoRA. The expert is a GLU
// (kernels/activations.h), with optional per-expert biases b:
//     g = gate(x) + bg, u = up(x) + bu, h = glu(g, u), y = down(h) + bd,
//     out[t] = sum_k w[t, k] * y_{e = ids[t, k]}(x[t]).
//
// Forward: the inference driver's exact mode (moe_forward_experts_exact in
// moe/moe_forward.h), with the LoRA terms added in the block epilogues (each
// expert's first products x A^T, h Ad^T made per expert before its blocks) and the saved
// gate/up pre-activations written there. bf16 hidden states on a bf16 base
// run its tile path: bf16 products fit fp32 and the sums are fp32, so the
// pre-activations (and the LoRA gradients) keep fp32 accuracy, while down reads h
// rounded to bf16 as inference does (the bf16 output moves by about its own
// rounding). Anything else runs the streaming kernels with fp32 activations times the
// exact weights (every format, QLoRA style on a quantized base; no rounding). A BLAS
// forward on fp32 weight panels (as the backward's) was tried: 1.5x slower for int8.
//
// Backward: one pool task per active expert (largest first). A task gathers
// the expert's rows, runs its GEMMs single-threaded (at::mm with the BLAS held
// to one thread, moe/blas_tasks.h) on L2-sized fp32 panels of the base
// (dense_expert_panel, expert_weights.h), and writes per-(token, slot)
// results; a second pass sums the slots of each token in k order. With bf16
// hidden states and gradients on a bf16 (or int8) base, the products with the base
// run on bf16 VNNI panels of the weights over n (bf16_vnni_panel) instead: on kt_ops'
// vdpbf16ps kernel where the forward's bf16 tiles are kt_ops' (AVX512_BF16 without
// AMX; it prefetches the next panel's weights while it multiplies), else on oneDNN's
// brgemm (kernels::brgemm::bf16_gemm). go Wd stays exact (bf16 products, fp32
// sums), dg and du are rounded to bf16 for x's (bf16) gradient. Without
// saved pre-activations it first reruns the exact forward (the same bits).
// Every value comes from the same sequence of operations for any thread
// count: results are bit-identical for 1, 2, ... threads.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "moe/expert_weights.h"
#include "moe/moe_layer.h"

namespace kt::moe {

// An expert's LoRA factor as rows ld floats apart.
struct LoraRows {
  const float* p;
  int64_t ld;
};

// One projection's LoRA factors read as fp32 (the LoRA forward's terms,
// moe/moe_forward.cpp, and the backward): an expert's rows at a time, from the factors
// as given (fp32, or bf16 / fp16 widened exactly as they are read into the calling
// thread's buffers). No fp32 copy of every expert per call: with a bf16 adapter that copy
// was most of a decode call (int4 g128, rank 16, T = 1, 8 of 128 experts: 4.5 ms against
// the base's 0.72, Zen 4).
struct LoraF32 {
  const void* a = nullptr;  // A [E, r, k], B [E, n, r] of dtype `dtype`
  const void* b = nullptr;
  at::ScalarType dtype = at::kFloat;
  int64_t r = 0, n = 0, k = 0;
  int id = 0;         // the projection (0 gate, 1 up, 2 down): its thread buffers
  uint64_t call = 0;  // unique per lora_f32 call: what the thread buffers hold
  bool present() const { return r > 0; }
  // A[e] [r, k] for a product over m rows: fp32 A itself, or a copy in the calling
  // thread's buffer (kept for the call's later uses of expert e): of bf16 / fp16 A
  // widened, and for m >= 16 where its rows are a multiple of 2 KiB apart with one 64-byte
  // line of padding per row (the rank rows and the m rows' lines would share L1 sets: 8
  // ways, 3 + 8 lines at a time; with m = 128, k = 2048 on a Zen 4 core x A^T ran 1.2x
  // (r = 8) to 1.7x (r = 16) and t w up to 3.3x (r = 16) slower).
  LoraRows a_rows(int64_t e, int64_t m) const;
  // B[e]^T [r, n] in the calling thread's buffer (rows padded likewise), kept likewise.
  LoraRows bt_rows(int64_t e) const;
  // Columns [16 nb, 16 nb + n_valid) of B[e]^T as r rows 16 floats apart (zero past
  // n_valid), in the calling thread's buffer: the LoRA term of one 16-row block of the
  // base's outputs, read with the block (16 r values), not B^T whole per expert.
  LoraRows bt_block(int64_t e, int64_t nb, int n_valid) const;
};
// `id`: 0, 1, 2 for gate, up, down (two LoraF32 a thread uses at once differ in it).
// The factors' storage is the caller's (the layer's tensors outlive the call).
LoraF32 lora_f32(const LoraProjection& p, int id);

// out [T, H] in the dtype of x. When save_pre is true, also returns the gate
// and up pre-activations (with their LoRA terms), fp32 [T*K, I], row t*K + k
// for slot (t, k), zero rows for slots with id -1 (what backward needs to
// skip recomputing them). x [T, H] bf16/fp16/fp32, ids [T, K] int32/int64 in
// [-1, E), topk_weights [T, K]; all validated by the op layer.
struct LoraForwardResult {
  at::Tensor out;
  at::Tensor gate_pre;  // undefined unless save_pre
  at::Tensor up_pre;
};
LoraForwardResult moe_forward_lora(const at::Tensor& x, const at::Tensor& topk_ids,
                                   const at::Tensor& topk_weights, const MoeLayer& layer,
                                   bool save_pre);

// Gradients of moe_forward(_lora) with respect to x, topk_weights and the
// LoRA factors present in `lora` (the base weights are frozen). gate_pre /
// up_pre: the forward's saved pre-activations, or undefined tensors to
// recompute them. grad_output [T, H] any float dtype.
struct MoeGrads {
  at::Tensor hidden_states;  // [T, H], dtype of x; undefined unless compute_grad_x
  at::Tensor topk_weights;   // [T, K], dtype of topk_weights
  at::Tensor gate_a, gate_b, up_a, up_b, down_a, down_b;  // dtype of the LoRA tensors
};
// The checks of kt.moe_backward's own arguments (grad_output, the saved
// pre-activations), after parse_moe_layer; errors name the argument. Under a
// ShapeOnlyScope (the fake kernel, kt_ops._C.check_backward_shapes) no device check.
void check_backward_args(int64_t intermediate_size, const at::Tensor& grad_output,
                         const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                         const std::optional<at::Tensor>& gate_pre,
                         const std::optional<at::Tensor>& up_pre);

MoeGrads moe_backward_lora(const at::Tensor& grad_output, const at::Tensor& x,
                           const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                           const MoeLayer& layer, const at::Tensor& gate_pre,
                           const at::Tensor& up_pre, bool compute_grad_x);

}  // namespace kt::moe
