"""``python -m kt_ops.demo``: greedy generation with an MoE model, with and without kt_ops.

Builds a Hugging Face ``transformers`` MoE model from a config with seeded
random weights (no download) and generates greedily from a fixed prompt with
the unmodified model (the reference). Then it replaces the routed experts with
kt_ops (:func:`kt_ops.replace_experts`) and decodes again, and checks that
kt_ops makes the same greedy choices with logits close to the reference's. It
prints prefill and decode speed for both, and exits with status 1 when the
check fails.

The default model has the per-layer shape of Qwen3-30B-A3B (hidden 2048, 128
experts of intermediate 768, top-8, 32 query / 4 KV heads of dim 128) with
2 layers and a small vocabulary, so it runs in about a minute on two cores.
``--arch`` picks the model code (router, attention, shared experts); the layer
sizes are flags.

The check, made exact rather than lucky. Random-weight models have flat
logits, so a near-tie between two tokens can flip a greedy choice for harmless
rounding reasons (two of transformers' own bf16 expert implementations flip
tokens against each other on this model). So:

* The expert weights are drawn as bf16 values: the reference computes with
  exactly the weights kt_ops stores (kt_ops packs bf16).
* ``--dtype fp32`` (default) runs the model in fp32; kt_ops also computes in
  fp32 (bf16 weights, fp32 activations and accumulation), so the two differ by
  summation order only (~1e-6 of the logit range), far below any near-tie.
* The kt_ops run is fed the reference's tokens (teacher forcing: the same
  prefill and one-token decode steps, so the timings are those of generation)
  and its own greedy choice is taken at every step. All steps' logits are thus
  compared on identical inputs, and "the same greedy choice at every step" is
  exactly "the same generated text" (by induction over the steps).
* Verdict: every logit within ``LOGIT_RTOL`` times the largest reference logit
  (fp32: 1e-4; bf16: 0.1), and the greedy choice identical at every step. In
  fp32 no exception is made. In bf16 a differing choice is accepted only where
  the reference itself preferred its token by less than the logit tolerance
  (a tie at bf16 precision); the report lists such steps.

CPU/GPU hybrid. ``--gpu-experts N`` keeps, per layer, the ``N`` experts most
hit on a calibration prompt (a second seeded prompt,
:func:`kt_ops.hf.collect_routing_stats`) as dense PyTorch weights computed by
torch, and the op skips them (``replace_experts(num_gpu_experts=N,
routing_stats=...)``); the same check then covers the split. ``--device cuda``
runs the model on the GPU: attention, router and the GPU-resident experts
there, the other experts through kt_ops from CUDA hidden states (the op's
CUDA bridge, :mod:`kt_ops.hybrid`). Without a CUDA device (or without the
bridge in the build), ``--device cuda`` says so and exits with status 2
(nothing runs);
``--device cpu --gpu-experts N`` exercises the same split on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

import kt_ops
from kt_ops.hf import collect_routing_stats, find_experts
from kt_ops.hybrid import cuda_bridge_built
from kt_ops.nn import MoEExperts

__all__ = ["ARCHS", "NoCudaDevice", "make_config", "build_model", "greedy_generate", "run", "main"]

#: Architectures the demo can build (``--arch``), each a transformers-v5 model type.
ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "deepseek_v4")

#: Max |logit difference| between kt_ops and the reference, as a fraction of the largest
#: |logit| of the reference, per model dtype. fp32: both accumulate in fp32 from the same bf16
#: weights (observed ~4e-6). bf16: the reference rounds every expert matmul and the SwiGLU
#: product to bf16 (kt_ops only its output), and the rest of the model computes in bf16 too;
#: two of transformers' own expert implementations (grouped_mm, eager) differ by ~4% of the
#: logit range on the default 2-layer model, and kt_ops lies within the same band.
LOGIT_RTOL = {"fp32": 1e-4, "bf16": 0.1}

#: A step where kt_ops' greedy choice differs from the reference's is accepted only when the
#: reference itself preferred its token by at most this fraction of the largest |logit|. fp32:
#: never. bf16: within the logit tolerance, i.e. a near-tie that rounding can flip.
TIE_RTOL = {"fp32": 0.0, "bf16": LOGIT_RTOL["bf16"]}

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

#: Exit status of ``--device cuda`` without a CUDA device.
NO_CUDA_STATUS = 2


class NoCudaDevice(RuntimeError):
    """``--device cuda`` was asked for, but torch sees no CUDA device (or kt_ops has no bridge)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_config(
    arch: str = "qwen3_moe",
    *,
    hidden_size: int = 2048,
    moe_intermediate_size: int = 768,
    num_experts: int = 128,
    top_k: int = 8,
    num_layers: int = 2,
    num_heads: int = 32,
    num_kv_heads: int = 4,
    head_dim: int = 128,
    vocab_size: int = 2048,
    init_std: float = 0.02,
):
    """A transformers config of ``arch`` with the given sizes; every layer is an MoE layer.

    Args:
        arch: one of :data:`ARCHS`.
        hidden_size, moe_intermediate_size, num_experts, top_k: the MoE layer
            (``H``, ``I``, ``E``, experts per token).
        num_layers, num_heads, num_kv_heads, head_dim, vocab_size: the rest of
            the model (``deepseek_v3`` uses MLA attention: ``num_kv_heads`` is
            ignored, ``head_dim`` is its nope/value head dim, its rope dim is
            half of it, and the latent ranks are derived from ``hidden_size``).
        init_std: ``initializer_range`` (std of the random weights).

    Returns:
        A ``transformers.PretrainedConfig`` (eager attention, fp32 by default).

    Raises:
        ValueError: unknown ``arch``.
    """
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        initializer_range=init_std,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        hidden_act="silu",
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            head_dim=head_dim,
            intermediate_size=4 * moe_intermediate_size,
            moe_intermediate_size=moe_intermediate_size,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        )
    if arch == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common,
            head_dim=head_dim,
            intermediate_size=4 * moe_intermediate_size,
            moe_intermediate_size=moe_intermediate_size,
            shared_expert_intermediate_size=4 * moe_intermediate_size,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            decoder_sparse_step=1,
        )
    if arch == "mixtral":
        return transformers.MixtralConfig(
            **common,
            head_dim=head_dim,
            intermediate_size=moe_intermediate_size,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
        )
    if arch == "olmoe":
        return transformers.OlmoeConfig(
            **common,
            head_dim=head_dim,
            intermediate_size=moe_intermediate_size,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            norm_topk_prob=False,
        )
    if arch == "deepseek_v3":
        n_group = 8 if num_experts % 8 == 0 and num_experts >= 32 else 1
        common["num_key_value_heads"] = num_heads  # MLA: one latent KV, expanded per head
        return transformers.DeepseekV3Config(
            **common,
            intermediate_size=4 * moe_intermediate_size,
            moe_intermediate_size=moe_intermediate_size,
            n_routed_experts=num_experts,
            n_shared_experts=1,
            num_experts_per_tok=top_k,
            first_k_dense_replace=0,
            n_group=n_group,
            topk_group=max(1, n_group // 2),
            kv_lora_rank=max(16, hidden_size // 4),
            q_lora_rank=max(16, hidden_size // 2),
            qk_rope_head_dim=max(8, head_dim // 2),
            qk_nope_head_dim=head_dim,
            v_head_dim=head_dim,
        )
    if arch == "gpt_oss":  # per-expert biases and the clamped SwiGLU (alpha 1.702, limit 7)
        return transformers.GptOssConfig(
            **common,
            head_dim=head_dim,
            intermediate_size=moe_intermediate_size,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
        )
    if arch == "deepseek_v4":  # SwiGLU clamped at swiglu_limit
        return transformers.DeepseekV4Config(
            **common,
            head_dim=head_dim,
            intermediate_size=moe_intermediate_size,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
        )
    raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def _fill_experts_(weight: Tensor, std: float, generator: torch.Generator) -> None:
    """Fill ``weight [E, R, C]`` with seeded N(0, std^2) values, rounded to bf16, fast.

    Drawing ~10^9 normal samples per Qwen3-30B-A3B layer takes tens of seconds
    on two cores, so each expert is instead a window of one shared pool of
    i.i.d. samples, at an offset with a distinct residue modulo ``C``: rows are
    i.i.d. within an expert and no two experts share a row (their rows overlap
    only as shifted sequences). Values are bf16-representable, so a reference
    computing with them uses exactly the weights kt_ops packs.
    """
    E, R, C = weight.shape
    n = R * C
    pool = torch.randn(n + E * C, generator=generator).mul_(std)
    pool = pool.to(torch.bfloat16).to(weight.dtype)
    residues = torch.randperm(C, generator=generator)[:E]
    if residues.numel() < E:  # more experts than columns: residues repeat
        residues = torch.randint(0, C, (E,), generator=generator)
    quotients = torch.randint(0, E, (E,), generator=generator)
    offsets = (quotients * C + residues).tolist()
    flat = weight.view(E, n)
    for e, off in enumerate(offsets):
        flat[e].copy_(pool[off : off + n])


def build_model(config, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` with seeded random weights, built fast.

    The expert weights (the bulk of the parameters) are filled by
    :func:`_fill_experts_` (bf16-representable values); everything else is
    initialized by transformers' own ``_init_weights`` after
    ``torch.manual_seed(seed)``. Returns the model in eval mode, in ``dtype``.
    """
    from transformers import AutoModelForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # not in this transformers: initialize everything now (slower)
        no_init_weights = contextlib.nullcontext

    torch.manual_seed(seed)
    with no_init_weights():  # allocate only; initialized below
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    generator = torch.Generator().manual_seed(seed)
    std = config.initializer_range
    modules = dict(model.named_modules())
    with torch.no_grad():
        for info in find_experts(model):
            experts = modules[info.name]
            for param in experts.parameters():
                if param.dim() == 3:
                    _fill_experts_(param, std, generator)
                    param._is_hf_initialized = True
                elif param.dim() == 2:  # per-expert biases (gpt-oss), bf16-representable
                    noise = torch.randn(param.shape, generator=generator).mul_(std)
                    param.copy_(noise.to(torch.bfloat16))
                    param._is_hf_initialized = True
            experts._is_hf_initialized = True
    torch.manual_seed(seed)
    model.init_weights()  # transformers' init for the rest; skips the flagged experts
    return model.eval()


@dataclass
class Generation:
    """Result of :func:`greedy_generate`.

    Attributes:
        tokens: ``[new_tokens]`` int64 greedy choices (argmax of each step's logits).
        logits: ``[new_tokens, vocab]`` fp32 logits of each step.
        prefill_s: seconds of the first forward (the whole prompt).
        decode_s: seconds of the ``new_tokens - 1`` one-token forwards.
        prefill_experts_s, decode_experts_s: the part of each spent in the
            routed-experts modules (0 when no ``ExpertTimer`` was given).
    """

    tokens: Tensor
    logits: Tensor
    prefill_s: float
    decode_s: float
    prefill_experts_s: float = 0.0
    decode_experts_s: float = 0.0


class ExpertTimer:
    """Wall time spent inside the routed-experts modules of a model (forward hooks).

    ``ExpertTimer(model)`` times the modules :func:`kt_ops.hf.find_experts`
    reports plus any :class:`kt_ops.nn.MoEExperts`; ``seconds`` accumulates.
    Call ``remove()`` to detach the hooks.
    """

    def __init__(self, model: nn.Module) -> None:
        names = {info.name for info in find_experts(model)}
        self.seconds = 0.0
        self._start = 0.0
        self._handles = []
        for name, module in model.named_modules():
            if name in names or isinstance(module, MoEExperts):
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._exit))

    def _enter(self, module, args) -> None:
        if args and isinstance(args[0], Tensor):
            _sync(args[0].device)  # CUDA: time the experts' work, not its launch
        self._start = time.perf_counter()

    def _exit(self, module, args, output) -> None:
        if isinstance(output, Tensor):
            _sync(output.device)
        self.seconds += time.perf_counter() - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def greedy_generate(
    model: nn.Module,
    prompt: Tensor,
    new_tokens: int,
    feed: Optional[Tensor] = None,
    timer: Optional[ExpertTimer] = None,
) -> Generation:
    """Greedy decoding with a KV cache: one prefill forward, then one forward per token.

    Args:
        model: a causal LM.
        prompt: ``[1, P]`` int64 token ids.
        new_tokens: number of steps (>= 1).
        feed: ``[new_tokens]`` tokens to feed back instead of the model's own
            greedy choices (teacher forcing, to compare two models step by step
            on one sequence); ``None``: free-running greedy generation. Either
            way ``tokens`` holds the model's own choices.
        timer: an :class:`ExpertTimer` on ``model``, to split out the experts' time.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if feed is not None:
        feed = feed.to(prompt.device)  # the reference's tokens come back on the CPU
    tokens, logits = [], []
    experts = (lambda: timer.seconds) if timer is not None else (lambda: 0.0)
    with torch.inference_mode():
        _sync(prompt.device)
        e0, t0 = experts(), time.perf_counter()
        out = model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
        _sync(prompt.device)
        e1, t1 = experts(), time.perf_counter()
        for step in range(new_tokens):
            if step > 0:
                fed = tokens[-1] if feed is None else feed[step - 1]
                out = model(input_ids=fed.view(1, 1), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1].float())
            tokens.append(logits[-1].argmax())
        _sync(prompt.device)
        e2, t2 = experts(), time.perf_counter()
    return Generation(
        torch.stack(tokens).cpu(), torch.stack(logits).cpu(), t1 - t0, t2 - t1, e1 - e0, e2 - e1
    )


@dataclass
class DemoResult:
    """What :func:`run` measured and concluded.

    Attributes:
        ok: the verdict of the check.
        mismatches: steps where kt_ops' greedy choice differs from the reference's token.
        near_ties: the mismatches the check accepts (bf16 only: the reference's own margin
            between the two tokens is within the logit tolerance).
        max_abs_logit_diff: max |kt_ops - reference| over all steps and the vocabulary.
        logit_tol: the tolerance it is held to.
        min_margin: smallest top-1/top-2 logit gap of the reference over the steps.
        reference, kt: the two runs (kt_ops teacher-forced on the reference's tokens).
        replaced: number of experts modules replaced.
        gpu_experts: GPU-resident experts per layer (``--gpu-experts``).
        gpu_share: fraction of the prompt's routed (token, slot) pairs that the
            GPU-resident experts served (0 without them).
        device: where the model ran (``cpu`` or ``cuda``).
    """

    ok: bool
    mismatches: list[int]
    near_ties: list[int]
    max_abs_logit_diff: float
    logit_tol: float
    min_margin: float
    reference: Generation
    kt: Generation
    replaced: int
    gpu_experts: int = 0
    gpu_share: float = 0.0
    device: str = "cpu"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kt_ops.demo",
        description="Greedy generation with a random-weight MoE model, with and without kt_ops: "
        "checks that kt_ops makes the same greedy choices with close logits, and compares "
        "prefill/decode speed. Exit status 1 when the check fails. Layer sizes default to "
        "Qwen3-30B-A3B's.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add("--arch", choices=ARCHS, default="qwen3_moe", help="model code (router, attention)")
    add("--layers", type=int, default=2, help="decoder layers, all MoE")
    add("--hidden-size", type=int, default=2048, help="H")
    add("--moe-intermediate-size", type=int, default=768, help="I of each expert")
    add("--num-experts", type=int, default=128, help="routed experts per layer")
    add("--top-k", type=int, default=8, help="experts per token")
    add("--num-heads", type=int, default=32, help="attention heads")
    add("--num-kv-heads", type=int, default=4, help="key/value heads (not deepseek_v3)")
    add("--head-dim", type=int, default=128, help="attention head dim")
    add("--vocab-size", type=int, default=2048, help="vocabulary")
    add("--init-std", type=float, default=0.02, help="std of the random weights")
    add("--prompt-tokens", type=int, default=64, help="prompt length (prefill)")
    add("--new-tokens", type=int, default=32, help="generated tokens (>= 2)")
    add("--dtype", choices=sorted(_DTYPES), default="fp32", help="model dtype")
    add(
        "--threads",
        type=int,
        default=None,
        help="torch and kt_ops threads; None: kt_ops' pool size",
    )
    add("--seed", type=int, default=0, help="seed of weights and prompt")
    add("--warmup", type=int, default=1, help="untimed warm-up generations per model")
    add(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model runs; cuda: the experts through kt_ops from CUDA hidden states "
        f"(exits with status {NO_CUDA_STATUS} when no CUDA device is present)",
    )
    add(
        "--gpu-experts",
        type=int,
        default=0,
        help="CPU/GPU hybrid: per layer, the N experts most hit on a calibration prompt run "
        "in torch on the model's device, the rest in kt_ops (works on --device cpu too)",
    )
    return p


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, flush=True)


def run(argv: Optional[Sequence[str]] = None, *, quiet: bool = False) -> DemoResult:
    """Run the demo with command-line style arguments (see ``--help``); returns the result.

    Prints progress, the timing table and the verdict unless ``quiet``.

    Raises:
        SystemExit: bad arguments (from argparse).
        ValueError: a size flag below its minimum (``--new-tokens`` >= 2: one
            prefill step and at least one decode step), ``--top-k`` above
            ``--num-experts``, or ``--gpu-experts`` outside ``[0, --num-experts]``.
        NoCudaDevice: ``--device cuda`` without a CUDA device, or with a
            kt_ops build without the CUDA bridge (``main`` prints it and
            returns 2).
    """
    args = _parser().parse_args(argv)
    minimum = dict(layers=1, prompt_tokens=1, new_tokens=2, num_experts=1, top_k=1, warmup=0)
    for flag, low in minimum.items():
        if getattr(args, flag) < low:
            raise ValueError(
                f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}"
            )
    if args.top_k > args.num_experts:
        raise ValueError(f"--top-k {args.top_k} exceeds --num-experts {args.num_experts}")
    if not 0 <= args.gpu_experts <= args.num_experts:
        raise ValueError(
            f"--gpu-experts must be in [0, --num-experts={args.num_experts}], "
            f"got {args.gpu_experts}"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        raise NoCudaDevice(
            f"--device cuda: no CUDA device is present (torch {torch.__version__}, {build}; "
            "torch.cuda.is_available() is False). Nothing was run. Use --device cpu; "
            "--gpu-experts N runs the CPU/GPU split of the experts on the CPU."
        )
    if args.device == "cuda":
        if not cuda_bridge_built():
            raise NoCudaDevice(
                "--device cuda: this kt_ops build has no CUDA bridge (kt_ops.hybrid."
                "cuda_bridge_built() is False: built against a CPU torch, or a CUDA torch older "
                "than 2.7), so its ops take CPU tensors only. Nothing was run."
            )
    device = torch.device(args.device)
    if args.threads is not None:
        kt_ops.set_num_threads(args.threads)
    threads = kt_ops.get_num_threads()
    torch.set_num_threads(threads)
    dtype = _DTYPES[args.dtype]

    config = make_config(
        args.arch,
        hidden_size=args.hidden_size,
        moe_intermediate_size=args.moe_intermediate_size,
        num_experts=args.num_experts,
        top_k=args.top_k,
        num_layers=args.layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        init_std=args.init_std,
    )
    expert_params = 3 * args.num_experts * args.hidden_size * args.moe_intermediate_size
    expert_params *= args.layers
    params = (
        f"{expert_params / 1e9:.2f} B" if expert_params >= 1e8 else f"{expert_params / 1e6:.2f} M"
    )
    _log(
        f"model      : {args.arch}, {args.layers} MoE layers, hidden {args.hidden_size}, "
        f"{args.num_experts} experts x intermediate {args.moe_intermediate_size}, "
        f"top-{args.top_k}, vocab {args.vocab_size}, {args.dtype}; "
        f"{params} expert params, random (seed {args.seed})",
        quiet,
    )
    t = time.perf_counter()
    model = build_model(config, dtype=dtype, seed=args.seed).to(device)
    _log(f"build      : {time.perf_counter() - t:.1f} s ({args.device})", quiet)

    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, args.vocab_size, (1, args.prompt_tokens), generator=gen)
    calibration = torch.randint(0, args.vocab_size, (1, args.prompt_tokens), generator=gen)
    prompt, calibration = prompt.to(device), calibration.to(device)
    warm_prompt = prompt[:, : min(8, args.prompt_tokens)]

    for _ in range(args.warmup):
        greedy_generate(model, warm_prompt, 2)
    timer = ExpertTimer(model)
    reference = greedy_generate(model, prompt, args.new_tokens, timer=timer)
    timer.remove()

    hybrid = {}
    if args.gpu_experts:
        stats = collect_routing_stats(model, input_ids=calibration)
        hybrid = dict(num_gpu_experts=args.gpu_experts, routing_stats=stats)
    t = time.perf_counter()
    kt_ops.replace_experts(model, **hybrid)
    replaced = sum(isinstance(m, MoEExperts) for m in model.modules())
    _log(
        f"kt_ops     : replaced {replaced} experts modules in {time.perf_counter() - t:.1f} s"
        + (f", {args.gpu_experts} GPU-resident experts per layer" if args.gpu_experts else ""),
        quiet,
    )
    gpu_share = _gpu_share(model, prompt) if args.gpu_experts else 0.0
    for _ in range(args.warmup):
        greedy_generate(model, warm_prompt, 2)
    timer = ExpertTimer(model)
    kt = greedy_generate(model, prompt, args.new_tokens, feed=reference.tokens, timer=timer)
    timer.remove()
    result = _check(reference, kt, args.dtype, replaced)
    result.gpu_experts, result.gpu_share, result.device = args.gpu_experts, gpu_share, args.device
    if not quiet:
        print(_report(args, result, threads))
    return result


def _gpu_share(model: nn.Module, prompt: Tensor) -> float:
    """Fraction of ``prompt``'s routed slots that went to GPU-resident experts (untimed pass)."""
    stats = collect_routing_stats(model, input_ids=prompt)
    hit = total = 0
    for name, counts in stats.counts.items():
        module = model.get_submodule(name)
        total += int(counts.sum())
        if module.num_gpu_experts:
            hit += int(counts[module.gpu_expert_ids.cpu()].sum())
    return hit / total if total else 0.0


def _check(reference: Generation, kt: Generation, dtype: str, replaced: int) -> DemoResult:
    """Compare the two runs step by step (both saw the same tokens); see the module docstring."""
    max_logit = reference.logits.abs().max().item()
    tol = LOGIT_RTOL[dtype] * max_logit
    tie_tol = TIE_RTOL[dtype] * max_logit
    diff = (reference.logits - kt.logits).abs().max().item()
    mismatches = (reference.tokens != kt.tokens).nonzero().flatten().tolist()
    near_ties = []
    for i in mismatches:
        preferred = reference.logits[i, reference.tokens[i]] - reference.logits[i, kt.tokens[i]]
        if preferred.item() <= tie_tol:
            near_ties.append(i)
    top2 = reference.logits.topk(2, dim=-1).values
    min_margin = (top2[:, 0] - top2[:, 1]).min().item()
    ok = diff <= tol and len(near_ties) == len(mismatches)
    return DemoResult(ok, mismatches, near_ties, diff, tol, min_margin, reference, kt, replaced)


def _report(args: argparse.Namespace, r: DemoResult, threads: int) -> str:
    P, N = args.prompt_tokens, args.new_tokens
    steps = max(N - 1, 1)
    ref, kt = r.reference, r.kt

    def row(*cells: str) -> str:
        widths = (11, 9, 9, 12, 10, 9, 11)
        return "".join(
            f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths))
        )

    def speeds(g: Generation) -> tuple[str, ...]:
        return (
            f"{P / g.prefill_s:.1f}",
            f"{g.prefill_s * 1e3:.0f}",
            f"{g.prefill_experts_s * 1e3:.0f}",
            f"{steps / g.decode_s:.2f}",
            f"{g.decode_s / steps * 1e3:.1f}",
            f"{g.decode_experts_s / steps * 1e3:.2f}",
        )

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b > 0 else "-"

    info = kt_ops.info()
    topo = info["topology"]
    prefill_x, decode_x = ref.prefill_s / kt.prefill_s, ref.decode_s / kt.decode_s
    n_same = N - len(r.mismatches)
    tokens = f"{n_same}/{N} greedy choices identical"
    if r.near_ties:
        tokens += f" ({len(r.near_ties)} differing at bf16 near-ties, steps {r.near_ties})"
    lines = [
        "",
        f"{'':<11}{f'prefill ({P} tokens)':^30}{f'decode ({steps} tokens)':^30}",
        row("", "tok/s", "ms", "experts ms", "tok/s", "ms/tok", "experts ms"),
        row("reference", *speeds(ref)),
        row("kt_ops", *speeds(kt)),
        row(
            "speed-up",
            f"{prefill_x:.2f}x",
            "",
            ratio(ref.prefill_experts_s, kt.prefill_experts_s),
            f"{decode_x:.2f}x",
            "",
            ratio(ref.decode_experts_s, kt.decode_experts_s),
        ),
        "(experts ms: time inside the routed-experts modules; per token for decode)",
        "",
        f"kt_ops     : ISA {info['active_isa']} (supported: {', '.join(info['supported_isas'])}), "
        f"{threads} threads; {topo['num_cores']} cores, {topo['num_numa_nodes']} NUMA node(s)",
        f"device     : {r.device}"
        + (
            f"; hybrid: {r.gpu_experts}/{args.num_experts} experts per layer GPU-resident "
            f"(hottest on a calibration prompt), computed by torch on {r.device}; they served "
            f"{100 * r.gpu_share:.1f}% of the prompt's routed slots"
            if r.gpu_experts
            else ""
        ),
        f"tokens     : {tokens}; reference starts {ref.tokens[:8].tolist()}",
        f"logits     : max |kt_ops - reference| = {r.max_abs_logit_diff:.3g} (tolerance "
        f"{r.logit_tol:.3g} = {LOGIT_RTOL[args.dtype]:g} x max |logit|; smallest top-1/top-2 "
        f"gap in the reference {r.min_margin:.3g})",
    ]
    if r.ok:
        verdict = (
            f"PASS: kt_ops reproduces the reference ({n_same}/{N} identical greedy tokens, "
            f"logits within tolerance); prefill {prefill_x:.2f}x, decode {decode_x:.2f}x the "
            "reference speed"
        )
    else:
        why = []
        bad = [i for i in r.mismatches if i not in r.near_ties]
        if bad:
            i = bad[0]
            ref_tok, kt_tok = int(ref.tokens[i]), int(kt.tokens[i])
            gap = (ref.logits[i, ref_tok] - ref.logits[i, kt_tok]).item()
            why.append(
                f"greedy tokens differ at {len(bad)} step(s), first at step {i} (reference "
                f"{ref_tok}, kt_ops {kt_tok}; the reference preferred its token by {gap:.3g})"
            )
        if not r.max_abs_logit_diff <= r.logit_tol:
            why.append(f"logit difference {r.max_abs_logit_diff:.3g} > {r.logit_tol:.3g}")
        verdict = "FAIL: " + "; ".join(why)
    lines.append(f"verdict    : {verdict}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``python -m kt_ops.demo``; returns the exit status (0: check passed)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        return 0 if run(argv).ok else 1
    except NoCudaDevice as err:
        print(f"error      : {err}", file=sys.stderr, flush=True)
        return NO_CUDA_STATUS


if __name__ == "__main__":
    sys.exit(main())
