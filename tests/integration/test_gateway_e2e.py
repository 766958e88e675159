"""HTTP -> gateway -> (stub router) -> engine worker -> tokens -> HTTP, over a real nats-server.

The router here is a stub that places every request on one node: the point is the path
through the real gateway and the real worker (sim node model), not the routing policy."""

from __future__ import annotations

import asyncio
import contextlib
import json

from aiohttp.test_utils import TestClient, TestServer

from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import BranchEnded, RequestFinished, RequestSubmitted, RouteDecided
from services.adapters.bus import NatsBus
from services.adapters.bus.tokens import NatsTokens, sim_text
from services.drivers.gateway.app import Gateway, GatewayConfig


async def stub_router(bus, node: str) -> None:
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            if isinstance(d.event, RequestSubmitted):
                await bus.publish(RouteDecided(ts=d.event.ts, request=d.event.request, prefill_node=node,
                                               decode_node=node, policy="stub"))


async def test_http_to_sim_engine_and_back(nats_url, partition):
    buses = [await NatsBus.connect(nats_url, partition=partition) for _ in range(3)]
    gw_bus, w_bus, r_bus = buses
    worker = EngineWorker(w_bus, NatsTokens(w_bus.nc, partition), "n1", "collocated",
                          load_profile("gb300-glm52"), time_scale=5.0)
    await worker.start()
    router = asyncio.create_task(stub_router(r_bus, "n1"))
    gw = Gateway(gw_bus, NatsTokens(gw_bus.nc, partition), GatewayConfig(partition=partition))
    try:
        async with TestClient(TestServer(gw.make_app())) as client:
            body = {"messages": [{"role": "user", "content": "y" * 300}], "max_tokens": 12, "stream": True,
                    "ignore_eos": True}  # the whole budget: a sim turn may end early (random request ids)
            r = await client.post("/v1/chat/completions", json=body, headers={"x-branch-id": "e2e"})
            assert r.status == 200
            data = [ln[6:] for ln in (await r.text()).splitlines() if ln.startswith("data: ")]
            assert data[-1] == "[DONE]"
            text = "".join(json.loads(x)["choices"][0]["delta"].get("content", "") for x in data[:-1])
            assert text == sim_text(12)
            r = await client.post("/v1/completions", json={"prompt": "z" * 100, "max_tokens": 5, "ignore_eos": True},
                                  headers={"x-branch-id": "e2e", "x-branch-end": "true",
                                           "x-context-compacted": "true"})
            assert r.status == 200
            out = await r.json()
            assert out["choices"][0]["text"] == sim_text(5) and out["usage"]["completion_tokens"] == 5
            assert out["evolving"]["version"] == 1 and out["evolving"]["prefill_node"] == "n1"
        head = await r_bus.last_seq()
        evs = []
        async with r_bus.consumer(None, start_seq=1) as c:
            async for d in c:
                evs.append(d.event)
                if d.seq >= head:
                    break
        fins = [e for e in evs if isinstance(e, RequestFinished)]
        assert [e.output_tokens for e in fins] == [12, 5]
        assert sum(isinstance(e, BranchEnded) for e in evs) == 1
    finally:
        router.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await router
        await worker.stop()
        for b in buses:
            await b.close()
