// bf16 kernels and the SwiGLU epilogue, AVX2 tier: the bf16_tiles.h and
// swiglu.h templates with this tier's vector traits (avx2/vec.h). See
// bf16_tiles.h for the register plan.
#include "kernels/avx2/vec.h"
#include "kernels/bf16_tiles.h"
#include "kernels/swiglu.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx2 {

const ProjectionKernels& bf16_kernels() {
  static const ProjectionKernels k{"avx2/bf16", &bf16_dot<Vec>, nullptr, nullptr};
  return k;
}

void silu_mul_rows(float* g, const float* u, int m) { kernels::silu_mul_rows<Vec>(g, u, m); }

}  // namespace kt::kernels::avx2
