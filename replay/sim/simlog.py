"""The simulator's event log writer: (seq, subject, event) rows batched into a DuckDB file,
written by a background thread off the simulation's critical path.

One writer serves a single run (partition ``default``) and each partition of a partitioned run
(subjects on ``ei.<p>.…``); a file already at the path is replaced.

The simulation only appends ``(seq, subject, event)`` to a list; every ``batch`` rows the list
goes to a bounded queue (``queue_batches`` deep: a simulation that outruns its writer waits
rather than holding the whole run in memory) and a writer thread encodes and appends it
(``DuckDbEventLog.append``: Arrow tables, every block hash stored once; DuckDB's insert runs
without the GIL). :meth:`SimLog.close` flushes, waits for the writer and checks that every row
handed to it was stored (a lost row, or a writer that failed, raises :class:`EventLogError`).

``level`` (``--log-level``): ``full`` records every event (what ``evolving verify`` replays);
``decisions`` keeps the decisions and what the run's tables need (:data:`DECISION_LEVEL_TYPES`:
the figures of ``sim-report`` and the views of ``evolving sql``) and drops the KV facts, the
ticks and the heartbeats. A ``decisions`` log says so in ``run_config.log_level``; ``verify``
refuses it.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from events.catalog import EVENT_TYPES
from events.subjects import DEFAULT_PARTITION, subject_for
from replay.sim.figures import METRIC_TYPES
from services.adapters.eventlog import DuckDbEventLog, EventLogError
from services.adapters.eventlog.columnar import FORMAT

#: What ``--log-level decisions`` keeps: the cores' decisions and acknowledgements, anomalies,
#: and every type the figures fold (requests, iterations, nodes; METRIC_TYPES).
DECISION_LEVEL_TYPES = frozenset({"RouteDecided", "PlanEvaluated", "RoleSwitchOrdered", "ModelFitted", "SwitchRole",
                                  "RoleSwitched", "AnomalyReported", "NodeRemoved"}) | METRIC_TYPES
LOG_LEVELS = ("full", "decisions")

#: Rows per batch handed to the writer. Small enough that the writer works while the simulation
#: runs (at 20,000, a 6-minute calibration run was one batch, written after its last event) and
#: that a batch's new hashes are few: the block dictionary sorts a batch's unseen hashes, and
#: most hashes of a batch were seen in an earlier one. Re-encoding one 20,135-event calibration
#: log (6.3 M hashes) took 3.06 s of writer CPU in one batch of 20,000, 1.41 s at 5,000, 1.39 s at
#: 2,000 and 1.30 s at 1,000, with the same file size (docs/simulator.md §8, "The log writer's batches").
BATCH = 2048


class SimLog:
    """Called with ``(seq, event)`` for every event; hands a batch to the writer every ``batch``
    rows and on close. ``background=False`` writes in the caller's thread (the previous path);
    ``format="1"`` writes the previous storage format (``bench sim``'s baseline row)."""

    def __init__(self, path: Path, partition: str = DEFAULT_PARTITION, config: dict | None = None,
                 batch: int = BATCH, *, level: str = "full", background: bool = True, format: str = FORMAT,
                 queue_batches: int = 4) -> None:
        if level not in LOG_LEVELS:
            raise ValueError(f"log level {level!r}: expected one of {', '.join(LOG_LEVELS)}")
        if path.exists():
            path.unlink()
        wal = Path(str(path) + ".wal")
        if wal.exists():
            wal.unlink()
        self.path = path
        self.log = DuckDbEventLog(str(path), format=format)
        if config is not None:
            self.log.set_run_config({**config, "log_level": level})
        self.level = level
        self._keep = None if level == "full" else frozenset(t for t in EVENT_TYPES
                                                            if t.__name__ in DECISION_LEVEL_TYPES)
        self.partition, self.batch, self.rows = partition, batch, []
        self.offered = 0  # rows handed to the writer
        self.stored = 0  # rows the log stored
        self.write_s = 0.0  # writer busy time (encoding + DuckDB), wall
        self.write_cpu_s = 0.0  # the writing thread's own CPU time for it
        self.close_wait_s = 0.0  # how long close() waited for the writer (after the last event)
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=queue_batches)
            self._thread = threading.Thread(target=self._drain, name=f"simlog-{path.name}", daemon=True)
            self._thread.start()

    def __call__(self, seq: int, ev) -> None:
        if self._keep is not None and type(ev) not in self._keep:
            return
        self.rows.append((seq, subject_for(ev, self.partition), ev))
        if len(self.rows) >= self.batch:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        rows, self.rows = self.rows, []
        self.offered += len(rows)
        if self._queue is None:
            self._write(rows)
            return
        if self._error is not None:
            raise EventLogError(f"{self.path}: the log writer failed: {self._error}") from self._error
        self._queue.put(rows)

    def _write(self, rows: list) -> None:
        t0, c0 = time.perf_counter(), time.thread_time()
        self.stored += self.log.append(rows)
        self.write_s += time.perf_counter() - t0
        self.write_cpu_s += time.thread_time() - c0

    def _drain(self) -> None:
        assert self._queue is not None
        while True:
            rows = self._queue.get()
            if rows is None:
                return
            if self._error is not None:
                continue  # keep taking batches so the simulation never blocks on a dead writer
            try:
                self._write(rows)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the simulation's thread
                self._error = exc

    def close(self) -> None:
        """Flush, wait for the writer, check that every row was stored, close the file."""
        t0 = time.perf_counter()
        try:
            self.flush()
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
            self.close_wait_s = time.perf_counter() - t0
            if self._error is not None:
                raise EventLogError(f"{self.path}: the log writer failed: {self._error}") from self._error
            if self.stored != self.offered:
                raise EventLogError(f"{self.path}: {self.offered} events handed to the log, {self.stored} stored")
        finally:
            self.log.close()

    def stats(self) -> dict:
        """What writing cost: rows, writer busy time (wall, and the writing thread's CPU: DuckDB's
    own worker threads not counted), the wait at close, the file's bytes."""
        size = self.path.stat().st_size if self.path.exists() else 0
        wal = Path(str(self.path) + ".wal")
        return {"log_events": self.stored, "log_write_s": self.write_s, "log_write_cpu_s": self.write_cpu_s,
                "log_close_wait_s": self.close_wait_s,
                "log_bytes": size + (wal.stat().st_size if wal.exists() else 0), "log_level": self.level,
                "log_format": self.log.format}
