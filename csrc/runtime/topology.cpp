#include "runtime/topology.h"

#include <hwloc.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>

namespace kt::runtime {

namespace {

struct HwlocHolder {
  hwloc_topology_t topo = nullptr;
  bool synthetic = false;
  Topology info;

  HwlocHolder() {
    if (hwloc_topology_init(&topo) != 0)
      throw std::runtime_error("kt_ops: hwloc_topology_init failed");
    const char* synth = std::getenv("KT_OPS_HWLOC_SYNTHETIC");
    if (synth != nullptr && synth[0] != '\0') {
      if (hwloc_topology_set_synthetic(topo, synth) != 0) {
        throw std::runtime_error(std::string("kt_ops: KT_OPS_HWLOC_SYNTHETIC='") + synth +
                                 "' is not a valid hwloc synthetic topology description");
      }
      synthetic = true;
      info.source = std::string("synthetic: ") + synth;
    } else {
      info.source = "this machine";
    }
    if (hwloc_topology_load(topo) != 0)
      throw std::runtime_error("kt_ops: hwloc_topology_load failed");

    info.num_pus = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_PU);
    int num_nodes = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
    info.num_numa_nodes = num_nodes > 0 ? num_nodes : 1;
    const int num_cores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    for (int node = 0; node < info.num_numa_nodes; ++node) {
      hwloc_obj_t numa =
          num_nodes > 0 ? hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, node) : nullptr;
      for (int c = 0; c < num_cores; ++c) {
        hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, c);
        if (numa != nullptr && !hwloc_bitmap_intersects(core->cpuset, numa->cpuset)) continue;
        Core entry;
        entry.os_index = static_cast<int>(core->logical_index);
        entry.numa_node = node;
        unsigned pu;
        hwloc_bitmap_foreach_begin(pu, core->cpuset) { entry.pus.push_back(static_cast<int>(pu)); }
        hwloc_bitmap_foreach_end();
        info.cores.push_back(entry);
      }
    }
    if (info.cores.empty()) {  // hwloc saw no cores (unusual VMs): one per PU
      for (int p = 0; p < info.num_pus; ++p) {
        hwloc_obj_t pu = hwloc_get_obj_by_type(topo, HWLOC_OBJ_PU, p);
        Core entry;
        entry.os_index = p;
        entry.pus.push_back(static_cast<int>(pu->os_index));
        info.cores.push_back(entry);
      }
    }
    if (info.cores.empty()) info.cores.push_back(Core{0, 0, {}});
  }
  ~HwlocHolder() {
    if (topo != nullptr) hwloc_topology_destroy(topo);
  }
};

HwlocHolder& holder() {
  static HwlocHolder h;
  return h;
}

}  // namespace

const Topology& topology() { return holder().info; }

bool bind_current_thread(const Core& core) {
  HwlocHolder& h = holder();
  if (h.synthetic || core.pus.empty()) return false;
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  for (int pu : core.pus) hwloc_bitmap_set(set, static_cast<unsigned>(pu));
  const int rc = hwloc_set_cpubind(h.topo, set, HWLOC_CPUBIND_THREAD);
  hwloc_bitmap_free(set);
  return rc == 0;
}

}  // namespace kt::runtime
