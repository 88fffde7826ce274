"""scripts/gpu_check.sh and its test runner, on machines without a GPU.

The script itself runs only where torch sees a CUDA device (README, "On a real
GPU"); here it must say "no GPU" and succeed, and its runner
(scripts/gpu_check_pytest.py) must survive a crashing test: record it, run the
rest of the file, and report failures with their text.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: it would run")
def test_gpu_check_without_a_gpu_says_so_and_succeeds(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable)
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "no GPU" in p.stdout
    assert "no GPU" in (tmp_path / "summary.txt").read_text()


def test_gpu_check_refuses_unknown_arguments():
    p = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--bogus"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and "usage" in p.stderr


CRASHY = """
import ctypes

def test_a():
    pass

def test_b():
    assert 1 == 2, "boom"

def test_c():
    ctypes.string_at(0)  # SIGSEGV

def test_d():
    pass
"""


def test_runner_survives_a_crash_and_reports_every_test(tmp_path):
    tests = tmp_path / "suite"
    tests.mkdir()
    (tests / "test_crashy.py").write_text(CRASHY)
    log = tmp_path / "log"
    log.mkdir()
    env = dict(os.environ, KT_GPU_CHECK_NO_DEBUGGER="1")
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "gpu_check_pytest.py"),
            str(log),
            str(tests / "test_crashy.py"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert p.returncode == 1, p.stdout + p.stderr
    assert "1 crashed, 1 failed, 2 passed" in p.stdout, p.stdout
    assert "CRASHED" in p.stdout and "test_c" in p.stdout
    assert "FAILED" in p.stdout and "boom" in p.stdout
    events = (log / "test_events.log").read_text()
    assert "DONE passed" in events and "test_d" in events
