"""The recorder's pure part: it batches deliveries for the event log. No I/O, no clock.

The adapter (:func:`services.drivers.recorder.service.run_recorder`) offers each delivery and flushes
when :meth:`Recorder.offer` says the batch is full or when its flush interval passes; it then
hands :meth:`Recorder.take` to the log and acks the last sequence only after the log committed.
A delivery at or below the position already handed over is a redelivery and is dropped here.
"""

from __future__ import annotations

from events.catalog import Event

Row = tuple[int, str, Event]


class Recorder:
    """Batches ``(seq, subject, event)`` rows; drops redeliveries."""

    name = "recorder"

    def __init__(self, max_batch: int = 4096, applied_seq: int = 0) -> None:
        assert max_batch >= 1, "a batch holds at least one row"
        self.max_batch = max_batch
        self.applied_seq = applied_seq  # highest seq handed over by take()
        self.redeliveries = 0
        self._batch: list[Row] = []
        self._last = applied_seq

    def offer(self, seq: int, subject: str, event: Event) -> bool:
        """Buffer one delivery; True when the batch is full and should be flushed now."""
        if seq <= self._last:
            self.redeliveries += 1
            return False
        self._last = seq
        self._batch.append((seq, subject, event))
        return len(self._batch) >= self.max_batch

    @property
    def pending(self) -> int:
        return len(self._batch)

    def take(self) -> list[Row]:
        """The buffered rows, in seq order; the buffer is empty afterwards."""
        batch, self._batch = self._batch, []
        if batch:
            self.applied_seq = batch[-1][0]
        return batch
