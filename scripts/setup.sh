#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install the project with its dev tools. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python >= 3.11 is required, found " + sys.version.split()[0])'
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ei-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing evolving-infra and its dev tools into .venv (log: .venv/install.log) ..." >&2
  if ! { .venv/bin/python -m pip install --disable-pip-version-check --upgrade pip &&
         .venv/bin/python -m pip install --disable-pip-version-check -e '.[dev]'; } > .venv/install.log 2>&1; then
    tail -40 .venv/install.log >&2
    echo "ERROR: installation failed (full log: .venv/install.log)" >&2
    exit 1
  fi
  touch "$stamp"
fi
