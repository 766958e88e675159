"""The gateway's ``/health`` reports the bus: 200 with the connected server
while NATS answers, 503 ``bus_unavailable`` while the server is down (a load balancer stops
sending requests that could only time out), 200 again once the client reconnected to the
restarted server. A real nats-server, killed and restarted on the same port and store."""

from __future__ import annotations

import asyncio
import time

from aiohttp.test_utils import TestClient, TestServer

from services.adapters.bus import InMemoryBus, NatsBus
from services.adapters.bus.natsserver import EmbeddedNats
from services.adapters.bus.tokens import MemoryTokens, NatsTokens
from services.drivers.gateway.app import Gateway, GatewayConfig


async def _health(client) -> tuple[int, dict]:
    r = await client.get("/health")
    return r.status, await r.json()


async def _until(client, status: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        got, body = await _health(client)
        if got == status:
            return body
        assert time.monotonic() < deadline, (status, got, body)
        await asyncio.sleep(0.1)


async def test_health_follows_the_bus(tmp_path):
    srv = EmbeddedNats(store_dir=tmp_path / "js").start()
    bus = await NatsBus.connect(srv.url, "hb")
    try:
        gw = Gateway(bus, NatsTokens(bus.nc, "hb"), GatewayConfig(partition="hb"))
        async with TestClient(TestServer(gw.make_app())) as client:
            status, body = await _health(client)
            assert status == 200 and body["status"] == "ok"
            assert body["bus"] == {"kind": "NatsBus", "connected": True, "reconnecting": False,
                                   "server": f"127.0.0.1:{srv.port}"}
            srv.proc.kill()  # the server dies
            srv.proc.wait()
            srv.proc = None
            down = await _until(client, 503, 10)
            assert down["status"] == "bus_unavailable" and down["bus"]["connected"] is False
            srv.start()  # same port, same store
            up = await _until(client, 200, 15)
            assert up["status"] == "ok" and up["bus"]["connected"] is True
    finally:
        await bus.close()
        srv.stop()


async def test_the_in_process_bus_is_always_connected():
    bus = InMemoryBus("hb2")
    gw = Gateway(bus, MemoryTokens("hb2"), GatewayConfig(partition="hb2"))
    async with TestClient(TestServer(gw.make_app())) as client:
        status, body = await _health(client)
        deadline = time.monotonic() + 5.0
        while len(body["consumers"]) < 2:  # the bus lists the gateway's own readers once polled
            assert time.monotonic() < deadline, body
            await asyncio.sleep(0.05)
            _, body = await _health(client)
    assert status == 200 and body["bus"] == {"kind": "InMemoryBus", "connected": True, "reconnecting": False,
                                             "server": None}
    # the route and failure watchers: ephemeral, at the head, not stuck
    assert {c["durable"] for c in body["consumers"].values()} == {False} and body["stuck"] == []
