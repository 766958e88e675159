"""``evolving bench planner``: the planner's benchmark command (see services/planner/bench.py)."""

from __future__ import annotations

import argparse
import json


def _bench(args: argparse.Namespace) -> int:
    from services.planner.bench import format_report, run

    sizes = tuple(int(x) for x in args.sizes.split(",") if x)
    result = run(sizes=sizes, repeats=args.repeats, seed=args.seed, naive_max_nodes=args.naive_max_nodes)
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else format_report(result))
    return 0


def register(sub, bench) -> None:
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
    p.set_defaults(func=_bench)
