"""The event log: the port and its two logs, side by side (docs/recorder.md).

- :mod:`.port` - the ``EventLog`` port: ``Row``, ``EventLogError`` / ``EventLogLocked``, and the
  rules both logs share (``new_rows``: which rows of a batch to store; ``batched``);
- :mod:`.memory` - ``InMemoryEventLog``, the in-process twin;
- :mod:`.duckdb_log` - ``DuckDbEventLog`` (one DuckDB file), ``open_sources`` (a read-only
  query session over several logs and Parquet segments) and ``refresh_tables`` (its stale
  ``mat_*`` tables stored again);
- :mod:`.views` - the typed per-kind views and the named views (requests, route_decisions, ...);
- :mod:`.sandbox` - the read-only, sandboxed DuckDB sessions of ``evolving sql``.

Both logs pass the same contract tests (``tests/contract/test_eventlog.py``). The recorder
service that fills a log from the bus, ``evolving verify`` and ``evolving sql`` are drivers
(``services/drivers/recorder/``).

Layer 2 (adapter: DuckDB). May import: ``events``, DuckDB, pyarrow (writers of format 2, lazily).
"""

from services.adapters.eventlog.duckdb_log import DuckDbEventLog, open_sources, refresh_tables
from services.adapters.eventlog.memory import InMemoryEventLog
from services.adapters.eventlog.port import EventLog, EventLogError, EventLogLocked, Row, batched, new_rows

__all__ = [
    "DuckDbEventLog",
    "EventLog",
    "EventLogError",
    "EventLogLocked",
    "InMemoryEventLog",
    "Row",
    "batched",
    "new_rows",
    "open_sources",
    "refresh_tables",
]
