// Portable reference kernels of the quantized layouts: plain loops over the
// scalar decoders of formats/qint.h and formats/fp8.h, with the same integer
// sums and the same fp32 fold points as the SIMD kernels (per 16 or 32 k),
// so any ISA path can be checked against them and against the dense
// reference.
#include <cstdint>

#include "formats/fp8.h"
#include "formats/q8_activations.h"
#include "formats/qint.h"
#include "kernels/block_args.h"
#include "kernels/tiers.h"

namespace kt::kernels::ref {

using formats::QintFormat;

namespace {

// Scale (min = false) or explicit zero (min = true) of row r, group g.
inline float param(const QintBlock& a, int64_t g, int r, bool min) {
  const QintFormat& f = *a.format;
  if (formats::is_kquant(f.scale_type))
    return formats::kquant_param(a.scales, f.scale_type, g, r, min);
  return min ? formats::scale_value(a.zeros, f.zero_type, g * 16 + r)
             : formats::scale_value(a.scales, f.scale_type, g * 16 + r);
}

// Whether the block has explicit zeros (a zeros tensor or q4_K/q5_K mins).
inline bool explicit_zeros(const QintBlock& a) {
  return formats::qint_subtracts_zeros(a.format->scale_type, a.zeros != nullptr);
}

}  // namespace

void qint_block_dot(const QintBlock& a) {
  const QintFormat& f = *a.format;
  const int64_t kp = a.kp;
  const int64_t unit = formats::qint_fold_unit(f.group_size);
  const int64_t gsize = f.group_size == 0 ? kp : f.group_size;
  for (int i = 0; i < a.m; ++i) {
    const uint8_t* rec = a.x_rows[i];
    const int8_t* xq = formats::q8_codes(rec);
    const float* xscale = formats::q8_scales(rec, kp);
    const float* xsum16 = formats::q8_sum16(rec, kp);
    for (int r = 0; r < formats::kQintBlockRows; ++r) {
      float acc = 0.f;
      for (int64_t k0 = 0; k0 < kp; k0 += unit) {
        int32_t isum = 0;
        for (int64_t k = k0; k < k0 + unit; ++k) {
          isum += formats::qint_code(a.block, f, kp, r, k) * static_cast<int32_t>(xq[k]);
        }
        const int64_t g = k0 / gsize;
        const float s = param(a, g, r, false);
        const float xa = xscale[k0 / 32] * static_cast<float>(isum);
        float xs = xsum16[k0 / 16];
        if (unit == 32) xs += xsum16[k0 / 16 + 1];
        if (explicit_zeros(a)) {
          const float z = param(a, g, r, true);
          acc += s * xa - z * xs;
        } else {
          acc += s * (xa - f.zero_offset * xs);
        }
      }
      a.out[i * a.ldo + r] = acc;
    }
  }
}

void qint_block_decode(const QintBlock& a, float* w) {
  const QintFormat& f = *a.format;
  const int64_t gsize = f.group_size == 0 ? a.kp : f.group_size;
  for (int64_t k = 0; k < a.kp; ++k) {
    const int64_t g = k / gsize;
    for (int r = 0; r < 16; ++r) {
      const float s = param(a, g, r, false);
      const float q = static_cast<float>(formats::qint_code(a.block, f, a.kp, r, k));
      // Implicit zeros: s (q - offset), rounded once (q - offset is exact), as
      // dequantize_weights; s q - s offset would round s offset (nvfp4: fp32 s times 12).
      w[k * 16 + r] = explicit_zeros(a) ? s * q - param(a, g, r, true) : s * (q - f.zero_offset);
    }
  }
}

namespace {

// The scale of row r for k-group k0 / step (row-scaled formats) or 128-k block.
float fp8_scale(const Fp8Block& a, int r, int64_t k0, int64_t step) {
  if (a.row_scales != nullptr)
    return formats::fp8_row_scale(a.row_scales, a.row_scale_type, (k0 / step) * 16 + r);
  return a.scales[k0 / step];
}

void fp8_block_dot(const Fp8Block& a) {
  const int64_t kBlock = a.row_scales != nullptr ? a.group_k : formats::kFp8ScaleBlock;
  for (int i = 0; i < a.m; ++i) {
    const float* x = a.x_rows[i];
    for (int r = 0; r < 16; ++r) {
      float acc = 0.f;
      for (int64_t k0 = 0; k0 < a.kp; k0 += kBlock) {
        float part = 0.f;
        const int64_t k1 = k0 + kBlock < a.kp ? k0 + kBlock : a.kp;
        for (int64_t k = k0; k < k1; ++k) {
          const uint8_t bits = a.block[k * 16 + r];
          part += formats::e4m3_to_float(bits) * x[k];
        }
        acc += part * fp8_scale(a, r, k0, kBlock);
      }
      a.out[i * a.ldo + r] = acc;
    }
  }
}

void fp8_block_decode(const Fp8Block& a, float* w) {
  const int64_t step = a.row_scales != nullptr ? a.group_k : formats::kFp8ScaleBlock;
  for (int64_t k = 0; k < a.kp; ++k)
    for (int r = 0; r < 16; ++r)
      w[k * 16 + r] =
          formats::e4m3_to_float(a.block[k * 16 + r]) * fp8_scale(a, r, k - k % step, step);
}

void dense_dot(const float* const* x, int m, const float* w, int64_t kp, float* out, int64_t ldo) {
  for (int i = 0; i < m; ++i) {
    float acc[16] = {};
    for (int64_t k = 0; k < kp; ++k)
      for (int r = 0; r < 16; ++r) acc[r] += w[k * 16 + r] * x[i][k];
    for (int r = 0; r < 16; ++r) out[i * ldo + r] = acc[r];
  }
}

void qint_run(const DotArgs& a) {
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) qint_block_dot(qint_block(a, nb));
}
void qint_run_fp32(const DotArgs& a, float* block) {
  weight_only_dot<QintBlock>(
      a, block, [](const DotArgs& d, int64_t nb) { return qint_block(d, nb); }, qint_block_decode,
      dense_dot);
}
void fp8_run(const DotArgs& a) {
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) fp8_block_dot(fp8_block(a, nb));
}
void fp8_run_fp32(const DotArgs& a, float* block) {
  weight_only_dot<Fp8Block>(a, block, fp8_block, fp8_block_decode, dense_dot);
}

}  // namespace

const ProjectionKernels& qint_kernels() {
  static const ProjectionKernels k{"ref/qint_q8", &qint_run, &qint_run_fp32, "ref/qint_fp32"};
  return k;
}

const ProjectionKernels& fp8_kernels() {
  static const ProjectionKernels k{"ref/fp8", &fp8_run, &fp8_run_fp32, "ref/fp8_fp32"};
  return k;
}

}  // namespace kt::kernels::ref
