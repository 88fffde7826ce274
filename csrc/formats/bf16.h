// Weight format "bf16": dense bf16 expert weights in the n16k2 blocked layout.
//
// LAYOUT  A dense projection W[E, N, K] (N output rows, K inputs; torch's
//         nn.Linear convention) is stored as
//             packed[E, ceil(N/16), ceil(K/2), 16, 2]   (bf16)
//         packed[e, nb, kp, r, j] = W[e, 16*nb + r, 2*kp + j], zero where the
//         index runs past N or K. One 64-byte row [16][2] holds 16 output rows
//         for one pair of K: a 32-bit lane is one row's (k even, k odd) pair,
//         so `lane << 16` and `lane & 0xFFFF0000` give both as fp32 with no
//         shuffle, and the same bytes feed AVX512_BF16's vdpbf16ps pairs.
//         A block [ceil(K/2)][16][2] is contiguous: a thread working on one
//         block streams one run of memory (decode is bandwidth bound).
#pragma once

#include <cstdint>

namespace kt::formats {

constexpr int kBf16BlockRows = 16;  // output rows per block
constexpr int kBf16KPack = 2;       // K values interleaved per row

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Number of 16-row blocks for N output rows, and of K pairs for K inputs.
constexpr int64_t bf16_row_blocks(int64_t n) { return ceil_div(n, kBf16BlockRows); }
constexpr int64_t bf16_k_pairs(int64_t k) { return ceil_div(k, kBf16KPack); }
// Elements of one [k_pairs][16][2] block.
constexpr int64_t bf16_block_elems(int64_t k) {
  return bf16_k_pairs(k) * kBf16BlockRows * kBf16KPack;
}

// Scalar reference: the fp32 value of a bf16 bit pattern.
inline float bf16_bits_to_float(uint16_t bits) {
  union {
    uint32_t u;
    float f;
  } v{static_cast<uint32_t>(bits) << 16};
  return v.f;
}

}  // namespace kt::formats
