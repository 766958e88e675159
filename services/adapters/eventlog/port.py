"""The event log port: :class:`EventLog`, its row type and errors, and the rules both logs share.

An event log stores the stream as ``(seq, subject, event)`` rows, in stream order. Two logs
satisfy the port, side by side in this folder: :class:`services.adapters.eventlog.duckdb_log.DuckDbEventLog`
(one DuckDB file) and its twin :class:`services.adapters.eventlog.memory.InMemoryEventLog`.

Invariants (held by ``tests/contract/test_eventlog.py`` for both backends):

- ``append(batch)`` stores the rows whose ``seq`` is above the applied position, sorted, each
  at most once (:func:`new_rows`), and moves the applied position to the highest ``seq`` of the
  batch *in the same transaction* as the rows. Redelivering a batch (or any part of one) is
  therefore a no-op. A row whose ``seq`` is at or below the applied position is skipped even if
  it was never stored (the stream is consumed in order; a lower position is a redelivery).
- ``read(from_seq)`` yields typed events, decoded from their stored form, in ``seq`` order;
  every event reads back, non-finite floats included (:mod:`.payload`). A row that does not
  decode (a corrupted or edited file) raises :class:`events.codec.CodecError` naming its seq,
  or, given an ``undecodable`` callback, is handed to it and skipped: one bad row never hides
  the rest of the log.
- ``skipped()`` says which seqs the writer was handed no row for (:class:`Skipped`): every jump
  in seq that ``append`` meets is noted in the same transaction as the rows, so a seq that is
  neither stored nor noted was deleted after it was written (``evolving verify`` names it).
- ``run_config`` is a small key -> JSON value table that whoever creates a run writes once
  (the plug-in names and constructor arguments of the cores); ``evolving verify`` builds its
  fresh cores from it. See docs/recorder.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from events.catalog import Event

Row = tuple[int, str, Event]
"""One log row: stream sequence, subject, event."""

Undecodable = Callable[[int, str, str], None]
"""Called by ``read`` with ``(seq, subject, reason)`` for a row that does not decode."""


@dataclass(frozen=True)
class Skipped:
    """The seqs a log's writer was handed no row for, noted by ``append`` as it met them.

    For the recorder these are the stream's messages its consumer did not deliver: bytes that
    did not decode (dead-lettered), messages removed by the stream's limits before it read them,
    the stream's beginning when it started after it; for the simulator's ``--log-level
    decisions``, the events it filtered out. ``ranges``: inclusive ``(first, last)`` seq ranges,
    ascending. ``since``: the applied position when the log began noting them (0: at its
    creation; None: never, a log written before: its holes are unknown)."""

    ranges: tuple[tuple[int, int], ...] = ()
    since: int | None = 0

    def covers(self, first: int, last: int) -> list[tuple[int, int]]:
        """The parts of ``first..last`` that are *not* in a noted range."""
        out: list[tuple[int, int]] = []
        lo = first
        for a, b in self.ranges:  # ascending, disjoint
            if b < lo:
                continue
            if a > last:
                break
            if a > lo:
                out.append((lo, a - 1))
            lo = max(lo, b + 1)
            if lo > last:
                return out
        if lo <= last:
            out.append((lo, last))
        return out

    def untracked(self, first: int, last: int) -> bool:
        """Whether a hole ``first..last`` lies where nothing was noted (before ``since``)."""
        return self.since is None or last < self.since


def skipped_ranges(seqs: Sequence[int], applied_seq: int) -> list[tuple[int, int]]:
    """The holes ``append`` notes for new rows ``seqs`` (ascending) after ``applied_seq``."""
    out: list[tuple[int, int]] = []
    prev = applied_seq
    for s in seqs:
        if s > prev + 1:
            out.append((prev + 1, s - 1))
        prev = s
    return out


class SeqHoles:
    """Fed the seqs of a log's rows in order (:meth:`see`), finds the seqs from 1 to the applied
    position that no row holds (:meth:`end`); ``first``: the first seq seen (0: none)."""

    def __init__(self) -> None:
        self.next = 1
        self.first = 0
        self.holes: list[tuple[int, int]] = []

    def see(self, seq: int) -> None:
        if not self.first:
            self.first = seq
        if seq > self.next:
            self.holes.append((self.next, seq - 1))
        if seq >= self.next:
            self.next = seq + 1

    def end(self, applied_seq: int) -> list[tuple[int, int]]:
        if applied_seq >= self.next:
            self.holes.append((self.next, applied_seq))
            self.next = applied_seq + 1
        return self.holes


class EventLogError(RuntimeError):
    """The log file is not usable (wrong schema, not an event log)."""


class EventLogLocked(EventLogError):
    """Another process (the live recorder) holds the file's write lock."""


@runtime_checkable
class EventLog(Protocol):
    """Append-only, seq-idempotent store of the stream."""

    def append(self, batch: Iterable[Row]) -> int:
        """Store the new rows of ``batch``; return how many were stored."""
        ...

    def last_seq(self) -> int:
        """The applied position (0 for an empty log)."""
        ...

    def read(self, from_seq: int = 1, types: Collection[str] | None = None, *,
             undecodable: Undecodable | None = None) -> Iterator[Row]:
        """Rows from ``from_seq`` on, in seq order; ``types``: only events of these type names
        (the others are not decoded: a figure that folds a few types skips the bulky ones).
        ``undecodable``: called for a row that does not decode, which is skipped (without it,
        such a row raises ``CodecError``)."""
        ...

    def skipped(self) -> Skipped:
        """The seqs the writer was handed no row for (see :class:`Skipped`)."""
        ...

    def count_by_type(self) -> dict[str, int]: ...

    def run_config(self) -> dict[str, Any]: ...

    def set_run_config(self, config: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def new_rows(batch: Iterable[Row], applied_seq: int) -> list[Row]:
    """The rows of ``batch`` to store after ``applied_seq``: sorted by seq, first copy of each seq."""
    seen: set[int] = set()
    out: list[Row] = []
    for row in sorted(batch, key=lambda r: r[0]):
        seq = row[0]
        if not isinstance(seq, int) or seq < 1:
            raise ValueError(f"stream sequence must be a positive int, got {seq!r}")
        if seq <= applied_seq or seq in seen:
            continue
        seen.add(seq)
        out.append(row)
    return out


def batched(rows: Iterable[Row], size: int) -> Iterator[list[Row]]:
    """``rows`` in lists of ``size`` (the last one shorter)."""
    it = iter(rows)
    while chunk := list(itertools.islice(it, size)):
        yield chunk
