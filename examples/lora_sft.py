#!/usr/bin/env python
"""LoRA SFT of a small MoE model with the routed experts on kt_ops (CPU), offline.

Fine-tunes a tiny Qwen3-MoE-style model (seeded random weights, built from a transformers
config as ``kt_ops.demo`` does: no model hub) on the instruction dataset kept in this
repository (``examples/data/tiny_sft.jsonl``, alpaca fields), with a byte-level BPE
tokenizer trained on that dataset at start-up (``tokenizers``, a few hundred tokens).

* The routed experts run on kt_ops (``kt_ops.replace_experts``) with kt_ops LoRA on their
  gate/up/down projections (``kt_ops.lora.apply_lora``; forward and backward in
  ``kt.moe_forward`` / ``kt::moe_backward``). Attention gets PEFT LoRA as usual
  (``--no-attn-lora`` to train the experts only); router and everything else are frozen.
* Every step prints the loss (labels on the response tokens only), tokens/s (non-padding
  tokens of the batch over the step's wall time) and the process's peak RSS so far; the end
  prints the loss drop. ``--output-dir`` saves the adapter in PEFT's format
  (``kt_ops.peft_adapters.save_pretrained``: loads into plain transformers + PEFT).
* ``--compare-peft`` then trains the plain transformers model with PEFT LoRA
  (``target_parameters`` on the fused experts + the same attention targets), from the same
  initial adapter (kt_ops' initial adapter exported and loaded with plain PEFT), on the same
  batches, and prints the per-step loss difference. Verdict: every one of the first
  ``--compare-steps`` losses within ``LOSS_RTOL`` (1e-4) relative of the PEFT loss. Both
  sides compute in fp32 from the same bf16-valued expert weights, so they differ by
  summation order only (observed <= 2e-7); a wrong gradient shows from step 2 on (the
  weights are drawn with std 0.1 so that the experts matter: a 10% error of the experts'
  LoRA scaling during training moves the losses by 1e-3 to 2.5e-3, 10-25x the tolerance).
  Exit status 1 when the check fails.

Usage::

    python examples/lora_sft.py                      # 30 steps
    python examples/lora_sft.py --steps 10 --compare-peft
    python examples/lora_sft.py --arch mixtral --rank 8 --output-dir /tmp/adapter
    python examples/lora_sft.py --save-model /tmp/kt_tiny_moe   # for LLaMA-Factory (see
                                        # examples/llamafactory_lora_sft.yaml)
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

import kt_ops
from kt_ops import demo, peft_adapters
from kt_ops.lora import apply_lora, lora_parameters

DATA = Path(__file__).resolve().parent / "data" / "tiny_sft.jsonl"

#: Relative loss difference kt_ops vs PEFT allowed on the first --compare-steps steps.
LOSS_RTOL = 1e-4

#: Attention projections that get PEFT LoRA, per architecture.
ATTN_TARGETS = {
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
}
DEFAULT_ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]

PROMPT = "### Instruction:\n{instruction}\n{input}### Response:\n"


def load_records(path: Path = DATA) -> list[dict]:
    """The alpaca-style records (``instruction``, ``input``, ``output``) of a JSONL file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def prompt_of(record: dict) -> str:
    inp = record.get("input") or ""
    return PROMPT.format(instruction=record["instruction"], input=f"{inp}\n" if inp else "")


def build_tokenizer(records: list[dict], vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on the records (deterministic, offline).

    Returns a ``transformers.PreTrainedTokenizerFast`` with ``<pad>`` (id 0) and ``<eos>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((prompt_of(r) + r["output"] for r in records), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def encode(record: dict, tokenizer, max_len: int) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response + eos, and labels (-100 on the prompt)."""
    prompt = tokenizer(prompt_of(record), add_special_tokens=False)["input_ids"]
    answer = tokenizer(record["output"], add_special_tokens=False)["input_ids"]
    answer = answer + [tokenizer.eos_token_id]
    ids = (prompt + answer)[:max_len]
    labels = ([-100] * len(prompt) + answer)[:max_len]
    return ids, labels


def make_batches(records, tokenizer, batch_size: int, steps: int, max_len: int, seed: int):
    """``steps`` padded batches ``(input_ids, attention_mask, labels)``, epochs reshuffled."""
    encoded = [encode(r, tokenizer, max_len) for r in records]
    rng = random.Random(seed)
    order: list[int] = []
    batches = []
    for _ in range(steps):
        if len(order) < batch_size:
            epoch = list(range(len(encoded)))
            rng.shuffle(epoch)
            order += epoch
        picked, order = order[:batch_size], order[batch_size:]
        width = max(len(encoded[i][0]) for i in picked)
        ids = torch.full((batch_size, width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        for row, i in enumerate(picked):
            x, y = encoded[i]
            ids[row, : len(x)] = torch.tensor(x)
            mask[row, : len(x)] = 1
            labels[row, : len(y)] = torch.tensor(y)
        batches.append((ids, mask, labels))
    return batches


def build_model(args, vocab_size: int):
    """The plain transformers model (fp32, bf16-valued expert weights), in training mode."""
    config = demo.make_config(
        args.arch,
        hidden_size=args.hidden_size,
        moe_intermediate_size=args.moe_intermediate_size,
        num_experts=args.num_experts,
        top_k=args.top_k,
        num_layers=args.layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        vocab_size=vocab_size,
        init_std=args.init_std,
    )
    return demo.build_model(config, seed=args.seed).train()


def save_model(args, out_dir: Path) -> Path:
    """Write the tiny model (safetensors) and its tokenizer to ``out_dir``, loadable offline."""
    tokenizer = build_tokenizer(load_records(args.data), args.vocab_size)
    model = build_model(args, len(tokenizer)).eval()
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, MB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@dataclass
class Run:
    """Per-step results of one training run."""

    losses: list[float] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0


def train(model, batches, lr: float, label: str, quiet: bool = False) -> Run:
    """AdamW on the trainable parameters of ``model`` over ``batches``; prints each step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    run = Run()
    for step, (ids, mask, labels) in enumerate(batches, 1):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        ntok = int(mask.sum())
        run.losses.append(loss.item())
        run.tokens_per_s.append(ntok / dt)
        run.seconds += dt
        run.tokens += ntok
        if not quiet:
            print(
                f"{label} step {step:3d}  loss {loss.item():8.4f}  {ntok / dt:8.1f} tok/s  "
                f"peak RSS {peak_rss_mb():7.1f} MB",
                flush=True,
            )
    return run


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--arch", choices=demo.ARCHS, default="qwen3_moe")
    p.add_argument("--data", type=Path, default=DATA, help="alpaca-style JSONL")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-len", type=int, default=64, help="tokens per example (truncated)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--no-attn-lora", action="store_true", help="LoRA on the experts only")
    p.add_argument("--vocab-size", type=int, default=384, help="BPE vocabulary to train")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--moe-intermediate-size", type=int, default=128)
    p.add_argument("--num-experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument(
        "--init-std",
        type=float,
        default=0.1,
        help="std of the random weights (0.1: the experts matter, see the module docstring)",
    )
    p.add_argument("--threads", type=int, help="kt_ops and torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, help="save the trained adapter (PEFT format)")
    p.add_argument("--compare-peft", action="store_true", help="also train plain PEFT, compare")
    p.add_argument("--compare-steps", type=int, default=5, help="steps the verdict checks")
    p.add_argument("--quiet", action="store_true")
    p.add_argument(
        "--save-model",
        type=Path,
        metavar="DIR",
        help="only write the tiny model and its tokenizer to DIR (for LLaMA-Factory) and exit",
    )
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be at least 2 (the loss drop needs two steps)")
    return args


@dataclass
class Result:
    """What :func:`run` measured (for tests)."""

    kt: Run
    peft: Optional[Run]
    ok: bool
    max_rel_diff: Optional[float]
    adapter_dir: Optional[str]


def run(argv: Optional[list[str]] = None) -> Result:
    """Train on kt_ops (and with plain PEFT when asked); print the report; return the results."""
    import peft

    args = parse_args(argv)
    say = (lambda *a: None) if args.quiet else print
    if args.save_model is not None:
        out = save_model(args, args.save_model)
        say(f"saved the tiny {args.arch} model and tokenizer to {out}")
        return Result(Run(), None, True, None, None)
    if args.threads:
        kt_ops.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    records = load_records(args.data)
    tokenizer = build_tokenizer(records, args.vocab_size)
    batches = make_batches(records, tokenizer, args.batch_size, args.steps, args.max_len, args.seed)
    plain = build_model(args, len(tokenizer))
    attn = [] if args.no_attn_lora else ATTN_TARGETS.get(args.arch, DEFAULT_ATTN)

    # kt_ops: experts on the CPU op with kt_ops LoRA, attention with PEFT LoRA.
    model = copy.deepcopy(plain) if args.compare_peft else plain
    kt_ops.replace_experts(model)
    apply_lora(model, args.rank, args.alpha, seed=args.seed)
    if attn:
        config = peft.LoraConfig(r=args.rank, lora_alpha=args.alpha, target_modules=attn)
        model = peft.get_peft_model(model, config)
        for _, p in lora_parameters(model):
            p.requires_grad_(True)  # get_peft_model froze everything but its own adapters
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        for _, p in lora_parameters(model):
            p.requires_grad_(True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    say(
        f"model      : {args.arch}, {args.layers} layers, hidden {args.hidden_size}, "
        f"{args.num_experts} experts x {args.moe_intermediate_size} (top-{args.top_k}), "
        f"vocab {len(tokenizer)}; LoRA r={args.rank} alpha={args.alpha:g} on experts "
        f"(kt_ops){' + ' + '/'.join(attn) + ' (PEFT)' if attn else ''}; "
        f"{trainable:,} trainable parameters"
    )
    say(
        f"data       : {len(records)} examples from {args.data.name}, batch {args.batch_size}, "
        f"{args.steps} steps; kt_ops {kt_ops.active_isa()}, {kt_ops.get_num_threads()} threads"
    )
    init_dir = None
    if args.compare_peft:
        init_dir = tempfile.mkdtemp(prefix="kt_lora_init_")
        peft_adapters.save_pretrained(model, init_dir)  # the same start for PEFT

    kt_run = train(model, batches, args.lr, "kt_ops", quiet=args.quiet)
    kt_peak = peak_rss_mb()
    drop = kt_run.losses[0] - kt_run.losses[-1]
    say(
        f"kt_ops     : loss {kt_run.losses[0]:.4f} -> {kt_run.losses[-1]:.4f} "
        f"({'falling' if drop > 0 else 'NOT falling'}), "
        f"{kt_run.tokens / kt_run.seconds:.1f} tok/s overall, peak RSS {kt_peak:.1f} MB"
    )
    adapter_dir = None
    if args.output_dir is not None:
        adapter_dir = peft_adapters.save_pretrained(model, args.output_dir)
        say(f"adapter    : saved to {adapter_dir} (PEFT format)")

    ok, max_diff, ref_run = drop > 0, None, None
    if args.compare_peft:
        reference = peft.PeftModel.from_pretrained(plain, init_dir, is_trainable=True)
        ref_run = train(reference, batches, args.lr, "peft  ", quiet=True)
        n = min(args.compare_steps, args.steps)
        diffs = [abs(a - b) / abs(b) for a, b in zip(kt_run.losses, ref_run.losses)]
        max_diff = max(diffs[:n])
        say("\nstep   kt_ops loss   PEFT loss   |rel diff|")
        for i, (a, b, d) in enumerate(zip(kt_run.losses, ref_run.losses, diffs), 1):
            say(f"{i:4d}  {a:12.6f}  {b:10.6f}  {d:10.2e}{'  *' if i <= n else ''}")
        say(
            f"PEFT       : {ref_run.tokens / ref_run.seconds:.1f} tok/s overall "
            f"(plain transformers experts + PEFT); kt_ops speed-up "
            f"{(kt_run.tokens / kt_run.seconds) / (ref_run.tokens / ref_run.seconds):.2f}x; "
            f"peak RSS so far {peak_rss_mb():.1f} MB"
        )
        within = max_diff <= LOSS_RTOL
        ok = ok and within
        say(
            f"verdict    : {'PASS' if within else 'FAIL'}: max |rel loss diff| over the first "
            f"{n} steps (*) {max_diff:.2e} (tolerance {LOSS_RTOL:g})"
        )
    if math.isnan(kt_run.losses[-1]):
        ok = False
    return Result(kt_run, ref_run, ok, max_diff, adapter_dir)


def main(argv: Optional[list[str]] = None) -> int:
    return 0 if run(argv).ok else 1


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
