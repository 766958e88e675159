#!/usr/bin/env bash
# Issue 22 part 6: the torch reference engine on a CUDA device, as one run under 8 minutes where a
# device is lent. Needs torch (+ triton) and the core packages (numpy, scipy, msgspec, structlog);
# the device machine has no network and no project venv: carry missing wheels (.library/device).
#   1. a random checkpoint of Llama-3-8B's shape (32 layers, hidden 4096, 32/8 heads, FFN 14336,
#      vocab 128256; EI_GPU_LAYERS=N to cut layers when time is short), bf16 on the GPU;
#   2. the engine's own scheduler over the grid of `evolving bench planner --engine torch`:
#      prefill over cached prefix 0-2048 x new tokens 16-1024 x 1-3 requests, decode batches 1-32;
#   3. NNLS hold-out error of eq. 1/eq. 2, the naive model and the extra terms on those timings;
#   4. the Triton/torch KV kernels (scripts/gpu_bench_kv.sh).
# Figures go to $OUT (or ./gpu-torch-engine/): timings.csv, fits.json, fits.txt, kv/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch' 2> /dev/null; then PY=.venv/bin/python; fi
out=${OUT:-gpu-torch-engine}
mkdir -p "$out"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_torch_engine.sh: torch sees no CUDA device")'
missing=$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("numpy","scipy","msgspec","structlog") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
  echo "gpu_torch_engine.sh: missing Python packages: $missing (carry their wheels: ../.library/device/README.md)" >&2
  exit 2
fi
"$PY" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))' | tee "$out/device.txt"
export PYTHONUNBUFFERED=1
timeout 360 "$PY" - "$out" << 'PYEOF'
import json, os, sys, time
from dataclasses import replace

import torch

from engine.backends.torch.loader import Checkpoint, random_weights
from engine.backends.torch.model import LlamaConfig
from services.drivers.bench import engine_timings, timings

out = sys.argv[1]
cfg = LlamaConfig(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, rope_base=500000.0,
                  max_pos=8192)
cfg = replace(cfg, layers=int(os.environ.get("EI_GPU_LAYERS", cfg.layers)))
t0 = time.time()
ck = Checkpoint(cfg=cfg, weights=random_weights(cfg, seed=0), tokenizer=None, path=f"random Llama-3-8B shape, {cfg.layers} layers")
print(f"random weights in {time.time() - t0:.0f} s", flush=True)
rows, meta = engine_timings.measure(checkpoint=ck, repeats=int(os.environ.get("EI_GPU_REPEATS", 2)), device="cuda",
                                    dtype="bf16", progress=lambda i, n: print(f"  cell {i}/{n}", flush=True) if i % 10 == 0 else None)
timings.write_timings(rows, os.path.join(out, "timings.csv"))
table = timings.fit_table(rows)
json.dump({"measured": meta, "fits": table}, open(os.path.join(out, "fits.json"), "w"), indent=2)
text = timings.format_table(table, f"torch engine on {torch.cuda.get_device_name(0)}: {meta['model']}")
open(os.path.join(out, "fits.txt"), "w").write(text + "\n")
print(text)
PYEOF
OUT="$out/kv" timeout 150 bash scripts/gpu_bench_kv.sh || echo "gpu_bench_kv.sh failed (rc $?)" | tee "$out/kv-failed.txt"
echo "figures in $out/"
