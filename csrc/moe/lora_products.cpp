#include "moe/lora_products.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

#include "formats/bf16.h"
#include "kernels/dispatch.h"
#include "kernels/tiers.h"

namespace kt::moe::lora_products {

namespace {

at::Tensor mat(const float* p, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<float*>(p), {rows, cols}, {ld, 1}, at::kFloat);
}

inline float widen(float v) { return v; }
inline float widen(uint16_t v) { return formats::bf16_bits_to_float(v); }

// xat_rows without AVX-512: at::mm on the rows gathered as fp32 (one GEMM, not m of them).
template <class T>
void xat_rows_aten(const T* const* x, int64_t m, int64_t k, const float* a, int64_t lda, int64_t r,
                   float* y) {
  at::Tensor xg = at::empty({m, k}, at::kFloat);
  float* xp = xg.data_ptr<float>();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k; ++j) xp[i * k + j] = widen(x[i][j]);
  at::Tensor out = mat(y, m, r, r);
  at::mm_out(out, xg, mat(a, r, k, lda).t());
}

// The tier's own kernels for these products (kernels/tiers.h): AVX-512's on the AVX-512
// tiers, AVX2's on the AVX2 tier; none on ref (and on a build without them): at::mm.
struct Kernels {
  decltype(&kernels::avx512::lora_xat) xat;
  decltype(&kernels::avx512::lora_xat_bf16) xat_bf16;
  decltype(&kernels::avx512::lora_tw) tw;
  decltype(&kernels::avx512::lora_dtx) dtx;
  decltype(&kernels::avx512::lora_dtx_bf16) dtx_bf16;
};

const Kernels* active_kernels() {
  namespace k = kernels;
  static const Kernels avx512{k::avx512::lora_xat, k::avx512::lora_xat_bf16, k::avx512::lora_tw,
                              k::avx512::lora_dtx, k::avx512::lora_dtx_bf16};
  static const Kernels avx2{k::avx2::lora_xat, k::avx2::lora_xat_bf16, k::avx2::lora_tw,
                            k::avx2::lora_dtx, k::avx2::lora_dtx_bf16};
  static const k::Isa isa_avx512 = k::parse_isa("avx512"), isa_avx2 = k::parse_isa("avx2");
  const k::Isa isa = k::active_isa();
  if (isa >= isa_avx512 && avx512.xat != nullptr) return &avx512;
  if (isa >= isa_avx2 && avx2.xat != nullptr) return &avx2;
  return nullptr;
}

}  // namespace

bool own_kernels() { return active_kernels() != nullptr; }

void xat(const float* x, int64_t ldx, int64_t m, int64_t k, const float* a, int64_t lda, int64_t r,
         float* y) {
  if (m == 0 || r == 0) return;
  if (own_kernels()) {
    std::vector<const float*> rows(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) rows[i] = x + i * ldx;
    xat_rows(rows.data(), m, k, a, lda, r, y);
    return;
  }
  at::Tensor out = mat(y, m, r, r);
  at::mm_out(out, mat(x, m, k, ldx), mat(a, r, k, lda).t());
}

void xat_rows(const float* const* x, int64_t m, int64_t k, const float* a, int64_t lda, int64_t r,
              float* y) {
  if (m == 0 || r == 0) return;
  if (const Kernels* kn = active_kernels()) {
    kn->xat(x, static_cast<int>(m), k, a, lda, static_cast<int>(r), y);
    return;
  }
  xat_rows_aten(x, m, k, a, lda, r, y);
}

void xat_rows_bf16(const uint16_t* const* x, int64_t m, int64_t k, const float* a, int64_t lda,
                   int64_t r, float* y) {
  if (m == 0 || r == 0) return;
  if (const Kernels* kn = active_kernels()) {
    kn->xat_bf16(x, static_cast<int>(m), k, a, lda, static_cast<int>(r), y);
    return;
  }
  xat_rows_aten(x, m, k, a, lda, r, y);
}

void tw(const float* t, int64_t m, int64_t r, const float* w, int64_t ldw, int64_t n, float s,
        bool accumulate, float* out, int64_t ldo) {
  if (m == 0 || n == 0) return;
  std::vector<float*> rows(static_cast<size_t>(m));
  for (int64_t i = 0; i < m; ++i) rows[i] = out + i * ldo;
  const TwTerm term{t, r, w, ldw};
  tw_terms(&term, 1, m, n, s, accumulate, rows.data());
}

void tw_rows(const float* t, int64_t m, int64_t r, const float* w, int64_t ldw, int64_t n, float s,
             bool accumulate, float* const* out) {
  const TwTerm term{t, r, w, ldw};
  tw_terms(&term, 1, m, n, s, accumulate, out);
}

void tw_terms(const TwTerm* terms, int nterms, int64_t m, int64_t n, float s, bool accumulate,
              float* const* out) {
  if (m == 0 || n == 0 || nterms == 0) return;
  TORCH_CHECK(nterms <= 4, "lora_products::tw_terms: at most 4 terms, got ", nterms);
  if (const Kernels* kn = active_kernels()) {
    kernels::LoraTwTerm q[4];
    for (int i = 0; i < nterms; ++i)
      q[i] = {terms[i].t, static_cast<int>(terms[i].r), terms[i].w, terms[i].ldw};
    kn->tw(q, nterms, static_cast<int>(m), n, s, accumulate, out);
    return;
  }
  // Rows ld apart (a matrix) and wide enough for an ATen call: one addmm per term.
  const int64_t ld = m > 1 ? out[1] - out[0] : n;
  bool strided = ld >= n && n >= 64;
  for (int64_t i = 2; i < m && strided; ++i) strided = out[i] - out[i - 1] == ld;
  if (strided) {
    at::Tensor o = mat(out[0], m, n, ld);
    bool add_m = accumulate;
    for (int qi = 0; qi < nterms; ++qi) {
      const TwTerm& q = terms[qi];
      o.addmm_(mat(q.t, m, q.r, q.r), mat(q.w, q.r, n, q.ldw), add_m ? 1.0 : 0.0, s);
      add_m = true;
    }
    return;
  }
  // Plain loops (rows anywhere, few columns per call in the forward's epilogues: one ATen
  // call per row would cost more than the arithmetic).
  std::vector<float> acc(static_cast<size_t>(n));
  bool add = accumulate;
  for (int qi = 0; qi < nterms; ++qi) {
    const TwTerm& q = terms[qi];
    for (int64_t i = 0; i < m; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < q.r; ++j) {
        const float tij = q.t[i * q.r + j];
        const float* wj = q.w + j * q.ldw;
        for (int64_t c = 0; c < n; ++c) acc[c] += tij * wj[c];
      }
      float* o = out[i];
      for (int64_t c = 0; c < n; ++c) o[c] = add ? o[c] + s * acc[c] : s * acc[c];
    }
    add = true;
  }
}

void dtx(const float* d, int64_t ldd, int64_t m, int64_t r, const float* x, int64_t ldx, int64_t k,
         float s, float* g, int64_t ldg) {
  if (r == 0 || k == 0) return;
  if (const Kernels* kn = active_kernels()) {
    kn->dtx(d, ldd, static_cast<int>(m), static_cast<int>(r), x, ldx, k, s, g, ldg);
    return;
  }
  at::Tensor out = mat(g, r, k, ldg);
  out.addmm_(mat(d, m, r, ldd).t(), mat(x, m, k, ldx), 0.0, s);
}

void dtx_bf16(const float* d, int64_t ldd, int64_t m, int64_t r, const uint16_t* x, int64_t ldx,
              int64_t k, float s, float* g, int64_t ldg) {
  if (r == 0 || k == 0) return;
  if (const Kernels* kn = active_kernels()) {
    kn->dtx_bf16(d, ldd, static_cast<int>(m), static_cast<int>(r), x, ldx, k, s, g, ldg);
    return;
  }
  const at::Tensor xf =
      at::from_blob(const_cast<uint16_t*>(x), {m, k}, {ldx, 1}, at::kBFloat16).to(at::kFloat);
  dtx(d, ldd, m, r, xf.data_ptr<float>(), k, k, s, g, ldg);
}

}  // namespace kt::moe::lora_products
