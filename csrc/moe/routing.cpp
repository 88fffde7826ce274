#include "moe/routing.h"

#include <ATen/ATen.h>

#include <algorithm>

namespace kt::moe {

void build_routing_plan(const char* op, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                        int64_t num_experts, const bool* skip, RoutingPlan& plan) {
  const int64_t T = topk_ids.size(0);
  const int64_t K = topk_ids.size(1);
  const int64_t S = T * K;
  plan.num_tokens = T;
  plan.top_k = K;
  // Every id is read from the caller's tensor exactly once, into plan.ids, and
  // range-checked there: another thread writing topk_ids during the call can
  // change the result but never make an index out of range.
  plan.ids.resize(S);
  int64_t lo = 0, hi = 0;
  {
    const at::Tensor ids = topk_ids.contiguous();
    AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "kt_routing_ids", [&] {
      const index_t* src = ids.data_ptr<index_t>();
      for (int64_t s = 0; s < S; ++s) {
        const int64_t v = static_cast<int64_t>(src[s]);
        lo = std::min(lo, v);
        hi = std::max(hi, v);
        plan.ids[s] = v;
      }
    });
  }
  TORCH_CHECK(lo >= -1 && hi < num_experts, op, ": topk_ids must lie in [-1, ", num_experts,
              ") (E = number of experts in gate_weight; -1 skips a slot), got values in [", lo,
              ", ", hi, "]");
  if (skip != nullptr) {  // an expert on the GPU: its slots are skipped like id -1
    for (int64_t s = 0; s < S; ++s)
      if (plan.ids[s] >= 0 && skip[plan.ids[s]]) plan.ids[s] = -1;
  }
  const int64_t* id = plan.ids.data();
  const at::Tensor w = topk_weights.to(at::kFloat).contiguous();
  const float* wt = w.data_ptr<float>();

  // Counting sort by expert: stable, so tokens ascend within each expert.
  plan.expert_offsets.assign(num_experts + 1, 0);
  plan.slot_valid.assign(S, 0);
  for (int64_t s = 0; s < S; ++s) {
    if (id[s] >= 0) {
      plan.expert_offsets[id[s] + 1] += 1;
      plan.slot_valid[s] = 1;
    }
  }
  plan.active_experts.clear();
  for (int64_t e = 0; e < num_experts; ++e) {
    if (plan.expert_offsets[e + 1] > 0) plan.active_experts.push_back(e);
    plan.expert_offsets[e + 1] += plan.expert_offsets[e];
  }
  const int64_t rows = plan.expert_offsets[num_experts];
  plan.row_token.resize(rows);
  plan.row_slot.resize(rows);
  plan.row_weight.resize(rows);
  std::vector<int64_t>& cursor = plan.cursor;
  cursor.assign(plan.expert_offsets.begin(), plan.expert_offsets.end() - 1);
  for (int64_t s = 0; s < S; ++s) {
    if (id[s] < 0) continue;
    const int64_t r = cursor[id[s]]++;
    plan.row_token[r] = s / K;
    plan.row_slot[r] = s;
    plan.row_weight[r] = wt[s];
  }
}

}  // namespace kt::moe
