// The one interface between the ISA-free MoE driver (csrc/moe) and the
// per-ISA kernels (csrc/kernels/<isa>/): a kernel multiplies a run of 16-row
// blocks of ONE expert's projection with a tile of m activation rows and
// writes the dot products. SwiGLU and the routing-weight scale are the
// driver's epilogue, not the kernels'. A streaming kernel (decode: one
// 16-row block at a time, read once) and a tile kernel (prefill: whole tiles
// to a matrix engine) both fit this shape. Kernels never allocate, never
// spawn threads and assume valid input (the op layer validated it).
#pragma once

#include <cstdint>

#include "formats/format_table.h"
#include "formats/qint.h"

namespace kt::kernels {

// One projection of every expert, as the kernels see it (pointers into the
// validated packed tensors; csrc/moe/moe_layer.h builds it).
struct ProjectionView {
  formats::Layout layout;
  // kQint: bits, signedness, table, implicit zero, group size and the scale /
  // zero storage types of this projection.
  formats::QintFormat qint;
  const uint8_t* weight;  // [E][row_blocks][block_bytes]
  const void* scales;     // kQint: [E][row_blocks][groups][16]; kFp8: [E][ceil(n/128)][ceil(k/128)]
  const void* zeros;      // kQint with explicit zeros: like scales; else nullptr
  int64_t n, k;           // dense [n, k] per expert (nn.Linear convention)
  int64_t kp;             // K extent of the activations (multiple of 32; bf16 reads ceil(k/2)*2)
  int64_t row_blocks;     // ceil(n / 16)
  int64_t groups;         // kQint: scale groups along K
  int64_t block_bytes;    // bytes of one 16-row block

  const uint8_t* block(int64_t e, int64_t nb) const {
    return weight + (e * row_blocks + nb) * block_bytes;
  }
};

// out[i * ldo + 16 * (nb - nb_begin) + r] = sum_k W_e[16 nb + r][k] * x_i[k]
// for i < m, nb in [nb_begin, nb_end), r < 16 (rows past n may hold anything).
struct DotArgs {
  const ProjectionView* proj;
  int64_t expert;
  int64_t nb_begin, nb_end;
  const float* const* x;     // m fp32 rows, proj->kp long, zero padded past k
  const uint8_t* const* xq;  // m q8 records (formats/q8_activations.h) of the same rows, or
                             // nullptr when the kernel's activation type is kF32
  int m;
  float* out;
  int64_t ldo;     // >= 16 * (nb_end - nb_begin)
  float* scratch;  // >= 16 * proj->kp floats, for kernels that decode a block first
  // The same m rows rounded to bf16, row i at xb + i * ldxb (zero padded past
  // k to an even count), for the brgemm tile kernels (kernels/brgemm.h);
  // nullptr for the streaming kernels.
  const uint16_t* xb = nullptr;
  int64_t ldxb = 0;
  // The codes of the m q8 records shifted to u8, with the compensation rows
  // (kernels/brgemm.h, gather_u8s8_rows: tiles of chunk-major rows), for the u8s8
  // brgemm kernel; nullptr otherwise.
  const uint8_t* xu8 = nullptr;
  // The codes of the m q8 records shifted to u8 (code ^ 0x80 = code + 128),
  // packed in tiles of kU8TileRows tokens (pack_u8_tiles), for streaming
  // kernels with ProjectionKernels::u8_codes on 8-bit signed formats (int8,
  // q8_0); nullptr: those kernels use the sign trick on xq instead (same results).
  const uint8_t* xq_u8 = nullptr;
  // Names the content of the m rows behind x for kernels that keep results
  // made from them between calls on one thread (the fp8 brgemm's scaled rows
  // and 2-block results, kernels/brgemm.h): the same nonzero id and x mean
  // the same rows. The driver passes its (call, phase); 0: nothing is reused.
  uint64_t rows_id = 0;
};

// Tokens per tile of the u8 streaming kernel (kernels/qint_tiles.h,
// qint8_u8_block_dot) and of DotArgs::xq_u8's packing.
constexpr int kU8TileRows = 12;

// DotArgs::xq_u8 of m q8 records of kp codes: the tile of rows [i0, i0 + mt)
// (i0 a multiple of kU8TileRows, mt = min(kU8TileRows, m - i0)) at dst + i0 * kp
// as [kp / 4][mt][4]: the 4-byte k-quads of the tile's tokens side by side, so
// the kernel broadcasts every token's quad from one pointer (12 row pointers
// spilled to the stack and reloaded per line before). dst: m * kp bytes.
inline void pack_u8_tiles(const uint8_t* const* records, int m, int64_t kp, uint8_t* dst) {
  for (int i0 = 0; i0 < m; i0 += kU8TileRows) {
    const int mt = m - i0 < kU8TileRows ? m - i0 : kU8TileRows;
    uint8_t* tile = dst + i0 * kp;
    for (int i = 0; i < mt; ++i) {
      const uint8_t* codes = records[i0 + i];
      for (int64_t q = 0; q < kp / 4; ++q)
        for (int b = 0; b < 4; ++b)
          tile[(q * mt + i) * 4 + b] = static_cast<uint8_t>(codes[q * 4 + b] ^ 0x80u);
    }
  }
}

// The kernels of one layout on one ISA tier.
struct ProjectionKernels {
  const char* name;  // "<isa>/<kernel>", reported by kt_ops.info() and the tests
  // The format's own path: q8 integer dot products (kQint), E4M3 decoded in
  // registers (kFp8), bf16 widened in registers (kBf16).
  void (*dot)(const DotArgs&);
  // The weight-only path (w4a16 style): each block decoded once to fp32 in
  // `scratch`, then fp32 FMAs with x. nullptr where `dot` already multiplies
  // fp32 activations with exact weights (bf16).
  void (*dot_fp32)(const DotArgs&);
  const char* fp32_name;
  // `dot` multiplies 8-bit signed codes with DotArgs::xq_u8 when the caller
  // supplies it (the AVX512_VNNI tier's vpdpbusd, u8 x s8); the driver then
  // makes those rows once per call.
  bool u8_codes = false;
};

// The q8 activation record of one fp32 row x[kp] (formats/q8_activations.h),
// vectorized per tier (kernels/q8_quantize.h).
using QuantizeRowQ8 = void (*)(const float* x, int64_t kp, uint8_t* rec);

}  // namespace kt::kernels
