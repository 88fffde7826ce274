// torch's own OpenMP threads as a source of worker threads (ThreadPool's
// 'openmp' parallel backend, runtime/thread_pool.h).
//
// Why: torch's CPU ops run on an OpenMP team whose idle threads spin for
// milliseconds after each parallel region (libgomp's default wait policy).
// A kt_ops call that follows a torch op on the pool's own threads shares
// every core with one of those spinning threads; on the 2-core host the
// Hugging Face demo's decode experts took 8.0-8.5 ms per token that way and
// 4.1-4.9 ms on torch's OpenMP threads (which take the job at once instead).
//
// The entry points are looked up at run time in the OpenMP runtime that
// libtorch_cpu itself is linked against (dlsym through its handle), never
// linked: a torch wheel bundles its own libgomp (older wheels under a hashed
// name, libgomp-<hash>.so.1), and linking the system's copy would start a
// second OpenMP runtime with its own threads, the opposite of the point.
// GOMP_parallel is the GNU OpenMP ABI that `#pragma omp parallel` compiles
// to; LLVM's and Intel's runtimes export it too. Without libtorch_cpu in the
// process (the standalone thread-pool stress test) or without an OpenMP
// runtime behind it, available() is false and the pool keeps its own threads.
#pragma once

#include <string>

namespace kt::runtime::openmp {

// Whether torch's OpenMP runtime was found (resolved once, on first use).
bool available();

// The file of that runtime (dladdr of its GOMP_parallel), or "" when unavailable.
std::string runtime_library();

// The calling thread's omp_get_max_threads(): the team size of torch's next
// parallel region on this thread. 0 when unavailable.
int max_threads();

// Whether the calling thread runs inside an OpenMP parallel region.
bool in_parallel();

// Runs body(ctx, thread_index) on every thread of a team of `threads`
// threads of torch's OpenMP runtime (the caller is thread 0) and returns when
// all are done. body must not throw (the OpenMP runtime cannot carry an
// exception across threads): callers catch inside it. Requires available().
void parallel(int threads, void (*body)(void* ctx, int thread_index), void* ctx);

}  // namespace kt::runtime::openmp
