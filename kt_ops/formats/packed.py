"""``PackedProjection``: one projection (gate, up or down) of all experts, packed."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from kt_ops import _C
from kt_ops.formats.spec import FormatSpec, format_spec, padded_k

__all__ = ["PackedProjection", "empty_huge_pages", "cat_experts", "huge_pages"]


def huge_pages() -> dict:
    """Whether kt_ops puts packed weights in transparent huge pages, and why.

    ``{'thp_mode': 'always' | 'madvise' | 'never' | 'unavailable', 'enabled': bool,
    'page_bytes': 2097152}``: ``thp_mode`` is the kernel's
    (``/sys/kernel/mm/transparent_hugepage/enabled``); ``enabled`` is true when it is
    ``always`` or ``madvise`` and ``KT_OPS_HUGE_PAGES`` is unset or ``1`` (``0``
    turns it off; read once; another value raises ``ValueError`` naming it).
    """
    return dict(_C.huge_pages())


def empty_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialised contiguous CPU tensor, in 2 MiB pages when it holds at least 2 MiB.

    A decode call streams every packed weight once; in 4 KiB pages that is a TLB
    miss per 4 KiB and a stop of the hardware prefetchers at every page boundary
    (docs/architecture.md, "Huge pages"). Where :func:`huge_pages` is not
    ``enabled``, or the tensor is smaller than a huge page, this is
    ``torch.empty``. Else the tensor gets a mapping of its own, 2 MiB-aligned,
    advised ``MADV_HUGEPAGE`` (madvise(2)) and unmapped with the tensor: its
    whole 2 MiB are huge pages once touched, a last partial one base pages.

    Raises:
        ValueError: a negative size; a malformed ``KT_OPS_HUGE_PAGES``.
        MemoryError: the memory is not there.
    """
    if any(s < 0 for s in shape):
        raise ValueError(f"empty_huge_pages: negative size in {tuple(shape)}")
    nbytes = math.prod(shape) * dtype.itemsize
    return _C.empty_huge_pages(nbytes).view(dtype).view(tuple(shape))


def cat_experts(tensors: list[Tensor]) -> Tensor:
    """``torch.cat(tensors, dim=0)`` (chunks of experts) into :func:`empty_huge_pages` memory.

    One tensor is copied there (so a packed tensor made by torch's allocator
    moves into huge pages), unless it starts on a 2 MiB boundary already (this
    function's, or torch's allocator under ``THP_MEM_ALLOC_ENABLE=1``): then it
    is returned as it is. CUDA tensors are concatenated by ``torch.cat``.
    """
    first = tensors[0]
    if len(tensors) == 1 and (
        first.device.type != "cpu"
        or (first.is_contiguous() and first.data_ptr() % _C.huge_pages()["page_bytes"] == 0)
    ):
        return first
    if first.device.type != "cpu":
        return torch.cat(tensors, dim=0)
    shape = (sum(int(t.shape[0]) for t in tensors), *first.shape[1:])
    return torch.cat(tensors, dim=0, out=empty_huge_pages(shape, first.dtype))


@dataclass
class PackedProjection:
    """Packed weights of one projection of ``E`` experts, in the layout of docs/formats.md.

    Fields:
        weight: the packed weight tensor (bf16 ``[E, NB, ceil(k/2), 16, 2]``;
            uint8 ``[E, NB, 16*Kp*bits/8]`` for the qint formats; uint8
            ``[E, NB, Kp, 16]`` (n16k1) for fp8).
        scales: ``[E, NB, G, 16]`` in the format's scale dtype (fp8:
            fp32 ``[E, ceil(n/128), ceil(k/128)]``; GGUF k-quants: uint8
            super-block records ``[E, NB, Kp/256, 256 | 288]``), or ``None``
            for bf16.
        zeros: ``[E, NB, G, 16]`` in weight units (``W = scale*q - zero``), or
            ``None`` where the zero is implicit.
        weight_format: one of ``FORMATS``.
        group_size: K elements per scale (0 = per output channel; fp8: 128).
        n, k: unpadded output rows and inputs of the dense ``[E, n, k]`` weights.
        bias: ``None``, or fp32 ``[E, n]``: a per-expert bias added to the
            projection's output (gpt-oss); not part of the packed format, so
            not in :meth:`tensors`.
    """

    weight: Tensor
    scales: Optional[Tensor]
    zeros: Optional[Tensor]
    weight_format: str
    group_size: int
    n: int
    k: int
    bias: Optional[Tensor] = None

    @property
    def spec(self) -> FormatSpec:
        """The :class:`FormatSpec` of ``weight_format`` (ValueError if unknown)."""
        return format_spec(self.weight_format)

    @property
    def num_experts(self) -> int:
        """``E``, the leading dimension of every tensor."""
        return int(self.weight.shape[0])

    def tensors(self) -> dict[str, Tensor]:
        """``{'weight': ..., 'scales': ..., 'zeros': ...}`` without the ``None`` entries."""
        out = {"weight": self.weight, "scales": self.scales, "zeros": self.zeros}
        return {name: t for name, t in out.items() if t is not None}

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors (weight, scales, zeros), padding included."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def bits_per_weight(self) -> float:
        """``8 * nbytes / (E * n * k)``: storage per real weight, padding and scales included."""
        return 8.0 * self.nbytes / (self.num_experts * self.n * self.k)

    def validate(self) -> PackedProjection:
        """Check every field against the format's layout; returns ``self``.

        Raises:
            ValueError: naming the first bad field (``weight_format``, ``n``,
                ``k``, ``group_size``, ``weight``, ``scales`` or ``zeros``):
                unknown format, non-positive sizes, a group size the format
                does not allow or that does not divide ``Kp``, a tensor of the
                wrong type, dtype, shape, device, or not contiguous, a missing
                required tensor or an extra one.
        """
        spec = format_spec(self.weight_format)
        for name in ("n", "k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ValueError(f"PackedProjection.{name} must be a positive int, got {v!r}")
        gs = self.group_size
        if isinstance(gs, bool) or not isinstance(gs, int) or gs not in spec.group_sizes:
            raise ValueError(
                f"PackedProjection.group_size={gs!r} is not allowed for {spec.name!r}; "
                f"allowed: {spec.group_sizes}"
            )
        if spec.is_kquant and self.k % spec.super_block:
            raise ValueError(
                f"PackedProjection.k={self.k} is not a multiple of the {spec.name!r} "
                f"super-block ({spec.super_block})"
            )
        if spec.is_grid and self.k % spec.gguf_block[0]:
            raise ValueError(
                f"PackedProjection.k={self.k} is not a multiple of the {spec.name!r} "
                f"block ({spec.gguf_block[0]})"
            )
        if spec.layout == "qint" and gs and padded_k(self.k) % gs:
            raise ValueError(
                f"PackedProjection.group_size={gs} does not divide the padded K "
                f"({padded_k(self.k)}) of k={self.k}"
            )
        w = self.weight
        if not isinstance(w, Tensor) or w.dim() < 1:
            raise ValueError(f"PackedProjection.weight must be a tensor, got {type(w).__name__}")
        e = int(w.shape[0])
        if e < 1:
            raise ValueError("PackedProjection.weight has no experts (E = 0)")
        expect = {"weight": (spec.weight_shape(e, self.n, self.k), spec.weight_dtype())}
        sshape = spec.scales_shape(e, self.n, self.k, gs)
        if sshape is not None:
            expect["scales"] = (sshape, spec.scale_dtype)
            # fp32 scales: exact repacks of checkpoints whose scales fp16 cannot hold.
            if spec.has_zeros and isinstance(self.scales, Tensor):
                if self.scales.dtype == torch.float32:
                    expect["scales"] = (sshape, torch.float32)
        if spec.has_zeros and (self.zeros is not None or spec.zeros_required):
            expect["zeros"] = (sshape, spec.scale_dtype)
            # fp32 zero points hold scale * z exactly (GPTQ/AWQ/compressed-tensors repacks).
            if self.zeros is not None and self.zeros.dtype == torch.float32:
                expect["zeros"] = (sshape, torch.float32)
        for name in ("weight", "scales", "zeros"):
            t = getattr(self, name)
            if name not in expect:
                if t is not None:
                    raise ValueError(
                        f"PackedProjection.{name} must be None for {spec.name!r}, "
                        f"got a tensor of shape {tuple(t.shape)}"
                    )
                continue
            shape, dtype = expect[name]
            if not isinstance(t, Tensor):
                raise ValueError(
                    f"PackedProjection.{name} is required for {spec.name!r}: expected a "
                    f"{dtype} tensor {list(shape)}, got {type(t).__name__}"
                )
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise ValueError(
                    f"PackedProjection.{name} has {t.dtype} {list(t.shape)}, expected {dtype} "
                    f"{list(shape)} for {spec.name!r} with n={self.n}, k={self.k}, "
                    f"group_size={gs}"
                )
            if t.device != w.device:
                raise ValueError(f"PackedProjection.{name} is on {t.device}, weight on {w.device}")
            if not t.is_contiguous():
                raise ValueError(f"PackedProjection.{name} must be contiguous")
        b = self.bias
        if b is not None:
            if (
                not isinstance(b, Tensor)
                or b.dtype != torch.float32
                or tuple(b.shape) != (e, self.n)
            ):
                got = f"{b.dtype} {list(b.shape)}" if isinstance(b, Tensor) else type(b).__name__
                raise ValueError(
                    f"PackedProjection.bias must be None or fp32 [E={e}, n={self.n}], got {got}"
                )
            if b.device != w.device or not b.is_contiguous():
                raise ValueError(
                    f"PackedProjection.bias must be contiguous and on the weight's device "
                    f"({w.device}), got {b.device}"
                )
        return self

    def select_experts(self, ids: Tensor) -> PackedProjection:
        """A copy holding experts ``ids`` (integer ``[m]``, in that order; repeats allowed).

        Every packed tensor is indexed by expert first, so this picks along dim 0
        (``ids`` is moved to the tensors' device); ``n``, ``k``, format and group
        size stay. Used for expert placement maps and GPU-resident expert copies.
        """
        picked = {
            name: None if t is None else t.index_select(0, ids.to(t.device)).contiguous()
            for name, t in self._fields().items()
        }
        return dataclasses.replace(self, **picked)

    def in_huge_pages(self) -> PackedProjection:
        """A copy whose weight, scales and zeros are in :func:`empty_huge_pages` memory.

        ``quantize_weights``, the checkpoint loaders and ``ExpertWeights.from_dense``
        return their packed tensors there already; this is for tensors made
        elsewhere (torch's allocator puts them in 4 KiB pages). A converted
        directory's memory-mapped tensors are better left where they are: the
        ranks of one host share their page-cache pages. Tensors on other devices
        are kept as they are.
        """
        moved = {
            name: None if t is None else cat_experts([t])
            for name, t in (("weight", self.weight), ("scales", self.scales), ("zeros", self.zeros))
        }
        return dataclasses.replace(self, **moved)

    def to(self, device: torch.device | str) -> PackedProjection:
        """A copy with every tensor moved to ``device``."""
        moved = {k: (t.to(device) if t is not None else None) for k, t in self._fields().items()}
        return PackedProjection(
            **moved,
            weight_format=self.weight_format,
            group_size=self.group_size,
            n=self.n,
            k=self.k,
        )

    def _fields(self) -> dict[str, Optional[Tensor]]:
        return {
            "weight": self.weight,
            "scales": self.scales,
            "zeros": self.zeros,
            "bias": self.bias,
        }
