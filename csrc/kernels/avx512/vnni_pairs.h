// Register helpers of the bf16 VNNI panels (kernels/avx512/bf16_vnni_panel_avx512.cpp,
// qint_columns_avx512.cpp): the 8 x 8 transpose of 64-bit lanes that turns lines of
// 16 rows into row pairs; and of the bf16 tiles' packed
// rows (bf16_dp_avx512bf16.cpp, brgemm_fp8_avx512.cpp): the 16 x 16 transpose of 32-bit
// lanes. AVX-512 F/BW; included only by files of the avx512 tier.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels/row_tiles.h"

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

// The 16 x 16 transpose of 32-bit lanes of r[0..15] (row i, lane j -> row j, lane i).
inline void transpose_16x16_epi32(__m512i r[16]) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {  // a[i] lane L: rows i, i + 1 of columns 4L, 4L + 1
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);  // ... of columns 4L + 2, 4L + 3
  }
  for (int i = 0; i < 16; i += 4) {  // b[i + c] lane L: rows i .. i + 3 of column 4L + c
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of b[c], b[4 + c], b[8 + c], b[12 + c]
    const __m512i t0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44);
    const __m512i t1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i t2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i t3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(t0, t2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(t1, t3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
  }
}

// Row tiles as kt_ops' bf16 tiles read them (pack_pair_tiles): for m rows of k_pairs
// 32-bit pairs, tile t of mt rows starting at row i0 (for_each_row_tile(m, max_rows)) is
// [k_pairs][mt] at dst + i0 * k_pairs. load(i, p0, mask) returns pairs p0 .. p0 + 15 of
// row i (the lanes past k_pairs, off in mask, zero); 16 rows at a time are transposed
// into 16 stores of 16 rows of one pair each.
template <class Load>
inline void pack_row_tiles(int m, int max_rows, int64_t k_pairs, uint32_t* dst, const Load& load) {
  for_each_row_tile(m, max_rows, [&](int, int i0, int mt) {
    uint32_t* d = dst + static_cast<int64_t>(i0) * k_pairs;
    for (int r0 = 0; r0 < mt; r0 += 16) {
      const int rows = mt - r0 < 16 ? mt - r0 : 16;
      const __mmask16 row_mask = static_cast<__mmask16>(rows == 16 ? 0xFFFF : (1u << rows) - 1);
      for (int64_t p0 = 0; p0 < k_pairs; p0 += 16) {
        const int64_t pairs = k_pairs - p0 < 16 ? k_pairs - p0 : 16;
        const __mmask16 pair_mask =
            static_cast<__mmask16>(pairs == 16 ? 0xFFFF : (1u << pairs) - 1);
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = i < rows ? load(i0 + r0 + i, p0, pair_mask) : _mm512_setzero_si512();
        transpose_16x16_epi32(r);
        for (int64_t j = 0; j < pairs; ++j)
          _mm512_mask_storeu_epi32(d + (p0 + j) * mt + r0, row_mask, r[j]);
      }
    }
  });
}

}  // namespace kt::kernels::avx512
