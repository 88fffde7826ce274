#!/usr/bin/env python
"""Benchmark ``kt_ops.moe_forward`` against PyTorch eager, with a roofline, in one process.

For one MoE layer (default: Qwen3-30B-A3B, hidden 2048, expert intermediate
768, 128 experts, top-8) and each token count T, this times

* ``kt``    -- ``kt_ops.moe_forward`` on bf16 ``kt_ops.ExpertWeights``;
* ``torch`` -- the eager expert loop of Hugging Face transformers
  (``Qwen3MoeExperts.forward``, 5.x: one_hot mask, loop over the experts hit,
  ``F.linear`` on bf16 ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``,
  ``silu(gate) * up``, ``index_add_``), copied below so transformers is not needed;

with the same thread count for both, runs interleaved (alternating which goes
first) so that host noise hits both, and fresh seeded routing for every
repetition (random distinct top-k experts per token, weights from a softmax), so
that decode reads expert weights from DRAM as a real decode step does, rather
than from a warm L3.

Roofline: the time bound of a call is max(weight bytes / read bandwidth,
FLOPs / compute peak) (``machine_peaks.roofline``), where

* weight bytes = distinct experts hit x 3 projections x H x I x 2 (bf16);
* FLOPs        = 2 x T x top_k x 3 x H x I;
* read bandwidth = torch.sum over a 1 GiB fp32 tensor (far beyond L3),
* compute peak   = the faster of the bf16 peak, torch.mm of cache-resident bf16
  512^3 matrices (oneDNN: ``vdpbf16ps`` on AVX512_BF16, AMX tiles where present),
  and the fp32 peak, the faster of torch.mm fp32 and kt_ops' FMA chains
  (``machine_peaks.measure_fp32_peak``): kt_ops runs a bf16 layer as fp32 FMAs
  where bf16 dot products are missing (AVX2) or slower (Intel CPUs with
  AVX512_BF16 and no AMX, docs/formats.md "Compute paths"),

both measured in this process at the benchmark's thread count, before and after
the timed runs; the best sample is the ceiling (STREAM's convention: load from
other processes only lowers a sample). "roofline %" is bound / time, medians;
the "bound by" column names the binding term (read: the bytes; bf16 or fp32:
the FLOPs at that peak).

Usage::

    python benchmarks/bench_moe.py                      # Qwen3-30B-A3B, T = 1, 8, 512, 2048
    python benchmarks/bench_moe.py --tokens 1 4 64 --threads 1 --markdown
    python benchmarks/bench_moe.py --preset olmoe --json out.json

Not part of the test suite (pytest only collects ``tests/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import kt_ops
from kt_ops.formats import quantize_weights
from kt_ops.formats.packed import empty_huge_pages


@dataclass(frozen=True)
class Shape:
    """One MoE layer's routed-expert shape (design.md, "Reference shapes")."""

    model: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    norm_topk_prob: bool = True

    def with_experts(self, experts: int) -> Shape:
        """The same layer with ``experts`` routed experts (``--experts``: less memory)."""
        return dataclasses.replace(
            self, model=f"{self.model} ({experts} of {self.experts} experts)", experts=experts
        )


PRESETS = {
    "qwen3": Shape("Qwen3-30B-A3B", 2048, 768, 128, 8, True),
    "olmoe": Shape("OLMoE-1B-7B", 2048, 1024, 64, 8, False),
    "granite": Shape("Granite-3.0-1B-A400M", 1024, 512, 32, 8, True),
    "mixtral": Shape("Mixtral-8x7B", 4096, 14336, 8, 2, True),
    # 256 experts are 22.5 GB in bf16: pass --experts to run a slice of the layer.
    "deepseek": Shape("DeepSeek-V3", 7168, 2048, 256, 8, True),
}

DEFAULT_TOKENS = (1, 8, 512, 2048)
# Repetitions per token count unless --repeats is given: decode is fast and noisy,
# prefill is slow. A time budget per T (--budget) can cut them short (minimum 3).
DEFAULT_REPEATS = {1: 50, 8: 20}
DEFAULT_REPEATS_LARGE = 5  # any T > 8

# design.md's figures for the development machine (AMD Zen 4, 2 threads), for reference only.
DESIGN_FP32_PEAK_GFLOPS = 230.0
DESIGN_DRAM_READ_GBS = 32.0

BW_BYTES = 1 << 30  # 1 GiB, well over the 32 MiB L3
PEAK_MNK = 512


# --------------------------------------------------------------------------- reference


class TorchEagerExperts:
    """The transformers eager expert loop (Qwen3MoeExperts.forward, transformers 5.x)."""

    def __init__(self, gate_up_proj: torch.Tensor, down_proj: torch.Tensor):
        self.gate_up_proj = gate_up_proj  # [E, 2I, H]
        self.down_proj = down_proj  # [E, H, I]
        self.num_experts = gate_up_proj.shape[0]

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        in_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(self.gate_up_proj.dtype)  # no-op for bf16 weights
        final_hidden_states = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts + 1)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[token_idx]
            gate, up = F.linear(current_state, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            current = F.silu(gate) * up
            current = F.linear(current, self.down_proj[expert_idx])
            current = current * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
        return final_hidden_states.to(in_dtype)


# --------------------------------------------------------------------------- inputs


def make_weights(shape: Shape, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded bf16 weights in the transformers layout: gate_up [E, 2I, H], down [E, H, I]."""
    torch.manual_seed(seed)
    E, H, Im = shape.experts, shape.hidden, shape.intermediate
    gate_up = torch.empty(E, 2 * Im, H, dtype=torch.bfloat16).normal_(0.0, H**-0.5)
    down = torch.empty(E, H, Im, dtype=torch.bfloat16).normal_(0.0, Im**-0.5)
    return gate_up, down


def make_inputs(
    shape: Shape, tokens: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states and routing: random distinct top-k experts, weights from a softmax."""
    x = torch.randn(tokens, shape.hidden, generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, shape.experts, generator=gen)
    probs = torch.softmax(logits, dim=-1)
    weights, ids = torch.topk(probs, shape.top_k, dim=-1)  # distinct experts per token
    if shape.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return x, ids, weights.float()


# --------------------------------------------------------------------------- machine limits


def _time(fn: Callable[[], object]) -> float:
    """Seconds of one call of ``fn``.

    The benchmarks' timing loops run under one ``torch.no_grad()``, as
    ``GenerationMixin.generate`` runs a whole decode, and the systems' calls
    carry no grad-mode switch of their own: a per-call ``@torch.no_grad()``
    cost 40-60 us of a cold 0.8 ms T = 1 call (paired, Zen 4 VM), a cost a
    model's MoE layers never pay.
    """
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_read_bandwidth(samples: int = 9) -> list[float]:
    """GB/s of torch.sum over a 1 GiB fp32 tensor (read-only stream), one value per sample."""
    buf = torch.ones(BW_BYTES // 4, dtype=torch.float32)  # touched, so no page faults later
    buf.sum()
    out = [BW_BYTES / _time(buf.sum) / 1e9 for _ in range(samples)]
    del buf
    return out


def compute_peak(threads: int) -> tuple[float, str]:
    """(GFLOP/s, "bf16" or "fp32"): the faster of the bf16 and fp32 peaks at ``threads``."""
    import machine_peaks  # here: machine_peaks imports this file

    bf16 = machine_peaks.measure_bf16_peak()
    fp32 = machine_peaks.measure_fp32_peak(threads, samples=20)
    return (bf16, "bf16") if bf16 >= fp32 else (fp32, "fp32")


def measure_fma_peak(samples: int = 50) -> list[float]:
    """GFLOP/s of torch.mm on cache-resident fp32 512^3 matrices, one value per sample."""
    n = PEAK_MNK
    a, b = torch.randn(n, n), torch.randn(n, n)
    c = torch.empty(n, n)
    for _ in range(3):
        torch.mm(a, b, out=c)
    return [2 * n**3 / _time(lambda: torch.mm(a, b, out=c)) / 1e9 for _ in range(samples)]


# --------------------------------------------------------------------------- cold calls
# Shared by bench_formats.py and bench_peers.py: decode on cold weights, as serving sees it.

FLUSH_BYTES = 96 << 20  # 3x the 32 MiB L3 of the development machine
LEAD_EXPERTS = 8  # experts of the untimed lead call; timed routings never use them


@dataclass
class Call:
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    experts_hit: int


def cold_inputs(shape: Shape, tokens: int, n: int, seed: int) -> tuple[list[Call], Call]:
    """``n`` timed inputs on fresh routing that avoids the lead's experts, and the lead input.

    Routing: softmax of random logits, top-k (distinct experts per token),
    renormalized when the preset says so. The lead call (T = 1) uses the last
    ``top_k`` experts; at decode (``tokens * top_k < E``) the timed routings
    draw from the first ``E - LEAD_EXPERTS`` experts only, so that the lead
    leaves none of theirs in cache. Prefill routes over all experts (it reads
    every expert anyway, and is compute-bound).
    """
    gen = torch.Generator().manual_seed(seed + tokens)
    E, K, H = shape.experts, shape.top_k, shape.hidden
    pool = E - max(LEAD_EXPERTS, K)
    if tokens * K >= E or pool < K:  # prefill, or too few experts to keep the lead's apart
        pool = E
    calls = []
    for _ in range(n):
        x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
        probs = torch.softmax(torch.randn(tokens, pool, generator=gen), dim=-1)
        w, ids = torch.topk(probs, K, dim=-1)
        if shape.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        calls.append(Call(x, ids, w.float(), int(torch.unique(ids).numel())))
    x = torch.randn(1, H, generator=gen).to(torch.bfloat16)
    lead = Call(x, torch.arange(E - K, E).view(1, K), torch.full((1, K), 1.0 / K), K)
    return calls, lead


class Flusher:
    """Evicts the caches: one read of a buffer several times the L3.

    The read is itself a DRAM read-bandwidth sample taken right before the
    timed call (``__call__`` returns its GB/s): on a shared VM whose bandwidth
    drifts by 2x within minutes, a decode call's bytes/s over the read rate of
    its own flush is a steadier "% of bandwidth" than a ratio to a best sample
    taken minutes apart.
    """

    def __init__(self, nbytes: int = FLUSH_BYTES):
        self.buf = torch.ones(nbytes // 4, dtype=torch.float32)

    def __call__(self) -> float:
        return self.buf.nbytes / _time(self.buf.sum) / 1e9


def _tile(t: Optional[torch.Tensor], experts: int) -> Optional[torch.Tensor]:
    """A fresh ``[experts, ...]`` tensor holding copies of ``t``'s experts, cyclically.

    In huge pages, as the packed tensors of ``quantize_weights`` and the loaders are.
    """
    if t is None or t.shape[0] == experts:
        return t
    out = empty_huge_pages((experts, *t.shape[1:]), t.dtype)
    u = t.shape[0]
    for e in range(0, experts, u):
        out[e : e + u].copy_(t[: min(u, experts - e)])
    return out


# --------------------------------------------------------------------------- benchmark


@dataclass
class Samples:
    """Raw per-call measurements for one token count (same inputs for kt and torch)."""

    tokens: int
    experts_hit: list[int]  # distinct experts per call
    kt_s: list[float]
    torch_s: list[float]
    max_abs_diff: Optional[float]  # kt vs torch on the first warm-up input, sanity only


@dataclass
class Row:
    tokens: int
    repeats: int
    experts_hit: float  # median distinct experts per call
    weight_mb: float  # median weight bytes touched per call, MB
    gflop: float
    kt_ms: float
    torch_ms: Optional[float]
    speedup: Optional[float]  # torch_ms / kt_ms
    bound_by: str  # "memory", or the compute peak that binds: "bf16" or "fp32"
    kt_achieved: float  # GB/s (memory) or GFLOP/s (compute)
    kt_roofline_pct: float
    torch_achieved: Optional[float]
    torch_roofline_pct: Optional[float]
    max_abs_diff: Optional[float]


@torch.no_grad()  # once for the whole loop, as generate() runs a decode (see _time)
def bench_tokens(
    shape: Shape,
    tokens: int,
    kt_fn: Callable,
    ref_fn: Optional[Callable],
    repeats: int,
    warmup: int,
    budget_s: float,
    settle_s: float,
    seed: int,
) -> Samples:
    """Time kt and torch interleaved, on fresh routing per repetition."""

    def timed(fn: Callable, args: tuple, lead_args: tuple) -> float:
        # Let the other runtime's idle threads go to sleep first: libgomp's OpenMP
        # workers (torch) spin for a while after a parallel region and would take a
        # core from whichever kernel runs next (measured: +3.5 ms on kt at T=1).
        time.sleep(settle_s)
        # ...but an idle pause also halts the vCPUs, and waking them (and parked
        # threads) costs 0.2-0.5 ms on this VM, which a model's decode step (layers
        # back to back) never pays. So the timed call follows an untimed call of the
        # same side on other routing, as one MoE layer follows another in a model.
        fn(*lead_args)
        return _time(lambda: fn(*args))

    gen = torch.Generator().manual_seed(seed + tokens)
    inputs = [make_inputs(shape, tokens, gen) for _ in range(warmup + repeats)]
    lead = make_inputs(shape, tokens, gen)  # routing of the untimed call before each timed one

    max_diff = None
    for i in range(warmup):
        y_kt = kt_fn(*inputs[i])
        if ref_fn is not None:
            y_ref = ref_fn(*inputs[i])
            if i == 0:
                max_diff = (y_kt.float() - y_ref.float()).abs().max().item()

    s = Samples(tokens, [], [], [], max_diff)
    start = time.perf_counter()
    for r in range(repeats):
        args = inputs[warmup + r]
        # Alternate the order so that neither side always runs right after the other.
        if r % 2 == 0:
            s.kt_s.append(timed(kt_fn, args, lead))
            if ref_fn is not None:
                s.torch_s.append(timed(ref_fn, args, lead))
        else:
            if ref_fn is not None:
                s.torch_s.append(timed(ref_fn, args, lead))
            s.kt_s.append(timed(kt_fn, args, lead))
        s.experts_hit.append(int(torch.unique(args[1]).numel()))
        if r + 1 >= 3 and time.perf_counter() - start > budget_s:
            break
    return s


def summarize(
    shape: Shape, s: Samples, bw_gbs: float, peak_gflops: float, peak_kind: str = "bf16"
) -> Row:
    """Medians, speed-up and roofline fractions of one token count's samples."""
    H, Im, K = shape.hidden, shape.intermediate, shape.top_k
    per_expert_bytes = 3 * H * Im * 2  # gate, up, down in bf16
    flops = 2 * s.tokens * K * 3 * H * Im
    med_hit = statistics.median(s.experts_hit)
    import machine_peaks  # here: machine_peaks imports this file

    term = machine_peaks.roofline(med_hit * per_expert_bytes, flops, bw_gbs, peak_gflops)[1]
    bound_by = "memory" if term == "read" else peak_kind

    def achieved(times: list[float]) -> tuple[float, float]:
        # Per call: bytes (or FLOPs) over its time and its roofline bound over its time.
        rate, pct = [], []
        for hit, t in zip(s.experts_hit, times):
            nbytes = hit * per_expert_bytes
            rate.append((nbytes if bound_by == "memory" else flops) / t / 1e9)
            bound = machine_peaks.roofline(nbytes, flops, bw_gbs, peak_gflops)[0]
            pct.append(100 * bound / t)
        return statistics.median(rate), statistics.median(pct)

    kt_rate, kt_pct = achieved(s.kt_s)
    kt_ms = 1e3 * statistics.median(s.kt_s)
    torch_ms = torch_rate = torch_pct = speedup = None
    if s.torch_s:
        torch_rate, torch_pct = achieved(s.torch_s)
        torch_ms = 1e3 * statistics.median(s.torch_s)
        speedup = torch_ms / kt_ms
    return Row(
        tokens=s.tokens,
        repeats=len(s.kt_s),
        experts_hit=med_hit,
        weight_mb=med_hit * per_expert_bytes / 1e6,
        gflop=flops / 1e9,
        kt_ms=kt_ms,
        torch_ms=torch_ms,
        speedup=speedup,
        bound_by=bound_by,
        kt_achieved=kt_rate,
        kt_roofline_pct=kt_pct,
        torch_achieved=torch_rate,
        torch_roofline_pct=torch_pct,
        max_abs_diff=s.max_abs_diff,
    )


# --------------------------------------------------------------------------- report


def _fmt(v: Optional[float], spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def table(rows: list[Row], markdown: bool) -> str:
    head = [
        "T",
        "reps",
        "experts hit",
        "kt ms",
        "torch ms",
        "speed-up",
        "bound by",
        "kt achieved",
        "kt roofline",
        "torch roofline",
        "max abs diff",
    ]
    body = []
    for r in rows:
        unit = "GB/s" if r.bound_by == "memory" else "GFLOP/s"
        term = "read" if r.bound_by == "memory" else r.bound_by
        body.append(
            [
                str(r.tokens),
                str(r.repeats),
                f"{r.experts_hit:g}",
                f"{r.kt_ms:.2f}",
                _fmt(r.torch_ms, ".2f"),
                _fmt(r.speedup, ".1f") + ("x" if r.speedup is not None else ""),
                f"{term} ({r.weight_mb:.1f} MB, {r.gflop:.2f} GFLOP)",
                f"{r.kt_achieved:.1f} {unit}",
                f"{r.kt_roofline_pct:.0f}%",
                _fmt(r.torch_roofline_pct, ".1f") + ("%" if r.torch_roofline_pct else ""),
                _fmt(r.max_abs_diff, ".2g"),
            ]
        )
    return render_table(head, body, markdown)


def render_table(
    head: list[str], body: list[list[str]], markdown: bool, first_left: bool = False
) -> str:
    """A right-aligned text table, or a markdown table (``first_left``: first column left)."""
    if markdown:
        align = ["---" if first_left and i == 0 else "---:" for i in range(len(head))]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
        return "\n".join(lines + ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    return "\n".join(lines + ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body])


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3", help="layer shape")
    p.add_argument("--experts", type=int, help="override the preset's expert count (memory)")
    p.add_argument(
        "--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS), help="token counts T"
    )
    p.add_argument("--threads", type=int, help="kt_ops and torch threads (default: kt_ops')")
    p.add_argument("--isa", choices=kt_ops.supported_isas(), help="kt_ops ISA path")
    p.add_argument(
        "--compute-path",
        choices=("auto", "streaming", "brgemm"),
        help="kt_ops.set_compute_path (default: auto)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        help=f"timed runs per T (default {DEFAULT_REPEATS} else {DEFAULT_REPEATS_LARGE})",
    )
    p.add_argument(
        "--warmup", type=int, help="untimed runs per T first (default 2 for T <= 8, else 1)"
    )
    p.add_argument(
        "--budget", type=float, default=40.0, help="seconds per T after which repeats stop (>= 3)"
    )
    p.add_argument(
        "--settle-ms",
        type=float,
        default=20.0,
        help="idle pause before every timed call, so spinning OpenMP threads park (default 20)",
    )
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch eager reference")
    p.add_argument(
        "--torch-dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="weight dtype of the eager reference (fp32: the same bf16 values widened, "
        "activations cast in and out inside the timed call; 2x the memory)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", action="store_true", help="also print a markdown table")
    p.add_argument("--json", metavar="PATH", help="write header and rows as JSON")
    return p.parse_args(argv)


def _mem_available_gb() -> Optional[float]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    shape = PRESETS[args.preset]
    if args.experts:
        shape = shape.with_experts(args.experts)
    E, H, Im = shape.experts, shape.hidden, shape.intermediate
    threads = args.threads or kt_ops.get_num_threads()
    kt_ops.set_num_threads(threads)
    torch.set_num_threads(threads)
    if args.isa:
        kt_ops.set_isa(args.isa)
    if args.compute_path:
        kt_ops.set_compute_path(args.compute_path)

    dense_gb = 3 * E * H * Im * 2 / 1e9
    # torch's bf16 copy + the packed copy + one projection being packed (2 transients).
    torch_copies = 0 if args.no_torch else (1 if args.torch_dtype == "bf16" else 3)
    need_gb = dense_gb * (1 + torch_copies) + 2 * dense_gb / 3 + BW_BYTES / 1e9
    avail = _mem_available_gb()
    if avail is not None and need_gb > 0.9 * avail:
        print(
            f"error: {shape.model} needs ~{need_gb:.1f} GB, {avail:.1f} GB available; "
            "pass --experts N (and/or --no-torch)",
            file=sys.stderr,
        )
        return 2

    info = kt_ops.info()
    topo = info["topology"]
    header = {
        "model": shape.model,
        "shape": asdict(shape),
        "weight_format": "bf16",
        "dense_weights_gb": dense_gb,
        "threads": threads,
        "kt_isa": kt_ops.active_isa(),
        "kt_compute_path": kt_ops.get_compute_path(),
        "kt_supported_isas": info["supported_isas"],
        "cpu_features": [k for k, v in info["cpu_features"].items() if v],
        "cores": topo["num_cores"],
        "numa_nodes": topo["num_numa_nodes"],
        "cpu": _cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "torch_reference": None if args.no_torch else f"eager expert loop, {args.torch_dtype}",
    }

    t_setup = time.perf_counter()
    bw = measure_read_bandwidth()
    peak = [compute_peak(threads)]
    gate_up, down = make_weights(shape, args.seed)
    packed = kt_ops.ExpertWeights(
        quantize_weights(gate_up[:, :Im], "bf16"),
        quantize_weights(gate_up[:, Im:], "bf16"),
        quantize_weights(down, "bf16"),
    )
    ref_fn = None
    if args.no_torch:
        del gate_up, down  # kt only needs the packed copy
    else:
        if args.torch_dtype == "fp32":
            gate_up, down = gate_up.float(), down.float()
        ref_fn = TorchEagerExperts(gate_up, down)
    setup_s = time.perf_counter() - t_setup

    def kt_fn(x, ids, w):
        return kt_ops.moe_forward(x, ids, w, packed)

    bw_gbs = statistics.median(bw)
    peak_gflops, peak_kind = peak[0]
    print(f"# kt_ops MoE benchmark: {shape.model} layer, bf16 weights")
    print(
        f"#   H={H} I={Im} E={E} top-{shape.top_k} "
        f"({'normalized' if shape.norm_topk_prob else 'unnormalized'} top-k), "
        f"{dense_gb:.2f} GB of expert weights"
    )
    print(
        f"#   kt_ops {kt_ops.__version__}: isa={header['kt_isa']} "
        f"compute_path={header['kt_compute_path']} "
        f"(supported {header['kt_supported_isas']}), threads={threads}, "
        f"{header['cpu']}, {header['cores']} cores / {header['numa_nodes']} NUMA node(s), "
        f"features={header['cpu_features']}"
    )
    print(
        f"#   torch {torch.__version__} (threads={torch.get_num_threads()}), reference: "
        f"{'none' if args.no_torch else 'transformers eager expert loop, ' + args.torch_dtype}"
        f" weights; "
        f"python {header['python']}, setup {setup_s:.1f}s"
    )
    print(
        f"#   before the runs: read bandwidth (torch.sum, 1 GiB fp32) {bw_gbs:.1f} GB/s median "
        f"[{min(bw):.1f}..{max(bw):.1f}] (design.md dev machine: ~{DESIGN_DRAM_READ_GBS:.0f})"
    )
    print(
        f"#   before the runs: compute peak (best sample of torch.mm bf16 / fp32 "
        f"{PEAK_MNK}^3 and kt_ops' FMA chains) {peak_kind} {peak_gflops:.1f} GFLOP/s"
    )
    sys.stdout.flush()

    samples = []
    for T in args.tokens:
        reps = args.repeats or DEFAULT_REPEATS.get(T, DEFAULT_REPEATS_LARGE)
        t0 = time.perf_counter()
        warmup = args.warmup if args.warmup is not None else (2 if T <= 8 else 1)
        s = bench_tokens(
            shape, T, kt_fn, ref_fn, reps, warmup, args.budget, args.settle_ms / 1e3, args.seed
        )
        samples.append(s)
        torch_ms = f"{1e3 * statistics.median(s.torch_s):.2f}" if s.torch_s else "n/a"
        print(
            f"#   T={T}: kt {1e3 * statistics.median(s.kt_s):.2f} ms, torch {torch_ms} ms "
            f"({len(s.kt_s)} reps, {time.perf_counter() - t0:.0f}s)",
            flush=True,
        )

    # Measure the limits again after the runs (the host's load drifts) and use all samples.
    bw_after, peak_after = measure_read_bandwidth(), [compute_peak(threads)]
    bw_all, peak_all = bw + bw_after, peak + peak_after
    # A ceiling is the best the hardware did (STREAM's convention): load from other
    # processes only ever lowers a sample, and a median under load would put the
    # kernels above 100% of "peak".
    bw_final, (peak_final, peak_kind) = max(bw_all), max(peak_all)
    rows = [summarize(shape, s, bw_final, peak_final, peak_kind) for s in samples]
    print(
        f"#   after the runs: read bandwidth {statistics.median(bw_after):.1f} GB/s, "
        f"{peak_after[0][1]} peak {peak_after[0][0]:.1f} GFLOP/s; roofline uses the best "
        f"of all {len(bw_all)} + {len(peak_all)} samples: read {bw_final:.1f} GB/s, "
        f"{peak_kind} peak {peak_final:.1f} GFLOP/s"
    )
    print(
        "#   speed-up = torch ms / kt ms; roofline = max(weight bytes / bandwidth, "
        f"FLOPs / {peak_kind} peak) / time, the binding term in 'bound by'; medians over reps; "
        "before each timed call: "
        f"{args.settle_ms:g} ms idle, then one untimed call of the same side on other routing"
    )
    print(table(rows, markdown=False))
    if args.markdown:
        print()
        print(
            f"{shape.model} layer (H={H}, I={Im}, E={E}, top-{shape.top_k}), bf16, "
            f"{threads} threads, isa {header['kt_isa']}, torch {torch.__version__} eager "
            f"reference with {args.torch_dtype} weights; "
            f"read bandwidth {bw_final:.1f} GB/s, {peak_kind} peak {peak_final:.1f} GFLOP/s "
            "(best samples, measured in the same run)."
        )
        print()
        print(table(rows, markdown=True))
    if args.json:
        header.update(
            read_bandwidth_gbs=bw_final,
            read_bandwidth_samples=bw_all,
            compute_peak_gflops=peak_final,
            compute_peak_kind=peak_kind,
            compute_peak_samples=[list(p) for p in peak_all],
            design_fp32_peak_gflops=DESIGN_FP32_PEAK_GFLOPS,
            design_dram_read_gbs=DESIGN_DRAM_READ_GBS,
        )
        with open(args.json, "w") as f:
            json.dump({"header": header, "rows": [asdict(r) for r in rows]}, f, indent=2)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
