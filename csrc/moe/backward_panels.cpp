#include "moe/backward_panels.h"

#include <ATen/ATen.h>

#include "moe/expert_weights.h"
#include "runtime/thread_pool.h"

namespace kt::moe {

at::Tensor make_backward_panels(const Projection& p) {
  if (!bf16_vnni_panel_applies(p)) return {};
  const int64_t E = p.num_experts(), slices = p.k / 16;
  at::Tensor panels = at::empty({E, slices, 16 * p.n}, at::kBFloat16);
  auto* base = static_cast<uint16_t*>(panels.data_ptr());
  runtime::ThreadPool::global().run(E, [&](int64_t e, int) {
    for (int64_t s = 0; s < slices; ++s)
      bf16_vnni_panel(p, e, 16 * s, 16, base + (e * slices + s) * 16 * p.n);
  });
  return panels;
}

}  // namespace kt::moe
