"""``python -m services.gateway --port 8000 --nats-url URL [--partition P] ...``

Runs the OpenAI-compatible gateway (services/gateway/app.py) against a NATS JetStream server.
Without ``--nats-url`` it starts an embedded ``nats-server`` (local trials only: no router or
engine will be attached to it, so requests time out with 503 unless you start them too).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from aiohttp import web

from services.gateway.app import Gateway, GatewayConfig
from services.logging import configure_logging, get_logger


def _env_epoch() -> float | None:
    raw = os.environ.get("EI_CLOCK_EPOCH", "").strip()
    return float(raw) if raw else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.gateway", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--nats-url", default=None, help="NATS server URL (default: an embedded nats-server)")
    p.add_argument("--partition", default="default")
    p.add_argument("--model", default="evolving-sim", help="model name served by /v1/models")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--tokenizer", default=None,
                   help="path of a Hugging Face tokenizer.json (needs the 'tokenizers' package); "
                        "default: the byte-level tokenizer")
    p.add_argument("--route-timeout-s", type=float, default=10.0)
    p.add_argument("--token-timeout-s", type=float, default=60.0)
    p.add_argument("--default-max-tokens", type=int, default=128)
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="event ts = epoch + (wall - epoch) * scale (match the sim engines' --time-scale)")
    p.add_argument("--clock-epoch", type=float, default=_env_epoch(),
                   help="epoch of the scaled clock (default: env EI_CLOCK_EPOCH, else now)")
    p.add_argument("--src", default="gateway", help="publisher id in the events' src field")
    p.add_argument("--log-format", choices=["console", "json"], default=None)
    p.add_argument("--log-level", default=None)
    return p


async def serve(args: argparse.Namespace) -> int:
    from services.bus import NatsBus
    from services.gateway.tokens import NatsTokens

    log = get_logger("gateway")
    embedded = None
    url = args.nats_url
    if url is None:
        from services.natsserver import EmbeddedNats

        embedded = EmbeddedNats().start()
        url = embedded.url
        log.warning("embedded_nats", url=url)
    bus = await NatsBus.connect(url, partition=args.partition, name=f"gateway-{args.src}")
    cfg = GatewayConfig(partition=args.partition, model=args.model, block_tokens=args.block_tokens,
                        route_timeout_s=args.route_timeout_s, token_timeout_s=args.token_timeout_s,
                        default_max_tokens=args.default_max_tokens, tokenizer=args.tokenizer, src=args.src,
                        time_scale=args.time_scale, clock_epoch=args.clock_epoch)
    gw = Gateway(bus, NatsTokens(bus.nc, args.partition), cfg)
    runner = web.AppRunner(gw.make_app())
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info("gateway_listening", host=args.host, port=args.port, nats=url, partition=args.partition)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gateway_stopping")
    await runner.cleanup()
    await bus.close()
    if embedded is not None:
        embedded.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(level=args.log_level, fmt=args.log_format)
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
