"""``evolving bench dynamo --offline`` without Dynamo (services/drivers/bench/dynamo.py): the trace
both sides replay (sessions and turns cut, one block size), our side's run of it (every request
once, no refill), the rows and the reason a missing Dynamo gives. The real Dynamo's side:
tests/dynamo/test_dynamo_side_by_side.py (``pytest -m dynamo``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import duckdb
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


def test_order_seed_moves_whole_sessions_and_keeps_each_one_s_turns(tmp_path: Path) -> None:
    """``--order-seed``: the same requests, each session's turns contiguous and in their order, the
    sessions in another order (the routing order of the first turns, all at t = 0)."""
    base = [json.loads(line) for line in _written(spec(sessions=8), tmp_path / "a.jsonl")]
    orders = []
    for seed in (1, 2, 3):
        rows = [json.loads(line) for line in _written(spec(sessions=8, order_seed=seed), tmp_path / f"{seed}.jsonl")]
        assert sorted(map(json.dumps, rows)) == sorted(map(json.dumps, base))
        sids = [r["session_id"] for r in rows]
        order = list(dict.fromkeys(sids))
        assert sids == [sid for sid in order for _ in range(sids.count(sid))]  # contiguous
        for sid in order:
            assert [r for r in rows if r["session_id"] == sid] == [r for r in base if r["session_id"] == sid]
        orders.append(order)
    assert orders[0] != list(dict.fromkeys(r["session_id"] for r in base)) or orders[1] != orders[0]


def _written(s: OfflineSpec, path: Path) -> list[str]:
    write_trace(s, path)
    return path.read_text().splitlines()


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


def test_dynamo_style_serves_the_split_the_real_one_is_given(tmp_path: Path) -> None:
    """Our Dynamo-style row runs at ``--prefill`` / ``--decode`` as the real Dynamo's workers do
    (it ran at two thirds of the nodes prefill whatever the split: 2P1D for a 1P2D bench)."""
    s = spec(prefill=1, decode=2, turns=2)
    write_trace(s, tmp_path / "t.jsonl")
    _, (m, _res) = run_ours(s, tmp_path / "t.jsonl", equalised_profile(load_profile(s.profile)), "dynamo")
    assert {k for k, v in m.split_time_s.items() if v > 0} == {"1P2D"}


@pytest.mark.parametrize("start,collocated", [("split", False), ("collocated", True)])
def test_evolving_starts_at_the_bench_split_or_warms_up_collocated(tmp_path: Path, start: str,
                                                                  collocated: bool) -> None:
    s = spec(turns=2, start=start, warmup_s=120.0)
    write_trace(s, tmp_path / "t.jsonl")
    _, (m, res) = run_ours(s, tmp_path / "t.jsonl", equalised_profile(load_profile(s.profile)), "evolving")
    served = {k for k, v in m.split_time_s.items() if v > 0}
    assert res.finished == res.submitted
    assert any(k.endswith("C") for k in served) == collocated, served
    if not collocated:
        assert served == {"2P1D"}


def test_kept_logs_are_event_logs_verify_reproduces(tmp_path: Path, capsys) -> None:
    """``--keep``: each of our stacks writes its DuckDB event log beside the trace; ``evolving
    verify`` rebuilds the cores from its run_config and reproduces every decision."""
    from services.drivers.cli import main

    res = run_offline(spec(stacks=("evolving", "static:2P1D")), python=tmp_path / "none", work=tmp_path,
                      keep_logs=True)
    assert res["logs"] == {"evolving": str(tmp_path / "evolving.duckdb"),
                           "static:2P1D": str(tmp_path / "static_2P1D.duckdb")}
    capsys.readouterr()
    for path in res["logs"].values():
        assert main(["verify", path]) == 0
        assert "every recorded decision was reproduced exactly" in capsys.readouterr().out
    assert run_offline(spec(stacks=("evolving",)), python=tmp_path / "none", work=tmp_path / "w")["logs"] == {}


def test_host_kv_tokens_sets_our_nodes_host_tier(tmp_path: Path) -> None:
    res = run_offline(spec(stacks=("evolving",), host_kv_tokens=0), python=tmp_path / "none", work=tmp_path,
                      keep_logs=True)
    with duckdb.connect(res["logs"]["evolving"], read_only=True) as con:
        cfg = {k: json.loads(v) for k, v in con.sql("SELECT key, value FROM run_config").fetchall()}
    assert cfg["kv_host_tokens"] == 0 and cfg["bench"] == "dynamo --offline"


def test_dynamo_style_has_no_host_tier_as_the_replay_s_workers(tmp_path: Path) -> None:
    """The replay's mocker workers hold GPU KV only: the dynamo-style row's nodes too, whatever the
    other stacks keep (the profile's host tier here; it restored evicted prefixes at no cost)."""
    res = run_offline(spec(stacks=("dynamo", "evolving", "dynamo-planned")), python=tmp_path / "none", work=tmp_path,
                      keep_logs=True)
    host = {}
    for stack, path in res["logs"].items():
        with duckdb.connect(path, read_only=True) as con:
            host[stack] = json.loads(con.execute("SELECT value FROM run_config WHERE key = 'kv_host_tokens'").fetchone()[0])
    prof = load_profile("gb300-glm52-pressure")
    assert host == {"dynamo-style": 0, "evolving": prof.l2_capacity_tokens, "dynamo-planned": prof.l2_capacity_tokens}


def test_dynamo_style_is_deployed_as_the_replay_deploys_the_real_one(tmp_path: Path) -> None:
    """Dynamo's replay runs its KV router and no planner (no ``planner_config``): so does the
    dynamo-style row (it ran the matrix baseline's planner, which restarted a prefill node into
    decode mid-run at ``scale:0``, and SGLang-style cache-aware routing). ``dynamo-planned`` is
    the matrix baseline at the same split."""
    s = spec(turns=2)
    write_trace(s, tmp_path / "t.jsonl")
    prof = equalised_profile(load_profile(s.profile))
    for name, want in (("dynamo", "planner=static router=dynamo_kv"),
                       ("dynamo-planned", "planner=dynamo router=cache_aware")):
        log = tmp_path / f"{name}.duckdb"
        run_ours(s, tmp_path / "t.jsonl", prof, name, log)
        with duckdb.connect(str(log), read_only=True) as c:
            conf = dict(c.sql("SELECT key, value FROM run_config").fetchall())
        assert want in json.loads(conf["stack"]) and "start=2P1D" in json.loads(conf["stack"])
        router = json.loads(conf["router"])["class"]
        assert router.endswith("DynamoKvRouter" if name == "dynamo" else "CacheAwareRouter")
