"""kt-kernel 0.7.2's KTMoEWrapper and kt_ops.compat.KTMoEWrapper on the same weights.

Run with the peers venv's python (``scripts/setup_peers.sh``: kt-kernel 0.7.2 and
the system torch / kt_ops), by ``tests/test_compat.py::test_cross_check_kt_kernel``::

    ~/.cache/kt_ops/peers-venv/bin/python tests/kt_kernel_crosscheck.py OUT.json

For each case it writes the weights into a temporary folder (the writers of
``tests/checkpoints.py``), builds both wrappers with the same arguments, loads
them the same way (``load_weights`` from ``weight_path``, or
``load_weights_from_tensors`` for the online-quantized methods), runs
``forward`` on the same bf16 inputs and writes, per case: ``rel`` =
||y_kt_kernel - y_kt_ops|| / ||y_kt_ops||, ``max_abs`` = max |y_kt_kernel -
y_kt_ops|, ``max_rel`` = max_abs / max |y_kt_ops|, and each side's relative error
against the fp32 dense reference of the stored weights (``ref_kt_kernel``,
``ref_kt_ops``). A case kt-kernel cannot run here is recorded with its error and
the side that raised it (``side``). Before each case and each side the script prints
``@case NAME`` / ``@side kt_kernel|kt_ops`` (flushed), so that when a wrapper kills
the process (kt-kernel 0.7.2's AVX2 build segfaults in RAWINT4) the caller knows
which one did, and reruns the rest with ``--skip NAME``::

    ... tests/kt_kernel_crosscheck.py OUT.json --skip RAWINT4

Two adjustments let kt-kernel's wrapper run on a CPU-only torch, neither of
which changes what it computes: its buffers ask for pinned memory, which a
CPU-only torch refuses (``pin_memory`` is dropped), and its submit path would
enqueue on a CUDA stream (``KT_FORCE_SYNC_SUBMIT=1`` selects its synchronous
``submit`` / ``sync`` path, which the environment sets before the import).
"""

# ruff: noqa: E741

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("KT_FORCE_SYNC_SUBMIT", "1")
# kt-kernel's NVFP4 (group 16) runs on its AVX2 FP4 backend only.
os.environ.setdefault("KT_MXFP4_BACKEND", "avx2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

if not torch.cuda.is_available():

    def _no_pin(fn):
        def call(*args, pin_memory=False, **kwargs):
            return fn(*args, **kwargs)

        return call

    for _name in ("zeros", "full", "empty"):
        setattr(torch, _name, _no_pin(getattr(torch, _name)))

import kt_kernel  # noqa: E402
from checkpoints import (  # noqa: E402
    dense_experts,
    write_compressed_int4,
    write_gguf,
    write_hf,
    write_hf_fp8,
)
from gguf import GGMLQuantizationType as Q  # noqa: E402
from test_quantized_checkpoints import write_checkpoint  # noqa: E402

import kt_ops  # noqa: E402
from kt_ops.compat import KTMoEWrapper  # noqa: E402

E, K, H, I, T = 8, 2, 256, 256, 16
LAYER = 1


def reference(x, ids, w, dense, p2l=None, mask=None):
    """fp32 SwiGLU experts on dense ``{gate, up, down}`` (physical id p -> logical p2l[p])."""
    out = torch.zeros(x.shape[0], H)
    xf = x.float()
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if mask is not None and bool(mask[e]):
                continue
            le = e if p2l is None else int(p2l[e])
            g = dense["gate"][le].float() @ xf[t]
            u = dense["up"][le].float() @ xf[t]
            h = torch.nn.functional.silu(g) * u
            out[t] += float(w[t, k]) * (dense["down"][le].float() @ h)
    return out


def _release_kt_kernel_loader() -> None:
    """kt-kernel keeps one checkpoint loader per process (its first weight_path); drop it."""
    try:
        from kt_kernel.utils.amx import NativeMoEWrapper
    except ImportError:
        return
    NativeMoEWrapper.force_release_loader()


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


_SIDE = ["kt_kernel"]  # the wrapper running now: which side an exception came from


def run_case(
    name, method, path, dense, *, tensors=None, p2l=None, mask=None, seed=0, experts=E, **extra
):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    args = dict(
        layer_idx=LAYER,
        num_experts=experts,
        num_experts_per_tok=K,
        hidden_size=H,
        moe_intermediate_size=I,
        gpu_experts_mask=mask,
        cpuinfer_threads=2,
        threadpool_count=1,
        weight_path=str(path),
        chunked_prefill_size=64,
        method=method,
        **extra,
    )
    ident = torch.arange(experts, dtype=torch.int64)
    m = ident if p2l is None else p2l
    outs = {}
    for side, cls in (("kt_kernel", kt_kernel.KTMoEWrapper), ("kt_ops", KTMoEWrapper)):
        _SIDE[0] = side
        print(f"@side {side}", flush=True)
        _release_kt_kernel_loader()
        wrapper = cls(**args)
        if tensors is not None:
            wrapper.load_weights_from_tensors(*tensors, m)
        else:
            wrapper.load_weights(m)
        outs[side] = wrapper.forward(x, ids, w, 0).clone()
    ref = reference(x, ids, w, dense, p2l, mask)
    # kt_ops' 4-bit kernels multiply int8 activations (q8, per 32) by default; its w4a16
    # path (fp32 activations) is the like-for-like with kt-kernel's fp32-activation backends.
    _SIDE[0] = "kt_ops"
    kt_ops.set_quant_activations("fp32")
    try:
        w4a16 = wrapper.forward(x, ids, w, 0).clone()
    finally:
        kt_ops.set_quant_activations("auto")
    a, b = outs["kt_kernel"], outs["kt_ops"]
    diff = (a.float() - b.float()).abs()
    return {
        "case": name,
        "method": method,
        "rel": rel(a, b),
        "max_abs": float(diff.max()),
        "max_rel": float(diff.max() / b.float().abs().max()),
        "ref_kt_kernel": rel(a, ref),
        "ref_kt_ops": rel(b, ref),
        "ref_kt_ops_fp32_activations": rel(w4a16, ref),
        "finite_kt_kernel": bool(torch.isfinite(a.float()).all()),
    }


def main(out_json: str, skip: frozenset[str] = frozenset()) -> int:
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="kt_compat_"))

    def case(fn):
        if fn.__name__ in skip:
            return
        print(f"@case {fn.__name__}", flush=True)
        _SIDE[0] = "kt_kernel"
        try:
            results.append(fn())
        except Exception as e:  # recorded, the test decides
            error = f"{type(e).__name__}: {e}"
            results.append({"case": fn.__name__, "error": error, "side": _SIDE[0]})
            traceback.print_exc()

    bf16 = write_hf(tmp / "bf16", E=E, H=H, I=I, num_layers=2, dense_layers=(0,))[LAYER]
    fp8 = write_hf_fp8(tmp / "fp8", E=E, H=H, I=I, num_layers=2)[LAYER]
    raw = write_compressed_int4(tmp / "rawint4", E=E, H=H, I=I, num_layers=2, group_size=32)
    gg = write_gguf(tmp / "m.gguf", {"gate": Q.Q4_K, "up": Q.Q4_K, "down": Q.Q6_K}, E=E, H=H, I=I)[
        LAYER
    ]
    gguf_dense = {r: v["dense"] for r, v in gg.items()}
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(7))
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[1, 4, 6]] = True
    dense_bf16 = tuple(bf16[r].to(torch.bfloat16) for r in ("gate", "up", "down"))

    def BF16():
        return run_case("BF16", "BF16", tmp / "bf16", bf16)

    def BF16_p2l():
        return run_case("BF16_p2l", "BF16", tmp / "bf16", bf16, p2l=perm)

    def BF16_mask():
        return run_case("BF16_mask", "BF16", tmp / "bf16", bf16, mask=mask)

    def FP8():
        return run_case("FP8", "FP8", tmp / "fp8", fp8)

    def RAWINT4():
        return run_case("RAWINT4", "RAWINT4", tmp / "rawint4", raw[LAYER])

    def LLAMAFILE():
        return run_case("LLAMAFILE", "LLAMAFILE", tmp / "m.gguf", gguf_dense)

    def AMXINT8():
        (tmp / "amx8").mkdir()
        return run_case("AMXINT8", "AMXINT8", tmp / "amx8", bf16, tensors=dense_bf16)

    def AMXINT4():
        (tmp / "amx4").mkdir()
        return run_case("AMXINT4", "AMXINT4", tmp / "amx4", bf16, tensors=dense_bf16)

    def AMXINT4_per_channel():  # kt-kernel's scheme: one int4 scale per output channel
        (tmp / "amx4c").mkdir()
        return run_case(
            "AMXINT4_per_channel", "AMXINT4", tmp / "amx4c", bf16, tensors=dense_bf16, group_size=0
        )

    # Checkpoints published quantized (tests/test_quantized_checkpoints.py's producers).
    # 4 experts: kt-kernel 0.7.2's GPTQ_INT4 / NVFP4 / MXFP4 wrappers crash (SIGSEGV /
    # SIGABRT) with 8 experts on a 2-core AVX-512 host; 4 run.
    EQ = 4
    experts = {L: dense_experts(EQ, I, H, 40 + L) for L in range(LAYER + 1)}

    def quantized(method, kind):
        def fn():
            refs = write_checkpoint(tmp / kind, kind, experts)
            return run_case(method, method, tmp / kind, refs[LAYER], experts=EQ)

        fn.__name__ = method
        return fn

    cases = [BF16, BF16_p2l, BF16_mask, FP8, RAWINT4, LLAMAFILE, AMXINT8, AMXINT4]
    cases += [AMXINT4_per_channel, quantized("GPTQ_INT4", "gptq_v1_sym")]
    cases += [quantized("NVFP4", "modelopt_nvfp4"), quantized("MXFP4", "dsv4_mxfp4")]
    cases += [quantized("FP8_PERCHANNEL", "glm_fp8_channel"), quantized("MXFP8", "minimax_mxfp8")]
    for fn in cases:
        case(fn)
    shutil.rmtree(tmp, ignore_errors=True)
    meta = {"kt_kernel": kt_kernel.__version__, "variant": kt_kernel.__cpu_variant__}
    Path(out_json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    skip = frozenset(args[args.index("--skip") + 1 :]) if "--skip" in args else frozenset()
    sys.exit(main(args[0], skip))
