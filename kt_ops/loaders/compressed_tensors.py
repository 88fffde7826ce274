"""Routed experts of a compressed-tensors ``pack-quantized`` int4 checkpoint (kt-kernel's RAWINT4).

:class:`CompressedTensorsCheckpoint` reads the tensors as kt-kernel's
``CompressedSafeTensorLoader`` does:
``{prefix}layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight_packed``
(int32 ``[N, K/8]``, eight 4-bit codes a word, first code in the low bits; or
uint8 ``[N, K/2]``, first code in the low nibble), ``.weight_scale`` (bf16
``[N, K/group]``) and optionally ``.weight_shape`` (``[N, K]``). A stored code
``c`` in ``[0, 16)`` means the weight ``scale * (c - 8)``: kt_ops' symmetric
``int4``. Its scales convert to fp16 exactly when they lie in fp16's normal
range (int4 scales of real checkpoints do); otherwise they stay bf16, which the
op also reads. Either way the packed weights are exact.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import safe_open
from torch import Tensor

from kt_ops.formats import PackedProjection, format_spec, pack_codes, pack_group_params
from kt_ops.layer import PROJECTIONS, ExpertWeights
from kt_ops.loaders._common import check_format
from kt_ops.loaders.base import CheckpointReader, expert_weights

__all__ = ["CompressedTensorsCheckpoint", "safetensors_files", "tensor_names"]

#: The format the stored codes and scales are, exactly.
_FORMAT = "int4"

_WEIGHT_PACKED_RE = re.compile(
    r"^(?P<prefix>(?:.+\.)?)layers\.(?P<layer>\d+)\.mlp\.experts\.(?P<expert>\d+)\."
    r"(?P<proj>gate|up|down)_proj\.weight_packed$"
)


def safetensors_files(path: Path) -> list[Path]:
    """The ``*.safetensors`` files of ``path`` (a file, or a folder with or without an index)."""
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: cannot read its weight_map ({e})") from e
        return sorted({path / str(f) for f in wmap.values()})
    return sorted(path.glob("*.safetensors"))


def tensor_names(files: list[Path]) -> dict[str, Path]:
    """Tensor name -> the file holding it, from the files' headers (ValueError for a bad file)."""
    out = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for name in h.keys():
                    out[name] = f
        except Exception as e:
            raise ValueError(f"{f}: not a valid safetensors file: {e}") from e
    return out


class CompressedTensorsCheckpoint(CheckpointReader):
    """The routed experts of a compressed-tensors ``pack-quantized`` int4 checkpoint.

    Args:
        path: a safetensors file or a folder of them (with or without an index).

    Attributes:
        path; ``kind``: ``"compressed_tensors_int4"``; ``layers`` (= ``moe_layers``):
        the layers with ``weight_packed`` experts.

    Raises:
        FileNotFoundError: no safetensors file.
        ValueError: an invalid file, no such experts, or experts under several prefixes.
    """

    kind = "compressed_tensors_int4"

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        files = safetensors_files(self.path)
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors files (RAWINT4 checkpoint)")
        self._names = tensor_names(files)
        layers: dict[int, dict[tuple[int, str], str]] = {}
        prefixes = set()
        for name in self._names:
            m = _WEIGHT_PACKED_RE.match(name)
            if m:
                prefixes.add(m["prefix"])
                layers.setdefault(int(m["layer"]), {})[(int(m["expert"]), m["proj"])] = name
        if not layers:
            raise ValueError(
                f"{self.path}: no compressed-tensors int4 experts (names like "
                "'model.layers.{L}.mlp.experts.{e}.gate_proj.weight_packed') for method RAWINT4"
            )
        if len(prefixes) > 1:
            raise ValueError(
                f"{self.path}: RAWINT4 experts under several prefixes {sorted(prefixes)}"
            )
        self._layers = layers
        self.moe_layers = self.layers = sorted(layers)

    def _get(self, name: str) -> Tensor:
        if name not in self._names:
            raise ValueError(f"{self.path}: tensor {name} is missing")
        with safe_open(str(self._names[name]), framework="pt") as h:
            return h.get_tensor(name)

    def _check_layer(self, layer: int) -> dict[tuple[int, str], str]:
        if layer not in self._layers:
            raise ValueError(
                f"{self.path}: layer {layer} has no RAWINT4 experts; MoE layers: {self.moe_layers}"
            )
        return self._layers[layer]

    def layer_shape(self, layer: int) -> tuple[int, int, int]:
        """``(E, I, H)`` of ``layer``, from the headers of its gate tensor of expert 0."""
        entries = self._check_layer(layer)
        name = entries.get((0, "gate"))
        if name is None:
            raise ValueError(f"{self.path}: layer {layer} expert 0 has no gate_proj.weight_packed")
        with safe_open(str(self._names[name]), framework="pt") as h:
            sl = h.get_slice(name)
            shape, dtype = sl.get_shape(), sl.get_dtype()
        per_byte = {"I32": 8, "U8": 2}.get(dtype)
        if per_byte is None or len(shape) != 2:
            raise ValueError(
                f"{self.path}: {name} is {dtype} {list(shape)}; expected int32 [N, K/8] or uint8 "
                "[N, K/2]"
            )
        return max(e for e, _ in entries) + 1, int(shape[0]), int(shape[1]) * per_byte

    def check_weight_format(self, layer: int, weight_format: Optional[str]) -> None:
        """The weights load as stored: ``weight_format`` must be None or ``'int4'``."""
        check_format(weight_format)
        self._check_layer(layer)
        if weight_format not in (None, _FORMAT):
            raise ValueError(
                f"{self.path}: compressed-tensors int4 experts load as {_FORMAT!r} only, not "
                f"{weight_format!r}"
            )

    def load_layer(
        self,
        layer: int,
        weight_format: Optional[str] = None,
        group_size: Optional[int] = None,
        symmetric: bool = True,
    ) -> ExpertWeights:
        """The experts of ``layer`` as symmetric ``int4``, exactly as stored.

        ``weight_format`` must be None or ``'int4'``; ``group_size`` and
        ``symmetric`` are not used (the group comes from the scales' shape).
        Raises ValueError for a missing or malformed tensor (named) or a group
        size kt_ops' int4 does not take.
        """
        self.check_weight_format(layer, weight_format)
        entries = self._layers[layer]
        num_experts = max(e for e, _ in entries) + 1
        out = {}
        for role in PROJECTIONS:
            out[role] = self._load_projection(layer, role, entries, num_experts)
        return expert_weights(**out, where=f"{self.path}: layer {layer}")

    def _load_projection(
        self, layer: int, role: str, entries: dict[tuple[int, str], str], num_experts: int
    ) -> PackedProjection:
        codes, scales = [], []
        for e in range(num_experts):
            name = entries.get((e, role))
            if name is None:
                raise ValueError(
                    f"{self.path}: layer {layer} expert {e} has no {role}_proj.weight_packed"
                )
            base = name[: -len("weight_packed")]
            w = self._get(name)
            s = self._get(base + "weight_scale")
            if w.dtype == torch.int32:
                w = w.contiguous().view(torch.uint8)  # little-endian: first codes first
            if w.dtype != torch.uint8 or w.dim() != 2:
                raise ValueError(
                    f"{self.path}: {name} is {w.dtype} {list(w.shape)}; expected int32 "
                    "[N, K/8] or uint8 [N, K/2]"
                )
            n, k = int(w.shape[0]), int(w.shape[1]) * 2
            if s.dim() != 2 or s.shape[0] != n or s.shape[1] < 1 or k % s.shape[1]:
                raise ValueError(
                    f"{self.path}: {base}weight_scale has shape {list(s.shape)}; expected "
                    f"[{n}, K/group] for K={k}"
                )
            codes.append(torch.stack([w & 15, w >> 4], dim=-1).view(n, k))
            scales.append(s.to(torch.bfloat16))
        q = torch.stack(codes)
        s = torch.stack(scales)
        E, n, k = q.shape
        group = k // s.shape[2]
        groups = format_spec(_FORMAT).group_sizes
        if group not in groups:
            raise ValueError(
                f"{self.path}: layer {layer} {role}: RAWINT4 group size {group} (K={k}, "
                f"{s.shape[2]} scales a row); kt_ops int4 takes groups of {groups}"
            )
        # kt_ops int4 stores fp16 scales; bf16 ones convert exactly unless they are
        # tiny (fp16 subnormals) or huge. Then they stay bf16, which the op reads too
        # (validate() and the reference dequantizer want fp16, so check against those).
        s16 = s.to(torch.float16)
        exact = bool(torch.equal(s16.to(torch.bfloat16), s))
        p = PackedProjection(
            pack_codes(q, 4, pad_code=8),
            pack_group_params(s16 if exact else s, s16.dtype if exact else s.dtype),
            None,
            _FORMAT,
            group,
            n,
            k,
        )
        dataclasses.replace(p, scales=p.scales.to(torch.float16)).validate()
        return p
