#include "runtime/huge_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <new>
#include <stdexcept>

namespace kt::runtime {

const std::string& thp_mode() {
  static const std::string mode = [] {
    std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
    std::string line;
    if (!f || !std::getline(f, line)) return std::string("unavailable");
    // "always [madvise] never": the bracketed word is the mode.
    const size_t open = line.find('['), close = line.find(']');
    if (open == std::string::npos || close == std::string::npos || close < open)
      return std::string("unavailable");
    return line.substr(open + 1, close - open - 1);
  }();
  return mode;
}

bool huge_pages_enabled() {
  static const bool enabled = [] {
    const char* env = std::getenv("KT_OPS_HUGE_PAGES");
    bool want = true;
    if (env != nullptr && env[0] != '\0') {
      const std::string v(env);
      if (v != "0" && v != "1")
        throw std::invalid_argument("KT_OPS_HUGE_PAGES='" + v +
                                    "' must be 1 (packed weights in 2 MiB pages, the default) "
                                    "or 0 (torch's allocator)");
      want = v == "1";
    }
    return want && (thp_mode() == "always" || thp_mode() == "madvise");
  }();
  return enabled;
}

at::Tensor empty_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype) {
  const at::TensorOptions options = at::TensorOptions().dtype(dtype).device(at::kCPU);
  int64_t numel = 1;
  for (int64_t s : sizes) {
    TORCH_CHECK_VALUE(s >= 0, "empty_huge_pages: negative size ", s);
    numel *= s;
  }
  const size_t nbytes = static_cast<size_t>(numel) * at::elementSize(dtype);
  if (nbytes < kHugePageBytes || !huge_pages_enabled()) return at::empty(sizes, options);
  // Whole base pages, not whole huge pages: the part of the last 2 MiB the
  // tensor does not fill stays in base pages (a huge page there would commit
  // up to 2 MiB more per tensor).
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = (nbytes + page - 1) / page * page;
  // A fresh mapping, not malloc: memory malloc reuses has its 4 KiB pages
  // already, and advice does not change pages that exist. One huge page more
  // is mapped, and the unaligned head and tail are unmapped again.
  void* raw = mmap(nullptr, bytes + kHugePageBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (begin + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (aligned > begin) munmap(raw, aligned - begin);
  const size_t tail = begin + bytes + kHugePageBytes - (aligned + bytes);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + bytes), tail);
  void* p = reinterpret_cast<void*>(aligned);
  // Advice, not a requirement: where the kernel refuses it the memory is
  // ordinary pages and everything else is the same.
  (void)madvise(p, bytes, MADV_HUGEPAGE);
  return at::from_blob(p, sizes, [bytes](void* q) { munmap(q, bytes); }, options);
}

}  // namespace kt::runtime
