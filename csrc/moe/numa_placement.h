// NUMA placement of an MoE layer (README, "NUMA"): with placement on
// (runtime/numa.h) and P parts (the NUMA nodes that have cores), every
// expert is split by 16-row output blocks into P contiguous slices:
//   gate/up: rows [I_p0, I_p1) of I  (phase 2 writes h[:, I_p0:I_p1]),
//   down:    rows [H_p0, H_p1) of H  (phase 3 reads all of h, writes y[:, H_p0:H_p1]).
// Part p's rows of every expert are bound to node numa_compute_nodes()[p]
// in place (the packed tensors' own pages, no copy) and computed by the pool
// threads of that node. Every output value is still one kernel call over the
// whole K, so results are bit-identical to one node; there are no partial
// sums to reduce (the top-k combine is the one reduction, as on one node).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "moe/moe_layer.h"

namespace kt::moe {

// How one projection's 16-row blocks are split across the placement parts.
struct BlockSplit {
  int64_t blocks = 0;           // 16-row blocks per expert
  std::vector<int64_t> bounds;  // empty: one part; else parts + 1 ascending boundaries
  int parts() const { return bounds.empty() ? 1 : static_cast<int>(bounds.size()) - 1; }
};

struct NumaSplit {
  BlockSplit gate_up;  // 16-row blocks of I (gate and up)
  BlockSplit down;     // 16-row blocks of H
};

// [0, blocks) in `parts` contiguous ranges whose sizes differ by at most one
// block (the first ones take the extra): parts + 1 boundaries.
std::vector<int64_t> split_blocks(int64_t blocks, int parts);

// The split for a call on `layer`. With placement off (or one part and mode
// auto) it is one part and costs nothing. With placement on, it first makes
// sure each packed tensor of the layer (weights, and the qint scales / zero
// points, laid out per row block too) has its parts bound to their nodes:
// once per tensor storage (a cache keyed by data pointer, checked against a
// weak reference to the storage, so a freed and reallocated tensor is placed
// again; writes into a tensor keep its pages where they are).
NumaSplit numa_split(const MoeLayer& layer);

// What kt_ops.numa_placement() reports for one layer: per projection, per
// part, its node, rows, requested nodeset (OS indices), whether the OS bound
// it, and where hwloc finds its pages (empty: hwloc cannot tell).
struct PartPlacement {
  int node = 0;
  int64_t row_begin = 0, row_end = 0;
  std::vector<int> nodeset;
  bool bound = false;
  std::vector<int> location;  // hwloc_get_area_memlocation
  std::vector<int> bound_to;  // hwloc_get_area_membind (policy BIND)
};
struct LayerPlacement {
  bool active = false;
  int parts = 1;
  std::vector<PartPlacement> gate, up, down;
};
LayerPlacement describe_placement(const MoeLayer& layer);

// Placed tensors still alive, and the bytes requested per part.
struct PlacementTotals {
  int64_t tensors = 0;
  int64_t tensors_bound = 0;  // those the OS bound
  std::vector<int64_t> bytes_per_part;
  std::vector<std::pair<int64_t, std::vector<int64_t>>> row_slices;  // (rows, row bounds)
};
PlacementTotals placement_totals();

}  // namespace kt::moe
