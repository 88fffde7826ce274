#!/usr/bin/env python
"""Decode/prefill speed of every weight format of ``kt_ops.moe_forward`` vs bf16, in one process.

For one Qwen3-30B-A3B MoE layer (H=2048, I=768, E=128, top-8) this times
``kt_ops.moe_forward`` in every format of ``kt_ops.formats.FORMATS``
(``int4`` twice: group 128 symmetric, the headline, and group 32) at decode
(T = 1 and T = 8) and, with ``--prefill``, at T = 512. Each format is timed
interleaved with bf16 (alternating which goes first, same inputs), so its
speed-up is a ratio of two medians taken in the same minutes of the same run,
on the same noisy host. Per format it reports:

* ``ms``: median over the repetitions (>= 15 at decode), and the paired bf16 median;
* ``speed-up`` = bf16 ms / format ms, and the **target** 0.7 x (bf16 bytes /
  format bytes) per expert, i.e. 70% of the speed-up that the byte ratio allows
  a memory-bound decode, with pass/fail (decode only);
* ``MB/call``: bytes of the expert weights the call reads, = distinct experts
  hit x (gate + up + down ``PackedProjection.nbytes`` / E), scales and zeros
  included (at T = 1 this is the bytes per token);
* ``GB/s`` = those bytes / time, and ``BW roofline`` = (bytes / read
  bandwidth) / time, medians over the calls; prefill (compute-bound) reports
  GFLOP/s instead. No compute roofline: the q8 formats multiply int8 codes,
  whose peak the fp32 ``torch.mm`` of ``bench_moe`` does not measure, and on a
  loaded 2-core host that two-thread ``torch.mm`` peak collapses (a descheduled
  MKL thread stalls the other).

Decode is measured the way serving sees it: a decode step reads each layer's
routed experts once, and the other layers stream gigabytes in between, so none
of them is in cache. Before every timed call this benchmark reads a 96 MiB
buffer (3x the 32 MiB L3 of the development machine) to evict the caches,
pauses ``--settle-ms`` (OpenMP threads of that read park), runs one untimed
*lead* call of the same format on 8 fixed experts (the thread pool is awake, as
when one MoE layer follows another; see benchmarks/README.md), then times the
call on fresh random routing (softmax of random logits, top-k, renormalized)
that never uses the lead's experts. So every timed call streams its experts
from DRAM.

The bf16 source weights are seeded random (``bench_moe.make_weights``).
Quantizing 128 experts x 3 projections into 11 formats takes ~15 minutes on
two cores, so by default ``--unique-experts 16`` distinct experts are drawn and
quantized per format and their packed tensors copied to fill all 128 experts:
every expert still has its own memory (1.2 GB in bf16), so the bytes streamed
and the timings are those of the full layer (the kernels do not depend on the
values); ``--unique-experts 128`` quantizes every expert. Formats are built
and measured one at a time; bf16 stays resident as the baseline and each
format's tensors are freed once measured.

The read bandwidth comes from ``bench_moe.measure_read_bandwidth`` (torch.sum
over 1 GiB), sampled before and after the runs; the best sample is the ceiling.

Usage::

    python benchmarks/bench_formats.py --markdown              # decode, every format (~3 min)
    python benchmarks/bench_formats.py --prefill --markdown    # + T = 512 (~4 min in all)
    python benchmarks/bench_formats.py --quick                 # 4 formats, T = 1, few reps
    python benchmarks/bench_formats.py --formats bf16 int4-g128 int4-g64-asym q4_k

Not part of the test suite (pytest only collects ``tests/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch

import kt_ops
from kt_ops.formats import FORMATS, PackedProjection, quantize_weights

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import (  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
    BW_BYTES,
    PRESETS,
    Call,
    Flusher,
    Shape,
    _cpu_model,
    _mem_available_gb,
    _tile,
    _time,
    cold_inputs,
    make_weights,
    measure_read_bandwidth,
    render_table,
)

#: Headline variant of each format, in FORMATS order; int4 also at group 32.
DEFAULT_VARIANTS = tuple(
    v for f in FORMATS for v in ((f,) if f != "int4" else ("int4-g128", "int4-g32"))
)
QUICK_VARIANTS = ("bf16", "int8", "int4-g128", "q4_k")

DECODE_TOKENS = (1, 8)
PREFILL_TOKENS = 512
DEFAULT_REPEATS = {1: 41, 8: 25}  # decode: >= 15 timed calls per format
DEFAULT_REPEATS_LARGE = 5
QUICK_REPEATS = 9
TARGET_FRACTION = 0.7  # a format must reach 70% of its byte ratio over bf16 at decode


@dataclass(frozen=True)
class Variant:
    """One measured configuration: a weight format and its quantizer arguments."""

    label: str
    weight_format: str
    group_size: Optional[int] = None  # None: the format's default
    symmetric: bool = True
    activations: str = "auto"  # kt_ops.set_quant_activations mode for this variant's calls


def parse_variant(label: str) -> Variant:
    """A format name (``bf16``, ``q4_k``, ...) or ``int4-g<group>[-asym]`` (``int4-g32-asym``).

    A suffix ``@q8``, ``@fp32`` or ``@auto`` pins the compute path
    (:func:`kt_ops.set_quant_activations`), e.g. ``int4-g128@fp32`` for w4a16.
    """
    name, _, mode = label.partition("@")
    if mode:
        if mode not in ("auto", "q8", "fp32"):
            raise argparse.ArgumentTypeError(f"{label!r}: the suffix must be @auto, @q8 or @fp32")
        return dataclasses.replace(parse_variant(name), label=label, activations=mode)
    m = re.fullmatch(r"int4-g(\d+)(-asym)?", label)
    if m:
        return Variant(label, "int4", int(m.group(1)), m.group(2) is None)
    if label == "int4":
        return Variant("int4-g128", "int4", 128, True)
    if label not in FORMATS:
        raise argparse.ArgumentTypeError(
            f"unknown format {label!r}; expected one of {FORMATS} or int4-g<32|64|128>[-asym]"
        )
    return Variant(label, label)


# --------------------------------------------------------------------------- weights


@dataclass
class Sizes:
    """What is kept of a variant once its tensors are freed."""

    variant: Variant
    group_size: int
    bytes_per_expert: float  # (gate + up + down) nbytes / E: weights, scales, zeros
    bits_per_weight: float
    build_s: float


@dataclass
class Packed:
    """gate, up, down of one variant for all E experts."""

    variant: Variant
    gate: PackedProjection
    up: PackedProjection
    down: PackedProjection
    build_s: float

    def sizes(self) -> Sizes:
        projs = (self.gate, self.up, self.down)
        nbytes = sum(p.nbytes for p in projs)
        experts = self.gate.num_experts
        n_weights = experts * sum(p.n * p.k for p in projs)
        bits = 8 * nbytes / n_weights
        return Sizes(self.variant, self.gate.group_size, nbytes / experts, bits, self.build_s)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with kt_ops.use_quant_activations(self.variant.activations):
            return self._forward(x, ids, w)

    def _forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kt_ops.moe_forward(x, ids, w, self.experts)

    @functools.cached_property
    def experts(self) -> kt_ops.ExpertWeights:
        # One ExpertWeights per variant: the op's eager inference calls keep their
        # parsed layer on it (kt_ops.moe_forward), as a model's layer does.
        return kt_ops.ExpertWeights(self.gate, self.up, self.down)


def build_variant(
    variant: Variant, dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor], experts: int
) -> Packed:
    """Quantize the unique dense experts once, then copy the packed tensors to ``experts``."""
    t0 = time.perf_counter()
    projs = []
    for w in dense:
        p = quantize_weights(w, variant.weight_format, variant.group_size, variant.symmetric)
        tiled = (_tile(t, experts) for t in (p.weight, p.scales, p.zeros))
        projs.append(PackedProjection(*tiled, p.weight_format, p.group_size, p.n, p.k).validate())
        del p
    return Packed(variant, *projs, build_s=time.perf_counter() - t0)


# --------------------------------------------------------------------------- inputs


# --------------------------------------------------------------------------- timing


@dataclass
class PairSamples:
    """Interleaved samples of one variant and bf16 at one token count (same inputs)."""

    tokens: int
    experts_hit: list[int] = field(default_factory=list)
    fmt_s: list[float] = field(default_factory=list)
    bf16_s: list[float] = field(default_factory=list)
    rel_err: Optional[float] = None  # ||y - y_bf16|| / ||y_bf16|| on the first warm-up input


@torch.no_grad()  # once for the whole loop, as generate() runs a decode (bench_moe._time)
def time_pair(
    fmt: Packed,
    base: Packed,
    calls: list[Call],
    lead: Call,
    warmup: int,
    budget_s: float,
    settle_s: float,
    flush: Flusher,
) -> PairSamples:
    """Time ``fmt`` and ``base`` (bf16) interleaved, alternating the order, on cold weights."""

    def timed(p: Packed, c: Call) -> float:
        flush()  # nothing of this layer stays in cache between decode steps
        time.sleep(settle_s)  # the flush's (torch) OpenMP threads park
        p.forward(lead.x, lead.ids, lead.weights)  # threads awake, as layer after layer
        return _time(lambda: p.forward(c.x, c.ids, c.weights))

    s = PairSamples(calls[0].x.shape[0])
    for i in range(warmup):
        c = calls[i]
        y = fmt.forward(c.x, c.ids, c.weights).float()
        if fmt is not base:
            y_ref = base.forward(c.x, c.ids, c.weights).float()
            if i == 0:
                s.rel_err = ((y - y_ref).norm() / y_ref.norm()).item()
    start = time.perf_counter()
    for r, c in enumerate(calls[warmup:]):
        order = [fmt] if fmt is base else [fmt, base] if r % 2 == 0 else [base, fmt]
        for p in order:
            (s.fmt_s if p is fmt else s.bf16_s).append(timed(p, c))
        s.experts_hit.append(c.experts_hit)
        if r + 1 >= 3 and time.perf_counter() - start > budget_s:
            break
    if fmt is base:
        s.bf16_s = list(s.fmt_s)
    return s


# --------------------------------------------------------------------------- summary


@dataclass
class Row:
    label: str
    weight_format: str
    group_size: int
    bits_per_weight: float
    mb_per_expert: float
    tokens: int
    repeats: int
    experts_hit: float
    mb_per_call: float
    ms: float
    bf16_ms: float  # paired bf16 median
    speedup: float  # bf16_ms / ms
    byte_ratio: float  # bf16 bytes / format bytes, per expert
    target: Optional[float]  # TARGET_FRACTION * byte_ratio (decode, quantized formats)
    meets: Optional[bool]
    gbs: float  # weight bytes / time, median over calls
    bw_roofline_pct: float  # (bytes / read bandwidth) / time, median over calls
    gflops: float
    rel_err: Optional[float]


def summarize(shape: Shape, p: Sizes, bf16_bytes: float, s: PairSamples, bw_gbs: float) -> Row:
    """Medians, speed-up, target and roofline fractions of one variant at one token count."""
    flops = 2 * s.tokens * shape.top_k * 3 * shape.hidden * shape.intermediate
    nbytes = [hit * p.bytes_per_expert for hit in s.experts_hit]
    gbs = [b / t / 1e9 for b, t in zip(nbytes, s.fmt_s)]
    pct = [100 * b / (bw_gbs * 1e9) / t for b, t in zip(nbytes, s.fmt_s)]
    gflops = [flops / t / 1e9 for t in s.fmt_s]
    ms, bf16_ms = 1e3 * statistics.median(s.fmt_s), 1e3 * statistics.median(s.bf16_s)
    speedup = bf16_ms / ms
    ratio = bf16_bytes / p.bytes_per_expert
    decode = s.tokens <= max(DECODE_TOKENS)
    quantized = p.variant.weight_format != "bf16"
    target = TARGET_FRACTION * ratio if decode and quantized else None
    return Row(
        label=p.variant.label,
        weight_format=p.variant.weight_format,
        group_size=p.group_size,
        bits_per_weight=p.bits_per_weight,
        mb_per_expert=p.bytes_per_expert / 1e6,
        tokens=s.tokens,
        repeats=len(s.fmt_s),
        experts_hit=statistics.median(s.experts_hit),
        mb_per_call=statistics.median(nbytes) / 1e6,
        ms=ms,
        bf16_ms=bf16_ms,
        speedup=speedup,
        byte_ratio=ratio,
        target=target,
        meets=None if target is None else speedup >= target,
        gbs=statistics.median(gbs),
        bw_roofline_pct=statistics.median(pct),
        gflops=statistics.median(gflops),
        rel_err=s.rel_err,
    )


def table(rows: list[Row], markdown: bool, with_err: bool = False) -> str:
    """One table per token count: decode tables with targets, prefill with GFLOP/s."""
    out = []
    for T in sorted({r.tokens for r in rows}):
        rs = [r for r in rows if r.tokens == T]
        decode = T <= max(DECODE_TOKENS)
        head = ["format", "bits/w", "MB/expert", "experts hit", "MB/call", "ms", "bf16 ms"]
        head += ["speed-up"]
        head += ["target", "meets"] if decode else []
        head += ["GB/s", "BW roofline"] if decode else ["GFLOP/s"]
        head += ["rel err (sanity)"] if with_err else []
        body = []
        for r in rs:
            b = [
                f"`{r.label}`" if markdown else r.label,
                f"{r.bits_per_weight:.3g}",
                f"{r.mb_per_expert:.2f}",
                f"{r.experts_hit:g}",
                f"{r.mb_per_call:.1f}",
                f"{r.ms:.2f}",
                f"{r.bf16_ms:.2f}",
                f"{r.speedup:.2f}x",
            ]
            if decode:
                b += ["-", "-"] if r.target is None else [f"{r.target:.2f}x"]
                if r.target is not None:
                    b += ["yes" if r.meets else "**no**" if markdown else "NO"]
                b += [f"{r.gbs:.1f}", f"{r.bw_roofline_pct:.0f}%"]
            else:
                b += [f"{r.gflops:.1f}"]
            if with_err:
                b += ["-" if r.rel_err is None else f"{r.rel_err:.3g}"]
            body.append(b)
        kind = "decode" if decode else "prefill"
        reps = min(r.repeats for r in rs)
        title = f"T = {T} ({kind}, {reps}+ timed calls per format)"
        out.append(f"**{title}**\n" if markdown else f"# {title}")
        out.append(render_table(head, body, markdown))
        out.append("")
    return "\n".join(out).rstrip()


# --------------------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3", help="layer shape")
    p.add_argument("--experts", type=int, help="override the preset's expert count")
    p.add_argument(
        "--formats",
        nargs="+",
        type=parse_variant,
        help=f"variants to run (default {' '.join(DEFAULT_VARIANTS)}); bf16 is always added",
    )
    p.add_argument(
        "--unique-experts",
        type=int,
        default=16,
        help="distinct experts drawn and quantized per format, copied to fill the layer "
        "(default 16; the layer's expert count quantizes them all)",
    )
    p.add_argument("--tokens", type=int, nargs="+", help="token counts (default 1 8)")
    p.add_argument("--prefill", action="store_true", help=f"also T = {PREFILL_TOKENS} (slow)")
    p.add_argument(
        "--repeats",
        type=int,
        help=f"timed calls per format and T (default {DEFAULT_REPEATS}, "
        f"else {DEFAULT_REPEATS_LARGE})",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per format and T first")
    p.add_argument(
        "--budget", type=float, default=60.0, help="seconds per format and T, then stop (>= 3)"
    )
    p.add_argument("--settle-ms", type=float, default=20.0, help="pause before every lead call")
    p.add_argument("--threads", type=int, help="kt_ops and torch threads (default: kt_ops')")
    p.add_argument("--isa", choices=kt_ops.supported_isas(), help="kt_ops ISA path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"development run: {' '.join(QUICK_VARIANTS)}, T = 1, {QUICK_REPEATS} calls, "
        "8 unique experts",
    )
    p.add_argument("--markdown", action="store_true", help="also print markdown tables")
    p.add_argument("--json", metavar="PATH", help="write header, rows and samples as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.formats = args.formats or [parse_variant(v) for v in QUICK_VARIANTS]
        args.tokens = args.tokens or [1]
        args.repeats = args.repeats or QUICK_REPEATS
        args.unique_experts = min(args.unique_experts, 8)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    shape = PRESETS[args.preset]
    if args.experts:
        shape = shape.with_experts(args.experts)
    E, H, Im = shape.experts, shape.hidden, shape.intermediate
    variants = args.formats or [parse_variant(v) for v in DEFAULT_VARIANTS]
    variants = [parse_variant("bf16")] + [v for v in variants if v.label != "bf16"]
    tokens = list(args.tokens or DECODE_TOKENS)
    if args.prefill and PREFILL_TOKENS not in tokens:
        tokens.append(PREFILL_TOKENS)
    unique = max(1, min(args.unique_experts, E))
    threads = args.threads or kt_ops.get_num_threads()
    kt_ops.set_num_threads(threads)
    torch.set_num_threads(threads)
    if args.isa:
        kt_ops.set_isa(args.isa)

    bf16_gb = 3 * E * H * Im * 2 / 1e9
    # bf16 baseline + the largest other format (~8.5 bits) + dense source + transients.
    need_gb = bf16_gb * (1 + 0.55) + 3 * unique * H * Im * 2 / 1e9 + BW_BYTES / 1e9 + 0.5
    avail = _mem_available_gb()
    if avail is not None and need_gb > 0.9 * avail:
        print(
            f"error: needs ~{need_gb:.1f} GB, {avail:.1f} GB available; pass --experts N",
            file=sys.stderr,
        )
        return 2

    info = kt_ops.info()
    print(f"# kt_ops weight-format benchmark: {shape.model} layer, every format vs bf16")
    print(
        f"#   H={H} I={Im} E={E} top-{shape.top_k}; {bf16_gb:.2f} GB of bf16 expert weights; "
        f"{unique} distinct random experts quantized per format, copied to fill {E}"
    )
    print(
        f"#   kt_ops {kt_ops.__version__}: isa={kt_ops.active_isa()}, threads={threads}, "
        f"{_cpu_model()}, {info['topology']['num_cores']} cores; torch {torch.__version__}"
    )
    bw = measure_read_bandwidth()
    print(
        f"#   before the runs: read bandwidth {statistics.median(bw):.1f} GB/s median "
        f"[{min(bw):.1f}..{max(bw):.1f}]",
        flush=True,
    )

    gate_up, down = make_weights(
        Shape(shape.model, H, Im, unique, shape.top_k, shape.norm_topk_prob), args.seed
    )
    dense = (gate_up[:, :Im], gate_up[:, Im:], down)

    inputs = {}
    for T in tokens:
        reps = args.repeats or DEFAULT_REPEATS.get(T, DEFAULT_REPEATS_LARGE)
        inputs[T] = cold_inputs(shape, T, args.warmup + reps, args.seed)
    flush = Flusher()
    settle = args.settle_ms / 1e3

    samples: dict[tuple[str, int], PairSamples] = {}
    sizes: dict[str, Sizes] = {}
    base: Optional[Packed] = None
    t_all = time.perf_counter()
    for v in variants:
        p = build_variant(v, dense, E)
        base = base or p  # bf16 comes first and stays resident
        sz = sizes[v.label] = p.sizes()
        line = (
            f"#   {v.label}: {sz.bits_per_weight:.3f} bits/weight, "
            f"{sz.bytes_per_expert / 1e6:.2f} MB/expert, built in {sz.build_s:.1f}s;"
        )
        for T in tokens:
            calls, lead = inputs[T]
            t1 = time.perf_counter()
            s = time_pair(p, base, calls, lead, args.warmup, args.budget, settle, flush)
            samples[(v.label, T)] = s
            line += (
                f" T={T} {1e3 * statistics.median(s.fmt_s):.2f} ms vs bf16 "
                f"{1e3 * statistics.median(s.bf16_s):.2f} ms ({len(s.fmt_s)} reps, "
                f"{time.perf_counter() - t1:.0f}s);"
            )
        print(line, flush=True)
        del p  # free this format's tensors before building the next
        gc.collect()
    del flush, base
    total_s = time.perf_counter() - t_all

    bw_after = measure_read_bandwidth()
    bw_all = bw + bw_after
    bw_best = max(bw_all)
    bf16_bytes = sizes["bf16"].bytes_per_expert
    rows = [
        summarize(shape, sizes[v.label], bf16_bytes, samples[(v.label, T)], bw_best)
        for T in tokens
        for v in variants
    ]
    print(
        f"#   after the runs: read bandwidth {statistics.median(bw_after):.1f} GB/s median; the "
        f"roofline uses the best of all {len(bw_all)} samples: {bw_best:.1f} GB/s; "
        f"total {total_s:.0f}s"
    )
    print(
        "#   speed-up = paired bf16 ms / format ms (medians); target = 0.7 x bf16 bytes / format "
        "bytes per expert; MB/call = distinct experts hit x bytes per expert (gate+up+down, "
        "scales and zeros included); BW roofline = (MB/call / read bandwidth) / time"
    )
    print(table(rows, markdown=False, with_err=True))
    misses = [f"{r.label} T={r.tokens}" for r in rows if r.meets is False]
    print("#   decode targets: " + ("all met" if not misses else "missed by " + ", ".join(misses)))
    if args.markdown:
        print()
        print(
            f"{shape.model} layer (H={H}, I={Im}, E={E}, top-{shape.top_k}), {threads} threads, "
            f"isa {kt_ops.active_isa()}; read bandwidth {bw_best:.1f} GB/s (best sample of the "
            "same run); every timed call on cold weights."
        )
        print()
        print(table(rows, markdown=True))
    if args.json:
        header = {
            "model": shape.model,
            "shape": asdict(shape),
            "unique_experts": unique,
            "threads": threads,
            "kt_isa": kt_ops.active_isa(),
            "cpu": _cpu_model(),
            "torch": torch.__version__,
            "read_bandwidth_gbs": bw_best,
            "read_bandwidth_samples": bw_all,
            "target_fraction": TARGET_FRACTION,
        }
        raw = [{"label": k[0], **asdict(s)} for k, s in samples.items()]
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": [asdict(r) for r in rows], "samples": raw}, f)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
