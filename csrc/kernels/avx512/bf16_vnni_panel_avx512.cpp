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

#include "kernels/avx512/vnni_pairs.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

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
