"""Thread-pool limits and races (issue #13, items 4 and 5).

* Item 5: ``set_num_threads`` and ``KT_OPS_NUM_THREADS`` are capped at
  ``max(4 x physical cores, 64)`` with a ValueError naming the argument and
  the cap; when the OS refuses a thread the pool goes back to its previous
  size, raises RuntimeError, and ``get_num_threads()`` matches the threads
  that exist.
* Item 4: ``tests/cpp/thread_pool_stress.cpp`` under ThreadSanitizer (run()
  and parallel_for() hammered while another thread resizes the pool): no
  report. Skipped when g++ or libtsan is missing; ``scripts/sanitize.sh tsan``
  runs it longer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kt_ops

ROOT = Path(__file__).resolve().parents[1]


def thread_cap() -> int:
    return max(64, 4 * kt_ops.info()["topology"]["num_cores"])


@pytest.mark.parametrize("n", [2**31 - 1, 2**31, 2**40, 2**70])
def test_set_num_threads_is_capped(n):
    before = kt_ops.get_num_threads()
    cap = thread_cap()
    with pytest.raises(ValueError, match=r"set_num_threads.*n must be in \[1, "):
        kt_ops.set_num_threads(n)
    if n < 2**63:
        with pytest.raises(ValueError, match=rf"\[1, {cap}\], got {n}"):
            kt_ops.set_num_threads(n)
    assert kt_ops.get_num_threads() == before


def test_cap_itself_is_allowed():
    cap = thread_cap()
    with pytest.raises(ValueError, match=rf"got {cap + 1}"):
        kt_ops.set_num_threads(cap + 1)
    kt_ops.set_num_threads(cap)
    assert kt_ops.get_num_threads() == cap
    kt_ops.set_num_threads(2)
    assert kt_ops.get_num_threads() == 2


def test_env_num_threads_is_capped(python_subprocess):
    cap = thread_cap()
    code = "import kt_ops; kt_ops.get_num_threads()"
    proc = python_subprocess(code, env={"KT_OPS_NUM_THREADS": str(cap + 1)})
    assert proc.returncode != 0
    assert f"KT_OPS_NUM_THREADS='{cap + 1}' must be an integer in [1, {cap}]" in proc.stderr
    proc = python_subprocess(
        "import kt_ops; print(kt_ops.get_num_threads())", env={"KT_OPS_NUM_THREADS": str(cap)}
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(cap)


_THREAD_LIMIT_SCRIPT = r"""
import os, resource, torch, kt_ops
from test_runtime import small_call

def os_threads():
    return len(os.listdir("/proc/self/task"))

args = small_call(T=16)
want = kt_ops.moe_forward(*args)
kt_ops.set_num_threads(2)
base = os_threads()
# Room for a few more thread stacks (8 MiB each), not for the cap's worth.
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))
cap = max(64, 4 * kt_ops.info()["topology"]["num_cores"])
try:
    kt_ops.set_num_threads(cap)
except RuntimeError as e:
    print("error:", e)
else:
    print("no error")
print("threads", kt_ops.get_num_threads(), os_threads() - base)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
assert torch.equal(kt_ops.moe_forward(*args), want)
kt_ops.set_num_threads(3)
assert kt_ops.get_num_threads() == 3 and os_threads() - base == 1
assert torch.equal(kt_ops.moe_forward(*args), want)
print("ok")
"""


@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""),
    reason="ASan reserves terabytes of address space: RLIMIT_AS cannot model a thread limit",
)
def test_thread_creation_failure_leaves_a_consistent_pool(python_subprocess):
    proc = python_subprocess(_THREAD_LIMIT_SCRIPT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "ok", proc.stdout
    err = next(line for line in lines if line.startswith(("error:", "no error")))
    assert err.startswith("error: kt_ops.set_num_threads("), err
    assert "could start only" in err and "the pool keeps 2 thread(s)" in err, err
    threads = next(line for line in lines if line.startswith("threads"))
    assert threads == "threads 2 0", threads  # back to 2 threads, the same OS threads


_FIRST_USE_LIMIT_SCRIPT = r"""
import os, resource, torch
# Before kt_ops starts its pool: room for a few thread stacks, not for KT_OPS_NUM_THREADS.
import kt_ops._C  # noqa: loads the library (no pool yet)
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (48 << 20), resource.RLIM_INFINITY))
import kt_ops
print("threads", kt_ops.get_num_threads())
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
from test_runtime import small_call
args = small_call(T=8)
out = kt_ops.moe_forward(*args)
kt_ops.set_num_threads(2)
assert torch.equal(kt_ops.moe_forward(*args), out)
print("ok")
"""


@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""),
    reason="ASan reserves terabytes of address space: RLIMIT_AS cannot model a thread limit",
)
def test_pool_that_cannot_start_falls_back_to_one_thread(python_subprocess):
    cap = max(64, 4 * kt_ops.info()["topology"]["num_cores"])
    proc = python_subprocess(
        _FIRST_USE_LIMIT_SCRIPT, env={"KT_OPS_NUM_THREADS": str(cap)}, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "ok" and "threads 1" in lines, proc.stdout
    assert "could start only" in proc.stderr and "running on 1 thread" in proc.stderr


def _tsan_available() -> bool:
    cxx = shutil.which("g++")
    if cxx is None or shutil.which("pkg-config") is None:
        return False
    probe = subprocess.run(
        [cxx, "-print-file-name=libtsan.so"], capture_output=True, text=True, check=False
    )
    return os.path.isabs(probe.stdout.strip())


@pytest.mark.skipif(not _tsan_available(), reason="needs g++ with libtsan and pkg-config")
def test_thread_pool_under_thread_sanitizer(tmp_path):
    exe = tmp_path / "thread_pool_stress"
    hwloc = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "hwloc"], capture_output=True, text=True, check=True
    ).stdout.split()
    build = subprocess.run(
        [
            "g++",
            "-std=c++17",
            "-O1",
            "-g",
            "-fsanitize=thread",
            f"-I{ROOT / 'csrc'}",
            str(ROOT / "tests/cpp/thread_pool_stress.cpp"),
            str(ROOT / "csrc/runtime/thread_pool.cpp"),
            str(ROOT / "csrc/runtime/openmp_team.cpp"),
            str(ROOT / "csrc/runtime/topology.cpp"),
            str(ROOT / "csrc/runtime/numa.cpp"),
            *hwloc,
            "-pthread",
            "-ldl",
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, build.stderr
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["TSAN_OPTIONS"] = "halt_on_error=1 exitcode=66"
    env.pop("KT_OPS_NUM_THREADS", None)
    run = subprocess.run(
        [str(exe), "1.5"], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert "ThreadSanitizer" not in run.stderr, run.stderr[-4000:]
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.strip().endswith("ok"), run.stdout


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
