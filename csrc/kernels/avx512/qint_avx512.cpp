// qint x q8 integer dot products, AVX-512 tier (F/BW/VL/DQ): the
// kernels/qint_tiles.h template with 512-bit pmaddubsw/pmaddwd traits (one zmm
// per 16-row line). The weight-only fp32 path is the AVX2 tier's.
#include "kernels/avx512/vec.h"
#include "kernels/qint_tiles.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

namespace {

void qint_run(const DotArgs& a) {
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb)
    kernels::qint_dot<QintVec512<false>>(qint_block(a, nb), ref::qint_block_dot);
}

}  // namespace

const ProjectionKernels& qint_kernels() {
  static const ProjectionKernels k{"avx512/qint_q8", &qint_run, avx2::qint_kernels().dot_fp32,
                                   avx2::qint_kernels().fp32_name};
  return k;
}

}  // namespace kt::kernels::avx512
