// The AVX-512 parts of the w8a8 brgemm path (kernels/brgemm.h): the per-token
// int8 quantization of the activation rows (the A operand) and the epilogue of
// each tile's int32 sums. brgemm.cpp reaches both through weak declarations
// (kernels/tiers.h): the path needs an AVX-512 tier anyway (oneDNN's u8s8).
//
// Per row (formats/q8_activations.h's formula over the whole row, as
// tests/reference.py's q8_activations with block = K):
//   amax = max|x|;  sx = amax / 127;  q = round_half_even(x * (127 / amax))
// (all zero, sx = 0, for a zero row), stored as q + 128 in [1, 255].
#include <immintrin.h>

#include "kernels/avx512/vec.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

void quantize_rows_i8_token(const float* const* x, int m, int64_t kp, uint8_t* dst, int64_t ld,
                            float* scales) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i bias = _mm512_set1_epi32(128);
  for (int i = 0; i < m; ++i) {
    const float* row = x[i];
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t k = 0; k < kp; k += 16)  // kp: a multiple of 32
      vmax = _mm512_max_ps(vmax, _mm512_and_ps(_mm512_loadu_ps(row + k), sign));
    const float amax = _mm512_reduce_max_ps(vmax);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;  // correctly rounded, as the reference
    scales[i] = amax / 127.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    uint8_t* d = dst + i * ld;
    for (int64_t k = 0; k < kp; k += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(row + k), vinv);
      __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(q, lo), hi), bias);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + k), _mm512_cvtepi32_epi8(q));
    }
  }
}

void w8a8_epilogue(const int32_t* c, int rows, const float* x_scales, const void* w_scales,
                   formats::ScaleType scale_type, bool accumulate, float* out, int64_t ldo) {
  using V = QintVec512<false>;
  const __m512 sw = V::load_scales(w_scales, scale_type, 0);  // per channel: one group
  const __m512i comp = _mm512_loadu_si512(c + rows * 16);
  for (int i = 0; i < rows; ++i) {
    const __m512i isum = _mm512_sub_epi32(_mm512_loadu_si512(c + i * 16), comp);
    const __m512 s = _mm512_mul_ps(sw, _mm512_set1_ps(x_scales[i]));
    float* o = out + i * ldo;
    const __m512 base = accumulate ? _mm512_loadu_ps(o) : _mm512_setzero_ps();
    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, base));
  }
}

}  // namespace kt::kernels::avx512
