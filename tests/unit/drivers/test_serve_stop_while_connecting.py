"""A service asked to stop while it connects ends even when the connect swallows a cancellation:
nats-py's connect loop catches CancelledError in its close's wait and retries, and one cancel with
an unbounded await hung ``evolving serve`` now and then under load (the SIGINT case of
tests/integration/test_serve_signals.py failed once in the default suite at load ~4)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from services.drivers import serve


@dataclass
class _Bus:
    nats_url: str = "nats://127.0.0.1:1"


@dataclass
class _Opts:
    kind: str = "directory"
    bus: _Bus = field(default_factory=_Bus)
    start_timeout_s: float = 60.0


async def test_stop_ends_a_connect_that_swallows_its_first_cancellation(monkeypatch):
    swallowed = []

    async def stubborn_connect(spec, name):
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if not swallowed:  # as nats-py's _close does once
                    swallowed.append(True)
                    continue
                raise

    monkeypatch.setattr(serve, "connect_bus", stubborn_connect)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, stop.set)
    t0 = loop.time()
    task = asyncio.ensure_future(serve._connect_until_stopped(_Opts(), stop, loop.time() + 60))
    done, _ = await asyncio.wait({task}, timeout=5.0)
    assert done, "still connecting 5 s after it was asked to stop"
    assert task.result() is None and swallowed == [True] and loop.time() - t0 < 2.0


async def test_the_deadline_still_says_the_bus_is_unreachable(monkeypatch):
    async def never(spec, name):
        await asyncio.sleep(3600)

    monkeypatch.setattr(serve, "connect_bus", never)
    loop = asyncio.get_running_loop()
    with pytest.raises(serve.BusUnreachable, match="cannot reach the bus"):
        await asyncio.wait_for(serve._connect_until_stopped(_Opts(start_timeout_s=0.2), asyncio.Event(),
                                                            loop.time() + 0.2), 5.0)
