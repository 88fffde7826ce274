// The AVX-512 parts of int8 on the bf16 brgemm (kernels/brgemm.h,
// int8_bf16_dot): a block's int8 codes decoded to their exact bf16 values in
// brgemm's VNNI layout, and the per-channel scales applied to the outputs.
//
// The int8 block is [kp/4][16][4] (docs/formats.md: each 64-byte line holds a
// k-quad of the 16 rows); the bf16 B operand is [kp/2][16][2]. So quad line q
// gives pair lines 2q (k0, k1 of every row) and 2q + 1 (k2, k3). Each code is
// sign-extended to int32, converted to fp32 (exact) and its upper 16 bits kept:
// exact, as |q| <= 128 needs at most 8 significant bits.
#include <immintrin.h>

#include "kernels/avx512/vec.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

namespace {

inline __m512i bf16_of_byte(__m512i v, int shift_left) {
  const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(v, shift_left), 24);
  return _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(q)), 16);
}

}  // namespace

void int8_to_bf16_vnni(const uint8_t* block, int64_t kp, uint16_t* dst) {
  for (int64_t q = 0; q < kp / 4; ++q) {
    const __m512i v = _mm512_loadu_si512(block + 64 * q);  // row r: bytes k0..k3 of the quad
    const __m512i k0 = bf16_of_byte(v, 24), k1 = bf16_of_byte(v, 16);
    const __m512i k2 = bf16_of_byte(v, 8), k3 = bf16_of_byte(v, 0);
    _mm512_storeu_si512(dst + 64 * q, _mm512_or_si512(k0, _mm512_slli_epi32(k1, 16)));
    _mm512_storeu_si512(dst + 64 * q + 32, _mm512_or_si512(k2, _mm512_slli_epi32(k3, 16)));
  }
}

void scale_columns16(float* out, int m, int64_t ldo, const void* scales,
                     formats::ScaleType scale_type) {
  const __m512 s = QintVec512<false>::load_scales(scales, scale_type, 0);
  for (int i = 0; i < m; ++i)
    _mm512_storeu_ps(out + i * ldo, _mm512_mul_ps(s, _mm512_loadu_ps(out + i * ldo)));
}

}  // namespace kt::kernels::avx512
