// The process-wide thread pool: one worker per physical core (hwloc), bound,
// created once and reused by every op call.
//
// The calling thread does its share of each job, so a pool of N threads runs
// N-1 workers. Tasks are handed out through one atomic counter (dynamic
// scheduling); kernels never spawn threads and never see the pool (style
// rule 11): they get a task index. Idle workers spin for a few microseconds
// (so the phases of one op call follow each other without a futex round
// trip) and then park on a condition variable: no core burns while another
// thread computes something else. Where torch's OpenMP team has the pool's
// size, run() hands the job to that team instead (ParallelBackend below,
// runtime/openmp_team.h): same tasks, same counter, other threads.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kt::runtime {

// Poll number `poll` of a spin-wait (every spin-wait of the pool and of
// chained_parallel_for): the x86 PAUSE hint (yields to a sibling
// hyperthread, saves power, avoids the memory-order flush on exit), and
// every 64 polls (a microsecond or two) a yield of the core. The yield is for
// a thread that waits for one sharing its core (more runnable threads than
// cores, e.g. right after a torch op whose OpenMP workers spin on): the other
// thread runs instead of the waiter spinning out its time slice. Measured on
// the 2-core VM: a cold T = 1 call right after a 2-thread torch op took
// 1.2 ms without it (the worker woken by prewake spun on the caller's core
// while the caller was descheduled) and 0.13-0.22 ms with it; with OpenMP
// parked, T = 1 was 1.03-1.07x faster and T = 8 unchanged. With nothing else
// runnable the yield returns at once.
inline void spin_pause(uint64_t poll) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
  if ((poll & 63) == 63) std::this_thread::yield();
}

// Which threads run a job (kt_ops.set_parallel_backend):
// - kPool: the pool's own workers, bound one per physical core (hwloc).
// - kOpenMP: the threads of torch's OpenMP runtime (runtime/openmp_team.h),
//   where torch has one and NUMA placement has one part; the pool's workers
//   otherwise.
// - kAuto: kOpenMP where, in addition, the pool's size equals the calling
//   thread's OpenMP team size (torch's intra-op thread count), so that torch's
//   regions and kt_ops' alternate on one team of one size (a team of another
//   size would make the runtime stop and start threads at every switch);
//   kPool otherwise.
// Never OpenMP in a process forked after the parent's OpenMP threads started
// (they do not survive fork(); the runtime then waits for them forever), or
// inside an OpenMP parallel region.
enum class ParallelBackend { kAuto, kPool, kOpenMP };

namespace detail {
// The role of an OS PU for the pool's calling thread: a worker is bound to
// its core, it is the caller's home (a PU no worker holds; under NUMA
// placement only those on the node of the part the caller computes), or other.
enum PuRole : uint8_t { kOtherPu = 0, kWorkerPu = 1, kHomePu = 2 };
// Where a calling thread on PU `cpu` with affinity `mask` (OS PU indices)
// runs its share of a pool job: empty to stay where it is (it is home, or
// cannot leave a worker's PU), else the PUs to move to: its home PUs within
// its mask, or, without any, its mask minus the workers' PUs when it sits on
// a worker's PU. `pu_role[pu]` is a PuRole (PUs past its end are other).
std::vector<int> caller_target(int cpu, const std::vector<int>& mask,
                               const std::vector<uint8_t>& pu_role);
}  // namespace detail

// "auto" / "pool" / "openmp"; parse throws std::invalid_argument naming the valid values.
const char* parallel_backend_name(ParallelBackend b);
ParallelBackend parse_parallel_backend(const std::string& name);

// For its lifetime, 'auto' keeps the pool's own threads on this thread. For
// threads on which torch's CPU ops do not run, such as the CUDA bridge's host
// callbacks (hybrid/bridge.cpp): there an OpenMP region would start a team of
// that thread's own, next to torch's, whose threads spin for milliseconds
// after every call while the Python thread launches GPU work.
class PoolThreadsScope {
 public:
  PoolThreadsScope();
  ~PoolThreadsScope();
  PoolThreadsScope(const PoolThreadsScope&) = delete;
  PoolThreadsScope& operator=(const PoolThreadsScope&) = delete;
};

// For its lifetime, a pool job started on this thread runs on the workers
// alone: this thread hands out the tasks and blocks (no spin) until they are
// done. For the CUDA bridge's host callbacks (hybrid/bridge.cpp): while the
// CPU experts run there, another thread drives the GPU (the caller of the op
// launching the next kernels, or spinning in a stream synchronize). With the
// pool sized to the cores, a computing callback thread made one busy thread
// more than cores, and a job waited for a descheduled thread's time slice:
// every bridged call took at least 4 ms on a 16-core H100 host, against
// 0.4-0.9 ms for the same call on CPU tensors (scripts/gpu_check.sh,
// README "CPU/GPU hybrid"). Without workers (one thread) jobs still run inline.
class CallerWaitsScope {
 public:
  explicit CallerWaitsScope(bool active = true);
  ~CallerWaitsScope();
  CallerWaitsScope(const CallerWaitsScope&) = delete;
  CallerWaitsScope& operator=(const CallerWaitsScope&) = delete;

 private:
  bool active_;
};

class ThreadPool {
 public:
  // fn(task_index, thread_index); thread_index is in [0, num_threads()).
  using TaskFn = std::function<void(int64_t, int)>;

  // The global pool; sized to the number of physical cores unless
  // $KT_OPS_NUM_THREADS or set_num_threads() says otherwise.
  // Throws std::invalid_argument for a malformed $KT_OPS_NUM_THREADS.
  static ThreadPool& global();
  // Sizes the global pool to n threads, creating it if needed. Throws
  // std::invalid_argument when n is outside [1, max_threads()] and
  // std::runtime_error when the OS refuses a worker thread (the pool then keeps
  // its previous size, or one thread).
  static void set_global_num_threads(int n);
  // The largest pool: kMaxThreadsPerCore x the physical cores (hwloc), at least
  // kMinMaxThreads. More threads than that only oversubscribe the cores; a huge
  // count exhausts the OS's threads and makes every op call crawl.
  static int max_threads();
  static constexpr int kMaxThreadsPerCore = 4;
  static constexpr int kMinMaxThreads = 64;

  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_.load(); }
  // Joins the current workers and starts n-1 new ones. Not to be called
  // while a job runs (it waits for it). When a thread cannot be created the
  // pool goes back to its previous size (or to one thread if even that fails)
  // and std::runtime_error is thrown: num_threads() always matches the workers.
  void set_num_threads(int n);
  // Whether worker threads could be bound to cores (false for synthetic topologies).
  bool workers_bound() const { return workers_bound_.load(); }

  // The process-wide parallel backend (initially $KT_OPS_PARALLEL_BACKEND,
  // else kAuto). Setting kOpenMP throws std::invalid_argument when torch's
  // OpenMP runtime is not available (the reason is in the message).
  static void set_parallel_backend(ParallelBackend backend);
  static ParallelBackend parallel_backend();
  // Whether a job that the calling thread starts now runs on torch's OpenMP
  // threads; `why` (if given) receives the reason in a few words.
  bool uses_openmp(std::string* why = nullptr) const;
  // Jobs run so far on torch's OpenMP threads and on the pool's (inline runs
  // not counted), process-wide.
  static uint64_t openmp_jobs();
  static uint64_t pool_jobs();
  // Pool jobs whose calling thread was moved to its home PUs for the job
  // (see run()), process-wide.
  static uint64_t caller_moves();

  // NUMA placement (runtime/numa.h). With runtime::numa_parts() > 1 the
  // threads are spread over the NUMA nodes that have cores, round robin:
  // thread i computes for part i % P (node numa_part_nodes()[i % P]) and
  // worker i is bound to core (i / P) of that node. Otherwise worker i takes
  // core i as before (the caller, thread 0, keeps its own core and counts as
  // the first node's). The part thread `thread_index` computes for, and the
  // threads per part of this pool (one entry when not spread).
  int thread_part(int thread_index) const;
  std::vector<int> threads_per_part() const;
  // Restarts the global pool's workers (if it exists) so that their binding
  // follows the current NUMA mode; runtime::set_numa_mode calls it.
  static void repin_global_workers();

  // Runs tasks_per_part[p] tasks for each placement part p:
  // fn(part, task, thread_index). A thread first takes the tasks of its own
  // part (thread_part), then helps the other parts in order (p+1, p+2, ...),
  // so every task runs even when a part has no thread of its own (fewer
  // threads than nodes). Tasks of one part are handed out dynamically, as run().
  using PartTaskFn = std::function<void(int, int64_t, int)>;
  void run_per_part(const std::vector<int64_t>& tasks_per_part, const PartTaskFn& fn);

  // Runs fn for every task in [0, num_tasks) and returns when all are done.
  // Exceptions thrown by fn are rethrown here (the first one). Calls from
  // inside a task, or with fewer than two tasks, run inline on this thread.
  // On the pool, with bound workers, a calling thread that the OS has put on
  // a worker's core (where it would keep that worker from running until the
  // scheduler preempts it), or under NUMA placement on another node than the
  // part it computes, is moved to its home PUs for the job
  // (detail::caller_target) and its affinity mask restored afterwards.
  void run(int64_t num_tasks, const TaskFn& fn);

  // Wakes parked workers so that they spin (up to 1 ms) for a job that
  // follows shortly. An op calls it on entry, before its kernels' first
  // parallel phase: the futex wake-up of the workers then overlaps the op's
  // single-threaded argument checks and routing instead of delaying that
  // phase. Not for calls that run ATen ops first (the spinning workers would
  // take cores from torch's own threads).
  void prewake();

  // The one partition helper (style rule 11): splits [0, num_items) into
  // about chunks_per_thread * num_threads() runs of consecutive items, handed
  // out dynamically, and calls fn(begin, end, thread_index) for each
  // (thread_index as run()'s: per-thread state of the job can be indexed by
  // it). Consecutive items are adjacent weight blocks, so each thread streams
  // long runs of memory (what the hardware prefetchers want) while late
  // chunks still balance the load.
  void parallel_for(int64_t num_items, int chunks_per_thread,
                    const std::function<void(int64_t, int64_t, int)>& fn);

 private:
  void start_workers();  // throws std::runtime_error (no workers left) on failure
  void stop_workers();
  void worker_loop(int thread_index, uint64_t seen_generation);
  void do_tasks(int thread_index);
  // run() on a team of torch's OpenMP threads (the same contract).
  void run_on_openmp(int64_t num_tasks, const TaskFn& fn);

  std::atomic<int> num_threads_{1};  // read without run_mutex_ by prewake()
  std::atomic<bool> workers_bound_{false};
  std::atomic<int> spread_parts_{1};  // parts the workers were spread over at their start
  // workers_ changes only under run_mutex_ (set_num_threads); run() reads its
  // size under that lock. num_workers_ mirrors it for the lock-free check of a
  // pool without workers (re-checked under the lock).
  std::vector<std::thread> workers_;
  std::atomic<int> num_workers_{0};
  std::atomic<int> started_workers_{0};
  std::atomic<int> bound_workers_{0};
  // pu_role_[pu]: the detail::PuRole of OS PU index `pu` for the calling
  // thread's placement (empty unless every worker is bound). Changes only
  // with workers_ (under run_mutex_).
  std::vector<uint8_t> pu_role_;

  std::mutex run_mutex_;  // one job at a time across calling threads
  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::atomic<uint64_t> generation_{0};
  bool stop_ = false;

  uint64_t wake_calls_ = 0;  // guarded by mutex_
  const TaskFn* job_ = nullptr;
  int64_t job_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
  std::atomic<int> busy_workers_{0};
  std::exception_ptr error_;
};

}  // namespace kt::runtime
