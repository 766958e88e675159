"""The recorder's adapter: bus -> :class:`Recorder` -> event log, in batches.

The log's applied position is the truth: the consumer starts at ``log.last_seq() + 1`` (so a
lost ack only costs a redelivery, which the log ignores) and a batch is acked only after the
log committed it. DuckDB writes run in a worker thread so the event loop keeps reading.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.logging import get_logger
from services.recorder.core import Recorder
from services.recorder.eventlog import EventLog

log = get_logger("recorder")

_EOF = object()


@dataclass
class RecorderStats:
    recorded: int = 0
    batches: int = 0
    redeliveries: int = 0
    last_seq: int = 0


async def run_recorder(
    bus,
    event_log: EventLog,
    durable: str | None = "recorder",
    *,
    max_batch: int = 4096,
    flush_interval_s: float = 0.2,
    stop: asyncio.Event | None = None,
    subjects: str | None = None,
) -> RecorderStats:
    """Record the stream until ``stop`` is set (then flush what is buffered) or the task is
    cancelled (what was committed stays; the rest is redelivered on restart)."""
    stats = RecorderStats(last_seq=event_log.last_seq())
    recorder = Recorder(max_batch=max_batch, applied_seq=stats.last_seq)
    queue: asyncio.Queue = asyncio.Queue(maxsize=4 * max_batch)
    stop = stop or asyncio.Event()

    async with bus.consumer(durable, start_seq=stats.last_seq + 1, subjects=subjects) as consumer:

        async def pump() -> None:
            async for d in consumer:
                await queue.put(d)

        async def flush() -> None:
            rows = recorder.take()
            if not rows:
                return
            stored = await asyncio.to_thread(event_log.append, rows)
            await consumer.ack(rows[-1][0])
            stats.recorded += stored
            stats.batches += 1
            stats.last_seq = rows[-1][0]

        def take_ready(first) -> bool:
            """Offer ``first`` and whatever else is queued; True when a flush is due."""
            full = recorder.offer(first.seq, first.subject, first.event)
            while not full and not queue.empty():
                d = queue.get_nowait()
                full = recorder.offer(d.seq, d.subject, d.event)
            return full

        loop = asyncio.get_running_loop()
        pump_task = asyncio.create_task(pump(), name="recorder-pump")
        stop_task = asyncio.create_task(stop.wait(), name="recorder-stop")
        oldest = None  # loop time when the oldest buffered row arrived
        try:
            while True:
                timeout = flush_interval_s if oldest is None else max(0.0, oldest + flush_interval_s - loop.time())
                get = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait(
                    {get, stop_task, pump_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                full = False
                if get in done:
                    if oldest is None:
                        oldest = loop.time()
                    full = take_ready(get.result())
                else:
                    get.cancel()  # not completed (no await since wait): the item stays queued
                if pump_task in done:
                    pump_task.result()  # re-raise a consumer failure; else the stream ended
                if stop_task in done or pump_task in done:
                    while not queue.empty():
                        d = queue.get_nowait()
                        recorder.offer(d.seq, d.subject, d.event)
                    await flush()
                    break
                if full or (oldest is not None and loop.time() - oldest >= flush_interval_s):
                    await flush()
                    oldest = loop.time() if recorder.pending else None
        finally:
            pump_task.cancel()
            stop_task.cancel()
            await asyncio.gather(pump_task, stop_task, return_exceptions=True)
    stats.redeliveries = recorder.redeliveries
    log.info("recorder_stopped", recorded=stats.recorded, batches=stats.batches, last_seq=stats.last_seq)
    return stats
