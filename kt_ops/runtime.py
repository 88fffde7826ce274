"""Runtime controls: thread count, ISA path, topology report.

The thread pool is process-wide, one worker per physical core (from hwloc),
bound to its core, reused across calls; the calling thread does its share.
``KT_OPS_NUM_THREADS`` sets its initial size and ``KT_OPS_ISA`` (``ref``,
``avx2``, ``avx512``) forces an ISA path at start-up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kt_ops import _C


def set_num_threads(n: int) -> None:
    """Resize the kt_ops thread pool to ``n`` threads (the caller included).

    Raises ``ValueError`` when ``n < 1``. Results are bit-identical for any ``n``.
    """
    _C.set_num_threads(int(n))


def get_num_threads() -> int:
    """Number of threads (the calling thread included) that run kt_ops kernels."""
    return _C.get_num_threads()


def supported_isas() -> list[str]:
    """ISA paths built into this extension that this CPU can run, lowest first."""
    return list(_C.supported_isas())


def active_isa() -> str:
    """The ISA path the ops use now: ``'ref'``, ``'avx2'`` or ``'avx512'``."""
    return _C.active_isa()


def set_isa(name: str) -> None:
    """Force an ISA path (``'ref'``, ``'avx2'``, ``'avx512'``) for later op calls.

    Raises ``ValueError`` naming the path and the missing CPU feature when the
    path is unknown, not built, or not runnable on this CPU.
    """
    _C.set_isa(str(name))


@contextlib.contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Context manager: run the ops on ISA path ``name``, then restore the previous one."""
    previous = active_isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(previous)


def info() -> dict:
    """Report the detected topology, CPU features, thread count and ISA paths.

    Returns a dict (also printed by ``python -m kt_ops.info``) with keys
    ``topology`` (cores, NUMA nodes, PUs, source), ``cpu_features``,
    ``num_threads``, ``workers_bound``, ``built_isas``, ``supported_isas``,
    ``active_isa``.
    """
    return {
        "topology": _C.topology(),
        "cpu_features": _C.cpu_features(),
        "num_threads": _C.get_num_threads(),
        "workers_bound": _C.workers_bound(),
        "built_isas": list(_C.built_isas()),
        "supported_isas": list(_C.supported_isas()),
        "active_isa": _C.active_isa(),
    }


def print_info() -> None:
    """Print the detected topology, CPU features, ISA paths and thread count."""
    from kt_ops.info import format_info

    print(format_info(info()))
