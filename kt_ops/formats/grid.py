"""The grid formats: GGUF's i-quants on lattice grids, held as the file's own blocks.

``iq1_s``, ``iq1_m``, ``iq2_xxs``, ``iq2_xs``, ``iq2_s``, ``iq3_xxs`` and ``iq3_s`` are
llama.cpp's ``IQ1_S``, ``IQ1_M``, ``IQ2_XXS``, ``IQ2_XS``, ``IQ2_S``, ``IQ3_XXS`` and
``IQ3_S`` (ggml-common.h ``block_<type>``, 256 weights per block; the dequantization
of ggml-quants.c, which ``gguf.quants`` mirrors). A packed projection is ``uint8 [E,
NB, 16 * K/256 * type_size]``: each 16-row block holds its rows' GGUF bytes back to
back, rows past ``n`` zero (``d = 0``). The kernels decode one block at a time to an
int8 panel (csrc/formats/grid.h, exact; one fp32 scale per 32 weights, per 16 for
IQ1_M / IQ2_XS / IQ2_S) and multiply it on the signed 8-bit kernels, so the memory is
the file's: 1.5625, 1.75, 2.0625, 2.3125, 2.5625, 3.0625 and 3.4375 bits a weight.

:func:`pack_grid` repacks GGUF rows (what :func:`kt_ops.formats.from_gguf` calls);
:func:`quantize_grid` is a simple quantizer writing valid blocks, for tests and
small models: per sub-block (32 weights; 16 for the types with scales per 16) every
sub-scale tried, per 8 (IQ3: 4) weights a grid entry near the scaled weights, no
importance matrix and none of llama.cpp's search, so its error is larger than
``llama-quantize``'s. Convert a GGUF file for production weights.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kt_ops.formats.packed import PackedProjection
from kt_ops.formats.spec import BLOCK_ROWS, FORMATS, ceil_div, format_spec

__all__ = ["GRID_FORMATS", "pack_grid", "quantize_grid"]

#: The grid formats, in table order.
GRID_FORMATS = tuple(f for f in FORMATS if format_spec(f).is_grid)


def pack_grid(name: str, blocks: np.ndarray, n: int, k: int) -> PackedProjection:
    """GGUF rows ``uint8 [E, n, row_bytes]`` of format ``name`` -> a validated
    :class:`PackedProjection` (rows padded with zero bytes to a multiple of 16).

    Raises:
        ValueError: a block's fp16 ``d`` is not finite (a corrupt file).
    """
    spec = format_spec(name)
    E, rows, row_bytes = blocks.shape
    if not np.isfinite(_stored_d(blocks.reshape(E, rows, -1, spec.gguf_block[1]), name)).all():
        raise ValueError(f"from_gguf: raw has a non-finite fp16 d in a {name} block")
    nb = ceil_div(n, BLOCK_ROWS)
    weight = torch.zeros(E, nb * BLOCK_ROWS, row_bytes, dtype=torch.uint8)
    weight[:, :n] = torch.from_numpy(np.ascontiguousarray(blocks))
    p = PackedProjection(
        weight=weight.view(E, nb, BLOCK_ROWS * row_bytes),
        scales=None,
        zeros=None,
        weight_format=name,
        group_size=spec.default_group_size,
        n=n,
        k=k,
    )
    return p.validate()


def _stored_d(blocks: np.ndarray, name: str) -> np.ndarray:
    """The fp16 ``d`` of GGUF blocks ``uint8 [..., type_size]`` -> ``float16 [...]``: the
    first two bytes, or IQ1_M's: the top nibbles of its four scale words (bytes 48-55)."""
    if name != "iq1_m":
        return np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    words = np.ascontiguousarray(blocks[..., 48:56]).view("<u2").astype(np.uint16)
    bits = sum((words[..., i] >> 12) << (4 * i) for i in range(4)).astype(np.uint16)
    return bits.view(np.float16)


@functools.cache
def _grid(name: str) -> torch.Tensor:
    """The values of ``name``'s grid ``[entries, 8 or 4]`` (fp32), from the gguf package."""
    from gguf import quants  # noqa: PLC0415  (optional dependency)

    cls = getattr(quants, name.upper())
    cls.init_grid()
    return torch.from_numpy(np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape))


@functools.cache
def _lattice(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid's levels ``[L]`` (its distinct values) and, for every point of the full
    lattice ``levels^m`` (index: base-L digits, element 0 least significant), the grid
    entry nearest to it ``[L^m]`` (int64)."""
    grid = _grid(name)
    levels = torch.unique(grid)
    m = grid.shape[1]
    digits = torch.arange(len(levels) ** m).unsqueeze(-1) // len(levels) ** torch.arange(m)
    points = levels[digits % len(levels)]  # [L^m, m]
    nearest = torch.cdist(points, grid).argmin(-1)
    return levels, nearest


def _nearest(t: torch.Tensor, name: str) -> torch.Tensor:
    """A grid entry near each row of ``t`` ``[..., m]``: every value rounded to the grid's
    nearest level, then that lattice point's nearest grid entry (``_lattice``). Not always
    the grid entry nearest ``t`` itself, but linear in the size of ``t`` (a search of the
    whole grid per row was 20 s per million IQ1_S weights)."""
    levels, nearest = _lattice(name)
    mid = (levels[1:] + levels[:-1]) / 2
    digit = torch.bucketize(t.contiguous(), mid)  # [..., m]: the nearest level's index
    index = (digit * len(levels) ** torch.arange(t.shape[-1])).sum(-1)
    return nearest[index]


def _even_signs(x: torch.Tensor) -> torch.Tensor:
    """Minus-sign masks ``[..., 8]`` (bool) of ``x [..., 8]`` with an even count: where it
    is odd, the weight of least magnitude flips (IQ2_XXS / IQ3_XXS store 7 sign bits and
    their parity)."""
    neg = x < 0
    odd = neg.sum(-1, keepdim=True) % 2 == 1
    least = torch.nn.functional.one_hot(x.abs().argmin(-1), 8).bool()
    return neg ^ (least & odd)


def _sign_bits(neg: torch.Tensor) -> torch.Tensor:
    """Bit ``j`` set where ``neg[..., j]`` (``[..., 8]`` -> int64 ``[...]``)."""
    return (neg.long() << torch.arange(8)).sum(-1)


def _f16(d: torch.Tensor) -> torch.Tensor:
    h = d.to(torch.float16)
    if not bool(torch.isfinite(h).all()):
        raise ValueError("quantize_weights: weight is too large for the fp16 d of the format")
    return h


def _le(v: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Little-endian bytes of the non-negative int64 values ``v [...]`` -> ``[..., nbytes]``."""
    return ((v.unsqueeze(-1) >> (8 * torch.arange(nbytes))) & 255).to(torch.uint8)


def _block_d(x: torch.Tensor, vmax: float, steps: int, mul: float) -> torch.Tensor:
    """The fp16 ``d`` of each block of ``x [B, 8, 32]``: the largest scale a group can take,
    ``d * (2 (steps - 1) + 1) * mul``, puts the block's largest magnitude on ``vmax``."""
    return _f16(x.abs().amax((-2, -1)) / (vmax * (2 * steps - 1) * mul))


def _search(d: torch.Tensor, steps: int, mul: float, fit) -> tuple:
    """Per sub-block (``G`` of them: 32 weights, or 16), the sub-scale ``ls < steps`` whose
    grid codes fit best: ``fit(scale [B, 1, 1]) -> (codes, squared error [B, G])`` for each
    ``scale = d * (2 ls + 1) * mul``; returns ``(ls [B, G], codes)`` of the least error (all
    candidates tried)."""
    df = d.float().view(-1, 1, 1)
    best = None
    for ls in range(steps):
        scale = torch.where(df > 0, df * (2 * ls + 1) * mul, 1.0)
        codes, err = fit(scale)
        if best is None:
            best = [torch.zeros_like(err, dtype=torch.int64), codes, err]
            continue
        take = err < best[2]
        best[0] = torch.where(take, ls, best[0])
        best[1] = torch.where(take.view(*take.shape, *[1] * (codes.dim() - 2)), codes, best[1])
        best[2] = torch.minimum(err, best[2])
    return best[0], best[1]


def _fit_magnitudes(mag: torch.Tensor, d: torch.Tensor, name: str, mul: float) -> tuple:
    """Per sub-block of ``mag [B, G, L]`` (the magnitudes the positive grid codes), its
    4-bit sub-scale and grid indices of least squared error (``_search``): ``(ls [B, G],
    idx [B, G, L / values per entry])``."""
    grid = _grid(name)
    B, G, L = mag.shape
    per = grid.shape[1]

    def fit(scale):
        idx = _nearest((mag / scale).reshape(B, G, L // per, per), name)
        return idx, ((grid[idx].reshape(B, G, L) * scale - mag) ** 2).sum(-1)

    return _search(d, 16, mul, fit)


def _even_sign_magnitudes(g: torch.Tensor) -> tuple:
    """``(neg, mag)`` of ``g [..., 8]``: minus-sign masks with an even count per 8
    (``_even_signs``) and the magnitudes the grid codes, ``|w|``, or ``-|w|`` where the
    parity flipped a sign (IQ2_XXS, IQ2_XS, IQ3_XXS)."""
    neg = _even_signs(g)
    return neg, torch.where(neg == (g < 0), 1.0, -1.0) * g.abs()


def _quantize_xxs(x: torch.Tensor, name: str) -> torch.Tensor:
    """IQ2_XXS (66 bytes) / IQ3_XXS (98 bytes) blocks of ``x [B, 256]``."""
    B = x.shape[0]
    iq2 = name == "iq2_xxs"
    grid = _grid(name)
    mul = 0.125 if iq2 else 0.25
    g = x.view(B, 8, 32)
    d = _block_d(g, float(grid.max()), 16, mul)
    neg, mag = _even_sign_magnitudes(g.view(B, 8, 4, 8))  # [B, 8, 4, 8]
    ls, idx = _fit_magnitudes(mag.reshape(B, 8, 32), d, name, mul)
    sign_word = (_sign_bits(neg) & 127) << (7 * torch.arange(4))  # [B, 8, 4]
    aux = sign_word.sum(-1) | (ls << 28)  # [B, 8]
    if iq2:  # [B, 8, 4]: one 8-value entry per 8 weights
        a0 = (idx << (8 * torch.arange(4))).sum(-1)
        body = torch.cat([_le(a0, 4), _le(aux, 4)], -1).reshape(B, 64)
    else:  # [B, 8, 8]: 4-value entries
        body = torch.cat([idx.to(torch.uint8).reshape(B, 64), _le(aux, 4).reshape(B, 32)], -1)
    return torch.cat([d.view(torch.uint8).view(B, 2), body], -1)


def _quantize_iq3_s(x: torch.Tensor) -> torch.Tensor:
    """IQ3_S blocks (110 bytes) of ``x [B, 256]``: free sign bits, 9-bit grid indices."""
    B = x.shape[0]
    grid = _grid("iq3_s")
    g = x.view(B, 8, 32)
    d = _block_d(g, float(grid.max()), 16, 1.0)
    ls, idx = _fit_magnitudes(g.abs(), d, "iq3_s", 1.0)
    idx = idx.reshape(B, 64)
    qh = ((idx >> 8).view(B, 8, 8) << torch.arange(8)).sum(-1)  # bit i%8 of byte i/8
    signs = _sign_bits((x < 0).view(B, 32, 8))
    sc = ls[:, 0::2] | (ls[:, 1::2] << 4)  # [B, 4]: low nibble the even group
    parts = [d.view(torch.uint8).view(B, 2), (idx & 255), qh, signs, sc]
    return torch.cat([p.to(torch.uint8) for p in parts], -1)


def _quantize_iq1_s(x: torch.Tensor) -> torch.Tensor:
    """IQ1_S blocks (50 bytes) of ``x [B, 256]``: per 32 weights a 3-bit scale and the
    delta's sign, per 8 an 11-bit index."""
    B = x.shape[0]
    grid = _grid("iq1_s")  # values -1, 0, 1
    g = x.view(B, 8, 32)
    d = _block_d(g, 1.125, 8, 1.0)

    def fit(scale):  # codes: the indices, then the delta's sign (1: -1/8) as a 5th column
        fits = []
        for minus in (0, 1):
            t = g / scale - (0.125 if minus == 0 else -0.125)
            idx = _nearest(t.view(B, 8, 4, 8), "iq1_s")  # [B, 8, 4]
            err = ((grid[idx].view(B, 8, 32) - t) ** 2).sum(-1) * scale[..., 0] ** 2
            fits.append((torch.cat([idx, torch.full_like(idx[..., :1], minus)], -1), err))
        (plus, e_plus), (minus, e_minus) = fits
        take = e_minus < e_plus
        return torch.where(take.unsqueeze(-1), minus, plus), torch.minimum(e_plus, e_minus)

    ls, codes = _search(d, 8, 1.0, fit)
    idx, minus = codes[..., :4], codes[..., 4]
    qh = ((idx >> 8) << (3 * torch.arange(4))).sum(-1) | (ls << 12) | (minus << 15)
    parts = [d.view(torch.uint8).view(B, 2), (idx & 255).reshape(B, 32).to(torch.uint8)]
    return torch.cat(parts + [_le(qh, 2).reshape(B, 16)], -1)


def _quantize_iq2_xs(x: torch.Tensor) -> torch.Tensor:
    """IQ2_XS blocks (74 bytes) of ``x [B, 256]``: per 16 weights a 4-bit sub-scale, per 8
    a 9-bit index of IQ2_XS' grid and 7 sign bits (the 8th their parity, as IQ2_XXS)."""
    B = x.shape[0]
    grid = _grid("iq2_xs")
    g = x.view(B, 16, 2, 8)  # sub-blocks of 16, pieces of 8
    d = _block_d(x.view(B, 16, 16), float(grid.max()), 16, 0.125)
    neg, mag = _even_sign_magnitudes(g)
    ls, idx = _fit_magnitudes(mag.reshape(B, 16, 16), d, "iq2_xs", 0.125)  # [B, 16], [B, 16, 2]
    qs = idx | ((_sign_bits(neg) & 127) << 9)  # piece l of 32 weights ib at 4 ib + l
    sc = ls[:, 0::2] | (ls[:, 1::2] << 4)  # [B, 8]: low nibble the first 16 weights
    parts = [d.view(torch.uint8).view(B, 2), _le(qs, 2).reshape(B, 64), sc.to(torch.uint8)]
    return torch.cat(parts, -1)


def _quantize_iq2_s(x: torch.Tensor) -> torch.Tensor:
    """IQ2_S blocks (82 bytes) of ``x [B, 256]``: per 16 weights a 4-bit sub-scale, per 8
    a 10-bit index of IQ2_S' grid and 8 free sign bits."""
    B = x.shape[0]
    grid = _grid("iq2_s")
    g = x.view(B, 16, 16)
    d = _block_d(g, float(grid.max()), 16, 0.125)
    ls, idx = _fit_magnitudes(g.abs(), d, "iq2_s", 0.125)
    idx = idx.reshape(B, 32)
    qh = ((idx >> 8).view(B, 8, 4) << (2 * torch.arange(4))).sum(-1)  # bits 2l of byte ib
    signs = _sign_bits((x < 0).view(B, 32, 8))
    sc = ls[:, 0::2] | (ls[:, 1::2] << 4)
    parts = [d.view(torch.uint8).view(B, 2), idx & 255, signs, qh, sc]
    return torch.cat([p.to(torch.uint8) for p in parts], -1)


def _quantize_iq1_m(x: torch.Tensor) -> torch.Tensor:
    """IQ1_M blocks (56 bytes) of ``x [B, 256]``: per 16 weights a 3-bit sub-scale, per 8
    an 11-bit index of IQ1_S' grid and the delta's sign; the fp16 ``d`` in the top
    nibbles of the four scale words."""
    B = x.shape[0]
    grid = _grid("iq1_s")  # IQ1_M's grid is IQ1_S'
    g = x.view(B, 16, 16)
    d = _block_d(g, 1.125, 8, 1.0)

    def fit(scale):  # codes [B, 16, 4]: two indices, then their deltas' signs (1: -1/8)
        idx, err = [], []
        for delta in (0.125, -0.125):
            t = (g / scale - delta).view(B, 16, 2, 8)
            i = _nearest(t, "iq1_s")
            idx.append(i)
            err.append(((grid[i] - t) ** 2).sum(-1))  # [B, 16, 2]
        minus = err[1] < err[0]
        best = torch.where(minus, idx[1], idx[0])
        e = torch.minimum(err[0], err[1]).sum(-1) * scale[..., 0] ** 2
        return torch.cat([best, minus.long()], -1), e

    ls, codes = _search(d, 8, 1.0, fit)
    idx, minus = codes[..., :2].reshape(B, 32), codes[..., 2:].reshape(B, 32)
    nib = (idx >> 8) | (minus << 3)  # per 8 weights: 3 index bits, the delta's sign
    qh = nib[:, 0::2] | (nib[:, 1::2] << 4)  # [B, 16]
    d_bits = d.view(torch.int16).long() & 0xFFFF
    four = torch.arange(4)
    words = (ls.view(B, 4, 4) << (3 * four)).sum(-1) | (
        ((d_bits[:, None] >> (4 * four)) & 15) << 12
    )
    parts = [(idx & 255).to(torch.uint8), qh.to(torch.uint8), _le(words, 2).reshape(B, 8)]
    return torch.cat(parts, -1)


def quantize_grid(blocks: np.ndarray, name: str) -> np.ndarray:
    """Blocks of 256 fp32 weights ``[B, 256]`` -> GGUF ``name`` blocks ``uint8 [B, size]``.

    The block's fp16 ``d`` puts its largest magnitude on the grid's largest value
    (IQ1_S / M: 1.125) at the largest sub-scale; per sub-block (32 weights; IQ1_M, IQ2_XS,
    IQ2_S: 16) every sub-scale is tried, each with a grid entry near the scaled weights per
    8 (IQ3_XXS, IQ3_S: 4; ``_nearest``), and the sub-scale of least squared error kept.
    IQ2_XXS / IQ2_XS / IQ3_XXS keep an even count of minus signs per 8 (the weight of least
    magnitude flips where needed). 0.3-0.5 s per million weights. Valid blocks for
    ``gguf.quants.dequantize``; no importance matrix.

    Raises:
        ValueError: weights whose fp16 ``d`` would overflow.
    """
    x = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.float32))
    if name in ("iq2_xxs", "iq3_xxs"):
        out = _quantize_xxs(x, name)
    elif name == "iq3_s":
        out = _quantize_iq3_s(x)
    elif name == "iq2_xs":
        out = _quantize_iq2_xs(x)
    elif name == "iq2_s":
        out = _quantize_iq2_s(x)
    elif name == "iq1_m":
        out = _quantize_iq1_m(x)
    else:
        out = _quantize_iq1_s(x)
    return out.numpy()
