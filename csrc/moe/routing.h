// Token grouping: the (token, slot) pairs of a batch, grouped per expert.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace kt::moe {

struct RoutingPlan {
  int64_t num_tokens = 0;
  int64_t top_k = 0;
  // Rows [expert_offsets[e], expert_offsets[e+1]) belong to expert e; within
  // an expert, tokens ascend. One row per (token, k) with a valid id.
  std::vector<int64_t> expert_offsets;
  std::vector<int64_t> row_token;       // token of each row
  std::vector<int64_t> row_slot;        // t * top_k + k of each row
  std::vector<float> row_weight;        // routing weight of each row, fp32
  std::vector<uint8_t> slot_valid;      // [T * K]: 1 where the id is not -1 nor skipped
  std::vector<int64_t> active_experts;  // experts with at least one row, ascending
  std::vector<int64_t> ids;             // [T * K] the ids as read (once) and range-checked
  std::vector<int64_t> cursor;          // scratch of build_routing_plan, kept to reuse its memory

  int64_t num_rows() const { return static_cast<int64_t>(row_token.size()); }
};

// ids [T, K] int32/int64, weights [T, K] fp32/bf16/fp16 (shapes and dtypes
// checked by the op layer). Reads each id once and raises c10::Error, naming
// `op`, when one lies outside [-1, num_experts). `skip` (nullable, [num_experts])
// marks experts served elsewhere: their slots are dropped as id -1 is.
void build_routing_plan(const char* op, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                        int64_t num_experts, const bool* skip, RoutingPlan& plan);

}  // namespace kt::moe
