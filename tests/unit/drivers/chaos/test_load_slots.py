"""The chaos load with ``max_in_flight``: an arrival that finds every slot taken is skipped, a
RequestFinished on the tail frees its slot, and a request left hanging past ``in_flight_for_s``
stops holding one. Without a bound every tick sends (the open loop the sim and torch runs use)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from events.catalog import RequestFinished, RequestSubmitted
from services.adapters.bus.memory import InMemoryBus
from services.drivers.chaos.load import Load


class _Tail:
    def __init__(self) -> None:
        self.deliveries: list = []

    def finish(self, request: str) -> None:
        self.deliveries.append(SimpleNamespace(event=RequestFinished(ts=0.0, src="e", request=request, node="d0")))


def _submitted(load: Load) -> list[str]:
    return [p.event.request for p in load.published if isinstance(p.event, RequestSubmitted)]


def test_a_full_set_of_slots_skips_arrivals_until_one_finishes():
    async def go() -> None:
        load = Load(InMemoryBus(), max_in_flight=2)
        load.tail = _Tail()
        for _ in range(5):
            if load.has_slot():
                await load.next_request()
            else:
                load.skipped += 1
        assert _submitted(load) == ["c0/0", "c0/1"] and load.skipped == 3 and load.in_flight() == 2
        load.tail.finish("c0/0")
        assert load.has_slot() and load.in_flight() == 1
        await load.next_request()
        assert not load.has_slot()
        load.in_flight_for_s = 0.0  # everything still open now counts as hung: it frees its slot
        await asyncio.sleep(0.01)
        assert load.in_flight() == 0 and load.has_slot()

    asyncio.run(go())


def test_without_a_bound_every_arrival_is_sent():
    async def go() -> None:
        load = Load(InMemoryBus())
        load.tail = _Tail()
        for _ in range(20):
            assert load.has_slot()
            await load.next_request()
        assert len(_submitted(load)) == 20 and load.skipped == 0

    asyncio.run(go())


async def _running(max_in_flight: int, *steps) -> Load:
    """A load at 50/s with ``max_in_flight`` slots, run through ``steps`` (seconds to run, or a
    callable applied to the load between them)."""
    load = Load(InMemoryBus(), rate=50.0, heartbeat_s=0.05, max_in_flight=max_in_flight)
    load.tail = _Tail()
    stop = asyncio.Event()
    task = asyncio.create_task(load.run(stop))
    for step in steps:
        if callable(step):
            step(load)
        else:
            await asyncio.sleep(step)
    stop.set()
    await task
    return load


def test_run_skips_ticks_when_full_and_keeps_its_heartbeats():
    load = asyncio.run(_running(3, 1.0))  # ~50 ticks; the bounds leave room for a loaded machine
    assert len(_submitted(load)) == 3 and load.skipped >= 5
    assert sum(type(p.event).__name__ == "NodeHeartbeat" for p in load.published) >= 4


def test_a_grant_sends_one_arrival_through_full_slots():
    seen = []
    load = asyncio.run(_running(1, 0.2, lambda ld: seen.append(len(_submitted(ld))), Load.grant, 0.2))
    assert seen == [1] and len(_submitted(load)) == 2  # the granted one, and no more
