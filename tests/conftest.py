"""Shared fixtures: ISA paths (with a ruy-style coverage check), thread-count hygiene.

* ``isa``: parametrized over ``kt_ops.supported_isas()`` (every path built into
  the extension that this CPU can run); activates the path for the test and
  restores the previous one. Each use is recorded.
* ``run_on_isa``: for tests that compare paths against each other; runs a
  callable on a named path and records it.
* At the end of the session the terminal summary lists which paths ran (and the
  kernels each format resolved to on them, ``kt_ops._C.kernel_names``), and
  ``test_every_supported_isa_was_exercised`` (in test_moe_forward.py, moved to
  the end of the run) FAILS when the CPU supports a path that no test used: a
  new ISA tier cannot ship untested just because nobody added it to a list.
  The report also names the oneDNN ISA class that ran (tests/onednn_isa.py).
* Every test leaves the process-wide thread count and ISA path as it found them
  (autouse ``_restore_runtime``).

Tolerances and the reference live in reference.py (one place for every test file).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional, TypeVar

import onednn_isa
import pytest
from reference import single_threaded_torch

import kt_ops

R = TypeVar("R")

#: ISA path -> number of tests (or comparisons) that ran on it this session.
EXERCISED_ISAS: collections.Counter[str] = collections.Counter()

#: Marker of the coverage test, which the collection hook moves to the end.
ISA_COVERAGE_MARK = "isa_coverage"

TESTS_DIR = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{ISA_COVERAGE_MARK}: checks that every supported ISA path was exercised"
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session: pytest.Session, config, items: list) -> None:
    # The coverage check must run after every test that could exercise a path.
    last = [it for it in items if it.get_closest_marker(ISA_COVERAGE_MARK)]
    rest = [it for it in items if not it.get_closest_marker(ISA_COVERAGE_MARK)]
    items[:] = rest + last


def record_isa(name: str) -> None:
    EXERCISED_ISAS[name] += 1


@pytest.fixture(params=kt_ops.supported_isas())
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on one ISA path (every supported one, in turn), then restore."""
    name = request.param
    with kt_ops.use_isa(name):
        assert kt_ops.active_isa() == name
        record_isa(name)
        yield name


@pytest.fixture
def run_on_isa() -> Callable[[str, Callable[[], R]], R]:
    """``run_on_isa(name, fn)``: call ``fn()`` with ISA path ``name`` active, and record it."""

    def run(name: str, fn: Callable[[], R]) -> R:
        with kt_ops.use_isa(name):
            record_isa(name)
            return fn()

    return run


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """ATen on one intra-op thread for the test (tiny tensors: OpenMP wake-ups on a busy
    2-core machine cost more than the ops). Files opt in with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``; the kt_ops
    thread pool, and its thread-count tests, are separate."""
    with single_threaded_torch():
        yield


@pytest.fixture(autouse=True)
def _restore_runtime() -> Iterator[None]:
    """Every ``kt_ops.config`` knob a test changed is set back after it."""
    before = kt_ops.config.as_dict()
    yield
    after = kt_ops.config.as_dict()
    for name, value in before.items():
        if after[name] != value:
            setattr(kt_ops.config, name, value)


@pytest.fixture
def python_subprocess() -> Callable[..., subprocess.CompletedProcess]:
    """``python_subprocess(code, env={...})``: run ``code`` in a fresh interpreter.

    For settings read once per process (``KT_OPS_ISA``, ``KT_OPS_NUM_THREADS``,
    ``KT_OPS_HWLOC_SYNTHETIC``, malloc poisoning). Inherited ``KT_OPS_*``
    variables are dropped so only ``env`` applies; the working directory is
    tests/ so ``import reference`` works. Returns the CompletedProcess (text).
    """

    def run(
        code: str, env: Optional[dict[str, str]] = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KT_OPS_")}
        full_env.update(env or {})
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=TESTS_DIR,
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


@pytest.fixture
def exercised_isas() -> collections.Counter[str]:
    """The session's record: ISA path -> number of uses so far."""
    return EXERCISED_ISAS


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    supported = kt_ops.supported_isas()
    built = kt_ops.info()["built_isas"]
    ran = ", ".join(f"{k} ({EXERCISED_ISAS[k]})" for k in supported if EXERCISED_ISAS[k])
    lines = [
        f"built: {', '.join(built)}; supported by this CPU: {', '.join(supported)}",
        f"exercised (uses): {ran or 'none'}",
    ]
    missing = [k for k in supported if not EXERCISED_ISAS[k]]
    if missing and EXERCISED_ISAS:
        lines.append(f"NOT exercised although supported: {', '.join(missing)}")
    unrunnable = [k for k in built if k not in supported]
    if unrunnable:
        lines.append(f"built but not runnable on this CPU (untested here): {', '.join(unrunnable)}")
    lines += kernel_lines([k for k in supported if EXERCISED_ISAS[k]])
    # The class oneDNN's brgemm ran (its verbose header): which bit-identity checks held.
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "unset")
    lines.append(
        f"oneDNN ISA: {onednn_isa.onednn_isa()} ({onednn_isa.onednn_isa_description()}); "
        f"ONEDNN_MAX_CPU_ISA={cap}"
    )
    terminalreporter.write_sep("-", "kt_ops ISA paths")
    for line in lines:
        terminalreporter.write_line(line)


def kernel_lines(isas: list[str]) -> list[str]:
    """Per exercised ISA path, the kernels its tests ran for each format (``_C.kernel_names``).

    Formats that resolve to the same kernels share a line, e.g.
    ``avx2: int8, int4, ... -> avx2/qint_q8 + avx2/qint_fp32``.
    """
    lines = []
    for name in isas:
        groups: dict[tuple, list[str]] = {}
        for fmt, (own, fp32) in kt_ops._C.kernel_names(name).items():
            groups.setdefault((own, fp32), []).append(fmt)
        parts = [
            f"{', '.join(fmts)} -> {own}" + (f" + {fp32}" if fp32 else "")
            for (own, fp32), fmts in groups.items()
        ]
        lines.append(f"kernels on {name}: " + "; ".join(parts))
    return lines
