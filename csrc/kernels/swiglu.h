// The SwiGLU activation of the expert MLP, written once over a vector-traits
// type V (kernels/<isa>/vec.h): h = silu(g) * u, silu(g) = g / (1 + exp(-g))
// (Shazeer 2020, "GLU Variants Improve Transformer").
#pragma once

#ifndef KT_ALWAYS_INLINE
#define KT_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

namespace kt::kernels {

// silu(g) * u over 16 values, in place in g.
template <class V>
KT_ALWAYS_INLINE void silu_mul_16(float* g, const float* u) {
  using Reg = typename V::Reg;
  const Reg one = V::set1(1.0f);
  for (int v = 0; v < 16; v += V::kLanes) {
    const Reg gv = V::load(g + v);
    const Reg sig = V::div(one, V::add(one, V::exp(V::neg(gv))));
    V::store(g + v, V::mul(V::mul(gv, sig), V::load(u + v)));
  }
}

// silu(g) * u over m rows of 16 values ([m][16], contiguous), in place in g.
template <class V>
void silu_mul_rows(float* g, const float* u, int m) {
  for (int i = 0; i < m; ++i) silu_mul_16<V>(g + 16 * i, u + 16 * i);
}

}  // namespace kt::kernels
