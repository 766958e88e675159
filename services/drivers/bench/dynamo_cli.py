"""``evolving bench dynamo``'s command line: the offline part (services/drivers/bench/dynamo.py)
and the live one (services/drivers/bench/dynamo_live.py), each run only when asked, their rows
printed together (docs/experiments.md, "Against the real Dynamo")."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from services.drivers.bench.dynamo import DYNAMO_PYTHON, ROOT, OfflineSpec, print_table, run_offline


def add_arguments(p) -> None:
    p.add_argument("--offline", action="store_true", help="trace replay on both sides (the default mode)")
    p.add_argument("--live", action="store_true", help="Dynamo's frontend + mockers and evolving up serving the "
                   "same trace through one client (services/drivers/bench/dynamo_live.py); with --offline: both")
    p.add_argument("--trace", default=str(ROOT / "deploy" / "traces" / "calibration"))
    p.add_argument("--sessions", type=int, default=None, help="sessions of the trace (offline 30, live 12)")
    p.add_argument("--turns", type=int, default=None, help="requests kept per session, its first ones (offline 8, live 6)")
    p.add_argument("--concurrency", type=int, default=None, help="sessions at a time on both sides (default: --sessions)")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--profile", default="gb300-glm52-pressure")
    p.add_argument("--prefill", type=int, default=6, help="offline: prefill workers / nodes")
    p.add_argument("--decode", type=int, default=3, help="offline: decode workers / nodes")
    p.add_argument("--stacks", default="dynamo,evolving,static:4P5D",
                   help="offline: our stacks (ours named dynamo is the row dynamo-style: Dynamo's KV router at the "
                        "split, no planner, as its replay runs; dynamo-planned: the matrix's Dynamo baseline, "
                        "planner and cache-aware routing, at the split)")
    p.add_argument("--engines", type=int, default=4, help="live: aggregated mocker workers / collocated sim engines")
    p.add_argument("--speedup", type=float, default=10.0, help="live: the client divides the trace's pauses by this")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="live: engines' model seconds per wall second (mocker --speedup-ratio, up --time-scale)")
    p.add_argument("--overhead-requests", type=int, default=100,
                   help="live: max_tokens-1 requests at 1 and at 8 clients for the serving-path overhead (0: none)")
    p.add_argument("--idle-s", type=float, default=10.0,
                   help="live: measure each stack's idle CPU this long before the trace (0: not)")
    p.add_argument("--live-stacks", default="dynamo,evolving", help="live: which stacks serve: dynamo, evolving, evolving:CHECKOUT (evolving up run from another "
                   "checkout, e.g. a worktree of an older commit, for before / after)")
    p.add_argument("--pace", default="agent:60:10", help="client pauses written into the trace: recorded, "
                   "agent[:TOOL_CAP[:HUMAN_CAP]] or scale:X (docs/traces.md), the README demo's by default")
    p.add_argument("--dynamo-python", default=str(DYNAMO_PYTHON), help="the python of the venv with ai-dynamo")
    p.add_argument("--keep", default=None, help="a folder to keep the trace, the NPZ, Dynamo's output and our "
                   "stacks' event logs in (offline/<stack>.duckdb: evolving sim-report / sql / verify read them; live: "
                   "the live stacks' logs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order-seed", type=int, default=None, help="offline: shuffle the order of the sessions in the trace "
                   "file both sides read (the routing order of the first turns, all at t = 0); default: the trace's")
    p.add_argument("--warmup", type=float, default=120.0, help="offline: our stacks' warm-up in seconds (evolving "
                   "serves collocated, fits, then takes its first split; baselines serve their split from 0); "
                   "every request counts")
    p.add_argument("--start", choices=("split", "collocated"), default="split", help="offline: evolving serves the "
                   "--prefill/--decode split from t = 0 as Dynamo's workers (its planner moves when sure), or warms up "
                   "collocated and picks its first split")
    p.add_argument("--host-kv-tokens", type=int, default=None, help="offline: our nodes' host (L2) KV tokens "
                   "(default: the profile's; 0: none, as the mocker; dynamo-style has none either way)")
    p.add_argument("--json", action="store_true")


def _bench_dynamo(args) -> int:
    offline = args.offline or not args.live
    results: list[dict] = []
    tmp = None
    work = Path(args.keep) if args.keep else None
    if work is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench-dynamo-")
        work = Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    try:
        if offline:
            sessions = args.sessions or 30
            spec = OfflineSpec(trace=args.trace, sessions=sessions, turns=args.turns or 8,
                               block_tokens=args.block_tokens, concurrency=args.concurrency or sessions,
                               profile=args.profile, prefill=args.prefill, decode=args.decode,
                               stacks=tuple(s for s in args.stacks.split(",") if s), pace=args.pace, seed=args.seed,
                               warmup_s=args.warmup, host_kv_tokens=args.host_kv_tokens, start=args.start,
                               order_seed=args.order_seed)
            (work / "offline").mkdir(exist_ok=True)
            results.append(run_offline(spec, Path(args.dynamo_python), work / "offline", keep_logs=bool(args.keep)))
        if args.live:
            from services.drivers.bench import dynamo_live as live  # lazy: aiohttp, only for --live

            sessions = args.sessions or 12
            lspec = live.LiveSpec(trace=args.trace, sessions=sessions, turns=args.turns or 6,
                                  concurrency=args.concurrency or sessions, engines=args.engines,
                                  profile=args.profile, pace=args.pace, speedup=args.speedup,
                                  time_scale=args.time_scale, block_tokens=args.block_tokens,
                                  overhead_requests=args.overhead_requests, idle_s=args.idle_s,
                                  stacks=tuple(s for s in args.live_stacks.split(",") if s))
            results.append(live.run_live(lspec, work / "live", Path(args.dynamo_python)))
    finally:
        if tmp is not None:
            tmp.cleanup()
    if args.json:
        out = results[0] if len(results) == 1 else {
            "rows": [r for res in results for r in res["rows"]], "offline": results[0], "live": results[1]}
        print(json.dumps(out))
        return 0
    if offline:
        print_table(results[0])
    if args.live:
        live.print_live(results[-1])
    return 0


def register(sub, bench) -> None:
    p = bench.add_parser("dynamo", help="the real NVIDIA Dynamo (ai-dynamo) beside our simulator's stacks")
    add_arguments(p)
    p.set_defaults(func=_bench_dynamo)
