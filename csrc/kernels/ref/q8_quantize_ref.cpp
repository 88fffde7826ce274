// q8 activation records, portable reference tier: the scalar definition
// itself (formats/q8_activations.h), with the u8 shift of DotArgs::xq_u8.
#include "formats/q8_activations.h"
#include "kernels/tiers.h"

namespace kt::kernels::ref {

void quantize_row_q8(const float* x, int64_t kp, uint8_t* rec, uint8_t* u8) {
  formats::quantize_row_q8(x, kp, rec);
  if (u8 == nullptr) return;
  for (int64_t k = 0; k < kp; ++k) u8[k] = static_cast<uint8_t>(rec[k] ^ 0x80u);
}

}  // namespace kt::kernels::ref
