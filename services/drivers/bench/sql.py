"""``evolving bench sql LOG``: the documented SQL over a recorded log, timed through the views,
beside its bound: the same query over each named view materialised as a plain table in the same
process (what DuckDB itself needs for the query once the rows exist; a view can approach it,
never beat it by much). Queries: ``count(*)`` of every named view and every ``sql`` block of
docs/recorder.md (where the repository's docs are beside the code). Each is timed ``repeats``
times; the median is reported.

Not a pure core: it opens files and reads the clock.
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

from services.adapters.eventlog import open_sources
from services.adapters.eventlog.views import NAMED_VIEWS

DOC = Path(__file__).resolve().parents[3] / "docs" / "recorder.md"


def documented_queries(doc: Path = DOC) -> list[tuple[str, str]]:
    """``(name, sql)``: a count of each named view, then the example queries of the docs."""
    out = [(f"count {v}", f"SELECT count(*) FROM {v}") for v in NAMED_VIEWS]
    if doc.exists():
        blocks = re.findall(r"```sql\n(.*?)```", doc.read_text(), flags=re.DOTALL)
        out += [(f"docs #{i + 1}", b.strip()) for i, b in enumerate(blocks)]
    return out


def _median_s(con, sql: str, repeats: int) -> tuple[float, int]:
    times, rows = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        rows = len(con.sql(sql).fetchall())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), rows


def run(sources: list[str], repeats: int = 3, bound: bool = True) -> dict:
    queries = documented_queries()
    views = open_sources(sources)
    tables = None
    try:
        events = views.sql("SELECT count(*) FROM events").fetchall()[0][0]
        if bound:  # the rows as plain tables, made before any clock starts
            tables = open_sources(sources)
            for v in NAMED_VIEWS:
                tables.execute(f"CREATE TEMP TABLE {v}_t AS SELECT * FROM {v}")
        out = []
        for name, sql in queries:
            view_s, rows = _median_s(views, sql, repeats)
            row = {"query": name, "sql": sql, "rows": rows, "view_s": view_s}
            if tables is not None:
                table_s, _ = _median_s(tables, re.sub(r"\b(" + "|".join(NAMED_VIEWS) + r")\b", r"\1_t", sql), repeats)
                row.update(table_s=table_s, view_over_table=view_s / table_s if table_s > 0 else None)
            out.append(row)
    finally:
        views.close()
        if tables is not None:
            tables.close()
    return {"log": sources, "events": events, "repeats": repeats, "queries": out,
            "max_view_s": max(r["view_s"] for r in out)}


def format_report(result: dict) -> str:
    lines = [(f"documented SQL over {', '.join(result['log'])} ({result['events']:,} events; median of "
             f"{result['repeats']}):"), f"  {'query':<24} {'rows':>7} {'view':>9} {'table':>9} {'view/table':>10}"]
    for r in result["queries"]:
        table = f"{r['table_s']:8.3f}s" if "table_s" in r else f"{'-':>9}"
        ratio = f"{r['view_over_table']:9.1f}x" if r.get("view_over_table") else f"{'-':>10}"
        lines.append(f"  {r['query']:<24} {r['rows']:>7} {r['view_s']:8.3f}s {table} {ratio}")
    lines.append(f"  slowest through the views: {result['max_view_s']:.3f} s")
    return "\n".join(lines)
