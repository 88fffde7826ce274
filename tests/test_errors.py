"""Every caller error gets a clear exception that names the offending argument."""

# T, H, I, E, K: tokens, hidden, intermediate, experts, top-k (the design notes' names).
# ruff: noqa: E741

from __future__ import annotations

import re

import pytest
import torch
from reference import make_expert_weights, make_hidden, make_routing, reference_moe_forward

import kt_ops

E, H, I, T, K = 4, 32, 16, 3, 2


@pytest.fixture(scope="module")
def layer():
    return make_expert_weights(E, H, I, seed=0)


@pytest.fixture
def call(layer):
    """``call(**overrides)``: moe_forward on valid arguments, some replaced by ``overrides``."""
    ids, weights = make_routing(T, E, K)
    valid = dict(
        hidden_states=make_hidden(T, H),
        topk_ids=ids,
        topk_weights=weights,
        gate_weight=layer.gate,
        up_weight=layer.up,
        down_weight=layer.down,
        intermediate_size=I,
    )

    def run(**overrides):
        return kt_ops.moe_forward(**{**valid, **overrides})

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
        call(**{name: getattr(other, name.split("_")[0])})


def test_hidden_states_of_another_hidden_size(call):
    with pytest.raises(RuntimeError, match="gate_weight"):
        call(hidden_states=make_hidden(T, H + 16))


@pytest.mark.parametrize("name", ["up_weight", "down_weight"])
def test_weight_with_another_expert_count(call, name):
    other = make_expert_weights(E + 1, H, I, seed=2)
    with pytest.raises(RuntimeError, match=name):
        call(**{name: getattr(other, name.split("_")[0])})


def test_intermediate_size_not_matching_weights(call):
    with pytest.raises(RuntimeError, match="gate_weight"):
        call(intermediate_size=I + 16)


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


def test_group_size_for_bf16(call):
    with pytest.raises(RuntimeError, match="group_size"):
        call(group_size=32)


@pytest.mark.parametrize(
    "name",
    ["gate_lora_a", "gate_lora_b", "up_lora_a", "up_lora_b", "down_lora_a", "down_lora_b"],
)
def test_lora_factor_without_its_pair(call, name):
    # LoRA is computed (tests/test_lora.py); a lone A or B is a caller error that names it.
    with pytest.raises(RuntimeError, match=rf"{name} was given without .*LoRA"):
        call(**{name: torch.zeros(E, 4, H)})


@pytest.mark.parametrize("act", ["gelu", "relu", "SiLU", "swiglu", ""])
def test_activation(call, act):
    with pytest.raises(RuntimeError, match=rf"activation='{act}'"):
        call(activation=act)


@pytest.mark.parametrize("size", [0, -1, -I])
def test_intermediate_size_not_positive(call, size):
    with pytest.raises(RuntimeError, match="intermediate_size"):
        call(intermediate_size=size)


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
    out = kt_ops.moe_forward(**meta)
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
    args = {k: (v.detach().float() if k in ("hidden_states", "topk_weights") else v)
            for k, v in call.valid.items()}  # fmt: skip
    args[wrt] = args[wrt].clone().requires_grad_(True)
    out = kt_ops.moe_forward(**args, activation_checkpointing=checkpointing)
    out.sum().backward()
    ref_args = {k: (v.detach().clone().requires_grad_(k == wrt) if k == wrt else v)
                for k, v in args.items()}  # fmt: skip
    reference_moe_forward(**ref_args).sum().backward()
    assert args[wrt].grad is not None, f"backward returned no gradient for {wrt}"
    torch.testing.assert_close(args[wrt].grad, ref_args[wrt].grad, rtol=1e-3, atol=1e-4)


def test_backward_for_frozen_weight_raises(call):
    # The packed base weights are frozen: asking for their gradient is refused at once.
    w = call.valid["down_weight"].clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match="down_weight requires grad"):
        call(hidden_states=call.valid["hidden_states"].float(), down_weight=w)


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
    kt_ops.moe_forward(make_hidden(2, 8), ids, wt, *w.args())
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
