// The exact qint tiles (kernels/brgemm.h, qint_dp_exact_dot): bf16 activation rows
// times a qint block's codes, with the scales (and zeros) applied to each group's fp32
// sums, for the LoRA forward on an int4 / k-quant / q8_0 / q4_0 / mxfp4 / nvfp4 / iq4 base.
//
// A qint weight is v = s[r,g] * c - z[r,g] (formats/qint.h): c the code's value (an
// integer of at most 8 bits, twice an E2M1 value or an IQ4_NL value: every one a bf16 value), s and
// z one per row and group of k. For a bf16 row x:
//   sum_k x[k] v[r,k] = sum_g ( s[r,g] * D[g] - z[r,g] * X[g] ),
//   D[g] = sum_{k in g} x[k] c[r,k],  X[g] = sum_{k in g} x[k],
// where each product x[k] c[r,k] is exact in fp32 (8 by 8 significant bits) and summed
// in fp32 by vdpbf16ps: products as exact as a bf16 base's, so the saved gate / up
// pre-activations keep fp32 accuracy (the LoRA gradients' 1e-5 bound). Measured (LoRA
// forward of a Qwen3-30B-A3B layer, T = 512, 2 threads, Zen 4): int4 g128 238 -> 128 ms,
// q4_k 237 -> 144, q6_k 245 -> 163 against the streaming fp32 path. X[g] comes from the
// group sums of the packed bf16 rows, made once per expert, rows and group size
// (qint_dp_group_sums), only for formats with zeros.
//
// REGISTER PLAN  a tile is MT <= 28 token rows x 16 weight rows, as the bf16 tile kernel
//   (bf16_dp_avx512bf16.cpp): MT zmm accumulators of one group, one weight line (a k
//   pair of the 16 rows) per step, each row's bf16 pair broadcast into vdpbf16ps from
//   the rows packed per tile (pack_pair_tiles: [k_pairs][MT], one pointer). At a
//   group's end each row's sums are scaled into `out` (fmadd with the group's 16 scales
//   on out as loaded; minus z X where the format has zeros): the running sums live in
//   memory (L1), so the tile keeps the bf16 kernel's 28 rows.
// DECODE  the first token tile decodes the codes of each k chunk (a group, or 128 k of
//   a longer one) into the VNNI tile [kp/2][16][2] (the codes' bf16 values, through a
//   64-entry word table: offset, zeros and E2M1 forms alike; 8-bit codes by conversion),
//   which the later tiles read from L2. The codes' lines are prefetched kPrefetchBytes
//   ahead (past the block's end into the next block's, which the next call decodes).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "formats/qint.h"
#include "kernels/avx512/vec.h"
#include "kernels/block_args.h"
#include "kernels/row_tiles.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

namespace {

#define KT_QDP_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// Rows per tile: 28 accumulators + the weight line + spare registers of 32. Measured
// against running sums in registers (tiles of 12, 2 x 12 accumulators): the same time
// (int4 g128, q4_k, q6_k LoRA forwards at T = 512), so the bf16 kernel's tiles are kept.
constexpr int kTileRows = kBf16TileRows;
// K per decode call: a group, or this much of a longer one (per channel: all of kp).
constexpr int64_t kDecodeChunk = 128;
// How far ahead of its decode the low plane's lines are prefetched: 16 lines (128 k of
// 4-bit codes), as the fused fp8 tiles; past the block's end, the next block's.
constexpr int64_t kPrefetchBytes = 1024;

// What the tiles of one block read.
struct BlockCtx {
  const uint8_t* low;   // the codes' low plane (8-bit: all of them)
  const uint8_t* high;  // 3/5/6-bit codes' high plane, else nullptr
  int bits;
  const uint16_t* table;  // code -> bf16 bits of its value (2-6-bit codes), 64 words
  int64_t kp, group_k, groups;
  const float* s;  // [groups][16]
  const float* z;  // [groups][16], or nullptr (no zeros)
  uint16_t* tile;  // [kp/2][16][2]
};

// The 16 rows' codes of k [k, k + 8) of a 2/3/4/5/6-bit block as their bf16 values: the 4
// k pairs' lines at dst (words 32 p + 2 r + (k % 2)).
KT_QDP_TARGET __attribute__((always_inline)) inline void decode8_nibbles(const BlockCtx& c,
                                                                         int64_t k, uint16_t* dst) {
  __m512i lo, hi;  // byte j of lane r: the codes of k + j, k + 4 + j
  if (c.bits <= 3) {
    // 2-bit plane, one line per 16 k: bit pairs 2 ((k % 16) / 4) (+ 2); 3-bit codes' third
    // bit from the high plane (one line per 32 k: bit (k % 32) / 4 (+ 1)) to bit 2.
    const __m512i line = _mm512_loadu_si512(c.low + (k / 16) * 64);
    const int cs = static_cast<int>(k % 16) / 4;
    lo = QintVec512<false>::crumbs(line, cs);
    hi = QintVec512<false>::crumbs(line, cs + 1);
    if (c.bits == 3) {
      const __m512i hl = _mm512_loadu_si512(c.high + (k / 32) * 64);
      const int hs = static_cast<int>((k % 32) / 4);
      lo = _mm512_or_si512(lo, QintVec512<false>::high_bits(hl, hs, 0x04, 2));
      hi = _mm512_or_si512(hi, QintVec512<false>::high_bits(hl, hs + 1, 0x04, 2));
    }
  } else {
    const __m512i line = _mm512_loadu_si512(c.low + (k / 8) * 64);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    lo = _mm512_and_si512(line, m4);
    hi = _mm512_and_si512(_mm512_srli_epi16(line, 4), m4);
  }
  if (c.bits == 5) {  // one line per 32 k: bit (k % 32) / 4 (+ 1: the high nibbles)
    const __m512i hl = _mm512_loadu_si512(c.high + (k / 32) * 64);
    const int hs = static_cast<int>((k % 32) / 4);
    lo = _mm512_or_si512(lo, QintVec512<false>::high_bits(hl, hs, 0x10));
    hi = _mm512_or_si512(hi, QintVec512<false>::high_bits(hl, hs + 1, 0x10));
  } else if (c.bits == 6) {  // one line per 16 k: bits 2 ((k % 16) / 4) (+ 2)
    const __m512i hl = _mm512_loadu_si512(c.high + (k / 16) * 64);
    const int hs = static_cast<int>(2 * ((k % 16) / 4));
    lo = _mm512_or_si512(lo, QintVec512<false>::high_bits(hl, hs, 0x30));
    hi = _mm512_or_si512(hi, QintVec512<false>::high_bits(hl, hs + 2, 0x30));
  }
  // Per 128-bit lane (4 rows): bytes (0, 1) / (2, 3) of each row's dword as words.
  const __m512i pair01 = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1));
  const __m512i pair23 = _mm512_broadcast_i32x4(
      _mm_setr_epi8(2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1));
  const __m512i t0 = _mm512_loadu_si512(c.table), t1 = _mm512_loadu_si512(c.table + 32);
  auto value = [&](__m512i codes) { return _mm512_permutex2var_epi16(t0, codes, t1); };
  _mm512_storeu_si512(dst, value(_mm512_shuffle_epi8(lo, pair01)));
  _mm512_storeu_si512(dst + 32, value(_mm512_shuffle_epi8(lo, pair23)));
  _mm512_storeu_si512(dst + 64, value(_mm512_shuffle_epi8(hi, pair01)));
  _mm512_storeu_si512(dst + 96, value(_mm512_shuffle_epi8(hi, pair23)));
}

// The same for k [k, k + 4) of 8-bit signed codes (one line: 4 k of the 16 rows), by
// conversion: bf16 of an int8 is the high half of its fp32.
KT_QDP_TARGET __attribute__((always_inline)) inline void decode4_signed(const BlockCtx& c,
                                                                        int64_t k, uint16_t* dst) {
  const __m512i line = _mm512_loadu_si512(c.low + (k / 4) * 64);
  auto byte = [&](int j) {  // byte j of each row's dword, sign-extended, as fp32 bits
    return _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(line, 24 - 8 * j), 24)));
  };
  auto pair = [&](__m512i even, __m512i odd) {  // (even, odd) bf16 words per row
    return _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(even, 16), odd);
  };
  _mm512_storeu_si512(dst, pair(byte(0), byte(1)));
  _mm512_storeu_si512(dst + 32, pair(byte(2), byte(3)));
}

// The codes of k [ka, kb) prefetched kPrefetchBytes ahead (the lines decode_chunk reads
// one chunk later).
KT_QDP_TARGET __attribute__((always_inline)) inline void prefetch_chunk(const BlockCtx& c,
                                                                        int64_t ka, int64_t kb) {
  const int64_t low_per_k = 2 * formats::qint_low_plane_bits(c.bits);  // bytes per k, 16 rows
  const int64_t bytes = (kb - ka) * low_per_k;
  const char* from = reinterpret_cast<const char*>(c.low + ka * low_per_k);
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(from + kPrefetchBytes + off, _MM_HINT_T0);
  if (c.high != nullptr) {  // the high plane's lines kPrefetchBytes ahead likewise
    const int64_t per_line = c.bits == 6 ? 16 : 32;
    const int64_t k_ahead = kPrefetchBytes / low_per_k;
    for (int64_t k = ka - ka % per_line; k < kb; k += per_line)
      _mm_prefetch(reinterpret_cast<const char*>(c.high + (k + k_ahead) / per_line * 64),
                   _MM_HINT_T0);
  }
}

// k [k, k + 8) of the block into c.tile.
KT_QDP_TARGET __attribute__((always_inline)) inline void decode8(const BlockCtx& c, int64_t k) {
  if (c.bits == 8) {
    decode4_signed(c, k, c.tile + k * 16);
    decode4_signed(c, k + 4, c.tile + (k + 4) * 16);
  } else {
    decode8_nibbles(c, k, c.tile + k * 16);
  }
}

// k [ka, kb) of the block into c.tile; the codes one chunk further prefetched.
KT_QDP_TARGET void decode_chunk(const BlockCtx& c, int64_t ka, int64_t kb) {
  prefetch_chunk(c, ka, kb);
  for (int64_t k = ka; k < kb; k += 8) decode8(c, k);
}

// Pairs [pa, pb) of the tile into acc: MT rows of packed pairs a [k_pairs][MT].
template <int MT>
KT_QDP_TARGET __attribute__((always_inline)) inline void dp_pairs(__m512* acc, const uint32_t* a,
                                                                  const uint16_t* w, int64_t pa,
                                                                  int64_t pb) {
  for (int64_t p = pa; p < pb; ++p) {
    const __m512bh wl = (__m512bh)_mm512_loadu_si512(w + 32 * p);
    const uint32_t* ap = a + p * MT;
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i)
      acc[i] = _mm512_dpbf16_ps(acc[i], wl, (__m512bh)_mm512_set1_epi32(static_cast<int>(ap[i])));
  }
}

// Group g's sums of MT rows into out: out = s D (+ out past group 0), minus z X.
template <int MT, bool Zeros>
KT_QDP_TARGET __attribute__((always_inline)) inline void fold_group(const BlockCtx& c, int64_t g,
                                                                    const __m512* acc,
                                                                    const float* xg, float* out,
                                                                    int64_t ldo) {
  const __m512 s = _mm512_loadu_ps(c.s + g * 16);
  [[maybe_unused]] __m512 z;
  if constexpr (Zeros) z = _mm512_loadu_ps(c.z + g * 16);
#pragma GCC unroll 32
  for (int i = 0; i < MT; ++i) {
    float* o = out + i * ldo;
    __m512 t = g == 0 ? _mm512_mul_ps(acc[i], s) : _mm512_fmadd_ps(acc[i], s, _mm512_loadu_ps(o));
    if constexpr (Zeros) t = _mm512_fnmadd_ps(z, _mm512_set1_ps(xg[i * c.groups + g]), t);
    _mm512_storeu_ps(o, t);
  }
}

// One token tile of MT rows: out[i][r] = sum_g s[g][r] D_i[g][r] - z[g][r] X_i[g]
// (xg: X_i[g] at xg[i * groups + g]). The running sums in `out` (L1): tiles of up to 28.
template <int MT, bool Zeros>
KT_QDP_TARGET void dp_tile(const BlockCtx& c, bool first, const uint32_t* a, const float* xg,
                           float* out, int64_t ldo) {
  __m512 acc[MT];
  for (int64_t g = 0; g < c.groups; ++g) {
    const int64_t k0 = g * c.group_k, k1 = k0 + c.group_k;
    // The decode is a call: the group's first one before the accumulators are live.
    const int64_t kb0 = std::min(k1, k0 + kDecodeChunk);
    if (first) decode_chunk(c, k0, kb0);
#pragma GCC unroll 32
    for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
    dp_pairs<MT>(acc, a, c.tile, k0 / 2, kb0 / 2);
    for (int64_t ka = kb0; ka < k1; ka += kDecodeChunk) {  // groups past kDecodeChunk
      const int64_t kb = std::min(k1, ka + kDecodeChunk);
      if (first) decode_chunk(c, ka, kb);
      dp_pairs<MT>(acc, a, c.tile, ka / 2, kb / 2);
    }
    fold_group<MT, Zeros>(c, g, acc, xg, out, ldo);
  }
}

// A tile of MT <= 2 rows that decodes (the block's only one: decode). Each row's sum
// over a group is one chain of dependent vdpbf16ps, one or two chains in flight where
// the tiles of 28 rows keep 28, and dp_tile decodes a chunk, then multiplies it: the
// int4 g128 LoRA forward at T = 1 spent 47% of its time in dp_tile, at about one
// vdpbf16ps per its latency, and 27% decoding (Zen 4). Here the next chunk's codes are
// decoded 8 k at a time between the current chunk's steps of 4 pairs, into the chains'
// idle cycles. The same chunks, pairs in the same order, the same folds: dp_tile's bits.
template <int MT, bool Zeros>
KT_QDP_TARGET void dp_tile_pipelined(const BlockCtx& c, const uint32_t* a, const float* xg,
                                     float* out, int64_t ldo) {
  // Chunks as dp_tile's: a group, or kDecodeChunk k of a longer one (multiples of 16 k).
  auto chunk_end = [&](int64_t k) {
    return std::min((k / c.group_k + 1) * c.group_k, k + kDecodeChunk);
  };
  int64_t ka = 0, kb = chunk_end(0);
  decode_chunk(c, ka, kb);
  __m512 acc[MT];
  while (ka < c.kp) {
    if (ka % c.group_k == 0) {
#pragma GCC unroll 2
      for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
    }
    const int64_t na = kb, nb = kb < c.kp ? chunk_end(kb) : kb;  // the next chunk
    if (nb > na) prefetch_chunk(c, na, nb);
    int64_t kd = na;  // the next chunk's next 8 k to decode
    for (int64_t k = ka; k < kb; k += 8) {
      if (kd < nb) {
        decode8(c, kd);
        kd += 8;
      }
      dp_pairs<MT>(acc, a, c.tile, k / 2, k / 2 + 4);
    }
    for (; kd < nb; kd += 8) decode8(c, kd);
    if (kb % c.group_k == 0) fold_group<MT, Zeros>(c, kb / c.group_k - 1, acc, xg, out, ldo);
    ka = na;
    kb = nb;
  }
}

template <int N, bool Zeros>
KT_QDP_TARGET void dp_tile_n(int rows, const BlockCtx& c, bool first, const uint32_t* a,
                             const float* xg, float* out, int64_t ldo) {
  if constexpr (N >= 1) {
    if constexpr (N <= 2) {
      if (rows == N && first) return dp_tile_pipelined<N, Zeros>(c, a, xg, out, ldo);
    }
    if (rows == N) return dp_tile<N, Zeros>(c, first, a, xg, out, ldo);
    return dp_tile_n<N - 1, Zeros>(rows, c, first, a, xg, out, ldo);
  }
}

// bf16 bits of an fp32 value that is a bf16 value (small integers here).
inline uint16_t bf16_bits_exact(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  return static_cast<uint16_t>(b >> 16);
}

// qint_dp_group_sums (tiers.h): per row tile, the tile's k pairs of 16 rows at a time
// (one dword per row: k in its low word, k + 1 in its high one), each row's bf16 values
// added as fp32 in k order.
KT_QDP_TARGET void group_sums_impl(const uint32_t* packed, int m, int64_t kp, int64_t group_k,
                                   float* sums) {
  const int64_t groups = kp / group_k, k_pairs = kp / 2;
  const __m512i hi_mask = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for_each_row_tile(m, kTileRows, [&](int, int i0, int mt) {
    const uint32_t* a = packed + i0 * k_pairs;
    for (int r0 = 0; r0 < mt; r0 += 16) {
      const __mmask16 rows = static_cast<__mmask16>(mt - r0 >= 16 ? 0xFFFF : (1u << (mt - r0)) - 1);
      for (int64_t g = 0; g < groups; ++g) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t p = g * group_k / 2; p < (g + 1) * group_k / 2; ++p) {
          const __m512i v = _mm512_maskz_loadu_epi32(rows, a + p * mt + r0);
          acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
          acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_and_si512(v, hi_mask)));
        }
        alignas(64) float out[16];
        _mm512_store_ps(out, acc);
        for (int r = 0; r < 16 && r0 + r < mt; ++r) sums[(i0 + r0 + r) * groups + g] = out[r];
      }
    }
  });
}

}  // namespace

void qint_dp_group_sums(const uint32_t* packed, int m, int64_t kp, int64_t group_k, float* sums) {
  group_sums_impl(packed, m, kp, group_k, sums);
}

bool qint_dp_block(const QintBlock& b, const uint32_t* packed, const float* xg, uint16_t* tile,
                   float* params) {
  const formats::QintFormat& f = *b.format;
  const bool kquant = formats::is_kquant(f.scale_type);
  const bool zeros = formats::qint_subtracts_zeros(f.scale_type, b.zeros != nullptr);
  if (f.bits < 2 || f.bits > 8 || f.bits == 7) return false;
  if (f.bits == 8 && (!f.is_signed || zeros || f.table != formats::CodeTable::kNone)) return false;
  const int64_t kp = b.kp;
  const int64_t group_k = f.group_size == 0 ? kp : f.group_size;
  if (group_k % 16 != 0 || kp % group_k != 0) return false;
  const int64_t groups = kp / group_k;
  // The code values: q - offset (implicit zero), q (explicit zeros), 2 e2m1(q) (mxfp4,
  // nvfp4: the scales are the kernels' 2^(E-128), formats/qint.h), IQ4_NL's values.
  alignas(64) uint16_t table[64];
  for (int q = 0; q < 64; ++q) {
    float v;
    if (f.table != formats::CodeTable::kNone)
      v = static_cast<float>(formats::table_code(f.table, q & 15)) - f.zero_offset;
    else
      v = zeros ? static_cast<float>(q) : static_cast<float>(q) - f.zero_offset;
    table[q] = bf16_bits_exact(v);
  }
  // The block's scales (and zeros) per group as fp32 [groups][16].
  float* s = params;
  float* z = zeros ? params + kp : nullptr;
  if (kquant) {
    const int64_t subs = formats::kquant_sub_blocks(f.scale_type);
    const int64_t rec = formats::kquant_record_bytes(f.scale_type);
    float unused[16 * 16];
    for (int64_t j = 0; j < kp / formats::kKSuperK; ++j)
      QintVec512<false>::kquant_decode(static_cast<const uint8_t*>(b.scales) + j * rec,
                                       f.scale_type, s + j * subs * 16,
                                       z != nullptr ? z + j * subs * 16 : unused);
  } else {
    for (int64_t g = 0; g < groups; ++g) {
      _mm512_storeu_ps(s + g * 16, QintVec512<false>::load_scales(b.scales, f.scale_type, g * 16));
      if (z != nullptr)
        _mm512_storeu_ps(z + g * 16, QintVec512<false>::load_scales(b.zeros, f.zero_type, g * 16));
    }
  }
  const BlockCtx c{b.block,
                   f.bits == 3 || f.bits == 5 || f.bits == 6
                       ? b.block + formats::qint_low_plane_bytes(f.bits, kp)
                       : nullptr,
                   f.bits,
                   table,
                   kp,
                   group_k,
                   groups,
                   s,
                   z,
                   tile};
  for_each_row_tile(b.m, kTileRows, [&](int t, int i, int rows) {
    const uint32_t* a = packed + i * (kp / 2);
    float* o = b.out + i * b.ldo;
    if (z != nullptr)
      dp_tile_n<kTileRows, true>(rows, c, t == 0, a, xg + i * groups, o, b.ldo);
    else
      dp_tile_n<kTileRows, false>(rows, c, t == 0, a, nullptr, o, b.ldo);
  });
  return true;
}

}  // namespace kt::kernels::avx512
