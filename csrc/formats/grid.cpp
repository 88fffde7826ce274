#include "formats/grid.h"

#include <cstring>

#include "formats/qint.h"  // half_bits_to_float

namespace kt::formats {

namespace {

#include "formats/grid_tables.inc"

// ksigns_iq2xs[i]: the 7 stored sign bits i and their parity as bit 7 (an even count
// of minus signs in every 8, as ggml's quantizer writes them).
inline uint32_t signs8(uint32_t i) { return i | (static_cast<uint32_t>(__builtin_parity(i)) << 7); }

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

// 8 values (one byte each) with the minus sign where bit j of `signs` is set.
inline void put8(uint64_t values, uint32_t signs, int8_t* out) {
  int8_t v[8];
  std::memcpy(v, &values, 8);
  for (int j = 0; j < 8; ++j) out[j] = (signs >> j) & 1 ? static_cast<int8_t>(-v[j]) : v[j];
}

// The 32 codes and the scale of group ib of one GGUF block `b` of type t.
void decode_group(GridType t, const uint8_t* b, int ib, int8_t* c, float* scale) {
  const float d = half_bits_to_float(load_u16(b));
  switch (t) {
    case GridType::kIq2xxs: {
      const uint32_t a0 = load_u32(b + 2 + 8 * ib), a1 = load_u32(b + 2 + 8 * ib + 4);
      *scale = d * static_cast<float>(2 * (a1 >> 28) + 1) * 0.125f;
      for (int l = 0; l < 4; ++l)
        put8(kIq2xxsGrid[(a0 >> (8 * l)) & 255], signs8((a1 >> (7 * l)) & 127), c + 8 * l);
      return;
    }
    case GridType::kIq3xxs: {
      const uint8_t* qs = b + 2 + 8 * ib;
      const uint32_t a = load_u32(b + 2 + 64 + 4 * ib);
      *scale = d * static_cast<float>(2 * (a >> 28) + 1) * 0.25f;
      for (int l = 0; l < 4; ++l) {
        const uint64_t v =
            kIq3xxsGrid[qs[2 * l]] | static_cast<uint64_t>(kIq3xxsGrid[qs[2 * l + 1]]) << 32;
        put8(v, signs8((a >> (7 * l)) & 127), c + 8 * l);
      }
      return;
    }
    case GridType::kIq3s: {
      const uint8_t* qs = b + 2 + 8 * ib;
      const uint8_t qh = b[2 + 64 + ib];
      const uint8_t* signs = b + 2 + 64 + 8 + 4 * ib;
      const uint8_t sc = (b[2 + 64 + 8 + 32 + ib / 2] >> (4 * (ib % 2))) & 15;
      *scale = d * static_cast<float>(2 * sc + 1);
      for (int l = 0; l < 4; ++l) {
        const uint32_t i0 = qs[2 * l] | (((qh >> (2 * l)) & 1u) << 8);
        const uint32_t i1 = qs[2 * l + 1] | (((qh >> (2 * l + 1)) & 1u) << 8);
        const uint64_t v = kIq3sGrid[i0] | static_cast<uint64_t>(kIq3sGrid[i1]) << 32;
        put8(v, signs[l], c + 8 * l);
      }
      return;
    }
    case GridType::kIq1s: {
      const uint8_t* qs = b + 2 + 4 * ib;
      const uint16_t qh = load_u16(b + 2 + 32 + 2 * ib);
      *scale = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1) * 0.125f;
      const int delta = qh & 0x8000 ? -1 : 1;
      for (int l = 0; l < 4; ++l) {
        int8_t v[8];
        std::memcpy(v, &kIq1sGrid[qs[l] | (((qh >> (3 * l)) & 7u) << 8)], 8);
        for (int j = 0; j < 8; ++j) c[8 * l + j] = static_cast<int8_t>(v[j] + delta);
      }
      return;
    }
    case GridType::kNone:
      break;
  }
  std::memset(c, 0, 32);
  *scale = 0.f;
}

}  // namespace

int64_t grid_type_bytes(GridType t) {
  switch (t) {
    case GridType::kIq2xxs:
      return 66;
    case GridType::kIq3xxs:
      return 98;
    case GridType::kIq3s:
      return 110;
    case GridType::kIq1s:
      return 50;
    case GridType::kNone:
      break;
  }
  return 0;
}

void grid_decode_block(GridType t, const uint8_t* block, int64_t kp, uint8_t* panel) {
  const int64_t tb = grid_type_bytes(t);
  const int64_t row_bytes = kp / kGridSuperK * tb;
  auto* codes = reinterpret_cast<int8_t*>(panel);
  auto* scales = reinterpret_cast<float*>(panel + 16 * kp);
  alignas(32) int8_t c[32];
  for (int r = 0; r < 16; ++r) {
    const uint8_t* row = block + r * row_bytes;
    for (int64_t s = 0; s < kp / kGridSuperK; ++s) {
      const uint8_t* b = row + s * tb;
      for (int ib = 0; ib < 8; ++ib) {
        const int64_t g = s * 8 + ib;  // panel group (32 k)
        decode_group(t, b, ib, c, &scales[g * 16 + r]);
        // quad q of the group: k = 32 g + 4 q, at [k/4][r][4]
        for (int q = 0; q < 8; ++q) std::memcpy(codes + ((8 * g + q) * 16 + r) * 4, c + 4 * q, 4);
      }
    }
  }
}

void grid_decode_row(GridType t, const uint8_t* block, int64_t kp, int r, float* w) {
  const int64_t tb = grid_type_bytes(t);
  const uint8_t* row = block + r * (kp / kGridSuperK * tb);
  int8_t c[32];
  float scale = 0.f;
  for (int64_t s = 0; s < kp / kGridSuperK; ++s)
    for (int ib = 0; ib < 8; ++ib) {
      decode_group(t, row + s * tb, ib, c, &scale);
      for (int j = 0; j < 32; ++j) w[(s * 8 + ib) * 32 + j] = scale * static_cast<float>(c[j]);
    }
}

}  // namespace kt::formats
