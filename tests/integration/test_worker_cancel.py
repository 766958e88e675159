"""A ``RequestCancelled`` on the stream stops the request on the sim engine workers that hold it:
a running decode within an iteration, a request routed after its cancel at
once; exactly one ``RequestFinished(error="cancelled")``, nothing of the request after it."""

from __future__ import annotations

import asyncio

from engine.worker.loop import EngineWorker
from events.catalog import (
    FirstToken,
    IterationDone,
    RequestCancelled,
    RequestFinished,
    RequestStarted,
    RouteDecided,
)
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from tests.integration.test_worker import PROFILE, all_events, submit, wait_for_event


def _of(evs, kind, rid):
    return [e for e in evs if isinstance(e, kind) and getattr(e, "request", None) == rid]


async def test_a_running_decode_stops_and_nothing_of_it_follows(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    w = EngineWorker(bus, tokens, "n1", "collocated", PROFILE, time_scale=1.0, heartbeat_s=0.2)
    await w.start()
    try:
        await bus.publish(submit("r1", max_tokens=100_000))
        await bus.publish(RouteDecided(ts=0.0, request="r1", prefill_node="n1", decode_node="n1", policy="t"))
        # a sim decode run is one IterationDone at its end (of all 100,000 iterations): wait for the start
        await wait_for_event(bus, lambda e: isinstance(e, RequestStarted) and e.phase == "decode")
        await asyncio.sleep(0.3)
        await bus.publish(RequestCancelled(ts=w.host.catch_up(), src="gw", request="r1", branch="b"))
        fin = await wait_for_event(bus, lambda e: isinstance(e, RequestFinished), timeout=1.0)
        assert (fin.request, fin.node, fin.error) == ("r1", "n1", "cancelled")
        assert 1 <= fin.output_tokens < 100_000
        await asyncio.sleep(0.5)  # nothing of r1 after its end, and the node is idle
        evs = await all_events(bus)
        end = evs.index(fin)
        assert not [e for e in evs[end + 1:] if isinstance(e, (IterationDone, RequestStarted, FirstToken))]
        assert len(_of(evs, RequestFinished, "r1")) == 1
        assert w.backend.load().running == 0 and "r1" not in w.view.requests and not w._cancelled
    finally:
        await w.stop()


async def test_split_nodes_one_report_and_a_route_after_the_cancel_never_runs(partition):
    bus = InMemoryBus(partition)
    wp = EngineWorker(bus, MemoryTokens(partition), "p1", "prefill", PROFILE, time_scale=1.0, heartbeat_s=0.2)
    wd = EngineWorker(bus, MemoryTokens(partition), "d1", "decode", PROFILE, time_scale=1.0, heartbeat_s=0.2)
    await wp.start()
    await wd.start()
    try:
        # decoding on d1: d1 stops it, p1 (which prefilled it) says nothing
        await bus.publish(submit("r1", max_tokens=100_000, prompt_tokens=640))
        await bus.publish(RouteDecided(ts=0.0, request="r1", prefill_node="p1", decode_node="d1", policy="t"))
        await wait_for_event(bus, lambda e: isinstance(e, RequestStarted) and e.node == "d1" and e.phase == "decode")
        await asyncio.sleep(0.3)
        await bus.publish(RequestCancelled(ts=wp.host.catch_up(), src="gw", request="r1", branch="b"))
        fin = await wait_for_event(bus, lambda e: isinstance(e, RequestFinished), timeout=1.0)
        assert (fin.request, fin.node, fin.error) == ("r1", "d1", "cancelled")
        # cancelled before the router placed it: the prefill node finishes it at once
        await bus.publish(submit("r2", max_tokens=50, prompt_tokens=640))
        await bus.publish(RequestCancelled(ts=wp.host.catch_up(), src="gw", request="r2", branch="b",
                                           reason="route_timeout"))
        await bus.publish(RouteDecided(ts=0.0, request="r2", prefill_node="p1", decode_node="d1", policy="t"))
        fin2 = await wait_for_event(bus, lambda e: isinstance(e, RequestFinished) and e.request == "r2", timeout=1.0)
        assert (fin2.node, fin2.error, fin2.output_tokens) == ("p1", "cancelled", 0)
        await asyncio.sleep(0.3)
        evs = await all_events(bus)
        assert len(_of(evs, RequestFinished, "r1")) == 1 and len(_of(evs, RequestFinished, "r2")) == 1
        assert not _of(evs, RequestStarted, "r2") and not _of(evs, FirstToken, "r2")
        assert not wp._cancelled and not wd._cancelled and not wd._decode_for
    finally:
        await wp.stop()
        await wd.stop()
