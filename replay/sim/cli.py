"""``evolving replay`` / ``compare`` / ``sweep-static`` / ``sim-report`` / ``bench sim``: the
simulator's commands (their flags and handlers).

Registered by ``replay.cli._register_sim``. A run's inputs (session source, configuration,
profile) are read from the flags by replay/sim/inputs.py; every run is one
``replay.sim.runs.run_one`` call, which writes its full event log to DuckDB through the
recorder's :class:`~services.adapters.eventlog.DuckDbEventLog` (the same code the live recorder
uses), in batches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from replay.sim.figures import METRIC_TYPES, RunMetrics, compute_metrics
from replay.sim.inputs import profile_name, run_profile, session_source, sim_config
from replay.sim.report import print_table, to_json, write_plots
from replay.sim.stacks import parse_split
from replay.traces.importers.spec import WorkloadSpecError, parse_spec
from replay.traces.pacing import parse_pace


def parse_duration(text: str) -> float:
    """``1h``, ``30m``, ``90s``, ``1h30m`` or plain seconds."""
    t = str(text).strip().lower()
    try:
        return float(t)
    except ValueError:
        pass
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([hms])", t)
    if not parts or "".join(a + b for a, b in parts) != t.replace(" ", ""):
        raise argparse.ArgumentTypeError(f"bad duration {text!r}: use like 1h, 30m, 90s, 1h30m")
    return sum(float(v) * {"h": 3600, "m": 60, "s": 1}[u] for v, u in parts)


def parse_tokens(text: str) -> int:
    """A token count: ``5000000``, ``5M``, ``800K``, ``1.5M`` (K = 1e3, M = 1e6, G = 1e9)."""
    t = str(text).strip().upper().replace("_", "")
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMG]?)", t)
    if not m:
        raise argparse.ArgumentTypeError(f"bad token count {text!r}: use like 5000000, 800K, 1.5M")
    n = round(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}[m.group(2)])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"bad token count {text!r}: must be positive")
    return n


def _checked(check, *errors: type[Exception]):
    """An argparse ``type=`` that runs ``check(text)`` (a validator) and turns its
    ``errors`` into a usage error naming what was wrong; the value stays the text."""

    def arg(text: str) -> str:
        try:
            check(text)
        except errors as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text

    return arg


def _split_arg(text: str) -> str:
    return _checked(parse_split, ValueError)(text)


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return n


def _pace_arg(text: str) -> str:
    return _checked(parse_pace, ValueError)(text)


def _trace_arg(text: str) -> str:
    """``--trace``: the spec's syntax checked at parse time (an unknown format is a usage error)."""
    return _checked(parse_spec, WorkloadSpecError)(text)


# --------------------------------------------------------------------------- commands
def add_run_args(p: argparse.ArgumentParser, default_duration: str = "1h", default_warmup: str = "30m") -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", type=_trace_arg,
                     help="a workload spec: trace path (session JSONL, kv-cache-tester JSON[.gz], Mooncake "
                          "JSONL, Claude Code transcripts; told by content), FORMAT:PATH (e.g. mooncake:t.jsonl) "
                          "or gen:NAME[:key=value]... (default: the bundled real Claude Code sessions)")
    src.add_argument("--workload", choices=["cc", "putnam", "osworld"], help="synthetic workload")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--agents", type=int, default=None,
                      help="fixed concurrency, finished agents replaced (default: the workload's, 126 for traces)")
    load.add_argument("--arrivals", type=float, default=None, help="open arrivals: agents per minute")
    p.add_argument("--nodes", type=int, default=9)
    p.add_argument("--profile", default=None, help="deploy/profiles/<name>.toml (default by workload)")
    p.add_argument("--duration", type=parse_duration, default=parse_duration(default_duration),
                   help="measured time after the warm-up (e.g. 1h, 20m)")
    p.add_argument("--warmup", type=parse_duration, default=parse_duration(default_warmup))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=_split_arg, default=None,
                   help="the split every node serves from t=0, for every stack (default: 6P3D for the "
                        "baselines, a collocated warm-up for evolving, the static split for static:)")
    p.add_argument("--kv-gpu-tokens", type=parse_tokens, default=None,
                   help="per-node GPU (L1) KV capacity in tokens, e.g. 5M (default: the profile's)")
    p.add_argument("--kv-host-tokens", type=parse_tokens, default=None,
                   help="per-node host (L2) KV capacity in tokens, e.g. 20M (default: the profile's)")
    p.add_argument("--fast", action="store_true",
                   help="no separate directory core (eviction reads the router's DirectoryCore)")
    p.add_argument("--pace", type=_pace_arg, default=None,
                   help="client pauses: recorded, agent[:TOOL_CAP[:HUMAN_CAP]] (tool time kept, human pauses "
                        "capped) or scale:X (default: recorded for --trace, agent for --workload)")
    p.add_argument("--partitions", type=_positive_int, default=1,
                   help="split the nodes into N partitions simulated in parallel processes, logs merged "
                        "(docs/partitions.md)")
    p.add_argument("--jobs", type=_positive_int, default=None,
                   help="with --partitions: at most this many processes (default: one per core available); "
                        "compare without --partitions: stacks simulated at a time, each in its own process "
                        "(default: the cores available, at most 2)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def _cmd_replay(args) -> int:
    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    source, what = session_source(args)
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    m, res = run_one(args.stack, args, source, out, progress=not args.no_progress and not args.json)
    if args.json:
        print(json.dumps(to_json([m]), indent=2))
        return 0
    c = Console()
    print_table([m], title=f"{args.stack} on {what}, {args.nodes} nodes", console=c)
    c.print(f"simulated {res.config.end_s:.0f} s in {res.wall_s:.1f} s wall "
            f"({res.config.end_s / max(res.wall_s, 1e-9):.0f}x real time); {len(res.log)} events"
            + (f"; event log: {out}" if out else ""))
    return 0


def _cmd_compare(args) -> int:
    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    source, what = session_source(args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    c = Console(stderr=args.json, width=max(100, 28 * (len(stacks) + 1)) if not args.json else None)
    cfg = sim_config(args)
    logs = {name: out_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.duckdb" for name in stacks}

    def line(name: str, submitted: int, finished: int, wall_s: float) -> None:
        c.print(f"[dim]{name}: {submitted} submitted, {finished} finished, "
                f"{wall_s:.1f} s wall ({cfg.end_s / max(wall_s, 1e-9):.0f}x real time)")

    jobs = _compare_jobs(args, len(stacks))
    if jobs > 1:
        runs = _compare_parallel(stacks, args, logs, jobs, line, progress=not args.no_progress and not args.json)
    else:
        runs = []
        for name in stacks:
            m, res = run_one(name, args, source, logs[name], progress=not args.no_progress)
            line(name, res.submitted, res.finished, res.wall_s)
            runs.append(m)
    plots = write_plots(runs, out_dir, cfg.warmup_s, cfg.end_s, cfg.nodes)
    if args.json:
        print(json.dumps(to_json(runs), indent=2))
        return 0
    prof = run_profile(args)
    kv = f"KV/node {prof.l1_capacity_tokens / 1e6:g}M GPU, {prof.l2_capacity_tokens / 1e6:g}M host"
    print_table(runs, title=f"{what}, {args.nodes} nodes x {profile_name(args)} ({kv}), "
                            f"{args.duration / 60:.0f} min after {args.warmup / 60:.0f} min warm-up, seed {args.seed}",
                console=c)
    c.print("event logs: " + ", ".join(str(logs[n]) for n in stacks))
    c.print("plots: " + ", ".join(str(p) for p in plots))
    return 0


def _compare_jobs(args, n_stacks: int) -> int:
    """Stacks simulated at a time: ``--jobs``, default the cores available (at most 2); 1 with
    ``--partitions`` (each run already spreads over processes)."""
    from replay.sim.runs import default_jobs  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    if getattr(args, "partitions", 1) > 1:
        return 1
    jobs = args.jobs if args.jobs else default_jobs()
    return max(1, min(jobs, n_stacks))


def _compare_worker(name: str, args, log: str) -> tuple[RunMetrics, int, int, float]:
    """One stack of ``compare`` in a worker process: the same session source, rebuilt there
    from the same flags (sources are pure functions of them), the same ``run_one``."""
    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    source, _ = session_source(args)
    m, res = run_one(name, args, source, Path(log), progress=False)
    return m, res.submitted, res.finished, res.wall_s


def _compare_parallel(stacks: list[str], args, logs: dict[str, Path], jobs: int, line, progress: bool) -> list:
    """Each stack in its own spawned process, ``jobs`` at a time; results in the given order.
    Each run is the same deterministic simulation as in one process (tested)."""
    wargs = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "func"})
    results: dict[str, RunMetrics] = {}
    bar = Progress(TextColumn("[bold]compare"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeElapsedColumn(), transient=True, disable=not progress)
    with bar, ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        task = bar.add_task("stacks", total=len(stacks), info=f"{jobs} at a time")
        futs = {pool.submit(_compare_worker, name, wargs, str(logs[name])): name for name in stacks}
        for f in as_completed(futs):
            name = futs[f]
            m, submitted, finished, wall_s = f.result()
            results[name] = m
            line(name, submitted, finished, wall_s)
            bar.update(task, advance=1, info=f"{name} done")
    return [results[n] for n in stacks]


def _cmd_sweep(args) -> int:
    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    source, what = session_source(args)
    runs = []
    c = Console(stderr=args.json, width=max(100, 24 * args.nodes) if not args.json else None)
    for p in range(1, args.nodes):
        m, _ = run_one(f"static:{p}P{args.nodes - p}D", args, source, None, progress=not args.no_progress)
        c.print(f"[dim]{m.stack}: {m.throughput_rps:.3f} req/s, TTFT P95 {m.ttft_p95_s:.2f} s")
        runs.append(m)
    best = max(runs, key=lambda m: (m.throughput_rps, -m.ttft_p95_s))
    if args.json:
        print(json.dumps({"best": best.stack, "runs": to_json(runs)}, indent=2))
        return 0
    ordered = [best] + [m for m in runs if m is not best]
    print_table(ordered, title=f"static splits on {what} (best first)", console=c)
    c.print(f"best static split: {best.stack} ({best.throughput_rps:.3f} req/s)")
    return 0


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


def _cmd_bench(args) -> int:
    """Simulated seconds per second, each cluster size's runs side by side with today's baseline.

    Every row is a dict (``--json`` prints the list; replay/sim/scaling_plot.py reads it). Sessions are
    generated once per cluster size and shared by its runs (timed apart: ``gen_s``); ``cpu_s`` is
    this process's CPU time for the run without generation, which a loaded machine moves much less
    than wall time; ``same_log_as_baseline``: the run's event log digest equals the baseline's."""
    from replay.sim.partitioned import bench_rows  # lazy: start-up (evolving --help skips DuckDB: +55 ms)
    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    out = sys.stderr if args.json else sys.stdout
    rows: list[dict] = []
    big_agents = args.big_agents if args.big_agents is not None else 2 * args.big_nodes
    cases = [(9, args.agents), (args.big_nodes, big_agents)]
    if args.sizes:  # NODES[:AGENTS],... instead (agents default: 2 per node)
        cases = []
        for part in (x.strip() for x in args.sizes.split(",") if x.strip()):
            n, _, ag = part.partition(":")
            if not n.isdigit() or int(n) < 1 or (ag and not ag.isdigit()):
                raise SystemExit(f"error: bench sim --sizes: bad size {part!r}; expected NODES or NODES:AGENTS")
            cases.append((int(n), int(ag) if ag else 2 * int(n)))
    if getattr(args, "only_partitions", False):  # just the partition rows below
        cases = []
    for nodes, agents in cases:
        base = argparse.Namespace(**vars(args))
        base.nodes, base.agents, base.arrivals, base.trace = nodes, agents, None, None
        base.partitions = 1  # the size rows are single-process runs; --partitions adds its own rows
        base.workload = "cc"
        source, _ = session_source(base)
        source.memoize()  # generated once, shared by this size's runs
        case: list[dict] = []
        for label, stack, fast, two in _bench_runs(args.runs, nodes):
            a = argparse.Namespace(**vars(base))
            a.fast, a.two_directories = fast, two
            gen0, gcpu0 = source.make_s, source.make_cpu_s
            _, res = run_one(stack, a, source, None, progress=False)
            gen, gen_cpu = source.make_s - gen0, source.make_cpu_s - gcpu0
            wall = max(1e-9, res.wall_s - gen)  # session generation reported apart
            cpu = max(1e-9, res.cpu_s - gen_cpu)
            r = {"nodes": nodes, "agents": agents, "run": label, "stack": stack, "simulated_s": res.config.end_s,
                 "wall_s": wall, "x_real_time": res.config.end_s / wall, "cpu_s": cpu,
                 "x_real_time_cpu": res.config.end_s / cpu, "events": len(res.log),
                 "events_per_s": len(res.log) / wall, "events_per_cpu_s": len(res.log) / cpu,
                 "finished": res.finished, "gen_s": gen, "gen_cpu_s": gen_cpu, "baseline": two,
                 "digest": _log_digest(res.log), "load_avg_1m": os.getloadavg()[0]}
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
    rows += _calibration_rows(args, out)
    if getattr(args, "partitions", 1) > 1:  # issue 16: one cluster as 1 vs N partitions (replay/sim/partitioned.py)
        for r in bench_rows(args, args.partition_nodes, args.partitions, args.partition_agents_per_node, args.jobs,
                            baseline=not args.no_partition_baseline):
            rows.append(r)
            print(f"{r['nodes']} nodes, {r['agents']} agents, {r['run']}: {r['x_real_time']:.2f}x real time "
                  f"({r['wall_s']:.1f} s wall end to end, {r['cpu_s']:.1f} s CPU, {r['events']} events)",
                  flush=True, file=out)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    t = Table(title=f"evolving bench sim: CC-like agents, simulated seconds per second (load {os.getloadavg()[0]:.1f})")
    for col in ("nodes", "agents", "run", "simulated s", "wall s", "x real time", "CPU s", "x per CPU s",
                "events/s", "events", "finished", "gen s", "log MB/sim min", "log write s", "close wait s",
                "vs baseline (CPU)", "same log"):
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
                  "-" if same is None else ("yes" if same else "NO"))
    Console(width=170).print(t)
    return 0


#: ``bench sim``'s rows on recorded sessions (issue 24): label -> (log format, written in the
#: simulation's thread, log level, writes a log). ``before`` is today's path before format 2.
CALIBRATION_RUNS = {
    "nolog": ("no log", None, False, "full", False),
    "before": ("log v1 inline (before)", "1", True, "full", True),
    "full": ("log v2 full", "2", False, "full", True),
    "decisions": ("log v2 decisions", "2", False, "decisions", True),
}
DEFAULT_CALIBRATION = Path(__file__).resolve().parents[3] / "shared" / "traces" / "weka-claude-code-calibration"


def _calibration_rows(args, out) -> list[dict]:
    """The calibration sessions at agent pace on 9 nodes, each run once per ``--calibration-runs``
    entry, with the event log written to a temporary folder: wall, CPU, events/s, x real time,
    log bytes per simulated minute, the writer's busy time and how long closing the log waited
    after the last simulated event; ``vs_nolog_wall``: the run's wall over the no-log run's."""
    import tempfile  # lazy: only the calibration rows

    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    path = args.calibration
    if not path:
        return []
    if not Path(path).exists():
        print(f"note: no calibration sessions at {path}: their rows are left out (--calibration PATH)", file=out)
        return []
    names = [x.strip() for x in args.calibration_runs.split(",") if x.strip()]
    unknown = [x for x in names if x not in CALIBRATION_RUNS]
    if unknown:
        raise SystemExit(f"error: bench sim --calibration-runs: unknown run {unknown[0]!r}; "
                         f"known: {', '.join(CALIBRATION_RUNS)}")
    base = argparse.Namespace(**vars(args))
    base.nodes, base.agents, base.arrivals, base.trace, base.workload = 9, args.agents, None, str(path), None
    base.pace, base.partitions = "agent", 1
    source, what = session_source(base)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ei-bench-sim-") as tmp:
        for name in names:
            label, fmt, sync, level, logged = CALIBRATION_RUNS[name]
            a = argparse.Namespace(**vars(base))
            a.log_format, a.log_sync, a.log_level = fmt, sync, level
            log_path = Path(tmp) / f"{name}.duckdb" if logged else None
            _, res = run_one("evolving", a, source, log_path, progress=False)
            wall, cpu, sim_s = max(1e-9, res.wall_s), max(1e-9, res.cpu_s), res.config.end_s
            st = res.log_stats
            r = {"nodes": 9, "agents": args.agents, "run": f"calib {label}", "stack": "evolving",
                 "workload": what, "simulated_s": sim_s, "wall_s": wall, "x_real_time": sim_s / wall, "cpu_s": cpu,
                 "x_real_time_cpu": sim_s / cpu, "events": len(res.log), "events_per_s": len(res.log) / wall,
                 "events_per_cpu_s": len(res.log) / cpu, "finished": res.finished, "gen_s": 0.0,
                 "baseline": name == "before", "calibration": name, "digest": _log_digest(res.log),
                 "load_avg_1m": os.getloadavg()[0], **st}
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
            print(f"9 nodes, {args.agents} agents, calibration, {label}: {r['x_real_time']:.1f}x real time "
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
    return rows


def _cmd_report(args) -> int:
    """Recompute the table and plots from recorded runs (metrics come from the log alone)."""
    from services.adapters.eventlog import DuckDbEventLog  # lazy: start-up (--help skips DuckDB: +55 ms)

    files = [Path(f) for f in args.logs]
    runs, cfgs = [], []
    for f in files:
        log = DuckDbEventLog(str(f), read_only=True)
        try:
            cfg = log.run_config()
            warm, dur = float(cfg["warmup_s"]), float(cfg["duration_s"])
            name = str(cfg.get("stack", f.stem)).split(": planner=")[0]
            m = compute_metrics((ev for _, _, ev in log.read(types=METRIC_TYPES)), warm, warm + dur, name)
        finally:
            log.close()
        runs.append(m)
        cfgs.append(cfg)
    if args.json:
        print(json.dumps(to_json(runs), indent=2))
        return 0
    c = Console(width=max(100, 28 * (len(runs) + 1)))
    print_table(runs, title=args.title or ", ".join(str(f) for f in files), console=c)
    if args.plots:
        cfg = cfgs[0]
        paths = write_plots(runs, args.plots, float(cfg["warmup_s"]),
                            float(cfg["warmup_s"]) + float(cfg["duration_s"]), int(cfg.get("nodes", 9)))
        c.print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def _add_log_level(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", choices=("full", "decisions"), default="full",
                   help="full (default): every event, what `evolving verify` replays; decisions: the decisions and "
                        "what the tables need (requests, iterations, nodes), no KV facts, ticks or heartbeats "
                        "(replay/sim/simlog.py)")


def register_sim(sub, bench) -> None:
    rep = sub.add_parser("sim-report", help="the comparison table (and plots) recomputed from recorded runs")
    rep.add_argument("logs", nargs="+", help="DuckDB event logs written by replay/compare (first = baseline of ratios)")
    rep.add_argument("--plots", default=None, help="write the PNG plots into this folder")
    rep.add_argument("--title", default="")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=_cmd_report)

    rp = sub.add_parser("replay", help="simulate one stack serving agent sessions on a simulated cluster")
    add_run_args(rp)
    rp.add_argument("--stack", default="evolving", help="evolving, dynamo, arrow, static:4P5D, ablations, "
                                                         "BASE+PART... (e.g. static:4P5D+round_robin+async)")
    rp.add_argument("--out", default=None, help="DuckDB file for the full event log")
    _add_log_level(rp)
    rp.set_defaults(func=_cmd_replay)

    cp = sub.add_parser("compare", help="several stacks on the identical trace: one table, plots, event logs")
    add_run_args(cp, default_duration="20m", default_warmup="10m")
    cp.add_argument("--stacks", default="evolving,dynamo,arrow,static:4P5D",
                    help="comma-separated stacks (see replay --stack)")
    cp.add_argument("--out-dir", default="runs/compare", help="event logs (DuckDB) and PNG plots go here")
    _add_log_level(cp)
    cp.set_defaults(func=_cmd_compare)

    sp = sub.add_parser("sweep-static", help="find the best static split for a workload")
    add_run_args(sp)
    sp.set_defaults(func=_cmd_sweep)

    bp = bench.add_parser("sim", help="simulator speed: simulated seconds per second, 9 and 96 nodes, beside "
                                      "today's path (two directories)")
    bp.add_argument("--agents", type=int, default=126, help="CC-like agents on 9 nodes")
    bp.add_argument("--duration", type=parse_duration, default=parse_duration("3m"))
    bp.add_argument("--warmup", type=parse_duration, default=parse_duration("3m"))
    bp.add_argument("--big-nodes", type=int, default=96,
                    help="the large cluster (default 96: one partition of the paper's 768 nodes)")
    bp.add_argument("--big-agents", type=int, default=None,
                    help="CC-like agents on the large cluster (default 2 per node: the paper-scale run's "
                         "1,536 agents on 768 nodes)")
    bp.add_argument("--sizes", default=None,
                    help="cluster sizes instead of 9 and --big-nodes: NODES[:AGENTS],... (e.g. 9:126,96:192)")
    bp.add_argument("--runs", default="evolving,baseline",
                    help="runs per size, comma-separated: evolving, baseline (two directories: the path before "
                         "the shared directory), fast (--fast), static (a 2/3 prefill static split)")
    bp.add_argument("--seed", type=int, default=0)
    bp.add_argument("--partitions", type=_positive_int, default=1,
                    help="add the partition rows: --partition-nodes nodes as 1 partition and as N partitions")
    bp.add_argument("--partition-nodes", type=_positive_int, default=96, help="the partitioned cluster's nodes")
    bp.add_argument("--partition-agents-per-node", type=float, default=2.0,
                    help="CC-like agents per node in the partition rows (2: the 768-node run's 1,536)")
    bp.add_argument("--jobs", type=_positive_int, default=None,
                    help="processes for the partition rows (default: one per core available)")
    bp.add_argument("--only-partitions", action="store_true", help="only the partition rows")
    bp.add_argument("--no-partition-baseline", action="store_true",
                    help="skip the 1-partition baseline row (a 768-node single process does not fit here)")
    bp.add_argument("--calibration", default=str(DEFAULT_CALIBRATION),
                    help="recorded sessions for the calibration rows (126 agents at agent pace, 9 nodes, the event "
                         "log written; default ../shared/traces/weka-claude-code-calibration; '' skips them)")
    bp.add_argument("--calibration-runs", default="nolog,before,full,decisions",
                    help="calibration rows, comma-separated: nolog, before (log format 1 in the simulation's thread: "
                         "the path before format 2), full, decisions (format 2, writer thread, --log-level)")
    bp.add_argument("--json", action="store_true", help="the rows as JSON on stdout (progress on stderr)")
    bp.set_defaults(func=_cmd_bench, profile=None, start=None, fast=False, json=False, no_progress=True,
                    trace=None, arrivals=None)
