"""Shared helpers of the LoRA tests: tiny offline MoE models and a dense reference of the experts.

``reference_forward`` computes what ``kt.moe_forward`` with LoRA must compute, in plain
PyTorch from the unpacked weights (Hu et al. 2021: ``y = W x + scaling * B (A x)`` per
projection), differentiably in the hidden states, routing weights and adapters. The
``backend`` fixture runs a test with it (``reference``: tests the PEFT mapping and the
module plumbing, runs without the LoRA op) and with the real op (``kt_op``: skipped until
``kt::moe_backward`` is registered).
"""

# E, H, I, K: experts, hidden, intermediate, top-k.
# ruff: noqa: E741

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from reference import TINY_MOE_CONFIG
from torch import nn

import kt_ops
from kt_ops import demo
from kt_ops.lora import lora_factors
from kt_ops.nn import MoEExperts

transformers = pytest.importorskip("transformers")

TINY = TINY_MOE_CONFIG
E, H, I, K = (TINY[k] for k in ("num_experts", "hidden_size", "moe_intermediate_size", "top_k"))

#: The LoRA op has landed when its backward is registered.
HAS_LORA_OP = hasattr(torch.ops.kt, "moe_backward")
LORA_OP_REASON = (
    "kt::moe_backward is not registered in this build: the op rejects LoRA tensors and has no "
    "backward yet"
)

#: max |kt - reference| / max |reference| on logits. fp32 on both sides, bf16-valued expert
#: weights: summation order only (observed ~1e-7 without LoRA).
RTOL_FP32 = 1e-4


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def reference_forward(
    self: MoEExperts, hidden_states: torch.Tensor, top_k_index, top_k_weights
) -> torch.Tensor:
    """Dense PyTorch MoEExperts.forward with LoRA (differentiable; the op's contract)."""
    Hs, Is = self.hidden_size, self.intermediate_size
    w = {
        "gate": kt_ops.unpack_weights(self.gate_weight, Is, Hs),
        "up": kt_ops.unpack_weights(self.up_weight, Is, Hs),
        "down": kt_ops.unpack_weights(self.down_weight, Hs, Is),
    }
    factors = lora_factors(self)
    x = hidden_states.reshape(-1, Hs)
    ids = top_k_index.reshape(-1, top_k_index.shape[-1])
    weights = top_k_weights.reshape(-1, top_k_weights.shape[-1])
    xf = x.float()
    out = torch.zeros_like(xf)

    def proj(name, e, v):
        y = v @ w[name][e].t()
        if name in factors:
            a, b = factors[name]
            y = y + self.lora_scaling * ((v @ a[e].float().t()) @ b[e].float().t())
        return y

    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = torch.where(ids == e)
        v = xf[tok]
        h = F.silu(proj("gate", e, v)) * proj("up", e, v)
        y = proj("down", e, h) * weights[tok, slot, None].float()
        out = out.index_add(0, tok, y)
    return out.to(hidden_states.dtype).view(hidden_states.shape)


@pytest.fixture(params=["kt_op"] if HAS_LORA_OP else ["reference"])
def backend(request, monkeypatch):
    """What computes MoEExperts: the op (``kt_op``) once it takes LoRA, else the reference.

    Before ``kt::moe_backward`` lands, ``reference`` (:func:`reference_forward` patched in)
    still tests the PEFT mapping and the module plumbing; afterwards the same tests run on the
    op (one backend per run keeps the files fast).
    """
    if request.param == "reference":
        monkeypatch.setattr(MoEExperts, "forward", reference_forward)
    return request.param


def tiny_model(arch: str = "qwen3_moe", num_layers: int = 2, seed: int = 0, **overrides):
    """A tiny transformers MoE model (fp32, eval), expert weights rounded to bf16 values."""
    config = demo.make_config(arch, **{**TINY, "num_layers": num_layers, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    round_experts_to_bf16_(model)
    return model


def round_experts_to_bf16_(model: nn.Module) -> None:
    from kt_ops.hf import find_experts

    with torch.no_grad():
        for info in find_experts(model):
            for p in model.get_submodule(info.name).parameters():
                p.copy_(p.to(torch.bfloat16))


def kt_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with its experts on kt_ops."""
    new = copy.deepcopy(model)
    kt_ops.replace_experts(new)
    return new


def randomize_lora_b_(model: nn.Module, std: float = 0.5, seed: int = 1) -> None:
    """Nonzero B for every kt_ops LoRA (fresh adapters have B = 0 and change nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoEExperts):
                for _, b in lora_factors(m).values():
                    b.copy_(torch.randn(b.shape, generator=gen) * std)


INPUT_IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def logits(model: nn.Module, input_ids: torch.Tensor = INPUT_IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits.float()


def lm_loss(model: nn.Module, input_ids: torch.Tensor = INPUT_IDS) -> torch.Tensor:
    return model(input_ids=input_ids, labels=input_ids).loss
