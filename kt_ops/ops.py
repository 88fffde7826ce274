"""Typed, documented wrappers of the ``kt::`` ops, with their fake kernels.

``torch.ops.kt.moe_forward`` is registered in C++ (csrc/ops/registration.cpp,
CPU kernel in csrc/ops/moe_ops.cpp); its fake (meta) kernel is registered
here so it traces under ``torch.compile(fullgraph=True, dynamic=True)``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

__all__ = ["moe_forward", "pack_weights", "unpack_weights", "WEIGHT_FORMATS"]

#: Weight formats the op computes with (docs/formats.md; ``kt_ops.formats.FORMATS``).
WEIGHT_FORMATS = ("bf16", "int8", "int4", "fp8", "mxfp4", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k")

_BLOCK_ROWS = 16  # output rows per packed block (csrc/formats/bf16.h)
_K_PACK = 2  # K values interleaved per row


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _check_format(weight_format: str) -> None:
    if weight_format != "bf16":
        raise ValueError(
            f"weight_format={weight_format!r}: pack_weights/unpack_weights handle 'bf16'; use "
            "kt_ops.formats.quantize_weights / dequantize_weights for the quantized formats"
        )
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(
            f"weight_format={weight_format!r} is not supported; expected one of {WEIGHT_FORMATS}"
        )


def pack_weights(weight: Tensor, weight_format: str = "bf16") -> Tensor:
    """Pack dense expert weights ``[E, N, K]`` into the kernel layout of ``weight_format``.

    ``weight`` follows the ``nn.Linear`` convention: ``N`` output rows, ``K``
    inputs, for each of ``E`` experts (gate/up: ``[E, I, H]``; down:
    ``[E, H, I]``). Any floating dtype; it is rounded to bf16 (round to
    nearest even).

    ``'bf16'`` layout (n16k2, csrc/formats/bf16.h): a bf16 tensor
    ``[E, ceil(N/16), ceil(K/2), 16, 2]`` with
    ``packed[e, nb, kp, r, j] = W[e, 16*nb + r, 2*kp + j]`` and zeros past N/K.

    Raises ``ValueError`` for an unknown format, a weight that is not 3-D or
    not floating point.
    """
    _check_format(weight_format)
    if not isinstance(weight, Tensor) or weight.dim() != 3:
        shape = tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"pack_weights: weight must be a 3-D tensor [E, N, K], got {shape}")
    if not weight.is_floating_point():
        raise ValueError(f"pack_weights: weight must be floating point, got {weight.dtype}")
    E, N, K = weight.shape
    nb, kp = _ceil_div(N, _BLOCK_ROWS), _ceil_div(K, _K_PACK)
    w = weight.detach().to(torch.bfloat16)
    w = torch.nn.functional.pad(w, (0, kp * _K_PACK - K, 0, nb * _BLOCK_ROWS - N))
    w = w.view(E, nb, _BLOCK_ROWS, kp, _K_PACK).permute(0, 1, 3, 2, 4)
    return w.contiguous()


def unpack_weights(packed: Tensor, n: int, k: int, weight_format: str = "bf16") -> Tensor:
    """Reference dequantizer: the dense fp32 ``[E, n, k]`` weights a packed tensor holds.

    Inverse of :func:`pack_weights` up to the bf16 rounding. ``n``/``k`` are
    the unpadded output/input sizes. Raises ``ValueError`` when ``packed`` does
    not have the layout of ``[E, n, k]`` in ``weight_format``.
    """
    _check_format(weight_format)
    nb, kp = _ceil_div(n, _BLOCK_ROWS), _ceil_div(k, _K_PACK)
    if packed.dim() != 5 or tuple(packed.shape[1:]) != (nb, kp, _BLOCK_ROWS, _K_PACK):
        raise ValueError(
            f"unpack_weights: packed has shape {tuple(packed.shape)}, expected "
            f"[E, {nb}, {kp}, {_BLOCK_ROWS}, {_K_PACK}] for n={n}, k={k} in {weight_format!r}"
        )
    E = packed.shape[0]
    w = packed.permute(0, 1, 3, 2, 4).reshape(E, nb * _BLOCK_ROWS, kp * _K_PACK)
    return w[:, :n, :k].float()


def moe_forward(
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    intermediate_size: int,
    weight_format: str = "bf16",
    gate_scales: Optional[Tensor] = None,
    up_scales: Optional[Tensor] = None,
    down_scales: Optional[Tensor] = None,
    gate_zeros: Optional[Tensor] = None,
    up_zeros: Optional[Tensor] = None,
    down_zeros: Optional[Tensor] = None,
    group_size: int = 0,
    gate_lora_a: Optional[Tensor] = None,
    gate_lora_b: Optional[Tensor] = None,
    up_lora_a: Optional[Tensor] = None,
    up_lora_b: Optional[Tensor] = None,
    down_lora_a: Optional[Tensor] = None,
    down_lora_b: Optional[Tensor] = None,
    lora_scaling: float = 1.0,
    activation: str = "silu",
) -> Tensor:
    """Routed-expert MLPs of one MoE layer for a batch of tokens (``torch.ops.kt.moe_forward``).

    Computes, for every token ``t`` (SwiGLU experts, as in Mixtral/Qwen-MoE;
    Shazeer 2020, "GLU Variants Improve Transformer")::

        out[t] = sum_k topk_weights[t, k] * W_down[e] @ (silu(W_gate[e] @ x[t]) * (W_up[e] @ x[t]))
        with e = topk_ids[t, k]; slots with e == -1 contribute nothing

    Args:
        hidden_states: ``[T, H]`` bf16, fp16 or fp32, on the CPU. ``T`` may be 0.
        topk_ids: ``[T, K]`` int32/int64 expert ids in ``[-1, E)``; -1 skips a
            slot (experts served elsewhere, e.g. on the GPU).
        topk_weights: ``[T, K]`` routing weights, fp32 or the activation dtype.
        gate_weight, up_weight: packed ``[E, I, H]`` projections (``pack_weights``).
        down_weight: packed ``[E, H, I]`` projection.
        intermediate_size: ``I``, the expert MLP width (packed shapes are padded).
        weight_format: one of ``WEIGHT_FORMATS`` (docs/formats.md): ``'bf16'``
            (packed by ``pack_weights``) or a quantized format whose tensors
            come from ``kt_ops.formats.quantize_weights``, the loaders or the
            converter (uint8 ``weight`` of a :class:`~kt_ops.formats.PackedProjection`).
        gate_scales, up_scales, down_scales: the projections' ``scales`` (``None`` for bf16).
        gate_zeros, up_zeros, down_zeros: the projections' ``zeros`` (formats
            with explicit zero points: asymmetric ``int4``, ``q4_k``, ``q5_k``), else ``None``.
        group_size: the projections' ``group_size`` (0 for bf16 and int8, 128 for fp8).
        gate_lora_a ... down_lora_b, lora_scaling: LoRA terms; must be ``None``
            in this version.
        activation: ``'silu'``.

    Returns:
        ``[T, H]`` tensor in the dtype of ``hidden_states``. Accumulation is
        fp32; results are bit-identical for any thread count on one ISA path.

    Raises:
        RuntimeError naming the argument for a wrong dtype, rank, shape, device,
        an expert id outside ``[-1, E)``, a packed weight whose layout does not
        match ``weight_format``, or quantization/LoRA data the format does not take.
    """
    return torch.ops.kt.moe_forward.default(
        hidden_states,
        topk_ids,
        topk_weights,
        gate_weight,
        up_weight,
        down_weight,
        intermediate_size,
        weight_format,
        gate_scales,
        up_scales,
        down_scales,
        gate_zeros,
        up_zeros,
        down_zeros,
        group_size,
        gate_lora_a,
        gate_lora_b,
        up_lora_a,
        up_lora_b,
        down_lora_a,
        down_lora_b,
        lora_scaling,
        activation,
    )


@torch.library.register_fake("kt::moe_forward")
def _moe_forward_fake(
    hidden_states,
    topk_ids,
    topk_weights,
    gate_weight,
    up_weight,
    down_weight,
    intermediate_size,
    weight_format="bf16",
    gate_scales=None,
    up_scales=None,
    down_scales=None,
    gate_zeros=None,
    up_zeros=None,
    down_zeros=None,
    group_size=0,
    gate_lora_a=None,
    gate_lora_b=None,
    up_lora_a=None,
    up_lora_b=None,
    down_lora_a=None,
    down_lora_b=None,
    lora_scaling=1.0,
    activation="silu",
):
    # A meta tensor mixed with real ones also lands here: name the odd one out
    # instead of returning an uninitialized tensor.
    device = hidden_states.device
    named = {
        "topk_ids": topk_ids,
        "topk_weights": topk_weights,
        "gate_weight": gate_weight,
        "up_weight": up_weight,
        "down_weight": down_weight,
        "gate_scales": gate_scales,
        "up_scales": up_scales,
        "down_scales": down_scales,
        "gate_zeros": gate_zeros,
        "up_zeros": up_zeros,
        "down_zeros": down_zeros,
        "gate_lora_a": gate_lora_a,
        "gate_lora_b": gate_lora_b,
        "up_lora_a": up_lora_a,
        "up_lora_b": up_lora_b,
        "down_lora_a": down_lora_a,
        "down_lora_b": down_lora_b,
    }
    for name, t in named.items():
        if t is not None:
            torch._check(
                t.device == device,
                lambda name=name, t=t: (
                    f"kt.moe_forward: {name} is on {t.device} but hidden_states is on {device}; "
                    "all tensors must be on one device"
                ),
            )
    torch._check(hidden_states.dim() == 2, lambda: "hidden_states must be 2-D [T, H]")
    torch._check(
        hidden_states.dtype in (torch.bfloat16, torch.float16, torch.float32),
        lambda: f"hidden_states must be bf16, fp16 or fp32, got {hidden_states.dtype}",
    )
    torch._check(topk_ids.dim() == 2, lambda: "topk_ids must be 2-D [T, K]")
    torch._check(
        topk_ids.dtype in (torch.int32, torch.int64),
        lambda: f"topk_ids must be int32 or int64, got {topk_ids.dtype}",
    )
    torch._check(
        topk_ids.shape[0] == hidden_states.shape[0],
        lambda: "topk_ids must have one row per token of hidden_states",
    )
    torch._check(
        topk_weights.shape == topk_ids.shape,
        lambda: "topk_weights must have the shape of topk_ids",
    )
    torch._check(weight_format in WEIGHT_FORMATS, lambda: f"unknown weight_format {weight_format}")
    H = hidden_states.shape[1]
    inter = intermediate_size
    E = gate_weight.shape[0]
    if weight_format == "bf16":
        expected = {
            "gate_weight": (E, _ceil_div(inter, _BLOCK_ROWS), _ceil_div(H, _K_PACK), 16, 2),
            "up_weight": (E, _ceil_div(inter, _BLOCK_ROWS), _ceil_div(H, _K_PACK), 16, 2),
            "down_weight": (E, _ceil_div(H, _BLOCK_ROWS), _ceil_div(inter, _K_PACK), 16, 2),
        }
        dtype = torch.bfloat16
    else:
        from kt_ops.formats import format_spec

        spec = format_spec(weight_format)
        expected = {
            "gate_weight": tuple(spec.weight_shape(E, inter, H)),
            "up_weight": tuple(spec.weight_shape(E, inter, H)),
            "down_weight": tuple(spec.weight_shape(E, H, inter)),
        }
        dtype = torch.uint8
    for name, t in (
        ("gate_weight", gate_weight),
        ("up_weight", up_weight),
        ("down_weight", down_weight),
    ):
        shape = expected[name]
        torch._check(
            t.dtype == dtype and tuple(t.shape) == shape,
            lambda name=name, t=t, shape=shape: (
                f"kt.moe_forward: {name} has shape {tuple(t.shape)} ({t.dtype}), expected the "
                f"{weight_format} packed layout {shape} ({dtype})"
            ),
        )
    return hidden_states.new_empty(hidden_states.shape)


def _moe_forward_backward(ctx, grad_output):
    raise NotImplementedError(
        "kt.moe_forward: backward (gradients for hidden_states / topk_weights / LoRA) is not "
        "implemented in this kt_ops version; run the experts under torch.no_grad() or detach "
        "their inputs"
    )


# Until kt::moe_backward exists, backward raises instead of PyTorch's fallback,
# which would silently leave every gradient as None.
torch.library.register_autograd("kt::moe_forward", _moe_forward_backward)
