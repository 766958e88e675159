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
import time
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
from services.drivers.gateway.guard import GatewayRunner

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
        runner = GatewayRunner(gw.make_app(), access_log=None)  # as __main__ serves it
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


# ----------------------------------------------------------------------------- bad bytes
COMPLETIONS = (b"/v1/completions", b'{"prompt":"hi","max_tokens":2}')
COUNT = (b"/v1/messages/count_tokens", b'{"model":"evolving-sim","messages":[{"role":"user","content":"hi"}]}')
RESPONSES = (b"/v1/responses", b'{"model":"evolving-sim","input":"hi","max_output_tokens":2}')
ROUTES = {"chat": CHAT, "completions": COMPLETIONS, "messages": MESSAGES, "count_tokens": COUNT,
          "responses": RESPONSES}


def _shape(route: tuple[bytes, bytes], body: bytes) -> dict:
    """The error body, checked to be the route's API shape: Anthropic's on /v1/messages*, else
    OpenAI's (``code`` a string); returns the inner ``error``."""
    doc = json.loads(body)
    if route[0].startswith(b"/v1/messages"):
        assert doc["type"] == "error" and set(doc["error"]) == {"type", "message"}, doc
        assert doc["error"]["type"] in ("invalid_request_error", "not_found_error"), doc
    else:
        assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
        assert isinstance(doc["error"]["code"], str)
    return doc["error"]


@pytest.mark.parametrize("name", list(ROUTES))
@pytest.mark.parametrize("depth", [129, 990, 100_000])
def test_regression_json_nested_too_deep_is_a_400(gateway_url, name, depth):
    """Was 500 (``RecursionError`` in msgspec) at 990 deep on all four POST routes."""
    route = ROUTES[name]
    body = route[1][:-1] + b',"metadata":' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
    status, out = _post(gateway_url, route[0], body)
    assert status == 400, out
    err = _shape(route, out)
    assert f"nested {depth} deep" in err["message"] and "at most 128 deep" in err["message"]
    if "code" in err:
        assert (err["code"], err["param"]) == ("json_too_deep", "body")


@pytest.mark.parametrize("name", ["chat", "messages"])
@pytest.mark.parametrize(("extra", "code"), [
    (b"x-big: " + b"a" * 100_000 + b"\r\n", "header_too_large"),  # over aiohttp's 8190-byte field limit
    (b"x-branch-id: a\x01b\r\n", "invalid_header"),  # a control character in a header value
    (b"".join(b"x-h%d: 1\r\n" % i for i in range(200)), "invalid_header"),  # over 128 headers
    (b"Content-Length: 99\r\n", "invalid_header"),  # a second, different Content-Length
])
def test_regression_aiohttps_own_400_is_json_in_the_routes_shape(gateway_url, capfd, caplog, name, extra, code):
    """Was aiohttp's plain text (``Got more than 8190 bytes when reading``) and a traceback in
    the log; now the route's JSON and one warning line."""
    route = ROUTES[name]
    capfd.readouterr()
    status, out = _post(gateway_url, *route, extra)
    assert status == 400, out
    err = _shape(route, out)
    assert err["message"].startswith("the HTTP request could not be parsed") and len(err["message"]) < 700
    if "code" in err:
        assert err["code"] == code
    time.sleep(0.05)  # the gateway's thread logs after it answered
    assert "http_protocol_error" in "".join(capfd.readouterr())
    _no_traceback(caplog)


def _no_traceback(caplog) -> None:
    """aiohttp logs through the standard logging module (``aiohttp.server``): no record with a traceback."""
    bad = [r for r in caplog.records if r.name.startswith("aiohttp") and (r.exc_info or r.levelno >= 40)]
    assert not bad, [(r.name, r.getMessage()) for r in bad]


def test_regression_a_bad_request_line_is_json(gateway_url):
    status, out = _raw(gateway_url, b"GARBAGE\r\n\r\n")
    assert status == 400 and json.loads(out)["error"]["code"] == "bad_request_line"
    status, out = _raw(gateway_url, b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n")
    assert status == 400 and json.loads(out)["error"]["code"] in ("bad_request_line", "bad_request")


def test_regression_an_undecodable_gzip_body_logs_one_line(gateway_url, capfd, caplog):
    """The 400 went out, then aiohttp logged ``Unhandled exception`` with a traceback while it
    drained the body: now one warning line."""
    capfd.readouterr()
    status, _ = _post(gateway_url, CHAT[0], b"garbage", b"Content-Encoding: gzip\r\n")
    assert status == 400
    time.sleep(0.05)
    assert "http_body_unreadable" in "".join(capfd.readouterr())
    _no_traceback(caplog)


@pytest.mark.parametrize("name", ["chat", "completions", "messages", "count_tokens", "responses"])
def test_regression_a_7mb_model_name_is_not_echoed_whole(gateway_url, name):
    """Was echoed whole in the 404 (7 MB back)."""
    route = ROUTES[name]
    doc = json.loads(route[1])
    doc["model"] = "m" * 7_000_000
    status, out = _post(gateway_url, route[0], json.dumps(doc).encode())
    assert status == 404 and len(out) < 1500, (status, len(out))
    assert "(7000000 chars)" in _shape(route, out)["message"]


def test_regression_unknown_route_and_method_are_json(gateway_url):
    status, out = _raw(gateway_url, b"GET /" + b"x" * 5000 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert status == 404 and json.loads(out)["error"]["code"] == "not_found" and len(out) < 1000
    status, out = _post(gateway_url, b"/v1/models", b"{}")
    assert status == 405 and json.loads(out)["error"]["code"] == "method_not_allowed"
