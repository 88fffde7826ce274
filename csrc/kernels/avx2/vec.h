// Vector traits for the AVX2 + FMA tier (8 fp32 lanes). Included only by
// files in kernels/avx2/, which are compiled with -mavx2 -mfma -mf16c.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kt::kernels::avx2 {

struct Vec {
  using Reg = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMaxTile = 4;  // tokens per register tile (8 accs + 4 weights)

  static inline Reg zero() { return _mm256_setzero_ps(); }
  static inline Reg set1(float v) { return _mm256_set1_ps(v); }
  static inline Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, Reg v) { _mm256_storeu_ps(p, v); }
  static inline Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
  static inline Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
  static inline Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
  static inline Reg neg(Reg a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static inline Reg fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }

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

}  // namespace kt::kernels::avx2
