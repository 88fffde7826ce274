#include "formats/format_table.h"

#include <algorithm>

namespace kt::formats {

namespace {

QintFormat qint(int bits, bool is_signed, float zero_offset, CodeTable table = CodeTable::kNone) {
  QintFormat f;
  f.bits = bits;
  f.is_signed = is_signed;
  f.table = table;
  f.zero_offset = zero_offset;
  return f;
}

// The int8 panel a grid format's block decodes to (formats/grid.h): signed 8-bit codes
// with one fp32 scale per `group` k (32, or 16 for the types with scales per 16), which
// the qint kernels multiply.
QintFormat grid_panel(int64_t group) {
  QintFormat f = qint(8, true, 0.f);
  f.scale_type = ScaleType::kF32;
  f.group_size = group;
  return f;
}
const QintFormat kGridPanel = grid_panel(32);
const QintFormat kGridPanel16 = grid_panel(16);
// A grid format's GGUF block: 256 weights, grid_type_bytes bytes.
constexpr FormatRow::GgufBlock grid_block(GridType t) { return {kGridSuperK, grid_type_bytes(t)}; }

constexpr const char* kGgml = "llama.cpp / ggml block structs (ggml-common.h), repacked losslessly";
constexpr const char* kGgmlGrid =
    "llama.cpp / ggml i-quant block structs and grids (ggml-common.h), held as stored";

// Break-even token counts of the fp32 path measured on AVX2 (Zen 3) at the
// Qwen3-30B-A3B shape: decoding a block to fp32 costs about as much as a few
// tokens' dot products, after which fp32 FMAs beat fp8's in-register decode
// (~8 tokens) and the int8 sign trick (~16). 4/5/6-bit codes multiply faster
// as integers at any count. On the VNNI tier (Fp32Class::kVnni: vpdpbusd on
// u8 activations, kernels/qint_tiles.h) the 8-bit q8 kernel beats the fp32
// path at every count measured: fp32/q8 2.9 (4 tokens per expert), 3.1 (8),
// 2.8 (16), 2.7 (32), 2.5 (64), 2.4 (96), 2.5 (128) for int8, 2.0-2.7 for
// q8_0 (Zen 4, 2 threads, H=2048, I=768): never there. (On Zen 4 the sign
// trick also wins: avx512 fp32/q8 1.9 (8) .. 1.3 (64), avx2 1.5 .. 1.0 (64);
// kBase keeps Zen 3's 16.)
constexpr int kFp8Fp32Min = 8;
constexpr int kInt8Fp32Min = 16;
constexpr Fp32Policy kNoFp32 = {{kNoFp32Path, kNoFp32Path}};
// fp8 with the E4M3 decoded by byte tables (kVnni: AVX-512 with VBMI), fp32 path /
// streaming, fp32 activations, Zen 4 (2 threads, 8 experts of H=2048, I=768):
// 2.36 (4), 1.75 (8), 1.34 (16), 1.16 (32), 1.05 (64), 1.00 (128): never.
constexpr Fp32Policy kFp8Fp32 = {{kFp8Fp32Min, kNoFp32Path}};
constexpr Fp32Policy kInt8Fp32 = {{kInt8Fp32Min, kNoFp32Path}};

// Formats without a brgemm path (yet): always the streaming kernels.
constexpr BrgemmPolicy kNoBrgemmPath = {{kNoBrgemm, kNoBrgemm, kNoBrgemm}};
// bf16 x bf16 -> fp32 on the brgemm path against the streaming fp32-FMA
// kernel, tokens per expert (benchmarks/bench_compute_paths.py, docs/formats.md
// "Compute paths"), Zen 4 (AVX512_BF16, 2 threads, H=2048, I=768). AVX512_BF16
// without AMX runs kt_ops' own vdpbf16ps tiles (kernels/avx512/
// bf16_dp_avx512bf16.cpp): brgemm/streaming 0.94-0.98 (4), 0.72-0.98 (6),
// 0.76-0.87 (8), 0.69-0.72 (10), 0.64 (32). On oneDNN's brgemm (the AMX
// class's kernel; AMX itself not measured, no AMX host) both were bound by
// the weight stream up to ~10 tokens (1.00-1.08), brgemm won from 12
// (0.93-0.97), 16 (0.83-0.85), 32 (0.77).
// AMX (Intel Xeon, 2 threads, 8 experts hot in L3; bench_compute_paths.py, 2026-12-02):
// oneDNN's brgemm 0.95 (4), 0.76 (8), 0.44 (12), 0.47 (16), 0.37 (32), 0.31 (64); kt_ops'
// AMX tiles (kernels/avx512/bf16_amx.cpp, the class's kernel since; gate and up in one
// pass) 0.97 (2), 1.01 (4), 0.92 (6), 0.80 (8), 0.48 (12), 0.47 (16), 0.34 (32): from 8.
// On an Intel Xeon with AVX512_BF16 / FP16 and no AMX (kAvx512Intel: vdpbf16ps at a
// quarter of the FMA's instruction rate), the same tiles against the same streaming
// kernel: 1.53 (8), 1.42 (16), 1.46 (32), 1.48 (64), 1.38 (128); oneDNN's bf16 brgemm
// 1.55 (8) to 1.44 (128); a layer at T = 512 / 2048 1.25x / 1.46x faster streaming:
// never.
constexpr int kBf16BrgemmMinAvx512 = 8;
constexpr int kBf16BrgemmMinAvx512Intel = kNoBrgemm;
constexpr int kBf16BrgemmMinAmx = 8;
constexpr BrgemmPolicy kBf16Brgemm = {
    {kBf16BrgemmMinAvx512, kBf16BrgemmMinAvx512Intel, kBf16BrgemmMinAmx}};
// u8 x s8 -> s32 brgemm (q8 activations, K chunks of 32, bit-identical to the
// streaming q8 kernels) against the streaming q8 kernel of the avx512_vnni
// tier (u8 activations, per-line compensation, kernels/qint_tiles.h), tokens
// per expert, Zen 4 (AVX512_VNNI, 2 threads, H=2048, I=768): brgemm/streaming
// int8 2.16 (4), 1.98 (8), 1.84 (16), 1.53 (32), 1.34 (64), 1.46 (96), 1.41
// (128), 1.37 (256), 1.38 (512); q8_0 2.34 (4), 1.90 (8), 1.73 (16), 1.52
// (32), 1.31 (64), 1.37 (96), 1.35 (128), 1.36 (256). Streaming wins at every
// count measured, so 'auto' never takes it on AVX512_VNNI (forced 'brgemm'
// still runs it). AMX (tdpbusd) not measured: the earlier AVX-512 value, 16.
// int8 under quant 'auto' runs a w8a8 kernel instead (full-K sums, per-token
// activations; kernels/brgemm.h). oneDNN's: 1.59 (2), 1.14 (16), 0.96 (32), 0.92
// (64), 0.86 (128) against streaming on Zen 4, a layer at T = 2048 1.13x faster:
// too little for the coarser rounding. kt_ops' vpdpbusd tiles (the avx512 class's
// kernel on AVX512_VNNI CPUs, kernels/avx512/w8a8_dp_avx512vnni.cpp): 1.25 (2),
// 1.28 (6), 1.01-1.02 (8), 0.86 (10), 0.84 (12), 0.80-0.84 (16), 0.72-0.81 (24-32),
// 0.80 (64), 0.82 (128); a layer 1.33x (T = 512) and 1.27x (T = 2048) faster: from
// 10 tokens. AMX (Intel Xeon, 2 threads, 2026-12-02): oneDNN's w8a8 on tdpbusd 1.15 (4),
// 0.99 (8), 0.78 (12), 0.67 (16), 0.58 (32), 0.53 (64); kt_ops' AMX tiles (kernels/avx512/
// w8a8_amx.cpp, the class's kernel since, gate and up in one pass) 1.19 (4), 1.10 (8), 0.95
// (10), 0.84 (12), 0.67 (16), 0.56 (32): from 10.
// The Intel Xeon without AMX (the same tiles, vpdpbusd at full rate there): 1.00 (4),
// 0.83 (8), 0.82 (10), 0.70 (16), 0.78 (32), 0.81 (128): from 8.
constexpr int kInt8BrgemmMinAvx512 = 10;
constexpr int kInt8BrgemmMinAvx512Intel = 8;
constexpr int kInt8BrgemmMinAmx = 10;
constexpr BrgemmPolicy kInt8Brgemm = {
    {kInt8BrgemmMinAvx512, kInt8BrgemmMinAvx512Intel, kInt8BrgemmMinAmx}};
// int4 with one scale per output channel (group_size 0) on kt_ops' w4a8 tiles
// (per-token int8 activations, full-K int32 sums; kernels/avx512/w8a8_dp_avx512vnni.cpp)
// against the streaming q8 kernel, Zen 4 (AVX512_VNNI, 2 threads, H=2048, I=768):
// 1.14 (2), 0.87 (4), 0.76 (6), 0.79 (8), 0.75 (10-16), 0.74 (32-64), 0.76 (128):
// from 4 tokens. int4 with groups and every other 4-bit format stream (the per-group
// fold costs more there; TileKernel::applies_to). AMX runs oneDNN's w4a8 (the codes
// decoded to signed bytes per block, then int8's w8a8 calls on AMX tiles; with groups of
// 64 or 128 one call per group), measured on a Xeon with AMX (2 threads, 2026-12-02): per
// channel 1.51 (4), 1.10 (8), 0.70 (16), 0.64 (32), 0.60 (64); g128 2.53 (4), 1.72 (8),
// 1.20 (16), 1.00 (32), 0.90 (64) (a layer at T = 512 / 2048: 65.0 / 199 against 65.6 /
// 260 ms streaming). On kt_ops' AMX tiles (kernels/avx512/w8a8_amx.cpp, the class's kernel
// since: the codes decoded once per block, gate and up in one pass) per channel 1.58 (4),
// 1.09 (8), 0.85 (12), 0.72 (16), 0.56 (32); g128 1.25 (8), 0.89 (16), 0.85 (24), 0.79
// (32), 0.67 (64): from 12, per channel's break-even (g128 about even there). oneDNN's grouped calls on Zen 4 (forced): g128 1.2-3.0x the streaming
// kernel's time from 4 to 128 tokens (docs/formats.md).
// The Intel Xeon without AMX: 1.55 (2), 1.11 (4), 1.03 (6), 0.86 (8), 0.72 (16), 0.74
// (64): from 8.
constexpr int kInt4BrgemmMinAvx512 = 4;
constexpr int kInt4BrgemmMinAvx512Intel = 8;
constexpr int kInt4BrgemmMinAmx = 12;
constexpr BrgemmPolicy kInt4Brgemm = {
    {kInt4BrgemmMinAvx512, kInt4BrgemmMinAvx512Intel, kInt4BrgemmMinAmx}};
constexpr int kQ80BrgemmMinAvx512 = kNoBrgemm;
constexpr int kQ80BrgemmMinAmx = 16;
constexpr BrgemmPolicy kQ80Brgemm = {{kQ80BrgemmMinAvx512, kQ80BrgemmMinAvx512, kQ80BrgemmMinAmx}};
// fp8 (the activations times the block scales rounded to bf16, times the
// codes' exact bf16 values, kernels/brgemm.h) against the AVX2 streaming kernels
// under 'auto' (the in-register E4M3 kernel below fp32_min_tokens = 8, the
// weight-only fp32 path from there), tokens per expert, Zen 4 (AVX512_BF16 and
// VBMI, 2 threads, H=2048, I=768; interleaved runs, brgemm/streaming). kt_ops'
// fused decode-and-multiply tiles (the avx512 class on such CPUs):
// 1.18-1.22 (1), 1.00-1.06 (2), 0.71 (3), 0.60-0.65 (4), 0.44-0.49 (6),
// 0.37-0.41 (8), 0.44-0.48 (16), 0.50 (32), 0.51-0.52 (64). On oneDNN's bf16
// brgemm (the AMX class's kernel, and AVX512_BF16 CPUs without VBMI), same
// runs: 1.80 (1), 1.53 (2), 0.92 (3), 0.94 (4), 0.72 (6), 0.59 (8). AMX (oneDNN's kernel
// on AMX tiles, Intel Xeon, 2 threads, 2026-12-02): 2.83 (2), 2.19 (4), 1.40 (6), 1.22 (8),
// 0.71 (16), 0.40 (32), 0.35 (64): from 12.
// Against the streaming kernel of AVX-512 with VBMI (E4M3 by byte tables, kernels/avx512/
// fp8_avx512.cpp), same host, fp8: 1.31 (2), 1.21 (3), 1.07 (4), 0.74 (5), 0.73 (6); mxfp8
// on the same tiles, its exponents in the decode: 1.57 (1), 1.33 (2), 1.20-1.21 (3),
// 1.07-1.09 (4), 0.74 (5), 0.71-0.73 (6), 0.42 (8), 0.51 (64): from 5. (CPUs with
// AVX512_BF16 but no VBMI, Cooper Lake, would take oneDNN's from 3 against the AVX2
// streaming kernel; not measured, the class keeps one value.)
// The Intel Xeon without AMX (the fused tiles' vdpbf16ps at a quarter rate there), fp8
// against 'auto' streaming: 1.25 (8), 1.01 (32), 0.99 (128): never.
constexpr int kFp8BrgemmMinAvx512 = 5;
constexpr int kFp8BrgemmMinAvx512Intel = kNoBrgemm;
constexpr int kFp8BrgemmMinAmx = 12;
constexpr BrgemmPolicy kFp8Brgemm = {
    {kFp8BrgemmMinAvx512, kFp8BrgemmMinAvx512Intel, kFp8BrgemmMinAmx}};
// mxfp4 on oneDNN's bf16 brgemm (its exact values decoded per pair of blocks, bf16
// activations; kernels/brgemm.h, mxfp4_dot) against the streaming q8 kernel of the
// avx512_vnni tier, 8 experts of m tokens (Zen 4, oneDNN's AVX512_BF16 kernel forced):
// 2.87 (4), 2.24 (8), 1.79 (16), 1.68 (32), 1.54 (64), 1.50 (128): never. AMX (tdpbf16ps,
// Intel Xeon, 2 threads, 2026-12-02): 2.53 (4), 1.67 (8), 1.31 (12), 0.99-1.05 (16), 0.74
// (32), 0.59 (64); a layer at T = 512 (about 32 tokens per expert) 72.5 against 69.6 ms
// streaming, at T = 2048 186 against 270: from 32.
constexpr int kMxfp4BrgemmMinAvx512 = kNoBrgemm;
constexpr int kMxfp4BrgemmMinAmx = 32;
constexpr BrgemmPolicy kMxfp4Brgemm = {
    {kMxfp4BrgemmMinAvx512, kMxfp4BrgemmMinAvx512, kMxfp4BrgemmMinAmx}};

}  // namespace

int FormatRow::bits() const {
  switch (layout) {
    case Layout::kBf16:
      return 16;
    case Layout::kFp8:
      return 8;
    case Layout::kQint:
      break;
    case Layout::kGrid:  // the nominal bits of the type's name (iq2_xxs: 2)
      return static_cast<int>(bits_per_weight);
  }
  return qint.bits;
}

bool FormatRow::group_size_allowed(int64_t g) const {
  return std::find(group_sizes.begin(), group_sizes.end(), g) != group_sizes.end();
}

const std::vector<FormatRow>& format_table() {
  using L = Layout;
  using S = ScaleType;
  using Z = ZeroPolicy;
  using A = ActType;
  // clang-format off
  static const std::vector<FormatRow> rows = {
      {"bf16", L::kBf16, {}, {0}, 0, S::kNone, Z::kNever, A::kF32, kNoFp32, kBf16Brgemm, 16.0,
       "bfloat16 weights (round to nearest even)"},
      {"int8", L::kQint, qint(8, true, 0.f), {0}, 0, S::kF32, Z::kNever, A::kQ8,
       kInt8Fp32, kInt8Brgemm, 8.0, "symmetric per-channel int8 (scale = amax/127)"},
      // group_size 0: one scale (and zero) per output channel (kt-kernel AMXINT4 / AMXINT4_1).
      {"int4", L::kQint, qint(4, false, 8.f), {0, 32, 64, 128}, 128, S::kF16,
       Z::kOptional, A::kQ8, kNoFp32, kInt4Brgemm, 4.125,
       "int4 per group or per output channel, symmetric or asymmetric (GPTQ/AWQ-style zero point)"},
      {"fp8", L::kFp8, {}, {128}, 128, S::kF32, Z::kNever, A::kF32, kFp8Fp32, kFp8Brgemm, 8.0,
       "E4M3 (Micikevicius et al. 2022) with DeepSeek-V3 128x128 weight_scale_inv"},
      // E4M3 with a scale per output channel (FP8-dynamic exports; fp8's tile path with unit
      // band scales, the row scales applied to the outputs, fp8's thresholds) or per 32
      // along K (OCP MXFP8: fp8's tile path with unit band scales, the exponents moved
      // into the decoded bf16 values; fp8's thresholds).
      {"fp8_channel", L::kFp8, {}, {0}, 0, S::kF32, Z::kNever, A::kF32, kFp8Fp32, kFp8Brgemm,
       8.0, "E4M3 with one fp32 scale per output channel (FP8-dynamic, compressed-tensors)",
       {}, true},
      {"mxfp8", L::kFp8, {}, {32}, 32, S::kE8M0, Z::kNever, A::kF32, kFp8Fp32, kFp8Brgemm,
       8.25, "OCP Microscaling Formats (MX) v1.0: E4M3 elements, UE8M0 scales, 32 per block",
       {}, true},
      // OCP MX: E2M1 codes, one UE8M0 exponent per 32; kernel codes 2v + 12. Also GGUF's
      // MXFP4 block (gpt-oss GGUF files: the exponent byte and q4_0's nibbles, ggml's
      // kvalues_mxfp4 = 2 * E2M1 against 2^(e - 128): the same values), repacked as stored.
      {"mxfp4", L::kQint, qint(4, false, 12.f, CodeTable::kE2m1), {32}, 32, S::kE8M0, Z::kNever, A::kQ8,
       kNoFp32, kMxfp4Brgemm, 4.25,
       "OCP Microscaling Formats (MX) v1.0: E2M1 elements, UE8M0 scales, 32 per block",
       {32, 17}},
      // NVIDIA NVFP4: E2M1 codes, one E4M3 scale per 16 times a per-tensor fp32 scale. Stored
      // as one fp32 scale per 16 (half the product, for the kernel codes 2v + 12): exact. Also
      // GGUF's NVFP4 block (64 weights: 4 UE4M3 scales, then q4_0's nibble order per 16; no
      // per-tensor scale), repacked as exactly; 6 bits a weight here against GGUF's 4.5.
      {"nvfp4", L::kQint, qint(4, false, 12.f, CodeTable::kE2m1), {16}, 16, S::kF32, Z::kNever, A::kQ8,
       kNoFp32, kNoBrgemmPath, 6.0,
       "NVIDIA NVFP4 (E2M1 elements, E4M3 scale per 16, fp32 per-tensor scale), fp32 scales",
       {64, 36}},
      {"q8_0", L::kQint, qint(8, true, 0.f), {32}, 32, S::kF16, Z::kNever, A::kQ8,
       kInt8Fp32, kQ80Brgemm, 8.5, kGgml, {32, 34}},
      {"q4_0", L::kQint, qint(4, false, 8.f), {32}, 32, S::kF16, Z::kNever, A::kQ8,
       kNoFp32, kNoBrgemmPath, 4.5, kGgml, {32, 18}},
      // GGUF's legacy block types, which llama.cpp's k-quant mixes fall back to where a
      // row is not a multiple of 256 (Q4_K -> Q5_0, Q5_K -> Q5_1, llama-quant.cpp): the
      // 1408-wide down projections of DeepSeek-V2-Lite and GLM-4.5-Air, gpt-oss' 2880-wide
      // gate / up. q4_1 / q5_1 hold their min m as the zero (W = d*q + m = d*q - (-m), fp16
      // like d), q5_0 its implicit zero 16; the same sizes as GGUF's, exact.
      {"q4_1", L::kQint, qint(4, false, 0.f), {32}, 32, S::kF16, Z::kRequired, A::kQ8,
       kNoFp32, kNoBrgemmPath, 5.0, kGgml, {32, 20}},
      {"q5_0", L::kQint, qint(5, false, 16.f), {32}, 32, S::kF16, Z::kNever, A::kQ8,
       kNoFp32, kNoBrgemmPath, 5.5, kGgml, {32, 22}},
      {"q5_1", L::kQint, qint(5, false, 0.f), {32}, 32, S::kF16, Z::kRequired, A::kQ8,
       kNoFp32, kNoBrgemmPath, 6.0, kGgml, {32, 24}},
      // k-quants: GGUF's own super-block scales (d, dmin fp16 per 256, 6-bit / int8
      // sub-scales), one record per 16 rows x 256 k (formats/qint.h); the q4_K/q5_K
      // mins are inside the record, so there is no zeros tensor. q2_K and q3_K keep their
      // codes in 2-bit planes (q3_K's third bit in a high plane, as 5-bit codes') and their
      // scales in records (q3_K: q6_K's, its 6-bit scales as int8 sc - 32; q2_K: its own
      // bytes): exact, the same values as ggml's; 2.625 and 3.5625 bits a weight (GGUF's
      // 2.625 / 3.4375).
      {"q2_k", L::kQint, qint(2, false, 0.f), {16}, 16, S::kKq2, Z::kNever, A::kQ8,
       kNoFp32, kNoBrgemmPath, 2.625, kGgml, {256, 84}},
      {"q3_k", L::kQint, qint(3, false, 4.f), {16}, 16, S::kKq6, Z::kNever, A::kQ8,
       kNoFp32, kNoBrgemmPath, 3.5625, kGgml, {256, 110}},
      {"q4_k", L::kQint, qint(4, false, 0.f), {32}, 32, S::kKq45, Z::kNever, A::kQ8,
       kNoFp32, kNoBrgemmPath, 4.5, kGgml, {256, 144}},
      {"q5_k", L::kQint, qint(5, false, 0.f), {32}, 32, S::kKq45, Z::kNever, A::kQ8,
       kNoFp32, kNoBrgemmPath, 5.5, kGgml, {256, 176}},
      {"q6_k", L::kQint, qint(6, false, 32.f), {16}, 16, S::kKq6, Z::kNever, A::kQ8,
       kNoFp32, kNoBrgemmPath, 6.5625, kGgml, {256, 210}},
      // i-quants with IQ4_NL's non-linear grid: 4-bit codes through its table of signed
      // values (CodeTable::kIq4nl), multiplied as 8-bit signed codes; IQ4_NL a fp16 d per
      // 32 (q4_0's groups), IQ4_XS GGUF's super-block scales in records (kKiq4: d and
      // 6-bit sub-scales per 32 as int8). The same sizes as GGUF's, exact.
      {"iq4_nl", L::kQint, qint(4, true, 0.f, CodeTable::kIq4nl), {32}, 32, S::kF16, Z::kNever,
       A::kQ8, kNoFp32, kNoBrgemmPath, 4.5, kGgml, {32, 18}},
      {"iq4_xs", L::kQint, qint(4, true, 0.f, CodeTable::kIq4nl), {32}, 32, S::kKiq4, Z::kNever,
       A::kQ8, kNoFp32, kNoBrgemmPath, 4.3125, kGgml, {256, 136}},
      // i-quants on lattice grids (formats/grid.h): GGUF's bytes as stored, each 16-row
      // block decoded to an int8 panel (signed codes, an fp32 scale per 32, or per 16 for
      // IQ1_M / IQ2_XS / IQ2_S: exact) that the signed 8-bit kernels multiply, so int8's
      // fp32-path policy; no tile path yet. The sizes of GGUF's blocks (1.5625 - 3.4375
      // bits a weight), exact.
      {"iq1_s", L::kGrid, kGridPanel, {32}, 32, S::kNone, Z::kNever, A::kQ8,
       kInt8Fp32, kNoBrgemmPath, 1.5625, kGgmlGrid, grid_block(GridType::kIq1s), false, GridType::kIq1s},
      {"iq1_m", L::kGrid, kGridPanel16, {16}, 16, S::kNone, Z::kNever, A::kQ8,
       kInt8Fp32, kNoBrgemmPath, 1.75, kGgmlGrid, grid_block(GridType::kIq1m), false, GridType::kIq1m},
      {"iq2_xxs", L::kGrid, kGridPanel, {32}, 32, S::kNone, Z::kNever, A::kQ8,
       kInt8Fp32, kNoBrgemmPath, 2.0625, kGgmlGrid, grid_block(GridType::kIq2xxs), false, GridType::kIq2xxs},
      {"iq2_xs", L::kGrid, kGridPanel16, {16}, 16, S::kNone, Z::kNever, A::kQ8,
       kInt8Fp32, kNoBrgemmPath, 2.3125, kGgmlGrid, grid_block(GridType::kIq2xs), false, GridType::kIq2xs},
      {"iq2_s", L::kGrid, kGridPanel16, {16}, 16, S::kNone, Z::kNever, A::kQ8,
       kInt8Fp32, kNoBrgemmPath, 2.5625, kGgmlGrid, grid_block(GridType::kIq2s), false, GridType::kIq2s},
      {"iq3_xxs", L::kGrid, kGridPanel, {32}, 32, S::kNone, Z::kNever, A::kQ8,
       kInt8Fp32, kNoBrgemmPath, 3.0625, kGgmlGrid, grid_block(GridType::kIq3xxs), false, GridType::kIq3xxs},
      {"iq3_s", L::kGrid, kGridPanel, {32}, 32, S::kNone, Z::kNever, A::kQ8,
       kInt8Fp32, kNoBrgemmPath, 3.4375, kGgmlGrid, grid_block(GridType::kIq3s), false, GridType::kIq3s},
  };
  // clang-format on
  return rows;
}

const FormatRow* find_format(const std::string& name) {
  for (const FormatRow& f : format_table())
    if (name == f.name) return &f;
  return nullptr;
}

std::string known_format_names() {
  std::string names;
  for (const FormatRow& f : format_table()) {
    if (!names.empty()) names += ", ";
    names += f.name;
  }
  return names;
}

}  // namespace kt::formats
