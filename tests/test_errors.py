"""Every caller error gets a clear exception that names the offending argument."""

# T, H, I, E, K: tokens, hidden, intermediate, experts, top-k (the design notes' names).
# ruff: noqa: E741

from __future__ import annotations

import re

import pytest
import torch
from reference import make_expert_weights, make_hidden, make_routing, reference_moe_forward

import kt_ops
from kt_ops.layer import PROJECTIONS

E, H, I, T, K = 4, 32, 16, 3, 2


@pytest.fixture(scope="module")
def layer():
    return make_expert_weights(E, H, I, seed=0)


#: The 9 entries of the op's ``weights`` list and the 6 of its ``lora`` list, by name.
WEIGHT_NAMES = [f"{p}_{part}" for p in PROJECTIONS for part in ("weight", "scales", "zeros")]
LORA_NAMES = [f"{p}_lora_{f}" for p in PROJECTIONS for f in ("a", "b")]


@pytest.fixture
def call(layer):
    """``call(**overrides)``: ``torch.ops.kt.moe_forward`` on valid arguments, some replaced.

    Arguments are named as the op's (``weight_format``, ``sizes``, ...), and
    one entry of the ``weights`` list (``gate_weight`` ... ``down_zeros``) or of
    the ``lora`` list (``gate_lora_a`` ... ``down_lora_b``; the others then
    ``[0]``-shaped) by its name.
    """
    ids, weights = make_routing(T, E, K)
    valid = dict(
        hidden_states=make_hidden(T, H),
        topk_ids=ids,
        topk_weights=weights,
        **dict(zip(WEIGHT_NAMES, layer.tensors())),
        weight_format="bf16",
        sizes=[H, I],
        group_sizes=[0, 0, 0],
        lora_scaling=1.0,
        activation="silu",
    )

    def run(**overrides):
        a = {**valid, **overrides}
        lora = [a.pop(n, None) for n in LORA_NAMES]
        if any(t is not None for t in lora):
            lora = [t if t is not None else torch.empty(0) for t in lora]
        else:
            lora = a.pop("lora", [])
        args = {k: v for k, v in a.items() if k not in WEIGHT_NAMES}
        weights = a.get("weights", [a[n] for n in WEIGHT_NAMES])
        return torch.ops.kt.moe_forward(**{**args, "weights": weights, "lora": lora})

    run.valid = valid
    return run


def test_valid_call_works(call):
    assert call().shape == (T, H)


# --------------------------------------------------------------------------
# Activations and routing
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int8, torch.bool], ids=str)
def test_hidden_states_dtype(call, dtype):
    with pytest.raises(RuntimeError, match="hidden_states"):
        call(hidden_states=make_hidden(T, H, torch.float32).to(dtype))


@pytest.mark.parametrize("shape", [(H,), (1, T, H), ()])
def test_hidden_states_rank(call, shape):
    x = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="hidden_states"):
        call(hidden_states=x)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.int16, torch.uint8, torch.bfloat16], ids=str
)
def test_topk_ids_dtype(call, dtype):
    ids = call.valid["topk_ids"]
    with pytest.raises(RuntimeError, match="topk_ids"):
        call(topk_ids=ids.to(dtype))


@pytest.mark.parametrize(
    "shape", [(T,), (T + 1, K), (T - 1, K), (1, T, K)], ids=["1d", "more_rows", "fewer_rows", "3d"]
)
def test_topk_ids_shape(call, shape):
    ids = torch.zeros(shape, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="topk_ids"):
        call(topk_ids=ids, topk_weights=torch.ones(shape))


@pytest.mark.parametrize("bad", [E, E + 7, -2, -100])
def test_topk_ids_out_of_range(call, bad):
    ids = call.valid["topk_ids"].clone()
    ids[T - 1, K - 1] = bad
    with pytest.raises(RuntimeError, match=r"topk_ids.*\[-1, 4\)"):
        call(topk_ids=ids)


def test_topk_ids_out_of_range_int32(call):
    ids = call.valid["topk_ids"].to(torch.int32)
    ids[0, 0] = E
    with pytest.raises(RuntimeError, match="topk_ids"):
        call(topk_ids=ids)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float64, torch.bool], ids=str)
def test_topk_weights_dtype(call, dtype):
    with pytest.raises(RuntimeError, match="topk_weights"):
        call(topk_weights=call.valid["topk_weights"].to(dtype))


@pytest.mark.parametrize("shape", [(T, K + 1), (T, K - 1), (T,), (T, K, 1)])
def test_topk_weights_shape(call, shape):
    with pytest.raises(RuntimeError, match="topk_weights"):
        call(topk_weights=torch.ones(shape))


# --------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gate_weight", "up_weight", "down_weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int16], ids=str)
def test_weight_dtype(call, name, dtype):
    bad = call.valid[name].to(dtype)
    with pytest.raises(RuntimeError, match=name):
        call(**{name: bad})


@pytest.mark.parametrize("name", ["gate_weight", "up_weight", "down_weight"])
def test_dense_unpacked_weight(call, name):
    n, k = (H, I) if name == "down_weight" else (I, H)
    dense = torch.randn(E, n, k, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=rf"{name}.*pack"):
        call(**{name: dense})


@pytest.mark.parametrize("name", ["gate_weight", "up_weight", "down_weight"])
def test_weight_packed_for_another_hidden_size(call, name):
    other = make_expert_weights(E, 2 * H, I, seed=1)
    with pytest.raises(RuntimeError, match=name):
        call(**{name: getattr(other, name.split("_")[0]).weight})


@pytest.mark.parametrize("cols", [H + 16, H - 1, H + 1, 1], ids=["H+16", "H-1", "H+1", "1"])
def test_hidden_states_of_another_hidden_size(call, cols):
    # issue 13 item 7: H-1 and H+1 lie inside the bf16 packing's padding (k pairs) and
    # used to compute silently; the experts' true hidden_size (sizes[0]) rules now.
    with pytest.raises(
        RuntimeError,
        match=rf"kt.moe_forward: hidden_states has {cols} columns but the experts' hidden_size "
        rf"is {H}",
    ):
        call(hidden_states=make_hidden(T, cols))


@pytest.mark.parametrize("fmt,h", [("bf16", 250), ("int4", 256), ("q8_0", 64), ("fp8", 256)])
def test_hidden_size_inside_the_padding(fmt, h):
    # The same through the Python API, for layers whose packing also holds h - 1
    # columns: bf16 (k pairs), int4 / q8_0 (blocks of 32 along K), fp8 (128 blocks).
    w = make_expert_weights(E, h, 128, weight_format=fmt)
    ids, weights = make_routing(T, E, K)
    msg = rf"hidden_states has {h - 1} columns but the experts' hidden_size is {h}"
    x = make_hidden(T, h - 1, torch.float32)
    with pytest.raises(RuntimeError, match="kt.moe_forward: " + msg):
        kt_ops.moe_forward(x, ids, weights, w)
    with pytest.raises(RuntimeError, match="kt.moe_forward_train: " + msg):
        kt_ops.ops.moe_forward_train(x, ids, weights, w)
    with pytest.raises(RuntimeError, match="kt.moe_backward: " + msg):
        kt_ops.ops.moe_backward(torch.ones_like(x), x, ids, weights, w)
    assert kt_ops.moe_forward(make_hidden(T, h), ids, weights, w).shape == (T, h)


@pytest.mark.parametrize("name", ["up_weight", "down_weight"])
def test_weight_with_another_expert_count(call, name):
    other = make_expert_weights(E + 1, H, I, seed=2)
    with pytest.raises(RuntimeError, match=name):
        call(**{name: getattr(other, name.split("_")[0]).weight})


def test_intermediate_size_not_matching_weights(call):
    with pytest.raises(RuntimeError, match="gate_weight"):
        call(sizes=[H, I + 16])


@pytest.mark.parametrize("name", ["gate_weight", "up_weight", "down_weight"])
def test_wrong_packed_layout(call, name):
    w = call.valid[name]
    # the [16, 2] rows swapped for [2, 16]: same number of elements, wrong layout
    swapped = w.transpose(3, 4).contiguous()
    with pytest.raises(RuntimeError, match=name):
        call(**{name: swapped})
    # right shape, but not contiguous
    strided = w.transpose(3, 4).contiguous().transpose(3, 4)
    with pytest.raises(RuntimeError, match=rf"{name}.*contiguous"):
        call(**{name: strided})


@pytest.mark.parametrize("fmt", ["int4", "BF16", "bf16 ", "", "fp32"])
def test_weight_format_name(call, fmt):
    with pytest.raises(RuntimeError, match=rf"weight_format='{re.escape(fmt)}'"):
        call(weight_format=fmt)


@pytest.mark.parametrize(
    "name", ["gate_scales", "up_scales", "down_scales", "gate_zeros", "up_zeros", "down_zeros"]
)
def test_scales_for_bf16(call, name):
    with pytest.raises(RuntimeError, match=name):
        call(**{name: torch.ones(E, I)})


@pytest.mark.parametrize("proj", range(3))
def test_group_size_for_bf16(call, proj):
    groups = [0, 0, 0]
    groups[proj] = 32
    name = PROJECTIONS[proj]
    with pytest.raises(RuntimeError, match=rf"group size 32 of {name} is not valid.*'bf16'"):
        call(group_sizes=groups)


@pytest.mark.parametrize(
    "override,match",
    [
        (dict(weights=[None] * 8), "weights must hold 9 entries"),
        (dict(weights=[None] * 10), "weights must hold 9 entries"),
        (dict(sizes=[H]), r"sizes must be \[hidden_size, intermediate_size\]"),
        (dict(sizes=[H, I, 1]), r"sizes must be \[hidden_size, intermediate_size\]"),
        (dict(group_sizes=[0, 0]), "group_sizes must hold 3 values"),
        (dict(group_sizes=[0, 0, 0, 0]), "group_sizes must hold 3 values"),
        (dict(lora=[torch.empty(0)] * 5), "lora must be empty or hold 6 tensors"),
        (dict(weight_format="bf16,bf16"), "weight_format='bf16,bf16' must be one format name"),
        (dict(weight_format="bf16,bf16,bf16,bf16"), "weight_format='bf16,.*got 4 names"),
        (dict(gate_weight=None), "gate_weight is missing"),
        (dict(down_weight=None), "down_weight (is missing|must be a packed)"),
    ],
    ids=lambda v: str(v)[:40] if isinstance(v, str) else None,
)
def test_layer_argument_lists(call, override, match):
    with pytest.raises(RuntimeError, match="kt.moe_forward: " + match):
        call(**override)


@pytest.mark.parametrize(
    "name",
    ["gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b"],
)
def test_lora_factor_without_its_pair(call, name):
    # LoRA is computed (tests/test_lora.py); a lone A or B is a caller error that names it.
    with pytest.raises(RuntimeError, match=rf"{name} was given without .*LoRA"):
        call(**{name: torch.zeros(E, 4, H)})


@pytest.mark.parametrize("act", ["tanh", "SiLU", "GELU", "gelu_new", "swiglu", ""])
def test_activation(call, act):
    with pytest.raises(RuntimeError, match=rf"activation='{act}' is not supported; expected one"):
        call(activation=act)


@pytest.mark.parametrize("size", [0, -1, -I])
def test_intermediate_size_not_positive(call, size):
    with pytest.raises(RuntimeError, match=r"sizes must be \[hidden_size, intermediate_size\]"):
        call(sizes=[H, size])
    with pytest.raises(RuntimeError, match=r"sizes must be \[hidden_size, intermediate_size\]"):
        call(sizes=[size, I])


# --------------------------------------------------------------------------
# Devices
# --------------------------------------------------------------------------

TENSOR_ARGS = [
    "hidden_states",
    "topk_ids",
    "topk_weights",
    "gate_weight",
    "up_weight",
    "down_weight",
]


@pytest.mark.parametrize("name", TENSOR_ARGS)
def test_meta_tensor_mixed_with_cpu(call, name):
    # One argument on 'meta', the rest on the CPU, is a caller error (torch's
    # own ops raise "Tensor on device cpu is not on the expected device meta").
    # It must not return a tensor: an uninitialized CPU result would be garbage.
    bad = call.valid[name].to("meta")
    with pytest.raises(RuntimeError, match=name):
        call(**{name: bad})


def test_all_meta_is_fine(call):
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in call.valid.items()}
    out = call(**meta)
    assert out.device.type == "meta" and out.shape == (T, H)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", TENSOR_ARGS)
def test_cuda_tensor_on_cpu_build(call, name):
    with pytest.raises(RuntimeError, match=name):
        call(**{name: call.valid[name].cuda()})


# --------------------------------------------------------------------------
# Autograd: backward through the experts (kt::moe_backward) matches the reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
@pytest.mark.parametrize("wrt", ["hidden_states", "topk_weights"])
def test_backward_matches_reference(call, layer, wrt, checkpointing):
    # Gradients must be there and correct: PyTorch's deprecated not-implemented
    # fallback (None gradients, a warning) would let a training loop silently not train.
    args = {k: call.valid[k].detach().float() for k in ("hidden_states", "topk_weights")}
    args[wrt] = args[wrt].clone().requires_grad_(True)
    ids = call.valid["topk_ids"]
    out = kt_ops.moe_forward(
        args["hidden_states"],
        ids,
        args["topk_weights"],
        layer,
        activation_checkpointing=checkpointing,
    )
    out.sum().backward()
    ref_args = {k: (v.detach().clone().requires_grad_(k == wrt)) for k, v in args.items()}
    reference_moe_forward(
        ref_args["hidden_states"], ids, ref_args["topk_weights"], layer
    ).sum().backward()
    assert args[wrt].grad is not None, f"backward returned no gradient for {wrt}"
    torch.testing.assert_close(args[wrt].grad, ref_args[wrt].grad, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("name", WEIGHT_NAMES[::3])
def test_backward_for_frozen_weight_raises(call, layer, name):
    # The packed base weights are frozen: asking for their gradient is refused at once,
    # through the Python API even when nothing else requires grad ...
    w = call.valid[name].clone().requires_grad_(True)
    ts = [w if n == name else t for n, t in zip(WEIGHT_NAMES, layer.tensors())]
    frozen = kt_ops.ExpertWeights.from_op_args(ts, "bf16", [H, I], [0, 0, 0])
    x = call.valid["hidden_states"].float()
    ids, weights = call.valid["topk_ids"], call.valid["topk_weights"]
    for fn in (kt_ops.moe_forward, kt_ops.ops.moe_forward_train):
        with pytest.raises(RuntimeError, match=f"{name} requires grad"):
            fn(x, ids, weights, frozen)
    # ... and through the raw op (its C++ autograd kernel), whatever else requires grad.
    with pytest.raises(RuntimeError, match=f"{name} requires grad"):
        call(**{name: w})
    with pytest.raises(RuntimeError, match=f"{name} requires grad"):
        call(hidden_states=x.requires_grad_(True), **{name: w})
    with torch.no_grad():
        assert kt_ops.moe_forward(x, ids, weights, frozen).shape == (T, H)


# --------------------------------------------------------------------------
# pack_weights / unpack_weights
# --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(4, 8), (2, 4, 8, 2), (8,)])
def test_pack_weights_rank(shape):
    with pytest.raises(ValueError, match=r"weight.*3-D"):
        kt_ops.pack_weights(torch.randn(shape))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool], ids=str)
def test_pack_weights_dtype(dtype):
    with pytest.raises(ValueError, match="floating point"):
        kt_ops.pack_weights(torch.ones(2, 4, 8, dtype=dtype))


def test_pack_weights_not_a_tensor():
    with pytest.raises(ValueError, match="weight"):
        kt_ops.pack_weights([[[1.0]]])


@pytest.mark.parametrize("fmt", ["int4", "q4_k", "", "BF16"])
def test_pack_weights_format(fmt):
    with pytest.raises(ValueError, match="weight_format"):
        kt_ops.pack_weights(torch.randn(2, 4, 8), fmt)
    with pytest.raises(ValueError, match="weight_format"):
        kt_ops.unpack_weights(kt_ops.pack_weights(torch.randn(2, 4, 8)), 4, 8, fmt)


@pytest.mark.parametrize("n,k", [(17, 8), (4, 9), (32, 8), (4, 16)])
def test_unpack_weights_wrong_sizes(n, k):
    packed = kt_ops.pack_weights(torch.randn(2, 4, 8))  # n=4 -> 1 block, k=8 -> 4 pairs
    with pytest.raises(ValueError, match="packed"):
        kt_ops.unpack_weights(packed, n, k)


def test_unpack_weights_dense_input():
    with pytest.raises(ValueError, match="packed"):
        kt_ops.unpack_weights(torch.randn(2, 4, 8), 4, 8)


# --------------------------------------------------------------------------
# Runtime controls
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -1, -64])
def test_set_num_threads_not_positive(n):
    before = kt_ops.get_num_threads()
    with pytest.raises(ValueError, match=rf"set_num_threads.*{n}"):
        kt_ops.set_num_threads(n)
    assert kt_ops.get_num_threads() == before


@pytest.mark.parametrize("name", ["bogus", "AVX2", "", "amx"])
def test_set_isa_unknown(name):
    before = kt_ops.active_isa()
    with pytest.raises(ValueError, match=f"unknown ISA '{name}'.*ref, avx2, avx512"):
        kt_ops.set_isa(name)
    assert kt_ops.active_isa() == before
    with pytest.raises(ValueError, match="unknown ISA"):
        with kt_ops.use_isa(name):
            pass
    assert kt_ops.active_isa() == before


@pytest.mark.skipif("avx512" in kt_ops.supported_isas(), reason="this CPU runs the AVX-512 path")
def test_set_isa_avx512_without_the_cpu_feature():
    before = kt_ops.active_isa()
    with pytest.raises(ValueError, match="avx512.*AVX-512"):
        kt_ops.set_isa("avx512")
    assert kt_ops.active_isa() == before


def test_env_isa_bogus(python_subprocess):
    # A typo in KT_OPS_ISA must not silently pick another path: the first use
    # raises, and the message says where the bad name came from.
    code = """
import kt_ops
from reference import make_expert_weights, make_hidden, make_routing
w = make_expert_weights(2, 8, 4); ids, wt = make_routing(2, 2, 1)
try:
    kt_ops.moe_forward(make_hidden(2, 8), ids, wt, w)
except Exception as e:
    print(type(e).__name__ + ': ' + str(e).splitlines()[0])
else:
    print('NO ERROR, isa=' + kt_ops.active_isa())
"""
    proc = python_subprocess(code, env={"KT_OPS_ISA": "bogus"})
    assert proc.returncode == 0, proc.stderr  # import itself must work
    line = proc.stdout.strip().splitlines()[-1]
    assert not line.startswith("NO ERROR"), line
    assert "bogus" in line, line
    assert "KT_OPS_ISA" in line, f"error does not name the KT_OPS_ISA variable: {line}"


@pytest.mark.skipif("avx512" in kt_ops.supported_isas(), reason="this CPU runs the AVX-512 path")
def test_env_isa_not_runnable(python_subprocess):
    code = """
import kt_ops
try:
    print('NO ERROR', kt_ops.active_isa())
except ValueError as e:
    print('ValueError: ' + str(e))
"""
    proc = python_subprocess(code, env={"KT_OPS_ISA": "avx512"})
    assert proc.returncode == 0, proc.stderr
    assert re.search("ValueError: .*avx512.*AVX-512", proc.stdout), proc.stdout


def test_env_hwloc_synthetic_invalid(python_subprocess):
    code = """
import kt_ops
try:
    kt_ops.info()
except Exception as e:
    print(type(e).__name__ + ': ' + str(e))
else:
    print('NO ERROR')
"""
    proc = python_subprocess(code, env={"KT_OPS_HWLOC_SYNTHETIC": "garbage topology"})
    assert proc.returncode == 0, proc.stderr
    assert "KT_OPS_HWLOC_SYNTHETIC" in proc.stdout and "garbage" in proc.stdout, proc.stdout


def test_activation_of_another_type_is_named():
    """A non-string activation under no_grad (the prepared-layer path looks it up first)."""
    experts = make_expert_weights(4, 64, 32, seed=2)
    ids, w = make_routing(3, 4, 2)
    x = make_hidden(3, 64)
    with torch.no_grad(), pytest.raises(RuntimeError, match="argument 'activation'"):
        kt_ops.moe_forward(x, ids, w, experts, activation=["silu"])


def test_lora_with_factors_refuses_half_pairs():
    lora = kt_ops.LoRAWeights(scaling=2.0)
    a = torch.zeros(4, 2, 64)
    with pytest.raises(ValueError, match="up has one of A and B, not both"):
        lora.with_factors([None, None, a, None, None, None])
