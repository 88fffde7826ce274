// The rank-r products of the LoRA forward and backward, fp32: y = x A^T,
// out (+)= s t W, g = s d^T x. On the active ISA path's own kernels: AVX-512's
// (kernels/avx512/lora_avx512.cpp) on avx512 or higher, AVX2's
// (kernels/avx2/lora_avx2.cpp) on avx2 (which runs no AVX-512 instruction); at::mm
// on ref.
// Pointers to row-major fp32 matrices with the given row strides; m, k, n >= 0.
#pragma once

#include <cstdint>

namespace kt::moe::lora_products {

// y [m, r] (contiguous) = x [m, k] a^T, a [r, k].
void xat(const float* x, int64_t ldx, int64_t m, int64_t k, const float* a, int64_t lda, int64_t r,
         float* y);

// xat with x's row i at x[i] (rows anywhere: the forward's token rows).
void xat_rows(const float* const* x, int64_t m, int64_t k, const float* a, int64_t lda, int64_t r,
              float* y);

// xat_rows on bf16 rows (x's values widened exactly: the results of xat_rows on their
// fp32 copies, without making them).
void xat_rows_bf16(const uint16_t* const* x, int64_t m, int64_t k, const float* a, int64_t lda,
                   int64_t r, float* y);

// out [m, n] = (accumulate ? out : 0) + s * t [m, r] (contiguous) w [r, n].
void tw(const float* t, int64_t m, int64_t r, const float* w, int64_t ldw, int64_t n, float s,
        bool accumulate, float* out, int64_t ldo);

// tw with out's row i at out[i] (rows anywhere: the forward's rows by slot).
void tw_rows(const float* t, int64_t m, int64_t r, const float* w, int64_t ldw, int64_t n, float s,
             bool accumulate, float* const* out);

// One term s t w of tw_terms: t [m, r] (rows r apart), w [r, n] (rows ldw apart).
struct TwTerm {
  const float* t;
  int64_t r;
  const float* w;
  int64_t ldw;
};
// out (+)= s t_q w_q for each of the nterms (at most 4) terms in order, the later ones
// accumulating: the bits of one tw_rows call per term, with out's rows read and written
// once per column block instead of once per term.
void tw_terms(const TwTerm* terms, int nterms, int64_t m, int64_t n, float s, bool accumulate,
              float* const* out);

// g [r, k] = s * d^T x: d [m, r], x [m, k].
void dtx(const float* d, int64_t ldd, int64_t m, int64_t r, const float* x, int64_t ldx, int64_t k,
         float s, float* g, int64_t ldg);

// dtx on bf16 x (widened exactly, as xat_rows_bf16).
void dtx_bf16(const float* d, int64_t ldd, int64_t m, int64_t r, const uint16_t* x, int64_t ldx,
              int64_t k, float s, float* g, int64_t ldg);

// Whether kt_ops' own kernels (the active tier's: AVX2 or AVX-512) compute them now,
// rather than at::mm (the ref tier).
bool own_kernels();

}  // namespace kt::moe::lora_products
