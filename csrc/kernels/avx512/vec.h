// Vector traits for the AVX-512 tier (F/BW/VL/DQ, 16 fp32 lanes). Included
// only by files in kernels/avx512/, compiled with -mavx512f -mavx512bw ...
// ISA flags: -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "formats/qint.h"
#include "kernels/kquant_records_sse.h"

namespace kt::kernels::avx512 {

// acc += the 4-byte dot products of u8 (unsigned) with the signed quad at q, broadcast
// from memory by vpdpbusd itself ({1to16}); only for callers compiled for AVX512_VNNI.
// Inline assembly: GCC 12 neither folds the broadcast of the intrinsic into the
// instruction (a separate vpbroadcastd per quad) nor, in the w8a8 tiles, kept their 28
// accumulators in registers (it spilled every one of them per k quad).
__attribute__((always_inline)) inline void dpbusd_bcast(__m512i& acc, __m512i u8, const void* q) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u8), "m"(*static_cast<const int32_t*>(q)));
}

struct Vec {
  using Reg = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMaxTile = 8;  // tokens per register tile (16 accs of 32)

  static inline Reg zero() { return _mm512_setzero_ps(); }
  static inline Reg set1(float v) { return _mm512_set1_ps(v); }
  static inline Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, Reg v) { _mm512_storeu_ps(p, v); }
  static inline Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
  static inline Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
  static inline Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
  static inline Reg neg(Reg a) {
    return _mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(static_cast<int>(0x80000000u))));
  }
  static inline Reg fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
  static inline Reg abs(Reg a) { return _mm512_abs_ps(a); }
  static inline Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
  // a < b ? a : b (b when either is NaN).
  static inline Reg min(Reg a, Reg b) { return _mm512_min_ps(a, b); }
  // copysign(1, a): +1 or -1 by a's sign bit (-0.0 gives -1).
  static inline Reg sign1(Reg a) {
    const __m512i sign =
        _mm512_and_si512(_mm512_castps_si512(a), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    return _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_castps_si512(_mm512_set1_ps(1.0f))));
  }
  static inline float reduce_max(Reg a) { return _mm512_reduce_max_ps(a); }
  // Whether every lane of a (an |x|) is finite: a <= FLT_MAX fails for NaN and inf.
  static inline bool all_finite_abs(Reg a) {
    return _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.40282347e38f), _CMP_LE_OQ) == 0xFFFF;
  }
  // Rounds the lanes half to even (MXCSR default) to int8 codes at dst (the
  // values lie in [-127, 127]); returns their sum.
  static inline int round_store_i8(Reg v, int8_t* dst) {
    const __m512i i = _mm512_cvtps_epi32(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(i));
    return _mm512_reduce_add_epi32(i);
  }

  // 64 bytes = 16 rows x (k even, k odd) -> one vector of even k, one of odd k.
  static inline void load_bf16_pairs(const uint16_t* p, Reg* even, Reg* odd) {
    const __m512i raw = _mm512_loadu_si512(p);
    even[0] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    odd[0] = _mm512_castsi512_ps(
        _mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }

  // exp(x): the same Cephes expf scheme as the AVX2 tier (see avx2/vec.h).
  static inline Reg exp(Reg x) {
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
    x = _mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f));
    const Reg n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    Reg r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    Reg y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    // y * 2^n in one instruction; scalef handles the exponent range itself.
    return _mm512_scalef_ps(y, n);
  }
};

// Integer traits of kernels/qint_tiles.h at 512 bits: one zmm holds all 16
// rows x 4 bytes of a 64-byte line. kVnni = false: pmaddubsw/pmaddwd
// (AVX-512 BW, tier avx512); kVnni = true: vpdpbusd accumulates u8 x s8
// quads straight into int32 (AVX512_VNNI, tier avx512_vnni). Each tier
// instantiates only its own specialization (its symbols carry kVnni), and
// only the avx512_vnni directory is compiled with -mavx512vnni.
template <bool kVnni>
struct QintVec512 {
  using I = __m512i;
  using F = __m512;
  static constexpr int kBytes = 64;
  static constexpr int kRows = 16;
  static constexpr int kParts = 1;
  // Tokens per prefill tile (qint_tiles.h): the decoded codes of a line serve
  // kMaxTile tokens. VNNI: 12 tokens, 12 int32 + 12 fp32 accumulators; per
  // unit the fp32 fold (4 ops per token) and the decode (3 per line) bound it.
  // Measured on Zen 4 (a layer of 128 experts, T = 512, 2 threads, hot, best
  // of 27 calls in 3 alternating processes), 4 -> 12 tokens: int4-g128 73.1 ->
  // 68.8 ms, q4_k 80.6 -> 73.9; 8 -> 12: mxfp4 73.1 -> 69.8. The avx512 tier
  // (pmaddubsw, int16 stages: more registers per token) keeps its 4: at 8 GCC
  // spills (zmm stack accesses in the object: 443 -> 1922).
  static constexpr int kMaxTile = kVnni ? 12 : 4;

  // Quads summed before widening to int32: pmaddubsw's int16 bound (see
  // avx2/vec.h); vpdpbusd has no int16 stage.
  // Independent int32 sum chains per (token, part) in decode tiles (M * P
  // <= 2). vpdpbusd accumulates in place, so one chain serializes a unit's 8
  // dpbusd on its latency (~5 cycles on Zen 4); measured within noise on Zen 4
  // (hot T = 1 int4, 158 vs 161 us). int32 sums are exact: any split gives the
  // same isum. pmaddubsw's chain is a 1-cycle add.
  static constexpr int kDecodeChains = kVnni ? 4 : 1;

  static constexpr int depth(int bits, bool lut) {
    if (kVnni) return 8;
    return bits <= 4 ? (lut ? 4 : 8) : (bits == 5 ? 4 : 2);
  }

  static inline I load(const void* p) { return _mm512_loadu_si512(p); }
  static inline I zero() { return _mm512_setzero_si512(); }
  static inline I set1_i32(int32_t v) { return _mm512_set1_epi32(v); }
  static inline I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static inline I add_i32(I a, I b) { return _mm512_add_epi32(a, b); }
  static inline I lo_nibbles(I raw) { return _mm512_and_si512(raw, _mm512_set1_epi8(0x0F)); }
  static inline I hi_nibbles(I raw) {
    return _mm512_and_si512(_mm512_srli_epi16(raw, 4), _mm512_set1_epi8(0x0F));
  }
  // A 16-byte table in every 128-bit lane (vpshufb looks up per lane).
  static inline I table16(const void* t) {
    return _mm512_broadcast_i32x4(_mm_load_si128(static_cast<const __m128i*>(t)));
  }
  // E2M1 code -> 2*value + 12 (formats::e2m1_kernel_code).
  static inline I e2m1_codes(I c) {
    return _mm512_shuffle_epi8(table16(formats::kE2m1KernelCodes), c);
  }
  // IQ4_NL code -> its signed value (formats::iq4nl_value).
  static inline I iq4nl_codes(I c) {
    return _mm512_shuffle_epi8(table16(formats::kIq4nlValues), c);
  }
  static inline I high_bits(I hb, int from, int mask, int to = 4) {
    const I m = _mm512_set1_epi8(static_cast<char>(mask));
    if (from < to) return _mm512_and_si512(_mm512_sll_epi16(hb, _mm_cvtsi32_si128(to - from)), m);
    return _mm512_and_si512(_mm512_srl_epi16(hb, _mm_cvtsi32_si128(from - to)), m);
  }
  // Bits 2c, 2c + 1 of each byte (quad c of a 2-bit plane's line) as codes 0..3.
  static inline I crumbs(I raw, int c) {
    return _mm512_and_si512(_mm512_srl_epi16(raw, _mm_cvtsi32_si128(2 * c)), _mm512_set1_epi8(3));
  }
  // Every 16-bit lane shifted right by n bits.
  static inline I srl16(I v, int n) { return _mm512_srl_epi16(v, _mm_cvtsi32_si128(n)); }
  static inline void dot2(I& st, I w0, I x0, I w1, I x1) {
    if constexpr (kVnni) {
      st = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(st, w0, x0), w1, x1);
    } else {
      st = _mm512_add_epi16(
          st, _mm512_add_epi16(_mm512_maddubs_epi16(w0, x0), _mm512_maddubs_epi16(w1, x1)));
    }
  }
  // dot2 with each token quad read by vpdpbusd itself (dpbusd_bcast: the quads at xp
  // and xp + 4), the same exact int32 sums. Zen 4, a layer at T = 512 on the 12-token
  // tiles, alternating builds (compare_trees.py, 3 rounds): q4_k 0.88x / 0.94x the time,
  // mxfp4 0.92x, q5_k 0.93x, int4-g128 0.99x; decode within the noise.
  static constexpr bool kDot2At = kVnni;
  static inline void dot2_at(I& st, I w0, I w1, const int8_t* xp) {
    if constexpr (kVnni) {
      dpbusd_bcast(st, w0, xp);
      dpbusd_bcast(st, w1, xp + 4);
    }
  }
  static inline I flush(I isum, I st) {
    if constexpr (kVnni) return _mm512_add_epi32(isum, st);
    return _mm512_add_epi32(isum, _mm512_madd_epi16(st, _mm512_set1_epi16(1)));
  }
  // isum += raw . x for signed 8-bit codes: |raw| * (x negated where raw < 0)
  // (AVX-512 has no psignb; where raw = 0 the product is 0 either way).
  static inline I dot_signed(I isum, I raw, I x) {
    const I xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(raw), _mm512_setzero_si512(), x);
    const I w = _mm512_abs_epi8(raw);
    if constexpr (kVnni) return _mm512_dpbusd_epi32(isum, w, xs);
    return _mm512_add_epi32(isum,
                            _mm512_madd_epi16(_mm512_maddubs_epi16(w, xs), _mm512_set1_epi16(1)));
  }

  // 8-bit signed codes against q8 activations shifted to u8 (qint_tiles.h,
  // qint8_u8_block_dot): vpdpbusd takes the u8 rows and the stored codes as
  // they are, so only the VNNI tier has it (pmaddubsw would saturate in int16
  // with u8 activations).
  // Tiles of kU8TileRows (12, kernel_api.h) tokens: 12 int32 + 12 fp32 accs
  // (measured best of 8/10/12/16).
  static constexpr bool kU8S8 = kVnni;
  static inline I sub_i32(I a, I b) { return _mm512_sub_epi32(a, b); }
  // acc += u8 quads of u . s8 quads of s, per 32-bit lane.
  static inline I dpbusd(I acc, I u, I s) {
    if constexpr (kVnni) return _mm512_dpbusd_epi32(acc, u, s);
    return acc;  // never instantiated: kU8S8 is false without VNNI
  }
  // The 4 bytes at p in every 32-bit lane (vpbroadcastd from memory).
  static inline I bcast_quad(const uint8_t* p) {
    return _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(p));
  }

  static inline F fzero() { return _mm512_setzero_ps(); }
  static inline F set1(float v) { return _mm512_set1_ps(v); }
  static inline F fload(const float* p) { return _mm512_loadu_ps(p); }
  static inline F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static inline F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // GGUF k-quant record (formats/qint.h) -> s[j * 16 + r] = d[r] * sc_j[r] and
  // (kKq45, kKq2) z[j * 16 + r] = dmin[r] * m_j[r] for the 16 rows: get_scale_min_k4
  // on 16-byte vectors (one byte per row), widened and scaled. Exact products.
  // The byte work is shared by the x86 tiers (kernels/kquant_records_sse.h).
  static inline void kquant_decode(const uint8_t* rec, formats::ScaleType t, float* s, float* z) {
    kquant_decode_records<QintVec512>(rec, t, s, z);
  }
  // The 16 rows' fp16 d of a record as fp32.
  static inline void kq_load_d(const uint8_t* p, F* d) {
    d[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // out[r] = d[r] * byte r of b (unsigned, or int8 when is_signed), 16 rows.
  static inline void kq_widen_store(__m128i b, bool is_signed, const F* d, float* out) {
    const __m512i v = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    _mm512_storeu_ps(out, _mm512_mul_ps(d[0], _mm512_cvtepi32_ps(v)));
  }
  static inline F load_scales(const void* base, formats::ScaleType t, int64_t index) {
    switch (t) {
      case formats::ScaleType::kF16:
        return _mm512_cvtph_ps(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index)));
      case formats::ScaleType::kBF16: {
        const __m256i v = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + index));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
      }
      case formats::ScaleType::kE8M0: {
        // 2^(E-128): exponent field E-1, flushed to zero for E < 2.
        const __m128i v = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + index));
        __m512i e = _mm512_sub_epi32(_mm512_cvtepu8_epi32(v), _mm512_set1_epi32(1));
        e = _mm512_max_epi32(e, _mm512_setzero_si512());
        return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
      }
      default:
        return _mm512_loadu_ps(static_cast<const float*>(base) + index);
    }
  }
};

}  // namespace kt::kernels::avx512
