#!/usr/bin/env bash
# The test command: set up (idempotent), lint, the pytest suite, then the brgemm
# tests again under each lower oneDNN ISA class this CPU has.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
"$PY" -m ruff check kt_ops tests benchmarks examples scripts
"$PY" -m ruff format --check kt_ops tests benchmarks examples scripts
"$PY" -m pytest tests "$@"

# oneDNN reads ONEDNN_MAX_CPU_ISA once per process, so each class is a process of
# its own: an AMX host also checks the AVX512_BF16 / VNNI / AVX2 expectations (which
# kernels run, bit-identity where the summation order is kt_ops' own). About 40 s each.
# KT_OPS_TEST_ONEDNN_CLASSES=0 skips this part.
if [[ "${KT_OPS_TEST_ONEDNN_CLASSES:-1}" != 0 ]]; then
  for cls in $("$PY" tests/onednn_isa.py --below-top); do
    echo "[test.sh] ONEDNN_MAX_CPU_ISA=$cls: the brgemm tests"
    ONEDNN_MAX_CPU_ISA=$cls "$PY" -m pytest tests/test_compute_paths.py \
      tests/test_compute_plan.py tests/test_lora.py tests/test_backward_panels.py -q \
      -p no:cacheprovider
  done
fi
