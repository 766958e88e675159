"""Side-by-side report of simulated runs: one table (ratios against the first stack), JSON, PNG plots.

Plots use matplotlib's Agg backend (no display): split over time per stack, TTFT and E2E
CDFs, lost KV reuse per stack.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from replay.sim.figures import RunMetrics

#: (label, attribute, format, lower is better?) rows of the table.
ROWS: list[tuple[str, str, str, bool | None]] = [
    ("throughput (req/s)", "throughput_rps", "{:.2f}", False),
    ("finished requests", "finished", "{:d}", None),
    ("TTFT mean (s)", "ttft_mean_s", "{:.2f}", True),
    ("TTFT P50 (s)", "ttft_p50_s", "{:.2f}", True),
    ("TTFT P95 (s)", "ttft_p95_s", "{:.2f}", True),
    ("TTFT P99 (s)", "ttft_p99_s", "{:.2f}", True),
    ("TTFT max (s)", "ttft_max_s", "{:.2f}", True),
    ("E2E mean (s)", "e2e_mean_s", "{:.2f}", True),
    ("E2E P95 (s)", "e2e_p95_s", "{:.2f}", True),
    ("TPOT (ms)", "tpot_mean_ms", "{:.1f}", True),
    ("KV hit actual", "kv_hit_actual", "{:.1%}", False),
    ("KV hit ideal", "kv_hit_ideal", "{:.1%}", None),
    ("lost KV reuse", "lost_kv_reuse", "{:.1%}", True),
    ("uncached tokens/req", "uncached_tokens_per_req", "{:.0f}", True),
    ("switches", "switches", "{:d}", None),
    ("mean switch time (s)", "switch_mean_s", "{:.1f}", True),
    ("prefill queue wait (s)", "prefill_wait_mean_s", "{:.2f}", True),
    ("queue wait max/avg node", "prefill_wait_imbalance", "{:.2f}", True),
    ("idle prefill GPU time", "idle_prefill_frac", "{:.1%}", True),
    ("idle decode GPU time", "idle_decode_frac", "{:.1%}", True),
    ("KV demand peak / GPU KV", "kv_demand_peak_gpu", "{:.1%}", None),
    ("KV demand mean / GPU KV", "kv_demand_mean_gpu", "{:.1%}", None),
    ("KV demand peak / host KV", "kv_demand_peak_host", "{:.1%}", None),
    ("unfinished at end", "unfinished", "{:d}", None),
]
#: The next turn's KV (replay/sim/figures.py): shown when a stack of the table
#: has ``+prestage`` or ``+specprefill``
NEXT_TURN_ROWS: list[tuple[str, str, str, bool | None]] = [
    ("continuation TTFT P50 (s)", "ttft_cont_p50_s", "{:.3f}", True),
    ("continuation TTFT P95 (s)", "ttft_cont_p95_s", "{:.3f}", True),
    ("next turn on staged node", "next_turn_on_staged", "{:.1%}", None),
    ("staged KV (tokens)", "staged_tokens", "{:d}", None),
    ("spec prefill computed (tokens)", "spec_prefilled_tokens", "{:d}", None),
    ("spec prefill moved (tokens)", "spec_moved_tokens", "{:d}", None),
]


def _fmt(fmt: str, v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return fmt.format(v)


def _ratio(v, base) -> str:
    try:
        if base in (0, None) or math.isnan(base) or math.isnan(v):
            return ""
    except TypeError:
        return ""
    return f" ({v / base:.2f}x)"


def _splits(m: RunMetrics, top: int = 3) -> str:
    total = sum(m.split_time_s.values()) or 1.0
    return ", ".join(f"{k} {v / total:.0%}" for k, v in list(m.split_time_s.items())[:top]) or "-"


def table_rows(runs: Sequence[RunMetrics]) -> list[list[str]]:
    base = runs[0]
    out = []
    rows = ROWS + (NEXT_TURN_ROWS if any(m.stage_orders or m.spec_requests for m in runs) else [])
    for label, attr, fmt, _ in rows:
        row = [label]
        for i, m in enumerate(runs):
            v = getattr(m, attr)
            cell = _fmt(fmt, v)
            if i > 0 and fmt != "{:d}" and "%" not in fmt:
                cell += _ratio(v, getattr(base, attr))
            row.append(cell)
        out.append(row)
    out.append(["time in split"] + [_splits(m) for m in runs])
    if any(m.partitions for m in runs):
        out.append(["prefill share by partition"] + [_spread(m, _prefill_share, "{:.0%}") for m in runs])
        out.append(["req/s by partition"] + [_spread(m, lambda f: f["throughput_rps"], "{:.1f}") for m in runs])
    return out


def _prefill_share(f: dict) -> float:
    p, d = f["prefill_nodes_mean"], f["decode_nodes_mean"]
    return p / (p + d) if p + d > 0 else float("nan")


def _spread(m: RunMetrics, value, fmt: str) -> str:
    """``min-max`` of a per-partition figure, with the swing (max - min) / mean."""
    xs = [v for v in (value(f) for f in m.partitions.values()) if not math.isnan(v)]
    if not xs:
        return "-"
    mean = sum(xs) / len(xs)
    swing = f" (swing {(max(xs) - min(xs)) / mean:.0%})" if mean > 0 else ""
    return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}{swing}"


def print_table(runs: Sequence[RunMetrics], title: str = "", console=None) -> None:
    console = console or Console()
    t = Table(title=title or None, show_lines=False)
    t.add_column("metric (after warm-up)")
    for i, m in enumerate(runs):
        t.add_column(m.stack + (" (ratio vs first)" if i == 1 else ""), justify="right")
    for row in table_rows(runs):
        t.add_row(*row)
    console.print(t)


def to_json(runs: Sequence[RunMetrics]) -> dict:
    def clean(v):
        if isinstance(v, float) and math.isnan(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return {m.stack: {k: clean(v) for k, v in m.summary().items()} for m in runs}


def write_plots(runs: Sequence[RunMetrics], out_dir: str | Path, warmup_s: float, end_s: float,
                nodes: int) -> list[Path]:
    import matplotlib  # lazy: start-up (tables without plots, evolving --help: +370 ms with pyplot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: start-up (tables without plots, evolving --help: +370 ms)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(8, 4))
    for m in runs:
        xs, ys = [], []
        for i, (t, p) in enumerate(m.split_series):
            nxt = m.split_series[i + 1][0] if i + 1 < len(m.split_series) else end_s
            xs += [t / 60, nxt / 60]
            ys += [p, p]
        ax.plot(xs, ys, label=m.stack, drawstyle="steps-post")
    ax.axvline(warmup_s / 60, color="grey", ls=":", lw=1)
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel(f"prefill-capable nodes (of {nodes})")
    ax.set_title("split over time (dotted: end of warm-up)")
    ax.legend(fontsize=8)
    p = out / "split_over_time.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    for attr, label, fname in (("ttft_s", "TTFT (s)", "ttft_cdf.png"), ("e2e_s", "E2E latency (s)", "e2e_cdf.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in runs:
            xs = np.sort(np.asarray(getattr(m, attr)))
            if len(xs):
                ax.plot(np.maximum(xs, 1e-3), np.arange(1, len(xs) + 1) / len(xs), label=m.stack)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        p = out / fname
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)

    fig, ax = plt.subplots(figsize=(6, 4))
    vals = [0.0 if math.isnan(m.lost_kv_reuse) else 100 * m.lost_kv_reuse for m in runs]
    ax.bar([m.stack for m in runs], vals)
    ax.set_ylabel("lost KV reuse (% of ideally reusable tokens)")
    ax.tick_params(axis="x", rotation=20)
    p = out / "lost_kv_reuse.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths
