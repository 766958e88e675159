"""verify: a faithful log is reproduced; a tampered, dropped or injected decision is caught."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from events.catalog import NodeHeartbeat, NodeRemoved, RequestSubmitted, RouteDecided, SwitchRole, Tick
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.recorder.verify import (
    CoreSpec,
    _checks_planner,
    _checks_router,
    build_cores,
    verify_log,
    verify_rows,
)
from tests.unit.drivers.recorder.fakecores import Exploding, FakePlanner, FakeRouter, inputs, live_log

REGISTRY = {
    "router": CoreSpec("router", lambda cfg: FakeRouter(**cfg.get("kwargs", {})), _checks_router),
    "planner": CoreSpec("planner", lambda cfg: FakePlanner(**cfg.get("kwargs", {})), _checks_planner),
}


def fresh(names=("router", "planner"), config=None):
    return build_cores(config or {}, names, REGISTRY)


def recorded(delay=0, n=12):
    return live_log(inputs(n), [FakeRouter(), FakePlanner()], delay=delay)


def decisions(rows, kind=None):
    return [(s, e) for s, _, e in rows if type(e).__name__ in
            ({kind} if kind else {"RouteDecided", "PlanEvaluated", "RoleSwitchOrdered", "SwitchRole"})]


@pytest.mark.parametrize("delay", [0, 1, 4])
def test_a_faithful_log_is_reproduced_whatever_the_publish_delay(delay):
    rows = recorded(delay)
    report = verify_rows(rows, fresh())
    assert report.ok, report.to_dict()
    assert report.events == len(rows)
    assert dict(report.checked) == {"RouteDecided": 12, "PlanEvaluated": 3, "RoleSwitchOrdered": 3, "SwitchRole": 3}
    assert report.not_recorded == []


def test_a_tampered_decision_is_the_first_divergence_with_both_versions():
    rows = recorded(delay=2)
    seq, original = decisions(rows, "RouteDecided")[5]
    forged = msgspec.structs.replace(original, prefill_node="n9")
    rows[seq - 1] = (seq, rows[seq - 1][1], forged)
    report = verify_rows(rows, fresh())
    assert not report.ok
    d = report.first_divergence
    assert (d.seq, d.core, d.kind) == (seq, "router", "mismatch")
    assert d.recorded == forged and d.predicted == original
    assert 0 < d.predicted_after_seq < seq
    assert report.checked["RouteDecided"] == 5  # the five before it matched
    out = report.to_dict()["first_divergence"]
    assert out["recorded"]["prefill_node"] == "n9" and out["predicted"]["prefill_node"] == original.prefill_node


def test_a_tampered_float_by_one_ulp_is_caught():
    rows = recorded()
    seq, original = decisions(rows, "PlanEvaluated")[1]
    import math

    forged = msgspec.structs.replace(original, window_end=math.nextafter(original.window_end, 1e9))
    rows[seq - 1] = (seq, rows[seq - 1][1], forged)
    d = verify_rows(rows, fresh()).first_divergence
    assert (d.seq, d.kind, d.core) == (seq, "mismatch", "planner")


def test_a_dropped_decision_is_caught_at_the_next_one():
    rows = recorded()
    seq, _ = decisions(rows, "SwitchRole")[0]
    rows = [r for r in rows if r[0] != seq]
    report = verify_rows(rows, fresh())
    d = report.first_divergence
    assert d.kind == "mismatch" and isinstance(d.predicted, SwitchRole) and d.seq > seq


def test_an_injected_decision_is_not_reproduced():
    rows = recorded()
    fake = RouteDecided(ts=0.5, request="ghost", prefill_node="n1", decode_node="n1", policy="fake")
    rows = [(1, "ei.default.route", fake)] + [(s + 1, subj, e) for s, subj, e in rows]  # the router's own subject
    d = verify_rows(rows, fresh()).first_divergence
    assert (d.seq, d.kind, d.recorded) == (1, "not_reproduced", fake)


def test_shadow_decisions_are_folded_but_not_checked():
    rows = recorded()
    shadow = RouteDecided(ts=1.0, request="r0", prefill_node="n9", decode_node="n9", policy="rr", shadow=True)
    rows = [(s * 2, subj, e) for s, subj, e in rows]
    rows.insert(5, (9, "ei.default.shadow.rr.routedecided", shadow))
    rows.sort(key=lambda r: r[0])
    report = verify_rows(rows, fresh())
    assert report.ok and report.checked["RouteDecided"] == 12


def test_keep_going_counts_every_divergence():
    rows = recorded()
    for seq, ev in decisions(rows, "PlanEvaluated"):
        rows[seq - 1] = (seq, rows[seq - 1][1], msgspec.structs.replace(ev, reason="forged"))
    assert len(verify_rows(rows, fresh()).divergences) == 1
    assert len(verify_rows(rows, fresh(), keep_going=True).divergences) == 3


def test_a_log_cut_before_a_decision_reports_it_and_fails_only_when_strict():
    rows = recorded(delay=3)
    last_input = max(s for s, _, e in rows if isinstance(e, Tick))
    cut = rows[:last_input]
    report = verify_rows(cut, fresh())
    assert report.ok and len(report.not_recorded) == 3  # PlanEvaluated, RoleSwitchOrdered, SwitchRole
    assert report.not_recorded[0].predicted_after_seq == last_input
    assert not verify_rows(cut, fresh(), strict=True).ok


def test_the_publisher_id_stamped_by_the_adapter_is_not_a_divergence():
    rows = live_log(inputs(), [FakeRouter(), FakePlanner()], src="svc-1")
    assert verify_rows(rows, fresh()).ok


def test_a_core_that_raises_is_a_divergence():
    spec = CoreSpec("boom", lambda cfg: Exploding())
    report = verify_rows(recorded(), [(spec, Exploding())])
    d = report.first_divergence
    assert d.kind == "core_error" and isinstance(d.recorded, Tick) and "invariant broken" in d.detail


def test_cores_are_built_from_run_config(tmp_path):
    log = DuckDbEventLog(tmp_path / "run.duckdb")
    log.append(live_log(inputs(), [FakeRouter(), FakePlanner(switch_at=2)]))
    log.set_run_config({"planner": {"kwargs": {"switch_at": 2}}, "cores": ["router", "planner"]})
    report = verify_log(log, registry=REGISTRY)
    assert report.ok and report.checked["RoleSwitchOrdered"] == 3
    # the same log against a planner built with the wrong config diverges
    log.set_run_config({"planner": {"kwargs": {"switch_at": 5}}})
    assert not verify_log(log, registry=REGISTRY).ok


def test_unknown_core_name_is_a_clear_error():
    with pytest.raises(KeyError, match="no core named 'nope'"):
        build_cores({}, ["nope"], REGISTRY)


def test_decisions_stored_out_of_emission_order_are_reproduced_and_counted():
    # seen under chaos: a router batch whose first publication was lost with the stream leader and
    # retried lands after the decisions that followed it, bytes unchanged (published 4 events
    # late: both inputs are folded before either decision lands)
    rows = recorded(delay=4)
    routes = decisions(rows, "RouteDecided")
    submitted = {e.request: s for s, _, e in rows if isinstance(e, RequestSubmitted)}
    (s1, first), (s2, second) = next((a, b) for a, b in itertools.pairwise(routes)
                                     if submitted[b[1].request] < a[0])
    rows[s1 - 1], rows[s2 - 1] = (s1, rows[s1 - 1][1], second), (s2, rows[s2 - 1][1], first)
    report = verify_rows(rows, fresh())
    assert report.ok, report.to_dict()
    assert report.reordered == 1 and report.checked["RouteDecided"] == 12
    assert report.to_dict()["reordered"] == 1


def test_a_decision_overtaken_and_never_recorded_is_a_divergence_even_when_not_strict():
    rows = recorded()
    seq, dropped = decisions(rows, "RouteDecided")[2]
    rows = [r for r in rows if r[0] != seq]
    report = verify_rows(rows, fresh(), keep_going=True)
    assert not report.ok
    d = report.first_divergence
    assert d.kind == "mismatch" and d.predicted == dropped and d.seq > seq and d.recorded is None


# --------------------------------------------------------------------------- authority and gaps
def forged_log(authority=True):
    """The fake run with forgeries on the stream, refused (never folded) by the live services."""
    evs = inputs()
    evs.insert(3, ("ei.default.agent.b", SwitchRole(ts=1.5, node="n1", to_role="prefill")))  # the gateway's subject
    evs.insert(8, ("ei.default.node.n1", NodeRemoved(ts=3.0, node="n2")))  # engine n1 about n2
    evs.insert(12, ("ei.default.node.n1", NodeHeartbeat(ts=float("nan"), node="n1", role="decode")))
    # an hour ahead: kept alive for an hour (the planner's own Tick may move the clock: a clock setter)
    evs.insert(14, ("ei.default.node.n1", NodeHeartbeat(ts=3600.0, node="n1", role="decode")))
    # engine n1's far-future Tick: not its subject's family (folded, it would end every window)
    evs.insert(16, ("ei.default.node.n1", Tick(ts=3600.0)))
    return live_log(evs, [FakeRouter(), FakePlanner()], delay=1, authority=authority)


def test_forged_events_are_refused_listed_and_never_folded_nor_compared():
    rows = forged_log()
    report = verify_rows(rows, fresh())
    assert report.ok, report.to_dict()
    got = [(r.seq, r.subject, r.type) for r in report.refusals]
    want = [(s, subj, type(e).__name__) for s, subj, e in rows
            if (isinstance(e, SwitchRole) and subj == "ei.default.agent.b")
            or isinstance(e, NodeRemoved | NodeHeartbeat) or (isinstance(e, Tick) and subj == "ei.default.node.n1")]
    assert got == want and report.refused == 5 and report.folded == len(rows) - 5
    reasons = [r.reason for r in report.refusals]
    assert "may not be published on 'ei.default.agent.b'" in reasons[0]
    assert "about 'n2' may not be published on 'ei.default.node.n1'" in reasons[1]
    assert reasons[2] == "ts is not a finite number (nan)" and "ahead of the stream's time" in reasons[3]
    # every decision of the cores is reproduced (the forged SwitchRole is no planner decision)
    assert report.checked["RouteDecided"] == 12 and report.checked["SwitchRole"] == 3
    out = report.to_dict()
    assert "Tick may not be published on 'ei.default.node.n1'" in reasons[4]
    assert out["refused"] == 5 and out["refusals"][0] == {"seq": got[0][0], "subject": "ei.default.agent.b",
                                                          "type": "SwitchRole", "reason": reasons[0]}


def test_the_same_forgeries_folded_would_diverge():
    """What the refusal saves: a log whose services folded them no longer matches fresh cores
    that refuse them (and the forged SwitchRole on its own would be an unreproduced decision)."""
    assert not verify_rows(forged_log(authority=False), fresh()).ok


def test_a_forged_decision_on_a_subject_not_its_own_is_refused_not_compared():
    rows = recorded()
    fake = RouteDecided(ts=0.5, request="ghost", prefill_node="n1", decode_node="n1", policy="fake")
    rows = [(1, "ei.default.agent.b", fake)] + [(s + 1, subj, e) for s, subj, e in rows]
    report = verify_rows(rows, fresh())
    assert report.ok and report.checked["RouteDecided"] == 12
    assert [(r.seq, r.type) for r in report.refusals] == [(1, "RouteDecided")]


def test_rows_without_a_subject_get_the_timestamp_rule_only():
    rows = [(s, "", e) for s, _, e in recorded()]
    n = len(rows)
    rows += [(n + 1, "", SwitchRole(ts=20.0, node="n1", to_role="decode")),  # no subject: not checked
             (n + 2, "", Tick(ts=float("inf")))]
    report = verify_rows(rows, fresh(), keep_going=True)
    assert [(r.seq, r.reason) for r in report.refusals] == [(n + 2, "ts is not a finite number (inf)")]
    assert [d.seq for d in report.divergences] == [n + 1]  # an unpredicted SwitchRole, compared


def write(path, rows, config=None):
    log = DuckDbEventLog(path)
    log.append(rows)
    log.set_run_config(config or {"cores": ["router", "planner"]})
    log.close()
    return path


def delete(path, seqs):
    log = DuckDbEventLog(path)
    log.con.execute("DELETE FROM event_rows WHERE list_contains(?, seq)", [sorted(seqs)])
    log.close()


def verify_file(path, **kw):
    log = DuckDbEventLog(path, read_only=True)
    try:
        return verify_log(log, registry=REGISTRY, **kw)
    finally:
        log.close()


def test_rows_deleted_from_the_log_are_named_as_gaps(tmp_path):
    rows = recorded()
    n = len(rows)
    path = write(tmp_path / "run.duckdb", rows)
    assert verify_file(path).complete and verify_file(path).ok
    delete(path, {1, 2, 10, 11, 12, 20, n})
    report = verify_file(path)
    assert report.gaps == [(1, 2), (10, 12), (20, 20), (n, n)] and not report.ok and not report.complete
    out = report.to_dict()
    assert out["missing"] == 7 and out["gaps"] == [[1, 2], [10, 12], [20, 20], [n, n]] and out["applied_seq"] == n


def test_gaps_are_found_past_the_first_divergence(tmp_path):
    rows = recorded()
    seq, ev = decisions(rows, "RouteDecided")[0]
    rows[seq - 1] = (seq, rows[seq - 1][1], msgspec.structs.replace(ev, t_uc=1))
    path = write(tmp_path / "run.duckdb", rows)
    delete(path, {len(rows) - 1})
    report = verify_file(path)  # not keep_going: the replay stops at the divergence, the gap check does not
    assert report.divergences[0].seq == seq and report.gaps == [(len(rows) - 1, len(rows) - 1)]


def test_seqs_the_recorder_was_not_handed_are_no_gap(tmp_path):
    """A log that begins after seq 1 (the stream's limits dropped the start) or skips a seq (a
    message the recorder's consumer dead-lettered) says so: verify names them, and is OK."""
    rows = [(s + 100 + (s > 30), subj, e) for s, subj, e in recorded()]
    path = write(tmp_path / "run.duckdb", rows)
    report = verify_file(path)
    assert report.ok and report.gaps == [] and report.skipped == [(1, 100), (131, 131)]
    assert report.to_dict()["skipped"] == 101


def test_a_log_written_before_skips_were_noted(tmp_path):
    """Its beginning is unknown (not a gap); a hole inside it is a gap (deleted or not handed: unknowable)."""
    rows = [(s + 100, subj, e) for s, subj, e in recorded()]
    path = write(tmp_path / "run.duckdb", rows)
    delete(path, {120})
    log = DuckDbEventLog(path)
    log.con.execute("DROP TABLE skipped_seqs")
    log.con.execute("DELETE FROM log_meta WHERE key = 'skipped_since'")
    log.close()
    report = verify_file(path)
    assert report.start_unknown == (1, 100) and report.gaps == [(120, 120)] and not report.skipped_noted


def test_an_empty_log_with_an_applied_position_is_one_gap(tmp_path):
    rows = recorded()
    path = write(tmp_path / "run.duckdb", rows)
    delete(path, {s for s, _, _ in rows})
    assert verify_file(path).gaps == [(1, len(rows))]
