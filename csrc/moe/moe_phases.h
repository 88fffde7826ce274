// Phases shared by every weight format's MoE driver: activations in, the
// top-k sum out, and the task-split constants.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "moe/routing.h"
#include "runtime/thread_pool.h"

namespace kt::moe {

// Weight-block items are handed out in about this many runs per thread: long
// enough runs to keep each thread's DRAM stream contiguous, enough of them to
// even out experts with different token counts.
constexpr int kChunksPerThread = 16;

template <class T>
void grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// The (active expert, 16-row weight block) items of a phase, handed out in
// runs of adjacent blocks (kChunksPerThread per thread) on the global pool:
// fn(e, nb, r0, m) for expert e, block nb and the expert's plan rows
// [r0, r0 + m). `blocks` is the number of 16-row blocks per expert.
// `after_run()` is called on the same thread after each run (the brgemm
// path releases its hardware context there).
template <class Fn, class AfterRun>
void for_each_expert_block(const RoutingPlan& plan, int64_t blocks, const Fn& fn,
                           const AfterRun& after_run) {
  const int64_t items = static_cast<int64_t>(plan.active_experts.size()) * blocks;
  runtime::ThreadPool::global().parallel_for(
      items, kChunksPerThread, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t e = plan.active_experts[item / blocks];
          const int64_t r0 = plan.expert_offsets[e];
          fn(e, item % blocks, r0, static_cast<int>(plan.expert_offsets[e + 1] - r0));
        }
        after_run();
      });
}

// Phase 1: hidden_states [T, H] (bf16/fp16/fp32, contiguous) -> fp32 rows
// dst[T][Hp], zero padded past H.
void convert_activations(const at::Tensor& hidden_states, int64_t Hp, float* dst);

// Last phase: out[t] = sum over k (ascending) of y[t*K + k] for the valid
// slots, cast to out's dtype. y holds [T*K][H] fp32 weighted expert outputs.
void combine_slots(const float* y, const RoutingPlan& plan, at::Tensor& out);

}  // namespace kt::moe
