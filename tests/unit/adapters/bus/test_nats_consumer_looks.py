"""How a pull consumer looks for its consumer after a 503 (its leader's server was lost) and how it
re-opens one after lost deliveries: each JetStream call waits ``recreate_timeout_s`` (1 s), not the
client's 5 s, so the reader sees the new leader soon after the election; after
``RECREATE_SLOW_AFTER`` failures in a row it waits the client's 5 s, so a JetStream slower than the
short timeout still answers (a re-open that always timed out would delete and make the consumer
again for ever). The JetStream calls are a recording fake; the cluster itself is
tests/integration/test_failover_reader.py and ``evolving bench failover``."""

from __future__ import annotations

import asyncio

import pytest
from nats.errors import TimeoutError as NatsTimeout

from services.adapters.bus import nats_bus
from services.adapters.bus.nats_bus import RECREATE_SLOW_AFTER, _NatsConsumer

pytestmark = pytest.mark.asyncio


class FakeJs:
    """Answers nothing until ``answer`` is set (a cluster electing), and records each call's timeout."""

    def __init__(self) -> None:
        self.answer = False
        self.timeouts: list[tuple[str, float | None]] = []

    async def consumer_info(self, stream, name, timeout=None):
        self.timeouts.append(("info", timeout))
        if not self.answer:
            raise NatsTimeout
        return object()

    async def add_consumer(self, stream, config=None, timeout=None):
        self.timeouts.append(("add", timeout))
        if not self.answer:
            raise NatsTimeout
        return type("Info", (), {"name": config.name})()

    async def delete_consumer(self, stream, name):
        return True


class FakeBus:
    partition, stream, account = "p", "EI_P", None

    def __init__(self) -> None:
        self.js = FakeJs()


@pytest.fixture
def no_waits(monkeypatch):
    real = asyncio.sleep
    monkeypatch.setattr(nats_bus.asyncio, "sleep", lambda *_a, **_k: real(0))


def _consumer(durable: str | None) -> tuple[_NatsConsumer, FakeJs]:
    bus = FakeBus()
    c = _NatsConsumer(bus, durable, 1, "ei.p.>", 256)
    c.recreate_timeout_s = 0.05
    c._consumer = durable or "eph-old"
    return c, bus.js


async def test_a_look_after_a_503_waits_the_short_timeout_then_the_clients(no_waits):
    c, js = _consumer("router")
    for _ in range(RECREATE_SLOW_AFTER + 2):
        c._gone = True
        c._owed.append([10, 1e18])
        await c._recreate()
        assert not c._gone and not c._owed  # the next pull request is the probe
    assert [t for _, t in js.timeouts] == [0.05] * RECREATE_SLOW_AFTER + [5.0, 5.0]
    js.answer = True
    await c._recreate()  # found: still there (an election), the count starts again
    js.answer = False
    await c._recreate()
    assert [t for _, t in js.timeouts[-2:]] == [5.0, 0.05]
    assert c.looks == RECREATE_SLOW_AFTER + 4


async def test_an_ephemeral_is_made_again_with_the_short_timeout(no_waits):
    c, js = _consumer(None)
    await c._recreate()
    js.answer = True
    await c._recreate()
    assert js.timeouts == [("add", 0.05), ("add", 0.05)] and c._consumer != "eph-old"


@pytest.mark.parametrize("durable", ["recorder", None])
async def test_a_reopen_that_keeps_timing_out_waits_longer_and_ends(no_waits, durable):
    c, js = _consumer(durable)
    c._reopen = True
    for _ in range(RECREATE_SLOW_AFTER + 1):
        await c._reopen_after_gap()
        assert c._reopen  # not made yet: tried again on the next wake-up
    assert [t for _, t in js.timeouts] == [0.05] * RECREATE_SLOW_AFTER + [5.0]
    js.answer = True
    await c._reopen_after_gap()
    assert not c._reopen and c._recreate_tries == 0
