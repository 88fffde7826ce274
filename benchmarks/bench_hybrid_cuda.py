#!/usr/bin/env python
"""Time the CPU/GPU hybrid path on a real GPU: the CUDA bridge, CUDA graphs, overlap, the split.

For one MoE layer (Qwen3-30B-A3B by default: hidden 2048, expert intermediate
768, 128 experts, top-8), each weight format (bf16 and int4 by default) and each
token count T (1, 8, 512), in one process on a machine with a CUDA device:

1. **Bridge cost.** ``kt_ops.moe_forward`` on CPU tensors (``cpu``) against the
   same call on CUDA hidden states, routing ids and weights (``cuda``: the
   CUDA-stream bridge, ``kt_ops.hybrid``: copy in, host function, copy out),
   eagerly and as the replay of a captured ``torch.cuda.CUDAGraph``
   (``graph``). Host clock around the call and a ``torch.cuda.synchronize()``;
   the three are interleaved per repetition (the order rotates) over the same
   pre-drawn routings, so host noise and DRAM state hit all alike, each after
   a 20 ms idle pause (``SETTLE_S``: torch's OpenMP threads, which the CPU
   call runs on, spin for a while after it).
   ``bridge`` = cuda - cpu (median of each).
2. **Overlap.** ``enqueue``: host time of the CUDA call alone (it returns before
   the CPU experts run). A chain of bf16 GPU matmuls sized to take about as long
   as the op, enqueued right after it: on the *same* stream it waits for the op
   (CUDA stream order: ``same`` ~ op + mm), on a side stream, as
   ``MoEExperts`` runs the op when it also has GPU experts (``cuda_overlap``),
   it runs while the CPU experts compute (``side``). ``overlap`` =
   (op + mm - side) / min(op, mm): 100% when the shorter one is hidden
   entirely. All from CUDA events on the current stream.
3. **The host function's thread** (``--caller-tokens``, first format only):
   CUDA-graph replays with that thread waiting while the pool's workers compute
   (the default, ``runtime::CallerWaitsScope``), computing its share, and
   computing with one pool thread less; one block per setting, the first again
   at the end.
4. **Split.** ``kt_ops.nn.MoEExperts`` with 0, 8 and 32 of its experts resident
   on the GPU (``set_gpu_experts``: bf16 copies, computed with torch on the
   GPU; the op skips them through ``gpu_experts_mask``), called on CUDA hidden
   states; the routing is skewed (a fixed Zipf-like popularity per expert added
   to the router logits, as real routers are) and the GPU experts are the
   hottest of a calibration batch, so ``gpu share`` (the share of routed
   (token, expert) slots the GPU computes) grows faster than N / E.

Also the stream time of a no-op ``cudaLaunchHostFunc`` (the floor of any
stream-ordered host work on the machine). Medians over ``--repeats`` (default
30 at T <= 8, 7 above). Not part of the test suite; ``scripts/gpu_check.sh``
runs it and prints its tables. Without a CUDA device (or without the bridge in
the build) it says so and exits 0.

Usage::

    python benchmarks/bench_hybrid_cuda.py                       # Qwen3 layer, bf16 + int4
    python benchmarks/bench_hybrid_cuda.py --experts 32 --tokens 1 8 --formats int8
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from typing import Callable, Optional

import torch

import kt_ops
import kt_ops.hybrid
from kt_ops import _C
from kt_ops.layer import ExpertWeights
from kt_ops.nn import MoEExperts, hottest_experts

DEFAULT_TOKENS = (1, 8, 512)
DEFAULT_SPLITS = (0, 8, 32)
MM_N = 4096  # one bf16 matmul of the overlap chain: 4096^3, ~0.2 ms on an H100
# An idle pause before each timed call of the interleaved bridge comparison. A CPU-tensor
# call runs on torch's OpenMP threads (kt_ops' 'auto' backend), which spin for a while
# after it; a bridged call right after it ran its host function beside 16 spinning
# threads on 16 cores (3.8-11 ms instead of 0.9 at T = 1 on the first H100 run).
SETTLE_S = 0.02


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _host_timed(fn: Callable[[], object]) -> float:
    """Seconds from the call to the end of the work it enqueued (synchronize)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _event_ms(fn: Callable[[], object]) -> float:
    """Milliseconds of the current stream's work enqueued by ``fn`` (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


class Layer:
    """One layer's seeded dense weights (bf16, made on the GPU: seconds, not minutes)."""

    def __init__(self, E: int, H: int, inter: int, top_k: int, seed: int = 0) -> None:
        self.E, self.H, self.inter, self.top_k = E, H, inter, top_k
        g = torch.Generator(device="cuda").manual_seed(seed)

        def normal(*shape: int, std: float) -> torch.Tensor:
            t = torch.empty(*shape, device="cuda", dtype=torch.bfloat16)
            return t.normal_(0.0, std, generator=g)

        self.gate = normal(E, inter, H, std=H**-0.5)
        self.up = normal(E, inter, H, std=H**-0.5)
        self.down = normal(E, H, inter, std=inter**-0.5)
        # A fixed popularity per expert (Zipf-like, s = 1), added to the router logits.
        rank = torch.randperm(E, generator=torch.Generator().manual_seed(seed + 1))
        self.bias = -torch.log1p(rank.float())

    def pack(self, fmt: str) -> ExpertWeights:
        return ExpertWeights.from_dense(self.gate, self.up, self.down, fmt)

    def routing(self, T: int, gen: torch.Generator, skewed: bool = False):
        """CPU bf16 hidden states [T, H], int64 ids and fp32 weights [T, K] (normalized top-k)."""
        x = torch.randn(T, self.H, generator=gen).to(torch.bfloat16)
        logits = torch.randn(T, self.E, generator=gen) + (self.bias if skewed else 0.0)
        w, ids = torch.topk(torch.softmax(logits, -1), self.top_k, dim=-1)
        return x, ids, (w / w.sum(-1, keepdim=True)).float()


def bridge_rows(layer: Layer, fmt: str, experts: ExpertWeights, tokens, repeats) -> list[dict]:
    return [bridge_row(layer, fmt, experts, T, repeats or (30 if T <= 8 else 7)) for T in tokens]


def bridge_row(layer: Layer, fmt: str, experts: ExpertWeights, T: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(100 + T)
    sets = [layer.routing(T, gen) for _ in range(min(reps, 8))]
    dev_sets = [tuple(t.cuda() for t in s) for s in sets]
    static = tuple(t.clone() for t in dev_sets[0])

    def cpu(i: int) -> None:
        kt_ops.moe_forward(*sets[i], experts)

    def cuda(i: int) -> None:
        kt_ops.moe_forward(*dev_sets[i], experts)

    for i in range(2):  # warm-up: staging memory, the prepared layer, lazy CUDA init
        cpu(i % len(sets))
        cuda(i % len(sets))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kt_ops.moe_forward(*static, experts)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out = kt_ops.moe_forward(*static, experts)

    samples: dict[str, list[float]] = {"cpu": [], "cuda": [], "graph": []}
    calls = {"cpu": cpu, "cuda": cuda, "graph": lambda i: graph.replay()}
    order = list(calls)
    for r in range(reps):
        i = r % len(sets)
        for t, dst in zip(dev_sets[i], static):
            dst.copy_(t)
        for name in order[r % 3 :] + order[: r % 3]:
            time.sleep(SETTLE_S)
            samples[name].append(_host_timed(lambda name=name, i=i: calls[name](i)))
    # The replay computed the last routing: check it against the CPU op (bit-identical).
    want = kt_ops.moe_forward(*sets[(reps - 1) % len(sets)], experts)
    exact = torch.equal(captured_out.cpu(), want)
    graph.reset()  # the graph is gone: its staging memory may go too
    kt_ops.hybrid.release_graph_staging()

    # Overlap: the op's stream time, a matmul chain of about that length after it on the
    # same stream, and the same chain beside the op on a side stream.
    x, ids, w = dev_sets[0]
    enqueue = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        kt_ops.moe_forward(x, ids, w, experts)
        enqueue.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    op_ms = statistics.median(
        _event_ms(lambda: kt_ops.moe_forward(x, ids, w, experts)) for _ in range(5)
    )
    a = torch.randn(MM_N, MM_N, device="cuda", dtype=torch.bfloat16)
    one_mm = statistics.median(_event_ms(lambda: a @ a) for _ in range(5))
    n_mm = max(1, round(op_ms / max(one_mm, 1e-3)))

    def chain() -> None:
        b = a
        for _ in range(n_mm):
            b = b @ a
        return b

    mm_ms = statistics.median(_event_ms(chain) for _ in range(3))

    def same_stream() -> None:
        kt_ops.moe_forward(x, ids, w, experts)
        chain()

    def side_stream() -> None:
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            y = kt_ops.moe_forward(x, ids, w, experts)
        chain()
        cur.wait_stream(side)
        y.record_stream(cur)

    same_ms = statistics.median(_event_ms(same_stream) for _ in range(3))
    side_ms = statistics.median(_event_ms(side_stream) for _ in range(3))
    overlap = (op_ms + mm_ms - side_ms) / min(op_ms, mm_ms)
    cpu_ms, cuda_ms, graph_ms = (_median_ms(samples[k]) for k in ("cpu", "cuda", "graph"))
    row = dict(
        fmt=fmt,
        T=T,
        cpu=cpu_ms,
        cuda=cuda_ms,
        graph=graph_ms,
        bridge=cuda_ms - cpu_ms,
        graph_bridge=graph_ms - cpu_ms,
        exact=exact,
        enqueue_us=statistics.median(enqueue) * 1e6,
        op=op_ms,
        mm=mm_ms,
        n_mm=n_mm,
        same=same_ms,
        side=side_ms,
        overlap=overlap,
    )
    print(
        f"  {fmt:5} T={T:<4} cpu {cpu_ms:8.3f}  cuda {cuda_ms:8.3f}  graph {graph_ms:8.3f} ms"
        f"  overlap {overlap:5.0%}  replay {'bit-identical' if exact else 'DIFFERS'}",
        flush=True,
    )
    return row


def host_function_round_trip_ms(samples: int = 50) -> Optional[float]:
    """Stream time of one no-op ``cudaLaunchHostFunc`` (libc ``free(NULL)``), median ms.

    The floor of any stream-ordered host work on this machine (driver callback
    thread, interrupt delivery), measured beside the bridge. None when the
    process's libcudart cannot be found.
    """
    torch.cuda.init()
    path = None
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "libcudart.so" in line:
                path = line.split()[-1]
                break
    if path is None:
        return None
    cudart = ctypes.CDLL(path)
    cudart.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    cudart.cudaLaunchHostFunc.restype = ctypes.c_int
    free = ctypes.cast(ctypes.CDLL(None).free, ctypes.c_void_p)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)

    def launch() -> None:
        err = cudart.cudaLaunchHostFunc(stream, free, None)
        if err != 0:
            raise RuntimeError(f"cudaLaunchHostFunc failed with error {err}")

    launch()
    return statistics.median(_event_ms(launch) for _ in range(samples))


def caller_rows(layer: Layer, experts: ExpertWeights, fmt: str, tokens, repeats) -> list[dict]:
    """CUDA-graph replays of a bridged call with the host function's thread waiting while
    the pool's workers compute (the default), computing its share, or computing with one
    thread less in the pool. One block of calls per setting (a pool resize restarts its
    workers), the first setting again at the end to show the drift."""
    n = kt_ops.get_num_threads()
    configs = [("waits", n, True), ("computes", n, False), ("computes", n - 1, False)]
    configs = [c for c in configs if c[1] >= 1] + [configs[0]]
    rows = []
    for T in tokens:
        gen = torch.Generator().manual_seed(300 + T)
        sets = [tuple(t.cuda() for t in layer.routing(T, gen)) for _ in range(8)]
        static = tuple(t.clone() for t in sets[0])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                kt_ops.moe_forward(*static, experts)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kt_ops.moe_forward(*static, experts)
        reps = repeats or 30
        for mode, threads, waits in configs:
            kt_ops.set_num_threads(threads)
            before = _C._testing.bridge_caller_waits(waits)
            samples = []
            for r in range(reps + 3):
                for t, dst in zip(sets[r % len(sets)], static):
                    dst.copy_(t)
                torch.cuda.synchronize()
                ms = _host_timed(graph.replay)
                if r >= 3:  # the first replays after a resize warm the new workers up
                    samples.append(ms)
            _C._testing.bridge_caller_waits(before)
            rows.append(dict(fmt=fmt, T=T, mode=mode, threads=threads, ms=_median_ms(samples)))
            print(
                f"  {fmt:5} T={T:<4} caller {mode:8} {threads:3} threads "
                f"{rows[-1]['ms']:8.3f} ms (graph replay)",
                flush=True,
            )
        kt_ops.set_num_threads(n)
        graph.reset()
        kt_ops.hybrid.release_graph_staging()
    return rows


def split_rows(layer: Layer, fmt: str, experts: ExpertWeights, tokens, splits, repeats):
    gen = torch.Generator().manual_seed(7)
    _, calib_ids, _ = layer.routing(4096, gen, skewed=True)
    counts = torch.bincount(calib_ids.flatten(), minlength=layer.E)
    rows = []
    module = MoEExperts(experts)
    for n in splits:
        if n > layer.E:
            continue
        ids_gpu = hottest_experts(counts, n) if n else None
        module.set_gpu_experts(
            ids_gpu,
            dense=(layer.gate, layer.up, layer.down),
            dtype=torch.bfloat16,
            device="cuda",
        )
        for T in tokens:
            reps = repeats or (30 if T <= 8 else 7)
            sets = [
                tuple(t.cuda() for t in layer.routing(T, gen, skewed=True))
                for _ in range(min(reps, 8))
            ]
            share = 0.0
            if n:
                mask = module.gpu_experts_mask
                share = float(sum(mask[s[1]].float().mean() for s in sets) / len(sets))
            for s in sets[:2]:
                module(*s)
            picks = [sets[i % len(sets)] for i in range(reps)]
            samples = [_host_timed(lambda s=s: module(*s)) for s in picks]
            rows.append(dict(fmt=fmt, n=n, T=T, ms=_median_ms(samples), share=share))
            print(
                f"  {fmt:5} gpu experts {n:3} T={T:<4} {rows[-1]['ms']:8.3f} ms "
                f"(gpu share {share:.0%})",
                flush=True,
            )
    module.set_gpu_experts(None)
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def report(
    bridge: list[dict], split: list[dict], splits, callers: list[dict], host_fn: Optional[float]
) -> str:
    out = [
        "Host function round trip (a no-op cudaLaunchHostFunc, stream time, median): "
        + ("libcudart not found" if host_fn is None else f"{host_fn * 1e3:.0f} us"),
        "",
        "Bridge cost (ms, median; bridge = cuda - cpu; graph = CUDA-graph replay):",
        _table(
            ["format", "T", "cpu", "cuda", "bridge", "graph", "graph bridge", "replay = cpu op"],
            [
                [
                    r["fmt"],
                    str(r["T"]),
                    f"{r['cpu']:.3f}",
                    f"{r['cuda']:.3f}",
                    f"{r['bridge']:+.3f}",
                    f"{r['graph']:.3f}",
                    f"{r['graph_bridge']:+.3f}",
                    "yes" if r["exact"] else "NO",
                ]
                for r in bridge
            ],
        ),
        "",
        "Overlap (CUDA events; mm = a bf16 matmul chain of about the op's length enqueued after "
        "it; same = on the op's stream, side = on another stream):",
        _table(
            ["format", "T", "enqueue us", "op ms", "mm ms", "same ms", "side ms", "overlap"],
            [
                [
                    r["fmt"],
                    str(r["T"]),
                    f"{r['enqueue_us']:.0f}",
                    f"{r['op']:.3f}",
                    f"{r['mm']:.3f}",
                    f"{r['same']:.3f}",
                    f"{r['side']:.3f}",
                    f"{r['overlap']:.0%}",
                ]
                for r in bridge
            ],
        ),
    ]
    if callers:
        out += [
            "",
            "The host function's thread (CUDA-graph replay, ms, median; waits = the pool's "
            "workers compute, the default; computes = it takes tasks too):",
            _table(
                ["format", "T", "caller", "threads", "ms"],
                [
                    [r["fmt"], str(r["T"]), r["mode"], str(r["threads"]), f"{r['ms']:.3f}"]
                    for r in callers
                ],
            ),
        ]
    if split:
        out += [
            "",
            "Split: MoEExperts forward on CUDA hidden states, N experts resident on the GPU "
            "(ms, median; share = routed slots the GPU computes):",
        ]
        keys = sorted({(r["fmt"], r["T"]) for r in split}, key=lambda k: (k[0], k[1]))
        header = ["format", "T"] + [f"N = {n}" for n in splits]
        rows = []
        for fmt, T in keys:
            cells = [fmt, str(T)]
            for n in splits:
                r = next((r for r in split if (r["fmt"], r["T"], r["n"]) == (fmt, T, n)), None)
                cells.append("" if r is None else f"{r['ms']:.3f} ({r['share']:.0%})")
            rows.append(cells)
        out.append(_table(header, rows))
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", nargs="+", default=["bf16", "int4"])
    p.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS))
    p.add_argument("--splits", nargs="+", type=int, default=list(DEFAULT_SPLITS))
    p.add_argument("--experts", type=int, default=128, help="E (Qwen3-30B-A3B: 128)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--repeats", type=int, default=0, help="0: 30 at T <= 8, 7 above")
    p.add_argument(
        "--caller-tokens",
        nargs="*",
        type=int,
        default=[1, 8],
        help="T of the host-function-thread comparison (first format only; none: skip)",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hybrid_cuda: no GPU (torch.cuda.is_available() is False); nothing timed")
        return 0
    if not kt_ops.hybrid.cuda_bridge_built():
        print("bench_hybrid_cuda: this kt_ops build has no CUDA bridge; nothing timed")
        return 0
    print(
        f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
        f"kt_ops threads {kt_ops.get_num_threads()}, ISA {kt_ops.info()['active_isa']}; layer "
        f"E={args.experts} H={args.hidden} I={args.intermediate} top-{args.top_k}",
        flush=True,
    )
    host_fn = host_function_round_trip_ms()
    layer = Layer(args.experts, args.hidden, args.intermediate, args.top_k)
    bridge, split, callers = [], [], []
    with torch.no_grad():
        for i, fmt in enumerate(args.formats):
            t0 = time.perf_counter()
            experts = layer.pack(fmt)
            print(f"packed {fmt} in {time.perf_counter() - t0:.1f} s", flush=True)
            if i == 0 and args.caller_tokens:
                callers = caller_rows(layer, experts, fmt, args.caller_tokens, args.repeats)
            bridge += bridge_rows(layer, fmt, experts, args.tokens, args.repeats)
            split += split_rows(layer, fmt, experts, args.tokens, args.splits, args.repeats)
            del experts
    print()
    print(report(bridge, split, args.splits, callers, host_fn))
    return 0


if __name__ == "__main__":
    sys.exit(main())
