"""The experts' GLU activations (``activation=``, csrc/kernels/activations.h) against torch.

Every activation of :data:`kt_ops.ACTIVATIONS` runs through the inference
kernels (every ISA tier's vector epilogue, the weight formats, the compute
paths), the LoRA training path (ATen, its scalar forward and backward),
``MoEExperts`` (prepared layer, GPU-resident experts in torch) and
``replace_experts`` on a Hugging Face model whose experts use GELU; each is
checked against a dense PyTorch reference computed with torch's own
function of that activation.
"""

from __future__ import annotations

import math

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
from kt_ops.layer import ACTIVATIONS, layer_args, torch_activation
from kt_ops.nn import MoEExperts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E, H, I, K = 6, 96, 80, 2  # noqa: E741  (I: not a multiple of the 16-row blocks)
GELUS = [a for a in ACTIVATIONS if a != "silu"]


def test_the_table():
    assert ACTIVATIONS[0] == "silu" and {"gelu", "gelu_tanh"} <= set(ACTIVATIONS)
    for name in ACTIVATIONS:
        assert callable(torch_activation(name))
    with pytest.raises(ValueError, match="activation must be one of"):
        torch_activation("tanh")


# --------------------------------------------------------------------------
# The epilogue itself: identity weights make out = act(x) * x exactly
# --------------------------------------------------------------------------


@pytest.mark.parametrize("act", ACTIVATIONS)
def test_epilogue_accuracy_over_a_wide_range(act: str, isa: str):
    """bf16 identity experts (exact): out = act(x) * x, from -9 to 9, tails included."""
    eye = torch.eye(16)[None]
    experts = kt_ops.ExpertWeights.from_dense(eye, eye, eye, "bf16")
    x = torch.linspace(-9, 9, 16 * 64).reshape(64, 16)
    ids, w = torch.zeros(64, 1, dtype=torch.long), torch.ones(64, 1)
    out = kt_ops.moe_forward(x, ids, w, experts, activation=act).double()
    xd = x.double()
    if act == "gelu":  # exact in float64 (torch's erf-based gelu loses the tail to 1 + erf)
        want = 0.5 * xd * torch.erfc(-xd / math.sqrt(2.0)) * xd
    elif act == "gelu_tanh":  # x / (1 + exp(-2z)): 0.5 x (1 + tanh z) without the cancellation
        z = math.sqrt(2.0 / math.pi) * (xd + 0.044715 * xd**3)
        want = xd / (1.0 + torch.exp(-2.0 * z)) * xd
    elif act == "relu":
        want = torch.relu(xd) * xd
    else:
        want = torch.nn.functional.silu(xd) * xd
    rel = (out - want).abs() / want.abs().clamp_min(1e-300)
    assert rel.max() < 2e-5, f"{act} on {isa}: max relative error {rel.max():.3g}"


def test_default_is_silu_and_bit_identical():
    experts = make_expert_weights(E, H, I, seed=1)
    ids, w = make_routing(9, E, K, seed=1)
    x = make_hidden(9, H, torch.float32, seed=1)
    assert torch.equal(
        kt_ops.moe_forward(x, ids, w, experts),
        kt_ops.moe_forward(x, ids, w, experts, activation="silu"),
    )


# --------------------------------------------------------------------------
# Formats, tiers, token counts: against the dense reference
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


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("T", [0, 1, 5, 40])
@pytest.mark.parametrize("act", GELUS)
def test_formats_match_the_reference(fmt: str, T: int, act: str, isa: str):
    h, inter = FORMATS[fmt]
    experts = make_quant_experts(fmt, E, h, inter, seed=3)
    ids, w = make_routing(T, E, K, seed=T, skip_fraction=0.2)
    x = make_hidden(T, h, torch.float32, seed=T)
    with kt_ops.use_compute_path("streaming"):
        out = kt_ops.moe_forward(x, ids, w, experts, activation=act)
        ref = reference_for(experts, x, ids, w, act=act)
    msg = quant_mismatch_report(out, ref)
    assert msg is None, f"{fmt} {act} T={T} on {isa}: {msg}"
    if T:  # the activation matters: silu's output is far from it
        silu = kt_ops.moe_forward(x, ids, w, experts)
        assert quant_mismatch_report(silu, ref) is not None


@pytest.mark.parametrize("act", GELUS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_and_brgemm_paths(act: str, dtype: torch.dtype):
    """The matrix path (bf16 brgemm, u8s8 brgemm where oneDNN runs them) and 'auto'."""
    T = 64
    ids, w = make_routing(T, E, K, seed=7)
    x = make_hidden(T, H, dtype, seed=7)
    experts = make_quant_experts("int8", E, H, I, seed=7)
    with kt_ops.use_compute_path("auto"):
        out = kt_ops.moe_forward(x, ids, w, experts, activation=act)
        msg = quant_mismatch_report(out, reference_for(experts, x, ids, w, act=act))
    assert msg is None, msg
    bf16 = make_expert_weights(E, H, I, seed=7)
    with kt_ops.use_compute_path("brgemm"):
        out = kt_ops.moe_forward(x, ids, w, bf16, activation=act)
        # Where the forced path has a bf16 tile kernel (whatever 'auto' would choose).
        on_brgemm = kt_ops.compute_paths()["bf16"]["brgemm_kernel"] is not None
    ref = reference_moe_forward(x, ids, w, bf16, bf16_activations=on_brgemm, act=act)
    assert mismatch_report(out, ref, TOL_BF16_BRGEMM if on_brgemm else TOL_BF16) is None


def test_bit_identical_for_thread_counts():
    experts = make_quant_experts("int4", E, 128, 256, seed=2)
    ids, w = make_routing(33, E, K, seed=2)
    x = make_hidden(33, 128, torch.bfloat16, seed=2)
    before = kt_ops.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            kt_ops.set_num_threads(n)
            outs.append(kt_ops.moe_forward(x, ids, w, experts, activation="gelu"))
    finally:
        kt_ops.set_num_threads(before)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


# --------------------------------------------------------------------------
# LoRA training: forward and every gradient against autograd of the reference
# --------------------------------------------------------------------------


@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
@pytest.mark.parametrize("T", [1, 7, 40])
def test_lora_gradients_match_autograd_of_the_reference(act: str, checkpointing: bool, T: int):
    experts = make_expert_weights(E, H, I, seed=4)
    ids, w = make_routing(T, E, K, seed=T, skip_fraction=0.2)
    x0 = make_hidden(T, H, torch.float32, seed=T)
    assert_lora_gradients_match(
        experts, x0, ids, w, act=act, activation_checkpointing=checkpointing, seed=T
    )


# --------------------------------------------------------------------------
# MoEExperts: the prepared layer, the GPU-resident experts (torch), pickling
# --------------------------------------------------------------------------


@pytest.mark.parametrize("act", GELUS)
def test_module_prepared_and_hybrid_paths(act: str):
    g = torch.Generator().manual_seed(11)
    dense = tuple(  # bf16 values: packing is exact, so the GPU experts' copies match
        t.bfloat16().float()
        for t in (
            torch.randn(E, I, H, generator=g) / H**0.5,
            torch.randn(E, I, H, generator=g) / H**0.5,
            torch.randn(E, H, I, generator=g) / I**0.5,
        )
    )
    m = MoEExperts.from_dense(*dense, "bf16", activation=act)
    assert m.activation == act and f"activation={act!r}" in repr(m)
    ids, w = make_routing(8, E, K, seed=11)
    x = make_hidden(8, H, torch.float32, seed=11)
    experts = m.expert_weights()
    want = kt_ops.moe_forward(x, ids, w, experts, activation=act)
    with torch.no_grad():
        assert torch.equal(m(x, ids, w), want)  # builds the prepared layer
        assert isinstance(m.__dict__["_prepared_layer"][0], kt_ops.ops.PreparedLayer)
        assert torch.equal(m(x, ids, w), want)  # through it
    ref = reference_moe_forward(x, ids, w, experts, act=act)
    assert_matches_reference(want, ref)
    # Changing the activation takes effect at once (the prepared layer is guarded on it).
    m.activation = "silu"
    with torch.no_grad():
        assert torch.equal(m(x, ids, w), kt_ops.moe_forward(x, ids, w, experts))
    m.activation = act
    # GPU-resident experts (here on the CPU) compute the same activation in torch.
    m.set_gpu_experts([0, 3], dense=dense)
    with torch.no_grad():
        assert_matches_reference(m(x, ids, w), ref)
    m.set_gpu_experts(None)
    import pickle

    clone = pickle.loads(pickle.dumps(m))
    assert clone.activation == act
    with torch.no_grad():
        assert torch.equal(clone(x, ids, w), want)


def test_module_refuses_an_unknown_activation():
    experts = make_expert_weights(E, H, I, seed=1)
    with pytest.raises(ValueError, match="activation='tanh' is not supported.*expected one of"):
        MoEExperts(experts, activation="tanh")


def test_op_refuses_an_unknown_activation_naming_it():
    experts = make_expert_weights(E, H, I, seed=1)
    ids, w = make_routing(2, E, K)
    x = make_hidden(2, H, torch.float32)
    with pytest.raises(RuntimeError, match="activation='tanh' is not supported; expected one of"):
        kt_ops.moe_forward(x, ids, w, experts, activation="tanh")
    with pytest.raises(RuntimeError, match="activation='tanh' is not supported"):
        with torch.no_grad():  # the prepared path declines; the op raises
            kt_ops.moe_forward(x, ids, w, experts, activation="tanh")


@pytest.mark.parametrize("act", GELUS)
def test_opcheck(act: str):
    experts = make_expert_weights(E, H, I, seed=5)
    ids, w = make_routing(5, E, K, seed=5)
    x = make_hidden(5, H, torch.float32, seed=5)
    args = (x, ids, w) + layer_args(experts, None, act, x)
    torch.library.opcheck(torch.ops.kt.moe_forward.default, args)


# --------------------------------------------------------------------------
# Hugging Face models whose experts use GELU
# --------------------------------------------------------------------------


def _tiny_model(hidden_act: str, num_layers: int = 2, bf16_experts: bool = True):
    """A tiny Qwen3-MoE model whose experts use ``hidden_act`` (bf16-valued expert weights)."""
    transformers = pytest.importorskip("transformers")
    from lora_helpers import TINY, round_experts_to_bf16_

    from kt_ops import demo

    config = demo.make_config("qwen3_moe", **{**TINY, "num_layers": num_layers})
    config.hidden_act = hidden_act
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if bf16_experts:
        round_experts_to_bf16_(model)
    return model


@pytest.mark.parametrize(
    "hidden_act, act",
    [
        ("gelu_pytorch_tanh", "gelu_tanh"),
        ("gelu", "gelu"),
        ("gelu_new", "gelu_tanh"),
        ("relu", "relu"),
    ],
)
def test_replace_experts_of_a_gelu_model(hidden_act: str, act: str):
    model, ref = _tiny_model(hidden_act), _tiny_model(hidden_act)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        want = ref(ids).logits
        kt_ops.replace_experts(model)
        replaced = [mod for mod in model.modules() if isinstance(mod, MoEExperts)]
        assert replaced and all(mod.activation == act for mod in replaced)
        got = model(ids).logits
    err = (got - want).abs().max() / want.abs().max()
    assert err < 1e-4, err


def test_replace_experts_refuses_another_activation():
    model = _tiny_model("tanh", num_layers=1, bf16_experts=False)
    with pytest.raises(kt_ops.hf.UnsupportedExpertsError, match="activation .*Tanh"):
        kt_ops.replace_experts(model)
