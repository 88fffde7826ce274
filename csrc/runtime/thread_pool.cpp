#include "runtime/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>

#include "runtime/numa.h"
#include "runtime/openmp_team.h"
#include "runtime/topology.h"

namespace kt::runtime {

namespace {

// How long an idle thread polls before parking. Long enough to bridge the gap
// between two phases of one op call, far too short to matter to other work.
constexpr auto kSpinBeforePark = std::chrono::microseconds(50);

// How long a thread woken by prewake() polls for the job it announced. A
// futex wake-up takes 40-100 us on a VM, and an op's argument checks on cold
// caches 30-60 us: with only kSpinBeforePark, the worker parked again before
// the first phase, woke once more after it began, and a decode call's whole
// weight stream often ran on the calling thread alone (measured on the
// 2-core Zen 4 host: 384 of 384 blocks on one thread in most cold T = 1
// calls). Bounded, so a prewake whose op then fails costs at most this.
constexpr auto kSpinAfterPrewake = std::chrono::microseconds(1000);

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

// The parallel backend: kUnset until chosen (by set_parallel_backend, else
// $KT_OPS_PARALLEL_BACKEND on first use). A malformed variable is kept as an
// error that ThreadPool::global() reports until a backend is set explicitly.
constexpr int kUnset = -1;
std::atomic<int> g_backend{kUnset};
std::mutex g_backend_mutex;
std::string g_backend_env_error;  // guarded by g_backend_mutex

ParallelBackend backend_or_auto() {
  int b = g_backend.load(std::memory_order_acquire);
  if (b != kUnset) return static_cast<ParallelBackend>(b);
  std::lock_guard<std::mutex> lock(g_backend_mutex);
  b = g_backend.load();
  if (b == kUnset) {
    ParallelBackend chosen = ParallelBackend::kAuto;
    if (const char* env = std::getenv("KT_OPS_PARALLEL_BACKEND");
        env != nullptr && env[0] != '\0') {
      try {
        chosen = parse_parallel_backend(env);
        if (chosen == ParallelBackend::kOpenMP && !openmp::available())
          throw std::invalid_argument("torch's OpenMP runtime was not found in this process");
      } catch (const std::invalid_argument& e) {
        g_backend_env_error = std::string("KT_OPS_PARALLEL_BACKEND='") + env +
                              "' cannot be used: " + e.what() +
                              " (unset it, or call kt_ops.set_parallel_backend)";
        return ParallelBackend::kAuto;  // not stored: the error stands until a set_parallel_backend
      }
    }
    g_backend.store(static_cast<int>(chosen), std::memory_order_release);
    b = static_cast<int>(chosen);
  }
  return static_cast<ParallelBackend>(b);
}

void throw_if_backend_env_error() {
  if (g_backend.load(std::memory_order_acquire) != kUnset) return;
  backend_or_auto();
  std::lock_guard<std::mutex> lock(g_backend_mutex);
  if (g_backend.load() == kUnset && !g_backend_env_error.empty())
    throw std::invalid_argument(g_backend_env_error);
}

thread_local int t_pool_threads_scopes = 0;  // PoolThreadsScope nesting on this thread
thread_local int t_caller_waits_scopes = 0;  // active CallerWaitsScope nesting on this thread
std::atomic<uint64_t> g_openmp_jobs{0}, g_pool_jobs{0}, g_caller_moves{0};

// For one pool job: moves the calling thread onto its home PUs
// (detail::caller_target) when it is elsewhere, and restores its affinity
// mask at the end. A bound worker cannot leave its core, and the running
// caller is not preempted for it until its time slice ends: with the caller
// on a worker's core a 2-thread job took 1.4x as long (README, "Thread
// pool"). Under NUMA placement the caller computes node 0's part, so it is
// brought to node 0 from another node too.
class CallerOnHomePus {
 public:
  explicit CallerOnHomePus(const std::vector<uint8_t>& pu_role) {
#if defined(__linux__)
    if (pu_role.empty()) return;  // workers not bound: the OS places everyone
    const int cpu = sched_getcpu();
    if (cpu < 0 || (static_cast<size_t>(cpu) < pu_role.size() && pu_role[cpu] == detail::kHomePu))
      return;  // the usual case: one vDSO call
    if (sched_getaffinity(0, sizeof(saved_), &saved_) != 0) return;
    std::vector<int> mask;
    for (int pu = 0; pu < CPU_SETSIZE; ++pu)
      if (CPU_ISSET(pu, &saved_)) mask.push_back(pu);
    const std::vector<int> target = detail::caller_target(cpu, mask, pu_role);
    if (target.empty()) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int pu : target) CPU_SET(pu, &set);
    moved_ = sched_setaffinity(0, sizeof(set), &set) == 0;
    if (moved_) g_caller_moves.fetch_add(1, std::memory_order_relaxed);
#endif
  }
  ~CallerOnHomePus() {
#if defined(__linux__)
    if (moved_) sched_setaffinity(0, sizeof(saved_), &saved_);
#endif
  }
  CallerOnHomePus(const CallerOnHomePus&) = delete;
  CallerOnHomePus& operator=(const CallerOnHomePus&) = delete;

 private:
#if defined(__linux__)
  cpu_set_t saved_;
#endif
  bool moved_ = false;
};

// Set in a child process by fork(): the parent's OpenMP threads are gone and
// the runtime would wait for them at the next parallel region.
std::atomic<bool> g_forked_child{false};
void mark_forked_child() { g_forked_child.store(true); }
const bool g_fork_handler_registered = [] {
  pthread_atfork(nullptr, nullptr, mark_forked_child);
  return true;
}();

void reset_after_fork() {
  // The child has only the forking thread: the old pool's workers are gone.
  // Leak the old object (its std::threads cannot be joined), forget it, and
  // let the next use start a pool of the same size. The mutex may have been
  // held by another parent thread at the fork: start it afresh too.
  if (g_pool != nullptr) g_threads_before_fork = g_pool->num_threads();
  g_pool = nullptr;
  new (&g_pool_mutex) std::mutex();
}

// The NUMA nodes that have cores, with the range of their cores in
// topology().cores (ordered by node): the placement parts, in order.
struct PartCores {
  std::vector<int> node, first, count;
};

const PartCores& part_cores() {
  static const PartCores parts = [] {
    PartCores p;
    const Topology& topo = topology();
    for (int c = 0; c < static_cast<int>(topo.cores.size()); ++c) {
      const int node = topo.cores[c].numa_node;
      if (p.node.empty() || p.node.back() != node) {
        p.node.push_back(node);
        p.first.push_back(c);
        p.count.push_back(0);
      }
      ++p.count.back();
    }
    return p;
  }();
  return parts;
}

// The index in topology().cores of the core that thread i is bound to, spread
// over `parts` nodes (1: the plain mapping, core i).
int core_for_thread(int i, int parts) {
  const int num_cores = static_cast<int>(topology().cores.size());
  if (parts <= 1) return i % num_cores;
  const PartCores& pc = part_cores();
  const int p = i % parts;
  return pc.first[p] + (i / parts) % pc.count[p];
}

// Polls pred until it holds (true) or the budget runs out (false).
template <class Pred>
bool spin_until(Pred pred, std::chrono::microseconds budget = kSpinBeforePark) {
  const auto deadline = std::chrono::steady_clock::now() + budget;
  for (uint64_t i = 0;; ++i) {
    if (pred()) return true;
    spin_pause(i);
    if ((i & 63) == 63 && std::chrono::steady_clock::now() > deadline) return false;
  }
}

}  // namespace

const char* parallel_backend_name(ParallelBackend b) {
  switch (b) {
    case ParallelBackend::kPool:
      return "pool";
    case ParallelBackend::kOpenMP:
      return "openmp";
    case ParallelBackend::kAuto:
    default:
      return "auto";
  }
}

ParallelBackend parse_parallel_backend(const std::string& name) {
  if (name == "auto") return ParallelBackend::kAuto;
  if (name == "pool") return ParallelBackend::kPool;
  if (name == "openmp") return ParallelBackend::kOpenMP;
  throw std::invalid_argument("parallel backend must be 'auto', 'pool' or 'openmp', got '" + name +
                              "'");
}

void ThreadPool::set_parallel_backend(ParallelBackend backend) {
  if (backend == ParallelBackend::kOpenMP && !openmp::available())
    throw std::invalid_argument(
        "kt_ops.set_parallel_backend('openmp'): torch's OpenMP runtime was not found in this "
        "process (a torch built without OpenMP?); use 'auto' or 'pool'");
  std::lock_guard<std::mutex> lock(g_backend_mutex);
  g_backend_env_error.clear();
  g_backend.store(static_cast<int>(backend), std::memory_order_release);
}

ParallelBackend ThreadPool::parallel_backend() { return backend_or_auto(); }

PoolThreadsScope::PoolThreadsScope() { ++t_pool_threads_scopes; }
PoolThreadsScope::~PoolThreadsScope() { --t_pool_threads_scopes; }

CallerWaitsScope::CallerWaitsScope(bool active) : active_(active) {
  if (active_) ++t_caller_waits_scopes;
}
CallerWaitsScope::~CallerWaitsScope() {
  if (active_) --t_caller_waits_scopes;
}

uint64_t ThreadPool::openmp_jobs() { return g_openmp_jobs.load(std::memory_order_relaxed); }
uint64_t ThreadPool::pool_jobs() { return g_pool_jobs.load(std::memory_order_relaxed); }
uint64_t ThreadPool::caller_moves() { return g_caller_moves.load(std::memory_order_relaxed); }

namespace detail {

std::vector<int> caller_target(int cpu, const std::vector<int>& mask,
                               const std::vector<uint8_t>& pu_role) {
  const auto role = [&](int pu) {
    return pu >= 0 && static_cast<size_t>(pu) < pu_role.size() ? pu_role[pu] : uint8_t{kOtherPu};
  };
  if (role(cpu) == kHomePu) return {};
  std::vector<int> home, off_workers;
  for (int pu : mask) {
    if (role(pu) == kHomePu) home.push_back(pu);
    if (role(pu) != kWorkerPu) off_workers.push_back(pu);
  }
  if (!home.empty()) return home;
  if (role(cpu) == kWorkerPu) return off_workers;  // empty: pinned to workers' PUs only
  return {};
}

}  // namespace detail

bool ThreadPool::uses_openmp(std::string* why) const {
  // One decision; `why` (kt_ops.info()) gets the case that made it.
  const auto pool = [why](const char* reason) {
    if (why != nullptr) *why = reason;
    return false;
  };
  const ParallelBackend b = backend_or_auto();
  const int n = num_threads_.load();
  if (b == ParallelBackend::kPool) return pool("set to 'pool'");
  if (n <= 1) return pool("one thread: jobs run on the calling thread");
  if (b == ParallelBackend::kAuto && t_pool_threads_scopes > 0)
    return pool("this thread runs no torch ops (a CUDA bridge host callback)");
  if (g_forked_child.load(std::memory_order_relaxed))
    return pool("a forked child: the parent's OpenMP threads did not survive fork()");
  if (spread_parts_.load() > 1)
    return pool("NUMA placement: the pool's threads are bound per node");
  if (!openmp::available()) return pool("torch's OpenMP runtime was not found");
  if (openmp::in_parallel()) return pool("called inside an OpenMP parallel region");
  if (b == ParallelBackend::kOpenMP) {
    if (why != nullptr) *why = "set to 'openmp': a team of " + std::to_string(n) + " threads";
    return true;
  }
  const int omp = openmp::max_threads();
  if (why != nullptr) {
    const std::string threads = std::to_string(n);
    *why = omp == n
               ? "torch's OpenMP team has the pool's size (" + threads + ")"
               : "torch's OpenMP team has " + std::to_string(omp) + " threads, kt_ops " + threads +
                     " (kt_ops.set_num_threads / torch.set_num_threads to match them)";
  }
  return omp == n;
}

ThreadPool& ThreadPool::global() {
  throw_if_backend_env_error();
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
  started_workers_.store(0);
  bound_workers_.store(0);
  // New workers wait for the next job: a worker that started from generation 0
  // would take the stop_workers() bump for a job and decrement busy_workers_
  // for a job it never joined, leaving a later run() waiting forever.
  const uint64_t start_generation = generation_.load();
  const int want = num_threads_.load() - 1;
  const int parts = numa_parts();
  spread_parts_.store(parts);
  try {
    workers_.reserve(static_cast<size_t>(want));
    for (int i = 1; i <= want; ++i) {
      workers_.emplace_back([this, i, parts, &topo, start_generation] {
        // Worker i takes core i (spread over the nodes under NUMA placement):
        // the caller, usually on core 0, keeps its own.
        if (bind_current_thread(topo.cores[core_for_thread(i, parts)])) bound_workers_.fetch_add(1);
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
  // The PUs' roles for the caller's placement (CallerOnHomePus): the workers'
  // PUs, and the caller's home: the other PUs, on thread 0's node only when
  // the threads are spread over nodes (it computes that node's part).
  pu_role_.clear();
  if (workers_bound_) {
    const auto mark = [&](int pu, uint8_t role) {
      if (pu < 0) return;
      if (pu_role_.size() <= static_cast<size_t>(pu)) pu_role_.resize(pu + 1, detail::kOtherPu);
      if (pu_role_[pu] != detail::kWorkerPu) pu_role_[pu] = role;
    };
    for (int i = 1; i <= want; ++i)
      for (int pu : topo.cores[core_for_thread(i, parts)].pus) mark(pu, detail::kWorkerPu);
    const int home_node = topo.cores[core_for_thread(0, parts)].numa_node;
    for (const Core& c : topo.cores)
      if (parts <= 1 || c.numa_node == home_node)
        for (int pu : c.pus) mark(pu, detail::kHomePu);
  }
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
  bool prewoken = false;  // woken by prewake(): the announced job is close
  for (;;) {
    const auto budget = prewoken ? kSpinAfterPrewake : kSpinBeforePark;
    prewoken = false;
    if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; }, budget)) {
      std::unique_lock<std::mutex> lock(mutex_);
      const uint64_t wakes = wake_calls_;
      work_cv_.wait(lock, [&] { return generation_.load() != seen || wake_calls_ != wakes; });
      if (generation_.load() == seen) {  // woken ahead of a job: spin for it
        prewoken = true;
        continue;
      }
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
  // (On torch's OpenMP threads the runtime wakes them itself; ours stay parked.)
  if (num_threads_.load() <= 1 || uses_openmp()) return;
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
  if (uses_openmp()) {
    g_openmp_jobs.fetch_add(1, std::memory_order_relaxed);
    run_on_openmp(num_tasks, fn);
    return;
  }
  g_pool_jobs.fetch_add(1, std::memory_order_relaxed);
  std::unique_lock<std::mutex> run_lock(run_mutex_);
  if (workers_.empty()) {  // resized to one thread since the check above
    run_lock.unlock();
    run_inline();
    return;
  }
  // A waiting caller (CallerWaitsScope) computes nothing: it stays where it is.
  const bool caller_waits = t_caller_waits_scopes > 0;
  static const std::vector<uint8_t> kStayPut;
  const CallerOnHomePus on_home_pus(caller_waits ? kStayPut : pu_role_);
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
  if (!caller_waits) do_tasks(0);
  if (caller_waits ||
      !spin_until([&] { return busy_workers_.load(std::memory_order_acquire) == 0; })) {
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

void ThreadPool::run_on_openmp(int64_t num_tasks, const TaskFn& fn) {
  std::lock_guard<std::mutex> run_lock(run_mutex_);  // one job at a time, as on the pool
  struct Job {
    const TaskFn* fn;
    int64_t tasks;
    std::atomic<int64_t> next{0};
    std::mutex error_mutex;
    std::exception_ptr error;
  } job;
  job.fn = &fn;
  job.tasks = num_tasks;
  // The whole team even for fewer tasks: a team of torch's size every time
  // (the runtime stops and starts threads when the size changes).
  openmp::parallel(
      num_threads_.load(),
      [](void* ctx, int thread_index) {
        Job& j = *static_cast<Job*>(ctx);
        const bool was_inside = t_inside_pool_task;
        t_inside_pool_task = true;
        for (;;) {
          const int64_t task = j.next.fetch_add(1, std::memory_order_relaxed);
          if (task >= j.tasks) break;
          try {
            (*j.fn)(task, thread_index);
          } catch (...) {  // nothing may leave an OpenMP region: rethrown below
            std::lock_guard<std::mutex> lock(j.error_mutex);
            if (!j.error) j.error = std::current_exception();
          }
        }
        t_inside_pool_task = was_inside;
      },
      &job);
  if (job.error) std::rethrow_exception(job.error);
}

int ThreadPool::thread_part(int thread_index) const {
  const int parts = spread_parts_.load();
  return parts <= 1 ? 0 : thread_index % parts;
}

std::vector<int> ThreadPool::threads_per_part() const {
  const int parts = std::max(1, spread_parts_.load());
  const int n = num_threads_.load();
  std::vector<int> out(static_cast<size_t>(parts), 0);
  for (int i = 0; i < n; ++i) ++out[static_cast<size_t>(thread_part(i))];
  return out;
}

void ThreadPool::repin_global_workers() {
  ThreadPool* pool = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_pool_mutex);
    pool = g_pool;
  }
  if (pool != nullptr) pool->set_num_threads(pool->num_threads());
}

void ThreadPool::run_per_part(const std::vector<int64_t>& tasks_per_part, const PartTaskFn& fn) {
  const int parts = static_cast<int>(tasks_per_part.size());
  if (parts == 0) return;
  std::unique_ptr<std::atomic<int64_t>[]> next(new std::atomic<int64_t>[parts]);
  for (int p = 0; p < parts; ++p) next[p].store(0, std::memory_order_relaxed);
  // One slot per thread; each slot drains its own part, then the others. A
  // thread that gets a second slot (or a late one) finds little or nothing left.
  // As run(): every task runs, then the first exception is rethrown.
  std::mutex error_mutex;
  std::exception_ptr first;
  run(num_threads_.load(), [&](int64_t, int thread) {
    const int own = thread_part(thread) % parts;
    for (int o = 0; o < parts; ++o) {
      const int p = (own + o) % parts;
      for (;;) {
        const int64_t task = next[p].fetch_add(1, std::memory_order_relaxed);
        if (task >= tasks_per_part[p]) break;
        try {
          fn(p, task, thread);
        } catch (...) {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (!first) first = std::current_exception();
        }
      }
    }
  });
  if (first) std::rethrow_exception(first);
}

void ThreadPool::parallel_for(int64_t num_items, int chunks_per_thread,
                              const std::function<void(int64_t, int64_t, int)>& fn) {
  if (num_items <= 0) return;
  const int64_t chunks =
      std::max<int64_t>(1, static_cast<int64_t>(chunks_per_thread) * num_threads_);
  const int64_t chunk = (num_items + chunks - 1) / chunks;
  const int64_t tasks = (num_items + chunk - 1) / chunk;
  run(tasks, [&](int64_t task, int thread) {
    const int64_t begin = task * chunk;
    fn(begin, std::min(num_items, begin + chunk), thread);
  });
}

}  // namespace kt::runtime
