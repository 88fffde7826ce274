#include "runtime/openmp_team.h"

#include <dlfcn.h>

namespace kt::runtime::openmp {

namespace {

// The GNU OpenMP ABI (libgomp's GOMP_4.0 symbol set) and the OpenMP API
// calls used here.
using GompParallelFn = void (*)(void (*fn)(void*), void* data, unsigned num_threads,
                                unsigned flags);
using IntFn = int (*)();

struct Runtime {
  GompParallelFn gomp_parallel = nullptr;
  IntFn get_thread_num = nullptr;
  IntFn get_max_threads = nullptr;
  IntFn in_parallel = nullptr;
  std::string library;
  bool ok() const {
    return gomp_parallel != nullptr && get_thread_num != nullptr && get_max_threads != nullptr &&
           in_parallel != nullptr;
  }
};

const Runtime& runtime() {
  static const Runtime rt = [] {
    Runtime r;
    // Only a libtorch_cpu that is already loaded (RTLD_NOLOAD): dlsym through
    // its handle searches it and its dependencies, i.e. finds the OpenMP
    // runtime torch's own parallel regions use.
    void* torch_cpu = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
    if (torch_cpu == nullptr) return r;
    r.gomp_parallel = reinterpret_cast<GompParallelFn>(dlsym(torch_cpu, "GOMP_parallel"));
    r.get_thread_num = reinterpret_cast<IntFn>(dlsym(torch_cpu, "omp_get_thread_num"));
    r.get_max_threads = reinterpret_cast<IntFn>(dlsym(torch_cpu, "omp_get_max_threads"));
    r.in_parallel = reinterpret_cast<IntFn>(dlsym(torch_cpu, "omp_in_parallel"));
    Dl_info info{};
    if (r.ok() && dladdr(reinterpret_cast<void*>(r.gomp_parallel), &info) != 0 &&
        info.dli_fname != nullptr)
      r.library = info.dli_fname;
    // The handle stays open: libtorch_cpu outlives every call anyway.
    return r;
  }();
  return rt;
}

struct Job {
  void (*body)(void*, int);
  void* ctx;
  IntFn get_thread_num;
};

void team_entry(void* data) {
  const Job* job = static_cast<const Job*>(data);
  job->body(job->ctx, job->get_thread_num());
}

}  // namespace

bool available() { return runtime().ok(); }

std::string runtime_library() { return runtime().library; }

int max_threads() { return available() ? runtime().get_max_threads() : 0; }

bool in_parallel() { return available() && runtime().in_parallel() != 0; }

void parallel(int threads, void (*body)(void*, int), void* ctx) {
  const Runtime& rt = runtime();
  Job job{body, ctx, rt.get_thread_num};
  rt.gomp_parallel(&team_entry, &job, static_cast<unsigned>(threads), 0);
}

}  // namespace kt::runtime::openmp
