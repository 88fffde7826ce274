// The bf16 tile kernel for CPUs with AMX: the product of the bf16 brgemm path
// (kernels/brgemm.h: the m bf16 activation rows, TileOperand::rows, times the
// packed 16-row blocks [k_pairs][16][2], fp32 sums) on AMX tiles, written here
// because oneDNN's brgemm, called per 16-row block, leaves the weight stream to
// the hardware prefetchers and reloads A for every block: the Qwen3-30B-A3B
// layer's prefill at T = 512 ran at 47% of the memory roofline on it (issue 26).
//
// TILE PLAN  tmm0 / tmm1: two A tiles (16 token rows x 32 k each, the second
//   only where the token tile has more than 16 rows); tmm2 / tmm3: the 16 k
//   pairs x 16 columns of two adjacent weight blocks, each a contiguous 1 KiB of
//   the packed layout (no repacking: [k_pairs][16][2] is AMX's B layout);
//   tmm4..7: the 2 x 2 fp32 accumulators. Each k step loads 2 + 2 tiles for four
//   tdpbf16ps. The pair's blocks stay in L2 for the expert's other token tiles.
// PREFETCH  during the first token tile's k loop, the next pair's blocks are
//   prefetched at the same k offsets (16 lines per block per k step: what that
//   step reads; prefetcht0, whose L2 copy is what the next pair finds, a pair
//   being 2 x 64 KiB at k = 2048). Qwen3-30B-A3B layer, 2 threads (Xeon with AMX,
//   medians of 3): T = 512 78.8 / 86.7 ms, T = 2048 167.7 / 190.6 ms with / without
//   (oneDNN's brgemm in the same runs 75-78 and 181-200 ms). Both T are held below
//   the read bandwidth by the core's outstanding misses (the stalls sit on the
//   prefetches), not by the tile products.
// K TAIL  k pairs past the last multiple of 16 go through zero-padded copies of
//   the A rows' and the block's tail (the A rows are zero past k only to an even
//   count), so one tile configuration serves every k.
// Each output's sum runs over k in order in one accumulator tile, whatever the
// token tiling: results do not depend on m's split or the thread count.
//
// Compiled in the avx512 tier with a function-level target (amx-tile,
// amx-bf16); run only where the CPU has AMX and the kernel granted its tile
// data (amx_tiles_permitted).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "formats/bf16.h"
#include "kernels/avx512/amx_tiles.h"
#include "kernels/block_args.h"
#include "kernels/kernel_api.h"
#include "kernels/tiers.h"

#ifdef KT_AMX_TILES_AVAILABLE  // kernels/avx512/amx_tiles.h: a compiler with AMX targets
#define KT_HAVE_AMX_TARGET 1
#endif

namespace kt::kernels::avx512 {

#if defined(KT_HAVE_AMX_TARGET) && defined(__x86_64__) && defined(__linux__)
namespace {

#define KT_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

using amx::kTileRows;
constexpr int kKStep = 32;           // bf16 values per tile row (64 bytes)
constexpr int kPairsPerStep = 16;    // k pairs per B tile
constexpr int kBlockElems = 16 * 2;  // elements per k pair of a block
constexpr int64_t kLine = 64;        // bytes per cache line

// One token tile (rows <= 32: TWO_A when > 16) times one block (b1 == nullptr) or
// two: out[i][0..16) (and out[i][16..32)) = sum over k of a[i][k] * w[k][col].
// `a` rows are lda elements apart; steps k steps of 32 from the blocks, then the
// zero-padded tails a_tail ([rows][32], lda 32) and b0_tail / b1_tail (1 KiB each)
// where they are not null. pf0 / pf1: blocks to prefetch at the same k offsets.
template <bool TWO_A, bool PAIR>
KT_AMX_TARGET void tile_product(const uint16_t* a, int64_t lda, const uint16_t* b0,
                                const uint16_t* b1, int64_t steps, const uint16_t* a_tail,
                                const uint16_t* b0_tail, const uint16_t* b1_tail, float* out,
                                float* out1, int64_t ldo, const uint8_t* pf0, const uint8_t* pf1) {
  const int64_t a_stride = lda * 2;
  _tile_zero(4);
  if (PAIR) _tile_zero(5);
  if (TWO_A) {
    _tile_zero(6);
    if (PAIR) _tile_zero(7);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* ak = a + s * kKStep;
    const uint16_t* bk0 = b0 + s * kPairsPerStep * kBlockElems;
    _tile_loadd(2, bk0, 64);
    _tile_loadd(0, ak, a_stride);
    if (pf0 != nullptr) {  // this step's 1 KiB of each of the next pair's blocks
      const uint8_t* p0 = pf0 + s * kPairsPerStep * kBlockElems * 2;
      for (int l = 0; l < 16; ++l)
        _mm_prefetch(reinterpret_cast<const char*>(p0 + l * kLine), _MM_HINT_T0);
      if (pf1 != nullptr) {
        const uint8_t* p1 = pf1 + s * kPairsPerStep * kBlockElems * 2;
        for (int l = 0; l < 16; ++l)
          _mm_prefetch(reinterpret_cast<const char*>(p1 + l * kLine), _MM_HINT_T0);
      }
    }
    _tile_dpbf16ps(4, 0, 2);
    if (TWO_A) {
      _tile_loadd(1, ak + kTileRows * lda, a_stride);
      _tile_dpbf16ps(6, 1, 2);
    }
    if (PAIR) {
      _tile_loadd(3, b1 + s * kPairsPerStep * kBlockElems, 64);
      _tile_dpbf16ps(5, 0, 3);
      if (TWO_A) _tile_dpbf16ps(7, 1, 3);
    }
  }
  if (a_tail != nullptr) {
    _tile_loadd(0, a_tail, kKStep * 2);
    _tile_loadd(2, b0_tail, 64);
    _tile_dpbf16ps(4, 0, 2);
    if (TWO_A) {
      _tile_loadd(1, a_tail + kTileRows * kKStep, kKStep * 2);
      _tile_dpbf16ps(6, 1, 2);
    }
    if (PAIR) {
      _tile_loadd(3, b1_tail, 64);
      _tile_dpbf16ps(5, 0, 3);
      if (TWO_A) _tile_dpbf16ps(7, 1, 3);
    }
  }
  const int64_t c_stride = ldo * 4;
  _tile_stored(4, out, c_stride);
  if (PAIR) _tile_stored(5, out1, c_stride);
  if (TWO_A) {
    _tile_stored(6, out + kTileRows * ldo, c_stride);
    if (PAIR) _tile_stored(7, out1 + kTileRows * ldo, c_stride);
  }
}

using TileProduct = void (*)(const uint16_t*, int64_t, const uint16_t*, const uint16_t*, int64_t,
                             const uint16_t*, const uint16_t*, const uint16_t*, float*, float*,
                             int64_t, const uint8_t*, const uint8_t*);

}  // namespace

bool amx_tiles_permitted() {
  // Linux hands out AMX tile data per process on request (ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA, Documentation/arch/x86/xstate.rst); oneDNN asks the same.
  static const bool ok =
      syscall(SYS_arch_prctl, 0x1023 /*ARCH_REQ_XCOMP_PERM*/, 18 /*XFEATURE_XTILEDATA*/) == 0;
  return ok;
}

namespace {

// The m rows x (ld apart, k values) times block b0 (and b1, or nullptr) of k pairs kp2
// into out0 (and out1), ldo apart; pf0 / pf1 (or nullptr) prefetched meanwhile.
// `configured`: the tile shape loaded (amx::ensure_2x2).
KT_AMX_TARGET void blocks_product(const uint16_t* x, int64_t ld, int m, int64_t kp2,
                                  const uint16_t* b0, const uint16_t* b1, float* out0, float* out1,
                                  int64_t ldo, const uint8_t* pf0, const uint8_t* pf1,
                                  int* configured) {
  const int64_t steps = kp2 / kPairsPerStep;
  const int64_t tail_pairs = kp2 - steps * kPairsPerStep;
  // The k tails, zero padded to one k step: A's per token tile (at most 32 rows at a
  // time), the blocks' once.
  alignas(64) uint16_t a_tail[2 * kTileRows * kKStep];
  alignas(64) uint16_t b_tail[2][kPairsPerStep * kBlockElems];
  if (tail_pairs != 0) {
    for (int j = 0; j < (b1 != nullptr ? 2 : 1); ++j) {
      std::memset(b_tail[j], 0, sizeof(b_tail[j]));
      std::memcpy(b_tail[j], (j ? b1 : b0) + steps * kPairsPerStep * kBlockElems,
                  tail_pairs * kBlockElems * sizeof(uint16_t));
    }
  }
  for (int i0 = 0; i0 < m; i0 += 2 * kTileRows) {
    const int rows = std::min(2 * kTileRows, m - i0);
    const int r0 = std::min(kTileRows, rows), r1 = rows - r0;
    amx::ensure_2x2(r0, r1, configured);
    const uint16_t* at = nullptr;
    if (tail_pairs != 0) {
      std::memset(a_tail, 0, sizeof(a_tail));
      for (int i = 0; i < rows; ++i)
        std::memcpy(a_tail + i * kKStep, x + (i0 + i) * ld + steps * kKStep,
                    2 * tail_pairs * sizeof(uint16_t));
      at = a_tail;
    }
    static constexpr TileProduct kProducts[2][2] = {
        {tile_product<false, false>, tile_product<false, true>},
        {tile_product<true, false>, tile_product<true, true>}};
    // The next pair is prefetched once, under the first token tile.
    kProducts[r1 > 0][b1 != nullptr](x + i0 * ld, ld, b0, b1, steps, at, b_tail[0], b_tail[1],
                                     out0 + i0 * ldo, out1 + i0 * ldo, ldo, i0 == 0 ? pf0 : nullptr,
                                     i0 == 0 ? pf1 : nullptr);
  }
}

}  // namespace

KT_AMX_TARGET void amx_bf16_dot(const DotArgs& a, const TileOperand& op) {
  const ProjectionView& p = *a.proj;
  const int64_t kp2 = formats::bf16_k_pairs(p.k);
  const auto* x = static_cast<const uint16_t*>(op.rows);
  int configured = -1;
  for (int64_t nb = a.nb_begin; nb < a.nb_end; nb += 2) {
    const bool pair = nb + 1 < a.nb_end;
    const auto* b0 = reinterpret_cast<const uint16_t*>(p.block(a.expert, nb));
    const uint16_t* b1 =
        pair ? reinterpret_cast<const uint16_t*>(p.block(a.expert, nb + 1)) : nullptr;
    float* out = a.out + 16 * (nb - a.nb_begin);
    blocks_product(x, op.ld, a.m, kp2, b0, b1, out, out + 16, a.ldo,
                   nb + 2 < a.nb_end ? p.block(a.expert, nb + 2) : nullptr,
                   nb + 3 < a.nb_end ? p.block(a.expert, nb + 3) : nullptr, &configured);
  }
  _tile_release();
}

KT_AMX_TARGET void amx_bf16_dot_pair(const DotArgs& a0, const DotArgs& a1, const TileOperand& op) {
  // Block a0.nb_begin of one projection and a1.nb_begin of another (gate and up) with the
  // same rows: each A tile loaded once for both (a block per call reloaded A from L2 for
  // every block, as often as it read the block's weights).
  int configured = -1;
  blocks_product(static_cast<const uint16_t*>(op.rows), op.ld, a0.m,
                 formats::bf16_k_pairs(a0.proj->k),
                 reinterpret_cast<const uint16_t*>(a0.proj->block(a0.expert, a0.nb_begin)),
                 reinterpret_cast<const uint16_t*>(a1.proj->block(a1.expert, a1.nb_begin)), a0.out,
                 a1.out, a0.ldo, nullptr, nullptr, &configured);
  _tile_release();
}

namespace {

// This thread's two decoded blocks [kp/2][16][2] (bf16), 64-byte aligned.
uint16_t* decoded_blocks(int64_t kp) {
  thread_local amx::ThreadBuffer buf;
  return static_cast<uint16_t*>(buf.get(2 * static_cast<size_t>(kp) * 16 * sizeof(uint16_t)));
}

}  // namespace

// int8 per channel times bf16 rows, exactly (the LoRA forward on an int8 base): each block's
// codes decoded to their bf16 values (int8_to_bf16_vnni), the same tile products, the
// channel scales on the outputs: oneDNN's int8_bf16 path on these tiles.
KT_AMX_TARGET void amx_int8_bf16_dot(const DotArgs& a, const TileOperand& op) {
  const ProjectionView& p = *a.proj;
  uint16_t* dec = decoded_blocks(p.kp);
  uint16_t* dec1 = dec + p.kp * 16;
  const auto* x = static_cast<const uint16_t*>(op.rows);
  int configured = -1;
  for (int64_t nb = a.nb_begin; nb < a.nb_end; nb += 2) {
    const bool pair = nb + 1 < a.nb_end;
    const QintBlock blk0 = qint_block(a, nb);
    const QintBlock blk1 = pair ? qint_block(a, nb + 1) : blk0;
    int8_to_bf16_vnni(blk0.block, p.kp, dec);
    if (pair) int8_to_bf16_vnni(blk1.block, p.kp, dec1);
    blocks_product(x, op.ld, a.m, p.kp / 2, dec, pair ? dec1 : nullptr, blk0.out, blk1.out, a.ldo,
                   nullptr, nullptr, &configured);
    scale_columns16(blk0.out, a.m, a.ldo, blk0.scales, p.qint.scale_type);
    if (pair) scale_columns16(blk1.out, a.m, a.ldo, blk1.scales, p.qint.scale_type);
  }
  _tile_release();
}

KT_AMX_TARGET void amx_int8_bf16_dot_pair(const DotArgs& a0, const DotArgs& a1,
                                          const TileOperand& op) {
  const int64_t kp = a0.proj->kp;
  uint16_t* dec = decoded_blocks(kp);
  uint16_t* dec1 = dec + kp * 16;
  const QintBlock blk0 = qint_block(a0, a0.nb_begin), blk1 = qint_block(a1, a1.nb_begin);
  int8_to_bf16_vnni(blk0.block, kp, dec);
  int8_to_bf16_vnni(blk1.block, kp, dec1);
  int configured = -1;
  blocks_product(static_cast<const uint16_t*>(op.rows), op.ld, a0.m, kp / 2, dec, dec1, blk0.out,
                 blk1.out, a0.ldo, nullptr, nullptr, &configured);
  scale_columns16(blk0.out, a0.m, a0.ldo, blk0.scales, a0.proj->qint.scale_type);
  scale_columns16(blk1.out, a1.m, a1.ldo, blk1.scales, a1.proj->qint.scale_type);
  _tile_release();
}

#endif  // KT_HAVE_AMX_TARGET

}  // namespace kt::kernels::avx512
