#!/usr/bin/env python
"""kt_ops side by side with kt-kernel 0.7.2 and the PyTorch eager expert loop, in one process.

For one Qwen3-30B-A3B MoE layer (H=2048, I=768, E=128, top-8) at T = 1, 8 and
512 tokens, this times, on the same seeded weights and the same inputs:

* **kt_ops** through its module API only (``kt_ops.nn.MoEExperts.from_dense``,
  then ``experts(x, ids, weights)``): ``bf16``, ``int8``, ``int4`` at group 128
  and 32 (symmetric) and ``q4_k``;
* **kt-kernel 0.7.2** (PyPI, ``scripts/setup_peers.sh``): the backend classes
  of ``kt_kernel_ext.moe`` that run on the CPU, driven the way its
  ``KTMoEWrapper`` drives them (``MOEConfig`` -> backend class ->
  ``load_weights_task``; per call ``forward_task`` + ``CPUInfer.submit`` /
  ``sync``), and also through the class's ``forward()`` in the calling thread,
  each with 1 and 2 pool workers (``WorkerPoolConfig``); a backend's row keeps
  the fastest of these per T. ``KT_BACKENDS`` says what each backend is fed;
* **torch**: the transformers eager expert loop (``bench_moe.TorchEagerExperts``)
  on bf16 weights.

Methodology (``bench_formats``'s): every timed call reads cold weights -- a
96 MiB read evicts the caches, a ``--settle-ms`` pause lets spinning threads
park, one untimed *lead* call of the same system on 8 fixed experts wakes its
threads (as one MoE layer follows another), then the timed call runs on fresh
routing that avoids the lead's experts (prefill routes over all experts). All
systems are interleaved within every repetition (the starting system rotates),
so host noise hits all of them; medians.

Columns: ``ms`` (median), ``vs kt-kernel`` = the matching kt-kernel row's ms /
this row's ms (same quantization scheme where kt-kernel has one), ``rel err`` =
||y - y_ref|| / ||y_ref|| on the first (warm-up) input of each T, with
``y_ref`` the fp32 computation on the **unquantized** weights (so quantized
formats include their quantization error, and kt-kernel's int8-activation
paths their activation rounding), and ``roofline``: at every T the larger of
the bytes of the experts hit (distinct experts x bytes per expert, scales
included) over the read bandwidth and the FLOPs over the bf16 peak (bf16
formats) or the int8 peak (integer formats), divided by the time, with the
binding term named (``BW``, ``bf16`` or ``int8``). The
limits come from ``machine_peaks`` at the benchmark's thread count, measured
before, between and after the runs in the same process (best samples).
``vs adjacent read`` (decode only): the median over the timed calls of the
call's bytes/s over the read rate of the cache flush (a 96 MiB ``torch.sum``)
done just before that call; it follows the VM's drifting bandwidth.

By default 16 distinct random experts are made and copied to fill all 128
(every expert still has its own memory, so the bytes streamed are the full
layer's); ``--unique-experts 128`` makes all of them distinct.

Usage::

    scripts/setup_peers.sh                                   # once: the venv with kt-kernel
    ~/.cache/kt_ops/peers-venv/bin/python benchmarks/bench_peers.py --markdown
    python benchmarks/bench_peers.py --quick                 # re-execs in the venv
    python benchmarks/bench_peers.py --no-kt-kernel          # kt_ops and torch only
    python benchmarks/bench_peers.py --isolate --markdown    # each side in its own process

Not part of the test suite (pytest only collects ``tests/``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import kt_ops
import kt_ops.nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine_peaks  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
from bench_moe import (  # noqa: E402
    PRESETS,
    Call,
    Flusher,
    Shape,
    TorchEagerExperts,
    _cpu_model,
    _mem_available_gb,
    _tile,
    _time,
    cold_inputs,
    make_weights,
    render_table,
)

VENV_ENV = "KT_OPS_PEERS_VENV"
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "kt_ops", "peers-venv")
_REEXEC_ENV = "KT_OPS_PEERS_REEXEC"

TOKENS = (1, 8, 512, 2048)
DEFAULT_REPEATS = {1: 31, 8: 21}
DEFAULT_REPEATS_LARGE = 5
QUICK_REPEATS = {1: 7, 8: 5}
QUICK_REPEATS_LARGE = 3


# --------------------------------------------------------------------------- systems


@dataclass(frozen=True)
class Family:
    """A quantization scheme: the rows of one family are compared with its kt-kernel row."""

    name: str
    compute: str  # "bf16" or "int8": which peak bounds prefill
    kt_kernel_peer: str  # KT_BACKENDS key of the kt-kernel row the others are compared with


FAMILIES = {
    "bf16": Family("bf16", "bf16", "BF16"),
    "int8": Family("int8", "int8", "AMXINT8"),
    "int4-g128": Family("int4-g128", "int8", "RAWINT4-g128"),
    "int4-g32": Family("int4-g32", "int8", "RAWINT4-g32"),
    "int4-pc": Family("int4 per channel", "int8", "AMXINT4"),
    "q4_k": Family("q4_k", "int8", "LLAMAFILE-Q4_K"),
}

#: kt_ops variants: label -> (family, weight_format, group_size).
KT_OPS_VARIANTS = {
    "bf16": ("bf16", "bf16", None),
    "int8": ("int8", "int8", None),
    "int4-g128": ("int4-g128", "int4", 128),
    "int4-g32": ("int4-g32", "int4", 32),
    # group_size 0: one scale per output channel, like kt-kernel's AMXINT4.
    "int4-pc": ("int4-pc", "int4", 0),
    "q4_k": ("q4_k", "q4_k", None),
}


@dataclass(frozen=True)
class KtBackend:
    """One kt-kernel backend: the ``kt_kernel_ext.moe`` class and how its weights are made."""

    family: str
    cls: str
    load: str  # "bf16" pointers, "online" (kt-kernel quantizes), "rawint4", "gguf"
    what: str  # the format / kernel, for the report
    group_size: int = 0
    bits_per_weight: float = 16.0  # nominal, scales included (for the roofline)


def _rawint4_bits(g: int) -> float:
    return 4 + 16 / g  # int4 codes + one bf16 scale per group


KT_BACKENDS = {
    # method BF16: AMXBF16_MOE, which prints "backend=AVX512-BF16" on a CPU without AMX.
    "BF16": KtBackend("bf16", "AMXBF16_MOE", "bf16", "bf16, AVX512-BF16 kernel"),
    # method AMXINT8: online per-channel int8 from bf16, int8 activations (AVX512-VNNI).
    "AMXINT8": KtBackend(
        "int8", "AMXInt8_MOE", "online", "int8 per channel (online), VNNI", bits_per_weight=8
    ),
    # method AMXINT4: online per-channel int4 from bf16 (no groups), int8 activations.
    "AMXINT4": KtBackend(
        "int4-pc", "AMXInt4_MOE", "online", "int4 per channel (online), VNNI", bits_per_weight=4
    ),
    # method RAWINT4 (compressed-tensors int4, bf16 group scales). Its selector picks
    # AMXInt4_KGroup_MOE, which returns NaN at group 128 on this AVX-512 CPU (fine at 32);
    # KT_RAWINT4_BACKEND=avx2 selects AVX2RawInt4_MOE, which is what runs group 128 here.
    "RAWINT4-g128": KtBackend(
        "int4-g128",
        "AVX2RawInt4_MOE",
        "rawint4",
        "int4 g128 sym, AVX2 RAWINT4 kernel",
        128,
        _rawint4_bits(128),
    ),
    "RAWINT4-g32": KtBackend(
        "int4-g32",
        "AMXInt4_KGroup_MOE",
        "rawint4",
        "int4 g32 sym, AVX-512 k-group kernel",
        32,
        _rawint4_bits(32),
    ),
    # Not run by default: AMXInt4_KGroup_MOE at group 128 (NaN output on AVX-512 without AMX).
    "RAWINT4-g128-kgroup": KtBackend(
        "int4-g128",
        "AMXInt4_KGroup_MOE",
        "rawint4",
        "int4 g128 sym, AVX-512 k-group kernel",
        128,
        _rawint4_bits(128),
    ),
    # method LLAMAFILE: GGUF Q4_K blocks (kt_ops.formats.quantize_gguf_raw, the bytes
    # kt_ops' q4_k is repacked from), bf16 activations quantized to Q8_K by llamafile.
    "LLAMAFILE-Q4_K": KtBackend(
        "q4_k", "MOE", "gguf", "GGUF Q4_K, llamafile kernel", 256, 8 * 144 / 256
    ),
}
DEFAULT_KT_BACKENDS = (
    "BF16",
    "AMXINT8",
    "AMXINT4",
    "RAWINT4-g128",
    "RAWINT4-g32",
    "LLAMAFILE-Q4_K",
)


@dataclass
class System:
    """One timed configuration."""

    label: str  # unique, e.g. "kt-kernel RAWINT4-g128 w1"
    kind: str  # "kt_ops", "kt-kernel", "torch"
    family: str
    what: str
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    bytes_per_expert: float
    workers: Optional[int] = None  # kt-kernel pool workers
    call: Optional[str] = None  # kt-kernel: "submit" (task queue) or "direct" (forward())
    backend: Optional[str] = None  # KT_BACKENDS key
    keep: list = field(default_factory=list)  # tensors the C++ side points at


class KtKernelPool:
    """A kt-kernel ``CPUInfer`` with one NUMA subpool of ``workers`` threads."""

    def __init__(self, ext, workers: int):
        cfg = ext.WorkerPoolConfig()
        cfg.subpool_count = 1
        cfg.subpool_numa_map = [0]
        cfg.subpool_thread_count = [workers]
        self.workers = workers
        self.cpu_infer = ext.CPUInfer(cfg)


class KtKernelExperts:
    """One kt-kernel backend class, fed and called the way ``KTMoEWrapper`` does it.

    ``gate``/``up`` are bf16 ``[E, I, H]`` and ``down`` ``[E, H, I]``; ``unique``
    leading experts are distinct and the rest copies (for the formats quantized
    here, only the distinct ones are quantized and the bytes copied).
    """

    def __init__(
        self,
        name: str,
        pool: KtKernelPool,
        shape: Shape,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        unique: int,
        max_tokens: int = 512,
    ):
        import kt_kernel_ext.moe as moe_mod
        from kt_kernel_ext.moe import MOEConfig

        spec = KT_BACKENDS[name]
        E, K, H, Im = shape.experts, shape.top_k, shape.hidden, shape.intermediate
        self.name, self.spec, self.pool = name, spec, pool
        self.hidden, self.top_k = H, K
        self.mask = torch.zeros(E, dtype=torch.bool)  # no expert on a GPU
        self.p2l = torch.arange(E, dtype=torch.int64)  # physical -> logical expert ids
        self.keep: list = []
        tmp = None
        cfg = MOEConfig(E, K, H, Im, self.mask.data_ptr())
        cfg.layer_idx = 0
        cfg.pool = pool.cpu_infer.backend_
        # chunked_prefill_size: the largest T of a call; kt-kernel segfaults past it.
        cfg.max_len = max(512, max_tokens)
        if spec.load == "bf16":
            projs = [t.contiguous() for t in (gate, up, down)]
            self.keep += projs
            cfg.gate_projs, cfg.up_projs, cfg.down_projs = (
                [[p[e].data_ptr() for e in range(E)]] for p in projs
            )
            zero = [[0] * E]
            cfg.gate_scales, cfg.up_scales, cfg.down_scales = zero, zero, zero
        elif spec.load == "online":
            # KTMoEWrapper.load_weights_from_tensors: quantize bf16 in C++ ("save" mode,
            # which also writes the quantized layer under cfg.path; a temporary folder).
            projs = [t.contiguous() for t in (gate, up, down)]
            self.keep += projs
            tmp = tempfile.TemporaryDirectory(prefix="kt_kernel_")
            cfg.save, cfg.load = True, False
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = (p.data_ptr() for p in projs)
            cfg.path = tmp.name
        elif spec.load == "rawint4":
            qs = [quantize_rawint4(t[:unique], spec.group_size, E) for t in (gate, up, down)]
            self.keep += qs
            cfg.gate_projs, cfg.up_projs, cfg.down_projs = (
                [[q[0][e].data_ptr() for e in range(E)]] for q in qs
            )
            cfg.gate_scales, cfg.up_scales, cfg.down_scales = (
                [[q[1][e].data_ptr() for e in range(E)]] for q in qs
            )
            cfg.quant_config.bits = 4
            cfg.quant_config.group_size = spec.group_size
            cfg.quant_config.zero_point = False
        elif spec.load == "gguf":
            from kt_kernel_ext.kvcache import ggml_type

            from kt_ops.formats import quantize_gguf_raw

            qs = []
            for t in (gate, up, down):
                raw = quantize_gguf_raw(t[:unique].float().numpy(), "q4_k")
                qs.append(_tile(torch.from_numpy(raw), E).contiguous())
            self.keep += qs
            cfg.m_block = 32
            cfg.group_min_len = 10
            cfg.group_max_len = max(512, max_tokens)
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = (q.data_ptr() for q in qs)
            cfg.gate_type = cfg.up_type = cfg.down_type = ggml_type.Q4_K
            cfg.hidden_type = ggml_type.BF16
        else:
            raise ValueError(spec.load)
        self.moe = getattr(moe_mod, spec.cls)(cfg)
        ci = pool.cpu_infer
        ci.submit(self.moe.load_weights_task(self.p2l.data_ptr()))
        ci.sync()
        if tmp is not None:
            tmp.cleanup()
        if spec.load == "online":
            self.keep.clear()  # quantized copies live in the C++ object

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, direct: bool = False
    ) -> torch.Tensor:
        """``direct``: the class's ``forward()`` in this thread instead of the task queue."""
        T = x.shape[0]
        x = x.to(torch.bfloat16).contiguous()
        ids = ids.to(torch.int64).contiguous()
        w = w.to(torch.float32).contiguous()
        out = torch.empty(T, self.hidden, dtype=torch.bfloat16)
        bsz = torch.tensor([T], dtype=torch.int32)
        args = (
            bsz.data_ptr(),
            self.top_k,
            ids.data_ptr(),
            w.data_ptr(),
            x.data_ptr(),
            out.data_ptr(),
            False,  # incremental (deferred experts): off
        )
        if direct:
            self.moe.forward(*args)
        else:
            self.pool.cpu_infer.submit(self.moe.forward_task(*args))
            self.pool.cpu_infer.sync()
        return out


def quantize_rawint4(
    w: torch.Tensor, group: int, experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """RAWINT4 (compressed-tensors pack-quantized) bytes of ``w [U, N, K]``, tiled to ``experts``.

    Symmetric round-to-nearest, scale = absmax / 7 per group of ``group`` along K
    (bf16, ``[E, N, K / group]``); codes q in [-8, 7] stored as q + 8, two per
    byte, the even element in the low nibble (``[E, N, K / 2]`` uint8), as
    ``CompressedSafeTensorLoader`` hands them to the kernels.
    """
    U, N, K = w.shape
    g = w.float().view(U, N, K // group, group)
    s = (g.abs().amax(-1, keepdim=True) / 7.0).to(torch.bfloat16).float()
    q = torch.round(g / s.clamp_min(1e-30)).clamp(-8, 7).to(torch.int16).view(U, N, K)
    u = (q + 8).to(torch.uint8)
    packed = (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()
    scales = s.view(U, N, K // group).to(torch.bfloat16)
    return _tile(packed, experts).contiguous(), _tile(scales, experts).contiguous()


def build_kt_ops(
    label: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, unique: int
) -> System:
    """``MoEExperts.from_dense`` on the distinct experts, its buffers copied to fill all E."""
    family, fmt, group = KT_OPS_VARIANTS[label]
    E = gate.shape[0]
    m = kt_ops.nn.MoEExperts.from_dense(
        gate[:unique], up[:unique], down[:unique], fmt, group_size=group
    )
    if unique < E:
        for name, buf in list(m.named_buffers(recurse=False)):
            if buf is not None and buf.dim() > 0 and buf.shape[0] == unique:
                setattr(m, name, _tile(buf, E))
        m.num_experts = E
    m.eval()
    nbytes = sum(b.nbytes for b in m.buffers())
    what = fmt if group is None else f"{fmt} per channel" if group == 0 else f"{fmt} g{group} sym"

    return System(f"kt_ops {label}", "kt_ops", family, what, m, nbytes / E, keep=[m])


# --------------------------------------------------------------------------- reference


@torch.no_grad()
def reference_fp32(
    gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
) -> torch.Tensor:
    """The layer in fp32 on the unquantized (bf16) weights: the error reference."""
    xf = x.float()
    out = torch.zeros_like(xf)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        gate, up = (xf[tok] @ gate_up[e].float().t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ down[e].float().t()
        out.index_add_(0, tok, y * w[tok, slot].float()[:, None])
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


# --------------------------------------------------------------------------- timing


@dataclass
class Samples:
    label: str
    tokens: int
    seconds: list[float] = field(default_factory=list)
    experts_hit: list[int] = field(default_factory=list)
    read_gbs: list[float] = field(default_factory=list)  # the flush read right before each call
    rel_err: Optional[float] = None


@torch.no_grad()  # once for the whole loop, as generate() runs a decode (bench_moe._time)
def run_tokens(
    systems: list[System],
    calls: list[Call],
    lead: Call,
    ref: torch.Tensor,
    warmup: int,
    budget_s: float,
    settle_s: float,
    flush: Flusher,
) -> dict[str, Samples]:
    """All systems interleaved on the same calls; the starting system rotates per repetition."""
    T = calls[0].x.shape[0]
    out = {s.label: Samples(s.label, T) for s in systems}
    for s in systems:
        for i in range(warmup):
            c = calls[i]
            y = s.fn(c.x, c.ids, c.weights)
            if i == 0:
                out[s.label].rel_err = rel_err(y, ref)

    def timed(s: System, c: Call) -> tuple[float, float]:
        gbs = flush()  # nothing of the layer stays in cache, as between decode steps
        time.sleep(settle_s)  # threads that spin after a parallel region park
        s.fn(lead.x, lead.ids, lead.weights)  # this system's threads are awake
        return _time(lambda: s.fn(c.x, c.ids, c.weights)), gbs

    start = time.perf_counter()
    n = len(systems)
    for r, c in enumerate(calls[warmup:]):
        for j in range(n):
            s = systems[(r + j) % n]
            smp = out[s.label]
            seconds, gbs = timed(s, c)
            smp.seconds.append(seconds)
            smp.read_gbs.append(gbs)
            smp.experts_hit.append(c.experts_hit)
        if r + 1 >= 3 and time.perf_counter() - start > budget_s:
            break
    return out


# --------------------------------------------------------------------------- summary


@dataclass
class Row:
    label: str
    kind: str
    family: str
    what: str
    workers: Optional[int]
    call: Optional[str]
    tokens: int
    repeats: int
    ms: float
    vs_kt_kernel: Optional[float]  # peer kt-kernel ms / ms
    rel_err: Optional[float]
    mb_per_call: float
    bound: str  # "BW" or "bf16" / "int8" peak
    roofline_pct: float
    achieved: float  # GB/s at decode, GFLOP/s at prefill
    adjacent_pct: Optional[float] = (
        None  # decode: median of bytes/s over the flush read just before
    )


def summarize(
    shape: Shape,
    systems: list[System],
    samples: dict[str, Samples],
    peaks: machine_peaks.Peaks,
) -> list[Row]:
    """Rows of one T; kt-kernel's rows keep the fastest (workers, call) of each backend."""
    T = next(iter(samples.values())).tokens
    flops = 2 * T * shape.top_k * 3 * shape.hidden * shape.intermediate
    decode = T * shape.top_k < shape.experts
    med = {k: statistics.median(v.seconds) for k, v in samples.items() if v.seconds}

    best_kt: dict[str, System] = {}  # backend -> fastest System
    for s in systems:
        if s.kind == "kt-kernel" and s.label in med:
            b = best_kt.get(s.backend)
            if b is None or med[s.label] < med[b.label]:
                best_kt[s.backend] = s

    rows = []
    for s in systems:
        if s.label not in med:
            continue
        if s.kind == "kt-kernel" and best_kt[s.backend] is not s:
            continue
        smp = samples[s.label]
        t = med[s.label]
        nbytes = [hit * s.bytes_per_expert for hit in smp.experts_hit]
        # Every T: max(weight bytes / read, FLOPs / peak) per call, the binding term named
        # (at T = 512 a bf16 layer can still be bound by its bytes on a fast-compute CPU).
        compute = FAMILIES[s.family].compute
        peak = peaks.bf16_gflops if compute == "bf16" else peaks.int8_gops
        if compute == "bf16" and peaks.fp32_gflops > peak:
            # kt_ops computes bf16 as fp32 FMAs where the CPU's bf16 dot products are the
            # slower (AVX2; Intel without AMX, brgemm class avx512_intel): that ceiling.
            compute, peak = "fp32", peaks.fp32_gflops
        bounds = [machine_peaks.roofline(b, flops, peaks.read_gbs, peak) for b in nbytes]
        pct = statistics.median(100 * sec / x for (sec, _), x in zip(bounds, smp.seconds))
        term = machine_peaks.roofline(statistics.median(nbytes), flops, peaks.read_gbs, peak)[1]
        bound = "BW" if term == "read" else compute
        if term == "read":
            achieved = statistics.median(b / x / 1e9 for b, x in zip(nbytes, smp.seconds))
        else:
            achieved = flops / t / 1e9
        adjacent = None
        if decode:
            adjacent = statistics.median(
                100 * b / x / 1e9 / g for b, x, g in zip(nbytes, smp.seconds, smp.read_gbs)
            )
        peer = best_kt.get(FAMILIES[s.family].kt_kernel_peer)
        vs = med[peer.label] / t if peer is not None else None
        rows.append(
            Row(
                label=s.label if s.kind != "kt-kernel" else f"kt-kernel {s.backend}",
                kind=s.kind,
                family=s.family,
                what=s.what,
                workers=s.workers,
                call=s.call,
                tokens=T,
                repeats=len(smp.seconds),
                ms=1e3 * t,
                vs_kt_kernel=vs,
                rel_err=smp.rel_err,
                mb_per_call=statistics.median(nbytes) / 1e6,
                bound=bound,
                roofline_pct=pct,
                achieved=achieved,
                adjacent_pct=adjacent,
            )
        )
    order = list(FAMILIES)
    kinds = ["kt_ops", "kt-kernel", "torch"]
    rows.sort(key=lambda r: (order.index(r.family), kinds.index(r.kind)))
    return rows


def table(rows: list[Row], markdown: bool) -> str:
    head = ["system", "format", "T", "ms", "vs kt-kernel", "rel err", "MB/call", "roofline"]
    head.append("vs adjacent read")
    body = []
    for r in rows:
        name = r.label + (f" ({r.workers}w, {r.call})" if r.workers else "")
        unit = "GB/s" if r.bound == "BW" else "GFLOP/s"
        roof = f"{r.roofline_pct:.0f}% {r.bound} ({r.achieved:.1f} {unit})"
        body.append(
            [
                name,
                r.what,
                str(r.tokens),
                f"{r.ms:.2f}",
                "-" if r.vs_kt_kernel is None else f"{r.vs_kt_kernel:.2f}x",
                "-" if r.rel_err is None else f"{r.rel_err:.3g}",
                f"{r.mb_per_call:.1f}",
                roof,
                "-" if r.adjacent_pct is None else f"{r.adjacent_pct:.0f}%",
            ]
        )
    return render_table(head, body, markdown, first_left=True)


# --------------------------------------------------------------------------- main


def _import_kt_kernel(argv: list[str], required: bool):
    """kt_kernel, re-executing this script with the peers venv's python when needed."""
    try:
        import kt_kernel  # noqa: F401
        import kt_kernel_ext

        return kt_kernel, kt_kernel_ext
    except ImportError as err:
        venv_py = os.path.join(os.environ.get(VENV_ENV, DEFAULT_VENV), "bin", "python")
        if os.path.exists(venv_py) and not os.environ.get(_REEXEC_ENV):
            os.environ[_REEXEC_ENV] = "1"
            sys.stdout.flush()
            os.execv(venv_py, [venv_py, os.path.abspath(__file__), *argv])
        if required:
            raise SystemExit(
                f"error: kt_kernel is not importable ({err}); run scripts/setup_peers.sh "
                f"(venv: ${VENV_ENV}, default {DEFAULT_VENV}) or pass --no-kt-kernel"
            ) from None
        return None, None


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3", help="layer shape")
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS), help="token counts")
    p.add_argument(
        "--kt-ops",
        nargs="*",
        default=list(KT_OPS_VARIANTS),
        choices=list(KT_OPS_VARIANTS),
        help="kt_ops variants (none: kt-kernel and/or torch only)",
    )
    p.add_argument(
        "--kt-backends",
        nargs="+",
        default=list(DEFAULT_KT_BACKENDS),
        choices=list(KT_BACKENDS),
        help="kt-kernel backends",
    )
    p.add_argument(
        "--kt-workers", type=int, nargs="+", default=[1, 2], help="kt-kernel pool workers to try"
    )
    p.add_argument(
        "--kt-call",
        nargs="+",
        choices=("submit", "direct"),
        default=["submit", "direct"],
        help="kt-kernel calls to try: CPUInfer.submit(forward_task) + sync (KTMoEWrapper's "
        "path) and/or the backend's forward() in the calling thread (default: both)",
    )
    p.add_argument("--no-kt-kernel", action="store_true", help="kt_ops and torch only")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch eager loop")
    p.add_argument("--threads", type=int, help="kt_ops and torch threads (default: kt_ops')")
    p.add_argument("--unique-experts", type=int, default=16, help="distinct experts (default 16)")
    p.add_argument("--repeats", type=int, help="timed calls per system and T")
    p.add_argument("--budget", type=float, default=150.0, help="seconds per T, then stop (>= 3)")
    p.add_argument("--settle-ms", type=float, default=20.0, help="pause before every lead call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="few repetitions (development run)")
    p.add_argument("--markdown", action="store_true", help="also print a markdown table")
    p.add_argument("--json", metavar="PATH", help="write header, rows and raw samples as JSON")
    p.add_argument(
        "--isolate",
        action="store_true",
        help="time kt_ops (+ torch) and kt-kernel each in their own process, one after the "
        "other, and merge the tables (nothing of one system's threads or memory in the "
        "other's process; interleaving then holds within each process only)",
    )
    return p.parse_args(argv)


def run_isolated(argv: list[str], args: argparse.Namespace) -> int:
    """``--isolate``: this script once for kt_ops + torch and once for kt-kernel, merged.

    Same seed, shape and inputs in both processes; each measures its own
    limits (so each row's roofline is against its own process's samples).
    ``vs kt-kernel`` is recomputed across the two.
    """
    import subprocess
    import tempfile

    drop = {"--isolate", "--markdown"}
    base, skip = [], False
    for a in argv:  # the other options, without --isolate / --markdown / --json PATH
        if skip:
            skip = False
        elif a == "--json":
            skip = True
        elif a.startswith("--json="):
            pass
        elif a not in drop:
            base.append(a)
    groups = [["--no-kt-kernel"]]
    if not args.no_kt_kernel:
        groups.append(["--kt-ops", "--no-torch"])  # --kt-ops with no variants: none
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, extra in enumerate(groups):
            out = os.path.join(tmp, f"group{i}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *base, *extra, "--json", out]
            print(f"# isolated run {i + 1}/{len(groups)}: {' '.join(extra)}", flush=True)
            rc = subprocess.call(cmd)
            if rc != 0:
                return rc
            with open(out) as f:
                rows += [Row(**r) for r in json.load(f)["rows"]]
    kt_ms = {(r.tokens, r.label): r.ms for r in rows if r.kind == "kt-kernel"}
    for r in rows:
        peer = kt_ms.get((r.tokens, f"kt-kernel {FAMILIES[r.family].kt_kernel_peer}"))
        r.vs_kt_kernel = None if peer is None else peer / r.ms
    order, kinds = list(FAMILIES), ["kt_ops", "kt-kernel", "torch"]
    rows.sort(key=lambda r: (r.tokens, order.index(r.family), kinds.index(r.kind)))
    print("# merged (each group timed in its own process; vs kt-kernel across the two)")
    print(table(rows, markdown=False))
    if args.markdown:
        print()
        print(table(rows, markdown=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isolated": True, "rows": [asdict(r) for r in rows]}, f)
        print(f"# wrote {args.json}")
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.isolate:
        return run_isolated(argv, args)
    kt_kernel, kt_ext = (None, None)
    if not args.no_kt_kernel:
        kt_kernel, kt_ext = _import_kt_kernel(argv, required=True)
    shape = PRESETS[args.preset]
    E, H, Im = shape.experts, shape.hidden, shape.intermediate
    unique = max(1, min(args.unique_experts, E))
    threads = args.threads or kt_ops.get_num_threads()
    kt_ops.set_num_threads(threads)
    torch.set_num_threads(threads)

    bf16_gb = 3 * E * H * Im * 2 / 1e9
    n_kt = 0 if args.no_kt_kernel else len(args.kt_workers)
    need_gb = bf16_gb * (2 + 0.6 * len(args.kt_ops) + 0.6 * n_kt * len(args.kt_backends)) + 1.5
    avail = _mem_available_gb()
    if avail is not None and need_gb > 0.9 * avail:
        print(f"error: needs ~{need_gb:.1f} GB, {avail:.1f} GB available", file=sys.stderr)
        return 2

    info = kt_ops.info()
    so = getattr(getattr(kt_ops, "_C", None), "__file__", None)
    built = time.strftime("%Y-%m-%d %H:%M", time.localtime(os.path.getmtime(so))) if so else "?"
    print(f"# kt_ops vs kt-kernel vs torch eager: {shape.model} layer")
    print(f"#   kt_ops from {os.path.dirname(kt_ops.__file__)}, extension {so} built {built}")
    print(
        f"#   H={H} I={Im} E={E} top-{shape.top_k}; {unique} distinct random experts copied to "
        f"fill {E}; {_cpu_model()}, {info['topology']['num_cores']} cores, features "
        f"{[k for k, v in info['cpu_features'].items() if v]}"
    )
    print(
        f"#   kt_ops {kt_ops.__version__} isa={info['active_isa']} threads={threads}; "
        f"torch {torch.__version__} threads={torch.get_num_threads()}; kt-kernel "
        + (
            "not run"
            if kt_kernel is None
            else f"{kt_kernel.__version__} variant={kt_kernel.__cpu_variant__} "
            f"int8={kt_kernel.__int8_kernel__} workers={args.kt_workers} call={args.kt_call}"
        ),
        flush=True,
    )
    peaks = machine_peaks.measure(threads)
    print(f"#   before the runs: {machine_peaks.describe(peaks)}", flush=True)

    t0 = time.perf_counter()
    gate_up, down = make_weights(
        Shape(shape.model, H, Im, unique, shape.top_k, shape.norm_topk_prob), args.seed
    )
    gate_up, down = _tile(gate_up, E).contiguous(), _tile(down, E).contiguous()
    gate, up = gate_up[:, :Im], gate_up[:, Im:]

    systems: list[System] = []
    for label in args.kt_ops:
        t1 = time.perf_counter()
        systems.append(build_kt_ops(label, gate, up, down, unique))
        print(f"#   built kt_ops {label} in {time.perf_counter() - t1:.1f}s", flush=True)
    failed: dict[str, str] = {}
    if kt_kernel is not None:
        gate_c, up_c = gate.contiguous(), up.contiguous()
        max_t = max(args.tokens)
        for workers in args.kt_workers:
            pool = KtKernelPool(kt_ext, workers)
            for name in args.kt_backends:
                spec = KT_BACKENDS[name]
                t1 = time.perf_counter()
                try:
                    m = KtKernelExperts(name, pool, shape, gate_c, up_c, down, unique, max_t)
                except Exception as err:  # a backend this build / CPU does not run
                    failed[name] = f"{type(err).__name__}: {err}"
                    print(f"#   kt-kernel {name}: FAILED {failed[name]}", flush=True)
                    continue
                bpe = spec.bits_per_weight / 8 * 3 * H * Im
                if spec.load == "online":  # + one fp32 scale per output row
                    bpe += 4 * (2 * Im + H)
                for call in args.kt_call:
                    systems.append(
                        System(
                            f"kt-kernel {name} w{workers} {call}",
                            "kt-kernel",
                            spec.family,
                            spec.what,
                            functools.partial(m, direct=call == "direct"),
                            bpe,
                            workers=workers,
                            backend=name,
                            call=call,
                            keep=[pool, m],
                        )
                    )
                print(
                    f"#   built kt-kernel {name} ({spec.cls}), {workers} worker(s) in "
                    f"{time.perf_counter() - t1:.1f}s",
                    flush=True,
                )
        del gate_c, up_c
    if not args.no_torch:
        eager = TorchEagerExperts(gate_up, down)
        systems.append(
            System("torch eager", "torch", "bf16", "bf16, eager loop", eager, 3 * H * Im * 2)
        )
    gc.collect()
    print(f"#   setup {time.perf_counter() - t0:.0f}s; {len(systems)} systems", flush=True)

    flush = Flusher()
    settle = args.settle_ms / 1e3
    per_tokens: dict[int, dict[str, Samples]] = {}
    for T in args.tokens:
        if args.repeats:
            reps = args.repeats
        elif args.quick:
            reps = QUICK_REPEATS.get(T, QUICK_REPEATS_LARGE)
        else:
            reps = DEFAULT_REPEATS.get(T, DEFAULT_REPEATS_LARGE)
        warmup = 2 if T <= 8 else 1
        calls, lead = cold_inputs(shape, T, warmup + reps, args.seed)
        c0 = calls[0]
        ref = reference_fp32(gate_up, down, c0.x, c0.ids, c0.weights)
        t1 = time.perf_counter()
        samples = run_tokens(systems, calls, lead, ref, warmup, args.budget, settle, flush)
        per_tokens[T] = samples
        peaks = peaks.merge(machine_peaks.measure(threads))  # sampled between the T's too
        line = " ".join(
            f"{k}={1e3 * statistics.median(v.seconds):.2f}" for k, v in samples.items() if v.seconds
        )
        print(f"#   T={T} ({time.perf_counter() - t1:.0f}s) ms: {line}", flush=True)

    after = machine_peaks.measure(threads)
    best = peaks.merge(after)
    print(f"#   after the runs: {machine_peaks.describe(after)}")
    print(
        f"#   limits used (best samples, before / between / after): {machine_peaks.describe(best)}"
    )
    rows = [r for T in args.tokens for r in summarize(shape, systems, per_tokens[T], best)]
    if failed:
        print(f"#   kt-kernel backends that failed: {failed}")
    nan = [r.label for r in rows if r.rel_err is not None and r.rel_err != r.rel_err]
    if nan:
        print(f"#   NaN outputs: {sorted(set(nan))}")
    print(
        "#   vs kt-kernel = ms of the family's kt-kernel row / ms; kt-kernel rows: the fastest "
        "(workers, call) per backend and T; rel err vs fp32 on the unquantized weights"
    )
    print(table(rows, markdown=False))
    if args.markdown:
        print()
        print(
            f"{shape.model} layer (H={H}, I={Im}, E={E}, top-{shape.top_k}), {_cpu_model()}, "
            f"{threads} threads (kt-kernel: the fastest of {args.kt_workers} workers x "
            f"{args.kt_call} calls per backend and T); "
            f"{machine_peaks.describe(best)} (best samples, same run)."
        )
        print()
        print(table(rows, markdown=True))
    if args.json:
        header = {
            "model": shape.model,
            "shape": asdict(shape),
            "unique_experts": unique,
            "threads": threads,
            "cpu": _cpu_model(),
            "kt_ops_isa": info["active_isa"],
            "kt_ops_path": os.path.dirname(kt_ops.__file__),
            "kt_ops_extension_built": built,
            "torch": torch.__version__,
            "kt_kernel": None if kt_kernel is None else kt_kernel.__version__,
            "kt_kernel_variant": None if kt_kernel is None else kt_kernel.__cpu_variant__,
            "kt_call": args.kt_call,
            "kt_workers": args.kt_workers,
            "failed": failed,
            "peaks_best": asdict(best),
            "peaks_after": asdict(after),
        }
        with open(args.json, "w") as f:
            raw = {T: [asdict(v) for v in smp.values()] for T, smp in per_tokens.items()}
            json.dump({"header": header, "rows": [asdict(r) for r in rows], "samples": raw}, f)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
