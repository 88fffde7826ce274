// The pybind11 module kt_ops._C: runtime controls that are not ops (style
// rule 2): thread count, ISA choice, topology report. Importing it also loads
// the TORCH_LIBRARY registrations of this shared object. Hooks for tests and
// benchmarks live in its submodule kt_ops._C._testing (csrc/ops/test_hooks.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <iterator>
#include <stdexcept>
#include <utility>

#include "formats/format_table.h"
#include "kernels/activations.h"
#include "kernels/brgemm.h"
#include "kernels/dispatch.h"
#include "kernels/plan.h"
#include "moe/moe_forward.h"
#include "runtime/cpu_features.h"
#include "runtime/openmp_team.h"
#include "runtime/thread_pool.h"
#include "runtime/topology.h"

namespace py = pybind11;
using kt::kernels::Isa;

namespace kt::hybrid {
// csrc/hybrid/host_transport.cpp
void register_host_bridge(pybind11::module& m, pybind11::module& testing);
}  // namespace kt::hybrid
namespace kt::ops {
void register_numa(pybind11::module& m, pybind11::module& testing);  // csrc/ops/numa_bindings.cpp
void register_memory(pybind11::module& m);                           // csrc/ops/memory_bindings.cpp
void register_test_hooks(pybind11::module& testing);                 // csrc/ops/test_hooks.cpp
void register_prepared_layer_call(pybind11::module& m);              // csrc/ops/prepared_layer.cpp
void register_layer_checks(pybind11::module& m,
                           pybind11::module& testing);  // csrc/ops/layer_bindings.cpp
}  // namespace kt::ops

namespace {

std::vector<std::string> names(const std::vector<Isa>& isas) {
  std::vector<std::string> out;
  for (Isa i : isas) out.emplace_back(kt::kernels::isa_name(i));
  return out;
}

py::dict topology_report() {
  const auto& topo = kt::runtime::topology();
  py::list cores;
  for (const auto& c : topo.cores) {
    py::dict d;
    d["core"] = c.os_index;
    d["numa_node"] = c.numa_node;
    d["pus"] = c.pus;
    cores.append(d);
  }
  py::dict out;
  out["source"] = topo.source;
  out["num_numa_nodes"] = topo.num_numa_nodes;
  out["num_cores"] = static_cast<int>(topo.cores.size());
  out["host_cores"] = topo.host_cores;
  out["core_share"] = py::make_tuple(topo.share_index, topo.share_count);
  out["core_share_source"] = topo.share_source;
  out["num_pus"] = topo.num_pus;
  out["cores"] = cores;
  return out;
}

py::dict cpu_features_report() {
  const auto& f = kt::runtime::cpu_features();
  py::dict d;
  d["avx2"] = f.avx2;
  d["avx512"] = f.avx512;
  d["avx512_vnni"] = f.avx512_vnni;
  d["avx512_bf16"] = f.avx512_bf16;
  d["avx512_vbmi"] = f.avx512_vbmi;
  d["amx"] = f.amx;
  d["intel"] = f.intel;
  return d;
}

const char* scale_dtype_name(kt::formats::ScaleType t) {
  switch (t) {
    case kt::formats::ScaleType::kF32:
      return "float32";
    case kt::formats::ScaleType::kF16:
      return "float16";
    case kt::formats::ScaleType::kBF16:
      return "bfloat16";
    case kt::formats::ScaleType::kE8M0:
    case kt::formats::ScaleType::kKq45:
    case kt::formats::ScaleType::kKq6:
    case kt::formats::ScaleType::kKq2:
    case kt::formats::ScaleType::kKiq4:
      return "uint8";
    case kt::formats::ScaleType::kNone:
      break;
  }
  return nullptr;
}

py::object fp32_min_or_none(int n) {
  return n == kt::formats::kNoFp32Path ? py::object(py::none()) : py::object(py::int_(n));
}

// The brgemm thresholds' CPU classes by their Python names (FormatSpec.brgemm_min_tokens).
constexpr std::pair<const char*, kt::formats::BrgemmIsa> kBrgemmClasses[] = {
    {"avx512", kt::formats::BrgemmIsa::kAvx512},
    {"avx512_intel", kt::formats::BrgemmIsa::kAvx512Intel},
    {"amx", kt::formats::BrgemmIsa::kAmx},
};

const char* brgemm_class_name(kt::formats::BrgemmIsa cls) {
  for (const auto& [name, c] : kBrgemmClasses)
    if (c == cls) return name;
  return "?";
}

py::object min_tokens_or_none(int n) {
  return n == kt::formats::kNoBrgemm ? py::object(py::none()) : py::object(py::int_(n));
}

// {format: {"brgemm_kernel": name or None, "brgemm_min_tokens": n or None}} on tier
// `isa` under the current modes: the compute plan's tile family (kernels/plan.h,
// tile_path), which computes the products of the experts with at least n tokens.
py::dict compute_paths(Isa isa) {
  py::dict out;
  for (const kt::formats::FormatRow& f : kt::formats::format_table()) {
    const kt::kernels::TilePath p = kt::kernels::tile_path(f, isa);
    py::dict d;
    d["brgemm_kernel"] =
        p.kernel == nullptr ? py::object(py::none()) : py::object(py::str(p.kernel->name));
    d["brgemm_min_tokens"] = min_tokens_or_none(p.min_tokens);
    out[f.name] = d;
  }
  return out;
}

// The format table (formats/format_table.h), one dict per row, in table order:
// what kt_ops/formats/spec.py builds its FormatSpec objects from.
py::list formats_report() {
  using kt::formats::Layout;
  py::list out;
  for (const kt::formats::FormatRow& f : kt::formats::format_table()) {
    py::dict d;
    d["name"] = f.name;
    d["layout"] = f.layout == Layout::kBf16   ? "bf16"
                  : f.layout == Layout::kFp8  ? "fp8"
                  : f.layout == Layout::kGrid ? "grid"
                                              : "qint";
    d["bits"] = f.bits();
    d["signed"] = f.layout == Layout::kQint && f.qint.is_signed;
    const kt::formats::CodeTable table =
        f.layout == Layout::kQint ? f.qint.table : kt::formats::CodeTable::kNone;
    d["code_table"] = table == kt::formats::CodeTable::kE2m1    ? py::object(py::str("e2m1"))
                      : table == kt::formats::CodeTable::kIq4nl ? py::object(py::str("iq4nl"))
                                                                : py::object(py::none());
    const char* sd = scale_dtype_name(f.packed_scale_type);
    d["scale_dtype"] = sd ? py::object(py::str(sd)) : py::object(py::none());
    const bool kq = kt::formats::is_kquant(f.packed_scale_type);
    // k-quants: bytes of one scale record (16 rows x 256 k), whether it holds mins.
    d["scale_record_bytes"] = kq ? kt::formats::kquant_record_bytes(f.packed_scale_type) : 0;
    d["super_block"] = kq ? kt::formats::kKSuperK : 0;
    d["record_mins"] = kq && kt::formats::kquant_has_mins(f.packed_scale_type);
    d["zero_offset"] = f.layout == Layout::kQint ? f.qint.zero_offset : 0.f;
    d["has_zeros"] = f.zeros != kt::formats::ZeroPolicy::kNever;
    d["zeros_optional"] = f.zeros == kt::formats::ZeroPolicy::kOptional;
    d["group_sizes"] = f.group_sizes;
    d["default_group_size"] = f.default_group_size;
    d["activation"] = f.activation == kt::formats::ActType::kQ8 ? "q8" : "fp32";
    d["fp32_min_tokens"] = fp32_min_or_none(f.fp32_min_tokens.min(kt::formats::Fp32Class::kBase));
    d["fp32_min_tokens_vnni"] =
        fp32_min_or_none(f.fp32_min_tokens.min(kt::formats::Fp32Class::kVnni));
    py::dict brgemm;
    for (const auto& [name, cls] : kBrgemmClasses)
      brgemm[name] = min_tokens_or_none(f.brgemm.min(cls));
    d["brgemm_min_tokens"] = brgemm;
    d["bits_per_weight"] = f.bits_per_weight;
    d["gguf_block"] = f.gguf_block.weights > 0
                          ? py::object(py::make_tuple(f.gguf_block.weights, f.gguf_block.bytes))
                          : py::object(py::none());
    d["source"] = f.source;
    d["fp8_row_scales"] = f.fp8_row_scales;
    out.append(d);
  }
  return out;
}

// {format: [kernel of its own path, kernel of the weight-only fp32 path or None]}
// on tier `isa`: the kernels that actually run, after the fallback chain.
py::dict kernel_names(Isa isa) {
  py::dict out;
  for (const kt::formats::FormatRow& f : kt::formats::format_table()) {
    const auto& k = kt::kernels::projection_kernels(f.layout, isa);
    py::list names;
    names.append(k.name);
    names.append(k.fp32_name ? py::object(py::str(k.fp32_name)) : py::object(py::none()));
    out[f.name] = names;
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kt_ops native runtime (thread pool, ISA dispatch, topology)";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });
  m.def("set_num_threads", [](int64_t n) {
    // int64_t so that a huge n gets the range message, not a pybind TypeError.
    const int cap = kt::runtime::ThreadPool::max_threads();
    if (n < 1 || n > cap)
      throw std::invalid_argument("kt_ops.set_num_threads: n must be in [1, " +
                                  std::to_string(cap) + "], got " + std::to_string(n) + " (" +
                                  std::to_string(kt::runtime::ThreadPool::kMaxThreadsPerCore) +
                                  " x the physical cores, at least " +
                                  std::to_string(kt::runtime::ThreadPool::kMinMaxThreads) + ")");
    kt::runtime::ThreadPool::set_global_num_threads(static_cast<int>(n));
  });
  m.def("get_num_threads", [] { return kt::runtime::ThreadPool::global().num_threads(); });
  m.def("set_parallel_backend", [](const std::string& name) {
    kt::runtime::ParallelBackend b;
    try {
      b = kt::runtime::parse_parallel_backend(name);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("kt_ops.set_parallel_backend: ") + e.what());
    }
    kt::runtime::ThreadPool::set_parallel_backend(b);
  });
  m.def("parallel_backend", [] {
    return std::string(
        kt::runtime::parallel_backend_name(kt::runtime::ThreadPool::parallel_backend()));
  });
  m.def("parallel_report", [] {
    // Which threads a job started now by this thread runs on, and why.
    kt::runtime::ThreadPool& pool = kt::runtime::ThreadPool::global();
    py::dict d;
    d["setting"] = kt::runtime::parallel_backend_name(kt::runtime::ThreadPool::parallel_backend());
    std::string reason;
    d["uses"] = pool.uses_openmp(&reason) ? "openmp" : "pool";
    d["reason"] = reason;
    d["openmp_runtime"] = kt::runtime::openmp::runtime_library();
    d["openmp_max_threads"] = kt::runtime::openmp::max_threads();
    py::dict jobs;
    jobs["openmp"] = kt::runtime::ThreadPool::openmp_jobs();
    jobs["pool"] = kt::runtime::ThreadPool::pool_jobs();
    d["jobs"] = jobs;
    d["caller_moves"] = kt::runtime::ThreadPool::caller_moves();
    return d;
  });
  m.def("workers_bound", [] { return kt::runtime::ThreadPool::global().workers_bound(); });
  m.def("activations", [] {
    // The ops' `activation` names (kernels/activations.h), in their table order.
    return std::vector<std::string>(std::begin(kt::kernels::kActivationNames),
                                    std::end(kt::kernels::kActivationNames));
  });
  m.def("parse_activation", [](const std::string& text) {
    // The ops' one parser of the `activation` argument (kernels/activations.h):
    // {"name", "alpha", "limit" or None, "act_limit" or None, "up_offset",
    //  "gate_softcap" or None, "up_softcap" or None}.
    kt::kernels::Glu glu;
    std::string error;
    if (!kt::kernels::parse_glu(text, &glu, &error))
      throw py::value_error("activation='" + text + "' is not supported: " + error);
    py::dict d;
    d["name"] = kt::kernels::activation_name(glu.act);
    d["alpha"] = glu.alpha;
    d["limit"] = glu.clamped() && !glu.clamp_after ? py::cast(glu.limit) : py::none();
    d["act_limit"] = glu.clamped() && glu.clamp_after ? py::cast(glu.limit) : py::none();
    d["up_offset"] = glu.up_offset;
    const auto cap = [](float c) { return std::isfinite(c) ? py::cast(c) : py::none(); };
    d["gate_softcap"] = cap(glu.gate_softcap);
    d["up_softcap"] = cap(glu.up_softcap);
    return d;
  });
  m.def("built_isas", [] { return names(kt::kernels::built_isas()); });
  m.def("supported_isas", [] { return names(kt::kernels::supported_isas()); });
  m.def("active_isa", [] { return std::string(kt::kernels::isa_name(kt::kernels::active_isa())); });
  m.def("set_isa", [](const std::string& name) {
    try {
      kt::kernels::set_active_isa(kt::kernels::parse_isa(name));
    } catch (const std::invalid_argument& e) {
      // "kt_ops: unknown ISA ..." -> "kt_ops.set_isa: unknown ISA ...": the error names the knob.
      std::string what = e.what();
      const std::string generic = "kt_ops: ";
      if (what.compare(0, generic.size(), generic) == 0) what.erase(0, generic.size());
      throw std::invalid_argument("kt_ops.set_isa: " + what);
    }
  });
  m.def("set_quant_activations", [](const std::string& mode) {
    using kt::moe::QuantActivations;
    if (mode == "auto") return kt::moe::set_quant_activations(QuantActivations::kAuto);
    if (mode == "q8") return kt::moe::set_quant_activations(QuantActivations::kQ8);
    if (mode == "fp32") return kt::moe::set_quant_activations(QuantActivations::kFp32);
    throw std::invalid_argument(
        "kt_ops.set_quant_activations: mode must be 'auto', 'q8' or 'fp32', got '" + mode + "'");
  });
  m.def("quant_activations", [] {
    switch (kt::moe::quant_activations()) {
      case kt::moe::QuantActivations::kQ8:
        return std::string("q8");
      case kt::moe::QuantActivations::kFp32:
        return std::string("fp32");
      default:
        return std::string("auto");
    }
  });
  m.def("set_compute_path", [](const std::string& path) {
    using kt::moe::ComputePath;
    if (path == "auto") return kt::moe::set_compute_path(ComputePath::kAuto);
    if (path == "streaming") return kt::moe::set_compute_path(ComputePath::kStreaming);
    if (path == "brgemm") return kt::moe::set_compute_path(ComputePath::kBrgemm);
    throw std::invalid_argument(
        "kt_ops.set_compute_path: path must be 'auto', 'streaming' or 'brgemm', got '" + path +
        "'");
  });
  m.def("set_brgemm_bf16_kernel", [](const std::string& name) {
    using kt::kernels::brgemm::Bf16Kernel;
    if (name == "auto") return kt::kernels::brgemm::set_bf16_kernel(Bf16Kernel::kAuto);
    if (name == "onednn") return kt::kernels::brgemm::set_bf16_kernel(Bf16Kernel::kOneDnn);
    if (name == "kt") return kt::kernels::brgemm::set_bf16_kernel(Bf16Kernel::kKt);
    throw std::invalid_argument(
        "kt_ops.set_brgemm_bf16_kernel: name must be 'auto', 'onednn' or 'kt', got '" + name + "'");
  });
  m.def("brgemm_bf16_kernel", [] {
    switch (kt::kernels::brgemm::bf16_kernel_setting()) {
      case kt::kernels::brgemm::Bf16Kernel::kOneDnn:
        return std::string("onednn");
      case kt::kernels::brgemm::Bf16Kernel::kKt:
        return std::string("kt");
      default:
        return std::string("auto");
    }
  });
  m.def("compute_path", [] {
    switch (kt::moe::compute_path()) {
      case kt::moe::ComputePath::kStreaming:
        return std::string("streaming");
      case kt::moe::ComputePath::kBrgemm:
        return std::string("brgemm");
      default:
        return std::string("auto");
    }
  });
  m.def("brgemm_built", &kt::kernels::brgemm::built);
  m.def("compute_paths",
        [](const std::string& isa) { return compute_paths(kt::kernels::parse_isa(isa)); });
  m.def("formats", &formats_report);
  m.def(
      "brgemm_cpu_class", [] { return brgemm_class_name(kt::kernels::brgemm_class()); },
      "The CPU class whose brgemm thresholds 'auto' follows here: 'avx512', 'avx512_intel' "
      "or 'amx' (FormatSpec.brgemm_min_tokens_for).");
  m.def("fp32_min_tokens", [](const std::string& format, const std::string& isa) {
    const kt::formats::FormatRow* f = kt::formats::find_format(format);
    if (f == nullptr) throw py::value_error("unknown weight_format '" + format + "'");
    return fp32_min_or_none(kt::moe::fp32_min_tokens(*f, kt::kernels::parse_isa(isa)));
  });
  m.def("kernel_names",
        [](const std::string& isa) { return kernel_names(kt::kernels::parse_isa(isa)); });
  m.def("retained_scratch_bytes", &kt::moe::retained_scratch_bytes);
  m.def("topology", &topology_report);
  m.def("cpu_features", &cpu_features_report);
  // Hooks for tests/ and benchmarks/ only, out of the runtime's namespace.
  py::module testing = m.def_submodule(
      "_testing", "kt_ops test and benchmark hooks (not API: nothing in kt_ops/ calls them)");
  kt::ops::register_test_hooks(testing);
  kt::hybrid::register_host_bridge(m, testing);
  kt::ops::register_numa(m, testing);
  kt::ops::register_memory(m);
  kt::ops::register_prepared_layer_call(m);
  kt::ops::register_layer_checks(m, testing);
}
