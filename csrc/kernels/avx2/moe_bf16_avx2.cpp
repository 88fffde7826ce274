// bf16 expert kernels, AVX2 + FMA tier: the bf16_tiles.h templates with
// 8-lane vectors (two ymm per 16-row block). See bf16_tiles.h for the plan.
#include "kernels/avx2/vec.h"
#include "kernels/bf16_tiles.h"

namespace kt::kernels::avx2 {

const Bf16Kernels& bf16_kernels() {
  static const Bf16Kernels k{"avx2", &gate_up_silu<Vec>, &down_scaled<Vec>};
  return k;
}

}  // namespace kt::kernels::avx2
