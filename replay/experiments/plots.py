"""``evolving experiments``' report of one experiment: its table(s), PNG plots and JSON summary.

A ``table`` experiment prints ``replay.sim.report``'s side-by-side table (ratios against
the first row, Evolving Infra) and its plots; a ``sweep`` one a row per swept value and stack
with the ratios against Evolving Infra at the same value, and a throughput / P95 TTFT (or lost
KV reuse) plot against the swept value; a ``curve`` one (the objective) throughput against P95
TTFT. Plots use matplotlib's Agg backend (no display).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
from rich.table import Table

from replay.experiments.matrix import SLO_TTFT_P95_S, Experiment
from replay.experiments.run import Result, run_parser
from replay.sim.report import print_table, write_plots

matplotlib.use("Agg")  # no display (pyplot picks its backend at the first figure)


# --------------------------------------------------------------------------- reporting
def _ok(results: list[Result]) -> list[Result]:
    return [r for r in results if r.metrics is not None]


def report(exp: Experiment, results: list[Result], out_dir: Path, console, quick: bool) -> dict:
    """Print the experiment's table(s), write its plots; return its JSON summary."""
    first = run_parser().parse_args(exp.runs[0].argv) if exp.runs else None
    window = f"{first.duration / 60:g} min after a {first.warmup / 60:g} min warm-up" if first else "short runs"
    title = exp.title + (f" [QUICK: {window}, subset of rows" + (f"; {exp.quick_note}" if exp.quick_note else "")
                         + "]" if quick else "")
    console.rule(f"[bold]{exp.name}")
    console.print(f"[dim]paper: {exp.claim}")
    ok = _ok(results)
    d = out_dir / exp.name
    plots: list[Path] = []
    if exp.kind == "table" and ok:
        print_table([r.metrics for r in ok], title=title, console=console)
        first = exp.runs[0]
        cfg = run_parser().parse_args(first.argv)
        plots = write_plots([r.metrics for r in ok], d, cfg.warmup, cfg.warmup + cfg.duration, cfg.nodes)
    elif exp.kind == "sweep" and ok:
        t = Table(title=title)
        for col in (exp.x_label, "stack", "throughput (req/s)", "TTFT P95 (s)", "E2E mean (s)", "lost KV reuse",
                    "KV demand peak/GPU", "idle GPU prefill/decode", "switches", "vs evolving (thr, TTFT P95)"):
            t.add_column(col, justify="right")
        base = {r.run.x: r.metrics for r in ok if r.run.stack == "evolving"}
        for r in ok:
            m, b = r.metrics, base.get(r.run.x)
            ratio = "" if b is None or r.run.stack == "evolving" else (
                f"{_div(m.throughput_rps, b.throughput_rps)}, {_div(m.ttft_p95_s, b.ttft_p95_s)}")
            t.add_row(f"{r.run.x:g}", r.run.stack, f"{m.throughput_rps:.2f}", f"{m.ttft_p95_s:.2f}",
                      f"{m.e2e_mean_s:.1f}", _pct(m.lost_kv_reuse), _pct(getattr(m, "kv_demand_peak_gpu", math.nan)),
                      f"{_pct(m.idle_prefill_frac)} / {_pct(m.idle_decode_frac)}", str(m.switches), ratio)
        console.print(t)
        plots = [_sweep_plot(exp, ok, d)]
        if exp.name == "open-arrivals":
            for stack, rate in max_rate_within_slo(ok).items():
                console.print(f"  {stack}: highest swept rate with P95 TTFT <= {SLO_TTFT_P95_S:g} s: "
                              + (f"{rate:g} agents/min" if rate is not None else "none of the swept rates"))
    elif exp.kind == "curve" and ok:
        print_table([r.metrics for r in ok], title=title, console=console)
        plots = [_curve_plot(exp, ok, d)]
    for r in results:
        if r.metrics is None:
            console.print(f"  {r.run.label}: [yellow]{r.status}")
        if r.sessions:
            console.print(f"  {r.run.label}: sessions started per phase: "
                          + ", ".join(f"{k} {v}" for k, v in sorted(r.sessions.items())))
    if plots:
        console.print("plots: " + ", ".join(str(p) for p in plots))
    return {"name": exp.name, "title": title, "claim": exp.claim,
            "runs": [{"label": r.run.label, "stack": r.run.stack, "x": r.run.x, "status": r.status,
                      "log": r.log, "wall_s": round(r.wall_s, 1), "cpu_s": round(r.cpu_s, 1),
                      "same_as": r.same_as, "ran_on": r.ran_on,
                      "metrics": _clean(r.metrics.summary()) if r.metrics else None} for r in results],
            "plots": [str(p) for p in plots]}


def max_rate_within_slo(results: list[Result]) -> dict[str, float | None]:
    """Per stack, the highest swept rate whose P95 TTFT meets the SLO, every lower swept rate
    meeting it too (a stack that fails at 2/min and passes at 3/min is not credited 3)."""
    out: dict[str, float | None] = {}
    for stack in dict.fromkeys(r.run.stack for r in results):
        best = None
        for r in sorted((r for r in results if r.run.stack == stack), key=lambda r: r.run.x):
            if not r.metrics.ttft_p95_s <= SLO_TTFT_P95_S:  # NaN (nothing served) fails too
                break
            best = r.run.x
        out[stack] = best
    return out


def _div(a: float, b: float) -> str:
    try:
        return f"{a / b:.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "-"
    except TypeError:
        return "-"


def _pct(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.1%}"


def _clean(d: dict) -> dict:
    def c(v):
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, dict):
            return {k: c(x) for k, x in v.items()}
        return v

    return {k: c(v) for k, v in d.items() if k not in ("ttft_s", "e2e_s", "split_series")}


def _sweep_plot(exp: Experiment, ok: list[Result], d: Path) -> Path:
    metric, label = (("ttft_p95_s", "TTFT P95 (s)") if exp.name == "open-arrivals"
                     else ("lost_kv_reuse", "lost KV reuse"))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for stack in dict.fromkeys(r.run.stack for r in ok):
        rs = sorted((r for r in ok if r.run.stack == stack), key=lambda r: r.run.x)
        xs = [r.run.x for r in rs]
        axes[0].plot(xs, [r.metrics.throughput_rps for r in rs], marker="o", label=stack)
        axes[1].plot(xs, [getattr(r.metrics, metric) for r in rs], marker="o", label=stack)
    if exp.name == "open-arrivals":
        axes[1].axhline(SLO_TTFT_P95_S, color="grey", ls=":", lw=1)
        axes[1].set_yscale("log")
    for ax, yl in zip(axes, ("throughput (req/s)", label), strict=True):
        ax.set_xlabel(exp.x_label)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(exp.title, fontsize=9)
    return _save(fig, d / f"{exp.name}.png")


def _curve_plot(exp: Experiment, ok: list[Result], d: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    planner = [r for r in ok if r.run.planner_args]
    planner.sort(key=lambda r: r.run.x if r.run.x is not None else -1)
    ax.plot([r.metrics.throughput_rps for r in planner], [r.metrics.ttft_p95_s for r in planner], marker="o",
            label="Evolving Infra planner")
    for i, r in enumerate(planner):  # stacked: settings that gave the same run share a point
        ax.annotate(r.run.label, (r.metrics.throughput_rps, r.metrics.ttft_p95_s), fontsize=7,
                    xytext=(4, 4 + 9 * i), textcoords="offset points")
    for r in ok:
        if not r.run.planner_args:
            ax.scatter([r.metrics.throughput_rps], [r.metrics.ttft_p95_s], marker="s", label=r.run.label)
    ax.set_xlabel("throughput (req/s)")
    ax.set_ylabel("TTFT P95 (s)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(exp.title, fontsize=9)
    return _save(fig, d / f"{exp.name}.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
