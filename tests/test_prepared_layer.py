"""kt::moe_forward_prepared: the eager inference path of MoEExperts, moe_forward, the wrapper.

Under ``no_grad`` without LoRA, ``MoEExperts`` computes through a layer parsed
once (``torch.classes.kt.PreparedLayer``, csrc/ops/prepared_layer.cpp) and the
op ``kt::moe_forward_prepared`` instead of ``kt::moe_forward``. It must give
the op's output bit for bit; it is a real dispatcher op, so dispatch modes and
the profiler see it; and ``kt_ops.ops.PreparedLayer.forward`` steps aside
(returns None, so the caller's full path runs) for grad mode, tensor
subclasses, other devices and errors (which the full path then raises with its
own type and message); the module makes a new one for replaced buffers or
another activation, and none with LoRA or GPU experts. ``opcheck`` and
``torch.compile(fullgraph=True)`` run on the op.
"""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch
from reference import make_hidden, make_routing
from torch.utils._python_dispatch import TorchDispatchMode

import kt_ops
from kt_ops.nn import MoEExperts
from kt_ops.ops import PreparedLayer, moe_forward_prepared, new_prepared_layer

E, H, I = 8, 96, 160  # noqa: E741  (multiples of 32 for int4 g32, not of 64)


@pytest.fixture(scope="module")
def dense():
    g = torch.Generator().manual_seed(3)
    return (
        torch.randn(E, I, H, generator=g) / H**0.5,
        torch.randn(E, I, H, generator=g) / H**0.5,
        torch.randn(E, H, I, generator=g) / I**0.5,
    )


def _module(dense, fmt="bf16", group_size=None) -> MoEExperts:
    m = MoEExperts.from_dense(*dense, fmt, group_size=group_size).eval()
    with torch.no_grad():
        x = make_hidden(1, m.hidden_size, torch.float32)
        ids, w = make_routing(1, E, 2)
        m(x, ids, w)  # builds the prepared layer
    assert isinstance(m.__dict__["_prepared_layer"][0], PreparedLayer)
    return m


def _prepared(m: MoEExperts) -> PreparedLayer:
    return m.__dict__["_prepared_layer"][0]


def _op(m: MoEExperts, x, ids, w):
    return torch.ops.kt.moe_forward.default(x, ids, w, *m._plain_layer_args())


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "fmt,group", [("bf16", None), ("int8", None), ("int4", 32), ("q4_k", None)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("T", [0, 1, 5])
def test_bit_identical_to_the_op(dense, fmt, group, dtype, T):
    if fmt == "q4_k":  # k-quants: K a multiple of 256 (H = 256, I = 256 + 16)
        g = torch.Generator().manual_seed(4)
        dense = (
            torch.randn(E, 272, 256, generator=g) / 16,
            torch.randn(E, 272, 256, generator=g) / 16,
            torch.randn(E, 256, 272, generator=g) / 16,
        )
        dense = (dense[0][:, :256], dense[1][:, :256], dense[2][:, :, :256])
    m = _module(dense, fmt, group)
    hidden = m.hidden_size
    prepared = _prepared(m)
    x = make_hidden(T, hidden, dtype, seed=T)
    ids, w = make_routing(T, E, 3, seed=T, skip_fraction=0.2)
    with torch.no_grad():
        fast = prepared.forward(x, ids, w)
        via_module = m(x, ids, w)
        want = _op(m, x, ids, w)
    assert fast is not None and fast.dtype == dtype and fast.shape == (T, hidden)
    assert torch.equal(fast, want)
    assert torch.equal(via_module, want)
    assert torch.equal(moe_forward_prepared(prepared.layer, x, ids, w), want)


def test_steps_aside_where_only_the_full_path_will_do(dense):
    m = _module(dense, "int8")
    prepared = _prepared(m)
    x = make_hidden(3, H, torch.float32)
    ids, w = make_routing(3, E, 2)
    with torch.no_grad():
        assert prepared.forward(x, ids, w) is not None
        # a tensor subclass (its __torch_function__ / __torch_dispatch__ must run)
        sub = x.as_subclass(type("Sub", (torch.Tensor,), {}))
        assert prepared.forward(sub, ids, w) is None
        # another device
        assert prepared.forward(x.to("meta"), ids, w) is None
        # errors: the caller's full path raises them
        assert prepared.forward(x, torch.full_like(ids, E), w) is None
        assert prepared.forward(x[:, :-1], ids, w) is None
        assert prepared.forward(x, ids.float(), w) is None
        # autocast: the op runs (no autocast rule: the inputs as they are)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(prepared.forward(x, ids, w), _op(m, x, ids, w))
    # grad mode
    assert prepared.forward(x, ids, w) is None


def test_a_torch_function_mode_sees_the_op(dense):
    """The fast entry skips only torch.ops' __torch_function__ layer: with a function mode
    active the full path runs, and the mode sees kt.moe_forward."""
    from torch.overrides import TorchFunctionMode

    class Log(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.funcs: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.funcs.append(str(func))
            return func(*args, **(kwargs or {}))

    m = _module(dense, "int8")
    x = make_hidden(3, H, torch.float32)
    ids, w = make_routing(3, E, 2)
    with torch.no_grad():
        want = _op(m, x, ids, w)
        assert _prepared(m).forward(x, ids, w) is not None
        with Log() as log:
            assert _prepared(m).forward(x, ids, w) is None
            assert torch.equal(m(x, ids, w), want)
    assert any("kt.moe_forward" in f for f in log.funcs), log.funcs


def test_the_op_refuses_autograd(dense):
    m = _module(dense, "int8")
    x = make_hidden(3, H, torch.float32).requires_grad_()
    ids, w = make_routing(3, E, 2)
    with pytest.raises(RuntimeError, match="moe_forward_prepared: hidden_states or topk_weights"):
        moe_forward_prepared(_prepared(m).layer, x, ids, w)
    with torch.no_grad():  # the same tensors without grad mode
        assert torch.equal(moe_forward_prepared(_prepared(m).layer, x, ids, w), _op(m, x, ids, w))


def test_opcheck_and_compile(dense):
    m = _module(dense, "int8")
    layer = _prepared(m).layer
    x = make_hidden(4, H, torch.float32)
    ids, w = make_routing(4, E, 2)
    with torch.no_grad():
        torch.library.opcheck(torch.ops.kt.moe_forward_prepared.default, (layer, x, ids, w))
    if not hasattr(torch._library, "register_fake_class"):
        pytest.skip("this torch has no fake script classes (torch.compile needs them)")
    with torch.no_grad():
        want = _op(m, x, ids, w)
        f = torch.compile(
            lambda x, ids, w: moe_forward_prepared(layer, x, ids, w) * 2,
            fullgraph=True,
            dynamic=True,
            backend="aot_eager",  # the fake class and fake kernel, through AOTAutograd
        )
        assert torch.equal(f(x, ids, w), want * 2)
        assert torch.equal(moe_forward_prepared(copy.deepcopy(layer), x, ids, w), want)


def test_module_rebuilds_after_a_replaced_buffer_and_steps_aside_for_lora(dense):
    m = _module(dense, "bf16")
    first = _prepared(m)
    x = make_hidden(2, H, torch.float32)
    ids, w = make_routing(2, E, 2)
    other = MoEExperts.from_dense(*(t.flip(0) for t in dense))
    m.up_weight = other.up_weight
    with torch.no_grad():
        out = m(x, ids, w)
    assert _prepared(m) is not first
    assert torch.equal(out, _op(m, x, ids, w))
    m.add_lora(2, alpha=2)
    with torch.no_grad():
        m.up_lora_b.normal_()
        assert not m._layer_unchanged(m.__dict__["_prepared_layer"][1])
        adapted = m(x, ids, w)
    assert not torch.equal(adapted, out)


def test_module_forward_tries_the_prepared_layer_first(dense, monkeypatch):
    m = _module(dense, "int8")
    x = make_hidden(3, H, torch.bfloat16)
    ids, w = make_routing(3, E, 2)
    with torch.no_grad():
        want = _op(m, x, ids, w)
        # Routing weights of a third dtype: forward converts them to fp32, the op too.
        w16 = w.half()
        want16 = _op(m, x, ids, w16.float())
        # [T, H] hidden states: none of forward's Python after the prepared layer runs
        monkeypatch.setattr(m, "_cpu_experts", lambda *a, **k: pytest.fail("not the fast path"))
        assert torch.equal(m(x, ids, w), want)
        assert torch.equal(m(x, ids, w16), want16)
        # [..., H] hidden states take the full path (reshaped there)
        with pytest.raises(pytest.fail.Exception, match="not the fast path"):
            m(x.view(1, 3, H), ids.view(1, 3, -1), w.view(1, 3, -1))
        monkeypatch.undo()
        # A None from the prepared layer (here an error) goes on to the usual checks.
        with pytest.raises(ValueError, match="last dimension"):
            m(x[:, :-1], ids, w)
        with pytest.raises(RuntimeError, match="topk_ids must lie in"):
            m(x, torch.full_like(ids, E), w)


def test_prepared_layer_steps_aside_for_gpu_experts(dense):
    m = _module(dense, "bf16")
    made_from = m.__dict__["_prepared_layer"][1]
    x = make_hidden(4, H, torch.float32)
    ids, w = make_routing(4, E, 3)
    with torch.no_grad():
        all_cpu = m(x, ids, w)
        m.set_gpu_experts([1, 4], dense=dense)  # on the CPU here: dense torch experts
        assert not m._layer_unchanged(made_from)
        hybrid = m(x, ids, w)
        cpu_part = _op(m, x, ids, w)  # every expert on the CPU path, no mask
    # Experts 1 and 4 now come from the dense fp32 weights, not the packed bf16 ones.
    assert not torch.equal(hybrid, all_cpu)
    assert torch.equal(cpu_part, all_cpu)


def test_dispatch_mode_and_profiler_see_the_op(dense):
    m = _module(dense, "int8")
    x = make_hidden(2, H, torch.float32)
    ids, w = make_routing(2, E, 2)
    with torch.no_grad():
        want = _op(m, x, ids, w)
        with _OpLog() as log:
            assert torch.equal(m(x, ids, w), want)
        assert "kt.moe_forward_prepared.default" in log.ops
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            m(x, ids, w)
    assert any(e.name == "kt::moe_forward_prepared" for e in prof.events())


def test_errors_under_no_grad_are_the_ops(dense):
    m = _module(dense, "int8")
    x = make_hidden(2, H, torch.float32)
    ids, w = make_routing(2, E, 2)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="topk_ids must lie in"):
            m(x, torch.full_like(ids, E), w)
        with pytest.raises(RuntimeError, match="topk_ids must be int32 or int64"):
            m(x, ids.to(torch.int16), w)
        with pytest.raises(RuntimeError, match="topk_weights must have the shape"):
            m(x, ids, w[:, :1])
        assert torch.equal(m(x, ids, w), _op(m, x, ids, w))  # still usable


def test_constructor_checks_the_layer(dense):
    m = _module(dense, "int8")
    weights, fmt, sizes, groups = m._plain_layer_args()[:4]

    def make(*args):
        return torch.classes.kt.PreparedLayer(*args)

    with pytest.raises(RuntimeError, match="sizes must be"):
        make(weights, fmt, [H], groups, "silu", None, 0)
    with pytest.raises(RuntimeError, match="not a kt_ops format"):
        make(weights, "int9", sizes, groups, "silu", None, 0)
    with pytest.raises(RuntimeError, match="weights must hold 9 entries"):
        make(weights[:8], fmt, sizes, groups, "silu", None, 0)
    with pytest.raises(RuntimeError, match="activation='tanh' is not supported"):
        make(weights, fmt, sizes, groups, "tanh", None, 0)
    assert new_prepared_layer(m.expert_weights(), activation="tanh") is None


def test_top_k_and_mask(dense):
    m = _module(dense, "int8")
    experts = m.expert_weights()
    mask = torch.zeros(E, dtype=torch.bool)
    prepared = new_prepared_layer(experts, mask, top_k=2)
    x = make_hidden(3, H, torch.float32)
    ids, w = make_routing(3, E, 2)
    with torch.no_grad():
        assert torch.equal(prepared.forward(x, ids, w), _op(m, x, ids, w))
        mask[ids[0, 0]] = True  # read live
        want = kt_ops.moe_forward(x, ids, w, experts, gpu_experts_mask=mask)
        assert torch.equal(prepared.forward(x, ids, w), want)
        ids3, w3 = make_routing(3, E, 3)
        assert prepared.forward(x, ids3, w3) is None
        with pytest.raises(RuntimeError, match="prepared for top_k=2"):
            moe_forward_prepared(prepared.layer, x, ids3, w3)


def test_copy_and_pickle_after_calls(dense):
    m = _module(dense, "int8")
    x = make_hidden(2, H, torch.float32)
    ids, w = make_routing(2, E, 2)
    with torch.no_grad():
        want = m(x, ids, w)
        clone = copy.deepcopy(m)
        assert "_prepared_layer" not in clone.__dict__
        assert torch.equal(clone(x, ids, w), want)
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert torch.equal(loaded(x, ids, w), want)
    assert torch.equal(m.gate_weight, clone.gate_weight)
    assert clone.gate_weight.data_ptr() != m.gate_weight.data_ptr()


def test_concurrent_python_threads(dense):
    # forward() releases the GIL like a torch.ops call; calls from several
    # Python threads take turns on the pool and each gets its own result.
    m = _module(dense, "int8")
    inputs = [
        (make_hidden(4, H, torch.float32, seed=s), *make_routing(4, E, 2, seed=s)) for s in range(4)
    ]
    with torch.no_grad():
        want = [_op(m, *a) for a in inputs]
    got: dict[int, list[torch.Tensor]] = {i: [] for i in range(4)}

    def work(i):
        with torch.no_grad():
            for _ in range(20):
                got[i].append(m(*inputs[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert len(got[i]) == 20 and all(torch.equal(y, want[i]) for y in got[i])


# ---------------------------------------------------------------------- kt_ops.moe_forward


@pytest.mark.parametrize("fmt,group", [("bf16", None), ("int8", None), ("int4", 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T", [0, 1, 5])
def test_functional_wrapper_inference_matches_the_op(dense, fmt, group, dtype, T):
    import kt_ops

    experts = kt_ops.ExpertWeights.from_dense(*dense, fmt, group_size=group)
    x = make_hidden(T, H, dtype, seed=T)
    ids, w = make_routing(T, E, 3, seed=T, skip_fraction=0.2)
    args = kt_ops.layer.layer_args(experts, None, "silu", None)
    want = torch.ops.kt.moe_forward.default(x, ids, w, *args)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            got = kt_ops.moe_forward(x, ids, w, experts)
        assert torch.equal(got, want) and got.dtype == dtype
    assert isinstance(experts.__dict__["_prepared_layers"]["silu"][0], PreparedLayer)


def test_functional_wrapper_takes_the_prepared_layer(dense, monkeypatch):
    import kt_ops
    import kt_ops.ops as ops

    experts = kt_ops.ExpertWeights.from_dense(*dense, "int8")
    x = make_hidden(2, H, torch.float32)
    ids, w = make_routing(2, E, 2)
    with torch.no_grad():
        want = kt_ops.moe_forward(x, ids, w, experts)
        calls = []
        real = ops.layer_args
        monkeypatch.setattr(ops, "layer_args", lambda *a: calls.append(a) or real(*a))
        assert torch.equal(kt_ops.moe_forward(x, ids, w, experts), want)
        assert calls == []  # no layer arguments built, no torch.ops call
        # What the prepared layer does not do goes to the op, as before:
        mask = torch.zeros(E, dtype=torch.bool)
        kt_ops.moe_forward(x, ids, w, experts, gpu_experts_mask=mask)  # a mask
        kt_ops.moe_forward(x, ids, w, experts, out=torch.empty_like(x))  # out=
        with pytest.raises(RuntimeError, match="topk_ids must lie in"):
            kt_ops.moe_forward(x, torch.full_like(ids, E), w, experts)  # the op's error
        assert len(calls) == 3
    with torch.enable_grad():  # autograd
        xg = x.clone().requires_grad_()
        kt_ops.moe_forward(xg, ids, w, experts).sum().backward()
    assert xg.grad is not None and len(calls) == 4


def test_functional_wrapper_copies_and_pickles_its_experts(dense):
    import pickle

    import kt_ops

    experts = kt_ops.ExpertWeights.from_dense(*dense, "int8")
    x = make_hidden(2, H, torch.float32)
    ids, w = make_routing(2, E, 2)
    with torch.no_grad():
        want = kt_ops.moe_forward(x, ids, w, experts)
        for clone in (copy.deepcopy(experts), pickle.loads(pickle.dumps(experts))):
            assert "_prepared_layers" not in clone.__dict__
            assert torch.equal(kt_ops.moe_forward(x, ids, w, clone), want)


# --------------------------------------------------------------------------
# Packed tensors replaced or given new storage after the layer was prepared
# --------------------------------------------------------------------------


def _storage_edits():
    """How a packed tensor ``t`` can get other data while its object stays (or not)."""

    def data_assign(t, new):
        t.data = new

    def set_storage(t, new):
        t.set_(new)

    def share_memory(t, new):  # new storage (shared memory), then the new values in place
        t.share_memory_()
        t.copy_(new)

    return {"data": data_assign, "set_": set_storage, "share_memory_": share_memory}


@pytest.mark.parametrize("edit", sorted(_storage_edits()))
def test_module_follows_its_buffers_new_storage(dense, edit):
    """``MoEExperts`` after a packed buffer got new storage in place (the module sees the
    same object): the prepared layer parses again and computes with the new values, as
    the op does. Before, it read the old storage through its parsed pointers (freed
    memory with ``.data =``)."""
    m = _module(dense, "int8")
    x = make_hidden(6, H, torch.float32)
    ids, w = make_routing(6, E, 3)
    with torch.no_grad():
        m(x, ids, w)  # the layer is prepared
        new = torch.randint_like(m.up_weight, 0, 255)
        _storage_edits()[edit](m.up_weight, new)
        got = m(x, ids, w)
        want = torch.ops.kt.moe_forward.default(
            x, ids, w, *kt_ops.layer.layer_args(m.expert_weights(), None, "silu", None)
        )
    assert torch.equal(m.up_weight, new)
    assert torch.equal(got, want)


@pytest.mark.parametrize("edit", sorted(_storage_edits()) + ["field"])
def test_functional_wrapper_follows_new_tensors(dense, edit):
    """``kt_ops.moe_forward`` on an ``ExpertWeights`` whose packed tensor was replaced
    (a :class:`PackedProjection` field assigned) or given new storage: the new values."""
    experts = kt_ops.ExpertWeights.from_dense(*dense, "int8")
    x = make_hidden(6, H, torch.float32)
    ids, w = make_routing(6, E, 3)
    with torch.no_grad():
        before = kt_ops.moe_forward(x, ids, w, experts)
        new = torch.randint_like(experts.up.weight, 0, 255)
        if edit == "field":
            experts.up.weight = new
        else:
            _storage_edits()[edit](experts.up.weight, new)
        got = kt_ops.moe_forward(x, ids, w, experts)
    want = torch.ops.kt.moe_forward.default(
        x, ids, w, *kt_ops.layer.layer_args(experts, None, "silu", None)
    )
    assert not torch.equal(got, before) and torch.equal(got, want)


def test_prepared_layer_refuses_a_resized_tensor(dense):
    """A packed tensor resized in place: the prepared op raises the op's shape error
    instead of reading past the new storage."""
    experts = kt_ops.ExpertWeights.from_dense(*dense, "int8")
    layer = new_prepared_layer(experts)
    x = make_hidden(2, H, torch.float32)
    ids, w = make_routing(2, E, 3)
    with torch.no_grad():
        moe_forward_prepared(layer.layer, x, ids, w)
        experts.down.weight.resize_(1, 16)
        with pytest.raises(RuntimeError, match="down_weight"):
            moe_forward_prepared(layer.layer, x, ids, w)
