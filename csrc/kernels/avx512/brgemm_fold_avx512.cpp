// The epilogue of the u8s8 brgemm path (kernels/brgemm.h): the int32 sums of
// K chunks of 32, as oneDNN's brgemm returns them for the codes shifted to u8,
// folded into fp32 dot products. AVX-512 code; brgemm.cpp reaches it through a
// weak declaration (the path needs an AVX-512 tier anyway).
//
// Per row i and chunk c, in chunk order (qint_tiles.h's fold of the 8-bit
// formats, whose implicit zero is 0):
//   isum = C_c[i] - C_c[comp]                  exact: sum (x + 128) w - 128 sum w
//   acc  = fma(scale[g(c)], float(isum) * x_scale_i[c], acc)
// the same operations, in the same order, as the streaming avx2 / avx512 /
// avx512_vnni kernels, so the results are bit-identical to theirs (for finite
// activations: the streaming fold also subtracts 0 * x_sum).
#include <immintrin.h>

#include "formats/q8_activations.h"
#include "kernels/avx512/vec.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

// c: nc chunks of [rows + 1][16] int32 (row `rows`: the compensation row);
// chunk j is K chunk chunk0 + j. xq: the rows' q8 records (kp codes).
// scales: the block's [G][16] scales; group_size 0 = per channel.
// out[i * ldo + r] (i < rows, r < 16): the running fp32 sums, updated in place.
void brgemm_q8_fold(const int32_t* c, int nc, int rows, const uint8_t* const* xq, int64_t kp,
                    int64_t chunk0, const void* scales, formats::ScaleType scale_type,
                    int64_t group_size, float* out, int64_t ldo) {
  using V = QintVec512<false>;
  constexpr int kMaxChunks = 8;
  if (nc > kMaxChunks) __builtin_trap();  // brgemm.cpp passes at most kFoldChunks
  const int64_t gsize = group_size == 0 ? kp : group_size;
  const int64_t cstride = static_cast<int64_t>(rows + 1) * 16;
  __m512 s[kMaxChunks];
  __m512i comp[kMaxChunks];
  for (int j = 0; j < nc; ++j) {
    const int64_t k0 = (chunk0 + j) * 32;
    s[j] = V::load_scales(scales, scale_type, (k0 / gsize) * 16);
    comp[j] = _mm512_loadu_si512(c + j * cstride + rows * 16);
  }
  for (int i = 0; i < rows; ++i) {
    const float* xs = formats::q8_scales(xq[i], kp) + chunk0;
    __m512 acc = _mm512_loadu_ps(out + i * ldo);
    for (int j = 0; j < nc; ++j) {
      const __m512i isum = _mm512_sub_epi32(_mm512_loadu_si512(c + j * cstride + i * 16), comp[j]);
      const __m512 xa = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(xs[j]));
      acc = _mm512_fmadd_ps(s[j], xa, acc);
    }
    _mm512_storeu_ps(out + i * ldo, acc);
  }
}

}  // namespace kt::kernels::avx512
