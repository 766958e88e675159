"""``evolving soak``: the command (``register`` adds it to the ``evolving`` parser)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from pathlib import Path


def register(sub, bench) -> None:
    p = sub.add_parser("soak", help="bounded soak of `evolving up`: Poisson chat load over agent streams; latency, "
                                    "RSS and fds over time, every event recorded, verify")
    p.add_argument("--duration", default="10m", help="how long to send (seconds, or 90s / 10m / 1h; default 10m)")
    p.add_argument("--rate", type=float, default=5.0, help="Poisson arrivals per second (default 5)")
    p.add_argument("--streams", type=int, default=8, help="concurrent agent streams (multi-turn sessions; default 8)")
    p.add_argument("--turns", type=int, default=None,
                   help="requests per session; the last ends its branch (default 6; with --trace 8: each "
                        "session cut to its first 8 requests)")
    p.add_argument("--fork-every", type=int, default=3,
                   help="every k-th turn is a one-request fork of the session's branch (0: none; default 3)")
    p.add_argument("--system-tokens", type=int, default=1024, help="shared system prompt length (default 1024)")
    p.add_argument("--user-tokens", type=int, default=192, help="new prompt text per turn (default 192)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", type=int, default=4, help="sim engines of the `up` the soak starts (default 4)")
    p.add_argument("--profile", default="gb300-glm52", help="the engines' profile (deploy/profiles/NAME.toml or a path)")
    p.add_argument("--kv-capacity-tokens", type=int, default=131_072,
                   help="GPU KV tokens per engine (host KV: twice), written into a copy of --profile so the KV "
                        "directory fills and evicts within the soak (0: the profile's own; default 131072)")
    p.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `evolving up`, e.g. --up-arg=--prefill=2 (repeatable)")
    p.add_argument("--ready-file", default=None,
                   help="attach to a running `evolving up --ready-file FILE` instead of starting one "
                        "(it is left running; the log is checked through a live snapshot)")
    p.add_argument("--run-dir", default=None, help="the started up's run directory (default: runs/soak-<timestamp>)")
    p.add_argument("--interval", default=None, help="latency interval (default: duration/60, at least 1 s)")
    p.add_argument("--sample", default=None, help="RSS/fd sampling period (default: duration/120, 1-5 s)")
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--max-rss-slope", type=float, default=1.0, help="MB/min per process over the second half (1.0)")
    p.add_argument("--max-fd-slope", type=float, default=0.5, help="fds/min per process over the second half (0.5)")
    p.add_argument("--max-latency-drift", type=float, default=0.05,
                   help="p50 latency slope as a fraction of its median per minute (0.05; p99: twice this)")
    p.add_argument("--no-verify", action="store_true", help="skip `verify` of the recorded log")
    p.add_argument("--json", action="store_true", help="print the report as JSON (no tables)")
    p.add_argument("--out", default=None, help="also write the JSON report here")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="latency, RSS and open files over time (PNG)")
    p.add_argument("--no-progress", action="store_true", help="no live display")
    g = p.add_argument_group("agent load (--trace): real agent sessions through the gateway, repeated on one "
                             "stack while busy loops compete for the CPU (docs/live.md, Liveness)")
    g.add_argument("--trace", default=None, metavar="SPEC",
                   help="replay this workload instead of the Poisson load, e.g. deploy/traces/calibration or "
                        "deploy/traces/calibration-100 (the first --sessions that fit the context)")
    g.add_argument("--sessions", type=int, default=30, help="sessions of the trace (default 30)")
    g.add_argument("--concurrency", type=int, default=30, help="sessions at a time (default 30)")
    g.add_argument("--speedup", type=float, default=100.0, help="pauses between requests divided by this (100)")
    g.add_argument("--repeat", type=int, default=2, help="times the load runs on the same stack (default 2)")
    g.add_argument("--busy", type=int, default=2,
                   help="processes `python -c 'while True: pass'` beside the stack during the load (default 2)")
    p.set_defaults(func=_cmd)


def _cmd_trace(args) -> int:
    """``--trace``: the agent load; exit 0 when nothing was lost and no node removed."""
    from services.drivers.soak.agents import AgentLoadConfig, run_agents  # lazy: aiohttp, nats, duckdb
    from services.drivers.soak.live_up import LiveUpError  # lazy: same

    if args.sessions < 1 or args.concurrency < 1 or args.repeat < 1 or args.busy < 0 or args.speedup <= 0:
        print("evolving soak: --sessions, --concurrency and --repeat must be >= 1, --busy >= 0, --speedup > 0",
              file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir) if args.run_dir else (Path(__file__).resolve().parents[3] / "runs"
                                                       / f"soak-agents-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = AgentLoadConfig(run_dir=run_dir, trace=args.trace, sessions=args.sessions, turns=args.turns or 8,
                          concurrency=args.concurrency, speedup=args.speedup, repeat=args.repeat, busy=args.busy,
                          engines=args.engines, up_args=list(args.up_arg), timeout_s=max(args.request_timeout_s, 300.0),
                          ready_file=Path(args.ready_file) if args.ready_file else None)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    logging.getLogger("nats").setLevel(logging.CRITICAL)
    say = (lambda *_: None) if args.json else (lambda line: print(line, file=sys.stderr))
    try:
        report = asyncio.run(run_agents(cfg, say))
    except LiveUpError as exc:
        print(f"evolving soak: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("evolving soak: interrupted; the stack it started is stopped", file=sys.stderr)
        return 130
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        lv, eng = report["liveness"], report["engines"]["all"]
        print(f"{'ok' if report['ok'] else 'FAILED'}: lost {report['lost']}, removals {report['removals']}, "
              f"errors on the log {lv['log_errors']}")
        for r in report["repeats"]:
            print(f"  repeat {r['repeat']}: {r['requests_ok']} ok, {r['failed']} failed in {r['wall_s']:.0f} s, "
                  f"TTFT p50 {r['ttft_p50_s']} s p95 {r['ttft_p95_s']} s" + (f"; {r['errors'][0]}" if r["errors"] else ""))
        s, late = lv["silence_at_tick_s"], lv["heartbeat_late_s"]
        print(f"  silence at ticks p50 {s['p50']} s, p99 {s['p99']} s, max {s['max']} s; heartbeat late p99 "
              f"{late['p99']} s, max {late['max']} s")
        if eng:
            print(f"  heartbeats {eng['beats']} ({eng['failed']} failed): publish p50 {eng['publish_p50_s']} s, "
                  f"p99 {eng['publish_p99_s']} s, max {eng['publish_max_s']} s; loop lag p99 "
                  f"{eng['loop_lag_p99_s']} s, max {eng['loop_lag_max_s']} s")
        for line in lv["removal_reasons"]:
            print(f"  removed {line}")
    return 0 if report["ok"] else 1


def _cmd(args) -> int:
    if args.trace:
        return _cmd_trace(args)
    args.turns = args.turns or 6
    from rich.console import Console  # lazy: evolving --help +30 ms (rich.live)
    from rich.live import Live as RichLive  # lazy: same

    from services.drivers.soak.load import LoadConfig  # lazy: evolving --help +120 ms (aiohttp)
    from services.drivers.soak.report import (  # lazy: evolving --help +400 ms (nats, duckdb)
        Display,
        plot,
        render,
    )
    from services.drivers.soak.run import (  # lazy: same
        Limits,
        Live,
        LiveUpError,
        SoakConfig,
        parse_duration,
        run_soak,
    )

    err = Console(stderr=True)
    try:
        duration = parse_duration(args.duration)
        interval = parse_duration(args.interval) if args.interval else None
        sample = parse_duration(args.sample) if args.sample else None
        if args.rate <= 0 or args.streams < 1 or args.turns < 1 or args.max_tokens < 1:
            raise ValueError("--rate must be > 0; --streams, --turns and --max-tokens >= 1")
    except ValueError as exc:
        err.print(f"evolving soak: {exc}", markup=False)
        return 2
    run_id = f"soak{time.strftime('%H%M%S')}"
    run_dir = Path(args.run_dir) if args.run_dir else Path(__file__).resolve().parents[3] / "runs" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = SoakConfig(
        duration_s=duration, run_dir=run_dir, engines=args.engines, up_args=list(args.up_arg),
        profile=args.profile, kv_capacity_tokens=args.kv_capacity_tokens,
        ready_file=Path(args.ready_file) if args.ready_file else None, interval_s=interval, sample_s=sample,
        limits=Limits(rss_mb_per_min=args.max_rss_slope, fds_per_min=args.max_fd_slope,
                      latency_p50_per_min=args.max_latency_drift, latency_p99_per_min=2 * args.max_latency_drift),
        verify=not args.no_verify,
        load=LoadConfig(gateway="", rate=args.rate, streams=args.streams, turns=args.turns,
                        fork_every=args.fork_every, system_tokens=args.system_tokens, user_tokens=args.user_tokens,
                        max_tokens=args.max_tokens, timeout_s=args.request_timeout_s, seed=args.seed, run_id=run_id))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops like Ctrl-C: up is stopped too
    logging.getLogger("nats").setLevel(logging.CRITICAL)  # reconnect tracebacks while up stops
    live = Live()
    show = not args.no_progress and err.is_terminal
    try:
        if show:
            display = Display(err)
            with RichLive(display.render(live), console=err, refresh_per_second=2, transient=True) as rl:
                report = asyncio.run(run_soak(cfg, live, lambda lv: rl.update(display.render(lv))))
        else:
            report = asyncio.run(run_soak(cfg, live))
    except LiveUpError as exc:
        err.print(f"evolving soak: {exc}", markup=False)
        return 2
    except KeyboardInterrupt:
        err.print("evolving soak: interrupted; the stack it started is stopped")
        return 130
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        render(report)
        if args.plot:
            print(f"plot: {args.plot}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # pragma: no cover
    from services.drivers.cli import main

    sys.exit(main(["soak", *sys.argv[1:]]))
