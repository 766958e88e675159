"""The event log in one DuckDB file: :class:`DuckDbEventLog`, and :func:`open_sources` for queries.

It satisfies the port in :mod:`services.adapters.eventlog.port` (invariants there), as does its
twin :class:`services.adapters.eventlog.memory.InMemoryEventLog`. Table ``events`` plus the typed
views of :mod:`services.adapters.eventlog.views`; read-only query sessions are sandboxed by
:mod:`services.adapters.eventlog.sandbox`.

Three storage formats (``log_meta.format``; docs/recorder.md, "Format"). **Format 3** (what a
new log is) and **format 2**: ``event_rows`` + ``block_dict``, written from Arrow tables, block
hashes stored once and referenced by id, format 3 with eviction lists as sparse bitmaps
(:mod:`services.adapters.eventlog.columnar`); ``events`` is a view that gives the format-1
relation back, so the typed views and ``evolving sql`` read every format alike. **Format 1**
(logs written before, and ``format="1"``: the benchmark's baseline): table ``events`` with the
whole event as JSON, a batch inserted as a dict of NumPy arrays. A file of another format is
refused with an error naming it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Self

import duckdb
import msgspec
import numpy as np

from events.catalog import Event
from events.codec import SCHEMA_VERSION, CodecError
from services.adapters.eventlog.columnar import (
    FORMAT,
    FORMATS,
    SCHEMA_V2,
    SCHEMA_V3,
    BlockDict,
    blocks_len_sql,
    blocks_sql,
    decode_bitmap,
    decode_blocks,
    decode_row,
    encode_rows,
    events_view_sql,
    rows_from_sql,
)
from services.adapters.eventlog.payload import decode_payload, encode_payload
from services.adapters.eventlog.port import (
    EventLogError,
    EventLogLocked,
    Row,
    Skipped,
    Undecodable,
    new_rows,
)
from services.adapters.eventlog.sandbox import connect_file, connect_sources, expand_parquet
from services.adapters.eventlog.views import (
    NAMED_VIEWS,
    Stored,
    catalog_key,
    create_views,
    materialize_views,
    view_keys,
)
from services.adapters.eventlog.views import use_materialized as use_materialized_views
from services.adapters.logging import get_logger

log = get_logger(__name__)

_READ_CHUNK = 4096

#: WAL size at which a streaming writer (one opened with a ``memory_limit``: the recorder)
#: checkpoints. DuckDB's default, 16 MiB, holds that much of the newest rows uncompressed in
#: memory between checkpoints: the soak's recorder rose ~12 MB and fell every ~2.7 minutes at
#: 20 req/s (docs/chaos.md, soak run 6); at 2 MB it checkpoints every ~20 s and holds ~1.5 MB.
STREAM_CHECKPOINT_THRESHOLD = "2MB"

#: Hashes per generation of a streaming writer's block dictionary (:class:`BlockDict`'s
#: ``max_entries``): two tables of 2**17 slots, 3.1 MB in all, allocated once. A hash unseen for
#: a generation (~11 minutes of the soak's 20 req/s: ~5,900 new hashes a minute) is stored again
#: when it comes back. A replay's writer keeps every hash (unbounded).
STREAM_BLOCK_DICT_ENTRIES = 65_536

#: DuckDB block size of a new format-2/3 file (DuckDB's default: 256 KiB). A file grows by whole
#: blocks and a column segment takes at least its block's free part, so a log with many small
#: segments (one per column per row group, a dozen columns) wastes most of its last blocks:
#: the calibration row's 3 + 3 minute log is 6.30 MB at 256 KiB, 4.47 MB at 64 KiB (4.53 MB at
#: 32 KiB, 5.81 MB at 16 KiB: per-block headers and smaller compression windows), the same rows
#: (docs/simulator.md, "Event log size: DuckDB blocks"). Read from the file's header on open: a
#: reader needs no setting, and files of either size open alike.
BLOCK_SIZE = 65_536

#: Format 1: the events table (and its indexes); the recorder bench builds the same table.
SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq UBIGINT PRIMARY KEY,
    ts DOUBLE NOT NULL,
    type VARCHAR NOT NULL,
    src VARCHAR NOT NULL,
    subject VARCHAR NOT NULL,
    payload JSON NOT NULL
);
CREATE TABLE IF NOT EXISTS log_meta (key VARCHAR PRIMARY KEY, value VARCHAR NOT NULL);
CREATE TABLE IF NOT EXISTS run_config (key VARCHAR PRIMARY KEY, value JSON NOT NULL);
"""

#: Every format: the seq ranges the writer was handed no row for (``port.Skipped``), noted by
#: ``append`` in the transaction of the rows after them; ``log_meta.skipped_since`` is the
#: applied position when the table was made (0: with the log; a log written before gets it at its
#: next writable open, and its holes below that position stay unknown).
SKIPPED_SCHEMA = """
CREATE TABLE IF NOT EXISTS skipped_seqs (first_seq UBIGINT NOT NULL, last_seq UBIGINT NOT NULL);
"""


class DuckDbEventLog:
    """The event log in one DuckDB file: table ``events`` plus typed views (see
    :mod:`services.adapters.eventlog.views`). One writer process at a time (DuckDB's file lock);
    ``read_only=True`` opens a finished run for queries and replay. ``format``: of a new file
    (default 2; ``"1"`` writes the previous format, the benchmarks' baseline); an existing file
    keeps its own. ``memory_limit``: DuckDB's cap for a long-running writer; it also sets
    ``checkpoint_threshold`` (default :data:`STREAM_CHECKPOINT_THRESHOLD`), so the rows not yet
    checkpointed stay few, and bounds the block dictionary (``block_dict_entries``, default
    :data:`STREAM_BLOCK_DICT_ENTRIES`; ``0``: unbounded). ``use_materialized=False``: a reader
    computes the named views from the events even where the ``mat_*`` tables are current (what
    ``evolving bench sql`` times as the other path). A reader's :attr:`stale_views` names the
    named views it computes because their stored table is missing or not current (each table is
    current or not on its own: :meth:`materialize`)."""

    def __init__(self, path: str | os.PathLike, read_only: bool = False, *, sandbox: bool = False,
                 format: str = FORMAT, memory_limit: str | None = None,
                 checkpoint_threshold: str | None = None, block_dict_entries: int | None = None,
                 materialize_on_close: bool = True, use_materialized: bool = True) -> None:
        #: :meth:`close` stores the named views as tables when the log moved (:meth:`materialize`)
        self.materialize_on_close = materialize_on_close
        #: whether all of this reader's named views read the ``mat_*`` tables (set by a read-only open)
        self.materialized = False
        #: named views whose stored table a reader cannot use (missing, or not current): computed
        self.stale_views: tuple[str, ...] = ()
        #: the ``materialized*`` notes of ``log_meta`` as a writer found them when it opened the log
        self._mat_notes: dict[str, str] = {}
        if format not in FORMATS:
            raise ValueError(f"event log format {format!r}: this version writes {', '.join(FORMATS)}")
        self.path = os.fspath(path)
        self._blocks: BlockDict | None = None
        if block_dict_entries is None and memory_limit:
            block_dict_entries = STREAM_BLOCK_DICT_ENTRIES
        self._block_dict_entries = block_dict_entries or None
        self._hashes: np.ndarray | None = None  # id -> hash, for reading (loaded on first read)
        self.read_only = read_only or sandbox
        if self.read_only:
            _check_file(self.path)
        if sandbox:  # no file system, no extensions, settings locked (services.adapters.eventlog.sandbox)
            self.con = _connect_or_explain(connect_file, self.path)
        elif read_only:
            self.con = _connect_or_explain(lambda p: duckdb.connect(p, read_only=True), self.path)
        else:
            # memory_limit caps DuckDB's buffer pool, which otherwise keeps written data cached
            # up to 80% of RAM: a long-running recorder's RSS then grows with the log
            config = {}
            if format != "1" and not os.path.exists(self.path):
                config["default_block_size"] = str(BLOCK_SIZE)  # a new file only; format 1 as before
            if memory_limit:
                config |= {"memory_limit": memory_limit,
                           "checkpoint_threshold": checkpoint_threshold or STREAM_CHECKPOINT_THRESHOLD}
            elif checkpoint_threshold:
                config["checkpoint_threshold"] = checkpoint_threshold
            self.con = duckdb.connect(self.path, config=config)
        # one connection, used from the event loop and from worker threads (run_recorder
        # appends in one): a transaction must not interleave with another thread's statements
        self._lock = threading.RLock()
        if self.read_only:
            try:
                self._check_schema()
                self.format = self._read_format()
                create_views(self.con, temp=True, events_sql=self._events_sql(), stored=self._stored_sql())
                self._applied = self._read_applied()
                fresh = self._fresh_views(self._notes())
                if use_materialized and fresh:
                    use_materialized_views(self.con, [n for n in NAMED_VIEWS if n in fresh])
                    self.materialized = len(fresh) == len(NAMED_VIEWS)
                if self._applied > 0:
                    self.stale_views = tuple(n for n in NAMED_VIEWS if n not in fresh)
            except (duckdb.Error, ValueError) as exc:  # a truncated or corrupt file fails on its first read
                self.con.close()
                raise EventLogError(f"{self.path} is not a readable event log: {_first_line(exc)}") from exc
        else:
            tables = self._tables()
            if tables & {"events", "event_rows", "log_meta"}:
                self._check_schema()
                self.format = self._read_format()
                self._applied = self._read_applied()
                if "skipped_seqs" not in tables:
                    self._add_skipped(self._applied)
                # a writer may change any row: the materialised views stop being current now, and
                # its close() writes them again (refresh_tables: only those not current at open)
                self._mat_notes = self._notes()
                self.con.execute("DELETE FROM log_meta WHERE key LIKE 'materialized%'")
            else:
                self.format = format
                self._create()
                self._applied = self._read_applied()

    # -- setup
    def _create(self) -> None:
        self.con.execute("BEGIN")
        self.con.execute({"1": SCHEMA, "2": SCHEMA_V2}.get(self.format, SCHEMA_V3))
        self.con.execute(
            "INSERT OR IGNORE INTO log_meta VALUES ('applied_seq', '0'), ('schema', ?)", [SCHEMA_VERSION]
        )
        if self.format != "1":
            self.con.execute("INSERT OR IGNORE INTO log_meta VALUES ('format', ?)", [self.format])
        self.con.execute(SKIPPED_SCHEMA)
        self.con.execute("INSERT OR IGNORE INTO log_meta VALUES ('skipped_since', '0')")
        create_views(self.con, events_sql=self._events_sql(), stored=self._stored_sql())
        self.con.execute("COMMIT")

    def _add_skipped(self, since: int) -> None:
        """The table of skipped seqs in a log written before it (its holes up to ``since`` stay unknown)."""
        self.con.execute("BEGIN")
        self.con.execute(SKIPPED_SCHEMA)
        self.con.execute("INSERT OR REPLACE INTO log_meta VALUES ('skipped_since', ?)", [str(since)])
        self.con.execute("COMMIT")

    def _tables(self) -> set[str]:
        return {r[0] for r in self.con.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE'").fetchall()}

    def _check_schema(self) -> None:
        tables = self._tables()
        if "log_meta" not in tables or not tables & {"events", "event_rows"}:
            self.con.close()
            raise EventLogError(f"{self.path} is not an event log (tables: {sorted(tables)})")

    def _read_format(self) -> str:
        """``log_meta.format`` (format 1 logs have none); an unknown one is refused by name."""
        row = self.con.execute("SELECT value FROM log_meta WHERE key = 'format'").fetchall()
        fmt = row[0][0] if row else "1"
        if fmt not in FORMATS:
            self.con.close()
            raise EventLogError(f"{self.path} is an event log of format {fmt}; this version reads formats "
                                f"{', '.join(FORMATS)} (upgrade evolving-infra to read it)")
        if (fmt != "1") != ("event_rows" in self._tables()):
            self.con.close()
            raise EventLogError(f"{self.path} is not a readable event log: log_meta says format {fmt} "
                                "but its tables are another format's")
        return fmt

    def _events_sql(self) -> str | None:
        """The ``events`` view of a format-2/3 log (format 1: ``events`` is the table itself)."""
        return events_view_sql(fmt=self.format) if self.format != "1" else None

    def _stored_sql(self) -> Stored | None:
        """What the typed views read directly (format 2/3): the stored rows, and the block lists."""
        if self.format == "1":
            return None
        # every kind with a list has one (empty by default): a row that stores none holds [], as in format 1
        return Stored("event_rows r", rows_from_sql(), f"coalesce({blocks_sql(self.format)}, []::UBIGINT[])",
                      f"coalesce({blocks_len_sql(self.format)}, 0)")

    def _block_dict(self) -> BlockDict:
        """The writer's dictionary, read back from the file (bounded: its newest entries)."""
        if self._blocks is None:
            with self._lock:
                (n,) = self.con.execute("SELECT count(*) FROM block_dict").fetchone()  # ids are 0..n-1
                lo = 0 if self._block_dict_entries is None else max(0, n - self._block_dict_entries)
                got = self.con.execute("SELECT hash, id FROM block_dict WHERE id >= ?", [lo]).fetchnumpy()
            self._blocks = BlockDict(got["hash"].astype(np.uint64), got["id"].astype(np.uint32), size=int(n),
                                     max_entries=self._block_dict_entries)
        return self._blocks

    def _hashes_by_id(self) -> np.ndarray:
        """Every stored hash by id (``[i]`` is id ``i``'s), read from the file: the writer's
        dictionary does not keep them (a bounded one forgets)."""
        (n,) = self.con.execute("SELECT count(*) FROM block_dict").fetchone()
        if self._hashes is None or len(self._hashes) != n:
            got = self.con.execute("SELECT hash FROM block_dict ORDER BY id").fetchnumpy()
            self._hashes = got["hash"].astype(np.uint64)
        return self._hashes

    def _read_applied(self) -> int:
        row = self.con.execute("SELECT value FROM log_meta WHERE key = 'applied_seq'").fetchall()
        return int(row[0][0]) if row else 0

    # -- port
    def append(self, batch: Iterable[Row]) -> int:
        with self._lock:
            return self._append(batch)

    def _append(self, batch: Iterable[Row]) -> int:
        rows = new_rows(batch, self._applied)
        if not rows:
            return 0
        if self.format != "1":
            return self._append_v2(rows)
        columns = _columns(rows)
        con = self.con
        con.execute("BEGIN")
        try:
            con.register("_ei_batch", columns)
            con.execute(
                "INSERT INTO events SELECT seq, CASE WHEN ts_nan THEN 'NaN'::DOUBLE ELSE ts END, type, src, subject, "
                "payload FROM _ei_batch"
            )
            self._note_skipped(rows)
            con.execute("UPDATE log_meta SET value = ? WHERE key = 'applied_seq'", [str(rows[-1][0])])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        finally:
            con.unregister("_ei_batch")
        self._applied = rows[-1][0]
        return len(rows)

    def _append_v2(self, rows: list[Row]) -> int:
        bd = self._block_dict()
        table, added, new = encode_rows(rows, bd, self.format)
        con = self.con
        con.execute("BEGIN")
        try:
            con.register("_ei_rows", table)
            con.register("_ei_dict", added)
            con.execute("INSERT INTO block_dict SELECT id, hash FROM _ei_dict")
            con.execute("INSERT INTO event_rows SELECT * FROM _ei_rows")
            self._note_skipped(rows)
            con.execute("UPDATE log_meta SET value = ? WHERE key = 'applied_seq'", [str(rows[-1][0])])
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            bd.undo(new)
            raise
        finally:
            con.unregister("_ei_rows")
            con.unregister("_ei_dict")
        bd.commit(new)
        self._applied = rows[-1][0]
        return len(rows)

    def _note_skipped(self, rows: Sequence[Row]) -> None:
        """Note the seqs before and between ``rows`` that the writer was not handed (in its
        transaction; one insert of arrays: a ``--log-level decisions`` batch has a hole per row)."""
        seqs = np.fromiter((r[0] for r in rows), dtype=np.uint64, count=len(rows))
        prev = np.concatenate(([np.uint64(self._applied)], seqs[:-1]))
        jump = seqs > prev + 1
        if not jump.any():
            return
        self.con.register("_ei_skipped", {"first_seq": prev[jump] + 1, "last_seq": seqs[jump] - 1})
        try:
            self.con.execute("INSERT INTO skipped_seqs SELECT first_seq, last_seq FROM _ei_skipped")
        finally:
            self.con.unregister("_ei_skipped")

    def skipped(self) -> Skipped:
        with self._lock:
            if "skipped_seqs" not in self._tables():
                return Skipped((), None)
            since = self.con.execute("SELECT value FROM log_meta WHERE key = 'skipped_since'").fetchall()
            ranges = self.con.execute("SELECT first_seq, last_seq FROM skipped_seqs ORDER BY first_seq").fetchall()
        return Skipped(tuple((int(a), int(b)) for a, b in ranges), int(since[0][0]) if since else None)

    def last_seq(self) -> int:
        return self._applied

    def read(self, from_seq: int = 1, types: Collection[str] | None = None, *,
             undecodable: Undecodable | None = None) -> Iterator[Row]:
        if self.format != "1":
            yield from self._read_v2(from_seq, types, undecodable)
            return
        with self._lock:
            cur = self.con.cursor()  # its own connection: reading does not hold the lock
        try:
            if types is None:
                cur.execute("SELECT seq, subject, payload, ts FROM events WHERE seq >= ? ORDER BY seq", [from_seq])
            else:
                cur.execute("SELECT seq, subject, payload, ts FROM events WHERE seq >= ? AND list_contains(?, type) "
                            "ORDER BY seq", [from_seq, sorted(types)])
            while chunk := cur.fetchmany(_READ_CHUNK):
                for seq, subject, payload, ts in chunk:
                    try:
                        ev = decode_payload(int(seq), payload, ts)
                    except CodecError as exc:
                        if undecodable is None:
                            raise
                        undecodable(int(seq), subject, exc.reason)
                        continue
                    yield int(seq), subject, ev
        finally:
            cur.close()

    def _read_v2(self, from_seq: int, types: Collection[str] | None, undecodable: Undecodable | None) -> Iterator[Row]:
        with self._lock:  # the dictionary and the rows at one position (no append between)
            hashes = self._hashes_by_id()
            cur = self.con.cursor()  # its own connection: fetching does not hold the lock
            cols = "seq, subject, payload, ts, block_starts, block_lens, block_segs"
            cols += ", bitmap_words, bitmap_segs, bitmap_bits" if self.format != "2" else ", NULL, NULL, NULL"
            if types is None:
                cur.execute(f"SELECT {cols} FROM event_rows WHERE seq >= ? ORDER BY seq", [from_seq])
            else:
                cur.execute(f"SELECT {cols} FROM event_rows WHERE seq >= ? AND list_contains(?, type) "
                            "ORDER BY seq", [from_seq, sorted(types)])
        try:
            while chunk := cur.fetchmany(_READ_CHUNK):
                for seq, subject, payload, ts, starts, lens, segs, wnums, wsegs, bits in chunk:
                    try:
                        ev = _decode_v2(hashes, int(seq), payload, ts, starts, lens, segs, wnums, wsegs, bits)
                    except CodecError as exc:
                        if undecodable is None:
                            raise
                        undecodable(int(seq), subject, exc.reason)
                        continue
                    yield int(seq), subject, ev
        finally:
            cur.close()

    def count_by_type(self) -> dict[str, int]:
        table = "event_rows" if self.format != "1" else "events"
        with self._lock:
            rows = self.con.execute(f"SELECT type, count(*) FROM {table} GROUP BY type ORDER BY type").fetchall()
        return {t: int(n) for t, n in rows}

    def run_config(self) -> dict[str, Any]:
        with self._lock:
            rows = self.con.execute("SELECT key, value FROM run_config ORDER BY key").fetchall()
        return {k: msgspec.json.decode(v) for k, v in rows}

    def set_run_config(self, config: Mapping[str, Any]) -> None:
        with self._lock:
            self._set_run_config(config)

    def _set_run_config(self, config: Mapping[str, Any]) -> None:
        con = self.con
        con.execute("BEGIN")
        try:
            for key, value in config.items():
                con.execute(
                    "INSERT OR REPLACE INTO run_config VALUES (?, ?::JSON)",
                    [key, msgspec.json.encode(value).decode()],
                )
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise

    def export_parquet(self, path: str | os.PathLike, from_seq: int = 1, to_seq: int | None = None) -> int:
        """Copy rows ``from_seq..to_seq`` (default: to the applied position) to one Parquet file
        with the columns of ``events``; return how many. Segments of a long run, queried in
        place with :func:`open_sources` / ``evolving sql``."""
        with self._lock:
            return self._export_parquet(path, from_seq, to_seq)

    def _export_parquet(self, path: str | os.PathLike, from_seq: int, to_seq: int | None) -> int:
        to_seq = self._applied if to_seq is None else to_seq
        n = self.con.execute("SELECT count(*) FROM events WHERE seq BETWEEN ? AND ?", [from_seq, to_seq]).fetchall()
        target = os.fspath(path).replace("'", "''")
        self.con.execute(
            f"COPY (SELECT * FROM events WHERE seq BETWEEN {int(from_seq)} AND {int(to_seq)} ORDER BY seq) "
            f"TO '{target}' (FORMAT parquet)"
        )
        return int(n[0][0])

    def snapshot(self, dest: str | os.PathLike) -> dict[str, Any]:
        """Write a consistent, self-contained copy of the log to ``dest`` (``evolving sql --live``).

        Under the writer's lock (no append can interleave): ``CHECKPOINT`` folds the WAL into
        the file, then the file is copied to ``dest.tmp`` and renamed over ``dest``, so a reader
        holding the previous copy open keeps it and a new reader sees a whole one. A stale
        ``dest.wal`` is removed first (DuckDB would replay it into the copy).

        The byte copy runs in a **child process**: DuckDB's file lock is a POSIX ``fcntl`` lock,
        which a process loses as soon as it closes *any* descriptor of the file, so copying it
        from this process would silently unlock the log for other writers. (DuckDB's own
        ``COPY FROM DATABASE`` keeps the lock too but re-encodes everything: 13x slower, 0.46 s
        against 0.036 s for a 30 MB log.)"""
        dest = os.fspath(dest)
        tmp = dest + ".tmp"
        t0 = time.perf_counter()
        with self._lock:
            if self.read_only:
                raise EventLogError(f"{self.path} is open read-only: only its writer can snapshot it")
            self.con.execute("CHECKPOINT")
            done = subprocess.run([sys.executable, "-c", _COPY_FILE, self.path, tmp], capture_output=True,
                                  text=True, check=False)
            applied = self._applied
        if done.returncode != 0:
            raise EventLogError(f"snapshot copy to {tmp} failed: {done.stderr.strip().splitlines()[-1:]}")
        for stale in (dest + ".wal", tmp + ".wal"):
            if os.path.exists(stale):
                os.remove(stale)
        os.replace(tmp, dest)
        return {"applied_seq": applied, "bytes": os.path.getsize(dest), "took_s": time.perf_counter() - t0}

    def _meta(self, key: str) -> str | None:
        row = self.con.execute("SELECT value FROM log_meta WHERE key = ?", [key]).fetchall()
        return row[0][0] if row else None

    def _notes(self) -> dict[str, str]:
        """The ``materialized*`` rows of ``log_meta``: ``materialized_seq`` and
        ``materialized_rows`` (the log as the tables were stored), ``materialized_view.<name>``
        (the :func:`~services.adapters.eventlog.views.view_key` each table was stored with), and
        in a log stored before per-view keys, ``materialized_views`` (one key for all)."""
        return dict(self.con.execute("SELECT key, value FROM log_meta WHERE key LIKE 'materialized%'").fetchall())

    def _rows(self) -> int:
        (rows,) = self.con.execute(f"SELECT count(*) FROM {'events' if self.format == '1' else 'event_rows'}").fetchone()
        return int(rows)

    def _fresh_views(self, notes: Mapping[str, str]) -> set[str]:
        """The named views whose ``mat_*`` table holds this log's rows as it is now (the same
        applied position and row count: rows added or deleted by another tool since change the
        count) as this version defines the view (its own key)."""
        if not (self._applied > 0 and notes.get("materialized_seq") == str(self._applied)
                and notes.get("materialized_rows") == str(self._rows())):
            return set()
        tables = self._tables()
        legacy = notes.get("materialized_views") == catalog_key()
        return {name for name, key in view_keys().items()
                if f"mat_{name}" in tables and (legacy or notes.get(f"materialized_view.{name}") == key)}

    def materialize(self, only_stale: bool = False) -> tuple[str, ...]:
        """Store the named views' rows as tables (``mat_requests``, ...), so a reader answers the
        documented queries from plain tables: on a cluster-hour log computing ``requests`` from
        the events takes seconds to tens of seconds. Done by :meth:`close` of a writer, for every
        table (a writer may have changed any row, through :attr:`con` too). Each table carries
        its own key (the named view's SQL and the kind views it reads), and a reader uses a table
        only while it is current (same position, same row count, same key), computing the view
        otherwise: a change to one kind's view stales only the tables that read it.
        ``only_stale``: keep the tables that were current when this writer opened the log, store
        the others (:func:`refresh_tables`, which changes nothing in between). Returns the names
        of the tables it stored."""
        if self.read_only or self._applied == 0:
            return ()
        with self._lock:
            keys = view_keys()
            fresh = self._fresh_views(self._mat_notes) if only_stale else set()
            stale = [name for name in NAMED_VIEWS if name not in fresh]
            # this version's views (a file's stored ones are its writer's), and no progress bar on stderr
            self.con.execute("SET enable_progress_bar = false")
            notes = {"materialized_seq": str(self._applied), "materialized_rows": str(self._rows()),
                     **{f"materialized_view.{name}": key for name, key in keys.items()}}
            if not stale and notes == self._notes():
                return ()
            if stale:
                create_views(self.con, temp=True, events_sql=self._events_sql(), stored=self._stored_sql())
            self.con.execute("BEGIN")
            try:
                materialize_views(self.con, stale)
                self.con.execute("DELETE FROM log_meta WHERE key LIKE 'materialized%'")
                for key, value in notes.items():
                    self.con.execute("INSERT INTO log_meta VALUES (?, ?)", [key, value])
                self.con.execute("COMMIT")
            except Exception:
                self.con.execute("ROLLBACK")
                raise
            self._mat_notes = notes
        return tuple(stale)

    def close(self) -> None:
        with self._lock:
            if not self.read_only and self.materialize_on_close:
                try:
                    self.materialize()
                except duckdb.Error as exc:  # the log itself is whole: readers compute the views
                    log.warning("materialize_failed", path=str(self.path), error=_first_line(exc))
            self.con.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def refresh_tables(path: str | os.PathLike) -> tuple[str, ...]:
    """Store again the ``mat_*`` tables of the event log at ``path`` that are missing or not
    current, as a writer's close would (``evolving sql --refresh``); returns their names. The file
    is checked to be an event log by a read-only open first (a writable open of another DuckDB
    file would make it one); a running writer's lock is :class:`EventLogLocked`."""
    DuckDbEventLog(path, read_only=True).close()
    log = DuckDbEventLog(path, materialize_on_close=False)
    try:
        return log.materialize(only_stale=True)
    finally:
        log.close()


def _decode_v2(hashes: np.ndarray, seq: int, payload: str, ts: float, starts, lens, segs, wnums, wsegs,
               bits) -> Event:
    """One format-2/3 row back to its event; block ids the dictionary does not hold (an edited
    or corrupted row) are a :class:`CodecError` naming the row, like an undecodable payload."""
    try:
        if starts is not None:
            blocks = decode_blocks(hashes, starts, lens, segs)
            if len(blocks) != sum(lens):  # a slice past the dictionary's end is short, not an error
                raise IndexError(f"runs of {sum(lens)} ids, {len(hashes)} in the dictionary")
        elif bits is not None:
            blocks = decode_bitmap(hashes, wnums, wsegs, bits)
        else:
            blocks = None
    except (IndexError, ValueError, TypeError) as exc:
        raise CodecError(f"event log row seq={seq}: its block list does not decode ({exc})") from exc
    return decode_row(seq, payload, blocks, ts)


def _columns(rows: Sequence[Row]) -> dict[str, np.ndarray]:
    """Column arrays of a batch (what DuckDB scans without pandas or pyarrow)."""
    n = len(rows)
    seq = np.fromiter((r[0] for r in rows), dtype=np.uint64, count=n)
    ts = np.fromiter((r[2].ts for r in rows), dtype=np.float64, count=n)
    typ = np.empty(n, dtype=object)
    src = np.empty(n, dtype=object)
    subject = np.empty(n, dtype=object)
    payload = np.empty(n, dtype=object)
    typ[:] = [type(r[2]).__name__ for r in rows]
    src[:] = [r[2].src for r in rows]
    subject[:] = [r[1] for r in rows]
    payload[:] = [encode_payload(r[2]).decode() for r in rows]
    # DuckDB scans a NumPy NaN as NULL (the column is NOT NULL): the NaNs go in by a flag
    return {"seq": seq, "ts": ts, "ts_nan": np.isnan(ts), "type": typ, "src": src, "subject": subject,
            "payload": payload}


def open_sources(sources: Sequence[str], materialized: bool = True, stale: list[str] | None = None):
    """A read-only, sandboxed query session over several recorded sources: DuckDB event logs
    (``*.duckdb``) and Parquet files or globs written by :meth:`DuckDbEventLog.export_parquet`.
    ``events`` is their union (they must not overlap in ``seq``) and every view is defined
    over it. One DuckDB file alone is opened directly (its own views). The session cannot read
    or write other files, attach databases, load extensions or change its settings
    (:mod:`services.adapters.eventlog.sandbox`). ``materialized=False``: one DuckDB file computes
    its named views from the events even where its ``mat_*`` tables are current. ``stale``: one
    DuckDB file's :attr:`DuckDbEventLog.stale_views` are appended to it (several sources are
    always computed)."""
    if len(sources) == 1 and not _is_parquet(sources[0]):
        log = DuckDbEventLog(sources[0], sandbox=True, use_materialized=materialized)
        if stale is not None:
            stale.extend(log.stale_views)
        return log.con
    db_files: list[str] = []
    parquet: list[list[str]] = []
    for src in sources:
        if _is_parquet(src):
            parquet.append(expand_parquet(src))
        else:
            if not os.path.exists(src):
                raise EventLogError(f"no event log at {src}")
            db_files.append(os.path.abspath(src))
    con = _connect_or_explain(lambda _: connect_sources(db_files, [f for fs in parquet for f in fs]),
                              ", ".join(db_files))
    parts = [_source_events(con, i, path) for i, path in enumerate(db_files)]
    for files in parquet:
        listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
        parts.append(f"SELECT seq, ts, type, src, subject, payload::JSON AS payload FROM read_parquet([{listed}])")
    con.execute("CREATE TEMP VIEW events AS " + " UNION ALL ".join(parts))
    create_views(con, temp=True)
    return con


def _source_events(con, i: int, path: str) -> str:
    """The ``events`` relation of attached source ``src<i>``, by its format (this version's SQL)."""
    qual = f"src{i}.main."
    try:
        row = con.execute(f"SELECT value FROM {qual}log_meta WHERE key = 'format'").fetchall()
    except duckdb.Error as exc:
        con.close()
        raise EventLogError(f"{path} is not an event log: {_first_line(exc)}") from exc
    fmt = row[0][0] if row else "1"
    if fmt not in FORMATS:
        con.close()
        raise EventLogError(f"{path} is an event log of format {fmt}; this version reads formats "
                            f"{', '.join(FORMATS)} (upgrade evolving-infra to read it)")
    return f"SELECT * FROM {qual}events" if fmt == "1" else events_view_sql(qual, fmt)


def _connect_or_explain(connect, path: str):
    """``connect(path)``; DuckDB's lock conflict becomes an :class:`EventLogError` that says
    what to do (the recorder of a running stack holds the file)."""
    try:
        return connect(path)
    except duckdb.Error as exc:
        if isinstance(exc, duckdb.IOException) and "could not set lock" in str(exc).lower():
            raise EventLogLocked(
                f"{path} is held by a running writer (the recorder of a live run); "
                "query it with `evolving sql --live`, or after the run stopped") from exc
        raise EventLogError(f"{path} is not a readable event log: {_first_line(exc)}") from exc


_COPY_FILE = "import shutil, sys; shutil.copyfile(sys.argv[1], sys.argv[2])"


def _check_file(path: str) -> None:
    """The plain reasons a file cannot be an event log, said before DuckDB says them worse."""
    if not os.path.exists(path):
        raise EventLogError(f"no event log at {path}")
    if os.path.isdir(path):
        raise EventLogError(f"{path} is a directory, not an event log")
    with open(path, "rb") as fh:
        head = fh.read(16)
    if not head:
        raise EventLogError(f"{path} is empty (0 bytes), not an event log")
    # A DuckDB file opens with an 8-byte header checksum and then its magic ``DUCK``: the checksum
    # can start with gzip's two magic bytes (1 file in 65,536), so the magic decides first.
    if head[8:12] != b"DUCK" and head[:2] == b"\x1f\x8b":
        raise EventLogError(f"{path} is gzip-compressed: gunzip it first")


def _first_line(exc: BaseException) -> str:
    """DuckDB's message on one line, without the file name it repeats."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _is_parquet(source: str) -> bool:
    return source.endswith(".parquet") or "*" in source
