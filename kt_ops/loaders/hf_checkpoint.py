"""Routed experts of a Hugging Face safetensors checkpoint, one MoE layer at a time.

:class:`HFCheckpoint` opens a model directory (``config.json`` plus
``model.safetensors``, or shards listed in ``model.safetensors.index.json``, or
any ``*.safetensors`` files) and reads the expert weights of one layer per
:meth:`HFCheckpoint.load_layer` call, packed for kt_ops.

**Memory.** Files are opened with ``safetensors.safe_open`` (memory-mapped);
only the tensors of the requested layer are read (tensor names come from the
index or the file headers), and each projection is read and quantized in
chunks of experts (:data:`kt_ops.loaders._common.CHUNK_BYTES` of fp32 at
most), so peak memory is about one layer of packed weights plus one chunk,
never the whole model. File handles are closed when ``load_layer`` returns.

Tensor layouts recognised (``{P}`` = ``...layers.{L}.mlp`` or
``...layers.{L}.block_sparse_moe``):

* **One tensor per expert** (the layout of checkpoints on the Hub; Qwen2-MoE,
  Qwen3-MoE, OLMoE, DeepSeek-V3 and Mixtral): ``{P}.experts.{e}.gate_proj.weight``,
  ``up_proj``, ``down_proj`` (``nn.Linear`` ``[N, K]``: gate/up ``[I, H]``, down
  ``[H, I]``), or Mixtral's ``w1`` (gate), ``w3`` (up), ``w2`` (down).
* **Fused 3-D tensors** (transformers >= 5 parameters, e.g. saved by
  ``save_pretrained`` of a converted model): ``{P}.experts.gate_up_proj``
  ``[E, 2I, H]`` and ``{P}.experts.down_proj`` ``[E, H, I]``, gate rows then up
  rows (``Qwen3MoeExperts``, ``MixtralExperts`` in transformers 5.23.0). The
  transposed variant (``is_transposed=True`` in
  ``transformers/integrations/moe.py``: ``[E, H, 2I]`` and ``[E, I, H]``, e.g.
  ``GptOssExperts``, ``AriaTextMoELayer``) is recognised by the shapes, which
  cannot be confused. Interleaved gate/up columns (``is_concatenated=False``:
  gate ``0::2``, up ``1::2``) are used for the model types in
  :data:`INTERLEAVED_GATE_UP_MODEL_TYPES` (gpt-oss).
* **bf16, fp16, fp32** weights: quantized online to the requested format.
* **fp8** (DeepSeek-V3 style, ``quantization_config.quant_method == "fp8"``):
  ``float8_e4m3fn`` weights plus ``{name}_scale_inv`` (per-expert:
  ``...gate_proj.weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]``; fused:
  ``gate_up_proj_scale_inv`` ``[E, ceil(2I/128), ceil(H/128)]``, split at row
  ``I/128``, so ``I`` must be a multiple of 128). Packed natively by
  :func:`kt_ops.formats.from_fp8` (no dequantization) when the target is
  ``fp8``; otherwise dequantized (``float(W8) * scale``) one chunk at a time.
* **MXFP4** (gpt-oss; ``transformers/integrations/mxfp4.py``):
  ``experts.gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]`` (two E2M1 codes a
  byte, low nibble first) and ``..._scales`` uint8 ``[E, 2I, H/32]`` (UE8M0),
  ``down_proj_blocks`` ``[E, H, I/32, 16]``, ``down_proj_scales``. Packed
  natively by :func:`kt_ops.formats.from_mxfp4` when the target is ``mxfp4``,
  otherwise dequantized (``e2m1 * 2^(E-127)``) one chunk at a time.

Expert biases (gpt-oss ``gate_up_proj_bias`` ``[E, 2I]``, split as the weights'
rows are, and ``down_proj_bias`` ``[E, H]``; ``.bias`` of per-expert linears) are
read as fp32 into the layer's projections (``PackedProjection.bias``);
:attr:`HFCheckpoint.has_expert_bias` tells whether there are any. Layers at or beyond
``config.num_hidden_layers`` (DeepSeek-V3's multi-token-prediction layer) are
not listed as MoE layers.
"""

from __future__ import annotations

import logging
import re
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import torch

from kt_ops.formats import E2M1_VALUES, PackedProjection, from_fp8, from_mxfp4
from kt_ops.formats.quantize import quantize_chunk
from kt_ops.layer import PROJECTIONS, ExpertWeights
from kt_ops.loaders._common import check_format, pack_in_chunks
from kt_ops.loaders.base import CheckpointReader, expert_weights
from kt_ops.loaders.safetensors_io import open_safetensors, read_json
from kt_ops.loaders.schemes import dequantize_fp8_blocks, dequantize_mxfp4_blocks

__all__ = ["HFCheckpoint", "INTERLEAVED_GATE_UP_MODEL_TYPES", "MXFP4_VALUES"]

logger = logging.getLogger(__name__)

#: ``config.model_type`` values whose fused ``gate_up_proj`` interleaves gate and up
#: (``@use_experts_implementation(is_concatenated=False)`` in transformers 5.23.0).
INTERLEAVED_GATE_UP_MODEL_TYPES = frozenset({"gpt_oss"})

#: E2M1 code -> value (OCP MX v1.0; ``FP4_VALUES`` of transformers/integrations/mxfp4.py).
MXFP4_VALUES = E2M1_VALUES

#: Quantization methods of ``config.quantization_config`` that this loader reads.
_SUPPORTED_QUANT_METHODS = ("fp8", "mxfp4")

_DENSE_DTYPES = {
    "BF16": ("bf16", torch.bfloat16),
    "F16": ("fp16", torch.float16),
    "F32": ("fp32", torch.float32),
}

_ROLE_OF = {
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
    "w1": "gate",
    "w3": "up",
    "w2": "down",
}

_LAYER = r"^(?P<prefix>(?:.+\.)?layers\.)(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe)\.experts\."
_PER_EXPERT_RE = re.compile(
    _LAYER + r"(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.(?P<kind>weight|weight_scale_inv|bias)$"
)
_FUSED_RE = re.compile(
    _LAYER + r"(?P<proj>gate_up_proj|down_proj)(?P<kind>|_blocks|_scales|_scale_inv|_bias)$"
)


@dataclass
class _LayerTensors:
    """Names of one layer's expert tensors, as found in the checkpoint."""

    layer: int
    base: str  # e.g. "model.layers.3.mlp.experts."
    # per-expert layout: (expert, role) -> {"proj": original name, kind: tensor name}
    per_expert: dict[tuple[int, str], dict[str, str]] = field(default_factory=dict)
    # fused layout: "gate_up_proj" / "down_proj" + kind suffix -> tensor name
    fused: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _LayerPlan:
    """How to read one layer: layout, encoding and sizes (from the file headers)."""

    style: str  # "per_expert" | "fused"
    encoding: str  # "dense" | "fp8" | "mxfp4"
    source_dtype: str  # "bf16" | "fp16" | "fp32" | "fp8" | "mxfp4"
    num_experts: int
    intermediate_size: int
    hidden_size: int
    transposed: bool = False
    interleaved: bool = False


class HFCheckpoint(CheckpointReader):
    """The routed experts of a Hugging Face safetensors checkpoint.

    Args:
        path: a model directory (``config.json`` optional; ``model.safetensors``,
            ``model.safetensors.index.json`` with shards, or other ``*.safetensors``
            files) or a single ``.safetensors`` file.
        prefix: the part of the tensor names before the layer index (e.g.
            ``"model.layers."``, ``"model.language_model.layers."``), needed only when
            the checkpoint holds experts under several prefixes.

    Attributes:
        path: the checkpoint path. ``kind``: ``"hf_safetensors"``.
        config: the parsed ``config.json`` (``{}`` when absent).
        num_layers: ``config.num_hidden_layers`` (or the highest layer index + 1).
        moe_layers: sorted indices of the layers that have routed experts
            (``layers`` too, as every :class:`~kt_ops.loaders.base.CheckpointReader`).
        num_experts, hidden_size, intermediate_size: ``E``, ``H``, ``I`` of the first
            MoE layer (see :meth:`layer_shape` for others).
        source_dtype: ``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp8"`` or ``"mxfp4"``.
        native_format: the kt_ops format that packs the source without requantizing
            (``"bf16"`` for float sources, else ``source_dtype``).
        has_expert_bias: whether the experts have biases (loaded as ``PackedProjection.bias``).

    Raises:
        FileNotFoundError: the path, a shard named by the index, or any
            safetensors file is missing.
        ValueError: unreadable config/index, a corrupt safetensors file, no
            routed experts found, a missing expert tensor (named), experts under
            several prefixes, inconsistent shapes, or an unsupported
            ``quantization_config`` / dtype.
    """

    kind = "hf_safetensors"

    def __init__(self, path: Union[str, Path], *, prefix: Optional[str] = None) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"checkpoint {self.path} does not exist")
        self.config: dict = {}
        self._weight_map = self._find_tensors()
        self._text_config = self._load_config()
        self._check_quantization_config()
        self._layers = self._group_layers(prefix)
        cfg_layers = self._text_config.get("num_hidden_layers")
        if isinstance(cfg_layers, int) and cfg_layers > 0:
            dropped = sorted(L for L in self._layers if L >= cfg_layers)
            if dropped:
                logger.info(
                    "%s: experts of layers %s (>= num_hidden_layers=%d, e.g. MTP) are skipped",
                    self.path,
                    dropped,
                    cfg_layers,
                )
            self._layers = {L: t for L, t in self._layers.items() if L < cfg_layers}
            self.num_layers = cfg_layers
        else:
            self.num_layers = max(self._layers) + 1 if self._layers else 0
        if not self._layers:
            raise ValueError(
                f"{self.path}: no routed expert tensors found (expected names like "
                "'model.layers.{L}.mlp.experts.{e}.gate_proj.weight', "
                "'...block_sparse_moe.experts.{e}.w1.weight' or '...mlp.experts.gate_up_proj')"
            )
        self.moe_layers = self.layers = sorted(self._layers)
        self._plans: dict[int, _LayerPlan] = {}
        first = self._plan(self.moe_layers[0])
        self.num_experts = first.num_experts
        self.hidden_size = first.hidden_size
        self.intermediate_size = first.intermediate_size
        self.source_dtype = first.source_dtype
        self.native_format = "bf16" if first.encoding == "dense" else first.encoding
        self.has_expert_bias = any(
            "bias" in d for t in self._layers.values() for d in t.per_expert.values()
        ) or any(k.endswith("_bias") for t in self._layers.values() for k in t.fused)

    # ------------------------------------------------------------------ discovery

    def _find_tensors(self) -> dict[str, Path]:
        """Tensor name -> file, from the index, a single file, or every *.safetensors."""
        p = self.path
        if p.is_file():
            files = [p]
        else:
            index = p / "model.safetensors.index.json"
            if index.is_file():
                data = read_json(index)
                wmap = data.get("weight_map") if isinstance(data, dict) else None
                if not isinstance(wmap, dict):
                    raise ValueError(f"{index}: has no 'weight_map' object")
                out = {}
                for name, fname in wmap.items():
                    f = p / str(fname)
                    if not f.is_file():
                        raise FileNotFoundError(
                            f"{index} lists tensor {name!r} in {fname}, which does not exist"
                        )
                    out[name] = f
                return out
            single = p / "model.safetensors"
            files = [single] if single.is_file() else sorted(p.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{p}: no model.safetensors, model.safetensors.index.json or *.safetensors file"
                )
        out = {}
        for f in files:
            with open_safetensors(f) as h:
                for name in h.keys():
                    out[name] = f
        return out

    def _load_config(self) -> dict:
        cfg_path = (self.path if self.path.is_dir() else self.path.parent) / "config.json"
        if cfg_path.is_file():
            cfg = read_json(cfg_path)
            if not isinstance(cfg, dict):
                raise ValueError(f"{cfg_path}: expected a JSON object")
            self.config = cfg
        text = self.config.get("text_config")
        merged = dict(self.config)
        if isinstance(text, dict):
            merged.update(text)
        return merged

    def _check_quantization_config(self) -> None:
        qc = self._text_config.get("quantization_config")
        if not isinstance(qc, dict):
            return
        method = qc.get("quant_method")
        if method not in _SUPPORTED_QUANT_METHODS:
            raise ValueError(
                f"{self.path}: quantization_config.quant_method={method!r} is not supported; "
                f"kt_ops reads float checkpoints and {', '.join(_SUPPORTED_QUANT_METHODS)}"
            )
        if method == "fp8":
            block = qc.get("weight_block_size")
            if block is not None and list(block) != [128, 128]:
                raise ValueError(
                    f"{self.path}: fp8 weight_block_size={block}; kt_ops fp8 needs [128, 128]"
                )
            fmt = qc.get("fmt", "e4m3")
            if fmt != "e4m3":
                raise ValueError(f"{self.path}: fp8 fmt={fmt!r}; kt_ops fp8 needs 'e4m3'")

    def _group_layers(self, prefix: Optional[str]) -> dict[int, _LayerTensors]:
        layers: dict[tuple[str, int], _LayerTensors] = {}
        for name in self._weight_map:
            m = _PER_EXPERT_RE.match(name) or _FUSED_RE.match(name)
            if m is None or (prefix is not None and m["prefix"] != prefix):
                continue
            L = int(m["layer"])
            base = f"{m['prefix']}{L}.{m['block']}.experts."
            t = layers.setdefault((m["prefix"], L), _LayerTensors(L, base))
            if t.base != base:
                raise ValueError(
                    f"{self.path}: layer {L} has experts under both {t.base!r} and {base!r}"
                )
            if "expert" in m.groupdict() and m["expert"] is not None:
                key = (int(m["expert"]), _ROLE_OF[m["proj"]])
                d = t.per_expert.setdefault(key, {"proj": m["proj"]})
                if d["proj"] != m["proj"]:
                    raise ValueError(
                        f"{self.path}: layer {L} expert {key[0]} has both {d['proj']} and "
                        f"{m['proj']} tensors"
                    )
                d[m["kind"]] = name
            else:
                t.fused[m["proj"] + m["kind"]] = name
        prefixes = sorted({p for p, _ in layers})
        if len(prefixes) > 1:
            raise ValueError(
                f"{self.path}: routed experts under several prefixes {prefixes}; pick one "
                "with HFCheckpoint(path, prefix=...)"
            )
        out = {L: t for (_, L), t in layers.items()}
        for t in out.values():
            self._check_complete(t)
        return out

    def _check_complete(self, t: _LayerTensors) -> None:
        """Every expert 0..E-1 must have gate, up and down (or both fused tensors)."""
        if t.per_expert and t.fused:
            raise ValueError(
                f"{self.path}: layer {t.layer} mixes per-expert tensors and fused "
                f"tensors ({sorted(t.fused)[0]!r})"
            )
        if t.fused:
            have = set(t.fused)
            if "gate_up_proj_blocks" in have or "down_proj_blocks" in have:
                need = ["gate_up_proj_blocks", "gate_up_proj_scales"]
                need += ["down_proj_blocks", "down_proj_scales"]
            else:
                need = ["gate_up_proj", "down_proj"]
            for k in need:
                if k not in have:
                    raise ValueError(
                        f"{self.path}: expert tensor {t.base}{k} is missing (layer {t.layer})"
                    )
            return
        num_experts = max(e for e, _ in t.per_expert) + 1
        style = next(iter(t.per_expert.values()))["proj"]
        names = (
            {"gate": "w1", "up": "w3", "down": "w2"}
            if style in ("w1", "w2", "w3")
            else {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
        )
        for e in range(num_experts):
            for role in PROJECTIONS:
                d = t.per_expert.get((e, role))
                if d is None or "weight" not in d:
                    raise ValueError(
                        f"{self.path}: expert tensor {t.base}{e}.{names[role]}.weight is missing "
                        f"(layer {t.layer} has experts 0..{num_experts - 1})"
                    )

    # ------------------------------------------------------------------ headers and plans

    def _header(self, name: str, handles: dict) -> tuple[str, list[int]]:
        """(safetensors dtype string, shape) of tensor ``name``, from its file header."""
        h = self._handle(name, handles)
        try:
            sl = h.get_slice(name)
            return sl.get_dtype(), list(sl.get_shape())
        except Exception as e:
            raise ValueError(
                f"{self._weight_map[name]}: cannot read the header of tensor {name!r} "
                f"(the index may not match the shard): {e}"
            ) from e

    def _handle(self, name: str, handles: dict):
        f = self._weight_map[name]
        h = handles.get(f)
        if h is None:
            h = handles["__stack__"].enter_context(open_safetensors(f))
            handles[f] = h
        return h

    def _plan(self, layer: int) -> _LayerPlan:
        plan = self._plans.get(layer)
        if plan is None:
            with ExitStack() as stack:
                plan = self._make_plan(self._layers[layer], {"__stack__": stack})
            self._plans[layer] = plan
        return plan

    def _make_plan(self, t: _LayerTensors, handles: dict) -> _LayerPlan:
        where = f"{self.path}: layer {t.layer}"
        if t.fused:
            return self._make_fused_plan(t, handles)
        num_experts = max(e for e, _ in t.per_expert) + 1
        shapes = {}
        dtypes = set()
        for (_e, role), d in sorted(t.per_expert.items()):
            dt, shape = self._header(d["weight"], handles)
            dtypes.add(dt)
            if len(shape) != 2:
                raise ValueError(f"{where}: tensor {d['weight']} has shape {shape}; expected 2-D")
            shapes.setdefault(role, shape)
            if shape != shapes[role]:
                raise ValueError(
                    f"{where}: tensor {d['weight']} has shape {shape}; the other {role} "
                    f"projections have {shapes[role]}"
                )
        inter, hidden = shapes["gate"]
        if shapes["up"] != [inter, hidden] or shapes["down"] != [hidden, inter]:
            raise ValueError(
                f"{where}: expert shapes gate {shapes['gate']}, up {shapes['up']}, down "
                f"{shapes['down']}; expected gate/up [I, H] and down [H, I]"
            )
        if len(dtypes) != 1:
            raise ValueError(f"{where}: expert weights mix dtypes {sorted(dtypes)}")
        dt = dtypes.pop()
        if dt in _DENSE_DTYPES:
            return _LayerPlan(
                "per_expert", "dense", _DENSE_DTYPES[dt][0], num_experts, inter, hidden
            )
        if dt == "F8_E4M3":
            for (_e, role), d in sorted(t.per_expert.items()):
                if "weight_scale_inv" not in d:
                    raise ValueError(
                        f"{where}: fp8 tensor {d['weight']} has no {d['weight']}_scale_inv "
                        "(DeepSeek-V3 block scales) beside it"
                    )
                n, k = shapes[role]
                sdt, sshape = self._header(d["weight_scale_inv"], handles)
                expect = [-(-n // 128), -(-k // 128)]
                if sshape != expect or sdt not in _DENSE_DTYPES:
                    raise ValueError(
                        f"{where}: {d['weight_scale_inv']} is {sdt} {sshape}; expected a float "
                        f"tensor of shape {expect} (ceil(N/128), ceil(K/128))"
                    )
            return _LayerPlan("per_expert", "fp8", "fp8", num_experts, inter, hidden)
        raise ValueError(
            f"{where}: expert weights have dtype {dt}; supported: BF16, F16, F32, F8_E4M3 "
            "(with weight_scale_inv) and MXFP4 blocks/scales"
        )

    def _fused_gate_up_interleaved(self, t: _LayerTensors, mxfp4: bool) -> bool:
        """Whether a fused ``gate_up_proj`` interleaves gate and up (gpt-oss) or concatenates.

        The tensors cannot tell (both splits have the same shapes), so
        ``config.json`` decides: ``model_type`` (of ``text_config`` first) in
        :data:`INTERLEAVED_GATE_UP_MODEL_TYPES` means interleaved. It is
        checked, not guessed: a missing ``config.json`` or ``model_type`` is a
        ValueError, as are ``architectures`` that disagree with it
        (``GptOss*`` with another model type, or the reverse), and MXFP4
        experts of another model type than gpt-oss (transformers' MXFP4
        layout is gpt-oss's only).
        """
        where = f"{self.path}: layer {t.layer}"
        cfg_path = (self.path if self.path.is_dir() else self.path.parent) / "config.json"
        model_type = self._text_config.get("model_type") or self.config.get("model_type")
        if not isinstance(model_type, str) or not model_type:
            raise ValueError(
                f"{where}: fused experts ({t.base}gate_up_proj...) need config.json's "
                f"model_type to tell whether gate and up rows are interleaved (gpt-oss) or "
                f"concatenated; {cfg_path} "
                + ("has no model_type" if cfg_path.is_file() else "does not exist")
            )
        interleaved = model_type in INTERLEAVED_GATE_UP_MODEL_TYPES
        archs = self.config.get("architectures")
        if isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs):
            gpt_oss_arch = any(a.startswith("GptOss") for a in archs)
            if gpt_oss_arch != interleaved:
                raise ValueError(
                    f"{cfg_path}: model_type {model_type!r} and architectures {archs} disagree "
                    "on the gate/up layout of the fused experts (interleaved for gpt-oss only); "
                    "fix config.json"
                )
        if mxfp4 and not interleaved:
            raise ValueError(
                f"{where}: MXFP4 fused experts with model_type {model_type!r} in {cfg_path}; "
                "kt_ops knows the MXFP4 layout of gpt-oss only (model_type 'gpt_oss', "
                "interleaved gate/up)"
            )
        return interleaved

    def _make_fused_plan(self, t: _LayerTensors, handles: dict) -> _LayerPlan:
        where = f"{self.path}: layer {t.layer}"
        f = t.fused
        interleaved = self._fused_gate_up_interleaved(t, mxfp4="gate_up_proj_blocks" in f)
        if "gate_up_proj_blocks" in f:
            gb_dt, gb = self._header(f["gate_up_proj_blocks"], handles)
            gs_dt, gs = self._header(f["gate_up_proj_scales"], handles)
            db_dt, db = self._header(f["down_proj_blocks"], handles)
            ds_dt, ds = self._header(f["down_proj_scales"], handles)
            ok = (
                len(gb) == 4
                and len(db) == 4
                and gb[3] == 16
                and db[3] == 16
                and gb[0] == db[0]
                and gs == gb[:3]
                and ds == db[:3]
                and gb[1] % 2 == 0
                and {gb_dt, gs_dt, db_dt, ds_dt} == {"U8"}
            )
            if ok:
                num_experts, inter, hidden = gb[0], gb[1] // 2, gb[2] * 32
                ok = db[1] == hidden and db[2] * 32 == inter
            if not ok:
                raise ValueError(
                    f"{where}: MXFP4 tensors gate_up_proj_blocks {gb_dt} {gb}, _scales {gs_dt} "
                    f"{gs}, down_proj_blocks {db_dt} {db}, _scales {ds_dt} {ds}; expected uint8 "
                    "blocks [E, 2I, H/32, 16], scales [E, 2I, H/32], down blocks "
                    "[E, H, I/32, 16], scales [E, H, I/32]"
                )
            return _LayerPlan(
                "fused", "mxfp4", "mxfp4", num_experts, inter, hidden, interleaved=interleaved
            )
        gu_dt, gu = self._header(f["gate_up_proj"], handles)
        dn_dt, dn = self._header(f["down_proj"], handles)
        if len(gu) != 3 or len(dn) != 3 or gu[0] != dn[0]:
            raise ValueError(
                f"{where}: fused tensors gate_up_proj {gu} and down_proj {dn}; expected "
                "[E, 2I, H] and [E, H, I] (or transposed [E, H, 2I] and [E, I, H])"
            )
        # Not transposed: gate_up [E, 2I, H], down [E, H, I]; transposed: [E, H, 2I], [E, I, H].
        # Both cannot hold at once (it would need H = 0), so the shapes decide.
        if gu[1] % 2 == 0 and dn[1] == gu[2] and dn[2] == gu[1] // 2:
            transposed, inter, hidden = False, gu[1] // 2, gu[2]
        elif gu[2] % 2 == 0 and dn[2] == gu[1] and dn[1] == gu[2] // 2:
            transposed, inter, hidden = True, gu[2] // 2, gu[1]
        else:
            raise ValueError(
                f"{where}: fused tensors gate_up_proj {gu} and down_proj {dn}; expected "
                "[E, 2I, H] and [E, H, I] (or transposed [E, H, 2I] and [E, I, H])"
            )
        if gu_dt != dn_dt:
            raise ValueError(f"{where}: gate_up_proj is {gu_dt} but down_proj is {dn_dt}")
        num_experts = gu[0]
        if gu_dt in _DENSE_DTYPES:
            return _LayerPlan(
                "fused",
                "dense",
                _DENSE_DTYPES[gu_dt][0],
                num_experts,
                inter,
                hidden,
                transposed,
                interleaved,
            )
        if gu_dt == "F8_E4M3":
            if transposed or interleaved:
                raise ValueError(
                    f"{where}: fp8 fused experts must be [E, 2I, H] with gate rows then up rows"
                )
            for key, (n, k) in (
                ("gate_up_proj", (2 * inter, hidden)),
                ("down_proj", (hidden, inter)),
            ):
                sname = f.get(key + "_scale_inv")
                if sname is None:
                    raise ValueError(
                        f"{where}: fp8 tensor {f[key]} has no {t.base}{key}_scale_inv beside it"
                    )
                sdt, ss = self._header(sname, handles)
                expect = [num_experts, max(-(-n // 128), 2 if key == "gate_up_proj" else 1)]
                expect.append(-(-k // 128))
                if ss != expect or sdt not in _DENSE_DTYPES:
                    raise ValueError(
                        f"{where}: {sname} is {sdt} {ss}; expected a float tensor {expect}"
                    )
            if inter % 128 != 0:
                raise ValueError(
                    f"{where}: fused fp8 gate_up_proj with I={inter}: the 128-row scale blocks "
                    "straddle the gate/up boundary (I must be a multiple of 128)"
                )
            return _LayerPlan("fused", "fp8", "fp8", num_experts, inter, hidden)
        raise ValueError(
            f"{where}: fused expert weights have dtype {gu_dt}; supported: BF16, F16, F32, "
            "F8_E4M3 (with _scale_inv) and MXFP4 _blocks/_scales"
        )

    # ------------------------------------------------------------------ public API

    def layer_shape(self, layer: int) -> tuple[int, int, int]:
        """``(E, I, H)`` of MoE layer ``layer``; ValueError if it has no experts."""
        p = self._plan(self._check_layer(layer))
        return p.num_experts, p.intermediate_size, p.hidden_size

    def tensor_names(self, layer: int) -> list[str]:
        """Names of every checkpoint tensor that :meth:`load_layer` may read for ``layer``."""
        t = self._layers[self._check_layer(layer)]
        names = list(t.fused.values())
        for d in t.per_expert.values():
            names += [v for k, v in d.items() if k != "proj"]
        return sorted(names)

    def _check_layer(self, layer: int) -> int:
        if layer not in self._layers:
            raise ValueError(
                f"{self.path}: layer {layer} has no routed experts; MoE layers: {self.moe_layers}"
            )
        return layer

    def load_layer(
        self,
        layer: int,
        weight_format: Optional[str] = None,
        group_size: Optional[int] = None,
        symmetric: bool = True,
    ) -> ExpertWeights:
        """Read and pack the routed experts of one layer.

        Args:
            layer: a layer index from :attr:`moe_layers`.
            weight_format: a name of ``kt_ops.formats.FORMATS``, or None for
                :attr:`native_format`. fp8 sources packed as ``fp8`` and MXFP4
                sources packed as ``mxfp4`` are repacked bit-exactly (no
                dequantization); any other combination is quantized online from the
                source values (dequantized first for fp8/MXFP4), one chunk of experts
                at a time, with :func:`kt_ops.formats.quantize_weights`.
            group_size, symmetric: passed to ``quantize_weights`` (ignored by the
                native fp8/MXFP4 repacking).

        Returns:
            :class:`~kt_ops.layer.ExpertWeights`: gate, up ``[E, I, H]``, down
            ``[E, H, I]`` (``n, k`` as in ``nn.Linear``).

        Raises:
            ValueError: unknown layer or format, a corrupt file or tensor, or an
                error of the packer (e.g. a NaN fp8 / MXFP4 scale).
            FileNotFoundError: a shard disappeared since the checkpoint was opened.
        """
        check_format(weight_format)
        plan = self._plan(self._check_layer(layer))
        target = weight_format or self.native_format
        t = self._layers[layer]
        E, I, H = plan.num_experts, plan.intermediate_size, plan.hidden_size  # noqa: E741
        shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        out = {}
        with ExitStack() as stack:
            handles: dict = {"__stack__": stack}
            for role in PROJECTIONS:
                n, k = shapes[role]

                def pack(e0: int, e1: int, role=role, n=n, k=k) -> PackedProjection:
                    try:
                        if plan.encoding == "fp8" and target == "fp8":
                            w8, s = self._read_fp8(t, plan, role, e0, e1, handles)
                            return from_fp8(w8, s)
                        if plan.encoding == "mxfp4" and target == "mxfp4":
                            blocks, scales = self._read_mxfp4(t, plan, role, e0, e1, handles)
                            return from_mxfp4(blocks, scales)
                        dense = self._read_dense_fp32(t, plan, role, e0, e1, handles)
                        return quantize_chunk(dense, target, group_size, symmetric)
                    except (ValueError, FileNotFoundError):
                        raise
                    except Exception as e:
                        raise ValueError(
                            f"{self.path}: layer {layer} {role} experts {e0}..{e1 - 1}: {e}"
                        ) from e

                out[role] = pack_in_chunks(E, n, k, pack)
            weights = expert_weights(**out, where=f"{self.path}: layer {layer}")
            if self.has_expert_bias:
                biases = self._read_biases(t, plan, handles)
                try:
                    weights = weights.with_biases(*biases)
                except ValueError as e:  # e.g. non-finite values: name the checkpoint
                    raise ValueError(f"{self.path}: layer {layer} expert biases: {e}") from e
        return weights

    def _read_biases(self, t: _LayerTensors, plan: _LayerPlan, handles) -> tuple:
        """(gate [E, I], up [E, I], down [E, H]) biases of a layer, None where absent;
        ValueError naming a bias tensor whose shape is not its projection's."""
        E, I, H = plan.num_experts, plan.intermediate_size, plan.hidden_size  # noqa: E741

        def read(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            b = self._get(name, handles)
            if tuple(b.shape) != shape:
                raise ValueError(
                    f"{self.path}: expert bias {name} has shape {list(b.shape)}, expected "
                    f"{list(shape)} (E={E}, I={I}, H={H})"
                )
            return b.float()

        if plan.style == "per_expert":

            def stack(role: str):
                ds = [t.per_expert.get((e, role), {}) for e in range(E)]
                if not all("bias" in d for d in ds):
                    return None
                n = H if role == "down" else I
                return torch.stack([read(d["bias"], (n,)) for d in ds])

            return tuple(stack(role) for role in PROJECTIONS)
        gate = up = down = None
        if "gate_up_proj_bias" in t.fused:
            both = read(t.fused["gate_up_proj_bias"], (E, 2 * I))
            if plan.interleaved:
                gate, up = both[:, 0::2], both[:, 1::2]
            else:
                gate, up = both[:, :I], both[:, I:]
        if "down_proj_bias" in t.fused:
            down = read(t.fused["down_proj_bias"], (E, H))
        return gate, up, down

    def load_dense(self, layer: int) -> dict[str, torch.Tensor]:
        """The source values of one layer in fp32 (fp8 / MXFP4 dequantized).

        Returns ``{"gate": [E, I, H], "up": [E, I, H], "down": [E, H, I]}`` float32;
        the whole layer is materialized (for checks and small models).
        """
        plan = self._plan(self._check_layer(layer))
        t = self._layers[layer]
        with ExitStack() as stack:
            handles: dict = {"__stack__": stack}
            return {
                r: self._read_dense_fp32(t, plan, r, 0, plan.num_experts, handles)
                for r in PROJECTIONS
            }

    # ------------------------------------------------------------------ readers

    def _get(self, name: str, handles: dict, index=None) -> torch.Tensor:
        h = self._handle(name, handles)
        try:
            if index is None:
                return h.get_tensor(name)
            return h.get_slice(name)[index]
        except Exception as e:
            raise ValueError(f"{self._weight_map[name]}: cannot read tensor {name!r}: {e}") from e

    def _fused_rows(
        self, t: _LayerTensors, plan: _LayerPlan, key: str, role: str, e0: int, e1: int, handles
    ) -> torch.Tensor:
        """Rows of ``role`` from fused tensor ``key`` (e.g. "gate_up_proj_blocks"), [c, n, ...]."""
        name = t.fused[key]
        I = plan.intermediate_size  # noqa: E741
        if role == "down":
            return self._get(name, handles, slice(e0, e1))
        if plan.interleaved:
            both = self._get(name, handles, slice(e0, e1))
            return both[:, 0::2] if role == "gate" else both[:, 1::2]
        rows = slice(0, I) if role == "gate" else slice(I, 2 * I)
        return self._get(name, handles, (slice(e0, e1), rows))

    def _read_dense_fp32(
        self, t: _LayerTensors, plan: _LayerPlan, role: str, e0: int, e1: int, handles
    ) -> torch.Tensor:
        """Experts ``e0:e1`` of ``role`` as fp32 ``[c, N, K]`` (dequantized if fp8/MXFP4)."""
        if plan.encoding == "fp8":
            w8, s = self._read_fp8(t, plan, role, e0, e1, handles)
            return dequantize_fp8_blocks(w8, s)
        if plan.encoding == "mxfp4":
            blocks, scales = self._read_mxfp4(t, plan, role, e0, e1, handles)
            return dequantize_mxfp4_blocks(blocks, scales)
        if plan.style == "per_expert":
            ws = [self._get(t.per_expert[(e, role)]["weight"], handles) for e in range(e0, e1)]
            return torch.stack([w.float() for w in ws])
        I = plan.intermediate_size  # noqa: E741
        if not plan.transposed:
            key = "gate_up_proj" if role != "down" else "down_proj"
            return self._fused_rows(t, plan, key, role, e0, e1, handles).float()
        # transposed: gate_up [E, H, 2I] (columns: gate then up, or interleaved), down [E, I, H]
        if role == "down":
            w = self._get(t.fused["down_proj"], handles, slice(e0, e1))
        elif plan.interleaved:
            both = self._get(t.fused["gate_up_proj"], handles, slice(e0, e1))
            w = both[:, :, 0::2] if role == "gate" else both[:, :, 1::2]
        else:
            cols = slice(0, I) if role == "gate" else slice(I, 2 * I)
            w = self._get(t.fused["gate_up_proj"], handles, (slice(e0, e1), slice(None), cols))
        return w.float().transpose(1, 2).contiguous()

    def _read_fp8(
        self, t: _LayerTensors, plan: _LayerPlan, role: str, e0: int, e1: int, handles
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts ``e0:e1``: fp8 weight ``[c, N, K]`` and fp32 scale_inv ``[c, N/128, K/128]``."""
        if plan.style == "per_expert":
            ds = [t.per_expert[(e, role)] for e in range(e0, e1)]
            w = torch.stack([self._get(d["weight"], handles) for d in ds])
            s = torch.stack([self._get(d["weight_scale_inv"], handles).float() for d in ds])
            return w, s
        if role == "down":
            return (
                self._get(t.fused["down_proj"], handles, slice(e0, e1)),
                self._get(t.fused["down_proj_scale_inv"], handles, slice(e0, e1)).float(),
            )
        I = plan.intermediate_size  # noqa: E741
        rows = slice(0, I) if role == "gate" else slice(I, 2 * I)
        srows = slice(rows.start // 128, rows.stop // 128)
        w = self._get(t.fused["gate_up_proj"], handles, (slice(e0, e1), rows))
        s = self._get(t.fused["gate_up_proj_scale_inv"], handles, (slice(e0, e1), srows))
        return w, s.float()

    def _read_mxfp4(
        self, t: _LayerTensors, plan: _LayerPlan, role: str, e0: int, e1: int, handles
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts ``e0:e1``: uint8 blocks ``[c, N, K/32, 16]`` and scales ``[c, N, K/32]``."""
        stem = "down_proj" if role == "down" else "gate_up_proj"
        blocks = self._fused_rows(t, plan, stem + "_blocks", role, e0, e1, handles)
        scales = self._fused_rows(t, plan, stem + "_scales", role, e0, e1, handles)
        return blocks.contiguous(), scales.contiguous()

    def __repr__(self) -> str:
        return (
            f"HFCheckpoint({str(self.path)!r}, moe_layers={len(self.moe_layers)}, "
            f"E={self.num_experts}, H={self.hidden_size}, I={self.intermediate_size}, "
            f"source_dtype={self.source_dtype!r})"
        )
