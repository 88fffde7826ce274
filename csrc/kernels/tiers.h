// Entry points that several tiers share (declarations only, no intrinsics):
// the ref tier's kernels and scalar per-block kernels, and the AVX2 tier's,
// whose weight-only kernels (and fp8's, on CPUs without AVX512_VBMI:
// avx512::fp8_kernels) the AVX-512 tiers reuse. The tier table
// in dispatch.cpp declares the rest; a tier that lacks a layout falls back
// there, never inside a kernel.
#pragma once

#include "kernels/activations.h"
#include "kernels/block_args.h"
#include "kernels/gemm_nt.h"
#include "kernels/kernel_api.h"

namespace kt::kernels {

namespace ref {
const ProjectionKernels& bf16_kernels();
const ProjectionKernels& qint_kernels();
const ProjectionKernels& fp8_kernels();
GluRows glu_rows(const Glu& glu);
GluBackwardRows glu_backward_rows(const Glu& glu);
void quantize_row_q8(const float* x, int64_t kp, uint8_t* rec);
// Scalar per-block kernels, also the SIMD tiers' answer for a code width
// they do not specialise.
void qint_block_dot(const QintBlock& b);
void qint_block_decode(const QintBlock& b, float* w);
}  // namespace ref

// One term s t w of the LoRA products' lora_tw (avx2::, avx512::; moe/lora_products.h).
struct LoraTwTerm {
  const float* t;  // [m, r], rows r apart
  int r;
  const float* w;  // [r, n], rows ldw apart
  int64_t ldw;
};

// Weak: null when the compiler could not build the AVX2 tier (dispatch.cpp).
namespace avx2 {
__attribute__((weak)) const ProjectionKernels& bf16_kernels();
__attribute__((weak)) const ProjectionKernels& qint_kernels();
__attribute__((weak)) const ProjectionKernels& fp8_kernels();
__attribute__((weak)) GluRows glu_rows(const Glu& glu);
__attribute__((weak)) GluBackwardRows glu_backward_rows(const Glu& glu);
__attribute__((weak)) void quantize_row_q8(const float* x, int64_t kp, uint8_t* rec);
__attribute__((weak)) void gemm_nt_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                                       const float* b, int64_t ldb, float* c, int64_t ldc,
                                       bool accumulate, const PrefetchChunks& next);
// The LoRA products of rank r (kernels/avx2/lora_avx2.cpp): as avx512::lora_xat,
// lora_tw and lora_dtx below (the same definitions; 8 lanes, so other sum orders for
// xat's reductions along k; tw and dtx sum each output in the same order).
__attribute__((weak)) void lora_xat(const float* const* x, int m, int64_t k, const float* a,
                                    int64_t lda, int r, float* y);
__attribute__((weak)) void lora_xat_bf16(const uint16_t* const* x, int m, int64_t k, const float* a,
                                         int64_t lda, int r, float* y);
__attribute__((weak)) void lora_tw(const LoraTwTerm* terms, int nterms, int m, int64_t n, float s,
                                   bool accumulate, float* const* out);
__attribute__((weak)) void lora_dtx(const float* d, int64_t ldd, int m, int r, const float* x,
                                    int64_t ldx, int64_t k, float s, float* g, int64_t ldg);
__attribute__((weak)) void lora_dtx_bf16(const float* d, int64_t ldd, int m, int r,
                                         const uint16_t* x, int64_t ldx, int64_t k, float s,
                                         float* g, int64_t ldg);
// `iters` steps of independent 256-bit FMA chains (kernels/avx2/fma_peak_avx2.cpp);
// returns the FLOPs done and stores a value of the result at sink.
__attribute__((weak)) double fma_chains(int64_t iters, float* sink);
}  // namespace avx2

namespace avx512 {
// fp8's streaming kernels (kernels/avx512/fp8_avx512.cpp; the AVX2 tier's on CPUs
// without AVX512_VBMI); the tier table's, and the fp8 brgemm path's for blocks
// it does not take (mxfp8 exponents outside bf16's range).
__attribute__((weak)) const ProjectionKernels& fp8_kernels();

// The epilogue of the u8s8 brgemm path (kernels/brgemm.h), AVX-512 code
// (kernels/avx512/brgemm_fold_avx512.cpp); null when the avx512 tier is not built.
__attribute__((weak)) void brgemm_q8_fold(const int32_t* c, int nc, int rows,
                                          const uint8_t* const* xq, int64_t kp, int64_t chunk0,
                                          const void* scales, formats::ScaleType scale_type,
                                          int64_t group_size, float* out, int64_t ldo);

// The w8a8 brgemm path (kernels/brgemm.h), AVX-512 code (kernels/avx512/w8a8_avx512.cpp).
// quantize_rows_i8_token: m fp32 rows x (kp long) as int8 per token, stored as codes +
// 128 at dst + i * ld, their scales amax / 127 in scales[i]. w8a8_epilogue: one tile's
// int32 sums c [rows + 1][16] (row `rows`: the compensation) to out[i * ldo + r] =
// (accumulate ? out : 0) + float(c[i][r] - c[rows][r]) * x_scales[i] * w_scales[r]
// (the block's 16 per-channel scales in scale_type).
__attribute__((weak)) void quantize_rows_i8_token(const float* const* x, int m, int64_t kp,
                                                  uint8_t* dst, int64_t ld, float* scales);
__attribute__((weak)) void w8a8_epilogue(const int32_t* c, int rows, const float* x_scales,
                                         const void* w_scales, formats::ScaleType scale_type,
                                         bool accumulate, float* out, int64_t ldo);
// int4 (per channel or per group) on the w8a8 calls (brgemm::w4a8_dot, the same file).
// int4_to_s8_vnni: one int4 block's codes c (low plane [kp/8][16][4], quads 2l / 2l + 1
// in line l's low / high nibbles) as signed bytes c - 8 in brgemm's s8 B layout
// [kp/4][16][4] at dst. w4a8_epilogue: one tile's int32 sums c [rows + 1][16] (row
// `rows`: the compensation) to out[i * ldo + r], kt_ops' w4a8 tiles' fold of the same
// integer: acc = c[i][r] - c[rows][r] (+ 8 q_sums[i] with zero points: sum c q), then
// s_r * (float(acc) * x_scales[i]) (- zero_r * (x_scales[i] * q_sums[i])), added to out
// (an fma) where accumulate; s_r, zero_r: scale group `group` of the block ([G][16]; 0 per
// channel), q_sums: the rows' sums of q over that group's k; zeros nullptr: the implicit
// zero.
__attribute__((weak)) void int4_to_s8_vnni(const uint8_t* block, int64_t kp, int8_t* dst);
__attribute__((weak)) void w4a8_epilogue(const int32_t* c, int rows, const float* x_scales,
                                         const int32_t* q_sums, const void* scales,
                                         formats::ScaleType scale_type, const void* zeros,
                                         formats::ScaleType zero_type, int64_t group,
                                         bool accumulate, float* out, int64_t ldo);

// kt_ops' w8a8 tiles on AVX512_VNNI (kernels/avx512/w8a8_dp_avx512vnni.cpp, vpdpbusd
// under a function-level target; kernels/brgemm.h, kt_w8a8_runs): pack_w8a8_dp_rows
// writes the A operand (brgemm::w8a8_dp_bytes(m, kp) bytes) of m fp32 rows; null when
// the avx512 tier or the compiler's avx512vnni target is missing.
__attribute__((weak)) void w8a8_dp_dot(const DotArgs& a, const TileOperand& op);
__attribute__((weak)) void pack_w8a8_dp_rows(const float* const* x, int m, int64_t kp,
                                             uint8_t* dst);
__attribute__((weak)) void w4a8_dp_dot(const DotArgs& a, const TileOperand& op);
__attribute__((weak)) void pack_w4a8_dp_rows(const float* const* x, int m, int64_t kp,
                                             uint8_t* dst);

// int8 on the bf16 brgemm (kernels/avx512/int8_bf16_avx512.cpp). int8_to_bf16_vnni:
// one int8 block [kp/4][16][4] as its exact bf16 values in brgemm's VNNI layout
// [kp/2][16][2] at dst. scale_columns16: out[i * ldo + r] *= scales[r] (r < 16,
// i < m; the block's per-channel scales in scale_type).
__attribute__((weak)) void int8_to_bf16_vnni(const uint8_t* block, int64_t kp, uint16_t* dst);
__attribute__((weak)) void scale_columns16(float* out, int m, int64_t ldo, const void* scales,
                                           formats::ScaleType scale_type);

// The bf16 tile kernel of the compute-bound path on AVX512_BF16 CPUs without
// AMX (kernels/avx512/bf16_dp_avx512bf16.cpp, vdpbf16ps under a function-level
// target; a TileKernel of the tier table); null when the avx512 tier or the
// compiler's avx512bf16 target is missing.
// Its A operand (TileInput::kBf16Packed): bf16_dp_pack writes m bf16 rows (kp values,
// ld apart) as pack_pair_tiles' row tiles of kp / 2 pairs, bf16_dp_pack_bytes(m, kp) bytes.
__attribute__((weak)) void bf16_dp_dot(const DotArgs& a, const TileOperand& op);
__attribute__((weak)) int64_t bf16_dp_pack_bytes(int m, int64_t kp);
__attribute__((weak)) void bf16_dp_pack(const uint16_t* rows, int64_t ld, int m, int64_t kp,
                                        uint8_t* dst);

// The bf16 tile kernel for AMX CPUs (kernels/avx512/bf16_amx.cpp, AMX tiles under a
// function-level target; a TileKernel of the tier table): the same operands as
// oneDNN's bf16 kernel (TileInput::kBf16Rows, the packed [k_pairs][16][2] blocks).
// amx_tiles_permitted: whether Linux granted this process AMX's tile data (asked once).
// Null when the avx512 tier or the compiler's AMX target is missing.
__attribute__((weak)) bool amx_tiles_permitted();
__attribute__((weak)) void amx_bf16_dot(const DotArgs& a, const TileOperand& op);
// Two projections' one-block runs (a0, a1: gate and up of the same expert and rows, the same
// k and ldo) in one pass: TileKernel::dot_pair.
__attribute__((weak)) void amx_bf16_dot_pair(const DotArgs& a0, const DotArgs& a1,
                                             const TileOperand& op);
// int8 per channel times the bf16 rows, exactly, on the same tiles (each block's codes
// decoded to bf16 first, the channel scales on the outputs): oneDNN's int8_bf16 product.
__attribute__((weak)) void amx_int8_bf16_dot(const DotArgs& a, const TileOperand& op);
__attribute__((weak)) void amx_int8_bf16_dot_pair(const DotArgs& a0, const DotArgs& a1,
                                                  const TileOperand& op);
// int8 per channel on AMX tiles (kernels/avx512/w8a8_amx.cpp, tdpbssd): the w8a8 product
// (per-token int8 activations, full-K int32 sums, w8a8_epilogue), bit-identical to oneDNN's
// w8a8 kernel. Its A operand (TileInput::kI8TokenRows): pack_amx_w8a8_rows writes the m
// rows' scales, then their signed codes zero padded to a multiple of 64,
// amx_w8a8_bytes(m, kp) bytes.
__attribute__((weak)) int64_t amx_w8a8_bytes(int m, int64_t kp);
__attribute__((weak)) void pack_amx_w8a8_rows(const float* const* x, int m, int64_t kp,
                                              uint8_t* dst);
__attribute__((weak)) void amx_w8a8_dot(const DotArgs& a, const TileOperand& op);
__attribute__((weak)) void amx_w8a8_dot_pair(const DotArgs& a0, const DotArgs& a1,
                                             const TileOperand& op);
// int4 (per channel, or groups of 64 / 128) on the same tiles (oneDNN's w4a8 product, the
// same bits): pack_amx_w4a8_rows adds the rows' sums of q (over K, and per 32 k) for the
// zero points and the groups, amx_w4a8_bytes(m, kp) bytes.
__attribute__((weak)) int64_t amx_w4a8_bytes(int m, int64_t kp);
__attribute__((weak)) void pack_amx_w4a8_rows(const float* const* x, int m, int64_t kp,
                                              uint8_t* dst);
__attribute__((weak)) void amx_w4a8_dot(const DotArgs& a, const TileOperand& op);
__attribute__((weak)) void amx_w4a8_dot_pair(const DotArgs& a0, const DotArgs& a1,
                                             const TileOperand& op);

// The fp8 brgemm path (kernels/brgemm.h), AVX-512 code
// (kernels/avx512/brgemm_fp8_avx512.cpp). fp8_to_bf16_vnni: a block's E4M3
// codes [kp][16] as their exact bf16 values in brgemm's VNNI B layout with
// ldb columns, the block's 16 at dst (word ((k/2) * ldb + r) * 2 + k % 2);
// `next` (or nullptr) is prefetched to L2 meanwhile; vbmi = false forces the
// AVX512_BW decode on CPUs with AVX512_VBMI (tests); e8m0 (or nullptr): mxfp8's
// exponents of the block [kp/32][16], each row's values times 2^(E-127) (exact
// when fp8_e8m0_fits_bf16 holds for them). fp8_dp_block: out [m][16] (rows ldo
// apart) = the m bf16 rows (packed by pack_pair_tiles with kp / 2 pairs) times the
// block's values (fused decode-and-multiply tiles, AVX512_BF16 + VBMI; the block
// decoded once into `tile` for its later token tiles). scale_rows_to_bf16: the
// m fp32 rows x times the 128-k scales of one band, rounded to bf16, row i at
// dst + i * ld (AVX512_BF16).
__attribute__((weak)) void fp8_to_bf16_vnni(const uint8_t* codes, int64_t kp, uint16_t* dst,
                                            int64_t ldb, const uint8_t* next, bool vbmi,
                                            const uint8_t* e8m0 = nullptr);
__attribute__((weak)) void fp8_dp_block(const uint32_t* packed, int m, const uint8_t* codes,
                                        int64_t kp, uint16_t* tile, float* out, int64_t ldo,
                                        const uint8_t* e8m0 = nullptr,
                                        const float* chunk_scales = nullptr);
// True when a block's UE8M0 exponents ([groups][16]; rows [0, rows) looked at, the
// rest are padding) make every E4M3 value times 2^(E-127) a normal bf16 (E in
// [10, 246]; kernels/avx512/e4m3_decode.h).
__attribute__((weak)) bool fp8_e8m0_fits_bf16(const uint8_t* e8m0, int64_t groups, int rows);
// True when every UE8M0 exponent of a block ([groups][16], rows [0, rows)) lies in
// [lo, hi] (the same file; mxfp4's backward panels ask for [2, 252]).
__attribute__((weak)) bool e8m0_within(const uint8_t* e8m0, int64_t groups, int rows, int lo,
                                       int hi);
// mxfp4 on the bf16 brgemm (kernels/avx512/mxfp4_bf16_avx512.cpp): one block's E2M1
// codes ([kp/8][16][4]) and UE8M0 exponents ([kp/32][16]) as the values e2m1 * 2^(E-127)
// in bf16, brgemm's VNNI B layout with ldb columns (word ((k/2) * ldb + r) * 2 + k % 2);
// exact where e8m0_within(e8m0, kp / 32, rows, kMxfp4BfMinE, kMxfp4BfMaxE) holds (the
// caller checks). `next` (or nullptr) is prefetched to L2 meanwhile.
constexpr int kMxfp4BfMinE = 2;
constexpr int kMxfp4BfMaxE = 252;
__attribute__((weak)) void mxfp4_to_bf16_vnni(const uint8_t* codes, const uint8_t* e8m0, int64_t kp,
                                              uint16_t* dst, int64_t ldb, const uint8_t* next);
__attribute__((weak)) void scale_rows_to_bf16(const float* const* x, int m, int64_t kp,
                                              const float* scales, uint16_t* dst, int64_t ld);
// scale_rows_to_bf16_packed: the same bf16 values (kp a multiple of 32), packed as
// pack_pair_tiles packs bf16 rows (kp / 2 pairs per row).
__attribute__((weak)) void scale_rows_to_bf16_packed(const float* const* x, int m, int64_t kp,
                                                     const float* scales, uint32_t* dst);
// The exact qint tiles (kernels/avx512/qint_dp_avx512bf16.cpp, AVX512_BF16; kernels/
// brgemm.h, qint_dp_exact_dot; its rows rounded to bf16 by scale_rows_to_bf16 with unit
// scales, then packed by pack_pair_tiles with kp / 2 pairs). qint_dp_group_sums: the
// fp32 sums of those packed bf16 rows per group of group_k k, [m][kp / group_k].
// qint_dp_block: b.out [b.m][16] = the packed rows times the block's values: each
// group's fp32 sums of the exact products
// bf16(x) * code times the group's scales, minus its zeros times the rows' group sums xg
// (formats with zeros; else unused); `tile` (>= kp * 16 words) holds the decoded codes
// for the later token tiles, `params` (>= 2 * kp floats) the scales and zeros. False
// (nothing written) for a code width or group size it does not take.
__attribute__((weak)) void qint_dp_group_sums(const uint32_t* packed, int m, int64_t kp,
                                              int64_t group_k, float* sums);
__attribute__((weak)) bool qint_dp_block(const QintBlock& b, const uint32_t* packed,
                                         const float* xg, uint16_t* tile, float* params);
// The LoRA products of rank r, fp32 (kernels/avx512/lora_avx512.cpp; moe/lora_products.h):
// lora_xat: y [m, r] = x a^T (x [m, k], its row i at x[i]; a [r, k] rows lda apart);
// lora_tw: out [m, n] = (accumulate ? out : 0) + s t w (t [m, r], w [r, n] rows ldw apart,
// out's row i at out[i]), for each of nterms terms in order (the later ones accumulate);
// lora_dtx: g [r, k] = s d^T x (d [m, r] rows ldd apart, x [m, k] rows ldx apart).
// The _bf16 forms read x as bf16 values, widened exactly: the same results as on their
// fp32 copies.
__attribute__((weak)) void lora_xat(const float* const* x, int m, int64_t k, const float* a,
                                    int64_t lda, int r, float* y);
__attribute__((weak)) void lora_xat_bf16(const uint16_t* const* x, int m, int64_t k, const float* a,
                                         int64_t lda, int r, float* y);
__attribute__((weak)) void lora_tw(const LoraTwTerm* terms, int nterms, int m, int64_t n, float s,
                                   bool accumulate, float* const* out);
__attribute__((weak)) void lora_dtx(const float* d, int64_t ldd, int m, int r, const float* x,
                                    int64_t ldx, int64_t k, float s, float* g, int64_t ldg);
__attribute__((weak)) void lora_dtx_bf16(const float* d, int64_t ldd, int m, int r,
                                         const uint16_t* x, int64_t ldx, int64_t k, float s,
                                         float* g, int64_t ldg);
// The LoRA backward's products with the base on AVX512_BF16 without AMX (in
// kernels/avx512/bf16_dp_avx512bf16.cpp, beside the forward's tile kernel).
// pack_pair_tiles: m bf16 rows (2 k_pairs values, ld apart) as the row tiles of up to 28
// rows the kernel runs (near-equal, kernels/row_tiles.h), the tile of rows [i, i + mt)
// at dst + i * k_pairs as [k_pairs][mt] 32-bit pairs. bf16_dp_panel: out [m][16] (rows
// ldo apart) = (add ? out : 0) + those rows times w [k_pairs][16][2] (a 16-column VNNI
// panel slice), fp32 sums in k order per output; while the first row tile runs, the
// lines of `next` are prefetched to L2 (8 per 8 k pairs). chunk_scales (or nullptr):
// one per 64 k pairs, multiplying that chunk's fp32 sums (fp8's 128x128 block scales).
__attribute__((weak)) void pack_pair_tiles(const uint16_t* rows, int64_t ld, int m, int k_pairs,
                                           uint32_t* dst);
__attribute__((weak)) void bf16_dp_panel(const uint32_t* a_tiles, int m, const uint16_t* w,
                                         int k_pairs, float* out, int64_t ldo, bool add,
                                         const PrefetchChunks& next,
                                         const float* chunk_scales = nullptr);
// The LoRA backward's weight panels (kernels/avx512/bf16_vnni_panel_avx512.cpp): the
// columns 2 kp0 .. 2 kp0 + cols of one packed bf16 16-row block as brgemm's VNNI B
// operand over the rows, its 8 row pairs at dst + j * cols * 2 (cols a multiple of 16).
__attribute__((weak)) void bf16_vnni_panel_block(const uint16_t* block, int64_t kp0, int64_t cols,
                                                 uint16_t* dst);
// How a qint code q becomes a weight (docs/formats.md, qint): kSigned 8-bit s * q;
// kOffset s * (q - offset) (an implicit zero); kZeros s * q - z; kE2m1 (mxfp4, nvfp4)
// s * 2 e2m1(q); kIq4nl (iq4_nl, iq4_xs) s * kvalues_iq4nl[q].
enum class QintValue { kSigned, kOffset, kZeros, kE2m1, kIq4nl };
// Where a split panel's lines go: the columns in slices of `width` (a multiple of 16),
// slice i at base + i * slice_stride words, row pair j of a slice at + j * width * 2
// ([pairs][width][2] bf16); one slice of all the columns is one [pairs][cols][2] panel.
struct PanelSlices {
  int64_t width;
  int64_t slice_stride;
  // Column c (a multiple of 16) of row pair j.
  int64_t at(int64_t c, int j) const {
    return (c / width) * slice_stride + (c % width) * 2 + j * width * 2;
  }
};
// The split panel (moe/expert_weights.h, split_vnni_panel) of one 16-row block of qint
// codes (low plane `low`, 5/6-bit high plane `high`), columns [k0, k0 + cols) (k0, cols
// multiples of 16): its 8 row pairs at hi + out.at(c, j) for the columns c from k0 (and
// lo likewise, unless nullptr), of the values v (the scalar dense decoder's: a product,
// then a difference) as hi = bf16(v), lo = bf16(v - hi). s and z: the per-row scales
// (and zeros for kZeros) of each 16 columns, [cols / 16][16]. False (nothing written)
// for a code width / value form it does not decode. AVX512_BF16 code: the caller checks
// the CPU (moe/expert_weights.cpp, split_vnni_panel_applies;
// kernels/avx512/qint_columns_avx512.cpp).
__attribute__((weak)) bool qint_block_vnni_split(const uint8_t* low, const uint8_t* high, int bits,
                                                 QintValue value, int32_t offset, int64_t k0,
                                                 int64_t cols, const float* s, const float* z,
                                                 const PanelSlices& out, uint16_t* hi,
                                                 uint16_t* lo);
// One k-quant super-block record of 16 rows (formats/qint.h) as fp32 s[j * 16 + r] =
// d[r] * sc_j[r] and (q4_K / q5_K) z[j * 16 + r] = dmin[r] * m_j[r], j < 8 (q6_K: 16,
// no z): formats::kquant_param's values, 16 rows at once.
__attribute__((weak)) void kquant_record_params(const uint8_t* rec, formats::ScaleType t, float* s,
                                                float* z);
// The 16 stored scales (or zeros) at base[index ..] in fp32, fp16 or bf16 as fp32 out[16]
// (exact conversions: vcvtph2ps, a shift), for the split panels' groups.
__attribute__((weak)) void qint_params16(const void* base, formats::ScaleType t, int64_t index,
                                         float* out);
}  // namespace avx512

}  // namespace kt::kernels
