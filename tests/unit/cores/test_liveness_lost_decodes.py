"""A removed node's decodes end with a clear error (an engine killed mid-decode left its
requests in flight for good). The liveness watcher fails every request past its first token
whose decode node is removed, once, from event ``ts`` only: at once when the engine says its KV
is gone (restarted, shutdown), after a grace of ``timeout_s`` for a removal for silence (a node
only late comes back and finishes them); its snapshot carries what it tracks."""

from __future__ import annotations

from events.catalog import (
    FirstToken,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestStarted,
    RouteDecided,
    Tick,
)
from services.cores.liveness import LivenessWatcher


def _route(req: str, decode: str, **kw) -> RouteDecided:
    return RouteDecided(ts=1.0, src="router", request=req, prefill_node="p0", decode_node=decode, **kw)


def _feed(w: LivenessWatcher, events) -> list:
    return [e for ev in events for e in w.apply(ev)]


def test_requests_decoding_on_a_removed_node_are_finished_with_an_error():
    w = LivenessWatcher(6.0)
    out = _feed(w, [NodeRegistered(ts=0.0, node=n, role="decode") for n in ("d0", "d1")] + [
        _route("a", "d0"), _route("b", "d0"), _route("c", "d1"), _route("q", "d0"),
        _route("s", "d1", shadow=True),  # a shadow decision places nothing
        FirstToken(ts=1.5, request="a", node="p0"),  # a: KV on its way to d0
        RequestStarted(ts=1.6, request="b", node="d0", phase="decode"), FirstToken(ts=1.5, request="c", node="p0"),
        RequestStarted(ts=1.6, request="c", node="d1", phase="decode"),
        FirstToken(ts=1.5, request="z", node="p0"),  # never routed here: not tracked
    ])
    assert out == []
    # "q" has no first token yet: the router re-routes it, the watcher leaves it alone
    snap = LivenessWatcher.from_snapshot(w.snapshot())
    for watcher in (w, snap):
        lost = _feed(watcher, [NodeRemoved(ts=9.0, src="d0", node="d0", reason="restarted")])
        assert [(type(e), e.request, e.node, e.ts, e.src) for e in lost] == [
            (RequestFinished, "a", "d0", 9.0, "liveness"), (RequestFinished, "b", "d0", 9.0, "liveness")]
        assert all("d0 was removed mid-decode (restarted)" in e.error for e in lost)
        assert _feed(watcher, [NodeRemoved(ts=9.5, node="d0")]) == []  # once
    assert _feed(w, [RequestFinished(ts=3.0, request="c", node="d1"), NodeRemoved(ts=10.0, node="d1")]) == []


def test_a_decode_only_reroute_moves_what_a_removal_fails():
    w = LivenessWatcher(6.0)
    _feed(w, [_route("a", "d0"), _route("a", "d1", reroute=True), FirstToken(ts=2.0, request="a", node="p0")])
    assert _feed(w, [NodeRemoved(ts=3.0, node="d0", reason="shutdown")]) == []
    assert [e.request for e in _feed(w, [NodeRemoved(ts=3.0, node="d1", reason="shutdown")])] == ["a"]


def test_a_node_removed_for_silence_keeps_its_decodes_if_it_comes_back_in_time():
    w = LivenessWatcher(6.0)
    _feed(w, [NodeRegistered(ts=0.0, node="d0", role="decode"), _route("a", "d0"), _route("b", "d0"),
              FirstToken(ts=1.0, request="a", node="p0"), FirstToken(ts=1.0, request="b", node="p0")])
    removed = _feed(w, [Tick(ts=8.0)])
    assert [type(e) for e in removed] == [NodeRemoved]
    assert _feed(w, removed) == []  # its echo: the node may only be late
    assert _feed(w, [NodeRegistered(ts=9.0, node="d0", role="decode")]) == []
    assert _feed(w, [Tick(ts=14.5)]) == []  # back in time: nothing failed at the end of the grace
    assert _feed(w, [RequestFinished(ts=15.0, request="a", node="d0")]) == []  # it finished it
    # removed again, and this time it stays away: failed once the grace is over
    again = _feed(w, [NodeRemoved(ts=30.0, src="liveness", node="d0", reason="heartbeat timeout")])
    assert again == [] and _feed(w, [Tick(ts=35.0)]) == []
    snap = LivenessWatcher.from_snapshot(w.snapshot())
    for watcher in (w, snap):
        lost = _feed(watcher, [Tick(ts=36.5)])
        assert [(e.request, e.ts) for e in lost] == [("b", 36.5)] and "not back 6 s" in lost[0].error
        assert _feed(watcher, [Tick(ts=50.0)]) == []


def test_a_registration_that_arrives_late_counts_from_when_it_is_folded():
    # seen under chaos: a worker whose publications lagged 2 minutes registered again with a ts 126 s
    # old and was removed at the next tick, again and again
    w = LivenessWatcher(6.0)
    _feed(w, [NodeRegistered(ts=0.0, node="p1", role="prefill"), Tick(ts=100.0)])  # removed (silent)
    assert _feed(w, [NodeRegistered(ts=2.0, node="p1", role="prefill"), Tick(ts=101.0)]) == []
    snap = LivenessWatcher.from_snapshot(w.snapshot())
    for watcher in (w, snap):
        assert [e.node for e in _feed(watcher, [Tick(ts=107.5)])] == ["p1"]  # then silence counts
