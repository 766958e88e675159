"""Liveness under load: the watcher tells a slow node from a dead one.

A heartbeat is life at its ``ts`` when the node progressed since its previous heartbeat (or its
loop is not late), else only when its loop last answered (``ts - loop_lag_s``); a node's grace
is ``min(max_grace_s, max(timeout_s, jitter_factor * p99 of its silences))``. Exact tables;
the properties are in tests/property/test_liveness_jitter.py."""

from __future__ import annotations

import msgspec

from events.catalog import IterationDone, NodeHeartbeat, NodeRegistered, NodeRemoved, Tick
from services.cores.liveness import LivenessWatcher, _Snap


def _hb(ts: float, node: str = "n1", seq: int = 0, pub: int = 0, lag: float = 0.0) -> NodeHeartbeat:
    return NodeHeartbeat(ts=ts, src=node, node=node, role="collocated", applied_seq=seq, published=pub,
                         loop_lag_s=lag)


def _removed(w: LivenessWatcher, events) -> list[tuple[float, str]]:
    return [(e.ts, e.node) for ev in events for e in w.apply(ev) if isinstance(e, NodeRemoved)]


def test_a_busy_node_that_progresses_is_not_removed_however_late_its_loop():
    w = LivenessWatcher(10.0)
    w.apply(NodeRegistered(ts=0.0, src="n1", node="n1", role="collocated"))
    evs = []
    for t in range(1, 61):  # its loop 30 s late, but its folded sequence moves every beat
        evs += [_hb(float(t), seq=100 + t, lag=30.0), Tick(ts=t + 0.5)]
    assert _removed(w, evs) == []


def test_a_node_whose_loop_has_stopped_is_removed_though_its_heartbeats_come():
    w = LivenessWatcher(10.0)
    w.apply(NodeRegistered(ts=0.0, src="n1", node="n1", role="collocated"))
    evs = [_hb(1.0, seq=5, pub=3)]
    for t in range(2, 30):  # the heartbeat thread goes on; the loop last answered at t = 1
        evs += [_hb(float(t), seq=5, pub=3, lag=t - 1.0), Tick(ts=t + 0.5)]
    out = _removed(w, evs)
    assert out == [(11.5, "n1")]  # 10.5 s after the loop's last answer, as a silent node


def test_any_event_of_the_node_is_life_and_a_heartbeat_without_progress_fields_counts_at_its_ts():
    w = LivenessWatcher(10.0)
    w.apply(NodeRegistered(ts=0.0, src="n1", node="n1", role="collocated"))
    old = NodeHeartbeat(ts=9.5, src="n1", node="n1", role="collocated")  # an earlier producer's
    it = IterationDone(ts=11.0, src="n1", node="n1", phase="decode", duration_s=0.1)
    assert _removed(w, [old, Tick(ts=10.5), it, Tick(ts=20.5), Tick(ts=21.5)]) == [(21.5, "n1")]


def test_the_grace_scales_with_the_nodes_own_silences_and_is_capped():
    w = LivenessWatcher(10.0)  # jitter_factor 3, max_grace_s 30
    w.apply(NodeRegistered(ts=0.0, src="n1", node="n1", role="collocated"))
    w.apply(NodeRegistered(ts=0.0, src="n2", node="n2", role="collocated"))
    evs = []
    for k in range(1, 6):  # n1 speaks every 5 s (its events late), n2 every second
        for t in range(5 * k - 4, 5 * k + 1):
            evs.append(Tick(ts=float(t)))
            evs.append(_hb(float(t), node="n2", seq=t))
        evs.append(_hb(5.0 * k, node="n1", seq=k))
    assert _removed(w, evs) == []
    assert w.grace("n1") == 15.0 and w.grace("n2") == 10.0  # 3 x its 5 s silences; n2 keeps the timeout
    # both go silent at 25: n2 is removed after 10 s, n1 after 15 s
    out = _removed(w, [Tick(ts=25.0 + s) for s in (9.0, 10.5, 14.0, 15.5)])
    assert out == [(35.5, "n2"), (40.5, "n1")]
    w2 = LivenessWatcher(10.0)
    w2.apply(NodeRegistered(ts=0.0, src="n1", node="n1", role="collocated"))
    assert _removed(w2, [ev for t in (9.0, 29.0) for ev in (Tick(ts=t), _hb(t, seq=int(t)))]) == []
    assert w2.grace("n1") == 30.0  # 3 x 20 s, capped at max_grace_s
    assert _removed(w2, [Tick(ts=59.0), Tick(ts=59.5)]) == [(59.5, "n1")]


def test_a_removal_names_the_grace_and_the_snapshot_keeps_the_jitter_and_progress():
    w = LivenessWatcher(10.0, jitter_factor=2.0, max_grace_s=40.0, window=4)
    w.apply(NodeRegistered(ts=0.0, src="n1", node="n1", role="collocated"))
    for t in (7.0, 14.0, 21.0):
        w.apply(Tick(ts=t))
        w.apply(_hb(t, seq=int(t), pub=2))
    r = LivenessWatcher.from_snapshot(w.snapshot())
    assert r.snapshot() == w.snapshot()
    assert (r.grace("n1"), r.window, r.max_grace_s, r.progress) == (14.0, 4, 40.0, {"n1": (21, 2)})
    out = r.apply(Tick(ts=35.5))
    assert [e.reason for e in out] == ["heartbeat timeout: silent for 14.5 s > 14.0 s (the timeout scaled by its jitter)"]


def test_a_snapshot_written_before_the_jitter_rule_reads_with_its_defaults():
    old = msgspec.msgpack.encode([10.0, [("n1", 5.0)], [], [], [], 6.0])  # the six fields it had
    w = LivenessWatcher.from_snapshot(old)
    assert (w.timeout_s, w.max_grace_s, w.jitter_factor, w.last_seen, w.silences) == (10.0, 30.0, 3.0, {"n1": 5.0}, {})
    assert msgspec.msgpack.decode(w.snapshot(), type=_Snap).max_grace_s == 30.0
