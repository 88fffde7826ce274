// kt_ops._C's huge-page allocation of packed weights (csrc/runtime/huge_pages.h).
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor casters

#include <string>

#include "runtime/huge_pages.h"

namespace py = pybind11;

namespace kt::ops {

void register_memory(py::module& m) {
  // A uint8 tensor of nbytes, in huge pages where runtime::empty_huge_pages puts it
  // (kt_ops.formats.packed views it as the packed tensor's dtype and shape).
  m.def("empty_huge_pages", [](int64_t nbytes) {
    if (nbytes < 0) throw std::invalid_argument("empty_huge_pages: nbytes must be >= 0");
    return runtime::empty_huge_pages({nbytes}, at::kByte);
  });
  m.def("huge_pages", [] {
    py::dict d;
    d["thp_mode"] = runtime::thp_mode();
    d["enabled"] = runtime::huge_pages_enabled();
    d["page_bytes"] = runtime::kHugePageBytes;
    return d;
  });
}

}  // namespace kt::ops
