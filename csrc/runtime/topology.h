// Machine topology from hwloc: physical cores grouped per NUMA node.
#pragma once

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
};

// The process-wide topology. The synthetic description in $KT_OPS_HWLOC_SYNTHETIC
// (hwloc's syntax, e.g. "node:2 core:4 pu:1") replaces the real machine; tests
// use it to exercise multi-node partitioning on a one-node machine.
const Topology& topology();

// Binds the calling thread to the hardware threads of `core`. Returns false
// (and leaves the thread unbound) when hwloc cannot bind, e.g. for a synthetic
// topology or inside a restricted container.
bool bind_current_thread(const Core& core);

}  // namespace kt::runtime
