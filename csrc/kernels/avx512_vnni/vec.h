// Vector traits for the AVX512_VNNI tier: the AVX-512 traits with vpdpbusd
// (avx512/vec.h, QintVec512<true>). Included only by files in
// kernels/avx512_vnni/, compiled with the flags below (read by
// cmake/isa_kernels.cmake).
// ISA flags: -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -mavx512vnni
#pragma once

#include "kernels/avx512/vec.h"

namespace kt::kernels::avx512_vnni {

using QintVec = avx512::QintVec512<true>;

}  // namespace kt::kernels::avx512_vnni
