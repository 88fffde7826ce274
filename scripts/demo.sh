#!/usr/bin/env bash
# The main job: set up (idempotent), then run a Hugging Face MoE model's experts
# through kt_ops and check it against the unmodified model. Extra arguments go
# to the demo (python -m kt_ops.demo --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec "${PYTHON:-python3}" -m kt_ops.demo "$@"
