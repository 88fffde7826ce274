// Per-block views of a DotArgs (kernel_api.h) for the kernels that work one
// 16-row block at a time, and the loop that hands them out. ISA-free: every
// tier includes it.
#pragma once

#include <cstdint>

#include "formats/bf16.h"  // ceil_div
#include "formats/fp8.h"
#include "formats/qint.h"
#include "kernels/kernel_api.h"

namespace kt::kernels {

// Bytes of one stored scale / zero of a qint projection.
inline int64_t scale_bytes(formats::ScaleType t) {
  switch (t) {
    case formats::ScaleType::kF32:
      return 4;
    case formats::ScaleType::kF16:
    case formats::ScaleType::kBF16:
      return 2;
    default:
      return 1;
  }
}

// One 16-row block of a qint projection with m q8 activation rows.
struct QintBlock {
  const uint8_t* const* x_rows;  // m q8 records of kp values
  int m;
  const uint8_t* block;  // one block of codes (formats::qint_block_bytes)
  const void* scales;    // [G][16] scales of this block, in format->scale_type (k-quants:
                         // the block's [Kp/256] super-block records, formats/qint.h)
  const void* zeros;     // [G][16] zeros of this block, or nullptr (implicit zero)
  const formats::QintFormat* format;
  int64_t kp;
  float* out;  // out[i * ldo + r], r < 16
  int64_t ldo;
  // 8-bit signed codes: the m records' codes shifted to u8 in tiles
  // (pack_u8_tiles; ProjectionKernels::dot_u8), or nullptr.
  const uint8_t* x_u8;
};

// One 16-row block of an fp8 projection ([Kp][16] E4M3 bytes) with m fp32 rows.
struct Fp8Block {
  const float* const* x_rows;
  int m;
  const uint8_t* block;
  const float* scales;  // [ceil(k/128)] scales of this block's 128-row band
  int64_t kp;
  float* out;
  int64_t ldo;
  // Row-scaled formats (fp8_channel, mxfp8): this block's [G][16] scales in
  // row_scale_type, one group per group_k k (a multiple of 32); scales is then nullptr.
  const void* row_scales = nullptr;
  formats::ScaleType row_scale_type = formats::ScaleType::kF32;
  int64_t group_k = 0;
};

// Block nb of a's run; x_u8: dot_u8's tiles of the m rows, or nullptr.
inline QintBlock qint_block(const DotArgs& a, int64_t nb, const uint8_t* x_u8 = nullptr) {
  const ProjectionView& p = *a.proj;
  const int64_t block = a.expert * p.row_blocks + nb;
  auto at = [&](const void* base, formats::ScaleType t) -> const void* {
    return base == nullptr
               ? nullptr
               : static_cast<const uint8_t*>(base) +
                     block * formats::qint_block_param_bytes(t, p.groups, p.kp, scale_bytes(t));
  };
  return {a.xq,
          a.m,
          p.block(a.expert, nb),
          at(p.scales, p.qint.scale_type),
          at(p.zeros, p.qint.zero_type),
          &p.qint,
          p.kp,
          a.out + 16 * (nb - a.nb_begin),
          a.ldo,
          x_u8};
}

// The [ceil(k/128)] scales of block nb's 128-row band.
inline const float* fp8_band_scales(const DotArgs& a, int64_t nb) {
  const ProjectionView& p = *a.proj;
  const int64_t bands = formats::ceil_div(p.n, formats::kFp8ScaleBlock);
  const int64_t kblocks = formats::ceil_div(p.k, formats::kFp8ScaleBlock);
  const int64_t band = nb * formats::kQintBlockRows / formats::kFp8ScaleBlock;
  return static_cast<const float*>(p.scales) + (a.expert * bands + band) * kblocks;
}

inline Fp8Block fp8_block(const DotArgs& a, int64_t nb) {
  const ProjectionView& p = *a.proj;
  if (p.fp8_row_scales) {
    const formats::ScaleType t = p.qint.scale_type;
    const uint8_t* s = static_cast<const uint8_t*>(p.scales) +
                       (a.expert * p.row_blocks + nb) * p.groups * 16 * scale_bytes(t);
    return {a.x,
            a.m,
            p.block(a.expert, nb),
            nullptr,
            p.kp,
            a.out + 16 * (nb - a.nb_begin),
            a.ldo,
            s,
            t,
            p.qint.group_size == 0 ? p.kp : p.qint.group_size};
  }
  return {a.x,
          a.m,
          p.block(a.expert, nb),
          fp8_band_scales(a, nb),
          p.kp,
          a.out + 16 * (nb - a.nb_begin),
          a.ldo};
}

// The weight-only path over a run of blocks: decode(block, w) writes the
// block as fp32 W^T [kp][16] (w[k * 16 + r] = W[r][k]) into `w` (16 * kp
// floats, ProjectionKernels::dot_fp32's block), then dense(x, m, w, kp, out,
// ldo) multiplies it with the fp32 rows.
template <class Block, class MakeBlock, class Decode, class Dense>
inline void weight_only_dot(const DotArgs& a, float* w, MakeBlock make, Decode decode,
                            Dense dense) {
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const Block b = make(a, nb);
    decode(b, w);
    dense(a.x, a.m, w, a.proj->kp, a.out + 16 * (nb - a.nb_begin), a.ldo);
  }
}

}  // namespace kt::kernels
