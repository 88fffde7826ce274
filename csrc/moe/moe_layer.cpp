#include "moe/moe_layer.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "formats/bf16.h"
#include "formats/fp8.h"
#include "formats/qint.h"
#include "formats/scale_dtype.h"
#include "moe/backward_panels.h"
#include "moe/expert_weights.h"

namespace kt::moe {

namespace {

constexpr const char* kProjNames[3] = {"gate", "up", "down"};
constexpr const char* kPackHint =
    "; pack dense [E, N, K] weights with kt_ops.formats.quantize_weights (or kt_ops.pack_weights "
    "for bf16)";

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

thread_local bool t_shape_only = false;  // ShapeOnlyScope

// t's data, or nullptr under ShapeOnlyScope (a meta tensor has none).
const void* data_of(const at::Tensor& t) { return t_shape_only ? nullptr : t.data_ptr(); }

void check_cpu(const char* op, const at::Tensor& t, const std::string& name) {
  if (t_shape_only) return;
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " is on ", t.device(),
              "; the kt_ops experts run on the CPU: move it to the CPU");
}

// A contiguous CPU tensor of `shape` and (when given) dtype.
void check_tensor(const char* op, const at::Tensor& t, const std::string& name,
                  const std::string& fmt, at::IntArrayRef shape, const char* what) {
  check_cpu(op, t, name);
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " has shape ", t.sizes(), " but weight_format='",
              fmt, "' expects ", shape, " (", what, ")", kPackHint);
  TORCH_CHECK(t.is_contiguous(), op, ": ", name,
              " must be contiguous (as the kt_ops packers return it)");
}

std::vector<std::string> split_formats(const char* op, const std::string& fmt) {
  std::vector<std::string> names;
  size_t start = 0;
  while (true) {
    const size_t comma = fmt.find(',', start);
    names.push_back(fmt.substr(start, comma == std::string::npos ? comma : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (names.size() == 1) return {fmt, fmt, fmt};
  TORCH_CHECK(names.size() == 3, op, ": weight_format='", fmt,
              "' must be one format name or three comma-separated names 'gate,up,down' (e.g. "
              "'q4_k,q4_k,q6_k'), got ",
              names.size(), " names");
  return names;
}

// One projection of E experts, dense [n, k], in format `f`.
Projection parse_projection(const char* op, int i, const formats::FormatRow& f, int64_t group,
                            const std::optional<at::Tensor>& weight,
                            const std::optional<at::Tensor>& scales,
                            const std::optional<at::Tensor>& zeros, int64_t E, int64_t n,
                            int64_t k) {
  const std::string proj = kProjNames[i];
  const std::string wname = kWeightNames[3 * i], sname = kWeightNames[3 * i + 1],
                    zname = kWeightNames[3 * i + 2];
  const char* dims = i == 2 ? "[E, H, I]" : "[E, I, H]";
  const std::string fmt = f.name;
  TORCH_CHECK(f.group_size_allowed(group), op, ": group size ", group, " of ", proj,
              " is not valid for weight_format='", fmt, "'; expected one of ",
              at::IntArrayRef(f.group_sizes));
  TORCH_CHECK(weight.has_value(), op, ": ", wname, " is missing (None)");
  const at::Tensor& w = *weight;
  check_cpu(op, w, wname);
  Projection p;
  p.format = &f;
  p.n = n;
  p.k = k;
  p.group_size = group;
  p.weight = w;
  kernels::ProjectionView& v = p.view;
  v.layout = f.layout;
  v.grid = f.grid;
  v.qint = f.qint;
  v.qint.group_size = group;
  v.n = n;
  v.k = k;
  v.kp = formats::qint_k_padded(k);
  v.row_blocks = formats::qint_row_blocks(n);
  v.groups = 1;
  v.scales = nullptr;
  v.zeros = nullptr;

  const auto absent = [&](const std::optional<at::Tensor>& t, const std::string& name) {
    TORCH_CHECK(!t.has_value(), op, ": ", name, " was given, but weight_format='", fmt,
                "' takes no ", name.substr(name.find('_') + 1));
  };
  switch (f.layout) {
    case formats::Layout::kBf16: {
      TORCH_CHECK(w.scalar_type() == at::kBFloat16, op, ": ", wname,
                  " must be bf16 for weight_format='bf16' (got ", w.scalar_type(), ")", kPackHint);
      check_tensor(op, w, wname, fmt,
                   {E, formats::bf16_row_blocks(n), formats::bf16_k_pairs(k),
                    formats::kBf16BlockRows, formats::kBf16KPack},
                   dims);
      absent(scales, sname);
      absent(zeros, zname);
      v.block_bytes = formats::bf16_block_elems(k) * 2;
      break;
    }
    case formats::Layout::kFp8: {
      TORCH_CHECK(w.scalar_type() == at::kByte, op, ": ", wname,
                  " must be uint8 for weight_format='", fmt, "' (got ", w.scalar_type(), ")",
                  kPackHint);
      absent(zeros, zname);
      TORCH_CHECK(scales.has_value(), op, ": weight_format='", fmt, "' needs ", sname);
      check_tensor(op, w, wname, fmt, {E, v.row_blocks, v.kp, 16}, dims);
      if (f.fp8_row_scales) {  // fp8_channel, mxfp8: one scale per row and group
        const bool e8m0 = f.packed_scale_type == formats::ScaleType::kE8M0;
        TORCH_CHECK(scales->scalar_type() == (e8m0 ? at::kByte : at::kFloat), op, ": ", sname,
                    " must be ", e8m0 ? "uint8 UE8M0 exponents" : "fp32", " for weight_format='",
                    fmt, "', got ", scales->scalar_type());
        v.groups = formats::qint_groups(v.qint.group_size, v.kp);
        check_tensor(op, *scales, sname, fmt, {E, v.row_blocks, v.groups, 16},
                     "[E, ceil(N/16), groups, 16]");
        v.fp8_row_scales = true;
        v.qint.scale_type = f.packed_scale_type;
        p.scales = *scales;
        v.block_bytes = formats::fp8_block_bytes(v.kp);
        v.scales = data_of(*scales);
        break;
      }
      TORCH_CHECK(scales->scalar_type() == at::kFloat, op, ": ", sname,
                  " must be fp32 block scales for weight_format='fp8', got ",
                  scales->scalar_type());
      check_tensor(op, *scales, sname, fmt,
                   {E, formats::ceil_div(n, formats::kFp8ScaleBlock),
                    formats::ceil_div(k, formats::kFp8ScaleBlock)},
                   "one scale per 128x128 block");
      p.scales = *scales;
      v.block_bytes = formats::fp8_block_bytes(v.kp);
      v.scales = data_of(*scales);
      break;
    }
    case formats::Layout::kQint: {
      TORCH_CHECK(w.scalar_type() == at::kByte, op, ": ", wname,
                  " must be uint8 for weight_format='", fmt, "' (got ", w.scalar_type(),
                  "); a weight packed for another format was ", "probably passed");
      TORCH_CHECK(group == 0 || v.kp % group == 0, op, ": group size ", group, " of ", proj,
                  " must divide the K of ", wname, " (", dims,
                  ") padded to a multiple of 32, which is ", v.kp);
      TORCH_CHECK(scales.has_value(), op, ": weight_format='", fmt, "' needs ", sname);
      v.groups = formats::qint_groups(group, v.kp);
      v.block_bytes = formats::qint_block_bytes(f.qint.bits, v.kp);
      check_tensor(op, w, wname, fmt, {E, v.row_blocks, v.block_bytes}, dims);
      const bool e8m0 = f.packed_scale_type == formats::ScaleType::kE8M0;
      v.qint.scale_type = formats::scale_type_of(scales->scalar_type(), e8m0);
      if (formats::is_kquant(f.packed_scale_type)) {
        // GGUF k-quant: one scale record per 16 rows x 256 k (docs/formats.md).
        TORCH_CHECK(v.kp % formats::kKSuperK == 0, op, ": weight_format='", fmt,
                    "' needs the K of ", wname, " (", dims,
                    ") to be a multiple of 256 (the GGUF super-block), got ", k);
        TORCH_CHECK(scales->scalar_type() == at::kByte, op, ": ", sname,
                    " must be uint8 k-quant scale records for weight_format='", fmt, "', got ",
                    scales->scalar_type(),
                    " (fp32 scales with a zeros tensor are the old k-quant layout of "
                    "manifest_version 1 converted directories; repack from the GGUF file with "
                    "kt_ops.formats.from_gguf or kt-ops convert)");
        check_tensor(op, *scales, sname, fmt,
                     {E, v.row_blocks, v.kp / formats::kKSuperK,
                      formats::kquant_record_bytes(f.packed_scale_type)},
                     "[E, ceil(N/16), K/256, record bytes]: GGUF super-block scales");
        v.qint.scale_type = f.packed_scale_type;
      } else if (e8m0) {
        TORCH_CHECK(scales->scalar_type() == at::kByte, op, ": ", sname,
                    " must be uint8 UE8M0 exponents for weight_format='", fmt, "', got ",
                    scales->scalar_type());
      } else {
        TORCH_CHECK(is_float_dtype(scales->scalar_type()), op, ": ", sname,
                    " must be fp32, fp16 or bf16, got ", scales->scalar_type());
      }
      if (!formats::is_kquant(f.packed_scale_type))
        check_tensor(op, *scales, sname, fmt, {E, v.row_blocks, v.groups, 16},
                     "[E, ceil(N/16), groups, 16]");
      p.scales = *scales;
      v.scales = data_of(*scales);
      v.qint.zero_type = formats::ScaleType::kNone;
      if (zeros.has_value()) {
        TORCH_CHECK(f.zeros != formats::ZeroPolicy::kNever, op, ": ", zname,
                    " was given, but weight_format='", fmt, "' has no zero points");
        TORCH_CHECK(is_float_dtype(zeros->scalar_type()), op, ": ", zname,
                    " must be fp32, fp16 or bf16, got ", zeros->scalar_type());
        check_tensor(op, *zeros, zname, fmt, {E, v.row_blocks, v.groups, 16},
                     "[E, ceil(N/16), groups, 16]");
        p.zeros = *zeros;
        v.zeros = data_of(*zeros);
        v.qint.zero_type = formats::scale_type_of(zeros->scalar_type());
      } else {
        TORCH_CHECK(f.zeros != formats::ZeroPolicy::kRequired, op, ": weight_format='", fmt,
                    "' needs ", zname);
      }
      break;
    }
    case formats::Layout::kGrid: {
      // GGUF i-quant bytes per 16-row block (formats/grid.h), decoded to the int8 panel
      // f.qint describes when the kernels run.
      TORCH_CHECK(w.scalar_type() == at::kByte, op, ": ", wname,
                  " must be uint8 for weight_format='", fmt, "' (got ", w.scalar_type(),
                  "); a weight packed for another format was probably passed");
      TORCH_CHECK(k % formats::kGridSuperK == 0, op, ": weight_format='", fmt, "' needs the K of ",
                  wname, " (", dims, ") to be a multiple of 256 (the GGUF super-block), got ", k);
      absent(scales, sname);
      absent(zeros, zname);
      v.groups = v.kp / formats::grid_group_k(f.grid);
      v.block_bytes = formats::grid_block_bytes(f.grid, v.kp);
      check_tensor(op, w, wname, fmt, {E, v.row_blocks, v.block_bytes}, dims);
      break;
    }
  }
  v.weight = static_cast<const uint8_t*>(data_of(w));
  return p;
}

// One projection's bias: fp32 [E, n], contiguous, or None.
at::Tensor parse_bias(const char* op, const std::optional<at::Tensor>& bias, const char* name,
                      int64_t E, int64_t n) {
  if (!bias.has_value()) return {};
  const at::Tensor& b = *bias;
  check_cpu(op, b, name);
  TORCH_CHECK(b.scalar_type() == at::kFloat, op, ": ", name,
              " must be fp32 (one bias per expert and output row), got ", b.scalar_type());
  TORCH_CHECK(b.dim() == 2 && b.size(0) == E && b.size(1) == n, op, ": ", name, " must be [E=", E,
              ", ", n, "], got shape ", b.sizes());
  TORCH_CHECK(b.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous())");
  return b;
}

// One projection's backward panels: bf16 [E, k/w, w n] for a width w of 16 or 64 that
// divides k (moe/backward_panels.h), contiguous, of a projection whose format has them
// (backward_panels_format), or None.
at::Tensor parse_backward_panels(const char* op, const std::optional<at::Tensor>& panels,
                                 const char* name, const Projection& p) {
  if (!panels.has_value()) return {};
  const at::Tensor& t = *panels;
  check_cpu(op, t, name);
  TORCH_CHECK(backward_panels_format(p), op, ": ", name, " was given, but that projection is ",
              p.format->name, " [", p.n, ", ", p.k,
              "]; backward panels exist for bf16, int8 (per channel, no zeros) and the fp8 "
              "formats with n and k multiples of 16 (kt_ops.ExpertWeights.with_backward_panels "
              "makes them)");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, op, ": ", name, " must be bf16, got ",
              t.scalar_type());
  bool shaped = false;
  for (const int64_t w : {kPanelWidthKt, kPanelWidthOnednn}) {
    shaped = shaped || (t.dim() == 3 && t.size(0) == p.num_experts() && p.k % w == 0 &&
                        t.size(1) == p.k / w && t.size(2) == w * p.n);
  }
  TORCH_CHECK(shaped, op, ": ", name, " must be [E=", p.num_experts(), ", k/w, w n] for a width w",
              " of 16 or 64 that divides k=", p.k, " (16: [", p.num_experts(), ", ", p.k / 16, ", ",
              16 * p.n, "]; kt_ops.ExpertWeights.with_backward_panels), got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous())");
  return t;
}

// One projection's LoRA A [E, r, k] and B [E, n, r]; a [0]-shaped pair = none.
LoraProjection parse_lora(const char* op, int i, const at::Tensor& a, const at::Tensor& b,
                          int64_t E, int64_t n, int64_t k) {
  const std::string proj = kProjNames[i];
  const std::string a_name = proj + "_lora_a", b_name = proj + "_lora_b";
  const char* n_name = i == 2 ? "H" : "I";
  const char* k_name = i == 2 ? "I" : "H";
  const bool has_a = a.dim() != 1 || a.numel() != 0;
  const bool has_b = b.dim() != 1 || b.numel() != 0;
  TORCH_CHECK(has_a == has_b, op, ": ", has_a ? a_name : b_name, " was given without ",
              has_a ? b_name : a_name,
              "; LoRA on a projection needs both A and B (or neither: [0]-shaped tensors)");
  if (!has_a) return {};
  const auto check_factor = [&](const std::string& name, const at::Tensor& t,
                                const std::string& layout) {
    check_cpu(op, t, name);
    TORCH_CHECK(is_float_dtype(t.scalar_type()), op, ": ", name,
                " must be fp32, bf16 or fp16, got ", t.scalar_type());
    TORCH_CHECK(t.dim() == 3, op, ": ", name, " must be 3-D ", layout,
                " (one LoRA factor per expert), got shape ", t.sizes());
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous (call .contiguous())");
  };
  check_factor(a_name, a, std::string("[E, r, ") + k_name + "]");
  check_factor(b_name, b, std::string("[E, ") + n_name + ", r]");
  const int64_t r = a.size(1);
  TORCH_CHECK(a.size(0) == E && a.size(2) == k && r > 0, op, ": ", a_name, " must be [E=", E,
              ", r, ", k_name, "=", k, "] with LoRA rank r >= 1, got ", a.sizes());
  TORCH_CHECK(b.size(0) == E && b.size(1) == n && b.size(2) == r, op, ": ", b_name,
              " must be [E=", E, ", ", n_name, "=", n, ", r=", r, "] (r = rank of ", a_name,
              "), got ", b.sizes());
  return {a, b};
}

}  // namespace

bool shape_only() { return t_shape_only; }

ShapeOnlyScope::ShapeOnlyScope() : previous_(t_shape_only) { t_shape_only = true; }
ShapeOnlyScope::~ShapeOnlyScope() { t_shape_only = previous_; }

const char* const kWeightNames[kNumWeightArgsPanels] = {"gate_weight",
                                                        "gate_scales",
                                                        "gate_zeros",
                                                        "up_weight",
                                                        "up_scales",
                                                        "up_zeros",
                                                        "down_weight",
                                                        "down_scales",
                                                        "down_zeros",
                                                        "gate_bias",
                                                        "up_bias",
                                                        "down_bias",
                                                        "gate_backward_panels",
                                                        "up_backward_panels",
                                                        "down_backward_panels"};
const char* const kLoraFactorNames[6] = {"gate_lora_a", "gate_lora_b", "up_lora_a",
                                         "up_lora_b",   "down_lora_a", "down_lora_b"};

void check_out(const char* op, const at::Tensor& out, const at::Tensor& hidden_states) {
  TORCH_CHECK(out.scalar_type() == hidden_states.scalar_type(), op,
              ": out must have the dtype of hidden_states (", hidden_states.scalar_type(),
              "), got ", out.scalar_type());
  TORCH_CHECK(out.sizes() == hidden_states.sizes() && out.is_contiguous(), op,
              ": out must be a contiguous tensor of the shape of hidden_states ",
              hidden_states.sizes(), ", got ", out.sizes(),
              out.is_contiguous() ? "" : " (not contiguous)");
  const at::MemOverlapStatus overlap = at::get_overlap_status(out, hidden_states);
  TORCH_CHECK(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial, op,
              ": out must not overlap hidden_states in memory (the kernels read hidden_states "
              "while writing out)");
}

void check_routed_args(const char* op, const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                       const at::Tensor& topk_weights) {
  check_cpu(op, hidden_states, "hidden_states");
  check_cpu(op, topk_ids, "topk_ids");
  check_cpu(op, topk_weights, "topk_weights");
  TORCH_CHECK(hidden_states.dim() == 2, op, ": hidden_states must be 2-D [T, H], got shape ",
              hidden_states.sizes());
  TORCH_CHECK(is_float_dtype(hidden_states.scalar_type()), op,
              ": hidden_states must be bf16, fp16 or fp32, got ", hidden_states.scalar_type());
  const int64_t T = hidden_states.size(0);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T, op,
              ": topk_ids must be [T, K] with T=", T, " (the rows of hidden_states), got shape ",
              topk_ids.sizes());
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong, op,
              ": topk_ids must be int32 or int64, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), op,
              ": topk_weights must have the shape of topk_ids ", topk_ids.sizes(), ", got ",
              topk_weights.sizes());
  TORCH_CHECK(is_float_dtype(topk_weights.scalar_type()), op,
              ": topk_weights must be fp32, bf16 or fp16, got ", topk_weights.scalar_type());
}

void check_hidden_size(const char* op, const at::Tensor& hidden_states, const MoeLayer& layer) {
  TORCH_CHECK(hidden_states.size(1) == layer.hidden_size, op, ": hidden_states has ",
              hidden_states.size(1), " columns but the experts' hidden_size is ",
              layer.hidden_size);
}

MoeLayer parse_moe_layer(const char* op, const at::Tensor& hidden_states,
                         const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                         KT_LAYER_PARAMS) {
  check_routed_args(op, hidden_states, topk_ids, topk_weights);
  return parse_layer(op, &hidden_states, KT_LAYER_ARGS);
}

MoeLayer parse_layer(const char* op, const at::Tensor* hidden_states, KT_LAYER_PARAMS) {
  kernels::Glu glu;
  std::string glu_error;
  if (!kernels::parse_glu(std::string_view(activation.data(), activation.size()), &glu,
                          &glu_error)) {
    std::string names;
    for (const char* n : kernels::kActivationNames)
      names += (names.empty() ? "'" : ", '") + std::string(n) + "'";
    TORCH_CHECK(false, op, ": activation='", std::string(activation),
                "' is not supported; expected one of ", names,
                ", optionally with parameters as in 'silu(alpha=1.702,limit=7,up_offset=1)' "
                "(the GLU of the experts: h = act(gate(x)) * up(x)); here: ",
                glu_error);
  }

  // --- the layer -------------------------------------------------------------
  TORCH_CHECK(sizes.size() == 2 && sizes[0] > 0 && sizes[1] > 0, op,
              ": sizes must be [hidden_size, intermediate_size], both positive, got ", sizes);
  MoeLayer layer;
  layer.op = op;
  layer.glu = glu;
  const int64_t H = layer.hidden_size = sizes[0];
  const int64_t I = layer.intermediate_size = sizes[1];
  if (hidden_states != nullptr) check_hidden_size(op, *hidden_states, layer);
  TORCH_CHECK(group_sizes.size() == 3, op,
              ": group_sizes must hold 3 values (gate, up, down), got ", group_sizes);
  TORCH_CHECK(weights.size() == kNumWeightArgs || weights.size() == kNumWeightArgsBias ||
                  weights.size() == kNumWeightArgsPanels,
              op,
              ": weights must hold 9 entries (weight, scales, zeros of gate, up, down; None "
              "where a format has none), 12 with the gate, up and down biases, or 15 with "
              "the biases and the backward panels (None where absent), got ",
              weights.size());
  const std::string fmt(weight_format.data(), weight_format.size());
  const std::vector<std::string> names = split_formats(op, fmt);
  const std::optional<at::Tensor> gate_weight = weights.get(0);
  TORCH_CHECK(gate_weight.has_value(), op, ": gate_weight is missing (None)");
  TORCH_CHECK(gate_weight->dim() >= 1, op, ": gate_weight must be a packed [E, ...] tensor");
  const int64_t E = layer.num_experts = gate_weight->size(0);
  Projection* projs[3] = {&layer.gate, &layer.up, &layer.down};
  for (int i = 0; i < 3; ++i) {
    const formats::FormatRow* f = formats::find_format(names[i]);
    TORCH_CHECK(f != nullptr, op, ": weight_format='", names[i],
                "' is not a kt_ops format; expected one of ", formats::known_format_names());
    const bool down = i == 2;
    *projs[i] =
        parse_projection(op, i, *f, group_sizes[i], weights.get(3 * i), weights.get(3 * i + 1),
                         weights.get(3 * i + 2), E, down ? H : I, down ? I : H);
    if (weights.size() >= kNumWeightArgsBias)
      projs[i]->bias = parse_bias(op, weights.get(kNumWeightArgs + i),
                                  kWeightNames[kNumWeightArgs + i], E, down ? H : I);
    if (weights.size() == kNumWeightArgsPanels)
      projs[i]->backward_panels = parse_backward_panels(
          op, weights.get(kNumWeightArgsBias + i), kWeightNames[kNumWeightArgsBias + i], *projs[i]);
  }

  // --- LoRA ------------------------------------------------------------------
  TORCH_CHECK(lora.empty() || lora.size() == 6, op,
              ": lora must be empty or hold 6 tensors (gate A, B, up A, B, down A, B; [0]-shaped "
              "where a projection has none), got ",
              lora.size());
  if (!lora.empty()) {
    LoraProjection* lp[3] = {&layer.lora.gate, &layer.lora.up, &layer.lora.down};
    for (int i = 0; i < 3; ++i) {
      const bool down = i == 2;
      *lp[i] = parse_lora(op, i, lora[2 * i], lora[2 * i + 1], E, down ? H : I, down ? I : H);
    }
    // One dtype for all factors: PEFT keeps a layer's adapters in one dtype,
    // and a mix is almost always an accidental cast.
    int first = -1;
    for (int i = 0; i < 6; ++i) {
      const at::Tensor& t = lora[i];
      if (t.dim() == 1 && t.numel() == 0) continue;
      if (first < 0) first = i;
      TORCH_CHECK(t.scalar_type() == lora[first].scalar_type(), op,
                  ": all LoRA tensors must have one dtype, but ", kLoraFactorNames[first], " is ",
                  lora[first].scalar_type(), " and ", kLoraFactorNames[i], " is ", t.scalar_type());
    }
    TORCH_CHECK(std::isfinite(lora_scaling), op, ": lora_scaling must be finite, got ",
                lora_scaling);
  }
  layer.lora.scaling = lora_scaling;

  // --- experts served elsewhere -------------------------------------------------
  if (gpu_experts_mask.has_value()) {
    const at::Tensor& m = *gpu_experts_mask;
    check_cpu(op, m, "gpu_experts_mask");
    TORCH_CHECK(m.scalar_type() == at::kBool, op,
                ": gpu_experts_mask must be a bool tensor (True = the expert runs on the GPU), "
                "got ",
                m.scalar_type());
    TORCH_CHECK(m.dim() == 1 && m.size(0) == E, op, ": gpu_experts_mask must be [E=", E,
                "] (one flag per expert), got shape ", m.sizes());
    layer.skip_experts = m.contiguous();
  }
  return layer;
}

}  // namespace kt::moe
