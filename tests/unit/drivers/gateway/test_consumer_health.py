"""The gateway's view of the stream's readers (services/drivers/gateway/consumers.py) and the
dead letter that never stops a consumer (services/adapters/bus/port.py)."""

from __future__ import annotations

from events.catalog import NodeHeartbeat, SwitchRole
from services.adapters.bus import InMemoryBus
from services.adapters.bus.port import Delivery, dead_letter
from services.drivers.gateway.consumers import ConsumerHealth, Watch


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Bus:
    """Only observe() is driven here: the bus is never asked."""


def _row(name: str, pending: int, position: int) -> dict:
    return {"name": name, "durable": False, "filter": "ei.t.>", "pending": pending, "position": position,
            "delivered": position, "ack_floor": 0}


def test_a_reader_behind_that_does_not_move_is_stuck_and_one_that_moves_is_not():
    clock = _Clock()
    ch = ConsumerHealth(_Bus(), clock=clock, stuck_after_s=4.0, lag_events=100)
    ch.observe([_row("engine-n0-a", 0, 10), _row("engine-n1-b", 0, 10)])
    for t, moving in ((1, 11), (2, 12), (3, 13), (4, 14), (5, 15), (6, 16)):
        clock.t = t
        ch.observe([_row("engine-n0-a", 3, moving), _row("engine-n1-b", 3 + t, 10)])  # n1 stopped at 10
    rep = ch.report()
    assert rep["stuck"] == ["engine-n1-b"] and rep["consumers"]["engine-n0-a"]["state"] == "ok"
    assert rep["consumers"]["engine-n1-b"]["unmoved_s"] == 6.0
    clock.t = 7
    ch.observe([_row("engine-n0-a", 500, 17), _row("engine-n1-b", 0, 30)])  # n1 caught up; n0 far behind
    rep = ch.report()
    assert rep["stuck"] == [] and rep["lagging"] == ["engine-n0-a"]


def test_an_idle_stream_is_never_stuck():
    clock = _Clock()
    ch = ConsumerHealth(_Bus(), clock=clock, stuck_after_s=4.0)
    for t in range(20):
        clock.t = t
        ch.observe([_row("recorder", 0, 5)])
    assert ch.report()["stuck"] == []


class _RefusingBus(InMemoryBus):
    async def publish_raw(self, subject, data, headers=None, msg_id=None):
        if subject.startswith("eidlq."):
            raise PermissionError("Permissions Violation for Publish")
        return await super().publish_raw(subject, data, headers, msg_id)


async def test_a_dead_letter_the_bus_refuses_is_logged_and_never_raises():
    bus = _RefusingBus("t")
    assert await dead_letter(bus, "ephemeral", 7, "ei.t.agent.x", b"\xc1junk", "undecodable") is False
    ok = InMemoryBus("t")
    ok.account = "engine-n0"
    assert await dead_letter(ok, "ephemeral", 7, "ei.t.agent.x", b"\xc1junk", "undecodable") is True
    (dl,) = await ok.dead_letters()
    assert (dl.consumer, dl.seq, dl.subject) == ("ephemeral", 7, "ei.t.agent.x")
    assert await ok.last_seq() == 0  # dead letters are not events of the stream


async def test_a_gateway_reader_refuses_forgeries_and_survives_a_failing_handler():
    bus = _RefusingBus("t")
    seen = []

    def handle(d: Delivery) -> None:
        if d.seq == 2:
            raise RuntimeError("a handler bug")
        seen.append(d.seq)

    w = Watch(bus, "gateway-failures", "ei.t.node.*", handle)
    await w._take(Delivery(1, "ei.t.node.n0", SwitchRole(ts=1.0, node="n1", to_role="prefill")))
    await w._take(Delivery(2, "ei.t.node.n0", NodeHeartbeat(ts=1.0, node="n0", role="prefill")))
    await w._take(Delivery(3, "ei.t.node.n0", NodeHeartbeat(ts=2.0, node="n0", role="prefill")))
    st = w.state
    assert seen == [3] and st.refused == 1 and st.dead_letters_failed == 1 and "seq 2" in st.error
