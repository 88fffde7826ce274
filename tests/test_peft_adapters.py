"""kt_ops LoRA <-> PEFT adapters (kt_ops.peft_adapters), both target styles, both directions.

* A kt_ops adapter saved with ``peft_adapters.save_pretrained`` loads into the plain
  transformers model with ``peft.PeftModel.from_pretrained`` (no kt_ops involved) and gives
  the same logits.
* A plain-PEFT adapter with nonzero B loads into a kt_ops model (``load_adapter``) with the
  same logits.

Formats: transformers' fused 3-D expert parameters (PEFT ``target_parameters``: ParamWrapper)
in every storage layout (concatenated / interleaved gate-up rows, transposed or not), and
per-expert ``nn.Linear`` (PEFT ``target_modules``) on a ModuleList of expert MLPs.

Tolerance: logits within ``RTOL_FP32 = 1e-4`` of max |logit| (fp32 model, bf16-valued expert
weights on both sides, so only summation order differs; a wrong row split, transposition,
expert order or scaling gives errors of order 1e-1..1). The converted adapter tensors
themselves are compared exactly where PEFT's are loaded into kt_ops (the conversion is a
reshape/permutation). The experts run on the kt op (the ``backend`` fixture: ``kt_op``; the
dense PyTorch reference stood in before ``kt::moe_backward`` landed).
"""

# ruff: noqa: E741, F811

from __future__ import annotations

import copy
import json

import pytest
import torch
from lora_helpers import (  # noqa: F401  (backend is a fixture)
    HAS_LORA_OP,
    INPUT_IDS,
    LORA_OP_REASON,
    RTOL_FP32,
    E,
    H,
    I,
    K,
    backend,
    kt_copy,
    lm_loss,
    logits,
    randomize_lora_b_,
    rel_err,
    tiny_model,
)
from torch import nn

peft = pytest.importorskip("peft")
import transformers  # noqa: E402
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

import kt_ops  # noqa: E402
from kt_ops import peft_adapters  # noqa: E402
from kt_ops.lora import (  # noqa: E402
    ExpertMLP,
    ExpertMLPList,
    apply_lora,
    lora_delta,
    lora_factors,
    lora_parameters,
    shares_gate_up_a,
    unfuse_experts,
)
from kt_ops.nn import MoEExperts  # noqa: E402


def peft_lora(model, **kwargs):
    """Plain PEFT LoRA with random A and B (init_lora_weights=False), on a copy of model."""
    torch.manual_seed(3)
    config = peft.LoraConfig(init_lora_weights=False, **kwargs)
    return peft.get_peft_model(copy.deepcopy(model), config)


# --------------------------------------------------------------------------------------------
# Plain PEFT -> kt_ops
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_peft_target_parameters_adapter_loads_into_kt(arch, backend, tmp_path):
    plain = tiny_model(arch)
    reference = peft_lora(
        plain,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj"],
        target_parameters=["gate_up_proj", "down_proj"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"down_proj": 3},
    )
    reference.save_pretrained(tmp_path)
    want = logits(reference)

    model = peft_adapters.load_adapter(kt_copy(plain), tmp_path)
    assert isinstance(model, peft.PeftModel)  # q_proj stays with PEFT
    experts = model.base_model.model.model.layers[0].mlp.experts
    assert isinstance(experts, MoEExperts) and shares_gate_up_a(experts)
    factors = lora_factors(experts)
    assert factors["gate"][0].shape == (E, 4, H) and factors["down"][0].shape == (E, 2, I)
    # The converted deltas equal PEFT's own, exactly.
    wrapper = reference.base_model.model.model.layers[0].mlp.experts  # down_proj (outer)
    gate_up, down = (
        wrapper.base_layer.get_delta_weight("default"),
        wrapper.get_delta_weight("default"),
    )
    assert torch.equal(lora_delta(experts, "gate"), gate_up[:, :I])
    assert torch.equal(lora_delta(experts, "up"), gate_up[:, I:])
    torch.testing.assert_close(lora_delta(experts, "down"), down, rtol=1e-6, atol=1e-7)
    assert experts.lora_scaling == 2.0  # gate_up: 8 / 4; down (3 / 2) folded into its B

    err = rel_err(logits(model), want)
    assert err <= RTOL_FP32, err
    assert rel_err(logits(kt_copy(plain)), want) > 100 * RTOL_FP32  # the adapter matters


class WithoutConfig(nn.Module):
    """A causal LM's body and head without its transformers config.

    PEFT converts adapters of per-expert nn.Linear (transformers v4) to the fused v5 experts
    of a transformers model; without a config it treats the model as plain PyTorch, so an
    unfused copy gets per-expert LoRA with v4 key names.
    """

    def __init__(self, causal_lm):
        super().__init__()
        self.model, self.lm_head = causal_lm.model, causal_lm.lm_head

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids=input_ids).last_hidden_state)


def out_logits(model, input_ids=INPUT_IDS):
    with torch.no_grad():
        out = model(input_ids=input_ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).float()


def test_peft_linear_targets_adapter_loads_into_kt(backend, tmp_path):
    """A v4-style adapter (experts.3.gate_proj.lora_A...) -> kt_ops == PEFT's own v4->v5 path."""
    plain = tiny_model("qwen3_moe")
    unfused = copy.deepcopy(plain)
    unfuse_experts(unfused)
    assert type(unfused.model.layers[0].mlp.experts).__name__ == "ExpertMLPList"
    v4 = peft_lora(
        WithoutConfig(unfused),
        r=4,
        lora_alpha=16,
        target_modules=["gate_proj", "up_proj", "down_proj", "k_proj"],
    )
    v4.save_pretrained(tmp_path)
    keys = peft.utils.load_peft_weights(str(tmp_path)).keys()
    assert "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight" in keys
    want = out_logits(v4)
    # Plain PEFT's conversion onto the fused v5 model agrees (an independent implementation).
    converted = peft.PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path)
    assert rel_err(out_logits(converted), want) <= RTOL_FP32

    model = peft_adapters.load_adapter(kt_copy(plain), tmp_path)
    experts = model.base_model.model.model.layers[1].mlp.experts
    assert not shares_gate_up_a(experts)  # one A per nn.Linear
    a, b = lora_factors(experts)["up"]
    lin = v4.base_model.model.model.layers[1].mlp.experts[5].up_proj
    assert torch.equal(a[5], lin.lora_A["default"].weight)
    assert torch.equal(b[5], lin.lora_B["default"].weight)
    err = rel_err(out_logits(model), want)
    assert err <= RTOL_FP32, err


def test_experts_only_adapter_returns_the_kt_model(backend, tmp_path):
    plain = tiny_model("olmoe")
    reference = peft_lora(plain, r=2, lora_alpha=4, target_parameters=["gate_up_proj"])
    reference.save_pretrained(tmp_path)
    kt_model = kt_copy(plain)
    assert peft_adapters.load_adapter(kt_model, tmp_path) is kt_model
    assert set(lora_factors(kt_model.model.layers[0].mlp.experts)) == {"gate", "up"}
    assert rel_err(logits(kt_model), logits(reference)) <= RTOL_FP32


# --------------------------------------------------------------------------------------------
# kt_ops -> plain PEFT
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("share_gate_up_a", [None, False], ids=["peft_form", "separate_A"])
def test_kt_adapter_loads_into_plain_peft(share_gate_up_a, backend, tmp_path):
    plain = tiny_model("qwen2_moe")
    model = kt_copy(plain)
    apply_lora(model, rank=4, alpha=8, share_gate_up_a=share_gate_up_a, seed=0)
    randomize_lora_b_(model)
    want = logits(model)
    out = peft_adapters.save_pretrained(model, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_parameters"] == [
        f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1) for p in ("gate_up_proj", "down_proj")
    ]
    assert config["task_type"] == "CAUSAL_LM" and config["lora_dropout"] == 0.0

    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(plain), out)  # no kt_ops here
    assert not any(isinstance(m, MoEExperts) for m in loaded.modules())
    err = rel_err(logits(loaded), want)
    assert err <= RTOL_FP32, err
    # And back into kt_ops: the same function again.
    again = peft_adapters.load_adapter(kt_copy(plain), out)
    assert rel_err(logits(again), want) <= RTOL_FP32


def test_kt_adapter_linear_style_loads_into_plain_peft(backend, tmp_path):
    """Per-expert nn.Linear style: a ModuleList-experts model, and v4-style keys for v5 PEFT."""
    # 1. Experts that are a ModuleList of MLPs: plain PEFT targets their nn.Linear directly.
    plain = Tiny(True, False).eval()
    for layer in plain.layers:
        fused = layer.experts
        layer.experts = ExpertMLPList(ExpertMLP(H, I) for _ in range(E))
        with torch.no_grad():
            for e, mlp in enumerate(layer.experts):
                mlp.gate_proj.weight.copy_(fused.gate_up_proj[e, :I])
                mlp.up_proj.weight.copy_(fused.gate_up_proj[e, I:])
                mlp.down_proj.weight.copy_(fused.down_proj[e])
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(plain)
    kt_ops.replace_experts(model)
    assert model.layers[0].experts.source_layout["layout"] == "module_list"
    apply_lora(model, rank=3, alpha=6, target_projections=("up", "down"), seed=0)
    randomize_lora_b_(model)
    with torch.no_grad():
        want = model(x)
    peft_adapters.save_pretrained(model, tmp_path / "list")
    config = json.loads((tmp_path / "list" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "up_proj"]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path / "list")
    lin = loaded.base_model.model.layers[0].experts[2]
    assert hasattr(lin.up_proj, "lora_A") and not hasattr(lin.gate_proj, "lora_A")
    with torch.no_grad():
        assert rel_err(loaded(x), want) <= RTOL_FP32

    # 2. transformers' fused experts exported with v4 (per-expert) keys: plain PEFT converts
    # them onto the fused v5 experts (for model types with a transformers conversion mapping).
    plain = tiny_model("qwen3_moe")
    model = kt_copy(plain)
    apply_lora(model, rank=2, alpha=4, seed=0)
    randomize_lora_b_(model)
    want = logits(model)
    peft_adapters.save_pretrained(model, tmp_path / "v4", style="modules")
    config = json.loads((tmp_path / "v4" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "up_proj"]
    assert not config["target_parameters"]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path / "v4")
    assert rel_err(logits(loaded), want) <= RTOL_FP32


def test_peft_model_with_kt_experts_saves_both(backend, tmp_path):
    """PEFT LoRA on attention + kt_ops LoRA on the experts -> one PEFT adapter directory."""
    plain = tiny_model("deepseek_v3")
    model = kt_copy(plain)
    apply_lora(model, rank=4, alpha=4, seed=0)
    config = peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_a_proj", "o_proj"], init_lora_weights=False
    )
    torch.manual_seed(0)
    peft_model = peft.get_peft_model(model, config)
    randomize_lora_b_(peft_model)
    want = logits(peft_model)
    peft_adapters.save_pretrained(peft_model, tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved["target_modules"] and len(saved["target_parameters"]) == 4
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path)
    assert rel_err(logits(loaded), want) <= RTOL_FP32


# --------------------------------------------------------------------------------------------
# Every fused storage layout (custom v5 experts modules, PEFT's is_transposed handling)
# --------------------------------------------------------------------------------------------


def fused_experts_class(concatenated: bool, transposed: bool):
    @use_experts_implementation(is_concatenated=concatenated, is_transposed=transposed)
    class FusedExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            g = torch.Generator().manual_seed(7)
            gate_up = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(torch.bfloat16).float()
            down = (torch.randn(E, H, I, generator=g) / I**0.5).to(torch.bfloat16).float()
            if transposed:
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            self.gate_up_proj = nn.Parameter(gate_up.contiguous())
            self.down_proj = nn.Parameter(down.contiguous())
            self.act_fn = nn.SiLU()

        if not concatenated:

            def _apply_gate(self, gate_up):
                return self.act_fn(gate_up[..., 0::2]) * gate_up[..., 1::2]

    return FusedExperts


class Block(nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = experts

    def forward(self, x):
        weights, index = torch.softmax(self.router(x), -1).topk(K, dim=-1)
        return x + self.experts(x, index, weights / weights.sum(-1, keepdim=True))


class Tiny(nn.Module):
    def __init__(self, concatenated, transposed):
        super().__init__()
        config = transformers.PretrainedConfig()
        config._experts_implementation = "batched_mm"
        cls = fused_experts_class(concatenated, transposed)
        torch.manual_seed(0)
        self.layers = nn.ModuleList(Block(cls(config)) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("transposed", [False, True], ids=["nt", "transposed"])
@pytest.mark.parametrize("concatenated", [True, False], ids=["concatenated", "interleaved"])
def test_fused_layouts_both_directions(concatenated, transposed, backend, tmp_path):
    plain = Tiny(concatenated, transposed).eval()
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(1))
    reference = peft_lora(plain, r=3, lora_alpha=5, target_parameters=["gate_up_proj", "down_proj"])
    reference.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        want = reference(x)
    model = copy.deepcopy(plain)
    kt_ops.replace_experts(model)
    layout = model.layers[0].experts.source_layout
    assert (layout["concatenated"], layout["transposed"]) == (concatenated, transposed)
    assert peft_adapters.load_adapter(model, tmp_path / "peft") is model
    with torch.no_grad():
        assert rel_err(model(x), want) <= RTOL_FP32
        assert rel_err(plain(x), want) > 100 * RTOL_FP32

    # kt -> PEFT: separate gate/up A (block-diagonal export), then plain PEFT.
    model = copy.deepcopy(plain)
    kt_ops.replace_experts(model)
    apply_lora(model, rank=2, alpha=3, share_gate_up_a=False, seed=0)
    randomize_lora_b_(model)
    with torch.no_grad():
        want = model(x)
    peft_adapters.save_pretrained(model, tmp_path / "kt")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path / "kt")
    with torch.no_grad():
        assert rel_err(loaded(x), want) <= RTOL_FP32


# --------------------------------------------------------------------------------------------
# Trained with kt_ops (the op's backward) -> plain PEFT
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_LORA_OP, reason=LORA_OP_REASON)
def test_adapter_trained_with_kt_ops_loads_into_plain_peft(tmp_path):
    plain = tiny_model("qwen3_moe")
    model = kt_copy(plain).train()
    apply_lora(model, rank=4, alpha=8, seed=0, freeze_base=True)
    opt = torch.optim.AdamW([p for _, p in lora_parameters(model)], lr=1e-2)
    losses = []
    for _ in range(4):
        loss = lm_loss(model)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    b = lora_factors(model.model.layers[0].mlp.experts)["down"][1]
    assert b.abs().max() > 0  # trained: B moved off zero
    model.eval()
    want = logits(model)
    peft_adapters.save_pretrained(model, tmp_path)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(plain), tmp_path)
    assert rel_err(logits(loaded), want) <= RTOL_FP32


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_errors(tmp_path):
    plain = tiny_model(num_layers=1)
    with pytest.raises(ValueError, match="no kt_ops experts with LoRA"):
        peft_adapters.save_pretrained(kt_copy(plain), tmp_path)
    with pytest.raises(ValueError, match="style must be"):
        peft_adapters.adapter_tensors(kt_copy(plain), style="fused")
    dora = peft.get_peft_model(
        copy.deepcopy(plain), peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
    )
    dora.save_pretrained(tmp_path / "dora")
    with pytest.raises(ValueError, match="DoRA"):
        peft_adapters.load_adapter(kt_copy(plain), tmp_path / "dora")
    # A config whose rank disagrees with the tensors.
    reference = peft_lora(plain, r=2, target_parameters=["down_proj"])
    reference.save_pretrained(tmp_path / "bad")
    cfg = json.loads((tmp_path / "bad" / "adapter_config.json").read_text())
    cfg["r"] = 3
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rank 2, its config says 3"):
        peft_adapters.load_adapter(kt_copy(plain), tmp_path / "bad")


def test_expert_mlp_list_refuses_ids_outside_the_experts():
    """ExpertMLPList skips -1 slots and refuses other ids outside [-1, E), as the op."""
    experts = ExpertMLPList(ExpertMLP(H, I) for _ in range(E))
    x = torch.randn(2, H)
    w = torch.ones(2, 1)
    skipped = experts(x, torch.tensor([[-1], [0]]), w)
    assert torch.equal(skipped[0], torch.zeros(H)) and skipped[1].abs().sum() > 0
    for bad in (E, -2):
        with pytest.raises(ValueError, match=rf"top_k_index must lie in \[-1, {E}\)"):
            experts(x, torch.tensor([[bad], [0]]), w)


_P = "base_model.model.model.layers.0.mlp.experts."


def _corrupt_fused(t: dict, case: str) -> None:
    if case == "B_missing":
        del t[_P + "lora_B.weight"]
    elif case == "A_width":  # down's A with one column too many: fits no projection
        t[_P + "lora_A.weight"] = torch.zeros(2 * E, I + 1)
    elif case == "A_rows":  # rank x E rows broken
        t[_P + "lora_A.weight"] = t[_P + "lora_A.weight"][:-1]
        t[_P + "lora_B.weight"] = t[_P + "lora_B.weight"][:, :-1]
    elif case == "dora":
        t[_P + "lora_magnitude_vector.weight"] = torch.ones(H)
    elif case == "mixed":
        t[_P + "0.gate_proj.lora_A.weight"] = torch.zeros(2, H)


def _corrupt_modules(t: dict, case: str) -> None:
    if case == "expert_missing":
        del t[_P + "3.up_proj.lora_A.weight"], t[_P + "3.up_proj.lora_B.weight"]
    elif case == "unknown_projection":
        for k in [k for k in t if ".down_proj." in k]:
            t[k.replace(".down_proj.", ".w9.")] = t.pop(k)
    elif case == "shape":
        t[_P + "2.gate_proj.lora_A.weight"] = torch.zeros(2, H + 1)


_ADAPTER_ERRORS = {
    # case: (style, corrupt, message)
    "B_missing": ("parameters", _corrupt_fused, r"without its pair"),
    "A_width": ("parameters", _corrupt_fused, r"fit neither gate_up_proj \(in 64, out 64\)"),
    "A_rows": ("parameters", _corrupt_fused, r"lora_A rows 15 are not rank x 8"),
    "dora": ("parameters", _corrupt_fused, r"not plain LoRA A/B weights"),
    "mixed": ("parameters", _corrupt_fused, r"mixes fused-parameter and per-expert"),
    "expert_missing": ("modules", _corrupt_modules, r"lora_A and lora_B for each of the 8"),
    "unknown_projection": ("modules", _corrupt_modules, r"unknown expert projection 'w9'"),
    "shape": ("modules", _corrupt_modules, r"experts\.2\.gate_proj: lora_A \(2, 65\)"),
}


@pytest.mark.parametrize("case", sorted(_ADAPTER_ERRORS))
def test_malformed_adapter_tensors_are_named(case):
    """An adapter whose expert tensors do not fit the kt_ops experts: a ValueError naming
    the module and what is wrong, and the model keeps no half-loaded adapter."""
    style, corrupt, message = _ADAPTER_ERRORS[case]
    source = kt_copy(tiny_model(num_layers=1))
    apply_lora(source, rank=2, alpha=4, seed=0)
    tensors, cfg = peft_adapters.adapter_tensors(source, style=style)
    corrupt(tensors, case)
    config = peft.LoraConfig(
        r=2,
        lora_alpha=4,
        rank_pattern=cfg["rank_pattern"],
        alpha_pattern=cfg["alpha_pattern"],
        target_parameters=cfg["target_parameters"] or None,
        target_modules=cfg["target_modules"],
    )
    target = kt_copy(tiny_model(num_layers=1))
    with pytest.raises(ValueError, match=message):
        peft_adapters.load_adapter_weights(target, tensors, config)
    assert not list(lora_parameters(target))


def test_adapter_api_refusals(tmp_path):
    model = kt_copy(tiny_model(num_layers=1))
    apply_lora(model, rank=2, seed=0)
    with pytest.raises(ValueError, match="dtype must be a floating dtype"):
        peft_adapters.adapter_tensors(model, dtype=torch.int8)
    wrapped = peft.get_peft_model(
        kt_copy(tiny_model(num_layers=1)), peft.LoraConfig(r=2, target_modules=["q_proj"])
    )
    peft_adapters.save_pretrained(model, tmp_path / "a")
    with pytest.raises(ValueError, match="not a PeftModel"):
        peft_adapters.load_adapter(wrapped, tmp_path / "a")
    prefix = peft.get_peft_model(
        tiny_model(num_layers=1),
        peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2),
    )
    with pytest.raises(ValueError, match="only LoRA adapters convert to kt_ops"):
        peft_adapters.load_adapter_weights(model, {}, prefix.peft_config["default"])
