"""Runtime controls: info(), thread count, ISA selection, hwloc topology, env overrides.

Settings read once per process (KT_OPS_ISA, KT_OPS_NUM_THREADS,
KT_OPS_HWLOC_SYNTHETIC) are tested in fresh interpreters (``python_subprocess``).
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from reference import (
    assert_matches_reference,
    make_expert_weights,
    make_hidden,
    make_routing,
    reference_moe_forward,
)

import kt_ops

ALL_ISAS = ("ref", "avx2", "avx512", "avx512_vnni")


def small_call(T: int = 9, seed: int = 0):
    w = make_expert_weights(6, 40, 24, seed=seed)
    ids, weights = make_routing(T, 6, 2, seed=seed)
    x = make_hidden(T, 40, torch.float32, seed=seed)
    return (x, ids, weights, w)


# --------------------------------------------------------------------------
# info()
# --------------------------------------------------------------------------


def test_info_contents():
    info = kt_ops.info()
    assert set(info) >= {
        "topology",
        "cpu_features",
        "num_threads",
        "workers_bound",
        "built_isas",
        "supported_isas",
        "active_isa",
    }
    topo = info["topology"]
    assert topo["num_numa_nodes"] >= 1
    assert topo["num_cores"] == len(topo["cores"]) >= 1
    assert topo["num_pus"] >= topo["num_cores"]
    assert isinstance(topo["source"], str) and topo["source"]
    for core in topo["cores"]:
        assert 0 <= core["numa_node"] < topo["num_numa_nodes"]
        assert isinstance(core["pus"], list)
    assert set(info["cpu_features"]) >= {"avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"}
    assert all(isinstance(v, bool) for v in info["cpu_features"].values())
    assert isinstance(info["workers_bound"], bool)
    assert info["num_threads"] == kt_ops.get_num_threads() >= 1
    assert info["active_isa"] == kt_ops.active_isa()


def test_isa_lists_are_consistent():
    info = kt_ops.info()
    built, supported = info["built_isas"], info["supported_isas"]
    assert supported == kt_ops.supported_isas()
    assert set(built) <= set(ALL_ISAS)
    assert "ref" in built and "ref" in supported  # the path of last resort always exists
    assert [i for i in built if i in supported] == supported  # a subset, same (lowest-first) order
    assert info["active_isa"] in supported
    # A built path is supported exactly when the CPU has its features.
    features = info["cpu_features"]
    needs = {
        "avx2": features["avx2"],
        "avx512": features["avx512"],
        "avx512_vnni": features["avx512"] and features["avx512_vnni"],
    }
    for name in built:
        if name in needs:
            assert (name in supported) == needs[name], (name, features)
    # AVX-512 implies AVX2 on every x86 CPU; the feature flags must agree.
    if features["avx512"]:
        assert features["avx2"]
    if features["avx512_vnni"] or features["avx512_bf16"]:
        assert features["avx512"]


def test_python_m_kt_ops_info_prints_the_report_without_warnings():
    """``python -m kt_ops info`` (the docs' command) prints the active ISA and exits 0,
    with nothing on stderr (``python -m kt_ops.info`` draws runpy's RuntimeWarning:
    the package imports that module for its ``info()`` function)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_OPS_")}
    proc = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "kt_ops", "info"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert f"ISA active     : {kt_ops.active_isa()}" in proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "kt_ops", "nonsense"], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "invalid choice: 'nonsense'" in bad.stderr


def test_default_isa_is_the_best_supported(python_subprocess):
    proc = python_subprocess("import kt_ops, json; print(json.dumps(kt_ops.info()))")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert info["active_isa"] == info["supported_isas"][-1]


# --------------------------------------------------------------------------
# Thread count
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_set_num_threads(n):
    args = small_call()
    before = kt_ops.moe_forward(*args)
    kt_ops.set_num_threads(n)
    assert kt_ops.get_num_threads() == n
    assert kt_ops.info()["num_threads"] == n
    if n == 1:
        assert kt_ops.info()["workers_bound"] is False  # no workers to bind
    assert torch.equal(kt_ops.moe_forward(*args), before)


def test_set_num_threads_takes_integers_only():
    import numpy as np

    n = kt_ops.get_num_threads()
    try:
        for bad in (2.7, "2", True, None):
            with pytest.raises(ValueError, match="n must be an int"):
                kt_ops.set_num_threads(bad)
            assert kt_ops.get_num_threads() == n
        kt_ops.set_num_threads(np.int64(1))  # integer scalars are ints
        assert kt_ops.get_num_threads() == 1
    finally:
        kt_ops.set_num_threads(n)


def test_set_num_threads_repeatedly():
    args = small_call(T=40)
    want = kt_ops.moe_forward(*args)
    for n in (3, 1, 2, 2, 4, 1):
        kt_ops.set_num_threads(n)
        assert torch.equal(kt_ops.moe_forward(*args), want)


def test_workers_bound_on_this_machine():
    # Workers are bound to cores when there are no more threads than cores
    # (binding can legitimately fail in restricted containers: report, not fail).
    topo = kt_ops.info()["topology"]
    kt_ops.set_num_threads(min(2, topo["num_cores"]))
    if kt_ops.get_num_threads() > 1 and not kt_ops.info()["workers_bound"]:
        pytest.skip("hwloc could not bind worker threads here")


def _worker_pus() -> set[int]:
    """OS PU indices of the cores the pool's workers are bound to (one node: cores 1..n-1)."""
    cores = kt_ops.info()["topology"]["cores"]
    n = kt_ops.get_num_threads()
    return {pu for i in range(1, n) for pu in cores[i % len(cores)]["pus"]}


def test_pool_moves_a_caller_off_a_workers_core():
    # The OS may run an unbound calling thread on a core a bound worker holds;
    # that worker could then not run until the caller's time slice ends. For
    # the job the caller is moved to its home (here: the core no worker holds),
    # then its mask restored.
    topo = kt_ops.info()["topology"]
    if topo["num_cores"] < 2 or topo["num_numa_nodes"] != 1 or not sys.platform.startswith("linux"):
        pytest.skip("needs Linux and two cores on one NUMA node")
    sched_getcpu = ctypes.CDLL(None).sched_getcpu
    kt_ops.set_num_threads(2)
    if not kt_ops.info()["workers_bound"]:
        pytest.skip("hwloc could not bind worker threads here")
    original = os.sched_getaffinity(0)
    workers = _worker_pus()
    if not workers <= original or not original - workers:
        pytest.skip("this thread's CPU mask does not span the caller's and the workers' cores")
    with kt_ops.use_parallel_backend("pool"):
        try:
            # Onto the worker's core, then unbound again: the thread stays where it is.
            os.sched_setaffinity(0, workers)
            os.sched_setaffinity(0, original)
            assert sched_getcpu() in workers
            moves = kt_ops.info()["parallel"]["caller_moves"]
            out = kt_ops._C._testing.parallel_probe_cpus(12, 1000)
            assert kt_ops.info()["parallel"]["caller_moves"] == moves + 1
            assert os.sched_getaffinity(0) == original  # restored after the job
            caller_cpus = {cpu for thread, cpu in out if thread == 0}
            assert caller_cpus and caller_cpus.isdisjoint(workers)
            assert {thread for thread, _ in out} == {0, 1}  # the worker ran its share
            # A caller pinned to the workers' cores only is left there.
            os.sched_setaffinity(0, workers)
            out = kt_ops._C._testing.parallel_probe_cpus(4, 200)
            assert kt_ops.info()["parallel"]["caller_moves"] == moves + 1
            assert {cpu for thread, cpu in out if thread == 0} <= workers
            assert os.sched_getaffinity(0) == workers
        finally:
            os.sched_setaffinity(0, original)


H_, W_, O_ = 2, 1, 0  # detail::PuRole: home, worker, other


@pytest.mark.parametrize(
    ("cpu", "mask", "roles", "want"),
    [
        # One node, 4 cores, workers on cores 1-3: home is core 0.
        (0, [0, 1, 2, 3], [H_, W_, W_, W_], []),  # home: stays (no syscall)
        (2, [0, 1, 2, 3], [H_, W_, W_, W_], [0]),  # on a worker's core: home
        (2, [1, 2], [H_, W_, W_, W_], []),  # pinned to workers' cores only: left there
        (2, [2, 3, 9], [H_, W_, W_, W_], [9]),  # no home in its mask: off the workers' PUs
        (9, [0, 9], [H_, W_, W_, W_], [0]),  # a PU past the roles is "other": home
        # NUMA placement over 2 nodes (PUs 0-3 node 0, 4-7 node 1), 4 threads: workers
        # on PUs 4, 1, 5; the caller computes node 0's part: home = node 0's free PUs.
        (6, list(range(8)), [H_, W_, H_, H_, W_, W_, O_, O_], [0, 2, 3]),  # other node: home
        (6, [4, 5, 6, 7], [H_, W_, H_, H_, W_, W_, O_, O_], []),  # confined to node 1: stays
        (4, [4, 5, 6, 7], [H_, W_, H_, H_, W_, W_, O_, O_], [6, 7]),  # off node 1's workers
        (3, list(range(8)), [H_, W_, H_, H_, W_, W_, O_, O_], []),
        # More threads than cores: every PU a worker's, no home.
        (0, [0, 1], [W_, W_], []),
    ],
)
def test_caller_target(cpu, mask, roles, want):
    assert kt_ops._C._testing.caller_target(cpu, mask, roles) == want


# --------------------------------------------------------------------------
# ISA selection
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", kt_ops.supported_isas())
def test_set_isa(name):
    kt_ops.set_isa(name)
    assert kt_ops.active_isa() == name
    assert kt_ops.info()["active_isa"] == name


def test_use_isa_restores_on_exception():
    before = kt_ops.active_isa()
    with pytest.raises(KeyError):
        with kt_ops.use_isa("ref"):
            assert kt_ops.active_isa() == "ref"
            raise KeyError("boom")
    assert kt_ops.active_isa() == before


def test_use_isa_nested():
    before = kt_ops.active_isa()
    supported = kt_ops.supported_isas()
    with kt_ops.use_isa(supported[0]):
        with kt_ops.use_isa(supported[-1]):
            assert kt_ops.active_isa() == supported[-1]
        assert kt_ops.active_isa() == supported[0]
    assert kt_ops.active_isa() == before


@pytest.mark.parametrize("name", kt_ops.supported_isas())
def test_env_isa_selects_path(python_subprocess, name):
    code = """
import json, kt_ops
from reference import *
x, ids, wt = make_hidden(5, 40), *make_routing(5, 6, 2)
w = make_expert_weights(6, 40, 24)
out = kt_ops.moe_forward(x, ids, wt, w)
print(json.dumps({"active": kt_ops.active_isa(), "info": kt_ops.info()["active_isa"],
                  "err": mismatch_report(out, reference_moe_forward(x, ids, wt, w))}))
"""
    proc = python_subprocess(code, env={"KT_OPS_ISA": name})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"active": name, "info": name, "err": None}


# --------------------------------------------------------------------------
# Environment: thread count, synthetic topology
# --------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["1", "3"])
def test_env_num_threads(python_subprocess, value):
    code = (
        "import json, kt_ops; i = kt_ops.info(); "
        "print(json.dumps([i['num_threads'], i['workers_bound']]))"
    )
    proc = python_subprocess(code, env={"KT_OPS_NUM_THREADS": value})
    assert proc.returncode == 0, proc.stderr
    num_threads, bound = json.loads(proc.stdout.strip().splitlines()[-1])
    assert num_threads == int(value)
    if num_threads == 1:
        assert bound is False


_SYNTHETIC_SCRIPT = r"""
import json, torch, kt_ops
from test_runtime import small_call
info = kt_ops.info()
outs = {}
for isa in kt_ops.supported_isas():
    with kt_ops.use_isa(isa):
        outs[isa] = kt_ops.moe_forward(*small_call(T=33))
torch.save(outs, OUT_PATH)
print(json.dumps(info))
"""


def test_synthetic_two_node_topology(python_subprocess, tmp_path):
    out_path = tmp_path / "synthetic_outputs.pt"
    code = _SYNTHETIC_SCRIPT.replace("OUT_PATH", repr(str(out_path)))
    proc = python_subprocess(code, env={"KT_OPS_HWLOC_SYNTHETIC": "node:2 core:2 pu:1"})
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    topo = info["topology"]
    assert topo["num_numa_nodes"] == 2
    assert topo["num_cores"] == 4 and topo["num_pus"] == 4
    assert topo["source"].startswith("synthetic")
    assert [c["numa_node"] for c in topo["cores"]] == [0, 0, 1, 1]
    assert info["num_threads"] == 4  # one per (synthetic) core by default
    assert info["workers_bound"] is False  # a synthetic topology has no real cores to bind to
    # Same results as this process (different thread count and topology): bit-identical.
    theirs = torch.load(out_path)
    assert set(theirs) == set(kt_ops.supported_isas())
    args = small_call(T=33)
    for isa, out in theirs.items():
        with kt_ops.use_isa(isa):
            assert torch.equal(out, kt_ops.moe_forward(*args)), isa


# --------------------------------------------------------------------------
# Concurrency and fork
# --------------------------------------------------------------------------


def test_concurrent_calls_from_python_threads():
    # Serving engines call from several threads: per-caller scratch, one pool.
    calls = [small_call(T=T, seed=T) for T in (1, 7, 30, 64)]
    want = [kt_ops.moe_forward(*c) for c in calls]
    errors: list[str] = []

    def worker(offset: int) -> None:
        try:
            for i in range(12):
                j = (i + offset) % len(calls)
                if not torch.equal(kt_ops.moe_forward(*calls[j]), want[j]):
                    errors.append(f"thread {offset}, call {j}: result differs")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a calling thread hung"
    assert not errors, errors


def test_op_works_in_forked_child(python_subprocess):
    code = """
import os, torch, kt_ops
from test_runtime import small_call
args = small_call(T=20)
# The pool's workers, or torch's OpenMP threads (the 'auto' parallel backend),
# exist before the fork. torch's OpenMP threads do not survive it (a parallel
# region in the child would wait for them forever): the child keeps the pool.
want = kt_ops.moe_forward(*args)
pid = os.fork()
if pid == 0:
    ok = torch.equal(kt_ops.moe_forward(*args), want) and kt_ops.get_num_threads() >= 1
    report = kt_ops.info()["parallel"]
    if torch.backends.openmp.is_available():
        ok = ok and report["uses"] == "pool" and "fork" in report["reason"]
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""
    proc = python_subprocess(code, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "child exit 0", proc.stdout


def test_reference_agrees_after_thread_changes():
    # The runtime knobs never change the numbers beyond the documented tolerance.
    args = small_call(T=50)
    ref = reference_moe_forward(*args)
    for n in (1, 2):
        kt_ops.set_num_threads(n)
        assert_matches_reference(kt_ops.moe_forward(*args), ref)


def test_resizing_the_pool_never_hangs_or_miscounts(python_subprocess):
    # Regression: workers started by set_num_threads once took the generation
    # bump of stop_workers() for a job and decremented the busy count for a job
    # they never joined; a later call then waited forever (or returned early).
    code = """
import torch, kt_ops
from test_runtime import small_call
args = small_call(T=40)
want = kt_ops.moe_forward(*args)
for i in range(300):
    kt_ops.set_num_threads(1 + i % 8)  # up to 4x oversubscribed: workers get preempted
    for _ in range(3):
        assert torch.equal(kt_ops.moe_forward(*args), want), i
print("ok")
"""
    proc = python_subprocess(code, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_runtime_all_lists_its_public_api_with_docstrings():
    # kt_ops.runtime's __all__ is its public API: every public function and class defined
    # there, each documented, and each re-exported by kt_ops.
    import inspect

    import kt_ops.runtime as runtime

    defined = {
        name
        for name, obj in vars(runtime).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == runtime.__name__
    }
    assert defined | {"config"} == set(runtime.__all__)
    for name in runtime.__all__:
        assert name == "config" or inspect.getdoc(getattr(runtime, name)), name
        assert name == "memory_nodes" or name in kt_ops.__all__, name


def test_aligned_scratch_starts_a_cache_line():
    """runtime::AlignedVector (the scratch kernels read as vectors: the LoRA backward's
    operands and weight panels, the forward's activation rows) starts on a 64-byte line at
    every size, small (malloc's 16-byte-aligned heap) and large (glibc's mmap'd blocks, 16
    bytes into a page): a base at 16 mod 32 had split every other 32-byte load in two."""
    sizes = [0, 1, 3, 4, 17, 1000, 1 << 16, 1 << 20, (1 << 22) + 5]
    assert kt_ops._C._testing.aligned_vector_offsets(sizes) == [0] * len(sizes)
    with pytest.raises(ValueError, match="sizes"):
        kt_ops._C._testing.aligned_vector_offsets([-1])


def test_fma_peak_gflops():
    """The benchmarks' fp32 ceiling (benchmarks/machine_peaks.py): independent FMA chains on
    every pool thread. A rate, not a timing test: positive and finite, within what 256-bit
    FMAs can do (2 pipes x 16 FLOPs a cycle, at most 8 GHz, per thread), and arguments
    checked."""
    hook = kt_ops._C._testing.fma_peak_gflops
    if "avx2" not in kt_ops.supported_isas():
        with pytest.raises(ValueError, match="AVX2"):
            hook(0.05)
        return
    rate = hook(0.05)
    assert 0 < rate < 2 * 16 * 8 * kt_ops.get_num_threads()
    for bad in (0.0, -1.0, 61.0, float("nan")):
        with pytest.raises(ValueError, match="seconds"):
            hook(bad)
