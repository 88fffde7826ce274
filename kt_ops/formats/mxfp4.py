"""mxfp4: OCP Microscaling (MX) v1.0 MXFP4, 32 E2M1 elements per UE8M0 scale.

Element: E2M1 (sign bit 3, exponent bits 2..1 with bias 1, mantissa bit 0),
values +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Scale: UE8M0 byte ``E``, ``X = 2^(E-127)``
(255 = NaN, rejected). ``W = X * e2m1(c)``.

Packed layout (docs/formats.md): the E2M1 codes ``c`` in the 4-bit qint plane,
the ``E`` bytes as uint8 ``scales [E, NB, G, 16]``, no zeros. The kernel maps
``c`` to ``q = 2*e2m1(c) + 12`` and uses ``scale = 2^(E-128)``, ``zero = 12*scale``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from kt_ops.formats.packed import PackedProjection
from kt_ops.formats.qint import pack_codes, pack_group_params

__all__ = ["E2M1_VALUES", "quantize_mxfp4", "from_mxfp4"]

#: E2M1 code -> value (OCP MX v1.0, section 5.3.3); codes 8..15 are the negatives.
E2M1_VALUES = (
    *(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0),
    *(-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0),
)
MXFP4_BLOCK = 32


def _e2m1_round(v: Tensor) -> Tensor:
    """E2M1 codes of ``v`` (float64): nearest value, ties to even mantissa, saturated at +-6.

    The E2M1 grid has step 0.5 below 2, 1 in [2, 4) and 2 from 4 on; rounding
    half to even in units of the step is ties-to-even-mantissa.
    """
    a = v.abs()
    r = torch.where(
        a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2)
    ).clamp(max=6.0)
    mags = torch.tensor(E2M1_VALUES[:8], dtype=torch.float64)
    code = torch.bucketize(r, mags)  # exact match -> its index
    return (code + 8 * ((v < 0) & (r > 0))).to(torch.uint8)


def quantize_mxfp4(w: Tensor) -> PackedProjection:
    """Dense fp32 ``[E, N, K]`` -> mxfp4 (OCP MX v1.0 conversion).

    Per 32 weights along K (K zero-padded to a multiple of 32): shared exponent
    ``E = clamp(floor(log2(amax)) - 2 + 127, 0, 254)`` (0 for an all-zero
    block), elements ``w / 2^(E-127)`` rounded to the nearest E2M1 value, ties
    to even, saturated to +-6 (-0 is stored as +0).
    """
    E, N, K = w.shape
    kp = -(-K // MXFP4_BLOCK) * MXFP4_BLOCK
    wp = torch.nn.functional.pad(w.to(torch.float64), (0, kp - K)).view(E, N, -1, MXFP4_BLOCK)
    amax = wp.abs().amax(dim=-1)
    _, ex = torch.frexp(amax)  # amax = m * 2^ex, m in [0.5, 1): floor(log2(amax)) = ex - 1
    ebyte = torch.where(amax > 0, (ex - 1 - 2 + 127).clamp(0, 254), 0)
    x = torch.pow(2.0, ebyte.to(torch.float64) - 127).unsqueeze(-1)
    codes = _e2m1_round(wp / x).view(E, N, kp)[:, :, :K]
    p = PackedProjection(
        pack_codes(codes, 4, pad_code=0),
        pack_group_params(ebyte.to(torch.uint8), torch.uint8),
        None,
        "mxfp4",
        MXFP4_BLOCK,
        N,
        K,
    )
    return p.validate()


def _as_uint8(x: Any, name: str) -> Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, Tensor) or x.dtype != torch.uint8:
        what = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"from_mxfp4: {name} must be a uint8 tensor, got {what}")
    return x.detach().cpu().contiguous()


def from_mxfp4(blocks: Tensor, scales: Tensor) -> PackedProjection:
    """Pack a Hugging Face MXFP4 checkpoint projection (e.g. gpt-oss ``*_blocks``/``*_scales``).

    MXFP4 of the OCP Microscaling Formats (MX) Specification v1.0: E2M1 elements
    (section 5.3.3), a UE8M0 scale per block of 32 (section 5.4).

    Layout of transformers' ``integrations/mxfp4.py`` (``convert_moe_packed_tensors``):

    Args:
        blocks: uint8 ``[E, N, K/32, 16]``: two E2M1 codes per byte, element
            ``2i`` in the low nibble and ``2i + 1`` in the high nibble of
            byte ``i`` of each 32-element block (``[E, N, K/2]`` is accepted too).
        scales: uint8 ``[E, N, K/32]`` UE8M0 exponents (bias 127).

    Returns:
        A validated :class:`PackedProjection` (``'mxfp4'``, group 32, n = N,
        k = K); dequantizes to ``e2m1(c) * 2^(E-127)`` exactly.

    Raises:
        ValueError: a tensor is not uint8, ``blocks`` is not ``[E, N, G, 16]``
            (or ``[E, N, 16G]``) for the ``[E, N, G]`` of ``scales``, an empty
            dimension, or a scale byte 255 (NaN).
    """
    blocks = _as_uint8(blocks, "blocks")
    scales = _as_uint8(scales, "scales")
    if scales.dim() != 3 or min(scales.shape) < 1:
        raise ValueError(f"from_mxfp4: scales must be [E, N, K/32], got {list(scales.shape)}")
    E, N, G = scales.shape
    if blocks.dim() == 3 and tuple(blocks.shape) == (E, N, 16 * G):
        blocks = blocks.view(E, N, G, 16)
    if tuple(blocks.shape) != (E, N, G, 16):
        raise ValueError(
            f"from_mxfp4: blocks has shape {list(blocks.shape)}, expected [E, N, K/32, 16] = "
            f"{[E, N, G, 16]} to match scales {list(scales.shape)}"
        )
    if bool((scales == 255).any()):
        raise ValueError("from_mxfp4: scales holds the UE8M0 NaN byte 255")
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).view(E, N, G * MXFP4_BLOCK)
    p = PackedProjection(
        pack_codes(codes, 4, pad_code=0),
        pack_group_params(scales, torch.uint8),
        None,
        "mxfp4",
        MXFP4_BLOCK,
        N,
        G * MXFP4_BLOCK,
    )
    return p.validate()
