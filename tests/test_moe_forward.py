"""kt::moe_forward against the pure-PyTorch reference, on every ISA path this CPU runs.

Shapes cover T = 0, 1, 2, 7, 64, 513; hidden/intermediate sizes that are not
multiples of the 16-row tile, the K pair or the vector width (1, 15, 16, 17,
33, 70, 130); every per-expert token count of a register tile and its
remainders; -1 ids (a few, a whole row, all); every activation / id / routing
weight dtype; the Qwen3-30B-A3B layer; thread counts 1-3 (bit-identical);
repeated calls (bit-identical); non-contiguous inputs; and, in a subprocess
with a poisoned heap, that every output element is written.
"""

# T, H, I, E, K: tokens, hidden, intermediate, experts, top-k (the design notes' names).
# ruff: noqa: E741

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
from reference import (
    ACTIVATION_DTYPES,
    TOL_BF16,
    assert_matches_reference,
    make_expert_weights,
    make_hidden,
    make_large_expert_weights,
    make_routing,
    mismatch_report,
    packed_weights,
    reference_moe_forward,
    replace_weights,
)

import kt_ops

THREAD_COUNTS = (1, 2, 3)


@pytest.fixture(autouse=True)
def _streaming_kernels():
    """This file checks the streaming kernels at the bf16 tolerance (fp32 activations
    times exact bf16 weights); oneDNN's brgemm path, which rounds the activations
    to bf16, and 'auto' are checked the same way in test_compute_paths.py."""
    with kt_ops.use_compute_path("streaming"):
        yield


def run_op(x, ids, weights, w: kt_ops.ExpertWeights, **kwargs):
    return kt_ops.moe_forward(x, ids, weights, w, **kwargs)


def run_ref(x, ids, weights, w: kt_ops.ExpertWeights):
    return reference_moe_forward(x, ids, weights, w)


def check(x, ids, weights, w: kt_ops.ExpertWeights, **kwargs):
    """Run the op, check dtype/shape/finiteness and every element against the reference."""
    out = run_op(x, ids, weights, w, **kwargs)
    assert out.dtype == x.dtype
    assert out.shape == x.shape
    assert out.device.type == "cpu"
    assert_matches_reference(out, run_ref(x, ids, weights, w))
    return out


@functools.cache
def small_layer(E: int, H: int, I: int, seed: int = 0) -> kt_ops.ExpertWeights:
    return make_expert_weights(E, H, I, seed=seed)


# --------------------------------------------------------------------------
# The reference dequantizer the whole suite relies on
# --------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(1, 1), (15, 17), (16, 16), (17, 15), (33, 70)])
def test_pack_unpack_roundtrip_and_layout(n, k):
    E = 3
    dense = torch.randn(E, n, k).to(torch.bfloat16).float()  # exactly representable
    packed = kt_ops.pack_weights(dense, "bf16")
    nb, kp = math.ceil(n / 16), math.ceil(k / 2)
    assert packed.dtype == torch.bfloat16
    assert packed.shape == (E, nb, kp, 16, 2)
    assert packed.is_contiguous()
    assert torch.equal(kt_ops.unpack_weights(packed, n, k, "bf16"), dense)
    # The documented layout, element by element: packed[e, nb, kp, r, j] = W[e, 16nb+r, 2kp+j].
    padded = torch.zeros(E, nb * 16, kp * 2)
    padded[:, :n, :k] = dense
    for e in range(E):
        for b in range(nb):
            for p in range(kp):
                block = padded[e, 16 * b : 16 * b + 16, 2 * p : 2 * p + 2]
                assert torch.equal(packed[e, b, p].float(), block)


def test_pack_rounds_to_nearest_even():
    w = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-9)]).view(1, 1, 3)
    got = kt_ops.unpack_weights(kt_ops.pack_weights(w), 1, 3).flatten().tolist()
    assert got == [1.0, 1.0 + 2.0**-6, -1.0]


# --------------------------------------------------------------------------
# Against the reference: token counts, odd sizes, tiles, dtypes, -1 ids
# --------------------------------------------------------------------------


@pytest.mark.parametrize("T", [0, 1, 2, 7, 64, 513])
def test_token_counts(isa, T):
    w = small_layer(8, 130, 70)
    ids, weights = make_routing(T, 8, 4, seed=T)
    check(make_hidden(T, 130, seed=T), ids, weights, w)


@pytest.mark.parametrize(
    "H,I",
    [(1, 1), (2, 3), (15, 15), (16, 16), (17, 17), (15, 17), (17, 15), (33, 17), (130, 70),
     (32, 48), (31, 33)],
)  # fmt: skip
def test_hidden_and_intermediate_sizes(isa, H, I):
    E, K, T = 6, 2, 23
    w = small_layer(E, H, I, seed=H * 1000 + I)
    ids, weights = make_routing(T, E, K, seed=H + I)
    check(make_hidden(T, H, torch.float32, seed=H), ids, weights, w)


def test_every_tile_remainder(isa):
    # Expert e receives exactly e + 1 tokens (1..17): every register-tile size
    # (AVX2 tiles of 4, AVX-512 tiles of 8) plus each remainder, and more than
    # two full tiles, in one call. Tokens of one expert are spread over the batch.
    E, H, I = 17, 40, 36
    counts = list(range(1, E + 1))
    slots = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    slots = slots[torch.randperm(slots.numel(), generator=torch.Generator().manual_seed(0))]
    K = 3
    T = -(-slots.numel() // K)
    ids = torch.full((T * K,), -1, dtype=torch.int64)
    ids[: slots.numel()] = slots
    ids = ids.view(T, K)
    # The same expert may appear twice for a token here; the op must add both.
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(1))
    got = torch.bincount(ids[ids >= 0], minlength=E)
    assert got.tolist() == counts
    check(make_hidden(T, H, seed=3), ids, weights, small_layer(E, H, I, seed=5))


@pytest.mark.parametrize("act_dtype", ACTIVATION_DTYPES, ids=str)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("weights_kind", ["fp32", "act"])
def test_dtypes(isa, act_dtype, ids_dtype, weights_kind):
    weights_dtype = torch.float32 if weights_kind == "fp32" else act_dtype
    E, H, I, T, K = 8, 33, 70, 19, 3
    w = small_layer(E, H, I)
    ids, weights = make_routing(T, E, K, seed=2, ids_dtype=ids_dtype, weights_dtype=weights_dtype)
    check(make_hidden(T, H, act_dtype, seed=2), ids, weights, w)


def test_routing_weights_other_half_dtype(isa):
    # bf16 activations with fp16 routing weights (and the reverse) are accepted.
    E, H, I, T, K = 4, 32, 16, 5, 2
    w = small_layer(E, H, I)
    for act, wdt in [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)]:
        ids, weights = make_routing(T, E, K, weights_dtype=wdt)
        check(make_hidden(T, H, act), ids, weights, w)


@pytest.mark.parametrize(
    "case", ["some_skipped", "row_skipped", "all_skipped", "all_but_one", "no_slots"]
)
def test_skipped_slots(isa, case):
    E, H, I, T, K = 8, 130, 70, 16, 4
    w = small_layer(E, H, I)
    x = make_hidden(T, H, torch.float32, seed=7)
    if case == "some_skipped":
        ids, weights = make_routing(T, E, K, skip_fraction=0.4, skip_rows=(0, 9))
    elif case == "row_skipped":
        ids, weights = make_routing(T, E, K, skip_rows=(3,))
    elif case == "all_skipped":
        ids, weights = make_routing(T, E, K, skip_rows=tuple(range(T)))
    elif case == "all_but_one":
        ids, weights = make_routing(T, E, K, skip_rows=tuple(range(T)))
        ids[5, 2] = 6
    else:  # K = 0: no slot at all
        ids = torch.empty(T, 0, dtype=torch.int64)
        weights = torch.empty(T, 0)
    out = check(x, ids, weights, w)
    # Rows with no valid slot are exactly zero, not just small.
    empty_rows = (ids < 0).all(dim=1) if ids.shape[1] else torch.ones(T, dtype=torch.bool)
    assert torch.all(out[empty_rows] == 0)


def test_all_experts_receive_tokens(isa):
    E, H, I, T, K = 8, 48, 40, 12, 2
    ids = (torch.arange(T * K) % E).view(T, K)
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(0))
    assert torch.unique(ids).numel() == E
    check(make_hidden(T, H), ids, weights, small_layer(E, H, I))


def test_experts_without_tokens_are_not_read(isa):
    # Experts with no token (or only -1 slots, e.g. served on the GPU) may hold
    # anything: fill their weights with NaN; the output must not change at all.
    E, H, I, T, K = 8, 33, 17, 9, 2
    w = small_layer(E, H, I)
    ids, weights = make_routing(T, E, K, seed=4)
    ids[ids >= 4] = -1
    ids[0, 0] = 1
    x = make_hidden(T, H, seed=4)
    clean = run_op(x, ids, weights, w)
    poisoned = replace_weights(w, *(t.clone() for t in packed_weights(w)))
    for t in packed_weights(poisoned):
        t[4:] = float("nan")
    assert torch.equal(run_op(x, ids, weights, poisoned), clean)


def test_weights_of_skipped_slots_are_ignored(isa):
    E, H, I, T, K = 4, 32, 16, 6, 3
    w = small_layer(E, H, I)
    ids, weights = make_routing(T, E, K, skip_fraction=0.5, skip_rows=(2,))
    x = make_hidden(T, H)
    clean = run_op(x, ids, weights, w)
    weights = weights.masked_fill(ids < 0, float("nan"))
    assert torch.equal(run_op(x, ids, weights, w), clean)


def test_activations_of_unrouted_tokens_are_ignored(isa):
    E, H, I, T, K = 4, 32, 16, 6, 2
    w = small_layer(E, H, I)
    ids, weights = make_routing(T, E, K, skip_rows=(1, 4))
    x = make_hidden(T, H)
    x[1] = float("nan")
    x[4] = float("inf")
    out = check(x, ids, weights, w)
    assert torch.all(out[[1, 4]] == 0)


# --------------------------------------------------------------------------
# The Qwen3-30B-A3B layer (hidden 2048, intermediate 768, 128 experts, top-8)
# --------------------------------------------------------------------------

QWEN3_E, QWEN3_H, QWEN3_I, QWEN3_K = 128, 2048, 768, 8


@pytest.fixture(scope="module")
def qwen3_layer() -> kt_ops.ExpertWeights:
    return make_large_expert_weights(QWEN3_E, QWEN3_H, QWEN3_I, seed=0)


#: Batches above this many tokens route to this many "hot" experts only, so
#: the reference dequantizes 32 experts, not all 128 (its cost is the unpacking).
QWEN3_HOT_ABOVE_T, QWEN3_HOT_EXPERTS = 16, 32


@functools.cache
def qwen3_inputs(T: int):
    """bf16 activations and normalized top-8 routing (Qwen3 normalizes the top-k weights)."""
    if T <= QWEN3_HOT_ABOVE_T:
        ids, weights = make_routing(T, QWEN3_E, QWEN3_K, seed=100 + T)
    else:
        # 64 tokens x 8 slots over 32 experts: ~16 tokens per expert, i.e. full
        # register tiles and remainders on the real layer shape.
        hot = torch.randperm(QWEN3_E, generator=torch.Generator().manual_seed(T))
        ids, weights = make_routing(T, QWEN3_HOT_EXPERTS, QWEN3_K, seed=100 + T)
        ids = hot[:QWEN3_HOT_EXPERTS][ids]
    return make_hidden(T, QWEN3_H, torch.bfloat16, seed=T), ids, weights


_qwen3_ref_cache: dict[int, torch.Tensor] = {}


def qwen3_reference(layer: kt_ops.ExpertWeights, T: int) -> torch.Tensor:
    if T not in _qwen3_ref_cache:
        _qwen3_ref_cache[T] = run_ref(*qwen3_inputs(T), layer)
    return _qwen3_ref_cache[T]


@pytest.mark.parametrize("T", [1, 2, 7, 64])
def test_qwen3_30b_a3b_layer(isa, qwen3_layer, T):
    x, ids, weights = qwen3_inputs(T)
    out = run_op(x, ids, weights, qwen3_layer)
    assert out.dtype == torch.bfloat16 and out.shape == (T, QWEN3_H)
    assert_matches_reference(out, qwen3_reference(qwen3_layer, T))


def test_qwen3_30b_a3b_fp32_output_is_tight(isa, qwen3_layer):
    # fp32 activations: no output rounding, so only TOL_BF16.compute is allowed.
    x, ids, weights = qwen3_inputs(7)
    out = run_op(x.float(), ids, weights, qwen3_layer)
    assert_matches_reference(out, qwen3_reference(qwen3_layer, 7))


@pytest.mark.parametrize("T", [2, 7])
def test_isa_paths_agree(run_on_isa, qwen3_layer, T):
    # ruy-style: every supported path against every other (not only the reference).
    x, ids, weights = qwen3_inputs(T)
    x = x.float()
    outs = {
        name: run_on_isa(name, lambda: run_op(x, ids, weights, qwen3_layer))
        for name in kt_ops.supported_isas()
    }
    names = list(outs)
    for a in names:
        for b in names:
            if a < b:
                msg = mismatch_report(outs[a], outs[b], TOL_BF16)
                assert msg is None, f"{a} vs {b}: {msg}"


# --------------------------------------------------------------------------
# Determinism: thread counts, repeated calls, scratch reuse
# --------------------------------------------------------------------------


def _outputs_for_threads(fn):
    outs = {}
    for n in THREAD_COUNTS:
        kt_ops.set_num_threads(n)
        assert kt_ops.get_num_threads() == n
        outs[n] = fn()
    return outs


def _assert_all_bit_identical(outs: dict):
    first_key = next(iter(outs))
    for key, out in outs.items():
        assert torch.equal(out, outs[first_key]), f"{key} differs from {first_key} bit-wise"


@pytest.mark.parametrize("T", [1, 7, 513])
def test_thread_counts_bit_identical_small(isa, T):
    w = small_layer(8, 130, 70)
    ids, weights = make_routing(T, 8, 4, seed=T)
    x = make_hidden(T, 130, torch.float32, seed=T)
    _assert_all_bit_identical(_outputs_for_threads(lambda: run_op(x, ids, weights, w)))


@pytest.mark.parametrize("T", [1, 7])
def test_thread_counts_bit_identical_qwen3(isa, qwen3_layer, T):
    x, ids, weights = qwen3_inputs(T)
    x = x.float()  # fp32 output shows any difference in the accumulation order
    _assert_all_bit_identical(_outputs_for_threads(lambda: run_op(x, ids, weights, qwen3_layer)))


@pytest.mark.parametrize("path", ["streaming", "brgemm"])
def test_pinned_paths_are_batch_invariant(isa, path):
    # docs/formats.md: with the compute path pinned, a token's output does not
    # depend on how many tokens share its experts. In a batch of 64 its expert's
    # rows run in the prefill tiles; alone, in the 1-token decode tile (which
    # once kept two FMA chains over k and differed by an ulp).
    w = small_layer(8, 130, 70)
    ids, weights = make_routing(64, 8, 4, seed=12)
    x = make_hidden(64, 130, torch.float32, seed=12)
    with kt_ops.use_compute_path(path):
        batch = run_op(x, ids, weights, w)
        for t in (1, 5, 33, 63):
            alone = run_op(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], w)
            assert torch.equal(alone[0], batch[t]), f"token {t} alone differs"


def test_repeated_calls_bit_identical(isa):
    E, H, I = 8, 130, 70
    w = small_layer(E, H, I)
    ids_a, w_a = make_routing(7, E, 4, seed=1)
    ids_b, w_b = make_routing(200, E, 4, seed=2)
    x_a = make_hidden(7, H, torch.float32, seed=1)
    x_b = make_hidden(200, H, torch.float32, seed=2)
    first = run_op(x_a, ids_a, w_a, w)
    again = [run_op(x_a, ids_a, w_a, w) for _ in range(3)]
    # A larger call in between (grows the op's reused scratch buffers), then the small one again.
    big = run_op(x_b, ids_b, w_b, w)
    after = run_op(x_a, ids_a, w_a, w)
    for out in [*again, after]:
        assert torch.equal(out, first)
    assert torch.equal(run_op(x_b, ids_b, w_b, w), big)
    assert_matches_reference(first, run_ref(x_a, ids_a, w_a, w))


@pytest.mark.parametrize("H", [128, 130])
def test_non_temporal_stores_give_the_same_bits(isa, H):
    # Past 16 MiB the per-slot outputs are written with non-temporal stores
    # (moe/moe_forward.h): the threshold lowered to 0 runs that path here. H = 128: every
    # row 16-byte aligned (streamed); H = 130: rows at every alignment (the unaligned
    # ones copied as before).
    w = small_layer(8, H, 70)
    ids, weights = make_routing(200, 8, 4, seed=3)
    x = make_hidden(200, H, torch.float32, seed=3)
    want = run_op(x, ids, weights, w)
    before = kt_ops._C._testing.set_stream_bytes(0)
    try:
        got = run_op(x, ids, weights, w)
    finally:
        kt_ops._C._testing.set_stream_bytes(before)
    assert torch.equal(got, want)
    assert_matches_reference(got, run_ref(x, ids, weights, w))


def test_inputs_are_not_modified(isa):
    E, H, I, T, K = 4, 33, 17, 9, 2
    w = small_layer(E, H, I)
    ids, weights = make_routing(T, E, K, skip_fraction=0.3, ids_dtype=torch.int32)
    x = make_hidden(T, H)
    before = [t.clone() for t in (x, ids, weights, *packed_weights(w))]
    run_op(x, ids, weights, w)
    for t0, t1 in zip(before, (x, ids, weights, *packed_weights(w))):
        assert torch.equal(t0, t1)


# --------------------------------------------------------------------------
# Non-contiguous inputs
# --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["column_slice", "transposed", "row_stride", "expanded"])
def test_non_contiguous_hidden_states(isa, layout):
    E, H, I, T, K = 8, 33, 17, 10, 3
    w = small_layer(E, H, I)
    ids, weights = make_routing(T, E, K, seed=9)
    base = make_hidden(T, 2 * H, torch.float32, seed=9)
    if layout == "column_slice":
        x = base[:, ::2]
    elif layout == "transposed":
        x = base[:, :H].t().contiguous().t()
    elif layout == "row_stride":
        x = make_hidden(2 * T, H, torch.float32, seed=9)[::2]
    else:
        x = base[:1, :H].expand(T, H)
    assert not x.is_contiguous()
    out = check(x, ids, weights, w)
    assert torch.equal(out, run_op(x.contiguous(), ids, weights, w))


def test_views_with_storage_offset(isa):
    # Contiguous views that do not start at their storage's beginning: every
    # tensor argument, packed weights included (e.g. one layer sliced from a stack).
    E, H, I, T, K = 5, 33, 17, 8, 2
    stack = make_expert_weights(E + 2, H, I, seed=13)
    g, u, d = packed_weights(stack)
    w = replace_weights(stack, g[1 : E + 1], u[2:], d[1 : E + 1])
    assert all(t.storage_offset() > 0 and t.is_contiguous() for t in packed_weights(w))
    ids, weights = make_routing(T + 3, E, K, seed=13)
    x = make_hidden(T + 3, H, seed=13)[3:]
    ids, weights = ids[3:], weights[3:]
    out = check(x, ids, weights, w)
    copies = replace_weights(w, *(t.clone() for t in packed_weights(w)))
    assert torch.equal(out, run_op(x.clone(), ids.clone(), weights.clone(), copies))


def test_non_contiguous_routing(isa):
    E, H, I, T, K = 8, 33, 17, 10, 3
    w = small_layer(E, H, I)
    ids, weights = make_routing(T, E, K, seed=10, skip_fraction=0.2)
    ids_nc = ids.t().contiguous().t()
    weights_nc = torch.stack([weights, weights], dim=2)[:, :, 1]
    assert not ids_nc.is_contiguous() and not weights_nc.is_contiguous()
    x = make_hidden(T, H, seed=10)
    out = check(x, ids_nc, weights_nc, w)
    assert torch.equal(out, run_op(x, ids, weights, w))


# --------------------------------------------------------------------------
# Every output element is written: heap poisoned before the op allocates
# --------------------------------------------------------------------------

_POISON_SCRIPT = r"""
import json, torch, kt_ops
from reference import make_expert_weights, make_routing, make_hidden, mismatch_report
from reference import reference_moe_forward, TOL_BF16, TOL_BF16_BRGEMM

# Freshly allocated memory must hold the poison (0x7F bytes: 3.4e38 in fp32/bf16,
# NaN in fp16), or this check proves nothing.
probe = torch.empty(4096).float()
poison_active = bool((probe.abs() > 1e38).all())
results = []
for isa in kt_ops.supported_isas():
    with kt_ops.use_isa(isa):
        for (T, H, I, E, K) in [(1, 33, 17, 4, 2), (7, 130, 70, 8, 3), (64, 48, 40, 8, 2),
                                (300, 17, 15, 5, 2)]:
            w = make_expert_weights(E, H, I, seed=T)
            ids, wt = make_routing(T, E, K, seed=T, skip_fraction=0.2, skip_rows=(0,))
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                x = make_hidden(T, H, dt, seed=T)
                for path in ("streaming", "brgemm"):  # brgemm falls back where it does not run
                    with kt_ops.use_compute_path("brgemm"):
                        brg = kt_ops.compute_paths()["bf16"]["brgemm_kernel"] is not None
                    rounded = path == "brgemm" and brg
                    with kt_ops.use_compute_path(path):
                        out = kt_ops.moe_forward(x, ids, wt, w)
                    ref = reference_moe_forward(x, ids, wt, w, bf16_activations=rounded)
                    tol = TOL_BF16_BRGEMM if rounded else TOL_BF16
                    results.append([isa, path, T, H, I, str(dt), mismatch_report(out, ref, tol)])
print(json.dumps({"poison_active": poison_active, "results": results}))
"""


def test_every_output_element_is_written(python_subprocess):
    # glibc fills every malloc'ed block with ~MALLOC_PERTURB_ (0x7F here) and the
    # raised mmap threshold keeps outputs on the heap; so an output element the
    # op forgets to write reads as 3.4e38 (NaN for fp16) and fails the comparison.
    proc = python_subprocess(
        _POISON_SCRIPT, env={"MALLOC_PERTURB_": "128", "MALLOC_MMAP_THRESHOLD_": "33554432"}
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if not report["poison_active"]:
        pytest.skip("this libc does not honour MALLOC_PERTURB_: cannot poison outputs")
    assert report["results"], "no case ran"
    failures = [r for r in report["results"] if r[-1] is not None]
    assert not failures, failures
    assert {r[0] for r in report["results"]} == set(kt_ops.supported_isas())


# --------------------------------------------------------------------------
# The checks can fail
# --------------------------------------------------------------------------


def test_checker_detects_a_perturbed_weight():
    E, H, I, T, K = 4, 33, 17, 6, 2
    w = small_layer(E, H, I)
    ids, weights = make_routing(T, E, K, seed=11)
    x = make_hidden(T, H, torch.float32, seed=11)
    ref = run_ref(x, ids, weights, w)
    e = int(ids[0, 0])
    for proj in ("gate", "up", "down"):
        bad = replace_weights(w, *(t.clone() for t in packed_weights(w)))
        t = getattr(bad, proj).weight
        # one element of one used expert, by about its own magnitude (~1/sqrt(fan-in))
        t[e, 0, 0, 0, 0] += 0.25
        for dtype in (torch.float32, torch.bfloat16):
            out = run_op(x.to(dtype), ids, weights, bad)
            assert mismatch_report(out, ref) is not None, (proj, dtype)
    # and the unperturbed op passes the same check
    assert mismatch_report(run_op(x, ids, weights, w), ref) is None


def test_checker_detects_one_wrong_element():
    E, H, I, T, K = 4, 33, 17, 6, 2
    w = small_layer(E, H, I)
    ids, weights = make_routing(T, E, K, seed=12)
    x = make_hidden(T, H, torch.float32, seed=12)
    ref = run_ref(x, ids, weights, w)
    out = run_op(x, ids, weights, w)
    assert mismatch_report(out, ref) is None
    scale = ref.abs().max().item()
    for t, j in [(0, 0), (T - 1, H - 1), (T // 2, H // 2)]:
        for value in (out[t, j] + 10 * TOL_BF16.compute * scale, float("nan"), float("inf")):
            bad = out.clone()
            bad[t, j] = value
            assert mismatch_report(bad, ref) is not None, (t, j, value)
    # a wrong routing weight or a swapped expert id is caught too
    assert mismatch_report(run_op(x, ids, weights * 1.01, w), ref) is not None
    swapped = ids.clone()
    swapped[1, 0] = (swapped[1, 0] + 1) % E
    if swapped[1, 0] == ids[1, 1]:
        swapped[1, 0] = (swapped[1, 0] + 1) % E
    assert mismatch_report(run_op(x, swapped, weights, w), ref) is not None
    # and a missing / extra row
    assert mismatch_report(out[:-1], ref) is not None


def test_bf16_tolerance_is_not_vacuous():
    # bf16 outputs may differ from the fp32 reference by half an ulp (2^-8
    # relative), not by a whole one. Each value alone: the tolerance's compute term
    # scales with max |ref|, which would cover a whole ulp of the smaller values
    # next to 100.
    for v in (1.0, 3.0, -0.75, 100.0):
        ref = torch.tensor([[v]])
        assert mismatch_report(ref.to(torch.bfloat16), ref) is None, v
        off_by_one_ulp = (ref * (1 + 2.0**-7)).to(torch.bfloat16)
        assert mismatch_report(off_by_one_ulp, ref) is not None, v


# --------------------------------------------------------------------------
# ruy-style coverage: must run last (conftest moves it there)
# --------------------------------------------------------------------------


@pytest.mark.isa_coverage
def test_every_supported_isa_was_exercised(request, exercised_isas):
    selected_isa_tests = [it for it in request.session.items if "isa" in it.fixturenames]
    if not selected_isa_tests:
        pytest.skip("no ISA-parametrized test selected in this run")
    supported = kt_ops.supported_isas()
    assert "ref" in supported
    missing = [name for name in supported if exercised_isas[name] == 0]
    assert not missing, (
        f"this CPU supports ISA path(s) {missing} that no test exercised; "
        f"exercised: {dict(exercised_isas)}"
    )
