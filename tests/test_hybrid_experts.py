"""CPU/GPU hybrid layers: GPU-resident experts in ``MoEExperts`` and ``replace_experts``.

A hybrid layer computes its GPU-resident experts with plain torch (from dense weights that
follow ``.to()``) and the rest with the op, which skips them (``gpu_experts_mask``). On this
CPU-only host the "GPU" experts live on the CPU, so the whole split is tested here: a split
module must give what the unsplit module gives.

How tight: the GPU experts' dense weights are exactly the packed values (dequantized, or the
bf16-valued dense originals), so with fp32 activations on the op's side (bf16 experts; the
quantized formats with ``use_quant_activations('fp32')``, or with LoRA, whose op path is fp32
ATen) both sides compute the same fp32 function and differ by summation order only:
``reference.TOL_BF16.compute`` (1e-4 of the largest output). The quantized formats' default
``q8`` path rounds the activations to int8 and the torch path does not: about 1e-2 relative
(test_gpu_experts_mask / the README's LoRA notes), held to ``Q8_RTOL``.
"""

# E, H, I, K: experts, hidden, intermediate, top-k.
# ruff: noqa: E741

from __future__ import annotations

import copy

import pytest
import torch
from reference import TOL_BF16

import kt_ops
from kt_ops.formats import dequantize_weights, quantize_weights
from kt_ops.lora import add_lora
from kt_ops.nn import MoEExpertList, MoEExperts, hottest_experts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E, H, I, K = 8, 256, 256, 3
#: fp32 activations on both sides: summation order only.
RTOL = TOL_BF16.compute
#: The op's q8 activation rounding against the torch path's fp32 activations.
Q8_RTOL = 5e-2
FORMATS = ["bf16", "int8", "int4", "q4_k"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    if want.numel() == 0:
        return 0.0 if got.shape == want.shape else float("inf")
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()


def _dense(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(E, I, H, generator=g) * 0.1
    up = torch.randn(E, I, H, generator=g) * 0.1
    down = torch.randn(E, H, I, generator=g) * 0.1
    return tuple(t.bfloat16().float() for t in (gate, up, down))  # bf16-valued


def _module(fmt: str, seed: int = 0, **kw) -> MoEExperts:
    gate, up, down = _dense(seed)
    if fmt == "bf16":
        return MoEExperts.from_dense(gate, up, down, "bf16", **kw)
    g = 32 if fmt == "int4" else None
    packed = [quantize_weights(t, fmt, group_size=g) for t in (gate, up, down)]
    return MoEExperts.from_packed(*packed, **kw)


def _routing(T: int, seed: int = 1, k: int = K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    if T:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    else:
        ids = torch.empty(0, k, dtype=torch.long)
    return x, ids, torch.rand(T, k, generator=g)


def _hybrid(module: MoEExperts, gpu) -> MoEExperts:
    new = copy.deepcopy(module)
    new.set_gpu_experts(gpu)
    return new


MASKS = {
    "none": [],
    "some": [1, 4, 6],
    "all": list(range(E)),
}


# --------------------------------------------------------------------------------------------
# The split equals the unsplit module
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [0, 1, 7])
@pytest.mark.parametrize("which", list(MASKS))
def test_split_matches_unsplit(fmt, T, which):
    base = _module(fmt)
    hybrid = _hybrid(base, MASKS[which])
    assert hybrid.num_gpu_experts == len(MASKS[which])
    x, ids, w = _routing(T)
    ids[:, -1:] = torch.where(torch.arange(T)[:, None] % 3 == 0, -1, ids[:, -1:])  # some -1
    with kt_ops.use_quant_activations("fp32"), torch.no_grad():
        got, want = hybrid(x, ids, w), base(x, ids, w)
    assert got.shape == want.shape == (T, H) and got.dtype == torch.float32
    assert rel_err(got, want) <= RTOL
    if which == "none":
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["int8", "int4", "q4_k"])
def test_split_q8_activations_within_rounding(fmt):
    base, x = _module(fmt), _routing(9)
    hybrid = _hybrid(base, [0, 2, 3, 5])
    with torch.no_grad():
        assert rel_err(hybrid(*x), base(*x)) <= Q8_RTOL


@pytest.mark.parametrize("gather", [True, False, None])
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("T", [0, 1, 9])
def test_gather_and_grouped_paths(T, lora, gather):
    base = _module("int4")
    if lora:
        add_lora(base, 2, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            base.down_lora_b.normal_(generator=torch.Generator().manual_seed(1))
    hybrid = _hybrid(base, list(range(E - 1)))
    hybrid.gpu_gather = gather
    x, ids, w = _routing(T)
    with kt_ops.use_quant_activations("fp32"):
        got, want = _grads(hybrid, x, ids, w), _grads(base, x, ids, w)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= RTOL


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gpu_dtype", [torch.float32, torch.bfloat16])
def test_low_precision_activations_and_weights(act_dtype, gpu_dtype):
    base = _module("bf16")
    hybrid = copy.deepcopy(base).set_gpu_experts([0, 3, 7], dtype=gpu_dtype)
    assert hybrid.gpu_gate_weight.dtype == gpu_dtype
    x, ids, w = _routing(6)
    x = x.to(act_dtype)
    with torch.no_grad():
        got, want = hybrid(x, ids, w), base(x, ids, w)
    assert got.dtype == act_dtype
    # bf16 x bf16 weights computes in bf16 (as the model would on a GPU): rounding per op.
    tol = 3e-2 if act_dtype == torch.bfloat16 and gpu_dtype == torch.bfloat16 else 1e-2
    assert rel_err(got, want) <= tol


def test_leading_dims_and_int32_ids():
    base = _module("int8")
    hybrid = _hybrid(base, [2, 5])
    x, ids, w = _routing(6)
    x3, ids3, w3 = x.view(2, 3, H), ids.int().view(2, 3, K), w.view(2, 3, K)
    with kt_ops.use_quant_activations("fp32"), torch.no_grad():
        got = hybrid(x3, ids3, w3)
        want = base(x, ids, w)
    assert got.shape == (2, 3, H)
    assert rel_err(got.view(6, H), want) <= RTOL


def test_from_dense_keeps_the_given_weights():
    gate, up, down = (t * 1.001 for t in _dense())  # not bf16-valued: originals kept
    hybrid = MoEExperts.from_dense(gate, up, down, "int4", group_size=32, gpu_experts=[6, 1])
    assert hybrid.gpu_expert_ids.tolist() == [1, 6]
    for name, t in (("gpu_gate_weight", gate), ("gpu_up_weight", up), ("gpu_down_weight", down)):
        assert torch.equal(getattr(hybrid, name), t[[1, 6]])
    assert hybrid.gpu_experts_mask.tolist() == [i in (1, 6) for i in range(E)]
    assert hybrid.gpu_expert_slot.tolist() == [-1, 0, -1, -1, -1, -1, 1, -1]


def test_from_packed_dequantizes_once():
    hybrid = _module("q4_k", gpu_experts=torch.tensor([3, 0]))
    experts = hybrid.expert_weights()
    for proj, name in zip(
        experts.projections, ("gpu_gate_weight", "gpu_up_weight", "gpu_down_weight")
    ):
        assert torch.equal(getattr(hybrid, name), dequantize_weights(proj)[[0, 3]])


# --------------------------------------------------------------------------------------------
# Gradients
# --------------------------------------------------------------------------------------------


def _randomize_lora_b(module: MoEExperts, seed: int = 3) -> None:
    """B != 0, so that the LoRA terms and A's gradients are not zero on both sides."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.lora_parameters().items():
            if "_b" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _grads(module: MoEExperts, x, ids, w):
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = module(xs, ids, ws)
    (out * torch.linspace(-1, 1, H, device=out.device)).square().sum().backward()
    lora = [p.grad for p in module.lora_parameters().values()]
    return [out.detach(), xs.grad, ws.grad, *lora]


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("T", [1, 7])
def test_gradients_without_lora(fmt, T):
    base = _module(fmt)
    hybrid = _hybrid(base, [0, 1, 5])
    x, ids, w = _routing(T)
    with kt_ops.use_quant_activations("fp32"):
        got, want = _grads(hybrid, x, ids, w), _grads(base, x, ids, w)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= RTOL


@pytest.mark.parametrize("fmt", ["bf16", "int8", "q4_k"])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("share_gate_up_a", [False, True])
def test_lora_gradients_match_unsplit(fmt, T, share_gate_up_a):
    base = _module(fmt)
    add_lora(
        base, 4, 8.0, share_gate_up_a=share_gate_up_a, generator=torch.Generator().manual_seed(2)
    )
    _randomize_lora_b(base)
    hybrid = _hybrid(base, [1, 2, 6])
    x, ids, w = _routing(T)
    got, want = _grads(hybrid, x, ids, w), _grads(base, x, ids, w)
    assert len(got) == len(want) == 3 + 6
    for a, b in zip(got, want):
        assert a is not None and rel_err(a, b) <= RTOL
    # The GPU experts' LoRA rows got their gradients from the torch path (nonzero).
    lora_grads = got[3:]
    hit = ids[(ids >= 0)].unique()
    gpu_hit = [e for e in (1, 2, 6) if e in hit.tolist()]
    assert gpu_hit and all(g[gpu_hit].abs().sum() > 0 for g in lora_grads)


def test_lora_on_all_gpu_experts_trains_in_torch_alone():
    base = _module("bf16")
    add_lora(base, 2)
    _randomize_lora_b(base)
    hybrid = _hybrid(base, list(range(E)))
    x, ids, w = _routing(5)
    got, want = _grads(hybrid, x, ids, w), _grads(base, x, ids, w)
    for a, b in zip(got, want):
        assert a.abs().sum() > 0 and rel_err(a, b) <= RTOL


# --------------------------------------------------------------------------------------------
# Changing the GPU experts, dtype/device, state_dict, repr
# --------------------------------------------------------------------------------------------


def test_set_change_and_clear():
    base = _module("bf16")
    m = copy.deepcopy(base)
    x, ids, w = _routing(7)
    with torch.no_grad():
        want = base(x, ids, w)
        for sel in (
            [3],
            torch.tensor([True] * 4 + [False] * 4),
            (0, 7),
            None,
            [],
            torch.tensor([], dtype=torch.long),
        ):
            m.set_gpu_experts(sel)
            assert rel_err(m(x, ids, w), want) <= RTOL
        assert m.num_gpu_experts == 0 and m.gpu_experts_mask is None
        assert torch.equal(m(x, ids, w), want)  # no GPU experts: the op alone


def test_to_dtype_moves_gpu_weights_not_packed():
    m = _module("int4", gpu_experts=[2, 4])
    packed = {n: t for n, t in m.named_buffers() if not n.startswith("gpu_")}
    m.to(torch.bfloat16)
    assert (
        m.gpu_gate_weight.dtype
        == m.gpu_up_weight.dtype
        == m.gpu_down_weight.dtype
        == torch.bfloat16
    )
    assert m.gpu_experts_mask.dtype == torch.bool and m.gpu_expert_ids.dtype == torch.long
    for n, t in m.named_buffers():
        if not n.startswith("gpu_"):
            assert t is packed[n]  # untouched: same tensor, same dtype
    x, ids, w = _routing(5)
    with torch.no_grad():
        out = m(x.bfloat16(), ids, w)
    assert out.dtype == torch.bfloat16
    m.half()
    assert m.gpu_down_weight.dtype == torch.float16
    # set_gpu_experts keeps the current dtype by default.
    m.set_gpu_experts([1])
    assert m.gpu_gate_weight.dtype == torch.float16


def test_device_follows_module():
    m = _module("bf16", gpu_experts=[0, 1])
    m.to("meta")  # a device other than the CPU, without a GPU
    assert m.gpu_gate_weight.device.type == "meta" and m.gpu_experts_mask.device.type == "meta"
    assert m.gate_weight.device.type == "cpu"
    x, ids, w = _routing(2)
    with pytest.raises(ValueError, match="hidden_states is on cpu but the GPU experts' weights"):
        m(x, ids, w)


def test_state_dict_has_no_gpu_buffers_and_reload_refreshes():
    plain = _module("int8")
    hybrid = _module("int8", gpu_experts=[1, 3])
    assert list(hybrid.state_dict()) == list(plain.state_dict())
    other = _module("int8", seed=5)
    hybrid.load_state_dict(other.state_dict())
    want = dequantize_weights(other.expert_weights().gate)[[1, 3]]
    assert torch.equal(hybrid.gpu_gate_weight, want)
    # and a hybrid state_dict loads into a plain module
    plain.load_state_dict(hybrid.state_dict())
    x = _routing(4)
    with kt_ops.use_quant_activations("fp32"), torch.no_grad():
        assert rel_err(hybrid(*x), other(*x)) <= RTOL


def test_extra_repr_and_deepcopy():
    m = _module("bf16", gpu_experts=[2, 3, 4], gpu_dtype=torch.bfloat16)
    assert "gpu_experts=3 (bfloat16, cpu)" in repr(m)
    assert "gpu_experts" not in repr(_module("bf16"))
    c = copy.deepcopy(m)
    assert c.num_gpu_experts == 3 and torch.equal(c.gpu_up_weight, m.gpu_up_weight)


def test_expert_list_indexing_on_hybrid():
    gate, up, down = _dense()
    plain = MoEExpertList.from_dense(gate, up, down)
    hybrid = MoEExpertList.from_dense(gate, up, down, gpu_experts=[0, 5])
    x = torch.randn(3, H)
    with torch.no_grad():
        for i in (0, 1, 5):
            assert rel_err(hybrid[i](x), plain[i](x)) <= RTOL


def test_compile_split():
    """gather: one graph (fullgraph, dynamic T); grouped: data-dependent sizes, graph breaks."""
    base = _module("bf16")
    hybrid = _hybrid(base, [1, 2, 3])
    hybrid.gpu_gather = True
    full = torch.compile(hybrid, fullgraph=True, dynamic=True, backend="eager")
    with torch.no_grad():
        for T in (5, 3):
            x, ids, w = _routing(T, seed=T)
            assert rel_err(full(x, ids, w), base(x, ids, w)) <= RTOL
    grouped = _hybrid(base, [1, 2, 3])
    compiled = torch.compile(grouped, backend="eager")
    x, ids, w = _routing(4)
    with torch.no_grad():
        assert rel_err(compiled(x, ids, w), base(x, ids, w)) <= RTOL


# --------------------------------------------------------------------------------------------
# Hot experts from routing counts
# --------------------------------------------------------------------------------------------


def test_hottest_experts_order_and_ties():
    counts = torch.tensor([5, 0, 9, 5, 1, 9, 0, 2])
    assert hottest_experts(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then 5 (tie: lower id)
    assert hottest_experts(counts, 0).tolist() == []
    assert hottest_experts(counts, E).tolist() == list(range(E))
    m = _module("bf16", gpu_experts=2, routing_counts=counts)
    assert m.gpu_expert_ids.tolist() == [2, 5]


def test_record_routing_counts_known_routing():
    from kt_ops.hf import record_routing

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = _module("bf16")

        def forward(self, x, ids, w):
            return self.experts(x, ids, w)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Block(), Block()])
    # Layer 0: expert e gets e hits; layer 1: expert 7 - e gets 2 e hits. -1 slots not counted.
    ids0 = torch.cat([torch.full((e,), e) for e in range(E)] + [torch.full((3,), -1)]).view(-1, 1)
    ids1 = torch.cat([torch.full((2 * e,), E - 1 - e) for e in range(E)]).view(-1, 1)
    with record_routing(model) as stats, torch.no_grad():
        for layer, ids in zip(model.layers, (ids0, ids1)):
            layer(torch.randn(ids.shape[0], H), ids, torch.ones(ids.shape))
    assert stats["layers.0.experts"].tolist() == list(range(E))
    assert stats["layers.1.experts"].tolist() == [2 * (E - 1 - e) for e in range(E)]
    assert stats.hottest("layers.0.experts", 2).tolist() == [6, 7]
    assert stats.hottest("layers.1.experts", 2).tolist() == [0, 1]
    # The hooks are gone after the block.
    assert all(not m._forward_pre_hooks for m in model.modules())


# --------------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(gpu_experts=torch.ones(E + 1, dtype=torch.bool)),
            r"gpu_experts as a bool mask must be \[E=8\]",
        ),
        (dict(gpu_experts=torch.ones(E, dtype=torch.float32)), "gpu_experts must be a bool mask"),
        (dict(gpu_experts=[0, 8]), r"gpu_experts has expert ids outside \[0, E=8\)"),
        (dict(gpu_experts=[-1]), r"gpu_experts has expert ids outside"),
        (dict(gpu_experts=[2, 2]), "gpu_experts has repeated expert ids"),
        (dict(gpu_experts=["a"]), "gpu_experts must be a bool mask"),
        (dict(gpu_experts=True), "gpu_experts must be a bool mask"),
        (dict(gpu_experts=3), "needs routing_counts"),
        (
            dict(gpu_experts=9, routing_counts=torch.ones(E)),
            r"gpu_experts as a count must be in \[0, E=8\]",
        ),
        (dict(gpu_experts=2, routing_counts=torch.ones(E + 1)), r"routing_counts must be \[E=8\]"),
        (
            dict(gpu_experts=[1], routing_counts=torch.ones(E)),
            "routing_counts is used only with an int",
        ),
        (dict(gpu_experts=[1], dtype=torch.int8), "dtype must be fp32, bf16 or fp16"),
        (dict(gpu_experts=[1], dense=(torch.ones(E, I, H + 1),) * 3), "dense must be floating"),
    ],
)
def test_bad_selection_is_refused(kwargs, message):
    m = _module("bf16", gpu_experts=[4])
    with pytest.raises(ValueError, match=message):
        m.set_gpu_experts(**kwargs)
    assert m.gpu_expert_ids.tolist() == [4]  # unchanged


def test_bad_forward_inputs():
    m = _module("bf16", gpu_experts=list(range(E)))  # all GPU: the op is not called
    x, ids, w = _routing(3)
    with pytest.raises(ValueError, match=r"top_k_index has expert ids outside \[-1, E=8\)"):
        m(x, torch.full_like(ids, E), w)
    with pytest.raises(ValueError, match="top_k_index must be int32 or int64"):
        m(x, ids.float(), w)
    with pytest.raises(ValueError, match=r"must both be \[T=3, K\]"):
        m(x, ids, w[:, :1])
    with pytest.raises(ValueError, match="hidden_states has last dimension"):
        m(x[:, :5], ids, w)


# --------------------------------------------------------------------------------------------
# CUDA (skipped on this project's CPU-only machines)
# --------------------------------------------------------------------------------------------


def cuda(test):
    """``@pytest.mark.cuda``, skipped without a CUDA device."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    return pytest.mark.cuda(skip(test))


def _cuda_bridge() -> bool:
    """Whether this build's ops take CUDA hidden states (the CUDA bridge, kt_ops.hybrid)."""
    import kt_ops.hybrid

    return kt_ops.hybrid.cuda_bridge_built()


@cuda
def test_cuda_all_gpu_experts_without_the_op():
    base = _module("bf16")
    hybrid = _hybrid(base, list(range(E))).cuda()
    assert hybrid.gpu_gate_weight.is_cuda and not hybrid.gate_weight.is_cuda
    x, ids, w = _routing(7)
    with torch.no_grad():
        got = hybrid(x.cuda(), ids.cuda(), w.cuda())
        assert got.is_cuda
        assert rel_err(got.cpu(), base(x, ids, w)) <= 1e-3  # cuBLAS fp32 (TF32 off by default)


@cuda
@pytest.mark.parametrize("T", [1, 7])
def test_cuda_split_through_the_bridge(T):
    if not _cuda_bridge():
        pytest.skip("this kt_ops build has no CUDA bridge (kt_ops.hybrid.cuda_bridge_built())")
    base = _module("bf16")
    add_lora(base, 2)
    _randomize_lora_b(base)
    hybrid = _hybrid(base, [0, 3, 5]).cuda()
    x, ids, w = _routing(T)
    got = _grads(hybrid, x.cuda(), ids.cuda(), w.cuda())
    want = _grads(base, x, ids, w)
    for a, b in zip(got, want):
        assert b.abs().sum() > 0 and rel_err(a.cpu(), b) <= 1e-3


# --------------------------------------------------------------------------------------------
# Hugging Face models: calibration, replace_experts, set_gpu_experts, the demo
# --------------------------------------------------------------------------------------------


@pytest.fixture
def hf(monkeypatch):
    """transformers (skipped without it), offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return pytest.importorskip("transformers")


def _tiny(arch="qwen3_moe", dtype=torch.float32):
    from lora_helpers import tiny_model

    return tiny_model(arch).to(dtype)


def _hf_logits(model, input_ids=None):
    from lora_helpers import INPUT_IDS

    with torch.no_grad():
        return model(input_ids=INPUT_IDS if input_ids is None else input_ids).logits.float()


@pytest.mark.parametrize(
    "arch, dtype, rtol",
    [
        ("qwen3_moe", torch.float32, 1e-4),
        ("mixtral", torch.float32, 1e-4),
        # bf16 model: the reference rounds every op to bf16, the op only its output (test_hf).
        ("qwen3_moe", torch.bfloat16, 5e-2),
    ],
)
def test_replace_experts_with_hot_experts(hf, arch, dtype, rtol):
    from lora_helpers import INPUT_IDS

    from kt_ops.hf import collect_routing_stats, replace_experts

    model = _tiny(arch, dtype)
    want = _hf_logits(model)
    stats = collect_routing_stats(model, input_ids=INPUT_IDS)
    tiny_k = model.config.num_experts_per_tok
    assert len(stats.counts) == 2
    for counts in stats.counts.values():
        assert int(counts.sum()) == INPUT_IDS.numel() * tiny_k  # every (token, slot) counted
    hybrid = replace_experts(copy.deepcopy(model), num_gpu_experts=3, routing_stats=stats)
    for name in stats.counts:
        m = hybrid.get_submodule(name)
        assert isinstance(m, MoEExperts) and m.num_gpu_experts == 3
        assert m.gpu_expert_ids.tolist() == stats.hottest(name, 3).tolist()
        assert m.gpu_gate_weight.dtype == dtype  # the model's own weights, in its dtype
    assert rel_err(_hf_logits(hybrid), want) <= rtol
    # The same counts are seen after replacement (same module names, same routing).
    again = collect_routing_stats(hybrid, input_ids=INPUT_IDS)
    assert {n: c.tolist() for n, c in again.counts.items()} == {
        n: c.tolist() for n, c in stats.counts.items()
    }


def test_module_list_experts_calibrate_and_split(hf):
    from lora_helpers import INPUT_IDS

    from kt_ops.hf import collect_routing_stats, replace_experts
    from kt_ops.lora import unfuse_experts

    model = _tiny()
    fused_stats = collect_routing_stats(model, input_ids=INPUT_IDS)
    unfuse_experts(model)  # nn.ModuleList of expert MLPs: counted per expert call
    stats = collect_routing_stats(model, input_ids=INPUT_IDS)
    assert {n: c.tolist() for n, c in stats.counts.items()} == {
        n: c.tolist() for n, c in fused_stats.counts.items()
    }
    want = _hf_logits(model)
    name = next(iter(stats.counts))
    replace_experts(model, gpu_experts={name: [0, 5]})
    assert model.get_submodule(name).gpu_expert_ids.tolist() == [0, 5]
    assert isinstance(model.get_submodule(name), MoEExpertList)
    other = [n for n in stats.counts if n != name]
    assert all(model.get_submodule(n).num_gpu_experts == 0 for n in other)
    assert rel_err(_hf_logits(model), want) <= 1e-4


def test_model_level_set_gpu_experts_quantized(hf):
    from lora_helpers import INPUT_IDS

    from kt_ops.hf import collect_routing_stats, replace_experts, set_gpu_experts

    model = _tiny()
    stats = collect_routing_stats(model, input_ids=INPUT_IDS)
    replace_experts(model, "int4", group_size=32)
    with kt_ops.use_quant_activations("fp32"):
        want = _hf_logits(model)
        set_gpu_experts(model, 4, stats, dtype=torch.float32)
        assert all(m.num_gpu_experts == 4 for m in model.modules() if isinstance(m, MoEExperts))
        assert rel_err(_hf_logits(model), want) <= 1e-4
        set_gpu_experts(model, gpu_experts=torch.ones(8, dtype=torch.bool))
        assert rel_err(_hf_logits(model), want) <= 1e-4
        set_gpu_experts(model, 0)
        assert all(m.num_gpu_experts == 0 for m in model.modules() if isinstance(m, MoEExperts))
        assert torch.equal(_hf_logits(model), want)


def test_hybrid_lora_training_matches(hf):
    from lora_helpers import INPUT_IDS, lm_loss, randomize_lora_b_

    from kt_ops.hf import collect_routing_stats, set_gpu_experts
    from kt_ops.lora import apply_lora, lora_parameters

    model = _tiny()
    stats = collect_routing_stats(model, input_ids=INPUT_IDS)
    kt_ops.replace_experts(model)
    torch.manual_seed(0)
    apply_lora(model, rank=4)
    randomize_lora_b_(model)
    hybrid = set_gpu_experts(copy.deepcopy(model), 3, stats)

    def grads(m):
        m.zero_grad()
        loss = lm_loss(m)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in lora_parameters(m)}

    loss, g = grads(model)
    loss_h, g_h = grads(hybrid)
    assert rel_err(loss_h, loss) <= 1e-5
    assert g.keys() == g_h.keys() and g
    for n in g:
        assert rel_err(g_h[n], g[n]) <= 1e-4, n


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_gpu_experts=2), "needs routing_stats"),
        (dict(num_gpu_experts=-1), "num_gpu_experts must be >= 0"),
        (dict(num_gpu_experts=2.0), "num_gpu_experts must be an int"),
        (dict(num_gpu_experts=2, routing_stats={}), "routing_stats has no counts for"),
        (dict(num_gpu_experts=2, routing_stats=[1]), "routing_stats must be a"),
        (dict(num_gpu_experts=9, routing_stats="stats"), r"gpu_experts as a count must be in"),
        (dict(num_gpu_experts=2, routing_stats="stats", gpu_experts=[1]), "not both"),
        (dict(gpu_experts=[1, 1]), "repeated expert ids"),
    ],
)
def test_replace_experts_bad_gpu_arguments_leave_model_untouched(hf, kwargs, message):
    from lora_helpers import INPUT_IDS

    from kt_ops.hf import collect_routing_stats, replace_experts

    model = _tiny()
    if kwargs.get("routing_stats") == "stats":
        kwargs["routing_stats"] = collect_routing_stats(model, input_ids=INPUT_IDS)
    with pytest.raises(ValueError, match=message):
        replace_experts(model, **kwargs)
    assert not any(isinstance(m, MoEExperts) for m in model.modules())


def test_set_gpu_experts_needs_replaced_model(hf):
    from kt_ops.hf import set_gpu_experts

    with pytest.raises(ValueError, match="call kt_ops.replace_experts"):
        set_gpu_experts(_tiny(), gpu_experts=[0])


DEMO_TINY = [
    "--hidden-size", "64", "--moe-intermediate-size", "32", "--num-experts", "8", "--top-k", "2",
    "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16", "--vocab-size", "128",
    "--prompt-tokens", "6", "--new-tokens", "4", "--layers", "2", "--init-std", "0.2",
    "--warmup", "0",
]  # fmt: skip


def test_demo_gpu_experts_on_cpu(hf, capsys):
    from kt_ops import demo

    result = demo.run([*DEMO_TINY, "--gpu-experts", "3"])
    out = capsys.readouterr().out
    assert result.ok and result.gpu_experts == 3 and 0 < result.gpu_share < 1
    assert "hybrid: 3/8 experts per layer GPU-resident" in out and "verdict    : PASS" in out
    with pytest.raises(ValueError, match=r"--gpu-experts must be in \[0, --num-experts=8\]"):
        demo.run([*DEMO_TINY, "--gpu-experts", "9"], quiet=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_demo_device_cuda_without_gpu_says_so(hf, capsys):
    from kt_ops import demo

    assert demo.main([*DEMO_TINY, "--device", "cuda"]) == demo.NO_CUDA_STATUS == 2
    err = capsys.readouterr().err
    assert "--device cuda: no CUDA device is present" in err and "Nothing was run" in err


@cuda
def test_demo_device_cuda(hf):
    from kt_ops import demo

    if not _cuda_bridge():
        pytest.skip("this kt_ops build has no CUDA bridge (kt_ops.hybrid.cuda_bridge_built())")
    result = demo.run([*DEMO_TINY, "--device", "cuda", "--gpu-experts", "2"], quiet=True)
    assert result.ok and result.device == "cuda"


def test_replace_experts_converted_dir_dequantizes_hot_experts(hf, tmp_path):
    from lora_helpers import INPUT_IDS

    from kt_ops.convert import convert
    from kt_ops.hf import collect_routing_stats, replace_experts

    model = _tiny()
    model.save_pretrained(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "out", "int8", progress=False)
    stats = collect_routing_stats(model, input_ids=INPUT_IDS)
    plain = replace_experts(copy.deepcopy(model), converted_dir=str(tmp_path / "out"))
    hybrid = replace_experts(
        model,  # fp32: the dequantized copies in fp32
        converted_dir=str(tmp_path / "out"),
        num_gpu_experts=2,
        routing_stats=stats,
    )
    for name in stats.counts:
        m = hybrid.get_submodule(name)
        assert m.gpu_gate_weight.dtype == torch.float32
        want = dequantize_weights(m.expert_weights().down)[stats.hottest(name, 2)]
        assert torch.equal(m.gpu_down_weight, want)
    with kt_ops.use_quant_activations("fp32"):
        assert rel_err(_hf_logits(hybrid), _hf_logits(plain)) <= 1e-4


@cuda
def test_cuda_graph_capture_of_a_hybrid_layer():
    """Decode (T = 1) captured in a CUDA graph: the op on the side stream, the GPU experts
    gathered per slot (no sync); replays with new inputs match eager calls."""
    if not _cuda_bridge():
        pytest.skip("this kt_ops build has no CUDA bridge (kt_ops.hybrid.cuda_bridge_built())")
    import kt_ops.hybrid

    base = _module("int4")
    hybrid = _hybrid(base, [0, 3, 5]).cuda()
    x, ids, w = (t.cuda() for t in _routing(1))
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            hybrid(x, ids, w)  # warm-up (creates the module's side stream too)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = hybrid(x, ids, w)
        for seed in range(5):
            nx, nids, nw = (t.cuda() for t in _routing(1, seed=10 + seed))
            x.copy_(nx), ids.copy_(nids), w.copy_(nw)
            graph.replay()
            torch.cuda.synchronize()
            assert rel_err(out.cpu(), hybrid(nx, nids, nw).cpu()) <= 1e-5
    del graph
    kt_ops.hybrid.release_graph_staging()


def test_gpu_share_ignores_ids_outside_the_experts():
    """The GPU experts' share indexes no slot for an id outside [0, E) (on CUDA that index
    would be a device-side assert, ending the context): it skips them, and the call
    raises the op's error naming topk_ids."""
    h = _hybrid(_module("bf16"), [1, 2, 6])
    x, ids, w = _routing(3)
    bad = ids.clone()
    bad[1, 0] = E + 3
    share = h._gpu_experts(x, bad, w)
    skipped = ids.clone()
    skipped[1, 0] = -1
    assert torch.equal(share, h._gpu_experts(x, skipped, w))
    with pytest.raises(RuntimeError, match=r"topk_ids must lie in \[-1, 8\)"):
        h(x, bad, w)
