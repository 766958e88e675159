"""``python -m services.drivers.up.businit``: create the partition's streams, then exit.

On a secured bus only the ``admin`` account may create (or change) a stream
(services.adapters.bus.security), so a deployment runs this once with the admin's credentials before the
services start (deploy/docker-compose.yml: the ``bus-init`` service; the services wait for it to
complete). It waits for the cluster to answer JetStream requests (a fresh cluster elects its
meta leader first), creates the event stream and the dead-letter stream with
``--stream-replicas`` replicas (R3 on the compose cluster), and exits 0; a second run finds
them and changes nothing (or raises their replicas to the asked number). Exit 1 with one line
when the cluster did not answer within ``--timeout-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from services.adapters.aio import wait_for
from services.adapters.bus.options import BusSpec, add_bus_args, bus_spec
from services.adapters.bus.security import CredentialsError
from services.adapters.logging import configure_logging, get_logger
from services.drivers.serve import connect_bus

log = get_logger("businit")


async def init_bus(bus_opts: BusSpec, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            bus = await wait_for(connect_bus(bus_opts, "evolving-businit"), 15)
        except CredentialsError:
            raise
        except Exception as exc:  # noqa: BLE001 - no meta leader yet, a server still starting: try again
            last = f"{type(exc).__name__}: {exc}".rstrip(": ")
            log.info("bus_not_ready", error=last)
            await asyncio.sleep(1.0)
            continue
        try:
            info = await bus.stream_info()
            log.info("streams_ready", stream=bus.stream, replicas=info.replicas, messages=info.messages)
            print(f"stream {bus.stream}: {info.replicas} replica(s), {info.messages} message(s)")
        finally:
            await bus.close()
        return 0
    print(f"businit: the bus at {bus_opts.nats_url} did not take the streams within {timeout_s:g} s: {last}",
          file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.drivers.up.businit", description=__doc__.splitlines()[0])
    add_bus_args(p)
    p.add_argument("--timeout-s", type=float, default=120.0, help="wait this long for the cluster")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging()
    try:
        return asyncio.run(init_bus(bus_spec(args), args.timeout_s))
    except CredentialsError as exc:
        print(f"businit: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
