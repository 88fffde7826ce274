// bf16 expert kernels, AVX-512 tier: the bf16_tiles.h templates with 16-lane
// vectors (one zmm per 16-row block). See bf16_tiles.h for the plan.
#include "kernels/avx512/vec.h"
#include "kernels/bf16_tiles.h"

namespace kt::kernels::avx512 {

const Bf16Kernels& bf16_kernels() {
  static const Bf16Kernels k{"avx512", &gate_up_silu<Vec>, &down_scaled<Vec>};
  return k;
}

}  // namespace kt::kernels::avx512
