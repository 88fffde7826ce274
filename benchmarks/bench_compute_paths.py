"""Break-even of the compute paths: streaming kernels vs oneDNN's brgemm, per tokens per expert.

Every token routes to the same ``--experts`` experts (top-k = experts), so each
expert gets exactly ``m = T`` tokens; the two paths run interleaved on the same
inputs and the medians are compared. The ``'auto'`` thresholds in the format
table (``brgemm_min_tokens``, docs/formats.md "Compute paths") come from this::

    python benchmarks/bench_compute_paths.py --tokens 1 2 3 4 6 8 12 16 32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import kt_ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference import make_expert_weights, make_hidden  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 32])
    p.add_argument("--format", default="bf16")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--isa", choices=kt_ops.supported_isas())
    args = p.parse_args()
    if args.isa:
        kt_ops.set_isa(args.isa)
    E, H, I = args.experts, args.hidden, args.intermediate  # noqa: E741
    experts = make_expert_weights(E, H, I, weight_format=args.format)
    paths = ("streaming", "brgemm")
    brg = kt_ops.compute_paths()[args.format]["brgemm_kernel"]
    print(
        f"# {args.format} H={H} I={I}, {E} experts all hit, isa {kt_ops.active_isa()}, "
        f"{kt_ops.get_num_threads()} threads, brgemm kernel {brg}"
    )
    print(" m  streaming ms  brgemm ms  brgemm/streaming")
    for T in args.tokens:
        x = make_hidden(T, H)
        ids = torch.arange(E).repeat(T, 1)
        w = torch.full((T, E), 1.0 / E)
        times = {path: [] for path in paths}
        for _ in range(args.repeats):
            for path in paths:
                with kt_ops.use_compute_path(path):
                    kt_ops.moe_forward(x, ids, w, experts)  # warm (JIT, caches)
                    t0 = time.perf_counter()
                    kt_ops.moe_forward(x, ids, w, experts)
                    times[path].append(time.perf_counter() - t0)
        ms = {path: 1e3 * statistics.median(v) for path, v in times.items()}
        print(
            f"{T:2d}  {ms['streaming']:12.3f}  {ms['brgemm']:9.3f}  "
            f"{ms['brgemm'] / ms['streaming']:16.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
