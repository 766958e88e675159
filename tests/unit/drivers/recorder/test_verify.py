"""verify: a faithful log is reproduced; a tampered, dropped or injected decision is caught."""

from __future__ import annotations

import itertools

import msgspec
import pytest

from events.catalog import RequestSubmitted, RouteDecided, SwitchRole, Tick
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
    rows = [(1, "x", fake)] + [(s + 1, subj, e) for s, subj, e in rows]
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
    # issue 26: a router batch whose first publication was lost with the stream leader and
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
