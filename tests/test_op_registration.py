"""torch.ops.kt.moe_forward as a PyTorch op: schema, fake kernel, opcheck, torch.compile."""

# T, H, I, E, K: tokens, hidden, intermediate, experts, top-k (the design notes' names).
# ruff: noqa: E741

from __future__ import annotations

import pytest
import torch
from reference import (
    Sample,
    assert_matches_reference,
    make_expert_weights,
    make_hidden,
    make_routing,
    reference_moe_forward,
    sample_inputs,
)
from torch._subclasses.fake_tensor import FakeTensorMode

import kt_ops

SAMPLES = list(sample_inputs())
OP = torch.ops.kt.moe_forward


def test_schema_is_functional_and_documented():
    schema = OP.default._schema
    assert str(schema.returns[0].type) == "Tensor"
    assert not schema.is_mutable
    names = [a.name for a in schema.arguments]
    assert names[:7] == [
        "hidden_states",
        "topk_ids",
        "topk_weights",
        "gate_weight",
        "up_weight",
        "down_weight",
        "intermediate_size",
    ]
    assert {"weight_format", "activation", "lora_scaling", "group_size"} <= set(names)
    assert kt_ops.moe_forward.__doc__


def test_training_op_schemas():
    # moe_forward_train: moe_forward's arguments; out plus the two saved pre-activations.
    train = torch.ops.kt.moe_forward_train.default._schema
    fwd = OP.default._schema
    assert [a.name for a in train.arguments] == [a.name for a in fwd.arguments]
    assert [r.name for r in train.returns] == ["out", "gate_pre", "up_pre"]
    # moe_backward: grad_output, moe_forward's arguments, the optional saved
    # pre-activations; eight plain tensors back (no optional/list returns).
    bwd = torch.ops.kt.moe_backward.default._schema
    names = [a.name for a in bwd.arguments]
    assert names == ["grad_output", *[a.name for a in fwd.arguments], "gate_pre", "up_pre",
                     "compute_grad_hidden_states"]  # fmt: skip
    assert [str(r.type) for r in bwd.returns] == ["Tensor"] * 8
    assert [r.name for r in bwd.returns][:2] == ["grad_hidden_states", "grad_topk_weights"]
    for schema in (train, bwd):
        assert not schema.is_mutable
    assert kt_ops.ops.moe_backward.__doc__ and kt_ops.ops.moe_forward_train.__doc__


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_opcheck(sample: Sample):
    torch.library.opcheck(OP.default, sample.args, sample.kwargs)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_sample_matches_reference(sample: Sample):
    # The opcheck samples are valid inputs the op computes correctly.
    out = OP(*sample.args, **sample.kwargs)
    x = sample.args[0]
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_matches_reference(out, reference_moe_forward(*sample.args, **sample.kwargs))


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_fake_kernel_shape_and_dtype(sample: Sample):
    real = OP(*sample.args, **sample.kwargs)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in sample.args]
        fake = OP(*fake_args, **sample.kwargs)
    assert fake.shape == real.shape
    assert fake.dtype == real.dtype
    assert fake.device == real.device
    assert fake.stride() == real.stride()


def test_meta_tensors_give_meta_output():
    x, ids, weights, g, u, d, I = SAMPLES[1].args
    meta = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in (x, ids, weights, g, u, d)]
    out = OP(*meta, I)
    assert out.device.type == "meta"
    assert out.shape == x.shape and out.dtype == x.dtype


def test_fake_kernel_rejects_bad_shapes():
    x, ids, weights, g, u, d, I = SAMPLES[0].args
    with FakeTensorMode() as mode:
        fx, fids, fw, fg, fu, fd = (mode.from_tensor(t) for t in (x, ids, weights, g, u, d))
        with pytest.raises(RuntimeError, match="topk_weights"):
            OP(fx, fids, fw[:, :1], fg, fu, fd, I)
        with pytest.raises(RuntimeError, match="hidden_states"):
            OP(fx.unsqueeze(0), fids, fw, fg, fu, fd, I)
        with pytest.raises(RuntimeError, match="topk_ids"):
            OP(fx, fids.float(), fw, fg, fu, fd, I)


# --------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------


class MoEBlock(torch.nn.Module):
    """A small module around the op: a pre-scale, the routed experts, a residual."""

    def __init__(self, E: int, H: int, I: int, K: int):
        super().__init__()
        w = make_expert_weights(E, H, I, seed=21)
        self.register_buffer("gate", w.gate)
        self.register_buffer("up", w.up)
        self.register_buffer("down", w.down)
        self.intermediate_size = I
        self.K = K

    def forward(self, x, topk_ids, topk_weights):
        h = x * 0.5
        y = torch.ops.kt.moe_forward(
            h, topk_ids, topk_weights, self.gate, self.up, self.down, self.intermediate_size
        )
        return x + y


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_fullgraph_dynamic_matches_eager(fresh_dynamo):
    from torch._dynamo.testing import CompileCounterWithBackend

    E, H, I, K = 8, 48, 40, 2
    model = MoEBlock(E, H, I, K)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    token_counts = [3, 7, 64, 5, 2]  # T changes between calls
    for T in token_counts:
        x = make_hidden(T, H, torch.float32, seed=T)
        ids, weights = make_routing(T, E, K, seed=T)
        got = compiled(x, ids, weights)
        want = model(x, ids, weights)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # One graph for every T >= 2 (dynamic shapes: no recompile per token count).
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times for T={token_counts}"


def test_compile_bf16_and_t_0_1_match_eager(fresh_dynamo):
    # aot_eager (no C++ codegen: fast) for the specialized T = 1 and T = 0 and bf16/int32.
    E, H, I, K = 6, 33, 17, 3
    model = MoEBlock(E, H, I, K)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    for T in (4, 9, 1, 0):
        x = make_hidden(T, H, torch.bfloat16, seed=T)
        ids, weights = make_routing(T, E, K, seed=T, ids_dtype=torch.int32)
        torch.testing.assert_close(
            compiled(x, ids, weights), model(x, ids, weights), rtol=0, atol=0
        )


def test_no_graph_breaks(fresh_dynamo):
    E, H, I, K = 4, 32, 16, 2
    model = MoEBlock(E, H, I, K)
    x = make_hidden(5, H, torch.float32)
    ids, weights = make_routing(5, E, K)
    explanation = torch._dynamo.explain(model)(x, ids, weights)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
