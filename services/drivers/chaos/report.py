"""The chaos table and its notes (rich)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from services.drivers.chaos.accounting import ChaosReport


def render(report: ChaosReport, console=None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 110)  # a log file: no squeezed columns
    table = Table(title=f"evolving chaos{' --quick' if report.quick else ''}: {report.events} events, "
                        f"{report.requests} requests, {report.elapsed_s:.0f} s")
    for col in ("scenario", "survived", "lost", "duplicated", "diverged", "recover s"):
        table.add_column(col, justify="left" if col == "scenario" else "right", no_wrap=True)
    for r in report.results:
        table.add_row(r.name, "[green]yes[/]" if r.survived else "[red]no[/]",
                      _num(r.lost), _num(r.duplicated), _num(r.diverged),
                      "-" if r.recover_s is None else f"{r.recover_s:.2f}")
    console.print(table)
    v = report.verify
    console.print(f"verify (recorder's DuckDB log): {'ok' if v.get('ok') else 'FAILED'}, "
                  f"{v.get('events', 0)} events, reproduced {v.get('reproduced', {})}, "
                  f"divergences {v.get('divergences', v.get('error', '?'))}")
    console.print(f"publish retries: {report.publish_retries}; unplanned exits: "
                  f"{', '.join(report.unplanned_exits) or 'none'}; nodes removed for silence and registered "
                  f"again: {', '.join(report.rejoins) or 'none'}")
    for r in report.results:
        nonzero = ", ".join(f"{k}={v}" for k, v in r.counts.items() if v)
        console.print(f"  {r.name}: {r.fault}" + (f" - {r.detail}" if r.detail else "")
                      + (f" [red]({nonzero})[/]" if nonzero else ""))
    console.print("[green]all zero[/]" if report.ok else "[red]NOT all zero[/]")


def _num(n: int) -> str:
    return "0" if n == 0 else f"[red]{n}[/]"
