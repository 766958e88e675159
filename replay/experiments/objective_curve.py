"""The TTFT objective's trade-off curve: Putnam-like at 256 agents,
Evolving Infra started at 1P8D (the split a throughput-only planner keeps, METHOD.md §6.1)
under different objective settings, next to static 1P8D / 2P7D / 3P6D.

Every row is one ``replay.experiments.run.execute`` call (the rows of ``evolving experiments``;
planner overrides go through a temporary preset), so a row is reproducible alone. Planner
windows are shortened (180 s, 3 slices: ``--window``) so a decision after the warm-up falls
inside a short run; docs/planner.md ("The trade-off curve") has the figures.

    python -m replay.experiments.objective_curve [--jobs 2] [--warmup 6m] [--duration 6m] [--rows a,b]
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

from replay.experiments.matrix import Run, run_flags
from replay.experiments.run import execute

matplotlib.use("Agg")  # no display (pyplot picks its backend at the first figure)

# label -> (stack, planner overrides); evolving rows start at 1P8D
ROWS: dict[str, tuple[str, dict]] = {
    "throughput only (paper)": ("evolving", {"ttft_objective": False, "slo_guard": False}),
    "SLO 60 s": ("evolving", {"slo_ttft_p95_s": 60.0}),
    "SLO 30 s": ("evolving", {"slo_ttft_p95_s": 30.0}),
    "SLO 15 s": ("evolving", {"slo_ttft_p95_s": 15.0}),
    "SLO 10 s": ("evolving", {"slo_ttft_p95_s": 10.0}),
    "SLO 10 s, tolerance 1%": ("evolving", {"slo_ttft_p95_s": 10.0, "throughput_tolerance": 0.01}),
    "static:1P8D": ("static:1P8D", {}),
    "static:2P7D": ("static:2P7D", {}),
    "static:3P6D": ("static:3P6D", {}),
}


def runs(warmup: str, duration: str, window_s: float, slices: int) -> dict[str, Run]:
    out = {}
    for label, (stack, over) in ROWS.items():
        extra = ("--start", "1P8D") if stack == "evolving" else ()
        args = {"window_s": window_s, "slices": slices, **over} if stack == "evolving" else {}
        out[label] = Run(label, stack, run_flags("putnam", 256, warmup, duration, *extra), planner_args=args)
    return out


def _one(job: tuple[Run, str]) -> dict:
    run, log = job
    r = execute(run, log)
    row = {"row": run.label, "status": r.status, "cpu_s": round(r.cpu_s, 1), "log": log}
    if r.metrics is not None:
        m = r.metrics
        row.update(throughput_rps=m.throughput_rps, ttft_p95_s=m.ttft_p95_s, ttft_mean_s=m.ttft_mean_s,
                   split_time_s=m.split_time_s)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m replay.experiments.objective_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--warmup", default="6m")
    p.add_argument("--duration", default="6m")
    p.add_argument("--window", type=float, default=180.0, help="planner window (s), 3 slices")
    p.add_argument("--rows", default="", help="comma-separated row labels (default: all)")
    p.add_argument("--out-dir", default="runs/objective-curve")
    a = p.parse_args(argv)
    table = runs(a.warmup, a.duration, a.window, 3)
    labels = [s.strip() for s in a.rows.split(",") if s.strip()] or list(table)
    unknown = [x for x in labels if x not in table]
    if unknown:
        p.error(f"unknown row(s) {unknown}; rows: {', '.join(table)}")
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(table[x], str(out / (x.replace(" ", "_").replace(",", "").replace(":", "_") + ".duckdb"))) for x in labels]
    with ProcessPoolExecutor(max(1, a.jobs)) as ex:
        rows = list(ex.map(_one, jobs))
    print(f"{'row':26} {'req/s':>7} {'TTFT P95 s':>11} {'TTFT mean s':>12}  time in split")
    for r in rows:
        if "throughput_rps" not in r:
            print(f"{r['row']:26} {r['status']}")
            continue
        total = sum(r["split_time_s"].values()) or 1.0
        splits = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(r["split_time_s"].items(), key=lambda kv: -kv[1])
                           if v / total >= 0.05)
        print(f"{r['row']:26} {r['throughput_rps']:7.2f} {r['ttft_p95_s']:11.2f} {r['ttft_mean_s']:12.2f}  {splits}")
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=str))
    _plot(rows, out / "objective_curve.png")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        if "throughput_rps" not in r:
            continue
        static = r["row"].startswith("static")
        ax.scatter(r["ttft_p95_s"], r["throughput_rps"], marker="s" if static else "o",
                   color="gray" if static else "tab:blue")
        ax.annotate(r["row"], (r["ttft_p95_s"], r["throughput_rps"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_xlabel("measured P95 TTFT (s)")
    ax.set_ylabel("measured throughput (req/s)")
    ax.set_title("Putnam-like, 256 agents, from 1P8D: throughput vs P95 TTFT", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
