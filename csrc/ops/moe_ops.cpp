// CPU implementation of kt::moe_forward: validates every argument once (style
// rule 3), with errors that name the argument, then hands off to csrc/moe.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "formats/bf16.h"
#include "formats/format_registry.h"
#include "formats/fp8.h"
#include "formats/qint.h"
#include "formats/scale_dtype.h"
#include "kernels/dispatch.h"
#include "moe/moe_forward.h"
#include "moe/moe_lora.h"
#include "ops/moe_op_args.h"
#include "runtime/thread_pool.h"

namespace kt::ops {

namespace {

bool is_activation_dtype(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat;
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "kt.moe_forward: ", name, " is on ", t.device(),
              "; this kt_ops build runs experts on the CPU only: move it to the CPU");
}

// A bf16 packed projection: [E, ceil(n/16), ceil(k/2), 16, 2] bf16, contiguous.
void check_bf16_packed(const at::Tensor& w, const char* name, int64_t E, int64_t n, int64_t k,
                       const char* n_name, const char* k_name) {
  check_cpu(w, name);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "kt.moe_forward: ", name,
              " must be bf16 for weight_format='bf16' (got ", w.scalar_type(),
              "); pack it with kt_ops.pack_weights(w, 'bf16')");
  const std::vector<int64_t> expected = {E, formats::bf16_row_blocks(n), formats::bf16_k_pairs(k),
                                         formats::kBf16BlockRows, formats::kBf16KPack};
  TORCH_CHECK(w.sizes() == at::IntArrayRef(expected), "kt.moe_forward: ", name, " has shape ",
              w.sizes(), " but the bf16 packed layout of [E=", E, ", ", n_name, "=", n, ", ",
              k_name, "=", k, "] is ", at::IntArrayRef(expected),
              "; pack dense [E, N, K] weights with kt_ops.pack_weights(w, 'bf16')");
  TORCH_CHECK(w.is_contiguous(), "kt.moe_forward: ", name,
              " must be contiguous (as returned by kt_ops.pack_weights)");
}

void check_absent(const OptTensor& t, const char* name, const std::string& fmt) {
  TORCH_CHECK(!t.has_value(), "kt.moe_forward: ", name, " was given, but weight_format='", fmt,
              "' takes no ", name);
}

formats::ScaleType scale_type_of(const at::Tensor& t) {
  return formats::scale_type_of(t.scalar_type());
}

// Checks that `t` is a contiguous CPU tensor of `shape`; names it otherwise.
void check_shape(const at::Tensor& t, const std::string& name, const std::string& fmt,
                 const std::vector<int64_t>& shape, const char* what) {
  check_cpu(t, name.c_str());
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "kt.moe_forward: ", name, " has shape ",
              t.sizes(), " but weight_format='", fmt, "' expects ", at::IntArrayRef(shape), " (",
              what, "); pack dense weights with kt_ops.quantize_weights");
  TORCH_CHECK(t.is_contiguous(), "kt.moe_forward: ", name,
              " must be contiguous (as returned by kt_ops.quantize_weights)");
}

// One projection of a quantized format: [E, n, k] packed as the format's
// layout (docs/formats.md). Sets the scale / zero storage types in `q` from
// the first projection and requires the others to match.
moe::QuantProjection check_quant_projection(const formats::FormatInfo& info, const std::string& fmt,
                                            const std::string& proj, const at::Tensor& w,
                                            const OptTensor& scales, const OptTensor& zeros,
                                            int64_t E, int64_t n, int64_t k, const char* dims,
                                            int64_t group_size, bool first,
                                            formats::QintFormat& q) {
  const std::string wname = proj + "_weight", sname = proj + "_scales", zname = proj + "_zeros";
  TORCH_CHECK(w.scalar_type() == at::kByte, "kt.moe_forward: ", wname,
              " must be uint8 for weight_format='", fmt, "' (got ", w.scalar_type(),
              "); a weight packed for another format was probably passed");
  TORCH_CHECK(scales.has_value(), "kt.moe_forward: weight_format='", fmt, "' needs ", sname);
  const int64_t kp = formats::qint_k_padded(k);
  const int64_t nb = formats::qint_row_blocks(n);
  moe::QuantProjection p;
  if (info.kind == formats::FormatKind::kFp8) {
    TORCH_CHECK(!zeros.has_value(), "kt.moe_forward: ", zname,
                " was given, but weight_format='fp8' has no zero points");
    check_shape(w, wname, fmt, {E, nb, kp, 16}, dims);
    TORCH_CHECK(scales->scalar_type() == at::kFloat, "kt.moe_forward: ", sname,
                " must be fp32 block scales for weight_format='fp8', got ", scales->scalar_type());
    check_shape(*scales, sname, fmt,
                {E, formats::ceil_div(n, formats::kFp8ScaleBlock),
                 formats::ceil_div(k, formats::kFp8ScaleBlock)},
                "one scale per 128x128 block");
    p.weight = w.data_ptr<uint8_t>();
    p.scales = scales->data_ptr();
    return p;
  }
  if (group_size != 0) {
    TORCH_CHECK(kp % group_size == 0, "kt.moe_forward: group_size=", group_size,
                " must divide the K of ", wname, " (", dims,
                ") padded to a multiple of 32, which is ", kp);
  } else if (info.qint.bits != 8) {
    TORCH_CHECK(false, "kt.moe_forward: weight_format='", fmt, "' needs a group_size");
  }
  const int64_t G = formats::qint_groups(group_size, kp);
  check_shape(w, wname, fmt, {E, nb, formats::qint_block_bytes(info.qint.bits, kp)}, dims);
  if (info.scale_is_e8m0) {
    TORCH_CHECK(scales->scalar_type() == at::kByte, "kt.moe_forward: ", sname,
                " must be uint8 UE8M0 exponents for weight_format='", fmt, "', got ",
                scales->scalar_type());
  } else {
    TORCH_CHECK(scale_type_of(*scales) != formats::ScaleType::kNone, "kt.moe_forward: ", sname,
                " must be fp32, fp16 or bf16, got ", scales->scalar_type());
  }
  check_shape(*scales, sname, fmt, {E, nb, G, 16}, "[E, ceil(N/16), groups, 16]");
  const formats::ScaleType st =
      info.scale_is_e8m0 ? formats::ScaleType::kE8M0 : scale_type_of(*scales);
  if (first) q.scale_type = st;
  TORCH_CHECK(q.scale_type == st, "kt.moe_forward: ", sname, " is ", scales->scalar_type(),
              " but gate_scales has another dtype; use one scale dtype for all projections");
  formats::ScaleType zt = formats::ScaleType::kNone;
  if (zeros.has_value()) {
    TORCH_CHECK(info.zeros != formats::ZeroPolicy::kNever, "kt.moe_forward: ", zname,
                " was given, but weight_format='", fmt, "' has no zero points");
    zt = scale_type_of(*zeros);
    TORCH_CHECK(zt != formats::ScaleType::kNone, "kt.moe_forward: ", zname,
                " must be fp32, fp16 or bf16, got ", zeros->scalar_type());
    check_shape(*zeros, zname, fmt, {E, nb, G, 16}, "[E, ceil(N/16), groups, 16]");
  } else {
    TORCH_CHECK(info.zeros != formats::ZeroPolicy::kRequired, "kt.moe_forward: weight_format='",
                fmt, "' needs ", zname);
  }
  if (first) q.zero_type = zt;
  TORCH_CHECK(q.zero_type == zt, "kt.moe_forward: ", zname,
              " must be given for all three projections or none, in one dtype");
  p.weight = w.data_ptr<uint8_t>();
  p.scales = scales->data_ptr();
  p.zeros = zeros.has_value() ? zeros->data_ptr() : nullptr;
  return p;
}

constexpr const char* kProjNames[3] = {"gate", "up", "down"};

}  // namespace

std::vector<std::string> split_weight_format(const std::string& fmt) {
  std::vector<std::string> names;
  size_t start = 0;
  while (true) {
    const size_t comma = fmt.find(',', start);
    names.push_back(
        fmt.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  if (names.size() == 1) return {fmt, fmt, fmt};
  TORCH_CHECK(names.size() == 3, "kt.moe_forward: weight_format='", fmt,
              "' must be one format name or three comma-separated names 'gate,up,down' (e.g. "
              "'q4_k,q4_k,q6_k'), got ",
              names.size(), " names");
  return names;
}

int64_t projection_group_size(const std::vector<std::string>& names, int proj, int64_t group_size) {
  const bool mixed = names[0] != names[1] || names[0] != names[2];
  const formats::FormatInfo& info = formats::lookup_format(names[proj]);
  return mixed && info.group_sizes.size() == 1 ? info.group_sizes[0] : group_size;
}

moe::QuantExperts check_moe_forward_args(
    const at::Tensor& hidden_states, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& gate_weight, const at::Tensor& up_weight, const at::Tensor& down_weight,
    int64_t intermediate_size, c10::string_view weight_format, const OptTensor& gate_scales,
    const OptTensor& up_scales, const OptTensor& down_scales, const OptTensor& gate_zeros,
    const OptTensor& up_zeros, const OptTensor& down_zeros, int64_t group_size,
    const OptTensor& gate_lora_a, const OptTensor& gate_lora_b, const OptTensor& up_lora_a,
    const OptTensor& up_lora_b, const OptTensor& down_lora_a, const OptTensor& down_lora_b,
    double lora_scaling, c10::string_view activation) {
  const std::string fmt(weight_format.data(), weight_format.size());
  // --- activations and routing -------------------------------------------
  check_cpu(hidden_states, "hidden_states");
  check_cpu(topk_ids, "topk_ids");
  check_cpu(topk_weights, "topk_weights");
  TORCH_CHECK(hidden_states.dim() == 2,
              "kt.moe_forward: hidden_states must be 2-D [T, H], got shape ",
              hidden_states.sizes());
  TORCH_CHECK(is_activation_dtype(hidden_states.scalar_type()),
              "kt.moe_forward: hidden_states must be bf16, fp16 or fp32, got ",
              hidden_states.scalar_type());
  const int64_t T = hidden_states.size(0);
  const int64_t H = hidden_states.size(1);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T,
              "kt.moe_forward: topk_ids must be [T, K] with T=", T,
              " (the rows of hidden_states), got shape ", topk_ids.sizes());
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
              "kt.moe_forward: topk_ids must be int32 or int64, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(),
              "kt.moe_forward: topk_weights must have the shape of topk_ids ", topk_ids.sizes(),
              ", got ", topk_weights.sizes());
  TORCH_CHECK(is_activation_dtype(topk_weights.scalar_type()),
              "kt.moe_forward: topk_weights must be fp32, bf16 or fp16, got ",
              topk_weights.scalar_type());
  TORCH_CHECK(intermediate_size > 0, "kt.moe_forward: intermediate_size must be positive, got ",
              intermediate_size);
  TORCH_CHECK(activation == "silu", "kt.moe_forward: activation='", std::string(activation),
              "' is not supported; expected 'silu' (SwiGLU experts)");

  // --- weights --------------------------------------------------------------
  // One format name for all three projections, or "gate,up,down" (GGUF files
  // mix them: Q4_K_M keeps some layers' ffn_down in q6_k).
  const std::vector<std::string> names = split_weight_format(fmt);
  const formats::FormatInfo* infos[3] = {nullptr, nullptr, nullptr};
  for (int i = 0; i < 3; ++i) {
    try {
      infos[i] = &formats::lookup_format(names[i]);
    } catch (const std::invalid_argument& err) {
      TORCH_CHECK(false, "kt.moe_forward: ", err.what());
    }
  }
  const bool mixed = names[0] != names[1] || names[0] != names[2];
  TORCH_CHECK(gate_weight.dim() >= 1,
              "kt.moe_forward: gate_weight must be a packed [E, ...] tensor");
  const int64_t E = gate_weight.size(0);
  const int64_t I = intermediate_size;
  int64_t groups[3];
  for (int i = 0; i < 3; ++i) {
    const formats::FormatInfo& info = *infos[i];
    groups[i] = projection_group_size(names, i, group_size);
    const bool ok_group = std::find(info.group_sizes.begin(), info.group_sizes.end(), groups[i]) !=
                          info.group_sizes.end();
    if (!ok_group) {
      std::string allowed;
      for (int64_t g : info.group_sizes)
        allowed += (allowed.empty() ? "" : ", ") + std::to_string(g);
      TORCH_CHECK(false, "kt.moe_forward: group_size=", group_size, " is not valid for ",
                  mixed ? std::string(kProjNames[i]) + " weight_format='" : "weight_format='",
                  names[i], "'; expected one of: ", allowed);
    }
  }
  const bool any_bf16 = infos[0]->kind == formats::FormatKind::kBf16 ||
                        infos[1]->kind == formats::FormatKind::kBf16 ||
                        infos[2]->kind == formats::FormatKind::kBf16;
  TORCH_CHECK(!mixed || !any_bf16, "kt.moe_forward: weight_format='", fmt,
              "' mixes bf16 with quantized formats; bf16 experts take one format for all three "
              "projections");
  const bool any_fp8 = infos[0]->kind == formats::FormatKind::kFp8 ||
                       infos[1]->kind == formats::FormatKind::kFp8 ||
                       infos[2]->kind == formats::FormatKind::kFp8;
  TORCH_CHECK(!mixed || !any_fp8, "kt.moe_forward: weight_format='", fmt,
              "' mixes fp8 with other formats; per-projection formats are for the integer "
              "(qint) formats: int8, int4, mxfp4 and the GGUF types");
  moe::QuantExperts quant;
  if (any_bf16) {
    TORCH_CHECK(gate_weight.dim() == 5,
                "kt.moe_forward: gate_weight must be the 5-D bf16 packed layout "
                "[E, ceil(I/16), ceil(H/2), 16, 2], got shape ",
                gate_weight.sizes(),
                "; pack dense [E, I, H] weights with kt_ops.pack_weights(w, 'bf16')");
    check_bf16_packed(gate_weight, "gate_weight", E, I, H, "I", "H");
    check_bf16_packed(up_weight, "up_weight", E, I, H, "I", "H");
    check_bf16_packed(down_weight, "down_weight", E, H, I, "H", "I");
    check_absent(gate_scales, "gate_scales", fmt);
    check_absent(up_scales, "up_scales", fmt);
    check_absent(down_scales, "down_scales", fmt);
    check_absent(gate_zeros, "gate_zeros", fmt);
    check_absent(up_zeros, "up_zeros", fmt);
    check_absent(down_zeros, "down_zeros", fmt);
  } else {
    const at::Tensor* weights[3] = {&gate_weight, &up_weight, &down_weight};
    const OptTensor* scales[3] = {&gate_scales, &up_scales, &down_scales};
    const OptTensor* zeros[3] = {&gate_zeros, &up_zeros, &down_zeros};
    moe::QuantProjection* projs[3] = {&quant.gate, &quant.up, &quant.down};
    // With one format, the three projections must also agree on scale and
    // zero dtypes (one format, one storage); mixed formats each have their own.
    formats::QintFormat shared;
    for (int i = 0; i < 3; ++i) {
      const formats::FormatInfo& info = *infos[i];
      const bool down = i == 2;
      formats::QintFormat q = info.qint;
      q.group_size = info.kind == formats::FormatKind::kFp8 ? 0 : groups[i];
      formats::QintFormat& types = mixed ? q : shared;
      *projs[i] = check_quant_projection(
          info, names[i], kProjNames[i], *weights[i], *scales[i], *zeros[i], E, down ? H : I,
          down ? I : H, down ? "[E, H, I]" : "[E, I, H]", q.group_size, mixed || i == 0, types);
      q.scale_type = types.scale_type;
      q.zero_type = types.zero_type;
      projs[i]->format = q;
      projs[i]->kind =
          info.kind == formats::FormatKind::kFp8 ? moe::QuantKind::kFp8 : moe::QuantKind::kQint;
    }
    quant.kind = quant.gate.kind;
  }
  check_lora_args("kt.moe_forward", E, H, I, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b,
                  down_lora_a, down_lora_b, lora_scaling);

  // --- expert ids in [-1, E) ---------------------------------------------------
  if (topk_ids.numel() > 0) {
    // A plain loop: two ATen reductions with .item() cost more than a decode
    // step's whole routing.
    const at::Tensor ids = topk_ids.contiguous();
    int64_t lo = 0, hi = 0;
    AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "kt_check_expert_ids", [&] {
      const index_t* p = ids.data_ptr<index_t>();
      lo = hi = p[0];
      for (int64_t i = 1; i < ids.numel(); ++i) {
        lo = std::min<int64_t>(lo, p[i]);
        hi = std::max<int64_t>(hi, p[i]);
      }
    });
    TORCH_CHECK(lo >= -1 && hi < E, "kt.moe_forward: topk_ids must lie in [-1, ", E,
                ") (E = number of experts in gate_weight; -1 skips a slot), got values in [", lo,
                ", ", hi, "]");
  }
  return quant;
}

at::Tensor moe_forward_cpu(
    const at::Tensor& hidden_states, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& gate_weight, const at::Tensor& up_weight, const at::Tensor& down_weight,
    int64_t intermediate_size, c10::string_view weight_format, const OptTensor& gate_scales,
    const OptTensor& up_scales, const OptTensor& down_scales, const OptTensor& gate_zeros,
    const OptTensor& up_zeros, const OptTensor& down_zeros, int64_t group_size,
    const OptTensor& gate_lora_a, const OptTensor& gate_lora_b, const OptTensor& up_lora_a,
    const OptTensor& up_lora_b, const OptTensor& down_lora_a, const OptTensor& down_lora_b,
    double lora_scaling, c10::string_view activation) {
  runtime::ThreadPool::global().prewake();
  const moe::QuantExperts quant = check_moe_forward_args(
      hidden_states, topk_ids, topk_weights, gate_weight, up_weight, down_weight, intermediate_size,
      weight_format, gate_scales, up_scales, down_scales, gate_zeros, up_zeros, down_zeros,
      group_size, gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b,
      lora_scaling, activation);
  const int64_t I = intermediate_size;
  const at::Tensor x = hidden_states.contiguous();
  if (has_lora(gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b)) {
    // LoRA: the ATen expert path (csrc/moe/moe_lora.cpp); the kernels below have no LoRA
    // terms. Any format: the base is dequantized to fp32 per expert (QLoRA style) and
    // multiplies fp32 activations, without the q8 rounding of the quantized kernels.
    const moe::ExpertWeights w = expert_weights(gate_weight, up_weight, down_weight, x.size(1), I,
                                                weight_format, gate_scales, up_scales, down_scales,
                                                gate_zeros, up_zeros, down_zeros, group_size);
    const moe::LoraParams lora = lora_params(gate_lora_a, gate_lora_b, up_lora_a, up_lora_b,
                                             down_lora_a, down_lora_b, lora_scaling);
    return moe::moe_forward_lora(x, topk_ids, topk_weights, w, lora, /*save_pre=*/false).out;
  }
  if (quant.kind != moe::QuantKind::kNone) {
    return moe::moe_forward_quant(x, topk_ids, topk_weights, quant, gate_weight.size(0), I,
                                  kernels::quant_kernels(kernels::active_isa()));
  }
  const auto& kernels = kernels::bf16_kernels(kernels::active_isa());
  return moe::moe_forward_bf16(x, topk_ids, topk_weights, gate_weight, up_weight, down_weight, I,
                               kernels);
}

// CUDA tensors reach this kernel on CUDA builds of torch (the dispatcher picks
// the CUDA key when any argument lives there). Until the CUDA-stream bridge
// exists, name the argument and the device instead of the dispatcher's
// generic "could not run with arguments from the 'CUDA' backend".
at::Tensor moe_forward_cuda_unsupported(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                                        const at::Tensor& topk_weights,
                                        const at::Tensor& gate_weight, const at::Tensor& up_weight,
                                        const at::Tensor& down_weight, int64_t, c10::string_view,
                                        const OptTensor&, const OptTensor&, const OptTensor&,
                                        const OptTensor&, const OptTensor&, const OptTensor&,
                                        int64_t, const OptTensor&, const OptTensor&,
                                        const OptTensor&, const OptTensor&, const OptTensor&,
                                        const OptTensor&, double, c10::string_view) {
  check_cpu(hidden_states, "hidden_states");
  check_cpu(topk_ids, "topk_ids");
  check_cpu(topk_weights, "topk_weights");
  check_cpu(gate_weight, "gate_weight");
  check_cpu(up_weight, "up_weight");
  check_cpu(down_weight, "down_weight");
  TORCH_CHECK(false,
              "kt.moe_forward: an optional tensor argument is on a CUDA device; this "
              "kt_ops build runs experts on the CPU only");
}

TORCH_LIBRARY_IMPL(kt, CPU, m) { m.impl("moe_forward", &moe_forward_cpu); }
TORCH_LIBRARY_IMPL(kt, CUDA, m) { m.impl("moe_forward", &moe_forward_cuda_unsupported); }

}  // namespace kt::ops
