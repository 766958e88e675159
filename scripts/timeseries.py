"""Per-bin time series of simulator logs, one line per stack: throughput, TTFT
mean and P95, and the prefill-queue imbalance across prefill nodes, after the warm-up.

    python scripts/timeseries.py --warmup 600 --bin 300 --out ts.png ours.duckdb dynamo.duckdb ...

Reads each log's ``requests`` view only (no KV figures: those need the node reports that
``evolving sim-report`` folds). Per bin of ``--bin`` seconds from ``--warmup``: requests
finished in it per second; TTFT mean and P95 of the requests submitted in it; the largest mean
prefill-queue wait (``queue_s``) of a prefill node over the mean of all prefill nodes' (1 =
balanced). A stack's name is its file's stem. Prints the table it plots.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import duckdb

QUERY = """
with done as (select floor((finished_ts - {w}) / {b}) k, count(*) / {b} thr from requests
         where finished_ts >= {w} and (error is null or error = '') group by 1),
ttft as (select floor((submitted_ts - {w}) / {b}) k, avg(first_token_ts - submitted_ts) mean,
         quantile_cont(first_token_ts - submitted_ts, 0.95) p95 from requests
         where submitted_ts >= {w} and first_token_ts is not null group by 1),
node as (select floor((submitted_ts - {w}) / {b}) k, prefill_node, avg(queue_s) q from requests
         where submitted_ts >= {w} and queue_s is not null and prefill_node is not null group by 1, 2),
imb as (select k, max(q) / nullif(avg(q), 0) imb from node group by 1)
select k, thr, mean, p95, imb from done join ttft using (k) left join imb using (k)
where k >= 0 and k < {n} order by k
"""


def series(path: Path, warmup_s: float, bin_s: float, bins: int) -> list[tuple]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.sql(QUERY.format(w=warmup_s, b=bin_s, n=bins)).fetchall()
    finally:
        con.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--warmup", type=float, default=600.0, help="seconds before the first bin")
    ap.add_argument("--bin", type=float, default=300.0, help="bin width in seconds")
    ap.add_argument("--bins", type=int, default=6, help="number of bins")
    ap.add_argument("--out", type=Path, required=True, help="PNG to write")
    args = ap.parse_args()
    import matplotlib  # lazy: only this script plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(8, 10), sharex=True)
    labels = ["throughput (req/s)", "TTFT mean (s)", "TTFT P95 (s)", "prefill queue wait max/avg node"]
    for path in args.logs:
        rows = series(path, args.warmup, args.bin, args.bins)
        minutes = [(args.warmup + (k + 0.5) * args.bin) / 60.0 for k, *_ in rows]
        print(path.stem, " | ".join(f"{m:.1f} min: {t:.2f} req/s, {a:.2f}/{p:.2f} s, imb {i or 0:.2f}"
                                    for m, (_, t, a, p, i) in zip(minutes, rows, strict=True)))
        for j, ax in enumerate(axes):
            ax.plot(minutes, [r[j + 1] if r[j + 1] is not None else float("nan") for r in rows],
                    marker="o", label=path.stem)
    for ax, label in zip(axes, labels, strict=True):
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel(f"minutes (bins of {args.bin:g} s after {args.warmup:g} s of warm-up)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
