// Entry points that several tiers share (declarations only, no intrinsics):
// the ref tier's kernels and scalar per-block kernels, and the AVX2 tier's,
// whose fp8 and weight-only kernels the AVX-512 tiers reuse. The tier table
// in dispatch.cpp declares the rest; a tier that lacks a layout falls back
// there, never inside a kernel.
#pragma once

#include "kernels/block_args.h"
#include "kernels/kernel_api.h"

namespace kt::kernels {

namespace ref {
const ProjectionKernels& bf16_kernels();
const ProjectionKernels& qint_kernels();
const ProjectionKernels& fp8_kernels();
void silu_mul_rows(float* g, const float* u, int m);
// Scalar per-block kernels, also the SIMD tiers' answer for a code width
// they do not specialise.
void qint_block_dot(const QintBlock& b);
void qint_block_decode(const QintBlock& b, float* w);
}  // namespace ref

// Weak: null when the compiler could not build the AVX2 tier (dispatch.cpp).
namespace avx2 {
__attribute__((weak)) const ProjectionKernels& bf16_kernels();
__attribute__((weak)) const ProjectionKernels& qint_kernels();
__attribute__((weak)) const ProjectionKernels& fp8_kernels();
__attribute__((weak)) void silu_mul_rows(float* g, const float* u, int m);
}  // namespace avx2

}  // namespace kt::kernels
