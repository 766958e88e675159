"""Heartbeats from a thread of their own, on a real nats-server: while the
worker's loop is blocked (a fold or a callback that runs for seconds), its heartbeats still reach
the stream on time, over a connection of their own, and say how late the loop is
(``loop_lag_s``) and that it made no progress meanwhile; the liveness watcher, refolding them,
takes such a node as silent from when its loop last answered. The stall is logged once with the
stack it is stuck in. Stopping the worker stops the thread: no heartbeat after its removal."""

from __future__ import annotations

import asyncio
import time

import pytest
import structlog

from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import NodeHeartbeat, NodeRemoved, Tick
from services.adapters.bus import NatsBus
from services.adapters.bus.tokens import NatsTokens
from services.cores.liveness import LivenessWatcher
from services.drivers.up.testing import read_all

pytestmark = pytest.mark.asyncio


async def test_heartbeats_keep_their_pace_while_the_loop_is_blocked(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition)
    w = EngineWorker(bus, NatsTokens(bus.nc, partition), "n1", "collocated", load_profile("gb300-glm52"),
                     heartbeat_s=0.1)
    w.heartbeat_bus = lambda: NatsBus.connect(nats_url, partition, name="engine-n1-heartbeat", ensure=False)
    with structlog.testing.capture_logs() as logs:
        await w.start()
        try:
            await asyncio.sleep(0.6)
            blocked_from = w.host.clock()
            time.sleep(2.5)  # noqa: ASYNC251 - the point: the worker's loop does nothing else for 2.5 s
            await asyncio.sleep(0.6)
        finally:
            await w.stop()
        await asyncio.sleep(0.5)  # a heartbeat after the removal would be on the stream by now
    evs = [d.event for d in await read_all(bus)]
    beats = [e for e in evs if isinstance(e, NodeHeartbeat)]
    during = [b for b in beats if blocked_from + 0.3 < b.ts < blocked_from + 2.4]
    assert len(during) >= 10, [b.ts - blocked_from for b in beats]  # every 0.1 s: not held by the loop
    assert max(b.loop_lag_s for b in during) >= 1.5
    assert len({(b.applied_seq, b.published) for b in during[1:]}) == 1  # no progress while blocked
    assert max(b.loop_lag_s for b in beats if b.ts > blocked_from + 3.0) < 0.5  # the loop answers again
    removed = max(i for i, e in enumerate(evs) if isinstance(e, NodeRemoved) and e.node == "n1")
    assert not any(isinstance(e, NodeHeartbeat) for e in evs[removed:])
    stalls = [entry for entry in logs if entry["event"] == "loop_stalled"]
    assert len(stalls) == 1 and "test_heartbeats_keep_their_pace" in stalls[0]["where"]
    # the watcher (timeout 1 s): life from the heartbeats stops when the loop stopped answering
    lw = LivenessWatcher(1.0)
    out = []
    for e in evs:
        if isinstance(e, NodeHeartbeat) and e.ts > blocked_from + 2.2 and not out:
            out += lw.apply(Tick(ts=e.ts, src="planner"))
        if not isinstance(e, NodeRemoved):
            out += lw.apply(e)
    assert [x.node for x in out if isinstance(x, NodeRemoved)] == ["n1"]
    await bus.close()
