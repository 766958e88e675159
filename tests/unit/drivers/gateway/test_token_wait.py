"""The gateway's token timeout tells a busy node from a dead one (the agent load's
last two lost requests were cold 246 K-token prefills on a live node that outlasted 60 s)."""

from __future__ import annotations

import pytest

from events.catalog import NodeHeartbeat, NodeRemoved, RouteDecided
from events.wire import TokenMsg
from services.adapters.bus import InMemoryBus
from services.adapters.bus.port import Delivery
from services.drivers.gateway.api import ApiError
from services.drivers.gateway.meta import PROGRESS_WAIT_CAP, Meta, next_token
from services.drivers.gateway.streamwatch import FailWatcher


class _Sub:
    """Token messages after ``silent`` timeouts."""

    def __init__(self, silent: int) -> None:
        self.silent, self.calls = silent, 0

    async def get(self, timeout_s: float):
        self.calls += 1
        if self.calls <= self.silent:
            raise TimeoutError
        return TokenMsg(request="r1", kind="first", tokens=1, total=1, text="tok ")


def _meta(quiet) -> Meta:
    route = RouteDecided(ts=1.0, request="r1", prefill_node="p0", decode_node="d0")
    return Meta("r1", "b", 0, route, 10, 1, "m", True, 8, 0, [], node_quiet_s=quiet)


async def test_a_request_on_a_working_node_is_waited_for():
    sub = _Sub(silent=3)
    m = await next_token(sub, _meta(lambda n: 0.5 if n == "p0" else None), timeout_s=1.0)
    assert m.kind == "first" and sub.calls == 4


async def test_a_silent_node_times_out_at_once_and_a_working_one_at_the_cap():
    with pytest.raises(ApiError) as e:
        await next_token(_Sub(silent=1), _meta(lambda n: None), timeout_s=1.0)
    assert e.value.status == 504
    sub = _Sub(silent=10 * PROGRESS_WAIT_CAP)
    with pytest.raises(ApiError):
        await next_token(sub, _meta(lambda n: 0.0), timeout_s=1.0)
    assert sub.calls == PROGRESS_WAIT_CAP
    with pytest.raises(ApiError):  # quiet for longer than the timeout: not working
        await next_token(_Sub(silent=1), _meta(lambda n: 5.0), timeout_s=1.0)


def test_progress_is_a_fact_or_a_heartbeat_whose_counters_moved():
    fw = FailWatcher(InMemoryBus("t"), "t")
    now = [100.0]
    fw._clock = lambda: now[0]
    hb = lambda a, p: Delivery(1, "ei.t.node.n0", NodeHeartbeat(ts=1.0, node="n0", role="prefill", applied_seq=a,
                                                                published=p))
    assert fw.quiet_s("n0") is None
    fw._on(hb(5, 5))
    now[0] = 110.0
    fw._on(hb(5, 5))  # alive but nothing moved: not progress
    assert fw.quiet_s("n0") == 10.0
    fw._on(hb(6, 5))
    assert fw.quiet_s("n0") == 0.0
    fw._on(Delivery(2, "ei.t.node.n0", NodeRemoved(ts=2.0, node="n0")))
    assert fw.quiet_s("n0") is None


def test_drive_reads_an_error_event_whose_code_is_a_word():
    from services.drivers.gateway.drive import _stream_error_status

    assert _stream_error_status({"code": "timeout", "message": "no tokens"}) == 504
    assert _stream_error_status({"code": "request_failed"}) == 503
    assert _stream_error_status({"code": 500}) == 500 and _stream_error_status({"code": "429"}) == 429
    assert _stream_error_status({"code": None}) == 502 and _stream_error_status({}) == 502
