// ATen GEMMs on the pool's threads: each pool task holds Intel MKL to one
// thread, so tasks run GEMMs side by side without oversubscription and with
// the rounding of one thread for any pool size (MKL's sgemm rounds differently
// for different thread counts; measured at m = 7 rows).
#pragma once

#include <ATen/core/LegacyTypeDispatch.h>

#include <cstdint>

#include "runtime/thread_pool.h"

// Intel MKL's per-thread thread count (the C entry point behind mkl_service.h's
// mkl_set_num_threads_local macro; the lower-case symbol is the Fortran one,
// which takes a pointer), exported by the MKL builds of libtorch (the x86-64
// torch wheels). Weak, so a build against another BLAS still loads; the
// tasks then run one after another on the calling thread.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

namespace kt::moe {

// Whether the BLAS can be held to one thread per pool thread.
inline bool blas_per_thread() { return MKL_Set_Num_Threads_Local != nullptr; }

// Holds the BLAS to one thread on the calling thread (a no-op without MKL).
class SequentialBlasGuard {
 public:
  SequentialBlasGuard() : prev_(blas_per_thread() ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~SequentialBlasGuard() {
    if (blas_per_thread()) MKL_Set_Num_Threads_Local(prev_);  // 0 = back to the global count
  }
  SequentialBlasGuard(const SequentialBlasGuard&) = delete;
  SequentialBlasGuard& operator=(const SequentialBlasGuard&) = delete;

 private:
  int prev_;
};

// fn(task, thread_index) for task in [0, n). On the pool when the BLAS can be
// held to one thread per pool thread; otherwise on the calling thread alone
// (each GEMM then uses the BLAS's own threads). Tasks call only at::mm-family
// ops and plain loops: ATen's elementwise ops would start OpenMP teams from
// pool threads.
template <class F>
void run_blas_tasks(int64_t n, const F& fn) {
  if (!blas_per_thread()) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    for (int64_t t = 0; t < n; ++t) fn(t, 0);
    return;
  }
  runtime::ThreadPool::global().run(n, [&](int64_t task, int thread) {
    SequentialBlasGuard blas;
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // temporaries need no autograd
    fn(task, thread);
  });
}

// The thread indices run_blas_tasks hands out: [0, blas_task_threads()).
inline int blas_task_threads() {
  return blas_per_thread() ? runtime::ThreadPool::global().num_threads() : 1;
}

}  // namespace kt::moe
