#!/usr/bin/env bash
# Idempotent set-up of everything kt_ops needs, then an editable build.
#   - system: a C++17 compiler, CMake >= 3.18, pkg-config, hwloc headers
#     (Debian/Ubuntu: apt-get install build-essential cmake pkg-config libhwloc-dev)
#   - torch: $KT_OPS_TORCH (default torch==2.13.0) when no torch is installed;
#     an installed torch >= 2.4 (CPU or CUDA build; no CUDA toolkit needed) is kept as it is
#   - Python packages: requirements.txt
#   - kt_ops itself: pip install --no-build-isolation -e .
# Set KT_OPS_SKIP_APT=1 to never call apt-get (then install the system packages yourself).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

need_system_pkgs() {
  ! pkg-config --exists hwloc 2>/dev/null || ! command -v cmake >/dev/null || ! command -v g++ >/dev/null
}
if need_system_pkgs; then
  if [ "${KT_OPS_SKIP_APT:-0}" != 1 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[kt_ops setup] installing system packages (hwloc, cmake, pkg-config, g++)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential cmake pkg-config libhwloc-dev >/dev/null
  else
    echo "[kt_ops setup] missing system packages: install a C++17 compiler, cmake, pkg-config and" >&2
    echo "               the hwloc development files (Debian: libhwloc-dev), then rerun" >&2
    exit 1
  fi
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[kt_ops setup] installing ${KT_OPS_TORCH:=torch==2.13.0}"
  "$PY" -m pip install -q "${KT_OPS_TORCH}"
fi
# The installed torch stays: pip may not swap it while installing the requirements.
torch_version=$("$PY" -c "import importlib.metadata as m; print(m.version('torch'))")
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==${torch_version}" >"$constraints"
"$PY" -m pip install -q -c "$constraints" -r requirements.txt
# Test-only: compressed-tensors, the independent producer of the quantized checkpoints in
# tests/test_quantized_checkpoints.py (it needs torch >= 2.10; those tests skip without it).
"$PY" -m pip install -q -c "$constraints" "compressed-tensors==0.20.0" \
  || echo "[kt_ops setup] compressed-tensors not installed (torch ${torch_version}): its tests skip"

# Rebuild only when the sources, the interpreter or its torch changed since the last build, or
# the installed kt_ops is not this checkout's (checked outside the checkout, where the
# current directory would shadow the install).
stamp=build/.kt_ops_build_stamp
built_for="$("$PY" -c "import sys; print(sys.executable)") torch ${torch_version}"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$built_for" ] \
   || [ -n "$(find csrc CMakeLists.txt cmake setup.py pyproject.toml -newer "$stamp" -print -quit)" ] \
   || ! (cd / && "$PY" -c "import sys, kt_ops._C, kt_ops; sys.exit(kt_ops.__file__ != sys.argv[1])" \
          "$OLDPWD/kt_ops/__init__.py") 2>/dev/null; then
  echo "[kt_ops setup] building kt_ops for ${built_for} (pip install --no-build-isolation -e .)"
  "$PY" -m pip install -q --no-build-isolation --no-deps -e .
  mkdir -p build && echo "$built_for" >"$stamp"
fi
