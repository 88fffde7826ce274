#!/usr/bin/env python
"""The machine's limits for the roofline columns: read bandwidth and bf16 / int8 / fp32 peaks.

Small and fast (~4 s per thread count); every figure is the **best** of many samples
(STREAM's convention: load from other processes only ever lowers a sample), at a
given thread count:

* **read bandwidth** -- ``torch.sum`` over a 1 GiB fp32 tensor (32x a 32 MiB L3),
  the read-only stream of ``bench_moe.measure_read_bandwidth``;
* **bf16 peak** -- ``torch.mm`` of cache-resident bf16 512^3 matrices: oneDNN's
  bf16 GEMM, ``vdpbf16ps`` on AVX512-BF16 (AMX tiles where present);
* **int8 peak** -- ``torch._int_mm`` of int8 512^3 matrices (int32 accumulation):
  oneDNN's u8s8/s8s8 GEMM, ``vpdpbusd`` on AVX512-VNNI; counted as 2 ops per
  multiply-add, like the FLOPs;
* **fp32 peak** -- the faster of ``torch.mm`` of fp32 512^3 matrices
  (``bench_moe.measure_fma_peak``) and independent 256-bit FMA chains on every
  kt_ops thread (``kt_ops._C._testing.fma_peak_gflops``): the BLAS behind torch.mm
  is MKL, whose sgemm on AMD CPUs runs far below their FMA units (Zen 3: 22-56
  against 94 GFLOP/s a core), while kt_ops' own fp32 tiles stream at up to ~90%
  of the FMA rate there.

Except the FMA loop, these are what oneDNN and MKL reach through torch, i.e. practical
peaks, not the data-sheet numbers. ``python benchmarks/machine_peaks.py [--threads 1 2]``
prints them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import (  # noqa: E402  (benchmarks/ is a folder of scripts, not a package)
    PEAK_MNK,
    _cpu_model,
    measure_fma_peak,
    measure_read_bandwidth,
    render_table,
)


@dataclass
class Peaks:
    """Best samples at one thread count: GB/s and GFLOP/s (GOP/s for int8)."""

    threads: int
    read_gbs: float
    bf16_gflops: float
    int8_gops: Optional[float]  # None: torch._int_mm is not available on the CPU
    fp32_gflops: float

    def merge(self, other: Peaks) -> Peaks:
        """The best of two measurements at the same thread count (before / after a run)."""

        def best(a: Optional[float], b: Optional[float]) -> Optional[float]:
            return b if a is None else a if b is None else max(a, b)

        return Peaks(
            self.threads,
            max(self.read_gbs, other.read_gbs),
            max(self.bf16_gflops, other.bf16_gflops),
            best(self.int8_gops, other.int8_gops),
            max(self.fp32_gflops, other.fp32_gflops),
        )


#: Seconds of sampling per compute peak: on a loaded host a quiet moment has to come by.
SAMPLE_SECONDS = 1.0


def _best_rate(fn: Callable[[], object], ops: float, samples: int) -> float:
    """Best rate over at least ``samples`` calls, continued up to ``SAMPLE_SECONDS``."""
    for _ in range(3):
        fn()
    best = float("inf")
    start = time.perf_counter()
    n = 0
    while n < samples or time.perf_counter() - start < SAMPLE_SECONDS:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        n += 1
    return ops / best / 1e9


def measure_bf16_peak(samples: int = 40) -> float:
    """GFLOP/s of torch.mm on cache-resident bf16 512^3 matrices (best sample)."""
    n = PEAK_MNK
    a, b = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16()
    c = torch.empty(n, n, dtype=torch.bfloat16)
    return _best_rate(lambda: torch.mm(a, b, out=c), 2 * n**3, samples)


def measure_int8_peak(samples: int = 40) -> Optional[float]:
    """GOP/s of torch._int_mm on int8 512^3 matrices (best sample), or None without it."""
    n = PEAK_MNK
    a = torch.randint(-128, 128, (n, n), dtype=torch.int8)
    b = torch.randint(-128, 128, (n, n), dtype=torch.int8)
    try:
        torch._int_mm(a, b)
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return _best_rate(lambda: torch._int_mm(a, b), 2 * n**3, samples)


def measure_fma_units(threads: int) -> Optional[float]:
    """GFLOP/s of independent 256-bit FMA chains on ``threads`` kt_ops threads at once
    (best sample over ``SAMPLE_SECONDS``), or None where kt_ops or its AVX2 tier is not
    there."""
    try:
        import kt_ops
    except ImportError:
        return None
    prev = kt_ops.get_num_threads()
    try:
        kt_ops.set_num_threads(threads)
        return kt_ops._C._testing.fma_peak_gflops(SAMPLE_SECONDS)
    except (AttributeError, ValueError):
        return None
    finally:
        kt_ops.set_num_threads(prev)


def measure_fp32_peak(threads: int, samples: int = 40) -> float:
    """GFLOP/s: the faster of torch.mm fp32 (best of ``samples``) and ``measure_fma_units``."""
    return max(max(measure_fma_peak(samples)), measure_fma_units(threads) or 0.0)


def measure(threads: int, bw_samples: int = 5) -> Peaks:
    """All limits at ``threads`` torch (and kt_ops) threads (restores the previous count)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return Peaks(
            threads=threads,
            read_gbs=max(measure_read_bandwidth(bw_samples)),
            bf16_gflops=measure_bf16_peak(),
            int8_gops=measure_int8_peak(),
            fp32_gflops=measure_fp32_peak(threads),
        )
    finally:
        torch.set_num_threads(prev)


def roofline(
    nbytes: float, flops: float, read_gbs: float, peak_gflops: Optional[float]
) -> tuple[float, str]:
    """The time bound of a call: max(bytes / read bandwidth, FLOPs / compute peak).

    Returns (seconds, binding term): ``"read"`` or ``"compute"``. ``nbytes``: the
    weight bytes the call must stream (scales included); ``flops``: 2 per
    multiply-add; ``peak_gflops``: GFLOP/s (GOP/s for int8) of the compute the
    call runs on, ``None`` where unknown (then only the bytes bind).
    """
    mem_s = nbytes / (read_gbs * 1e9)
    comp_s = 0.0 if not peak_gflops else flops / (peak_gflops * 1e9)
    return (mem_s, "read") if mem_s >= comp_s else (comp_s, "compute")


def describe(p: Peaks) -> str:
    int8 = "n/a" if p.int8_gops is None else f"{p.int8_gops:.0f} GOP/s"
    return (
        f"{p.threads} thread(s): read {p.read_gbs:.1f} GB/s, bf16 {p.bf16_gflops:.0f} GFLOP/s, "
        f"int8 {int8}, fp32 {p.fp32_gflops:.0f} GFLOP/s"
    )


def table(peaks: list[Peaks], markdown: bool = False) -> str:
    head = ["threads", "read GB/s", "bf16 GFLOP/s", "int8 GOP/s", "fp32 GFLOP/s"]
    body = [
        [
            str(p.threads),
            f"{p.read_gbs:.1f}",
            f"{p.bf16_gflops:.0f}",
            "n/a" if p.int8_gops is None else f"{p.int8_gops:.0f}",
            f"{p.fp32_gflops:.0f}",
        ]
        for p in peaks
    ]
    return render_table(head, body, markdown)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    peaks = [measure(t) for t in args.threads]
    print(
        f"# machine peaks on {_cpu_model()}, torch {torch.__version__} "
        f"({time.perf_counter() - t0:.1f}s; best samples; read: torch.sum over 1 GiB fp32; "
        f"bf16 / int8 / fp32: torch.mm / torch._int_mm / torch.mm at {PEAK_MNK}^3; fp32 also "
        f"kt_ops' FMA chains, the faster of the two)"
    )
    print(table(peaks, args.markdown))
    if not args.markdown:
        for pk in peaks:
            print("#", asdict(pk))
    return 0


if __name__ == "__main__":
    sys.exit(main())
