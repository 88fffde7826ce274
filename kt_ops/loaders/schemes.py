"""Decoders of the quantization schemes that Hugging Face checkpoints ship their experts in.

Each turns a checkpoint's stored tensors into fp32 weights, exactly; the loaders then
pack them into a kt_ops format (or keep them as stored where a format represents them).

* ``fp8``: DeepSeek-V3-style E4M3 weights with one ``weight_scale_inv`` per 128x128 block.
* ``mxfp4``: gpt-oss' E2M1 ``blocks`` with one UE8M0 ``scales`` byte per 32 elements
  (OCP Microscaling Formats MX v1.0).
"""

from __future__ import annotations

import torch

from kt_ops.formats import E2M1_VALUES

__all__ = ["dequantize_fp8_blocks", "dequantize_mxfp4_blocks"]


def dequantize_fp8_blocks(w8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``float(W8[e, n, k]) * scale_inv[e, n // 128, k // 128]`` as fp32 ``[c, N, K]``."""
    n, k = w8.shape[-2:]
    s = scale_inv.float().repeat_interleave(128, dim=-2)[..., :n, :]
    s = s.repeat_interleave(128, dim=-1)[..., :k]
    return w8.float() * s


def dequantize_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks ``[c, N, K/32, 16]`` + UE8M0 scales ``[c, N, K/32]`` -> fp32 ``[c, N, K]``.

    Byte ``j`` of a block holds elements ``2j`` (low nibble) and ``2j + 1`` (high
    nibble), as in transformers' ``_convert_moe_packed_tensors``.
    """
    if bool((scales == 255).any()):
        raise ValueError("MXFP4 scale byte 255 (NaN) in the checkpoint")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    b = blocks.to(torch.int64)
    vals = torch.stack([lut[b & 0x0F], lut[b >> 4]], dim=-1).flatten(-2)  # [c, N, K/32, 32]
    vals = torch.ldexp(vals, (scales.to(torch.int32) - 127).unsqueeze(-1).float())
    return vals.flatten(-2)
