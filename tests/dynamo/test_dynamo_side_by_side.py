"""The real NVIDIA Dynamo (ai-dynamo 1.6.1 in .venv-dynamo: ``bash scripts/setup.sh --dynamo``) beside
our simulator (``pytest -m dynamo``, not in the default suite; skipped with
the reason where Dynamo is not installed).

- One request, one prefill and one decode worker on each side, the same engine model
  (services/drivers/bench/dynamo_model.py): prefill and decode times agree within 5%; from the
  prefill's end to the last token within 1%, one output token to 300.
- ``evolving bench dynamo --offline --json`` on a small cut of the bundled sessions: the rows'
  shape, the same request count on every side, the real Dynamo's row named ``dynamo``.
- ``--live --json`` on a tinier cut: both live stacks answer every request (services/drivers/bench/dynamo_live.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.profiles import load_profile
from services.drivers.bench.dynamo import OfflineSpec, dynamo_missing, run_dynamo, run_ours
from services.drivers.bench.dynamo_model import equalised_profile

pytestmark = pytest.mark.dynamo

WHY = dynamo_missing()


@pytest.fixture(autouse=True)
def _needs_dynamo() -> None:
    if WHY:
        pytest.skip(WHY)


@pytest.mark.parametrize("input_tokens,output_tokens", [(20_000, 500), (70_000, 1200)])
def test_one_request_prefill_and_decode_agree_within_5_percent(tmp_path: Path, input_tokens: int,
                                                               output_tokens: int) -> None:
    prof = equalised_profile(load_profile("gb300-glm52-pressure"))
    trace = tmp_path / "one.jsonl"
    trace.write_text(json.dumps({"session_id": "s", "input_length": input_tokens, "output_length": output_tokens,
                                 "hash_ids": list(range(-(-input_tokens // 64)))}) + "\n")
    spec = OfflineSpec(trace=str(trace), sessions=1, turns=1, block_tokens=64, concurrency=1,
                       profile="gb300-glm52-pressure", prefill=1, decode=1, stacks=("static:1P1D",))
    theirs, out = run_dynamo(spec, trace, prof, tmp_path)
    ours, _ = run_ours(spec, trace, prof, "static:1P1D")
    assert len(out["requests"]) == 1 and theirs["requests"] == ours["requests"] == 1
    assert ours["prefill_done_p50_s"] == pytest.approx(theirs["prefill_done_p50_s"], rel=0.05)
    theirs_decode = theirs["e2e_mean_s"] - theirs["ttft_p50_s"]
    ours_decode = ours["e2e_mean_s"] - ours["ttft_p50_s"]
    assert ours_decode == pytest.approx(theirs_decode, rel=0.05)


@pytest.mark.parametrize("output_tokens", [1, 2, 13, 300])
def test_one_request_prefill_end_to_last_token_agrees_within_1_percent(tmp_path: Path, output_tokens: int) -> None:
    """The decode side step for step: the mocker emits every output token on the decode worker
    after the transfer, one a step; our equalised engine the same (dynamo_model.py). Before, with
    2.6 tokens a 9.5 ms iteration and the first token at the prefill's end, one token took 7.0 ms
    on ours against the mocker's 9.6 and two 16.5 against 13.3 (a 1 ms fixed transfer latency included)."""
    prof = equalised_profile(load_profile("gb300-glm52-pressure"))
    trace = tmp_path / "one.jsonl"
    trace.write_text(json.dumps({"session_id": "s", "input_length": 20_000, "output_length": output_tokens,
                                 "hash_ids": list(range(-(-20_000 // 64)))}) + "\n")
    spec = OfflineSpec(trace=str(trace), sessions=1, turns=1, block_tokens=64, concurrency=1,
                       profile="gb300-glm52-pressure", prefill=1, decode=1, stacks=("static:1P1D",))
    _, out = run_dynamo(spec, trace, prof, tmp_path)
    q = out["requests"][0]
    theirs_s = (q["arrival_time_ms"] + q["e2e_latency_ms"] - q["source_held_ms"]) / 1000.0
    ours, _ = run_ours(spec, trace, prof, "static:1P1D")
    assert ours["e2e_mean_s"] - ours["prefill_done_p50_s"] == pytest.approx(theirs_s, rel=0.01)


def test_bench_offline_json_rows(capsys) -> None:
    from services.drivers.cli import main

    assert main(["bench", "dynamo", "--offline", "--sessions", "4", "--turns", "3", "--concurrency", "2",
                 "--prefill", "2", "--decode", "1", "--stacks", "dynamo,static:1P2D", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    rows = res["rows"]
    assert {r["mode"] for r in rows} == {"offline"}
    assert {r["stack"] for r in rows} == {"dynamo", "dynamo-style", "static:1P2D"}
    counts = {r["stack"]: r["value"] for r in rows if r["metric"] == "requests"}
    assert set(counts.values()) == {float(res["requests"])} and res["requests"] > 4
    assert res["dynamo_version"] == "1.6.1"


def test_bench_live_json_rows(capsys, tmp_path: Path) -> None:
    """``--live`` on a tiny cut: Dynamo's frontend + mockers and ``evolving up`` serve the same
    requests through one client, every one answered on both sides, the second turns of a session
    served from cache on both, CPU split by process role."""
    from services.drivers.cli import main

    assert main(["bench", "dynamo", "--live", "--sessions", "2", "--turns", "2", "--engines", "2",
                 "--overhead-requests", "4", "--idle-s", "2", "--keep", str(tmp_path), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    by = {(r["stack"], r["metric"]): r["value"] for r in res["rows"]}
    assert {r["mode"] for r in res["rows"]} == {"live"} and {r["stack"] for r in res["rows"]} == {"dynamo", "evolving"}
    for stack in ("dynamo", "evolving"):
        assert by[(stack, "requests")] == res["requests"] == 4 and by[(stack, "errors")] == 0
        assert 0 < by[(stack, "kv_hit")] < 1 and by[(stack, "cpu_ms_per_request")] > 0
        assert by[(stack, "idle_cpu_ms_per_s")] >= 0
        assert by[(stack, "overhead_ttft_p50_ms.c1")] > res["prefill_1block_ms"] * 0.9
    assert {"frontend", "mockers"} <= {m.split(".", 1)[1] for s, m in by if s == "dynamo" and m.startswith("cpu_ms_per_request.")}
    ours = {m.split(".", 1)[1] for s, m in by if s == "evolving" and m.startswith("cpu_ms_per_request.")}
    assert {"gateway", "router", "directory", "planner", "recorder", "engines", "nats-server"} <= ours
    assert res["dynamo_version"] == "1.6.1"
