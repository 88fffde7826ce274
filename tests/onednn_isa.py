"""Which oneDNN ISA class runs in this process: what oneDNN's verbose header says.

oneDNN picks its kernels' instructions at run time: the CPU's best class, capped by
``ONEDNN_MAX_CPU_ISA`` (read once per process). Its brgemm sums bf16 products in an
order that depends on that class (AMX tiles accumulate 32-pair tile rows, the
AVX512_BF16 kernel one ``vdpbf16ps`` chain per output), so tests that compare
kt_ops' kernels with oneDNN's bit for bit hold only on the class where the orders
are known to agree, and expectations of where the brgemm path runs follow the
class oneDNN runs, not CPUID.

The C API (``dnnl_get_effective_cpu_isa``) is not exported by libtorch, so this
asks a child interpreter with ``ONEDNN_VERBOSE=1`` (same environment) for the
header line ``onednn_verbose,...,info,cpu,isa:<description>``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

#: Classes, lowest first, as ONEDNN_MAX_CPU_ISA spells them. AVX10_1_512 (oneDNN 3.x's
#: name for AVX512_CORE_FP16: AVX512_BF16 plus FP16, Sapphire Rapids and later) sits
#: between BF16 and AMX, as in oneDNN's own order (``dnnl_cpu_isa_t``).
CLASSES = (
    "AVX2",
    "AVX512_CORE",
    "AVX512_CORE_VNNI",
    "AVX512_CORE_BF16",
    "AVX10_1_512",
    "AVX512_CORE_AMX",
)

_PROBE = "import torch\ntorch.randn(4, 4).to_mkldnn()\n"


@functools.cache
def onednn_isa_description() -> str:
    """oneDNN's own description of its ISA in this environment, e.g. ``Intel AVX-512 with
    Intel DL Boost and bfloat16 support``; ``"unknown"`` where no header was printed."""
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    for line in proc.stdout.splitlines():
        if ",info,cpu,isa:" in line:
            return line.split("isa:", 1)[1].strip()
    return "unknown"


def classify(description: str) -> str:
    """The ``CLASSES`` entry of a verbose ISA description (``"unknown"`` if none fits)."""
    if "AMX" in description:
        return "AVX512_CORE_AMX"
    # oneDNN 3.x prints "Intel AVX 10.1" (or "10.1/512") for an AVX512_FP16 CPU without AMX.
    if "AVX 10" in description:
        return "AVX10_1_512"
    if "AVX-512" in description:
        if "bfloat16" in description:
            return "AVX512_CORE_BF16"
        if "DL Boost" in description:
            return "AVX512_CORE_VNNI"
        return "AVX512_CORE"
    if "AVX2" in description:
        return "AVX2"
    return "unknown"


def onednn_isa() -> str:
    """The class oneDNN runs in this process's environment (``CLASSES`` or ``"unknown"``)."""
    return classify(onednn_isa_description())


def at_least(cls: str) -> bool:
    """Whether oneDNN runs ``cls`` or a higher class here."""
    here = onednn_isa()
    return here in CLASSES and CLASSES.index(here) >= CLASSES.index(cls)


def host_classes() -> list[str]:
    """The classes this CPU offers (from /proc/cpuinfo flags), lowest first."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln.split(":", 1)[1].split() for ln in f if ln.startswith("flags")), [])
    except OSError:
        return []
    have = set(flags)
    needs = {
        "AVX2": {"avx2", "fma"},
        "AVX512_CORE": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
        "AVX512_CORE_VNNI": {"avx512_vnni"},
        "AVX512_CORE_BF16": {"avx512_bf16"},
        "AVX10_1_512": {"avx512_fp16"},
        "AVX512_CORE_AMX": {"amx_tile", "amx_bf16", "amx_int8"},
    }
    out = []
    for cls in CLASSES:
        if not needs[cls] <= have:
            break
        out.append(cls)
    return out


if __name__ == "__main__":
    # ``python tests/onednn_isa.py --below-top``: the host's classes under its best one
    # (scripts/test.sh reruns the brgemm tests capped at each); no argument: this class.
    if sys.argv[1:] == ["--below-top"]:
        print(" ".join(host_classes()[:-1]))
    else:
        print(onednn_isa(), "|", onednn_isa_description())
