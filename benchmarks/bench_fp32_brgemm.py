#!/usr/bin/env python
"""The weight-only fp32 path's dense product: kt_ops' FMA tiles against oneDNN's fp32 brgemm.

The weight-only path (``kt_ops.set_quant_activations('fp32')``, and ``'auto'`` from a
format's ``fp32_min_tokens``; docs/formats.md, "Compute paths") decodes each 16-row block
to fp32 ``W^T [Kp][16]`` in a per-thread buffer, then multiplies it with the expert's
fp32 token rows: ``dense_dot`` in ``csrc/kernels/avx2/moe_quant_avx2.cpp``, the tier
fallback of every x86 tier. libtorch's ``at::native::cpublas::brgemm`` has an fp32
kernel (oneDNN's brgemm ukernel; on AVX2 CPUs the one type it runs) that takes that same
buffer as its B operand (``ld_b = 16``, no VNNI packing). This script measures the two on
the same blocks, one thread, B in cache (as the decoded block is), A contiguous rows
(``dense_dot`` reads row pointers), and checks that they agree bit for bit.

It compiles kt_ops' AVX2 tier source (and the ref tier it calls) from this checkout into
a throwaway extension with the tier's flags (torch.utils.cpp_extension.load_inline, ~1
min the first time), so the timed kernel is the one the build ships.

Usage::

    python benchmarks/bench_fp32_brgemm.py                      # oneDNN's best ISA here
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_fp32_brgemm.py   # its AVX2 kernel

Not part of the test suite.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[1]

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>

#include <chrono>

// The tier's translation units, as the build compiles them (AVX2 flags below).
#include "kernels/ref/moe_quant_ref.cpp"
#include "kernels/avx2/moe_quant_avx2.cpp"

// A [m][kp] fp32 rows, W [blocks][kp][16] decoded blocks. Best seconds over
// `reps` walks of all blocks for kt_ops' dense_dot and for the fp32 brgemm
// (one call per block and tile of at most 64 rows, as the driver would make),
// then the number of output elements that differ.
std::vector<double> compare(at::Tensor A, at::Tensor W, int64_t reps) {
  const int m = static_cast<int>(A.size(0));
  const int64_t kp = A.size(1), blocks = W.size(0), ldo = 16 * blocks;
  const float* a = A.data_ptr<float>();
  const float* w = W.data_ptr<float>();
  std::vector<const float*> rows(m);
  for (int i = 0; i < m; ++i) rows[i] = a + i * kp;
  std::vector<float> kt(static_cast<size_t>(m) * ldo), dnnl(kt.size());
  double best_kt = 1e30, best_dnnl = 1e30;
  for (int64_t r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t b = 0; b < blocks; ++b)
      kt::kernels::avx2::dense_dot(rows.data(), m, w + b * kp * 16, kp, kt.data() + b * 16, ldo);
    const auto t1 = std::chrono::steady_clock::now();
    for (int64_t b = 0; b < blocks; ++b)
      for (int i = 0; i < m; i += 64)
        at::native::cpublas::brgemm(std::min(64, m - i), 16, kp, kp, 16, ldo, false, a + i * kp,
                                    w + b * kp * 16, dnnl.data() + i * ldo + b * 16, false);
    const auto t2 = std::chrono::steady_clock::now();
    best_kt = std::min(best_kt, std::chrono::duration<double>(t1 - t0).count());
    best_dnnl = std::min(best_dnnl, std::chrono::duration<double>(t2 - t1).count());
  }
  at::native::cpublas::brgemm_release(false);
  int64_t differ = 0;
  for (size_t j = 0; j < kt.size(); ++j) differ += kt[j] != dnnl[j];
  return {best_kt, best_dnnl, static_cast<double>(differ)};
}
"""


def build():
    return cpp_extension.load_inline(
        name="kt_fp32_brgemm_bench",
        cpp_sources=SOURCE,
        functions=["compare"],
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c"],
        verbose=False,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=2048, help="K of the blocks (multiple of 32)")
    p.add_argument("--tokens", type=int, nargs="+", default=[6, 7, 8, 9, 12, 13, 16, 32, 64])
    p.add_argument("--blocks", type=int, default=8, help="16-row blocks per walk")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    mod = build()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.blocks, args.k, 16, generator=g)
    print(
        f"# one thread, K = {args.k}, {args.blocks} blocks of 16 rows in cache, best of "
        f"{args.reps}; GFLOP/s"
    )
    print(" m   kt_ops dense_dot   oneDNN fp32 brgemm   oneDNN speed / kt   outputs differing")
    for m in args.tokens:
        a = torch.randn(m, args.k, generator=g)
        t_kt, t_dnnl, differ = mod.compare(a, w, args.reps)
        flop = 2.0 * m * args.k * 16 * args.blocks
        print(
            f"{m:3d}   {flop / t_kt / 1e9:16.1f}   {flop / t_dnnl / 1e9:18.1f}"
            f"   {t_kt / t_dnnl:17.2f}   {int(differ):17d}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
