// The LoRA backward's transposed weights, made once instead of at every backward
// (kt_ops.ExpertWeights.with_backward_panels; Projection::backward_panels).
//
// Why: the backward's products with the frozen base (go Wd^T, dg Wg + du Wu) reduce
// over the forward's output rows n, so their bf16 operands (kt_ops' vdpbf16ps kernel,
// oneDNN's brgemm) pair the weights along n while the forward's blocks pair them along
// k: every backward transposes each expert's three projections into VNNI panels
// (bf16_vnni_panel). Kept, the panels are read as they are, streamed from DRAM, for the
// memory of a bf16 copy of the weights (2 bytes per weight: as much again as a bf16
// base, twice an int8 one). Two widths, one per kernel: kt_ops' kernel reads 16-column
// slices (the next one prefetched while it multiplies); oneDNN's brgemm reads 64-column
// panels as one N = 64 call (or 16-column ones as N = 16 calls). Measured on Zen 4
// (Qwen3-30B-A3B layer, T = 512, 2 threads, same process; docs/lora.md): kt_ops' kernel
// 135 -> 124 ms on a bf16 base, 192 -> 155 ms on int8; oneDNN's (the AMX backward's
// kernel, forced here) 163 -> 118 ms on bf16 (138 with 16-wide panels), 198 -> 152 ms
// on int8.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "kernels/kernel_api.h"
#include "moe/moe_layer.h"

namespace kt::moe {

// The panel widths (output columns of W per panel) the backward reads kept panels in:
// kt_ops' vdpbf16ps kernel multiplies 16-column slices; oneDNN's brgemm (the AMX
// kernel) reads any width, and 64 columns make one N = 64 call where 16 make four
// N = 16 calls (the shape AMX tiles are slowest at).
constexpr int64_t kPanelWidthKt = 16;
constexpr int64_t kPanelWidthOnednn = 64;

// Whether the LoRA backward's products with the base run on kt_ops' own vdpbf16ps
// kernel (kernels::avx512::bf16_dp_panel) rather than oneDNN's brgemm (moe/moe_lora.cpp).
bool backward_on_kt_kernel();

// Projection p's backward panels: bf16 [E, k/w, w n], panel s of expert e =
// bf16_vnni_panel(p, e, w s, w) ([n/2][w][2]: pairs of rows of W, exact values, the
// scales of int8 / fp8 left out as there). w: `width` (16 or 64; 0: 16 where the
// backward runs on kt_ops' kernel, else 64), 16 where that does not divide k. An
// undefined tensor where this CPU and build make no such panels
// (!bf16_vnni_panel_applies(p): another format, or no AVX-512). Built on kt_ops' pool,
// one expert per task.
at::Tensor make_backward_panels(const Projection& p, int64_t width = 0);

// The width of p's backward panels (0 where it has none).
inline int64_t backward_panel_width(const Projection& p) {
  return p.backward_panels.defined() ? p.k / p.backward_panels.size(1) : 0;
}

// Expert e's panel that starts at column k0 (a multiple of the width) in p's backward
// panels, or nullptr where p has none: in every width the panel of columns
// [k0, k0 + w) of expert e starts (e k + k0) n values in.
inline const uint16_t* backward_panel_slice(const Projection& p, int64_t e, int64_t k0) {
  if (!p.backward_panels.defined()) return nullptr;
  const auto* base = static_cast<const uint16_t*>(p.backward_panels.data_ptr());
  return base + (e * p.k + k0) * p.n;
}

// The lines of a slice from backward_panel_slice, for the kernel to prefetch while it
// multiplies the slice before: 16 n bf16, n / 2 lines in a row.
inline kernels::PrefetchChunks backward_panel_prefetch(const uint16_t* slice, int64_t n) {
  kernels::PrefetchChunks pf;
  pf.base = slice;
  pf.stride = 8 * 64;
  pf.chunk_lines_log2 = 3;
  pf.lines = n / 2;
  return pf;
}

}  // namespace kt::moe
