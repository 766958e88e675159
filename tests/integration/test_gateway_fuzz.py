"""Fuzz the gateway against its own OpenAPI description (schemathesis), on loopback.

A live gateway (aiohttp on a free 127.0.0.1 port, in a thread with its own event loop) over an
InMemoryBus, with a fast fake router + engine that routes every request and answers it in two
token messages, so every generated request runs to its end. schemathesis loads
``GET /openapi.json`` from it and sends generated requests (valid ones and, in its negative
mode, invalid ones) to every operation, checking: no 5xx, the status code and the content type
are documented, and a JSON body matches its documented schema.

Bounded and deterministic by default (Hypothesis ``derandomize``, no example database,
``MAX_EXAMPLES`` = 15 per operation and mode: about 15 s). A longer randomized run (``-s`` prints
each operation's status codes, ``EI_FUZZ_DEBUG=1`` also the 400 bodies):

    EI_FUZZ_EXAMPLES=300 .venv/bin/python -m pytest -p no:cacheprovider -q -s tests/integration/test_gateway_fuzz.py

The ``test_regression_*`` tests below replay, as raw bytes, the bad input that gave a 5xx
(docs/gateway.md, "OpenAPI description and fuzzing", lists what was found and fixed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")  # the dev extra (pyproject.toml)

from aiohttp import web
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from events.catalog import RequestSubmitted, RouteDecided
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens, TokenMsg, sim_text
from services.drivers.gateway import openapi
from services.drivers.gateway.app import Gateway, GatewayConfig

PARTITION = "fuzz"
FUZZ_EXAMPLES = int(os.environ.get("EI_FUZZ_EXAMPLES", "0") or 0)  # > 0: the longer randomized run
MAX_EXAMPLES = FUZZ_EXAMPLES or 15
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


async def fast_cluster(bus, tokens) -> None:
    """Route every RequestSubmitted and answer it at once: a "first" token, then "done"."""
    async with bus.consumer(None, start_seq=1, subjects=f"ei.{bus.partition}.agent.>") as c:
        async for d in c:
            ev = d.event
            if not isinstance(ev, RequestSubmitted):
                continue
            await bus.publish(RouteDecided(ts=ev.ts, request=ev.request, prefill_node="n1", decode_node="n2",
                                           policy="fuzz"))
            await tokens.publish(TokenMsg(request=ev.request, kind="first", tokens=1, total=1, text=sim_text(1),
                                          simulated=True, cached_tokens=0))
            rest = max(0, ev.max_tokens - 1)
            await tokens.publish(TokenMsg(request=ev.request, kind="done", tokens=rest, total=ev.max_tokens,
                                          text=sim_text(rest), finish_reason="length", simulated=True))


class LiveGateway:
    """The gateway served on 127.0.0.1:<free port> from a thread of its own."""

    def __init__(self, **cfg) -> None:
        self.cfg = cfg  # GatewayConfig fields
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="fuzz-gateway", daemon=True)
        self.port = 0
        self.error: BaseException | None = None
        self._stop: asyncio.Event | None = None

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to the test thread
            self.error = exc
            self.ready.set()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        bus, tokens = InMemoryBus(PARTITION), MemoryTokens(PARTITION)
        # Short timeouts: a request the fake does not answer fails in seconds, not minutes.
        cfg = GatewayConfig(partition=PARTITION, route_timeout_s=2.0, token_timeout_s=2.0,
                            context_length=300_000, **self.cfg)
        gw = Gateway(bus, tokens, cfg)
        task = asyncio.create_task(fast_cluster(bus, tokens))
        runner = web.AppRunner(gw.make_app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def __enter__(self) -> str:
        self.thread.start()
        if not self.ready.wait(30) or self.error is not None:
            raise RuntimeError(f"the gateway did not start: {self.error!r}")
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(30)


@pytest.fixture(scope="module")
def gateway_url():
    with LiveGateway() as url:
        yield url


@pytest.fixture(scope="module")
def gateway_schema(gateway_url):
    """The description the live gateway serves (``GET /openapi.json``)."""
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    schema.config.update(base_url=gateway_url)
    return schema


def _operations() -> list[tuple[str, str, GenerationMode]]:
    """(method, path, mode) of every documented operation; negative too where there is a body."""
    out = []
    for path, item in openapi.build()["paths"].items():
        for method, op in item.items():
            out.append((method.upper(), path, GenerationMode.POSITIVE))
            if op.get("requestBody"):  # (a negative path parameter, "", cannot be sent)
                out.append((method.upper(), path, GenerationMode.NEGATIVE))
    return out


# schemathesis.pytest.from_fixture would be the short way; with pytest 9 it fails (it reads
# ``request.node._nodeid``), so each operation's strategy is driven by Hypothesis directly.
@pytest.mark.parametrize(("method", "path", "mode"), _operations(),
                         ids=lambda v: str(v).lower() if isinstance(v, GenerationMode) else str(v))
def test_gateway_fuzz(gateway_schema, gateway_url, method, path, mode):
    operation = gateway_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=not FUZZ_EXAMPLES,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    def run(case):
        response = case.call_and_validate(base_url=gateway_url, checks=CHECKS, timeout=30)
        statuses[response.status_code] += 1
        if os.environ.get("EI_FUZZ_DEBUG") and response.status_code == 400:
            print(response.text[:200])

    statuses: Counter[int] = Counter()
    run()
    print(f"{method} {path} {mode}: {sum(statuses.values())} requests, status codes {dict(sorted(statuses.items()))}")
    if mode is GenerationMode.POSITIVE and method == "POST":  # the generated requests got through
        assert statuses[200] > 0, statuses


# ----------------------------------------------------------------------------- regressions
# 5xx found by hand-made bad input beyond what the description can generate (requests sends
# header values as Latin-1 text and bodies as given): raw bytes on a socket, exactly as found.
KEY = "fuzz-key-12345678"


def _raw(url: str, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` as is to the gateway at ``url``; (status, body) of the answer."""
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _post(url: str, path: bytes, body: bytes, headers: bytes = b"") -> tuple[int, bytes]:
    return _raw(url, b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n"
                + headers + b"\r\n" + body)


CHAT = (b"/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2}')
MESSAGES = (b"/v1/messages", b'{"model":"evolving-sim","messages":[{"role":"user","content":"hi"}],"max_tokens":2}')


@pytest.mark.parametrize("route", [CHAT, MESSAGES], ids=["chat", "messages"])
@pytest.mark.parametrize("header, name", [
    (b"x-branch-id: \xff\xfe", "x-branch-id"),  # was 500 UnicodeEncodeError (token_key)
    (b"x-claude-code-session-id: \x80", "x-claude-code-session-id"),  # was 500
    (b"session-id: \xff", "session-id"),  # was 500
    (b"x-branch-id: a\r\nx-parent-branch-id: \xc3", "x-parent-branch-id"),  # was 503 bus_unavailable
])
def test_regression_branch_header_not_utf8_is_a_400(gateway_url, route, header, name):
    status, body = _post(gateway_url, *route, header + b"\r\n")
    assert status == 400, body
    assert b"not valid UTF-8" in body and name.encode() in body


@pytest.mark.parametrize("route", [CHAT, MESSAGES], ids=["chat", "messages"])
@pytest.mark.parametrize("encoding", [b"gzip", b"deflate"])
def test_regression_body_that_does_not_decompress_is_a_400(gateway_url, route, encoding):
    """Was 500 ``internal error: RequestPayloadError``: ``Content-Encoding: gzip`` + ``garbage``."""
    status, body = _post(gateway_url, route[0], b"garbage", b"Content-Encoding: " + encoding + b"\r\n")
    assert status == 400, body
    assert b"could not be read" in body
    shape = json.loads(body)
    assert shape["type"] == "error" if route is MESSAGES else shape["error"]["code"] == "invalid_body"


def test_regression_api_key_not_utf8_is_a_401():
    """Was 500 (``UnicodeEncodeError`` in ApiKeys.check) with keys configured: ``x-api-key: \\xff``,
    also behind ``Expect: 100-continue`` (the handler that checks before the body)."""
    with LiveGateway(api_keys=frozenset({KEY})) as url:
        for extra in (b"", b"Expect: 100-continue\r\n"):
            status, body = _post(url, *CHAT, b"x-api-key: \xff\r\n" + extra)
            assert status == 401, body
            status, body = _post(url, *CHAT, b"Authorization: Bearer \xff\xfe\xfd\r\n" + extra)
            assert status == 401, body
        status, _ = _post(url, *CHAT, f"x-api-key: {KEY}\r\n".encode())
        assert status == 200
