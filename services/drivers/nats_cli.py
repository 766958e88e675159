"""``evolving nats`` (run the embedded JetStream server), ``evolving bench bus`` and ``evolving
bench failover``."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import sys
import time

from rich.console import Console
from rich.table import Table

from services.adapters.bus.natsserver import EmbeddedNats


def register(sub, bench) -> None:
    p = sub.add_parser("nats", help="run the embedded nats-server with JetStream (Ctrl-C stops it)")
    p.add_argument("--port", type=int, default=None,
                   help="client port (default: NATS's 4222, which the services and `evolving serve` "
                        "connect to by default, or a free one when 4222 is taken; 0 = a free one)")
    p.add_argument("--store-dir", default=None, help="JetStream store (default: a temporary folder)")
    p.add_argument("--host", default="127.0.0.1")
    p.set_defaults(func=_cmd_nats)

    b = bench.add_parser("bus", help="publish/consume events/s through JetStream vs raw nats-py")
    b.add_argument("--events", type=int, default=100_000)
    b.add_argument("--nats-url", default=None, help="use this server instead of an embedded one")
    b.add_argument("--json", action="store_true", help="print the figures as JSON")
    b.set_defaults(func=_cmd_bench_bus)

    f = bench.add_parser("failover", help="a durable reader's stall when its consumer's nats-server is killed "
                                          "(3-server cluster): ours vs the client's 5 s API timeout")
    f.add_argument("--runs", type=int, default=3, help="pairs of runs, the order alternating (default %(default)s)")
    f.add_argument("--rate", type=float, default=20.0, help="events/s published through the kill")
    f.add_argument("--json", action="store_true", help="print the figures as JSON")
    f.set_defaults(func=_cmd_bench_failover)


def _cmd_nats(args) -> int:
    port = args.port
    note = ""
    if port is None:
        port = DEFAULT_PORT if _free(args.host, DEFAULT_PORT) else 0
        if port == 0:
            note = f" ({DEFAULT_PORT} is taken: pass this URL to the services)"
    stop = False

    def _stop(*_):
        nonlocal stop
        stop = True

    # Before the URL is printed: whoever reads it may stop us at once (a test, a script's trap),
    # and a SIGTERM that came before the handler would kill us with the server left running.
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    srv = EmbeddedNats(port=port, store_dir=args.store_dir, host=args.host).start()
    print(f"nats-server with JetStream at {srv.url} (store {srv.store_dir}); Ctrl-C to stop{note}", flush=True)
    print(f"export EI_NATS_URL={srv.url}", flush=True)
    try:
        while not stop and srv.proc and srv.proc.poll() is None:
            time.sleep(0.2)
    finally:
        srv.stop()
    return 0


#: NATS's own client port, the services' default URL (``nats://127.0.0.1:4222``).
DEFAULT_PORT = 4222


def _free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _cmd_bench_bus(args) -> int:
    from services.drivers.bench.bus import run_bench_bus  # lazy: start-up, nats-py + aiohttp ~300 ms

    res = asyncio.run(run_bench_bus(args.events, args.nats_url))
    if args.json:
        json.dump(res, sys.stdout, indent=2)
        print()
        return 0
    con = Console()
    t = Table(title=f"bus benchmark: {res['events']:,} events through JetStream (file storage)")
    for col in ("path", "evolving events/s", "raw nats-py events/s", "ratio"):
        t.add_column(col, justify="right" if col != "path" else "left")
    for k, label in (("publish_events_per_s", "publish"), ("consume_events_per_s", "consume (fold)")):
        t.add_row(label, f"{res['evolving'][k]:,.0f}", f"{res['raw_nats_py'][k]:,.0f}", f"{res['ratio'][k]:.2f}")
    con.print(t)
    c = res["codec"]
    con.print(f"codec: encode {c['encode_events_per_s']:,.0f} events/s, decode {c['decode_events_per_s']:,.0f} "
              f"events/s, mean payload {c['mean_payload_bytes']:,.0f} B")
    verdict = "meets" if res["ratio"]["consume_events_per_s"] >= 0.5 else "misses"
    con.print(f"consume ratio {res['ratio']['consume_events_per_s']:.2f} {verdict} the >= 0.5 target")
    return 0


def _cmd_bench_failover(args) -> int:
    from services.drivers.bench.failover import run  # lazy: start-up

    con = Console(stderr=True)

    def progress(r) -> None:
        con.print(f"{r.variant:9} stall {r.stall_s:5.2f} s, {r.distinct}/{r.events} events read "
                  f"({r.read - r.distinct} twice), stream leader killed too: {r.stream_leader_killed}")

    res = run(args.runs, args.rate, progress)
    bad = any(s["lost"] or s["duplicated"] or s["out_of_order_runs"] for s in res["summary"].values())
    if args.json:
        json.dump(res, sys.stdout, indent=2)
        print()
        return 1 if bad else 0
    t = Table(title=f"a killed nats-server of 3: the reader's stall, {args.runs} run(s) each, {args.rate:g} events/s")
    for col in ("reader", "median s", "min s", "max s", "lost", "read twice"):
        t.add_column(col, justify="right" if col != "reader" else "left")
    labels = {"ours": "ours (1 s look after a 503)", "client_timeout": "baseline (the client's 5 s)"}
    for v, s in res["summary"].items():
        t.add_row(labels[v], f"{s['stall_median_s']:.2f}", f"{s['stall_min_s']:.2f}", f"{s['stall_max_s']:.2f}",
                  str(s["lost"]), str(s["duplicated"]))
    Console().print(t)
    print(f"median stall, baseline / ours: {res['ratio_median_stall_baseline_over_ours']:.2f}x")
    return 1 if bad else 0
