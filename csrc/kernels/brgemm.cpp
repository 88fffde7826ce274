#include "kernels/brgemm.h"

#include <algorithm>
#include <exception>
#include <mutex>

#include "formats/bf16.h"
#include "kernels/dispatch.h"
#include "runtime/cpu_features.h"

#ifdef KT_HAVE_CPUBLAS_BRGEMM
#include <ATen/Context.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#endif

namespace kt::kernels::brgemm {

namespace {

#ifdef KT_HAVE_CPUBLAS_BRGEMM
// One bf16 brgemm call on the calling thread: a 1 x 16 x 2 product with known
// bits. oneDNN throws (c10::Error or dnnl::error) where it does not run the
// type, e.g. "could not generate a kernel" on AVX-512 without BF16, or where
// torch.backends.mkldnn is off.
bool probe_bf16() {
  try {
    alignas(64) c10::BFloat16 a[2] = {c10::BFloat16(1.0f), c10::BFloat16(2.0f)};
    alignas(64) c10::BFloat16 b[32];
    for (int r = 0; r < 16; ++r) {
      b[2 * r] = c10::BFloat16(static_cast<float>(r));
      b[2 * r + 1] = c10::BFloat16(0.5f);
    }
    alignas(64) float c[16] = {};
    at::native::cpublas::brgemm(1, 16, 2, 2, 16, 16, false, a, b, c, true);
    at::native::cpublas::brgemm_release(true);
    for (int r = 0; r < 16; ++r)
      if (c[r] != static_cast<float>(r) + 1.0f) return false;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}
#endif

bool bf16_probed_ok() {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  static const bool ok = probe_bf16();
  return ok;
#else
  return false;
#endif
}

}  // namespace

bool built() {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  return true;
#else
  return false;
#endif
}

std::optional<formats::BrgemmIsa> runs(formats::Layout layout, Isa isa) {
  if (layout != formats::Layout::kBf16 || !built()) return std::nullopt;
  // oneDNN's bf16 kernels are AVX-512 code: not under a tier below AVX-512
  // (KT_OPS_ISA=avx2 means no AVX-512 instruction from kt_ops).
  static const Isa kAvx512 = parse_isa("avx512");
  if (isa < kAvx512) return std::nullopt;
  const runtime::CpuFeatures& f = runtime::cpu_features();
  if (!f.avx512_bf16 && !f.amx) return std::nullopt;  // oneDNN emulates or refuses
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  if (!at::globalContext().userEnabledMkldnn()) return std::nullopt;
#endif
  if (!bf16_probed_ok()) return std::nullopt;
  return f.amx ? formats::BrgemmIsa::kAmx : formats::BrgemmIsa::kAvx512;
}

const char* kernel_name(formats::Layout layout) {
  return layout == formats::Layout::kBf16 ? "onednn/brgemm_bf16" : nullptr;
}

void bf16_dot(const DotArgs& a) {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  const int64_t k = 2 * formats::bf16_k_pairs(a.proj->k);  // even: the VNNI pairs
  const auto* xb = reinterpret_cast<const c10::BFloat16*>(a.xb);
  for (int64_t nb = a.nb_begin; nb < a.nb_end; ++nb) {
    const auto* w = reinterpret_cast<const c10::BFloat16*>(a.proj->block(a.expert, nb));
    float* out = a.out + 16 * (nb - a.nb_begin);
    for (int i = 0; i < a.m; i += kMaxTileRows) {
      const int rows = std::min(kMaxTileRows, a.m - i);
      at::native::cpublas::brgemm(rows, 16, k, a.ldxb, 16, a.ldo, false, xb + i * a.ldxb, w,
                                  out + i * a.ldo, true);
    }
  }
#endif
}

void release() {
#ifdef KT_HAVE_CPUBLAS_BRGEMM
  at::native::cpublas::brgemm_release(true);
#endif
}

}  // namespace kt::kernels::brgemm
