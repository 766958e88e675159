"""``evolving chaos``: the command (``register`` adds it to the ``evolving`` parser)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


def _cmd(args) -> int:
    from services.drivers.chaos.report import render  # lazy: evolving --help +300 ms (nats: the suite)
    from services.drivers.chaos.scenarios import scenarios  # lazy: evolving --help +300 ms (nats: the suite)
    from services.drivers.chaos.suite import run_chaos, select  # lazy: evolving --help +360 ms (nats, duckdb)

    err = Console(stderr=True)
    # SIGTERM stops the run like Ctrl-C: the finally blocks stop every child (nothing left behind)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    # nats-py logs every refused reconnect with a traceback: expected while a server is down
    logging.getLogger("nats").setLevel(logging.CRITICAL)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    try:
        n = len(select(scenarios(), quick=args.quick, only=only, engines=args.engines)) + 3
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TimeElapsedColumn(), console=err, transient=True) as progress:
            task = progress.add_task("chaos", total=n)

            def step(name: str) -> None:
                progress.update(task, description=f"chaos: {name}", advance=0 if name == "starting the stack" else 1)

            report = asyncio.run(run_chaos(quick=args.quick, only=only, rate=args.rate, engines=args.engines,
                                           workdir=Path(args.workdir) if args.workdir else None, on_progress=step))
    except ValueError as exc:
        err.print(f"evolving chaos: {exc}")
        return 2
    except KeyboardInterrupt:  # the stack was stopped by run_chaos's finally
        err.print("evolving chaos: interrupted; the stack is stopped")
        return 130
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render(report)
    return 0 if report.ok else 1


def register(sub, bench) -> None:
    p = sub.add_parser("chaos", help="fault suite over a live stack under load: loss/duplicate/divergence table")
    p.add_argument("--quick", action="store_true", help="the short suite CI runs (about a minute)")
    p.add_argument("--only", default=None, metavar="NAME[,NAME]", help="run only these scenarios")
    p.add_argument("--rate", type=float, default=20.0, help="harness requests/s during the run")
    p.add_argument("--engines", action="store_true",
                   help="run a sim engine worker per node (engine.worker) instead of the load generator's nodes; "
                        "partition-engine then SIGSTOPs the worker")
    p.add_argument("--workdir", default=None, help="keep the services' logs and the DuckDB log here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd)


if __name__ == "__main__":  # pragma: no cover
    from services.drivers.cli import main

    sys.exit(main(["chaos", *sys.argv[1:]]))
