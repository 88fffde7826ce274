// Register helpers of the bf16 VNNI panels (kernels/avx512/bf16_vnni_panel_avx512.cpp,
// qint_columns_avx512.cpp): the 8 x 8 transpose of 64-bit lanes that turns lines of
// 16 rows into row pairs, and the rounding of fp32 to bf16. AVX-512 F/BW; included
// only by files of the avx512 tier.
#pragma once

#include <immintrin.h>

namespace kt::kernels::avx512 {

// The 8 x 8 transpose of 64-bit lanes of r[0..7] (row q, lane j -> row j, lane q).
inline void transpose_8x8_epi64(__m512i r[8]) {
  __m512i t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm512_unpacklo_epi64(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi64(r[i], r[i + 1]);
  }
  // t[0] = rows 0, 1 of columns 0, 2, 4, 6; t[1] = of columns 1, 3, 5, 7; t[2], t[3]
  // rows 2, 3, ... Gather 4 rows per column pair:
  __m512i u[8];
  const __m512i lo2 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
  const __m512i hi2 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
  for (int i = 0; i < 2; ++i) {
    u[i] = _mm512_permutex2var_epi64(t[i], lo2, t[i + 2]);
    u[i + 2] = _mm512_permutex2var_epi64(t[i], hi2, t[i + 2]);
    u[i + 4] = _mm512_permutex2var_epi64(t[i + 4], lo2, t[i + 6]);
    u[i + 6] = _mm512_permutex2var_epi64(t[i + 4], hi2, t[i + 6]);
  }
  // u[0] = rows 0-3 of columns 0 and 2, u[1] = of columns 1 and 3, u[2] = of columns 4
  // and 6, u[3] = of 5 and 7; u[4..7] the same for rows 4-7. Join the halves.
  const __m512i lo4 = _mm512_set_epi64(11, 10, 9, 8, 3, 2, 1, 0);
  const __m512i hi4 = _mm512_set_epi64(15, 14, 13, 12, 7, 6, 5, 4);
  r[0] = _mm512_permutex2var_epi64(u[0], lo4, u[4]);
  r[1] = _mm512_permutex2var_epi64(u[1], lo4, u[5]);
  r[2] = _mm512_permutex2var_epi64(u[0], hi4, u[4]);
  r[3] = _mm512_permutex2var_epi64(u[1], hi4, u[5]);
  r[4] = _mm512_permutex2var_epi64(u[2], lo4, u[6]);
  r[5] = _mm512_permutex2var_epi64(u[3], lo4, u[7]);
  r[6] = _mm512_permutex2var_epi64(u[2], hi4, u[6]);
  r[7] = _mm512_permutex2var_epi64(u[3], hi4, u[7]);
}

// bf16 bits (round to nearest even) of 16 finite fp32 values u, in the high half of
// each 32-bit lane (the low half zero): the rounded value as fp32 bits.
inline __m512i round_to_bf16_high(__m512i u) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

}  // namespace kt::kernels::avx512
