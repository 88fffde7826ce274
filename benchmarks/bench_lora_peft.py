#!/usr/bin/env python
"""LoRA training step of one MoE layer: kt_ops vs PyTorch eager + PEFT, tokens/s, one process.

For one routed-experts layer (default: Qwen3-30B-A3B, hidden 2048, expert intermediate 768,
128 experts, top-8) with rank-16 LoRA on gate, up and down, this times forward + backward
(``loss.backward()``, gradients of the hidden states, routing weights and adapters) of

* ``kt``   -- :class:`kt_ops.nn.MoEExperts` (bf16 packed weights) with kt_ops LoRA
  (:func:`kt_ops.lora.add_lora`, fp32 adapters, PEFT's fused gate/up parametrisation):
  ``kt.moe_forward`` + ``kt::moe_backward``;
* ``peft`` -- transformers' own ``Qwen3MoeExperts`` (bf16 ``gate_up_proj``/``down_proj``,
  ``config._experts_implementation``: ``eager`` = the loop over the experts hit, or
  ``grouped_mm`` / ``batched_mm``) with PEFT LoRA on both parameters
  (``LoraConfig(target_parameters=["gate_up_proj", "down_proj"])``, PEFT's ParamWrapper;
  adapters in the parameter dtype, PEFT's default),

on the same adapter values (PEFT's random init, B nonzero, imported into kt_ops with
:mod:`kt_ops.peft_adapters`), the same hidden states (bf16) and routing (random distinct top-k
experts, softmax weights; fresh per repetition), at the same thread count. Tokens/s is
``T / median(seconds)``; the speed-up is peft time / kt time. The first call of each T
compares the two outputs and hidden-state gradients (max |diff| / max |value|; both use bf16
weights, PEFT computes in bf16, kt in fp32), a sanity check.

Usage::

    python benchmarks/bench_lora_peft.py                 # Qwen3-30B-A3B layer, T = 512, 2048
    python benchmarks/bench_lora_peft.py --quick         # small layer, T = 64, 256 (seconds)
    python benchmarks/bench_lora_peft.py --tokens 512 --reps 3 --peft-impl grouped_mm

Not part of the test suite. The big shapes take minutes on two cores (PEFT's eager path
rebuilds W + dW for all 128 experts every call); run them once.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

import kt_ops
from kt_ops.nn import MoEExperts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import Shape, render_table  # noqa: E402  (benchmarks/ holds scripts, not a package)

QWEN3 = Shape("Qwen3-30B-A3B", 2048, 768, 128, 8)
QUICK = Shape("quick", 512, 256, 32, 4)


class Holder(nn.Module):
    """A parent for the experts module: PEFT and kt_ops.peft_adapters address it as ``experts``."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts


def build(shape: Shape, rank: int, alpha: float, impl: str, seed: int):
    """``(peft_model, kt_experts)`` with the same base weights and the same adapter values."""
    import peft
    import transformers
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from kt_ops import peft_adapters

    config = transformers.Qwen3MoeConfig(
        hidden_size=shape.hidden,
        moe_intermediate_size=shape.intermediate,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        hidden_act="silu",
    )
    config._experts_implementation = impl
    torch.manual_seed(seed)
    experts = Qwen3MoeExperts(config)
    H, inter = shape.hidden, shape.intermediate
    with torch.no_grad():
        experts.gate_up_proj.normal_(0.0, H**-0.5)
        experts.down_proj.normal_(0.0, inter**-0.5)
    experts = experts.to(torch.bfloat16)
    kt = MoEExperts.from_dense(
        experts.gate_up_proj[:, :inter], experts.gate_up_proj[:, inter:], experts.down_proj
    )
    lora_config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_parameters=["gate_up_proj", "down_proj"],
        init_lora_weights=False,  # random A and B: the LoRA path really computes something
    )
    model = peft.get_peft_model(Holder(experts), lora_config)
    with torch.no_grad():  # B of the size a few training steps give
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.01)
    tensors = peft.get_peft_model_state_dict(model)
    tensors = {
        k if k.startswith("base_model.") else "base_model.model." + k: v for k, v in tensors.items()
    }
    holder = Holder(kt)
    peft_adapters.load_adapter_weights(holder, tensors, lora_config, trainable=True)
    return model, kt


def routing(shape: Shape, T: int, gen: torch.Generator):
    x = torch.randn(T, shape.hidden, generator=gen).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(T, shape.experts, generator=gen), dim=-1)
    weights, ids = torch.topk(probs, shape.top_k, dim=-1)
    return x, ids, (weights / weights.sum(-1, keepdim=True)).float()


def step(fn, x, ids, w, grad_out):
    """One forward + backward; returns (seconds, output, grad of x)."""
    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    t0 = time.perf_counter()
    out = fn(x, ids, w)
    (out.float() * grad_out).sum().backward()
    dt = time.perf_counter() - t0
    return dt, out.detach(), x.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@dataclass
class Row:
    tokens: int
    reps: int
    kt_ms: float
    peft_ms: Optional[float]
    out_rel: Optional[float]
    grad_rel: Optional[float]

    @property
    def kt_tps(self) -> float:
        return 1e3 * self.tokens / self.kt_ms

    @property
    def peft_tps(self) -> Optional[float]:
        return None if self.peft_ms is None else 1e3 * self.tokens / self.peft_ms


def bench(shape, T, peft_model, kt, reps, warmup, seed, skip_peft) -> Row:
    gen = torch.Generator().manual_seed(seed + T)
    inputs = [routing(shape, T, gen) for _ in range(warmup + reps)]
    grad_out = torch.randn(T, shape.hidden, generator=gen)
    peft_fn = peft_model.base_model.model.experts  # the ParamWrapper chain: PEFT LoRA active

    def kt_fn(x, ids, w):
        return kt(x, ids, w)

    def peft_call(x, ids, w):
        return peft_fn(x, ids, w.to(x.dtype))

    kt_s, peft_s, out_rel, grad_rel = [], [], None, None
    for i, (x, ids, w) in enumerate(inputs):
        order = [("kt", kt_fn)] + ([] if skip_peft else [("peft", peft_call)])
        if i % 2:
            order.reverse()  # alternate which side runs first
        got = {}
        for name, fn in order:
            for p in list(kt.parameters()) + list(peft_model.parameters()):
                p.grad = None
            got[name] = step(fn, x, ids, w, grad_out)
        if i == 0 and not skip_peft:
            out_rel = rel(got["kt"][1], got["peft"][1])
            grad_rel = rel(got["kt"][2], got["peft"][2])
        if i >= warmup:
            kt_s.append(got["kt"][0])
            if not skip_peft:
                peft_s.append(got["peft"][0])
    return Row(
        T,
        reps,
        1e3 * statistics.median(kt_s),
        1e3 * statistics.median(peft_s) if peft_s else None,
        out_rel,
        grad_rel,
    )


def table(rows: list[Row], markdown: bool) -> str:
    head = [
        "T",
        "reps",
        "kt ms",
        "PEFT ms",
        "kt tok/s",
        "PEFT tok/s",
        "speed-up",
        "out diff",
        "dx diff",
    ]
    body = []
    for r in rows:
        body.append(
            [
                str(r.tokens),
                str(r.reps),
                f"{r.kt_ms:.1f}",
                "n/a" if r.peft_ms is None else f"{r.peft_ms:.1f}",
                f"{r.kt_tps:.1f}",
                "n/a" if r.peft_tps is None else f"{r.peft_tps:.1f}",
                "n/a" if r.peft_ms is None else f"{r.peft_ms / r.kt_ms:.2f}x",
                "n/a" if r.out_rel is None else f"{r.out_rel:.1e}",
                "n/a" if r.grad_rel is None else f"{r.grad_rel:.1e}",
            ]
        )
    return render_table(head, body, markdown)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help=f"small layer {QUICK}, T = 64, 256")
    p.add_argument("--tokens", type=int, nargs="+", help="token counts (default 512 2048)")
    p.add_argument("--experts", type=int, help="override the expert count (memory)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per T (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, help="kt_ops and torch threads (default: kt_ops')")
    p.add_argument(
        "--peft-impl",
        choices=("eager", "grouped_mm", "batched_mm"),
        default="eager",
        help="transformers experts implementation under PEFT (default eager)",
    )
    p.add_argument("--no-peft", action="store_true", help="time kt_ops only")
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    shape = QUICK if args.quick else QWEN3
    if args.experts:
        shape = shape.with_experts(args.experts)
    tokens = args.tokens or ([64, 256] if args.quick else [512, 2048])
    threads = args.threads or kt_ops.get_num_threads()
    kt_ops.set_num_threads(threads)
    torch.set_num_threads(threads)
    print(
        f"layer  : {shape.model}: H={shape.hidden}, I={shape.intermediate}, E={shape.experts}, "
        f"top-{shape.top_k}; LoRA r={args.rank} alpha={args.alpha:g} on gate, up, down; "
        f"forward + backward",
        flush=True,
    )
    t0 = time.perf_counter()
    peft_model, kt = build(shape, args.rank, args.alpha, args.peft_impl, args.seed)
    print(
        f"setup  : {time.perf_counter() - t0:.1f} s; kt_ops {kt_ops.active_isa()}, "
        f"{threads} threads; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; PEFT on transformers "
        f"Qwen3MoeExperts ({args.peft_impl}), bf16 weights and adapters; kt fp32 adapters",
        flush=True,
    )
    rows = []
    for T in tokens:
        rows.append(
            bench(shape, T, peft_model, kt, args.reps, args.warmup, args.seed, args.no_peft)
        )
        print(table(rows[-1:], False).splitlines()[-1], flush=True)
    print()
    print(table(rows, args.markdown))
    print(
        f"\nmachine: {platform.processor() or platform.machine()}, python {sys.version.split()[0]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
