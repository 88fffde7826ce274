// q8 activation records, portable reference tier: the scalar definition
// itself (formats/q8_activations.h).
#include "formats/q8_activations.h"
#include "kernels/tiers.h"

namespace kt::kernels::ref {

void quantize_row_q8(const float* x, int64_t kp, uint8_t* rec) {
  formats::quantize_row_q8(x, kp, rec);
}

}  // namespace kt::kernels::ref
