#include "formats/grid.h"

#include <cstring>

#include "formats/grid_blocks.h"
#include "formats/qint.h"  // half_bits_to_float

namespace kt::formats {

namespace {

using namespace grid_blocks;

// The fp16 d of GGUF block `b` as fp32.
template <GridType T>
inline float block_d(const uint8_t* b) {
  return half_bits_to_float(block_d_bits<T>(b));
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
        group_scales<T>(b, d, ib, s);
        group_codes<T>(b, ib, c);
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
  for (int64_t g = k0 / kGroupK; g * kGroupK < k1; ++g) {  // groups of 32 k
    const uint8_t* b = row + (g / 8) * tb;
    group_scales<T>(b, block_d<T>(b), static_cast<int>(g % 8), s);
    group_codes<T>(b, static_cast<int>(g % 8), c);
    int8_t v[32];
    std::memcpy(v, c, 32);
    for (int j = 0; j < 32; ++j) {
      const int64_t k = g * kGroupK + j;
      if (k < k1) w[k - k0] = s[j * S / 32] * static_cast<float>(v[j]);
    }
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
