"""LoRA on kt_ops experts: kt_ops.lora (add_lora, apply_lora) and training HF MoE models.

* One module: adapter shapes, PEFT initialisation, names, dtypes, errors; frozen packed
  weights; forward/backward of the op against a dense autograd reference (``kt_op`` only).
* Training mode for Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and DeepSeek-V3 (fused experts) and
  an unfused (ModuleList) layout: a kt_ops model and the plain transformers model with PEFT
  LoRA, started from the same adapter (PEFT's random init imported into kt_ops), take the
  same SGD steps. Losses agree within ``LOSS_RTOL`` and the router / shared experts / LoRA
  gradients within ``GRAD_RTOL`` (fp32 everywhere, bf16-valued expert weights: only summation
  order differs). Router and shared experts train in PyTorch.

Before ``kt::moe_backward`` lands these run on the dense reference of the op
(``lora_helpers.reference_forward``), which checks the module and HF plumbing; after, on the op.
"""

# ruff: noqa: E741, F811

from __future__ import annotations

import copy
import math

import pytest
import torch
from lora_helpers import (  # noqa: F401  (backend is a fixture)
    HAS_LORA_OP,
    INPUT_IDS,
    LORA_OP_REASON,
    E,
    H,
    I,
    backend,
    kt_copy,
    lm_loss,
    reference_forward,
    rel_err,
    tiny_model,
)

peft = pytest.importorskip("peft")

import kt_ops  # noqa: E402
from kt_ops import peft_adapters  # noqa: E402
from kt_ops.lora import (  # noqa: E402
    add_lora,
    apply_lora,
    lora_factors,
    lora_parameters,
    mark_only_lora_as_trainable,
    remove_lora,
    set_lora_factors,
    shares_gate_up_a,
    unfuse_experts,
)
from kt_ops.nn import MoEExperts  # noqa: E402

#: Relative loss difference kt_ops vs PEFT per step (fp32; observed ~1e-7).
LOSS_RTOL = 1e-5
#: max |grad difference| / max |grad| for router, shared experts and LoRA (observed ~1e-6).
GRAD_RTOL = 1e-4


def experts_module(seed: int = 0) -> MoEExperts:
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, I, H, generator=g) / H**0.5
    up = torch.randn(E, I, H, generator=g) / H**0.5
    down = torch.randn(E, H, I, generator=g) / I**0.5
    return MoEExperts.from_dense(gate, up, down)


def routing(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    weights = torch.rand(T, 2, generator=g) + 0.1
    return x, ids, weights


# --------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------


def test_add_lora_parameters_and_init():
    m = experts_module()
    add_lora(m, 8, 16, generator=torch.Generator().manual_seed(0))
    names = {n for n, _ in m.named_parameters()}
    assert names == {f"{p}_lora_{ab}" for p in ("gate", "up", "down") for ab in "ab"}
    assert m.lora_scaling == 2.0
    f = lora_factors(m)
    assert f["gate"][0].shape == (E, 8, H) and f["gate"][1].shape == (E, I, 8)
    assert f["down"][0].shape == (E, 8, I) and f["down"][1].shape == (E, H, 8)
    for p, (a, b) in f.items():
        n_in = I if p == "down" else H
        assert a.dtype == torch.float32 and a.requires_grad
        assert a.abs().max() <= 1 / math.sqrt(n_in)  # kaiming_uniform(a=sqrt(5)) of [r, in]
        assert a.abs().max() > 0.9 / math.sqrt(n_in)  # ... and really uniform over the bound
        assert torch.count_nonzero(b) == 0  # B = 0: no change at init
    # The packed base weights stay frozen buffers.
    assert {n for n, _ in m.named_buffers()} == {"gate_weight", "up_weight", "down_weight"}
    assert "down_lora_b" in m.state_dict()
    remove_lora(m)
    assert not list(m.parameters()) and m.lora_scaling == 1.0

    add_lora(m, 4, 4, ("gate", "up"), share_gate_up_a=True, dtype=torch.bfloat16, use_rslora=True)
    assert shares_gate_up_a(m) and m.lora_scaling == 2.0  # 4 / sqrt(4)
    f = lora_factors(m)
    assert f["gate"][0] is f["up"][0] and set(f) == {"gate", "up"}
    assert f["gate"][0].dtype == torch.bfloat16
    assert len(list(m.parameters())) == 3  # the shared A once
    clone = copy.deepcopy(m)
    assert shares_gate_up_a(clone)  # deepcopy keeps the sharing


def test_add_lora_errors():
    m = experts_module()
    with pytest.raises(ValueError, match="rank must be a positive int"):
        add_lora(m, 0)
    with pytest.raises(ValueError, match="unknown LoRA projection 'o'"):
        add_lora(m, 4, projections=("gate", "o"))
    with pytest.raises(ValueError, match="distinct and non-empty"):
        add_lora(m, 4, projections=())
    with pytest.raises(ValueError, match="share_gate_up_a needs both"):
        add_lora(m, 4, projections=("gate", "down"), share_gate_up_a=True)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        add_lora(m, 4, dtype=torch.float64)
    add_lora(m, 4)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(m, 4)
    with pytest.raises(ValueError, match="expected A"):
        set_lora_factors(m, {"down": (torch.zeros(E, 2, H), torch.zeros(E, H, 2))}, 1.0)
    with pytest.raises(ValueError, match="kt_ops.replace_experts"):
        apply_lora(torch.nn.Linear(2, 2), 4)


@pytest.mark.skipif(not HAS_LORA_OP, reason=LORA_OP_REASON)
@pytest.mark.parametrize(
    ("act_dtype", "lora_dtype", "tol"),
    [
        (torch.float32, torch.float32, 1e-4),
        # bf16 LoRA factors get bf16 gradients: one rounding (2^-9 relative) on each side.
        (torch.float32, torch.bfloat16, 4e-3),
        (torch.bfloat16, torch.float32, 5e-2),
    ],
    ids=["fp32", "bf16_lora", "bf16_act"],
)
@pytest.mark.parametrize("projections", [("gate", "up", "down"), ("up",)], ids=["all", "up"])
def test_op_forward_backward_matches_reference(act_dtype, lora_dtype, tol, projections):
    m = experts_module()
    add_lora(m, 4, 8, projections, dtype=lora_dtype, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _, b in lora_factors(m).values():
            b.copy_(torch.randn(b.shape) * 0.3)
    x, ids, w = routing(13)
    ids[3, 1] = -1  # a skipped slot
    results = []
    for fn in (MoEExperts.forward, reference_forward):
        xi = x.to(act_dtype).requires_grad_()
        wi = w.clone().requires_grad_()
        out = fn(m, xi, ids, wi)
        grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
        for p in m.parameters():
            p.grad = None
        (out.float() * grad_out).sum().backward()
        grads = {n: p.grad.clone() for n, p in m.named_parameters()}
        results.append((out, xi.grad, wi.grad, grads))
    (o1, gx1, gw1, gp1), (o2, gx2, gw2, gp2) = results
    assert rel_err(o1, o2) <= tol
    assert rel_err(gx1, gx2) <= tol and rel_err(gw1, gw2) <= tol
    assert set(gp1) == set(gp2)
    for name in gp1:
        assert rel_err(gp1[name], gp2[name]) <= tol, name


def test_fresh_adapters_change_nothing(backend):
    plain = tiny_model("qwen3_moe")
    model = kt_copy(plain)
    before = model(input_ids=INPUT_IDS).logits.detach()
    apply_lora(model, rank=4, alpha=8, seed=0)
    after = model(input_ids=INPUT_IDS).logits.detach()
    assert rel_err(after, before) <= 1e-6


# --------------------------------------------------------------------------------------------
# Training HF models: kt_ops vs transformers + PEFT, step by step
# --------------------------------------------------------------------------------------------


def sgd_steps(model, params, steps: int = 3, lr: float = 0.5):
    """Losses of ``steps`` plain-SGD steps, and the gradients of the first step."""
    opt = torch.optim.SGD(params, lr=lr)
    losses, first = [], None
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(model)
        loss.backward()
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, first


def strip(name: str) -> str:
    return name.replace("base_model.model.", "").replace(".base_layer", "")


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3"])
def test_training_matches_transformers_peft(arch, backend, tmp_path):
    plain = tiny_model(arch, num_layers=1).train()
    # PEFT on the plain model: LoRA on the fused experts (random A, B), router trainable.
    reference = peft.get_peft_model(
        copy.deepcopy(plain),
        peft.LoraConfig(
            r=4, lora_alpha=8, target_parameters=["gate_up_proj", "down_proj"],
            init_lora_weights=False,
        ),
    )  # fmt: skip
    for n, p in reference.named_parameters():  # the router is mlp.gate in all five
        if "mlp.gate." in n or "shared_expert" in n:
            p.requires_grad_(True)
    reference.save_pretrained(tmp_path)

    model = kt_copy(plain).train()
    assert peft_adapters.load_adapter(model, tmp_path, is_trainable=True) is model
    trainable = {strip(n) for n, p in reference.named_parameters() if p.requires_grad}
    for n, p in model.named_parameters():
        p.requires_grad_(n in trainable or "lora_" in n)
    params_ref = [p for p in reference.parameters() if p.requires_grad]
    params_kt = [p for p in model.parameters() if p.requires_grad]
    n_router = sum(1 for n in trainable if "lora_" not in n)
    assert n_router >= 1  # the router (+ shared experts for qwen2_moe / deepseek_v3)

    losses_ref, grads_ref = sgd_steps(reference, params_ref)
    losses_kt, grads_kt = sgd_steps(model, params_kt)
    for a, b in zip(losses_kt, losses_ref):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (losses_kt, losses_ref)
    assert losses_kt[-1] < losses_kt[0]
    # Router / shared-expert gradients are the same tensors on both sides.
    for name, g in grads_ref.items():
        if "lora_" not in name:
            assert rel_err(grads_kt[strip(name)], g) <= GRAD_RTOL, name
    # LoRA gradients: PEFT's down_proj lora_B.weight [H, r*E] vs kt's down_lora_b [E, H, r].
    g_peft = grads_ref["base_model.model.model.layers.0.mlp.experts.lora_B.default.weight"]
    g_kt = grads_kt["model.layers.0.mlp.experts.down_lora_b"]
    assert rel_err(g_kt.permute(1, 2, 0).reshape(H, -1), g_peft) <= GRAD_RTOL


def test_training_unfused_layout(backend, tmp_path):
    """ModuleList experts (per-expert nn.Linear) train the same on kt_ops as with PEFT."""
    plain = tiny_model("qwen3_moe")
    unfuse_experts(plain)
    plain.train()

    class WithoutConfig(torch.nn.Module):  # PEFT converts nothing on a config-less model
        def __init__(self, lm):
            super().__init__()
            self.model, self.lm_head = lm.model, lm.lm_head

    torch.manual_seed(0)
    wrapper = WithoutConfig(copy.deepcopy(plain))
    reference = peft.get_peft_model(
        wrapper,
        peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"],
            init_lora_weights=False,
        ),
    )  # fmt: skip
    reference.save_pretrained(tmp_path)
    ref_lm = copy.deepcopy(plain)
    ref_lm.model, ref_lm.lm_head = reference.base_model.model.model, wrapper.lm_head

    model = kt_copy(plain).train()
    assert model.model.layers[0].mlp.experts.source_layout["layout"] == "module_list"
    peft_adapters.load_adapter(model, tmp_path, is_trainable=True)
    assert mark_only_lora_as_trainable(model) == sum(p.numel() for _, p in lora_parameters(model))
    losses_kt, _ = sgd_steps(model, [p for p in model.parameters() if p.requires_grad])
    losses_ref, _ = sgd_steps(ref_lm, [p for p in reference.parameters() if p.requires_grad])
    for a, b in zip(losses_kt, losses_ref):
        assert abs(a - b) <= LOSS_RTOL * abs(b), (losses_kt, losses_ref)
    assert losses_kt[-1] < losses_kt[0]


def test_apply_lora_on_model(backend):
    model = kt_copy(tiny_model("mixtral"))
    names = apply_lora(model, rank=2, alpha=4, target_projections=("gate", "up"), freeze_base=True)
    assert names == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    experts = model.model.layers[0].mlp.experts
    assert shares_gate_up_a(experts)  # fused source: PEFT's gate_up_proj parametrisation
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n, _ in lora_parameters(model)] and len(trainable) == 6
    unfused = tiny_model("mixtral")
    unfuse_experts(unfused)
    kt_unfused = kt_copy(unfused)
    apply_lora(kt_unfused, rank=2, target_projections=("gate", "up"))
    assert not shares_gate_up_a(kt_unfused.model.layers[0].mlp.experts)
    # Training mode flows through replace_experts.
    trained = kt_ops.replace_experts(tiny_model("olmoe").train())
    assert trained.model.layers[0].mlp.experts.training
