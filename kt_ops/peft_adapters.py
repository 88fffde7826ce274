"""PEFT adapters of the routed experts: save kt_ops LoRA as PEFT adapters, load PEFT adapters.

kt_ops keeps the LoRA of an experts module as stacked tensors (``A [E, r, in]``,
``B [E, out, r]`` per projection, see :func:`kt_ops.lora.add_lora`).
This module converts them, exactly, to and from the two ways PEFT adapts
experts of the *original* (unconverted) transformers model, so that

* an adapter trained with kt_ops saves (:func:`save_pretrained`) into a PEFT
  adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)
  that ``peft.PeftModel.from_pretrained(plain_model, path)`` loads, with no
  kt_ops installed, and gives the same outputs;
* an adapter trained with plain PEFT loads into a kt_ops model
  (:func:`load_adapter`) with the same outputs.

The two PEFT formats (peft 0.21, ``peft/tuners/lora/layer.py``):

**Fused 3-D expert parameters** (transformers >= 5: ``experts.gate_up_proj``
``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``), adapted with
``LoraConfig(target_parameters=[...])``. PEFT's ``ParamWrapper`` keeps for a
parameter ``[E, out, in]`` (``[E, in, out]`` when the module ``is_transposed``)
``lora_A.weight [r*E, in]`` and ``lora_B.weight [out, r*E]``, and its delta is
``delta[e] = scaling * B_e @ A_e`` with::

    A_e = lora_A.weight.reshape(E, r, in)[e]                    # rows e*r .. e*r+r-1
    B_e = lora_B.weight.reshape(out, r, E).permute(2, 0, 1)[e]  # column j*E + e is B_e[:, j]

``gate_up_proj`` is one rank-r adapter of all ``2I`` output rows: gate and up
share ``A`` and own the gate / up rows of ``B`` (rows ``[:I]`` / ``[I:]``, or
even / odd rows for ``is_concatenated=False``). Two parameters of one module
nest two ``ParamWrapper`` s; the one of the parameter registered first is
innermost, so its keys read ``experts.base_layer.lora_A.weight`` and the
other's ``experts.lora_A.weight``. kt_ops adapters with separate gate and up
``A`` export as one block-diagonal adapter of rank ``r_gate + r_up`` (exact).

**Per-expert nn.Linear** (an ``nn.ModuleList`` of expert MLPs, and every
adapter of the transformers-v4 MoE models), adapted with ``target_modules``:
``experts.{e}.gate_proj.lora_A.weight [r, H]``, ``...lora_B.weight [I, r]``
(``w1``/``w3``/``w2`` in Mixtral-style MLPs). Such adapters load into kt_ops
models of either layout. Saved in this style from fused experts
(``style='modules'``), plain PEFT loads them into the fused v5 model only where
it converts v4 adapters (model types with a transformers conversion mapping,
e.g. Qwen3-MoE; not Qwen2-MoE in transformers 5.23, and Mixtral's v4 names are
``w1``/``w3``/``w2``): the default ``style='auto'`` saves fused experts as
``target_parameters``, which load everywhere.

Scaling: PEFT's ``alpha / r`` (``alpha / sqrt(r)`` with ``use_rslora``),
per target through ``rank_pattern`` / ``alpha_pattern``. kt_ops has one
``lora_scaling`` per experts module; a different factor of another projection
is folded into its ``B`` on import.

Only plain LoRA converts: DoRA, LoRA biases and other PEFT methods raise
``ValueError``. ``target_parameters`` LoRA needs ``lora_dropout=0`` in PEFT.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
from typing import Optional, Union

import torch
from torch import Tensor, nn

from kt_ops.lora import (
    LORA_PROJECTIONS,
    lora_factors,
    lora_shapes,
    remove_lora,
    set_lora_factors,
)
from kt_ops.nn import MoEExperts

__all__ = [
    "PEFT_PREFIX",
    "adapter_tensors",
    "save_pretrained",
    "load_adapter",
    "load_adapter_weights",
]

logger = logging.getLogger(__name__)

#: Prefix of every key of a saved PEFT adapter (``PeftModel.base_model.model``).
PEFT_PREFIX = "base_model.model."

_WEIGHTS_NAME = "adapter_model.safetensors"
_DEFAULT_FUSED = {
    "layout": "fused",
    "concatenated": True,
    "transposed": False,
    "param_names": ("gate_up_proj", "down_proj"),
}
_LINEAR_NAMES = {
    ("gate_proj", "up_proj", "down_proj"): ("gate", "up", "down"),
    ("w1", "w3", "w2"): ("gate", "up", "down"),
}
_KT_PARAM = re.compile(r"\.(?:gate|up|down)_lora_[ab](?:\.[^.]+)?$")
_FUSED_KEY = re.compile(r"^((?:base_layer\.)*)lora_(A|B)\.weight$")
_LINEAR_KEY = re.compile(r"^(\d+)\.([A-Za-z_][A-Za-z0-9_]*)\.lora_(A|B)\.weight$")


#: The oldest peft that round-trips these adapters (tests/test_peft_adapters.py, 14/14 with
#: peft 0.20.0 and transformers 5.23.0). peft 0.18.1 (LLaMA-Factory 0.9.5's pin) lays out
#: ``target_parameters`` LoRA of fused 3-D experts differently: its ``from_pretrained`` fails
#: with a size mismatch of ``experts.lora_A.default.weight``; peft 0.19.1 fails on
#: transformers 5.23's weight-conversion API.
MIN_PEFT_VERSION = "0.20.0"


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(m) for m in re.findall(r"\d+", version.split("+")[0])[:3])


def _peft():
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - peft is in requirements.txt
        raise ImportError(
            f"kt_ops.peft_adapters needs the peft package (pip install 'peft>={MIN_PEFT_VERSION}')"
        ) from exc
    if _version_tuple(peft.__version__) < _version_tuple(MIN_PEFT_VERSION):
        raise ImportError(
            f"kt_ops.peft_adapters needs peft>={MIN_PEFT_VERSION}, found peft "
            f"{peft.__version__}: older peft lays out LoRA of fused 3-D experts "
            "(target_parameters) differently and fails to load these adapters with a size "
            f"mismatch; pip install 'peft>={MIN_PEFT_VERSION}'"
        )
    return peft


def _unwrap(model: nn.Module) -> tuple[nn.Module, bool]:
    """``(the model PEFT adapts, whether model is a PeftModel)``."""
    peft = _peft()
    if isinstance(model, peft.PeftModel):
        return model.base_model.model, True
    return model, False


def _experts_modules(base: nn.Module) -> dict[str, MoEExperts]:
    """kt_ops experts modules by qualified name (PEFT's ``.base_layer`` segments removed)."""
    out = {}
    for name, module in base.named_modules():
        if isinstance(module, MoEExperts):
            out[name.replace(".base_layer", "")] = module
    return out


def _layout(module: MoEExperts) -> dict:
    return getattr(module, "source_layout", None) or _DEFAULT_FUSED


def _peft_alpha(scaling: float, rank: int, use_rslora: bool) -> float:
    """The alpha giving ``scaling`` at ``rank`` under PEFT's scaling rule."""
    alpha = scaling * (math.sqrt(rank) if use_rslora else rank)
    return float(round(alpha)) if abs(alpha - round(alpha)) < 1e-9 else alpha


def _peft_scaling(alpha: float, rank: int, use_rslora: bool) -> float:
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


# --------------------------------------------------------------------------------------------
# kt_ops -> PEFT
# --------------------------------------------------------------------------------------------


def _fused_gate_up(module: MoEExperts, factors: dict) -> tuple[Tensor, Tensor]:
    """``(A [E, R, H], B [E, 2I, R])`` of the gate_up_proj adapter equal to kt's gate/up LoRA."""
    E, inter = module.num_experts, module.intermediate_size
    gate, up = factors.get("gate"), factors.get("up")
    if gate is not None and up is not None and gate[0] is up[0]:  # shared A: PEFT's own form
        a = gate[0].detach().float()
        b_gate, b_up = gate[1].detach().float(), up[1].detach().float()
    else:  # block-diagonal adapter of rank r_gate + r_up
        parts = [f for f in (gate, up) if f is not None]
        a = torch.cat([f[0].detach().float() for f in parts], dim=1)
        rg = gate[0].shape[1] if gate is not None else 0
        ru = up[0].shape[1] if up is not None else 0
        b_gate = torch.zeros(E, inter, rg + ru)
        b_up = torch.zeros(E, inter, rg + ru)
        if gate is not None:
            b_gate[:, :, :rg] = gate[1].detach().float()
        if up is not None:
            b_up[:, :, rg:] = up[1].detach().float()
    if _layout(module).get("concatenated", True):
        b = torch.cat([b_gate, b_up], dim=1)
    else:  # rows gate0, up0, gate1, up1, ...
        b = torch.stack([b_gate, b_up], dim=2).reshape(E, 2 * inter, -1)
    return a, b


def _flatten_param_lora(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Stacked ``A [E, R, in]``, ``B [E, out, R]`` -> PEFT ParamWrapper ``lora_A/B.weight``."""
    E, R, n_in = a.shape
    n_out = b.shape[1]
    return a.reshape(E * R, n_in).contiguous(), b.permute(1, 2, 0).reshape(
        n_out, R * E
    ).contiguous()


def adapter_tensors(
    model: nn.Module,
    *,
    style: str = "auto",
    use_rslora: bool = False,
    dtype: Optional[torch.dtype] = None,
) -> tuple[dict[str, Tensor], dict]:
    """The kt_ops expert adapters of ``model`` as PEFT adapter tensors and config entries.

    Args:
        model: a model with kt_ops LoRA (:func:`kt_ops.lora.apply_lora`), or a
            ``PeftModel`` wrapping one.
        style: ``'parameters'`` (fused 3-D parameters, ``target_parameters``),
            ``'modules'`` (per-expert nn.Linear, ``target_modules``) or
            ``'auto'``: the layout each module replaced (``source_layout``).
        use_rslora: write alphas for PEFT's rsLoRA scaling rule.
        dtype: dtype of the written tensors (default: fp32).

    Returns:
        ``(tensors, config)``: tensors keyed as PEFT saves them
        (``base_model.model.<module>...lora_A.weight``); ``config`` has
        ``target_parameters`` (qualified parameter names), ``target_modules``
        (leaf names such as ``['down_proj', 'gate_proj', 'up_proj']``, as
        adapters of per-expert experts always had, so that PEFT's own conversion
        of such adapters to transformers-v5 fused experts applies; or ``None``),
        ``rank_pattern``, ``alpha_pattern``.

    Raises:
        ValueError: no kt_ops experts module has LoRA, an unknown style, or a
            ``dtype`` that is not a floating dtype.
    """
    if style not in ("auto", "parameters", "modules"):
        raise ValueError(f"style must be 'auto', 'parameters' or 'modules', got {style!r}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"adapter_tensors: dtype must be a floating dtype, got {dtype!r}")
    base, _ = _unwrap(model)
    dtype = dtype or torch.float32
    tensors: dict[str, Tensor] = {}
    target_parameters: list[str] = []
    module_leaves: list[str] = []
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for name, module in _experts_modules(base).items():
        factors = lora_factors(module)
        if not factors:
            continue
        layout = _layout(module)
        if layout["layout"] not in ("fused", "module_list"):
            raise ValueError(
                f"{name}: experts replaced from the {layout['layout']!r} layout (DBRX's "
                "stacked mlp.w1/v1/w2, JetMoE's or Llama 4's block) have no PEFT adapter "
                "layout yet; save the LoRA factors "
                "with the model's state_dict ({p}_lora_a / {p}_lora_b)"
            )
        s = module.lora_scaling
        use_params = style == "parameters" or (style == "auto" and layout["layout"] == "fused")
        if use_params:
            entries = {}
            if "gate" in factors or "up" in factors:
                entries["gate_up_proj"] = _fused_gate_up(module, factors)
            if "down" in factors:
                a, b = factors["down"]
                entries["down_proj"] = (a.detach().float(), b.detach().float())
            order = list(layout.get("param_names") or _DEFAULT_FUSED["param_names"])
            order += [p for p in entries if p not in order]
            targeted = [p for p in order if p in entries]
            for i, pname in enumerate(targeted):
                a, b = entries[pname]
                rank = a.shape[1]
                nest = "base_layer." * (len(targeted) - 1 - i)
                a_w, b_w = _flatten_param_lora(a, b)
                key = f"{PEFT_PREFIX}{name}.{nest}"
                tensors[key + "lora_A.weight"] = a_w.to(dtype)
                tensors[key + "lora_B.weight"] = b_w.to(dtype)
                target = f"{name}.{pname}"
                target_parameters.append(target)
                rank_pattern[re.escape(target)] = rank
                alpha_pattern[re.escape(target)] = _peft_alpha(s, rank, use_rslora)
        else:
            names = layout.get("linear_names") or ("gate_proj", "up_proj", "down_proj")
            linear = dict(zip(LORA_PROJECTIONS, names))
            for proj, (a, b) in factors.items():
                rank = a.shape[1]
                a, b = a.detach().to(dtype), b.detach().to(dtype)
                for e in range(module.num_experts):
                    key = f"{PEFT_PREFIX}{name}.{e}.{linear[proj]}"
                    tensors[key + ".lora_A.weight"] = a[e].clone()  # own storage: gate and
                    tensors[key + ".lora_B.weight"] = b[e].clone()  # up may share one A
                pattern = rf"{re.escape(name)}\.\d+\.{linear[proj]}"
                rank_pattern[pattern] = rank
                alpha_pattern[pattern] = _peft_alpha(s, rank, use_rslora)
            module_leaves += [linear[p] for p in factors if linear[p] not in module_leaves]
    if not tensors:
        raise ValueError(
            f"{type(model).__name__} has no kt_ops experts with LoRA adapters; see "
            "kt_ops.lora.apply_lora"
        )
    config = {
        "target_parameters": target_parameters,
        "target_modules": sorted(module_leaves) or None,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }
    return tensors, config


def _drop_default_patterns(ours: dict, r: int, alpha: float) -> None:
    """Keep only rank/alpha pattern entries that differ from the config's ``r``/``lora_alpha``."""
    for key in list(ours["rank_pattern"]):
        if ours["rank_pattern"][key] == r and ours["alpha_pattern"][key] == alpha:
            del ours["rank_pattern"][key], ours["alpha_pattern"][key]


def _merge_config(cfg: dict, ours: dict) -> dict:
    """Add kt_ops' expert targets to a PEFT adapter_config.json dict (in place; returned)."""
    if ours["target_parameters"]:
        cfg["target_parameters"] = list(cfg.get("target_parameters") or []) + [
            t for t in ours["target_parameters"] if t not in (cfg.get("target_parameters") or [])
        ]
        if cfg.get("lora_dropout"):
            logger.warning(
                "kt_ops: PEFT's target_parameters LoRA needs lora_dropout=0; the saved "
                "adapter_config.json sets lora_dropout=0 (was %s), which only affects training",
                cfg["lora_dropout"],
            )
            cfg["lora_dropout"] = 0.0
    if ours["target_modules"]:
        existing = cfg.get("target_modules")
        leaves = "|".join(re.escape(t) for t in ours["target_modules"])
        if existing == "all-linear":
            pass  # already covers every nn.Linear of the original experts
        elif isinstance(existing, str):
            cfg["target_modules"] = rf"(?:{existing})|(?:.*\.)?(?:{leaves})"
        else:
            cfg["target_modules"] = sorted(set(existing or []) | set(ours["target_modules"]))
    for key in ("rank_pattern", "alpha_pattern"):
        # Ours first: PEFT takes the first matching pattern, and ours name exact targets.
        cfg[key] = {**ours[key], **(cfg.get(key) or {})}
    return cfg


def save_pretrained(
    model: nn.Module,
    save_directory: Union[str, os.PathLike],
    *,
    style: str = "auto",
    base_model_name_or_path: Optional[str] = None,
    task_type: Optional[str] = "auto",
    dtype: Optional[torch.dtype] = None,
    **peft_kwargs,
) -> str:
    """Save the LoRA adapters of a kt_ops model as a PEFT adapter of the original model.

    ``save_directory`` gets ``adapter_config.json`` and ``adapter_model.safetensors``
    in PEFT's format (see the module docstring for the key layout), loadable
    by ``peft.PeftModel.from_pretrained(original_model, save_directory)``
    without kt_ops, and by :func:`load_adapter`.

    * ``model`` with kt_ops LoRA only: the config is written here
      (``LoraConfig`` with the qualified ``target_parameters`` of the adapted
      experts and/or the leaf ``target_modules`` of per-expert layers; ranks and alphas that
      differ from the config's ``r``/``lora_alpha`` in ``rank_pattern`` /
      ``alpha_pattern``).
    * ``model`` a ``peft.PeftModel`` (PEFT LoRA on attention, shared experts ...
      plus kt_ops LoRA on the routed experts): PEFT's own ``save_pretrained``
      runs first, then the experts' tensors and targets are added to its files.

    Args:
        model: see above.
        save_directory: created if needed.
        style: ``'auto'``, ``'parameters'`` or ``'modules'`` (:func:`adapter_tensors`).
        base_model_name_or_path: recorded in the config (PeftModel: its own).
        task_type: PEFT task type; ``'auto'``: ``'CAUSAL_LM'`` for a
            ``*ForCausalLM`` model, else none.
        dtype: dtype of the saved expert tensors (default fp32).
        **peft_kwargs: passed to ``PeftModel.save_pretrained`` (PeftModel only).

    Returns:
        The directory holding the adapter files.

    Raises:
        ValueError: no kt_ops LoRA in ``model`` (:func:`adapter_tensors`).
    """
    peft = _peft()
    from safetensors.torch import load_file, save_file

    base, is_peft = _unwrap(model)
    save_directory = os.fspath(save_directory)
    os.makedirs(save_directory, exist_ok=True)
    if is_peft:
        config = model.peft_config[model.active_adapter]
        tensors, ours = adapter_tensors(
            model, style=style, use_rslora=bool(config.use_rslora), dtype=dtype
        )
        peft_kwargs.pop("safe_serialization", None)  # the merge below reads safetensors
        # The class's method: an instance may have this function patched in as its
        # save_pretrained (kt_ops.integrations.llamafactory does, for the HF Trainer).
        type(model).save_pretrained(model, save_directory, safe_serialization=True, **peft_kwargs)
        adapter = model.active_adapter
        out_dir = save_directory if adapter == "default" else os.path.join(save_directory, adapter)
        weights_path = os.path.join(out_dir, _WEIGHTS_NAME)
        saved = load_file(weights_path) if os.path.exists(weights_path) else {}
        # kt_ops' own parameter names (from a full state_dict passed by a Trainer) are not
        # PEFT keys: the experts are in ``tensors``, in PEFT's layout.
        saved = {k: v for k, v in saved.items() if not _KT_PARAM.search(k)}
        saved.update(tensors)
        save_file(saved, weights_path, metadata={"format": "pt"})
        config_path = os.path.join(out_dir, "adapter_config.json")
        with open(config_path) as f:
            cfg = json.load(f)
        with open(config_path, "w") as f:
            json.dump(_merge_config(cfg, ours), f, indent=2, sort_keys=True)
        return out_dir
    tensors, ours = adapter_tensors(model, style=style, dtype=dtype)
    pairs = list(zip(ours["rank_pattern"].values(), ours["alpha_pattern"].values()))
    r, alpha = max(set(pairs), key=pairs.count)  # the most common (rank, alpha): no pattern
    _drop_default_patterns(ours, r, alpha)
    if task_type == "auto":
        task_type = "CAUSAL_LM" if type(base).__name__.endswith("ForCausalLM") else None
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(base, "config", None), "_name_or_path", None)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=ours["target_modules"] or [],
        target_parameters=ours["target_parameters"] or None,
        rank_pattern=ours["rank_pattern"],
        alpha_pattern=ours["alpha_pattern"],
        lora_dropout=0.0,
        bias="none",
        task_type=task_type,
        base_model_name_or_path=base_model_name_or_path or None,
        inference_mode=True,
    )
    config.save_pretrained(save_directory)
    save_file(tensors, os.path.join(save_directory, _WEIGHTS_NAME), metadata={"format": "pt"})
    return save_directory


# --------------------------------------------------------------------------------------------
# PEFT -> kt_ops
# --------------------------------------------------------------------------------------------


def _pattern_value(patterns: dict, key: str, default):
    from peft.utils.other import get_pattern_key

    if not patterns:
        return default
    return patterns.get(get_pattern_key(list(patterns), key), default)


def _check_lora_config(config) -> None:
    peft_type = str(getattr(config, "peft_type", ""))
    if not peft_type.endswith("LORA") or peft_type.endswith("ADALORA"):
        raise ValueError(f"only LoRA adapters convert to kt_ops, got peft_type={peft_type}")
    for flag, what in (("use_dora", "DoRA"), ("lora_bias", "LoRA biases")):
        if getattr(config, flag, False):
            raise ValueError(f"kt_ops experts do not support {what} ({flag}=True)")


def load_adapter_weights(
    model: nn.Module,
    tensors: dict[str, Tensor],
    config,
    *,
    dtype: torch.dtype = torch.float32,
    trainable: bool = False,
) -> dict[str, Tensor]:
    """Install the experts' tensors of a PEFT LoRA adapter into the kt_ops experts of ``model``.

    Args:
        model: a kt_ops model (``replace_experts``) without expert LoRA yet, or a
            PeftModel wrapping one.
        tensors: the adapter's state dict as PEFT saves it (``load_peft_weights``).
        config: its ``peft.LoraConfig`` (``r``, ``lora_alpha``, ``rank_pattern``,
            ``alpha_pattern``, ``use_rslora``).
        dtype: dtype of the kt_ops LoRA parameters.
        trainable: ``requires_grad`` of the new parameters.

    Returns:
        The tensors that do not belong to a kt_ops experts module (for PEFT).

    Raises:
        ValueError: DoRA / LoRA bias / not LoRA, an experts module's tensors
            that are incomplete, of unexpected shapes, or in both styles, or a
            rank that disagrees with ``rank_pattern``.
    """
    _check_lora_config(config)
    base, _ = _unwrap(model)
    modules = _experts_modules(base)
    names = sorted(modules, key=len, reverse=True)
    rest: dict[str, Tensor] = {}
    grouped: dict[str, dict[str, Tensor]] = {}
    for key, t in tensors.items():
        k = key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key
        owner = next((n for n in names if k.startswith(n + ".")), None)
        if owner is None:
            rest[key] = t
            continue
        grouped.setdefault(owner, {})[k[len(owner) + 1 :]] = t
    use_rslora = bool(getattr(config, "use_rslora", False))
    for name, sub in grouped.items():
        module = modules[name]
        factors, scales = _module_factors(name, module, sub, config, use_rslora)
        s = next(iter(scales.values()))
        folded = {}
        for proj, (a, b) in factors.items():
            folded[proj] = (a, b * (scales[proj] / s) if scales[proj] != s else b)
        remove_lora(module)
        set_lora_factors(module, folded, s, dtype=dtype, requires_grad=trainable)
    return rest


def _module_factors(name: str, module: MoEExperts, sub: dict, config, use_rslora: bool):
    """``({proj: (A, B)}, {proj: scaling})`` of one experts module from its adapter keys."""
    E, H, inter = module.num_experts, module.hidden_size, module.intermediate_size
    fused, linear, bad = {}, {}, []
    for k, t in sub.items():
        m = _FUSED_KEY.match(k)
        if m:
            fused.setdefault(m.group(1), {})[m.group(2)] = t.float()
            continue
        m = _LINEAR_KEY.match(k)
        if m:
            linear.setdefault(m.group(2), {}).setdefault(int(m.group(1)), {})[m.group(3)] = t
            continue
        bad.append(k)
    if bad:
        raise ValueError(
            f"{name}: adapter tensors {sorted(bad)[:4]} are not plain LoRA A/B weights "
            "(DoRA magnitudes, biases or another PEFT method?); kt_ops cannot use them"
        )
    if fused and linear:
        raise ValueError(f"{name}: adapter mixes fused-parameter and per-expert nn.Linear keys")
    factors, scales = {}, {}

    def scaling_of(target: str, rank: int) -> float:
        r_cfg = _pattern_value(config.rank_pattern, target, config.r)
        if r_cfg != rank:
            raise ValueError(f"{target}: adapter tensors have rank {rank}, its config says {r_cfg}")
        alpha = _pattern_value(config.alpha_pattern, target, config.lora_alpha)
        return _peft_scaling(alpha, rank, use_rslora)

    layout = _layout(module)
    for nest, ab in fused.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{name}.{nest}: adapter has lora_{set(ab)} without its pair")
        a_w, b_w = ab["A"], ab["B"]
        n_in, n_out = a_w.shape[1], b_w.shape[0]
        if (n_in, n_out) == (H, 2 * inter):
            pname = "gate_up_proj"
        elif (n_in, n_out) == (inter, H):
            pname = "down_proj"
        else:
            raise ValueError(
                f"{name}: adapter tensors lora_A {tuple(a_w.shape)}, lora_B {tuple(b_w.shape)} fit "
                f"neither gate_up_proj (in {H}, out {2 * inter}) nor down_proj (in {inter}, "
                f"out {H}) of {E} experts"
            )
        if a_w.shape[0] % E or b_w.shape[1] != a_w.shape[0]:
            raise ValueError(f"{name}.{pname}: lora_A rows {a_w.shape[0]} are not rank x {E}")
        rank = a_w.shape[0] // E
        a = a_w.reshape(E, rank, n_in)
        b = b_w.reshape(n_out, rank, E).permute(2, 0, 1)
        s = scaling_of(f"{name}.{pname}", rank)
        if pname == "down_proj":
            factors["down"], scales["down"] = (a, b), s
        else:
            if layout.get("concatenated", True):
                b_gate, b_up = b[:, :inter], b[:, inter:]
            else:
                b_gate, b_up = b[:, 0::2], b[:, 1::2]
            factors["gate"], factors["up"] = (a, b_gate), (a, b_up)  # one shared A
            scales["gate"] = scales["up"] = s
    if linear:
        names = layout.get("linear_names")
        mapping = {}
        for known, projs in _LINEAR_NAMES.items():
            if names is None or tuple(names) == known:
                mapping.update(zip(known, projs))
        for lname, per_expert in linear.items():
            proj = mapping.get(lname)
            if proj is None:
                raise ValueError(f"{name}: unknown expert projection {lname!r} in the adapter")
            if sorted(per_expert) != list(range(E)) or any(
                set(v) != {"A", "B"} for v in per_expert.values()
            ):
                raise ValueError(
                    f"{name}: the adapter of {lname} must have lora_A and lora_B for each of "
                    f"the {E} experts"
                )
            rank = per_expert[0]["A"].shape[0] if per_expert[0]["A"].dim() == 2 else -1
            want = lora_shapes(module, proj, rank)
            for e, v in per_expert.items():  # each expert's pair, before stacking them
                if (tuple(v["A"].shape), tuple(v["B"].shape)) != (want[0][1:], want[1][1:]):
                    raise ValueError(
                        f"{name}.{e}.{lname}: lora_A {tuple(v['A'].shape)}, lora_B "
                        f"{tuple(v['B'].shape)}; expected {want[0][1:]}, {want[1][1:]} (rank "
                        f"{rank}, that of expert 0)"
                    )
            a = torch.stack([per_expert[e]["A"].float() for e in range(E)])
            b = torch.stack([per_expert[e]["B"].float() for e in range(E)])
            factors[proj] = (a, b)  # of the shapes `want` (each expert's pair checked)
            scales[proj] = scaling_of(f"{name}.0.{lname}", a.shape[1])
    return factors, scales


def _param_targets_present(base: nn.Module, targets) -> list[str]:
    keys = [
        f"{n}.{p}" for n, m in base.named_modules() for p, _ in m.named_parameters(recurse=False)
    ]
    return [t for t in targets if any(k == t or k.endswith("." + t) for k in keys)]


def load_adapter(
    model: nn.Module,
    adapter: Union[str, os.PathLike],
    *,
    is_trainable: bool = False,
    adapter_name: str = "default",
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Load a PEFT LoRA adapter of the original model into a kt_ops model.

    The experts' tensors (either PEFT format, see the module docstring) become
    kt_ops LoRA of the :class:`~kt_ops.nn.MoEExperts` (exact conversion,
    scaling folded per projection). Whatever else the adapter adapts
    (attention, shared experts, router ...) is loaded by PEFT itself: the
    model is then wrapped in a ``PeftModel`` whose config keeps the targets
    that exist in the kt_ops model.

    Args:
        model: a model after :func:`kt_ops.replace_experts`, without adapters.
        adapter: a local adapter directory (``adapter_config.json`` +
            ``adapter_model.safetensors``/``.bin``).
        is_trainable: make the loaded adapters trainable (PEFT's meaning).
        adapter_name: the PEFT adapter name.
        dtype: dtype of the kt_ops LoRA parameters.

    Returns:
        ``model`` (experts-only adapter) or a ``peft.PeftModel`` wrapping it.

    Raises:
        ValueError: not a LoRA adapter, DoRA / LoRA bias, tensors that do not
            fit the model, or non-expert tensors whose targets the model lacks.
    """
    peft = _peft()
    from peft.tuners.tuners_utils import check_target_module_exists
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    if isinstance(model, peft.PeftModel):
        raise ValueError("load_adapter: pass the kt_ops model itself, not a PeftModel")
    adapter = os.fspath(adapter)
    config = peft.PeftConfig.from_pretrained(adapter)
    tensors = load_peft_weights(adapter, device="cpu")
    rest = load_adapter_weights(model, tensors, config, dtype=dtype, trainable=is_trainable)
    kt_names = set(_experts_modules(model))
    cfg = copy.deepcopy(config)
    cfg.target_parameters = _param_targets_present(model, config.target_parameters or [])
    names = [n for n, _ in model.named_modules() if n and n not in kt_names]
    if cfg.target_modules and not any(check_target_module_exists(cfg, n) for n in names):
        cfg.target_modules = []
    if not cfg.target_modules and not cfg.target_parameters:
        if rest:
            raise ValueError(
                f"load_adapter: {len(rest)} adapter tensors (e.g. {next(iter(rest))}) belong to "
                "no kt_ops experts module and no target of the adapter exists in the model"
            )
        return model
    cfg.inference_mode = not is_trainable
    peft_model = peft.get_peft_model(model, cfg, adapter_name=adapter_name)
    result = set_peft_model_state_dict(peft_model, rest, adapter_name=adapter_name)
    ours = {f"{n}." for n in _experts_modules(peft_model.base_model.model)}
    missing = [
        k
        for k in result.missing_keys
        if "lora_" in k and not any(o in k.replace(".base_layer", "") for o in ours)
    ]
    if missing:
        logger.warning("kt_ops: adapter tensors missing for %d PEFT parameters", len(missing))
    for mod in _experts_modules(peft_model.base_model.model).values():
        for _, p in mod.named_parameters(recurse=False):
            p.requires_grad_(is_trainable)
    if not is_trainable:
        peft_model.eval()
    return peft_model
