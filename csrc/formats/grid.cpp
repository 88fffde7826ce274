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
constexpr int64_t kGridGroupK32 = 32;  // weights per group of the GGUF blocks' layouts

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

// IQ1_S / IQ1_M's delta as 8 bytes: +1 each (minus = 0) or -1 (minus = 1), without a
// branch (its sign is as random as the weights: a branch here ran IQ1_M's decode of random
// blocks 2.2x slower).
inline uint64_t delta_bytes(uint32_t minus) { return kOnes | (uint64_t{0} - (minus & 1u)); }

// Scales per group of 32 weights: 2 for the types with a scale per 16.
template <GridType T>
constexpr int kScalesPerGroup = static_cast<int>(kGridGroupK32 / grid_group_k(T));

// The fp16 d of GGUF block `b` as fp32 (IQ1_M: the top nibbles of its four scale words).
template <GridType T>
inline float block_d(const uint8_t* b) {
  if constexpr (T == GridType::kIq1m) {
    const uint8_t* sc = b + 48;
    const uint32_t bits = (load_u16(sc) >> 12) | ((load_u16(sc + 2) >> 8) & 0xF0u) |
                          ((load_u16(sc + 4) >> 4) & 0xF00u) | (load_u16(sc + 6) & 0xF000u);
    return half_bits_to_float(static_cast<uint16_t>(bits));
  } else {
    return half_bits_to_float(load_u16(b));
  }
}

// The 32 codes (as four 8-byte words) of group ib of one GGUF block `b` of type T whose
// d is `d`, and its scale (s[0]) or, for the types with scales per 16, the scales of its
// first and second 16 weights (s[0], s[1]).
template <GridType T>
inline void decode_group(const uint8_t* b, float d, int ib, uint64_t* c, float* s) {
  if constexpr (T == GridType::kIq2xxs) {
    const uint32_t a0 = load_u32(b + 2 + 8 * ib), a1 = load_u32(b + 2 + 8 * ib + 4);
    for (int l = 0; l < 4; ++l)
      c[l] =
          apply_signs(kIq2xxsGrid[(a0 >> (8 * l)) & 255], kSignMasks.even[(a1 >> (7 * l)) & 127]);
    s[0] = d * static_cast<float>(2 * (a1 >> 28) + 1) * 0.125f;
  } else if constexpr (T == GridType::kIq2xs) {
    const uint8_t* qs = b + 2 + 8 * ib;
    for (int l = 0; l < 4; ++l) {
      const uint32_t v = load_u16(qs + 2 * l);
      c[l] = apply_signs(kIq2xsGrid[v & 511], kSignMasks.even[v >> 9]);
    }
    const uint32_t ls = b[2 + 64 + ib];
    s[0] = d * static_cast<float>(2 * (ls & 15) + 1) * 0.125f;
    s[1] = d * static_cast<float>(2 * (ls >> 4) + 1) * 0.125f;
  } else if constexpr (T == GridType::kIq2s) {
    const uint8_t* qs = b + 2 + 4 * ib;
    const uint8_t* signs = b + 2 + 32 + 4 * ib;
    const uint32_t qh = b[2 + 64 + ib];
    for (int l = 0; l < 4; ++l)
      c[l] = apply_signs(kIq2sGrid[qs[l] | (((qh >> (2 * l)) & 3u) << 8)], kSignMasks.m[signs[l]]);
    const uint32_t ls = b[2 + 64 + 8 + ib];
    s[0] = d * static_cast<float>(2 * (ls & 15) + 1) * 0.125f;
    s[1] = d * static_cast<float>(2 * (ls >> 4) + 1) * 0.125f;
  } else if constexpr (T == GridType::kIq3xxs) {
    const uint8_t* qs = b + 2 + 8 * ib;
    const uint32_t a = load_u32(b + 2 + 64 + 4 * ib);
    for (int l = 0; l < 4; ++l) {
      const uint64_t v = kIq3xxsGrid[qs[2 * l]] | static_cast<uint64_t>(kIq3xxsGrid[qs[2 * l + 1]])
                                                      << 32;
      c[l] = apply_signs(v, kSignMasks.even[(a >> (7 * l)) & 127]);
    }
    s[0] = d * static_cast<float>(2 * (a >> 28) + 1) * 0.25f;
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
    s[0] = d * static_cast<float>(2 * sc + 1);
  } else if constexpr (T == GridType::kIq1m) {  // IQ1_S' codes with a delta per 8 weights
    const uint8_t* qs = b + 4 * ib;
    const uint8_t* qh = b + 32 + 2 * ib;
    for (int l = 0; l < 4; ++l) {
      const uint32_t h = (qh[l / 2] >> (4 * (l % 2))) & 15;
      c[l] = add_bytes(kIq1sGrid[qs[l] | ((h & 7u) << 8)], delta_bytes(h >> 3));
    }
    const uint32_t sc = load_u16(b + 48 + 2 * (ib / 2)) >> (6 * (ib % 2));
    s[0] = d * static_cast<float>(2 * (sc & 7) + 1) * 0.125f;
    s[1] = d * static_cast<float>(2 * ((sc >> 3) & 7) + 1) * 0.125f;
  } else {  // kIq1s: 8 * {-1, 0, 1} plus the delta's +-1
    const uint8_t* qs = b + 2 + 4 * ib;
    const uint32_t qh = load_u16(b + 2 + 32 + 2 * ib);
    const uint64_t delta = delta_bytes(qh >> 15);
    for (int l = 0; l < 4; ++l)
      c[l] = add_bytes(kIq1sGrid[qs[l] | (((qh >> (3 * l)) & 7u) << 8)], delta);
    s[0] = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1) * 0.125f;
  }
}

// grid_decode_block for type T: super-block by super-block, its 16 rows in turn (the
// panel's 4 KiB of one super-block stay in L1 while its rows fill it: row by row over the
// whole panel, 36 KiB at K = 2048, ran 1.8x slower), each group's four 8-byte words split
// into the 4-byte quads of the panel ([k/4][16][4]: quad q of row r at (q * 16 + r) * 4).
template <GridType T>
void decode_block(const uint8_t* block, int64_t kp, uint8_t* panel) {
  constexpr int S = kScalesPerGroup<T>;
  const int64_t tb = grid_type_bytes(T);
  const int64_t supers = kp / kGridSuperK;
  auto* scales = reinterpret_cast<float*>(panel + 16 * kp);
  uint64_t c[4];
  float s[S];
  for (int64_t sb = 0; sb < supers; ++sb) {
    for (int r = 0; r < 16; ++r) {
      const uint8_t* b = block + (r * supers + sb) * tb;
      const float d = block_d<T>(b);
      for (int ib = 0; ib < 8; ++ib) {
        const int64_t g = sb * 8 + ib;  // group of 32 k
        decode_group<T>(b, d, ib, c, s);
        for (int h = 0; h < S; ++h) scales[(g * S + h) * 16 + r] = s[h];
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
  constexpr int S = kScalesPerGroup<T>;
  const int64_t tb = grid_type_bytes(T);
  const uint8_t* row = block + r * (kp / kGridSuperK * tb);
  uint64_t c[4];
  float s[S];
  for (int64_t g = k0 / kGridGroupK32; g * kGridGroupK32 < k1; ++g) {  // groups of 32 k
    const uint8_t* b = row + (g / 8) * tb;
    decode_group<T>(b, block_d<T>(b), static_cast<int>(g % 8), c, s);
    int8_t v[32];
    std::memcpy(v, c, 32);
    for (int j = 0; j < 32; ++j) {
      const int64_t k = g * kGridGroupK32 + j;
      if (k < k1) w[k - k0] = s[j * S / 32] * static_cast<float>(v[j]);
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
    case GridType::kIq1m:
      return f(std::integral_constant<GridType, GridType::kIq1m>{});
    case GridType::kIq2xs:
      return f(std::integral_constant<GridType, GridType::kIq2xs>{});
    case GridType::kIq2s:
      return f(std::integral_constant<GridType, GridType::kIq2s>{});
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
