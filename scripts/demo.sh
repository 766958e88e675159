#!/usr/bin/env bash
# Set up and run the main job: a what-if comparison of Evolving Infra against Dynamo, Arrow and
# a static PD split, serving the bundled real Claude Code sessions (126 agents) on a simulated
# 9-node GB300 cluster. Every run's full event log lands in DuckDB; PNG plots beside it.
# Extra arguments go to `evolving compare` (e.g. --workload putnam --agents 256).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/evolving compare --duration 20m --warmup 10m --out-dir runs/demo "$@"
