#!/usr/bin/env bash
# Set up and run the main job: a what-if comparison of Evolving Infra against Dynamo, Arrow and
# a static PD split, serving 34 bundled real Claude Code sessions (deploy/traces/calibration,
# Apache-2.0) as 126 autonomous agents (--pace agent: tool time kept, human pauses capped) on a
# simulated 9-node GB300 cluster in the regime METHOD §5 describes (the gb300-glm52-pressure
# profile: the cluster loaded and the agents' KV near what it keeps, the running requests still
# fitting; docs/simulator.md, "Regimes"), 10 min measured after a 5 min warm-up, two stacks at a
# time. Its table puts the load (idle GPU time), the KV demand (% of GPU and host KV) and the
# lost KV reuse beside the ratios. Every run's full event log lands in DuckDB; PNG plots beside it.
# Extra arguments go to `evolving compare` (e.g. --workload putnam --agents 256).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/evolving compare --trace deploy/traces/calibration --pace agent --agents 126 \
    --profile gb300-glm52-pressure --duration 10m --warmup 5m --fast --out-dir runs/demo "$@"
