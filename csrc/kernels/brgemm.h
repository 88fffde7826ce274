// The compute-bound path on oneDNN's brgemm ukernel, through libtorch's
// at::native::cpublas::brgemm / brgemm_release (ATen/native/CPUBlas.h): the
// same oneDNN that the installed torch carries (AVX512_BF16 / VNNI kernels,
// AMX tiles where the CPU has them), no second copy. ISA-free code: oneDNN
// picks its own instructions; kt_ops decides WHETHER to call it.
//
// bf16: the packed 16-row block [ceil(k/2)][16][2] (formats/bf16.h) already
// is brgemm's VNNI B operand for N = 16 (ld_b = 16); A is the m activation
// rows rounded to bf16 (TileOperand::rows), C the fp32 dot products [m][ldo].
//
// u8s8 (8-bit signed qint: int8, q8_0): the packed 16-row block
// [Kp/4][16][4] (docs/formats.md, b = 8) already is brgemm's VNNI B operand
// for s8 (ld_b = 16); A is the m q8 activation records' codes shifted to u8
// (code + 128, TileOperand::rows, gathered by gather_u8s8_rows). One brgemm call
// per K chunk of 32 (the q8 activation block, and q8_0's weight group) gives
// the exact int32 sums C[i][r] = sum (x + 128) * w; each token tile carries
// one extra A row of 128s, whose C row is the compensation 128 * sum w of
// the chunk, computed by the same call (no stored sums, no second copy of the
// weights). The epilogue (kernels/avx512/brgemm_fold_avx512.cpp) folds
// isum = C[i] - C[comp] into fp32 exactly as the streaming kernels do
// (kernels/qint_tiles.h: acc = fma(scale, float(isum) * x_scale, acc), chunks
// in K order), so the result is bit-identical to the avx2 / avx512 /
// avx512_vnni q8 kernels.
//
// fp8 (E4M3, 128x128 block scales; bf16 x bf16 -> fp32): the block scales
// move to the activations. A 128-row band has one scale per 128-k block, so
// for its output rows sum_k x[k] * e4m3[k] * s[k/128] = sum_k (x[k] *
// s[k/128]) * e4m3[k]: the A operand is the fp32 activation rows (DotArgs::x)
// times the band's scales, rounded once to bf16 (made once per band and kept
// while the thread computes the band's blocks), and the B operand is the
// codes' exact bf16 values (every E4M3 value is one), decoded by the pool
// thread with integer operations into brgemm's VNNI layout
// (kernels/avx512/brgemm_fp8_avx512.cpp). Each product carries one bf16
// rounding, of x * s; the weights none. Blocks go in groups of
// kTileGroupBlocks (one N = 32 call: faster per column than N = 16); the
// thread keeps the group's results for its next task, the group's other block.
// Which thread computes a group never changes its results.
// Before (kept in the history): the scales were folded into the decoded
// weights (bf16(e4m3 * s), an fp32 multiply and a rounding per weight, ~20%
// of an fp8 prefill) and the activations rounded to bf16 on their own: two
// roundings per product.
// The exact alternative, one call per 128-k scale chunk with the scale applied
// to its fp32 sums, measured 2.1x slower at T = 512 (N = 16 x K = 128 calls
// run at about half of brgemm's full-K rate), so it is not kept.
//
// These are tile kernel families (kernel_api.h, TileKernel): the tier table
// (kernels/dispatch.cpp) lists them with their fallbacks and the plan
// (kernels/plan.h) decides which experts they compute; this file only
// computes, and reports whether oneDNN runs a type here.
//
// Built only against a torch whose CPUBlas.h declares the bf16 brgemm
// (cmake/torch.cmake defines KT_HAVE_CPUBLAS_BRGEMM); otherwise built() is
// false, no brgemm kernel runs and the streaming kernels compute everywhere.
#pragma once

#include "formats/format_table.h"
#include "kernels/kernel_api.h"

namespace kt::kernels::brgemm {

// Whether this extension was built with the brgemm path (torch >= 2.6 headers).
bool built();

// Whether oneDNN's brgemm runs here now, per type (the TileKernel::runs of
// the tier table, kernels/dispatch.cpp): built, torch.backends.mkldnn on, the
// CPU class (bf16: AVX512_BF16 or AMX; u8s8: AVX512_VNNI or AMX, with the
// avx512 tier's fold; fp8: AVX512_BF16 and the avx512 tier's decode), and a
// probe call of that type that oneDNN answered with the right bits (once per
// process and type). The tier table lists these kernels only on tiers from
// avx512 up: oneDNN's bf16 / int8 kernels are AVX-512 code, and
// KT_OPS_ISA=avx2 means no AVX-512 instruction from kt_ops.
bool bf16_runs();
bool u8s8_runs();
bool fp8_runs();
// kt_ops' own tiles where they replace oneDNN's: bf16_runs() and
// bf16_uses_kt_kernel(); fp8_runs() and fp8_uses_kt_kernel().
bool kt_bf16_runs();
bool kt_fp8_runs();
// The fp8 tile kernels read 128x128 block scales: not the row-scaled fp8 formats.
bool fp8_applies(const formats::FormatRow& format);

// The formats the u8s8 kernel computes: 8-bit signed qint codes without a
// table or zeros, with q8 activations (int8, q8_0).
bool u8s8_applies(const formats::FormatRow& format);

// Which kernel computes the bf16 products of this path. kAuto: kt_ops' own
// vdpbf16ps tile kernel (kernels/avx512/bf16_dp_avx512bf16.cpp, with software
// prefetch of the weight stream) on CPUs with AVX512_BF16 and no AMX, oneDNN's
// brgemm otherwise (AMX tiles where the CPU has them). kOneDnn / kKt force one
// (kKt falls back to oneDNN where the CPU or the build lacks it), for tests
// and benchmarks.
enum class Bf16Kernel : uint8_t { kAuto, kOneDnn, kKt };
void set_bf16_kernel(Bf16Kernel k);
Bf16Kernel bf16_kernel_setting();
// Whether kt_ops' bf16 kernel replaces oneDNN's now (the setting resolved for this CPU).
bool bf16_uses_kt_kernel();
// Whether kt_ops' AMX tile kernel (kernels/avx512/bf16_amx.cpp) computes the bf16
// products now: under kAuto, on CPUs with AMX where Linux granted the tile data,
// oneDNN's bf16 brgemm runs (torch.backends.mkldnn on: one switch for the tile path)
// and oneDNN's ISA cap (ONEDNN_MAX_CPU_ISA) leaves AMX on.
// kOneDnn / kKt turn it off. amx_bf16_dot: its TileKernel::dot (a's run of blocks with
// the bf16 rows op.rows, as bf16_dot), then brgemm_release's reset of oneDNN's tile
// state (oneDNN loads its own configuration again when it next computes on this thread).
bool amx_bf16_runs();
void amx_bf16_dot(const DotArgs& a, const TileOperand& op);
void amx_bf16_dot_pair(const DotArgs& a0, const DotArgs& a1, const TileOperand& op);
// The same for int8 per channel under quant 'auto' (kernels/avx512/w8a8_amx.cpp: the w8a8
// product on tdpbssd, bit-identical to w8a8_dot): amx_w8a8_runs where w8a8_runs() and the
// AMX conditions above hold; K up to kW8A8MaxK (amx_w8a8_applies_to; int32 sums).
bool amx_w8a8_runs();
bool amx_w8a8_applies_to(const ProjectionView& view);
void amx_w8a8_dot(const DotArgs& a, const TileOperand& op);
void amx_w8a8_dot_pair(const DotArgs& a0, const DotArgs& a1, const TileOperand& op);
// int4 on the same tiles (kernels/avx512/w8a8_amx.cpp), where oneDNN's w4a8 runs
// (w4a8_runs, w4a8_onednn_applies_to: per channel or groups of 64 / 128) and the AMX
// conditions hold; bit-identical to w4a8_dot.
bool amx_w4a8_runs();
void amx_w4a8_dot(const DotArgs& a, const TileOperand& op);
void amx_w4a8_dot_pair(const DotArgs& a0, const DotArgs& a1, const TileOperand& op);
int64_t amx_w4a8_bytes(int m, int64_t kp);
int64_t amx_w8a8_bytes(int m, int64_t kp);
// Whether kt_ops' fused fp8 kernel replaces oneDNN's now: where its bf16
// kernel does and the CPU has AVX512_VBMI (its decode's byte tables).
bool fp8_uses_kt_kernel();

// The tile kernels (TileKernel::dot), each on its TileInput:
//
// bf16_dot: a's run of blocks with the bf16 rows op.rows (row stride op.ld).
// Token tiles of at most kMaxTileRows rows, then one remainder tile: which
// tile a token lands in depends only on m (bit-identical for any thread count).
// Where bf16_pairs(): blocks in pairs (kTileGroupBlocks), the two interleaved into
// op.scratch's tile [k/2][32][2] (the next pair's lines prefetched to L2 meanwhile) and
// multiplied by one N = 32 call per token tile, the pair's results kept for its other
// block, as fp8_dot does; the last block of an odd count alone. Each output is the same
// chain over k as with N = 16 (bit-identical where oneDNN sums in k order: AVX512_BF16).
void bf16_dot(const DotArgs& a, const TileOperand& op);

// Whether bf16_dot pairs its blocks: off unless KT_OPS_BRGEMM_BF16_PAIRS=1 when first
// asked (tests set it with kt_ops._C._testing.set_brgemm_bf16_pairs). Off by default
// because it is measured only on Zen 4, where oneDNN's N = 16 and N = 32 calls take the
// same time (docs/formats.md, "Compute paths"); AMX, where one thread's hot N = 32 calls
// ran 1.37x faster than N = 16, is where it is meant for and still to be measured.
bool bf16_pairs();
void set_bf16_pairs(bool on);

// Most A rows per brgemm call: oneDNN generates (JIT) one kernel per distinct
// M per thread, so M is capped.
constexpr int kMaxTileRows = 64;

// u8s8_dot: a's run of blocks with the m q8 records a.xq, whose codes op.rows
// holds as gather_u8s8_rows wrote them. Token tiles as bf16_dot's
// (kMaxTileRows), K chunks of kU8S8Chunk; the int32 sums of kFoldChunks chunks
// wait on the stack for their fold.
void u8s8_dot(const DotArgs& a, const TileOperand& op);

// K per u8s8 brgemm call: the q8 activation block, so every call's int32 sums
// take one activation scale per row (and one q8_0 weight scale per column).
constexpr int kU8S8Chunk = 32;

// Rows of the u8s8 A operand for m tokens: each token tile (kMaxTileRows
// rows, the last one shorter) followed by one compensation row of 128s.
inline int64_t u8s8_rows(int m) { return m + (m + kMaxTileRows - 1) / kMaxTileRows; }
// Its bytes for kp codes per row (TileKernel::pack_bytes).
inline int64_t u8s8_bytes(int m, int64_t kp) { return u8s8_rows(m) * kp; }

// Writes the u8s8 A operand of m q8 records of kp codes into dst
// (u8s8_bytes(m, kp) bytes; TileKernel::pack): code + 128 per token row, tile
// by tile, each tile followed by a row of 128s; within a tile chunk-major,
// [kp/32][rows + 1][32] (lda = 32: a call's A is one contiguous run, where
// rows kp bytes apart would fall into few L1 sets).
void gather_u8s8_rows(const uint8_t* const* records, int m, int64_t kp, uint8_t* dst);

// w8a8 (int8 per output channel, the int8 format): full-K u8s8 calls on
// activations quantized per token, as kt-kernel's AMXINT8 and SGLang's w8a8_int8
// do (dynamic symmetric int8 per row: amax = max|x|, sx = amax / 127, q =
// round_half_even(x * (127 / amax)), formats/q8_activations.h's formula over the
// whole row instead of per 32). One call per 16-row block and token tile over
// all of K (the q8 path's 32-k calls are the shape matrix engines are worst at):
// C[i][r] = sum (q + 128) * w, the tile's extra row of 128s giving 128 * sum w
// (the u8s8 compensation, computed by the same call); the epilogue writes
// out = float(C[i] - C[comp]) * sx_i * sw_r. Exact integer sums, so the result
// depends only on the activation rounding: not bit-identical to the q8 kernels
// (their scales are per 32 k), within the per-token rounding's bound
// (docs/formats.md "Compute paths"). Only under QuantActivations::kAuto (kQ8 asks
// for the q8 kernels' bits: the u8s8 kernel; kFp32 for exact activations).
bool w8a8_runs();
// The formats of the w8a8 and int8_bf16 kernels and of the LoRA backward's int8 panels:
// 8-bit signed codes with one scale per output channel (the int8 format).
bool int8_per_channel_applies(const formats::FormatRow& format);
// The A operand of m rows of kp: their per-token scales (m floats, padded to 64
// bytes), then per token tile (kMaxTileRows rows, the last one shorter) the
// tile's codes + 128 and a row of 128s, rows w8a8_ld(kp) bytes apart.
inline int64_t w8a8_ld(int64_t kp) { return kp + 64; }  // rows 4 KiB apart share L1 sets
inline int64_t w8a8_scale_bytes(int m) { return (static_cast<int64_t>(m) * 4 + 63) / 64 * 64; }
inline int64_t w8a8_bytes(int m, int64_t kp) {
  return w8a8_scale_bytes(m) + u8s8_rows(m) * w8a8_ld(kp);
}
// Writes it from the m fp32 rows x (kp long, zero padded past k; TileKernel::pack_rows).
void pack_w8a8_rows(const float* const* x, int m, int64_t kp, uint8_t* dst);
void w8a8_dot(const DotArgs& a, const TileOperand& op);
// K per w8a8 call. The int32 sums wrap (vpdpbusd, AMX's tdpbusd), so
// C[i] - C[comp] = sum q * w is exact while that difference fits:
// |q * w| <= 127 * 127, 131072 of them < 2^31. Longer K is folded per chunk.
constexpr int64_t kW8A8MaxK = 131072;

// kt_ops' own w8a8 tiles (kernels/avx512/w8a8_dp_avx512vnni.cpp) for AVX512_VNNI CPUs
// without AMX (or forced, brgemm_bf16_kernel = 'kt'; 'onednn' turns them off): the
// same exact int32 sums and epilogue as w8a8_dot, so bit-identical to it, with the
// weights as vpdpbusd's unsigned operand (code + 128) and each token's signed quad
// broadcast from memory. Needs no oneDNN.
bool kt_w8a8_runs();
// Token rows per tile of that kernel, and its A operand for m rows of kp: the
// per-token scales (m floats, padded to 64 bytes), then per row and K chunk of
// kW8A8MaxK the int32 -128 * sum q (padded to 64 bytes), then the rows' signed
// codes q in near-equal tiles of at most kW8A8TileRows rows (kernels/row_tiles.h),
// the tile of rows [i, i + mt) at byte i * kp as [kp/4][mt][4].
constexpr int kW8A8TileRows = 28;
inline int64_t w8a8_dp_chunks(int64_t kp) { return (kp + kW8A8MaxK - 1) / kW8A8MaxK; }
inline int64_t w8a8_dp_header_bytes(int m, int64_t kp) {
  return w8a8_scale_bytes(m) + (m * w8a8_dp_chunks(kp) * 4 + 63) / 64 * 64;
}
inline int64_t w8a8_dp_bytes(int m, int64_t kp) { return w8a8_dp_header_bytes(m, kp) + m * kp; }
// kt_ops' w4a8 tiles (the same file): int4 codes with one scale (and zero) per output
// channel times the per-token int8 activations, exact int32 sums over all of K
// (kernels/avx512/w8a8_dp_avx512vnni.cpp). Its A operand: the per-token scales as
// above, then per row the int32 sum of q over each 32 k (padded to 64 bytes), then the
// tiles as above. w4a8_applies: the int4 format (it has per-channel projections);
// w4a8_applies_to: a projection of it with group_size 0 (per channel).
bool kt_w4a8_runs();
bool w4a8_applies(const formats::FormatRow& format);
bool w4a8_applies_to(const ProjectionView& view);
inline int64_t w4a8_dp_header_bytes(int m, int64_t kp) {
  return w8a8_scale_bytes(m) + (m * (kp / 32) * 4 + 63) / 64 * 64;
}
inline int64_t w4a8_dp_bytes(int m, int64_t kp) { return w4a8_dp_header_bytes(m, kp) + m * kp; }
// oneDNN's w4a8 (the AMX path of int4; brgemm_bf16_kernel = 'onednn' runs it elsewhere):
// per block, the codes decoded to signed bytes c - 8 (avx512::int4_to_s8_vnni, into
// op.scratch's tile), then u8s8 calls on w8a8's A operand (per-token int8 activations)
// and kt_ops' w4a8 fold of the exact integers (avx512::w4a8_epilogue). Per channel: one
// full-K call per token tile, bit-identical to kt_ops' w4a8 tiles. With groups (64, 128:
// the AMX path of int4 g128, which otherwise streams on per-32 q8 activations): one
// call per group (K = the group size), each group's sums times its scales (less its zeros
// times the group's sum of q) added in k order; kt_ops' tiles take no groups (their
// per-group fold did not pay on Zen 4, kernels/avx512/w8a8_dp_avx512vnni.cpp). Its A
// operand: w8a8's (w8a8_bytes), then each row's int32 sum of q over all of K (m of them,
// padded to 64 bytes), then each row's sums over each 32 k ([m][kp/32], a group's sum
// is its chunks'). Up to kW8A8MaxK (|(c - 8) (q + 128)| <= 2040, K of them within int32),
// groups of at least kW4A8MinGroup dividing kp: w4a8_onednn_applies_to.
bool w4a8_runs();
// Groups of 32 stream: one K = 32 call per group is the shape of the q8 path's u8s8 calls,
// which on AMX ran int8 slower than int4's streaming (issue 26: 109.5 against 72 ms at
// T = 512); on Zen 4's oneDNN (AVX512_VNNI) g32 took 2.3x the time of per channel, g128
// 1.25x (bench_compute_paths.py, 8 experts of 32 tokens).
constexpr int64_t kW4A8MinGroup = 64;
bool w4a8_onednn_applies_to(const ProjectionView& view);
inline int64_t w4a8_chunk_sums_offset(int m, int64_t kp) {
  return w8a8_bytes(m, kp) + (static_cast<int64_t>(m) * 4 + 63) / 64 * 64;
}
inline int64_t w4a8_bytes(int m, int64_t kp) {
  return w4a8_chunk_sums_offset(m, kp) +
         (static_cast<int64_t>(m) * (kp / kU8S8Chunk) * 4 + 63) / 64 * 64;
}
void pack_w4a8_rows(const float* const* x, int m, int64_t kp, uint8_t* dst);
void w4a8_dot(const DotArgs& a, const TileOperand& op);

// int8 (per channel) on the bf16 brgemm, exact for bf16 activation rows: per
// block, the codes decoded to their bf16 values into op.scratch's tile
// (kernels/avx512/int8_bf16_avx512.cpp; every |q| <= 127 is a bf16 value), one
// bf16 call per token tile, then out[i][r] *= the channel scale. The products are
// exact in fp32 and summed in fp32: as exact as the bf16 base's tile path, for the
// LoRA forward on an int8 base (quant 'fp32': exact activations).
bool int8_bf16_runs();
void int8_bf16_dot(const DotArgs& a, const TileOperand& op);
// The same product on kt_ops' AMX tiles (kernels/avx512/bf16_amx.cpp): where
// int8_bf16_runs() and amx_bf16_runs() hold.
bool amx_int8_bf16_runs();
void amx_int8_bf16_dot(const DotArgs& a, const TileOperand& op);
void amx_int8_bf16_dot_pair(const DotArgs& a0, const DotArgs& a1, const TileOperand& op);

// mxfp4 on the bf16 brgemm, exact for bf16 activation rows: its values e2m1 * 2^(E-127)
// are bf16 values for E in [2, 252], so per group of kTileGroupBlocks blocks the codes
// and exponents are decoded into one bf16 tile (avx512::mxfp4_to_bf16_vnni, into
// op.scratch's tile) and multiplied with A = bf16(x) in one full-K call per token tile
// (N = 32), the results kept for the group's other block: the products exact in fp32
// and summed in fp32, as a bf16 base's. A block with an exponent outside [2, 252] (no
// real checkpoint has one) runs on kt_ops' exact qint tiles (same values, another sum
// order). Where oneDNN computes bf16 (AMX, or brgemm_bf16_kernel = 'onednn'):
// mxfp4_runs; elsewhere kt_ops' exact qint tiles take mxfp4 (qint_dp_exact_dot).
// mxfp4_applies: the mxfp4 format; mxfp4_applies_to: its projections with UE8M0
// exponents per 32 k.
bool mxfp4_applies(const formats::FormatRow& format);
bool mxfp4_applies_to(const ProjectionView& view);
bool mxfp4_runs();
void mxfp4_dot(const DotArgs& a, const TileOperand& op);

// fp8_dot (oneDNN) / fp8_dp_dot (kt_ops' fused tiles): a's run of blocks
// with the fp32 rows a.x: per 128-row band, A = bf16(x * scale), kept in a
// slot of op.scratch while the thread computes the band's blocks. oneDNN: per
// group of kTileGroupBlocks blocks, the codes decoded to one bf16 tile and
// one brgemm call per token tile (kMaxTileRows rows), the group's results
// kept for its other block; kt_ops: each block decoded and multiplied in
// registers. The two are bit-identical. fp8_channel and mxfp8: A = bf16(x)
// (their scales on the outputs / in the decoded values).
// fp8_dp_exact_dot (quant 'fp32'): kt_ops' tiles with A = bf16(x) and fp8's
// block scales on each 128-k chunk's fp32 sums instead: exact products for bf16
// activations (the LoRA forward on an fp8 base).
void fp8_dot(const DotArgs& a, const TileOperand& op);
void fp8_dp_dot(const DotArgs& a, const TileOperand& op);
void fp8_dp_exact_dot(const DotArgs& a, const TileOperand& op);
// Whether the tile path of `format` under quant 'fp32' multiplies bf16 activations
// exactly (kt_ops' exact fp8 tiles; fp8_channel and mxfp8 on either kernel).
bool fp8_tiles_exact(const formats::FormatRow& format);

// qint_dp_exact_dot (quant 'fp32', only where 'brgemm' is forced: the LoRA forward on a
// qint base with bf16 hidden states): kt_ops' vdpbf16ps tiles with A = bf16(x) and B the
// codes' exact bf16 values, each group's fp32 sums times its scales, minus its zeros
// times the group's sum of bf16(x) (kernels/avx512/qint_dp_avx512bf16.cpp): every
// product exact, as on a bf16 base. Needs AVX512_BF16, not oneDNN. The bf16 rows (and
// their group sums, for formats with zeros) are made once per expert and rows source, in
// a slot of op.scratch.
// qint_dp_exact_applies: the qint formats of 4/5/6-bit codes and 8-bit signed ones;
// qint_dp_exact_applies_to: their projections with groups of a multiple of 16 k (or
// per channel). qint_tiles_exact: whether that kernel computes `format` here.
bool qint_dp_exact_runs();
bool qint_dp_exact_applies(const formats::FormatRow& format);
bool qint_dp_exact_applies_to(const ProjectionView& view);
void qint_dp_exact_dot(const DotArgs& a, const TileOperand& op);
bool qint_tiles_exact(const formats::FormatRow& format);

// Releases the calling thread's brgemm hardware context (AMX tile
// configuration): once after each thread's run of oneDNN calls.
void release();

// C [m][ldc] = (add_c ? C : 0) + A [m][lda] x B, fp32 sums of bf16 products, on
// oneDNN's brgemm in token tiles of kMaxTileRows rows: A bf16 rows, B a bf16 VNNI
// operand [k/2][n][2] (k even). The bf16 and fp8 tile kernels' calls (n = 16 / 32) and
// the LoRA backward's d @ W (moe/moe_lora.cpp). Only where bf16_runs(); release()
// after a thread's last call.
void bf16_gemm(int m, int64_t n, int64_t k, const uint16_t* a, int64_t lda, const uint16_t* b,
               float* c, int64_t ldc, bool add_c);

}  // namespace kt::kernels::brgemm
