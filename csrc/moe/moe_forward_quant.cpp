// The MoE driver for the quantized formats (qint family and fp8): the same
// phases and task split as the bf16 driver (moe_forward.cpp), with kernels
// that return dot products of one 16-row block, and the SwiGLU / routing
// weight applied here.
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "formats/bf16.h"
#include "formats/fp8.h"
#include "formats/q8_activations.h"
#include "formats/qint.h"
#include "moe/moe_forward.h"
#include "moe/moe_phases.h"
#include "moe/routing.h"
#include "runtime/thread_pool.h"

namespace kt::moe {

namespace {

using formats::kQintBlockRows;

struct QuantScratch {
  RoutingPlan plan;
  std::vector<float> x;     // [T][Hp] fp32 activations
  std::vector<uint8_t> xq;  // [T] q8 records of x (qint)
  std::vector<float> h;     // [rows][Ip] SwiGLU outputs
  std::vector<uint8_t> hq;  // [rows] q8 records of h (qint)
  std::vector<float> y;     // [T*K][H] weighted expert outputs per slot
  std::vector<const float*> x_rows;
  std::vector<const uint8_t*> xq_rows;
  std::vector<float*> h_rows;
  std::vector<const uint8_t*> hq_rows;
  std::vector<float*> y_rows;
};

thread_local QuantScratch t_scratch;
// Per-task dot products [m][16]; grown once per thread.
thread_local std::vector<float> t_gate_out, t_up_out;
// The fp32 path's decoded block [Kp][16]; grown once per thread.
thread_local std::vector<float> t_block;

std::atomic<QuantActivations> g_quant_activations{QuantActivations::kAuto};

int64_t scale_bytes(formats::ScaleType t) {
  switch (t) {
    case formats::ScaleType::kF32:
      return 4;
    case formats::ScaleType::kF16:
    case formats::ScaleType::kBF16:
      return 2;
    default:
      return 1;
  }
}

// Where one 16-row block of one projection lives.
struct BlockLocator {
  const QuantProjection* proj;
  int64_t n, k, kp, row_blocks, groups;

  const uint8_t* weight(int64_t e, int64_t nb) const {
    const int64_t bytes = proj->kind == QuantKind::kFp8
                              ? formats::fp8_block_bytes(kp)
                              : formats::qint_block_bytes(proj->format.bits, kp);
    return proj->weight + (e * row_blocks + nb) * bytes;
  }
  const void* qint_params(const void* base, formats::ScaleType t, int64_t e, int64_t nb) const {
    if (base == nullptr) return nullptr;
    return static_cast<const uint8_t*>(base) +
           (e * row_blocks + nb) * groups * kQintBlockRows * scale_bytes(t);
  }
  const float* fp8_scales(int64_t e, int64_t nb) const {
    const int64_t bands = formats::ceil_div(n, formats::kFp8ScaleBlock);
    const int64_t kblocks = formats::ceil_div(k, formats::kFp8ScaleBlock);
    const int64_t band = nb * kQintBlockRows / formats::kFp8ScaleBlock;
    return static_cast<const float*>(proj->scales) + (e * bands + band) * kblocks;
  }
};

BlockLocator locator(const QuantProjection& p, int64_t n, int64_t k) {
  const int64_t kp = formats::qint_k_padded(k);
  return {&p, n, k, kp, formats::qint_row_blocks(n), formats::qint_groups(p.format.group_size, kp)};
}

// The kernel arguments of block (e, nb) of a qint projection.
kernels::QintDotArgs qint_args(const BlockLocator& loc, int64_t e, int64_t nb,
                               const uint8_t* const* xq_rows, int m, int n_valid, float* out) {
  const QuantProjection& p = *loc.proj;
  return {xq_rows,
          m,
          loc.weight(e, nb),
          loc.qint_params(p.scales, p.format.scale_type, e, nb),
          loc.qint_params(p.zeros, p.format.zero_type, e, nb),
          &p.format,
          loc.kp,
          n_valid,
          out};
}

// out[i][r] = W_block[r] . x_i for the m rows starting at row r0 of the plan;
// experts with at least `fp32_min` rows decode the block to fp32 and multiply
// x_rows (qint formats otherwise multiply the q8 records xq_rows).
void block_dot(const kernels::QuantKernels& kernels, const BlockLocator& loc, int fp32_min,
               int64_t e, int64_t nb, const float* const* x_rows, const uint8_t* const* xq_rows,
               int m, int n_valid, float* out) {
  const QuantProjection& p = *loc.proj;
  if (m >= fp32_min) {
    grow(t_block, static_cast<size_t>(loc.kp) * kQintBlockRows);
    if (p.kind == QuantKind::kFp8) {
      kernels::Fp8DotArgs args{nullptr, 0,      loc.weight(e, nb), loc.fp8_scales(e, nb), loc.kp,
                               16,      nullptr};
      kernels.fp8_decode(args, t_block.data());
    } else {
      kernels.qint_decode(qint_args(loc, e, nb, nullptr, 0, 16, nullptr), t_block.data());
    }
    kernels.dense_dot({x_rows, m, t_block.data(), loc.kp, out});
    return;
  }
  if (p.kind == QuantKind::kFp8) {
    kernels::Fp8DotArgs args{x_rows,  m,  loc.weight(e, nb), loc.fp8_scales(e, nb), loc.kp,
                             n_valid, out};
    kernels.fp8_dot(args);
  } else {
    kernels.qint_dot(qint_args(loc, e, nb, xq_rows, m, n_valid, out));
  }
}

void quantize_rows(const float* src, int64_t stride, int64_t rows, int64_t kp, uint8_t* dst) {
  const int64_t rec = formats::q8_record_bytes(kp);
  runtime::ThreadPool::global().run(formats::ceil_div(rows, 16), [&](int64_t task, int) {
    const int64_t end = std::min(rows, (task + 1) * 16);
    for (int64_t r = task * 16; r < end; ++r)
      formats::quantize_row_q8(src + r * stride, kp, dst + r * rec);
  });
}

}  // namespace

void set_quant_activations(QuantActivations mode) { g_quant_activations.store(mode); }
QuantActivations quant_activations() { return g_quant_activations.load(); }

int fp32_path_min_tokens(QuantKind kind, const formats::QintFormat& format) {
  // Break-even token counts per expert measured on AVX2 (Zen 3) at the
  // Qwen3-30B-A3B shape (docs/formats.md, "Compute paths"): decoding a block
  // to fp32 costs about as much as a few tokens' dot products, after which
  // fp32 FMAs beat fp8's in-register decode (~8 tokens) and the int8 sign
  // trick (~16). 4/5/6-bit codes multiply faster as integers at any count.
  if (kind == QuantKind::kFp8) return 8;
  if (kind == QuantKind::kQint && format.bits == 8) return 16;
  return std::numeric_limits<int>::max();
}

at::Tensor moe_forward_quant(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                             const at::Tensor& topk_weights, const QuantExperts& ex,
                             int64_t num_experts, int64_t intermediate_size,
                             const kernels::QuantKernels& kernels) {
  const int64_t T = hidden_states.size(0);
  const int64_t H = hidden_states.size(1);
  const int64_t K = topk_ids.size(1);
  const int64_t I = intermediate_size;
  at::Tensor out = at::empty({T, H}, hidden_states.options());
  if (T == 0 || H == 0) return out;
  const BlockLocator gate_loc = locator(ex.gate, I, H);
  const BlockLocator up_loc = locator(ex.up, I, H);
  const BlockLocator down_loc = locator(ex.down, H, I);
  const int64_t Hp = gate_loc.kp;
  const int64_t Ip = down_loc.kp;

  // Per projection: experts with at least this many rows take the fp32 path.
  const QuantActivations mode = quant_activations();
  auto fp32_min = [mode](const QuantProjection& p) {
    if (mode == QuantActivations::kFp32) return 1;
    if (mode == QuantActivations::kQ8) return std::numeric_limits<int>::max();
    return fp32_path_min_tokens(p.kind, p.format);
  };
  const int gate_min = fp32_min(ex.gate), up_min = fp32_min(ex.up), down_min = fp32_min(ex.down);
  // q8 records are needed unless every qint call takes the fp32 path.
  auto needs_q8 = [](const QuantProjection& p, int min) {
    return p.kind == QuantKind::kQint && min > 1;
  };
  const bool x_q8 = needs_q8(ex.gate, gate_min) || needs_q8(ex.up, up_min);
  const bool h_q8 = needs_q8(ex.down, down_min);

  QuantScratch& s = t_scratch;
  build_routing_plan(topk_ids, topk_weights, num_experts, s.plan);
  const RoutingPlan& plan = s.plan;
  const int64_t R = plan.num_rows();

  // Phase 1: activations to fp32, then to q8 records for the integer formats.
  grow(s.x, T * Hp);
  convert_activations(hidden_states, Hp, s.x.data());
  const int64_t x_rec = formats::q8_record_bytes(Hp);
  const int64_t h_rec = formats::q8_record_bytes(Ip);
  if (x_q8) {
    grow(s.xq, T * x_rec);
    quantize_rows(s.x.data(), Hp, T, Hp, s.xq.data());
  }

  grow(s.h, R * Ip);
  grow(s.y, T * K * H);
  grow(s.x_rows, R);
  grow(s.xq_rows, R);
  grow(s.h_rows, R);
  grow(s.hq_rows, R);
  grow(s.y_rows, R);
  if (h_q8) grow(s.hq, R * h_rec);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = plan.row_token[r];
    s.x_rows[r] = s.x.data() + t * Hp;
    s.xq_rows[r] = x_q8 ? s.xq.data() + t * x_rec : nullptr;
    s.h_rows[r] = s.h.data() + r * Ip;
    s.hq_rows[r] = h_q8 ? s.hq.data() + r * h_rec : nullptr;
    s.y_rows[r] = s.y.data() + plan.row_slot[r] * H;
    std::fill(s.h_rows[r] + I, s.h_rows[r] + Ip, 0.0f);  // K padding of the down projection
  }

  const int64_t blocks_I = gate_loc.row_blocks;
  const int64_t blocks_H = down_loc.row_blocks;

  // Phase 2: gate/up + SwiGLU, one item per (active expert, 16-row block of I).
  for_each_expert_block(plan, blocks_I, [&](int64_t e, int64_t nb, int64_t r0, int m) {
    const int n_valid =
        static_cast<int>(std::min<int64_t>(kQintBlockRows, I - nb * kQintBlockRows));
    grow(t_gate_out, static_cast<size_t>(m) * kQintBlockRows);
    grow(t_up_out, static_cast<size_t>(m) * kQintBlockRows);
    block_dot(kernels, gate_loc, gate_min, e, nb, s.x_rows.data() + r0, s.xq_rows.data() + r0, m,
              n_valid, t_gate_out.data());
    block_dot(kernels, up_loc, up_min, e, nb, s.x_rows.data() + r0, s.xq_rows.data() + r0, m,
              n_valid, t_up_out.data());
    kernels.silu_mul_rows(t_gate_out.data(), t_up_out.data(), m);
    for (int i = 0; i < m; ++i) {
      float* h = s.h_rows[r0 + i] + nb * kQintBlockRows;
      const float* g = t_gate_out.data() + i * kQintBlockRows;
      std::copy(g, g + n_valid, h);
    }
  });

  // Phase 2b: the SwiGLU outputs to q8 records.
  if (h_q8) quantize_rows(s.h.data(), Ip, R, Ip, s.hq.data());

  // Phase 3: down projection scaled by the routing weight, per (expert, 16-row block of H).
  for_each_expert_block(plan, blocks_H, [&](int64_t e, int64_t nb, int64_t r0, int m) {
    const int n_valid =
        static_cast<int>(std::min<int64_t>(kQintBlockRows, H - nb * kQintBlockRows));
    grow(t_gate_out, static_cast<size_t>(m) * kQintBlockRows);
    block_dot(kernels, down_loc, down_min, e, nb, s.h_rows.data() + r0, s.hq_rows.data() + r0, m,
              n_valid, t_gate_out.data());
    for (int i = 0; i < m; ++i) {
      float* y = s.y_rows[r0 + i] + nb * kQintBlockRows;
      const float w = plan.row_weight[r0 + i];
      const float* d = t_gate_out.data() + i * kQintBlockRows;
      for (int r = 0; r < n_valid; ++r) y[r] = w * d[r];
    }
  });

  // Phase 4: sum the top-k slots of each token in k order.
  combine_slots(s.y.data(), plan, out);
  return out;
}

}  // namespace kt::moe
