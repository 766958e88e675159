#!/usr/bin/env bash
# GPU smoke test of the SGLang backend (never part of CI; docs/deploy.md, "Smoke test").
#
# Needs: one NVIDIA GPU, SGLang installed in the project's environment (pip install -e '.[gpu]'),
# and the Mooncake transfer engine for PD (or EI_SMOKE_TRANSFER=fake: SGLang's test backend,
# which refuses the runtime role switch, so the worker falls back to a restart).
#
# What it does, on one machine:
#   1. `evolving up --engines 0`: NATS, directory, planner, router, recorder, gateway.
#   2. Two workers, each launching one SGLang server on the tiny dummy model of
#      deploy/smoke/tiny-llama (--load-format dummy): g1 prefill, g2 decode, PD-paired through
#      the bootstrap fields, runtime role switch on, ZMQ KV events on.
#   3. Drives the bundled Claude Code trace (3 sessions) through our gateway.
#   4. Orders one role switch (g2 decode -> prefill) on the bus and waits for RoleSwitched.
#   5. Stops everything and checks the DuckDB log: every request finished, KvStored from the
#      SGLang nodes naming the requests' blocks, the RoleSwitched (and how it was done).
#
#   bash scripts/gpu_smoke.sh            # exit 0 = pass; logs in $EI_SMOKE_DIR (default /tmp/ei-smoke)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DIR=${EI_SMOKE_DIR:-/tmp/ei-smoke}
TRANSFER=${EI_SMOKE_TRANSFER:-mooncake}
MODEL=$PWD/deploy/smoke/tiny-llama
rm -rf "$DIR" && mkdir -p "$DIR"

"$PY" -c "import sglang" 2>/dev/null || { echo "gpu_smoke: SGLang is not installed in $PY (pip install -e '.[gpu]')" >&2; exit 2; }
command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null || { echo "gpu_smoke: no NVIDIA GPU visible" >&2; exit 2; }

pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

echo "== 1. control plane"
"$PY" -m services.drivers.cli up --engines 0 --run-dir "$DIR/run" --gateway-port 0 --ready-file "$DIR/ready.json" \
    --no-status --metrics-port -1 >"$DIR/up.log" 2>&1 &
pids+=($!)
for _ in $(seq 120); do [ -f "$DIR/ready.json" ] && break; sleep 1; done
[ -f "$DIR/ready.json" ] || { echo "gpu_smoke: evolving up did not become ready (see $DIR/up.log)" >&2; exit 1; }
NATS=$("$PY" -c "import json; print(json.load(open('$DIR/ready.json'))['nats'])")
GATEWAY=$("$PY" -c "import json; print(json.load(open('$DIR/ready.json'))['gateway'])")

echo "== 2. two SGLang servers behind two workers (tiny dummy model)"
server() {  # port kv_port bootstrap_port mode
  echo "$PY -m sglang.launch_server --model-path $MODEL --load-format dummy --skip-tokenizer-init \
--port $1 --host 127.0.0.1 --mem-fraction-static 0.3 --page-size 64 --disaggregation-mode $4 \
--disaggregation-transfer-backend $TRANSFER --disaggregation-bootstrap-port $3 --enable-pd-role-switch \
--kv-events-config '{\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:$2\",\"topic\":\"kv\"}'"
}
worker() {  # node role port kv_port bootstrap_port peer_node peer_port
  "$PY" -m engine.worker --backend sglang --node "$1" --role "$2" --nats-url "$NATS" \
      --sglang-launch "$(server "$3" "$4" "$5" "$2")" --sglang-url "http://127.0.0.1:$3" \
      --sglang-launch-timeout-s 600 --kv-events-endpoint "tcp://127.0.0.1:$4" --kv-events-topic kv \
      --bootstrap-host 127.0.0.1 --bootstrap-port "$5" --peer-url "$6=http://127.0.0.1:$7" \
      >"$DIR/worker-$1.log" 2>&1 &
  pids+=($!)
}
worker g1 prefill 30000 5557 8998 g2 30001
worker g2 decode 30001 5558 8999 g1 30000
for _ in $(seq 600); do
  grep -q worker_up "$DIR/worker-g1.log" 2>/dev/null && grep -q worker_up "$DIR/worker-g2.log" 2>/dev/null && break
  sleep 1
done
grep -q worker_up "$DIR/worker-g1.log" && grep -q worker_up "$DIR/worker-g2.log" || {
  echo "gpu_smoke: the workers did not come up (see $DIR/worker-*.log)" >&2; exit 1; }

echo "== 3. requests through the gateway"
"$PY" -m services.drivers.cli trace import weka tests/fixtures/traces/weka-claude-code/trace_0504.json -o "$DIR/trace.jsonl"
"$PY" -m services.drivers.cli drive "$DIR/trace.jsonl" --gateway "$GATEWAY" --speedup 1000 --json --timeout-s 300 \
    | tee "$DIR/drive.json"

echo "== 4. one role switch: g2 decode -> prefill"
"$PY" - "$NATS" <<'EOF'
import asyncio, sys, time
from events.catalog import RoleSwitched, SwitchRole
from services.adapters.bus.nats_bus import NatsBus

async def main(url):
    bus = await NatsBus.connect(url, partition="default")
    start = await bus.last_seq() + 1
    await bus.publish(SwitchRole(ts=time.time(), src="gpu_smoke", node="g2", to_role="prefill"))
    async with bus.consumer(None, start_seq=start) as c:
        async for d in c:
            if isinstance(d.event, RoleSwitched) and d.event.node == "g2":
                print("RoleSwitched:", d.event)
                break
    await bus.close()

asyncio.run(asyncio.wait_for(main(sys.argv[1]), 600))
EOF

echo "== 5. checks on the recorded log"
cleanup
pids=()
"$PY" - "$DIR/run/run.duckdb" "$DIR/drive.json" <<'EOF'
import json, sys
from services.adapters.eventlog.duckdb_log import DuckDbEventLog

drive = json.load(open(sys.argv[2]))
assert drive["requests_failed"] == 0 and drive["requests_ok"] > 0, drive
with DuckDbEventLog(sys.argv[1], read_only=True) as log:
    q = log.con.execute
    sub = {r for (r,) in q("SELECT payload->>'$.request' FROM events WHERE type='RequestSubmitted'").fetchall()}
    fin = {r for (r,) in q("SELECT payload->>'$.request' FROM events WHERE type='RequestFinished'").fetchall()}
    blocks = set()
    for (b,) in q("SELECT payload->'$.blocks' FROM events WHERE type='RequestSubmitted'").fetchall():
        blocks |= set(json.loads(b))
    stored = set()
    for (b,) in q("SELECT payload->'$.blocks' FROM events WHERE type='KvStored' AND src IN ('g1','g2')").fetchall():
        stored |= set(json.loads(b))
    sw = q("SELECT payload FROM events WHERE type='RoleSwitched'").fetchall()
    how = q("SELECT payload->>'$.kind' FROM events WHERE type='AnomalyReported' "
            "AND payload->>'$.component'='engine.sglang'").fetchall()
assert sub and sub == fin, (len(sub), len(fin))
assert stored and stored <= blocks, "no KV events from SGLang, or blocks that no request has"
assert sw, "no RoleSwitched"
print(f"PASS: {len(fin)} requests, {len(stored)} blocks reported by SGLang, switches {sw}, how {how}")
EOF
