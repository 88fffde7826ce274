// bf16 expert kernels, portable reference tier: plain scalar C++ on the packed
// layout (formats/bf16.h), no intrinsics; std::exp for SiLU. It is the path of
// last resort on any CPU and the independent check of the SIMD tiers.
#include <cmath>

#include "formats/bf16.h"
#include "kernels/kernel_api.h"

namespace kt::kernels::ref {

namespace {

using formats::bf16_bits_to_float;

// acc[r] = sum over k of W[r][k] * x[k] for the 16 rows of one block.
void block_dot(const float* x, const uint16_t* w, int k_pairs, float* acc) {
  for (int r = 0; r < 16; ++r) acc[r] = 0.0f;
  for (int p = 0; p < k_pairs; ++p) {
    const uint16_t* wp = w + 32 * static_cast<int64_t>(p);
    const float x0 = x[2 * p];
    const float x1 = x[2 * p + 1];
    for (int r = 0; r < 16; ++r) {
      acc[r] += bf16_bits_to_float(wp[2 * r]) * x0 + bf16_bits_to_float(wp[2 * r + 1]) * x1;
    }
  }
}

void gate_up_silu(const GateUpArgs& a) {
  float g[16], u[16];
  for (int i = 0; i < a.m; ++i) {
    block_dot(a.x_rows[i], a.gate_block, a.k_pairs, g);
    block_dot(a.x_rows[i], a.up_block, a.k_pairs, u);
    for (int r = 0; r < a.n_valid; ++r) {
      a.h_rows[i][a.out_col + r] = g[r] / (1.0f + std::exp(-g[r])) * u[r];
    }
  }
}

void down_scaled(const DownArgs& a) {
  float y[16];
  for (int i = 0; i < a.m; ++i) {
    block_dot(a.h_rows[i], a.down_block, a.k_pairs, y);
    for (int r = 0; r < a.n_valid; ++r) a.y_rows[i][a.out_col + r] = a.scales[i] * y[r];
  }
}

}  // namespace

const Bf16Kernels& bf16_kernels() {
  static const Bf16Kernels k{"ref", &gate_up_silu, &down_scaled};
  return k;
}

}  // namespace kt::kernels::ref
