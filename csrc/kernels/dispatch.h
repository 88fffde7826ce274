// The one ISA selection point (style rule 4): the active tier is the highest
// one that is built into this extension, detected on this CPU, and allowed by
// $KT_OPS_ISA (or kt_ops.set_isa). A format without a kernel at the chosen
// tier falls back through the declared chain avx512 -> avx2 -> ref.
#pragma once

#include <vector>

#include "kernels/isa.h"
#include "kernels/kernel_api.h"

namespace kt::kernels {

// Tiers compiled into this build (ref always).
std::vector<Isa> built_isas();
// Tiers that are built and that this CPU can run.
std::vector<Isa> supported_isas();
// The tier the ops use now.
Isa active_isa();
// Forces a tier; throws std::invalid_argument (naming the tier and the
// missing CPU feature) when it is not built or not supported here.
void set_active_isa(Isa isa);

// The bf16 expert kernels for a tier (after the fallback chain).
const Bf16Kernels& bf16_kernels(Isa isa);
// The quantized-format kernels (qint family, fp8) for a tier.
const QuantKernels& quant_kernels(Isa isa);

}  // namespace kt::kernels
