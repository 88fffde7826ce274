"""LoRA on a quantized, frozen base (QLoRA style): every weight format, forward and backward.

With LoRA tensors the op runs the ATen expert path (csrc/moe/moe_lora.cpp), which reads
each active expert's base through ``dense_expert_weight`` (csrc/moe/expert_weights.cpp):
the packed weights dequantized to fp32, multiplied with fp32 activations (no q8 rounding).

* The C++ decoder equals ``kt_ops.formats.dequantize_weights`` bit for bit, for every format
  and group size, on random raw packed tensors (every code value, random scales and zeros,
  N not a multiple of 16, K not a multiple of 32, mxfp4 scales down to the fp32 subnormals).
  Read through the op: ``moe_forward_train``'s gate pre-activations for one-hot hidden states
  are the columns of ``W`` exactly.
* Forward and gradients (hidden states, routing weights, every LoRA A and B) match autograd
  through tests/reference.py's dense fp32 reference on the dequantized weights, within the
  fp32 tolerance of tests/test_lora.py (``TOL_BF16``: both sides use the same fp32 weights,
  only summation order differs), for every format; T = 0 and 1, -1 ids, experts without
  tokens; 1 and 2 threads bit-identical; opcheck.
* ``MoEExperts.from_dense(..., 'int4')`` and a tiny HF Qwen3-MoE model with
  ``replace_experts(model, 'int4', group_size=32)`` + ``apply_lora`` train (the loss falls);
  the PEFT adapter saves and loads with the quantized base.
"""

# T, H, I, E, K, r: tokens, hidden, intermediate, experts, top-k, LoRA rank.
# ruff: noqa: E741

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from reference import (
    TOL_BF16,
    assert_matches_reference,
    make_quant_experts,
    reference_moe_forward,
    set_iq1_m_d,
)
from test_lora import (
    ALL3,
    LORA_NAMES,
    TOL_BF16_ON_KERNELS,
    Case,
    _requires_grad,
    assert_grads_match,
    make_problem,
    op_grads,
    reference_grads,
)
from test_quant_forward import Variant

import kt_ops
from kt_ops.formats import FORMATS as WEIGHT_FORMATS
from kt_ops.formats import PackedProjection, dequantize_weights, format_spec
from kt_ops.formats.grid import GRID_FORMATS
from kt_ops.layer import layer_args
from kt_ops.nn import MoEExperts

QUANT_FORMATS = [f for f in WEIGHT_FORMATS if f != "bf16"]


# --------------------------------------------------------------------------
# The dense decoder equals dequantize_weights, bit for bit
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """A packed projection ``[E, n, k]`` of random bytes: format, group size, zeros or not."""

    fmt: str
    group_size: int
    zeros: bool
    n: int
    k: int

    @property
    def id(self) -> str:
        return f"{self.fmt}_g{self.group_size}{'_zeros' if self.zeros else ''}_{self.n}x{self.k}"


def _shape(gs: int) -> tuple[int, int]:
    """``(n, k)``, neither a multiple of 16 / 32, with ``gs`` dividing both padded to 32.

    (Both: the op also gets the ``[k, n]`` projection of the same format as down.)
    """
    return {64: (100, 40), 128: (250, 100)}.get(gs, (72, 40))


LAYOUTS = [
    Layout("int8", 0, False, 72, 40),
    *(Layout("int4", gs, z, *_shape(gs)) for gs in (0, 32, 64, 128) for z in (False, True)),
    Layout("fp8", 128, False, 200, 136),  # two 128-row and two 128-k scale blocks
    Layout("fp8_channel", 0, False, 72, 40),
    Layout("mxfp8", 32, False, 72, 40),
    Layout("mxfp4", 32, False, 72, 40),
    Layout("nvfp4", 16, False, 72, 40),
    Layout("q8_0", 32, False, 72, 40),
    Layout("q4_0", 32, False, 72, 40),
    # k-quants: K (and so, for the [k, n] down, n) a multiple of 256; scale records.
    Layout("q2_k", 16, False, 256, 512),
    Layout("q3_k", 16, False, 512, 256),
    Layout("q4_k", 32, False, 256, 512),
    Layout("q5_k", 32, False, 512, 256),  # several 32-k high-plane words, 2 super-blocks
    Layout("q6_k", 16, False, 256, 512),
    # IQ4_NL's table: every code value through the signed-value decoders.
    Layout("iq4_nl", 32, False, 72, 40),
    Layout("iq4_xs", 32, False, 256, 512),
    # GGUF's fallback types: 5-bit codes with fp16 scales, q4_1 / q5_1 with fp16 zeros (-m).
    Layout("q4_1", 32, True, 72, 40),
    Layout("q5_0", 32, False, 72, 40),
    Layout("q5_1", 32, True, 72, 40),
    # The lattice-grid i-quants: GGUF blocks decoded row by row (K a multiple of 256).
    Layout("iq1_s", 32, False, 256, 512),
    Layout("iq1_m", 16, False, 256, 256),  # scales per 16
    Layout("iq2_xxs", 32, False, 512, 256),
    Layout("iq2_xs", 16, False, 256, 256),
    Layout("iq2_s", 16, False, 512, 256),
    Layout("iq3_xxs", 32, False, 256, 512),
    Layout("iq3_s", 32, False, 256, 256),
    # n * 4 bytes a multiple of 2 KiB: the decoder pads the rows of its W^T storage.
    Layout("int4", 32, False, 512, 40),
    Layout("fp8", 128, False, 1024, 40),
    Layout("bf16", 0, False, 512, 40),
]


def random_packed(
    fmt: str, E: int, n: int, k: int, group_size: int, zeros: bool, seed: int
) -> PackedProjection:
    """Random bytes in the layout of ``fmt``: every code value, random signed scales / zeros.

    mxfp4 / mxfp8 scale bytes lie in [0, 160): 2^-128 (an fp32 subnormal) up to finite
    weights (the one-hot read of ``decoded_by_op`` turns inf into NaN); fp8 codes
    (fp8, fp8_channel, mxfp8) skip the two NaN codes.
    """
    spec = format_spec(fmt)
    g = torch.Generator().manual_seed(seed)
    if fmt == "bf16":
        packed = kt_ops.pack_weights(torch.randn(E, n, k, generator=g))
        return PackedProjection(packed, None, None, fmt, 0, n, k).validate()
    weight = torch.randint(0, 256, spec.weight_shape(E, n, k), dtype=torch.uint8, generator=g)
    if spec.layout == "fp8":
        weight[(weight & 0x7F) == 0x7F] -= 1
    if spec.is_grid:  # GGUF blocks of random bytes, each with a finite random fp16 d
        blocks = weight.view(E, -1, spec.gguf_block[1])
        d = (torch.randn(blocks.shape[:2], generator=g) * 0.002).half()
        if fmt == "iq1_m":  # d spread over the scale words' top nibbles
            set_iq1_m_d(blocks.numpy(), d.numpy())
        else:
            blocks[..., 0:2] = d.unsqueeze(-1).view(torch.uint8)
        return PackedProjection(weight, None, None, fmt, group_size, n, k).validate()
    sshape = spec.scales_shape(E, n, k, group_size)
    if spec.is_kquant:  # every record byte random, then finite random fp16 d (and dmin)
        scales = torch.randint(0, 256, sshape, dtype=torch.uint8, generator=g)
        n_f16 = 64 if spec.record_mins else 32  # d (and dmin) fp16 [16]
        f16 = (torch.randn(*sshape[:-1], n_f16 // 2, generator=g) * 0.05).half()
        scales[..., :n_f16] = f16.view(torch.uint8)
    elif spec.scale_dtype == torch.uint8:
        scales = torch.randint(0, 160, sshape, dtype=torch.uint8, generator=g)
    else:
        scales = (torch.randn(sshape, generator=g) * 0.05).to(spec.scale_dtype)
    z = (torch.randn(sshape, generator=g) * 0.05).to(spec.scale_dtype) if zeros else None
    return PackedProjection(weight, scales, z, fmt, group_size, n, k).validate()


def decoded_by_op(p: PackedProjection, down: PackedProjection, **scale_casts) -> torch.Tensor:
    """``W`` [E, n, k] as the op's dense decoder produces it (the base of the LoRA
    backward's GEMMs, ``moe::dense_expert_weight``; ``kt_ops._C._testing.dense_expert_weights``).

    ``down`` ([E, k, n], same format) completes the layer; ``scale_casts`` cast
    the scales / zeros as the op accepts them.
    """

    def cast(q: PackedProjection) -> PackedProjection:
        kw = {
            name: scale_casts.get(name, lambda t: t)(getattr(q, name))
            for name in ("scales", "zeros")
            if getattr(q, name) is not None  # bf16: none; zeros: some formats
        }
        return dataclasses.replace(q, **kw)

    experts = kt_ops.ExpertWeights(cast(p), cast(p), cast(down))
    return kt_ops._C._testing.dense_expert_weights(
        experts.tensors(),
        experts.weight_format,
        [experts.hidden_size, experts.intermediate_size],
        list(experts.group_sizes),
        0,
    )


@functools.cache
def random_pair(layout: Layout) -> tuple[PackedProjection, PackedProjection]:
    v = layout
    p = random_packed(v.fmt, 3, v.n, v.k, v.group_size, v.zeros, seed=v.n + v.k)
    down = random_packed(v.fmt, 3, v.k, v.n, v.group_size, v.zeros, seed=1)
    return p, down


def test_every_format_is_decoded():
    assert {v.fmt for v in LAYOUTS} == set(WEIGHT_FORMATS)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.id)
def test_dense_decoder_equals_dequantize_weights(layout):
    p, down = random_pair(layout)
    want = dequantize_weights(p)
    got = decoded_by_op(p, down)
    assert torch.isfinite(want).all()
    mismatch = got != want
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} of {want.numel()} weights differ; first at "
        f"{mismatch.nonzero()[0].tolist()}: {got[mismatch][0].item()!r} vs "
        f"{want[mismatch][0].item()!r}"
    )


@pytest.mark.parametrize("fmt", GRID_FORMATS)
def test_grid_decoder_reads_every_grid_entry(fmt):
    """The C++ grid tables (csrc/formats/grid_tables.inc, generated from the gguf package)
    against ``gguf.quants.dequantize``, bit for bit: 2048 blocks of random bytes draw
    65536 grid indices, so every entry of the largest grid (IQ1_S / IQ1_M: 2048) is read
    with probability 1 - 1e-14 (a stale or mistyped table entry fails here)."""
    p = random_packed(fmt, 1, 256, 2048, format_spec(fmt).default_group_size, False, seed=7)
    down = random_packed(fmt, 1, 2048, 256, format_spec(fmt).default_group_size, False, seed=8)
    want = dequantize_weights(p)
    assert torch.isfinite(want).all() and bool((want != 0).any())
    assert torch.equal(decoded_by_op(p, down), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: v.id)
def test_training_forward_reads_every_code_value(layout, dtype):
    """Through the op: ``moe_forward_train``'s gate pre-activations for one-hot hidden
    states are the columns of ``W`` (token e * k + j: the j-th unit vector, routed to
    expert e alone), on the random raw layouts (every code value, random scales and
    zeros), bit for bit: fp32 activations take the streaming kernels' fp32 decoder (s (q -
    offset) rounded once: nvfp4's fp32 scales times 12 do not fit fp32), bf16 ones the
    exact tiles where the CPU has AVX512_BF16. mxfp4 within TOL_BF16: the kernels flush
    its subnormal scales (2^(E-128) below the fp32 normals) to zero."""
    p, down = random_pair(layout)
    experts = kt_ops.ExpertWeights(p, p, down)
    E, n, k = p.weight.shape[0], layout.n, layout.k
    x = torch.eye(k).repeat(E, 1).to(dtype)
    ids = torch.arange(E).repeat_interleave(k)[:, None]
    _, gate_pre, _ = torch.ops.kt.moe_forward_train(
        x, ids, torch.ones(E * k, 1), *layer_args(experts, None, "silu", x)
    )
    want = dequantize_weights(p).transpose(1, 2).reshape(E * k, n)
    if layout.fmt == "mxfp4":
        assert_matches_reference(gate_pre, want, TOL_BF16)
    else:
        mismatch = gate_pre != want
        assert not mismatch.any(), f"{int(mismatch.sum())} of {want.numel()} weights differ"


def test_mxfp4_subnormal_scales_are_exact():
    # The kernels flush 2^(E-128) below the fp32 normals to zero; the dense decoder must not.
    p, down = random_pair(next(v for v in LAYOUTS if v.fmt == "mxfp4"))
    scales = p.scales.clone()
    scales[0, 0, 0] = torch.tensor([0, 1, 2, 3] * 4, dtype=torch.uint8)
    p = dataclasses.replace(p, scales=scales)
    want = dequantize_weights(p)
    tiny = want[0, :16, :32]
    assert (tiny != 0).any() and (tiny.abs() < torch.finfo(torch.float32).tiny).any()
    assert torch.equal(decoded_by_op(p, down), want)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_scale_and_zero_dtypes(fmt):
    # The op also takes fp32 and bf16 scales/zeros (one dtype for the layer): fp32 copies of
    # the fp16 values decode identically; bf16 ones like their fp32 copies.
    layout = next(v for v in LAYOUTS if v.fmt == fmt and v.zeros == (fmt == "int4"))
    p, down = random_pair(layout)
    want = dequantize_weights(p)
    f32 = {"scales": lambda t: t.float(), "zeros": lambda t: t.float()}
    assert torch.equal(decoded_by_op(p, down, **f32), want)
    bf16 = {"scales": lambda t: t.bfloat16(), "zeros": lambda t: t.bfloat16()}
    via_f32 = {"scales": lambda t: t.bfloat16().float(), "zeros": lambda t: t.bfloat16().float()}
    assert torch.equal(decoded_by_op(p, down, **bf16), decoded_by_op(p, down, **via_f32))


# --------------------------------------------------------------------------
# LoRA forward and gradients against the dense reference, every format
# --------------------------------------------------------------------------


# H = 72, I = 40 where the packer pads K (int8, fp8, mxfp4); the grouped formats need the
# group size (the k-quants: 256) to divide H and I. I = 512: padded decoder rows (gate/up).
VARIANTS = [
    Variant("int8", None, True, 72, 40),
    *(
        Variant("int4", gs, sym, H, I)
        for gs, H, I in ((32, 96, 64), (64, 128, 64), (128, 128, 512), (0, 72, 40))
        for sym in (True, False)
    ),
    Variant("fp8", None, True, 72, 40),
    Variant("fp8_channel", None, True, 72, 40),
    Variant("mxfp8", None, True, 72, 40),
    Variant("mxfp4", None, True, 72, 40),
    Variant("nvfp4", None, True, 72, 40),
    Variant("q8_0", None, True, 96, 64),
    Variant("q4_0", None, True, 96, 64),
    Variant("q4_1", None, True, 96, 64),
    Variant("q5_0", None, True, 96, 64),
    Variant("q5_1", None, True, 96, 64),
    Variant("q2_k", None, True, 256, 256),
    Variant("q3_k", None, True, 256, 256),
    Variant("q4_k", None, True, 256, 256),
    Variant("q5_k", None, True, 256, 256),
    Variant("q6_k", None, True, 256, 256),
    Variant("iq4_nl", None, True, 96, 64),
    Variant("iq4_xs", None, True, 256, 256),
    Variant("iq1_s", None, True, 256, 256),
    Variant("iq1_m", None, True, 256, 256),
    Variant("iq2_xxs", None, True, 256, 256),
    # I = 1024: the backward decodes down's columns in panels of 256 (moe_lora.cpp).
    Variant("iq2_xxs", None, True, 256, 1024, "_256x1024"),
    Variant("iq2_xs", None, True, 256, 256),
    Variant("iq2_s", None, True, 256, 256),
    Variant("iq3_xxs", None, True, 256, 256),
    Variant("iq3_s", None, True, 256, 256),
]
PER_FORMAT = list({v.fmt: v for v in reversed(VARIANTS)}.values())[::-1]
E_TOTAL = 6


@functools.cache
def layer(v: Variant) -> kt_ops.ExpertWeights:
    return make_quant_experts(
        v.fmt, E_TOTAL, v.H, v.I, group_size=v.group_size, symmetric=v.symmetric, seed=1
    )


def problem(v: Variant, T: int, ranks: dict[str, int] = ALL3, **case_kwargs):
    """T tokens, top-2, some -1 slots, expert E-1 without tokens; LoRA of ``ranks``."""
    case = Case(v.id, T, v.H, v.I, E_TOTAL, 2, ranks, skip_fraction=0.2, **case_kwargs)
    p = make_problem(case, seed=T, weights=layer(v))
    p.ids[p.ids == E_TOTAL - 1] = -1
    return p


def test_every_format_trains():
    assert [v.fmt for v in PER_FORMAT] == QUANT_FORMATS
    assert {(v.group_size, v.symmetric) for v in VARIANTS if v.fmt == "int4"} == {
        (gs, sym) for gs in (0, 32, 64, 128) for sym in (True, False)
    }


@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: v.id)
def test_forward_and_gradients_match_reference(v, checkpointing):
    p = problem(v, 9)
    assert (p.ids < 0).any()
    out, grads = op_grads(p, checkpointing)
    ref_out, ref_grads = reference_grads(p)
    assert_matches_reference(out, ref_out)
    assert_grads_match(grads, ref_grads)
    for name in LORA_NAMES:  # expert E-1 got no token
        assert torch.count_nonzero(grads[name][E_TOTAL - 1]) == 0, name
    # Inference (no autograd) runs the same path: the same output.
    with torch.no_grad():
        assert torch.equal(kt_ops.moe_forward(*p.op_args(), **p.op_kwargs()), out)


@pytest.mark.parametrize("T", [0, 1])
@pytest.mark.parametrize("v", PER_FORMAT, ids=lambda v: v.id)
def test_few_tokens(v, T):
    p = problem(v, T)
    out, grads = op_grads(p, checkpointing=False)
    assert out.shape == (T, v.H)
    ref_out, ref_grads = reference_grads(p)
    assert_matches_reference(out, ref_out)
    assert_grads_match(grads, ref_grads)


@pytest.mark.parametrize("v", [VARIANTS[2], PER_FORMAT[2]], ids=lambda v: v.id)
def test_gradients_without_lora(v):
    # A quantized base without LoRA is differentiable too (hidden states, routing weights):
    # backward runs on the dequantized weights. The recomputing forward is the kernel (q8
    # activations for the integer formats), so only the saving forward's output is compared.
    p = problem(v, 9, ranks={})
    ref_out, ref_grads = reference_grads(p)
    for checkpointing in (False, True):
        out, grads = op_grads(p, checkpointing)
        if not checkpointing:
            assert_matches_reference(out, ref_out)
        assert_grads_match(grads, ref_grads)


def test_low_precision_activations_and_adapters():
    v = VARIANTS[2]  # int4 g32 asymmetric
    p = problem(v, 7, act=torch.bfloat16, lora_dtype=torch.bfloat16)
    out, grads = op_grads(p, checkpointing=False)
    assert out.dtype == torch.bfloat16 and grads["down_lora_b"].dtype == torch.bfloat16
    ref_out, ref_grads = reference_grads(p)
    # bf16 hidden states: where the CPU has AVX512_BF16 the forward runs the exact qint
    # tiles (avx512_bf16/qint_dp_exact), whose down projection reads the GLU output
    # rounded to bf16, as a bf16 base's tile path does: that base's output bound.
    assert_matches_reference(out, ref_out, TOL_BF16_ON_KERNELS)
    # bf16 hidden states and output gradient: where the CPU has the bf16 products, x's
    # gradient runs on them (dg, du and the split weights' hi part rounded to bf16,
    # moe_lora.cpp): about two bf16 roundings of each product, ~1e-3 of max|dx|, as a bf16
    # base's (test_lora_gradients_at_fp32_accuracy_on_a_bf16_base).
    assert_grads_match(grads, ref_grads, {"hidden_states": TOL_BF16_ON_KERNELS})


@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
@pytest.mark.parametrize("v", [VARIANTS[2], PER_FORMAT[2], PER_FORMAT[-2]], ids=lambda v: v.id)
def test_thread_counts_bit_identical(v, checkpointing):
    p = problem(v, 48)
    results = []
    for threads in (1, 2):
        kt_ops.set_num_threads(threads)
        results.append(op_grads(p, checkpointing))
    (out1, grads1), (out2, grads2) = results
    assert torch.equal(out1, out2)
    for name in grads1:
        assert torch.equal(grads1[name], grads2[name]), name


@pytest.mark.parametrize("v", PER_FORMAT, ids=lambda v: v.id)
def test_lora_path_vs_kernel_path(v):
    # B = 0: the LoRA path computes the base alone, on fp32 activations. The kernels of the
    # q8 formats round the activations to int8 first (reference_quant_moe_forward), so the
    # two differ by that rounding (~1e-2 of max|out| here); fp8 kernels keep fp32 activations.
    p = problem(v, 16)
    lora = {k: (torch.zeros_like(t) if k.endswith("_b") else t) for k, t in p.lora.items()}
    args = p.op_args()
    with_lora = kt_ops.moe_forward(*args, p.lora_weights(lora))
    assert_matches_reference(with_lora, reference_moe_forward(*args))
    kernel = kt_ops.moe_forward(*args)
    diff = ((with_lora - kernel).abs().max() / kernel.abs().max()).item()
    if format_spec(v.fmt).activation == "q8":
        assert 1e-4 < diff < 5e-2, diff
    else:
        assert diff < 1e-4, diff


@pytest.mark.parametrize("T", [0, 1, 16])
@pytest.mark.parametrize("v", PER_FORMAT, ids=lambda v: v.id)
def test_lora_inference_with_q8_pinned_is_the_kernel_path_plus_the_lora_terms(v, T):
    # quant_activations='q8' sends LoRA calls without autograd to the inference driver:
    # the base's own kernels (q8 activations where the format has them) with the same
    # LoRA terms in the block epilogues (x A^T B^T for gate and up, h Ad^T Bd^T for down).
    p = problem(v, T)
    args = p.op_args()
    zero_b = {k: (torch.zeros_like(t) if k.endswith("_b") else t) for k, t in p.lora.items()}
    with torch.no_grad(), kt_ops.use_quant_activations("q8"):
        kernel = kt_ops.moe_forward(*args)
        # B = 0: the terms add exact zeros, so these are the base inference's bits.
        assert torch.equal(kt_ops.moe_forward(*args, p.lora_weights(zero_b)), kernel)
        got = kt_ops.moe_forward(*args, **p.op_kwargs())
    assert got.shape == (T, v.H)
    if T == 0:
        return
    want = reference_moe_forward(*args, p.lora_weights())
    want_delta = want - reference_moe_forward(*args)
    assert want_delta.abs().max() > 0.1 * want.abs().max()  # the LoRA terms matter here
    if format_spec(v.fmt).activation == "q8":
        # The q8 rounding of x and h (~1e-2 of max|out|, test_lora_path_vs_kernel_path)
        # moves the LoRA terms' inputs too (the delta's error 0.8-1.6e-2 of max|out| here,
        # the delta itself 18-31% of it).
        delta_err = ((got - kernel) - want_delta).abs().max() / want.abs().max()
        assert delta_err.item() < 3e-2, delta_err.item()
        assert ((got - want).abs().max() / want.abs().max()).item() < 3e-2
    else:
        assert_matches_reference(got, want)


def test_opcheck():
    p = problem(VARIANTS[2], 7)  # int4 asymmetric: scales and zeros
    q = _requires_grad(p)
    for op in (torch.ops.kt.moe_forward.default, torch.ops.kt.moe_forward_train.default):
        torch.library.opcheck(op, q.raw_args())
    args = (p.grad_output, *p.raw_args())
    torch.library.opcheck(torch.ops.kt.moe_backward.default, args)
    _, gate_pre, up_pre = kt_ops.ops.moe_forward_train(*p.op_args(), **p.op_kwargs())
    kwargs = {"gate_pre": gate_pre, "up_pre": up_pre}
    torch.library.opcheck(torch.ops.kt.moe_backward.default, args, kwargs)


# --------------------------------------------------------------------------
# Modules and models
# --------------------------------------------------------------------------


def test_moe_experts_from_dense_int4_trains():
    E, H, I, T = 8, 64, 32, 24
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(E, n, k, generator=g) / k**0.5 for n, k in ((I, H), (I, H), (H, I))]
    m = MoEExperts.from_dense(*dense, "int4", group_size=32, activation_checkpointing=True)
    assert m.activation_checkpointing is True and m.group_sizes == (32, 32, 32)
    m.add_lora(4, 8, generator=torch.Generator().manual_seed(1))
    buffers = {n: b.clone() for n, b in m.named_buffers()}
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    w = torch.rand(T, 2, generator=g)
    target = torch.randn(T, H, generator=g) * 0.1
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x, ids, w), target)
        loss.backward()
        assert all(p.grad is not None for p in m.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses
    for name, b in m.named_buffers():  # the quantized base stays frozen
        assert torch.equal(b, buffers[name]), name


def test_hf_model_int4_base_trains_and_saves_adapter(tmp_path):
    pytest.importorskip("peft")
    lora_helpers = pytest.importorskip("lora_helpers")
    from kt_ops import peft_adapters
    from kt_ops.lora import apply_lora, lora_factors, lora_parameters

    plain = lora_helpers.tiny_model("qwen3_moe")

    def quantized():
        return kt_ops.replace_experts(copy.deepcopy(plain), "int4", group_size=32)

    model = quantized().train()
    experts = model.model.layers[0].mlp.experts
    assert experts.weight_format == "int4" and experts.group_sizes == (32, 32, 32)
    apply_lora(model, rank=4, alpha=8, seed=0, freeze_base=True)
    opt = torch.optim.SGD([p for _, p in lora_parameters(model)], lr=0.5)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = lora_helpers.lm_loss(model)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert lora_factors(experts)["down"][1].abs().max() > 0  # B moved off zero

    # The adapter does not depend on the base: save, load onto another int4 copy.
    model.eval()
    want = lora_helpers.logits(model)
    peft_adapters.save_pretrained(model, tmp_path)
    again = peft_adapters.load_adapter(quantized(), tmp_path)
    assert torch.equal(lora_helpers.logits(again), want)
    for name, p in lora_parameters(again):
        assert torch.equal(p, dict(lora_parameters(model))[name]), name
