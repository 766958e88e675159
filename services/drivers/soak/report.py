"""The soak's output: the live progress display, the summary tables and the PNG plot."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from services.drivers.soak.run import Live


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


class Display:
    """A rich progress bar over the duration, with the counts and the last interval's figures."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(TextColumn("soak"), BarColumn(), TextColumn("{task.fields[phase]}"),
                                 TimeElapsedColumn(), console=console)
        self.task = self.progress.add_task("soak", total=1.0, phase="starting")

    def render(self, live: Live) -> Group:
        self.progress.update(self.task, completed=live.elapsed_s / live.duration_s if live.duration_s else 0,
                             phase=live.phase)
        t = Table.grid(padding=(0, 2))
        ld = live.load
        if ld is not None:
            ok = sum(o.ok for o in ld.outcomes)
            t.add_row("requests", f"sent {len(ld.outcomes) + len(ld.in_flight)}  answered {ok}  "
                                  f"failed {len(ld.outcomes) - ok}  in flight {len(ld.in_flight)}  "
                                  f"waiting for a stream {len(ld.backlog)}")
        if live.last:
            r = live.last
            t.add_row("last interval", f"TTFT p50/p99 {_ms(r['ttft_p50_s'])}/{_ms(r['ttft_p99_s'])} ms  "
                                       f"E2E p50/p99 {_ms(r['e2e_p50_s'])}/{_ms(r['e2e_p99_s'])} ms")
        if live.sampler is not None and live.sampler.series:
            rss, fds = live.sampler.totals()
            top = sorted(((s.rss_bytes[-1], n) for n, s in live.sampler.series.items() if n != "soak"),
                         reverse=True)[:3]
            t.add_row("stack", f"RSS {rss:.0f} MB  fds {fds}  (" +
                      ", ".join(f"{n} {r / 1e6:.0f} MB" for r, n in top) + ")")
        return Group(self.progress.get_renderable(), t)


def render(report: dict[str, Any], console: Console | None = None) -> None:
    """The summary: totals, the recorder check and verify, growth per process, the verdict."""
    c = console or Console()
    tot, cfg = report["totals"], report["config"]
    t = Table(title=f"evolving soak: {cfg['duration_s']:g} s at {cfg['rate']:g} req/s over {cfg['streams']} "
                    f"agent streams ({cfg['engines']} sim engines)")
    t.add_column("figure")
    t.add_column("value", justify="right")
    for k, label in (("sent", "requests sent"), ("answered", "answered"), ("failed", "failed"),
                     ("achieved_rate", "sent / s"), ("backlog_at_end", "arrivals still waiting at the end")):
        t.add_row(label, str(tot[k]))
    t.add_row("TTFT p50 / p99 (ms)", f"{_ms(tot['ttft_p50_s'])} / {_ms(tot['ttft_p99_s'])}")
    t.add_row("E2E p50 / p99 (ms)", f"{_ms(tot['e2e_p50_s'])} / {_ms(tot['e2e_p99_s'])}")
    t.add_row("wait for a stream p99 (ms)", _ms(tot["wait_p99_s"]))
    rec = report["recorded"]
    t.add_row("stream events to the load's end / recorded",
              f"{rec['stream_messages']} / {rec['recorded']} ({'ok' if rec['ok'] else 'MISSING ' + str(rec['missing'])})")
    t.add_row("dead letters", str(rec["dead_letters"]))
    req = report["requests_on_log"]
    t.add_row("requests on the log: submitted / decided once / finished ok",
              f"{req['submitted']} / {req['decided_once']} / {req['finished_ok']}")
    v = report.get("verify")
    if v is not None:
        rep = ", ".join(f"{k} {n}" for k, n in v["reproduced"].items())
        t.add_row("verify", f"{'OK' if v['ok'] else 'DIVERGED'}: {v['events']} events; {rep}")
    shares = {n: p["cpu_share"] for n, p in report["processes"].items() if p.get("cpu_share") is not None}
    if shares:
        stack = sum(v for n, v in shares.items() if n != "soak")
        top = ", ".join(f"{n} {v:.2f}" for n, v in sorted(shares.items(), key=lambda kv: -kv[1])[:4])
        t.add_row("CPU, cores busy (stack; top)", f"{stack:.2f}; {top}")
    if tot.get("machine_busy_cores") is not None:
        t.add_row("machine: cores busy, all / other work", f"{tot['machine_busy_cores']:.2f} / "
                  f"{tot['other_busy_cores']:.2f} of {tot['cores']}")
    if tot["errors"]:
        t.add_row("errors", ", ".join(f"{k} x{n}" for k, n in tot["errors"].items()))
    c.print(t)

    g = Table(title="growth over the second half (Theil-Sen slope; anon = anonymous RSS, MB)")
    for col in ("series", "first", "last", "slope", "limit", "verdict"):
        g.add_column(col, justify="left" if col == "series" else "right")
    procs = report["processes"]
    for f in report["flatness"]:
        first = last = "-"
        what, _, name = f["name"].partition(" ")
        if what in ("anon", "fds") and name in procs:
            ys = procs[name]["anon_mb" if what == "anon" else "fds"]
            first, last = (f"{ys[0]:g}", f"{ys[-1]:g}") if ys else ("-", "-")
        elif f.get("median") is not None:
            first = "-"
            last = f"median {f['median'] * 1e3:.0f} ms"
        verdict = ("flat" if f["ok"] else "GROWS") if f["judged"] else "not judged"
        g.add_row(f["name"], first, last, f"{f['slope']:.3g} {f['unit']}", f"{f['limit']:.3g}", verdict)
    c.print(g)
    if report["ok"]:
        c.print("[bold green]OK[/]: every request answered, every event recorded, verify passed, growth flat")
    else:
        c.print("[bold red]FAILED[/]:")
        for r in report["reasons"]:
            c.print(f"  - {r}", markup=False)


def plot(report: dict[str, Any], path: str) -> None:
    """Latency (p50/p99 TTFT and E2E per interval), RSS and open fds per process, and the
    requests answered per interval, against minutes since the load started."""
    import matplotlib  # lazy: optional heavy import (+300 ms), only with --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: same

    rows, procs, cfg = report["intervals"], report["processes"], report["config"]
    fig, ax = plt.subplots(4, 1, figsize=(10, 12), sharex=True)
    mins = [(r["start_s"] + cfg["interval_s"] / 2) / 60 for r in rows]
    for key, style in (("ttft_p50_s", "C0-"), ("ttft_p99_s", "C0:"), ("e2e_p50_s", "C1-"), ("e2e_p99_s", "C1:")):
        ys = [None if r[key] is None else r[key] * 1e3 for r in rows]
        ax[0].plot(mins, ys, style, label=key.removesuffix("_s").replace("_", " "))
    ax[0].set_ylabel("latency (ms)")
    ax[0].set_yscale("log")
    ax[0].legend(loc="upper left", ncol=4, fontsize=8)
    ax[0].set_title(f"evolving soak: {cfg['duration_s']:g} s at {cfg['rate']:g} req/s (Poisson), "
                    f"{cfg['streams']} agent streams, {cfg['engines']} sim engines")
    for i, (name, s) in enumerate(sorted(procs.items())):
        t = [x / 60 for x in s["t_s"]]
        style = "--" if name == "soak" else "-"
        a0 = s["anon_mb"][0] if s["anon_mb"] else 0.0
        ax[1].plot(t, [r - a0 for r in s["anon_mb"]], style, color=f"C{i % 10}",
                   label=f"{name} ({a0:.0f} of {s['rss_mb'][0] if s['rss_mb'] else 0:.0f} MB)")
        ax[2].plot(t, s["fds"], style, color=f"C{i % 10}", label=name)
    ax[1].set_ylabel("anonymous RSS growth\nsince the first sample (MB)")
    ax[1].legend(loc="upper left", ncol=4, fontsize=7)
    ax[2].set_ylabel("open file descriptors")
    ax[2].legend(loc="upper left", ncol=4, fontsize=7)
    ax[3].bar(mins, [r["answered"] for r in rows], width=cfg["interval_s"] / 60 * 0.9, label="answered")
    ax[3].bar(mins, [r["failed"] for r in rows], width=cfg["interval_s"] / 60 * 0.9, color="C3", label="failed")
    ax[3].set_ylabel(f"requests per {cfg['interval_s']:g} s")
    m = report.get("machine") or {}
    if m.get("t_s"):  # what else the machine ran: the soak shares its cores
        cpu = ax[3].twinx()
        mt = [x / 60 for x in m["t_s"]]
        cpu.plot(mt, m["stack_cores"], "k-", lw=1, label="cores busy: stack + client")
        cpu.plot(mt, m["other_cores"], "C3-", lw=1, label="cores busy: other work")
        cpu.set_ylabel("cores busy")
        cpu.set_ylim(bottom=0)
        cpu.legend(loc="upper right", fontsize=8)
    ax[3].set_xlabel("minutes since the load started")
    ax[3].legend(loc="upper left", fontsize=8)
    for a in ax:
        a.grid(alpha=0.3)
        a.axvline(cfg["duration_s"] / 120, color="grey", lw=0.8, ls="--")  # the judged second half starts
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
