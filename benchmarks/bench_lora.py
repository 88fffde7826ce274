#!/usr/bin/env python
"""Benchmark one LoRA training step through the routed experts: kt_ops vs PyTorch vs kt-kernel.

For one MoE layer (default: Qwen3-30B-A3B: hidden 2048, expert intermediate
768, 128 experts, top-8) with LoRA of rank r (default 8, alpha 16, so scaling
2) on the gate, up and down projections, this times one training step --
forward saving what backward needs, then backward of a fixed ``grad_output``
to the hidden states, the routing weights and the six LoRA factors -- of

* ``kt``           -- ``kt_ops.moe_forward(x, ids, w, packed, kt_ops.LoRAWeights(...))``
  on bf16 hidden states (``--kt-dtype``; fp32 LoRA factors and routing weights)
  saving the gate/up pre-activations (activation checkpointing off), then
  ``out.backward(gy)``; on the base in each ``--formats`` entry (``bf16``,
  ``int8``, ...: ``kt_ops.ExpertWeights.from_dense``);
* ``kt_panels``    -- ``kt`` on the weights with the backward's transposed copy kept
  (``ExpertWeights.with_backward_panels``: 2 bytes more host memory per weight;
  the row is left out where this CPU or base has none);
* ``kt_recompute`` -- the same as ``kt`` with ``activation_checkpointing=True``
  (backward recomputes the pre-activations);
* ``kt_forward``   -- the kt forward alone under ``torch.no_grad`` (no backward);
* ``torch``        -- an eager PyTorch loop over the experts hit
  (``x @ W.T + s * (x @ A.T) @ B.T`` per projection, ``silu(g) * u``,
  ``index_add``; autograd) on fp32 weights (the bf16 weights, upcast);
* ``torch_bf16``   -- the same loop on bf16 weights, bf16 activations, bf16
  LoRA factors and bf16 routing weights (the usual eager baseline);
* ``kt_kernel``    -- kt-kernel 0.7.2's ``kt_kernel.sft.AMXSFTMoEWrapper``
  (method ``AMXBF16_SFT`` for the bf16 base, ``AMXINT8_SFT`` for int8),
  ``wrapper.forward(x, ids, w, save_for_backward=True)`` then
  ``wrapper.backward(gy)``, run in the peers virtualenv
  (``scripts/setup_peers.sh``; ``$KT_OPS_PEERS_VENV``, default
  ``~/.cache/kt_ops/peers-venv``) in a subprocess per method (this script with
  ``--kt-kernel-worker``), so a crash or a method this CPU lacks is reported
  in the table instead of ending the run. Weights, LoRA factors and inputs go
  to it through a temporary ``torch.save`` file; it prints JSON per T. For
  ``AMXINT8_SFT`` (which loads pre-quantized ``.kt`` files only) the worker
  first writes them with kt-kernel's own inference quantizer
  (``AMXInt8_MOE`` in save mode) plus the backward copies
  (``save_backward_weights_from_tensors``); without the latter its backward
  silently drops the base-weight part of the input gradient.

All systems get the same weights (random, seeded, bf16-representable), the
same LoRA factors (bf16-representable), fresh routing every repetition (the
same seeds for every system) and the same ``x`` / ``gy`` per T. One untimed
lead step on routing seed 0, whose outputs and gradients are compared, then
``--reps`` timed steps; medians.

Table columns: ``step ms`` (median), ``vs kt_ops`` = this row's ms / the kt
row's ms on the same base (torch rows: vs the bf16 kt row; > 1: slower),
relative errors ||a - b|| / ||b|| of the output, of dL/dx, of dL/dw (routing
weights) and the worst of the six LoRA-factor gradients, against the kt row
on the same base (kt rows: against ``torch`` fp32 when it runs), ``step
mem`` = peak RSS during the timed steps over the RSS just before them
(activations, gradients, buffers), ``peak RSS`` = the process's peak RSS
during the steps (in-process rows share one process holding every
in-process system's weights; kt-kernel rows: the worker process's
``ru_maxrss``, including the load), and ``roofline`` = the (base, T)
roofline time / this row's time. The roofline per (base, T): the bytes of the
experts hit read twice per step (forward and backward) at ``--read-gbps``
versus the FLOPs of the forward (3 projections, 2*T*K*H*I each) plus the
input-gradient backward (the same) at ``--peak-gflops``; the larger bounds.
Both limits are measured in the same run unless given (``machine_peaks.py``:
the read stream, and torch's bf16 matmul peak on CPUs with AVX512_BF16, whose
bf16 products the step runs on, else its fp32 one).

Usage::

    bash scripts/setup_peers.sh                        # once: the venv with kt-kernel
    python benchmarks/bench_lora.py                    # T = 512, 2048; bf16 and int8
    python benchmarks/bench_lora.py --tokens 64 --experts 16 --hidden 512 \\
        --intermediate 256 --reps 2 --formats bf16 int8      # quick check
    python benchmarks/bench_lora.py --systems kt torch_bf16 kt_kernel --reps 5
    python benchmarks/bench_lora.py --kt-threads 1 2   # kt rows at 1 and 2 threads

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import kt_ops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_ENV = "KT_OPS_PEERS_VENV"
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "kt_ops", "peers-venv")
KT_KERNEL_METHODS = {"bf16": "AMXBF16_SFT", "int8": "AMXINT8_SFT"}
SYSTEMS = ("kt", "kt_panels", "kt_recompute", "kt_forward", "torch", "torch_bf16", "kt_kernel")
PROJ = {"gate": 0, "up": 1, "down": 2}
FACTORS = [f"{p}_lora_{ab}" for p in PROJ for ab in "ab"]
MARK = "@@KT_KERNEL_SFT "


def routing(T: int, E: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    vals, ids = torch.topk(torch.randn(T, E, generator=g), K, dim=1)
    return ids, torch.softmax(vals, dim=1)


def torch_experts(x, ids, w, dense, lora, s):
    """Eager reference: loop over the experts hit, autograd through plain ops."""
    wg, wu, wd = dense
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        xe = x[tok]

        def proj(v, W, p, e=e):
            a, b = lora[f"{p}_lora_a"][e], lora[f"{p}_lora_b"][e]
            return F.linear(v, W[e]) + s * F.linear(F.linear(v, a), b)

        h = F.silu(proj(xe, wg, "gate")) * proj(xe, wu, "up")
        out = out.index_add(0, tok, proj(h, wd, "down") * w[tok, slot, None])
    return out


# --------------------------------------------------------------------------- memory


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Reset the process's peak RSS (``VmHWM``; Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class StepMemory:
    """Peak RSS over the steps run inside the ``with`` block, and over the RSS before it."""

    def __enter__(self):
        self.reset = _reset_peak()
        self.before = _status_kb("VmRSS")
        return self

    def __exit__(self, *exc):
        peak = _status_kb("VmHWM") if self.reset else _status_kb("VmRSS")
        self.peak_mb = peak / 1024
        self.delta_mb = max(0, peak - self.before) / 1024
        return False


def timed_steps(fn, reps: int):
    """``fn(0)`` untimed (its result returned), then ``reps`` timed calls on seeds 1..reps."""
    with StepMemory() as mem:
        first = fn(0)
        times = []
        for i in range(reps):
            t0 = time.perf_counter()
            fn(i + 1)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), first, mem


def rel_err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# --------------------------------------------------------------------------- kt-kernel worker


def kt_kernel_worker(spec_path: str, method: str, out_path: str) -> int:
    """Runs in the peers venv: builds ``AMXSFTMoEWrapper`` and times forward + backward per T.

    Prints one ``MARK``-prefixed JSON line per T (or one with ``error``) and
    saves the lead step's output and gradients to ``out_path``.
    """
    try:
        spec = torch.load(spec_path)
        E, K, H, I, r = (spec[k] for k in ("E", "K", "H", "I", "r"))  # noqa: E741
        threads, reps = spec["threads"], spec["reps"]
        torch.set_num_threads(threads)
        import kt_kernel
        from kt_kernel.sft import AMXSFTMoEWrapper

        kw = dict(
            layer_idx=0,
            num_experts=E,
            num_experts_per_tok=K,
            hidden_size=H,
            moe_intermediate_size=I,
            num_gpu_experts=0,
            cpuinfer_threads=threads,
            threadpool_count=1,
            chunked_prefill_size=max(spec["tokens"]),  # max_len: >= every T of a call
            lora_rank=r,
            lora_alpha=spec["alpha"],
            method=method,
        )
        p2l = torch.arange(E, dtype=torch.int64)
        gate, up, down = spec.pop("gate"), spec.pop("up"), spec.pop("down")
        tmp = None
        t0 = time.perf_counter()
        if method == "AMXBF16_SFT":
            w = AMXSFTMoEWrapper(weight_path=None, **kw)
            w.load_weights_from_tensors(gate, up, down, p2l)
        else:  # AMXINT8_SFT: pre-quantized .kt files only; write them with kt-kernel itself
            from kt_kernel_ext.moe import AMXInt8_MOE, MOEConfig

            tmp = tempfile.TemporaryDirectory(prefix="kt_kernel_sft_int8_")
            w = AMXSFTMoEWrapper(weight_path=tmp.name, **kw)
            mask = torch.zeros(E, dtype=torch.bool)
            cfg = MOEConfig(E, K, H, I, mask.data_ptr())
            cfg.layer_idx, cfg.pool, cfg.max_len = (
                0,
                w.cpu_infer.backend_,
                kw["chunked_prefill_size"],
            )
            cfg.save, cfg.load, cfg.path = True, False, tmp.name
            cfg.gate_proj, cfg.up_proj, cfg.down_proj = (t.data_ptr() for t in (gate, up, down))
            q = AMXInt8_MOE(cfg)  # online per-channel int8 from bf16, written under tmp
            w.cpu_infer.submit(q.load_weights_task(p2l.data_ptr()))
            w.cpu_infer.sync()
            del q
            w.load_weights(p2l)
            w.save_backward_weights_from_tensors(gate, up, down, p2l, tmp.name)  # *_bwd_*.kt
            del w
            w = AMXSFTMoEWrapper(weight_path=tmp.name, **kw)  # loads forward + backward files
            w.load_weights(p2l)
        del gate, up, down
        load_s = time.perf_counter() - t0
        lora = {k: v.contiguous() for k, v in spec.pop("lora").items()}
        grads = {k: torch.zeros_like(v) for k, v in lora.items()}
        w.init_lora_weights(*(lora[k] for k in FACTORS), *(grads[k] for k in FACTORS))
        info = {
            "version": kt_kernel.__version__,
            "variant": getattr(kt_kernel, "__cpu_variant__", "?"),
            "load_s": load_s,
        }
    except Exception as err:  # the method does not build / load here
        print(MARK + json.dumps({"error": f"{type(err).__name__}: {err}"}), flush=True)
        return 0

    saved = {}
    for T in spec["tokens"]:
        x0, gy0 = spec["x"][T], spec["gy"][T]

        def step(i, T=T, x0=x0, gy0=gy0):
            ids, rw = routing(T, E, K, i)
            y = w.forward(x0, ids, rw, save_for_backward=True)
            dx, dw = w.backward(gy0)  # LoRA grads: written into ``grads`` (overwritten)
            return (y, dx, dw, {k: v.clone() for k, v in grads.items()}) if i == 0 else None

        try:
            ms, (y, dx, dw, g), mem = timed_steps(step, reps)
        except Exception as err:
            print(MARK + json.dumps({"T": T, "error": f"{type(err).__name__}: {err}"}), flush=True)
            continue
        saved[T] = {"y": y, "dx": dx, "dw": dw, "grads": g}
        torch.save(saved, out_path)
        row = {
            "T": T,
            "ms": ms,
            "step_mem_mb": mem.delta_mb,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **info,
        }
        print(MARK + json.dumps(row), flush=True)
    if tmp is not None:
        tmp.cleanup()
    return 0


def run_kt_kernel(method: str, spec_path: str, timeout: float) -> dict:
    """One worker process for ``method``: ``{T: row}``, plus ``"error"`` if it failed."""
    venv_py = os.path.join(os.environ.get(VENV_ENV, DEFAULT_VENV), "bin", "python")
    if not os.path.exists(venv_py):
        return {"error": f"no peers venv at {venv_py} (run scripts/setup_peers.sh)"}
    out_path = spec_path + f".{method}.out"
    path = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    cmd = [venv_py, os.path.abspath(__file__), "--kt-kernel-worker", spec_path, method, out_path]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        out = err.stdout or ""
        text = out.decode(errors="replace") if isinstance(out, bytes) else out
        rc = f"timeout after {timeout:.0f} s"
    res: dict = {}
    for line in text.splitlines():
        if line.startswith(MARK):
            row = json.loads(line[len(MARK) :])
            if "T" in row:
                res[row["T"]] = row
            else:
                res["error"] = row["error"]
    if rc != 0 and "error" not in res:
        why = f"killed by signal {-rc}" if isinstance(rc, int) and rc < 0 else f"exit {rc}"
        tail = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith(MARK)][-3:]
        res["error"] = f"worker {why}" + (f" ({' | '.join(tail)})" if tail else "")
    if os.path.exists(out_path):
        outs = torch.load(out_path)
        for T, o in outs.items():
            if T in res:
                res[T]["out"] = o
        os.remove(out_path)
    return res


# --------------------------------------------------------------------------- in-process systems


def lora_weights(lora: dict, scaling: float) -> kt_ops.LoRAWeights:
    """``{p}_lora_{a,b}`` factors as the op's :class:`kt_ops.LoRAWeights`."""
    pairs = {p: (lora[f"{p}_lora_a"], lora[f"{p}_lora_b"]) for p in PROJ}
    return kt_ops.LoRAWeights(**pairs, scaling=scaling)


def leaf_lora(lora: dict, dtype=torch.float32) -> dict:
    return {k: v.to(dtype).clone().requires_grad_() for k, v in lora.items()}


def make_step(run_forward, T, E, K, x0, gy0, lora, dtype=torch.float32, rw_dtype=None):
    """A training step: fresh routing, forward, ``out.backward(gy)``; returns what to compare.

    ``dtype``: of the hidden states and of ``gy``; ``rw_dtype``: of the routing weights
    (default ``dtype``)."""

    def step(i):
        ids, rw = routing(T, E, K, i)
        x = x0.to(dtype, copy=True).requires_grad_()
        rw = rw.to(rw_dtype or dtype, copy=True).requires_grad_()
        for v in lora.values():
            v.grad = None
        y = run_forward(x, ids, rw)
        y.backward(gy0.to(dtype))
        if i == 0:
            return y.detach(), x.grad, rw.grad, {k: v.grad for k, v in lora.items()}

    return step


def expert_bytes(packed) -> int:
    return sum(t.numel() * t.element_size() for t in packed.tensors() if torch.is_tensor(t))


def fmt_mb(mb) -> str:
    return "-" if mb is None else f"{mb:,.0f}"


def fmt_err(e) -> str:
    return "-" if e is None else f"{e:.2e}"


def errors(got, ref) -> dict:
    """Relative errors of (y, dx, dw, lora grads) against ``ref``'s."""
    if got is None or ref is None:
        return {}
    y, dx, dw, g = got
    ry, rdx, rdw, rg = ref
    return {
        "out": rel_err(y, ry),
        "dx": rel_err(dx, rdx),
        "dw": rel_err(dw, rdw),
        "lora": max(rel_err(g[k], rg[k]) for k in FACTORS),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha (scaling alpha / rank)")
    ap.add_argument("--formats", nargs="+", default=["bf16", "int8"], help="base weight formats")
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--reps", type=int, default=3, help="timed steps per system and T")
    ap.add_argument("--threads", type=int, help="torch and kt-kernel threads (default: kt_ops')")
    ap.add_argument(
        "--kt-threads", type=int, nargs="+", help="kt_ops thread counts (default: --threads)"
    )
    ap.add_argument(
        "--read-gbps",
        type=float,
        default=None,
        help="read bandwidth, roofline (default: measured in this run, machine_peaks.py)",
    )
    ap.add_argument(
        "--peak-gflops",
        type=float,
        default=None,
        help="compute peak, roofline (default: measured in this run: torch's bf16 matmul "
        "where the CPU has AVX512_BF16, whose bf16 products the step runs on, else fp32)",
    )
    ap.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds per kt-kernel run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--kt-dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="kt_ops' hidden states and output gradient (bf16: as kt-kernel's and a bf16 model's)",
    )
    ap.add_argument(
        "--bf16-kernel",
        choices=["auto", "kt", "onednn"],
        default="auto",
        help="kt_ops.config.brgemm_bf16_kernel for every kt row (onednn: the AMX hosts' "
        "kernel; its kept backward panels are 64 columns wide)",
    )
    ap.add_argument(
        "--kt-kernel-worker", nargs=3, metavar=("SPEC", "METHOD", "OUT"), help=argparse.SUPPRESS
    )
    args = ap.parse_args()
    if args.kt_kernel_worker:
        return kt_kernel_worker(*args.kt_kernel_worker)

    kt_ops.config.brgemm_bf16_kernel = args.bf16_kernel  # before the panels take its width
    E, H, I, K, r = args.experts, args.hidden, args.intermediate, args.top_k, args.rank  # noqa: E741
    s = args.alpha / r
    systems = set(args.systems)
    threads = args.threads or kt_ops.get_num_threads()
    kt_threads = args.kt_threads or [threads]
    torch.set_num_threads(threads)
    if args.read_gbps is None or args.peak_gflops is None:
        # The limits of this run, at the kt_ops thread count (as machine_peaks.py).
        import machine_peaks

        peaks = machine_peaks.measure(kt_threads[-1])
        bf16 = kt_ops.info()["cpu_features"]["avx512_bf16"]
        args.read_gbps = args.read_gbps or peaks.read_gbs
        args.peak_gflops = args.peak_gflops or (peaks.bf16_gflops if bf16 else peaks.fp32_gflops)
        print(f"limits: {machine_peaks.describe(peaks)}")
    g = torch.Generator().manual_seed(args.seed)
    bf = torch.bfloat16
    dense = [
        (torch.randn(E, n, k, generator=g) / k**0.5).to(bf).float()
        for n, k in ((I, H), (I, H), (H, I))
    ]
    dims = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    lora = {}
    for p, (n, k) in dims.items():
        lora[f"{p}_lora_a"] = (torch.randn(E, r, k, generator=g) / k**0.5).to(bf).float()
        lora[f"{p}_lora_b"] = (torch.randn(E, n, r, generator=g) * 0.01).to(bf).float()
    xs = {T: torch.randn(T, H, generator=g).to(bf).float() for T in args.tokens}
    gys = {T: (torch.randn(T, H, generator=g) / T).to(bf).float() for T in args.tokens}

    print(
        f"E={E} H={H} I={I} K={K} r={r} alpha={args.alpha:g} (scaling {s:g}); bases "
        f"{args.formats}; threads: kt_ops {kt_threads}, torch {torch.get_num_threads()}, "
        f"kt-kernel {threads}; kt_ops ISA {kt_ops.active_isa()}, bf16 kernel "
        f"{args.bf16_kernel}; medians of {args.reps} "
        f"steps after 1 lead step",
        flush=True,
    )

    # kt-kernel first, one worker process per method (all T in it; max_len = the largest T)
    peer: dict = {}
    if "kt_kernel" in systems:
        with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
            spec_path = os.path.join(tmp, "spec.pt")
            spec = {
                "E": E, "K": K, "H": H, "I": I, "r": r, "alpha": args.alpha,
                "threads": threads, "reps": args.reps, "tokens": list(args.tokens),
                "gate": dense[0].to(bf), "up": dense[1].to(bf), "down": dense[2].to(bf),
                "lora": {k: v.to(bf) for k, v in lora.items()},
                "x": {T: x.to(bf) for T, x in xs.items()},
                "gy": {T: gy.to(bf) for T, gy in gys.items()},
            }  # fmt: skip
            torch.save(spec, spec_path)
            del spec
            for fmt in args.formats:
                method = KT_KERNEL_METHODS.get(fmt)
                if method is None:
                    peer[fmt] = {"error": f"no kt-kernel SFT method for base {fmt}"}
                    continue
                t0 = time.perf_counter()
                peer[fmt] = res = run_kt_kernel(method, spec_path, args.peer_timeout)
                done = [T for T in args.tokens if T in res]
                info = next((res[T] for T in done), {})
                print(
                    f"# kt-kernel {method}: {time.perf_counter() - t0:.0f}s, T done {done}"
                    + (
                        f", kt_kernel {info['version']} ({info['variant']}), weights loaded in "
                        f"{info['load_s']:.1f}s"
                        if info
                        else ""
                    )
                    + (f"; ERROR {res['error']}" if "error" in res else ""),
                    flush=True,
                )

    packed = {fmt: kt_ops.ExpertWeights.from_dense(*dense, fmt) for fmt in args.formats}
    with_panels = {}  # kt_panels: the weights with the backward's transposed copy kept
    if "kt_panels" in systems:
        for fmt in args.formats:
            t0 = time.perf_counter()
            w = packed[fmt].with_backward_panels()
            ms = (time.perf_counter() - t0) * 1e3
            mb = w.backward_panels_nbytes / 1e6
            print(f"# backward panels of {fmt}: {mb:,.0f} MB, made in {ms:,.0f} ms")
            with_panels[fmt] = w
    kt_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.kt_dtype]
    bpe = {fmt: expert_bytes(p) / E for fmt, p in packed.items()}
    dense_bf16 = [d.to(bf) for d in dense] if "torch_bf16" in systems else None
    notes = []
    for T in args.tokens:
        x0, gy0 = xs[T], gys[T]
        rows = []  # (system, base, ms, result, mem, ref_key)
        results = {}

        def run(label, base, step, key, rows=rows, results=results):
            ms, res, mem = timed_steps(step, args.reps)
            rows.append(
                dict(system=label, base=base, ms=ms, mem=mem.delta_mb, rss=mem.peak_mb, key=key)
            )
            results[key] = res

        if "torch" in systems:
            lt = leaf_lora(lora)
            fwd = lambda x, ids, rw, lt=lt: torch_experts(x, ids, rw, dense, lt, s)  # noqa: E731
            step = make_step(fwd, T, E, K, x0, gy0, lt)
            run("torch eager fp32", "bf16 (fp32 copy)", step, "torch")
        if "torch_bf16" in systems:
            lt = leaf_lora(lora, bf)
            fwd = lambda x, ids, rw, lt=lt: torch_experts(x, ids, rw, dense_bf16, lt, s)  # noqa: E731
            run("torch eager bf16", "bf16", make_step(fwd, T, E, K, x0, gy0, lt, bf), "torch_bf16")
        for fmt in args.formats:
            for nt in kt_threads:
                kt_ops.set_num_threads(nt)
                if "kt" in systems:
                    lk = leaf_lora(lora)

                    def fwd(x, ids, rw, lk=lk, fmt=fmt):
                        return kt_ops.moe_forward(x, ids, rw, packed[fmt], lora_weights(lk, s))

                    step = make_step(fwd, T, E, K, x0, gy0, lk, kt_dtype, torch.float32)
                    run(f"kt_ops ({nt}t)", fmt, step, f"kt:{fmt}:{nt}")
                if "kt_panels" in systems and with_panels[fmt].backward_panels is not None:
                    lk = leaf_lora(lora)

                    def fwd(x, ids, rw, lk=lk, fmt=fmt):
                        lw = lora_weights(lk, s)
                        return kt_ops.moe_forward(x, ids, rw, with_panels[fmt], lw)

                    step = make_step(fwd, T, E, K, x0, gy0, lk, kt_dtype, torch.float32)
                    run(f"kt_ops backward panels ({nt}t)", fmt, step, f"ktp:{fmt}:{nt}")
                if "kt_recompute" in systems:
                    lk = leaf_lora(lora)

                    def fwd(x, ids, rw, lk=lk, fmt=fmt):
                        lw = lora_weights(lk, s)
                        return kt_ops.moe_forward(
                            x, ids, rw, packed[fmt], lw, activation_checkpointing=True
                        )

                    step = make_step(fwd, T, E, K, x0, gy0, lk, kt_dtype, torch.float32)
                    run(f"kt_ops recompute ({nt}t)", fmt, step, f"ktr:{fmt}:{nt}")
                if "kt_forward" in systems:
                    xk = x0.to(kt_dtype)

                    def fwd_only(i, fmt=fmt, T=T, x0=xk):
                        ids, rw = routing(T, E, K, i)
                        with torch.no_grad():
                            kt_ops.moe_forward(x0, ids, rw, packed[fmt], lora_weights(lora, s))

                    run(f"kt_ops forward only ({nt}t)", fmt, fwd_only, f"ktf:{fmt}:{nt}")
            kt_ops.set_num_threads(threads)
            if "kt_kernel" in systems:
                res = peer.get(fmt, {})
                method = KT_KERNEL_METHODS.get(fmt)
                row = res.get(T)
                if method is None:
                    why = f"kt-kernel has no SFT method for base {fmt} here"
                    rows.append(dict(system="kt-kernel SFT", base=fmt, ms=None, why=why))
                elif row is None:
                    why = res.get("error", "no result")
                    rows.append(dict(system=f"kt-kernel {method}", base=fmt, ms=None, why=why))
                    notes.append(f"kt-kernel {method} T={T}: not available on this CPU: {why}")
                else:
                    o = row.get("out")
                    got = None if o is None else (o["y"], o["dx"], o["dw"], o["grads"])
                    rows.append(
                        dict(
                            system=f"kt-kernel {method} ({threads}t)",
                            base=fmt,
                            ms=row["ms"],
                            mem=row["step_mem_mb"],
                            rss=row["peak_rss_mb"],
                            got=got,
                            key="",
                        )
                    )

        # errors: kt rows vs torch fp32, everything else vs the kt row of its base
        for row in rows:
            fmt = "bf16" if row["base"].startswith("bf16") else row["base"]
            key = row.get("key", "")
            got = row.get("got", results.get(key))
            main_kt = f"kt:{fmt}:{kt_threads[-1]}"
            ref = results.get("torch") if key.startswith("kt:") else results.get(main_kt)
            row["err"] = errors(got, ref) if got is not None and key != "torch" else {}
            kt_row = next((x for x in rows if x.get("key") == main_kt), None)
            row["ratio"] = None if kt_row is None or row["ms"] is None else row["ms"] / kt_row["ms"]

        # roofline per base: distinct experts hit (routing seed 1) x bytes, read twice per step
        hit = torch.unique(routing(T, E, K, 1)[0]).numel()
        flops = 2 * (3 * 2 * T * K * H * I)  # forward + input-gradient backward
        roof = {}
        for fmt in dict.fromkeys([*args.formats, "bf16"]):
            mb = hit * bpe.get(fmt, 3 * H * I * 2) / 1e6
            t_bw = 2 * mb / 1e3 / args.read_gbps * 1e3
            t_fl = flops / 1e9 / args.peak_gflops * 1e3
            roof[fmt] = max(t_bw, t_fl)
            print(
                f"roofline {fmt} T={T}: weights 2 x {mb:,.1f} MB ({hit} experts) / "
                f"{args.read_gbps:.1f} GB/s = {t_bw:.1f} ms; {flops / 1e9:.1f} GFLOP "
                f"(fwd + input-grad bwd) / {args.peak_gflops:.0f} GFLOP/s = {t_fl:.1f} ms -> "
                f"{max(t_bw, t_fl):.1f} ms ({'memory' if t_bw > t_fl else 'compute'} bound)"
            )
        print()
        head = [
            "system", "base", "T", "step ms", "vs kt_ops", "out err", "dx err", "dw err",
            "LoRA grad err", "step mem MB", "peak RSS MB", "roofline",
        ]  # fmt: skip
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" for _ in head) + "|")
        for row in rows:
            fmt = "bf16" if row["base"].startswith("bf16") else row["base"]
            if row["ms"] is None:
                cells = [row["system"], row["base"], str(T), "n/a: " + row["why"][:80]]
                cells += ["-"] * (len(head) - len(cells))
            else:
                e = row["err"]
                cells = [
                    row["system"],
                    row["base"],
                    str(T),
                    f"{row['ms']:.1f}",
                    "-" if row["ratio"] is None else f"{row['ratio']:.2f}x",
                    fmt_err(e.get("out")),
                    fmt_err(e.get("dx")),
                    fmt_err(e.get("dw")),
                    fmt_err(e.get("lora")),
                    fmt_mb(row.get("mem")),
                    fmt_mb(row.get("rss")),
                    "-" if row["key"].startswith("ktf") else f"{100 * roof[fmt] / row['ms']:.0f}%",
                ]
            print("| " + " | ".join(cells) + " |")
        print(flush=True)
    for n in notes:
        print(n)
    print(
        "vs kt_ops: ms / the kt_ops row's ms on the same base (torch rows: bf16). Errors: "
        "||a - b|| / ||b|| vs that kt_ops row (kt_ops rows: vs torch eager fp32); LoRA grad err: "
        "worst of the six factors. step mem: peak RSS during the steps over the RSS before; "
        "peak RSS: in-process rows share one process (all their weights), kt-kernel rows are "
        "their worker's ru_maxrss. kt_ops forward only: no backward (no roofline)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
