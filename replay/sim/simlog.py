"""The simulator's event log writer: (seq, subject, event) rows batched into a DuckDB file.

One writer serves a single run (partition ``default``) and each partition of a partitioned run
(subjects on ``ei.<p>.…``); a file already at the path is replaced.
"""

from __future__ import annotations

from pathlib import Path

from events.subjects import DEFAULT_PARTITION, subject_for
from services.adapters.eventlog import DuckDbEventLog


class SimLog:
    """Called with ``(seq, event)`` for every event; flushes every ``batch`` rows and on close."""

    def __init__(self, path: Path, partition: str = DEFAULT_PARTITION, config: dict | None = None,
                 batch: int = 20000) -> None:
        if path.exists():
            path.unlink()
        self.log = DuckDbEventLog(str(path))
        if config is not None:
            self.log.set_run_config(config)
        self.partition, self.batch, self.rows = partition, batch, []

    def __call__(self, seq: int, ev) -> None:
        self.rows.append((seq, subject_for(ev, self.partition), ev))
        if len(self.rows) >= self.batch:
            self.flush()

    def flush(self) -> None:
        if self.rows:
            self.log.append(self.rows)
            self.rows = []

    def close(self) -> None:
        self.flush()
        self.log.close()
