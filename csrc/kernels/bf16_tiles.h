// Register-tiled bf16 expert kernels, written once over a vector-traits type V
// and instantiated per ISA (kernels/avx2, kernels/avx512). This header holds
// no intrinsics: every instantiation's symbols carry its ISA's V type, so
// objects compiled with different -m flags never share a definition.
//
// SHAPES  weight block [k_pairs][16][2] bf16 (formats/bf16.h), activations
//         m rows of fp32 [2*k_pairs], output m rows x 16 (DotArgs, kernel_api.h).
// DEFINITION
//   for i in tokens: for r in 0..16: acc = 0
//     for p in 0..k_pairs: acc += W[p][r][0]*x[i][2p] + W[p][r][1]*x[i][2p+1]
// REGISTER PLAN  a tile is M tokens x 16 rows = M x (16/V::kLanes) vector
//   accumulators. Per k-pair: one 64-byte weight load split into the even-k
//   and odd-k vectors (shift / mask, no shuffle), two broadcasts per token,
//   two FMAs per accumulator, even k then odd k. Every tile sums in this one
//   order, so a token's bits do not depend on the tile it lands in (pinned
//   paths are batch-invariant, tests/test_moe_forward.py). Decode tiles once
//   kept separate even/odd chains to halve the FMA latency chain: measured
//   no faster on Zen 4 (T = 1 and 2, 8 experts streamed from DRAM), where the
//   weight stream is the limit. AVX-512: M <= 8 (8 zmm
//   accs); AVX2: M <= 5 (10 ymm accs + 4 weight ymm + a broadcast). Each
//   accumulator takes two dependent FMAs per k pair, so 8 of them (M = 4) left
//   the FMA units no slack for their latency; 10 do: a bf16 layer at T = 512
//   with the AVX2 tier forced on Zen 4 0.91-0.94x the time of 4-token tiles.
//   Measured on Zen 3: AVX2 tiles of 6 tokens (even-k then odd-k sweeps, 2
//   weight ymm live) were 10-15% slower at T=512 than tiles of 4.
#pragma once

#include <cstdint>

#include "formats/bf16.h"
#include "kernels/kernel_api.h"
#include "kernels/row_tiles.h"

namespace kt::kernels {

#define KT_ALWAYS_INLINE inline __attribute__((always_inline))

// Software prefetch distance in 64-byte weight lines (one per k pair): 2 KB
// ahead covers DRAM latency at this stream's rate. Measured on Zen 3, cold
// decode: none 4.5 ms, 16 lines 3.9, 32 lines 3.6, 64 lines 3.9.
constexpr int kPrefetchLines = 32;
// And into L2, 8 KB ahead: more lines in flight than L1's miss buffers hold
// (kernels/qint_tiles.h, kQintPrefetchL2Bytes).
constexpr int kPrefetchL2Lines = 128;

// out[i * ldo + 0..16) = dot products of token i with the 16 rows of the block.
template <class V, int M>
KT_ALWAYS_INLINE void bf16_tile(const float* const* x, const uint16_t* w, int k_pairs, float* out,
                                int64_t ldo) {
  constexpr int NV = 16 / V::kLanes;
  using Reg = typename V::Reg;
  Reg acc[M][NV];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = V::zero();
  const float* xr[M];
  for (int i = 0; i < M; ++i) xr[i] = x[i];
  for (int p = 0; p < k_pairs; ++p) {
    // One 64-byte line per k pair; ask for the line kPrefetchLines ahead so
    // the DRAM stream stays in flight across page and block boundaries.
    __builtin_prefetch(w + 32 * static_cast<int64_t>(p + kPrefetchLines), 0, 3);
    __builtin_prefetch(w + 32 * static_cast<int64_t>(p + kPrefetchL2Lines), 0, 2);
    Reg w_even[NV], w_odd[NV];
    V::load_bf16_pairs(w + 32 * static_cast<int64_t>(p), w_even, w_odd);
    for (int i = 0; i < M; ++i) {
      const Reg a0 = V::set1(xr[i][2 * p]);
      const Reg a1 = V::set1(xr[i][2 * p + 1]);
      for (int v = 0; v < NV; ++v) {
        acc[i][v] = V::fma(w_even[v], a0, acc[i][v]);
        acc[i][v] = V::fma(w_odd[v], a1, acc[i][v]);
      }
    }
  }
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) V::store(out + i * ldo + v * V::kLanes, acc[i][v]);
}

// One token tile of one block: out[i * ldo + r] for the M rows at x.
template <class V, int M>
struct Bf16Tile {
  static KT_ALWAYS_INLINE void run(const float* const* x, const uint16_t* w, int k_pairs,
                                   float* out, int64_t ldo) {
    bf16_tile<V, M>(x, w, k_pairs, out, ldo);
  }
};

// The remainder tile: Tile<V, rem> for rem in [1, N], picked at run time.
template <class V, template <class, int> class Tile, int N, class... Args>
KT_ALWAYS_INLINE void run_remainder_tile(int rem, Args... args) {
  if constexpr (N >= 1) {
    if (rem == N) {
      Tile<V, N>::run(args...);
    } else {
      run_remainder_tile<V, Tile, N - 1>(rem, args...);
    }
  }
}

// ProjectionKernels::dot of the bf16 layout: every block of the run, the
// tokens in near-equal tiles of at most V::kMaxTile (for_each_row_tile: 32 rows
// in tiles of 5 are 5 5 5 5 4 4 4, not six 5s and a 2, whose 4 accumulator chains
// would run at half the rate); the tile a token lands in depends only on m,
// never on the thread count, and its sums not on the tile.
template <class V>
void bf16_dot(const DotArgs& a) {
  constexpr int MT = V::kMaxTile;
  const int k_pairs = static_cast<int>(formats::bf16_k_pairs(a.proj->k));
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const auto* w = reinterpret_cast<const uint16_t*>(a.proj->block(a.expert, nb));
    float* out = a.out + 16 * (nb - a.nb_begin);
    for_each_row_tile(static_cast<int>(a.m), MT, [&](int, int i, int rows) {
      run_remainder_tile<V, Bf16Tile, MT>(rows, a.x + i, w, k_pairs, out + i * a.ldo, a.ldo);
    });
  }
}

}  // namespace kt::kernels
