"""A ZMQ forwarder between a vLLM server's KV-event publisher and its worker, for
``evolving chaos --engines vllm``'s ``cut-kv-events``: ``python -m services.drivers.chaos.zmq_proxy
FRONT BACK`` connects an XSUB socket to the server's ``FRONT`` (``tcp://127.0.0.1:P``, the server
binds it) and binds an XPUB socket on ``BACK`` that the worker connects to; subscriptions go up,
events come down, frames untouched. Killing the process cuts the socket (every event published
meanwhile is lost, as on a broken link); starting it again mends it (the worker's SUB socket
reconnects and subscribes again by itself)."""

from __future__ import annotations

import sys

import zmq


def main(argv: list[str] | None = None) -> int:
    front, back = (argv if argv is not None else sys.argv[1:])[:2]
    ctx = zmq.Context.instance()
    xsub, xpub = ctx.socket(zmq.XSUB), ctx.socket(zmq.XPUB)
    xsub.connect(front)
    xpub.bind(back)
    print(f"zmq_proxy {front} -> {back}", flush=True)
    zmq.proxy(xsub, xpub)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
