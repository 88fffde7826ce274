"""GGUF blocks (llama.cpp / ggml) <-> the qint layout: lossless repacking and simple quantizers.

Block structs (ggml-common.h; the ``gguf`` package's ``gguf/quants.py`` decodes
the same bytes), ``QK_K = 256``, ``d``/``dmin`` fp16, little endian:

* ``block_q8_0`` (34 B / 32 weights): ``d``, ``int8 qs[32]``; ``W = d * qs``.
* ``block_q4_0`` (18 B / 32): ``d``, ``qs[16]``; weight ``i < 16`` is the low
  nibble of ``qs[i]``, weight ``i + 16`` the high nibble; ``W = d * (q - 8)``.
* ``block_q4_K`` (144 B / 256): ``d``, ``dmin``, ``scales[12]`` (8 six-bit
  scales ``sc`` and mins ``m``, ``get_scale_min_k4``), ``qs[128]``; sub-block
  ``2i`` / ``2i+1`` (32 weights each) are the low / high nibbles of
  ``qs[32i : 32i+32]``; ``W = d*sc[j] * q - dmin*m[j]``.
* ``block_q5_K`` (176 B / 256): ``d``, ``dmin``, ``scales[12]``, ``qh[32]``,
  ``qs[128]``; low 4 bits as q4_K, bit 4 of weight ``l`` of sub-block ``j``
  is bit ``j`` of ``qh[l]``.
* ``block_q6_K`` (210 B / 256): ``ql[128]``, ``qh[64]``, ``int8 scales[16]``,
  ``d``; in each half ``i`` (128 weights), weight ``32t + l`` has low bits
  from ``ql[64i + 32(t%2) + l]`` (nibble ``t//2``), high bits ``(qh[32i + l]
  >> 2t) & 3``; 16 weights per scale; ``W = d*sc * (q - 32)``.

The repacked scales are ``d`` (fp16, q8_0/q4_0) or, for the k-quants, GGUF's
own scale bytes (``d``, ``dmin``, ``scales[12]`` / ``scales[16]``), copied into
records of 16 rows x 256 k (docs/formats.md, "k-quant scales"); only the codes
are rearranged. The kernels form ``d*sc`` and ``dmin*m`` (exact in fp32), so
the qint dequantization reproduces ``gguf.quants.dequantize`` bit for bit.
"""

from __future__ import annotations

import enum
import numbers
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor

from kt_ops.formats.packed import PackedProjection
from kt_ops.formats.qint import pack_codes, pack_group_params, pack_kquant_scales
from kt_ops.formats.spec import FORMATS, format_spec

__all__ = ["GGUF_FORMATS", "from_gguf", "quantize_gguf_raw"]

#: The GGUF types kt_ops repacks (``from_gguf``): the formats with a ``gguf_block``.
GGUF_FORMATS = tuple(f for f in FORMATS if format_spec(f).is_gguf)


def _qtype_name(qtype: Any) -> str:
    if isinstance(qtype, enum.Enum):  # gguf.GGMLQuantizationType
        name = qtype.name.lower()
    elif isinstance(qtype, str):
        name = qtype.lower()
    else:
        raise ValueError(f"qtype must be a name or a gguf.GGMLQuantizationType, got {qtype!r}")
    if name not in GGUF_FORMATS:
        raise ValueError(
            f"qtype={qtype!r} is not supported; supported GGUF types: {', '.join(GGUF_FORMATS)}"
        )
    return name


def _f16(a: np.ndarray) -> np.ndarray:
    """Bytes ``[..., 2]`` -> fp16 ``[...]`` (little endian)."""
    return np.ascontiguousarray(a).view("<f2")[..., 0]


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4_K/q5_K ``scales[..., 12]`` -> six-bit ``sc[..., 8]``, ``m[..., 8]`` (get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_scale_min_k4`: six-bit ``sc``, ``m`` ``[..., 8]`` -> ``[..., 12]``."""
    out = np.empty(sc.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    return out


def _as_bytes(raw: Any) -> np.ndarray:
    if isinstance(raw, Tensor):
        if raw.dtype != torch.uint8:
            raise ValueError(f"from_gguf: raw must hold uint8 bytes, got {raw.dtype}")
        return raw.detach().cpu().contiguous().numpy().reshape(-1)
    if isinstance(raw, np.ndarray):
        if raw.dtype != np.uint8:
            raise ValueError(f"from_gguf: raw must hold uint8 bytes, got {raw.dtype}")
        return np.ascontiguousarray(raw).reshape(-1)
    raise ValueError(
        f"from_gguf: raw must be a uint8 numpy array or tensor, got {type(raw).__name__}"
    )


def from_gguf(
    qtype: Union[str, Any], raw: Union[np.ndarray, Tensor], n: int, k: int
) -> PackedProjection:
    """Repack the raw GGUF blocks of an ``[E, n, k]`` tensor losslessly into the qint layout.

    Args:
        qtype: ``'q8_0'``, ``'q4_0'``, ``'q4_k'``, ``'q5_k'`` or ``'q6_k'``
            (any case) or the matching ``gguf.GGMLQuantizationType``.
        raw: uint8 numpy array or tensor with the block bytes, rows of ``k``
            weights along GGUF's first dimension ``ne0``: shape
            ``[E, n, k / block * type_size]`` as ``gguf.GGUFReader`` returns
            it, or any shape with ``E * n * row_bytes`` bytes (``E`` is
            inferred from the byte count).
        n, k: output rows and inputs of one expert.

    Returns:
        A validated :class:`PackedProjection` of format ``qtype``: codes in the
        qint planes, scales ``d`` (fp16, q8_0/q4_0) or the k-quants' scale
        records (uint8 ``[E, NB, K/256, 256 | 288]``, GGUF's bytes), no
        zeros, group 32 (q6_k: 16).
        Dequantizing it gives exactly ``gguf.quants.dequantize(raw, qtype)``.

    Raises:
        ValueError: unsupported ``qtype``; ``n``/``k`` not positive, ``k`` not a
            multiple of the block size (32 or 256); ``raw`` not uint8, or its
            byte count not a positive multiple of ``n * row_bytes``; a
            non-finite fp16 ``d``/``dmin`` in ``raw``.
    """
    name = _qtype_name(qtype)
    spec = format_spec(name)
    bs, ts = spec.gguf_block
    n, k = (
        v if isinstance(v, bool) or not isinstance(v, numbers.Integral) else int(v) for v in (n, k)
    )
    for arg, v in (("n", n), ("k", k)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise ValueError(f"from_gguf: {arg} must be a positive int, got {v!r}")
    if k % bs:
        raise ValueError(f"from_gguf: k={k} is not a multiple of the {name} block size {bs}")
    data = _as_bytes(raw)
    row_bytes = k // bs * ts
    if data.size == 0 or data.size % (n * row_bytes):
        raise ValueError(
            f"from_gguf: raw has {data.size} bytes, expected E * n * row_bytes = E * {n} * "
            f"{row_bytes} for a {name} tensor [E, n={n}, k={k}]"
        )
    E = data.size // (n * row_bytes)
    blk = data.reshape(E, n, k // bs, ts)
    if name == "q8_0":
        d = _f16(blk[..., 0:2])
        codes = blk[..., 2:].view(np.int8)
        scales = d
    elif name == "q4_0":
        d = _f16(blk[..., 0:2])
        qs = blk[..., 2:18]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
        scales = d
    elif spec.record_mins:  # q4_K, q5_K: d, dmin, scales[12] ahead of the codes
        _check_finite(name, _f16(blk[..., 0:2]), _f16(blk[..., 2:4]))
        head = blk[..., 0:16]  # d, dmin, scales[12]: copied as they are
        if name == "q4_k":
            qs = blk[..., 16:144].reshape(E, n, -1, 4, 1, 32)
            codes = qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)  # [..., 4, 2, 32]
            codes = codes & 15
        else:
            qh = blk[..., 16:48].reshape(E, n, -1, 1, 32)
            qs = blk[..., 48:176].reshape(E, n, -1, 4, 1, 32)
            low = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15  # [..., 4, 2, 32]
            high = (qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # [..., 8, 32]
            codes = low.reshape(E, n, -1, 8, 32) | (high << 4)
    else:  # q6_k
        ql = blk[..., 0:128].reshape(E, n, -1, 2, 1, 2, 32)  # [i][.][a][l]
        qh = blk[..., 128:192].reshape(E, n, -1, 2, 1, 32)  # [i][.][l]
        _check_finite(name, _f16(blk[..., 208:210]))
        head = blk[..., 192:210]  # int8 scales[16], d: copied as they are
        # weight 32t + l of half i, t = 2s + a: nibble s of ql[64i + 32a + l]
        low = (ql >> np.array([0, 4], dtype=np.uint8).reshape(2, 1, 1)) & 15  # [..., 2, 2, 2, 32]
        high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3  # [..., 2, 4, 32]
        codes = low.reshape(E, n, -1, 2, 4, 32) | (high << 4)
    codes_t = torch.from_numpy(np.ascontiguousarray(codes).reshape(E, n, k))
    pad = 0 if spec.signed else 1 << (spec.bits - 1)
    g = spec.default_group_size
    weight = pack_codes(codes_t, spec.bits, pad_code=pad)
    if spec.is_kquant:
        scales = pack_kquant_scales(torch.from_numpy(np.ascontiguousarray(head)), name)
    else:
        _check_finite(name, scales.astype(np.float32))
        scales = pack_group_params(torch.from_numpy(scales.reshape(E, n, k // g)), spec.scale_dtype)
    p = PackedProjection(
        weight=weight,
        scales=scales,
        zeros=None,
        weight_format=name,
        group_size=g,
        n=n,
        k=k,
    )
    return p.validate()


def _check_finite(name: str, *arrays: np.ndarray) -> None:
    for a in arrays:
        if not np.isfinite(a).all():
            raise ValueError(f"from_gguf: raw has a non-finite fp16 d/dmin in a {name} block")


# --------------------------------------------------------------------------- quantizers


def _to_f16(a: np.ndarray, what: str) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    if not np.isfinite(h).all():
        raise ValueError(f"quantize_weights: weight is too large for the fp16 {what} of the format")
    return h


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a / b`` where ``b > 0``, else 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1), 0).astype(np.float32)


def _quantize_q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Blocks ``[B, 256]`` fp32 -> q4_K (bits=4) or q5_K (bits=5) bytes ``[B, 144 | 176]``."""
    B = x.shape[0]
    nmax = (1 << bits) - 1
    xs = x.reshape(B, 8, 32)
    mn = np.minimum(xs.min(-1), 0)
    scale = (xs.max(-1) - mn) / nmax
    d = _to_f16(scale.max(-1) / 63, "d")
    dmin = _to_f16((-mn).max(-1) / 63, "dmin")
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(_div(-mn, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    s = d.astype(np.float32)[:, None] * sc
    z = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint(_div(xs + z[..., None], s[..., None])), 0, nmax).astype(np.uint8)
    head = [d.view(np.uint8).reshape(B, 2), dmin.view(np.uint8).reshape(B, 2)]
    head.append(_pack_scale_min_k4(sc, m))
    q4 = q.reshape(B, 4, 2, 32) & 15
    qs = (q4[:, :, 0] | (q4[:, :, 1] << 4)).reshape(B, 128)
    if bits == 4:
        return np.concatenate([*head, qs], axis=-1)
    hb = (q >> 4) & 1  # [B, 8 (j), 32 (l)] -> bit j of qh[l]
    qh = (hb << np.arange(8, dtype=np.uint8).reshape(8, 1)).sum(axis=1, dtype=np.uint8)
    return np.concatenate([*head, qh, qs], axis=-1)


def _quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Blocks ``[B, 256]`` fp32 -> q6_K bytes ``[B, 210]``."""
    B = x.shape[0]
    xs = x.reshape(B, 16, 16)
    scale = np.abs(xs).max(-1) / 31
    d = _to_f16(scale.max(-1) / 127, "d")
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), 0, 127).astype(np.int8)
    s = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.rint(_div(xs, s[..., None])) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(B, 2, 2, 2, 32)  # [i][s][a][l]: weight 128i + 32(2s + a) + l
    ql = ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(B, 128)
    hb = (q.reshape(B, 2, 4, 32) >> 4) & 3  # [i][t][l] -> bits 2t of qh[32i + l]
    qh = (hb << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)).sum(axis=2, dtype=np.uint8)
    return np.concatenate(
        [ql, qh.reshape(B, 64), sc.view(np.uint8), d.view(np.uint8).reshape(B, 2)], axis=-1
    )


def quantize_gguf_raw(weight: np.ndarray, qtype: Union[str, Any]) -> np.ndarray:
    """Quantize fp32 ``[..., K]`` to raw GGUF blocks ``[..., K / block * type_size]`` (uint8).

    ``q8_0`` and ``q4_0`` use ``gguf.quants.quantize`` (bit-exact with
    llama.cpp's reference quantizers). The ``gguf`` package cannot quantize
    the k-quants, so ``q4_k``/``q5_k``/``q6_k`` use a simple round-to-nearest
    quantizer here: per sub-block min/max (min clipped to <= 0) or absmax,
    6-bit (q6_K: int8) sub-block scales against an fp16 super-block ``d``.
    It writes valid blocks but skips llama.cpp's iterative scale search
    (``make_qkx2_quants``), so its error is somewhat larger than
    ``llama-quantize``'s; convert a GGUF file for production weights.

    Raises:
        ValueError: unsupported ``qtype``, ``K`` not a multiple of the block
            size, or weights whose fp16 super-block scale would overflow.
    """
    name = _qtype_name(qtype)
    spec = format_spec(name)
    bs, ts = spec.gguf_block
    x = np.ascontiguousarray(weight, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] % bs:
        raise ValueError(
            f"quantize_weights: K={x.shape[-1] if x.ndim else 0} is not a multiple of the "
            f"{name} block size {bs}"
        )
    if not spec.is_kquant:  # q8_0, q4_0
        import gguf  # noqa: PLC0415  (optional dependency)

        qt = getattr(gguf.GGMLQuantizationType, name.upper())
        return gguf.quants.quantize(x, qt)
    blocks = x.reshape(-1, bs)
    out = _quantize_q45_k(blocks, spec.bits) if spec.record_mins else _quantize_q6_k(blocks)
    return out.reshape(*x.shape[:-1], x.shape[-1] // bs * ts)
