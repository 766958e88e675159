#!/usr/bin/env bash
# aiperf (NVIDIA's load generator for OpenAI-compatible servers) in its own environment, .venv-aiperf:
#   bash scripts/install_aiperf.sh [--optional]     # the `aiperf` tests (pytest -m aiperf) use it
#   bash scripts/install_aiperf.sh --version        # the pinned version
# Its own venv, not .venv: `pip install --dry-run aiperf==0.13.0` into .venv upgrades nothing we pin
# but adds ~40 packages (dash, kopf, datasets, SQLAlchemy, pandas, ...) that nothing here needs, and
# aiperf is a client that talks to the gateway over HTTP only. Idempotent: nothing is installed when
# the pinned version already runs. --optional: a failed install is a warning and exit 0 (the tests
# then skip with the reason). AIPERF_VERSION in the environment overrides the pin.
# transformers < 5 beside it: with transformers 5, apply_chat_template(tokenize=True) returns a
# BatchEncoding where aiperf 0.13 expects a list, so --apply-chat-template silently counts each
# request's prompt as bare text (its "Token Count Discrepancy" against any server that applies the
# model's chat template: ~30% on a 100-token prompt with SmolLM2's); 4.57 makes it a list again
# (docs/benchmarking.md). huggingface-hub < 1 and datasets < 4.9 are what transformers 4.57 accepts.
set -euo pipefail
PIN=0.13.0
DEPS=("transformers>=4.56,<5" "huggingface-hub<1" "datasets>=3,<4.9")
OPTIONAL=0
case "${1:-}" in
  --version) echo "$PIN"; exit 0 ;;
  --optional) OPTIONAL=1 ;;
  "") ;;
  *) echo "usage: bash scripts/install_aiperf.sh [--optional|--version]" >&2; exit 2 ;;
esac
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=$ROOT/.venv-aiperf
VERSION=${AIPERF_VERSION:-$PIN}
LOG=$VENV.log
fail() {
  echo "ERROR: $1 (log: $LOG)" >&2
  [ "$OPTIONAL" = 1 ] && { echo "aiperf is optional here: the aiperf tests will skip" >&2; exit 0; }
  exit 1
}
old_transformers() { "$VENV/bin/python" -c 'import sys, transformers; sys.exit(int(transformers.__version__.split(".")[0]) >= 5)' 2>/dev/null; }
if "$VENV/bin/aiperf" --version 2>/dev/null | grep -qx "$VERSION" && old_transformers; then
  echo "aiperf $VERSION already in $VENV"
  exit 0
fi
PY=${PYTHON:-python3.11}
command -v "$PY" > /dev/null || PY=python3
start=$(date +%s)
echo "installing aiperf==$VERSION into $VENV (log: $LOG) ..." >&2
"$PY" -m venv "$VENV" > "$LOG" 2>&1 || fail "could not make $VENV"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q "aiperf==$VERSION" "${DEPS[@]}" >> "$LOG" 2>&1 \
  || { tail -20 "$LOG" >&2; fail "aiperf==$VERSION did not install"; }
"$VENV/bin/aiperf" --version 2>/dev/null | grep -qx "$VERSION" || fail "aiperf does not run after installation"
old_transformers || fail "transformers < 5 did not install beside aiperf"
echo "aiperf $VERSION in $VENV ($(( $(date +%s) - start )) s)"
