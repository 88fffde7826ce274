// q8 activations: the int8 form of an activation row that the qint kernels
// multiply (llama.cpp's q8_0 activation format plus per-16 sums).
//
// A row of Kp values (Kp a multiple of 32) is one record:
//   int8  q[Kp]          q = round_half_even(x * 127 / amax), per 32-block amax
//   float scale[Kp/32]   amax / 127 (0 for an all-zero block)
//   float sum16[Kp/16]   scale * sum(q over the 16-block): the zero-point term
// x ~= scale[k/32] * q[k]. Records are padded to 64 bytes.
// A 32-block holding a NaN or an infinity gets q = 0 and scale = sum16 = NaN,
// so that every output it reaches is NaN, as in torch's own matmul (a plain
// amax would skip a NaN and quietly drop it).
// The SIMD tiers quantize with kernels/q8_quantize.h, bit-identical to this.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>

namespace kt::formats {

inline int64_t q8_record_bytes(int64_t kp) {
  const int64_t bytes = kp + 4 * (kp / 32) + 4 * (kp / 16);
  return (bytes + 63) / 64 * 64;
}
inline const int8_t* q8_codes(const uint8_t* rec) { return reinterpret_cast<const int8_t*>(rec); }
inline const float* q8_scales(const uint8_t* rec, int64_t kp) {
  return reinterpret_cast<const float*>(rec + kp);
}
inline const float* q8_sum16(const uint8_t* rec, int64_t kp) {
  return reinterpret_cast<const float*>(rec + kp + 4 * (kp / 32));
}

// Quantizes one fp32 row x[kp] (zero padded past the real width) into rec.
inline void quantize_row_q8(const float* x, int64_t kp, uint8_t* rec) {
  auto* q = reinterpret_cast<int8_t*>(rec);
  auto* scale = reinterpret_cast<float*>(rec + kp);
  auto* sum16 = reinterpret_cast<float*>(rec + kp + 4 * (kp / 32));
  for (int64_t b = 0; b < kp / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.f;
    bool finite = true;
    for (int j = 0; j < 32; ++j) {
      const float a = std::fabs(xb[j]);
      finite = finite && a <= FLT_MAX;  // false for NaN and +-inf
      amax = std::fmax(amax, a);
    }
    if (!finite) {
      const float nan = std::numeric_limits<float>::quiet_NaN();
      for (int j = 0; j < 32; ++j) q[32 * b + j] = 0;
      scale[b] = sum16[2 * b] = sum16[2 * b + 1] = nan;
      continue;
    }
    const float d = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int sums[2] = {0, 0};
    for (int j = 0; j < 32; ++j) {
      // nearbyint rounds half to even in the default rounding mode.
      const int v = static_cast<int>(std::nearbyint(xb[j] * inv));
      q[32 * b + j] = static_cast<int8_t>(v);
      sums[j / 16] += v;
    }
    scale[b] = d;
    sum16[2 * b] = d * static_cast<float>(sums[0]);
    sum16[2 * b + 1] = d * static_cast<float>(sums[1]);
  }
}

}  // namespace kt::formats
