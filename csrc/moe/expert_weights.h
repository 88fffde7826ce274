// Access to one expert's base weights as dense fp32, for the ATen paths (LoRA
// forward, backward; QLoRA on a quantized base). Besides the kernels, this is
// the ONE place that knows how a weight format stores a projection: a new
// format extends dense_expert_weight and nothing else in csrc/moe changes.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "moe/moe_layer.h"

namespace kt::moe {

// Expert `expert`'s dense weights W[expert] as an fp32 [n, k] tensor, for
// every weight format of the registry: bf16, fp8 and the qint family (int8,
// int4, mxfp4, q8_0, q4_0, q4_k, q5_k, q6_k). Values equal
// kt_ops.formats.dequantize_weights bit for bit (fp32 subnormal mxfp4 scales
// included, which the kernels flush to zero). The memory layout is
// column-major for every format, strides (1, ld) with ld >= n (padded where
// n * 4 bytes is a multiple of 2 KiB): a 16-row block then decodes with
// contiguous 64-byte writes, and at::mm takes the view without a copy.
// `scratch`, when defined, is a contiguous fp32 tensor of at least
// dense_expert_weight_numel(p) elements to decode into (reused across
// experts: no allocation, no page faults); otherwise a new tensor is
// allocated. Reads only that expert's bytes and uses no ATen parallelism, so
// pool tasks may call it. Throws c10::Error for a format it cannot decode or
// tensors that do not have its layout.
at::Tensor dense_expert_weight(const Projection& p, int64_t expert,
                               const at::Tensor& scratch = at::Tensor());

// The fp32 elements dense_expert_weight needs as scratch for a projection of
// `p` (at least n * k: the storage may pad its rows).
int64_t dense_expert_weight_numel(const Projection& p);

// Columns [k0, k1) of expert's W (k0 a multiple of 32), decoded as
// dense_expert_weight decodes them, into `panel` (at least (k1 - k0) *
// dense_panel_ld(p) floats) as W^T: row j (ld = dense_panel_ld(p) floats apart) is
// column k0 + j of W, n floats; seen as W's [n, k1 - k0] piece with strides (1, ld).
// An L2-sized piece of the weights for the backward's W products, which then
// never writes or reads the whole fp32 matrix (moe/moe_lora.cpp).
void dense_expert_panel(const Projection& p, int64_t expert, int64_t k0, int64_t k1, float* panel);
int64_t dense_panel_ld(const Projection& p);

// Columns [k0, k0 + cols) of expert's bf16 W [n, k] as a brgemm B operand whose
// reduction runs over n (the backward's d @ W, d [m, n]): bf16 [n / 2][cols][2], the
// VNNI layout (pairs of consecutive rows of W per column), exact (no rounding), by
// AVX-512 code (kernels/avx512/bf16_vnni_panel_avx512.cpp). For int8 (per channel,
// no zeros), fp8 and fp8_channel the panel holds the codes' exact bf16 values, without
// the scales: per output channel (channel_scales: the caller folds them into d), or
// fp8's 128x128 blocks (fp8_chunk_scales: the kernel scales each 128-row chunk's sums);
// for mxfp8 and mxfp4 the values times their power-of-two scales (exact:
// panel_values_exact; mxfp4's made by split_vnni_panel's decoder, its hi part alone).
// Needs bf16_vnni_panel_applies(p) (bf16, int8, an fp8 format or mxfp4, n and k
// multiples of 16, an AVX-512 CPU and build; mxfp4 AVX512_BF16) and k0, cols multiples of 16 inside
// [0, k); throws c10::Error otherwise.
bool bf16_vnni_panel_applies(const Projection& p);
// The format half of bf16_vnni_panel_applies (no CPU or build check): whether p can
// have Projection::backward_panels.
bool backward_panels_format(const Projection& p);
void bf16_vnni_panel(const Projection& p, int64_t expert, int64_t k0, int64_t cols, uint16_t* dst);
// A qint projection's panel (int4 with or without zeros, the k-quants, q8_0, q4_0,
// nvfp4: values s * q - z that are not bf16 values; mxfp4's are, bf16_vnni_panel) as two bf16
// panels of the same layout whose sum is within 2^-17 of each weight: its values v (as
// dense_expert_panel decodes them) as hi = bf16(v) and lo = bf16(v - hi) (lo may be nullptr: hi
// alone, W rounded to bf16). A product d @ W with bf16 d is then two exact bf16 products. AVX-512
// code (kernels/avx512/qint_columns_avx512.cpp). Needs split_vnni_panel_applies(p) (a
// qint format other than int8, n and k multiples of 16, groups of a multiple of 16 k, an
// AVX512_BF16 CPU and an AVX-512 build) and k0, cols multiples of 16 inside [0, k); throws
// c10::Error otherwise. slice_width (a multiple of 16 dividing cols; 0: cols): the
// columns as cols / slice_width panels [n/2][slice_width][2], each n * slice_width words
// after the last (kt_ops' kernel reads 16-wide slices): one call decodes all of them,
// each 4-bit block's value tables made once per group, not per slice.
bool split_vnni_panel_applies(const Projection& p);
void split_vnni_panel(const Projection& p, int64_t expert, int64_t k0, int64_t cols, uint16_t* hi,
                      uint16_t* lo, int64_t slice_width = 0);
// Where bf16_vnni_panel(p, expert, k0, cols, ...) (or split_vnni_panel, or dense_expert_panel
// of columns [k0, k0 + cols)) reads: its lines, to prefetch to L2 while the previous panel
// is multiplied (kernels::avx512::bf16_dp_panel, the AVX2 tier's gemm_nt_f32). cols: a
// power of two, at least 16. An empty source (lines 0) for a layout it does not know.
kernels::PrefetchChunks vnni_panel_source(const Projection& p, int64_t expert, int64_t k0,
                                          int64_t cols = 16);
// An int8 or fp8_channel projection's n channel scales of `expert` as fp32 (the calling
// thread's buffer, valid until its next call); nullptr for the others (bf16, fp8,
// mxfp8, mxfp4).
const float* channel_scales(const Projection& p, int64_t expert);
// Whether bf16_vnni_panel gives expert's exact values: always, but for mxfp8 blocks
// with exponents outside [10, 246] (e4m3 * 2^(E-127) then leaves bf16's normal range)
// and mxfp4 blocks with exponents outside [2, 252] (2 e2m1 * 2^(E-128) likewise; no
// real checkpoint has either), which the caller computes otherwise.
bool panel_values_exact(const Projection& p, int64_t expert);
// fp8 with its 128x128 block scales (not fp8_channel / mxfp8, scaled per row).
bool fp8_block_scaled(const Projection& p);
// An fp8 projection's (128x128 block scales) scales of the 128-column block holding
// column k0, one per 128 rows (ceil(n / 128); the calling thread's buffer, valid until
// its next call); nullptr for the other formats.
const float* fp8_chunk_scales(const Projection& p, int64_t expert, int64_t k0);

}  // namespace kt::moe
