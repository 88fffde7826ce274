// The one ISA selection point (style rule 4): the active tier is the highest
// one that is built into this extension, detected on this CPU, and allowed by
// $KT_OPS_ISA (or kt_ops.set_isa). The kernels of a (layout, tier) pair, the
// streaming and the tile (matrix-engine) families, come from one table with
// one declared fallback chain (dispatch.cpp).
#pragma once

#include <vector>

#include "formats/format_table.h"
#include "kernels/activations.h"
#include "kernels/gemm_nt.h"
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

// The streaming kernels of `layout` on tier `isa`, after the fallback chain.
const ProjectionKernels& projection_kernels(formats::Layout layout, Isa isa);
// The tile kernel that computes `format`'s products on tier `isa` in this
// process now: the first of the tier table's chain for the format's layout
// (at `isa` or the next lower tier that has one) that applies to the format
// and runs; nullptr: none (the streaming kernels compute). Which experts it
// takes is the plan's decision (kernels/plan.h). quant_mode: a QuantModeBits bit;
// kernels whose TileKernel::quant_modes lack it are skipped.
const TileKernel* tile_kernel(const formats::FormatRow& format, Isa isa,
                              uint8_t quant_mode = kQuantAutoBit);
// The GLU epilogue act(g) * u of activation `a` on tier `isa` (kernels/activations.h).
GluRows glu_rows(Isa isa, const Glu& glu);
// Its backward over lines of 16 (the LoRA backward), or nullptr: the scalar glu_backward.
GluBackwardRows glu_backward_rows(Isa isa, const Glu& glu);
// The q8 activation quantizer of tier `isa`.
QuantizeRowQ8 quantize_row_q8(Isa isa);
// Tier `isa`'s own fp32 NT product for the LoRA backward (kernels/gemm_nt.h), or nullptr:
// the BLAS computes it. No fallback to a lower tier: a tier without one (AVX-512) keeps
// the BLAS's kernels for its own vector width.
GemmNtF32 gemm_nt_f32(Isa isa);

}  // namespace kt::kernels
