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
  echo "installing evolving-infra and its dev tools into .venv ..." >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >&2
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]' >&2
  touch "$stamp"
fi
