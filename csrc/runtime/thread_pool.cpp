#include "runtime/thread_pool.h"

#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>

#include "runtime/topology.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KT_CPU_RELAX() _mm_pause()
#else
#define KT_CPU_RELAX() ((void)0)
#endif

namespace kt::runtime {

namespace {

// How long an idle thread polls before parking. Long enough to bridge the gap
// between two phases of one op call, far too short to matter to other work.
constexpr auto kSpinBeforePark = std::chrono::microseconds(50);

thread_local bool t_inside_pool_task = false;

ThreadPool* g_pool = nullptr;
std::mutex g_pool_mutex;
bool g_atfork_registered = false;

int default_num_threads() {
  if (const char* env = std::getenv("KT_OPS_NUM_THREADS"); env != nullptr && env[0] != '\0') {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    const int cap = ThreadPool::max_threads();
    if (end == env || *end != '\0' || n < 1 || n > cap) {
      throw std::invalid_argument(
          std::string("KT_OPS_NUM_THREADS='") + env + "' must be an integer in [1, " +
          std::to_string(cap) + "] (threads, the caller included; the cap is " +
          std::to_string(ThreadPool::kMaxThreadsPerCore) + " x the physical cores, at least " +
          std::to_string(ThreadPool::kMinMaxThreads) + ")");
    }
    return static_cast<int>(n);
  }
  return static_cast<int>(topology().cores.size());
}

void check_thread_count(int n) {
  const int cap = ThreadPool::max_threads();
  if (n < 1 || n > cap) {
    throw std::invalid_argument(
        "kt_ops.set_num_threads: n must be in [1, " + std::to_string(cap) + "], got " +
        std::to_string(n) + " (the cap is " + std::to_string(ThreadPool::kMaxThreadsPerCore) +
        " x the " + std::to_string(topology().cores.size()) + " physical cores, at least " +
        std::to_string(ThreadPool::kMinMaxThreads) + ")");
  }
}

int g_threads_before_fork = 0;

void reset_after_fork() {
  // The child has only the forking thread: the old pool's workers are gone.
  // Leak the old object (its std::threads cannot be joined), forget it, and
  // let the next use start a pool of the same size. The mutex may have been
  // held by another parent thread at the fork: start it afresh too.
  if (g_pool != nullptr) g_threads_before_fork = g_pool->num_threads();
  g_pool = nullptr;
  new (&g_pool_mutex) std::mutex();
}

template <class Pred>
bool spin_until(Pred pred) {
  const auto deadline = std::chrono::steady_clock::now() + kSpinBeforePark;
  for (int i = 0;; ++i) {
    if (pred()) return true;
    KT_CPU_RELAX();
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) return false;
  }
}

}  // namespace

ThreadPool& ThreadPool::global() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (g_pool == nullptr) {
    const int n = g_threads_before_fork > 0 ? g_threads_before_fork : default_num_threads();
    try {
      g_pool = new ThreadPool(n);  // never destroyed: outlives Python
    } catch (const std::runtime_error& e) {
      // Threads refused (a process limit under a large KT_OPS_NUM_THREADS): run
      // on the calling thread, which needs none, and say so once, instead of
      // failing this call and every later one.
      std::fprintf(stderr, "kt_ops: %s; running on 1 thread (kt_ops.set_num_threads to retry)\n",
                   e.what());
      g_pool = new ThreadPool(1);
    }
    if (!g_atfork_registered) pthread_atfork(nullptr, nullptr, reset_after_fork);
    g_atfork_registered = true;
  }
  return *g_pool;
}

int ThreadPool::max_threads() {
  const int cores = static_cast<int>(topology().cores.size());
  return std::max(kMinMaxThreads, kMaxThreadsPerCore * std::max(cores, 1));
}

void ThreadPool::set_global_num_threads(int n) {
  check_thread_count(n);
  {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    if (g_pool == nullptr) {  // never read $KT_OPS_NUM_THREADS: the caller decided
      g_pool = new ThreadPool(n);
      if (!g_atfork_registered) pthread_atfork(nullptr, nullptr, reset_after_fork);
      g_atfork_registered = true;
      return;
    }
  }
  g_pool->set_num_threads(n);
}

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  try {
    start_workers();
  } catch (const std::runtime_error& e) {
    throw std::runtime_error("kt_ops thread pool of " + std::to_string(num_threads) +
                             " threads: " + e.what());
  }
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::set_num_threads(int n) {
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  const int previous = num_threads_.load();
  stop_workers();
  num_threads_ = n < 1 ? 1 : n;
  try {
    start_workers();
  } catch (const std::runtime_error& e) {
    // start_workers() left no workers: go back to the previous size, which
    // worked before (or to one thread, which needs none), then report.
    num_threads_ = previous;
    int now = previous;
    try {
      start_workers();
    } catch (const std::runtime_error&) {
      num_threads_ = 1;
      num_workers_.store(0);
      now = 1;
    }
    throw std::runtime_error(std::string("kt_ops.set_num_threads(") + std::to_string(n) + "): " +
                             e.what() + "; the pool keeps " + std::to_string(now) + " thread(s)");
  }
}

void ThreadPool::start_workers() {
  stop_ = false;
  const Topology& topo = topology();
  const int num_cores = static_cast<int>(topo.cores.size());
  started_workers_.store(0);
  bound_workers_.store(0);
  // New workers wait for the next job: a worker that started from generation 0
  // would take the stop_workers() bump for a job and decrement busy_workers_
  // for a job it never joined, leaving a later run() waiting forever.
  const uint64_t start_generation = generation_.load();
  const int want = num_threads_.load() - 1;
  try {
    workers_.reserve(static_cast<size_t>(want));
    for (int i = 1; i <= want; ++i) {
      workers_.emplace_back([this, i, num_cores, &topo, start_generation] {
        // Worker i takes core i: the caller, usually on core 0, keeps its own.
        if (bind_current_thread(topo.cores[i % num_cores])) bound_workers_.fetch_add(1);
        started_workers_.fetch_add(1);
        worker_loop(i, start_generation);
      });
    }
  } catch (const std::exception& e) {  // std::system_error (EAGAIN), std::bad_alloc
    const int started = static_cast<int>(workers_.size());
    stop_workers();  // joins the workers that did start: none is left running
    throw std::runtime_error("could start only " + std::to_string(started) + " of " +
                             std::to_string(want) + " worker threads (" + e.what() +
                             "; a limit on threads or processes?)");
  }
  while (started_workers_.load() < want) std::this_thread::yield();
  workers_bound_ = want > 0 && bound_workers_.load() == want;
  num_workers_.store(want, std::memory_order_release);
}

void ThreadPool::stop_workers() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
    generation_.fetch_add(1);
  }
  work_cv_.notify_all();
  for (auto& t : workers_) t.join();
  workers_.clear();
  num_workers_.store(0, std::memory_order_release);
}

void ThreadPool::do_tasks(int thread_index) {
  const bool was_inside = t_inside_pool_task;
  t_inside_pool_task = true;
  for (;;) {
    const int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= job_tasks_) break;
    try {
      (*job_)(task, thread_index);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }
  t_inside_pool_task = was_inside;
}

void ThreadPool::worker_loop(int thread_index, uint64_t seen) {
  for (;;) {
    if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      std::unique_lock<std::mutex> lock(mutex_);
      const uint64_t wakes = wake_calls_;
      work_cv_.wait(lock, [&] { return generation_.load() != seen || wake_calls_ != wakes; });
      if (generation_.load() == seen) continue;  // woken ahead of a job: spin for it
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (stop_) return;
      seen = generation_.load();
    }
    do_tasks(thread_index);
    if (busy_workers_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lock(mutex_);
      done_cv_.notify_one();
    }
  }
}

void ThreadPool::prewake() {
  // num_threads_, not workers_: set_num_threads may be rebuilding the vector.
  if (num_threads_.load() <= 1) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++wake_calls_;
  }
  work_cv_.notify_all();
}

void ThreadPool::run(int64_t num_tasks, const TaskFn& fn) {
  if (num_tasks <= 0) return;
  // Inline as pooled: every task runs, then the first exception is rethrown
  // (a task's failure never leaves later tasks' outputs unwritten on one path only).
  const auto run_inline = [&] {
    std::exception_ptr first;
    for (int64_t t = 0; t < num_tasks; ++t) {
      try {
        fn(t, 0);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  };
  // workers_ is only read under run_mutex_: set_num_threads() rebuilds it under
  // that lock. The atomic count lets a pool without workers skip the lock.
  if (num_tasks == 1 || t_inside_pool_task || num_workers_.load(std::memory_order_acquire) == 0) {
    run_inline();
    return;
  }
  std::unique_lock<std::mutex> run_lock(run_mutex_);
  if (workers_.empty()) {  // resized to one thread since the check above
    run_lock.unlock();
    run_inline();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    job_tasks_ = num_tasks;
    next_task_.store(0, std::memory_order_relaxed);
    busy_workers_.store(static_cast<int>(workers_.size()), std::memory_order_relaxed);
    error_ = nullptr;
    generation_.fetch_add(1, std::memory_order_release);
  }
  work_cv_.notify_all();
  do_tasks(0);
  if (!spin_until([&] { return busy_workers_.load(std::memory_order_acquire) == 0; })) {
    std::unique_lock<std::mutex> lock(mutex_);
    done_cv_.wait(lock, [&] { return busy_workers_.load() == 0; });
  }
  job_ = nullptr;
  if (error_) {
    std::exception_ptr e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
}

void ThreadPool::parallel_for(int64_t num_items, int chunks_per_thread,
                              const std::function<void(int64_t, int64_t)>& fn) {
  if (num_items <= 0) return;
  const int64_t chunks =
      std::max<int64_t>(1, static_cast<int64_t>(chunks_per_thread) * num_threads_);
  const int64_t chunk = (num_items + chunks - 1) / chunks;
  const int64_t tasks = (num_items + chunk - 1) / chunk;
  run(tasks, [&](int64_t task, int) {
    const int64_t begin = task * chunk;
    fn(begin, std::min(num_items, begin + chunk));
  });
}

}  // namespace kt::runtime
