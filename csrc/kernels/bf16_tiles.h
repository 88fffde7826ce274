// Register-tiled bf16 expert kernels, written once over a vector-traits type V
// and instantiated per ISA (kernels/avx2, kernels/avx512). This header holds
// no intrinsics: every instantiation's symbols carry its ISA's V type, so
// objects compiled with different -m flags never share a definition.
//
// SHAPES  weight block [k_pairs][16][2] bf16 (formats/bf16.h), activations
//         m rows of fp32 [2*k_pairs], output m rows x 16 (n_valid stored).
// DEFINITION
//   for i in tokens: for r in 0..16: acc = 0
//     for p in 0..k_pairs: acc += W[p][r][0]*x[i][2p] + W[p][r][1]*x[i][2p+1]
// REGISTER PLAN  a tile is M tokens x 16 rows = M x (16/V::kLanes) vector
//   accumulators. Per k-pair: one 64-byte weight load split into the even-k
//   and odd-k vectors (shift / mask, no shuffle), two broadcasts per token,
//   two FMAs per accumulator. Small tiles (M <= 2, decode) keep separate
//   even/odd accumulators so the FMA latency chain is half as long; the
//   weight stream, not the FMAs, is then the limit. AVX-512: M <= 8 (8 zmm
//   accs); AVX2: M <= 4 (8 ymm accs + 4 weight ymm). Measured on Zen 3: AVX2
//   tiles of 6 tokens (even-k then odd-k sweeps, 2 weight ymm live) were
//   10-15% slower at T=512 than tiles of 4.
#pragma once

#include <cstdint>

#include "kernels/kernel_api.h"
#include "kernels/swiglu.h"

namespace kt::kernels {

#define KT_ALWAYS_INLINE inline __attribute__((always_inline))

// Software prefetch distance in 64-byte weight lines (one per k pair): 2 KB
// ahead covers DRAM latency at this stream's rate. Measured on Zen 3, cold
// decode: none 4.5 ms, 16 lines 3.9, 32 lines 3.6, 64 lines 3.9.
constexpr int kPrefetchLines = 32;

// acc_out[i][0..16) = dot products of token i with the 16 rows of the block.
template <class V, int M>
KT_ALWAYS_INLINE void bf16_tile(const float* const* x, const uint16_t* w, int k_pairs,
                                float (*acc_out)[16]) {
  constexpr int NV = 16 / V::kLanes;
  constexpr bool kSplitK = M <= 2;
  using Reg = typename V::Reg;
  Reg acc0[M][NV];
  Reg acc1[M][NV];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) {
      acc0[i][v] = V::zero();
      acc1[i][v] = V::zero();
    }
  const float* xr[M];
  for (int i = 0; i < M; ++i) xr[i] = x[i];
  for (int p = 0; p < k_pairs; ++p) {
    // One 64-byte line per k pair; ask for the line kPrefetchLines ahead so
    // the DRAM stream stays in flight across page and block boundaries.
    __builtin_prefetch(w + 32 * static_cast<int64_t>(p + kPrefetchLines), 0, 3);
    Reg w_even[NV], w_odd[NV];
    V::load_bf16_pairs(w + 32 * static_cast<int64_t>(p), w_even, w_odd);
    for (int i = 0; i < M; ++i) {
      const Reg a0 = V::set1(xr[i][2 * p]);
      const Reg a1 = V::set1(xr[i][2 * p + 1]);
      for (int v = 0; v < NV; ++v) {
        acc0[i][v] = V::fma(w_even[v], a0, acc0[i][v]);
        if (kSplitK) {
          acc1[i][v] = V::fma(w_odd[v], a1, acc1[i][v]);
        } else {
          acc0[i][v] = V::fma(w_odd[v], a1, acc0[i][v]);
        }
      }
    }
  }
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) {
      const Reg r = kSplitK ? V::add(acc0[i][v], acc1[i][v]) : acc0[i][v];
      V::store(&acc_out[i][v * V::kLanes], r);
    }
}

template <class V, int M>
KT_ALWAYS_INLINE void gate_up_tile(const GateUpArgs& a, int i0) {
  alignas(64) float g[M][16];
  alignas(64) float u[M][16];
  bf16_tile<V, M>(a.x_rows + i0, a.gate_block, a.k_pairs, g);
  bf16_tile<V, M>(a.x_rows + i0, a.up_block, a.k_pairs, u);
  for (int i = 0; i < M; ++i) {
    silu_mul_16<V>(g[i], u[i]);
    float* out = a.h_rows[i0 + i] + a.out_col;
    for (int r = 0; r < a.n_valid; ++r) out[r] = g[i][r];
  }
}

template <class V, int M>
KT_ALWAYS_INLINE void down_tile(const DownArgs& a, int i0) {
  alignas(64) float y[M][16];
  bf16_tile<V, M>(a.h_rows + i0, a.down_block, a.k_pairs, y);
  for (int i = 0; i < M; ++i) {
    const float s = a.scales[i0 + i];
    float* out = a.y_rows[i0 + i] + a.out_col;
    for (int r = 0; r < a.n_valid; ++r) out[r] = s * y[i][r];
  }
}

// The remainder tile: Tile<V, rem> for rem in [1, N], picked at run time.
template <class V, template <class, int> class Tile, class Args, int N>
KT_ALWAYS_INLINE void run_remainder_tile(const Args& a, int i0, int rem) {
  if constexpr (N >= 1) {
    if (rem == N) {
      Tile<V, N>::run(a, i0);
    } else {
      run_remainder_tile<V, Tile, Args, N - 1>(a, i0, rem);
    }
  }
}

// Runs Tile<V, M> over m tokens in tiles of V::kMaxTile, then one remainder
// tile; the tile size a token lands in depends only on m, never on threads.
template <class V, template <class, int> class Tile, class Args>
inline void for_each_tile(const Args& a) {
  constexpr int MT = V::kMaxTile;
  int i = 0;
  for (; i + MT <= a.m; i += MT) Tile<V, MT>::run(a, i);
  run_remainder_tile<V, Tile, Args, MT - 1>(a, i, a.m - i);
}

template <class V, int M>
struct GateUpTile {
  static KT_ALWAYS_INLINE void run(const GateUpArgs& a, int i0) { gate_up_tile<V, M>(a, i0); }
};
template <class V, int M>
struct DownTile {
  static KT_ALWAYS_INLINE void run(const DownArgs& a, int i0) { down_tile<V, M>(a, i0); }
};

template <class V>
void gate_up_silu(const GateUpArgs& a) {
  for_each_tile<V, GateUpTile>(a);
}

template <class V>
void down_scaled(const DownArgs& a) {
  for_each_tile<V, DownTile>(a);
}

}  // namespace kt::kernels
