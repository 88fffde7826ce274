#!/usr/bin/env python
"""LoRA training steps of one MoE layer across N data-parallel ranks on one host (DDP, gloo).

Each rank runs ``--tokens`` tokens per step through the same experts (one bf16 Qwen3-30B-A3B
style layer with ``--experts`` experts: hidden 2048, intermediate 768, top-8, LoRA rank 16),
read from one ``kt-ops convert``-style safetensors file that every rank memory-maps (one
copy in the page cache). The module is wrapped in ``DistributedDataParallel`` (the packed
experts on its ignore list: never broadcast), the kt_ops pools share the cores out by
``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``. Reports, per rank count: the median step time
(forward + backward + DDP's gradient all-reduce), tokens per second of the host
(ranks x tokens / step), and per rank the PSS (``/proc/self/smaps_rollup``), the PSS
and RSS of the experts' file mapping, and the peak RSS.

Usage (runs itself under torchrun for each rank count)::

    python benchmarks/bench_lora_ranks.py --ranks 1 2 --tokens 512

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

H, I, K, RANK = 2048, 768, 8, 16  # noqa: E741


def write_experts(path: Path, E: int) -> None:
    """bf16 packed experts (random, fixed seed) as one safetensors file."""
    from safetensors.torch import save_file

    import kt_ops

    g = torch.Generator().manual_seed(0)
    w = {
        "gate": torch.randn(E, I, H, generator=g) * 0.02,
        "up": torch.randn(E, I, H, generator=g) * 0.02,
        "down": torch.randn(E, H, I, generator=g) * 0.02,
    }
    experts = kt_ops.ExpertWeights.from_dense(w["gate"], w["up"], w["down"], "bf16")
    save_file({r: p.weight for r, p in zip(w, experts.projections)}, str(path))


def file_mapping(path: Path) -> dict[str, int]:
    root = str(path.resolve())
    out = {"Pss": 0, "Rss": 0, "Private_Dirty": 0}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and ":" not in fields[0]:
                inside = len(fields) >= 6 and fields[5] == root
                continue
            key = fields[0].rstrip(":") if fields else ""
            if inside and key in out:
                out[key] += int(fields[1]) * 1024
    return out


def pss() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args) -> int:
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.nn.parallel import DistributedDataParallel as DDP

    import kt_ops
    from kt_ops.distributed import core_share, keep_packed_experts_out_of_ddp
    from kt_ops.formats import PackedProjection
    from kt_ops.nn import MoEExperts

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = Path(args.file)
    with safe_open(str(path), framework="pt") as f:  # memory-mapped views
        t = {r: f.get_tensor(r) for r in ("gate", "up", "down")}
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    projs = [PackedProjection(t[r], None, None, "bf16", 0, *shapes[r]) for r in t]
    module = MoEExperts(kt_ops.ExpertWeights(*projs))
    module.add_lora(RANK, alpha=2 * RANK, generator=torch.Generator().manual_seed(1))
    keep_packed_experts_out_of_ddp(module)
    model = DDP(module)
    E = module.num_experts
    times = []
    for step in range(args.warmup + args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(args.tokens, H, generator=g).bfloat16().requires_grad_()
        vals, ids = torch.topk(torch.randn(args.tokens, E, generator=g), K, dim=1)
        w = torch.softmax(vals, dim=1)
        dist.barrier()
        t0 = time.perf_counter()
        y = model(x, ids, w)
        y.float().square().mean().backward()
        dist.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    report = {
        "rank": rank,
        "world": world,
        "step_s": statistics.median(times),
        "pss": pss(),
        "experts_file": file_mapping(path),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": kt_ops.get_num_threads(),
        "cores": core_share()["cores"],
    }
    Path(args.out).joinpath(f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=512, help="tokens per rank per step")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    tmp = Path(tempfile.mkdtemp(prefix="kt_lora_ranks_"))
    file = tmp / "experts.safetensors"
    write_experts(file, args.experts)
    size = file.stat().st_size
    print(f"# LoRA step, one layer: E={args.experts} H={H} I={I} top-{K} rank {RANK}, bf16 experts")
    print(f"# {size / 1e6:.0f} MB of experts in one memory-mapped file; {args.tokens} tokens/rank")
    print("| ranks | step ms (median) | host tokens/s | threads/rank | PSS/rank MB | "
          "experts PSS/rank MB | experts RSS/rank MB | peak RSS/rank MB |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in args.ranks:
        out = tmp / f"n{n}"
        out.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("KT_OPS_")}
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc-per-node={n}", __file__, "--worker", "--file", str(file)]
        cmd += ["--out", str(out), "--tokens", str(args.tokens), "--steps", str(args.steps)]
        cmd += ["--warmup", str(args.warmup)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return 1
        reps = [json.loads((out / f"rank{i}.json").read_text()) for i in range(n)]
        step = max(x["step_s"] for x in reps)

        def mean(key, sub=None, reps=reps):  # MB, over the ranks
            vals = [x[key][sub] if sub else x[key] for x in reps]
            return sum(vals) / len(vals) * 1e-6

        print(
            f"| {n} | {step * 1e3:.0f} | {n * args.tokens / step:.0f} | {reps[0]['threads']} | "
            f"{mean('pss'):.0f} | {mean('experts_file', 'Pss'):.0f} | "
            f"{mean('experts_file', 'Rss'):.0f} | {mean('peak_rss'):.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
