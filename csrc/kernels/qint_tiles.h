// The integer dot product of the qint formats (formats/qint.h) with q8
// activations (formats/q8_activations.h), written once over an integer
// vector-traits type V and instantiated per ISA (kernels/<isa>/qint_*.cpp).
// This header holds no intrinsics: each instantiation's symbols carry its
// ISA's V, so objects compiled with different -m flags never share code.
//
// SHAPES  one 16-row block of codes: low plane [Kp/8][16 rows][4 bytes] for
//         4/5/6-bit (byte j of row r, line l: low nibble = quad 2l, high
//         nibble = quad 2l+1; a quad is 4 consecutive k), [Kp/16][16][4] for
//         2/3-bit (bits 2c, 2c+1 of byte j of line l = quad 4l + c) or
//         [Kp/4][16][4] signed bytes for 8-bit; 3/5/6-bit codes keep their high
//         bits in a second plane (one 64-byte line per 32, 32 or 16 k). Scales (zeros)
//         [G][16]. m q8 activation rows. Output out[i * ldo + r], r < 16.
// DEFINITION
//   for i < m, r < 16: acc = 0
//     for each fold unit u (16 or 32 k; formats::qint_fold_unit):
//       isum = sum_{k in u} q[r][k] * xq_i[k]                       (exact int32)
//       acc += s[r,g] * (x_scale_i(u) * isum) - zero[r,g] * x_sum_i(u)
//   (implicit zero: zero = zero_offset * s, folded as
//   acc = fma(s, fma(float(isum), x_scale, -zero_offset * x_sum), acc) for
//   int4, q4_0, mxfp4, nvfp4, q3_k and q6_k; signed codes (8-bit, IQ4_NL,
//   IQ4_XS) keep fma(s, fnmadd(offset, x_sum, float(isum) * x_scale), acc), as
//   brgemm_fold_avx512.cpp). The fp32 fold is the same
//   sequence of operations (FMAs) on every SIMD tier, and the int32 sums are
//   exact, so avx2, avx512 and avx512_vnni give bit-identical results (ref,
//   plain C++ without FMA contraction, rounds its folds differently).
// REGISTER PLAN  a register holds V::kRows rows x 4 bytes (one k-quad of
//   kRows rows); a 64-byte line is V::kParts registers (AVX2: 2 halves of 8
//   rows; AVX-512: all 16 rows). Per fold unit the codes of a quad pair are
//   decoded once and multiplied with M tokens' broadcast quads. The traits
//   decide how products reach int32: pmaddubsw sums in int16 for
//   V::depth(bits) quads (bounded so it cannot saturate), then pmaddwd; VNNI's
//   vpdpbusd accumulates int32 directly. Signed 8-bit codes use the sign
//   trick |w| * (x * sign(w)) (llama.cpp), whose pairs are bounded by 2*127^2;
//   on VNNI, with u8 tiles from the plan (dot_u8), qint8_u8_block_dot (below) instead.
//   Code tables (Tab): E2M1 codes become unsigned kernel codes 2v + 12 (pshufb) and
//   go the 4-bit way; IQ4_NL codes become their signed values (-127..113, pshufb) and
//   go the signed 8-bit way, two quads of one 4-bit line at a time.
// TILES  decode (m <= 2) reads each line once with all parts together (one
//   sequential DRAM stream); more tokens go part by part in tiles of
//   V::kMaxTile (AVX2 / AVX-512 4, AVX512_VNNI 12) and one remainder tile,
//   so the codes of a part stay in registers for the tile.
#pragma once

#include <cstdint>
#include <type_traits>

#include "formats/q8_activations.h"
#include "formats/qint.h"
#include "kernels/block_args.h"

namespace kt::kernels {

#ifndef KT_ALWAYS_INLINE
#define KT_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

enum class ZeroMode { kImplicit, kExplicit };

// Whether the tier's traits decode a unit's four 3-bit quads at once
// (V::q3_quads: AVX2, whose integer ops cost most per quad; the other tiers
// insert each quad's high bit with shifts).
template <class V, class = void>
struct HasQ3Quads : std::false_type {};
template <class V>
struct HasQ3Quads<V, std::void_t<decltype(&V::q3_quads)>> : std::true_type {};

// Whether the tier's traits multiply a token's quads read from memory (V::dot2_at:
// AVX512_VNNI's vpdpbusd with its {1to16} operand) instead of broadcast registers.
template <class V, class = void>
struct HasDot2At : std::false_type {};
template <class V>
struct HasDot2At<V, std::enable_if_t<V::kDot2At>> : std::true_type {};

// Whether the tier's traits scale a k-quant's int8 sub-block scales in the
// fold (V::kq_int8_scales: AVX2), instead of decoding the super-block's record
// to fp32 first. The same exact products d * sc either way, so the same bits.
template <class V, class = void>
struct HasKqInt8Scales : std::false_type {};
template <class V>
struct HasKqInt8Scales<V, std::void_t<decltype(&V::kq_int8_scales)>> : std::true_type {};

// Software prefetch of the code streams, two levels: into L1 2 KB ahead of
// the decode (measured on Zen 3; on Zen 4 1, 2, 4 and 8 KB alike, none 0.5x)
// and into L2 8 KB ahead. A core has few L1 miss buffers: with L1 prefetches
// alone, at the 4-bit kernels' decode rate the stream ran out of misses in
// flight (cold T = 1, Zen 4, the gate/up phase of int4 at half the read
// bandwidth, whatever the L1 distance); L2 prefetches use the L2's deeper
// miss queue. Measured (same host, cold gate/up phase, us): L2 distance 0 /
// 4 / 6 / 8 / 10 / 16 KB: int4 900 / 735 / 602 / 645 / 615 / 636, q4_k
// 1019 / 818 / 748 / 730 / 708 / 713, int8 1570 / 1438 / 1288 / 1173 / 1120
// / 1110 (docs/formats.md).
constexpr int64_t kQintPrefetchBytes = 2048;
constexpr int64_t kQintPrefetchL2Bytes = 8192;

// The byte of k (k may pass kp: then in the blocks that follow) in a plane
// holding `bytes_per_k` bytes per k of each block, the planes of consecutive
// blocks `block_bytes` apart.
KT_ALWAYS_INLINE const uint8_t* plane_ahead(const uint8_t* plane, int64_t k, int64_t kp,
                                            int64_t block_bytes, int64_t bytes_per_k) {
  while (k >= kp) {  // once or twice for real layers (kp >= 512); more only for tiny K
    k -= kp;
    plane += block_bytes;
  }
  return plane + k * bytes_per_k;
}

// Prefetches every 64-byte line holding the codes of k in [k0, k0 + kStep)
// kQintPrefetchBytes ahead into L1 and kQintPrefetchL2Bytes ahead into L2,
// where kStep is the unit, or 32 k for units of 16: a unit of 16 k with k0 % 32
// != 0 prefetches nothing. (Per 16 k, the address arithmetic and the
// prefetches had cost a hot q3_k T = 1 call a quarter of its time on Zen 3.)
// kp and both distances are multiples of 32 k, so the lines of one step lie in one block.
// 4- and 8-bit codes are one plane, consecutive blocks back to back: one
// stream, prefetched by bytes. 3/5/6-bit codes are two planes per block, read
// side by side: each is prefetched as many k ahead as those bytes are of the
// low plane, continuing into the next block's plane past the block's end. (A
// byte distance in the high plane had run its prefetches into the next block's
// low plane and left the high plane's start to the low plane's stream, which
// reached it just in time: a cold q3_k T = 1 call spent a fifth of its time
// on the high plane's loads.) k-quants (`recs`): their scale records, a
// third stream, into L2 as far ahead.
template <int Bits, int Unit>
KT_ALWAYS_INLINE void qint_prefetch_unit(const uint8_t* block, [[maybe_unused]] const uint8_t* high,
                                         int64_t k0, [[maybe_unused]] int64_t kp,
                                         [[maybe_unused]] const uint8_t* recs = nullptr,
                                         [[maybe_unused]] int64_t rec_bytes = 0) {
  constexpr int64_t kStep = Unit < 32 ? 32 : Unit;
  if (k0 % kStep != 0) return;
  constexpr int kLowBits = formats::qint_low_plane_bits(Bits);
  constexpr int64_t kLowPerK = 16 * kLowBits / 8;  // bytes per k of the block's 16 rows
  constexpr int64_t kLowLines = kStep * kLowPerK / 64;
  static_assert(kLowLines >= 1, "a step covers whole low-plane lines");
  constexpr int64_t kAheadK = kQintPrefetchBytes / kLowPerK;
  constexpr int64_t kAheadL2K = kQintPrefetchL2Bytes / kLowPerK;
  static_assert(kAheadK % 32 == 0 && kAheadL2K % 32 == 0, "a step's lines in one block");
  if constexpr (Bits != kLowBits) {
    constexpr int64_t kHighPerK = 16 * (Bits - kLowBits) / 8;
    constexpr int64_t kHighLines = kStep * kHighPerK / 64;  // 3, 5 bit: 1; 6 bit: 2
    const int64_t block_bytes = formats::qint_block_bytes(Bits, kp);
    const uint8_t* l1 = plane_ahead(block, k0 + kAheadK, kp, block_bytes, kLowPerK);
    const uint8_t* l2 = plane_ahead(block, k0 + kAheadL2K, kp, block_bytes, kLowPerK);
    for (int64_t l = 0; l < kLowLines; ++l) {
      __builtin_prefetch(l1 + l * 64, 0, 3);
      __builtin_prefetch(l2 + l * 64, 0, 2);
    }
    const uint8_t* h1 = plane_ahead(high, k0 + kAheadK, kp, block_bytes, kHighPerK);
    const uint8_t* h2 = plane_ahead(high, k0 + kAheadL2K, kp, block_bytes, kHighPerK);
    for (int64_t l = 0; l < kHighLines; ++l) {
      __builtin_prefetch(h1 + l * 64, 0, 3);
      __builtin_prefetch(h2 + l * 64, 0, 2);
    }
  } else {
    const uint8_t* low = block + k0 * kLowPerK;
    for (int64_t l = 0; l < kLowLines; ++l) {
      __builtin_prefetch(low + kQintPrefetchBytes + l * 64, 0, 3);
      __builtin_prefetch(low + kQintPrefetchL2Bytes + l * 64, 0, 2);
    }
  }
  // The records of consecutive blocks are back to back: one stream, one record per
  // 256 k (<= 320 bytes: a step of 32 k passes at most 40 of them, a line per step).
  if (recs != nullptr)
    __builtin_prefetch(recs + (k0 + kAheadL2K) * rec_bytes / formats::kKSuperK, 0, 2);
}

// The parts of M q8 activation records.
template <int M>
struct Q8Rows {
  const int8_t* codes[M];
  const float* scales[M];  // one per 32 k
  const float* sum16[M];   // scale * sum of the codes, one per 16 k
  Q8Rows(const uint8_t* const* rows, int64_t kp) {
    for (int i = 0; i < M; ++i) {
      codes[i] = formats::q8_codes(rows[i]);
      scales[i] = formats::q8_scales(rows[i], kp);
      sum16[i] = formats::q8_sum16(rows[i], kp);
    }
  }
};

// k-quants: the fp32 scales s[j * 16 + r] = d[r] * sc_j[r] and (q4_K/q5_K)
// zeros z[j * 16 + r] = dmin[r] * m_j[r] of the 16 rows of one super-block
// (256 k), decoded from its record (formats/qint.h) into a stack buffer by the
// tier's V::kquant_decode. The products are exact, so every tier folds with
// the same fp32 values.
template <class V>
KT_ALWAYS_INLINE void kquant_decode_super(const uint8_t* rec, formats::ScaleType t, float* s,
                                          float* z) {
  V::kquant_decode(rec, t, s, z);
}

// Rows [part0 * kRows, (part0 + P) * kRows) of the block for M tokens.
// KQ: the scales are k-quant records (decoded per super-block, kquant_decode_super).
template <class V, int Bits, formats::CodeTable Tab, int Unit, ZeroMode Z, bool KQ, int M, int P>
KT_ALWAYS_INLINE void qint_tile(const QintBlock& a, const uint8_t* const* x_rows, float* out,
                                int part0) {
  using I = typename V::I;
  using F = typename V::F;
  // Signed kernel codes: 8-bit codes as stored, or IQ4_NL's values of 4-bit codes.
  constexpr bool kSigned = Bits == 8 || Tab == formats::CodeTable::kIq4nl;
  constexpr bool kE2m1 = Tab == formats::CodeTable::kE2m1;
  constexpr int NQ = Unit / 4;  // k-quads per fold unit
  constexpr int kDepth = V::depth(kSigned ? 8 : Bits, kE2m1);
  constexpr int D = kDepth < NQ ? kDepth : NQ;  // quads per flush
  static_assert(D % 2 == 0 && NQ % D == 0, "quads go in pairs; flushes divide the unit");
  // Decode tiles spread a unit's quad pairs over C independent sum chains
  // (V::kDecodeChains); exact int32, so the sums do not depend on C.
  constexpr int C = M * P <= 2 ? V::kDecodeChains : 1;
  constexpr int kHighMask = Bits == 5 ? 0x10 : 0x30;
  const formats::QintFormat& f = *a.format;
  const int64_t kp = a.kp;
  const int64_t gsize = f.group_size == 0 ? kp : f.group_size;
  const uint8_t* high = a.block + formats::qint_low_plane_bytes(Bits, kp);
  const Q8Rows<M> xr(x_rows, kp);
  const F offset = V::set1(f.zero_offset);
  F acc[M][P];
  for (int i = 0; i < M; ++i)
    for (int p = 0; p < P; ++p) acc[i][p] = V::fzero();
  // Implicit zeros of unsigned codes (int4, q4_0, mxfp4, nvfp4, q3_k, q6_k): the fold
  // adds nz = -zero_offset * x_sum of each token and unit inside one FMA,
  // float(isum) * x_scale + nz (one vector op less per token and unit than
  // fnmadd(offset, x_sum, .); q3_k and q6_k too since their 2/3-bit planes).
  // Prefill tiles (M > 2) compute nz for kNzUnits units at a time, so the fold
  // reads it as a broadcast operand; decode tiles compute it in the fold (a
  // per-tile pass over the units cost more than the fold at 1-2 tokens: hot
  // T = 1 mxfp4 / int4-g32 17-19% slower). The same fp32 product either
  // way, so a token's result does not depend on the tile it falls in.
  constexpr bool kNz = Z == ZeroMode::kImplicit && !kSigned;
  // Tiers of 8-row registers (AVX2) pass over a block once per part, and per part the
  // table cost more than it saved (Zen 3, T = 512 int4-g128 7-11% slower): they compute
  // nz in the fold at every M.
  constexpr bool kNzFill = kNz && M > 2 && V::kParts == 1;
  constexpr int kNzUnits = 64;
  [[maybe_unused]] alignas(64) float nz[kNzFill ? M * kNzUnits : 1];
  // q3_k and q6_k (int8 sub-block scales, no mins) on tiers with V::kq_int8_scales:
  // the super-block's d per row (kq_d) and its scales' bytes (kq_sc), scaled per unit.
  constexpr bool kLazyScales = KQ && (Bits == 3 || Bits == 6) && HasKqInt8Scales<V>::value;
  static_assert(!kLazyScales || Z == ZeroMode::kImplicit, "q3_k / q6_k records hold no mins");
  [[maybe_unused]] alignas(64) float kq_d[kLazyScales ? 16 : 1];
  [[maybe_unused]] const uint8_t* kq_sc = nullptr;
  constexpr int64_t kRecFloats = KQ && !kLazyScales ? formats::kKquantMaxSubBlocks * 16 : 1;
  [[maybe_unused]] alignas(64) float kq_s[kRecFloats];  // a decoded record's d * sc
  [[maybe_unused]] alignas(64) float kq_z[kRecFloats];  // and dmin * m
  // The scale group of k0, followed without a division per unit (a 64-bit
  // idiv sat on every unit's fold; a unit never straddles two groups).
  [[maybe_unused]] int64_t g = 0, g_end = gsize;
  // k-quants: bytes of one scale record (a table lookup, kept out of the loop).
  [[maybe_unused]] const int64_t rec_bytes = KQ ? formats::kquant_record_bytes(f.scale_type) : 0;
  for (int64_t k0 = 0; k0 < kp; k0 += Unit) {
    // Keep the block's stream ahead of the decode, in the first pass only
    // (later parts find the lines in cache).
    if (part0 == 0)
      qint_prefetch_unit<Bits, Unit>(
          a.block, high, k0, kp, KQ ? static_cast<const uint8_t*>(a.scales) : nullptr, rec_bytes);
    if constexpr (kNzFill) {
      const int64_t u0 = k0 / Unit;
      if (u0 % kNzUnits == 0) {
        const int64_t n = kp / Unit - u0 < kNzUnits ? kp / Unit - u0 : kNzUnits;
        for (int i = 0; i < M; ++i) {
          const float* s16 = xr.sum16[i] + u0 * (Unit / 16);
          for (int64_t j = 0; j < n; ++j) {
            float x_sum = s16[j * (Unit / 16)];
            if constexpr (Unit == 32) x_sum += s16[j * 2 + 1];
            nz[i * kNzUnits + j] = -f.zero_offset * x_sum;
          }
        }
      }
    }
    if constexpr (KQ) {
      if (k0 % formats::kKSuperK == 0) {
        const uint8_t* rec =
            static_cast<const uint8_t*>(a.scales) + (k0 / formats::kKSuperK) * rec_bytes;
        if constexpr (kLazyScales) {
          F d[V::kParts];
          V::kq_load_d(rec, d);
          for (int p = 0; p < V::kParts; ++p) V::store(kq_d + p * V::kRows, d[p]);
          kq_sc = rec + formats::kKq6ScaleOffset;
        } else {
          kquant_decode_super<V>(rec, f.scale_type, kq_s, kq_z);
        }
      }
    }
    I isum[M][P];
    [[maybe_unused]] I isum_c[kSigned ? C : 1][M][P];  // signed codes: the chains of isum
    for (int i = 0; i < M; ++i)
      for (int p = 0; p < P; ++p) {
        isum[i][p] = V::zero();
        if constexpr (kSigned)
          for (int c = 0; c < C; ++c) isum_c[c][i][p] = V::zero();
      }
    [[maybe_unused]] I hb[P];  // 3/5/6 bit: the unit's one high-plane line
    if constexpr (Bits == 5 || Bits == 6) {
      static_assert(Unit * (Bits - 4) == 32, "one high-plane line per unit");
      for (int p = 0; p < P; ++p)
        hb[p] = V::load(high + (k0 / Unit) * 64 + (part0 + p) * V::kBytes);
    } else if constexpr (Bits == 3) {
      // One line per 32 k, bit h of a byte for quad h: a unit of 16 k in its second
      // half moves its bits 4-7 down, so the shifts below are constants.
      static_assert(Unit == 16 || Unit == 32, "a unit in one high-plane line");
      for (int p = 0; p < P; ++p) {
        hb[p] = V::load(high + (k0 / 32) * 64 + (part0 + p) * V::kBytes);
        if (Unit == 16 && k0 % 32 != 0) hb[p] = V::srl16(hb[p], 4);
      }
    }
    // 3-bit codes on tiers with V::q3_quads: the unit's 4 quads of each part at once.
    constexpr bool kQ3Quads = Bits == 3 && HasQ3Quads<V>::value;
    [[maybe_unused]] I q3w[kQ3Quads ? P : 1][4];
    if constexpr (kQ3Quads) {
      static_assert(Unit == 16, "q3_k: one 2-bit line per unit");
      const uint8_t* line = a.block + (k0 / 16) * 64;
      for (int p = 0; p < P; ++p)
        V::q3_quads(V::load(line + (part0 + p) * V::kBytes), hb[p], q3w[p]);
    }
    for (int q0 = 0; q0 < NQ; q0 += D) {
      [[maybe_unused]] I st[C][M][P];
      if constexpr (!kSigned) {
        for (int c = 0; c < C; ++c)
          for (int i = 0; i < M; ++i)
            for (int p = 0; p < P; ++p) st[c][i][p] = V::zero();
      }
      for (int q = q0; q < q0 + D; q += 2) {
        const int c = (q / 2) % C;  // a constant once the loops unroll
        if constexpr (kSigned) {
          I r0[P], r1[P];
          if constexpr (Bits == 8) {
            // Two lines: quads q and q+1, each 4 k of all 16 rows.
            const uint8_t* line = a.block + (k0 / 4 + q) * 64;
            for (int p = 0; p < P; ++p) {
              r0[p] = V::load(line + (part0 + p) * V::kBytes);
              r1[p] = V::load(line + 64 + (part0 + p) * V::kBytes);
            }
          } else {
            // IQ4_NL: one low-plane line, quad q in the low nibbles, q+1 in the high ones.
            const uint8_t* line = a.block + ((k0 / 4 + q) / 2) * 64;
            for (int p = 0; p < P; ++p) {
              const I raw = V::load(line + (part0 + p) * V::kBytes);
              r0[p] = V::iq4nl_codes(V::lo_nibbles(raw));
              r1[p] = V::iq4nl_codes(V::hi_nibbles(raw));
            }
          }
          for (int i = 0; i < M; ++i) {
            const I xa = V::set1_i32(*reinterpret_cast<const int32_t*>(xr.codes[i] + k0 + 4 * q));
            const I xb =
                V::set1_i32(*reinterpret_cast<const int32_t*>(xr.codes[i] + k0 + 4 * q + 4));
            for (int p = 0; p < P; ++p)
              isum_c[c][i][p] = V::dot_signed(V::dot_signed(isum_c[c][i][p], r0[p], xa), r1[p], xb);
          }
        } else {
          I w0[P], w1[P];
          if constexpr (kQ3Quads) {
            for (int p = 0; p < P; ++p) {
              w0[p] = q3w[p][q];
              w1[p] = q3w[p][q + 1];
            }
          } else if constexpr (Bits <= 3) {
            // One 2-bit plane line per 16 k (k0 is a multiple of 16): quads q, q+1 in
            // bit pairs q % 4 and q % 4 + 1; the 3-bit codes' third bit to bit 2.
            const uint8_t* line = a.block + ((k0 / 4 + q) / 4) * 64;
            for (int p = 0; p < P; ++p) {
              const I raw = V::load(line + (part0 + p) * V::kBytes);
              w0[p] = V::crumbs(raw, q % 4);
              w1[p] = V::crumbs(raw, q % 4 + 1);
              if constexpr (Bits == 3) {
                w0[p] = V::or_(w0[p], V::high_bits(hb[p], q, 0x04, 2));
                w1[p] = V::or_(w1[p], V::high_bits(hb[p], q + 1, 0x04, 2));
              }
            }
          } else {
            // One low-plane line: quad q in the low nibbles, q+1 in the high ones.
            const uint8_t* line = a.block + ((k0 / 4 + q) / 2) * 64;
            for (int p = 0; p < P; ++p) {
              const I raw = V::load(line + (part0 + p) * V::kBytes);
              w0[p] = V::lo_nibbles(raw);
              w1[p] = V::hi_nibbles(raw);
              if constexpr (kE2m1) {
                w0[p] = V::e2m1_codes(w0[p]);
                w1[p] = V::e2m1_codes(w1[p]);
              }
              if constexpr (Bits == 5 || Bits == 6) {
                // Constant shifts once the loops unroll.
                w0[p] = V::or_(w0[p], V::high_bits(hb[p], (Bits - 4) * q, kHighMask));
                w1[p] = V::or_(w1[p], V::high_bits(hb[p], (Bits - 4) * (q + 1), kHighMask));
              }
            }
          }
          for (int i = 0; i < M; ++i) {
            const int8_t* xp = xr.codes[i] + k0 + 4 * q;
            if constexpr (HasDot2At<V>::value) {
              for (int p = 0; p < P; ++p) V::dot2_at(st[c][i][p], w0[p], w1[p], xp);
            } else {
              const I xa = V::set1_i32(*reinterpret_cast<const int32_t*>(xp));
              const I xb = V::set1_i32(*reinterpret_cast<const int32_t*>(xp + 4));
              for (int p = 0; p < P; ++p) V::dot2(st[c][i][p], w0[p], xa, w1[p], xb);
            }
          }
        }
      }
      if constexpr (!kSigned) {
        for (int c = 0; c < C; ++c)
          for (int i = 0; i < M; ++i)
            for (int p = 0; p < P; ++p) isum[i][p] = V::flush(isum[i][p], st[c][i][p]);
      }
    }
    if constexpr (kSigned) {
      for (int c = 0; c < C; ++c)
        for (int i = 0; i < M; ++i)
          for (int p = 0; p < P; ++p) isum[i][p] = V::add_i32(isum[i][p], isum_c[c][i][p]);
    }
    // Fold the unit into fp32: acc += s * (isum * x_scale) - zero * x_sum.
    F s[P], z[P];
    if constexpr (KQ) {
      constexpr auto kF32 = formats::ScaleType::kF32;
      const int64_t sidx = ((k0 % formats::kKSuperK) / Unit) * 16 + part0 * V::kRows;
      for (int p = 0; p < P; ++p) {
        if constexpr (kLazyScales) {  // no mins: implicit zeros
          s[p] = V::kq_int8_scales(kq_sc + sidx + p * V::kRows, kq_d + (part0 + p) * V::kRows);
          z[p] = V::fzero();
        } else {
          s[p] = V::load_scales(kq_s, kF32, sidx + p * V::kRows);
          z[p] = Z == ZeroMode::kExplicit ? V::load_scales(kq_z, kF32, sidx + p * V::kRows)
                                          : V::fzero();
        }
      }
    } else {
      if (k0 == g_end) {
        ++g;
        g_end += gsize;
      }
      const int64_t sidx = g * 16 + part0 * V::kRows;
      for (int p = 0; p < P; ++p) {
        s[p] = V::load_scales(a.scales, f.scale_type, sidx + p * V::kRows);
        z[p] = Z == ZeroMode::kExplicit ? V::load_scales(a.zeros, f.zero_type, sidx + p * V::kRows)
                                        : V::fzero();
      }
    }
    for (int i = 0; i < M; ++i) {
      const F x_scale = V::set1(xr.scales[i][k0 / 32]);
      if constexpr (kNz) {
        // acc += s * (float(isum) * x_scale - zero_offset * x_sum)
        F nzi;
        if constexpr (kNzFill) {
          nzi = V::set1(nz[i * kNzUnits + (k0 / Unit) % kNzUnits]);
        } else {
          float x_sum = xr.sum16[i][k0 / 16];
          if constexpr (Unit == 32) x_sum += xr.sum16[i][k0 / 16 + 1];
          nzi = V::set1(-f.zero_offset * x_sum);
        }
        for (int p = 0; p < P; ++p)
          acc[i][p] = V::fmadd(s[p], V::fmadd(V::cvt(isum[i][p]), x_scale, nzi), acc[i][p]);
        continue;
      }
      float x_sum = xr.sum16[i][k0 / 16];
      if constexpr (Unit == 32) x_sum += xr.sum16[i][k0 / 16 + 1];
      const F xs = V::set1(x_sum);
      for (int p = 0; p < P; ++p) {
        const F xa = V::mul(V::cvt(isum[i][p]), x_scale);
        if constexpr (Z == ZeroMode::kExplicit) {
          acc[i][p] = V::fnmadd(z[p], xs, V::fmadd(s[p], xa, acc[i][p]));
        } else {
          acc[i][p] = V::fmadd(s[p], V::fnmadd(offset, xs, xa), acc[i][p]);
        }
      }
    }
  }
  for (int i = 0; i < M; ++i)
    for (int p = 0; p < P; ++p) V::store(out + i * a.ldo + (part0 + p) * V::kRows, acc[i][p]);
}

// qint_tile for a remainder of 1 <= rows <= N tokens (one part).
template <class V, int Bits, formats::CodeTable Tab, int Unit, ZeroMode Z, bool KQ, int N>
KT_ALWAYS_INLINE void qint_tile_rem(const QintBlock& a, const uint8_t* const* x, float* out,
                                    int part, int rows) {
  if (rows == N) return qint_tile<V, Bits, Tab, Unit, Z, KQ, N, 1>(a, x, out, part);
  if constexpr (N > 1) qint_tile_rem<V, Bits, Tab, Unit, Z, KQ, N - 1>(a, x, out, part, rows);
}

template <class V, int Bits, formats::CodeTable Tab, int Unit, ZeroMode Z, bool KQ = false>
void qint_block_dot(const QintBlock& a) {
  if (V::kParts > 1 && a.m <= 2) {  // decode: one sequential pass over the block
    if (a.m == 2) return qint_tile<V, Bits, Tab, Unit, Z, KQ, 2, V::kParts>(a, a.x_rows, a.out, 0);
    if (a.m == 1) return qint_tile<V, Bits, Tab, Unit, Z, KQ, 1, V::kParts>(a, a.x_rows, a.out, 0);
    return;
  }
  constexpr int MT = V::kMaxTile;
  for (int part = 0; part < V::kParts; ++part) {
    int i = 0;
    for (; i + MT <= a.m; i += MT)
      qint_tile<V, Bits, Tab, Unit, Z, KQ, MT, 1>(a, a.x_rows + i, a.out + i * a.ldo, part);
    if (i < a.m)
      qint_tile_rem<V, Bits, Tab, Unit, Z, KQ, MT - 1>(a, a.x_rows + i, a.out + i * a.ldo, part,
                                                       a.m - i);
  }
}

// ---------------------------------------------------------------------------
// 8-bit signed codes with u8 activations (V::kU8S8: AVX512_VNNI).
//
// vpdpbusd multiplies u8 by s8. With x' = x + 128 (QintBlock::x_u8: the q8
// codes shifted to u8 and packed in tiles by the plan, pack_u8_tiles in
// kernel_api.h) and the stored codes w:
//   sum_{k in u} x'_k w_k - 128 sum_{k in u} w_k = sum_{k in u} x_k w_k
// exactly in int32 (|sum x' w| <= 32 * 255 * 127). The compensation
// 128 sum w of each row and fold unit is one vpdpbusd of 0x80 with each line
// per block and K chunk, shared by all tokens (the chunk's first tile); per token and
// line one vpbroadcastd of the token's quad and one vpdpbusd, against a
// vpabsb, a masked negation and a vpdpbusd in the sign trick (dot_signed).
// Tiles of kU8TileRows (12) tokens go over K in chunks of kQint8ChunkK: a
// chunk's codes (16 rows x 512 k = 8 KiB) stay in L1 while every token tile
// of the expert passes over them (a whole 16-row block of K = 2048 is 32 KiB,
// Zen 4's L1D); the fp32 accumulators wait in `out` between chunks (stored
// and reloaded exactly). Measured on Zen 4 (1 thread, 8 experts of
// 2048 x 768, 64 tokens each): tiles of 8 / 10 / 12 / 16 tokens 0.71 / 0.59 /
// 0.59-0.66 / 0.99 of the sign trick's time (16 spills); chunks of 256 / 512 /
// 1024 / whole K 0.78 / 0.70 / 0.77 / 0.77 (tiles of 8).
// Per (row, token) the fold is qint_tile's: units in K order,
//   acc = fma(s, float(isum) * x_scale, acc)
// so the results are bit-identical to the sign-trick kernels of every SIMD
// tier (for finite activations: those also subtract 0 * x_sum, the implicit
// zero of the 8-bit formats; brgemm_fold_avx512.cpp does the same).
// IQ4_NL / IQ4_XS (Bits = 4) run the same tiles on their table values, read from
// the 4-bit plane (one line holds two quads: low and high nibbles); IQ4_XS (KQ)
// takes its scales from the super-block records, decoded at each 256 k.
// ---------------------------------------------------------------------------

constexpr int64_t kQint8ChunkK = 512;
static_assert(kQint8ChunkK % formats::kKSuperK == 0, "IQ4_XS records: whole super-blocks");

// Tokens [i0, i0 + M) of the block over k in [k_begin, k_end); out holds the
// running fp32 sums (first: start from 0). The chunk's first tile (First)
// computes ncomp[u] = -128 * sum_{k in unit u} w[r][k] per row r as it goes
// (one vpdpbusd of 0x80 per line) and prefetches the stream ahead, as
// qint_tile does; the chunk's later tiles start each unit's sums from ncomp.
template <class V, int Bits, bool KQ, int M, bool First>
KT_ALWAYS_INLINE void qint8_u8_tile(const QintBlock& a, int i0, int64_t k_begin, int64_t k_end,
                                    typename V::I* ncomp, bool first_chunk) {
  using I = typename V::I;
  using F = typename V::F;
  static_assert(Bits == 8 || Bits == 4, "8-bit codes, or IQ4_NL's table of 4-bit codes");
  const formats::QintFormat& f = *a.format;
  const int64_t kp = a.kp;
  const int64_t gsize = f.group_size == 0 ? kp : f.group_size;
  const I c80 = V::set1_i32(static_cast<int32_t>(0x80808080u));
  constexpr int C = M <= 2 ? 4 / M : 1;  // sum chains per token (and compensation)
  // The tile's u8 codes, [kp / 4][M][4] (pack_u8_tiles): token i's quad q at xt + (q * M + i) * 4.
  const uint8_t* xt = a.x_u8 + i0 * kp;
  const float* xs[M];
  float* out = a.out + i0 * a.ldo;
  F acc[M];
  for (int i = 0; i < M; ++i) {
    xs[i] = formats::q8_scales(a.x_rows[i0 + i], kp);
    acc[i] = first_chunk ? V::fzero() : V::fload(out + i * a.ldo);
  }
  int64_t g = k_begin / gsize;      // the scale group of k0
  int64_t g_end = (g + 1) * gsize;  // its end
  [[maybe_unused]] alignas(64) float kq_s[KQ ? formats::kKquantMaxSubBlocks * 16 : 1];
  [[maybe_unused]] float kq_z[1];  // IQ4_XS records hold no mins
  for (int64_t k0 = k_begin; k0 < k_end; k0 += 32) {
    // The unit's lines: k0 / 4 lines of 64 bytes (8-bit), k0 / 8 (4-bit).
    const uint8_t* line = a.block + k0 * 16 * Bits / 8;
    const uint8_t* xq = xt + k0 * M;  // the unit's 8 quads of the M tokens
    I* nc = ncomp + (k0 - k_begin) / 32;
    // isum[c][i], comp[c]: C independent dpbusd chains (decode: few tokens
    // leave the chains' latency exposed; exact int32, summed after the unit).
    I isum[C][M];
    [[maybe_unused]] I comp[C];
    for (int c = 0; c < C; ++c) {
      comp[c] = V::zero();
      for (int i = 0; i < M; ++i) isum[c][i] = V::zero();
    }
    if constexpr (First) {
      qint_prefetch_unit<Bits, 32>(a.block, nullptr, k0, kp);
    } else {
      for (int i = 0; i < M; ++i) isum[0][i] = *nc;
    }
    // Unrolled: as a loop GCC 12 kept the 12 tokens' sums rotating through
    // registers (23 vector moves per 24 vpdpbusd); unrolled, T = 512 ran 8-10%
    // faster for iq4_xs and q8_0 (Zen 4, 2 threads, alternating builds).
#pragma GCC unroll 4
    for (int q = 0; q < 8; q += 2) {
      I w[2];
      if constexpr (Bits == 8) {
        w[0] = V::load(line + q * 64);
        w[1] = V::load(line + (q + 1) * 64);
      } else {
        const I raw = V::load(line + (q / 2) * 64);
        w[0] = V::iq4nl_codes(V::lo_nibbles(raw));
        w[1] = V::iq4nl_codes(V::hi_nibbles(raw));
      }
      for (int h = 0; h < 2; ++h) {
        const int c = (q + h) % C;
        if constexpr (First) comp[c] = V::dpbusd(comp[c], c80, w[h]);
        for (int i = 0; i < M; ++i)
          isum[c][i] = V::dpbusd(isum[c][i], V::bcast_quad(xq + ((q + h) * M + i) * 4), w[h]);
      }
    }
    for (int c = 1; c < C; ++c) {
      if constexpr (First) comp[0] = V::add_i32(comp[0], comp[c]);
      for (int i = 0; i < M; ++i) isum[0][i] = V::add_i32(isum[0][i], isum[c][i]);
    }
    if constexpr (First) {
      for (int i = 0; i < M; ++i) isum[0][i] = V::sub_i32(isum[0][i], comp[0]);
      *nc = V::sub_i32(V::zero(), comp[0]);
    }
    F s;
    if constexpr (KQ) {
      if (k0 % formats::kKSuperK == 0)  // chunks start on a super-block
        kquant_decode_super<V>(
            static_cast<const uint8_t*>(a.scales) +
                (k0 / formats::kKSuperK) * formats::kquant_record_bytes(f.scale_type),
            f.scale_type, kq_s, kq_z);
      s = V::load_scales(kq_s, formats::ScaleType::kF32, ((k0 % formats::kKSuperK) / 32) * 16);
    } else {
      if (k0 == g_end) {  // k0 / gsize without a division per unit
        ++g;
        g_end += gsize;
      }
      s = V::load_scales(a.scales, f.scale_type, g * 16);
    }
    for (int i = 0; i < M; ++i)
      acc[i] = V::fmadd(s, V::mul(V::cvt(isum[0][i]), V::set1(xs[i][k0 / 32])), acc[i]);
  }
  for (int i = 0; i < M; ++i) V::store(out + i * a.ldo, acc[i]);
}

// qint8_u8_tile for a run of 1 <= rows <= N tokens.
template <class V, int Bits, bool KQ, bool First, int N>
KT_ALWAYS_INLINE void qint8_u8_tile_rem(const QintBlock& a, int i0, int rows, int64_t kb,
                                        int64_t ke, typename V::I* ncomp, bool first_chunk) {
  if (rows == N) return qint8_u8_tile<V, Bits, KQ, N, First>(a, i0, kb, ke, ncomp, first_chunk);
  if constexpr (N > 1)
    qint8_u8_tile_rem<V, Bits, KQ, First, N - 1>(a, i0, rows, kb, ke, ncomp, first_chunk);
}

template <class V, int Bits = 8, bool KQ = false>
void qint8_u8_block_dot(const QintBlock& a) {
  constexpr int MT = kU8TileRows;  // the packing's tiles
  typename V::I ncomp[kQint8ChunkK / 32];
  for (int64_t kb = 0; kb < a.kp; kb += kQint8ChunkK) {
    const int64_t ke = kb + kQint8ChunkK < a.kp ? kb + kQint8ChunkK : a.kp;
    const bool first_chunk = kb == 0;
    const int rows0 = a.m < MT ? a.m : MT;
    qint8_u8_tile_rem<V, Bits, KQ, true, MT>(a, 0, rows0, kb, ke, ncomp, first_chunk);
    int i = rows0;
    for (; i + MT <= a.m; i += MT)
      qint8_u8_tile<V, Bits, KQ, MT, false>(a, i, kb, ke, ncomp, first_chunk);
    if (i < a.m)
      qint8_u8_tile_rem<V, Bits, KQ, false, MT - 1>(a, i, a.m - i, kb, ke, ncomp, first_chunk);
  }
}

// The combinations the format table produces; anything else (none today)
// goes to the scalar reference.
template <class V>
void qint_dot(const QintBlock& a, void (*fallback)(const QintBlock&)) {
  using T = formats::CodeTable;
  const formats::QintFormat& f = *a.format;
  const bool explicit_zero = a.zeros != nullptr;  // k-quants: zeros inside the records
  const int unit = static_cast<int>(formats::qint_fold_unit(f.group_size));
  const bool iq4 = f.bits == 4 && f.table == T::kIq4nl && unit == 32;  // iq4_nl, iq4_xs
  if (formats::is_kquant(f.scale_type)) {
    if (iq4) {  // iq4_xs
      if constexpr (V::kU8S8)
        if (a.x_u8 != nullptr) return qint8_u8_block_dot<V, 4, true>(a);
      return qint_block_dot<V, 4, T::kIq4nl, 32, ZeroMode::kImplicit, true>(a);
    }
    if (f.bits == 4 && unit == 32)
      return qint_block_dot<V, 4, T::kNone, 32, ZeroMode::kExplicit, true>(a);
    if (f.bits == 2 && unit == 16)  // q2_k
      return qint_block_dot<V, 2, T::kNone, 16, ZeroMode::kExplicit, true>(a);
    if (f.bits == 3 && unit == 16)  // q3_k
      return qint_block_dot<V, 3, T::kNone, 16, ZeroMode::kImplicit, true>(a);
    if (f.bits == 5 && unit == 32)
      return qint_block_dot<V, 5, T::kNone, 32, ZeroMode::kExplicit, true>(a);
    if (f.bits == 6 && unit == 16)
      return qint_block_dot<V, 6, T::kNone, 16, ZeroMode::kImplicit, true>(a);
    return fallback(a);
  }
  if (f.bits == 8 && unit == 32) {
    if constexpr (V::kU8S8)
      if (a.x_u8 != nullptr) return qint8_u8_block_dot<V>(a);
    return qint_block_dot<V, 8, T::kNone, 32, ZeroMode::kImplicit>(a);
  }
  if (f.bits == 8 && unit == 16)  // the panels of IQ1_M, IQ2_XS, IQ2_S (scales per 16)
    return qint_block_dot<V, 8, T::kNone, 16, ZeroMode::kImplicit>(a);
  if (iq4) {  // iq4_nl
    if constexpr (V::kU8S8)
      if (a.x_u8 != nullptr) return qint8_u8_block_dot<V, 4>(a);
    return qint_block_dot<V, 4, T::kIq4nl, 32, ZeroMode::kImplicit>(a);
  }
  if (f.bits == 4 && f.table == T::kE2m1 && unit == 32)
    return qint_block_dot<V, 4, T::kE2m1, 32, ZeroMode::kImplicit>(a);
  if (f.bits == 4 && f.table == T::kE2m1 && unit == 16)  // nvfp4
    return qint_block_dot<V, 4, T::kE2m1, 16, ZeroMode::kImplicit>(a);
  if (f.bits == 4 && f.table == T::kNone && unit == 32) {
    if (explicit_zero) return qint_block_dot<V, 4, T::kNone, 32, ZeroMode::kExplicit>(a);
    return qint_block_dot<V, 4, T::kNone, 32, ZeroMode::kImplicit>(a);
  }
  if (f.bits == 5 && unit == 32) {  // q5_1, q5_0
    if (explicit_zero) return qint_block_dot<V, 5, T::kNone, 32, ZeroMode::kExplicit>(a);
    return qint_block_dot<V, 5, T::kNone, 32, ZeroMode::kImplicit>(a);
  }
  fallback(a);  // 6-bit codes are k-quants only
}

}  // namespace kt::kernels
