// Weight format "fp8": E4M3 codes (Micikevicius et al. 2022, "FP8 Formats
// for Deep Learning"; torch.float8_e4m3fn: bias 7, no infinities, NaN =
// S.1111.111) with one fp32 scale per 128x128 block of [N, K], as in
// DeepSeek-V3 checkpoints (`weight_scale_inv`). docs/formats.md.
//
// LAYOUT  weight [E, ceil(N/16), Kp, 16] uint8 (Kp = K padded to 32):
//         packed[e, nb, k, r] = bits(W[e, 16nb + r, k]); one 16-byte row
//         holds one k of the block's 16 rows, so a 32-byte load is 2 k x 16
//         rows, widened through fp16 (F16C) with no shuffles across rows.
//         scales [E, ceil(N/128), ceil(K/128)] fp32, unchanged from the
//         checkpoint: W = e4m3(code) * scales[e, n/128, k/128].
// Row-scaled variants (FormatRow::fp8_row_scales): "fp8_channel" and "mxfp8" keep
// the codes' layout and hold one scale per row and group of k, like qint's:
//         scales [E, NB, G, 16] (G = 1 per output channel, Kp/32 for mxfp8),
//         W = e4m3(code) * scales[e, n/16, k/group, n%16]; fp32, or UE8M0 bytes
//         (2^(E-127), OCP MX v1.0) for mxfp8.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "formats/qint.h"

namespace kt::formats {

constexpr int64_t kFp8ScaleBlock = 128;
// mxfp8: k per UE8M0 exponent (OCP MX v1.0 block size).
constexpr int64_t kMxfp8GroupK = 32;

inline int64_t fp8_block_bytes(int64_t kp) { return 16 * kp; }

// Scalar reference: the value of one E4M3 code.
inline float e4m3_to_float(uint8_t bits) {
  const int sign = bits >> 7;
  const int exp = (bits >> 3) & 15;
  const int mant = bits & 7;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), -9);  // subnormal: 2^-6 * m/8
  } else {
    v = std::ldexp(1.f + static_cast<float>(mant) / 8.f, exp - 7);
  }
  return sign ? -v : v;
}

// One row scale of a row-scaled fp8 format as fp32: an fp32 value, or the UE8M0
// byte E as 2^(E-127) (exact, 2^-127 included; 255 is rejected by the packer).
inline float fp8_row_scale(const void* scales, ScaleType t, int64_t i) {
  if (t == ScaleType::kE8M0) {
    const uint32_t e = static_cast<const uint8_t*>(scales)[i];
    const uint32_t bits = e >= 1 ? e << 23 : 1u << 22;
    float v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
  return static_cast<const float*>(scales)[i];
}

}  // namespace kt::formats
