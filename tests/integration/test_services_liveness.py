"""The planner service publishes ``Tick`` and removes a node that stopped heartbeating; the
removal is decided from the events' ``ts`` only, so a fresh watcher folded over the recorded
stream reproduces it exactly."""

from __future__ import annotations

import asyncio
import time

import pytest

from events.catalog import NodeHeartbeat, NodeRegistered, NodeRemoved, Tick
from services.adapters.bus import NatsBus
from services.cores.liveness import LivenessWatcher
from services.drivers.options import ServiceOptions
from services.drivers.serve import run_core_service
from services.drivers.up.testing import read_all, wait_until

pytestmark = pytest.mark.asyncio


def _planner_args(**kw) -> ServiceOptions:
    base = {"planner": "static", "planner_arg": [], "tick_s": 0.1, "heartbeat_timeout_s": 1.0,
            "time_scale": 1.0, "clock_epoch": None, "snapshot_every": 1000, "snapshot_interval_s": 5.0,
            "metrics_port": 0, "metrics_host": "127.0.0.1"}
    return ServiceOptions.of("planner", **{**base, **kw})


async def test_silent_node_is_removed_once_and_replay_agrees(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition)
    svc_bus = await NatsBus.connect(nats_url, partition)
    stop = asyncio.Event()
    task = asyncio.create_task(run_core_service("planner", _planner_args(), svc_bus, stop))

    async def heartbeat() -> None:
        while not stop.is_set():
            await bus.publish(NodeHeartbeat(ts=time.time(), src="t", node="alive", role="prefill"))
            await asyncio.sleep(0.1)

    try:
        now = time.time()
        await bus.publish(NodeRegistered(ts=now, src="t", node="alive", role="prefill"))
        await bus.publish(NodeRegistered(ts=now, src="t", node="silent", role="decode"))
        beats = asyncio.create_task(heartbeat())

        async def removed() -> bool:
            evs = [d.event for d in await read_all(bus, f"ei.{partition}.node.>")]
            return any(isinstance(e, NodeRemoved) for e in evs)

        await wait_until(removed, 20, every_s=0.1, what="the silent node's removal")
        await asyncio.sleep(0.5)  # more ticks: the node must not be removed twice
    finally:
        stop.set()
        await beats
        runner = await asyncio.wait_for(task, 20)
        await svc_bus.close()
    stream = [d.event for d in await read_all(bus)]
    removals = [e for e in stream if isinstance(e, NodeRemoved)]
    assert [(e.node, e.src) for e in removals] == [("silent", "liveness")]
    assert "heartbeat timeout" in removals[0].reason
    assert any(isinstance(e, Tick) for e in stream)
    fresh = LivenessWatcher(1.0)
    replayed = [out for e in stream for out in fresh.apply(e)]
    assert replayed == removals  # same node, same tick ts, same reason: decided from ts alone
    assert runner.metrics.value("ei_service_decisions_total", type="NodeRemoved") == 1
    assert runner.health()["ready"]
    await bus.close()


async def test_metrics_endpoint_serves_prometheus_text_and_health(nats_url, partition):
    import aiohttp

    from services.adapters.metrics import MetricsServer
    from services.drivers.serve import build_runner

    bus = await NatsBus.connect(nats_url, partition)
    args = ServiceOptions.of("router", router="round_robin", router_arg=[], shadow=None, snapshot_every=100,
                             snapshot_interval_s=5.0)
    runner = build_runner("router", args, bus)
    server = await MetricsServer(runner.metrics, runner.health, port=0).start()
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    try:
        await asyncio.wait_for(runner.ready.wait(), 20)
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{server.port}/metrics") as r:
                text = await r.text()
                assert r.status == 200
            async with http.get(f"http://127.0.0.1:{server.port}/healthz") as r:
                health = await r.json()
                assert r.status == 200
        for name in ("ei_service_lag_events", "ei_service_events_folded_total", "ei_service_dead_letters_total",
                     "ei_service_snapshots_total"):
            assert f'{name}{{service="router"}}' in text, name
        assert health["service"] == "router" and health["ready"] is True
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await server.stop()
        await bus.close()
