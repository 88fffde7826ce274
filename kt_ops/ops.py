"""Typed, documented wrappers of the ``kt::`` ops, with their fake kernels.

The ops are registered in C++ (csrc/ops/registration.cpp; CPU kernels in
csrc/ops/moe_ops.cpp and csrc/ops/moe_train_ops.cpp, autograd kernels in
csrc/ops/moe_autograd.cpp):

* ``torch.ops.kt.moe_forward`` (and ``moe_forward.out``): the routed experts,
  optionally with LoRA.
* ``torch.ops.kt.moe_forward_train``: the same, also returning the gate/up
  pre-activations that backward can reuse.
* ``torch.ops.kt.moe_backward``: gradients for ``hidden_states``,
  ``topk_weights`` and the LoRA factors (base weights are frozen).

Every op takes the routed tokens then the layer arguments that
:func:`kt_ops.layer.layer_args` builds from an :class:`~kt_ops.layer.ExpertWeights`
and a :class:`~kt_ops.layer.LoRAWeights` (the one Python statement of that
list). Their fake (meta) kernels are registered here so they trace under
``torch.compile(fullgraph=True, dynamic=True)``; their autograd kernels are in
C++ (csrc/ops/moe_autograd.cpp: ``loss.backward()`` just works, and an
inference call never enters Python between the dispatcher and the kernel).
See :func:`set_lora_activation_checkpointing` for what forward saves.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import unset_fake_temporarily

from kt_ops import _C
from kt_ops.layer import (
    DEFAULT_ACTIVATION,
    PROJECTIONS,
    ExpertWeights,
    LoRAWeights,
    layer_args,
    parse_activation,
)

__all__ = [
    "moe_forward",
    "moe_forward_train",
    "moe_backward",
    "moe_forward_prepared",
    "new_prepared_layer",
    "PreparedLayer",
    "set_lora_activation_checkpointing",
    "lora_activation_checkpointing",
]


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


def moe_forward(
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    experts: ExpertWeights,
    lora: Optional[LoRAWeights] = None,
    *,
    activation: str = DEFAULT_ACTIVATION,
    activation_checkpointing: Optional[bool] = None,
    out: Optional[Tensor] = None,
    gpu_experts_mask: Optional[Tensor] = None,
) -> Tensor:
    """Routed-expert MLPs of one MoE layer for a batch of tokens (``torch.ops.kt.moe_forward``).

    Computes, for every token ``t`` (gated experts: SwiGLU as in Mixtral/Qwen-MoE,
    or GeGLU; Shazeer 2020, "GLU Variants Improve Transformer")::

        out[t] = sum_k topk_weights[t, k] * down_e(act(gate_e(x[t])) * up_e(x[t]))
        with e = topk_ids[t, k]; slots with e == -1 contribute nothing

    where each projection ``p`` of expert ``e`` is ``p_e(v) = W_p[e] @ v``, plus,
    when ``lora`` has factors for it, ``lora.scaling * B_p[e] @ (A_p[e] @ v)``
    (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"; the
    PEFT convention, ``scaling = lora_alpha / r``).

    Differentiable: gradients flow to ``hidden_states``, ``topk_weights`` and
    the LoRA factors through ``kt.moe_backward``. The base weights are frozen.

    Args:
        hidden_states: ``[T, H]`` bf16, fp16 or fp32, on the CPU. ``T`` may be 0.
        topk_ids: ``[T, K]`` int32/int64 expert ids in ``[-1, E)``; -1 skips a
            slot (experts served elsewhere, e.g. on the GPU).
        topk_weights: ``[T, K]`` routing weights, fp32 or the activation dtype.
        experts: the layer's packed experts (:class:`~kt_ops.layer.ExpertWeights`:
            gate/up ``[E, I, H]``, down ``[E, H, I]``, each projection in any
            weight format of :data:`kt_ops.formats.FORMATS`, docs/formats.md).
            ``ExpertWeights.from_dense(gate, up, down, 'int4')`` builds one;
            so do the loaders, the converter and ``MoEExperts.expert_weights()``.
        lora: optional LoRA factors (:class:`~kt_ops.layer.LoRAWeights`): any
            subset of the projections, each with its own rank ``r >= 1``; one
            float dtype (fp32, bf16 or fp16), contiguous, on the CPU; computed
            in fp32. Any weight format takes LoRA (QLoRA style: the quantized
            base stays frozen and packed; each active expert is dequantized to
            fp32 per call).
        activation: the experts' ``act``, one of :data:`kt_ops.ACTIVATIONS`:
            ``'silu'`` (default, SwiGLU), ``'gelu'`` (GeGLU, erf),
            ``'gelu_tanh'`` (GeGLU with PyTorch's tanh approximation;
            transformers' ``gelu_pytorch_tanh``), optionally with the clamps
            and offsets of :func:`kt_ops.activation_spec` (gpt-oss's
            ``'silu(alpha=1.702,limit=7.0,up_offset=1.0)'``). Formulas:
            ``csrc/kernels/activations.h``. Per-expert biases travel in
            ``experts`` (:meth:`ExpertWeights.with_biases`).
        activation_checkpointing: what a call that records autograd saves for
            backward: ``False`` saves the gate/up pre-activations (``2*K*I*4``
            bytes per token), ``True`` recomputes them; ``None``
            (default): with LoRA, :func:`set_lora_activation_checkpointing`'s
            setting, without LoRA ``True`` (the fast inference kernel).
        out: optional caller-owned contiguous ``[T, H]`` tensor in the dtype of
            ``hidden_states`` to write the result into (``kt.moe_forward.out``;
            static buffers, CUDA graphs); not differentiable.
        gpu_experts_mask: optional bool ``[E]`` on the device of
            ``hidden_states``: ``True`` marks an expert served elsewhere (its
            weights on the GPU, CPU/GPU hybrid inference). The op skips its
            slots exactly as it skips id ``-1``: they add nothing to ``out``
            and get zero gradients. The caller adds the GPU experts' output.

    Returns:
        ``[T, H]`` tensor in the dtype of ``hidden_states`` (``out`` when
        given). Accumulation is fp32; results are bit-identical for any thread
        count on one ISA path. Without LoRA the ISA kernels run; with LoRA (and
        for the saving training forward) they run in their exact mode: fp32
        activations times the exact weights (the streaming kernels, no q8
        rounding), the LoRA terms as fp32 GEMMs per expert. bf16 hidden states
        on a bf16 base also take the tile path there (bf16 products are exact
        in fp32; the down projection reads the GLU outputs rounded to bf16, as
        inference does). The kernels of the integer formats round the
        activations to int8 (q8, docs/formats.md) and the exact mode does not,
        so on such a base the LoRA path with ``B = 0`` differs from the no-LoRA
        call by that rounding: about 1e-2 relative (fp8, whose kernels keep
        fp32 activations: 6e-7). A LoRA call without autograd under
        ``quant_activations='q8'`` (``kt_ops.use_quant_activations('q8')``) runs
        the ISA kernels instead, with the same LoRA terms: the no-LoRA call's bits
        when ``B = 0``, and decode with an unmerged adapter on an integer base at
        about the base's speed (int4 g128, T = 1: 2.8x faster than the exact mode
        on Zen 4, ``benchmarks/bench_lora_inference.py``). The backward runs fp32 GEMMs on the base
        weights dequantized to fp32 (exactly ``kt_ops.formats.dequantize_weights``);
        for bf16 hidden states and gradients on a bf16 base, bf16 brgemm products
        (``go Wd`` exact; ``dg``, ``du`` rounded to bf16 for the gradient of x).
        Inference calls (grad mode off, no LoRA, mask or ``out``) compute the
        same bits through a layer parsed once and kept on ``experts``
        (``kt_ops._C.PreparedLayer``), which skips the op's argument conversion
        and dispatch; dispatch modes, subclasses and the profiler still see the op.
        Packed tensors replaced in ``experts`` or given new storage in place are
        seen by the next call. A NaN or infinite routing weight makes its token's
        output NaN (slots of id -1 ignore theirs).

    Raises:
        RuntimeError naming the argument for a wrong dtype, rank, shape, device,
        an expert id outside ``[-1, E)``, hidden states whose width is not the
        experts' hidden size, a packed weight whose layout does not match its
        format, quantization data the format does not take, or a LoRA factor
        with the wrong rank/shape/dtype/device, a B whose rank differs from its
        A, an A without its B, or non-contiguous factors; and, when autograd
        records the call, for packed weights (or their scales) that require
        grad (the base weights are frozen).
        ValueError: ``experts`` carries backward panels made before its packed
            weights changed (``ExpertWeights.with_backward_panels``; make them again).
    """
    if (
        out is None
        and gpu_experts_mask is None
        and (lora is None or not lora.any())
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    ):
        prepared = _prepared_layer(experts, activation)
        if prepared is not None:
            y = prepared.forward(hidden_states, topk_ids, topk_weights)
            if y is not None:
                return y
    args = (hidden_states, topk_ids, topk_weights) + layer_args(
        experts, lora, activation, hidden_states, gpu_experts_mask
    )
    if out is not None:
        if torch.is_grad_enabled():
            # The out= overload has no autograd kernel to refuse a base weight that
            # requires grad (it would just get no gradient).
            _check_frozen(args[3])
        _check_out(hidden_states, topk_weights, lora, out)
        torch.ops.kt.moe_forward.out(*args, out=out)
        return out
    has_lora = lora is not None and lora.any()
    if activation_checkpointing is None:
        activation_checkpointing = _ACTIVATION_CHECKPOINTING if has_lora else True
    if not activation_checkpointing and torch.is_grad_enabled():
        factors = [t for t in (lora.factors() if has_lora else ()) if t is not None]
        if any(t.requires_grad for t in (hidden_states, topk_weights, *factors)):
            return torch.ops.kt.moe_forward_train.default(*args)[0]
    return torch.ops.kt.moe_forward.default(*args)


def _prepared_layer(experts: ExpertWeights, activation: str) -> Optional[PreparedLayer]:
    """The :class:`PreparedLayer` of ``experts`` with ``activation``, made once, or None.

    Inference calls without LoRA, mask or ``out=`` run through it: the op's
    output bit for bit from the three routed tensors, without the layer
    arguments' conversion and checks (about half of a cold call's fixed cost:
    ``benchmarks/bench_call_overhead.py``). Kept on the (frozen)
    ``ExpertWeights`` object with the packed tensors it was made from, and made
    again where one of them was replaced (a :class:`PackedProjection`'s fields can
    be assigned); tensors given new storage in place (``.data =``, ``set_()``) the
    layer itself finds (csrc/ops/prepared_layer.cpp). None where the op would
    reject the layer (it then raises).
    """
    if not isinstance(activation, str):  # the op's call raises, naming activation
        return None
    layers = experts.__dict__.get("_prepared_layers")
    if layers is None:
        layers = {}
        object.__setattr__(experts, "_prepared_layers", layers)
    entry = layers.get(activation)
    if entry is not None and _same_tensors(experts, entry[1]):
        return entry[0]
    # A spec the op refuses gets no prepared layer: the op's call then raises.
    layer = (
        new_prepared_layer(experts, activation=activation)
        if _valid_activation(activation)
        else None
    )
    layers[activation] = (layer, _packed_tensors(experts))
    return layer


def _packed_tensors(experts: ExpertWeights) -> tuple:
    """The tensors a prepared layer of ``experts`` reads (weights, scales, zeros, biases)."""
    return tuple(t for p in experts.projections for t in (p.weight, p.scales, p.zeros, p.bias))


def _same_tensors(experts: ExpertWeights, made_from: tuple) -> bool:
    """Whether ``experts`` still holds the tensors ``made_from`` (written out: 0.5 us, a
    generator over the pairs cost 2 us a call; a counter bumped by PackedProjection's
    assignments would be a global that torch.compile guards on, recompiling)."""
    g, u, d = experts.gate, experts.up, experts.down
    m = made_from
    return (
        g.weight is m[0]
        and g.scales is m[1]
        and g.zeros is m[2]
        and g.bias is m[3]
        and u.weight is m[4]
        and u.scales is m[5]
        and u.zeros is m[6]
        and u.bias is m[7]
        and d.weight is m[8]
        and d.scales is m[9]
        and d.zeros is m[10]
        and d.bias is m[11]
    )


def _valid_activation(activation: str) -> bool:
    try:
        parse_activation(activation)
    except ValueError:
        return False
    return True


_PREPARED_OP = torch.ops.kt.moe_forward_prepared.default
_torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled


def moe_forward_prepared(
    layer, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor
) -> Tensor:
    """``torch.ops.kt.moe_forward_prepared``: :func:`moe_forward` on a layer parsed once.

    Args:
        layer: a ``torch.classes.kt.PreparedLayer`` (:func:`new_prepared_layer`
            makes one: :attr:`PreparedLayer.layer`).
        hidden_states, topk_ids, topk_weights: as in :func:`moe_forward`, on the CPU.

    Returns:
        ``[T, H]`` in the dtype of ``hidden_states``: :func:`moe_forward`'s output
        (no LoRA; the layer's activation and GPU-experts mask), bit for bit.

    Raises:
        RuntimeError: :func:`moe_forward`'s errors for the routed tensors; when
            autograd would record the call (use :func:`moe_forward` to
            differentiate); ``topk_ids`` with another K than the layer's ``top_k``.
    """
    return _PREPARED_OP(layer, hidden_states, topk_ids, topk_weights)


class PreparedLayer:
    """A layer parsed once (``torch.classes.kt.PreparedLayer``) and its inference call.

    The one way the front ends (:func:`moe_forward`, ``kt_ops.nn.MoEExperts``,
    ``kt_ops.compat.KTMoEWrapper``) take ``kt::moe_forward_prepared``:
    :meth:`forward` returns the op's output, or None where the caller's full
    path must run instead: grad mode on, arguments that are not plain CPU
    ``torch.Tensor`` objects (subclasses, other devices), or an error, which the
    full path then raises with the caller's own type and message. Modes, the
    profiler and autocast see ``kt::moe_forward_prepared`` as any op.
    """

    __slots__ = ("layer",)

    def __init__(self, layer) -> None:
        """``layer``: a ``torch.classes.kt.PreparedLayer`` (:func:`new_prepared_layer`)."""
        self.layer = layer  # torch.classes.kt.PreparedLayer

    def forward(
        self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor
    ) -> Optional[Tensor]:
        """``[T, H]`` in the dtype of ``hidden_states`` (``topk_ids``, ``topk_weights``
        ``[T, K]``, as :func:`moe_forward`), or None where the caller's full path must
        run (the cases above; every error included: the full path raises it). Giving
        the packed tensors new storage while a call runs in another thread is a data
        race, as for any op reading them.
        """
        if (
            torch.is_grad_enabled()
            or type(hidden_states) is not Tensor
            or type(topk_ids) is not Tensor
            or type(topk_weights) is not Tensor
            or not hidden_states.is_cpu
            or _torch_function_mode_enabled()
        ):
            return None
        try:
            # The op through the dispatcher, entered from C++: exact tensors and no
            # torch function mode leave torch.ops' __torch_function__ layer nothing
            # to do, and on a script object argument it costs ~8 us a call
            # (csrc/ops/prepared_layer.cpp, register_prepared_layer_call).
            return _C.moe_forward_prepared(self.layer, hidden_states, topk_ids, topk_weights)
        except RuntimeError:
            return None


def new_prepared_layer(
    experts: ExpertWeights,
    gpu_experts_mask: Optional[Tensor] = None,
    top_k: int = 0,
    activation: str = DEFAULT_ACTIVATION,
) -> Optional[PreparedLayer]:
    """A :class:`PreparedLayer` of ``experts``, or None where the op would reject the layer.

    ``gpu_experts_mask`` (contiguous CPU bool ``[E]``) is read at every call;
    ``top_k`` > 0 makes calls with another K fail (and :meth:`PreparedLayer.forward`
    return None, so a caller raises its own error).
    """
    try:
        layer = torch.classes.kt.PreparedLayer(
            list(experts.tensors()),
            experts.weight_format,
            [experts.hidden_size, experts.intermediate_size],
            list(experts.group_sizes),
            activation,
            gpu_experts_mask,
            top_k,
        )
    except RuntimeError:
        return None
    return PreparedLayer(layer)


def _check_out(hidden_states: Tensor, topk_weights: Tensor, lora, out: Tensor) -> None:
    """What ``moe_forward(..., out=)`` refuses before the op runs.

    ``out`` is not differentiable (as PyTorch's out= variants). Overlap with
    ``hidden_states`` is the op's own check (csrc/ops/moe_ops.cpp).
    """
    if torch.is_grad_enabled():
        factors = [t for t in (lora.factors() if lora is not None else ()) if t is not None]
        if any(t.requires_grad for t in (hidden_states, topk_weights, out, *factors)):
            raise RuntimeError(
                "kt.moe_forward: out= does not support automatic differentiation (an input "
                "requires grad); call it without out=, or under torch.no_grad()"
            )


def moe_forward_train(
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    experts: ExpertWeights,
    lora: Optional[LoRAWeights] = None,
    *,
    activation: str = DEFAULT_ACTIVATION,
    gpu_experts_mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.kt.moe_forward_train``: :func:`moe_forward` plus what backward reuses.

    Takes the arguments of :func:`moe_forward` and returns ``(out, gate_pre,
    up_pre)``: ``out`` as :func:`moe_forward`; ``gate_pre`` and ``up_pre`` the
    gate and up pre-activations of every (token, slot), LoRA terms included:
    fp32 ``[T*K, I]``, row ``t*K + k``, zero rows where ``topk_ids`` is -1.
    The activations are never quantized to int8 here (unlike :func:`moe_forward` on
    an integer format): bf16 hidden states multiply the weights' exact values on
    tiles with fp32 sums (AVX512_BF16 / AMX CPUs; the down projection reads the GLU
    outputs rounded to bf16, as inference does), other inputs run the streaming
    kernels on fp32 activations (docs/lora.md, "Training step speed"). Differentiable in
    ``out`` (``gate_pre``/``up_pre`` are not). Raises what :func:`moe_forward` raises.
    """
    args = (hidden_states, topk_ids, topk_weights) + layer_args(
        experts, lora, activation, hidden_states, gpu_experts_mask
    )
    return torch.ops.kt.moe_forward_train.default(*args)


def moe_backward(
    grad_output: Tensor,
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    experts: ExpertWeights,
    lora: Optional[LoRAWeights] = None,
    *,
    activation: str = DEFAULT_ACTIVATION,
    gate_pre: Optional[Tensor] = None,
    up_pre: Optional[Tensor] = None,
    compute_grad_hidden_states: bool = True,
    gpu_experts_mask: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, LoRAWeights]:
    """``torch.ops.kt.moe_backward``: gradients of :func:`moe_forward`; autograd calls it for you.

    ``grad_output`` is ``[T, H]`` (fp32/bf16/fp16); ``gate_pre``/``up_pre`` are
    the pre-activations of :func:`moe_forward_train` (``None``: recomputed).

    Returns ``(grad_hidden_states, grad_topk_weights, grad_lora)``:
    ``grad_hidden_states`` ``[T, H]`` (dtype of ``hidden_states``; an empty
    ``[0]`` tensor when ``compute_grad_hidden_states=False``),
    ``grad_topk_weights`` ``[T, K]`` (dtype of ``topk_weights``;
    ``d out[t] / d w[t, k] = <grad_output[t], expert_e(x_t)>``, 0 where the
    id is -1), and ``grad_lora``, a :class:`~kt_ops.layer.LoRAWeights` holding
    the gradient of each factor that ``lora`` has (shape and dtype of the
    factor; zero for experts that got no token). Base weights are frozen: no
    gradient for them. Per expert, the LoRA gradients accumulate in fp32; the
    products with the frozen base run on bf16 panels of the weights (bf16 hidden
    states and ``grad_output`` on AVX512_BF16 / AMX CPUs: the exact values, or hi +
    lo within 2^-17 of them) or on fp32 sgemm (docs/lora.md); results are
    bit-identical for any thread count.

    Raises what :func:`moe_forward` raises for its arguments, and RuntimeError
    for a ``grad_output`` of another shape, dtype or device, or
    ``gate_pre``/``up_pre`` that are not both given or not fp32 ``[T*K, I]``.
    """
    args = (grad_output, hidden_states, topk_ids, topk_weights) + layer_args(
        experts, lora, activation, hidden_states, gpu_experts_mask
    )
    gx, gw, grad_lora = torch.ops.kt.moe_backward.default(
        *args,
        gate_pre=gate_pre,
        up_pre=up_pre,
        compute_grad_hidden_states=compute_grad_hidden_states,
    )
    lora = lora if lora is not None else LoRAWeights()
    grads = [g if t is not None else None for g, t in zip(grad_lora, lora.factors())]
    return gx, gw, lora.with_factors(grads) if grad_lora else LoRAWeights(scaling=lora.scaling)


# --------------------------------------------------------------------------
# Fake (meta) kernels
# --------------------------------------------------------------------------


def _signature_of(op) -> inspect.Signature:
    """An op overload's schema as a Python signature (keyword-only arguments included)."""
    params = []
    for a in op._schema.arguments:
        kind = (
            inspect.Parameter.KEYWORD_ONLY
            if a.kwarg_only
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        default = a.default_value if a.has_default_value() else inspect.Parameter.empty
        params.append(inspect.Parameter(a.name, kind, default=default))
    return inspect.Signature(params)


#: The schema of kt::moe_forward as a Python signature: the fake kernels bind
#: their arguments with it instead of spelling the list out again.
_FORWARD_SIGNATURE = _signature_of(torch.ops.kt.moe_forward.default)


def _bind(*args, **kwargs) -> dict:
    """The arguments of a ``kt::moe_forward``-like call by name, defaults included.

    The dispatcher drops trailing arguments equal to their defaults
    (``lora_scaling``, ``activation``), so the fake kernels fill them back in.
    """
    bound = _FORWARD_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _as_trace_check(check, *args) -> None:
    """Run one of the op's own C++ checks (shape-only mode, on meta stand-ins) and raise
    its failure as ``torch._check`` does, with the eager op's message (without the C++
    backtrace)."""
    try:
        check(*args)
    except (RuntimeError, ValueError) as err:
        torch._check(False, lambda err=err: str(err).split("\nException raised from")[0])


def _check_fake_layer(op: str, bound: dict) -> ExpertWeights:
    """The fake kernels' share of the op's checks; returns the layer's experts.

    Ranks, shapes, dtypes, layouts, formats, LoRA factors, the activation: the op's
    own checks (``moe::parse_moe_layer`` in shape-only mode, through
    ``kt_ops._C.check_layer_shapes``) on meta stand-ins of the traced tensors, so a
    compiled graph fails at trace time with the eager op's message. Devices are
    checked here: with CUDA hidden states (the CUDA-stream bridge) the packed
    weights stay on the CPU and everything else is on the GPU.
    """
    x, ids, w = bound["hidden_states"], bound["topk_ids"], bound["topk_weights"]
    mask = bound.get("gpu_experts_mask")
    _as_trace_check(
        _C.check_layer_shapes,
        op,
        _meta(x),
        _meta(ids),
        _meta(w),
        [_meta(t) for t in bound["weights"]],
        bound["weight_format"],
        list(bound["sizes"]),
        list(bound["group_sizes"]),
        [_meta(t) for t in bound["lora"]],
        float(bound["lora_scaling"]),
        bound["activation"],
        _meta(mask),
    )
    experts = ExpertWeights.from_op_args(
        bound["weights"], bound["weight_format"], bound["sizes"], bound["group_sizes"]
    )
    lora = LoRAWeights.from_op_args(bound["lora"], bound["lora_scaling"])
    # A meta tensor mixed with real ones also lands here: name the odd one out
    # instead of returning an uninitialized tensor. With CUDA hidden states (the
    # CUDA-stream bridge) the packed weights stay on the CPU and everything else
    # is on the GPU.
    packed_device = torch.device("cpu") if x.device.type == "cuda" else x.device
    named = {}
    for name, p in zip(PROJECTIONS, experts.projections):
        named.update({f"{name}_{k}": (t, packed_device) for k, t in p.tensors().items()})
        if p.bias is not None:
            named[f"{name}_bias"] = (p.bias, packed_device)
    for name, t in zip(PROJECTIONS, experts.backward_panels or ()):
        if t is not None:
            named[f"{name}_backward_panels"] = (t, packed_device)
    named.update({"topk_ids": (ids, x.device), "topk_weights": (w, x.device)})
    factor_names = (f"{p}_lora_{f}" for p in PROJECTIONS for f in ("a", "b"))
    named.update({n: (t, x.device) for n, t in zip(factor_names, lora.factors()) if t is not None})
    if mask is not None:
        named["gpu_experts_mask"] = (mask, x.device)
    for name, (t, device) in named.items():
        torch._check(
            t.device == device,
            lambda name=name, t=t, device=device: (
                f"{op}: {name} is on {t.device} but must be on {device} (hidden_states is "
                f"on {x.device}; the packed expert weights live on the CPU)"
            ),
        )
    return experts


def _concrete(n) -> int:
    """A size as an int: a symbolic one (torch.compile's dynamic shapes) by its hint, so
    checking it installs no guard (the relations the op checks hold for any value)."""
    if isinstance(n, torch.SymInt):
        hint = n.node.hint
        return int(hint) if hint is not None else 1
    return int(n)


def _meta(t: Optional[Tensor]) -> Optional[Tensor]:
    """A real meta tensor of ``t``'s dtype, sizes and strides (contiguous where ``t``'s
    sizes are symbolic), for the C++ checks, which read concrete sizes."""
    if t is None:
        return None
    sizes = [_concrete(n) for n in t.shape]
    if any(isinstance(n, torch.SymInt) for n in t.shape):
        strides = [1] * len(sizes)
        for i in range(len(sizes) - 2, -1, -1):
            strides[i] = strides[i + 1] * max(sizes[i + 1], 1)
    else:
        strides = [_concrete(n) for n in t.stride()]
    with unset_fake_temporarily():
        return torch.empty_strided(sizes, strides, dtype=t.dtype, device="meta")


@torch.library.register_fake("kt::moe_forward")
def _moe_forward_fake(*args, **kwargs):
    bound = _bind(*args, **kwargs)
    _check_fake_layer("kt.moe_forward", bound)
    x = bound["hidden_states"]
    return x.new_empty(x.shape)


@torch.library.register_fake("kt::moe_forward.out")
def _moe_forward_out_fake(*args, out, **kwargs):
    bound = _bind(*args, **kwargs)
    _check_fake_layer("kt.moe_forward", bound)
    x = bound["hidden_states"]
    torch._check(
        out.device == x.device,
        lambda: f"kt.moe_forward: out is on {out.device} but hidden_states is on {x.device}",
    )
    torch._check(
        out.dtype == x.dtype,
        lambda: (
            f"kt.moe_forward: out must have the dtype of hidden_states ({x.dtype}), got {out.dtype}"
        ),
    )
    torch._check(
        out.shape == x.shape and out.is_contiguous(),
        lambda: (
            "kt.moe_forward: out must be a contiguous tensor of the shape of hidden_states "
            f"{list(x.shape)}, got {list(out.shape)}"
        ),
    )


@torch.library.register_fake("kt::moe_forward_train")
def _moe_forward_train_fake(*args, **kwargs):
    bound = _bind(*args, **kwargs)
    experts = _check_fake_layer("kt.moe_forward_train", bound)
    x = bound["hidden_states"]
    pre = (x.shape[0] * bound["topk_ids"].shape[1], experts.intermediate_size)
    return (
        x.new_empty(x.shape),
        x.new_empty(pre, dtype=torch.float32),
        x.new_empty(pre, dtype=torch.float32),
    )


class _FakePreparedLayer:
    """The fake class of ``torch.classes.kt.PreparedLayer``, for tracing (torch >= 2.5).

    Built from the real object's ``__obj_flatten__`` (num_experts, hidden_size,
    top_k): all the fake kernel of ``kt::moe_forward_prepared`` needs.
    """

    def __init__(self, num_experts: int, hidden_size: int, top_k: int) -> None:
        self._sizes = (num_experts, hidden_size, top_k)

    @classmethod
    def __obj_unflatten__(cls, flat):
        return cls(**dict(flat))

    def num_experts(self) -> int:
        return self._sizes[0]

    def hidden_size(self) -> int:
        return self._sizes[1]

    def top_k(self) -> int:
        return self._sizes[2]

    def __len__(self) -> int:  # as the real class (torch's schema check probes len())
        return 0


if hasattr(torch._library, "register_fake_class"):  # torch 2.4: the op is not traced
    torch._library.register_fake_class("kt::PreparedLayer")(_FakePreparedLayer)


@torch.library.register_fake("kt::moe_forward_prepared")
def _moe_forward_prepared_fake(layer, hidden_states, topk_ids, topk_weights):
    op = "kt.moe_forward"
    x, ids, w = hidden_states, topk_ids, topk_weights
    torch._check(x.dim() == 2, lambda: f"{op}: hidden_states must be 2-D [T, H]")
    H = layer.hidden_size()
    torch._check(
        x.shape[1] == H,
        lambda: f"{op}: hidden_states has {x.shape[1]} columns but the experts' hidden_size is {H}",
    )
    torch._check(
        ids.dim() == 2 and ids.shape[0] == x.shape[0],
        lambda: f"{op}: topk_ids must be [T={x.shape[0]}, K], got {list(ids.shape)}",
    )
    torch._check(
        w.shape == ids.shape,
        lambda: f"{op}: topk_weights must have the shape of topk_ids {list(ids.shape)}",
    )
    k = layer.top_k()
    torch._check(
        k <= 0 or ids.shape[1] == k,
        lambda: f"kt.moe_forward_prepared: topk_ids has {ids.shape[1]} columns, top_k={k}",
    )
    return x.new_empty(x.shape)


#: kt::moe_backward's schema as a Python signature (the dispatcher may pass
#: gate_pre, up_pre and compute_grad_hidden_states positionally).
_BACKWARD_SIGNATURE = _signature_of(torch.ops.kt.moe_backward.default)


@torch.library.register_fake("kt::moe_backward")
def _moe_backward_fake(*args, **kwargs):
    full = _BACKWARD_SIGNATURE.bind(*args, **kwargs)
    full.apply_defaults()
    bound = dict(full.arguments)
    grad_output = bound.pop("grad_output")
    gate_pre, up_pre = bound.pop("gate_pre"), bound.pop("up_pre")
    compute_grad_hidden_states = bound.pop("compute_grad_hidden_states")
    experts = _check_fake_layer("kt.moe_backward", bound)
    x = bound["hidden_states"]
    # Devices here (the saved tensors on the device of hidden_states: the CPU, or the GPU
    # through the CUDA-stream bridge); shapes, dtypes, layouts and pairing by the eager
    # op's own checks on meta stand-ins.
    for name, t in (("grad_output", grad_output), ("gate_pre", gate_pre), ("up_pre", up_pre)):
        torch._check(
            t is None or t.device == x.device,
            lambda name=name, t=t: f"kt.moe_backward: {name} is on {t.device}, not {x.device}",
        )
    _as_trace_check(
        _C.check_backward_shapes,
        experts.intermediate_size,
        _meta(grad_output),
        _meta(x),
        _meta(bound["topk_ids"]),
        _meta(gate_pre),
        _meta(up_pre),
    )
    lora = LoRAWeights.from_op_args(bound["lora"], bound["lora_scaling"])
    empty = x.new_empty((0,))
    grad_lora = (
        []
        if not bound["lora"]
        else [t.new_empty(t.shape) if t is not None else x.new_empty((0,)) for t in lora.factors()]
    )
    return (
        x.new_empty(x.shape) if compute_grad_hidden_states else empty,
        bound["topk_weights"].new_empty(bound["topk_weights"].shape),
        grad_lora,
    )


# --------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------
# In C++ (csrc/ops/moe_autograd.cpp): an inference call goes from the
# dispatcher to the CPU kernel without entering Python. It saves what
# set_lora_activation_checkpointing says, refuses packed weights that require
# grad under grad mode, and makes a second-order backward raise.


def _check_frozen(weights) -> None:
    """Refuse packed base weights that require grad (the ``out=`` path has no autograd kernel)."""
    for i, t in enumerate(weights):
        if t is not None and t.requires_grad:
            name = (
                f"{PROJECTIONS[i // 3]}_{('weight', 'scales', 'zeros')[i % 3]}"
                if i < 9
                else f"{PROJECTIONS[i - 9]}_bias"
            )
            raise RuntimeError(
                f"kt.moe_forward: {name} requires grad, but the base expert weights are frozen "
                "(kt.moe_backward computes gradients only for hidden_states, topk_weights and "
                "the LoRA factors); call .requires_grad_(False) on it, or pass LoRA factors to "
                "fine-tune the experts"
            )
