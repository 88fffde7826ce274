// bf16 expert kernels, portable reference tier: the bf16_tiles.h templates
// over plain C++ 16-lane arrays (ref/vec.h). Runs on any CPU; the tests check
// it, like every tier, against the dense PyTorch reference.
#include "kernels/bf16_tiles.h"
#include "kernels/ref/vec.h"

namespace kt::kernels::ref {

const Bf16Kernels& bf16_kernels() {
  static const Bf16Kernels k{"ref", &gate_up_silu<Vec>, &down_scaled<Vec>};
  return k;
}

}  // namespace kt::kernels::ref
