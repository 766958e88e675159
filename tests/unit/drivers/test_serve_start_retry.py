"""A service's start goes through transient bus errors (the quick chaos scenario
corrupt-planner-snapshot once ended "planner exited 1" under heavy machine load, a JetStream
request of the restarted planner timing out): it connects again, for up to START_RETRY_S; an
error a retry cannot fix still ends it at once."""

from __future__ import annotations

import asyncio
import os
import signal

import nats.errors
import pytest
from nats.js.errors import BadRequestError, ServiceUnavailableError

from services.adapters.bus import InMemoryBus
from services.drivers import serve
from services.drivers.options import ServiceOptions, service_options
from services.drivers.up.testing import wait_until

pytestmark = pytest.mark.asyncio


def _args() -> ServiceOptions:
    return service_options("directory", serve.build_parser("directory").parse_args(
        ["--nats-url", "nats://127.0.0.1:1", "--partition", "p"]))


async def test_a_transient_error_at_start_is_tried_again_on_a_fresh_connection(monkeypatch):
    calls, buses = [], []
    errors = [nats.errors.TimeoutError(), ServiceUnavailableError()]

    async def flaky(bus_opts, name):
        calls.append(name)
        if errors:
            raise errors.pop(0)
        bus = InMemoryBus(bus_opts.partition)
        buses.append(bus)
        return bus

    monkeypatch.setattr(serve, "connect_bus", flaky)
    task = asyncio.create_task(serve.serve_async(_args()))

    async def serving() -> bool:
        return bool(buses) and await buses[0].get_snapshot("config.directory") is not None

    await wait_until(serving, 10, what="the directory to start")
    os.kill(os.getpid(), signal.SIGTERM)  # serve_async's own handler: a clean stop
    assert await asyncio.wait_for(task, 10) == 0
    assert len(calls) == 3


async def test_an_error_a_retry_cannot_fix_is_raised_at_once(monkeypatch):
    calls = []

    async def refused(bus_opts, name):
        calls.append(name)
        raise BadRequestError()

    monkeypatch.setattr(serve, "connect_bus", refused)
    with pytest.raises(BadRequestError):
        await asyncio.wait_for(serve.serve_async(_args()), 10)
    assert len(calls) == 1
    assert not serve.transient_bus_error(BadRequestError()) and serve.transient_bus_error(TimeoutError())
