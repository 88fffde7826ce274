"""Routed experts of a GGUF file (llama.cpp), one MoE layer at a time.

:class:`GGUFCheckpoint` reads the stacked expert tensors that llama.cpp's
converters write for MoE models (``gguf`` Python package, ``constants.py``
``MODEL_TENSOR.FFN_*_EXP``):

* ``blk.{L}.ffn_gate_exps.weight``, ``blk.{L}.ffn_up_exps.weight``: dims
  ``(ne0, ne1, ne2) = (H, I, E)`` in GGUF order, i.e. ``[E, I, H]`` row-major;
* ``blk.{L}.ffn_down_exps.weight``: ``(I, H, E)``, i.e. ``[E, H, I]``.

``ne0`` is the row length ``K``; every row is a whole number of ggml blocks.

Gate and up may be one tensor, ``blk.{L}.ffn_gate_up_exps.weight`` with dims ``(H, 2I, E)``
(llama.cpp's ``qwen35moe``, ``qwen3next``, ``gemma4`` and ``mistral4`` files converted from
a fused ``gate_up_proj``): its first ``I`` rows are gate's, the other ``I`` up's, each
repacked as a tensor of its own (exactly: a row is whole blocks), as llama.cpp's
``build_moe_ffn`` views them; its ``.bias`` ``(2I, E)`` likewise. A block holds gate and up
either fused or apart.

Files written by llama.cpp's converters before they merged the experts (early 2024, e.g. the
widely shared Mixtral-8x7B GGUFs, ``general.architecture = "llama"``) hold one 2-D tensor per
expert instead: ``blk.{L}.ffn_{gate,up,down}.{x}.weight`` with dims ``(H, I)`` / ``(I, H)``,
``x`` = 0 .. E-1. They load the same way, their experts stacked in index order (llama.cpp
merges them likewise when it loads such a file); every expert of a projection must be
present and have the same type and dims, and a block holds either form, not both.
Quantized tensors of the types in :data:`GGUF_NATIVE_FORMATS` are handed as
raw blocks to :func:`kt_ops.formats.from_gguf` (no dense round trip; the
result dequantizes bit-identically to ``gguf.quants.dequantize``). ``F16``,
``BF16`` and ``F32`` tensors are quantized online to the requested format
(``bf16`` by default). ``Q2_K`` and ``Q3_K`` load exactly, their codes held in
2- and 3-bit planes (2.625 / 3.5625 bits a weight in memory, GGUF's 2.625 / 3.4375); ``IQ4_NL`` and
``IQ4_XS`` exactly, their codes as stored (IQ4_XS at 4.31 bits a weight, GGUF's 4.25).
``NVFP4`` loads as ``nvfp4``, exactly (the E2M1 codes as stored, each UE4M3 scale held as
fp32: 6 bits a weight against GGUF's 4.5). llama.cpp's optional per-expert output scales,
``blk.{L}.ffn_{gate,up,down}_exps.scale`` (or ``ffn_gate_up_exps.scale``) ``(E,)``, which
its ``build_moe_ffn`` multiplies each expert's products by (an NVFP4 checkpoint's
per-tensor scale ``g``), are folded into the weights: into NVFP4's fp32 block scales
(``fp32(b * g)``, as :func:`kt_ops.formats.nvfp4.from_nvfp4`) and into float and
requantized values before they are quantized; with any other type such a scale is a
ValueError unless it is all ones, never left out.
``MXFP4`` (gpt-oss GGUF files) loads as ``mxfp4``, the codes and exponents as stored, with
the experts' biases (``blk.{L}.ffn_{gate,up,down}_exps.bias``, any float type) as
``PackedProjection.bias``; the clamped SwiGLU of gpt-oss is the model's to pass
(``activation``). ``Q4_1``, ``Q5_0`` and ``Q5_1`` (what llama.cpp's k-quant mixes write
where a row is not a multiple of 256, e.g. the 1408-wide ``ffn_down_exps`` of
DeepSeek-V2-Lite in a ``Q4_K_M`` file) load exactly at GGUF's size.

``IQ1_S``, ``IQ1_M``, ``IQ2_XXS``, ``IQ2_XS``, ``IQ2_S``, ``IQ3_XXS`` and ``IQ3_S`` (the
lattice-grid types of llama.cpp's smallest files, e.g. the "dynamic" UD-IQ1_S / UD-IQ1_M /
UD-IQ2_XXS / UD-IQ2_M quantizations of DeepSeek-R1 and Kimi-K2) load as the formats of
the same names in lower case: their blocks as stored (1.5625 - 3.4375 bits a weight, as
the file), decoded per 16-row block by the kernels (:mod:`kt_ops.formats.grid`).
``TQ1_0`` and ``TQ2_0`` (ternary, ``W = d (q - 1)``) have no kt_ops format of their own:
with ``weight_format`` None or ``'q2_k'`` they repack **exactly** into ``q2_k``
(:data:`GGUF_REQUANTIZE_DEFAULT`; 2.625 bits a weight against the file's 1.69 / 2.06);
into any other ``weight_format`` they are dequantized (``gguf.quants.dequantize``) and
**requantized**, lossily, with a warning naming the types (against the values stored in
the file about 3-6% relative error for ``q4_k``, 1% for ``q6_k`` and 0.5% for ``q8_0``:
random blocks, ``tests/test_loaders.py``).
Other types (``Q8_1``, ``F64``, integer types, ...) are
refused with a ValueError naming the tensor and its type.
A quantized tensor of a kt_ops format is only packed in that format: asking for another
one (requantizing) is a ValueError; pass ``weight_format=None`` to get each
tensor's own format (llama.cpp mixes them, e.g. Q6_K ``ffn_down_exps`` in a
``Q4_K_M`` file).

**Memory.** ``gguf.GGUFReader`` memory-maps the file; :meth:`load_layer` copies
only the requested layer's tensors, in chunks of experts.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from kt_ops.formats import GGUF_FORMATS, PackedProjection, from_gguf
from kt_ops.formats.gguf_blocks import ternary_as_q2_k
from kt_ops.formats.quantize import quantize_chunk
from kt_ops.layer import PROJECTIONS, ExpertWeights
from kt_ops.loaders._common import check_format, pack_in_chunks
from kt_ops.loaders.base import CheckpointReader, expert_weights

__all__ = [
    "GGUFCheckpoint",
    "GGUF_NATIVE_FORMATS",
    "GGUF_FLOAT_TYPES",
    "GGUF_REQUANTIZED_TYPES",
    "GGUF_REQUANTIZE_DEFAULT",
    "GGUF_TENSOR_NAMES",
]

#: GGUF quantized types read natively -> kt_ops format name (the formats' GGUF block types).
GGUF_NATIVE_FORMATS = {GGMLQuantizationType[f.upper()]: f for f in GGUF_FORMATS}

#: GGUF float types, quantized online.
GGUF_FLOAT_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
)

#: GGUF quantized types with no kt_ops format of their own (the ternary TQ1_0 / TQ2_0):
#: repacked exactly into ``q2_k`` (:data:`GGUF_REQUANTIZE_DEFAULT`), or dequantized and
#: requantized (lossy) into another ``weight_format``.
GGUF_REQUANTIZED_TYPES = (
    GGMLQuantizationType.TQ1_0,
    GGMLQuantizationType.TQ2_0,
)

#: The format ``GGUF_REQUANTIZED_TYPES`` load as when ``weight_format`` is None: ``q2_k``,
#: which holds their ternary weights ``d (q - 1)`` exactly
#: (:func:`kt_ops.formats.gguf_blocks.ternary_as_q2_k`).
GGUF_REQUANTIZE_DEFAULT = "q2_k"

#: Projection -> GGUF tensor name pattern (``{L}`` = block index).
GGUF_TENSOR_NAMES = {
    "gate": "blk.{L}.ffn_gate_exps.weight",
    "up": "blk.{L}.ffn_up_exps.weight",
    "down": "blk.{L}.ffn_down_exps.weight",
}

_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias|scale)$")
# Gate and up in one tensor, dims (H, 2I, E): gate's rows first (llama.cpp's qwen35moe,
# qwen3next, gemma4, mistral4; the fused gate_up_proj of Hugging Face checkpoints).
_GATE_UP_RE = re.compile(r"^blk\.(\d+)\.ffn_gate_up_exps\.(weight|bias|scale)$")
# One tensor per expert (llama.cpp's converters before the experts were merged).
_SPLIT_EXPERT_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


class _GateUpHalf:
    """Gate's or up's half of a ``blk.{L}.ffn_gate_up_exps.weight`` tensor (dims ``(H, 2I,
    E)``: rows ``[0, I)`` are gate's, ``[I, 2I)`` up's; every row a whole number of ggml
    blocks, so the halves are exact) or of its ``.bias`` (dims ``(2I, E)``), read as a
    tensor of its own: the attributes of ``gguf.ReaderTensor`` that :class:`GGUFCheckpoint`
    uses (a weight's ``data`` sliced over experts, a bias's whole)."""

    def __init__(self, fused: Any, role: str) -> None:
        self.fused = fused
        self.name = f"{fused.name} ({role} rows)"
        self.tensor_type = fused.tensor_type
        dims = [int(d) for d in fused.shape]
        rows = dims[-2]
        self.rows = slice(0, rows // 2) if role == "gate" else slice(rows // 2, rows)
        if len(dims) == 3:  # weight: [E, 2I, row bytes or H]
            self.shape = [dims[0], rows // 2, dims[2]]
            self.data = self
        else:  # bias: [E, 2I]
            self.shape = [rows // 2, *dims[1:]]
            self.data = fused.data[:, self.rows]

    def __getitem__(self, experts: slice) -> np.ndarray:
        return self.fused.data[experts, self.rows]


class _StackedExperts:
    """The per-expert tensors ``blk.{L}.ffn_{role}.{x}.weight`` of one projection, read as
    one stacked tensor: the attributes of ``gguf.ReaderTensor`` that :class:`GGUFCheckpoint`
    uses (``name``, ``tensor_type``, ``shape`` in GGUF order with ``E`` last, and ``data``,
    whose slice over experts stacks their blocks as a merged tensor holds them)."""

    def __init__(self, layer: int, role: str, experts: list[Any]) -> None:
        self.parts = experts
        self.name = f"blk.{layer}.ffn_{role}.{{0..{len(experts) - 1}}}.weight"
        self.tensor_type = experts[0].tensor_type
        self.shape = [*(int(d) for d in experts[0].shape), len(experts)]
        self.data = self

    def __getitem__(self, experts: slice) -> np.ndarray:
        return np.stack([np.asarray(t.data) for t in self.parts[experts]])


_SUPPORTED = ", ".join(t.name for t in (*GGUF_NATIVE_FORMATS, *GGUF_FLOAT_TYPES)) + (
    "; requantized: " + ", ".join(t.name for t in GGUF_REQUANTIZED_TYPES)
)


def _own_format(qtype: GGMLQuantizationType) -> str:
    """The kt_ops format a tensor of ``qtype`` loads as with ``weight_format=None``."""
    if qtype in GGUF_NATIVE_FORMATS:
        return GGUF_NATIVE_FORMATS[qtype]
    return GGUF_REQUANTIZE_DEFAULT if qtype in GGUF_REQUANTIZED_TYPES else "bf16"


def _field(reader: GGUFReader, key: str) -> Any:
    f = reader.get_field(key)
    if f is None:
        return None
    try:
        return f.contents()
    except Exception:  # pragma: no cover - malformed field
        return None


class GGUFCheckpoint(CheckpointReader):
    """The routed experts of a ``.gguf`` file.

    Args:
        path: the GGUF file.

    Attributes:
        path; ``kind``: ``"gguf"``; ``architecture`` (``general.architecture``);
        num_layers (``{arch}.block_count``, or the highest block + 1); moe_layers
        (sorted block indices with expert tensors; ``layers`` too, as every
        :class:`~kt_ops.loaders.base.CheckpointReader`); num_experts, hidden_size,
        intermediate_size (``E``, ``H``, ``I`` of the first MoE layer);
        source_dtype (the lower-case GGML type name of the first layer's gate,
        e.g. ``"q4_k"``); native_format (the kt_ops format that tensor loads as
        with ``weight_format=None``: ``"bf16"`` for float types,
        :data:`GGUF_REQUANTIZE_DEFAULT` for :data:`GGUF_REQUANTIZED_TYPES`);
        has_expert_bias (the file holds expert biases,
        ``blk.{L}.ffn_{gate,up,down}_exps.bias`` as gpt-oss's: :meth:`load_layer`
        returns them as ``PackedProjection.bias``, fp32).

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a readable GGUF file (bad magic, truncated), no expert
            tensors, a missing projection in a layer (named), shapes that do not
            match each other, or an unsupported tensor type (naming the tensor,
            its type and the supported types); an expert bias of a non-float type,
            of the wrong dims, or in a block without expert weights.
    """

    kind = "gguf"

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        try:
            self._reader = GGUFReader(str(self.path))
        except Exception as e:  # ValueError, struct/numpy errors, OSError
            raise ValueError(
                f"{self.path}: not a readable GGUF file (truncated or corrupt?): "
                f"{type(e).__name__}: {e}"
            ) from e
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._check_tensor_offsets()
        self.architecture = _field(self._reader, "general.architecture") or "unknown"
        layers: dict[int, dict[str, Any]] = {}
        biases: dict[int, dict[str, Any]] = {}
        scales: dict[int, dict[str, Any]] = {}  # per-expert output scales (.scale, [E])
        split: dict[int, dict[str, dict[int, Any]]] = {}  # block -> role -> expert -> tensor
        fused: dict[tuple[int, str], Any] = {}  # (block, weight | bias) -> ffn_gate_up_exps
        for name, t in self._tensors.items():
            m = _EXPERT_RE.match(name)
            if m and m[3] == "scale":
                scales.setdefault(int(m[1]), {})[m[2]] = t
            elif m:
                (layers if m[3] == "weight" else biases).setdefault(int(m[1]), {})[m[2]] = t
            m = _SPLIT_EXPERT_RE.match(name)
            if m:
                split.setdefault(int(m[1]), {}).setdefault(m[2], {})[int(m[3])] = t
            m = _GATE_UP_RE.match(name)
            if m and m[2] == "scale":  # scales gate's and up's outputs alike
                scales.setdefault(int(m[1]), {})["gate_up"] = t
            elif m:
                fused[int(m[1]), m[2]] = t
        for (L, kind), t in sorted(fused.items()):
            group = (layers if kind == "weight" else biases).setdefault(L, {})
            if "gate" in group or "up" in group:
                raise ValueError(
                    f"{self.path}: block {L} holds {t.name} and also "
                    f"{group.get('gate', group.get('up')).name}; gate and up are either fused or "
                    "not"
                )
            dims = [int(d) for d in t.shape]
            if len(dims) != (3 if kind == "weight" else 2) or dims[-2] % 2:
                want = "(H, 2I, E)" if kind == "weight" else "(2I, E)"
                raise ValueError(
                    f"{self.path}: {t.name} has dims {tuple(dims)}; expected {want}, gate's I "
                    "rows then up's"
                )
            group["gate"], group["up"] = _GateUpHalf(t, "gate"), _GateUpHalf(t, "up")
        for L, roles in sorted(split.items()):
            if L in layers:
                raise ValueError(
                    f"{self.path}: block {L} holds both merged expert tensors "
                    f"(blk.{L}.ffn_*_exps.weight) and per-expert ones "
                    f"(blk.{L}.ffn_*.{{x}}.weight); a block has one form"
                )
            layers[L] = {r: self._stack_split_experts(L, r, ts) for r, ts in roles.items()}
        if not layers:
            raise ValueError(
                f"{self.path}: no routed expert tensors (blk.{{L}}.ffn_gate_exps.weight, "
                "ffn_up_exps (or ffn_gate_up_exps), ffn_down_exps, or per expert "
                "blk.{L}.ffn_gate.{x}.weight, ...) in this GGUF file"
            )
        self._layers = layers
        self._biases = biases
        self._shapes: dict[int, tuple[int, int, int]] = {}
        for L in sorted(layers):
            self._shapes[L] = self._check_layer_tensors(L)
        for L in sorted(biases):
            self._check_bias_tensors(L)
        self.has_expert_bias = bool(biases)
        self._scales = {L: self._check_scale_tensors(L, s) for L, s in sorted(scales.items())}
        self.moe_layers = self.layers = sorted(layers)
        count = _field(self._reader, f"{self.architecture}.block_count")
        self.num_layers = int(count) if isinstance(count, (int, np.integer)) else max(layers) + 1
        first = self.moe_layers[0]
        self.num_experts, self.intermediate_size, self.hidden_size = self._shapes[first]
        gate_type = layers[first]["gate"].tensor_type
        self.source_dtype = gate_type.name.lower()
        self.native_format = _own_format(gate_type)
        self._warned: set[tuple[str, str]] = set()  # (type, target) already warned about

    def _stack_split_experts(self, layer: int, role: str, experts: dict[int, Any]) -> Any:
        """The per-expert tensors of one projection as a :class:`_StackedExperts`;
        ValueError naming the tensor when an expert is missing or differs in type or dims."""
        count = max(experts) + 1
        if len(experts) != count:  # some x <= len(experts) is missing (not O(max index))
            gap = next(x for x in range(len(experts) + 1) if x not in experts)
            raise ValueError(
                f"{self.path}: expert tensor blk.{layer}.ffn_{role}.{gap}.weight is "
                f"missing (block {layer} has {len(experts)} of the {count} experts "
                f"0..{count - 1} of ffn_{role})"
            )
        ts = [experts[x] for x in range(count)]
        first = ts[0]
        for t in ts[1:]:
            if t.tensor_type != first.tensor_type or [int(d) for d in t.shape] != [
                int(d) for d in first.shape
            ]:
                raise ValueError(
                    f"{self.path}: {t.name} is {t.tensor_type.name} with dims "
                    f"{tuple(int(d) for d in t.shape)}, {first.name} "
                    f"{first.tensor_type.name} with {tuple(int(d) for d in first.shape)}; the "
                    "experts of one projection must have the same type and dims"
                )
        if len(first.shape) != 2:
            raise ValueError(
                f"{self.path}: {first.name} has dims {tuple(int(d) for d in first.shape)}; a "
                "per-expert tensor has 2 (gate/up (H, I), down (I, H))"
            )
        return _StackedExperts(layer, role, ts)

    def _check_tensor_offsets(self) -> None:
        """Every tensor's data must lie inside the data section, aligned, not overlap
        another, and follow the previous tensor's (padded) data, as llama.cpp requires.

        ``gguf.GGUFReader`` takes the offsets of the tensor infos as they are; an
        edited offset would otherwise read shifted bytes (of the padding or of
        another tensor) without any error.
        """
        r = self._reader
        size = len(r.data)
        start = int(r.data_offset)
        align = int(getattr(r, "alignment", 32) or 32)
        spans = []
        for t in r.tensors:
            off = int(t.data_offset)
            end = off + int(t.n_bytes)
            if off < start or end > size:
                raise ValueError(
                    f"{self.path}: tensor {t.name} has data at bytes {off}..{end} of the file, "
                    f"outside the data section {start}..{size} (truncated or corrupt file?)"
                )
            if (off - start) % align:
                raise ValueError(
                    f"{self.path}: tensor {t.name} has data offset {off - start}, not a multiple "
                    f"of the file's alignment {align} (corrupt tensor info?)"
                )
            spans.append((off, end, t.name))
        for (a0, a1, a), (b0, _b1, b) in zip(sorted(spans), sorted(spans)[1:]):
            if b0 < a1:
                raise ValueError(
                    f"{self.path}: the data of tensors {a} (bytes {a0}..{a1}) and {b} (from "
                    f"{b0}) overlap (corrupt tensor info?)"
                )
        # As llama.cpp's gguf_init_from_file: the data follow each other in
        # tensor-info order, each padded to the alignment. This also catches an
        # edited type or dims that changes a tensor's size (a gap would remain).
        expect = 0
        for off, end, name in spans:
            if off - start != expect:
                raise ValueError(
                    f"{self.path}: tensor {name} has data offset {off - start}, expected "
                    f"{expect} (the tensors' data must follow each other in tensor-info order; "
                    "corrupt tensor info?)"
                )
            expect += -(-(end - off) // align) * align
        if spans and size > start + expect:
            raise ValueError(
                f"{self.path}: {size - start - expect} bytes after the last tensor's data (the "
                f"tensors end at {start + expect}, the file at {size}); an edited tensor type or "
                "dims, or a corrupt file"
            )

    def _check_layer_tensors(self, layer: int) -> tuple[int, int, int]:
        ts = self._layers[layer]
        for role in PROJECTIONS:
            if role not in ts:
                if any(isinstance(t, _StackedExperts) for t in ts.values()):
                    want = f"blk.{layer}.ffn_{role}.{{x}}.weight"
                else:
                    want = GGUF_TENSOR_NAMES[role].format(L=layer)
                have = ", ".join(
                    dict.fromkeys(getattr(ts[r], "fused", ts[r]).name for r in sorted(ts))
                )
                raise ValueError(
                    f"{self.path}: expert tensor {want} is missing (block {layer} has {have})"
                )
            t = ts[role]
            known = (*GGUF_NATIVE_FORMATS, *GGUF_FLOAT_TYPES, *GGUF_REQUANTIZED_TYPES)
            if t.tensor_type not in known:
                raise ValueError(
                    f"{self.path}: tensor {t.name} has GGML type {t.tensor_type.name}, which "
                    f"kt_ops cannot load; supported types: {_SUPPORTED}"
                )
        dims = {r: [int(d) for d in ts[r].shape] for r in PROJECTIONS}
        g = dims["gate"]
        if len(g) != 3:
            raise ValueError(f"{self.path}: {ts['gate'].name} has dims {g}; expected (H, I, E)")
        hidden, inter, experts = g
        expect = {"gate": [hidden, inter, experts], "up": [hidden, inter, experts]}
        expect["down"] = [inter, hidden, experts]
        for r in PROJECTIONS:
            if dims[r] != expect[r]:
                raise ValueError(
                    f"{self.path}: {ts[r].name} has dims (ne0, ne1, ne2) = {tuple(dims[r])}; "
                    f"expected {tuple(expect[r])} (gate/up (H, I, E), down (I, H, E))"
                )
        return experts, inter, hidden

    def _check_bias_tensors(self, layer: int) -> None:
        """The expert biases of ``layer`` (gpt-oss: ``blk.{L}.ffn_{gate,up,down}_exps.bias``,
        dims ``(n, E)``, a float type) must belong to its expert weights."""
        if layer not in self._layers:
            names = ", ".join(t.name for t in self._biases[layer].values())
            raise ValueError(
                f"{self.path}: expert bias {names} belongs to block {layer}, which has no expert "
                "weights (blk.{L}.ffn_gate_exps.weight, ffn_up_exps, ffn_down_exps)"
            )
        E, inter, hidden = self._shapes[layer]
        for role, t in self._biases[layer].items():
            if t.tensor_type not in GGUF_FLOAT_TYPES:
                raise ValueError(
                    f"{self.path}: tensor {t.name} has GGML type {t.tensor_type.name}; expert "
                    f"biases load from {', '.join(f.name for f in GGUF_FLOAT_TYPES)}"
                )
            want = [hidden if role == "down" else inter, E]
            if [int(d) for d in t.shape] != want:
                raise ValueError(
                    f"{self.path}: {t.name} has dims (ne0, ne1) = "
                    f"{tuple(int(d) for d in t.shape)}; expected {tuple(want)} (gate/up (I, E), "
                    "down (H, E))"
                )

    def _check_scale_tensors(self, layer: int, scales: dict[str, Any]) -> dict[str, Any]:
        """Per-expert output scales of ``layer`` (llama.cpp's optional
        ``blk.{L}.ffn_{gate,up,down}_exps.scale`` and ``ffn_gate_up_exps.scale``, dims
        ``(E,)``: ``build_moe_ffn`` multiplies each expert's products by its value, as
        NVFP4 checkpoints' per-tensor scale) -> ``{role: tensor}``. kt_ops folds them into
        the weights: into NVFP4's fp32 block scales (``fp32(b * g)``, as
        :func:`kt_ops.formats.nvfp4.from_nvfp4`) and into float or requantized weights
        before they are quantized. ValueError naming the tensor for anything else, never a
        scale left out."""
        names = ", ".join(t.name for t in scales.values())
        if layer not in self._layers:
            raise ValueError(
                f"{self.path}: expert scale {names} belongs to block {layer}, which has no "
                "expert weights"
            )
        ts = self._layers[layer]
        fused = isinstance(ts["gate"], _GateUpHalf)
        if (fused and {"gate", "up"} & set(scales)) or (not fused and "gate_up" in scales):
            raise ValueError(
                f"{self.path}: block {layer} holds {names}; a block with gate and up fused "
                "takes ffn_gate_up_exps.scale, one with them apart ffn_gate_exps.scale / "
                "ffn_up_exps.scale"
            )
        E = self._shapes[layer][0]
        out = {}
        for key, t in scales.items():
            dims = [int(d) for d in t.shape]
            if t.tensor_type not in GGUF_FLOAT_TYPES or dims != [E]:
                raise ValueError(
                    f"{self.path}: expert scale {t.name} is {t.tensor_type.name} with dims "
                    f"{tuple(dims)}; expected a float type with dims ({E},), one per expert"
                )
            for role in ("gate", "up") if key == "gate_up" else (key,):
                w = ts[role]
                foldable = GGUF_NATIVE_FORMATS.get(w.tensor_type, "nvfp4") == "nvfp4"
                if not foldable and _all_ones(t):
                    continue  # scales of 1: nothing to fold
                if not foldable:
                    raise ValueError(
                        f"{self.path}: expert scale {t.name} scales {w.name}, of type "
                        f"{w.tensor_type.name}; kt_ops folds per-expert scales into NVFP4, float "
                        "and requantized weights only"
                    )
                out[role] = t
        return out

    def _expert_scales(self, layer: int, role: str, e0: int, e1: int) -> Optional[torch.Tensor]:
        """fp32 ``[e1 - e0]`` output scales of ``role``'s experts ``e0..e1-1``, or None."""
        t = self._scales.get(layer, {}).get(role)
        if t is None:
            return None
        s = _float_tensor(t.tensor_type, t.data)[e0:e1]
        if not bool(torch.isfinite(s).all()):
            raise ValueError(f"expert scale {t.name} holds NaN or infinite values")
        return s

    def layer_shape(self, layer: int) -> tuple[int, int, int]:
        """``(E, I, H)`` of MoE layer ``layer``; ValueError if it has no experts."""
        return self._shapes[self._check_layer(layer)]

    def tensor_types(self, layer: int) -> dict[str, str]:
        """GGML type name of each projection of ``layer``, e.g. ``{"gate": "Q4_K", ...}``."""
        ts = self._layers[self._check_layer(layer)]
        return {r: ts[r].tensor_type.name for r in PROJECTIONS}

    def native_formats(self, layer: int) -> dict[str, str]:
        """kt_ops format of each projection of ``layer`` when loaded with ``weight_format=None``."""
        ts = self._layers[self._check_layer(layer)]
        return {r: _own_format(ts[r].tensor_type) for r in PROJECTIONS}

    def _check_layer(self, layer: int) -> int:
        if layer not in self._layers:
            raise ValueError(
                f"{self.path}: block {layer} has no routed experts; MoE layers: {self.moe_layers}"
            )
        return layer

    def check_weight_format(self, layer: int, weight_format: Optional[str]) -> None:
        """Raise ValueError unless ``load_layer(layer, weight_format)`` can pack every tensor.

        A quantized tensor of a kt_ops format loads only in that format (no
        requantizing); :data:`GGUF_REQUANTIZED_TYPES` load in any; None always works.
        """
        check_format(weight_format)
        ts = self._layers[self._check_layer(layer)]
        for role in PROJECTIONS:
            native = GGUF_NATIVE_FORMATS.get(ts[role].tensor_type)
            if native is not None and weight_format not in (None, native):
                raise ValueError(
                    f"{self.path}: tensor {ts[role].name} is {ts[role].tensor_type.name}, which "
                    f"loads as {native!r} only, not {weight_format!r} (requantizing a quantized "
                    "GGUF tensor is not supported); use weight_format=None for each tensor's "
                    "own format"
                )

    def load_layer(
        self,
        layer: int,
        weight_format: Optional[str] = None,
        group_size: Optional[int] = None,
        symmetric: bool = True,
    ) -> ExpertWeights:
        """Read and pack the routed experts of one block.

        Args:
            layer: a block index from :attr:`moe_layers`.
            weight_format: None packs every tensor in its own format (quantized
                types via :func:`kt_ops.formats.from_gguf`, float types as
                ``bf16``, :data:`GGUF_REQUANTIZED_TYPES` requantized to
                :data:`GGUF_REQUANTIZE_DEFAULT`); a format name must match every
                quantized tensor of a kt_ops format in the layer, and is the
                target for float tensors and requantized types.
            group_size, symmetric: passed to ``quantize_weights`` for float tensors.

        Returns:
            :class:`~kt_ops.layer.ExpertWeights`: gate, up ``[E, I, H]``, down ``[E, H, I]``,
            with the layer's expert biases (fp32 ``[E, I]`` / ``[E, H]``) where the file
            has them.

        Warns:
            UserWarning: once per checkpoint, type and target format, when a tensor of
                :data:`GGUF_REQUANTIZED_TYPES` is requantized (lossy).

        Raises:
            ValueError: unknown block or format, a quantized tensor whose type is not
                ``weight_format``, or a packer error (naming the tensor; a
                requantized tensor whose values are not finite, too).
        """
        self.check_weight_format(layer, weight_format)
        self._warn_requantized(layer, weight_format)
        E, I, H = self._shapes[layer]  # noqa: E741
        ts = self._layers[layer]
        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        out = {}
        for role in PROJECTIONS:
            t = ts[role]
            n, k = shapes[role]
            native = GGUF_NATIVE_FORMATS.get(t.tensor_type)

            def pack(e0: int, e1: int, t=t, n=n, k=k, native=native, role=role) -> PackedProjection:
                try:
                    raw = t.data[e0:e1]
                    scale = self._expert_scales(layer, role, e0, e1)
                    if native is not None:
                        p = from_gguf(native, torch.from_numpy(np.array(raw)), n, k)
                        if scale is not None:  # nvfp4 (checked): fp32(b * g) / 2, exact for b
                            p = dataclasses.replace(p, scales=p.scales * scale.view(-1, 1, 1, 1))
                        return p
                    target = weight_format or _own_format(t.tensor_type)
                    if t.tensor_type in GGUF_REQUANTIZED_TYPES and _exact(target, scale):
                        q2 = ternary_as_q2_k(t.tensor_type, np.array(raw))
                        return from_gguf("q2_k", torch.from_numpy(q2), n, k)
                    if t.tensor_type in GGUF_REQUANTIZED_TYPES:
                        dense = _dequantized_tensor(t.tensor_type, raw)
                    else:
                        dense = _float_tensor(t.tensor_type, raw)
                    if scale is not None:
                        dense = dense * scale.view(-1, 1, 1)
                    return quantize_chunk(dense, target, group_size, symmetric)
                except ValueError as e:
                    raise ValueError(f"{self.path}: tensor {t.name}: {e}") from e
                except Exception as e:
                    raise ValueError(
                        f"{self.path}: tensor {t.name} (experts {e0}..{e1 - 1}) cannot be read "
                        f"(truncated file?): {type(e).__name__}: {e}"
                    ) from e

            out[role] = pack_in_chunks(E, n, k, pack)
        weights = expert_weights(**out, where=f"{self.path}: block {layer}")
        if layer in self._biases:
            weights = weights.with_biases(*self._read_biases(layer))
        return weights

    def _warn_requantized(self, layer: int, weight_format: Optional[str]) -> None:
        """Warn (once per type and target) that this layer's tensors of a requantized type
        lose bits."""
        target = weight_format or GGUF_REQUANTIZE_DEFAULT
        for role, t in self._layers[layer].items():
            name = t.tensor_type.name
            if _exact(target, self._scales.get(layer, {}).get(role)):
                continue  # the ternary types into q2_k: exact
            if t.tensor_type in GGUF_REQUANTIZED_TYPES and (name, target) not in self._warned:
                self._warned.add((name, target))
                warnings.warn(
                    f"{self.path}: {name} tensors (e.g. {t.name}) have no kt_ops format of "
                    f"their own; they are dequantized and requantized to {target!r}, which "
                    "is lossy (pass weight_format to choose the format: 'q6_k' or 'q8_0' "
                    "lose less and take more memory)",
                    UserWarning,
                    stacklevel=3,
                )

    def _read_biases(self, layer: int) -> list[Optional[torch.Tensor]]:
        """The gate, up ``[E, I]`` and down ``[E, H]`` biases of ``layer`` as fp32, None
        where absent; ValueError naming a tensor that is unreadable or not finite."""
        out: list[Optional[torch.Tensor]] = []
        for role in PROJECTIONS:
            t = self._biases[layer].get(role)
            if t is None:
                out.append(None)
                continue
            try:
                b = _float_tensor(t.tensor_type, t.data)
            except Exception as e:
                raise ValueError(
                    f"{self.path}: tensor {t.name} cannot be read (truncated file?): "
                    f"{type(e).__name__}: {e}"
                ) from e
            if not bool(torch.isfinite(b).all()):
                raise ValueError(f"{self.path}: tensor {t.name} holds NaN or infinite values")
            out.append(b)
        return out

    def __repr__(self) -> str:
        return (
            f"GGUFCheckpoint({str(self.path)!r}, arch={self.architecture!r}, "
            f"moe_layers={len(self.moe_layers)}, E={self.num_experts}, H={self.hidden_size}, "
            f"I={self.intermediate_size}, source_dtype={self.source_dtype!r})"
        )


def _exact(target: str, scale: Any) -> bool:
    """Whether a tensor of :data:`GGUF_REQUANTIZED_TYPES` packs into ``target`` exactly:
    ``q2_k`` (:func:`~kt_ops.formats.gguf_blocks.ternary_as_q2_k`), with no expert scale
    to fold in."""
    return target == "q2_k" and scale is None


def _dequantized_tensor(qtype: GGMLQuantizationType, raw: np.ndarray) -> torch.Tensor:
    """A chunk ``[c, N, row bytes]`` of a requantized type -> fp32 ``[c, N, K]``
    (``gguf.quants.dequantize``, llama.cpp's ``dequantize_row_*`` in numpy)."""
    return torch.from_numpy(np.ascontiguousarray(dequantize(np.asarray(raw), qtype), np.float32))


def _all_ones(t: Any) -> bool:
    """Whether a float tensor holds only 1.0 (False if it cannot be read)."""
    try:
        return bool((_float_tensor(t.tensor_type, t.data) == 1).all())
    except Exception:  # a truncated file: load_layer names it
        return False


def _float_tensor(qtype: GGMLQuantizationType, raw: np.ndarray) -> torch.Tensor:
    """A float GGUF tensor chunk ``[c, N, K]`` (BF16 comes as bytes ``[c, N, 2K]``) -> fp32."""
    if qtype == GGMLQuantizationType.BF16:
        arr = np.ascontiguousarray(raw).view(np.int16)
        return torch.from_numpy(arr.copy()).view(torch.bfloat16).float()
    return torch.from_numpy(np.array(raw, dtype=np.float32))
