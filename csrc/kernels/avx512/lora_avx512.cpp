// The LoRA products of rank r (moe/lora_products.h), fp32, AVX-512. MKL's sgemm
// runs these skinny shapes (one side r = 8 to 64) at 30-60 GFLOP/s on a Zen 4
// core, 4-5x the time of streaming the big operand once (m = 128, k = 2048,
// r = 8: x A^T 124 us, d^T x 90-167 us, against 24 us for a copy); here every
// product streams its [m, k] operand once with r accumulators (or r weight rows)
// per 16 lanes. Each output is one fp32 chain in a fixed order, whatever the
// thread count and however the rows are tiled. Every loop over an accumulator array
// is unrolled under constant bounds: with a runtime bound (a rank count, a tail
// step) GCC 12 kept the arrays in memory, a store per FMA; unrolled, m = 32, k = 2048,
// r = 8 on a Zen 4 core: x A^T 25 -> 11.5 us (90 GFLOP/s of its 117 fp32 peak), d^T x
// 22.5 -> 9.8 us.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

namespace {

// Lanes of the last 16-wide step of a length-k row.
inline __mmask16 tail_mask(int64_t k) {
  const int64_t rem = k % 16;
  return rem == 0 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rem) - 1u);
}

// 16 values of a row (masked lanes 0) as fp32: fp32 loaded, bf16 widened (exact).
inline __m512 load_row(const float* p, __mmask16 mk) { return _mm512_maskz_loadu_ps(mk, p); }
inline __m512 load_row(const uint16_t* p, __mmask16 mk) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// x a^T for R rows of x and RC rows of a (rc <= RC of them real: the rest repeat
// a's last row, their sums dropped). Each a vector serves R rows: one load per R
// FMAs, not per FMA (3 rows x 8 ranks: 24 accumulators; m = 128, k = 2048, r = 8:
// 47 us, against 132 with one row at a time on a Zen 4 core).
template <int R, int RC, class T>
void xat_tile(const T* const* x, int64_t k, const float* a, int64_t lda, int rc, float* y,
              int64_t ldy) {
  const float* ar[RC];
#pragma GCC unroll 16
  for (int j = 0; j < RC; ++j) ar[j] = a + std::min(j, rc - 1) * lda;
  // The tail's mask chosen per step: a separate tail step would index acc at runtime.
  __m512 acc[R * RC];
#pragma GCC unroll 32
  for (int q = 0; q < R * RC; ++q) acc[q] = _mm512_setzero_ps();
  const __mmask16 tail = tail_mask(k);
  for (int64_t c = 0; c < k; c += 16) {
    const __mmask16 mk = c + 16 <= k ? static_cast<__mmask16>(0xFFFF) : tail;
    __m512 xv[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) xv[i] = load_row(x[i] + c, mk);
#pragma GCC unroll 16
    for (int j = 0; j < RC; ++j) {
      const __m512 av = _mm512_maskz_loadu_ps(mk, ar[j] + c);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[i * RC + j] = _mm512_fmadd_ps(xv[i], av, acc[i * RC + j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < RC; ++j)
      if (j < rc) y[i * ldy + j] = _mm512_reduce_add_ps(acc[i * RC + j]);
}

template <int RC, class T>
void xat_rows(const T* const* x, int m, int64_t k, const float* a, int64_t lda, int rc, float* y,
              int64_t ldy) {
  int i = 0;
  for (; i + 3 <= m; i += 3) xat_tile<3, RC, T>(x + i, k, a, lda, rc, y + i * ldy, ldy);
  if (m - i == 2) xat_tile<2, RC, T>(x + i, k, a, lda, rc, y + i * ldy, ldy);
  if (m - i == 1) xat_tile<1, RC, T>(x + i, k, a, lda, rc, y + i * ldy, ldy);
}

// out (+)= s t w for R rows of t with its r = RC values held in registers, columns
// [c0, c1) of n: per 16 columns RC loads of w serve R rows. Each output's sum runs over
// j ascending, whatever the column blocks.
template <int R, int RC>
void tw_tile(const float* t, int r, const float* w, int64_t ldw, int64_t c0, int64_t c1, int64_t n,
             float s, bool accumulate, float* const* out) {
  __m512 tv[R * RC];
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 16
    for (int j = 0; j < RC; ++j) tv[i * RC + j] = _mm512_set1_ps(t[i * r + j]);
  const __m512 sv = _mm512_set1_ps(s);
  const __mmask16 tail = tail_mask(n);
  for (int64_t c = c0; c < c1; c += 16) {
    const __mmask16 mk = c + 16 <= n ? static_cast<__mmask16>(0xFFFF) : tail;
    __m512 acc[R];
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < RC; ++j) {
      const __m512 wv = _mm512_maskz_loadu_ps(mk, w + j * ldw + c);
#pragma GCC unroll 4
      for (int i = 0; i < R; ++i) acc[i] = _mm512_fmadd_ps(tv[i * RC + j], wv, acc[i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      float* o = out[i] + c;
      const __m512 base = accumulate ? _mm512_maskz_loadu_ps(mk, o) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(o, mk, _mm512_fmadd_ps(sv, acc[i], base));
    }
  }
}

// One 16-column step of one term, all m rows (n <= 16: the forward's LoRA terms, added per
// 16-row block of the base product): w's RC rows stay in registers for every row and each
// t value is broadcast from memory into its FMA. Rows in groups of 4: a row's sum is one
// chain of RC dependent FMAs (4 cycles each on Zen 4), four chains keep the FMA unit busy.
// tw_tile's sums and order: the same bits. (tw_tile re-read w and broadcast t's RC values
// into registers for every 2 rows, as many instructions as its 2 RC FMAs: on Zen 4 the
// per-block terms ran at half the fp32 peak.)
template <int RC>
void tw_one_step(const float* t, int m, int r, const float* w, int64_t ldw, int64_t n, float s,
                 bool accumulate, float* const* out) {
  const __mmask16 mk = n >= 16 ? static_cast<__mmask16>(0xFFFF) : tail_mask(n);
  __m512 wv[RC];
#pragma GCC unroll 16
  for (int j = 0; j < RC; ++j) wv[j] = _mm512_maskz_loadu_ps(mk, w + j * ldw);
  const __m512 sv = _mm512_set1_ps(s);
  auto rows = [&](auto group, int i) {
    constexpr int G = decltype(group)::value;
    __m512 acc[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int j = 0; j < RC; ++j)
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g)
        acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(t[(i + g) * r + j]), wv[j], acc[g]);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      float* o = out[i + g];
      const __m512 base = accumulate ? _mm512_maskz_loadu_ps(mk, o) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(o, mk, _mm512_fmadd_ps(sv, acc[g], base));
    }
  };
  int i = 0;
  for (; i + 4 <= m; i += 4) rows(std::integral_constant<int, 4>{}, i);
  for (; i < m; ++i) rows(std::integral_constant<int, 1>{}, i);
}

// Columns per block of lora_tw: w's rows for them (RC x 2 KiB at r = 8) stay in L1 while
// all m rows pass, instead of streaming w from L2 for every row tile (m = 32, n = 2048,
// r = 8 on a Zen 4 core: 26 -> 20 us); out's rows for them stay in L1 from one term to
// the next.
constexpr int64_t kTwCols = 512;

// Columns [c0, c1) of one term for all m rows: ranks 1..16 in registers (2 rows per tile
// up to 8, 1 above).
template <int RC>
void tw_block(const float* t, int m, int r, const float* w, int64_t ldw, int64_t c0, int64_t c1,
              int64_t n, float s, bool accumulate, float* const* out) {
  constexpr int R = RC <= 8 ? 2 : 1;
  int i = 0;
  for (; i + R <= m; i += R)
    tw_tile<R, RC>(t + i * r, r, w, ldw, c0, c1, n, s, accumulate, out + i);
  for (; i < m; ++i) tw_tile<1, RC>(t + i * r, r, w, ldw, c0, c1, n, s, accumulate, out + i);
}

// Ranks past 16: the t values re-read per column step.
void tw_block_wide(const float* t, int m, int r, const float* w, int64_t ldw, int64_t c0,
                   int64_t c1, int64_t n, float s, bool accumulate, float* const* out) {
  const __mmask16 tail = tail_mask(n);
  for (int i = 0; i < m; ++i) {
    const float* ti = t + i * r;
    float* oi = out[i];
    for (int64_t c = c0; c < c1; c += 16) {
      const __mmask16 mk = c + 16 <= n ? static_cast<__mmask16>(0xFFFF) : tail;
      __m512 acc = _mm512_setzero_ps();
      for (int j = 0; j < r; ++j)
        acc =
            _mm512_fmadd_ps(_mm512_set1_ps(ti[j]), _mm512_maskz_loadu_ps(mk, w + j * ldw + c), acc);
      const __m512 base = accumulate ? _mm512_maskz_loadu_ps(mk, oi + c) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(oi + c, mk, _mm512_fmadd_ps(_mm512_set1_ps(s), acc, base));
    }
  }
}

template <int... Rm1>
void tw_term_block(std::integer_sequence<int, Rm1...>, const LoraTwTerm& q, int m, int64_t c0,
                   int64_t c1, int64_t n, float s, bool accumulate, float* const* out) {
  if (!((q.r == Rm1 + 1 &&
         (tw_block<Rm1 + 1>(q.t, m, q.r, q.w, q.ldw, c0, c1, n, s, accumulate, out), true)) ||
        ...))
    tw_block_wide(q.t, m, q.r, q.w, q.ldw, c0, c1, n, s, accumulate, out);
}

// tw_one_step for ranks 1..16; false for wider ones.
template <int... Rm1>
bool tw_term_step(std::integer_sequence<int, Rm1...>, const LoraTwTerm& q, int m, int64_t n,
                  float s, bool accumulate, float* const* out) {
  return ((q.r == Rm1 + 1 &&
           (tw_one_step<Rm1 + 1>(q.t, m, q.r, q.w, q.ldw, n, s, accumulate, out), true)) ||
          ...);
}

// Rank chunk of RC (<= 8) of lora_dtx, its column blocks of kDtxVecs vectors: every loop
// over the accumulators unrolled under constant bounds (a runtime rank count kept them in
// memory: 2x slower on Zen 4).
constexpr int kDtxVecs = 3;

template <int RC, class T>
void dtx_chunk(const float* d, int64_t ldd, int m, const T* x, int64_t ldx, int64_t k, float s,
               float* g, int64_t ldg) {
  constexpr int V = kDtxVecs;
  const __m512 sv = _mm512_set1_ps(s);
  for (int64_t c = 0; c < k; c += 16 * V) {
    __mmask16 mk[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const int64_t c0 = c + 16 * v;
      mk[v] = c0 + 16 <= k ? static_cast<__mmask16>(0xFFFF)
              : c0 < k     ? tail_mask(k - c0)
                           : static_cast<__mmask16>(0);
    }
    __m512 acc[RC * V];
#pragma GCC unroll 32
    for (int q = 0; q < RC * V; ++q) acc[q] = _mm512_setzero_ps();
    for (int i = 0; i < m; ++i) {
      __m512 xv[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) xv[v] = load_row(x + i * ldx + c + 16 * v, mk[v]);
      const float* di = d + i * ldd;
#pragma GCC unroll 8
      for (int j = 0; j < RC; ++j) {
        const __m512 dv = _mm512_set1_ps(di[j]);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) acc[j * V + v] = _mm512_fmadd_ps(dv, xv[v], acc[j * V + v]);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < RC; ++j)
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v)
        _mm512_mask_storeu_ps(g + j * ldg + c + 16 * v, mk[v], _mm512_mul_ps(sv, acc[j * V + v]));
  }
}

template <class T, int... Rm1>
void dtx_ranks(std::integer_sequence<int, Rm1...>, int rc, const float* d, int64_t ldd, int m,
               const T* x, int64_t ldx, int64_t k, float s, float* g, int64_t ldg) {
  ((rc == Rm1 + 1 && (dtx_chunk<Rm1 + 1, T>(d, ldd, m, x, ldx, k, s, g, ldg), true)) || ...);
}

// lora_xat / lora_dtx over fp32 or bf16 rows.
template <class T>
void xat_any(const T* const* x, int m, int64_t k, const float* a, int64_t lda, int r, float* y) {
  for (int j0 = 0; j0 < r; j0 += 8) {
    const int rc = std::min(8, r - j0);
    if (rc > 4)
      xat_rows<8, T>(x, m, k, a + j0 * lda, lda, rc, y + j0, r);
    else
      xat_rows<4, T>(x, m, k, a + j0 * lda, lda, rc, y + j0, r);
  }
}

template <class T>
void dtx_any(const float* d, int64_t ldd, int m, int r, const T* x, int64_t ldx, int64_t k, float s,
             float* g, int64_t ldg) {
  for (int j0 = 0; j0 < r; j0 += 8) {
    const int rc = std::min(8, r - j0);
    dtx_ranks<T>(std::make_integer_sequence<int, 8>{}, rc, d + j0, ldd, m, x, ldx, k, s,
                 g + j0 * ldg, ldg);
  }
}

}  // namespace

// y[i * r + j] = sum_k x[i][k] * a[j * lda + k]  (y = x a^T: [m, r]), ranks
// in chunks of 8 (4 for a last chunk of at most 4); x's rows fp32 or bf16.
void lora_xat(const float* const* x, int m, int64_t k, const float* a, int64_t lda, int r,
              float* y) {
  xat_any(x, m, k, a, lda, r, y);
}
void lora_xat_bf16(const uint16_t* const* x, int m, int64_t k, const float* a, int64_t lda, int r,
                   float* y) {
  xat_any(x, m, k, a, lda, r, y);
}

// out[i][c] = (accumulate ? out : 0) + s * sum_j t[i * r + j] * w[j * ldw + c] for each
// term in order (out (+)= s t w: [m, r] x [r, n], out's rows anywhere), per column block:
// the terms' sums added to out one after the other, as separate calls would.
void lora_tw(const LoraTwTerm* terms, int nterms, int m, int64_t n, float s, bool accumulate,
             float* const* out) {
  if (n <= 16) {
    for (int q = 0; q < nterms; ++q) {
      const bool acc = accumulate || q > 0;
      if (!tw_term_step(std::make_integer_sequence<int, 16>{}, terms[q], m, n, s, acc, out))
        tw_block_wide(terms[q].t, m, terms[q].r, terms[q].w, terms[q].ldw, 0, n, n, s, acc, out);
    }
    return;
  }
  for (int64_t c0 = 0; c0 < n; c0 += kTwCols) {
    const int64_t c1 = std::min(n, c0 + kTwCols);
    for (int q = 0; q < nterms; ++q)
      tw_term_block(std::make_integer_sequence<int, 16>{}, terms[q], m, c0, c1, n, s,
                    accumulate || q > 0, out);
  }
}

// g[j * ldg + c] = s * sum_i d[i * ldd + j] * x[i * ldx + c]  (g = s d^T x: [r, k]), x
// fp32 or bf16. Column blocks of kDtxVecs vectors by ranks of 8: RC * kDtxVecs
// accumulators while the m rows stream past, each output one fp32 chain over i ascending.
void lora_dtx(const float* d, int64_t ldd, int m, int r, const float* x, int64_t ldx, int64_t k,
              float s, float* g, int64_t ldg) {
  dtx_any(d, ldd, m, r, x, ldx, k, s, g, ldg);
}
void lora_dtx_bf16(const float* d, int64_t ldd, int m, int r, const uint16_t* x, int64_t ldx,
                   int64_t k, float s, float* g, int64_t ldg) {
  dtx_any(d, ldd, m, r, x, ldx, k, s, g, ldg);
}

}  // namespace kt::kernels::avx512
