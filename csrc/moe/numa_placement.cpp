#include "moe/numa_placement.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <utility>

#include "formats/qint.h"
#include "runtime/numa.h"
#include "runtime/topology.h"

namespace kt::moe {

namespace {

using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

// One packed tensor laid out [E, row_blocks, ...]: what is placed.
struct RowTensor {
  const at::Tensor* tensor;
  int64_t rows;  // dense output rows (n) of the projection, for reports
};

// A placed tensor. Valid while its storage is alive and the split is the same.
struct Placed {
  std::optional<WeakStorage> storage;  // always set (weak_intrusive_ptr has no empty state)
  size_t nbytes = 0;
  int64_t rows = 0;
  std::vector<int64_t> bounds;  // in row blocks
  std::vector<int> nodes;       // node of each part
  bool bound = false;           // the OS bound every range
  std::vector<int64_t> bytes_per_part;
};

std::mutex g_mutex;
std::unordered_map<const void*, Placed> g_placed;

WeakStorage weak_storage(const at::Tensor& t) {
  return WeakStorage(
      c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(t.storage().unsafeGetStorageImpl()));
}

bool alive_and_same(const Placed& p, const at::Tensor& t) {
  const c10::intrusive_ptr<c10::StorageImpl> s = p.storage->lock();
  return s && s.get() == t.storage().unsafeGetStorageImpl();
}

// Bytes per row block of a [E, row_blocks, ...] tensor.
int64_t block_stride(const at::Tensor& t) {
  return static_cast<int64_t>(t.nbytes()) / (t.size(0) * t.size(1));
}

// Byte ranges of part p (row blocks [b0, b1) of every expert), adjacent
// ranges merged (one range for the whole tensor when there is one part).
std::vector<std::pair<int64_t, int64_t>> part_ranges(const at::Tensor& t, int64_t b0, int64_t b1) {
  std::vector<std::pair<int64_t, int64_t>> out;
  if (b1 <= b0) return out;
  const int64_t E = t.size(0), rb = t.size(1), stride = block_stride(t);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = (e * rb + b0) * stride, end = (e * rb + b1) * stride;
    if (!out.empty() && out.back().second == begin)
      out.back().second = end;
    else
      out.emplace_back(begin, end);
  }
  return out;
}

bool placeable(const at::Tensor& t, int64_t E, int64_t row_blocks) {
  return t.defined() && t.dim() >= 2 && t.size(0) == E && t.size(1) == row_blocks &&
         t.is_contiguous() && t.nbytes() > 0;
}

// The packed tensors of a projection that are laid out per row block: the
// weight in every layout, the scales and zero points of the qint layout and the
// row scales of fp8_channel / mxfp8 (fp8's 128x128 block scales are not: a few
// KiB, left where they are).
std::vector<const at::Tensor*> row_tensors(const Projection& p) {
  std::vector<const at::Tensor*> out{&p.weight};
  if (p.view.layout == formats::Layout::kQint) {
    out.push_back(&p.scales);
    out.push_back(&p.zeros);
  } else if (p.view.fp8_row_scales) {
    out.push_back(&p.scales);
  }
  return out;
}

// Binds part p of `t` to nodes[p] unless the cache says it already is (g_mutex held).
void place_locked(const at::Tensor& t, int64_t rows, const std::vector<int64_t>& bounds,
                  const std::vector<int>& nodes) {
  const void* key = t.data_ptr();
  auto it = g_placed.find(key);
  if (it != g_placed.end() && it->second.nbytes == t.nbytes() && it->second.bounds == bounds &&
      it->second.nodes == nodes && alive_and_same(it->second, t))
    return;
  // A new tensor: drop the entries of freed storages first (they hold only
  // the StorageImpl object alive, never its memory).
  for (auto e = g_placed.begin(); e != g_placed.end();)
    e = e->second.storage->expired() ? g_placed.erase(e) : std::next(e);
  Placed placed;
  placed.storage = weak_storage(t);
  placed.nbytes = t.nbytes();
  placed.rows = rows;
  placed.bounds = bounds;
  placed.nodes = nodes;
  placed.bound = runtime::memory_binding_supported();
  const auto* base = static_cast<const uint8_t*>(t.data_ptr());
  for (size_t p = 0; p + 1 < bounds.size(); ++p) {
    int64_t bytes = 0;
    for (const auto& [b, e] : part_ranges(t, bounds[p], bounds[p + 1])) {
      bytes += e - b;
      if (placed.bound)
        placed.bound = runtime::bind_area_to_node(base + b, static_cast<size_t>(e - b), nodes[p]);
    }
    placed.bytes_per_part.push_back(bytes);
  }
  g_placed.insert_or_assign(key, std::move(placed));
}

std::vector<int> part_nodes(int parts) {
  const std::vector<int>& compute = runtime::numa_compute_nodes();
  return std::vector<int>(compute.begin(), compute.begin() + parts);
}

}  // namespace

std::vector<int64_t> split_blocks(int64_t blocks, int parts) {
  std::vector<int64_t> bounds(static_cast<size_t>(parts) + 1, 0);
  const int64_t base = blocks / parts, extra = blocks % parts;
  for (int p = 0; p < parts; ++p) bounds[p + 1] = bounds[p] + base + (p < extra ? 1 : 0);
  return bounds;
}

NumaSplit numa_split(const MoeLayer& layer) {
  NumaSplit split;
  split.gate_up.blocks = layer.gate.view.row_blocks;
  split.down.blocks = layer.down.view.row_blocks;
  if (!runtime::numa_active()) return split;
  const int parts = runtime::numa_parts();
  const std::vector<int> nodes = part_nodes(parts);
  const std::vector<int64_t> gu = split_blocks(split.gate_up.blocks, parts);
  const std::vector<int64_t> dn = split_blocks(split.down.blocks, parts);
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    const int64_t E = layer.num_experts;
    for (const Projection* p : {&layer.gate, &layer.up, &layer.down}) {
      const std::vector<int64_t>& bounds = p == &layer.down ? dn : gu;
      for (const at::Tensor* t : row_tensors(*p))
        if (placeable(*t, E, p->view.row_blocks)) place_locked(*t, p->n, bounds, nodes);
    }
  }
  if (parts > 1) {
    split.gate_up.bounds = gu;
    split.down.bounds = dn;
  }
  return split;
}

LayerPlacement describe_placement(const MoeLayer& layer) {
  numa_split(layer);  // places the layer when placement is on
  LayerPlacement out;
  out.active = runtime::numa_active();
  out.parts = runtime::numa_parts();
  const std::vector<int> nodes = part_nodes(out.parts);
  const auto describe = [&](const Projection& p, std::vector<PartPlacement>& dst) {
    const std::vector<int64_t> bounds = split_blocks(p.view.row_blocks, out.parts);
    const at::Tensor& w = p.weight;
    bool bound = false;
    if (out.active) {
      std::lock_guard<std::mutex> lock(g_mutex);
      const auto it = g_placed.find(w.data_ptr());
      bound = it != g_placed.end() && it->second.bound;
    }
    const auto* base = static_cast<const uint8_t*>(w.data_ptr());
    for (int part = 0; part < out.parts; ++part) {
      PartPlacement pp;
      pp.node = nodes[part];
      pp.row_begin = std::min(bounds[part] * formats::kQintBlockRows, p.n);
      pp.row_end = std::min(bounds[part + 1] * formats::kQintBlockRows, p.n);
      pp.nodeset = runtime::node_os_indices(pp.node);
      pp.bound = bound;
      std::vector<int> loc, to;
      for (const auto& [b, e] : part_ranges(w, bounds[part], bounds[part + 1])) {
        for (int n : runtime::area_memory_nodes(base + b, static_cast<size_t>(e - b)))
          loc.push_back(n);
        bool is_bind = false;
        for (int n : runtime::area_bound_nodes(base + b, static_cast<size_t>(e - b), &is_bind))
          if (is_bind) to.push_back(n);
      }
      std::sort(loc.begin(), loc.end());
      loc.erase(std::unique(loc.begin(), loc.end()), loc.end());
      std::sort(to.begin(), to.end());
      to.erase(std::unique(to.begin(), to.end()), to.end());
      pp.location = loc;
      pp.bound_to = to;
      dst.push_back(std::move(pp));
    }
  };
  describe(layer.gate, out.gate);
  describe(layer.up, out.up);
  describe(layer.down, out.down);
  return out;
}

PlacementTotals placement_totals() {
  PlacementTotals out;
  std::map<int64_t, std::vector<int64_t>> slices;
  std::lock_guard<std::mutex> lock(g_mutex);
  for (const auto& [key, p] : g_placed) {
    if (p.storage->expired()) continue;
    ++out.tensors;
    if (p.bound) ++out.tensors_bound;
    if (out.bytes_per_part.size() < p.bytes_per_part.size())
      out.bytes_per_part.resize(p.bytes_per_part.size(), 0);
    for (size_t i = 0; i < p.bytes_per_part.size(); ++i)
      out.bytes_per_part[i] += p.bytes_per_part[i];
    std::vector<int64_t> rows;
    for (int64_t b : p.bounds) rows.push_back(std::min(b * formats::kQintBlockRows, p.rows));
    slices[p.rows] = rows;
  }
  out.row_slices.assign(slices.begin(), slices.end());
  return out;
}

}  // namespace kt::moe
