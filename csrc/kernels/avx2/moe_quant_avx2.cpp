// Quantized-format kernels, AVX2 tier.
//
// qint x q8: the integer dot product of kernels/qint_tiles.h with this tier's
// integer traits (avx2/vec.h QintVec: pmaddubsw/pmaddwd, 8 rows per ymm).
//
// qint weight-only path: a block decoded once to fp32 W^T, then fp32 FMAs
// over tiles of 6 tokens (dense_dot).
//
// fp8: a 32-byte line of the n16k1 layout (16 rows x 2 k) becomes 4 fp32
// vectors through fp16 bit moves and F16C (exact for normals and
// subnormals); fp32 FMAs, block scale per 128 k.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "formats/fp8.h"
#include "formats/q8_activations.h"
#include "formats/qint.h"
#include "kernels/avx2/vec.h"
#include "kernels/block_args.h"
#include "kernels/kernel_api.h"
#include "kernels/qint_tiles.h"
#include "kernels/row_tiles.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx2 {

namespace {

#define KT_INLINE inline __attribute__((always_inline))

using formats::QintFormat;
using formats::ScaleType;

// Decodes the codes of k in [k0, k0 + 4*NV) (NV even) for the rows of one
// half into NV vectors of [8 rows][4 k] kernel codes (2-6 bit and E2M1 unsigned,
// IQ4_NL signed), with the integer traits of the dot product (QintVec).
template <int Bits, formats::CodeTable Tab, int NV>
KT_INLINE void decode_unit(const uint8_t* block, [[maybe_unused]] const uint8_t* high, int64_t k0,
                           int half, __m256i* w) {
  static_assert(Bits != 8 && NV % 2 == 0, "8-bit codes are loaded as they are");
  const int64_t h0 = k0 / 4;  // first half-set (quad)
  if constexpr (Bits <= 3) {  // 2-bit plane: quad h in bit pair h % 4 of line h / 4
    for (int v = 0; v < NV; ++v) {
      const int64_t h = h0 + v;
      w[v] =
          QintVec::crumbs(QintVec::load(block + (h / 4) * 64 + half * 32), static_cast<int>(h % 4));
      if constexpr (Bits == 3) {  // bit h % 8 of line h / 8 of the high plane, to bit 2
        const __m256i hb = QintVec::load(high + (h / 8) * 64 + half * 32);
        w[v] = QintVec::or_(w[v], QintVec::high_bits(hb, static_cast<int>(h % 8), 0x04, 2));
      }
    }
    return;
  }
  for (int v = 0; v < NV; v += 2) {
    const __m256i raw = QintVec::load(block + ((h0 + v) / 2) * 64 + half * 32);
    w[v] = QintVec::lo_nibbles(raw);
    w[v + 1] = QintVec::hi_nibbles(raw);
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t h = h0 + v;
    if constexpr (Tab == formats::CodeTable::kE2m1) w[v] = QintVec::e2m1_codes(w[v]);
    if constexpr (Tab == formats::CodeTable::kIq4nl) w[v] = QintVec::iq4nl_codes(w[v]);
    if constexpr (Bits == 5) {
      const __m256i hb = QintVec::load(high + (h / 8) * 64 + half * 32);
      w[v] = QintVec::or_(w[v], QintVec::high_bits(hb, static_cast<int>(h % 8), 0x10));
    }
    if constexpr (Bits == 6) {
      const __m256i hb = QintVec::load(high + (h / 4) * 64 + half * 32);
      w[v] = QintVec::or_(w[v], QintVec::high_bits(hb, static_cast<int>(2 * (h % 4)), 0x30));
    }
  }
}

// ---- fp8 -------------------------------------------------------------------

// Two k of all 16 rows (one 32-byte line of the n16k1 layout) as fp32:
// out[0], out[1] = rows 0-7, 8-15 of k; out[2], out[3] = rows 0-7, 8-15 of
// k+1. An E4M3 byte b becomes the fp16 bits ((b & 0x7F) << 7) | ((b & 0x80)
// << 8), whose value is e4m3(b) * 2^-8 for normals and subnormals alike
// (exponent bias 15 vs 7); F16C widens them, the caller folds in 2^8.
KT_INLINE void decode_e4m3_pair(__m256i v, __m256* out) {
  const __m256i zero = _mm256_setzero_si256();
  const __m256i clear14 = _mm256_set1_epi16(static_cast<short>(0xBFFF));
  // Byte into the high half of each 16-bit lane, then shift right by one
  // keeping the sign (srai copies it into bit 14, which is cleared).
  const __m256i lo = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpacklo_epi8(zero, v), 1), clear14);
  const __m256i hi = _mm256_and_si256(_mm256_srai_epi16(_mm256_unpackhi_epi8(zero, v), 1), clear14);
  out[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(lo));
  out[1] = _mm256_cvtph_ps(_mm256_castsi256_si128(hi));
  out[2] = _mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1));
  out[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1));
}

// M tokens; each k step (one 32-byte line, 2 k x 16 rows) is unrolled U
// times with separate partial sums per (line, k parity, half), so the FMA
// chains are 4*U deep in parallel: one chain per 2 FMAs would tie M = 1 to
// the FMA latency (4 cycles per line, ~13 GB/s a core), not to its inputs.
// The 16 row scales of group g of a row-scaled block, times 2^8 (the decode's
// fp16 bias): s[0] rows 0-7, s[1] rows 8-15.
KT_INLINE void fp8_group_row_scales(const Fp8Block& a, int64_t g, __m256* s) {
  if (a.row_scale_type == formats::ScaleType::kE8M0) {
    // UE8M0 byte E -> 2^(E-127) * 2^8: the fp32 bits (E + 8) << 23 (E = 0 included;
    // E >= 247 overflows to inf, as the scalar product would).
    const uint8_t* e = static_cast<const uint8_t*>(a.row_scales) + g * 16;
    const __m256i eight = _mm256_set1_epi32(8), inf_exp = _mm256_set1_epi32(255);
    for (int h = 0; h < 2; ++h) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(e + 8 * h));
      const __m256i ex =
          _mm256_min_epi32(_mm256_add_epi32(_mm256_cvtepu8_epi32(b), eight), inf_exp);
      s[h] = _mm256_castsi256_ps(_mm256_slli_epi32(ex, 23));
    }
    return;
  }
  const float* f = static_cast<const float*>(a.row_scales) + g * 16;
  const __m256 k256 = _mm256_set1_ps(256.0f);
  s[0] = _mm256_mul_ps(_mm256_loadu_ps(f), k256);
  s[1] = _mm256_mul_ps(_mm256_loadu_ps(f + 8), k256);
}

// RowScaled: one scale per row and group of a.group_k k (fp8_channel, mxfp8),
// applied per group as two 8-row vectors; else one per 128 k (the band's).
template <int M, bool RowScaled = false>
KT_INLINE void fp8_tile(const Fp8Block& a, const float* const* x_rows, float* out) {
  constexpr int64_t kBlock = formats::kFp8ScaleBlock;
  const int64_t step = RowScaled ? a.group_k : kBlock;  // group_k: a multiple of 32
  __m256 acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < a.kp; k0 += step) {
    // kp is a multiple of 32; a scale group ends at kp or at k0 + step.
    const int64_t k1 = std::min(a.kp, k0 + step);
    __m256 part[M][4];
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < 4; ++j) part[i][j] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k += 2) {
      __builtin_prefetch(a.block + k * 16 + 2048, 0, 3);
      __builtin_prefetch(a.block + k * 16 + 8192, 0, 2);  // into L2 (kernels/qint_tiles.h)
      __m256 w[4];
      decode_e4m3_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.block + k * 16)), w);
      for (int i = 0; i < M; ++i) {
        const __m256 x0 = _mm256_set1_ps(x_rows[i][k]);
        const __m256 x1 = _mm256_set1_ps(x_rows[i][k + 1]);
        part[i][0] = _mm256_fmadd_ps(w[0], x0, part[i][0]);
        part[i][1] = _mm256_fmadd_ps(w[1], x0, part[i][1]);
        part[i][2] = _mm256_fmadd_ps(w[2], x1, part[i][2]);
        part[i][3] = _mm256_fmadd_ps(w[3], x1, part[i][3]);
      }
    }
    __m256 s[2];
    if constexpr (RowScaled) {
      fp8_group_row_scales(a, k0 / step, s);
    } else {
      s[0] = s[1] = _mm256_set1_ps(a.scales[k0 / kBlock] * 256.0f);
    }
    for (int i = 0; i < M; ++i) {
      const __m256 lo = _mm256_add_ps(part[i][0], part[i][2]);
      const __m256 hi = _mm256_add_ps(part[i][1], part[i][3]);
      acc[i][0] = _mm256_fmadd_ps(lo, s[0], acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(hi, s[1], acc[i][1]);
    }
  }
  for (int i = 0; i < M; ++i) {
    _mm256_storeu_ps(out + i * a.ldo, acc[i][0]);
    _mm256_storeu_ps(out + i * a.ldo + 8, acc[i][1]);
  }
}

void fp8_dot(const Fp8Block& a) {
  // Two tokens: 8 partial + 4 total accumulators + 4 decoded weights. A lone
  // token sums in the pairs' order, so its bits do not depend on how many
  // tokens its expert has (pinned paths are batch-invariant,
  // test_pinned_paths_are_batch_invariant); a lone-token tile with two chains
  // over k had broken that and was no faster (hot T = 1 fp8 / mxfp8, Zen 4).
  constexpr int kTile = 2;
  int i = 0;
  if (a.row_scales != nullptr) {
    for (; i + kTile <= a.m; i += kTile) fp8_tile<kTile, true>(a, a.x_rows + i, a.out + i * a.ldo);
    if (a.m - i == 1) fp8_tile<1, true>(a, a.x_rows + i, a.out + i * a.ldo);
    return;
  }
  for (; i + kTile <= a.m; i += kTile) fp8_tile<kTile>(a, a.x_rows + i, a.out + i * a.ldo);
  if (a.m - i == 1) fp8_tile<1>(a, a.x_rows + i, a.out + i * a.ldo);
}

// ---- weight-only path: decode a block to fp32, then fp32 FMAs -------------

// One 16-row block as fp32 W^T [Kp][16]. Per 8 k and half: the codes of 8
// rows x 8 k ([row][4 k] bytes per quad), regrouped by a byte shuffle and a
// dword permute into 8-byte runs of one k, widened to int32, converted and
// scaled: w = s * q - z (explicit zeros), s * (q - zero_offset) (implicit: q - offset is
// exact, so w is s (q - offset) rounded once, as dequantize_weights; s * q - s * offset
// rounded s * offset first, which nvfp4's fp32 scales times 12 need not fit).
template <int Bits, formats::CodeTable Tab, ZeroMode Z, bool KQ = false>
void qint_decode_impl(const QintBlock& a, float* w) {
  constexpr bool kSigned = Bits == 8 || Tab == formats::CodeTable::kIq4nl;
  const QintFormat& f = *a.format;
  const int64_t kp = a.kp;
  const int64_t gsize = f.group_size == 0 ? kp : f.group_size;
  const uint8_t* high = a.block + formats::qint_low_plane_bytes(Bits, kp);
  // Bytes r*4 + j -> j*4 + r within each 128-bit lane (rows 0-3 | rows 4-7),
  // then dwords (j, rows 0-3), (j, rows 4-7) side by side.
  const __m256i by_k = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4,
                                        8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i rows_together = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  [[maybe_unused]] const __m256 offset = _mm256_set1_ps(f.zero_offset);
  [[maybe_unused]] alignas(64) float kq_s[KQ ? formats::kKquantMaxSubBlocks * 16 : 1];
  [[maybe_unused]] alignas(64) float kq_z[KQ ? formats::kKquantMaxSubBlocks * 16 : 1];
  for (int64_t k0 = 0; k0 < kp; k0 += 8) {
    if constexpr (KQ) {  // k-quants: the super-block's scales (qint_tiles.h)
      if (k0 % formats::kKSuperK == 0)
        kquant_decode_super<QintVec>(
            static_cast<const uint8_t*>(a.scales) +
                (k0 / formats::kKSuperK) * formats::kquant_record_bytes(f.scale_type),
            f.scale_type, kq_s, kq_z);
    }
    for (int half = 0; half < 2; ++half) {
      __m256i c[2];
      if constexpr (Bits == 8) {
        for (int v = 0; v < 2; ++v)
          c[v] = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(a.block + (k0 / 4 + v) * 64 + half * 32));
      } else {
        decode_unit<Bits, Tab, 2>(a.block, high, k0, half, c);
      }
      __m256 sc;
      [[maybe_unused]] __m256 z;
      if constexpr (KQ) {
        const int64_t sidx = ((k0 % formats::kKSuperK) / gsize) * 16 + half * 8;
        sc = _mm256_load_ps(kq_s + sidx);
        if constexpr (Z == ZeroMode::kExplicit) z = _mm256_load_ps(kq_z + sidx);
      } else {
        const int64_t sidx = (k0 / gsize) * 16 + half * 8;
        sc = QintVec::load_scales(a.scales, f.scale_type, sidx);
        if constexpr (Z == ZeroMode::kExplicit)
          z = QintVec::load_scales(a.zeros, f.zero_type, sidx);
      }
      for (int v = 0; v < 2; ++v) {
        const __m256i t =
            _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(c[v], by_k), rows_together);
        const __m128i lo = _mm256_castsi256_si128(t), hi = _mm256_extracti128_si256(t, 1);
        const __m128i runs[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
        for (int j = 0; j < 4; ++j) {
          const __m256i q = kSigned ? _mm256_cvtepi8_epi32(runs[j]) : _mm256_cvtepu8_epi32(runs[j]);
          const __m256 qf = _mm256_cvtepi32_ps(q);
          __m256 wv;
          if constexpr (Z == ZeroMode::kExplicit)
            wv = _mm256_fmsub_ps(sc, qf, z);
          else
            wv = _mm256_mul_ps(sc, _mm256_sub_ps(qf, offset));
          _mm256_storeu_ps(w + (k0 + 4 * v + j) * 16 + half * 8, wv);
        }
      }
    }
  }
}

void qint_decode(const QintBlock& a, float* w) {
  using T = formats::CodeTable;
  const QintFormat& f = *a.format;
  const bool explicit_zero = a.zeros != nullptr;
  if (formats::is_kquant(f.scale_type)) {
    if (f.bits == 4 && f.table == T::kIq4nl)  // iq4_xs
      return qint_decode_impl<4, T::kIq4nl, ZeroMode::kImplicit, true>(a, w);
    if (f.bits == 2) return qint_decode_impl<2, T::kNone, ZeroMode::kExplicit, true>(a, w);
    if (f.bits == 3) return qint_decode_impl<3, T::kNone, ZeroMode::kImplicit, true>(a, w);
    if (f.bits == 4) return qint_decode_impl<4, T::kNone, ZeroMode::kExplicit, true>(a, w);
    if (f.bits == 5) return qint_decode_impl<5, T::kNone, ZeroMode::kExplicit, true>(a, w);
    if (f.bits == 6) return qint_decode_impl<6, T::kNone, ZeroMode::kImplicit, true>(a, w);
    return ref::qint_block_decode(a, w);
  }
  if (f.bits == 8) return qint_decode_impl<8, T::kNone, ZeroMode::kImplicit>(a, w);
  if (f.bits == 4 && f.table != T::kNone) {  // mxfp4, nvfp4, iq4_nl
    if (f.table == T::kE2m1) return qint_decode_impl<4, T::kE2m1, ZeroMode::kImplicit>(a, w);
    return qint_decode_impl<4, T::kIq4nl, ZeroMode::kImplicit>(a, w);
  }
  if (f.bits == 4) {
    if (explicit_zero) return qint_decode_impl<4, T::kNone, ZeroMode::kExplicit>(a, w);
    return qint_decode_impl<4, T::kNone, ZeroMode::kImplicit>(a, w);
  }
  if (f.bits == 5) {  // q5_1, q5_0
    if (explicit_zero) return qint_decode_impl<5, T::kNone, ZeroMode::kExplicit>(a, w);
    return qint_decode_impl<5, T::kNone, ZeroMode::kImplicit>(a, w);
  }
  ref::qint_block_decode(a, w);  // 6-bit codes are k-quants only
}

void fp8_decode(const Fp8Block& a, float* w) {
  if (a.row_scales != nullptr) {  // per row and group: two 8-row scale vectors per group
    __m256 s[2];
    for (int64_t k = 0; k < a.kp; k += 2) {
      if (k % a.group_k == 0) fp8_group_row_scales(a, k / a.group_k, s);
      __m256 v[4];
      decode_e4m3_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.block + k * 16)), v);
      for (int j = 0; j < 4; ++j)
        _mm256_storeu_ps(w + k * 16 + 8 * j, _mm256_mul_ps(v[j], s[j & 1]));
    }
    return;
  }
  for (int64_t k = 0; k < a.kp; k += 2) {
    __m256 v[4];
    decode_e4m3_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.block + k * 16)), v);
    const __m256 s = _mm256_set1_ps(a.scales[k / formats::kFp8ScaleBlock] * 256.0f);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(w + k * 16 + 8 * j, _mm256_mul_ps(v[j], s));
  }
}

// M tokens x 16 rows: 2M accumulator chains, one FMA each per k.
template <int M>
KT_INLINE void dense_tile(const float* const* x_rows, const float* w, int64_t kp, float* out,
                          int64_t ldo) {
  __m256 acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kp; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * 16), w1 = _mm256_loadu_ps(w + k * 16 + 8);
    for (int i = 0; i < M; ++i) {
      const __m256 x = _mm256_set1_ps(x_rows[i][k]);
      acc[i][0] = _mm256_fmadd_ps(w0, x, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w1, x, acc[i][1]);
    }
  }
  for (int i = 0; i < M; ++i) {
    _mm256_storeu_ps(out + i * ldo, acc[i][0]);
    _mm256_storeu_ps(out + i * ldo + 8, acc[i][1]);
  }
}

template <int N>
KT_INLINE void dense_tile_n(int rows, const float* const* x, const float* w, int64_t kp, float* out,
                            int64_t ldo) {
  if constexpr (N >= 1) {
    if (rows == N) return dense_tile<N>(x, w, kp, out, ldo);
    return dense_tile_n<N - 1>(rows, x, w, kp, out, ldo);
  }
}

// out[i * ldo + r] = sum_k w[k * 16 + r] * x_i[k] for m fp32 rows, in tiles
// of near-equal size (kernels/row_tiles.h): a tile of M rows has 2M FMA
// chains, and a short remainder tile (8 = 6 + 2: 4 chains, half the FMA rate
// at Zen's 4-cycle latency x 2 pipes) measured 20% slower than 4 + 4.
void dense_dot(const float* const* x, int m, const float* w, int64_t kp, float* out, int64_t ldo) {
  constexpr int kTile = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast
  for_each_row_tile(m, kTile, [&](int, int i, int rows) {
    dense_tile_n<kTile>(rows, x + i, w, kp, out + i * ldo, ldo);
  });
}

void qint_run(const DotArgs& a) {
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb)
    kernels::qint_dot<QintVec>(qint_block(a, nb), ref::qint_block_dot);
}
void qint_run_fp32(const DotArgs& a, float* block) {
  weight_only_dot<QintBlock>(
      a, block, [](const DotArgs& d, int64_t nb) { return qint_block(d, nb); }, qint_decode,
      dense_dot);
}
void fp8_run(const DotArgs& a) {
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) fp8_dot(fp8_block(a, nb));
}
void fp8_run_fp32(const DotArgs& a, float* block) {
  weight_only_dot<Fp8Block>(a, block, fp8_block, fp8_decode, dense_dot);
}

}  // namespace

const ProjectionKernels& qint_kernels() {
  static const ProjectionKernels k{"avx2/qint_q8", &qint_run, &qint_run_fp32, "avx2/qint_fp32"};
  return k;
}

const ProjectionKernels& fp8_kernels() {
  static const ProjectionKernels k{"avx2/fp8", &fp8_run, &fp8_run_fp32, "avx2/fp8_fp32"};
  return k;
}

}  // namespace kt::kernels::avx2
