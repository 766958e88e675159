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
- ``read(from_seq)`` yields typed events, decoded from their stored form, in ``seq`` order.
- ``run_config`` is a small key -> JSON value table that whoever creates a run writes once
  (the plug-in names and constructor arguments of the cores); ``evolving verify`` builds its
  fresh cores from it. See docs/recorder.md.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from events.catalog import Event

Row = tuple[int, str, Event]
"""One log row: stream sequence, subject, event."""


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

    def read(self, from_seq: int = 1, types: Collection[str] | None = None) -> Iterator[Row]:
        """Rows from ``from_seq`` on, in seq order; ``types``: only events of these type names
        (the others are not decoded: a figure that folds a few types skips the bulky ones)."""
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
