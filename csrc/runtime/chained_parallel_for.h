// Two dependent phases of grouped work as one thread-pool job, without a
// barrier between them (the MoE driver's gate/up -> down, csrc/moe/moe_phases.h).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "runtime/thread_pool.h"

namespace kt::runtime {

// Items [0, groups * first_per_group) are first(g, i, thread) for group g and
// index i < first_per_group; the rest are second(g, i, thread), i <
// second_per_group (thread: the pool's index of the thread running the item,
// ThreadPool::parallel_for). Once all first(g, .) are done, the thread that
// completed the last of them runs between(g); every second(g, .) waits
// (spinning) until between(g) has run. after_run(thread) follows each run of
// items on the thread that did them.
//
// Items are handed out in order in runs (ThreadPool::parallel_for), so every
// first-phase item is taken before any second-phase item, and it is computed
// by a thread that does not wait: the earliest unfinished item always
// progresses, and nothing deadlocks, for any thread count. A thread that
// finishes its share of phase one goes on to the groups whose first phase is
// done instead of idling at a barrier. If first() or between() throws, the
// second-phase items still waiting give up and the pool rethrows the error.
template <class First, class Between, class Second, class AfterRun>
void chained_parallel_for(ThreadPool& pool, int64_t groups, int64_t first_per_group,
                          int64_t second_per_group, int chunks_per_thread, const First& first,
                          const Between& between, const Second& second, const AfterRun& after_run) {
  if (groups <= 0) return;
  // done[g]: first-phase items of group g completed, +1 once between(g) ran.
  std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[groups]);
  for (int64_t g = 0; g < groups; ++g) done[g].store(0, std::memory_order_relaxed);
  std::atomic<bool> failed{false};
  const int64_t first_items = groups * first_per_group;
  pool.parallel_for(
      first_items + groups * second_per_group, chunks_per_thread,
      [&](int64_t begin, int64_t end, int thread) {
        for (int64_t item = begin; item < end; ++item) {
          if (item < first_items) {
            const int64_t g = item / first_per_group;
            try {
              first(g, item % first_per_group, thread);
              // acq_rel: the last one sees every first(g, .)'s writes.
              if (done[g].fetch_add(1, std::memory_order_acq_rel) + 1 == first_per_group) {
                between(g);
                done[g].fetch_add(1, std::memory_order_release);
              }
            } catch (...) {
              failed.store(true, std::memory_order_relaxed);
              after_run(thread);
              throw;
            }
            continue;
          }
          const int64_t g = (item - first_items) / second_per_group;
          for (uint64_t poll = 0; done[g].load(std::memory_order_acquire) <= first_per_group;
               ++poll) {
            if (failed.load(std::memory_order_relaxed)) {
              after_run(thread);
              return;
            }
            spin_pause(poll);
          }
          second(g, (item - first_items) % second_per_group, thread);
        }
        after_run(thread);
      });
}

}  // namespace kt::runtime
