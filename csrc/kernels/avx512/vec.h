// Vector traits for the AVX-512 tier (F/BW/VL/DQ, 16 fp32 lanes). Included
// only by files in kernels/avx512/, compiled with -mavx512f -mavx512bw ...
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kt::kernels::avx512 {

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

}  // namespace kt::kernels::avx512
