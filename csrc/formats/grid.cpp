#include "formats/grid.h"

#include <cstring>
#include <type_traits>

#include "formats/qint.h"  // half_bits_to_float

namespace kt::formats {

namespace {

#include "formats/grid_tables.inc"

// kSignMasks.m[s]: byte j = 0xFF where bit j of s is set (a minus sign), else 0; .even[i]:
// the mask of ggml's ksigns_iq2xs[i], the 7 stored sign bits i and their parity as bit 7
// (an even count of minus signs in every 8, as ggml's quantizer writes them).
struct SignMasks {
  uint64_t m[256];
  uint64_t even[128];
  constexpr SignMasks() : m(), even() {
    for (int s = 0; s < 256; ++s) {
      int ones = 0;
      for (int j = 0; j < 8; ++j)
        if ((s >> j) & 1) {
          m[s] |= uint64_t{0xFF} << (8 * j);
          ++ones;
        }
      if (ones % 2 == 0) even[s & 127] = m[s];
    }
  }
};
constexpr SignMasks kSignMasks;

constexpr uint64_t kOnes = 0x0101010101010101ull;

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// 8 positive byte values (below 128) negated where the mask byte is 0xFF, all 8 bytes at
// once: -v = (v ^ 0xFF) + 1 per byte, which never carries into the next byte for v > 0.
inline uint64_t apply_signs(uint64_t values, uint64_t mask) {
  return (values ^ mask) + (mask & kOnes);
}

// 8 bytes plus +1 or -1 each (delta: kOnes or ~0), per byte (SWAR: no carries between).
inline uint64_t add_bytes(uint64_t v, uint64_t delta) {
  constexpr uint64_t kLow7 = 0x7F7F7F7F7F7F7F7Full;
  return ((v & kLow7) + (delta & kLow7)) ^ ((v ^ delta) & ~kLow7);
}

// The 32 codes (as four 8-byte words) and the scale of group ib of one GGUF block `b`
// of type T whose fp16 d is `d`.
template <GridType T>
inline float decode_group(const uint8_t* b, float d, int ib, uint64_t* c) {
  if constexpr (T == GridType::kIq2xxs) {
    const uint32_t a0 = load_u32(b + 2 + 8 * ib), a1 = load_u32(b + 2 + 8 * ib + 4);
    for (int l = 0; l < 4; ++l)
      c[l] =
          apply_signs(kIq2xxsGrid[(a0 >> (8 * l)) & 255], kSignMasks.even[(a1 >> (7 * l)) & 127]);
    return d * static_cast<float>(2 * (a1 >> 28) + 1) * 0.125f;
  } else if constexpr (T == GridType::kIq3xxs) {
    const uint8_t* qs = b + 2 + 8 * ib;
    const uint32_t a = load_u32(b + 2 + 64 + 4 * ib);
    for (int l = 0; l < 4; ++l) {
      const uint64_t v = kIq3xxsGrid[qs[2 * l]] | static_cast<uint64_t>(kIq3xxsGrid[qs[2 * l + 1]])
                                                      << 32;
      c[l] = apply_signs(v, kSignMasks.even[(a >> (7 * l)) & 127]);
    }
    return d * static_cast<float>(2 * (a >> 28) + 1) * 0.25f;
  } else if constexpr (T == GridType::kIq3s) {
    const uint8_t* qs = b + 2 + 8 * ib;
    const uint32_t qh = b[2 + 64 + ib];
    const uint8_t* signs = b + 2 + 64 + 8 + 4 * ib;
    for (int l = 0; l < 4; ++l) {
      const uint32_t i0 = qs[2 * l] | (((qh >> (2 * l)) & 1u) << 8);
      const uint32_t i1 = qs[2 * l + 1] | (((qh >> (2 * l + 1)) & 1u) << 8);
      const uint64_t v = kIq3sGrid[i0] | static_cast<uint64_t>(kIq3sGrid[i1]) << 32;
      c[l] = apply_signs(v, kSignMasks.m[signs[l]]);
    }
    const uint32_t sc = (b[2 + 64 + 8 + 32 + ib / 2] >> (4 * (ib % 2))) & 15;
    return d * static_cast<float>(2 * sc + 1);
  } else {  // kIq1s: 8 * {-1, 0, 1} plus the delta's +-1
    const uint8_t* qs = b + 2 + 4 * ib;
    const uint32_t qh = load_u16(b + 2 + 32 + 2 * ib);
    const uint64_t delta = qh & 0x8000 ? ~uint64_t{0} : kOnes;
    for (int l = 0; l < 4; ++l)
      c[l] = add_bytes(kIq1sGrid[qs[l] | (((qh >> (3 * l)) & 7u) << 8)], delta);
    return d * static_cast<float>(2 * ((qh >> 12) & 7) + 1) * 0.125f;
  }
}

// grid_decode_block for type T: super-block by super-block, its 16 rows in turn (the
// panel's 4 KiB of one super-block stay in L1 while its rows fill it: row by row over the
// whole panel, 36 KiB at K = 2048, ran 1.8x slower), each group's four 8-byte words split
// into the 4-byte quads of the panel ([k/4][16][4]: quad q of row r at (q * 16 + r) * 4).
template <GridType T>
void decode_block(const uint8_t* block, int64_t kp, uint8_t* panel) {
  const int64_t tb = grid_type_bytes(T);
  const int64_t supers = kp / kGridSuperK;
  auto* scales = reinterpret_cast<float*>(panel + 16 * kp);
  uint64_t c[4];
  for (int64_t s = 0; s < supers; ++s) {
    for (int r = 0; r < 16; ++r) {
      const uint8_t* b = block + (r * supers + s) * tb;
      const float d = half_bits_to_float(load_u16(b));
      for (int ib = 0; ib < 8; ++ib) {
        const int64_t g = s * 8 + ib;  // panel group (32 k)
        scales[g * 16 + r] = decode_group<T>(b, d, ib, c);
        uint8_t* q = panel + (8 * g * 16 + r) * 4;
        for (int l = 0; l < 4; ++l) {
          const uint32_t lo = static_cast<uint32_t>(c[l]), hi = static_cast<uint32_t>(c[l] >> 32);
          std::memcpy(q + (2 * l) * 64, &lo, 4);
          std::memcpy(q + (2 * l + 1) * 64, &hi, 4);
        }
      }
    }
  }
}

template <GridType T>
void decode_row(const uint8_t* block, int64_t kp, int r, int64_t k0, int64_t k1, float* w) {
  const int64_t tb = grid_type_bytes(T);
  const uint8_t* row = block + r * (kp / kGridSuperK * tb);
  uint64_t c[4];
  for (int64_t g = k0 / kGridGroupK; g * kGridGroupK < k1; ++g) {  // groups of 32 k
    const uint8_t* b = row + (g / 8) * tb;
    const float scale =
        decode_group<T>(b, half_bits_to_float(load_u16(b)), static_cast<int>(g % 8), c);
    int8_t v[32];
    std::memcpy(v, c, 32);
    for (int j = 0; j < 32; ++j) {
      const int64_t k = g * kGridGroupK + j;
      if (k < k1) w[k - k0] = scale * static_cast<float>(v[j]);
    }
  }
}

// f(std::integral_constant<GridType, T>{}) for the type t (nothing for kNone).
template <class F>
void with_type(GridType t, F f) {
  switch (t) {
    case GridType::kIq2xxs:
      return f(std::integral_constant<GridType, GridType::kIq2xxs>{});
    case GridType::kIq3xxs:
      return f(std::integral_constant<GridType, GridType::kIq3xxs>{});
    case GridType::kIq3s:
      return f(std::integral_constant<GridType, GridType::kIq3s>{});
    case GridType::kIq1s:
      return f(std::integral_constant<GridType, GridType::kIq1s>{});
    case GridType::kNone:
      break;
  }
}

}  // namespace

void grid_decode_block(GridType t, const uint8_t* block, int64_t kp, uint8_t* panel) {
  with_type(t, [&](auto type) { decode_block<decltype(type)::value>(block, kp, panel); });
}

void grid_decode_row(GridType t, const uint8_t* block, int64_t kp, int r, int64_t k0, int64_t k1,
                     float* w) {
  with_type(t, [&](auto type) { decode_row<decltype(type)::value>(block, kp, r, k0, k1, w); });
}

}  // namespace kt::formats
