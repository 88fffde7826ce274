// The AVX-512 parts of the w8a8 brgemm path (kernels/brgemm.h): the per-token
// int8 quantization of the activation rows (the A operand) and the epilogue of
// each tile's int32 sums; for int4 per channel on the same calls (w4a8), the block's
// codes as signed bytes and that kernel's epilogue. brgemm.cpp reaches both through weak
// declarations (kernels/tiers.h): the path needs an AVX-512 tier anyway (oneDNN's u8s8).
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

void int4_to_s8_vnni(const uint8_t* block, int64_t kp, int8_t* dst) {
  // The low plane [kp/8][16][4]: line l holds quad 2l of the 16 rows in its low nibbles
  // and quad 2l + 1 in its high ones, so each nibble half is one [16][4] line of dst.
  const __m512i mask = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  for (int64_t l = 0; l < kp / 8; ++l) {
    const __m512i raw = _mm512_loadu_si512(block + 64 * l);
    const __m512i lo = _mm512_and_si512(raw, mask);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
    _mm512_storeu_si512(dst + 128 * l, _mm512_sub_epi8(lo, eight));
    _mm512_storeu_si512(dst + 128 * l + 64, _mm512_sub_epi8(hi, eight));
  }
}

void w4a8_epilogue(const int32_t* c, int rows, const float* x_scales, const int32_t* q_sums,
                   const void* scales, formats::ScaleType scale_type, const void* zeros,
                   formats::ScaleType zero_type, int64_t group, bool accumulate, float* out,
                   int64_t ldo) {
  using V = QintVec512<false>;
  const __m512 s = V::load_scales(scales, scale_type, 16 * group);
  const __m512 z =
      zeros != nullptr ? V::load_scales(zeros, zero_type, 16 * group) : _mm512_setzero_ps();
  const __m512i comp = _mm512_loadu_si512(c + rows * 16);
  for (int i = 0; i < rows; ++i) {
    // sum (c - 8) q, exact; with zero points sum c q (kt_ops' w4a8 tiles' acc).
    __m512i acc = _mm512_sub_epi32(_mm512_loadu_si512(c + i * 16), comp);
    if (zeros != nullptr) acc = _mm512_add_epi32(acc, _mm512_set1_epi32(8 * q_sums[i]));
    // The tiles' fold, operation for operation (w4a8_tile): the same bits per channel.
    const __m512 xa = _mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(x_scales[i]));
    float* o = out + i * ldo;
    __m512 r = accumulate ? _mm512_fmadd_ps(s, xa, _mm512_loadu_ps(o)) : _mm512_mul_ps(s, xa);
    if (zeros != nullptr) r = _mm512_fnmadd_ps(z, _mm512_set1_ps(x_scales[i] * q_sums[i]), r);
    _mm512_storeu_ps(o, r);
  }
}

}  // namespace kt::kernels::avx512
