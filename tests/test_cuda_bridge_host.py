"""The CPU/GPU bridge's host side, on machines without a GPU.

``csrc/hybrid/bridge.cpp`` runs the kt:: ops on device tensors as copy-in,
host function, copy-out on a stream. Everything above the device runtime
(staging layout, the staging pool, the parse over staged views, the host
function, outputs, the deferred id-range error, capture and replay) is driven
here through ``kt_ops._C._testing.HostBridge``, a transport whose "device" is host
memory: memcpy for the copies, a direct call for the host function, and, with
``capture=True``, recorded steps that ``replay()`` runs again (as a CUDA graph
replays its memcpy and host nodes). Each result must be bit-identical to the
CPU op on the same inputs: the bridge runs the same driver on a copy.
The CUDA transport itself runs in tests/test_cuda_bridge.py (GPU only).
"""

# ruff: noqa: E741

from __future__ import annotations

import pytest
import torch

import kt_ops
import kt_ops.hybrid
import kt_ops.ops
from kt_ops import _C
from kt_ops.layer import ExpertWeights, LoRAWeights, layer_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E, H, I, K = 8, 256, 256, 3


def _experts(fmt: str, seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    dense = [torch.randn(E, I, H, generator=g) * 0.1, torch.randn(E, I, H, generator=g) * 0.1]
    return ExpertWeights.from_dense(*dense, torch.randn(E, H, I, generator=g) * 0.1, fmt)


def _routing(T: int, seed: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.randint(-1, E, (T, K), generator=g)
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def _lora(rank: int = 4) -> LoRAWeights:
    g = torch.Generator().manual_seed(3)

    def f(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    return LoRAWeights(up=(f(E, rank, H), f(E, I, rank)), down=(f(E, rank, I), f(E, H, rank)))


def _args(experts, lora=None, mask=None, like=None):
    weights, fmt, sizes, gs, lora_list, scaling, activation, mask = layer_args(
        experts, lora, "silu", like, mask
    )
    return [weights, fmt, sizes, gs, lora_list, scaling, activation, mask]


FORMATS = ["bf16", "int8", "int4", "q4_k,q4_k,q6_k", "fp8"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [0, 1, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_forward_matches_cpu_op(fmt, T, dtype):
    experts = _experts(fmt)
    x, ids, w = _routing(T, dtype=dtype)
    got = _C._testing.HostBridge().moe_forward(x, ids, w, *_args(experts, like=x), None)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, kt_ops.moe_forward(x, ids, w, experts))


@pytest.mark.parametrize("caller_waits", [True, False])
def test_host_function_with_a_waiting_or_computing_caller(caller_waits):
    """The host function leaves the compute to the pool's workers by default
    (runtime::CallerWaitsScope); either way the result is the CPU op's."""
    experts = _experts("int4")
    x, ids, w = _routing(40)
    lora = _lora()
    before = _C._testing.bridge_caller_waits(caller_waits)
    try:
        bridge = _C._testing.HostBridge()
        got = bridge.moe_forward(x, ids, w, *_args(experts, like=x), None)
        got_lora = bridge.moe_forward(x, ids, w, *_args(experts, lora, None, x), None)
    finally:
        assert _C._testing.bridge_caller_waits(before) is caller_waits
    assert before is True  # the default
    assert torch.equal(got, kt_ops.moe_forward(x, ids, w, experts))
    assert torch.equal(got_lora, kt_ops.moe_forward(x, ids, w, experts, lora))


def test_eager_forward_mask_lora_and_out():
    experts = _experts("int8")
    x, ids, w = _routing(7)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[1, 5]] = True
    lora = _lora()
    bridge = _C._testing.HostBridge()
    got = bridge.moe_forward(x, ids, w, *_args(experts, lora, mask, x), None)
    want = kt_ops.moe_forward(x, ids, w, experts, lora, gpu_experts_mask=mask)
    assert torch.equal(got, want)
    out = torch.full_like(x, float("nan"))
    assert bridge.moe_forward(x, ids, w, *_args(experts, like=x), out) is not None
    assert torch.equal(out, kt_ops.moe_forward(x, ids, w, experts))


def test_training_and_backward_match_cpu_ops():
    experts = _experts("int4")
    x, ids, w = _routing(6)
    lora = _lora()
    mask = torch.zeros(E, dtype=torch.bool)
    mask[2] = True
    bridge = _C._testing.HostBridge()
    args = _args(experts, lora, mask, x)
    got = bridge.moe_forward_train(x, ids, w, *args)
    want = kt_ops.ops.moe_forward_train(x, ids, w, experts, lora, gpu_experts_mask=mask)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    gy = torch.randn_like(x)
    for pre in (None, got[1:]):
        for compute_gx in (True, False):
            gp, up = pre if pre is not None else (None, None)
            gx, gw, gl = bridge.moe_backward(gy, x, ids, w, *args, gp, up, compute_gx)
            rx, rw, rl = torch.ops.kt.moe_backward.default(
                gy, x, ids, w, *args, gate_pre=gp, up_pre=up,
                compute_grad_hidden_states=compute_gx,
            )  # fmt: skip
            assert torch.equal(gx, rx) and torch.equal(gw, rw)
            assert len(gl) == len(rl) == 6
            for a, b in zip(gl, rl):
                assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_capture_records_and_replays_with_stable_staging():
    """Two layers captured into one "graph"; replays see the inputs' current contents."""
    kt_ops.hybrid.release_graph_staging()
    layers = [_experts("int8", seed=0), _experts("q4_k,q4_k,q6_k", seed=1)]
    x, ids, w = _routing(4)
    static_x, static_ids, static_w = x.clone(), ids.clone(), w.clone()
    outs = [torch.full_like(x, float("nan")) for _ in layers]
    graph = _C._testing.HostBridge(capture=True)
    h = static_x
    for experts, out in zip(layers, outs):
        graph.moe_forward(h, static_ids, static_w, *_args(experts, like=x), out)
        h = out  # layer 2 reads layer 1's output, as in a model
    stats = kt_ops.hybrid.staging_stats()
    assert stats["captured_blocks"] == 2 and stats["captured_bytes"] > 0
    # Capture records; nothing ran yet.
    assert all(torch.isnan(o).all() for o in outs)

    def eager(x, ids, w):
        y = kt_ops.moe_forward(x, ids, w, layers[0])
        return y, kt_ops.moe_forward(y, ids, w, layers[1])

    for step in range(20):
        new_x, new_ids, new_w = _routing(4, seed=10 + step)
        static_x.copy_(new_x)
        static_ids.copy_(new_ids)
        static_w.copy_(new_w)
        assert graph.replay() == 2 * 5  # per call: 3 copies in, the host function, 1 copy out
        want = eager(new_x, new_ids, new_w)
        assert torch.equal(outs[0], want[0]) and torch.equal(outs[1], want[1])
    kt_ops.hybrid.release_graph_staging()
    assert kt_ops.hybrid.staging_stats()["captured_blocks"] == 0


def test_eager_staging_is_reused_and_grows():
    experts = _experts("int8")
    bridge = _C._testing.HostBridge()
    bridge.moe_forward(*_routing(1), *_args(experts, like=torch.empty(0)), None)
    before = kt_ops.hybrid.staging_stats()
    for _ in range(5):
        bridge.moe_forward(*_routing(1), *_args(experts, like=torch.empty(0)), None)
    assert kt_ops.hybrid.staging_stats()["eager_bytes"] == before["eager_bytes"]
    big = _routing(300)
    bridge.moe_forward(*big, *_args(experts, like=torch.empty(0)), None)
    after = kt_ops.hybrid.staging_stats()
    assert after["eager_bytes"] > before["eager_bytes"]
    assert after["eager_blocks"] == before["eager_blocks"]  # one block per stream


def test_out_of_range_id_is_deferred_and_outputs_are_nan():
    experts = _experts("int8")
    x, ids, w = _routing(3)
    ids[1, 2] = E  # out of range: found only when the host function reads the ids
    bridge = _C._testing.HostBridge()
    kt_ops.hybrid.take_bridge_error()
    out = bridge.moe_forward(x, ids, w, *_args(experts, like=x), None)
    assert torch.isnan(out).all()
    with pytest.raises(
        RuntimeError, match=r"earlier kt_ops call .* failed in its CPU part.*topk_ids"
    ):
        bridge.moe_forward(*_routing(2), *_args(experts, like=x), None)
    # Raised once: the next call runs.
    ok = bridge.moe_forward(*_routing(2), *_args(experts, like=x), None)
    assert torch.isfinite(ok).all()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.__setitem__(1, a[1].int().float()), "topk_ids must be int32 or int64"),
        (lambda a: a.__setitem__(0, a[0][:, :-1]), "hidden_states has 255 columns"),
        (lambda a: a.__setitem__(2, a[2][:1]), "topk_weights must have the shape"),
        (lambda a: a.__setitem__(4, "int9"), "not a kt_ops format"),
    ],
)
def test_bad_arguments_raise_before_anything_runs(mutate, message):
    experts = _experts("int8")
    x, ids, w = _routing(3)
    a = [x, ids, w, *_args(experts, like=x)]
    mutate(a)
    with pytest.raises(RuntimeError, match=message):
        _C._testing.HostBridge().moe_forward(*a, None)
    assert kt_ops.hybrid.take_bridge_error() is None


def test_fake_kernels_take_cuda_activations_with_cpu_weights():
    """torch.compile's view of the bridge, without a GPU: fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    experts = _experts("int8")
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(3, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.zeros(3, K, dtype=torch.long, device="cuda")
        w = torch.ones(3, K, device="cuda")
        mask = torch.zeros(E, dtype=torch.bool, device="cuda")
        y = torch.ops.kt.moe_forward(x, ids, w, *_args(experts, mask=mask, like=x))
        assert (y.device.type, y.shape, y.dtype) == ("cuda", x.shape, x.dtype)
        out, gate_pre, up_pre = torch.ops.kt.moe_forward_train(x, ids, w, *_args(experts, like=x))
        assert gate_pre.device.type == "cuda" and gate_pre.shape == (3 * K, I)
        gx, gw, _ = torch.ops.kt.moe_backward(y, x, ids, w, *_args(experts, like=x))
        assert gx.device.type == "cuda" and gw.shape == w.shape
        with pytest.raises(RuntimeError, match="topk_ids is on cpu but must be on cuda"):
            torch.ops.kt.moe_forward(x, ids.cpu(), w, *_args(experts, like=x))
        with pytest.raises(RuntimeError, match="gpu_experts_mask is on cpu but must be on cuda"):
            torch.ops.kt.moe_forward(x, ids, w, *_args(experts, mask=mask.cpu(), like=x))
        cuda_weight = experts.gate.weight.to("meta")
        bad = _args(experts, like=x)
        bad[0] = [cuda_weight, *bad[0][1:]]
        with pytest.raises(RuntimeError, match="gate_weight is on meta but must be on cpu"):
            torch.ops.kt.moe_forward(x, ids, w, *bad)
