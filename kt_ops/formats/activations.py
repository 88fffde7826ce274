"""The q8 activation quantization of docs/formats.md (llama.cpp ``q8_0`` activations)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["quantize_activations_q8"]


def quantize_activations_q8(x: Tensor, block: int = 32) -> Tensor:
    """What the kernels of the ``q8`` formats see of ``x``: the fp32 dequantized int8 activations.

    Per row (last dimension ``K``), in blocks of ``block`` (32 in the kernels)
    along ``K``, with ``x`` zero-padded to a multiple of ``block``::

        amax = max |x[32i : 32i+32]|;   sx[i] = amax / 127
        xq = round_half_even(x * (127 / amax))  in [-127, 127]   (0 when amax = 0)
        result = xq * sx

    all in fp32 (the llama.cpp ``block_q8_0`` activation format, with the
    scale kept in fp32). The kernel tests build their dense reference with it.

    Args:
        x: floating tensor ``[..., K]`` of any float dtype (converted to fp32).
        block: elements per scale along the last dimension (positive int).

    Returns:
        fp32 tensor of the shape of ``x`` (the padding is cut off again).

    Raises:
        ValueError: ``x`` is not a floating tensor with at least one dimension,
            or ``block`` is not a positive int.
    """
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 1:
        what = f"{x.dtype} {list(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(
            f"quantize_activations_q8: x must be a floating tensor [..., K], got {what}"
        )
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"quantize_activations_q8: block must be a positive int, got {block!r}")
    shape = x.shape
    K = shape[-1]
    if x.numel() == 0:
        return x.detach().float().clone()
    kp = -(-K // block) * block
    xf = torch.nn.functional.pad(x.detach().float().reshape(-1, K), (0, kp - K))
    xb = xf.view(xf.shape[0], kp // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    sx = amax / 127
    # Tensor / tensor is the correctly rounded fp32 quotient (127.f / amax in the
    # kernels); a Python scalar over a tensor would be 127 * reciprocal(amax).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv).clamp_(-127, 127)
    return (xq * sx).view(-1, kp)[:, :K].reshape(shape)
