// bf16 kernels and the GLU activation epilogues, portable reference tier: the
// bf16_tiles.h templates over plain C++ 16-lane arrays (ref/vec.h). Runs on
// any CPU; the tests check it, like every tier, against the dense PyTorch
// reference.
#include "kernels/activations.h"
#include "kernels/bf16_tiles.h"
#include "kernels/ref/vec.h"
#include "kernels/tiers.h"

namespace kt::kernels::ref {

const ProjectionKernels& bf16_kernels() {
  static const ProjectionKernels k{"ref/bf16", &bf16_dot<Vec>, nullptr, nullptr};
  return k;
}

GluRows glu_rows(const Glu& glu) { return kernels::glu_rows_for<Vec>(glu); }
GluBackwardRows glu_backward_rows(const Glu& glu) {
  return kernels::glu_backward_rows_for<Vec>(glu);
}

}  // namespace kt::kernels::ref
