// fp8 streaming kernels (fp8, fp8_channel, mxfp8), AVX-512 tier with
// AVX512_VBMI: the E4M3 codes of one 16-row block decoded in registers to
// exact fp32 by byte-table lookups, times fp32 activations. They serve
// experts with few tokens (decode). The AVX2 kernel's decode (fp16 bit moves
// and F16C, 8 lanes) bounded it below a core's share of DRAM bandwidth.
// Measured on Zen 4 (2 threads, Qwen3-30B-A3B layer, cold weights, bench_formats.py):
// T = 1 fp8 1.23-1.41 ms against 1.41-1.56 on AVX2 (2.0x bf16's time
// against 1.6-1.8x), mxfp8 1.23-1.38 against 2.65; with the weights hot in
// L3, 0.79x the AVX2 kernel's time. An AVX512_BW decode without VBMI (sign
// extension, shifts and vcvtph2ps, 12 ops a line) measured 0.86-0.98x the
// AVX2 kernel's time there and was not kept: CPUs without VBMI (Skylake-SP,
// Cascade Lake) run the AVX2 kernel (fp8_kernels() below).
//
// SHAPES  block [Kp][16] E4M3 bytes (row inside the block last; one 64-byte
//         line = 4 k x 16 rows); scales: one per 128 k (fp8's band) or
//         [G][16] per row and group of group_k k (fp8_channel, mxfp8);
//         m fp32 activation rows; out[i * ldo + r], r < 16.
// DEFINITION
//   for i < m, r < 16: acc = 0
//     for each scale group g:
//       even = sum_{k in g, k even} w'[r][k] * x_i[k]   (fp32 FMAs in k order)
//       odd  = sum_{k in g, k odd}  w'[r][k] * x_i[k]
//       acc  = fma(even + odd, 2^8 * scale[g][r], acc)
//   with w' = e4m3 * 2^-8 exactly: the AVX2 kernel's operations on the same
//   fp32 numbers, so both tiers give bit-identical results, and a token's
//   result does not depend on its tile (pinned paths stay batch-invariant).
// DECODE  per 64-byte line, into 4 zmm (one k of 16 rows each): the byte
//   tables of e4m3_decode.h (Shift 8) to bf16 VNNI pairs, then fp32 =
//   pair << 16 (k even) and pair & 0xFFFF0000 (k odd): 10 ops and 4 FMAs
//   per token. More independent FMA chains (4 a token) measured no faster:
//   the decode, not the FMA latency, bounds a lone token.
// REGISTER PLAN  tiles of up to kTile tokens: per token 2 chains (even, odd)
//   and 1 accumulator; 4 decoded weight vectors; the decoder's 6 constants.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "formats/fp8.h"
#include "kernels/avx512/e4m3_decode.h"
#include "kernels/block_args.h"
#include "kernels/kernel_api.h"
#include "kernels/tiers.h"
#include "runtime/cpu_features.h"

namespace kt::kernels::avx512 {

namespace {

// Every function on the decode's path carries the VBMI target (the tier's
// flags stop at AVX-512 F/BW/VL/DQ); fp8_kernels() checks the CPU first.
#define KT_FP8_INLINE inline __attribute__((always_inline)) KT_E4M3_VBMI_TARGET

using Decoder = E4m3VbmiDecoder<8>;

// The 16 row scales of group g of a row-scaled block, times 2^8 (w' carries 2^-8).
KT_FP8_INLINE __m512 group_row_scales(const Fp8Block& a, int64_t g) {
  if (a.row_scale_type == formats::ScaleType::kE8M0) {
    // UE8M0 byte E -> 2^(E-127) * 2^8: the fp32 bits (E + 8) << 23 (E = 0 included;
    // E >= 247 overflows to inf, as the scalar product would).
    const auto* e = static_cast<const uint8_t*>(a.row_scales) + g * 16;
    const __m512i ex = _mm512_min_epi32(
        _mm512_add_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e))),
                         _mm512_set1_epi32(8)),
        _mm512_set1_epi32(255));
    return _mm512_castsi512_ps(_mm512_slli_epi32(ex, 23));
  }
  return _mm512_mul_ps(_mm512_loadu_ps(static_cast<const float*>(a.row_scales) + g * 16),
                       _mm512_set1_ps(256.0f));
}

// One line (4 k x 16 rows) -> w'[k .. k + 3], 16 rows each.
KT_FP8_INLINE void decode_line(const Decoder& dec, const uint8_t* line, __m512* w) {
  __m512i p0, p1;
  dec.decode(line, p0, p1);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(p0, 16));
  w[1] = _mm512_castsi512_ps(_mm512_and_si512(p0, high));
  w[2] = _mm512_castsi512_ps(_mm512_slli_epi32(p1, 16));
  w[3] = _mm512_castsi512_ps(_mm512_and_si512(p1, high));
}

// Tokens [i0, i0 + M) of one block. RowScaled: one scale per row and group of
// group_k k (fp8_channel, mxfp8), else one per 128 k (the band's). First: the
// block's first token tile, which prefetches the code stream (later tiles
// find it in cache).
template <int M, bool RowScaled, bool First>
KT_FP8_INLINE void fp8_tile(const Decoder& dec, const Fp8Block& a, int i0) {
  const float* const* x = a.x_rows + i0;
  const int64_t step = RowScaled ? a.group_k : formats::kFp8ScaleBlock;  // a multiple of 32
  __m512 acc[M];
  for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < a.kp; k0 += step) {
    const int64_t k1 = std::min(a.kp, k0 + step);  // kp is a multiple of 32
    __m512 even[M], odd[M];
    for (int i = 0; i < M; ++i) even[i] = odd[i] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 4) {
      const uint8_t* line = a.block + k * 16;
      if constexpr (First) {  // distances of kernels/qint_tiles.h
        __builtin_prefetch(line + 2048, 0, 3);
        __builtin_prefetch(line + 8192, 0, 2);
      }
      __m512 w[4];
      decode_line(dec, line, w);
      for (int i = 0; i < M; ++i) {
        even[i] = _mm512_fmadd_ps(w[0], _mm512_set1_ps(x[i][k]), even[i]);
        odd[i] = _mm512_fmadd_ps(w[1], _mm512_set1_ps(x[i][k + 1]), odd[i]);
        even[i] = _mm512_fmadd_ps(w[2], _mm512_set1_ps(x[i][k + 2]), even[i]);
        odd[i] = _mm512_fmadd_ps(w[3], _mm512_set1_ps(x[i][k + 3]), odd[i]);
      }
    }
    const __m512 s = RowScaled ? group_row_scales(a, k0 / step)
                               : _mm512_set1_ps(a.scales[k0 / formats::kFp8ScaleBlock] * 256.0f);
    for (int i = 0; i < M; ++i) acc[i] = _mm512_fmadd_ps(_mm512_add_ps(even[i], odd[i]), s, acc[i]);
  }
  for (int i = 0; i < M; ++i) _mm512_storeu_ps(a.out + (i0 + i) * a.ldo, acc[i]);
}

constexpr int kTile = 4;  // tokens: 12 accumulators + 4 weights + 6 decoder constants

template <bool RowScaled, bool First, int N = kTile>
KT_FP8_INLINE void fp8_tile_n(int rows, const Decoder& dec, const Fp8Block& a, int i0) {
  if constexpr (N >= 1) {
    if (rows == N) return fp8_tile<N, RowScaled, First>(dec, a, i0);
    return fp8_tile_n<RowScaled, First, N - 1>(rows, dec, a, i0);
  }
}

// The m rows in tiles of near-equal size (the split of kernels/row_tiles.h,
// written out: a lambda would not carry this function's target).
template <bool RowScaled>
KT_E4M3_VBMI_TARGET void fp8_block_dot(const Decoder& dec, const Fp8Block& a) {
  const int tiles = (a.m + kTile - 1) / kTile;
  if (tiles == 0) return;
  const int base = a.m / tiles, extra = a.m % tiles;
  for (int t = 0, i = 0; t < tiles; ++t) {
    const int rows = base + (t < extra ? 1 : 0);
    if (t == 0)
      fp8_tile_n<RowScaled, true>(rows, dec, a, i);
    else
      fp8_tile_n<RowScaled, false>(rows, dec, a, i);
    i += rows;
  }
}

KT_E4M3_VBMI_TARGET void fp8_run(const DotArgs& a) {
  const Decoder dec;
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const Fp8Block b = fp8_block(a, nb);
    if (b.row_scales != nullptr)
      fp8_block_dot<true>(dec, b);
    else
      fp8_block_dot<false>(dec, b);
  }
}

}  // namespace

// The explicit fallback: without AVX512_VBMI, the AVX2 tier's kernels. The
// weight-only fp32 path (a block decoded to fp32, then fp32 FMAs) is the AVX2 tier's.
const ProjectionKernels& fp8_kernels() {
  static const ProjectionKernels k{"avx512/fp8_vbmi",
                                   &fp8_run,
                                   avx2::fp8_kernels().dot_fp32,
                                   avx2::fp8_kernels().fp32_name,
                                   nullptr,
                                   formats::Fp32Class::kVnni};
  return runtime::cpu_features().avx512_vbmi ? k : avx2::fp8_kernels();
}

}  // namespace kt::kernels::avx512
