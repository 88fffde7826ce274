// Stress test of kt::runtime::ThreadPool for ThreadSanitizer (scripts/sanitize.sh tsan).
//
// Several caller threads (one of them a waiting caller) hammer run(), parallel_for(),
// run_per_part() and chained_parallel_for() while another thread resizes the pool with
// set_num_threads(), and others call prewake(), num_threads() and
// workers_bound(). Every job checks its own result (each
// task index exactly once, parallel_for covering [0, n) exactly once), so a
// lost or duplicated task fails the program even without a sanitizer. Task
// exceptions are thrown now and then and must reach the caller. The pool is
// also asked for more threads than the cap allows (set_global_num_threads
// must refuse it and keep its size).
//
// Build (what sanitize.sh does):
//   g++ -std=c++17 -O1 -g -fsanitize=thread -Icsrc tests/cpp/thread_pool_stress.cpp \
//       csrc/runtime/thread_pool.cpp csrc/runtime/openmp_team.cpp csrc/runtime/topology.cpp
//       csrc/runtime/numa.cpp $(pkg-config --cflags --libs hwloc) -pthread -ldl
//       -o /tmp/thread_pool_stress
// Without libtorch_cpu in the process the pool keeps its own threads (the
// 'openmp' backend is covered by tests/test_parallel_backend.py).
// Run: /tmp/thread_pool_stress [seconds]   (exit status 0 = passed)
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "runtime/chained_parallel_for.h"
#include "runtime/thread_pool.h"

using kt::runtime::ThreadPool;

namespace {

std::atomic<bool> g_failed{false};
std::atomic<long> g_jobs{0};

void fail(const std::string& what) {
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  g_failed = true;
}

void check_run(ThreadPool& pool, int64_t tasks, unsigned seed) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(tasks));
  for (auto& h : hits) h.store(0);
  const int64_t bad = (seed % 7 == 0) ? static_cast<int64_t>(seed % tasks) : -1;
  bool threw = false;
  try {
    pool.run(tasks, [&](int64_t t, int thread_index) {
      if (thread_index < 0) fail("negative thread index");
      hits[static_cast<size_t>(t)].fetch_add(1);
      if (t == bad) throw std::runtime_error("task error");
    });
  } catch (const std::runtime_error& e) {
    threw = true;
    if (std::string(e.what()) != "task error") fail(std::string("unexpected error ") + e.what());
  }
  if (threw != (bad >= 0)) fail("task exception lost or invented");
  // Every task runs exactly once, a failing one or not, on the inline path
  // (one thread, nested) as on the pooled one.
  for (int64_t t = 0; t < tasks; ++t) {
    const int h = hits[static_cast<size_t>(t)].load();
    if (h != 1) fail("task " + std::to_string(t) + " ran " + std::to_string(h) + " times");
  }
  g_jobs.fetch_add(1);
}

void check_parallel_for(ThreadPool& pool, int64_t items) {
  std::vector<std::atomic<int>> hits(static_cast<size_t>(items));
  for (auto& h : hits) h.store(0);
  pool.parallel_for(items, 4, [&](int64_t b, int64_t e, int) {
    if (b < 0 || e > items || b >= e) fail("bad chunk");
    for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)].fetch_add(1);
  });
  for (int64_t i = 0; i < items; ++i)
    if (hits[static_cast<size_t>(i)].load() != 1) fail("item covered twice or never");
  g_jobs.fetch_add(1);
}

// run_per_part: every (part, task) runs exactly once, whatever the part of
// the thread that takes it, and a task's exception reaches the caller.
void check_run_per_part(ThreadPool& pool, int parts, int64_t tasks, unsigned seed) {
  std::vector<int64_t> per_part(static_cast<size_t>(parts));
  for (int p = 0; p < parts; ++p) per_part[static_cast<size_t>(p)] = (tasks * (p + 1)) % 11;
  std::vector<std::atomic<int>> hits(static_cast<size_t>(parts) * 11);
  for (auto& h : hits) h.store(0);
  const bool throw_one = seed % 5 == 0 && per_part[0] > 0;
  bool threw = false;
  try {
    pool.run_per_part(per_part, [&](int p, int64_t t, int thread_index) {
      if (thread_index < 0 || p < 0 || p >= parts || t < 0 || t >= per_part[p])
        fail("bad part task");
      hits[static_cast<size_t>(p) * 11 + static_cast<size_t>(t)].fetch_add(1);
      if (throw_one && p == 0 && t == 0) throw std::runtime_error("part error");
    });
  } catch (const std::runtime_error&) {
    threw = true;
  }
  if (threw != throw_one) fail("run_per_part lost or invented an exception");
  for (int p = 0; p < parts; ++p)
    for (int64_t t = 0; t < per_part[static_cast<size_t>(p)]; ++t)
      if (hits[static_cast<size_t>(p) * 11 + static_cast<size_t>(t)].load() != 1)
        fail("part task ran twice or never");
  g_jobs.fetch_add(1);
}

// chained_parallel_for: every item runs once; between(g) sees all of group
// g's first-phase writes and runs before any second(g, .) (which checks the
// sum it published); a first-phase exception reaches the caller and no
// waiting item hangs.
void check_chained(ThreadPool& pool, int64_t groups, int64_t first_n, int64_t second_n,
                   unsigned seed) {
  std::vector<int64_t> values(static_cast<size_t>(groups * first_n), 0);
  std::vector<int64_t> sums(static_cast<size_t>(groups), -1);
  std::vector<std::atomic<int>> hits(static_cast<size_t>(groups * second_n));
  for (auto& h : hits) h.store(0);
  const bool throw_one = seed % 7 == 0;
  const int64_t bad = static_cast<int64_t>(seed % static_cast<unsigned>(groups * first_n));
  bool threw = false;
  try {
    kt::runtime::chained_parallel_for(
        pool, groups, first_n, second_n, 4,
        [&](int64_t g, int64_t i, int) {
          if (throw_one && g * first_n + i == bad) throw std::runtime_error("first error");
          values[static_cast<size_t>(g * first_n + i)] = g * 1000 + i + 1;  // plain write
        },
        [&](int64_t g) {
          int64_t s = 0;
          for (int64_t i = 0; i < first_n; ++i) s += values[static_cast<size_t>(g * first_n + i)];
          sums[static_cast<size_t>(g)] = s;  // plain write, published by the release
        },
        [&](int64_t g, int64_t i, int) {
          const int64_t want = g * 1000 * first_n + first_n * (first_n + 1) / 2;
          if (sums[static_cast<size_t>(g)] != want) fail("second phase ran before its group");
          hits[static_cast<size_t>(g * second_n + i)].fetch_add(1);
        },
        [](int) {});
  } catch (const std::runtime_error&) {
    threw = true;
  }
  if (threw != throw_one) fail("chained_parallel_for lost or invented an exception");
  if (!throw_one)
    for (auto& h : hits)
      if (h.load() != 1) fail("chained item ran twice or never");
  g_jobs.fetch_add(1);
}

}  // namespace

int main(int argc, char** argv) {
  const double seconds = argc > 1 ? std::atof(argv[1]) : 5.0;
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<long>(seconds * 1e3));
  ThreadPool::set_global_num_threads(3);
  ThreadPool& pool = ThreadPool::global();

  // The cap: a huge count is refused and the pool keeps its size.
  try {
    ThreadPool::set_global_num_threads(ThreadPool::max_threads() + 1);
    fail("a count above max_threads() was accepted");
  } catch (const std::invalid_argument&) {
  }
  if (pool.num_threads() != 3) fail("a refused resize changed the pool");

  std::atomic<bool> stop{false};
  std::vector<std::thread> callers;
  for (int c = 0; c < 3; ++c) {
    callers.emplace_back([&, c] {
      // The last caller waits while the workers compute, as the CUDA bridge's
      // host callbacks do (runtime::CallerWaitsScope).
      const kt::runtime::CallerWaitsScope waits(c == 2);
      unsigned seed = 12345u + static_cast<unsigned>(c);
      while (!stop.load()) {
        seed = seed * 1103515245u + 12345u;
        const int64_t n = 1 + static_cast<int64_t>((seed >> 8) % 97);
        if (seed & 1)
          check_run(pool, n, seed >> 4);
        else if (seed & 2)
          check_parallel_for(pool, n * 13);
        else if (seed & 4)
          check_chained(pool, 1 + n % 9, 1 + n % 13, 1 + n % 29, seed >> 6);
        else
          check_run_per_part(pool, 1 + static_cast<int>((seed >> 3) % 4), n, seed >> 5);
      }
    });
  }
  std::thread observer([&] {
    while (!stop.load()) {
      pool.prewake();
      const int n = pool.num_threads();
      if (n < 1 || n > 6) fail("num_threads() out of range: " + std::to_string(n));
      (void)pool.workers_bound();
      (void)pool.threads_per_part();
      std::this_thread::yield();
    }
  });
  std::thread resizer([&] {
    int i = 0;
    while (!stop.load()) {
      ThreadPool::set_global_num_threads(1 + (i++ % 6));  // 1..6, through one thread
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  });
  while (std::chrono::steady_clock::now() < deadline && !g_failed.load())
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  stop = true;
  resizer.join();
  observer.join();
  for (auto& t : callers) t.join();
  // Nested calls run inline on the calling worker.
  pool.set_num_threads(4);
  std::atomic<int> inner{0};
  pool.run(8, [&](int64_t, int) { pool.run(3, [&](int64_t, int) { inner.fetch_add(1); }); });
  if (inner.load() != 24) fail("nested run() lost tasks");
  std::printf("thread_pool_stress: %ld jobs checked, %s\n", g_jobs.load(),
              g_failed.load() ? "FAILED" : "ok");
  return g_failed.load() ? 1 : 0;
}
