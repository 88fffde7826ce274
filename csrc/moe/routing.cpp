#include "moe/routing.h"

#include <ATen/ATen.h>

namespace kt::moe {

void build_routing_plan(const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                        int64_t num_experts, RoutingPlan& plan) {
  const int64_t T = topk_ids.size(0);
  const int64_t K = topk_ids.size(1);
  plan.num_tokens = T;
  plan.top_k = K;
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();  // no copy when already int64
  const at::Tensor w = topk_weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = w.data_ptr<float>();

  // Counting sort by expert: stable, so tokens ascend within each expert.
  plan.expert_offsets.assign(num_experts + 1, 0);
  plan.slot_valid.assign(T * K, 0);
  for (int64_t s = 0; s < T * K; ++s) {
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
  for (int64_t s = 0; s < T * K; ++s) {
    if (id[s] < 0) continue;
    const int64_t r = cursor[id[s]]++;
    plan.row_token[r] = s / K;
    plan.row_slot[r] = s;
    plan.row_weight[r] = wt[s];
  }
}

}  // namespace kt::moe
