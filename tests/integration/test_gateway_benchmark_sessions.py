"""Sessions from benchmark clients: aiperf's multi-turn mode sends ``X-Session-Affinity`` and
``X-Correlation-ID``, stable per conversation. Each conversation is one branch (its later
turns continue it), and idle expiry ends it, since aiperf never sends an end header."""

from __future__ import annotations

from events.catalog import BranchEnded, BranchOpened, RequestSubmitted
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from tests.integration.test_gateway_app import CHAT, _events, gateway


def _turns(k: int) -> dict:
    msgs = []
    for i in range(k):
        msgs += [{"role": "user", "content": f"turn {i} " + "x" * 150}, {"role": "assistant", "content": "ok"}]
    return {**CHAT, "messages": msgs[:-1]}


async def test_one_branch_per_conversation_and_idle_expiry(partition):
    bus = InMemoryBus(partition)
    now = [100.0]
    async with gateway(bus, MemoryTokens(partition), branch_ttl_s=60.0) as (gw, client):
        gw.clock = lambda: now[0]
        for turn in (1, 2, 3):
            for conv in ("conv-a", "conv-b"):  # interleaved, as concurrent aiperf workers send them
                headers = {"X-Session-Affinity": conv, "X-Correlation-ID": f"{conv}-corr"}
                r = await client.post("/v1/chat/completions", json=_turns(turn), headers=headers)
                assert r.status == 200, await r.text()
                now[0] += 1.0
        evs = await _events(bus)
        opened = [e for e in evs if isinstance(e, BranchOpened)]
        assert [(e.branch, e.mode) for e in opened] == [("conv-a", "root"), ("conv-b", "root")]
        assert [e.branch for e in evs if isinstance(e, RequestSubmitted)] == ["conv-a", "conv-b"] * 3
        assert gw.metrics.get("ei_gateway_headerless_requests_total") == 0
        # the correlation id alone (a client that sends only it) names the branch too
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Correlation-ID": "only-corr"})
        assert r.status == 200
        now[0] = 300.0
        await gw._expire(gw.clock())
        ended = [e for e in await _events(bus) if isinstance(e, BranchEnded)]
        assert sorted((e.branch, e.reason) for e in ended) == [("conv-a", "idle"), ("conv-b", "idle"),
                                                               ("only-corr", "idle")]
        assert not gw.table.open
