// The LoRA products of rank r (moe/lora_products.h), fp32, AVX2 + FMA: the AVX-512
// kernels' plan (kernels/avx512/lora_avx512.cpp) in 16 ymm registers. These shapes (one
// side r = 8 to 64) went to MKL's sgemm before, which on Zen CPUs runs them far below
// its peak and repacks its operands per call, and the forward's per-block terms
// (n <= 16) to plain loops: together ~9% of an AVX2 training step (Zen 4 with the AVX2
// tier forced, Qwen3-30B-A3B layer at T = 512). Each output is one fp32 chain in a fixed
// order, whatever the thread count and however the rows are tiled; the last k % 8 (or
// n % 8) terms run as scalar FMAs with the same arithmetic as a vector lane.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/avx2/vec.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx2 {

namespace {

// 8 values of a row as fp32: fp32 loaded, bf16 widened (exact).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline float value(const float* p) { return *p; }
inline float value(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

// ---------------------------------------------------------------------------- x a^T

// y[i][j] = sum_k x[i][k] a[j][k] for R rows of x and RC ranks: lanes k % 8, summed by a
// fixed tree, then the last k % 8 terms. R x RC = 8 accumulators; each a vector serves R
// rows.
template <int R, int RC, class T>
void xat_tile(const T* const* x, int64_t k, const float* a, int64_t lda, float* y, int64_t ldy) {
  __m256 acc[R * RC];
#pragma GCC unroll 16
  for (int q = 0; q < R * RC; ++q) acc[q] = _mm256_setzero_ps();
  const int64_t k8 = k / 8 * 8;
  for (int64_t c = 0; c < k8; c += 8) {
    __m256 xv[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) xv[i] = load8(x[i] + c);
#pragma GCC unroll 8
    for (int j = 0; j < RC; ++j) {
      const __m256 av = _mm256_loadu_ps(a + j * lda + c);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[i * RC + j] = _mm256_fmadd_ps(xv[i], av, acc[i * RC + j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < RC; ++j) {
      float s = Vec::sum(acc[i * RC + j]);
      for (int64_t c = k8; c < k; ++c) s = std::fma(value(x[i] + c), a[j * lda + c], s);
      y[i * ldy + j] = s;
    }
  }
}

// Ranks j0 .. j0 + rc (rc <= 4) of R rows.
template <int R, class T>
void xat_ranks(const T* const* x, int64_t k, const float* a, int64_t lda, int rc, float* y,
               int64_t ldy) {
  switch (rc) {
    case 1:
      return xat_tile<R, 1, T>(x, k, a, lda, y, ldy);
    case 2:
      return xat_tile<R, 2, T>(x, k, a, lda, y, ldy);
    case 3:
      return xat_tile<R, 3, T>(x, k, a, lda, y, ldy);
    default:
      return xat_tile<R, 4, T>(x, k, a, lda, y, ldy);
  }
}

// Rows in pairs, all ranks of a pair before the next (its rows stay in L1).
template <class T>
void xat_any(const T* const* x, int m, int64_t k, const float* a, int64_t lda, int r, float* y) {
  for (int i = 0; i < m; i += 2) {
    const bool pair = i + 1 < m;
    for (int j0 = 0; j0 < r; j0 += 4) {
      const int rc = std::min(4, r - j0);
      if (pair) {
        xat_ranks<2, T>(x + i, k, a + j0 * lda, lda, rc, y + i * r + j0, r);
      } else {
        xat_ranks<1, T>(x + i, k, a + j0 * lda, lda, rc, y + i * r + j0, r);
      }
    }
  }
}

// ---------------------------------------------------------------------------- s t w

// Columns per block of lora_tw: w's rows for them (r x 2 KiB at r = 8) stay in L1 while
// all m rows pass; out's rows for them stay in L1 from one term to the next.
constexpr int64_t kTwCols = 512;

// out[i][c..c+8V) (+)= s * sum_j t[i][j] w[j][c..] for R rows: the sum over j ascending
// (one FMA chain from 0), then fma(s, sum, out or 0), as the AVX-512 kernels.
template <int R, int V>
inline void tw_step(const float* t, int r, const float* w, int64_t ldw, int64_t c, float s,
                    bool accumulate, float* const* out) {
  __m256 acc[R * V];
#pragma GCC unroll 8
  for (int q = 0; q < R * V; ++q) acc[q] = _mm256_setzero_ps();
  for (int j = 0; j < r; ++j) {
    __m256 wv[V];
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) wv[v] = _mm256_loadu_ps(w + j * ldw + c + 8 * v);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const __m256 tv = _mm256_broadcast_ss(t + i * r + j);
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) acc[i * V + v] = _mm256_fmadd_ps(tv, wv[v], acc[i * V + v]);
    }
  }
  const __m256 sv = _mm256_set1_ps(s);
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
#pragma GCC unroll 2
    for (int v = 0; v < V; ++v) {
      float* o = out[i] + c + 8 * v;
      const __m256 base = accumulate ? _mm256_loadu_ps(o) : _mm256_setzero_ps();
      _mm256_storeu_ps(o, _mm256_fmadd_ps(sv, acc[i * V + v], base));
    }
  }
}

// Columns [c, c1) past the last full 8 of one row: the same arithmetic per column.
inline void tw_scalar(const float* t, int r, const float* w, int64_t ldw, int64_t c, int64_t c1,
                      float s, bool accumulate, float* o) {
  for (; c < c1; ++c) {
    float acc = 0.0f;
    for (int j = 0; j < r; ++j) acc = std::fma(t[j], w[j * ldw + c], acc);
    o[c] = std::fma(s, acc, accumulate ? o[c] : 0.0f);
  }
}

// Columns [c0, c1) of one term for R rows: 16 columns a step (8 accumulators), then 8,
// then the scalar tail.
template <int R>
void tw_rows(const float* t, int r, const float* w, int64_t ldw, int64_t c0, int64_t c1, float s,
             bool accumulate, float* const* out) {
  int64_t c = c0;
  for (; c + 16 <= c1; c += 16) tw_step<R, 2>(t, r, w, ldw, c, s, accumulate, out);
  if (c + 8 <= c1) {
    tw_step<R, 1>(t, r, w, ldw, c, s, accumulate, out);
    c += 8;
  }
  if (c < c1)
    for (int i = 0; i < R; ++i) tw_scalar(t + i * r, r, w, ldw, c, c1, s, accumulate, out[i]);
}

void tw_block(const LoraTwTerm& q, int m, int64_t c0, int64_t c1, float s, bool accumulate,
              float* const* out) {
  int i = 0;
  for (; i + 4 <= m; i += 4)
    tw_rows<4>(q.t + i * q.r, q.r, q.w, q.ldw, c0, c1, s, accumulate, out + i);
  for (; i < m; ++i) tw_rows<1>(q.t + i * q.r, q.r, q.w, q.ldw, c0, c1, s, accumulate, out + i);
}

// ---------------------------------------------------------------------------- s d^T x

// g[j][c..c+16) = s * sum_i d[i][j] x[i][c..] for RC ranks: 2 RC accumulators while the m
// rows stream past, each output one fp32 chain over i ascending; the last k % 8 columns
// as scalar chains of the same arithmetic.
template <int RC, class T>
void dtx_chunk(const float* d, int64_t ldd, int m, const T* x, int64_t ldx, int64_t k, float s,
               float* g, int64_t ldg) {
  const __m256 sv = _mm256_set1_ps(s);
  const int64_t k16 = k / 16 * 16;
  for (int64_t c = 0; c < k16; c += 16) {
    __m256 acc[RC * 2];
#pragma GCC unroll 8
    for (int q = 0; q < RC * 2; ++q) acc[q] = _mm256_setzero_ps();
    for (int i = 0; i < m; ++i) {
      const __m256 x0 = load8(x + i * ldx + c), x1 = load8(x + i * ldx + c + 8);
      const float* di = d + i * ldd;
#pragma GCC unroll 4
      for (int j = 0; j < RC; ++j) {
        const __m256 dv = _mm256_broadcast_ss(di + j);
        acc[2 * j] = _mm256_fmadd_ps(dv, x0, acc[2 * j]);
        acc[2 * j + 1] = _mm256_fmadd_ps(dv, x1, acc[2 * j + 1]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < RC; ++j) {
      _mm256_storeu_ps(g + j * ldg + c, _mm256_mul_ps(sv, acc[2 * j]));
      _mm256_storeu_ps(g + j * ldg + c + 8, _mm256_mul_ps(sv, acc[2 * j + 1]));
    }
  }
  for (int64_t c = k16; c < k; ++c) {
    for (int j = 0; j < RC; ++j) {
      float acc = 0.0f;
      for (int i = 0; i < m; ++i) acc = std::fma(d[i * ldd + j], value(x + i * ldx + c), acc);
      g[j * ldg + c] = s * acc;
    }
  }
}

template <class T>
void dtx_any(const float* d, int64_t ldd, int m, int r, const T* x, int64_t ldx, int64_t k, float s,
             float* g, int64_t ldg) {
  for (int j0 = 0; j0 < r; j0 += 4) {
    const float* dj = d + j0;
    float* gj = g + j0 * ldg;
    switch (std::min(4, r - j0)) {
      case 1:
        dtx_chunk<1, T>(dj, ldd, m, x, ldx, k, s, gj, ldg);
        break;
      case 2:
        dtx_chunk<2, T>(dj, ldd, m, x, ldx, k, s, gj, ldg);
        break;
      case 3:
        dtx_chunk<3, T>(dj, ldd, m, x, ldx, k, s, gj, ldg);
        break;
      default:
        dtx_chunk<4, T>(dj, ldd, m, x, ldx, k, s, gj, ldg);
        break;
    }
  }
}

}  // namespace

void lora_xat(const float* const* x, int m, int64_t k, const float* a, int64_t lda, int r,
              float* y) {
  xat_any(x, m, k, a, lda, r, y);
}
void lora_xat_bf16(const uint16_t* const* x, int m, int64_t k, const float* a, int64_t lda, int r,
                   float* y) {
  xat_any(x, m, k, a, lda, r, y);
}

void lora_tw(const LoraTwTerm* terms, int nterms, int m, int64_t n, float s, bool accumulate,
             float* const* out) {
  for (int64_t c0 = 0; c0 < n; c0 += kTwCols) {
    const int64_t c1 = std::min(n, c0 + kTwCols);
    for (int q = 0; q < nterms; ++q) tw_block(terms[q], m, c0, c1, s, accumulate || q > 0, out);
  }
}

void lora_dtx(const float* d, int64_t ldd, int m, int r, const float* x, int64_t ldx, int64_t k,
              float s, float* g, int64_t ldg) {
  dtx_any(d, ldd, m, r, x, ldx, k, s, g, ldg);
}
void lora_dtx_bf16(const float* d, int64_t ldd, int m, int r, const uint16_t* x, int64_t ldx,
                   int64_t k, float s, float* g, int64_t ldg) {
  dtx_any(d, ldd, m, r, x, ldx, k, s, g, ldg);
}

}  // namespace kt::kernels::avx2
