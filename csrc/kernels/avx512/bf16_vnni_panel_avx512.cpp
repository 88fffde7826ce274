// The LoRA backward's bf16 weight panels for oneDNN's brgemm (moe/moe_lora.cpp,
// kernels::brgemm::bf16_gemm), AVX-512 code reached through a weak declaration
// (kernels/tiers.h): that path needs AVX512_BF16 or AMX anyway.
//
// The backward multiplies by W [n, k] with the reduction over n (go Wd, dg Wg): the B
// operand is VNNI over n, [n/2][cols][2] (rows 2j and 2j+1 of W side by side per
// column). The packed bf16 block (formats/bf16.h) holds 16 rows x 2 columns per
// 64-byte line, as 16 lanes of (k even, k odd): per 64-bit lane j (rows 2j, 2j+1) the
// 16-bit words (W[2j][c], W[2j][c+1], W[2j+1][c], W[2j+1][c+1]) become, by one byte
// shuffle, (W[2j][c], W[2j+1][c], W[2j][c+1], W[2j+1][c+1]): the panel's two words
// for columns c and c+1 of row pair j. Eight lines (16 columns), transposed 8 x 8 in
// 64-bit units, give each of the block's 8 row pairs 64 contiguous bytes. No rounding.
#include <immintrin.h>

#include <cstdint>

#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

namespace {

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

}  // namespace

void bf16_vnni_panel_block(const uint16_t* block, int64_t kp0, int64_t cols, uint16_t* dst) {
  // Word order inside each 64-bit lane: (0 1 2 3) -> (0 2 1 3).
  const __m512i swap =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15));
  for (int64_t c = 0; c < cols; c += 16) {
    __m512i r[8];
    const uint16_t* lines = block + (kp0 + c / 2) * 32;  // 16 rows x 2 words per line
    for (int q = 0; q < 8; ++q)
      r[q] = _mm512_shuffle_epi8(_mm512_loadu_si512(lines + q * 32), swap);
    transpose_8x8_epi64(r);
    for (int j = 0; j < 8; ++j) _mm512_storeu_si512(dst + (j * cols + c) * 2, r[j]);
  }
}

}  // namespace kt::kernels::avx512
