// The compute-bound path on oneDNN's brgemm ukernel, through libtorch's
// at::native::cpublas::brgemm / brgemm_release (ATen/native/CPUBlas.h): the
// same oneDNN that the installed torch carries (AVX512_BF16 / VNNI kernels,
// AMX tiles where the CPU has them), no second copy. ISA-free code: oneDNN
// picks its own instructions; kt_ops decides WHETHER to call it.
//
// bf16: the packed 16-row block [ceil(k/2)][16][2] (formats/bf16.h) already
// is brgemm's VNNI B operand for N = 16 (ld_b = 16); A is the m activation
// rows rounded to bf16 (DotArgs::xb), C the fp32 dot products [m][ldo].
//
// Built only against a torch whose CPUBlas.h declares the bf16 brgemm
// (cmake/torch.cmake defines KT_HAVE_CPUBLAS_BRGEMM); otherwise available()
// is false and the streaming kernels run everywhere.
#pragma once

#include <optional>

#include "formats/format_table.h"
#include "kernels/isa.h"
#include "kernels/kernel_api.h"

namespace kt::kernels::brgemm {

// Whether this extension was built with the brgemm path (torch >= 2.6 headers).
bool built();

// The CPU class on which oneDNN runs `layout`'s brgemm natively while kt_ops
// runs on tier `isa`, or nullopt: no brgemm for that layout (not built, not a
// layout with a brgemm kernel, a tier below AVX-512, a CPU without
// AVX512_BF16, oneDNN disabled with torch.backends.mkldnn, or oneDNN refused
// a probe call). The probe runs once per process; the rest is checked per call.
std::optional<formats::BrgemmIsa> runs(formats::Layout layout, Isa isa);

// "onednn/brgemm_bf16" etc.: the name kt_ops.info() reports for `layout`, or
// nullptr when the layout has no brgemm kernel.
const char* kernel_name(formats::Layout layout);

// DotArgs -> the dot products of its run of blocks with a.xb (bf16 rows).
// Token tiles of at most kMaxTileRows rows, then one remainder tile: which
// tile a token lands in depends only on m (bit-identical for any thread count).
void bf16_dot(const DotArgs& a);

// Most A rows per brgemm call: oneDNN generates (JIT) one kernel per distinct
// M per thread, so M is capped.
constexpr int kMaxTileRows = 64;

// Releases the calling thread's brgemm hardware context (AMX tile
// configuration): once after each thread's tile loop.
void release();

}  // namespace kt::kernels::brgemm
