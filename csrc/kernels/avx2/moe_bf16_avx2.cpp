// bf16 kernels and the GLU activation epilogues, AVX2 tier: the bf16_tiles.h and
// activations.h templates with this tier's vector traits (avx2/vec.h). See
// bf16_tiles.h for the register plan.
#include "kernels/activations.h"
#include "kernels/avx2/vec.h"
#include "kernels/bf16_tiles.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx2 {

const ProjectionKernels& bf16_kernels() {
  static const ProjectionKernels k{"avx2/bf16", &bf16_dot<Vec>, nullptr, nullptr};
  return k;
}

GluRows glu_rows(const Glu& glu) { return kernels::glu_rows_for<Vec>(glu); }
GluBackwardRows glu_backward_rows(const Glu& glu) {
  return kernels::glu_backward_rows_for<Vec>(glu);
}

}  // namespace kt::kernels::avx2
