"""Runtime controls: thread count, ISA path, topology report.

The thread pool is process-wide, one worker per physical core (from hwloc),
bound to its core, reused across calls; the calling thread does its share.
:func:`set_parallel_backend` (``KT_OPS_PARALLEL_BACKEND``) runs the work on
torch's own OpenMP threads instead, where that is the better choice.
``KT_OPS_NUM_THREADS`` sets its initial size and ``KT_OPS_ISA`` (``ref``,
``avx2``, ``avx512``) forces an ISA path at start-up. :func:`set_compute_path`
chooses between the streaming kernels and oneDNN's brgemm. :func:`set_numa`
(``KT_OPS_NUMA``) splits every expert across the NUMA nodes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Optional

from kt_ops import _C

if TYPE_CHECKING:
    from kt_ops.layer import ExpertWeights


@contextlib.contextmanager
def _scoped(get: Callable[[], str], set_: Callable[[str], None], value: str) -> Iterator[None]:
    """``set_(value)`` for the block, then ``set_`` back to what ``get()`` returned before."""
    previous = get()
    set_(value)
    try:
        yield
    finally:
        set_(previous)


def set_num_threads(n: int) -> None:
    """Resize the kt_ops thread pool to ``n`` threads (the caller included).

    ``n`` is capped at 4 x the physical cores (at least 64): more threads only
    oversubscribe the cores. Results are bit-identical for any ``n``.

    Raises:
        ValueError: ``n`` is not in ``[1, cap]`` (the message gives the cap).
        RuntimeError: the OS refused a worker thread (e.g. a pids limit); the
            pool then keeps its previous size (or one thread), which
            :func:`get_num_threads` reports.
    """
    n = int(n)
    if not -(2**63) <= n < 2**63:  # the extension checks [1, cap] and names the cap
        raise ValueError(
            f"kt_ops.set_num_threads: n must be in [1, 4 x the physical cores (at least 64)], "
            f"got {n}"
        )
    _C.set_num_threads(n)


def get_num_threads() -> int:
    """Number of threads (the calling thread included) that run kt_ops kernels."""
    return _C.get_num_threads()


_PARALLEL_BACKENDS = ("auto", "pool", "openmp")


def set_parallel_backend(backend: str) -> None:
    """Choose which threads run kt_ops' parallel work (process-wide).

    * ``'pool'``: kt_ops' own pool, one worker per physical core, bound to it.
    * ``'openmp'``: the threads of torch's own OpenMP runtime (the intra-op
      threads of torch's CPU ops), a team of :func:`get_num_threads` threads.
      After a torch CPU op those threads spin for a while (OpenMP's default
      wait policy) and take kt_ops' job at once; on the pool's threads the
      two would share every core (measured on a 2-core host: the demo's decode
      experts 8.0-8.5 ms per token on the pool, 4.1-4.9 on OpenMP).
    * ``'auto'`` (default; ``KT_OPS_PARALLEL_BACKEND`` sets the initial value):
      ``'openmp'`` when kt_ops' thread count equals torch's
      (``torch.get_num_threads()``, the calling thread's OpenMP team size),
      else ``'pool'``: one team of one size for torch and kt_ops (the OpenMP
      runtime stops and starts threads when the team size changes). The CUDA
      bridge's host callbacks (:mod:`kt_ops.hybrid`) keep the pool under
      ``'auto'``: torch's ops do not run on that thread, and a team of its own
      would spin beside the thread that launches the GPU work.

    ``'openmp'`` also falls back to the pool with NUMA placement across
    several nodes (:func:`set_numa`: the pool's threads are bound per node),
    in a process forked after the parent started OpenMP threads (they do not
    survive ``fork()``), inside an OpenMP parallel region, and on one thread.
    ``kt_ops.info()['parallel']`` says which threads a call from this thread
    uses and why. Results are bit-identical on either backend.

    Raises:
        ValueError: ``backend`` is not ``'auto'``, ``'pool'`` or ``'openmp'``,
            or ``'openmp'`` where torch has no OpenMP runtime.
    """
    if not isinstance(backend, str):
        raise ValueError(
            "kt_ops.set_parallel_backend: backend must be 'auto', 'pool' or 'openmp', "
            f"got {backend!r}"
        )
    _C.set_parallel_backend(backend)


def get_parallel_backend() -> str:
    """The setting of :func:`set_parallel_backend`: ``'auto'``, ``'pool'`` or ``'openmp'``."""
    return _C.parallel_backend()


def use_parallel_backend(backend: str) -> contextlib.AbstractContextManager[None]:
    """Context manager: :func:`set_parallel_backend` ``backend``, then restore the previous one."""
    return _scoped(get_parallel_backend, set_parallel_backend, backend)


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


def use_isa(name: str) -> contextlib.AbstractContextManager[None]:
    """Context manager: run the ops on ISA path ``name``, then restore the previous one."""
    return _scoped(active_isa, set_isa, name)


def set_quant_activations(mode: str) -> None:
    """Choose how the quantized weight formats multiply activations (process-wide).

    * ``'q8'``: the qint formats (``int8``, ``int4``, ``mxfp4``, GGUF types)
      quantize each activation row to int8 per 32 values and multiply integer
      codes (w8a8 / w4a8, ``pmaddubsw``/VNNI dot products); ``fp8`` multiplies
      its decoded codes with fp32 activations in registers.
    * ``'fp32'``: every format decodes each 16-row weight block once to fp32
      (``scale * q - zero``) and multiplies fp32 activations (weight-only,
      the w4a16 path; no activation rounding).
    * ``'auto'`` (default): per expert and call, ``'fp32'`` when the expert
      has at least the format's measured break-even token count (see
      docs/formats.md, "Compute paths"), else ``'q8'``.

    The two paths round differently (``'q8'`` rounds activations to int8), so
    under ``'auto'`` a token's output can depend on how many tokens share its
    experts; pin ``'q8'`` or ``'fp32'`` for batch-invariant results.

    Raises ``ValueError`` for any other ``mode``.
    """
    _C.set_quant_activations(str(mode))


def get_quant_activations() -> str:
    """The mode set by :func:`set_quant_activations`: ``'auto'``, ``'q8'`` or ``'fp32'``."""
    return _C.quant_activations()


def quant_fp32_min_tokens(weight_format: str, isa: Optional[str] = None) -> Optional[int]:
    """Tokens per expert from which ``'auto'`` takes the ``'fp32'`` path for ``weight_format``.

    On ISA path ``isa`` (default: the active one): the thresholds depend on
    the tier's kernels (``FormatSpec.fp32_min_tokens`` /
    ``fp32_min_tokens_vnni``). ``None`` when ``'auto'`` always takes ``'q8'``
    (4/5/6-bit formats; int8 and q8_0 on ``avx512_vnni``; ``bf16``, which has
    one path). The thresholds are measured break-evens (docs/formats.md,
    "Compute paths"). Raises ``ValueError`` for an unknown format or ISA path.
    """
    from kt_ops.formats import format_spec

    name = format_spec(str(weight_format)).name
    return _C.fp32_min_tokens(name, _C.active_isa() if isa is None else str(isa))


def use_quant_activations(mode: str) -> contextlib.AbstractContextManager[None]:
    """Context manager: :func:`set_quant_activations` ``mode``, then restore the previous one."""
    return _scoped(get_quant_activations, set_quant_activations, mode)


_COMPUTE_PATHS = ("auto", "streaming", "brgemm")


def set_compute_path(path: str) -> None:
    """Choose which kernels compute the expert products (process-wide).

    * ``'streaming'``: kt_ops' own per-ISA kernels, which stream each 16-row
      weight block once and multiply it with the expert's tokens in registers
      (decode; the only path before oneDNN's brgemm was added).
    * ``'brgemm'``: oneDNN's brgemm ukernel (through libtorch's
      ``at::native::cpublas::brgemm``) on the packed weight blocks, at any
      token count, for the formats and CPUs on which oneDNN runs the product
      (``bf16`` and ``fp8``: AVX-512 with AVX512_BF16, or AMX; ``int8`` and
      ``q8_0``: AVX512_VNNI or AMX, with q8 activations; :func:`compute_paths`
      says which); every other format and CPU keeps the streaming kernels.
      bf16 brgemm rounds the activations (and the SwiGLU outputs) to bf16
      first; fp8 multiplies the activations times the 128x128 block scales,
      rounded once to bf16 (``bf16(x * scale)``), by the exact E4M3 values
      (kt_ops' fused decode-and-multiply tiles on AVX512_BF16 CPUs with
      AVX512_VBMI and no AMX, else the codes decoded to a bf16 tile for
      oneDNN's bf16 brgemm; the two are bit-identical); the int8 / q8_0
      brgemm (u8 x s8) gives the streaming q8 kernels' results bit for bit.
    * ``'auto'`` (default): per expert and call, ``'brgemm'`` when the expert
      has at least the format's measured break-even token count on this CPU
      (``kt_ops.formats.format_spec(name).brgemm_min_tokens``;
      docs/formats.md, "Compute paths"), else ``'streaming'``. For bf16 and
      fp8 only with bf16 activations: fp32 and fp16 ones stay on
      ``'streaming'`` (brgemm would round them to bf16).

    As with :func:`set_quant_activations`, the paths round differently, so
    under ``'auto'`` a token's output can depend on how many tokens share its
    experts; pin ``'streaming'`` or ``'brgemm'`` for batch-invariant results.
    Results are bit-identical for any thread count on every path.

    Raises:
        ValueError: ``path`` is not ``'auto'``, ``'streaming'`` or ``'brgemm'``.
    """
    if not isinstance(path, str) or path not in _COMPUTE_PATHS:
        raise ValueError(
            f"kt_ops.set_compute_path: path must be 'auto', 'streaming' or 'brgemm', got {path!r}"
        )
    _C.set_compute_path(path)


def get_compute_path() -> str:
    """The path set by :func:`set_compute_path`: ``'auto'``, ``'streaming'`` or ``'brgemm'``."""
    return _C.compute_path()


def use_compute_path(path: str) -> contextlib.AbstractContextManager[None]:
    """Context manager: :func:`set_compute_path` ``path``, then restore the previous one."""
    return _scoped(get_compute_path, set_compute_path, path)


_BF16_BRGEMM_KERNELS = ("auto", "onednn", "kt")


def set_brgemm_bf16_kernel(name: str) -> None:
    """Choose the kernel of the bf16 products on the ``'brgemm'`` compute path.

    * ``'auto'`` (default): kt_ops' own vdpbf16ps tile kernel on CPUs with
      AVX512_BF16 and no AMX (it prefetches the weight stream, which a
      prefill reads from DRAM; benchmarks/README.md has the measurements),
      oneDNN's brgemm elsewhere (AMX tiles on CPUs that have them).
    * ``'onednn'``: always oneDNN's brgemm.
    * ``'kt'``: kt_ops' kernel wherever the CPU has AVX512_BF16 (AMX CPUs
      included); oneDNN's brgemm where it has not.

    Both compute the same fp32 sums in the same order (one vdpbf16ps chain
    per output over k): their results are bit-identical. For tests and
    benchmarks; ``compute_paths()['bf16']['brgemm_kernel']`` names the
    kernel that runs.

    Raises:
        ValueError: ``name`` is not ``'auto'``, ``'onednn'`` or ``'kt'``.
    """
    if name not in _BF16_BRGEMM_KERNELS:
        raise ValueError(
            f"kt_ops.set_brgemm_bf16_kernel: name must be 'auto', 'onednn' or 'kt', got {name!r}"
        )
    _C.set_brgemm_bf16_kernel(name)


def get_brgemm_bf16_kernel() -> str:
    """The setting of :func:`set_brgemm_bf16_kernel`: ``'auto'``, ``'onednn'`` or ``'kt'``."""
    return _C.brgemm_bf16_kernel()


def use_brgemm_bf16_kernel(name: str) -> contextlib.AbstractContextManager[None]:
    """Context manager: :func:`set_brgemm_bf16_kernel` ``name``, then restore the previous one."""
    return _scoped(get_brgemm_bf16_kernel, set_brgemm_bf16_kernel, name)


def compute_paths(isa: Optional[str] = None) -> dict:
    """Per weight format, where oneDNN's brgemm computes its products now.

    Returns ``{format: {'brgemm_kernel': name or None, 'brgemm_min_tokens': n or None}}``
    for ISA path ``isa`` (default: the active one) under the current
    :func:`set_compute_path`: experts with at least ``brgemm_min_tokens``
    tokens run on ``brgemm_kernel`` (under ``'auto'``: with bf16 activations),
    the others on the streaming kernels;
    ``None`` where brgemm never runs (format without a brgemm path, a CPU or
    ISA path on which oneDNN does not run it, a torch without it, or
    ``torch.backends.mkldnn`` disabled).
    """
    return dict(_C.compute_paths(active_isa() if isa is None else str(isa)))


_NUMA_MODES = ("auto", "on", "off")


def set_numa(mode: str) -> None:
    """Choose NUMA placement of the experts (process-wide; README, "NUMA").

    * ``'auto'`` (default, or ``KT_OPS_NUMA``): on when hwloc reports more than
      one NUMA node with cores, else off.
    * ``'on'``: every expert is split by 16-row output blocks into one
      contiguous slice per NUMA node (gate/up along the intermediate size I,
      down along the hidden size H); each node's slices are bound to that node
      (in place, the packed tensors' own pages, at the first call on a layer)
      and computed by the pool threads pinned to its cores. With one node
      this binds the weights to it and changes nothing else.
    * ``'off'``: no placement; the pool's threads take cores in order.

    Results are bit-identical in every mode. Switching modes rebinds the
    pool's worker threads; pages already placed stay where they are.

    Raises:
        ValueError: ``mode`` is not ``'auto'``, ``'on'`` or ``'off'``.
    """
    if not isinstance(mode, str) or mode not in _NUMA_MODES:
        raise ValueError(f"kt_ops.set_numa: mode must be 'auto', 'on' or 'off', got {mode!r}")
    _C.set_numa(mode)


def get_numa() -> str:
    """The mode set by :func:`set_numa` (or ``KT_OPS_NUMA``): ``'auto'``, ``'on'`` or ``'off'``."""
    return _C.numa_mode()


def use_numa(mode: str) -> contextlib.AbstractContextManager[None]:
    """Context manager: :func:`set_numa` ``mode``, then restore the previous one."""
    return _scoped(get_numa, set_numa, mode)


def numa_placement(experts: ExpertWeights) -> dict[str, Any]:
    """Where one layer's experts live under the current NUMA mode (placing them if on).

    Returns ``{'active', 'parts', 'memory_binding', 'gate', 'up', 'down'}``;
    each projection is a list with one entry per part (NUMA node):
    ``{'node', 'rows': (begin, end), 'nodeset', 'bound', 'location', 'bound_to'}``.
    ``rows`` are the output rows of every expert held by that node
    (intermediate rows for gate/up, hidden rows for down); ``nodeset`` the
    OS indices the binding requested; ``bound`` whether the OS bound them;
    ``location`` the nodes hwloc finds the pages on
    (``hwloc_get_area_memlocation``) and ``bound_to`` the nodes of their
    binding policy; both ``None`` where hwloc cannot tell (a synthetic
    topology: ``memory_binding`` is then False and nothing is bound).
    """
    return dict(
        _C.numa_placement(
            list(experts.tensors()),
            experts.weight_format,
            [experts.hidden_size, experts.intermediate_size],
            list(experts.group_sizes),
        )
    )


def memory_nodes(tensor: Any) -> Optional[list[int]]:
    """NUMA nodes holding the (touched) pages of a CPU tensor's bytes, or ``None`` if unknown."""
    return _C.memory_nodes(tensor)
