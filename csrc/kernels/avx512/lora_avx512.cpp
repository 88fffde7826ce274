// The LoRA products of rank r (moe/lora_products.h), fp32, AVX-512. MKL's sgemm
// runs these skinny shapes (one side r = 8 to 64) at 30-60 GFLOP/s on a Zen 4
// core, 4-5x the time of streaming the big operand once (m = 128, k = 2048,
// r = 8: x A^T 124 us, d^T x 90-167 us, against 24 us for a copy); here every
// product streams its [m, k] operand once with r accumulators (or r weight rows)
// per 16 lanes. Each output is one fp32 chain in a fixed order, whatever the
// thread count.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

namespace {

// Lanes of the last 16-wide step of a length-k row.
inline __mmask16 tail_mask(int64_t k) {
  const int64_t rem = k % 16;
  return rem == 0 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rem) - 1u);
}

// Ranks per pass: accumulators in registers.
constexpr int kRankChunk = 16;

}  // namespace

// y[i * r + j] = sum_k x[i * ldx + k] * a[j * lda + k]  (y = x a^T: [m, r])
void lora_xat(const float* x, int64_t ldx, int m, int64_t k, const float* a, int64_t lda, int r,
              float* y) {
  const int64_t full = k / 16 * 16;
  const __mmask16 tail = tail_mask(k);
  for (int i = 0; i < m; ++i) {
    const float* xi = x + i * ldx;
    for (int j0 = 0; j0 < r; j0 += kRankChunk) {
      const int rc = std::min(kRankChunk, r - j0);
      __m512 acc[kRankChunk];
      for (int j = 0; j < rc; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t c = 0; c < full; c += 16) {
        const __m512 xv = _mm512_loadu_ps(xi + c);
        for (int j = 0; j < rc; ++j)
          acc[j] = _mm512_fmadd_ps(xv, _mm512_loadu_ps(a + (j0 + j) * lda + c), acc[j]);
      }
      if (full < k) {
        const __m512 xv = _mm512_maskz_loadu_ps(tail, xi + full);
        for (int j = 0; j < rc; ++j)
          acc[j] =
              _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(tail, a + (j0 + j) * lda + full), acc[j]);
      }
      for (int j = 0; j < rc; ++j) y[i * r + j0 + j] = _mm512_reduce_add_ps(acc[j]);
    }
  }
}

// out[i * ldo + c] = (accumulate ? out : 0) + s * sum_j t[i * r + j] * w[j * ldw + c]
// (out (+)= s t w: [m, r] x [r, n])
void lora_tw(const float* t, int m, int r, const float* w, int64_t ldw, int64_t n, float s,
             bool accumulate, float* out, int64_t ldo) {
  const int64_t full = n / 16 * 16;
  const __mmask16 tail = tail_mask(n);
  for (int i = 0; i < m; ++i) {
    const float* ti = t + i * r;
    float* oi = out + i * ldo;
    for (int64_t c = 0; c < n; c += 16) {
      const __mmask16 mk = c < full ? static_cast<__mmask16>(0xFFFF) : tail;
      __m512 acc = _mm512_setzero_ps();
      for (int j = 0; j < r; ++j)
        acc =
            _mm512_fmadd_ps(_mm512_set1_ps(ti[j]), _mm512_maskz_loadu_ps(mk, w + j * ldw + c), acc);
      const __m512 base = accumulate ? _mm512_maskz_loadu_ps(mk, oi + c) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(oi + c, mk, _mm512_fmadd_ps(_mm512_set1_ps(s), acc, base));
    }
  }
}

// g[j * ldg + c] = s * sum_i d[i * ldd + j] * x[i * ldx + c]  (g = s d^T x: [r, k]).
// Column blocks of 32 (two vectors, a whole 128-byte pair of lines per row) by
// ranks of 8: 16 accumulators while the m rows stream past.
void lora_dtx(const float* d, int64_t ldd, int m, int r, const float* x, int64_t ldx, int64_t k,
              float s, float* g, int64_t ldg) {
  constexpr int kRanks = 8;
  const __m512 sv = _mm512_set1_ps(s);
  for (int j0 = 0; j0 < r; j0 += kRanks) {
    const int rc = std::min(kRanks, r - j0);
    for (int64_t c = 0; c < k; c += 32) {
      const __mmask16 m0 = c + 16 <= k ? static_cast<__mmask16>(0xFFFF) : tail_mask(k - c);
      const __mmask16 m1 = c + 32 <= k  ? static_cast<__mmask16>(0xFFFF)
                           : c + 16 < k ? tail_mask(k - c - 16)
                                        : static_cast<__mmask16>(0);
      __m512 a0[kRanks], a1[kRanks];
      for (int j = 0; j < rc; ++j) a0[j] = a1[j] = _mm512_setzero_ps();
      for (int i = 0; i < m; ++i) {
        const __m512 x0 = _mm512_maskz_loadu_ps(m0, x + i * ldx + c);
        const __m512 x1 = _mm512_maskz_loadu_ps(m1, x + i * ldx + c + 16);
        const float* di = d + i * ldd + j0;
        for (int j = 0; j < rc; ++j) {
          const __m512 dv = _mm512_set1_ps(di[j]);
          a0[j] = _mm512_fmadd_ps(dv, x0, a0[j]);
          a1[j] = _mm512_fmadd_ps(dv, x1, a1[j]);
        }
      }
      for (int j = 0; j < rc; ++j) {
        _mm512_mask_storeu_ps(g + (j0 + j) * ldg + c, m0, _mm512_mul_ps(sv, a0[j]));
        _mm512_mask_storeu_ps(g + (j0 + j) * ldg + c + 16, m1, _mm512_mul_ps(sv, a1[j]));
      }
    }
  }
}

}  // namespace kt::kernels::avx512
