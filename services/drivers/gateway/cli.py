"""``evolving drive TRACE --gateway URL [--concurrency N] [--speedup X]`` (services/drivers/gateway/drive.py).

``register_drive(sub)`` adds the subcommand; ``services/drivers/up/cli.py`` calls it when present.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from dataclasses import asdict


def register_drive(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drive", help="replay agent sessions through a running gateway over HTTP (closed loop)")
    p.add_argument("trace", help="a workload spec: session JSONL file or directory, another trace format "
                                 "(told by content, or FORMAT:PATH such as mooncake:t.jsonl) or gen:NAME[:k=v]...")
    p.add_argument("--gateway", default="http://127.0.0.1:8000", help="gateway base URL")
    p.add_argument("--concurrency", type=int, default=8, help="sessions running at once")
    p.add_argument("--speedup", type=float, default=1.0, help="divide every pause by this factor")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N sessions")
    p.add_argument("--model", default="evolving-sim")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per HTTP request")
    p.add_argument("--run-id", default=None, help="branch id prefix (default: random, so reruns never clash)")
    p.add_argument("--wait-s", type=float, default=30.0,
                   help="wait this long for the gateway's /health before starting (0: do not wait)")
    p.add_argument("--no-stream", action="store_true", help="non-streaming requests (no client TTFT)")
    p.add_argument("--api-key", default=None,
                   help="API key for a gateway started with keys (default: env EI_API_KEY)")
    p.add_argument("--out", default=None, help="write one JSON line per request here (also after Ctrl-C)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is shown only when stderr is a terminal)")
    p.set_defaults(func=_cmd_drive)


def _cmd_drive(args: argparse.Namespace) -> int:
    from replay.traces.format import TraceFormatError  # lazy: evolving --help +60 ms (the trace importers)
    from replay.traces.importers.spec import (  # lazy: as above
        WorkloadSpecError,
        load_workload,
        skipped_lines,
    )
    from services.drivers.gateway.drive import DriveConfig, DriveProgress, Driver, drive  # lazy: as above

    try:  # the workload-spec parser every trace-taking command shares (replay/traces/importers/spec.py)
        w = load_workload(args.trace, require_sessions=False)
    except (OSError, TraceFormatError, WorkloadSpecError) as exc:
        print(f"evolving drive: {exc}", file=sys.stderr)
        return 2
    for line in skipped_lines(w.skipped):  # a folder's unreadable files: listed, the rest driven
        print(f"evolving drive: {line}", file=sys.stderr)
    sessions = w.sessions
    if args.limit is not None:
        sessions = sessions[: args.limit]
    if not sessions:
        print(f"evolving drive: no sessions in {args.trace}", file=sys.stderr)
        return 2
    if args.concurrency < 1 or args.speedup <= 0:
        print("evolving drive: --concurrency must be >= 1 and --speedup > 0", file=sys.stderr)
        return 2
    run_id = args.run_id if args.run_id is not None else f"d{uuid.uuid4().hex[:6]}-"
    cfg = DriveConfig(gateway=args.gateway, concurrency=args.concurrency, speedup=args.speedup,
                      model=args.model, timeout_s=args.timeout_s, run_id=run_id, stream=not args.no_stream,
                      wait_s=args.wait_s, api_key=args.api_key or os.environ.get("EI_API_KEY") or None)
    show = not args.no_progress and sys.stderr.isatty()

    async def main():
        if not show:
            return await drive(Driver(cfg), sessions)
        with DriveProgress(len(sessions)) as progress:
            return await drive(Driver(cfg), sessions, progress)

    try:
        report = asyncio.run(main())
    except TimeoutError as exc:
        print(f"evolving drive: {exc}", file=sys.stderr)
        return 3
    if args.out:
        with open(args.out, "w") as fh:
            fh.writelines(json.dumps(asdict(r)) + "\n" for r in report.results)
    summary = report.summary()
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for k, v in summary.items():
            print(f"{k:>20}: {v}")
    if report.interrupted:
        print(f"evolving drive: interrupted after {report.sessions}/{len(sessions)} sessions"
              + (f"; {args.out} holds the requests done" if args.out else ""), file=sys.stderr)
        return 130
    return 0 if not report.failed else 1
