"""``evolving regimes``: the classification of one run's figures into the four
regimes, the grid, and a tiny grid run end to end through the CLI (rows in one JSON, reused by
a second call that adds a stack at one cell, a PNG map)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.experiments.regimes import (
    REGIMES,
    Cell,
    Thresholds,
    cell_regime,
    classify,
    grid,
    parse_cells,
    roomy_rps,
    summarise,
)
from replay.sim.cli import parse_tokens
from replay.sim.inputs import FIXTURE_TRACE
from services.drivers.cli import main


def _row(peak_tokens=50.0, gpu=100, host=400, lost=0.0, idle_p=0.1, idle_d=0.5, p95=5.0, rps=1.0, wait=0.1) -> dict:
    return {"throughput_rps": rps, "prefill_wait_mean_s": wait, "kv_demand_peak_tokens": peak_tokens, "kv_gpu_capacity_tokens": gpu, "kv_host_capacity_tokens": host,
            "lost_kv_reuse": lost, "idle_prefill_frac": idle_p, "idle_decode_frac": idle_d, "ttft_p95_s": p95}


def test_each_regime_has_its_rule_and_the_first_that_fires_wins():
    t = Thresholds()
    assert classify(_row(idle_p=0.6, idle_d=0.4), t)[0] == "agent-bound"  # both phases idle
    assert classify(_row(idle_p=0.6, idle_d=0.4, wait=2.0), t)[0] == "loaded-roomy"  # idle on average, yet queued
    assert classify(_row(peak_tokens=50), t)[0] == "loaded-roomy"  # half the GPU tier
    assert classify(_row(peak_tokens=86), t)[0] == "near-capacity"  # 86% of GPU KV, host 4x
    assert classify(_row(peak_tokens=200), t)[0] == "near-capacity"  # beyond GPU, the host keeps it
    # the other reading: a share of the KV the cluster keeps (the host pool)
    assert classify(_row(peak_tokens=200), Thresholds(near_of="kept"))[0] == "loaded-roomy"
    assert classify(_row(peak_tokens=344), Thresholds(near_of="kept"))[0] == "near-capacity"
    assert classify(_row(peak_tokens=400), t)[0] == "thrashing"  # all of it
    assert classify(_row(peak_tokens=100, lost=0.12), t)[0] == "thrashing"
    regime, why = classify(_row(idle_p=0.6, idle_d=0.4, p95=90.0), t)  # idle GPUs, long waits: KV-bound
    assert regime == "thrashing" and "KV-bound" in why
    # kept KV is the host pool; the GPU tier where it is the larger
    assert classify(_row(peak_tokens=344, gpu=400, host=100), Thresholds(near_of="kept"))[0] == "near-capacity"
    assert classify(_row(peak_tokens=401, gpu=400, host=100), t)[0] == "thrashing"
    # idle GPUs, short waits, but a fraction of what the same agents get with room: KV-bound
    regime, why = classify(_row(idle_p=0.6, idle_d=0.5, rps=1.5), t, roomy_rps=6.9)
    assert regime == "thrashing" and "KV-bound" in why
    assert classify(_row(idle_p=0.6, idle_d=0.5, rps=6.0), t, roomy_rps=6.9)[0] == "agent-bound"
    # the thresholds move the borders
    assert classify(_row(peak_tokens=80), Thresholds(near_demand=0.9))[0] == "loaded-roomy"
    assert classify(_row(idle_p=0.3, idle_d=0.3), Thresholds(loaded_idle=0.35))[0] == "loaded-roomy"
    assert classify(_row(lost=0.06), Thresholds(thrash_lost=0.05))[0] == "thrashing"


def test_a_cell_takes_the_most_severe_regime_of_its_stacks():
    assert cell_regime([{"regime": "near-capacity"}, {"regime": "loaded-roomy"}]) == "near-capacity"
    assert cell_regime([{"regime": "near-capacity"}, {"regime": "thrashing"}]) == "thrashing"
    assert cell_regime([{"regime": "agent-bound"}]) == "agent-bound"
    assert list(REGIMES) == ["agent-bound", "loaded-roomy", "near-capacity", "thrashing"]


def test_the_roomiest_capacity_is_each_stack_and_concurrency_reference():
    def r(gpu, host, agents, stack, rps, **kw):
        return {**_row(rps=rps, **kw), "gpu_tokens": gpu, "host_tokens": host, "agents": agents, "stack": stack,
                "key": f"{gpu}/{host}/{agents}"}

    rows = [r(1, 4, 126, "a", 1.5, idle_p=0.6, idle_d=0.5), r(2, 8, 126, "a", 6.9), r(2, 2, 126, "a", 6.0),
            r(1, 4, 126, "b", 2.0), r(1, 4, 48, "a", 2.5, idle_p=0.7, idle_d=0.6)]
    assert roomy_rps(rows) == {("a", 126): 6.9, ("b", 126): 2.0, ("a", 48): 2.5}
    doc = summarise({"rows": rows}, Thresholds())
    assert [x["regime"] for x in rows] == ["thrashing", "loaded-roomy", "loaded-roomy", "loaded-roomy", "agent-bound"]
    assert {c["key"]: c["regime"] for c in doc["cells"]} == {"1/4/126": "thrashing", "2/8/126": "loaded-roomy",
                                                             "2/2/126": "loaded-roomy", "1/4/48": "agent-bound"}


def test_the_grid_and_the_cell_list():
    cells = grid([2_000_000, 1_000_000], [4, 1], [126, 64])
    assert len(cells) == 8 and len({c.key for c in cells}) == 8
    assert [(c.agents, c.gpu_tokens, c.host_tokens) for c in cells[:4]] == [
        (64, 1_000_000, 1_000_000), (64, 1_000_000, 4_000_000), (64, 2_000_000, 2_000_000), (64, 2_000_000, 8_000_000)]
    assert parse_cells("1.5M:4:126, 2M:1:64", parse_tokens) == [Cell(1_500_000, 6_000_000, 126),
                                                               Cell(2_000_000, 2_000_000, 64)]
    with pytest.raises(ValueError):
        parse_cells("2M:4", parse_tokens)


def test_a_tiny_grid_runs_end_to_end_and_a_second_call_reuses_its_rows(tmp_path, capsys):
    out = tmp_path / "map.json"
    base = ["regimes", "--trace", str(FIXTURE_TRACE), "--nodes", "2", "--warmup", "30s", "--duration", "90s",
            "--out", str(out)]
    # a tiny KV tier (the agents' contexts do not fit) beside a roomy one
    assert main(base + ["--gpu", "60K,2M", "--agents", "12", "--stacks", "static:1P1D"]) == 0
    doc = json.loads(out.read_text())
    assert [(r["gpu_tokens"], r["host_tokens"], r["stack"]) for r in doc["rows"]] == [
        (60_000, 240_000, "static:1P1D"), (2_000_000, 8_000_000, "static:1P1D")]
    small, big = doc["rows"]
    for r in doc["rows"]:  # the map's figures, from the run itself
        assert r["kv_gpu_capacity_tokens"] == 2 * r["gpu_tokens"] and r["kv_host_capacity_tokens"] == 2 * r["host_tokens"]
        assert r["finished"] > 0 and r["throughput_rps"] > 0 and r["regime"] in REGIMES
        assert r["kv_demand_peak_kept"] == pytest.approx(r["kv_demand_peak_tokens"] / r["kv_host_capacity_tokens"])
    # the same agents' contexts (demand is theirs, not where they are held) against 1/33 of the room
    assert small["kv_demand_peak_tokens"] == pytest.approx(big["kv_demand_peak_tokens"], rel=0.5)
    assert small["kv_demand_peak_gpu"] > 10 * big["kv_demand_peak_gpu"]
    assert small["lost_kv_reuse"] > 0.1 > big["lost_kv_reuse"] and small["regime"] == "thrashing"
    assert {c["key"]: c["regime"] for c in doc["cells"]} == {r["key"]: r["regime"] for r in doc["rows"]}
    assert Path(out.with_suffix(".png")).stat().st_size > 10_000
    first = capsys.readouterr().out
    assert "[2/2]" in first and "map:" in first
    # the same settings: the two rows are reused, one stack added at one cell
    assert main(base + ["--cells", "2M:4:12", "--stacks", "static:1P1D,evolving"]) == 0
    doc2 = json.loads(out.read_text())
    assert doc2["rows"][:2] == doc["rows"] and [r["stack"] for r in doc2["rows"]] == ["static:1P1D"] * 2 + ["evolving"]
    assert "[1/1]" in capsys.readouterr().out
    two = next(c for c in doc2["cells"] if c["key"] == big["key"])
    assert two["stacks"] == ["static:1P1D", "evolving"]
    assert two["regime"] == cell_regime([r for r in doc2["rows"] if r["key"] == big["key"]])


def test_replot_without_a_grid_file_says_so_in_one_line(tmp_path, capsys):
    from services.drivers.cli import main

    missing = tmp_path / "none.json"
    assert main(["regimes", "--replot", "--markdown", "--out", str(missing)]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "--replot" in err and "Traceback" not in err
    assert not missing.exists()
