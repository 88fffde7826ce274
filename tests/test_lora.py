"""LoRA through the routed experts: forward with LoRA terms, kt.moe_backward, autograd.

Every gradient is compared with PyTorch autograd through the dense fp32
reference of reference.py (same LoRA maths: Hu et al. 2021, PEFT convention),
within the bf16 tolerance of the forward (``TOL_BF16``, relative to the
largest reference magnitude, plus the rounding of the result's dtype).
"""

# T, H, I, E, K, r: tokens, hidden, intermediate, experts, top-k, LoRA rank.
# ruff: noqa: E741

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional

import pytest
import torch
from reference import (
    LORA_NAMES,
    TOL_BF16,
    WEIGHT_NAMES,
    Tolerance,
    assert_matches_reference,
    bf16_projection,
    lora_weights_from,
    make_expert_weights,
    make_hidden,
    make_routing,
    mismatch_report,
    raw_op_kwargs,
    reference_moe_forward,
)
from torch.utils._pytree import tree_map

import kt_ops
from kt_ops.layer import layer_args

PROJECTIONS = ("gate", "up", "down")


def make_lora(
    E: int,
    H: int,
    I: int,
    *,
    ranks: dict[str, int],
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    scale: float = 0.3,
) -> dict[str, torch.Tensor]:
    """LoRA factors for the projections in ``ranks`` (name -> rank), all nonzero.

    PEFT initialises B to zero; here both factors are random so that every
    gradient is nonzero and a wrong term shows.
    """
    g = torch.Generator().manual_seed(seed + 77)
    dims = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    out = {}
    for proj, r in ranks.items():
        n, k = dims[proj]
        out[f"{proj}_lora_a"] = (torch.randn(E, r, k, generator=g) * scale / k**0.5).to(dtype)
        out[f"{proj}_lora_b"] = (torch.randn(E, n, r, generator=g) * scale / r**0.5).to(dtype)
    return out


@dataclasses.dataclass
class Case:
    name: str
    T: int
    H: int
    I: int
    E: int
    K: int
    ranks: dict[str, int]
    act: torch.dtype = torch.float32
    lora_dtype: torch.dtype = torch.float32
    skip_fraction: float = 0.0
    skip_rows: tuple[int, ...] = ()
    scaling: float = 2.0


ALL3 = {"gate": 4, "up": 3, "down": 5}
CASES = [
    Case("T0", 0, 32, 48, 4, 2, ALL3),
    Case("T1_decode", 1, 32, 48, 8, 2, ALL3),
    Case("T2", 2, 33, 70, 6, 3, ALL3, act=torch.bfloat16),
    Case("T7_odd", 7, 33, 70, 6, 3, ALL3, skip_fraction=0.3, skip_rows=(2,)),
    Case("T64", 64, 48, 40, 8, 2, ALL3),
    Case("T64_bf16", 64, 33, 70, 8, 4, ALL3, act=torch.bfloat16, lora_dtype=torch.bfloat16),
    Case("gate_only", 7, 33, 70, 5, 2, {"gate": 4}),
    Case("up_down", 9, 32, 48, 5, 2, {"up": 2, "down": 6}, act=torch.bfloat16),
    Case("down_only_fp16lora", 9, 33, 17, 5, 2, {"down": 1}, lora_dtype=torch.float16),
    Case("no_tokens_for_most", 2, 32, 16, 16, 2, ALL3),
    Case("all_skipped", 3, 32, 16, 4, 2, ALL3, skip_rows=(0, 1, 2)),
    Case("no_lora", 7, 33, 70, 6, 3, {}),
    # Ranks past the AVX-512 LoRA kernels' register chunks (8 for x A^T and d^T x, 16 for
    # t W; 12: t W with one row per tile), and not multiples of them; 40 tokens: experts
    # with several rows.
    Case("high_rank", 40, 33, 70, 4, 2, {"gate": 19, "up": 12, "down": 33}),
]


@dataclasses.dataclass
class Problem:
    case: Case
    weights: kt_ops.ExpertWeights  # bf16 here, quantized in test_lora_quant.py
    x: torch.Tensor
    ids: torch.Tensor
    topk_weights: torch.Tensor
    lora: dict[str, torch.Tensor]
    grad_output: torch.Tensor

    def op_args(self) -> tuple:
        """``(hidden_states, topk_ids, topk_weights, experts)`` of the Python API."""
        return (self.x, self.ids, self.topk_weights, self.weights)

    def lora_weights(self, factors: Optional[dict] = None) -> kt_ops.LoRAWeights:
        """``self.lora`` (or ``factors``) as a ``LoRAWeights`` with the case's scaling."""
        return lora_weights_from(self.lora if factors is None else factors, self.case.scaling)

    def op_kwargs(self) -> dict:
        """``lora=`` of the Python API."""
        return {"lora": self.lora_weights()}

    def raw_args(self) -> tuple:
        """The positional arguments of ``torch.ops.kt.moe_forward`` (LoRA included)."""
        return (self.x, self.ids, self.topk_weights) + layer_args(
            self.weights, self.lora_weights(), "silu", self.x
        )


def make_problem(case: Case, seed: int = 0, weights: Optional[Any] = None) -> Problem:
    """Random inputs of ``case``; ``weights`` (e.g. quantized experts) replaces the bf16 ones."""
    w = weights if weights is not None else make_expert_weights(case.E, case.H, case.I, seed=seed)
    ids, tw = make_routing(
        case.T,
        case.E,
        case.K,
        seed=seed,
        skip_fraction=case.skip_fraction,
        skip_rows=case.skip_rows,
    )
    x = make_hidden(case.T, case.H, case.act, seed=seed)
    lora = make_lora(case.E, case.H, case.I, ranks=case.ranks, dtype=case.lora_dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 5)
    grad_output = torch.randn(case.T, case.H, generator=g).to(case.act)
    return Problem(case, w, x, ids, tw, lora, grad_output)


def reference_grads(p: Problem) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """fp32 reference output and gradients (autograd through reference_moe_forward)."""
    x = p.x.detach().float().requires_grad_(True)
    tw = p.topk_weights.detach().float().requires_grad_(True)
    lora = {k: v.detach().float().requires_grad_(True) for k, v in p.lora.items()}
    out = reference_moe_forward(x, p.ids, tw, p.weights, p.lora_weights(lora))
    if out.requires_grad:  # not when no slot reaches an expert (T = 0, all ids -1)
        out.backward(p.grad_output.float())
    leaves = {"hidden_states": x, "topk_weights": tw, **lora}
    grads = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in leaves.items()}
    return out.detach(), grads


def op_grads(p: Problem, checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """kt_ops output and gradients through autograd (loss.backward())."""
    x = p.x.detach().clone().requires_grad_(True)
    tw = p.topk_weights.detach().clone().requires_grad_(True)
    lora = {k: v.detach().clone().requires_grad_(True) for k, v in p.lora.items()}
    out = kt_ops.moe_forward(
        x, p.ids, tw, p.weights, p.lora_weights(lora), activation_checkpointing=checkpointing
    )
    out.backward(p.grad_output)
    grads = {"hidden_states": x.grad, "topk_weights": tw.grad}
    grads.update({k: v.grad for k, v in lora.items()})
    return out.detach(), grads


def assert_grads_match(got: dict, want: dict, tolerances: Optional[dict] = None) -> None:
    """Each gradient against the reference's (``tolerances``: per name, else TOL_BF16)."""
    assert got.keys() == want.keys()
    for name, ref in want.items():
        g = got[name]
        assert g is not None, f"no gradient for {name}"
        assert g.shape == ref.shape, f"{name}: shape {tuple(g.shape)} != {tuple(ref.shape)}"
        report = _report(g, ref, (tolerances or {}).get(name, TOL_BF16))
        assert report is None, f"{name}: {report}"


def _report(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance = TOL_BF16) -> Optional[str]:
    if got.numel() == 0:
        return None
    if ref.abs().max() == 0:  # e.g. every slot skipped: must be exactly zero
        return None if torch.count_nonzero(got) == 0 else "nonzero gradient where it must be 0"
    return mismatch_report(got, ref, tol)


# --------------------------------------------------------------------------
# Forward and gradients against the reference
# --------------------------------------------------------------------------


#: bf16 hidden states on a bf16 base: the LoRA forward runs the inference driver, whose
#: tile kernel (at enough tokens per expert) reads the GLU outputs rounded to bf16 before
#: the down projection, as inference does: about one bf16 rounding (2^-9) of the down
#: input, ~1e-3 of max|out| against the fp32 reference. The saved pre-activations (so
#: the LoRA gradients) stay exact: test_lora_gradients_at_fp32_accuracy_on_a_bf16_base.
TOL_BF16_ON_KERNELS = Tolerance(compute=3e-3)


def forward_tolerance(p: Problem) -> Tolerance:
    return TOL_BF16_ON_KERNELS if p.x.dtype == torch.bfloat16 else TOL_BF16


def grad_tolerances(p: Problem) -> dict:
    """bf16 hidden states on a bf16 base: the backward's dg Wg + du Wu runs on oneDNN's
    bf16 brgemm with dg, du rounded to bf16 (x's gradient is bf16 anyway): about one
    bf16 rounding of those, as in the forward; go Wd stays exact (bf16 products), so the
    LoRA factors' gradients keep TOL_BF16."""
    return {"hidden_states": TOL_BF16_ON_KERNELS} if p.x.dtype == torch.bfloat16 else {}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_forward_matches_reference(case: Case, isa: str):
    p = make_problem(case)
    out = kt_ops.moe_forward(*p.op_args(), **p.op_kwargs())
    assert out.dtype == p.x.dtype and out.shape == p.x.shape
    ref = reference_moe_forward(*p.op_args(), p.lora_weights(), out_dtype=torch.float32)
    assert_matches_reference(out, ref, forward_tolerance(p))


@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gradients_match_reference(case: Case, checkpointing: bool, isa: str):
    p = make_problem(case)
    out, grads = op_grads(p, checkpointing)
    ref_out, ref_grads = reference_grads(p)
    assert_matches_reference(out, ref_out, forward_tolerance(p))
    for name, t in grads.items():
        want_dtype = {"hidden_states": p.x.dtype, "topk_weights": p.topk_weights.dtype}.get(
            name, case.lora_dtype
        )
        assert t.dtype == want_dtype, f"{name}: dtype {t.dtype}, expected {want_dtype}"
    assert_grads_match(grads, ref_grads, grad_tolerances(p))


def test_experts_without_tokens_get_zero_lora_gradients():
    case = Case("sparse", 3, 32, 16, 12, 1, ALL3)
    p = make_problem(case)
    _, grads = op_grads(p, checkpointing=False)
    used = set(p.ids[p.ids >= 0].tolist())
    for name in LORA_NAMES:
        for e in range(case.E):
            nonzero = bool(grads[name][e].abs().sum() > 0)
            assert nonzero == (e in used), f"{name}[{e}]: used={e in used}, nonzero={nonzero}"


def test_skipped_slots_get_zero_routing_gradient():
    case = Case("skips", 9, 32, 16, 6, 3, ALL3, skip_fraction=0.4, skip_rows=(4,))
    p = make_problem(case)
    _, grads = op_grads(p, checkpointing=True)
    skipped = p.ids < 0
    assert skipped.any()
    assert torch.all(grads["topk_weights"][skipped] == 0)
    assert torch.all(grads["topk_weights"][~skipped] != 0)
    assert torch.all(grads["hidden_states"][4] == 0)  # a token whose every slot is skipped


def test_lora_b_zero_matches_base_forward():
    # PEFT initialises B to zero: the LoRA model starts as the base model.
    case = Case("peft_init", 7, 33, 70, 6, 3, ALL3)
    p = make_problem(case)
    lora = {k: (torch.zeros_like(v) if k.endswith("_b") else v) for k, v in p.lora.items()}
    base = kt_ops.moe_forward(*p.op_args())
    with_lora = kt_ops.moe_forward(*p.op_args(), lora_weights_from(lora, 2.0))
    assert_matches_reference(with_lora, reference_moe_forward(*p.op_args()))
    torch.testing.assert_close(with_lora, base, rtol=1e-5, atol=1e-5)


def test_save_and_recompute_give_identical_gradients():
    p = make_problem(CASES[3])
    _, saved = op_grads(p, checkpointing=False)
    _, recomputed = op_grads(p, checkpointing=True)
    for name in saved:
        assert torch.equal(saved[name], recomputed[name]), name


def test_backward_makes_no_zero_gradients_for_the_saved_pre_activations():
    # moe_forward_train's pre-activations never get a gradient. Autograd's default hands
    # the node a zero tensor for each such output: two [T*K, I] fp32 zero fills per step
    # (100 MB of fresh pages at T = 2048 on a Qwen3-30B-A3B layer). The node turns that
    # off (set_materialize_grads(false)).
    p = make_problem(CASES[4])
    x = p.x.clone().requires_grad_(True)
    out = kt_ops.moe_forward(x, *p.op_args()[1:], **p.op_kwargs())
    assert out.grad_fn.name().endswith("MoeForwardTrainBackward>")
    with torch.profiler.profile(record_shapes=True) as prof:
        out.backward(p.grad_output)
    pre_shape = [p.case.T * p.case.K, p.case.I]
    fills = [e.name for e in prof.events() if pre_shape in e.input_shapes]
    assert not any("zero" in name or "fill" in name for name in fills), fills
    assert x.grad is not None and torch.isfinite(x.grad).all()


class _DropsGradient(torch.autograd.Function):
    """Identity forward whose backward returns no gradient (None)."""

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
def test_no_gradient_for_the_output_gives_none_for_the_inputs(checkpointing: bool):
    # A downstream node that returns None hands the MoE node an undefined gradient (no
    # zeros are materialized for it): its inputs then get no gradient, as autograd's
    # zero, and x keeps the gradient of its other use.
    p = make_problem(CASES[4])
    x = p.x.clone().requires_grad_(True)
    lora = {k: v.clone().requires_grad_(True) for k, v in p.lora.items()}
    out = kt_ops.moe_forward(
        x, *p.op_args()[1:], p.lora_weights(lora), activation_checkpointing=checkpointing
    )
    (_DropsGradient.apply(out).sum() + x.float().sum()).backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    assert all(v.grad is None for v in lora.values())


def test_global_checkpointing_switch_selects_the_op():
    p = make_problem(CASES[3])
    x = p.x.clone().requires_grad_(True)
    assert kt_ops.lora_activation_checkpointing() is False
    out = kt_ops.moe_forward(x, *p.op_args()[1:], **p.op_kwargs())
    assert out.grad_fn.name().endswith("MoeForwardTrainBackward>")
    kt_ops.set_lora_activation_checkpointing(True)
    try:
        out = kt_ops.moe_forward(x, *p.op_args()[1:], **p.op_kwargs())
        assert out.grad_fn.name().endswith("MoeForwardBackward>")
    finally:
        kt_ops.set_lora_activation_checkpointing(False)
    # Without LoRA the default recomputes (the fast kernel runs forward) unless asked to save.
    base = (x, *p.op_args()[1:])
    assert kt_ops.moe_forward(*base).grad_fn.name().endswith("MoeForwardBackward>")
    out = kt_ops.moe_forward(*base, activation_checkpointing=False)
    assert out.grad_fn.name().endswith("MoeForwardTrainBackward>")
    # No autograd: always the plain op, whatever the setting.
    with torch.no_grad():
        assert kt_ops.moe_forward(x, *p.op_args()[1:], **p.op_kwargs()).grad_fn is None


def test_gradient_for_lora_only():
    # hidden_states and topk_weights need no gradient: only the LoRA factors get one.
    p = make_problem(CASES[4])
    lora = {k: v.clone().requires_grad_(True) for k, v in p.lora.items()}
    out = kt_ops.moe_forward(*p.op_args(), p.lora_weights(lora))
    out.backward(p.grad_output)
    _, ref = reference_grads(p)
    assert_grads_match({k: v.grad for k, v in lora.items()}, {k: ref[k] for k in lora})


def test_moe_backward_direct_call_and_outputs():
    p = make_problem(CASES[6])  # gate only
    gx, gw, glora = kt_ops.ops.moe_backward(p.grad_output, *p.op_args(), **p.op_kwargs())
    assert gx.shape == p.x.shape and gw.shape == p.topk_weights.shape
    assert isinstance(glora, kt_ops.LoRAWeights) and glora.scaling == p.case.scaling
    ga, gb = glora.gate
    assert ga.shape == p.lora["gate_lora_a"].shape and gb.shape == p.lora["gate_lora_b"].shape
    assert glora.up is None and glora.down is None
    # The raw op: 6 LoRA gradients, [0]-shaped where the factor is absent.
    raw = torch.ops.kt.moe_backward(p.grad_output, *p.raw_args())
    assert len(raw) == 3 and len(raw[2]) == 6
    assert torch.equal(raw[0], gx) and torch.equal(raw[1], gw)
    assert torch.equal(raw[2][0], ga) and torch.equal(raw[2][1], gb)
    for absent in raw[2][2:]:
        assert absent.shape == (0,) and absent.dtype == p.x.dtype
    # Without LoRA: no LoRA gradients at all.
    assert torch.ops.kt.moe_backward(p.grad_output, *p.raw_args()[:7], [])[2] == []
    no_gx = kt_ops.ops.moe_backward(
        p.grad_output, *p.op_args(), **p.op_kwargs(), compute_grad_hidden_states=False
    )
    assert no_gx[0].shape == (0,)
    assert torch.equal(no_gx[1], gw)
    assert all(torch.equal(a, b) for a, b in zip(no_gx[2].gate, glora.gate))
    # With the saved pre-activations of moe_forward_train: the same gradients.
    out, gate_pre, up_pre = kt_ops.ops.moe_forward_train(*p.op_args(), **p.op_kwargs())
    assert gate_pre.shape == (p.case.T * p.case.K, p.case.I) and gate_pre.dtype == torch.float32
    assert torch.equal(out, kt_ops.moe_forward(*p.op_args(), **p.op_kwargs()))
    with_pre = kt_ops.ops.moe_backward(
        p.grad_output, *p.op_args(), **p.op_kwargs(), gate_pre=gate_pre, up_pre=up_pre
    )
    assert torch.equal(with_pre[0], gx) and torch.equal(with_pre[1], gw)
    assert all(torch.equal(a, b) for a, b in zip(with_pre[2].gate, glora.gate))


def test_forward_train_pre_activations():
    case = Case("pre", 5, 32, 24, 4, 2, ALL3, skip_rows=(1,))
    p = make_problem(case)
    _, gate_pre, up_pre = kt_ops.ops.moe_forward_train(*p.op_args(), **p.op_kwargs())
    for proj, pre in (("gate", gate_pre), ("up", up_pre)):
        w = kt_ops.unpack_weights(getattr(p.weights, proj).weight, case.I, case.H)
        a, b = p.lora[f"{proj}_lora_a"], p.lora[f"{proj}_lora_b"]
        for t in range(case.T):
            for k in range(case.K):
                e = int(p.ids[t, k])
                row = pre[t * case.K + k]
                if e < 0:
                    assert torch.all(row == 0)
                    continue
                want = w[e] @ p.x[t] + case.scaling * (b[e] @ (a[e] @ p.x[t]))
                torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# Determinism: thread counts, repeated calls
# --------------------------------------------------------------------------


@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
def test_bit_identical_for_thread_counts(checkpointing: bool):
    p = make_problem(CASES[5])  # T=64, bf16
    results = []
    for threads in (1, 2, 1):
        kt_ops.set_num_threads(threads)
        results.append(op_grads(p, checkpointing))
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the BLAS is held to one thread per task either way
    try:
        results.append(op_grads(p, checkpointing))
    finally:
        torch.set_num_threads(torch_threads)
    out0, grads0 = results[0]
    for out, grads in results[1:]:
        assert torch.equal(out, out0)
        for name in grads0:
            assert torch.equal(grads[name], grads0[name]), name


def _gemm_nt_isas() -> list[str]:
    """The supported tiers with their own fp32 NT tiles (the rest run the BLAS)."""
    a, b, c = torch.ones(1, 1), torch.ones(1, 1), torch.zeros(1, 1)
    have = []
    for isa in kt_ops.supported_isas():
        try:
            kt_ops._C._testing.gemm_nt_f32(a, b, c, False, isa, 0, 1)
        except ValueError:
            continue
        have.append(isa)
    return have


def test_gemm_nt_tiles_match_fp64_and_any_row_split():
    """The backward's fp32 products with the base on a tier's own NT tiles (AVX2:
    kernels/avx2/gemm_nt_avx2.cpp; 3 x 4 register tiles, 8 lanes along the reduction):
    every edge of the tiling (m % 3, n % 4, k % 8), against fp64, and the same bits for
    any split of the rows (a thread's share), with and without accumulation."""
    isas = _gemm_nt_isas()
    if "avx2" in kt_ops.supported_isas():
        assert "avx2" in isas
    if not isas:
        pytest.skip("no tier here has its own fp32 NT tiles (the BLAS computes them)")
    g = torch.Generator().manual_seed(5)
    nt = kt_ops._C._testing.gemm_nt_f32
    for isa in isas:
        for m, n, k in [
            (1, 1, 1),
            (2, 3, 7),
            (3, 4, 8),
            (4, 5, 9),
            (5, 9, 33),
            (7, 6, 70),
            (8, 13, 256),
            (16, 7, 131),
        ]:
            a = torch.randn(m, k, generator=g)
            b = torch.randn(n, k, generator=g)
            c0 = torch.randn(m, n, generator=g)
            want = a.double() @ b.double().T
            bound = 4 * k * 2**-24 * (a.abs().double() @ b.abs().double().T) + 1e-30
            whole = torch.empty(m, n)
            nt(a, b, whole, False, isa, 0, m)
            assert ((whole.double() - want).abs() <= bound).all(), (isa, m, n, k)
            for cut in range(1, m):
                split = torch.empty(m, n)
                nt(a, b, split, False, isa, 0, cut)
                nt(a, b, split, False, isa, cut, m - cut)
                assert torch.equal(split, whole), (isa, m, n, k, cut)
            acc = c0.clone()
            nt(a, b, acc, True, isa, 0, m)
            assert torch.equal(acc, c0 + whole), (isa, m, n, k)
    with pytest.raises(ValueError, match="no such kernel"):
        nt(torch.ones(1, 1), torch.ones(1, 1), torch.zeros(1, 1), False, "ref", 0, 1)


def _fp32_bound(terms: int, mags: torch.Tensor) -> torch.Tensor:
    """A sum of `terms` fp32 products, each rounded once and summed in any order: within
    terms * 2^-24 of the sum of their magnitudes (plus one rounding of the result)."""
    return (terms + 2) * 2**-24 * mags + 1e-30


@pytest.mark.parametrize("m", [0, 1, 2, 3, 5])
def test_lora_products_match_fp64_on_every_isa(m: int, isa: str):
    """The rank-r products of the LoRA forward and backward (moe/lora_products.h) on the
    active path's kernels (kernels/avx2/lora_avx2.cpp, kernels/avx512/lora_avx512.cpp;
    at::mm on ref): x A^T, s sum_q t_q w_q (1 to 4 terms, accumulating or not) and
    s d^T x, against fp64 at every edge of their tiles (k % 8 and % 16, n % 8 and % 16,
    n past a 512-column block, ranks 1 to 33, odd row counts). On kt_ops' own kernels
    (every path but ref, whose at::mm promises neither) bf16 rows give the bits of their
    fp32 copies, and x A^T and s t w the same bits for any split of the rows."""
    own = isa != "ref"
    g = torch.Generator().manual_seed(11 + m)
    xat, tw, dtx = (
        kt_ops._C._testing.lora_xat,
        kt_ops._C._testing.lora_tw,
        kt_ops._C._testing.lora_dtx,
    )
    for k in (1, 7, 9, 16, 17, 33, 70):
        for r in (1, 3, 4, 5, 8, 9, 17, 33):
            x = torch.randn(m, k, generator=g).bfloat16().float()
            a = torch.randn(r, k, generator=g)
            y = xat(x, a)
            want = x.double() @ a.double().T
            bound = _fp32_bound(k, x.abs().double() @ a.abs().double().T)
            assert ((y.double() - want).abs() <= bound).all(), (isa, m, k, r)
            if own:
                assert torch.equal(xat(x.bfloat16(), a), y), (isa, m, k, r)
                for cut in range(1, m):
                    assert torch.equal(torch.cat([xat(x[:cut], a), xat(x[cut:], a)]), y), cut
            d = torch.randn(m, r, generator=g)
            s = 0.75
            gt = dtx(d, x, s)
            want = s * d.double().T @ x.double()
            bound = _fp32_bound(m, abs(s) * d.abs().double().T @ x.abs().double())
            assert ((gt.double() - want).abs() <= bound).all(), (isa, m, k, r)
            if own:
                assert torch.equal(dtx(d, x.bfloat16(), s), gt), (isa, m, k, r)
    for n in (1, 7, 8, 15, 16, 17, 33, 600):
        for ranks in ((1,), (8,), (3, 17), (2, 5, 9, 33)):
            terms = [
                (torch.randn(m, r, generator=g), torch.randn(r, n, generator=g)) for r in ranks
            ]
            c0 = torch.randn(m, n, generator=g)
            s = 2.0
            for accumulate in (False, True):
                out = c0.clone()
                tw(terms, s, accumulate, out)
                want = (c0.double() if accumulate else torch.zeros(m, n, dtype=torch.double)) + sum(
                    s * t.double() @ w.double() for t, w in terms
                )
                mags = c0.abs().double() + sum(
                    s * t.abs().double() @ w.abs().double() for t, w in terms
                )
                bound = _fp32_bound(max(ranks) + len(ranks), mags)
                assert ((out.double() - want).abs() <= bound).all(), (isa, m, n, ranks, accumulate)
                if own and m > 1:
                    cut = m // 2
                    top, bottom = c0[:cut].clone(), c0[cut:].clone()
                    tw([(t[:cut], w) for t, w in terms], s, accumulate, top)
                    tw([(t[cut:], w) for t, w in terms], s, accumulate, bottom)
                    assert torch.equal(torch.cat([top, bottom]), out), (isa, m, n, ranks)
    with pytest.raises(ValueError, match="a must be"):
        xat(torch.ones(2, 3), torch.ones(4, 5))
    with pytest.raises(ValueError, match="contiguous 2-D fp32 CPU"):
        dtx(torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3), 1.0)


@pytest.mark.parametrize("case", [CASES[3], CASES[4], CASES[5]], ids=lambda c: c.name)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
def test_non_temporal_stores_give_the_same_bits(case: Case, checkpointing: bool):
    # Past 16 MiB the forward writes its per-slot outputs and the saved pre-activations
    # with non-temporal stores (moe/moe_forward.h); these layers are far smaller, so the
    # threshold is lowered to run that path: H = 48 gives 16-byte aligned rows (streamed),
    # H = 33 rows at every alignment (the others copied as before).
    p = make_problem(case)
    want_out, want = op_grads(p, checkpointing)
    before = kt_ops._C._testing.set_stream_bytes(0)
    try:
        got_out, got = op_grads(p, checkpointing)
    finally:
        kt_ops._C._testing.set_stream_bytes(before)
    assert torch.equal(got_out, want_out)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _grads_with_factors(p: Problem, factors: dict, checkpointing: bool):
    """Output and gradients of x, the routing weights and each distinct factor tensor."""
    x = p.x.detach().clone().requires_grad_(True)
    tw = p.topk_weights.detach().clone().requires_grad_(True)
    out = kt_ops.moe_forward(
        x, p.ids, tw, p.weights, p.lora_weights(factors), activation_checkpointing=checkpointing
    )
    out.backward(p.grad_output)
    return out.detach(), x.grad, tw.grad, {k: v.grad for k, v in factors.items()}


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
def test_shared_gate_up_a_gives_the_bits_of_two_copies(act: torch.dtype, checkpointing: bool):
    # One A tensor passed as gate's and up's (PEFT's LoRA of a fused gate_up_proj) has
    # x A^T computed once for both projections: the results must be bit for bit those of
    # two separate copies of it (the shared A's gradient is the sum of the two copies').
    case = dataclasses.replace(CASES[4], act=act, ranks={"gate": 4, "up": 4, "down": 5})
    p = make_problem(case)
    fresh = {k: v.detach().clone().requires_grad_(True) for k, v in p.lora.items()}
    shared = dict(fresh, up_lora_a=fresh["gate_lora_a"])
    out_s, dx_s, dw_s, g_s = _grads_with_factors(p, shared, checkpointing)
    copies = {k: v.detach().clone().requires_grad_(True) for k, v in shared.items()}
    out_c, dx_c, dw_c, g_c = _grads_with_factors(p, copies, checkpointing)
    assert torch.equal(out_s, out_c) and torch.equal(dx_s, dx_c) and torch.equal(dw_s, dw_c)
    assert torch.equal(g_s["gate_lora_a"], g_c["gate_lora_a"] + g_c["up_lora_a"])
    for name in ("gate_lora_b", "up_lora_b", "down_lora_a", "down_lora_b"):
        assert torch.equal(g_s[name], g_c[name]), name
    # And it is the reference's (so that both sides cannot share one wrong term): the
    # reference's gate and up copies of A are separate leaves, the shared one's gradient
    # is their sum.
    want_out, want = reference_grads(dataclasses.replace(p, lora=shared))
    assert _report(out_s.float(), want_out, forward_tolerance(p)) is None
    ref = {k: v for k, v in want.items() if k != "up_lora_a"}
    ref["gate_lora_a"] = want["gate_lora_a"] + want["up_lora_a"]
    got = {"hidden_states": dx_s, "topk_weights": dw_s}
    got.update({k: v for k, v in g_s.items() if k != "up_lora_a"})
    assert_grads_match(got, ref, grad_tolerances(p))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("T", [1, 40], ids=["T1", "T40"])
def test_half_precision_factors_give_the_bits_of_their_fp32_values(dtype: torch.dtype, T: int):
    # bf16 / fp16 factors are widened to fp32 as the products read them (an expert's A, a
    # block's columns of B), not copied whole per call: the results must be those of the
    # same values given as fp32, bit for bit, on the training path (saving and recomputing
    # forward, backward) and on the inference driver (no grad, q8 pinned). H = 512 puts
    # A's rows 2 KiB apart, so at T = 40 (20 rows an expert) x A^T reads the padded copy;
    # at T = 1 two of the four experts have no tokens.
    case = Case("half", T, 512, 48, 4, 2, ALL3, act=torch.bfloat16, lora_dtype=dtype)
    p = make_problem(case)
    for checkpointing in (False, True):
        half = {k: v.detach().clone().requires_grad_(True) for k, v in p.lora.items()}
        wide = {k: v.detach().float().requires_grad_(True) for k, v in p.lora.items()}
        out_h, dx_h, dw_h, g_h = _grads_with_factors(p, half, checkpointing)
        out_f, dx_f, dw_f, g_f = _grads_with_factors(p, wide, checkpointing)
        assert torch.equal(out_h, out_f) and torch.equal(dx_h, dx_f) and torch.equal(dw_h, dw_f)
        for name, g in g_h.items():
            assert g.dtype == dtype and torch.equal(g, g_f[name].to(dtype)), name
    wide = {k: v.float() for k, v in p.lora.items()}
    with torch.no_grad(), kt_ops.use_quant_activations("q8"):
        got = kt_ops.moe_forward(*p.op_args(), p.lora_weights())
        assert torch.equal(got, kt_ops.moe_forward(*p.op_args(), p.lora_weights(wide)))
    want_out, _ = reference_grads(p)
    assert _report(out_h.float(), want_out, forward_tolerance(p)) is None


def test_gate_and_up_a_at_one_address_but_of_other_ranks_are_not_shared():
    # Contiguous views from the same address with different ranks are two factors: the
    # check for a shared A must compare shapes, not only data pointers.
    case = dataclasses.replace(CASES[4], ranks={"gate": 4, "up": 2, "down": 5})
    p = make_problem(case)
    E, r, H = p.lora["gate_lora_a"].shape
    storage = torch.randn(E * r * H, generator=torch.Generator().manual_seed(9)) * 0.02
    factors = {k: v.detach().clone() for k, v in p.lora.items()}
    factors["gate_lora_a"] = storage.view(E, r, H)
    factors["up_lora_a"] = storage[: E * 2 * H].view(E, 2, H)
    assert factors["gate_lora_a"].data_ptr() == factors["up_lora_a"].data_ptr()
    with torch.no_grad():
        got = kt_ops.moe_forward(*p.op_args(), p.lora_weights(factors))
        copies = {k: v.clone() for k, v in factors.items()}
        want = kt_ops.moe_forward(*p.op_args(), p.lora_weights(copies))
    assert torch.equal(got, want)


# --------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------

OPCHECK_CASES = [CASES[i] for i in (0, 1, 3, 5, 7, 8, 10)]


def _requires_grad(p: Problem) -> Problem:
    lora = {k: v.clone().requires_grad_(True) for k, v in p.lora.items()}
    x = p.x.clone().requires_grad_(p.x.is_floating_point())
    tw = p.topk_weights.clone().requires_grad_(True)
    return dataclasses.replace(p, lora=lora, x=x, topk_weights=tw)


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("op_name", ["moe_forward", "moe_forward_train"])
def test_opcheck_forward_with_lora(case: Case, op_name: str):
    p = _requires_grad(make_problem(case))
    op = getattr(torch.ops.kt, op_name).default
    torch.library.opcheck(op, p.raw_args())


@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: c.name)
def test_opcheck_backward(case: Case):
    p = make_problem(case)
    op = torch.ops.kt.moe_backward.default
    torch.library.opcheck(op, (p.grad_output, *p.raw_args()))
    _, gate_pre, up_pre = kt_ops.ops.moe_forward_train(*p.op_args(), **p.op_kwargs())
    kwargs = {"gate_pre": gate_pre, "up_pre": up_pre, "compute_grad_hidden_states": False}
    torch.library.opcheck(op, (p.grad_output, *p.raw_args()), kwargs)


# --------------------------------------------------------------------------
# torch.compile: a training step
# --------------------------------------------------------------------------


class LoraExperts(torch.nn.Module):
    """Frozen packed experts with trainable LoRA on the gate and down projections."""

    def __init__(self, E: int, H: int, I: int, r: int = 4):
        super().__init__()
        w = make_expert_weights(E, H, I, seed=3)
        self.register_buffer("gate", w.gate.weight)
        self.register_buffer("up", w.up.weight)
        self.register_buffer("down", w.down.weight)
        self.H, self.I = H, I
        lora = make_lora(E, H, I, ranks={"gate": r, "down": r}, seed=3)
        self.lora = torch.nn.ParameterDict({k: torch.nn.Parameter(v) for k, v in lora.items()})

    def forward(self, x, ids, weights):
        y = kt_ops.moe_forward(
            x * 0.5,
            ids,
            weights,
            kt_ops.ExpertWeights(
                bf16_projection(self.gate, self.I, self.H),
                bf16_projection(self.up, self.I, self.H),
                bf16_projection(self.down, self.H, self.I),
            ),
            kt_ops.LoRAWeights(
                gate=(self.lora["gate_lora_a"], self.lora["gate_lora_b"]),
                down=(self.lora["down_lora_a"], self.lora["down_lora_b"]),
                scaling=0.5,
            ),
        )
        return x + y


def _loss(model, x, ids, weights):
    return model(x, ids, weights).square().mean()


def _eager_grads(model, x, ids, weights):
    model.zero_grad()
    x = x.clone().requires_grad_(True)
    w = weights.clone().requires_grad_(True)
    loss = _loss(model, x, ids, w)
    loss.backward()
    grads = {k: v.grad.clone() for k, v in model.named_parameters()}
    return loss.detach(), x.grad, w.grad, grads


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
def test_compiled_training_step_matches_eager(fresh_dynamo, backend: str, checkpointing: bool):
    from torch._dynamo.testing import CompileCounterWithBackend

    if backend == "inductor" and checkpointing:
        pytest.skip("one inductor compile is enough (slow on 2 cores)")
    E, H, I, K = 6, 32, 24, 2
    model = LoraExperts(E, H, I)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(
        lambda x, ids, w: _loss(model, x, ids, w), backend=counter, fullgraph=True, dynamic=True
    )
    kt_ops.set_lora_activation_checkpointing(checkpointing)
    try:
        for T in (5, 9, 3):
            x = make_hidden(T, H, torch.float32, seed=T)
            ids, weights = make_routing(T, E, K, seed=T)
            want = _eager_grads(model, x, ids, weights)
            model.zero_grad()
            xc = x.clone().requires_grad_(True)
            wc = weights.clone().requires_grad_(True)
            loss = compiled(xc, ids, wc)
            loss.backward()
            got_params = {k: v.grad for k, v in model.named_parameters()}
            tol = dict(rtol=0, atol=0) if backend == "aot_eager" else dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(loss.detach(), want[0], **tol)
            torch.testing.assert_close(xc.grad, want[1], **tol)
            torch.testing.assert_close(wc.grad, want[2], **tol)
            for k in want[3]:
                torch.testing.assert_close(got_params[k], want[3][k], **tol)
    finally:
        kt_ops.set_lora_activation_checkpointing(False)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"


def test_training_step_has_no_graph_breaks(fresh_dynamo):
    E, H, I, K, T = 4, 32, 16, 2, 5
    model = LoraExperts(E, H, I)
    x = make_hidden(T, H, torch.float32).requires_grad_(True)
    ids, weights = make_routing(T, E, K)
    explanation = torch._dynamo.explain(lambda x, i, w: _loss(model, x, i, w))(x, ids, weights)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.skipif(
    not hasattr(torch._dynamo.config, "trace_autograd_ops"),
    reason="this torch cannot trace Tensor.backward() inside torch.compile",
)
def test_compiled_step_with_backward_inside(fresh_dynamo):
    # forward + loss.backward() in ONE fullgraph compiled function.
    E, H, I, K, T = 5, 32, 24, 2, 7
    model = LoraExperts(E, H, I)
    x = make_hidden(T, H, torch.float32)
    ids, weights = make_routing(T, E, K)
    want = _eager_grads(model, x, ids, weights)

    def step(x, ids, w):
        loss = _loss(model, x, ids, w)
        loss.backward()
        return loss.detach()

    model.zero_grad()
    xc = x.clone().requires_grad_(True)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        loss = torch.compile(step, backend="aot_eager", fullgraph=True)(xc, ids, weights)
    torch.testing.assert_close(loss, want[0], rtol=0, atol=0)
    torch.testing.assert_close(xc.grad, want[1], rtol=0, atol=0)
    for k, v in model.named_parameters():
        torch.testing.assert_close(v.grad, want[3][k], rtol=0, atol=0)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------

E, H, I, T, K, R = 4, 32, 16, 3, 2, 4


@pytest.fixture(scope="module")
def layer():
    return make_expert_weights(E, H, I, seed=0)


@pytest.fixture
def call(layer):
    """``call(**overrides)``: ``kt_ops.moe_forward`` with all six LoRA factors, some replaced.

    Arguments are the raw op's, with the packed tensors and the LoRA factors
    named one by one (``reference.raw_op_kwargs``; a factor set to None is
    absent). ``call.raw(**overrides)`` returns the raw op's keyword arguments.
    """
    ids, weights = make_routing(T, E, K)
    valid = dict(
        hidden_states=make_hidden(T, H),
        topk_ids=ids,
        topk_weights=weights,
        **dict(zip(WEIGHT_NAMES, layer.tensors())),
        weight_format="bf16",
        sizes=[H, I],
        group_sizes=[0, 0, 0],
        lora_scaling=1.0,
        **make_lora(E, H, I, ranks={"gate": R, "up": R, "down": R}),
    )

    def raw(**overrides):
        return raw_op_kwargs({**valid, **overrides})

    def run(activation_checkpointing=None, **overrides):
        kw = raw(**overrides)
        experts = kt_ops.ExpertWeights.from_op_args(
            kw["weights"], kw["weight_format"], kw["sizes"], kw["group_sizes"]
        )
        lora = kt_ops.LoRAWeights.from_op_args(kw["lora"], kw["lora_scaling"])
        return kt_ops.moe_forward(
            kw["hidden_states"],
            kw["topk_ids"],
            kw["topk_weights"],
            experts,
            lora,
            activation_checkpointing=activation_checkpointing,
        )

    run.valid = valid
    run.raw = raw
    return run


def test_valid_lora_call_works(call):
    assert call().shape == (T, H)


SHAPES = {
    "gate_lora_a": (E, R, H),
    "gate_lora_b": (E, I, R),
    "up_lora_a": (E, R, H),
    "up_lora_b": (E, I, R),
    "down_lora_a": (E, R, I),
    "down_lora_b": (E, H, R),
}


@pytest.mark.parametrize("name", LORA_NAMES)
@pytest.mark.parametrize("how", ["rank2", "rank4", "experts", "last", "middle"])
def test_wrong_shape_or_rank(call, name, how):
    shape = list(SHAPES[name])
    if how == "rank2":
        shape = shape[1:]
    elif how == "rank4":
        shape = [1, *shape]
    elif how == "experts":
        shape[0] += 1
    elif how == "last":
        shape[2] += 1
    else:
        shape[1] += 1
    with pytest.raises(RuntimeError, match=name):
        call(**{name: torch.zeros(shape)})


def test_shape_message_is_specific(call):
    with pytest.raises(RuntimeError) as info:
        call(up_lora_b=torch.zeros(E, I + 1, R))
    msg = str(info.value)
    assert f"kt.moe_forward: up_lora_b must be [E={E}, I={I}, r={R}]" in msg, msg


@pytest.mark.parametrize("proj", PROJECTIONS)
def test_a_b_rank_mismatch(call, proj):
    b = call.valid[f"{proj}_lora_b"]
    bad = torch.zeros(*b.shape[:2], R + 1)
    with pytest.raises(RuntimeError, match=rf"{proj}_lora_b must be .*r={R}\]"):
        call(**{f"{proj}_lora_b": bad})


@pytest.mark.parametrize("name", LORA_NAMES)
def test_a_without_b(call, name):
    with pytest.raises(RuntimeError, match=r"was given without .*needs both A and B"):
        call(**{name: None})


@pytest.mark.parametrize("name", LORA_NAMES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bool], ids=str)
def test_lora_dtype(call, name, dtype):
    with pytest.raises(RuntimeError, match=f"{name} must be fp32, bf16 or fp16"):
        call(**{name: call.valid[name].to(dtype)})


def test_mixed_lora_dtypes(call):
    with pytest.raises(
        RuntimeError, match="one dtype, but gate_lora_a is Float and down_lora_b is BFloat16"
    ):
        call(down_lora_b=call.valid["down_lora_b"].bfloat16())


@pytest.mark.parametrize("name", LORA_NAMES)
def test_lora_device(call, name):
    with pytest.raises(RuntimeError, match=name):
        call(**{name: call.valid[name].to("meta")})


@pytest.mark.parametrize("name", ["gate_lora_a", "down_lora_b"])
def test_lora_not_contiguous(call, name):
    t = call.valid[name]
    bad = t.transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(RuntimeError, match=f"{name} must be contiguous"):
        call(**{name: bad})


def test_lora_rank_zero(call):
    with pytest.raises(RuntimeError, match="rank r >= 1"):
        call(gate_lora_a=torch.zeros(E, 0, H), gate_lora_b=torch.zeros(E, I, 0))


@pytest.mark.parametrize("scaling", [float("inf"), float("nan")])
def test_lora_scaling_not_finite(call, scaling):
    with pytest.raises(RuntimeError, match="lora_scaling must be finite"):
        call(lora_scaling=scaling)


def test_fake_kernel_rejects_bad_lora(call):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:

        def fake(kw):
            return tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, kw)

        assert torch.ops.kt.moe_forward(**fake(call.raw())).shape == (T, H)
        bad = fake(call.raw(up_lora_b=torch.zeros(E, I, R + 1)))
        with pytest.raises(RuntimeError, match="up_lora_b"):
            torch.ops.kt.moe_forward(**bad)
        bad = fake(call.raw(down_lora_a=torch.zeros(E, R, I + 1)))
        with pytest.raises(RuntimeError, match="down_lora_a"):
            torch.ops.kt.moe_forward(**bad)


@pytest.mark.parametrize("name", ["gate_weight", "up_weight", "down_weight"])
def test_grad_for_frozen_base_weights(call, name):
    packed = call.valid[name].clone().requires_grad_(True)
    with pytest.raises(RuntimeError, match=rf"{name} requires grad, but the base expert weights"):
        call(**{name: packed})
    with torch.no_grad():  # no autograd: nothing to refuse
        call(**{name: packed})


def test_second_backward_raises_pytorch_error(call):
    x = call.valid["hidden_states"].float().requires_grad_(True)
    for checkpointing in (False, True):
        out = call(hidden_states=x, activation_checkpointing=checkpointing)
        out.sum().backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            out.sum().backward()


def test_double_backward_raises(call):
    x = call.valid["hidden_states"].float().requires_grad_(True)
    out = call(hidden_states=x)
    (gx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* not supported"):
        gx.sum().backward()


def test_backward_argument_errors(call):
    kw = call.raw()
    bwd = torch.ops.kt.moe_backward
    go = torch.ones(T, H)
    with pytest.raises(RuntimeError, match="grad_output must have the shape"):
        bwd(go[:1], **kw)
    with pytest.raises(RuntimeError, match="grad_output must be fp32"):
        bwd(go.double(), **kw)
    pre = torch.zeros(T * K, I)
    with pytest.raises(RuntimeError, match="gate_pre was given without up_pre"):
        bwd(go, **kw, gate_pre=pre)
    with pytest.raises(
        RuntimeError, match=re.escape(f"up_pre must be a contiguous fp32 [T*K={T * K}")
    ):
        bwd(go, **kw, gate_pre=pre, up_pre=pre[:1])
    with pytest.raises(RuntimeError, match="up_lora_b"):
        bwd(go, **call.raw(up_lora_b=torch.zeros(E, I, R + 1)))
    with pytest.raises(RuntimeError, match="kt.moe_backward: lora must be empty or hold 6"):
        bwd(go, **dict(kw, lora=kw["lora"][:4]))


def _bad_routed_args(ids: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> dict:
    """case -> (overrides of the raw op's arguments, the error's text after the op's name)."""
    out_of_range = ids.clone()
    out_of_range[1, 0] = E
    return {
        "ids_out_of_range": (
            {"topk_ids": out_of_range},
            re.escape(f"topk_ids must lie in [-1, {E})"),
        ),
        "ids_dtype": ({"topk_ids": ids.float()}, "topk_ids must be int32 or int64"),
        "hidden_dtype": ({"hidden_states": x.double()}, "hidden_states must be bf16, fp16 or fp32"),
        "hidden_size": (
            {"hidden_states": x[:, :-1]},
            f"hidden_states has {H - 1} columns but the experts' hidden_size is {H}",
        ),
        "weights_shape": (
            {"topk_weights": w[:, :1]},
            "topk_weights must have the shape of topk_ids",
        ),
        "weights_dtype": ({"topk_weights": w.double()}, "topk_weights must be fp32, bf16 or fp16"),
        "hidden_device": (
            {"hidden_states": x.to("meta")},
            "gate_weight is on cpu but must be on meta",
        ),
    }


@pytest.mark.parametrize("op", ["moe_backward", "moe_forward_train"])
@pytest.mark.parametrize(
    "case",
    ["ids_out_of_range", "ids_dtype", "hidden_dtype", "hidden_size", "weights_shape",
     "weights_dtype", "hidden_device"],
)  # fmt: skip
def test_training_ops_refuse_bad_routed_arguments(call, op: str, case: str):
    """The training ops check the routed arguments as kt.moe_forward does, naming the
    argument: the backward builds its own routing plan from topk_ids and writes LoRA
    gradients per expert, so an id past E must be refused there too."""
    kw = call.raw()
    overrides, message = _bad_routed_args(kw["topk_ids"], kw["topk_weights"], kw["hidden_states"])[
        case
    ]
    kw.update(overrides)
    with pytest.raises(RuntimeError, match=f"kt.{op}: {message}"):
        if op == "moe_backward":
            torch.ops.kt.moe_backward(torch.ones(T, H), **kw)
        else:
            torch.ops.kt.moe_forward_train(**kw)


def test_backward_refuses_saved_tensors_on_another_device(call):
    kw = call.raw()
    pre = torch.zeros(T * K, I)
    with pytest.raises(RuntimeError, match="kt.moe_backward: gate_pre is on meta, not cpu"):
        torch.ops.kt.moe_backward(torch.ones(T, H), **kw, gate_pre=pre.to("meta"), up_pre=pre)
    with pytest.raises(RuntimeError, match="kt.moe_backward: grad_output is on meta, not cpu"):
        torch.ops.kt.moe_backward(torch.ones(T, H, device="meta"), **kw)


def test_training_ops_read_strided_arguments_as_their_contiguous_copies(call):
    """Transposed views of hidden_states, topk_ids and topk_weights and a strided
    grad_output give the bits of their contiguous copies (forward with saved
    pre-activations, and backward)."""
    kw = call.raw()
    strided = dict(kw)
    for name in ("hidden_states", "topk_ids", "topk_weights"):
        t = kw[name]
        strided[name] = torch.empty(t.shape[::-1], dtype=t.dtype).t().copy_(t)
        assert not strided[name].is_contiguous()
    go = torch.randn(T, 2 * H)[:, ::2]
    want = torch.ops.kt.moe_forward_train(**kw)
    got = torch.ops.kt.moe_forward_train(**strided)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    want = torch.ops.kt.moe_backward(go.contiguous(), **kw, gate_pre=want[1], up_pre=want[2])
    got = torch.ops.kt.moe_backward(go, **strided, gate_pre=got[1], up_pre=got[2])
    for a, b in zip([want[0], want[1], *want[2]], [got[0], got[1], *got[2]]):
        assert a.numel() > 0 and torch.equal(a, b)


#: The backward's products with the base on bf16 hidden states: kt_ops' vdpbf16ps
#: kernel (AVX512_BF16 CPUs; the default there without AMX) or oneDNN's brgemm.
BACKWARD_BF16_KERNELS = ["onednn", "kt"]


@pytest.mark.parametrize("bf16_kernel", BACKWARD_BF16_KERNELS)
@pytest.mark.parametrize(
    "base",
    ["bf16", "int8", "fp8", "fp8_channel", "mxfp8", "mxfp8_e0"]
    + ["int4", "int4_zeros", "q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "mxfp4", "mxfp4_e1", "nvfp4"]
    + ["q2_k", "q3_k", "iq4_nl", "iq4_xs", "q4_1", "q5_0", "q5_1"]
    + ["int8,int8,q6_k"],
)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
def test_lora_gradients_at_fp32_accuracy_on_a_bf16_base(
    checkpointing: bool, isa: str, base: str, bf16_kernel: str
):
    # bf16 hidden states times bf16 weights run the gate / up products on the inference
    # kernels (the tile path at 64+ tokens per expert): their products are exact in fp32,
    # so the LoRA factors' gradients stay at fp32 accuracy: within 1e-5 of an fp64
    # reference (a bf16 rounding of the activations anywhere would give ~1e-3). An int8
    # base too: its codes are exact in bf16 (forward: avx512_bf16/qint_dp_exact or
    # onednn/brgemm_int8_bf16), and the
    # backward's go Wd splits go * scale into two bf16 rows (within 2^-17). fp8 bases: the
    # E4M3 values are exact in bf16 (forward: avx512_bf16/fp8_dp_exact, fp8's block
    # scales on each 128-k chunk's fp32 sums; fp8_channel's on the outputs; mxfp8's in
    # the decoded values; elsewhere the streaming kernels with fp32 activations); mxfp8_e0:
    # one exponent group of one expert's gate set to E = 0, outside bf16's range once
    # added to the decoded values: that block streams in the forward and that expert's
    # backward products run on fp32 BLAS (moe_lora.cpp, panel_values_exact). mxfp4 likewise:
    # 2 e2m1(c) * 2^(E-128) is a bf16 value for E in [2, 252], so its panels hold its exact
    # values (one go Wd product, as on bf16); mxfp4_e1: one exponent group at E = 1 (an
    # fp32 subnormal scale), that expert's backward on fp32 BLAS. The
    # backward's products with the base run on either bf16 kernel (kt_ops' packs its rows
    # as row tiles and prefetches the next weight panel: one expert of 3 tokens, others
    # of ~60 in 3 tiles, panels of 64 and 32 columns); x's gradient (bf16, from dg / du
    # rounded to bf16) and the routing weights' stay within their bf16 bounds, and every
    # gradient is bit-identical at 1 and 2 threads. H = 512: the LoRA factors' rows along
    # H are 2 KiB apart, so the rank-r products read padded copies of them (LoraF32::a_rows,
    # bt_rows) for experts of 16+ rows and the factors themselves for the expert of 3.
    # Bases whose values are not bf16 values (int4 with or without zeros, the k-quants,
    # q8_0, q4_0, q4_1, q5_0, q5_1, nvfp4, iq4_nl, iq4_xs; a q6_k down projection beside
    # int8 gate / up; mxfp4 in the forward): their
    # forward runs the exact qint tiles (avx512_bf16/qint_dp_exact: bf16(x) times the
    # codes' bf16 values, the scales and zeros on each group's fp32 sums; elsewhere the
    # streaming kernels with fp32 activations), their backward splits the decoded weights
    # into bf16 hi + lo panels (split_vnni_panel): go Wd on both (the LoRA gradients
    # within 1e-5; a hi-only go Wd gives ~1.4e-3), dx on hi (x's gradient ~2.7e-3 against
    # bf16's 2.2e-3).
    if bf16_kernel == "kt" and not kt_ops.info()["cpu_features"]["avx512_bf16"]:
        pytest.skip("kt_ops' bf16 kernels need AVX512_BF16")
    from reference import dense_weights

    E, H, I, K, T, r = 5, 512, 96, 2, 160, 4  # noqa: E741
    if "_k" in base or base == "iq4_xs":
        I = 256  # noqa: E741  (the k-quants' and iq4_xs' super-blocks of 256 k)
    g = torch.Generator().manual_seed(7)
    dense = [(torch.randn(E, n, k, generator=g) / k**0.5).bfloat16() for n, k in ((I, H),) * 2]
    dense.append((torch.randn(E, H, I, generator=g) / I**0.5).bfloat16())
    fmt = base.removesuffix("_e0").removesuffix("_e1").removesuffix("_zeros")
    group = 32 if fmt == "int4" else None  # I = 96
    weights = kt_ops.ExpertWeights.from_dense(
        *dense, fmt, group_size=group, symmetric=not base.endswith("_zeros")
    )
    if base in ("mxfp8_e0", "mxfp4_e1"):
        from kt_ops.formats import PackedProjection

        gp = weights.projections[0]
        scales = gp.scales.clone()
        scales[1, 2, 3, :] = int(base[-1])  # expert 1, rows 32-47, k 96-127: 2^-127
        gate = PackedProjection(gp.weight, scales, None, fmt, gp.group_size, gp.n, gp.k)
        weights = kt_ops.ExpertWeights(gate, *weights.projections[1:])
    if base != "bf16":  # the reference multiplies the dequantized weights
        dense = list(dense_weights(weights))
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    ids[:3, 0] = E - 1  # an expert of 3 tokens
    tw = torch.rand(T, K, generator=g)
    go = torch.randn(T, H, generator=g).bfloat16()  # the op returns bf16: its grad is bf16
    dims = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    lora = {}
    for p, (n, k) in dims.items():
        lora[f"{p}_a"] = torch.randn(E, r, k, generator=g) / k**0.5
        lora[f"{p}_b"] = torch.randn(E, n, r, generator=g) * 0.1

    def run(dtype, op):
        leaves = {k: v.detach().to(dtype).requires_grad_(True) for k, v in lora.items()}
        pairs = {p: (leaves[f"{p}_a"], leaves[f"{p}_b"]) for p in dims}
        xl = x.detach().to(torch.float64 if dtype == torch.float64 else x.dtype, copy=True)
        xl.requires_grad_(True)
        twl = tw.detach().to(dtype, copy=True).requires_grad_(True)
        out = op(pairs, xl, twl)
        out.backward(go.to(out.dtype))
        grads = {k: v.grad.double() for k, v in leaves.items()}
        return dict(grads, x=xl.grad.double(), topk_weights=twl.grad.double())

    def kt(pairs, xl, twl):
        lw = kt_ops.LoRAWeights(**pairs, scaling=2.0)
        return kt_ops.moe_forward(xl, ids, twl, weights, lw, activation_checkpointing=checkpointing)

    def fp64(pairs, xd, twd):
        out = torch.zeros(T, H, dtype=torch.float64)
        for e in range(E):
            tok, slot = torch.nonzero(ids == e, as_tuple=True)

            def proj(v, p, W, e=e):
                a, b = pairs[p]
                return v @ W[e].double().T + 2.0 * (v @ a[e].T) @ b[e].T

            h = torch.nn.functional.silu(proj(xd[tok], "gate", dense[0]))
            y = proj(h * proj(xd[tok], "up", dense[1]), "down", dense[2])
            out = out.index_add(0, tok, twd[tok, slot, None] * y)
        return out

    with kt_ops.use_brgemm_bf16_kernel(bf16_kernel):
        got = run(torch.float32, kt)
        threads = kt_ops.get_num_threads()
        kt_ops.set_num_threads(1 if threads > 1 else 2)
        try:
            got1 = run(torch.float32, kt)
        finally:
            kt_ops.set_num_threads(threads)
    want = run(torch.float64, fp64)
    # x's gradient is bf16 (x's dtype) from dg / du rounded to bf16: a few bf16 ulps.
    bound = {"x": 8e-3, "topk_weights": 1e-5}
    for name in want:
        rel = ((got[name] - want[name]).norm() / want[name].norm()).item()
        assert rel < bound.get(name, 1e-5), (name, rel)
        assert torch.equal(got[name], got1[name]), name
