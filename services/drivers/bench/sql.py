"""``evolving bench sql LOG``: the documented SQL over a recorded log, timed through the views,
beside its bound: the same query over each named view materialised as a plain table in the same
process (what DuckDB itself needs for the query once the rows exist; a view can approach it,
never beat it by much). Queries: ``count(*)`` of every named view and every ``sql`` block of
docs/recorder.md (where the repository's docs are beside the code). Each is timed ``repeats``
times; the median is reported.

A log's named views are answered one of two ways (docs/recorder.md, "Materialised views"): from
the ``mat_*`` tables its writer stored at close, while they are current, or computed from the
events. The report says which; ``computed=True`` times the computed path too (what a reader of a
log whose tables are stale, or of several sources, gets).

Named cases (``--case``): a log the issue's targets are stated on, its place, the command that
writes it and the target per query (:data:`CASES`).

Not a pure core: it opens files, runs the simulator and reads the clock.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from services.adapters.eventlog import DuckDbEventLog, EventLogError, open_sources, refresh_tables
from services.adapters.eventlog.views import NAMED_VIEWS

DOC = Path(__file__).resolve().parents[3] / "docs" / "recorder.md"


@dataclass(frozen=True)
class Case:
    """A log the SQL targets are stated on (docs/recorder.md)."""

    log: str  #: where the log is kept, relative to the working directory
    make: tuple[str, ...] | None  #: `evolving` arguments that write it ({log}: its path); None: ``hint``
    hint: str  #: what the log is, how it is made
    target_s: float  #: every documented query answers within this, through the views


CASES: dict[str, Case] = {
    "demo": Case("runs/demo/evolving.duckdb", None,
                 "the README demo's log of the evolving stack: bash scripts/demo.sh writes it", 1.0),
    # the paper's deployment density (2 agents per node: docs/simulator.md, one partition of the
    # 768-node run); the demo's 14 per node does not fit a 23 GB machine for an hour at 96 nodes
    "hour-96": Case("runs/bench-sql/hour-96.duckdb",
                    ("replay", "--trace", "deploy/traces/calibration", "--nodes", "96", "--agents", "192",
                     "--warmup", "10m", "--duration", "60m", "--no-progress", "--out", "{log}"),
                    "70 simulated minutes (10 warm-up + 60) of 96 nodes, 192 agents replaying the bundled "
                    "sessions; written once (~70 CPU-s, 4.3 GB peak), kept for the next run", 10.0),
}


class CaseError(Exception):
    """A case's log is missing and this command cannot make it."""


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


def answered_from(con) -> str:
    """``materialized`` when the session's named views read the ``mat_*`` tables, else ``computed``."""
    rows = con.sql("SELECT sql FROM duckdb_views() WHERE view_name = 'requests' AND temporary").fetchall()
    return "materialized" if any("mat_requests" in sql for (sql,) in rows) else "computed"


def run(sources: list[str], repeats: int = 3, bound: bool = True, computed: bool = False) -> dict:
    queries = documented_queries()
    views = open_sources(sources)
    tables = other = None
    try:
        events = views.sql("SELECT count(*) FROM events").fetchall()[0][0]
        path = answered_from(views)
        if computed and path == "materialized":
            other = open_sources(sources, materialized=False)
        if bound:  # the rows as plain tables, made before any clock starts
            tables = open_sources(sources)
            for v in NAMED_VIEWS:
                tables.execute(f"CREATE TEMP TABLE {v}_t AS SELECT * FROM {v}")
        out = []
        for name, sql in queries:
            view_s, rows = _median_s(views, sql, repeats)
            row = {"query": name, "sql": sql, "rows": rows, "view_s": view_s}
            if computed:
                row["computed_s"] = _median_s(other, sql, repeats)[0] if other is not None else view_s
            if tables is not None:
                table_s, _ = _median_s(tables, re.sub(r"\b(" + "|".join(NAMED_VIEWS) + r")\b", r"\1_t", sql), repeats)
                row.update(table_s=table_s, view_over_table=view_s / table_s if table_s > 0 else None)
            out.append(row)
    finally:
        for con in (views, other, tables):
            if con is not None:
                con.close()
    result = {"log": sources, "events": events, "repeats": repeats, "answered_from": path, "queries": out,
              "max_view_s": max(r["view_s"] for r in out)}
    if computed:
        result["max_computed_s"] = max(r["computed_s"] for r in out)
    return result


def run_case(name: str, log: str | None = None, repeats: int = 3, bound: bool = True) -> dict:
    """Time a named case: its log made first where missing (``make``), its stale ``mat_*`` tables
    stored again (``evolving sql --refresh``: a log written by another version of a view), then
    both paths, against the case's target."""
    case = CASES[name]
    path = log or case.log
    made_s = materialized_s = None
    refreshed: tuple[str, ...] = ()
    if not os.path.exists(path):
        if case.make is None:
            raise CaseError(f"case {name}: no log at {path} ({case.hint})")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        cmd = [sys.executable, "-m", "services.drivers.cli", *(a.replace("{log}", path) for a in case.make)]
        print(f"case {name}: writing {path}: evolving {' '.join(cmd[3:])}", file=sys.stderr)
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        made_s = time.perf_counter() - t0
    reader = DuckDbEventLog(path, read_only=True)
    stale = reader.stale_views
    reader.close()
    if stale:
        t0 = time.perf_counter()
        try:
            refreshed = refresh_tables(path)
            materialized_s = time.perf_counter() - t0
        except (EventLogError, duckdb.Error) as exc:  # held by a live writer: the computed path is what readers get
            print(f"case {name}: mat_* tables stale and not stored again: {exc}", file=sys.stderr)
    result = run([path], repeats=repeats, bound=bound, computed=True)
    return {"case": name, "hint": case.hint, "target_s": case.target_s, "made_s": made_s,
            "materialized_s": materialized_s, "refreshed": list(refreshed), "met": result["max_view_s"] <= case.target_s,
            "computed_met": result["max_computed_s"] <= case.target_s, **result}


def format_report(result: dict) -> str:
    lines = [(f"documented SQL over {', '.join(result['log'])} ({result['events']:,} events; median of "
             f"{result['repeats']}); the named views answered from "
             f"{'the mat_* tables' if result['answered_from'] == 'materialized' else 'the events (computed)'}:")]
    computed = "max_computed_s" in result
    lines.append(f"  {'query':<24} {'rows':>7} {'view':>9}" + (f" {'computed':>9}" if computed else "")
                 + f" {'table':>9} {'view/table':>10}")
    for r in result["queries"]:
        table = f"{r['table_s']:8.3f}s" if "table_s" in r else f"{'-':>9}"
        ratio = f"{r['view_over_table']:9.1f}x" if r.get("view_over_table") else f"{'-':>10}"
        comp = f" {r['computed_s']:8.3f}s" if computed else ""
        lines.append(f"  {r['query']:<24} {r['rows']:>7} {r['view_s']:8.3f}s{comp} {table} {ratio}")
    lines.append(f"  slowest through the views: {result['max_view_s']:.3f} s"
                 + (f"; computed from the events: {result['max_computed_s']:.3f} s" if computed else ""))
    if "case" in result:
        made = "" if result["made_s"] is None else f"; log written in {result['made_s']:.0f} s"
        mat = "" if result["materialized_s"] is None else (
            f"; stale tables stored again ({', '.join(result['refreshed'])}) in {result['materialized_s']:.1f} s")
        lines.append(f"  case {result['case']}: target <= {result['target_s']:g} s per query: "
                     f"{'met' if result['met'] else 'NOT met'} "
                     f"(computed path: {'met' if result['computed_met'] else 'not met'}){made}{mat}")
    return "\n".join(lines)
