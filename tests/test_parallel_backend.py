"""kt_ops.set_parallel_backend: kt_ops' parallel work on its own pool or on torch's OpenMP threads.

The 'openmp' backend (csrc/runtime/openmp_team.cpp) runs the pool's jobs on a
team of the OpenMP runtime that libtorch_cpu uses, looked up at run time. These
tests check which threads a job really runs on (a probe task asks the OpenMP
runtime whether it runs inside a parallel region), when 'auto' picks which
backend, the fallbacks (NUMA split, one thread, the CUDA bridge's host
callbacks; a forked child: tests/test_runtime.py), errors inside a team, and
that every backend and thread count gives bit-identical outputs.
"""

from __future__ import annotations

import pytest
import torch
from reference import make_hidden, make_routing

import kt_ops
from kt_ops import _C
from kt_ops.nn import MoEExperts

OPENMP = torch.backends.openmp.is_available()
needs_openmp = pytest.mark.skipif(not OPENMP, reason="this torch has no OpenMP runtime")

E, H, I = 8, 96, 160  # noqa: E741


@pytest.fixture(autouse=True)
def _restore_backend():
    before, torch_threads = kt_ops.get_parallel_backend(), torch.get_num_threads()
    yield
    kt_ops.set_parallel_backend(before)
    torch.set_num_threads(torch_threads)


def _probe(tasks: int = 64) -> tuple[set[int], set[bool]]:
    """(thread indices, in-OpenMP flags) seen by the tasks of one pool job."""
    out = _C._testing.parallel_probe(tasks, -1)
    assert len(out) == tasks
    return {t for t, _ in out}, {o for _, o in out}


def _matched_threads() -> int:
    """kt_ops and torch on the same thread count (2 here), as 'auto' wants."""
    n = max(2, torch.get_num_threads())
    kt_ops.set_num_threads(n)
    torch.set_num_threads(n)
    return n


# --------------------------------------------------------------------------
# Which threads run a job
# --------------------------------------------------------------------------


@needs_openmp
def test_openmp_runtime_is_torchs():
    report = kt_ops.info()["parallel"]
    assert report["openmp_runtime"], report
    # The runtime libtorch_cpu is linked against (torch/lib/libgomp*.so.1 in a
    # pip wheel), not a second copy.
    assert "omp" in report["openmp_runtime"]
    assert report["openmp_max_threads"] == torch.get_num_threads()


@needs_openmp
def test_auto_runs_on_openmp_when_thread_counts_match():
    n = _matched_threads()
    kt_ops.set_parallel_backend("auto")
    report = kt_ops.info()["parallel"]
    assert (report["setting"], report["uses"]) == ("auto", "openmp"), report
    threads, in_openmp = _probe()
    assert in_openmp == {True}
    assert threads <= set(range(n))


@needs_openmp
def test_auto_keeps_the_pool_when_thread_counts_differ():
    torch.set_num_threads(2)
    kt_ops.set_num_threads(3)
    kt_ops.set_parallel_backend("auto")
    report = kt_ops.info()["parallel"]
    assert report["uses"] == "pool"
    assert "2 threads, kt_ops 3" in report["reason"], report
    threads, in_openmp = _probe()
    assert in_openmp == {False}
    assert threads <= {0, 1, 2}
    torch.set_num_threads(3)  # now they match
    assert kt_ops.info()["parallel"]["uses"] == "openmp"
    assert _probe()[1] == {True}


@needs_openmp
def test_forced_openmp_takes_kt_ops_thread_count():
    torch.set_num_threads(2)
    kt_ops.set_num_threads(3)
    kt_ops.set_parallel_backend("openmp")
    assert kt_ops.info()["parallel"]["uses"] == "openmp"
    threads, in_openmp = _probe(256)
    assert in_openmp == {True}
    assert threads <= {0, 1, 2}


def test_forced_pool_never_uses_openmp():
    _matched_threads()
    kt_ops.set_parallel_backend("pool")
    report = kt_ops.info()["parallel"]
    assert (report["uses"], report["reason"]) == ("pool", "set to 'pool'")
    assert _probe()[1] == {False}


@needs_openmp
def test_one_thread_runs_inline():
    kt_ops.set_num_threads(1)
    kt_ops.set_parallel_backend("openmp")
    assert kt_ops.info()["parallel"]["uses"] == "pool"
    assert _probe() == ({0}, {False})


@needs_openmp
@pytest.mark.parametrize("backend", ["pool", "openmp"])
def test_task_errors_reach_the_caller(backend):
    _matched_threads()
    kt_ops.set_parallel_backend(backend)
    with pytest.raises(RuntimeError, match="_testing.parallel_probe: task 5"):
        _C._testing.parallel_probe(64, 5)
    # The backend still works after the error.
    assert _probe()[1] == {backend == "openmp"}


# --------------------------------------------------------------------------
# Outputs: bit-identical on every backend and thread count
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def modules():
    g = torch.Generator().manual_seed(5)
    dense = (
        torch.randn(E, I, H, generator=g) / H**0.5,
        torch.randn(E, I, H, generator=g) / H**0.5,
        torch.randn(E, H, I, generator=g) / I**0.5,
    )
    kq = (
        torch.randn(E, 256, 256, generator=g) / 16,
        torch.randn(E, 256, 256, generator=g) / 16,
        torch.randn(E, 256, 256, generator=g) / 16,
    )
    return {
        "bf16": MoEExperts.from_dense(*dense, "bf16").eval(),
        "int8": MoEExperts.from_dense(*dense, "int8").eval(),
        "int4-g32": MoEExperts.from_dense(*dense, "int4", group_size=32).eval(),
        "q4_k": MoEExperts.from_dense(*kq, "q4_k").eval(),
    }


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4-g32", "q4_k"])
@pytest.mark.parametrize("T", [0, 1, 5, 40])
def test_outputs_bit_identical_across_backends_and_threads(modules, fmt, T):
    m = modules[fmt]
    x = make_hidden(T, m.hidden_size, torch.float32, seed=T)
    ids, w = make_routing(T, E, 3, seed=T, skip_fraction=0.1)
    backends = ["pool", "openmp"] if OPENMP else ["pool"]
    outs = {}
    with torch.no_grad():
        for backend in backends:
            kt_ops.set_parallel_backend(backend)
            for n in (1, 2, 3):
                kt_ops.set_num_threads(n)
                outs[(backend, n)] = m(x, ids, w)
    first = next(iter(outs))
    for key, out in outs.items():
        assert torch.equal(out, outs[first]), f"{key} differs from {first} bit-wise"


@needs_openmp
def test_concurrent_calls_from_python_threads_on_forced_openmp():
    # test_runtime's concurrency test (several Python threads, each its own
    # OpenMP team; kt_ops runs one job at a time) on teams of another size than
    # torch's. Under 'auto' with matched counts it already runs on OpenMP.
    from test_runtime import test_concurrent_calls_from_python_threads

    torch.set_num_threads(2)
    kt_ops.set_num_threads(3)
    kt_ops.set_parallel_backend("openmp")
    omp0 = _jobs()[0]
    test_concurrent_calls_from_python_threads()
    assert _jobs()[0] > omp0


# --------------------------------------------------------------------------
# Settings, environment, fallbacks
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["omp", "", "OpenMP", None, 1])
def test_bad_backend_names_are_rejected(bad):
    before = kt_ops.get_parallel_backend()
    with pytest.raises(ValueError, match="set_parallel_backend.*'auto', 'pool' or 'openmp'"):
        kt_ops.set_parallel_backend(bad)
    assert kt_ops.get_parallel_backend() == before


def test_use_parallel_backend_restores_on_exception():
    kt_ops.set_parallel_backend("auto")
    with pytest.raises(KeyError):
        with kt_ops.use_parallel_backend("pool"):
            assert kt_ops.get_parallel_backend() == "pool"
            raise KeyError("boom")
    assert kt_ops.get_parallel_backend() == "auto"


_ENV_SCRIPT = """
import torch, kt_ops
from test_runtime import small_call
print(kt_ops.get_parallel_backend(), kt_ops.info()["parallel"]["uses"])
"""


@pytest.mark.parametrize("value,want", [("pool", "pool pool"), ("auto", "auto openmp")])
def test_env_sets_the_initial_backend(python_subprocess, value, want):
    if not OPENMP:
        want = want.replace("openmp", "pool")
    proc = python_subprocess(_ENV_SCRIPT, env={"KT_OPS_PARALLEL_BACKEND": value})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == want.split()


def test_bad_env_is_reported_until_a_backend_is_set(python_subprocess):
    code = """
import torch, kt_ops
from test_runtime import small_call
args = small_call(T=5)
try:
    kt_ops.moe_forward(*args)
    print("no error")
except ValueError as e:
    print("error:", e)
kt_ops.set_parallel_backend("auto")
print("after set:", tuple(kt_ops.moe_forward(*args).shape))
"""
    proc = python_subprocess(code, env={"KT_OPS_PARALLEL_BACKEND": "gomp"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("error: KT_OPS_PARALLEL_BACKEND='gomp' cannot be used"), lines
    assert "'auto', 'pool' or 'openmp'" in lines[0]
    assert lines[1] == "after set: (5, 40)"


@needs_openmp
def test_numa_split_keeps_the_pool(python_subprocess):
    code = """
import torch, kt_ops
kt_ops.set_num_threads(torch.get_num_threads())
kt_ops.set_numa("off")
print(kt_ops.info()["parallel"]["uses"])
kt_ops.set_numa("on")  # the auto default with two nodes
report = kt_ops.info()["parallel"]
print(report["uses"], "NUMA" in report["reason"])
"""
    proc = python_subprocess(code, env={"KT_OPS_HWLOC_SYNTHETIC": "node:2 core:1 pu:1"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["openmp", "pool", "True"], proc.stdout


# --------------------------------------------------------------------------
# Which backend the op's jobs took (process-wide job counts)
# --------------------------------------------------------------------------


def _jobs() -> tuple[int, int]:
    jobs = kt_ops.info()["parallel"]["jobs"]
    return jobs["openmp"], jobs["pool"]


def _bridge_inputs():
    from kt_ops.layer import ExpertWeights, layer_args

    g = torch.Generator().manual_seed(6)
    experts = ExpertWeights.from_dense(
        torch.randn(E, I, H, generator=g) * 0.1,
        torch.randn(E, I, H, generator=g) * 0.1,
        torch.randn(E, H, I, generator=g) * 0.1,
        "int8",
    )
    ids, w = make_routing(40, E, 3, seed=6)
    x = make_hidden(40, H, torch.float32, seed=6)
    return experts, x, ids, w, list(layer_args(experts, None, "silu", x, None))


@needs_openmp
def test_op_jobs_run_on_the_chosen_backend():
    experts, x, ids, w, _ = _bridge_inputs()
    _matched_threads()
    kt_ops.set_parallel_backend("auto")
    omp0, pool0 = _jobs()
    want = kt_ops.moe_forward(x, ids, w, experts)
    omp1, pool1 = _jobs()
    assert omp1 > omp0 and pool1 == pool0, (omp0, pool0, omp1, pool1)
    kt_ops.set_parallel_backend("pool")
    assert torch.equal(kt_ops.moe_forward(x, ids, w, experts), want)
    omp2, pool2 = _jobs()
    assert omp2 == omp1 and pool2 > pool1


@needs_openmp
def test_cuda_bridge_host_callbacks_keep_the_pool_under_auto():
    # The bridge's host function runs on the device runtime's callback thread,
    # where torch's ops do not run: 'auto' keeps kt_ops' pool there (the host
    # transport calls it directly, on this thread, inside the same scope).
    experts, x, ids, w, args = _bridge_inputs()
    _matched_threads()
    kt_ops.set_parallel_backend("auto")
    want = kt_ops.moe_forward(x, ids, w, experts)
    omp0, pool0 = _jobs()
    got = _C._testing.HostBridge().moe_forward(x, ids, w, *args, None)
    omp1, pool1 = _jobs()
    assert torch.equal(got, want)
    assert omp1 == omp0 and pool1 > pool0, (omp0, pool0, omp1, pool1)
    kt_ops.set_parallel_backend("openmp")  # forced: the callbacks follow it too
    assert torch.equal(_C._testing.HostBridge().moe_forward(x, ids, w, *args, None), want)
    assert _jobs()[0] > omp1


# --------------------------------------------------------------------------
# A waiting caller (runtime::CallerWaitsScope: the CUDA bridge's host callbacks)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "pool"])
def test_waiting_caller_leaves_every_task_to_the_workers(backend):
    n = _matched_threads()
    kt_ops.set_parallel_backend(backend)
    out = _C._testing.parallel_probe(256, -1, caller_waits=True, pool_threads=True)
    assert len(out) == 256
    threads = {t for t, _ in out}
    assert 0 not in threads and threads <= set(range(1, n)), threads
    # The scope ends with the call: the next job's caller computes again (on a
    # busy machine the caller may lose every task to the workers, so only the
    # thread indices' range is checked).
    assert {t for t, _ in _C._testing.parallel_probe(256, -1)} <= set(range(n))


def test_waiting_caller_gets_task_errors_and_runs_inline_alone():
    _matched_threads()
    with pytest.raises(RuntimeError, match="_testing.parallel_probe: task 5"):
        _C._testing.parallel_probe(64, 5, caller_waits=True, pool_threads=True)
    kt_ops.set_num_threads(1)
    try:
        assert {t for t, _ in _C._testing.parallel_probe(16, -1, caller_waits=True)} == {0}
    finally:
        _matched_threads()
