"""The soak's recorder finding (docs/chaos.md "Soak", runs 9-10): a stalled writer must leave the
backlog on the server, not decoded in the recorder. Against a real nats-server (the session's,
tests/conftest.py): while the first append is held, what JetStream has handed out and not had
acknowledged is everything the recorder holds (the batch being written, its queue, the
consumer's read-ahead); it stays within ``2 x max_batch`` plus the consumer's pull window
(it was ``max_batch + 4 x max_batch`` plus the window before the bound), and once the writer
goes on every event is recorded once, in order."""

from __future__ import annotations

import asyncio
import threading

import pytest

from events import codec
from events.catalog import Tick
from events.subjects import subject_for
from services.adapters.bus import InMemoryBus, NatsBus
from services.adapters.eventlog import InMemoryEventLog
from services.drivers.recorder.service import run_recorder


class _HeldLog(InMemoryEventLog):
    """An in-memory log whose first append waits until ``release`` (a stalled writer)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: set[str] = set()

    def append(self, batch):
        self.threads.add(threading.current_thread().name)
        if not self.entered.is_set():
            self.entered.set()
            if not self.release.wait(30):
                raise TimeoutError("never released")
        return super().append(batch)


async def _publish(bus: NatsBus, n: int) -> list[int]:
    """``n`` ticks through core NATS (the stream stores them; no JetStream ack per message: 24 k
    acked publishes take ~30 s on a loaded machine, these ~1 s); their stream sequences."""
    first = await bus.last_seq() + 1
    hdrs = codec.headers()
    for i in range(1, n + 1):
        ev = Tick(ts=float(i))
        await bus.nc.publish(subject_for(ev, bus.partition), codec.encode(ev), headers=hdrs)
    await bus.nc.flush()
    for _ in range(200):
        if await bus.last_seq() >= first + n - 1:
            break
        await asyncio.sleep(0.05)
    assert await bus.last_seq() == first + n - 1
    return list(range(first, first + n))


async def _ack_pending(bus: NatsBus, durable: str) -> int:
    info = await bus.js.consumer_info(bus.stream, durable)
    return info.num_ack_pending


async def test_a_stalled_writer_keeps_the_backlog_on_the_server(nats_url, partition):
    max_batch, n = 4096, 24_000  # n > max_batch + 4 x max_batch + the pull window: the old queue would fill
    bus = await NatsBus.connect(nats_url, partition)
    log = _HeldLog()
    stop = asyncio.Event()
    task = None
    try:
        seqs = await _publish(bus, n)
        task = asyncio.create_task(run_recorder(bus, log, "backlog", max_batch=max_batch, flush_interval_s=0.05,
                                                stop=stop, live=False, trim_interval_s=None))
        assert await asyncio.to_thread(log.entered.wait, 10), "the first append never started"
        # the read-ahead settles once the queue is full and the consumer has stopped asking
        held, same = -1, 0
        for _ in range(100):
            await asyncio.sleep(0.1)
            now = await _ack_pending(bus, "backlog")
            same = same + 1 if now == held else 0
            held = now
            if same >= 5:
                break
        window = 3 * 2048  # the consumer's pull requests in flight (services/adapters/bus/nats_bus.py: batch 2048)
        assert max_batch < held <= 2 * max_batch + window, held
        log.release.set()
        while log.last_seq() < seqs[-1]:
            await asyncio.sleep(0.05)
        stop.set()
        stats = await asyncio.wait_for(task, 30)
    finally:
        log.release.set()
        stop.set()
        if task is not None and not task.done():
            task.cancel()
        await bus.close()
    assert stats.recorded == n and [s for s, _, _ in log.read()] == seqs
    assert len(log.threads) == 1 and next(iter(log.threads)).startswith("recorder-writer")


async def test_max_queued_below_one_is_refused():
    with pytest.raises(ValueError, match="max_queued"):
        await run_recorder(InMemoryBus(), InMemoryEventLog(), max_queued=0)
