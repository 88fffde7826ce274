// q8 activation records (formats/q8_activations.h) on a SIMD tier, written
// once over the tier's fp32 vector traits V (kernels/<isa>/vec.h). The scalar
// formats::quantize_row_q8 rounds each value with nearbyint and called libm
// per element: at T = 512 it took ~10% of an int8 prefill (perf, Zen 4).
// Same operations in the same fp32 precision (|x| max, amax / 127, 127 / amax,
// one multiply, round half to even), so the records are bit-identical to it.
#pragma once

#include <cstdint>
#include <limits>

#include "formats/q8_activations.h"

namespace kt::kernels {

#ifndef KT_ALWAYS_INLINE
#define KT_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

// One row x[kp] (kp a multiple of 32) into the q8 record rec.
template <class V>
void quantize_row_q8(const float* x, int64_t kp, uint8_t* rec) {
  using Reg = typename V::Reg;
  constexpr int NV = 32 / V::kLanes;  // registers per 32-block
  constexpr int PER16 = 16 / V::kLanes;
  auto* q = reinterpret_cast<int8_t*>(rec);
  float* scale = reinterpret_cast<float*>(rec + kp);
  float* sum16 = reinterpret_cast<float*>(rec + kp + 4 * (kp / 32));
  for (int64_t b = 0; b < kp / 32; ++b) {
    Reg v[NV];
    Reg amax = V::zero();
    bool finite = true;
    for (int j = 0; j < NV; ++j) {
      v[j] = V::load(x + 32 * b + j * V::kLanes);
      const Reg a = V::abs(v[j]);
      finite = finite && V::all_finite_abs(a);
      amax = V::max(amax, a);
    }
    if (!finite) {  // as formats::quantize_row_q8: NaN scale, zero codes
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int j = 0; j < 32; ++j) q[32 * b + j] = 0;
      scale[b] = sum16[2 * b] = sum16[2 * b + 1] = nan;
    } else {
      const float m = V::reduce_max(amax);
      const float d = m / 127.f;
      const Reg inv = V::set1(m > 0.f ? 127.f / m : 0.f);
      int sums[2] = {0, 0};
      for (int j = 0; j < NV; ++j)
        sums[j / PER16] += V::round_store_i8(V::mul(v[j], inv), q + 32 * b + j * V::kLanes);
      scale[b] = d;
      sum16[2 * b] = d * static_cast<float>(sums[0]);
      sum16[2 * b + 1] = d * static_cast<float>(sums[1]);
    }
  }
}

}  // namespace kt::kernels
