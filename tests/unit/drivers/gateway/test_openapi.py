"""The OpenAPI description (services/drivers/gateway/openapi.py, ``GET /openapi.json``): it
validates as OpenAPI 3.1, documents every route the app registers, its request bodies are the
Structs the routes decode into, and what the app answers fits its response Structs."""

from __future__ import annotations

import copy
import json

import msgspec
import pytest

from events.catalog import RouteDecided
from services.adapters.bus import InMemoryBus
from services.adapters.bus.tokens import MemoryTokens
from services.drivers.gateway import anthropic_api, api, headers, openapi
from services.drivers.gateway.app import Gateway, GatewayConfig
from services.drivers.gateway.meta import Meta

schemathesis = pytest.importorskip("schemathesis")  # the dev extra: its loader validates the document


def _routes() -> set[tuple[str, str]]:
    app = Gateway(InMemoryBus("t"), MemoryTokens("t"), GatewayConfig(partition="t")).make_app()
    out = set()
    for route in app.router.routes():
        if route.method == "HEAD":  # aiohttp adds one to every GET
            continue
        path = route.resource.canonical.replace("{model:.+}", "{model}")
        out.add((route.method, path))
    return out


def test_the_description_validates_as_openapi_3_1():
    doc = openapi.build("evolving-sim")
    assert doc["openapi"] == "3.1.0"
    schemathesis.openapi.from_dict(doc).validate()
    json.dumps(doc)  # served as JSON
    broken = copy.deepcopy(doc)
    broken["paths"]["/health"]["get"]["responses"] = "nope"
    with pytest.raises(Exception, match="nope"):  # the validator is not a no-op
        schemathesis.openapi.from_dict(broken).validate()


def test_every_registered_route_is_documented_and_nothing_else():
    documented = {(m.upper(), p) for p, item in openapi.build()["paths"].items() for m in item}
    assert documented == _routes()
    assert ("GET", "/openapi.json") in documented


def test_request_bodies_are_the_structs():
    comps = openapi.build("m")["components"]["schemas"]
    for cls in openapi.REQUESTS:
        c = comps[cls.__name__]
        assert set(c["properties"]) == set(cls.__struct_fields__)
        assert c["additionalProperties"] is True  # api.convert drops (and the app counts) unknown fields
        assert c["properties"]["model"]["anyOf" if "anyOf" in c["properties"]["model"] else "enum"]
    assert comps["MessagesRequest"]["properties"]["model"] == {"type": "string", "enum": ["m"]}
    assert set(comps["AgentHints"]["properties"]) == set(api.AGENT_HINTS)
    # without a model name (the generic document) the field is the Struct's own
    assert openapi.build()["components"]["schemas"]["MessagesRequest"]["properties"]["model"]["type"] == "string"


def test_headers_come_from_headers_py():
    doc = openapi.build()
    names = {p["name"] for p in doc["paths"]["/v1/chat/completions"]["post"]["parameters"]}
    expected = {f.branch for f in headers.FAMILIES} | {f.parent for f in headers.FAMILIES if f.parent} \
        | {f.child for f in headers.FAMILIES if f.child} | set(headers.END_HEADERS) | {headers.H_MODE,
                                                                                         headers.H_COMPACTED}
    assert names == expected
    msg = {p["name"] for p in doc["paths"]["/v1/messages"]["post"]["parameters"]}
    assert msg == expected | {"anthropic-version", "anthropic-beta"}
    assert doc["components"]["securitySchemes"]["apiKey"]["name"] == "x-api-key"
    assert doc["paths"]["/health"]["get"]["security"] == []


def test_error_shapes_per_route():
    paths = openapi.build()["paths"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert paths[path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/OpenAIError")
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        assert paths[path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
            "/AnthropicError")


def _fits(obj: dict, cls) -> None:
    msgspec.convert(obj, cls)  # forbid_unknown_fields: a key the Struct does not know fails


ROUTE = RouteDecided(ts=1.0, request="b/1", prefill_node="n1", decode_node="n2", policy="p")


@pytest.mark.parametrize("unapplied", [[], ["temperature"]])
@pytest.mark.parametrize("route", [ROUTE, None])
def test_openai_bodies_fit_their_structs(unapplied, route):
    for chat, full, chunk in ((True, openapi.ChatCompletion, openapi.ChatCompletionChunk),
                              (False, openapi.Completion, openapi.Completion)):
        meta = Meta("b/1", "b", 0, route, 10, 0, "m", chat, 4, 0, unapplied, cached_tokens=3)
        _fits(meta.full_body("tok ", 1, "length", True), full)
        _fits(meta.full_body("", 0, "stop", False), full)
        _fits(meta.chunk("tok ", None, True, True), chunk)
        _fits(meta.chunk("tok ", None, False, True), chunk)
        _fits(meta.chunk("tok ", "length", False, True), chunk)
        _fits(meta.usage_chunk(4), chunk)


def test_anthropic_bodies_fit_their_structs():
    meta = Meta("b/1", "b", 0, ROUTE, 10, 0, "m", True, 4, 0, ["top_k"])
    reply = anthropic_api.Reply("msg_1", "m", 10, 4, meta.extension(True))
    _fits(reply.message("tok ", 1, "length"), openapi.AnthropicMessage)
    _fits(reply.message("", 0, "stop"), openapi.AnthropicMessage)
    _fits(reply.message("", 1, None, streaming=True), openapi.AnthropicMessage)


@pytest.mark.parametrize("status", sorted(set(api.DEFAULT_CODES) | set(anthropic_api.ERROR_TYPES) | {417}))
def test_error_bodies_fit_their_structs(status):
    exc = api.ApiError(status, "m", "p")
    _fits(exc.body(), openapi.OpenAIError)
    _fits(api.ApiError(status, "m").body(), openapi.OpenAIError)
    _fits(anthropic_api.error_body(exc), openapi.AnthropicError)


async def test_small_endpoints_fit_their_structs():
    gw = Gateway(InMemoryBus("t"), MemoryTokens("t"), GatewayConfig(partition="t"))
    _fits(json.loads((await gw.health(None)).body), openapi.Health)
    _fits(json.loads((await gw.hello(None)).body), openapi.Hello)
    _fits(json.loads((await gw.models(None)).body), openapi.ModelList)
    served = json.loads((await gw.openapi_view(None)).body)
    assert served == json.loads(json.dumps(openapi.build(None, gw.cfg.max_tokens_limit)))  # any model name
    assert served["components"]["schemas"]["MessagesRequest"]["properties"]["max_tokens"]["maximum"] == 262_144


def _frames(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for frame in raw.decode().strip().split("\n\n"):
        event, data = frame.split("\n")
        out.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_anthropic_stream_events_fit_their_structs():
    meta = Meta("b/1", "b", 0, ROUTE, 10, 0, "m", True, 4, 0, [])
    reply = anthropic_api.Reply("msg_1", "m", 10, 4, meta.extension(True))
    b = anthropic_api.Blocks()
    raw = (reply.start(1, b) + b.text("tok ") + b.end() + reply.end(2, "length") + reply.stop()
           + anthropic_api.error_event(api.ApiError(504, "slow")))
    frames = _frames(raw)
    assert [e for e, _ in frames] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop", "error"]
    assert set(openapi.ANTHROPIC_EVENTS) == {e for e, _ in frames}
    for event, data in frames:
        assert data["type"] == event
        msgspec.convert(data, openapi.AnthropicStreamEvent)
