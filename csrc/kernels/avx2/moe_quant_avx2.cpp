// Quantized-format kernels, AVX2 tier (also run by the AVX-512 tier).
//
// qint (formats/qint.h) x q8 activations: a 32-bit lane holds one row's 4
// consecutive k, so `pmaddubsw(codes, broadcast(4 activations))` then
// `pmaddwd(., 1)` is one row's 4-term int32 dot product, 8 rows per ymm: the
// AVX2 form of VNNI's vpdpbusd. Unsigned 4/5/6-bit codes feed pmaddubsw's
// unsigned operand directly; products of a few k-quads are summed in int16
// before widening (bounded so they cannot saturate: 4-bit codes 8 quads,
// 5-bit and E2M1 (q <= 24) 4 quads, 6-bit 2). Signed 8-bit codes use
// llama.cpp's sign trick: |w| * (x * sign(w)), each pair bounded by 2*127^2.
// Every fold unit (16 or 32 k) turns the int32 sums into fp32 with the
// activation block scale and the weight group scale (and zero).
//
// PLAN  one 8-row half of the 16-row block at a time; tiles of up to 4
// tokens; per fold unit the weight codes are decoded once into 8 ymm and
// reused by every token of the tile.
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
#include "kernels/tiers.h"
#include "kernels/kernel_api.h"
#include "kernels/swiglu.h"

namespace kt::kernels::avx2 {

namespace {

#define KT_INLINE inline __attribute__((always_inline))

using formats::QintFormat;
using formats::ScaleType;

constexpr int kMaxTokens = 4;  // tokens per register tile

// 8 consecutive stored scales (rows of one half) as fp32.
KT_INLINE __m256 load_scales(const void* base, ScaleType t, int64_t index) {
  switch (t) {
    case ScaleType::kF16:
      return _mm256_cvtph_ps(_mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + index)));
    case ScaleType::kBF16: {
      const __m128i v = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + index));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    }
    case ScaleType::kE8M0: {
      // 2^(E-128): exponent field E-1, flushed to zero for E < 2.
      const __m128i v = _mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(base) + index));
      __m256i e = _mm256_sub_epi32(_mm256_cvtepu8_epi32(v), _mm256_set1_epi32(1));
      e = _mm256_max_epi32(e, _mm256_setzero_si256());
      return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
    }
    default:
      return _mm256_loadu_ps(static_cast<const float*>(base) + index);
  }
}

// Moves the 1 or 2 high bits of half-set h (stored at bit `from` of each
// byte) to bit 4 of each byte. 16-bit shifts are safe: the mask keeps only
// bits that came from the same byte.
KT_INLINE __m256i high_bits_to_bit4(__m256i hb, int from, int mask) {
  const __m256i m = _mm256_set1_epi8(static_cast<char>(mask));
  if (from < 4) return _mm256_and_si256(_mm256_sll_epi16(hb, _mm_cvtsi32_si128(4 - from)), m);
  return _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(from - 4)), m);
}

// Decodes the codes of k in [k0, k0 + 4*NV) for the rows of one half into NV
// vectors of [8 rows][4 k] bytes: unsigned codes for 4/5/6 bit and E2M1,
// |w| for signed 8 bit.
template <int Bits, bool Lut, int NV>
KT_INLINE void decode_unit(const uint8_t* block, [[maybe_unused]] const uint8_t* high, int64_t k0,
                           int half, __m256i* w) {
  if constexpr (Bits == 8) {
    for (int v = 0; v < NV; ++v) {
      const uint8_t* p = block + (k0 / 4 + v) * 64 + half * 32;
      w[v] = _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
  } else {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const int64_t h0 = k0 / 4;  // first half-set
    for (int v = 0; v < NV; v += 2) {
      const uint8_t* p = block + ((h0 + v) / 2) * 64 + half * 32;
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      w[v] = _mm256_and_si256(raw, low4);
      w[v + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
    }
    if constexpr (Lut) {
      // E2M1 code -> 2*value + 12 (formats::e2m1_kernel_code), per 128-bit lane.
      const __m256i lut =
          _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14,
                           15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
      for (int v = 0; v < NV; ++v) w[v] = _mm256_shuffle_epi8(lut, w[v]);
    }
    if constexpr (Bits == 5) {
      for (int v = 0; v < NV; ++v) {
        const int64_t h = h0 + v;
        const uint8_t* p = high + (h / 8) * 64 + half * 32;
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        w[v] = _mm256_or_si256(w[v], high_bits_to_bit4(hb, static_cast<int>(h % 8), 0x10));
      }
    }
    if constexpr (Bits == 6) {
      for (int v = 0; v < NV; ++v) {
        const int64_t h = h0 + v;
        const uint8_t* p = high + (h / 4) * 64 + half * 32;
        const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
        w[v] = _mm256_or_si256(w[v], high_bits_to_bit4(hb, static_cast<int>(2 * (h % 4)), 0x30));
      }
    }
  }
}

// int32 dot products of the NV decoded vectors with one token's codes.
template <int Bits, bool Lut, int NV>
KT_INLINE __m256i unit_dot(const __m256i* w, [[maybe_unused]] const uint8_t* raw_block,
                           [[maybe_unused]] int64_t k0, [[maybe_unused]] int half,
                           const int8_t* xq) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  if constexpr (Bits == 8) {
    for (int v = 0; v < NV; ++v) {
      const __m256i x = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + 4 * v));
      const __m256i sw = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(raw_block + (k0 / 4 + v) * 64 + half * 32));
      const __m256i p = _mm256_maddubs_epi16(w[v], _mm256_sign_epi8(x, sw));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
    }
  } else {
    constexpr int kDepth = Bits == 4 ? (Lut ? 4 : 8) : (Bits == 5 ? 4 : 2);
    for (int v0 = 0; v0 < NV; v0 += kDepth) {
      __m256i s16 = _mm256_setzero_si256();
      for (int v = v0; v < v0 + kDepth && v < NV; ++v) {
        const __m256i x = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xq + 4 * v));
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[v], x));
      }
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(s16, ones));
    }
  }
  return acc;
}

// Software prefetch distance of the code streams, in bytes.
constexpr int64_t kPrefetchBytes = 2048;

// Prefetches every 64-byte line holding the codes of k in [k0, k0 + Unit),
// kPrefetchBytes ahead, in the low plane and (5/6 bit) the high plane.
template <int Bits, int Unit>
KT_INLINE void prefetch_unit(const uint8_t* block, [[maybe_unused]] const uint8_t* high,
                             int64_t k0) {
  constexpr int kLowBits = Bits == 8 ? 8 : 4;
  constexpr int64_t kLowLines = int64_t{Unit} * 16 * kLowBits / 8 / 64;
  const uint8_t* low = block + k0 * 16 * kLowBits / 8 + kPrefetchBytes;
  for (int64_t l = 0; l < kLowLines; ++l) __builtin_prefetch(low + l * 64, 0, 3);
  if constexpr (Bits == 5 || Bits == 6) {
    // One high-plane line per 32 (5 bit) or 16 (6 bit) k: Unit covers one.
    __builtin_prefetch(high + k0 * 16 * (Bits - 4) / 8 + kPrefetchBytes, 0, 3);
  }
}

enum class ZeroMode { kImplicit, kExplicit };

// The parts of M q8 activation records (formats/q8_activations.h).
template <int M>
struct Q8Rows {
  const int8_t* codes[M];
  const float* scales[M];  // one per 32 k
  const float* sum16[M];   // sums of the codes times scale, one per 16 k
  Q8Rows(const uint8_t* const* rows, int64_t kp) {
    for (int i = 0; i < M; ++i) {
      codes[i] = formats::q8_codes(rows[i]);
      scales[i] = formats::q8_scales(rows[i], kp);
      sum16[i] = formats::q8_sum16(rows[i], kp);
    }
  }
};

// out rows [8*half, 8*half + 8) for M tokens starting at x_rows[0].
template <int Bits, bool Lut, int Unit, ZeroMode Z, int M>
KT_INLINE void qint_half_tile(const QintBlock& a, const uint8_t* const* x_rows, float* out,
                              int half) {
  constexpr int NV = Unit / 4;
  const QintFormat& f = *a.format;
  const int64_t kp = a.kp;
  const int64_t gsize = f.group_size == 0 ? kp : f.group_size;
  const uint8_t* high = a.block + formats::qint_low_plane_bytes(Bits, kp);
  const Q8Rows<M> xr(x_rows, kp);
  __m256 acc[M];
  for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
  const __m256 offset = _mm256_set1_ps(f.zero_offset);
  for (int64_t k0 = 0; k0 < kp; k0 += Unit) {
    // Keep the block's stream ahead of the decode: every line of the unit
    // ~2 KB ahead, in the first pass only (the second finds them in cache).
    if (half == 0) prefetch_unit<Bits, Unit>(a.block, high, k0);
    __m256i w[NV];
    decode_unit<Bits, Lut, NV>(a.block, high, k0, half, w);
    const int64_t sidx = (k0 / gsize) * 16 + half * 8;
    const __m256 s = load_scales(a.scales, f.scale_type, sidx);
    __m256 z = _mm256_setzero_ps();
    if constexpr (Z == ZeroMode::kExplicit) z = load_scales(a.zeros, f.zero_type, sidx);
    for (int i = 0; i < M; ++i) {
      const __m256i isum = unit_dot<Bits, Lut, NV>(w, a.block, k0, half, xr.codes[i] + k0);
      const __m256 xa =
          _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(xr.scales[i][k0 / 32]));
      float xs_scalar = xr.sum16[i][k0 / 16];
      if constexpr (Unit == 32) xs_scalar += xr.sum16[i][k0 / 16 + 1];
      const __m256 xs = _mm256_set1_ps(xs_scalar);
      if constexpr (Z == ZeroMode::kExplicit) {
        acc[i] = _mm256_fnmadd_ps(z, xs, _mm256_fmadd_ps(s, xa, acc[i]));
      } else {
        acc[i] = _mm256_fmadd_ps(s, _mm256_fnmadd_ps(offset, xs, xa), acc[i]);
      }
    }
  }
  for (int i = 0; i < M; ++i) _mm256_storeu_ps(out + i * a.ldo + half * 8, acc[i]);
}

// Folds one unit's int32 dot products of rows [8*half, 8*half + 8) into
// fp32: acc += s * (isum * x_scale) - zero * x_sum.
template <ZeroMode Z>
KT_INLINE __m256 fold_unit(__m256 acc, __m256i isum, __m256 s, __m256 z, __m256 offset,
                           float x_scale, float x_sum) {
  const __m256 xa = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(x_scale));
  const __m256 xs = _mm256_set1_ps(x_sum);
  if constexpr (Z == ZeroMode::kExplicit)
    return _mm256_fnmadd_ps(z, xs, _mm256_fmadd_ps(s, xa, acc));
  return _mm256_fmadd_ps(s, _mm256_fnmadd_ps(offset, xs, xa), acc);
}

// All 16 rows of the block for M <= 2 tokens in ONE pass over its codes
// (decode: every 64-byte line is read once, in order, both 32-byte halves
// together), so the stream from DRAM is a single sequential read and each
// activation quad is broadcast once for 16 rows. Few tokens leave the
// registers for the second half's accumulators; larger tiles use
// qint_half_tile, which decodes each code once for up to 4 tokens.
template <int Bits, bool Lut, int Unit, ZeroMode Z, int M>
KT_INLINE void qint_block_tile(const QintBlock& a, const uint8_t* const* x_rows, float* out) {
  constexpr int NV = Unit / 4;  // k-quads per unit
  // Quads summed in int16 before widening (see the file comment).
  constexpr int kDepth =
      Bits == 8 ? 1 : std::min(NV, Bits == 4 ? (Lut ? 4 : 8) : (Bits == 5 ? 4 : 2));
  const QintFormat& f = *a.format;
  const int64_t kp = a.kp;
  const int64_t gsize = f.group_size == 0 ? kp : f.group_size;
  const uint8_t* high = a.block + formats::qint_low_plane_bytes(Bits, kp);
  const Q8Rows<M> xr(x_rows, kp);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 offset = _mm256_set1_ps(f.zero_offset);
  __m256 acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < kp; k0 += Unit) {
    prefetch_unit<Bits, Unit>(a.block, high, k0);
    __m256i isum[M][2];
    for (int i = 0; i < M; ++i) isum[i][0] = isum[i][1] = _mm256_setzero_si256();
    // 5/6 bit: the unit's one high-plane line (32 or 16 k), loaded once.
    [[maybe_unused]] __m256i hb[2];
    [[maybe_unused]] constexpr int hi_mask = Bits == 5 ? 0x10 : 0x30;
    if constexpr (Bits == 5 || Bits == 6) {
      static_assert(Unit * (Bits - 4) == 32, "one high-plane line per unit");
      const uint8_t* hl = high + (k0 / Unit) * 64;
      hb[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hl));
      hb[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hl + 32));
    }
    for (int v0 = 0; v0 < NV; v0 += kDepth) {
      if constexpr (Bits == 8) {
        // One line: 4 k of all 16 rows; llama.cpp's sign trick per half.
        const uint8_t* line = a.block + (k0 / 4 + v0) * 64;
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32));
        const __m256i a0 = _mm256_abs_epi8(r0), a1 = _mm256_abs_epi8(r1);
        for (int i = 0; i < M; ++i) {
          const __m256i x =
              _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xr.codes[i] + k0 + 4 * v0));
          isum[i][0] = _mm256_add_epi32(
              isum[i][0],
              _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x, r0)), ones));
          isum[i][1] = _mm256_add_epi32(
              isum[i][1],
              _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x, r1)), ones));
        }
      } else {
        __m256i s16[M][2];
        for (int i = 0; i < M; ++i) s16[i][0] = s16[i][1] = _mm256_setzero_si256();
        for (int v = v0; v < v0 + kDepth; v += 2) {
          // Quads v, v+1 of both halves: one 64-byte line of the low plane.
          __m256i w0[2], w1[2];
          if constexpr (Bits == 4) {
            decode_unit<Bits, Lut, 2>(a.block, high, k0 + 4 * v, 0, w0);
            decode_unit<Bits, Lut, 2>(a.block, high, k0 + 4 * v, 1, w1);
          } else {
            decode_unit<4, false, 2>(a.block, high, k0 + 4 * v, 0, w0);
            decode_unit<4, false, 2>(a.block, high, k0 + 4 * v, 1, w1);
            for (int j = 0; j < 2; ++j) {
              const int from = (Bits - 4) * (v + j);  // a constant once the loops unroll
              w0[j] = _mm256_or_si256(w0[j], high_bits_to_bit4(hb[0], from, hi_mask));
              w1[j] = _mm256_or_si256(w1[j], high_bits_to_bit4(hb[1], from, hi_mask));
            }
          }
          for (int i = 0; i < M; ++i) {
            const int8_t* xp = xr.codes[i] + k0 + 4 * v;
            const __m256i xa = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xp));
            const __m256i xb = _mm256_set1_epi32(*reinterpret_cast<const int32_t*>(xp + 4));
            s16[i][0] = _mm256_add_epi16(
                s16[i][0],
                _mm256_add_epi16(_mm256_maddubs_epi16(w0[0], xa), _mm256_maddubs_epi16(w0[1], xb)));
            s16[i][1] = _mm256_add_epi16(
                s16[i][1],
                _mm256_add_epi16(_mm256_maddubs_epi16(w1[0], xa), _mm256_maddubs_epi16(w1[1], xb)));
          }
        }
        for (int i = 0; i < M; ++i)
          for (int h = 0; h < 2; ++h)
            isum[i][h] = _mm256_add_epi32(isum[i][h], _mm256_madd_epi16(s16[i][h], ones));
      }
    }
    const int64_t sidx = (k0 / gsize) * 16;
    const __m256 s[2] = {load_scales(a.scales, f.scale_type, sidx),
                         load_scales(a.scales, f.scale_type, sidx + 8)};
    __m256 z[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    if constexpr (Z == ZeroMode::kExplicit) {
      z[0] = load_scales(a.zeros, f.zero_type, sidx);
      z[1] = load_scales(a.zeros, f.zero_type, sidx + 8);
    }
    for (int i = 0; i < M; ++i) {
      float x_sum = xr.sum16[i][k0 / 16];
      if constexpr (Unit == 32) x_sum += xr.sum16[i][k0 / 16 + 1];
      const float x_scale = xr.scales[i][k0 / 32];
      for (int h = 0; h < 2; ++h)
        acc[i][h] = fold_unit<Z>(acc[i][h], isum[i][h], s[h], z[h], offset, x_scale, x_sum);
    }
  }
  for (int i = 0; i < M; ++i) {
    _mm256_storeu_ps(out + i * a.ldo, acc[i][0]);
    _mm256_storeu_ps(out + i * a.ldo + 8, acc[i][1]);
  }
}

template <int Bits, bool Lut, int Unit, ZeroMode Z>
void qint_dot_impl(const QintBlock& a) {
  if (a.m <= 2) {  // decode: one sequential pass over the block
    if (a.m == 2) return qint_block_tile<Bits, Lut, Unit, Z, 2>(a, a.x_rows, a.out);
    if (a.m == 1) return qint_block_tile<Bits, Lut, Unit, Z, 1>(a, a.x_rows, a.out);
    return;
  }
  for (int half = 0; half < 2; ++half) {
    int i = 0;
    for (; i + kMaxTokens <= a.m; i += kMaxTokens)
      qint_half_tile<Bits, Lut, Unit, Z, kMaxTokens>(a, a.x_rows + i, a.out + i * a.ldo, half);
    switch (a.m - i) {
      case 3:
        qint_half_tile<Bits, Lut, Unit, Z, 3>(a, a.x_rows + i, a.out + i * a.ldo, half);
        break;
      case 2:
        qint_half_tile<Bits, Lut, Unit, Z, 2>(a, a.x_rows + i, a.out + i * a.ldo, half);
        break;
      case 1:
        qint_half_tile<Bits, Lut, Unit, Z, 1>(a, a.x_rows + i, a.out + i * a.ldo, half);
        break;
      default:
        break;
    }
  }
}

void qint_dot(const QintBlock& a) {
  const QintFormat& f = *a.format;
  const bool explicit_zero = a.zeros != nullptr;
  const int unit = static_cast<int>(formats::qint_fold_unit(f.group_size));
  // The combinations the format table (formats/qint.h) produces; the op
  // layer rejects any other, so the last branch is unreachable there.
  if (f.bits == 8) return qint_dot_impl<8, false, 32, ZeroMode::kImplicit>(a);
  if (f.bits == 4 && f.lut_e2m1) return qint_dot_impl<4, true, 32, ZeroMode::kImplicit>(a);
  if (f.bits == 4 && unit == 32) {
    if (explicit_zero) return qint_dot_impl<4, false, 32, ZeroMode::kExplicit>(a);
    return qint_dot_impl<4, false, 32, ZeroMode::kImplicit>(a);
  }
  if (f.bits == 5 && unit == 32) {
    if (explicit_zero) return qint_dot_impl<5, false, 32, ZeroMode::kExplicit>(a);
    return qint_dot_impl<5, false, 32, ZeroMode::kImplicit>(a);
  }
  if (f.bits == 6 && unit == 16) return qint_dot_impl<6, false, 16, ZeroMode::kImplicit>(a);
  ref::qint_block_dot(a);
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
template <int M, int U>
KT_INLINE void fp8_tile(const Fp8Block& a, const float* const* x_rows, float* out) {
  constexpr int64_t kBlock = formats::kFp8ScaleBlock;
  static_assert(kBlock % (2 * U) == 0, "the unroll must divide a scale block");
  __m256 acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < a.kp; k0 += kBlock) {
    // kp is a multiple of 32, so of 2 * U; a scale block ends at kp or at k0 + 128.
    const int64_t k1 = std::min(a.kp, k0 + kBlock);
    __m256 part[M][U][4];
    for (int i = 0; i < M; ++i)
      for (int u = 0; u < U; ++u)
        for (int j = 0; j < 4; ++j) part[i][u][j] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k += 2 * U) {
      __builtin_prefetch(a.block + k * 16 + 2048, 0, 3);
      if constexpr (U == 2) __builtin_prefetch(a.block + k * 16 + 2048 + 32, 0, 3);
      for (int u = 0; u < U; ++u) {
        const int64_t kk = k + 2 * u;
        __m256 w[4];
        decode_e4m3_pair(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.block + kk * 16)),
                         w);
        for (int i = 0; i < M; ++i) {
          const __m256 x0 = _mm256_set1_ps(x_rows[i][kk]);
          const __m256 x1 = _mm256_set1_ps(x_rows[i][kk + 1]);
          part[i][u][0] = _mm256_fmadd_ps(w[0], x0, part[i][u][0]);
          part[i][u][1] = _mm256_fmadd_ps(w[1], x0, part[i][u][1]);
          part[i][u][2] = _mm256_fmadd_ps(w[2], x1, part[i][u][2]);
          part[i][u][3] = _mm256_fmadd_ps(w[3], x1, part[i][u][3]);
        }
      }
    }
    const __m256 s = _mm256_set1_ps(a.scales[k0 / kBlock] * 256.0f);
    for (int i = 0; i < M; ++i) {
      __m256 lo = _mm256_add_ps(part[i][0][0], part[i][0][2]);
      __m256 hi = _mm256_add_ps(part[i][0][1], part[i][0][3]);
      for (int u = 1; u < U; ++u) {
        lo = _mm256_add_ps(lo, _mm256_add_ps(part[i][u][0], part[i][u][2]));
        hi = _mm256_add_ps(hi, _mm256_add_ps(part[i][u][1], part[i][u][3]));
      }
      acc[i][0] = _mm256_fmadd_ps(lo, s, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(hi, s, acc[i][1]);
    }
  }
  for (int i = 0; i < M; ++i) {
    _mm256_storeu_ps(out + i * a.ldo, acc[i][0]);
    _mm256_storeu_ps(out + i * a.ldo + 8, acc[i][1]);
  }
}

void fp8_dot(const Fp8Block& a) {
  // Two tokens: 8 partial + 4 total accumulators + 4 decoded weights.
  constexpr int kTile = 2;
  int i = 0;
  for (; i + kTile <= a.m; i += kTile) fp8_tile<kTile, 1>(a, a.x_rows + i, a.out + i * a.ldo);
  if (a.m - i == 1) fp8_tile<1, 2>(a, a.x_rows + i, a.out + i * a.ldo);
}

// ---- weight-only path: decode a block to fp32, then fp32 FMAs -------------

// One 16-row block as fp32 W^T [Kp][16]. Per 8 k and half: the codes of 8
// rows x 8 k ([row][4 k] bytes per quad), regrouped by a byte shuffle and a
// dword permute into 8-byte runs of one k, widened to int32, converted and
// scaled: w = s * q - z.
template <int Bits, bool Lut, ZeroMode Z>
void qint_decode_impl(const QintBlock& a, float* w) {
  const QintFormat& f = *a.format;
  const int64_t kp = a.kp;
  const int64_t gsize = f.group_size == 0 ? kp : f.group_size;
  const uint8_t* high = a.block + formats::qint_low_plane_bytes(Bits, kp);
  // Bytes r*4 + j -> j*4 + r within each 128-bit lane (rows 0-3 | rows 4-7),
  // then dwords (j, rows 0-3), (j, rows 4-7) side by side.
  const __m256i by_k = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4,
                                        8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m256i rows_together = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const __m256 offset = _mm256_set1_ps(f.zero_offset);
  for (int64_t k0 = 0; k0 < kp; k0 += 8) {
    for (int half = 0; half < 2; ++half) {
      __m256i c[2];
      if constexpr (Bits == 8) {
        for (int v = 0; v < 2; ++v)
          c[v] = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(a.block + (k0 / 4 + v) * 64 + half * 32));
      } else {
        decode_unit<Bits, Lut, 2>(a.block, high, k0, half, c);
      }
      const int64_t sidx = (k0 / gsize) * 16 + half * 8;
      const __m256 sc = load_scales(a.scales, f.scale_type, sidx);
      const __m256 z = Z == ZeroMode::kExplicit ? load_scales(a.zeros, f.zero_type, sidx)
                                                : _mm256_mul_ps(offset, sc);
      for (int v = 0; v < 2; ++v) {
        const __m256i t =
            _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(c[v], by_k), rows_together);
        const __m128i lo = _mm256_castsi256_si128(t), hi = _mm256_extracti128_si256(t, 1);
        const __m128i runs[4] = {lo, _mm_unpackhi_epi64(lo, lo), hi, _mm_unpackhi_epi64(hi, hi)};
        for (int j = 0; j < 4; ++j) {
          const __m256i q =
              Bits == 8 ? _mm256_cvtepi8_epi32(runs[j]) : _mm256_cvtepu8_epi32(runs[j]);
          _mm256_storeu_ps(w + (k0 + 4 * v + j) * 16 + half * 8,
                           _mm256_fmsub_ps(sc, _mm256_cvtepi32_ps(q), z));
        }
      }
    }
  }
}

void qint_decode(const QintBlock& a, float* w) {
  const QintFormat& f = *a.format;
  const bool explicit_zero = a.zeros != nullptr;
  if (f.bits == 8) return qint_decode_impl<8, false, ZeroMode::kImplicit>(a, w);
  if (f.bits == 4 && f.lut_e2m1) return qint_decode_impl<4, true, ZeroMode::kImplicit>(a, w);
  if (f.bits == 4) {
    if (explicit_zero) return qint_decode_impl<4, false, ZeroMode::kExplicit>(a, w);
    return qint_decode_impl<4, false, ZeroMode::kImplicit>(a, w);
  }
  if (f.bits == 5) {
    if (explicit_zero) return qint_decode_impl<5, false, ZeroMode::kExplicit>(a, w);
    return qint_decode_impl<5, false, ZeroMode::kImplicit>(a, w);
  }
  if (f.bits == 6) return qint_decode_impl<6, false, ZeroMode::kImplicit>(a, w);
  ref::qint_block_decode(a, w);
}

void fp8_decode(const Fp8Block& a, float* w) {
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

// out[i * ldo + r] = sum_k w[k * 16 + r] * x_i[k] for m fp32 rows.
void dense_dot(const float* const* x, int m, const float* w, int64_t kp, float* out, int64_t ldo) {
  constexpr int kTile = 6;  // 12 accumulators + 2 weight vectors + 1 broadcast
  int i = 0;
  for (; i + kTile <= m; i += kTile) dense_tile<kTile>(x + i, w, kp, out + i * ldo, ldo);
  x += i;
  out += i * ldo;
  switch (m - i) {
    case 5:
      return dense_tile<5>(x, w, kp, out, ldo);
    case 4:
      return dense_tile<4>(x, w, kp, out, ldo);
    case 3:
      return dense_tile<3>(x, w, kp, out, ldo);
    case 2:
      return dense_tile<2>(x, w, kp, out, ldo);
    case 1:
      return dense_tile<1>(x, w, kp, out, ldo);
    default:
      return;
  }
}

void qint_run(const DotArgs& a) {
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) qint_dot(qint_block(a, nb));
}
void qint_run_fp32(const DotArgs& a) {
  weight_only_dot<QintBlock>(a, qint_block, qint_decode, dense_dot);
}
void fp8_run(const DotArgs& a) {
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) fp8_dot(fp8_block(a, nb));
}
void fp8_run_fp32(const DotArgs& a) {
  weight_only_dot<Fp8Block>(a, fp8_block, fp8_decode, dense_dot);
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
