"""Fingerprints of kt_ops outputs, to prove a refactor changed no result bit.

Runs ``kt_ops.nn.MoEExperts`` (the stable module API) over a grid of weight
formats, ISA paths, compute paths, token counts, activation dtypes and LoRA
(forward and backward), and records a SHA-256 of every output tensor's bytes.
The grid runs on the streaming kernels (``kt_ops.set_compute_path('streaming')``,
the kernels that existed before the brgemm path, so their fingerprints stay
comparable across trees); the brgemm path adds its own cases
(``fwd/<format>/.../brgemm/...``) for the formats and ISA paths it runs on.

    python scripts/output_fingerprints.py --save before.json   # on the old tree
    python scripts/output_fingerprints.py --check before.json  # on the new tree

``--check`` prints every case whose bytes differ and exits 1 if any does.
Only the ISA paths this CPU supports run; a file saved on another CPU checks
the paths both have.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import sys
import zlib

import torch

import kt_ops
from kt_ops.nn import MoEExperts

# (weight_format, group_size, symmetric, H, I): sizes legal for each format
# (k-quants need K % 256 == 0; odd N exercises the partial last block).
FORMATS = [
    ("bf16", None, True, 130, 70),
    ("int8", None, True, 130, 70),
    ("int4", 32, True, 160, 96),
    ("int4", 128, True, 256, 384),
    ("int4", 64, False, 192, 128),
    ("fp8", None, True, 130, 200),
    ("fp8_channel", None, True, 130, 70),
    ("mxfp8", None, True, 130, 70),
    ("mxfp4", None, True, 160, 96),
    ("nvfp4", None, True, 160, 96),
    ("int4", 0, False, 130, 70),
    ("q8_0", None, True, 160, 96),
    ("q4_0", None, True, 160, 96),
    ("q4_k", None, True, 256, 256),
    ("q5_k", None, True, 256, 256),
    ("q6_k", None, True, 256, 256),
    ("q4_k,q4_k,q6_k", None, True, 256, 256),
    ("int8,int4,q8_0", 32, True, 160, 96),
]
TOKENS = (0, 1, 2, 5, 17, 40)
E, K = 6, 3


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()[:24]


def make_experts(fmt: str, group: int | None, symmetric: bool, H: int, I: int):  # noqa: E741
    g = torch.Generator().manual_seed(zlib.crc32(f"{fmt}/{H}/{I}".encode()))
    gate = torch.randn(E, I, H, generator=g) / H**0.5
    up = torch.randn(E, I, H, generator=g) / H**0.5
    down = torch.randn(E, H, I, generator=g) / I**0.5
    kw = {} if fmt == "bf16" else {"group_size": group, "symmetric": symmetric}
    return MoEExperts.from_dense(gate, up, down, fmt, **kw)


def routing(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else None
    if ids is None:
        ids = torch.zeros(0, K, dtype=torch.long)
    ids = ids.clone()
    if T > 2:
        ids[1, 0] = -1  # a skipped slot
    weights = torch.softmax(torch.randn(T, K, generator=g), -1)
    return ids, weights


def brgemm_runs(fmt: str, isa: str) -> bool:
    """Whether oneDNN's brgemm computes some projection of ``fmt`` on ISA path ``isa``."""
    with kt_ops.use_compute_path("brgemm"):
        paths = kt_ops.compute_paths(isa)
    return any(paths[f]["brgemm_kernel"] for f in fmt.split(","))


def cases():
    for fmt, group, sym, H, I in FORMATS:  # noqa: E741
        experts = make_experts(fmt, group, sym, H, I)
        modes = ("q8", "fp32", "auto") if fmt != "bf16" else ("auto",)
        for isa, mode, path, T, dtype in itertools.product(
            kt_ops.supported_isas(),
            modes,
            ("streaming", "brgemm"),
            TOKENS,
            (torch.float32, torch.bfloat16),
        ):
            if path == "brgemm" and not brgemm_runs(fmt, isa):
                continue
            g = torch.Generator().manual_seed(T * 7 + 1)
            x = torch.randn(T, H, generator=g).to(dtype)
            ids, w = routing(T, T + 3)
            with (
                kt_ops.use_isa(isa),
                kt_ops.use_quant_activations(mode),
                kt_ops.use_compute_path(path),
                torch.no_grad(),
            ):
                out = experts(x, ids, w)
            suffix = "" if path == "streaming" else "/brgemm"
            tag = "sym" if sym else "asym"
            yield f"fwd/{fmt}/g{group}/{tag}/{isa}/{mode}{suffix}/T{T}/{dtype}", out
        # LoRA forward + backward (ATen path; ISA-independent but run once per format).
        lora = make_experts(fmt, group, sym, H, I)
        lora.add_lora(4, 8, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            for p in lora.lora_parameters().values():
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(6)))
        for T in (1, 17):
            x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).requires_grad_()
            ids, w = routing(T, T + 11)
            w.requires_grad_()
            out = lora(x, ids, w)
            out.square().sum().backward()
            yield f"lora/{fmt}/T{T}/out", out
            yield f"lora/{fmt}/T{T}/dx", x.grad
            yield f"lora/{fmt}/T{T}/dw", w.grad
            for name, p in lora.lora_parameters().items():
                yield f"lora/{fmt}/T{T}/d{name}", p.grad
                p.grad = None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", metavar="FILE")
    group.add_argument("--check", metavar="FILE")
    args = ap.parse_args()
    kt_ops.set_num_threads(2)
    got = {name: digest(t) for name, t in cases()}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(got, f, indent=0, sort_keys=True)
        print(f"saved {len(got)} fingerprints to {args.save}")
        return 0
    with open(args.check) as f:
        want = json.load(f)
    common = sorted(set(want) & set(got))
    bad = [n for n in common if want[n] != got[n]]
    for n in bad:
        print(f"DIFFERS: {n}")
    missing = sorted(set(want) - set(got))
    print(
        f"{len(common) - len(bad)}/{len(common)} cases bit-identical; {len(bad)} differ; "
        f"{len(missing)} saved cases not run here; {len(set(got) - set(want))} new"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
