#include "moe/backward_panels.h"

#include <ATen/ATen.h>

#include "moe/expert_weights.h"
#include "runtime/huge_pages.h"
#include "runtime/thread_pool.h"

namespace kt::moe {

at::Tensor make_backward_panels(const Projection& p, int64_t width) {
  TORCH_CHECK(width == 0 || width == kPanelWidthKt || width == kPanelWidthOnednn,
              "make_backward_panels: width must be 16 or 64 (0: the kernel's), got ", width);
  if (!bf16_vnni_panel_applies(p)) return {};
  if (width == 0) width = backward_on_kt_kernel() ? kPanelWidthKt : kPanelWidthOnednn;
  if (p.k % width != 0) width = kPanelWidthKt;  // k is a multiple of 16 (the format check)
  const int64_t E = p.num_experts(), panels_per_expert = p.k / width;
  // Streamed by every backward as the weights are by a decode: in huge pages as they are.
  at::Tensor panels = runtime::empty_huge_pages({E, panels_per_expert, width * p.n}, at::kBFloat16);
  auto* base = static_cast<uint16_t*>(panels.data_ptr());
  runtime::ThreadPool::global().run(E, [&](int64_t e, int) {
    for (int64_t k0 = 0; k0 < p.k; k0 += width)
      bf16_vnni_panel(p, e, k0, width, base + (e * p.k + k0) * p.n);
  });
  return panels;
}

}  // namespace kt::moe
