"""The redesigned layer API (issue 9): the out variant, ExpertWeights, the format table, kernels.

* ``torch.ops.kt.moe_forward.out`` / ``kt_ops.moe_forward(..., out=)``: bit-identical
  to the functional op on every ISA path and format (mixes included), opcheck,
  torch.compile, and clear errors for a wrong out dtype / shape / device /
  layout, aliasing or overlapping ``hidden_states``, and autograd.
* :class:`kt_ops.ExpertWeights`: sizes, formats, group sizes, op arguments and
  their parsing back; validation errors when the projections disagree on E, H, I.
* :data:`kt_ops.formats.FORMATS` / ``format_spec`` equal the C++ format table
  (``_C.formats()``); ``kt_ops.info()['kernels']`` names a kernel for every format.
"""

# T, H, I, E, K: tokens, hidden, intermediate, experts, top-k.
# ruff: noqa: E741

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from reference import (
    make_expert_weights,
    make_hidden,
    make_quant_experts,
    make_routing,
    quant_mismatch_report,
    reference_for,
    sample_inputs,
    tolerance_for,
)
from torch.utils._pytree import tree_map

import kt_ops
from kt_ops import _C
from kt_ops.formats import FORMATS, format_spec
from kt_ops.info import format_info
from kt_ops.layer import layer_args

OUT = torch.ops.kt.moe_forward.out
E, H, I, T, K = 6, 64, 32, 9, 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: (weight_format, H, I, group size): one layer per format, and mixes with bf16/fp8.
LAYERS = [
    ("bf16", 33, 17, None),
    ("int8", 64, 32, None),
    ("int4", 64, 32, 32),
    ("fp8", 64, 40, None),
    ("fp8_channel", 64, 40, None),
    ("mxfp8", 64, 40, None),
    ("mxfp4", 64, 32, None),
    ("nvfp4", 64, 32, None),
    ("int4", 64, 40, 0),
    ("q8_0", 64, 32, None),
    ("q4_0", 64, 32, None),
    ("q2_k", 256, 256, None),
    ("q3_k", 256, 256, None),
    ("iq4_nl", 64, 32, None),
    ("iq4_xs", 256, 256, None),
    ("q4_1", 64, 32, None),
    ("q5_0", 64, 32, None),
    ("q5_1", 64, 32, None),
    ("q4_k", 256, 256, None),
    ("q5_k", 256, 256, None),
    ("q6_k", 256, 256, None),
    ("iq1_s", 256, 256, None),
    ("iq1_m", 256, 256, None),
    ("iq2_xxs", 256, 256, None),
    ("iq2_xs", 256, 256, None),
    ("iq2_s", 256, 256, None),
    ("iq3_xxs", 256, 256, None),
    ("iq3_s", 256, 256, None),
    ("bf16,fp8,q8_0", 64, 32, None),
    ("iq2_xxs,iq2_xxs,q4_k", 256, 256, None),
    ("q4_k,q4_k,bf16", 256, 256, None),
    ("fp8,int4,bf16", 64, 64, 32),
]


@functools.cache
def layer(fmt: str, h: int, i: int, gs) -> kt_ops.ExpertWeights:
    if fmt == "bf16":
        return make_expert_weights(E, h, i, seed=3)
    return make_quant_experts(fmt, E, h, i, group_size=gs, seed=3)


def inputs(h: int, t: int = T, dtype=torch.bfloat16):
    ids, weights = make_routing(t, E, K, seed=t, skip_fraction=0.2)
    return make_hidden(t, h, dtype, seed=t), ids, weights


def test_layers_cover_every_format():
    names = {f for fmt, *_ in LAYERS for f in fmt.split(",")}
    assert names == set(FORMATS)


# --------------------------------------------------------------------------
# The out variant
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("spec", LAYERS, ids=lambda s: s[0])
def test_out_matches_functional_bit_for_bit(isa, spec, dtype):
    fmt, h, i, gs = spec
    w = layer(fmt, h, i, gs)
    for t in (0, 1, T):
        x, ids, weights = inputs(h, t, dtype)
        want = kt_ops.moe_forward(x, ids, weights, w)
        out = torch.full((t, h), float("nan"), dtype=dtype)  # every element is written
        got = kt_ops.moe_forward(x, ids, weights, w, out=out)
        assert got is out
        assert torch.equal(out, want), f"{fmt} T={t}"
        # the raw overload, and a second call into the same buffer
        out.fill_(float("nan"))
        assert OUT(x, ids, weights, *layer_args(w, None, "silu", x), out=out) is None
        assert torch.equal(out, want)
    if t:
        ref = reference_for(w, x, ids, weights)
        assert quant_mismatch_report(out, ref, tolerance_for(w)) is None


def test_out_with_lora_matches_functional():
    w = layer("int4", 64, 32, 32)
    x, ids, weights = inputs(64, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    lora = kt_ops.LoRAWeights(
        up=(torch.randn(E, 4, 64, generator=g) * 0.1, torch.randn(E, 32, 4, generator=g) * 0.1),
        scaling=2.0,
    )
    want = kt_ops.moe_forward(x, ids, weights, w, lora)
    out = torch.empty_like(x)
    assert torch.equal(kt_ops.moe_forward(x, ids, weights, w, lora, out=out), want)


#: opcheck's utilities for the out overload, all of them (its schema returns ``()``, so
#: AOTAutograd takes it: test_aot_dispatch_dynamic included).
OUT_OPCHECK = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)


@pytest.mark.parametrize("sample", list(sample_inputs()), ids=lambda s: s.name)
def test_opcheck_out(sample):
    x = sample.args[0]
    torch.library.opcheck(OUT, sample.args, {"out": torch.empty_like(x)}, test_utils=OUT_OPCHECK)


def test_opcheck_out_quantized():
    w = layer("bf16,fp8,q8_0", 64, 32, None)
    x, ids, weights = inputs(64)
    args = (x, ids, weights) + layer_args(w, None, "silu", x)
    torch.library.opcheck(OUT, args, {"out": torch.empty_like(x)}, test_utils=OUT_OPCHECK)


def test_out_fake_and_meta():
    w = layer("int4", 64, 32, 32)
    x, ids, weights = inputs(64)
    args = (x, ids, weights) + layer_args(w, None, "silu", x)
    meta = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, args)
    out = torch.empty(x.shape, dtype=x.dtype, device="meta")
    assert OUT(*meta, out=out) is None
    with pytest.raises(RuntimeError, match="out must have the dtype of hidden_states"):
        OUT(*meta, out=out.float())


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_fullgraph_out(fresh_dynamo):
    w = layer("q4_0", 64, 32, None)
    args_of = functools.partial(layer_args, w, None, "silu")

    def step(x, ids, weights, out):
        OUT(x * 0.5, ids, weights, *args_of(x), out=out)
        return out + 1

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    for t in (3, 7, 5):
        x, ids, weights = inputs(64, t, torch.float32)
        want = step(x, ids, weights, torch.empty_like(x))
        got = compiled(x, ids, weights, torch.empty_like(x))
        assert torch.equal(got, want), t


@pytest.fixture
def call_out():
    w = layer("bf16", 33, 17, None)
    x, ids, weights = inputs(33)

    def run(out, x=x):
        return kt_ops.moe_forward(x, ids, weights, w, out=out)

    run.x = x
    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32], ids=str)
def test_out_wrong_dtype(call_out, dtype):
    with pytest.raises(
        RuntimeError, match=r"kt.moe_forward: out must have the dtype of hidden_states"
    ):
        call_out(torch.empty(T, 33, dtype=dtype))


@pytest.mark.parametrize("shape", [(T + 1, 33), (T, 32), (T * 33,), (1, T, 33), (0,)], ids=str)
def test_out_wrong_shape(call_out, shape):
    with pytest.raises(RuntimeError, match=r"out must be a contiguous tensor of the shape"):
        call_out(torch.empty(shape, dtype=torch.bfloat16))


def test_out_non_contiguous(call_out):
    out = torch.empty(33, T, dtype=torch.bfloat16).t()
    with pytest.raises(RuntimeError, match=r"out must be a contiguous .*\(not contiguous\)"):
        call_out(out)


def test_out_on_another_device(call_out):
    with pytest.raises(RuntimeError, match="out is on meta but hidden_states is on cpu"):
        call_out(torch.empty(T, 33, dtype=torch.bfloat16, device="meta"))


def test_out_aliasing_hidden_states(call_out):
    x = call_out.x.clone()
    with pytest.raises(RuntimeError, match="out must not (be|overlap) hidden_states"):
        call_out(x, x=x)
    # raw op too
    w = layer("bf16", 33, 17, None)
    _, ids, weights = inputs(33)
    with pytest.raises(RuntimeError, match="out must not overlap hidden_states"):
        OUT(x, ids, weights, *layer_args(w, None, "silu", x), out=x)
    # ... and a partly overlapping view through the raw op
    buf2 = torch.zeros(2 * T * 33, dtype=torch.bfloat16)
    x2 = buf2[: T * 33].view(T, 33)
    with pytest.raises(RuntimeError, match="out must not overlap hidden_states"):
        OUT(
            x2,
            ids,
            weights,
            *layer_args(w, None, "silu", x2),
            out=buf2[33 : 33 + T * 33].view(T, 33),
        )
    # an overlapping view (not the same tensor) through the Python API
    buf = torch.zeros(2 * T * 33, dtype=torch.bfloat16)
    xin = buf[: T * 33].view(T, 33)
    xin.copy_(call_out.x)
    with pytest.raises(RuntimeError, match="out must not overlap hidden_states"):
        call_out(buf[33 : 33 + T * 33].view(T, 33), x=xin)
    # disjoint halves of one buffer are fine
    out = buf[T * 33 :].view(T, 33)
    assert torch.equal(call_out(out, x=xin), kt_ops.moe_forward(xin.clone(), ids, weights, w))


def test_out_is_not_differentiable(call_out):
    x = call_out.x.float().requires_grad_(True)
    with pytest.raises(RuntimeError, match="out= does not support automatic differentiation"):
        call_out(torch.empty(T, 33), x=x)
    with torch.no_grad():
        assert call_out(torch.empty(T, 33), x=x).shape == (T, 33)


# --------------------------------------------------------------------------
# ExpertWeights
# --------------------------------------------------------------------------


def test_expert_weights_describe_the_layer():
    w = layer("q4_k,q4_k,bf16", 256, 256, None)
    assert (w.num_experts, w.hidden_size, w.intermediate_size) == (E, 256, 256)
    assert w.weight_format == "q4_k,q4_k,bf16" and w.group_sizes == (32, 32, 0)
    t = w.tensors()
    assert len(t) == 9 and t[8] is None and t[7] is None and t[6] is w.down.weight
    back = kt_ops.ExpertWeights.from_op_args(t, w.weight_format, [256, 256], w.group_sizes)
    assert back == w
    assert w.validate() is w
    x = make_hidden(2, 256)
    args = layer_args(w, None, "silu", x)
    assert args[1:] == ("q4_k,q4_k,bf16", [256, 256], [32, 32, 0], [], 1.0, "silu", None)


def test_expert_weights_from_dense_any_mix():
    g = torch.Generator().manual_seed(1)
    dense = [torch.randn(E, n, k, generator=g) for n, k in ((32, 64), (32, 64), (64, 32))]
    w = kt_ops.ExpertWeights.from_dense(*dense, "bf16,fp8,int4", group_size=32)
    assert w.weight_format == "bf16,fp8,int4" and w.group_sizes == (0, 128, 32)
    assert (w.num_experts, w.hidden_size, w.intermediate_size) == (E, 64, 32)
    x, ids, weights = inputs(64, dtype=torch.float32)
    ref = reference_for(w, x, ids, weights)
    out = kt_ops.moe_forward(x, ids, weights, w)
    assert quant_mismatch_report(out, ref, tolerance_for(w)) is None


def test_expert_weights_validation_errors():
    w = layer("int4", 64, 32, 32)
    g, u, d = w.projections
    # I disagreement: up with another n
    u_wide = layer("int4", 64, 64, 32).up
    with pytest.raises(ValueError, match=r"expected gate and up \[E, I, H\] and down \[E, H, I\]"):
        kt_ops.ExpertWeights(g, u_wide, d)
    # H disagreement: down with another n
    d_other = layer("int4", 256, 32, 32).down
    with pytest.raises(ValueError, match=r"got gate \[32, 64\], up \[32, 64\], down \[256, 32\]"):
        kt_ops.ExpertWeights(g, u, d_other)
    # down [E, I, H] instead of [E, H, I]
    with pytest.raises(ValueError, match="expected gate and up"):
        kt_ops.ExpertWeights(g, u, g)
    # E disagreement
    fewer = dataclasses.replace(d, weight=d.weight[:-1], scales=d.scales[:-1])
    with pytest.raises(ValueError, match=rf"different expert counts \[{E - 1}, {E}\]"):
        kt_ops.ExpertWeights(g, u, fewer)
    # validate(): a tensor of the wrong layout, named with its projection
    bad = kt_ops.ExpertWeights(g, dataclasses.replace(u, scales=u.scales[:, :, :1]), d)
    with pytest.raises(ValueError, match=r"ExpertWeights.up: PackedProjection.scales has"):
        bad.validate()
    with pytest.raises(ValueError, match="weights must hold 9 entries"):
        kt_ops.ExpertWeights.from_op_args(w.tensors()[:8], "int4", [64, 32], [32] * 3)
    with pytest.raises(ValueError, match="sizes must be"):
        kt_ops.ExpertWeights.from_op_args(w.tensors(), "int4", [64], [32] * 3)
    with pytest.raises(ValueError, match="unknown weight_format 'int5'"):
        kt_ops.ExpertWeights.from_op_args(w.tensors(), "int5", [64, 32], [32] * 3)


def test_lora_weights_op_args():
    a, b = torch.zeros(E, 2, 64), torch.zeros(E, 32, 2)
    lora = kt_ops.LoRAWeights(up=(a, b), scaling=0.5)
    args = lora.op_args(torch.empty(0))
    assert len(args) == 6 and args[2] is a and args[3] is b
    assert all(t.shape == (0,) for i, t in enumerate(args) if i not in (2, 3))
    back = kt_ops.LoRAWeights.from_op_args(args, 0.5)
    assert back.up == (a, b) and back.gate is None and back.down is None and back.scaling == 0.5
    assert kt_ops.LoRAWeights().op_args(torch.empty(0)) == []


# --------------------------------------------------------------------------
# The format table and the kernels
# --------------------------------------------------------------------------


def test_formats_are_the_cpp_table():
    rows = _C.formats()
    assert FORMATS == tuple(r["name"] for r in rows)
    for row in rows:
        spec = format_spec(row["name"])
        got = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        sd = row["scale_dtype"]
        want = {
            **row,
            "group_sizes": tuple(row["group_sizes"]),
            "scale_dtype": getattr(torch, sd) if sd else None,
            "brgemm_min_tokens": tuple(sorted(row["brgemm_min_tokens"].items())),
        }
        assert got == want, row["name"]
        assert spec.default_group_size in spec.group_sizes
        assert (spec.fp32_min_tokens is None) or spec.fp32_min_tokens >= 1
    assert kt_ops.ops.__dict__.get("WEIGHT_FORMATS") is None
    with pytest.raises(ValueError, match="unknown weight_format 'int5'"):
        format_spec("int5")


#: The streaming kernels in their fast form (formats::Fp32Class::kVnni), whose fp32-path
#: break-evens are the spec's ``fp32_min_tokens_vnni``: vpdpbusd on u8 activations for the
#: integer formats, E4M3 by byte tables (AVX-512 with VBMI) for the fp8 layout.
FAST_STREAMING_KERNELS = ("avx512_vnni/qint_q8", "avx512/fp8_vbmi")


def test_fp32_min_tokens_follows_the_table():
    built = kt_ops.info()["built_isas"]
    supported = kt_ops.supported_isas()
    for name in FORMATS:
        spec = format_spec(name)
        for isa in built:
            if isa not in supported or (spec.activation != "q8" and spec.layout != "fp8"):
                continue
            fast = _C.kernel_names(isa)[name][0] in FAST_STREAMING_KERNELS
            want = spec.fp32_min_tokens_vnni if fast else spec.fp32_min_tokens
            assert kt_ops.quant_fp32_min_tokens(name, isa) == want, (name, isa)
        fast = _C.kernel_names(kt_ops.active_isa())[name][0] in FAST_STREAMING_KERNELS
        want = spec.fp32_min_tokens_vnni if fast else spec.fp32_min_tokens
        if spec.activation == "q8" or spec.layout == "fp8":
            assert kt_ops.quant_fp32_min_tokens(name) == want, name
    for name in ("int8", "q8_0"):  # the vpdpbusd kernel beats the fp32 path at every count
        assert format_spec(name).fp32_min_tokens == 16
        assert format_spec(name).fp32_min_tokens_vnni is None
    for name in ("fp8", "fp8_channel", "mxfp8"):  # so does the VBMI E4M3 decode (to 128)
        assert format_spec(name).fp32_min_tokens == 8
        assert format_spec(name).fp32_min_tokens_vnni is None
    with pytest.raises(ValueError, match="avx9"):
        kt_ops.quant_fp32_min_tokens("int8", "avx9")


def _is_kernel_name(name: str, isa: str) -> bool:
    tier, _, kernel = name.partition("/")
    # a path may fall back to a lower tier (e.g. avx512 -> avx2 for qint)
    return (
        bool(kernel)
        and tier in kt_ops.info()["built_isas"]
        and (kt_ops.info()["built_isas"].index(tier) <= kt_ops.info()["built_isas"].index(isa))
    )


@pytest.mark.parametrize("isa_name", kt_ops.info()["built_isas"])
def test_kernel_names_for_every_format(isa_name):
    names = _C.kernel_names(isa_name)
    assert list(names) == list(FORMATS)
    for fmt, (own, fp32) in names.items():
        assert _is_kernel_name(own, isa_name), (fmt, own)
        spec = format_spec(fmt)
        if spec.fp32_min_tokens is None and spec.activation == "fp32":
            assert fp32 is None, (fmt, fp32)  # bf16: one path
        if fp32 is not None:
            assert _is_kernel_name(fp32, isa_name) and fp32 != own, (fmt, fp32)
    if isa_name == "ref":
        assert all(own.startswith("ref/") for own, _ in names.values())


def test_info_kernels_are_the_active_isa(isa):
    report = kt_ops.info()
    assert report["active_isa"] == isa
    assert report["kernels"] == dict(_C.kernel_names(isa))
    assert set(report["kernels"]) == set(FORMATS)
    text = format_info(report)
    for fmt, (own, _) in report["kernels"].items():
        assert own in text, fmt
