// The fp8 brgemm path (kernels/brgemm.h), AVX-512 code reached through weak
// declarations (kernels/tiers.h): the path needs an AVX-512 tier anyway.
//
// 1. fp8_to_bf16_vnni: the E4M3 codes of one 16-row block [kp][16]
//    (formats/fp8.h, row inside the block last) -> their exact values as
//    bf16 in brgemm's VNNI B layout, k pairs per column: word
//    ((k / 2) * ldb + col0 + r) * 2 + k % 2 holds W[r][k]. Every E4M3 value is
//    a bf16 value, so this is pure integer work, no rounding
//    (kernels/avx512/e4m3_decode.h: with AVX512_VBMI two 128-entry byte
//    tables, 64 codes per step; without it (AVX512_BW only) the formula on
//    16-bit lanes, 32 codes per step, ~2x the instructions).
// 2. scale_rows_to_bf16: the activations times the 128-k block scales of one
//    128-row band, rounded once to bf16 (vcvtne2ps2bf16, AVX512_BF16): the
//    brgemm's A operand. The scales move from the weights to the activations
//    because a band's scale is one number per (band, 128-k block): for the
//    band's output rows, sum_k x[k] * (e4m3[k] * s[k/128]) = sum_k (x[k] *
//    s[k/128]) * e4m3[k]. The decode above then needs no FP work, and each
//    product carries one bf16 rounding (of x * s) where bf16(x) times
//    bf16(e4m3 * s) carried two.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "formats/fp8.h"
#include "kernels/avx512/e4m3_decode.h"
#include "kernels/avx512/vnni_pairs.h"
#include "kernels/row_tiles.h"
#include "kernels/tiers.h"
#include "runtime/cpu_features.h"

namespace kt::kernels::avx512 {

namespace {

using VbmiDecoder = E4m3VbmiDecoder<0>;

KT_E4M3_VBMI_TARGET void decode_vbmi(const uint8_t* codes, int64_t kp, uint16_t* dst, int64_t ldb,
                                     const uint8_t* next, const uint8_t* e8m0) {
  const VbmiDecoder dec;
  __m512i off = _mm512_setzero_si512();
  for (int64_t k = 0; k < kp; k += 4) {
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + k * 16), _MM_HINT_T1);
    __m512i p0, p1;
    dec.decode(codes + k * 16, p0, p1);
    if (e8m0 != nullptr) {
      e8m0_track_group(e8m0, k, off);
      p0 = scale_bf16_pairs(p0, off);
      p1 = scale_bf16_pairs(p1, off);
    }
    uint16_t* d = dst + (k / 2) * ldb * 2;
    _mm512_storeu_si512(d, p0);
    _mm512_storeu_si512(d + ldb * 2, p1);
  }
}

// The fused kernel for CPUs with AVX512_BF16 and VBMI (no AMX): one 16-row
// block times MT <= 28 scaled rows (bf16 pairs broadcast into vdpbf16ps from the
// rows packed per tile, pack_pair_tiles: one pointer, not MT of them),
// decoding the codes line by line as it goes; with First, it also stores the
// decoded lines to `tile` (for the block's later token tiles, which read it
// from L2 like bf16 weights) and prefetches the codes kPrefetchLines lines
// ahead: the prefetches spread through the multiply-adds, which hide DRAM
// latency where a burst of prefetches per block (or oneDNN's calls between
// them) did not.
constexpr int kFusedTileRows = kBf16TileRows;
constexpr int kFusedPrefetchLines = 16;  // 1 KB of codes ahead

#define KT_FP8_DP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi,avx512bf16")))

// What the decoded values are multiplied by, besides the A rows: mxfp8's
// exponents (added in the decode), or fp8's 128-k block scales of the block's
// band (chunk_scales: each 128-k chunk's sums, exact products of bf16(x) and
// the E4M3 values, times its scale in fp32), or nothing (the scales are on A).
struct FusedScales {
  const uint8_t* e8m0 = nullptr;
  const float* chunk_scales = nullptr;
};

enum class FusedMode { kPlain, kE8m0, kChunked };

template <int MT, bool First, FusedMode Mode>
KT_FP8_DP_TARGET void fused_tile(const uint32_t* a, const uint8_t* codes, uint16_t* tile,
                                 int64_t kp, float* out, int64_t ldo, const FusedScales& sc) {
  const VbmiDecoder dec;
  [[maybe_unused]] __m512i off = _mm512_setzero_si512();
  constexpr int64_t kChunk = formats::kFp8ScaleBlock;
  const int64_t kc = Mode == FusedMode::kChunked ? kChunk : kp;
  __m512 acc[MT];
  for (int64_t k0 = 0; k0 < kp; k0 += kc) {
    const int64_t k1 = std::min(kp, k0 + kc);
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 4) {
      __m512i w0, w1;
      if constexpr (First) {
        _mm_prefetch(reinterpret_cast<const char*>(codes + (k + 4 * kFusedPrefetchLines) * 16),
                     _MM_HINT_T0);
        dec.decode(codes + k * 16, w0, w1);
        if constexpr (Mode == FusedMode::kE8m0) {
          e8m0_track_group(sc.e8m0, k, off);
          w0 = scale_bf16_pairs(w0, off);
          w1 = scale_bf16_pairs(w1, off);
        }
        _mm512_storeu_si512(tile + k * 16, w0);
        _mm512_storeu_si512(tile + k * 16 + 32, w1);
      } else {
        w0 = _mm512_loadu_si512(tile + k * 16);
        w1 = _mm512_loadu_si512(tile + k * 16 + 32);
      }
      const uint32_t* a0 = a + (k / 2) * MT;  // pairs k / 2 and k / 2 + 1 of the MT rows
#pragma GCC unroll 32
      for (int i = 0; i < MT; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)w0,
                                  (__m512bh)_mm512_set1_epi32(static_cast<int>(a0[i])));
#pragma GCC unroll 32
      for (int i = 0; i < MT; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)w1,
                                  (__m512bh)_mm512_set1_epi32(static_cast<int>(a0[MT + i])));
    }
    if constexpr (Mode == FusedMode::kChunked) {
      const __m512 s = _mm512_set1_ps(sc.chunk_scales[k0 / kChunk]);
#pragma GCC unroll 32
      for (int i = 0; i < MT; ++i) {
        float* o = out + i * ldo;
        _mm512_storeu_ps(
            o, k0 == 0 ? _mm512_mul_ps(acc[i], s) : _mm512_fmadd_ps(acc[i], s, _mm512_loadu_ps(o)));
      }
    }
  }
  if constexpr (Mode != FusedMode::kChunked) {
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i) _mm512_storeu_ps(out + i * ldo, acc[i]);
  }
}

template <int N, bool First, FusedMode Mode>
KT_FP8_DP_TARGET void fused_tile_n(int rows, const uint32_t* a, const uint8_t* codes,
                                   uint16_t* tile, int64_t kp, float* out, int64_t ldo,
                                   const FusedScales& sc) {
  if constexpr (N >= 1) {
    if (rows == N) return fused_tile<N, First, Mode>(a, codes, tile, kp, out, ldo, sc);
    return fused_tile_n<N - 1, First, Mode>(rows, a, codes, tile, kp, out, ldo, sc);
  }
}

// BW: 32 codes (2 k x 16 rows, one 32-byte line) per step, widened to words
// and put in VNNI order (word q = code (q % 2) * 16 + q / 2) first.
__attribute__((target("avx512f,avx512bw"))) void decode_bw(const uint8_t* codes, int64_t kp,
                                                           uint16_t* dst, int64_t ldb,
                                                           const uint8_t* next,
                                                           const uint8_t* e8m0) {
  alignas(64) int16_t order[32];
  for (int q = 0; q < 32; ++q) order[q] = static_cast<int16_t>((q % 2) * 16 + q / 2);
  alignas(64) int16_t subnormal[32] = {};
  for (int m = 0; m < 8; ++m) subnormal[m] = static_cast<int16_t>(e4m3_magnitude_bf16(m));
  const __m512i index = _mm512_load_si512(order);
  const __m512i table = _mm512_load_si512(subnormal);
  __m512i off = _mm512_setzero_si512();
  for (int64_t k = 0; k < kp; k += 2) {
    if (next != nullptr && (k & 3) == 0)  // one 64-byte line per 4 k
      _mm_prefetch(reinterpret_cast<const char*>(next + k * 16), _MM_HINT_T1);
    const __m512i b = _mm512_permutexvar_epi16(
        index,
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + k * 16))));
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7F));
    __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
    const __mmask32 sub = _mm512_testn_epi16_mask(b, _mm512_set1_epi16(0x78));
    v = _mm512_mask_permutexvar_epi16(v, sub, b, table);
    v = _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(b, 8),
                                  _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
    if (e8m0 != nullptr) {
      e8m0_track_group(e8m0, k, off);
      v = scale_bf16_pairs(v, off);
    }
    _mm512_storeu_si512(dst + (k / 2) * ldb * 2, v);
  }
}

}  // namespace

void fp8_to_bf16_vnni(const uint8_t* codes, int64_t kp, uint16_t* dst, int64_t ldb,
                      const uint8_t* next, bool vbmi, const uint8_t* e8m0) {
  if (vbmi && runtime::cpu_features().avx512_vbmi)
    decode_vbmi(codes, kp, dst, ldb, next, e8m0);
  else
    decode_bw(codes, kp, dst, ldb, next, e8m0);
}

void fp8_dp_block(const uint32_t* packed, int m, const uint8_t* codes, int64_t kp, uint16_t* tile,
                  float* out, int64_t ldo, const uint8_t* e8m0, const float* chunk_scales) {
  const FusedScales sc{e8m0, chunk_scales};
  auto run = [&](auto mode_tag) {
    constexpr FusedMode kMode = decltype(mode_tag)::value;
    for_each_row_tile(m, kFusedTileRows, [&](int t, int i, int rows) {
      const uint32_t* a = packed + i * (kp / 2);
      if (t == 0)
        fused_tile_n<kFusedTileRows, true, kMode>(rows, a, codes, tile, kp, out, ldo, sc);
      else
        fused_tile_n<kFusedTileRows, false, kMode>(rows, a, codes, tile, kp, out + i * ldo, ldo,
                                                   sc);
    });
  };
  if (e8m0 != nullptr)
    run(std::integral_constant<FusedMode, FusedMode::kE8m0>{});
  else if (chunk_scales != nullptr)
    run(std::integral_constant<FusedMode, FusedMode::kChunked>{});
  else
    run(std::integral_constant<FusedMode, FusedMode::kPlain>{});
}

// Rows past a projection's N (zero codes, which stay zero whatever their exponent)
// are not looked at.
bool e8m0_within(const uint8_t* e8m0, int64_t groups, int rows, int lo_e, int hi_e) {
  const uint64_t r16 = rows >= 16 ? 0xFFFF : (uint64_t{1} << rows) - 1;
  const __mmask64 row_mask = r16 | r16 << 16 | r16 << 32 | r16 << 48;
  const __m512i mid = _mm512_set1_epi8(static_cast<char>(lo_e));
  __m512i lo = mid, hi = mid;
  const int64_t n = groups * 16;
  for (int64_t i = 0; i < n; i += 64) {
    const __mmask64 tail = n - i >= 64 ? ~__mmask64{0} : (__mmask64{1} << (n - i)) - 1;
    const __m512i v = _mm512_mask_loadu_epi8(mid, row_mask & tail, e8m0 + i);
    lo = _mm512_min_epu8(lo, v);
    hi = _mm512_max_epu8(hi, v);
  }
  return _mm512_cmplt_epu8_mask(lo, _mm512_set1_epi8(static_cast<char>(lo_e))) == 0 &&
         _mm512_cmpgt_epu8_mask(hi, _mm512_set1_epi8(static_cast<char>(hi_e))) == 0;
}

bool fp8_e8m0_fits_bf16(const uint8_t* e8m0, int64_t groups, int rows) {
  return e8m0_within(e8m0, groups, rows, kE8m0BfMin, kE8m0BfMax);
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void scale_rows_to_bf16_packed(
    const float* const* x, int m, int64_t kp, const float* scales, uint32_t* dst) {
  // kp is a multiple of 32: every 16 pairs are 32 k of one 128-k scale block.
  auto load = [&](int i, int64_t p0, __mmask16) __attribute__((target("avx512bf16"))) {
    const __m512 s = _mm512_set1_ps(scales[2 * p0 / formats::kFp8ScaleBlock]);
    const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(x[i] + 2 * p0), s);
    const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(x[i] + 2 * p0 + 16), s);
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
  };
  pack_row_tiles(m, kBf16TileRows, kp / 2, dst, load);
}

__attribute__((target("avx512f,avx512bw,avx512bf16"))) void scale_rows_to_bf16(
    const float* const* x, int m, int64_t kp, const float* scales, uint16_t* dst, int64_t ld) {
  for (int i = 0; i < m; ++i) {
    const float* src = x[i];
    uint16_t* d = dst + i * ld;
    for (int64_t k0 = 0; k0 < kp; k0 += formats::kFp8ScaleBlock) {
      const __m512 s = _mm512_set1_ps(scales[k0 / formats::kFp8ScaleBlock]);
      const int64_t k1 = std::min<int64_t>(kp, k0 + formats::kFp8ScaleBlock);
      for (int64_t k = k0; k < k1; k += 32) {  // kp is a multiple of 32
        const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(src + k), s);
        const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(src + k + 16), s);
        _mm512_storeu_si512(d + k, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
      }
    }
  }
}

}  // namespace kt::kernels::avx512
