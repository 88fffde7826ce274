// The LoRA backward's split panels of the qint formats (moe/expert_weights.cpp,
// split_vnni_panel): 16 columns of one 16-row block of codes decoded to fp32, one
// register per column (16 rows), the same values as the scalar dense decoder
// (dequantize_qint_transposed: a product, then a difference, no FMA) at 16 lanes; then,
// in registers, rounded to bf16 hi (and lo = bf16(v - hi)), paired by rows and
// transposed into the panel's 8 row pairs (kernels/avx512/vnni_pairs.h). AVX512_BF16.
//
// Code layout (formats/qint.h, kernels/qint_tiles.h): 8-bit codes [Kp/4][16][4] (row r's
// 4 consecutive k in lane r of a line); 2/3-bit codes [Kp/16][16][4] (bit pair 2 c of
// byte j: k = 16 l + 4 c + j; 3-bit: the third bit in a high plane as 5-bit codes');
// 4/5/6-bit codes [Kp/8][16][4] in the low plane
// (byte j of lane r: low nibble k = 8 l + j, high nibble k = 8 l + 4 + j), and for 5/6
// bits a high plane after it (one line per 32 / 16 k: bit (or bit pair) of k at
// 8 j + (k % 32) / 4 (+ 1 for the high nibble's half), resp. 8 j + 2 ((k % 16) / 4)).
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

#include "kernels/avx512/vec.h"
#include "kernels/avx512/vnni_pairs.h"
#include "kernels/tiers.h"

namespace kt::kernels::avx512 {

namespace {

// The values of the 16 codes of a table form as fp32 (kE2m1: 2 e2m1(c), the kernel codes
// minus 12; kIq4nl: IQ4_NL's grid); zeros for the other forms.
template <QintValue A>
inline __m512 code_table_ps() {
  const auto bytes = [](const void* t) { return _mm_load_si128(static_cast<const __m128i*>(t)); };
  if (A == QintValue::kE2m1)
    return _mm512_cvtepi32_ps(_mm512_sub_epi32(
        _mm512_cvtepu8_epi32(bytes(formats::kE2m1KernelCodes)), _mm512_set1_epi32(12)));
  if (A == QintValue::kIq4nl)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes(formats::kIq4nlValues)));
  return _mm512_setzero_ps();
}

// The 16 columns [k0, k0 + 16) of the block as fp32 registers v[c] (row r in lane r).
// k0 is a multiple of 16: the columns are 2 lines of the low plane (8-bit: 4, 2/3-bit: 1), each
// code at a fixed bit of its line, so the loops below unroll to immediate shifts (per-
// column address and shift arithmetic had been most of the decode's scalar work).
template <int Bits, QintValue A>
inline void columns(const uint8_t* low, const uint8_t* high, int32_t offset, int64_t k0,
                    const float* s, const float* z, __m512 v[16]) {
  const __m512 sv = _mm512_loadu_ps(s);
  const __m512 zv = A == QintValue::kZeros ? _mm512_loadu_ps(z) : _mm512_setzero_ps();
  // mxfp4: E2M1 code c -> 2 e2m1(c) (magnitudes 0, 1, 2, 3, 4, 6, 8, 12, bit 3 the sign;
  // -0 as +0, as the scalar decoder's integer form); iq4: IQ4_NL's values.
  const __m512 table = code_table_ps<A>();
  const __m512i off = _mm512_set1_epi32(offset);
  auto value = [&](__m512i q) {
    if (A == QintValue::kSigned || A == QintValue::kZeros) {
      const __m512 p = _mm512_mul_ps(sv, _mm512_cvtepi32_ps(q));
      return A == QintValue::kZeros ? _mm512_sub_ps(p, zv) : p;
    }
    if (A == QintValue::kOffset)
      return _mm512_mul_ps(sv, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, off)));
    return _mm512_mul_ps(sv, _mm512_permutexvar_ps(q, table));
  };
  if constexpr (Bits == 8) {
#pragma GCC unroll 4
    for (int l = 0; l < 4; ++l) {  // 4 k per line, byte j of a row's lane
      const __m512i line = _mm512_loadu_si512(low + (k0 / 4 + l) * 64);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j)
        v[4 * l + j] = value(_mm512_srai_epi32(_mm512_slli_epi32(line, 24 - 8 * j), 24));
    }
    return;
  }
  if constexpr (Bits <= 3) {
    // 2-bit plane: the 16 columns are one line, code k0 + 4 c + j at bits 8 j + 2 c of a
    // row's lane; 3-bit codes' third bit at 8 j + (k0 % 32) / 4 + c of the high plane's
    // line (one per 32 k).
    const __m512i line = _mm512_loadu_si512(low + (k0 / 16) * 64);
    [[maybe_unused]] __m512i hl;
    if constexpr (Bits == 3) hl = _mm512_loadu_si512(high + (k0 / 32) * 64);
    const int h3 = static_cast<int>((k0 % 32) / 4);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i q = _mm512_and_si512(_mm512_srli_epi32(line, 8 * j + 2 * c), _mm512_set1_epi32(3));
        if constexpr (Bits == 3)
          q = _mm512_or_si512(
              q, _mm512_slli_epi32(
                     _mm512_and_si512(_mm512_srl_epi32(hl, _mm_cvtsi32_si128(8 * j + h3 + c)),
                                      _mm512_set1_epi32(1)),
                     2));
        v[4 * c + j] = value(q);
      }
    }
    return;
  }
  // 5/6-bit high planes: one line per 32 / 16 k (formats/qint.h, qint_code): the high
  // bit(s) of code k = kw + 4 half + j (kw = k0 + 8 l) at 8 j + hs, hs = (kw % 32) / 4 +
  // half for 5 bits, 2 ((kw % 16) / 4) + 2 half for 6.
  [[maybe_unused]] __m512i hl;
  if constexpr (Bits == 5 || Bits == 6)
    hl = _mm512_loadu_si512(high + (k0 / (Bits == 5 ? 32 : 16)) * 64);
  const int h5 = static_cast<int>((k0 % 32) / 4);  // 5-bit: the first line's bit base
#pragma GCC unroll 2
  for (int l = 0; l < 2; ++l) {
    const __m512i line = _mm512_loadu_si512(low + (k0 / 8 + l) * 64);
#pragma GCC unroll 2
    for (int half = 0; half < 2; ++half) {
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i q =
            _mm512_and_si512(_mm512_srli_epi32(line, 8 * j + 4 * half), _mm512_set1_epi32(15));
        if constexpr (Bits == 5) {
          const int hs = h5 + 2 * l + half;
          q = _mm512_or_si512(
              q, _mm512_slli_epi32(
                     _mm512_and_si512(_mm512_srl_epi32(hl, _mm_cvtsi32_si128(8 * j + hs)),
                                      _mm512_set1_epi32(1)),
                     4));
        } else if constexpr (Bits == 6) {
          const int hs = 4 * l + 2 * half;
          q = _mm512_or_si512(
              q, _mm512_slli_epi32(
                     _mm512_and_si512(_mm512_srli_epi32(hl, 8 * j + hs), _mm512_set1_epi32(3)), 4));
        }
        v[8 * l + 4 * half + j] = value(q);
      }
    }
  }
}

// The panel of columns [k0, k0 + cols): per 16 columns, two columns rounded by one
// vcvtne2ps2bf16 into one register of words (column 2i's rows in words 0-15, column
// 2i + 1's in 16-31), paired by one vpermw; lo = bf16(v - hi) with hi widened back from
// those words. AVX512_BF16, as the products that read the panels (before: an integer
// rounding of each column and a two-source word permute, twice the operations).
// Round-to-nearest-even; inputs below bf16's smallest normal are flushed to zero: no
// decoded weight of a real checkpoint is one (a lo part is one below |v| ~ 2^-117), and
// mxfp4's exact panels exclude them (panel_values_exact).
template <int Bits, QintValue A, bool Lo>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void block_panel(
    const uint8_t* low, const uint8_t* high, int32_t offset, int64_t k0, int64_t cols,
    const float* s, const float* z, const PanelSlices& out, uint16_t* hi, uint16_t* lo) {
  // Qword j of a pair register: words (row 2j, 2j + 1) of column 2i, then of column 2i + 1.
  const __m512i pick = _mm512_set_epi16(31, 30, 15, 14, 29, 28, 13, 12, 27, 26, 11, 10, 25, 24, 9,
                                        8, 23, 22, 7, 6, 21, 20, 5, 4, 19, 18, 3, 2, 17, 16, 1, 0);
  // The fp32 value of 16 bf16 words.
  auto widen = [](__m256i w) __attribute__((target("avx512f,avx512bw"))) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
  };
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    __m512 v[16];
    columns<Bits, A>(low, high, offset, k0 + c0, s + c0, z + c0, v);
    __m512i p[8], q[8];
    for (int i = 0; i < 8; ++i) {
      const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v[2 * i + 1], v[2 * i]));
      p[i] = _mm512_permutexvar_epi16(pick, h);
      if constexpr (Lo) {
        // v - hi is exact in fp32 (hi is v rounded to 8 significant bits).
        const __m512 d0 = _mm512_sub_ps(v[2 * i], widen(_mm512_castsi512_si256(h)));
        const __m512 d1 = _mm512_sub_ps(v[2 * i + 1], widen(_mm512_extracti64x4_epi64(h, 1)));
        q[i] =
            _mm512_permutexvar_epi16(pick, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(d1, d0)));
      }
    }
    transpose_8x8_epi64(p);  // p[j]: qword i = columns 2i, 2i + 1 of pair j
    const int64_t at = out.at(c0, 0), pair = out.width * 2;  // one division per slice
    for (int j = 0; j < 8; ++j) _mm512_storeu_si512(hi + at + j * pair, p[j]);
    if constexpr (Lo) {
      transpose_8x8_epi64(q);
      for (int j = 0; j < 8; ++j) _mm512_storeu_si512(lo + at + j * pair, q[j]);
    }
  }
}

// The same panel for 4-bit codes through tables: a 16-column slice lies in one group, so
// each row has only 16 values there, and a panel line (one row pair, 16 columns) draws on
// two rows' 32: per row pair and group one table of 32 bf16 words (hi; lo likewise), the
// values computed as `columns` does (a product, then a difference) and rounded by the
// same vcvtne2ps2bf16, so the same bits. A line is then one vpermw of the table by its
// codes + 16 p (row 2j + p), the codes moved from the block's lines (row r's dword, a
// nibble per k) to word 2c + p of column c by one two-source qword permute, one in-lane
// byte shuffle and a per-lane shift: no transpose. About half the operations of
// `block_panel` per slice with hi + lo (the tables remade only where a slice's scales
// differ from the previous slice's: once per group).
template <QintValue A, bool Lo>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void nibble_panel(
    const uint8_t* low, const uint8_t*, int32_t offset, int64_t k0, int64_t cols, const float* s,
    const float* z, const PanelSlices& out, uint16_t* hi, uint16_t* lo) {
  // The code values q (as `columns`): q - offset, q (with zeros), 2 e2m1(q), IQ4_NL's.
  const __m512 q = [&] {
    if (A == QintValue::kE2m1 || A == QintValue::kIq4nl) return code_table_ps<A>();
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    if (A == QintValue::kOffset)
      return _mm512_cvtepi32_ps(_mm512_sub_epi32(iota, _mm512_set1_epi32(offset)));
    return _mm512_cvtepi32_ps(iota);
  }();
  auto widen = [](__m256i w) __attribute__((target("avx512f,avx512bw"))) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16));
  };
  // Word 2c + p of a line: column c (of 16) of row 2j + p. Lanes 0 / 1 read line l's low /
  // high nibbles (columns 0-3 / 4-7), lanes 2 / 3 line l + 1's (8-11 / 12-15); in each lane
  // the row pair's qword: bytes 0-3 row 2j, 4-7 row 2j + 1.
  const __m512i bytes =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, -1, 4, -1, 1, -1, 5, -1, 2, -1, 6, -1, 3, -1, 7, -1));
  const __m512i shifts = _mm512_setr_epi64(0, 0, 0x0004000400040004, 0x0004000400040004, 0, 0,
                                           0x0004000400040004, 0x0004000400040004);
  const __m512i odd = _mm512_set1_epi32(16 << 16);  // + 16 for row 2j + 1's half of the table
  const __m512i m4 = _mm512_set1_epi16(0x0F);
  __m512i thi[8], tlo[8];
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const float* sc = s + c0;
    const float* zc = z + c0;
    const bool same = c0 > 0 &&
                      _mm512_cmpneq_ps_mask(_mm512_loadu_ps(sc), _mm512_loadu_ps(sc - 16)) == 0 &&
                      (A != QintValue::kZeros ||
                       _mm512_cmpneq_ps_mask(_mm512_loadu_ps(zc), _mm512_loadu_ps(zc - 16)) == 0);
    if (!same) {
      for (int j = 0; j < 8; ++j) {
        __m512 v0 = _mm512_mul_ps(_mm512_set1_ps(sc[2 * j]), q);
        __m512 v1 = _mm512_mul_ps(_mm512_set1_ps(sc[2 * j + 1]), q);
        if constexpr (A == QintValue::kZeros) {
          v0 = _mm512_sub_ps(v0, _mm512_set1_ps(zc[2 * j]));
          v1 = _mm512_sub_ps(v1, _mm512_set1_ps(zc[2 * j + 1]));
        }
        const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v1, v0));
        thi[j] = h;
        if constexpr (Lo) {
          const __m512 d0 = _mm512_sub_ps(v0, widen(_mm512_castsi512_si256(h)));
          const __m512 d1 = _mm512_sub_ps(v1, widen(_mm512_extracti64x4_epi64(h, 1)));
          tlo[j] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(d1, d0));
        }
      }
    }
    const int64_t k = k0 + c0;  // a multiple of 16: lines k / 8 and k / 8 + 1
    const __m512i l0 = _mm512_loadu_si512(low + (k / 8) * 64);
    const __m512i l1 = _mm512_loadu_si512(low + (k / 8 + 1) * 64);
    const int64_t at = out.at(c0, 0), pair = out.width * 2;  // one division per slice
    for (int j = 0; j < 8; ++j) {
      const __m512i pick = _mm512_setr_epi64(j, j, j, j, 8 + j, 8 + j, 8 + j, 8 + j);
      const __m512i src = _mm512_permutex2var_epi64(l0, pick, l1);
      const __m512i codes =
          _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_epi8(src, bytes), shifts), m4);
      const __m512i idx = _mm512_or_si512(codes, odd);
      _mm512_storeu_si512(hi + at + j * pair, _mm512_permutexvar_epi16(idx, thi[j]));
      if constexpr (Lo)
        _mm512_storeu_si512(lo + at + j * pair, _mm512_permutexvar_epi16(idx, tlo[j]));
    }
  }
}

using PanelFn = void (*)(const uint8_t*, const uint8_t*, int32_t, int64_t, int64_t, const float*,
                         const float*, const PanelSlices&, uint16_t*, uint16_t*);

// make(bits, value) for the code widths and value forms the decoders cover (as
// std::integral_constant arguments), else nullptr.
template <class Make>
PanelFn by_form(int bits, QintValue value, const Make& make) {
  using V = QintValue;
  auto is = [&](V v) { return value == v; };
  using std::integral_constant;
  switch (bits) {
    case 8:
      if (is(V::kSigned))
        return make(integral_constant<int, 8>{}, integral_constant<V, V::kSigned>{});
      return nullptr;
    case 4:
      if (is(V::kOffset))
        return make(integral_constant<int, 4>{}, integral_constant<V, V::kOffset>{});
      if (is(V::kZeros))
        return make(integral_constant<int, 4>{}, integral_constant<V, V::kZeros>{});
      if (is(V::kE2m1)) return make(integral_constant<int, 4>{}, integral_constant<V, V::kE2m1>{});
      if (is(V::kIq4nl))
        return make(integral_constant<int, 4>{}, integral_constant<V, V::kIq4nl>{});
      return nullptr;
    case 2:
      if (is(V::kOffset))
        return make(integral_constant<int, 2>{}, integral_constant<V, V::kOffset>{});
      if (is(V::kZeros))
        return make(integral_constant<int, 2>{}, integral_constant<V, V::kZeros>{});
      return nullptr;
    case 3:
      if (is(V::kOffset))
        return make(integral_constant<int, 3>{}, integral_constant<V, V::kOffset>{});
      if (is(V::kZeros))
        return make(integral_constant<int, 3>{}, integral_constant<V, V::kZeros>{});
      return nullptr;
    case 5:
      if (is(V::kOffset))
        return make(integral_constant<int, 5>{}, integral_constant<V, V::kOffset>{});
      if (is(V::kZeros))
        return make(integral_constant<int, 5>{}, integral_constant<V, V::kZeros>{});
      return nullptr;
    case 6:
      if (is(V::kOffset))
        return make(integral_constant<int, 6>{}, integral_constant<V, V::kOffset>{});
      if (is(V::kZeros))
        return make(integral_constant<int, 6>{}, integral_constant<V, V::kZeros>{});
      return nullptr;
    default:
      return nullptr;
  }
}

}  // namespace

bool qint_block_vnni_split(const uint8_t* low, const uint8_t* high, int bits, QintValue value,
                           int32_t offset, int64_t k0, int64_t cols, const float* s, const float* z,
                           const PanelSlices& out, uint16_t* hi, uint16_t* lo) {
  const PanelFn fn = by_form(bits, value, [&](auto b, auto v) -> PanelFn {
    if constexpr (b() == 4)
      return lo == nullptr ? nibble_panel<v(), false> : nibble_panel<v(), true>;
    else
      return lo == nullptr ? block_panel<b(), v(), false> : block_panel<b(), v(), true>;
  });
  if (fn == nullptr) return false;
  fn(low, high, offset, k0, cols, s, z, out, hi, lo);
  return true;
}

void kquant_record_params(const uint8_t* rec, formats::ScaleType t, float* s, float* z) {
  QintVec512<false>::kquant_decode(rec, t, s, z);
}

void qint_params16(const void* base, formats::ScaleType t, int64_t index, float* out) {
  _mm512_storeu_ps(out, QintVec512<false>::load_scales(base, t, index));
}

}  // namespace kt::kernels::avx512
