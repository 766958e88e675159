"""The engine's tokens back as an OpenAI response (step 6 of app.py's lifecycle).

``collect``: one JSON body (``/v1/chat/completions``, ``/v1/completions``); ``stream``: SSE chunks
(``stream: true``), the usage chunk when ``stream_options.include_usage``, then ``[DONE]``; with
``continuous_usage_stats`` too (vLLM's rule) every chunk carries ``usage``, its
``completion_tokens`` the tokens streamed so far. Both
call ``before_done`` (the branch's end) before the client sees the end of the response. With a
tool-call parser (``Meta.tools``), calls in the text become ``message.tool_calls`` / streamed
``delta.tool_calls`` (each call whole in one delta) and ``finish_reason`` ``tool_calls``.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from events.wire import sim_text
from services.drivers.gateway.api import ApiError
from services.drivers.gateway.guard import STREAMING
from services.drivers.gateway.meta import Meta, engine_failure, next_token
from services.drivers.gateway.metrics import GatewayMetrics


async def collect(tsub, meta: Meta, before_done, *,
                  timeout_s: float, metrics: GatewayMetrics) -> web.Response:
    parts: list[str] = []
    got, simulated = 0, False
    while True:
        m = await next_token(tsub, meta, timeout_s)
        simulated |= m.simulated
        if m.kind == "error":
            raise engine_failure(meta, m)
        parts.append(m.text)
        got += m.tokens
        if m.kind == "done":
            total = max(got, m.total)
            if total > got and simulated:  # a lost chunk (core NATS is at-most-once)
                parts.append(sim_text(total - got, got))
            metrics.inc("ei_gateway_output_tokens_total", total)
            text, calls = meta.split("".join(parts), end=True)
            await before_done()
            return web.json_response(meta.full_body(text, total, meta.finish_reason(m.finish_reason or "length"),
                                                    simulated, calls), headers=meta.headers())


async def stream(req: web.Request, tsub, meta: Meta, include_usage: bool, before_done, *,
                  timeout_s: float, metrics: GatewayMetrics, continuous_usage: bool = False) -> web.StreamResponse:
    m = await next_token(tsub, meta, timeout_s)  # errors before the first byte are plain JSON errors
    if m.kind == "error":
        raise engine_failure(meta, m)
    resp = SseResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **meta.headers()})
    req[STREAMING] = True  # from here on, errors are events inside the stream
    await resp.prepare(req)  # the headers go out with the first chunk (one write)
    got, first, tail = 0, True, b""
    # a client that leaves makes a write raise ConnectionResetError: cancel.Cancels takes it from there
    while True:
        if m.kind in ("first", "chunk"):
            got += m.tokens
            text, calls = meta.split(m.text)
            if first or text or calls:  # a possible tool-call marker held back: nothing to say yet
                out = meta.chunk(text, None, first, m.simulated, calls)
                if continuous_usage:
                    out["usage"] = meta.usage(got)
                await resp.write(sse(out))
            first = False
        elif m.kind == "done":
            got += m.tokens
            total = max(got, m.total)
            metrics.inc("ei_gateway_output_tokens_total", total)
            text, calls = meta.split(m.text + (sim_text(total - got, got) if total > got and m.simulated else ""), end=True)
            out = meta.chunk(text, meta.finish_reason(m.finish_reason or "length"), first, m.simulated, calls)
            if continuous_usage:
                out["usage"] = meta.usage(total)
            tail = sse(out)
            if include_usage:
                tail += sse(meta.usage_chunk(total))
            break
        elif m.kind == "error":
            err = engine_failure(meta, m)
            tail = sse(err.body())
            metrics.inc("ei_gateway_errors_total", status=str(err.status), code=err.code)
            break
        try:
            m = await next_token(tsub, meta, timeout_s)
        except ApiError as exc:
            metrics.inc("ei_gateway_errors_total", status=str(exc.status), code=exc.code)
            tail = sse(exc.body())
            break
    await before_done()  # BranchEnded before the client sees the end
    await resp.write_eof(tail + b"data: [DONE]\n\n")  # the last chunk, [DONE] and the end: one write
    return resp


class SseResponse(web.StreamResponse):
    """A streamed response whose headers are written with its first chunk, not on their own
    (aiohttp's ``Response`` does the same): one socket write less before the first token."""

    _send_headers_immediately = False


def sse(obj: dict) -> bytes:
    return b"data: " + _json(obj) + b"\n\n"


_json = msgspec.json.Encoder().encode
