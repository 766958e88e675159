"""The in-memory twin of the event log: :class:`InMemoryEventLog`.

Rows are kept as the JSON bytes DuckDB would store, so reading them back goes through the same
decoder; it passes the same contract tests as
:class:`services.adapters.eventlog.duckdb_log.DuckDbEventLog` (``tests/contract/test_eventlog.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any

import msgspec
import numpy as np

from events.codec import CodecError
from services.adapters.eventlog.payload import decode_payload, encode_payload
from services.adapters.eventlog.port import Row, Skipped, Undecodable, new_rows, skipped_ranges


class InMemoryEventLog:
    """The in-memory twin: rows are kept as the JSON bytes DuckDB would store, so reading
    them back goes through the same decoder."""

    def __init__(self) -> None:
        self._seqs: list[int] = []
        self._rows: list[tuple[str, bytes]] = []
        self._applied = 0
        self._config: dict[str, bytes] = {}
        self._skipped: list[tuple[int, int]] = []

    def append(self, batch: Iterable[Row]) -> int:
        rows = new_rows(batch, self._applied)
        encoded = [(seq, subject, encode_payload(ev)) for seq, subject, ev in rows]
        for seq, subject, data in encoded:  # encode all first: a bad event stores nothing
            self._seqs.append(seq)
            self._rows.append((subject, data))
        if rows:
            self._skipped += skipped_ranges([r[0] for r in rows], self._applied)
            self._applied = rows[-1][0]
        return len(rows)

    def last_seq(self) -> int:
        return self._applied

    def read(self, from_seq: int = 1, types: Collection[str] | None = None, *,
             undecodable: Undecodable | None = None) -> Iterator[Row]:
        start = int(np.searchsorted(np.asarray(self._seqs, dtype=np.int64), from_seq)) if self._seqs else 0
        for i in range(start, len(self._seqs)):
            subject, data = self._rows[i]
            try:
                ev = decode_payload(self._seqs[i], data)
            except CodecError as exc:
                if undecodable is None:
                    raise
                undecodable(self._seqs[i], subject, exc.reason)
                continue
            if types is None or type(ev).__name__ in types:
                yield self._seqs[i], subject, ev

    def skipped(self) -> Skipped:
        return Skipped(tuple(self._skipped), 0)

    def count_by_type(self) -> dict[str, int]:
        return dict(Counter(msgspec.json.decode(d)["type"] for _, d in self._rows))

    def run_config(self) -> dict[str, Any]:
        return {k: msgspec.json.decode(v) for k, v in sorted(self._config.items())}

    def set_run_config(self, config: Mapping[str, Any]) -> None:
        self._config.update({k: msgspec.json.encode(v) for k, v in config.items()})

    def close(self) -> None:
        pass
