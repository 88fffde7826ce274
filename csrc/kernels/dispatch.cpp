#include "kernels/dispatch.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "kernels/brgemm.h"
#include "kernels/tiers.h"
#include "runtime/cpu_features.h"

// Each tier's entry points. Declared weak: a tier whose object library the
// compiler could not build (cmake/isa_kernels.cmake) leaves them null, which
// is how the table below knows what is built, with no #ifdef per tier.
#define KT_WEAK __attribute__((weak))
// (avx2's are in kernels/tiers.h: other tiers reuse its fp32-path kernels, and its fp8
// kernels on CPUs without AVX512_VBMI.)
namespace kt::kernels {
namespace avx512 {
KT_WEAK const ProjectionKernels& bf16_kernels();
KT_WEAK const ProjectionKernels& qint_kernels();
KT_WEAK GluRows glu_rows(const Glu& glu);
KT_WEAK GluBackwardRows glu_backward_rows(const Glu& glu);
KT_WEAK void quantize_row_q8(const float* x, int64_t kp, uint8_t* rec);
}  // namespace avx512
namespace avx512_vnni {
KT_WEAK const ProjectionKernels& qint_kernels();
}  // namespace avx512_vnni

namespace {

using KernelsFn = const ProjectionKernels& (*)();

// The tile (matrix-engine) kernel families (kernel_api.h, TileKernel), each
// chained to its fallback: kt_ops' own tiles first where they beat oneDNN's
// (measured, docs/formats.md "Compute paths"), then oneDNN's brgemm; past the
// end of a chain the streaming families compute.
const TileKernel kOneDnnBf16{
    /*name=*/"onednn/brgemm_bf16",
    /*input=*/TileInput::kBf16Rows,
    /*bf16_activations_only=*/true,
    /*keeps=*/false,
    /*applies=*/nullptr,
    /*runs=*/brgemm::bf16_runs,
    /*dot=*/brgemm::bf16_dot,
    /*pack_bytes=*/nullptr,
    /*pack=*/nullptr,
    /*release=*/brgemm::release,
    /*fallback=*/nullptr,
    /*pack_rows=*/nullptr,
    /*quant_modes=*/kAnyQuantMode,
    /*keeps_if=*/brgemm::bf16_pairs,
};
// kt_ops' AMX tiles for the same product (AMX CPUs: 2 x 2 tiles over two blocks, the
// next pair prefetched under the tile products), oneDNN's kernel where they do not run.
const TileKernel kAmxBf16{
    /*name=*/"amx/bf16_tiles",
    /*input=*/TileInput::kBf16Rows,
    /*bf16_activations_only=*/true,
    /*keeps=*/false,
    /*applies=*/nullptr,
    /*runs=*/brgemm::amx_bf16_runs,
    /*dot=*/brgemm::amx_bf16_dot,
    /*pack_bytes=*/nullptr,
    /*pack=*/nullptr,
    /*release=*/brgemm::release,
    /*fallback=*/&kOneDnnBf16,
    /*pack_rows=*/nullptr,
    /*quant_modes=*/kAnyQuantMode,
    /*keeps_if=*/nullptr,
    /*forced_only=*/false,
    /*applies_to=*/nullptr,
    /*pack_bf16=*/nullptr,
    /*dot_pair=*/brgemm::amx_bf16_dot_pair,
};
const TileKernel kKtBf16{
    /*name=*/"avx512_bf16/bf16_dp",
    /*input=*/TileInput::kBf16Packed,
    /*bf16_activations_only=*/true,
    /*keeps=*/false,
    /*applies=*/nullptr,
    /*runs=*/brgemm::kt_bf16_runs,
    /*dot=*/avx512::bf16_dp_dot,
    /*pack_bytes=*/avx512::bf16_dp_pack_bytes,
    /*pack=*/nullptr,
    /*release=*/nullptr,
    /*fallback=*/&kAmxBf16,
    /*pack_rows=*/nullptr,
    /*quant_modes=*/kAnyQuantMode,
    /*keeps_if=*/nullptr,
    /*forced_only=*/false,
    /*applies_to=*/nullptr,
    /*pack_bf16=*/avx512::bf16_dp_pack,
};
// The other qint formats (int4 grouped or per channel, the k-quants, q8_0, q4_0, mxfp4,
// nvfp4) times bf16 hidden states, exactly: kt_ops' vdpbf16ps tiles on the codes' bf16
// values, each group's fp32 sums times its scales (minus zeros times the group's x
// sum). Under quant 'fp32', only where 'brgemm' is forced (the LoRA forward).
const TileKernel kKtQintExact{
    /*name=*/"avx512_bf16/qint_dp_exact",
    /*input=*/TileInput::kFp32Rows,
    /*bf16_activations_only=*/true,
    /*keeps=*/true,
    /*applies=*/brgemm::qint_dp_exact_applies,
    /*runs=*/brgemm::qint_dp_exact_runs,
    /*dot=*/brgemm::qint_dp_exact_dot,
    /*pack_bytes=*/nullptr,
    /*pack=*/nullptr,
    /*release=*/nullptr,
    /*fallback=*/nullptr,
    /*pack_rows=*/nullptr,
    /*quant_modes=*/kQuantFp32Bit,
    /*keeps_if=*/nullptr,
    /*forced_only=*/true,
    /*applies_to=*/brgemm::qint_dp_exact_applies_to,
};
// mxfp4 times bf16 hidden states, exactly, on oneDNN's bf16 brgemm (AMX, or
// brgemm_bf16_kernel = 'onednn'): its values e2m1 * 2^(E-127) are bf16 values, decoded
// per pair of blocks into one N = 32 tile (kernels/brgemm.h, mxfp4_dot). Under 'auto'
// from the mxfp4 row's threshold (bf16 activations: as exact as a bf16 base, where the
// streaming kernels quantize the activations to q8), and under 'fp32' where 'brgemm' is
// forced (the LoRA forward); elsewhere kt_ops' exact qint tiles.
const TileKernel kOneDnnMxfp4{
    /*name=*/"onednn/brgemm_mxfp4_bf16",
    /*input=*/TileInput::kBf16Rows,
    /*bf16_activations_only=*/true,
    /*keeps=*/true,
    /*applies=*/brgemm::mxfp4_applies,
    /*runs=*/brgemm::mxfp4_runs,
    /*dot=*/brgemm::mxfp4_dot,
    /*pack_bytes=*/nullptr,
    /*pack=*/nullptr,
    /*release=*/brgemm::release,
    /*fallback=*/&kKtQintExact,
    /*pack_rows=*/nullptr,
    /*quant_modes=*/kQuantAutoBit | kQuantFp32Bit,
    /*keeps_if=*/nullptr,
    /*forced_only=*/false,
    /*applies_to=*/brgemm::mxfp4_applies_to,
};
// int8 (per channel) times bf16 hidden states, exactly: each block's codes decoded to
// their bf16 values (|q| <= 127: exact), bf16 x bf16 products (exact in fp32), fp32
// sums, the channel scales applied to the outputs. Under quant 'fp32' (exact
// activations), only where 'brgemm' is forced: the LoRA forward on an int8 base (the
// down projection reads h rounded to bf16; under 'auto' compute the int8 row's
// threshold is the w8a8 kernels', and 'fp32' streams the weight-only path).
const TileKernel kOneDnnInt8Bf16{
    /*name=*/"onednn/brgemm_int8_bf16",
    /*input=*/TileInput::kBf16Rows,
    /*bf16_activations_only=*/true,
    /*keeps=*/true,
    /*applies=*/brgemm::int8_per_channel_applies,
    /*runs=*/brgemm::int8_bf16_runs,
    /*dot=*/brgemm::int8_bf16_dot,
    /*pack_bytes=*/nullptr,
    /*pack=*/nullptr,
    /*release=*/brgemm::release,
    /*fallback=*/&kOneDnnMxfp4,
    /*pack_rows=*/nullptr,
    /*quant_modes=*/kQuantFp32Bit,
    /*keeps_if=*/nullptr,
    /*forced_only=*/true,
};
// kt_ops' AMX tiles for the same product (AMX CPUs, under 'auto'): gate and up in one pass.
const TileKernel kAmxInt8Bf16{
    /*name=*/"amx/int8_bf16_tiles",
    /*input=*/TileInput::kBf16Rows,
    /*bf16_activations_only=*/true,
    /*keeps=*/false,
    /*applies=*/brgemm::int8_per_channel_applies,
    /*runs=*/brgemm::amx_int8_bf16_runs,
    /*dot=*/brgemm::amx_int8_bf16_dot,
    /*pack_bytes=*/nullptr,
    /*pack=*/nullptr,
    /*release=*/brgemm::release,
    /*fallback=*/&kOneDnnInt8Bf16,
    /*pack_rows=*/nullptr,
    /*quant_modes=*/kQuantFp32Bit,
    /*keeps_if=*/nullptr,
    /*forced_only=*/true,
    /*applies_to=*/nullptr,
    /*pack_bf16=*/nullptr,
    /*dot_pair=*/brgemm::amx_int8_bf16_dot_pair,
};
// On q8 records, bit-identical to the streaming q8 kernels: any activations.
const TileKernel kOneDnnU8S8{
    /*name=*/"onednn/brgemm_u8s8",
    /*input=*/TileInput::kQ8Packed,
    /*bf16_activations_only=*/false,
    /*keeps=*/false,
    /*applies=*/brgemm::u8s8_applies,
    /*runs=*/brgemm::u8s8_runs,
    /*dot=*/brgemm::u8s8_dot,
    /*pack_bytes=*/brgemm::u8s8_bytes,
    /*pack=*/brgemm::gather_u8s8_rows,
    /*release=*/brgemm::release,
    /*fallback=*/&kAmxInt8Bf16,
    /*pack_rows=*/nullptr,
    /*quant_modes=*/kQuantAutoBit | kQuantQ8Bit,
};
// Full-K u8s8 calls on per-token int8 activations (int8 per channel), under
// QuantActivations::kAuto only (tile_kernel); elsewhere the u8s8 kernel above.
const TileKernel kOneDnnW8A8{
    /*name=*/"onednn/brgemm_w8a8",
    /*input=*/TileInput::kI8TokenRows,
    /*bf16_activations_only=*/false,
    /*keeps=*/false,
    /*applies=*/brgemm::int8_per_channel_applies,
    /*runs=*/brgemm::w8a8_runs,
    /*dot=*/brgemm::w8a8_dot,
    /*pack_bytes=*/brgemm::w8a8_bytes,
    /*pack=*/nullptr,
    /*release=*/brgemm::release,
    /*fallback=*/&kOneDnnU8S8,
    /*pack_rows=*/brgemm::pack_w8a8_rows,
    /*quant_modes=*/kQuantAutoBit,
};
// kt_ops' AMX tiles for the same product (tdpbssd on signed activations), bit-identical.
const TileKernel kAmxW8A8{
    /*name=*/"amx/w8a8_tiles",
    /*input=*/TileInput::kI8TokenRows,
    /*bf16_activations_only=*/false,
    /*keeps=*/false,
    /*applies=*/brgemm::int8_per_channel_applies,
    /*runs=*/brgemm::amx_w8a8_runs,
    /*dot=*/brgemm::amx_w8a8_dot,
    /*pack_bytes=*/brgemm::amx_w8a8_bytes,
    /*pack=*/nullptr,
    /*release=*/brgemm::release,
    /*fallback=*/&kOneDnnW8A8,
    /*pack_rows=*/avx512::pack_amx_w8a8_rows,
    /*quant_modes=*/kQuantAutoBit,
    /*keeps_if=*/nullptr,
    /*forced_only=*/false,
    /*applies_to=*/brgemm::amx_w8a8_applies_to,
    /*pack_bf16=*/nullptr,
    /*dot_pair=*/brgemm::amx_w8a8_dot_pair,
};
// kt_ops' vpdpbusd tiles for the same product, bit-identical (AVX512_VNNI without AMX).
const TileKernel kKtW8A8{
    /*name=*/"avx512_vnni/w8a8_dp",
    /*input=*/TileInput::kI8TokenRows,
    /*bf16_activations_only=*/false,
    /*keeps=*/false,
    /*applies=*/brgemm::int8_per_channel_applies,
    /*runs=*/brgemm::kt_w8a8_runs,
    /*dot=*/avx512::w8a8_dp_dot,
    /*pack_bytes=*/brgemm::w8a8_dp_bytes,
    /*pack=*/nullptr,
    /*release=*/nullptr,
    /*fallback=*/&kAmxW8A8,
    /*pack_rows=*/avx512::pack_w8a8_dp_rows,
    /*quant_modes=*/kQuantAutoBit,
};
// int4 on oneDNN's u8s8 brgemm (w4a8: the codes decoded to signed bytes per block, the
// w8a8 calls, the w4a8 tiles' fold; per channel, or one call per group of 64 / 128): AMX,
// or brgemm_bf16_kernel = 'onednn'; the int8 formats go on down the chain.
const TileKernel kOneDnnW4A8{
    /*name=*/"onednn/brgemm_w4a8",
    /*input=*/TileInput::kI8TokenRows,
    /*bf16_activations_only=*/false,
    /*keeps=*/true,  // the decoded block in the scratch tile
    /*applies=*/brgemm::w4a8_applies,
    /*runs=*/brgemm::w4a8_runs,
    /*dot=*/brgemm::w4a8_dot,
    /*pack_bytes=*/brgemm::w4a8_bytes,
    /*pack=*/nullptr,
    /*release=*/brgemm::release,
    /*fallback=*/&kKtW8A8,
    /*pack_rows=*/brgemm::pack_w4a8_rows,
    /*quant_modes=*/kQuantAutoBit,
    /*keeps_if=*/nullptr,
    /*forced_only=*/false,
    /*applies_to=*/brgemm::w4a8_onednn_applies_to,
};
// kt_ops' AMX tiles for the same product (the codes decoded to signed bytes per block,
// tdpbssd on signed per-token codes, oneDNN path's fold per group), bit-identical.
const TileKernel kAmxW4A8{
    /*name=*/"amx/w4a8_tiles",
    /*input=*/TileInput::kI8TokenRows,
    /*bf16_activations_only=*/false,
    /*keeps=*/false,
    /*applies=*/brgemm::w4a8_applies,
    /*runs=*/brgemm::amx_w4a8_runs,
    /*dot=*/brgemm::amx_w4a8_dot,
    /*pack_bytes=*/brgemm::amx_w4a8_bytes,
    /*pack=*/nullptr,
    /*release=*/brgemm::release,
    /*fallback=*/&kOneDnnW4A8,
    /*pack_rows=*/avx512::pack_amx_w4a8_rows,
    /*quant_modes=*/kQuantAutoBit,
    /*keeps_if=*/nullptr,
    /*forced_only=*/false,
    /*applies_to=*/brgemm::w4a8_onednn_applies_to,
    /*pack_bf16=*/nullptr,
    /*dot_pair=*/brgemm::amx_w4a8_dot_pair,
};
// int4 per channel on kt_ops' vpdpbusd tiles with per-token activations (w4a8),
// AVX512_VNNI without AMX (bit-identical to oneDNN's above).
const TileKernel kKtW4A8{
    /*name=*/"avx512_vnni/w4a8_dp",
    /*input=*/TileInput::kI8TokenRows,
    /*bf16_activations_only=*/false,
    /*keeps=*/false,
    /*applies=*/brgemm::w4a8_applies,
    /*runs=*/brgemm::kt_w4a8_runs,
    /*dot=*/avx512::w4a8_dp_dot,
    /*pack_bytes=*/brgemm::w4a8_dp_bytes,
    /*pack=*/nullptr,
    /*release=*/nullptr,
    /*fallback=*/&kAmxW4A8,
    /*pack_rows=*/avx512::pack_w4a8_dp_rows,
    /*quant_modes=*/kQuantAutoBit,
    /*keeps_if=*/nullptr,
    /*forced_only=*/false,
    /*applies_to=*/brgemm::w4a8_applies_to,
};
const TileKernel kOneDnnFp8{
    /*name=*/"onednn/brgemm_fp8_bf16",
    /*input=*/TileInput::kFp32Rows,
    /*bf16_activations_only=*/true,
    /*keeps=*/true,
    /*applies=*/brgemm::fp8_applies,
    /*runs=*/brgemm::fp8_runs,
    /*dot=*/brgemm::fp8_dot,
    /*pack_bytes=*/nullptr,
    /*pack=*/nullptr,
    /*release=*/brgemm::release,
    /*fallback=*/nullptr,
};
const TileKernel kKtFp8{
    /*name=*/"avx512_bf16/fp8_dp",
    /*input=*/TileInput::kFp32Rows,
    /*bf16_activations_only=*/true,
    /*keeps=*/true,
    /*applies=*/brgemm::fp8_applies,
    /*runs=*/brgemm::kt_fp8_runs,
    /*dot=*/brgemm::fp8_dp_dot,
    /*pack_bytes=*/nullptr,
    /*pack=*/nullptr,
    /*release=*/nullptr,
    /*fallback=*/&kOneDnnFp8,
    /*pack_rows=*/nullptr,
    /*quant_modes=*/kQuantAutoBit | kQuantQ8Bit,
};
// Under quant 'fp32' (exact activations), kt_ops' tiles multiply bf16(x) by the exact
// E4M3 values and apply fp8's 128-k block scales to each chunk's fp32 sums: for bf16
// hidden states every product is exact, as on a bf16 base (the LoRA forward on an fp8
// base). fp8_channel and mxfp8 compute as under kKtFp8 (exact already). oneDNN's kernel
// (AMX, AVX512_BF16 without VBMI) keeps the scales on the activations.
const TileKernel kKtFp8Exact{
    /*name=*/"avx512_bf16/fp8_dp_exact",
    /*input=*/TileInput::kFp32Rows,
    /*bf16_activations_only=*/true,
    /*keeps=*/true,
    /*applies=*/brgemm::fp8_applies,
    /*runs=*/brgemm::kt_fp8_runs,
    /*dot=*/brgemm::fp8_dp_exact_dot,
    /*pack_bytes=*/nullptr,
    /*pack=*/nullptr,
    /*release=*/nullptr,
    /*fallback=*/&kKtFp8,
    /*pack_rows=*/nullptr,
    /*quant_modes=*/kQuantFp32Bit,
};

// THE tier table, lowest first; a tier's rank is its index. Per tier: its
// name, whether this CPU runs it (and what it lacks otherwise), its streaming
// kernel families per layout (index: formats::Layout; nullptr: not
// specialized at this tier), its tile kernel families per layout (the head of
// a chain; nullptr: none at this tier), its GLU activation epilogues and its
// q8 activation quantizer. THE fallback chain: a layout a tier does not
// specialize is served by the next lower tier that does (ref has every
// streaming entry and no tile one); within a tile chain, by the entry's
// fallback. Which family computes an expert is the plan's choice
// (kernels/plan.h). Adding an ISA: its traits header (with its compiler
// flags), its instantiation file(s), and a row here. Adding a tile family:
// its kernel file, its TileKernel above in a column of a row here, and its
// break-evens in the format table (docs/architecture.md).
struct Tier {
  const char* name;
  bool (*runs)(const runtime::CpuFeatures&);
  const char* needs;
  KernelsFn layouts[3];                         // kBf16, kQint, kFp8
  const TileKernel* tiles[3];                   // kBf16, kQint, kFp8
  GluRows (*glu)(const Glu&);                   // the epilogue of each activation
  GluBackwardRows (*glu_backward)(const Glu&);  // its backward (LoRA), where vectorized
  QuantizeRowQ8 quantize_q8;
  GemmNtF32 gemm_nt = nullptr;  // the LoRA backward's fp32 products (else the BLAS)
};

const Tier kTiers[] = {
    {"ref",
     [](const runtime::CpuFeatures&) { return true; },
     "",
     {ref::bf16_kernels, ref::qint_kernels, ref::fp8_kernels},
     {nullptr, nullptr, nullptr},
     ref::glu_rows,
     ref::glu_backward_rows,
     ref::quantize_row_q8},
    {"avx2",
     [](const runtime::CpuFeatures& f) { return f.avx2; },
     "AVX2+FMA",
     {avx2::bf16_kernels, avx2::qint_kernels, avx2::fp8_kernels},
     {nullptr, nullptr, nullptr},  // oneDNN's bf16 / int8 brgemm does not run on AVX2
     avx2::glu_rows,
     avx2::glu_backward_rows,
     avx2::quantize_row_q8,
     avx2::gemm_nt_f32},
    // The weight-only fp32 path stays on AVX2 code, which every AVX-512 CPU runs;
    // so does fp8 without AVX512_VBMI (avx512::fp8_kernels chooses).
    // The tile families: oneDNN's brgemm (AVX-512 code, or AMX tiles where the
    // CPU has them) and kt_ops' AVX512_BF16 tiles, each where it runs.
    {"avx512",
     [](const runtime::CpuFeatures& f) { return f.avx512; },
     "AVX-512 F/BW/VL/DQ",
     {avx512::bf16_kernels, avx512::qint_kernels, avx512::fp8_kernels},
     {&kKtBf16, &kKtW4A8, &kKtFp8Exact},
     avx512::glu_rows,
     avx512::glu_backward_rows,
     avx512::quantize_row_q8},
    // vpdpbusd for the integer formats; the rest from the avx512 row.
    {"avx512_vnni",
     [](const runtime::CpuFeatures& f) { return f.avx512 && f.avx512_vnni; },
     "AVX-512 F/BW/VL/DQ + AVX512_VNNI",
     {nullptr, avx512_vnni::qint_kernels, nullptr},
     {nullptr, nullptr, nullptr},
     nullptr,
     nullptr,
     nullptr},
};
constexpr int kNumTiers = static_cast<int>(sizeof(kTiers) / sizeof(kTiers[0]));

bool is_built(Isa isa) {
  const Tier& t = kTiers[isa];
  for (KernelsFn k : t.layouts)
    if (k != nullptr) return true;
  return t.glu != nullptr;
}

// Why this CPU cannot run `isa`, or nullptr when it can.
const char* missing_feature(Isa isa) {
  return kTiers[isa].runs(runtime::cpu_features()) ? nullptr : kTiers[isa].needs;
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
  std::mutex mutex;  // guards isa and env_error
  Isa isa = 0;       // ref
  std::string env_error;
  // isa while no error is pending, else -1: read without the mutex (the LoRA products
  // ask per 16-column block of the forward's epilogues; two locks each were 0.4% of it).
  std::atomic<int> usable{-1};
};

void choose_first(ActiveIsa& state) {
  std::lock_guard<std::mutex> lock(state.mutex);
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
  state.usable.store(state.env_error.empty() ? state.isa : -1, std::memory_order_release);
}

ActiveIsa& active_state() {
  static ActiveIsa state;
  static const bool chosen = (choose_first(state), true);  // once, thread-safe
  (void)chosen;
  return state;
}

}  // namespace

const char* isa_name(Isa isa) { return isa >= 0 && isa < kNumTiers ? kTiers[isa].name : "?"; }

Isa parse_isa(const std::string& name) {
  std::string known;
  for (Isa i = 0; i < kNumTiers; ++i) {
    if (name == kTiers[i].name) return i;
    known += (i ? ", " : "") + std::string(kTiers[i].name);
  }
  throw std::invalid_argument("kt_ops: unknown ISA '" + name + "'; expected one of " + known);
}

std::vector<Isa> built_isas() {
  std::vector<Isa> out;
  for (Isa isa = 0; isa < kNumTiers; ++isa)
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
  const int usable = state.usable.load(std::memory_order_acquire);
  if (usable >= 0) return usable;
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
  state.usable.store(isa, std::memory_order_release);
}

const ProjectionKernels& projection_kernels(formats::Layout layout, Isa isa) {
  // The grid formats' blocks are decoded to int8 panels of the qint layout (kernels/plan.cpp).
  if (layout == formats::Layout::kGrid) layout = formats::Layout::kQint;
  for (Isa i = isa; i > 0; --i)
    if (KernelsFn k = kTiers[i].layouts[static_cast<int>(layout)]) return k();
  return kTiers[0].layouts[static_cast<int>(layout)]();
}

const TileKernel* tile_kernel(const formats::FormatRow& format, Isa isa, uint8_t quant_mode) {
  if (format.layout == formats::Layout::kGrid) return nullptr;  // no tile family (yet)
  for (Isa i = isa; i >= 0; --i) {
    const TileKernel* k = kTiers[i].tiles[static_cast<int>(format.layout)];
    if (k == nullptr) continue;
    for (; k != nullptr; k = k->fallback) {
      if ((k->quant_modes & quant_mode) == 0) continue;
      if ((k->applies == nullptr || k->applies(format)) && k->runs()) return k;
    }
    return nullptr;
  }
  return nullptr;
}

GluRows glu_rows(Isa isa, const Glu& glu) {
  for (Isa i = isa; i > 0; --i)
    if (kTiers[i].glu != nullptr) return kTiers[i].glu(glu);
  return kTiers[0].glu(glu);
}

GluBackwardRows glu_backward_rows(Isa isa, const Glu& glu) {
  for (Isa i = isa; i > 0; --i)
    if (kTiers[i].glu_backward != nullptr) return kTiers[i].glu_backward(glu);
  return kTiers[0].glu_backward(glu);
}

GemmNtF32 gemm_nt_f32(Isa isa) { return kTiers[isa].gemm_nt; }

QuantizeRowQ8 quantize_row_q8(Isa isa) {
  for (Isa i = isa; i > 0; --i)
    if (kTiers[i].quantize_q8 != nullptr) return kTiers[i].quantize_q8;
  return kTiers[0].quantize_q8;
}

}  // namespace kt::kernels
