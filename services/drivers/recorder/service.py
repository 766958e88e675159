"""The recorder's adapter: bus -> :class:`Recorder` -> event log, in batches.

The log's applied position is the truth: the consumer starts at ``log.last_seq() + 1`` (so a
lost ack only costs a redelivery, which the log ignores) and a batch is acked only after the
log committed it. DuckDB writes run in a worker thread so the event loop keeps reading.

On a NATS bus with a DuckDB log, the recorder also answers ``evolving sql --live`` (snapshot
requests, :class:`LiveSnapshots`; the protocol is in :mod:`services.drivers.recorder.live`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from events.catalog import NodeHeartbeat, Tick
from services.adapters.bus import Bus, Message
from services.adapters.eventlog import EventLog
from services.adapters.logging import get_logger
from services.cores.recording import Recorder
from services.drivers.recorder.live import sidecar_path, snapshot_path, snapshot_subject

log = get_logger("recorder")

_EOF = object()

#: events that only say the cluster is alive (a heartbeat a second per node, the planner's tick a
#: second): while nothing else is buffered they wait up to ``background_flush_s`` (5 s), not
#: ``flush_interval_s``. Each flush is one DuckDB transaction (5-7 ms here): flushing every 0.2 s
#: for them was most of an idle stack's recorder CPU, and every 1 s still 7 ms a second
#: (docs/experiments.md, "Against the real Dynamo"). Any other event flushes them with it.
BACKGROUND = (NodeHeartbeat, Tick)


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
    flush_interval_s: float = 1.0,
    background_flush_s: float = 5.0,
    stop: asyncio.Event | None = None,
    subjects: str | None = None,
    live: bool = True,
    trim_interval_s: float | None = 10.0,
    max_queued: int | None = None,
) -> RecorderStats:
    """Record the stream until ``stop`` is set (then flush what is buffered) or the task is
    cancelled (what was committed stays; the rest is redelivered on restart). ``live``: answer
    ``evolving sql --live`` while recording (NATS bus and DuckDB log only). ``trim_interval_s``:
    after an append at most this often, hand the C heap's free pages back (:func:`release_free_heap`).

    A batch is appended when ``max_batch`` rows are buffered, or ``flush_interval_s`` after the
    oldest buffered row arrived (1 s: each append is one DuckDB transaction of several ms, and at
    0.2 s they were most of a serving stack's recorder CPU; the log is at most that far behind
    the stream, as ``evolving sql --live``'s snapshots already are); while every buffered row is a heartbeat or a tick
    (:data:`BACKGROUND`), ``background_flush_s`` after it instead (never less than
    ``flush_interval_s``): any other event flushes them with it.

    ``max_queued`` (default ``max_batch``): decoded deliveries waiting for the writer. While an
    append runs, the next batch is read ahead, no more: a stalled writer then stops the consumer,
    whose pull requests stop, so the backlog stays on the server (JetStream), not in this
    process (it was ``4 x max_batch``: 16,384 decoded events and their raw messages, ~22 MB,
    whenever a loaded machine stalled the writer; docs/chaos.md "Soak", runs 9-10). Appends run
    on one writer thread of their own: DuckDB's, Arrow's and glibc's per-thread caches are then
    one thread's, the one the heap trim runs on (``asyncio.to_thread`` spread them over its
    pool's threads)."""
    if max_queued is not None and max_queued < 1:
        raise ValueError(f"max_queued must be >= 1, got {max_queued}")
    stats = RecorderStats(last_seq=event_log.last_seq())
    recorder = Recorder(max_batch=max_batch, applied_seq=stats.last_seq)
    queue: asyncio.Queue = asyncio.Queue(maxsize=max_queued or max_batch)
    writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="recorder-writer")
    stop = stop or asyncio.Event()
    serve_live = live and getattr(bus, "url", None) is not None and hasattr(event_log, "snapshot")

    async with (bus.consumer(durable, start_seq=stats.last_seq + 1, subjects=subjects) as consumer,
                LiveSnapshots(bus, event_log) if serve_live else contextlib.nullcontext()):

        async def pump() -> None:
            async for d in consumer:
                await queue.put(d)

        last_trim = time.monotonic()

        def append(rows, trim: bool) -> int:
            stored = event_log.append(rows)
            if trim:
                release_free_heap()
            return stored

        async def flush() -> None:
            nonlocal last_trim
            rows = recorder.take()
            if not rows:
                return
            trim = trim_interval_s is not None and time.monotonic() - last_trim >= trim_interval_s
            if trim:
                last_trim = time.monotonic()
            stored = await loop.run_in_executor(writer, append, rows, trim)
            await consumer.ack(rows[-1][0])
            stats.recorded += stored
            stats.batches += 1
            stats.last_seq = rows[-1][0]

        def take_ready(first) -> tuple[bool, bool]:
            """Offer ``first`` and whatever else is queued: (a flush is due, an offered event is
            not :data:`BACKGROUND`)."""
            full = recorder.offer(first.seq, first.subject, first.event)
            urgent = not isinstance(first.event, BACKGROUND)
            while not full and not queue.empty():
                d = queue.get_nowait()
                full = recorder.offer(d.seq, d.subject, d.event)
                urgent = urgent or not isinstance(d.event, BACKGROUND)
            return full, urgent

        loop = asyncio.get_running_loop()
        pump_task = asyncio.create_task(pump(), name="recorder-pump")
        stop_task = asyncio.create_task(stop.wait(), name="recorder-stop")
        oldest = None  # loop time when the oldest buffered row that is not BACKGROUND arrived
        oldest_bg = None  # ... the oldest buffered row

        def flush_due() -> float | None:
            """Loop time of the next flush by age (None: nothing buffered)."""
            dues = [t + dt for t, dt in ((oldest, flush_interval_s), (oldest_bg, max(flush_interval_s, background_flush_s)))
                    if t is not None]
            return min(dues) if dues else None

        try:
            while True:
                due = flush_due()
                timeout = flush_interval_s if due is None else max(0.0, due - loop.time())
                get = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait(
                    {get, stop_task, pump_task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                full = False
                if get in done:
                    now = loop.time()
                    full, urgent = take_ready(get.result())
                    if oldest_bg is None:
                        oldest_bg = now
                    if urgent and oldest is None:
                        oldest = now
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
                due = flush_due()
                if full or (due is not None and loop.time() >= due):
                    await flush()
                    oldest = oldest_bg = loop.time() if recorder.pending else None
        finally:
            pump_task.cancel()
            stop_task.cancel()
            await asyncio.gather(pump_task, stop_task, return_exceptions=True)
            writer.shutdown(wait=False)  # an append cancelled mid-way finishes on its thread (as to_thread's)
    stats.redeliveries = recorder.redeliveries
    log.info("recorder_stopped", recorded=stats.recorded, batches=stats.batches, last_seq=stats.last_seq)
    return stats


_LIBC = None


def release_free_heap() -> bool:
    """``malloc_trim(0)``: glibc hands the free pages inside its heaps back to the kernel; and
    when pyarrow is loaded (an append encodes its batch with it), its pool's unused memory too
    (``release_unused``: mimalloc collects the calling thread's heap, so call it on the writer
    thread; in run 9 that pool's resident pages rose 4 -> 10 MB in the second half).

    Each append allocates and frees a batch's payload strings, arrays and DuckDB's transient
    buffers from several threads' arenas; the freed chunks stay resident, scattered, and the
    heap's free space crept up with the log (the recorder-only bench,
    ``python -m services.drivers.recorder.rss``: glibc's free space 7 -> 20 MB over 200,000
    rows, docs/chaos.md "Soak"). False where the C library is not glibc."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            lib = ctypes.CDLL(name) if name else None
            _LIBC = lib if lib is not None and hasattr(lib, "malloc_trim") else False
        except OSError:
            _LIBC = False
    pa = sys.modules.get("pyarrow")
    if pa is not None:
        with contextlib.suppress(Exception):  # a pool without it (older pyarrow): nothing to release
            pa.default_memory_pool().release_unused()
    if not _LIBC:
        return False
    _LIBC.malloc_trim(0)
    return True


class LiveSnapshots:
    """Answers ``evolving sql --live`` for one DuckDB log on a NATS bus: on a request on
    ``eictl.<partition>.recorder.snapshot``, checkpoint and copy the log (under its write lock)
    to ``RUN.snapshot.duckdb`` and reply ``{"ok", "file", "applied_seq", "bytes", "age_s",
    "took_s", "db"}`` (JSON). Writes ``RUN.duckdb.live.json`` (how to reach it) while it runs;
    removes both files on exit. One snapshot at a time; the last one is reused while the log has
    not moved or is younger than ``min_interval_s``."""

    def __init__(self, bus: Bus, event_log, *, min_interval_s: float = 1.0) -> None:
        self.bus, self.event_log, self.min_interval_s = bus, event_log, min_interval_s
        self.db = os.path.abspath(event_log.path)
        self.subject = snapshot_subject(bus.partition)
        self.sidecar = sidecar_path(self.db)
        self.snapshot = snapshot_path(self.db)
        self.served = 0
        self.copies = 0
        self._last: dict[str, Any] | None = None
        self._last_at = 0.0
        self._lock = asyncio.Lock()
        self._sub = None

    async def __aenter__(self):
        self._sub = await self.bus.listen(self.subject, self._on_request)
        info = {"nats_url": self.bus.url,
                "partition": self.bus.partition, "subject": self.subject, "pid": os.getpid(),
                "db": os.path.basename(self.db), "snapshot": os.path.basename(self.snapshot)}
        await asyncio.to_thread(_write_atomically, self.sidecar, json.dumps(info, indent=2))
        log.info("live_snapshots_ready", subject=self.subject, sidecar=self.sidecar)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._sub is not None:
            await self._sub.close()
        for f in (self.sidecar, self.snapshot):
            with contextlib.suppress(FileNotFoundError):
                os.remove(f)

    async def take(self) -> dict[str, Any]:
        """A snapshot's reply (a fresh copy, or the last one when it is still good)."""
        async with self._lock:
            now = time.monotonic()
            last = self._last
            if last is not None and os.path.exists(self.snapshot) and (
                    last["applied_seq"] == self.event_log.last_seq() or now - self._last_at < self.min_interval_s):
                return {**last, "age_s": round(now - self._last_at, 3)}
            res = await asyncio.to_thread(self.event_log.snapshot, self.snapshot)
            self.copies += 1
            self._last_at = time.monotonic()
            self._last = {"ok": True, "file": os.path.basename(self.snapshot), "path": self.snapshot,
                          "db": os.path.basename(self.db), "applied_seq": res["applied_seq"],
                          "bytes": res["bytes"], "took_s": round(res["took_s"], 4)}
            log.info("live_snapshot", applied_seq=res["applied_seq"], bytes=res["bytes"],
                     took_s=round(res["took_s"], 4))
            return {**self._last, "age_s": 0.0}

    async def _on_request(self, msg: Message) -> bytes:
        try:
            reply = await self.take()
        except Exception as exc:  # noqa: BLE001 - the client gets the reason; the recorder goes on
            log.warning("live_snapshot_failed", error=f"{type(exc).__name__}: {exc}")
            reply = {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        self.served += 1
        return json.dumps(reply).encode()


def _write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
