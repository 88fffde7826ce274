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
    sample_inputs,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

import kt_ops
from kt_ops.layer import layer_args

SAMPLES = list(sample_inputs())
OP = torch.ops.kt.moe_forward


LAYER_ARGS = ["weights", "weight_format", "sizes", "group_sizes", "lora", "lora_scaling",
              "activation", "gpu_experts_mask"]  # fmt: skip


def test_schema_is_functional_and_documented():
    schema = OP.default._schema
    assert str(schema.returns[0].type) == "Tensor"
    assert not schema.is_mutable
    names = [a.name for a in schema.arguments]
    assert names == ["hidden_states", "topk_ids", "topk_weights", *LAYER_ARGS]
    types = {a.name: str(a.type) for a in schema.arguments}
    assert types["weights"] == "List[Optional[Tensor]]" and types["lora"] == "List[Tensor]"
    assert (types["sizes"], types["group_sizes"]) == ("List[int]", "List[int]")
    assert types["gpu_experts_mask"] == "Optional[Tensor]"
    assert not any(a.kwarg_only for a in schema.arguments)
    assert kt_ops.moe_forward.__doc__


def test_out_overload_schema():
    out = OP.out._schema
    fwd = OP.default._schema
    assert [a.name for a in out.arguments] == [a.name for a in fwd.arguments] + ["out"]
    (arg,) = [a for a in out.arguments if a.name == "out"]
    assert arg.kwarg_only and arg.alias_info is not None and arg.alias_info.is_write
    assert out.is_mutable
    # No return: AOTAutograd refuses custom ops whose outputs alias an input.
    assert len(out.returns) == 0


def test_training_op_schemas():
    # moe_forward_train: moe_forward's arguments; out plus the two saved pre-activations.
    train = torch.ops.kt.moe_forward_train.default._schema
    fwd = OP.default._schema
    assert [a.name for a in train.arguments] == [a.name for a in fwd.arguments]
    assert [r.name for r in train.returns] == ["out", "gate_pre", "up_pre"]
    # moe_backward: grad_output, moe_forward's arguments, the optional saved
    # pre-activations; two tensors and the list of LoRA gradients back.
    bwd = torch.ops.kt.moe_backward.default._schema
    names = [a.name for a in bwd.arguments]
    assert names == ["grad_output", *[a.name for a in fwd.arguments], "gate_pre", "up_pre",
                     "compute_grad_hidden_states"]  # fmt: skip
    assert [str(r.type) for r in bwd.returns] == ["Tensor", "Tensor", "List[Tensor]"]
    assert [r.name for r in bwd.returns] == [
        "grad_hidden_states",
        "grad_topk_weights",
        "grad_lora",
    ]
    for schema in (train, bwd):
        assert not schema.is_mutable
    assert kt_ops.ops.moe_backward.__doc__ and kt_ops.ops.moe_forward_train.__doc__


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_opcheck(sample: Sample):
    torch.library.opcheck(OP.default, sample.args, sample.kwargs)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_sample_matches_reference(sample: Sample):
    # The opcheck samples are valid inputs the op computes correctly (on the
    # streaming kernels; the brgemm path's reference: test_compute_paths.py).
    with kt_ops.use_compute_path("streaming"):
        out = OP(*sample.args, **sample.kwargs)
    x = sample.args[0]
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_matches_reference(out, sample.reference())


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_fake_kernel_shape_and_dtype(sample: Sample):
    real = OP(*sample.args, **sample.kwargs)
    with FakeTensorMode() as mode:
        fake_args = tree_map(
            lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a, sample.args
        )
        fake = OP(*fake_args, **sample.kwargs)
    assert fake.shape == real.shape
    assert fake.dtype == real.dtype
    assert fake.device == real.device
    assert fake.stride() == real.stride()


def to_meta(args):
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, args)


def test_meta_tensors_give_meta_output():
    args = SAMPLES[1].args
    out = OP(*to_meta(args))
    x = args[0]
    assert out.device.type == "meta"
    assert out.shape == x.shape and out.dtype == x.dtype


def test_fake_kernel_rejects_bad_shapes():
    x, ids, weights, *layer = SAMPLES[0].args
    H = x.shape[1]
    with FakeTensorMode() as mode:
        fx, fids, fw, *flayer = tree_map(
            lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t,
            (x, ids, weights, *layer),
        )
        with pytest.raises(RuntimeError, match="topk_weights"):
            OP(fx, fids, fw[:, :1], *flayer)
        with pytest.raises(RuntimeError, match="hidden_states"):
            OP(fx.unsqueeze(0), fids, fw, *flayer)
        with pytest.raises(RuntimeError, match="topk_ids"):
            OP(fx, fids.float(), fw, *flayer)
        # issue 13 item 7: hidden_states one column short of sizes[0] (inside the padding)
        with pytest.raises(RuntimeError, match=f"has {H - 1} columns but .* hidden_size is {H}"):
            OP(fx[:, : H - 1], fids, fw, *flayer)
        with pytest.raises(RuntimeError, match="weights must hold 9 entries"):
            OP(fx, fids, fw, flayer[0][:8], *flayer[1:])
        with pytest.raises(RuntimeError, match=r"gate(_weight|: PackedProjection\.weight) has"):
            OP(fx, fids, fw, flayer[0], flayer[1], [H, 2 * x.shape[1]], *flayer[3:])


# --------------------------------------------------------------------------
# torch.compile
# --------------------------------------------------------------------------


class MoEBlock(torch.nn.Module):
    """A small module around the op: a pre-scale, the routed experts, a residual."""

    def __init__(self, E: int, H: int, I: int, K: int):
        super().__init__()
        w = make_expert_weights(E, H, I, seed=21)
        self.register_buffer("gate", w.gate.weight)
        self.register_buffer("up", w.up.weight)
        self.register_buffer("down", w.down.weight)
        self.sizes = [H, I]
        self.K = K

    def forward(self, x, topk_ids, topk_weights):
        h = x * 0.5
        weights = [self.gate, None, None, self.up, None, None, self.down, None, None]
        y = torch.ops.kt.moe_forward(
            h, topk_ids, topk_weights, weights, "bf16", self.sizes, [0, 0, 0], []
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


# --------------------------------------------------------------------------
# The fake kernel makes the op's own checks (shape-only mode of parse_moe_layer)
# --------------------------------------------------------------------------


def _corrupt(args: list, case: str) -> list:
    args = list(args)
    weights = list(args[3])
    if case == "weight_shape":
        weights[0] = weights[0][:, :1]
    elif case == "bias_dtype":
        weights += [torch.zeros(6, 80, dtype=torch.bfloat16), None, None]
    elif case == "weights_count":
        weights = weights[:8]
    elif case == "ids_dtype":
        args[1] = args[1].float()
    elif case == "activation":
        args[9] = "silu(limit=-1)"
    elif case == "lora_rank":
        args[7] = [torch.zeros(6, 2, 96), torch.zeros(6, 80, 3)] + [torch.zeros(0)] * 4
    elif case == "group_size":
        args[6] = [0, 0, 7]
    args[3] = weights
    return args


def _assert_fake_raises_as_eager(op, args: list, message: str) -> None:
    """``op`` raises ``message`` eagerly and under FakeTensorMode (torch.compile's trace),
    with the same first line."""
    with pytest.raises(RuntimeError, match=message) as eager:
        op(*args)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, args)
        with pytest.raises(RuntimeError, match=message) as traced:
            op(*fake)
    assert str(traced.value).split("\n")[0] == str(eager.value).split("\n")[0]


# case -> the start of the eager error (after "kt.moe_forward: "), so that both sides
# failing on some other check cannot pass.
_FORWARD_BAD_ARGS = {
    "weight_shape": r"gate_weight has shape \[6, 1, 48, 16, 2\]",
    "bias_dtype": "gate_bias must be fp32",
    "weights_count": "weights must hold 9 entries",
    "ids_dtype": "topk_ids must be int32 or int64, got Float",
    "activation": r"activation='silu\(limit=-1\)' is not supported",
    "lora_rank": r"gate_lora_b must be \[E=6, I=80, r=2\]",
    "group_size": "group size 7 of down is not valid",
}


@pytest.mark.parametrize("case", sorted(_FORWARD_BAD_ARGS))
def test_fake_kernel_raises_the_eager_error(case: str):
    experts = make_expert_weights(6, 96, 80, seed=1)
    ids, w = make_routing(3, 6, 2)
    x = make_hidden(3, 96, torch.float32)
    args = _corrupt([x, ids, w, *layer_args(experts, None, "silu", x)], case)
    message = "kt.moe_forward: " + _FORWARD_BAD_ARGS[case]
    _assert_fake_raises_as_eager(torch.ops.kt.moe_forward.default, args, message)


_BACKWARD_BAD_ARGS = {
    # case: (what to change in (grad_output, gate_pre, up_pre), the eager error's start)
    "grad_output_dtype": (lambda g, gp, up: (g.double(), gp, up), "grad_output must be fp32"),
    "grad_output_shape": (lambda g, gp, up: (g[:2], gp, up), "grad_output must have the shape"),
    "gate_pre_alone": (lambda g, gp, up: (g, gp, None), "gate_pre was given without up_pre"),
    "up_pre_alone": (lambda g, gp, up: (g, None, up), "up_pre was given without gate_pre"),
    "gate_pre_rows": (lambda g, gp, up: (g, gp[:1], up), "gate_pre must be a contiguous fp32"),
    "up_pre_dtype": (lambda g, gp, up: (g, gp, up.double()), "up_pre must be a contiguous fp32"),
    "gate_pre_strided": (
        lambda g, gp, up: (g, gp.t().contiguous().t(), up),
        r"gate_pre must be a contiguous fp32 .* \(not contiguous\)",
    ),
}


@pytest.mark.parametrize("case", sorted(_BACKWARD_BAD_ARGS))
def test_backward_fake_kernel_raises_the_eager_error(case: str):
    """kt.moe_backward's fake kernel (torch.compile's trace) refuses what its eager kernel
    refuses, with the same message: grad_output's dtype and shape, the saved
    pre-activations' pairing, shape, dtype and layout (the eager op's own checks, on meta
    stand-ins)."""
    experts = make_expert_weights(6, 96, 80, seed=1)
    ids, w = make_routing(3, 6, 2)
    x = make_hidden(3, 96, torch.float32)
    layer = layer_args(experts, None, "silu", x)
    _, gate_pre, up_pre = torch.ops.kt.moe_forward_train.default(x, ids, w, *layer)
    change, message = _BACKWARD_BAD_ARGS[case]
    g, gp, up = change(torch.ones_like(x), gate_pre, up_pre)
    args = [g, x, ids, w, *layer, gp, up]
    _assert_fake_raises_as_eager(torch.ops.kt.moe_backward.default, args, message)
    # Unchanged, both accept the arguments.
    ok = [torch.ones_like(x), x, ids, w, *layer, gate_pre, up_pre]
    torch.ops.kt.moe_backward.default(*ok)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        torch.ops.kt.moe_backward.default(
            *tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, ok)
        )


def test_dynamic_token_count_compiles_once():
    experts = make_expert_weights(6, 96, 80, seed=1)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    f = torch.compile(
        lambda x, i, w: kt_ops.moe_forward(x, i, w, experts) * 2,
        backend=backend,
        dynamic=True,
        fullgraph=True,
    )
    with torch.no_grad():
        for T in (3, 5, 9, 17):
            ids, w = make_routing(T, 6, 2, seed=T)
            x = make_hidden(T, 96, torch.float32, seed=T)
            assert torch.equal(f(x, ids, w), kt_ops.moe_forward(x, ids, w, experts) * 2)
    assert len(graphs) == 1
