"""Routed experts of checkpoints published already quantized, read as they are stored.

:class:`QuantizedCheckpoint` reads one ``nn.Linear``-per-expert tensor group per
projection (``{prefix}layers.{L}.{mlp|block_sparse_moe|ffn}.experts.{e}.{proj}.*`` with
``proj`` one of ``gate_proj``/``up_proj``/``down_proj`` or ``w1``/``w3``/``w2``) in
one of these schemes, chosen from ``config.json``'s ``quantization_config`` (or, for
DeepSeek-V4, from the tensor names and dtypes):

======================  ===========================================  ==============  =====
scheme                  tensors of one projection ``[N, K]``          kt_ops format   exact
======================  ===========================================  ==============  =====
GPTQ (``gptq``)         ``qweight`` int32 ``[K/8, N]``, ``qzeros``    ``int4``        yes
                        int32 ``[G, N/8]``, ``scales`` fp16 ``[G,
                        N]``, ``g_idx`` int32 ``[K]``
GPTQ with ``desc_act``  as above, ``g_idx`` not ``k // group``        ``bf16``        no
AWQ (``awq``, GEMM)     ``qweight`` int32 ``[K, N/8]`` (nibble        ``int4``        yes
                        order 0 2 4 6 1 3 5 7), ``qzeros`` ``[G,
                        N/8]``, ``scales`` fp16 ``[G, N]``
compressed-tensors      ``weight_packed`` int32 ``[N, K/8]``,         ``int4``        yes
``pack-quantized`` int4 ``weight_scale`` ``[N, G]``,
                        ``weight_zero_point`` int32 ``[N/8, G]``
compressed-tensors      ``weight_packed`` uint8 ``[N, K/2]``,         ``nvfp4``       yes
``nvfp4-pack-quantized``  ``weight_scale`` E4M3 ``[N, K/16]``,
                        ``weight_global_scale`` fp32 ``[1]``
ModelOpt NVFP4          ``weight`` uint8 ``[N, K/2]``, ``weight_scale``  ``nvfp4``     yes
(``modelopt``)          E4M3 ``[N, K/16]``, ``weight_scale_2`` fp32
compressed-tensors      ``weight_packed`` uint8 ``[N, K/2]``,         ``mxfp4``       yes
``mxfp4-pack-quantized``  ``weight_scale`` uint8 UE8M0 ``[N, K/32]``
compressed-tensors      ``weight`` E4M3 ``[N, K]``, ``weight_scale``  ``fp8``         yes
``float-quantized`` fp8   fp32 ``[N/128, K/128]`` (block 128x128)
  (per channel)         ``weight_scale`` ``[N, 1]`` (also without a    ``fp8_channel`` yes
                        config: GLM-4.7-FP8, kt-kernel FP8_PERCHANNEL)
compressed-tensors      ``weight`` E4M3 ``[N, K]``, ``weight_scale``  ``mxfp8``       yes
``mxfp8-quantized``       uint8 UE8M0 ``[N, K/32]``
MiniMax-M3 MXFP8        ``weight`` E4M3, ``weight_scale_inv`` uint8   ``mxfp8``       yes
                        UE8M0 ``[N, K/32]`` (no config needed)
DeepSeek-V4 MXFP4       ``weight`` int8/uint8 ``[N, K/2]``, ``scale``  ``mxfp4``       yes
                        UE8M0 ``[N, K/32]``
======================  ===========================================  ==============  =====

Sources (the packing conventions): GPTQ: AutoGPTQ / GPTQModel ``pack`` (codes along K,
eight a word, first in the low bits; zero points along N likewise; the
``checkpoint_format`` ``"gptq"`` (v1) stores ``z - 1``, ``"gptq_v2"`` stores ``z``).
AWQ: AutoAWQ ``WQLinear_GEMM`` (``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``, as undone by
compressed-tensors' ``AutoAWQConverter``). compressed-tensors: its ``pack_to_int32``
(signed codes ``+ 2^(bits-1)``, zero points packed along N), ``NVFP4PackedCompressor``
(``W = e2m1 * weight_scale / weight_global_scale``); ModelOpt: ``W = e2m1 *
weight_scale * weight_scale_2``. DeepSeek-V4: two E2M1 codes a byte,
first in the low nibble (``torch.float4_e2m1fn_x2``), one UE8M0 exponent per 32.

"Exact" means the packed experts dequantize to the producer's own dequantization
evaluated in fp32 (``s * (q - z)``, ``e2m1 * b * g``). The inexact row holds what no
kt_ops format represents: GPTQ act-order scales change along K per column; such
projections are dequantized exactly in fp32 and packed as ``bf16`` (relative error at
most 2^-9 per weight) unless ``weight_format`` asks for another format. Any scheme
can also be requantized to any format (``weight_format``). Files are memory-mapped;
one layer is read per :meth:`QuantizedCheckpoint.load_layer`.
"""

from __future__ import annotations

import logging
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from kt_ops.formats import (
    PackedProjection,
    dequantize_weights,
    from_fp8,
    from_fp8_channel,
    from_int4,
    from_mxfp4,
    from_mxfp8,
    from_nvfp4,
)
from kt_ops.formats.int4 import int4_scale_dtype
from kt_ops.formats.quantize import quantize_chunk
from kt_ops.layer import PROJECTIONS, ExpertWeights
from kt_ops.loaders._common import check_format, pack_in_chunks
from kt_ops.loaders.base import CheckpointReader, expert_weights
from kt_ops.loaders.compressed_tensors import safetensors_files
from kt_ops.loaders.safetensors_io import open_safetensors, read_json

__all__ = ["QuantizedCheckpoint", "quantization_scheme"]

logger = logging.getLogger(__name__)

_EXPERT_RE = re.compile(
    r"^(?P<prefix>(?:.+\.)?)layers\.(?P<layer>\d+)\.(?P<block>mlp|block_sparse_moe|ffn)\."
    r"experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.(?P<kind>\w+)$"
)
_ROLE_OF = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_ROLE_OF.update({"w1": "gate", "w3": "up", "w2": "down"})
_AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass(frozen=True)
class Scheme:
    """One checkpoint's quantization scheme, as read from its config.

    ``name``: ``gptq``, ``awq``, ``ct_int4``, ``ct_nvfp4``, ``ct_mxfp4``, ``ct_fp8_block``,
    ``ct_fp8_channel``, ``modelopt_nvfp4`` or ``dsv4_mxfp4``; ``weight_tensor``: the suffix
    that marks an expert projection (``qweight``, ``weight_packed``, ``weight``);
    ``group_size``: the config's (-1 or 0: per channel); ``symmetric``; ``zero_offset``:
    what to add to a stored GPTQ zero point (1 for v1 checkpoints).
    """

    name: str
    weight_tensor: str
    group_size: int = 0
    symmetric: bool = True
    zero_offset: int = 0
    desc_act: bool = False

    @property
    def native_format(self) -> str:
        return {
            "gptq": "int4",
            "awq": "int4",
            "ct_int4": "int4",
            "ct_nvfp4": "nvfp4",
            "modelopt_nvfp4": "nvfp4",
            "ct_mxfp4": "mxfp4",
            "ct_fp8_block": "fp8",
            "ct_fp8_channel": "fp8_channel",
            "ct_mxfp8": "mxfp8",
            "mxfp8_scale_inv": "mxfp8",
            "dsv4_mxfp4": "mxfp4",
        }[self.name]


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{where}: {what}")


def _compressed_tensors_scheme(qc: dict, where: str) -> Scheme:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    _need(
        isinstance(groups, dict) and groups, where, "compressed-tensors config has no config_groups"
    )
    weights = []
    for g in groups.values():
        w = g.get("weights") if isinstance(g, dict) else None
        if isinstance(w, dict):
            weights.append(w)
    _need(bool(weights), where, "compressed-tensors config_groups hold no 'weights' arguments")
    w = weights[0]
    for other in weights[1:]:
        _need(other == w, where, "config_groups quantize weights differently; kt_ops reads one")
    bits, typ = w.get("num_bits"), w.get("type")
    strategy, gs = w.get("strategy"), w.get("group_size")
    sym = bool(w.get("symmetric", True))
    if fmt == "pack-quantized":
        _need(
            bits == 4 and typ == "int", where, f"pack-quantized {typ} {bits} bit; kt_ops reads int4"
        )
        _need(
            strategy in ("group", "channel"),
            where,
            f"pack-quantized int4 strategy {strategy!r}; expected 'group' or 'channel'",
        )
        group = int(gs) if strategy == "group" else 0
        return Scheme("ct_int4", "weight_packed", group, sym)
    if fmt == "nvfp4-pack-quantized":
        _need(
            bits == 4 and typ == "float" and gs == 16, where, "nvfp4 must be float 4 bit, group 16"
        )
        return Scheme("ct_nvfp4", "weight_packed", 16)
    if fmt == "mxfp4-pack-quantized":
        _need(
            bits == 4 and typ == "float" and gs == 32, where, "mxfp4 must be float 4 bit, group 32"
        )
        return Scheme("ct_mxfp4", "weight_packed", 32)
    if fmt == "float-quantized":
        _need(bits == 8 and typ == "float", where, f"float-quantized {bits} bit; kt_ops reads fp8")
        if strategy == "block":
            block = w.get("block_structure")
            _need(
                list(block or []) == [128, 128],
                where,
                f"fp8 block_structure {block}; kt_ops needs [128, 128]",
            )
            return Scheme("ct_fp8_block", "weight")
        _need(
            strategy == "channel",
            where,
            f"fp8 strategy {strategy!r}; expected 'block' or 'channel'",
        )
        return Scheme("ct_fp8_channel", "weight")
    if fmt == "mxfp8-quantized":
        _need(
            bits == 8 and typ == "float" and gs == 32, where, "mxfp8 must be float 8 bit, group 32"
        )
        return Scheme("ct_mxfp8", "weight", 32)
    raise ValueError(
        f"{where}: compressed-tensors format {fmt!r} is not read; kt_ops reads pack-quantized "
        "(int4), nvfp4-pack-quantized, mxfp4-pack-quantized, float-quantized (fp8) and "
        "mxfp8-quantized"
    )


def quantization_scheme(config: dict, where: str) -> Optional[Scheme]:
    """The :class:`Scheme` of a ``config.json`` (its ``quantization_config``, looked up in
    ``text_config`` too), or None when it has none this reader handles.

    Raises ValueError for a GPTQ / AWQ / compressed-tensors config kt_ops cannot read
    (bits other than 4, AWQ GEMV packing, ...), naming the field.
    """
    qc = config.get("quantization_config")
    text = config.get("text_config")
    if not isinstance(qc, dict) and isinstance(text, dict):
        qc = text.get("quantization_config")
    if not isinstance(qc, dict):
        return None
    method = qc.get("quant_method")
    if method == "gptq":
        _need(qc.get("bits") == 4, where, f"GPTQ bits={qc.get('bits')}; kt_ops reads 4-bit GPTQ")
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        _need(
            fmt in ("gptq", "gptq_v2"),
            where,
            f"GPTQ checkpoint_format={fmt!r}; expected 'gptq' or 'gptq_v2'",
        )
        gs = int(qc.get("group_size", 128))
        return Scheme(
            "gptq",
            "qweight",
            0 if gs <= 0 else gs,
            bool(qc.get("sym", True)),
            1 if fmt == "gptq" else 0,
            bool(qc.get("desc_act", False)),
        )
    if method == "awq":
        _need(qc.get("bits", qc.get("w_bit")) == 4, where, "AWQ bits must be 4")
        version = str(qc.get("version", "gemm")).lower()
        _need(version == "gemm", where, f"AWQ version={version!r}; kt_ops reads the GEMM packing")
        gs = int(qc.get("group_size", qc.get("q_group_size", 128)))
        return Scheme("awq", "qweight", 0 if gs <= 0 else gs, not qc.get("zero_point", True))
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, where)
    if method == "modelopt":
        algo = qc.get("quant_algo")
        _need(algo == "NVFP4", where, f"ModelOpt quant_algo={algo!r}; kt_ops reads NVFP4")
        return Scheme("modelopt_nvfp4", "weight", 16)
    return None


def _nibbles(words: Tensor, dim: int) -> Tensor:
    """int32 words -> their eight 4-bit fields along ``dim`` (first in the low bits)."""
    b = words.contiguous().view(torch.uint8)  # little endian: byte 0 holds fields 0 and 1
    b = b.view(*words.shape, 4)
    f = torch.stack([b & 15, b >> 4], dim=-1).view(*words.shape, 8)
    if dim == -1 or dim == words.dim() - 1:
        return f.flatten(-2)
    return f.movedim(-1, dim + 1).flatten(dim, dim + 1)


class QuantizedCheckpoint(CheckpointReader):
    """The routed experts of a GPTQ, AWQ, compressed-tensors or DeepSeek-V4 MXFP4 checkpoint.

    Args:
        path: the checkpoint directory (``config.json`` and ``*.safetensors``, with or
            without an index), or one safetensors file beside its ``config.json``.

    Attributes:
        path; ``kind``: ``"quantized_<scheme>"``; ``scheme`` (:class:`Scheme`);
        ``layers`` (= ``moe_layers``); ``num_layers``; ``native_format``; ``source_dtype``.

    Raises:
        FileNotFoundError: no safetensors file.
        ValueError: no scheme this reader reads, no expert tensors of it, or experts under
            several prefixes; the message names the file and field.
    """

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        files = safetensors_files(self.path)
        if not files:
            raise FileNotFoundError(f"{self.path}: no *.safetensors files")
        cfg_path = (self.path if self.path.is_dir() else self.path.parent) / "config.json"
        config = read_json(cfg_path) if cfg_path.is_file() else {}
        self._names: dict[str, Path] = {}
        for f in files:
            with open_safetensors(f) as h:
                for name in h.keys():
                    self._names[name] = f
        scheme = quantization_scheme(config, str(cfg_path))
        if scheme is None:
            scheme = self._scheme_from_tensors()
        if scheme is None:
            raise ValueError(
                f"{self.path}: no GPTQ, AWQ or compressed-tensors quantization_config in "
                f"{cfg_path.name}, and no DeepSeek-V4 MXFP4 experts"
            )
        self.scheme = scheme
        self.kind = f"quantized_{scheme.name}"
        # GPTQ act-order layers load as bf16 (an act-order config whose g_idx turn out to
        # be in natural order still loads as exact int4).
        self.native_format = "bf16" if scheme.desc_act else scheme.native_format
        self.source_dtype = scheme.name
        text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        layers: dict[int, dict[tuple[int, str], str]] = {}
        prefixes = set()
        for name in self._names:
            m = _EXPERT_RE.match(name)
            if m is None or m["kind"] != scheme.weight_tensor:
                continue
            prefixes.add(m["prefix"] + m["block"])
            base = name[: -len(scheme.weight_tensor)]
            layers.setdefault(int(m["layer"]), {})[(int(m["expert"]), _ROLE_OF[m["proj"]])] = base
        if not layers:
            raise ValueError(
                f"{self.path}: no {scheme.name} expert tensors (names like "
                f"'model.layers.0.mlp.experts.0.gate_proj.{scheme.weight_tensor}')"
            )
        if len(prefixes) > 1:
            raise ValueError(
                f"{self.path}: routed experts under several prefixes {sorted(prefixes)}"
            )
        for L, entries in layers.items():
            E = max(e for e, _ in entries) + 1
            for e in range(E):
                for role in PROJECTIONS:
                    if (e, role) not in entries:
                        raise ValueError(
                            f"{self.path}: layer {L} expert {e} has no {role} projection "
                            f"({scheme.weight_tensor}); the layer has experts 0..{E - 1}"
                        )
        self._layers = layers
        self.moe_layers = self.layers = sorted(layers)
        self.num_layers = int(
            text.get("num_hidden_layers", config.get("num_hidden_layers", self.layers[-1] + 1))
        )
        if scheme.desc_act:
            logger.info("kt_ops: %s: GPTQ desc_act; act-order layers load as bf16", self.path)

    def _scheme_from_tensors(self) -> Optional[Scheme]:
        """Checkpoints known by their tensors (no ``quantization_config`` kt_ops reads):
        DeepSeek-V4's MXFP4 (``ffn.experts.{i}.w1.scale``), MiniMax-M3's MXFP8 (fp8
        ``weight`` with uint8 ``weight_scale_inv`` per 32) and fp8 per output channel
        (fp8 ``weight`` with ``weight_scale`` ``[N]`` or ``[N, 1]``: GLM-4.7-FP8)."""
        with ExitStack() as stack:
            handles: dict = {"__stack__": stack}
            for name in self._names:
                m = _EXPERT_RE.match(name)
                if m is None:
                    continue
                if m["block"] == "ffn" and m["kind"] == "scale":
                    return Scheme("dsv4_mxfp4", "weight", 32)
                if m["kind"] in ("weight_scale_inv", "weight_scale"):
                    base = name[: -len(m["kind"])]
                    if base + "weight" not in self._names:
                        continue
                    wdt, _ = self._header(base + "weight", handles)
                    sdt, sshape = self._header(name, handles)
                    if wdt != "F8_E4M3":
                        continue
                    if m["kind"] == "weight_scale_inv" and sdt in ("U8", "F8_E8M0"):
                        return Scheme("mxfp8_scale_inv", "weight", 32)
                    if m["kind"] == "weight_scale" and (
                        len(sshape) == 1 or (len(sshape) == 2 and sshape[1] == 1)
                    ):
                        return Scheme("ct_fp8_channel", "weight")
        return None

    # ------------------------------------------------------------------ tensors

    def _header(self, name: str, handles: dict) -> tuple[str, list[int]]:
        sl = self._handle(name, handles).get_slice(name)
        return sl.get_dtype(), list(sl.get_shape())

    def _handle(self, name: str, handles: dict):
        if name not in self._names:
            raise ValueError(f"{self.path}: tensor {name} is missing")
        f = self._names[name]
        if f not in handles:
            handles[f] = handles["__stack__"].enter_context(open_safetensors(f))
        return handles[f]

    def _get(self, name: str, handles: dict) -> Tensor:
        try:
            return self._handle(name, handles).get_tensor(name)
        except ValueError:
            raise
        except Exception as e:  # a truncated or corrupt file
            raise ValueError(f"{self._names[name]}: cannot read tensor {name}: {e}") from e

    def _shape(self, base: str, handles: dict) -> tuple[int, int]:
        """``(N, K)`` of one projection, from its headers."""
        s = self.scheme
        name = base + s.weight_tensor
        dt, shape = self._header(name, handles)
        where = f"{self._names[name]}: {name}"
        _need(len(shape) == 2, where, f"has shape {shape}; expected 2-D")
        if s.name == "gptq":
            _need(dt == "I32", where, f"is {dt}; GPTQ qweight is int32 [K/8, N]")
            return shape[1], shape[0] * 8
        if s.name == "awq":
            _need(dt == "I32", where, f"is {dt}; AWQ qweight is int32 [K, N/8]")
            return shape[1] * 8, shape[0]
        if s.name == "ct_int4":
            if base + "weight_shape" in self._names:
                ws = self._get(base + "weight_shape", handles).tolist()
                return int(ws[0]), int(ws[1])
            _need(dt in ("I32", "U8"), where, f"is {dt}; expected int32 [N, K/8]")
            return shape[0], shape[1] * (8 if dt == "I32" else 2)
        if s.name in ("ct_nvfp4", "ct_mxfp4", "dsv4_mxfp4", "modelopt_nvfp4"):
            _need(
                dt in ("U8", "I8"),
                where,
                f"is {dt}; expected uint8 [N, K/2] (two E2M1 codes a byte)",
            )
            return shape[0], shape[1] * 2
        _need(dt == "F8_E4M3", where, f"is {dt}; expected float8_e4m3fn [N, K]")
        return shape[0], shape[1]

    def layer_shape(self, layer: int) -> tuple[int, int, int]:
        """``(E, I, H)`` of ``layer``, from the headers of expert 0's gate projection."""
        entries = self._check_layer(layer)
        with ExitStack() as stack:
            n, k = self._shape(entries[(0, "gate")], {"__stack__": stack})
        return max(e for e, _ in entries) + 1, n, k

    def _check_layer(self, layer: int) -> dict[tuple[int, str], str]:
        if layer not in self._layers:
            raise ValueError(f"{self.path}: layer {layer} has no routed experts: {self.layers}")
        return self._layers[layer]

    # ------------------------------------------------------------------ decoding

    def _check_groups(self, where: str, name: str, groups: int, k: int) -> None:
        """``groups`` scales a row must be what the config's group size gives for ``k``."""
        gs = self.scheme.group_size
        want = 1 if gs == 0 else -(-k // gs)
        _need(
            groups == want,
            where,
            f"{name} holds {groups} groups a row, but the config's group_size={gs or -1} gives "
            f"{want} for K={k} (a mismatched group size)",
        )

    def _int4_parts(self, base: str, n: int, k: int, handles: dict) -> dict[str, Any]:
        """codes ``[N, K]``, scales ``[N, G]``, zero points ``[N, G]`` (or None), g_idx."""
        get = lambda suffix: self._get(base + suffix, handles)  # noqa: E731
        where = f"{self.path}: {base}"
        out = self._int4_tensors(base, n, k, get, where)
        self._check_groups(where, "the scales", out["scales"].shape[1], k)
        if out["zeros"] is not None:
            _need(
                tuple(out["zeros"].shape) == tuple(out["scales"].shape),
                where,
                f"the zero points unpack to {list(out['zeros'].shape)}, the scales are "
                f"{list(out['scales'].shape)}",
            )
        return out

    def _int4_tensors(self, base: str, n: int, k: int, get, where: str) -> dict[str, Any]:
        s = self.scheme
        if s.name == "ct_int4":
            w = get("weight_packed")
            if w.dtype == torch.int32:
                codes = _nibbles(w, -1)[:, :k]
            else:
                codes = torch.stack([w & 15, w >> 4], dim=-1).flatten(-2)[:, :k]
            scale = get("weight_scale")
            _need(
                scale.dim() == 2 and scale.shape[0] == n,
                where,
                f"weight_scale has shape {list(scale.shape)}; expected [{n}, G]",
            )
            zp = None
            if not s.symmetric:
                z = get("weight_zero_point")
                # pack_to_int32 stores signed zero points + 8, packed along N; an unpacked
                # one is the signed int8 value.
                if z.dtype == torch.int32:
                    zp = _nibbles(z, 0)[:n].to(torch.int64)
                else:
                    zp = z.to(torch.int64) + 8
            _need(
                tuple(codes.shape) == (n, k),
                where,
                f"weight_packed holds {list(codes.shape)} codes; expected [{n}, {k}]",
            )
            return {"codes": codes, "scales": scale, "zeros": zp}
        qweight, scales = get("qweight"), get("scales")
        qzeros = get("qzeros") if base + "qzeros" in self._names else None
        if s.name == "gptq":
            _need(
                tuple(qweight.shape) == (k // 8, n),
                where,
                f"qweight has shape {list(qweight.shape)}; expected [K/8={k // 8}, N={n}]",
            )
            codes = _nibbles(qweight, 0).t()  # [N, K]
            G = scales.shape[0]
            _need(
                scales.dim() == 2 and scales.shape[1] == n,
                where,
                f"scales has shape {list(scales.shape)}; expected [G, {n}]",
            )
            zp = None
            if qzeros is not None:
                zp = ((_nibbles(qzeros, 1)[:, :n].to(torch.int64) + s.zero_offset) & 15).t()
            elif not s.symmetric:
                raise ValueError(f"{where}qzeros is missing (asymmetric GPTQ)")
            gidx = get("g_idx").to(torch.int64) if base + "g_idx" in self._names else None
            if gidx is not None:
                _need(
                    gidx.shape == (k,), where, f"g_idx has shape {list(gidx.shape)}; expected [{k}]"
                )
                _need(
                    int(gidx.min()) >= 0 and int(gidx.max()) < G,
                    where,
                    f"g_idx values outside [0, {G})",
                )
            elif s.desc_act:
                raise ValueError(f"{where}g_idx is missing (GPTQ desc_act)")
            return {"codes": codes, "scales": scales.t(), "zeros": zp, "g_idx": gidx}
        # AWQ GEMM
        _need(
            tuple(qweight.shape) == (k, n // 8),
            where,
            f"qweight has shape {list(qweight.shape)}; expected [K={k}, N/8={n // 8}]",
        )
        # Column 8w + i of the output is nibble _AWQ_REVERSE_ORDER[i] of word w.
        cols = (torch.arange(n // 8).view(-1, 1) * 8 + torch.tensor(_AWQ_REVERSE_ORDER)).flatten()
        codes = _nibbles(qweight, -1)[:, cols].t()  # [N, K]
        zp = None
        if qzeros is not None:
            zp = _nibbles(qzeros, -1)[:, cols].t().to(torch.int64)
        elif not s.symmetric:
            raise ValueError(f"{where}qzeros is missing (AWQ zero_point)")
        _need(
            scales.dim() == 2 and scales.shape[1] == n,
            where,
            f"scales has shape {list(scales.shape)}; expected [G, {n}]",
        )
        return {"codes": codes, "scales": scales.t(), "zeros": zp}

    def _pack_int4(self, parts: list[dict], n: int, k: int, scale_dtype) -> PackedProjection:
        codes = torch.stack([p["codes"] for p in parts])
        scales = torch.stack([p["scales"] for p in parts])
        zeros = None if parts[0]["zeros"] is None else torch.stack([p["zeros"] for p in parts])
        return from_int4(codes, scales, zeros, scale_dtype)

    def _act_order(self, parts: list[dict], k: int) -> bool:
        gidx = parts[0].get("g_idx")
        if gidx is None:
            return False
        G = parts[0]["scales"].shape[1]
        natural = torch.arange(k) // (k // G) if k % G == 0 else None
        return natural is None or any(not torch.equal(p["g_idx"], natural) for p in parts)

    def _dense_int4(self, parts: list[dict]) -> Tensor:
        """fp32 ``s[g_idx] * (q - z[g_idx])`` of GPTQ act-order experts (exact in fp32)."""
        out = []
        for p in parts:
            g = p["g_idx"]
            s = p["scales"].float()[:, g]
            z = 8 if p["zeros"] is None else p["zeros"][:, g]
            out.append(s * (p["codes"].to(torch.int64) - z).float())
        return torch.stack(out)

    def _exact(self, base_list: list[str], n: int, k: int, handles: dict, ctx: dict):
        """The experts of ``base_list`` as stored: packed, or fp32 for the inexact rows."""
        s = self.scheme
        get = lambda b, suffix: self._get(b + suffix, handles)  # noqa: E731
        if s.name in ("gptq", "awq", "ct_int4"):
            parts = [ctx["parts"][b] for b in base_list]
            if ctx["act_order"]:
                return self._dense_int4(parts)
            return self._pack_int4(parts, n, k, ctx["scale_dtype"])
        if s.name == "ct_nvfp4":
            w = torch.stack([get(b, "weight_packed").view(torch.uint8) for b in base_list])
            bs = torch.stack([get(b, "weight_scale") for b in base_list])
            gs = torch.stack(
                [get(b, "weight_global_scale").float().flatten()[0] for b in base_list]
            )
            # weight_scale / weight_global_scale in fp32, as compressed-tensors divides.
            return from_nvfp4(w, bs.float() / gs.view(-1, 1, 1), 1.0)
        if s.name == "modelopt_nvfp4":  # W = e2m1 * weight_scale * weight_scale_2
            w = torch.stack([get(b, "weight").view(torch.uint8) for b in base_list])
            bs = torch.stack([get(b, "weight_scale") for b in base_list])
            s2 = torch.stack([get(b, "weight_scale_2").float().flatten()[0] for b in base_list])
            return from_nvfp4(w, bs, s2)
        if s.name in ("ct_mxfp4", "dsv4_mxfp4"):
            wname, sname = (
                ("weight_packed", "weight_scale") if s.name == "ct_mxfp4" else ("weight", "scale")
            )
            w = torch.stack([get(b, wname).view(torch.uint8) for b in base_list])
            sc = torch.stack([get(b, sname).view(torch.uint8) for b in base_list])
            return from_mxfp4(w, sc)
        w8 = torch.stack([get(b, "weight") for b in base_list])
        if s.name in ("ct_mxfp8", "mxfp8_scale_inv"):
            sname = "weight_scale" if s.name == "ct_mxfp8" else "weight_scale_inv"
            return from_mxfp8(w8, torch.stack([get(b, sname).view(torch.uint8) for b in base_list]))
        sc = torch.stack([get(b, "weight_scale").float() for b in base_list])
        if s.name == "ct_fp8_block":
            return from_fp8(w8, sc)
        _need(
            tuple(sc.shape[1:]) in ((n, 1), (n,)),
            f"{self.path}: {base_list[0]}weight_scale",
            f"has shape {list(sc.shape[1:])}; expected [{n}, 1]",
        )
        return from_fp8_channel(w8, sc.view(-1, n))

    def check_weight_format(self, layer: int, weight_format: Optional[str]) -> None:
        """Any format: None keeps the stored scheme (:attr:`native_format`)."""
        check_format(weight_format)
        self._check_layer(layer)

    def load_layer(
        self,
        layer: int,
        weight_format: Optional[str] = None,
        group_size: Optional[int] = None,
        symmetric: bool = True,
    ) -> ExpertWeights:
        """The experts of ``layer``: as stored (``weight_format`` None or the native format),
        else dequantized exactly and quantized to ``weight_format`` (a few experts at a time).

        Raises ValueError for a missing, truncated or malformed tensor (naming it).
        """
        self.check_weight_format(layer, weight_format)
        entries = self._layers[layer]
        E = max(e for e, _ in entries) + 1
        out = {}
        with ExitStack() as stack:
            handles: dict = {"__stack__": stack}
            for role in PROJECTIONS:
                bases = [entries[(e, role)] for e in range(E)]
                n, k = self._shape(bases[0], handles)
                for b in bases[1:]:
                    _need(
                        self._shape(b, handles) == (n, k),
                        f"{self.path}: {b}{self.scheme.weight_tensor}",
                        f"holds a projection of another shape than expert 0's [{n}, {k}]",
                    )
                ctx: dict[str, Any] = {}
                if self.scheme.name in ("gptq", "awq", "ct_int4"):
                    # The codes of a layer's projection (uint8, twice the stored bytes) are
                    # decoded once, so that every chunk agrees on the scale dtype and on
                    # the act-order decision.
                    parts = {b: self._int4_parts(b, n, k, handles) for b in bases}
                    ctx["parts"] = parts
                    ctx["scale_dtype"] = int4_scale_dtype(
                        torch.stack([p["scales"] for p in parts.values()])
                    )
                    ctx["act_order"] = self._act_order(list(parts.values()), k)

                def pack(e0: int, e1: int, bases=bases, n=n, k=k, ctx=ctx) -> PackedProjection:
                    got = self._exact(bases[e0:e1], n, k, handles, ctx)
                    native = isinstance(got, PackedProjection)
                    if native and weight_format in (None, got.weight_format):
                        return got
                    dense = dequantize_weights(got) if native else got
                    target = weight_format or "bf16"
                    return quantize_chunk(dense, target, group_size, symmetric)

                out[role] = pack_in_chunks(E, n, k, pack)
        return expert_weights(**out, where=f"{self.path}: layer {layer}")

    def __repr__(self) -> str:
        return (
            f"QuantizedCheckpoint({str(self.path)!r}, scheme={self.scheme.name}, "
            f"layers={len(self.layers)})"
        )
