"""kt-kernel compatibility: ``KTMoEWrapper`` with kt-kernel 0.7.2's API, on ``torch.ops.kt``.

Code written for kt-kernel (``from kt_kernel import KTMoEWrapper``) runs on kt_ops
by changing the import to ``from kt_ops.compat import KTMoEWrapper``: the
constructor takes the same arguments (same names, same positional order), and
``load_weights``, ``load_weights_from_tensors``, ``submit_forward``,
``sync_forward``, ``forward`` and the buffer-cache static methods are there.
The API is that of kt-kernel 0.7.2 (PyPI), read from its ``experts.py``,
``experts_base.py`` and ``utils/{amx,llamafile,moe_kernel,loader}.py``.

**Methods.** Each kt-kernel ``method`` maps to a kt_ops weight format
(:data:`METHODS`), or is refused with a ValueError naming the nearest kt_ops
format (:data:`REFUSED`); the table and the reader of each method's
``weight_path`` are in :mod:`kt_ops.compat_methods`:

================  ==================  ==============================================
method            kt_ops format       ``load_weights`` reads ``weight_path`` as
================  ==================  ==============================================
``BF16``          ``bf16``            HF safetensors (bf16/fp16/fp32), exact
``FP8``           ``fp8``             HF fp8 + ``weight_scale_inv`` 128x128, exact
``AMXINT8``       ``int8``            HF float/fp8, quantized per output channel
``MOE_INT8``      ``int8``            as ``AMXINT8``
``AMXINT4``       ``int4`` g128 sym   HF float/fp8, quantized per group of 128
``MOE_INT4``      ``int4`` g128 sym   as ``AMXINT4``
``RAWINT4``       ``int4`` sym        compressed-tensors ``weight_packed`` (bf16
                                      scales, group from the scales), exact
``AMXINT4_1``     ``int4`` asym, per  HF float/fp8, quantized per output channel
                  channel             with zero points
``AMXINT4_1KGroup`` ``int4`` asym     HF float/fp8, quantized per group of
                                      ``group_size`` with zero points
``GPTQ_INT4``     ``int4``            GPTQ ``qweight``/``qzeros``/``scales`` (v1
                                      and v2 zero points), exact; ``desc_act``
                                      layers as ``bf16``
``NVFP4``         ``nvfp4``           compressed-tensors ``nvfp4-pack-quantized``
                                      or ModelOpt NVFP4, exact
``MXFP4``         ``mxfp4``           DeepSeek-V4 ``ffn.experts.{i}.w1.weight`` /
                                      ``.scale``, exact
``FP8_PERCHANNEL`` ``fp8_channel``    fp8 ``weight`` + ``weight_scale`` ``[N]`` /
                                      ``[N, 1]`` (GLM-4.7-FP8), exact
``MXFP8``         ``mxfp8``           fp8 ``weight`` + uint8 UE8M0
                                      ``weight_scale_inv`` per 32 (MiniMax-M3), exact
``LLAMAFILE``     GGUF types          ``.gguf`` file (or a folder of them): Q8_0,
                                      Q4_0, Q4_1, Q5_0, Q5_1, Q2_K ... Q6_K, IQ4_NL,
                                      IQ4_XS, MXFP4 (gpt-oss), NVFP4 exact per
                                      tensor; F16/BF16/F32 as ``bf16``
================  ==================  ==============================================

Any method also reads a ``kt-ops convert`` directory (``manifest.json``) of its
format. kt-kernel's *own* converted AMX layout
(``blk.{L}.ffn_*_exps.{e}.numa.{n}.weight``) is kt-kernel's internal tile
layout and is refused with a message saying what to pass instead.
``AMXINT4``/``MOE_INT4`` quantize per group of ``group_size`` (default 128)
along K, the same bits plus a scale per group and a smaller error than
kt-kernel's per-output-channel int4; ``group_size=0`` gives kt-kernel's
granularity (one scale per output channel), not its rounding. Refused:
``SYCL_GPTQ_INT4`` (a SYCL device method; nearest ``int4``) and ``mode='sft'``
(kt_ops trains LoRA through ``replace_experts`` + ``apply_lora``).

**Arguments kt_ops has no use for.** ``cpuinfer_threads``: the first wrapper of
the process calls :func:`kt_ops.set_num_threads` with it (kt-kernel creates
its ``CPUInfer`` once, from its first wrapper, likewise); later wrappers'
values are ignored. ``threadpool_count`` and ``numa_nodes`` (kt-kernel's NUMA
subpools) are validated and ignored: kt_ops' one pool spans the machine
(hwloc). ``chunked_prefill_size`` sizes kt-kernel's buffers; kt_ops has none,
so any token count runs. ``cpu_save`` is accepted and ignored (kt_ops always
quantizes from the source). SFT-only arguments (``lora_*``,
``max_cache_depth``, ``full_weight_grad``, ``zero_point``) are ignored in
inference mode, as in kt-kernel; ``group_size`` picks the int4 group of the
methods kt_ops quantizes to ``int4`` (32, 64 or 128). Refused with a
ValueError: ``max_deferred_experts_per_token > 0`` (kt-kernel adds deferred
experts' output to the *next* layer's), ``swiglu_alpha`` other than 0.
``swiglu_limit`` > 0 runs DeepSeek-V4's clamped SwiGLU (``silu(limit=L)``: the
gate clamped above at ``L``, up to ``[-L, L]``).

**GPU experts.** ``gpu_experts_mask`` (bool ``[E]``, True = the expert lives on
the GPU) makes the CPU skip those experts, as in kt-kernel; it is read at
every forward, so updating ``wrapper.gpu_experts_mask`` in place takes effect
(kt-kernel shares it with its C++ side the same way). ``num_gpu_experts=n`` in
inference mode is ignored by kt-kernel 0.7.2 (its README still passes it);
here it means experts ``0..n-1`` are on the GPU when no mask is given.

**Forward.** kt-kernel copies the inputs into bf16 buffers, so its results are
rounded through bf16; kt_ops computes from the caller's dtype (bf16, fp16 or
fp32; others go through fp32) and returns that dtype, flattened to
``[T, H]`` as kt-kernel returns it, in a new tensor (kt-kernel returns a
buffer reused by its next call). On CPU tensors ``submit_forward`` runs the
experts to completion and ``sync_forward`` hands the result back. On CUDA
tensors the op is called on the CUDA tensors (stream-ordered) when this
kt_ops build has the CUDA bridge; otherwise the wrapper copies to the host,
runs the op, and copies back on ``cuda_stream`` (not capturable in a CUDA
graph). After the first CPU call, CPU calls go through a layer parsed once
(``kt_ops._C.PreparedLayer`` with the live ``gpu_experts_mask``; bit-identical
to the op, about 10 µs instead of 30-50 per call hot): the engine pays the
wrapper's fixed cost once per layer per decode step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Optional, Union

import torch
from torch import Tensor

import kt_ops
from kt_ops import ops
from kt_ops._checks import as_int
from kt_ops.compat_methods import (
    KT_KERNEL_VERSION,
    METHODS,
    REFUSED,
    SFT_HINT,
    SFT_METHODS,
    MethodMapping,
    group_choices,
    load_experts,
    method_mapping,
    open_source,
    source_of,
)
from kt_ops.layer import ExpertWeights, activation_spec

if TYPE_CHECKING:  # kt_ops.loaders needs safetensors and gguf, optional dependencies
    from kt_ops.loaders import CheckpointReader

__all__ = [
    "KT_KERNEL_VERSION",
    "METHODS",
    "REFUSED",
    "SFT_METHODS",
    "KTMoEWrapper",
    "MethodMapping",
    "generate_gpu_experts_masks",
    "method_mapping",
]

logger = logging.getLogger(__name__)


def generate_gpu_experts_masks(activation_freq: Tensor, num_gpu_experts: int) -> Tensor:
    """The ``num_gpu_experts`` most frequently activated experts over all layers, as masks.

    kt-kernel 0.7.2's ``kt_kernel.generate_gpu_experts_masks``, same semantics:
    ``activation_freq`` ``[num_layers, num_experts]`` (higher = more often
    routed); ``num_gpu_experts`` is clamped to ``[0, num_layers * num_experts]``.
    Returns a CPU bool tensor ``[num_layers, num_experts]``, True = on the GPU;
    row ``L`` is the ``gpu_experts_mask`` of layer ``L``. Raises ValueError for
    a tensor that is not 2-D.
    """
    if not isinstance(activation_freq, Tensor) or activation_freq.dim() != 2:
        raise ValueError("activation_freq must be a 2-D tensor [num_layers, num_experts]")
    layers, experts = activation_freq.shape
    n = max(0, min(int(num_gpu_experts), layers * experts))
    mask = torch.zeros(layers * experts, dtype=torch.bool)
    if n:
        top = torch.topk(activation_freq.reshape(-1).float().cpu(), k=n, sorted=False).indices
        mask[top] = True
    return mask.view(layers, experts)


# ---------------------------------------------------------------------- GPU expert masking


def _moe_forward_masked(
    x: Tensor,
    ids: Tensor,
    weights: Tensor,
    experts: ExpertWeights,
    mask: Optional[Tensor],
    activation: str = "silu",
) -> Tensor:
    """``kt_ops.ops.moe_forward``, skipping the experts of ``mask`` (None: no GPU experts)."""
    return ops.moe_forward(x, ids, weights, experts, activation=activation, gpu_experts_mask=mask)


# ---------------------------------------------------------------------- the wrapper


@dataclasses.dataclass
class _Pending:
    """A submitted forward: its result (CPU/bridge) or the host copies (CUDA fallback)."""

    rows: int
    out: Optional[Tensor] = None
    host_inputs: Optional[tuple[Tensor, Tensor, Tensor]] = None
    event: Any = None
    stream: Any = None
    device: Optional[torch.device] = None
    dtype: Optional[torch.dtype] = None


def _int(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    return v


class KTMoEWrapper:
    """kt-kernel 0.7.2's ``KTMoEWrapper`` (inference mode), running on ``torch.ops.kt``.

    Same constructor as ``kt_kernel.KTMoEWrapper`` (kt-kernel 0.7.2,
    ``experts.py``): the same names in the same positional order. The arguments
    kt-kernel requires are optional here (``gpu_experts_mask``, ``cpuinfer_threads``,
    ``threadpool_count``, ``weight_path``, ``chunked_prefill_size``), so kt-kernel's
    README call (``num_gpu_experts=2``, no mask) works too. See the module
    docstring for what each argument does on kt_ops.

    Args:
        layer_idx: MoE layer index: picks ``layers.{L}`` / ``blk.{L}`` in the checkpoint.
        num_experts: ``E`` (the physical experts when a ``physical_to_logical_map`` is used).
        num_experts_per_tok: top-k ``K``; ``topk_ids`` / ``topk_weights`` are ``[T, K]``.
        hidden_size: ``H``.
        moe_intermediate_size: ``I``.
        gpu_experts_mask: bool ``[E]`` (any tensor convertible to it), True = the
            expert runs on the GPU and is skipped here; None = all on the CPU.
        cpuinfer_threads: kt_ops' thread count, set by the first wrapper of the
            process (None or <= 0: leave it).
        threadpool_count, numa_nodes: validated (``len(numa_nodes) ==
            threadpool_count``), then ignored.
        weight_path: what :meth:`load_weights` reads (per method, module docstring).
        chunked_prefill_size, cpu_save: accepted, unused.
        max_deferred_experts_per_token: None or 0 (deferring is refused).
        method: a kt-kernel inference method (:data:`METHODS`).
        mode: ``"inference"`` (``"sft"`` is refused).
        num_gpu_experts: without a mask, ``n > 0`` puts experts ``0..n-1`` on the
            GPU; with a mask, 0 or the mask's count.
        group_size: int4 group of ``AMXINT4``/``MOE_INT4``/``AMXINT4_1KGroup`` (and of
            ``RAWINT4`` via :meth:`load_weights_from_tensors`): 32, 64 or 128, or 0
            (per output channel, kt-kernel's ``AMXINT4``).
        lora_rank, lora_alpha, lora_dropout, max_cache_depth, zero_point,
            full_weight_grad: kt-kernel SFT arguments, ignored.
        swiglu_limit: 0 (plain SwiGLU) or the DeepSeek-V4 clamp ``L > 0``.
        swiglu_alpha: 0 only.

    Attributes:
        the arguments above; ``gpu_experts_mask`` (CPU bool ``[E]``),
        ``num_gpu_experts``, ``mapping`` (:class:`MethodMapping`), ``experts``
        (:class:`kt_ops.ExpertWeights` once loaded, else None; ``moe`` is the same).

    Raises:
        ValueError: a bad argument (named), a refused method (naming the nearest
            kt_ops format), ``mode='sft'``, deferred experts or a SwiGLU clamp.
    """

    _threads_configured: ClassVar[bool] = False
    _capture_batch_sizes: ClassVar[list[int]] = []
    _sources: ClassVar[dict[tuple[str, str], Any]] = {}

    def __init__(
        self,
        layer_idx: int,
        num_experts: int,
        num_experts_per_tok: int,
        hidden_size: int,
        moe_intermediate_size: int,
        gpu_experts_mask: Optional[Tensor] = None,
        cpuinfer_threads: Optional[int] = None,
        threadpool_count: int = 1,
        weight_path: Optional[Union[str, os.PathLike]] = None,
        chunked_prefill_size: Optional[int] = None,
        cpu_save: bool = False,
        max_deferred_experts_per_token: Optional[int] = None,
        method: str = "AMXINT4",
        numa_nodes: Optional[list[int]] = None,
        mode: str = "inference",
        num_gpu_experts: int = 0,
        lora_rank: int = 16,
        lora_alpha: float = 32.0,
        lora_dropout: float = 0.0,
        max_cache_depth: int = 1,
        group_size: int = 128,
        zero_point: bool = True,
        full_weight_grad: bool = False,
        swiglu_limit: float = 0.0,
        swiglu_alpha: float = 0.0,
    ) -> None:
        if mode not in ("inference", "sft"):
            raise ValueError(f"Unknown mode: {mode!r}. Supported modes: 'inference', 'sft'")
        if mode == "sft":
            raise ValueError(f"mode='sft' is not supported by kt_ops.compat; {SFT_HINT}")
        self.mapping = method_mapping(method)
        self.method = method
        self.layer_idx = _int("layer_idx", layer_idx, 0)
        self.num_experts = _int("num_experts", num_experts, 1)
        self.num_experts_per_tok = _int("num_experts_per_tok", num_experts_per_tok, 1)
        self.hidden_size = _int("hidden_size", hidden_size, 1)
        self.moe_intermediate_size = _int("moe_intermediate_size", moe_intermediate_size, 1)
        if num_experts_per_tok > num_experts:
            raise ValueError(
                f"num_experts_per_tok ({num_experts_per_tok}) cannot exceed num_experts "
                f"({num_experts})"
            )
        self.threadpool_count = _int("threadpool_count", threadpool_count, 1)
        if numa_nodes is not None:
            if not isinstance(numa_nodes, (list, tuple)) or not all(
                as_int(n) is not None and n >= 0 for n in numa_nodes
            ):
                raise ValueError(
                    f"numa_nodes must be a list of NUMA node indices (ints >= 0), got "
                    f"{numa_nodes!r}"
                )
            if len(numa_nodes) != threadpool_count:
                raise ValueError(
                    f"numa_nodes length ({len(numa_nodes)}) must match threadpool_count "
                    f"({threadpool_count})"
                )
        self.numa_nodes = numa_nodes
        deferred = 0 if max_deferred_experts_per_token is None else max_deferred_experts_per_token
        if _int("max_deferred_experts_per_token", deferred, 0) > 0:
            raise ValueError(
                f"max_deferred_experts_per_token={deferred}: kt-kernel's deferred experts (whose "
                "output is added to the next layer's) are not supported by kt_ops.compat; pass 0"
            )
        self.max_deferred_experts_per_token = 0
        if swiglu_alpha != 0.0:
            raise ValueError(
                f"swiglu_alpha={swiglu_alpha}: only 0.0 is supported (kt_ops runs plain SwiGLU "
                "or, with swiglu_limit, DeepSeek-V4's clamped SwiGLU)"
            )
        if (
            isinstance(swiglu_limit, bool)
            or not isinstance(swiglu_limit, numbers.Real)
            or not (swiglu_limit >= 0.0 and math.isfinite(swiglu_limit))
        ):
            raise ValueError(f"swiglu_limit={swiglu_limit!r}: expected a finite number >= 0")
        self.swiglu_limit = float(swiglu_limit)
        self.activation = (
            activation_spec("silu", limit=self.swiglu_limit) if self.swiglu_limit else "silu"
        )
        groups = group_choices(self.mapping.weight_format)
        if groups and group_size not in groups:
            allowed = ", ".join(map(str, groups[:-1])) + f" or {groups[-1]}"
            raise ValueError(f"group_size must be {allowed} for method {method!r}")
        self.group_size = group_size
        self.mask_from_num_gpu_experts = False
        self.gpu_experts_mask = self._make_mask(gpu_experts_mask, num_gpu_experts)
        self.weight_path = None if weight_path is None else os.fspath(weight_path)
        self.chunked_prefill_size = chunked_prefill_size
        self.cpu_save = bool(cpu_save)
        self.cpuinfer_threads = cpuinfer_threads
        self._configure_threads(cpuinfer_threads)
        self.experts: Optional[ExpertWeights] = None
        self._pending: Optional[_Pending] = None
        # (kt_ops._C.PreparedLayer, the experts and the mask it was built on): the
        # CPU forward's fast way in (_prepared_forward).
        self._prepared: Optional[tuple[Any, ExpertWeights, Tensor]] = None

    # ------------------------------------------------------------------ set-up

    def _make_mask(self, mask: Optional[Tensor], num_gpu_experts: int) -> Tensor:
        E = self.num_experts
        n = _int("num_gpu_experts", num_gpu_experts, 0)
        if n > E:
            raise ValueError(f"num_gpu_experts ({n}) cannot exceed num_experts ({E})")
        if mask is None:
            out = torch.zeros(E, dtype=torch.bool)
            out[:n] = True
            self.mask_from_num_gpu_experts = n > 0
            return out
        t = torch.as_tensor(mask)
        if t.dim() != 1 or t.shape[0] != E:
            raise ValueError(
                f"gpu_experts_mask must have shape [{E}] (num_experts), got {list(t.shape)}"
            )
        if t.dtype != torch.bool and not bool(((t == 0) | (t == 1)).all()):
            raise ValueError("gpu_experts_mask must be boolean (True = the expert is on the GPU)")
        out = t.to("cpu", torch.bool).clone()
        if n not in (0, int(out.sum())):
            raise ValueError(
                f"num_gpu_experts={n} disagrees with gpu_experts_mask, which puts "
                f"{int(out.sum())} experts on the GPU"
            )
        return out

    @classmethod
    def _configure_threads(cls, threads: Optional[int]) -> None:
        # Checked for every wrapper, applied by the first.
        if threads is not None and as_int(threads) is None:
            raise ValueError(f"cpuinfer_threads must be an int or None, got {threads!r}")
        if cls._threads_configured or threads is None:
            return
        if threads <= 0:
            return
        try:
            kt_ops.set_num_threads(threads)
        except ValueError as e:
            logger.warning("cpuinfer_threads=%d not applied: %s", threads, e)
        cls._threads_configured = True

    @property
    def num_gpu_experts(self) -> int:
        """How many experts ``gpu_experts_mask`` puts on the GPU (read live)."""
        return int(self.gpu_experts_mask.sum())

    @property
    def moe(self) -> Optional[ExpertWeights]:
        """kt-kernel's name for the loaded backend: here the :class:`ExpertWeights` (or None)."""
        return self.experts

    # ------------------------------------------------------------------ weights

    def _source(self) -> CheckpointReader:
        """The (cached) checkpoint reader of ``weight_path`` for this method."""
        if self.weight_path is None:
            raise ValueError(f"weight_path is None; method {self.method!r} loads from weight_path")
        path = Path(self.weight_path)
        if not path.exists():
            raise FileNotFoundError(f"weight_path {path} does not exist (method {self.method!r})")
        source, path = source_of(path, self.mapping, self.layer_idx)
        key = (source, os.path.realpath(path))
        reader = KTMoEWrapper._sources.get(key)
        if reader is None:
            reader = open_source(source, path, self.method, self.mapping)
            KTMoEWrapper._sources[key] = reader
        return reader

    def _check_map(self, p2l: Optional[Tensor], logical: int) -> Optional[Tensor]:
        """The physical -> logical expert map as int64 indices, or None for the identity."""
        E = self.num_experts
        if p2l is None:
            if logical != E:
                raise ValueError(
                    f"the weights hold {logical} experts, the wrapper was built for "
                    f"num_experts={E}; pass a physical_to_logical_map to pick them"
                )
            return None
        m = torch.as_tensor(p2l)
        if m.dim() != 1 or m.shape[0] != E or m.is_floating_point() or m.dtype == torch.bool:
            raise ValueError(
                f"physical_to_logical_map must be an integer tensor [{E}] (num_experts), got "
                f"{m.dtype} {list(m.shape)}"
            )
        m = m.to("cpu", torch.int64)
        if E and (int(m.min()) < 0 or int(m.max()) >= logical):
            raise ValueError(
                f"physical_to_logical_map holds ids outside [0, {logical}) (the weights' experts)"
            )
        if logical == E and torch.equal(m, torch.arange(E)):
            return None
        return m

    def _check_shape(self, where: str, E: int, inter: int, hidden: int) -> None:
        if (inter, hidden) != (self.moe_intermediate_size, self.hidden_size):
            raise ValueError(
                f"{where}: experts are [I={inter}, H={hidden}], the wrapper was built for "
                f"moe_intermediate_size={self.moe_intermediate_size}, "
                f"hidden_size={self.hidden_size}"
            )

    def load_weights(self, physical_to_logical_map_cpu: Optional[Tensor] = None) -> None:
        """Load layer ``layer_idx`` from ``weight_path`` (kt-kernel ``load_weights``).

        What ``weight_path`` must hold depends on the method (module docstring);
        the readers are :class:`kt_ops.loaders.HFCheckpoint`,
        :class:`kt_ops.loaders.GGUFCheckpoint`, :class:`kt_ops.loaders.ConvertedExperts`
        and, for ``RAWINT4``, :class:`kt_ops.loaders.CompressedTensorsCheckpoint`.
        Readers are cached per path across wrappers (:meth:`force_release_loader`
        drops them).

        Args:
            physical_to_logical_map_cpu: optional integer ``[num_experts]``: physical
                expert ``p`` (the id in ``topk_ids``) computes with the weights of
                logical expert ``map[p]`` of the checkpoint (kt-kernel's expert
                placement map); None is the identity.

        Raises:
            FileNotFoundError: ``weight_path`` missing.
            ValueError: ``weight_path`` is None, holds kt-kernel's own converted
                layout, or a layer / format / shape that does not match; a bad map.
        """
        experts = load_experts(
            self._source(), self.method, self.mapping, self.layer_idx, self.group_size
        )
        where = f"{self.weight_path} layer {self.layer_idx}"
        self._check_shape(where, 0, experts.intermediate_size, experts.hidden_size)
        m = self._check_map(physical_to_logical_map_cpu, experts.num_experts)
        if m is not None:
            experts = ExpertWeights(*(p.select_experts(m) for p in experts.projections))
        self.experts = experts

    def load_weights_from_tensors(
        self,
        gate_proj: Tensor,
        up_proj: Tensor,
        down_proj: Tensor,
        physical_to_logical_map_cpu: Optional[Tensor] = None,
    ) -> None:
        """Quantize dense expert weights online (kt-kernel ``load_weights_from_tensors``).

        ``gate_proj``/``up_proj`` ``[E, I, H]`` and ``down_proj`` ``[E, H, I]``, any
        float dtype and device, packed into the method's format with
        :meth:`kt_ops.ExpertWeights.from_dense` (``int4`` with ``group_size``, or the
        method's own: per channel for ``AMXINT4_1``; zero points for ``AMXINT4_1`` and
        ``AMXINT4_1KGroup``), as :meth:`load_weights` quantizes a checkpoint.
        kt-kernel offers this for AMXINT4/AMXINT8/MOE_INT4/MOE_INT8 and also writes
        the quantized layer under ``weight_path``; kt_ops writes nothing and also
        accepts BF16, FP8 and RAWINT4 (int4, symmetric).

        Raises:
            NotImplementedError: ``LLAMAFILE`` (no GGUF type to quantize to; as kt-kernel).
            ValueError: shapes that do not match the wrapper, a bad map, or what
                ``quantize_weights`` raises.
        """
        fmt = self.mapping.weight_format
        if fmt is None:
            raise NotImplementedError(
                "LLAMAFILE does not support online quantization (load_weights_from_tensors), as "
                "in kt-kernel; load a GGUF file with load_weights(), or build the experts with "
                "kt_ops.ExpertWeights.from_dense(gate, up, down, 'q4_k')"
            )
        shapes = [
            tuple(t.shape) if isinstance(t, Tensor) else None
            for t in (gate_proj, up_proj, down_proj)
        ]
        E = shapes[0][0] if shapes[0] and len(shapes[0]) == 3 else None
        I, H = self.moe_intermediate_size, self.hidden_size  # noqa: E741
        if shapes != [(E, I, H), (E, I, H), (E, H, I)] or E is None:
            raise ValueError(
                f"load_weights_from_tensors: expected gate/up [E, {I}, {H}] and down "
                f"[E, {H}, {I}], got {shapes}"
            )
        m = self._check_map(physical_to_logical_map_cpu, E)
        if m is not None:
            gate_proj, up_proj, down_proj = (
                t[m.to(t.device)] for t in (gate_proj, up_proj, down_proj)
            )
        # The method's own group and symmetry (AMXINT4_1: per channel with zero points;
        # AMXINT4_1KGroup: zero points), as load_weights quantizes an HF checkpoint.
        group = self.mapping.group_size
        if group is None:
            group = self.group_size if group_choices(fmt) else None
        self.experts = ExpertWeights.from_dense(
            gate_proj, up_proj, down_proj, fmt, group_size=group, symmetric=self.mapping.symmetric
        )

    # ------------------------------------------------------------------ forward

    def _inputs(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor):
        if self.experts is None:
            raise RuntimeError(
                "KTMoEWrapper: no weights loaded; call load_weights() or "
                "load_weights_from_tensors()"
            )
        for name, t in (
            ("hidden_states", hidden_states),
            ("topk_ids", topk_ids),
            ("topk_weights", topk_weights),
        ):
            if not isinstance(t, Tensor):
                raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
        H, K = self.hidden_size, self.num_experts_per_tok
        if (
            hidden_states.dim() < 1
            or hidden_states.shape[-1] != H
            or not hidden_states.is_floating_point()
        ):
            raise ValueError(
                f"hidden_states must be a floating tensor [..., {H}] (hidden_size), got "
                f"{hidden_states.dtype} {list(hidden_states.shape)}"
            )
        x = hidden_states.reshape(-1, H)
        T = x.shape[0]
        if topk_ids.shape != (T, K) or topk_ids.is_floating_point() or topk_ids.dtype == torch.bool:
            raise ValueError(
                f"topk_ids must be an integer tensor [{T}, {K}] (tokens, num_experts_per_tok), got "
                f"{topk_ids.dtype} {list(topk_ids.shape)}"
            )
        if topk_weights.shape != (T, K) or not topk_weights.is_floating_point():
            raise ValueError(
                f"topk_weights must be a floating tensor [{T}, {K}], got {topk_weights.dtype} "
                f"{list(topk_weights.shape)}"
            )
        if len({hidden_states.device, topk_ids.device, topk_weights.device}) != 1:
            raise ValueError(
                "hidden_states, topk_ids and topk_weights must be on one device, got "
                f"{hidden_states.device}, {topk_ids.device}, {topk_weights.device}"
            )
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            x = x.float()
        ids = topk_ids if topk_ids.dtype in (torch.int32, torch.int64) else topk_ids.long()
        return x.contiguous(), ids.contiguous(), topk_weights.float().contiguous()

    def __getstate__(self) -> dict:
        # The prepared layer cannot be pickled or copied; it is rebuilt on use.
        state = self.__dict__.copy()
        state["_prepared"] = None
        return state

    def _prepared_forward(
        self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> Optional[Tensor]:
        """The CPU forward through a layer parsed once, or None where the full path must run.

        A serving engine calls the wrapper once per MoE layer per decode step; the
        full path (the checks of :meth:`_inputs`, the mask test, ``torch.ops``) costs
        about 200 µs more per call on cold caches than the prepared layer
        (``kt_ops._C.PreparedLayer``, csrc/ops/prepared_layer.cpp), which computes
        the op's output bit for bit. It returns None, and the full path then runs
        (and raises its errors), for anything but ``[T, H]`` bf16/fp16/fp32 hidden
        states with int32/int64 ``[T, K]`` ids and floating ``[T, K]`` weights on the
        CPU, outside grad mode, dispatch modes, subclasses and the profiler.
        """
        layer = self._current_prepared()
        return None if layer is None else layer.forward(hidden_states, topk_ids, topk_weights)

    def _current_prepared(self):
        """The prepared layer if it was built on the current experts and mask objects."""
        p = self._prepared
        if p is None or p[1] is not self.experts or p[2] is not self.gpu_experts_mask:
            return None
        return p[0]

    def _prepare(self) -> None:
        """(Re)build :attr:`_prepared` for the loaded experts and the current mask object."""
        experts, mask = self.experts, self.gpu_experts_mask
        self._prepared = None
        if experts is None or not (
            isinstance(mask, Tensor)
            and mask.device.type == "cpu"
            and mask.dtype == torch.bool
            and mask.shape == (self.num_experts,)
            and mask.is_contiguous()  # read live by the layer: in-place updates count
        ):
            return
        layer = ops.new_prepared_layer(
            experts, mask, self.num_experts_per_tok, activation=self.activation
        )
        if layer is not None:
            self._prepared = (layer, experts, mask)

    def _mask(self) -> Optional[Tensor]:
        mask = self.gpu_experts_mask
        return mask if bool(mask.any()) else None

    def submit_forward(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        cuda_stream: Any = None,
    ) -> None:
        """Start the routed experts of one batch (kt-kernel ``submit_forward``).

        Args:
            hidden_states: ``[T, H]`` (or ``[..., H]``, flattened) floating, CPU or CUDA.
            topk_ids: integer ``[T, K]``, ids in ``[-1, E)`` (-1 skips a slot).
            topk_weights: floating ``[T, K]``.
            cuda_stream: CUDA tensors: the stream to order the work on (a
                ``torch.cuda.Stream``, or its ``cuda_stream`` handle as kt-kernel
                takes it; None = the current stream); ignored for CPU tensors.

        CPU tensors run to completion here; :meth:`sync_forward` returns the result.

        Raises:
            RuntimeError: no weights loaded, or a forward already submitted and not synced.
            ValueError: wrong shapes, dtypes or devices (named).
        """
        if self._pending is not None:
            raise RuntimeError(
                "submit_forward called again before sync_forward; call sync_forward first"
            )
        out = self._prepared_forward(hidden_states, topk_ids, topk_weights)
        if out is not None:  # [T, H] in hidden_states' dtype already
            self._pending = _Pending(rows=out.shape[0], out=out)
            return
        x, ids, w = self._inputs(hidden_states, topk_ids, topk_weights)
        if x.is_cuda:
            self._pending = self._submit_cuda(x, ids, w, hidden_states.dtype, cuda_stream)
        else:
            if self._current_prepared() is None:
                self._prepare()  # for the next call
            out = _moe_forward_masked(x, ids, w, self.experts, self._mask(), self.activation)
            self._pending = _Pending(rows=x.shape[0], out=out.to(hidden_states.dtype))

    def sync_forward(self, hidden_states: Tensor, cuda_stream: Any = None) -> Tensor:
        """The result of the last :meth:`submit_forward` (kt-kernel ``sync_forward``).

        Returns ``[T, H]`` in the dtype and on the device of ``hidden_states``
        (flattened like kt-kernel's), a new tensor.

        Raises:
            RuntimeError: nothing submitted.
            ValueError: ``hidden_states`` has another token count than the submitted batch.
        """
        p = self._pending
        if p is None:
            raise RuntimeError("sync_forward called without submit_forward")
        rows = (
            hidden_states.numel() // max(1, hidden_states.shape[-1]) if hidden_states.dim() else -1
        )
        if rows != p.rows:
            raise ValueError(
                f"sync_forward: hidden_states has {rows} tokens, the submitted batch {p.rows}"
            )
        self._pending = None
        if p.out is not None:
            return p.out
        return self._finish_cuda(p)

    def forward(
        self,
        hidden_states: Tensor,
        topk_ids: Tensor,
        topk_weights: Tensor,
        cuda_stream: Any = None,
    ) -> Tensor:
        """:meth:`submit_forward` then :meth:`sync_forward` (kt-kernel ``forward``)."""
        self.submit_forward(hidden_states, topk_ids, topk_weights, cuda_stream)
        return self.sync_forward(hidden_states, cuda_stream)

    # ------------------------------------------------------------------ CUDA

    _cuda_bridge: ClassVar[Optional[bool]] = None

    @staticmethod
    def _stream(cuda_stream: Any, device: torch.device):
        if cuda_stream is None:
            return torch.cuda.current_stream(device)
        if isinstance(cuda_stream, torch.cuda.Stream):
            return cuda_stream
        return torch.cuda.ExternalStream(int(cuda_stream), device=device)

    def _submit_cuda(self, x, ids, w, dtype, cuda_stream) -> _Pending:  # pragma: no cover - GPU
        stream = self._stream(cuda_stream, x.device)
        with torch.cuda.stream(stream):
            if KTMoEWrapper._cuda_bridge is not False:
                try:
                    mask = self._mask()  # the op takes it on the device of hidden_states
                    mask = None if mask is None else mask.to(x.device, non_blocking=True)
                    out = _moe_forward_masked(x, ids, w, self.experts, mask, self.activation)
                    KTMoEWrapper._cuda_bridge = True
                    return _Pending(rows=x.shape[0], out=out.to(dtype))
                except RuntimeError as e:
                    if "on the CPU only" not in str(e):
                        raise
                    KTMoEWrapper._cuda_bridge = False
                    logger.info("kt_ops has no CUDA bridge: KTMoEWrapper copies through the host")
            host = tuple(
                torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for t in (x, ids, w)
            )
            event = torch.cuda.Event()
            event.record(stream)
        return _Pending(x.shape[0], None, host, event, stream, x.device, dtype)

    def _finish_cuda(self, p: _Pending) -> Tensor:  # pragma: no cover - GPU
        p.event.synchronize()
        x, ids, w = p.host_inputs
        out = (
            _moe_forward_masked(x, ids, w, self.experts, self._mask(), self.activation)
            .to(p.dtype)
            .pin_memory()
        )
        with torch.cuda.stream(p.stream):
            return out.to(p.device, non_blocking=True)

    # ------------------------------------------------------------------ kt-kernel statics

    @staticmethod
    def set_capture_batch_sizes(capture_bs: list[int]) -> None:
        """Recorded only: kt_ops keeps no per-batch-size buffers (kt-kernel pre-allocates them)."""
        KTMoEWrapper._capture_batch_sizes = list(capture_bs)

    @staticmethod
    def get_capture_batch_sizes() -> list[int]:
        """The list given to :meth:`set_capture_batch_sizes`."""
        return KTMoEWrapper._capture_batch_sizes

    @staticmethod
    def clear_buffer_cache() -> None:
        """No-op: kt_ops keeps no input/output buffers."""

    @staticmethod
    def clear_sft_buffer_cache() -> None:
        """No-op (kt-kernel's SFT buffers)."""

    @staticmethod
    def force_release_loader() -> None:
        """Drop the cached checkpoint readers (as kt-kernel's ``force_release_loader``)."""
        KTMoEWrapper._sources.clear()

    def _refused(self, name: str, what: str):
        raise NotImplementedError(f"KTMoEWrapper.{name} ({what}) is not supported by kt_ops.compat")

    def select_deferred_experts(self, *args, **kwargs):
        """Refused: kt-kernel's deferred experts (NotImplementedError)."""
        self._refused("select_deferred_experts", "deferred experts")

    def copy_inputs_to_cpu_buffers(self, *args, **kwargs):
        """Refused: kt-kernel's NPU graph host-callback path (NotImplementedError)."""
        self._refused("copy_inputs_to_cpu_buffers", "NPU graph host callbacks")

    def forward_on_pinned_buffers(self, *args, **kwargs):
        """Refused: kt-kernel's NPU graph host-callback path (NotImplementedError)."""
        self._refused("forward_on_pinned_buffers", "NPU graph host callbacks")

    def run_pinned_forward_sync(self, *args, **kwargs):
        """Refused: kt-kernel's NPU graph host-callback path (NotImplementedError)."""
        self._refused("run_pinned_forward_sync", "NPU graph host callbacks")

    def copy_forward_output_to_device(self, *args, **kwargs):
        """Refused: kt-kernel's NPU graph host-callback path (NotImplementedError)."""
        self._refused("copy_forward_output_to_device", "NPU graph host callbacks")

    def submit_write_weight_scale_to_buffer(self, *args, **kwargs):
        """Refused: kt-kernel's GPU layerwise prefill (NotImplementedError)."""
        self._refused("submit_write_weight_scale_to_buffer", "GPU layerwise prefill")

    def sync_write_weight_scale_to_buffer(self, *args, **kwargs):
        """Refused: kt-kernel's GPU layerwise prefill (NotImplementedError)."""
        self._refused("sync_write_weight_scale_to_buffer", "GPU layerwise prefill")

    def run_layerwise_fp8_batch(self, *args, **kwargs):
        """Refused: kt-kernel's GPU layerwise prefill (NotImplementedError)."""
        self._refused("run_layerwise_fp8_batch", "GPU layerwise prefill")

    def __repr__(self) -> str:
        fmt = self.experts.weight_format if self.experts is not None else "not loaded"
        return (
            f"KTMoEWrapper(layer_idx={self.layer_idx}, method={self.method!r} -> {fmt}, "
            f"E={self.num_experts}, K={self.num_experts_per_tok}, H={self.hidden_size}, "
            f"I={self.moe_intermediate_size}, gpu_experts={self.num_gpu_experts})"
        )
