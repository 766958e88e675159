"""``evolving bench directory``: the directory's benchmark command (see services/directory/bench.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _bench(args: argparse.Namespace) -> int:
    from services.directory.bench import DEFAULT_TRACES, format_report, run

    result = run(
        trace_dir=Path(args.traces) if args.traces else DEFAULT_TRACES,
        min_requests=args.min_requests,
        min_blocks=args.min_blocks,
        repeats=args.repeats,
    )
    print(json.dumps(result, indent=2, sort_keys=True) if args.json else format_report(result))
    return 0


def register(sub, bench) -> None:
    p = bench.add_parser("directory", help="KV directory: lookup+update throughput vs a bare dict")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.add_argument("--traces", default=None, help="folder of weka Claude Code trace JSON files")
    p.add_argument("--min-requests", type=int, default=3000)
    p.add_argument("--min-blocks", type=int, default=5_000_000)
    p.add_argument("--repeats", type=int, default=3, help="alternating runs; the best of each is kept")
    p.set_defaults(func=_bench)
