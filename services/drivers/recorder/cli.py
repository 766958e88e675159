"""``evolving sql``, ``evolving verify`` and ``evolving bench recorder``."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
import time
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table
from rich.text import Text

from events.codec import CodecError
from services.adapters.bus.options import bus_auth
from services.adapters.bus.security import CredentialsError, add_cli_options
from services.drivers.recorder.verify import verify_log


def register(sub, bench) -> None:
    p = sub.add_parser("sql", help="run SQL on a recorded run, read-only and sandboxed (docs/recorder.md)")
    p.add_argument("db", help="the run's DuckDB file, or Parquet segments (a file or a quoted glob)")
    p.add_argument("query", nargs="?", help='SQL, e.g. "SELECT * FROM role_switches" (optional with --refresh)')
    p.add_argument("--with", dest="more", action="append", default=[], metavar="SOURCE",
                   help="another DuckDB file or Parquet segment(s) of the same run (repeatable)")
    p.add_argument("--format", dest="fmt", choices=("table", "csv", "json"), default="table",
                   help="table (default; values printed in full, never cut), csv (header row), json (JSON lines)")
    p.add_argument("--json", dest="fmt", action="store_const", const="json", help="same as --format json")
    p.add_argument("--max-rows", type=int, default=200, help="rows shown in the table (default 200; csv/json: all)")
    p.add_argument("--live", action="store_true",
                   help="the run is still going: ask its recorder for a consistent read-only snapshot and query that "
                        "(a finished run is read directly)")
    p.add_argument("--nats-url", default=None,
                   help="--live: the bus (default: what the recorder wrote in DB.live.json, else $EI_NATS_URL)")
    p.add_argument("--partition", default=None, help="--live: the partition (default: from DB.live.json)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="--live: wait this long for the snapshot")
    p.add_argument("--refresh", action="store_true",
                   help="first store again the log's stale mat_* tables (the named views' rows, as a writer's close "
                        "does): the one time this command writes to DB; then run QUERY, if given")
    add_cli_options(p)  # --live on a secured bus (default: RUN_DIR/credentials/operator.json of `evolving up`)
    p.set_defaults(func=cmd_sql)
    p.__class__ = _OptionsAnywhere  # `sql DB --json QUERY` with QUERY optional (--refresh alone)

    p = sub.add_parser("verify", help="replay a recorded run through fresh cores; check every decision")
    p.add_argument("db", help="the run's DuckDB file")
    p.add_argument("--cores", default=None,
                   help="comma-separated core names (default: run_config 'cores', else directory,planner,router)")
    p.add_argument("--keep-going", action="store_true", help="count every divergence, not only the first")
    p.add_argument("--strict", action="store_true", help="also fail on predictions the log ends before")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)

    p = bench.add_parser("recorder", help="events/s appended to DuckDB vs NDJSON+read_json and executemany")
    p.add_argument("--requests", type=int, default=2000, help="requests in the mix (~12 events each)")
    p.add_argument("--blocks", type=int, default=1000, help="block hashes per RequestSubmitted")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_bench)


class _OptionsAnywhere(argparse.ArgumentParser):
    """Positionals before, between and after options: an optional positional (``QUERY``) after
    an option is otherwise refused by argparse, which takes the positionals of a run at once."""

    _inner = False

    def parse_known_args(self, args=None, namespace=None):
        if self._inner:  # parse_known_intermixed_args calls back here
            return super().parse_known_args(args, namespace)
        self._inner = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inner = False


def _jsonable(v: Any) -> Any:
    if isinstance(v, float | int | str | bool) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    return str(v)


def _cell(v: Any) -> str:
    """A value as text, in full: NULL, JSON for nested values, ``str`` otherwise."""
    if v is None:
        return "NULL"
    if isinstance(v, dict | list | tuple):
        return json.dumps(_jsonable(v))
    return str(v)


def cmd_sql(args) -> int:
    import duckdb  # lazy: evolving --help +40 ms (duckdb)

    from services.adapters.eventlog import (  # lazy: evolving --help +70 ms (duckdb)
        EventLogError,
        EventLogLocked,
        open_sources,
    )
    from services.adapters.eventlog.sandbox import (  # lazy: evolving --help +70 ms (duckdb)
        QueryRefused,
        check_query,
    )

    query = args.query
    if args.refresh:
        rc = _refresh(args)
        if rc or query is None:
            return rc
    elif query is None:
        print("error: no query (give one, or --refresh to store the log's stale tables)", file=sys.stderr)
        return 2
    try:
        check_query(query)
    except QueryRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sources = [args.db, *args.more]
    stale: list[str] = []
    try:
        try:
            con = open_sources(sources, stale=stale)
        except EventLogLocked:
            if not args.live:
                raise
            from services.drivers.recorder.live import (  # lazy: evolving --help +300 ms (nats)
                LiveError,
                request_snapshot,
            )

            try:
                try:
                    creds = bus_auth(args).credentials()
                except CredentialsError as exc:
                    raise LiveError(str(exc)) from exc
                snap = request_snapshot(args.db, nats_url=args.nats_url, partition=args.partition,
                                        timeout_s=args.timeout_s, credentials=creds)
            except LiveError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 2
            print(f"live snapshot of {args.db} up to seq {snap.applied_seq} ({snap.file}, "
                  f"taken {snap.age_s:.1f} s ago)", file=sys.stderr)
            stale = []  # a snapshot of a running log: its writer stores the tables when it stops
            con = open_sources([snap.path, *args.more])
    except (EventLogError, duckdb.Error) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    if not args.more and not args.db.endswith(".parquet") and _holds_no_events(con):
        print(f"note: {args.db} holds no events (a copy taken without its .wal while the run was going? "
              "query the running stack with --live)", file=sys.stderr)
    reads = [v for v in stale if re.search(rf"\b{v}\b", query, flags=re.IGNORECASE)]
    if reads:  # one line, on stderr, where it matters: the query reads a view that is computed
        print(f"note: {args.db}: the stored table of {', '.join(reads)} is not current (written by another "
              "version of the views, or by a writer that stopped before storing it): answered from the "
              f"events, slower; `evolving sql --refresh {args.db}` stores it again", file=sys.stderr)
    t0 = time.monotonic()
    try:
        rel = con.sql(query)
        if rel is None:  # a statement without a result
            return 0
        cols, rows = rel.columns, rel.fetchall()
    except duckdb.PermissionException as exc:  # the sandbox's first line of defence
        print(f"error: refused by the sandbox: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    except duckdb.Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        con.close()
    elapsed = time.monotonic() - t0
    if elapsed > 2.0:  # a slow query says so (on stderr: the output stays the result alone)
        print(f"query took {elapsed:.1f} s ({len(rows)} row(s))", file=sys.stderr)
    try:
        _write_rows(args, cols, rows)
    except BrokenPipeError:
        # the reader left (`evolving sql ... | head`): what it wanted it has; no traceback, and no
        # second error when Python flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _refresh(args) -> int:
    """``--refresh``: the log's stale ``mat_*`` tables stored again (one DuckDB file)."""
    import duckdb  # lazy: evolving --help +40 ms (duckdb)

    from services.adapters.eventlog import (  # lazy: evolving --help +70 ms (duckdb)
        EventLogError,
        EventLogLocked,
        refresh_tables,
    )

    if args.more or args.live or args.db.endswith(".parquet") or "*" in args.db:
        print("error: --refresh takes one DuckDB event log (no --with, --live or Parquet)", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        stored = refresh_tables(args.db)
    except EventLogLocked:
        print(f"error: {args.db} is held by a running writer: its close stores the tables", file=sys.stderr)
        return 2
    except (EventLogError, duckdb.Error) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    done = f"stored {', '.join(stored)}" if stored else "every table was current"
    print(f"{args.db}: {done} ({time.monotonic() - t0:.1f} s)", file=sys.stderr)
    return 0


def _write_rows(args, cols: list[str], rows: list[tuple]) -> None:
    if args.fmt == "json":
        for row in rows:
            print(json.dumps({c: _jsonable(v) for c, v in zip(cols, row)}))
    elif args.fmt == "csv":
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(cols)
        for row in rows:
            w.writerow("" if v is None else _cell(v) for v in row)
    else:
        print_table(cols, rows, args.max_rows)
    sys.stdout.flush()


def _holds_no_events(con) -> bool:
    import duckdb  # lazy: evolving --help +40 ms (duckdb)

    try:
        row = con.execute("SELECT value FROM log_meta WHERE key = 'applied_seq'").fetchall()
    except duckdb.Error:
        return False
    return bool(row) and row[0][0] == "0"


def print_table(cols: list[str], rows: list[tuple], max_rows: int) -> None:
    """A rich table that never cuts a value: in a terminal long values wrap inside their
    column; piped or redirected, each row stays on one line (the table takes its natural width)."""
    shown = rows[:max_rows]
    table = Table()
    for c in cols:
        table.add_column(Text(c), overflow="fold")
    for row in shown:
        table.add_row(*(Text(_cell(v)) for v in row))  # Text: a '[x]' in a value is not markup
    console = _Console()
    if not console.is_terminal:
        console = _Console(width=max(80, Console(width=1 << 20).measure(table).maximum))
    console.print(table)
    console.print(Text(f"{len(rows)} row(s)" + (f", first {max_rows} shown" if len(rows) > max_rows else "")))


class _Console(Console):
    def on_broken_pipe(self) -> None:
        raise BrokenPipeError  # rich would exit 1; the caller ends quietly, as for csv and json


#: ``evolving verify``'s exit statuses (docs/recorder.md, "evolving verify")
VERIFY_OK, VERIFY_DIVERGED, VERIFY_UNREADABLE, VERIFY_INCOMPLETE = 0, 1, 2, 3


def cmd_verify(args) -> int:
    """Exit 0: every decision reproduced; 1: diverged; 2: the log or the cores could not be
    read or built (one line on stderr: an empty, junk, truncated or corrupt file lands here);
    3: the log is incomplete - rows missing from its seqs (deleted) or rows that do not decode,
    each named - whatever the decisions (a divergence after a gap is no news)."""
    import duckdb  # lazy: evolving --help +40 ms (duckdb)

    from services.adapters.eventlog import (  # lazy: evolving --help +70 ms (duckdb)
        DuckDbEventLog,
        EventLogError,
    )

    try:
        log = DuckDbEventLog(args.db, read_only=True, sandbox=True)
    except EventLogError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.cores.split(",") if n.strip()] if args.cores else None
    try:
        if log.last_seq() == 0:
            print(f"error: {args.db} holds no events (a copy taken without its .wal while the run was going? "
                  "copy it after the run stopped, or query the live run with `evolving sql --live`)", file=sys.stderr)
            return 2
        level = log.run_config().get("log_level", "full")
        if level != "full":  # --log-level decisions dropped the KV facts the cores fold
            print(f"error: {args.db} was recorded with --log-level {level} (no KV facts, ticks or heartbeats): "
                  "verify replays full logs only (--log-level full, the default)", file=sys.stderr)
            return 2
        report = verify_log(log, names, keep_going=args.keep_going, strict=args.strict)
    except CodecError as exc:
        print(f"error: unreadable log: {_one_line(exc)}", file=sys.stderr)
        return 2
    except (duckdb.Error, msgspec.DecodeError) as exc:  # corrupt blocks met while reading
        print(f"error: {args.db} is not a readable event log: {_one_line(exc)}", file=sys.stderr)
        return 2
    except (KeyError, ImportError, LookupError, ValueError, TypeError) as exc:
        print(f"error: cannot build the cores: {_one_line(exc)}", file=sys.stderr)
        return 2
    finally:
        log.close()
    out = report.to_dict()
    if args.json:
        print(json.dumps(out))
    else:
        print_report(out)
    if not report.complete:
        return VERIFY_INCOMPLETE
    return VERIFY_OK if report.ok else VERIFY_DIVERGED


def _one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


#: lines of refusals, gaps and undecodable rows printed (--json lists up to verify.LISTED)
SHOWN = 20


def _ranges(ranges: list, limit: int = SHOWN) -> str:
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges[:limit])
    return text + (f", ... ({len(ranges) - limit} more ranges)" if len(ranges) > limit else "")


def print_report(out: dict) -> None:
    reproduced = ", ".join(f"{k}={v}" for k, v in out["reproduced"].items()) or "none"
    refused = out.get("refused", 0)
    print(f"folded {out.get('folded', out['events'])} events" + (f", refused {refused}" if refused else "")
          + f"; reproduced decisions: {reproduced}")
    if refused:
        print(f"refused by the event authority (events/authority.py; not folded, not compared, as the live "
              f"services do): {refused}")
        for r in out["refusals"][:SHOWN]:
            print(f"  seq {r['seq']} on {r['subject'] or '(no subject)'}: {r['type']}: {r['reason']}")
        if refused > SHOWN:
            print(f"  ... and {refused - SHOWN} more (--json lists the first {len(out['refusals'])})")
    if out.get("skipped"):
        print(f"not handed to the recorder: {out['skipped']} seq(s), {_ranges(out['skipped_ranges'])} (messages it "
              "could not decode and dead-lettered, or that left the stream before it read them)")
    if out.get("start_unknown"):
        a, b = out["start_unknown"]
        print(f"the log begins at seq {b + 1}: it was written before logs noted where they begin (seqs {a}-{b} "
              "not checked)")
    if out["not_recorded"]:
        print(f"{out['not_recorded']} predicted decision(s) not in the log (the run ended before them)")
    if out.get("missing"):
        why = ("deleted from the log after they were recorded" if out["skipped_noted"] else
               "deleted, or messages the recorder did not get: this log was written before it noted those")
        print(f"GAP: {out['missing']} seq(s) missing from the log (applied position {out['applied_seq']}): "
              f"seqs {_ranges(out['gaps'])} ({why})")
    if out.get("undecodable"):
        print(f"UNREADABLE: {out['undecodable']} row(s) do not decode (not folded):")
        for b in out["undecodable_rows"][:SHOWN]:
            print(f"  seq {b['seq']} on {b['subject']}: {b['reason']}")
        if out["undecodable"] > SHOWN:
            print(f"  ... and {out['undecodable'] - SHOWN} more")
    first = out["first_divergence"]
    incomplete = not out.get("complete", True)
    if incomplete:
        print("INCOMPLETE: the log lacks the rows named above; decisions were checked over the rest"
              + ("" if first else " and all were reproduced"))
    if first is None:
        if not incomplete:
            print("OK: every recorded decision was reproduced exactly")
        return
    print(f"DIVERGED ({out['divergences']} divergence(s)); first at seq {first['seq']}, "
          f"core {first['core']}: {first['kind']}" + (f" ({first['detail']})" if first["detail"] else ""))
    if first["predicted_after_seq"]:
        print(f"  the fresh core predicted it after folding seq {first['predicted_after_seq']}")
    print(f"  recorded:  {json.dumps(first['recorded'], sort_keys=True)}")
    print(f"  predicted: {json.dumps(first['predicted'], sort_keys=True)}")


def cmd_bench(args) -> int:
    from services.drivers.recorder import bench  # lazy: evolving --help +60 ms (duckdb)

    res = bench.run(n_requests=args.requests, blocks_per_request=args.blocks)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{res['events']} events ({res['payload_mb']} MB of JSON, {args.blocks} blocks per RequestSubmitted), "
          f"batches of {res['batch']}")
    print(f"  DuckDbEventLog.append      {res['eventlog_events_per_s']:>10,} events/s  "
          f"({res['eventlog_mb_per_s']} MB/s of JSON; file {res['eventlog_bytes'] / 1e6:.1f} MB)")
    print(f"  format 1 (before)          {res['eventlog_v1_events_per_s']:>10,} events/s  "
          f"(ours {res['ratio_vs_v1']}x; file {res['eventlog_v1_bytes'] / 1e6:.1f} MB)")
    print(f"  NDJSON + read_json         {res['ndjson_read_json_events_per_s']:>10,} events/s  "
          f"(ours {res['ratio_vs_ndjson']}x)")
    print(f"  executemany ({res['executemany_sample']} rows)     {res['executemany_events_per_s']:>10,} events/s  "
          f"(ours {res['ratio_vs_executemany']}x)")
    print(f"  read back + decode         {res['read_decode_events_per_s']:>10,} events/s")
    return 0
