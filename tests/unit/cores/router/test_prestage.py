"""Prestaging routers (services/cores/router/prestage.py): the stage order after a turn is the
router's own choice for the branch's next request; no order without the mixin, in shadow, for
a failed request or when the prediction is the decode node itself."""

from __future__ import annotations

import pytest

from events.catalog import KvStageOrdered, KvStored, RequestFinished, RouteDecided
from replay.sim.stacks import PRESTAGING
from services.adapters.recipes import ROUTERS, resolve
from services.cores.router.cache_aware import CacheAwareRouter
from services.cores.router.least_ttft import LeastTtftRouter
from services.cores.router.prestage import PrestageCacheAwareRouter, PrestageLeastTtftRouter
from services.drivers.bench import scenario as s

PROMPT = s.blocks(1_000, 100)


def feed(router, events):
    out = []
    for ev in events:
        out.extend(router.apply(ev))
    return out


def turn(busy_p00: int = 0, error: str = "") -> list:
    """Two prefill nodes, one decode node; branch b's turn r1 prefilled on p00, decoded on d00,
    finished with 500 output tokens. ``busy_p00`` other requests queue on p00 meanwhile."""
    evs = s.register(2, 1) + [s.branch("b", 0.0), s.branch("x", 0.0)]
    evs.append(s.submit("r1", "b", PROMPT, 1.0, extra_tokens=20))
    evs.append(s.routed("r1", "p00", "d00", 1.0, policy="other", branch="b"))
    evs += s.store("p00", PROMPT, 1.2)
    for i in range(busy_p00):
        evs.append(s.submit(f"q{i}", "x", s.blocks(50_000 + 1_000 * i, 300), 1.3))
        evs.append(s.routed(f"q{i}", "p00", "d00", 1.3, policy="other", branch="x"))
    evs += s.lifecycle("r1", "p00", "d00", 1.2, output_tokens=500)[:-1]
    evs.append(KvStored(ts=1.4, node="d00", tier="L2", blocks=PROMPT, request="r1"))
    evs.append(RequestFinished(ts=1.4, request="r1", node="d00", output_tokens=500, error=error))
    return evs


def orders(out):
    return [e for e in out if isinstance(e, KvStageOrdered)]


def test_the_order_goes_to_the_routers_choice_for_the_next_turn():
    out = feed(PrestageLeastTtftRouter(), turn())
    (o,) = orders(out)
    assert (o.request, o.branch, o.src_node, o.dst_node, o.tier) == ("r1", "b", "d00", "p00", "L2")
    assert o.policy == "prestage" and o.predicted_ttft_s > 0
    # a long queue on the holder: least TTFT predicts the idle node (it fetches the prompt)
    (o,) = orders(feed(PrestageLeastTtftRouter(), turn(busy_p00=6)))
    assert o.dst_node == "p01"
    # cache-aware keeps the holder below its balance threshold
    (o,) = orders(feed(PrestageCacheAwareRouter(), turn()))
    assert o.dst_node == "p00"


def test_the_prediction_changes_no_state_and_the_routes_are_the_plain_routers():
    for plain_cls, staged_cls in ((LeastTtftRouter, PrestageLeastTtftRouter), (CacheAwareRouter, PrestageCacheAwareRouter)):
        plain, staged = plain_cls(), staged_cls()
        evs = turn(busy_p00=3) + [s.submit("r2", "b", PROMPT + s.blocks(9_000, 12), 9.0)]
        a, b = feed(plain, evs), feed(staged, evs)
        assert [e for e in b if not isinstance(e, KvStageOrdered)] == a
        assert not orders(a) and len(orders(b)) == 1
        assert [e for e in a if isinstance(e, RouteDecided)][-1].request == "r2"
        assert plain.state.to_snapshot() == staged.state.to_snapshot()


def test_no_order_in_shadow_for_a_failed_request_or_onto_the_decode_node():
    assert not orders(feed(PrestageLeastTtftRouter(shadow=True), turn()))
    assert not orders(feed(PrestageLeastTtftRouter(), turn(error="boom")))
    evs = [e for e in s.register(0, 0, collocated=1)] + [s.branch("b", 0.0)]
    evs += [s.submit("r1", "b", PROMPT, 1.0), s.routed("r1", "c00", "c00", 1.0, policy="other", branch="b")]
    evs += s.lifecycle("r1", "c00", "c00", 1.2, output_tokens=50)
    assert not orders(feed(PrestageLeastTtftRouter(), evs))  # collocated: the KV is already there


def test_snapshot_keeps_the_turns_in_flight():
    r = PrestageLeastTtftRouter()
    evs = turn()
    feed(r, evs[:-1])
    again = PrestageLeastTtftRouter.from_snapshot(r.snapshot())
    assert again.turns == r.turns and "r1" in again.turns
    assert orders(again.apply(evs[-1])) == orders(r.apply(evs[-1]))


@pytest.mark.parametrize("path", sorted(PRESTAGING))
def test_every_prestaging_class_resolves_and_extends_its_router(path):
    assert path in ROUTERS.values()
    assert issubclass(resolve(PRESTAGING[path]), resolve(path))
