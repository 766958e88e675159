"""A durable reader when the nats-server holding its consumer's leader is SIGKILLed (three real
servers, the stream R3; marker ``chaos``): its pull requests meet no responder (503) until the
election ends, it looks for the consumer (a 1 s API timeout, not the client's 5 s) and probes
with the next pull request, and goes on with every event once, in order, well inside the
gateway's route timeout. How long it takes against the client's 5 s: ``evolving bench
failover`` (docs/bus.md, "Consuming")."""

from __future__ import annotations

import pytest

from services.drivers.bench.failover import one_run
from services.drivers.gateway.config import GatewayConfig

pytestmark = [pytest.mark.chaos, pytest.mark.asyncio]


async def test_a_reader_whose_consumer_leader_is_killed_goes_on_with_nothing_lost():
    r = await one_run("ours", 0)
    assert r.events > 40 and r.distinct == r.events and r.read == r.distinct and r.in_order, r
    # the leader it read from was gone: at 20 events/s nothing came for a while (an election;
    # the 503 path is taken when the request expired before the new leader was there)
    assert r.stall_s > 1.0, r
    # a route crosses the stream twice: the reader's stall must leave the other leg room
    assert r.stall_s < GatewayConfig.route_timeout_s * 2 / 3, r
