"""Quantized formats: every bad argument of kt.moe_forward raises a clear error naming it.

Also the op's registration with quantized arguments: ``torch.library.opcheck``
(schema, fake kernel, autograd registration, AOT dispatch) and
``torch.compile(fullgraph=True)``.
"""

# T, H, I, E, K: tokens, hidden, intermediate, experts, top-k (the design notes' names).
# ruff: noqa: E741

from __future__ import annotations

import dataclasses
import functools
import re

import pytest
import torch
from conftest import record_isa
from reference import (
    WEIGHT_NAMES,
    make_expert_weights,
    make_hidden,
    make_quant_experts,
    make_routing,
    quant_mismatch_report,
    raw_op_kwargs,
    reference_for,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

import kt_ops
from kt_ops.formats import format_spec, quantize_weights
from kt_ops.layer import layer_args

OP = torch.ops.kt.moe_forward
E, H, I, T, K = 4, 64, 32, 3, 2
PROJ = ("gate", "up", "down")


@functools.cache
def layer(fmt: str, group_size=None, symmetric: bool = True, h: int = H, i: int = I):
    return make_quant_experts(fmt, E, h, i, group_size=group_size, symmetric=symmetric, seed=1)


@functools.cache
def k_layer(fmt: str) -> kt_ops.ExpertWeights:
    """q4_k / q5_k / q6_k need K a multiple of 256."""
    return make_quant_experts(fmt, 2, 256, 256, seed=2)


def inputs(h: int = H, n_experts: int = E):
    ids, weights = make_routing(T, n_experts, K, seed=0)
    return make_hidden(T, h, torch.float32, seed=0), ids, weights


def call(w: kt_ops.ExpertWeights, **overrides):
    """``torch.ops.kt.moe_forward`` on valid arguments for ``w``, some replaced by ``overrides``.

    Packed tensors are named one by one (``gate_weight`` ... ``down_zeros``,
    ``reference.raw_op_kwargs``); ``group_size=g`` stands for ``group_sizes=[g, g, g]``.
    """
    x, ids, weights = inputs(w.hidden_size, w.num_experts)
    kwargs = {
        "hidden_states": x,
        "topk_ids": ids,
        "topk_weights": weights,
        **dict(zip(WEIGHT_NAMES, w.tensors())),
        "weight_format": w.weight_format,
        "sizes": [w.hidden_size, w.intermediate_size],
        "group_sizes": list(w.group_sizes),
    }
    if "group_size" in overrides:
        overrides["group_sizes"] = [overrides.pop("group_size")] * 3
    return torch.ops.kt.moe_forward(**raw_op_kwargs({**kwargs, **overrides}))


@pytest.mark.parametrize(
    "fmt,gs,sym",
    [("int8", None, True), ("int4", 32, True), ("int4", 32, False), ("fp8", None, True),
     ("mxfp4", None, True), ("q8_0", None, True), ("q4_0", None, True)],
)  # fmt: skip
def test_valid_calls_work(fmt, gs, sym):
    w = layer(fmt, gs, sym)
    x, ids, weights = inputs()
    out = call(w)
    assert out.shape == (T, H)
    assert quant_mismatch_report(out, reference_for(w, x, ids, weights)) is None


@pytest.mark.parametrize("fmt", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"])
def test_valid_k_quant_calls_work(fmt):
    assert call(k_layer(fmt)).shape == (T, 256)


# --------------------------------------------------------------------------
# weight_format and group_size
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int5", "INT4", "q4_K", "Q8_0", "fp4", "", "int4 "])
def test_unknown_format_name(fmt):
    with pytest.raises(RuntimeError, match=rf"weight_format='{re.escape(fmt)}'.*int4.*q6_k"):
        call(layer("int4", 32), weight_format=fmt)


@pytest.mark.parametrize(
    "fmt,gs,bad",
    [("int4", 32, 16), ("int4", 32, 8), ("int4", 32, 256), ("int4", 32, -32), ("int8", None, 32),
     ("int8", None, 128), ("fp8", None, 0), ("fp8", None, 64), ("mxfp4", None, 64),
     ("q8_0", None, 0), ("q4_0", None, 64), ("iq4_nl", None, 16)],
)  # fmt: skip
def test_group_size_not_allowed_for_format(fmt, gs, bad):
    match = rf"group size {bad} of gate is not valid for weight_format='{fmt}'; expected one of"
    with pytest.raises(RuntimeError, match=match):
        call(layer(fmt, gs), group_size=bad)


@pytest.mark.parametrize("fmt", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"])
def test_group_size_not_allowed_for_k_quants(fmt):
    with pytest.raises(RuntimeError, match=f"group size 64 of gate is not valid for .*'{fmt}'"):
        call(k_layer(fmt), group_size=64)


def test_group_size_not_dividing_k():
    # gate/up K = H = 96 (group 32 fits, 64 does not): named with the projection.
    w = layer("int4", 32, h=96, i=64)
    with pytest.raises(
        RuntimeError, match=r"group size 64 of gate must divide the K of gate_weight.*96"
    ):
        call(w, group_size=64)
    # down K = I = 96 while gate/up (K = H = 128) are packed with group 64
    g = torch.Generator().manual_seed(4)
    gate, up = (quantize_weights(torch.randn(E, 96, 128, generator=g), "int4", 64) for _ in "gu")
    down = quantize_weights(torch.randn(E, 128, 96, generator=g), "int4", 32)
    w = kt_ops.ExpertWeights(gate, up, down)
    with pytest.raises(
        RuntimeError, match=r"group size 64 of down must divide the K of down_weight.*96"
    ):
        call(w, group_size=64)


def test_group_size_of_another_packing():
    # int4 packed with group 64, called as group 32: the scales have half the groups.
    w = layer("int4", 64, h=128, i=64)
    with pytest.raises(RuntimeError, match="gate_scales has shape"):
        call(w, group_size=32)


# --------------------------------------------------------------------------
# Tensors packed for another format
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "packed,fmt,gs,match",
    [
        (("int4", 32), "int8", 0, "gate_weight has shape"),
        (("int4", 32), "int8", 32, "group size 32 of gate is not valid"),
        (("int8", None), "int4", 32, "gate_weight has shape"),
        (("int8", None), "q4_0", 32, "gate_weight has shape"),
        (("fp8", None), "int8", 0, "gate_weight has shape"),
        (("int4", 32), "fp8", 128, "gate_weight has shape"),
        (("int8", None), "fp8", 128, "gate_weight has shape"),
        (("mxfp4", None), "q4_0", 32, "gate_scales must be fp32, fp16 or bf16, got Byte"),
        (("q4_0", None), "mxfp4", 32, "gate_scales must be uint8 UE8M0"),
        (("int4", 32), "q4_k", 32, "q4_k' needs the K of gate_weight .* multiple of 256"),
        (("fp8", None), "mxfp4", 32, "gate_weight has shape"),
    ],
    ids=lambda p: p if isinstance(p, str) else None,
)
def test_tensors_of_another_format(packed, fmt, gs, match):
    with pytest.raises(RuntimeError, match=match):
        call(layer(*packed), weight_format=fmt, group_size=gs)


def test_asymmetric_int4_as_a_format_without_zeros():
    with pytest.raises(RuntimeError, match="gate_zeros was given, but weight_format='q4_0'"):
        call(layer("int4", 32, False), weight_format="q4_0")


def test_k_quant_tensors_as_another_k_quant():
    w = k_layer("q5_k")
    with pytest.raises(RuntimeError, match="gate_weight has shape"):
        call(w, weight_format="q4_k")
    with pytest.raises(RuntimeError, match="gate_weight has shape"):
        call(k_layer("q4_k"), weight_format="q6_k", group_size=16, **_no_zeros())


def _no_zeros():
    return {f"{p}_zeros": None for p in PROJ}


def test_bf16_tensors_with_a_quantized_format():
    bf16 = make_expert_weights(E, H, I, seed=0)
    w = layer("int4", 32)
    with pytest.raises(RuntimeError, match=r"gate_weight must be uint8 for weight_format='int4'"):
        call(
            w, gate_weight=bf16.gate.weight, up_weight=bf16.up.weight, down_weight=bf16.down.weight
        )


def test_quantized_tensors_with_bf16():
    w = layer("int4", 32)
    with pytest.raises(RuntimeError, match="gate_weight must be .*bf16"):
        call(w, weight_format="bf16", group_size=0)
    # bf16 weights with quantization data left over
    bf16 = make_expert_weights(E, H, I, seed=0)
    x, ids, weights = inputs()
    for name in ("gate_scales", "down_zeros"):
        with pytest.raises(RuntimeError, match=rf"{name} was given, but weight_format='bf16'"):
            call(bf16, **{name: w.gate.scales})


@pytest.mark.parametrize("proj", PROJ)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_weight_dtype(proj, dtype):
    w = layer("int4", 32)
    bad = getattr(w, proj).weight.to(dtype)
    with pytest.raises(
        RuntimeError, match=rf"{proj}_weight must be uint8 for weight_format='int4'"
    ):
        call(w, **{f"{proj}_weight": bad})


@pytest.mark.parametrize("proj", PROJ)
def test_weight_of_another_shape(proj):
    w = layer("int4", 32)
    other = layer("int4", 32, h=2 * H)  # gate/up K and down N double
    with pytest.raises(RuntimeError, match=rf"{proj}_weight has shape"):
        call(w, **{f"{proj}_weight": getattr(other, proj).weight})
    # one expert fewer: E is gate_weight's, so for gate the mismatch shows in gate_scales
    fewer = getattr(w, proj).weight[:-1].contiguous()
    with pytest.raises(RuntimeError, match=rf"{proj}_(weight|scales) has shape"):
        call(w, **{f"{proj}_weight": fewer})


def test_dense_weights_with_a_quantized_format():
    gate = torch.randint(0, 255, (E, I, H), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="gate_weight has shape.*quantize_weights"):
        call(layer("int8"), gate_weight=gate)


# --------------------------------------------------------------------------
# Scales and zeros
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,gs,sym", [("int8", None, True), ("int4", 32, False),
                                        ("fp8", None, True), ("mxfp4", None, True)])  # fmt: skip
@pytest.mark.parametrize("proj", PROJ)
def test_scales_missing(fmt, gs, sym, proj):
    with pytest.raises(RuntimeError, match=rf"weight_format='{fmt}' needs {proj}_scales"):
        call(layer(fmt, gs, sym), **{f"{proj}_scales": None})


def _bad_shapes(t: torch.Tensor):
    """Same dtype, wrong shape: a group (fp8: k-block) fewer, an expert more, flat, transposed."""
    yield t[..., :-1, :].contiguous() if t.dim() == 4 else t[..., :-1].contiguous()
    yield torch.cat([t, t[:1]]).contiguous()
    yield t.reshape(t.shape[0], -1).contiguous()
    if t.shape[-1] != t.shape[-2]:
        yield t.transpose(-1, -2).contiguous()


@pytest.mark.parametrize(
    "fmt,gs,sym,what",
    [("int8", None, True, "scales"), ("int4", 32, False, "scales"), ("int4", 32, False, "zeros"),
     ("fp8", None, True, "scales"), ("q4_0", None, True, "scales"),
     ("mxfp4", None, True, "scales")],
)  # fmt: skip
@pytest.mark.parametrize("proj", PROJ)
def test_scales_and_zeros_of_the_wrong_shape(fmt, gs, sym, what, proj):
    w = layer(fmt, gs, sym) if fmt != "fp8" else layer(fmt, h=200, i=136)
    t = getattr(getattr(w, proj), what)
    name = f"{proj}_{what}"
    for bad in _bad_shapes(t):
        assert bad.shape != t.shape
        with pytest.raises(RuntimeError, match=rf"{name} has shape"):
            call(w, **{name: bad})


@pytest.mark.parametrize("proj", PROJ)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8, torch.int8], ids=str)
def test_scales_dtype_int4(proj, dtype):
    w = layer("int4", 32, False)
    name = f"{proj}_scales"
    with pytest.raises(RuntimeError, match=rf"{name} must be fp32, fp16 or bf16, got"):
        call(w, **{name: getattr(w, proj).scales.to(dtype)})
    name = f"{proj}_zeros"
    with pytest.raises(RuntimeError, match=rf"{name} must be fp32, fp16 or bf16, got"):
        call(w, **{name: getattr(w, proj).zeros.to(dtype)})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_scales_dtype_fp8(dtype):
    w = layer("fp8")
    with pytest.raises(RuntimeError, match="up_scales must be fp32 block scales"):
        call(w, up_scales=w.up.scales.to(dtype))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8], ids=str)
def test_scales_dtype_mxfp4(dtype):
    w = layer("mxfp4")
    with pytest.raises(RuntimeError, match="down_scales must be uint8 UE8M0 exponents"):
        call(w, down_scales=w.down.scales.to(dtype))


def _matches_reference(w: kt_ops.ExpertWeights) -> None:
    """The op on ``w`` matches ``reference_for`` on every ISA path (per-projection data)."""
    x, ids, weights = inputs(w.hidden_size, w.num_experts)

    def canonical(p):
        # the reference dequantizer takes the packers' scale dtype: cast back (exactly,
        # from values already rounded to the narrower of the two dtypes)
        dt = format_spec(p.weight_format).scale_dtype
        kw = {n: getattr(p, n).to(dt) for n in ("scales", "zeros") if getattr(p, n) is not None}
        return dataclasses.replace(p, **kw)

    ref = reference_for(kt_ops.ExpertWeights(*map(canonical, w.projections)), x, ids, weights)
    for isa in kt_ops.supported_isas():
        with kt_ops.use_isa(isa):
            record_isa(isa)
            msg = quant_mismatch_report(kt_ops.moe_forward(x, ids, weights, w), ref)
        assert msg is None, f"{isa}: {msg}"


@pytest.mark.parametrize("proj", ["up", "down"])
@pytest.mark.parametrize("fmt,gs", [("int8", None), ("int4", 32), ("q4_0", None)])
def test_scale_dtype_per_projection(fmt, gs, proj):
    # Each projection is described on its own (issue 9): one projection's scales in
    # another float dtype than the gate's is fine (it used to be refused), and the
    # op dequantizes it with its own dtype.
    w = layer(fmt, gs)
    p = getattr(w, proj)
    other = torch.float16 if p.scales.dtype == torch.float32 else torch.float32
    kw = {proj: dataclasses.replace(p, scales=p.scales.to(other))}
    w2 = kt_ops.ExpertWeights(*(kw.get(n, q) for n, q in zip(PROJ, w.projections)))
    assert getattr(w2, proj).scales.dtype != w2.gate.scales.dtype
    _matches_reference(w2)


def test_zero_dtype_per_projection():
    w = layer("int4", 32, False)
    w2 = dataclasses.replace(w, down=dataclasses.replace(w.down, zeros=w.down.zeros.float()))
    assert w2.down.zeros.dtype != w2.gate.zeros.dtype
    _matches_reference(w2)


@pytest.mark.parametrize("fmt,gs", [("int8", None), ("mxfp4", None), ("q8_0", None),
                                    ("q4_0", None)])  # fmt: skip
@pytest.mark.parametrize("proj", PROJ)
def test_zeros_for_a_format_without_zeros(fmt, gs, proj):
    w = layer(fmt, gs)
    zeros = torch.zeros(w.gate.scales.shape, dtype=torch.float16)
    if proj != "gate":
        zeros = torch.zeros(getattr(w, proj).scales.shape, dtype=torch.float16)
    name = f"{proj}_zeros"
    with pytest.raises(RuntimeError, match=rf"{name} was given, but weight_format='{fmt}' has no"):
        call(w, **{name: zeros})


def test_zeros_for_q6_k():
    w = k_layer("q6_k")
    with pytest.raises(RuntimeError, match="gate_zeros was given, but weight_format='q6_k'"):
        call(w, gate_zeros=torch.zeros_like(w.gate.scales))


@pytest.mark.parametrize("proj", PROJ)
def test_zeros_for_fp8(proj):
    w = layer("fp8")
    name = f"{proj}_zeros"
    with pytest.raises(RuntimeError, match=name):
        call(w, **{name: torch.ones(3)})


@pytest.mark.parametrize("fmt", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs"])
@pytest.mark.parametrize("proj", PROJ)
def test_k_quant_scale_records_are_checked(fmt, proj):
    # The k-quants keep GGUF's own scales in uint8 records [E, NB, K/256, 256 | 288 | 320]
    # (the q2_k/q4_k/q5_k mins inside): no zeros tensor, and the old layout (fp32 d*sc
    # [E, NB, G, 16] with fp32 zeros) is refused with a message that names it.
    w = k_layer(fmt)
    rec = getattr(w, proj).scales
    size = {"q2_k": 320, "q3_k": 288, "q6_k": 288, "iq4_xs": 160}.get(fmt, 256)
    assert rec.dtype == torch.uint8 and rec.shape[-1] == size
    with pytest.raises(RuntimeError, match=rf"{proj}_zeros was given, but weight_format='{fmt}'"):
        call(w, **{f"{proj}_zeros": torch.zeros(rec.shape[0], rec.shape[1], 8, 16)})
    g = 8 if fmt in ("q4_k", "q5_k", "iq4_xs") else 16
    old = torch.ones(rec.shape[0], rec.shape[1], g, 16)
    with pytest.raises(
        RuntimeError, match=r"must be uint8 k-quant scale records.*manifest_version 1"
    ):
        call(w, **{f"{proj}_scales": old})
    # A truncated record, a missing super-block, a record of another k-quant family.
    other = torch.zeros(*rec.shape[:-1], 256 if size != 256 else 288, dtype=torch.uint8)
    for bad in (rec[..., :-1], rec[:, :, :0], other):
        with pytest.raises(RuntimeError, match=rf"{proj}_scales has shape"):
            call(w, **{f"{proj}_scales": bad.contiguous()})


def test_k_quants_need_k_a_multiple_of_256():
    # H = I = 128: codes of the right shape, but no whole 256-k super-block to scale them.
    w = k_layer("q4_k")
    x, _, _ = inputs(128, w.num_experts)
    codes = torch.zeros(w.num_experts, 8, 16 * 128 // 2, dtype=torch.uint8)
    short = {f"{p}_weight": codes for p in PROJ}
    with pytest.raises(RuntimeError, match="gate_weight .* to be a multiple of 256 .*got 128"):
        call(w, hidden_states=x, sizes=[128, 128], **short)


@pytest.mark.parametrize("proj", ["up", "down"])
def test_zeros_for_some_projections_only(proj):
    # int4 zeros are optional per projection (issue 9: one description per projection):
    # an asymmetric projection among symmetric ones computes what its own data says.
    asym = layer("int4", 32, False)
    sym = layer("int4", 32, True)
    without = dataclasses.replace(asym, **{proj: getattr(sym, proj)})
    assert getattr(without, proj).zeros is None and without.gate.zeros is not None
    _matches_reference(without)
    only = dataclasses.replace(sym, **{proj: getattr(asym, proj)})
    assert getattr(only, proj).zeros is not None and only.gate.zeros is None
    _matches_reference(only)
    # zeros of a symmetric packing's shape but the wrong dtype are still refused
    with pytest.raises(RuntimeError, match=rf"{proj}_zeros"):
        call(sym, **{f"{proj}_zeros": getattr(asym, proj).zeros.to(torch.int32)})


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, reversed strides."""
    dims = list(range(t.dim()))[::-1]
    out = t.permute(*dims).contiguous().permute(*dims)
    assert out.shape == t.shape and not out.is_contiguous() and torch.equal(out, t)
    return out


@pytest.mark.parametrize("what", ["weight", "scales", "zeros"])
@pytest.mark.parametrize("proj", PROJ)
def test_non_contiguous(what, proj):
    w = layer("int4", 32, False)
    name = f"{proj}_{what}"
    bad = _non_contiguous(getattr(getattr(w, proj), what))
    with pytest.raises(RuntimeError, match=rf"{name} must be contiguous"):
        call(w, **{name: bad})


def test_non_contiguous_fp8():
    w = layer("fp8", h=200, i=136)  # 2 x 2 scale blocks
    for name, t in (("gate_weight", w.gate.weight), ("down_scales", w.down.scales)):
        with pytest.raises(RuntimeError, match=rf"{name} must be contiguous"):
            call(w, **{name: _non_contiguous(t)})


@pytest.mark.parametrize("what", ["weight", "scales", "zeros"])
@pytest.mark.parametrize("proj", PROJ)
def test_meta_tensor_mixed_with_cpu(what, proj):
    # One quantization tensor on 'meta', the rest on the CPU: a caller error, not
    # an uninitialized result.
    w = layer("int4", 32, False)
    name = f"{proj}_{what}"
    with pytest.raises(RuntimeError, match=name):
        call(w, **{name: getattr(getattr(w, proj), what).to("meta")})


def test_all_meta_quantized_call():
    w = layer("int4", 32, False)
    x, ids, weights = inputs()
    meta = w.to("meta")
    out = kt_ops.moe_forward(x.to("meta"), ids.to("meta"), weights.to("meta"), meta)
    assert out.device.type == "meta" and out.shape == (T, H) and out.dtype == x.dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_scales_on_cpu_build():
    w = layer("int4", 32)
    with pytest.raises(RuntimeError, match="CUDA|cuda"):
        call(w, gate_scales=w.gate.scales.cuda())


# --------------------------------------------------------------------------
# Packers and the op agree on which shapes are valid
# --------------------------------------------------------------------------


def test_mxfp4_packer_output_is_accepted_by_the_op():
    g = torch.Generator().manual_seed(3)
    h, i = 64, 40  # I = 40: the down projection's K is not a multiple of 32
    dense = [torch.randn(E, i, h, generator=g), torch.randn(E, i, h, generator=g),
             torch.randn(E, h, i, generator=g)]  # fmt: skip
    w = kt_ops.ExpertWeights(*(quantize_weights(d, "mxfp4") for d in dense))  # K padded
    x, ids, weights = inputs(h)
    out = kt_ops.moe_forward(x, ids, weights, w)
    assert quant_mismatch_report(out, reference_for(w, x, ids, weights)) is None


# --------------------------------------------------------------------------
# opcheck and the fake kernel with quantized arguments
# --------------------------------------------------------------------------


def _opcheck_cases():
    # name, format, group size, symmetric, T, H, I, activation dtype, ids dtype
    return [
        ("int4_sym_g32", "int4", 32, True, 5, 64, 32, torch.bfloat16, torch.int64),
        ("int4_asym_g64", "int4", 64, False, 3, 128, 64, torch.float32, torch.int32),
        ("fp8_odd", "fp8", None, True, 4, 50, 40, torch.float16, torch.int64),
        ("int8_odd", "int8", None, True, 2, 33, 17, torch.float32, torch.int64),
        ("mxfp4", "mxfp4", None, True, 1, 64, 32, torch.bfloat16, torch.int64),
        ("q4_k", "q4_k", None, True, 3, 256, 256, torch.float32, torch.int64),
        ("int4_T0", "int4", 32, True, 0, 64, 32, torch.bfloat16, torch.int64),
    ]


@functools.cache
def opcheck_sample(name):
    case = next(c for c in _opcheck_cases() if c[0] == name)
    _, fmt, gs, sym, t, h, i, act, idt = case
    w = make_quant_experts(fmt, 4, h, i, group_size=gs, symmetric=sym, seed=5)
    ids, weights = make_routing(t, 4, 2, seed=5, ids_dtype=idt, skip_fraction=0.2)
    x = make_hidden(t, h, act, seed=5)
    return (x, ids, weights) + layer_args(w, None, "silu", x), {}


@pytest.mark.parametrize("name", [c[0] for c in _opcheck_cases()])
def test_opcheck_quantized(name):
    args, kwargs = opcheck_sample(name)
    torch.library.opcheck(OP.default, args, kwargs)


@pytest.mark.parametrize("name", [c[0] for c in _opcheck_cases()])
def test_fake_kernel_shape_and_dtype(name):
    args, kwargs = opcheck_sample(name)
    real = OP(*args, **kwargs)
    with FakeTensorMode() as mode:

        def fake(v):
            return mode.from_tensor(v) if isinstance(v, torch.Tensor) else v

        out = OP(*tree_map(fake, args), **kwargs)
    assert (out.shape, out.dtype, out.device, out.stride()) == (
        real.shape,
        real.dtype,
        real.device,
        real.stride(),
    )


def test_fake_kernel_rejects_tensors_of_another_format():
    args, _ = opcheck_sample("int4_sym_g32")
    with FakeTensorMode() as mode:
        x, ids, w, weights, fmt, sizes, groups, *rest = tree_map(
            lambda a: mode.from_tensor(a) if isinstance(a, torch.Tensor) else a, args
        )
        with pytest.raises(RuntimeError, match="gate"):
            OP(x, ids, w, weights, "int8", sizes, [0, 0, 0], *rest)
        with pytest.raises(RuntimeError, match="gate"):
            OP(x, ids, w, weights, "bf16", sizes, [0, 0, 0], *rest)
        with pytest.raises(RuntimeError, match="weight_format"):
            OP(x, ids, w, weights, "int5", sizes, groups, *rest)
        with pytest.raises(RuntimeError, match="hidden_states has 63 columns"):
            OP(x[:, :63], ids, w, weights, fmt, sizes, groups, *rest)


class QuantMoEBlock(torch.nn.Module):
    """A small module around the op with quantized experts held as buffers."""

    def __init__(self, w: kt_ops.ExpertWeights):
        super().__init__()
        self.weight_format = w.weight_format
        self.group_sizes = list(w.group_sizes)
        self.sizes = [w.hidden_size, w.intermediate_size]
        for proj, p in zip(PROJ, w.projections):
            for what, t in p.tensors().items():
                self.register_buffer(f"{proj}_{what}", t)

    def forward(self, x, topk_ids, topk_weights):
        weights = [getattr(self, n, None) for n in WEIGHT_NAMES]
        y = torch.ops.kt.moe_forward(
            x * 0.5,
            topk_ids,
            topk_weights,
            weights,
            self.weight_format,
            self.sizes,
            self.group_sizes,
            [],
        )
        return x + y


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("fmt,gs,sym", [("int4", 32, False), ("fp8", None, True)])
def test_compile_fullgraph_quantized(fresh_dynamo, fmt, gs, sym):
    from torch._dynamo.testing import CompileCounterWithBackend

    w = layer(fmt, gs, sym)
    model = QuantMoEBlock(w)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    for t in (3, 7, 12, 5):
        x = make_hidden(t, H, torch.float32, seed=t)
        ids, weights = make_routing(t, E, K, seed=t)
        with torch.no_grad():
            got = compiled(x, ids, weights)
            want = model(x, ids, weights)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


def test_compile_fullgraph_bf16_scales(fresh_dynamo):
    # bf16 scales through the compiled graph give the eager result too.
    w = layer("int4", 32)
    projs = [dataclasses.replace(p, scales=p.scales.to(torch.bfloat16)) for p in w.projections]
    model = QuantMoEBlock(kt_ops.ExpertWeights(*projs))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = make_hidden(6, H, torch.bfloat16, seed=1)
    ids, weights = make_routing(6, E, K, seed=1, ids_dtype=torch.int32)
    with torch.no_grad():
        torch.testing.assert_close(
            compiled(x, ids, weights), model(x, ids, weights), rtol=0, atol=0
        )
