// The GLU activations of the expert MLP, one entry each:
//
//   h = act(g) * u,   g = gate(x), u = up(x),   expert(x) = down(h)
//
// (Shazeer 2020, "GLU Variants Improve Transformer"). Each entry has a name
// (the ops' `activation` argument, kt_ops.ACTIVATIONS), scalar forms of act(g)
// and of the GLU's backward (the LoRA training path, moe/moe_lora.cpp) and a
// vector form over a
// vector-traits type V (kernels/<isa>/vec.h: the inference epilogue, one
// instantiation per tier through glu_rows_for). Adding an activation: an X()
// line in KT_ACTIVATIONS and its three formulas below; Python reads the names
// from kt_ops._C.activations(), and the model integration (kt_ops/hf.py)
// maps Hugging Face's names onto them.
//
//   silu       silu(g) = g / (1 + exp(-g))                           SwiGLU
//   gelu       gelu(g) = g * Phi(g), Phi(g) = erfc(-g / sqrt 2) / 2  GeGLU (erf)
//   gelu_tanh  g / (1 + exp(-2 z)), z = sqrt(2/pi) (g + 0.044715 g^3)
//              = 0.5 g (1 + tanh z): PyTorch's gelu(approximate='tanh'),
//              Hugging Face's gelu_pytorch_tanh / gelu_new / gelu_fast
//
// erfc: Numerical Recipes' erfcc (Press et al., 3rd ed., 6.2.2), fractional
// error below 1.2e-7 for every argument, so Phi keeps its relative accuracy
// in the far negative tail, where gelu(g) is a tiny number.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>

#ifndef KT_ALWAYS_INLINE
#define KT_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

namespace kt::kernels {

// X(enum name, op name)
#define KT_ACTIVATIONS(X) \
  X(kSilu, "silu")        \
  X(kGelu, "gelu")        \
  X(kGeluTanh, "gelu_tanh")

enum class Activation : uint8_t {
#define KT_ACT_ENUM(e, name) e,
  KT_ACTIVATIONS(KT_ACT_ENUM)
#undef KT_ACT_ENUM
};

inline constexpr const char* kActivationNames[] = {
#define KT_ACT_NAME(e, name) name,
    KT_ACTIVATIONS(KT_ACT_NAME)
#undef KT_ACT_NAME
};
inline constexpr int kNumActivations =
    static_cast<int>(sizeof(kActivationNames) / sizeof(kActivationNames[0]));

inline const char* activation_name(Activation a) { return kActivationNames[static_cast<int>(a)]; }

// The activation named `name`, or nullopt.
inline std::optional<Activation> parse_activation(std::string_view name) {
  for (int i = 0; i < kNumActivations; ++i)
    if (name == kActivationNames[i]) return static_cast<Activation>(i);
  return std::nullopt;
}

// ---------------------------------------------------------------- scalar forms

namespace act_detail {
constexpr float kSqrtHalf = 0.70710678118654752f;    // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;  // 1 / sqrt(2 pi)
constexpr float kGeluTanhC = 0.79788456080286536f;   // sqrt(2 / pi)
constexpr float kGeluTanhA = 0.044715f;

// erfc(a) for a >= 0 (Numerical Recipes erfcc), as t * exp(poly(t) - a^2).
inline float erfc_nonneg(float a) {
  const float t = 1.0f / (1.0f + 0.5f * a);
  const float p =
      -1.26551223f +
      t * (1.00002368f +
           t * (0.37409196f +
                t * (0.09678418f +
                     t * (-0.18628806f +
                          t * (0.27886807f +
                               t * (-1.13520398f +
                                    t * (1.48851587f + t * (-0.82215223f + t * 0.17087277f))))))));
  return t * std::exp(p - a * a);
}

// Phi(g), the standard normal CDF.
inline float normal_cdf(float g) {
  const float q = 0.5f * erfc_nonneg(std::fabs(g) * kSqrtHalf);  // Phi(-|g|)
  return g < 0.0f ? q : 1.0f - q;
}
}  // namespace act_detail

// act(g), rounded as the vector form computes it.
inline float activation_value(Activation a, float g) {
  switch (a) {
    case Activation::kSilu:
      return g * (1.0f / (1.0f + std::exp(-g)));
    case Activation::kGelu:
      return g * act_detail::normal_cdf(g);
    case Activation::kGeluTanh: {
      const float z = act_detail::kGeluTanhC * (g + act_detail::kGeluTanhA * g * g * g);
      return g / (1.0f + std::exp(-2.0f * z));
    }
  }
  return 0.0f;
}

// The backward of h = act(g) * u for dL/dh = dh: dg = dh * u * act'(g), du = dh * act(g)
// (the LoRA training path, moe/moe_lora.cpp).
inline void glu_backward(Activation a, float g, float u, float dh, float* dg, float* du) {
  switch (a) {
    case Activation::kSilu: {
      const float s = 1.0f / (1.0f + std::exp(-g));  // silu' = s (1 + g (1 - s))
      *dg = dh * u * s * (1.0f + g * (1.0f - s));
      *du = dh * g * s;
      return;
    }
    case Activation::kGelu: {
      const float cdf = act_detail::normal_cdf(g);  // gelu' = Phi(g) + g phi(g)
      *dg = dh * u * (cdf + g * act_detail::kInvSqrt2Pi * std::exp(-0.5f * g * g));
      *du = dh * (g * cdf);
      return;
    }
    case Activation::kGeluTanh: {
      const float g2 = g * g;
      const float z = act_detail::kGeluTanhC * (g + act_detail::kGeluTanhA * g2 * g);
      const float th = std::tanh(z);
      const float dz = act_detail::kGeluTanhC * (1.0f + 3.0f * act_detail::kGeluTanhA * g2);
      *dg = dh * u * (0.5f * (1.0f + th) + 0.5f * g * (1.0f - th * th) * dz);
      *du = dh * (0.5f * g * (1.0f + th));
      return;
    }
  }
}

// ---------------------------------------------------------------- vector forms

// act(g) * u over 16 values, in place in g, for one activation.
template <class V, Activation A>
KT_ALWAYS_INLINE void glu_16(float* g, const float* u) {
  using Reg = typename V::Reg;
  const Reg one = V::set1(1.0f);
  for (int v = 0; v < 16; v += V::kLanes) {
    const Reg gv = V::load(g + v);
    Reg act;
    if constexpr (A == Activation::kSilu) {
      const Reg sig = V::div(one, V::add(one, V::exp(V::neg(gv))));
      act = V::mul(gv, sig);
    } else if constexpr (A == Activation::kGelu) {
      // Phi(g) = p (1 - q) + (1 - p) q with q = Phi(-|g|) and p = [g >= 0]: an exact
      // select (p is 0 or 1), no cancellation in the tail.
      const Reg a = V::mul(V::abs(gv), V::set1(act_detail::kSqrtHalf));
      const Reg t = V::div(one, V::fma(V::set1(0.5f), a, one));
      Reg p = V::set1(0.17087277f);
      for (float c : {-0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f, -0.18628806f,
                      0.09678418f, 0.37409196f, 1.00002368f, -1.26551223f})
        p = V::fma(p, t, V::set1(c));
      const Reg q = V::mul(V::set1(0.5f), V::mul(t, V::exp(V::fma(V::neg(a), a, p))));
      const Reg pos = V::max(V::sign1(gv), V::zero());  // 1 for g >= +0, else 0
      const Reg cdf = V::fma(pos, V::add(one, V::mul(V::set1(-2.0f), q)), q);
      act = V::mul(gv, cdf);
    } else {
      static_assert(A == Activation::kGeluTanh);
      const Reg g3 = V::mul(V::mul(gv, gv), gv);
      const Reg z =
          V::mul(V::set1(act_detail::kGeluTanhC), V::fma(V::set1(act_detail::kGeluTanhA), g3, gv));
      act = V::div(gv, V::add(one, V::exp(V::mul(V::set1(-2.0f), z))));
    }
    V::store(g + v, V::mul(act, V::load(u + v)));
  }
}

// act(g) * u over m rows of 16 values ([m][16], contiguous), in place in g.
template <class V, Activation A>
void glu_rows(float* g, const float* u, int m) {
  for (int i = 0; i < m; ++i) glu_16<V, A>(g + 16 * i, u + 16 * i);
}

// The driver's epilogue (moe/moe_forward.cpp): g = act(g) * u over m rows of 16.
using GluRows = void (*)(float* g, const float* u, int m);

// Every activation's epilogue with vector traits V: what a tier's glu_rows() returns.
template <class V>
GluRows glu_rows_for(Activation a) {
  switch (a) {
#define KT_ACT_CASE(e, name) \
  case Activation::e:        \
    return &glu_rows<V, Activation::e>;
    KT_ACTIVATIONS(KT_ACT_CASE)
#undef KT_ACT_CASE
  }
  return nullptr;
}

}  // namespace kt::kernels
