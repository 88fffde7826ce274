#!/usr/bin/env python
"""Survey: every Mixture-of-Experts family of the installed transformers through replace_experts.

For each model type whose modeling code has routed experts (a ``*Experts`` class or an
``experts`` attribute), in its own subprocess: a tiny random model (the default config with
every size shrunk: hidden 64, 2 layers, 8 experts of intermediate 32, top-2; the experts'
weights rounded to bf16 so that kt_ops' default bf16 packing is exact), fp32; its logits
before and after ``kt_ops.replace_experts(model)``, then one backward pass. Outcome per
family:

* ``SERVED``: logits within 1e-3 relative and the same argmax, gradients reach the
  embeddings and equal the unmodified model's within 1e-3;
* ``REFUSED``: ``replace_experts`` raised ``UnsupportedExpertsError`` (the reason is kept);
* ``WRONG``: replaced, but the logits or gradients differ (a silent wrong result);
* ``CRASH``: anything else raised by kt_ops;
* ``NOT_BUILT``: the tiny model could not be built or run by transformers itself (its
  config needs more than this generic shrinking), so kt_ops was not tried.

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
}


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


def _shrink(config) -> None:
    for key, value in TINY.items():
        if hasattr(config, key) and isinstance(getattr(config, key), int):
            setattr(config, key, value)
    for key in ("layer_types", "mlp_layer_types"):
        v = getattr(config, key, None)
        if isinstance(v, list) and v:
            setattr(config, key, v[: config.num_hidden_layers])
    for sub in ("text_config",):
        inner = getattr(config, sub, None)
        if inner is not None and inner is not config:
            _shrink(inner)


def run_one(model_type: str) -> dict:
    """The survey of one family (in this process)."""
    import copy

    import torch
    import transformers

    import kt_ops
    from kt_ops.hf import UnsupportedExpertsError

    try:
        config = transformers.AutoConfig.for_model(model_type)
        _shrink(config)
        torch.manual_seed(0)
        try:
            model = transformers.AutoModelForCausalLM.from_config(config)
        except (ValueError, KeyError):
            model = transformers.AutoModel.from_config(config)
        model = model.float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "expert" in name:
                    p.copy_(p.bfloat16().float())
        vocab = getattr(getattr(config, "text_config", config), "vocab_size", 128) or 128
        ids = torch.randint(0, min(vocab, 128), (2, 9), generator=torch.Generator().manual_seed(1))
        reference = copy.deepcopy(model)
        with torch.no_grad():
            want = reference(input_ids=ids)
    except Exception as e:  # the tiny model itself: not kt_ops' business
        return {"family": model_type, "outcome": "NOT_BUILT", "why": f"{type(e).__name__}: {e}"}
    out = want.logits if hasattr(want, "logits") else want.last_hidden_state
    try:
        kt_ops.replace_experts(model)
    except UnsupportedExpertsError as e:
        return {"family": model_type, "outcome": "REFUSED", "why": str(e)[:300]}
    except Exception as e:
        return {"family": model_type, "outcome": "CRASH", "why": f"{type(e).__name__}: {e}"}
    try:
        with torch.no_grad():
            got = model(input_ids=ids)
        got = got.logits if hasattr(got, "logits") else got.last_hidden_state
        rel = float((got - out).norm() / out.norm().clamp_min(1e-30))
        same_argmax = bool(torch.equal(got.argmax(-1), out.argmax(-1)))
        # The backward in eval mode: the gradient math, without the training-time noise
        # some families add (PhiMoE's router jitter) that would differ between the runs.
        # The loss is the output against a fixed random tensor, not its squared norm: after
        # a final RMSNorm (a bare AutoModel's last_hidden_state) the gradient of |y|^2 is
        # parallel to y, which the norm's backward projects away, leaving only rounding
        # noise (inkling2 and minimax_m3_vl then "differed" by 7e-2 and 3e-3).
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
        grads = []
        for m in (model, reference):
            o = m(input_ids=ids)
            (
                (o.logits if hasattr(o, "logits") else o.last_hidden_state).float() * probe
            ).sum().backward()
            grads.append(m.get_input_embeddings().weight.grad)
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
