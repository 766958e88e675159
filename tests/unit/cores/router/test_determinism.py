"""Ties break on node id; the same events give byte-equal decisions and snapshots."""

from __future__ import annotations

import msgspec
import pytest

from events.catalog import RouteDecided
from services.cores.router.cache_aware import CacheAwareRouter, StickyRouter
from services.cores.router.dynamo import DynamoKvRouter
from services.cores.router.least_ttft import LeastTtftRouter
from services.cores.router.load_balancing import LeastLoadedRouter, RoundRobinRouter
from services.drivers.bench import scenario as s

ALL = [LeastTtftRouter, CacheAwareRouter, DynamoKvRouter, LeastLoadedRouter, RoundRobinRouter, StickyRouter]


def stream() -> list:
    evs = s.register(4, 3) + [s.branch(f"b{i}", 0.0) for i in range(5)]
    evs += s.store("p02", s.blocks(1, 40), 0.5)
    ts = 1.0
    for i in range(30):
        ts += 0.05
        b = f"b{i % 5}"
        evs.append(s.submit(f"r{i}", b, s.blocks(1, 10 * (i % 5)) + s.blocks(10_000 + 100 * i, 3), ts))
        if i % 4 == 3:
            evs += s.lifecycle(f"r{i - 3}", "p00", "d00", ts)[:2]
    return evs


def run(router) -> list[bytes]:
    return [msgspec.msgpack.encode(o) for ev in stream() for o in router.apply(ev)]


@pytest.mark.parametrize("cls", ALL)
def test_same_events_byte_equal_decisions_and_snapshots(cls):
    a, b = cls(), cls()
    out_a, out_b = run(a), run(b)
    assert out_a and out_a == out_b
    assert a.snapshot() == b.snapshot()


@pytest.mark.parametrize("cls", ALL)
def test_snapshot_restore_continues_identically(cls):
    evs = stream()
    cut = len(evs) // 2
    a = cls()
    for ev in evs[:cut]:
        a.apply(ev)
    b = cls.from_snapshot(a.snapshot())
    assert b.snapshot() == a.snapshot()
    tail_a = [msgspec.msgpack.encode(o) for ev in evs[cut:] for o in a.apply(ev)]
    tail_b = [msgspec.msgpack.encode(o) for ev in evs[cut:] for o in b.apply(ev)]
    assert tail_a == tail_b and tail_a
    assert a.snapshot() == b.snapshot()


@pytest.mark.parametrize("cls", ALL)
def test_ties_break_on_node_id(cls):
    r = cls()
    # registered in reverse order: the decision must not depend on arrival order
    evs = list(reversed(s.register(3, 2))) + [s.branch("b", 0.0), s.submit("x", "b", s.blocks(1, 4), 1.0)]
    out = [o for ev in evs for o in r.apply(ev)]
    rd = next(o for o in out if isinstance(o, RouteDecided))
    assert (rd.prefill_node, rd.decode_node) == ("p00", "d00")
    assert [sc.node for sc in rd.scores] == ["p00", "p01", "p02"]
