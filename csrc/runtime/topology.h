// Machine topology from hwloc: physical cores grouped per NUMA node.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace kt::runtime {

struct Core {
  int os_index = -1;     // hwloc logical index of the core
  int numa_node = 0;     // logical index of the NUMA node holding it
  std::vector<int> pus;  // OS indices of its hardware threads (for binding)
};

struct Topology {
  std::vector<Core> cores;  // physical cores, ordered by NUMA node then core
  int num_numa_nodes = 1;
  int num_pus = 0;
  std::string source;  // "this machine" or the synthetic description
  // The process's share of the host's cores (CoreShare below): `cores` holds part
  // `share_index` of `share_count` contiguous parts of the host's `host_cores`.
  int host_cores = 0;
  int share_index = 0;
  int share_count = 1;
  std::string share_source;  // "LOCAL_RANK/LOCAL_WORLD_SIZE", "KT_OPS_CORE_SHARE", "none"
};

// Several processes of one job on a host (torchrun / accelerate data-parallel ranks)
// split its cores instead of each binding a full pool to all of them. The share is
// read once, when the topology is first built:
//   $KT_OPS_CORE_SHARE = "off"  the whole host (one process per host);
//                      = "i/n"  part i of n;
//   unset or "auto"             part $LOCAL_RANK of $LOCAL_WORLD_SIZE when both are set
//                               (torchrun, accelerate, torch.distributed.launch), else off.
// Part i of n holds cores [i*C/n, (i+1)*C/n) of the C cores, in NUMA-node order, so a
// rank stays on as few nodes as it can; with fewer cores than ranks, rank i gets core
// i mod C. Throws std::invalid_argument for a malformed $KT_OPS_CORE_SHARE, and for
// $LOCAL_RANK / $LOCAL_WORLD_SIZE that are both set but not 0 <= rank < size (each rank
// would otherwise take the whole host).

// The process-wide topology. The synthetic description in $KT_OPS_HWLOC_SYNTHETIC
// (hwloc's syntax, e.g. "node:2 core:4 pu:1") replaces the real machine; tests
// use it to exercise multi-node partitioning on a one-node machine.
const Topology& topology();

// Binds the calling thread to the hardware threads of `core`. Returns false
// (and leaves the thread unbound) when hwloc cannot bind, e.g. for a synthetic
// topology or inside a restricted container.
bool bind_current_thread(const Core& core);

// --- Memory placement (NUMA; csrc/moe/numa_placement.h) ---------------------
// Whether hwloc can bind memory areas and tell where their pages are on this
// topology: false for a synthetic topology (hwloc's binding calls then succeed
// without doing anything) and where the OS offers no NUMA memory policy.
bool memory_binding_supported();

// The OS indices of NUMA node `node` (logical index): the nodeset a binding
// to that node requests. One index per node in practice.
std::vector<int> node_os_indices(int node);

// Binds the pages of [addr, addr + len) to NUMA node `node` (logical index),
// moving the pages already there (HWLOC_MEMBIND_BIND + MIGRATE, by nodeset).
// The range is shrunk inward to whole pages: a page shared with a neighbour
// range keeps its place. Returns false, binding nothing, where
// memory_binding_supported() is false or the OS refuses.
bool bind_area_to_node(const void* addr, size_t len, int node);

// Logical indices of the NUMA nodes holding the (touched) pages of
// [addr, addr + len), from hwloc_get_area_memlocation; empty when hwloc
// cannot tell (synthetic topology, unsupported OS).
std::vector<int> area_memory_nodes(const void* addr, size_t len);

// Logical indices of the nodes the whole pages of [addr, addr + len) are bound
// to, and whether the policy is HWLOC_MEMBIND_BIND (hwloc_get_area_membind);
// empty when hwloc cannot tell or the pages have no single policy.
std::vector<int> area_bound_nodes(const void* addr, size_t len, bool* is_bind);

}  // namespace kt::runtime
