#!/usr/bin/env bash
# The GPU part of `evolving bench kv` (issue 14) as one short run (under 5 minutes) where a CUDA
# device is lent. Needs only torch (triton optional) and this checkout: the device machine has
# no network and no project venv. Figures go to $OUT (or ./gpu-bench-kv/) as JSON and text.
#   1. the device tests of tests/unit/kernels against the CPU reference (when pytest and
#      hypothesis are installed; the benchmark below checks every path against the reference too);
#   2. large blocks (8 MiB: 64 tokens of a 32-layer, 8-KV-head bf16 model, K and V) and small
#      ones (64 KiB: one layer's K and V), torch and Triton paths, host<->device copies against
#      the naive copy and the pinned DMA limit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch' 2> /dev/null; then PY=.venv/bin/python; fi
out=${OUT:-gpu-bench-kv}
mkdir -p "$out"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_bench_kv.sh: torch sees no CUDA device")'
"$PY" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))' | tee "$out/device.txt"
"$PY" -c 'import triton; print("triton", triton.__version__)' 2>&1 | tail -1 | tee -a "$out/device.txt"

if "$PY" -c 'import pytest, hypothesis' 2> /dev/null; then
  # --noconftest: the shared conftest starts nats-server, which this machine does not need.
  timeout 120 "$PY" -m pytest -q -p no:cacheprovider --noconftest tests/unit/kernels/test_ops.py \
    2>&1 | tee "$out/tests.txt" | tail -5
else
  echo "pytest/hypothesis missing: skipping the unit tests (the benchmark still checks every path)" | tee "$out/tests.txt"
fi

run() {  # name, then bench arguments
  local name=$1
  shift
  timeout 150 "$PY" -m services.drivers.bench.kv_cli --device cuda --no-transfer --json "$@" > "$out/$name.json"
  "$PY" - "$out/$name.json" << 'PYEOF' | tee "$out/$name.txt"
import json, sys
from services.drivers.bench.kv import format_report
print(format_report(json.load(open(sys.argv[1]))))
PYEOF
}
run large --layout bf16:64x64x8x128 --slots 192 --blocks 96 --repeats 5
run small --layout bf16:16x2x8x128 --slots 8192 --blocks 2048 --repeats 5
echo "figures in $out/"
