#!/usr/bin/env bash
# Developer rebuild of kt_ops/_C without disturbing running Python processes:
# builds into build/, then renames the new library over the old one (a
# rename keeps the old inode alive for whoever has it mapped).
set -euo pipefail
cd "$(dirname "$0")/.."
python setup.py -q build_ext 2>&1 | grep -v "^copying" || true
so=$(ls -t build/lib*/kt_ops/_C*.so | head -1)
cp "$so" "kt_ops/.$(basename "$so").tmp"
mv -f "kt_ops/.$(basename "$so").tmp" "kt_ops/$(basename "$so")"
echo "installed $so"
