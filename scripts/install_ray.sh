#!/usr/bin/env bash
# Ray for `evolving experiments --ray ADDRESS` (the matrix's rows as Ray tasks) and `pytest -m ray`:
#   bash scripts/install_ray.sh [--optional]     # into .venv, the project's own environment
#   bash scripts/install_ray.sh --version        # the pinned version
# Into .venv, not a venv of its own: a Ray worker runs the row's simulation, so it imports this
# project and its dependencies from the interpreter that started it. The pin is the version the
# tests ran on; pyproject's extra `ray` allows any 2.x from it. A pip dry run into .venv adds ray
# alone (2026-12-06: everything else it needs was already there). Idempotent: nothing is installed
# when the pinned version already imports. --optional: a failed install is a warning and exit 0
# (the ray tests then skip with the reason). RAY_VERSION in the environment overrides the pin.
set -euo pipefail
PIN=2.60.0
OPTIONAL=0
case "${1:-}" in
  --version) echo "$PIN"; exit 0 ;;
  --optional) OPTIONAL=1 ;;
  "") ;;
  *) echo "usage: bash scripts/install_ray.sh [--optional|--version]" >&2; exit 2 ;;
esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=$ROOT/.venv/bin/python
VERSION=${RAY_VERSION:-$PIN}
LOG=$ROOT/.venv/install-ray.log
fail() {
  echo "ERROR: $1 (log: $LOG)" >&2
  [ "$OPTIONAL" = 1 ] && { echo "ray is optional here: the ray tests will skip" >&2; exit 0; }
  exit 1
}
[ -x "$PY" ] || fail "no $PY: run bash scripts/setup.sh first"
ray_ok() { "$PY" -c "import sys, ray; sys.exit(ray.__version__ != '$VERSION')" 2>/dev/null; }
if ray_ok; then
  echo "ray $VERSION already in .venv"
  exit 0
fi
start=$(date +%s)
echo "installing ray==$VERSION into .venv (log: $LOG) ..." >&2
"$PY" -m pip install --disable-pip-version-check "ray==$VERSION" > "$LOG" 2>&1 \
  || { tail -20 "$LOG" >&2; fail "ray==$VERSION did not install"; }
ray_ok || fail "ray $VERSION does not import after installation"
echo "ray $VERSION in .venv ($(( $(date +%s) - start )) s): $(grep -o 'Successfully installed.*' "$LOG" || true)"
