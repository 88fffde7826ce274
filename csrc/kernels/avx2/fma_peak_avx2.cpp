// The vector FMA units' rate, for the benchmarks' fp32 ceiling (benchmarks/machine_peaks.py,
// through kt_ops._C._testing.fma_peak_gflops): torch.mm's fp32 rate is its BLAS's, not the
// CPU's (MKL's sgemm on a Zen 3 core: 22 GFLOP/s at 512^3, 56 at 1024^3; this loop 94).
// 256-bit FMAs: on Zen 4 a 512-bit FMA does the same work in twice the time, and where
// 512-bit FMAs are faster (Intel's two 512-bit FMA units) the BLAS reaches them.
#include "kernels/avx2/vec.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx2 {

double fma_chains(int64_t iters, float* sink) {
  // Independent chains: two FMA pipes times a 4-5 cycle latency need 8-10 in flight.
  constexpr int kChains = 12;
  const __m256 mul = _mm256_set1_ps(0.999999f), add = _mm256_set1_ps(1e-7f);
  __m256 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(c));
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = _mm256_fmadd_ps(acc[c], mul, add);
  }
  __m256 s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm256_add_ps(s, acc[c]);
  *sink = _mm256_cvtss_f32(s);  // the result is used: the loop cannot be dropped
  return 2.0 * Vec::kLanes * kChains * static_cast<double>(iters);
}

}  // namespace kt::kernels::avx2
