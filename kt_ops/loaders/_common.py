"""Pieces shared by the loaders: format checks, chunked packing.

Every loader reads one MoE layer at a time and packs each projection in chunks
of experts (:func:`pack_in_chunks`), so the dense (fp32) copy that quantization
needs never holds more than about :data:`CHUNK_BYTES` at once. The packed
chunks are concatenated along the expert dimension: every tensor of a
:class:`~kt_ops.formats.PackedProjection` has the expert as its first dimension
(see docs/formats.md), and every format quantizes each expert independently,
so the result equals packing the whole layer at once.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from kt_ops.formats import FORMATS, PackedProjection
from kt_ops.formats.packed import cat_experts

#: Upper bound, in bytes, of the fp32 copy of one chunk of experts being quantized.
CHUNK_BYTES = 256 << 20


def check_format(weight_format: Optional[str], *, allow_none: bool = True) -> None:
    """Raise ValueError unless ``weight_format`` is one of ``FORMATS`` (or None if allowed)."""
    if weight_format is None and allow_none:
        return
    if weight_format not in FORMATS:
        raise ValueError(
            f"weight_format={weight_format!r} is not a kt_ops weight format; expected one of "
            f"{', '.join(FORMATS)}"
            + (" (or None for the source's own format)" if allow_none else "")
        )


def experts_per_chunk(n: int, k: int, num_experts: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """How many ``[n, k]`` experts fit in ``chunk_bytes`` of fp32 (at least 1, at most all)."""
    per_expert = max(1, n * k * 4)
    return max(1, min(num_experts, chunk_bytes // per_expert))


def concat_packed(parts: list[PackedProjection]) -> PackedProjection:
    """Concatenate packed chunks of consecutive experts along the expert dimension (dim 0)."""
    first = parts[0]
    for p in parts[1:]:
        same = (p.weight_format, p.group_size, p.n, p.k) == (
            first.weight_format,
            first.group_size,
            first.n,
            first.k,
        )
        if not same:  # pragma: no cover - internal invariant
            raise ValueError("packed chunks disagree on format, group size or shape")

    def cat(name: str) -> Optional[torch.Tensor]:
        ts = [getattr(p, name) for p in parts]
        if ts[0] is None:
            return None
        return cat_experts(ts)  # into huge pages (one part: copied there)

    biases = [p.bias for p in parts]
    return PackedProjection(
        weight=cat("weight"),
        scales=cat("scales"),
        zeros=cat("zeros"),
        weight_format=first.weight_format,
        group_size=first.group_size,
        n=first.n,
        k=first.k,
        bias=None if biases[0] is None else torch.cat(biases),
    )


def pack_in_chunks(
    num_experts: int,
    n: int,
    k: int,
    pack_chunk: Callable[[int, int], PackedProjection],
    chunk_bytes: Optional[int] = None,
) -> PackedProjection:
    """Call ``pack_chunk(e0, e1)`` for consecutive expert ranges and concatenate the results.

    ``chunk_bytes`` defaults to the module's :data:`CHUNK_BYTES` at call time.
    """
    budget = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    step = experts_per_chunk(n, k, num_experts, budget)
    parts = [pack_chunk(e0, min(e0 + step, num_experts)) for e0 in range(0, num_experts, step)]
    return concat_packed(parts).validate()
