// Packed expert weights in transparent huge pages (2 MiB on x86-64).
//
// A decode call streams tens of MB of weights once: in 4 KiB pages that is a
// TLB miss every 4 KiB, and the hardware prefetchers stop at every page
// boundary. In 2 MiB pages bf16 T = 1 ran 2-9% faster on Zen 3, int8 5-6%
// (docs/architecture.md, "Huge pages"). The kernel backs an anonymous mapping
// with huge pages where the THP mode (/sys/kernel/mm/transparent_hugepage/
// enabled) is "always", or "madvise" and the range is advised MADV_HUGEPAGE;
// the pages must be 2 MiB-aligned. torch's allocator does neither unless
// THP_MEM_ALLOC_ENABLE=1 is set before its first allocation (process-wide), so
// kt_ops allocates the large packed tensors itself.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <string>

namespace kt::runtime {

constexpr size_t kHugePageBytes = size_t{2} << 20;

// The kernel's THP mode: "always", "madvise", "never", or "unavailable" (no
// sysfs file: not Linux, or a kernel without THP). Read once.
const std::string& thp_mode();

// Whether empty_huge_pages() uses huge pages: $KT_OPS_HUGE_PAGES ("1", the
// default, or "0"; read once; std::invalid_argument naming it otherwise) and a
// THP mode of "always" or "madvise".
bool huge_pages_enabled();

// An uninitialised contiguous CPU tensor. When huge_pages_enabled() and it
// holds at least kHugePageBytes: a mapping of its own, 2 MiB-aligned, advised
// MADV_HUGEPAGE, so its whole 2 MiB are huge pages once touched (a last partial
// 2 MiB stays in base pages); else at::empty. std::bad_alloc when the memory
// is not there.
at::Tensor empty_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype);

}  // namespace kt::runtime
