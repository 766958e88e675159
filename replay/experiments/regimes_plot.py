"""The regime map's PNG: one row of panels per stack, one panel per metric
(req/s, P95 TTFT, lost KV reuse, peak KV demand of kept KV and of GPU KV, idle GPU of the busier phase,
regime), agents down, per-node KV capacities (GPU/host) across; every cell annotated with its
value. Matplotlib's Agg backend (no display)."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

from replay.experiments.regimes import REGIMES

matplotlib.use("Agg")  # no display (pyplot picks its backend at the first figure)

#: (title, row field or callable, format, colour map)
PANELS = [
    ("req/s", "throughput_rps", "{:.2f}", "viridis"),
    ("P95 TTFT (s)", "ttft_p95_s", "{:.0f}", "magma_r"),
    ("lost KV reuse", "lost_kv_reuse", "{:.0%}", "Reds"),
    ("peak KV demand / kept KV", "kv_demand_peak_kept", "{:.0%}", "Blues"),
    ("peak KV demand / GPU KV", "kv_demand_peak_gpu", "{:.0%}", "Purples"),
    ("idle GPU, busier phase", lambda r: min(r["idle_prefill_frac"] or 0, r["idle_decode_frac"] or 0), "{:.0%}",
     "Greens"),
]
REGIME_COLOURS = ["#9ecae1", "#a1d99b", "#fdae6b", "#de2d26"]
REGIME_SHORT = {"agent-bound": "AB", "loaded-roomy": "LR", "near-capacity": "NC", "thrashing": "TH"}


def _value(r: dict, field) -> float:
    v = field(r) if callable(field) else r.get(field)
    return float("nan") if v is None else float(v)


def plot_map(doc: dict, path: str | Path) -> Path:
    rows = doc["rows"]
    stacks = list(dict.fromkeys(r["stack"] for r in rows))
    caps = sorted({(r["gpu_tokens"], r["host_tokens"]) for r in rows})
    agents = sorted({r["agents"] for r in rows})
    cols = len(PANELS) + 1
    fig, axes = plt.subplots(len(stacks), cols, figsize=(2.7 * cols, 0.6 + 1.0 * max(2, len(agents)) * len(stacks)),
                             squeeze=False)
    for si, stack in enumerate(stacks):
        mine = {(r["gpu_tokens"], r["host_tokens"], r["agents"]): r for r in rows if r["stack"] == stack}
        for pi, (title, field, fmt, cmap) in enumerate(PANELS + [("regime", None, None, None)]):
            ax = axes[si][pi]
            grid = np.full((len(agents), len(caps)), np.nan)
            for (g, h, a), r in mine.items():
                y, x = agents.index(a), caps.index((g, h))
                grid[y, x] = REGIMES.index(r["regime"]) if field is None else _value(r, field)
            if field is None:
                ax.imshow(grid, cmap=ListedColormap(REGIME_COLOURS), vmin=-0.5, vmax=3.5, aspect="auto")
            else:
                ax.imshow(grid, cmap=cmap, aspect="auto")
            for (g, h, a), r in mine.items():
                y, x = agents.index(a), caps.index((g, h))
                v = grid[y, x]
                txt = REGIME_SHORT[r["regime"]] if field is None else ("-" if math.isnan(v) else fmt.format(v))
                ax.text(x, y, txt, ha="center", va="center", fontsize=7,
                        bbox={"boxstyle": "round,pad=0.1", "fc": "white", "alpha": 0.6, "lw": 0})
            ax.set_xticks(range(len(caps)), [f"{g / 1e6:g}/{h / 1e6:g}" for g, h in caps], fontsize=6, rotation=45)
            ax.set_yticks(range(len(agents)), [str(a) for a in agents], fontsize=7)
            ax.set_title(f"{stack}: {title}", fontsize=8)
            if pi == 0:
                ax.set_ylabel("agents", fontsize=7)
            if si == len(stacks) - 1:
                ax.set_xlabel("KV per node, M tokens (GPU/host)", fontsize=6)
    s = doc.get("settings", {})
    fig.suptitle(f"regime map: {s.get('nodes')} nodes, {s.get('warmup_s', 0) / 60:g} min warm-up + "
                 f"{s.get('duration_s', 0) / 60:g} min, pace {s.get('pace')}; AB agent-bound, LR loaded-roomy, "
                 f"NC near capacity, TH thrashing", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
