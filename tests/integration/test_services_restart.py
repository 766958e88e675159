"""Kill a live service mid-run and start it again: it rebuilds from its snapshot plus the tail,
decisions continue, no request is lost or decided twice, and the recorded log still verifies.

The services run as real child processes (``python -m services.<name>``) against the session's
nats-server; the recorder runs in the test's event loop into a DuckDB file in ``tmp_path``.
"""

from __future__ import annotations

import asyncio
import signal

import msgspec
import pytest

from events.catalog import AnomalyReported, KvEvicted, RequestSubmitted
from services.adapters.bus import NatsBus
from services.adapters.eventlog import DuckDbEventLog
from services.adapters.runner import _RunnerSnap
from services.cores.contract import Sequenced
from services.cores.directory.core import DirectoryCore
from services.drivers.bench import harness as workload
from services.drivers.chaos.faults import FAULT_EXIT_CODE
from services.drivers.options import ServiceOptions
from services.drivers.recorder.verify import verify_log
from services.drivers.serve import run_recorder_service
from services.drivers.up.testing import acting_route_counts, read_all, spawn_service, wait_until

pytestmark = pytest.mark.asyncio


def _recorder_args(db) -> ServiceOptions:
    return ServiceOptions.of("recorder", db=str(db), run_config=None, flush_interval_s=0.05, drain_timeout_s=5.0)


async def _wait_exit(proc, timeout_s: float = 30.0) -> int:
    return await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout=timeout_s)


async def _wait_log(path, text: str) -> None:
    async def seen() -> bool:
        return path.exists() and text in path.read_text()

    await wait_until(seen, 30.0, what=f"{text!r} in {path.name}")


async def _stop(proc) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    return await _wait_exit(proc)


def _requests(events) -> list[str]:
    return [e.request for e in events if isinstance(e, RequestSubmitted)]


async def _publish_slowly(bus, events, gap_s: float = 0.02) -> None:
    for ev in events:
        await bus.publish(ev)
        await asyncio.sleep(gap_s)


async def _started(bus, key: str) -> None:
    """Wait until the service wrote its configuration (it then opens its consumer at once)."""
    async def present() -> bool:
        return await bus.get_snapshot(f"config.{key}") is not None

    await wait_until(present, 30.0, what=f"the {key} service to start")


async def _all_routed(bus, requests: list[str]) -> bool:
    counts = acting_route_counts(await read_all(bus, f"ei.{bus.partition}.route"))
    return all(counts[r] >= 1 for r in requests)


async def test_router_crash_between_publish_and_ack_rebuilds_without_double_decisions(nats_url, partition, tmp_path):
    bus = await NatsBus.connect(nats_url, partition)
    db = tmp_path / "run.duckdb"
    rec_stop = asyncio.Event()
    recorder = asyncio.create_task(run_recorder_service(_recorder_args(db), bus, rec_stop))
    await bus.publish_many(workload.nodes(2, 2))
    first = [e for b in range(3) for e in workload.branch_events(b, 4, ts=1.0)]
    second = [e for b in range(3, 5) for e in workload.branch_events(b, 4, ts=2.0)]
    log1, log2 = tmp_path / "router1.log", tmp_path / "router2.log"
    router = spawn_service("router", nats_url, partition, "--snapshot-every", "3",
                           fault="crash_after_publish:7", log_path=log1)
    try:
        await _started(bus, "router")
        # The first branch (4 decisions, under the crash's 7) goes out alone, and the rest only once
        # its snapshot is on the bus: on a loaded machine the router can start late and take all
        # of ``first`` in one batch, crashing before it ever snapshots.
        await _publish_slowly(bus, first[:5])

        async def snapshotted() -> bool:
            return await bus.get_snapshot("router") is not None

        await wait_until(snapshotted, 30.0, what="the router's first snapshot")
        publisher = asyncio.create_task(_publish_slowly(bus, first[5:]))
        assert await _wait_exit(router) == FAULT_EXIT_CODE, log1.read_text()
        await publisher
        await bus.publish_many(second)  # arrives while no router runs
        router = spawn_service("router", nats_url, partition, "--snapshot-every", "3", log_path=log2)
        wanted = _requests(first + second)
        await wait_until(lambda: _all_routed(bus, wanted), 30.0, what="every request routed")
        await _wait_log(log2, "service_caught_up")
        assert await _stop(router) == 0
    finally:
        if router.poll() is None:
            router.kill()
    counts = acting_route_counts(await read_all(bus))
    assert sorted(counts) == sorted(wanted)
    assert set(counts.values()) == {1}, {r: n for r, n in counts.items() if n != 1}
    text = log2.read_text()
    assert "service_start" in text and "from_snapshot=0" not in text, text  # restored from a snapshot
    skipped = int(text.split("skipped=")[1].split()[0])
    assert skipped >= 1, text  # the crashed batch's decisions were found on the stream, not re-sent

    rec_stop.set()
    await recorder
    with DuckDbEventLog(db, read_only=True) as log:
        assert log.last_seq() == await bus.last_seq()
        assert log.run_config()["cores"] == ["router"]
        report = verify_log(log)
    assert report.ok, report.to_dict()
    assert report.checked["RouteDecided"] == len(wanted)
    await bus.close()


async def test_router_killed_mid_traffic_keeps_deciding(nats_url, partition, tmp_path):
    bus = await NatsBus.connect(nats_url, partition)
    await bus.publish_many(workload.nodes(2, 1))
    events = [e for b in range(4) for e in workload.branch_events(b, 5, ts=1.0)]
    wanted = _requests(events)
    router = spawn_service("router", nats_url, partition, "--snapshot-every", "4", log_path=tmp_path / "r1.log")
    try:
        await _started(bus, "router")
        publisher = asyncio.create_task(_publish_slowly(bus, events, 0.03))

        async def some_routed() -> bool:
            return len(acting_route_counts(await read_all(bus, f"ei.{partition}.route"))) >= 5

        await wait_until(some_routed, 30.0, what="a first few decisions")
        router.kill()  # SIGKILL: no final snapshot, no final ack
        await _wait_exit(router)
        await publisher
        router = spawn_service("router", nats_url, partition, "--snapshot-every", "4", log_path=tmp_path / "r2.log")
        await wait_until(lambda: _all_routed(bus, wanted), 30.0, what="every request routed")
        await _wait_log(tmp_path / "r2.log", "service_caught_up")
        assert await _stop(router) == 0
    finally:
        if router.poll() is None:
            router.kill()
    counts = acting_route_counts(await read_all(bus))
    assert sorted(counts) == sorted(wanted) and set(counts.values()) == {1}
    await bus.close()


async def test_directory_crash_and_restart_matches_a_fresh_fold(nats_url, partition, tmp_path):
    """Each request of an unopened branch and each eviction on an unknown node is one anomaly;
    across a crash the directory reports each exactly once, and its final snapshot equals a
    fresh directory folded over the same stream."""
    bus = await NatsBus.connect(nats_url, partition)
    bad = []
    for i in range(12):
        bad.append(RequestSubmitted(ts=1.0 + i, src="t", request=f"r{i}", branch=f"ghost{i}", blocks=[i, i + 1]))
        bad.append(KvEvicted(ts=1.0 + i, src="t", node=f"n{i}", tier="L1", blocks=[i]))
    args = ("--snapshot-every", "5")
    directory = spawn_service("directory", nats_url, partition, *args, fault="crash_after_publish:9",
                              log_path=tmp_path / "d1.log")
    try:
        await _started(bus, "directory")
        publisher = asyncio.create_task(_publish_slowly(bus, bad[:14]))
        assert await _wait_exit(directory) == FAULT_EXIT_CODE
        await publisher
        await bus.publish_many(bad[14:])
        directory = spawn_service("directory", nats_url, partition, *args, log_path=tmp_path / "d2.log")

        async def all_reported() -> bool:
            evs = await read_all(bus, f"ei.{partition}.anomaly.>")
            return len(evs) >= len(bad)

        await wait_until(all_reported, 30.0, what="every anomaly reported")
        await _wait_log(tmp_path / "d2.log", "service_caught_up")
        assert await _stop(directory) == 0  # a clean stop writes the final snapshot
    finally:
        if directory.poll() is None:
            directory.kill()
    stream = await read_all(bus)
    fresh = DirectoryCore()
    expected = []
    for d in stream:
        expected.extend(fresh.apply(d.event))
    reported = [d.event for d in stream if isinstance(d.event, AnomalyReported)]
    assert [(a.kind, a.ref) for a in reported] == [(a.kind, a.ref) for a in expected]
    assert len(reported) == len(bad)

    snap = msgspec.msgpack.decode(await bus.get_snapshot("directory"), type=_RunnerSnap)
    restored = Sequenced.restore(snap.sequenced, DirectoryCore)
    assert restored.applied_seq == stream[-1].seq  # the snapshot covers the whole stream
    assert restored.core.snapshot() == fresh.snapshot()
    await bus.close()
