#!/usr/bin/env python
"""Benchmark a LoRA training step through the routed experts: kt_ops vs PyTorch eager.

For one MoE layer (default: Qwen3-30B-A3B shapes with fewer experts, so the
dense fp32 baseline fits: hidden 2048, expert intermediate 768, 64 experts,
top-8) with LoRA of rank r on the gate, up and down projections, this times
forward + backward (``loss.backward()``) of

* ``kt save``      -- ``kt_ops.moe_forward`` saving the gate/up pre-activations
  (``kt.moe_forward_train``; activation checkpointing off, the default);
* ``kt recompute`` -- the same with activation checkpointing on
  (``kt.moe_forward``; backward recomputes the pre-activations);
* ``torch``        -- an eager PyTorch loop over the experts hit (the dense
  fp32 reference of tests/reference.py: ``x @ W.T + s * (x @ A.T) @ B.T`` per
  projection, ``silu(g) * u``, ``index_add``) on pre-dequantized fp32 weights,
  differentiated by autograd;

and the forward alone (``torch.no_grad``) of kt with LoRA. kt runs at 1 and at
the full thread count (``kt_ops.set_num_threads``); torch at its own full
thread count. Fresh routing every repetition; medians of ``--reps``.

Usage::

    python benchmarks/bench_lora.py                    # T = 128, 512
    python benchmarks/bench_lora.py --tokens 64 --experts 32 --rank 8

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import kt_ops


def routing(T: int, E: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    vals, ids = torch.topk(torch.randn(T, E, generator=g), K, dim=1)
    return ids, torch.softmax(vals, dim=1)


def torch_experts(x, ids, w, dense, lora, s):
    """Eager reference: loop over the experts hit, autograd through plain ops."""
    wg, wu, wd = dense
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        xe = x[tok]

        def proj(v, W, p, e=e):
            a, b = lora[f"{p}_lora_a"][e], lora[f"{p}_lora_b"][e]
            return F.linear(v, W[e]) + s * F.linear(F.linear(v, a), b)

        h = F.silu(proj(xe, wg, "gate")) * proj(xe, wu, "up")
        out = out.index_add(0, tok, proj(h, wd, "down") * w[tok, slot, None])
    return out


def median_ms(fn, reps: int) -> float:
    fn(0)  # untimed lead call
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i + 1)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    E, H, I, K, r = args.experts, args.hidden, args.intermediate, args.top_k, args.rank  # noqa: E741
    g = torch.Generator().manual_seed(0)
    dense = [
        (torch.randn(E, n, k, generator=g) / k**0.5).to(torch.bfloat16).float()
        for n, k in ((I, H), (I, H), (H, I))
    ]
    packed = kt_ops.ExpertWeights.from_dense(*dense, "bf16")
    dims = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    lora = {}
    for p, (n, k) in dims.items():
        lora[f"{p}_lora_a"] = (torch.randn(E, r, k, generator=g) / k**0.5).requires_grad_()
        lora[f"{p}_lora_b"] = (torch.randn(E, n, r, generator=g) * 0.01).requires_grad_()
    s = 2.0
    full = kt_ops.get_num_threads()
    print(
        f"E={E} H={H} I={I} K={K} r={r}; kt threads 1 and {full}, torch threads "
        f"{torch.get_num_threads()}; ISA {kt_ops.active_isa()}; medians of {args.reps} (ms)"
    )
    print(f"{'T':>5} {'case':<24} {'ms':>9}")
    for T in args.tokens:
        x0 = torch.randn(T, H, generator=g)
        for name, ms in bench_tokens(T, E, K, I, x0, packed, dense, lora, s, full, args.reps):
            print(f"{T:>5} {name:<24} {ms:>9.1f}")


def lora_weights(lora: dict, scaling: float) -> kt_ops.LoRAWeights:
    """``{p}_lora_{a,b}`` factors as the op's :class:`kt_ops.LoRAWeights`."""
    pairs = {p: (lora[f"{p}_lora_a"], lora[f"{p}_lora_b"]) for p in ("gate", "up", "down")}
    return kt_ops.LoRAWeights(**pairs, scaling=scaling)


def bench_tokens(T, E, K, I, x0, packed, dense, lora, s, full, reps):  # noqa: E741
    def kt_step(ckpt):
        def run(i):
            ids, w = routing(T, E, K, i)
            x = x0.clone().requires_grad_()
            out = kt_ops.moe_forward(
                x, ids, w, packed, lora_weights(lora, s), activation_checkpointing=ckpt
            )
            out.square().mean().backward()

        return run

    def kt_forward(i):
        ids, w = routing(T, E, K, i)
        with torch.no_grad():
            kt_ops.moe_forward(x0, ids, w, packed, lora_weights(lora, s))

    def torch_step(i):
        ids, w = routing(T, E, K, i)
        x = x0.clone().requires_grad_()
        torch_experts(x, ids, w, dense, lora, s).square().mean().backward()

    rows = []
    for threads in sorted({1, full}):
        kt_ops.set_num_threads(threads)
        rows.append((f"kt forward ({threads}t)", median_ms(kt_forward, reps)))
        rows.append((f"kt save step ({threads}t)", median_ms(kt_step(False), reps)))
        rows.append((f"kt recompute step ({threads}t)", median_ms(kt_step(True), reps)))
    kt_ops.set_num_threads(full)
    rows.append(("torch eager step", median_ms(torch_step, reps)))
    return rows


if __name__ == "__main__":
    main()
