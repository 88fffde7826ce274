#!/usr/bin/env python
"""Inference with an unmerged LoRA adapter: the base alone vs LoRA in exact mode vs LoRA on q8.

For one MoE layer (Qwen3-30B-A3B: hidden 2048, expert intermediate 768, 128 experts,
top-8; 8 distinct experts' packed tensors tiled to 128, as bench_formats.py does) and
each base format and T, times ``kt_ops.moe_forward`` without autograd:

* ``base``       -- no LoRA (the ISA kernels under ``quant_activations='auto'``);
* ``lora exact`` -- with rank-r LoRA on gate, up and down (the exact forward: fp32
  activations times the exact weights, what training computes);
* ``lora q8``    -- the same LoRA under ``quant_activations='q8'``: the base's kernels
  with the LoRA terms in their epilogues (docs/lora.md, "Generating with an unmerged
  adapter on a quantized base").

The three run interleaved with fresh seeded routing per repetition (weights read from
DRAM, as in decode); medians in ms and each LoRA row's ratio to the base::

    python benchmarks/bench_lora_inference.py --formats int4-g128 q4_k int8 --tokens 1 8
    python benchmarks/bench_lora_inference.py --lora-dtype bf16   # a serving engine's adapter
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import kt_ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_formats import build_variant, parse_variant  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=["int4-g128", "q4_k", "int8", "bf16"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument(
        "--lora-dtype",
        choices=["fp32", "bf16", "fp16"],
        default="fp32",
        help="dtype of the LoRA factors (PEFT keeps fp32 adapters by default; serving "
        "engines cast them to the model's bf16)",
    )
    p.add_argument("--repeats", type=int, default=101)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    args = p.parse_args()
    E, K, H, I, r = args.experts, args.top_k, 2048, 768, args.rank  # noqa: E741
    g = torch.Generator().manual_seed(0)
    dense = (
        torch.randn(8, I, H, generator=g) / H**0.5,
        torch.randn(8, I, H, generator=g) / H**0.5,
        torch.randn(8, H, I, generator=g) / I**0.5,
    )

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.lora_dtype]

    def factor(*shape):
        return (torch.randn(*shape, generator=g) * 0.01).to(dtype)

    lora = kt_ops.LoRAWeights(
        gate=(factor(E, r, H), factor(E, I, r)),
        up=(factor(E, r, H), factor(E, I, r)),
        down=(factor(E, r, I), factor(E, H, r)),
        scaling=2.0,
    )
    sides = (("base", None, "auto"), ("lora exact", lora, "auto"), ("lora q8", lora, "q8"))
    print(
        f"# H={H} I={I} E={E} top-{K}, {args.lora_dtype} LoRA rank {r} on gate/up/down, "
        f"isa {kt_ops.active_isa()}, {kt_ops.get_num_threads()} threads; ms, medians"
    )
    print(f"{'format':>10s} {'T':>3s} " + " ".join(f"{s:>11s}" for s, _, _ in sides) + "  ratios")
    for fmt in args.formats:
        experts = build_variant(parse_variant(fmt), dense, E).experts
        for T in args.tokens:
            x = torch.randn(T, H, generator=g).bfloat16()
            times = {name: [] for name, _, _ in sides}
            with torch.no_grad():
                for rep in range(args.repeats + 3):
                    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
                    w = torch.full((T, K), 1.0 / K)
                    for name, lw, mode in sides:
                        with kt_ops.use_quant_activations(mode):
                            t0 = time.perf_counter()
                            kt_ops.moe_forward(x, ids, w, experts, lw)
                            if rep >= 3:  # warm-up calls
                                times[name].append(time.perf_counter() - t0)
            ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
            ratios = " ".join(f"{ms[n] / ms['base']:.2f}x" for n, _, _ in sides[1:])
            cells = " ".join(f"{ms[n]:11.3f}" for n, _, _ in sides)
            print(f"{fmt:>10s} {T:3d} {cells}  {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
