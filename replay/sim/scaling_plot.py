"""The simulator's scaling plot: nodes vs x real time and events per wall second.

``python -m replay.sim.scaling_plot BENCH.json... -o docs/sim_scaling.png`` reads the rows that
``evolving bench sim --json`` prints (one JSON list per file; the single-process rows and the
partition rows, ``--partitions N``) and draws one line per kind of run: the in-memory
single-process rows by their ``run`` label (``evolving``, ``evolving --fast``; static splits are
left out), the partition rows as "1 process (DuckDB log)" and "N partitions". Each point is
labelled with its agents. A middle panel divides by the CPU seconds of all processes
(``cpu_s``, partition rows only), which a loaded machine changes less than wall time. Rows of several files are drawn together, so points
measured at different times (and loads) can share one plot; the docs say when they were taken.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

matplotlib.use("Agg")  # no display (pyplot picks its backend at the first figure)


def series(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped into plot lines (sorted by nodes); static-split rows and the calibration
    rows (one size, recorded sessions, event log written) are dropped."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        run = str(r.get("run", ""))
        if run.startswith("static:") or "calibration" in r:
            continue
        if "partitions" in r:  # a partition row (replay.sim.partitioned.bench_rows)
            n = int(r["partitions"])
            key = "1 partition (1 process, DuckDB log)" if n == 1 else f"{n} partitions ({r.get('processes', '?')} processes)"
        else:
            key = f"{run} (1 process, log in memory)"
        out.setdefault(key, []).append(r)
    for pts in out.values():
        pts.sort(key=lambda r: r["nodes"])
    return out


def load_rows(paths: list[str | Path]) -> list[dict]:
    rows: list[dict] = []
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"error: {p}: not a `evolving bench sim --json` output ({exc})") from None
        if not isinstance(doc, list) or not all(isinstance(r, dict) and "nodes" in r and "x_real_time" in r
                                                for r in doc):
            raise SystemExit(f"error: {p}: expected a JSON list of bench sim rows (nodes, x_real_time, ...)")
        for r in doc:
            r.setdefault("events_per_s", r["events"] / max(1e-9, r["wall_s"]))
        rows += doc
    return rows


def plot(rows: list[dict], out: str | Path, title: str = "") -> Path:
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
    for i, (name, pts) in enumerate(series(rows).items()):
        color = f"C{i}"
        for ax, key in ((ax1, "x_real_time"), (ax2, "x_cpu"), (ax3, "events_per_s")):
            have = [r for r in pts if key != "x_cpu" or r.get("cpu_s")]
            if not have:
                continue
            ys = [r["simulated_s"] / r["cpu_s"] if key == "x_cpu" else r[key] for r in have]
            ax.plot([r["nodes"] for r in have], ys, marker="o", color=color, label=name)
            for r, y in zip(have, ys, strict=True):
                ax.annotate(f"{r['agents']} ag.", (r["nodes"], y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
    for ax in (ax1, ax2):
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set_ylabel("simulated s per wall s (x real time)")
    ax2.set_ylabel("simulated s per CPU s (all processes; load-independent)")
    ax3.set_ylabel("events per wall second")
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("nodes (4 GPUs each)")
        ax.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle(title or "evolving bench sim: CC-like agents, 2-core shared machine")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m replay.sim.scaling_plot", description=__doc__.splitlines()[0])
    ap.add_argument("bench_json", nargs="+", help="outputs of `evolving bench sim --json`")
    ap.add_argument("-o", "--out", default="docs/sim_scaling.png")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    path = plot(load_rows(args.bench_json), args.out, args.title)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
