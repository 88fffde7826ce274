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
from kt_ops.formats.qint import pack_group_params
from kt_ops.formats.spec import BLOCK_ROWS, ceil_div, padded_k

__all__ = [
    "from_fp8",
    "from_fp8_channel",
    "from_mxfp8",
    "quantize_fp8",
    "quantize_fp8_channel",
    "quantize_mxfp8",
]

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

    E4M3 as in Micikevicius et al., "FP8 Formats for Deep Learning" (2022), with
    DeepSeek-V3's 128x128 block scales (DeepSeek-AI, "DeepSeek-V3 Technical Report",
    2024, section 3.3.2).

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


# --------------------------------------------------------------------------- row-scaled fp8
# fp8_channel: one fp32 scale per output channel; mxfp8 (OCP Microscaling Formats v1.0):
# one UE8M0 exponent per 32 along K. Same codes layout; scales [E, NB, G, 16] (qint's).

MXFP8_BLOCK = 32


def _e4m3_bits(x: Tensor) -> Tensor:
    """E4M3 bits of ``x`` (fp32, already within +-448): round to nearest even."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def _check_codes(weight: Tensor, fn: str) -> Tensor:
    if not isinstance(weight, Tensor) or weight.dim() != 3 or min(weight.shape) < 1:
        what = list(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"{fn}: weight must be a non-empty 3-D tensor [E, N, K], got {what}")
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(
            f"{fn}: weight must be torch.float8_e4m3fn (or its uint8 bits), got {weight.dtype}"
        )
    bits = weight.detach().cpu().contiguous().view(torch.uint8)
    if bool(((bits & 0x7F) == 0x7F).any()):
        raise ValueError(f"{fn}: weight holds NaN codes (E4M3 S.1111.111)")
    return bits


def quantize_fp8_channel(w: Tensor) -> PackedProjection:
    """Dense fp32 ``[E, N, K]`` -> ``fp8_channel``: per output channel ``scale = amax / 448``
    (fp32), codes ``E4M3(w / scale)`` (nearest even); an all-zero row gets scale 0."""
    E, N, K = w.shape
    scale = w.abs().amax(dim=-1, keepdim=True) / FP8_MAX  # [E, N, 1]
    x = torch.where(scale > 0, w / torch.where(scale > 0, scale, 1.0), 0.0)
    return _pack_channel(_e4m3_bits(x), scale, N, K)


def _pack_channel(bits: Tensor, scale: Tensor, n: int, k: int) -> PackedProjection:
    p = PackedProjection(
        _pack_bits(bits), pack_group_params(scale, torch.float32), None, "fp8_channel", 0, n, k
    )
    return p.validate()


def from_fp8_channel(weight: Tensor, scale: Tensor) -> PackedProjection:
    """Pack an fp8 per-output-channel checkpoint projection, exactly.

    E4M3 (Micikevicius et al. 2022) with one scale per output channel, as the
    compressed-tensors ``FP8_DYNAMIC`` scheme stores ``weight_scale`` ``[N, 1]``.

    Args:
        weight: ``[E, N, K]`` ``torch.float8_e4m3fn`` (or its uint8 bits).
        scale: ``[E, N]`` or ``[E, N, 1]`` floating (compressed-tensors ``weight_scale``
            of strategy ``channel``; ``W = fp8 * scale``), stored as fp32.

    Raises:
        ValueError: a wrong shape or dtype (named), NaN codes, non-finite scales.
    """
    bits = _check_codes(weight, "from_fp8_channel")
    E, N, K = bits.shape
    if not isinstance(scale, Tensor) or not scale.is_floating_point():
        raise ValueError("from_fp8_channel: scale must be a floating tensor [E, N]")
    if tuple(scale.shape) not in ((E, N), (E, N, 1)):
        raise ValueError(
            f"from_fp8_channel: scale has shape {list(scale.shape)}, expected [E, N] = {[E, N]}"
        )
    s = scale.detach().cpu().float().reshape(E, N, 1)
    if not bool(torch.isfinite(s).all()):
        raise ValueError("from_fp8_channel: scale holds non-finite values")
    return _pack_channel(bits, s, N, K)


def _pack_mx(bits: Tensor, ebytes: Tensor, n: int, k: int) -> PackedProjection:
    groups = padded_k(k) // MXFP8_BLOCK
    ebytes = torch.nn.functional.pad(ebytes, (0, groups - ebytes.shape[-1]))
    p = PackedProjection(
        _pack_bits(bits), pack_group_params(ebytes, torch.uint8), None, "mxfp8", MXFP8_BLOCK, n, k
    )
    return p.validate()


def quantize_mxfp8(w: Tensor) -> PackedProjection:
    """Dense fp32 ``[E, N, K]`` -> ``mxfp8`` (OCP MX v1.0 conversion): per 32 along K (K
    zero-padded), ``E = clamp(floor(log2(amax)) - 8 + 127, 0, 254)`` (8 = E4M3's largest
    exponent; 0 for an all-zero block), elements ``E4M3(w / 2^(E-127))``, nearest even,
    saturated at +-448."""
    E, N, K = w.shape
    kp = ceil_div(K, MXFP8_BLOCK) * MXFP8_BLOCK
    wp = torch.nn.functional.pad(w.double(), (0, kp - K)).view(E, N, -1, MXFP8_BLOCK)
    amax = wp.abs().amax(dim=-1)
    _, ex = torch.frexp(amax)  # floor(log2(amax)) = ex - 1
    ebyte = torch.where(amax > 0, (ex - 1 - 8 + 127).clamp(0, 254), 0)
    x = wp / torch.pow(2.0, ebyte.double() - 127).unsqueeze(-1)
    bits = _e4m3_bits(x.float().view(E, N, kp)[:, :, :K])
    return _pack_mx(bits, ebyte.to(torch.uint8), N, K)


def from_mxfp8(weight: Tensor, scales: Tensor) -> PackedProjection:
    """Pack an MXFP8 checkpoint projection, exactly (``W = fp8 * 2^(E-127)``).

    MXFP8 (E4M3) of the OCP Microscaling Formats (MX) Specification v1.0: a UE8M0
    scale per block of 32 elements (section 5.4).

    Args:
        weight: ``[E, N, K]`` ``torch.float8_e4m3fn`` (or its uint8 bits).
        scales: ``[E, N, ceil(K/32)]`` UE8M0 exponents: uint8 or ``torch.float8_e8m0fnu``.

    Raises:
        ValueError: a wrong shape or dtype (named), NaN codes, or the UE8M0 NaN byte 255.
    """
    bits = _check_codes(weight, "from_mxfp8")
    E, N, K = bits.shape
    G = ceil_div(K, MXFP8_BLOCK)
    if not isinstance(scales, Tensor) or scales.element_size() != 1:
        raise ValueError("from_mxfp8: scales must be uint8 (or float8_e8m0fnu) UE8M0 exponents")
    if tuple(scales.shape) != (E, N, G):
        raise ValueError(
            f"from_mxfp8: scales has shape {list(scales.shape)}, expected [E, N, K/32] = "
            f"{[E, N, G]}"
        )
    e = scales.detach().cpu().contiguous().view(torch.uint8)
    if bool((e == 255).any()):
        raise ValueError("from_mxfp8: scales holds the UE8M0 NaN byte 255")
    return _pack_mx(bits, e, N, K)
