"""The chaos table and its notes (rich)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from services.drivers.chaos.accounting import ChaosReport


def render(report: ChaosReport, console=None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 110)  # a log file: no squeezed columns
    flags = (" --quick" if report.quick else "") + (
        f" --engines {report.engine_backend}".rstrip() if report.engines else "")
    table = Table(title=f"evolving chaos{flags}: {report.events} events, "
                        f"{report.requests} requests, {report.elapsed_s:.0f} s")
    cols = ["scenario", "survived", "lost", "hung", "duplicated", "diverged", "recover s"]
    if not report.engines:
        cols.remove("hung")  # the load generator's nodes run nothing: nothing can hang
    for col in cols:
        table.add_column(col, justify="left" if col == "scenario" else "right", no_wrap=True)
    for r in report.results:
        row = [r.name, "[green]yes[/]" if r.survived else "[red]no[/]", _num(r.lost), _num(r.hung),
               _num(r.duplicated), _num(r.diverged), "-" if r.recover_s is None else f"{r.recover_s:.2f}"]
        if not report.engines:
            del row[3]
        table.add_row(*row)
    console.print(table)
    v = report.verify
    console.print(f"verify (recorder's DuckDB log): {'ok' if v.get('ok') else 'FAILED'}, "
                  f"{v.get('events', 0)} events, reproduced {v.get('reproduced', {})}, "
                  f"divergences {v.get('divergences', v.get('error', '?'))}")
    console.print(f"publish retries: {report.publish_retries}; unplanned exits: "
                  f"{', '.join(report.unplanned_exits) or 'none'}; nodes removed for silence and registered "
                  f"again: {', '.join(report.rejoins) or 'none'}")
    if report.drain:
        console.print(f"final drain: {report.drain.get('s', '?')} s, {report.drain.get('ended', '?')}")
    for r in report.results:
        nonzero = ", ".join(f"{k}={v}" for k, v in r.counts.items() if v and k != "requests_failed")
        console.print(f"  {r.name}: {r.fault}" + (f" - {r.detail}" if r.detail else "")
                      + (f" [red]({nonzero})[/]" if nonzero else ""))
    console.print("[green]all zero[/]" if report.ok else "[red]NOT all zero[/]")


def _num(n: int) -> str:
    return "0" if n == 0 else f"[red]{n}[/]"
