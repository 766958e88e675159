"""The gateway on several partitions: each session (and its forks) on its root's partition."""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp.test_utils import TestClient, TestServer

from events.catalog import BranchEnded, BranchOpened, RequestSubmitted, RouteDecided
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens, TokenMsg, sim_text
from services.cores.partitions import session_index
from services.drivers.gateway.app import Gateway, GatewayConfig

NAMES = ("p0", "p1", "p2")


async def _router(bus, tokens):
    """Answer every RequestSubmitted of this partition: a route on this partition, then tokens."""
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            ev = d.event
            if isinstance(ev, RequestSubmitted):
                await bus.publish(RouteDecided(ts=ev.ts, request=ev.request, prefill_node=f"{bus.partition}-n0",
                                               decode_node=f"{bus.partition}-n0", policy="fake"))
                await tokens.publish(TokenMsg(request=ev.request, kind="done", tokens=2, total=2,
                                              text=sim_text(2), finish_reason="length", simulated=True))


async def _events(bus) -> list:
    out, head = [], await bus.last_seq()
    if head == 0:
        return out
    async with bus.consumer(None, start_seq=1) as c:
        async for d in c:
            out.append(d.event)
            if d.seq >= head:
                break
    return out


async def test_sessions_and_their_forks_land_on_their_roots_partition():
    lanes = {p: (InMemoryBus(p), MemoryTokens(p)) for p in NAMES}
    gw = Gateway(lanes["p0"][0], lanes["p0"][1], GatewayConfig(partition="p0"), clock=lambda: 1.0, lanes=lanes)
    tasks = [asyncio.create_task(_router(b, t)) for b, t in lanes.values()]
    roots = [f"root-{i}" for i in range(12)]
    try:
        async with TestClient(TestServer(gw.make_app())) as client:
            for root in roots:
                for branch, parent in ((root, None), (f"{root}.fork", root), (f"{root}.fork.sub", f"{root}.fork")):
                    h = {"x-branch-id": branch}
                    if parent:
                        h["x-parent-branch-id"] = parent
                        h["x-branch-mode"] = "fork"
                    r = await client.post("/v1/completions", json={"prompt": f"hello {branch}", "max_tokens": 2},
                                          headers=h)
                    body = await r.json()
                    assert r.status == 200, body
                    want = NAMES[session_index(root, len(NAMES))]
                    assert body["evolving"]["prefill_node"] == f"{want}-n0"  # its partition's router served it
                for branch in (f"{root}.fork.sub", f"{root}.fork", root):
                    r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0},
                                          headers={"x-branch-id": branch, "x-branch-end": "true"})
                    assert r.status == 200
            health = await (await client.get("/health")).json()
            assert health["partitions"] == list(NAMES)
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
    seen = {}
    for p, (bus, _) in lanes.items():
        for ev in await _events(bus):
            if isinstance(ev, (BranchOpened, RequestSubmitted, BranchEnded)):
                seen.setdefault(ev.branch.split(".")[0], set()).add(p)
    assert set(seen) == set(roots)
    for root, parts in seen.items():
        assert parts == {NAMES[session_index(root, len(NAMES))]}, root  # nothing of a session elsewhere
    assert len({p for parts in seen.values() for p in parts}) > 1  # the sessions did spread
