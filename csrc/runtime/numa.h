// NUMA placement controls: whether the MoE driver splits every expert across
// the NUMA nodes (csrc/moe/numa_placement.h), and which node each pool thread
// computes for.
//
//   auto (default): on when the topology has more than one NUMA node;
//   on:             on, even with one node (the weights are then bound to
//                   node 0: the binding code runs on any machine);
//   off:            never; threads and memory as without NUMA support.
// $KT_OPS_NUMA sets the initial mode; kt_ops.set_numa() changes it.
#pragma once

#include <string>
#include <vector>

namespace kt::runtime {

enum class NumaMode { kAuto, kOn, kOff };

// Parses "auto", "on" or "off"; throws std::invalid_argument naming `who` otherwise.
NumaMode parse_numa_mode(const std::string& name, const char* who);
const char* numa_mode_name(NumaMode mode);

// The mode; the first call reads $KT_OPS_NUMA (std::invalid_argument when malformed).
NumaMode numa_mode();
// Sets the mode. When that changes how pool threads map to cores (spread over
// the nodes or not), the global pool restarts its workers with the new binding.
void set_numa_mode(NumaMode mode);

// Whether placement is on: mode on, or auto with more than one NUMA node.
bool numa_active();
// The NUMA nodes that have cores (logical indices, ascending): part p of
// every expert lives on node numa_compute_nodes()[p]. Memory-only nodes
// (CXL, HBM in flat mode) get no part: no thread would compute it locally.
const std::vector<int>& numa_compute_nodes();
// Number of parts every expert is split into: numa_compute_nodes().size()
// when numa_active(), else 1.
int numa_parts();

}  // namespace kt::runtime
