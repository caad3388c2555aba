#!/usr/bin/env bash
# One GPU slot of the KernelBench audit (docs/verifier.md "An audit over several GPU
# slots"): audits, for at most about T seconds, the problems of KernelBench's level LEVEL
# that benchmarks/results/raw/audit_levelLEVEL.json does not yet hold a row for (same
# problem source, same verifier version), and writes the file with the new rows to $OUT
# (copy it back over the checkout's before the next slot):
#
#   benchmarks/gpu_audit_slot.sh LEVEL T [JOBS] [KERNELBENCH]
#
# KERNELBENCH is a checkout's KernelBench folder (default .kb/KernelBench, git-ignored: the
# project ships none). REDO="2_ShallowWideMLP 31_VisionAttention" audits those problems
# again though their rows stand (--redo). A problem begun before T finishes; leave room
# for the slowest (a 10-minute call suits T=380 with JOBS=2 on an H100). Summarise with
# python -m benchmarks.kernelbench_audit 1=benchmarks/results/raw/audit_level1.json ...
set -uo pipefail
LEVEL=$1 T=$2 JOBS=${3:-2} KB=${4:-.kb/KernelBench}
cd "$(dirname "$0")/.."
J=benchmarks/results/raw/audit_level${LEVEL}.json
OUT=${OUT:-/tmp/kz-audit}
mkdir -p "$OUT"
[ -f "$J" ] && cp "$J" "$OUT/audit_level${LEVEL}.json"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
start=$(date +%s)
timeout -s INT $((T + 200)) python3 -m kz_stream.cli verify audit-suite "$KB/level${LEVEL}" \
  --json "$OUT/audit_level${LEVEL}.json" --resume --time-limit "$T" --jobs "$JOBS" \
  $(for name in ${REDO:-}; do printf -- '--redo %s ' "$name"; done) \
  > "$OUT/audit_level${LEVEL}.txt" 2>&1
echo "rc=$? wall=$(( $(date +%s) - start ))"
tail -n 4 "$OUT/audit_level${LEVEL}.txt"
