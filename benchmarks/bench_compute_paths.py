"""Break-even of the compute paths: streaming kernels vs oneDNN's brgemm, per tokens per expert.

Every token routes to the same ``--experts`` experts (top-k = experts), so each
expert gets exactly ``m = T`` tokens; the two paths run interleaved on the same
inputs and the medians are compared. The ``'auto'`` thresholds in the format
table (``brgemm_min_tokens``, docs/formats.md "Compute paths") come from this::

    python benchmarks/bench_compute_paths.py --tokens 1 2 3 4 6 8 12 16 32
    python benchmarks/bench_compute_paths.py --format int8 --tokens 4 8 12 16 24 32
    python benchmarks/bench_compute_paths.py --format fp8 --tokens 2 4 8 12 16 32 64 --repeats 7

For the q8 formats (int8, q8_0) the streaming side is timed twice: under the
default activation mode (``'auto'``: q8 below the format's fp32 threshold on
the active tier, ``kt_ops.quant_fp32_min_tokens``, the weight-only fp32 path
from there; never on avx512_vnni) and pinned to ``'q8'`` (the kernels whose
results brgemm reproduces bit for bit).
For fp8 the streaming side under ``'auto'`` is the in-register E4M3 kernel
below its ``fp32_min_tokens`` and the weight-only fp32 path from there.

``--layer T ...`` times a whole layer instead (Qwen3-30B-A3B shape: 128
experts, top-8, seeded random routing; the packed tensors of 8 unique experts
tiled to 128, as bench_formats.py does) and reports ms, GOP/s and the fraction
of the int8 (or, for bf16 and fp8, the bf16) peak measured in the same run
(machine_peaks.py)::

    python benchmarks/bench_compute_paths.py --format int8 --layer 128 512
    python benchmarks/bench_compute_paths.py --format fp8 --layer 512
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
sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference import make_expert_weights, make_hidden  # noqa: E402

Q8_FORMATS = ("int8", "q8_0")
#: Formats whose brgemm multiplies bf16 (fp8: decoded to bf16 tiles): the bf16 peak.
BF16_BRGEMM_FORMATS = ("bf16", "fp8")


def paths_for(fmt: str) -> tuple[tuple[str, str, str], ...]:
    """(label, compute path, activation mode) of every timed side.

    bf16 and fp8 also time ``brgemm@onednn``: the brgemm path on oneDNN's
    kernel (``kt_ops.set_brgemm_bf16_kernel('onednn')``), beside ``brgemm`` on
    the kernel ``auto`` picks (kt_ops' vdpbf16ps tiles on AVX512_BF16 without
    AMX; for fp8 with AVX512_VBMI too). bf16 also times ``brgemm@onednn_pairs``:
    oneDNN's kernel with its 16-row blocks in pairs, one N = 32 call each
    (``KT_OPS_BRGEMM_BF16_PAIRS``, csrc/kernels/brgemm.h). int8 times its w8a8
    kernels likewise: ``brgemm`` on kt_ops' vpdpbusd tiles (AVX512_VNNI without AMX),
    ``brgemm@onednn`` on oneDNN's u8s8 brgemm; so does int4 (``int4-g0``, per channel:
    its w4a8 kernels; with groups, ``int4-g128``, ``brgemm`` streams where kt_ops' tiles
    run and ``brgemm@onednn`` is oneDNN's w4a8 with one call per group). mxfp4 times
    ``brgemm@onednn``: its exact values decoded to bf16 tiles on oneDNN's bf16 brgemm
    (its AMX path).
    """
    if fmt in BF16_BRGEMM_FORMATS:
        pairs = (("brgemm@onednn_pairs", "brgemm", "auto"),) if fmt == "bf16" else ()
        return (
            ("streaming", "streaming", "auto"),
            ("brgemm", "brgemm", "auto"),
            ("brgemm@onednn", "brgemm", "auto"),
            *pairs,
            ("auto", "auto", "auto"),
        )
    if fmt in Q8_FORMATS:
        onednn = (("brgemm@onednn", "brgemm", "auto"),) if fmt == "int8" else ()
        return (
            ("streaming", "streaming", "auto"),
            ("streaming@q8", "streaming", "q8"),
            ("brgemm", "brgemm", "auto"),
            *onednn,
            ("auto", "auto", "auto"),
        )
    onednn_tiles = fmt.startswith("int4-g") or fmt == "mxfp4"
    onednn = (("brgemm@onednn", "brgemm", "auto"),) if onednn_tiles else ()
    return (
        ("streaming", "streaming", "auto"),
        ("brgemm", "brgemm", "auto"),
        *onednn,
        ("auto", "auto", "auto"),
    )


def time_paths(sides, x, ids, w, experts, repeats: int) -> dict[str, float]:
    """Median ms per side, the sides interleaved (one warm call before each timed one)."""
    times = {label: [] for label, _, _ in sides}
    for _ in range(repeats):
        for label, path, act in sides:
            kernel = "onednn" if "@onednn" in label else "auto"
            pairs = kt_ops._C._testing.set_brgemm_bf16_pairs(label.endswith("_pairs"))
            try:
                with (
                    kt_ops.use_compute_path(path),
                    kt_ops.use_quant_activations(act),
                    kt_ops.use_brgemm_bf16_kernel(kernel),
                ):
                    kt_ops.moe_forward(x, ids, w, experts)  # warm (JIT, caches)
                    t0 = time.perf_counter()
                    kt_ops.moe_forward(x, ids, w, experts)
                    times[label].append(time.perf_counter() - t0)
            finally:
                kt_ops._C._testing.set_brgemm_bf16_pairs(pairs)
    return {label: 1e3 * statistics.median(v) for label, v in times.items()}


def break_even(ms_by_tokens: dict[int, dict[str, float]], side: str) -> int | None:
    """The smallest m measured from which ``side`` beats ``streaming`` at every larger m.

    ``ms_by_tokens[m][label]``: median ms per side at m tokens per expert. None when
    ``side`` loses at the largest m measured (never, within the range). This is the
    ``brgemm_min_tokens`` the format table takes for the kernel ``side`` runs.
    """
    found = None
    for m in sorted(ms_by_tokens, reverse=True):
        if ms_by_tokens[m][side] >= ms_by_tokens[m]["streaming"]:
            break
        found = m
    return found


def layer_main(args) -> int:
    """A whole layer at T tokens: ms, GOP/s and the fraction of the same-run peak."""
    import machine_peaks
    from bench_formats import build_variant, parse_variant

    H, I, E, K = args.hidden, args.intermediate, args.layer_experts, args.topk  # noqa: E741
    g = torch.Generator().manual_seed(0)
    dense = (
        torch.randn(8, I, H, generator=g) / H**0.5,
        torch.randn(8, I, H, generator=g) / H**0.5,
        torch.randn(8, H, I, generator=g) / I**0.5,
    )
    experts = build_variant(parse_variant(args.format), dense, E).experts
    threads = kt_ops.get_num_threads()
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if args.format in BF16_BRGEMM_FORMATS:
            peak, unit = machine_peaks.measure_bf16_peak(), "bf16 GFLOP/s"
        else:
            peak, unit = machine_peaks.measure_int8_peak(), "int8 GOP/s"
    finally:
        torch.set_num_threads(prev)
    sides = paths_for(args.format)
    print(
        f"# {args.format} layer H={H} I={I} E={E} top-{K}, isa {kt_ops.active_isa()}, "
        f"{threads} threads; same-run peak {peak:.0f} {unit} (machine_peaks.py)"
    )
    head = "  ".join(f"{label:>22s}" for label, _, _ in sides)
    print(f"   T  {head}   (ms / GOP/s / % peak)")
    for T in args.layer:
        x = make_hidden(T, H)
        logits = torch.randn(T, E, generator=g)
        w, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
        ms = time_paths(sides, x, ids, w.float(), experts, args.repeats)
        ops = 2.0 * T * K * 3 * H * I
        cells = []
        for label, _, _ in sides:
            gops = ops / ms[label] / 1e6
            cells.append(f"{ms[label]:8.1f} {gops:6.0f} {100 * gops / peak:5.1f}%")
        print(f"{T:4d}  " + "  ".join(f"{c:>22s}" for c in cells))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 32])
    p.add_argument(
        "--format",
        default="bf16",
        help="a format name, or int4-g<group>[-asym] (int4-g0: one scale per output channel)",
    )
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--isa", choices=kt_ops.supported_isas())
    p.add_argument("--layer", type=int, nargs="+", help="time a whole layer at these T instead")
    p.add_argument("--layer-experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    args = p.parse_args()
    if args.isa:
        kt_ops.set_isa(args.isa)
    if args.layer:
        return layer_main(args)
    E, H, I = args.experts, args.hidden, args.intermediate  # noqa: E741
    if args.format.startswith("int4-g"):  # int4-g<group>[-asym]; int4-g0: per channel
        from bench_formats import build_variant, parse_variant

        variant = parse_variant(args.format)
        g = torch.Generator().manual_seed(0)
        dense = (
            torch.randn(E, I, H, generator=g) / H**0.5,
            torch.randn(E, I, H, generator=g) / H**0.5,
            torch.randn(E, H, I, generator=g) / I**0.5,
        )
        experts, fmt = build_variant(variant, dense, E).experts, variant.weight_format
    else:
        experts, fmt = make_expert_weights(E, H, I, weight_format=args.format), args.format
    sides = paths_for(args.format if args.format.startswith("int4-g") else fmt)
    with kt_ops.use_compute_path("brgemm"):  # the kernel that forced 'brgemm' runs
        brg = kt_ops.compute_paths()[fmt]["brgemm_kernel"]
    print(
        f"# {args.format} H={H} I={I}, {E} experts all hit, isa {kt_ops.active_isa()}, "
        f"{kt_ops.get_num_threads()} threads, brgemm kernel {brg}"
    )
    head = "  ".join(f"{label + ' ms':>15s}" for label, _, _ in sides)
    print(f" m  {head}  brgemm/streaming")
    ms_by_tokens = {}
    for T in args.tokens:
        x = make_hidden(T, H)
        ids = torch.arange(E).repeat(T, 1)
        w = torch.full((T, E), 1.0 / E)
        ms = ms_by_tokens[T] = time_paths(sides, x, ids, w, experts, args.repeats)
        ratio = ms["brgemm"] / ms["streaming"]
        extra = f"  (vs q8 {ms['brgemm'] / ms['streaming@q8']:.2f})" if "streaming@q8" in ms else ""
        print(
            f"{T:2d}  "
            + "  ".join(f"{ms[label]:15.3f}" for label, _, _ in sides)
            + f"  {ratio:16.2f}{extra}"
        )
    # One line per matrix-engine side, for the format table (scripts/amx_check.sh
    # collects them): from which m it wins, on this CPU class.
    for label, _, _ in sides:
        if label.startswith("brgemm"):
            m = break_even(ms_by_tokens, label)
            where = f"m >= {m}" if m is not None else f"never up to m = {max(ms_by_tokens)}"
            print(f"# break-even {args.format} {label} ({kt_ops.active_isa()}): {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
