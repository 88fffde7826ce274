// The interface between the ISA-free MoE driver (csrc/moe) and the per-ISA
// kernels (csrc/kernels/<isa>/). Kernels see one weight block and a list of
// activation rows; they never allocate, never spawn threads and assume valid
// input (the op layer validated it).
#pragma once

#include <cstdint>

#include "formats/qint.h"

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

// Dot products of one 16-row block of a qint format (formats/qint.h) with m
// rows of q8 activations (moe/activation_q8.h):
//   out[i*16 + r] = sum_k W[r][k] * x_i[k]   for i < m, r < n_valid
// where W = scale * q - zero and x_i = the dequantized q8 row. Rows past
// n_valid may be left unwritten.
struct QintDotArgs {
  const uint8_t* const* x_rows;  // m q8 activation records of Kp values
  int m;
  const uint8_t* block;  // one 16-row block of codes (formats::qint_block_bytes)
  const void* scales;    // [G][16] scales of this block, in format->scale_type
  const void* zeros;     // [G][16] zeros of this block, or nullptr (implicit zero)
  const formats::QintFormat* format;
  int64_t kp;  // padded K (multiple of 32)
  int n_valid;
  float* out;  // [m][16]
};

// Dot products of one 16-row block of fp8 E4M3 codes ([Kp/4][16][4] bytes)
// with m rows of fp32 activations, times the 128x128 block scales:
//   out[i*16 + r] = sum_k e4m3(W[r][k]) * scales[k / 128] * x_i[k]
struct Fp8DotArgs {
  const float* const* x_rows;  // m rows of fp32, Kp long, zero padded
  int m;
  const uint8_t* block;  // [Kp/4][16][4] E4M3 bits
  const float* scales;   // [ceil(K/128)] scales of this block's 128-row band
  int64_t kp;
  int n_valid;
  float* out;  // [m][16]
};

// The weight-only ("dequantize, then fp32 FMA") path of the quantized
// formats, the w4a16 alternative to the integer dot: decode writes one
// 16-row block as fp32 W^T, w[k * 16 + r] = W[r][k] for k < Kp (qint:
// scale * q - zero; fp8: e4m3 * block scale); dense_dot multiplies it with m
// fp32 activation rows:  out[i*16 + r] = sum_k w[k * 16 + r] * x_i[k].
struct DenseDotArgs {
  const float* const* x_rows;  // m rows of fp32, Kp long, zero padded
  int m;
  const float* w;  // [Kp][16]
  int64_t kp;
  float* out;  // [m][16]
};

struct QuantKernels {
  const char* isa_name;
  void (*qint_dot)(const QintDotArgs&);
  void (*fp8_dot)(const Fp8DotArgs&);
  // gate[i] = silu(gate[i]) * up[i] over m rows of 16 ([m][16] fp32, in place).
  void (*silu_mul_rows)(float* gate, const float* up, int m);
  // Weight-only path (see DenseDotArgs); the decoders ignore x_rows, m, out.
  void (*qint_decode)(const QintDotArgs&, float* w);
  void (*fp8_decode)(const Fp8DotArgs&, float* w);
  void (*dense_dot)(const DenseDotArgs&);
};

namespace ref {
const Bf16Kernels& bf16_kernels();
const QuantKernels& quant_kernels();
}  // namespace ref
namespace avx2 {
const Bf16Kernels& bf16_kernels();
const QuantKernels& quant_kernels();
}  // namespace avx2
namespace avx512 {
const Bf16Kernels& bf16_kernels();
}

}  // namespace kt::kernels
