#!/usr/bin/env bash
# One GPU slot of the loop's learning-curve benchmark: a treatment run and its control
# (learning rate 0) side by side on one GPU for T seconds, each in a folder of its own,
# resuming what the folder holds. Then each store is copied out (gzip) with its log, for
# benchmarks/bench_gpu_loop.py to read:
#
#   benchmarks/gpu_loop_slot.sh OUT SLOT T [STORES]
#
# OUT: where the stores (run.sqlite3.gz, control.sqlite3.gz), logs and nvidia-smi samples
# go; SLOT: a name for this slot's files; T: the run's --time-limit in seconds; STORES: a
# folder holding run.sqlite3.gz and control.sqlite3.gz to resume from (a run carried off
# its host and back), instead of the stores already in the run folders. Environment:
# RUN_DIR and CONTROL_DIR (default /tmp/kz-run, /tmp/kz-control), ONLY_RUN=1 (the
# treatment alone), STEPS_PER_TURN (each role's steps before the other's turn, default 1),
# GUARD (seconds past T before the run is interrupted, default 170), MAX_NEW_TOKENS (the
# Coder's cap, default 1280: the warm Coder's matmul answers take up to 1,182 tokens; the
# runs of 2026-12-01 to -05 used 1024, which cuts about one in five of them; keep one
# value within a run), and
# any KZ_* setting. The checkpoints stay in each folder's .kz/policies: carry them too
# when the next slot runs on another host (the learner refuses to start without its last
# published version). PACK=DIR writes each run's newest checkpoint of each role (what a
# resumed learner and the generators load) to DIR as NAME-policies.part-NN, 15 MiB each (a
# size the device tool carries); POLICIES=DIR, with STORES, restores a run from them into
# an emptied folder: what the slot finds on the host is then only what was carried.
set -uo pipefail
OUT=$1 SLOT=$2 T=$3 STORES=${4:-}
RUN_DIR=${RUN_DIR:-/tmp/kz-run} CONTROL_DIR=${CONTROL_DIR:-/tmp/kz-control}
export PYTHONUNBUFFERED=1 KZ_LOG_LEVEL=${KZ_LOG_LEVEL:-INFO}
mkdir -p "$OUT"
dirs=("$RUN_DIR") names=(run)
if [ -z "${ONLY_RUN:-}" ]; then dirs+=("$CONTROL_DIR"); names+=(control); fi

for i in "${!dirs[@]}"; do
  if [ -n "${POLICIES:-}" ]; then
    [ -n "$STORES" ] || { echo "POLICIES needs STORES" >&2; exit 1; }
    rm -rf "${dirs[$i]}/.kz" && mkdir -p "${dirs[$i]}/.kz"
    cat "$POLICIES/${names[$i]}-policies.part-"* | tar -C "${dirs[$i]}/.kz" -xf - \
      || { echo "cannot restore $POLICIES/${names[$i]}-policies.part-*" >&2; exit 1; }
  fi
  mkdir -p "${dirs[$i]}/.kz"
  if [ -n "$STORES" ]; then
    # Whole or not at all: an empty store beside the checkpoints is another run.
    gunzip -c "$STORES/${names[$i]}.sqlite3.gz" > "${dirs[$i]}/.kz/carried.tmp" \
      || { echo "cannot read $STORES/${names[$i]}.sqlite3.gz" >&2; exit 1; }
    rm -f "${dirs[$i]}"/.kz/kz.sqlite3*
    mv "${dirs[$i]}/.kz/carried.tmp" "${dirs[$i]}/.kz/kz.sqlite3"
  fi
done

nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 5 \
  > "$OUT/smi-$SLOT.csv" 2>&1 &
smi=$!
start=$(date +%s)
pids=()
for i in "${!dirs[@]}"; do
  lr=()
  [ "${names[$i]}" = control ] && lr=(KZ_LEARNER__LEARNING_RATE=0)
  log="${dirs[$i]}/.kz/slot-$SLOT.log"
  (
    cd "${dirs[$i]}" || exit 1
    env "${lr[@]+"${lr[@]}"}" timeout -s INT -k 40 $((T + ${GUARD:-170})) \
      python3 -m kz_stream.cli run --device cuda --rounds 200 --steps-per-turn "${STEPS_PER_TURN:-1}" \
      --group-size 4 --groups-per-step 4 --max-new-tokens "${MAX_NEW_TOKENS:-1280}" --time-limit "$T" \
      > "$log" 2>&1
    echo "exit $? after $(($(date +%s) - start)) s" >> "$log"
  ) &
  pids+=($!)
done
wait "${pids[@]}"
kill "$smi" 2>/dev/null

status=0  # 1: a store or a pack is missing (the runs' own exits are in their logs)
for i in "${!dirs[@]}"; do
  name=${names[$i]} kz="${dirs[$i]}/.kz"
  gzip -c "$kz/slot-$SLOT.log" > "$OUT/$name-$SLOT.log.gz"
  echo "== $name: $(tail -n 1 "$kz/slot-$SLOT.log"); checkpoints" \
    "$(du -sh "$kz/policies" 2>/dev/null | cut -f1)"
  if [ ! -s "$kz/kz.sqlite3" ]; then echo "no store in $kz" >&2; status=1; continue; fi
  # SQLite's backup API: a consistent copy whatever the journal holds.
  python3 -c "import sqlite3, sys; d = sqlite3.connect(sys.argv[2]); \
sqlite3.connect(sys.argv[1]).backup(d); d.close()" "$kz/kz.sqlite3" "$kz/copy.sqlite3"
  gzip -c "$kz/copy.sqlite3" > "$OUT/$name.sqlite3.gz"
  if [ -n "${PACK:-}" ]; then
    # Each role's last published version: an unpublished newer one is what a learner
    # discards on resuming (a save cut short by the end of the slot).
    newest=$(python3 -c '
import json, sqlite3, sys
last = {}
for (payload,) in sqlite3.connect(sys.argv[1]).execute(
        "select payload from events where type = ?", ("PolicyVersionPublished",)):
    p = json.loads(payload)
    last[p["role"]] = max(last.get(p["role"], 0), int(p["version"]))
print(" ".join(f"policies/{r}/{r}-v{v:08d}" for r, v in sorted(last.items())))
' "$kz/copy.sqlite3")
    # A published version without its folder cannot be resumed from: say so, pack nothing.
    missing=$(for d in $newest; do [ -d "$kz/$d" ] || echo "$d"; done)
    if [ -z "$newest" ] || [ -n "$missing" ]; then
      echo "== $name: cannot pack: ${missing:-no policy version published}" >&2
      status=1
      rm -f "$kz/copy.sqlite3"
      continue
    fi
    mkdir -p "$PACK" && rm -f "$PACK/$name-policies.part-"*
    if ! tar -C "$kz" -cf - $newest | split -b 15M -d - "$PACK/$name-policies.part-"; then
      echo "== $name: packing $newest failed" >&2
      status=1
      rm -f "$kz/copy.sqlite3"
      continue
    fi
    echo "== $name: packed $newest ($(du -shc $(printf "$kz/%s " $newest) | tail -n 1 \
      | cut -f1)) into $(ls "$PACK/$name-policies.part-"* | wc -l) parts"
  fi
  rm -f "$kz/copy.sqlite3"
done
exit "$status"
