// mxfp4 on the bf16 brgemm (kernels/brgemm.h, mxfp4_dot): one 16-row block's E2M1 codes
// and UE8M0 exponents decoded to their values as bf16, in brgemm's VNNI B layout.
//
// An mxfp4 weight is e2m1(c) * 2^(E-127) (OCP Microscaling Formats v1.0, sections 5.3.3
// and 6.3): at most two significant bits times a power of two, so a bf16 value for every E
// in [kMxfp4BfMinE, kMxfp4BfMaxE] (the callers check a block's exponents first,
// e8m0_within, and compute a block outside on another kernel). The decode is integer work:
// the codes through a 16-entry table of bf16 words (E = 127), then E - 127 added to the
// exponent field of every nonzero word (kernels/avx512/e4m3_decode.h, as mxfp8's).
//
// Code layout (formats/qint.h): [kp/8][16][4], byte j of row r's dword in line l holds
// code k = 8 l + j in its low nibble and k = 8 l + 4 + j in its high one. The B layout:
// word ((k / 2) * ldb + r) * 2 + k % 2 holds W[r][k], so each line gives 4 pair lines.
#include <immintrin.h>

#include <cstdint>

#include "formats/qint.h"
#include "kernels/avx512/e4m3_decode.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

void mxfp4_to_bf16_vnni(const uint8_t* codes, const uint8_t* e8m0, int64_t kp, uint16_t* dst,
                        int64_t ldb, const uint8_t* next) {
  alignas(64) uint16_t table[32] = {};
  for (int c = 0; c < 16; ++c) {
    const float v = formats::e2m1_value(c) + 0.0f;  // -0 as +0, as the scalar decoder
    uint32_t bits;
    __builtin_memcpy(&bits, &v, 4);
    table[c] = static_cast<uint16_t>(bits >> 16);  // exact: two significant bits
  }
  const __m512i values = _mm512_load_si512(table);
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  // Per 128-bit lane (4 rows): bytes (0, 1) / (2, 3) of each row's dword as words.
  const __m512i pair01 = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1));
  const __m512i pair23 = _mm512_broadcast_i32x4(
      _mm_setr_epi8(2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1));
  __m512i off = _mm512_setzero_si512();
  const int64_t pair_line = 2 * ldb;  // words from one k pair to the next
  for (int64_t k = 0; k < kp; k += 8) {
    if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + k * 8), _MM_HINT_T1);
    e8m0_track_group(e8m0, k, off);
    const __m512i line = _mm512_loadu_si512(codes + k * 8);
    const __m512i lo = _mm512_and_si512(line, m4);                        // k + j
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(line, 4), m4);  // k + 4 + j
    auto value = [&](__m512i c) {
      return scale_bf16_pairs(_mm512_permutexvar_epi16(c, values), off);
    };
    uint16_t* d = dst + (k / 2) * pair_line;
    _mm512_storeu_si512(d, value(_mm512_shuffle_epi8(lo, pair01)));
    _mm512_storeu_si512(d + pair_line, value(_mm512_shuffle_epi8(lo, pair23)));
    _mm512_storeu_si512(d + 2 * pair_line, value(_mm512_shuffle_epi8(hi, pair01)));
    _mm512_storeu_si512(d + 3 * pair_line, value(_mm512_shuffle_epi8(hi, pair23)));
  }
}

}  // namespace kt::kernels::avx512
