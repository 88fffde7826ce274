#include "kernels/dispatch.h"

#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "kernels/tiers.h"
#include "runtime/cpu_features.h"

namespace kt::kernels {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kRef:
      return "ref";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx512Vnni:
      return "avx512_vnni";
  }
  return "?";
}

Isa parse_isa(const std::string& name) {
  if (name == "ref") return Isa::kRef;
  if (name == "avx2") return Isa::kAvx2;
  if (name == "avx512") return Isa::kAvx512;
  if (name == "avx512_vnni") return Isa::kAvx512Vnni;
  throw std::invalid_argument("kt_ops: unknown ISA '" + name +
                              "'; expected one of ref, avx2, avx512, avx512_vnni");
}

namespace {

bool is_built(Isa isa) {
  switch (isa) {
    case Isa::kRef:
      return true;
#ifdef KT_BUILD_AVX2
    case Isa::kAvx2:
      return true;
#endif
#ifdef KT_BUILD_AVX512
    case Isa::kAvx512:
      return true;
#endif
#ifdef KT_BUILD_AVX512_VNNI
    case Isa::kAvx512Vnni:
      return true;
#endif
    default:
      return false;
  }
}

// Why this CPU cannot run `isa`, or nullptr when it can.
const char* missing_feature(Isa isa) {
  const auto& f = runtime::cpu_features();
  switch (isa) {
    case Isa::kRef:
      return nullptr;
    case Isa::kAvx2:
      return f.avx2 ? nullptr : "AVX2+FMA";
    case Isa::kAvx512:
      return f.avx512 ? nullptr : "AVX-512 F/BW/VL/DQ";
    case Isa::kAvx512Vnni:
      return f.avx512_vnni ? nullptr : "AVX-512 F/BW/VL/DQ + AVX512_VNNI";
  }
  return "?";
}

void check_usable(Isa isa) {
  if (!is_built(isa)) {
    throw std::invalid_argument(
        std::string("kt_ops: ISA '") + isa_name(isa) +
        "' is not built into this extension (the compiler could not target it)");
  }
  if (const char* missing = missing_feature(isa)) {
    throw std::invalid_argument(std::string("kt_ops: ISA '") + isa_name(isa) +
                                "' cannot run on this CPU: it lacks " + missing);
  }
}

// The active tier, chosen on first use. An unusable $KT_OPS_ISA is kept as an
// error that every op call reports (a typo must not silently pick another
// path) until set_active_isa() chooses a tier explicitly.
struct ActiveIsa {
  std::mutex mutex;
  bool initialized = false;
  Isa isa = Isa::kRef;
  std::string env_error;
};

ActiveIsa& active_state() {
  static ActiveIsa state;
  std::lock_guard<std::mutex> lock(state.mutex);
  if (!state.initialized) {
    state.initialized = true;
    state.isa = supported_isas().back();
    const char* env = std::getenv("KT_OPS_ISA");
    if (env != nullptr && env[0] != '\0') {
      try {
        const Isa forced = parse_isa(env);
        check_usable(forced);
        state.isa = forced;
      } catch (const std::invalid_argument& e) {
        state.env_error = std::string("KT_OPS_ISA='") + env + "' cannot be used: " + e.what() +
                          " (unset it, or call kt_ops.set_isa to choose a path)";
      }
    }
  }
  return state;
}

}  // namespace

std::vector<Isa> built_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kRef, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Vnni})
    if (is_built(isa)) out.push_back(isa);
  return out;
}

std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : built_isas())
    if (missing_feature(isa) == nullptr) out.push_back(isa);
  return out;
}

Isa active_isa() {
  ActiveIsa& state = active_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (!state.env_error.empty()) throw std::invalid_argument(state.env_error);
  return state.isa;
}

void set_active_isa(Isa isa) {
  check_usable(isa);
  ActiveIsa& state = active_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.isa = isa;
  state.env_error.clear();
}

namespace {

// Each tier's kernels per layout (index: formats::Layout), nullptr where the
// tier has none. THE fallback chain: a missing entry is served by the next
// lower tier that has one (avx512 -> avx2 -> ref); ref has every entry.
struct TierKernels {
  Isa isa;
  const ProjectionKernels* layouts[3];  // kBf16, kQint, kFp8
  SiluMulRows silu;
};

const std::vector<TierKernels>& tier_table() {
  static const std::vector<TierKernels> table = {
      {Isa::kRef, {&ref::bf16_kernels(), &ref::qint_kernels(), &ref::fp8_kernels()}, ref::silu_mul_rows},
#ifdef KT_BUILD_AVX2
      {Isa::kAvx2, {&avx2::bf16_kernels(), &avx2::qint_kernels(), &avx2::fp8_kernels()}, avx2::silu_mul_rows},
#endif
#ifdef KT_BUILD_AVX512
      // fp8 stays on the AVX2 kernels (256-bit code every AVX-512 CPU runs).
      {Isa::kAvx512, {&avx512::bf16_kernels(), &avx512::qint_kernels(), nullptr},
       avx512::silu_mul_rows},
#endif
#ifdef KT_BUILD_AVX512_VNNI
      // vpdpbusd for the integer formats; the rest from the avx512 row.
      {Isa::kAvx512Vnni, {nullptr, &avx512_vnni::qint_kernels(), nullptr}, nullptr},
#endif
  };
  return table;
}

}  // namespace

const ProjectionKernels& projection_kernels(formats::Layout layout, Isa isa) {
  const auto& table = tier_table();
  for (auto it = table.rbegin(); it != table.rend(); ++it) {
    if (it->isa > isa) continue;
    if (const ProjectionKernels* k = it->layouts[static_cast<int>(layout)]) return *k;
  }
  return *table.front().layouts[static_cast<int>(layout)];
}

SiluMulRows silu_mul_rows(Isa isa) {
  const auto& table = tier_table();
  for (auto it = table.rbegin(); it != table.rend(); ++it)
    if (it->isa <= isa && it->silu != nullptr) return it->silu;
  return table.front().silu;
}

}  // namespace kt::kernels
