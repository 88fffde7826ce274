// The bf16 compute-bound kernel for AVX512_BF16 CPUs without AMX: the same
// product as the bf16 brgemm path (kernels/brgemm.h: the m bf16 activation
// rows (TileOperand::rows) times the packed 16-row block [k_pairs][16][2],
// fp32 sums), written
// with vdpbf16ps, because oneDNN's brgemm leaves the weight stream to the
// hardware prefetchers. A layer's prefill reads every expert's weights once
// from DRAM; measured on Zen 4 (one core, H = 2048, 16-row blocks streamed
// from DRAM, GFLOP/s): oneDNN 65-135 at m = 16, 95-160 at m = 32, while its
// kernel reaches ~225 on weights already in cache. This kernel prefetches the
// block kPrefetchLines ahead of its first token tile, inside the k loop.
//
// REGISTER PLAN  a tile is MT <= 28 token rows x 16 weight rows: MT zmm
//   accumulators, one weight line per k pair, each row's bf16 pair broadcast
//   straight from memory into vdpbf16ps (the {1to16} operand). m rows are cut
//   into ceil(m / 28) tiles of near-equal size; the first tile streams the
//   block from DRAM, the others find it in L2. Each row's sum runs over k
//   pairs in order in one accumulator, whatever the tiling: results do not
//   depend on m's split or the thread count.
//
// Compiled in the avx512 tier with a function-level target (avx512bf16): a
// tile kernel of the tier table (kernels/dispatch.cpp), which the plan runs
// only where brgemm::kt_bf16_runs() (AVX512_BF16) holds.
#include "formats/bf16.h"

#include <immintrin.h>

#include <cstdint>

#include "kernels/kernel_api.h"
#include "kernels/row_tiles.h"
#include "kernels/tiers.h"

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 10)
#define KT_HAVE_AVX512BF16_TARGET 1
#endif

namespace kt::kernels::avx512 {

#ifdef KT_HAVE_AVX512BF16_TARGET
namespace {

#define KT_BF16DP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// Rows per tile: 28 accumulators + the weight line + spare registers of 32.
constexpr int kMaxTileRows = 28;
// Weight lines (64 bytes, one k pair) ahead of the first tile's loads: 2 KB,
// across the page and block boundaries the hardware prefetchers stop at.
constexpr int kPrefetchLines = 32;

template <int MT, bool Prefetch>
KT_BF16DP_TARGET void dp_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int k_pairs,
                              float* out, int64_t ldo) {
  __m512 acc[MT];
#pragma GCC unroll 32
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int p = 0; p < k_pairs; ++p) {
    if constexpr (Prefetch) __builtin_prefetch(w + 32 * static_cast<int64_t>(p + kPrefetchLines));
    const __m512bh wl = (__m512bh)_mm512_loadu_si512(w + 32 * static_cast<int64_t>(p));
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i) {
      int32_t pair;
      __builtin_memcpy(&pair, x + i * ldx + 2 * p, sizeof(pair));
      acc[i] = _mm512_dpbf16_ps(acc[i], wl, (__m512bh)_mm512_set1_epi32(pair));
    }
  }
#pragma GCC unroll 32
  for (int i = 0; i < MT; ++i) _mm512_storeu_ps(out + i * ldo, acc[i]);
}

// dp_tile<rows, Prefetch> for rows in [1, N], picked at run time.
template <int N, bool Prefetch>
KT_BF16DP_TARGET void dp_tile_n(int rows, const uint16_t* x, int64_t ldx, const uint16_t* w,
                                int k_pairs, float* out, int64_t ldo) {
  if constexpr (N >= 1) {
    if (rows == N) return dp_tile<N, Prefetch>(x, ldx, w, k_pairs, out, ldo);
    return dp_tile_n<N - 1, Prefetch>(rows, x, ldx, w, k_pairs, out, ldo);
  }
}

KT_BF16DP_TARGET void bf16_dp_dot_impl(const DotArgs& a, const uint16_t* xb, int64_t ldx) {
  const int k_pairs = static_cast<int>(formats::bf16_k_pairs(a.proj->k));
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const auto* w = reinterpret_cast<const uint16_t*>(a.proj->block(a.expert, nb));
    float* out = a.out + 16 * (nb - a.nb_begin);
    for_each_row_tile(a.m, kMaxTileRows, [&](int t, int i, int rows) {
      const uint16_t* x = xb + i * ldx;
      float* o = out + i * a.ldo;
      if (t == 0) {
        dp_tile_n<kMaxTileRows, true>(rows, x, ldx, w, k_pairs, o, a.ldo);
      } else {
        dp_tile_n<kMaxTileRows, false>(rows, x, ldx, w, k_pairs, o, a.ldo);
      }
    });
  }
}

}  // namespace

// Plain entry point (a target-attributed declaration would be a GCC function
// version): tiers.h declares it weak. op.rows: the m bf16 rows (TileInput::kBf16Rows).
void bf16_dp_dot(const DotArgs& a, const TileOperand& op) {
  bf16_dp_dot_impl(a, static_cast<const uint16_t*>(op.rows), op.ld);
}
#endif

}  // namespace kt::kernels::avx512
