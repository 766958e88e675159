"""`evolving bench planner` runs and reports both figures with their side-by-side baselines."""

from __future__ import annotations

import argparse
import json

from services.drivers.bench import cli
from services.drivers.bench import planner as bench


def test_bench_reports_accuracy_and_speed_with_baselines(capsys):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers()
    cli.register(sub, sub.add_parser("bench").add_subparsers())
    args = ap.parse_args(["bench", "planner", "--json", "--sizes", "9,12", "--repeats", "1"])
    assert args.func(args) == 0
    r = json.loads(capsys.readouterr().out)
    acc = r["accuracy"]["prefill"]
    assert acc["high_reuse"]["ours_mape"] < 0.05 < acc["high_reuse"]["arrow_mape"]
    assert abs(acc["no_reuse"]["arrow_over_ours"] - 1.0) < 0.05  # nothing cached: same predictor
    assert [row["nodes"] for row in r["speed"]] == [9, 12]
    assert all(row["window_eval_s"] > 0 and row["naive_theta_s"] > 0 for row in r["speed"])
    assert "speedup" in bench.format_report(r)
