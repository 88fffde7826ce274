"""Run pytest files so that a crash loses nothing: scripts/gpu_check.sh's test step.

As a runner (``python scripts/gpu_check_pytest.py LOG_DIR TARGET...``): each
target (a test file, a file::test node, or several separated by spaces: one
process for them all) runs in its own pytest process
with this module loaded as a plugin (``-p gpu_check_pytest``), which writes
every test's start and outcome, and each failure's text, to ``LOG_DIR``
as it happens. When a process dies (a segfault, an abort), the test that
was running is recorded as ``crashed``, re-run alone under ``cuda-gdb`` (or
``gdb``) where one is installed, for a native backtrace in
``LOG_DIR/crash.log``, and the rest of the file runs in a new process without
it. Prints one summary and exits 1 when any test failed or crashed.

As a plugin it only logs: ``KT_GPU_CHECK_EVENTS`` names the events file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# --------------------------------------------------------------------------- plugin


def _event(line: str) -> None:
    path = os.environ.get("KT_GPU_CHECK_EVENTS")
    if path:
        with open(path, "a") as f:
            f.write(line.rstrip("\n") + "\n")
            f.flush()


def pytest_runtest_logstart(nodeid, location):
    _event(f"START {nodeid}")


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        if report.when != "call" and report.outcome == "skipped":
            _event(f"DONE skipped {report.nodeid}")
        elif report.when == "call" or report.outcome == "failed":
            _event(f"DONE {report.outcome} {report.nodeid}")
    if report.failed:
        _event("TEXT " + report.longreprtext.replace("\n", "\nTEXT "))


# --------------------------------------------------------------------------- runner


def _outcomes(events: Path, texts: dict[str, list[str]] | None = None):
    """Outcome per test id, the ids started in order, and (into ``texts``) failure texts."""
    outcome: dict[str, str] = {}
    started: list[str] = []
    last = ""
    if events.exists():
        for line in events.read_text().splitlines():
            if line.startswith("START "):
                started.append(line[6:])
            elif line.startswith("DONE "):
                _, state, last = line.split(" ", 2)
                if outcome.get(last) != "failed":  # a failed teardown stays failed
                    outcome[last] = state
            elif line.startswith("TEXT") and texts is not None:
                texts.setdefault(last, []).append(line[5:])
    return outcome, started


def _backtrace(nodeid: str, log: Path) -> None:
    if os.environ.get("KT_GPU_CHECK_NO_DEBUGGER") == "1":  # the runner's own tests
        return
    debugger = shutil.which("cuda-gdb") or shutil.which("gdb")
    if debugger is None:
        return
    cmd = [debugger, "-batch", "-ex", "run", "-ex", "bt 40", "-ex", "info threads", "--args"]
    cmd += [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", nodeid]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        text = p.stdout[-20000:] + p.stderr[-4000:]
    except subprocess.TimeoutExpired as e:
        text = f"(timed out) {e}"
    with open(log / "crash.log", "a") as f:
        f.write(f"===== {nodeid} under {debugger}\n{text}\n")


def main(argv: list[str]) -> int:
    log = Path(argv[0])
    targets = argv[1:]
    events = log / "test_events.log"
    events.unlink(missing_ok=True)
    env = dict(os.environ, KT_GPU_CHECK_EVENTS=str(events))
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = here + os.pathsep + env.get("PYTHONPATH", "")
    crashed: list[str] = []
    with open(log / "tests.log", "a") as out:
        for target in targets:
            deselect: list[str] = []
            for _attempt in range(4):
                cmd = [sys.executable, "-m", "pytest", "-p", "gpu_check_pytest"]
                cmd += ["-p", "no:cacheprovider", "-q", "-ra", *target.split()]
                for nodeid in deselect:
                    cmd += ["--deselect", nodeid]
                out.write(f"===== {' '.join(cmd)}\n")
                out.flush()
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
                if rc >= 0:  # finished (passed or failed); < 0: killed by a signal
                    break
                outcome, started = _outcomes(events)
                running = [n for n in started if n not in outcome]
                if not running:
                    break
                crashed.append(running[-1])
                with open(events, "a") as f:
                    f.write(f"DONE crashed {running[-1]}\n")
                out.write(f"===== crashed (exit {rc}) in {running[-1]}\n")
                _backtrace(running[-1], log)
                deselect.append(running[-1])
    texts: dict[str, list[str]] = {}
    outcome, _ = _outcomes(events, texts)
    counts: dict[str, int] = {}
    for state in outcome.values():
        counts[state] = counts.get(state, 0) + 1
    print("  tests: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    for nodeid, state in outcome.items():
        if state in ("failed", "crashed"):
            print(f"    {state.upper()} {nodeid}")
            for line in [t for t in texts.get(nodeid, []) if t.strip()][-6:]:
                print(f"      {line[:200]}")
    for nodeid, state in outcome.items():
        if "greedy_decode" in nodeid:
            print(f"  CUDA-graph greedy decode ({nodeid.split('::')[-1]}): {state.upper()}")
    return 1 if any(s in ("failed", "crashed") for s in outcome.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
