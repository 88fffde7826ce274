// The ScaleType of a scales / zeros tensor's dtype: the one place that maps
// torch dtypes to formats/qint.h's storage types (op checks, dense decoders).
#pragma once

#include <c10/core/ScalarType.h>

#include "formats/qint.h"

namespace kt::formats {

// fp32 / fp16 / bf16 -> kF32 / kF16 / kBF16; uint8 -> kE8M0 when `e8m0`
// (mxfp4's UE8M0 exponents); anything else -> kNone.
inline ScaleType scale_type_of(c10::ScalarType t, bool e8m0 = false) {
  switch (t) {
    case c10::ScalarType::Float:
      return ScaleType::kF32;
    case c10::ScalarType::Half:
      return ScaleType::kF16;
    case c10::ScalarType::BFloat16:
      return ScaleType::kBF16;
    case c10::ScalarType::Byte:
      return e8m0 ? ScaleType::kE8M0 : ScaleType::kNone;
    default:
      return ScaleType::kNone;
  }
}

}  // namespace kt::formats
