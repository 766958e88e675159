#!/usr/bin/env bash
# Set up and run the whole test suite. Fails when a test fails or when no test ran.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "ruff check ." >&2
if ! .venv/bin/ruff check . ; then
  echo "ERROR: ruff check . failed (lint is part of the test command)" >&2
  exit 1
fi
set +e
.venv/bin/python -m pytest -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "ERROR: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
