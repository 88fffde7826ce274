#include "runtime/thread_pool.h"

#include <pthread.h>

#include <chrono>
#include <cstdlib>

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

int default_num_threads() {
  if (const char* env = std::getenv("KT_OPS_NUM_THREADS")) {
    const int n = std::atoi(env);
    if (n > 0) return n;
  }
  return static_cast<int>(topology().cores.size());
}

ThreadPool* g_pool = nullptr;
std::once_flag g_pool_once;

void reset_after_fork() {
  // The child has only the forking thread: the old pool's workers are gone.
  // Leak the old object (its std::threads cannot be joined) and start afresh.
  if (g_pool != nullptr) g_pool = new ThreadPool(g_pool->num_threads());
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
  std::call_once(g_pool_once, [] {
    g_pool = new ThreadPool(default_num_threads());  // never destroyed: outlives Python
    pthread_atfork(nullptr, nullptr, reset_after_fork);
  });
  return *g_pool;
}

ThreadPool::ThreadPool(int num_threads) : num_threads_(num_threads < 1 ? 1 : num_threads) {
  start_workers();
}

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::set_num_threads(int n) {
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  stop_workers();
  num_threads_ = n < 1 ? 1 : n;
  start_workers();
}

void ThreadPool::start_workers() {
  stop_ = false;
  const Topology& topo = topology();
  const int num_cores = static_cast<int>(topo.cores.size());
  started_workers_.store(0);
  bound_workers_.store(0);
  for (int i = 1; i < num_threads_; ++i) {
    workers_.emplace_back([this, i, num_cores, &topo] {
      // Worker i takes core i: the caller, usually on core 0, keeps its own.
      if (bind_current_thread(topo.cores[i % num_cores])) bound_workers_.fetch_add(1);
      started_workers_.fetch_add(1);
      worker_loop(i);
    });
  }
  while (started_workers_.load() < num_threads_ - 1) std::this_thread::yield();
  workers_bound_ = num_threads_ > 1 && bound_workers_.load() == num_threads_ - 1;
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

void ThreadPool::worker_loop(int thread_index) {
  uint64_t seen = 0;
  for (;;) {
    if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      std::unique_lock<std::mutex> lock(mutex_);
      work_cv_.wait(lock, [&] { return generation_.load() != seen; });
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

void ThreadPool::run(int64_t num_tasks, const TaskFn& fn) {
  if (num_tasks <= 0) return;
  if (num_tasks == 1 || workers_.empty() || t_inside_pool_task) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t, 0);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mutex_);
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

}  // namespace kt::runtime
