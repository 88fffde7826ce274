"""The LoRA backward's transposed weights made once (``ExpertWeights.with_backward_panels``).

The backward's products with the frozen base reduce over each projection's output
rows, so its bf16 kernels (kt_ops' vdpbf16ps kernel, oneDNN's brgemm) read the weights
paired along ``n``; without panels every backward transposes them
(``bf16_vnni_panel``), with them it reads the kept copy, 16 or 64 columns per panel.
These tests check that the copy has the documented layout in both widths, that the
op reads it where the documentation says (zeroed panels change the gradient there and
nothing elsewhere), that results are bit for bit those without panels (formats,
widths, both kernels, odd token counts, thread counts), and every error a caller can
hit.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
from reference import dense_weights, make_expert_weights, make_routing

import kt_ops
from kt_ops.layer import layer_args
from kt_ops.nn import MoEExperts

AVX512_BF16 = kt_ops.info()["cpu_features"]["avx512_bf16"]
AVX512 = "avx512" in kt_ops.supported_isas()
needs_panels = pytest.mark.skipif(
    not AVX512, reason="backward panels are made on AVX-512 CPUs (bf16_vnni_panel)"
)
needs_kt_kernel = pytest.mark.skipif(
    not AVX512_BF16, reason="kt_ops' bf16 backward kernel needs AVX512_BF16"
)

E, H, I, K = 5, 256, 96, 2  # noqa: E741
DIMS = {"gate": (I, H), "up": (I, H), "down": (H, I)}


def dense_bf16(seed: int = 7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(E, n, k, generator=g) / k**0.5).bfloat16() for n, k in DIMS.values()]


def lora_factors(r: int = 4, seed: int = 3, inter: int = I) -> dict[str, torch.Tensor]:
    """LoRA factors of rank r for every projection (intermediate size `inter`)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    dims = {"gate": (inter, H), "up": (inter, H), "down": (H, inter)}
    for p, (n, k) in dims.items():
        out[f"{p}_a"] = torch.randn(E, r, k, generator=g) / k**0.5
        out[f"{p}_b"] = torch.randn(E, n, r, generator=g) * 0.1
    return out


def routing(T: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 of E - 1 experts, the first 3 tokens on expert E - 1 (an expert of 3 rows)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.randperm(E - 1, generator=g)[:K] for _ in range(T)]
        or [torch.zeros(0, K, dtype=torch.long)]
    )
    if T:
        ids[: min(3, T), 0] = E - 1
    return ids.reshape(T, K), torch.rand(T, K, generator=g)


def step(weights, T: int, checkpointing: bool = False, seed: int = 1) -> dict[str, torch.Tensor]:
    """Output and every gradient of one LoRA step (bf16 hidden states)."""
    g = torch.Generator().manual_seed(seed + 10)
    x = torch.randn(T, H, generator=g).bfloat16().requires_grad_(True)
    go = torch.randn(T, H, generator=g).bfloat16()
    ids, tw = routing(T, seed)
    tw.requires_grad_(True)
    factors = lora_factors(inter=weights.intermediate_size)
    leaves = {k: v.clone().requires_grad_(True) for k, v in factors.items()}
    pairs = {p: (leaves[f"{p}_a"], leaves[f"{p}_b"]) for p in DIMS}
    out = kt_ops.moe_forward(
        x,
        ids,
        tw,
        weights,
        kt_ops.LoRAWeights(**pairs, scaling=2.0),
        activation_checkpointing=checkpointing,
    )
    out.backward(go)
    return dict({k: v.grad for k, v in leaves.items()}, out=out.detach(), x=x.grad, tw=tw.grad)


def assert_identical(got: dict, want: dict) -> None:
    for name in want:
        assert torch.equal(got[name], want[name]), name


# --------------------------------------------------------------------------
# What is made, and its layout
# --------------------------------------------------------------------------


@needs_panels
@pytest.mark.parametrize("width", [16, 64])
def test_bf16_panels_hold_the_weights_paired_along_n(width: int):
    dense = dense_bf16()
    w = kt_ops.ExpertWeights.from_dense(*dense, "bf16").with_backward_panels(width)
    for t, d in zip(w.backward_panels, dense):
        n, k = d.shape[1:]
        wd = width if k % width == 0 else 16  # down's k = 96: 64 does not divide it
        assert t.dtype == torch.bfloat16 and t.shape == (E, k // wd, wd * n)
        # panel s, [n/2][wd][2]: element [p, j, i] = W[2p + i, wd s + j]
        want = d.view(E, n // 2, 2, k // wd, wd).permute(0, 3, 1, 4, 2).reshape(E, k // wd, wd * n)
        assert torch.equal(t, want)


@needs_kt_kernel  # mxfp4's panels: the split decoder's rounding (AVX512_BF16)
@pytest.mark.parametrize("width", [16, 64])
def test_mxfp4_panels_hold_its_exact_values(width: int):
    # 2 e2m1(c) * 2^(E-128) is a bf16 value while it stays normal: the panel holds the
    # dense weights themselves (scales included), as a bf16 base's panel does.
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "mxfp4").with_backward_panels(width)
    assert w.backward_panels is not None
    for t, d in zip(w.backward_panels, dense_weights(w)):
        n, k = d.shape[1:]
        wd = width if k % width == 0 else 16
        want = d.view(E, n // 2, 2, k // wd, wd).permute(0, 3, 1, 4, 2).reshape(E, k // wd, wd * n)
        assert t.dtype == torch.bfloat16 and torch.equal(t.float(), want)


@needs_panels
def test_the_default_width_follows_the_backward_kernel():
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16")

    def widths():
        panels = w.with_backward_panels().backward_panels
        return [k // t.shape[1] for t, (_, k) in zip(panels, DIMS.values())]

    with kt_ops.use_brgemm_bf16_kernel("onednn"):
        assert widths() == [64, 64, 16]  # down's k = 96: 64 does not divide it
    with kt_ops.use_brgemm_bf16_kernel("kt"):
        with kt_ops.use_compute_path("brgemm"):  # the kernel, whatever 'auto' would pick
            kernel = kt_ops.compute_paths("avx512")["bf16"]["brgemm_kernel"]  # any ISA forced
        kt_runs = (kernel or "").endswith("bf16_dp")
        assert widths() == ([16, 16, 16] if kt_runs else [64, 64, 16])


@needs_panels
def test_int8_panels_hold_the_codes_without_their_channel_scales():
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "int8").with_backward_panels(16)
    for t, d in zip(w.backward_panels, dense_weights(w)):
        n, k = d.shape[1:]
        codes = t.view(E, k // 16, n // 2, 16, 2).permute(0, 2, 4, 1, 3).reshape(E, n, k).float()
        assert torch.equal(codes, codes.round()) and codes.abs().max() <= 127
        # dense = codes * the row's scale: one scale per output row.
        scale = d.abs().amax(dim=2, keepdim=True) / codes.abs().amax(dim=2, keepdim=True)
        torch.testing.assert_close(codes * scale, d, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "fmt,made",
    [
        ("bf16", (True,) * 3),
        ("int8", (True,) * 3),
        ("fp8", (True,) * 3),
        ("fp8_channel", (True,) * 3),
        ("mxfp8", (True,) * 3),
        ("mxfp4", (True,) * 3),
        ("int8,int8,q6_k", (True, True, False)),
        ("int4", None),
        ("q4_k", None),
    ],
)
def test_which_projections_get_panels(fmt: str, made):
    inter = 256 if "_k" in fmt else I
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(E, n, k, generator=g) / k**0.5 for n, k in ((inter, H),) * 2]
    dense.append(torch.randn(E, H, inter, generator=g) / inter**0.5)
    w = kt_ops.ExpertWeights.from_dense(*dense, fmt, group_size=32 if fmt == "int4" else None)
    wp = w.with_backward_panels()
    if made is None or not AVX512 or (fmt == "mxfp4" and not AVX512_BF16):  # none kept here
        assert wp.backward_panels is None
        assert len(wp.tensors()) == len(w.tensors())
        return
    assert tuple(t is not None for t in wp.backward_panels) == made
    assert len(wp.tensors()) == 15 and wp.tensors()[:9] == w.tensors()[:9]


# --------------------------------------------------------------------------
# Read by the op, and the same results
# --------------------------------------------------------------------------


def _zeroed(w: kt_ops.ExpertWeights, which=(0, 1, 2)) -> kt_ops.ExpertWeights:
    """w with the panels of the projections `which` zeroed (the others kept)."""
    panels = tuple(
        torch.zeros_like(t) if i in which else t for i, t in enumerate(w.backward_panels)
    )
    return dataclasses.replace(w, backward_panels=panels)


def _bf16_tiles(kernel: str) -> bool:
    """Whether the backward's bf16 products run on `kernel` here (oneDNN capped below
    AVX512_CORE_BF16 runs none: the fp32 BLAS backward)."""
    with kt_ops.use_isa("avx512"), kt_ops.use_brgemm_bf16_kernel(kernel):
        return kt_ops.compute_paths()["bf16"]["brgemm_kernel"] is not None


@needs_kt_kernel
@pytest.mark.parametrize("width", [16, 64])
def test_which_kernel_reads_which_panels(width: int):
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16")
    wp = w.with_backward_panels(width)
    if not _bf16_tiles("kt"):
        pytest.skip("no bf16 tiles here (oneDNN capped below AVX512_CORE_BF16)")
    # Zeroed panels: W^T products of zero. x's gradient keeps the LoRA terms only.
    with kt_ops.use_isa("avx512"), kt_ops.use_brgemm_bf16_kernel("onednn"):  # either width
        want = step(w, 40)
        got = step(_zeroed(wp), 40)
        assert not torch.equal(got["x"], want["x"])
        assert torch.equal(got["out"], want["out"])  # the forward never reads them
    with kt_ops.use_isa("avx512"), kt_ops.use_brgemm_bf16_kernel("kt"):  # 16 wide only
        want = step(w, 40)
        # gate and up: 64 wide where asked (k = 256); down stays 16 wide (k = 96).
        got = step(_zeroed(wp, which=(0, 1)), 40)
        if width == 16:
            assert not torch.equal(got["x"], want["x"])
        else:
            assert_identical(got, want)
    with kt_ops.use_isa("avx2"):  # the fp32 BLAS backward: ignored
        assert_identical(step(_zeroed(wp), 40), step(w, 40))


@needs_panels
@pytest.mark.parametrize("width", [16, 64])
@pytest.mark.parametrize("bf16_kernel", ["kt", "onednn"])
@pytest.mark.parametrize(
    "base",
    [
        "bf16",
        "int8",
        "fp8",
        "fp8_channel",
        "mxfp8",
        "mxfp8_e0",
        "mxfp4",
        "mxfp4_e1",
        "int8,int8,q6_k",
    ],
)
def test_results_are_bit_identical_with_panels(base: str, bf16_kernel: str, width: int):
    if (bf16_kernel == "kt" or base.startswith("mxfp4")) and not AVX512_BF16:
        pytest.skip("kt_ops' bf16 kernels and mxfp4's panels need AVX512_BF16")
    inter = 256 if "_k" in base else I
    g = torch.Generator().manual_seed(7)
    dense = [(torch.randn(E, n, k, generator=g) / k**0.5).bfloat16() for n, k in ((inter, H),) * 2]
    dense.append((torch.randn(E, H, inter, generator=g) / inter**0.5).bfloat16())
    fmt = base.split("_e")[0]
    w = kt_ops.ExpertWeights.from_dense(*dense, fmt)
    if base.endswith(("_e0", "_e1")):
        # An exponent outside the range where the values are bf16 values (mxfp8 below
        # 10, mxfp4 below 2): that expert computes otherwise.
        from kt_ops.formats import PackedProjection

        gp = w.gate
        scales = gp.scales.clone()
        scales[1, 2, 3, :] = int(base[-1])
        gate = PackedProjection(gp.weight, scales, None, fmt, gp.group_size, gp.n, gp.k)
        w = kt_ops.ExpertWeights(gate, w.up, w.down)
    wp = w.with_backward_panels(width)
    assert wp.backward_panels is not None
    threads = kt_ops.get_num_threads()
    with kt_ops.use_brgemm_bf16_kernel(bf16_kernel):
        want = step(w, 160)
        try:
            for n in (1, 2):
                kt_ops.set_num_threads(n)
                assert_identical(step(wp, 160), want)
        finally:
            kt_ops.set_num_threads(threads)


@needs_kt_kernel
@pytest.mark.parametrize("T", [0, 1, 7, 64])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["save", "recompute"])
@pytest.mark.parametrize("bf16_kernel,width", [("kt", 16), ("onednn", 64)])
def test_odd_token_counts_and_checkpointing(T: int, checkpointing: bool, bf16_kernel, width):
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16")
    wp = w.with_backward_panels(width)
    with kt_ops.use_brgemm_bf16_kernel(bf16_kernel):
        assert_identical(step(wp, T, checkpointing), step(w, T, checkpointing))


def test_inference_ignores_the_panels():
    w = make_expert_weights(6, 64, 32, seed=2)
    wp = w.with_backward_panels()
    x = torch.randn(9, 64).bfloat16()
    ids, tw = make_routing(9, 6, 2, seed=2)
    assert torch.equal(kt_ops.moe_forward(x, ids, tw, wp), kt_ops.moe_forward(x, ids, tw, w))


# --------------------------------------------------------------------------
# Kept fresh, not pickled, round trips
# --------------------------------------------------------------------------


@needs_panels
def test_weights_changed_in_place_make_the_panels_stale():
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16")
    wp = w.with_backward_panels()
    assert wp.backward_panels_fresh()
    w.down.weight.mul_(1)  # an in-place write: the panels may no longer match
    assert not wp.backward_panels_fresh()
    with pytest.raises(ValueError, match="with_backward_panels"):
        wp.tensors()
    x = torch.randn(4, H).bfloat16()
    ids, tw = routing(4)
    with pytest.raises(ValueError, match="changed in place"):
        kt_ops.moe_forward(x, ids, tw, wp)
    again = wp.with_backward_panels()
    assert again.backward_panels_fresh() and len(again.tensors()) == 15


@needs_panels
def test_panels_are_not_pickled_or_moved_and_survive_with_biases():
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16").with_backward_panels()
    assert pickle.loads(pickle.dumps(w)).backward_panels is None
    assert w.to("cpu").backward_panels is None
    zeros = [torch.zeros(E, n) for n, _ in DIMS.values()]
    wb = w.with_biases(*zeros)
    assert wb.backward_panels is w.backward_panels and wb.backward_panels_fresh()
    assert len(wb.tensors()) == 15 and wb.tensors()[9] is not None


@needs_panels
def test_from_op_args_reads_fifteen_entries():
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16").with_backward_panels()
    args = layer_args(w, None, "silu", None)
    back = kt_ops.ExpertWeights.from_op_args(*args[:4])
    assert all(a is b for a, b in zip(back.backward_panels, w.backward_panels))
    assert back.tensors()[:12] == w.tensors()[:12]
    with pytest.raises(ValueError, match="or 15 with the biases and the backward panels"):
        kt_ops.ExpertWeights.from_op_args(args[0][:13], *args[1:4])


@needs_kt_kernel
def test_module_keeps_panels_and_remakes_them_after_load_state_dict():
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16")
    m = MoEExperts(w)
    m.add_lora(rank=4, projections=("gate", "up", "down"))
    for p in m.lora_parameters().values():  # nonzero B: every term of the gradient shows
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(12, H).bfloat16()
    ids, tw = routing(12)

    def grads(module):
        xl = x.clone().requires_grad_(True)
        module(xl, ids, tw).float().square().sum().backward()
        return xl.grad

    want = grads(m)
    assert m.expert_weights().backward_panels is None
    m.keep_backward_panels()
    kept = m.expert_weights().backward_panels
    assert kept is not None and m.expert_weights().backward_panels is kept  # made once
    assert torch.equal(grads(m), want)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    assert not any("panel" in k for k in state)
    state["down_weight"].mul_(0.5)
    m.load_state_dict(state, strict=False)  # written in place: the panels are made again
    remade = m.expert_weights().backward_panels
    assert remade is not kept and remade[2].float().abs().sum() > 0
    assert not torch.equal(grads(m), want)
    m.keep_backward_panels(False)
    assert m.expert_weights().backward_panels is None


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


def _call_with_panels(w: kt_ops.ExpertWeights, panels: list) -> None:
    x = torch.randn(4, H).bfloat16()
    ids, tw = routing(4)
    weights = w.tensors()[:9] + [None] * 3 + panels
    torch.ops.kt.moe_forward(x, ids, tw, weights, w.weight_format, [H, I], list(w.group_sizes), [])


@needs_panels
@pytest.mark.parametrize(
    "how,match",
    [
        ("dtype", "gate_backward_panels must be bf16, got Float"),
        ("shape", r"gate_backward_panels must be \[E=5, k/w, w n\] for a width w of 16 or 64"),
        ("width 32", r"that divides k=256 \(16: \[5, 16, 1536\]"),
        ("down 64 wide", r"down_backward_panels must be \[E=5, k/w, w n\].*divides k=96"),
        ("strided", "gate_backward_panels must be contiguous"),
        ("device", "gate_backward_panels"),
    ],
)
def test_bad_panels_are_refused_by_name(how: str, match: str):
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16").with_backward_panels(16)
    gate, up, down = w.backward_panels
    if how == "down 64 wide":  # [E, 96/64, 64 n] does not exist: 64 does not divide 96
        bad_down = torch.zeros(E, 1, 64 * H, dtype=torch.bfloat16)
        with pytest.raises(RuntimeError, match=match):
            _call_with_panels(w, [gate, up, bad_down])
        return
    bad = {
        "dtype": gate.float(),
        "shape": gate[:, :8],
        "width 32": gate.reshape(E, 8, 32 * I),
        "strided": gate.transpose(1, 2).contiguous().transpose(1, 2),
        "device": gate.to("meta"),
    }[how]
    with pytest.raises(RuntimeError, match=match):
        _call_with_panels(w, [bad, up, down])


def test_panels_for_a_format_without_them_are_refused():
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(E, n, k, generator=g) for n, k in DIMS.values()]
    w = kt_ops.ExpertWeights.from_dense(*dense, "int4", group_size=32)
    bogus = torch.zeros(E, H // 16, 16 * I, dtype=torch.bfloat16)
    with pytest.raises(
        RuntimeError,
        match=r"gate_backward_panels was given, but that projection is int4 \[96, 256\]",
    ):
        _call_with_panels(w, [bogus, None, None])


@pytest.mark.parametrize("width", [32, 0, True, 16.0])
def test_with_backward_panels_refuses_other_widths(width):
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16")
    with pytest.raises(ValueError, match=r"width must be 16 or 64 \(or None\), got"):
        w.with_backward_panels(width)


def test_with_backward_panels_refuses_weights_off_the_cpu():
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16").to("meta")
    with pytest.raises(ValueError, match="must be on the CPU, got meta"):
        w.with_backward_panels()


@needs_kt_kernel
def test_opcheck_with_panels():
    w = kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16").with_backward_panels()
    x = torch.randn(24, H).bfloat16().requires_grad_(True)
    ids, tw = routing(24)
    tw.requires_grad_(True)
    lora = kt_ops.LoRAWeights(
        **{p: (v[f"{p}_a"], v[f"{p}_b"]) for v in [lora_factors()] for p in DIMS}, scaling=2.0
    )
    args = (x, ids, tw) + layer_args(w, lora, "silu", x)
    torch.library.opcheck(torch.ops.kt.moe_forward.default, args)
    go = torch.randn(24, H).bfloat16()
    plain = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args[:3]) + args[3:]
    torch.library.opcheck(torch.ops.kt.moe_backward.default, (go, *plain))


def test_keep_backward_panels_on_a_model_counts_their_bytes():
    from kt_ops.lora import keep_backward_panels

    model = torch.nn.ModuleDict(
        {
            "bf16": MoEExperts(kt_ops.ExpertWeights.from_dense(*dense_bf16(), "bf16")),
            "int8": MoEExperts(kt_ops.ExpertWeights.from_dense(*dense_bf16(1), "int8")),
        }
    )
    weights_per_layer = sum(n * k for n, k in DIMS.values()) * E
    want = 2 * 2 * weights_per_layer if AVX512 else 0  # 2 bytes per weight, 2 layers
    assert keep_backward_panels(model) == want
    assert (model["int8"].expert_weights().backward_panels is not None) == AVX512
    assert keep_backward_panels(model, keep=False) == 0
    assert model["bf16"].expert_weights().backward_panels is None
