// One description of an MoE layer: the op's layer arguments parsed and
// validated once, by one function that every kt:: op calls.
// Forward, train and backward, the kernels' views and the dense decoders all
// read this struct; nothing downstream looks at the raw argument list again.
#pragma once

#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>

#include "formats/format_table.h"
#include "kernels/activations.h"
#include "kernels/kernel_api.h"

// The layer arguments of every kt:: op, in schema order (the schema text is
// kLayerSchema in csrc/ops/registration.cpp). Written once here for the C++
// kernels' signatures (KT_LAYER_PARAMS) and their calls (KT_LAYER_ARGS):
//   weights       9 packed tensors: gate, up, down x (weight, scales, zeros),
//                 None where a format has no such tensor; optionally followed
//                 by 3 per-expert biases (gate [E, I], up [E, I], down [E, H],
//                 fp32, None where a projection has none; gpt-oss), and then
//                 optionally by 3 backward panels (gate, up, down: the transposed
//                 weights of Projection::backward_panels, None where a projection
//                 has none; the biases None where absent)
//   weight_format one format name, or "gate,up,down" names
//   sizes         [hidden_size, intermediate_size] of the dense weights
//   group_sizes   [gate, up, down] group sizes along K (0: per channel)
//   lora          [] or 6 tensors (gate A, B, up A, B, down A, B); a [0]-shaped
//                 tensor stands for an absent factor
//   lora_scaling
//   activation    the GLU: a name of KT_ACTIVATIONS, or with parameters
//                 "silu(alpha=1.702,limit=7,up_offset=1)" (kernels/activations.h)
//   gpu_experts_mask  None, or bool [E]: True marks an expert that lives on the
//                 GPU; the op skips its slots as it skips id -1
#define KT_LAYER_PARAMS                                                               \
  const c10::List<std::optional<at::Tensor>>&weights, c10::string_view weight_format, \
      at::IntArrayRef sizes, at::IntArrayRef group_sizes, const at::TensorList &lora, \
      double lora_scaling, c10::string_view activation,                               \
      const std::optional<at::Tensor>&gpu_experts_mask
#define KT_LAYER_ARGS \
  weights, weight_format, sizes, group_sizes, lora, lora_scaling, activation, gpu_experts_mask
// Their types alone, for the typed operator handles that call the ops (moe_autograd.cpp).
#define KT_LAYER_TYPES                                                                             \
  const c10::List<std::optional<at::Tensor>>&, c10::string_view, at::IntArrayRef, at::IntArrayRef, \
      const at::TensorList&, double, c10::string_view, const std::optional<at::Tensor>&

namespace kt::moe {

// One projection (gate, up or down) of every expert.
struct Projection {
  const formats::FormatRow* format = nullptr;
  at::Tensor weight;  // packed, layout of format->layout
  at::Tensor scales;  // undefined for bf16
  at::Tensor zeros;   // explicit zero points, or undefined
  int64_t n = 0;      // dense [n, k] per expert (nn.Linear convention)
  int64_t k = 0;
  int64_t group_size = 0;
  kernels::ProjectionView view;  // what the kernels read
  at::Tensor bias;               // fp32 [E, n], contiguous, added to the product; or undefined
  // The LoRA backward's transposed weights made once (kt_ops.ExpertWeights.
  // with_backward_panels): bf16 [E, k/w, w n] for a width w of 16 or 64, panel s =
  // columns [w s, w s + w) of W as [n/2][w][2] (pairs of rows of W), what
  // bf16_vnni_panel makes per call otherwise (moe/backward_panels.h); or undefined.
  at::Tensor backward_panels;

  // Expert e's bias row [n], or nullptr.
  const float* bias_row(int64_t e) const {
    return bias.defined() ? bias.data_ptr<float>() + e * n : nullptr;
  }

  int64_t num_experts() const { return weight.size(0); }
};

// LoRA factors of one projection; both undefined when it has none.
struct LoraProjection {
  at::Tensor a;  // [E, r, k]
  at::Tensor b;  // [E, n, r]
  bool present() const { return a.defined(); }
};

struct LoraParams {
  LoraProjection gate, up, down;
  double scaling = 1.0;
  bool any() const { return gate.present() || up.present() || down.present(); }
  // One A for gate and up (PEFT's LoRA of a fused gate_up_proj: the caller passes the
  // same tensor twice): x A^T is then computed once for both.
  bool shares_gate_up_a() const {
    return gate.present() && up.present() && gate.a.data_ptr() == up.a.data_ptr() &&
           gate.a.dtype() == up.a.dtype() && gate.a.sizes() == up.a.sizes() &&
           gate.a.strides() == up.a.strides();
  }
};

struct MoeLayer {
  const char* op = "";  // the op that parsed it, for later error messages
  int64_t num_experts = 0;
  int64_t hidden_size = 0;        // H
  int64_t intermediate_size = 0;  // I
  Projection gate, up, down;      // [E, I, H], [E, I, H], [E, H, I]
  LoraParams lora;
  // h = act(gate(x)) * up(x), with the GLU's clamps and offsets (kernels/activations.h;
  // the ops' `activation` argument).
  kernels::Glu glu;
  // bool [E], contiguous CPU: experts the op skips (served on the GPU); undefined: none.
  at::Tensor skip_experts;

  const bool* skip_mask() const {
    return skip_experts.defined() ? skip_experts.data_ptr<bool>() : nullptr;
  }
};

// The names of the entries of the `weights` argument (gate_weight,
// gate_scales, gate_zeros, up_..., down_..., then gate_bias, up_bias,
// down_bias, then gate_backward_panels, up_..., down_...) and of the 6 entries of the `lora`
// argument, for error messages.
constexpr int kNumWeightArgs = 9;         // the packed tensors
constexpr int kNumWeightArgsBias = 12;    // with the biases
constexpr int kNumWeightArgsPanels = 15;  // with the biases and the backward panels
extern const char* const kWeightNames[kNumWeightArgsPanels];
extern const char* const kLoraFactorNames[6];

// kt.moe_forward.out's `out`, on any device: the dtype and shape of
// hidden_states, contiguous, not overlapping it (the kernels read
// hidden_states while writing out). The caller checks the device.
void check_out(const char* op, const at::Tensor& out, const at::Tensor& hidden_states);

// Checks every argument of a kt:: op that takes a layer (errors name the
// argument and say what was expected; `op` prefixes them, e.g.
// "kt.moe_forward") and returns the parsed layer. The values of topk_ids are
// not read here: they are checked where they are used (the routing plan),
// so a CUDA-stream or graph-captured call never reads them on the host early.
MoeLayer parse_moe_layer(const char* op, const at::Tensor& hidden_states,
                         const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                         KT_LAYER_PARAMS);

// The two halves of parse_moe_layer, for a layer parsed once and called many
// times (ops/prepared_layer.cpp): the checks of the routed arguments alone,
// and the layer's (with hidden_states' width checked against H where given).
void check_routed_args(const char* op, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights);
MoeLayer parse_layer(const char* op, const at::Tensor* hidden_states, KT_LAYER_PARAMS);
// hidden_states [T, H] against the layer's H.
void check_hidden_size(const char* op, const at::Tensor& hidden_states, const MoeLayer& layer);

// While one lives on a thread, parse_moe_layer checks shapes, dtypes and layouts
// only: no device check and no data pointer read, so it runs on meta tensors.
// The fake kernels (kt_ops/ops.py, through kt_ops._C.check_layer_shapes) make
// the op's own checks this way instead of repeating them; they check devices
// themselves (a CUDA-bridge call has its packed weights on the CPU).
// Whether a ShapeOnlyScope lives on this thread (the op's other argument checks skip
// their device checks then, as parse_moe_layer does).
bool shape_only();

class ShapeOnlyScope {
 public:
  ShapeOnlyScope();
  ~ShapeOnlyScope();
  ShapeOnlyScope(const ShapeOnlyScope&) = delete;
  ShapeOnlyScope& operator=(const ShapeOnlyScope&) = delete;

 private:
  bool previous_;
};

}  // namespace kt::moe
