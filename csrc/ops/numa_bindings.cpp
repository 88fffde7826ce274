// kt_ops._C's NUMA placement controls and reports (docs/architecture.md, "NUMA
// placement"; csrc/runtime/numa.h, csrc/moe/numa_placement.h), and the
// split_blocks test hook of kt_ops._C._testing.
#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // at::Tensor <-> torch.Tensor casters

#include <optional>
#include <string>
#include <vector>

#include "moe/moe_layer.h"
#include "moe/numa_placement.h"
#include "runtime/numa.h"
#include "runtime/thread_pool.h"
#include "runtime/topology.h"

namespace py = pybind11;

namespace kt::ops {

namespace {

py::object nodes_or_none(const std::vector<int>& nodes) {
  if (nodes.empty()) return py::none();
  return py::cast(nodes);
}

py::dict numa_report() {
  const moe::PlacementTotals totals = moe::placement_totals();
  const std::vector<int>& compute = runtime::numa_compute_nodes();
  const int parts = runtime::numa_parts();
  py::dict d;
  d["mode"] = std::string(runtime::numa_mode_name(runtime::numa_mode()));
  d["active"] = runtime::numa_active();
  d["nodes"] = std::vector<int>(compute.begin(), compute.begin() + parts);
  d["threads_per_node"] = runtime::ThreadPool::global().threads_per_part();
  d["memory_binding"] = runtime::memory_binding_supported();
  py::dict placed;
  placed["tensors"] = totals.tensors;
  placed["tensors_bound"] = totals.tensors_bound;
  placed["bytes_per_node"] = totals.bytes_per_part;
  d["placed"] = placed;
  py::dict slices;
  for (const auto& [rows, bounds] : totals.row_slices) {
    py::list ranges;
    for (size_t i = 0; i + 1 < bounds.size(); ++i)
      ranges.append(py::make_tuple(bounds[i], bounds[i + 1]));
    slices[py::int_(rows)] = ranges;
  }
  d["slices"] = slices;
  return d;
}

py::list parts_report(const std::vector<moe::PartPlacement>& parts) {
  py::list out;
  for (const moe::PartPlacement& p : parts) {
    py::dict d;
    d["node"] = p.node;
    d["rows"] = py::make_tuple(p.row_begin, p.row_end);
    d["nodeset"] = p.nodeset;
    d["bound"] = p.bound;
    d["location"] = nodes_or_none(p.location);
    d["bound_to"] = nodes_or_none(p.bound_to);
    out.append(d);
  }
  return out;
}

py::dict layer_placement(const std::vector<std::optional<at::Tensor>>& weights,
                         const std::string& weight_format, const std::vector<int64_t>& sizes,
                         const std::vector<int64_t>& group_sizes) {
  TORCH_CHECK(sizes.size() == 2,
              "kt_ops.numa_placement: sizes must be [hidden_size, intermediate_size]");
  c10::List<std::optional<at::Tensor>> list;
  for (const auto& w : weights) list.push_back(w);
  const at::Tensor x = at::empty({0, sizes[0]}, at::kFloat);
  const at::Tensor ids = at::empty({0, 1}, at::kLong);
  const at::Tensor w = at::empty({0, 1}, at::kFloat);
  const std::vector<at::Tensor> no_lora;
  // The placement depends on the weights alone: any activation will do.
  const char* act = kernels::activation_name(kernels::Activation::kSilu);
  const moe::MoeLayer layer =
      moe::parse_moe_layer("kt_ops.numa_placement", x, ids, w, list, weight_format, sizes,
                           group_sizes, no_lora, 1.0, act, std::nullopt);
  const moe::LayerPlacement placement = moe::describe_placement(layer);
  py::dict d;
  d["active"] = placement.active;
  d["parts"] = placement.parts;
  d["memory_binding"] = runtime::memory_binding_supported();
  d["gate"] = parts_report(placement.gate);
  d["up"] = parts_report(placement.up);
  d["down"] = parts_report(placement.down);
  return d;
}

}  // namespace

void register_numa(py::module& m, py::module& testing) {
  m.def("set_numa", [](const std::string& mode) {
    runtime::set_numa_mode(runtime::parse_numa_mode(mode, "kt_ops.set_numa"));
  });
  m.def("numa_mode", [] { return std::string(runtime::numa_mode_name(runtime::numa_mode())); });
  m.def("numa_report", &numa_report);
  m.def("numa_placement", &layer_placement);
  // Where the pages of a tensor's bytes are (hwloc_get_area_memlocation), and
  // the nodes its policy binds it to; None where hwloc cannot tell.
  m.def("memory_nodes", [](const at::Tensor& t) {
    return nodes_or_none(runtime::area_memory_nodes(t.data_ptr(), t.nbytes()));
  });
  m.def("bound_nodes", [](const at::Tensor& t) {
    bool is_bind = false;
    std::vector<int> nodes = runtime::area_bound_nodes(t.data_ptr(), t.nbytes(), &is_bind);
    return is_bind ? nodes_or_none(nodes) : py::none();
  });
  // Test hook (kt_ops._C._testing): the bounds of `blocks` 16-row blocks split
  // into `parts` NUMA slices (moe/numa_placement.h).
  testing.def("split_blocks", &moe::split_blocks);
}

}  // namespace kt::ops
