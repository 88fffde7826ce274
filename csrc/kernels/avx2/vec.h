// Vector traits for the AVX2 + FMA tier (8 fp32 lanes). Included only by
// files in kernels/avx2/, which are compiled with -mavx2 -mfma -mf16c.
// ISA flags: -mavx2 -mfma -mf16c
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "formats/qint.h"
#include "kernels/kquant_records_sse.h"

namespace kt::kernels::avx2 {

struct Vec {
  using Reg = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMaxTile = 5;  // tokens per register tile (10 accs + 4 weights)

  static inline Reg zero() { return _mm256_setzero_ps(); }
  static inline Reg set1(float v) { return _mm256_set1_ps(v); }
  static inline Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static inline Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static inline Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static inline Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
  static inline Reg neg(Reg a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static inline Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
  static inline Reg abs(Reg a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static inline Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
  // a < b ? a : b (b when either is NaN).
  static inline Reg min(Reg a, Reg b) { return _mm256_min_ps(a, b); }
  // copysign(1, a): +1 or -1 by a's sign bit (-0.0 gives -1).
  static inline Reg sign1(Reg a) {
    return _mm256_or_ps(_mm256_and_ps(a, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
  }
  // The 8 lanes' sum by a fixed tree (halves, then pairs).
  static inline float sum(Reg v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static inline float reduce_max(Reg a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  // Whether every lane of a (an |x|) is finite: a <= FLT_MAX fails for NaN and inf.
  static inline bool all_finite_abs(Reg a) {
    return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(3.40282347e38f), _CMP_LE_OQ)) == 0xFF;
  }
  // Rounds the lanes half to even (MXCSR default) to int8 codes at dst (the
  // values lie in [-127, 127]); returns their sum.
  static inline int round_store_i8(Reg v, int8_t* dst) {
    const __m256i i = _mm256_cvtps_epi32(v);
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packs_epi16(w, w));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
  }

  // 64 bytes = 16 rows x (k even, k odd) -> two vectors of even k, two of odd k.
  static inline void load_bf16_pairs(const uint16_t* p, Reg* even, Reg* odd) {
    const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int v = 0; v < 2; ++v) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * v));
      even[v] = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
      odd[v] = _mm256_castsi256_ps(_mm256_and_si256(raw, hi_mask));
    }
  }

  // exp(x) to ~1 ulp over the fp32 range (Cephes expf: x = n ln2 + r, degree-5
  // polynomial in r, then scale by 2^n through the exponent bits).
  static inline Reg exp(Reg x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f));
    const Reg n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    Reg r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    Reg y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // 2^n: n in [-127, 128] after the clamp; split in two so 2^128 never forms.
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i half = _mm256_srai_epi32(ni, 1);
    const Reg s1 =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    const Reg s2 = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(ni, half), _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
  }
};

// Integer traits of kernels/qint_tiles.h: 8 rows x 4 bytes per ymm (a 64-byte
// line is two halves); products reach int32 through pmaddubsw (int16) and
// pmaddwd, the AVX2 form of VNNI's vpdpbusd.
struct QintVec {
  using I = __m256i;
  using F = __m256;
  static constexpr int kBytes = 32;
  static constexpr int kRows = 8;     // rows per register
  static constexpr int kParts = 2;    // registers per 64-byte line
  static constexpr int kMaxTile = 4;  // tokens per tile: 4 x (int16 + int32 + fp32 accs) + 2 codes
  static constexpr bool kU8S8 = false;  // no u8 x s8 int32 dot (qint_tiles.h, qint8_u8_block_dot)

  // Quads whose pmaddubsw products may be summed in int16 before widening:
  // pairs of u8 * s8 products are at most 2 * qmax * 127, so 4-bit codes
  // (qmax 15) allow 8 quads (2/3-bit codes, qmax 3 / 7, as many), 5-bit and
  // E2M1 (qmax 24..31) 4, 6-bit 2.
  // Independent int32 sum chains in decode tiles (see avx512/vec.h): the
  // pmaddubsw chain is a 1-cycle add, so one.
  static constexpr int kDecodeChains = 1;

  static constexpr int depth(int bits, bool lut) {
    return bits <= 4 ? (lut ? 4 : 8) : (bits == 5 ? 4 : 2);
  }

  static inline I load(const void* p) { return _mm256_loadu_si256(static_cast<const I*>(p)); }
  static inline I zero() { return _mm256_setzero_si256(); }
  static inline I set1_i32(int32_t v) { return _mm256_set1_epi32(v); }
  static inline I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static inline I add_i32(I a, I b) { return _mm256_add_epi32(a, b); }
  static inline I lo_nibbles(I raw) { return _mm256_and_si256(raw, _mm256_set1_epi8(0x0F)); }
  static inline I hi_nibbles(I raw) {
    return _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0F));
  }
  // A 16-byte table in both 128-bit lanes (vpshufb looks up per lane).
  static inline I table16(const void* t) {
    return _mm256_broadcastsi128_si256(_mm_load_si128(static_cast<const __m128i*>(t)));
  }
  // E2M1 code -> 2*value + 12 (formats::e2m1_kernel_code).
  static inline I e2m1_codes(I c) {
    return _mm256_shuffle_epi8(table16(formats::kE2m1KernelCodes), c);
  }
  // IQ4_NL code -> its signed value (formats::iq4nl_value).
  static inline I iq4nl_codes(I c) {
    return _mm256_shuffle_epi8(table16(formats::kIq4nlValues), c);
  }
  // The high bits stored at bit `from` of each byte, moved to bit `to` (4: 5/6-bit
  // codes, 2: 3-bit codes) and masked. 16-bit shifts are safe: the mask keeps only bits of the same
  // byte.
  static inline I high_bits(I hb, int from, int mask, int to = 4) {
    const I m = _mm256_set1_epi8(static_cast<char>(mask));
    if (from < to) return _mm256_and_si256(_mm256_sll_epi16(hb, _mm_cvtsi32_si128(to - from)), m);
    return _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(from - to)), m);
  }
  // Bits 2c, 2c + 1 of each byte (quad c of a 2-bit plane's line) as codes 0..3.
  static inline I crumbs(I raw, int c) {
    return _mm256_and_si256(_mm256_srl_epi16(raw, _mm_cvtsi32_si128(2 * c)), _mm256_set1_epi8(3));
  }
  // The 4 quads of a unit of 3-bit codes (q3_k): `raw` one 2-bit plane line's
  // half (quad c in bits 2c, 2c+1 of each byte), `hb` the high plane's half
  // with quad c's third bit at bit c (bits 4-7 of `hb` ignored). Codes
  // 0..7 into w[0..3]. Quads 0 and 2 (1 and 3) go as one nibble pair: their
  // crumbs masked in place (0x33) and their high bits spread to bits 2 and 6
  // by a 16-entry table on the high nibble, then split into nibbles:
  // 13 ops for 4 quads against 18 for a shift, mask and or per quad.
  static inline void q3_quads(I raw, I hb, I* w) {
    alignas(16) static constexpr uint8_t kSpread02[16] = {0, 4, 0, 4, 0x40, 0x44, 0x40, 0x44,
                                                          0, 4, 0, 4, 0x40, 0x44, 0x40, 0x44};
    alignas(16) static constexpr uint8_t kSpread13[16] = {
        0, 0, 4, 4, 0, 0, 4, 4, 0x40, 0x40, 0x44, 0x44, 0x40, 0x40, 0x44, 0x44};
    const I m33 = _mm256_set1_epi8(0x33), m0f = _mm256_set1_epi8(0x0F);
    const I hn = _mm256_and_si256(hb, m0f);
    const I c02 =
        _mm256_or_si256(_mm256_and_si256(raw, m33), _mm256_shuffle_epi8(table16(kSpread02), hn));
    const I c13 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 2), m33),
                                  _mm256_shuffle_epi8(table16(kSpread13), hn));
    w[0] = _mm256_and_si256(c02, m0f);
    w[1] = _mm256_and_si256(c13, m0f);
    w[2] = _mm256_and_si256(_mm256_srli_epi16(c02, 4), m0f);
    w[3] = _mm256_and_si256(_mm256_srli_epi16(c13, 4), m0f);
  }
  // Every 16-bit lane shifted right by n bits.
  static inline I srl16(I v, int n) { return _mm256_srl_epi16(v, _mm_cvtsi32_si128(n)); }
  // st += w0 . x0 + w1 . x1 per 16-bit pair (u8 codes x s8 activations).
  static inline void dot2(I& st, I w0, I x0, I w1, I x1) {
    st = _mm256_add_epi16(
        st, _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1)));
  }
  static inline I flush(I isum, I st) {
    return _mm256_add_epi32(isum, _mm256_madd_epi16(st, _mm256_set1_epi16(1)));
  }
  // isum += raw . x for signed 8-bit codes: |raw| * (x * sign(raw)).
  static inline I dot_signed(I isum, I raw, I x) {
    const I p = _mm256_maddubs_epi16(_mm256_abs_epi8(raw), _mm256_sign_epi8(x, raw));
    return _mm256_add_epi32(isum, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }

  static inline F fzero() { return _mm256_setzero_ps(); }
  static inline F set1(float v) { return _mm256_set1_ps(v); }
  static inline F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  // GGUF k-quant record (formats/qint.h) -> s[j * 16 + r] = d[r] * sc_j[r] and
  // (kKq45, kKq2) z[j * 16 + r] = dmin[r] * m_j[r] for the 16 rows: get_scale_min_k4
  // on 16-byte vectors (one byte per row), widened and scaled. Exact products.
  // The byte work is shared by the x86 tiers (kernels/kquant_records_sse.h).
  static inline void kquant_decode(const uint8_t* rec, formats::ScaleType t, float* s, float* z) {
    kquant_decode_records<QintVec>(rec, t, s, z);
  }
  // The 16 rows' fp16 d of a record as fp32 (rows 0-7, 8-15).
  static inline void kq_load_d(const uint8_t* p, F* d) {
    d[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    d[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  // out[r] = d[r] * byte r of b (unsigned, or int8 when is_signed), 16 rows.
  static inline void kq_widen_store(__m128i b, bool is_signed, const F* d, float* out) {
    const __m128i b1 = _mm_srli_si128(b, 8);
    const __m256i v0 = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    const __m256i v1 = is_signed ? _mm256_cvtepi8_epi32(b1) : _mm256_cvtepu8_epi32(b1);
    _mm256_storeu_ps(out, _mm256_mul_ps(d[0], _mm256_cvtepi32_ps(v0)));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(d[1], _mm256_cvtepi32_ps(v1)));
  }
  // kRows rows' fp32 scales d * sc of a k-quant sub-block: int8 scales sc at p,
  // the rows' d at d (kq_load_d's values); kq_widen_store's exact products.
  static inline F kq_int8_scales(const uint8_t* p, const float* d) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_mul_ps(_mm256_loadu_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
  // kRows consecutive stored scales (or zeros) as fp32.
  static inline F load_scales(const void* base, formats::ScaleType t, int64_t index) {
    switch (t) {
      case formats::ScaleType::kF16:
        return _mm256_cvtph_ps(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + index)));
      case formats::ScaleType::kBF16: {
        const __m128i v = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + index));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
      }
      case formats::ScaleType::kE8M0: {
        // 2^(E-128): exponent field E-1, flushed to zero for E < 2.
        const __m128i v = _mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + index));
        __m256i e = _mm256_sub_epi32(_mm256_cvtepu8_epi32(v), _mm256_set1_epi32(1));
        e = _mm256_max_epi32(e, _mm256_setzero_si256());
        return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
      }
      default:
        return _mm256_loadu_ps(static_cast<const float*>(base) + index);
    }
  }
};

}  // namespace kt::kernels::avx2
