// Phases shared by every weight format's MoE driver: activations in, the
// top-k sum out, and the task-split constants.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "moe/routing.h"

namespace kt::moe {

// Weight-block items are handed out in about this many runs per thread: long
// enough runs to keep each thread's DRAM stream contiguous, enough of them to
// even out experts with different token counts.
constexpr int kChunksPerThread = 16;

template <class T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// Phase 1: hidden_states [T, H] (bf16/fp16/fp32, contiguous) -> fp32 rows
// dst[T][Hp], zero padded past H.
void convert_activations(const at::Tensor& hidden_states, int64_t Hp, float* dst);

// Last phase: out[t] = sum over k (ascending) of y[t*K + k] for the valid
// slots, cast to out's dtype. y holds [T*K][H] fp32 weighted expert outputs.
void combine_slots(const float* y, const RoutingPlan& plan, at::Tensor& out);

}  // namespace kt::moe
