"""run_recorder against a real nats-server: a realistic mix lands in DuckDB exactly once,
across a restart, with every decision readable through the views."""

from __future__ import annotations

import asyncio

from events import codec
from services.adapters.bus import NatsBus
from services.adapters.eventlog import DuckDbEventLog
from services.drivers.recorder.bench import workload
from services.drivers.recorder.service import run_recorder


async def _wait_for(cond, timeout=10.0):
    async def loop():
        while not cond():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(loop(), timeout)


async def _record_until(bus, log, seq):
    stop = asyncio.Event()
    task = asyncio.create_task(run_recorder(bus, log, max_batch=128, flush_interval_s=0.05, stop=stop))
    try:
        await _wait_for(lambda: log.last_seq() >= seq)
    finally:
        stop.set()
    return await task


async def test_recorder_over_nats_lands_every_event_once(nats_url, partition, tmp_path):
    events = [e for _, _, e in workload(40, blocks_per_request=50)]
    half = len(events) // 2
    bus = await NatsBus.connect(nats_url, partition)
    log = DuckDbEventLog(tmp_path / "run.duckdb")
    try:
        seqs = await bus.publish_many(events[:half])
        first = await _record_until(bus, log, seqs[-1])
        seqs += await bus.publish_many(events[half:])
        second = await _record_until(bus, log, seqs[-1])  # a restart: resumes from the log
    finally:
        await bus.close()
    assert first.recorded + second.recorded == len(events)
    back = list(log.read())
    assert [s for s, _, _ in back] == seqs
    assert [codec.encode(e) for _, _, e in back] == [codec.encode(e) for e in events]
    assert all(subj.startswith(f"ei.{partition}.") for _, subj, _ in back)
    n_req = log.con.execute("SELECT count(*) FROM requests WHERE ttft_s IS NOT NULL").fetchall()[0][0]
    assert n_req == 40
    log.close()
