"""Compute paths: the streaming kernels and oneDNN's brgemm, forced one by one.

``kt_ops.set_compute_path('streaming' | 'brgemm' | 'auto')`` picks which kernels
compute the expert products (docs/formats.md, "Compute paths"). Every test runs
the paths on the same inputs: each against the dense reference (brgemm rounds
the activations and SwiGLU outputs to bf16, so its reference does too), per ISA
path (the ``isa`` fixture), with odd sizes, T = 0 and 1, experts without
tokens, T at the 'auto' switch-over threshold, and 1/2/3 threads bit-identical.
Where oneDNN's brgemm does not run (AVX2 tiers, CPUs without AVX512_BF16, a
torch without it), 'brgemm' must fall back to the streaming kernels bit for bit.

int8 and q8_0 run on the u8s8 brgemm (q8 activations, K chunks of 32, the
streaming kernels' fp32 fold): against the q8 reference (``reference_for``)
and bit-identical to the streaming q8 kernels of the SIMD tiers.

fp8 runs on the bf16 tiles with the activations times the block scales rounded to
bf16 and the codes' exact bf16 values (bf16(x * s) * e4m3): against the reference
with those activations (``fp8_scaled_activations``), and, with power-of-two scales
(where bf16(x * s) = bf16(x) * s), bit-identical to the bf16 brgemm on the
dequantized weights (the last section).
"""

from __future__ import annotations

import functools

import onednn_isa
import pytest
import torch
from reference import (
    TOL_BF16,
    TOL_BF16_BRGEMM,
    TOL_QUANT,
    W4A8_KERNELS,
    Tolerance,
    assert_matches_reference,
    lora_weights_from,
    make_expert_weights,
    make_hidden,
    make_quant_experts,
    make_routing,
    mismatch_report,
    quant_mismatch_report,
    reference_for,
    reference_moe_forward,
    token_int8_min_tokens_of,
)
from test_quant_forward import VARIANTS as QUANT_VARIANTS
from test_quant_forward import Variant

import kt_ops
from kt_ops.formats.grid import GRID_FORMATS
from kt_ops.info import format_info

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PATHS = ("streaming", "brgemm", "auto")
#: The formats on the u8s8 brgemm kernel.
Q8_BRGEMM_FORMATS = ("int8", "q8_0")
_FEATS = kt_ops.info()["cpu_features"]
#: Every format with a brgemm kernel, and the kernel where it runs: bf16 and
#: fp8 (with AVX512_VBMI) on kt_ops' own vdpbf16ps tiles on AVX512_BF16 CPUs
#: without AMX (``set_brgemm_bf16_kernel``).
BRGEMM_KERNELS = {
    # AMX: kt_ops' AMX tiles (kernels/avx512/bf16_amx.cpp) under the default kernel setting,
    # unless ONEDNN_MAX_CPU_ISA caps oneDNN below AMX (which turns them off too).
    "bf16": (
        "avx512_bf16/bf16_dp"
        if _FEATS["avx512_bf16"] and not _FEATS.get("amx")
        else "amx/bf16_tiles"
        if _FEATS.get("amx") and onednn_isa.at_least("AVX512_CORE_AMX")
        else "onednn/brgemm_bf16"
    ),
    # int8 (per channel) under quant 'auto': full-K calls on per-token int8 activations;
    # under 'q8' the u8s8 kernel on the q8 records (bit-identical to the q8 kernels).
    "int8": (
        "avx512_vnni/w8a8_dp"
        if _FEATS.get("avx512_vnni") and not _FEATS.get("amx")
        else "amx/w8a8_tiles"  # kt_ops' AMX tiles (kernels/avx512/w8a8_amx.cpp)
        if _FEATS.get("amx") and onednn_isa.at_least("AVX512_CORE_AMX")
        else "onednn/brgemm_w8a8"
    ),
    "q8_0": "onednn/brgemm_u8s8",
    "fp8": (
        "avx512_bf16/fp8_dp"
        if _FEATS["avx512_bf16"] and _FEATS.get("avx512_vbmi") and not _FEATS.get("amx")
        else "onednn/brgemm_fp8_bf16"
    ),
}
# fp8_channel: fp8's tiles with unit band scales, its row scales applied to the outputs;
# mxfp8: the same, its exponents moved into the decoded bf16 values.
BRGEMM_KERNELS["fp8_channel"] = BRGEMM_KERNELS["mxfp8"] = BRGEMM_KERNELS["fp8"]
#: The 4-bit integer format on the w4a8 kernels: its projections with one scale per
#: output channel, on kt_ops' tiles (AVX512_VNNI without AMX), else oneDNN's u8s8 calls on
#: the codes decoded to signed bytes (AMX).
W4A8_FORMATS = ("int4",)
for _name in W4A8_FORMATS:
    BRGEMM_KERNELS[_name] = (
        "avx512_vnni/w4a8_dp"
        if _FEATS.get("avx512_vnni") and not _FEATS.get("amx")
        else "amx/w4a8_tiles"  # kt_ops' AMX tiles (kernels/avx512/w8a8_amx.cpp)
        if _FEATS.get("amx") and onednn_isa.at_least("AVX512_CORE_AMX")
        else "onednn/brgemm_w4a8"
    )
#: mxfp4's tile kernel: its exact values decoded to bf16 tiles on oneDNN's bf16 brgemm,
#: where oneDNN computes bf16 (AMX by default; ``use_brgemm_bf16_kernel('onednn')``
#: elsewhere). Without it mxfp4 streams (under quant 'fp32': kt_ops' exact qint tiles).
MXFP4_KERNEL = "onednn/brgemm_mxfp4_bf16"
if _FEATS.get("amx") and _FEATS["avx512_bf16"] and onednn_isa.at_least("AVX512_CORE_BF16"):
    BRGEMM_KERNELS["mxfp4"] = MXFP4_KERNEL  # (oneDNN capped below BF16: no bf16 brgemm)

#: 'auto' with experts on both paths, against the unrounded reference: the
#: brgemm experts' bf16 activations (relative rounding 2^-9 per value).
TOL_MIXED = Tolerance(compute=4e-3)
THREAD_COUNTS = (1, 2, 3)


def brgemm_runs(fmt: str = "bf16") -> bool:
    """Whether a tile kernel (oneDNN's brgemm, or kt_ops' own tiles) computes ``fmt`` on the
    active ISA path when forced."""
    with kt_ops.use_compute_path("brgemm"):
        return kt_ops.compute_paths()[fmt]["brgemm_kernel"] is not None


def bf16_min_tokens() -> int | None:
    with kt_ops.use_compute_path("auto"):
        return kt_ops.compute_paths()["bf16"]["brgemm_min_tokens"]


def planned_kernels(experts, counts, bf16_activations: bool = True) -> list[str]:
    """The kernel the compute plan picks for gate, up and down of an expert of each of
    ``counts`` tokens under the current modes (``ProjectionPlan::kernel_name``); one name
    per count, the three projections checked to agree (one format)."""
    names = kt_ops._C._testing.plan_kernels(
        experts.tensors(),
        experts.weight_format,
        [experts.hidden_size, experts.intermediate_size],
        list(experts.group_sizes),
        bf16_activations,
        list(counts),
    )
    assert all(len(set(n)) == 1 for n in names), names
    return [n[0] for n in names]


def assert_plan_follows_threshold(experts, counts, tile_kernel, min_tokens, bf16_activations):
    """Under 'auto', experts of at least ``min_tokens`` tokens run ``tile_kernel`` and the
    others a streaming kernel (``min_tokens`` None: all stream). Where the two paths give
    the same bits (q8_0's u8s8 brgemm) only the plan tells them apart."""
    with kt_ops.use_compute_path("auto"):
        got = planned_kernels(experts, counts, bf16_activations)
    for c, name in zip(counts, got):
        if min_tokens is not None and c >= min_tokens:
            assert name == tile_kernel, (c, name, tile_kernel)
        else:
            assert name != tile_kernel, (c, name, tile_kernel)


def run(path: str, x, ids, w, experts):
    with kt_ops.use_compute_path(path):
        return kt_ops.moe_forward(x, ids, w, experts)


def check_path(path: str, x, ids, w, experts):
    """Run ``path`` and compare it with the reference of what that path computes."""
    out = run(path, x, ids, w, experts)
    assert out.dtype == x.dtype and out.shape == x.shape
    counts = torch.bincount(ids[ids >= 0].flatten(), minlength=experts.num_experts)
    min_tokens = bf16_min_tokens()
    on_brgemm = brgemm_runs() and (
        path == "brgemm"
        or (
            path == "auto"
            and x.dtype == torch.bfloat16  # 'auto' keeps fp32/fp16 activations exact
            and min_tokens is not None
            and bool((counts >= min_tokens).any())
        )
    )
    if path == "auto" and on_brgemm and bool(((counts > 0) & (counts < min_tokens)).any()):
        # Mixed: experts on both paths (each token's path: test_auto_threshold).
        ref = reference_moe_forward(x, ids, w, experts)
        assert_matches_reference(out, ref, TOL_MIXED)
        return out
    ref = reference_moe_forward(x, ids, w, experts, bf16_activations=on_brgemm)
    assert_matches_reference(out, ref, TOL_BF16_BRGEMM if on_brgemm else TOL_BF16)
    return out


# --------------------------------------------------------------------------
# The API
# --------------------------------------------------------------------------


def test_set_get_use_compute_path():
    assert kt_ops.get_compute_path() == "auto"
    for path in PATHS:
        kt_ops.set_compute_path(path)
        assert kt_ops.get_compute_path() == path
    kt_ops.set_compute_path("auto")
    with kt_ops.use_compute_path("streaming"):
        assert kt_ops.get_compute_path() == "streaming"
    assert kt_ops.get_compute_path() == "auto"
    for name in ("set_compute_path", "get_compute_path", "use_compute_path", "compute_paths"):
        assert name in kt_ops.__all__
        assert getattr(kt_ops, name).__doc__


@pytest.mark.parametrize("bad", ["", "Brgemm", "onednn", "fp32", None, 1])
def test_bad_compute_path_raises(bad):
    with pytest.raises(ValueError, match="set_compute_path: path must be"):
        kt_ops.set_compute_path(bad)
    with pytest.raises(ValueError, match="set_compute_path"):
        kt_ops._C.set_compute_path("nope")
    assert kt_ops.get_compute_path() == "auto"


def test_info_reports_the_compute_path(isa):
    with kt_ops.use_compute_path("streaming"):
        report = kt_ops.info()
        assert report["compute_path"] == "streaming"
        assert all(v["brgemm_kernel"] is None for v in report["brgemm"].values())
    report = kt_ops.info()
    assert report["compute_path"] == "auto"
    assert set(report["brgemm"]) == set(report["kernels"])
    text = format_info(report)
    assert "compute path   : auto" in text
    if brgemm_runs():
        feats = report["cpu_features"]
        assert feats["avx512_bf16"] == _FEATS["avx512_bf16"]
        kernel = BRGEMM_KERNELS["bf16"]  # kt_ops' own tiles on AVX512_BF16 or AMX
        min_tokens = kt_ops.formats.format_spec("bf16").brgemm_min_tokens_for(
            report["brgemm_cpu_class"]
        )
        # A class whose threshold is none (avx512_intel) streams bf16 under 'auto'.
        assert report["brgemm"]["bf16"] == {
            "brgemm_kernel": kernel if min_tokens is not None else None,
            "brgemm_min_tokens": min_tokens,
        }
        assert (kernel in text) == (min_tokens is not None)


def test_brgemm_cpu_class_follows_the_cpu():
    # AMX first; an Intel CPU without it has vdpbf16ps at a quarter of its FMA's rate.
    feats = kt_ops.info()["cpu_features"]
    want = "amx" if feats["amx"] else "avx512_intel" if feats["intel"] else "avx512"
    assert kt_ops.info()["brgemm_cpu_class"] == want
    assert f"brgemm thresholds of the {want} class" in format_info(kt_ops.info())


def test_format_table_records_the_thresholds():
    spec = kt_ops.formats.format_spec("bf16")
    assert spec.brgemm_min_tokens_for("avx512") == 8  # kt_ops' vdpbf16ps tiles
    assert spec.brgemm_min_tokens_for("avx512_intel") is None  # streaming fp32 FMAs win
    assert spec.brgemm_min_tokens_for("amx") == 8  # kt_ops' AMX tiles
    with pytest.raises(ValueError, match="cpu_class"):
        spec.brgemm_min_tokens_for("avx2")
    for name in Q8_BRGEMM_FORMATS:  # u8s8 brgemm, docs/formats.md "Compute paths"
        spec = kt_ops.formats.format_spec(name)
        # q8_0: the VNNI streaming kernel wins at every count measured; int8 (w8a8, kt_ops'
        # vpdpbusd tiles) from 10 tokens per expert; on AMX int8 (oneDNN's w8a8) from 10,
        # q8_0 16 (not measured).
        assert spec.brgemm_min_tokens_for("avx512") == (10 if name == "int8" else None)
        assert spec.brgemm_min_tokens_for("avx512_intel") == (8 if name == "int8" else None)
        assert spec.brgemm_min_tokens_for("amx") == (10 if name == "int8" else 16)
    spec = kt_ops.formats.format_spec("int4")  # per channel on the w4a8 kernels
    assert spec.brgemm_min_tokens_for("avx512") == 4  # kt_ops' tiles
    assert spec.brgemm_min_tokens_for("avx512_intel") == 8
    assert spec.brgemm_min_tokens_for("amx") == 12  # kt_ops' AMX tiles (measured)
    for name in ("fp8", "fp8_channel", "mxfp8"):  # docs/formats.md "Compute paths"
        spec = kt_ops.formats.format_spec(name)
        assert spec.brgemm_min_tokens_for("avx512") == 5  # kt_ops' fused tiles
        assert spec.brgemm_min_tokens_for("avx512_intel") is None  # vdpbf16ps: slow there
        assert spec.brgemm_min_tokens_for("amx") == 12  # oneDNN's brgemm on decoded tiles
    spec = kt_ops.formats.format_spec("mxfp4")  # oneDNN's bf16 brgemm on decoded tiles
    assert spec.brgemm_min_tokens_for("avx512") is None  # the q8 streaming kernel wins
    assert spec.brgemm_min_tokens_for("avx512_intel") is None
    assert spec.brgemm_min_tokens_for("amx") == 32  # measured on a Xeon with AMX
    for name in kt_ops.formats.FORMATS:
        if name not in BRGEMM_KERNELS and name != "mxfp4":  # no brgemm path yet: streaming
            assert dict(kt_ops.formats.format_spec(name).brgemm_min_tokens) == {
                "avx512": None,
                "avx512_intel": None,
                "amx": None,
            }


def test_where_brgemm_runs(isa):
    feats = kt_ops.info()["cpu_features"]
    with kt_ops.use_compute_path("brgemm"):
        paths = kt_ops.compute_paths()
    for name, p in paths.items():
        if name not in BRGEMM_KERNELS:
            assert p["brgemm_kernel"] is None
    # Where oneDNN runs the type: the class it runs here (the CPU's, capped by
    # ONEDNN_MAX_CPU_ISA; scripts/test.sh reruns this file under each lower class).
    expected_u8s8 = (
        kt_ops._C.brgemm_built()
        and isa not in ("ref", "avx2")
        and onednn_isa.at_least("AVX512_CORE_VNNI")
        and torch.backends.mkldnn.is_available()
    )
    # int8's w8a8 on kt_ops' own vpdpbusd tiles needs no oneDNN: an AVX512_VNNI CPU
    # without AMX and an AVX-512 path.
    kt_w8a8 = isa not in ("ref", "avx2") and feats["avx512_vnni"] and not feats.get("amx")
    for name in W4A8_FORMATS:  # the w4a8 kernels, under 'auto' quant only
        want = (
            "avx512_vnni/w4a8_dp"
            if kt_w8a8
            else BRGEMM_KERNELS[name]  # kt_ops' AMX tiles or oneDNN's calls
            if expected_u8s8 and isa not in ("ref", "avx2")
            else None
        )
        assert paths[name]["brgemm_kernel"] == want
        assert paths[name]["brgemm_min_tokens"] == (1 if want else None)
    for name in Q8_BRGEMM_FORMATS:
        runs = expected_u8s8 or (name == "int8" and kt_w8a8)
        want = BRGEMM_KERNELS[name] if runs else None
        assert paths[name]["brgemm_kernel"] == want
        assert paths[name]["brgemm_min_tokens"] == (1 if runs else None)
        with kt_ops.use_compute_path("brgemm"), kt_ops.use_quant_activations("q8"):
            q8 = kt_ops.compute_paths()[name]["brgemm_kernel"]
        assert q8 == ("onednn/brgemm_u8s8" if expected_u8s8 else None)
    expected = (
        kt_ops._C.brgemm_built()
        and isa not in ("ref", "avx2")
        and onednn_isa.at_least("AVX512_CORE_BF16")
        and torch.backends.mkldnn.is_available()
    )
    # Both on the bf16 brgemm path; fp8 rounds its A rows with AVX512_BF16 itself.
    fp8_runs = expected and feats["avx512_bf16"]
    fp8s = [(name, fp8_runs) for name in ("fp8", "fp8_channel", "mxfp8")]
    for name, runs in [("bf16", expected), *fp8s]:
        want = BRGEMM_KERNELS[name] if runs else None
        assert paths[name]["brgemm_kernel"] == want
        assert paths[name]["brgemm_min_tokens"] == (1 if runs else None)  # forced: any count
    # mxfp4: oneDNN's bf16 brgemm where it computes bf16 (AMX, or forced 'onednn'), under
    # quant 'auto' and 'fp32' (never 'q8': it does not quantize the activations).
    onednn_default = feats.get("amx") or not feats["avx512_bf16"]
    for kernel in ("auto", "onednn", "kt"):
        on = fp8_runs and (kernel == "onednn" or (kernel == "auto" and onednn_default))
        with kt_ops.use_compute_path("brgemm"), kt_ops.use_brgemm_bf16_kernel(kernel):
            for quant in ("auto", "fp32", "q8"):
                with kt_ops.use_quant_activations(quant):
                    got = kt_ops.compute_paths()["mxfp4"]["brgemm_kernel"]
                if quant == "fp32" and not on and got is not None:
                    assert got == "avx512_bf16/qint_dp_exact", kernel  # test_qint_exact_*
                    continue
                assert got == (MXFP4_KERNEL if on and quant != "q8" else None), (kernel, quant)
    with kt_ops.use_compute_path("streaming"):
        assert kt_ops.compute_paths()["bf16"]["brgemm_kernel"] is None


def test_mkldnn_disabled_falls_back_to_streaming():
    experts = make_expert_weights(4, 40, 24, seed=3)
    ids, w = make_routing(30, 4, 2, seed=3)
    x = make_hidden(30, 40, seed=3)
    want = run("streaming", x, ids, w, experts)
    with torch.backends.mkldnn.flags(enabled=False):
        with kt_ops.use_compute_path("brgemm"):
            assert kt_ops.compute_paths()["bf16"]["brgemm_kernel"] is None
        got = run("brgemm", x, ids, w, experts)
    assert torch.equal(got, want)


def test_onednn_limited_below_bf16_is_queried(python_subprocess):
    # ONEDNN_MAX_CPU_ISA=AVX512_CORE: the CPU has AVX512_BF16 but oneDNN may not
    # use it and refuses to generate the bf16 kernel; kt_ops asks oneDNN (a
    # probe call) instead of trusting CPUID, and streams.
    if not brgemm_runs():
        pytest.skip("oneDNN's bf16 brgemm does not run on this CPU / torch")
    code = (
        "import torch, kt_ops\n"
        "from reference import make_expert_weights, make_hidden, make_routing\n"
        "kt_ops.set_compute_path('brgemm')\n"
        "print(kt_ops.compute_paths()['bf16']['brgemm_kernel'])\n"
        "e = make_expert_weights(4, 40, 24)\n"
        "ids, w = make_routing(20, 4, 2)\n"
        "print(bool(torch.isfinite(kt_ops.moe_forward(make_hidden(20, 40), ids, w, e)).all()))\n"
    )
    proc = python_subprocess(code, env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None", "True"]


# --------------------------------------------------------------------------
# Against the reference, every path
# --------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("T", [0, 1, 5, 40])
def test_token_counts(isa, path, T):
    # 8 experts, top-2: at T = 1 and 5 some experts get no tokens.
    experts = make_expert_weights(8, 130, 70, seed=1)
    ids, w = make_routing(T, 8, 2, seed=T)
    check_path(path, make_hidden(T, 130, seed=T), ids, w, experts)


@pytest.mark.parametrize("path", ["streaming", "brgemm"])
@pytest.mark.parametrize(
    "H,I", [(1, 1), (2, 3), (15, 17), (17, 15), (33, 17), (64, 48), (130, 70), (31, 33)]
)  # fmt: skip
def test_odd_sizes(isa, path, H, I):  # noqa: E741
    E, K, T = 5, 2, 37
    experts = make_expert_weights(E, H, I, seed=H * 100 + I)
    ids, w = make_routing(T, E, K, seed=H + I)
    check_path(path, make_hidden(T, H, torch.float32, seed=H), ids, w, experts)


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_activation_dtypes_on_brgemm(isa, act_dtype):
    experts = make_expert_weights(4, 96, 80, seed=7)
    ids, w = make_routing(33, 4, 2, seed=7)
    check_path("brgemm", make_hidden(33, 96, act_dtype, seed=7), ids, w, experts)


def test_tiles_larger_than_one_brgemm_call(isa):
    # Experts with more rows than one brgemm call takes (64): full tiles + remainder.
    E, H, I, K, T = 3, 48, 40, 2, 200  # noqa: E741
    experts = make_expert_weights(E, H, I, seed=11)
    ids, w = make_routing(T, E, K, seed=11)
    assert int(torch.bincount(ids.flatten()).max()) > 128
    check_path("brgemm", make_hidden(T, H, seed=11), ids, w, experts)


def test_skipped_slots_and_unused_experts(isa):
    E, H, I, K, T = 10, 64, 48, 3, 50  # noqa: E741
    experts = make_expert_weights(E, H, I, seed=2)
    ids, w = make_routing(T, 6, K, seed=2, skip_fraction=0.3, skip_rows=(0, 7))  # experts 6..9 idle
    for path in ("streaming", "brgemm"):
        check_path(path, make_hidden(T, H, seed=2), ids, w, experts)


def test_brgemm_reference_is_not_vacuous(isa):
    # brgemm differs from the unrounded fp32 reference by more than TOL_BF16:
    # the bf16-rounding reference is what makes its tolerance tight.
    if not brgemm_runs():
        pytest.skip("oneDNN's bf16 brgemm does not run here")
    experts = make_expert_weights(4, 256, 128, seed=5)
    ids, w = make_routing(40, 4, 2, seed=5)
    x = make_hidden(40, 256, torch.float32, seed=5)
    out = run("brgemm", x, ids, w, experts)
    assert mismatch_report(out, reference_moe_forward(x, ids, w, experts), TOL_BF16) is not None
    ref = reference_moe_forward(x, ids, w, experts, bf16_activations=True)
    assert_matches_reference(out, ref, TOL_BF16_BRGEMM)


def test_brgemm_forced_where_it_does_not_run_is_streaming(isa):
    # Forcing 'brgemm' on an ISA path / format without a brgemm kernel keeps the streaming
    # kernels, bit for bit: q4_0, nvfp4 and the k-quants have none anywhere; bf16, int8,
    # int4, q8_0 and mxfp4 where this ISA path (and oneDNN's class) has none.
    E, H, I, K, T = 4, 256, 256, 2, 30  # noqa: E741 (k-quants: K a multiple of 256)
    candidates = ["q4_0", "nvfp4", "q4_k", "bf16", "int8", "int4", "q8_0", "mxfp4"]
    fmts = [fmt for fmt in candidates if not brgemm_runs(fmt)]
    assert fmts[:3] == ["q4_0", "nvfp4", "q4_k"]
    for fmt in fmts:
        experts = make_expert_weights(E, H, I, seed=4, weight_format=fmt)
        ids, w = make_routing(T, E, K, seed=4)
        x = make_hidden(T, H, seed=4)
        assert torch.equal(run("brgemm", x, ids, w, experts), run("streaming", x, ids, w, experts))


# --------------------------------------------------------------------------
# The bf16 kernels of the brgemm path: kt_ops' vdpbf16ps tiles and oneDNN's brgemm
# --------------------------------------------------------------------------


def kt_bf16_kernel_runs() -> bool:
    """Whether kt_ops' own bf16 tile kernel runs here when forced (AVX512_BF16 CPU)."""
    with kt_ops.use_compute_path("brgemm"), kt_ops.use_brgemm_bf16_kernel("kt"):
        return kt_ops.compute_paths()["bf16"]["brgemm_kernel"] == "avx512_bf16/bf16_dp"


@functools.cache
def onednn_sums_in_kt_order() -> bool:
    """Whether oneDNN's bf16 brgemm sums in kt_ops' order in this process.

    kt_ops' tiles run one ``vdpbf16ps`` chain per output over the k pairs; so does
    oneDNN's AVX512_BF16 kernel (bit-identical, checked on Zen 4), also under the
    AVX10_1_512 class (AVX512_FP16; checked on an Intel Xeon without AMX). On AMX oneDNN
    accumulates tile rows of 32 products in the tiles' own order, and the class it
    runs is the CPU's capped by ONEDNN_MAX_CPU_ISA (tests/onednn_isa.py). Where the
    orders differ the two kernels are each held to the reference instead
    (``TOL_BF16_BRGEMM``: the same bf16 products, fp32 sums in another order).
    """
    return onednn_isa.onednn_isa() in ("AVX512_CORE_BF16", "AVX10_1_512")


def assert_same_sums_or_reference(got, want, ref_of) -> None:
    """``got`` (kt_ops' kernel) equals ``want`` (oneDNN's) bit for bit where the two
    sum in the same order; elsewhere both match ``ref_of()`` within TOL_BF16_BRGEMM."""
    if onednn_sums_in_kt_order():
        assert torch.equal(got, want)
        return
    ref = ref_of()
    assert_matches_reference(got, ref, TOL_BF16_BRGEMM)
    assert_matches_reference(want, ref, TOL_BF16_BRGEMM)


def test_set_get_use_brgemm_bf16_kernel():
    assert kt_ops.get_brgemm_bf16_kernel() == "auto"
    for name in ("onednn", "kt", "auto"):
        with kt_ops.use_brgemm_bf16_kernel(name):
            assert kt_ops.get_brgemm_bf16_kernel() == name
    assert kt_ops.get_brgemm_bf16_kernel() == "auto"
    with pytest.raises(ValueError, match=r"set_brgemm_bf16_kernel: name must be .*'AMX'"):
        kt_ops.set_brgemm_bf16_kernel("AMX")
    assert kt_ops.get_brgemm_bf16_kernel() == "auto"


def test_brgemm_bf16_kernel_reported():
    if not brgemm_runs():
        pytest.skip("the bf16 brgemm path does not run here")
    feats = kt_ops.info()["cpu_features"]
    with kt_ops.use_compute_path("brgemm"):
        with kt_ops.use_brgemm_bf16_kernel("onednn"):
            assert kt_ops.compute_paths()["bf16"]["brgemm_kernel"] == "onednn/brgemm_bf16"
        with kt_ops.use_brgemm_bf16_kernel("auto"):
            want = "avx512_bf16/bf16_dp" if feats["avx512_bf16"] and not feats["amx"] else None
            if want is not None:
                assert kt_ops.compute_paths()["bf16"]["brgemm_kernel"] == want
    assert kt_bf16_kernel_runs() == bool(feats["avx512_bf16"])


@pytest.mark.parametrize(
    "H,I,T,E", [(2048, 96, 90, 2), (130, 70, 150, 3), (33, 17, 61, 2), (96, 40, 400, 4)]
)  # fmt: skip
def test_kt_and_onednn_bf16_kernels_bit_identical(isa, H, I, T, E):  # noqa: E741
    # Tokens per expert across the kt kernel's tiles (28 rows: 27, 28, 29,
    # 56, 57, ... and > 64, oneDNN's call size); H = 2048 is the row stride
    # that is a multiple of 4 KiB.
    if not (brgemm_runs() and kt_bf16_kernel_runs()):
        pytest.skip("needs the bf16 brgemm path and an AVX512_BF16 CPU")
    experts = make_expert_weights(E, H, I, seed=H + T)
    ids, w = make_routing(T, E, 2, seed=T)
    x = make_hidden(T, H, seed=H)
    outs = {}
    for name in ("onednn", "kt"):
        with kt_ops.use_brgemm_bf16_kernel(name):
            outs[name] = check_path("brgemm", x, ids, w, experts)  # each against the reference
    if onednn_sums_in_kt_order():
        assert torch.equal(outs["kt"], outs["onednn"])


@pytest.mark.parametrize(
    "H,I,T,E", [(2048, 40, 150, 2), (130, 70, 61, 3), (33, 16, 90, 2)]
)  # fmt: skip
def test_onednn_bf16_block_pairs(isa, H, I, T, E):  # noqa: E741
    # oneDNN's bf16 kernel with its blocks in pairs (one N = 32 call on two interleaved
    # blocks, the results kept for the pair's other block; KT_OPS_BRGEMM_BF16_PAIRS):
    # I = 40 and 70 have an odd block count (the last block alone), I = 16 one block;
    # experts past the 64-row call size. Each output is the same k chain as with N = 16:
    # bit-identical where oneDNN sums in k order, else each against the reference; the
    # same bits at 1, 2 and 3 threads (a pair split between two threads' runs is
    # computed by both).
    if not brgemm_runs():
        pytest.skip("needs the bf16 brgemm path")
    experts = make_expert_weights(E, H, I, seed=H + I)
    ids, w = make_routing(T, E, 2, seed=T)
    x = make_hidden(T, H, seed=I)
    outs = {}
    with kt_ops.use_brgemm_bf16_kernel("onednn"):
        for pairs in (False, True):
            before = kt_ops._C._testing.set_brgemm_bf16_pairs(pairs)
            try:
                got = []
                for n in THREAD_COUNTS:
                    kt_ops.set_num_threads(n)
                    got.append(check_path("brgemm", x, ids, w, experts))
                    assert torch.equal(got[-1], got[0]), f"pairs={pairs}, {n} threads"
            finally:
                kt_ops._C._testing.set_brgemm_bf16_pairs(before)
            outs[pairs] = got[0]
    if onednn_sums_in_kt_order():
        assert torch.equal(outs[True], outs[False])


def amx_bf16_tiles_run() -> bool:
    with kt_ops.use_compute_path("brgemm"):
        return kt_ops.compute_paths()["bf16"]["brgemm_kernel"] == "amx/bf16_tiles"


@pytest.mark.parametrize(
    "H,I,T,E",
    [(2048, 96, 90, 2), (96, 48, 37, 3), (130, 70, 150, 3), (33, 17, 61, 2), (64, 16, 1, 2)],
)
def test_amx_bf16_tiles(isa, H, I, T, E):  # noqa: E741
    # kt_ops' AMX tiles (kernels/avx512/bf16_amx.cpp): token tiles of 32 rows (one or two
    # A tiles: 1, 17-31, > 32 tokens per expert), blocks in pairs (odd block counts: I =
    # 48, 70, 17), k tails (H = 130, 33: zero-padded copies). Each against the reference;
    # the same bits at 1, 2 and 3 threads; bit-identical to oneDNN's AMX kernel where k is a
    # multiple of 32 (both one tile chain over k in order; the tails sum in other orders).
    if not amx_bf16_tiles_run():
        pytest.skip("needs an AMX CPU, an AVX-512 path and the bf16 brgemm path")
    experts = make_expert_weights(E, H, I, seed=H + I + T)
    ids, w = make_routing(T, E, min(2, E), seed=T)
    x = make_hidden(T, H, seed=I)
    got = []
    for n in THREAD_COUNTS:
        kt_ops.set_num_threads(n)
        got.append(check_path("brgemm", x, ids, w, experts))
        assert torch.equal(got[-1], got[0]), f"{n} threads"
    with kt_ops.use_brgemm_bf16_kernel("onednn"):
        onednn = check_path("brgemm", x, ids, w, experts)
    if H % 32 == 0 and onednn_isa.onednn_isa() == "AVX512_CORE_AMX":
        assert torch.equal(got[0], onednn)


@pytest.mark.parametrize("m", [1, 2, 13, 27, 28, 29, 55, 56, 57, 84, 85, 113])
def test_kt_bf16_kernel_tiles(isa, m):
    # One expert with m tokens: every tile split of the kt kernel, 1/2/3 threads.
    if not (brgemm_runs() and kt_bf16_kernel_runs()):
        pytest.skip("needs the bf16 brgemm path and an AVX512_BF16 CPU")
    H, I = 100, 36  # noqa: E741
    experts = make_expert_weights(2, H, I, seed=m)
    ids = torch.zeros(m, 1, dtype=torch.long)
    w = torch.ones(m, 1)
    x = make_hidden(m, H, torch.float32, seed=m)
    with kt_ops.use_brgemm_bf16_kernel("onednn"):
        want = run("brgemm", x, ids, w, experts)
    with kt_ops.use_brgemm_bf16_kernel("kt"):
        got = []
        for n in THREAD_COUNTS:
            kt_ops.set_num_threads(n)
            got.append(check_path("brgemm", x, ids, w, experts))
            assert torch.equal(got[-1], got[0]), f"{n} threads"  # kt_ops' own order
    assert_same_sums_or_reference(
        got[0], want, lambda: reference_moe_forward(x, ids, w, experts, bf16_activations=True)
    )


# --------------------------------------------------------------------------
# 'auto': the switch-over threshold
# --------------------------------------------------------------------------


def test_auto_threshold(isa):
    # Top-1 routing: expert e gets exactly counts[e] tokens (around the
    # threshold), and each token's output depends only on its expert, so each
    # token must equal the path its expert takes under 'auto'.
    min_tokens = bf16_min_tokens() or 12
    counts = [1, min_tokens - 1, min_tokens, min_tokens + 1, 2 * min_tokens]
    E, H, I = len(counts), 72, 40  # noqa: E741
    experts = make_expert_weights(E, H, I, seed=9)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(9))]
    T = ids.numel()
    ids = ids.view(T, 1)
    w = torch.rand(T, 1, generator=torch.Generator().manual_seed(9)) + 0.5
    x = make_hidden(T, H, torch.bfloat16, seed=9)
    outs = {path: run(path, x, ids, w, experts) for path in PATHS}
    # fp32 and fp16 activations stay exact under 'auto': the streaming kernels.
    for dtype in (torch.float32, torch.float16):
        xd = x.to(dtype)
        assert torch.equal(run("auto", xd, ids, w, experts), run("streaming", xd, ids, w, experts))
    on_brgemm = brgemm_runs() and bf16_min_tokens() is not None
    for e, c in enumerate(counts):
        rows = (ids[:, 0] == e).nonzero().flatten()
        want = "brgemm" if on_brgemm and c >= min_tokens else "streaming"
        assert torch.equal(outs["auto"][rows], outs[want][rows]), (e, c, want)
    tile = BRGEMM_KERNELS["bf16"]
    assert_plan_follows_threshold(experts, counts, tile, bf16_min_tokens(), True)
    assert_plan_follows_threshold(experts, counts, tile, None, False)  # fp32 activations
    forced = brgemm_runs()  # forced 'brgemm' runs the tiles wherever they exist
    ref = reference_moe_forward(x, ids, w, experts, bf16_activations=forced)
    assert_matches_reference(outs["brgemm"], ref, TOL_BF16_BRGEMM if forced else TOL_BF16)


# --------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------


def assert_thread_counts_bit_identical(path, x, ids, w, experts):
    """The op on ``path`` gives the same bits at every count of THREAD_COUNTS."""
    outs = {}
    for n in THREAD_COUNTS:
        kt_ops.set_num_threads(n)
        outs[n] = run(path, x, ids, w, experts)
    for n in THREAD_COUNTS:
        assert torch.equal(outs[n], outs[THREAD_COUNTS[0]]), f"{n} threads differ"


@pytest.mark.parametrize("path", PATHS)
def test_thread_counts_bit_identical(isa, path):
    E, H, I, K, T = 6, 130, 70, 2, 150  # ~50 tokens per expert, some past one 64-row call  # noqa: E741
    experts = make_expert_weights(E, H, I, seed=6)
    ids, w = make_routing(T, E, K, seed=6)
    x = make_hidden(T, H, torch.float32, seed=6)
    assert_thread_counts_bit_identical(path, x, ids, w, experts)


def test_repeated_and_interleaved_calls_bit_identical(isa):
    # The brgemm path keeps gathered rows per thread between blocks of one
    # call; a later call (other experts, other tokens) must never reuse them.
    a = make_expert_weights(4, 64, 48, seed=1)
    ids_a, w_a = make_routing(40, 4, 2, seed=1)
    ids_b, w_b = make_routing(41, 4, 2, seed=2)
    x_a = make_hidden(40, 64, torch.float32, seed=1)
    x_b = make_hidden(41, 64, torch.float32, seed=2)
    with kt_ops.use_compute_path("brgemm"):
        first = kt_ops.moe_forward(x_a, ids_a, w_a, a)
        for _ in range(2):
            kt_ops.moe_forward(x_b, ids_b, w_b, a)
            assert torch.equal(kt_ops.moe_forward(x_a, ids_a, w_a, a), first)


# --------------------------------------------------------------------------
# int8 and q8_0: the u8s8 brgemm
# --------------------------------------------------------------------------

#: (format, H, I): sizes that are not multiples of a 16-row block or of a
#: 64-row token tile; q8_0 needs K (H and I) in multiples of 32.
Q8_SHAPES = [
    ("int8", 1, 1),
    ("int8", 17, 15),
    ("int8", 130, 70),
    ("int8", 33, 200),
    ("q8_0", 32, 32),
    ("q8_0", 160, 96),
    ("q8_0", 96, 224),
]


def q8_min_tokens(fmt: str) -> int | None:
    with kt_ops.use_compute_path("auto"):
        return kt_ops.compute_paths()[fmt]["brgemm_min_tokens"]


def check_q8(path: str, x, ids, w, experts, *, quant: str = "q8"):
    """Run ``path`` under ``quant`` activations; check against the q8 reference."""
    with kt_ops.use_quant_activations(quant):
        out = run(path, x, ids, w, experts)
        ref = reference_for(experts, x, ids, w)
    assert out.dtype == x.dtype and out.shape == x.shape
    msg = quant_mismatch_report(out, ref)
    assert msg is None, f"{experts.weight_format} {path}: {msg}"
    return out


def streaming_q8(x, ids, w, experts):
    with kt_ops.use_quant_activations("q8"):
        return run("streaming", x, ids, w, experts)


@pytest.mark.parametrize("fmt", Q8_BRGEMM_FORMATS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("T", [0, 1, 5, 40])
def test_q8_formats_token_counts(isa, fmt, path, T):
    # 8 experts, top-2: at T = 1 and 5 some experts get no tokens.
    experts = make_quant_experts(fmt, 8, 160, 96, seed=1)
    ids, w = make_routing(T, 8, 2, seed=T)
    x = make_hidden(T, 160, seed=T)
    out = check_q8(path, x, ids, w, experts)
    if isa not in ("ref",):  # the SIMD tiers' q8 fold: the same bits on every path
        assert torch.equal(out, streaming_q8(x, ids, w, experts))


@pytest.mark.parametrize("path", ["streaming", "brgemm"])
@pytest.mark.parametrize("fmt,H,I", Q8_SHAPES)
def test_q8_formats_odd_sizes(isa, path, fmt, H, I):  # noqa: E741
    E, K, T = 5, 2, 37
    experts = make_quant_experts(fmt, E, H, I, seed=H * 100 + I)
    ids, w = make_routing(T, E, K, seed=H + I)
    check_q8(path, make_hidden(T, H, torch.float32, seed=H), ids, w, experts)


@pytest.mark.parametrize("fmt", Q8_BRGEMM_FORMATS)
def test_q8_formats_bit_identical_to_streaming_q8(isa, fmt):
    # The u8s8 brgemm's int32 sums are exact and it folds them as the
    # streaming kernels do: forced brgemm == streaming q8, bit for bit, for
    # every activation dtype, experts past one 64-row call, and under either
    # quant mode ('auto' does not send brgemm experts to the fp32 path).
    if isa == "ref":
        pytest.skip("the scalar ref tier folds without FMAs (and brgemm does not run on it)")
    E, H, I, K, T = 3, 96, 160, 2, 200  # noqa: E741
    experts = make_quant_experts(fmt, E, H, I, seed=12)
    ids, w = make_routing(T, E, K, seed=12)
    assert int(torch.bincount(ids.flatten()).max()) > 128  # full 64-row tiles + remainder
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = make_hidden(T, H, dtype, seed=12)
        want = streaming_q8(x, ids, w, experts)
        # Where brgemm does not run, 'brgemm' under quant 'auto' streams on the fp32 path;
        # int8 under 'auto' takes the w8a8 kernel (per-token activations, its own section).
        on_u8s8 = brgemm_runs(fmt) and BRGEMM_KERNELS[fmt] == "onednn/brgemm_u8s8"
        for quant in ("q8", "auto") if on_u8s8 else ("q8",):
            with kt_ops.use_quant_activations(quant):
                assert torch.equal(run("brgemm", x, ids, w, experts), want), (dtype, quant)


def test_q8_formats_mixed_per_projection(isa):
    # Mixed formats per projection: int8 and q8_0 (per-channel and per-32 scales) in one
    # call, each projection against its own reference part. (bf16 next to int8 and fp8:
    # test_fp8_mixed_with_bf16_and_int8_projections.)
    experts = make_quant_experts("int8,q8_0,int8", 4, 96, 64, seed=13)
    ids, w = make_routing(60, 4, 2, seed=13)
    x = make_hidden(60, 96, seed=13)
    for path in PATHS:
        check_q8(path, x, ids, w, experts)


@pytest.mark.parametrize("fmt", Q8_BRGEMM_FORMATS)
def test_q8_formats_skipped_slots_and_unused_experts(isa, fmt):
    E, H, I, K, T = 10, 64, 96, 3, 50  # noqa: E741
    experts = make_quant_experts(fmt, E, H, I, seed=2)
    ids, w = make_routing(T, 6, K, seed=2, skip_fraction=0.3, skip_rows=(0, 7))  # experts 6..9 idle
    for path in ("streaming", "brgemm"):
        check_q8(path, make_hidden(T, H, seed=2), ids, w, experts)


@pytest.mark.parametrize("fmt", Q8_BRGEMM_FORMATS)
def test_q8_formats_auto_threshold(isa, fmt):
    # Top-1 routing: expert e gets exactly counts[e] tokens around the
    # threshold; each token must equal the path its expert takes under 'auto'
    # (activations of any dtype: the u8s8 brgemm takes q8 records either way).
    # q8_0's u8s8 brgemm gives the streaming kernels' bits, so the plan's own
    # choice (planned_kernels) is checked as well as the outputs.
    min_tokens = q8_min_tokens(fmt) or 16
    counts = [1, min_tokens - 1, min_tokens, min_tokens + 1, 2 * min_tokens]
    E, H, I = len(counts), 96, 64  # noqa: E741
    experts = make_quant_experts(fmt, E, H, I, seed=9)
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(9))]
    T = ids.numel()
    ids = ids.view(T, 1)
    w = torch.rand(T, 1, generator=torch.Generator().manual_seed(9)) + 0.5
    on_brgemm = brgemm_runs(fmt) and q8_min_tokens(fmt) is not None
    for dtype in (torch.bfloat16, torch.float32):
        x = make_hidden(T, H, dtype, seed=9)
        outs = {path: run(path, x, ids, w, experts) for path in PATHS}  # quant 'auto'
        for e, c in enumerate(counts):
            rows = (ids[:, 0] == e).nonzero().flatten()
            want = "brgemm" if on_brgemm and c >= min_tokens else "streaming"
            assert torch.equal(outs["auto"][rows], outs[want][rows]), (dtype, e, c, want)
        check_q8("auto", x, ids, w, experts, quant="auto")
        assert_plan_follows_threshold(
            experts,
            counts,
            BRGEMM_KERNELS[fmt],
            q8_min_tokens(fmt) if on_brgemm else None,
            dtype == torch.bfloat16,
        )


@pytest.mark.parametrize("fmt", Q8_BRGEMM_FORMATS)
@pytest.mark.parametrize("path", ["brgemm", "auto"])
def test_q8_formats_thread_counts_bit_identical(isa, fmt, path):
    E, H, I, K, T = 6, 160, 96, 2, 150  # noqa: E741  (~50 tokens per expert)
    experts = make_quant_experts(fmt, E, H, I, seed=6)
    ids, w = make_routing(T, E, K, seed=6)
    x = make_hidden(T, H, torch.float32, seed=6)
    assert_thread_counts_bit_identical(path, x, ids, w, experts)


def test_q8_formats_repeated_and_interleaved_calls_bit_identical(isa):
    # Gathered u8 rows are kept per thread, per (call, phase, expert).
    a = make_quant_experts("int8", 4, 64, 96, seed=1)
    ids_a, w_a = make_routing(40, 4, 2, seed=1)
    ids_b, w_b = make_routing(41, 4, 2, seed=2)
    x_a = make_hidden(40, 64, torch.float32, seed=1)
    x_b = make_hidden(41, 64, torch.float32, seed=2)
    with kt_ops.use_compute_path("brgemm"):
        first = kt_ops.moe_forward(x_a, ids_a, w_a, a)
        for _ in range(2):
            kt_ops.moe_forward(x_b, ids_b, w_b, a)
            assert torch.equal(kt_ops.moe_forward(x_a, ids_a, w_a, a), first)


def test_q8_brgemm_needs_q8_activations():
    # set_quant_activations('fp32') turns q8 activations off: no 8-bit brgemm runs
    # even when forced. q8_0 takes the exact qint tiles where they run (the qint exact
    # section below), else streams (the weight-only fp32 path); int8 (per channel)
    # takes its exact bf16 kernel where it runs (the int8_bf16 section below).
    experts = make_quant_experts("q8_0", 4, 64, 96, seed=3)
    ids, w = make_routing(30, 4, 2, seed=3)
    x = make_hidden(30, 64, seed=3)
    with kt_ops.use_quant_activations("fp32"):
        with kt_ops.use_compute_path("brgemm"):
            paths = kt_ops.compute_paths()
            assert paths["q8_0"]["brgemm_kernel"] in (None, "avx512_bf16/qint_dp_exact")
            # oneDNN's exact kernel, else the exact qint tiles (oneDNN capped below bf16)
            assert paths["int8"]["brgemm_kernel"] in (
                None,
                "amx/int8_bf16_tiles",
                "onednn/brgemm_int8_bf16",
                "avx512_bf16/qint_dp_exact",
            )
        if paths["q8_0"]["brgemm_kernel"] is None:
            want = run("streaming", x, ids, w, experts)
            assert torch.equal(run("brgemm", x, ids, w, experts), want)


def test_q8_formats_mkldnn_disabled_falls_back_to_streaming():
    experts = make_quant_experts("q8_0", 4, 64, 96, seed=3)
    ids, w = make_routing(30, 4, 2, seed=3)
    x = make_hidden(30, 64, seed=3)
    want = run("streaming", x, ids, w, experts)
    with torch.backends.mkldnn.flags(enabled=False):
        with kt_ops.use_compute_path("brgemm"):
            assert kt_ops.compute_paths()["q8_0"]["brgemm_kernel"] is None
        got = run("brgemm", x, ids, w, experts)
    assert torch.equal(got, want)


def test_onednn_limited_below_vnni_streams_int8(python_subprocess):
    # ONEDNN_MAX_CPU_ISA=AVX512_CORE: oneDNN refuses the u8s8 kernel; the
    # probe call finds out and int8 streams (bit-identical to streaming). Under quant
    # 'q8' (the u8s8 kernel's mode: no w8a8, whose kt_ops tiles need no oneDNN).
    if not brgemm_runs("int8"):
        pytest.skip("oneDNN's u8s8 brgemm does not run on this CPU / torch")
    code = (
        "import torch, kt_ops\n"
        "kt_ops.config.quant_activations = 'q8'\n"
        "from reference import make_quant_experts, make_hidden, make_routing\n"
        "print(kt_ops.compute_paths()['int8']['brgemm_kernel'])\n"
        "e = make_quant_experts('int8', 4, 40, 24)\n"
        "ids, w = make_routing(20, 4, 2)\n"
        "x = make_hidden(20, 40)\n"
        "kt_ops.set_compute_path('brgemm')\n"
        "a = kt_ops.moe_forward(x, ids, w, e)\n"
        "kt_ops.set_compute_path('streaming')\n"
        "print(torch.equal(a, kt_ops.moe_forward(x, ids, w, e)))\n"
    )
    proc = python_subprocess(code, env={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None", "True"]


# --------------------------------------------------------------------------
# int8 on the w8a8 brgemm: full-K calls on per-token int8 activations
# --------------------------------------------------------------------------
# Under quant 'auto' the int8 format (one scale per output channel) runs on
# full-K u8s8 calls with the activations quantized per token (one scale per
# row): the per-token rounding of reference.py (token_q8_activations), and the
# exact int32 sums. Not the q8 kernels' bits (their scales are per 32 k).


W8A8_KERNELS = ("amx/w8a8_tiles", "avx512_vnni/w8a8_dp", "onednn/brgemm_w8a8")


def w8a8_runs() -> bool:
    with kt_ops.use_compute_path("brgemm"):
        return kt_ops.compute_paths()["int8"]["brgemm_kernel"] in W8A8_KERNELS


def token_int8_kernels_here(fmt: str, kernels: tuple[str, ...]) -> list[str]:
    """The ``brgemm_bf16_kernel`` settings under which one of ``kernels`` computes ``fmt``
    here, one per kernel (kt_ops' AMX tiles under ``'auto'`` on AMX, its vpdpbusd tiles
    under ``'kt'`` on AVX512_VNNI, oneDNN's u8s8 brgemm under ``'onednn'``)."""
    found = {}
    for setting in ("kt", "onednn", "auto"):
        with kt_ops.use_compute_path("brgemm"), kt_ops.use_brgemm_bf16_kernel(setting):
            name = kt_ops.compute_paths()[fmt]["brgemm_kernel"]
        if name in kernels:
            found.setdefault(name, setting)
    return list(found.values())


def w8a8_kernels_here() -> list[str]:
    """The settings that run int8's w8a8 kernels here (:func:`token_int8_kernels_here`)."""
    return token_int8_kernels_here("int8", W8A8_KERNELS)


def check_w8a8(x, ids, w, experts):
    """Forced brgemm under quant 'auto' against the reference of what runs there."""
    with kt_ops.use_compute_path("brgemm"):
        out = kt_ops.moe_forward(x, ids, w, experts)
        ref = reference_for(experts, x, ids, w)
    assert out.dtype == x.dtype and out.shape == x.shape
    msg = quant_mismatch_report(out, ref)
    assert msg is None, msg
    return out


@pytest.mark.parametrize("T", [0, 1, 5, 40, 300])
@pytest.mark.parametrize("H,I", [(1, 1), (17, 15), (130, 70), (160, 96), (33, 200)])
def test_w8a8_against_the_per_token_reference(isa, H, I, T):  # noqa: E741
    # Odd sizes (not multiples of the 16-row block, the 32-k quad or the 64-row
    # token tile), T = 0 and 1, experts without tokens (6 experts, top-2 at T = 1
    # and 5), and at T = 300 experts past two 64-row tiles.
    experts = make_quant_experts("int8", 6, H, I, seed=H * 7 + I)
    ids, w = make_routing(T, 6, 2, seed=T + H)
    for setting in w8a8_kernels_here() or ["auto"]:
        with kt_ops.use_brgemm_bf16_kernel(setting):
            for dtype in (torch.bfloat16, torch.float32):
                check_w8a8(make_hidden(T, H, dtype, seed=T + I), ids, w, experts)


def test_w8a8_is_per_token_not_per_32(isa):
    # Not vacuous: with one outlier channel the per-token scale is 50x the per-32 one
    # of the other blocks, so the q8 reference (per 32) must NOT match, and the
    # per-token one must.
    if not w8a8_runs():
        pytest.skip("the w8a8 brgemm does not run on this ISA path / CPU / torch")
    E, H, I, T = 2, 256, 64, 30  # noqa: E741
    experts = make_quant_experts("int8", E, H, I, seed=5)
    ids, w = make_routing(T, E, 1, seed=5)
    x = make_hidden(T, H, torch.float32, seed=5)
    x[:, 7] = 50.0
    out = check_w8a8(x, ids, w, experts)
    with kt_ops.use_quant_activations("q8"):
        q8_ref = reference_for(experts, x, ids, w)
    assert quant_mismatch_report(out, q8_ref) is not None


def test_w8a8_only_under_quant_auto(isa):
    # 'q8' asks for the q8 kernels' bits (u8s8 on the q8 records), 'fp32' for
    # exact activations (no 8-bit brgemm: the codes as bf16 values times bf16 rows).
    if not w8a8_runs():
        pytest.skip("the w8a8 brgemm does not run on this ISA path / CPU / torch")
    with kt_ops.use_compute_path("brgemm"):
        kernels = {}
        for quant in ("auto", "q8", "fp32"):
            with kt_ops.use_quant_activations(quant):
                kernels[quant] = kt_ops.compute_paths()["int8"]["brgemm_kernel"]
    assert kernels == {
        "auto": BRGEMM_KERNELS["int8"],
        # the u8s8 kernel where oneDNN runs it (q8_0 has the same one)
        "q8": "onednn/brgemm_u8s8" if brgemm_runs("q8_0") else None,
        # exact activations: the codes as bf16 values, on the exact qint tiles where kt_ops'
        # bf16 tiles run (the same chain as oneDNN's AVX512_BF16 kernel, rows packed),
        # else on oneDNN's bf16 brgemm where it runs, else on the exact qint tiles (which
        # need AVX512_BF16, not oneDNN)
        "fp32": "avx512_bf16/qint_dp_exact"
        if qint_exact_runs("int8") and BRGEMM_KERNELS["bf16"] == "avx512_bf16/bf16_dp"
        else "amx/int8_bf16_tiles"  # kt_ops' AMX tiles where its bf16 AMX tiles run
        if BRGEMM_KERNELS["bf16"] == "amx/bf16_tiles" and brgemm_runs("bf16")
        else "onednn/brgemm_int8_bf16"
        if brgemm_runs("bf16")
        else ("avx512_bf16/qint_dp_exact" if qint_exact_runs("int8") else None),
    }


def test_w8a8_long_k_is_folded_per_chunk(isa):
    # The int32 sums wrap, so C[i] - C[comp] = sum q * w is exact while it fits in
    # int32: |q * w| <= 127 * 127, at most 131072 of them (brgemm.h, kW8A8MaxK).
    # K = 133376 codes at the extremes would exceed 2^31 in one call, so the
    # kernel folds K per chunk. Constant rows quantize to code 127 and every
    # weight to +-127: the largest sums there are.
    if not w8a8_runs():
        pytest.skip("the w8a8 brgemm does not run on this ISA path / CPU / torch")
    from kt_ops.formats import quantize_weights

    H, I, T = 133376, 16, 3  # noqa: E741
    sign = torch.ones(1, I, H)
    sign[:, 1::2] = -1.0  # half the channels all negative
    gate = quantize_weights(sign * 0.01, "int8")
    up = quantize_weights(torch.ones(1, I, H) * 0.01, "int8")
    down = quantize_weights(
        torch.randn(1, H, I, generator=torch.Generator().manual_seed(0)), "int8"
    )
    experts = kt_ops.ExpertWeights(gate, up, down)
    x = torch.full((T, H), 0.5)
    ids = torch.zeros(T, 1, dtype=torch.long)
    w = torch.ones(T, 1)
    for setting in w8a8_kernels_here():
        with kt_ops.use_compute_path("brgemm"), kt_ops.use_brgemm_bf16_kernel(setting):
            out = kt_ops.moe_forward(x, ids, w, experts)
            ref = reference_for(experts, x, ids, w)
        # The reference's own fp32 sums of 133376 equal terms are off by ~1e-4 (the
        # kernel's are exact integers); a wrapped int32 sum would be off by O(1).
        assert quant_mismatch_report(out, ref, Tolerance(compute=3e-3)) is None, setting


@pytest.mark.parametrize("m", [1, 2, 13, 27, 28, 29, 55, 56, 57, 64, 65, 84, 85, 130])
def test_kt_and_onednn_w8a8_kernels_bit_identical(isa, m):
    # kt_ops' vpdpbusd tiles (28-row tiles, near-equal splits: m = 29 is 15 + 14) and
    # oneDNN's u8s8 brgemm (64-row calls) both compute exact int32 sums of the same
    # per-token codes and apply the same epilogue operations: bit for bit the same, on
    # every CPU (integer sums have no order), at 1, 2 and 3 threads. K = 100 pads to
    # 128 (zero codes past k), I = 36 is not a multiple of 16 (a partial last block).
    kernels = w8a8_kernels_here()
    if len(kernels) < 2:
        pytest.skip(f"needs both w8a8 kernels (AVX512_VNNI CPU, oneDNN u8s8); here {kernels}")
    H, I = 100, 36  # noqa: E741
    experts = make_quant_experts("int8", 2, H, I, seed=m)
    ids = torch.zeros(m, 1, dtype=torch.long)
    w = torch.ones(m, 1)
    x = make_hidden(m, H, torch.float32, seed=m)
    x[0, 3] = 40.0  # one outlier row: its scale differs from the others'
    outs = {}
    for setting in kernels:
        with kt_ops.use_brgemm_bf16_kernel(setting):
            got = []
            for n in THREAD_COUNTS:
                kt_ops.set_num_threads(n)
                got.append(check_w8a8(x, ids, w, experts))
                assert torch.equal(got[-1], got[0]), f"{setting}, {n} threads"
            outs[setting] = got[0]
    first = next(iter(outs.values()))  # AMX: kt_ops' AMX tiles under 'auto' too
    assert all(torch.equal(o, first) for o in outs.values()), list(outs)


@pytest.mark.parametrize("path", ["brgemm", "auto"])
def test_w8a8_thread_counts_bit_identical(isa, path):
    E, H, I, K, T = 4, 160, 96, 2, 200  # noqa: E741  (~100 tokens per expert: 2 tiles)
    experts = make_quant_experts("int8", E, H, I, seed=8)
    ids, w = make_routing(T, E, K, seed=8)
    x = make_hidden(T, H, torch.bfloat16, seed=8)
    assert_thread_counts_bit_identical(path, x, ids, w, experts)


# --------------------------------------------------------------------------
# int4 per channel on kt_ops' w4a8 tiles: per-token int8 activations, full-K int32 sums
# --------------------------------------------------------------------------
# The unsigned 4-bit codes times the per-token codes, exact int32 sums over all of K,
# then the channel's scale (and zero). The reference: per-token int8 activations
# (token_q8_activations) times the dequantized weights. int4 with groups: oneDNN's w4a8
# (groups of 64 and up: one call per group, each group's sums times its scales) against
# the same reference; on kt_ops' tiles they stream on the q8 kernels, as g32 and q4_0 do
# on both, even when brgemm is forced: their reference is the q8 one
# (reference.token_int8_min_tokens_of), and their outputs the streaming bits.

#: (format, group size, symmetric): per channel (symmetric, zero points), int4 with
#: groups (oneDNN's w4a8 from g64; kt_ops' tiles stream them), q4_0 (streams).
W4A8_VARIANTS = [
    ("int4", 0, True),
    ("int4", 0, False),
    ("int4", 32, True),
    ("int4", 128, False),
    ("int4", 64, False),
    ("q4_0", None, True),
]
W4A8_IDS = [f"{f}-g{g}-{'sym' if s else 'zp'}" for f, g, s in W4A8_VARIANTS]


def w4a8_runs() -> bool:
    with kt_ops.use_compute_path("brgemm"):
        return kt_ops.compute_paths()["int4"]["brgemm_kernel"] in W4A8_KERNELS


def w4a8_kernels_here() -> list[str]:
    """The settings that run int4's w4a8 kernels here (:func:`token_int8_kernels_here`)."""
    return token_int8_kernels_here("int4", W4A8_KERNELS)


@pytest.mark.parametrize("variant", W4A8_VARIANTS, ids=W4A8_IDS)
@pytest.mark.parametrize("T", [0, 1, 40, 300])
@pytest.mark.parametrize("H,I", [(128, 64), (256, 160), (2048, 64)])
def test_w4a8_against_the_per_token_reference(isa, variant, H, I, T):  # noqa: E741
    # T = 0 and 1, experts without tokens (6 experts, top-2), experts past one 28-row
    # tile (T = 300: ~100 rows each); H = 2048 is the 4 KiB row stride. Forced brgemm
    # (any token count).
    if not w4a8_runs():
        pytest.skip("no w4a8 kernel runs on this ISA path / CPU")
    fmt, gs, sym = variant
    if gs and (H % gs or I % gs):
        pytest.skip("group size does not divide K")
    experts = make_quant_experts(fmt, 6, H, I, group_size=gs, symmetric=sym, seed=H + I + T)
    ids, w = make_routing(T, 6, 2, seed=T + H)
    for setting in w4a8_kernels_here():
        with kt_ops.use_brgemm_bf16_kernel(setting):
            with kt_ops.use_compute_path("brgemm"):  # the reference's own rule
                streams = token_int8_min_tokens_of(experts.gate) is None
            for dtype in (torch.bfloat16, torch.float32):
                x = make_hidden(T, H, dtype, seed=T + I)
                out = check_w8a8(x, ids, w, experts)
                if streams:  # the streaming q8 kernels, bit for bit
                    with kt_ops.use_quant_activations("q8"):
                        assert torch.equal(out, run("streaming", x, ids, w, experts))


@pytest.mark.parametrize("gs", [64, 128])
def test_onednn_w4a8_groups_are_per_token_and_per_group(isa, gs):
    # oneDNN's w4a8 on int4 with groups: not vacuous either way. One outlier channel
    # makes the per-token scale 50x the per-32 one elsewhere, so the q8 (per-32)
    # reference must NOT match, the per-token one must; and one group of each row scaled
    # 1000x (with zero points) makes a fold that took one group's scale for another
    # miss the reference by far more than its tolerance.
    if "onednn" not in w4a8_kernels_here():
        pytest.skip("oneDNN's w4a8 does not run on this ISA path / CPU / torch")
    experts = make_quant_experts("int4", 2, 256, 128, group_size=gs, symmetric=False, seed=gs)
    for p in (experts.gate, experts.up, experts.down):  # scales [E][blocks][groups][16]
        p.scales[:, :, p.scales.shape[2] // 2] *= 1000  # a group past the first
    ids, w = make_routing(30, 2, 1, seed=gs)
    x = make_hidden(30, 256, torch.float32, seed=gs)
    x[:, 7] = 50.0
    with kt_ops.use_brgemm_bf16_kernel("onednn"):
        out = check_w8a8(x, ids, w, experts)
        with kt_ops.use_quant_activations("q8"):
            q8_ref = reference_for(experts, x, ids, w)
    assert quant_mismatch_report(out, q8_ref) is not None


def test_w4a8_is_per_token_not_per_32(isa):
    # Not vacuous: one outlier channel makes the per-token scale 50x the per-32 one of
    # the other blocks, so the q8 (per-32) reference must NOT match, and the per-token
    # one must.
    if not w4a8_runs():
        pytest.skip("kt_ops' w4a8 tiles do not run on this ISA path / CPU")
    experts = make_quant_experts("int4", 2, 256, 128, group_size=0, seed=5)
    ids, w = make_routing(30, 2, 1, seed=5)
    x = make_hidden(30, 256, torch.float32, seed=5)
    x[:, 7] = 50.0
    out = check_w8a8(x, ids, w, experts)
    with kt_ops.use_quant_activations("q8"):
        q8_ref = reference_for(experts, x, ids, w)
    assert quant_mismatch_report(out, q8_ref) is not None


@pytest.mark.parametrize("variant", W4A8_VARIANTS[:5], ids=W4A8_IDS[:5])
@pytest.mark.parametrize("m", [1, 13, 28, 29, 57, 65, 85])
def test_w4a8_tiles_and_thread_counts(isa, variant, m):
    # One expert with m tokens: every tile split (28 rows: 29 is 15 + 14), the same
    # bits at 1, 2 and 3 threads (each output is its own chain in a fixed order).
    # Per channel, kt_ops' tiles and oneDNN's (64-row calls: 65 is 64 + 1) give the same
    # bits: the same exact int32 sums, the same fold. With groups (K = 128: 4, 2 or 1
    # group), oneDNN's per-group folds against the reference, kt_ops' tiles stream.
    if not w4a8_runs():
        pytest.skip("no w4a8 kernel runs on this ISA path / CPU")
    fmt, gs, sym = variant
    experts = make_quant_experts(fmt, 2, 128, 128, group_size=gs, symmetric=sym, seed=m)
    ids = torch.zeros(m, 1, dtype=torch.long)
    w = torch.ones(m, 1)
    x = make_hidden(m, 128, torch.float32, seed=m)
    first = None
    for setting in w4a8_kernels_here():
        with kt_ops.use_brgemm_bf16_kernel(setting):
            got = []
            for n in THREAD_COUNTS:
                kt_ops.set_num_threads(n)
                got.append(check_w8a8(x, ids, w, experts))
                assert torch.equal(got[-1], got[0]), f"{setting}, {n} threads"
            if gs == 0:
                first = got[0] if first is None else first
                assert torch.equal(got[0], first), f"{setting} against the other kernel"


@pytest.mark.parametrize("sym", [True, False], ids=["sym", "zp"])
@pytest.mark.parametrize("m", [1, 2, 27, 28, 29, 64, 65, 130])
def test_kt_and_onednn_w4a8_kernels_bit_identical(isa, sym, m):
    # kt_ops' tiles add vpdpbusd of the unsigned codes c onto -8 sum q (or 0 with zero
    # points); oneDNN's calls multiply the codes decoded to c - 8 with q + 128 and take
    # off the compensation row (plus 8 sum q with zero points): the same exact int32, the
    # same fold, so the same bits. K = 100 pads to 128 (codes of zero past k), I = 36 is
    # a partial last block, one outlier row has its own scale.
    kernels = w4a8_kernels_here()
    if len(kernels) < 2:
        pytest.skip(f"needs both w4a8 kernels (AVX512_VNNI CPU, oneDNN u8s8); here {kernels}")
    H, I = 100, 36  # noqa: E741
    experts = make_quant_experts("int4", 2, H, I, group_size=0, symmetric=sym, seed=m)
    ids = torch.zeros(m, 1, dtype=torch.long)
    w = torch.ones(m, 1)
    x = make_hidden(m, H, torch.float32, seed=m)
    x[0, 3] = 40.0
    outs = {}
    for setting in kernels:
        with kt_ops.use_brgemm_bf16_kernel(setting):
            outs[setting] = check_w8a8(x, ids, w, experts)
    first = next(iter(outs.values()))  # AMX: kt_ops' AMX tiles under 'auto' too
    assert all(torch.equal(o, first) for o in outs.values()), list(outs)


def test_w4a8_only_under_quant_auto(isa):
    if not w4a8_runs():
        pytest.skip("no w4a8 kernel runs on this ISA path / CPU")
    with kt_ops.use_compute_path("brgemm"):
        for quant in ("q8", "fp32"):
            # Under 'fp32', the exact qint tiles (bf16 activations) where they run.
            exact = quant == "fp32" and qint_exact_runs("int4")
            with kt_ops.use_quant_activations(quant):
                name = kt_ops.compute_paths()["int4"]["brgemm_kernel"]
                assert name == ("avx512_bf16/qint_dp_exact" if exact else None), quant
    with kt_ops.use_compute_path("brgemm"), kt_ops.use_brgemm_bf16_kernel("onednn"):
        int8 = kt_ops.compute_paths()["int8"]["brgemm_kernel"]
        int4 = kt_ops.compute_paths()["int4"]["brgemm_kernel"]
        # oneDNN's w4a8 wherever its w8a8 runs (the same calls on decoded codes).
        assert int4 == ("onednn/brgemm_w4a8" if int8 == "onednn/brgemm_w8a8" else None)


# --------------------------------------------------------------------------
# int8 on the bf16 brgemm, exact: quant 'fp32' (the LoRA forward on an int8 base)
# --------------------------------------------------------------------------
# Every int8 code is a bf16 value, so bf16 rows times the decoded block are exact
# products summed in fp32, the channel scales applied to the outputs: against an
# fp64 reference with the GLU output rounded to bf16 (the down projection's rows,
# as the bf16 tile path reads them), fp32 hidden states holding bf16 values.


def int8_bf16_runs() -> bool:
    """Whether int8 runs exactly on bf16 tiles under forced brgemm and quant 'fp32':
    oneDNN's bf16 brgemm on the decoded codes, or the exact qint tiles."""
    with kt_ops.use_compute_path("brgemm"), kt_ops.use_quant_activations("fp32"):
        return kt_ops.compute_paths()["int8"]["brgemm_kernel"] in (
            "amx/int8_bf16_tiles",
            "onednn/brgemm_int8_bf16",
            "avx512_bf16/qint_dp_exact",
        )


def bf16_h_reference(x, ids, w, experts):
    """fp64 MoE of the dequantized weights with the GLU output rounded to bf16."""
    from reference import dense_weights

    gate, up, down = (t.double() for t in dense_weights(experts))
    xd = x.double()
    out = torch.zeros(xd.shape, dtype=torch.float64)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        g, u = xd[tok] @ gate[e].T, xd[tok] @ up[e].T
        h = (torch.nn.functional.silu(g) * u).float().bfloat16().double()
        out.index_add_(0, tok, (h @ down[e].T) * w[tok, slot].double().unsqueeze(1))
    return out


@pytest.mark.parametrize("T", [0, 1, 6, 150])
@pytest.mark.parametrize("H,I", [(1, 1), (17, 15), (130, 70), (33, 200)])
def test_int8_bf16_exact_against_fp64(isa, H, I, T):  # noqa: E741
    if not int8_bf16_runs():
        pytest.skip("the bf16 brgemm does not run on this ISA path / CPU / torch")
    experts = make_quant_experts("int8", 5, H, I, seed=H + 3 * I)
    ids, w = make_routing(T, 5, 2, seed=T + 1)
    x = make_hidden(T, H, torch.bfloat16, seed=I).float()  # bf16 values, fp32 outputs
    with kt_ops.use_compute_path("brgemm"), kt_ops.use_quant_activations("fp32"):
        out = kt_ops.moe_forward(x, ids, w, experts)
    ref = bf16_h_reference(x, ids, w, experts)
    # fp32 sums of exact products, and h's bf16 roundings on either side of a boundary.
    assert_matches_reference(out, ref.float(), TOL_BF16_BRGEMM)


@pytest.mark.parametrize("T", [1, 27, 29, 150])
def test_amx_int8_exact_tiles(isa, T):
    # int8 under quant 'fp32' on kt_ops' AMX tiles (the codes decoded to bf16 per block,
    # gate and up in one pass, the channel scales on the outputs): the same bits at 1, 2
    # and 3 threads; against the fp64 reference with k tails (H = 130, I = 70), and
    # oneDNN's AMX kernel's bits where k is a multiple of 32 (H = 128, I = 64: both one
    # tile chain over k in order; oneDNN's kernel is held to the reference elsewhere, and
    # the reference's bf16 rounding of h can fall on either side of a tie there).
    with kt_ops.use_compute_path("brgemm"), kt_ops.use_quant_activations("fp32"):
        if kt_ops.compute_paths()["int8"]["brgemm_kernel"] != "amx/int8_bf16_tiles":
            pytest.skip("needs kt_ops' AMX tiles (an AMX CPU and oneDNN's AMX class)")
    for H, I in ((130, 70), (128, 64)):  # noqa: E741
        experts = make_quant_experts("int8", 4, H, I, seed=T)
        ids, w = make_routing(T, 4, 2, seed=T + 5)
        x = make_hidden(T, H, torch.bfloat16, seed=T).float()
        ref = bf16_h_reference(x, ids, w, experts).float()
        got = []
        with kt_ops.use_compute_path("brgemm"), kt_ops.use_quant_activations("fp32"):
            for n in THREAD_COUNTS:
                kt_ops.set_num_threads(n)
                got.append(kt_ops.moe_forward(x, ids, w, experts))
                assert torch.equal(got[-1], got[0]), f"{n} threads"
            with kt_ops.use_brgemm_bf16_kernel("onednn"):
                onednn = kt_ops.moe_forward(x, ids, w, experts)
        if H % 32 == 0:
            assert torch.equal(got[0], onednn)
        else:
            assert_matches_reference(got[0], ref, TOL_BF16_BRGEMM)


@pytest.mark.parametrize("T", [1, 27, 29, 150])
def test_int8_exact_kernels_bit_identical(isa, T):
    # int8 under quant 'fp32' takes the exact qint tiles where kt_ops' bf16 tiles run and
    # oneDNN's bf16 brgemm under brgemm_bf16_kernel = 'onednn': bf16(x) times the same
    # exact code values in one fp32 chain over k, then the channel scale, so the two give
    # the same bits where oneDNN sums in kt_ops' order (AVX512_BF16 without AMX); each is
    # held to the fp64 reference elsewhere.
    with kt_ops.use_compute_path("brgemm"), kt_ops.use_quant_activations("fp32"):
        with kt_ops.use_brgemm_bf16_kernel("onednn"):
            onednn = kt_ops.compute_paths()["int8"]["brgemm_kernel"]
        with kt_ops.use_brgemm_bf16_kernel("kt"):
            kt = kt_ops.compute_paths()["int8"]["brgemm_kernel"]
    if onednn != "onednn/brgemm_int8_bf16" or kt != "avx512_bf16/qint_dp_exact":
        pytest.skip("needs oneDNN's bf16 brgemm and the exact qint tiles (AVX512_BF16)")
    experts = make_quant_experts("int8", 4, 130, 70, seed=T)
    ids, w = make_routing(T, 4, 2, seed=T + 5)
    x = make_hidden(T, 130, torch.bfloat16, seed=T).float()
    ref = bf16_h_reference(x, ids, w, experts).float()
    outs = {}
    for name in ("onednn", "kt"):
        with kt_ops.use_brgemm_bf16_kernel(name), kt_ops.use_compute_path("brgemm"):
            with kt_ops.use_quant_activations("fp32"):
                outs[name] = kt_ops.moe_forward(x, ids, w, experts)
        assert_matches_reference(outs[name], ref, TOL_BF16_BRGEMM)
    if onednn_sums_in_kt_order():
        assert torch.equal(outs["kt"], outs["onednn"])


def test_int8_bf16_thread_counts_bit_identical(isa):
    with kt_ops.use_quant_activations("fp32"):
        experts = make_quant_experts("int8", 4, 96, 64, seed=4)
        ids, w = make_routing(120, 4, 2, seed=4)
        x = make_hidden(120, 96, torch.bfloat16, seed=4)
        assert_thread_counts_bit_identical("brgemm", x, ids, w, experts)


# --------------------------------------------------------------------------
# The other qint formats, exact: quant 'fp32' (the LoRA forward on a qint base)
# --------------------------------------------------------------------------
# Every code's value (q - offset, q beside explicit zeros, 2 e2m1(q), a signed byte) is
# a bf16 value, so bf16 rows times the decoded codes are exact products; each group's
# fp32 sums take the group's scales, minus its zeros times the group's sum of the rows
# (avx512_bf16/qint_dp_exact, kernels/avx512/qint_dp_avx512bf16.cpp). Against the fp64
# reference of the dequantized weights with the GLU output rounded to bf16, as the int8
# kernel above. Shapes from test_quant_forward.VARIANTS (every group size, zeros or
# not, N not a multiple of 16, several k-quant super-blocks per block); tokens per expert
# 0, 1 and around the kernel's 28-row tiles (27, 28, 29, 57).

#: The qint variants this kernel computes (int8 per channel has its own exact kernel; the
#: lattice-grid i-quants are decoded per block by the plan into int8 panels, which these
#: tiles do not read: under 'fp32' they stream, test_qint_exact_kernel_reported).
QINT_EXACT_VARIANTS = [
    v
    for v in QUANT_VARIANTS
    if v.fmt != "int8" and not v.fmt.startswith(("fp8", "mxfp8")) and v.fmt not in GRID_FORMATS
]
QINT_EXACT_COUNTS = [0, 1, 27, 28, 29, 57]


def qint_exact_runs(fmt: str) -> bool:
    """Whether kt_ops' exact qint tiles compute ``fmt`` under forced 'brgemm' and quant
    'fp32' (on kt_ops' bf16 kernel: mxfp4 has oneDNN's exact kernel first where oneDNN
    computes bf16, ``test_mxfp4_*`` below)."""
    with (
        kt_ops.use_compute_path("brgemm"),
        kt_ops.use_quant_activations("fp32"),
        kt_ops.use_brgemm_bf16_kernel("kt" if fmt == "mxfp4" else "auto"),
    ):
        return kt_ops.compute_paths()[fmt]["brgemm_kernel"] == "avx512_bf16/qint_dp_exact"


def test_qint_exact_kernel_reported(isa):
    # Where the CPU has AVX512_BF16, on the AVX-512 paths: forced 'brgemm' under quant
    # 'fp32' only (never under 'auto', whose tile kernels quantize the activations).
    bf16 = kt_ops.info()["cpu_features"]["avx512_bf16"] and isa != "avx2" and isa != "ref"
    for fmt in sorted({v.fmt for v in QINT_EXACT_VARIANTS}):
        assert qint_exact_runs(fmt) == bf16, fmt
        with kt_ops.use_compute_path("auto"), kt_ops.use_quant_activations("fp32"):
            got = kt_ops.compute_paths()[fmt]["brgemm_kernel"]
        # mxfp4's oneDNN kernel (AMX) decodes with AVX-512 code: not on the ref / avx2 tiers.
        tiles = isa not in ("ref", "avx2")
        assert got == (BRGEMM_KERNELS.get(fmt) if fmt == "mxfp4" and tiles else None), fmt
        with kt_ops.use_compute_path("brgemm"), kt_ops.use_quant_activations("auto"):
            assert kt_ops.compute_paths()[fmt]["brgemm_kernel"] != "avx512_bf16/qint_dp_exact"
    for fmt in GRID_FORMATS:
        assert not qint_exact_runs(fmt), fmt


@pytest.mark.parametrize("v", QINT_EXACT_VARIANTS, ids=lambda v: v.id)
def test_qint_exact_against_fp64(isa, v):
    if not qint_exact_runs(v.fmt):
        pytest.skip("the exact qint tiles need AVX512_BF16 and an AVX-512 path")
    experts = make_quant_experts(
        v.fmt,
        len(QINT_EXACT_COUNTS),
        v.H,
        v.I,
        group_size=v.group_size,
        symmetric=v.symmetric,
        seed=v.H + 3 * v.I,
    )
    ids, w = fp8_routing(QINT_EXACT_COUNTS, seed=v.H)
    x = make_hidden(ids.shape[0], v.H, torch.bfloat16, seed=v.I).float()  # bf16 values
    with kt_ops.use_compute_path("brgemm"), kt_ops.use_quant_activations("fp32"):
        out = kt_ops.moe_forward(x, ids, w, experts)
    ref = bf16_h_reference(x, ids, w, experts)
    # fp32 sums of exact products, and h's bf16 roundings on either side of a boundary.
    assert_matches_reference(out, ref.float(), TOL_BF16_BRGEMM)
    # Not the weight-only streaming path's result (fp32 h into the down projection).
    with kt_ops.use_compute_path("streaming"), kt_ops.use_quant_activations("fp32"):
        assert not torch.equal(kt_ops.moe_forward(x, ids, w, experts), out)


def test_int8_without_onednn_takes_the_exact_qint_tiles(isa):
    # int8 (per channel) has oneDNN's exact kernel first; with oneDNN off (mkldnn
    # disabled) the exact qint tiles take it (8-bit codes decoded by conversion, one
    # group over all of K), still exact against the fp64 reference.
    if not qint_exact_runs("int4"):
        pytest.skip("the exact qint tiles need AVX512_BF16 and an AVX-512 path")
    experts = make_quant_experts("int8", len(QINT_EXACT_COUNTS), 50, 40, seed=3)
    ids, w = fp8_routing(QINT_EXACT_COUNTS, seed=3)
    x = make_hidden(ids.shape[0], 50, torch.bfloat16, seed=4).float()
    with torch.backends.mkldnn.flags(enabled=False):
        assert qint_exact_runs("int8")
        with kt_ops.use_compute_path("brgemm"), kt_ops.use_quant_activations("fp32"):
            out = kt_ops.moe_forward(x, ids, w, experts)
    assert_matches_reference(out, bf16_h_reference(x, ids, w, experts).float(), TOL_BF16_BRGEMM)


@pytest.mark.parametrize("fmt", ["int4", "q4_k", "q6_k"])
def test_qint_exact_thread_counts_bit_identical(isa, fmt):
    with kt_ops.use_quant_activations("fp32"):
        experts = make_quant_experts(
            fmt,
            4,
            256,
            256,
            group_size=32 if fmt == "int4" else None,
            symmetric=fmt == "q6_k",
            seed=5,
        )
        ids, w = make_routing(120, 4, 2, seed=5)
        x = make_hidden(120, 256, torch.bfloat16, seed=5)
        assert_thread_counts_bit_identical("brgemm", x, ids, w, experts)


#: And groups longer than the tiles' 128-k decode chunks (one per channel over K = 200 and
#: 300: chunks of 128 and a shorter last one).
ROW_TILE_VARIANTS = [*QINT_EXACT_VARIANTS, Variant("int4", 0, False, 200, 300, "_long")]


@pytest.mark.parametrize("v", ROW_TILE_VARIANTS, ids=lambda v: v.id)
def test_qint_exact_rows_do_not_depend_on_their_tile(isa, v):
    # A token's output on the exact qint tiles is the same bits alone with its expert (a
    # tile of one row, which decodes the codes), beside one other token (two rows) and
    # inside a tile of 28 (29 tokens: a tile of 28, then one of a single row that reads
    # the codes the first decoded): each group's sum is one chain over its k pairs in
    # order, folded in group order, in every tile. (What a decode-shaped variant of the
    # tiles, e.g. groups' chains side by side for one row, must keep: the LoRA forward at
    # T = 1 computes what the training forward computed for that token.)
    if not qint_exact_runs(v.fmt):
        pytest.skip("the exact qint tiles need AVX512_BF16 and an AVX-512 path")
    experts = make_quant_experts(
        v.fmt, 1, v.H, v.I, group_size=v.group_size, symmetric=v.symmetric, seed=v.H + v.I
    )
    T = 29
    ids = torch.zeros(T, 1, dtype=torch.int64)
    w = torch.ones(T, 1)
    x = make_hidden(T, v.H, torch.bfloat16, seed=v.I).float()  # bf16 values, fp32 out
    with (
        kt_ops.use_compute_path("brgemm"),
        kt_ops.use_quant_activations("fp32"),
        kt_ops.use_brgemm_bf16_kernel("kt" if v.fmt == "mxfp4" else "auto"),
    ):
        full = kt_ops.moe_forward(x, ids, w, experts)
        for i in range(T):
            alone = kt_ops.moe_forward(x[i : i + 1], ids[:1], w[:1], experts)
            assert torch.equal(alone, full[i : i + 1]), i
        for i in range(0, T - 1, 2):
            pair = kt_ops.moe_forward(x[i : i + 2], ids[:2], w[:2], experts)
            assert torch.equal(pair, full[i : i + 2]), i
    assert_matches_reference(full, bf16_h_reference(x, ids, w, experts).float(), TOL_BF16_BRGEMM)


# --------------------------------------------------------------------------
# mxfp4 on oneDNN's bf16 brgemm: its exact values decoded to bf16 tiles
# --------------------------------------------------------------------------
# mxfp4's values e2m1 * 2^(E-127) are bf16 values for every exponent E in [2, 252], so per
# pair of 16-row blocks the codes and exponents decode into one bf16 tile and bf16 rows
# times it are exact products summed in fp32 (kernels/brgemm.h, mxfp4_dot): against the
# fp64 reference with the GLU output rounded to bf16, as the exact qint tiles above. It
# runs where oneDNN computes bf16 (AMX; forced here with use_brgemm_bf16_kernel('onednn')).
#: (H, I): N not a multiple of 16 or 32 (70, 17, 33: a pair's second block partial or
#: absent), K padded to 32 (70, 17, 33, 200); the Qwen3 shape's H.
MXFP4_SHAPES = [(96, 64), (160, 96), (2048, 200), (130, 70), (33, 17)]
#: Tokens per expert: none, 1, short tiles, one 64-row call and past it, two calls.
MXFP4_COUNTS = [0, 1, 5, 13, 31, 64, 65, 130]


def mxfp4_onednn_runs() -> bool:
    with kt_ops.use_compute_path("brgemm"), kt_ops.use_brgemm_bf16_kernel("onednn"):
        return kt_ops.compute_paths()["mxfp4"]["brgemm_kernel"] == MXFP4_KERNEL


def run_mxfp4_onednn(x, ids, w, experts, quant: str = "fp32"):
    with (
        kt_ops.use_compute_path("brgemm"),
        kt_ops.use_brgemm_bf16_kernel("onednn"),
        kt_ops.use_quant_activations(quant),
    ):
        assert kt_ops.compute_paths()["mxfp4"]["brgemm_kernel"] == MXFP4_KERNEL
        return kt_ops.moe_forward(x, ids, w, experts)


@pytest.mark.parametrize("quant", ["fp32", "auto"])
@pytest.mark.parametrize(("H", "I"), MXFP4_SHAPES)
def test_mxfp4_onednn_exact_against_fp64(isa, H, I, quant):  # noqa: E741
    if not mxfp4_onednn_runs():
        pytest.skip("oneDNN's bf16 brgemm does not run on this ISA path / CPU / torch")
    experts = make_quant_experts("mxfp4", len(MXFP4_COUNTS), H, I, seed=H + I)
    ids, w = fp8_routing(MXFP4_COUNTS, seed=H)
    x = make_hidden(ids.shape[0], H, torch.bfloat16, seed=I).float()  # bf16 values
    out = run_mxfp4_onednn(x, ids, w, experts, quant)
    # fp32 sums of exact products, and h's bf16 roundings on either side of a boundary.
    assert_matches_reference(out, bf16_h_reference(x, ids, w, experts).float(), TOL_BF16_BRGEMM)
    # Not the q8 streaming result (its activations quantized: ~1e-2 off).
    with kt_ops.use_compute_path("streaming"), kt_ops.use_quant_activations("auto"):
        q8 = kt_ops.moe_forward(x, ids, w, experts)
    assert not torch.allclose(q8, out, rtol=0, atol=1e-4 * float(out.abs().max()))


@pytest.mark.parametrize("value", [0, 1, 2])
def test_mxfp4_onednn_exponents_outside_bf16_take_the_exact_qint_tiles(isa, value):
    # The decode adds E - 127 to the bf16 exponent field of e2m1's values (126..129), exact
    # while E >= 2; at E = 0 or 1 (a scale flushed to zero, formats/qint.h) the add would
    # borrow into the sign bit and decode huge values. Such a block's pair is computed by
    # kt_ops' exact qint tiles instead; E = 2 still decodes (the smallest normal values).
    if not mxfp4_onednn_runs():
        pytest.skip("oneDNN's bf16 brgemm does not run on this ISA path / CPU / torch")
    H, I, counts = 160, 96, [5, 40, 0, 70]  # noqa: E741
    base = make_quant_experts("mxfp4", len(counts), H, I, seed=19)
    experts = mxfp8_with_exponent(base, 1, value, "mxfp4")
    ids, w = fp8_routing(counts, seed=19)
    x = make_hidden(ids.shape[0], H, torch.bfloat16, seed=19).float()
    out = run_mxfp4_onednn(x, ids, w, experts)
    assert torch.isfinite(out).all()
    assert_matches_reference(out, bf16_h_reference(x, ids, w, experts).float(), TOL_BF16_BRGEMM)


def test_mxfp4_onednn_and_exact_qint_tiles_agree(isa):
    # Both multiply bf16(x) by mxfp4's exact values and sum in fp32, in different orders:
    # they agree to fp32 rounding (not bit for bit), far inside the format's error.
    if not (mxfp4_onednn_runs() and qint_exact_runs("mxfp4")):
        pytest.skip("needs oneDNN's bf16 brgemm and kt_ops' exact qint tiles")
    H, I = 256, 96  # noqa: E741
    experts = make_quant_experts("mxfp4", len(MXFP4_COUNTS), H, I, seed=23)
    ids, w = fp8_routing(MXFP4_COUNTS, seed=23)
    x = make_hidden(ids.shape[0], H, torch.bfloat16, seed=23).float()
    out = run_mxfp4_onednn(x, ids, w, experts)
    with (
        kt_ops.use_compute_path("brgemm"),
        kt_ops.use_brgemm_bf16_kernel("kt"),
        kt_ops.use_quant_activations("fp32"),
    ):
        kt = kt_ops.moe_forward(x, ids, w, experts)
    torch.testing.assert_close(out, kt, rtol=0, atol=2e-5 * float(kt.abs().max()))


@pytest.mark.parametrize("ldb", [16, 32])
def test_mxfp4_tile_decode_of_every_code_and_exponent(ldb):
    # The decode: each E2M1 code c (all 16, both zeros) of row r at k as e2m1(c) *
    # 2^(E-127) in bf16, exactly (two significant bits), for every exponent E in [2, 252]
    # (both ends), at word ((k / 2) * ldb + r) * 2 + k % 2; -0 decodes as +0 (as the
    # scalar decoder). The low plane: byte j of row r's dword in line l holds code
    # 8 l + j in its low nibble and 8 l + 4 + j in its high one.
    if "avx512" not in kt_ops.supported_isas():
        pytest.skip("the decode is AVX-512 code")
    # OCP MX v1.0, section 5.3.3: E2M1 magnitudes, bit 3 the sign.
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
    e2m1 = torch.cat([e2m1, -e2m1])
    kp = 256 * 8  # 64 groups of 32 k: every exponent in [2, 252] at least once
    g = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 16, (16, kp), dtype=torch.uint8, generator=g)  # [row, k]
    codes[:, :16] = torch.arange(16, dtype=torch.uint8)  # every code in every row
    exps = torch.arange(2, 253).repeat(8)[: kp // 32 * 16].view(kp // 32, 16).to(torch.uint8)
    lines = codes.view(16, kp // 8, 2, 4)  # [row, line, half (low / high nibble), j]
    low = (lines[:, :, 0] | (lines[:, :, 1] << 4)).permute(1, 0, 2).contiguous()
    out = kt_ops._C._testing.mxfp4_block_to_bf16_vnni(
        low.numpy().tobytes(), exps.numpy().tobytes(), ldb
    )
    tile = torch.frombuffer(bytearray(out), dtype=torch.bfloat16).view(kp // 2, ldb, 2)
    scale = torch.exp2(exps.double() - 127).repeat_interleave(32, dim=0).T  # [row, k]
    values = e2m1[codes.long()] * scale + 0.0
    assert torch.equal(values.bfloat16().double(), values)  # bf16 values: exact
    want = values.bfloat16().T.reshape(kp // 2, 2, 16).transpose(1, 2)
    assert torch.equal(tile[:, :16].view(torch.int16), want.contiguous().view(torch.int16))
    assert not tile[:, 16:].view(torch.int16).any()  # the other columns untouched
    with pytest.raises(ValueError, match=r"len\(exponents\) must be len\(codes\) / 16"):
        kt_ops._C._testing.mxfp4_block_to_bf16_vnni(low.numpy().tobytes(), bytes(3))


def test_mxfp4_onednn_thread_counts_bit_identical(isa):
    if not mxfp4_onednn_runs():
        pytest.skip("oneDNN's bf16 brgemm does not run on this ISA path / CPU / torch")
    experts = make_quant_experts("mxfp4", 4, 256, 136, seed=29)
    ids, w = make_routing(150, 4, 2, seed=29)
    x = make_hidden(150, 256, torch.bfloat16, seed=29)
    with kt_ops.use_brgemm_bf16_kernel("onednn"), kt_ops.use_quant_activations("fp32"):
        assert_thread_counts_bit_identical("brgemm", x, ids, w, experts)


# --------------------------------------------------------------------------
# fp8: E4M3 decoded to bf16 tiles (scales folded in), then the bf16 brgemm
# --------------------------------------------------------------------------

#: (H, I): K not a multiple of 128 (H = 160, 2080: a partial last scale
#: block; I = 200, 70, 17), N not a multiple of 16 or 128 (I = 200, 70, 17; H
#: = 130, 33 for down).
FP8_SHAPES = [(160, 96), (2080, 200), (130, 70), (33, 17), (256, 136)]
#: Tokens per expert (top-1 routing, one expert each): none, 1, around the
#: 'auto' threshold (6) and one 64-row call, and past two calls.
FP8_COUNTS = [0, 1, 5, 6, 7, 11, 12, 13, 64, 65, 130]


def fp8_min_tokens() -> int | None:
    with kt_ops.use_compute_path("auto"):
        return kt_ops.compute_paths()["fp8"]["brgemm_min_tokens"]


def fp8_routing(counts: list[int], seed: int):
    """Top-1 routing in which expert e gets exactly counts[e] tokens, shuffled."""
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(seed))]
    T = ids.numel()
    w = torch.rand(T, 1, generator=torch.Generator().manual_seed(seed)) + 0.5
    return ids.view(T, 1), w


def bf16_twin(experts: kt_ops.ExpertWeights) -> kt_ops.ExpertWeights:
    """bf16 experts holding the fp8 experts' dequantized weights rounded to bf16."""
    from reference import dense_expert

    from kt_ops.formats import quantize_weights

    def one(p):
        dense = torch.stack([dense_expert(p, e) for e in range(p.weight.shape[0])])
        return quantize_weights(dense.bfloat16().float(), "bf16")

    return kt_ops.ExpertWeights(*(one(p) for p in experts.projections))


def check_fp8(path: str, x, ids, w, experts):
    """Run ``path`` on fp8 experts; check against the reference of what it computes."""
    out = run(path, x, ids, w, experts)
    assert out.dtype == x.dtype and out.shape == x.shape
    if path == "brgemm" and brgemm_runs("fp8"):
        ref = reference_moe_forward(
            x, ids, w, experts, bf16_activations=True, fp8_scaled_activations=True
        )
        assert_matches_reference(out, ref, TOL_BF16_BRGEMM)
    else:
        with kt_ops.use_compute_path(path):
            assert quant_mismatch_report(out, reference_for(experts, x, ids, w)) is None
    return out


@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel", "mxfp8"])
@pytest.mark.parametrize("path", ["streaming", "brgemm"])
@pytest.mark.parametrize("H,I", FP8_SHAPES)
def test_fp8_odd_sizes(isa, path, H, I, fmt):  # noqa: E741
    E, K, T = 5, 2, 37
    experts = make_quant_experts(fmt, E, H, I, seed=H * 100 + I)
    ids, w = make_routing(T, E, K, seed=H + I)
    for dtype in (torch.float32, torch.bfloat16):
        check_fp8(path, make_hidden(T, H, dtype, seed=H), ids, w, experts)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel", "mxfp8"])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp8_token_counts_per_expert(isa, act_dtype, fmt):
    # Experts with 0, 1, 7, 8, ... 130 tokens: forced paths against their
    # references, and 'auto' per expert: brgemm from the threshold for bf16
    # activations only (fp32 / fp16 ones keep their precision on streaming).
    experts = make_quant_experts(fmt, len(FP8_COUNTS), 160, 200, seed=21)
    ids, w = fp8_routing(FP8_COUNTS, seed=21)
    x = make_hidden(ids.shape[0], 160, act_dtype, seed=21)
    outs = {path: check_fp8(path, x, ids, w, experts) for path in ("streaming", "brgemm")}
    auto = run("auto", x, ids, w, experts)
    min_tokens = fp8_min_tokens()
    for e, c in enumerate(FP8_COUNTS):
        rows = (ids[:, 0] == e).nonzero().flatten()
        on_brgemm = (
            brgemm_runs("fp8")
            and act_dtype == torch.bfloat16
            and min_tokens is not None
            and c >= min_tokens
        )
        want = "brgemm" if on_brgemm else "streaming"
        assert torch.equal(auto[rows], outs[want][rows]), (e, c, want)


def fp8_kernels() -> list[str]:
    """The bf16-kernel settings under which the fp8 brgemm runs a different kernel here.

    ``'kt'``: kt_ops' fused decode-and-multiply tiles (AVX512_BF16 and VBMI,
    no AMX); ``'onednn'``: the codes decoded to a tile, then oneDNN's brgemm.
    """
    kernels: dict[str, str] = {}  # kernel name -> the first setting that runs it
    for setting in ("kt", "onednn"):
        with kt_ops.use_compute_path("brgemm"), kt_ops.use_brgemm_bf16_kernel(setting):
            name = kt_ops.compute_paths()["fp8"]["brgemm_kernel"]
        if name is not None:
            kernels.setdefault(name, setting)
    return list(kernels.values())


def with_power_of_two_scales(experts: kt_ops.ExpertWeights) -> kt_ops.ExpertWeights:
    """The fp8 experts with every block scale rounded to a power of two."""
    from kt_ops.formats import PackedProjection

    def one(p):
        scales = torch.exp2(torch.round(torch.log2(p.scales)))
        return PackedProjection(p.weight, scales, None, "fp8", p.group_size, p.n, p.k)

    return kt_ops.ExpertWeights(*(one(p) for p in experts.projections))


def test_fp8_brgemm_with_power_of_two_scales_is_the_bf16_brgemm(isa):
    # The fp8 brgemm multiplies bf16(x * s) by the exact E4M3 values. With s a
    # power of two that is bf16(x) * s, and e4m3 * s is exact in bf16: fp8 on
    # brgemm equals bf16 on brgemm with the dequantized weights, bit for bit,
    # on every fp8 kernel and for fp32 and bf16 activations.
    kernels = fp8_kernels()
    if not kernels or not brgemm_runs("fp8"):
        pytest.skip("the fp8 brgemm does not run on this ISA path / CPU / torch")
    for H, I in FP8_SHAPES:  # noqa: E741
        experts = with_power_of_two_scales(make_quant_experts("fp8", 4, H, I, seed=H + I))
        twin = bf16_twin(experts)
        ids, w = fp8_routing([0, 3, 40, 70], seed=H)
        for dtype in (torch.float32, torch.bfloat16):
            x = make_hidden(ids.shape[0], H, dtype, seed=I)
            for kernel in kernels:  # each kernel's fp8 against its own bf16 (its own order)
                with kt_ops.use_brgemm_bf16_kernel(kernel):
                    want = run("brgemm", x, ids, w, twin)
                    got = run("brgemm", x, ids, w, experts)
                if kernel == "kt" or onednn_sums_in_kt_order():
                    assert torch.equal(got, want), (H, I, kernel)
                else:  # oneDNN's bf16 (N = 16) and fp8 (N = 32) calls: its order, not ours
                    ref = reference_moe_forward(x, ids, w, twin, bf16_activations=True)
                    assert_matches_reference(got, ref, TOL_BF16_BRGEMM)
                    assert_matches_reference(want, ref, TOL_BF16_BRGEMM)


#: fp8 on brgemm against its reference at K = 2080 with 130 tokens: the gate / up
#: sums reach ~30, and a SwiGLU output that the kernel and the reference round to
#: bf16 on either side of a boundary (their fp32 sums differ in order) moves a
#: down sum by 2^-8 of that term: measured 7.8e-4 of max |out| for 2 of 840k outputs.
TOL_FP8_SWIGLU_FLIPS = Tolerance(compute=2e-3)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp8_brgemm_kernels_bit_identical(isa, act_dtype, fmt):
    # kt_ops' fused tiles and oneDNN's AVX512_BF16 brgemm on the decoded tile
    # compute the same sums in the same order (one fp32 chain per output over k
    # pairs): bit-identical there. On AMX (oneDNN's order) each is held to the
    # reference. Token counts across the fused kernel's 28-row tiles and oneDNN's 64.
    if len(fp8_kernels()) < 2:
        pytest.skip("one fp8 brgemm kernel runs here (or none)")
    counts = [0, 1, 3, 27, 28, 29, 57, 64, 65, 130]
    for H, I in FP8_SHAPES:  # noqa: E741
        experts = make_quant_experts(fmt, len(counts), H, I, seed=H * 3 + I)
        ids, w = fp8_routing(counts, seed=I)
        x = make_hidden(ids.shape[0], H, act_dtype, seed=H)
        ref = reference_moe_forward(
            x, ids, w, experts, bf16_activations=True, fp8_scaled_activations=True
        )
        outs = []
        for kernel in ("kt", "onednn"):
            with kt_ops.use_brgemm_bf16_kernel(kernel):
                outs.append(run("brgemm", x, ids, w, experts))
            assert_matches_reference(outs[-1], ref, TOL_FP8_SWIGLU_FLIPS)
        if onednn_sums_in_kt_order():
            assert torch.equal(outs[0], outs[1]), (H, I)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_channel", "mxfp8"])
def test_fp8_tiles_under_quant_fp32_multiply_exactly(isa, fmt):
    # Under quant 'fp32' kt_ops' fp8 tiles keep the scales off the activations: bf16(x)
    # times the exact E4M3 values, fp8's 128-k block scales on each chunk's fp32 sums
    # (avx512_bf16/fp8_dp_exact): for bf16 activations the reference of the bf16 tile
    # path on the dequantized weights, not fp8's scaled-activation one. oneDNN's kernel
    # (AMX, no VBMI) keeps the scales on the activations for fp8.
    if not brgemm_runs(fmt):
        pytest.skip("the fp8 brgemm does not run on this ISA path / CPU / torch")
    with kt_ops.use_compute_path("brgemm"), kt_ops.use_quant_activations("fp32"):
        name = kt_ops.compute_paths()[fmt]["brgemm_kernel"]
    kt = BRGEMM_KERNELS["fp8"] == "avx512_bf16/fp8_dp" and brgemm_runs("fp8")
    assert name == ("avx512_bf16/fp8_dp_exact" if kt else "onednn/brgemm_fp8_bf16")
    with kt_ops.use_compute_path("auto"), kt_ops.use_quant_activations("auto"):
        auto = kt_ops.compute_paths()[fmt]["brgemm_kernel"]
    # A class whose threshold is none (avx512_intel) streams fp8 under 'auto'.
    cls = kt_ops.info()["brgemm_cpu_class"]
    on_auto = kt_ops.formats.format_spec(fmt).brgemm_min_tokens_for(cls) is not None
    assert auto == (BRGEMM_KERNELS[fmt] if on_auto else None)
    for H, I in FP8_SHAPES:  # noqa: E741
        experts = make_quant_experts(fmt, 4, H, I, seed=H + 2 * I)
        ids, w = fp8_routing([0, 3, 40, 70], seed=H)
        x = make_hidden(ids.shape[0], H, torch.bfloat16, seed=I)
        with kt_ops.use_quant_activations("fp32"):
            out = run("brgemm", x, ids, w, experts)
        # fp8_channel and mxfp8 scale nothing on the activations on either kernel: their
        # banded reference is exact (bf16(x) @ e4m3 times the row scales, or @ W).
        exact_fp8 = kt and fmt == "fp8"
        ref = reference_moe_forward(
            x, ids, w, experts, bf16_activations=True, fp8_scaled_activations=not exact_fp8
        )
        # A SwiGLU output rounded to bf16 on either side of a boundary (the kernel's and
        # the reference's fp32 sums differ in order) moves a down sum: TOL_FP8_SWIGLU_FLIPS.
        assert_matches_reference(out, ref, TOL_FP8_SWIGLU_FLIPS)
        if exact_fp8:  # and not the scaled-activation scheme's result
            with kt_ops.use_quant_activations("auto"):
                assert not torch.equal(run("brgemm", x, ids, w, experts), out), (H, I)


def mxfp8_with_exponent(experts: kt_ops.ExpertWeights, e: int, value: int, fmt: str = "mxfp8"):
    """``experts`` with UE8M0 exponent ``value`` in group 0 of rows 0-15 of expert ``e``'s gate."""
    from kt_ops.formats import PackedProjection

    g = experts.projections[0]
    scales = g.scales.clone()
    scales[e, 0, 0, :] = value  # [E, NB, G, 16]: block 0, group 0, its 16 rows
    gate = PackedProjection(g.weight, scales, None, fmt, g.group_size, g.n, g.k)
    return kt_ops.ExpertWeights(gate, *experts.projections[1:])


@pytest.mark.parametrize("value", [0, 5, 9])
def test_mxfp8_exponents_outside_bf16_take_the_streaming_kernel(isa, value):
    # mxfp8 on the fp8 tiles adds E - 127 to the decoded bf16 exponents, which is
    # exact while E is in [10, 246]. A block with an exponent outside (here E <= 9:
    # the add would borrow into the sign bit and decode huge values) is computed by
    # the streaming kernel instead; the rest of the layer stays on the tiles.
    if not brgemm_runs("mxfp8"):
        pytest.skip("the fp8 brgemm does not run on this ISA path / CPU / torch")
    H, I, counts = 160, 96, [5, 40, 0, 70]  # noqa: E741
    base = make_quant_experts("mxfp8", len(counts), H, I, seed=17)
    experts = mxfp8_with_exponent(base, 1, value)
    ids, w = fp8_routing(counts, seed=17)
    x = make_hidden(ids.shape[0], H, torch.bfloat16, seed=17)
    ref = reference_moe_forward(x, ids, w, experts, bf16_activations=True)
    for kernel in fp8_kernels():
        with kt_ops.use_brgemm_bf16_kernel(kernel):
            out = run("brgemm", x, ids, w, experts)
        assert torch.isfinite(out).all(), kernel
        assert_matches_reference(out, ref, TOL_BF16_BRGEMM)


def test_fp8_every_code_decodes_exactly(isa):
    # All 254 finite E4M3 codes (subnormals, zeros, both signs, +-448), with
    # scales of 1 and 2^-2: brgemm equals the bf16 brgemm of float(code) *
    # scale, bit for bit, on every fp8 kernel.
    kernels = fp8_kernels()
    if not kernels or not brgemm_runs("fp8"):
        pytest.skip("the fp8 brgemm does not run on this ISA path / CPU / torch")
    from reference import dense_expert

    from kt_ops.formats import PackedProjection, quantize_weights

    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    E, N, K = 1, 32, 256  # gate/up [N, K]: 2 blocks of 16 rows, 2 scale blocks along K
    perm = torch.randperm(N * K, generator=torch.Generator().manual_seed(0))
    w8 = finite.repeat(N * K // finite.numel() + 1)[: N * K][perm].view(N, K)
    assert set(w8.flatten().tolist()) == set(finite.tolist())
    scales = torch.tensor([[[1.0, 0.25]]])  # [E, ceil(N/128), ceil(K/128)]
    packed = w8.view(E, N // 16, 16, K).transpose(2, 3).contiguous()  # [E, NB, Kp, 16]
    proj = PackedProjection(packed, scales, None, "fp8", 128, N, K)
    want = w8.view(torch.float8_e4m3fn).float() * torch.tensor([1.0, 0.25]).repeat_interleave(128)
    assert torch.equal(dense_expert(proj, 0), want)  # the layout as the reference reads it
    g = torch.Generator().manual_seed(1)
    down = quantize_weights(torch.randn(E, K, N, generator=g), "fp8")
    experts = with_power_of_two_scales(kt_ops.ExpertWeights(proj, proj, down))
    ids, w = fp8_routing([20], seed=4)
    x = make_hidden(20, K, torch.bfloat16, seed=4) * 0.01  # |gate| << SiLU's range of exp overflow
    for kernel in kernels:  # each kernel against its own bf16 brgemm (its own order)
        with kt_ops.use_brgemm_bf16_kernel(kernel):
            want = run("brgemm", x, ids, w, bf16_twin(experts))
            out = run("brgemm", x, ids, w, experts)
        assert torch.isfinite(out).all()
        if kernel == "kt" or onednn_sums_in_kt_order():
            assert torch.equal(out, want), kernel
        else:  # oneDNN's order (see the test above)
            ref = reference_moe_forward(x, ids, w, bf16_twin(experts), bf16_activations=True)
            assert_matches_reference(out, ref, TOL_BF16_BRGEMM)


def skip_unless_fp8_tile_decode_runs(decode: str) -> None:
    feats = kt_ops.info()["cpu_features"]
    if not feats["avx512"] or (decode == "vbmi" and not feats.get("avx512_vbmi")):
        pytest.skip(f"the {decode} decode needs AVX-512{' VBMI' if decode == 'vbmi' else ''}")


@pytest.mark.parametrize("decode", ["vbmi", "bw"])
def test_fp8_tile_decode_of_every_code(decode):
    # The decode to brgemm's VNNI tile, both implementations, on all 256
    # codes: word (k // 2) * 32 + 2 * r + k % 2 holds bf16(E4M3 value of
    # codes[k][r]) exactly (E4M3's NaN codes 0x7F / 0xFF, which the packer
    # refuses, decode to +-480 as in the streaming kernels).
    skip_unless_fp8_tile_decode_runs(decode)
    kp = 64
    g = torch.Generator().manual_seed(5)
    codes = torch.cat([torch.arange(256), torch.randint(0, 256, (kp * 16 - 256,), generator=g)])
    codes = codes.to(torch.uint8).view(kp, 16)
    out = kt_ops._C._testing.fp8_block_to_bf16_vnni(codes.numpy().tobytes(), decode)
    tile = torch.frombuffer(bytearray(out), dtype=torch.bfloat16).view(kp // 2, 16, 2)
    values = codes.view(torch.float8_e4m3fn).float()
    nan = values.isnan()
    values[nan] = torch.where(codes[nan] & 0x80 != 0, -480.0, 480.0)
    want = values.bfloat16().view(kp // 2, 2, 16).transpose(1, 2)
    assert torch.equal(tile.view(torch.int16), want.contiguous().view(torch.int16))


@pytest.mark.parametrize("decode", ["vbmi", "bw"])
def test_mxfp8_tile_decode_adds_the_exponents(decode):
    # mxfp8 on the tiles: the decode moves each row's bf16 exponents by E - 127
    # (one UE8M0 byte per row and 32 k): every finite code times 2^(E-127), exactly,
    # for E over bf16's safe range [10, 246] (its ends included); +-0 stay +-0.
    skip_unless_fp8_tile_decode_runs(decode)
    kp = 256
    g = torch.Generator().manual_seed(6)
    finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    codes = finite[torch.randint(0, finite.numel(), (kp * 16,), generator=g)].view(kp, 16)
    codes[:2, :] = finite[:32].view(2, 16)  # +0, -0 and the subnormals among them
    exps = torch.randint(10, 247, (kp // 32, 16), dtype=torch.uint8, generator=g)
    exps[0, :2] = torch.tensor([10, 246], dtype=torch.uint8)
    out = kt_ops._C._testing.fp8_block_to_bf16_vnni(
        codes.numpy().tobytes(), decode, exps.numpy().tobytes()
    )
    tile = torch.frombuffer(bytearray(out), dtype=torch.bfloat16).view(kp // 2, 16, 2)
    scale = torch.exp2(exps.double() - 127).repeat_interleave(32, dim=0)  # [kp, 16]
    values = codes.view(torch.float8_e4m3fn).double() * scale
    want = values.float().bfloat16()
    assert torch.equal(want.double(), values)  # the products are bf16 values: exact
    want = want.view(kp // 2, 2, 16).transpose(1, 2).contiguous()
    assert torch.equal(tile.view(torch.int16), want.view(torch.int16))  # signs of zero too
    with pytest.raises(ValueError, match="len\\(exponents\\) must be len\\(codes\\) / 32"):
        kt_ops._C._testing.fp8_block_to_bf16_vnni(codes.numpy().tobytes(), decode, bytes(3))


def test_fp8_tile_decode_refuses_bad_arguments():
    with pytest.raises(ValueError, match="decode must be 'vbmi' or 'bw'"):
        kt_ops._C._testing.fp8_block_to_bf16_vnni(bytes(512), "avx2")
    if kt_ops.info()["cpu_features"]["avx512"]:
        with pytest.raises(ValueError, match="multiple of 512"):
            kt_ops._C._testing.fp8_block_to_bf16_vnni(bytes(500), "bw")


@pytest.mark.parametrize("path", ["brgemm", "auto"])
def test_fp8_thread_counts_bit_identical(isa, path):
    E, H, I, K, T = 6, 2080, 200, 2, 150  # noqa: E741  (~50 tokens per expert, some past 64)
    experts = make_quant_experts("fp8", E, H, I, seed=6)
    ids, w = make_routing(T, E, K, seed=6)
    x = make_hidden(T, H, torch.bfloat16, seed=6)
    assert_thread_counts_bit_identical(path, x, ids, w, experts)


def test_fp8_info_reports_the_brgemm_kernel(isa):
    report = kt_ops.info()["brgemm"]["fp8"]
    if brgemm_runs("fp8"):
        cls = kt_ops.info()["brgemm_cpu_class"]
        kernel = BRGEMM_KERNELS["fp8"]
        min_tokens = kt_ops.formats.format_spec("fp8").brgemm_min_tokens_for(cls)
        assert report == {
            "brgemm_kernel": kernel if min_tokens is not None else None,
            "brgemm_min_tokens": min_tokens,
        }
        assert (kernel in format_info(kt_ops.info())) == (min_tokens is not None)
        with kt_ops.use_brgemm_bf16_kernel("onednn"), kt_ops.use_compute_path("brgemm"):
            assert kt_ops.info()["brgemm"]["fp8"]["brgemm_kernel"] == "onednn/brgemm_fp8_bf16"
    else:
        assert report == {"brgemm_kernel": None, "brgemm_min_tokens": None}


def test_fp8_brgemm_where_it_does_not_run_is_streaming(isa):
    # Where oneDNN's bf16 brgemm does not run (AVX2 tiers, no AVX512_BF16,
    # mkldnn off), forcing 'brgemm' streams fp8 bit for bit.
    experts = make_quant_experts("fp8", 4, 160, 96, seed=8)
    ids, w = make_routing(30, 4, 2, seed=8)
    x = make_hidden(30, 160, seed=8)
    want = run("streaming", x, ids, w, experts)
    with torch.backends.mkldnn.flags(enabled=False):
        assert torch.equal(run("brgemm", x, ids, w, experts), want)
    if not brgemm_runs("fp8"):
        assert torch.equal(run("brgemm", x, ids, w, experts), want)


def test_fp8_mixed_with_bf16_and_int8_projections(isa):
    # Per-projection formats: the three brgemm kernels in one call, each
    # expert's bf16 rows shared by a bf16 and an fp8 projection.
    experts = make_quant_experts("fp8,bf16,fp8", 4, 160, 96, seed=14)
    ids, w = make_routing(60, 4, 2, seed=14)
    x = make_hidden(60, 160, torch.bfloat16, seed=14)
    out = run("brgemm", x, ids, w, experts)
    if brgemm_runs("fp8"):
        ref = reference_moe_forward(
            x, ids, w, experts, bf16_activations=True, fp8_scaled_activations=True
        )
        assert_matches_reference(out, ref, TOL_BF16_BRGEMM)
    else:  # forced 'brgemm' without fp8 tiles: fp8 streams, bf16 as the path says
        with kt_ops.use_compute_path("brgemm"):
            ref = reference_for(experts, x, ids, w)
        assert quant_mismatch_report(out, ref, TOL_MIXED) is None
    # int8, fp8 and bf16 in one call, against the reference of each projection's path
    # (the bf16 projection's rounding of h on the brgemm path is not modelled: TOL_MIXED).
    mixed = make_quant_experts("int8,fp8,bf16", 4, 160, 96, seed=15)
    for path, tol in (("streaming", TOL_QUANT), ("brgemm", TOL_MIXED)):
        with kt_ops.use_compute_path(path):
            y = kt_ops.moe_forward(x, ids, w, mixed)
            ref = reference_for(mixed, x, ids, w)
        assert y.shape == x.shape
        assert quant_mismatch_report(y, ref, tol) is None, path


def test_fp8_lora_with_brgemm_forced(isa):
    # With LoRA the base projections run on ATen from the dequantized weights
    # (csrc/moe/moe_lora.cpp), whatever the compute path: fp8 base weights
    # under 'brgemm' give the unrounded reference, forward and backward.
    E, H, I, T, r = 4, 160, 96, 40, 4  # noqa: E741
    experts = make_quant_experts("fp8", E, H, I, seed=16)
    ids, w = make_routing(T, E, 2, seed=16)
    g = torch.Generator().manual_seed(16)
    dims = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    factors = {}
    for proj, (n, k) in dims.items():
        factors[f"{proj}_lora_a"] = torch.randn(E, r, k, generator=g) * 0.3 / k**0.5
        factors[f"{proj}_lora_b"] = torch.randn(E, n, r, generator=g) * 0.3 / r**0.5
    x = make_hidden(T, H, torch.float32, seed=16)
    lora = lora_weights_from(factors)
    outs = {}
    for path in ("streaming", "brgemm"):
        xg = x.clone().requires_grad_(True)
        with kt_ops.use_compute_path(path):
            out = kt_ops.moe_forward(xg, ids, w, experts, lora=lora)
            out.sum().backward()
        outs[path] = (out.detach(), xg.grad)
    ref = reference_moe_forward(x, ids, w, experts, lora)
    assert_matches_reference(outs["brgemm"][0], ref, TOL_BF16)
    assert torch.equal(outs["brgemm"][0], outs["streaming"][0])
    assert torch.equal(outs["brgemm"][1], outs["streaming"][1])


# --------------------------------------------------------------------------
# int8 and q8_0 on the avx512_vnni streaming kernel: u8 activations
# --------------------------------------------------------------------------
# The VNNI tier multiplies 8-bit signed codes with the q8 codes shifted to u8
# (vpdpbusd u8 x s8, minus 128 * sum w per row and fold unit; qint_tiles.h,
# qint8_u8_block_dot), in K chunks of 512; the other tiers use the sign trick.
# Both sum exactly in int32 and fold the same way: bit-identical to avx2.

#: Tokens per expert (top-1 routing): single tokens, the 8-token tile and its
#: remainders, several tiles.
U8_COUNTS = (1, 2, 3, 7, 8, 9, 17, 64, 65)
#: (format, H, I): K (H for gate/up, I for down) not a multiple of 64 / 128 /
#: the 512 chunk, N (I, and H for down) not a multiple of 16 where the format
#: allows it (q8_0 needs K in multiples of 32).
U8_SHAPES = [
    ("int8", 96, 40),
    ("int8", 160, 50),
    ("int8", 2080, 24),
    ("int8", 50, 600),
    ("q8_0", 96, 64),
    ("q8_0", 160, 32),
    ("q8_0", 2080, 96),
]


def needs_vnni_and_avx2():
    missing = {"avx512_vnni", "avx2"} - set(kt_ops.supported_isas())
    if missing:
        pytest.skip(f"this CPU / build has no {sorted(missing)} path")


def counts_routing(counts, seed: int):
    """Top-1 ids giving expert e exactly counts[e] tokens (shuffled), and weights."""
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    g = torch.Generator().manual_seed(seed)
    ids = ids[torch.randperm(ids.numel(), generator=g)].view(-1, 1)
    w = torch.rand(ids.shape[0], 1, generator=g) + 0.5
    return ids, w


def streaming_q8_on(run_on_isa, isa: str, x, ids, w, experts):
    return run_on_isa(isa, lambda: streaming_q8(x, ids, w, experts))


@pytest.mark.parametrize("fmt,H,I", U8_SHAPES)
def test_vnni_8bit_u8_kernel_matches_avx2_and_reference(run_on_isa, fmt, H, I):  # noqa: E741
    needs_vnni_and_avx2()
    experts = make_quant_experts(fmt, len(U8_COUNTS), H, I, seed=H + I)
    ids, w = counts_routing(U8_COUNTS, seed=H)
    x = make_hidden(ids.shape[0], H, torch.float32, seed=I)
    got = streaming_q8_on(run_on_isa, "avx512_vnni", x, ids, w, experts)
    want = streaming_q8_on(run_on_isa, "avx2", x, ids, w, experts)
    with kt_ops.use_quant_activations("q8"):
        ref = reference_for(experts, x, ids, w)
    msg = quant_mismatch_report(got, ref)
    assert msg is None, f"{fmt} H={H} I={I}: {msg}"
    assert torch.equal(got, want)
    # The same rows on their own: a token's result does not depend on the tile
    # it lands in (m = 1 and 3 here against its place in a 65-token expert).
    big = (ids[:, 0] == len(U8_COUNTS) - 1).nonzero().flatten()
    for rows in (big[:1], big[:3]):
        one = streaming_q8_on(run_on_isa, "avx512_vnni", x[rows], ids[rows], w[rows], experts)
        assert torch.equal(one, got[rows])


def sign_pattern(kind: str, shape, seed: int) -> torch.Tensor:
    if kind == "plus":
        return torch.ones(shape)
    if kind == "minus":
        return -torch.ones(shape)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, shape, generator=g).float() * 2 - 1


@pytest.mark.parametrize("fmt", Q8_BRGEMM_FORMATS)
@pytest.mark.parametrize(
    "w_kind,x_kind", [("random", "random"), ("plus", "plus"), ("minus", "plus"), ("plus", "minus")]
)
def test_vnni_8bit_u8_kernel_extreme_codes(run_on_isa, fmt, w_kind, x_kind):
    # Codes -127 / 127 everywhere (weights of +-1 with per-row or per-32 scales)
    # and activations at +-max (q8 codes +-127, shifted: 1 / 255): the largest
    # int32 partial sums either way; no overflow, the same bits as avx2.
    needs_vnni_and_avx2()
    from kt_ops.formats import quantize_weights

    E, H, I = 4, 2080, 96  # noqa: E741
    # gate . x = +H where x is constant, so that SwiGLU does not vanish.
    dense = [
        sign_pattern(w_kind if x_kind == "random" else x_kind, (E, I, H), 1),
        sign_pattern(w_kind, (E, I, H), 2),
        sign_pattern(w_kind, (E, H, I), 3),
    ]
    packed = [quantize_weights(d, fmt) for d in dense]
    codes = packed[0].weight.view(torch.int8)
    assert (
        int(codes.abs().min()) == 127
    )  # every code at the extreme (K padding aside: 2080 % 32 == 0)
    experts = kt_ops.ExpertWeights(*packed)
    ids, w = counts_routing((1, 9, 17, 65), seed=5)
    x = sign_pattern(x_kind, (ids.shape[0], H), 4)
    got = streaming_q8_on(run_on_isa, "avx512_vnni", x, ids, w, experts)
    want = streaming_q8_on(run_on_isa, "avx2", x, ids, w, experts)
    assert torch.equal(got, want)
    with kt_ops.use_quant_activations("q8"):
        ref = reference_for(experts, x, ids, w)
    msg = quant_mismatch_report(got, ref)
    assert msg is None, f"{fmt} {w_kind}/{x_kind}: {msg}"


@pytest.mark.parametrize("fmt", Q8_BRGEMM_FORMATS)
def test_vnni_8bit_u8_kernel_thread_counts_bit_identical(run_on_isa, fmt):
    needs_vnni_and_avx2()
    experts = make_quant_experts(fmt, len(U8_COUNTS), 160, 96, seed=21)
    ids, w = counts_routing(U8_COUNTS, seed=21)
    x = make_hidden(ids.shape[0], 160, seed=21)
    outs = []
    for n in THREAD_COUNTS:
        kt_ops.set_num_threads(n)
        outs.append(streaming_q8_on(run_on_isa, "avx512_vnni", x, ids, w, experts))
    for n, out in zip(THREAD_COUNTS, outs):
        assert torch.equal(out, outs[0]), f"{n} threads differ"
    assert torch.equal(outs[0], streaming_q8_on(run_on_isa, "avx2", x, ids, w, experts))


@pytest.mark.parametrize("fmt", Q8_BRGEMM_FORMATS)
def test_vnni_8bit_u8_kernel_under_auto_and_mixed_formats(run_on_isa, fmt):
    # 'auto' (q8 streaming below the thresholds, brgemm or fp32 above) and a
    # mix with a 4-bit projection: the u8 rows are made only for the 8-bit
    # projections' streaming experts; every path stays bit-identical to avx2
    # where the two tiers run the same path (q8 pinned).
    needs_vnni_and_avx2()
    for f in (fmt, f"{fmt},int4,{fmt}", f"int4,{fmt},int4"):
        gs = 32 if "int4" in f else None  # int4's group must divide I = 64
        experts = make_quant_experts(f, len(U8_COUNTS), 128, 64, group_size=gs, seed=31)
        ids, w = counts_routing(U8_COUNTS, seed=31)
        x = make_hidden(ids.shape[0], 128, seed=31)
        got = streaming_q8_on(run_on_isa, "avx512_vnni", x, ids, w, experts)
        assert torch.equal(got, streaming_q8_on(run_on_isa, "avx2", x, ids, w, experts)), f
        with kt_ops.use_quant_activations("auto"):
            out = run_on_isa("avx512_vnni", functools.partial(run, "auto", x, ids, w, experts))
            ref = reference_for(experts, x, ids, w)
        msg = quant_mismatch_report(out, ref)
        assert msg is None, f"{f}: {msg}"
