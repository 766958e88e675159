"""A client that leaves stops its engine: the gateway (served as ``__main__``
serves it) in front of a real sim engine worker and a stub router on the in-process bus. A
streaming client that disconnects after its first tokens, and one that gives up on a
non-streamed answer, make the gateway publish ``RequestCancelled`` once; the engine stops
decoding within a second (``RequestFinished(error="cancelled")``, no token message, no iteration
after it); no traceback. A request the gateway times out is cancelled too."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import pytest
from aiohttp import web

from engine.profiles import load_profile
from engine.worker.loop import EngineWorker
from events.catalog import (
    IterationDone,
    RequestCancelled,
    RequestFinished,
    RequestStarted,
    RequestSubmitted,
    RouteDecided,
)
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from services.drivers.gateway.app import Gateway, GatewayConfig
from services.drivers.gateway.guard import GatewayRunner
from tests.integration.test_worker import all_events, wait_for_event

LONG = 60_000  # output tokens: minutes of decoding unless the cancel stops it


async def stub_router(bus, node: str) -> None:
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            if isinstance(d.event, RequestSubmitted):
                await bus.publish(RouteDecided(ts=d.event.ts, request=d.event.request, prefill_node=node,
                                               decode_node=node, policy="stub"))


@contextlib.asynccontextmanager
async def stack(partition: str, engine: bool = True, router: bool = True, **cfg):
    bus, tokens = InMemoryBus(partition), MemoryTokens(partition)
    worker = None
    if engine:
        worker = EngineWorker(bus, tokens, "n1", "collocated", load_profile("gb300-glm52"), heartbeat_s=0.2)
        await worker.start()
    tasks = [asyncio.create_task(stub_router(bus, "n1"))] if router else []
    gw = Gateway(bus, tokens, GatewayConfig(partition=partition, **cfg))
    runner = GatewayRunner(gw.make_app(), access_log=None)  # as __main__ serves it (its protocol logged the traceback)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield bus, tokens, gw, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()
        for t in tasks:
            t.cancel()
        if worker is not None:
            await worker.stop()


def _one(evs, kind, rid):
    got = [e for e in evs if isinstance(e, kind) and e.request == rid]
    assert len(got) == 1, got
    return got[0]


async def _engine_stopped(bus, rid: str, sub) -> tuple[RequestCancelled, RequestFinished]:
    """The cancel and the engine's end of ``rid``; then nothing more of it for 0.6 s."""
    cancel = await wait_for_event(bus, lambda e: isinstance(e, RequestCancelled) and e.request == rid, timeout=3.0)
    fin = await wait_for_event(bus, lambda e: isinstance(e, RequestFinished) and e.request == rid, timeout=3.0)
    while not sub.queue.empty():
        sub.queue.get_nowait()
    await asyncio.sleep(0.6)
    assert sub.queue.empty(), "token messages after the engine's end"
    evs = await all_events(bus)
    end = evs.index(fin)
    assert not [e for e in evs[end + 1:] if isinstance(e, IterationDone)], "decoding went on"
    assert _one(evs, RequestCancelled, rid) == cancel and _one(evs, RequestFinished, rid) == fin
    return cancel, fin


STREAMS = {  # path -> a streaming body asking for LONG tokens (ignore_eos: the sim engine would end its turn first)
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "y" * 300}], "max_tokens": LONG, "stream": True,
                             "ignore_eos": True},
    "/v1/messages": {"model": "evolving-sim", "messages": [{"role": "user", "content": "y" * 300}],
                     "max_tokens": LONG, "stream": True, "ignore_eos": True},
}


@pytest.mark.parametrize("path", sorted(STREAMS))
async def test_a_streaming_client_that_disconnects_stops_the_engine_within_a_second(partition, caplog, capfd, path):
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    async with stack(partition) as (bus, tokens, gw, url), aiohttp.ClientSession() as http:
        r = await http.post(f"{url}{path}", json=STREAMS[path])
        assert r.status == 200
        rid = r.headers["x-request-id"]
        sub = await tokens.subscribe(rid)
        chunks = 0
        async for line in r.content:
            chunks += line.startswith(b"data: ")
            if chunks >= 3:  # the first tokens arrived
                break
        r.close()  # the client leaves
        cancel, fin = await _engine_stopped(bus, rid, sub)
        assert cancel.reason == "client_disconnected" and cancel.branch == rid.split("/")[0]
        assert (fin.node, fin.error) == ("n1", "cancelled") and 1 <= fin.output_tokens < LONG
        assert fin.ts - cancel.ts <= 1.0  # the engine's decoding stopped within a second
        assert gw.metrics.get("ei_gateway_cancelled_total", reason="client_disconnected") == 1
        assert gw.in_flight == 0
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.count("request_cancelled") >= 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_client_that_gives_up_on_a_plain_answer_stops_the_engine(partition):
    async with stack(partition) as (bus, tokens, _gw, url), aiohttp.ClientSession() as http:
        body = {"prompt": "z" * 200, "max_tokens": LONG, "ignore_eos": True}
        post = asyncio.create_task(http.post(f"{url}/v1/completions", json=body))
        sub_evt = await wait_for_event(bus, lambda e: isinstance(e, RequestSubmitted))
        sub = await tokens.subscribe(sub_evt.request)
        await wait_for_event(bus, lambda e: isinstance(e, RequestStarted) and e.phase == "decode")
        post.cancel()  # the client gives up waiting: its connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await post
        cancel, fin = await _engine_stopped(bus, sub_evt.request, sub)
        assert cancel.reason == "client_disconnected" and fin.error == "cancelled"
        assert fin.ts - cancel.ts <= 1.0


async def test_a_request_the_gateway_times_out_is_cancelled(partition):
    async with stack(partition, engine=False, token_timeout_s=0.3) as (bus, _tokens, _gw, url), \
            aiohttp.ClientSession() as http:
        r = await http.post(f"{url}/v1/completions", json={"prompt": "z" * 100, "max_tokens": 5})
        assert r.status == 504
        cancel = await wait_for_event(bus, lambda e: isinstance(e, RequestCancelled), timeout=3.0)
        assert cancel.reason == "timeout"
    async with stack(partition + "r", engine=False, router=False, route_timeout_s=0.3) as (bus, _t, _gw, url), \
            aiohttp.ClientSession() as http:
        r = await http.post(f"{url}/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True})
        assert r.status == 503
        cancel = await wait_for_event(bus, lambda e: isinstance(e, RequestCancelled), timeout=3.0)
        assert cancel.reason == "route_timeout"


async def test_a_finished_request_is_never_cancelled(partition):
    async with stack(partition) as (bus, _tokens, gw, url), aiohttp.ClientSession() as http:
        r = await http.post(f"{url}/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
        assert r.status == 200 and (await r.text()).endswith("data: [DONE]\n\n")
        r = await http.post(f"{url}/v1/completions", json={"prompt": "z" * 100, "max_tokens": 3})
        assert (await r.json())["usage"]["completion_tokens"] == 3
        await asyncio.sleep(0.4)
        assert not [e for e in await all_events(bus) if isinstance(e, RequestCancelled)]
        assert gw.metrics.get("ei_gateway_cancelled_total") == 0


async def test_a_stopping_gateway_cancels_what_it_fails(partition):
    """The gateway's shutdown fails its requests in flight to their clients (503) and cancels
    them on their engines first: nobody will read their output."""
    async with stack(partition) as (bus, tokens, gw, url), aiohttp.ClientSession() as http:
        path = "/v1/chat/completions"
        r = await http.post(f"{url}{path}", json=STREAMS[path])
        assert r.status == 200
        rid = r.headers["x-request-id"]
        sub = await tokens.subscribe(rid)
        await wait_for_event(bus, lambda e: isinstance(e, RequestStarted) and e.phase == "decode" and e.request == rid)
        assert await gw.cancel_in_flight("gateway_stopping") == 1
        assert gw.fail_in_flight("the gateway is shutting down; send the request again") == 1
        cancel, fin = await _engine_stopped(bus, rid, sub)
        assert cancel.reason == "gateway_stopping" and fin.error == "cancelled"
        assert fin.ts - cancel.ts <= 1.0
        assert b"shutting down" in await r.content.read()
        assert await gw.cancel_in_flight() == 0  # nothing left, nothing cancelled twice
