"""``evolving bench sim``: simulated seconds per second, each size's runs side by side with
today's path, the calibration sessions' rows and the partition rows (flags: replay/sim/cli.py).

Every row is a dict; ``--json`` prints the list (replay/sim/scaling_plot.py draws it). A row
that one of the speed targets is about carries ``target`` (what it is measured against) and
``meets_target``; see docs/simulator.md section 8.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from replay.sim.inputs import SimSpec, parse_duration, session_source

#: ``bench sim`` runs per cluster size: label, stack, --fast, two directories (today's path before
#: the shared directory, the baseline every other row of its size is compared with)
BENCH_RUNS = {
    "evolving": ("evolving", "evolving", False, False),
    "baseline": ("evolving, two directories (before)", "evolving", False, True),
    "fast": ("evolving --fast", "evolving", True, False),
}


def _log_digest(log) -> str:
    """sha256 of the log's events (type + msgpack): equal digests = the same run, decision for decision."""
    enc, h = msgspec.msgpack.Encoder(order="deterministic"), hashlib.sha256()
    for e in log:
        h.update(type(e).__name__.encode())
        h.update(enc.encode(e))
    return h.hexdigest()


def _bench_runs(spec: str, nodes: int) -> list[tuple[str, str, bool, bool]]:
    out = []
    for name in (x.strip() for x in spec.split(",") if x.strip()):
        if name == "static":
            split = f"static:{nodes * 2 // 3}P{nodes - nodes * 2 // 3}D"
            out.append((split, split, False, False))
        elif name in BENCH_RUNS:
            out.append(BENCH_RUNS[name])
        else:
            raise SystemExit(f"error: bench sim --runs: unknown run {name!r}; known: {', '.join(BENCH_RUNS)}, static")
    return out


#: Speed targets, x real time (wall) of the evolving stack per cluster size (96 nodes: raised
#: from 30x to 60x, one partition of 768 nodes at the pace a paper-length matrix needs)
SIZE_TARGETS = {9: 150.0, 96: 60.0}
CALIBRATION_TARGET = 100.0  # the calibration sessions, 126 agents at agent pace, 9 nodes
PARTITION_HOUR_TARGET_S = 20 * 60  # 768 nodes in 8 partitions: 1 simulated hour in <= 20 min on 2 cores
LOG_HOUR_TARGET_BYTES = 50e6  # --log-level full at 9 nodes, per simulated hour
LOG_WALL_TARGET = 1.10  # the logged run's wall within 10% of the run without a log


def parse_size(text: str) -> tuple[int, int, tuple[float, float] | None]:
    """``NODES[:AGENTS][@WARMUP+DURATION]`` (e.g. ``96:192@1m+1m``): agents default 2 per node,
    the span the bench's ``--warmup``/``--duration``."""
    size, at, span = text.partition("@")
    n, _, ag = size.partition(":")
    bad = SystemExit(f"error: bench sim --sizes: bad size {text!r}; expected NODES[:AGENTS][@WARMUP+DURATION]")
    if not n.isdigit() or int(n) < 1 or (ag and not ag.isdigit()):
        raise bad
    times = None
    if at:
        w, plus, d = span.partition("+")
        try:
            times = (parse_duration(w), parse_duration(d)) if plus else None
        except argparse.ArgumentTypeError:
            times = None
        if times is None:
            raise bad
    return int(n), int(ag) if ag else 2 * int(n), times


def _target(r: dict, want_x: float | None) -> None:
    """A row's target: x real time on the wall (the target's measure), met or not."""
    if want_x is not None:
        r["target"] = f">= {want_x:g}x real time"
        r["meets_target"] = r["x_real_time"] >= want_x


def _extrapolate(r: dict) -> None:
    """A partition row's 1 simulated hour, extrapolated linearly from its span (labelled so):
    wall and CPU per simulated second times 3600; the 768-node row's target is <= 20 min wall."""
    per = 3600.0 / max(1e-9, r["simulated_s"])
    r["extrapolated_hour_wall_s"] = r["wall_s"] * per
    r["extrapolated_hour_cpu_s"] = r["cpu_s"] * per
    r["extrapolated_from_s"] = r["simulated_s"]
    if r["nodes"] == 768 and r.get("partitions", 1) == 8:
        r["target"] = "1 simulated hour in <= 20 min wall on 2 cores (extrapolated)"
        r["meets_target"] = r["extrapolated_hour_wall_s"] <= PARTITION_HOUR_TARGET_S


@dataclass(frozen=True, kw_only=True)
class BenchSimSpec:
    """``evolving bench sim``'s options, named as its flags; ``run`` holds the ones every row's
    run starts from (``--agents``, ``--duration``, ``--warmup``, ``--seed``, ``--partitions``,
    ``--jobs``), which each row varies with ``dataclasses.replace``."""

    run: SimSpec
    big_nodes: int = 96
    big_agents: int | None = None  # None: 2 per node
    sizes: str | None = None  # NODES[:AGENTS][@WARMUP+DURATION],... instead of 9 and big_nodes
    runs: str = "evolving,baseline"
    only_partitions: bool = False
    partition_nodes: int = 96
    partition_agents_per_node: float = 2.0
    partition_warmup: float | None = None  # None: run.warmup
    partition_duration: float | None = None  # None: run.duration
    no_partition_baseline: bool = False
    calibration: str = ""  # '': no calibration rows
    calibration_runs: str = "nolog,before,full,decisions"
    calibration_profile: str | None = None
    json: bool = False


def cmd_bench(spec: BenchSimSpec) -> int:
    """Simulated seconds per second, each cluster size's runs side by side with today's baseline.

    Every row is a dict (``--json`` prints the list; replay/sim/scaling_plot.py reads it). Sessions are
    generated once per cluster size and shared by its runs (timed apart: ``gen_s``); ``cpu_s`` is
    this process's CPU time for the run without generation, which a loaded machine moves much less
    than wall time; ``same_log_as_baseline``: the run's event log digest equals the baseline's."""
    from replay.sim.partitioned import bench_rows  # lazy: start-up (evolving --help skips DuckDB: +55 ms)
    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    out = sys.stderr if spec.json else sys.stdout
    rows: list[dict] = []
    big_agents = spec.big_agents if spec.big_agents is not None else 2 * spec.big_nodes
    cases = [(9, spec.run.agents, None), (spec.big_nodes, big_agents, None)]
    if spec.sizes:  # NODES[:AGENTS][@WARMUP+DURATION],... instead (agents default: 2 per node)
        cases = [parse_size(part) for part in (x.strip() for x in spec.sizes.split(",") if x.strip())]
    if spec.only_partitions:  # just the partition rows below
        cases = []
    for nodes, agents, span in cases:
        # the size rows are single-process runs; --partitions adds its own rows
        base = replace(spec.run, nodes=nodes, agents=agents, arrivals=None, trace=None, partitions=1, workload="cc")
        if span is not None:
            base = replace(base, warmup=span[0], duration=span[1])
        source, _ = session_source(base)
        source.memoize()  # generated once, shared by this size's runs
        case: list[dict] = []
        for label, stack, fast, two in _bench_runs(spec.runs, nodes):
            a = replace(base, fast=fast, two_directories=two)
            gen0, gcpu0 = source.make_s, source.make_cpu_s
            _, res = run_one(stack, a, source, None, progress=False, keep_log=True)  # the digest
            gen, gen_cpu = source.make_s - gen0, source.make_cpu_s - gcpu0
            wall = max(1e-9, res.wall_s - gen)  # session generation reported apart
            cpu = max(1e-9, res.cpu_s - gen_cpu)
            r = {"nodes": nodes, "agents": agents, "run": label, "stack": stack, "simulated_s": res.config.end_s,
                 "wall_s": wall, "x_real_time": res.config.end_s / wall, "cpu_s": cpu,
                 "x_real_time_cpu": res.config.end_s / cpu, "events": len(res.log),
                 "events_per_s": len(res.log) / wall, "events_per_cpu_s": len(res.log) / cpu,
                 "finished": res.finished, "gen_s": gen, "gen_cpu_s": gen_cpu, "baseline": two,
                 "x_real_time_with_gen": res.config.end_s / max(1e-9, res.wall_s),
                 "x_real_time_cpu_with_gen": res.config.end_s / max(1e-9, res.cpu_s),
                 "digest": _log_digest(res.log), "load_avg_1m": os.getloadavg()[0]}
            _target(r, SIZE_TARGETS.get(nodes) if stack == "evolving" and not two and not fast else None)
            case.append(r)
            print(f"{nodes} nodes, {agents} agents, {label}: {r['x_real_time']:.1f}x real time, "
                  f"{r['x_real_time_cpu']:.1f}x per CPU s ({res.config.end_s:.0f} s simulated in {wall:.1f} s wall, "
                  f"{cpu:.1f} s CPU, + {gen:.1f} s generating sessions; {len(res.log)} events; "
                  f"load {r['load_avg_1m']:.1f})", flush=True, file=out)
            del res
        ref = next((r for r in case if r["baseline"]), None)
        for r in case if ref is not None else ():
            r["vs_baseline_wall"] = r["x_real_time"] / ref["x_real_time"]
            r["vs_baseline_cpu"] = r["x_real_time_cpu"] / ref["x_real_time_cpu"]
            if r["stack"] == ref["stack"] and not r["run"].endswith("--fast"):  # same run, other code path
                r["same_log_as_baseline"] = r["digest"] == ref["digest"]
        rows += case
    rows += _calibration_rows(spec, out)
    if spec.run.partitions > 1:  # one cluster as 1 vs N partitions (replay/sim/partitioned.py)
        pa = spec.run
        if spec.partition_warmup is not None:
            pa = replace(pa, warmup=spec.partition_warmup)
        if spec.partition_duration is not None:
            pa = replace(pa, duration=spec.partition_duration)
        for r in bench_rows(pa, spec.partition_nodes, spec.run.partitions, spec.partition_agents_per_node,
                            spec.run.jobs, baseline=not spec.no_partition_baseline):
            _extrapolate(r)
            rows.append(r)
            print(f"{r['nodes']} nodes, {r['agents']} agents, {r['run']}: {r['x_real_time']:.2f}x real time "
                  f"({r['wall_s']:.1f} s wall end to end, {r['cpu_s']:.1f} s CPU, {r['events']} events; "
                  f"1 simulated hour extrapolated: {r['extrapolated_hour_wall_s'] / 60:.1f} min wall, "
                  f"{r['extrapolated_hour_cpu_s'] / 60:.1f} CPU-min)", flush=True, file=out)
    if spec.json:
        print(json.dumps(rows, indent=2))
        return 0
    t = Table(title=f"evolving bench sim: CC-like agents, simulated seconds per second (load {os.getloadavg()[0]:.1f})")
    for col in ("nodes", "agents", "run", "simulated s", "wall s", "x real time", "CPU s", "x per CPU s",
                "events/s", "events", "finished", "gen s", "log MB/sim min", "log write s", "close wait s",
                "vs baseline (CPU)", "same log", "target met"):
        t.add_column(col, justify="right")
    for r in rows:
        cpu = r.get("cpu_s")
        same = r.get("same_log_as_baseline")
        per_min = r.get("log_bytes_per_sim_min")
        t.add_row(str(r["nodes"]), str(r["agents"]), r["run"], f"{r['simulated_s']:.0f}", f"{r['wall_s']:.1f}",
                  f"{r['x_real_time']:.1f}", f"{cpu:.1f}" if cpu else "-",
                  f"{r['simulated_s'] / cpu:.1f}" if cpu else "-", f"{r['events_per_s']:.0f}", str(r["events"]),
                  str(r["finished"]), f"{r['gen_s']:.1f}", "-" if per_min is None else f"{per_min / 1e6:.2f}",
                  f"{r['log_write_s']:.1f}" if "log_write_s" in r else "-",
                  f"{r['log_close_wait_s']:.1f}" if "log_close_wait_s" in r else "-",
                  f"{r['vs_baseline_cpu']:.2f}x" if "vs_baseline_cpu" in r else "-",
                  "-" if same is None else ("yes" if same else "NO"),
                  "-" if "meets_target" not in r else ("yes" if r["meets_target"] else "NO"))
    Console(width=170).print(t)
    return 0


#: ``bench sim``'s rows on recorded sessions: label -> (log format, written in the
#: simulation's thread, log level, writes a log). Format ``None`` is the current one
#: (``services.adapters.eventlog.columnar.FORMAT``, the ``{fmt}`` of the label); ``before`` is the
#: deliberate old-format baseline: format 1, written in the simulation's thread, as before format 2.
CALIBRATION_RUNS = {
    "nolog": ("no log", None, False, "full", False),
    "before": ("log v1 inline (before)", "1", True, "full", True),
    "full": ("log v{fmt} full", None, False, "full", True),
    "decisions": ("log v{fmt} decisions", None, False, "decisions", True),
}
#: The 100 calibration sessions, shipped with the repository (deploy/traces/calibration-100/README.md).
DEFAULT_CALIBRATION = Path(__file__).resolve().parents[2] / "deploy" / "traces" / "calibration-100"


def _calibration_rows(spec: BenchSimSpec, out) -> list[dict]:
    """The calibration sessions at agent pace on 9 nodes, each run once per ``--calibration-runs``
    entry, with the event log written to a temporary folder: wall, CPU, events/s, x real time,
    log bytes per simulated minute, the writer's busy time and how long closing the log waited
    after the last simulated event; ``vs_nolog_wall``: the run's wall over the no-log run's."""
    import tempfile  # lazy: only the calibration rows

    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)
    from services.adapters.eventlog.columnar import FORMAT as CURRENT_FORMAT  # lazy: pyarrow, for these rows

    path = spec.calibration
    if not path:
        return []
    if not Path(path).exists():
        print(f"note: no calibration sessions at {path}: their rows are left out (--calibration PATH)", file=out)
        return []
    names = [x.strip() for x in spec.calibration_runs.split(",") if x.strip()]
    unknown = [x for x in names if x not in CALIBRATION_RUNS]
    if unknown:
        raise SystemExit(f"error: bench sim --calibration-runs: unknown run {unknown[0]!r}; "
                         f"known: {', '.join(CALIBRATION_RUNS)}")
    agents = spec.run.agents
    base = replace(spec.run, nodes=9, arrivals=None, trace=str(path), workload=None, pace="agent", partitions=1,
                   profile=spec.calibration_profile)
    t0, c0 = time.perf_counter(), time.process_time()
    source, what = session_source(base)  # the import (cached: replay/traces/importers/cache.py) and pacing
    import_s, import_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    print(f"calibration sessions: {what}, imported in {import_s:.1f} s ({import_cpu_s:.1f} s CPU)", flush=True, file=out)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ei-bench-sim-") as tmp:
        for name in names:
            label, fmt, sync, level, logged = CALIBRATION_RUNS[name]
            label = label.format(fmt=fmt or CURRENT_FORMAT)
            # the baseline row is the path before format 2 as it was: batches of 20,000 rows
            a = replace(base, log_format=fmt, log_sync=sync, log_level=level,
                        log_batch=20_000 if name == "before" else None)
            log_path = Path(tmp) / f"{name}.duckdb" if logged else None
            _, res = run_one("evolving", a, source, log_path, progress=False, keep_log=True)  # the digest
            wall, cpu, sim_s = max(1e-9, res.wall_s), max(1e-9, res.cpu_s), res.config.end_s
            st = res.log_stats
            r = {"nodes": 9, "agents": agents, "run": f"calib {label}", "stack": "evolving",
                 "workload": what, "simulated_s": sim_s, "wall_s": wall, "x_real_time": sim_s / wall, "cpu_s": cpu,
                 "x_real_time_cpu": sim_s / cpu, "events": len(res.log), "events_per_s": len(res.log) / wall,
                 "events_per_cpu_s": len(res.log) / cpu, "finished": res.finished, "gen_s": 0.0,
                 "baseline": name == "before", "calibration": name, "digest": _log_digest(res.log),
                 "import_s": import_s, "import_cpu_s": import_cpu_s, "load_avg_1m": os.getloadavg()[0],
                 "profile": base.profile or "(the trace's)",
                 # as `evolving replay --out` runs it: the sessions' import (cached) and the run with its log
                 "x_real_time_with_import": sim_s / (wall + import_s),
                 "x_real_time_cpu_with_import": sim_s / (cpu + import_cpu_s), **st}
            _target(r, CALIBRATION_TARGET)
            if logged:
                r["log_bytes_per_sim_min"] = st["log_bytes"] / (sim_s / 60)
                r["log_bytes_per_sim_hour"] = st["log_bytes"] / (sim_s / 3600)
                if level == "full" and st["log_events"] != len(res.log):
                    raise SystemExit(f"error: bench sim: {label}: {st['log_events']} events stored of {len(res.log)}")
            rows.append(r)
            log_txt = (f"; log {st['log_bytes'] / 1e6:.1f} MB ({r['log_bytes_per_sim_hour'] / 1e6:.1f} MB per simulated "
                       f"hour), writer busy {st['log_write_s']:.1f} s ({st['log_write_cpu_s']:.1f} s CPU), close waited "
                       f"{st['log_close_wait_s']:.1f} s"
                       if logged else "")
            print(f"9 nodes, {agents} agents, calibration, {label}: {r['x_real_time']:.1f}x real time "
                  f"({sim_s:.0f} s simulated in {wall:.1f} s wall, {cpu:.1f} s CPU; {len(res.log)} events{log_txt}; "
                  f"load {r['load_avg_1m']:.1f})", flush=True, file=out)
            del res
    ref = next((r for r in rows if r["calibration"] == "nolog"), None)
    before = next((r for r in rows if r["calibration"] == "before"), None)
    for r in rows:
        if ref is not None:
            r["vs_nolog_wall"] = r["wall_s"] / ref["wall_s"]
            r["vs_nolog_cpu"] = r["cpu_s"] / ref["cpu_s"]
            r["same_log_as_baseline"] = r["digest"] == ref["digest"]
        if before is not None and "log_bytes" in r:
            r["log_bytes_vs_before"] = r["log_bytes"] / before["log_bytes"]
        if before is not None:
            r["vs_baseline_wall"] = before["wall_s"] / r["wall_s"]
            r["vs_baseline_cpu"] = before["cpu_s"] / r["cpu_s"]
        if r["calibration"] == "full" and ref is not None:  # the log targets
            r["log_target"] = (f"<= {LOG_HOUR_TARGET_BYTES / 1e6:g} MB per simulated hour, wall within "
                               f"{LOG_WALL_TARGET - 1:.0%} of the run without a log")
            r["meets_log_target"] = (r["log_bytes_per_sim_hour"] <= LOG_HOUR_TARGET_BYTES
                                     and r["vs_nolog_wall"] <= LOG_WALL_TARGET)
    return rows
