"""LLaMA-Factory LoRA SFT with the experts on kt_ops (kt_ops.integrations.llamafactory).

* Without LLaMA-Factory: the config handling (``kt_*`` keys, overrides) and the
  ``init_adapter`` hook, driven the way LLaMA-Factory's ``load_model`` drives it (a stand-in
  ``init_adapter`` that applies PEFT LoRA to ``lora_target`` as LLaMA-Factory's does): the
  experts move to kt_ops, both adapters train, and the PeftModel's ``save_pretrained`` writes
  one PEFT adapter that plain transformers + PEFT loads with the same outputs.
* With LLaMA-Factory importable: ``python -m kt_ops.integrations.llamafactory train`` on a
  tiny local Qwen3-MoE model and the repository's dataset for 6 steps; the loss falls and the
  saved adapter holds the experts' LoRA and loads into plain PEFT.

``llamafactory`` cannot join the main environment (pip would replace torch / transformers /
peft, see the module docstring of kt_ops.integrations.llamafactory). ``.ci/run`` runs this file
in the venv of ``scripts/setup_llamafactory.sh`` with ``KT_OPS_REQUIRE_LLAMAFACTORY=1``, which
turns the skip of the second part into a failure.
"""

# ruff: noqa: E741, F811

from __future__ import annotations

import copy
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from lora_helpers import (  # noqa: F401  (backend is a fixture)
    HAS_LORA_OP,
    LORA_OP_REASON,
    RTOL_FP32,
    backend,
    lm_loss,
    logits,
    randomize_lora_b_,
    rel_err,
    tiny_model,
)

peft = pytest.importorskip("peft")

from kt_ops.integrations import llamafactory as kt_lf  # noqa: E402
from kt_ops.lora import lora_parameters  # noqa: E402
from kt_ops.nn import MoEExperts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
YAML = ROOT / "examples" / "llamafactory_lora_sft.yaml"

LF_MISSING = (
    "llamafactory is not importable: llamafactory 0.9.5 requires transformers<=5.6.0, "
    "peft<=0.18.1, accelerate<=1.11.0 and torchaudio (no build for torch 2.13), so pip would "
    "replace the pinned torch 2.13.0 / transformers 5.23.0 / peft 0.21.2; run this test with "
    "the python that scripts/setup_llamafactory.sh prints (as .ci/run does)"
)
REQUIRE_LF = os.environ.get("KT_OPS_REQUIRE_LLAMAFACTORY") == "1"


# --------------------------------------------------------------------------------------------
# Without LLaMA-Factory
# --------------------------------------------------------------------------------------------


def test_config_keys_and_overrides(tmp_path):
    config = kt_lf.load_config(str(YAML), ["max_steps=3", "kt_lora_rank=4", "kt_num_threads=1"])
    assert config["max_steps"] == 3 and config["finetuning_type"] == "lora"
    lf_args, options = kt_lf.split_config(config)
    assert not any(k.startswith("kt_") for k in lf_args)
    assert options == kt_lf.KtOptions(
        lora_rank=4, lora_alpha=16, lora_projections=("gate", "up", "down"), num_threads=1
    )
    assert kt_lf.split_config({"kt_lora_projections": "up, down"})[1].lora_projections == (
        "up",
        "down",
    )
    with pytest.raises(ValueError, match="unknown kt_ops options \\['kt_rank'\\]"):
        kt_lf.split_config({"kt_rank": 4})
    with pytest.raises(ValueError, match="expected a subset of gate,up,down"):
        kt_lf.split_config({"kt_lora_projections": "gate,o_proj"})
    assert kt_lf.split_config({"kt_backward_panels": True})[1].backward_panels
    with pytest.raises(ValueError, match="kt_backward_panels: 'yes please'; expected true or"):
        kt_lf.split_config({"kt_backward_panels": "yes please"})
    with pytest.raises(ValueError, match="is not key=value"):
        kt_lf.load_config(str(YAML), ["max_steps"])


def lf_like_init_adapter(config, model, model_args, finetuning_args, is_trainable):
    """What LLaMA-Factory's init_adapter does for a new LoRA adapter (lora_target: q/v)."""
    lora_config = peft.LoraConfig(
        task_type=peft.TaskType.CAUSAL_LM,
        r=finetuning_args.lora_rank,
        lora_alpha=finetuning_args.lora_alpha,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=finetuning_args.lora_dropout,
    )
    model = peft.get_peft_model(model, lora_config)
    for p in filter(lambda p: p.requires_grad, model.parameters()):
        p.data = p.data.to(torch.float32)
    return model


def lf_args(**finetuning):
    model_args = types.SimpleNamespace(adapter_name_or_path=None)
    defaults = dict(
        finetuning_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.0, use_rslora=False
    )
    return model_args, types.SimpleNamespace(**{**defaults, **finetuning})


def test_init_adapter_hook(backend, tmp_path):
    plain = tiny_model("qwen3_moe")
    hook = kt_lf.make_init_adapter(lf_like_init_adapter, kt_lf.KtOptions(lora_rank=2))
    model_args, finetuning_args = lf_args()
    model = hook(plain.config, copy.deepcopy(plain), model_args, finetuning_args, True)
    assert isinstance(model, peft.PeftModel)
    experts = model.base_model.model.model.layers[0].mlp.experts
    assert isinstance(experts, MoEExperts)
    assert experts.gate_lora_a.shape[1] == 2 and experts.lora_scaling == 4.0  # kt rank 2, alpha 8
    kt_params = [p for _, p in lora_parameters(model)]
    assert kt_params and all(p.requires_grad for p in kt_params)  # re-enabled after PEFT
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("q_proj.lora_A" in n for n in trainable)
    assert not any("embed" in n or "mlp.gate." in n for n in trainable)

    randomize_lora_b_(model)
    # Both adapters train: one backward reaches PEFT's attention LoRA and kt_ops' experts'.
    lm_loss(model).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert any(
        "q_proj.lora_B" in n and g is not None and g.abs().sum() > 0 for n, g in grads.items()
    )
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in kt_params)
    model.zero_grad()
    want = logits(model)
    model.save_pretrained(str(tmp_path))  # what the HF Trainer calls: patched by the hook
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert len(config["target_parameters"]) == 4 and set(config["target_modules"]) == {
        "q_proj",
        "v_proj",
    }
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path)
    assert rel_err(logits(loaded), want) <= RTOL_FP32


def test_init_adapter_hook_keeps_backward_panels():
    plain = tiny_model("qwen3_moe", num_layers=1)
    options = kt_lf.KtOptions(lora_rank=2, backward_panels=True)
    model_args, finetuning_args = lf_args()
    hook = kt_lf.make_init_adapter(lf_like_init_adapter, options)
    model = hook(plain.config, copy.deepcopy(plain), model_args, finetuning_args, True)
    experts = model.base_model.model.model.layers[0].mlp.experts
    panels = experts.expert_weights().backward_panels
    avx512 = "avx512" in kt_lf.kt_ops.supported_isas()
    assert (panels is not None) == avx512  # bf16 experts: made wherever AVX-512 runs


def test_init_adapter_hook_errors():
    plain = tiny_model("qwen3_moe", num_layers=1)
    hook = kt_lf.make_init_adapter(lf_like_init_adapter)
    model_args, finetuning_args = lf_args(finetuning_type="full")
    with pytest.raises(ValueError, match="finetuning_type='full' is not supported"):
        hook(plain.config, plain, model_args, finetuning_args, True)
    model_args, finetuning_args = lf_args(use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        hook(plain.config, plain, model_args, finetuning_args, True)
    model_args.adapter_name_or_path = ["/some/adapter"]
    with pytest.raises(NotImplementedError, match="kt_ops.peft_adapters.load_adapter"):
        hook(plain.config, plain, model_args, finetuning_args, True)


# --------------------------------------------------------------------------------------------
# With LLaMA-Factory
# --------------------------------------------------------------------------------------------


def load_example():
    spec = importlib.util.spec_from_file_location("lora_sft", ROOT / "examples" / "lora_sft.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["lora_sft"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


TINY_MODEL_ARGS = [
    "--hidden-size", "64", "--moe-intermediate-size", "32", "--num-experts", "8",
    "--top-k", "2", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16",
    "--init-std", "0.2",
]  # fmt: skip


@pytest.mark.skipif(not HAS_LORA_OP, reason=LORA_OP_REASON)
def test_llamafactory_sft_runs_and_saves_the_adapter(tmp_path, monkeypatch):
    if REQUIRE_LF:
        import llamafactory  # noqa: F401  (CI: fail, do not skip)
    else:
        pytest.importorskip("llamafactory", reason=LF_MISSING)
    example = load_example()
    model_dir = tmp_path / "model"
    example.save_model(example.parse_args(TINY_MODEL_ARGS), model_dir)
    out = tmp_path / "out"
    monkeypatch.chdir(ROOT)  # dataset_dir in the YAML is relative to the repository
    assert (
        kt_lf.main(
            [
                "train",
                str(YAML),
                f"model_name_or_path={model_dir}",
                f"output_dir={out}",
                "max_steps=6",
                "per_device_train_batch_size=8",
                "kt_lora_rank=4",
                "kt_num_threads=1",
            ]
        )  # fmt: skip
        == 0
    )
    losses = [
        json.loads(line)["loss"]
        for line in (out / "trainer_log.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    config = json.loads((out / "adapter_config.json").read_text())
    assert "model.layers.0.mlp.experts.gate_up_proj" in config["target_parameters"]
    weights = peft.utils.load_peft_weights(str(out))
    assert "base_model.model.model.layers.1.mlp.experts.lora_B.weight" in weights
    assert weights["base_model.model.model.layers.1.mlp.experts.lora_B.weight"].abs().max() > 0

    # The saved adapter loads into plain transformers + PEFT and into kt_ops alike.
    import transformers

    from kt_ops import peft_adapters, replace_experts

    plain = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(plain), out)
    kt_model = peft_adapters.load_adapter(replace_experts(copy.deepcopy(plain)), out)
    want = logits(loaded)
    assert rel_err(logits(kt_model), want) <= RTOL_FP32
    assert rel_err(logits(plain), want) > 10 * RTOL_FP32


def test_llamafactory_sft_on_two_ranks(tmp_path):
    # examples/accelerate_multi_cpu.yaml: accelerate launches 2 ranks (gloo, CPU); each
    # trains its micro-batches with the experts on kt_ops, DDP syncs the LoRA gradients.
    if REQUIRE_LF:
        import llamafactory  # noqa: F401  (CI: fail, do not skip)
    else:
        pytest.importorskip("llamafactory", reason=LF_MISSING)
    pytest.importorskip("accelerate")
    import subprocess

    example = load_example()
    model_dir = tmp_path / "model"
    example.save_model(example.parse_args(TINY_MODEL_ARGS), model_dir)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KT_OPS_")}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file"]
    cmd += [str(ROOT / "examples" / "accelerate_multi_cpu.yaml"), "-m"]
    cmd += ["kt_ops.integrations.llamafactory", "train", str(YAML)]
    cmd += [f"model_name_or_path={model_dir}", f"output_dir={out}", "max_steps=6"]
    cmd += ["per_device_train_batch_size=4", "kt_lora_rank=4", "ddp_backend=gloo"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-6000:]
    assert "world size: 2" in r.stdout + r.stderr
    losses = [
        json.loads(line)["loss"]
        for line in (out / "trainer_log.jsonl").read_text().splitlines()
        if '"loss"' in line
    ]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    weights = peft.utils.load_peft_weights(str(out))  # saved by rank 0, loads in plain PEFT
    assert weights["base_model.model.model.layers.1.mlp.experts.lora_B.weight"].abs().max() > 0
