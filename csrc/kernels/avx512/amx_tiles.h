// AMX tile configuration shared by kt_ops' AMX kernels (kernels/avx512/bf16_amx.cpp,
// kernels/avx512/w8a8_amx.cpp): the 2 x 2 plan of both, two A tiles (tmm0 / tmm1, the
// second only where a token tile has more than 16 rows), two B tiles (tmm2 / tmm3, two
// adjacent 16-row weight blocks), four accumulators (tmm4..7). Intel SDM vol. 1 ch. 18
// ("Intel AMX"): palette 1, 8 tiles of at most 16 rows x 64 bytes.
#pragma once

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

// AMX targets: gcc 11+, clang 12+ (the kernels that include this header check the same).
#if ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
     (defined(__clang__) && __clang_major__ >= 12)) &&               \
    defined(__x86_64__)
#define KT_AMX_TILES_AVAILABLE 1

namespace kt::kernels::avx512::amx {

#define KT_AMX_TILE_TARGET __attribute__((target("amx-tile")))

constexpr int kTileRows = 16;  // token rows per A tile, and k groups per B tile

// AMX's tile configuration (palette 1), the layout ldtilecfg reads.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// A tiles of r0 and r1 rows (r1 = 0: one A tile), full-width B and C tiles.
KT_AMX_TILE_TARGET inline void configure_2x2(int r0, int r1) {
  TileConfig c;
  const int a_rows[2] = {r0, r1};
  for (int t = 0; t < 2; ++t) {
    if (a_rows[t] == 0) continue;
    c.rows[t] = static_cast<uint8_t>(a_rows[t]);
    c.colsb[t] = 64;
    c.rows[4 + 2 * t] = c.rows[5 + 2 * t] = static_cast<uint8_t>(a_rows[t]);
    c.colsb[4 + 2 * t] = c.colsb[5 + 2 * t] = 64;
  }
  c.rows[2] = c.rows[3] = kTileRows;
  c.colsb[2] = c.colsb[3] = 64;
  _tile_loadconfig(&c);
}

// A thread's scratch for decoded blocks: 64-byte aligned, grown on demand, kept for the
// thread's life (no std::vector here: its instantiations would be weak functions compiled
// with this tier's flags, cmake/check_isa_odr.py).
class ThreadBuffer {
 public:
  ThreadBuffer() = default;
  ThreadBuffer(const ThreadBuffer&) = delete;
  ThreadBuffer& operator=(const ThreadBuffer&) = delete;
  ~ThreadBuffer() { std::free(p_); }
  // At least `bytes` bytes; std::bad_alloc when the memory is not there.
  void* get(size_t bytes) {
    if (bytes > n_) {
      const size_t n = (bytes + 63) / 64 * 64;
      void* p = std::aligned_alloc(64, n);
      if (p == nullptr) throw std::bad_alloc();
      std::free(p_);
      p_ = p;
      n_ = n;
    }
    return p_;
  }

 private:
  void* p_ = nullptr;
  size_t n_ = 0;
};

// Loads configure_2x2(r0, r1) unless `*loaded` already holds that shape (-1: none).
KT_AMX_TILE_TARGET inline void ensure_2x2(int r0, int r1, int* loaded) {
  const int shape = r0 * 64 + r1;
  if (*loaded == shape) return;
  configure_2x2(r0, r1);
  *loaded = shape;
}

}  // namespace kt::kernels::avx512::amx

#endif  // KT_AMX_TILES_AVAILABLE
