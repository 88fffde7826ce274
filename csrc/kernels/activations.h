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
//   relu       max(g, 0) (NaN stays NaN, as torch.relu): ReGLU; with the gate
//              a copy of up, relu(u) * u = relu(u)^2, NemotronH's non-gated
//              relu2 experts (So et al. 2021, "Primer")
//
// The GLU around act (struct Glu, the `activation` argument's parameters) adds
// what some families do to SwiGLU:
//   alpha      silu only: act(g) = g * sigmoid(alpha g) (gpt-oss: 1.702; the
//              Swish-beta of Ramachandran et al. 2017, "Searching for
//              Activation Functions")
//   limit      g <- min(g, limit) before act, u <- clamp(u, -limit, limit)
//              (gpt-oss, DeepSeek-V4, GLM-5-Next, HY-V4, MiniMax-M3)
//   act_limit  act(g) <- min(act(g), limit) after act, u clamped the same way
//              (Step-3.7's swiglu_limits)
//   up_offset  h = act(g) * (u + up_offset) (gpt-oss: 1)
//   gate_softcap, up_softcap (silu only; Inkling2's softcapped SwiGLU, without the
//              other parameters): h = cg tanh(g / cg) * sigmoid(g) * cu tanh(u / cu),
//              the sigmoid on the raw gate; either cap alone is allowed
// written "silu(alpha=1.702,limit=7,up_offset=1)"; a bare name is the plain GLU.
// The clamps follow torch.clamp: NaN stays NaN, and the gradient passes where
// the value is inside the bounds (ends included).
//
// erfc: Numerical Recipes' erfcc (Press et al., 3rd ed., 6.2.2), fractional
// error below 1.2e-7 for every argument, so Phi keeps its relative accuracy
// in the far negative tail, where gelu(g) is a tiny number.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#ifndef KT_ALWAYS_INLINE
#define KT_ALWAYS_INLINE inline __attribute__((always_inline))
#endif

namespace kt::kernels {

// X(enum name, op name)
#define KT_ACTIVATIONS(X)   \
  X(kSilu, "silu")          \
  X(kGelu, "gelu")          \
  X(kGeluTanh, "gelu_tanh") \
  X(kRelu, "relu")

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

// The GLU of the experts: h = act'(g') * (u' + up_offset), with the optional
// clamps and the silu alpha of the header comment. The default is the plain GLU.
struct Glu {
  Activation act = Activation::kSilu;
  float alpha = 1.0f;  // silu's sigmoid(alpha g)
  float limit = std::numeric_limits<float>::infinity();
  bool clamp_after = false;  // limit clamps act(g) (act_limit) instead of g (limit)
  float up_offset = 0.0f;
  float gate_softcap = std::numeric_limits<float>::infinity();  // silu only: c tanh(g / c)
  float up_softcap = std::numeric_limits<float>::infinity();    // c tanh(u / c)

  bool clamped() const { return std::isfinite(limit); }
  bool softcapped() const { return std::isfinite(gate_softcap) || std::isfinite(up_softcap); }
  // No parameter set: the plain act(g) * u, computed exactly as before they existed.
  bool plain() const { return alpha == 1.0f && !clamped() && up_offset == 0.0f && !softcapped(); }
};

// Parses "name" or "name(key=value,...)" (keys alpha, limit, act_limit,
// up_offset) into *out; on failure returns false with the reason in *error.
inline bool parse_glu(std::string_view text, Glu* out, std::string* error) {
  Glu glu;
  const size_t open = text.find('(');
  const std::string_view name = text.substr(0, open);
  const std::optional<Activation> act = parse_activation(name);
  if (!act) {
    *error = "unknown activation '" + std::string(name) + "'; expected one of ";
    for (int i = 0; i < kNumActivations; ++i)
      *error += (i ? ", '" : "'") + std::string(kActivationNames[i]) + "'";
    return false;
  }
  glu.act = *act;
  if (open != std::string_view::npos) {
    if (text.back() != ')') {
      *error = "parameters must be written name(key=value,...)";
      return false;
    }
    std::string_view rest = text.substr(open + 1, text.size() - open - 2);
    if (!rest.empty() && (rest.front() == ',' || rest.back() == ',')) {
      *error = "parameters must be written name(key=value,...) without an empty one";
      return false;
    }
    bool seen_limit = false;
    std::string seen = ",";  // the keys given so far, each followed by a comma
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      const std::string_view item = rest.substr(0, comma);
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      const size_t eq = item.find('=');
      const std::string key(item.substr(0, eq));
      const std::string value =
          eq == std::string_view::npos ? "" : std::string(item.substr(eq + 1));
      char* end = nullptr;
      const double v = value.empty() ? 0.0 : std::strtod(value.c_str(), &end);
      // The kernels take fp32: the value must stay finite (and, where it must be
      // positive, nonzero) once rounded to fp32 (1e39 would be inf, 1e-50 zero).
      if (value.empty() || end != value.c_str() + value.size() ||
          !std::isfinite(static_cast<float>(v)) || (v != 0.0 && static_cast<float>(v) == 0.0f)) {
        *error = "parameter '" + std::string(item) +
                 "' must be key=<finite number> that fp32 holds (1e39 overflows, 1e-50 underflows)";
        return false;
      }
      if (seen.find("," + key + ",") != std::string::npos) {
        *error = "parameter '" + key + "' is given twice";
        return false;
      }
      seen += key + ",";
      if (key == "alpha") {
        if (glu.act != Activation::kSilu || !(v > 0.0)) {
          *error = "alpha applies to silu only and must be positive";
          return false;
        }
        glu.alpha = static_cast<float>(v);
      } else if (key == "limit" || key == "act_limit") {
        if (seen_limit || !(v > 0.0)) {
          *error = "one of limit / act_limit, positive";
          return false;
        }
        seen_limit = true;
        glu.limit = static_cast<float>(v);
        glu.clamp_after = key == "act_limit";
      } else if (key == "up_offset") {
        glu.up_offset = static_cast<float>(v);
      } else if (key == "gate_softcap" || key == "up_softcap") {
        if (glu.act != Activation::kSilu || !(v > 0.0)) {
          *error = key + " applies to silu only and must be positive";
          return false;
        }
        (key == "gate_softcap" ? glu.gate_softcap : glu.up_softcap) = static_cast<float>(v);
      } else {
        *error = "unknown parameter '" + key +
                 "' (expected alpha, limit, act_limit, up_offset, gate_softcap, up_softcap)";
        return false;
      }
    }
  }
  if (glu.softcapped() && (glu.alpha != 1.0f || glu.clamped() || glu.up_offset != 0.0f)) {
    *error = "gate_softcap / up_softcap do not combine with alpha, limit or up_offset";
    return false;
  }
  *out = glu;
  return true;
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

// act(g), rounded as the vector form computes it; alpha: silu's sigmoid(alpha g)
// (alpha * g is g exactly at the default 1).
inline float activation_value(Activation a, float g, float alpha = 1.0f) {
  switch (a) {
    case Activation::kSilu:
      return g * (1.0f / (1.0f + std::exp(-(alpha * g))));
    case Activation::kGelu:
      return g * act_detail::normal_cdf(g);
    case Activation::kGeluTanh: {
      const float z = act_detail::kGeluTanhC * (g + act_detail::kGeluTanhA * g * g * g);
      return g / (1.0f + std::exp(-2.0f * z));
    }
    case Activation::kRelu:
      return g > 0.0f || g != g ? g : 0.0f;  // NaN passes, -0 and negatives give +0
  }
  return 0.0f;
}

// The backward of h = act(g) * u for dL/dh = dh: dg = dh * u * act'(g), du = dh * act(g)
// (the LoRA training path, moe/moe_lora.cpp).
inline void glu_backward(Activation a, float g, float u, float dh, float* dg, float* du,
                         float alpha = 1.0f) {
  switch (a) {
    case Activation::kSilu: {
      const float s = 1.0f / (1.0f + std::exp(-(alpha * g)));  // silu' = s (1 + a g (1 - s))
      *dg = dh * u * s * (1.0f + alpha * g * (1.0f - s));
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
    case Activation::kRelu: {  // relu' = [g > 0] (0 at 0, as torch)
      *dg = g > 0.0f ? dh * u : 0.0f;
      *du = dh * (g > 0.0f || g != g ? g : 0.0f);
      return;
    }
  }
}

namespace act_detail {
// torch.clamp's forms: NaN passes through.
inline float clamp_max(float x, float hi) { return hi < x ? hi : x; }
inline float clamp_pm(float x, float lim) {
  const float hi = clamp_max(x, lim);
  return -lim > hi ? -lim : hi;
}
}  // namespace act_detail

namespace act_detail {
// c tanh(x / c), and x itself for c = inf (no cap).
inline float softcap(float x, float c) { return std::isfinite(c) ? c * std::tanh(x / c) : x; }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
}  // namespace act_detail

// h of one element under the GLU p (the LoRA training path's forward).
inline float glu_value(const Glu& p, float g, float u) {
  if (p.plain()) return activation_value(p.act, g) * u;
  if (p.softcapped()) {  // silu: softcap(g) * sigmoid(g) * softcap(u)
    return act_detail::softcap(g, p.gate_softcap) * act_detail::sigmoid(g) *
           act_detail::softcap(u, p.up_softcap);
  }
  if (p.clamped()) {
    if (!p.clamp_after) g = act_detail::clamp_max(g, p.limit);
    u = act_detail::clamp_pm(u, p.limit);
  }
  float a = activation_value(p.act, g, p.alpha);
  if (p.clamped() && p.clamp_after) a = act_detail::clamp_max(a, p.limit);
  return a * (u + p.up_offset);
}

// The backward of glu_value for dL/dh = dh: dg and du; a clamp passes the
// gradient where its input is inside the bounds, ends included (torch.clamp).
inline void glu_backward(const Glu& p, float g, float u, float dh, float* dg, float* du) {
  if (p.plain()) {
    glu_backward(p.act, g, u, dh, dg, du);
    return;
  }
  if (p.softcapped()) {
    // d/dx c tanh(x / c) = 1 - tanh^2; d/dg [sc(g) s(g)] = sc'(g) s + sc(g) s (1 - s).
    const float tg = std::isfinite(p.gate_softcap) ? std::tanh(g / p.gate_softcap) : 0.0f;
    const float tu = std::isfinite(p.up_softcap) ? std::tanh(u / p.up_softcap) : 0.0f;
    const float scg = std::isfinite(p.gate_softcap) ? p.gate_softcap * tg : g;
    const float dscg = std::isfinite(p.gate_softcap) ? 1.0f - tg * tg : 1.0f;
    const float scu = std::isfinite(p.up_softcap) ? p.up_softcap * tu : u;
    const float dscu = std::isfinite(p.up_softcap) ? 1.0f - tu * tu : 1.0f;
    const float s = act_detail::sigmoid(g);
    *dg = dh * scu * (dscg * s + scg * s * (1.0f - s));
    *du = dh * scg * s * dscu;
    return;
  }
  float gate_pass = 1.0f, up_pass = 1.0f;
  if (p.clamped()) {
    if (!p.clamp_after) {
      gate_pass = g <= p.limit ? 1.0f : 0.0f;
      g = act_detail::clamp_max(g, p.limit);
    }
    up_pass = (u >= -p.limit && u <= p.limit) ? 1.0f : 0.0f;
    u = act_detail::clamp_pm(u, p.limit);
  }
  float da = 0.0f, a = 0.0f;  // act'(g) and act(g): the GLU's backward at u = dh = 1
  glu_backward(p.act, g, 1.0f, 1.0f, &da, &a, p.alpha);
  if (p.clamped() && p.clamp_after) {
    if (!(a <= p.limit)) da = 0.0f;
    a = act_detail::clamp_max(a, p.limit);
  }
  *dg = dh * (u + p.up_offset) * da * gate_pass;
  *du = dh * a * up_pass;
}

// ---------------------------------------------------------------- vector forms

// act(g) over one register; z is silu's sigmoid argument (g, or alpha g).
template <class V, Activation A>
KT_ALWAYS_INLINE typename V::Reg act_reg(typename V::Reg gv, typename V::Reg z) {
  using Reg = typename V::Reg;
  const Reg one = V::set1(1.0f);
  if constexpr (A == Activation::kSilu) {
    const Reg sig = V::div(one, V::add(one, V::exp(V::neg(z))));
    return V::mul(gv, sig);
  } else if constexpr (A == Activation::kGelu) {
    // Phi(g) = p (1 - q) + (1 - p) q with q = Phi(-|g|) and p = [g >= 0]: an exact
    // select (p is 0 or 1), no cancellation in the tail.
    const Reg a = V::mul(V::abs(gv), V::set1(act_detail::kSqrtHalf));
    const Reg t = V::div(one, V::fma(V::set1(0.5f), a, one));
    Reg p = V::set1(0.17087277f);
    for (float c : {-0.82215223f, 1.48851587f, -1.13520398f, 0.27886807f, -0.18628806f, 0.09678418f,
                    0.37409196f, 1.00002368f, -1.26551223f})
      p = V::fma(p, t, V::set1(c));
    const Reg q = V::mul(V::set1(0.5f), V::mul(t, V::exp(V::fma(V::neg(a), a, p))));
    const Reg pos = V::max(V::sign1(gv), V::zero());  // 1 for g >= +0, else 0
    const Reg cdf = V::fma(pos, V::add(one, V::mul(V::set1(-2.0f), q)), q);
    return V::mul(gv, cdf);
  } else if constexpr (A == Activation::kRelu) {
    (void)one;
    (void)z;
    return V::max(V::zero(), gv);  // x86 max returns its second operand (gv) for NaN
  } else {
    static_assert(A == Activation::kGeluTanh);
    const Reg g3 = V::mul(V::mul(gv, gv), gv);
    const Reg zt =
        V::mul(V::set1(act_detail::kGeluTanhC), V::fma(V::set1(act_detail::kGeluTanhA), g3, gv));
    return V::div(gv, V::add(one, V::exp(V::mul(V::set1(-2.0f), zt))));
  }
}

// act(g) * u over 16 values, in place in g, for one activation.
template <class V, Activation A>
KT_ALWAYS_INLINE void glu_16(float* g, const float* u) {
  for (int v = 0; v < 16; v += V::kLanes) {
    const typename V::Reg gv = V::load(g + v);
    V::store(g + v, V::mul(act_reg<V, A>(gv, gv), V::load(u + v)));
  }
}

// The same under a parametrized GLU p (Glu above). The clamps put the bound
// first: x86's min/max return their second operand when one is NaN, so NaN
// passes through as in torch.clamp (kernels/<isa>/vec.h's min and max).
// tanh(x) over one register: the odd rational minimax approximation of Eigen's
// ptanh_float (13/6 degree, x clamped to +-7.905, where tanh is 1 in fp32): a few ulp,
// and no cancellation near 0, unlike 1 - 2 / (exp(2x) + 1). The clamp puts the bound
// first so that NaN passes (x86 min/max return their second operand for NaN).
template <class V>
KT_ALWAYS_INLINE typename V::Reg tanh_reg(typename V::Reg x) {
  using Reg = typename V::Reg;
  const Reg bound = V::set1(7.90531110763549805f);
  x = V::max(V::neg(bound), V::min(bound, x));
  const Reg x2 = V::mul(x, x);
  Reg p = V::set1(-2.76076847742355e-16f);
  for (float c : {2.00018790482477e-13f, -8.60467152213735e-11f, 5.12229709037114e-08f,
                  1.48572235717979e-05f, 6.37261928875436e-04f, 4.89352455891786e-03f})
    p = V::fma(p, x2, V::set1(c));
  Reg q = V::set1(1.19825839466702e-06f);
  for (float c : {1.18534705686654e-04f, 2.26843463243900e-03f, 4.89352518554385e-03f})
    q = V::fma(q, x2, V::set1(c));
  return V::div(V::mul(p, x), q);
}

// c tanh(x / c) over one register (saturates to +-c; NaN passes).
template <class V>
KT_ALWAYS_INLINE typename V::Reg softcap_reg(typename V::Reg x, float c) {
  return V::mul(V::set1(c), tanh_reg<V>(V::mul(V::set1(1.0f / c), x)));
}

template <class V, Activation A>
KT_ALWAYS_INLINE void glu_16(float* g, const float* u, const Glu& p) {
  using Reg = typename V::Reg;
  if constexpr (A == Activation::kSilu) {
    if (p.softcapped()) {  // Inkling2: softcap(g) * sigmoid(g) * softcap(u)
      const Reg one = V::set1(1.0f);
      const bool cg = std::isfinite(p.gate_softcap), cu = std::isfinite(p.up_softcap);
      for (int v = 0; v < 16; v += V::kLanes) {
        const Reg gv = V::load(g + v), uv = V::load(u + v);
        const Reg sig = V::div(one, V::add(one, V::exp(V::neg(gv))));
        const Reg a = V::mul(cg ? softcap_reg<V>(gv, p.gate_softcap) : gv, sig);
        V::store(g + v, V::mul(a, cu ? softcap_reg<V>(uv, p.up_softcap) : uv));
      }
      return;
    }
  }
  const Reg hi = V::set1(p.limit), lo = V::set1(-p.limit);
  const Reg alpha = V::set1(p.alpha), offset = V::set1(p.up_offset);
  const bool clamped = p.clamped(), before = clamped && !p.clamp_after;
  for (int v = 0; v < 16; v += V::kLanes) {
    Reg gv = V::load(g + v), uv = V::load(u + v);
    if (before) gv = V::min(hi, gv);
    if (clamped) uv = V::max(lo, V::min(hi, uv));
    Reg a = act_reg<V, A>(gv, A == Activation::kSilu ? V::mul(alpha, gv) : gv);
    if (clamped && !before) a = V::min(hi, a);
    V::store(g + v, V::mul(a, V::add(uv, offset)));
  }
}

// act(g) * u over m rows of 16 values ([m][16], contiguous), in place in g.
template <class V, Activation A>
void glu_rows(float* g, const float* u, int m, const Glu&) {
  for (int i = 0; i < m; ++i) glu_16<V, A>(g + 16 * i, u + 16 * i);
}

// The same under a parametrized GLU.
template <class V, Activation A>
void glu_rows_params(float* g, const float* u, int m, const Glu& p) {
  for (int i = 0; i < m; ++i) glu_16<V, A>(g + 16 * i, u + 16 * i, p);
}

// The GLU's backward over `lines` lines of 16 values, in place: g <- dL/dg and u <- dL/du
// from g, u and dh = dL/dh (the LoRA backward, moe/moe_lora.cpp). The vector form of
// glu_backward() for a plain SiLU GLU (silu' = s (1 + g (1 - s)), s = sigmoid(g)), the
// tier's exp; null for any other GLU, which keeps the scalar form.
using GluBackwardRows = void (*)(float* g, float* u, const float* dh, int64_t lines);

template <class V>
void silu_glu_backward_rows(float* g, float* u, const float* dh, int64_t lines) {
  using Reg = typename V::Reg;
  const Reg one = V::set1(1.0f);
  for (int64_t i = 0; i < lines * 16; i += V::kLanes) {
    const Reg gv = V::load(g + i), uv = V::load(u + i), dv = V::load(dh + i);
    const Reg s = V::div(one, V::add(one, V::exp(V::neg(gv))));
    const Reg ds = V::fma(V::mul(gv, s), V::add(one, V::neg(s)), s);  // s (1 + g (1 - s))
    V::store(g + i, V::mul(V::mul(dv, uv), ds));
    V::store(u + i, V::mul(dv, V::mul(gv, s)));
  }
}

template <class V>
GluBackwardRows glu_backward_rows_for(const Glu& p) {
  return p.plain() && p.act == Activation::kSilu ? &silu_glu_backward_rows<V> : nullptr;
}

// The driver's epilogue (moe/moe_forward.cpp): g = h over m rows of 16.
using GluRows = void (*)(float* g, const float* u, int m, const Glu& p);

// Every GLU's epilogue with vector traits V: what a tier's glu_rows() returns
// (the plain form for a plain GLU: its results do not change with the parameters' code).
template <class V>
GluRows glu_rows_for(const Glu& p) {
  switch (p.act) {
#define KT_ACT_CASE(e, name) \
  case Activation::e:        \
    return p.plain() ? &glu_rows<V, Activation::e> : &glu_rows_params<V, Activation::e>;
    KT_ACTIVATIONS(KT_ACT_CASE)
#undef KT_ACT_CASE
  }
  return nullptr;
}

}  // namespace kt::kernels
