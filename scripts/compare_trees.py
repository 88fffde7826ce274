"""Run one benchmark in two checkouts of kt_ops, alternately, and compare them.

    python scripts/compare_trees.py OLD_TREE NEW_TREE [--rounds 3] -- bench_moe.py --tokens 1 8
    python scripts/compare_trees.py OLD NEW -- bench_formats.py --tokens 1 --formats int4-g128 q4_k

Each tree runs its own ``benchmarks/<script>`` (so each uses its own op API)
with ``PYTHONPATH=<tree>`` and ``--json``; the runs alternate old, new, old,
new, ... so both see the same host load. Each row's time (``kt_ms`` for
bench_moe.py, ``ms`` for bench_formats.py) is reduced to its median over the
rounds, and the table shows new/old with the spread of each side (max/min of
the round medians), which is the noise to judge the ratio against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(tree: Path, script: str, args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "benchmarks" / script), *args, "--json", out]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    rows = {}
    for r in data["rows"]:
        key = (r.get("label", "bf16"), r["tokens"])
        rows[key] = r.get("kt_ms", r.get("ms"))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    if "--" not in argv:
        ap.error("give the benchmark after --, e.g. -- bench_moe.py --tokens 1 8")
    cut = argv.index("--")
    a = ap.parse_args(argv[:cut])
    bench = argv[cut + 1 :]
    if not bench:
        ap.error("give the benchmark after --, e.g. -- bench_moe.py --tokens 1 8")
    script, args = bench[0], bench[1:]
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for r in range(a.rounds):
        for side, tree in (("old", a.old), ("new", a.new)):
            print(f"round {r + 1}/{a.rounds}: {side} ({tree})", file=sys.stderr)
            runs[side].append(run_once(tree, script, args))
    print("| row | T | old ms | new ms | new/old | old spread | new spread |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    worst = 0.0
    for key in runs["old"][0]:
        old = [r[key] for r in runs["old"] if key in r]
        new = [r[key] for r in runs["new"] if key in r]
        if not old or not new:
            continue
        mo, mn = statistics.median(old), statistics.median(new)
        worst = max(worst, mn / mo)
        print(
            f"| {key[0]} | {key[1]} | {mo:.2f} | {mn:.2f} | {mn / mo:.2f} | "
            f"{max(old) / min(old):.2f} | {max(new) / min(new):.2f} |"
        )
    print(f"\nworst new/old: {worst:.2f} ({a.rounds} alternating rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
