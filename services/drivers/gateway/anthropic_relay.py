"""The engine's tokens back as an Anthropic ``/v1/messages`` response (step 6 of app.py's lifecycle).

``collect``: one message body; ``stream``: Anthropic's event sequence. The shapes are
``anthropic_api``'s (pure); this is the relay over the token channel, as ``openai_relay`` is for
the OpenAI endpoints.
"""

from __future__ import annotations

import contextlib

from aiohttp import web

from events.wire import sim_text, token_key
from services.drivers.gateway import anthropic_api
from services.drivers.gateway.api import ApiError
from services.drivers.gateway.guard import STREAMING
from services.drivers.gateway.meta import Meta, engine_failure, next_token
from services.drivers.gateway.metrics import GatewayMetrics
from services.drivers.gateway.openai_relay import SseResponse


async def pieces(tsub, meta: Meta, timeout_s: float, metrics: GatewayMetrics):
    """The engine's messages as ``(text, simulated, end)``; ``end`` is ``(total tokens,
    finish_reason)`` on the last one (a lost chunk filled in from ``done.total``). An engine
    error is a 502 :class:`ApiError`, silence a 504."""
    got = 0
    while True:
        m = await next_token(tsub, meta, timeout_s)
        if m.kind == "error":
            raise engine_failure(meta, m)
        got += m.tokens
        if m.kind == "done":
            total = max(got, m.total)
            metrics.inc("ei_gateway_output_tokens_total", total)
            fill = sim_text(total - got, got) if total > got and m.simulated else ""
            yield m.text + fill, m.simulated, (total, m.finish_reason or "length")
            return
        yield m.text, m.simulated, None


def make_reply(meta: Meta, simulated: bool) -> anthropic_api.Reply:
    return anthropic_api.Reply("msg_" + token_key(meta.request or meta.branch), meta.model,
                               meta.prompt_tokens, meta.cached_tokens, meta.extension(simulated))


def messages_headers(meta: Meta) -> dict[str, str]:
    return {**meta.headers(), "request-id": meta.request} if meta.request else meta.headers()


async def collect(tsub, meta: Meta, before_done, *,
                  timeout_s: float, metrics: GatewayMetrics) -> web.Response:
    parts, simulated, end = [], False, None
    async with contextlib.aclosing(pieces(tsub, meta, timeout_s, metrics)) as relay:
        while end is None:
            text, sim, end = await anext(relay)
            parts.append(text)
            simulated |= sim
    await before_done()
    said = meta.pieces("".join(parts), end=True)
    body = make_reply(meta, simulated).message("", end[0], meta.finish_reason(end[1]), pieces=said)
    return web.json_response(body, headers=messages_headers(meta))


async def stream(req: web.Request, tsub, meta: Meta, before_done, *,
                  timeout_s: float, metrics: GatewayMetrics) -> web.StreamResponse:
    """Anthropic's sequence: message_start, content_block_start, ping, content_block_delta...,
    content_block_stop, message_delta, message_stop (an ``error`` event if it fails midway)."""
    relay = pieces(tsub, meta, timeout_s, metrics)
    try:
        text, simulated, end = await anext(relay)  # errors before the first byte are plain JSON errors
    except BaseException:
        await relay.aclose()
        raise
    reply = make_reply(meta, simulated)
    resp = SseResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                **messages_headers(meta)})
    req[STREAMING] = True  # from here on, errors are events inside the stream
    await resp.prepare(req)
    blocks = anthropic_api.Blocks(lazy=meta.tools is not None)
    try:
        await resp.write(reply.start(end[0] if end else 1, blocks) + blocks.pieces(meta.pieces(text, end is not None)))
        out = b""  # the last message's blocks go out with the end (one write)
        try:
            while end is None:
                text, _sim, end = await anext(relay)
                out = blocks.pieces(meta.pieces(text, end is not None))
                if end is None:
                    await resp.write(out)
                    out = b""
        except ApiError as exc:
            metrics.inc("ei_gateway_errors_total", status=str(exc.status), code=exc.code)
            tail = anthropic_api.error_event(exc)
        else:
            tail = out + blocks.end() + reply.end(end[0], meta.finish_reason(end[1]))
            await before_done()  # BranchEnded before the client sees message_stop
            tail += reply.stop()
        await resp.write_eof(tail)  # the last events and the end of the response: one write
    finally:  # a client that leaves makes a write raise ConnectionResetError: cancel.Cancels takes it from there
        await relay.aclose()
    return resp
