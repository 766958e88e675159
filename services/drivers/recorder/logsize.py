"""A log's size per storage format: its events appended again to a fresh file of each format.

``python -m services.drivers.recorder.logsize RUN.duckdb [--formats 1,2,3] [--columns] [--json]``

The events of ``RUN.duckdb`` (any format) are appended in batches of ``--batch`` rows (20,000:
what the simulator's ``SimLog`` hands its writer) to a fresh unbounded log of each format in a
temporary folder; per format: bytes, bytes per simulated hour (the events' ``ts`` span), write
time, and with ``--columns`` the bytes of each stored column (``pragma_storage_info``; a block's
last segment counted to the block's end, so an upper bound). Same events, so the difference is
the format's alone (docs/recorder.md, "Format 3").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from services.adapters.eventlog import DuckDbEventLog

_COLUMNS_SQL = """
WITH s AS (SELECT column_name, block_id, block_offset FROM pragma_storage_info('{table}')
           WHERE persistent AND block_id >= 0),
     o AS (SELECT column_name, coalesce(lead(block_offset) OVER (PARTITION BY block_id ORDER BY block_offset),
                                        {block}) - block_offset AS sz FROM s)
SELECT column_name, sum(sz)::BIGINT FROM o GROUP BY ALL ORDER BY 2 DESC"""


def columns(con, table: str) -> dict[str, int]:
    """Bytes of each column of ``table`` (upper bound: see the module's doc)."""
    (block,) = con.execute("SELECT block_size FROM pragma_database_size()").fetchone()
    return {name: int(n) for name, n in con.execute(_COLUMNS_SQL.format(table=table, block=int(block))).fetchall()}


def run(source: str, formats: tuple[str, ...] = ("2", "3"), batch: int = 20_000, with_columns: bool = False,
        keep: str | None = None) -> dict[str, Any]:
    src = DuckDbEventLog(source, read_only=True)
    rows = list(src.read())
    src.close()
    if not rows:
        raise SystemExit(f"error: {source} holds no events")
    ts = [e.ts for _, _, e in rows]
    span = max(ts) - min(min(ts), 0.0)
    out: dict[str, Any] = {"source": source, "events": len(rows), "simulated_s": round(span, 1), "formats": {}}
    with tempfile.TemporaryDirectory(prefix="ei-logsize-") as tmp:
        for fmt in formats:
            path = os.path.join(keep or tmp, f"format{fmt}.duckdb")
            for f in (path, path + ".wal"):
                if os.path.exists(f):
                    os.remove(f)
            t0 = time.perf_counter()
            log = DuckDbEventLog(path, format=fmt)
            for k in range(0, len(rows), batch):
                log.append(rows[k:k + batch])
            log.close()
            r: dict[str, Any] = {"bytes": os.path.getsize(path), "write_s": round(time.perf_counter() - t0, 2)}
            if span > 0:
                r["bytes_per_sim_hour"] = round(r["bytes"] * 3600 / span)
            if with_columns:
                ro = DuckDbEventLog(path, read_only=True)
                tables = ("events",) if fmt == "1" else ("event_rows", "block_dict")
                r["columns"] = {t: columns(ro.con, t) for t in tables}
                ro.close()
            out["formats"][fmt] = r
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.drivers.recorder.logsize", description=__doc__.split("\n")[0])
    p.add_argument("source", help="an event log (e.g. `evolving replay --out RUN.duckdb`)")
    p.add_argument("--formats", default="2,3", help="comma-separated: 1, 2, 3 (default 2,3)")
    p.add_argument("--batch", type=int, default=20_000)
    p.add_argument("--columns", action="store_true", help="bytes per stored column")
    p.add_argument("--keep", default=None, metavar="DIR", help="write the files here and keep them")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    r = run(a.source, tuple(x.strip() for x in a.formats.split(",") if x.strip()), a.batch, a.columns, a.keep)
    if a.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['source']}: {r['events']:,} events, {r['simulated_s']:.0f} s simulated")
    for fmt, f in r["formats"].items():
        per_h = f" = {f['bytes_per_sim_hour'] / 1e6:.1f} MB per simulated hour" if "bytes_per_sim_hour" in f else ""
        print(f"format {fmt}: {f['bytes'] / 1e6:.2f} MB{per_h} (written in {f['write_s']} s)")
        for table, cols in f.get("columns", {}).items():
            print(f"  {table}: " + ", ".join(f"{c} {n / 1e6:.2f} MB" for c, n in cols.items() if n >= 5_000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
