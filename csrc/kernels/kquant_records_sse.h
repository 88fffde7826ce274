// Decoding one GGUF k-quant scale record (formats/qint.h, docs/formats.md
// "k-quant scales") for the 16 rows of a block, shared by the x86 tiers:
// get_scale_min_k4 (ggml) on 16-byte vectors, one byte per row, then widened
// and scaled by the tier's traits V (V::F, V::kParts, V::kq_load_d,
// V::kq_widen_store: AVX2 two 8-lane halves, AVX-512 one 16-lane register).
// The byte work is SSE2, which every x86 tier has; the products d * sc and
// dmin * m are exact in fp32, so every tier yields the same values.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "formats/qint.h"

namespace kt::kernels {

// s[j * 16 + r] = d[r] * sc_j[r] and (q4_k, q5_k, q2_k) z[j * 16 + r] = dmin[r] * m_j[r].
// (q6_k, q3_k, iq4_xs write no z.)
template <class V>
inline void kquant_decode_records(const uint8_t* rec, formats::ScaleType t, float* s, float* z) {
  typename V::F d[V::kParts], dmin[V::kParts];
  V::kq_load_d(rec, d);
  if (formats::kquant_int8_scales(t)) {  // q6_K, q3_K (16 sub-blocks), IQ4_XS (8)
    const uint8_t* q = rec + formats::kKq6ScaleOffset;
    const int subs = static_cast<int>(formats::kquant_sub_blocks(t));
    for (int j = 0; j < subs; ++j)
      V::kq_widen_store(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j)), true, d,
                        s + 16 * j);
    return;
  }
  if (t == formats::ScaleType::kKq2) {  // sc_j | m_j << 4, one byte per row
    V::kq_load_d(rec + formats::kKq2MinOffset, dmin);
    const uint8_t* q = rec + formats::kKq2ScaleOffset;
    const __m128i m15 = _mm_set1_epi8(15);
    for (int j = 0; j < 16; ++j) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j));
      V::kq_widen_store(_mm_and_si128(b, m15), false, d, s + 16 * j);
      V::kq_widen_store(_mm_and_si128(_mm_srli_epi16(b, 4), m15), false, dmin, z + 16 * j);
    }
    return;
  }
  V::kq_load_d(rec + formats::kKq45MinOffset, dmin);
  const uint8_t* q = rec + formats::kKq45ScaleOffset;
  const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m48 = _mm_set1_epi8(0x30);
  for (int j = 0; j < 4; ++j) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * j));
    const __m128i mid = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * (j + 4)));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * (j + 8)));
    // (b >> 6) << 4 == (b >> 2) & 0x30; 16-bit shifts, masked to bits of the same byte.
    const __m128i sc_hi =
        _mm_or_si128(_mm_and_si128(hi, m15), _mm_and_si128(_mm_srli_epi16(lo, 2), m48));
    const __m128i mn_hi = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(hi, 4), m15),
                                       _mm_and_si128(_mm_srli_epi16(mid, 2), m48));
    V::kq_widen_store(_mm_and_si128(lo, m63), false, d, s + 16 * j);
    V::kq_widen_store(sc_hi, false, d, s + 16 * (j + 4));
    V::kq_widen_store(_mm_and_si128(mid, m63), false, dmin, z + 16 * j);
    V::kq_widen_store(mn_hi, false, dmin, z + 16 * (j + 4));
  }
}

}  // namespace kt::kernels
