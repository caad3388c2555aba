#!/usr/bin/env bash
# One GPU slot of the full-size corpus's GPU tests (tests/verify/test_full_size_corpus.py,
# docs/verifier.md "Full-size corpus"): they take longer than one slot (29 honest kernels
# and 2 cheats at KernelBench's published sizes; the 6.4 GB ones 130-170 s each on an
# H200), so each slot runs the tests that LOG does not yet hold a result for, for at most
# T seconds, and appends to LOG:
#
#   benchmarks/gpu_full_size_slot.sh LOG T
#
# A test cut by the time limit has no RESULT line and runs again in the next slot. Carry
# LOG to the next slot's host if it is another one. The verdict lines read
# "RESULT full NAME: STATUS ..." (honest) and "RESULT full cheat NAME: STATUS CHECK: ...".
set -uo pipefail
LOG=$1 T=$2
cd "$(dirname "$0")/.."
touch "$LOG"
mapfile -t deselect < <(python3 - "$LOG" <<'EOF'
import re
import sys
for line in open(sys.argv[1]):
    m = re.match(r"RESULT full (cheat )?(\w+):", line)
    if m:
        kind = "cheat" if m[1] else "honest"
        print(f"--deselect=tests/verify/test_full_size_corpus.py::test_{kind}_full_on_gpu[{m[2]}]")
EOF
)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
echo "=== slot $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null) ${gpu:-no GPU}; ${#deselect[@]} done before" >> "$LOG"
timeout -s INT "$T" python3 -m pytest -m gpu tests/verify/test_full_size_corpus.py -k full_on_gpu \
  "${deselect[@]}" -s -rA -p no:cacheprovider --timeout 420 >> "$LOG" 2>&1
rc=$?
echo "pytest rc=$rc (124: cut at ${T} s)"
grep -E "^RESULT|^STAGES" "$LOG" | cut -c1-300
