"""Command-line options of ``python -m engine.worker --backend vllm`` (documented in --help).

``--kv-events-endpoint``, ``--kv-events-topic``, ``--metrics-interval-s`` and
``--request-timeout-s`` are shared with the SGLang backend (engine/backends/sglang/options.py).
"""

from __future__ import annotations

import argparse
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
        if ep and ep != "none" and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            return f"--kv-events-endpoint {ep!r} is not a ZMQ endpoint (tcp://HOST:PORT)"
    if args.time_scale != 1.0:
        return "--backend vllm runs in real time: --time-scale must be 1"
    return None
