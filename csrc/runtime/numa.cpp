#include "runtime/numa.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "runtime/thread_pool.h"
#include "runtime/topology.h"

namespace kt::runtime {

namespace {

std::atomic<int> g_mode{-1};  // -1: $KT_OPS_NUMA not read yet
std::mutex g_mode_mutex;

}  // namespace

NumaMode parse_numa_mode(const std::string& name, const char* who) {
  if (name == "auto") return NumaMode::kAuto;
  if (name == "on") return NumaMode::kOn;
  if (name == "off") return NumaMode::kOff;
  throw std::invalid_argument(std::string(who) +
                              ": NUMA mode must be 'auto', 'on' or 'off', got '" + name + "'");
}

const char* numa_mode_name(NumaMode mode) {
  switch (mode) {
    case NumaMode::kOn:
      return "on";
    case NumaMode::kOff:
      return "off";
    default:
      return "auto";
  }
}

NumaMode numa_mode() {
  int m = g_mode.load(std::memory_order_acquire);
  if (m >= 0) return static_cast<NumaMode>(m);
  std::lock_guard<std::mutex> lock(g_mode_mutex);
  m = g_mode.load();
  if (m < 0) {
    NumaMode mode = NumaMode::kAuto;
    if (const char* env = std::getenv("KT_OPS_NUMA"); env != nullptr && env[0] != '\0')
      mode = parse_numa_mode(env, "KT_OPS_NUMA");
    m = static_cast<int>(mode);
    g_mode.store(m, std::memory_order_release);
  }
  return static_cast<NumaMode>(m);
}

void set_numa_mode(NumaMode mode) {
  numa_mode();  // a malformed $KT_OPS_NUMA is reported, not silently replaced
  const int before = numa_parts();
  g_mode.store(static_cast<int>(mode), std::memory_order_release);
  if (numa_parts() != before) ThreadPool::repin_global_workers();
}

bool numa_active() {
  const NumaMode mode = numa_mode();
  if (mode == NumaMode::kOff) return false;
  return mode == NumaMode::kOn || topology().num_numa_nodes > 1;
}

const std::vector<int>& numa_compute_nodes() {
  static const std::vector<int> nodes = [] {
    std::vector<int> out;
    for (const Core& c : topology().cores)
      if (out.empty() || out.back() != c.numa_node) out.push_back(c.numa_node);
    if (out.empty()) out.push_back(0);
    return out;
  }();
  return nodes;
}

int numa_parts() { return numa_active() ? static_cast<int>(numa_compute_nodes().size()) : 1; }

}  // namespace kt::runtime
