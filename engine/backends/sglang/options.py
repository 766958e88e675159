"""Command-line options of ``python -m engine.worker --backend sglang`` (documented in --help)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from urllib.parse import urlparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sglang backend (--backend sglang; docs/engines.md)")
    g.add_argument("--sglang-url", default=None,
                   help="attach to a running SGLang server at this URL (e.g. http://127.0.0.1:30000); "
                        "without it the worker launches one with --sglang-launch")
    g.add_argument("--sglang-launch", default=None,
                   help="launch command for the server, run with the shell, e.g. 'python -m sglang.launch_server "
                        "--model-path /models/X --tp 4 --port 30000 --disaggregation-mode prefill "
                        "--enable-pd-role-switch --kv-events-config ...' (the worker stops it on exit)")
    g.add_argument("--sglang-launch-timeout-s", type=float, default=900.0,
                   help="seconds to wait for a launched server's /health (model load; default 900)")
    g.add_argument("--sglang-wait-s", type=float, default=0.0,
                   help="attach: wait this long for the server's /health before giving up (default 0: fail at "
                        "once with one line)")
    g.add_argument("--kv-events-endpoint", default=None,
                   help="ZMQ endpoint of the server's KV-event publisher, e.g. tcp://127.0.0.1:5557 (default: "
                        "discovered from the kv_events block of the server's /server_info, one per DP rank); "
                        "'none': no KV events (the directory learns nothing of this node's cache)")
    g.add_argument("--kv-events-topic", default="",
                   help="topic of the KV-event publisher with --kv-events-endpoint (default: all)")
    g.add_argument("--bootstrap-host", default=None,
                   help="host a decode server reaches this node's prefill bootstrap server at "
                        "(default: the host of --sglang-url)")
    g.add_argument("--bootstrap-port", type=int, default=8998,
                   help="this node's --disaggregation-bootstrap-port (default 8998, SGLang's default)")
    g.add_argument("--peer-url", action="append", default=[], metavar="NODE=URL",
                   help="HTTP URL of another node's SGLang server (repeatable): a prefill node sends the request "
                        "to its decode peer too, with the same bootstrap room")
    g.add_argument("--peer-bootstrap", action="append", default=[], metavar="NODE=HOST:PORT",
                   help="bootstrap address of another node's prefill server (repeatable)")
    g.add_argument("--switch-fallback", choices=("restart", "refuse"), default="restart",
                   help="when the server refuses POST /pd_role_switch (no --enable-pd-role-switch, a transfer "
                        "backend without it, collocated): restart it in the new role (needs --sglang-launch) "
                        "or report the switch as refused (default restart)")
    g.add_argument("--decode-cuda-graph-memory-gb", type=float, default=None,
                   help="sent with a switch to decode: SGLang refuses to capture decode CUDA graphs on a flip "
                        "without this measured footprint (take it from a decode peer's log); unset: not sent")
    g.add_argument("--metrics-interval-s", type=float, default=2.0,
                   help="poll the server's /metrics (needs SGLang --enable-metrics) this often for its running and "
                        "queued requests, reported in heartbeats (0: off)")
    g.add_argument("--decode-log-interval", type=int, default=40,
                   help="the launched server's --decode-log-interval: iterations per 'Decode batch' log line, "
                        "the source of the decode IterationDone events (default 40, SGLang's default)")
    g.add_argument("--drain-timeout-s", type=float, default=120.0,
                   help="longest wait for in-flight requests before a role switch (default 120)")
    g.add_argument("--request-timeout-s", type=float, default=600.0, help="HTTP timeout of one generate call")


def _url_ok(url: str) -> bool:
    u = urlparse(url)
    return u.scheme in ("http", "https") and bool(u.hostname)


def check_args(args: argparse.Namespace) -> str | None:
    """One line naming the bad option, or None."""
    if not args.sglang_url and not args.sglang_launch:
        return "--backend sglang needs --sglang-url URL (attach) or --sglang-launch CMD (launch)"
    if args.sglang_url and not _url_ok(args.sglang_url):
        return f"--sglang-url {args.sglang_url!r} is not an http(s)://host[:port] URL"
    for spec in args.peer_url:
        node, _, url = spec.partition("=")
        if not node or not _url_ok(url):
            return f"--peer-url {spec!r} is not NODE=http://host:port"
    for spec in args.peer_bootstrap:
        node, _, addr = spec.partition("=")
        host, _, port = addr.rpartition(":")
        if not node or not host or not port.isdigit():
            return f"--peer-bootstrap {spec!r} is not NODE=HOST:PORT"
    if args.time_scale != 1.0:
        return "--backend sglang runs in real time: --time-scale must be 1"
    return None


@dataclass
class SglangConfig:
    url: str | None = None
    launch: str | None = None
    launch_timeout_s: float = 900.0
    wait_s: float = 0.0  # attach: wait this long for /health (a server still loading its model)
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    bootstrap_host: str | None = None
    bootstrap_port: int = 8998
    peers: dict[str, str] = field(default_factory=dict)  # node -> http url
    switch_fallback: str = "restart"
    drain_timeout_s: float = 120.0
    request_timeout_s: float = 600.0
    decode_cuda_graph_memory_gb: float | None = None
    decode_log_interval: int = 40  # SGLang --decode-log-interval: iterations per "Decode batch" log line
    metrics_interval_s: float = 2.0  # poll /metrics (SGLang --enable-metrics) for the server's load; 0: off
    retry_s: float = 60.0  # a request that cannot connect (a server restarting) is retried this long


def config_from_args(args: argparse.Namespace) -> SglangConfig:
    """The typed configuration of the parsed options (the backend never sees ``args``)."""
    url = args.sglang_url
    if url is None and args.sglang_launch:
        m = re.search(r"--port[ =](\d+)", args.sglang_launch)
        url = f"http://127.0.0.1:{m.group(1) if m else 30000}"
    return SglangConfig(url=url, launch=args.sglang_launch, launch_timeout_s=args.sglang_launch_timeout_s,
                        wait_s=args.sglang_wait_s,
                        kv_events_endpoint=args.kv_events_endpoint, kv_events_topic=args.kv_events_topic,
                        bootstrap_host=args.bootstrap_host, bootstrap_port=args.bootstrap_port,
                        peers=dict(s.split("=", 1) for s in args.peer_url), switch_fallback=args.switch_fallback,
                        drain_timeout_s=args.drain_timeout_s, request_timeout_s=args.request_timeout_s,
                        decode_cuda_graph_memory_gb=args.decode_cuda_graph_memory_gb,
                        metrics_interval_s=args.metrics_interval_s, decode_log_interval=args.decode_log_interval)
