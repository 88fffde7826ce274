"""kt::moe_forward on the quantized weight formats, on every ISA path this CPU runs.

Reference (tests/reference.py, ``reference_quant_moe_forward``): the packed
projections dequantized by ``kt_ops.formats.dequantize_weights`` (docs/formats.md
index arithmetic, no code shared with the packers or kernels), dense fp32
matmuls, and for the ``q8`` formats (all but fp8) the activations rounded as the
kernels round them (``q8_activations``, the documented formula of
``quantize_activations_q8``, on the hidden states before gate/up and on the
SwiGLU output before down). Tolerance ``TOL_QUANT``: 2e-5 of max|ref| (20x the
observed fp32 summation-order difference) plus, per output element, the most
that SwiGLU values sitting on a q8 rounding tie can change it if the kernel
rounds them the other way (the reference's ``slack``; see reference.py).
A flat 2e-3 of max|ref| would be needed otherwise: one such flip moves a token
of this file's small layers (I = 64) by up to ~1e-3 of max|ref|.

Covered, per format (int8; int4 symmetric/asymmetric x group 32/64/128; fp8;
mxfp4; q8_0; q4_0; q4_k; q5_k; q6_k): weights from ``quantize_weights`` and from
random raw blocks (``from_gguf``, ``from_fp8``, ``from_mxfp4``); T = 0, 1, 2, 7,
64, 130; -1 ids, all-skipped rows, experts that receive no token (poisoned:
never read); N not a multiple of 16 and K not a multiple of 32 where the packers
allow it (int8, fp8, mxfp4); activations bf16/fp16/fp32, topk_ids int32/int64;
thread counts 1/2/3 bit-identical; fp32/fp16/bf16 scales (and zeros) for
int8/int4 (and q4_0); the total error against the unquantized
dense layer; and that the checks can fail.

A note on shapes: ``moe_forward`` requires ``group_size`` to divide the K of
every projection padded to a multiple of 32, but ``quantize_weights`` (int4)
and ``from_gguf`` require it to divide the unpadded K. Each of H and I is the K
of one projection and the N of another, so for int4 and the GGUF formats N is
always a multiple of 16; partial 16-row blocks (and K not a multiple of 32)
occur for int8, fp8 and mxfp4 (whose packer pads K).
"""

# T, H, I, E, K: tokens, hidden, intermediate, experts, top-k (the design notes' names).
# ruff: noqa: E741

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math

import pytest
import torch
from reference import (
    QuantReference,
    Tolerance,
    activation_of,
    dense_expert_weights,
    dense_weights,
    make_hidden,
    make_quant_experts,
    make_routing,
    q8_activations,
    quant_mismatch_report,
    random_gguf_raw,
    reference_for,
    reference_quant_moe_forward,
    single_threaded_torch,
)
from torch import Tensor

import kt_ops
from kt_ops.formats import (
    E2M1_VALUES,
    PackedProjection,
    dequantize_weights,
    format_spec,
    from_fp8,
    from_gguf,
    from_mxfp4,
    quantize_activations_q8,
)
from kt_ops.formats import FORMATS as WEIGHT_FORMATS

THREAD_COUNTS = (1, 2, 3)

#: ISA path -> uses by this file's tests (checked by the coverage test at the end).
QUANT_ISAS: collections.Counter[str] = collections.Counter()


@pytest.fixture
def qisa(isa):
    """conftest's ``isa`` (every supported path in turn), also counted for this file."""
    QUANT_ISAS[isa] += 1
    return isa


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of packing a layer: format, group size, symmetry, and a layer shape it allows."""

    fmt: str
    group_size: int | None
    symmetric: bool
    H: int
    I: int
    tag: str = ""

    @property
    def id(self) -> str:
        gs = "" if self.group_size is None else f"_g{self.group_size}"
        sym = "" if self.symmetric else "_asym"
        return f"{self.fmt}{gs}{sym}{self.tag}"


# Shapes: the smallest that give several 16-row blocks and several groups, with
# N not a multiple of 16 and K not a multiple of 32 where the format allows it
# (int8: K=50/40; fp8: K=200/136, also two 128-row scale blocks each way), K a
# multiple of the group size for grouped formats and of 256 for the k-quants.
VARIANTS = [
    Variant("int8", None, True, 50, 40),
    *(
        Variant("int4", gs, sym, H, I)
        for gs, H, I in ((32, 96, 64), (64, 128, 192), (128, 256, 128), (0, 80, 72))
        for sym in (True, False)
    ),
    Variant("fp8", None, True, 200, 136),
    Variant("fp8_channel", None, True, 200, 72),
    Variant("mxfp8", None, True, 96, 72),
    Variant("mxfp4", None, True, 96, 64),
    Variant("nvfp4", None, True, 96, 72),
    Variant("q8_0", None, True, 96, 64),
    Variant("q4_0", None, True, 96, 64),
    # GGUF's fallback types (k-quant mixes, rows not a multiple of 256): 5-bit codes with
    # q4_0's fp16 scales, and q4_1's / q5_1's mins as fp16 zeros.
    Variant("q4_1", None, True, 96, 64),
    Variant("q5_0", None, True, 96, 64),
    Variant("q5_0", None, True, 160, 96, "_160x96"),
    Variant("q5_1", None, True, 96, 64),
    Variant("q2_k", None, True, 256, 256),
    Variant("q2_k", None, True, 512, 256, "_512x256"),
    Variant("q3_k", None, True, 256, 256),
    Variant("q3_k", None, True, 256, 512, "_256x512"),
    Variant("q4_k", None, True, 256, 256),
    Variant("q5_k", None, True, 256, 256),
    Variant("q6_k", None, True, 256, 256),
    # Several 256-k super-blocks per 16-row block (scale records decoded per super-block).
    Variant("q5_k", None, True, 512, 256, "_512x256"),
    Variant("q6_k", None, True, 256, 768, "_256x768"),
    # IQ4_NL's table of signed values from 4-bit codes (the signed 8-bit kernels' way).
    Variant("iq4_nl", None, True, 96, 64),
    Variant("iq4_xs", None, True, 256, 256),
    Variant("iq4_xs", None, True, 512, 256, "_512x256"),
    # The lattice-grid i-quants: GGUF's blocks decoded per 16-row block to int8 panels
    # (one and two 256-k blocks per row, N not a multiple of 16 for the zero rows);
    # IQ1_M, IQ2_XS, IQ2_S's panels have scales per 16 (folded per 16).
    Variant("iq1_s", None, True, 256, 256),
    Variant("iq1_m", None, True, 256, 256),
    Variant("iq2_xxs", None, True, 256, 256),
    Variant("iq2_xxs", None, True, 512, 256, "_512x256"),
    Variant("iq2_xs", None, True, 256, 256),
    Variant("iq2_s", None, True, 256, 256),
    Variant("iq2_s", None, True, 512, 256, "_512x256"),
    Variant("iq3_xxs", None, True, 256, 256),
    Variant("iq3_s", None, True, 256, 256),
    Variant("iq3_s", None, True, 512, 256, "_512x256"),
]
VARIANT_IDS = [v.id for v in VARIANTS]
#: One variant per format (the first listed).
PER_FORMAT = list({v.fmt: v for v in reversed(VARIANTS)}.values())[::-1]

E_TOTAL, TOP_K = 6, 2


def test_every_quantized_format_is_covered():
    assert {v.fmt for v in VARIANTS} == set(WEIGHT_FORMATS) - {"bf16"}
    assert {(v.group_size, v.symmetric) for v in VARIANTS if v.fmt == "int4"} == {
        (gs, sym) for gs in (0, 32, 64, 128) for sym in (True, False)
    }
    assert [v.fmt for v in PER_FORMAT] == [f for f in WEIGHT_FORMATS if f != "bf16"]


@functools.cache
def layer(v: Variant, seed: int = 0) -> kt_ops.ExpertWeights:
    return make_quant_experts(
        v.fmt, E_TOTAL, v.H, v.I, group_size=v.group_size, symmetric=v.symmetric, seed=seed
    )


def run_op(x, ids, weights, w: kt_ops.ExpertWeights, **overrides):
    return kt_ops.moe_forward(x, ids, weights, w, **overrides)


def check(x, ids, weights, w: kt_ops.ExpertWeights):
    """Run the op; check dtype/shape and every element against the quantized reference."""
    out = run_op(x, ids, weights, w)
    assert out.dtype == x.dtype and out.shape == x.shape
    msg = quant_mismatch_report(out, reference_for(w, x, ids, weights))
    assert msg is None, f"{w.weight_format}: {msg}"
    return out


def routing(T: int, *, seed: int, ids_dtype=torch.int64, weights_dtype=torch.float32):
    """Top-2 over experts 0..E-2 (expert E-1 never gets a token), ~20% -1 slots, row 0 all -1."""
    return make_routing(
        T,
        E_TOTAL - 1,
        TOP_K,
        seed=seed,
        ids_dtype=ids_dtype,
        weights_dtype=weights_dtype,
        skip_fraction=0.2,
        skip_rows=(0,) if T > 2 else (),
    )


def routing_by_counts(counts: list[int]) -> tuple[Tensor, Tensor]:
    """Top-1 routing in shuffled order where expert e gets exactly counts[e] tokens."""
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(3))].view(-1, 1)
    weights = torch.rand(ids.shape[0], 1, generator=torch.Generator().manual_seed(4)) + 0.5
    return ids, weights


# --------------------------------------------------------------------------
# The reference dequantizer agrees with the packers' own dense input
# --------------------------------------------------------------------------


@pytest.mark.parametrize("v", VARIANTS, ids=VARIANT_IDS)
def test_packed_layer_is_valid(v):
    w = layer(v)
    for p, (n, k) in zip(w.projections, ((v.I, v.H), (v.I, v.H), (v.H, v.I))):
        p.validate()
        assert (p.n, p.k, p.weight_format) == (n, k, v.fmt)
        assert (p.zeros is not None) == (format_spec(v.fmt).zeros_required or not v.symmetric)
    # dequantized weights are close to the dense weights they were made from (2 bits: ~0.33;
    # the grid formats' simple quantizer, kt_ops.formats.grid: IQ1_S ~0.45, IQ2_XXS ~0.33)
    bound = {"q2_k": 0.4, "iq1_s": 0.55, "iq1_m": 0.5, "iq2_xxs": 0.4, "iq2_xs": 0.35,
             "iq2_s": 0.3, "iq3_xxs": 0.22}.get(v.fmt, 0.2)  # fmt: skip
    for got, want in zip(dense_weights(w), dense_expert_weights(E_TOTAL, v.H, v.I)):
        err = ((got - want).norm() / want.norm()).item()
        assert err < bound, f"{v.id}: weight quantization error {err:.3g}"


# --------------------------------------------------------------------------
# Against the reference: token counts, -1 ids, unused experts
# --------------------------------------------------------------------------


@pytest.mark.parametrize("v", VARIANTS, ids=VARIANT_IDS)
def test_token_counts(qisa, v):
    w = layer(v)
    for T in (0, 1, 2, 7, 64, 130):
        ids, weights = routing(T, seed=T)
        x = make_hidden(T, v.H, torch.float32, seed=T)
        out = check(x, ids, weights, w)
        if T > 2:
            assert torch.all(out[0] == 0), "a token with only -1 slots must give exact zeros"


@pytest.mark.parametrize("v", PER_FORMAT, ids=[v.id for v in PER_FORMAT])
def test_all_skipped_and_no_slots(qisa, v):
    w = layer(v)
    T = 5
    x = make_hidden(T, v.H, torch.float32, seed=3)
    ids = torch.full((T, TOP_K), -1, dtype=torch.int64)
    out = run_op(x, ids, torch.rand(T, TOP_K), w)
    assert out.shape == (T, v.H) and torch.all(out == 0)
    out = run_op(x, ids[:, :0], torch.empty(T, 0), w)
    assert out.shape == (T, v.H) and torch.all(out == 0)


def _poison(p: PackedProjection, experts: slice) -> PackedProjection:
    """A copy whose experts ``experts`` hold garbage codes and NaN (or 255) scales and zeros."""
    weight = p.weight.clone()
    weight[experts] = torch.randint(0, 256, weight[experts].shape, dtype=torch.uint8)
    if p.scales is None:  # the grid formats: scales inside the garbage blocks
        return dataclasses.replace(p, weight=weight)
    scales = p.scales.clone()
    scales[experts] = 255 if scales.dtype == torch.uint8 else float("nan")
    zeros = None
    if p.zeros is not None:
        zeros = p.zeros.clone()
        zeros[experts] = float("nan")
    return dataclasses.replace(p, weight=weight, scales=scales, zeros=zeros)


@pytest.mark.parametrize("v", PER_FORMAT, ids=[v.id for v in PER_FORMAT])
def test_experts_without_tokens_are_not_read(qisa, v):
    # Expert E-1 never gets a token, expert E-2 only -1 slots' worth: poison both;
    # the output must not change by a single bit.
    w = layer(v)
    T = 9
    ids, weights = routing(T, seed=4)
    ids[ids == E_TOTAL - 2] = -1
    x = make_hidden(T, v.H, seed=4)
    clean = check(x, ids, weights, w)
    unused = slice(E_TOTAL - 2, E_TOTAL)
    poisoned = kt_ops.ExpertWeights(*(_poison(p, unused) for p in w.projections))
    assert torch.equal(run_op(x, ids, weights, poisoned), clean)


# --------------------------------------------------------------------------
# Odd shapes: N not a multiple of 16, K not a multiple of 32 (int8, fp8, mxfp4)
# --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "fp8", "fp8_channel", "mxfp8", "mxfp4"])
@pytest.mark.parametrize("H,I", [(1, 1), (17, 15), (33, 50), (130, 129)])
def test_odd_sizes(qisa, fmt, H, I):
    w = make_quant_experts(fmt, 4, H, I, seed=H + I)
    T = 11
    ids, weights = make_routing(T, 4, 2, seed=H, skip_fraction=0.2)
    check(make_hidden(T, H, torch.float32, seed=I), ids, weights, w)


# --------------------------------------------------------------------------
# dtypes of activations, ids, routing weights
# --------------------------------------------------------------------------


@pytest.mark.parametrize("v", PER_FORMAT, ids=[v.id for v in PER_FORMAT])
def test_dtypes(qisa, v):
    w = layer(v)
    T = 9
    for act in (torch.bfloat16, torch.float16, torch.float32):
        for ids_dtype in (torch.int32, torch.int64):
            for wdt in {torch.float32, act}:
                ids, weights = routing(T, seed=5, ids_dtype=ids_dtype, weights_dtype=wdt)
                check(make_hidden(T, v.H, act, seed=5), ids, weights, w)


@pytest.mark.parametrize("v", [PER_FORMAT[0], PER_FORMAT[1], PER_FORMAT[2]], ids=lambda v: v.id)
def test_non_contiguous_inputs(qisa, v):
    w = layer(v)
    T = 8
    ids, weights = routing(T, seed=6)
    base = make_hidden(T, 2 * v.H, torch.float32, seed=6)
    x = base[:, ::2]
    ids_nc = ids.t().contiguous().t()
    assert not x.is_contiguous() and not ids_nc.is_contiguous()
    out = check(x, ids_nc, weights, w)
    assert torch.equal(out, run_op(x.contiguous(), ids, weights, w))


# --------------------------------------------------------------------------
# Threads: bit-identical for any thread count
# --------------------------------------------------------------------------


@pytest.mark.parametrize("v", VARIANTS, ids=VARIANT_IDS)
def test_thread_counts_bit_identical(qisa, v):
    w = layer(v)
    T = 64
    ids, weights = routing(T, seed=7)
    x = make_hidden(T, v.H, torch.float32, seed=7)  # fp32 output shows every bit
    outs = {}
    for n in THREAD_COUNTS:
        kt_ops.set_num_threads(n)
        assert kt_ops.get_num_threads() == n
        outs[n] = run_op(x, ids, weights, w)
    for n, out in outs.items():
        assert torch.equal(out, outs[1]), f"{n} threads differ bit-wise from 1 thread"
    assert quant_mismatch_report(outs[1], reference_for(w, x, ids, weights)) is None


# --------------------------------------------------------------------------
# Compute paths: q8 (integer dot), fp32 (decoded block, weight-only), auto
# --------------------------------------------------------------------------


@pytest.mark.parametrize("v", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("T", [1, 7, 130])
def test_fp32_path_matches_the_unrounded_reference(qisa, v, T):
    w = layer(v)
    ids, weights = routing(T, seed=T)
    x = make_hidden(T, v.H, torch.bfloat16, seed=T)
    # Streaming pinned: under 'auto' fp8 experts with bf16 activations take
    # the brgemm from its threshold, which rounds the scaled activations to
    # bf16 (tests/test_compute_paths.py checks that path).
    with kt_ops.use_quant_activations("fp32"), kt_ops.use_compute_path("streaming"):
        out = check(x, ids, weights, w)  # reference_for follows the mode: no q8 rounding
    ref = reference_quant_moe_forward(x, ids, weights, *dense_weights(w), activation="fp32")
    assert quant_mismatch_report(out, ref) is None


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_fp32_path_every_token_tile_split(qisa, fmt):
    # The weight-only product cuts an expert's m rows into ceil(m / 6) tiles
    # of near-equal size (8 = 4 + 4, 13 = 5 + 4 + 4): expert e gets exactly
    # counts[e] tokens, each against the unrounded reference.
    counts = list(range(1, 20)) + [25, 36, 37]
    gs = 32 if fmt == "int4" else None
    experts = make_quant_experts(fmt, len(counts), 96, 64, group_size=gs, seed=3)
    ids, weights = routing_by_counts(counts)
    x = make_hidden(ids.shape[0], 96, torch.float32, seed=5)
    with kt_ops.use_quant_activations("fp32"), kt_ops.use_compute_path("streaming"):
        out = kt_ops.moe_forward(x, ids, weights, experts)
    ref = reference_quant_moe_forward(x, ids, weights, *dense_weights(experts), activation="fp32")
    assert quant_mismatch_report(out, ref) is None


@pytest.mark.parametrize("v", PER_FORMAT, ids=[v.id for v in PER_FORMAT])
def test_q8_path_every_token_tile_split(v):
    # The q8 kernels cut an expert's m rows into register tiles of the tier's
    # size (AVX2 / AVX-512 4 tokens, AVX512_VNNI 12) and one remainder tile:
    # expert e gets counts[e] tokens, so every tile size and remainder of each
    # tier runs. Each SIMD tier against the reference, and bit-identical to the
    # others (exact int32 sums, the same fp32 fold: kernels/qint_tiles.h).
    counts = list(range(1, 28)) + [37]
    w = make_quant_experts(v.fmt, len(counts), v.H, v.I, group_size=v.group_size, seed=3)
    ids, weights = routing_by_counts(counts)
    x = make_hidden(ids.shape[0], v.H, torch.float32, seed=5)
    outs = {}
    # q8 activations on the streaming kernels, pinned (the reference follows both).
    with kt_ops.use_quant_activations("q8"), kt_ops.use_compute_path("streaming"):
        ref = reference_for(w, x, ids, weights)
        for name in [i for i in kt_ops.supported_isas() if i != "ref"]:
            with kt_ops.use_isa(name):
                outs[name] = run_op(x, ids, weights, w)
            assert quant_mismatch_report(outs[name], ref) is None, name
    first = next(iter(outs))
    for name, out in outs.items():
        assert torch.equal(out, outs[first]), f"{name} differs bit-wise from {first}"


@pytest.mark.parametrize("v", PER_FORMAT, ids=[v.id for v in PER_FORMAT])
def test_pinned_paths_are_batch_invariant(qisa, v):
    # docs/formats.md: with the activation and compute paths pinned, a token's
    # output does not depend on how many tokens share its experts. In a batch of
    # 64 its expert's rows go through prefill tiles (and their remainders); alone,
    # through the 1-token decode tile: the same bits.
    w = layer(v)
    T = 64
    ids, weights = routing(T, seed=11)
    x = make_hidden(T, v.H, torch.float32, seed=11)
    for mode, path in itertools.product(("q8", "fp32"), ("streaming", "brgemm")):
        with kt_ops.use_quant_activations(mode), kt_ops.use_compute_path(path):
            batch = run_op(x, ids, weights, w)
            for t in (1, 5, 33, 63):
                alone = run_op(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], w)
                assert torch.equal(alone[0], batch[t]), f"{mode}, {path}: token {t} alone differs"


@pytest.mark.parametrize("v", PER_FORMAT, ids=[v.id for v in PER_FORMAT])
def test_fp32_path_thread_counts_bit_identical(qisa, v):
    w = layer(v)
    T = 40
    ids, weights = routing(T, seed=3)
    x = make_hidden(T, v.H, torch.float32, seed=3)
    with kt_ops.use_quant_activations("fp32"):
        outs = []
        for n in THREAD_COUNTS:
            kt_ops.set_num_threads(n)
            outs.append(run_op(x, ids, weights, w))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


def _heavy_and_light_routing(T: int, heavy: int, light: int) -> tuple[Tensor, Tensor]:
    """Top-1 routing: tokens 0..heavy-1 to expert 0, the next ``light`` to expert 1, rest -1."""
    ids = torch.full((T, 1), -1, dtype=torch.int64)
    ids[:heavy, 0] = 0
    ids[heavy : heavy + light, 0] = 1
    return ids, torch.ones(T, 1)


@pytest.mark.parametrize("fmt", ["int8", "q8_0", "fp8"])
def test_auto_switches_path_at_the_threshold(qisa, fmt):
    v = next(v for v in PER_FORMAT if v.fmt == fmt)
    n = kt_ops.quant_fp32_min_tokens(fmt)
    w = layer(v)
    if n is None:  # int8 / q8_0 on avx512_vnni, fp8 with VBMI: 'auto' is q8 at any count
        own = kt_ops._C.kernel_names(qisa)[fmt][0]
        assert own in ("avx512_vnni/qint_q8", "avx512/fp8_vbmi"), own
        ids, weights = _heavy_and_light_routing(80, heavy=64, light=16)
        x = make_hidden(80, v.H, torch.float32, seed=11)
        with kt_ops.use_compute_path("streaming"):
            with kt_ops.use_quant_activations("auto"):
                auto = check(x, ids, weights, w)
            with kt_ops.use_quant_activations("q8"):
                assert torch.equal(auto, check(x, ids, weights, w))
        return
    assert n > 1
    T = 2 * n
    ids, weights = _heavy_and_light_routing(T, heavy=n, light=n - 1)
    x = make_hidden(T, v.H, torch.float32, seed=11)
    outs = {}
    # The streaming kernels' switch (on a VNNI CPU, 'auto' compute would send
    # the heavy int8 / q8_0 expert to the u8s8 brgemm, which takes q8: tests/
    # test_compute_paths.py).
    for mode in ("auto", "q8", "fp32"):
        with kt_ops.use_quant_activations(mode), kt_ops.use_compute_path("streaming"):
            outs[mode] = check(x, ids, weights, w)
    heavy, light = slice(0, n), slice(n, 2 * n - 1)
    # Expert 0 (n tokens) took the fp32 path, expert 1 (n - 1 tokens) the q8 one.
    assert torch.equal(outs["auto"][heavy], outs["fp32"][heavy])
    assert torch.equal(outs["auto"][light], outs["q8"][light])
    if fmt != "fp8":  # q8 rounds activations: the two paths really differ
        assert not torch.equal(outs["q8"][heavy], outs["fp32"][heavy])


def test_quant_activation_modes():
    assert kt_ops.get_quant_activations() == "auto"
    with kt_ops.use_quant_activations("q8"):
        assert kt_ops.get_quant_activations() == "q8"
        with kt_ops.use_quant_activations("fp32"):
            assert kt_ops.get_quant_activations() == "fp32"
        assert kt_ops.get_quant_activations() == "q8"
    assert kt_ops.get_quant_activations() == "auto"
    with pytest.raises(ValueError, match="mode must be 'auto', 'q8' or 'fp32', got 'int8'"):
        kt_ops.set_quant_activations("int8")
    for fmt in ("int4", "mxfp4", "q4_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "bf16"):
        assert kt_ops.quant_fp32_min_tokens(fmt) is None, fmt
    for fmt in ("int8", "q8_0", "fp8"):
        assert kt_ops.quant_fp32_min_tokens(fmt, "avx2") >= 2, fmt
    if "avx512_vnni" in kt_ops.info()["built_isas"]:
        vbmi = kt_ops.info()["cpu_features"].get("avx512_vbmi")  # fp8's fast E4M3 decode
        assert (kt_ops.quant_fp32_min_tokens("fp8", "avx512_vnni") is None) == bool(vbmi)
        for fmt in ("int8", "q8_0"):
            assert kt_ops.quant_fp32_min_tokens(fmt, "avx512_vnni") is None, fmt
    with pytest.raises(ValueError, match="int3"):
        kt_ops.quant_fp32_min_tokens("int3")


# --------------------------------------------------------------------------
# Weights from raw checkpoint blocks (every code value, not just a quantizer's)
# --------------------------------------------------------------------------

GGUF_TYPES = [
    "mxfp4", "nvfp4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k",
    "q6_k", "iq4_nl", "iq4_xs",
]  # fmt: skip


@functools.cache
def gguf_layer(qtype: str) -> kt_ops.ExpertWeights:
    # k-quants and iq4_xs: 2 super-blocks (nvfp4: 4 and 8 blocks of 64)
    H, I = (96, 64) if format_spec(qtype).gguf_block[0] == 32 else (512, 256)
    shapes = ((I, H), (I, H), (H, I))
    return kt_ops.ExpertWeights(
        *(from_gguf(qtype, random_gguf_raw(qtype, 4, n, k, seed=i), n, k)
          for i, (n, k) in enumerate(shapes))
    )  # fmt: skip


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_from_gguf_raw_blocks(qisa, qtype):
    w = gguf_layer(qtype)
    if qtype == "q8_0":  # the random blocks hold the code -128 (valid int8, never quantized to)
        assert int(w.gate.weight.view(torch.int8).min()) == -128
    for T in (1, 7, 64):
        ids, weights = make_routing(T, 4, 2, seed=T, skip_fraction=0.1)
        check(make_hidden(T, w.hidden_size, torch.float32, seed=T), ids, weights, w)


def _all_fp8_bits(shape, gen):
    """Random E4M3 bytes over every non-NaN code (subnormals, +-0, +-448 included)."""
    codes = torch.tensor([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=torch.uint8)
    return codes[torch.randint(0, codes.numel(), shape, generator=gen)]


@functools.cache
def fp8_raw_layer() -> kt_ops.ExpertWeights:
    gen = torch.Generator().manual_seed(8)
    E, H, I = 4, 200, 136
    projs = []
    for n, k in ((I, H), (I, H), (H, I)):
        bits = _all_fp8_bits((E, n, k), gen)
        scale = torch.rand(E, math.ceil(n / 128), math.ceil(k / 128), generator=gen)
        projs.append(from_fp8(bits.view(torch.float8_e4m3fn), (scale + 0.5) / (40 * math.sqrt(k))))
    return kt_ops.ExpertWeights(*projs)


@functools.cache
def mxfp4_raw_layer() -> kt_ops.ExpertWeights:
    gen = torch.Generator().manual_seed(9)
    E, H, I = 4, 96, 64
    projs = []
    for n, k in ((I, H), (I, H), (H, I)):
        blocks = torch.randint(0, 256, (E, n, k // 32, 16), dtype=torch.uint8, generator=gen)
        # 2^(E-127) * e2m1 with E around 122: weights ~0.1
        ebytes = torch.randint(119, 125, (E, n, k // 32), dtype=torch.uint8, generator=gen)
        projs.append(from_mxfp4(blocks, ebytes))
    return kt_ops.ExpertWeights(*projs)


@pytest.mark.parametrize("source", ["fp8", "mxfp4"])
def test_from_checkpoint_raw_blocks(qisa, source):
    w = fp8_raw_layer() if source == "fp8" else mxfp4_raw_layer()
    if source == "mxfp4":  # all 16 E2M1 codes occur, -0 included
        assert len(E2M1_VALUES) == 16
        nibbles = torch.cat([w.gate.weight & 15, w.gate.weight >> 4]).unique()
        assert nibbles.numel() == 16
    for T in (1, 7, 64):
        ids, weights = make_routing(T, 4, 2, seed=T, skip_fraction=0.1)
        check(make_hidden(T, w.hidden_size, torch.float32, seed=T), ids, weights, w)


def test_fp8_streaming_every_code_bit_identical_across_tiers():
    # The fp8 streaming kernels decode E4M3 per tier (AVX2: fp16 bit moves and
    # F16C; AVX-512 with VBMI: byte tables, kernels/avx512/fp8_avx512.cpp) to the
    # same fp32 values (e4m3 * 2^-8) and sum them in the same order: every
    # non-NaN code (subnormals, +-0, +-448), 1 to 5 tokens per expert, the same bits.
    w = fp8_raw_layer()
    isas = [i for i in kt_ops.supported_isas() if i != "ref"]
    if len(isas) < 2:
        pytest.skip("one SIMD tier on this CPU")
    names = {i: kt_ops._C.kernel_names(i)["fp8"][0] for i in isas}
    for T in (1, 2, 3, 5):
        ids, weights = routing_by_counts([T] * w.num_experts)
        x = make_hidden(ids.shape[0], w.hidden_size, torch.float32, seed=T)
        with kt_ops.use_quant_activations("q8"), kt_ops.use_compute_path("streaming"):
            outs = {}
            for name in isas:
                with kt_ops.use_isa(name):
                    outs[name] = run_op(x, ids, weights, w)
        for name in isas[1:]:
            assert torch.equal(outs[name], outs[isas[0]]), (T, names[name], names[isas[0]])


# --------------------------------------------------------------------------
# Scale (and zero) dtypes: the kernels read fp32, fp16 and bf16
# --------------------------------------------------------------------------


def _cast_params(p: PackedProjection, dtype: torch.dtype) -> tuple[PackedProjection, Tensor]:
    """(``p`` with scales/zeros cast to ``dtype``, the dense weights those cast values give).

    ``dequantize_weights`` takes the format's own scale dtype, so the cast values
    are converted back to it for the reference; the test asserts that this
    conversion is exact, so the reference dequantizes exactly the values the op reads.
    """
    spec_dtype = p.spec.scale_dtype
    cast = {name: (t.to(dtype) if t is not None else None)
            for name, t in (("scales", p.scales), ("zeros", p.zeros))}  # fmt: skip
    back = {}
    for name, t in cast.items():
        if t is not None:
            back[name] = t.to(spec_dtype)
            assert torch.equal(back[name].to(dtype), t), f"{name}: {dtype} -> {spec_dtype} is lossy"
        else:
            back[name] = None
    ref = dequantize_weights(dataclasses.replace(p, **back))
    return dataclasses.replace(p, **cast), ref


SCALE_DTYPE_VARIANTS = [
    v for v in VARIANTS if v.fmt == "int8" or (v.fmt == "int4" and v.group_size == 32)
] + [v for v in PER_FORMAT if v.fmt == "q4_0"]  # k-quants: uint8 scale records, no cast


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("v", SCALE_DTYPE_VARIANTS, ids=[v.id for v in SCALE_DTYPE_VARIANTS])
def test_scale_dtypes(qisa, v, dtype):
    base = layer(v)
    with single_threaded_torch():
        cast = [_cast_params(p, dtype) for p in base.projections]
    w = kt_ops.ExpertWeights(*(p for p, _ in cast))
    dense = tuple(d for _, d in cast)
    assert w.gate.scales.dtype == dtype
    T = 23
    ids, weights = routing(T, seed=10)
    x = make_hidden(T, v.H, torch.float32, seed=10)
    out = run_op(x, ids, weights, w)
    ref = reference_quant_moe_forward(x, ids, weights, *dense, activation="q8")
    msg = quant_mismatch_report(out, ref)
    assert msg is None, f"{v.id} with {dtype} scales: {msg}"
    if dtype == torch.bfloat16:
        # bf16 scales are a coarser rounding of the fp16/fp32 ones: the op must see
        # the difference (it reads the bf16 values, not the originals).
        assert not torch.equal(out, run_op(x, ids, weights, base)) or all(
            torch.equal(a, b) for a, b in zip(dense, dense_weights(base))
        )


def test_zeros_dtype_independent_of_scales(qisa):
    # fp32 scales with fp16 zeros (and the reverse) for asymmetric int4.
    v = next(v for v in VARIANTS if v.fmt == "int4" and not v.symmetric)
    base = layer(v)
    T = 13
    ids, weights = routing(T, seed=11)
    x = make_hidden(T, v.H, torch.float32, seed=11)
    ref = reference_for(base, x, ids, weights)  # fp16 -> fp32 is exact, so the same reference
    for sdt, zdt in ((torch.float32, torch.float16), (torch.float16, torch.float32)):
        projs = [dataclasses.replace(p, scales=p.scales.to(sdt), zeros=p.zeros.to(zdt))
                 for p in base.projections]  # fmt: skip
        out = run_op(x, ids, weights, kt_ops.ExpertWeights(*projs))
        assert quant_mismatch_report(out, ref) is None, (sdt, zdt)


# --------------------------------------------------------------------------
# Total error against the unquantized layer (activation quantization is sane)
# --------------------------------------------------------------------------

#: Relative Frobenius error of the op against the dense fp32 layer it was quantized
#: from (weights and activations both exact). Measured on this layer (E=6, T=64):
#: int8 1.7%, q8_0 1.5%, fp8 4.6% (E4M3 keeps 3 mantissa bits: ~2.5% rms per
#: weight, three projections in series), q6_k ~6%, q5_k ~9%, 4-bit formats 15-20%
#: (int4 symmetric g128: step amax/7 of 128 weights, ~9% rms per projection).
#: Bounds: ~1.5x the measurement, rounded up.
TOTAL_ERROR = {
    "int8": 0.03,
    "q8_0": 0.03,
    "fp8": 0.07,
    "fp8_channel": 0.07,
    "mxfp8": 0.08,
    "q6_k": 0.10,
    "q5_k": 0.15,
    "int4": 0.30,
    "mxfp4": 0.30,
    "nvfp4": 0.30,
    "q4_0": 0.30,
    "q4_1": 0.30,
    "q5_0": 0.15,
    "q5_1": 0.15,
    "q4_k": 0.30,
    "iq4_nl": 0.30,
    "iq4_xs": 0.30,
    "q3_k": 0.45,
    "q2_k": 0.80,
    # the grid formats' simple quantizer (kt_ops.formats.grid), 1.56 - 3.44 bits a weight:
    # measured 0.76, 0.70, 0.59, 0.51, 0.45, 0.34, 0.26
    "iq1_s": 1.0,
    "iq1_m": 0.95,
    "iq2_xxs": 0.8,
    "iq2_xs": 0.7,
    "iq2_s": 0.6,
    "iq3_xxs": 0.45,
    "iq3_s": 0.4,
}
#: Relative Frobenius error of the q8 kernels against the same dequantized weights
#: with fp32 activations: only the two int8 roundings of the activations (step
#: amax/127 per 32 values: ~0.5% rms each). Measured 0.5-1%.
ACTIVATION_ERROR = 0.02


def _rel(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("v", VARIANTS, ids=VARIANT_IDS)
def test_total_error_against_dense_layer(v):
    w = layer(v)
    T = 64
    ids, weights = routing(T, seed=12)
    x = make_hidden(T, v.H, torch.float32, seed=12)
    out = run_op(x, ids, weights, w)
    dense = dense_expert_weights(E_TOTAL, v.H, v.I)
    total = _rel(out, reference_quant_moe_forward(x, ids, weights, *dense, activation="fp32").out)
    assert total < TOTAL_ERROR[v.fmt], f"{v.id}: total error {total:.3g}"
    # The activation rounding alone (dequantized weights, fp32 activations).
    plain = reference_quant_moe_forward(x, ids, weights, *dense_weights(w), activation="fp32").out
    act_err = _rel(out, plain)
    if activation_of(w) == "q8":
        assert 1e-4 < act_err < ACTIVATION_ERROR, f"{v.id}: activation error {act_err:.3g}"
    else:  # fp8: fp32 activations, nothing but summation order
        assert act_err < 1e-5, f"{v.id}: {act_err:.3g}"


# --------------------------------------------------------------------------
# The q8 activation rounding of the reference
# --------------------------------------------------------------------------


def _q8_numpy(x: Tensor, block: int = 32) -> Tensor:
    """docs/formats.md's q8 rounding in numpy float32 (IEEE division), independent of torch."""
    import numpy as np

    a = x.float().numpy().reshape(-1, x.shape[-1])
    K = a.shape[1]
    kp = -(-K // block) * block
    a = np.pad(a, ((0, 0), (0, kp - K))).reshape(a.shape[0], kp // block, block)
    amax = np.abs(a).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(a * inv), -127, 127).astype(np.float32)
    out = (q * (amax / np.float32(127))).reshape(a.shape[0], kp)[:, :K]
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(x.shape)


#: x * (127 / amax) = -1.1875 * 127 / 2.375 = -63.5 in exact arithmetic. In fp32,
#: 127 / 2.375 rounds to 53.473682 and the product to -63.499996: code -63 (what the
#: kernels' ``127.f / amax`` gives). 127 * (1 / 2.375) is 53.473686: -63.500004, code -64.
TIE_BLOCK = torch.tensor([[2.375, -1.1875] + [0.0] * 30])


def test_q8_activations_follow_the_documented_formula():
    step = torch.tensor(2.375) / torch.tensor(127.0)  # fp32, as the kernels
    assert q8_activations(TIE_BLOCK)[0, 1] == -63 * step
    g = torch.Generator().manual_seed(0)
    for x in (
        TIE_BLOCK,
        torch.randn(64, 256, generator=g).to(torch.bfloat16),
        torch.randn(7, 50, generator=g) * 3,
        torch.zeros(2, 40),
    ):
        assert torch.equal(q8_activations(x), _q8_numpy(x)), x.shape


def test_quantize_activations_q8_matches_the_kernel_formula():
    from kt_ops.formats import quantize_activations_q8

    # x = -1.1875, amax = 2.375: the kernels round to -63 (127 * reciprocal(amax) gives -64)
    assert torch.equal(quantize_activations_q8(TIE_BLOCK), _q8_numpy(TIE_BLOCK))
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    assert torch.equal(quantize_activations_q8(x), _q8_numpy(x))


def test_the_op_rounds_activation_ties_as_documented(qisa):
    # An int8 layer fed the tie block: the op agrees with the documented rounding
    # (q8_activations, code -63) and not with the other code (-64).
    H, I = 32, 32
    w = make_quant_experts("int8", 1, H, I, seed=15)
    x = TIE_BLOCK.clone()
    ids, weights = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1)
    out = run_op(x, ids, weights, w)
    ref = reference_for(w, x, ids, weights)
    assert quant_mismatch_report(out, ref) is None
    gate, up, down = dense_weights(w)
    other = q8_activations(x)
    other[0, 1] = -64 * (torch.tensor(2.375) / torch.tensor(127.0))  # the neighbouring code
    h = q8_activations(torch.nn.functional.silu(other @ gate[0].T) * (other @ up[0].T))
    wrong = QuantReference(h @ down[0].T, ref.slack)
    assert quant_mismatch_report(out, wrong) is not None


def _q8_edge_rows() -> list[list[float]]:
    """Rows of 64 (two 32-blocks) that stress the q8 quantizer of every tier."""
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(64, generator=g) * s for s in (1e-30, 1e-3, 1.0, 3e4, 1e38)]
    rows.append(torch.zeros(64))
    tie = torch.zeros(64)
    tie[:32] = TIE_BLOCK[0]
    tie[32:] = torch.arange(32) - 15.5  # many x * 127 / amax near .5
    rows.append(tie)
    for bad in (float("nan"), float("inf"), float("-inf")):
        r = torch.randn(64, generator=g)
        r[40] = bad  # the second block is non-finite, the first is not
        rows.append(r)
    return [r.tolist() for r in rows]


def test_q8_records_are_bit_identical_on_every_tier():
    import numpy as np

    rows = _q8_edge_rows()
    for isa in kt_ops.supported_isas():
        for x in rows:
            rec = kt_ops._C._testing.quantize_row_q8(x, isa)
            ref_rec = kt_ops._C._testing.quantize_row_q8(x, "ref")
            assert rec == ref_rec, (isa, x[:4])
            codes = np.frombuffer(rec[:64], dtype=np.int8)
            scales = np.frombuffer(rec[64:72], dtype=np.float32)
            sum16 = np.frombuffer(rec[72:88], dtype=np.float32)
            xt = torch.tensor(x)
            want = quantize_activations_q8(xt[None])[0].numpy()
            got = codes.astype(np.float32) * np.repeat(scales, 32)
            finite = np.isfinite(want)
            assert np.array_equal(got[finite], want[finite]), isa
            # A non-finite block: zero codes, NaN scale and sums (its outputs become NaN).
            for b in range(2):
                if not np.isfinite(np.array(x[32 * b : 32 * b + 32])).all():
                    assert not codes[32 * b : 32 * b + 32].any() and np.isnan(scales[b])
                    assert np.isnan(sum16[2 * b : 2 * b + 2]).all()
                else:
                    for h in range(2):
                        part = codes[32 * b + 16 * h : 32 * b + 16 * h + 16].astype(np.float32)
                        assert sum16[2 * b + h] == scales[b] * np.float32(part.sum())


@pytest.mark.parametrize("fmt", ["int8", "int4", "q4_k"])
def test_non_finite_activations_reach_the_output(qisa, fmt):
    # A NaN or inf in a token's hidden state makes that token's output NaN (as
    # torch's matmul would), rather than being dropped by the q8 rounding.
    H, I, E = 256, 256, 4
    w = make_quant_experts(fmt, E, H, I, seed=5)
    T = 6
    x = make_hidden(T, H, torch.float32, seed=2)
    x[1, 7] = float("nan")
    x[4, 200] = float("inf")
    ids = torch.tensor([[e % E, (e + 1) % E] for e in range(T)])
    out = run_op(x, ids, torch.full((T, 2), 0.5), w)
    assert torch.isnan(out[1]).all() and torch.isnan(out[4]).all()
    ok = [0, 2, 3, 5]
    assert torch.isfinite(out[ok]).all()


# --------------------------------------------------------------------------
# The checks can fail
# --------------------------------------------------------------------------


@pytest.mark.parametrize("v", PER_FORMAT, ids=[v.id for v in PER_FORMAT])
def test_checker_detects_wrong_weights(v):
    w = layer(v)
    T = 16
    ids, weights = routing(T, seed=13)
    x = make_hidden(T, v.H, torch.float32, seed=13)
    ref = reference_for(w, x, ids, weights)
    assert quant_mismatch_report(run_op(x, ids, weights, w), ref) is None
    e = int(ids[ids >= 0][0])
    # one code byte of a used expert changed: first block (rows 0-15), all rows of the
    # byte's word change, so some token sees it
    for proj in ("gate", "up", "down"):
        projs = dict(zip(("gate", "up", "down"), w.projections))
        p = projs[proj]
        weight = p.weight.clone()
        flat = weight.view(weight.shape[0], -1)
        flat[e, :64] ^= 0x44  # one [16 rows][4 bytes] word: codes move by 4 (or 64)
        projs[proj] = dataclasses.replace(p, weight=weight)
        out = run_op(x, ids, weights, kt_ops.ExpertWeights(**projs))
        assert quant_mismatch_report(out, ref) is not None, proj
    # one scale of a used expert doubled: gate's row 0, its first group (every token of
    # expert e reads it); k-quants: row 0's super-block scale d (fp16, first 2 bytes of
    # the block's first record)
    projs = list(w.projections)
    if format_spec(v.fmt).is_grid:  # the scale d of gate's row 0, first block, doubled
        weight = projs[0].weight.clone()
        weight.view(weight.shape[0], -1)[e, 0:2].view(torch.float16).mul_(2)
        projs[0] = dataclasses.replace(projs[0], weight=weight)
        out = run_op(x, ids, weights, kt_ops.ExpertWeights(*projs))
        assert quant_mismatch_report(out, ref) is not None
        return
    scales = projs[0].scales.clone()
    flat = scales.view(scales.shape[0], -1)
    if format_spec(v.fmt).is_kquant:
        flat[e, 0:2].view(torch.float16).mul_(2)
    elif scales.dtype == torch.uint8:
        flat[e, 0] += 1  # UE8M0: x2
    else:
        flat[e, 0] *= 2
    assert 1 <= torch.count_nonzero(scales != projs[0].scales) <= 2  # one value's bytes
    projs[0] = dataclasses.replace(projs[0], scales=scales)
    out = run_op(x, ids, weights, kt_ops.ExpertWeights(*projs))
    assert quant_mismatch_report(out, ref) is not None


@pytest.mark.parametrize(
    "v", [v for v in PER_FORMAT if format_spec(v.fmt).activation == "q8"], ids=lambda v: v.id
)
def test_reference_without_activation_rounding_is_not_close(v):
    # The tight tolerance relies on modelling the q8 rounding: a reference without it
    # is off by more than even a flat 2e-3 of max|ref| (100x TOL_QUANT.compute).
    w = layer(v)
    T = 16
    ids, weights = routing(T, seed=14)
    x = make_hidden(T, v.H, torch.float32, seed=14)
    out = run_op(x, ids, weights, w)
    plain = reference_quant_moe_forward(x, ids, weights, *dense_weights(w), activation="fp32")
    assert quant_mismatch_report(out, plain, Tolerance(compute=2e-3)) is not None
    # ... while the tie slack of the real reference stays a small part of the output
    ref = reference_for(w, x, ids, weights)
    assert quant_mismatch_report(out, ref) is None
    # (observed: max 0.15-0.5% of max|ref|, mean 0.03-0.26% of mean|ref|)
    assert ref.slack.max() < 0.01 * ref.out.abs().max()
    assert ref.slack.mean() < 0.005 * ref.out.abs().mean()


# --------------------------------------------------------------------------
# Coverage of the ISA paths by this file (runs last: conftest moves it)
# --------------------------------------------------------------------------


@pytest.mark.isa_coverage
def test_every_supported_isa_ran_the_quantized_kernels(request):
    selected = [it for it in request.session.items if "qisa" in it.fixturenames]
    if not selected:
        pytest.skip("no quantized ISA-parametrized test selected in this run")
    missing = [name for name in kt_ops.supported_isas() if QUANT_ISAS[name] == 0]
    assert not missing, (
        f"this CPU supports ISA path(s) {missing} that no quantized-format test exercised; "
        f"exercised: {dict(QUANT_ISAS)}"
    )
