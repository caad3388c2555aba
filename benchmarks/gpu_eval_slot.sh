#!/usr/bin/env bash
# One GPU slot of a KernelBench evaluation run in parts (docs/evaluation.md, "kz eval
# merge"): evaluates the problems of one level whose file names match GLOB, for at most
# about T seconds, in the SQLite store STORE (resumed if it exists), then writes the part's
# report (report.json, report.md, plots) and a gzipped copy of the store to $OUT:
#
#   benchmarks/gpu_eval_slot.sh LEVEL GLOB RUN_ID T STORE [kz eval run options...]
#
#   benchmarks/gpu_eval_slot.sh 1 '2?_*' eval-kb-warm-l1-2x 480 /tmp/kz-eval/l1-2x.sqlite3 \
#     --policy kz_stream/data/warmstart/coder --samples 10 --max-new-tokens 1280 --seed 0 \
#     --device cuda --batch-size 560 --concurrency 64 --kv-cache compiled
#
# A part cut short by T resumes from its store: carry $OUT/STORE.gz back (gunzip it to
# STORE) and run the same line again on that host (a store holds KernelBench's sources: it
# is not kept in the repository). Level 1 in ten parts of 9-12 problems: '[1-9]_*', '1?_*',
# '2?_*' ... '9?_*' and '100_*'. Merge the parts' report.json files with kz eval merge.
# KB (default .kb/KernelBench, git-ignored: the project ships none) is the checkout's
# KernelBench folder. The run stops with SIGINT, which kz eval run takes as a cut.
set -uo pipefail
LEVEL=$1 GLOB=$2 RUN=$3 T=$4 STORE=$5
shift 5
KB=${KB:-.kb/KernelBench}
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kz-eval-out}
mkdir -p "$OUT" "$(dirname "$STORE")"
# The model converted from its GGUF once per host, kept while the host is.
export KZ_CACHE_DIR=${KZ_CACHE_DIR:-/tmp/kz-cache}
export COLUMNS=${COLUMNS:-200}  # the tables in the logs whole
export KZ_DATABASE_URL="sqlite+aiosqlite:///$(realpath "$STORE")"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
start=$(date +%s)
timeout -s INT "$T" python3 -m kz_stream.cli eval run "$KB/level${LEVEL}" --match "$GLOB" \
  --run-id "$RUN" "$@" > "$OUT/$RUN.txt" 2>&1
rc=$?
echo "eval rc=$rc wall=$(( $(date +%s) - start ))"
tail -n 3 "$OUT/$RUN.txt"
python3 -m kz_stream.cli eval report "$RUN" --out "$OUT/$RUN" > "$OUT/$RUN.report.txt" 2>&1
report_rc=$?
echo "report rc=$report_rc"
cat "$OUT/$RUN.report.txt"
# SQLite's online backup: the store whole, its write-ahead log included.
python3 -c 'import sqlite3, sys; sqlite3.connect(sys.argv[1]).backup(sqlite3.connect(sys.argv[2]))' \
  "$STORE" "$OUT/$(basename "$STORE")" && gzip -f "$OUT/$(basename "$STORE")"
copy_rc=$?
ls -la "$OUT"
# A cut by T (timeout's 124; kz eval run's own 130 on SIGINT) is the plan, not a failure.
case $rc in 124|130) rc=0 ;; esac
[ "$rc" -ne 0 ] && exit "$rc"
[ "$report_rc" -ne 0 ] && exit "$report_rc"
exit "$copy_rc"
