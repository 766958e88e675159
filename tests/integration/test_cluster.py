"""Clustered JetStream as users run it: three real nats-servers, the stream
replicated on all three, services connected with the full server list. One server is killed
in the middle of a run: no event is lost or duplicated, the router keeps deciding, and the
recorded log passes ``evolving verify``."""

from __future__ import annotations

import asyncio
import time

import pytest

from events.catalog import RouteDecided
from services.adapters.bus import NatsBus, StreamSettings
from services.adapters.bus.natsserver import NatsCluster
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.bench import harness as workload
from services.drivers.options import ServiceOptions
from services.drivers.recorder.verify import verify_log
from services.drivers.serve import build_runner, run_recorder_service
from services.drivers.up.testing import acting_route_counts, read_all, wait_until

pytestmark = pytest.mark.asyncio
R3 = StreamSettings(replicas=3)


async def connect_when_ready(url: str, partition: str, timeout_s: float = 30.0) -> NatsBus:
    """The cluster answers before it has elected a JetStream leader: retry stream setup."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await asyncio.wait_for(NatsBus.connect(url, partition, settings=R3), 10)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def read_all_settled(bus: NatsBus, timeout_s: float = 60.0):
    """Every event up to the head, asked again while the cluster re-elects after a loss: the
    ephemeral consumer's create call times out until the stream has a leader, and a read that
    stalls mid-election stops short of the head."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            out = await read_all(bus, idle_s=2.0)
            if out and out[-1].seq >= await bus.last_seq():
                return out
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"the stream was not read to its head within {timeout_s:g} s")
        await asyncio.sleep(0.5)


def _args(kind: str = "router", **kw) -> ServiceOptions:
    base = {"router": "evolving", "router_arg": [], "shadow": None, "snapshot_every": 4,
            "snapshot_interval_s": 5.0, "planner": "evolving", "planner_arg": [], "heartbeat_timeout_s": 0.0}
    return ServiceOptions.of(kind, **{**base, **kw})


@pytest.mark.chaos
async def test_losing_one_server_of_three_loses_nothing(tmp_path):
    partition = "clu"
    with NatsCluster(3) as cluster:
        pub = await connect_when_ready(cluster.url, partition)
        assert (await pub.js.stream_info(pub.stream)).config.num_replicas == 3
        router_bus = await NatsBus.connect(cluster.url, partition, settings=R3)
        rec_bus = await NatsBus.connect(cluster.url, partition, settings=R3)
        router = build_runner("router", _args(), router_bus)
        stop, rec_stop = asyncio.Event(), asyncio.Event()
        router_task = asyncio.create_task(router.run(stop))
        db = tmp_path / "cluster.duckdb"
        rec_args = ServiceOptions.of("recorder", db=str(db), run_config=None, flush_interval_s=0.05,
                                     drain_timeout_s=5.0)
        recorder = asyncio.create_task(run_recorder_service(rec_args, rec_bus, rec_stop))
        first = workload.nodes(2, 2) + [e for b in range(6) for e in workload.branch_events(b, 3)]
        second = [e for b in range(6, 12) for e in workload.branch_events(b, 3)]
        wanted = [f"b{b}/{k}" for b in range(12) for k in range(3)]

        async def routed(requests) -> bool:
            try:  # while the cluster elects new leaders, JetStream API calls time out: ask again
                counts = acting_route_counts(await read_all(pub, f"ei.{partition}.route"))
            except Exception:  # noqa: BLE001
                return False
            return all(counts[r] for r in requests)

        try:
            ids = [f"pub-{i}" for i in range(len(first) + len(second))]
            await pub.publish_many(first, msg_ids=ids[:len(first)])
            await wait_until(lambda: routed(wanted[:18]), 30, what="the first half routed")
            cluster.kill(0)  # SIGKILL one server mid-run
            for i, ev in enumerate(second):  # the publisher reconnects; a retried id is not stored twice
                mid = ids[len(first) + i]
                for attempt in range(20):
                    try:
                        await pub.publish(ev, msg_id=mid)
                        break
                    except Exception:
                        if attempt == 19:
                            raise
                        await asyncio.sleep(0.5)
            await wait_until(lambda: routed(wanted), 60, what="every request routed after the loss")
        finally:
            stop.set()
            await asyncio.wait_for(router_task, 30)
        stream = await read_all_settled(pub)

        async def recorded() -> bool:
            # the recorder acks what it has written: after losing its server it reconnects and
            # catches up, which under a loaded machine takes longer than the drain at its stop
            try:
                info = await pub.js.consumer_info(pub.stream, "recorder")
            except Exception:  # noqa: BLE001 - a leader election: ask again
                return False
            return info.ack_floor.stream_seq >= stream[-1].seq

        await wait_until(recorded, 60, what="the recorder caught up")
        rec_stop.set()
        await asyncio.wait_for(recorder, 30)
        harness = [d.event for d in stream if d.event.src == "harness"]
        assert len(harness) == len(first) + len(second)  # nothing lost, nothing twice
        counts = acting_route_counts(stream)
        assert sorted(counts) == sorted(wanted) and set(counts.values()) == {1}
        assert [d.seq for d in stream] == list(range(1, len(stream) + 1))
        with DuckDbEventLog(db, read_only=True) as log:
            assert log.last_seq() == stream[-1].seq
            report = verify_log(log)
        decided = sum(isinstance(d.event, RouteDecided) for d in stream)
        assert report.ok and report.checked["RouteDecided"] == decided, report.to_dict()
        for b in (pub, router_bus, rec_bus):
            await b.close()
