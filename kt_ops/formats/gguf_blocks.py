"""GGUF blocks (llama.cpp / ggml) <-> the qint layout: lossless repacking and simple quantizers.

Block structs (ggml-common.h; the ``gguf`` package's ``gguf/quants.py`` decodes
the same bytes), ``QK_K = 256``, ``d``/``dmin`` fp16, little endian:

* ``block_q8_0`` (34 B / 32 weights): ``d``, ``int8 qs[32]``; ``W = d * qs``.
* ``block_q4_0`` (18 B / 32): ``d``, ``qs[16]``; weight ``i < 16`` is the low
  nibble of ``qs[i]``, weight ``i + 16`` the high nibble; ``W = d * (q - 8)``.
* ``block_q4_1`` (20 B / 32): ``d``, ``m``, ``qs[16]`` in q4_0's nibble order;
  ``W = d * q + m``.
* ``block_q5_0`` (22 B / 32): ``d``, ``uint32 qh``, ``qs[16]``; weight ``i`` has the
  low bits of q4_0's nibble ``i`` and bit 4 from bit ``i`` of ``qh``; ``W = d * (q - 16)``.
* ``block_q5_1`` (24 B / 32): ``d``, ``m``, ``qh``, ``qs[16]`` as q5_0;
  ``W = d * q + m``.
* ``block_mxfp4`` (17 B / 32): ``uint8 e``, ``qs[16]`` in q4_0's nibble order;
  ``W = kvalues_mxfp4[q] * 2^(e - 128)``, ``kvalues_mxfp4`` twice the E2M1 values (OCP MX
  v1.0), so ``W = e2m1(q) * 2^(e - 127)``: kt_ops' ``mxfp4`` with ``E = e`` (``e = 255``,
  NaN in OCP MX and finite in ggml, is refused).
* ``block_nvfp4`` (36 B / 64): ``uint8 d[4]``, ``qs[32]``; sub-block ``s`` (16 weights)
  has the UE4M3 scale ``d[s]`` (E4M3 without its sign bit) and its weights ``l < 8`` /
  ``l + 8`` in the low / high nibbles of ``qs[8s + l]``; ``W = kvalues[q] * ue4m3(d[s]) /
  2``, ``kvalues`` twice the E2M1 values, so ``W = e2m1(q) * ue4m3(d[s])``: kt_ops'
  ``nvfp4`` with the per-tensor scale 1. ggml's quantizer writes the bytes 0 to 0x7E; the
  others (0x7F, read as 0 by ggml, and any byte with bit 7 set, whose bit ggml ignores)
  are refused.
* ``block_q2_K`` (84 B / 256): ``scales[16]`` (``sc`` in the low nibble,
  ``m`` in the high one, 16 weights each), ``qs[64]``, ``d``, ``dmin``; in
  each half ``i`` (128 weights), weight ``32t + l`` is ``(qs[32i + l] >> 2t)
  & 3``; ``W = d*sc[j] * q - dmin*m[j]``.
* ``block_q3_K`` (110 B / 256): ``hmask[32]``, ``qs[64]``, ``scales[12]`` (16
  six-bit scales, packed as ggml's ``dequantize_row_q3_K`` unpacks them), ``d``;
  weight ``32t + l`` of half ``i`` has low bits ``(qs[32i + l] >> 2t) & 3`` and
  high bit ``(hmask[l] >> (4i + t)) & 1``; ``W = d*(sc[j] - 32) * (q - 4)``
  with ``q = low + 4 * high`` (ggml: ``low - (high ? 0 : 4)``).
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
* ``block_iq4_nl`` (18 B / 32): ``d``, ``qs[16]`` with q4_0's nibble order;
  ``W = d * kvalues_iq4nl[q]`` (a non-linear grid of 16 signed values,
  ggml-quants.c; :data:`kt_ops.formats.IQ4NL_VALUES`).
* ``block_iq4_xs`` (136 B / 256): ``d``, ``uint16 scales_h``, ``scales_l[4]``,
  ``qs[128]``; sub-block ``j`` (32 weights) has the 6-bit scale ``ls_j =
  ((scales_l[j/2] >> 4(j%2)) & 15) | (((scales_h >> 2j) & 3) << 4)`` and its
  weights ``l < 16`` / ``l + 16`` in the low / high nibbles of ``qs[16j + l]``;
  ``W = d*(ls_j - 32) * kvalues_iq4nl[q]``.

NVFP4's UE4M3 scales are held as fp32 (half the value, as every ``nvfp4`` projection
holds its block scales), 6 bits a weight against GGUF's 4.5.
The repacked scales are ``d`` (fp16, q8_0/q4_0/q4_1/q5_0/q5_1; q4_1 and q5_1 keep
``-m`` as their fp16 zeros, ``W = d*q - (-m)``) or, for the k-quants, GGUF's
own scale bytes (``d``, ``dmin``, ``scales[12]`` / ``scales[16]``), copied into
records of 16 rows x 256 k (docs/formats.md, "k-quant scales"); only the codes
are rearranged (q3_K's 6-bit scales are unpacked to int8 ``sc - 32``, q6_K's
record; IQ4_XS's likewise into its own record of int8 ``ls - 32``). q2_K's and q3_K's codes go
into 2- and 3-bit planes: exact, q2_K at GGUF's 2.625 bits a weight, q3_K at 3.5625 (GGUF:
3.4375; its 6-bit sub-scales held as bytes). IQ4_NL's and
IQ4_XS's 4-bit codes are stored as they are (their table is the kernels'), at GGUF's size
(4.5 / 4.3 bits). The kernels form ``d*sc`` and ``dmin*m`` (exact in fp32), so
the qint dequantization reproduces ``gguf.quants.dequantize`` bit for bit.
"""

from __future__ import annotations

import enum
import numbers
from typing import Any, Union

import numpy as np
import torch
from torch import Tensor

from kt_ops.formats.dequant import IQ4NL_VALUES
from kt_ops.formats.grid import pack_grid, quantize_grid
from kt_ops.formats.nvfp4 import _block_codes as nvfp4_block_codes
from kt_ops.formats.packed import PackedProjection
from kt_ops.formats.qint import pack_codes, pack_group_params, pack_kquant_scales
from kt_ops.formats.spec import FORMATS, format_spec

__all__ = ["GGUF_FORMATS", "from_gguf", "quantize_gguf_raw"]

#: The GGUF types kt_ops repacks (``from_gguf``): the formats with a ``gguf_block``.
GGUF_FORMATS = tuple(f for f in FORMATS if format_spec(f).is_gguf)

#: UE4M3 byte -> its fp32 value (E4M3 of OCP MX v1.0 / torch.float8_e4m3fn, bytes 0-0x7E).
_UE4M3_VALUES = torch.arange(128, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


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


def _crumbs(a: np.ndarray) -> np.ndarray:
    """Bytes ``[..., 1, L]`` -> their four 2-bit fields ``[..., 4, L]``, bits ``2t`` first."""
    return (a >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3


def _pack_crumbs(q: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_crumbs`: 2-bit values ``[B, 256]`` -> bytes ``[B, 64]``, value
    ``128i + 32t + l`` at bits ``2t`` of byte ``32i + l`` (q2_K's / q3_K's ``qs``, q6_K's
    ``qh``)."""
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8) & 3
    return (
        (q << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1))
        .sum(axis=2, dtype=np.uint8)
        .reshape(-1, 64)
    )


def _scales_q3_k(b: np.ndarray) -> np.ndarray:
    """q3_K ``scales[..., 12]`` -> the 16 six-bit scales ``[..., 16]`` (0..63; ggml subtracts 32).

    As ``dequantize_row_q3_K``: scale ``i``'s low four bits are the low (``i < 8``) or
    high (``i >= 8``) nibble of byte ``i % 8``, its two high bits bits ``2 (i // 4)`` and
    ``2 (i // 4) + 1`` of byte ``8 + i % 4``.
    """
    lo = np.concatenate([b[..., 0:8] & 15, b[..., 0:8] >> 4], axis=-1)  # [..., 16]
    hb = b[..., 8:12]
    hi = np.concatenate([(hb >> s) & 3 for s in (0, 2, 4, 6)], axis=-1)  # i // 4 = s / 2
    return lo | (hi << 4)


def _pack_scales_q3_k(s: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_scales_q3_k`: six-bit ``[..., 16]`` -> ``scales[..., 12]``."""
    out = np.empty(s.shape[:-1] + (12,), dtype=np.uint8)
    out[..., 0:8] = (s[..., 0:8] & 15) | ((s[..., 8:16] & 15) << 4)
    hi = s >> 4  # [..., 16], two bits each
    out[..., 8:12] = (
        hi[..., 0:4] | (hi[..., 4:8] << 2) | (hi[..., 8:12] << 4) | (hi[..., 12:16] << 6)
    )
    return out


def _scales_iq4_xs(b: np.ndarray) -> np.ndarray:
    """IQ4_XS ``scales_h`` (2 bytes, little endian) and ``scales_l[4]`` ``[..., 6]`` -> the 8
    six-bit scales ``ls`` ``[..., 8]`` (0..63; ggml subtracts 32)."""
    h = b[..., 0:1].astype(np.uint16) | (b[..., 1:2].astype(np.uint16) << 8)
    hi = (h >> (2 * np.arange(8, dtype=np.uint16))) & 3  # [..., 8]
    lo = (b[..., 2:6, None] >> np.array([0, 4], dtype=np.uint8)) & 15  # [..., 4, 2]
    return (lo.reshape(*b.shape[:-1], 8) | (hi.astype(np.uint8) << 4)).astype(np.uint8)


def _pack_scales_iq4_xs(ls: np.ndarray) -> np.ndarray:
    """Inverse of :func:`_scales_iq4_xs`: six-bit ``[..., 8]`` -> ``scales_h, scales_l`` bytes."""
    hi = (ls >> 4).astype(np.uint16) & 3
    h = (hi << (2 * np.arange(8, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16)
    lo = (ls & 15).reshape(*ls.shape[:-1], 4, 2)
    out = np.empty(ls.shape[:-1] + (6,), dtype=np.uint8)
    out[..., 0] = h & 0xFF
    out[..., 1] = h >> 8
    out[..., 2:6] = lo[..., 0] | (lo[..., 1] << 4)
    return out


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
        qtype: ``'mxfp4'``, ``'nvfp4'``, ``'q8_0'``, ``'q4_0'``, ``'q4_1'``, ``'q5_0'``,
            ``'q5_1'``,
            ``'q2_k'``, ``'q3_k'``, ``'q4_k'``,
            ``'q5_k'``, ``'q6_k'``, ``'iq4_nl'`` or ``'iq4_xs'`` (any case) or the
            matching ``gguf.GGMLQuantizationType``.
        raw: uint8 numpy array or tensor with the block bytes, rows of ``k``
            weights along GGUF's first dimension ``ne0``: shape
            ``[E, n, k / block * type_size]`` as ``gguf.GGUFReader`` returns
            it, or any shape with ``E * n * row_bytes`` bytes (``E`` is
            inferred from the byte count).
        n, k: output rows and inputs of one expert.

    Returns:
        A validated :class:`PackedProjection` of format ``qtype``: codes in the
        qint planes, the exponent bytes (uint8, mxfp4), half the UE4M3 scales (fp32,
        nvfp4, group 16), scales ``d`` (fp16,
        q8_0/q4_0/q4_1/q5_0/q5_1/iq4_nl) or the
        scale records of the k-quants and iq4_xs (uint8 ``[E, NB, K/256, 256 | 288 |
        320 | 160]``, GGUF's bytes), zeros ``-m`` (fp16, q4_1 and q5_1; else none),
        group 32 (q2_k, q3_k, q6_k: 16).
        Dequantizing it gives exactly ``gguf.quants.dequantize(raw, qtype)``.

    Raises:
        ValueError: unsupported ``qtype``; ``n``/``k`` not positive, ``k`` not a
            multiple of the block size (32 or 256); ``raw`` not uint8, or its
            byte count not a positive multiple of ``n * row_bytes``; a
            non-finite fp16 ``d``/``dmin`` in ``raw``; an MXFP4 exponent byte 255; an
            NVFP4 scale byte 0x7F or above.
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
    if spec.is_grid:  # the i-quants on lattice grids: their blocks as stored
        return pack_grid(name, data.reshape(E, n, row_bytes), n, k)
    blk = data.reshape(E, n, k // bs, ts)
    zeros = None  # q4_1, q5_1: -m
    if name == "q8_0":
        d = _f16(blk[..., 0:2])
        codes = blk[..., 2:].view(np.int8)
        scales = d
    elif name == "mxfp4":  # e, qs[16]: E2M1 codes as stored, the exponent byte as E
        scales = blk[..., 0]
        if (scales == 255).any():
            raise ValueError(
                "from_gguf: raw has an MXFP4 exponent byte 255 (NaN in OCP MX; ggml reads it "
                "as 2^127), which kt_ops' mxfp4 does not hold"
            )
        qs = blk[..., 1:17]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
    elif name == "nvfp4":  # d[4] (UE4M3 per 16), qs[32]: q4_0's nibble order per 16
        d = blk[..., 0:4]
        if (d >= 0x7F).any():
            bad = int(d[d >= 0x7F][0])
            raise ValueError(
                f"from_gguf: raw has an NVFP4 scale byte 0x{bad:02X}; UE4M3 scales are 0x00-"
                "0x7E (0x7F is NaN in E4M3, ggml reads it as 0; bit 7 is no part of UE4M3), "
                "so the file is corrupt or not NVFP4"
            )
        scales = _UE4M3_VALUES[d] * np.float32(0.5)  # kt_ops' nvfp4 scale: half of b * g
        qs = blk[..., 4:36].reshape(E, n, -1, 4, 8)
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)  # [.., 4, 16]: E2M1 as stored
    elif name in ("q4_0", "iq4_nl", "q4_1", "q5_0", "q5_1"):  # d, [m], [qh], qs[16]
        d = _f16(blk[..., 0:2])
        has_m, has_qh = name in ("q4_1", "q5_1"), name in ("q5_0", "q5_1")
        at = 4 if has_m else 2
        if has_m:
            m = _f16(blk[..., 2:4])
            _check_finite(name, m.astype(np.float32))
            zeros = -m  # W = d*q + m = d*q - zero
        if has_qh:  # bit i of the little-endian uint32 qh: bit 4 of weight i
            qh = blk[..., at : at + 4, None] >> np.arange(8, dtype=np.uint8)
            high = (qh & 1).reshape(*blk.shape[:-1], 32)
            at += 4
        qs = blk[..., at : at + 16]
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
        if has_qh:
            codes = codes | (high << 4)
        scales = d
    elif name == "iq4_xs":  # d, scales_h, scales_l[4], qs[128]
        _check_finite(name, _f16(blk[..., 0:2]))
        sc = _scales_iq4_xs(blk[..., 2:8]).astype(np.int16) - 32  # [.., 8] in [-32, 31]
        head = np.concatenate([sc.astype(np.int8).view(np.uint8), blk[..., 0:2]], axis=-1)
        qs = blk[..., 8:136].reshape(E, n, -1, 8, 1, 16)  # [j][.][l]
        codes = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 15  # [.., 8, 2, 16]
    elif name == "q2_k":  # scales[16], qs[64], d, dmin
        _check_finite(name, _f16(blk[..., 80:82]), _f16(blk[..., 82:84]))
        head = np.concatenate([blk[..., 0:16], blk[..., 80:84]], axis=-1)
        qs = blk[..., 16:80].reshape(E, n, -1, 2, 1, 32)  # [i][.][l]
        codes = _crumbs(qs)  # [.., 2, 4, 32]
    elif name == "q3_k":  # hmask[32], qs[64], scales[12], d
        _check_finite(name, _f16(blk[..., 108:110]))
        sc = _scales_q3_k(blk[..., 96:108]).astype(np.int16) - 32  # [.., 16] in [-32, 31]
        head = np.concatenate([sc.astype(np.int8).view(np.uint8), blk[..., 108:110]], axis=-1)
        qs = blk[..., 32:96].reshape(E, n, -1, 2, 1, 32)
        hm = blk[..., 0:32].reshape(E, n, -1, 1, 1, 32)
        low = _crumbs(qs)  # [.., 2, 4, 32]
        high = (hm >> np.arange(8, dtype=np.uint8).reshape(2, 4, 1)) & 1  # bit 4i + t
        codes = low | (high << 2)
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
        high = _crumbs(qh)  # [..., 2, 4, 32]
        codes = low.reshape(E, n, -1, 2, 4, 32) | (high << 4)
    codes_t = torch.from_numpy(np.ascontiguousarray(codes).reshape(E, n, k))
    pad = 0 if spec.signed else 1 << (spec.bits - 1)
    g = spec.default_group_size
    weight = pack_codes(codes_t, spec.bits, pad_code=pad)
    if spec.is_kquant:
        scales = pack_kquant_scales(torch.from_numpy(np.ascontiguousarray(head)), name)
    else:
        if scales.dtype != np.uint8:  # fp16 d (mxfp4: exponent bytes, all finite)
            _check_finite(name, scales.astype(np.float32))
        scales = pack_group_params(
            torch.from_numpy(np.ascontiguousarray(scales).reshape(E, n, k // g)), spec.scale_dtype
        )
        if zeros is not None:
            zeros = pack_group_params(
                torch.from_numpy(np.ascontiguousarray(zeros).reshape(E, n, k // g)),
                spec.scale_dtype,
            )
    p = PackedProjection(
        weight=weight,
        scales=scales,
        zeros=zeros,
        weight_format=name,
        group_size=g,
        n=n,
        k=k,
    )
    return p.validate()


def ternary_as_q2_k(qtype: Union[str, Any], raw: np.ndarray) -> np.ndarray:
    """GGUF TQ1_0 / TQ2_0 (ternary) blocks ``uint8 [..., 54 | 66]`` -> q2_K blocks ``uint8
    [..., 84]`` holding exactly the same weights.

    TQ2_0 (ggml-common.h ``block_tq2_0``: ``qs[64]``, fp16 ``d``) is ``W = d (q - 1)`` with
    2-bit ``q`` laid out as q2_K's ``qs``; TQ1_0 (``qs[48]``, ``qh[4]``, ``d``) packs ``q``
    in base 3 (``dequantize_row_tq1_0``), unpacked here as ``gguf.quants`` does. q2_K's
    ``W = d sc q - dmin m`` per 16 with ``sc = m = 1`` and ``dmin = d`` is ``d q - d``:
    the same fp32 values (``d q`` and ``d`` are exact for ``q <= 3``), at 2.625 bits a
    weight (TQ1_0: 1.6875, TQ2_0: 2.0625).

    Raises:
        ValueError: ``qtype`` is neither, or ``raw``'s last dimension is not its block.
    """
    name = qtype.name.lower() if isinstance(qtype, enum.Enum) else str(qtype).lower()
    size = {"tq1_0": 54, "tq2_0": 66}.get(name)
    if size is None or raw.shape[-1] != size:
        raise ValueError(f"ternary_as_q2_k: expected TQ1_0 / TQ2_0 blocks, got {name} {raw.shape}")
    lead = raw.shape[:-1]
    blk = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, size)
    if name == "tq2_0":
        qs, d = blk[:, 0:64], blk[:, 64:66]
    else:  # 5 trits a byte in qs[0:32] (x 32) and qs[32:48] (x 16), 4 in qh[4] (x 4)
        pow3 = np.array([1, 3, 9, 27, 81], dtype=np.uint8)
        parts = [
            (blk[:, None, 0:32] * pow3[:, None]).reshape(-1, 160),
            (blk[:, None, 32:48] * pow3[:, None]).reshape(-1, 80),
            (blk[:, None, 48:52] * pow3[:4, None]).reshape(-1, 16),
        ]
        q = (np.concatenate(parts, -1).astype(np.uint16) * 3) >> 8  # [B, 256] in 0 .. 2
        qs, d = _pack_crumbs(q), blk[:, 52:54]
    scales = np.full((blk.shape[0], 16), 0x11, dtype=np.uint8)  # sc = 1, m = 1
    return np.concatenate([scales, qs, d, d], -1).reshape(*lead, 84)


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
    """``a / b`` where ``b != 0``, else 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def _signed_absmax(a: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis, with its sign ``[...]``."""
    return np.take_along_axis(a, np.abs(a).argmax(-1)[..., None], axis=-1)[..., 0]


def _min_max_quants(xs: np.ndarray, nmax: int, smax: int) -> tuple[np.ndarray, ...]:
    """Sub-blocks ``[B, J, L]`` fp32 -> ``d``, ``dmin`` fp16 ``[B]``, sub-scales ``sc``, mins
    ``m`` ``[B, J]`` (``0..smax``) and codes ``q`` ``[B, J, L]`` (``0..nmax``), by round to
    nearest: ``W ~ d*sc * q - dmin*m`` with the sub-block's min clipped to <= 0 (q2_K,
    q4_K, q5_K)."""
    mn = np.minimum(xs.min(-1), 0)
    scale = (xs.max(-1) - mn) / nmax
    d = _to_f16(scale.max(-1) / smax, "d")
    dmin = _to_f16((-mn).max(-1) / smax, "dmin")
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), 0, smax).astype(np.uint8)
    m = np.clip(np.rint(_div(-mn, dmin.astype(np.float32)[:, None])), 0, smax).astype(np.uint8)
    s = d.astype(np.float32)[:, None] * sc
    z = dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.rint(_div(xs + z[..., None], s[..., None])), 0, nmax).astype(np.uint8)
    return d, dmin, sc, m, q


def _quantize_q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """Blocks ``[B, 256]`` fp32 -> q4_K (bits=4) or q5_K (bits=5) bytes ``[B, 144 | 176]``."""
    B = x.shape[0]
    d, dmin, sc, m, q = _min_max_quants(x.reshape(B, 8, 32), (1 << bits) - 1, 63)
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
    qh = _pack_crumbs(q.reshape(B, 256) >> 4)  # weight 128i + 32t + l: bits 2t of qh[32i + l]
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(B, 2)], axis=-1)


def _quantize_q2_k(x: np.ndarray) -> np.ndarray:
    """Blocks ``[B, 256]`` fp32 -> q2_K bytes ``[B, 84]`` (4-bit sub-block scales and mins)."""
    B = x.shape[0]
    d, dmin, sc, m, q = _min_max_quants(x.reshape(B, 16, 16), 3, 15)
    return np.concatenate(
        [
            sc | (m << 4),
            _pack_crumbs(q),
            d.view(np.uint8).reshape(B, 2),
            dmin.view(np.uint8).reshape(B, 2),
        ],
        axis=-1,
    )


def _quantize_q3_k(x: np.ndarray) -> np.ndarray:
    """Blocks ``[B, 256]`` fp32 -> q3_K bytes ``[B, 110]``.

    Per sub-block of 16 the scale maps the value of largest magnitude to -4 (ggml's
    ``make_q3_quants`` sign trick: q runs over [-4, 3]); the signed sub-block scales
    become 6-bit ``sc - 32`` against ``d``, the largest in magnitude -32 (as llama.cpp).
    """
    B = x.shape[0]
    xs = x.reshape(B, 16, 16)
    scale = -_signed_absmax(xs) / 4  # signed
    big = _signed_absmax(scale)
    d = _to_f16(-big / 32, "d")
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), -32, 31)
    s = d.astype(np.float32)[:, None] * sc.astype(np.int16)
    q = np.clip(np.rint(_div(xs, s[..., None])), -4, 3).astype(np.int16) + 4  # 0..7
    qb = q.reshape(B, 256)
    hbits = (qb >> 2).astype(np.uint8).reshape(B, 2, 4, 32)  # [i][t][l] -> bit 4i + t of hmask[l]
    shifts = np.arange(8, dtype=np.uint8).reshape(2, 4, 1)
    hmask = (hbits << shifts).reshape(B, 8, 32).sum(axis=1, dtype=np.uint8)
    return np.concatenate(
        [
            hmask,
            _pack_crumbs(qb & 3),
            _pack_scales_q3_k((sc + 32).astype(np.uint8)),
            d.view(np.uint8).reshape(B, 2),
        ],
        axis=-1,
    )


_IQ4 = np.array(IQ4NL_VALUES, dtype=np.float32)
_IQ4_MID = (_IQ4[1:] + _IQ4[:-1]) / 2


def _iq4_index(y: np.ndarray) -> np.ndarray:
    """The IQ4_NL code of the grid value nearest to each ``y`` (uint8)."""
    return np.searchsorted(_IQ4_MID, y).astype(np.uint8)


def _iq4_scales(xs: np.ndarray, ntry: int = 7) -> np.ndarray:
    """Sub-blocks ``[B, L]`` fp32 -> the fp32 scale ``d [B]`` (signed) of the IQ4_NL grid.

    As ggml's ``quantize_row_iq4_nl_impl`` without an importance matrix: weights
    ``x^2``; candidate inverse scales ``(t - 127) / max`` (``t`` in ``[-ntry, ntry]``,
    ``max`` the value of largest magnitude) and ``127 / max``; per candidate the nearest
    grid codes and the least-squares scale ``sum(w q x) / sum(w q q)``, keeping the one
    of least weighted error.
    """
    w = xs * xs
    mx = _signed_absmax(xs)[:, None]  # [B, 1]
    safe = np.where(mx != 0, mx, 1)
    ids = [127 / safe] + [(t - 127) / safe for t in range(-ntry, ntry + 1)]
    best_d = np.zeros(xs.shape[0], dtype=np.float32)
    best = np.full(xs.shape[0], -np.inf, dtype=np.float32)
    for inv in ids:
        q = _IQ4[_iq4_index(inv * xs)]
        sumqx = (w * q * xs).sum(-1)
        sumq2 = (w * q * q).sum(-1)
        score = np.where(sumq2 > 0, sumqx * _div(sumqx, sumq2), -np.inf)
        take = score > best
        best = np.where(take, score, best)
        best_d = np.where(take, _div(sumqx, sumq2), best_d)
    return np.where(mx[:, 0] != 0, best_d, 0).astype(np.float32)


def _quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """Blocks ``[B, 32]`` fp32 -> IQ4_NL bytes ``[B, 18]``."""
    B = x.shape[0]
    d = _to_f16(_iq4_scales(x), "d")
    q = _iq4_index(x * _div(np.ones_like(d, dtype=np.float32), d.astype(np.float32))[:, None])
    qs = q[:, 0:16] | (q[:, 16:32] << 4)
    return np.concatenate([d.view(np.uint8).reshape(B, 2), qs], axis=-1)


def _quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """Blocks ``[B, 256]`` fp32 -> IQ4_XS bytes ``[B, 136]``.

    The sub-block scales of :func:`_iq4_scales`, then as ggml's ``quantize_row_iq4_nl_impl``
    for super-blocks: ``d = -max_scale / 32`` (the scale of largest magnitude at -32),
    ``ls = clamp(round(scale / d), -32, 31) + 32``, codes against ``d * (ls - 32)``.
    """
    B = x.shape[0]
    xs = x.reshape(B, 8, 32)
    scale = _iq4_scales(xs.reshape(B * 8, 32)).reshape(B, 8)
    d = _to_f16(-_signed_absmax(scale) / 32, "d")
    sc = np.clip(np.rint(_div(scale, d.astype(np.float32)[:, None])), -32, 31)
    s = d.astype(np.float32)[:, None] * sc.astype(np.float32)
    q = _iq4_index(xs * _div(np.ones_like(s), s)[..., None])  # [B, 8, 32]
    qs = (q[..., 0:16] | (q[..., 16:32] << 4)).reshape(B, 128)
    hl = _pack_scales_iq4_xs((sc + 32).astype(np.uint8))
    return np.concatenate([d.view(np.uint8).reshape(B, 2), hl, qs], axis=-1)


def _quantize_nvfp4(x: np.ndarray) -> np.ndarray:
    """NVFP4 blocks of ``x [B, 64]``: per 16 weights the UE4M3 scale ``amax / 6`` and E2M1
    elements, as :func:`kt_ops.formats.nvfp4.quantize_nvfp4` with a per-tensor scale of 1
    (ggml's reference rounds its scale half up instead: both write valid blocks)."""
    d, codes = nvfp4_block_codes(torch.from_numpy(x.reshape(-1, 4, 16)))
    codes = codes.numpy()
    out = np.empty((codes.shape[0], 36), dtype=np.uint8)
    out[:, 0:4] = d.view(torch.uint8).numpy()
    out[:, 4:36] = (codes[..., :8] | (codes[..., 8:] << 4)).reshape(-1, 32)
    return out


def quantize_gguf_raw(weight: np.ndarray, qtype: Union[str, Any]) -> np.ndarray:
    """Quantize fp32 ``[..., K]`` to raw GGUF blocks ``[..., K / block * type_size]`` (uint8).

    ``mxfp4``, ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0`` and ``q5_1`` use ``gguf.quants.quantize``
    (bit-exact with llama.cpp's reference quantizers). The ``gguf`` package cannot quantize
    NVFP4 or the k-quants: ``nvfp4`` takes a UE4M3 scale ``amax / 6`` per 16
    (:func:`_quantize_nvfp4`), and ``q2_k`` ... ``q6_k`` use a simple round-to-nearest
    quantizer here: per sub-block min/max (min clipped to <= 0; q2_k, q4_k,
    q5_k) or the value of largest magnitude (q3_k, q6_k), 4-bit (q2_K), 6-bit
    (q3_K, q4_K, q5_K) or int8 (q6_K) sub-block scales against an fp16
    super-block ``d``. ``iq4_nl`` / ``iq4_xs`` search the sub-block scale as
    llama.cpp does without an importance matrix (:func:`_iq4_scales`).
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
    blocks = x.reshape(-1, bs)
    if name in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"):
        import gguf  # noqa: PLC0415  (optional dependency)

        qt = getattr(gguf.GGMLQuantizationType, name.upper())
        return gguf.quants.quantize(x, qt)
    if spec.is_grid:
        out = quantize_grid(blocks, name)
    elif name == "nvfp4":
        out = _quantize_nvfp4(blocks)
    elif name == "iq4_nl":
        out = _quantize_iq4_nl(blocks)
    elif name == "iq4_xs":
        out = _quantize_iq4_xs(blocks)
    elif name == "q2_k":
        out = _quantize_q2_k(blocks)
    elif name == "q3_k":
        out = _quantize_q3_k(blocks)
    elif spec.record_mins:
        out = _quantize_q45_k(blocks, spec.bits)
    else:
        out = _quantize_q6_k(blocks)
    return out.reshape(*x.shape[:-1], x.shape[-1] // bs * ts)
