#!/usr/bin/env python
"""Fixed cost of one ``kt.moe_forward`` call: Python, dispatcher, autograd kernel, checks.

A decode step (T = 1) of a real layer streams 19-76 MB in about a millisecond,
so whatever a call costs outside the weight stream shows in its bandwidth. This
benchmark times calls on a layer so small (E = 8, H = 256, I = 128, int8,
top-2) that the kernels take a few microseconds and the rest is the fixed
cost, through each way in:

* ``module``: ``kt_ops.nn.MoEExperts`` (what ``kt_ops.hf.replace_experts`` installs);
* ``wrapper``: ``kt_ops.moe_forward(x, ids, w, experts)``;
* ``op``: ``torch.ops.kt.moe_forward.default`` on prebuilt layer arguments;
* ``KTMoEWrapper``: ``forward`` of kt-kernel's API (:mod:`kt_ops.compat`), with one
  of the 8 experts on the GPU (its mask), as a serving engine calls it per layer;

each under ``torch.no_grad()`` (how ``generate`` runs) and
``torch.inference_mode()`` (which skips the Autograd dispatch key), and, for
reference, ``torch.add`` on two 256-element tensors. ``hot``: the median over
tight loops; ``cold``: the median of single calls after a 96 MiB read has
evicted the caches, as between two decode steps (each call's own code and
data then come from DRAM). Medians in microseconds; noisy on a shared host:
compare the rows of one run.

Usage::

    python benchmarks/bench_call_overhead.py [--markdown] [--json PATH]

Not part of the test suite (pytest only collects ``tests/``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

import kt_ops
from kt_ops.compat import KTMoEWrapper
from kt_ops.layer import layer_args
from kt_ops.nn import MoEExperts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import Flusher  # noqa: E402  (benchmarks/ is a folder of scripts)

NUM_EXPERTS, HIDDEN, INTER = 8, 256, 128


def hot_us(fn: Callable[[], object], calls: int, rounds: int = 5) -> float:
    for _ in range(min(calls, 200)):
        fn()
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def cold_us(fn: Callable[[], object], calls: int, flush: Flusher) -> float:
    samples = []
    for _ in range(calls):
        flush()
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hot-calls", type=int, default=5000, help="calls per hot round")
    p.add_argument("--cold-calls", type=int, default=200, help="cold calls per row")
    p.add_argument("--markdown", action="store_true", help="also print a markdown table")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = p.parse_args(argv)

    gen = torch.Generator().manual_seed(0)
    shapes = ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER))
    dense = [torch.randn(NUM_EXPERTS, n, k, generator=gen) / k**0.5 for n, k in shapes]
    module = MoEExperts.from_dense(*dense, "int8").eval()
    experts = module.expert_weights()
    x = torch.randn(1, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([[0, 3]])
    w = torch.tensor([[0.6, 0.4]])
    op_args = (x, ids, w, *layer_args(experts, None, "silu", x))
    op = torch.ops.kt.moe_forward.default
    KTMoEWrapper._threads_configured = True  # keep this process' thread settings
    mask = torch.zeros(NUM_EXPERTS, dtype=torch.bool)
    mask[7] = True
    wrapper = KTMoEWrapper(
        layer_idx=0,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=2,
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        gpu_experts_mask=mask,
        cpuinfer_threads=kt_ops.get_num_threads(),
        threadpool_count=1,
        weight_path=None,
        chunked_prefill_size=64,
        method="MOE_INT8",
    )
    wrapper.load_weights_from_tensors(*dense)
    paths = {
        "module": lambda: module(x, ids, w),
        "wrapper": lambda: kt_ops.moe_forward(x, ids, w, experts),
        "op": lambda: op(*op_args),
        "KTMoEWrapper": lambda: wrapper.forward(x, ids, w),
        "torch.add": lambda: torch.add(x, x),
    }
    flush = Flusher()
    rows = []
    for name, fn in paths.items():
        for mode, ctx in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
            with ctx():
                rows.append(
                    {
                        "label": f"{name} {mode}",
                        "tokens": 1,
                        "hot_us": hot_us(fn, args.hot_calls),
                        "cold_us": cold_us(fn, args.cold_calls, flush),
                    }
                )
    for r in rows:
        r["ms"] = r["cold_us"] / 1e3  # scripts/compare_trees.py compares "ms"
    threads = kt_ops.get_num_threads()
    print(f"# kt_ops {kt_ops.__version__} threads={threads}; torch {torch.__version__}")
    print(f"{'path':28s} {'hot us':>8s} {'cold us':>8s}")
    for r in rows:
        print(f"{r['label']:28s} {r['hot_us']:8.1f} {r['cold_us']:8.1f}")
    if args.markdown:
        print("\n| path | hot µs | cold µs |\n|---|---:|---:|")
        for r in rows:
            print(f"| {r['label']} | {r['hot_us']:.1f} | {r['cold_us']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
