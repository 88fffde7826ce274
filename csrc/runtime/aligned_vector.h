// std::vector whose storage starts on a cache line.
//
// glibc's malloc returns 16-byte-aligned blocks (large ones sit 16 bytes into a
// page), so a std::vector<float> of rows read by 32-byte vector loads had every
// other load split across two cache lines whenever its base fell at 16 mod 32:
// kt_ops' AVX2 NT tiles (kernels/avx2/gemm_nt_avx2.cpp) ran at 47-62 GFLOP/s on
// such buffers and 76-83 on aligned ones (one Zen 3 core, m = 32-512, k = 768),
// and which one a run got depended on the heap. Scratch that kernels read as
// vectors uses this type.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace kt::runtime {

constexpr std::size_t kCacheLineBytes = 64;

template <class T>
struct CacheLineAllocator {
  using value_type = T;

  CacheLineAllocator() = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}  // NOLINT: rebinding must be implicit

  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kCacheLineBytes}));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{kCacheLineBytes}); }

  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const {
    return true;
  }
  template <class U>
  bool operator!=(const CacheLineAllocator<U>&) const {
    return false;
  }
};

template <class T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

}  // namespace kt::runtime
