#include "runtime/topology.h"

#include <hwloc.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kt::runtime {

namespace {

// An int in [lo, hi] from `text`, or -1.
int parse_int(const char* text, int lo, int hi) {
  if (text == nullptr || text[0] == '\0') return -1;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  return (end == text || *end != '\0' || v < lo || v > hi) ? -1 : static_cast<int>(v);
}

// The share of $KT_OPS_CORE_SHARE / $LOCAL_RANK of $LOCAL_WORLD_SIZE (topology.h).
void apply_core_share(Topology& info) {
  int index = 0, count = 1;
  const char* env = std::getenv("KT_OPS_CORE_SHARE");
  const std::string spec = env != nullptr ? env : "";
  info.share_source = "none";
  if (spec == "off") return;
  if (!spec.empty() && spec != "auto") {
    const size_t slash = spec.find('/');
    const int n = slash == std::string::npos ? -1 : parse_int(spec.c_str() + slash + 1, 1, 1 << 16);
    const int i = n < 1 ? -1 : parse_int(spec.substr(0, slash).c_str(), 0, n - 1);
    if (i < 0)
      throw std::invalid_argument("KT_OPS_CORE_SHARE='" + spec +
                                  "' must be 'auto', 'off' or 'i/n' with 0 <= i < n");
    index = i;
    count = n;
    info.share_source = "KT_OPS_CORE_SHARE";
  } else {
    const char* size_env = std::getenv("LOCAL_WORLD_SIZE");
    const char* rank_env = std::getenv("LOCAL_RANK");
    if (size_env == nullptr || rank_env == nullptr) return;  // not local ranks: the whole host
    const int n = parse_int(size_env, 1, 1 << 16);
    const int i = n < 1 ? -1 : parse_int(rank_env, 0, n - 1);
    if (i < 0)  // every rank would take the whole host: say so instead
      throw std::invalid_argument(std::string("LOCAL_RANK='") + rank_env +
                                  "' and LOCAL_WORLD_SIZE='" + size_env +
                                  "' must be ints with 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE "
                                  "(set KT_OPS_CORE_SHARE=off to use the whole host)");
    index = i;
    count = n;
    info.share_source = "LOCAL_RANK/LOCAL_WORLD_SIZE";
  }
  info.share_index = index;
  info.share_count = count;
  if (count <= 1) return;
  const int c = static_cast<int>(info.cores.size());
  std::vector<Core> mine;
  if (c >= count) {
    mine.assign(info.cores.begin() + static_cast<int64_t>(index) * c / count,
                info.cores.begin() + static_cast<int64_t>(index + 1) * c / count);
  } else {
    mine.push_back(info.cores[index % c]);
  }
  info.cores = std::move(mine);
}

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
    info.host_cores = static_cast<int>(info.cores.size());
    apply_core_share(info);
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

namespace {

// Logical indices of the NUMA nodes in `nodeset` (a set of OS indices).
std::vector<int> logical_nodes(hwloc_topology_t topo, hwloc_const_bitmap_t nodeset) {
  std::vector<int> out;
  unsigned os;
  hwloc_bitmap_foreach_begin(os, nodeset) {
    hwloc_obj_t node = hwloc_get_numanode_obj_by_os_index(topo, os);
    if (node != nullptr) out.push_back(static_cast<int>(node->logical_index));
  }
  hwloc_bitmap_foreach_end();
  return out;
}

// [addr, addr + len) shrunk inward to whole pages; len 0 when no page is whole.
std::pair<void*, size_t> whole_pages(const void* addr, size_t len) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(addr) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(addr) + len) / page * page;
  if (end <= begin) return {nullptr, 0};
  return {reinterpret_cast<void*>(begin), static_cast<size_t>(end - begin)};
}

}  // namespace

bool memory_binding_supported() {
  HwlocHolder& h = holder();
  if (h.synthetic) return false;
  const hwloc_topology_support* support = hwloc_topology_get_support(h.topo);
  return support != nullptr && support->membind != nullptr &&
         support->membind->set_area_membind != 0 && support->membind->bind_membind != 0;
}

std::vector<int> node_os_indices(int node) {
  HwlocHolder& h = holder();
  hwloc_obj_t obj = hwloc_get_obj_by_type(h.topo, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(node));
  std::vector<int> out;
  if (obj == nullptr || obj->nodeset == nullptr) return out;
  unsigned os;
  hwloc_bitmap_foreach_begin(os, obj->nodeset) { out.push_back(static_cast<int>(os)); }
  hwloc_bitmap_foreach_end();
  return out;
}

bool bind_area_to_node(const void* addr, size_t len, int node) {
  if (!memory_binding_supported()) return false;
  const auto [begin, bytes] = whole_pages(addr, len);
  if (bytes == 0) return true;  // nothing of its own to move
  HwlocHolder& h = holder();
  hwloc_obj_t obj = hwloc_get_obj_by_type(h.topo, HWLOC_OBJ_NUMANODE, static_cast<unsigned>(node));
  if (obj == nullptr) return false;
  return hwloc_set_area_membind(h.topo, begin, bytes, obj->nodeset, HWLOC_MEMBIND_BIND,
                                HWLOC_MEMBIND_MIGRATE | HWLOC_MEMBIND_BYNODESET) == 0;
}

std::vector<int> area_memory_nodes(const void* addr, size_t len) {
  HwlocHolder& h = holder();
  if (h.synthetic || len == 0) return {};
  const hwloc_topology_support* support = hwloc_topology_get_support(h.topo);
  if (support == nullptr || support->membind == nullptr ||
      support->membind->get_area_memlocation == 0)
    return {};
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  std::vector<int> out;
  if (hwloc_get_area_memlocation(h.topo, addr, len, set, HWLOC_MEMBIND_BYNODESET) == 0)
    out = logical_nodes(h.topo, set);
  hwloc_bitmap_free(set);
  return out;
}

std::vector<int> area_bound_nodes(const void* addr, size_t len, bool* is_bind) {
  if (is_bind != nullptr) *is_bind = false;
  HwlocHolder& h = holder();
  if (h.synthetic || len == 0) return {};
  const hwloc_topology_support* support = hwloc_topology_get_support(h.topo);
  if (support == nullptr || support->membind == nullptr || support->membind->get_area_membind == 0)
    return {};
  const auto [begin, bytes] = whole_pages(addr, len);  // the pages a binding covers
  if (bytes == 0) return {};
  hwloc_bitmap_t set = hwloc_bitmap_alloc();
  hwloc_membind_policy_t policy;
  std::vector<int> out;
  if (hwloc_get_area_membind(h.topo, begin, bytes, set, &policy, HWLOC_MEMBIND_BYNODESET) == 0) {
    out = logical_nodes(h.topo, set);
    if (is_bind != nullptr) *is_bind = policy == HWLOC_MEMBIND_BIND;
  }
  hwloc_bitmap_free(set);
  return out;
}

}  // namespace kt::runtime
