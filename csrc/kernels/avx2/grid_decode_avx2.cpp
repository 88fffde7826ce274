// The grid formats' panel decode (formats/grid.h), AVX2 tier: the same int8 panel as
// formats::grid_decode_block, byte for byte, with a group's 32 codes made in one register
// (its grid entries and sign masks loaded by index, the signs applied bytewise) and four
// rows' groups transposed into the panel's lines of 4-byte quads, where the scalar decode
// flips signs in 64-bit words and stores each row's 4-byte quads one by one.
// Measured on Zen 3 (one thread, T = 1, a Qwen3-30B-A3B layer's 8 routed experts, the
// scalar decode as built before this file, two alternating rounds on a noisy host): the
// op's time x0.58-0.74 for iq1_s / iq1_m, x0.70-0.76 iq2_s, x0.84-0.99 iq2_xs, x0.90-1.09
// iq2_xxs, x0.76-1.06 iq3_xxs / iq3_s. Hardware gathers (vpgatherdq / vpgatherdd) for the
// lookups ran 1.1-1.3x slower than scalar loads.
#include <immintrin.h>

#include "formats/grid_blocks.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx2 {

namespace {

using formats::GridType;
using namespace formats::grid_blocks;

// table[idx[l]] as qword l, for the four int32 indices idx: four loads (a vpgatherdq of
// the four ran 1.1-1.3x slower on Zen 3).
inline __m256i lookup64(const uint64_t* table, __m128i idx) {
  return _mm256_setr_epi64x(static_cast<long long>(table[_mm_cvtsi128_si32(idx)]),
                            static_cast<long long>(table[_mm_extract_epi32(idx, 1)]),
                            static_cast<long long>(table[_mm_extract_epi32(idx, 2)]),
                            static_cast<long long>(table[_mm_extract_epi32(idx, 3)]));
}

// Four qwords of two 4-value entries each: qword l = table[i(2l)] | table[i(2l + 1)] << 32
// (IQ3_XXS / IQ3_S), for an index function i; eight loads (a vpgatherdd of the eight ran
// 1.3x slower on Zen 3).
template <class Index>
inline __m256i lookup32_pairs(const uint32_t* table, Index i) {
  uint64_t q[4];
  for (int l = 0; l < 4; ++l)
    q[l] = table[i(2 * l)] | static_cast<uint64_t>(table[i(2 * l + 1)]) << 32;
  return _mm256_setr_epi64x(static_cast<long long>(q[0]), static_cast<long long>(q[1]),
                            static_cast<long long>(q[2]), static_cast<long long>(q[3]));
}

inline __m128i bytes4(const uint8_t* p) {
  return _mm_cvtepu8_epi32(_mm_cvtsi32_si128(load_u32(p)));
}

// Minus-sign masks (0xFF bytes) of four sign bytes: byte l of `bits` holds the signs of
// weights 8l .. 8l + 7 (bit j: weight 8l + j), spread to qword l and tested bit by bit
// (IQ2_S, IQ3_S; the 7-bit signs with their parity come from kSignMasks.even instead: the
// vector parity was no faster).
inline __m256i sign_masks(uint32_t bits) {
  const __m256i spread =
      _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                          _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2,
                                           2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ull));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// The four 7-bit fields at bits 7l of `a` as int32 lanes.
inline __m128i fields7v(uint32_t a) {
  return _mm_and_si128(
      _mm_srlv_epi32(_mm_set1_epi32(static_cast<int>(a)), _mm_setr_epi32(0, 7, 14, 21)),
      _mm_set1_epi32(127));
}

// (v ^ m) - m: v negated where the byte of m is 0xFF.
inline __m256i apply_signs(__m256i v, __m256i m) {
  return _mm256_sub_epi8(_mm256_xor_si256(v, m), m);
}

// The 32 codes of group ib of block `b` (byte j: weight j), grid_blocks::group_codes' in
// one register.
template <GridType T>
inline __m256i group_codes(const uint8_t* b, int ib) {
  if constexpr (T == GridType::kIq2xxs) {
    return apply_signs(lookup64(kIq2xxsGrid, bytes4(b + 2 + 8 * ib)),
                       lookup64(kSignMasks.even, fields7v(load_u32(b + 2 + 8 * ib + 4))));
  } else if constexpr (T == GridType::kIq2xs) {
    const __m128i v =
        _mm_cvtepu16_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * ib)));
    return apply_signs(lookup64(kIq2xsGrid, _mm_and_si128(v, _mm_set1_epi32(511))),
                       lookup64(kSignMasks.even, _mm_srli_epi32(v, 9)));
  } else if constexpr (T == GridType::kIq2s) {
    const __m128i high =
        _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(b[2 + 64 + ib]), _mm_setr_epi32(0, 2, 4, 6)),
                      _mm_set1_epi32(3));
    const __m128i idx = _mm_or_si128(bytes4(b + 2 + 4 * ib), _mm_slli_epi32(high, 8));
    return apply_signs(lookup64(kIq2sGrid, idx), sign_masks(load_u32(b + 34 + 4 * ib)));
  } else if constexpr (T == GridType::kIq3xxs) {
    const uint8_t* qs = b + 2 + 8 * ib;
    return apply_signs(lookup32_pairs(kIq3xxsGrid, [&](int j) { return qs[j]; }),
                       lookup64(kSignMasks.even, fields7v(load_u32(b + 2 + 64 + 4 * ib))));
  } else if constexpr (T == GridType::kIq3s) {
    const uint8_t* qs = b + 2 + 8 * ib;
    const uint32_t qh = b[2 + 64 + ib];
    return apply_signs(
        lookup32_pairs(kIq3sGrid, [&](int j) { return qs[j] | (((qh >> j) & 1u) << 8); }),
        sign_masks(load_u32(b + 2 + 64 + 8 + 4 * ib)));
  } else if constexpr (T == GridType::kIq1m) {
    // The 4-bit fields of qh[2 ib], qh[2 ib + 1]: 3 index bits and the delta's sign.
    const __m128i h = _mm_and_si128(
        _mm_srlv_epi32(_mm_set1_epi32(load_u16(b + 32 + 2 * ib)), _mm_setr_epi32(0, 4, 8, 12)),
        _mm_set1_epi32(15));
    const __m128i idx =
        _mm_or_si128(bytes4(b + 4 * ib), _mm_slli_epi32(_mm_and_si128(h, _mm_set1_epi32(7)), 8));
    const __m128i minus = _mm_cmpeq_epi32(_mm_and_si128(h, _mm_set1_epi32(8)), _mm_set1_epi32(8));
    // per 8 weights: +1 bytes, or -1 (0xFF) where the delta is negative
    const __m256i delta = _mm256_or_si256(_mm256_cvtepi32_epi64(minus), _mm256_set1_epi8(1));
    return _mm256_add_epi8(lookup64(kIq1sGrid, idx), delta);
  } else {  // kIq1s
    const uint32_t qh = load_u16(b + 2 + 32 + 2 * ib);
    const __m128i high = _mm_and_si128(
        _mm_srlv_epi32(_mm_set1_epi32(static_cast<int>(qh)), _mm_setr_epi32(0, 3, 6, 9)),
        _mm_set1_epi32(7));
    const __m128i idx = _mm_or_si128(bytes4(b + 2 + 4 * ib), _mm_slli_epi32(high, 8));
    return _mm256_add_epi8(lookup64(kIq1sGrid, idx),
                           _mm256_set1_epi64x(static_cast<long long>(delta_bytes(qh >> 15))));
  }
}

// formats::grid_decode_block for type T: per super-block, four rows at a time, each
// group's codes of the four rows (dword j: quad j) transposed so that quad j of the four
// rows is one 16-byte run of panel line 8g + j; the scales as the scalar decode.
template <GridType T>
void decode_block(const uint8_t* block, int64_t kp, uint8_t* panel) {
  constexpr int S = kScalesPerGroup<T>;
  const int64_t tb = formats::grid_type_bytes(T);
  const int64_t supers = kp / formats::kGridSuperK;
  auto* scales = reinterpret_cast<float*>(panel + 16 * kp);
  float s[S];
  for (int64_t sb = 0; sb < supers; ++sb) {
    for (int r0 = 0; r0 < 16; r0 += 4) {
      const uint8_t* b[4];
      float d[4];
      for (int i = 0; i < 4; ++i) {
        b[i] = block + ((r0 + i) * supers + sb) * tb;
        d[i] = _cvtsh_ss(block_d_bits<T>(b[i]));
      }
      for (int ib = 0; ib < 8; ++ib) {
        const int64_t g = sb * 8 + ib;  // group of 32 k
        __m256i c[4];
        for (int i = 0; i < 4; ++i) {
          c[i] = group_codes<T>(b[i], ib);
          group_scales<T>(b[i], d[i], ib, s);
          for (int h = 0; h < S; ++h) scales[(g * S + h) * 16 + r0 + i] = s[h];
        }
        // 4 x 8 dwords -> per quad j the 4 rows' dwords: t (rows 0,1 / 2,3 interleaved),
        // then u[j % 4] = quads j (low lane) and j + 4 (high lane) of rows 0-3.
        const __m256i t0 = _mm256_unpacklo_epi32(c[0], c[1]),
                      t1 = _mm256_unpackhi_epi32(c[0], c[1]);
        const __m256i t2 = _mm256_unpacklo_epi32(c[2], c[3]),
                      t3 = _mm256_unpackhi_epi32(c[2], c[3]);
        const __m256i u[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                              _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
        uint8_t* line = panel + (8 * g * 16 + r0) * 4;
        for (int j = 0; j < 4; ++j) {
          _mm_storeu_si128(reinterpret_cast<__m128i*>(line + j * 64), _mm256_castsi256_si128(u[j]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(line + (j + 4) * 64),
                           _mm256_extracti128_si256(u[j], 1));
        }
      }
    }
  }
}

}  // namespace

void grid_decode_block(GridType t, const uint8_t* block, int64_t kp, uint8_t* panel) {
  with_type(t, [&](auto type) { decode_block<decltype(type)::value>(block, kp, panel); });
}

}  // namespace kt::kernels::avx2
