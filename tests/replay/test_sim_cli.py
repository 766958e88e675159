"""The simulator's commands end to end on the bundled real Claude Code sessions (short runs)."""

from __future__ import annotations

import argparse
import json

import pytest

from replay.sim.cli import parse_duration
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.cli import main


def test_parse_duration():
    assert parse_duration("1h") == 3600 and parse_duration("30m") == 1800
    assert parse_duration("1h30m") == 5400 and parse_duration("90") == 90
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("ten minutes")


def test_compare_prints_json_keyed_by_stack_writes_logs_and_plots(tmp_path, capsys):
    rc = main(["compare", "--duration", "4m", "--warmup", "3m", "--agents", "6", "--no-progress",
               "--stacks", "evolving,static:3P6D", "--out-dir", str(tmp_path), "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["evolving", "static:3P6D"]
    for figures in out.values():
        assert figures["finished"] > 0 and figures["throughput_rps"] > 0
    for name in ("split_over_time.png", "ttft_cdf.png", "e2e_cdf.png", "lost_kv_reuse.png"):
        assert (tmp_path / name).stat().st_size > 1000
    log = DuckDbEventLog(str(tmp_path / "evolving.duckdb"), read_only=True)
    try:
        counts = log.count_by_type()
        assert counts.get("RequestFinished", 0) > 0 and counts.get("Tick", 0) == 7 * 60 + 1
        seqs = [seq for seq, _, _ in log.read()]
        assert seqs == list(range(1, len(seqs) + 1))
        assert log.run_config()["stack"].startswith("evolving")
    finally:
        log.close()
    # every recorded decision of both stacks comes out byte-equal from fresh cores built from
    # the run_config alone (the planner ordered the evolving stack's first split in this run)
    for stack in ("evolving", "static_3P6D"):
        capsys.readouterr()
        assert main(["verify", str(tmp_path / f"{stack}.duckdb"), "--strict"]) == 0, capsys.readouterr().out


def test_replay_table(tmp_path, capsys):
    rc = main(["replay", "--duration", "3m", "--warmup", "2m", "--agents", "4", "--no-progress",
               "--stack", "dynamo", "--out", str(tmp_path / "run.duckdb")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "throughput" in text and "TTFT P95" in text


def test_sweep_static_names_the_best_split(capsys):
    rc = main(["sweep-static", "--nodes", "3", "--agents", "4", "--duration", "3m", "--warmup", "2m",
               "--no-progress", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(out["runs"]) == ["static:1P2D", "static:2P1D"]
    best = out["runs"][out["best"]]["throughput_rps"]
    assert best == max(r["throughput_rps"] for r in out["runs"].values())


def test_sim_report_recomputes_the_table_from_the_logs(tmp_path, capsys):
    assert main(["compare", "--duration", "3m", "--warmup", "2m", "--agents", "4", "--no-progress",
                 "--stacks", "evolving,static:3P6D", "--out-dir", str(tmp_path), "--json"]) == 0
    live = json.loads(capsys.readouterr().out)
    logs = [str(tmp_path / "evolving.duckdb"), str(tmp_path / "static_3P6D.duckdb")]
    assert main(["sim-report", *logs, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again == live


def test_kv_capacity_flags_and_kv_demand_in_the_json(tmp_path, capsys):
    rc = main(["replay", "--duration", "2m", "--warmup", "2m", "--agents", "4", "--no-progress", "--json",
               "--stack", "static:3P6D+round_robin+async", "--kv-gpu-tokens", "1M", "--kv-host-tokens", "2.5M",
               "--out", str(tmp_path / "run.duckdb")])
    assert rc == 0
    fig = json.loads(capsys.readouterr().out)["static:3P6D+round_robin+async"]
    assert fig["kv_gpu_capacity_tokens"] == 9_000_000 and fig["kv_host_capacity_tokens"] == 22_500_000
    assert fig["kv_demand_peak_tokens"] > 0
    assert fig["kv_demand_peak_gpu"] == fig["kv_demand_peak_tokens"] / 9_000_000
    assert 0 < fig["kv_demand_mean_gpu"] <= fig["kv_demand_peak_gpu"]
    log = DuckDbEventLog(str(tmp_path / "run.duckdb"), read_only=True)
    try:
        cfg = log.run_config()
    finally:
        log.close()
    assert cfg["kv_gpu_tokens"] == 1_000_000 and cfg["kv_host_tokens"] == 2_500_000


def test_bad_start_and_token_counts_are_one_line_errors(capsys):
    for argv in (["replay", "--start", "4P"], ["replay", "--kv-gpu-tokens", "lots"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "bad split '4P'" in err or "bad token count 'lots'" in err


def test_compare_in_worker_processes_gives_the_same_runs_as_one_process(tmp_path, capsys):
    """`compare --jobs 2` runs each stack in a spawned process: the same simulations, so the same
    figures and byte-identical event logs as one after another here."""
    figs = {}
    for jobs in ("1", "2"):
        assert main(["compare", "--duration", "2m", "--warmup", "2m", "--agents", "4", "--no-progress",
                     "--stacks", "evolving,static:3P6D", "--out-dir", str(tmp_path / jobs), "--json",
                     "--jobs", jobs]) == 0
        figs[jobs] = json.loads(capsys.readouterr().out)
    assert list(figs["2"]) == ["evolving", "static:3P6D"]
    assert figs["1"] == figs["2"]
    for stack in ("evolving", "static_3P6D"):
        logs = [DuckDbEventLog(str(tmp_path / j / f"{stack}.duckdb"), read_only=True) for j in ("1", "2")]
        try:
            a, b = (list(log.read()) for log in logs)
        finally:
            for log in logs:
                log.close()
        assert a == b and len(a) > 100
