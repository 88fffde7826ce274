// The interface between the ISA-free MoE driver (csrc/moe) and the per-ISA
// kernels (csrc/kernels/<isa>/). Kernels see one weight block and a list of
// activation rows; they never allocate, never spawn threads and assume valid
// input (the op layer validated it).
#pragma once

#include <cstdint>

namespace kt::kernels {

// Fused gate/up projection + SwiGLU on one 16-row block of the bf16 layout
// (csrc/formats/bf16.h), for m tokens:
//   for i < m, r < n_valid:
//     g = sum_k x_rows[i][k] * Wg[r][k];  u = sum_k x_rows[i][k] * Wu[r][k]
//     h_rows[i][out_col + r] = silu(g) * u    (silu(g) = g / (1 + exp(-g)))
struct GateUpArgs {
  const float* const* x_rows;  // m rows of fp32 activations, each 2*k_pairs long, zero padded
  int m;
  const uint16_t* gate_block;  // [k_pairs][16][2] bf16 bits
  const uint16_t* up_block;    // [k_pairs][16][2] bf16 bits
  int k_pairs;
  float* const* h_rows;  // m output rows; columns [out_col, out_col + n_valid) are written
  int64_t out_col;       // 16 * (index of this block)
  int n_valid;           // rows of this block inside N (<= 16)
};

// Down projection on one 16-row block, scaled by each token's routing weight:
//   for i < m, r < n_valid:
//     y_rows[i][out_col + r] = scales[i] * sum_k h_rows[i][k] * Wd[r][k]
struct DownArgs {
  const float* const* h_rows;  // m rows of fp32, each 2*k_pairs long, zero padded
  int m;
  const uint16_t* down_block;  // [k_pairs][16][2] bf16 bits
  int k_pairs;
  float* const* y_rows;  // m output rows; columns [out_col, out_col + n_valid) written
  int64_t out_col;       // 16 * (index of this block)
  const float* scales;   // m routing weights
  int n_valid;
};

struct Bf16Kernels {
  const char* isa_name;
  void (*gate_up_silu)(const GateUpArgs&);
  void (*down_scaled)(const DownArgs&);
};

namespace ref {
const Bf16Kernels& bf16_kernels();
}
namespace avx2 {
const Bf16Kernels& bf16_kernels();
}
namespace avx512 {
const Bf16Kernels& bf16_kernels();
}

}  // namespace kt::kernels
