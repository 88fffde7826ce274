#!/usr/bin/env python
"""Time ``dense_expert_weight`` (csrc/moe/expert_weights.cpp) per expert, for every weight format.

The LoRA forward and backward (QLoRA on a quantized base included) dequantize every active
expert's gate, up and down projections to fp32 with this function, on every training step.
This script compiles csrc/moe/expert_weights.cpp (with the flags CMakeLists.txt gives it)
into a small throwaway extension (torch.utils.cpp_extension.load, ~1 min the first time),
and times the decode of one projection of ``--experts`` distinct random experts into one
reused scratch buffer, as moe_lora.cpp does, on one thread. Each repetition walks all the
experts once (their packed bytes come from DRAM, not cache, for the default sizes); the
median over ``--reps`` walks is divided by the number of experts.

Usage::

    python benchmarks/bench_dense_decode.py                  # Qwen3-30B-A3B gate [768, 2048]
    python benchmarks/bench_dense_decode.py --n 2048 --k 768  # its down projection

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

from kt_ops.formats import PackedProjection, format_spec

ROOT = Path(__file__).resolve().parents[1]

BINDING = r"""
#include <torch/extension.h>
#include <chrono>
#include "moe/expert_weights.h"

namespace {
// One projection as the op's layer description holds it (csrc/moe/moe_layer.h);
// dense_expert_weight reads the format row, the tensors and the sizes.
kt::moe::Projection projection(at::Tensor weight, c10::optional<at::Tensor> scales,
                               c10::optional<at::Tensor> zeros, const std::string& format,
                               int64_t group_size, int64_t n, int64_t k) {
  kt::moe::Projection p;
  p.format = kt::formats::find_format(format);
  TORCH_CHECK(p.format != nullptr, "unknown format ", format);
  p.weight = weight;
  p.scales = scales.value_or(at::Tensor());
  p.zeros = zeros.value_or(at::Tensor());
  p.n = n;
  p.k = k;
  p.group_size = group_size;
  return p;
}
}  // namespace

// Seconds per walk over every expert, one per repetition.
std::vector<double> time_decode(at::Tensor weight, c10::optional<at::Tensor> scales,
                                c10::optional<at::Tensor> zeros, std::string format,
                                int64_t group_size, int64_t n, int64_t k, int64_t reps) {
  const kt::moe::Projection p = projection(weight, scales, zeros, format, group_size, n, k);
  at::Tensor scratch = at::empty({kt::moe::dense_expert_weight_numel(p)}, at::kFloat);
  scratch.zero_();  // fault the pages in before timing
  std::vector<double> out;
  for (int64_t r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t e = 0; e < p.num_experts(); ++e) kt::moe::dense_expert_weight(p, e, scratch);
    out.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return out;
}

at::Tensor decode(at::Tensor weight, c10::optional<at::Tensor> scales,
                  c10::optional<at::Tensor> zeros, std::string format, int64_t group_size,
                  int64_t n, int64_t k, int64_t expert) {
  const kt::moe::Projection p = projection(weight, scales, zeros, format, group_size, n, k);
  return kt::moe::dense_expert_weight(p, expert).contiguous();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("time_decode", &time_decode);
  m.def("decode", &decode);
}
"""

# (label, format, group_size, zeros)
CASES = [
    ("bf16", "bf16", 0, False),
    ("int8", "int8", 0, False),
    ("int4 g32", "int4", 32, False),
    ("int4 g32 asym", "int4", 32, True),
    ("int4 g128", "int4", 128, False),
    ("fp8", "fp8", 128, False),
    ("mxfp4", "mxfp4", 32, False),
    ("q8_0", "q8_0", 32, False),
    ("q4_0", "q4_0", 32, False),
    ("q4_k", "q4_k", 32, True),
    ("q5_k", "q5_k", 32, True),
    ("q6_k", "q6_k", 16, False),
]


def build():
    src_dir = Path(tempfile.mkdtemp(prefix="kt_decode_bench_"))
    (src_dir / "binding.cpp").write_text(BINDING)
    return cpp_extension.load(
        name="kt_decode_bench",
        sources=[
            str(src_dir / "binding.cpp"),
            str(ROOT / "csrc/moe/expert_weights.cpp"),
            str(ROOT / "csrc/formats/format_table.cpp"),
        ],
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cflags=["-O3", "-ffp-contract=off"],
        verbose=False,
    )


def random_projection(fmt: str, E: int, n: int, k: int, gs: int, zeros: bool) -> PackedProjection:
    spec = format_spec(fmt)
    g = torch.Generator().manual_seed(0)
    shape = spec.weight_shape(E, n, k)
    if fmt == "bf16":
        weight = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
        return PackedProjection(weight, None, None, fmt, 0, n, k)
    weight = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    if fmt == "fp8":
        weight[(weight & 0x7F) == 0x7F] -= 1
    sshape = spec.scales_shape(E, n, k, gs)
    if spec.is_kquant:  # scale records: random sub-scale bytes, small finite fp16 d/dmin
        scales = torch.randint(0, 256, sshape, dtype=torch.uint8, generator=g)
        n_f16 = 32 if fmt == "q6_k" else 64
        d = (torch.rand(*sshape[:-1], n_f16 // 2, generator=g) * 1e-3).half()
        scales[..., :n_f16] = d.view(torch.uint8)
    elif spec.scale_dtype == torch.uint8:
        scales = torch.randint(100, 130, sshape, dtype=torch.uint8, generator=g)
    else:
        scales = (torch.rand(sshape, generator=g) * 0.01).to(spec.scale_dtype)
    z = (torch.rand(sshape, generator=g) * 0.01).to(spec.scale_dtype) if zeros else None
    return PackedProjection(weight, scales, z, fmt, gs, n, k).validate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=768, help="output rows (default: Qwen3 gate/up)")
    ap.add_argument("--k", type=int, default=2048, help="inputs")
    ap.add_argument("--experts", type=int, default=32, help="distinct experts per walk")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--check", action="store_true", help="also compare with dequantize_weights")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("MAX_JOBS", "2")
    ext = build()
    n, k = args.n, args.k
    print(f"dense_expert_weight, one projection [{n}, {k}], {args.experts} experts, 1 thread")
    print("| format | ms / expert | x bf16 | GB/s fp32 written |")
    print("|---|---:|---:|---:|")
    bf16_ms = None
    for label, fmt, gs, zeros in CASES:
        p = random_projection(fmt, args.experts, n, k, gs, zeros)
        times = ext.time_decode(p.weight, p.scales, p.zeros, fmt, gs, n, k, args.reps)
        ms = statistics.median(times) / args.experts * 1e3
        bf16_ms = bf16_ms or ms
        gbs = n * k * 4 / (ms * 1e-3) / 1e9
        print(f"| {label} | {ms:.3f} | {ms / bf16_ms:.2f} | {gbs:.1f} |")
        if args.check and fmt != "bf16":
            from kt_ops.formats import dequantize_weights

            one = PackedProjection(
                p.weight[:1], p.scales[:1], None if p.zeros is None else p.zeros[:1], fmt, gs, n, k
            )
            got = ext.decode(p.weight, p.scales, p.zeros, fmt, gs, n, k, 0)
            assert torch.equal(got, dequantize_weights(one)[0]), label


if __name__ == "__main__":
    main()
