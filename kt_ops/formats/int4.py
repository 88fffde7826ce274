"""Exact repacking of int4 checkpoints (GPTQ, AWQ, compressed-tensors) into kt_ops ``int4``.

Those schemes store unsigned 4-bit codes ``q``, one scale ``s`` per group of K (or per
output channel) and, when asymmetric, an integer zero point ``z``; the weight is ``W = s
* (q - z)``. kt_ops' ``int4`` computes ``W = s * q - zero``: a symmetric source (``z =
8`` everywhere) needs no zeros tensor (the implicit ``zero = 8 * s``); otherwise the
zeros are stored as fp32 ``s * z``, which is exact for fp16 and bf16 scales (11 or 8
significant bits times a 4-bit integer), so ``s*q - s*z`` is ``s*(q - z)`` exactly.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kt_ops.formats.packed import PackedProjection
from kt_ops.formats.qint import pack_codes, pack_group_params
from kt_ops.formats.spec import format_spec, padded_k

__all__ = ["from_int4", "int4_scale_dtype"]


def int4_scale_dtype(scales: Tensor) -> torch.dtype:
    """fp16 where it holds every scale of ``scales`` exactly, else fp32 (what :func:`from_int4`
    stores; pass it as ``scale_dtype`` so that chunks of one projection agree)."""
    s16 = scales.to(torch.float16)
    exact = bool(torch.equal(s16.to(scales.dtype), scales)) and bool(torch.isfinite(s16).all())
    return torch.float16 if exact else torch.float32


def from_int4(
    codes: Tensor,
    scales: Tensor,
    zero_points: Optional[Tensor] = None,
    scale_dtype: Optional[torch.dtype] = None,
) -> PackedProjection:
    """Pack unsigned int4 codes with group scales (and zero points) as kt_ops ``int4``.

    The codes and group scales of GPTQ (Frantar et al., "GPTQ: Accurate Post-Training
    Quantization for Generative Pre-trained Transformers", 2022) and AWQ (Lin et al.,
    "AWQ: Activation-aware Weight Quantization", 2023) checkpoints, as AutoGPTQ,
    AutoAWQ and compressed-tensors store them (their readers unpack to these codes).

    Args:
        codes: integer ``[E, N, K]``, values in ``[0, 15]``, in natural K order (a
            reader undoes any act-order permutation or nibble interleave first).
        scales: float ``[E, N, G]``: one scale per group of ``K / G`` along K (``G =
            1``: per output channel). fp16 scales are kept; bf16 and fp32 ones are
            kept as fp16 where that is exact, else as fp32.
        zero_points: integer ``[E, N, G]`` in ``[0, 15]`` (stored as fp32 ``s * z`` zeros),
            or None for symmetric codes (zero point 8, no zeros tensor).
        scale_dtype: the dtype to store the scales in (:func:`int4_scale_dtype`, the
            default); it must hold them exactly.

    Returns:
        A validated ``'int4'`` :class:`PackedProjection`; it dequantizes to ``s * (q -
        z)`` exactly (in fp32).

    Raises:
        ValueError: shapes or dtypes that do not match (named), codes or zero points out
            of range, or a group size kt_ops' ``int4`` does not take (it takes
            ``format_spec('int4').group_sizes``; 0 is per channel).
    """
    if not isinstance(codes, Tensor) or codes.dim() != 3 or codes.is_floating_point():
        raise ValueError("from_int4: codes must be an integer tensor [E, N, K]")
    E, N, K = codes.shape
    if not isinstance(scales, Tensor) or not scales.is_floating_point() or scales.dim() != 3:
        raise ValueError("from_int4: scales must be a float tensor [E, N, G]")
    if tuple(scales.shape[:2]) != (E, N) or scales.shape[2] < 1 or K % scales.shape[2]:
        raise ValueError(
            f"from_int4: scales has shape {list(scales.shape)}; expected [E={E}, N={N}, G] "
            f"with G dividing K={K}"
        )
    G = int(scales.shape[2])
    group = 0 if G == 1 else K // G
    allowed = format_spec("int4").group_sizes
    if group not in allowed or (group and padded_k(K) % group):
        raise ValueError(
            f"from_int4: group size {K // G} (K={K}, {G} scales a row) is not one kt_ops int4 "
            f"takes ({allowed}; 0 = per channel); load it with weight_format= another format "
            "to requantize"
        )
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("from_int4: codes must lie in [0, 15]")
    s = scales.detach().cpu()
    s_stored = s.to(scale_dtype or int4_scale_dtype(s))
    if not bool(torch.equal(s_stored.to(s.dtype), s)):
        raise ValueError(f"from_int4: scale_dtype={scale_dtype} does not hold the scales exactly")
    zeros = None
    if zero_points is not None:
        if not isinstance(zero_points, Tensor) or tuple(zero_points.shape) != (E, N, G):
            what = list(zero_points.shape) if isinstance(zero_points, Tensor) else zero_points
            raise ValueError(f"from_int4: zero_points must be [E, N, G] = {[E, N, G]}, got {what}")
        z = zero_points.detach().cpu().to(torch.int64)
        if z.numel() and (int(z.min()) < 0 or int(z.max()) > 15):
            raise ValueError("from_int4: zero_points must lie in [0, 15]")
        zeros = pack_group_params(s_stored.float() * z.float(), torch.float32)
    p = PackedProjection(
        pack_codes(codes.detach().cpu().to(torch.uint8), 4, pad_code=8),
        pack_group_params(s_stored, s_stored.dtype),
        zeros,
        "int4",
        group,
        N,
        K,
    )
    return p.validate()
