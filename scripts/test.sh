#!/usr/bin/env bash
# The test command: set up (idempotent), lint, then the pytest suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
PY=${PYTHON:-python3}
"$PY" -m ruff check kt_ops tests benchmarks examples scripts
"$PY" -m ruff format --check kt_ops tests benchmarks examples scripts
exec "$PY" -m pytest tests "$@"
