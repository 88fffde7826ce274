#!/usr/bin/env bash
# The measurements an Intel Xeon with AMX owes issues 26 and 27, in one run, so that a
# session that draws such a host spends it on the results, not on assembling commands.
# Runs on any x86 host (it names the CPU class it measured); the figures are for AMX.
#
#   bash scripts/amx_check.sh              # everything (~50 min on 2 cores)
#   bash scripts/amx_check.sh --quick      # tests and break-evens only (~20 min)
#   bash scripts/amx_check.sh --dry-run    # print the steps, run nothing
#
# Steps (each logged to $OUT/<step>.log; a failed step is reported and the rest run):
#   tests        the test command (scripts/test.sh: lint, the suite, then the brgemm tests
#                under each lower oneDNN class), which issue 26 asks to pass on AMX first
#   breakeven-*  bench_compute_paths.py per tile format (bf16 with oneDNN's N = 32 pairs,
#                int8 and int4 per channel on kt_ops' and oneDNN's kernels, int4 g128 on
#                oneDNN's per-group w4a8 against its q8 streaming kernel, fp8, mxfp4 on
#                oneDNN's bf16 brgemm against its q8 streaming kernel): the
#                tokens per expert from which each AMX kernel wins, for the AMX column of
#                csrc/formats/format_table.cpp (today's AMX values are unmeasured)
#   layer-*      whole-layer prefill at T = 512 and 2048 on each path
#   huge-pages   bench_huge_pages.py: decode with the packed weights in 2 MiB pages
#                against 4 KiB pages (the TLB, a suspect for decode below the read
#                bandwidth on Intel: issue 26)
#   peers        bench_peers.py --isolate (kt-kernel 0.7.2 in its venv: scripts/setup_peers.sh
#                first; skipped, with a note, where that venv is missing)
#   lora         bench_lora.py: the LoRA step on bf16, int8 and mxfp4 bases, default and
#                with the backward panels kept (64 columns wide on oneDNN's brgemm),
#                against kt-kernel's SFT classes (bf16, int8) and the eager loop
# Then $OUT/summary.md gathers the host, every kernel's break-even line (the tokens per
# expert from which it beats streaming: the AMX column of the format table) and the
# layer, peers and LoRA tables.
#
# Environment: PYTHON (python3), OUT (default build/amx_check), KT_OPS_PEERS_VENV (as
# scripts/setup_peers.sh). Exit status: 0 when every step ran and passed, 1 otherwise, 2
# for a bad argument.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-build/amx_check}
QUICK=0
DRY=0
for arg in "$@"; do
  case "$arg" in
    --quick) QUICK=1 ;;
    --dry-run) DRY=1 ;;
    *)
      echo "amx_check.sh: unknown argument '$arg' (expected --quick or --dry-run)" >&2
      exit 2
      ;;
  esac
done
export HF_HUB_OFFLINE=1

FAILED=()
step() {  # step NAME COMMAND...: run one step, its output in $OUT/NAME.log
  local name=$1
  shift
  echo "[amx_check] $name: $*"
  [[ $DRY == 1 ]] && return 0
  local t0=$SECONDS
  if "$@" >"$OUT/$name.log" 2>&1; then
    echo "[amx_check] $name: ok ($((SECONDS - t0)) s)"
  else
    echo "[amx_check] $name: FAILED ($((SECONDS - t0)) s; $OUT/$name.log)"
    FAILED+=("$name")
  fi
}

mkdir -p "$OUT"
if [[ $DRY == 0 ]]; then
  {
    echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)"
    grep -m1 "model name" /proc/cpuinfo
    echo "amx: $(grep -o -m1 -w 'amx_tile\|amx_bf16\|amx_int8' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    "$PY" -c "import kt_ops; i = kt_ops.info(); print('kt_ops ISA:', i['active_isa'])" 2>&1
    echo "oneDNN ISA: $("$PY" tests/onednn_isa.py 2>&1)"
  } | tee "$OUT/host.txt"
fi

B=benchmarks
step tests bash scripts/test.sh -q -p no:cacheprovider
step breakeven-bf16 "$PY" $B/bench_compute_paths.py --format bf16 --tokens 4 8 12 16 32 64 128
step breakeven-int8 "$PY" $B/bench_compute_paths.py --format int8 --tokens 4 8 12 16 24 32 64
step breakeven-int4-g0 "$PY" $B/bench_compute_paths.py --format int4-g0 --tokens 4 8 16 32 64
step breakeven-int4-g128 "$PY" $B/bench_compute_paths.py --format int4-g128 --tokens 4 8 16 32 64
step breakeven-fp8 "$PY" $B/bench_compute_paths.py --format fp8 --tokens 2 4 6 8 16 32 64
step breakeven-mxfp4 "$PY" $B/bench_compute_paths.py --format mxfp4 --tokens 4 8 12 16 32 64
if [[ $QUICK == 0 ]]; then
  for fmt in bf16 int8 int4-g0 int4-g128 mxfp4 fp8; do
    step "layer-$fmt" "$PY" $B/bench_compute_paths.py --format "$fmt" --layer 512 2048 --repeats 3
  done
  step huge-pages "$PY" $B/bench_huge_pages.py --formats bf16 int8 int4 q4_k --tokens 1 8 \
    --markdown
  peers_venv=${KT_OPS_PEERS_VENV:-$HOME/.cache/kt_ops/peers-venv}  # scripts/setup_peers.sh
  if [[ -x $peers_venv/bin/python ]] || [[ $DRY == 1 ]]; then
    step peers "$PY" $B/bench_peers.py --isolate --markdown --tokens 1 8 512 2048
  else
    echo "[amx_check] peers: skipped (no kt-kernel venv: bash scripts/setup_peers.sh first)"
  fi
  step lora "$PY" $B/bench_lora.py --formats bf16 int8 mxfp4 --systems kt kt_panels torch_bf16 \
    kt_kernel --reps 5
fi

if [[ $DRY == 1 ]]; then
  exit 0
fi
# What the closing note and the format table need, from the logs, in one file: the host,
# each matrix-engine kernel's break-even (the AMX column of brgemm_min_tokens), the
# layer tables and the peers' and LoRA tables.
{
  cat "$OUT/host.txt"
  echo
  echo "## break-evens (tokens per expert from which the kernel beats streaming)"
  cat "$OUT"/breakeven-*.log 2>/dev/null | grep "^# break-even" || echo "(none ran)"
  for log in "$OUT"/layer-*.log "$OUT/huge-pages.log" "$OUT/peers.log" "$OUT/lora.log"; do
    [[ -f $log ]] || continue
    echo
    echo "## $(basename "$log" .log)"
    cat "$log"
  done
  ((${#FAILED[@]})) && echo && echo "failed steps: ${FAILED[*]}"
} >"$OUT/summary.md"
echo "[amx_check] summary: $OUT/summary.md"
if ((${#FAILED[@]})); then
  echo "[amx_check] failed: ${FAILED[*]} (logs in $OUT)"
  exit 1
fi
echo "[amx_check] all steps ran; logs in $OUT"
