"""scripts/amx_check.sh: the AMX measurements of issues 26 and 27 as one prepared run.

Its steps take ~45 minutes, so the suite checks what it would run (``--dry-run``) and
that it refuses arguments it does not know; an AMX session runs it for real.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "amx_check.sh"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_dry_run_lists_every_step_and_runs_nothing():
    p = run("--dry-run")
    assert p.returncode == 0, p.stdout + p.stderr
    steps = [line.split(":")[0].removeprefix("[amx_check] ") for line in p.stdout.splitlines()]
    assert steps[0] == "tests"
    for fmt in ("bf16", "int8", "int4-g0", "fp8", "mxfp4"):
        assert f"breakeven-{fmt}" in steps
    assert "layer-int4-g128" in steps and "peers" in steps and "lora" in steps
    assert "huge-pages" in steps
    # Every benchmark it names exists, with the flags it passes (argparse lists them).
    flags: dict[str, set[str]] = {}
    for line in p.stdout.splitlines():
        if "benchmarks/" in line:
            cmd = line.split(": ", 1)[1].split()
            flags.setdefault(cmd[1], set()).update(a for a in cmd[2:] if a.startswith("--"))
    assert len(flags) == 4, flags  # bench_compute_paths, bench_huge_pages, bench_peers, bench_lora
    for script, used in flags.items():
        assert (ROOT / script).is_file(), script
        helptext = subprocess.run(
            [sys.executable, str(ROOT / script), "--help"],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        assert all(f in helptext for f in used), (script, used)


def test_quick_skips_the_long_steps():
    steps = run("--dry-run", "--quick").stdout
    assert "breakeven-int4-g0" in steps
    assert "layer-" not in steps and "peers" not in steps and "lora" not in steps
    assert "huge-pages" not in steps


def test_unknown_arguments_are_refused_by_name():
    p = run("--bogus")
    assert p.returncode == 2
    assert "unknown argument '--bogus'" in p.stderr


def test_break_even_is_where_the_kernel_wins_from_then_on():
    # The line each breakeven step prints for the format table: the smallest m from
    # which the side beats streaming at every larger m (a win below a loss is noise).
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_compute_paths import break_even

    def table(*rows):
        return {m: {"streaming": s, "brgemm": b} for m, s, b in rows}

    assert break_even(table((4, 1.0, 2.0), (8, 2.0, 1.9), (16, 4.0, 3.0)), "brgemm") == 8
    assert break_even(table((4, 1.0, 0.9), (8, 2.0, 2.1), (16, 4.0, 3.0)), "brgemm") == 16
    assert break_even(table((4, 1.0, 0.5), (8, 2.0, 1.0)), "brgemm") == 4
    assert break_even(table((4, 1.0, 0.5), (8, 2.0, 2.0)), "brgemm") is None  # a tie is no win
