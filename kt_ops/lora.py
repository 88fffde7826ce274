"""LoRA fine-tuning of the routed experts on kt_ops (Hu et al. 2021; PEFT's conventions).

After :func:`kt_ops.replace_experts`, :func:`apply_lora` gives every
:class:`kt_ops.nn.MoEExperts` of a model trainable LoRA adapters. The op
computes, per projection ``p`` of expert ``e`` (gate, up: ``[I, H]``; down:
``[H, I]``)::

    y = W_p[e] x + lora_scaling * B_p[e] (A_p[e] x),   lora_scaling = alpha / r

and its registered autograd formula (``kt::moe_backward``) gives the gradients
of the adapters, of the hidden states (so attention, router and shared experts
train in PyTorch as usual) and of the routing weights. The packed base weights
are frozen buffers.

The parametrisation follows what PEFT does to the original model, so adapters
convert exactly (:mod:`kt_ops.peft_adapters`):

* experts that were transformers' fused 3-D parameters (``gate_up_proj``,
  ``down_proj``): PEFT's ``target_parameters`` LoRA of ``gate_up_proj`` is one
  rank-r adapter of the stacked ``2I`` outputs, i.e. one ``A`` shared by gate
  and up with separate ``B`` rows; :func:`apply_lora` does the same by default
  (``share_gate_up_a=None``).
* experts that were an ``nn.ModuleList`` of MLPs: one adapter per
  ``nn.Linear`` (separate ``A`` for gate and up), as PEFT's ``target_modules``.

:func:`unfuse_experts` turns a model's fused experts into such a ModuleList of
per-expert ``nn.Linear`` MLPs (plain PyTorch, same outputs), the layout that
PEFT's per-module LoRA targets.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Optional

import torch
from torch import Tensor, nn

from kt_ops.hf_experts import _dense_fused, _plan
from kt_ops.layer import PROJECTIONS
from kt_ops.nn import MoEExperts

__all__ = [
    "LORA_PROJECTIONS",
    "add_lora",
    "apply_lora",
    "keep_backward_panels",
    "lora_factors",
    "lora_delta",
    "lora_modules",
    "lora_parameters",
    "lora_shapes",
    "mark_only_lora_as_trainable",
    "remove_lora",
    "set_lora_factors",
    "shares_gate_up_a",
    "ExpertMLP",
    "ExpertMLPList",
    "unfuse_experts",
]

#: Projections of an expert MLP that can carry LoRA, in the op's argument order: all three.
LORA_PROJECTIONS = PROJECTIONS

#: dtypes the op takes for LoRA tensors.
_LORA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --------------------------------------------------------------------------------------------
# The adapters of one MoEExperts module
#
# They live on the module as the parameters ``{p}_lora_a [E, r, in]`` / ``{p}_lora_b
# [E, out, r]`` (named as the op's arguments) and the float ``lora_scaling``, which
# ``MoEExperts.forward`` passes to ``kt.moe_forward``. A shared gate/up A is one Parameter
# registered under both ``gate_lora_a`` and ``up_lora_a`` (listed once by ``parameters()``;
# the op receives it twice and autograd sums both gradients into it).
# --------------------------------------------------------------------------------------------


def lora_shapes(module: MoEExperts, projection: str, rank: int):
    """Shapes ``(A, B)`` of rank-``rank`` LoRA of ``projection`` of ``module``.

    ``gate``/``up``: ``A [E, r, H]``, ``B [E, I, r]``; ``down``: ``A [E, r, I]``,
    ``B [E, H, r]`` (PEFT's ``lora_A.weight [r, in]`` / ``lora_B.weight [out, r]`` of every
    expert, stacked). Raises ``ValueError`` for an unknown projection.
    """
    if projection not in LORA_PROJECTIONS:
        raise ValueError(f"unknown LoRA projection {projection!r}; expected {LORA_PROJECTIONS}")
    H, inter, E = module.hidden_size, module.intermediate_size, module.num_experts
    n_in, n_out = (inter, H) if projection == "down" else (H, inter)
    return (E, rank, n_in), (E, n_out, rank)


def lora_factors(module: MoEExperts) -> dict[str, tuple[Tensor, Tensor]]:
    """``{projection: (A [E, r, in], B [E, out, r])}`` of the projections with LoRA.

    The tensors are the parameters themselves; gate and up give the same ``A`` when shared.
    """
    out = {}
    for p in LORA_PROJECTIONS:
        a, b = getattr(module, f"{p}_lora_a", None), getattr(module, f"{p}_lora_b", None)
        if a is not None and b is not None:
            out[p] = (a, b)
    return out


def shares_gate_up_a(module: MoEExperts) -> bool:
    """Whether gate and up use one ``A`` (PEFT's LoRA of a fused ``gate_up_proj``)."""
    f = lora_factors(module)
    return "gate" in f and "up" in f and f["gate"][0] is f["up"][0]


def lora_delta(module: MoEExperts, projection: str) -> Tensor:
    """Dense fp32 ``lora_scaling * B @ A``, ``[E, out, in]``: what LoRA adds to the weight.

    Raises ``KeyError`` when ``projection`` has no LoRA.
    """
    a, b = lora_factors(module)[projection]
    return module.lora_scaling * torch.bmm(b.detach().float(), a.detach().float())


def remove_lora(module: MoEExperts) -> None:
    """Drop the LoRA adapters of ``module`` (it computes the base experts again)."""
    for p in LORA_PROJECTIONS:
        for f in ("a", "b"):
            module.register_parameter(f"{p}_lora_{f}", None)
    module.lora_scaling = 1.0


def set_lora_factors(
    module: MoEExperts,
    factors: dict[str, tuple[Tensor, Tensor]],
    scaling: float,
    *,
    dtype: Optional[torch.dtype] = None,
    requires_grad: bool = True,
) -> None:
    """Install LoRA factors on ``module`` (copies, on the CPU).

    Args:
        module: the experts module; its adapters are replaced.
        factors: ``{projection: (A, B)}`` with the shapes of :func:`lora_shapes` (the rank
            may differ between projections). When gate and up pass the same ``A`` object it
            becomes one shared parameter.
        scaling: ``lora_scaling`` of every projection (fold other factors into ``B``).
        dtype: dtype of the parameters (default: that of each tensor).
        requires_grad: of the new parameters.

    Raises:
        ValueError: no or unknown projections, a wrong shape, an unsupported dtype.
    """
    if not factors:
        raise ValueError("set_lora_factors: no projections given")
    shared = "gate" in factors and "up" in factors and factors["gate"][0] is factors["up"][0]
    params: dict[str, nn.Parameter] = {}
    for p, (a, b) in factors.items():
        rank = int(a.shape[1]) if a.dim() == 3 else 1
        want = lora_shapes(module, p, rank)
        if (tuple(a.shape), tuple(b.shape)) != want:
            raise ValueError(
                f"set_lora_factors: {p} factors have shapes A {tuple(a.shape)}, B "
                f"{tuple(b.shape)}; expected A {want[0]}, B {want[1]} (A [E, r, in], B [E, out, r])"
            )
        for t in (a, b):
            got = dtype or t.dtype
            if got not in _LORA_DTYPES:
                raise ValueError(
                    f"set_lora_factors: LoRA dtype must be fp32, bf16 or fp16, got {got}"
                )
        if p == "up" and shared:
            params["up_lora_a"] = params["gate_lora_a"]
        else:
            a = a.detach().to(device="cpu", dtype=dtype or a.dtype).clone().contiguous()
            params[f"{p}_lora_a"] = nn.Parameter(a, requires_grad=requires_grad)
        b = b.detach().to(device="cpu", dtype=dtype or b.dtype).clone().contiguous()
        params[f"{p}_lora_b"] = nn.Parameter(b, requires_grad=requires_grad)
    remove_lora(module)
    for name, param in params.items():
        module.register_parameter(name, param)
    module.lora_scaling = float(scaling)


def add_lora(
    module: MoEExperts,
    rank: int,
    alpha: Optional[float] = None,
    projections: Sequence[str] = LORA_PROJECTIONS,
    *,
    dtype: torch.dtype = torch.float32,
    share_gate_up_a: bool = False,
    use_rslora: bool = False,
    generator: Optional[torch.Generator] = None,
) -> None:
    """Give every expert of ``module`` fresh trainable LoRA adapters on ``projections``.

    Per projection ``p`` of expert ``e`` the op then computes (Hu et al. 2021)::

        y = W_p[e] x + lora_scaling * B_p[e] (A_p[e] x)
        lora_scaling = alpha / rank   (alpha / sqrt(rank) with use_rslora, Kalajdzievski 2023)

    Initialisation as PEFT's ``init_lora_weights=True``: ``A`` is ``kaiming_uniform_(a=
    sqrt(5))`` of an ``nn.Linear(in, rank)`` weight, i.e. ``U(-1/sqrt(in), 1/sqrt(in))``,
    ``B`` is zero, so the module computes what it did before until ``B`` is trained.
    (``MoEExperts.add_lora`` is the same without the shared-A and rsLoRA options.)

    Args:
        module: the experts module (must have no adapters on ``projections``).
        rank: ``r >= 1``.
        alpha: LoRA alpha (default ``rank``: scaling 1).
        projections: non-empty subset of ``("gate", "up", "down")``.
        dtype: fp32 (default), bf16 or fp16.
        share_gate_up_a: one ``A`` for gate and up with separate ``B`` s: the
            parametrisation PEFT gives a fused ``gate_up_proj [E, 2I, H]`` parameter targeted
            with ``target_parameters`` (one rank-r LoRA of the stacked 2I outputs). Needs
            both gate and up.
        use_rslora: rank-stabilised scaling ``alpha / sqrt(rank)``.
        generator: random generator of the ``A`` initialisation.

    Raises:
        ValueError: ``rank < 1``; unknown, repeated or no projections; a dtype other than
            fp32/bf16/fp16; ``share_gate_up_a`` without gate and up; adapters already there.
    """
    module.check_lora_allowed("add_lora")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"add_lora: rank must be a positive int, got {rank!r}")
    projections = tuple(projections)
    if not projections or len(set(projections)) != len(projections):
        raise ValueError(f"add_lora: projections must be distinct and non-empty, got {projections}")
    for p in projections:
        lora_shapes(module, p, rank)  # validates the name
    if share_gate_up_a and not {"gate", "up"} <= set(projections):
        raise ValueError("add_lora: share_gate_up_a needs both 'gate' and 'up' in projections")
    if dtype not in _LORA_DTYPES:
        raise ValueError(f"add_lora: dtype must be fp32, bf16 or fp16, got {dtype}")
    if lora_factors(module):
        raise ValueError("add_lora: the module already has LoRA adapters; remove_lora() first")
    factors = {}
    for p in projections:
        a_shape, b_shape = lora_shapes(module, p, rank)
        if p == "up" and share_gate_up_a:
            a = factors["gate"][0]
        else:
            bound = 1.0 / math.sqrt(a_shape[2])
            a = torch.rand(a_shape, generator=generator).mul_(2 * bound).sub_(bound)
        factors[p] = (a, torch.zeros(b_shape))
    alpha = float(rank if alpha is None else alpha)
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    set_lora_factors(module, factors, scaling, dtype=dtype)


def lora_modules(model: nn.Module) -> dict[str, MoEExperts]:
    """``{qualified name: module}`` of every :class:`MoEExperts` in ``model`` (LoRA or not)."""
    return {n: m for n, m in model.named_modules() if isinstance(m, MoEExperts)}


def apply_lora(
    model: nn.Module,
    rank: int = 16,
    alpha: Optional[float] = None,
    target_projections: Sequence[str] = LORA_PROJECTIONS,
    *,
    share_gate_up_a: Optional[bool] = None,
    dtype: torch.dtype = torch.float32,
    use_rslora: bool = False,
    seed: Optional[int] = None,
    freeze_base: bool = False,
) -> list[str]:
    """Add LoRA adapters to every kt_ops experts module of ``model`` (after ``replace_experts``).

    Args:
        model: a model whose experts :func:`kt_ops.replace_experts` replaced (or any
            module holding :class:`kt_ops.nn.MoEExperts`), in any weight format
            (a quantized base trains QLoRA style, see ``MoEExperts.add_lora``).
        rank: LoRA rank ``r``.
        alpha: LoRA alpha (default ``rank``): ``lora_scaling = alpha / r``
            (``alpha / sqrt(r)`` with ``use_rslora``).
        target_projections: subset of ``("gate", "up", "down")``.
        share_gate_up_a: one ``A`` for gate and up, as PEFT's LoRA of a fused
            ``gate_up_proj`` parameter. ``None``: per module, ``True`` when it
            replaced fused experts (``source_layout['layout'] == 'fused'``) and
            both gate and up are targeted, else ``False``.
        dtype: adapter dtype (fp32, bf16 or fp16).
        use_rslora: rank-stabilised scaling.
        seed: seed of the ``A`` initialisation (``None``: torch's global RNG).
        freeze_base: also set ``requires_grad=False`` on every other parameter
            of ``model`` (PEFT's ``get_peft_model`` does that for its own targets).

    Returns:
        The qualified names of the modules that got adapters.

    Raises:
        ValueError: the model has no ``MoEExperts`` (call ``replace_experts``
            first), a module already has adapters, or an argument is invalid
            (see :func:`add_lora`).
    """
    modules = lora_modules(model)
    if not modules:
        raise ValueError(
            f"apply_lora: {type(model).__name__} has no kt_ops experts modules; call "
            "kt_ops.replace_experts(model) first"
        )
    targets = tuple(target_projections)
    both = {"gate", "up"} <= set(targets)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    for module in modules.values():
        share = share_gate_up_a
        if share is None:
            layout = (getattr(module, "source_layout", None) or {}).get("layout")
            share = both and layout == "fused"
        add_lora(
            module,
            rank,
            alpha,
            targets,
            dtype=dtype,
            share_gate_up_a=share,
            use_rslora=use_rslora,
            generator=generator,
        )
    if freeze_base:
        mark_only_lora_as_trainable(model)
    from kt_ops.distributed import keep_packed_experts_out_of_ddp

    keep_packed_experts_out_of_ddp(model)  # DDP syncs the LoRA factors, not the experts
    return list(modules)


def lora_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(qualified name, parameter)`` of every kt_ops LoRA adapter in ``model``."""
    for name, module in lora_modules(model).items():
        for pname, p in module.named_parameters(recurse=False):  # a shared A once
            if "_lora_" in pname:
                yield (f"{name}.{pname}" if name else pname), p


def mark_only_lora_as_trainable(model: nn.Module) -> int:
    """``requires_grad=True`` on the kt_ops LoRA adapters, ``False`` on every other parameter.

    Returns the number of trainable elements.
    """
    ours = {id(p) for _, p in lora_parameters(model)}
    for p in model.parameters():
        p.requires_grad_(id(p) in ours)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def keep_backward_panels(model: nn.Module, keep: bool = True) -> int:
    """:meth:`MoEExperts.keep_backward_panels` on every kt_ops experts module of ``model``.

    The LoRA backward then reads each layer's transposed weights, made once,
    instead of transposing every routed expert's weights at every step (the same
    results; 10-17% of the backward on Zen 4 at 512 tokens), for 2 bytes of host
    memory per expert weight (as much again as a bf16 base, twice an int8 one,
    four times an mxfp4 one; bf16, int8, the fp8 formats and mxfp4 have them):
    for memory to spare. Returns the bytes of panels a training step of the
    model keeps (0 with ``keep=False``, or where this CPU or the weight formats
    have none: :meth:`kt_ops.ExpertWeights.with_backward_panels`).
    """
    total = 0
    for module in lora_modules(model).values():
        module.keep_backward_panels(keep)
        total += module.expert_weights().backward_panels_nbytes if keep else 0
    return total


# --------------------------------------------------------------------------------------------
# Per-expert nn.Linear layout (plain PyTorch): what PEFT's target_modules LoRA targets
# --------------------------------------------------------------------------------------------


class ExpertMLP(nn.Module):
    """One SwiGLU expert ``down_proj(silu(gate_proj(x)) * up_proj(x))`` of bias-free nn.Linear."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype=None, device=None) -> None:
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.act_fn = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        """``[..., H]`` -> ``[..., H]``."""
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ExpertMLPList(nn.ModuleList):
    """``nn.ModuleList`` of :class:`ExpertMLP`, called like transformers-v5 experts.

    ``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K])``
    returns ``sum_k w[t, k] * experts[top_k_index[t, k]](x[t])`` (ids of ``-1``
    skipped), looping over the experts hit as transformers' eager experts do.
    Raises ValueError for an id outside ``[-1, E)``, as ``kt.moe_forward`` does.
    """

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        """``hidden_states [T, H]``, ``top_k_index [T, K]`` int, ``top_k_weights [T, K]``
        -> ``[T, H]`` in the dtype of ``hidden_states``."""
        out = torch.zeros_like(hidden_states)
        num_experts = len(self)
        ids = torch.unique(top_k_index).tolist()
        bad = [e for e in ids if e < -1 or e >= num_experts]
        if bad:
            raise ValueError(
                f"ExpertMLPList: top_k_index must lie in [-1, {num_experts}) (-1 skips a slot), "
                f"got {bad[:4]}"
            )
        for e in ids:
            if e < 0:
                continue
            token, slot = torch.where(top_k_index == e)
            y = self[e](hidden_states[token]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


def unfuse_experts(model: nn.Module) -> list[str]:
    """Replace transformers' fused experts modules by :class:`ExpertMLPList` (same weights).

    In place, plain PyTorch: the 3-D ``gate_up_proj``/``down_proj`` of every
    fused experts module (any layout :func:`kt_ops.hf.find_experts` accepts) are
    copied into per-expert ``gate_proj``/``up_proj``/``down_proj`` nn.Linear
    layers, in the dtype and device of the originals. The parent block keeps
    calling ``experts(hidden_states, top_k_index, top_k_weights)``, so the
    model computes the same function. PEFT can then target the experts with
    ``target_modules=["gate_proj", "up_proj", "down_proj"]`` (keys
    ``...experts.3.gate_proj.lora_A.weight``), and ``replace_experts`` reads them
    as the ``module_list`` layout.

    Returns:
        The names of the replaced modules.

    Raises:
        kt_ops.hf.UnsupportedExpertsError: an experts module kt_ops cannot run
            (same checks as ``replace_experts``).
    """
    plans, _ = _plan(model)
    names = []
    for plan in plans:
        if plan.info.layout != "fused":
            continue
        gate, up, down = _dense_fused(plan.module, plan.info)
        ref = plan.module.gate_up_proj
        H, inter = plan.info.hidden_size, plan.info.intermediate_size
        experts = ExpertMLPList(
            ExpertMLP(H, inter, dtype=ref.dtype, device=ref.device)
            for _ in range(plan.info.num_experts)
        )
        with torch.no_grad():
            for e, mlp in enumerate(experts):
                mlp.gate_proj.weight.copy_(gate[e])
                mlp.up_proj.weight.copy_(up[e])
                mlp.down_proj.weight.copy_(down[e])
        experts.train(plan.module.training)
        setattr(plan.parent, plan.attr, experts)
        names.append(plan.info.name)
    return names
