"""The one interface of the checkpoint readers: :class:`CheckpointReader`.

Every reader (Hugging Face safetensors, GGUF, compressed-tensors int4, a
``kt-ops convert`` directory) reads the routed experts of one MoE layer at a
time and returns them as one :class:`kt_ops.layer.ExpertWeights`, the layer
description the ops, ``MoEExperts`` and ``KTMoEWrapper`` take.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import ClassVar, Optional

from kt_ops.formats import PackedProjection
from kt_ops.layer import ExpertWeights
from kt_ops.loaders._common import check_format

__all__ = ["CheckpointReader", "expert_weights"]


class CheckpointReader(abc.ABC):
    """A checkpoint's routed experts, read one MoE layer at a time.

    Attributes (every reader sets them):
        kind: what it reads (``"hf_safetensors"``, ``"gguf"``,
            ``"compressed_tensors_int4"``, ``"converted"``).
        path: the file or directory it reads.
        layers: the MoE layers :meth:`load_layer` reads, ascending.

    ``layer in reader`` tests ``layers``.
    """

    kind: ClassVar[str]
    path: Path
    layers: list[int]

    @abc.abstractmethod
    def layer_shape(self, layer: int) -> tuple[int, int, int]:
        """``(E, I, H)`` of MoE layer ``layer``; ValueError if it has no experts."""

    @abc.abstractmethod
    def load_layer(
        self,
        layer: int,
        weight_format: Optional[str] = None,
        group_size: Optional[int] = None,
        symmetric: bool = True,
    ) -> ExpertWeights:
        """The experts of ``layer``, packed: gate, up ``[E, I, H]``, down ``[E, H, I]``.

        ``weight_format`` None keeps the source's own format (each tensor's, for
        sources that mix them); a format name packs (quantizes) to it where the
        reader can. ``group_size`` and ``symmetric`` are the quantizer's
        (:func:`kt_ops.formats.quantize_weights`). Raises ValueError for an
        unknown layer or format, or one the source cannot be packed as.
        """

    def check_weight_format(self, layer: int, weight_format: Optional[str]) -> None:
        """Raise ValueError unless ``load_layer(layer, weight_format)`` can pack every tensor.

        Checks the format name and the layer (not the tensors); readers of packed
        sources also refuse a format other than their own.
        """
        check_format(weight_format)
        if layer not in self.layers:
            raise ValueError(f"{self.path}: layer {layer} has no routed experts: {self.layers}")

    def __contains__(self, layer: object) -> bool:
        return layer in self.layers


def expert_weights(
    gate: PackedProjection, up: PackedProjection, down: PackedProjection, where: str
) -> ExpertWeights:
    """The :class:`ExpertWeights` a reader returns; ValueError prefixed by ``where`` when the
    projections disagree on ``E``, ``I`` or ``H``."""
    try:
        return ExpertWeights(gate, up, down)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
