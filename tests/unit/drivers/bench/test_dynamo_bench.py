"""``evolving bench dynamo --offline`` without Dynamo (services/drivers/bench/dynamo.py): the trace
both sides replay (sessions and turns cut, one block size), our side's run of it (every request
once, no refill), the rows and the reason a missing Dynamo gives. The real Dynamo's side:
tests/dynamo/test_dynamo_side_by_side.py (``pytest -m dynamo``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from engine.profiles import load_profile
from services.drivers.bench.dynamo import (
    OfflineSpec,
    dynamo_missing,
    ratios,
    row_label,
    run_offline,
    run_ours,
    write_trace,
)
from services.drivers.bench.dynamo_model import equalised_profile

FIXTURE = str(Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "weka-claude-code")


def spec(**kw) -> OfflineSpec:
    base = {"trace": FIXTURE, "sessions": 2, "turns": 3, "block_tokens": 64, "concurrency": 2,
            "profile": "gb300-glm52-pressure", "prefill": 2, "decode": 1, "stacks": ("dynamo",)}
    return OfflineSpec(**{**base, **kw})


def test_trace_keeps_the_first_turns_of_the_first_sessions(tmp_path: Path) -> None:
    n = write_trace(spec(), tmp_path / "t.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    per = Counter(r["session_id"] for r in rows)
    assert n == len(rows) and len(per) == 2 and max(per.values()) <= 3
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 64) for r in rows)


def test_ours_runs_every_request_once(tmp_path: Path) -> None:
    s = spec(turns=4)
    n = write_trace(s, tmp_path / "t.jsonl")
    figs, (_m, res) = run_ours(s, tmp_path / "t.jsonl", equalised_profile(load_profile(s.profile)), "dynamo")
    assert res.finished == res.submitted == n and figs["requests"] == n
    assert 0.0 < figs["ttft_p50_s"] <= figs["ttft_p95_s"] and 0.0 < figs["kv_hit"] < 1.0


def test_without_dynamo_the_rows_are_ours_and_a_note_says_why(tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    assert "setup.sh --dynamo" in (dynamo_missing(missing) or "")
    res = run_offline(spec(stacks=("dynamo", "static:2P1D")), python=missing)
    assert {r["stack"] for r in res["rows"]} == {"dynamo-style", "static:2P1D"}
    assert {r["mode"] for r in res["rows"]} == {"offline"}
    assert any("no dynamo row" in n for n in res["notes"]) and res["dynamo_version"] is None


def test_labels_and_ratios() -> None:
    assert row_label("dynamo") == "dynamo-style" and row_label("evolving") == "evolving"
    rows = [{"mode": "offline", "stack": "dynamo", "metric": "ttft_p50_s", "value": 2.0},
            {"mode": "offline", "stack": "dynamo-style", "metric": "ttft_p50_s", "value": 1.0}]
    assert ratios(rows, against="dynamo-style") == {"ttft_p50_s": pytest.approx(0.5)}
