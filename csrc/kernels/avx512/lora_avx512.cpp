// The LoRA products of rank r (moe/lora_products.h), fp32, AVX-512. MKL's sgemm
// runs these skinny shapes (one side r = 8 to 64) at 30-60 GFLOP/s on a Zen 4
// core, 4-5x the time of streaming the big operand once (m = 128, k = 2048,
// r = 8: x A^T 124 us, d^T x 90-167 us, against 24 us for a copy); here every
// product streams its [m, k] operand once with r accumulators (or r weight rows)
// per 16 lanes. Each output is one fp32 chain in a fixed order, whatever the
// thread count and however the rows are tiled.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <utility>

#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

namespace {

// Lanes of the last 16-wide step of a length-k row.
inline __mmask16 tail_mask(int64_t k) {
  const int64_t rem = k % 16;
  return rem == 0 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rem) - 1u);
}

// x a^T for R rows of x and RC rows of a (rc <= RC of them real: the rest repeat
// a's last row, their sums dropped). Each a vector serves R rows: one load per R
// FMAs, not per FMA (3 rows x 8 ranks: 24 accumulators; m = 128, k = 2048, r = 8:
// 97 against 132 us with one row at a time on a Zen 4 core).
template <int R, int RC>
void xat_tile(const float* x, int64_t ldx, int64_t k, const float* a, int64_t lda, int rc, float* y,
              int64_t ldy) {
  const float* ar[RC];
  for (int j = 0; j < RC; ++j) ar[j] = a + std::min(j, rc - 1) * lda;
  __m512 acc[R][RC];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < RC; ++j) acc[i][j] = _mm512_setzero_ps();
  auto step = [&](int64_t c, __mmask16 mk) {
    __m512 xv[R];
    for (int i = 0; i < R; ++i) xv[i] = _mm512_maskz_loadu_ps(mk, x + i * ldx + c);
    for (int j = 0; j < RC; ++j) {
      const __m512 av = _mm512_maskz_loadu_ps(mk, ar[j] + c);
      for (int i = 0; i < R; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], av, acc[i][j]);
    }
  };
  const int64_t full = k / 16 * 16;
  for (int64_t c = 0; c < full; c += 16) step(c, static_cast<__mmask16>(0xFFFF));
  if (full < k) step(full, tail_mask(k));
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < rc; ++j) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int RC>
void xat_rows(const float* x, int64_t ldx, int m, int64_t k, const float* a, int64_t lda, int rc,
              float* y, int64_t ldy) {
  int i = 0;
  for (; i + 3 <= m; i += 3) xat_tile<3, RC>(x + i * ldx, ldx, k, a, lda, rc, y + i * ldy, ldy);
  if (m - i == 2) xat_tile<2, RC>(x + i * ldx, ldx, k, a, lda, rc, y + i * ldy, ldy);
  if (m - i == 1) xat_tile<1, RC>(x + i * ldx, ldx, k, a, lda, rc, y + i * ldy, ldy);
}

// out (+)= s t w for R rows of t with its r = RC values held in registers: per 16
// columns RC loads of w serve R rows (m = 128, n = 2048, r = 8: 91 against 154 us
// with one row and the t values re-read per column step, Zen 4).
template <int R, int RC>
void tw_tile(const float* t, int r, const float* w, int64_t ldw, int64_t n, float s,
             bool accumulate, float* out, int64_t ldo) {
  __m512 tv[R][RC];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < RC; ++j) tv[i][j] = _mm512_set1_ps(t[i * r + j]);
  const __m512 sv = _mm512_set1_ps(s);
  const int64_t full = n / 16 * 16;
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 mk = c < full ? static_cast<__mmask16>(0xFFFF) : tail_mask(n);
    __m512 acc[R];
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int j = 0; j < RC; ++j) {
      const __m512 wv = _mm512_maskz_loadu_ps(mk, w + j * ldw + c);
      for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(tv[i][j], wv, acc[i]);
    }
    for (int i = 0; i < R; ++i) {
      float* o = out + i * ldo + c;
      const __m512 base = accumulate ? _mm512_maskz_loadu_ps(mk, o) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(o, mk, _mm512_fmadd_ps(sv, acc[i], base));
    }
  }
}

// Ranks 1..16 in registers: 2 rows per tile up to 8 (16 values), 1 above.
template <int RC>
void tw_rows(const float* t, int m, int r, const float* w, int64_t ldw, int64_t n, float s,
             bool accumulate, float* out, int64_t ldo) {
  constexpr int R = RC <= 8 ? 2 : 1;
  int i = 0;
  for (; i + R <= m; i += R)
    tw_tile<R, RC>(t + i * r, r, w, ldw, n, s, accumulate, out + i * ldo, ldo);
  for (; i < m; ++i) tw_tile<1, RC>(t + i * r, r, w, ldw, n, s, accumulate, out + i * ldo, ldo);
}

template <int... Rm1>
bool tw_in_registers(std::integer_sequence<int, Rm1...>, const float* t, int m, int r,
                     const float* w, int64_t ldw, int64_t n, float s, bool accumulate, float* out,
                     int64_t ldo) {
  return ((r == Rm1 + 1 && (tw_rows<Rm1 + 1>(t, m, r, w, ldw, n, s, accumulate, out, ldo), true)) ||
          ...);
}

}  // namespace

// y[i * r + j] = sum_k x[i * ldx + k] * a[j * lda + k]  (y = x a^T: [m, r]), ranks
// in chunks of 8 (4 for a last chunk of at most 4).
void lora_xat(const float* x, int64_t ldx, int m, int64_t k, const float* a, int64_t lda, int r,
              float* y) {
  for (int j0 = 0; j0 < r; j0 += 8) {
    const int rc = std::min(8, r - j0);
    if (rc > 4)
      xat_rows<8>(x, ldx, m, k, a + j0 * lda, lda, rc, y + j0, r);
    else
      xat_rows<4>(x, ldx, m, k, a + j0 * lda, lda, rc, y + j0, r);
  }
}

// out[i * ldo + c] = (accumulate ? out : 0) + s * sum_j t[i * r + j] * w[j * ldw + c]
// (out (+)= s t w: [m, r] x [r, n])
void lora_tw(const float* t, int m, int r, const float* w, int64_t ldw, int64_t n, float s,
             bool accumulate, float* out, int64_t ldo) {
  if (tw_in_registers(std::make_integer_sequence<int, 16>{}, t, m, r, w, ldw, n, s, accumulate, out,
                      ldo))
    return;
  // Ranks past 16: the t values re-read per column step.
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
