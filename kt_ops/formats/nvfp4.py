"""nvfp4: NVIDIA NVFP4, 16 E2M1 elements per E4M3 block scale, times an fp32 per-tensor scale.

Element: E2M1 as in OCP MX v1.0 (:data:`kt_ops.formats.E2M1_VALUES`). A block of 16
elements along K shares an E4M3 scale ``b``; a projection of one expert has one fp32
scale ``g``. The weight is ``W = e2m1(c) * b * g`` (NVIDIA Transformer Engine / ModelOpt
``weight_scale * weight_scale_2``; compressed-tensors ``nvfp4-pack-quantized`` stores
``1 / g`` as ``weight_global_scale`` and dequantizes ``x * (weight_scale /
weight_global_scale)``).

Packed layout (docs/formats.md): the E2M1 codes in the 4-bit qint plane, the scales as
fp32 ``[E, NB, K/16, 16]`` holding ``s = fp32(b * g) / 2``, no zeros: the kernel maps ``c``
to ``q = 2*e2m1(c) + 12`` and computes ``W = s*q - 12*s``, which is ``e2m1(c) * fp32(b*g)``
exactly in real arithmetic. The fp32 block scale costs 2 bits per weight (6.0 in all):
keeping E4M3 bytes and a per-expert scale would need a per-expert output scale in the
kernels' epilogue, which they do not have yet.
"""

from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from kt_ops.formats.mxfp4 import _as_uint8, _e2m1_round
from kt_ops.formats.packed import PackedProjection
from kt_ops.formats.qint import pack_codes, pack_group_params
from kt_ops.formats.spec import padded_k

__all__ = ["NVFP4_BLOCK", "quantize_nvfp4", "from_nvfp4"]

NVFP4_BLOCK = 16
_E4M3_MAX = 448.0
_E2M1_MAX = 6.0


def _pack(codes: Tensor, block_scale: Tensor, n: int, k: int) -> PackedProjection:
    """codes ``[E, N, K]`` + fp32 ``b * g`` ``[E, N, ceil(K/16)]`` -> a validated nvfp4
    projection (the groups of the K padding to a multiple of 32 get scale 0)."""
    groups = padded_k(k) // NVFP4_BLOCK
    block_scale = torch.nn.functional.pad(block_scale, (0, groups - block_scale.shape[-1]))
    p = PackedProjection(
        pack_codes(codes, 4, pad_code=0),
        pack_group_params(block_scale * 0.5, torch.float32),
        None,
        "nvfp4",
        NVFP4_BLOCK,
        n,
        k,
    )
    return p.validate()


def _block_codes(blocks: Tensor, g: Union[Tensor, float] = 1.0) -> tuple[Tensor, Tensor]:
    """fp32 blocks ``[..., 16]`` and the per-tensor scale ``g`` (broadcast over ``...``) ->
    the E4M3 block scales ``b = E4M3(amax / 6 / g)`` (round to nearest even, saturating;
    float8_e4m3fn ``[...]``) and the E2M1 codes of ``w / (b * g)`` (uint8 ``[..., 16]``;
    nearest, ties to even, saturated at +-6; 0 where ``b * g`` is 0)."""
    b = (blocks.abs().amax(dim=-1) / _E2M1_MAX / g).clamp(max=_E4M3_MAX).to(torch.float8_e4m3fn)
    scale = b.float() * g
    safe = torch.where(scale > 0, scale, 1.0).unsqueeze(-1)
    return b, _e2m1_round((blocks / safe).to(torch.float64))


def quantize_nvfp4(w: Tensor) -> PackedProjection:
    """Dense fp32 ``[E, N, K]`` -> nvfp4 (the ModelOpt / compressed-tensors recipe).

    Per expert: ``g = amax / (448 * 6)`` (fp32; 1 for an all-zero projection). Per 16
    weights along K (K zero-padded to a multiple of 16): ``b = E4M3(amax_block / 6 /
    g)`` (round to nearest even, saturating), elements ``w / (b * g)`` rounded to the
    nearest E2M1 value, ties to even, saturated at +-6.
    """
    E, N, K = w.shape
    kp = -(-K // NVFP4_BLOCK) * NVFP4_BLOCK
    wp = torch.nn.functional.pad(w.float(), (0, kp - K)).view(E, N, -1, NVFP4_BLOCK)
    amax = w.abs().flatten(1).amax(dim=1).float()
    g = torch.where(amax > 0, amax / (_E4M3_MAX * _E2M1_MAX), 1.0).view(E, 1, 1)
    b, codes = _block_codes(wp, g)
    scale = b.float() * g  # fp32, what the producers dequantize with
    return _pack(codes.view(E, N, kp)[:, :, :K], scale, N, K)


def from_nvfp4(
    weight_packed: Tensor, block_scale: Tensor, global_scale: Tensor
) -> PackedProjection:
    """Pack NVFP4 checkpoint tensors of ``E`` experts, exactly.

    NVFP4 as NVIDIA specifies it (E2M1 elements of the OCP Microscaling Formats v1.0,
    section 5.3.3; an E4M3 scale per 16 elements and an fp32 scale per tensor: the
    TensorRT-Model-Optimizer / compressed-tensors ``nvfp4`` layout).

    Args:
        weight_packed: uint8 ``[E, N, K/2]``: two E2M1 codes a byte, element ``2i`` in
            the low nibble of byte ``i`` (compressed-tensors ``weight_packed``, ModelOpt
            ``weight``).
        block_scale: float8_e4m3fn (or any float dtype holding E4M3 values) ``[E, N,
            K/16]`` (``weight_scale``).
        global_scale: fp32 ``[E]`` (or one value for all): the per-tensor scale ``g``
            the block scales are multiplied by (ModelOpt ``weight_scale_2``; for
            compressed-tensors pass ``1 / weight_global_scale``, computed in fp32 as
            its dequantizer divides).

    Returns:
        A validated ``'nvfp4'`` :class:`PackedProjection` (group 16) whose weights
        dequantize to ``e2m1(c) * fp32(b * g)``.

    Raises:
        ValueError: a wrong dtype or shape (named), or a non-finite or negative scale.
    """
    weight_packed = _as_uint8(weight_packed, "weight_packed")
    if weight_packed.dim() != 3 or min(weight_packed.shape) < 1:
        raise ValueError(
            f"from_nvfp4: weight_packed must be uint8 [E, N, K/2], got {list(weight_packed.shape)}"
        )
    E, N, half = weight_packed.shape
    K = 2 * half
    if not isinstance(block_scale, Tensor) or not block_scale.is_floating_point():
        raise ValueError("from_nvfp4: block_scale must be a float8_e4m3fn (or float) tensor")
    G = -(-K // NVFP4_BLOCK)
    if tuple(block_scale.shape) != (E, N, G):
        raise ValueError(
            f"from_nvfp4: block_scale has shape {list(block_scale.shape)}, expected [E, N, "
            f"K/16] = {[E, N, G]} for weight_packed {list(weight_packed.shape)}"
        )
    gs = torch.as_tensor(global_scale, dtype=torch.float32).flatten()
    if gs.numel() == 1:
        gs = gs.expand(E)
    if gs.numel() != E:
        raise ValueError(f"from_nvfp4: global_scale must hold 1 or E={E} values, got {gs.numel()}")
    b = block_scale.detach().cpu().float()
    scale = b * gs.view(E, 1, 1)
    if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
        raise ValueError("from_nvfp4: the block scales times global_scale are not finite and >= 0")
    codes = torch.stack([weight_packed & 15, weight_packed >> 4], dim=-1).view(E, N, K)
    return _pack(codes, scale, N, K)
