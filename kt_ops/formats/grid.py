"""The grid formats: GGUF's i-quants on lattice grids, held as the file's own blocks.

``iq1_s``, ``iq2_xxs``, ``iq3_xxs`` and ``iq3_s`` are llama.cpp's ``IQ1_S``,
``IQ2_XXS``, ``IQ3_XXS`` and ``IQ3_S`` (ggml-common.h ``block_<type>``, 256 weights
per block; the dequantization of ggml-quants.c, which ``gguf.quants`` mirrors). A
packed projection is ``uint8 [E, NB, 16 * K/256 * type_size]``: each 16-row block
holds its rows' GGUF bytes back to back, rows past ``n`` zero (``d = 0``). The
kernels decode one block at a time to an int8 panel (csrc/formats/grid.h, exact)
and multiply it on the signed 8-bit kernels, so the memory is the file's: 1.5625,
2.0625, 3.0625 and 3.4375 bits a weight.

:func:`pack_grid` repacks GGUF rows (what :func:`kt_ops.formats.from_gguf` calls);
:func:`quantize_grid` is a simple quantizer writing valid blocks, for tests and
small models: per 32 weights a scale from the largest magnitude, per 8 (IQ3: 4)
weights the nearest grid entry, no importance matrix and none of llama.cpp's
search, so its error is larger than ``llama-quantize``'s. Convert a GGUF file for
production weights.
"""

from __future__ import annotations

import numpy as np
import torch

from kt_ops.formats.packed import PackedProjection
from kt_ops.formats.spec import BLOCK_ROWS, ceil_div, format_spec

__all__ = ["GRID_FORMATS", "pack_grid", "quantize_grid"]

#: The grid formats, in table order.
GRID_FORMATS = ("iq1_s", "iq2_xxs", "iq3_xxs", "iq3_s")


def pack_grid(name: str, blocks: np.ndarray, n: int, k: int) -> PackedProjection:
    """GGUF rows ``uint8 [E, n, row_bytes]`` of format ``name`` -> a validated
    :class:`PackedProjection` (rows padded with zero bytes to a multiple of 16).

    Raises:
        ValueError: a block's fp16 ``d`` is not finite (a corrupt file).
    """
    spec = format_spec(name)
    E, rows, row_bytes = blocks.shape
    d = np.ascontiguousarray(blocks.reshape(E, rows, -1, spec.gguf_block[1])[..., 0:2])
    if not np.isfinite(d.view(np.float16)).all():
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


def _grid(name: str) -> torch.Tensor:
    """The values of ``name``'s grid ``[entries, 8 or 4]`` (fp32), from the gguf package."""
    from gguf import quants  # noqa: PLC0415  (optional dependency)

    cls = getattr(quants, name.upper())
    cls.init_grid()
    return torch.from_numpy(np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape))


def _nearest(t: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Index of the grid row nearest each row of ``t`` ``[..., m]`` (grid ``[G, m]``)."""
    flat = t.reshape(-1, grid.shape[1])
    # argmin |t - g|^2 = argmax (t . g - |g|^2 / 2), in chunks to bound the [rows, G] scores
    out = torch.empty(flat.shape[0], dtype=torch.int64)
    half = (grid * grid).sum(1) / 2
    step = max(1, (1 << 22) // grid.shape[0])
    for i in range(0, flat.shape[0], step):
        out[i : i + step] = (flat[i : i + step] @ grid.T - half).argmax(1)
    return out.reshape(t.shape[:-1])


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


def _scales(x: torch.Tensor, vmax: float, steps: int, mul: float) -> tuple:
    """The fp16 ``d`` per block and the 2 ls + 1 per group of 32 for ``x [B, 8, 32]`` whose
    codes reach ``vmax`` at most: scale = d * (2 ls + 1) * mul, ls < steps."""
    ideal = x.abs().amax(-1) / vmax  # [B, 8]: the scale of each group
    d = _f16(ideal.amax(-1) / ((2 * steps - 1) * mul))  # the largest group takes ls = steps - 1
    df = d.float().unsqueeze(-1)
    safe = torch.where(df > 0, df, 1.0)
    ls = torch.round((ideal / (safe * mul) - 1) / 2).clamp(0, steps - 1)
    scale = torch.where(df > 0, df * (2 * ls + 1) * mul, 1.0)
    return d, ls.long(), scale


def _quantize_xxs(x: torch.Tensor, name: str) -> torch.Tensor:
    """IQ2_XXS (66 bytes) / IQ3_XXS (98 bytes) blocks of ``x [B, 256]``."""
    B = x.shape[0]
    iq2 = name == "iq2_xxs"
    grid = _grid(name)
    g = x.view(B, 8, 32)
    d, ls, scale = _scales(g, float(grid.max()), 16, 0.125 if iq2 else 0.25)
    neg = _even_signs(g.view(B, 8, 4, 8))  # [B, 8, 4, 8]
    t = (g.view(B, 8, 4, 8).abs() * torch.where(neg == (g.view(B, 8, 4, 8) < 0), 1.0, -1.0)) / (
        scale.view(B, 8, 1, 1)
    )
    sign_word = (_sign_bits(neg) & 127) << (7 * torch.arange(4))  # [B, 8, 4]
    aux = sign_word.sum(-1) | (ls << 28)  # [B, 8]
    if iq2:
        idx = _nearest(t, grid)  # [B, 8, 4]: one 8-value entry per chunk
        a0 = (idx << (8 * torch.arange(4))).sum(-1)
        body = torch.cat([_le(a0, 4), _le(aux, 4)], -1).reshape(B, 64)
    else:
        idx = _nearest(t.reshape(B, 8, 8, 4), grid)  # [B, 8, 8]: 4-value entries
        body = torch.cat([idx.to(torch.uint8).reshape(B, 64), _le(aux, 4).reshape(B, 32)], -1)
    return torch.cat([d.view(torch.uint8).view(B, 2), body], -1)


def _quantize_iq3_s(x: torch.Tensor) -> torch.Tensor:
    """IQ3_S blocks (110 bytes) of ``x [B, 256]``: free sign bits, 9-bit grid indices."""
    B = x.shape[0]
    grid = _grid("iq3_s")
    g = x.view(B, 8, 32)
    d, ls, scale = _scales(g, float(grid.max()), 16, 1.0)
    idx = _nearest((g.abs() / scale.unsqueeze(-1)).view(B, 8, 8, 4), grid).view(B, 64)
    qh = ((idx >> 8).view(B, 8, 8) << torch.arange(8)).sum(-1)  # bit i%8 of byte i/8
    signs = _sign_bits((x < 0).view(B, 32, 8))
    sc = ls[:, 0::2] | (ls[:, 1::2] << 4)  # [B, 4]: low nibble the even group
    parts = [d.view(torch.uint8).view(B, 2), (idx & 255), qh, signs, sc]
    return torch.cat([p.to(torch.uint8) for p in parts], -1)


def _quantize_iq1_s(x: torch.Tensor) -> torch.Tensor:
    """IQ1_S blocks (50 bytes) of ``x [B, 256]``: per 32 weights a 3-bit scale and the
    delta's sign (of the two, the one of smaller squared error), per 8 an 11-bit index."""
    B = x.shape[0]
    grid = _grid("iq1_s")  # values -1, 0, 1
    g = x.view(B, 8, 32)
    d, ls, scale = _scales(g, 1.125, 8, 1.0)
    best = None
    for sign in (1.0, -1.0):  # delta = +1/8 (bit 15 clear) or -1/8
        t = g / scale.unsqueeze(-1) - 0.125 * sign
        idx = _nearest(t.view(B, 8, 4, 8), grid)  # [B, 8, 4]
        err = ((grid[idx].view(B, 8, 32) - t) ** 2).sum(-1)  # [B, 8]
        if best is None:
            best = (idx, err, torch.zeros_like(err, dtype=torch.bool))
        else:
            take = err < best[1]
            best = (
                torch.where(take.unsqueeze(-1), idx, best[0]),
                torch.minimum(err, best[1]),
                take,
            )
    idx, _, minus = best
    qh = ((idx >> 8) << (3 * torch.arange(4))).sum(-1) | (ls << 12) | (minus.long() << 15)
    parts = [d.view(torch.uint8).view(B, 2), (idx & 255).reshape(B, 32).to(torch.uint8)]
    return torch.cat(parts + [_le(qh, 2).reshape(B, 16)], -1)


def quantize_grid(blocks: np.ndarray, name: str) -> np.ndarray:
    """Blocks of 256 fp32 weights ``[B, 256]`` -> GGUF ``name`` blocks ``uint8 [B, size]``.

    Per 32 weights the scale nearest ``amax / vmax`` (``vmax`` the grid's largest value;
    IQ1_S: 1.125) on the block's fp16 ``d``, then per 8 weights (IQ3_XXS, IQ3_S: 4) the
    grid entry nearest in squared error; IQ2_XXS / IQ3_XXS keep an even count of minus
    signs per 8 (the weight of least magnitude flips where needed). Valid blocks for
    ``gguf.quants.dequantize``; no importance matrix.

    Raises:
        ValueError: weights whose fp16 ``d`` would overflow.
    """
    x = torch.from_numpy(np.ascontiguousarray(blocks, dtype=np.float32))
    if name in ("iq2_xxs", "iq3_xxs"):
        out = _quantize_xxs(x, name)
    elif name == "iq3_s":
        out = _quantize_iq3_s(x)
    else:
        out = _quantize_iq1_s(x)
    return out.numpy()
