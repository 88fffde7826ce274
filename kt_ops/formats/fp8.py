"""fp8: E4M3 weights with 128x128 block scales (DeepSeek-V3 ``weight_scale_inv``).

Element format: E4M3 of "FP8 Formats for Deep Learning" (Micikevicius et al.,
2022), i.e. ``torch.float8_e4m3fn`` (bias 7, no infinities, max 448, NaN =
``S.1111.111``). Scales: one fp32 per ``[128 rows x 128 k]`` block, as in the
DeepSeek-V3 checkpoints: ``W = float(W8) * scale_inv[e, n // 128, k // 128]``.

Packed layout (docs/formats.md): uint8 ``[E, NB, Kp, 16]`` with
``packed[e, nb, c, r, j] = bits(W8[e, 16nb + r, 4c + j])``, zero bits (+0.0)
in the padding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kt_ops.formats.packed import PackedProjection
from kt_ops.formats.spec import BLOCK_ROWS, ceil_div, padded_k

__all__ = ["from_fp8", "quantize_fp8"]

FP8_MAX = 448.0
FP8_BLOCK = 128


def _pack_bits(bits: Tensor) -> Tensor:
    """uint8 E4M3 bits ``[E, N, K]`` -> ``[E, NB, Kp, 16]`` (16 bytes: one k of 16 rows)."""
    E, N, K = bits.shape
    nb, kp = ceil_div(N, BLOCK_ROWS), padded_k(K)
    padded = torch.nn.functional.pad(bits, (0, kp - K, 0, nb * BLOCK_ROWS - N))
    return padded.view(E, nb, BLOCK_ROWS, kp).permute(0, 1, 3, 2).contiguous()


def _expand_block_scales(scale: Tensor, n: int, k: int) -> Tensor:
    """``[E, ceil(n/128), ceil(k/128)]`` -> ``[E, n, k]``."""
    rows = torch.arange(n) // FP8_BLOCK
    cols = torch.arange(k) // FP8_BLOCK
    return scale[:, rows][:, :, cols]


def quantize_fp8(w: Tensor) -> PackedProjection:
    """Dense fp32 ``[E, N, K]`` -> fp8 with 128x128 block scales ``amax / 448`` (fp32).

    Codes are ``(w / scale).to(torch.float8_e4m3fn)`` (round to nearest even,
    clamped to +-448); an all-zero block gets scale 0 and zero codes.
    """
    E, N, K = w.shape
    nbn, nbk = ceil_div(N, FP8_BLOCK), ceil_div(K, FP8_BLOCK)
    wp = torch.nn.functional.pad(w, (0, nbk * FP8_BLOCK - K, 0, nbn * FP8_BLOCK - N))
    amax = wp.abs().view(E, nbn, FP8_BLOCK, nbk, FP8_BLOCK).amax(dim=(2, 4))
    scale = amax / FP8_MAX
    s = _expand_block_scales(scale, N, K)
    x = torch.where(s > 0, w / torch.where(s > 0, s, 1.0), 0.0).clamp(-FP8_MAX, FP8_MAX)
    bits = x.to(torch.float8_e4m3fn).view(torch.uint8)
    p = PackedProjection(_pack_bits(bits), scale.contiguous(), None, "fp8", FP8_BLOCK, N, K)
    return p.validate()


def from_fp8(weight: Tensor, scale_inv: Tensor) -> PackedProjection:
    """Pack an fp8 checkpoint projection (DeepSeek-V3 style) without changing any value.

    Args:
        weight: ``[E, N, K]`` ``torch.float8_e4m3fn`` (or its uint8 bits).
        scale_inv: ``[E, ceil(N/128), ceil(K/128)]`` floating tensor, the
            checkpoint's ``weight_scale_inv`` (dequantized weight =
            ``fp8 * scale_inv``); stored as fp32 (exact for fp32/bf16/fp16 input).

    Returns:
        A validated :class:`PackedProjection` (format ``'fp8'``, group 128).

    Raises:
        ValueError: ``weight`` is not 3-D ``float8_e4m3fn``/uint8 or holds a NaN
            code (``S.1111.111``); ``scale_inv`` is not a floating tensor of the
            block shape or holds a non-finite value.
    """
    if not isinstance(weight, Tensor) or weight.dim() != 3:
        what = list(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"from_fp8: weight must be a 3-D tensor [E, N, K], got {what}")
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(
            f"from_fp8: weight must be torch.float8_e4m3fn (or its uint8 bits), got {weight.dtype}"
        )
    E, N, K = weight.shape
    if min(E, N, K) < 1:
        raise ValueError(f"from_fp8: weight has an empty dimension: {list(weight.shape)}")
    bits = weight.detach().cpu().contiguous().view(torch.uint8)
    if bool(((bits & 0x7F) == 0x7F).any()):
        raise ValueError("from_fp8: weight holds NaN codes (E4M3 S.1111.111)")
    shape = (E, ceil_div(N, FP8_BLOCK), ceil_div(K, FP8_BLOCK))
    if not isinstance(scale_inv, Tensor) or not scale_inv.is_floating_point():
        what = scale_inv.dtype if isinstance(scale_inv, Tensor) else type(scale_inv).__name__
        raise ValueError(f"from_fp8: scale_inv must be a floating tensor, got {what}")
    if tuple(scale_inv.shape) != shape:
        raise ValueError(
            f"from_fp8: scale_inv has shape {list(scale_inv.shape)}, expected {list(shape)} "
            f"(one per 128x128 block of weight {list(weight.shape)})"
        )
    scale = scale_inv.detach().cpu().to(torch.float32).contiguous()
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("from_fp8: scale_inv holds non-finite values")
    return PackedProjection(_pack_bits(bits), scale, None, "fp8", FP8_BLOCK, N, K).validate()
