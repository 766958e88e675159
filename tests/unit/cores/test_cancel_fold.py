"""How the cores fold a cancellation: ``RequestCancelled`` changes no core's
state and decides nothing (a replay with or without it decides the same), and the engine's
``RequestFinished(error="cancelled")`` closes the request in every core that tracks requests in
flight; ``evolving verify`` reproduces every decision of a log holding both."""

from __future__ import annotations

import json

import pytest

from events.catalog import (
    BranchOpened,
    FirstToken,
    NodeRegistered,
    RequestCancelled,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
    Tick,
)
from services.adapters.eventlog import DuckDbEventLog
from services.cores.liveness import LivenessWatcher
from services.cores.worker_view import WorkerView
from services.drivers.cli import main
from services.drivers.recorder.verify import build_cores
from tests.unit.drivers.recorder.fakecores import live_log

CONFIG = {
    "cores": ["directory", "planner", "router"],
    "planner": {"plugin": "evolving", "kwargs": {"window_s": 4.0, "slices": 4, "warmup_s": 0.0, "cooldown_s": 0.0}},
    "router": {"plugin": "evolving", "kwargs": {"name": "evolving"}},
}


def cores():
    return [c for _, c in build_cores(CONFIG, CONFIG["cores"])] + [LivenessWatcher(), WorkerView()]


def _prefix():
    return [
        NodeRegistered(ts=0.0, src="n0", node="n0", role="collocated", l1_capacity_tokens=10**6,
                       l2_capacity_tokens=10**7),
        BranchOpened(ts=1.0, src="gw", branch="b1"),
        RequestSubmitted(ts=1.0, src="gw", request="r1", branch="b1", blocks=[11, 12, 13], prompt_tokens=200,
                         max_tokens=5000),
    ]


def test_a_cancel_changes_no_core_state_and_decides_nothing():
    for core in cores():
        for ev in _prefix():
            core.apply(ev)
        before = core.snapshot()
        assert core.apply(RequestCancelled(ts=1.5, src="gw", request="r1", branch="b1")) == [], type(core)
        assert core.apply(RequestCancelled(ts=1.6, src="gw", request="nope", branch="b9")) == [], type(core)
        assert core.snapshot() == before, f"{type(core).__name__} changed on a RequestCancelled"


def test_the_engines_cancelled_finish_closes_the_request_everywhere():
    directory, planner, router, liveness, view = cores()
    route = None
    for ev in _prefix():
        for core in (directory, planner, router, liveness, view):
            out = core.apply(ev)
            route = next((e for e in out if isinstance(e, RouteDecided)), route)
    assert route is not None and route.request == "r1"
    rest = [RequestStarted(ts=1.1, src="n0", request="r1", node="n0", phase="prefill"),
            FirstToken(ts=1.2, src="n0", request="r1", node="n0"),
            RequestStarted(ts=1.2, src="n0", request="r1", node="n0", phase="decode"),
            RequestCancelled(ts=1.5, src="gw", request="r1", branch="b1"),
            RequestFinished(ts=1.6, src="n0", request="r1", node="n0", output_tokens=40, error="cancelled")]
    for core in (directory, planner, router, liveness, view):
        core.apply(route)
    assert directory.pinned("n0")  # a routed request pins its blocks until it ends...
    for ev in rest:
        for core in (directory, planner, router, liveness, view):
            core.apply(ev)
    assert not directory.pinned("n0")  # ...which the cancelled finish is: its KV is evictable, still cached
    assert "r1" not in router.state.requests
    assert "r1" not in planner.st.routed_work
    assert "r1" not in liveness.decoding and "r1" not in view.requests


def _log_inputs():
    evs = [NodeRegistered(ts=0.0, src=f"n{i}", node=f"n{i}", role="prefill" if i == 0 else "decode",
                          l1_capacity_tokens=10**6, l2_capacity_tokens=10**7) for i in range(3)]
    for i in range(30):
        t = 1.0 + i * 0.1
        rid, b = f"r{i}", f"b{i}"
        evs += [BranchOpened(ts=t, src="gw", branch=b),
                RequestSubmitted(ts=t, src="gw", request=rid, branch=b, blocks=[1000 * i + k for k in range(8)],
                                 prompt_tokens=8 * 64, max_tokens=300)]
        if i % 3 == 0:  # the client left: the gateway's cancel, the engine's cancelled finish
            evs += [RequestCancelled(ts=t + 0.01, src="gw", request=rid, branch=b),
                    RequestFinished(ts=t + 0.02, src="n1", request=rid, node="n1", error="cancelled")]
        else:
            evs.append(RequestFinished(ts=t + 0.05, src="n1", request=rid, node="n1", output_tokens=300))
        if i % 5 == 4:
            evs.append(Tick(ts=t + 0.06, src="planner"))
    return evs


@pytest.mark.parametrize("with_cancels", [True, False])
def test_verify_refolds_a_log_with_cancellations(tmp_path, capsys, with_cancels):
    evs = [e for e in _log_inputs() if with_cancels or not isinstance(e, RequestCancelled)]
    rows = live_log(evs, [c for _, c in build_cores(CONFIG, CONFIG["cores"])], delay=2, authority=True)
    log = DuckDbEventLog(tmp_path / "run.duckdb")
    log.append(rows)
    log.set_run_config(CONFIG)
    log.close()
    assert main(["verify", str(tmp_path / "run.duckdb"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["reproduced"].get("RouteDecided", 0) == 30
    decisions = [e for _, _, e in rows if isinstance(e, RouteDecided)]
    assert [d.request for d in decisions] == [f"r{i}" for i in range(30)]  # the router ignores cancels
