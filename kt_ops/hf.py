"""Hugging Face ``transformers`` integration: run a model's routed experts on kt_ops.

:func:`replace_experts` swaps the experts module of every MoE layer of a model
for a :class:`kt_ops.nn.MoEExperts` that holds the same weights packed for the
CPU kernels. The router, shared experts, attention and everything else stay in
PyTorch, untouched.

Four layouts of experts are recognised:

* **Fused (transformers >= 5).** Every MoE model's experts module is decorated
  with ``@use_experts_implementation`` (``transformers/integrations/moe.py``),
  holds 3-D parameters ``gate_up_proj`` and ``down_proj`` and is called by its
  MoE block as ``experts(hidden_states, top_k_index, top_k_weights)``.
  ``gate_up_proj`` is ``[E, 2I, H]`` (``[E, H, 2I]`` when ``is_transposed``),
  gate rows then up rows (``is_concatenated=True``) or interleaved
  ``gate0, up0, gate1, ...`` (``is_concatenated=False``); ``down_proj`` is
  ``[E, H, I]`` (``[E, I, H]`` transposed). All four combinations are
  supported. Modules with the same two parameters but without the decorator
  are read with the decorator's defaults (concatenated, not transposed).
  Examples: Qwen3MoeExperts, Qwen2MoeExperts, MixtralExperts, OlmoeExperts,
  DeepseekV3Experts, GraniteMoeExperts, GptOssExperts (with the per-expert
  biases ``gate_up_proj_bias`` / ``down_proj_bias``).
* **Stacked (DBRX).** An experts module whose ``mlp`` holds 2-D ``w1`` (gate),
  ``v1`` (up) and ``w2`` (down, transposed), ``[E*I, H]`` each, called as the
  fused ones are.
* **Whole MoE blocks.** JetMoE's block (parallel experts ``input_linear`` /
  ``output_linear`` and an output bias) and Llama 4's (transposed fused experts
  called as ``experts(routed_in)`` on inputs already scaled by the routing
  scores) are replaced as a whole by :class:`kt_ops.hf_experts.JetMoeBlock` /
  :class:`kt_ops.hf_experts.Llama4MoeBlock`, which keep the block's router (and
  shared expert) and run the experts on kt_ops.
* A norm after each expert (MuseSpark's ``has_post_expert_norm``) is kept as the
  model's module around the kt_ops experts (:class:`kt_ops.hf_experts.PostNormExperts`).
* **Per-expert modules.** An ``nn.ModuleList`` registered under the name
  ``experts`` whose items are MLPs with bias-free ``nn.Linear`` layers
  ``gate_proj``/``up_proj``/``down_proj`` (Qwen-MoE/OLMoE style) or
  ``w1``/``w3``/``w2`` (Mixtral style of transformers 4.x). Routing in such
  models lives in the parent block and differs from model to model (softmax
  before or after top-k, renormalisation, group-limited routing...), so it is
  not reproduced: the list is replaced by a :class:`kt_ops.nn.MoEExpertList`,
  which serves both ways a parent can use it: a parent that calls
  ``experts(hidden_states, top_k_index, top_k_weights)`` (v5 style) gets the
  fused kernel, and a parent that loops ``self.experts[i](x)`` itself keeps its
  own routing and runs each expert through kt_ops (correct, but one op call per
  expert, so without the fused speed-up).

Supported experts compute the gated MLP ``down(act(gate(x)) * up(x))`` with
``act`` SiLU (SwiGLU) or GELU (erf or tanh approximation: GeGLU), found from the
experts' ``act_fn`` (:data:`kt_ops.ACTIVATIONS`), with the clamps, alpha and +1
of gpt-oss-style SwiGLUs read from the module's ``limit`` / ``alpha`` (or
``swiglu_*``) attributes and confirmed by the probe
(:func:`kt_ops.activation_spec`). Anything else is refused with
:class:`UnsupportedExpertsError` (a ``ValueError``) naming the module, its class
and the reason: non-gated
experts (``has_gate=False``) other than relu2, another activation, extra
tensors such as
quantization scales, or a custom gating function (``_apply_gate`` with clamps or
a different GLU). As a last guard, the first replacement of each kind of module (its
class, layout and every scalar attribute, so a clamp set on some layers only makes its own
kind) is checked on a probe batch against the module it replaces (``check=True``), which
also catches gating that no flag describes.

Nothing is replaced unless every experts module of the model is supported.
After replacement the state-dict keys of the experts are ``gate_weight``,
``up_weight``, ``down_weight`` (packed), so ``save_pretrained`` checkpoints of
a converted model do not load back into the unconverted class. The experts run
on the CPU (from CUDA hidden states only through the op's CUDA-stream bridge,
where the build has it). CPU/GPU hybrid: :func:`collect_routing_stats` counts
each layer's expert hits on a calibration prompt, and
``replace_experts(..., num_gpu_experts=n, routing_stats=stats)`` (or
:func:`set_gpu_experts` afterwards) keeps each layer's ``n`` hottest experts as
dense PyTorch weights that follow ``model.to()`` and are computed by torch; the
op skips them (:meth:`kt_ops.nn.MoEExperts.set_gpu_experts`). The packed expert weights
are frozen; gradients flow through the experts to the rest of the model
(kt.moe_backward), and
``MoEExperts.add_lora`` adds trainable LoRA adapters to the experts.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Optional, Union

import torch
from torch import Tensor, nn

from kt_ops.distributed import keep_packed_experts_out_of_ddp
from kt_ops.formats import FORMATS
from kt_ops.hf_experts import (
    _MLP_NAMES,
    ExpertsInfo,
    ExpertsWrapper,
    JetMoeBlock,
    Llama4MoeBlock,
    PostNormExperts,
    UnsupportedExpertsError,
    _dense_biases,
    _dense_experts,
    _Plan,
    _plan,
    find_experts,
)
from kt_ops.layer import ACTIVATIONS, ExpertWeights, split_weight_format
from kt_ops.nn import MoEExpertList, MoEExperts, MoEExpertsWithIdentity, parse_gpu_experts
from kt_ops.routing_stats import RoutingStats, collect_routing_stats, record_routing

__all__ = [
    "ExpertsInfo",
    "RoutingStats",
    "UnsupportedExpertsError",
    "collect_routing_stats",
    "find_experts",
    "record_routing",
    "replace_experts",
    "set_gpu_experts",
]

logger = logging.getLogger(__name__)

#: Relative error (max |replacement - original| / max |original|) allowed on the probe batch.
#: bf16 rounding of the weights stays near 1e-2 even for a bf16 model; a different
#: gating function (clamp, alpha, +1, wrong gate/up split) gives errors of order 1.
_PROBE_TOL = 0.05


# --------------------------------------------------------------------------------------------
# Building and checking the replacements
# --------------------------------------------------------------------------------------------


def _probe_inputs(gate: Tensor, dtype: torch.dtype, device: torch.device, num_tokens: int = 4):
    """A small batch whose gate pre-activations are large (std ~20), so clamps show up."""
    E, _, H = gate.shape
    gen = torch.Generator().manual_seed(0)
    K = min(2, E)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(num_tokens)])
    rows = gate[ids.unique()].float()
    rms = rows.pow(2).mean().sqrt().item()
    scale = 20.0 / (rms * H**0.5) if rms > 0 else 1.0
    x = torch.randn(num_tokens, H, generator=gen) * scale
    weights = torch.rand(num_tokens, K, generator=gen) + 0.5
    return x.to(device=device, dtype=dtype), ids.to(device), weights.to(device=device, dtype=dtype)


def _relative_error(got: Tensor, want: Tensor) -> float:
    got, want = got.float().cpu(), want.float().cpu()
    if got.shape != want.shape and got.numel() == want.numel():
        got = got.reshape(want.shape)  # DBRX returns [T, 1, H] for [T, H] hidden states
    scale = want.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return ((got - want).abs().max() / scale).item()


def _has_custom_gate(module: nn.Module) -> bool:
    """Whether a fused experts class replaces transformers' default ``act(gate) * up`` gating."""
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is None:
        return False
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # another transformers version: cannot tell
        return False
    return apply_gate is not _default_apply_gate


def _check_replacement(plan: _Plan, new: MoEExperts, gate: Tensor) -> None:
    info, old = plan.info, plan.module
    where = f"{info.class_name} at '{info.name}'"
    dtype, device = gate.dtype, gate.device
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        dtype = torch.float32
    x, ids, weights = _probe_inputs(gate, dtype, device)
    errors = {}
    if info.layout in _BLOCK_LAYOUTS:  # the whole block, with its own router: x -> block(x)
        x3 = x.unsqueeze(0)
        got, want = new(x3.cpu()), old(x3)
        if isinstance(want, tuple):  # Llama 4: (out, router_logits)
            got, want = got[0], want[0]
        errors["block(x)"] = _relative_error(got, want)
    elif info.layout == "fused" or type(old).forward is not nn.Module.forward:
        # The module's own call: x -> weighted sum of the routed experts.
        try:
            want = old(x, ids, weights)
        except Exception as exc:  # noqa: BLE001 - report what the original module does not take
            raise UnsupportedExpertsError(
                f"{where}: calling it as experts(hidden_states, top_k_index, top_k_weights) "
                f"failed ({type(exc).__name__}: {exc}); kt_ops replaces experts with that call"
            ) from exc
        errors["experts(x, top_k_index, top_k_weights)"] = _relative_error(
            new(x.cpu(), ids.cpu(), weights.cpu()), want
        )
    if info.layout == "module_list":
        for i in sorted({0, info.num_experts - 1}):
            errors[f"experts[{i}](x)"] = _relative_error(new[i](x.cpu()), old[i](x))
    bad = {call: err for call, err in errors.items() if not err <= _PROBE_TOL}
    if bad:
        custom_gate = ""
        if _has_custom_gate(old):
            custom_gate = f" {type(old).__name__} overrides _apply_gate (custom gating)."
        raise UnsupportedExpertsError(
            f"{where}: its output differs from the {plan.info.activation} GLU experts kt_ops "
            "computes "
            f"(relative error {', '.join(f'{c}: {e:.3g}' for c, e in bad.items())} on a probe "
            f"batch, tolerance {_PROBE_TOL}).{custom_gate} Only down(act(gate(x)) * up(x)) "
            f"experts with act one of {list(ACTIVATIONS)} are supported, with the clamps, "
            "alpha and +1 of gpt-oss-style SwiGLUs read from the module's limit / alpha "
            f"attributes (tried {list(plan.info.glu_candidates or (plan.info.activation,))})"
        )


def _probe_kind(plan: _Plan) -> tuple:
    """What makes two experts modules compute the same function of their weights."""
    info = plan.info
    scalars = tuple(
        sorted(
            (k, v)
            for k, v in vars(plan.module).items()
            if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))
        )
    )
    return (
        type(plan.module),
        info.layout,
        info.concatenated,
        info.transposed,
        info.biased,
        info.non_gated,
        info.glu_candidates or (info.activation,),
        scalars,
    )


def _probe_glu(plan: _Plan) -> MoEExperts:
    """The bf16 replacement of ``plan`` whose GLU the probe confirms (``plan.info`` updated).

    Tries ``info.glu_candidates`` in order (the checks of the structure, gating and
    activation, with bf16 weights, whose rounding error is far below any quantized
    format's); raises the first candidate's error when none matches.
    """
    info = plan.info
    first_error = None
    for spec in info.glu_candidates or (info.activation,):
        plan.info = dataclasses.replace(info, activation=spec)
        probe, gate = _build(plan, "bf16")
        try:
            _check_replacement(plan, probe, gate)
        except UnsupportedExpertsError as err:
            first_error = first_error or err
            continue
        return probe
    plan.info = info
    raise first_error


def _source_layout(plan: _Plan) -> dict:
    """How the replaced module stores its experts, for PEFT adapters (``kt_ops.peft_adapters``).

    ``{'layout': 'fused', 'concatenated', 'transposed', 'param_names'}`` (3-D parameters in
    registration order, which fixes how PEFT nests its ``ParamWrapper`` s) or
    ``{'layout': 'module_list', 'linear_names': (gate, up, down)}`` (nn.Linear attribute names).
    """
    info = plan.info
    if info.non_gated:
        return {"layout": "non_gated", "param_names": ("up_proj", "down_proj")}
    if info.layout == "jetmoe":
        return {"layout": "jetmoe", "param_names": ("input_linear.weight", "output_linear.weight")}
    if info.layout == "llama4":
        return {"layout": "llama4", "param_names": ("experts.gate_up_proj", "experts.down_proj")}
    if info.layout == "stacked":
        return {"layout": "stacked", "param_names": ("mlp.w1", "mlp.v1", "mlp.w2")}
    if info.layout == "fused":
        names = [n for n, _ in plan.module.named_parameters(recurse=False)]
        return {
            "layout": "fused",
            "concatenated": info.concatenated,
            "transposed": info.transposed,
            "param_names": tuple(n for n in names if n in ("gate_up_proj", "down_proj")),
        }
    first = plan.module[0]
    names = next(
        n for n in _MLP_NAMES if all(isinstance(getattr(first, x, None), nn.Linear) for x in n)
    )
    return {"layout": "module_list", "linear_names": tuple(names)}


def _build(plan: _Plan, weight_format: str, **quant) -> tuple[MoEExperts, Tensor]:
    """The replacement of one experts module, and the dense gate weights it was built from.

    ``quant``: ``group_size`` / ``symmetric`` for the quantized formats.
    """
    act = plan.info.activation
    if plan.info.layout in _CALLED_AS_EXPERTS:
        gate, up, down = _dense_experts(plan.module, plan.info)
        experts = ExpertWeights.from_dense(gate, up, down, weight_format, **quant)
        if plan.info.biased:
            experts = experts.with_biases(*_dense_biases(plan.module, plan.info))
        return _replacement(plan, _experts_module(experts, plan.info)), gate
    gate, up, down = _dense_experts(plan.module, plan.info)
    return (
        MoEExpertList.from_dense(gate, up, down, weight_format, activation=act, **quant),
        gate,
    )


def _place_gpu_experts(
    plan: _Plan, new: MoEExperts, selection, counts, *, from_model: bool
) -> None:
    """Give ``new`` its GPU-resident experts: the model's dense weights, or dequantized."""
    dense = _dense_experts(plan.module, plan.info)
    new = _kt_experts(new)
    if from_model:
        new.set_gpu_experts(selection, routing_counts=counts, dense=dense)
    else:  # converted experts: dequantize them, in the dtype / on the device of the model's
        dtype = dense[0].dtype if dense[0].dtype in _GPU_DTYPES else None
        new.set_gpu_experts(selection, routing_counts=counts, dtype=dtype, device=dense[0].device)


_GPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Layouts whose module becomes one MoEExperts, called as experts(hidden_states,
#: top_k_index, top_k_weights) (JetMoE's block: inside a JetMoeBlock; a module list
#: becomes a MoEExpertList).
_CALLED_AS_EXPERTS = ("fused", "stacked", "jetmoe", "llama4")

#: Layouts replaced as a whole MoE block (router kept) around one MoEExperts.
_BLOCK_LAYOUTS = {"jetmoe": JetMoeBlock, "llama4": Llama4MoeBlock}


def _layer_index(name: str) -> Optional[int]:
    """The decoder layer of a module path such as ``model.layers.7.mlp.experts``."""
    match = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
    return int(match.group(1)) if match else None


def _load_converted(plan: _Plan, converted) -> MoEExperts:
    """The replacement of one experts module from a converted directory (``kt-ops convert``)."""
    info = plan.info
    layer = _layer_index(info.name)
    if layer is None or layer not in converted:
        raise ValueError(
            f"replace_experts: {converted.path} holds no experts for '{info.name}' "
            f"(layer {layer}); it has layers {list(converted.layers)}"
        )
    want = (info.num_experts, info.intermediate_size, info.hidden_size)
    have = tuple(converted.layer_shape(layer))
    if have != want:
        raise ValueError(
            f"replace_experts: layer {layer} of {converted.path} holds experts [E, I, H] = {have}, "
            f"but '{info.name}' has {want}; was the directory converted from this model?"
        )
    packed = converted.load_layer(layer)
    if info.biased:  # the model's own biases (small), whether or not the directory has them
        packed = packed.with_biases(*_dense_biases(plan.module, info))
    if info.layout in _CALLED_AS_EXPERTS:
        return _replacement(plan, _experts_module(packed, info))
    return MoEExpertList.from_packed(*packed.projections, activation=info.activation)


class _CheckpointLayers:
    """A checkpoint reader seen as a converted directory by :func:`_load_converted`:
    ``load_layer(L)`` in the requested (or the checkpoint's own) format."""

    def __init__(self, reader, weight_format: Optional[str]) -> None:
        self.reader = reader
        self.path = reader.path
        self.layers = reader.layers
        self.requested = weight_format  # None: each tensor in the format it is stored in
        self.weight_format = weight_format or getattr(reader, "native_format", None)

    def __contains__(self, layer: object) -> bool:
        return layer in self.reader

    def layer_shape(self, layer: int) -> tuple[int, int, int]:
        return self.reader.layer_shape(layer)

    def load_layer(self, layer: int):
        return self.reader.load_layer(layer, self.requested)


def _open_checkpoint(path, weight_format: Optional[str]) -> _CheckpointLayers:
    from kt_ops.convert import ConvertedExperts
    from kt_ops.loaders import open_checkpoint

    p = Path(path)
    if p.is_dir() and (p / "manifest.json").is_file():
        return _CheckpointLayers(ConvertedExperts(p), None)  # as converted
    reader = open_checkpoint(p)
    if weight_format is not None:
        for L in reader.layers:
            reader.check_weight_format(L, weight_format)
    return _CheckpointLayers(reader, weight_format)


def _replacement(plan: _Plan, experts: nn.Module) -> nn.Module:
    """What replaces ``plan.module``: ``experts`` itself, or for a whole MoE block
    (JetMoE) the block around them."""
    if plan.info.post_expert_norm:
        return PostNormExperts(experts, plan.module.post_expert_norm)
    block = _BLOCK_LAYOUTS.get(plan.info.layout)
    return block(plan.module, experts) if block else experts


def _kt_experts(module: nn.Module) -> MoEExperts:
    """The MoEExperts of a replacement (itself, or a block's ``kt_experts``)."""
    return module.kt_experts if isinstance(module, ExpertsWrapper) else module


def _experts_module(experts: ExpertWeights, info: ExpertsInfo) -> MoEExperts:
    """The replacement module of a fused or stacked experts module (with its identity
    experts where it has them: LongCat-Flash)."""
    if info.identity_experts:
        return MoEExpertsWithIdentity(
            experts, activation=info.activation, num_identity=info.identity_experts
        )
    return MoEExperts(experts, activation=info.activation)


def replace_experts(
    model: nn.Module,
    weight_format: Optional[str] = None,
    *,
    group_size: Optional[int] = None,
    symmetric: bool = True,
    converted_dir: Optional[str] = None,
    checkpoint: Optional[str] = None,
    check: bool = True,
    num_gpu_experts: Optional[int] = None,
    routing_stats: Optional[RoutingStats] = None,
    gpu_experts=None,
) -> nn.Module:
    """Replace the routed experts of every MoE layer of ``model`` by :class:`kt_ops.nn.MoEExperts`.

    In place: each experts module found (see the module docstring for the
    layouts) is packed into ``weight_format`` and swapped for a ``MoEExperts``
    (a ``MoEExpertList`` for an ``nn.ModuleList`` of expert MLPs); the dense
    expert weights are released once nothing else references them. Modules that
    already are ``MoEExperts`` are left alone. What was replaced is logged at
    INFO level by the ``kt_ops.hf`` logger (:func:`find_experts` gives the same
    list up front).

    Args:
        model: a ``transformers`` MoE model (or any ``nn.Module`` holding such
            experts), its weights materialized (any floating dtype and device;
            packed weights are stored on the CPU).
        weight_format: one of ``kt_ops.formats.FORMATS`` (docs/formats.md),
            or per-projection ``'gate,up,down'`` formats (``'q4_k,q4_k,q6_k'``),
            None for ``'bf16'`` (or, with ``checkpoint``, the checkpoint's own format);
            the model's expert weights are quantized online (a few experts at
            a time) unless ``converted_dir`` is given.
        group_size: group along K for the grouped formats (``None``: the
            format's default; with per-projection formats, a format that has a
            single group size keeps its own).
        symmetric: ``int4``: ``False`` stores zero points.
        converted_dir: a directory written by ``kt-ops convert`` from this
            model's checkpoint: the packed experts are loaded from it (checksums
            verified) instead of quantized from the model's weights;
            ``weight_format`` is then ignored (the directory's format is used).
        checkpoint: the model's checkpoint to read the experts from, in the formats
            it stores (:func:`kt_ops.loaders.open_checkpoint`: GPTQ, AWQ,
            compressed-tensors, DeepSeek-V4 MXFP4, fp8, MXFP4, GGUF, safetensors; or a
            ``kt-ops convert`` directory), instead of the model's own weights: for
            models published quantized, whose experts ``from_pretrained`` cannot
            dequantize on a CPU. ``weight_format`` None (or the default) keeps the
            checkpoint's own format (:attr:`native_format`), another name converts
            to it. Layer ``L`` of the checkpoint replaces ``...layers.{L}...experts``.
        check: before replacing anything, run the first module of each kind
            (class and layout) and a bf16 replacement on a small probe batch, and
            refuse when they disagree beyond bf16 rounding (catches gating
            functions no flag describes). Costs one tiny forward per kind.
        num_gpu_experts: CPU/GPU hybrid: per layer, keep the ``n`` most hit
            experts of ``routing_stats`` as dense PyTorch weights (the model's
            own, in its dtype and on its device; with ``converted_dir``,
            dequantized from the loaded experts) that follow ``model.to()``,
            computed by torch, while the op skips them
            (:meth:`kt_ops.nn.MoEExperts.set_gpu_experts`). ``None``/0: none.
        routing_stats: per-layer hit counts from :func:`collect_routing_stats`
            on a calibration prompt (run it before ``replace_experts``: the
            module names stay the same).
        gpu_experts: instead of ``num_gpu_experts``: one selection (bool mask
            ``[E]`` or expert ids) for every layer, or ``{module name:
            selection}``.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: unknown ``weight_format``; a ``converted_dir`` that lacks a
            layer, holds other shapes or fails its checksums; GPU-expert
            arguments that do not fit (``num_gpu_experts`` without
            ``routing_stats``, outside ``[0, E]`` or with ``gpu_experts``;
            ``routing_stats`` lacking a layer; a bad selection). Nothing is
            replaced then.
        UnsupportedExpertsError (a ``ValueError``): the model has no MoE
            experts, or an experts module is unsupported (biases, no gate,
            activation other than SiLU, post-expert norm, extra tensors,
            custom gating, weights on the meta device). Nothing is replaced then.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"replace_experts: expected a torch.nn.Module, got {type(model).__name__}")
    converted = None
    if converted_dir is not None and checkpoint is not None:
        raise ValueError("replace_experts: pass converted_dir or checkpoint, not both")
    if converted_dir is not None:
        from kt_ops.convert import ConvertedExperts

        converted = ConvertedExperts(converted_dir)
        weight_format = converted.weight_format
    elif checkpoint is not None:
        converted = _open_checkpoint(checkpoint, weight_format)
        weight_format = converted.weight_format
    weight_format = weight_format or "bf16"
    quant = {} if weight_format == "bf16" else {"group_size": group_size, "symmetric": symmetric}
    if converted is None:
        try:
            split_weight_format(weight_format)
        except ValueError:
            raise ValueError(
                f"replace_experts: weight_format={weight_format!r} is not supported; expected one "
                f"of {FORMATS} or per-projection 'gate,up,down' formats (e.g. "
                "'q4_k,q4_k,q6_k')"
            ) from None
    _check_gpu_args("replace_experts", num_gpu_experts, routing_stats, gpu_experts)
    plans, already = _plan(model)
    # The GPU experts of every layer, validated before anything is replaced.
    selections = []
    for plan in plans:
        info = plan.info
        selection, counts = _gpu_selection_for(
            info.name, info.num_experts, num_gpu_experts, routing_stats, gpu_experts
        )
        parse_gpu_experts(selection, counts, info.num_experts, f"replace_experts: '{info.name}'")
        if selection is not None and info.biased:
            raise UnsupportedExpertsError(
                f"replace_experts: '{info.name}' has per-expert biases (gpt-oss); GPU-resident "
                "experts of such layers are not supported yet: leave num_gpu_experts / "
                "gpu_experts unset for this model"
            )
        selections.append((selection, counts))
    if not plans:
        if already:
            logger.info(
                "kt_ops: %s already runs its %d experts modules on kt_ops",
                type(model).__name__,
                already,
            )
            return model
        dicts = [
            n
            for n, m in model.named_modules()
            if n.rsplit(".", 1)[-1] == "experts" and isinstance(m, nn.ModuleDict)
        ]
        if dicts:  # Switch Transformers, NLLB-MoE
            raise UnsupportedExpertsError(
                f"{type(model).__name__}: its experts ('{dicts[0]}' and {len(dicts) - 1} more) "
                "are an nn.ModuleDict of non-gated MLPs (down(act(up(x))), routed with an "
                "expert capacity): kt_ops runs gated experts down(act(gate(x)) * up(x)) "
                "(relu2 the one non-gated activation) and is not used for this model "
                "(found no MoE experts module it can run)"
            )
        raise UnsupportedExpertsError(
            f"{type(model).__name__}: found no MoE experts module (looked for transformers' fused "
            "experts with 3-D gate_up_proj/down_proj and for an nn.ModuleList named 'experts' of "
            "gated MLPs); is this a Mixture-of-Experts model?"
        )
    with torch.no_grad():
        built: dict[int, MoEExperts] = {}
        if check:
            # One probe per kind of module, before anything is replaced, so an
            # unsupported model is left untouched. A kind is the class, the layout and
            # every scalar attribute of the instance: a per-layer clamp (Step-3.7's
            # swiglu_limits), alpha or bias flag makes its own kind, and is probed.
            chosen: dict[tuple, str] = {}
            for i, plan in enumerate(plans):
                kind = _probe_kind(plan)
                if kind in chosen:
                    plan.info = dataclasses.replace(plan.info, activation=chosen[kind])
                    continue
                probe = _probe_glu(plan)
                chosen[kind] = plan.info.activation
                if weight_format == "bf16" and converted is None:
                    built[i] = probe
                del probe
        if converted is not None:
            # Load (and verify) every layer before swapping any in, so a directory
            # that lacks a layer leaves the model untouched.
            for i, plan in enumerate(plans):
                built[i] = _load_converted(plan, converted)
        for i, plan in enumerate(plans):
            if i in built:
                new = built.pop(i)
            elif converted is not None:
                new = _load_converted(plan, converted)
            else:
                new = _build(plan, weight_format, **quant)[0]
            selection, counts = selections[i]
            if selection is not None:
                _place_gpu_experts(plan, new, selection, counts, from_model=converted is None)
            new.train(plan.module.training)
            _kt_experts(new).source_layout = _source_layout(plan)
            setattr(plan.parent, plan.attr, new)
            plan.module = None  # drop the reference held here to the dense weights
    counts = Counter(p.info.class_name for p in plans)
    first = plans[0].info
    n_gpu = sum(1 for sel, _ in selections if sel is not None)
    logger.info(
        "kt_ops: replaced %d experts modules of %s (%s; %d experts, hidden %d, intermediate %d) "
        "with MoEExperts(weight_format=%r)%s",
        len(plans),
        type(model).__name__,
        ", ".join(f"{n} x{c}" for n, c in counts.items()),
        first.num_experts,
        first.hidden_size,
        first.intermediate_size,
        weight_format,
        f", {n_gpu} of them with GPU-resident experts" if n_gpu else "",
    )
    keep_packed_experts_out_of_ddp(model)  # a plain DDP(model) keeps one copy of them
    return model


# --------------------------------------------------------------------------------------------
# GPU-resident experts (CPU/GPU hybrid)
# --------------------------------------------------------------------------------------------


def _gpu_selection_for(
    name: str,
    num_experts: int,
    num_gpu_experts: Optional[int],
    routing_stats,
    gpu_experts,
):
    """``(gpu_experts, routing_counts)`` for ``MoEExperts.set_gpu_experts`` of module ``name``."""
    if gpu_experts is not None:
        if isinstance(gpu_experts, dict):
            return gpu_experts.get(name), None
        return gpu_experts, None
    if not num_gpu_experts:
        return None, None
    counts = routing_stats.counts if isinstance(routing_stats, RoutingStats) else routing_stats
    if name not in counts:
        raise ValueError(
            f"routing_stats has no counts for the experts module '{name}' (it has "
            f"{sorted(counts)}); collect them on this model (kt_ops.hf.collect_routing_stats)"
        )
    if counts[name].shape != (num_experts,):
        raise ValueError(
            f"routing_stats['{name}'] has shape {list(counts[name].shape)}, expected "
            f"[E={num_experts}]"
        )
    return num_gpu_experts, counts[name]


def _check_gpu_args(where: str, num_gpu_experts, routing_stats, gpu_experts) -> None:
    if num_gpu_experts is not None and (
        isinstance(num_gpu_experts, bool) or not isinstance(num_gpu_experts, int)
    ):
        raise ValueError(f"{where}: num_gpu_experts must be an int >= 0, got {num_gpu_experts!r}")
    if num_gpu_experts is not None and num_gpu_experts < 0:
        raise ValueError(f"{where}: num_gpu_experts must be >= 0, got {num_gpu_experts}")
    if num_gpu_experts and gpu_experts is not None:
        raise ValueError(
            f"{where}: pass num_gpu_experts (with routing_stats) or gpu_experts, not both"
        )
    if num_gpu_experts and routing_stats is None:
        raise ValueError(
            f"{where}: num_gpu_experts={num_gpu_experts} picks the most used experts of each layer "
            "and needs routing_stats (kt_ops.hf.collect_routing_stats(model, input_ids) on a "
            "calibration prompt); or pass gpu_experts= to choose them"
        )
    if routing_stats is not None and not isinstance(routing_stats, (RoutingStats, dict)):
        raise ValueError(
            f"{where}: routing_stats must be a kt_ops.hf.RoutingStats or a dict "
            f"{{module name: [E] counts}}, got {type(routing_stats).__name__}"
        )


def set_gpu_experts(
    model: nn.Module,
    num_gpu_experts: Optional[int] = None,
    routing_stats: Optional[RoutingStats] = None,
    *,
    gpu_experts=None,
    dtype: Optional[torch.dtype] = None,
    device: Optional[Union[str, torch.device]] = None,
) -> nn.Module:
    """Choose the GPU-resident experts of every :class:`kt_ops.nn.MoEExperts` of ``model``.

    For a model already on kt_ops (:func:`replace_experts`); each module's
    chosen experts are dequantized from its packed weights
    (:meth:`MoEExperts.set_gpu_experts`). To keep the model's own dense
    weights instead, pass the same arguments to :func:`replace_experts`.

    Args:
        model: a model holding ``MoEExperts`` modules.
        num_gpu_experts: per layer, how many of the most hit experts of
            ``routing_stats`` go to the GPU (0: none, the layers become
            CPU-only again).
        routing_stats: a :class:`RoutingStats` (or ``{module name: [E]
            counts}``) from :func:`collect_routing_stats`.
        gpu_experts: instead of a count: one selection for every layer (a bool
            mask ``[E]`` or expert ids), or ``{module name: selection}`` (layers
            not in the dict get none).
        dtype: the dense weights' dtype (default: fp32 for a layer that has
            none yet, else unchanged).
        device: their device (default: unchanged, else the CPU); ``.to()``
            moves them later with the model.

    Returns:
        ``model``.

    Raises:
        ValueError: naming the argument: ``num_gpu_experts`` not an int in
            ``[0, E]``, without ``routing_stats`` or together with
            ``gpu_experts``; ``routing_stats`` lacking a layer or with another
            ``E``; a bad selection (see ``MoEExperts.set_gpu_experts``); or a
            model without ``MoEExperts`` (call :func:`replace_experts` first).
    """
    _check_gpu_args("set_gpu_experts", num_gpu_experts, routing_stats, gpu_experts)
    modules = [(n, m) for n, m in model.named_modules() if isinstance(m, MoEExperts)]
    if not modules:
        raise ValueError(
            f"set_gpu_experts: {type(model).__name__} has no kt_ops MoEExperts modules; call "
            "kt_ops.replace_experts(model, ...) first (it takes the same arguments)"
        )
    for name, module in modules:
        selection, counts = _gpu_selection_for(
            name, module.num_experts, num_gpu_experts, routing_stats, gpu_experts
        )
        module.set_gpu_experts(selection, routing_counts=counts, dtype=dtype, device=device)
    keep_packed_experts_out_of_ddp(model)
    return model
