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
* :class:`QuantizedCheckpoint` (``quantized_linear.py``): checkpoints published
  quantized: GPTQ, AWQ, compressed-tensors (int4, NVFP4, MXFP4, fp8) and
  DeepSeek-V4's MXFP4 experts, exactly where a kt_ops format represents them.
* :func:`open_checkpoint`: any of them, chosen from the path (the sources
  ``kt-ops convert`` and ``replace_experts(checkpoint=...)`` read).

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
from kt_ops.loaders.quantized_linear import QuantizedCheckpoint, quantization_scheme
from kt_ops.loaders.safetensors_io import read_json

__all__ = [
    "CheckpointReader",
    "CompressedTensorsCheckpoint",
    "ConvertedExperts",
    "GGUFCheckpoint",
    "HFCheckpoint",
    "QuantizedCheckpoint",
    "load_converted",
    "open_checkpoint",
]

_GGUF_MAGIC = b"GGUF"


def open_checkpoint(path: Union[str, Path]) -> CheckpointReader:
    """Open ``path`` with the reader its contents call for.

    A GGUF file (``.gguf`` or GGUF magic): :class:`GGUFCheckpoint`; a checkpoint whose
    ``config.json`` has a GPTQ, AWQ, compressed-tensors or ModelOpt
    ``quantization_config``, or whose expert tensors are DeepSeek-V4 MXFP4, MXFP8 or
    fp8 per output channel: :class:`QuantizedCheckpoint`; any other Hugging Face
    checkpoint: :class:`HFCheckpoint`.

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
    folder = p if p.is_dir() else p.parent
    cfg = folder / "config.json"
    config = read_json(cfg) if cfg.is_file() else {}
    if isinstance(config, dict) and quantization_scheme(config, str(cfg)) is not None:
        return QuantizedCheckpoint(p)
    try:  # schemes known by their tensors: DeepSeek-V4 MXFP4, MXFP8, fp8 per channel
        return QuantizedCheckpoint(p)
    except (ValueError, FileNotFoundError):
        pass
    return HFCheckpoint(p)
