#!/usr/bin/env python
"""Accuracy of every weight format against bf16: one MoE layer's output, and greedy tokens.

Both measurements use the demo model (``kt_ops.demo.build_model``: a seeded
random Qwen3-MoE with Qwen3-30B-A3B layer shapes, H=2048, 128 experts of
I=768, top-8, 2 layers, vocabulary 2048, fp32, built offline) and put its
routed experts on kt_ops with ``kt_ops.replace_experts(model, format,
group_size=..., symmetric=...)``: the experts run in each format while
everything else stays the same. Every format is quantized from the same bf16
expert weights (the demo draws bf16-representable values).

(a) **Layer error**: ``||y_fmt - y_bf16|| / ||y_bf16||`` (Frobenius norm over
    the tokens) of the routed-experts output of layer 0 (H=2048, I=768,
    E=128, top-8: the Qwen3-30B-A3B shape) for ``--layer-tokens`` (256) tokens
    of random N(0, 1) hidden states with random routing (softmax of random
    logits, top-8, renormalized as Qwen3 does). ``y_bf16`` is kt_ops with
    bf16 weights; the first row checks it against transformers' own expert
    loop on the same weights (fp32).
(b) **Greedy agreement** with the bf16-experts model over ``--prompts`` (32)
    fixed random prompts of ``--prompt-tokens`` (32) tokens (seeded):
    ``next token``: top-1 agreement of the next token after the prompt;
    ``16 steps``: the bf16 model generates ``--new-tokens`` (16) greedy tokens,
    the format's model is fed the same tokens (teacher forcing) and its greedy
    choice is compared at every step; ``same text``: prompts whose 16
    greedy tokens are all identical (by induction, the prompts whose
    free-running generation would be identical); ``logit err``: ``||l_fmt -
    l_bf16|| / ||l_bf16||`` over all steps' logits.

A random-weight model has flat logits (top-1/top-2 gaps far smaller than a
trained model's), so small logit errors flip greedy choices much more often
than they would on a trained model: the agreement figures are a **stress
test** of the formats' rounding, not a claim about quality on a real model.
The layer error (a) is the direct measure; it is taken on Gaussian weights,
which have no outliers, so real checkpoints may quantize worse or better.

Quantizing two 128-expert layers into 11 formats takes most of the ~15 minutes
of a run on two cores (``kt_ops.formats.quantize_weights``, a few experts at a
time); ``--quick`` runs 16 experts and 3 formats in a few minutes.

Usage::

    python benchmarks/quality_formats.py --markdown
    python benchmarks/quality_formats.py --quick
    python benchmarks/quality_formats.py --formats int4-g128 int4-g128-asym int4-g32 q4_k

Not part of the test suite (pytest only collects ``tests/``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import Tensor, nn

import kt_ops
from kt_ops.demo import build_model, make_config
from kt_ops.hf import find_experts

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_formats import DEFAULT_VARIANTS, Variant, parse_variant  # noqa: E402
from bench_moe import render_table  # noqa: E402

QUICK_VARIANTS = ("int8", "int4-g128", "q4_k")
QUICK_EXPERTS = 16
HF_LABEL = "transformers (fp32)"


# --------------------------------------------------------------------------- model surgery


class Experts:
    """The experts modules of a model: swap kt_ops replacements in and the originals back."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.names = [info.name for info in find_experts(model)]
        modules = dict(model.named_modules())
        self.originals = {name: modules[name] for name in self.names}

    def replace(self, variant: Variant, check: bool = False) -> float:
        """Put the original (dense) experts back, then replace them in ``variant``; seconds."""
        self.restore()
        quant = {}
        if variant.weight_format != "bf16":
            quant = {"group_size": variant.group_size, "symmetric": variant.symmetric}
        t0 = time.perf_counter()
        kt_ops.replace_experts(self.model, variant.weight_format, check=check, **quant)
        return time.perf_counter() - t0

    def restore(self) -> None:
        for name, module in self.originals.items():
            parent, _, attr = name.rpartition(".")
            setattr(self.model.get_submodule(parent), attr, module)
        gc.collect()

    def layer0(self) -> nn.Module:
        return self.model.get_submodule(self.names[0])

    def bits_per_weight(self) -> float:
        """Storage of the replaced experts (weights, scales, zeros) per dense weight."""
        nbytes = n_weights = 0
        for name in self.names:
            m = self.model.get_submodule(name)
            nbytes += sum(b.numel() * b.element_size() for b in m.buffers())
            n_weights += 3 * m.num_experts * m.hidden_size * m.intermediate_size
        return 8 * nbytes / n_weights


# --------------------------------------------------------------------------- inputs


def layer_inputs(config, tokens: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Random hidden states N(0, 1) and Qwen3-style routing (softmax, top-k, renormalized)."""
    gen = torch.Generator().manual_seed(seed + 2)
    E, K = config.num_experts, config.num_experts_per_tok
    x = torch.randn(tokens, config.hidden_size, generator=gen)
    probs = torch.softmax(torch.randn(tokens, E, generator=gen), dim=-1)
    w, ids = torch.topk(probs, K, dim=-1)
    return x, ids, w / w.sum(dim=-1, keepdim=True)


@dataclass
class Greedy:
    tokens: Tensor  # [B, steps] the model's own greedy choices
    logits: Tensor  # [B, steps, V]


@torch.inference_mode()
def greedy(model: nn.Module, prompts: Tensor, steps: int, feed: Optional[Tensor] = None) -> Greedy:
    """Batched greedy decoding with a KV cache (equal-length prompts, no padding).

    ``feed``: ``[B, steps]`` tokens fed back instead of the model's choices
    (teacher forcing); the returned tokens are the model's own argmax either way.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=prompts, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tokens, logits = [], []
    for step in range(steps):
        if step > 0:
            fed = tokens[-1] if feed is None else feed[:, step - 1]
            out = model(input_ids=fed.view(-1, 1), past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1].float())
        tokens.append(logits[-1].argmax(dim=-1))
    return Greedy(torch.stack(tokens, dim=1), torch.stack(logits, dim=1))


# --------------------------------------------------------------------------- measurements


@dataclass
class Row:
    label: str
    bits_per_weight: Optional[float]
    layer_rel_err: float
    next_token_agree: float  # fraction of prompts
    steps_agree: float  # fraction of prompt x step positions (teacher-forced)
    same_text: int  # prompts with every step identical
    prompts: int
    logit_rel_err: float
    replace_s: float
    run_s: float


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def compare(
    label: str,
    bits: Optional[float],
    y: Tensor,
    y_ref: Tensor,
    g: Greedy,
    ref: Greedy,
    replace_s: float,
    run_s: float,
) -> Row:
    same = g.tokens == ref.tokens  # [B, steps]
    return Row(
        label=label,
        bits_per_weight=bits,
        layer_rel_err=_rel(y, y_ref),
        next_token_agree=same[:, 0].float().mean().item(),
        steps_agree=same.float().mean().item(),
        same_text=int(same.all(dim=1).sum()),
        prompts=int(same.shape[0]),
        logit_rel_err=_rel(g.logits, ref.logits),
        replace_s=replace_s,
        run_s=run_s,
    )


def table(rows: list[Row], steps: int, markdown: bool) -> str:
    head = [
        "format",
        "bits/w",
        "layer rel err",
        "next token",
        f"{steps} steps",
        "same text",
        "logit err",
    ]
    body = []
    for r in rows:
        name = r.label if not markdown or r.label == HF_LABEL else f"`{r.label}`"
        body.append(
            [
                name,
                "-" if r.bits_per_weight is None else f"{r.bits_per_weight:.3g}",
                f"{r.layer_rel_err:.2e}" if r.layer_rel_err < 1e-3 else f"{r.layer_rel_err:.4f}",
                f"{100 * r.next_token_agree:.1f}%",
                f"{100 * r.steps_agree:.1f}%",
                f"{r.same_text}/{r.prompts}",
                f"{r.logit_rel_err:.2e}" if r.logit_rel_err < 1e-3 else f"{r.logit_rel_err:.4f}",
            ]
        )
    return render_table(head, body, markdown, first_left=True)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--formats",
        nargs="+",
        type=parse_variant,
        help=f"variants (default {' '.join(DEFAULT_VARIANTS)}); bf16 is always the reference",
    )
    p.add_argument("--num-experts", type=int, default=128, help="experts per layer (demo: 128)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (demo: 2)")
    p.add_argument("--layer-tokens", type=int, default=256, help="tokens for the layer error")
    p.add_argument("--prompts", type=int, default=32, help="number of fixed random prompts")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy steps compared")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers reference row")
    p.add_argument("--threads", type=int, help="kt_ops and torch threads (default: kt_ops')")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts, inputs")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"development run: {QUICK_EXPERTS} experts, {' '.join(QUICK_VARIANTS)}",
    )
    p.add_argument("--markdown", action="store_true", help="also print a markdown table")
    p.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.formats = args.formats or [parse_variant(v) for v in QUICK_VARIANTS]
        args.num_experts = min(args.num_experts, QUICK_EXPERTS)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args(argv)
    threads = args.threads or kt_ops.get_num_threads()
    kt_ops.set_num_threads(threads)
    torch.set_num_threads(threads)
    variants = args.formats or [parse_variant(v) for v in DEFAULT_VARIANTS]
    variants = [v for v in variants if v.label != "bf16"]
    bf16 = parse_variant("bf16")

    config = make_config(num_experts=args.num_experts, num_layers=args.layers)
    H, Im, E, K = (
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_experts,
        config.num_experts_per_tok,
    )
    t0 = time.perf_counter()
    model = build_model(config, dtype=torch.float32, seed=args.seed)
    experts = Experts(model)
    print(
        f"# kt_ops weight-format quality: demo model (kt_ops.demo, qwen3_moe, {args.layers} layers,"
        f" H={H}, I={Im}, E={E}, top-{K}, vocab {config.vocab_size}, fp32, random weights seed "
        f"{args.seed}), built in {time.perf_counter() - t0:.1f}s; kt_ops isa "
        f"{kt_ops.active_isa()}, {threads} threads",
        flush=True,
    )
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(0, config.vocab_size, (args.prompts, args.prompt_tokens), generator=gen)
    x, ids, w = layer_inputs(config, args.layer_tokens, args.seed)
    steps = args.new_tokens

    def measure(label: str, feed: Optional[Tensor]) -> tuple[Tensor, Greedy, float]:
        t = time.perf_counter()
        with torch.inference_mode():
            y = experts.layer0()(x, ids, w).float()
        g = greedy(model, prompts, steps, feed)
        return y, g, time.perf_counter() - t

    # The reference: kt_ops bf16 (check=True: replace_experts' own probe of the structure).
    replace_s = experts.replace(bf16, check=True)
    bits = experts.bits_per_weight()
    y_ref, ref, run_s = measure("bf16", None)
    rows = [compare("bf16", bits, y_ref, y_ref, ref, ref, replace_s, run_s)]
    print(f"#   bf16: replaced in {replace_s:.1f}s, ran in {run_s:.1f}s (reference)", flush=True)
    if not args.no_hf:
        experts.restore()
        y, g, run_s = measure(HF_LABEL, ref.tokens)
        rows.insert(0, compare(HF_LABEL, None, y, y_ref, g, ref, 0.0, run_s))
        print(f"#   {HF_LABEL}: ran in {run_s:.1f}s", flush=True)
    for v in variants:
        replace_s = experts.replace(v)
        bits = experts.bits_per_weight()
        y, g, run_s = measure(v.label, ref.tokens)
        r = compare(v.label, bits, y, y_ref, g, ref, replace_s, run_s)
        rows.append(r)
        print(
            f"#   {v.label}: quantized in {replace_s:.1f}s, ran in {run_s:.1f}s: layer rel err "
            f"{r.layer_rel_err:.4f}, next token {100 * r.next_token_agree:.1f}%",
            flush=True,
        )
        experts.restore()  # frees this format's packed experts

    top2 = ref.logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]) / ref.logits.abs().amax(dim=-1)
    print(
        f"#   layer error: layer 0's experts, {args.layer_tokens} random tokens; greedy: "
        f"{args.prompts} prompts x {args.prompt_tokens} tokens (seed {args.seed + 1}), "
        f"{steps} teacher-forced steps; bf16 model's median top-1/top-2 logit gap "
        f"{100 * gap.median().item():.2f}% of the largest |logit| (random weights: flat logits, "
        "so agreement is a stress test, not a real-model quality claim)"
    )
    print(table(rows, steps, markdown=False))
    if args.markdown:
        print()
        print(
            f"Demo model (qwen3_moe, {args.layers} layers, H={H}, I={Im}, E={E}, top-{K}, random "
            f"weights, fp32), kt_ops isa {kt_ops.active_isa()}. Layer rel err: layer 0's experts "
            f"on {args.layer_tokens} random tokens vs kt_ops bf16. Greedy: {args.prompts} fixed "
            f"random prompts of {args.prompt_tokens} tokens vs the bf16-experts model; "
            f"{steps} steps teacher-forced on its tokens. Random weights: a stress test, not a "
            "real-model quality claim."
        )
        print()
        print(table(rows, steps, markdown=True))
    if args.json:
        with open(args.json, "w") as f:
            settings = {k: str(v) for k, v in vars(args).items()}
            json.dump({"args": settings, "rows": [asdict(r) for r in rows]}, f, indent=1)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
