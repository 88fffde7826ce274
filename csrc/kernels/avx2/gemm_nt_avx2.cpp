// gemm_nt_f32 (kernels/gemm_nt.h) on AVX2 + FMA: register tiles of 3 rows of a times
// 4 rows of b, 12 accumulators of 8 lanes over the reduction (lane t % 8), each summed
// by a fixed tree at the end, the last k % 8 terms added by scalar FMAs. On Zen 3 MKL's
// sgemm copied every decoded panel into its own packed layout first (a sixth of its
// time in the LoRA backward); these tiles read the panel where it is, and ask for the
// next panel's weights meanwhile (the caller's PrefetchChunks).
#include <algorithm>
#include <cmath>

#include "kernels/avx2/vec.h"
#include "kernels/gemm_nt.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx2 {

namespace {

constexpr int kRowsA = 3, kRowsB = 4;

template <int MR, int NR>
void tile(int64_t k, const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
          int64_t ldc, bool accumulate) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int64_t k8 = k / 8 * 8;
  for (int64_t t = 0; t < k8; t += 8) {
    __m256 av[MR];
    for (int i = 0; i < MR; ++i) av[i] = _mm256_loadu_ps(a + i * lda + t);
    for (int j = 0; j < NR; ++j) {
      const __m256 bv = _mm256_loadu_ps(b + j * ldb + t);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(av[i], bv, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      float s = Vec::sum(acc[i][j]);
      for (int64_t t = k8; t < k; ++t) s = std::fma(a[i * lda + t], b[j * ldb + t], s);
      float& out = c[i * ldc + j];
      out = accumulate ? out + s : s;
    }
  }
}

using Tile = void (*)(int64_t, const float*, int64_t, const float*, int64_t, float*, int64_t, bool);

template <int MR>
constexpr Tile tile_for(int nr) {
  return nr == 1 ? &tile<MR, 1> : nr == 2 ? &tile<MR, 2> : nr == 3 ? &tile<MR, 3> : &tile<MR, 4>;
}

Tile tile_for(int mr, int nr) {
  return mr == 1 ? tile_for<1>(nr) : mr == 2 ? tile_for<2>(nr) : tile_for<3>(nr);
}

// Lines of a PrefetchChunks to L2 (the source of the caller's next panel), a share before
// each tile: the decoder that reads them next then waits on L2, not on DRAM (its reads are
// short runs a block apart, where the hardware prefetchers start cold).
class Prefetcher {
 public:
  Prefetcher(const PrefetchChunks& src, int64_t tiles)
      : src_(src), per_tile_(tiles > 0 ? (src.lines + tiles - 1) / tiles : 0) {}
  void next_share() {
    if (src_.base == nullptr) return;
    const auto* base = static_cast<const char*>(src_.base);
    const int log2 = src_.chunk_lines_log2;
    const int64_t mask = (int64_t{1} << log2) - 1;
    const int64_t end = std::min(src_.lines, done_ + per_tile_);
    for (; done_ < end; ++done_)
      _mm_prefetch(base + (done_ >> log2) * src_.stride + (done_ & mask) * 64, _MM_HINT_T1);
  }

 private:
  const PrefetchChunks& src_;
  int64_t per_tile_;
  int64_t done_ = 0;
};

}  // namespace

// Columns of c (rows of b) outer, rows of a inner: the kRowsB rows of b a tile reads
// stay in L1 while every row of a passes them.
void gemm_nt_f32(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda, const float* b,
                 int64_t ldb, float* c, int64_t ldc, bool accumulate, const PrefetchChunks& next) {
  Prefetcher prefetch(next, ((n + kRowsB - 1) / kRowsB) * ((m + kRowsA - 1) / kRowsA));
  for (int64_t j0 = 0; j0 < n; j0 += kRowsB) {
    const int nr = static_cast<int>(std::min<int64_t>(kRowsB, n - j0));
    for (int64_t i0 = 0; i0 < m; i0 += kRowsA) {
      const int mr = static_cast<int>(std::min<int64_t>(kRowsA, m - i0));
      prefetch.next_share();
      tile_for(mr, nr)(k, a + i0 * lda, lda, b + j0 * ldb, ldb, c + i0 * ldc + j0, ldc, accumulate);
    }
  }
}

}  // namespace kt::kernels::avx2
