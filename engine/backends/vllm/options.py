"""Command-line options of ``python -m engine.worker --backend vllm`` (documented in --help).

``--kv-events-endpoint``, ``--kv-events-topic``, ``--metrics-interval-s`` and
``--request-timeout-s`` are shared with the SGLang backend (engine/backends/sglang/options.py).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from urllib.parse import urlparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vllm backend (--backend vllm, attach only; docs/engines.md); also uses "
                             "--kv-events-endpoint, --kv-events-topic, --metrics-interval-s, --request-timeout-s")
    g.add_argument("--vllm-url", default=None,
                   help="URL of a running vLLM server's OpenAI-compatible API, e.g. http://127.0.0.1:8000 (started "
                        "with --kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                        "\"endpoint\": \"tcp://*:5557\", \"topic\": \"kv\"}'; give the worker --kv-events-endpoint "
                        "tcp://HOST:5557, comma-separated for one publisher per DP rank at port + rank)")
    g.add_argument("--vllm-model", default=None,
                   help="model name sent with each request (default: the first of the server's GET /v1/models)")
    g.add_argument("--vllm-api-key", default=None,
                   help="the server's --api-key, sent as a bearer token (default: env VLLM_API_KEY)")
    g.add_argument("--vllm-pd", action="store_true",
                   help="the server runs a KV connector with kv_role kv_both over a store its peers share (vLLM's "
                        "ExampleConnector): prefill here and decode on another server, any role, switched in place")
    g.add_argument("--vllm-wait-s", type=float, default=0.0,
                   help="wait this long for the server's /health before giving up (default 0: fail at once with "
                        "one line)")


def check_args(args: argparse.Namespace) -> str | None:
    """One line naming the bad option, or None."""
    if not args.vllm_url:
        return "--backend vllm needs --vllm-url URL (attach to a running vLLM server; the worker does not launch one)"
    u = urlparse(args.vllm_url)
    if u.scheme not in ("http", "https") or not u.hostname:
        return f"--vllm-url {args.vllm_url!r} is not an http(s)://host[:port] URL"
    for ep in (args.kv_events_endpoint or "").split(","):
        ep = ep.strip()
        if ep and ep != "none":
            problem = check_endpoint(ep)
            if problem:
                return f"--kv-events-endpoint {problem}"
    if args.time_scale != 1.0:
        return "--backend vllm runs in real time: --time-scale must be 1"
    return None


#: hosts a server binds to that no client can connect to
_BIND_ONLY = ("*", "0.0.0.0", "::", "[::]")


def check_endpoint(ep: str) -> str | None:
    """Why ``ep`` is not an address a subscriber can connect to (one line), or None. vLLM's
    ``--kv-events-config`` ``endpoint`` is what the *server binds* (``tcp://*:5557``); the worker
    *connects* to the server's host at that port (``tcp://127.0.0.1:5557``)."""
    scheme, sep, rest = ep.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc"):
        return f"{ep!r} is not a ZMQ endpoint: want tcp://HOST:PORT (or ipc://PATH)"
    if scheme != "tcp":
        return None if rest else f"{ep!r} names no path"
    host, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit() or not 0 < int(port) < 65536:
        return f"{ep!r} has no port: want tcp://HOST:PORT, the port of the server's kv-events endpoint"
    if host in _BIND_ONLY:
        return (f"{ep!r} is the address the vLLM server binds (its --kv-events-config endpoint), not one to "
                f"connect to: give the server's host, e.g. tcp://127.0.0.1:{port}")
    if not host:
        return f"{ep!r} names no host: want tcp://HOST:{port}"
    return None


def bind_endpoint(ep: str) -> str:
    """The endpoint a vLLM server binds for subscribers that connect to ``ep`` (tcp: every interface)."""
    scheme, _, rest = ep.partition("://")
    return f"tcp://*:{rest.rpartition(':')[2]}" if scheme == "tcp" else ep


@dataclass
class VllmConfig:
    url: str = ""
    model: str | None = None  # default: the first of GET /v1/models
    api_key: str | None = None  # vLLM --api-key
    wait_s: float = 0.0
    kv_events_endpoints: list[str] = field(default_factory=list)
    kv_events_topic: str = ""
    metrics_interval_s: float = 2.0
    request_timeout_s: float = 600.0
    retry_s: float = 60.0
    pd: bool = False  # the server runs a kv_both KV connector shared with its peers (pd.py)


def config_from_args(args: argparse.Namespace) -> VllmConfig:
    """The typed configuration of the parsed options (the backend never sees ``args``)."""
    eps = [e.strip() for e in (args.kv_events_endpoint or "").split(",") if e.strip() and e.strip() != "none"]
    return VllmConfig(url=args.vllm_url.rstrip("/"), model=args.vllm_model,
                      api_key=args.vllm_api_key or os.environ.get("VLLM_API_KEY") or None,
                      wait_s=args.vllm_wait_s, kv_events_endpoints=eps, kv_events_topic=args.kv_events_topic,
                      metrics_interval_s=args.metrics_interval_s, request_timeout_s=args.request_timeout_s,
                      pd=args.vllm_pd)
