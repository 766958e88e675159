"""A request the stream says failed (``RequestFinished`` with an ``error``, e.g. the liveness
watcher's "decode node N was removed mid-decode") ends at the client at once, on both APIs,
streaming or not, before and after its first token; the engine sends no token message for it.
And a gateway restarted on the same stream continues the branches of the one before it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import anthropic
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from events.catalog import (
    BranchEnded,
    BranchOpened,
    ContextCompacted,
    RequestFinished,
    RequestSubmitted,
    RouteDecided,
)
from services.adapters.bus import InMemoryBus, NatsBus
from services.adapters.bus.natsserver import free_port
from services.adapters.bus.tokens import MemoryTokens, NatsTokens, TokenMsg, sim_text
from services.drivers.gateway.app import Gateway, GatewayConfig
from services.drivers.up.testing import read_all
from tests.integration.gateway_harness import serving as serve_app

REPO = Path(__file__).resolve().parents[2]
LOST = "decode node n2 was removed mid-decode (heartbeat timeout: 10.2 s); the request is lost"


async def cluster(bus, tokens, lose_after_first=frozenset(), lose_before_route=frozenset(),
                  stall=frozenset()):
    """Route every request to n1/n2 and stream 4 sim tokens back, except: branches in
    ``lose_after_first`` get their first token, then the stream's RequestFinished error (no
    token message); ``lose_before_route`` get the error before any RouteDecided; ``stall`` get
    the first token and nothing more (their first request only)."""
    stalled: set[str] = set()
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            ev = d.event
            if not isinstance(ev, RequestSubmitted):
                continue
            if ev.branch in lose_before_route:
                await bus.publish(RequestFinished(ts=ev.ts, src="planner", request=ev.request, node="n1",
                                                  error="no node can take it"))
                continue
            await bus.publish(RouteDecided(ts=ev.ts, request=ev.request, prefill_node="n1", decode_node="n2",
                                           policy="fake"))
            await tokens.publish(TokenMsg(request=ev.request, kind="first", tokens=1, total=1, text=sim_text(1),
                                          simulated=True))
            stalls = ev.branch in stall or ("gw-*" in stall and ev.branch.startswith("gw-"))
            if stalls and ev.branch not in stalled:
                stalled.add(ev.branch)
                continue
            if ev.branch in lose_after_first:
                await asyncio.sleep(0.05)
                await bus.publish(RequestFinished(ts=ev.ts, src="planner", request=ev.request, node="n2",
                                                  error=LOST))
                continue
            await tokens.publish(TokenMsg(request=ev.request, kind="done", tokens=3, total=4, text=sim_text(3, 1),
                                          finish_reason="length", simulated=True))


@contextlib.asynccontextmanager
async def serving(bus, tokens, **fake):
    gw = Gateway(bus, tokens, GatewayConfig(partition=bus.partition, token_timeout_s=30, route_timeout_s=30))
    async with serve_app(gw, cluster(bus, tokens, **fake)) as client:
        yield gw, client


CHAT = {"model": "evolving-sim", "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 4}
MSG = {"model": "evolving-sim", "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 4}


def _data(text: str) -> list:
    return [ln[6:] if ln[6:] == "[DONE]" else json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: ")]


async def _openai_cases(client) -> None:
    t0 = time.monotonic()
    # non-streaming: a 503 naming the cause
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"x-branch-id": "lost-a"})
    assert r.status == 503, await r.text()
    err = (await r.json())["error"]
    assert err["code"] == "request_failed" and "removed mid-decode" in err["message"] and "n2" in err["message"]
    # streaming, after the first token: the first chunk, an error chunk, [DONE], the end
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers={"x-branch-id": "lost-b"})
    assert r.status == 200
    data = _data(await asyncio.wait_for(r.text(), 10))
    assert data[0]["choices"][0]["delta"]["content"] == sim_text(1)
    assert data[-2]["error"]["code"] == "request_failed" and "removed mid-decode" in data[-2]["error"]["message"]
    assert data[-1] == "[DONE]" and len(data) == 3
    # before the route: a plain 503 error, streaming or not
    for stream in (False, True):
        r = await client.post("/v1/completions", json={"prompt": "p" * 50, "max_tokens": 4, "stream": stream},
                              headers={"x-branch-id": "lost-c"})
        assert r.status == 503
        assert (await r.json())["error"]["code"] == "request_failed"
    # a healthy request beside them is served
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"x-branch-id": "ok"})
    assert r.status == 200 and (await r.json())["choices"][0]["message"]["content"] == sim_text(4)
    assert time.monotonic() - t0 < 10  # no token timeout (30 s) was waited for


async def test_stream_failures_reach_openai_clients(partition):
    bus = InMemoryBus(partition)
    async with serving(bus, MemoryTokens(partition), lose_after_first={"lost-a", "lost-b"},
                       lose_before_route={"lost-c"}) as (gw, client):
        await _openai_cases(client)
        assert gw.in_flight == 0 and all(not f._flight for f in gw.failures.values())
        assert gw.metrics.get("ei_frontend_requests_total", model="evolving-sim", endpoint="chat_completions",
                              request_type="unary", status="error") == 1


async def test_stream_failures_reach_anthropic_clients(partition):
    bus = InMemoryBus(partition)
    async with serving(bus, MemoryTokens(partition), lose_after_first={"lost-a", "lost-b"},
                       lose_before_route={"lost-c"}) as (_gw, client):
        r = await client.post("/v1/messages", json=MSG, headers={"x-branch-id": "lost-a"})
        assert r.status == 503
        body = await r.json()
        assert body["type"] == "error" and "removed mid-decode" in body["error"]["message"]
        r = await client.post("/v1/messages", json={**MSG, "stream": True}, headers={"x-branch-id": "lost-b"})
        assert r.status == 200
        text = await asyncio.wait_for(r.text(), 10)
        events = [ln[7:] for ln in text.splitlines() if ln.startswith("event: ")]
        assert events[:2] == ["message_start", "content_block_start"] and events[-1] == "error"
        assert "message_stop" not in events
        last = json.loads([ln for ln in text.splitlines() if ln.startswith("data: ")][-1][6:])
        assert last["type"] == "error" and "removed mid-decode" in last["error"]["message"]
        r = await client.post("/v1/messages", json=MSG, headers={"x-branch-id": "lost-c"})
        assert r.status == 503 and (await r.json())["type"] == "error"


async def test_stream_failures_over_a_real_nats_server(nats_url, partition):
    buses = [await NatsBus.connect(nats_url, partition=partition) for _ in range(2)]
    gw_bus, c_bus = buses
    gw = Gateway(gw_bus, NatsTokens(gw_bus.nc, partition),
                 GatewayConfig(partition=partition, token_timeout_s=30, route_timeout_s=30))
    task = asyncio.create_task(cluster(c_bus, NatsTokens(c_bus.nc, partition), lose_after_first={"lost-a", "lost-b"},
                                       lose_before_route={"lost-c"}))
    try:
        async with TestClient(TestServer(gw.make_app())) as client:
            await _openai_cases(client)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for b in buses:
            await b.close()


# ------------------------------------------------------------------------------ restart
def _start_gateway(nats_url: str, partition: str, port: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("EI_API_KEYS", "EI_PROFILE", "EI_TOKENIZER")}
    with open(log, "a") as fh:
        return subprocess.Popen([sys.executable, "-m", "services.drivers.gateway", "--nats-url", nats_url,
                                 "--port", str(port), "--partition", partition, "--log-format", "json",
                                 "--token-timeout-s", "10", "--route-timeout-s", "10", "--shutdown-grace-s", "0.5"],
                                cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)


async def _wait_up(http: aiohttp.ClientSession, url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/health") as r:
                if r.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise AssertionError(f"gateway not up: {log.read_text()[-2000:]}")


async def test_a_restarted_gateway_continues_the_branches_of_the_one_it_replaces(nats_url, partition, tmp_path):
    """Gateway 1 (a process) serves two turns of branch ``a``, ends branch ``e`` and is
    SIGKILLed while streaming a request of branch ``s``: that client, and one of a request
    without branch headers, see the connection close. Gateway 2 on the same stream continues
    ``a`` (its third turn extends the second: same branch id, no second BranchOpened, no
    compaction), still
    refuses ``e`` (409), ends the dead instance's one-request branch, and serves ``s`` again.
    Stopped (SIGTERM) mid-stream after its grace period, it ends that stream with an error event."""
    bus = await NatsBus.connect(nats_url, partition=partition)
    task = asyncio.create_task(cluster(bus, NatsTokens(bus.nc, partition), stall={"s", "gw-*", "t"}))
    port, log = free_port(), tmp_path / "gateway.log"
    url = f"http://127.0.0.1:{port}"
    turn = lambda n: {"model": "evolving-sim", "max_tokens": 4,
                      "messages": [{"role": "user", "content": f"turn {i} " * 30} for i in range(n)]}
    proc = _start_gateway(nats_url, partition, port, log)
    try:
        async with aiohttp.ClientSession() as http:
            await _wait_up(http, url, proc, log)
            for n in (1, 2):
                async with http.post(url + "/v1/chat/completions", json=turn(n), headers={"x-branch-id": "a"}) as r:
                    assert r.status == 200, await r.text()
            async with http.post(url + "/v1/chat/completions", json=turn(1),
                                 headers={"x-branch-id": "e", "x-branch-end": "true"}) as r:
                assert r.status == 200
            async with (http.post(url + "/v1/chat/completions", json={**turn(1), "stream": True}) as r1,
                        http.post(url + "/v1/chat/completions", json={**turn(1), "stream": True},
                                  headers={"x-branch-id": "s"}) as r2):
                for r in (r1, r2):  # without branch headers, and on branch s
                    assert r.status == 200
                    assert (await r.content.readline()).startswith(b"data: ")  # the first token came
                proc.send_signal(signal.SIGKILL)
                for r in (r1, r2):
                    with pytest.raises(aiohttp.ClientError):  # the connection closes under the client
                        await asyncio.wait_for(r.content.read(), 10)
            proc.wait(10)
            before = await bus.last_seq()
            proc = _start_gateway(nats_url, partition, port, log)
            await _wait_up(http, url, proc, log)
            async with http.post(url + "/v1/chat/completions", json=turn(3), headers={"x-branch-id": "a"}) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-branch-id"] == "a"
            async with http.post(url + "/v1/chat/completions", json=turn(2), headers={"x-branch-id": "e"}) as r:
                assert r.status == 409 and (await r.json())["error"]["code"] == "branch_ended"
            async with http.post(url + "/v1/chat/completions", json=turn(2), headers={"x-branch-id": "s"}) as r:
                assert r.status == 200  # the lost stream's branch takes its next request
            # a stop (SIGTERM) mid-stream: after the grace period the stream ends with an error event
            async with http.post(url + "/v1/chat/completions", json={**turn(1), "stream": True},
                                 headers={"x-branch-id": "t"}) as r:
                assert (await r.content.readline()).startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)
                data = _data((await asyncio.wait_for(r.content.read(), 10)).decode())
                assert data[-2]["error"]["code"] == "request_failed" and "shutting down" in data[-2]["error"]["message"]
                assert data[-1] == "[DONE]"
            assert proc.wait(10) == 0
        after = [d.event for d in await read_all(bus, subjects=f"ei.{partition}.agent.>") if d.seq > before]
        kinds = [(type(e).__name__, e.branch) for e in after]
        orphan = [e for e in after if isinstance(e, BranchEnded)]
        assert len(orphan) == 1 and orphan[0].branch.startswith("gw-") and orphan[0].reason == "gateway_restart"
        assert [e.branch for e in after if isinstance(e, BranchOpened | ContextCompacted)] == ["t"], kinds
        subs = [e for e in after if isinstance(e, RequestSubmitted)]
        assert [(e.branch, e.version) for e in subs] == [("a", 0), ("s", 0), ("t", 0)], kinds
        rebuilt = [ln for ln in log.read_text().splitlines() if "branches_rebuilt" in ln]
        assert rebuilt and ("orphans_ended=1" in rebuilt[-1] or '"orphans_ended": 1' in rebuilt[-1]), rebuilt
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await bus.close()


async def test_the_official_clients_see_the_failure(partition):
    """What an agent harness sees: the ``openai`` and ``anthropic`` clients raise, naming the cause,
    streaming (after the first token) and not; nothing hangs."""
    bus = InMemoryBus(partition)
    async with serving(bus, MemoryTokens(partition), lose_after_first={"lost-a", "lost-b"}) as (_gw, client):
        base = str(client.make_url("")).rstrip("/")
        oa = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as err:
            await oa.chat.completions.create(model="evolving-sim", messages=CHAT["messages"], max_tokens=4,
                                             extra_headers={"x-branch-id": "lost-a"})
        assert err.value.status_code == 503 and "removed mid-decode" in str(err.value)
        got = []
        with pytest.raises(openai.APIError, match="removed mid-decode"):
            stream = await oa.chat.completions.create(model="evolving-sim", messages=CHAT["messages"], max_tokens=4,
                                                      stream=True, extra_headers={"x-branch-id": "lost-b"})
            async for chunk in stream:
                got.append(chunk.choices[0].delta.content)
        assert got == [sim_text(1)]
        an = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as aerr:
            await an.messages.create(model="evolving-sim", messages=MSG["messages"], max_tokens=4,
                                     extra_headers={"x-branch-id": "lost-a"})
        assert aerr.value.status_code == 503 and "removed mid-decode" in str(aerr.value)
        text = []
        with pytest.raises(anthropic.APIError, match="removed mid-decode"):
            async with an.messages.stream(model="evolving-sim", messages=MSG["messages"], max_tokens=4,
                                          extra_headers={"x-branch-id": "lost-b"}) as s:
                async for t in s.text_stream:
                    text.append(t)
        assert text == [sim_text(1)]
