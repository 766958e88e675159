"""Liveness that heals, with a real worker process on a real nats-server: a
worker stopped (SIGSTOP) past the heartbeat timeout is removed by the planner's liveness
watcher; after SIGCONT it sees its own removal on the stream, registers again, re-publishes
its KV and serves the next request the router sends it; it is not removed again, and it
stops cleanly (its own view of the directory, which folds both removals, does not assert).

Also: heartbeats are published straight to the bus, so a backlog of the node's own events (a
slow bus, a burst of them during a drain) does not delay them."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import (
    KvStored,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    RequestFinished,
    RequestSubmitted,
    RouteDecided,
)
from services.adapters.bus import InMemoryBus, NatsBus
from services.adapters.bus.tokens import MemoryTokens
from services.drivers.options import ServiceOptions
from services.drivers.serve import run_core_service
from services.drivers.up.testing import read_all, wait_until

pytestmark = pytest.mark.asyncio
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 1.5


def _args(kind: str = "router", **kw) -> ServiceOptions:
    base = {"planner": "static", "planner_arg": [], "tick_s": 0.1, "heartbeat_timeout_s": TIMEOUT_S,
            "time_scale": 1.0, "clock_epoch": None, "router": "round_robin", "router_arg": [], "shadow": None,
            "snapshot_every": 1000, "snapshot_interval_s": 5.0, "metrics_port": None, "metrics_host": "127.0.0.1"}
    return ServiceOptions.of(kind, **{**base, **kw})


def _submit(rid: str) -> RequestSubmitted:
    return RequestSubmitted(ts=time.time(), src="test", request=rid, branch=f"b-{rid}",
                            blocks=[hash(rid) % 10**9 * 100 + i for i in range(4)], prompt_tokens=256, max_tokens=4)


async def test_stopped_worker_is_removed_then_registers_again_and_serves(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition)
    svc_buses = [await NatsBus.connect(nats_url, partition) for _ in range(2)]
    stop = asyncio.Event()
    services = [asyncio.create_task(run_core_service(kind, _args(kind), b, stop))
                for kind, b in zip(("planner", "router"), svc_buses, strict=True)]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine.worker", "--node", "w1", "--role", "collocated", "--heartbeat-s", "0.2",
        "--nats-url", nats_url, "--partition", partition, cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)

    async def events(pred) -> list:
        return [d for d in await read_all(bus) if pred(d.event)]

    async def has(pred) -> bool:
        return bool(await events(pred))

    try:
        await wait_until(lambda: has(lambda e: isinstance(e, NodeRegistered) and e.node == "w1"), 30,
                         what="w1's registration")
        await bus.publish(_submit("r1"))
        await wait_until(lambda: has(lambda e: isinstance(e, RequestFinished) and e.request == "r1"), 30,
                         what="r1 served")

        proc.send_signal(signal.SIGSTOP)
        try:
            await wait_until(lambda: has(lambda e: isinstance(e, NodeRemoved) and e.node == "w1"), 20,
                             what="w1 removed for silence")
        finally:
            proc.send_signal(signal.SIGCONT)
        removed = (await events(lambda e: isinstance(e, NodeRemoved)))[0]
        assert removed.event.src == "liveness" and "heartbeat timeout" in removed.event.reason

        reg = lambda e: isinstance(e, NodeRegistered) and e.node == "w1"

        async def registered_again() -> bool:
            return len(await events(reg)) >= 2

        await wait_until(registered_again, 20, what="w1 registered again")
        regs = await events(reg)
        assert len(regs) == 2 and regs[1].seq > removed.seq
        assert regs[1].event.role == "collocated" and regs[1].event.l1_capacity_tokens > 0
        restored = [d for d in await events(lambda e: isinstance(e, KvStored) and e.node == "w1")
                    if d.seq > regs[1].seq and d.event.request is None]
        assert set(_submit("r1").blocks) <= {b for d in restored for b in d.event.blocks}  # r1's KV, re-published

        await bus.publish(_submit("r2"))
        await wait_until(lambda: has(lambda e: isinstance(e, RequestFinished) and e.request == "r2"), 30,
                         what="r2 served after the re-registration")
        route = (await events(lambda e: isinstance(e, RouteDecided) and e.request == "r2"))[0].event
        assert route.prefill_node == "w1"
        await asyncio.sleep(2 * TIMEOUT_S)  # heartbeating again: not removed a second time
        assert len(await events(lambda e: isinstance(e, NodeRemoved) and e.node == "w1")) == 1

        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, err.decode()[-3000:]
        assert b"removed_rejoining" in err
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        stop.set()
        await asyncio.wait_for(asyncio.gather(*services, return_exceptions=True), 20)
        for b in svc_buses:
            await b.close()
        await bus.close()


class SlowBus(InMemoryBus):
    """Every publication takes ``delay_s``: a busy JetStream leader, one round trip each."""

    delay_s = 0.02

    async def publish(self, event, **kw):
        await asyncio.sleep(self.delay_s)
        return await super().publish(event, **kw)


async def test_heartbeats_are_not_queued_behind_the_nodes_events(partition):
    bus = SlowBus(partition)
    w = EngineWorker(bus, MemoryTokens(partition), "n1", "collocated", load_profile("gb300-glm52"),
                     heartbeat_s=0.05)
    await w.start()
    try:
        for i in range(200):  # a burst of 200 x 20 ms = 4 s of publications ahead of any heartbeat
            w._publish_own(KvStored(ts=w.host.catch_up(), src="n1", node="n1", tier="L2", blocks=[10_000 + i]))
        await asyncio.sleep(0.6)
        beats = [d.event for d in await read_all(bus) if isinstance(d.event, NodeHeartbeat)]
        assert len(beats) >= 3, "heartbeats waited behind the event backlog"
        assert w._out.qsize() > 100  # the backlog is still there
    finally:
        await w.stop()
