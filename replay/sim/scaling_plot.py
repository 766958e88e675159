"""The simulator's scaling plot: nodes vs x real time, per CPU second, and events per wall second.

``python -m replay.sim.scaling_plot BENCH.json... -o docs/sim_scaling.png`` reads the rows that
``evolving bench sim --json`` prints (one JSON list per file; the single-process rows, the
calibration rows and the partition rows, ``--partitions N``) and draws one line per kind of run:
the synthetic CC single-process rows by their ``run`` label (``evolving``, ``evolving --fast``;
static splits are left out), the calibration sessions' rows (recorded Claude Code sessions at
agent pace, one point at 9 nodes per log setting) beside them, and the partition rows as
"1 process (DuckDB log)" and "N partitions". Each point is labelled with its agents. The middle
panel divides by the CPU seconds of the run (all processes for partition rows), which a loaded
machine changes less than wall time. The speed targets are drawn as crosses where a row
carries one (``target``: 150x synthetic CC at 9 nodes, 100x calibration, 30x at 96 nodes,
768 nodes' hour in 20 min = 3x). With several files each line is suffixed by its file's stem
(``--label`` names them), so two measurements can share one plot; the docs say when each was
taken.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt

matplotlib.use("Agg")  # no display (pyplot picks its backend at the first figure)


#: the calibration rows drawn (bench sim --calibration-runs): no log and the default full log
CALIBRATION_DRAWN = {"nolog": "calibration sessions, no log", "full": "calibration sessions, full log (DuckDB)"}
#: the speed targets in x real time (wall) per kind of row; the 768-node hour in 20 min is 3x
TARGET_X = {"synthetic": {9: 150.0, 96: 30.0}, "calibration": {9: 100.0}, "partitions": {768: 3.0}}


def series(rows: list[dict]) -> dict[str, list[dict]]:
    """Rows grouped into plot lines (sorted by nodes); static-split rows are dropped, and of the
    calibration rows only those of ``CALIBRATION_DRAWN``. A row with ``_label`` (several files)
    has it appended to its line's name."""
    out: dict[str, list[dict]] = {}
    for r in rows:
        run = str(r.get("run", ""))
        if run.startswith("static:"):
            continue
        if "calibration" in r:
            if r["calibration"] not in CALIBRATION_DRAWN:
                continue
            key = CALIBRATION_DRAWN[r["calibration"]]
        elif "partitions" in r:  # a partition row (replay.sim.partitioned.bench_rows)
            n = int(r["partitions"])
            key = "1 partition (1 process, DuckDB log)" if n == 1 else f"{n} partitions ({r.get('processes', '?')} processes)"
        else:
            key = f"{run} (1 process, log in memory)"
        if r.get("_label"):
            key = f"{key} [{r['_label']}]"
        out.setdefault(key, []).append(r)
    for pts in out.values():
        pts.sort(key=lambda r: r["nodes"])
    return out


def load_rows(paths: list[str | Path], labels: list[str] | None = None) -> list[dict]:
    """Every file's rows; with more than one file each row gets its file's label (``labels``, or
    the file's stem) as ``_label``."""
    rows: list[dict] = []
    for i, p in enumerate(paths):
        try:
            doc = json.loads(Path(p).read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"error: {p}: not a `evolving bench sim --json` output ({exc})") from None
        if not isinstance(doc, list) or not all(isinstance(r, dict) and "nodes" in r and "x_real_time" in r
                                                for r in doc):
            raise SystemExit(f"error: {p}: expected a JSON list of bench sim rows (nodes, x_real_time, ...)")
        for r in doc:
            r.setdefault("events_per_s", r["events"] / max(1e-9, r["wall_s"]))
            if len(paths) > 1:
                r["_label"] = labels[i] if labels and i < len(labels) else Path(p).stem
        rows += doc
    return rows


def _kind(r: dict) -> str:
    return "calibration" if "calibration" in r else "partitions" if "partitions" in r else "synthetic"


def _earlier(pts: list[dict]) -> bool:
    """A line from an earlier measurement (its label starts with "before"): drawn dotted."""
    return str(pts[0].get("_label", "")).startswith("before")


def plot(rows: list[dict], out: str | Path, title: str = "") -> Path:
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 6.4))
    for i, (name, pts) in enumerate(series(rows).items()):
        color = f"C{i}"
        for ax, key in ((ax1, "x_real_time"), (ax2, "x_cpu"), (ax3, "events_per_s")):
            have = [r for r in pts if key != "x_cpu" or r.get("cpu_s")]
            if not have:
                continue
            ys = [r["simulated_s"] / r["cpu_s"] if key == "x_cpu" else r[key] for r in have]
            calib = "calibration" in name
            ax.plot([r["nodes"] for r in have], ys, marker="s" if calib else "o", color=color, label=name,
                    ls=":" if _earlier(pts) else "-", ms=7 if calib else 5)
            for r, y in zip(have, ys, strict=True):
                ax.annotate(f"{r['agents']} ag.", (r["nodes"], y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
    targets = sorted({(n, x, kind) for kind, by in TARGET_X.items() for n, x in by.items()
                      if any(r["nodes"] == n and _kind(r) == kind for r in rows)})
    for i, (n, x, kind) in enumerate(targets):
        # per CPU-second: one process on a free core has wall = CPU; the partitions' 2 cores halve it
        for ax, y in ((ax1, x), (ax2, x / 2 if kind == "partitions" else x)):
            ax.plot([n], [y], marker="x", ms=10, mew=2, color="black", ls="none",
                    label="target (x real time; per CPU-s on 2 cores for partitions)" if i == 0 and ax is ax1
                    else None)
            ax.annotate(f"target {y:g}x ({kind})", (n, y), textcoords="offset points", xytext=(6, -10), fontsize=7)
    for ax in (ax1, ax2):
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax1.set_ylabel("simulated s per wall s (x real time)")
    ax2.set_ylabel("simulated s per CPU s (x real time per CPU-second; all processes)")
    ax3.set_ylabel("events per wall second")
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("nodes (4 GPUs each)")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.suptitle(title or "evolving bench sim: synthetic CC and the calibration sessions, 2-core shared machine")
    fig.tight_layout(rect=(0, 0.06 + 0.022 * ((len(labels) + 1) // 2), 1, 1))
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
    ap.add_argument("--label", action="append", default=None,
                    help="a name per file, in order (default: the file's stem); a name starting with "
                         "'before' draws that file's lines dotted")
    args = ap.parse_args(argv)
    path = plot(load_rows(args.bench_json, args.label), args.out, args.title)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
