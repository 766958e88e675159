"""``evolving sql`` is a sandbox, not a shell: DuckDB sessions that can read the run and nothing else.

Two lines of defence (docs/recorder.md, "The SQL sandbox"):

1. **DuckDB's own configuration** does the enforcement. The database is opened read-only
   (``access_mode``: every later ``ATTACH`` is read-only too), ``enable_external_access=false``
   (no file system: ``read_text``/``read_csv``/``glob``, ``COPY ... TO``, ``EXPORT DATABASE``,
   ``ATTACH`` of another file, ``INSTALL``, loading extension files, secrets), autoload and
   autoinstall of extensions off, and ``lock_configuration=true`` last, so no ``SET``/``RESET``/
   ``PRAGMA`` can turn any of it back on. Parquet segments a session needs are named one by one
   in ``allowed_paths`` before the lock (globs are expanded here first).
2. **A statement check** (:func:`check_query`), parsed by DuckDB itself
   (``duckdb.extract_statements``), admits only queries: ``SELECT`` (``WITH``, ``FROM``,
   ``SHOW``, ``DESCRIBE``, ``SUMMARIZE``, ``PIVOT``), ``EXPLAIN``, ``CALL`` of table functions
   and the introspection ``PRAGMA`` s. It refuses ``ATTACH``/``DETACH``/``INSTALL``/``LOAD``/
   ``COPY``/``EXPORT``/``IMPORT``/``SET``/DDL/DML with one clear line before DuckDB runs anything.
   It is the second line: everything it refuses that could reach outside is refused by 1 too,
   except one case 1 cannot cover: a DuckDB source attached before the lock stays attachable
   by path after a ``DETACH`` (read-only still, since the instance is).
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from collections.abc import Sequence

import duckdb

from services.adapters.eventlog.port import EventLogError

SANDBOX_CONFIG: dict[str, str | bool] = {
    "enable_external_access": False,
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "allow_community_extensions": False,
    "allow_unsigned_extensions": False,
    "lock_configuration": True,
}
"""What :func:`connect_file` passes to ``duckdb.connect`` (with ``read_only=True``)."""

# Statement types (duckdb.StatementType names) a query session may run.
ALLOWED_STATEMENTS = frozenset({"SELECT", "EXPLAIN", "CALL", "MULTI"})
# PRAGMAs that only describe the session (the others change settings: locked anyway).
ALLOWED_PRAGMAS = frozenset({
    "show_tables", "show_tables_expanded", "table_info", "show", "database_list", "database_size",
    "storage_info", "version", "platform", "functions", "collations", "metadata_info", "user_agent",
})
_EXPLAIN = re.compile(r"^\s*explain\s+(analy[sz]e\s+)?", re.IGNORECASE)
_PRAGMA_NAME = re.compile(r"^\s*pragma\s+([a-z_][a-z0-9_]*)", re.IGNORECASE)


class QueryRefused(ValueError):
    """The query is not a read-only query over the run; ``str`` is one line saying why."""


def check_query(query: str) -> None:
    """Raise :class:`QueryRefused` unless every statement of ``query`` is a query.

    A syntax error is left to DuckDB (it names the position); only statements that parse are
    judged here."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.ParserException:
        return  # DuckDB reports it with its position when the query runs
    for st in statements:
        text = " ".join(st.query.split())
        short = text if len(text) <= 60 else text[:57] + "..."
        try:
            kind = st.type.name
        except ValueError as exc:  # a statement type this duckdb build cannot name
            raise QueryRefused(f"refused: {short!r}: evolving sql runs read-only queries only ({exc})") from exc
        if kind == "PRAGMA":
            m = _PRAGMA_NAME.match(st.query)
            if m and m.group(1).lower() in ALLOWED_PRAGMAS:
                continue
            raise QueryRefused(f"refused: {short!r}: evolving sql allows only the introspection PRAGMAs "
                               f"({', '.join(sorted(ALLOWED_PRAGMAS))}); settings are locked")
        if kind == "EXPLAIN":  # EXPLAIN ANALYZE runs what it explains: judge that
            inner = _EXPLAIN.sub("", st.query, count=1)
            if inner != st.query:
                check_query(inner)
                continue
        if kind not in ALLOWED_STATEMENTS:
            raise QueryRefused(f"refused: {short!r} is a {kind} statement; evolving sql runs read-only "
                               "queries only (SELECT/WITH/FROM, SHOW, DESCRIBE, SUMMARIZE, PIVOT, EXPLAIN, CALL)")


def connect_file(path: str):
    """One DuckDB file, read-only, sandboxed from the start."""
    return duckdb.connect(path, read_only=True, config=dict(SANDBOX_CONFIG))


def expand_parquet(source: str) -> list[str]:
    """The Parquet files of ``source`` (a file or a glob), absolute and sorted; an error if none."""
    if any(c in source for c in "*?["):
        files = sorted(os.path.abspath(f) for f in glob.glob(source))
        if not files:
            raise EventLogError(f"no Parquet file matches {source}")
        return files
    if not os.path.isfile(source):
        raise EventLogError(f"no Parquet file at {source}")
    return [os.path.abspath(source)]


def connect_sources(duckdb_files: Sequence[str], parquet_files: Sequence[str]):
    """A sandboxed session over several sources: the DuckDB files attached read-only as
    ``src0, src1, ...`` and the Parquet files readable (and nothing else).

    The session's own database is an empty scratch file opened read-only (an in-memory
    database cannot be read-only), so every ``ATTACH`` in it is read-only as well."""
    scratch_dir = tempfile.mkdtemp(prefix="evolving-sql-")
    scratch = os.path.join(scratch_dir, "session.duckdb")
    try:
        duckdb.connect(scratch).close()
        config = {k: v for k, v in SANDBOX_CONFIG.items() if k not in ("enable_external_access", "lock_configuration")}
        con = duckdb.connect(scratch, read_only=True, config=config)
    finally:  # the open connection keeps its file; nothing is left behind on disk
        for f in (scratch, scratch + ".wal"):
            if os.path.exists(f):
                os.remove(f)
        os.rmdir(scratch_dir)
    try:
        for i, path in enumerate(duckdb_files):
            quoted = path.replace("'", "''")
            con.execute(f"ATTACH '{quoted}' AS src{i} (READ_ONLY)")
        if parquet_files:
            con.execute("SET allowed_paths = ?", [list(parquet_files)])
        con.execute("SET enable_external_access = false")
        con.execute("SET lock_configuration = true")
    except BaseException:
        con.close()
        raise
    return con
