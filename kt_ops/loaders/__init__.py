"""Checkpoint readers: the routed experts of a checkpoint, one MoE layer at a time, packed.

Every reader is a :class:`CheckpointReader` (``base.py``): ``path``, ``kind``,
``layers`` (the MoE layers it reads), ``layer_shape(layer) -> (E, I, H)``,
``check_weight_format(layer, weight_format)`` and ``load_layer(layer,
weight_format=None, group_size=None, symmetric=True) ->``
:class:`kt_ops.layer.ExpertWeights`.

* :class:`HFCheckpoint` (``hf_checkpoint.py``): Hugging Face safetensors
  directories (bf16/fp16/fp32, DeepSeek-V3 fp8, gpt-oss MXFP4; per-expert or
  fused transformers-v5 tensors).
* :class:`GGUFCheckpoint` (``gguf_file.py``): llama.cpp GGUF files
  (``blk.{L}.ffn_{gate,up,down}_exps.weight``).
* :class:`CompressedTensorsCheckpoint` (``compressed_tensors.py``):
  compressed-tensors ``pack-quantized`` int4 (kt-kernel's RAWINT4), as stored.
* :class:`ConvertedExperts` (``converted.py``): a ``kt-ops convert``
  directory, as converted (:mod:`kt_ops.convert` writes it).
* :func:`open_checkpoint`: a GGUF file or a Hugging Face checkpoint, chosen
  from the path (the sources ``kt-ops convert`` reads).

HFCheckpoint and GGUFCheckpoint also have ``num_layers``, ``moe_layers``
(= ``layers``), ``num_experts``, ``hidden_size``, ``intermediate_size``,
``source_dtype`` and ``native_format``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from kt_ops.loaders.base import CheckpointReader
from kt_ops.loaders.compressed_tensors import CompressedTensorsCheckpoint
from kt_ops.loaders.converted import ConvertedExperts, load_converted
from kt_ops.loaders.gguf_file import GGUFCheckpoint
from kt_ops.loaders.hf_checkpoint import HFCheckpoint

__all__ = [
    "CheckpointReader",
    "CompressedTensorsCheckpoint",
    "ConvertedExperts",
    "GGUFCheckpoint",
    "HFCheckpoint",
    "load_converted",
    "open_checkpoint",
]

_GGUF_MAGIC = b"GGUF"


def open_checkpoint(path: Union[str, Path]) -> Union[HFCheckpoint, GGUFCheckpoint]:
    """Open ``path`` as a GGUF file (``.gguf`` or GGUF magic) or a Hugging Face checkpoint.

    Raises FileNotFoundError when ``path`` does not exist, and whatever the chosen
    loader raises (ValueError for unreadable or unsupported checkpoints).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p} does not exist")
    if p.is_file():
        try:
            with open(p, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise ValueError(f"{p}: cannot read it: {e}") from e
        if p.suffix == ".gguf" or magic == _GGUF_MAGIC:
            return GGUFCheckpoint(p)
    return HFCheckpoint(p)
