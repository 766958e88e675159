"""``evolving experiments``: the paper's evaluation matrix (METHOD.md §5, §6) on the simulator.

Each experiment is a list of runs (replay/experiments/matrix.py); each run is one
``replay.sim.runs.run_one`` call (the same code ``evolving replay`` / ``compare`` use: session
source, profile with the KV flags, stack composition, the DuckDB recorder) with its own
command-line flags, parsed by the same parser ``compare`` uses (replay/experiments/run.py). One
DuckDB event log per run goes to ``OUT_DIR/<experiment>/<run>.duckdb``; each experiment prints
its table with ratios against Evolving Infra (the first column) and writes PNG plots next to the
logs (replay/experiments/plots.py). ``--quick`` shortens every run and keeps a subset of rows
(labelled "quick" everywhere); the full matrix uses METHOD's 30 min warm-up and 1 h runs.

A row that needs a piece the simulator does not have yet says ``not available: needs X``
instead of running something else under its name.

Experiments (docs/experiments.md has the commands, the claims and the measured figures):

- ``cc-90``, ``cc-108``, ``cc-126``, ``putnam-224``, ``osworld-128``: stationary runs at fixed
  concurrency, Evolving Infra against Dynamo, Arrow and the paper's best static SGLang split.
- ``ablation-4p5d``: a fixed 4P5D split, our stack with one part at a time swapped back
  (router: cache-aware, load-balancing; data plane: fetch at prefill start, node-local caches;
  eviction: LRU), and a baseline router with the asynchronous fetch added.
- ``start-split``: Evolving Infra started at 1P8D / 4P5D / 8P1D: where does it converge?
- ``shifting``: a schedule of workload mixes over time (Putnam -> mixed -> OSWorld).
- ``open-arrivals``: Poisson agent arrivals at a rate; the highest swept rate at which each
  stack still meets a P95 TTFT SLO.
- ``kv-capacity``: GPU KV capacity per node swept; lost KV reuse under count-aware vs LRU.
- ``objective``: the planner's TTFT objective on Putnam-like at 256 agents: throughput against
  P95 TTFT as the objective's throughput tolerance varies, next to static splits.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from replay.sim.cli import DEFAULT_CALIBRATION, parse_duration, parse_tokens
from replay.sim.inputs import SimSpec
from replay.traces.pacing import parse_pace


def split_labels(text: str, known: set[str]) -> list[str]:
    """``--rows``' comma-separated labels, where a label may itself hold commas (the ablation's
    ``ours (least-TTFT, async, count-aware)``): from each piece on, the longest run of pieces
    that joins into a known label is one label; a piece that starts none is a label of its own
    (an unknown one, which the caller names). Whitespace around each label is dropped."""
    pieces = text.split(",")
    out: list[str] = []
    i = 0
    while i < len(pieces):
        take = 1
        for j in range(len(pieces), i + 1, -1):
            if ",".join(pieces[i:j]).strip() in known:
                take = j - i
                break
        label = ",".join(pieces[i:i + take]).strip()
        if label:
            out.append(label)
        i += take
    return out

def _cmd(args) -> int:
    from replay.experiments.matrix import matrix  # lazy: start-up (--help skips the planner: +330 ms)
    from replay.experiments.run import (  # lazy: start-up (--help skips the planner and DuckDB: +400 ms)
        missing_piece,
        run_key,
        run_matrix,
        run_parser,
    )
    from replay.sim.runs import default_jobs  # lazy: start-up (evolving --help skips DuckDB: +55 ms)

    if args.ray_shared and not args.ray:
        print("evolving experiments: --ray-shared goes with --ray ADDRESS", file=sys.stderr)
        return 2
    exps = matrix(args.quick, tiny=args.tiny, window=args.window)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        known = {e.name for e in exps}
        bad = [n for n in names if n not in known]
        if bad:
            print(f"evolving experiments: unknown experiment {', '.join(bad)}; known: {', '.join(sorted(known))}")
            return 2
        by_name = {e.name: e for e in exps}
        exps = [by_name[n] for n in dict.fromkeys(names)]  # in the order asked
    if args.rows:
        have = {r.label for e in exps for r in e.runs}
        want = set(split_labels(args.rows, have))
        if want - have:
            print(f"evolving experiments: no row {', '.join(sorted(want - have))} in "
                  f"{', '.join(e.name for e in exps)}; rows: {', '.join(sorted(have))}")
            return 2
        exps = [replace(e, runs=[r for r in e.runs if r.label in want]) for e in exps]
        exps = [e for e in exps if e.runs]
    if args.list:
        parser = run_parser()
        seen: set[str] = set()
        for e in exps:
            keys = [run_key(r, parser) for r in e.runs if not missing_piece(r, parser)]
            new = [k for k in keys if k not in seen]
            seen.update(keys)
            extra = f" ({len(e.runs) - len(new)} reused or not available)" if len(new) < len(e.runs) else ""
            print(f"{e.name:14s} {len(e.runs):2d} runs{extra}  {e.title}"
                  + (f" [QUICK: {e.quick_note}]" if e.quick_note else ""))
        print(f"{sum(len(e.runs) for e in exps)} rows, {len(seen)} simulations")
        return 0
    from replay.experiments.plots import report  # lazy: start-up (--help, --list skip matplotlib: +370 ms)

    out_dir = Path(args.out_dir)
    if args.ray_shared:  # the workers' paths: absolute, whatever their working directory
        out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    console = Console(width=max(120, 30 * 5), stderr=args.json)
    total = sum(len(e.runs) for e in exps)
    label = ("TINY matrix (test size)" if args.tiny else "QUICK matrix (short runs, subset of rows)"
             if args.quick else "full matrix")
    t0 = time.perf_counter()  # a Ray connection (or a local instance's start) is part of the wait
    executor, ray_doc = None, None
    if args.ray:
        from services.adapters.executors import RayExecutor, RayUnavailable  # lazy: ray only with --ray

        try:
            executor = RayExecutor(args.ray, num_cpus=args.jobs)
        except RayUnavailable as exc:
            print(f"evolving experiments: {exc}", file=sys.stderr)
            return 2
        jobs = executor.cpus()
        ray_doc = {"address": args.ray, "cluster": executor.describe(),
                   "logs": "written in --out-dir by the workers" if args.ray_shared else "shipped back"}
        where = f"as Ray tasks ({executor.describe()}; logs {ray_doc['logs']})"
    else:
        jobs = args.jobs or default_jobs()
        where = f"{jobs} at a time"
    console.print(f"[bold]evolving experiments: {label}, {len(exps)} experiment(s), {total} run(s), "
                  f"{where} -> {out_dir}")

    def write(summary: list[dict], complete: bool = False) -> dict:
        """summary.json after every experiment, so an interrupted matrix keeps what it ran."""
        cpu = sum(r["cpu_s"] for e in summary for r in e["runs"])
        doc = {"quick": args.quick, "tiny": args.tiny, "jobs": jobs, "ray": ray_doc, "complete": complete,
               "experiments_asked": [e.name for e in exps], "wall_s": round(time.perf_counter() - t0, 1),
               "cpu_s": round(cpu, 1), "experiments": summary}
        (out_dir / "summary.json").write_text(json.dumps(doc, indent=2))
        return doc

    def on_term(signum, frame):  # SIGTERM as Ctrl-C: stop the workers, keep the summary so far
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        summary = run_matrix(exps, out_dir, console, report=report, jobs=jobs, progress=not args.no_progress,
                             seed=args.seed, quick=args.quick or args.tiny, on_experiment=write,
                             resume=args.resume, executor=executor, ship_logs=executor is not None and not args.ray_shared)
    except KeyboardInterrupt:
        console.print(f"[red]interrupted after {(time.perf_counter() - t0) / 60:.1f} min; "
                      f"summary of the experiments done: {out_dir / 'summary.json'}")
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    wall = time.perf_counter() - t0
    doc = write(summary, complete=True)
    cpu = doc["cpu_s"]
    failed = [f"{e['name']} / {r['label']}" for e in summary for r in e["runs"] if r["status"].startswith("failed")]
    console.print(f"done in {wall / 60:.1f} min wall ({cpu / 60:.1f} CPU-min in the runs, "
                  f"{'as Ray tasks, ' if executor is not None else ''}{jobs} at a time); "
                  f"summary: {out_dir / 'summary.json'}")
    if failed:
        console.print(f"[red]{len(failed)} row(s) failed: {', '.join(failed)}")
    if args.json:
        print(json.dumps(doc, indent=2))
    return 1 if failed else 0


def _window_arg(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"bad window {text!r}: WARMUP,DURATION such as 2m,2m")
    w, d = (parse_duration(x) for x in parts)
    if w < 0 or d <= 0:
        raise argparse.ArgumentTypeError(f"bad window {text!r}: a warm-up >= 0 and a duration > 0")
    return w, d


def register(sub, bench) -> None:
    p = sub.add_parser("experiments", help="the paper's evaluation matrix on the simulator (tables, logs, plots)")
    p.add_argument("--quick", action="store_true", help="short runs and a subset of rows (minutes, labelled quick)")
    p.add_argument("--only", default="", help="comma-separated experiment names (see --list)")
    p.add_argument("--out-dir", default="runs/experiments", help="DuckDB logs, PNG plots and summary.json go here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="list the experiments and their run counts, run nothing")
    p.add_argument("--rows", default="",
                   help="comma-separated row labels: run only these rows of the experiments chosen (e.g. dynamo,arrow)")
    p.add_argument("--resume", action="store_true",
                   help="rows whose log in --out-dir holds the same simulation run to the end are read back from "
                        "it, not run again (a stopped matrix, or --rows run earlier, completes its tables)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (per run with --jobs 1; of the simulations done with workers or --ray)")
    p.add_argument("--json", action="store_true", help="also print the summary as JSON")
    p.add_argument("--jobs", type=int, default=None,
                   help="rows simulated at a time, each in its own process (default: the cores available, at "
                        "most 2; 1: in this process, in order, with a progress bar)")
    p.add_argument("--ray", default="", metavar="ADDRESS",
                   help="run each row as a Ray task on the cluster at ADDRESS (HOST:PORT of `ray start --head`; "
                        "auto: the cluster started on this machine; local: a new one for this command, --jobs "
                        "CPUs); logs and summary land in --out-dir here (needs the ray extra: "
                        "bash scripts/install_ray.sh)")
    p.add_argument("--ray-shared", action="store_true",
                   help="with --ray: --out-dir is a shared folder at the same path on every node; the workers "
                        "write the logs there instead of shipping them back")
    p.add_argument("--window", type=_window_arg, default=None, metavar="WARMUP,DURATION",
                   help="every run's warm-up and measured time, e.g. 1m,1m for a smoke test of the matrix "
                        "(default: 4m,4m with --quick, 30m,1h otherwise)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: seconds, not minutes
    p.set_defaults(func=_cmd)
    _register_regimes(sub)


# --------------------------------------------------------------------------- evolving regimes
def _token_list(text: str) -> list[int]:
    xs = [parse_tokens(x) for x in text.split(",") if x.strip()]  # a bad one: ArgumentTypeError
    if not xs:
        raise argparse.ArgumentTypeError(f"bad list {text!r}: token counts, comma-separated")
    return xs


def _number_list(kind):
    def arg(text: str) -> list:
        try:
            xs = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            xs = []
        if not xs or any(x <= 0 for x in xs):
            raise argparse.ArgumentTypeError(f"bad list {text!r}: positive numbers, comma-separated")
        return xs

    return arg


def _pace(text: str) -> str:
    try:
        parse_pace(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _cmd_regimes(args) -> int:
    from replay.experiments.regimes import (  # lazy: start-up (--help skips the simulator)
        Thresholds,
        grid,
        markdown,
        parse_cells,
        run_grid,
        summarise,
    )
    from replay.experiments.regimes_plot import plot_map  # lazy: start-up (--help skips matplotlib: +370 ms)

    out = Path(args.out)
    t = Thresholds(loaded_idle=args.loaded_idle, loaded_wait_s=args.loaded_wait, near_demand=args.near_demand, thrash_lost=args.thrash_lost,
                   kv_bound_rate=args.kv_bound_rate, near_of=args.near_of)
    if args.replot:
        if not out.is_file():
            print(f"evolving regimes: --replot reads an earlier grid's JSON and {out} does not exist: run the grid "
                  f"first, or name its file with --out (the bundled map: --out docs/regimes_map.json)", file=sys.stderr)
            return 2
        doc = summarise(json.loads(out.read_text()), t)
        out.write_text(json.dumps(doc, indent=2))
    else:
        try:
            cells = (parse_cells(args.cells, parse_tokens) if args.cells
                     else grid(args.gpu, args.host_ratios, args.agents))
        except (ValueError, argparse.ArgumentTypeError) as exc:
            print(f"evolving regimes: {exc}")
            return 2
        stacks = [s.strip() for s in args.stacks.split(",") if s.strip()]
        t0 = time.perf_counter()
        base = SimSpec(trace=args.trace, pace=args.pace, nodes=args.nodes, profile=args.profile,
                       warmup=args.warmup, duration=args.duration, seed=args.seed, fast=args.fast)
        doc = run_grid(base, cells, stacks, out, t)
        print(f"grid done in {(time.perf_counter() - t0) / 60:.1f} min wall")
    png = plot_map(doc, out.with_suffix(".png"))
    if args.markdown:
        print(markdown(doc))
    for c in doc["cells"]:
        print(f"{c['gpu_tokens'] / 1e6:g}M GPU / {c['host_tokens'] / 1e6:g}M host per node, {c['agents']} agents: "
              f"{c['regime']} ({', '.join(c['stacks'])})")
    print(f"rows: {out}; map: {png}")
    return 0


def _register_regimes(sub) -> None:
    p = sub.add_parser("regimes", help="the regime map: KV capacity x agents on recorded sessions, per stack "
                                       "(agent-bound / loaded-roomy / near capacity / thrashing), JSON + PNG")
    p.add_argument("--trace", default=str(DEFAULT_CALIBRATION),
                   help="workload spec (default: the 100 calibration sessions, deploy/traces/calibration-100)")
    p.add_argument("--pace", type=_pace, default="agent", help="client pauses (default agent: tool time kept)")
    p.add_argument("--nodes", type=int, default=9)
    p.add_argument("--profile", default=None, help="base profile (default gb300-glm52); capacities come from the grid")
    p.add_argument("--gpu", type=_token_list, default=_token_list("1M,2M,3.5M,5M"),
                   help="per-node GPU KV capacities, comma-separated (e.g. 1M,2M,3.5M,5M)")
    p.add_argument("--host-ratios", type=_number_list(float), default=[4.0],
                   help="host:GPU KV ratios, comma-separated (default 4 [M §4.1]; add 1 for the 1:1 column)")
    p.add_argument("--agents", type=_number_list(int), default=[64, 126], help="concurrencies, comma-separated")
    p.add_argument("--cells", default="", help="instead of the grid: GPU:RATIO:AGENTS,... (e.g. 2M:4:126)")
    p.add_argument("--stacks", default="evolving,dynamo", help="comma-separated stacks run at every cell")
    p.add_argument("--warmup", type=parse_duration, default=parse_duration("5m"))
    p.add_argument("--duration", type=parse_duration, default=parse_duration("10m"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-fast", dest="fast", action="store_false",
                   help="keep the separate directory core (default --fast, as the comparisons)")
    p.add_argument("--out", default="runs/regimes/regimes.json",
                   help="the rows (a later call with the same settings reuses them); the PNG map beside it")
    p.add_argument("--replot", action="store_true", help="re-classify and redraw --out, run nothing")
    p.add_argument("--markdown", action="store_true", help="also print the rows as a Markdown table")
    p.add_argument("--loaded-idle", type=float, default=0.25, help="loaded below this idle share of the busier phase")
    p.add_argument("--loaded-wait", type=float, default=1.0,
                   help="loaded as well from this mean prefill queue wait (s)")
    p.add_argument("--near-demand", type=float, default=0.70, help="near capacity from this peak KV demand share")
    p.add_argument("--near-of", choices=("gpu", "kept"), default="gpu",
                   help="near capacity's share of: the GPU tier (default) or the KV the cluster keeps (host pool)")
    p.add_argument("--thrash-lost", type=float, default=0.10, help="thrashing from this lost KV reuse")
    p.add_argument("--kv-bound-rate", type=float, default=0.80,
                   help="thrashing (KV-bound) below this share of the req/s at the roomiest capacity")
    p.set_defaults(func=_cmd_regimes)
