#include "runtime/cpu_features.h"

namespace kt::runtime {

namespace {

CpuFeatures detect() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  // GCC/Clang's __builtin_cpu_supports checks both CPUID and the OS-enabled
  // XSAVE state, so a path it reports is safe to execute.
  __builtin_cpu_init();
  f.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  f.avx512_vnni = f.avx512 && __builtin_cpu_supports("avx512vnni");
  f.avx512_vbmi = f.avx512 && __builtin_cpu_supports("avx512vbmi");
  f.intel = __builtin_cpu_is("intel");
#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
    (defined(__clang__) && __clang_major__ >= 12)
  f.avx512_bf16 = f.avx512 && __builtin_cpu_supports("avx512bf16");
#endif
#if (defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
    (defined(__clang__) && __clang_major__ >= 12)
  f.amx = __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
          __builtin_cpu_supports("amx-int8");
#endif
#endif  // x86
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace kt::runtime
