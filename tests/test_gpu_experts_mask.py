"""``gpu_experts_mask``: the experts of a CPU/GPU hybrid layer that the op skips.

An expert marked ``True`` lives on the GPU; the op must treat its slots
exactly as slots with id ``-1``: no contribution to the output, zero gradient
for their routing weights, no LoRA gradient from them. So every check here
compares the masked call with the same call on ids remapped to ``-1``
(bit-identical: the same rows reach the same kernels), and the remapped call
itself with the dense reference (the op's own tests cover that path).
"""

# ruff: noqa: E741

from __future__ import annotations

import pytest
import torch

import kt_ops
import kt_ops.ops
from kt_ops.layer import ExpertWeights, LoRAWeights

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E, H, I, K = 8, 256, 256, 3


def _experts(fmt: str) -> ExpertWeights:
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(E, I, H, generator=g) * 0.1
    up = torch.randn(E, I, H, generator=g) * 0.1
    down = torch.randn(E, H, I, generator=g) * 0.1
    return ExpertWeights.from_dense(gate, up, down, fmt)


def _routing(T: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = (
        torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        if T
        else (torch.empty(0, K, dtype=torch.long))
    )
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def _mask(*experts: int) -> torch.Tensor:
    m = torch.zeros(E, dtype=torch.bool)
    m[list(experts)] = True
    return m


def _remapped(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    ids = ids.clone()
    ids[mask[ids.clamp(min=0)] & (ids >= 0)] = -1
    return ids


def _lora(rank: int = 4, dtype=torch.float32) -> LoRAWeights:
    g = torch.Generator().manual_seed(3)

    def f(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(dtype).requires_grad_()

    return LoRAWeights(
        gate=(f(E, rank, H), f(E, I, rank)), down=(f(E, rank, I), f(E, H, rank)), scaling=0.5
    )


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "q4_k,q4_k,q6_k", "mxfp4", "fp8"])
@pytest.mark.parametrize("T", [0, 1, 7])
def test_masked_experts_are_skipped_like_id_minus_one(isa, fmt, T):
    experts = _experts(fmt)
    x, ids, w = _routing(T)
    mask = _mask(1, 4, 6, *ids[:1, :1].flatten().tolist())  # token 0's first expert
    got = kt_ops.moe_forward(x, ids, w, experts, gpu_experts_mask=mask)
    want = kt_ops.moe_forward(x, _remapped(ids, mask), w, experts)
    assert torch.equal(got, want)
    if T:
        # The mask matters: some routed slots went to masked experts.
        assert bool(mask[ids].any())
        assert not torch.equal(got, kt_ops.moe_forward(x, ids, w, experts))


def test_all_and_no_experts_masked():
    experts = _experts("int8")
    x, ids, w = _routing(5)
    none = torch.zeros(E, dtype=torch.bool)
    assert torch.equal(
        kt_ops.moe_forward(x, ids, w, experts, gpu_experts_mask=none),
        kt_ops.moe_forward(x, ids, w, experts),
    )
    out = kt_ops.moe_forward(x, ids, w, experts, gpu_experts_mask=torch.ones(E, dtype=torch.bool))
    assert torch.equal(out, torch.zeros_like(out))


def test_masked_out_variant_and_bf16_activations():
    experts = _experts("int4")
    x, ids, w = _routing(6)
    x = x.bfloat16()
    mask = _mask(0, 2)
    out = torch.full_like(x, float("nan"))
    kt_ops.moe_forward(x, ids, w, experts, gpu_experts_mask=mask, out=out)
    assert torch.equal(out, kt_ops.moe_forward(x, _remapped(ids, mask), w, experts))


@pytest.mark.parametrize("checkpointing", [True, False])
def test_masked_lora_training_gradients(checkpointing):
    experts = _experts("int8")
    x, ids, w = _routing(9)
    mask = _mask(3, 5)

    def grads(ids_, mask_):
        lora = _lora()
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = kt_ops.moe_forward(
            xs, ids_, ws, experts, lora, activation_checkpointing=checkpointing,
            gpu_experts_mask=mask_,
        )  # fmt: skip
        out.square().sum().backward()
        return [out.detach(), xs.grad, ws.grad] + [t.grad for t in lora.factors() if t is not None]

    got = grads(ids, mask)
    want = grads(_remapped(ids, mask), None)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # The routing weights of masked slots get no gradient from the CPU experts.
    assert torch.all(got[2][mask[ids]] == 0)
    # Nor do the LoRA factors of masked experts.
    for g in got[3:]:
        assert torch.all(g[mask] == 0)


def test_masked_backward_op_direct():
    experts = _experts("bf16")
    x, ids, w = _routing(4)
    mask = _mask(1)
    gy = torch.randn(4, H)
    got = kt_ops.ops.moe_backward(gy, x, ids, w, experts, gpu_experts_mask=mask)
    want = kt_ops.ops.moe_backward(gy, x, _remapped(ids, mask), w, experts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    out, gate_pre, up_pre = kt_ops.ops.moe_forward_train(x, ids, w, experts, gpu_experts_mask=mask)
    ref = kt_ops.ops.moe_forward_train(x, _remapped(ids, mask), w, experts)
    assert all(torch.equal(a, b) for a, b in zip((out, gate_pre, up_pre), ref))


def test_opcheck_with_mask():
    experts = _experts("int8")
    x, ids, w = _routing(3)
    from kt_ops.layer import layer_args

    args = (x, ids, w) + layer_args(experts, None, "silu", x, _mask(2))
    torch.library.opcheck(torch.ops.kt.moe_forward.default, args)


def test_compile_with_mask():
    experts = _experts("int8")
    x, ids, w = _routing(5)
    mask = _mask(0, 7)

    def f(x, ids, w, mask):
        return kt_ops.moe_forward(x, ids, w, experts, gpu_experts_mask=mask)

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="eager")
    assert torch.equal(compiled(x, ids, w, mask), f(x, ids, w, mask))


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.zeros(E, dtype=torch.uint8), "gpu_experts_mask must be a bool"),
        (torch.zeros(E + 1, dtype=torch.bool), r"gpu_experts_mask must be \[E=8\]"),
        (torch.zeros(2, E, dtype=torch.bool), r"gpu_experts_mask must be \[E=8\]"),
        (torch.zeros(E, dtype=torch.bool, device="meta"), "gpu_experts_mask is on meta"),
    ],
)
def test_bad_mask_is_refused(mask, message):
    experts = _experts("int8")
    x, ids, w = _routing(2)
    with pytest.raises(RuntimeError, match=message):
        kt_ops.moe_forward(x, ids, w, experts, gpu_experts_mask=mask)
