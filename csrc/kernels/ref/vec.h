// Vector traits for the portable reference tier: 16 fp32 lanes as a plain
// array, scalar C++ only (std::exp), no intrinsics. Its shape (16 lanes, tiles
// of up to 8 tokens) is that of the AVX-512 tier, so every machine exercises
// the AVX-512 tile schedule of bf16_tiles.h through this path; only the
// intrinsic wrappers of kernels/avx512/vec.h are left to AVX-512 hosts.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kt::kernels::ref {

struct Vec {
  struct Reg {
    float v[16];
  };
  static constexpr int kLanes = 16;
  static constexpr int kMaxTile = 8;

  template <class F>
  static inline Reg map(F f) {
    Reg r;
    for (int i = 0; i < 16; ++i) r.v[i] = f(i);
    return r;
  }
  static inline Reg zero() {
    return map([](int) { return 0.0f; });
  }
  static inline Reg set1(float x) {
    return map([x](int) { return x; });
  }
  static inline Reg load(const float* p) {
    return map([p](int i) { return p[i]; });
  }
  static inline void store(float* p, const Reg& a) { std::memcpy(p, a.v, sizeof(a.v)); }
  static inline Reg add(const Reg& a, const Reg& b) {
    return map([&](int i) { return a.v[i] + b.v[i]; });
  }
  static inline Reg mul(const Reg& a, const Reg& b) {
    return map([&](int i) { return a.v[i] * b.v[i]; });
  }
  static inline Reg div(const Reg& a, const Reg& b) {
    return map([&](int i) { return a.v[i] / b.v[i]; });
  }
  static inline Reg neg(const Reg& a) {
    return map([&](int i) { return -a.v[i]; });
  }
  static inline Reg fma(const Reg& a, const Reg& b, const Reg& c) {
    return map([&](int i) { return a.v[i] * b.v[i] + c.v[i]; });
  }
  static inline Reg abs(const Reg& a) {
    return map([&](int i) { return std::fabs(a.v[i]); });
  }
  static inline Reg max(const Reg& a, const Reg& b) {
    return map([&](int i) { return a.v[i] > b.v[i] ? a.v[i] : b.v[i]; });
  }
  // a < b ? a : b (b when either is NaN, as x86's minps).
  static inline Reg min(const Reg& a, const Reg& b) {
    return map([&](int i) { return a.v[i] < b.v[i] ? a.v[i] : b.v[i]; });
  }
  // copysign(1, a): +1 or -1 by a's sign bit (-0.0 gives -1).
  static inline Reg sign1(const Reg& a) {
    return map([&](int i) { return std::copysign(1.0f, a.v[i]); });
  }
  static inline Reg exp(const Reg& a) {
    return map([&](int i) { return std::exp(a.v[i]); });
  }
  // bf16 bits to fp32: the bits become the high half of the fp32 word.
  static inline void load_bf16_pairs(const uint16_t* p, Reg* even, Reg* odd) {
    for (int r = 0; r < 16; ++r) {
      const uint32_t e = static_cast<uint32_t>(p[2 * r]) << 16;
      const uint32_t o = static_cast<uint32_t>(p[2 * r + 1]) << 16;
      std::memcpy(&even[0].v[r], &e, 4);
      std::memcpy(&odd[0].v[r], &o, 4);
    }
  }
};

}  // namespace kt::kernels::ref
