#!/usr/bin/env bash
# Set up and run the main job: a what-if comparison of Evolving Infra against Dynamo, Arrow and
# a static PD split, serving the bundled real Claude Code sessions as 126 autonomous agents
# (--pace agent: tool time kept, human pauses capped, so the cluster is loaded; with the
# recorded human pauses it idles and every stack serves the same requests/s) on a simulated
# 9-node GB300 cluster, 10 min measured after a 5 min warm-up, two stacks at a time.
# Every run's full event log lands in DuckDB; PNG plots beside it.
# Extra arguments go to `evolving compare` (e.g. --workload putnam --agents 256).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/evolving compare --pace agent --duration 10m --warmup 5m --out-dir runs/demo "$@"
