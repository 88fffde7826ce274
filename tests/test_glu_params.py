"""Parametrized GLUs and per-expert biases (gpt-oss's clamped SwiGLU, DeepSeek-V4's clamp,
Step-3.7's clamp after the activation) against torch.

The ``activation`` argument's parameters (``kt_ops.activation_spec``: alpha, limit,
act_limit, up_offset; csrc/kernels/activations.h) and the biases of
``ExpertWeights.with_biases`` run through every ISA tier's vector epilogue, the
weight formats and compute paths, the LoRA training path (forward and every
gradient against autograd of the dense reference), the prepared layer,
``MoEExperts`` and the op's checks.
"""

from __future__ import annotations

import math
import pickle
import re

import pytest
import torch
from reference import (
    TOL_BF16,
    TOL_BF16_BRGEMM,
    assert_lora_gradients_match,
    assert_matches_reference,
    make_expert_weights,
    make_hidden,
    make_quant_experts,
    make_routing,
    mismatch_report,
    quant_mismatch_report,
    reference_for,
    reference_moe_forward,
)

import kt_ops
from kt_ops.layer import activation_spec, layer_args, parse_activation, torch_glu
from kt_ops.nn import MoEExperts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E, H, I, K = 6, 96, 80, 2  # noqa: E741  (I: not a multiple of the 16-row blocks)

#: gpt-oss's GLU with a small limit, so random activations reach the clamps.
GPT_OSS = activation_spec("silu", alpha=1.702, limit=0.5, up_offset=1.0)
#: DeepSeek-V4 / GLM-5-Next / HY-V4: clamp, plain SwiGLU.
CLAMPED = activation_spec("silu", limit=0.4)
#: Step-3.7: the activation's output clamped.
CLAMPED_AFTER = activation_spec("silu", act_limit=0.1)
#: Inkling2: softcaps on the gate's linear factor and on up, sigmoid on the raw gate.
SOFTCAPPED = activation_spec("silu", gate_softcap=0.8, up_softcap=1.5)
SPECS = [
    GPT_OSS,
    CLAMPED,
    CLAMPED_AFTER,
    activation_spec("gelu_tanh", limit=0.5, up_offset=0.5),
    SOFTCAPPED,
    activation_spec("silu", up_softcap=0.7),
]


def _biases(experts: kt_ops.ExpertWeights, which: str, seed: int = 0) -> kt_ops.ExpertWeights:
    """``experts`` with random biases on the projections named in ``which`` ('gud')."""
    g = torch.Generator().manual_seed(seed)
    e, inter, h = experts.num_experts, experts.intermediate_size, experts.hidden_size

    def bias(flag: str, n: int):
        return torch.randn(e, n, generator=g) * 0.3 if flag in which else None

    return experts.with_biases(bias("g", inter), bias("u", inter), bias("d", h))


# --------------------------------------------------------------------------
# The spec
# --------------------------------------------------------------------------


def test_spec_round_trip():
    assert activation_spec("silu") == "silu"
    spec = activation_spec("silu", alpha=1.702, limit=7, up_offset=1)
    assert spec == "silu(alpha=1.702,limit=7.0,up_offset=1.0)"
    p = parse_activation(spec)
    assert p["name"] == "silu" and p["limit"] == 7.0 and p["act_limit"] is None
    assert p["up_offset"] == 1.0 and abs(p["alpha"] - 1.702) < 1e-6
    assert parse_activation("gelu(act_limit=3)")["act_limit"] == 3.0


@pytest.mark.parametrize(
    "spec, match",
    [
        ("tanh", "unknown activation 'tanh'; expected one of 'silu'"),
        ("gelu(gate_softcap=2)", "gate_softcap applies to silu only"),
        ("silu(gate_softcap=2,limit=1)", "do not combine"),
        ("silu(up_softcap=0)", "positive"),
        ("gelu(alpha=2)", "alpha applies to silu only"),
        ("silu(limit=1,act_limit=1)", "one of limit / act_limit"),
        ("silu(limit=0)", "positive"),
        ("silu(limit=-3)", "positive"),
        ("silu(limit=nan)", "finite number"),
        ("silu(limit=abc)", "finite number"),
        ("silu(beta=1)", "unknown parameter 'beta'"),
        ("silu(limit=7", r"name\(key=value"),
        ("silu(limit)", "finite number"),
        ("silu(limit=1e39)", "finite number> that fp32 holds"),  # inf in the kernels
        ("silu(limit=1e-50)", "finite number> that fp32 holds"),  # 0: would zero the output
        ("silu(up_offset=-1e39)", "finite number> that fp32 holds"),
        ("silu(alpha=2,alpha=3)", "'alpha' is given twice"),
        ("silu(limit=1,)", "without an empty one"),
        ("silu(,limit=1)", "without an empty one"),
    ],
)
def test_spec_errors(spec: str, match: str):
    with pytest.raises(ValueError, match=match):
        parse_activation(spec)
    experts = make_expert_weights(E, H, I, seed=1)
    ids, w = make_routing(2, E, K)
    x = make_hidden(2, H, torch.float32)
    with pytest.raises(RuntimeError, match=f"activation='{re.escape(spec)}' is not supported"):
        kt_ops.moe_forward(x, ids, w, experts, activation=spec)
    with pytest.raises(ValueError, match="is not supported"):
        MoEExperts(experts, activation=spec)


def test_torch_glu_is_the_formula():
    g = torch.linspace(-3, 3, 61, dtype=torch.float64)
    u = torch.linspace(2, -2, 61, dtype=torch.float64)
    # gpt-oss's _apply_gate (transformers' GptOssExperts), written out.
    gc, uc = g.clamp(max=0.5), u.clamp(-0.5, 0.5)
    want = (uc + 1) * (gc * torch.sigmoid(gc * 1.702))
    got = torch_glu(GPT_OSS)(g, u)
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    # Step-3.7's: silu(g).clamp(max) * up.clamp.
    want = torch.nn.functional.silu(g).clamp(max=0.1) * u.clamp(-0.1, 0.1)
    assert torch.allclose(torch_glu(CLAMPED_AFTER)(g, u), want)
    # Inkling2's Inkling2SoftcappedSwiGLU, written out.
    want = torch.tanh(g / 0.8) * 0.8 * torch.sigmoid(g) * torch.tanh(u / 1.5) * 1.5
    assert torch.allclose(torch_glu(SOFTCAPPED)(g, u), want)


# --------------------------------------------------------------------------
# The epilogue: identity experts make out = glu(x + bg, x + bu) + bd exactly
# --------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_epilogue_with_biases_over_a_wide_range(spec: str, isa: str):
    eye = torch.eye(16)[None]
    experts = _biases(kt_ops.ExpertWeights.from_dense(eye, eye, eye, "bf16"), "gud", seed=2)
    x = torch.linspace(-4, 4, 16 * 64).reshape(64, 16)
    x[3, 5] = float("nan")  # NaN passes through the clamps (torch.clamp)
    ids, w = torch.zeros(64, 1, dtype=torch.long), torch.ones(64, 1)
    out = kt_ops.moe_forward(x, ids, w, experts, activation=spec).double()
    bg, bu, bd = (p.bias[0].double() for p in experts.projections)
    want = torch_glu(spec)(x.double() + bg, x.double() + bu) + bd
    # The NaN reaches its whole row through the down product (NaN * 0 is NaN).
    assert torch.isnan(want[3, 5]) and torch.isnan(out[3]).all()
    keep = torch.arange(64) != 3
    # Relative to the operands of the last (fp32) add, h + bd: they may cancel.
    scale = (want[keep] - bd).abs() + bd.abs()
    err = (out[keep] - want[keep]).abs() / scale.clamp_min(1e-3)
    assert err.max() < 2e-5, f"{spec} on {isa}: max error {err.max():.3g}"


# --------------------------------------------------------------------------
# Formats, tiers, token counts, compute paths: against the dense reference
# --------------------------------------------------------------------------

# (H, I) per format: odd sizes where the format takes them; K-quants want K % 256 == 0.
FORMATS = {
    "bf16": (H, I),
    "int8": (H, I),
    "int4": (128, 256),
    "q4_k,q4_k,q6_k": (256, 256),
    "fp8": (H, 128),
    "mxfp4": (H, 160),
}
#: (spec, projections with a bias).
CASES = [(GPT_OSS, "gud"), (CLAMPED, "g"), (CLAMPED_AFTER, "d"), ("silu", "ud")]
CASES += [(SOFTCAPPED, "gu")]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("T", [0, 1, 5, 40])
@pytest.mark.parametrize("spec, which", CASES, ids=[f"{s}-{b}" for s, b in CASES])
def test_formats_match_the_reference(fmt: str, T: int, spec: str, which: str, isa: str):
    h, inter = FORMATS[fmt]
    experts = _biases(make_quant_experts(fmt, E, h, inter, seed=3), which, seed=T)
    ids, w = make_routing(T, E, K, seed=T, skip_fraction=0.2)
    x = make_hidden(T, h, torch.float32, seed=T) * 3
    with kt_ops.use_compute_path("streaming"):
        out = kt_ops.moe_forward(x, ids, w, experts, activation=spec)
        ref = reference_for(experts, x, ids, w, act=spec)
    msg = quant_mismatch_report(out, ref)
    assert msg is None, f"{fmt} {spec} {which} T={T} on {isa}: {msg}"
    if T:  # the biases and the parameters matter
        plain = experts.with_biases(None, None, None)
        assert quant_mismatch_report(kt_ops.moe_forward(x, ids, w, plain), ref) is not None
        if spec != "silu":  # the parameters alone, with the biases kept
            name = kt_ops.layer.parse_activation(spec)["name"]
            bare = kt_ops.moe_forward(x, ids, w, experts, activation=name)
            assert quant_mismatch_report(bare, ref) is not None


@pytest.mark.parametrize("spec, which", CASES[:2], ids=["gpt_oss", "clamped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_and_brgemm_paths(spec: str, which: str, dtype: torch.dtype):
    """The matrix path (bf16 brgemm, u8s8 brgemm where oneDNN runs them) and 'auto'."""
    T = 64
    ids, w = make_routing(T, E, K, seed=7)
    x = make_hidden(T, H, dtype, seed=7) * 3
    experts = _biases(make_quant_experts("int8", E, H, I, seed=7), which)
    with kt_ops.use_compute_path("auto"):
        out = kt_ops.moe_forward(x, ids, w, experts, activation=spec)
        msg = quant_mismatch_report(out, reference_for(experts, x, ids, w, act=spec))
    assert msg is None, msg
    bf16 = _biases(make_expert_weights(E, H, I, seed=7), which)
    with kt_ops.use_compute_path("brgemm"):
        out = kt_ops.moe_forward(x, ids, w, bf16, activation=spec)
        # Where the forced path has a bf16 tile kernel (whatever 'auto' would choose).
        on_brgemm = kt_ops.compute_paths()["bf16"]["brgemm_kernel"] is not None
    ref = reference_moe_forward(x, ids, w, bf16, bf16_activations=on_brgemm, act=spec)
    assert mismatch_report(out, ref, TOL_BF16_BRGEMM if on_brgemm else TOL_BF16) is None


def test_bit_identical_for_thread_counts():
    experts = _biases(make_quant_experts("int4", E, 128, 256, seed=2), "gud")
    ids, w = make_routing(33, E, K, seed=2)
    x = make_hidden(33, 128, torch.bfloat16, seed=2)
    before = kt_ops.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            kt_ops.set_num_threads(n)
            outs.append(kt_ops.moe_forward(x, ids, w, experts, activation=GPT_OSS))
    finally:
        kt_ops.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_without_parameters_the_plain_path_is_unchanged():
    """'silu' and a spec whose parameters are the defaults give the same bits."""
    experts = make_expert_weights(E, H, I, seed=1)
    ids, w = make_routing(9, E, K, seed=1)
    x = make_hidden(9, H, torch.float32, seed=1)
    plain = kt_ops.moe_forward(x, ids, w, experts)
    assert torch.equal(plain, kt_ops.moe_forward(x, ids, w, experts, activation="silu(alpha=1)"))
    assert torch.equal(
        plain, kt_ops.moe_forward(x, ids, w, experts, activation="silu(up_offset=0)")
    )
    zero = experts.with_biases(torch.zeros(E, I), torch.zeros(E, I), torch.zeros(E, H))
    assert torch.equal(plain, kt_ops.moe_forward(x, ids, w, zero))


# --------------------------------------------------------------------------
# LoRA training: forward and every gradient against autograd of the reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, which", CASES, ids=["gpt_oss", "clamped", "after", "bias", "softcapped"]
)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_lora_gradients_match_autograd_of_the_reference(
    spec: str, which: str, checkpointing: bool, T: int
):
    experts = _biases(make_expert_weights(E, H, I, seed=4), which, seed=T)
    ids, w = make_routing(T, E, K, seed=T, skip_fraction=0.2)
    x0 = make_hidden(T, H, torch.float32, seed=T) * 3
    assert_lora_gradients_match(
        experts, x0, ids, w, act=spec, activation_checkpointing=checkpointing, seed=T
    )


# --------------------------------------------------------------------------
# MoEExperts, the prepared layer, opcheck and compile
# --------------------------------------------------------------------------


def test_module_with_biases_and_a_spec():
    experts = _biases(make_expert_weights(E, H, I, seed=11), "gud")
    m = MoEExperts(experts, activation=GPT_OSS)
    assert f"activation={GPT_OSS!r}" in repr(m)
    sd = m.state_dict()
    assert {"gate_bias", "up_bias", "down_bias"} <= set(sd)
    ids, w = make_routing(8, E, K, seed=11)
    x = make_hidden(8, H, torch.float32, seed=11) * 3
    want = kt_ops.moe_forward(x, ids, w, experts, activation=GPT_OSS)
    with torch.no_grad():
        assert torch.equal(m(x, ids, w), want)  # builds the prepared layer
        assert isinstance(m.__dict__["_prepared_layer"][0], kt_ops.ops.PreparedLayer)
        assert torch.equal(m(x, ids, w), want)  # through it
    assert_matches_reference(want, reference_moe_forward(x, ids, w, experts, act=GPT_OSS))
    # A replaced bias takes effect at once (the prepared layer is guarded on it).
    m.down_bias = torch.zeros(E, H)
    with torch.no_grad():
        assert not torch.equal(m(x, ids, w), want)
    m.load_state_dict(sd)
    clone = pickle.loads(pickle.dumps(m))
    m.half()  # the biases are part of the packed layout: casts leave them alone
    assert m.down_bias.dtype == torch.float32
    with torch.no_grad():
        assert torch.equal(m(x, ids, w), want)
        assert torch.equal(clone(x, ids, w), want)
    with pytest.raises(ValueError, match="per-expert biases"):
        m.set_gpu_experts([0])


def test_prepared_layer_with_biases_is_the_op():
    experts = _biases(make_quant_experts("int4", E, 128, 256, seed=5), "gd")
    layer = kt_ops.ops.new_prepared_layer(experts, activation=CLAMPED)
    ids, w = make_routing(7, E, K, seed=5)
    x = make_hidden(7, 128, torch.bfloat16, seed=5)
    want = torch.ops.kt.moe_forward.default(x, ids, w, *layer_args(experts, None, CLAMPED, x))
    with torch.no_grad():
        assert torch.equal(layer.forward(x, ids, w), want)


def test_opcheck_and_compile():
    experts = _biases(make_expert_weights(E, H, I, seed=5), "gud")
    ids, w = make_routing(5, E, K, seed=5)
    x = make_hidden(5, H, torch.float32, seed=5)
    args = (x, ids, w) + layer_args(experts, None, GPT_OSS, x)
    torch.library.opcheck(torch.ops.kt.moe_forward.default, args)

    def f(x, ids, w):
        return kt_ops.moe_forward(x, ids, w, experts, activation=GPT_OSS) * 2

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert torch.equal(compiled(x, ids, w), f(x, ids, w))


# --------------------------------------------------------------------------
# Errors name the argument
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "index, bias, match",
    [
        (9, torch.zeros(E, I, dtype=torch.bfloat16), "gate_bias must be fp32"),
        (10, torch.zeros(E, I + 1), r"up_bias must be \[E=6, 80\]"),
        (11, torch.zeros(E, 2 * H)[:, ::2], "down_bias must be contiguous"),
        (11, torch.zeros(E), r"down_bias must be \[E=6, 96\]"),
    ],
)
def test_op_names_a_bad_bias(index: int, bias: torch.Tensor, match: str):
    experts = make_expert_weights(E, H, I, seed=1)
    ids, w = make_routing(2, E, K)
    x = make_hidden(2, H, torch.float32)
    weights = experts.tensors() + [None, None, None]
    weights[index] = bias
    args = layer_args(experts, None, "silu", x)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.kt.moe_forward.default(x, ids, w, weights, *args[1:])
    with pytest.raises(
        RuntimeError,
        match="12 with the gate, up and down biases, or 15 with the biases and the backward panels",
    ):
        torch.ops.kt.moe_forward.default(x, ids, w, weights[:10], *args[1:])


def test_with_biases_validates():
    experts = make_expert_weights(E, H, I, seed=1)
    with pytest.raises(ValueError, match=r"bias must be None or fp32 \[E=6, n=80\]"):
        experts.with_biases(torch.zeros(E, H), None, None)
    b = experts.with_biases(None, None, torch.ones(E, H, dtype=torch.float64))
    assert b.down.bias.dtype == torch.float32 and b.has_bias and not experts.has_bias
    assert len(b.tensors()) == 12 and len(experts.tensors()) == 9
    assert (
        kt_ops.ExpertWeights.from_op_args(
            b.tensors(), b.weight_format, [H, I], list(b.group_sizes)
        ).down.bias
        is b.down.bias
    )
    assert math.isfinite(float(b.down.bias.sum()))
