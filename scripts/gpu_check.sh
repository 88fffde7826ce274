#!/usr/bin/env bash
# The CPU/GPU hybrid path on a real NVIDIA GPU, in one run: build kt_ops with the CUDA
# bridge against the torch already installed, run the CUDA tests, the CUDA-graph greedy
# decode and the demo on --device cuda, time the bridge (benchmarks/bench_hybrid_cuda.py),
# and print one summary. Made for GPU machines that reach no package index.
#
#   bash scripts/gpu_check.sh --prepare   # on a machine WITH network (Debian/Ubuntu, apt):
#                                         # fills .gpu_check/ (git-ignored, ~15 MB) with what
#                                         # a bare GPU machine may lack
#   bash scripts/gpu_check.sh             # on the GPU machine (copy .gpu_check/ along);
#                                         # without a GPU: prints "no GPU" and exits 0
#
# .gpu_check/ holds hwloc (Debian's libhwloc15 + libhwloc-dev, and libudev1, unpacked; used
# only when the machine has no hwloc of its own) and the wheels of the Python packages the
# tests pin in requirements.txt (transformers, peft, gguf, expecttest; installed into a
# temporary folder put first on PYTHONPATH, never into the machine's environment).
#
# Environment: PYTHON (python3), OUT (folder for the logs; default build/gpu_check),
# KT_GPU_CHECK_PYTHON_VERSION (3.12: the wheels' target for --prepare),
# KT_GPU_CHECK_BENCH_ARGS (extra arguments of bench_hybrid_cuda.py).
# Exit status: 0 when every step passed (or no GPU), 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
DEPS=$ROOT/.gpu_check

prepare() {
  set -e
  rm -rf "$DEPS" && mkdir -p "$DEPS/debs" "$DEPS/wheels"
  (cd "$DEPS/debs" && { apt-get download libhwloc15 libhwloc-dev libudev1 2>/dev/null \
    || { apt-get update -qq && apt-get download libhwloc15 libhwloc-dev libudev1; }; })
  for f in "$DEPS"/debs/libhwloc*.deb; do dpkg -x "$f" "$DEPS/hwloc"; done
  dpkg -x "$DEPS"/debs/libudev1_*.deb "$DEPS/udev"
  rm -rf "$DEPS/debs"
  # hwloc.pc says prefix=/usr: make it relative to where the folder ends up.
  sed -i 's|^prefix=.*|prefix=${pcfiledir}/../../..|' "$DEPS"/hwloc/usr/lib/*/pkgconfig/hwloc.pc
  local pins=()
  for pkg in transformers peft gguf expecttest; do
    pin=$(grep -E "^${pkg}([=<>~ ]|$)" requirements.txt | head -1 | tr -d ' ')
    pins+=("${pin:-$pkg}")
  done
  "$PY" -m pip download -q --no-deps --only-binary=:all: \
    --python-version "${KT_GPU_CHECK_PYTHON_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEPS/wheels" "${pins[@]}"
  echo "[gpu_check --prepare] $(du -sh "$DEPS" | cut -f1) in $DEPS:"
  ls "$DEPS/wheels" "$DEPS"/hwloc/usr/lib/*/ | sed 's/^/  /'
}

if [ "${1:-}" = --prepare ]; then
  prepare
  exit 0
fi
if [ $# -gt 0 ]; then
  echo "usage: bash scripts/gpu_check.sh [--prepare]" >&2
  exit 2
fi

LOG=${OUT:-$ROOT/build/gpu_check}
mkdir -p "$LOG"
SUMMARY=$LOG/summary.txt
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
started=$SECONDS

# --- 0. Is there a GPU that torch can use? -------------------------------------------
gpu=$("$PY" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')" 2>&1)
if [ $? -ne 0 ]; then
  say "gpu_check: FAIL: $PY cannot import torch: $gpu"
  exit 1
fi
if [ -z "$gpu" ]; then
  say "gpu_check: no GPU ($PY's torch $("$PY" -c 'import torch; print(torch.__version__)') sees no CUDA device); nothing to check"
  exit 0
fi
torch_v=$("$PY" -c "import torch; print(torch.__version__)")
say "gpu_check: $gpu; torch $torch_v; $(nproc) CPUs; $("$PY" --version 2>&1)"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader >>"$SUMMARY" 2>&1

# --- 1. What this machine lacks, from .gpu_check/ -------------------------------------
if compgen -G "$DEPS/wheels/*.whl" >/dev/null; then
  site=$(mktemp -d /tmp/kt_gpu_check_site.XXXXXX)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$DEPS"/wheels/*.whl >"$LOG/wheels.log" 2>&1 || say "  wheels: install failed (see wheels.log)"
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  say "  wheels: $(ls "$DEPS"/wheels | sed 's/-py3.*//' | tr '\n' ' ')"
fi
has_hwloc() {
  { command -v pkg-config >/dev/null && pkg-config --exists hwloc; } \
    || { [ -f /usr/include/hwloc.h ] && ldconfig -p | grep -q 'libhwloc\.so '; }
}
if has_hwloc; then
  say "  hwloc: the machine's own"
elif [ -d "$DEPS/hwloc" ]; then
  libdir=$(dirname "$(ls "$DEPS"/hwloc/usr/lib/*/libhwloc.so.15 | head -1)")
  export HWLOC_ROOT=$DEPS/hwloc/usr PKG_CONFIG_PATH=$libdir/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  export LD_LIBRARY_PATH=$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  if ! ldconfig -p | grep -q 'libudev\.so\.1 '; then
    export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$(dirname "$(ls "$DEPS"/udev/*/lib*/*/libudev.so.1 "$DEPS"/udev/usr/lib/*/libudev.so.1 2>/dev/null | head -1)")
  fi
  say "  hwloc: from .gpu_check/hwloc (pkg-config: $(command -v pkg-config || echo none))"
else
  say "gpu_check: FAIL: no hwloc here and no .gpu_check/hwloc: run 'bash scripts/gpu_check.sh --prepare' on a machine with network, and copy .gpu_check/ along"
  exit 1
fi

# --- 2. Build with the CUDA bridge --------------------------------------------------
status=0
t0=$SECONDS
# RelWithDebInfo: -O3 all the same (CMakeLists.txt), with symbols for crash.log's backtraces.
if KT_OPS_CUDA_BRIDGE=ON KT_OPS_BUILD_JOBS=$(nproc) KT_OPS_BUILD_TYPE=${KT_OPS_BUILD_TYPE:-RelWithDebInfo} \
   timeout 600 "$PY" setup.py -q build_ext \
     --inplace >"$LOG/build.log" 2>&1 \
   && "$PY" -c "import kt_ops.hybrid as h, sys; sys.exit(not h.cuda_bridge_built())" >>"$LOG/build.log" 2>&1; then
  say "  build: OK in $((SECONDS - t0)) s (CUDA bridge on)"
else
  say "gpu_check: FAIL: the build (last lines of build.log):"
  tail -25 "$LOG/build.log" | tee -a "$SUMMARY"
  exit 1
fi
export HF_HUB_OFFLINE=1 PYTHONPATH=$ROOT:$PYTHONPATH

# --- 3. The CUDA tests ----------------------------------------------------------------
# One pytest process per file (scripts/gpu_check_pytest.py): a crash loses nothing, its
# test is re-run under cuda-gdb/gdb for a backtrace (crash.log), and the rest goes on.
t0=$SECONDS
# The bridge's GPU and host-transport tests share a process: state the GPU tests leave
# (the pool, staging, a deferred error) must not break the host-side ones.
timeout 900 "$PY" scripts/gpu_check_pytest.py "$LOG" \
  "tests/test_cuda_bridge.py tests/test_cuda_bridge_host.py" tests/test_hybrid_experts.py \
  tests/test_compat.py tests/test_parallel_backend.py \
  "tests/test_errors.py::test_cuda_tensor_on_cpu_build" \
  "tests/test_quant_errors.py::test_cuda_scales_on_cpu_build" | tee -a "$SUMMARY"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
say "  tests took $((SECONDS - t0)) s (logs: tests.log, test_events.log, crash.log)"

# --- 4. The demo on --device cuda -----------------------------------------------------
t0=$SECONDS
timeout 600 "$PY" -m kt_ops.demo --device cuda --gpu-experts 8 >"$LOG/demo.log" 2>&1
demo_rc=$?
say "  demo (python -m kt_ops.demo --device cuda --gpu-experts 8), $((SECONDS - t0)) s, exit $demo_rc:"
grep -E "^(kt_ops|reference|speed-up|device|tokens|logits|verdict) " "$LOG/demo.log" \
  | sed 's/^/    /' | tee -a "$SUMMARY"
[ $demo_rc -eq 0 ] || { status=1; tail -15 "$LOG/demo.log" | sed 's/^/    /' | tee -a "$SUMMARY"; }

# --- 5. Timings -------------------------------------------------------------------------
t0=$SECONDS
# shellcheck disable=SC2086
timeout 600 "$PY" benchmarks/bench_hybrid_cuda.py ${KT_GPU_CHECK_BENCH_ARGS:-} >"$LOG/timings.log" 2>&1
bench_rc=$?
say "  timings (benchmarks/bench_hybrid_cuda.py), $((SECONDS - t0)) s, exit $bench_rc:"
sed -n '/^device:/p;/^Bridge cost/,$p' "$LOG/timings.log" | tee -a "$SUMMARY"
[ $bench_rc -eq 0 ] || { status=1; tail -15 "$LOG/timings.log" | tee -a "$SUMMARY"; }

say "gpu_check: $([ $status -eq 0 ] && echo PASS || echo FAIL) in $((SECONDS - started)) s (logs in $LOG)"
exit $status
