"""``evolving regimes``: the regime map.

A grid of per-node KV capacities (GPU tokens x host:GPU ratios) and concurrencies (agents) on
recorded sessions at agent pace; each cell run once per stack with the same code every other
command uses (``replay.sim.runs.run_one``, flags parsed by the ``replay`` parser). Each row keeps
the figures the map needs (req/s, P95 TTFT, lost KV reuse, peak / mean KV demand as a share of
GPU and host KV, idle prefill / decode GPU time) and a regime (:func:`classify`); each cell gets
the most severe regime of its stacks (:func:`cell_regime`). One JSON file holds every row, and a
later call with the same run settings reuses the rows it already has (so a second call can add
stacks at selected cells, or finish an interrupted grid). The PNG map is drawn by
replay/experiments/regimes_plot.py. docs/simulator.md, "Regimes", has the thresholds and why.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from replay.sim.figures import RunMetrics

if TYPE_CHECKING:
    from replay.sim.inputs import SimSpec

#: the four regimes, mildest first (a cell takes the most severe of its stacks')
REGIMES = ("agent-bound", "loaded-roomy", "near-capacity", "thrashing")


@dataclass(frozen=True)
class Thresholds:
    """Where one regime ends and the next begins (docs/simulator.md, "Regimes").

    ``loaded_idle`` / ``loaded_wait_s``: a run is loaded when its busier phase idles less than
    this share of its GPU time (min of idle prefill, idle decode), or when requests wait this
    long for a prefill GPU on average (a router that piles requests on a few nodes leaves the
    mean idle time high while they queue; METHOD §4.1's median queue wait under load was
    0.7-2.2 s); otherwise the agents' own pauses bound the rate.
    ``near_demand`` / ``near_of``: near capacity from this peak KV demand of active branches, as
    a share of the GPU tier (``"gpu"``, the default) or of the KV the cluster keeps (``"kept"``:
    every GPU block is written through to host [M §4.1], so that is the host pool, or the GPU
    tier where that is larger). METHOD §5's 86% sits inside [0.70, 1.0). The map on the
    calibration sessions picks ``"gpu"``: at 70-89% of kept KV every run thrashes (host = GPU)
    or its running requests no longer fit (host = 4 x GPU); docs/simulator.md, "Regimes".
    ``thrash_demand`` / ``thrash_lost``: thrashing once the peak demand exceeds what the cluster
    keeps, or once the lost KV reuse reaches this share of the ideal reuse (METHOD §5: "KV
    capacity was not the bottleneck"). ``kv_bound_rate``: thrashing as well (KV-bound) when the
    run serves less than this share of what the same stack serves with the same agents at the
    grid's roomiest capacity: the running requests no longer fit in GPU KV, whatever the idle
    time says. ``kv_bound_ttft_s``: thrashing as well when GPUs idle (not loaded) while P95 TTFT
    exceeds this: requests wait for KV room, not for compute.
    """

    loaded_idle: float = 0.25
    loaded_wait_s: float = 1.0
    near_demand: float = 0.70
    near_of: str = "gpu"
    thrash_demand: float = 1.0
    thrash_lost: float = 0.10
    kv_bound_rate: float = 0.80
    kv_bound_ttft_s: float = 60.0


@dataclass(frozen=True)
class Cell:
    """One grid point: per-node GPU KV tokens, host KV tokens, agents."""

    gpu_tokens: int
    host_tokens: int
    agents: int

    @property
    def ratio(self) -> float:
        return self.host_tokens / self.gpu_tokens

    @property
    def key(self) -> str:
        return f"{self.gpu_tokens}/{self.host_tokens}/{self.agents}"

    def label(self) -> str:
        return f"{self.gpu_tokens / 1e6:g}M/{self.host_tokens / 1e6:g}M"


def grid(gpu_tokens: Iterable[int], ratios: Iterable[float], agents: Iterable[int]) -> list[Cell]:
    """Every (GPU capacity, host:GPU ratio, agents) combination, capacities ascending."""
    cells = {Cell(int(g), round(g * r), int(a)) for g in gpu_tokens for r in ratios for a in agents}
    return sorted(cells, key=lambda c: (c.agents, c.gpu_tokens, c.host_tokens))


def parse_cells(text: str, parse_tokens: Callable[[str], int]) -> list[Cell]:
    """``GPU:RATIO:AGENTS,...`` (e.g. ``2M:4:126``) -> cells."""
    out = []
    for part in (x.strip() for x in text.split(",") if x.strip()):
        bits = part.split(":")
        if len(bits) != 3:
            raise ValueError(f"bad cell {part!r}: GPU:RATIO:AGENTS such as 2M:4:126")
        g = parse_tokens(bits[0])
        out.append(Cell(g, round(g * float(bits[1])), int(bits[2])))
    return out


def kept_tokens(row: dict) -> float:
    """The KV the cluster keeps: its host pool, or its GPU tier where that is larger."""
    return max(row["kv_gpu_capacity_tokens"], row["kv_host_capacity_tokens"])


def classify(row: dict, t: Thresholds = Thresholds(), roomy_rps: float | None = None) -> tuple[str, str]:
    """The regime of one run's figures, and why (the first rule that fired). ``roomy_rps``: what
    the same stack serves with the same agents at the grid's roomiest capacity (None: unknown)."""
    kept = kept_tokens(row)
    peak = row["kv_demand_peak_tokens"] / kept if kept else float("nan")
    lost = row["lost_kv_reuse"]
    idle = min(row["idle_prefill_frac"], row["idle_decode_frac"])
    wait = row.get("prefill_wait_mean_s", float("nan"))
    loaded = idle < t.loaded_idle or (wait is not None and not math.isnan(wait) and wait >= t.loaded_wait_s)
    if not math.isnan(peak) and peak >= t.thrash_demand:
        return "thrashing", f"peak KV demand {peak:.0%} of kept KV >= {t.thrash_demand:.0%}"
    if lost is not None and not math.isnan(lost) and lost >= t.thrash_lost:
        return "thrashing", f"lost KV reuse {lost:.1%} >= {t.thrash_lost:.0%}"
    rps = row.get("throughput_rps")
    if roomy_rps and rps is not None and not math.isnan(rps) and rps < t.kv_bound_rate * roomy_rps:
        return "thrashing", (f"KV-bound: {rps:.2f} req/s < {t.kv_bound_rate:.0%} of the {roomy_rps:.2f} "
                             f"served at the roomiest capacity")
    p95 = row["ttft_p95_s"]
    if not loaded and p95 is not None and p95 >= t.kv_bound_ttft_s:
        return "thrashing", f"GPUs idle {idle:.0%} while P95 TTFT {p95:.0f} s >= {t.kv_bound_ttft_s:.0f} s (KV-bound)"
    if not loaded:
        return "agent-bound", f"busier phase idles {idle:.0%} >= {t.loaded_idle:.0%}, prefill queue wait {wait:.2f} s"
    gpu = row["kv_demand_peak_tokens"] / row["kv_gpu_capacity_tokens"] if row["kv_gpu_capacity_tokens"] else peak
    near, of = (gpu, "GPU") if t.near_of == "gpu" else (peak, "kept")
    if not math.isnan(near) and near >= t.near_demand:
        return "near-capacity", f"loaded (idle {idle:.0%}), peak KV demand {near:.0%} of {of} KV, {peak:.0%} of kept"
    return "loaded-roomy", f"loaded (idle {idle:.0%}), peak KV demand {near:.0%} of {of} KV, {peak:.0%} of kept"


def cell_regime(rows: Sequence[dict]) -> str:
    """A cell's regime: the most severe of its stacks' (near capacity only if no stack thrashes)."""
    return max((r["regime"] for r in rows), key=REGIMES.index)


def _nan_none(v):
    return None if isinstance(v, float) and math.isnan(v) else v


def row_of(cell: Cell, stack: str, m: RunMetrics, t: Thresholds, wall_s: float = 0.0, cpu_s: float = 0.0) -> dict:
    """The map's figures of one run (NaN as None), its regime and the reason."""
    total = sum(m.split_time_s.values()) or 1.0
    kept = max(m.kv_gpu_capacity_tokens, m.kv_host_capacity_tokens)
    r = {"key": cell.key, "gpu_tokens": cell.gpu_tokens, "host_tokens": cell.host_tokens, "ratio": cell.ratio,
         "agents": cell.agents, "stack": stack, "throughput_rps": m.throughput_rps, "finished": m.finished,
         "ttft_p50_s": m.ttft_p50_s, "ttft_p95_s": m.ttft_p95_s, "e2e_mean_s": m.e2e_mean_s,
         "lost_kv_reuse": m.lost_kv_reuse, "kv_demand_peak_tokens": m.kv_demand_peak_tokens,
         "kv_demand_mean_tokens": m.kv_demand_mean_tokens, "kv_gpu_capacity_tokens": m.kv_gpu_capacity_tokens,
         "kv_host_capacity_tokens": m.kv_host_capacity_tokens,
         "kv_demand_peak_gpu": m.kv_demand_peak_gpu, "kv_demand_mean_gpu": m.kv_demand_mean_gpu,
         "kv_demand_peak_host": m.kv_demand_peak_host,
         "kv_demand_mean_host": (m.kv_demand_mean_tokens / m.kv_host_capacity_tokens
                                 if m.kv_host_capacity_tokens else float("nan")),
         "kv_demand_peak_kept": m.kv_demand_peak_tokens / kept if kept else float("nan"),
         "idle_prefill_frac": m.idle_prefill_frac, "idle_decode_frac": m.idle_decode_frac,
         "prefill_wait_mean_s": m.prefill_wait_mean_s, "unfinished": m.unfinished,
         "split": ", ".join(f"{k} {v / total:.0%}" for k, v in list(m.split_time_s.items())[:2]),
         "wall_s": round(wall_s, 1), "cpu_s": round(cpu_s, 1)}
    r = {k: _nan_none(v) for k, v in r.items()}
    r["regime"], r["why"] = classify(_nan(r), t)
    return r


def _nan(r: dict) -> dict:
    return {k: (float("nan") if v is None else v) for k, v in r.items()}


def roomy_rps(rows: Sequence[dict]) -> dict[tuple[str, int], float]:
    """Per (stack, agents): the req/s at the roomiest capacity run (most kept KV, then most GPU KV)."""
    best: dict[tuple[str, int], dict] = {}
    for r in rows:
        k = (r["stack"], r["agents"])
        cap = (max(r["gpu_tokens"], r["host_tokens"]), r["gpu_tokens"])
        if k not in best or cap > (max(best[k]["gpu_tokens"], best[k]["host_tokens"]), best[k]["gpu_tokens"]):
            best[k] = r
    return {k: r["throughput_rps"] for k, r in best.items()}


def settings_of(base: SimSpec) -> dict:
    """What makes two grids' rows comparable (a reused row must share all of it)."""
    return {"trace": str(base.trace), "pace": base.pace, "nodes": base.nodes, "profile": base.profile,
            "warmup_s": base.warmup, "duration_s": base.duration, "seed": base.seed, "fast": base.fast}


def run_argv(base: SimSpec, cell: Cell) -> list[str]:
    """The ``evolving replay`` flags of one cell (parsed by the same parser, run by ``run_one``)."""
    argv = ["--trace", str(base.trace), "--pace", str(base.pace), "--nodes", str(base.nodes),
            "--agents", str(cell.agents), "--warmup", str(base.warmup), "--duration", str(base.duration),
            "--seed", str(base.seed), "--kv-gpu-tokens", str(cell.gpu_tokens),
            "--kv-host-tokens", str(cell.host_tokens), "--no-progress"]
    if base.profile:
        argv += ["--profile", base.profile]
    if base.fast:
        argv.append("--fast")
    return argv


def load_doc(path: Path, settings: dict) -> dict:
    """The JSON of an earlier call with the same settings, or a fresh one."""
    if path.exists():
        doc = json.loads(path.read_text())
        if doc.get("settings") == settings:
            return doc
    return {"settings": settings, "thresholds": {}, "rows": [], "cells": []}


def summarise(doc: dict, t: Thresholds) -> dict:
    """Re-classify every row with ``t`` and give each cell its regime (in place; returned)."""
    doc["thresholds"] = asdict(t)
    by_cell: dict[str, list[dict]] = {}
    ref = roomy_rps(doc["rows"])
    for r in doc["rows"]:
        r["regime"], r["why"] = classify(_nan(r), t, ref.get((r["stack"], r["agents"])))
        by_cell.setdefault(r["key"], []).append(r)
    doc["cells"] = [{"key": k, "gpu_tokens": rs[0]["gpu_tokens"], "host_tokens": rs[0]["host_tokens"],
                     "agents": rs[0]["agents"], "stacks": [r["stack"] for r in rs], "regime": cell_regime(rs)}
                    for k, rs in by_cell.items()]
    return doc


def run_grid(base: SimSpec, cells: Sequence[Cell], stacks: Sequence[str], out: Path, t: Thresholds,
             log: Callable[[str], None] = print) -> dict:
    """Run every (cell, stack) not in ``out`` yet, one at a time, writing ``out`` after each."""
    from replay.experiments.run import run_parser  # lazy: start-up (--help skips the planner: +330 ms)
    from replay.sim.cli import sim_spec  # lazy: start-up (--help skips the simulator's commands)
    from replay.sim.inputs import session_source  # lazy: start-up (evolving --help skips DuckDB: +55 ms)
    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    doc = load_doc(out, settings_of(base))
    done = {(r["key"], r["stack"]) for r in doc["rows"]}
    todo = [(c, s) for c in cells for s in stacks if (c.key, s) not in done]
    parser = run_parser()
    source = None
    out.parent.mkdir(parents=True, exist_ok=True)
    for i, (cell, stack) in enumerate(todo, 1):
        a = sim_spec(parser.parse_args(run_argv(base, cell)))
        if source is None:  # the sessions are a pure function of trace and pace: read once
            source, _ = session_source(a)
        t0, c0 = time.perf_counter(), time.process_time()
        m, _ = run_one(stack, a, source, None, progress=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        r = row_of(cell, stack, m, t, wall, cpu)
        doc["rows"].append(r)
        summarise(doc, t)
        out.write_text(json.dumps(doc, indent=2))
        log(f"[{i}/{len(todo)}] {cell.label()} x {cell.agents} agents, {stack}: {r['throughput_rps']:.2f} req/s, "
            f"P95 TTFT {r['ttft_p95_s'] or float('nan'):.1f} s, lost {(r['lost_kv_reuse'] or 0):.1%}, "
            f"peak demand {(r['kv_demand_peak_kept'] or 0):.0%} of kept KV, idle P/D "
            f"{(r['idle_prefill_frac'] or 0):.0%}/{(r['idle_decode_frac'] or 0):.0%} -> {r['regime']} "
            f"({wall:.0f} s wall, {cpu:.0f} s CPU, load {os.getloadavg()[0]:.1f})")
    summarise(doc, t)
    out.write_text(json.dumps(doc, indent=2))
    return doc


def markdown(doc: dict) -> str:
    """The rows as a Markdown table, cells in grid order, stacks in run order (docs/simulator.md)."""
    def pct(v):
        return "-" if v is None else f"{v:.0%}"

    head = ("| KV/node GPU / host (M) | agents | stack | req/s | P95 TTFT (s) | lost KV reuse | peak / mean demand "
            "of GPU KV | peak / mean of host KV | idle prefill / decode GPU | regime |")
    out = [head, "|" + "---|" * 10]
    rows = sorted(doc["rows"], key=lambda r: (r["agents"], r["gpu_tokens"], r["host_tokens"]))
    for r in rows:
        p95 = "-" if r["ttft_p95_s"] is None else f"{r['ttft_p95_s']:.1f}"
        out.append(f"| {r['gpu_tokens'] / 1e6:g} / {r['host_tokens'] / 1e6:g} | {r['agents']} | {r['stack']} | "
                   f"{r['throughput_rps']:.2f} | {p95} | {(r['lost_kv_reuse'] or 0):.1%} | "
                   f"{pct(r['kv_demand_peak_gpu'])} / {pct(r['kv_demand_mean_gpu'])} | "
                   f"{pct(r['kv_demand_peak_host'])} / {pct(r['kv_demand_mean_host'])} | "
                   f"{pct(r['idle_prefill_frac'])} / {pct(r['idle_decode_frac'])} | {r['regime']} |")
    return "\n".join(out)
