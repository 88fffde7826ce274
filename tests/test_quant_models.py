"""Quantized experts in modules and models: ``MoEExperts.from_dense/from_packed`` and
``replace_experts(model, weight_format, ...)`` online or from a converted directory.

* ``MoEExperts.from_dense(gate, up, down, fmt, group_size=, symmetric=)`` packs exactly as
  ``kt_ops.formats.quantize_weights`` (its output is bit-identical to the op on those
  tensors), matches the quantized reference of tests/reference.py tightly and the dense
  layer within the format's quantization error; ``from_packed`` of the same
  ``PackedProjection`` s gives the same module.
* ``replace_experts(model, 'int4', group_size=32)`` on a tiny Qwen3-MoE built from a config
  (no download): logits close to the unmodified model (loose: int4 weights), and, with
  one layer, very close to the model whose expert weights are replaced by their int4
  dequantization (only the q8 activation rounding differs).
* ``replace_experts(model, converted_dir=...)`` after ``kt_ops.convert.convert`` of the
  saved model equals the online replacement bit for bit (state dicts and logits); a
  directory converted from a model of another shape, or lacking one of its layers, raises
  a clear ValueError and leaves the model untouched.
"""

# E, H, I, K: experts, hidden, intermediate, top-k (the design notes' names).
# ruff: noqa: E741

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
from reference import (
    TINY_MOE_CONFIG,
    dense_expert_weights,
    make_hidden,
    make_routing,
    quant_mismatch_report,
    reference_for,
    reference_quant_moe_forward,
)
from torch import nn

import kt_ops
from kt_ops.formats import dequantize_weights, quantize_weights
from kt_ops.nn import MoEExperts

transformers = pytest.importorskip("transformers")
from kt_ops import demo  # noqa: E402
from kt_ops.convert import convert  # noqa: E402
from kt_ops.hf import find_experts, replace_experts  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------------------------
# MoEExperts.from_dense / from_packed
# --------------------------------------------------------------------------------------------

#: (format, group size, symmetric, H, I): the formats of the brief, shapes each allows.
MODULE_CASES = [
    ("int4", 32, True, 128, 64),
    ("int4", 64, False, 128, 64),
    ("int8", None, True, 50, 40),
    ("fp8", None, True, 200, 136),
    ("mxfp4", None, True, 128, 64),
    ("q4_k", None, True, 256, 256),
]
MODULE_IDS = [f"{f}{'' if g is None else f'_g{g}'}{'' if s else '_asym'}"
              for f, g, s, _, _ in MODULE_CASES]  # fmt: skip
E_MOD, K_MOD, T_MOD = 6, 2, 24

#: Relative Frobenius error of the quantized layer against the dense fp32 layer (weights and
#: activations unquantized), as in test_quant_forward.py::TOTAL_ERROR (measured there:
#: int8 1.7%, fp8 4.6%, 4-bit formats 15-20%).
TOTAL_ERROR = {"int8": 0.03, "fp8": 0.07, "int4": 0.30, "mxfp4": 0.30, "q4_k": 0.30}


@functools.cache
def dense_layer(H: int, I: int):
    return dense_expert_weights(E_MOD, H, I, seed=H + I)


@functools.cache
def packed_layer(fmt, gs, sym, H, I) -> kt_ops.ExpertWeights:
    return kt_ops.ExpertWeights(*(quantize_weights(w, fmt, gs, sym) for w in dense_layer(H, I)))


def module_inputs(H: int, dtype=torch.float32):
    ids, weights = make_routing(T_MOD, E_MOD, K_MOD, seed=1, skip_fraction=0.1)
    return make_hidden(T_MOD, H, dtype, seed=1), ids, weights


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("fmt,gs,sym,H,I", MODULE_CASES, ids=MODULE_IDS)
def test_from_dense_packs_like_quantize_weights(fmt, gs, sym, H, I):
    gate, up, down = dense_layer(H, I)
    module = MoEExperts.from_dense(gate, up, down, fmt, group_size=gs, symmetric=sym)
    assert module.weight_format == fmt
    assert (module.num_experts, module.hidden_size, module.intermediate_size) == (E_MOD, H, I)
    w = packed_layer(fmt, gs, sym, H, I)
    x, ids, weights = module_inputs(H)
    with torch.no_grad():
        out = module(x, ids, weights)
    # the same packed tensors as quantize_weights: the very same result as the op on them
    assert torch.equal(out, kt_ops.moe_forward(x, ids, weights, w))
    assert quant_mismatch_report(out, reference_for(w, x, ids, weights)) is None
    # within the format's error of the dense layer
    dense = reference_quant_moe_forward(x, ids, weights, gate, up, down, activation="fp32")
    err = _rel(out, dense.out)
    assert err < TOTAL_ERROR[fmt], f"{fmt}: {err:.3g} of the dense layer's output"


@pytest.mark.parametrize("fmt,gs,sym,H,I", MODULE_CASES[:3], ids=MODULE_IDS[:3])
def test_from_dense_shapes_and_dtypes(fmt, gs, sym, H, I):
    module = MoEExperts.from_dense(*dense_layer(H, I), fmt, group_size=gs, symmetric=sym)
    x, ids, weights = module_inputs(H, torch.bfloat16)
    with torch.no_grad():
        flat = module(x, ids, weights)
        batched = module(
            x.view(2, T_MOD // 2, H), ids.view(2, -1, K_MOD), weights.view(2, -1, K_MOD)
        )
    assert flat.dtype == torch.bfloat16 and flat.shape == (T_MOD, H)
    assert batched.shape == (2, T_MOD // 2, H) and torch.equal(batched.view(T_MOD, H), flat)


@pytest.mark.parametrize("fmt,gs,sym,H,I", MODULE_CASES, ids=MODULE_IDS)
def test_from_packed_equals_from_dense(fmt, gs, sym, H, I):
    w = packed_layer(fmt, gs, sym, H, I)
    a = MoEExperts.from_packed(w.gate, w.up, w.down)
    b = MoEExperts.from_dense(*dense_layer(H, I), fmt, group_size=gs, symmetric=sym)
    assert a.weight_format == fmt
    _assert_same_state(a, b)
    x, ids, weights = module_inputs(H)
    with torch.no_grad():
        assert torch.equal(a(x, ids, weights), b(x, ids, weights))


@pytest.mark.parametrize("fmt,gs,sym,H,I", [MODULE_CASES[1], MODULE_CASES[2]], ids=MODULE_IDS[1:3])
def test_casting_the_module_keeps_the_quantized_tensors(fmt, gs, sym, H, I):
    # .half()/.to(bf16)/.double() of a model must not cast packed codes, scales or zeros
    # (e.g. fp32 int8 scales to fp16): they are a storage format, as the bf16 weights are.
    module = MoEExperts.from_dense(*dense_layer(H, I), fmt, group_size=gs, symmetric=sym)
    before = copy.deepcopy(module)
    x, ids, weights = module_inputs(H)
    with torch.no_grad():
        want = before(x, ids, weights)
        for cast in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.double()):
            cast(module)
            _assert_same_state(module, before)
            assert torch.equal(module(x, ids, weights), want)


def test_from_dense_errors():
    gate, up, down = dense_layer(50, 40)
    with pytest.raises(ValueError, match="group_size"):
        MoEExperts.from_dense(gate, up, down, "int4", group_size=32)  # K = 50
    with pytest.raises(ValueError, match="group_size"):
        MoEExperts.from_dense(gate, up, down, "int4", group_size=48)
    with pytest.raises(ValueError, match="symmetric=False"):
        MoEExperts.from_dense(gate, up, down, "int8", symmetric=False)
    with pytest.raises(ValueError, match="int5"):
        MoEExperts.from_dense(gate, up, down, "int5")


# --------------------------------------------------------------------------------------------
# replace_experts on a tiny Qwen3-MoE
# --------------------------------------------------------------------------------------------

TINY = TINY_MOE_CONFIG
E, H, I, K = (TINY[k] for k in ("num_experts", "hidden_size", "moe_intermediate_size", "top_k"))
INPUT_IDS = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))


def tiny_qwen3(dtype=torch.float32, **overrides) -> nn.Module:
    config = demo.make_config("qwen3_moe", **{**TINY, **overrides})
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def logits(model: nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(INPUT_IDS).logits.float()


def experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, MoEExperts)]


#: Relative Frobenius error of the logits of the 2-layer tiny model with replaced experts
#: against the unmodified model. Simulated (expert weights replaced by their dequantized
#: values, plus the q8 activation rounding): int4 g32 0.17 (fp32 and bf16 models), int8
#: 0.05 (a router decision of layer 2 flips). Which router decisions flip depends on the
#: bf16 arithmetic of the torch version: the bf16 int8 model measured 0.131 with torch
#: 2.6.0, below 0.1 with 2.13 and 2.14. A broken replacement (experts' down projections
#: permuted or zeroed) gives 0.7-1.0.
LOGIT_ERROR = {"int4": 0.3, "int8": 0.2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt,gs", [("int4", 32), ("int8", None)])
def test_replace_experts_quantized_logits_close(fmt, gs, dtype):
    model = tiny_qwen3(dtype)
    reference = copy.deepcopy(model)
    assert replace_experts(model, fmt, group_size=gs) is model
    replaced = experts_modules(model)
    assert len(replaced) == 2 and all(m.weight_format == fmt for m in replaced)
    assert find_experts(model) == []
    err = _rel(logits(model), logits(reference))
    assert err < LOGIT_ERROR[fmt], f"{fmt} {dtype}: relative logit error {err:.3g}"


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_replace_experts_int4_is_the_dequantized_model(sym):
    # One layer (the router sees identical inputs): against the dense model whose expert
    # weights are their int4 dequantization, only the q8 activation rounding is left
    # (simulated: 0.8% of the logits).
    model = tiny_qwen3(num_layers=1)
    simulated = copy.deepcopy(model)
    with torch.no_grad():
        experts = simulated.model.layers[0].mlp.experts
        gate_up, down = experts.gate_up_proj, experts.down_proj  # [E, 2I, H], [E, H, I]
        for t in (gate_up[:, :I], gate_up[:, I:], down):
            t.copy_(dequantize_weights(quantize_weights(t, "int4", 32, sym)))
    replace_experts(model, "int4", group_size=32, symmetric=sym)
    err = _rel(logits(model), logits(simulated))
    assert err < 0.03, f"relative logit error {err:.3g} against the dequantized model"


# --------------------------------------------------------------------------------------------
# replace_experts from a converted directory
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """The fp32 tiny Qwen3-MoE saved as a Hugging Face directory."""
    src = tmp_path_factory.mktemp("tiny_qwen3") / "src"
    tiny_qwen3().save_pretrained(src)
    return src


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_converted_dir_equals_online(saved_model, tmp_path, sym):
    out = tmp_path / "int4"
    manifest = convert(saved_model, out, "int4", 32, symmetric=sym, progress=False)
    assert manifest["moe_layers"] == [0, 1] and manifest["format"] == "int4"
    offline = replace_experts(tiny_qwen3(), converted_dir=str(out))
    online = replace_experts(tiny_qwen3(), "int4", group_size=32, symmetric=sym)
    a, b = experts_modules(offline), experts_modules(online)
    assert len(a) == len(b) == 2
    for ma, mb in zip(a, b):
        assert ma.weight_format == mb.weight_format == "int4"
        _assert_same_state(ma, mb)  # bit-identical packed tensors
    _assert_same_state(offline, online)  # and everything else
    assert torch.equal(logits(offline), logits(online))


@pytest.mark.parametrize(
    "other", [{"moe_intermediate_size": 64}, {"num_experts": 4}], ids=["I64", "E4"]
)
def test_converted_dir_of_another_shape(saved_model, tmp_path, other):
    src = tmp_path / "other"
    tiny_qwen3(**other).save_pretrained(src)
    out = tmp_path / "other_int4"
    convert(src, out, "int4", 32, progress=False)
    want = (other.get("num_experts", E), other.get("moe_intermediate_size", I), H)
    model = tiny_qwen3()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ValueError,
        match=rf"layer 0 of .* holds experts \[E, I, H\] = {re.escape(str(want))}, but "
        rf"'model.layers.0.mlp.experts' has \({E}, {I}, {H}\)",
    ):
        replace_experts(model, converted_dir=str(out))
    # nothing was replaced
    assert experts_modules(model) == [] and len(find_experts(model)) == 2
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)


def test_converted_dir_without_the_models_layers(saved_model, tmp_path):
    out = tmp_path / "layer1"
    convert(saved_model, out, "int4", 32, layers=[1], progress=False)
    model = tiny_qwen3()
    with pytest.raises(ValueError, match=r"holds no experts for 'model.layers.0.mlp.experts'"):
        replace_experts(model, converted_dir=str(out))
    assert experts_modules(model) == []


def test_converted_dir_missing_a_later_layer_leaves_the_model_untouched(saved_model, tmp_path):
    # Every layer is loaded (and verified) before any is swapped in.
    out = tmp_path / "layer0"
    convert(saved_model, out, "int4", 32, layers=[0], progress=False)
    model = tiny_qwen3()
    with pytest.raises(ValueError, match=r"holds no experts for 'model.layers.1.mlp.experts'"):
        replace_experts(model, converted_dir=str(out))
    assert experts_modules(model) == [], "layer 0 was replaced although the call failed"
