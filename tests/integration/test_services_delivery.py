"""Live services against a real nats-server, in the test's event loop: redelivered and duplicated
messages change nothing, a malformed message is dead-lettered while the service keeps going,
and a shadow router's decisions land under its own subjects without changing served traffic."""

from __future__ import annotations

import asyncio
import json

import pytest

from events import codec
from events.catalog import AnomalyReported, BranchOpened, Event, RequestSubmitted, RouteDecided
from services.adapters.bus import NatsBus
from services.adapters.eventlog import DuckDbEventLog
from services.adapters.runner import RunnerConfig, ServiceRunner
from services.drivers.bench import harness as workload
from services.drivers.options import ServiceOptions
from services.drivers.recorder.verify import verify_log
from services.drivers.serve import build_runner, collect_run_config, core_spec, run_recorder_service
from services.drivers.up.testing import acting_route_counts, read_all, wait_until

pytestmark = pytest.mark.asyncio


def _args(kind: str = "router", **kw) -> ServiceOptions:
    base = {"router": "evolving", "router_arg": [], "shadow": None, "snapshot_every": 4,
            "snapshot_interval_s": 5.0, "planner": "evolving", "planner_arg": [], "heartbeat_timeout_s": 0.0}
    return ServiceOptions.of(kind, **{**base, **kw})


class Service:
    """A runner on its own connection (so dead-letter counts are its own), as a task."""

    def __init__(self, runner: ServiceRunner, bus) -> None:
        self.runner, self.bus, self.stop = runner, bus, asyncio.Event()
        self.task = asyncio.create_task(runner.run(self.stop))

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 20)
        await self.bus.close()


async def start(kind: str, nats_url: str, partition: str, **kw) -> Service:
    bus = await NatsBus.connect(nats_url, partition)
    args = _args(kind, **kw)
    runner = build_runner(kind, args, bus)
    _n, entry, key = core_spec(kind, args)
    await bus.put_snapshot(f"config.{key}", json.dumps(entry).encode())
    svc = Service(runner, bus)
    await asyncio.wait_for(runner.ready.wait(), 20)
    return svc


async def routed(bus, requests) -> bool:
    counts = acting_route_counts(await read_all(bus, f"ei.{bus.partition}.route"))
    return all(counts[r] for r in requests)


class _NoAck:
    async def ack(self, seq: int) -> None:
        pass


async def test_redelivered_and_duplicated_messages_change_nothing(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition)
    router = await start("router", nats_url, partition)
    try:
        await bus.publish_many(workload.nodes(2, 2))
        events = [e for b in range(2) for e in workload.branch_events(b, 3)]
        wanted = [e.request for e in events if isinstance(e, RequestSubmitted)]
        for i, ev in enumerate(events):  # each published twice under one message id: stored once
            seq = await bus.publish(ev, msg_id=f"harness:{i}")
            assert await bus.publish(ev, msg_id=f"harness:{i}") == seq
        for ev in events:  # and again without an id, as a retrying client would: new sequences
            await bus.publish(ev)
        await wait_until(lambda: routed(bus, wanted), 20, what="every request routed")
        head_before = await bus.last_seq()

        async def caught_up() -> bool:
            return router.runner.applied_seq >= head_before

        await wait_until(caught_up, 20, what="the router to fold everything")
        state = router.runner.core.snapshot()
        old = await read_all(bus)
        await router.runner._process(old, _NoAck())  # a redelivery of the whole stream
        assert router.runner.core.snapshot() == state
        assert await bus.last_seq() == head_before  # nothing published
        assert router.runner.metrics.value("ei_service_redeliveries_total") >= len(old)
    finally:
        await router.close()
    counts = acting_route_counts(await read_all(bus))
    assert sorted(counts) == sorted(wanted) and set(counts.values()) == {1}
    await bus.close()


async def test_malformed_message_is_dead_lettered_and_services_keep_running(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition)
    router = await start("router", nats_url, partition)
    directory = await start("directory", nats_url, partition)
    try:
        await bus.publish_many(workload.nodes(1, 1))
        await bus.publish_raw(f"ei.{partition}.agent.b0", b"\xc1 not msgpack at all")
        await bus.publish_many(workload.branch_events(0, 2))
        await wait_until(lambda: routed(bus, ["b0/0", "b0/1"]), 20, what="requests after the bad message")

        async def dead_lettered() -> bool:
            names = {dl.consumer for dl in await bus.dead_letters()}
            return {"router", "directory"} <= names

        await wait_until(dead_lettered, 20, what="dead letters of both services")
        for svc in (router, directory):
            assert svc.runner.metrics.value("ei_service_dead_letters_total") == 1
            assert not svc.task.done()
        letters = [dl for dl in await bus.dead_letters() if dl.consumer == "router"]
        assert letters[0].subject == f"ei.{partition}.agent.b0" and letters[0].data.startswith(b"\xc1")
    finally:
        await router.close()
        await directory.close()
    await bus.close()


class BoomCore:
    """A core that raises on one request (a bug), and emits an anomaly for every other one."""

    name = "boom"

    def __init__(self) -> None:
        self.seen: list[str] = []

    def apply(self, event: Event) -> list[Event]:
        if isinstance(event, RequestSubmitted):
            if event.request == "b0/1":
                raise RuntimeError("invariant broken")
            self.seen.append(event.request)
            return [AnomalyReported(ts=event.ts, component="boom", kind="seen", ref=event.request)]
        return []

    def snapshot(self) -> bytes:
        return codec.encode(BranchOpened(ts=0, branch=",".join(self.seen)))

    @classmethod
    def from_snapshot(cls, data: bytes) -> BoomCore:
        core = cls()
        core.seen = [s for s in codec.decode(data).branch.split(",") if s]
        return core


async def test_a_core_that_raises_dead_letters_the_message_and_goes_on(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition)
    runner = ServiceRunner(bus, RunnerConfig(name="boom", config={}), BoomCore, BoomCore.from_snapshot)
    svc = Service(runner, bus)
    pub = await NatsBus.connect(nats_url, partition)
    try:
        await pub.publish_many(workload.branch_events(0, 3))

        async def done() -> bool:  # the core exists once the runner has loaded (a task: it may not yet)
            return runner.core is not None and len(runner.core.seen) == 2

        await wait_until(done, 20, what="the requests after the failing one")
        assert runner.core.seen == ["b0/0", "b0/2"]
        letters = await pub.dead_letters()
        assert [(d.consumer, "RuntimeError" in d.reason) for d in letters] == [("boom", True)]
        # the fold of b0/2 is visible before its anomaly is published: wait for both
        anomalies: list = []

        async def both_published() -> bool:
            anomalies[:] = [d.event for d in await read_all(pub, f"ei.{partition}.anomaly.>", idle_s=0.2)]
            return len(anomalies) >= 2

        await wait_until(both_published, 20, what="both anomalies")
        assert [(a.ref, a.src) for a in anomalies] == [("b0/0", "boom"), ("b0/2", "boom")]
    finally:
        await svc.close()
        await pub.close()


async def _serve_traffic(nats_url, partition, shadow: bool, db=None) -> tuple[list[RouteDecided], list, object]:
    bus = await NatsBus.connect(nats_url, partition)
    events = workload.nodes(2, 2) + [e for b in range(4) for e in workload.branch_events(b, 3)]
    await bus.publish_many(events)
    wanted = [e.request for e in events if isinstance(e, RequestSubmitted)]
    rec_stop = asyncio.Event()
    recorder = None
    if db is not None:
        rec_args = ServiceOptions.of("recorder", db=str(db), run_config=None, flush_interval_s=0.05,
                                     drain_timeout_s=5.0)
        recorder = asyncio.create_task(run_recorder_service(rec_args, bus, rec_stop))
    services = [await start("router", nats_url, partition)]
    if shadow:
        services.append(await start("router", nats_url, partition, router="cache_aware", shadow="cache_aware"))
    try:
        await wait_until(lambda: routed(bus, wanted), 20, what="every request routed")

        async def shadowed() -> bool:
            return not shadow or len(await read_all(bus, f"ei.{partition}.shadow.cache_aware.>")) >= len(wanted)

        await wait_until(shadowed, 20, what="every shadow decision")
    finally:
        for s in services:
            await s.close()
    stream = await read_all(bus)
    if recorder is not None:
        rec_stop.set()
        await recorder
    acting = [d.event for d in stream if isinstance(d.event, RouteDecided) and not d.event.shadow]
    shadows = [d for d in stream if d.subject.startswith(f"ei.{partition}.shadow.")]
    await bus.close()
    return acting, shadows, stream


async def test_shadow_router_decides_under_its_name_and_served_traffic_is_unchanged(nats_url, partition, tmp_path):
    alone, none, _ = await _serve_traffic(nats_url, partition + "a", shadow=False)
    db = tmp_path / "shadow.duckdb"
    acting, shadows, stream = await _serve_traffic(nats_url, partition + "b", shadow=True, db=db)
    assert not none
    key = [(r.request, r.prefill_node, r.decode_node, r.t_c, r.t_uc, r.policy) for r in acting]
    assert key == [(r.request, r.prefill_node, r.decode_node, r.t_c, r.t_uc, r.policy) for r in alone]
    assert {d.subject for d in shadows} == {f"ei.{partition}b.shadow.cache_aware.routedecided"}
    assert all(d.event.shadow and d.event.policy == "cache_aware" for d in shadows)
    assert sorted(d.event.request for d in shadows) == sorted(r.request for r in acting)
    with DuckDbEventLog(db, read_only=True) as log:
        n = log.con.execute("SELECT count(*) FROM events WHERE subject LIKE ?",
                            [f"ei.{partition}b.shadow.cache_aware.%"]).fetchall()[0][0]
        assert n == len(shadows)
        assert log.last_seq() == stream[-1].seq
        report = verify_log(log)
    assert report.ok and report.checked["RouteDecided"] == len(acting), report.to_dict()


async def test_recorder_collects_the_run_config_the_services_wrote(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition)
    router = await start("router", nats_url, partition, router_arg=["fetch_latency_s=0.003"])
    planner = await start("planner", nats_url, partition, planner="static", planner_arg=["name=static"])
    try:
        cfg = await collect_run_config(bus)
    finally:
        await router.close()
        await planner.close()
    assert cfg["router"] == {"plugin": "evolving", "kwargs": {"fetch_latency_s": 0.003}}
    assert cfg["planner"] == {"plugin": "static", "kwargs": {"name": "static"}}
    assert cfg["cores"] == ["planner", "router"]
    await bus.close()


async def test_unreadable_snapshot_rebuilds_from_zero_without_republishing(nats_url, partition):
    bus = await NatsBus.connect(nats_url, partition)
    await bus.publish_many(workload.nodes(2, 2) + [e for b in range(3) for e in workload.branch_events(b, 3)])
    wanted = [f"b{b}/{k}" for b in range(3) for k in range(3)]
    router = await start("router", nats_url, partition)
    await wait_until(lambda: routed(bus, wanted), 20, what="every request routed")
    await router.close()
    await bus.put_snapshot("router", b"\x00 not a snapshot")
    await bus.publish_many(workload.branch_events(9, 2))  # new work after the restart point
    router = await start("router", nats_url, partition)
    try:
        await wait_until(lambda: routed(bus, wanted + ["b9/0", "b9/1"]), 20, what="the new requests routed")
        assert router.runner.restored_from == 0  # rebuilt from sequence 0
        assert router.runner.metrics.value("ei_service_republish_skipped_total") == len(wanted)
    finally:
        await router.close()
    counts = acting_route_counts(await read_all(bus))
    assert sorted(counts) == sorted(wanted + ["b9/0", "b9/1"]) and set(counts.values()) == {1}
    await bus.close()
