#!/usr/bin/env bash
# One command for a LLaMA-Factory environment next to kt_ops (idempotent, cached):
#
#   bash scripts/setup_llamafactory.sh        # prints the venv's python on its last line
#   "$(bash scripts/setup_llamafactory.sh | tail -1)" -m kt_ops.integrations.llamafactory train ...
#
# It creates a venv with --system-site-packages on top of $PYTHON (default python3), so the
# venv sees that interpreter's torch, transformers, peft and kt_ops, and installs there:
#   - llamafactory==0.9.5 with --no-deps: its own pins (transformers<=5.6.0, peft<=0.18.1,
#     accelerate<=1.11.0, torchaudio) would make pip replace torch and transformers, and
#     peft 0.18.1 cannot load the experts' adapters (kt_ops.peft_adapters needs peft >= 0.21);
#   - the rest of what LLaMA-Factory imports for text SFT (datasets, trl, ...), under a
#     constraints file that this script writes from $PYTHON's installed versions of torch,
#     transformers, peft, accelerate, tokenizers, huggingface_hub, safetensors and numpy,
#     so that none of them moves.
# torchaudio is not installed (no build for torch 2.13); kt_ops.integrations.llamafactory
# serves text-only SFT without it.
#
# Environment: KT_OPS_LF_VENV (default ~/.cache/kt_ops/llamafactory-venv), PYTHON.
# The venv is rebuilt when the constraints (the base environment) or this recipe change.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KT_OPS_LF_VENV:-$HOME/.cache/kt_ops/llamafactory-venv}
LLAMAFACTORY=llamafactory==0.9.5
# What LLaMA-Factory 0.9.5 imports for text SFT that the base environment lacks (at its own
# upper pins).
EXTRA=(datasets==4.0.0 trl==0.24.0 omegaconf)
RECIPE_VERSION=1

log() { echo "[kt_ops llamafactory] $*" >&2; }

constraints=$("$PY" - <<'EOF'
import importlib.metadata as md

for name in ["torch", "transformers", "peft", "accelerate", "tokenizers", "huggingface_hub",
             "safetensors", "numpy"]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        pass
EOF
)
stamp_want="recipe $RECIPE_VERSION $LLAMAFACTORY ${EXTRA[*]}
$constraints"
stamp=$VENV/kt_ops-setup.stamp

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_want" ] &&
  "$VENV/bin/python" -c "import importlib.metadata as m; \
[m.version(p) for p in ('llamafactory', 'datasets', 'trl', 'omegaconf')]" >/dev/null 2>&1; then
  log "up to date: $VENV"
else
  start=$SECONDS
  log "creating $VENV (system site-packages of $("$PY" -c 'import sys; print(sys.executable)'))"
  rm -rf "$VENV"
  "$PY" -m venv --system-site-packages "$VENV"
  echo "$constraints" >"$VENV/kt_ops-constraints.txt"
  pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --no-deps "$LLAMAFACTORY"
  "${pip[@]}" -c "$VENV/kt_ops-constraints.txt" "${EXTRA[@]}"
  DISABLE_VERSION_CHECK=1 "$VENV/bin/python" -c "import kt_ops.integrations.llamafactory as m; \
m._import_llamafactory()" >&2
  echo "$stamp_want" >"$stamp"
  log "ready in $((SECONDS - start)) s: $VENV"
fi
echo "$VENV/bin/python"
