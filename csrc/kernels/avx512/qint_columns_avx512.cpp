// The LoRA backward's split panels of the qint formats (moe/expert_weights.cpp,
// split_vnni_panel): 16 columns of one 16-row block of codes decoded to fp32, one
// register per column (16 rows), the same values as the scalar dense decoder
// (dequantize_qint_transposed: a product, then a difference, no FMA) at 16 lanes.
//
// Code layout (formats/qint.h, kernels/qint_tiles.h): 8-bit codes [Kp/4][16][4] (row r's
// 4 consecutive k in lane r of a line); 4/5/6-bit codes [Kp/8][16][4] in the low plane
// (byte j of lane r: low nibble k = 8 l + j, high nibble k = 8 l + 4 + j), and for 5/6
// bits a high plane after it (one line per 32 / 16 k: bit (or bit pair) of k at
// 8 j + (k % 32) / 4 (+ 1 for the high nibble's half), resp. 8 j + 2 ((k % 16) / 4)).
#include <immintrin.h>

#include <cstdint>

#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

namespace {

// The 16 rows' codes of column k of a 4/5/6-bit block as int32 lanes.
template <int Bits>
inline __m512i nibble_codes(const uint8_t* low, const uint8_t* high, int64_t k) {
  const __m512i line = _mm512_loadu_si512(low + (k / 8) * 64);
  const int j = static_cast<int>(k % 4), half = static_cast<int>((k % 8) / 4);
  __m512i q = _mm512_and_si512(_mm512_srl_epi32(line, _mm_cvtsi32_si128(8 * j + 4 * half)),
                               _mm512_set1_epi32(15));
  if (Bits == 5 || Bits == 6) {
    const int64_t per_line = Bits == 5 ? 32 : 16;
    const __m512i hl = _mm512_loadu_si512(high + (k / per_line) * 64);
    // Bit position as the scalar decoder's: 8 j + shift of the 8-k word kw holding k
    // (5-bit (kw % 32) / 4, + half; 6-bit 2 ((kw % 16) / 4), + 2 half).
    const int64_t kw = k - k % 8;
    const int hs = Bits == 5 ? static_cast<int>((kw % 32) / 4) + half
                             : static_cast<int>(2 * ((kw % 16) / 4)) + 2 * half;
    const __m512i hb = _mm512_and_si512(_mm512_srl_epi32(hl, _mm_cvtsi32_si128(8 * j + hs)),
                                        _mm512_set1_epi32(Bits == 5 ? 1 : 3));
    q = _mm512_or_si512(q, _mm512_slli_epi32(hb, 4));
  }
  return q;
}

template <int Bits, QintValue A>
void columns(const uint8_t* low, const uint8_t* high, int32_t offset, int64_t k0, const float* s,
             const float* z, float* dst) {
  const __m512 sv = _mm512_loadu_ps(s);
  const __m512 zv = A == QintValue::kZeros ? _mm512_loadu_ps(z) : _mm512_setzero_ps();
  // mxfp4: E2M1 code c -> 2 e2m1(c) (magnitudes 0, 1, 2, 3, 4, 6, 8, 12, bit 3 the sign;
  // -0 as +0, as the scalar decoder's integer form).
  const __m512 e2m1 = _mm512_setr_ps(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m512i off = _mm512_set1_epi32(offset);
  for (int c = 0; c < 16; ++c) {
    const int64_t k = k0 + c;
    __m512i q;
    if (Bits == 8) {
      const __m512i line = _mm512_loadu_si512(low + (k / 4) * 64);
      q = _mm512_srai_epi32(_mm512_sll_epi32(line, _mm_cvtsi32_si128(24 - 8 * (k % 4))), 24);
    } else {
      q = nibble_codes<Bits>(low, high, k);
    }
    __m512 v;
    if (A == QintValue::kSigned) {
      v = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(q));
    } else if (A == QintValue::kOffset) {
      v = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, off)));
    } else if (A == QintValue::kZeros) {
      v = _mm512_sub_ps(_mm512_mul_ps(sv, _mm512_cvtepi32_ps(q)), zv);
    } else {
      v = _mm512_mul_ps(sv, _mm512_permutexvar_ps(q, e2m1));
    }
    _mm512_storeu_ps(dst + c * 16, v);
  }
}

}  // namespace

bool qint_columns_f32(const uint8_t* low, const uint8_t* high, int bits, QintValue value,
                      int32_t offset, int64_t k0, const float* s, const float* z, float* dst) {
  switch (bits) {
    case 8:
      if (value != QintValue::kSigned) return false;
      columns<8, QintValue::kSigned>(low, high, offset, k0, s, z, dst);
      return true;
    case 4:
      switch (value) {
        case QintValue::kOffset:
          columns<4, QintValue::kOffset>(low, high, offset, k0, s, z, dst);
          return true;
        case QintValue::kZeros:
          columns<4, QintValue::kZeros>(low, high, offset, k0, s, z, dst);
          return true;
        case QintValue::kE2m1:
          columns<4, QintValue::kE2m1>(low, high, offset, k0, s, z, dst);
          return true;
        default:
          return false;
      }
    case 5:
    case 6: {
      const bool five = bits == 5;
      if (value == QintValue::kOffset) {
        (five ? columns<5, QintValue::kOffset> : columns<6, QintValue::kOffset>)(low, high, offset,
                                                                                 k0, s, z, dst);
        return true;
      }
      if (value == QintValue::kZeros) {
        (five ? columns<5, QintValue::kZeros> : columns<6, QintValue::kZeros>)(low, high, offset,
                                                                               k0, s, z, dst);
        return true;
      }
      return false;
    }
    default:
      return false;
  }
}

}  // namespace kt::kernels::avx512
