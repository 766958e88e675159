"""A re-route that reaches the stream after the prefill it moves has started elsewhere (seen in
`evolving chaos --engines`: a worker's events arrive seconds late on a loaded machine; the
planner switched p0 to decode, the router re-routed six requests it still saw queued on p0,
which had begun them; p1 prefilled them a second time 30 s later and their decode node took
the KV from p1, which had none). Now the new prefill node leaves such a re-route alone while
the first node lives, the decode node takes the KV from the node whose ``FirstToken`` it saw,
and a second ``FirstToken`` (a prefill run twice) admits no second decode."""

from __future__ import annotations

import asyncio

from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import (
    FirstToken,
    KvMoved,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
)
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens

PROFILE = load_profile("gb300-glm52")


def _submit(rid: str, base: int) -> RequestSubmitted:
    return RequestSubmitted(ts=0.0, src="test", request=rid, branch=f"b-{rid}", blocks=[base + i for i in range(4)],
                            prompt_tokens=266, max_tokens=4)


async def _events(bus) -> list:
    out, head = [], await bus.last_seq()
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            out.append(d.event)
            if d.seq >= head:
                return out


async def _until(bus, pred, timeout: float = 10.0) -> None:
    async def run():
        while not any(pred(e) for e in await _events(bus)):
            await asyncio.sleep(0.05)
    await asyncio.wait_for(run(), timeout)


async def test_a_late_reroute_of_a_started_prefill_runs_once_and_decodes_from_its_real_node(partition):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    p1 = EngineWorker(bus, tokens, "p1", "prefill", PROFILE, time_scale=20.0)
    d1 = EngineWorker(bus, tokens, "d1", "decode", PROFILE, time_scale=20.0)
    await bus.publish(NodeRegistered(ts=0.0, src="p0", node="p0", role="prefill", l1_capacity_tokens=1 << 22,
                                     l2_capacity_tokens=1 << 24))
    for w in (p1, d1):
        await w.start()
    try:
        await bus.publish(_submit("r", 7000))
        await bus.publish(RouteDecided(ts=0.0, src="router", request="r", prefill_node="p0", decode_node="d1"))
        await bus.publish(RequestStarted(ts=0.0, src="p0", request="r", node="p0", phase="prefill"))
        # decided by the router before it saw that start: moves the prefill to p1
        await bus.publish(RouteDecided(ts=0.0, src="router", request="r", prefill_node="p1", decode_node="d1",
                                       reroute=True))
        await bus.publish(FirstToken(ts=0.0, src="p0", request="r", node="p0"))
        await _until(bus, lambda e: isinstance(e, RequestFinished) and e.request == "r")
        await bus.publish(FirstToken(ts=0.0, src="p1", request="r", node="p1"))  # as if p1 had run it too
        await asyncio.sleep(0.3)
        evs = await _events(bus)
        assert not any(isinstance(e, RequestStarted) and e.node == "p1" for e in evs)  # p1 did not run it again
        moved = [e for e in evs if isinstance(e, KvMoved) and e.request == "r"]
        assert [m.src_node for m in moved] == ["p0"]  # the KV comes from the node that prefilled it
        decodes = [e for e in evs if isinstance(e, RequestStarted) and e.request == "r" and e.phase == "decode"]
        assert len(decodes) == 1

        # once the first node is gone, a re-route of what it was running is followed
        await bus.publish(_submit("s", 8000))
        await bus.publish(RouteDecided(ts=0.0, src="router", request="s", prefill_node="p0", decode_node="d1"))
        await bus.publish(RequestStarted(ts=0.0, src="p0", request="s", node="p0", phase="prefill"))
        await bus.publish(NodeRemoved(ts=0.0, src="p0", node="p0", reason="restarted"))
        await bus.publish(RouteDecided(ts=0.0, src="router", request="s", prefill_node="p1", decode_node="d1",
                                       reroute=True))
        await _until(bus, lambda e: isinstance(e, RequestFinished) and e.request == "s")
        evs = await _events(bus)
        assert any(isinstance(e, RequestStarted) and e.request == "s" and e.node == "p1" for e in evs)
        assert [e.src_node for e in evs if isinstance(e, KvMoved) and e.request == "s"] == ["p1"]
    finally:
        for w in (p1, d1):
            await w.stop()


async def test_a_decode_only_reroute_after_the_first_token_is_admitted_by_its_new_decode_node(partition):
    """`evolving chaos --engines --quick` (sim workers, load average about 20): the decode node
    named for ``c97/1`` was removed before it took the request, and the router's decode-only
    re-route reached the new decode node after the prefill's ``FirstToken``. The new node waited
    for a first token that had already gone by (a second one admits nothing), so the request
    stayed open until the stack stopped. It is now admitted at the re-route, with the KV of the
    node that sent the first token."""
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    d1 = EngineWorker(bus, tokens, "d1", "decode", PROFILE, time_scale=20.0)
    for node, role in (("p0", "prefill"), ("d0", "decode")):
        await bus.publish(NodeRegistered(ts=0.0, src=node, node=node, role=role, l1_capacity_tokens=1 << 22,
                                         l2_capacity_tokens=1 << 24))
    await d1.start()
    try:
        await bus.publish(_submit("r", 9000))
        await bus.publish(RouteDecided(ts=0.0, src="router", request="r", prefill_node="p0", decode_node="d0"))
        await bus.publish(RequestStarted(ts=0.0, src="p0", request="r", node="p0", phase="prefill"))
        await bus.publish(FirstToken(ts=0.0, src="p0", request="r", node="p0"))
        await bus.publish(NodeRemoved(ts=0.0, src="liveness", node="d0", reason="heartbeat timeout"))
        await bus.publish(RouteDecided(ts=0.0, src="router", request="r", prefill_node="p0", decode_node="d1",
                                       reroute=True))
        await _until(bus, lambda e: isinstance(e, RequestFinished) and e.request == "r" and e.node == "d1")
        await bus.publish(FirstToken(ts=0.0, src="p0", request="r", node="p0"))  # the prefill run again: nothing
        await bus.publish(RouteDecided(ts=0.0, src="router", request="r", prefill_node="p0", decode_node="d1",
                                       reroute=True))  # nor a second re-route to the same node
        await asyncio.sleep(0.3)
        evs = await _events(bus)
        decodes = [e for e in evs if isinstance(e, RequestStarted) and e.request == "r" and e.phase == "decode"]
        assert [e.node for e in decodes] == ["d1"]
        assert [e.src_node for e in evs if isinstance(e, KvMoved) and e.request == "r"] == ["p0"]
    finally:
        await d1.stop()
