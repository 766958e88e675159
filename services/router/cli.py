"""``evolving bench router``: the router's benchmark command (see services/router/bench.py)."""

from __future__ import annotations

import argparse
import json


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _bench(args: argparse.Namespace) -> int:
    from services.router.bench import format_report, run

    result = run(router=args.router, baselines=tuple(b for b in args.baselines.split(",") if b),
                 sizes=_sizes(args.sizes), requests=args.requests, agents=args.agents,
                 prompt_blocks=args.prompt_blocks, new_blocks=args.new_blocks, repeats=args.repeats)
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else format_report(result))
    return 0


def register(sub, bench) -> None:
    p = bench.add_parser("router", help="router decision time (decisions/s, p50/p99) vs baseline routers")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--router", default="evolving", help="router plug-in to measure (entry-point name)")
    p.add_argument("--baselines", default="round_robin,cache_aware", help="comma-separated plug-in names")
    p.add_argument("--sizes", default="9,64", help="comma-separated prefill node counts")
    p.add_argument("--requests", type=int, default=1500, help="decisions per run")
    p.add_argument("--agents", type=int, default=48, help="branches whose contexts share the pool")
    p.add_argument("--prompt-blocks", type=int, default=1000, help="blocks per prompt")
    p.add_argument("--new-blocks", type=int, default=100, help="new (uncached) blocks per prompt")
    p.add_argument("--repeats", type=int, default=3, help="alternating runs; each router keeps its best")
    p.set_defaults(func=_bench)
