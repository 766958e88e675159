"""``evolving serve <service>``, ``evolving up``, ``evolving bench live`` and ``evolving drive``
(services/drivers/gateway/cli.py)."""

from __future__ import annotations

import asyncio
import json

from services.drivers.gateway.cli import register_drive
from services.drivers.options import add_service_args, service_options
from services.drivers.services import SERVICES
from services.drivers.up.options import add_up_args, up_spec


def register(sub, bench) -> None:
    p = sub.add_parser("serve", help="run one live service (directory, planner, router, recorder)")
    services = p.add_subparsers(dest="service", metavar="SERVICE", required=True)
    for kind in SERVICES:
        sp = services.add_parser(kind, help=f"the live {kind} service (same as python -m services.drivers.serve {kind})")
        add_service_args(sp, kind)
        sp.set_defaults(func=_serve(kind))

    p = sub.add_parser("up", help="start NATS, the services, sim engines and the gateway; Ctrl-C stops all")
    add_up_args(p)
    p.set_defaults(func=_up)

    p = bench.add_parser("live", help="live path over NATS: route latency, fold rates, recorder, gateway req/s")
    p.add_argument("--nats-url", default=None, help="use this server (default: an embedded nats-server)")
    p.add_argument("--rate", type=float, default=100.0, help="requests/s for the route latency test")
    p.add_argument("--requests", type=int, default=1000, help="requests timed at --rate")
    p.add_argument("--fold-events", type=int, default=50000, help="events for the fold-rate comparison")
    p.add_argument("--gateway-requests", type=int, default=200,
                   help="requests through gateway -> router -> sim engines (0: skip)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_bench)

    register_drive(sub)


def _serve(kind: str):
    def run(args) -> int:
        from services.drivers.serve import serve_async  # lazy: evolving --help +100 ms (runner, duckdb)

        try:
            return asyncio.run(serve_async(service_options(kind, args)))
        except KeyboardInterrupt:
            return 0

    return run


def _up(args) -> int:
    from services.drivers.up.launch import cmd_up  # lazy: evolving --help +100 ms (duckdb, serve)

    return cmd_up(up_spec(args))


def _bench(args) -> int:
    from services.drivers.up import bench  # lazy: evolving --help +130 ms (serve)

    spec = bench.LiveBenchSpec(nats_url=args.nats_url, rate=args.rate, requests=args.requests,
                               fold_events=args.fold_events, gateway_requests=args.gateway_requests)
    res = asyncio.run(bench.run(spec))
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        bench.print_report(res)
    return 0
