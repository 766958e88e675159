"""The engine's tokens back as an OpenAI Responses API answer (step 6 of app.py's lifecycle).

``collect``: one response object; ``stream``: the ``response.*`` event sequence. The shapes are
``responses_api``'s (pure); this is the relay over the token channel, as ``openai_relay`` and
``anthropic_relay`` are for the other routes. Both hand the finished response to ``keep``
(the store behind ``previous_response_id``) and call ``before_done`` (the branch's end) before
the client sees the end of the response.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from aiohttp import web

from events.wire import token_key
from services.drivers.gateway import responses_api
from services.drivers.gateway.anthropic_relay import pieces
from services.drivers.gateway.api import ApiError
from services.drivers.gateway.guard import STREAMING
from services.drivers.gateway.meta import Meta
from services.drivers.gateway.metrics import GatewayMetrics
from services.drivers.gateway.openai_relay import SseResponse
from services.drivers.gateway.toolcalls import ToolCall, merged

Keep = Callable[[dict], None]  # the finished response object -> the store (or nowhere: store false)


def make_builder(meta: Meta, req: responses_api.ResponsesRequest, simulated: bool,
                 namespaced: dict[str, tuple[str, str]] | None = None) -> responses_api.ResponseBuilder:
    return responses_api.ResponseBuilder("resp_" + token_key(meta.request or meta.branch), meta.created,
                                         meta.model, req, meta.extension(simulated), namespaced=namespaced or {})


def _final(b: responses_api.ResponseBuilder, meta: Meta, total: int, finish: str) -> dict:
    return b.body(responses_api.status_of(finish), responses_api.usage(meta.prompt_tokens, meta.cached_tokens, total))


async def collect(tsub, meta: Meta, req: responses_api.ResponsesRequest, keep: Keep, before_done, *,
                  timeout_s: float, metrics: GatewayMetrics,
                  namespaced: dict[str, tuple[str, str]] | None = None) -> web.Response:
    parts, simulated, end = [], False, None
    async with contextlib.aclosing(pieces(tsub, meta, timeout_s, metrics)) as relay:
        while end is None:
            text, sim, end = await anext(relay)
            parts.append(text)
            simulated |= sim
    b = make_builder(meta, req, simulated, namespaced)
    status = "incomplete" if responses_api.status_of(end[1]) == "incomplete" else "completed"
    said = meta.pieces("".join(parts), end=True)
    for p in merged(said):
        if isinstance(p, ToolCall):
            b.output.append(b.call_item(p))
        else:
            b.add_message(p, status)
    if not b.output:
        b.add_message("", status)
    body = _final(b, meta, *end)
    keep(body)
    await before_done()
    return web.json_response(body, headers=meta.headers())


async def stream(req: web.Request, tsub, meta: Meta, rreq: responses_api.ResponsesRequest, keep: Keep,
                 before_done, *, timeout_s: float, metrics: GatewayMetrics,
                 namespaced: dict[str, tuple[str, str]] | None = None) -> web.StreamResponse:
    """response.created, response.in_progress, output_item.added, content_part.added,
    output_text.delta..., output_text.done, content_part.done, output_item.done, then
    response.completed (response.incomplete at the budget); an ``error`` event and
    response.failed if it fails midway."""
    relay = pieces(tsub, meta, timeout_s, metrics)
    try:
        text, simulated, end = await anext(relay)  # errors before the first byte are plain JSON errors
    except BaseException:
        await relay.aclose()
        raise
    b = make_builder(meta, rreq, simulated, namespaced)
    resp = SseResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **meta.headers()})
    req[STREAMING] = True  # from here on, errors are events inside the stream
    await resp.prepare(req)
    try:
        # without a parser the message opens at once (its text is all there is); with one, on its first text
        head = b.start() + (b.open_message() if meta.tools is None else b"")
        await resp.write(head + b.pieces(meta.pieces(text, end is not None)))
        out = b""  # the last message's events go out with the end (one write)
        try:
            while end is None:
                text, _sim, end = await anext(relay)
                out = b.pieces(meta.pieces(text, end is not None))
                if end is None:
                    await resp.write(out)
                    out = b""
        except ApiError as exc:
            metrics.inc("ei_gateway_errors_total", status=str(exc.status), code=exc.code)
            tail = out + b.failed(exc)
        else:
            status = "incomplete" if responses_api.status_of(end[1]) == "incomplete" else "completed"
            if not b.message_open and not b.output:  # nothing said at all: one empty message, as without a parser
                out += b.open_message()
            tail = out + (b.close_message(status) if b.message_open else b"")
            body = _final(b, meta, *end)
            keep(body)
            await before_done()  # BranchEnded before the client sees response.completed
            tail += b.finish(body)
        await resp.write_eof(tail)  # the last events and the end of the response: one write
    finally:  # a client that leaves makes a write raise ConnectionResetError: the serving path takes it from there
        await relay.aclose()
    return resp
