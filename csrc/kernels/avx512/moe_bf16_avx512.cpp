// bf16 kernels and the SwiGLU epilogue, AVX512 tier: the bf16_tiles.h and
// swiglu.h templates with this tier's vector traits (avx512/vec.h). See
// bf16_tiles.h for the register plan.
#include "kernels/avx512/vec.h"
#include "kernels/bf16_tiles.h"
#include "kernels/swiglu.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

const ProjectionKernels& bf16_kernels() {
  static const ProjectionKernels k{"avx512/bf16", &bf16_dot<Vec>, nullptr, nullptr};
  return k;
}

void silu_mul_rows(float* g, const float* u, int m) { kernels::silu_mul_rows<Vec>(g, u, m); }

}  // namespace kt::kernels::avx512
