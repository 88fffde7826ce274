// int8 per channel times per-token int8 activations on AMX tiles (tdpbssd): the
// product of oneDNN's w8a8 kernel (kernels/brgemm.h, w8a8_dot: full-K int32 sums,
// then out = sum * x_scale * w_scale), with the tile plan of the bf16 AMX kernel
// (kernels/avx512/amx_tiles.h: 2 x 2 tiles over pairs of 16-row blocks, the next
// pair prefetched under the first token tile). The packed int8 block [kp/4][16][4]
// is AMX's B layout as stored: each 64-k step of a block is one contiguous 1 KiB
// tile. The activations are signed (tdpbssd, s8 x s8), so no compensation row;
// the int32 sums are exact, and the epilogue is oneDNN path's (w8a8_epilogue):
// bit-identical to oneDNN's w8a8 kernel and across thread counts.
//
// Compiled in the avx512 tier with a function-level target (amx-tile, amx-int8);
// run only where the CPU has AMX and Linux granted the tile data.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/avx512/amx_tiles.h"
#include "kernels/block_args.h"
#include "kernels/kernel_api.h"
#include "kernels/tiers.h"

#ifdef KT_AMX_TILES_AVAILABLE  // kernels/avx512/amx_tiles.h: a compiler with AMX targets
#define KT_HAVE_AMX_INT8_TARGET 1
#endif

namespace kt::kernels::avx512 {

#if defined(KT_HAVE_AMX_INT8_TARGET) && defined(__x86_64__) && defined(__linux__)
namespace {

#define KT_AMX_INT8_TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw")))

using amx::kTileRows;
constexpr int kKStep = 64;        // int8 values per tile row
constexpr int kStepBytes = 1024;  // one block's 64 k: [16][16][4]
constexpr int64_t kLine = 64;

int64_t scale_bytes(int m) { return (static_cast<int64_t>(m) * 4 + 63) / 64 * 64; }
// Rows padded with zeros to a whole k step, plus a line (rows 4 KiB apart share L1 sets).
int64_t row_ld(int64_t kp) { return (kp + kKStep - 1) / kKStep * kKStep + 64; }

// One token tile (rows <= 32: TWO_A when > 16) times one block or two (PAIR): the int32
// sums of `steps` 64-k steps, then the tails (a_tail rows of 64, b tails of 1 KiB) where
// a_tail is not null, into c0 (and c1) as [rows][16].
template <bool TWO_A, bool PAIR>
KT_AMX_INT8_TARGET void tile_sums(const int8_t* a, int64_t lda, const int8_t* b0, const int8_t* b1,
                                  int64_t steps, const int8_t* b0_tail, const int8_t* b1_tail,
                                  bool tail, int32_t* c0, int32_t* c1, const uint8_t* pf0,
                                  const uint8_t* pf1) {
  _tile_zero(4);
  if (PAIR) _tile_zero(5);
  if (TWO_A) {
    _tile_zero(6);
    if (PAIR) _tile_zero(7);
  }
  const int64_t total = steps + (tail ? 1 : 0);
  for (int64_t s = 0; s < total; ++s) {
    const bool t = s == steps;  // the zero-padded tail step (A rows are padded in place)
    const int8_t* ak = a + s * kKStep;
    _tile_loadd(2, t ? b0_tail : b0 + s * kStepBytes, 64);
    _tile_loadd(0, ak, lda);
    if (pf0 != nullptr && !t) {  // this step's 1 KiB of each of the next pair's blocks
      for (int l = 0; l < 16; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(pf0 + s * kStepBytes + l * kLine), _MM_HINT_T0);
      if (pf1 != nullptr)
        for (int l = 0; l < 16; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(pf1 + s * kStepBytes + l * kLine),
                       _MM_HINT_T0);
    }
    _tile_dpbssd(4, 0, 2);
    if (TWO_A) {
      _tile_loadd(1, ak + kTileRows * lda, lda);
      _tile_dpbssd(6, 1, 2);
    }
    if (PAIR) {
      _tile_loadd(3, t ? b1_tail : b1 + s * kStepBytes, 64);
      _tile_dpbssd(5, 0, 3);
      if (TWO_A) _tile_dpbssd(7, 1, 3);
    }
  }
  _tile_stored(4, c0, 64);
  if (PAIR) _tile_stored(5, c1, 64);
  if (TWO_A) {
    _tile_stored(6, c0 + kTileRows * 16, 64);
    if (PAIR) _tile_stored(7, c1 + kTileRows * 16, 64);
  }
}

using TileSums = void (*)(const int8_t*, int64_t, const int8_t*, const int8_t*, int64_t,
                          const int8_t*, const int8_t*, bool, int32_t*, int32_t*, const uint8_t*,
                          const uint8_t*);
// tile_sums by [two A tiles][a pair of blocks].
constexpr TileSums kTileSums[2][2] = {{tile_sums<false, false>, tile_sums<false, true>},
                                      {tile_sums<true, false>, tile_sums<true, true>}};

}  // namespace

int64_t amx_w8a8_bytes(int m, int64_t kp) { return scale_bytes(m) + m * row_ld(kp); }

void pack_amx_w8a8_rows(const float* const* x, int m, int64_t kp, uint8_t* dst) {
  auto* scales = reinterpret_cast<float*>(dst);
  uint8_t* rows = dst + scale_bytes(m);
  const int64_t ld = row_ld(kp);
  quantize_rows_i8_token(x, m, kp, rows, ld, scales);  // codes + 128, scales amax / 127
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int i = 0; i < m; ++i) {
    uint8_t* r = rows + i * ld;
    int64_t k = 0;
    for (; k + 64 <= kp; k += 64)  // to signed codes: (q + 128) ^ 0x80 = q
      _mm512_storeu_si512(r + k, _mm512_xor_si512(_mm512_loadu_si512(r + k), flip));
    for (; k < kp; ++k) r[k] ^= 0x80u;
    std::memset(r + kp, 0, ld - kp);  // the tail step's zeros
  }
}

namespace {

// The m packed rows (op.rows: scales, then signed codes row_ld(kp) apart) times blk0 (and
// blk1, or nullptr: they may belong to two projections with the same kp) into their
// outputs; pf0 / pf1 (or nullptr) prefetched meanwhile. `configured`: amx::ensure_2x2.
KT_AMX_INT8_TARGET void blocks_product(const void* packed, int m, int64_t kp,
                                       formats::ScaleType scale_type, const QintBlock& blk0,
                                       const QintBlock* blk1, const uint8_t* pf0,
                                       const uint8_t* pf1, int* configured) {
  const int64_t ld = row_ld(kp);
  const int64_t steps = kp / kKStep;
  const int64_t tail_bytes = (kp - steps * kKStep) * 16;  // of a block: k / 4 lines of 64
  const auto* x_scales = static_cast<const float*>(packed);
  const auto* x =
      reinterpret_cast<const int8_t*>(static_cast<const uint8_t*>(packed) + scale_bytes(m));
  const bool pair = blk1 != nullptr;
  const auto* b0 = reinterpret_cast<const int8_t*>(blk0.block);
  const auto* b1 = pair ? reinterpret_cast<const int8_t*>(blk1->block) : nullptr;
  alignas(64) int8_t b_tail[2][kStepBytes];
  if (tail_bytes != 0) {
    for (int j = 0; j < (pair ? 2 : 1); ++j) {
      std::memset(b_tail[j], 0, kStepBytes);
      std::memcpy(b_tail[j], (j ? b1 : b0) + steps * kStepBytes, tail_bytes);
    }
  }
  // Each block's sums [32][16] and a zero row after the tile's rows (w8a8_epilogue's
  // compensation: none with signed activations).
  alignas(64) int32_t c[2][(2 * kTileRows + 1) * 16];
  for (int i0 = 0; i0 < m; i0 += 2 * kTileRows) {
    const int rows = std::min(2 * kTileRows, m - i0);
    const int r0 = std::min(kTileRows, rows), r1 = rows - r0;
    amx::ensure_2x2(r0, r1, configured);
    kTileSums[r1 > 0][pair](x + i0 * ld, ld, b0, b1, steps, b_tail[0], b_tail[1], tail_bytes != 0,
                            c[0], c[1], i0 == 0 ? pf0 : nullptr, i0 == 0 ? pf1 : nullptr);
    for (int j = 0; j < (pair ? 2 : 1); ++j) {
      const QintBlock& blk = j ? *blk1 : blk0;
      std::memset(c[j] + rows * 16, 0, 16 * sizeof(int32_t));
      w8a8_epilogue(c[j], rows, x_scales + i0, blk.scales, scale_type, false,
                    blk.out + i0 * blk.ldo, blk.ldo);
    }
  }
}

}  // namespace

KT_AMX_INT8_TARGET void amx_w8a8_dot(const DotArgs& a, const TileOperand& op) {
  const ProjectionView& p = *a.proj;
  int configured = -1;
  for (int64_t nb = a.nb_begin; nb < a.nb_end; nb += 2) {
    const bool pair = nb + 1 < a.nb_end;
    const QintBlock blk0 = qint_block(a, nb);
    const QintBlock blk1 = pair ? qint_block(a, nb + 1) : blk0;
    blocks_product(op.rows, a.m, p.kp, p.qint.scale_type, blk0, pair ? &blk1 : nullptr,
                   nb + 2 < a.nb_end ? p.block(a.expert, nb + 2) : nullptr,
                   nb + 3 < a.nb_end ? p.block(a.expert, nb + 3) : nullptr, &configured);
  }
  _tile_release();
}

KT_AMX_INT8_TARGET void amx_w8a8_dot_pair(const DotArgs& a0, const DotArgs& a1,
                                          const TileOperand& op) {
  // Gate and up's block with the same rows: each A tile loaded once for both.
  int configured = -1;
  const QintBlock blk0 = qint_block(a0, a0.nb_begin), blk1 = qint_block(a1, a1.nb_begin);
  blocks_product(op.rows, a0.m, a0.proj->kp, a0.proj->qint.scale_type, blk0, &blk1, nullptr,
                 nullptr, &configured);
  _tile_release();
}

// int4 (per channel, or groups of 64 / 128; unsigned codes c, with or without zeros) on
// the same tiles: each block's codes decoded once to c - 8 as signed bytes in the B
// layout (int4_to_s8_vnni, zero padded to a whole k step), the int32 sums of one group
// (or all of K) per pass, then oneDNN path's fold per group (w4a8_epilogue): the same
// integers and operations as oneDNN's w4a8 kernel, so the same bits.
namespace {

int64_t padded_k(int64_t kp) { return (kp + kKStep - 1) / kKStep * kKStep; }
// The w4a8 packing: pack_amx_w8a8_rows's, then each row's sum of q over K ([m] int32),
// then over each 32 k ([m][kp / 32] int32), each part 64-byte aligned.
int64_t q_sums_offset(int m, int64_t kp) { return amx_w8a8_bytes(m, kp); }
int64_t chunk_sums_offset(int m, int64_t kp) {
  return q_sums_offset(m, kp) + (static_cast<int64_t>(m) * 4 + 63) / 64 * 64;
}

// One pair (or one block) of int4 blocks on the packed rows: dec0 / dec1 the decoded
// blocks, padded_k(kp) * 16 bytes each.
KT_AMX_INT8_TARGET void int4_blocks_product(const void* packed, int m, int64_t kp, int64_t gk,
                                            const ProjectionView& p, const QintBlock& blk0,
                                            const QintBlock* blk1, const int8_t* dec0,
                                            const int8_t* dec1, int* configured) {
  const int64_t ld = row_ld(kp);
  const auto* base = static_cast<const uint8_t*>(packed);
  const auto* x_scales = reinterpret_cast<const float*>(base);
  const auto* x = reinterpret_cast<const int8_t*>(base + scale_bytes(m));
  const auto* q_sums = reinterpret_cast<const int32_t*>(base + q_sums_offset(m, kp));
  const auto* chunk_sums = reinterpret_cast<const int32_t*>(base + chunk_sums_offset(m, kp));
  const int64_t chunks = kp / 32, group_chunks = gk / 32;
  const int64_t groups = gk == kp ? 1 : kp / gk;
  const int64_t group_steps = gk == kp ? padded_k(kp) / kKStep : gk / kKStep;
  const bool pair = blk1 != nullptr;
  alignas(64) int32_t c[2][(2 * kTileRows + 1) * 16];
  int32_t group_q[2 * kTileRows];
  for (int i0 = 0; i0 < m; i0 += 2 * kTileRows) {
    const int rows = std::min(2 * kTileRows, m - i0);
    const int r0 = std::min(kTileRows, rows), r1 = rows - r0;
    amx::ensure_2x2(r0, r1, configured);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * gk;
      kTileSums[r1 > 0][pair](x + i0 * ld + k0, ld, dec0 + k0 * 16, pair ? dec1 + k0 * 16 : nullptr,
                              group_steps, nullptr, nullptr, false, c[0], c[1], nullptr, nullptr);
      const int32_t* qs = q_sums + i0;
      if (groups > 1) {
        for (int r = 0; r < rows; ++r) {
          const int32_t* cs = chunk_sums + (i0 + r) * chunks + g * group_chunks;
          int32_t t = 0;
          for (int64_t j = 0; j < group_chunks; ++j) t += cs[j];
          group_q[r] = t;
        }
        qs = group_q;
      }
      for (int j = 0; j < (pair ? 2 : 1); ++j) {
        const QintBlock& blk = j ? *blk1 : blk0;
        std::memset(c[j] + rows * 16, 0, 16 * sizeof(int32_t));
        w4a8_epilogue(c[j], rows, x_scales + i0, qs, blk.scales, p.qint.scale_type, blk.zeros,
                      p.qint.zero_type, g, g > 0, blk.out + i0 * blk.ldo, blk.ldo);
      }
    }
  }
}

// This thread's decoded blocks: two of padded_k(kp) * 16 bytes, 64-byte aligned.
int8_t* decoded_blocks(int64_t kp) {
  thread_local amx::ThreadBuffer buf;
  return static_cast<int8_t*>(buf.get(2 * static_cast<size_t>(padded_k(kp)) * 16));
}

// Block b's codes as signed bytes c - 8 at dst, zero past kp (a whole last k step).
void decode_int4(const uint8_t* block, int64_t kp, int8_t* dst) {
  int4_to_s8_vnni(block, kp, dst);
  std::memset(dst + kp * 16, 0, (padded_k(kp) - kp) * 16);
}

}  // namespace

int64_t amx_w4a8_bytes(int m, int64_t kp) {
  return chunk_sums_offset(m, kp) + (static_cast<int64_t>(m) * (kp / 32) * 4 + 63) / 64 * 64;
}

void pack_amx_w4a8_rows(const float* const* x, int m, int64_t kp, uint8_t* dst) {
  pack_amx_w8a8_rows(x, m, kp, dst);
  const auto* rows = reinterpret_cast<const int8_t*>(dst + scale_bytes(m));
  auto* q_sums = reinterpret_cast<int32_t*>(dst + q_sums_offset(m, kp));
  auto* chunk_sums = reinterpret_cast<int32_t*>(dst + chunk_sums_offset(m, kp));
  const int64_t ld = row_ld(kp), chunks = kp / 32;
  for (int i = 0; i < m; ++i) {
    const int8_t* r = rows + i * ld;
    int32_t t = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      int32_t u = 0;
      for (int k = 0; k < 32; ++k) u += r[c * 32 + k];
      chunk_sums[i * chunks + c] = u;
      t += u;
    }
    q_sums[i] = t;
  }
}

KT_AMX_INT8_TARGET void amx_w4a8_dot(const DotArgs& a, const TileOperand& op) {
  const ProjectionView& p = *a.proj;
  const int64_t kp = p.kp, gk = p.qint.group_size == 0 ? kp : p.qint.group_size;
  int8_t* dec = decoded_blocks(kp);
  int8_t* dec1 = dec + padded_k(kp) * 16;
  int configured = -1;
  for (int64_t nb = a.nb_begin; nb < a.nb_end; nb += 2) {
    const bool pair = nb + 1 < a.nb_end;
    const QintBlock blk0 = qint_block(a, nb);
    const QintBlock blk1 = pair ? qint_block(a, nb + 1) : blk0;
    decode_int4(blk0.block, kp, dec);
    if (pair) decode_int4(blk1.block, kp, dec1);
    int4_blocks_product(op.rows, a.m, kp, gk, p, blk0, pair ? &blk1 : nullptr, dec, dec1,
                        &configured);
  }
  _tile_release();
}

KT_AMX_INT8_TARGET void amx_w4a8_dot_pair(const DotArgs& a0, const DotArgs& a1,
                                          const TileOperand& op) {
  const ProjectionView& p = *a0.proj;
  const int64_t kp = p.kp, gk = p.qint.group_size == 0 ? kp : p.qint.group_size;
  if (a1.proj->qint.group_size != p.qint.group_size) {  // gate and up grouped apart
    amx_w4a8_dot(a0, op);
    amx_w4a8_dot(a1, op);
    return;
  }
  int8_t* dec = decoded_blocks(kp);
  int8_t* dec1 = dec + padded_k(kp) * 16;
  const QintBlock blk0 = qint_block(a0, a0.nb_begin), blk1 = qint_block(a1, a1.nb_begin);
  decode_int4(blk0.block, kp, dec);
  decode_int4(blk1.block, kp, dec1);
  int configured = -1;
  int4_blocks_product(op.rows, a0.m, kp, gk, p, blk0, &blk1, dec, dec1, &configured);
  _tile_release();
}

#endif  // KT_HAVE_AMX_INT8_TARGET

}  // namespace kt::kernels::avx512
