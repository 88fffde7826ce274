// Phases shared by every weight format's MoE driver: activations in, the
// top-k sum out, and the task-split constants.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "moe/numa_placement.h"
#include "moe/routing.h"
#include "runtime/chained_parallel_for.h"
#include "runtime/thread_pool.h"

namespace kt::moe {

// Weight-block items are handed out in about this many runs per thread: long
// enough runs to keep each thread's DRAM stream contiguous, enough of them to
// even out experts with different token counts.
constexpr int kChunksPerThread = 16;

template <class T, class A>
void grow(std::vector<T, A>& v, size_t n) {
  if (v.size() < n) v.resize(n);
}

// The (active expert, 16-row weight block) items of a phase, handed out in
// runs of adjacent blocks (kChunksPerThread per thread) on the global pool:
// fn(e, nb, r0, m, thread) for expert e, block nb and the expert's plan rows
// [r0, r0 + m), on pool thread index `thread`. `blocks` is the number of
// 16-row blocks per expert. `after_run(thread)` is called on the same thread
// after each run (a tile kernel releases its hardware context there).
template <class Fn, class AfterRun>
void for_each_expert_block(const RoutingPlan& plan, int64_t blocks, const Fn& fn,
                           const AfterRun& after_run) {
  const int64_t items = static_cast<int64_t>(plan.active_experts.size()) * blocks;
  runtime::ThreadPool::global().parallel_for(
      items, kChunksPerThread, [&](int64_t begin, int64_t end, int thread) {
        for (int64_t item = begin; item < end; ++item) {
          const int64_t e = plan.active_experts[item / blocks];
          const int64_t r0 = plan.expert_offsets[e];
          fn(e, item % blocks, r0, static_cast<int>(plan.expert_offsets[e + 1] - r0), thread);
        }
        after_run(thread);
      });
}

// The same over a NUMA split (moe/numa_placement.h): the blocks of part p
// ([bounds[p], bounds[p+1]) of every active expert) are handed out in runs to
// the pool threads of part p first (ThreadPool::run_per_part). One part: the
// function above, unchanged. Which thread computes an item never changes
// what it computes, so results are bit-identical for any split.
template <class Fn, class AfterRun>
void for_each_expert_block(const RoutingPlan& plan, const BlockSplit& split, const Fn& fn,
                           const AfterRun& after_run) {
  if (split.bounds.empty()) {
    for_each_expert_block(plan, split.blocks, fn, after_run);
    return;
  }
  runtime::ThreadPool& pool = runtime::ThreadPool::global();
  const int parts = split.parts();
  const int64_t active = static_cast<int64_t>(plan.active_experts.size());
  const std::vector<int> threads = pool.threads_per_part();
  std::vector<int64_t> items(parts), chunk(parts), tasks(parts);
  for (int p = 0; p < parts; ++p) {
    items[p] = active * (split.bounds[p + 1] - split.bounds[p]);
    const int own = threads[static_cast<size_t>(p) % threads.size()];
    const int64_t chunks = static_cast<int64_t>(kChunksPerThread) * std::max(own, 1);
    chunk[p] = std::max<int64_t>(1, (items[p] + chunks - 1) / chunks);
    tasks[p] = (items[p] + chunk[p] - 1) / chunk[p];
  }
  pool.run_per_part(tasks, [&](int p, int64_t task, int thread) {
    const int64_t b0 = split.bounds[p], width = split.bounds[p + 1] - b0;
    const int64_t begin = task * chunk[p], end = std::min(items[p], begin + chunk[p]);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t e = plan.active_experts[item / width];
      const int64_t r0 = plan.expert_offsets[e];
      fn(e, b0 + item % width, r0, static_cast<int>(plan.expert_offsets[e + 1] - r0), thread);
    }
    after_run(thread);
  });
}

// Phases 2 and 3 of the driver as one pool job (runtime/chained_parallel_for.h):
// first(e, nb, r0, m, thread) for every (active expert, block of first_blocks),
// then second(e, nb, r0, m, thread) for every (active expert, block of
// second_blocks); an expert's second-phase blocks start once its first-phase
// blocks are done and between(e, r0, m) has run, with no barrier between the
// phases (a thread that finishes its share of phase one goes on to phase two
// of the experts that are ready). Which thread computes an item never changes
// what it computes, so results are bit-identical to two separate phases.
template <class First, class Between, class Second, class AfterRun>
void for_each_expert_block_chained(const RoutingPlan& plan, int64_t first_blocks,
                                   int64_t second_blocks, const First& first,
                                   const Between& between, const Second& second,
                                   const AfterRun& after_run) {
  const int64_t* offsets = plan.expert_offsets.data();
  const int64_t* active = plan.active_experts.data();
  auto rows = [&](int64_t a, auto&& fn) {
    const int64_t e = active[a];
    fn(e, offsets[e], static_cast<int>(offsets[e + 1] - offsets[e]));
  };
  runtime::chained_parallel_for(
      runtime::ThreadPool::global(), static_cast<int64_t>(plan.active_experts.size()), first_blocks,
      second_blocks, kChunksPerThread,
      [&](int64_t a, int64_t nb, int thread) {
        rows(a, [&](int64_t e, int64_t r0, int m) { first(e, nb, r0, m, thread); });
      },
      [&](int64_t a) { rows(a, between); },
      [&](int64_t a, int64_t nb, int thread) {
        rows(a, [&](int64_t e, int64_t r0, int m) { second(e, nb, r0, m, thread); });
      },
      after_run);
}

// Phase 1: hidden_states [T, H] (bf16/fp16/fp32, contiguous) -> fp32 rows
// dst[T][Hp], zero padded past H.
void convert_activations(const at::Tensor& hidden_states, int64_t Hp, float* dst);

// Last phase: out[t] = sum over k (ascending) of y[t*K + k] for the valid
// slots, cast to out's dtype. y holds [T*K][H] fp32 weighted expert outputs.
void combine_slots(const float* y, const RoutingPlan& plan, at::Tensor& out);

}  // namespace kt::moe
