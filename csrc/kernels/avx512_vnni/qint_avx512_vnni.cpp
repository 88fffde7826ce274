// qint x q8 integer dot products, AVX512_VNNI tier: the kernels/qint_tiles.h
// template with vpdpbusd (u8 codes x s8 activations accumulated straight into
// int32, one zmm per 16-row line; 8-bit signed codes against the activations
// shifted to u8, ProjectionKernels::dot_u8: qint8_u8_block_dot). The
// weight-only fp32 path is the AVX2 tier's. Bit-identical to the avx2 and avx512 tiers: the int32
// sums are exact and the fp32 fold is the same sequence of operations.
#include "kernels/avx512_vnni/vec.h"
#include "kernels/qint_tiles.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512_vnni {

namespace {

void qint_run(const DotArgs& a) {
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb)
    kernels::qint_dot<QintVec>(qint_block(a, nb), ref::qint_block_dot);
}

// 8-bit signed codes with the activations' codes as u8 tiles (qint8_u8_block_dot).
void qint_run_u8(const DotArgs& a, const uint8_t* x_u8) {
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb)
    kernels::qint_dot<QintVec>(qint_block(a, nb, x_u8), ref::qint_block_dot);
}

}  // namespace

const ProjectionKernels& qint_kernels() {
  static const ProjectionKernels k{
      "avx512_vnni/qint_q8",          &qint_run,    avx2::qint_kernels().dot_fp32,
      avx2::qint_kernels().fp32_name, &qint_run_u8, formats::Fp32Class::kVnni};
  return k;
}

}  // namespace kt::kernels::avx512_vnni
