#include "moe/moe_forward.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#include "formats/bf16.h"
#include "moe/moe_phases.h"
#include "moe/routing.h"

namespace kt::moe {

namespace {

using formats::bf16_block_elems;
using formats::bf16_k_pairs;
using formats::bf16_row_blocks;
using formats::kBf16BlockRows;

// Per-calling-thread buffers, grown on demand and reused across calls: a
// decode step allocates nothing, and prefill does not fault in fresh pages.
struct Scratch {
  RoutingPlan plan;
  std::vector<float> x;  // [T][Hp] fp32 activations, zero padded to an even H
  std::vector<float> h;  // [rows][Ip] SwiGLU outputs, zero padded to an even I
  std::vector<float> y;  // [T*K][H] weighted expert outputs per slot
  std::vector<const float*> x_rows;
  std::vector<float*> h_rows;
  std::vector<float*> y_rows;
};

thread_local Scratch t_scratch;

}  // namespace

at::Tensor moe_forward_bf16(const at::Tensor& hidden_states, const at::Tensor& topk_ids,
                            const at::Tensor& topk_weights, const at::Tensor& gate_weight,
                            const at::Tensor& up_weight, const at::Tensor& down_weight,
                            int64_t intermediate_size, const kernels::Bf16Kernels& kernels) {
  const int64_t T = hidden_states.size(0);
  const int64_t H = hidden_states.size(1);
  const int64_t K = topk_ids.size(1);
  const int64_t E = gate_weight.size(0);
  const int64_t I = intermediate_size;
  at::Tensor out = at::empty({T, H}, hidden_states.options());
  if (T == 0 || H == 0) return out;

  const int64_t Hp = 2 * bf16_k_pairs(H);
  const int64_t Ip = 2 * bf16_k_pairs(I);
  const int64_t blocks_I = bf16_row_blocks(I);
  const int64_t blocks_H = bf16_row_blocks(H);
  const int64_t gate_up_block = bf16_block_elems(H);  // elements per block of Wg / Wu
  const int64_t down_block = bf16_block_elems(I);     // elements per block of Wd

  Scratch& s = t_scratch;
  build_routing_plan(topk_ids, topk_weights, E, s.plan);
  const RoutingPlan& plan = s.plan;
  const int64_t R = plan.num_rows();

  // Phase 1: activations to fp32.
  grow(s.x, T * Hp);
  float* x = s.x.data();
  convert_activations(hidden_states, Hp, x);

  grow(s.h, R * Ip);
  grow(s.y, T * K * H);
  grow(s.x_rows, R);
  grow(s.h_rows, R);
  grow(s.y_rows, R);
  for (int64_t r = 0; r < R; ++r) {
    s.x_rows[r] = x + plan.row_token[r] * Hp;
    s.h_rows[r] = s.h.data() + r * Ip;
    s.y_rows[r] = s.y.data() + plan.row_slot[r] * H;
    if (Ip != I) s.h_rows[r][I] = 0.0f;  // the pad column of the last k pair
  }

  const auto* wg = reinterpret_cast<const uint16_t*>(gate_weight.data_ptr());
  const auto* wu = reinterpret_cast<const uint16_t*>(up_weight.data_ptr());
  const auto* wd = reinterpret_cast<const uint16_t*>(down_weight.data_ptr());

  // Phase 2: gate/up + SwiGLU, one item per (active expert, 16-row block of I).
  for_each_expert_block(plan, blocks_I, [&](int64_t e, int64_t nb, int64_t r0, int m) {
    const int64_t block = e * blocks_I + nb;
    kernels::GateUpArgs args{
        s.x_rows.data() + r0,
        m,
        wg + block * gate_up_block,
        wu + block * gate_up_block,
        static_cast<int>(bf16_k_pairs(H)),
        s.h_rows.data() + r0,
        nb * kBf16BlockRows,
        static_cast<int>(std::min<int64_t>(kBf16BlockRows, I - nb * kBf16BlockRows))};
    kernels.gate_up_silu(args);
  });

  // Phase 3: down projection scaled by the routing weight, per (expert, 16-row block of H).
  for_each_expert_block(plan, blocks_H, [&](int64_t e, int64_t nb, int64_t r0, int m) {
    const int64_t block = e * blocks_H + nb;
    kernels::DownArgs args{
        s.h_rows.data() + r0,
        m,
        wd + block * down_block,
        static_cast<int>(bf16_k_pairs(I)),
        s.y_rows.data() + r0,
        nb * kBf16BlockRows,
        plan.row_weight.data() + r0,
        static_cast<int>(std::min<int64_t>(kBf16BlockRows, H - nb * kBf16BlockRows))};
    kernels.down_scaled(args);
  });

  // Phase 4: sum the top-k slots of each token in k order, cast to the activation dtype.
  combine_slots(s.y.data(), plan, out);
  return out;
}

}  // namespace kt::moe
