// The "grid" weight-format family: GGUF's lattice-grid i-quants (IQ1_S, IQ1_M,
// IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), held as the file's own bytes and decoded
// per 16-row block to an int8 panel just before the q8 kernels multiply it
// (kernels/plan.cpp).
//
// Why a panel: each of these types is, per 32 weights (IQ1_M, IQ2_XS, IQ2_S: per 16),
// a scale times small signed integers (IQ2_XXS / XS / S {+-8, +-25, +-43}, IQ3_XXS
// {+-4 .. +-62}, IQ3_S the odd values +-1 .. +-15, IQ1_S / M 8 * {-1, 0, 1} +- 1),
// picked from a lattice grid by an 8- to 11-bit index. The integers fit int8 and the
// scale is exact in fp32, so one block decodes exactly to the int8 / q8_0 layout the
// signed 8-bit kernels of every tier already multiply (formats/qint.h: codes
// [Kp/4][16][4], fp32 scales [Kp/G][16], G = grid_group_k: 32, or 16 for the types
// with scales per 16, which the kernels fold per 16). The file's 1.56 - 3.44 bits a
// weight stay in memory; the panel (18-20 bytes per k of a block) lives in the pool
// thread's scratch, in L1 / L2.
//
// Layout of one 16-row block: the 16 rows' GGUF bytes back to back, row r at
// r * row_bytes, row_bytes = Kp / 256 * type_bytes (K a multiple of 256, GGUF's
// super-block); rows past n are zero bytes (weights 0). Per type (llama.cpp
// ggml-common.h block_<type>, dequantize_row_<type> in ggml-quants.c):
//   IQ2_XXS (66 bytes): d fp16 | qs uint16[32]. 32 weights ib: uint32 a0, a1 at
//     qs + 8 ib: byte l of a0 indexes kIq2xxsGrid (8 values), 7-bit field l of a1
//     (a1 >> 7l) its signs with an even-parity 8th bit; ls = a1 >> 28;
//     W = d * (0.5 + ls) / 4 * value * sign.
//   IQ3_XXS (98 bytes): d fp16 | qs[64] (kIq3xxsGrid, 4 values each) | uint32[8]
//     signs and scales: 32 weights ib from qs[8 ib ..], signs as IQ2_XXS per 8;
//     W = d * (0.5 + ls) / 2 * value * sign.
//   IQ3_S (110 bytes): d fp16 | qs[64] | qh[8] | signs[32] | scales[4]: index i =
//     qs[i] | bit i%8 of qh[i/8] << 8 (kIq3sGrid, 4 values), sign of weight j = bit
//     j%8 of signs[j/8], 4-bit scale of ib in scales[ib/2] (low nibble first);
//     W = d * (1 + 2 sc) * value * sign.
//   IQ1_S (50 bytes): d fp16 | qs[32] | qh uint16[8]: 32 weights ib, index l =
//     qs[4 ib + l] | ((qh[ib] >> 3l) & 7) << 8 (kIq1sGrid: {-1, 0, 1} x 8),
//     s = (qh[ib] >> 12) & 7, delta = -1/8 if bit 15 else +1/8;
//     W = d * (2 s + 1) * (value + delta).
//   IQ2_XS (74 bytes): d fp16 | qs uint16[32] | scales[8]: 8 weights l of 32 ib from
//     qs[4 ib + l]: index & 511 (kIq2xsGrid), signs as IQ2_XXS' 7-bit field from
//     index >> 9; 16 weights h of ib the 4-bit ls of nibble h of scales[ib];
//     W = d * (0.5 + ls) / 4 * value * sign.
//   IQ2_S (82 bytes): d fp16 | qs[32] | signs[32] | qh[8] | scales[8]: index of 8
//     weights l of ib = qs[4 ib + l] | ((qh[ib] >> 2l) & 3) << 8 (kIq2sGrid), sign of
//     weight j = bit j of signs[4 ib + l]; scales as IQ2_XS.
//   IQ1_M (56 bytes): qs[32] | qh[16] | scales uint16[4]: d fp16 = the top nibbles
//     of the four scales words (word i's bits 12-15 as d's bits 4i .. 4i+3); 8
//     weights l of ib: index qs[4 ib + l] | (nibble l%2 of qh[2 ib + l/2] & 7) << 8
//     (kIq1sGrid), delta -1/8 if that nibble's bit 3 is set else +1/8; 16 weights
//     j = 2 ib + h: s = (scales[j / 4] >> 3 (j % 4)) & 7; W = d * (2 s + 1) * (value
//     + delta).
// Panel codes and scales (exact): IQ2_XXS / XS / S value * sign, d * (2 ls + 1) / 8;
// IQ3_XXS value * sign, d * (2 ls + 1) / 4; IQ3_S value * sign, d * (2 sc + 1);
// IQ1_S / M 8 value +- 1, d * (2 s + 1) / 8.
#pragma once

#include <cstdint>

namespace kt::formats {

enum class GridType : uint8_t { kNone, kIq2xxs, kIq3xxs, kIq3s, kIq1s, kIq1m, kIq2xs, kIq2s };

constexpr int64_t kGridSuperK = 256;  // weights per GGUF block of every grid type

// Weights per panel scale: the type's sub-block (IQ1_M, IQ2_XS, IQ2_S: 16, else 32).
constexpr int64_t grid_group_k(GridType t) {
  return t == GridType::kIq1m || t == GridType::kIq2xs || t == GridType::kIq2s ? 16 : 32;
}

// Bytes of one GGUF block (256 weights) of type t (ggml-common.h block_<type>; the
// format table's gguf_block reads it).
constexpr int64_t grid_type_bytes(GridType t) {
  return t == GridType::kIq1s     ? 50
         : t == GridType::kIq1m   ? 56
         : t == GridType::kIq2xxs ? 66
         : t == GridType::kIq2xs  ? 74
         : t == GridType::kIq2s   ? 82
         : t == GridType::kIq3xxs ? 98
         : t == GridType::kIq3s   ? 110
                                  : 0;
}

// Bytes of one 16-row block of kp (a multiple of 256) columns.
inline int64_t grid_block_bytes(GridType t, int64_t kp) {
  return 16 * (kp / kGridSuperK) * grid_type_bytes(t);
}

// Bytes of the int8 panel of one block: codes [kp/4][16][4], then fp32 scales [kp/G][16]
// (G = grid_group_k(t)).
inline int64_t grid_panel_bytes(GridType t, int64_t kp) {
  return 16 * kp + 16 * (kp / grid_group_k(t)) * 4;
}

// Decodes one 16-row block (grid_block_bytes bytes) into the panel at `panel`
// (grid_panel_bytes bytes, 4-byte aligned): codes first, then the scales.
// Keep kernels/plan.cpp its only caller: with a second one (a test hook) the link-time
// optimizer kept it out of line and the op ran 1.25-1.3x slower at T = 1 (Zen 3, every
// grid format); tests reach it through the op (tests/test_quant_forward.py) and its
// group decode through grid_decode_row (tests/test_lora_quant.py).
void grid_decode_block(GridType t, const uint8_t* block, int64_t kp, uint8_t* panel);

// Decodes columns [k0, k1) of row r of one block (k0 a multiple of 32) into dense fp32
// values w[0 .. k1 - k0): the decode of the training path (exact).
void grid_decode_row(GridType t, const uint8_t* block, int64_t kp, int r, int64_t k0, int64_t k1,
                     float* w);

}  // namespace kt::formats
