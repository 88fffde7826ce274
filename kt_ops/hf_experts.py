"""The experts modules of a Hugging Face ``transformers`` MoE model, as kt_ops sees them.

:func:`find_experts` walks a model and describes each experts module
(:class:`ExpertsInfo`) or refuses it with :class:`UnsupportedExpertsError`,
naming the module, its class and the reason. Two layouts are recognised (the
module docstring of :mod:`kt_ops.hf` describes both): fused 3-D
``gate_up_proj``/``down_proj`` parameters (transformers >= 5; with gpt-oss's
per-expert biases and clamped SwiGLUs) and an
``nn.ModuleList`` of bias-free gated MLPs. Also the dense views of their
weights (``[E, I, H]`` gate/up, ``[E, H, I]`` down) that the replacement packs.
:mod:`kt_ops.hf` replaces them; :mod:`kt_ops.routing_stats` counts their hits.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from kt_ops.layer import ACTIVATIONS, DEFAULT_ACTIVATION, activation_spec
from kt_ops.nn import MoEExperts

__all__ = ["ExpertsInfo", "UnsupportedExpertsError", "find_experts"]

#: Names of the (gate, up, down) nn.Linear layers of one expert MLP, per naming style.
_MLP_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class UnsupportedExpertsError(ValueError):
    """An MoE experts module (or model) that kt_ops cannot run; the message says which and why."""


@dataclass(frozen=True)
class ExpertsInfo:
    """One experts module of a model, as :func:`find_experts` sees it.

    Attributes:
        name: qualified module name in the model (``model.layers.0.mlp.experts``).
        class_name: class of the module (``Qwen3MoeExperts``, ``ModuleList``...).
        layout: ``'fused'`` (3-D ``gate_up_proj``/``down_proj``), ``'stacked'`` (DBRX's
            2-D ``mlp.w1``/``v1``/``w2``, ``[E*I, H]`` each, called as fused experts
            are), ``'jetmoe'`` (JetMoE's whole MoE block, replaced by a
            :class:`JetMoeBlock`), ``'llama4'`` (Llama 4's whole MoE block, replaced by a
            :class:`Llama4MoeBlock`) or ``'module_list'``.
        concatenated: gate rows then up rows (``True``) or interleaved (``False``); fused only.
        transposed: weights stored ``[E, in, out]``; fused only.
        num_experts, hidden_size, intermediate_size: ``E``, ``H``, ``I``.
        activation: the experts' GLU as the ops take it (:data:`kt_ops.ACTIVATIONS`, or
            a spec with gpt-oss-style clamps, :func:`kt_ops.activation_spec`): the most
            likely of ``glu_candidates``; :func:`kt_ops.replace_experts` keeps the
            first one its probe confirms.
        biased: fused only: per-expert biases ``gate_up_proj_bias`` / ``down_proj_bias``
            (gpt-oss).
        glu_candidates: the GLUs the module's attributes allow, most likely first.
        identity_experts: fused only: zero-computation experts after the ``num_experts``
            real ones (LongCat-Flash's ``zero_expert_num``: ids ``E ..`` return their input).
        non_gated: fused only: ``down(relu(up(x))^2)`` experts without a gate projection
            (NemotronH's ``has_gate=False`` with ``relu2``), run as the GLU ``relu`` with the
            gate a copy of up: ``relu(u) * u = relu(u)^2``. Their LoRA is refused (an
            adapter on up would not reach the gate's copy).
        post_expert_norm: fused only: a norm module ``post_expert_norm`` applied to each
            expert's output before its routing weight (MuseSpark's
            ``has_post_expert_norm=True``); replaced by a :class:`PostNormExperts`.
    """

    name: str
    class_name: str
    layout: str
    concatenated: bool
    transposed: bool
    num_experts: int
    hidden_size: int
    intermediate_size: int
    activation: str = DEFAULT_ACTIVATION
    biased: bool = False
    glu_candidates: tuple[str, ...] = ()
    identity_experts: int = 0
    non_gated: bool = False
    post_expert_norm: bool = False


@dataclass
class _Plan:
    info: ExpertsInfo
    module: nn.Module
    parent: nn.Module
    attr: str


# --------------------------------------------------------------------------------------------
# Recognising experts modules
# --------------------------------------------------------------------------------------------


def _is_3d(t: object) -> bool:
    return isinstance(t, Tensor) and t.dim() == 3


def _is_2d(t: object) -> bool:
    return isinstance(t, Tensor) and t.dim() == 2


def _is_fused_experts(module: nn.Module) -> bool:
    decorated = hasattr(module, "has_gate") and hasattr(module, "is_transposed")
    has_weights = _is_3d(getattr(module, "gate_up_proj", None)) and _is_3d(
        getattr(module, "down_proj", None)
    )
    return decorated or has_weights


def _is_jetmoe_block(module: nn.Module) -> bool:
    """JetMoE's MoE block: ``input_linear`` / ``output_linear`` parallel experts (3-D
    ``weight`` ``[E, 2I, H]`` / ``[E, H, I]``), a top-k ``router``, a shared output ``bias``
    and an ``activation``; called as ``block(hidden_states)``."""
    w_in = getattr(getattr(module, "input_linear", None), "weight", None)
    w_out = getattr(getattr(module, "output_linear", None), "weight", None)
    router = getattr(module, "router", None)
    return (
        _is_3d(w_in)
        and _is_3d(w_out)
        and hasattr(module, "activation")
        and isinstance(getattr(router, "layer", None), nn.Linear)
        and isinstance(getattr(router, "top_k", None), int)
        and w_in.shape[1] == 2 * w_out.shape[2]
    )


def _plan_jetmoe(name: str, module: nn.Module) -> ExpertsInfo:
    where = _where(name, module)
    w_in, w_out = module.input_linear.weight, module.output_linear.weight
    E, two_i, H = w_in.shape
    if tuple(w_out.shape) != (E, H, two_i // 2):
        raise UnsupportedExpertsError(
            f"{where}: input_linear.weight {tuple(w_in.shape)} and output_linear.weight "
            f"{tuple(w_out.shape)} are not [E, 2I, H] and [E, H, I]"
        )
    bias = getattr(module, "bias", None)
    if not (isinstance(bias, Tensor) and tuple(bias.shape) == (H,)):
        raise UnsupportedExpertsError(f"{where}: expected an output bias [H={H}], got {bias!r}")
    activation = _kt_activation(module.activation)
    if activation is None:
        raise UnsupportedExpertsError(
            f"{where}: activation {_act_name(module, module.activation)} is not supported"
        )
    _check_materialized(where, [w_in, w_out])
    return ExpertsInfo(
        name, type(module).__name__, "jetmoe", True, False, E, H, two_i // 2, activation,
        glu_candidates=(activation,),
    )  # fmt: skip


class ExpertsWrapper(nn.Module):
    """A replacement that wraps a :class:`kt_ops.nn.MoEExperts` (``kt_experts``) in the
    parts of the original module kt_ops does not compute (a router, a norm)."""

    kt_experts: MoEExperts


def per_slot_outputs(experts: MoEExperts, x: Tensor, top_k_index: Tensor) -> Tensor:
    """Each routed expert's own output, unweighted: ``[T, k, H]`` from ``x`` ``[T, H]`` or
    ``[T, k, H]`` (a different input per slot) and ``top_k_index`` ``[T, k]``.

    Runs the ``T * k`` (token, slot) pairs as tokens of their own, each routed to its one
    expert with weight 1 (exact: the same products as the weighted call, the weighting
    left to the caller), for blocks that act on an expert's output before weighting it.
    """
    T, k = top_k_index.shape
    rows = x.reshape(T * k, -1) if x.dim() == 3 else x.repeat_interleave(k, dim=0)
    ones = torch.ones(T * k, 1, dtype=rows.dtype, device=rows.device)
    return experts(rows, top_k_index.reshape(T * k, 1), ones).view(T, k, -1)


class PostNormExperts(ExpertsWrapper):
    """Experts with a norm after each expert (MuseSpark's ``has_post_expert_norm``):
    ``sum_k w_k * norm(expert_k(x))``, the experts on kt_ops (:func:`per_slot_outputs`),
    the original ``post_expert_norm`` module (kept, with its weight) in PyTorch.

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.
    """

    def __init__(self, experts: MoEExperts, post_expert_norm: nn.Module) -> None:
        super().__init__()
        self.kt_experts = experts
        self.post_expert_norm = post_expert_norm

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        out = self.post_expert_norm(per_slot_outputs(self.kt_experts, hidden_states, top_k_index))
        return (out * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(dim=1).to(hidden_states.dtype)


class JetMoeBlock(ExpertsWrapper):
    """JetMoE's MoE block with its experts on kt_ops: the block's own router (kept, so
    ``output_router_logits`` still records its logits) and output bias around a
    :class:`kt_ops.nn.MoEExperts` (``kt_experts``) of ``input_linear`` (gate rows, then
    up rows) and ``output_linear``.

    ``forward(layer_input [B, S, H]) -> [B, S, H]``: the router's top-k of its logits,
    softmax over them (``type_as`` the input, as JetMoE's ``JetMoeTopKGating``), the
    weighted experts, plus the bias.
    """

    def __init__(self, block: nn.Module, experts: nn.Module) -> None:
        super().__init__()
        self.router = block.router
        self.bias = block.bias
        self.kt_experts = experts

    def forward(self, layer_input: Tensor) -> Tensor:
        shape = layer_input.shape
        x = layer_input.reshape(-1, shape[-1])
        logits = self.router(x)[4]  # (.., router_logits): what the output recorder reads
        top_logits, top_ids = logits.topk(self.router.top_k, dim=1)
        gates = torch.softmax(top_logits, dim=1).type_as(x)
        return self.kt_experts(x, top_ids, gates).view(shape) + self.bias


def _is_llama4_block(module: nn.Module) -> bool:
    """Llama 4's MoE block: ``experts`` with transposed 3-D ``gate_up_proj`` ``[E, H, 2I]`` /
    ``down_proj`` ``[E, I, H]`` called as ``experts(routed_in)`` on every expert's copy of the
    tokens, each already scaled by its routing score (``Llama4TextMoe``); a top-k
    ``router`` (an ``nn.Linear`` returning ``(scores, logits)``) and a ``shared_expert``."""
    experts = getattr(module, "experts", None)
    router = getattr(module, "router", None)
    if not (
        isinstance(experts, nn.Module)
        and _is_3d(getattr(experts, "gate_up_proj", None))
        and _is_3d(getattr(experts, "down_proj", None))
        and isinstance(router, nn.Linear)
        and isinstance(getattr(router, "top_k", None), int)
        and isinstance(getattr(module, "shared_expert", None), nn.Module)
    ):
        return False
    try:  # called with the routed tokens alone: forward(self, hidden_states)
        params = inspect.signature(type(experts).forward).parameters
    except (TypeError, ValueError):
        return False
    return len(params) == 2


def _extra_tensors(module: nn.Module, allowed: tuple[str, ...]) -> list[str]:
    """The module's parameters and buffers other than ``allowed`` (what kt_ops would ignore)."""
    return sorted(
        n
        for n, _ in list(module.named_parameters()) + list(module.named_buffers())
        if n not in allowed
    )


def _plan_llama4(name: str, module: nn.Module) -> ExpertsInfo:
    where = _where(name, module)
    experts = module.experts
    gate_up, down = experts.gate_up_proj, experts.down_proj
    E, H, two_i = gate_up.shape
    if tuple(down.shape) != (E, two_i // 2, H) or two_i % 2:
        raise UnsupportedExpertsError(
            f"{where}: experts.gate_up_proj {tuple(gate_up.shape)} and experts.down_proj "
            f"{tuple(down.shape)} are not [E, H, 2I] and [E, I, H]"
        )
    extra = _extra_tensors(experts, ("gate_up_proj", "down_proj"))
    if extra:
        raise UnsupportedExpertsError(
            f"{where}: experts have tensors {extra} besides gate_up_proj/down_proj"
        )
    act = getattr(experts, "act_fn", None)
    activation = _kt_activation(act)
    if activation is None:
        raise UnsupportedExpertsError(
            f"{where}: activation {_act_name(experts, act)} is not supported"
        )
    _check_materialized(where, [gate_up, down])
    return ExpertsInfo(
        name, type(module).__name__, "llama4", True, True, E, H, two_i // 2, activation,
        glu_candidates=(activation,),
    )  # fmt: skip


class Llama4MoeBlock(ExpertsWrapper):
    """Llama 4's MoE block with its experts on kt_ops: the block's own ``router`` and
    ``shared_expert`` (kept) around a :class:`kt_ops.nn.MoEExperts` (``kt_experts``).

    Llama 4 scales each routed expert's *input* by its routing score (``sigmoid`` of the
    top-k router logits): ``sum_k expert_k(s_k * x)``, not ``sum_k s_k * expert_k(x)``. The
    block therefore runs the ``T * top_k`` scaled copies of the tokens as tokens of their
    own, each routed to its one expert with weight 1, and sums the ``top_k`` outputs of
    each token: the same products as the original's dense ``bmm`` over all ``E`` experts,
    without the ``E - top_k`` experts whose input is zero.

    ``forward(hidden_states [B, S, H]) -> (out [B*S, H], router_logits [B*S, E])``, as
    ``Llama4TextMoe``.
    """

    def __init__(self, block: nn.Module, experts: nn.Module) -> None:
        super().__init__()
        self.router = block.router
        self.shared_expert = block.shared_expert
        self.kt_experts = experts

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        scores, logits = self.router(x)
        k = self.router.top_k
        top_ids = torch.topk(logits, k, dim=1).indices  # the router's own top-k call
        scaled = x.unsqueeze(1) * scores.gather(1, top_ids).unsqueeze(-1)  # [T, k, H]
        routed = per_slot_outputs(self.kt_experts, scaled, top_ids)
        return self.shared_expert(x) + routed.sum(dim=1), logits


def _plan_non_gated(name: str, module: nn.Module) -> ExpertsInfo:
    """NemotronH's ``has_gate=False`` experts: ``down(act(up(x)))`` with 3-D ``up_proj``
    ``[E, I, H]`` and ``down_proj`` ``[E, H, I]``; served for ``act = relu2`` only."""
    where = _where(name, module)
    act = getattr(module, "act_fn", None)
    if type(act).__name__ != "ReLUSquaredActivation":
        raise UnsupportedExpertsError(
            f"{where}: experts without a gate projection (has_gate=False) with activation "
            f"{_act_name(module, act)}: kt_ops serves them for relu2 only (as relu(u) * u); "
            "other non-gated activations are not supported"
        )
    up, down = getattr(module, "up_proj", None), getattr(module, "down_proj", None)
    if not (_is_3d(up) and _is_3d(down)):
        raise UnsupportedExpertsError(
            f"{where}: expected 3-D tensors up_proj and down_proj, got up_proj={_describe(up)}, "
            f"down_proj={_describe(down)}"
        )
    transposed = bool(getattr(module, "is_transposed", False))
    E = up.shape[0]
    inter, H = (up.shape[2], up.shape[1]) if transposed else (up.shape[1], up.shape[2])
    want_down = (E, inter, H) if transposed else (E, H, inter)
    if tuple(down.shape) != want_down or getattr(module, "has_bias", False):
        raise UnsupportedExpertsError(
            f"{where}: up_proj {tuple(up.shape)} and down_proj {tuple(down.shape)} are not "
            f"[E, I, H] and [E, H, I] without biases (is_transposed={transposed})"
        )
    extra = _extra_tensors(module, ("up_proj", "down_proj"))
    if extra:
        raise UnsupportedExpertsError(
            f"{where}: has tensors {extra} besides up_proj/down_proj that kt_ops would ignore"
        )
    _check_materialized(where, [up, down])
    return ExpertsInfo(
        name, type(module).__name__, "fused", True, transposed, E, H, inter, "relu",
        glu_candidates=("relu",), non_gated=True,
    )  # fmt: skip


#: transformers' activation classes (transformers.activations.ACT2CLS) by kt_ops' name.
_HF_ACTIVATIONS = {
    "SiLUActivation": "silu",  # "silu"
    "GELUActivation": "gelu",  # "gelu", "gelu_python": erf
    "GELUTanh": "gelu_tanh",  # "gelu_pytorch_tanh", "gelu_python_tanh"
    "NewGELUActivation": "gelu_tanh",  # "gelu_new": the same tanh formula
    "FastGELUActivation": "gelu_tanh",  # "gelu_fast"
    "AccurateGELUActivation": "gelu_tanh",  # "gelu_accurate"
}


def _kt_activation(act: object) -> Optional[str]:
    """kt_ops' name (:data:`kt_ops.ACTIVATIONS`) of an experts' ``act_fn``, or None.

    The replacement's probe (``_check_replacement``) then checks the numbers.
    """
    if act is torch.nn.functional.silu or isinstance(act, nn.SiLU):
        return "silu"
    if act is torch.nn.functional.gelu:
        return "gelu"
    if isinstance(act, nn.GELU):
        return "gelu_tanh" if act.approximate == "tanh" else "gelu"
    if act is torch.relu or act is torch.nn.functional.relu or isinstance(act, nn.ReLU):
        return "relu"  # ReGLU
    return _HF_ACTIVATIONS.get(type(act).__name__)


def _softcapped_swiglu(act: object) -> Optional[str]:
    """Inkling2's ``act_fn(gate, up)``: ``softcap(g) * sigmoid(g) * softcap(u)`` with
    ``gate_softcap`` / ``up_softcap`` modules holding ``softcap``, as an ``activation`` spec."""
    if type(act).__name__ != "Inkling2SoftcappedSwiGLU":
        return None
    caps = {}
    for key in ("gate_softcap", "up_softcap"):
        c = getattr(getattr(act, key, None), "softcap", None)
        if isinstance(c, (int, float)) and not isinstance(c, bool) and c > 0 and math.isfinite(c):
            caps[key] = float(c)
    return activation_spec("silu", **caps) if caps else None


def _scalar_attr(module: nn.Module, *names: str) -> Optional[float]:
    for name in names:
        v = getattr(module, name, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _glu_candidates(module: nn.Module, activation: str) -> tuple[str, ...]:
    """The GLUs a fused experts module may compute, most likely first.

    transformers' clamped SwiGLUs keep their constants as attributes: ``alpha`` /
    ``swiglu_alpha`` with ``limit`` / ``swiglu_limit`` is gpt-oss's (and
    MiniMax-M3's) ``(clamp(u) + 1) * g sigmoid(alpha g)``; a ``limit`` alone clamps
    before the activation (DeepSeek-V4, GLM-5-Next, HY-V4) or after it (Step-3.7).
    The attributes cannot tell those apart, so the replacement's probe, whose
    pre-activations reach any such clamp, tries each in turn.
    """
    limit = _scalar_attr(module, "limit", "swiglu_limit")
    alpha = _scalar_attr(module, "alpha", "swiglu_alpha")
    clamp = limit if limit is not None and math.isfinite(limit) and limit > 0 else None
    specs = []
    if alpha is not None and alpha > 0 and activation == "silu":
        specs.append(activation_spec("silu", alpha=alpha, limit=clamp, up_offset=1.0))
    if clamp is not None:
        specs += [activation_spec(activation, limit=clamp)]
        specs += [activation_spec(activation, act_limit=clamp)]
    specs.append(activation)
    return tuple(dict.fromkeys(specs))


def _act_name(module: nn.Module, act: object) -> str:
    config = getattr(module, "config", None)
    hidden_act = getattr(config, "hidden_act", None)
    suffix = f", config.hidden_act={hidden_act!r}" if hidden_act is not None else ""
    return f"{type(act).__name__}{suffix}"


def _where(name: str, module: nn.Module) -> str:
    return f"{type(module).__name__} at '{name}'"


def _check_materialized(where: str, tensors: list[Tensor]) -> None:
    for t in tensors:
        if t.device.type == "meta":
            raise UnsupportedExpertsError(
                f"{where}: the expert weights are on the meta device (not loaded); "
                "load or initialize the model before replace_experts"
            )
        if not t.is_floating_point():
            raise UnsupportedExpertsError(
                f"{where}: expert weights of dtype {t.dtype} (quantized?) are not supported; "
                "kt_ops packs floating-point weights"
            )


def _plan_fused(name: str, module: nn.Module) -> ExpertsInfo:
    where = _where(name, module)
    if not getattr(module, "has_gate", True):
        return _plan_non_gated(name, module)
    biased = bool(getattr(module, "has_bias", False))
    bias_names = ("gate_up_proj_bias", "down_proj_bias") if biased else ()
    if biased and not all(_is_2d(getattr(module, n, None)) for n in bias_names):
        raise UnsupportedExpertsError(
            f"{where}: has_bias=True without 2-D gate_up_proj_bias [E, 2I] and down_proj_bias "
            f"[E, H] (got {[_describe(getattr(module, n, None)) for n in bias_names]})"
        )
    post_norm = bool(getattr(module, "has_post_expert_norm", False))
    norm_names: tuple[str, ...] = ()
    if post_norm:
        norm = getattr(module, "post_expert_norm", None)
        if not isinstance(norm, nn.Module):
            raise UnsupportedExpertsError(
                f"{where}: has_post_expert_norm=True without a post_expert_norm module"
            )
        norm_names = tuple(
            f"post_expert_norm.{n}"
            for n, _ in list(norm.named_parameters()) + list(norm.named_buffers())
        )
    act = getattr(module, "act_fn", None)
    activation = DEFAULT_ACTIVATION if act is None else _kt_activation(act)
    softcapped = _softcapped_swiglu(act)
    if activation is None and softcapped is None:
        raise UnsupportedExpertsError(
            f"{where}: activation {_act_name(module, act)} is not supported; kt_ops experts "
            f"compute act(gate(x)) * up(x) with act one of {list(ACTIVATIONS)}"
        )
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (_is_3d(gate_up) and _is_3d(down)):
        raise UnsupportedExpertsError(
            f"{where}: expected 3-D tensors gate_up_proj and down_proj, got "
            f"gate_up_proj={_describe(gate_up)}, down_proj={_describe(down)}"
        )
    extra = _extra_tensors(module, ("gate_up_proj", "down_proj", *bias_names, *norm_names))
    if extra:
        raise UnsupportedExpertsError(
            f"{where}: has tensors {extra} besides gate_up_proj/down_proj (quantization "
            "scales, biases or norms) that kt_ops would ignore"
        )
    _check_materialized(where, [gate_up, down, *(getattr(module, n) for n in bias_names)])
    transposed = bool(getattr(module, "is_transposed", False))
    concatenated = bool(getattr(module, "is_concatenated", True))
    E = gate_up.shape[0]
    # LongCat-Flash: gate_up_proj has rows for its zero-computation experts too.
    routed, zero = (
        getattr(module, "num_routed_experts", None),
        getattr(module, "zero_expert_num", 0),
    )
    identity = 0
    if isinstance(routed, int) and isinstance(zero, int) and zero > 0 and E == routed + zero:
        E, identity = routed, zero
    if transposed:
        H, two_i = gate_up.shape[1:]
        inter, h_down = down.shape[1:]
    else:
        two_i, H = gate_up.shape[1:]
        h_down, inter = down.shape[1:]
    if down.shape[0] != E or two_i != 2 * inter or h_down != H:
        layout = "[E, H, 2I] and [E, I, H]" if transposed else "[E, 2I, H] and [E, H, I]"
        raise UnsupportedExpertsError(
            f"{where}: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} "
            f"are not {layout} (is_transposed={transposed})"
        )
    if biased:
        gub, db = module.gate_up_proj_bias, module.down_proj_bias
        if tuple(gub.shape) != (E, 2 * inter) or tuple(db.shape) != (E, H):
            raise UnsupportedExpertsError(
                f"{where}: gate_up_proj_bias {tuple(gub.shape)} and down_proj_bias "
                f"{tuple(db.shape)} are not [E, 2I] = {[E, 2 * inter]} and [E, H] = {[E, H]}"
            )
    candidates = (softcapped,) if softcapped else _glu_candidates(module, activation)
    return ExpertsInfo(
        name,
        type(module).__name__,
        "fused",
        concatenated,
        transposed,
        E,
        H,
        inter,
        candidates[0],
        biased,
        candidates,
        identity,
        post_expert_norm=post_norm,
    )


def _is_stacked_experts(module: nn.Module) -> bool:
    """DBRX's experts: ``mlp.w1`` (gate), ``mlp.v1`` (up), ``mlp.w2`` (down^T), 2-D
    ``[E*I, H]`` parameters stacked over the experts."""
    mlp = getattr(module, "mlp", None)
    return isinstance(mlp, nn.Module) and all(
        _is_2d(getattr(mlp, n, None)) for n in ("w1", "v1", "w2")
    )


def _plan_stacked(name: str, module: nn.Module) -> ExpertsInfo:
    where = _where(name, module)
    mlp = module.mlp
    w1, v1, w2 = mlp.w1, mlp.v1, mlp.w2
    E = getattr(module, "num_experts", None) or getattr(mlp, "moe_num_experts", None)
    inter = getattr(module, "ffn_hidden_size", None) or getattr(mlp, "ffn_hidden_size", None)
    H = w1.shape[1]
    if not isinstance(E, int) or not isinstance(inter, int) or E * inter != w1.shape[0]:
        raise UnsupportedExpertsError(
            f"{where}: mlp.w1 {tuple(w1.shape)} is not [num_experts * ffn_hidden_size, H] "
            f"(num_experts={E!r}, ffn_hidden_size={inter!r})"
        )
    if tuple(v1.shape) != tuple(w1.shape) or tuple(w2.shape) != tuple(w1.shape):
        raise UnsupportedExpertsError(
            f"{where}: mlp.w1, v1 and w2 must all be [E*I, H] = {tuple(w1.shape)}, got "
            f"{tuple(v1.shape)} and {tuple(w2.shape)}"
        )
    extra = sorted(
        n for n, _ in module.named_parameters() if n not in ("mlp.w1", "mlp.v1", "mlp.w2")
    )
    if extra:
        raise UnsupportedExpertsError(
            f"{where}: has tensors {extra} besides mlp.w1/v1/w2 that kt_ops would ignore"
        )
    _check_materialized(where, [w1, v1, w2])
    act = getattr(mlp, "activation_fn", None)
    activation = _kt_activation(act) if act is not None else DEFAULT_ACTIVATION
    if activation is None:
        raise UnsupportedExpertsError(
            f"{where}: activation {type(act).__name__} is not supported; kt_ops experts "
            f"compute act(gate(x)) * up(x) with act one of {list(ACTIVATIONS)}"
        )
    return ExpertsInfo(
        name, type(module).__name__, "stacked", True, False, E, H, inter, activation,
        glu_candidates=(activation,),
    )  # fmt: skip


def _describe(t: object) -> str:
    return f"tensor{tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__


def _mlp_linears(mlp: nn.Module) -> Optional[tuple[nn.Linear, nn.Linear, nn.Linear]]:
    for names in _MLP_NAMES:
        layers = [getattr(mlp, n, None) for n in names]
        if all(isinstance(layer, nn.Linear) for layer in layers):
            return tuple(layers)  # type: ignore[return-value]
    return None


def _plan_module_list(name: str, experts: nn.ModuleList) -> ExpertsInfo:
    where = _where(name, experts)
    first = experts[0]
    linears = _mlp_linears(first)
    if linears is None:
        raise UnsupportedExpertsError(
            f"{where}: the experts are {type(first).__name__} modules without bias-free nn.Linear "
            "layers gate_proj/up_proj/down_proj (or w1/w3/w2); kt_ops cannot read their weights"
        )
    inter, H = linears[0].weight.shape
    for i, mlp in enumerate(experts):
        where_i = f"{where}, expert {i} ({type(mlp).__name__})"
        if type(mlp) is not type(first):
            raise UnsupportedExpertsError(f"{where_i}: not of the class of expert 0")
        lin = _mlp_linears(mlp)
        if lin is None:
            raise UnsupportedExpertsError(f"{where_i}: missing gate/up/down nn.Linear layers")
        if any(layer.bias is not None for layer in lin):
            raise UnsupportedExpertsError(
                f"{where_i}: the expert projections have biases; kt_ops experts have no bias terms"
            )
        shapes = [tuple(layer.weight.shape) for layer in lin]
        if shapes != [(inter, H), (inter, H), (H, inter)]:
            raise UnsupportedExpertsError(
                f"{where_i}: projection shapes {shapes} differ from expert 0's "
                f"[(I, H), (I, H), (H, I)] with I={inter}, H={H}"
            )
        own = {id(layer.weight) for layer in lin}
        extra = sorted(
            n
            for n, t in list(mlp.named_parameters()) + list(mlp.named_buffers())
            if id(t) not in own
        )
        if extra:
            raise UnsupportedExpertsError(
                f"{where_i}: has tensors {extra} besides the three projection weights"
            )
        _check_materialized(where_i, [layer.weight for layer in lin])
    act = getattr(first, "act_fn", None)
    if act is None:
        raise UnsupportedExpertsError(
            f"{where}: the expert MLPs ({type(first).__name__}) have no act_fn attribute, so "
            "their activation cannot be checked"
        )
    activation = _kt_activation(act)
    if activation is None:
        raise UnsupportedExpertsError(
            f"{where}: activation {_act_name(first, act)} of {type(first).__name__} is not "
            f"supported; kt_ops experts compute act(gate(x)) * up(x) with act one of "
            f"{list(ACTIVATIONS)}"
        )
    for i, mlp in enumerate(experts):
        other = _kt_activation(getattr(mlp, "act_fn", None))
        if other != activation:
            raise UnsupportedExpertsError(
                f"{where}: expert {i} has activation "
                f"{_act_name(mlp, getattr(mlp, 'act_fn', None))} but expert 0 has "
                f"{_act_name(first, act)}; kt_ops runs one activation per layer"
            )
    return ExpertsInfo(
        name,
        type(experts).__name__,
        "module_list",
        True,
        False,
        len(experts),
        H,
        inter,
        activation,
    )


def _plan(model: nn.Module) -> tuple[list[_Plan], int]:
    """Find every experts module; raise on an unsupported one. Also counts converted ones."""
    plans: list[_Plan] = []
    already = 0
    modules = dict(model.named_modules())
    claimed: list[str] = []
    for name, module in modules.items():
        if any(name.startswith(prefix + ".") for prefix in claimed):
            continue
        if isinstance(module, MoEExperts):
            already += 1
            claimed.append(name)
            continue
        if isinstance(module, ExpertsWrapper):
            already += 1
            claimed.append(name)
            continue
        if name.rsplit(".", 1)[-1] == "experts" and isinstance(module, nn.ModuleList):
            if len(module) == 0:
                continue
            info = _plan_module_list(name, module)
        elif _is_jetmoe_block(module):
            info = _plan_jetmoe(name, module)
        elif _is_llama4_block(module):
            info = _plan_llama4(name, module)
        elif _is_fused_experts(module):
            info = _plan_fused(name, module)
        elif _is_stacked_experts(module):
            info = _plan_stacked(name, module)
        else:
            continue
        if not name:
            raise UnsupportedExpertsError(
                f"{type(model).__name__} is itself an experts module; replace it by "
                "kt_ops.nn.MoEExperts.from_dense(...) instead of replace_experts"
            )
        parent_name, _, attr = name.rpartition(".")
        plans.append(_Plan(info, module, modules[parent_name], attr))
        claimed.append(name)
    return plans, already


def find_experts(model: nn.Module) -> list[ExpertsInfo]:
    """The experts modules :func:`replace_experts` would replace, without changing ``model``.

    Returns:
        One :class:`ExpertsInfo` per experts module, in module order (empty if
        the model has none).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        UnsupportedExpertsError: an experts module is found that kt_ops cannot run.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"find_experts: expected a torch.nn.Module, got {type(model).__name__}")
    return [p.info for p in _plan(model)[0]]


# --------------------------------------------------------------------------------------------
# Dense views of their weights
# --------------------------------------------------------------------------------------------


def _dense_fused(module: nn.Module, info: ExpertsInfo) -> tuple[Tensor, Tensor, Tensor]:
    """(gate [E, I, H], up [E, I, H], down [E, H, I]) views of a fused experts module
    (non-gated experts: up twice, the gate a copy of it)."""
    if info.non_gated:
        up, down = module.up_proj.detach(), module.down_proj.detach()
        if info.transposed:
            up, down = up.transpose(1, 2), down.transpose(1, 2)
        return up, up, down
    gate_up = module.gate_up_proj.detach()[: info.num_experts]  # not the identity experts' rows
    down = module.down_proj.detach()
    if info.transposed:
        gate_up = gate_up.transpose(1, 2)  # [E, 2I, H]
        down = down.transpose(1, 2)  # [E, H, I]
    inter = info.intermediate_size
    if info.concatenated:
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
    else:
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    return gate, up, down


def _dense_biases(
    module: nn.Module, info: ExpertsInfo
) -> tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]]:
    """(gate [E, I], up [E, I], down [E, H]) biases of a fused experts module, or Nones."""
    if not info.biased:
        return None, None, None
    gate_up = module.gate_up_proj_bias.detach()
    inter = info.intermediate_size
    if info.concatenated:
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
    else:
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    return gate, up, module.down_proj_bias.detach()


def _dense_stacked(module: nn.Module, info: ExpertsInfo) -> tuple[Tensor, Tensor, Tensor]:
    """(gate [E, I, H], up [E, I, H], down [E, H, I]) views of DBRX's stacked experts
    (expert e computes ``(act(x w1_e^T) * x v1_e^T) w2_e``)."""
    E, inter, H = info.num_experts, info.intermediate_size, info.hidden_size
    mlp = module.mlp
    gate = mlp.w1.detach().view(E, inter, H)
    up = mlp.v1.detach().view(E, inter, H)
    down = mlp.w2.detach().view(E, inter, H).transpose(1, 2)
    return gate, up, down


def _dense_experts(module: nn.Module, info: ExpertsInfo) -> tuple[Tensor, Tensor, Tensor]:
    """The dense (gate, up, down) of an experts module of any recognised layout."""
    if info.layout == "fused":
        return _dense_fused(module, info)
    if info.layout == "stacked":
        return _dense_stacked(module, info)
    if info.layout == "llama4":  # [E, H, 2I] (gate columns, then up) and [E, I, H]
        gate_up = module.experts.gate_up_proj.detach().transpose(1, 2)
        inter = info.intermediate_size
        return gate_up[:, :inter], gate_up[:, inter:], module.experts.down_proj.detach().mT
    if info.layout == "jetmoe":  # chunk(2): gate rows, then up rows
        w_in = module.input_linear.weight.detach()
        inter = info.intermediate_size
        return w_in[:, :inter], w_in[:, inter:], module.output_linear.weight.detach()
    return _dense_module_list(module)


def _dense_module_list(experts: nn.ModuleList) -> tuple[Tensor, Tensor, Tensor]:
    linears = [_mlp_linears(mlp) for mlp in experts]
    gate, up, down = (torch.stack([lin[j].weight.detach() for lin in linears]) for j in range(3))
    return gate, up, down
