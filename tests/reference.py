"""Pure-PyTorch reference of ``kt::moe_forward``, its tolerances, and input generators.

The reference is deliberately plain: it dequantizes the packed weights with the
format's reference dequantizer (``kt_ops.unpack_weights``), then loops over the
experts that received tokens and runs the gated MLP of each one as dense fp32
matmuls over all of its (token, slot) rows at once::

    out[t] = sum_k w[t, k] * W_down[e] @ (act(W_gate[e] @ x[t]) * (W_up[e] @ x[t])),
    e = ids[t, k], slots with e == -1 skipped, act = torch's silu (default) or gelu

It shares no code with the C++ op beyond ``unpack_weights`` (itself a few lines
of ``permute``/``reshape``, tested against the dense weights in
test_moe_forward.py).

Tolerances live here, one per weight format (ggml's ``kTol<fmt>`` style), so
every test file (op, nn, hf) compares with the same numbers:

* ``Tolerance.compute``: the fp32 accumulation error of the op relative to the
  largest reference magnitude. Both sides use the same bf16 weights and the
  same fp32 activations, so they differ only by fp32 summation order (blocked
  FMA chains vs. BLAS) and the vector ``exp`` in SiLU: a few ulp times
  sqrt(reduction length), i.e. 5e-6 (one ulp, 2^-23 x sqrt(2048)) to 2e-5 (three)
  for H = 2048. 1e-4 leaves a margin of 5-20x yet catches a single wrong weight,
  token or routing weight.
* ``OUTPUT_ROUNDING``: the output is the fp32 result rounded once to the
  activation dtype, which adds at most half an ulp: 2^-8 relative for bf16,
  2^-11 for fp16, 0 for fp32 (plus half the smallest fp16 subnormal).

A compared element passes when
``|out - ref| <= compute * max|ref| * (1 + rtol) + rtol * |ref| + subnormal``,
with ``ref`` the fp32 reference *before* rounding to the output dtype: sound by
the triangle inequality, and no looser than that.
"""

# T, H, I, E, K: tokens, hidden, intermediate, experts, top-k (the design notes' names).
# ruff: noqa: E741

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any, Optional

import torch
from torch import Tensor

import kt_ops
from kt_ops.formats import quantize_weights
from kt_ops.layer import layer_args, torch_glu


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Allowed difference between ``kt::moe_forward`` and ``reference_moe_forward``."""

    #: max |op_fp32 - ref_fp32| / max|ref_fp32| before the output is rounded.
    compute: float


#: weight_format 'bf16': exact bf16 weights, fp32 accumulation (see module doc).
TOL_BF16 = Tolerance(compute=1e-4)

#: weight_format 'bf16' on oneDNN's brgemm (kt_ops.set_compute_path('brgemm')) against
#: the reference with ``bf16_activations=True``: the activations and the SwiGLU
#: outputs are rounded to bf16 on both sides, so only the fp32 accumulation
#: order differs, plus the SwiGLU outputs that land on the other side of a bf16
#: rounding boundary (one bf16 ulp of one term of a down-projection sum).
TOL_BF16_BRGEMM = Tolerance(compute=5e-4)

#: One tolerance per weight format; a new format adds its line here.
TOLERANCES = {"bf16": TOL_BF16}

#: Relative error of rounding an fp32 value once to the output dtype (half an ulp).
OUTPUT_ROUNDING = {
    torch.float32: 0.0,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}

#: Absolute half-ulp of the smallest subnormal per output dtype.
OUTPUT_SUBNORMAL = {
    torch.float32: 0.0,
    torch.bfloat16: 0.0,
    torch.float16: 2.0**-25,
}

ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: A tiny MoE for ``kt_ops.demo.make_config`` (tests that build transformers
#: models): 8 experts, H=64, I=32, top-2, 2 layers. transformers' default
#: init_std 0.02 makes a 64-wide model's experts contribute ~1e-3 of the
#: logits; at 0.2 a 1% change of the expert weights moves the logits by ~1%,
#: so the checks see it.
TINY_MOE_CONFIG = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    num_experts=8,
    top_k=2,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=128,
    init_std=0.2,
)


# --------------------------------------------------------------------------
# The reference
# --------------------------------------------------------------------------


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """Run ATen single-threaded inside the block (restored after).

    The reference is many small ops; on a shared 2-core machine each OpenMP
    region costs milliseconds of wake-up (100x the op itself), and one thread
    is also deterministic.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def reference_moe_forward(
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    experts: kt_ops.ExpertWeights,
    lora: Optional[kt_ops.LoRAWeights] = None,
    *,
    out_dtype: Optional[torch.dtype] = torch.float32,
    bf16_activations: bool = False,
    fp8_scaled_activations: bool = False,
    act: str = "silu",
) -> Tensor:
    """Dense fp32 reference of ``kt_ops.moe_forward(hidden_states, ..., experts, lora)``.

    Multiplies fp32 activations with each projection's dequantized weights
    (``kt_ops.unpack_weights`` for bf16, ``kt_ops.formats.dequantize_weights``
    otherwise; each projection in its own format): what the op computes for
    bf16 and fp8, and with LoRA, where the base runs on ATen from the
    dequantized weights. (Without LoRA the integer formats' kernels also round
    the activations to q8: ``reference_for`` / ``reference_quant_moe_forward``.)

    Returns the fp32 result (``out_dtype=torch.float32``, the default, which is
    what the tolerances are defined against) or that result rounded once to
    ``out_dtype`` (``None``: the dtype of ``hidden_states``, as the op returns).
    Only the experts that receive tokens are dequantized, so a 128-expert layer
    never materializes as fp32 at once.

    A projection ``p`` of ``lora`` with factors ``(A, B)`` adds
    ``lora.scaling * (v @ A[e].T) @ B[e].T`` (Hu et al. 2021, PEFT convention).
    Differentiable: autograd through this function gives the reference
    gradients for ``hidden_states``, ``topk_weights`` and the LoRA factors.

    ``bf16_activations=True`` rounds the activations and the SwiGLU outputs to
    bf16 before they are multiplied (what the bf16 brgemm path computes,
    ``kt_ops.set_compute_path('brgemm')``). ``fp8_scaled_activations=True``
    computes each fp8 projection (no LoRA) as the fp8 brgemm does: per 128-row
    band, the fp32 activations times the band's 128-k block scales, rounded
    once to bf16, times the exact E4M3 values (:func:`fp8_banded_product`).
    ``act``: the experts' GLU (``activation=`` of the op, parameters included; torch's
    own functions, :func:`kt_ops.layer.torch_glu`). Each projection's per-expert
    ``bias`` (``ExpertWeights.with_biases``) is added to its product.
    """
    glu = torch_glu(act)
    T, H = hidden_states.shape
    if H != experts.hidden_size:
        raise ValueError(f"reference: hidden_states has {H} columns, experts {experts.hidden_size}")
    lora = lora if lora is not None else kt_ops.LoRAWeights()

    def project(v: Tensor, p: Any, proj: str, e: int) -> Tensor:
        pair = getattr(lora, proj)
        if fp8_scaled_activations and p.weight_format in FP8_TILE_FORMATS and pair is None:
            return fp8_banded_product(v, p, e)
        if bf16_activations:
            v = v.bfloat16().float()
        y = v @ dense_expert(p, e).T
        if pair is not None:
            a, b = pair
            y = y + lora.scaling * ((v @ a[e].float().T) @ b[e].float().T)
        return y if p.bias is None else y + p.bias[e]

    with single_threaded_torch():
        x = hidden_states.float()
        ids = topk_ids.long()
        w = topk_weights.float()
        out = torch.zeros(T, H, dtype=torch.float32)
        for e in torch.unique(ids[ids >= 0]).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            pg, pu, pd = experts.projections
            xe = x[tok]
            h = glu(project(xe, pg, "gate", e), project(xe, pu, "up", e))
            y = project(h, pd, "down", e) * w[tok, slot].unsqueeze(1)
            out = out.index_add(0, tok, y)
    if out_dtype is None:
        out_dtype = hidden_states.dtype
    return out.to(out_dtype)


def assert_lora_gradients_match(
    experts: kt_ops.ExpertWeights,
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    *,
    act: str = "silu",
    activation_checkpointing: Optional[bool] = None,
    seed: int = 0,
) -> None:
    """``kt_ops.moe_forward`` with random rank-4 LoRA factors on gate, up and down (scaling
    2): its output and the gradients of ``hidden_states``, ``topk_weights`` and every
    factor (fp32), against autograd through :func:`reference_moe_forward`.

    The factors and the output gradient are seeded (``seed``, 9); ``act`` is the
    op's ``activation``. Raises ``AssertionError`` naming the first tensor that differs.
    """
    E, H, inter = experts.num_experts, experts.hidden_size, experts.intermediate_size
    g = torch.Generator().manual_seed(seed)
    factors = {}
    for proj, (n, k) in {"gate": (inter, H), "up": (inter, H), "down": (H, inter)}.items():
        factors[f"{proj}_lora_a"] = torch.randn(E, 4, k, generator=g) * 0.3 / k**0.5
        factors[f"{proj}_lora_b"] = torch.randn(E, n, 4, generator=g) * 0.3 / 2
    grad_out = torch.randn(hidden_states.shape, generator=torch.Generator().manual_seed(9))

    def grads(fn, **kwargs):
        x = hidden_states.clone().requires_grad_()
        tw = topk_weights.clone().requires_grad_()
        f = {k: v.clone().requires_grad_() for k, v in factors.items()}
        pairs = {p: (f[f"{p}_lora_a"], f[f"{p}_lora_b"]) for p in ("gate", "up", "down")}
        out = fn(x, topk_ids, tw, experts, kt_ops.LoRAWeights(**pairs, scaling=2.0), **kwargs)
        out.backward(grad_out)
        return out.detach(), {"x": x.grad, "w": tw.grad, **{k: v.grad for k, v in f.items()}}

    got_out, got = grads(
        kt_ops.moe_forward, activation=act, activation_checkpointing=activation_checkpointing
    )
    want_out, want = grads(reference_moe_forward, act=act)
    assert_matches_reference(got_out, want_out)
    for name, grad in got.items():
        msg = mismatch_report(grad, want[name])
        assert msg is None, f"{act}: grad of {name}: {msg}"


#: The formats the fp8 tile kernels (oneDNN's bf16 brgemm, kt_ops' fp8_dp) compute.
FP8_TILE_FORMATS = ("fp8", "fp8_channel", "mxfp8")


def fp8_banded_product(v: Tensor, p: Any, e: int) -> Tensor:
    """``v [m, k] @ W[e].T`` as the fp8 brgemm computes it: ``[m, n]`` fp32.

    For each 128-row band ``b`` of the fp8 projection ``p``: ``bf16(v * s[b,
    k // 128]) @ e4m3[rows of b].T``, the E4M3 values exact (the block scales
    applied to the activations, rounded once to bf16). ``fp8_channel``:
    ``(bf16(v) @ e4m3.T) * s[row]`` (unit band scales, the row scales on the outputs).
    ``mxfp8``: ``bf16(v) @ W.T`` (unit band scales, its power-of-two scales exact in
    the decoded bf16 values; blocks whose exponents leave bf16's range stream instead:
    only where a test makes them).
    """
    from kt_ops.formats import PackedProjection, unpack_group_params

    if p.weight_format == "mxfp8":
        return v.bfloat16().float() @ dense_expert(p, e).T

    if p.weight_format == "fp8_channel":
        ones = torch.ones_like(p.scales[e : e + 1])
        codes = dense_expert(
            PackedProjection(p.weight[e : e + 1], ones, None, p.weight_format, 0, p.n, p.k), 0
        )
        s = unpack_group_params(p.scales[e : e + 1], p.n)[0, :, 0]
        return (v.bfloat16().float() @ codes.T) * s

    ones = torch.ones_like(p.scales[e : e + 1])
    codes = dense_expert(
        PackedProjection(p.weight[e : e + 1], ones, None, "fp8", p.group_size, p.n, p.k), 0
    )  # the exact E4M3 values [n, k]
    out = torch.empty(v.shape[0], p.n)
    for b in range(p.scales.shape[1]):
        rows = slice(128 * b, min(p.n, 128 * (b + 1)))
        sk = p.scales[e, b].repeat_interleave(128)[: p.k]
        out[:, rows] = (v * sk).bfloat16().float() @ codes[rows].T
    return out


def dense_expert(p: Any, e: int) -> Tensor:
    """Expert ``e`` of one packed projection (a ``PackedProjection``) as dense fp32 ``[n, k]``."""
    if p.weight_format == "bf16":
        return kt_ops.unpack_weights(p.weight[e : e + 1], p.n, p.k)[0]
    from kt_ops.formats import PackedProjection, dequantize_weights

    def one(t: Optional[Tensor]) -> Optional[Tensor]:
        return None if t is None else t[e : e + 1]

    q = PackedProjection(
        one(p.weight), one(p.scales), one(p.zeros), p.weight_format, p.group_size, p.n, p.k
    )
    return dequantize_weights(q)[0]


def mismatch_report(
    out: Tensor,
    ref: Tensor,
    tol: Tolerance = TOL_BF16,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> Optional[str]:
    """``None`` when every element of ``out`` is within tolerance of ``ref``; else why not.

    ``ref`` is the fp32 reference (before rounding); ``out_dtype`` defaults to
    ``out.dtype`` and selects the output-rounding term. Every element is
    compared: shapes must match exactly and a NaN/inf anywhere in ``out`` fails.
    """
    out_dtype = out.dtype if out_dtype is None else out_dtype
    if tuple(out.shape) != tuple(ref.shape):
        return f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}"
    if out.numel() == 0:
        return None
    o = out.float()
    r = ref.float()
    if not torch.isfinite(o).all():
        bad = (~torch.isfinite(o)).nonzero()
        return f"{bad.shape[0]} non-finite output element(s), first at {bad[0].tolist()}"
    if not torch.isfinite(r).all():
        return "the reference itself is not finite: the test inputs are too large"
    rtol = OUTPUT_ROUNDING[out_dtype]
    scale = r.abs().max().item()
    atol = tol.compute * scale * (1.0 + rtol) + OUTPUT_SUBNORMAL[out_dtype]
    err = (o - r).abs()
    allowed = atol + rtol * r.abs()
    bad = err > allowed
    if bad.any():
        n_bad = int(bad.sum())
        flat = int((err - allowed).flatten().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), o.shape))
        return (
            f"{n_bad} of {o.numel()} elements out of tolerance (compute={tol.compute:g}, "
            f"rtol={rtol:g}, max|ref|={scale:.4g}); worst at {list(idx)}: "
            f"out={o[idx].item():.6g} ref={r[idx].item():.6g} "
            f"|diff|={err[idx].item():.3g} > allowed {allowed[idx].item():.3g}"
        )
    return None


def assert_matches_reference(
    out: Tensor,
    ref: Tensor,
    tol: Tolerance = TOL_BF16,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> None:
    """Assert ``out`` (any dtype) matches the fp32 reference ``ref``; see ``mismatch_report``."""
    msg = mismatch_report(out, ref, tol, out_dtype=out_dtype)
    assert msg is None, msg


# --------------------------------------------------------------------------
# Input generators
# --------------------------------------------------------------------------


def make_expert_weights(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    seed: int = 0,
    weight_format: str = "bf16",
) -> kt_ops.ExpertWeights:
    """Random packed experts, scaled by 1/sqrt(fan-in) (like nn.Linear) so outputs are O(1).

    Gate weights are twice as large, so SiLU sees arguments of both signs up to
    about +-6 (its curved part, not just its linear tail). ``weight_format`` is
    one name or ``'gate,up,down'`` (each format's default group size).
    """
    if weight_format == "bf16":
        dense = dense_expert_weights(num_experts, hidden_size, intermediate_size, seed=seed)
        return kt_ops.ExpertWeights(*(quantize_weights(w, "bf16") for w in dense))
    return make_quant_experts(weight_format, num_experts, hidden_size, intermediate_size, seed=seed)


def bf16_projection(weight: Tensor, n: int, k: int) -> Any:
    """A ``PackedProjection`` of an already bf16-packed ``[E, ceil(n/16), ceil(k/2), 16, 2]``."""
    from kt_ops.formats import PackedProjection

    return PackedProjection(weight, None, None, "bf16", 0, n, k)


def make_large_expert_weights(
    num_experts: int, hidden_size: int, intermediate_size: int, *, seed: int = 0
) -> kt_ops.ExpertWeights:
    """bf16 packed experts for model-sized layers (e.g. Qwen3-30B-A3B: 1.2 GB), made fast.

    Drawing 600M normals and packing them takes ~15 s on 2 cores, so this draws
    16 distinct random experts directly in the packed layout (valid only when
    ``H`` and ``I`` are multiples of 16, i.e. no padding) and makes expert
    ``e = 16 * j + i`` the base ``i`` scaled by a distinct factor ``0.5 + j/8``:
    every expert still differs from every other one, so an expert mix-up shows.
    """
    E, H, I = num_experts, hidden_size, intermediate_size
    if H % 16 or I % 16:
        raise ValueError("make_large_expert_weights needs H and I multiples of 16")
    n_base = min(16, E)
    reps = -(-E // n_base)
    g = torch.Generator().manual_seed(seed)
    scales = (0.5 + torch.arange(reps, dtype=torch.float32) / 8).to(torch.bfloat16)
    scales = scales.view(reps, 1, 1, 1, 1, 1)

    def one(n: int, k: int, std: float) -> Any:
        base = torch.randn(n_base, n // 16, k // 2, 16, 2, generator=g, dtype=torch.float32)
        base = (base * std).to(torch.bfloat16)
        full = torch.mul(base.unsqueeze(0), scales)  # [reps, n_base, ...] in one pass
        packed = full.reshape(reps * n_base, n // 16, k // 2, 16, 2)[:E].contiguous()
        return bf16_projection(packed, n, k)

    return kt_ops.ExpertWeights(
        one(I, H, 2.0 / math.sqrt(H)),
        one(I, H, 1.0 / math.sqrt(H)),
        one(H, I, 1.0 / math.sqrt(I)),
    )


def make_routing(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    *,
    seed: int = 0,
    ids_dtype: torch.dtype = torch.int64,
    weights_dtype: torch.dtype = torch.float32,
    skip_fraction: float = 0.0,
    skip_rows: tuple[int, ...] = (),
) -> tuple[Tensor, Tensor]:
    """Top-k routing like a softmax router: ``K`` distinct experts per token, positive weights.

    ``skip_fraction`` of the slots get id -1 (experts served elsewhere), and
    every row in ``skip_rows`` is entirely -1. Requires ``top_k <= num_experts``.
    """
    g = torch.Generator().manual_seed(seed)
    T, E, K = num_tokens, num_experts, top_k
    logits = torch.randn(T, E, generator=g)
    vals, ids = torch.topk(logits, K, dim=1)
    weights = torch.softmax(vals, dim=1)
    if skip_fraction > 0:
        skip = torch.rand(T, K, generator=g) < skip_fraction
        ids = torch.where(skip, torch.full_like(ids, -1), ids)
    for row in skip_rows:
        ids[row] = -1
    return ids.to(ids_dtype), weights.to(weights_dtype)


def make_hidden(
    num_tokens: int, hidden_size: int, dtype: torch.dtype = torch.bfloat16, *, seed: int = 0
) -> Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(num_tokens, hidden_size, generator=g).to(dtype)


# --------------------------------------------------------------------------
# sample_inputs(): argument sets for opcheck and the fake kernel (extension-cpp)
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Sample:
    """One call of ``torch.ops.kt.moe_forward``: positional args and kwargs."""

    name: str
    args: tuple
    kwargs: dict[str, Any]
    experts: Any = None  # the kt_ops.ExpertWeights of args

    def reference(self) -> Tensor:
        """``reference_moe_forward`` of this call (fp32)."""
        x, ids, weights = self.args[:3]
        return reference_moe_forward(x, ids, weights, self.experts)


def sample_inputs() -> Iterator[Sample]:
    """Varied valid argument sets: token counts, odd sizes, dtypes, -1 ids."""
    cases = [
        # name, T, H, I, E, K, act dtype, ids dtype, weights dtype, skip frac, skip rows
        ("decode_bf16", 1, 64, 32, 4, 2, torch.bfloat16, torch.int64, torch.float32, 0.0, ()),
        ("odd_fp32", 7, 33, 17, 5, 3, torch.float32, torch.int32, torch.float32, 0.3, (2,)),
        ("fp16_w16", 9, 130, 70, 8, 2, torch.float16, torch.int64, torch.float16, 0.0, ()),
        ("bf16_wbf16", 20, 48, 16, 6, 4, torch.bfloat16, torch.int32, torch.bfloat16, 0.0, ()),
        ("tile_pm1", 17, 15, 15, 3, 1, torch.float32, torch.int64, torch.float32, 0.0, ()),
        ("empty_T0", 0, 32, 16, 4, 2, torch.bfloat16, torch.int64, torch.float32, 0.0, ()),
        ("all_skipped", 3, 32, 16, 4, 2, torch.float32, torch.int64, torch.float32, 0.0, (0, 1, 2)),
    ]
    for i, (name, T, H, I, E, K, act, idt, wdt, frac, rows) in enumerate(cases):
        w = make_expert_weights(E, H, I, seed=i)
        ids, weights = make_routing(
            T, E, K, seed=i, ids_dtype=idt, weights_dtype=wdt, skip_fraction=frac, skip_rows=rows
        )
        x = make_hidden(T, H, act, seed=i)
        yield Sample(name, (x, ids, weights) + layer_args(w, None, "silu", x), {}, w)


# --------------------------------------------------------------------------
# Quantized formats: packed projections, their dense reference, raw blocks
# --------------------------------------------------------------------------
#
# The reference of a quantized call dequantizes every projection with
# ``kt_ops.formats.dequantize_weights`` (index arithmetic straight from
# docs/formats.md, no code shared with the packers or the kernels) and, for the
# formats whose kernels multiply int8 activations (``format_spec(f).activation
# == 'q8'``), rounds the activations exactly as the kernels do
# (:func:`q8_activations`, the formula of ``quantize_activations_q8``): the
# hidden states before gate/up and the SwiGLU output before down.
#
# What is left between the op and this reference:
#
# * fp32 summation order (int32 group sums scaled per group in the kernel,
#   fp32 BLAS here) and SiLU's exp: ~5e-7 of max|ref| observed.
# * A SwiGLU value ``h`` whose ``h * 127 / amax`` lies on (or within rounding
#   noise of) a .5 tie of the q8 rounding can round to the neighbouring code in
#   the kernel: that token's output then moves by one code step (amax/127 of
#   the 32-block) times one column of the down projection. This is ~3e-3 of the
#   token's output for I = 64 (observed up to 1.1e-3 of max|ref| over a
#   batch), so a flat tolerance that admits it would be loose. Instead the
#   reference returns a per-element *slack*: for every SwiGLU value within
#   ``Q8_TIE_WINDOW`` code units of a tie, ``routing weight * step * |W_down[:, j]|``
#   is added to the allowance of that token's outputs (exactly the most that
#   flipping that code can change them). Ties in the hidden states themselves
#   need no slack: both sides compute ``x * (127 / amax)`` from identical fp32
#   values.
#
# A compared element passes when
#   |out - ref| <= compute * max|ref| * (1 + rtol) + slack * (1 + rtol) + rtol * |ref| + subnormal
# (rtol, subnormal: the output rounding, as for bf16).

#: op vs ``reference_quant_moe_forward`` (plus its tie slack): 20x the largest
#: summation-order difference observed (~1e-6 of max|ref|). A wrong code or
#: scale, or leaving the activation rounding out of the reference (>= 2e-2),
#: is far outside.
TOL_QUANT = Tolerance(compute=2e-5)

#: A q8 code is "ambiguous" when ``|frac(h * 127 / amax) - 0.5|`` is below this:
#: the two sides' ``h`` differ by ~1e-6 relative (< 2e-4 code units at |code| <= 127),
#: so 2e-3 is a 10x margin; about 0.4% of the SwiGLU values fall in it.
Q8_TIE_WINDOW = 2e-3

for _fmt in (
    "int8",
    "int4",
    "fp8",
    "fp8_channel",
    "mxfp8",
    "mxfp4",
    "nvfp4",
    "q8_0",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q2_k",
    "q3_k",
    "q4_k",
    "q5_k",
    "q6_k",
    "iq4_nl",
    "iq4_xs",
    "iq1_s",
    "iq1_m",
    "iq2_xxs",
    "iq2_xs",
    "iq2_s",
    "iq3_xxs",
    "iq3_s",
):
    TOLERANCES[_fmt] = TOL_QUANT
del _fmt


def _q8_blocks(x: Tensor, block: int) -> tuple[Tensor, Tensor, Tensor]:
    """``x [..., K]`` -> (``xb [rows, Kp/block, block]`` fp32 zero padded, ``amax``, ``inv``)."""
    K = x.shape[-1]
    kp = -(-K // block) * block
    xf = torch.nn.functional.pad(x.detach().float().reshape(-1, K), (0, kp - K))
    xb = xf.view(xf.shape[0], kp // block, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    # tensor / tensor: the correctly rounded quotient (127 / tensor is 127 * reciprocal)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / safe, torch.zeros_like(amax))
    return xb, amax, inv


def q8_activations(x: Tensor, block: int = 32) -> Tensor:
    """The q8 activation rounding of docs/formats.md, in fp32 exactly as written there.

    Per row, per ``block`` values along the last dimension (zero padded)::

        amax = max|x|;  sx = amax / 127;  xq = round_half_even(x * (127 / amax))  (0 if amax = 0)

    returning ``xq * sx`` (fp32, the shape of ``x``): the function of
    ``kt_ops.formats.quantize_activations_q8``, written again here so that the
    kernel tests do not depend on it. ``127 / amax`` must be the correctly
    rounded fp32 quotient, as in the C++ kernels (``127.f / amax``): PyTorch
    evaluates ``127 / tensor`` (a Python scalar over a tensor) as
    ``127 * reciprocal(tensor)``, one ulp off for ~25% of the values, and for
    activations on a coarse grid (bf16) ``x * (127 / amax)`` often lands
    exactly on a .5 tie, where that ulp picks the other code (see
    test_quant_forward.py::test_quantize_activations_q8_matches_the_kernel_formula).
    """
    if x.numel() == 0:
        return x.detach().float().clone()
    K = x.shape[-1]
    xb, amax, inv = _q8_blocks(x, block)
    sx = amax / torch.full_like(amax, 127.0)
    xq = torch.round(xb * inv).clamp_(-127, 127)
    return (xq * sx).view(xb.shape[0], -1)[:, :K].reshape(x.shape)


def q8_tie_steps(x: Tensor, block: int = 32, window: float = Q8_TIE_WINDOW) -> Tensor:
    """The q8 step ``amax/127`` where ``x * 127/amax`` is within ``window`` of a .5 tie, else 0.

    fp32, the shape of ``x``: how far each value's q8 rounding may move if it
    lands on the other side of the tie.
    """
    if x.numel() == 0:
        return x.detach().float().clone()
    K = x.shape[-1]
    xb, amax, inv = _q8_blocks(x, block)
    v = xb * inv
    near = ((v - v.floor() - 0.5).abs() < window) & (amax > 0)
    step = (amax / torch.full_like(amax, 127.0)).expand_as(v)
    out = torch.where(near, step, torch.zeros_like(v))
    return out.view(xb.shape[0], -1)[:, :K].reshape(x.shape)


#: Dense fp32 weights of packed experts, by the ``id`` s of all their packed tensors
#: (``dense_weights``); the tensors are kept alive alongside, so an id is not reused.
_DENSE_CACHE: dict[tuple, tuple[tuple, tuple[Tensor, Tensor, Tensor]]] = {}


def dense_weights(experts: kt_ops.ExpertWeights) -> tuple[Tensor, Tensor, Tensor]:
    """Dequantized fp32 ``(gate [E, I, H], up [E, I, H], down [E, H, I])`` (cached).

    Each projection by its own format's reference dequantizer
    (``kt_ops.formats.dequantize_weights``; ``kt_ops.unpack_weights`` for bf16).
    """
    from kt_ops.formats import dequantize_weights

    tensors = tuple(t for t in experts.tensors() if t is not None)
    key = tuple(id(t) for t in tensors)
    hit = _DENSE_CACHE.get(key)
    if hit is not None and all(a is b for a, b in zip(hit[0], tensors)):
        return hit[1]

    def one(p: Any) -> Tensor:
        if p.weight_format == "bf16":
            return kt_ops.unpack_weights(p.weight, p.n, p.k)
        return dequantize_weights(p)

    with single_threaded_torch():
        dense = tuple(one(p) for p in experts.projections)
    if len(_DENSE_CACHE) > 64:
        _DENSE_CACHE.clear()
    _DENSE_CACHE[key] = (tensors, dense)
    return dense


def activation_of(experts: kt_ops.ExpertWeights) -> str:
    """``'q8'`` when some projection's kernels multiply q8 activations, else ``'fp32'``."""
    from kt_ops.formats import format_spec

    acts = {format_spec(p.weight_format).activation for p in experts.projections}
    return "q8" if "q8" in acts else "fp32"


def tolerance_for(experts: kt_ops.ExpertWeights) -> Tolerance:
    """The loosest of the projections' ``TOLERANCES``."""
    tols = [TOLERANCES[p.weight_format] for p in experts.projections]
    return max(tols, key=lambda t: t.compute)


def dense_expert_weights(
    num_experts: int, hidden_size: int, intermediate_size: int, *, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 ``(gate, up, down)`` drawn as in :func:`make_expert_weights` (before packing)."""
    g = torch.Generator().manual_seed(seed)
    E, H, I = num_experts, hidden_size, intermediate_size
    gate = torch.randn(E, I, H, generator=g) * (2.0 / math.sqrt(H))
    up = torch.randn(E, I, H, generator=g) / math.sqrt(H)
    down = torch.randn(E, H, I, generator=g) / math.sqrt(I)
    return gate, up, down


def make_quant_experts(
    weight_format: str,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    group_size: Optional[int] = None,
    symmetric: bool = True,
    seed: int = 0,
) -> kt_ops.ExpertWeights:
    """Random experts (as :func:`dense_expert_weights`) quantized with ``quantize_weights``.

    ``weight_format`` is one name or ``'gate,up,down'``; with a mix, ``group_size``
    and ``symmetric`` apply to the int4 projections only (the others keep their defaults).
    """
    from kt_ops.layer import split_weight_format

    fmts = split_weight_format(weight_format)
    mixed = len(set(fmts)) > 1
    dense = dense_expert_weights(num_experts, hidden_size, intermediate_size, seed=seed)

    def one(w: Tensor, fmt: str) -> Any:
        if mixed and fmt != "int4":
            return quantize_weights(w, fmt)
        return quantize_weights(w, fmt, group_size, symmetric)

    with single_threaded_torch():
        packed = [one(w, f) for w, f in zip(dense, fmts)]
    return kt_ops.ExpertWeights(*packed)


@dataclasses.dataclass
class QuantReference:
    """fp32 reference output ``out`` and the per-element allowance ``slack`` of q8 ties."""

    out: Tensor
    slack: Tensor


def reference_quant_moe_forward(
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate: Tensor,
    up: Tensor,
    down: Tensor,
    *,
    activation: str = "q8",
    fp32_min_tokens: Optional[int] = None,
    act: str = "silu",
) -> QuantReference:
    """Dense fp32 reference of a quantized ``moe_forward`` on dense weights.

    ``gate``/``up`` ``[E, I, H]`` and ``down`` ``[E, H, I]`` are fp32 weights
    (``QuantExperts.dense()`` for the op's reference; the original dense
    weights to measure the total quantization error). ``activation='q8'``
    rounds the activations as the q8 kernels do (the hidden states before
    gate/up, the SwiGLU output before down, :func:`q8_activations`) and
    fills ``slack`` (see the comment above ``TOL_QUANT``); ``'fp32'`` leaves
    them alone (fp8 kernels, or the plain dense model) with zero slack.
    With ``fp32_min_tokens``, experts with at least that many routed slots
    take the fp32 path even for ``'q8'`` (``kt_ops.set_quant_activations('auto')``).
    ``act``: the experts' GLU activation (the op's ``activation=``).
    """
    glu = torch_glu(act)
    if activation not in ("q8", "fp32"):
        raise ValueError(f"activation must be 'q8' or 'fp32', got {activation!r}")
    T, H = hidden_states.shape
    with single_threaded_torch():
        x = hidden_states.float()
        ids = topk_ids.long()
        w = topk_weights.float()
        out = torch.zeros(T, H, dtype=torch.float32)
        slack = torch.zeros(T, H, dtype=torch.float32)
        for e in torch.unique(ids[ids >= 0]).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            xe = x[tok]
            q8 = activation == "q8" and (fp32_min_tokens is None or len(tok) < fp32_min_tokens)
            if q8:
                xe = q8_activations(xe)
            h = glu(xe @ gate[e].float().T, xe @ up[e].float().T)
            wd = down[e].float()
            we = w[tok, slot].unsqueeze(1)
            if q8:
                slack.index_add_(0, tok, (q8_tie_steps(h) @ wd.abs().T) * we.abs())
                h = q8_activations(h)
            out.index_add_(0, tok, (h @ wd.T) * we)
    return QuantReference(out, slack)


def q8_brgemm_min_tokens_of(weight_format: str) -> Optional[int]:
    """Rows per expert from which ``weight_format`` runs on the u8s8 brgemm (q8 activations).

    In the current compute path and quant-activation mode
    (``kt_ops.compute_paths()``): the 8-bit formats (int8, q8_0) on a CPU where
    oneDNN runs u8s8; ``None`` elsewhere (no brgemm, or a brgemm that takes
    other activations). Such experts multiply q8 activations even where
    ``fp32_min_tokens_of`` would send them to the fp32 path.
    """
    p = kt_ops.compute_paths().get(weight_format)
    if p is None or p["brgemm_kernel"] != "onednn/brgemm_u8s8":
        return None
    return p["brgemm_min_tokens"]


#: The tile kernels that multiply per-token int8 activations (w8a8 for int8, w4a8 for int4).
TOKEN_INT8_KERNELS = (
    "amx/w8a8_tiles",
    "avx512_vnni/w8a8_dp",
    "onednn/brgemm_w8a8",
    "avx512_vnni/w4a8_dp",
    "onednn/brgemm_w4a8",
    "amx/w4a8_tiles",
)
#: The w4a8 kernels (int4 with one scale per output channel): kt_ops' tiles, oneDNN's.
W4A8_KERNELS = ("avx512_vnni/w4a8_dp", "onednn/brgemm_w4a8", "amx/w4a8_tiles")
#: kt_ops' w4a8 tiles: int4 per channel only (oneDNN's take its groups too).
W4A8_KT_KERNEL = "avx512_vnni/w4a8_dp"
#: The smallest int4 group oneDNN's w4a8 takes (brgemm::kW4A8MinGroup): g32 streams.
W4A8_MIN_GROUP = 64


def w8a8_min_tokens_of(weight_format: str) -> Optional[int]:
    """Rows per expert from which ``weight_format`` runs on the w8a8 brgemm (per-token int8).

    In the current compute path and quant-activation mode (``kt_ops.compute_paths()``):
    int8 where kt_ops' vpdpbusd tiles or oneDNN's u8s8 run, under quant ``'auto'``;
    ``None`` elsewhere. Such
    experts multiply activations quantized per token (``q8_activations`` with one
    block per row, :func:`token_q8_activations`).
    """
    p = kt_ops.compute_paths().get(weight_format)
    if p is None or p["brgemm_kernel"] not in TOKEN_INT8_KERNELS:
        return None
    return p["brgemm_min_tokens"]


def token_int8_min_tokens_of(projection: Any) -> Optional[int]:
    """:func:`w8a8_min_tokens_of` of one packed projection: kt_ops' w4a8 tiles take int4
    projections with one scale per output channel only (``group_size`` 0), their
    grouped ones stream (q8 activations); oneDNN's w4a8 takes both, groups of at least
    :data:`W4A8_MIN_GROUP` (one call per group)."""
    m = w8a8_min_tokens_of(projection.weight_format)
    gs = getattr(projection, "group_size", 0)
    if m is None or gs == 0:
        return m
    kernel = kt_ops.compute_paths()[projection.weight_format]["brgemm_kernel"]
    if kernel not in W4A8_KERNELS:
        return m
    return m if kernel != W4A8_KT_KERNEL and gs >= W4A8_MIN_GROUP else None


def token_q8_activations(x: Tensor) -> Tensor:
    """Per-token int8 activations (the w8a8 brgemm): ``q8_activations`` over whole rows."""
    return q8_activations(x, block=max(1, x.shape[-1]))


def token_q8_tie_steps(x: Tensor) -> Tensor:
    """``q8_tie_steps`` of :func:`token_q8_activations`: the row's step where near a tie."""
    return q8_tie_steps(x, block=max(1, x.shape[-1]))


def fp8_brgemm_min_tokens_of(weight_format: str, act_dtype: torch.dtype) -> Optional[int]:
    """Rows per expert from which an ``weight_format`` projection runs on the fp8 brgemm.

    In the current compute path (``kt_ops.compute_paths()``): for ``'fp8'`` where
    the fp8 brgemm runs (under ``'auto'`` only for bf16 activations); ``None``
    elsewhere. Such projections multiply bf16(x * block scale) by the exact
    E4M3 values (:func:`fp8_banded_product`).
    """
    if weight_format not in FP8_TILE_FORMATS:
        return None
    p = kt_ops.compute_paths().get(weight_format)
    if p is None or p["brgemm_kernel"] is None:
        return None
    if kt_ops.get_compute_path() == "auto" and act_dtype != torch.bfloat16:
        return None
    return p["brgemm_min_tokens"]


def fp32_min_tokens_of(weight_format: str) -> Optional[int]:
    """Rows per expert from which projections in ``weight_format`` multiply fp32 activations.

    In the current mode (``kt_ops.get_quant_activations()``): 1 (always) for the
    formats whose kernels take fp32 activations (bf16, fp8) and in mode
    ``'fp32'``; ``None`` (never) in mode ``'q8'``; the format's threshold
    (``quant_fp32_min_tokens``, None for formats without one) in ``'auto'``.
    """
    from kt_ops.formats import format_spec

    mode = kt_ops.get_quant_activations()
    if format_spec(weight_format).activation == "fp32" or mode == "fp32":
        return 1
    if mode == "q8":
        return None
    return kt_ops.quant_fp32_min_tokens(weight_format)


def per_projection_reference(
    x: Tensor,
    ids: Tensor,
    topk_weights: Tensor,
    dense: tuple[Tensor, Tensor, Tensor],
    fp32_min: tuple[Optional[int], Optional[int], Optional[int]],
    q8_brgemm_min: tuple[Optional[int], Optional[int], Optional[int]] = (None, None, None),
    fp8_brgemm: Optional[tuple[tuple[Any, ...], tuple[Optional[int], ...]]] = None,
    act: str = "silu",
    biases: tuple[Optional[Tensor], Optional[Tensor], Optional[Tensor]] = (None, None, None),
    w8a8_min: tuple[Optional[int], Optional[int], Optional[int]] = (None, None, None),
) -> QuantReference:
    """``reference_quant_moe_forward`` with the q8-or-fp32 choice made per projection.

    Projection ``p`` of an expert with ``m`` routed rows multiplies fp32
    activations when ``fp32_min[p]`` is not None and ``m >= fp32_min[p]``
    (unless ``q8_brgemm_min[p]`` is not None and ``m >= q8_brgemm_min[p]``: the
    u8s8 brgemm takes q8 activations), else the q8-rounded ones
    (``q8_activations``); a q8 down adds the tie slack. ``fp8_brgemm``:
    (the packed projections, :func:`fp8_brgemm_min_tokens_of` of each): an
    fp8 projection with at least that many rows is the fp8 brgemm's
    :func:`fp8_banded_product`. ``act``: the experts' GLU activation; ``biases``:
    the per-expert biases of gate, up, down (``[E, n]`` or None), added to the products.
    ``w8a8_min`` (:func:`w8a8_min_tokens_of` of each): a projection with at least that
    many rows multiplies per-token int8 activations (:func:`token_q8_activations`).
    """
    glu = torch_glu(act)
    projections, fp8_min = fp8_brgemm if fp8_brgemm is not None else ((), (None, None, None))

    def product(v: Tensor, p: int, dense_w: Tensor, e: int, m: int) -> Tensor:
        if fp8_min[p] is not None and m >= fp8_min[p]:
            y = fp8_banded_product(v, projections[p], e)
        else:
            y = v @ dense_w.float().T
        return y if biases[p] is None else y + biases[p][e]

    gate, up, down = dense
    with single_threaded_torch():
        xf = x.float()
        ids = ids.long()
        w = topk_weights.float()
        out = torch.zeros(xf.shape, dtype=torch.float32)
        slack = torch.zeros(xf.shape, dtype=torch.float32)

        for e in torch.unique(ids[ids >= 0]).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            m = len(tok)

            def q8(p: int, m: int = m) -> bool:
                if q8_brgemm_min[p] is not None and m >= q8_brgemm_min[p]:
                    return True
                return fp32_min[p] is None or m < fp32_min[p]

            def per_token(p: int, m: int = m) -> bool:
                return w8a8_min[p] is not None and m >= w8a8_min[p]

            def rounded(v: Tensor, p: int) -> Tensor:
                if per_token(p):
                    return token_q8_activations(v)
                return q8_activations(v) if q8(p) else v

            xe = xf[tok]
            g = product(rounded(xe, 0), 0, gate[e], e, m)
            h = glu(g, product(rounded(xe, 1), 1, up[e], e, m))
            wd = down[e].float()
            we = w[tok, slot].unsqueeze(1)
            if per_token(2) or q8(2):
                steps = token_q8_tie_steps(h) if per_token(2) else q8_tie_steps(h)
                slack.index_add_(0, tok, (steps @ wd.abs().T) * we.abs())
                h = rounded(h, 2)
            out.index_add_(0, tok, product(h, 2, wd, e, m) * we)
    return QuantReference(out, slack)


def reference_for(
    experts: kt_ops.ExpertWeights,
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    act: str = "silu",
) -> QuantReference:
    """The reference of ``kt_ops.moe_forward(hidden_states, ..., experts)`` (no LoRA).

    Any formats, mixed per projection. Follows the process-wide compute path
    (``kt_ops.get_quant_activations()``) per projection
    (:func:`fp32_min_tokens_of`): under ``'auto'`` each expert's path depends on
    its token count and each projection's format. fp8 projections on the fp8
    brgemm (:func:`fp8_brgemm_min_tokens_of`) follow :func:`fp8_banded_product`.
    ``act``: the experts' GLU activation (the op's ``activation=``).
    """
    mins = tuple(fp32_min_tokens_of(p.weight_format) for p in experts.projections)
    dense = dense_weights(experts)
    brg = tuple(q8_brgemm_min_tokens_of(p.weight_format) for p in experts.projections)
    fp8 = tuple(
        fp8_brgemm_min_tokens_of(p.weight_format, hidden_states.dtype) for p in experts.projections
    )
    w8a8 = tuple(token_int8_min_tokens_of(p) for p in experts.projections)
    if experts.has_bias or any(b is not None for b in fp8 + w8a8):
        return per_projection_reference(
            hidden_states,
            topk_ids,
            topk_weights,
            dense,
            mins,
            brg,
            (experts.projections, fp8),
            act=act,
            biases=tuple(p.bias for p in experts.projections),
            w8a8_min=w8a8,
        )
    if any(b is not None for b in brg) and any(m not in (None, 1) for m in mins):
        return per_projection_reference(
            hidden_states, topk_ids, topk_weights, dense, mins, brg, act=act
        )
    if all(m is None for m in mins):
        return reference_quant_moe_forward(
            hidden_states, topk_ids, topk_weights, *dense, activation="q8", act=act
        )
    if all(m == 1 for m in mins):
        return reference_quant_moe_forward(
            hidden_states, topk_ids, topk_weights, *dense, activation="fp32", act=act
        )
    if len(set(mins)) == 1:
        return reference_quant_moe_forward(
            hidden_states,
            topk_ids,
            topk_weights,
            *dense,
            activation="q8",
            fp32_min_tokens=mins[0],
            act=act,
        )
    return per_projection_reference(hidden_states, topk_ids, topk_weights, dense, mins, act=act)


def quant_mismatch_report(
    out: Tensor,
    ref: QuantReference,
    tol: Tolerance = TOL_QUANT,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> Optional[str]:
    """``None`` when ``out`` matches ``ref`` (see the comment above ``TOL_QUANT``); else why not."""
    out_dtype = out.dtype if out_dtype is None else out_dtype
    r = ref.out
    if tuple(out.shape) != tuple(r.shape):
        return f"shape {tuple(out.shape)} != reference shape {tuple(r.shape)}"
    if out.numel() == 0:
        return None
    o = out.float()
    if not torch.isfinite(o).all():
        bad = (~torch.isfinite(o)).nonzero()
        return f"{bad.shape[0]} non-finite output element(s), first at {bad[0].tolist()}"
    if not torch.isfinite(r).all():
        return "the reference itself is not finite: the test inputs are too large"
    rtol = OUTPUT_ROUNDING[out_dtype]
    scale = r.abs().max().item()
    err = (o - r).abs()
    allowed = (
        tol.compute * scale * (1.0 + rtol)
        + ref.slack * (1.0 + rtol)
        + rtol * r.abs()
        + OUTPUT_SUBNORMAL[out_dtype]
    )
    bad = err > allowed
    if bad.any():
        n_bad = int(bad.sum())
        flat = int((err - allowed).flatten().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), o.shape))
        return (
            f"{n_bad} of {o.numel()} elements out of tolerance (compute={tol.compute:g}, "
            f"rtol={rtol:g}, max|ref|={scale:.4g}); worst at {list(idx)}: "
            f"out={o[idx].item():.6g} ref={r[idx].item():.6g} |diff|={err[idx].item():.3g} "
            f"> allowed {allowed[idx].item():.3g} (of which q8 tie slack "
            f"{ref.slack[idx].item():.3g})"
        )
    return None


#: GGUF block types: name -> (weights per block, bytes per block), as ggml-common.h.
GGUF_BLOCKS = {
    "mxfp4": (32, 17),
    "nvfp4": (64, 36),
    "q8_0": (32, 34),
    "q4_0": (32, 18),
    "q4_1": (32, 20),
    "q5_0": (32, 22),
    "q5_1": (32, 24),
    "q2_k": (256, 84),
    "q3_k": (256, 110),
    "q4_k": (256, 144),
    "q5_k": (256, 176),
    "q6_k": (256, 210),
    "iq4_nl": (32, 18),
    "iq4_xs": (256, 136),
    "iq1_s": (256, 50),
    "iq1_m": (256, 56),
    "iq2_xxs": (256, 66),
    "iq2_xs": (256, 74),
    "iq2_s": (256, 82),
    "iq3_xxs": (256, 98),
    "iq3_s": (256, 110),
}


def set_iq1_m_d(blocks, d) -> None:
    """Writes fp16 ``d [...]`` (any float array) into IQ1_M blocks ``uint8 [..., 56]`` in
    place: d's bits 4i .. 4i+3 are the top nibble of scale word i (bytes 48 + 2i, 49 + 2i;
    ggml-common.h block_iq1_m), the 3-bit sub-scales below them kept."""
    import numpy as np

    bits = np.asarray(d, dtype=np.float16).view(np.uint16)
    for i in range(4):
        nib = ((bits >> (4 * i)) & 0xF).astype(np.uint8)
        blocks[..., 49 + 2 * i] = (blocks[..., 49 + 2 * i] & 0x0F) | (nib << 4)


def random_gguf_raw(qtype: str, num_experts: int, n: int, k: int, *, seed: int = 0) -> Tensor:
    """Random valid raw GGUF blocks of an ``[E, n, k]`` tensor: uint8 ``[E, n, row_bytes]``.

    Every code byte, six-bit scale/min and int8 sub-block scale is uniformly
    random (q8_0 codes include -128, q6_K scales -128..127); the fp16 super-block
    scales ``d``/``dmin`` are drawn so that the weights are O(1/sqrt(k)).
    """
    import numpy as np

    bs, ts = GGUF_BLOCKS[qtype]
    if k % bs:
        raise ValueError(f"random_gguf_raw: k={k} is not a multiple of {bs} for {qtype}")
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(num_experts, n, k // bs, ts), dtype=np.uint8)

    def set_f16(off: int, lo: float, hi: float) -> None:
        v = rng.uniform(lo, hi, size=raw.shape[:-1]).astype(np.float16)
        raw[..., off : off + 2] = v[..., None].view(np.uint8)

    s = 1.0 / math.sqrt(k)
    if qtype == "mxfp4":  # W = e2m1(q) * 2^(e - 127), |e2m1| <= 6: e around 2^(e-127) ~ s/4
        e0 = 127 + round(math.log2(s / 4))
        raw[..., 0] = rng.integers(e0 - 2, e0 + 2, size=raw.shape[:-1], dtype=np.uint8)
    elif qtype == "nvfp4":  # W = e2m1(q) * ue4m3(d), |e2m1| <= 6: ue4m3 bytes around s/4
        e0 = 7 + round(math.log2(s / 4))  # the UE4M3 exponent field of s/4 (bias 7)
        d = rng.integers(8 * (e0 - 1), 8 * (e0 + 1), size=(*raw.shape[:-1], 4))
        raw[..., 0:4] = np.clip(d, 0, 0x7E).astype(np.uint8)
    elif qtype == "q8_0":  # W = d * q, |q| <= 128
        set_f16(0, 0.5 * s / 64, 2 * s / 64)
    elif qtype == "q4_0":  # W = d * (q - 8)
        set_f16(0, 0.5 * s / 4, 2 * s / 4)
    elif qtype == "q5_0":  # W = d * (q - 16)
        set_f16(0, 0.5 * s / 8, 2 * s / 8)
    elif qtype in ("q4_1", "q5_1"):  # W = d * q + m, q < 16 | 32; m of either sign
        nmax = 15 if qtype == "q4_1" else 31
        set_f16(0, 0.5 * s / nmax, 2 * s / nmax)
        set_f16(2, -2 * s, 0.5 * s)
    elif qtype in ("q4_k", "q5_k"):  # W = d*sc*q - dmin*m, sc, m < 64
        nmax = 15 if qtype == "q4_k" else 31
        set_f16(0, 0.5 * s / (32 * nmax), 2 * s / (32 * nmax))
        set_f16(2, 0.5 * s / 64, 2 * s / 64)
    elif qtype == "q2_k":  # W = d*sc*q - dmin*m, sc, m < 16, q < 4
        set_f16(80, 0.5 * s / (16 * 3), 2 * s / (16 * 3))
        set_f16(82, 0.5 * s / 16, 2 * s / 16)
    elif qtype == "q3_k":  # W = d*(sc - 32)*(q - 4), |sc - 32| <= 32, |q - 4| <= 4
        set_f16(108, 0.5 * s / (32 * 4), 2 * s / (32 * 4))
    elif qtype == "iq4_nl":  # W = d * v, |v| <= 127
        set_f16(0, 0.5 * s / 64, 2 * s / 64)
    elif qtype == "iq4_xs":  # W = d*(ls - 32) * v, |ls - 32| <= 32, |v| <= 127
        set_f16(0, 0.5 * s / (16 * 64), 2 * s / (16 * 64))
    elif qtype in ("iq1_s", "iq2_xxs", "iq2_xs", "iq2_s", "iq3_xxs", "iq3_s"):
        # W = d * (2 ls + 1) * c; the largest |(2 ls + 1) * c|: 15 * 1.125, 31 / 8 * 43,
        # 31 / 4 * 62, 31 * 15
        top = {"iq1_s": 17, "iq2_xxs": 167, "iq2_xs": 167, "iq2_s": 167, "iq3_xxs": 480,
               "iq3_s": 465}[qtype]  # fmt: skip
        set_f16(0, 0.5 * s / top, 2 * s / top)
    elif qtype == "iq1_m":  # IQ1_S' values, d spread over the scale words
        top = 17
        set_iq1_m_d(raw, rng.uniform(0.5 * s / top, 2 * s / top, size=raw.shape[:-1]))
    else:  # q6_k: W = d*sc*(q - 32), |sc| <= 128
        set_f16(208, 0.5 * s / (64 * 32), 2 * s / (64 * 32))
    return torch.from_numpy(raw.reshape(num_experts, n, k // bs * ts))


def map_packed(experts: kt_ops.ExpertWeights, fn, parts=("weight", "scales", "zeros")):
    """``experts`` with ``fn`` applied to each present packed tensor named in ``parts``."""

    def one(p: Any) -> Any:
        new = {k: fn(getattr(p, k)) for k in parts if getattr(p, k) is not None}
        return dataclasses.replace(p, **new)

    return kt_ops.ExpertWeights(*(one(p) for p in experts.projections))


def replace_weights(
    experts: kt_ops.ExpertWeights, gate: Tensor, up: Tensor, down: Tensor
) -> kt_ops.ExpertWeights:
    """``experts`` with the packed ``weight`` tensors replaced (scales, zeros, sizes kept)."""
    return kt_ops.ExpertWeights(
        *(dataclasses.replace(p, weight=t) for p, t in zip(experts.projections, (gate, up, down)))
    )


def packed_weights(experts: kt_ops.ExpertWeights) -> tuple[Tensor, Tensor, Tensor]:
    """The packed ``weight`` tensors of gate, up, down."""
    return experts.gate.weight, experts.up.weight, experts.down.weight


def lora_weights_from(factors: dict[str, Tensor], scaling: float = 1.0) -> kt_ops.LoRAWeights:
    """A ``LoRAWeights`` of factors named ``{gate,up,down}_lora_{a,b}`` (missing: no LoRA).

    A projection with only one of its factors keeps it (and None for the other),
    so that the op can name the lone factor.
    """
    pairs = {}
    for p in ("gate", "up", "down"):
        a, b = factors.get(f"{p}_lora_a"), factors.get(f"{p}_lora_b")
        pairs[p] = None if a is None and b is None else (a, b)
    return kt_ops.LoRAWeights(**pairs, scaling=scaling)


#: The entries of the ops' ``weights`` list and ``lora`` list, by name (op order).
WEIGHT_NAMES = tuple(
    f"{p}_{part}" for p in ("gate", "up", "down") for part in ("weight", "scales", "zeros")
)
LORA_NAMES = tuple(f"{p}_lora_{f}" for p in ("gate", "up", "down") for f in ("a", "b"))


def raw_op_kwargs(named: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``torch.ops.kt.moe_forward`` from per-tensor names.

    ``named`` holds the op's arguments, except that the entries of ``weights``
    may be given one by one as ``gate_weight`` ... ``down_zeros`` and those of
    ``lora`` as ``gate_lora_a`` ... ``down_lora_b`` (None or missing: absent,
    a ``[0]``-shaped placeholder; all absent: ``lora=[]``).
    """
    args = {k: v for k, v in named.items() if k not in WEIGHT_NAMES and k not in LORA_NAMES}
    if any(n in named for n in WEIGHT_NAMES):
        args["weights"] = [named.get(n) for n in WEIGHT_NAMES]
    factors = [named.get(n) for n in LORA_NAMES]
    if any(t is not None for t in factors):
        like = args["hidden_states"]
        args["lora"] = [t if t is not None else like.new_empty((0,)) for t in factors]
    args.setdefault("lora", [])
    return args
