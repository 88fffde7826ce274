"""Typed, documented wrappers of the ``kt::`` ops, with their fake kernels and autograd.

The ops are registered in C++ (csrc/ops/registration.cpp; CPU kernels in
csrc/ops/moe_ops.cpp and csrc/ops/moe_backward_ops.cpp):

* ``torch.ops.kt.moe_forward``: the routed experts, optionally with LoRA.
* ``torch.ops.kt.moe_forward_train``: the same, also returning the gate/up
  pre-activations that backward can reuse.
* ``torch.ops.kt.moe_backward``: gradients for ``hidden_states``,
  ``topk_weights`` and the LoRA factors (base weights are frozen).

Their fake (meta) kernels are registered here so they trace under
``torch.compile(fullgraph=True, dynamic=True)``, and so is the autograd
formula of ``moe_forward`` / ``moe_forward_train`` (``loss.backward()`` just
works). See :func:`set_lora_activation_checkpointing` for what forward saves.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "moe_forward",
    "moe_forward_train",
    "moe_backward",
    "pack_weights",
    "unpack_weights",
    "set_lora_activation_checkpointing",
    "lora_activation_checkpointing",
    "WEIGHT_FORMATS",
    "split_weight_format",
    "join_weight_format",
]

#: Weight formats the op computes with (docs/formats.md; ``kt_ops.formats.FORMATS``).
WEIGHT_FORMATS = ("bf16", "int8", "int4", "fp8", "mxfp4", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k")

_BLOCK_ROWS = 16  # output rows per packed block (csrc/formats/bf16.h)
_K_PACK = 2  # K values interleaved per row


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def split_weight_format(weight_format: str) -> tuple[str, str, str]:
    """The (gate, up, down) format names of a ``weight_format`` argument.

    ``weight_format`` is one name for all three projections (``'q4_k'``) or
    three comma-separated names ``'gate,up,down'`` (``'q4_k,q4_k,q6_k'``, as
    GGUF Q4_K_M files store some layers). Raises ``ValueError`` for another
    count of names, an unknown name, or ``bf16`` or ``fp8`` mixed with other formats.
    """
    names = weight_format.split(",")
    if len(names) == 1:
        names = names * 3
    if len(names) != 3:
        raise ValueError(
            f"weight_format={weight_format!r} must be one format name or three comma-separated "
            "names 'gate,up,down' (e.g. 'q4_k,q4_k,q6_k')"
        )
    for n in names:
        if n not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight_format {n!r}; expected one of {WEIGHT_FORMATS}")
    if "bf16" in names and len(set(names)) > 1:
        raise ValueError(
            f"weight_format={weight_format!r} mixes bf16 with quantized formats; bf16 experts "
            "take one format for all three projections"
        )
    if "fp8" in names and len(set(names)) > 1:
        raise ValueError(
            f"weight_format={weight_format!r} mixes fp8 with other formats; per-projection "
            "formats are for the integer (qint) formats: int8, int4, mxfp4 and the GGUF types"
        )
    return names[0], names[1], names[2]


def join_weight_format(gate: str, up: str, down: str) -> str:
    """The ``weight_format`` argument for per-projection formats (one name when they agree)."""
    return gate if gate == up == down else f"{gate},{up},{down}"


def _check_format(weight_format: str) -> None:
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(
            f"unknown weight_format {weight_format!r}; expected one of {WEIGHT_FORMATS}"
        )
    if weight_format != "bf16":
        raise ValueError(
            f"weight_format={weight_format!r}: pack_weights/unpack_weights handle 'bf16'; use "
            "kt_ops.formats.quantize_weights / dequantize_weights for the quantized formats"
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


# --------------------------------------------------------------------------
# What a training forward saves (activation checkpointing)
# --------------------------------------------------------------------------

_ACTIVATION_CHECKPOINTING = False


def set_lora_activation_checkpointing(enabled: bool) -> None:
    """Choose what :func:`moe_forward` with LoRA saves for backward.

    Applies to calls that pass LoRA factors and record autograd (grad mode on
    and an input, such as a LoRA factor, ``hidden_states`` or
    ``topk_weights``, requiring grad). A call can override it with its
    ``activation_checkpointing`` argument (and :class:`kt_ops.nn.MoEExperts`
    with its attribute of that name).

    * ``False`` (default, PyTorch's usual trade): **save activations.** Forward
      runs ``kt.moe_forward_train`` and keeps the gate and up pre-activations,
      fp32 ``[T*K, I]`` each: ``2 * K * I * 4`` bytes per token beyond the
      inputs (Qwen3-30B-A3B, K=8, I=768: 48 KiB per token per layer).
      Backward then runs 3 base GEMMs per expert (down, and the two for
      ``grad hidden_states``) instead of 5.
    * ``True``: **recompute (checkpointing).** Forward runs ``kt.moe_forward``
      and saves only its inputs (which autograd holds anyway): 0 extra bytes
      per token. Backward recomputes the gate and up pre-activations (2 more
      GEMMs per expert).

    Calls **without** LoRA recompute unless they pass
    ``activation_checkpointing=False``: their forward is then the fast
    inference kernel (which has no pre-activations to save), so a model that
    only backpropagates through frozen experts, or forgot ``torch.no_grad()``,
    keeps inference speed and memory.

    Both give the same gradients (bit for bit with LoRA). Under
    ``torch.compile`` the setting is read at trace time (a guard recompiles
    when it changes).
    """
    global _ACTIVATION_CHECKPOINTING
    _ACTIVATION_CHECKPOINTING = bool(enabled)


def lora_activation_checkpointing() -> bool:
    """The setting of :func:`set_lora_activation_checkpointing` (default ``False``: save)."""
    return _ACTIVATION_CHECKPOINTING


_LORA_NAMES = (
    "gate_lora_a",
    "gate_lora_b",
    "up_lora_a",
    "up_lora_b",
    "down_lora_a",
    "down_lora_b",
)


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
    *,
    activation_checkpointing: Optional[bool] = None,
) -> Tensor:
    """Routed-expert MLPs of one MoE layer for a batch of tokens (``torch.ops.kt.moe_forward``).

    Computes, for every token ``t`` (SwiGLU experts, as in Mixtral/Qwen-MoE;
    Shazeer 2020, "GLU Variants Improve Transformer")::

        out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t]))
        with e = topk_ids[t, k]; slots with e == -1 contribute nothing

    where each projection ``p`` of expert ``e`` is ``p_e(v) = W_p[e] @ v``, plus,
    when its LoRA factors are given, ``lora_scaling * B_p[e] @ (A_p[e] @ v)``
    (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; the
    PEFT convention, ``lora_scaling = lora_alpha / r``).

    Differentiable: gradients flow to ``hidden_states``, ``topk_weights`` and
    the LoRA factors through ``kt.moe_backward``. The base weights are frozen.

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
            Quantized projections may differ: ``'gate,up,down'``, e.g.
            ``'q4_k,q4_k,q6_k'`` (GGUF Q4_K_M); see :func:`split_weight_format`.
        gate_scales, up_scales, down_scales: the projections' ``scales`` (``None`` for bf16).
        gate_zeros, up_zeros, down_zeros: the projections' ``zeros`` (formats
            with explicit zero points: asymmetric ``int4``, ``q4_k``, ``q5_k``), else ``None``.
        group_size: the projections' ``group_size`` (0 for bf16 and int8, 128 for fp8).
            With per-projection formats, a format that has a single group size
            (the GGUF types, int8, fp8) uses its own and ``group_size`` is that of
            the others (``int4``).
        gate_lora_a, up_lora_a: ``[E, r, H]`` LoRA A of the gate/up projections.
        gate_lora_b, up_lora_b: ``[E, I, r]`` LoRA B of the gate/up projections.
        down_lora_a: ``[E, r, I]``; down_lora_b: ``[E, H, r]``.
            Any subset of the three projections may carry LoRA (A and B of a
            projection together); each projection has its own rank ``r >= 1``.
            All given factors share one dtype (fp32, bf16 or fp16), are
            contiguous and on the CPU; the LoRA terms are computed in fp32. Any
            ``weight_format`` takes LoRA (QLoRA style: the quantized base stays
            frozen and packed; each active expert is dequantized to fp32 per call).
        lora_scaling: the LoRA scale (``alpha / r``), a finite float.
        activation: ``'silu'``.
        activation_checkpointing: what a call that records autograd saves for
            backward: ``False`` saves the gate/up pre-activations (``2*K*I*4``
            bytes per token; ATen forward), ``True`` recomputes them; ``None``
            (default): with LoRA, :func:`set_lora_activation_checkpointing`'s
            setting, without LoRA ``True`` (the fast inference kernel).

    Returns:
        ``[T, H]`` tensor in the dtype of ``hidden_states``. Accumulation is
        fp32; results are bit-identical for any thread count on one ISA path.
        Without LoRA the ISA kernels run; with LoRA (and for the saving
        training forward) an ATen fp32 path (per-expert GEMMs) runs instead, on
        the base weights dequantized to fp32 (exactly
        ``kt_ops.formats.dequantize_weights``) and fp32 activations. The kernels
        of the integer formats round the activations to int8 (q8, docs/formats.md)
        and that path does not, so on such a base the LoRA path with ``B = 0``
        differs from the no-LoRA call by that rounding: about 1e-2 relative
        (1.2e-2 of the output norm measured on a Qwen3-30B-A3B-shaped layer;
        fp8, whose kernels keep fp32 activations: 6e-7, summation order).

    Raises:
        RuntimeError naming the argument for a wrong dtype, rank, shape, device,
        an expert id outside ``[-1, E)``, a packed weight whose layout does not
        match ``weight_format``, quantization data the format does not take, or
        a LoRA factor with the wrong rank/shape/dtype/device, a B whose rank
        differs from its A, an A without its B, or non-contiguous factors;
        and, when autograd records the call, for packed weights (or their
        scales) that require grad (the base weights are frozen).
    """
    args = (
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
    lora = _present(args[15:21])
    if activation_checkpointing is None:
        activation_checkpointing = _ACTIVATION_CHECKPOINTING if lora else True
    if not activation_checkpointing and torch.is_grad_enabled():
        grad_inputs = (hidden_states, topk_weights, *lora)
        if any(t.requires_grad for t in grad_inputs):
            return torch.ops.kt.moe_forward_train.default(*args)[0]
    return torch.ops.kt.moe_forward.default(*args)


def _present(tensors):
    return [t for t in tensors if t is not None]


def moe_forward_train(*args, **kwargs) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.kt.moe_forward_train``: :func:`moe_forward` plus what backward reuses.

    Takes exactly the arguments of the op ``kt.moe_forward`` (no
    ``activation_checkpointing``) and returns ``(out, gate_pre, up_pre)``:
    ``out`` as :func:`moe_forward`; ``gate_pre`` and ``up_pre`` the gate and
    up pre-activations of every (token, slot), LoRA terms included: fp32
    ``[T*K, I]``, row ``t*K + k``, zero rows where ``topk_ids`` is -1. Always
    runs the ATen fp32 path. Differentiable in ``out`` (``gate_pre``/``up_pre``
    are not). Raises what :func:`moe_forward` raises.
    """
    return torch.ops.kt.moe_forward_train.default(*args, **kwargs)


def moe_backward(grad_output: Tensor, *args, **kwargs) -> tuple[Tensor, ...]:
    """``torch.ops.kt.moe_backward``: gradients of ``kt.moe_forward``; autograd calls it for you.

    Call as ``moe_backward(grad_output, <the arguments of kt.moe_forward>,
    gate_pre=None, up_pre=None, compute_grad_hidden_states=True)``.
    ``grad_output`` is ``[T, H]`` (fp32/bf16/fp16); ``gate_pre``/``up_pre``
    are the pre-activations of :func:`moe_forward_train` (``None``: recomputed).

    Returns eight tensors: ``grad_hidden_states`` ``[T, H]`` (dtype of
    ``hidden_states``), ``grad_topk_weights`` ``[T, K]`` (dtype of
    ``topk_weights``; ``d out[t] / d w[t, k] = <grad_output[t], expert_e(x_t)>``,
    0 where the id is -1), then the gradients of ``gate_lora_a``,
    ``gate_lora_b``, ``up_lora_a``, ``up_lora_b``, ``down_lora_a``,
    ``down_lora_b`` (shape and dtype of each factor; zero for experts that got
    no token). A factor that was not given, and ``grad_hidden_states`` when
    ``compute_grad_hidden_states=False``, come back as an empty ``[0]``
    tensor in the dtype of ``hidden_states``. Base weights are frozen: no
    gradient for them. Computed in fp32 with per-expert GEMMs; results are
    bit-identical for any thread count.

    Raises what :func:`moe_forward` raises for its arguments (messages say
    ``kt.moe_forward``), and RuntimeError for a ``grad_output`` of another
    shape, dtype or device, or ``gate_pre``/``up_pre`` that are not both
    given or not fp32 ``[T*K, I]``.
    """
    return torch.ops.kt.moe_backward.default(grad_output, *args, **kwargs)


# --------------------------------------------------------------------------
# Fake (meta) kernels
# --------------------------------------------------------------------------


def _check_fake_args(
    hidden_states,
    topk_ids,
    topk_weights,
    gate_weight,
    up_weight,
    down_weight,
    intermediate_size,
    weight_format,
    scales_and_zeros,
    lora,
):
    """The fake kernels' share of moe_forward's checks: devices, ranks, shapes, dtypes."""
    # A meta tensor mixed with real ones also lands here: name the odd one out
    # instead of returning an uninitialized tensor.
    device = hidden_states.device
    named = {
        "topk_ids": topk_ids,
        "topk_weights": topk_weights,
        "gate_weight": gate_weight,
        "up_weight": up_weight,
        "down_weight": down_weight,
        **scales_and_zeros,
        **lora,
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
    try:
        names = split_weight_format(weight_format)
    except ValueError as err:
        torch._check(False, lambda err=err: f"kt.moe_forward: {err}")
    H = hidden_states.shape[1]
    inter = intermediate_size
    E = gate_weight.shape[0]
    if names[0] == "bf16":
        expected = {
            "gate_weight": (E, _ceil_div(inter, _BLOCK_ROWS), _ceil_div(H, _K_PACK), 16, 2),
            "up_weight": (E, _ceil_div(inter, _BLOCK_ROWS), _ceil_div(H, _K_PACK), 16, 2),
            "down_weight": (E, _ceil_div(H, _BLOCK_ROWS), _ceil_div(inter, _K_PACK), 16, 2),
        }
        dtype = torch.bfloat16
    else:
        from kt_ops.formats import format_spec

        gate_spec, up_spec, down_spec = (format_spec(n) for n in names)
        expected = {
            "gate_weight": tuple(gate_spec.weight_shape(E, inter, H)),
            "up_weight": tuple(up_spec.weight_shape(E, inter, H)),
            "down_weight": tuple(down_spec.weight_shape(E, H, inter)),
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
    _check_fake_lora(gate_weight.shape[0], H, intermediate_size, lora)


def _check_fake_lora(E, H, I, lora):  # noqa: E741
    """LoRA shapes as the C++ op checks them (so a compiled graph fails at trace time)."""
    sizes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    dtype = None
    for proj, (n, k) in sizes.items():
        a, b = lora[f"{proj}_lora_a"], lora[f"{proj}_lora_b"]
        torch._check(
            (a is None) == (b is None),
            lambda proj=proj: f"kt.moe_forward: {proj}_lora_a and {proj}_lora_b go together",
        )
        if a is None or b is None:
            continue
        for name, t in ((f"{proj}_lora_a", a), (f"{proj}_lora_b", b)):
            torch._check(
                t.dtype in (torch.float32, torch.bfloat16, torch.float16),
                lambda name=name, t=t: (
                    f"kt.moe_forward: {name} must be fp32/bf16/fp16, got {t.dtype}"
                ),
            )
            dtype = dtype or t.dtype
            torch._check(
                t.dtype == dtype,
                lambda: "kt.moe_forward: all LoRA tensors must have one dtype",
            )
        torch._check(
            a.dim() == 3 and a.shape[0] == E and a.shape[2] == k and a.shape[1] >= 1,
            lambda proj=proj, a=a, k=k: (
                f"kt.moe_forward: {proj}_lora_a must be [E={E}, r, {k}], got {tuple(a.shape)}"
            ),
        )
        torch._check(
            b.dim() == 3 and b.shape[0] == E and b.shape[1] == n and b.shape[2] == a.shape[1],
            lambda proj=proj, a=a, b=b, n=n: (
                f"kt.moe_forward: {proj}_lora_b must be [E={E}, {n}, r={a.shape[1]}], "
                f"got {tuple(b.shape)}"
            ),
        )


def _fake_forward_checks(args: tuple) -> None:
    (x, ids, w, gw, uw, dw, I, fmt, gs, us, ds, gz, uz, dz, _group, *rest) = args  # noqa: E741
    lora = dict(zip(_LORA_NAMES, rest[:6]))
    scales = {
        "gate_scales": gs,
        "up_scales": us,
        "down_scales": ds,
        "gate_zeros": gz,
        "up_zeros": uz,
        "down_zeros": dz,
    }
    _check_fake_args(x, ids, w, gw, uw, dw, I, fmt, scales, lora)


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
    _fake_forward_checks(
        (
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
        )
    )
    return hidden_states.new_empty(hidden_states.shape)


_FORWARD_SIGNATURE = inspect.signature(_moe_forward_fake)


@torch.library.register_fake("kt::moe_forward_train")
def _moe_forward_train_fake(*args, **kwargs):
    out = _moe_forward_fake(*args, **kwargs)
    bound = _FORWARD_SIGNATURE.bind(*args, **kwargs).arguments
    rows = bound["hidden_states"].shape[0] * bound["topk_ids"].shape[1]
    pre = (rows, bound["intermediate_size"])
    x = bound["hidden_states"]
    return out, x.new_empty(pre, dtype=torch.float32), x.new_empty(pre, dtype=torch.float32)


@torch.library.register_fake("kt::moe_backward")
def _moe_backward_fake(
    grad_output,
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
    gate_pre=None,
    up_pre=None,
    compute_grad_hidden_states=True,
):
    lora = (gate_lora_a, gate_lora_b, up_lora_a, up_lora_b, down_lora_a, down_lora_b)
    x = hidden_states
    _fake_forward_checks(
        (
            x,
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
            *lora,
        )
    )
    torch._check(
        grad_output.shape == x.shape,
        lambda: (
            "kt.moe_backward: grad_output must have the shape of hidden_states "
            f"{tuple(x.shape)}, got {tuple(grad_output.shape)}"
        ),
    )
    torch._check(
        grad_output.device == x.device,
        lambda: f"kt.moe_backward: grad_output is on {grad_output.device}, not {x.device}",
    )
    torch._check(
        (gate_pre is None) == (up_pre is None),
        lambda: "kt.moe_backward: pass both gate_pre and up_pre (or neither)",
    )
    empty = x.new_empty((0,))
    return (
        x.new_empty(x.shape) if compute_grad_hidden_states else empty,
        topk_weights.new_empty(topk_weights.shape),
        *(t.new_empty(t.shape) if t is not None else x.new_empty((0,)) for t in lora),
    )


# --------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------

#: Argument names of kt::moe_forward, in schema order (moe_forward_train has the same).
_FORWARD_ARGS = (
    "hidden_states",
    "topk_ids",
    "topk_weights",
    "gate_weight",
    "up_weight",
    "down_weight",
    "intermediate_size",
    "weight_format",
    "gate_scales",
    "up_scales",
    "down_scales",
    "gate_zeros",
    "up_zeros",
    "down_zeros",
    "group_size",
    *_LORA_NAMES,
    "lora_scaling",
    "activation",
)

#: Argument names of kt::moe_backward, in schema order.
_BACKWARD_ARGS = ("grad_output", *_FORWARD_ARGS, "gate_pre", "up_pre", "compute_grad_hidden_states")

#: Positions (in _FORWARD_ARGS) of the tensors that backward takes.
_TENSOR_POSITIONS = tuple(
    i
    for i, name in enumerate(_FORWARD_ARGS)
    if name
    not in ("intermediate_size", "weight_format", "group_size", "lora_scaling", "activation")
)

#: Tensors that hold the frozen base weights.
_FROZEN = (
    "gate_weight",
    "up_weight",
    "down_weight",
    "gate_scales",
    "up_scales",
    "down_scales",
    "gate_zeros",
    "up_zeros",
    "down_zeros",
)

_LORA_POSITIONS = tuple(_FORWARD_ARGS.index(name) for name in _LORA_NAMES)


def _setup_context_common(ctx, inputs, saved_pre) -> None:
    for name in _FROZEN:
        t = inputs[_FORWARD_ARGS.index(name)]
        if t is not None and t.requires_grad:
            raise RuntimeError(
                f"kt.moe_forward: {name} requires grad, but the base expert weights are frozen "
                "(kt.moe_backward computes gradients only for hidden_states, topk_weights and "
                f"the LoRA factors); call {name}.requires_grad_(False), or pass LoRA tensors "
                "(gate_lora_a/b, up_lora_a/b, down_lora_a/b) to fine-tune the experts"
            )
    # save_for_backward (not ctx attributes): autograd frees them after the
    # first backward, and a second backward then raises PyTorch's clear error.
    ctx.save_for_backward(*(inputs[i] for i in _TENSOR_POSITIONS), *saved_pre)
    ctx.non_tensor_args = {
        name: inputs[i] for i, name in enumerate(_FORWARD_ARGS) if i not in _TENSOR_POSITIONS
    }
    ctx.num_saved_pre = len(saved_pre)


def _moe_forward_setup_context(ctx, inputs, output) -> None:
    _setup_context_common(ctx, inputs, ())


def _moe_forward_train_setup_context(ctx, inputs, output) -> None:
    _out, gate_pre, up_pre = output
    ctx.mark_non_differentiable(gate_pre, up_pre)
    _setup_context_common(ctx, inputs, (gate_pre, up_pre))


def _moe_backward_formula(ctx, grad_output, *_grads_of_saved_pre):
    saved = ctx.saved_tensors
    n_pre = ctx.num_saved_pre
    tensors = saved[: len(saved) - n_pre]
    pre = saved[len(saved) - n_pre :] if n_pre else (None, None)
    kwargs = dict(ctx.non_tensor_args)
    kwargs.update({_FORWARD_ARGS[i]: t for i, t in zip(_TENSOR_POSITIONS, tensors)})
    # The dispatcher drops trailing arguments equal to their defaults, so
    # needs_input_grad may be shorter than the schema: pad it.
    given = len(ctx.needs_input_grad)
    needs = tuple(ctx.needs_input_grad) + (False,) * (len(_FORWARD_ARGS) - given)
    grads = torch.ops.kt.moe_backward.default(
        grad_output,
        *(kwargs[name] for name in _FORWARD_ARGS),
        gate_pre=pre[0],
        up_pre=pre[1],
        compute_grad_hidden_states=needs[0],
    )
    result = [None] * len(_FORWARD_ARGS)
    if needs[0]:
        result[0] = grads[0]
    if needs[2]:
        result[2] = grads[1]
    for pos, grad in zip(_LORA_POSITIONS, grads[2:]):
        if needs[pos]:
            result[pos] = grad
    return tuple(result[:given])


torch.library.register_autograd(
    "kt::moe_forward", _moe_backward_formula, setup_context=_moe_forward_setup_context
)
torch.library.register_autograd(
    "kt::moe_forward_train", _moe_backward_formula, setup_context=_moe_forward_train_setup_context
)


def _moe_backward_setup_context(ctx, inputs, output) -> None:
    pass


def _moe_backward_double_backward(ctx, *grads):
    raise RuntimeError(
        "kt.moe_backward: double backward (gradients of gradients, e.g. "
        "torch.autograd.grad(..., create_graph=True) followed by another backward) through "
        "kt.moe_forward is not supported"
    )


# Without this, a second-order backward would silently produce no gradient.
torch.library.register_autograd(
    "kt::moe_backward", _moe_backward_double_backward, setup_context=_moe_backward_setup_context
)
