// What each ISA tier's object library exports (declarations only, no
// intrinsics): the kernels of each layout and the SwiGLU epilogue. The table
// in dispatch.cpp picks among them; a tier that lacks a layout falls back
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

namespace avx2 {
const ProjectionKernels& bf16_kernels();
const ProjectionKernels& qint_kernels();
const ProjectionKernels& fp8_kernels();
void silu_mul_rows(float* g, const float* u, int m);
}  // namespace avx2

namespace avx512 {
const ProjectionKernels& bf16_kernels();
const ProjectionKernels& qint_kernels();
void silu_mul_rows(float* g, const float* u, int m);
}  // namespace avx512

namespace avx512_vnni {
const ProjectionKernels& qint_kernels();
}  // namespace avx512_vnni

}  // namespace kt::kernels
