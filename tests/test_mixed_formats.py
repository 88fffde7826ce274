"""Per-projection weight formats: ``weight_format='gate,up,down'`` (e.g. ``'q4_k,q4_k,q6_k'``).

GGUF Q4_K_M files store some layers' ``ffn_down`` in q6_k while gate/up are q4_k;
``kt.moe_forward`` takes one format name or three comma-separated names, and one
group size per projection (``group_sizes``). Any formats mix, bf16 and fp8 included
(issue 9: one driver); each projection keeps its own format, group size, scale and
zero dtypes.

Reference: the three projections dequantized by ``kt_ops.formats.dequantize_weights``
(each in its own format) and ``reference_quant_moe_forward`` of tests/reference.py
(all qint formats round activations to q8 alike). Under
``use_quant_activations('auto')`` each projection picks its path by its own format's
threshold (``quant_fp32_min_tokens``): gate/up by theirs, down by its own, so a
heavy expert of ``'mxfp4,mxfp4,int8'`` multiplies q8 activations in gate/up and
fp32 ones in down. ``mixed_reference`` models that per projection.

Covered: forward on every ISA path for six mixes (plus two with int4 on down and
two at sizes the packers pad), T = 0/1/7/64 (in the default 'auto' mode: at T = 64
the int8/q8_0 projections of most experts take the fp32 path, the others q8), -1
slots, experts without tokens (poisoned, never read); the down format matters; a
scale dtype per projection; 'fp32'/'q8'/'auto' modes; 1 vs 2 threads bit-identical;
clear errors; opcheck, fake kernel and torch.compile(fullgraph); ``MoEExperts.from_packed``;
LoRA (functional and ``add_lora``) forward and gradients on a mixed base; a GGUF
file with Q4_K gate/up and Q6_K down through the loader, the converter and
``replace_experts(converted_dir=...)``.
"""

# T, H, I, E, K: tokens, hidden, intermediate, experts, top-k (the design notes' names).
# ruff: noqa: E741

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import pytest
import torch
from checkpoints import ROLES, Q, write_gguf
from reference import (
    TINY_MOE_CONFIG,
    WEIGHT_NAMES,
    assert_matches_reference,
    dense_expert_weights,
    dense_weights,
    make_hidden,
    make_routing,
    mismatch_report,
    per_projection_reference,
    quant_mismatch_report,
    raw_op_kwargs,
    reference_for,
    reference_quant_moe_forward,
    single_threaded_torch,
    tolerance_for,
)
from test_lora import ALL3, Case, assert_grads_match, make_problem, op_grads
from test_quant_forward import _cast_params, _heavy_and_light_routing, _poison
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

import kt_ops
from kt_ops.convert import ConvertedExperts, convert, load_converted
from kt_ops.formats import dequantize_weights, format_spec, quantize_weights
from kt_ops.layer import ExpertWeights, join_weight_format, layer_args, split_weight_format
from kt_ops.loaders import GGUFCheckpoint
from kt_ops.nn import MoEExperts

OP = torch.ops.kt.moe_forward
E_TOTAL, TOP_K = 6, 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------
# Mixed layers and their reference
# --------------------------------------------------------------------------


def formats(w: kt_ops.ExpertWeights) -> tuple[str, str, str]:
    """The (gate, up, down) format names of ``w``."""
    return tuple(p.weight_format for p in w.projections)


@dataclasses.dataclass(frozen=True)
class Mix:
    """Formats of gate, up, down; int4's group size and symmetry; a layer shape all allow."""

    fmts: tuple[str, str, str]
    H: int
    I: int
    group_size: Optional[int] = None
    symmetric: bool = True

    @property
    def id(self) -> str:
        gs = "" if self.group_size is None else f"_g{self.group_size}"
        return "-".join(self.fmts) + gs + ("" if self.symmetric else "_asym")

    @property
    def weight_format(self) -> str:
        return ",".join(self.fmts)


# K-quants need K (H for gate/up, I for down) a multiple of 256; int4 a multiple of its
# group; q8_0/q4_0 of 32 (int8 and mxfp4 pad K, and N to 16 rows, themselves).
MIXES = [
    Mix(("q4_k", "q4_k", "q6_k"), 256, 256),  # GGUF Q4_K_M
    Mix(("q5_k", "q5_k", "q6_k"), 256, 256),  # GGUF Q5_K_M
    Mix(("int4", "int4", "q8_0"), 96, 64, 32, False),  # zeros on gate/up only
    Mix(("q4_0", "q4_0", "q8_0"), 96, 64),
    Mix(("mxfp4", "mxfp4", "int8"), 96, 64),  # uint8 UE8M0 scales + fp32 channel scales
    Mix(("int8", "q4_k", "q6_k"), 256, 256),  # gate != up
    # int4 on down: group_size is down's; zeros on gate/up (q4_k) but not down, or down only
    Mix(("q4_k", "q4_k", "int4"), 256, 256, 128, True),
    Mix(("q8_0", "q8_0", "int4"), 96, 64, 64, False),
    # K not a multiple of 32 and N not a multiple of 16 (the packers pad), gate != up
    Mix(("int8", "mxfp4", "int8"), 50, 40),
    Mix(("mxfp4", "int8", "mxfp4"), 17, 15),
    # issue 9: bf16 and fp8 mix with anything (one driver); odd sizes too
    Mix(("bf16", "bf16", "q4_k"), 256, 256),
    Mix(("q4_k", "q4_k", "bf16"), 256, 256),
    Mix(("fp8", "fp8", "q6_k"), 256, 256),
    Mix(("int4", "fp8", "bf16"), 96, 64, 32, False),
    Mix(("bf16", "fp8", "int8"), 50, 40),
    Mix(("fp8", "bf16", "fp8"), 17, 15),
    # the low-bit GGUF mixes: Q3_K_M-like and Q2_K-like
    Mix(("q3_k", "q3_k", "q4_k"), 256, 256),
    Mix(("q2_k", "q2_k", "q3_k"), 256, 256),
    # IQ4_XS files: an iq4_nl or q5_k projection beside iq4_xs (signed table codes beside
    # the unsigned 4/5-bit kernels in one layer)
    Mix(("iq4_xs", "iq4_xs", "iq4_nl"), 256, 256),
    Mix(("iq4_xs", "q5_k", "iq4_xs"), 256, 256),
    # Q4_K_M / Q5_K_M files of models whose expert width is not a multiple of 256: the
    # down projection falls back to q5_0 / q5_1 (llama.cpp), beside k-quant gate / up
    Mix(("q4_k", "q4_k", "q5_0"), 256, 160),
    Mix(("q5_k", "q5_k", "q5_1"), 256, 96),
    Mix(("q4_1", "q5_1", "q5_0"), 96, 64),
]
MIX_IDS = [m.id for m in MIXES]
#: The six mixes of the brief (the first six).
MAIN_MIXES = MIXES[:6]


def _quantize(w: Tensor, fmt: str, mix: Mix):
    if fmt == "int4":
        return quantize_weights(w, fmt, mix.group_size, mix.symmetric)
    return quantize_weights(w, fmt)


@functools.cache
def mixed_layer(mix: Mix, E: int = E_TOTAL, seed: int = 0) -> kt_ops.ExpertWeights:
    """``dense_expert_weights`` of ``mix``'s shape, each projection quantized in its format."""
    dense = dense_expert_weights(E, mix.H, mix.I, seed=seed)
    with single_threaded_torch():
        return kt_ops.ExpertWeights(*(_quantize(w, f, mix) for w, f in zip(dense, mix.fmts)))


@functools.cache
def uniform_layer(mix: Mix, fmt: str, E: int = E_TOTAL, seed: int = 0) -> kt_ops.ExpertWeights:
    """The same dense weights with all three projections in ``fmt``."""
    dense = dense_expert_weights(E, mix.H, mix.I, seed=seed)
    with single_threaded_torch():
        return kt_ops.ExpertWeights(*(_quantize(w, fmt, mix) for w in dense))


def run_op(x, ids, weights, w: kt_ops.ExpertWeights, **overrides) -> Tensor:
    """``kt_ops.moe_forward``; with ``overrides``, the raw op with those arguments replaced.

    Overrides are the raw op's (``weight_format``, ``group_sizes``, one packed
    tensor by name: ``reference.raw_op_kwargs``). A ``weight_format`` override
    without ``group_sizes`` takes each named format's group size when it has
    one, else ``w``'s.
    """
    if not overrides:
        return kt_ops.moe_forward(x, ids, weights, w)
    fmt = overrides.get("weight_format", w.weight_format)
    if "group_sizes" not in overrides:
        try:
            own = [format_spec(f).group_sizes for f in split_weight_format(fmt)]
        except ValueError:  # a bad weight_format: the op names it
            own = [()] * 3
        groups = zip(own, w.group_sizes)
        overrides["group_sizes"] = [g[0] if len(g) == 1 else wg for g, wg in groups]
        overrides["group_sizes"] += list(w.group_sizes)[len(overrides["group_sizes"]) :]
    named = {
        "hidden_states": x,
        "topk_ids": ids,
        "topk_weights": weights,
        **dict(zip(WEIGHT_NAMES, w.tensors())),
        "weight_format": w.weight_format,
        "sizes": [w.hidden_size, w.intermediate_size],
        **overrides,
    }
    return OP(**raw_op_kwargs(named))


def mixed_reference(w: kt_ops.ExpertWeights, x: Tensor, ids: Tensor, topk_weights: Tensor):
    """The reference of ``run_op(x, ids, topk_weights, w)`` in the current activation mode."""
    return reference_for(w, x, ids, topk_weights)


def check(x, ids, weights, w: kt_ops.ExpertWeights) -> Tensor:
    out = run_op(x, ids, weights, w)
    assert out.dtype == x.dtype and out.shape == x.shape
    msg = quant_mismatch_report(out, mixed_reference(w, x, ids, weights), tolerance_for(w))
    assert msg is None, f"{w.weight_format} (mode {kt_ops.get_quant_activations()}): {msg}"
    return out


def routing(T: int, *, seed: int):
    """Top-2 over experts 0..E-2 (expert E-1 never gets a token), ~20% -1 slots, row 0 all -1."""
    return make_routing(
        T, E_TOTAL - 1, TOP_K, seed=seed, skip_fraction=0.2, skip_rows=(0,) if T > 2 else ()
    )


def test_per_projection_reference_reduces_to_the_shared_one():
    # The per-projection reference with one choice for all projections is exactly
    # reference_quant_moe_forward (so the 'auto' checks use the same maths).
    w = mixed_layer(MIXES[4])
    T = 20
    ids, weights = routing(T, seed=1)
    x = make_hidden(T, MIXES[4].H, torch.float32, seed=1)
    for mins, act in (((None,) * 3, "q8"), ((1,) * 3, "fp32")):
        got = per_projection_reference(x, ids, weights, dense_weights(w), mins)
        want = reference_quant_moe_forward(x, ids, weights, *dense_weights(w), activation=act)
        assert torch.equal(got.out, want.out) and torch.equal(got.slack, want.slack), act


def test_split_and_join_weight_format():
    assert split_weight_format("q4_k") == ("q4_k",) * 3
    assert split_weight_format("q4_k,q4_k,q6_k") == ("q4_k", "q4_k", "q6_k")
    assert split_weight_format("int8,q4_k,q6_k") == ("int8", "q4_k", "q6_k")
    assert split_weight_format("bf16,bf16,bf16") == ("bf16",) * 3
    # any mix, bf16 and fp8 included (issue 9)
    assert split_weight_format("q4_k,q4_k,bf16") == ("q4_k", "q4_k", "bf16")
    assert split_weight_format("fp8,bf16,int4") == ("fp8", "bf16", "int4")
    assert join_weight_format("q4_k", "q4_k", "q6_k") == "q4_k,q4_k,q6_k"
    assert join_weight_format("q6_k", "q6_k", "q6_k") == "q6_k"
    for m in MIXES:
        assert split_weight_format(join_weight_format(*m.fmts)) == m.fmts


@pytest.mark.parametrize("mix", MIXES, ids=MIX_IDS)
def test_mixed_layer_is_what_it_claims(mix):
    w = mixed_layer(mix)
    assert formats(w) == mix.fmts and w.weight_format == mix.weight_format
    for p, (n, k) in zip(w.projections, ((mix.I, mix.H), (mix.I, mix.H), (mix.H, mix.I))):
        p.validate()
        assert (p.n, p.k) == (n, k)


# --------------------------------------------------------------------------
# Forward against the reference, every ISA path
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mix", MIXES, ids=MIX_IDS)
def test_forward_matches_reference(isa, mix):
    w = mixed_layer(mix)
    for T in (0, 1, 7, 64):
        ids, weights = routing(T, seed=T)
        x = make_hidden(T, mix.H, torch.float32, seed=T)
        out = check(x, ids, weights, w)
        if T > 2:
            assert torch.all(out[0] == 0), "a token with only -1 slots must give exact zeros"
    # bf16 activations too (the output rounding term of the tolerance)
    ids, weights = routing(9, seed=9)
    check(make_hidden(9, mix.H, torch.bfloat16, seed=9), ids, weights, w)


@pytest.mark.parametrize("mix", MAIN_MIXES, ids=MIX_IDS[:6])
def test_experts_without_tokens_are_not_read(isa, mix):
    # Expert E-1 never gets a token, expert E-2 only -1 slots: poison both in all three
    # projections (each in its own format); the output must not change by a bit.
    w = mixed_layer(mix)
    T = 9
    ids, weights = routing(T, seed=4)
    ids[ids == E_TOTAL - 2] = -1
    x = make_hidden(T, mix.H, torch.float32, seed=4)
    clean = check(x, ids, weights, w)
    unused = slice(E_TOTAL - 2, E_TOTAL)
    poisoned = kt_ops.ExpertWeights(*(_poison(p, unused) for p in w.projections))
    assert torch.equal(run_op(x, ids, weights, poisoned), clean)


@pytest.mark.parametrize(
    "mix,uniform",
    [(MIXES[0], "q4_k"), (MIXES[1], "q5_k"), (MIXES[3], "q4_0"), (MIXES[4], "mxfp4")],
    ids=lambda v: v.id if isinstance(v, Mix) else v,
)
def test_down_format_matters(mix, uniform):
    # The same dense weights with down in gate/up's format: a different result, which
    # the mixed reference rejects (the op really reads down in its own format).
    w = mixed_layer(mix)
    same = uniform_layer(mix, uniform)
    assert same.weight_format == uniform
    assert torch.equal(same.gate.weight, w.gate.weight)  # gate/up identical, down differs
    T = 16
    ids, weights = routing(T, seed=2)
    x = make_hidden(T, mix.H, torch.float32, seed=2)
    mixed = check(x, ids, weights, w)
    plain = check(x, ids, weights, same)
    assert not torch.equal(mixed, plain)
    assert quant_mismatch_report(plain, mixed_reference(w, x, ids, weights)) is not None


@pytest.mark.parametrize("fmt", ["q4_k", "int8"])
def test_three_equal_names_are_one_format(fmt):
    mix = MIXES[0] if fmt == "q4_k" else MIXES[4]
    w = uniform_layer(mix, fmt)
    T = 7
    ids, weights = routing(T, seed=3)
    x = make_hidden(T, mix.H, torch.float32, seed=3)
    one = run_op(x, ids, weights, w)
    three = run_op(x, ids, weights, w, weight_format=f"{fmt},{fmt},{fmt}")
    assert torch.equal(one, three)


def test_group_sizes_are_per_projection():
    # 'q4_k,q4_k,q6_k' has one group size per format (32, 32, 16): the op takes exactly
    # those, each projection its own (there is no shared group_size to ignore any more).
    w = mixed_layer(MIXES[0])
    assert w.group_sizes == (32, 32, 16)
    T = 7
    ids, weights = routing(T, seed=3)
    x = make_hidden(T, 256, torch.float32, seed=3)
    want = run_op(x, ids, weights, w)
    assert torch.equal(run_op(x, ids, weights, w, group_sizes=[32, 32, 16]), want)
    for gs, proj in (([16, 32, 16], "gate"), ([32, 16, 16], "up"), ([32, 32, 32], "down")):
        with pytest.raises(RuntimeError, match=rf"group size \d+ of {proj} is not valid"):
            run_op(x, ids, weights, w, group_sizes=gs)


@pytest.mark.parametrize(
    "dtypes",
    [
        (torch.float32, torch.bfloat16, torch.float32),
        (torch.bfloat16, torch.float16, torch.bfloat16),
        (torch.float16, torch.float32, torch.bfloat16),
    ],
    ids=lambda d: "-".join(str(t).removeprefix("torch.") for t in d),
)
def test_scale_dtypes_per_projection(dtypes):
    # With mixed formats each projection has its own scale (and zero) dtype, even gate
    # and up of one format: int4 gate/up and q8_0 down cast to three different dtypes.
    mix = MIXES[2]
    base = mixed_layer(mix)
    with single_threaded_torch():
        cast = [_cast_params(p, d) for p, d in zip(base.projections, dtypes)]
    w = kt_ops.ExpertWeights(*(p for p, _ in cast))
    assert tuple(p.scales.dtype for p in w.projections) == dtypes
    T = 23
    ids, weights = routing(T, seed=10)
    x = make_hidden(T, mix.H, torch.float32, seed=10)
    with kt_ops.use_quant_activations("q8"):
        out = run_op(x, ids, weights, w)
    ref = reference_quant_moe_forward(x, ids, weights, *(d for _, d in cast), activation="q8")
    msg = quant_mismatch_report(out, ref)
    assert msg is None, f"{dtypes}: {msg}"
    # bf16 scales are coarser than the fp16 originals: the op reads the cast values
    assert not torch.equal(out, run_op(x, ids, weights, base))


# --------------------------------------------------------------------------
# Compute paths: 'fp32', 'q8' and per-projection 'auto'
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fp32", "q8"])
@pytest.mark.parametrize("mix", MAIN_MIXES, ids=MIX_IDS[:6])
def test_modes_match_reference(isa, mix, mode):
    w = mixed_layer(mix)
    T = 40
    ids, weights = routing(T, seed=5)
    x = make_hidden(T, mix.H, torch.bfloat16, seed=5)
    with kt_ops.use_quant_activations(mode):
        out = check(x, ids, weights, w)
    act = "fp32" if mode == "fp32" else "q8"
    ref = reference_quant_moe_forward(x, ids, weights, *dense_weights(w), activation=act)
    assert quant_mismatch_report(out, ref) is None


#: Mixes where 'auto' sends some projections of a heavy expert to fp32 and others to q8.
AUTO_MIXES = [m for m in MAIN_MIXES if {"int8", "q8_0"} & set(m.fmts)]


def test_auto_mixes_have_split_thresholds():
    assert len(AUTO_MIXES) == 4
    for m in AUTO_MIXES:
        mins = {kt_ops.quant_fp32_min_tokens(f, "avx2") for f in m.fmts}
        assert None in mins and len(mins) == 2, m.id


@pytest.mark.parametrize("mix", AUTO_MIXES, ids=[m.id for m in AUTO_MIXES])
def test_auto_decides_per_projection(isa, mix):
    # Expert 0 gets n rows (n = the int8/q8_0 threshold), expert 1 n - 1. Under 'auto'
    # the heavy expert's int8/q8_0 projections take the fp32 path and the others q8,
    # so its tokens match neither the all-q8 nor the all-fp32 run; the light expert's
    # tokens equal the q8 run bit for bit.
    n = min(kt_ops.quant_fp32_min_tokens(f) or 10**9 for f in mix.fmts)
    if n == 10**9:
        pytest.skip(f"no fp32 switch for {mix.id} on {isa} (int8 / q8_0 on avx512_vnni)")
    w = mixed_layer(mix)
    T = 2 * n
    ids, weights = _heavy_and_light_routing(T, heavy=n, light=n - 1)
    x = make_hidden(T, mix.H, torch.float32, seed=11)
    outs = {}
    # The streaming kernels' switch (not the u8s8 brgemm's: tests/test_compute_paths.py).
    for mode in ("auto", "q8", "fp32"):
        with kt_ops.use_quant_activations(mode), kt_ops.use_compute_path("streaming"):
            outs[mode] = check(x, ids, weights, w)
    heavy, light = slice(0, n), slice(n, 2 * n - 1)
    assert torch.equal(outs["auto"][light], outs["q8"][light])
    assert not torch.equal(outs["auto"][heavy], outs["q8"][heavy])
    assert not torch.equal(outs["auto"][heavy], outs["fp32"][heavy])
    # ... and a reference that switched all three projections at once would not pass
    whole = reference_quant_moe_forward(
        x, ids, weights, *dense_weights(w), activation="q8", fp32_min_tokens=n
    )
    assert quant_mismatch_report(outs["auto"], whole) is not None


# --------------------------------------------------------------------------
# Threads: bit-identical
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mix", MIXES, ids=MIX_IDS)
def test_thread_counts_bit_identical(mix):
    w = mixed_layer(mix)
    T = 64
    ids, weights = routing(T, seed=7)
    x = make_hidden(T, mix.H, torch.float32, seed=7)
    for mode in ("auto", "fp32"):
        with kt_ops.use_quant_activations(mode):
            outs = []
            for n in (1, 2):
                kt_ops.set_num_threads(n)
                outs.append(run_op(x, ids, weights, w))
            assert torch.equal(outs[0], outs[1]), f"{mode}: 2 threads differ from 1"
            assert quant_mismatch_report(outs[0], mixed_reference(w, x, ids, weights)) is None


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


def _k_inputs(w: kt_ops.ExpertWeights, T: int = 3):
    ids, weights = make_routing(T, w.num_experts, TOP_K, seed=0)
    return make_hidden(T, w.hidden_size, torch.float32, seed=0), ids, weights


def call(w: kt_ops.ExpertWeights, **overrides) -> Tensor:
    return run_op(*_k_inputs(w), w, **overrides)


@pytest.mark.parametrize(
    "fmt,match",
    [
        ("q4_k,q6_k", r"weight_format='q4_k,q6_k' must be one format name or three "
                      r"comma-separated names.*got 2 names"),
        ("q4_k,q4_k,q6_k,q6_k", "one format name or three comma-separated names.*got 4"),
        # bf16 / fp8 mix with anything now: q4_k tensors called so are named instead
        ("q4_k,q4_k,bf16", r"down_weight must be bf16 for weight_format='bf16'"),
        ("bf16,q4_k,q4_k", r"gate_weight must be bf16 for weight_format='bf16'"),
        ("fp8,fp8,q6_k", r"gate_weight has shape .* but weight_format='fp8' expects"),
        ("q4_k,fp8,q6_k", r"up_weight has shape .* but weight_format='fp8' expects"),
        ("q4_k,q4_k,nope", r"weight_format='nope'.*q4_k.*q6_k"),
        ("q4_k,,q6_k", r"weight_format=''"),
        ("q4_k, q4_k, q6_k", r"weight_format=' q4_k'"),
    ],
)  # fmt: skip
def test_bad_weight_format(fmt, match):
    with pytest.raises(RuntimeError, match=match):
        call(mixed_layer(MIXES[0]), weight_format=fmt)


@pytest.mark.parametrize(
    "fmt,match",
    [
        ("q4_k,q6_k", "one format name or three comma-separated names"),
        ("q4_k,q4_k,bf16,fp8", "one format name or three comma-separated names"),
        ("q4_k,q4_k,nope", "unknown weight_format 'nope'"),
        ("", "unknown weight_format ''"),
    ],
)
def test_split_weight_format_errors(fmt, match):
    with pytest.raises(ValueError, match=match):
        split_weight_format(fmt)


@pytest.mark.parametrize("bad", [48, 8, 16, 256])
def test_int4_group_size_in_a_mix(bad):
    # The error names the int4 projection: gate in 'int4,int4,q8_0', down in
    # 'q8_0,q8_0,int4'.
    with pytest.raises(
        RuntimeError, match=rf"group size {bad} of gate is not valid for weight_format='int4'"
    ):
        call(mixed_layer(MIXES[2]), group_sizes=[bad, bad, 32])
    with pytest.raises(
        RuntimeError, match=rf"group size {bad} of up is not valid for weight_format='int4'"
    ):
        call(mixed_layer(MIXES[2]), group_sizes=[32, bad, 32])
    with pytest.raises(
        RuntimeError, match=rf"group size {bad} of down is not valid for weight_format='int4'"
    ):
        call(mixed_layer(MIXES[7]), group_sizes=[32, 32, bad])


def test_int4_group_size_of_another_packing_in_a_mix():
    # down int4 packed with group 64 (I = 64), called as group 32: the scales disagree.
    with pytest.raises(RuntimeError, match="down_scales has shape"):
        call(mixed_layer(MIXES[7]), group_sizes=[32, 32, 32])


def test_tensors_packed_for_another_down_format():
    # A q4_k-packed down with 'q4_k,q4_k,q6_k' (with or without its zeros): named.
    w = uniform_layer(MIXES[0], "q4_k")
    for extra in ({}, {"down_zeros": None}):
        with pytest.raises(RuntimeError, match=r"down_weight has shape .*weight_format='q6_k'"):
            call(w, weight_format="q4_k,q4_k,q6_k", **extra)
    # The other way round: q6_k down called as q4_k (uniform): q4_k wants zeros and shape.
    with pytest.raises(RuntimeError, match="down_weight has shape"):
        call(mixed_layer(MIXES[0]), weight_format="q4_k")
    # q6_k down tensors with a q4_k format on up: the up tensors are named
    m = mixed_layer(MIXES[0])
    with pytest.raises(RuntimeError, match="up_weight has shape"):
        call(m, weight_format="q4_k,q6_k,q6_k")


def test_scales_and_zeros_of_another_projection_format():
    w = mixed_layer(MIXES[0])  # q4_k, q4_k, q6_k
    with pytest.raises(RuntimeError, match="down_zeros was given, but weight_format='q6_k'"):
        call(w, down_zeros=torch.zeros_like(w.down.scales))
    # q6_k scale records (288 bytes) where q4_k's (256 bytes, with the mins) belong
    with pytest.raises(RuntimeError, match=r"up_scales has shape .*weight_format='q4_k'"):
        call(w, up_scales=w.down.scales)
    w = mixed_layer(MIXES[4])  # mxfp4, mxfp4, int8
    with pytest.raises(RuntimeError, match="gate_scales must be uint8 UE8M0"):
        call(w, gate_scales=w.down.scales)


def test_fake_kernel_checks_each_projection():
    w = uniform_layer(MIXES[0], "q4_k")
    x, ids, weights = _k_inputs(w)
    args = (x, ids, weights) + layer_args(w, None, "silu", x)
    with FakeTensorMode() as mode:
        fx, fids, fw, fweights, _, sizes, _, *rest = tree_map(
            lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, args
        )
        with pytest.raises(RuntimeError, match="down"):
            OP(fx, fids, fw, fweights, "q4_k,q4_k,q6_k", sizes, [32, 32, 16], *rest)
        with pytest.raises(RuntimeError, match="down"):
            OP(fx, fids, fw, fweights, "q4_k,q4_k,bf16", sizes, [32, 32, 0], *rest)


def test_from_packed_any_mix():
    # Each projection keeps its own format and group size (issue 9): int4 with different
    # group sizes per projection, and bf16 / fp8 next to integer formats, all compute.
    E, H, I = 3, 128, 128
    gi, ui, dn = dense_expert_weights(E, H, I, seed=3)
    gate32, up32 = quantize_weights(gi, "int4", 32), quantize_weights(ui, "int4", 32)
    cases = [
        ((gate32, up32, quantize_weights(dn, "int4", 128)), "int4", (32, 32, 128)),
        (
            (gate32, quantize_weights(ui, "int4", 128), quantize_weights(dn, "q8_0")),
            "int4,int4,q8_0",
            (32, 128, 32),
        ),
        (
            (
                quantize_weights(gi, "bf16"),
                quantize_weights(ui, "q4_0"),
                quantize_weights(dn, "q4_0"),
            ),  # fmt: skip
            "bf16,q4_0,q4_0",
            (0, 32, 32),
        ),
        ((gate32, up32, quantize_weights(dn, "bf16")), "int4,int4,bf16", (32, 32, 0)),
        (
            (
                quantize_weights(gi, "fp8"),
                quantize_weights(ui, "fp8"),
                quantize_weights(dn, "q8_0"),
            ),  # fmt: skip
            "fp8,fp8,q8_0",
            (128, 128, 32),
        ),
        ((gate32, up32, quantize_weights(dn, "q8_0")), "int4,int4,q8_0", (32, 32, 32)),
        (
            (quantize_weights(gi, "q8_0"), up32, quantize_weights(dn, "int4", 32)),
            "q8_0,int4,int4",
            (32, 32, 32),
        ),
    ]
    T = 9
    ids, weights = make_routing(T, E, TOP_K, seed=4)
    x = make_hidden(T, H, torch.float32, seed=4)
    for projs, fmt, groups in cases:
        m = MoEExperts.from_packed(*projs)
        assert m.weight_format == fmt and m.group_sizes == groups, fmt
        w = m.expert_weights()
        with torch.no_grad():
            out = m(x, ids, weights)
        assert torch.equal(out, run_op(x, ids, weights, w)), fmt
        msg = quant_mismatch_report(out, mixed_reference(w, x, ids, weights), tolerance_for(w))
        assert msg is None, f"{fmt}: {msg}"
    # what stays an error: projections that disagree on E, H or I
    with pytest.raises(ValueError, match=r"from_packed: .*expected gate and up \[E, I, H\]"):
        MoEExperts.from_packed(gate32, up32, quantize_weights(dn[:, :, :64], "q8_0"))
    with pytest.raises(ValueError, match=r"from_packed: .*different expert counts"):
        MoEExperts.from_packed(gate32, up32, quantize_weights(dn[:2], "q8_0"))


def test_module_checks_each_projection_shape():
    w = uniform_layer(MIXES[0], "q4_k")
    sizes = [256, 256]
    with pytest.raises(ValueError, match=r"ExpertWeights.down: PackedProjection.weight has"):
        MoEExperts(
            kt_ops.ExpertWeights.from_op_args(w.tensors(), "q4_k,q4_k,q6_k", sizes, [32, 32, 16])
        )
    with pytest.raises(ValueError, match=r"ExpertWeights.gate: PackedProjection.weight has"):
        MoEExperts(
            kt_ops.ExpertWeights.from_op_args(w.tensors(), "bf16,q4_k,q4_k", sizes, [0, 32, 32])
        )


# --------------------------------------------------------------------------
# opcheck, torch.compile
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mix", [MIXES[0], MIXES[2], MIXES[7]], ids=lambda m: m.id)
def test_opcheck(mix):
    w = mixed_layer(mix, E=4)
    ids, weights = make_routing(3, 4, TOP_K, seed=5, skip_fraction=0.2)
    x = make_hidden(3, mix.H, torch.bfloat16, seed=5)
    torch.library.opcheck(OP.default, (x, ids, weights) + layer_args(w, None, "silu", x))


def test_fake_kernel_shape_and_dtype():
    w = mixed_layer(MIXES[0], E=4)
    ids, weights = make_routing(5, 4, TOP_K, seed=5)
    x = make_hidden(5, 256, torch.bfloat16, seed=5)
    args = (x, ids, weights) + layer_args(w, None, "silu", x)
    real = OP(*args)
    with FakeTensorMode() as mode:

        def fake(v):
            return mode.from_tensor(v) if isinstance(v, torch.Tensor) else v

        out = OP(*tree_map(fake, args))
    assert (out.shape, out.dtype, out.stride()) == (real.shape, real.dtype, real.stride())


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compile_fullgraph_module(fresh_dynamo):
    # fullgraph through the fake kernel (aot_eager); later token counts reuse the graph.
    # (CompileCounterWithBackend counts 2 frames on the first call of any MoEExperts,
    # bf16 included, so the check is "no growth after the first call".)
    from torch._dynamo.testing import CompileCounterWithBackend

    mix = MIXES[2]  # int4 (zeros) + q8_0 (no zeros)
    module = MoEExperts.from_packed(*mixed_layer(mix).projections)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(module, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for T in (3, 7, 12):
        ids, weights = routing(T, seed=T)
        x = make_hidden(T, mix.H, torch.float32, seed=T)
        with torch.no_grad():
            assert torch.equal(compiled(x, ids, weights), module(x, ids, weights))
        frames.append(counter.frame_count)
    assert frames[0] >= 1 and frames[-1] == frames[0], f"recompiled: frames {frames}"


# --------------------------------------------------------------------------
# MoEExperts.from_packed
# --------------------------------------------------------------------------


@pytest.mark.parametrize("mix", MIXES, ids=MIX_IDS)
def test_from_packed_module(mix):
    w = mixed_layer(mix)
    module = MoEExperts.from_packed(*w.projections)
    assert module.weight_format == mix.weight_format
    assert (module.num_experts, module.hidden_size, module.intermediate_size) == (
        E_TOTAL,
        mix.H,
        mix.I,
    )
    assert module.group_sizes == w.group_sizes
    if "int4" in mix.fmts and mix.group_size is not None:
        assert mix.group_size in module.group_sizes
    T = 9
    ids, weights = routing(T, seed=8)
    x = make_hidden(T, mix.H, torch.bfloat16, seed=8)
    with torch.no_grad():
        out = module(x, ids, weights)
    assert torch.equal(out, run_op(x, ids, weights, w))
    assert quant_mismatch_report(out, mixed_reference(w, x, ids, weights)) is None


def test_from_packed_q4_k_m():
    w = mixed_layer(MIXES[0])
    module = MoEExperts.from_packed(w.gate, w.up, w.down)
    assert module.weight_format == "q4_k,q4_k,q6_k"
    # GGUF k-quant scale records, the q4_k mins inside: no zeros tensors
    assert module.down_zeros is None and module.gate_zeros is None
    assert module.gate_scales.shape[-1] == 256 and module.down_scales.shape[-1] == 288
    # state_dict round trip into a fresh module of the same format
    clone = MoEExperts.from_packed(*mixed_layer(MIXES[0], seed=1).projections)
    clone.load_state_dict(module.state_dict())
    ids, weights = routing(5, seed=1)
    x = make_hidden(5, 256, torch.float32, seed=1)
    with torch.no_grad():
        assert torch.equal(clone(x, ids, weights), module(x, ids, weights))


# --------------------------------------------------------------------------
# LoRA on a mixed base
# --------------------------------------------------------------------------


def dense_lora_reference(p, dense, lora: dict[str, Tensor], scaling: float):
    """fp32 output and autograd gradients of the LoRA layer on dense weights ``dense``.

    The maths of ``reference.reference_moe_forward`` (which takes one packed
    format) on the three dequantized projections.
    """
    x = p.x.detach().float().requires_grad_(True)
    tw = p.topk_weights.detach().float().requires_grad_(True)
    leaves = {k: v.detach().float().requires_grad_(True) for k, v in lora.items()}
    weights = dict(zip(("gate", "up", "down"), dense))
    ids = p.ids.long()

    def project(v: Tensor, proj: str, e: int) -> Tensor:
        y = v @ weights[proj][e].T
        a, b = leaves.get(f"{proj}_lora_a"), leaves.get(f"{proj}_lora_b")
        if a is not None and b is not None:
            y = y + scaling * ((v @ a[e].T) @ b[e].T)
        return y

    with single_threaded_torch():
        out = torch.zeros(x.shape)
        for e in torch.unique(ids[ids >= 0]).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            xe = x[tok]
            h = torch.nn.functional.silu(project(xe, "gate", e)) * project(xe, "up", e)
            out = out.index_add(0, tok, project(h, "down", e) * tw[tok, slot].unsqueeze(1))
        if out.requires_grad:
            out.backward(p.grad_output.float())
    grads = {"hidden_states": x, "topk_weights": tw, **leaves}
    grads = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in grads.items()}
    return out.detach(), grads


LORA_MIXES = [MIXES[0], MIXES[2], MIXES[4], MIXES[5]]


@pytest.mark.parametrize("ranks", [ALL3, {}], ids=["lora", "no_lora"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
@pytest.mark.parametrize("mix", LORA_MIXES, ids=lambda m: m.id)
def test_lora_forward_and_gradients(mix, checkpointing, ranks):
    w = mixed_layer(mix)
    case = Case(mix.id, 9, mix.H, mix.I, E_TOTAL, TOP_K, ranks, skip_fraction=0.2)
    p = make_problem(case, seed=3, weights=w)
    p.ids[p.ids == E_TOTAL - 1] = -1
    assert p.weights.weight_format == mix.weight_format
    out, grads = op_grads(p, checkpointing)
    ref_out, ref_grads = dense_lora_reference(p, dense_weights(w), p.lora, case.scaling)
    if ranks or not checkpointing:  # without LoRA the recomputing forward is the q8 kernel
        assert_matches_reference(out, ref_out)
    assert_grads_match(grads, ref_grads)
    for name in p.lora:  # expert E-1 got no token
        assert torch.count_nonzero(grads[name][E_TOTAL - 1]) == 0, name


def test_lora_gradients_need_each_projections_own_format():
    # The same check against the base with down in q4_k (gate/up's format) fails: the
    # LoRA path decodes down as q6_k.
    mix = MIXES[0]
    w = mixed_layer(mix)
    case = Case(mix.id, 9, mix.H, mix.I, E_TOTAL, TOP_K, ALL3)
    p = make_problem(case, seed=3, weights=w)
    out, _ = op_grads(p, checkpointing=False)
    wrong = dense_weights(uniform_layer(mix, "q4_k"))
    ref_out, _ = dense_lora_reference(p, wrong, p.lora, case.scaling)
    assert mismatch_report(out, ref_out) is not None


def test_lora_thread_counts_bit_identical():
    mix = MIXES[5]  # int8, q4_k, q6_k
    case = Case(mix.id, 48, mix.H, mix.I, E_TOTAL, TOP_K, ALL3)
    p = make_problem(case, seed=4, weights=mixed_layer(mix))
    results = []
    for threads in (1, 2):
        kt_ops.set_num_threads(threads)
        results.append(op_grads(p, checkpointing=False))
    (out1, g1), (out2, g2) = results
    assert torch.equal(out1, out2)
    for name in g1:
        assert torch.equal(g1[name], g2[name]), name


def test_add_lora_on_mixed_module_gradients():
    mix = MIXES[0]
    w = mixed_layer(mix)
    module = MoEExperts.from_packed(*w.projections)
    module.add_lora(4, 8, generator=torch.Generator().manual_seed(1))
    assert module.weight_format == "q4_k,q4_k,q6_k"
    with torch.no_grad():  # random B so that every gradient is nonzero
        g = torch.Generator().manual_seed(2)
        for proj in ("gate", "up", "down"):
            b = getattr(module, f"{proj}_lora_b")
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    buffers = {n: t.clone() for n, t in module.named_buffers()}
    T = 12
    ids, weights = routing(T, seed=6)
    x = make_hidden(T, mix.H, torch.float32, seed=6).requires_grad_(True)
    grad_out = torch.randn(T, mix.H, generator=g)
    out = module(x, ids, weights)
    out.backward(grad_out)
    lora = {k: v.detach() for k, v in module.lora_parameters().items()}
    case = Case("module", T, mix.H, mix.I, E_TOTAL, TOP_K, ALL3)
    p = make_problem(case, weights=w)
    p = dataclasses.replace(p, x=x.detach(), ids=ids, topk_weights=weights, grad_output=grad_out)
    ref_out, ref_grads = dense_lora_reference(p, dense_weights(w), lora, module.lora_scaling)
    assert_matches_reference(out.detach(), ref_out)
    got = {"hidden_states": x.grad, **{k: v.grad for k, v in module.lora_parameters().items()}}
    assert_grads_match(got, {k: ref_grads[k] for k in got})
    for name, t in module.named_buffers():  # the packed base stays frozen
        assert torch.equal(t, buffers[name]), name


def test_opcheck_with_lora():
    mix = MIXES[8]  # int8, mxfp4, int8 at odd sizes: small, and gate != up
    case = Case(mix.id, 5, mix.H, mix.I, 4, TOP_K, ALL3, skip_fraction=0.2)
    p = make_problem(case, seed=5, weights=mixed_layer(mix, E=4))
    x = p.x.clone().requires_grad_(True)
    lora = {k: v.clone().requires_grad_(True) for k, v in p.lora.items()}
    args = dataclasses.replace(p, x=x, lora=lora).raw_args()
    for op in (OP.default, torch.ops.kt.moe_forward_train.default):
        torch.library.opcheck(op, args)
    torch.library.opcheck(torch.ops.kt.moe_backward.default, (p.grad_output, *p.raw_args()))


# --------------------------------------------------------------------------
# GGUF: Q4_K gate/up, Q6_K down, through the loader, the converter and replace_experts
# --------------------------------------------------------------------------

GGUF_TYPES = {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K}
GGUF_E, GGUF_H, GGUF_I = 4, 256, 256


@pytest.fixture(scope="module")
def q4_k_m_gguf(tmp_path_factory):
    """A two-layer GGUF file with Q4_K gate/up and Q6_K down experts, and what it stores."""
    path = tmp_path_factory.mktemp("q4_k_m") / "m.gguf"
    expected = write_gguf(path, GGUF_TYPES, E=GGUF_E, H=GGUF_H, I=GGUF_I, moe_layers=(0, 1))
    return path, expected


def _gguf_module(packed: ExpertWeights) -> MoEExperts:
    return MoEExperts.from_packed(*packed.projections)


def test_gguf_loader_to_module(isa, q4_k_m_gguf):
    import gguf

    path, expected = q4_k_m_gguf
    ck = GGUFCheckpoint(path)
    assert ck.native_formats(1) == {"gate": "q4_k", "up": "q4_k", "down": "q6_k"}
    T = 13
    ids, weights = make_routing(T, GGUF_E, TOP_K, seed=1, skip_fraction=0.2)
    x = make_hidden(T, GGUF_H, torch.float32, seed=1)
    for L in (0, 1):
        packed = ck.load_layer(L)  # weight_format=None: each tensor in its own type
        assert {r: getattr(packed, r).weight_format for r in ROLES} == {
            "gate": "q4_k",
            "up": "q4_k",
            "down": "q6_k",
        }
        # the reference weights: gguf's own dequantizer of the raw tensors
        dense = tuple(
            torch.from_numpy(gguf.quants.dequantize(expected[L][r]["raw"], GGUF_TYPES[r])).float()
            for r in ROLES
        )
        for r, d in zip(ROLES, dense):
            assert torch.equal(dequantize_weights(getattr(packed, r)), d), (L, r)
        module = _gguf_module(packed)
        assert module.weight_format == "q4_k,q4_k,q6_k"
        with torch.no_grad(), kt_ops.use_quant_activations("q8"):
            out = module(x, ids, weights)
        ref = reference_quant_moe_forward(x, ids, weights, *dense, activation="q8")
        msg = quant_mismatch_report(out, ref)
        assert msg is None, f"layer {L}: {msg}"
        with torch.no_grad(), kt_ops.use_quant_activations("fp32"):
            out = module(x, ids, weights)
        ref = reference_quant_moe_forward(x, ids, weights, *dense, activation="fp32")
        assert quant_mismatch_report(out, ref) is None, L


def test_gguf_convert_native_bit_identical(q4_k_m_gguf, tmp_path):
    path, _ = q4_k_m_gguf
    out_dir = tmp_path / "conv"
    manifest = convert(path, out_dir, progress=False)  # default: native formats
    assert manifest["format"] == "native"
    for L in ("0", "1"):
        formats = {r: manifest["layers"][L]["projections"][r]["format"] for r in ROLES}
        assert formats == {"gate": "q4_k", "up": "q4_k", "down": "q6_k"}
    ck = GGUFCheckpoint(path)
    converted = ConvertedExperts(out_dir)
    assert converted.weight_format == "native" and converted.layers == [0, 1]
    T = 11
    ids, weights = make_routing(T, GGUF_E, TOP_K, seed=2, skip_fraction=0.2)
    x = make_hidden(T, GGUF_H, torch.bfloat16, seed=2)
    for L in (0, 1):
        online = _gguf_module(ck.load_layer(L))
        for packed in (load_converted(out_dir, L), converted[L]):
            offline = _gguf_module(packed)
            assert offline.weight_format == "q4_k,q4_k,q6_k"
            for name, t in online.state_dict().items():
                assert torch.equal(offline.state_dict()[name], t), (L, name)
            with torch.no_grad():
                assert torch.equal(offline(x, ids, weights), online(x, ids, weights)), L


def _tiny_qwen3_moe(hidden: int, inter: int, experts: int, top_k: int, *, num_layers: int):
    """A random transformers Qwen3-MoE (eval mode) with the given expert shape."""
    transformers = pytest.importorskip("transformers")
    from kt_ops import demo

    shape = dict(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts)
    config = demo.make_config(
        "qwen3_moe", **{**TINY_MOE_CONFIG, **shape, "top_k": top_k, "num_layers": num_layers}
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_gguf_converted_dir_replace_experts(q4_k_m_gguf, tmp_path):
    pytest.importorskip("transformers")
    from kt_ops.hf import replace_experts

    path, _ = q4_k_m_gguf
    out_dir = tmp_path / "conv"
    convert(path, out_dir, progress=False)
    model = _tiny_qwen3_moe(GGUF_H, GGUF_I, GGUF_E, TOP_K, num_layers=2)
    assert replace_experts(model, converted_dir=str(out_dir)) is model
    replaced = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert len(replaced) == 2
    ck = GGUFCheckpoint(path)
    T = 6
    ids, weights = make_routing(T, GGUF_E, TOP_K, seed=3)
    x = make_hidden(T, GGUF_H, torch.float32, seed=3)
    for L, m in enumerate(replaced):
        assert m.weight_format == "q4_k,q4_k,q6_k"
        with torch.no_grad():
            assert torch.equal(m(x, ids, weights), _gguf_module(ck.load_layer(L))(x, ids, weights))
    with torch.inference_mode():
        logits = model(torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(logits.logits).all()


# --------------------------------------------------------------------------
# Online quantization into per-projection formats
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt, group_size", [("q4_k,q4_k,q6_k", None), ("int4,int4,q8_0", 32), ("q4_k,int4,q6_k", 64)]
)
def test_from_dense_quantizes_each_projection_in_its_format(fmt, group_size):
    H, I = 256, 256
    dense = dense_expert_weights(3, H, I, seed=5)
    m = MoEExperts.from_dense(*dense, fmt, group_size=group_size)
    assert m.weight_format == fmt
    names = split_weight_format(fmt)
    for name, w, f in zip(("gate", "up", "down"), dense, names):
        g = group_size if len(format_spec(f).group_sizes) > 1 else None
        p = quantize_weights(w, f, g)
        assert torch.equal(getattr(m, f"{name}_weight"), p.weight), name
        assert torch.equal(getattr(m, f"{name}_scales"), p.scales), name
    T = 5
    ids, weights = make_routing(T, 3, TOP_K, seed=5)
    x = make_hidden(T, H, torch.float32, seed=5)
    with kt_ops.use_quant_activations("q8"):
        out = m(x, ids, weights)
    deq = [
        dequantize_weights(quantize_weights(w, f, g))
        for w, f, g in zip(
            dense,
            names,
            [group_size if len(format_spec(f).group_sizes) > 1 else None for f in names],
        )
    ]
    ref = reference_quant_moe_forward(x, ids, weights, *deq, activation="q8")
    assert quant_mismatch_report(out, ref) is None


def _check_module_against_its_reference(m: MoEExperts) -> None:
    """The replaced experts' output: the reference of each projection's format and path."""
    x = make_hidden(6, m.hidden_size, torch.float32, seed=3)
    ids, w = make_routing(6, m.num_experts, 2, seed=3)
    with torch.inference_mode():
        out = m(x, ids, w)
        ref = reference_for(m.expert_weights(), x, ids, w)
    assert quant_mismatch_report(out, ref) is None


def test_replace_experts_online_mixed_format():
    from kt_ops.hf import replace_experts

    model = _tiny_qwen3_moe(64, 32, 4, 2, num_layers=1)
    replace_experts(model, "int4,int4,q8_0", group_size=32)
    (m,) = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert m.weight_format == "int4,int4,q8_0" and m.group_sizes == (32, 32, 32)
    with torch.inference_mode():
        logits = model(torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(logits.logits).all()
    _check_module_against_its_reference(m)
    with pytest.raises(ValueError, match="per-projection 'gate,up,down'"):
        replace_experts(_tiny_qwen3_moe(64, 32, 4, 2, num_layers=1), "q4_k,bf17,q6_k")
    # bf16 and fp8 mix with the integer formats online too (issue 9)
    model = _tiny_qwen3_moe(64, 32, 4, 2, num_layers=1)
    replace_experts(model, "bf16,fp8,int8")
    (m,) = [m for m in model.modules() if isinstance(m, MoEExperts)]
    assert m.weight_formats == ("bf16", "fp8", "int8") and m.group_sizes == (0, 128, 0)
    with torch.inference_mode():
        logits = model(torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0)))
    assert torch.isfinite(logits.logits).all()
    _check_module_against_its_reference(m)
