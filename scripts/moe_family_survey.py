#!/usr/bin/env python
"""Survey: every Mixture-of-Experts family of the installed transformers through replace_experts.

For each model type whose modeling code has routed experts (a ``*Experts`` class or an
``experts`` attribute), in its own subprocess: a tiny random model (the default config with
every size shrunk: hidden 64, 2-4 layers, 8 experts of intermediate 32, top-2; the experts'
weights rounded to bf16 so that kt_ops' default bf16 packing is exact), fp32; its output
before and after ``kt_ops.replace_experts(model)``, then one backward pass. The tiny config:

* the part that holds the experts: a multimodal config's language model (its text config,
  built by the auto class of its model type or by its modeling module's own model class),
  an encoder-decoder's whole config, a vision backbone's config;
* TINY's sizes under the config's own attribute names, in sub-configs too (DBRX's
  ``attn_config``/``ffn_config``) and in per-layer overrides (``per_layer_config``);
* the layers kept: the first of each distinct kind of every per-layer list
  (``layer_types``, ``mlp_layer_types``, ...), so a hybrid model keeps an attention layer
  and a dense-first model a sparse one; special token ids inside the tiny vocabulary;
  mrope sections and MLA head dims consistent with the tiny heads;
* ``OVERRIDES``: a few per-family fields where the default config cannot build a model.

The inputs: token ids (and decoder ids for an encoder-decoder; the decoder's logits are
compared), or a tiny image for a vision backbone (its feature maps are compared, gradients
w.r.t. the pixels). Outcome per family:

* ``SERVED``: outputs within 1e-3 relative and the same argmax, gradients (of a fixed random
  projection of the output) reach the input embeddings and equal the unmodified model's
  within 1e-3;
* ``REFUSED``: ``replace_experts`` raised ``UnsupportedExpertsError`` (the reason is kept);
* ``WRONG``: replaced, but the outputs or gradients differ (a silent wrong result);
* ``CRASH``: anything else raised by kt_ops;
* ``NOT_BUILT``: the tiny model could not be built or run by transformers itself, or it has
  no experts module with at least 4 experts (its config needs more than this shrinking), so
  kt_ops was not tried.

Usage::

    python scripts/moe_family_survey.py                 # every family, a markdown table
    python scripts/moe_family_survey.py qwen3_moe jetmoe  # some
    python scripts/moe_family_survey.py --json out.json

``tests/test_moe_family_survey.py`` runs a fixed slice in the suite and fails on any
WRONG or CRASH (``KT_OPS_SURVEY_ALL=1``: every family).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

TINY = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "ffn_hidden_size": 32,
    "shared_expert_intermediate_size": 32,
    "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_top_k": 2,
    "top_k": 2,
    "top_k_experts": 2,
    "first_k_dense_replace": 0,
    "n_shared_experts": 1,
    "max_position_embeddings": 256,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
    "sliding_window": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16,
    "num_experts_per_token": 2,
    "num_expert_group": 1,
    "shared_intermediate_size": 32,
    # linear attention (Gated DeltaNet, KDA, ...) and Mamba mixers
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_head_dim": 16,
    "linear_num_heads": 4,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "num_layers": 2,
    "num_dense_layers": 0,
    "zero_expert_num": 2,
    "num_sliding_attention_heads": 4,
    # encoder-decoder models (NLLB-MoE, Switch Transformers)
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_decoder_layers": 2,
    "num_sparse_encoder_layers": 1,
    "num_sparse_decoder_layers": 1,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "d_ff": 64,
    "d_kv": 16,
    "hc_lowrank": 16,
}

#: Keys of TINY that are filled in even where the default config leaves them None: the
#: experts' count, size and top-k (a default config may describe the dense variant), and
#: head_dim (None: hidden_size // num_attention_heads in most families, 16 here too).
FILL_NONE = {
    "head_dim",
    "num_experts",
    "n_routed_experts",
    "num_experts_per_tok",
    "top_k_experts",
    "moe_intermediate_size",
}

#: Boolean switches that turn a family's MoE block on (set True where present).
MOE_SWITCHES = ("enable_moe_block",)

#: Per-family config fields (the tiny values, merged in after the generic shrinking), where
#: the default config cannot build a working model or a generic rule cannot do it.
OVERRIDES: dict[str, dict] = {
    # DbrxAttention reads attn_config.rope_theta and clamps to clip_qkv, which only
    # checkpoints' configs carry (DBRX's: 500000, 8)
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    # its default mlp_layer_types are None, which its layers index (checkpoints: dense first)
    "deepseek_ocr2": {"mlp_layer_types": ["dense", "sparse"]},
    # its default n_shared_experts is None, which its MoE block multiplies by
    "dots1": {"n_shared_experts": 1},
    # its default layer_types are all Mamba: a cache needs one attention layer
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    # its default layer_types are None, which its layers index
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    # its default has indexed-attention layers but leaves the QSA indexer's sizes None
    "qwen4_exp": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
    },
    # its attention reads a sliding window, which its default leaves None
    "step3p7": {"sliding_window": 16},
    # a vision backbone: tiny images of 4x4 patches; its MoE produces `part_features` of
    # the hidden size; the output is the last of the tiny stages (its default: stage 12)
    "vitpose_backbone": {
        "image_size": [32, 32],
        "patch_size": [8, 8],
        "part_features": 16,
        "stage_names": ["stem", "stage1", "stage2"],
        "out_features": ["stage2"],
        "out_indices": [2],
    },
    # its config accepts top-1 only
    "zaya": {"num_experts_per_tok": 1},
}


def _merge(d: dict, extra: dict) -> None:
    """``extra`` into ``d`` (in place), merging nested dicts."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            _merge(d[key], value)
        else:
            d[key] = value


def moe_model_types() -> list[str]:
    """Model types whose modeling code has routed experts."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    root = Path(transformers.__file__).parent / "models"
    out = []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        folder = root / model_type.replace("-", "_")
        files = list(folder.glob("modeling_*.py")) if folder.is_dir() else []
        text = "".join(f.read_text(errors="ignore") for f in files)
        if re.search(r"class \w+Experts\(|self\.experts\s*=", text):
            out.append(model_type)
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_layer_refs(values: list) -> bool:
    """A per-layer list of layer indices (each layer's source layer, e.g. its KV cache's)."""
    return all(_is_int(v) and 0 <= v <= i for i, v in enumerate(values)) and len(set(values)) > 2


def _is_layer_set(key: str, values, n_layers: int) -> bool:
    """A set of layer indices (e.g. ``mlp_only_layers``: the dense ones)."""
    return (
        key.endswith("_layers")
        and isinstance(values, list)
        and 0 < len(values) < n_layers
        and all(_is_int(v) and 0 <= v < n_layers for v in values)
    )


def _pick_layers(d: dict, n_layers: int) -> list[int]:
    """Layers to keep: the first of each distinct kind in every per-layer list (a list as
    long as the model's layers, e.g. ``layer_types``, ``mlp_layer_types``) and of each
    distinct ``per_layer_config`` override, in and out of every set of layers (e.g.
    ``mlp_only_layers``), at least TINY's layer count."""
    keep: set[int] = set()
    per_layer = [
        v
        for v in d.values()
        if isinstance(v, list) and len(v) == n_layers and not _is_layer_refs(v)
    ]
    per_layer += [
        [i in v for i in range(n_layers)] for k, v in d.items() if _is_layer_set(k, v, n_layers)
    ]
    overrides = {int(k): v for k, v in (d.get("per_layer_config") or {}).items()}
    if overrides:
        per_layer.append([overrides.get(i, {}) for i in range(n_layers)])
    for values in per_layer:
        seen = set()
        for i, v in enumerate(values):
            key = json.dumps(v, sort_keys=True, default=str)
            if key not in seen:
                seen.add(key)
                keep.add(i)
    i = 0
    while len(keep) < min(TINY["num_hidden_layers"], n_layers):
        keep.add(i)
        i += 1
    return sorted(keep)


def _shrink_values(d: dict, amap: dict) -> None:
    """TINY's sizes into a config dict (in place), under the config's own attribute names."""
    for key, value in TINY.items():
        real = amap.get(key, key)
        v = d.get(real)
        # (a 0 stays: it turns a feature off, e.g. NoPE's qk_rope_head_dim, no shared experts)
        if real in d and ((_is_int(v) and v > 0) or (v is None and key in FILL_NONE)):
            d[real] = value
        elif isinstance(v, list) and v and all(_is_int(x) and x > 0 for x in v):
            # one size per layer or per kind of experts (ERNIE-VL's text and vision experts)
            d[real] = [value] * len(v)
    for key in MOE_SWITCHES:
        if isinstance(d.get(key), bool):
            d[key] = True
    for key in list(d):
        # Period/offset layer patterns (Jamba): every other layer, keeping the offset parity.
        if key.endswith("_layer_period") and _is_int(d[key]):
            d[key] = 2
        elif key.endswith("_layer_offset") and _is_int(d[key]):
            d[key] = d[key] % 2
        # Every n-th layer sparse: every other one at most (one of the two tiny layers).
        elif key.endswith("sparse_step") and _is_int(d[key]):
            d[key] = min(d[key], 2)


def _default_mrope_section(config_class) -> list[int] | None:
    """The ``mrope_section`` a family's modeling code uses where its config has none."""
    import importlib.util

    module = getattr(config_class, "__module__", "").replace(".configuration_", ".modeling_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    m = re.search(r'get\(\s*"mrope_section"\s*,\s*\[([\d,\s]+)\]', Path(spec.origin).read_text())
    return [int(x) for x in m.group(1).split(",") if x.strip()] if m else None


def _fit_rope(rope, head_dim: int) -> None:
    """mrope sections (halves of the rotary dims per axis) rescaled to the shrunk head dim."""
    if isinstance(rope, dict):
        section = rope.get("mrope_section")
        if isinstance(section, list) and section and all(_is_int(x) for x in section):
            rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
            total, want = sum(section), rotary // 2
            if total != want:
                new = [max(1, x * want // total) for x in section]
                new[-1] += want - sum(new)
                rope["mrope_section"] = new
        for v in rope.values():
            _fit_rope(v, head_dim)


def _tiny_dict(d: dict, config_class) -> dict:
    """A config dict with every size shrunk (recursing into sub-configs)."""
    d = dict(d)
    amap = dict(getattr(config_class, "attribute_map", {}) or {})
    layers_key = amap.get("num_hidden_layers", "num_hidden_layers")
    if layers_key not in d:
        layers_key = next((k for k in ("num_layers", "n_layers") if k in d), layers_key)
    n_layers = d.get(layers_key)
    orig = dict(d)
    _shrink_values(d, amap)
    # MLA: where head_dim is the rotary part of a head (qk_rope_head_dim), it stays so, and
    # there are no grouped key/value heads (they all come from the latent).
    if "head_dim" in d and _is_int(orig.get("qk_rope_head_dim")):
        if orig["head_dim"] == orig["qk_rope_head_dim"]:
            d["head_dim"] = d["qk_rope_head_dim"]
    if _is_int(d.get("qk_head_dim")) and _is_int(d.get("qk_nope_head_dim")):
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    mla = _is_int(d.get("kv_lora_rank"))
    if mla and _is_int(d.get(amap.get("num_key_value_heads", "num_key_value_heads"))):
        d[amap.get("num_key_value_heads", "num_key_value_heads")] = d[
            amap.get("num_attention_heads", "num_attention_heads")
        ]
    # Special token ids inside the shrunk vocabulary (an embedding's padding_idx, ...).
    vocab = d.get(amap.get("vocab_size", "vocab_size"))
    if _is_int(vocab):
        for key, v in d.items():
            if key.endswith("_token_id") or key.endswith("_token_index"):
                if _is_int(v) and v >= vocab:
                    d[key] = v % vocab
                elif isinstance(v, list):
                    d[key] = [x % vocab if _is_int(x) else x for x in v]
    # Per-layer lists and overrides: keep one layer of each kind.
    if _is_int(n_layers) and n_layers > TINY["num_hidden_layers"]:
        keep = _pick_layers(d, n_layers)
        d[layers_key] = len(keep)
        for key, v in list(d.items()):
            if isinstance(v, list) and len(v) == n_layers and _is_layer_refs(v):
                # a kept layer's source layer, or itself where that one is dropped
                d[key] = [keep.index(v[i]) if v[i] in keep else j for j, i in enumerate(keep)]
            elif isinstance(v, list) and len(v) == n_layers:
                d[key] = [v[i] for i in keep]
            elif _is_layer_set(key, v, n_layers):
                d[key] = [new for new, old in enumerate(keep) if old in v]
        overrides = d.get("per_layer_config")
        if overrides:
            by_index = {int(k): v for k, v in overrides.items()}
            d["per_layer_config"] = {
                new: _tiny_overrides(by_index[old], amap, mla)
                for new, old in enumerate(keep)
                if old in by_index
            }
    elif d.get("per_layer_config"):
        d["per_layer_config"] = {
            int(k): _tiny_overrides(v, amap, mla) for k, v in d["per_layer_config"].items()
        }
    head_dim = d.get("head_dim") if _is_int(d.get("head_dim")) else None
    if head_dim is None and _is_int(d.get(amap.get("hidden_size", "hidden_size"))):
        heads = d.get(amap.get("num_attention_heads", "num_attention_heads"))
        if _is_int(heads) and heads:
            head_dim = d[amap.get("hidden_size", "hidden_size")] // heads
    if head_dim:
        rope = d.get("rope_parameters")
        default = _default_mrope_section(config_class)
        if isinstance(rope, dict) and default and "mrope_section" not in rope:
            # the modeling code's default (sized for the full head): explicit, to be rescaled
            d["rope_parameters"] = rope = {**rope, "mrope_section": default}
        for key in ("rope_parameters", "rope_scaling"):
            _fit_rope(d.get(key), head_dim)
    # Sub-configs (DBRX's attn_config / ffn_config, a multimodal model's parts).
    subs = dict(getattr(config_class, "sub_configs", {}) or {})
    for key, v in list(d.items()):
        if isinstance(v, dict) and (key in subs or "model_type" in v):
            sub = subs.get(key)
            sub = getattr(sub, "config_class", sub)
            d[key] = _tiny_dict(v, sub if isinstance(sub, type) else None)
    return d


def _tiny_overrides(layer: dict, amap: dict, mla: bool) -> dict:
    """One layer's ``per_layer_config`` overrides, shrunk like the global config."""
    layer = dict(layer)
    _shrink_values(layer, amap)
    heads, kv_heads = (amap.get(k, k) for k in ("num_attention_heads", "num_key_value_heads"))
    if mla and kv_heads in layer and heads in layer:
        layer[kv_heads] = layer[heads]
    return layer


def _tiny_config(model_type: str):
    """The tiny config of the part of ``model_type`` that holds its experts: the text (language
    model) part of a multimodal config, else the whole config."""
    import transformers

    config = transformers.AutoConfig.for_model(model_type)
    # (an encoder-decoder's flat config is the whole: not only its decoder's part)
    target = config if config.is_encoder_decoder else config.get_text_config(decoder=True)
    d = _tiny_dict(target.to_dict(), type(target))
    _merge(d, OVERRIDES.get(model_type, {}))
    return type(target).from_dict(d)


def _model_classes(config) -> list:
    """Classes that build a model from ``config``: the auto mappings of its model type
    (causal LM, seq2seq LM, backbone, base model), then its modeling module's own models."""
    import importlib
    import inspect

    import transformers
    from transformers.models.auto import modeling_auto as auto

    names = []
    for mapping in (
        auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
        auto.MODEL_FOR_BACKBONE_MAPPING_NAMES,
        auto.MODEL_MAPPING_NAMES,
    ):
        name = mapping.get(config.model_type)
        names += list(name) if isinstance(name, (list, tuple)) else [name] if name else []
    classes = [getattr(transformers, n) for n in names if hasattr(transformers, n)]
    module = type(config).__module__.replace(".configuration_", ".modeling_")
    try:
        own = [
            c
            for c in vars(importlib.import_module(module)).values()
            if inspect.isclass(c)
            and issubclass(c, transformers.PreTrainedModel)
            and getattr(c, "config_class", None) is type(config)
            and re.search(r"(ForCausalLM|ForConditionalGeneration|[^d]Model)$", c.__name__)
        ]
    except ImportError:
        own = []
    own.sort(key=lambda c: not c.__name__.endswith("ForCausalLM"))
    return classes + [c for c in own if c not in classes]


def _experts_summary(model, config) -> str:
    """The experts modules of ``model`` (count, fewest experts) and the top-k; raises where the
    tiny model lost its experts (fewer than 4 per module)."""
    counts = []
    for name, module in model.named_modules():
        if not (name.rsplit(".", 1)[-1] == "experts" or type(module).__name__.endswith("Experts")):
            continue
        if any(name.startswith(f"{n}.") for n, _ in counts):
            continue
        e = getattr(module, "num_experts", None)
        if not _is_int(e):
            if hasattr(module, "__len__"):  # a module list
                e = len(module)
            else:
                e = max((p.shape[0] for p in module.parameters() if p.dim() == 3), default=0)
        counts.append((name, e))
    if not counts:
        raise RuntimeError("the tiny model has no experts module")
    fewest = min(e for _, e in counts)
    if fewest < 4:
        raise RuntimeError(f"the tiny model has only {fewest} experts in a module")
    top_k = None
    for key in ("num_experts_per_tok", "moe_top_k", "top_k_experts", "top_k", "num_selects"):
        for c in (config, getattr(config, "ffn_config", None)):
            v = getattr(c, key, None) if c is not None else None
            if _is_int(v):
                top_k = v
                break
        if top_k is not None:
            break
    return f"{len(counts)} modules, >= {fewest} experts, top-k {top_k}"


def _build(model_type: str):
    """(model, inputs, pixel input name or None, experts summary) of the tiny model."""
    import inspect

    import torch

    config = _tiny_config(model_type)
    errors = []
    model = None
    for cls in _model_classes(config):
        try:
            torch.manual_seed(0)
            model = cls._from_config(config)
            break
        except Exception as e:
            errors.append(f"{cls.__name__}: {type(e).__name__}: {e}")
    if model is None:
        raise RuntimeError("; ".join(errors) or f"no model class for {type(config).__name__}")
    model = model.float().eval()
    summary = _experts_summary(model, config)
    g = torch.Generator().manual_seed(1)
    if model.main_input_name == "pixel_values":
        size = config.image_size
        h, w = (size, size) if _is_int(size) else size
        inputs = {"pixel_values": torch.randn(2, config.num_channels, h, w, generator=g)}
        if "dataset_index" in inspect.signature(model.forward).parameters:
            # VitPose: the experts are picked per image by its dataset index
            inputs["dataset_index"] = torch.tensor([1, config.num_experts - 1])
        return model, inputs, "pixel_values", summary
    vocab = min(getattr(config, "vocab_size", None) or 128, 128)
    special = set()
    for key in dir(config):
        if key.endswith("_token_id") or key.endswith("_token_index"):
            v = getattr(config, key, None)
            special |= set(v) if isinstance(v, list) else {v}
    allowed = torch.tensor([i for i in range(vocab) if i not in special])
    inputs = {"input_ids": allowed[torch.randint(0, len(allowed), (2, 9), generator=g)]}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = allowed[torch.randint(0, len(allowed), (2, 7), generator=g)]
    return model, inputs, None, summary


def _main_output(o):
    """The tensor compared: logits (the decoder's for an encoder-decoder), else the last hidden
    state, else a backbone's feature maps."""
    import torch

    for key in ("logits", "last_hidden_state"):
        v = getattr(o, key, None)
        if v is not None:
            return v
    maps = getattr(o, "feature_maps", None)
    if maps is not None:
        return torch.cat([m.flatten(1) for m in maps], 1)
    return o[0]


def run_one(model_type: str) -> dict:
    """The survey of one family (in this process)."""
    import copy

    import torch

    import kt_ops
    from kt_ops.hf import UnsupportedExpertsError

    try:
        model, inputs, pixel_key, summary = _build(model_type)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "expert" in name:
                    p.copy_(p.bfloat16().float())
        reference = copy.deepcopy(model)
        with torch.no_grad():
            out = _main_output(reference(**inputs))
    except Exception as e:  # the tiny model itself: not kt_ops' business
        return {"family": model_type, "outcome": "NOT_BUILT", "why": f"{type(e).__name__}: {e}"}
    try:
        kt_ops.replace_experts(model)
    except UnsupportedExpertsError as e:
        return {"family": model_type, "outcome": "REFUSED", "why": str(e)[:300], "experts": summary}
    except Exception as e:
        return {"family": model_type, "outcome": "CRASH", "why": f"{type(e).__name__}: {e}"}
    try:
        with torch.no_grad():
            got = _main_output(model(**inputs))
        rel = float((got - out).norm() / out.norm().clamp_min(1e-30))
        same_argmax = bool(torch.equal(got.argmax(-1), out.argmax(-1)))
        # The backward in eval mode: the gradient math, without the training-time noise
        # some families add (PhiMoE's router jitter) that would differ between the runs.
        # Gradients w.r.t. the input embeddings (shared by an encoder-decoder's two halves),
        # or w.r.t. the input pixels of a vision backbone, of a fixed random projection of the
        # output: a loss like mean(out**2) would be (nearly) invariant to the scale of a
        # final RMSNorm's input when the output is a normed hidden state, leaving a gradient
        # of rounding noise only.
        cotangent = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        grads = []
        for m in (model, reference):
            args = dict(inputs)
            if pixel_key:
                args[pixel_key] = inputs[pixel_key].clone().requires_grad_()
            (_main_output(m(**args)).float() * cotangent).sum().backward()
            grads.append(
                args[pixel_key].grad if pixel_key else m.get_input_embeddings().weight.grad
            )
        grad_rel = float((grads[0] - grads[1]).norm() / grads[1].norm().clamp_min(1e-30))
    except Exception as e:
        return {"family": model_type, "outcome": "CRASH", "why": f"{type(e).__name__}: {e}"}
    ok = rel < 1e-3 and same_argmax and grad_rel < 1e-3
    return {
        "family": model_type,
        "outcome": "SERVED" if ok else "WRONG",
        "rel": rel,
        "grad_rel": grad_rel,
        "same_argmax": same_argmax,
        "experts": summary,
    }


def survey(families: list[str], timeout: float = 300.0) -> list[dict]:
    """Each family in its own subprocess (a crash or a hang stays with it)."""
    results = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_OPS_")}
    env["HF_HUB_OFFLINE"] = "1"
    for family in families:
        cmd = [sys.executable, __file__, "--one", family]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
            res = json.loads(line) if line.startswith("{") else None
            if res is None:
                res = {"family": family, "outcome": "CRASH", "why": r.stderr[-500:]}
        except subprocess.TimeoutExpired:
            res = {"family": family, "outcome": "CRASH", "why": f"timeout after {timeout} s"}
        results.append(res)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", help="model types (default: every MoE family)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one)))
        return 0
    families = args.families or moe_model_types()
    results = survey(families)
    print("| family | outcome | detail |")
    print("|---|---|---|")
    for r in results:
        detail = r.get("why", "")
        if "rel" in r:
            detail = f"logits rel {r['rel']:.1e}, gradients rel {r['grad_rel']:.1e}"
        print(f"| {r['family']} | {r['outcome']} | {detail[:160].replace('|', '/')} |")
    counts = {}
    for r in results:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    print(f"\n{len(results)} families: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
