// q8 activation records, AVX-512 tier: kernels/q8_quantize.h with this tier's
// fp32 vector traits (avx512/vec.h).
#include "kernels/avx512/vec.h"
#include "kernels/q8_quantize.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

void quantize_row_q8(const float* x, int64_t kp, uint8_t* rec) {
  kernels::quantize_row_q8<Vec>(x, kp, rec);
}

}  // namespace kt::kernels::avx512
