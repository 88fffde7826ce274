"""The ``bf16`` layout: packing and its reference unpacking (csrc/formats/bf16.h).

Packing is a pad, a view and a permute: it traces, runs on any device and
needs no kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kt_ops.formats.spec import BLOCK_ROWS, ceil_div

__all__ = ["pack_weights", "unpack_weights"]

_K_PACK = 2  # K values interleaved per row


def _check_format(weight_format: str) -> None:
    if weight_format != "bf16":
        raise ValueError(
            f"weight_format={weight_format!r}: pack_weights/unpack_weights handle 'bf16'; use "
            "kt_ops.formats.quantize_weights / dequantize_weights for the other formats"
        )


def pack_weights(weight: Tensor, weight_format: str = "bf16") -> Tensor:
    """Pack dense expert weights ``[E, N, K]`` into the ``bf16`` kernel layout.

    ``weight`` follows the ``nn.Linear`` convention: ``N`` output rows, ``K``
    inputs, for each of ``E`` experts (gate/up: ``[E, I, H]``; down:
    ``[E, H, I]``). Any floating dtype; it is rounded to bf16 (round to
    nearest even).

    Layout (n16k2, csrc/formats/bf16.h): a bf16 tensor
    ``[E, ceil(N/16), ceil(K/2), 16, 2]`` with
    ``packed[e, nb, kp, r, j] = W[e, 16*nb + r, 2*kp + j]`` and zeros past N/K.
    For a :class:`~kt_ops.formats.PackedProjection` (which records ``N`` and
    ``K``) use ``kt_ops.formats.quantize_weights(weight, 'bf16')``.

    Raises ``ValueError`` for a format other than ``'bf16'``, a weight that is
    not 3-D or not floating point.
    """
    _check_format(weight_format)
    if not isinstance(weight, Tensor) or weight.dim() != 3:
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"pack_weights: weight must be a 3-D tensor [E, N, K], got {shape}")
    if not weight.is_floating_point():
        raise ValueError(f"pack_weights: weight must be floating point, got {weight.dtype}")
    E, N, K = weight.shape
    nb, kp = ceil_div(N, BLOCK_ROWS), ceil_div(K, _K_PACK)
    w = weight.detach().to(torch.bfloat16)
    w = torch.nn.functional.pad(w, (0, kp * _K_PACK - K, 0, nb * BLOCK_ROWS - N))
    w = w.view(E, nb, BLOCK_ROWS, kp, _K_PACK).permute(0, 1, 3, 2, 4)
    return w.contiguous()


def unpack_weights(packed: Tensor, n: int, k: int, weight_format: str = "bf16") -> Tensor:
    """Reference dequantizer: the dense fp32 ``[E, n, k]`` weights a bf16 packed tensor holds.

    Inverse of :func:`pack_weights` up to the bf16 rounding. ``n``/``k`` are
    the unpadded output/input sizes. Raises ``ValueError`` when ``packed`` does
    not have the layout of ``[E, n, k]``.
    """
    _check_format(weight_format)
    nb, kp = ceil_div(n, BLOCK_ROWS), ceil_div(k, _K_PACK)
    if packed.dim() != 5 or tuple(packed.shape[1:]) != (nb, kp, BLOCK_ROWS, _K_PACK):
        raise ValueError(
            f"unpack_weights: packed has shape {tuple(packed.shape)}, expected "
            f"[E, {nb}, {kp}, {BLOCK_ROWS}, {_K_PACK}] for n={n}, k={k} in {weight_format!r}"
        )
    E = packed.shape[0]
    w = packed.permute(0, 1, 3, 2, 4).reshape(E, nb * BLOCK_ROWS, kp * _K_PACK)
    return w[:, :n, :k].float()
