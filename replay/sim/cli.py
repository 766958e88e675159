"""``evolving replay`` / ``compare`` / ``sweep-static`` / ``sim-report`` / ``bench sim``: the
simulator's commands (their flags and handlers; ``bench sim``'s rows are replay/sim/bench.py).

Registered by ``replay.cli._register_sim``. Each handler turns its flags into a typed value once
(:func:`sim_spec`: a :class:`~replay.sim.inputs.SimSpec`; ``bench sim``: a
:class:`~replay.sim.bench.BenchSimSpec`) and nothing below sees the ``Namespace``. A run's inputs
(session source, configuration, profile) are read from that spec by replay/sim/inputs.py; every run is one
``replay.sim.runs.run_one`` call, which writes its full event log to DuckDB through the
recorder's :class:`~services.adapters.eventlog.DuckDbEventLog` (the same code the live recorder
uses), in batches.
"""

from __future__ import annotations

import argparse
import json
import re
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import fields
from multiprocessing import get_context
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from replay.sim.bench import DEFAULT_CALIBRATION, BenchSimSpec, cmd_bench
from replay.sim.figures import METRIC_TYPES, RunMetrics, compute_metrics
from replay.sim.inputs import SimSpec, parse_duration, profile_name, run_profile, session_source, sim_config
from replay.sim.report import print_table, to_json, write_plots
from replay.sim.stacks import parse_split
from replay.traces.importers.spec import WorkloadSpecError, parse_spec
from replay.traces.pacing import parse_pace


def from_flags(cls, args: argparse.Namespace, **given):
    """``cls`` (a dataclass of options) from the parsed flags of the same names, as vLLM's
    ``EngineArgs.from_cli_args``: flags it has no field for are left; ``given`` adds the rest."""
    flags = vars(args)
    return cls(**{f.name: flags[f.name] for f in fields(cls) if f.name in flags and f.name not in given}, **given)


def sim_spec(args: argparse.Namespace) -> SimSpec:
    """The run's options, parsed once: what ``run_one``, ``session_source`` and the rest read."""
    return from_flags(SimSpec, args)


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
                          "or gen:NAME[:key=value]... (default: the 3 test-fixture Claude Code sessions, tests/fixtures/traces/weka-claude-code; the bundled 34 the README replays: deploy/traces/calibration)")
    src.add_argument("--workload", choices=["cc", "putnam", "osworld"], help="synthetic workload")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--agents", type=int, default=None,
                      help="fixed concurrency, finished agents replaced (default: the workload's, 126 for traces)")
    load.add_argument("--arrivals", type=float, default=None, help="open arrivals: agents per minute")
    p.add_argument("--nodes", type=int, default=9)
    p.add_argument("--profile", default=None, help="deploy/profiles/<name>.toml, or a path to a profile file "
                   "(evolving calibrate writes one from a live run; default by workload)")
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

    spec = sim_spec(args)
    source, what = session_source(spec)
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    m, res = run_one(args.stack, spec, source, out, progress=not args.no_progress and not args.json)
    if args.json:
        print(json.dumps(to_json([m]), indent=2))
        return 0
    c = Console()
    print_table([m], title=f"{args.stack} on {what}, {args.nodes} nodes", console=c)
    c.print(f"simulated {res.config.end_s:.0f} s in {res.wall_s:.1f} s wall "
            f"({res.config.end_s / max(res.wall_s, 1e-9):.0f}x real time); {res.events} events"
            + (f"; event log: {out}" if out else ""))
    return 0


def _cmd_compare(args) -> int:
    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
    spec = sim_spec(args)
    source, what = session_source(spec)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    c = Console(stderr=args.json, width=max(100, 28 * (len(stacks) + 1)) if not args.json else None)
    cfg = sim_config(spec)
    logs = {name: out_dir / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.duckdb" for name in stacks}

    def line(name: str, submitted: int, finished: int, wall_s: float) -> None:
        c.print(f"[dim]{name}: {submitted} submitted, {finished} finished, "
                f"{wall_s:.1f} s wall ({cfg.end_s / max(wall_s, 1e-9):.0f}x real time)")

    jobs = _compare_jobs(spec, len(stacks))
    if jobs > 1:
        runs = _compare_parallel(stacks, spec, logs, jobs, line, progress=not args.no_progress and not args.json)
    else:
        runs = []
        for name in stacks:
            m, res = run_one(name, spec, source, logs[name], progress=not args.no_progress)
            line(name, res.submitted, res.finished, res.wall_s)
            runs.append(m)
    plots = write_plots(runs, out_dir, cfg.warmup_s, cfg.end_s, cfg.nodes)
    if args.json:
        print(json.dumps(to_json(runs), indent=2))
        return 0
    prof = run_profile(spec)
    kv = f"KV/node {prof.l1_capacity_tokens / 1e6:g}M GPU, {prof.l2_capacity_tokens / 1e6:g}M host"
    print_table(runs, title=f"{what}, {args.nodes} nodes x {profile_name(spec)} ({kv}), "
                            f"{args.duration / 60:.0f} min after {args.warmup / 60:.0f} min warm-up, seed {args.seed}",
                console=c)
    c.print("event logs: " + ", ".join(str(logs[n]) for n in stacks))
    c.print("plots: " + ", ".join(str(p) for p in plots))
    return 0


def _compare_jobs(spec: SimSpec, n_stacks: int) -> int:
    """Stacks simulated at a time: ``--jobs``, default the cores available (at most 2); 1 with
    ``--partitions`` (each run already spreads over processes)."""
    from replay.sim.runs import default_jobs  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    if spec.partitions > 1:
        return 1
    jobs = spec.jobs if spec.jobs else default_jobs()
    return max(1, min(jobs, n_stacks))


def _compare_worker(name: str, spec: SimSpec, log: str) -> tuple[RunMetrics, int, int, float]:
    """One stack of ``compare`` in a worker process: the same session source, rebuilt there
    from the same spec (sources are pure functions of it), the same ``run_one``."""
    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    source, _ = session_source(spec)
    m, res = run_one(name, spec, source, Path(log), progress=False)
    return m, res.submitted, res.finished, res.wall_s


def _compare_parallel(stacks: list[str], spec: SimSpec, logs: dict[str, Path], jobs: int, line, progress: bool) -> list:
    """Each stack in its own spawned process, ``jobs`` at a time; results in the given order.
    Each run is the same deterministic simulation as in one process (tested)."""
    results: dict[str, RunMetrics] = {}
    bar = Progress(TextColumn("[bold]compare"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeElapsedColumn(), transient=True, disable=not progress)
    with bar, ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        task = bar.add_task("stacks", total=len(stacks), info=f"{jobs} at a time")
        futs = {pool.submit(_compare_worker, name, spec, str(logs[name])): name for name in stacks}
        for f in as_completed(futs):
            name = futs[f]
            m, submitted, finished, wall_s = f.result()
            results[name] = m
            line(name, submitted, finished, wall_s)
            bar.update(task, advance=1, info=f"{name} done")
    return [results[n] for n in stacks]


def _cmd_sweep(args) -> int:
    from replay.sim.runs import run_one  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    spec = sim_spec(args)
    source, what = session_source(spec)
    runs = []
    c = Console(stderr=args.json, width=max(100, 24 * args.nodes) if not args.json else None)
    for p in range(1, args.nodes):
        m, _ = run_one(f"static:{p}P{args.nodes - p}D", spec, source, None, progress=not args.no_progress)
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


def _cmd_bench(args: argparse.Namespace) -> int:
    return cmd_bench(from_flags(BenchSimSpec, args, run=sim_spec(args)))


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
                    help="cluster sizes instead of 9 and --big-nodes: NODES[:AGENTS][@WARMUP+DURATION],... "
                         "(e.g. 9:126,96:192@1m+1m; the span defaults to --warmup/--duration)")
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
    bp.add_argument("--partition-warmup", type=parse_duration, default=None,
                    help="the partition rows' warm-up (default --warmup): a short span for 768 nodes, whose hour "
                         "the rows extrapolate")
    bp.add_argument("--partition-duration", type=parse_duration, default=None,
                    help="the partition rows' measured span (default --duration)")
    bp.add_argument("--no-partition-baseline", action="store_true",
                    help="skip the 1-partition baseline row (a 768-node single process does not fit here)")
    bp.add_argument("--calibration", default=str(DEFAULT_CALIBRATION),
                    help="recorded sessions for the calibration rows (126 agents at agent pace, 9 nodes, the event "
                         "log written; default deploy/traces/calibration-100; '' skips them)")
    bp.add_argument("--calibration-runs", default="nolog,before,full,decisions",
                    help="calibration rows, comma-separated: nolog, before (log format 1 in the simulation's thread: "
                         "the path before format 2), full, decisions (the current format, writer thread, --log-level)")
    bp.add_argument("--calibration-profile", default=None,
                    help="the calibration rows' profile (e.g. gb300-glm52-pressure, the experiments' own; default "
                         "the trace's)")
    bp.add_argument("--json", action="store_true", help="the rows as JSON on stdout (progress on stderr)")
    bp.set_defaults(func=_cmd_bench, profile=None, start=None, fast=False, json=False, no_progress=True,
                    trace=None, arrivals=None)
