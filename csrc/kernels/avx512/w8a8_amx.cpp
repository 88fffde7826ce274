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

#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
    (defined(__clang__) && __clang_major__ >= 12)
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
    static constexpr TileSums kSums[2][2] = {{tile_sums<false, false>, tile_sums<false, true>},
                                             {tile_sums<true, false>, tile_sums<true, true>}};
    kSums[r1 > 0][pair](x + i0 * ld, ld, b0, b1, steps, b_tail[0], b_tail[1], tail_bytes != 0, c[0],
                        c[1], i0 == 0 ? pf0 : nullptr, i0 == 0 ? pf1 : nullptr);
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

#endif  // KT_HAVE_AMX_INT8_TARGET

}  // namespace kt::kernels::avx512
