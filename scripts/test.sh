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
# Both cores (pytest-xdist): most tests wait on processes, servers and sockets. Measured on this
# 2-core machine: 1,487 tests in 6 min 37 s with two workers, where one process took 8 min 56 s
# for 1,338 of them. EI_TEST_WORKERS=0 runs in one process.
.venv/bin/python -m pytest -p no:cacheprovider -n "${EI_TEST_WORKERS:-2}" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "ERROR: pytest collected no tests" >&2
  exit 1
fi
if [ "$rc" -ne 0 ]; then
  exit "$rc"
fi
# The heavy real-load suite (marker `load`, deselected above by pyproject's addopts): the agent load
# of 226 real Claude Code requests twice on one `evolving up --engines 4` beside two busy loops,
# 0 lost and 0 removals asserted (docs/live.md, "Liveness under load"); ~4.5 min here, alone, since
# it brings its own CPU contention. EI_SKIP_LOAD=1 skips it; extra arguments skip it too (a
# developer running a subset).
if [ "${EI_SKIP_LOAD:-0}" != 1 ] && [ "$#" -eq 0 ]; then
  echo "pytest -m load (the heavy load suite)" >&2
  set +e
  .venv/bin/python -m pytest -p no:cacheprovider -m load tests/integration/test_liveness_load.py
  rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "ERROR: the load suite collected no tests" >&2
    exit 1
  fi
fi
# The real coding agents (marker `clients`, deselected above): Claude Code, Codex, opencode and
# mini-swe-agent, installed by scripts/install_clients.sh (pinned, idempotent: ~1 min 50 s the first
# time, ~4 s after), each headless against a live `evolving up` (issue 36; 11 tests, ~2 min here). Without
# Node or a reachable registry the install warns and the tests skip with the reason.
# EI_SKIP_CLIENTS=1 skips both; extra arguments skip them too.
if [ "$rc" -eq 0 ] && [ "${EI_SKIP_CLIENTS:-0}" != 1 ] && [ "$#" -eq 0 ]; then
  echo "scripts/install_clients.sh --optional; pytest -m clients (the real agent clients)" >&2
  bash scripts/install_clients.sh --optional
  set +e
  .venv/bin/python -m pytest -p no:cacheprovider -m clients tests/integration/test_real_clients.py
  rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "ERROR: the clients suite collected no tests" >&2
    exit 1
  fi
fi
exit "$rc"
