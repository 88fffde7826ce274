"""Pure-PyTorch reference of ``kt::moe_forward``, its tolerances, and input generators.

The reference is deliberately plain: it dequantizes the packed weights with the
format's reference dequantizer (``kt_ops.unpack_weights``), then loops over the
experts that received tokens and runs the SwiGLU MLP of each one as dense fp32
matmuls over all of its (token, slot) rows at once::

    out[t] = sum_k w[t, k] * W_down[e] @ (silu(W_gate[e] @ x[t]) * (W_up[e] @ x[t])),
    e = ids[t, k], slots with e == -1 skipped

It shares no code with the C++ op beyond ``unpack_weights`` (itself a few lines
of ``permute``/``reshape``, tested against the dense weights in
test_moe_forward.py).

Tolerances live here, one per weight format (ggml's ``kTol<fmt>`` style), so
every test file (op, nn, hf) compares with the same numbers:

* ``Tolerance.compute``: the fp32 accumulation error of the op relative to the
  largest reference magnitude. Both sides use the same bf16 weights and the
  same fp32 activations, so they differ only by fp32 summation order (blocked
  FMA chains vs. BLAS) and the vector ``exp`` in SiLU: a few ulp times
  sqrt(reduction length), i.e. ~1e-6 for H = 2048. 1e-4 leaves a wide margin
  yet catches a single wrong weight, token or routing weight.
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


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Allowed difference between ``kt::moe_forward`` and ``reference_moe_forward``."""

    #: max |op_fp32 - ref_fp32| / max|ref_fp32| before the output is rounded.
    compute: float


#: weight_format 'bf16': exact bf16 weights, fp32 accumulation (see module doc).
TOL_BF16 = Tolerance(compute=1e-4)

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
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    intermediate_size: int,
    weight_format: str = "bf16",
    *,
    out_dtype: Optional[torch.dtype] = torch.float32,
    lora: Optional[dict[str, Tensor]] = None,
    lora_scaling: float = 1.0,
) -> Tensor:
    """Dense fp32 reference of ``kt_ops.moe_forward`` on packed weights.

    Returns the fp32 result (``out_dtype=torch.float32``, the default, which is
    what the tolerances are defined against) or that result rounded once to
    ``out_dtype`` (``None``: the dtype of ``hidden_states``, as the op returns).
    Only the experts that receive tokens are dequantized, so a 128-expert layer
    never materializes as fp32 at once.

    ``lora`` maps any of ``gate_lora_a`` ... ``down_lora_b`` to its tensor; a
    projection ``p`` with both factors adds ``lora_scaling * (v @ A[e].T) @ B[e].T``
    (Hu et al. 2021, PEFT convention). Differentiable: autograd through this
    function gives the reference gradients for ``hidden_states``,
    ``topk_weights`` and the LoRA factors.
    """
    T, H = hidden_states.shape
    I = intermediate_size
    lora = lora or {}

    def project(v: Tensor, w: Tensor, proj: str, e: int) -> Tensor:
        y = v @ w.T
        a, b = lora.get(f"{proj}_lora_a"), lora.get(f"{proj}_lora_b")
        if a is not None and b is not None:
            y = y + lora_scaling * ((v @ a[e].float().T) @ b[e].float().T)
        return y

    with single_threaded_torch():
        x = hidden_states.float()
        ids = topk_ids.long()
        w = topk_weights.float()
        out = torch.zeros(T, H, dtype=torch.float32)
        for e in torch.unique(ids[ids >= 0]).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)
            wg = kt_ops.unpack_weights(gate_weight[e : e + 1], I, H, weight_format)[0]
            wu = kt_ops.unpack_weights(up_weight[e : e + 1], I, H, weight_format)[0]
            wd = kt_ops.unpack_weights(down_weight[e : e + 1], H, I, weight_format)[0]
            xe = x[tok]
            h = torch.nn.functional.silu(project(xe, wg, "gate", e)) * project(xe, wu, "up", e)
            y = project(h, wd, "down", e) * w[tok, slot].unsqueeze(1)
            out = out.index_add(0, tok, y)
    if out_dtype is None:
        out_dtype = hidden_states.dtype
    return out.to(out_dtype)


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


@dataclasses.dataclass
class ExpertWeights:
    """Packed expert weights of one MoE layer and their dense fp32 originals."""

    num_experts: int
    hidden_size: int
    intermediate_size: int
    gate: Tensor  # packed [E, I, H]
    up: Tensor  # packed [E, I, H]
    down: Tensor  # packed [E, H, I]
    weight_format: str = "bf16"

    def args(self) -> tuple[Tensor, Tensor, Tensor, int]:
        """``(gate_weight, up_weight, down_weight, intermediate_size)`` for the op."""
        return self.gate, self.up, self.down, self.intermediate_size


def make_expert_weights(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    seed: int = 0,
    weight_format: str = "bf16",
) -> ExpertWeights:
    """Random packed experts, scaled by 1/sqrt(fan-in) (like nn.Linear) so outputs are O(1).

    Gate weights are twice as large, so SiLU sees arguments of both signs up to
    about +-6 (its curved part, not just its linear tail).
    """
    g = torch.Generator().manual_seed(seed)
    E, H, I = num_experts, hidden_size, intermediate_size
    gate = torch.randn(E, I, H, generator=g) * (2.0 / math.sqrt(H))
    up = torch.randn(E, I, H, generator=g) / math.sqrt(H)
    down = torch.randn(E, H, I, generator=g) / math.sqrt(I)
    return ExpertWeights(
        E,
        H,
        I,
        kt_ops.pack_weights(gate, weight_format),
        kt_ops.pack_weights(up, weight_format),
        kt_ops.pack_weights(down, weight_format),
        weight_format,
    )


def make_large_expert_weights(
    num_experts: int, hidden_size: int, intermediate_size: int, *, seed: int = 0
) -> ExpertWeights:
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

    def one(n: int, k: int, std: float) -> Tensor:
        base = torch.randn(n_base, n // 16, k // 2, 16, 2, generator=g, dtype=torch.float32)
        base = (base * std).to(torch.bfloat16)
        full = torch.mul(base.unsqueeze(0), scales)  # [reps, n_base, ...] in one pass
        return full.reshape(reps * n_base, n // 16, k // 2, 16, 2)[:E].contiguous()

    return ExpertWeights(
        E,
        H,
        I,
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
        yield Sample(name, (x, ids, weights, *w.args()), {"weight_format": "bf16"})
