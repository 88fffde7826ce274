"""Weight loaders: the routed experts of a checkpoint, one MoE layer at a time, packed for kt_ops.

* :class:`HFCheckpoint` (``hf_checkpoint.py``): Hugging Face safetensors
  directories (bf16/fp16/fp32, DeepSeek-V3 fp8, gpt-oss MXFP4; per-expert or
  fused transformers-v5 tensors).
* :class:`GGUFCheckpoint` (``gguf_file.py``): llama.cpp GGUF files
  (``blk.{L}.ffn_{gate,up,down}_exps.weight``).
* :func:`open_checkpoint`: either of them, chosen from the path.

Both have the same interface: ``path``, ``kind``, ``num_layers``,
``moe_layers``, ``num_experts``, ``hidden_size``, ``intermediate_size``,
``source_dtype``, ``native_format``, ``layer_shape(layer) -> (E, I, H)`` and
``load_layer(layer, weight_format=None, group_size=None, symmetric=True) ->
{"gate", "up", "down": PackedProjection}``. A converted directory
(:class:`kt_ops.convert.ConvertedExperts`) reads back the same dicts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from kt_ops.loaders.gguf_file import GGUFCheckpoint
from kt_ops.loaders.hf_checkpoint import HFCheckpoint

__all__ = ["GGUFCheckpoint", "HFCheckpoint", "open_checkpoint"]

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
