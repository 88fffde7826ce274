// How the register-tiled kernels cut an expert's m token rows into tiles.
#pragma once

namespace kt::kernels {

// Token rows per tile of kt_ops' bf16 tile kernels (the bf16, fused fp8 and exact qint
// tiles: 28 zmm accumulators, the weight line and spare registers of 32). Their A
// operand, the rows packed per tile (pack_pair_tiles), is cut the same way.
constexpr int kBf16TileRows = 28;

// fn(t, i, rows) for each of the ceil(m / max_rows) tiles of near-equal size,
// tile t covering rows [i, i + rows): 30 rows with max_rows = 28 are 15 + 15,
// not 28 + 2. A tile of few rows has too few independent accumulator chains
// to keep the FMA / dot-product pipes busy (their latency times their count),
// so a short remainder tile runs at a fraction of the rate. Each row's sums
// are their own chains, so the split never changes results.
// A template over fn: every call site's instantiation is its own, which keeps
// the per-ISA translation units apart (no shared inline code across flags).
template <class Fn>
inline void for_each_row_tile(int m, int max_rows, Fn&& fn) {
  const int tiles = (m + max_rows - 1) / max_rows;
  if (tiles == 0) return;
  const int base = m / tiles, extra = m % tiles;  // `extra` tiles of base + 1 rows
  for (int t = 0, i = 0; t < tiles; ++t) {
    const int rows = base + (t < extra ? 1 : 0);
    fn(t, i, rows);
    i += rows;
  }
}

}  // namespace kt::kernels
