// E4M3 (OCP FP8, formats/fp8.h) decoded with AVX-512 byte permutes: shared by
// the fp8 brgemm path (brgemm_fp8_avx512.cpp) and the fp8 streaming kernels
// (fp8_avx512.cpp). Included only by files of this tier (kernels/avx512/);
// the VBMI parts carry a function-level target, since the tier's flags stop
// at AVX-512 F/BW/VL/DQ and callers check runtime::cpu_features() first.
//
// Every E4M3 value times 2^-Shift (Shift = 0 or 8) is a bf16 value (3
// mantissa bits, exponents -9..8), so the map is pure integer work, no
// rounding:
//   normal (exponent field e > 0):  bf16 = s | (e + 120 - Shift) << 7 | m << 4
//   subnormal (e == 0):             m * 2^(-9 - Shift) (a normal bf16)
// (0x7F / 0xFF, E4M3's NaN, which the packer rejects, decode to +-480 *
// 2^-Shift, as the AVX2 kernels' fp16 decode.) With AVX512_VBMI the map is two
// 128-entry byte tables (vpermt2b: the low and the high byte of the bf16 of
// the code's low 7 bits; the sign is the code's top bit), 64 codes per step.
// Shift = 8 gives the values of the AVX2 kernels' fp16 decode (e4m3 * 2^-8,
// whose scales carry the 2^8): the streaming kernels of both tiers then
// multiply the same fp32 numbers and stay bit-identical.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kt::kernels::avx512 {

#define KT_E4M3_INLINE inline __attribute__((always_inline))
#define KT_E4M3_VBMI_TARGET __attribute__((target("avx512f,avx512bw,avx512vbmi")))

// bf16 bits of the E4M3 value of code c (c < 128; sign apart) times 2^-shift.
constexpr uint16_t e4m3_magnitude_bf16(int c, int shift = 0) {
  const int e = c >> 3, m = c & 7;
  if (e > 0) return static_cast<uint16_t>((e + 120 - shift) << 7 | m << 4);
  // m * 2^-9: normalize m (1..7) to 1.f * 2^p.
  if (m == 0) return 0;
  int p = 2;  // m in [4, 8)
  while ((m >> p) == 0) --p;
  const int frac = (m << (3 - p)) & 7;  // the 3 bits below the leading one
  return static_cast<uint16_t>((p - 9 - shift + 127) << 7 | frac << 4);
}

template <int Shift>
struct E4m3ByteTables {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  constexpr E4m3ByteTables() : lo{}, hi{} {
    for (int c = 0; c < 128; ++c) {
      lo[c] = static_cast<uint8_t>(e4m3_magnitude_bf16(c, Shift) & 0xFF);
      hi[c] = static_cast<uint8_t>(e4m3_magnitude_bf16(c, Shift) >> 8);
    }
  }
};
template <int Shift>
inline constexpr E4m3ByteTables<Shift> kE4m3Tables{};

// vpermb first puts the 64 codes of one line of the [k][16 rows] layout (4 k
// x 16 rows) in the order that unpacklo / unpackhi_epi8 (within 128-bit
// lanes) of the two looked-up byte planes turn into VNNI pairs: output word
// q of the two results (q < 32 the first: k pair 0, else pair 1) is code
// (2 (q / 32) + q % 2) * 16 + (q % 32) / 2, and unpacklo's word w of lane l
// is byte 16 l + w (w < 8), unpackhi's byte 16 l + 8 + w.
struct E4m3VbmiOrder {
  alignas(64) uint8_t idx[64];
  constexpr E4m3VbmiOrder() : idx{} {
    for (int q = 0; q < 64; ++q) {
      const int code = (2 * (q / 32) + q % 2) * 16 + (q % 32) / 2;
      const int w = q % 32;
      const int byte = 16 * (w / 8) + (q < 32 ? 0 : 8) + w % 8;
      idx[byte] = static_cast<uint8_t>(code);
    }
  }
};
inline constexpr E4m3VbmiOrder kE4m3VbmiOrder{};

// The VBMI decode's constants, held in registers by the caller's loop.
template <int Shift = 0>
struct E4m3VbmiDecoder {
  __m512i lo0, lo1, hi0, hi1, order, sign;
  KT_E4M3_VBMI_TARGET KT_E4M3_INLINE E4m3VbmiDecoder()
      : lo0(_mm512_load_si512(kE4m3Tables<Shift>.lo)),
        lo1(_mm512_load_si512(kE4m3Tables<Shift>.lo + 64)),
        hi0(_mm512_load_si512(kE4m3Tables<Shift>.hi)),
        hi1(_mm512_load_si512(kE4m3Tables<Shift>.hi + 64)),
        order(_mm512_load_si512(kE4m3VbmiOrder.idx)),
        sign(_mm512_set1_epi8(static_cast<char>(0x80))) {}
  // The 64 codes of one line (k .. k + 3, 16 rows each) -> the bf16 VNNI
  // lines of pairs k / 2 (p0) and k / 2 + 1 (p1): dword r holds row r's
  // (k even, k odd) as (low, high) word.
  KT_E4M3_VBMI_TARGET KT_E4M3_INLINE void decode(const uint8_t* line, __m512i& p0,
                                                 __m512i& p1) const {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(line));
    const __m512i lo = _mm512_permutex2var_epi8(lo0, c, lo1);  // index: the low 7 bits
    // hi | (c & 0x80): the sign (ternary-logic table of A | (B & C)).
    const __m512i hi =
        _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, c, hi1), c, sign, 0xF8);
    p0 = _mm512_unpacklo_epi8(lo, hi);
    p1 = _mm512_unpackhi_epi8(lo, hi);
  }
};

// mxfp8 (OCP MX: a UE8M0 exponent E per row and 32 k): e4m3 * 2^(E-127) is
// again a bf16 value, its exponent field moved by E - 127, as long as it stays
// a normal one: the decoded exponents (Shift 0) lie in 118..135, so every E in
// [kE8m0BfMin, kE8m0BfMax] keeps them in 1..254; the callers check a block's
// exponents first (fp8_e8m0_fits_bf16) and take another kernel where one is outside.
constexpr int kE8m0Group = 32;  // k per exponent (formats::kMxfp8GroupK)
constexpr int kE8m0BfMin = 10;
constexpr int kE8m0BfMax = 246;

// The exponents of one group of 16 rows (bytes e[0..15]) as the offsets of
// bf16 VNNI pair lines: dword r = d_r | d_r << 16 with d_r = (e[r] - 127) << 7.
KT_E4M3_INLINE __m512i e8m0_pair_offsets(const uint8_t* e) {
  const __m512i d = _mm512_slli_epi32(
      _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(e))),
                       _mm512_set1_epi32(127)),
      7);
  return _mm512_or_si512(_mm512_and_si512(d, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(d, 16));
}

// bf16 pairs times 2^(E-127) per row: the offset added to the exponent field of
// every nonzero word (a 16-bit add that stays inside the field); +-0 stay.
KT_E4M3_INLINE __m512i scale_bf16_pairs(__m512i pairs, __m512i offsets) {
  const __mmask32 nonzero = _mm512_test_epi16_mask(pairs, _mm512_set1_epi16(0x7FFF));
  return _mm512_mask_add_epi16(pairs, nonzero, pairs, offsets);
}

// In a decode loop over k from 0: `off` made anew from e8m0 ([groups][16]) at each
// 32-k group's first k.
KT_E4M3_INLINE void e8m0_track_group(const uint8_t* e8m0, int64_t k, __m512i& off) {
  if (k % kE8m0Group == 0) off = e8m0_pair_offsets(e8m0 + (k / kE8m0Group) * 16);
}

}  // namespace kt::kernels::avx512
