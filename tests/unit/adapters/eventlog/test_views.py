"""The SQL views over a small hand-built run, and every query of docs/recorder.md."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from events.catalog import (
    EVENT_TYPES,
    Candidate,
    FetchStep,
    FirstToken,
    ModelFitted,
    NodeRegistered,
    NodeScore,
    PlanEvaluated,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RoleSwitched,
    RoleSwitchOrdered,
    RouteDecided,
    Split,
    SwitchRole,
)
from events.subjects import subject_for
from services.adapters.eventlog import DuckDbEventLog
from services.adapters.eventlog.views import NAMED_VIEWS, view_name

DOC = Path(__file__).resolve().parents[4] / "docs" / "recorder.md"
T0 = datetime(2026, 11, 29, 10, 40, tzinfo=UTC).timestamp()
BIG = 2**64 - 1


def scenario():
    t = T0
    evs = [
        NodeRegistered(ts=t, node="n1", role="prefill"),
        NodeRegistered(ts=t, node="n2", role="decode"),
        NodeRegistered(ts=t, node="n3", role="decode"),
        RequestSubmitted(ts=t + 10, request="r1", branch="b1", blocks=[BIG] + list(range(1, 300)),
                         prompt_tokens=300 * 64 + 10, max_tokens=101),
        RouteDecided(ts=t + 10, src="router", request="r1", prefill_node="n1", decode_node="n2", t_c=19200,
                     t_uc=10, predicted_ttft_s=0.75, policy="evolving", branch="b1",
                     fetch_plan=[FetchStep(src_node="n3", first_block=100, n_blocks=120),
                                 FetchStep(src_node="n2", first_block=220, n_blocks=80)],
                     scores=[NodeScore(node="n1", score=0.4, t_c=19200), NodeScore(node="n3", score=0.9)]),
        RouteDecided(ts=t + 10, src="rr", request="r1", prefill_node="n3", decode_node="n2", policy="rr",
                     shadow=True),
        RequestStarted(ts=t + 10.1, request="r1", node="n1", phase="prefill"),
        FirstToken(ts=t + 10.8, request="r1", node="n1"),
        RequestStarted(ts=t + 10.9, request="r1", node="n2", phase="decode"),
        RequestFinished(ts=t + 15.8, request="r1", node="n2", output_tokens=101),
        RequestSubmitted(ts=t + 20, request="r2", branch="b2", blocks=[7, 8], prompt_tokens=130, max_tokens=5),
        RouteDecided(ts=t + 20, request="r2", prefill_node="n3", decode_node="n2", policy="evolving",
                     fetch_plan=[FetchStep(src_node="n1", first_block=0, n_blocks=2)]),
        ModelFitted(ts=t + 30, node="n1", phase="prefill", coefficients=[1e-3, 2e-5, 3e-10, 4e-7], samples=50,
                    mape=0.04),
        PlanEvaluated(ts=t + 90, window_start=t + 30, window_end=t + 90, current=Split(prefill=1, decode=2),
                      candidates=[Candidate(split=Split(prefill=1, decode=2), mean_gain=0.0, se=0.0)],
                      reason="no significant gain", planner="evolving"),
        PlanEvaluated(ts=t + 125, window_start=t + 90, window_end=t + 125, current=Split(prefill=1, decode=2),
                      candidates=[Candidate(split=Split(prefill=2, decode=1), mean_gain=0.31, se=0.05,
                                            passed=True),
                                  Candidate(split=Split(prefill=1, decode=2), mean_gain=0.0, se=0.0)],
                      chosen=Split(prefill=2, decode=1), reason="prefill queue growing", planner="evolving"),
        RoleSwitchOrdered(ts=t + 125, node="n3", from_role="decode", to_role="prefill", reason="plan"),
        SwitchRole(ts=t + 125, node="n3", to_role="prefill"),
        RouteDecided(ts=t + 126, request="r2", prefill_node="n1", decode_node="n2", policy="evolving",
                     reroute=True),
        RoleSwitched(ts=t + 129, node="n3", role="prefill", drained=2, duration_s=4.0),
        RoleSwitchOrdered(ts=t + 600, node="n2", from_role="decode", to_role="prefill", reason="plan"),
    ]
    return [(i + 1, subject_for(e, shadow="rr" if getattr(e, "shadow", False) else None), e)
            for i, e in enumerate(evs)]


@pytest.fixture(scope="module")
def con(tmp_path_factory):
    path = tmp_path_factory.mktemp("views") / "run.duckdb"
    log = DuckDbEventLog(path)
    log.append(scenario())
    log.close()
    ro = DuckDbEventLog(path, read_only=True)
    yield ro.con
    ro.close()


def q(con, sql):
    rel = con.sql(sql)
    return [dict(zip(rel.columns, row)) for row in rel.fetchall()]


def doc_queries() -> list[str]:
    return re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.DOTALL)


def test_every_event_kind_has_a_view_and_every_named_view_exists(con):
    names = {r[0] for r in con.execute("SELECT view_name FROM duckdb_views() WHERE NOT internal").fetchall()}
    assert {view_name(t) for t in EVENT_TYPES} | set(NAMED_VIEWS) <= names


def test_kind_view_has_typed_columns(con):
    rel = con.sql("SELECT blocks, prompt_tokens, request FROM ev_request_submitted WHERE request = 'r1'")
    assert [str(t) for t in rel.types] == ["UBIGINT[]", "BIGINT", "VARCHAR"]
    blocks, tokens, _ = rel.fetchall()[0]
    assert blocks[0] == BIG and len(blocks) == 300 and tokens == 19210


def test_a_field_missing_from_an_old_payload_reads_as_its_default(tmp_path):
    log = DuckDbEventLog(tmp_path / "old.duckdb", format="1")  # a log written before format 2
    log.con.execute("""INSERT INTO events VALUES (1, 5.0, 'RequestSubmitted', '', 's',
                       '{"type":"RequestSubmitted","ts":5.0,"request":"r","branch":"b"}')""")
    assert q(log.con, "SELECT max_tokens, block_tokens, blocks FROM ev_request_submitted") == [
        {"max_tokens": 0, "block_tokens": 64, "blocks": None}]


def test_why_did_node_3_switch_at_10_42(con):
    rows = q(con, doc_queries()[0])
    assert len(rows) == 1
    r = rows[0]
    assert (r["node"], r["from_role"], r["to_role"]) == ("n3", "decode", "prefill")
    assert (r["plan_reason"], r["split_before"], r["split_chosen"]) == ("prefill queue growing", "1P/2D", "2P/1D")
    assert r["switch_s"] == pytest.approx(4.0) and r["drained"] == 2
    cands = q(con, doc_queries()[1])
    assert [(c["prefill"], c["decode"], c["passed"]) for c in cands] == [(2, 1, True), (1, 2, False)]


def test_which_router_decisions_fetched_more_than_10k_tokens(con):
    rows = q(con, doc_queries()[2])
    assert [(r["request"], r["fetched_tokens"], r["fetch_steps"]) for r in rows] == [("r1", 200 * 64, 2)]


def test_requests_view_latencies_and_last_route(con):
    rows = {r["request"]: r for r in q(con, "SELECT * FROM requests ORDER BY request")}
    r1, r2 = rows["r1"], rows["r2"]
    assert r1["ttft_s"] == pytest.approx(0.8) and r1["e2e_s"] == pytest.approx(5.8)
    assert r1["queue_s"] == pytest.approx(0.1) and r1["tpot_s"] == pytest.approx(5.0 / 100)
    assert (r1["prefill_node"], r1["decode_node"], r1["t_c"], r1["t_uc"]) == ("n1", "n2", 19200, 10)
    assert (r1["output_tokens"], r1["n_blocks"], r1["reroutes"], r1["policy"]) == (101, 300, 0, "evolving")
    assert (r2["prefill_node"], r2["reroutes"], r2["finished_ts"], r2["ttft_s"]) == ("n1", 1, None, None)


def test_role_switches_join_the_plan_before_and_the_ack_after(con):
    rows = q(con, "SELECT node, plan_seq, ack_seq, drained FROM role_switches ORDER BY seq")
    assert rows == [{"node": "n3", "plan_seq": 15, "ack_seq": 19, "drained": 2},
                    {"node": "n2", "plan_seq": 15, "ack_seq": None, "drained": None}]


def test_plan_evaluations_and_model_fits(con):
    assert [(r["switched"], r["n_candidates"]) for r in q(con, "SELECT * FROM plan_evaluations ORDER BY seq")] == [
        (False, 1), (True, 2)]
    fit = q(con, "SELECT node, c0, c3, samples FROM model_fits")
    assert fit == [{"node": "n1", "c0": 1e-3, "c3": 4e-7, "samples": 50}]


def test_route_scores_one_row_per_candidate(con):
    rows = q(con, "SELECT node, score, chosen FROM route_scores WHERE request = 'r1' ORDER BY score")
    assert rows == [{"node": "n1", "score": 0.4, "chosen": True}, {"node": "n3", "score": 0.9, "chosen": False}]


def test_the_docs_hold_the_example_queries():
    assert len(doc_queries()) >= 7


@pytest.mark.parametrize("sql", doc_queries(), ids=lambda s: s.split("FROM")[1].split()[0])
def test_every_documented_query_runs_and_returns_rows(con, sql):
    assert con.sql(sql).fetchall(), "each documented query finds something in the scenario"


def test_views_over_parquet_segments_and_a_tail_file_match_the_single_file(tmp_path, con):
    full = DuckDbEventLog(tmp_path / "full.duckdb")
    rows = scenario()
    full.append(rows)
    assert full.export_parquet(tmp_path / "seg-1.parquet", 1, 8) == 8
    assert full.export_parquet(tmp_path / "seg-2.parquet", 9, 14) == 6
    full.close()
    tail = DuckDbEventLog(tmp_path / "tail.duckdb")
    tail.append([r for r in rows if r[0] > 14])
    tail.close()
    from services.adapters.eventlog import open_sources

    mixed = open_sources([str(tmp_path / "seg-*.parquet"), str(tmp_path / "tail.duckdb")])
    for view in ("requests", "role_switches", "route_decisions", "plan_evaluations"):
        sql = f"SELECT * FROM {view} ORDER BY ALL"
        assert mixed.sql(sql).fetchall() == con.sql(sql).fetchall(), view
    mixed.close()


def test_a_read_only_open_sees_the_views_of_its_own_catalog_not_stale_stored_ones(tmp_path):
    log = DuckDbEventLog(tmp_path / "old.duckdb", format="1")  # a log written before format 2
    log.append(scenario())
    log.con.execute("CREATE OR REPLACE VIEW requests AS SELECT 1 AS stale")
    log.close()
    ro = DuckDbEventLog(tmp_path / "old.duckdb", read_only=True)
    assert "ttft_s" in ro.con.sql("SELECT * FROM requests").columns
    ro.close()
