"""The batching core, and run_recorder against the in-memory bus."""

from __future__ import annotations

import asyncio

import pytest

from events.catalog import NodeHeartbeat, NodeRemoved, Tick
from services.adapters.bus import InMemoryBus
from services.adapters.eventlog import DuckDbEventLog, InMemoryEventLog
from services.cores.recording import Recorder
from services.drivers.recorder.service import run_recorder


def test_recorder_batches_and_drops_redeliveries():
    r = Recorder(max_batch=3)
    assert [r.offer(s, "x", Tick(ts=s)) for s in (1, 2)] == [False, False]
    assert r.offer(2, "x", Tick(ts=2)) is False and r.redeliveries == 1
    assert r.offer(3, "x", Tick(ts=3)) is True
    assert [s for s, _, _ in r.take()] == [1, 2, 3] and r.pending == 0 and r.applied_seq == 3
    assert r.offer(3, "x", Tick(ts=3)) is False and r.take() == []


async def _wait_for(cond, timeout=5.0):
    async def loop():
        while not cond():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(loop(), timeout)


@pytest.mark.parametrize("backend", ["memory", "duckdb"])
async def test_records_everything_then_resumes_after_a_restart(tmp_path, backend):
    log = InMemoryEventLog() if backend == "memory" else DuckDbEventLog(tmp_path / "run.duckdb")
    bus = InMemoryBus()
    await bus.publish_many([Tick(ts=float(i)) for i in range(1, 251)])
    stop = asyncio.Event()
    task = asyncio.create_task(run_recorder(bus, log, max_batch=64, flush_interval_s=0.02,
                                            background_flush_s=0.02, stop=stop))
    await _wait_for(lambda: log.last_seq() == 250)
    await bus.publish(Tick(ts=251.0))  # a trickle is flushed by the (background) interval, not the batch size
    await _wait_for(lambda: log.last_seq() == 251)
    stop.set()
    stats = await task
    assert stats.recorded == 251 and stats.batches >= 5

    await bus.publish_many([Tick(ts=float(i)) for i in range(252, 261)])
    stop = asyncio.Event()
    task = asyncio.create_task(run_recorder(bus, log, max_batch=64, flush_interval_s=0.02,
                                            background_flush_s=0.02, stop=stop))
    await _wait_for(lambda: log.last_seq() == 260)
    stop.set()
    stats = await task
    assert stats.recorded == 9
    assert [e.ts for _, _, e in log.read()] == [float(i) for i in range(1, 261)]
    assert log.count_by_type() == {"Tick": 260}


async def test_the_log_position_wins_over_a_lost_ack():
    """The durable's ack floor says 0, the log says 5: the recorder resumes at 6, stores nothing twice."""
    log = InMemoryEventLog()
    bus = InMemoryBus()
    seqs = await bus.publish_many([Tick(ts=float(i)) for i in range(1, 11)])
    log.append([(s, "ei.default.clock", Tick(ts=float(s))) for s in seqs[:5]])
    stop = asyncio.Event()
    task = asyncio.create_task(run_recorder(bus, log, flush_interval_s=0.02, background_flush_s=0.02, stop=stop))
    await _wait_for(lambda: log.last_seq() == 10)
    stop.set()
    assert (await task).recorded == 5
    assert [s for s, _, _ in log.read()] == list(range(1, 11))


async def test_stop_flushes_what_is_buffered():
    log = InMemoryEventLog()
    bus = InMemoryBus()
    await bus.publish_many([Tick(ts=float(i)) for i in range(1, 4)])
    stop = asyncio.Event()
    task = asyncio.create_task(run_recorder(bus, log, max_batch=1000, flush_interval_s=60.0, stop=stop))
    await asyncio.sleep(0.05)
    assert log.last_seq() == 0  # neither full nor idle long enough
    stop.set()
    assert (await task).recorded == 3 and log.last_seq() == 3


async def test_heartbeats_and_ticks_alone_wait_for_the_background_interval():
    """An idle stack's heartbeats and ticks are appended once a background interval, not every
    flush interval (one DuckDB transaction each); any other event flushes them at once with it."""
    log = InMemoryEventLog()
    bus = InMemoryBus()
    stop = asyncio.Event()
    task = asyncio.create_task(run_recorder(bus, log, max_batch=64, flush_interval_s=0.05,
                                            background_flush_s=0.8, stop=stop))
    try:
        loop = asyncio.get_running_loop()
        await bus.publish(NodeHeartbeat(ts=1.0, src="n0", node="n0", role="collocated"))
        await bus.publish(Tick(ts=1.0))
        t0 = loop.time()
        await asyncio.sleep(0.4)
        assert log.last_seq() == 0  # 8 flush intervals: still buffered
        await _wait_for(lambda: log.last_seq() == 2)
        assert loop.time() - t0 >= 0.7
        await bus.publish(Tick(ts=2.0))
        await asyncio.sleep(0.2)
        assert log.last_seq() == 2
        t1 = loop.time()
        await bus.publish(NodeRemoved(ts=2.0, src="n0", node="n0", reason="shutdown"))
        await _wait_for(lambda: log.last_seq() == 4)
        assert loop.time() - t1 < 0.5  # the removal's flush interval, the buffered tick with it
    finally:
        stop.set()
        await task
    assert log.count_by_type() == {"NodeHeartbeat": 1, "Tick": 2, "NodeRemoved": 1}
