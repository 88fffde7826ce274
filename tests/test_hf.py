"""Tests of kt_ops.hf (replace_experts on transformers models) and of the demo (kt_ops.demo).

Models are tiny transformers-v5 models built from configs with seeded random weights (no
download). Their expert weights are rounded to bf16 before the reference copy is taken, so the
reference and kt_ops compute with the same weight values: in fp32 they then differ by summation
order only, and the comparison can be tight.
"""

# E, H, I, K: experts, hidden, intermediate, top-k (the design notes' names).
# ruff: noqa: E741

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F
from reference import TINY_MOE_CONFIG
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers.integrations.moe import use_experts_implementation  # noqa: E402

import kt_ops  # noqa: E402
from kt_ops import demo  # noqa: E402
from kt_ops.hf import UnsupportedExpertsError, find_experts, replace_experts  # noqa: E402
from kt_ops.nn import MoEExpertList, MoEExperts  # noqa: E402

TINY = TINY_MOE_CONFIG
E, H, I, K = (TINY[k] for k in ("num_experts", "hidden_size", "moe_intermediate_size", "top_k"))
#: max |kt_ops - reference| / max |reference|. fp32: summation order only (observed ~1e-7).
#: bf16: the reference model rounds every op to bf16 (observed ~1e-2); a wrong layout or
#: expert gives errors of order 1.
RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def round_experts_to_bf16_(model: nn.Module) -> None:
    """Make the expert weights bf16-representable (what kt_ops stores), in place."""
    with torch.no_grad():
        for info in find_experts(model):
            for p in model.get_submodule(info.name).parameters():
                p.copy_(p.to(torch.bfloat16))


def tiny_model(arch: str, dtype=torch.float32, num_layers: int = 2, **overrides) -> nn.Module:
    config = demo.make_config(arch, **{**TINY, "num_layers": num_layers})
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return model


INPUT_IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(INPUT_IDS).logits.float()


# --------------------------------------------------------------------------------------------
# transformers MoE models
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", demo.ARCHS)
def test_replace_experts_matches_unmodified_model(arch, dtype, caplog):
    # In bf16, the rounding differences of layer 1's experts can flip a near-tied expert choice
    # of layer 2's router (bf16 router logits tie often), which changes that token's output by
    # O(1) for reasons that are not kt_ops'. One layer keeps the router inputs identical.
    layers = 2 if dtype == torch.float32 else 1
    model = tiny_model(arch, dtype, num_layers=layers)
    round_experts_to_bf16_(model)
    reference = copy.deepcopy(model)
    infos = find_experts(model)
    assert len(infos) == layers and all(i.layout == "fused" for i in infos)
    assert (infos[0].num_experts, infos[0].hidden_size, infos[0].intermediate_size) == (E, H, I)

    with caplog.at_level(logging.INFO, logger="kt_ops.hf"):
        assert replace_experts(model) is model
    assert f"replaced {layers} experts modules" in caplog.text

    replaced = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert len(replaced) == layers
    # The dense expert weights are gone; router, attention and shared experts are untouched.
    names = [n for n, _ in model.named_parameters()]
    assert not any(".experts.gate_up_proj" in n or ".experts.down_proj" in n for n in names)
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_params[name])
    # gate_up_proj and down_proj per layer (and gpt-oss's biases) live in the packed buffers.
    moved = sum(len(list(reference.get_submodule(i.name).parameters())) for i in infos)
    assert moved == (4 if arch == "gpt_oss" else 2) * layers
    assert len(names) == len(ref_params) - moved
    if arch == "qwen2_moe":
        assert "model.layers.0.mlp.shared_expert.gate_proj.weight" in names

    err = rel_err(logits(model), logits(reference))
    assert err <= RTOL[dtype], f"{arch} {dtype}: relative logit error {err:.3g}"


GLM4_MOE = dict(
    moe_intermediate_size=I, n_routed_experts=E, first_k_dense_replace=0, n_group=1, topk_group=1
)


@pytest.mark.parametrize(
    ("config_class", "sizes"),
    [
        ("GraniteMoeConfig", dict(intermediate_size=I, num_local_experts=E)),
        ("Glm4MoeConfig", GLM4_MOE),
    ],
)
def test_more_transformers_moe_models(config_class, sizes):
    config = getattr(transformers, config_class)(
        vocab_size=128, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts_per_tok=K, initializer_range=0.2,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, **sizes,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    round_experts_to_bf16_(model)
    reference = copy.deepcopy(model)
    replace_experts(model)
    assert sum(isinstance(m, MoEExperts) for m in model.modules()) == 2
    assert rel_err(logits(model), logits(reference)) <= RTOL[torch.float32]


def test_comparison_is_sensitive_to_the_experts():
    """A 1% change of one projection of the experts moves the logits well past RTOL[fp32]."""
    model = tiny_model("qwen3_moe")
    round_experts_to_bf16_(model)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj.mul_(1.01)
    replace_experts(model)
    assert rel_err(logits(model), logits(reference)) > 20 * RTOL[torch.float32]


def test_replaced_block_compiles_fullgraph_dynamic():
    """The MoE block (router + kt_ops experts) traces to one graph, for any token count."""
    model = tiny_model("qwen3_moe")
    replace_experts(model)
    block = model.model.layers[0].mlp
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for T in (3, 6, 11):
            x = torch.randn(1, T, H)
            assert torch.equal(compiled(x), block(x))
    assert counter.frame_count == 1


def test_replace_experts_twice_and_alias():
    model = tiny_model("mixtral")
    kt_ops.replace_experts(model)  # the lazy alias in kt_ops/__init__.py
    first = model.model.layers[0].mlp.experts
    replace_experts(model)  # nothing left to replace: a no-op
    assert model.model.layers[0].mlp.experts is first
    assert find_experts(model) == []


# --------------------------------------------------------------------------------------------
# Fused layouts: concatenated / interleaved x transposed or not
# --------------------------------------------------------------------------------------------


def fused_experts_class(concatenated: bool = True, transposed: bool = False, **flags):
    """A v5 experts module with the given storage flags, run by transformers' batched_mm."""

    @use_experts_implementation(is_concatenated=concatenated, is_transposed=transposed, **flags)
    class FusedExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            self.gate_up_proj = nn.Parameter(
                torch.empty((E, H, 2 * I) if transposed else (E, 2 * I, H))
            )
            self.down_proj = nn.Parameter(torch.empty((E, I, H) if transposed else (E, H, I)))
            self.act_fn = nn.SiLU()

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise NotImplementedError("only transformers' batched_mm implementation is used")

        if not concatenated:

            def _apply_gate(self, gate_up):  # interleaved rows: gate0, up0, gate1, up1, ...
                return self.act_fn(gate_up[..., 0::2]) * gate_up[..., 1::2]

    return FusedExperts


def batched_mm_config():
    config = transformers.PretrainedConfig()
    config._experts_implementation = "batched_mm"  # transformers' reading of the flags
    return config


class TinyMoEBlock(nn.Module):
    """A v5-style MoE block: top-k router, then experts(hidden, top_k_index, top_k_weights)."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = experts

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        weights, index = probs.topk(K, dim=-1)
        return self.experts(x, index, weights / weights.sum(-1, keepdim=True))


class TinyModel(nn.Module):
    def __init__(self, *experts: nn.Module):
        super().__init__()
        self.layers = nn.ModuleList(TinyMoEBlock(e) for e in experts)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def dense_weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, I, H, generator=g) * (2 / H**0.5)
    up = torch.randn(E, I, H, generator=g) / H**0.5
    down = torch.randn(E, H, I, generator=g) / I**0.5
    return tuple(w.to(torch.bfloat16).float() for w in (gate, up, down))


def store(module: nn.Module, gate, up, down, concatenated: bool, transposed: bool) -> None:
    """Write dense gate/up [E, I, H] and down [E, H, I] into the module's storage layout."""
    if concatenated:
        gate_up = torch.cat([gate, up], dim=1)  # [E, 2I, H]: gate rows, then up rows
    else:
        gate_up = torch.stack([gate, up], dim=2).reshape(E, 2 * I, H)  # gate0, up0, gate1, ...
    if transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)


@pytest.mark.parametrize("transposed", [False, True], ids=["nt", "transposed"])
@pytest.mark.parametrize("concatenated", [True, False], ids=["concatenated", "interleaved"])
def test_fused_layouts(concatenated, transposed):
    cls = fused_experts_class(concatenated, transposed)
    experts = [cls(batched_mm_config()) for _ in range(2)]
    dense = [dense_weights(seed) for seed in range(2)]
    for module, (gate, up, down) in zip(experts, dense):
        store(module, gate, up, down, concatenated, transposed)
    torch.manual_seed(0)
    model = TinyModel(*experts)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
    infos = find_experts(model)
    assert [(i.concatenated, i.transposed) for i in infos] == [(concatenated, transposed)] * 2

    replace_experts(model)

    for layer, (gate, up, down) in zip(model.layers, dense):
        new = layer.experts
        assert type(new) is MoEExperts
        assert torch.equal(kt_ops.unpack_weights(new.gate_weight, I, H), gate)
        assert torch.equal(kt_ops.unpack_weights(new.up_weight, I, H), up)
        assert torch.equal(kt_ops.unpack_weights(new.down_weight, H, I), down)
    with torch.no_grad():
        err = rel_err(model(x), want)
    assert err <= RTOL[torch.float32]


# --------------------------------------------------------------------------------------------
# nn.ModuleList of per-expert MLPs
# --------------------------------------------------------------------------------------------


class MixtralStyleMLP(nn.Module):
    """transformers 4.x MixtralBlockSparseTop2MLP: w1 (gate), w3 (up), w2 (down)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, I, bias=False)
        self.w2 = nn.Linear(I, H, bias=False)
        self.w3 = nn.Linear(H, I, bias=False)
        self.act_fn = transformers.activations.ACT2FN["silu"]

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class QwenStyleMLP(nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(H, I, bias=bias)
        self.up_proj = nn.Linear(H, I, bias=bias)
        self.down_proj = nn.Linear(I, H, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class LegacySparseMoeBlock(nn.Module):
    """transformers 4.x MixtralSparseMoeBlock: the routing loop lives in the block."""

    def __init__(self):
        super().__init__()
        self.num_experts, self.top_k = E, K
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(MixtralStyleMLP() for _ in range(E))

    def forward(self, hidden_states):
        routing_weights = F.softmax(self.gate(hidden_states), dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final = torch.zeros_like(hidden_states)
        expert_mask = F.one_hot(selected_experts, num_classes=self.num_experts).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:  # one-element tensors, as in transformers 4.x
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx].squeeze(0))
            current = expert_layer(hidden_states[top_x]) * routing_weights[top_x, idx, None]
            final.index_add_(0, top_x, current.to(hidden_states.dtype))
        return final


class ExpertList(nn.ModuleList):
    """A ModuleList of expert MLPs that its block calls v5-style: (hidden, index, weights)."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[0]):
            for k in range(top_k_index.shape[1]):
                expert = self[int(top_k_index[t, k])]
                out[t] += top_k_weights[t, k] * expert(hidden_states[t])
        return out


def round_module_to_bf16_(module: nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16))


def test_module_list_looped_by_its_block():
    torch.manual_seed(0)
    block = LegacySparseMoeBlock()
    round_module_to_bf16_(block.experts)
    w1, w2 = (
        block.experts[3].w1.weight.detach().clone(),
        block.experts[3].w2.weight.detach().clone(),
    )
    x = torch.randn(6, H)
    with torch.no_grad():
        want = block(x)
    assert [i.layout for i in find_experts(block)] == ["module_list"]
    replace_experts(block)
    assert type(block.experts) is MoEExpertList and len(block.experts) == E
    assert torch.equal(kt_ops.unpack_weights(block.experts.gate_weight, I, H)[3], w1)
    assert torch.equal(kt_ops.unpack_weights(block.experts.down_weight, H, I)[3], w2)
    with torch.no_grad():
        assert rel_err(block(x), want) <= RTOL[torch.float32]


def test_module_list_called_fused():
    torch.manual_seed(0)
    experts = [ExpertList(QwenStyleMLP() for _ in range(E)) for _ in range(2)]
    for e in experts:
        round_module_to_bf16_(e)
    model = TinyModel(*experts)
    dense_gate = torch.stack([m.gate_proj.weight.detach().clone() for m in experts[1]])
    x = torch.randn(5, H)
    with torch.no_grad():
        want = model(x)
    replace_experts(model)
    new = model.layers[1].experts
    assert type(new) is MoEExpertList
    assert torch.equal(kt_ops.unpack_weights(new.gate_weight, I, H), dense_gate)
    with torch.no_grad():
        assert rel_err(model(x), want) <= RTOL[torch.float32]


# --------------------------------------------------------------------------------------------
# Unsupported models: clear errors, and nothing replaced
# --------------------------------------------------------------------------------------------


def test_model_without_experts():
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=H, intermediate_size=I, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedExpertsError, match="Qwen3ForCausalLM: found no MoE experts"):
        replace_experts(model)


def test_activation_kt_ops_lacks():
    # GELU and ReLU GLU experts are served (tests/test_activations.py); tanh ones are not.
    model = tiny_model("qwen3_moe", hidden_act="tanh")
    with pytest.raises(UnsupportedExpertsError, match="Qwen3MoeExperts .*activation Tanh"):
        replace_experts(model)


def test_experts_without_gate():
    @use_experts_implementation(has_gate=False)
    class UngatedExperts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.up_proj = nn.Parameter(torch.randn(E, I, H))
            self.down_proj = nn.Parameter(torch.randn(E, H, I))

    with pytest.raises(UnsupportedExpertsError, match=r"UngatedExperts at .*has_gate=False"):
        replace_experts(TinyModel(UngatedExperts(batched_mm_config())))


def test_extra_tensors_are_refused():
    experts = fused_experts_class()(batched_mm_config())
    experts.register_buffer("gate_up_scales", torch.ones(E, 2 * I))
    with pytest.raises(UnsupportedExpertsError, match=r"tensors \['gate_up_scales'\]"):
        replace_experts(TinyModel(experts))


def test_custom_gating_is_caught_by_the_probe_and_nothing_is_replaced():
    """A clamped SwiGLU (as in DeepSeek-V4 / gpt-oss) has no flag; the probe batch catches it."""
    base = fused_experts_class()

    class ClampedExperts(base):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0)

    good, clamped = base(batched_mm_config()), ClampedExperts(batched_mm_config())
    for module, seed in ((good, 0), (clamped, 1)):
        store(module, *dense_weights(seed), concatenated=True, transposed=False)
    model = TinyModel(good, clamped)
    with pytest.raises(UnsupportedExpertsError, match="ClampedExperts .*overrides _apply_gate"):
        replace_experts(model)
    assert model.layers[0].experts is good  # atomic: the supported layer was not replaced either


def test_weights_on_meta_device():
    config = demo.make_config("qwen3_moe", **TINY)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedExpertsError, match="meta device"):
        replace_experts(model)


def test_module_list_errors():
    block = LegacySparseMoeBlock()
    block.experts = nn.ModuleList(QwenStyleMLP(bias=True) for _ in range(E))
    with pytest.raises(UnsupportedExpertsError, match="expert 0 .*biases"):
        replace_experts(block)
    block.experts = nn.ModuleList(nn.Linear(H, H) for _ in range(E))
    with pytest.raises(UnsupportedExpertsError, match="without bias-free nn.Linear layers"):
        replace_experts(block)


def test_argument_errors():
    with pytest.raises(TypeError, match="expected a torch.nn.Module"):
        replace_experts("Qwen/Qwen3-30B-A3B")
    with pytest.raises(ValueError, match="weight_format='int5' is not supported"):
        replace_experts(LegacySparseMoeBlock(), weight_format="int5")
    with pytest.raises(ValueError, match="pass converted_dir or checkpoint, not both"):
        replace_experts(LegacySparseMoeBlock(), converted_dir="a", checkpoint="b")
    with pytest.raises(ValueError, match="group_size"):
        replace_experts(LegacySparseMoeBlock(), "int4", group_size=7)


# --------------------------------------------------------------------------------------------
# The demo
# --------------------------------------------------------------------------------------------

DEMO_TINY = [
    "--hidden-size", "64", "--moe-intermediate-size", "32", "--num-experts", "8", "--top-k", "2",
    "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16", "--vocab-size", "128",
    "--prompt-tokens", "6", "--new-tokens", "5", "--layers", "2", "--init-std", "0.2",
]  # fmt: skip


def test_demo_passes(capsys):
    assert demo.main(DEMO_TINY) == 0
    out = capsys.readouterr().out
    assert "verdict    : PASS" in out and "decode (4 tokens)" in out and "ISA" in out
    assert "5/5 greedy choices identical" in out


@pytest.mark.parametrize(("arch", "dtype"), [("mixtral", "bf16"), ("deepseek_v3", "fp32")])
def test_demo_other_archs(arch, dtype):
    result = demo.run([*DEMO_TINY, "--arch", arch, "--dtype", dtype], quiet=True)
    assert result.replaced == 2
    assert result.ok, (result.mismatches, result.max_abs_logit_diff, result.logit_tol)
    assert result.max_abs_logit_diff > 0  # kt_ops really ran (fp32 sums in another order)


def test_demo_check_can_fail(monkeypatch, capsys):
    """Experts 2% off in one layer (a packing bug, say) must fail the check; main() returns 1."""
    real = kt_ops.replace_experts

    def sabotaged(model, **kwargs):
        real(model, **kwargs)
        experts = next(m for m in model.modules() if isinstance(m, MoEExperts))
        experts.down_weight.mul_(1.02)
        return model

    monkeypatch.setattr(kt_ops, "replace_experts", sabotaged)
    assert demo.main(DEMO_TINY) == 1
    assert "verdict    : FAIL: logit difference" in capsys.readouterr().out
