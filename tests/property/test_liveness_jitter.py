"""Hypothesis: the liveness rule (services/cores/liveness.py).

* A node that goes on - heartbeats every ``h`` seconds, however late they reach the stream
  within the timeout, however late its loop, as long as it progresses - is never removed.
* A dead node is removed, whatever its history: at the latest at the first tick more than
  ``max_grace_s`` after its last event.
* The watcher is deterministic, and a snapshot taken anywhere and restored decides the rest
  exactly as the watcher that never stopped (what a planner restart and ``verify`` rely on).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from events.catalog import IterationDone, NodeHeartbeat, NodeRegistered, NodeRemoved, Tick
from services.cores.liveness import LivenessWatcher
from tests.hyp import examples


def _hb(ts: float, node: str, seq: int, lag: float) -> NodeHeartbeat:
    return NodeHeartbeat(ts=ts, src=node, node=node, role="decode", applied_seq=seq, published=seq,
                         loop_lag_s=lag)


@settings(max_examples=examples(200), deadline=None)
@given(h=st.floats(0.2, 2.0), tick_s=st.floats(0.1, 3.0), delays=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=9),
       lags=st.lists(st.floats(0.0, 120.0), min_size=1, max_size=9), duration=st.floats(10.0, 200.0),
       timeout=st.floats(5.0, 30.0))
def test_a_node_that_progresses_is_never_removed(h, tick_s, delays, lags, duration, timeout):
    w = LivenessWatcher(timeout)
    max_delay = timeout - h - tick_s - 0.01  # what reaches the stream within the timeout
    arrivals: list[tuple[float, int, object]] = [(0.0, 0, NodeRegistered(ts=0.0, src="n1", node="n1", role="decode"))]
    t, k = 0.0, 0
    while t < duration:
        t += h
        delay = max(0.0, delays[k % len(delays)] * max_delay)
        arrivals.append((t + delay, 1, _hb(t, "n1", seq=k + 1, lag=lags[k % len(lags)])))
        k += 1
    tw = tick_s
    while tw <= t:
        arrivals.append((tw, 2, Tick(ts=tw, src="planner")))
        tw += tick_s
    arrivals.sort(key=lambda a: (a[0], a[1]))
    out = [e for _, _, ev in arrivals for e in w.apply(ev)]
    assert not any(isinstance(e, NodeRemoved) for e in out), out[:1]


_EVENT = st.one_of(
    st.tuples(st.just("hb"), st.floats(0.0, 40.0), st.booleans(), st.floats(0.0, 30.0)),  # dt, progress?, lag
    st.tuples(st.just("it"), st.floats(0.0, 40.0), st.just(True), st.just(0.0)),
    st.tuples(st.just("tick"), st.floats(0.0, 40.0), st.just(True), st.just(0.0)),
)


def _events(script) -> list:
    """A history of node n1 (and n2, registered with it): heartbeats with or without progress and
    with loop lags, iterations and ticks, at increasing times."""
    out: list = [NodeRegistered(ts=0.0, src=n, node=n, role="decode") for n in ("n1", "n2")]
    t, seq = 0.0, 0
    for kind, dt, progress, lag in script:
        t += dt
        if kind == "hb":
            seq += progress
            out.append(_hb(t, "n1", seq, lag))
            out.append(_hb(t, "n2", seq + 1, 0.0))
        elif kind == "it":
            out.append(IterationDone(ts=t, src="n1", node="n1", phase="decode", duration_s=0.1))
        else:
            out.append(Tick(ts=t, src="planner"))
    return out


@settings(max_examples=examples(200), deadline=None)
@given(script=st.lists(_EVENT, max_size=60), timeout=st.floats(2.0, 20.0), tick_s=st.floats(0.1, 2.0))
def test_a_dead_node_is_removed_within_max_grace_whatever_its_history(script, timeout, tick_s):
    w = LivenessWatcher(timeout)
    evs = _events(script)
    removed_at = None
    for ev in evs:
        for e in w.apply(ev):
            if isinstance(e, NodeRemoved) and e.node == "n1" and removed_at is None:
                removed_at = e.ts
    last = max(ev.ts for ev in evs)  # n1 says nothing from here on
    t = last
    while removed_at is None and t <= last + w.max_grace_s + 2 * tick_s:
        t += tick_s
        removed_at = next((e.ts for e in w.apply(Tick(ts=t)) if isinstance(e, NodeRemoved) and e.node == "n1"), None)
    assert removed_at is not None and removed_at <= last + w.max_grace_s + tick_s + 1e-9, (removed_at, last)
    assert w.max_grace_s == 3 * timeout


@settings(max_examples=examples(150), deadline=None)
@given(script=st.lists(_EVENT, max_size=60), cut=st.integers(0, 130), timeout=st.floats(2.0, 20.0),
       window=st.integers(1, 8))
def test_deterministic_and_a_snapshot_anywhere_decides_the_rest_the_same(script, cut, timeout, window):
    evs = _events(script)
    cut = min(cut, len(evs))
    a, b = LivenessWatcher(timeout, window=window), LivenessWatcher(timeout, window=window)
    out_a = [e for ev in evs for e in a.apply(ev)]
    out_b = [e for ev in evs[:cut] for e in b.apply(ev)]
    b = LivenessWatcher.from_snapshot(b.snapshot())
    out_b += [e for ev in evs[cut:] for e in b.apply(ev)]
    assert out_a == out_b
    assert a.snapshot() == b.snapshot()
    again = LivenessWatcher(timeout, window=window)
    assert [e for ev in evs for e in again.apply(ev)] == out_a
