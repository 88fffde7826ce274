// The fp8 brgemm path (kernels/brgemm.h): the E4M3 codes of one 16-row block
// decoded to brgemm's bf16 VNNI B operand with the block scales folded in.
// AVX-512 code (F/BW, and AVX512_BF16 for the rounding, which every CPU that
// runs oneDNN's bf16 brgemm has); brgemm.cpp reaches it through a weak
// declaration (kernels/tiers.h): the path needs an AVX-512 tier anyway.
//
// The codes [kp][16] (formats/fp8.h, row inside the block last) become bf16
// [kp/2][16][2] (formats/bf16.h's packed block: k pairs per row), each value
// bf16(fp32(e4m3 * scale)), rounded to nearest even: the bits of torch's
// (w8.float() * scale).bfloat16(). The E4M3 value itself is built exactly as
// bf16 bits with integer operations (every E4M3 value is a bf16 value: 3
// mantissa bits, exponents -9..8):
//   normal (exponent field e > 0):  bf16 = s | (e + 120) << 7 | m << 4
//   subnormal (e == 0):             m * 2^-9 from an 8-entry table (a normal bf16)
// (the codes 0x7F / 0xFF, E4M3's NaN, which the packer rejects, decode to
// +-480 as in the streaming kernels' fp16 decode). Only the scale product is
// an FP operation, on normal inputs (MXCSR's DAZ cannot change it; FTZ only
// products below 2^-126).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "formats/fp8.h"
#include "kernels/avx512/vec.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

namespace {

// bf16 bits of the E4M3 subnormals m * 2^-9, m = 0..7 (index = low 5 bits of
// the code, whose exponent bits are 0 there); entries 8..31 are not used.
inline __m512i subnormal_table() {
  alignas(64) static const int16_t t[32] = {0x0000, 0x3B00, 0x3B80, 0x3BC0,
                                            0x3C00, 0x3C20, 0x3C40, 0x3C60};
  return _mm512_load_si512(t);
}

// 32 codes (k and k + 1 of the block's 16 rows, one 32-byte line, widened to
// words: k's rows in words 0..15, k + 1's in 16..31) -> their 32 exact bf16
// values, permuted by `index`.
inline __m512i decode_line(const uint8_t* line, __m512i index, __m512i table) {
  const __m512i b = _mm512_permutexvar_epi16(
      index, _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line))));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi16(0x7F));
  __m512i v = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(120 << 7));
  const __mmask32 sub = _mm512_testn_epi16_mask(b, _mm512_set1_epi16(0x78));
  v = _mm512_mask_permutexvar_epi16(v, sub, b, table);
  // v | (b << 8 & 0x8000): the sign (ternary-logic table of A | (B & C)).
  return _mm512_ternarylogic_epi32(v, _mm512_slli_epi16(b, 8),
                                   _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xF8);
}

// The permutation of decode_line for the VNNI pairs (k, r), (k + 1, r): the
// result should hold word (q % 2) * 16 + q / 2 at position q, but the
// unpacklo / unpackhi that follow (within 128-bit lanes) and cvtne2ps (b, then
// a) move word p to position q(p) = 4 (p / 8) + p % 8 for p % 8 < 4, else
// 16 + 4 (p / 8) + p % 8 - 4; so word p is the source word for q(p).
inline __m512i interleave_index() {
  alignas(64) static const int16_t idx[32] = {0,  16, 1,  17, 8,  24, 9,  25, 2,  18, 3,
                                              19, 10, 26, 11, 27, 4,  20, 5,  21, 12, 28,
                                              13, 29, 6,  22, 7,  23, 14, 30, 15, 31};
  return _mm512_load_si512(idx);
}

}  // namespace

// codes: one block [kp][16] (kp a multiple of 32); scales: its [ceil(k/128)]
// scales; dst: [kp/2][16][2] bf16 bits, W = bf16(fp32(e4m3 * scales[k / 128]))
// (vcvtne2ps2bf16: round to nearest even).
// `next` (may be nullptr): the block the caller decodes next, prefetched to
// L2 line by line along with this one's loads, so that its codes arrive
// while this block's brgemm calls run (the decode itself would otherwise
// wait on DRAM: between two decodes no load runs ahead of the brgemm).
// Prefetches never fault, so `next` may point past the experts' weights.
__attribute__((target("avx512bf16"))) void fp8_to_bf16_vnni_scaled(const uint8_t* codes, int64_t kp,
                                                                   const float* scales,
                                                                   uint16_t* dst,
                                                                   const uint8_t* next) {
  const __m512i index = interleave_index();
  const __m512i table = subnormal_table();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t k0 = 0; k0 < kp; k0 += formats::kFp8ScaleBlock) {
    const __m512 s = _mm512_set1_ps(scales[k0 / formats::kFp8ScaleBlock]);
    const int64_t k1 = std::min<int64_t>(kp, k0 + formats::kFp8ScaleBlock);
    for (int64_t kk = k0; kk < k1; kk += 2) {
      if (next != nullptr && (kk & 3) == 0)  // one 64-byte line per 4 k
        _mm_prefetch(reinterpret_cast<const char*>(next + kk * 16), _MM_HINT_T1);
      const __m512i v = decode_line(codes + kk * 16, index, table);
      // bf16 -> fp32: the word into the high half of a dword.
      const __m512 lo = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v)), s);
      const __m512 hi = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v)), s);
      _mm512_storeu_si512(dst + kk * 16, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    }
  }
}

}  // namespace kt::kernels::avx512
