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
// PACKED ROWS  the tile's rows are read from one pointer: the expert's bf16 rows
//   are packed once per expert (bf16_dp_pack, pack_pair_tiles: per tile
//   [k_pairs][MT] pairs), and every block of gate, up (or down) reuses them. With a
//   pointer per row (MT of them next to the accumulators) the compiler spilled the
//   pointers and reloaded them every k pair: packed, the Qwen3-30B-A3B layer's
//   prefill at T = 512 (Zen 4, 2 threads, same process, alternating) fell from
//   113.7 to 103.1 ms, bit for bit the same.
//
// Compiled in the avx512 tier with a function-level target (avx512bf16): a
// tile kernel of the tier table (kernels/dispatch.cpp), which the plan runs
// only where brgemm::kt_bf16_runs() (AVX512_BF16) holds.
#include "formats/bf16.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/avx512/vnni_pairs.h"
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

constexpr int kMaxTileRows = kBf16TileRows;
// Weight lines (64 bytes, one k pair) ahead of the first tile's loads: 2 KB,
// across the page and block boundaries the hardware prefetchers stop at.
constexpr int kPrefetchLines = 32;

// One k pair p of dp_packed_tile: acc[i] += a[p][i] . w[p] for its MT rows.
template <int MT>
KT_BF16DP_TARGET __attribute__((always_inline)) inline void dp_packed_step(__m512* acc,
                                                                           const uint32_t* a,
                                                                           const uint16_t* w,
                                                                           int p) {
  const __m512bh wl = (__m512bh)_mm512_loadu_si512(w + 32 * static_cast<int64_t>(p));
  const uint32_t* ap = a + static_cast<int64_t>(p) * MT;
#pragma GCC unroll 32
  for (int i = 0; i < MT; ++i)
    acc[i] = _mm512_dpbf16_ps(acc[i], wl, (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[i])));
}

// Pairs [p, end) of dp_packed_tile's product into acc; while p < pf_pairs, 8 lines of
// the next panel's source per 8 pairs are prefetched (chunks of CL lines, `stride`
// apart; pf advances), to L2 (Locality 2) or L1 (3).
template <int MT, int CL, int Locality>
KT_BF16DP_TARGET __attribute__((always_inline)) inline void dp_packed_steps(
    __m512* acc, const uint32_t* a, const uint16_t* w, int p, int end, const char*& pf,
    int64_t stride, int pf_pairs) {
  if constexpr (CL > 0) {
    for (; p + 8 <= end && p + 8 <= pf_pairs; p += 8) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        __builtin_prefetch(pf + (j / CL) * stride + (j % CL) * 64, 0, Locality);
        dp_packed_step<MT>(acc, a, w, p + j);
      }
      pf += (8 / CL) * stride;
    }
  }
  for (; p < end; ++p) dp_packed_step<MT>(acc, a, w, p);
}

// The tile of the forward's blocks and of the LoRA backward's panels: MT rows of packed
// pairs a [k_pairs][MT] (one pointer, the rows at fixed offsets: MT row pointers would
// not fit the general registers) times one 16-column slice w [k_pairs][16][2] (a weight
// block, or a slice of a backward panel). While it runs, 8 lines per 8 k pairs are
// prefetched for the first pf_pairs pairs: chunks of CL lines (8: bf16, 4: int8 and
// fp8), `stride` apart; the backward's next panel source to L2, the forward's own block
// a short way ahead to L1 (Locality 3). chunk_scales (fp8's 128x128 blocks): each 64
// pairs' (128 rows') fp32 sums times their scale, added to out in order (exact products
// stay exact until then).
template <int MT, int CL, int Locality = 2>
KT_BF16DP_TARGET void dp_packed_tile(const uint32_t* a, const uint16_t* w, int k_pairs, float* out,
                                     int64_t ldo, bool add, const char* pf, int64_t stride,
                                     int pf_pairs, const float* chunk_scales) {
  __m512 acc[MT];
  if (chunk_scales == nullptr) {
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i)
      acc[i] = add ? _mm512_loadu_ps(out + i * ldo) : _mm512_setzero_ps();
    dp_packed_steps<MT, CL, Locality>(acc, a, w, 0, k_pairs, pf, stride, pf_pairs);
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i) _mm512_storeu_ps(out + i * ldo, acc[i]);
    return;
  }
  constexpr int kChunkPairs = 64;
  for (int c0 = 0; c0 < k_pairs; c0 += kChunkPairs) {
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
    dp_packed_steps<MT, CL, Locality>(acc, a, w, c0, std::min(k_pairs, c0 + kChunkPairs), pf,
                                      stride, pf_pairs);
    const __m512 s = _mm512_set1_ps(chunk_scales[c0 / kChunkPairs]);
    const bool load = add || c0 > 0;
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i) {
      float* o = out + i * ldo;
      _mm512_storeu_ps(
          o, load ? _mm512_fmadd_ps(acc[i], s, _mm512_loadu_ps(o)) : _mm512_mul_ps(acc[i], s));
    }
  }
}

// dp_packed_tile<rows, CL, Locality> for rows in [1, N], picked at run time.
template <int N, int CL, int Locality = 2>
KT_BF16DP_TARGET void dp_packed_tile_n(int rows, const uint32_t* a, const uint16_t* w, int k_pairs,
                                       float* out, int64_t ldo, bool add, const char* pf,
                                       int64_t stride, int pf_pairs, const float* chunk_scales) {
  if constexpr (N >= 1) {
    if (rows == N)
      return dp_packed_tile<N, CL, Locality>(a, w, k_pairs, out, ldo, add, pf, stride, pf_pairs,
                                             chunk_scales);
    return dp_packed_tile_n<N - 1, CL, Locality>(rows, a, w, k_pairs, out, ldo, add, pf, stride,
                                                 pf_pairs, chunk_scales);
  }
}

KT_BF16DP_TARGET void bf16_dp_panel_impl(const uint32_t* a_tiles, int m, const uint16_t* w,
                                         int k_pairs, float* out, int64_t ldo, bool add,
                                         const PrefetchChunks& next, const float* chunk_scales) {
  const auto* pf = static_cast<const char*>(next.base);
  const int log2 = next.chunk_lines_log2;
  // Whole groups of 8 lines (8 k pairs) only: a tail of < 8 lines goes unprefetched.
  const int pf_pairs =
      pf == nullptr ? 0 : static_cast<int>(std::min<int64_t>(next.lines, k_pairs)) / 8 * 8;
  for_each_row_tile(m, kMaxTileRows, [&](int t, int i, int rows) {
    const uint32_t* a = a_tiles + static_cast<int64_t>(i) * k_pairs;
    float* o = out + i * ldo;
    if (t == 0 && pf_pairs > 0 && log2 == 3) {
      dp_packed_tile_n<kMaxTileRows, 8>(rows, a, w, k_pairs, o, ldo, add, pf, next.stride, pf_pairs,
                                        chunk_scales);
    } else if (t == 0 && pf_pairs > 0 && log2 == 2) {
      dp_packed_tile_n<kMaxTileRows, 4>(rows, a, w, k_pairs, o, ldo, add, pf, next.stride, pf_pairs,
                                        chunk_scales);
    } else {
      dp_packed_tile_n<kMaxTileRows, 0>(rows, a, w, k_pairs, o, ldo, add, nullptr, 0, 0,
                                        chunk_scales);
    }
  });
}

// The forward's blocks: the expert's packed rows (bf16_dp_pack: tile i at
// a_tiles + i * kp / 2) times each 16-row block, the first tile prefetching the block
// kPrefetchLines ahead (into the next block's first lines at its end).
KT_BF16DP_TARGET void bf16_dp_dot_impl(const DotArgs& a, const uint32_t* a_tiles) {
  const int k_pairs = static_cast<int>(formats::bf16_k_pairs(a.proj->k));
  const int64_t tile_pairs = a.proj->kp / 2;
  const int pf_pairs = k_pairs / 8 * 8;
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const auto* w = reinterpret_cast<const uint16_t*>(a.proj->block(a.expert, nb));
    const char* pf = reinterpret_cast<const char*>(w) + kPrefetchLines * 64;
    float* out = a.out + 16 * (nb - a.nb_begin);
    for_each_row_tile(a.m, kMaxTileRows, [&](int t, int i, int rows) {
      const uint32_t* at = a_tiles + i * tile_pairs;
      float* o = out + i * a.ldo;
      if (t == 0) {
        dp_packed_tile_n<kMaxTileRows, 8, 3>(rows, at, w, k_pairs, o, a.ldo, false, pf, 8 * 64,
                                             pf_pairs, nullptr);
      } else {
        dp_packed_tile_n<kMaxTileRows, 0>(rows, at, w, k_pairs, o, a.ldo, false, nullptr, 0, 0,
                                          nullptr);
      }
    });
  }
}

}  // namespace

// Plain entry point (a target-attributed declaration would be a GCC function
// version): tiers.h declares it weak. op.rows: the m rows packed by bf16_dp_pack
// (TileInput::kBf16Packed).
void bf16_dp_dot(const DotArgs& a, const TileOperand& op) {
  bf16_dp_dot_impl(a, static_cast<const uint32_t*>(op.rows));
}

int64_t bf16_dp_pack_bytes(int m, int64_t kp) {
  return static_cast<int64_t>(m) * (kp / 2) * static_cast<int64_t>(sizeof(uint32_t));
}

void bf16_dp_pack(const uint16_t* rows, int64_t ld, int m, int64_t kp, uint8_t* dst) {
  pack_pair_tiles(rows, ld, m, static_cast<int>(kp / 2), reinterpret_cast<uint32_t*>(dst));
}

void bf16_dp_panel(const uint32_t* a_tiles, int m, const uint16_t* w, int k_pairs, float* out,
                   int64_t ldo, bool add, const PrefetchChunks& next, const float* chunk_scales) {
  bf16_dp_panel_impl(a_tiles, m, w, k_pairs, out, ldo, add, next, chunk_scales);
}

void pack_pair_tiles(const uint16_t* rows, int64_t ld, int m, int k_pairs, uint32_t* dst) {
  pack_row_tiles(m, kMaxTileRows, k_pairs, dst, [&](int i, int64_t p0, __mmask16 mask) {
    return _mm512_maskz_loadu_epi32(mask, rows + i * ld + 2 * p0);
  });
}
#endif

}  // namespace kt::kernels::avx512
