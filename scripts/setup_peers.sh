#!/usr/bin/env bash
# Idempotent set-up of the virtual environment that benchmarks/bench_peers.py runs kt-kernel in.
#   - venv: $KT_OPS_PEERS_VENV (default ~/.cache/kt_ops/peers-venv), made with
#     --system-site-packages so that the installed torch and kt_ops (editable) stay visible
#   - kt-kernel $KT_KERNEL_VERSION (default 0.7.2) from PyPI with --no-deps: its metadata pins
#     torch==2.9.1, which would replace the torch kt_ops is built against; the wheel's CPU
#     extensions run with the installed torch
#   - what `import kt_kernel` needs besides torch: numpy, safetensors, gguf (+ pyyaml, tqdm),
#     also --no-deps; a constraints file pins the installed torch so pip never resolves another
# Nothing outside the venv is touched (no apt, no build, kt_ops is not reinstalled).
set -euo pipefail
PY=${PYTHON:-python3}
VENV=${KT_OPS_PEERS_VENV:-$HOME/.cache/kt_ops/peers-venv}
VERSION=${KT_KERNEL_VERSION:-0.7.2}

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[setup_peers] $PY has no torch; install kt_ops first (scripts/setup.sh)" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup_peers] creating $VENV (--system-site-packages)"
  "$PY" -m venv --system-site-packages "$VENV"
fi
VPY="$VENV/bin/python"

if "$VPY" -c "import importlib.metadata as m, sys; sys.exit(m.version('kt-kernel') != '$VERSION')" \
  2>/dev/null && "$VPY" -c "import kt_kernel" >/dev/null 2>&1; then
  echo "[setup_peers] kt-kernel $VERSION already installed in $VENV"
else
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  "$PY" -c "import torch; print('torch==' + torch.__version__)" >"$constraints"
  echo "[setup_peers] installing kt-kernel==$VERSION (--no-deps, $(cat "$constraints") kept)"
  "$VPY" -m pip install -q --no-deps -c "$constraints" \
    "kt-kernel==$VERSION" numpy safetensors gguf pyyaml tqdm
fi

# The check that matters: both packages import in the venv, with the system torch.
"$VPY" - <<'PY'
import torch
import kt_kernel
import kt_ops

print(
    f"[setup_peers] ok: torch {torch.__version__}, kt_kernel {kt_kernel.__version__} "
    f"(cpu variant {kt_kernel.__cpu_variant__}), kt_ops {kt_ops.__version__}"
)
PY
echo "[setup_peers] run: $VPY benchmarks/bench_peers.py"
