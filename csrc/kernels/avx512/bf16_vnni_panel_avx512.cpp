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
//
// Weights that are not bf16 values (int4, k-quants, mxfp4: s * q - z) reach the same
// panel split: their fp32 values v as hi = bf16(v) and lo = bf16(v - hi), two bf16
// blocks whose sum is within 2^-17 |v| of v (f32_to_bf16_split_block).
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

// bf16 bits (round to nearest even) of 16 finite fp32 values u, in the high half of
// each 32-bit lane (the low half zero): the rounded value as fp32 bits.
inline __m512i round_to_bf16_high(__m512i u) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  return _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
}

}  // namespace

void f32_to_bf16_split_block(const float* src, int64_t ld, int64_t cols, uint16_t* hi,
                             uint16_t* lo) {
  // Words 2r, 2r + 1 of a line: the high halves of lane r of columns 2q and 2q + 1.
  const __m512i pick =
      _mm512_set_epi16(63, 31, 61, 29, 59, 27, 57, 25, 55, 23, 53, 21, 51, 19, 49, 17, 47, 15, 45,
                       13, 43, 11, 41, 9, 39, 7, 37, 5, 35, 3, 33, 1);
  for (int64_t q = 0; q < cols / 2; ++q) {
    const __m512 v0 = _mm512_loadu_ps(src + 2 * q * ld),
                 v1 = _mm512_loadu_ps(src + (2 * q + 1) * ld);
    const __m512i h0 = round_to_bf16_high(_mm512_castps_si512(v0));
    const __m512i h1 = round_to_bf16_high(_mm512_castps_si512(v1));
    _mm512_storeu_si512(hi + 32 * q, _mm512_permutex2var_epi16(h0, pick, h1));
    if (lo == nullptr) continue;
    // v - hi is exact in fp32 (hi is v rounded to 8 significant bits).
    const __m512 r0 = _mm512_sub_ps(v0, _mm512_castsi512_ps(h0));
    const __m512 r1 = _mm512_sub_ps(v1, _mm512_castsi512_ps(h1));
    const __m512i l0 = round_to_bf16_high(_mm512_castps_si512(r0));
    const __m512i l1 = round_to_bf16_high(_mm512_castps_si512(r1));
    _mm512_storeu_si512(lo + 32 * q, _mm512_permutex2var_epi16(l0, pick, l1));
  }
}

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
