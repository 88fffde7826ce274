#!/usr/bin/env bash
# Sanitizer runs of kt_ops (not part of scripts/test.sh: the ASan build takes
# several minutes).
#
#   scripts/sanitize.sh asan [TEST_FILE ...] [-- PYTEST_ARGS]
#       Builds the extension with -fsanitize=address,undefined into a separate
#       directory ($KT_OPS_SANITIZE_DIR, default /tmp/kt_ops_sanitize: a copy of
#       the kt_ops package plus its own _C*.so; the checkout's build/ and
#       kt_ops/_C*.so are not touched) and runs the test files under it
#       (default: $ASAN_TESTS below). Passes when pytest passes and no
#       sanitizer wrote a report (reports of every process, subprocesses
#       included, go to $KT_OPS_SANITIZE_DIR/reports/).
#   scripts/sanitize.sh tsan [SECONDS]
#       Builds tests/cpp/thread_pool_stress.cpp with csrc/runtime/thread_pool.cpp (+ topology, numa)
#       under ThreadSanitizer and runs it for SECONDS (default 20): run() and
#       parallel_for() from several threads while another resizes the pool.
#   scripts/sanitize.sh all      both, with the defaults.
#
# Environment: KT_OPS_SANITIZE_DIR, KT_OPS_BUILD_JOBS (default: cores),
# CXX (default g++).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${KT_OPS_SANITIZE_DIR:-/tmp/kt_ops_sanitize}"
CXX="${CXX:-g++}"
JOBS="${KT_OPS_BUILD_JOBS:-$(nproc)}"
PYTHON="${PYTHON:-python3}"

ASAN_TESTS=(
  tests/test_formats.py
  tests/test_errors.py
  tests/test_quant_errors.py
  tests/test_loaders.py
  tests/test_convert.py
  tests/test_convert_integrity.py
  tests/test_source_integrity.py
  tests/test_fuzz_loaders.py
  tests/test_runtime.py
  tests/test_runtime_limits.py
  tests/test_moe_forward.py
  tests/test_quant_forward.py
  tests/test_mixed_formats.py
  tests/test_lora.py
  tests/test_lora_quant.py
)

build_asan() {
  local pkg="$DIR/pkg" build="$DIR/build"
  mkdir -p "$pkg" "$build" "$DIR/reports"
  # A copy of the Python package, without the checkout's extension.
  rm -rf "$pkg/kt_ops"
  cp -r "$ROOT/kt_ops" "$pkg/kt_ops"
  find "$pkg/kt_ops" -name '_C*.so' -delete
  find "$pkg/kt_ops" -name '__pycache__' -prune -exec rm -rf {} +
  local prefix flags
  prefix="$("$PYTHON" -c 'import torch.utils, pybind11; print(torch.utils.cmake_prefix_path + ";" + pybind11.get_cmake_dir())')"
  flags="-fsanitize=address,undefined -fno-sanitize=vptr -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g"
  local gen=()
  if "$PYTHON" -c 'import ninja' 2>/dev/null; then gen=(-GNinja); fi
  cmake -S "$ROOT" -B "$build" "${gen[@]}" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_COMPILER="$CXX" \
    -DCMAKE_PREFIX_PATH="$prefix" \
    -DPython_EXECUTABLE="$(command -v "$PYTHON")" \
    -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$pkg/kt_ops" \
    -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_MODULE_LINKER_FLAGS="-fsanitize=address,undefined" \
    -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" >"$DIR/cmake.log"
  cmake --build "$build" -j "$JOBS" >"$DIR/build.log" || {
    tail -40 "$DIR/build.log"
    return 1
  }
  ls "$pkg"/kt_ops/_C*.so >/dev/null
}

run_asan() {
  local tests=() pytest_args=()
  while (($#)); do
    if [[ "$1" == "--" ]]; then
      shift
      pytest_args=("$@")
      break
    fi
    tests+=("$1")
    shift
  done
  ((${#tests[@]})) || tests=("${ASAN_TESTS[@]}")
  echo "== ASan+UBSan: building into $DIR (log: $DIR/build.log)"
  build_asan
  rm -f "$DIR"/reports/*
  local libasan libstdcxx
  libasan="$("$CXX" -print-file-name=libasan.so)"
  libstdcxx="$("$CXX" -print-file-name=libstdc++.so.6)"
  echo "== ASan+UBSan: ${tests[*]}"
  local rc=0
  (
    cd "$ROOT"
    # libasan first, and libstdc++ with it: torch's exceptions must be
    # intercepted by ASan's own __cxa_throw, or the first C++ exception aborts.
    # CPython leaks by design: no leak checking.
    export LD_PRELOAD="$libasan $libstdcxx"
    export ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:log_path=$DIR/reports/asan"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$DIR/reports/ubsan"
    export PYTHONPATH="$DIR/pkg${PYTHONPATH:+:$PYTHONPATH}"
    export HF_HUB_OFFLINE=1
    # -P: no checkout directory ahead of PYTHONPATH (python -m / -c would put
    # the working directory first and import the checkout's kt_ops). Not the
    # PYTHONSAFEPATH variable: the tests' subprocesses need their own cwd.
    "$PYTHON" -P -c 'import kt_ops, sys; sys.exit(0 if kt_ops.__file__.startswith(sys.argv[1]) else 1)' "$DIR/pkg" ||
      { echo "kt_ops is not imported from $DIR/pkg"; exit 3; }
    "$PYTHON" -P -m pytest -q -p no:cacheprovider "${tests[@]}" "${pytest_args[@]}"
  ) || rc=$?
  local reports
  reports="$(find "$DIR/reports" -type f | wc -l)"
  if ((reports)); then
    echo "== sanitizer reports ($reports files):"
    for f in "$DIR"/reports/*; do
      echo "--- $f"
      head -60 "$f"
    done
    rc=1
  fi
  echo "== ASan+UBSan: pytest exit $rc, $reports sanitizer report(s)"
  return "$rc"
}

run_tsan() {
  local seconds="${1:-20}" exe="$DIR/thread_pool_stress_tsan"
  mkdir -p "$DIR"
  echo "== TSan: tests/cpp/thread_pool_stress.cpp for ${seconds}s"
  # shellcheck disable=SC2046
  "$CXX" -std=c++17 -O1 -g -fsanitize=thread -I"$ROOT/csrc" \
    "$ROOT/tests/cpp/thread_pool_stress.cpp" "$ROOT/csrc/runtime/thread_pool.cpp" \
    "$ROOT/csrc/runtime/openmp_team.cpp" "$ROOT/csrc/runtime/topology.cpp" "$ROOT/csrc/runtime/numa.cpp" \
    $(pkg-config --cflags --libs hwloc) -pthread -ldl -o "$exe"
  local rc=0
  env -u LD_PRELOAD TSAN_OPTIONS="halt_on_error=1 exitcode=66" "$exe" "$seconds" || rc=$?
  echo "== TSan: exit $rc"
  return "$rc"
}

mode="${1:-all}"
shift || true
case "$mode" in
  asan) run_asan "$@" ;;
  tsan) run_tsan "$@" ;;
  all)
    run_tsan
    run_asan
    ;;
  *)
    echo "usage: $0 asan [TEST_FILE ...] [-- PYTEST_ARGS] | tsan [SECONDS] | all" >&2
    exit 2
    ;;
esac
