"""Runtime controls: the process-wide settings (:data:`config`), ISA and topology reports.

:data:`config` (``kt_ops.config``, a :class:`Config`) holds the seven
process-wide knobs: thread count, parallel backend, ISA path, compute path,
quantized activations, the bf16 brgemm kernel and NUMA placement; its
docstring lists them with their values, defaults and environment variables.
The ``set_*`` / ``get_*`` / ``use_*`` functions below are its older aliases,
kept for a deprecation cycle (the ``set_*`` ones validate every value that
:data:`config` sets). :func:`supported_isas`, :func:`compute_paths`,
:func:`quant_fp32_min_tokens`, :func:`numa_placement` and
:func:`memory_nodes` report what the settings select.

The thread pool is process-wide, one worker per physical core (from hwloc),
bound to its core, reused across calls; the calling thread does its share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Optional

from kt_ops import _C
from kt_ops._checks import as_int
from kt_ops.formats import format_spec

if TYPE_CHECKING:
    from kt_ops.layer import ExpertWeights

__all__ = [
    "config",
    "Config",
    "set_num_threads",
    "get_num_threads",
    "set_parallel_backend",
    "get_parallel_backend",
    "use_parallel_backend",
    "supported_isas",
    "active_isa",
    "set_isa",
    "use_isa",
    "set_quant_activations",
    "get_quant_activations",
    "quant_fp32_min_tokens",
    "use_quant_activations",
    "set_compute_path",
    "get_compute_path",
    "use_compute_path",
    "set_brgemm_bf16_kernel",
    "get_brgemm_bf16_kernel",
    "use_brgemm_bf16_kernel",
    "compute_paths",
    "set_numa",
    "get_numa",
    "use_numa",
    "numa_placement",
    "memory_nodes",
]


def set_num_threads(n: int) -> None:
    """Alias of ``kt_ops.config.num_threads = n`` (:attr:`Config.num_threads`), kept for a
    deprecation cycle; the validated setter behind it.

    Raises:
        ValueError: ``n`` is not in ``[1, cap]`` (the message gives the cap).
        RuntimeError: the OS refused a worker thread (e.g. a pids limit); the
            pool then keeps its previous size (or one thread), which
            :func:`get_num_threads` reports.
    """
    if as_int(n) is None:  # not 2.7, "2" or True
        raise ValueError(f"kt_ops.set_num_threads: n must be an int, got {n!r}")
    n = as_int(n)
    if not -(2**63) <= n < 2**63:  # the extension checks [1, cap] and names the cap
        raise ValueError(
            f"kt_ops.set_num_threads: n must be in [1, 4 x the physical cores (at least 64)], "
            f"got {n}"
        )
    _C.set_num_threads(n)


def get_num_threads() -> int:
    """Alias of ``kt_ops.config.num_threads`` (:attr:`Config.num_threads`), kept for a
    deprecation cycle: the threads (the calling thread included) that run kt_ops kernels."""
    return config.num_threads


_PARALLEL_BACKENDS = ("auto", "pool", "openmp")


def set_parallel_backend(backend: str) -> None:
    """Alias of ``kt_ops.config.parallel_backend = backend`` (:attr:`Config.parallel_backend`),
    kept for a deprecation cycle; the validated setter behind it.

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
    """Alias of ``kt_ops.config.parallel_backend`` (:attr:`Config.parallel_backend`), kept for
    a deprecation cycle: ``'auto'``, ``'pool'`` or ``'openmp'``."""
    return config.parallel_backend


def use_parallel_backend(backend: str) -> contextlib.AbstractContextManager[Config]:
    """Alias of ``kt_ops.config.override(parallel_backend=backend)`` (:meth:`Config.override`),
    kept for a deprecation cycle: the backend for the block, then the previous one again."""
    return config.override(parallel_backend=backend)


def supported_isas() -> list[str]:
    """ISA paths built into this extension that this CPU can run, lowest first."""
    return list(_C.supported_isas())


def active_isa() -> str:
    """The ISA path the ops use now (``'ref'``, ``'avx2'``, ``'avx512'``, ``'avx512_vnni'``).

    Alias of ``kt_ops.config.isa`` (:attr:`Config.isa`), kept for a deprecation cycle.
    """
    return config.isa


def set_isa(name: str) -> None:
    """Alias of ``kt_ops.config.isa = name`` (:attr:`Config.isa`), kept for a deprecation
    cycle; the validated setter behind it.

    Raises ``ValueError`` naming the path and the missing CPU feature when the
    path is unknown, not built, or not runnable on this CPU.
    """
    _C.set_isa(str(name))


def use_isa(name: str) -> contextlib.AbstractContextManager[Config]:
    """Alias of ``kt_ops.config.override(isa=name)`` (:meth:`Config.override`), kept for a
    deprecation cycle: the ops run on ISA path ``name`` in the block, then the previous one."""
    return config.override(isa=name)


def set_quant_activations(mode: str) -> None:
    """Alias of ``kt_ops.config.quant_activations = mode`` (:attr:`Config.quant_activations`),
    kept for a deprecation cycle; the validated setter behind it.

    Raises ``ValueError`` for any other ``mode``.
    """
    _C.set_quant_activations(str(mode))


def get_quant_activations() -> str:
    """Alias of ``kt_ops.config.quant_activations`` (:attr:`Config.quant_activations`), kept
    for a deprecation cycle: ``'auto'``, ``'q8'`` or ``'fp32'``."""
    return config.quant_activations


def quant_fp32_min_tokens(weight_format: str, isa: Optional[str] = None) -> Optional[int]:
    """Tokens per expert from which ``'auto'`` takes the ``'fp32'`` path for ``weight_format``.

    On ISA path ``isa`` (default: the active one): the thresholds depend on
    the tier's kernels (``FormatSpec.fp32_min_tokens`` /
    ``fp32_min_tokens_vnni``). ``None`` when ``'auto'`` always takes ``'q8'``
    (4/5/6-bit formats; int8 and q8_0 on ``avx512_vnni``; ``bf16``, which has
    one path). The thresholds are measured break-evens (docs/formats.md,
    "Compute paths"). Raises ``ValueError`` for an unknown format or ISA path.
    """
    name = format_spec(str(weight_format)).name
    return _C.fp32_min_tokens(name, _C.active_isa() if isa is None else str(isa))


def use_quant_activations(mode: str) -> contextlib.AbstractContextManager[Config]:
    """Alias of ``kt_ops.config.override(quant_activations=mode)`` (:meth:`Config.override`),
    kept for a deprecation cycle: ``mode`` for the block, then the previous one again."""
    return config.override(quant_activations=mode)


_COMPUTE_PATHS = ("auto", "streaming", "brgemm")


def set_compute_path(path: str) -> None:
    """Alias of ``kt_ops.config.compute_path = path`` (:attr:`Config.compute_path`), kept for
    a deprecation cycle; the validated setter behind it.

    Raises:
        ValueError: ``path`` is not ``'auto'``, ``'streaming'`` or ``'brgemm'``.
    """
    if not isinstance(path, str) or path not in _COMPUTE_PATHS:
        raise ValueError(
            f"kt_ops.set_compute_path: path must be 'auto', 'streaming' or 'brgemm', got {path!r}"
        )
    _C.set_compute_path(path)


def get_compute_path() -> str:
    """Alias of ``kt_ops.config.compute_path`` (:attr:`Config.compute_path`), kept for a
    deprecation cycle: ``'auto'``, ``'streaming'`` or ``'brgemm'``."""
    return config.compute_path


def use_compute_path(path: str) -> contextlib.AbstractContextManager[Config]:
    """Alias of ``kt_ops.config.override(compute_path=path)`` (:meth:`Config.override`), kept
    for a deprecation cycle: ``path`` for the block, then the previous one again."""
    return config.override(compute_path=path)


_BF16_BRGEMM_KERNELS = ("auto", "onednn", "kt")


def set_brgemm_bf16_kernel(name: str) -> None:
    """Alias of ``kt_ops.config.brgemm_bf16_kernel = name`` (:attr:`Config.brgemm_bf16_kernel`),
    kept for a deprecation cycle; the validated setter behind it.

    Raises:
        ValueError: ``name`` is not ``'auto'``, ``'onednn'`` or ``'kt'``.
    """
    if name not in _BF16_BRGEMM_KERNELS:
        raise ValueError(
            f"kt_ops.set_brgemm_bf16_kernel: name must be 'auto', 'onednn' or 'kt', got {name!r}"
        )
    _C.set_brgemm_bf16_kernel(name)


def get_brgemm_bf16_kernel() -> str:
    """Alias of ``kt_ops.config.brgemm_bf16_kernel`` (:attr:`Config.brgemm_bf16_kernel`), kept
    for a deprecation cycle: ``'auto'``, ``'onednn'`` or ``'kt'``."""
    return config.brgemm_bf16_kernel


def use_brgemm_bf16_kernel(name: str) -> contextlib.AbstractContextManager[Config]:
    """Alias of ``kt_ops.config.override(brgemm_bf16_kernel=name)`` (:meth:`Config.override`),
    kept for a deprecation cycle: ``name`` for the block, then the previous one again."""
    return config.override(brgemm_bf16_kernel=name)


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
    """Alias of ``kt_ops.config.numa = mode`` (:attr:`Config.numa`), kept for a deprecation
    cycle; the validated setter behind it.

    Raises:
        ValueError: ``mode`` is not ``'auto'``, ``'on'`` or ``'off'``.
    """
    if not isinstance(mode, str) or mode not in _NUMA_MODES:
        raise ValueError(f"kt_ops.set_numa: mode must be 'auto', 'on' or 'off', got {mode!r}")
    _C.set_numa(mode)


def get_numa() -> str:
    """Alias of ``kt_ops.config.numa`` (:attr:`Config.numa`), kept for a deprecation cycle:
    ``'auto'``, ``'on'`` or ``'off'``."""
    return config.numa


def use_numa(mode: str) -> contextlib.AbstractContextManager[Config]:
    """Alias of ``kt_ops.config.override(numa=mode)`` (:meth:`Config.override`), kept for a
    deprecation cycle: ``mode`` for the block, then the previous one again."""
    return config.override(numa=mode)


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


class Config:
    """kt_ops' process-wide settings, one attribute per knob (``kt_ops.config``).

    Read a knob as an attribute (``kt_ops.config.isa``), set it by assignment
    (``kt_ops.config.num_threads = 4``), set several for a block and restore
    them after it (``with kt_ops.config.override(isa="avx2", compute_path="streaming"):``),
    report all (``kt_ops.config.as_dict()``). An assignment goes through the
    knob's validated setter: an invalid value raises ``ValueError`` naming the
    knob and its valid values and leaves the setting as it was. An unknown name
    raises ``AttributeError`` (``TypeError`` in :meth:`override`).

    ======================  ===========================================  ==========================
    knob                    values (default first)                       environment variable
    ======================  ===========================================  ==========================
    ``num_threads``         the physical cores (hwloc); 1 to 4 x the     ``KT_OPS_NUM_THREADS``
                            physical cores (at least 64)
    ``parallel_backend``    ``'auto'``, ``'pool'``, ``'openmp'``         ``KT_OPS_PARALLEL_BACKEND``
    ``isa``                 the highest of :func:`supported_isas`;       ``KT_OPS_ISA``
                            ``'ref'``, ``'avx2'``, ``'avx512'``,
                            ``'avx512_vnni'``
    ``compute_path``        ``'auto'``, ``'streaming'``, ``'brgemm'``    none
    ``quant_activations``   ``'auto'``, ``'q8'``, ``'fp32'``             none
    ``brgemm_bf16_kernel``  ``'auto'``, ``'onednn'``, ``'kt'``           none
    ``numa``                ``'auto'``, ``'on'``, ``'off'``              ``KT_OPS_NUMA``
    ======================  ===========================================  ==========================

    Environment variables. Each is read once per process, when its knob is
    first used, and gives that knob's initial value; setting the knob replaces
    it. A malformed value is an error, never silently replaced by the default:
    using the knob (reading it, or an op call) raises ``ValueError`` naming the
    variable. Setting the knob ends the error of ``KT_OPS_NUM_THREADS``,
    ``KT_OPS_ISA`` and ``KT_OPS_PARALLEL_BACKEND``; a malformed ``KT_OPS_NUMA``
    stays an error (the setter too) until it is corrected. ``KT_OPS_HWLOC_SYNTHETIC``
    (an hwloc synthetic topology such as ``"node:2 core:4 pu:1"``, for tests)
    replaces the machine's topology, from which ``num_threads`` and ``numa``
    take their defaults. ``KT_OPS_CORE_SHARE`` (``'auto'``: part ``LOCAL_RANK`` of
    ``LOCAL_WORLD_SIZE`` when torchrun / accelerate set them; ``'i/n'``; ``'off'``)
    restricts that topology to this process's share of the host's cores, so
    data-parallel ranks on one host split them (:mod:`kt_ops.distributed`).
    ``KT_OPS_SCRATCH_KEEP_MB`` (default 512) is how many MiB of scratch a calling
    thread keeps between op calls (a call that needs more frees it on return); a
    malformed value makes the op calls raise an error naming it.
    ``KT_OPS_HUGE_PAGES`` (``1``, the default, or ``0``; read once) says whether the
    packed weights kt_ops allocates go in 2 MiB pages
    (:func:`kt_ops.formats.packed.empty_huge_pages`); another value makes
    quantizing and loading raise an error naming it.
    ``KT_OPS_BRGEMM_BF16_PAIRS`` set to ``1`` (read once) makes oneDNN's bf16 brgemm
    multiply two 16-row blocks per call (N = 32; docs/formats.md, "Compute paths"). Build-time
    variables (``KT_OPS_CUDA_BRIDGE``,
    ``KT_OPS_BUILD_TYPE``, ...) belong to ``setup.py``, not to this object.

    Every knob is process-wide (all threads, all layers) and leaves results
    bit-identical except ``isa``, ``compute_path`` and ``quant_activations``,
    which choose kernels that round differently. The older functions
    (``kt_ops.set_num_threads``, ``get_numa``, ``use_isa``, ...) are aliases of
    these attributes and of :meth:`override`, kept for a deprecation cycle.
    """

    #: The knobs, in the order :meth:`as_dict` reports them and :meth:`override` validates them.
    KNOBS: tuple[str, ...] = (
        "num_threads",
        "parallel_backend",
        "isa",
        "compute_path",
        "quant_activations",
        "brgemm_bf16_kernel",
        "numa",
    )

    __slots__ = ()

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in Config.KNOBS:
            raise AttributeError(
                f"kt_ops.config has no setting {name!r}; the settings are {', '.join(Config.KNOBS)}"
            )
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return "kt_ops.config(" + ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items()) + ")"

    def as_dict(self) -> dict[str, Any]:
        """Every knob's current value, ``{name: value}`` in :attr:`KNOBS` order."""
        return {name: getattr(self, name) for name in Config.KNOBS}

    @contextlib.contextmanager
    def override(self, **settings: Any) -> Iterator[Config]:
        """Context manager: set the given knobs for the block, then restore their values.

        ``with kt_ops.config.override(isa="avx2", compute_path="streaming"): ...``
        sets the knobs in the order given and, on leaving the block (by an
        exception too), sets each back to its value before, in reverse order.
        The block gets this object (``as cfg``).

        Raises:
            TypeError: a name is not a knob (nothing is set).
            ValueError: a value is invalid (the knobs set before it are restored).
        """
        unknown = [name for name in settings if name not in Config.KNOBS]
        if unknown:
            raise TypeError(
                f"kt_ops.config.override: unknown setting {unknown[0]!r}; "
                f"the settings are {', '.join(Config.KNOBS)}"
            )
        previous: list[tuple[str, Any]] = []
        try:
            for name, value in settings.items():
                before = getattr(self, name)
                setattr(self, name, value)
                previous.append((name, before))
            yield self
        finally:
            for name, before in reversed(previous):
                setattr(self, name, before)

    @property
    def num_threads(self) -> int:
        """Threads (the calling thread included) that run kt_ops' kernels.

        Default: the physical cores (from hwloc), or ``KT_OPS_NUM_THREADS``.
        At most 4 x the physical cores (at least 64): more threads only
        oversubscribe the cores. Results are bit-identical for any count.
        Setting it resizes the pool; ``ValueError`` outside ``[1, cap]`` (the
        message gives the cap), ``RuntimeError`` when the OS refuses a worker
        thread (e.g. a pids limit: the pool then keeps its previous size, or one
        thread, which this attribute reports).
        """
        return _C.get_num_threads()

    @num_threads.setter
    def num_threads(self, n: int) -> None:
        set_num_threads(n)

    @property
    def parallel_backend(self) -> str:
        """Which threads run kt_ops' parallel work: ``'auto'``, ``'pool'`` or ``'openmp'``.

        * ``'pool'``: kt_ops' own pool, one worker per physical core, bound to it.
        * ``'openmp'``: the threads of torch's own OpenMP runtime (the intra-op
          threads of torch's CPU ops), a team of :attr:`num_threads` threads.
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
        several nodes (:attr:`numa`: the pool's threads are bound per node),
        in a process forked after the parent started OpenMP threads (they do not
        survive ``fork()``), inside an OpenMP parallel region, and on one thread.
        ``kt_ops.info()['parallel']`` says which threads a call from this thread
        uses and why. Results are bit-identical on either backend. Setting
        ``'openmp'`` where torch has no OpenMP runtime raises ``ValueError``.
        """
        return _C.parallel_backend()

    @parallel_backend.setter
    def parallel_backend(self, backend: str) -> None:
        set_parallel_backend(backend)

    @property
    def isa(self) -> str:
        """The ISA path the ops use: ``'ref'``, ``'avx2'``, ``'avx512'`` or ``'avx512_vnni'``.

        Default: the highest of :func:`supported_isas` (built into this
        extension and runnable on this CPU), or ``KT_OPS_ISA``. Setting it
        forces a path for later op calls; ``ValueError`` names the path and the
        missing CPU feature when it is unknown, not built, or not runnable here.
        """
        return _C.active_isa()

    @isa.setter
    def isa(self, name: str) -> None:
        set_isa(name)

    @property
    def compute_path(self) -> str:
        """Which kernels compute the expert products: ``'auto'``, ``'streaming'`` or ``'brgemm'``.

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
          oneDNN's bf16 brgemm; the two are bit-identical; ``fp8_channel`` and
          ``mxfp8`` on the same kernels, ``mxfp8`` with its power-of-two scales
          in the decoded bf16 values, exactly); the int8 / q8_0
          brgemm (u8 x s8) gives the streaming q8 kernels' results bit for bit.
        * ``'auto'`` (default): per expert and call, ``'brgemm'`` when the expert
          has at least the format's measured break-even token count on this CPU
          (``kt_ops.formats.format_spec(name).brgemm_min_tokens``;
          docs/formats.md, "Compute paths"), else ``'streaming'``. For bf16 and
          fp8 only with bf16 activations: fp32 and fp16 ones stay on
          ``'streaming'`` (brgemm would round them to bf16).

        As with :attr:`quant_activations`, the paths round differently, so
        under ``'auto'`` a token's output can depend on how many tokens share its
        experts; pin ``'streaming'`` or ``'brgemm'`` for batch-invariant results.
        Results are bit-identical for any thread count on every path.
        """
        return _C.compute_path()

    @compute_path.setter
    def compute_path(self, path: str) -> None:
        set_compute_path(path)

    @property
    def quant_activations(self) -> str:
        """How the quantized weight formats multiply activations: ``'auto'``, ``'q8'``, ``'fp32'``.

        * ``'q8'``: the qint formats (``int8``, ``int4``, ``mxfp4``, GGUF types)
          quantize each activation row to int8 per 32 values and multiply integer
          codes (w8a8 / w4a8, ``pmaddubsw``/VNNI dot products); ``fp8`` multiplies
          its decoded codes with fp32 activations in registers.
        * ``'fp32'``: every format decodes each 16-row weight block once to fp32
          (``scale * q - zero``) and multiplies fp32 activations (weight-only,
          the w4a16 path; no activation rounding).
        * ``'auto'`` (default): per expert and call, ``'fp32'`` when the expert
          has at least the format's measured break-even token count
          (:func:`quant_fp32_min_tokens`; docs/formats.md, "Compute paths"),
          else ``'q8'``.

        The two paths round differently (``'q8'`` rounds activations to int8), so
        under ``'auto'`` a token's output can depend on how many tokens share its
        experts; pin ``'q8'`` or ``'fp32'`` for batch-invariant results.
        """
        return _C.quant_activations()

    @quant_activations.setter
    def quant_activations(self, mode: str) -> None:
        set_quant_activations(mode)

    @property
    def brgemm_bf16_kernel(self) -> str:
        """The kernel of the bf16 products on the brgemm path: ``'auto'``, ``'onednn'``, ``'kt'``.

        * ``'auto'`` (default): kt_ops' own vdpbf16ps tile kernel on CPUs with
          AVX512_BF16 and no AMX (it prefetches the weight stream, which a
          prefill reads from DRAM; benchmarks/README.md has the measurements),
          oneDNN's brgemm elsewhere (AMX tiles on CPUs that have them).
        * ``'onednn'``: always oneDNN's brgemm.
        * ``'kt'``: kt_ops' kernel wherever the CPU has AVX512_BF16 (AMX CPUs
          included); oneDNN's brgemm where it has not.

        Both compute the same fp32 sums in the same order (one vdpbf16ps chain
        per output over k): their results are bit-identical. The same choice
        holds for fp8's tiles and for int8's w8a8 tiles (kt_ops' vpdpbusd
        kernel on AVX512_VNNI CPUs; exact int32 sums, bit-identical to
        oneDNN's u8s8 brgemm) and int4's per-channel w4a8 tiles (bit-identical
        to oneDNN's u8s8 brgemm on the codes decoded to signed bytes, the AMX
        path; oneDNN's also takes int4 with groups of 64 and 128, one call per
        group, which kt_ops' tiles leave to the streaming kernels). For tests and benchmarks;
        ``compute_paths()[fmt]['brgemm_kernel']`` names the kernel that runs.
        """
        return _C.brgemm_bf16_kernel()

    @brgemm_bf16_kernel.setter
    def brgemm_bf16_kernel(self, name: str) -> None:
        set_brgemm_bf16_kernel(name)

    @property
    def numa(self) -> str:
        """NUMA placement of the experts: ``'auto'``, ``'on'`` or ``'off'`` (docs/architecture.md).

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
        pool's worker threads; pages already placed stay where they are
        (:func:`numa_placement` reports a layer's placement).
        """
        return _C.numa_mode()

    @numa.setter
    def numa(self, mode: str) -> None:
        set_numa(mode)


#: The process-wide settings (exported as ``kt_ops.config``).
config = Config()
