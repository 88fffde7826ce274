"""Tests of kt_ops.nn: MoEExperts / MoEExpertList against tests/reference.py.

Every comparison uses reference.py's fp32 reference on the module's packed weights and its
tolerance (``assert_matches_reference``); ``test_packs_the_dense_weights`` ties the packed
weights to the dense ones the module was built from.
"""

# E, H, I: experts, hidden, intermediate (the design notes' names).
# ruff: noqa: E741

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch._dynamo.testing
from reference import assert_matches_reference, make_hidden, make_routing, reference_moe_forward

import kt_ops
import kt_ops.layer as kt_layer
from kt_ops.layer import PROJECTIONS as PROJ
from kt_ops.nn import MoEExpertList, MoEExperts

E, H, I = 8, 64, 40  # I not a multiple of 16: exercises the packed padding


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


@pytest.fixture(scope="module")
def dense() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(E, I, H, generator=g) * (2 / H**0.5),
        torch.randn(E, I, H, generator=g) / H**0.5,
        torch.randn(E, H, I, generator=g) / I**0.5,
    )


@pytest.fixture(scope="module")
def experts(dense) -> MoEExperts:
    return MoEExperts.from_dense(*dense)


def reference(module: MoEExperts, x, ids, weights):
    """tests/reference.py's fp32 reference on the module's packed weights, for [..., H] inputs."""
    x2 = x.reshape(-1, H)
    ref = reference_moe_forward(
        x2,
        ids.reshape(x2.shape[0], -1),
        weights.reshape(x2.shape[0], -1),
        module.expert_weights(),
        module.lora_weights(),
    )
    return ref.view(x.shape)


def routing(T: int, K: int = 2, seed: int = 1, **kwargs):
    return make_routing(T, E, K, seed=seed, **kwargs)


def test_packs_the_dense_weights(experts, dense):
    """The buffers hold exactly the bf16-rounded dense weights (so the reference below is fair)."""
    for name, w in zip(("gate_weight", "up_weight", "down_weight"), dense):
        packed = getattr(experts, name)
        assert packed.dtype == torch.bfloat16
        assert torch.equal(kt_ops.unpack_weights(packed, *w.shape[1:]), _bf16(w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 5])
def test_forward_matches_reference(experts, dtype, T):
    x = make_hidden(T, H, dtype, seed=2)
    ids, weights = routing(T)
    out = experts(x, ids, weights)
    assert out.shape == (T, H) and out.dtype == dtype
    assert_matches_reference(out, reference(experts, x, ids, weights))


def test_forward_any_leading_shape_int32_ids_and_skips(experts):
    x = make_hidden(6, H, torch.float32, seed=3).view(2, 3, H)
    ids, weights = routing(6, K=3, ids_dtype=torch.int32, skip_fraction=0.3, skip_rows=(4,))
    ids, weights = ids.view(2, 3, 3), weights.view(2, 3, 3)
    out = experts(x, ids, weights)
    assert out.shape == x.shape
    assert_matches_reference(out, reference(experts, x, ids, weights))
    assert torch.count_nonzero(out.view(6, H)[4]) == 0  # a token with no expert here


def test_routing_weights_in_another_dtype(experts):
    """bf16 activations with fp16 routing weights: the weights are taken as fp32."""
    x = make_hidden(3, H, torch.bfloat16, seed=4)
    ids, weights = routing(3, weights_dtype=torch.float16)
    out = experts(x, ids, weights)
    assert_matches_reference(out, reference(experts, x, ids, weights))


def test_empty_batch(experts):
    out = experts(torch.empty(0, H), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2))
    assert out.shape == (0, H)


def test_buffers_state_dict_and_repr(experts, dense):
    names = [n for n, _ in experts.named_buffers()]
    assert names == ["gate_weight", "up_weight", "down_weight"]
    assert (experts.num_experts, experts.hidden_size, experts.intermediate_size) == (E, H, I)
    assert repr(experts) == (
        "MoEExperts(num_experts=8, hidden_size=64, intermediate_size=40, weight_format='bf16')"
    )
    # state_dict round trip into a module built from other weights
    other = MoEExperts.from_dense(*(torch.zeros_like(t) for t in dense))
    other.load_state_dict(experts.state_dict())
    x = torch.randn(4, H)
    ids, weights = routing(4)
    assert torch.equal(other(x, ids, weights), experts(x, ids, weights))


def test_old_kquant_state_dict_is_refused_by_name():
    # kt_ops before manifest_version 2 kept k-quant scales as fp32 d*sc plus
    # fp32 dmin*m zeros; such a state_dict names the buffer and the layout.
    g = torch.Generator().manual_seed(3)
    h, i = 256, 32  # k-quants need K % 256 == 0 (gate/up K = h; down K = i -> bf16 down)
    gate, up = (torch.randn(2, i, h, generator=g) / 16 for _ in range(2))
    down = torch.randn(2, h, i, generator=g) / 6
    m = MoEExperts(
        kt_ops.ExpertWeights(
            kt_ops.formats.quantize_weights(gate, "q4_k"),
            kt_ops.formats.quantize_weights(up, "q4_k"),
            kt_ops.formats.quantize_weights(down, "bf16"),
        )
    )
    sd = m.state_dict()
    E_, NB, _, _ = sd["up_scales"].shape
    sd["up_scales"] = torch.ones(E_, NB, h // 32, 16)  # the old fp32 [E, NB, G, 16]
    sd["up_zeros"] = torch.zeros(E_, NB, h // 32, 16)
    with pytest.raises(ValueError, match=r"up_scales is torch.float32.*manifest_version 2"):
        m.load_state_dict(sd)
    m.load_state_dict(m.state_dict())  # today's layout still loads


def test_old_q2_k_and_q3_k_state_dicts_are_repacked():
    # kt_ops before the 2- and 3-bit planes (manifest_version 2) kept q2_k / q3_k codes
    # in the 4-bit plane; such a state_dict loads, its codes repacked, bit-identically.
    g = torch.Generator().manual_seed(4)
    h, i = 256, 256
    gate, up = (torch.randn(2, i, h, generator=g) / 16 for _ in range(2))
    down = torch.randn(2, h, i, generator=g) / 6
    q = kt_ops.formats.quantize_weights
    m = MoEExperts(kt_ops.ExpertWeights(q(gate, "q2_k"), q(up, "q3_k"), q(down, "q2_k")))
    sd = m.state_dict()
    old = dict(sd)
    for proj, bits in (("gate", 2), ("up", 3), ("down", 2)):
        codes = kt_ops.formats.unpack_codes(sd[f"{proj}_weight"], bits, *sd_dims(proj, h, i))
        old[f"{proj}_weight"] = kt_ops.formats.pack_codes(codes, 4)
        assert old[f"{proj}_weight"].shape[-1] == 8 * 256
    other = MoEExperts(kt_ops.ExpertWeights(q(gate * 0, "q2_k"), q(up, "q3_k"), q(down, "q2_k")))
    other.load_state_dict(old)
    for proj in ("gate", "up", "down"):
        assert torch.equal(getattr(other, f"{proj}_weight"), sd[f"{proj}_weight"])
    x = torch.randn(3, h, generator=g)
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])
    w = torch.full((3, 2), 0.5)
    assert torch.equal(other(x, ids, w), m(x, ids, w))


def sd_dims(proj: str, h: int, i: int) -> tuple[int, int]:
    return (h, i) if proj == "down" else (i, h)


def test_dtype_and_device_casts_leave_packed_weights_alone(experts):
    m = copy.deepcopy(experts)
    m.half()
    m.to(torch.float32)
    m.to("cpu", torch.float64)
    assert all(b.dtype == torch.bfloat16 for b in m.buffers())
    assert torch.equal(m.gate_weight, experts.gate_weight)
    x = make_hidden(3, H, torch.float32)
    ids, weights = routing(3)
    assert torch.equal(m(x, ids, weights), experts(x, ids, weights))


def test_chunked_packing_equals_pack_weights(dense, monkeypatch):
    monkeypatch.setattr(kt_layer, "_QUANTIZE_CHUNK_ELEMS", 3 * I * H)  # 3 experts per chunk
    chunked = MoEExperts.from_dense(*dense)
    for name, w in zip(("gate_weight", "up_weight", "down_weight"), dense):
        assert torch.equal(getattr(chunked, name), kt_ops.pack_weights(w))


def test_from_dense_errors(dense):
    gate, up, down = dense
    with pytest.raises(ValueError, match="gate must be 3-D"):
        MoEExperts.from_dense(gate[0], up, down)
    with pytest.raises(ValueError, match=r"expected gate and up \[E, I, H\] and down \[E, H, I\]"):
        MoEExperts.from_dense(gate, up, down.transpose(1, 2))
    with pytest.raises(ValueError, match="unknown weight_format 'int5'"):
        MoEExperts.from_dense(gate, up, down, weight_format="int5")
    with pytest.raises(ValueError, match="not a multiple of group_size=128"):
        MoEExperts.from_dense(gate, up, down, weight_format="int4", group_size=128)


def test_constructor_checks_packed_shapes(experts):
    ew = experts.expert_weights()
    with pytest.raises(ValueError, match=r"expected gate and up \[E, I, H\] and down \[E, H, I\]"):
        MoEExperts(kt_ops.ExpertWeights(ew.gate, ew.up, ew.gate))
    wider = [dataclasses.replace(p, k=H + 2) for p in (ew.gate, ew.up)]
    wider.append(dataclasses.replace(ew.down, n=H + 2))
    with pytest.raises(ValueError, match=r"ExpertWeights.gate: PackedProjection.weight has"):
        MoEExperts(kt_ops.ExpertWeights(*wider))
    empty = [dataclasses.replace(p, n=0) for p in (ew.gate, ew.up)]
    empty.append(dataclasses.replace(ew.down, k=0))
    with pytest.raises(ValueError, match="must be a positive int"):
        MoEExperts(kt_ops.ExpertWeights(*empty))
    with pytest.raises(ValueError, match="experts must be a kt_ops.ExpertWeights"):
        MoEExperts(ew.tensors())
    fewer = dataclasses.replace(ew.down, weight=ew.down.weight[:4])
    with pytest.raises(ValueError, match=r"different expert counts \[4, 8\]"):
        kt_ops.ExpertWeights(ew.gate, ew.up, fewer)


def test_module_round_trips_expert_weights(experts):
    ew = experts.expert_weights()
    again = MoEExperts(ew)
    assert again.weight_formats == ("bf16",) * 3 and again.group_sizes == (0, 0, 0)
    assert again.weight_format == "bf16"
    for a, b in zip(ew.tensors(), again.expert_weights().tensors()):
        assert (a is None and b is None) or torch.equal(a, b)
    assert (ew.num_experts, ew.hidden_size, ew.intermediate_size) == (E, H, I)


def test_inference_call_follows_buffers_and_lora(dense):
    # Under no_grad without LoRA the module calls the op on cached layer arguments:
    # the cache must follow a replaced buffer and step aside once LoRA is added.
    module = MoEExperts.from_dense(*dense)
    x = make_hidden(4, H, torch.float32)
    ids, weights = routing(4)
    with torch.no_grad():
        first = module(x, ids, weights)
    torch.testing.assert_close(first, module(x, ids, weights), rtol=0, atol=0)  # grad-mode path
    other = MoEExperts.from_dense(*(t.flip(0) for t in dense))
    module.gate_weight = other.gate_weight
    with torch.no_grad():
        swapped = module(x, ids, weights)
    assert not torch.equal(swapped, first)
    torch.testing.assert_close(swapped, module(x, ids, weights), rtol=0, atol=0)
    assert_matches_reference(swapped, reference(module, x, ids, weights))
    module.add_lora(2, alpha=2)
    with torch.no_grad():
        module.gate_lora_b.normal_()
        adapted = module(x, ids, weights)
    assert not torch.equal(adapted, swapped)
    assert_matches_reference(adapted, reference(module, x, ids, weights))


def test_forward_errors(experts):
    ids, weights = routing(2)
    with pytest.raises(ValueError, match="expected hidden_size=64"):
        experts(torch.randn(2, H + 1), ids, weights)
    with pytest.raises(RuntimeError, match="topk_ids must lie in"):
        experts(torch.randn(2, H), torch.full((2, 2), E), weights)


def test_expert_list_indexing(dense):
    experts = MoEExpertList.from_dense(*dense)
    assert len(experts) == E and isinstance(experts, MoEExperts)
    x = make_hidden(6, H, torch.float32, seed=5).view(2, 3, H)
    for index in (0, 5, torch.tensor([E - 1]), -1):
        e = int(index) % E
        want = reference(experts, x, torch.full((2, 3, 1), e), torch.ones(2, 3, 1))
        assert_matches_reference(experts[index](x), want)
    assert [expert.index for expert in experts] == list(range(E))
    with pytest.raises(IndexError, match="out of range"):
        experts[E]
    # The fused call still works.
    ids, weights = routing(6)
    x = x.view(6, H)
    assert_matches_reference(experts(x, ids, weights), reference(experts, x, ids, weights))


def test_torch_compile_fullgraph_dynamic(experts, dense):
    torch._dynamo.reset()
    compiled = torch.compile(experts, fullgraph=True, dynamic=True)
    for T in (1, 4, 9):
        x = make_hidden(T, H, torch.float32, seed=T)
        ids, weights = routing(T)
        assert torch.equal(compiled(x, ids, weights), experts(x, ids, weights))
    x = torch.randn(2, 3, H).to(torch.bfloat16)
    ids, weights = routing(6)
    ids, weights = ids.view(2, 3, 2), weights.view(2, 3, 2)
    assert torch.equal(compiled(x, ids, weights), experts(x, ids, weights))


def test_compile_single_graph_no_breaks_no_recompiles(experts):
    torch._dynamo.reset()
    x, (ids, weights) = torch.randn(3, H), routing(3)
    explanation = torch._dynamo.explain(experts)(x, ids, weights)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(experts, backend=counter, fullgraph=True, dynamic=True)
    for T in (3, 5, 17):  # several token counts, one graph
        ids, weights = routing(T)
        compiled(torch.randn(T, H), ids, weights)
    assert counter.frame_count == 1


# --------------------------------------------------------------------------
# Training: gradients through the module, LoRA adapters
# --------------------------------------------------------------------------


def test_gradients_flow_to_inputs(dense):
    module = MoEExperts.from_dense(*dense)
    x = make_hidden(6, H, torch.float32).requires_grad_(True)
    ids, weights = routing(6)
    weights.requires_grad_(True)
    module(x, ids, weights).square().sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = weights.detach().clone().requires_grad_(True)
    reference(module, x_ref, ids, w_ref).square().sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(weights.grad, w_ref.grad, rtol=1e-4, atol=1e-5)
    assert all(not b.requires_grad for b in module.buffers())


@pytest.mark.parametrize("checkpointing", [None, False, True])
def test_add_lora_trains_the_adapters(dense, checkpointing):
    module = MoEExperts.from_dense(*dense, activation_checkpointing=None)
    module.activation_checkpointing = checkpointing
    gen = torch.Generator().manual_seed(0)
    assert module.add_lora(4, alpha=8, projections=("gate", "down"), generator=gen) is module
    assert module.lora_scaling == 2.0
    assert set(dict(module.named_parameters())) == {
        "gate_lora_a", "gate_lora_b", "down_lora_a", "down_lora_b"
    }  # fmt: skip
    assert module.gate_lora_a.shape == (E, 4, H) and module.down_lora_b.shape == (E, H, 4)
    assert "lora=('gate', 'down')" in repr(module)
    x = make_hidden(5, H, torch.float32)
    ids, weights = routing(5)
    # B starts at zero (PEFT): the adapted module starts as the base module.
    assert_matches_reference(module(x, ids, weights), reference(module, x, ids, weights))
    before = module(x, ids, weights).detach()
    loss = module(x, ids, weights).square().sum()
    loss.backward()
    # With B = 0 only the B factors get a gradient (dA = s (d B)^T x = 0).
    assert module.gate_lora_b.grad.abs().sum() > 0 and module.down_lora_b.grad.abs().sum() > 0
    assert torch.all(module.gate_lora_a.grad == 0)
    # One SGD step changes the output (to the reference's with the new factors), and
    # state_dict carries the adapters.
    with torch.no_grad():
        for p in module.parameters():
            p -= 0.1 * p.grad
    after = module(x, ids, weights)
    assert (after - before).abs().max() > 1e-3 * before.abs().max()
    assert_matches_reference(after, reference(module, x, ids, weights))
    assert {"gate_lora_a", "down_lora_b", "gate_weight"} <= set(module.state_dict())
    clone = copy.deepcopy(module)
    torch.testing.assert_close(clone(x, ids, weights), module(x, ids, weights), rtol=0, atol=0)


def test_add_lora_on_expert_list(dense):
    module = MoEExpertList.from_dense(*dense).add_lora(2, dtype=torch.bfloat16)
    with torch.no_grad():
        module.up_lora_b.normal_()
    x = make_hidden(3, H, torch.float32)
    lora = {k: v.detach() for k, v in module.lora_parameters().items()}
    ids = torch.full((3, 1), 5)
    lw = kt_ops.LoRAWeights(**{p: (lora[f"{p}_lora_a"], lora[f"{p}_lora_b"]) for p in PROJ})
    want = kt_ops.moe_forward(x, ids, torch.ones(3, 1), module.expert_weights(), lw)
    torch.testing.assert_close(module[5](x), want, rtol=0, atol=0)  # the op's bits
    # and the dense reference's values (the LoRA term of up is not zero)
    ref = reference_moe_forward(x, ids, torch.ones(3, 1), module.expert_weights(), lw)
    assert_matches_reference(module[5](x), ref)
    base = kt_ops.moe_forward(x, ids, torch.ones(3, 1), module.expert_weights())
    assert not torch.equal(base, want)


def test_integer_routing_weights_are_refused(experts):
    """Routing weights must be floating (the op's rule); an int tensor is an error, not
    silently converted."""
    x = torch.randn(3, experts.hidden_size)
    ids = torch.zeros(3, 2, dtype=torch.long)
    for grad in (False, True):
        with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match="top_k_weights"):
            experts(x, ids, torch.ones(3, 2, dtype=torch.long))
    torch.testing.assert_close(  # float64: converted
        experts(x, ids, torch.ones(3, 2, dtype=torch.float64)), experts(x, ids, torch.ones(3, 2))
    )


def test_add_lora_errors(dense):
    module = MoEExperts.from_dense(*dense)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="rank must be an int >= 1"):
            module.add_lora(bad)
    with pytest.raises(ValueError, match="projections"):
        module.add_lora(2, projections=("gate", "qkv"))
    with pytest.raises(ValueError, match="dtype"):
        module.add_lora(2, dtype=torch.float64)
    module.add_lora(2, projections=("up",))
    with pytest.raises(ValueError, match="already have LoRA"):
        module.add_lora(2, projections=("up",))


def test_compiled_lora_training_step(dense):
    torch._dynamo.reset()
    module = MoEExperts.from_dense(*dense).add_lora(4, alpha=4)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("_b"):
                p.normal_(std=0.1)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True, dynamic=True)
    for T in (3, 7):
        x = make_hidden(T, H, torch.float32)
        ids, weights = routing(T)
        module.zero_grad()
        module(x, ids, weights).square().sum().backward()
        want = {k: p.grad.clone() for k, p in module.named_parameters()}
        module.zero_grad()
        compiled(x, ids, weights).square().sum().backward()
        for k, p in module.named_parameters():
            torch.testing.assert_close(p.grad, want[k], rtol=0, atol=0)
    torch._dynamo.reset()
