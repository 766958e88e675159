"""The recorder: lands the whole stream in DuckDB for SQL and deterministic replay.

- :mod:`.eventlog` - the ``EventLog`` port, ``DuckDbEventLog`` and ``InMemoryEventLog``;
- :mod:`.views` - typed per-kind views and the named views (requests, route_decisions, ...);
- :mod:`.core` / :mod:`.service` - the batching core and the bus adapter ``run_recorder``;
- :mod:`.verify` - ``evolving verify``: fold the log through fresh cores, compare decisions;
- :mod:`.sandbox` - the read-only, sandboxed DuckDB sessions of ``evolving sql``;
- :mod:`.live` - ``evolving sql --live``: ask a running recorder for a consistent snapshot.

See docs/recorder.md.

Layer 2 (adapter: DuckDB). May import: ``events``, the cores (``verify`` refolds through them),
DuckDB. ``cli`` and ``bench`` are drivers (layer 3).
"""

from services.adapters.eventlog.duckdb_log import DuckDbEventLog, EventLog, EventLogError, InMemoryEventLog

__all__ = ["DuckDbEventLog", "EventLog", "EventLogError", "InMemoryEventLog"]
