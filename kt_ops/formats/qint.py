"""qint code planes: pack integer codes ``[E, N, K]`` into 16-row blocks and back.

The layout is docs/formats.md, "Byte layout of one 16-row block". One block
``weight[e, nb, :]`` is the low plane followed (3, 5 and 6 bit) by the high plane:

* 8 bit: ``Kp/4`` words ``[16 rows][4 bytes]``; byte ``j`` of row ``r`` in
  word ``c`` is ``q[n, 4c + j]``.
* 4/5/6 bit low plane: ``Kp/8`` words ``[16][4]``; the low nibble of byte ``j``
  of row ``r`` in word ``c`` is ``q[n, 8c + j] & 15``, the high nibble
  ``q[n, 8c + 4 + j] & 15``.
* 2/3 bit low plane: ``Kp/16`` words ``[16][4]``; bits ``2h, 2h+1`` of byte ``j``
  of row ``r`` in word ``c`` are ``q[n, 16c + 4h + j] & 3``.
* 3 bit high plane: ``Kp/32`` words; bit ``h`` of byte ``j`` of row ``r`` in
  word ``w`` is bit 2 of ``q[n, 32w + 4h + j]`` (the 5-bit plane's layout).
* 5 bit high plane: ``Kp/32`` words; bit ``h`` of byte ``j`` of row ``r`` in
  word ``w`` is bit 4 of ``q[n, 32w + 4h + j]``.
* 6 bit high plane: ``Kp/16`` words; bits ``2h, 2h+1`` of byte ``j`` are bits
  4, 5 of ``q[n, 16w + 4h + j]``.

These packers work with ``reshape``/``permute``; the reference dequantizer
(``kt_ops.formats.dequant``) decodes with explicit byte/bit index arithmetic
instead, so the two check each other.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kt_ops._checks import as_int
from kt_ops.formats.spec import BLOCK_ROWS, FORMATS, ceil_div, format_spec, padded_k

__all__ = [
    "pack_codes",
    "unpack_codes",
    "repack_codes",
    "repack_four_bit_plane",
    "FOUR_BIT_PLANE_BEFORE_V3",
    "pack_group_params",
    "unpack_group_params",
    "pack_kquant_scales",
    "unpack_kquant_scales",
    "kquant_scale_values",
]

_BITS = (2, 3, 4, 5, 6, 8)


def _check_bits(bits: int) -> None:
    if bits not in _BITS:
        raise ValueError(f"bits={bits!r} is not a qint code width; expected one of {_BITS}")


def pack_codes(q: Tensor, bits: int, pad_code: int = 0) -> Tensor:
    """Pack integer codes ``q [E, N, K]`` into the qint block layout.

    Args:
        q: integer tensor ``[E, N, K]``: codes in ``[0, 2^bits)``, or for
            ``bits=8`` also signed codes in ``[-128, 127]`` (stored as their
            two's-complement byte).
        bits: 2, 3, 4, 5, 6 or 8.
        pad_code: the code written for the padding (rows ``N..16*NB`` and
            columns ``K..Kp``); pass the code of weight 0 (e.g. 8 for symmetric
            4 bit) so that the padding holds zero weights.

    Returns:
        uint8 ``[E, NB, 16 * Kp * bits / 8]`` (``NB = ceil(N/16)``, ``Kp = ceil(K/32)*32``).

    Raises:
        ValueError: ``q`` is not a 3-D integer tensor, a code is out of range
            for ``bits``, or ``bits`` is not 2, 3, 4, 5, 6 or 8.
    """
    _check_bits(bits)
    if not isinstance(q, Tensor) or q.dim() != 3 or q.is_floating_point() or q.is_complex():
        raise ValueError("pack_codes: q must be a 3-D integer tensor [E, N, K]")
    lo, hi = (-128, 255) if bits == 8 else (0, (1 << bits) - 1)
    if q.numel() and (int(q.min()) < lo or int(q.max()) > hi):
        raise ValueError(f"pack_codes: q has codes outside [{lo}, {hi}] for bits={bits}")
    E, N, K = q.shape
    nb, kp = ceil_div(N, BLOCK_ROWS), padded_k(K)
    if q.dtype == torch.uint8:
        qu = q
    elif q.dtype == torch.int8:
        qu = q.view(torch.uint8)  # two's complement
    else:
        qu = (q.to(torch.int64) & 0xFF).to(torch.uint8)
    full = torch.full((E, nb * BLOCK_ROWS, kp), pad_code & 0xFF, dtype=torch.uint8)
    full[:, :N, :K] = qu.cpu()
    full = full.view(E, nb, BLOCK_ROWS, kp)
    if bits == 8:
        # [E, NB, 16, Kp/4, 4] -> words [E, NB, Kp/4, 16, 4]
        out = full.view(E, nb, BLOCK_ROWS, kp // 4, 4).permute(0, 1, 3, 2, 4)
        return out.reshape(E, nb, -1).contiguous()
    if bits <= 3:
        # low plane: [E, NB, 16, Kp/16, 4 (h), 4 (j)]: bits 2h, 2h+1 of byte j = q[16c + 4h + j] & 3
        low = (full & 3).view(E, nb, BLOCK_ROWS, kp // 16, 4, 4)
        low = (low << (2 * torch.arange(4, dtype=torch.uint8).view(4, 1))).sum(
            dim=-2, dtype=torch.uint8
        )
    else:
        # low plane: [E, NB, 16, Kp/8, 2 (nibble), 4 (j)]
        low = (full & 15).view(E, nb, BLOCK_ROWS, kp // 8, 2, 4)
        low = low[..., 0, :] | (low[..., 1, :] << 4)
    planes = [low.permute(0, 1, 3, 2, 4).reshape(E, nb, -1)]
    if bits in (3, 5):
        # [E, NB, 16, Kp/32, 8 (h), 4 (j)]: bit h of byte j = bit 2 (3 bit) or 4 (5 bit) of
        # q[32w + 4h + j]
        hb = ((full >> (bits - 1)) & 1).view(E, nb, BLOCK_ROWS, kp // 32, 8, 4)
        shift = torch.arange(8, dtype=torch.uint8).view(8, 1)
        high = (hb << shift).sum(dim=-2, dtype=torch.uint8)  # disjoint bits: sum == or
        planes.append(high.permute(0, 1, 3, 2, 4).reshape(E, nb, -1))
    elif bits == 6:
        # [E, NB, 16, Kp/16, 4 (h), 4 (j)]: bits 2h, 2h+1 of byte j = bits 4, 5 of q[16w + 4h + j]
        hb = ((full >> 4) & 3).view(E, nb, BLOCK_ROWS, kp // 16, 4, 4)
        shift = 2 * torch.arange(4, dtype=torch.uint8).view(4, 1)
        high = (hb << shift).sum(dim=-2, dtype=torch.uint8)
        planes.append(high.permute(0, 1, 3, 2, 4).reshape(E, nb, -1))
    return torch.cat(planes, dim=-1).contiguous()


def unpack_codes(weight: Tensor, bits: int, n: int, k: int, signed: bool = False) -> Tensor:
    """Inverse of :func:`pack_codes`: the codes ``[E, n, k]`` of a packed qint weight.

    Returns int32 codes: in ``[0, 2^bits)``, or for ``signed`` 8-bit codes in
    ``[-128, 127]``. Raises ValueError when ``weight`` is not uint8
    ``[E, ceil(n/16), 16*Kp*bits/8]``.
    """
    _check_bits(bits)
    nb, kp = ceil_div(n, BLOCK_ROWS), padded_k(k)
    expect = (nb, BLOCK_ROWS * kp * bits // 8)
    if weight.dtype != torch.uint8 or weight.dim() != 3 or tuple(weight.shape[1:]) != expect:
        raise ValueError(
            f"unpack_codes: weight has {weight.dtype} {list(weight.shape)}, expected uint8 "
            f"[E, {expect[0]}, {expect[1]}] for n={n}, k={k}, bits={bits}"
        )
    E = weight.shape[0]
    w = weight.to(torch.int32)
    if bits == 8:
        q = w.view(E, nb, kp // 4, BLOCK_ROWS, 4).permute(0, 1, 3, 2, 4).reshape(E, -1, kp)
        if signed:
            q = q - ((q & 0x80) << 1)
        return q[:, :n, :k].contiguous()
    if bits <= 3:
        low_bytes = 4 * kp
        low = w[..., :low_bytes].view(E, nb, kp // 16, BLOCK_ROWS, 1, 4).permute(0, 1, 3, 2, 4, 5)
        shift = 2 * torch.arange(4, dtype=torch.int32).view(4, 1)
        q = ((low >> shift) & 3).reshape(E, nb, BLOCK_ROWS, kp)
    else:
        low_bytes = 8 * kp
        low = w[..., :low_bytes].view(E, nb, kp // 8, BLOCK_ROWS, 4).permute(0, 1, 3, 2, 4)
        q = torch.stack([low & 15, low >> 4], dim=-2).reshape(E, nb, BLOCK_ROWS, kp)
    if bits in (3, 5):
        high = w[..., low_bytes:].view(E, nb, kp // 32, BLOCK_ROWS, 1, 4).permute(0, 1, 3, 2, 4, 5)
        shift = torch.arange(8, dtype=torch.int32).view(8, 1)
        q = q | (((high >> shift) & 1) << (bits - 1)).reshape(E, nb, BLOCK_ROWS, kp)
    elif bits == 6:
        high = w[..., low_bytes:].view(E, nb, kp // 16, BLOCK_ROWS, 1, 4).permute(0, 1, 3, 2, 4, 5)
        shift = 2 * torch.arange(4, dtype=torch.int32).view(4, 1)
        q = q | (((high >> shift) & 3) << 4).reshape(E, nb, BLOCK_ROWS, kp)
    return q.reshape(E, nb * BLOCK_ROWS, kp)[:, :n, :k].contiguous()


def repack_codes(
    weight: Tensor, from_bits: int, bits: int, n: int, k: int, pad_code: int = 0
) -> Tensor:
    """A packed qint weight of ``from_bits`` codes in the layout of ``bits`` codes (lossless).

    For weights written before q2_k / q3_k had their own 2- and 3-bit planes
    (kt_ops' ``manifest_version`` 2: their codes in the 4-bit plane).

    Raises:
        ValueError: ``weight`` is not a packed ``from_bits`` weight of ``n x k``
            (:func:`unpack_codes`), or holds a code wider than ``bits``.
    """
    codes = unpack_codes(weight, from_bits, n, k)
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"repack_codes: a code above {(1 << bits) - 1} for bits={bits}")
    return pack_codes(codes, bits, pad_code=pad_code)


#: Formats whose codes kt_ops before ``manifest_version`` 3 kept in the 4-bit plane.
FOUR_BIT_PLANE_BEFORE_V3 = ("q2_k", "q3_k")


def repack_four_bit_plane(weight: Tensor, weight_format: str, n: int, k: int) -> Tensor:
    """An old ``q2_k`` / ``q3_k`` weight (codes in the 4-bit plane) in today's planes.

    ``weight``: uint8 ``[E, ceil(n/16), 8 * Kp]``, as kt_ops before
    ``manifest_version`` 3 packed :data:`FOUR_BIT_PLANE_BEFORE_V3`; returns uint8
    ``[E, ceil(n/16), 16 * Kp * bits / 8]``, the same codes (lossless), the padding
    holding the code of weight 0. Raises ValueError as :func:`repack_codes`.
    """
    spec = format_spec(weight_format)
    return repack_codes(weight, 4, spec.bits, n, k, pad_code=int(spec.zero_offset))


def _check_rows(where: str, n: int, nb: int) -> None:
    """``n`` output rows must fill ``nb`` blocks of 16 (the last one partly)."""
    if as_int(n) is None or not BLOCK_ROWS * (nb - 1) < n <= BLOCK_ROWS * nb:
        raise ValueError(
            f"{where}: n={n!r} does not fit {nb} blocks of {BLOCK_ROWS} rows; expected an int in "
            f"({BLOCK_ROWS * (nb - 1)}, {BLOCK_ROWS * nb}]"
        )


def pack_group_params(p: Tensor, dtype: torch.dtype) -> Tensor:
    """Scales or zeros ``[E, N, G]`` -> ``[E, NB, G, 16]`` in ``dtype``; padding rows are 0.

    The last dimension is the row inside the 16-row block (docs/formats.md).
    """
    if p.dim() != 3:
        raise ValueError(f"pack_group_params: expected [E, N, G], got {list(p.shape)}")
    E, N, G = p.shape
    nb = ceil_div(N, BLOCK_ROWS)
    full = torch.zeros(E, nb * BLOCK_ROWS, G, dtype=dtype)
    full[:, :N] = p.to(dtype)
    return full.view(E, nb, BLOCK_ROWS, G).transpose(2, 3).contiguous()


def unpack_group_params(p: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_group_params`: ``[E, NB, G, 16]`` -> ``[E, n, G]`` (same dtype).

    Raises:
        ValueError: ``p`` is not ``[E, NB, G, 16]``, or ``n`` is not in ``(16 (NB - 1), 16 NB]``.
    """
    if p.dim() != 4 or p.shape[-1] != BLOCK_ROWS:
        raise ValueError(f"unpack_group_params: expected [E, NB, G, 16], got {list(p.shape)}")
    _check_rows("unpack_group_params", n, p.shape[1])
    E, nb, G, r = p.shape
    return p.transpose(2, 3).reshape(E, nb * r, G)[:, :n].contiguous()


# --------------------------------------------------------------------------- k-quant records

#: The GGUF k-quants and iq4_xs: the formats whose scales are super-block records.
_KQUANTS = tuple(f for f in FORMATS if format_spec(f).is_kquant)


def _kq(fmt: str) -> tuple[int, int, bool]:
    """Bytes of the scale fields of one GGUF block per row (``head``: 16 for q4_k/q5_k, 18
    for q6_k/q3_k, 20 for q2_k, 10 for iq4_xs), bytes of one record (16 rows of heads), and
    whether the head holds mins."""
    if fmt not in _KQUANTS:
        raise ValueError(f"{fmt!r} is not a GGUF k-quant; expected one of {_KQUANTS}")
    spec = format_spec(fmt)
    return spec.scale_record_bytes // BLOCK_ROWS, spec.scale_record_bytes, spec.record_mins


def pack_kquant_scales(head: Tensor, fmt: str) -> Tensor:
    """GGUF k-quant scale bytes per row and super-block -> the scale records (docs/formats.md).

    Args:
        head: uint8 ``[E, N, S]`` x the bytes of GGUF's scale fields of each
            block, in GGUF order: q4_K/q5_K ``d, dmin, scales[12]`` (16 bytes,
            the first 16 of ``block_q4_K``/``block_q5_K``); q6_K ``scales[16],
            d`` (18 bytes, the last 18 of ``block_q6_K``); q3_K the same 18 bytes
            as q6_K, its sub-block scales as int8 ``sc - 32`` (``from_gguf``
            unpacks GGUF's 12 bytes of 6-bit scales into them); q2_K ``scales[16],
            d, dmin`` (20 bytes: the first 16 of ``block_q2_K`` and its last 4);
            IQ4_XS int8 ``scales[8], d`` (10 bytes: its 6-bit ``ls - 32`` unpacked
            from ``scales_h`` / ``scales_l`` by ``from_gguf``, then its ``d``).
            ``S = K / 256``.
        fmt: ``'q2_k'``, ``'q3_k'``, ``'q4_k'``, ``'q5_k'``, ``'q6_k'`` or ``'iq4_xs'``.

    Returns:
        uint8 ``[E, NB, S, 256 | 288 | 320 | 160]``: per 16-row block and super-block,
        ``d`` fp16 ``[16]``, (q2_k/q4_k/q5_k) ``dmin`` fp16 ``[16]`` and the
        sub-block bytes ``[12 | 16 | 8][16 rows]`` (byte ``i`` of row ``r`` at
        ``16 i + r``): the same bytes, the block's 16 rows side by side.
        Padding rows are 0.
    """
    hb, rb, mins = _kq(fmt)
    if not isinstance(head, Tensor) or head.dtype != torch.uint8 or head.dim() != 4:
        raise ValueError(f"pack_kquant_scales: head must be uint8 [E, N, S, {hb}]")
    E, N, S, h = head.shape
    if h != hb:
        raise ValueError(f"pack_kquant_scales: head has {h} bytes per block, {fmt} has {hb}")
    nb = ceil_div(N, BLOCK_ROWS)
    full = torch.zeros(E, nb * BLOCK_ROWS, S, hb, dtype=torch.uint8)
    full[:, :N] = head.cpu()
    full = full.view(E, nb, BLOCK_ROWS, S, hb).permute(0, 1, 3, 2, 4)  # [E, NB, S, 16 rows, hb]
    if fmt == "q2_k":  # d, dmin [16][2], sc | m << 4 [16 j][16 r]
        parts = [full[..., 16:18], full[..., 18:20], full[..., 0:16].transpose(-1, -2)]
    elif mins:  # q4_k, q5_k: d, dmin [16][2], sc [12 j][16 r]
        parts = [full[..., 0:2], full[..., 2:4], full[..., 4:16].transpose(-1, -2)]
    else:  # q6_k, q3_k, iq4_xs: d [16][2], int8 sc [16 | 8 j][16 r]
        parts = [full[..., hb - 2 : hb], full[..., 0 : hb - 2].transpose(-1, -2)]
    out = torch.cat([p.reshape(E, nb, S, -1) for p in parts], dim=-1).contiguous()
    assert out.shape[-1] == rb
    return out


def unpack_kquant_scales(scales: Tensor, fmt: str, n: int) -> Tensor:
    """Inverse of :func:`pack_kquant_scales`: records ``[E, NB, S, R]`` -> heads ``[E, n, S, H]``.

    ``H``: 16 (q4_k, q5_k), 18 (q6_k, q3_k), 20 (q2_k) or 10 (iq4_xs) bytes, as
    :func:`pack_kquant_scales` takes them.
    """
    hb, rb, mins = _kq(fmt)
    if scales.dtype != torch.uint8 or scales.dim() != 4 or scales.shape[-1] != rb:
        raise ValueError(
            f"unpack_kquant_scales: scales has {scales.dtype} {list(scales.shape)}, expected "
            f"uint8 [E, NB, S, {rb}] for {fmt!r}"
        )
    E, nb, S, _ = scales.shape
    _check_rows("unpack_kquant_scales", n, nb)
    rows = scales.view(E, nb, S, -1)
    d = rows[..., 0:32].reshape(E, nb, S, BLOCK_ROWS, 2)
    if fmt == "q2_k":
        dmin = rows[..., 32:64].reshape(E, nb, S, BLOCK_ROWS, 2)
        sc = rows[..., 64:320].reshape(E, nb, S, 16, BLOCK_ROWS).transpose(-1, -2)
        head = torch.cat([sc, d, dmin], dim=-1)
    elif mins:  # q4_k, q5_k
        dmin = rows[..., 32:64].reshape(E, nb, S, BLOCK_ROWS, 2)
        sc = rows[..., 64:256].reshape(E, nb, S, 12, BLOCK_ROWS).transpose(-1, -2)
        head = torch.cat([d, dmin, sc], dim=-1)
    else:  # q6_k, q3_k, iq4_xs
        sc = rows[..., 32:rb].reshape(E, nb, S, hb - 2, BLOCK_ROWS).transpose(-1, -2)
        head = torch.cat([sc, d], dim=-1)
    head = head.permute(0, 1, 3, 2, 4).reshape(E, nb * BLOCK_ROWS, S, hb)
    return head[:, :n].contiguous()


def kquant_scale_values(scales: Tensor, fmt: str, n: int) -> tuple[Tensor, Optional[Tensor]]:
    """The fp32 scales ``d*sc`` and zeros ``dmin*m`` (None for q6_k, q3_k, iq4_xs) ``[E, n, G]``
    of records.

    ``G = K / 32`` (q4_k, q5_k, iq4_xs) or ``K / 16`` (q2_k, q3_k, q6_k); the products are
    exact.
    """
    head = unpack_kquant_scales(scales, fmt, n).to(torch.int32)
    E, _, S, hb = head.shape

    def f16(lo: Tensor, hi: Tensor) -> Tensor:
        return (lo | (hi << 8)).to(torch.int16).view(torch.float16).float()

    if fmt == "q2_k":  # scales[16] (sc | m << 4), d, dmin
        d, dmin = f16(head[..., 16], head[..., 17]), f16(head[..., 18], head[..., 19])
        b = head[..., 0:16]
        scale = (d.unsqueeze(-1) * (b & 15).float()).reshape(E, n, S * 16)
        return scale, (dmin.unsqueeze(-1) * (b >> 4).float()).reshape(E, n, S * 16)
    if not format_spec(fmt).record_mins:  # q6_k, q3_k, iq4_xs: int8 scales[16 | 8], d
        sc = head[..., 0 : hb - 2].to(torch.uint8).view(torch.int8).float()
        d = f16(head[..., hb - 2], head[..., hb - 1])
        return (d.unsqueeze(-1) * sc).reshape(E, n, S * (hb - 2)), None
    d, dmin = f16(head[..., 0], head[..., 1]), f16(head[..., 2], head[..., 3])
    q = head[..., 4:16]
    lo, mid, hi = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 15) | ((lo >> 6) << 4)], dim=-1).float()
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1).float()
    scale = (d.unsqueeze(-1) * sc).reshape(E, n, S * 8)
    zero = (dmin.unsqueeze(-1) * mn).reshape(E, n, S * 8)
    return scale, zero
