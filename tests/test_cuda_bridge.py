"""The kt:: ops on CUDA tensors (the CUDA bridge), on a machine with a GPU.

Skipped without a CUDA device or without the bridge in the build (a CPU torch).
What runs everywhere: the bridge's host side, tests/test_cuda_bridge_host.py.
Here: eager equality with the CPU op (bit-identical: the same driver on a
copy), the out variant, the GPU-experts mask, capture and 100 replays in
``torch.cuda.graph`` at T = 1, a CUDA-graph greedy decode loop of a tiny
Hugging Face MoE model (StaticCache) with identical tokens, the overlap of the
CPU experts with GPU work, and a LoRA training step.
"""

# ruff: noqa: E741

from __future__ import annotations

import time

import pytest
import torch

import kt_ops
import kt_ops.hybrid
import kt_ops.ops
from kt_ops.layer import ExpertWeights, LoRAWeights

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and kt_ops.hybrid.cuda_bridge_built()),
        reason="needs a CUDA device and a kt_ops build with the CUDA bridge (CUDA torch)",
    ),
]

E, H, I, K = 16, 256, 256, 4
DEV = "cuda"


def _experts(fmt: str, seed: int = 0) -> ExpertWeights:
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(E, I, H, generator=g) * 0.1 for _ in range(2))
    return ExpertWeights.from_dense(gate, up, torch.randn(E, H, I, generator=g) * 0.1, fmt)


def _routing(T: int, seed: int = 1, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    rows = [torch.randperm(E, generator=g)[:K] for _ in range(T)]
    ids = torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.long)
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return x, ids, w


def _cuda(*ts):
    return [t.to(DEV) for t in ts]


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "q4_k,q4_k,q6_k", "fp8"])
@pytest.mark.parametrize("T", [0, 1, 33])
def test_eager_matches_cpu_op(fmt, T):
    experts = _experts(fmt)
    x, ids, w = _routing(T)
    got = kt_ops.moe_forward(*_cuda(x, ids, w), experts)
    assert got.device.type == "cuda" and got.dtype == x.dtype
    assert torch.equal(got.cpu(), kt_ops.moe_forward(x, ids, w, experts))


def test_out_variant_and_mask():
    experts = _experts("int8")
    x, ids, w = _routing(9)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[0, 3, 7]] = True
    out = torch.full((9, H), float("nan"), dtype=x.dtype, device=DEV)
    kt_ops.moe_forward(*_cuda(x, ids, w), experts, out=out, gpu_experts_mask=mask.to(DEV))
    want = kt_ops.moe_forward(x, ids, w, experts, gpu_experts_mask=mask)
    assert torch.equal(out.cpu(), want)


def test_mixed_devices_are_refused():
    experts = _experts("int8")
    x, ids, w = _routing(2)
    with pytest.raises(RuntimeError, match="topk_ids is on cpu"):
        kt_ops.moe_forward(x.to(DEV), ids, w.to(DEV), experts)


def test_graph_capture_and_100_replays_at_T1():
    layers = [_experts("int4", seed=0), _experts("q4_k,q4_k,q6_k", seed=1)]
    x, ids, w = _cuda(*_routing(1))

    def step(x, ids, w):
        y = kt_ops.moe_forward(x, ids, w, layers[0])
        return kt_ops.moe_forward(y, ids, w, layers[1])

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm-up, as for any captured op
            step(x, ids, w)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(x, ids, w)
    assert kt_ops.hybrid.staging_stats()["captured_blocks"] >= 2
    for i in range(100):
        nx, nids, nw = _routing(1, seed=100 + i)
        x.copy_(nx)
        ids.copy_(nids)
        w.copy_(nw)
        graph.replay()
        torch.cuda.synchronize()
        y = kt_ops.moe_forward(nx, nids, nw, layers[0])
        assert torch.equal(out.cpu(), kt_ops.moe_forward(y, nids, nw, layers[1]))
    del graph
    kt_ops.hybrid.release_graph_staging()
    assert kt_ops.hybrid.staging_stats()["captured_blocks"] == 0


def test_call_returns_before_the_cpu_experts_finish():
    """Stream-ordered: the call enqueues; the GPU runs ahead; CUDA events time the overlap."""
    experts = _experts("bf16")
    x, ids, w = _cuda(*_routing(512))
    kt_ops.moe_forward(x, ids, w, experts)
    a = torch.randn(2048, 2048, device=DEV)
    # cuBLAS's first matmul in a process initialises it and waits for the device: had it
    # come after the op (as it did on the first H100 run), the "enqueue" would include
    # the whole CPU part.
    a = a @ a / 2048
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    y = kt_ops.moe_forward(x, ids, w, experts)
    enqueue_s = time.perf_counter() - t0
    for _ in range(10):  # GPU work enqueued behind it on another stream would overlap
        a = a @ a / 2048
    end.record()
    torch.cuda.synchronize()
    total_s = start.elapsed_time(end) / 1e3
    print(f"enqueue {enqueue_s * 1e3:.2f} ms, stream time {total_s * 1e3:.2f} ms")
    assert enqueue_s < 0.5 * total_s
    assert torch.isfinite(y).all()


def test_lora_training_step_on_cuda():
    experts = _experts("int8")
    x, ids, w = _routing(12, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    factors = [torch.randn(E, 4, H, generator=g) * 0.1, torch.randn(E, I, 4, generator=g) * 0.1]

    def run(device):
        a, b = (f.to(device).requires_grad_() for f in factors)
        xs = x.to(device).requires_grad_()
        ws = w.to(device).requires_grad_()
        lora = LoRAWeights(gate=(a, b), scaling=0.5)
        out = kt_ops.moe_forward(xs, ids.to(device), ws, experts, lora)
        out.square().sum().backward()
        return [t.detach().cpu() for t in (out, xs.grad, ws.grad, a.grad, b.grad)]

    for got, want in zip(run(DEV), run("cpu")):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cuda_graph_greedy_decode_of_a_tiny_moe_model():
    """A decode loop captured once and replayed per token (StaticCache), experts on kt_ops."""
    transformers = pytest.importorskip("transformers")
    from lora_helpers import tiny_model

    model = tiny_model(num_layers=2)
    ref_model = tiny_model(num_layers=2)
    kt_ops.replace_experts(model)
    model.to(DEV)
    ref_model.to(DEV)
    prompt = torch.tensor([[1, 5, 9, 2, 7]], device=DEV)
    steps = 16
    with torch.no_grad():
        ref = ref_model.generate(prompt, max_new_tokens=steps, do_sample=False)[
            0, prompt.shape[1] :
        ]
        cache = transformers.StaticCache(
            config=model.config, max_batch_size=1, max_cache_len=prompt.shape[1] + steps + 1
        )
        logits = model(prompt, past_key_values=cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        static_token = token.clone()
        static_pos = torch.tensor([prompt.shape[1]], device=DEV)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        # No eager warm-up step: it would advance the cache; the prefill above warmed up.
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            static_logits = model(
                static_token, past_key_values=cache, cache_position=static_pos, use_cache=True
            ).logits
        tokens = [int(token)]
        for _ in range(steps - 1):
            graph.replay()
            token = static_logits[:, -1:].argmax(-1)
            static_token.copy_(token)
            static_pos += 1
            tokens.append(int(token))
    assert tokens == ref.tolist()
    del graph
    kt_ops.hybrid.release_graph_staging()
