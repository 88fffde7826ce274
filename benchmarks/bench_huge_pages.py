#!/usr/bin/env python
"""Decode with the packed weights in 2 MiB pages against the same weights in 4 KiB pages.

``quantize_weights``, ``ExpertWeights.from_dense`` and the loaders put the
packed tensors in transparent huge pages (:func:`kt_ops.formats.packed.empty_huge_pages`):
a decode call streams tens of MB once, which in 4 KiB pages costs a TLB miss
per page and stops the hardware prefetchers at every page boundary. This
benchmark builds one layer (Qwen3-30B-A3B's shape, H = 2048, I = 768, top-8 of
``--experts``) per format, and a copy of it made by torch's allocator (4 KiB
pages unless ``THP_MEM_ALLOC_ENABLE=1`` or the THP mode is ``always``), and
times calls on the two alternately in one process, each after a 64 MiB read
that evicts the caches (cold weights, as between two decode steps), new
routing per pair. Medians in ms and their ratio (``huge / 4k`` below 1: the
huge pages are faster); the ratio is what holds on a shared host.

Usage::

    python benchmarks/bench_huge_pages.py [--formats bf16 int8 int4 q4_k]
        [--tokens 1 8] [--repeats 60] [--markdown] [--json PATH]

Not part of the test suite (pytest only collects ``tests/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import kt_ops
from kt_ops.formats import PackedProjection, quantize_weights
from kt_ops.formats.packed import huge_pages

HIDDEN, INTER, TOP_K = 2048, 768, 8  # Qwen3-30B-A3B's expert shape and top-k


def in_4k_pages(p: PackedProjection) -> PackedProjection:
    """The same tensors copied by torch's allocator (ordinary pages)."""

    def copy(t):
        return None if t is None else t.clone()

    return dataclasses.replace(p, weight=copy(p.weight), scales=copy(p.scales), zeros=copy(p.zeros))


def anon_huge_mb() -> int:
    """The process's anonymous memory in huge pages, MiB (0 where /proc has no count)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


def run(fmt: str, experts: int, tokens: int, repeats: int, flush: torch.Tensor) -> dict:
    g = torch.Generator().manual_seed(0)
    dense = [
        torch.randn(experts, INTER, HIDDEN, generator=g) * 0.02,
        torch.randn(experts, INTER, HIDDEN, generator=g) * 0.02,
        torch.randn(experts, HIDDEN, INTER, generator=g) * 0.02,
    ]
    huge = kt_ops.ExpertWeights(*(quantize_weights(w, fmt) for w in dense))
    del dense
    small = kt_ops.ExpertWeights(*(in_4k_pages(p) for p in huge.projections))
    x = torch.randn(tokens, HIDDEN, generator=g).bfloat16()
    times: dict[str, list[float]] = {"huge": [], "4k": []}
    for r in range(repeats + 2):
        ids = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(tokens)])
        w = torch.rand(tokens, TOP_K, generator=g)
        order = (("huge", huge), ("4k", small)) if r % 2 else (("4k", small), ("huge", huge))
        for name, layer in order:
            flush.sum()
            time.sleep(0.002)
            t0 = time.perf_counter()
            kt_ops.moe_forward(x, ids, w, layer)
            if r >= 2:  # the first two pairs warm the code paths
                times[name].append(time.perf_counter() - t0)
    a, b = statistics.median(times["4k"]), statistics.median(times["huge"])
    return {"format": fmt, "tokens": tokens, "4k_ms": a * 1e3, "huge_ms": b * 1e3, "ratio": b / a}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", nargs="+", default=["bf16", "int8", "int4", "q4_k"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--experts", type=int, default=32, help="experts in the layer (default 32)")
    ap.add_argument("--repeats", type=int, default=60, help="timed pairs per row (default 60)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    hp = huge_pages()
    print(f"huge pages: {hp}; threads {kt_ops.config.num_threads}; ISA {kt_ops.config.isa}")
    if not hp["enabled"]:
        print("kt_ops does not use huge pages here: both columns are 4 KiB pages")
    flush = torch.ones(64 << 18)  # 64 MiB of fp32
    rows = []
    for fmt in args.formats:
        for t in args.tokens:
            row = run(fmt, args.experts, t, args.repeats, flush)
            rows.append(row)
            print(
                f"{fmt:8s} T={t:<4d} 4k {row['4k_ms']:8.3f} ms  huge {row['huge_ms']:8.3f} ms  "
                f"huge/4k {row['ratio']:.3f}  (AnonHugePages {anon_huge_mb()} MiB)"
            )
    if args.markdown:
        print("\n| format | T | 4 KiB pages ms | 2 MiB pages ms | huge / 4k |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['format']} | {r['tokens']} | {r['4k_ms']:.3f} | {r['huge_ms']:.3f} "
                f"| {r['ratio']:.3f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"huge_pages": hp, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
