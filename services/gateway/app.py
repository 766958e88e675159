"""OpenAI-compatible HTTP gateway (aiohttp): harness signals in, events out, tokens back.

Request lifecycle (one POST /v1/chat/completions or /v1/completions)
1. Parse the JSON body (400 naming the field on bad input) and the branch headers
   (``services.gateway.headers``; 400 on a bad value, 409 on a branch that has ended).
2. Render the prompt (chat template, ``services.gateway.tokenizer``), tokenise it and compute
   the chained block hashes (``events.hashing.block_hashes``).
3. Register the request with the route watcher and subscribe to its token subject
   (``services.gateway.tokens``) *before* publishing, so neither answer can be missed.
4. Publish ``BranchOpened`` (first sight), ``ContextCompacted`` (header or inferred) and
   ``RequestSubmitted`` on the partition's stream.
5. Wait for the non-shadow ``RouteDecided`` of the request (``route_timeout_s``, then 503).
6. Relay the engine's token messages: SSE chunks (``stream: true``) or one JSON body.
   ``token_timeout_s`` of silence ends the request (504, or an error event in a stream).
7. When the response completes, before the client sees its end (and after a failure): ``BranchEnded`` when ``x-branch-end`` /
   ``x-dynamo-session-final`` was true, or when the request had no branch headers (it is then
   served as a one-request branch and counted in ``ei_gateway_headerless_requests_total``).

A request with ``max_tokens: 0`` and a branch-end header is a *branch-end request* (Dynamo's
"dedicated minimal request" when a session ends): it only publishes ``BranchEnded``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from aiohttp import web

from events.catalog import Event, RouteDecided
from events.hashing import block_hashes
from events.subjects import token
from events.wire import TokenMsg, sim_text
from services.gateway.headers import (
    BranchSignals,
    BranchStateError,
    BranchTable,
    HeaderError,
    parse_branch_headers,
)
from services.gateway.tokenizer import TemplateError, Tokenizer, load_tokenizer, render_chat
from services.logging import get_logger

log = get_logger("gateway")


@dataclass(frozen=True)
class GatewayConfig:
    partition: str = "default"
    model: str = "evolving-sim"
    block_tokens: int = 64
    route_timeout_s: float = 10.0
    token_timeout_s: float = 60.0
    default_max_tokens: int = 128
    max_tokens_limit: int = 65_536
    tokenizer: str | None = None
    src: str = "gateway"
    # Event ts = epoch + (wall - epoch) * time_scale: the scaled clock the sim engines and the
    # planner's ticker share (engine/worker.py). 1.0 = wall-clock seconds.
    time_scale: float = 1.0
    clock_epoch: float | None = None


def scaled_clock(time_scale: float, epoch: float | None) -> Callable[[], float]:
    """``epoch + (time.time() - epoch) * time_scale`` (plain ``time.time`` at scale 1)."""
    if time_scale == 1.0:
        return time.time
    e = time.time() if epoch is None else epoch
    return lambda: e + (time.time() - e) * time_scale


class ApiError(Exception):
    """An error answered as OpenAI-style JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_

    def response(self) -> web.Response:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}
        return web.json_response(body, status=self.status)


class Metrics:
    """Counters rendered in the Prometheus text format."""

    HELP: ClassVar[dict[str, str]] = {
        "ei_gateway_requests_total": "completion requests received, by endpoint",
        "ei_gateway_headerless_requests_total": "requests without branch headers (one-request branches)",
        "ei_gateway_errors_total": "requests answered with an error, by HTTP status",
        "ei_gateway_compactions_total": "ContextCompacted published, by reason (header|inferred)",
        "ei_gateway_branches_opened_total": "BranchOpened published",
        "ei_gateway_branches_ended_total": "BranchEnded published",
        "ei_gateway_output_tokens_total": "output tokens relayed to clients",
        "ei_gateway_route_timeouts_total": "requests with no RouteDecided in time",
    }

    def __init__(self) -> None:
        self.c: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()

    def inc(self, name: str, n: int = 1, **labels: str) -> None:
        self.c[(name, tuple(sorted(labels.items())))] += n

    def get(self, name: str, **labels: str) -> int:
        return self.c[(name, tuple(sorted(labels.items())))]

    def render(self, gauges: dict[str, float]) -> str:
        lines = []
        for name, help_ in self.HELP.items():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter"]
            rows = sorted((k, v) for k, v in self.c.items() if k[0] == name)
            if not rows and "{" not in name:
                lines.append(f"{name} 0")
            for (_, labels), v in rows:
                lab = ",".join(f'{k}="{val}"' for k, val in labels)
                lines.append(f"{name}{{{lab}}} {v}" if lab else f"{name} {v}")
        for name, v in gauges.items():
            lines += [f"# TYPE {name} gauge", f"{name} {v}"]
        return "\n".join(lines) + "\n"


class RouteWatcher:
    """One ephemeral consumer of ``ei.<p>.route`` from the head at start; resolves the future
    of each awaited request with its first non-shadow ``RouteDecided``."""

    def __init__(self, bus, partition: str) -> None:
        self.bus, self.partition = bus, partition
        self._waiting: dict[str, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()

    async def start(self) -> None:
        head = await self.bus.last_seq()
        self._task = asyncio.create_task(self._run(head + 1), name="route-watcher")
        await asyncio.wait_for(self._ready.wait(), 10.0)

    async def _run(self, start: int) -> None:
        subj = f"ei.{token(self.partition)}.route"
        async with self.bus.consumer(None, start_seq=start, subjects=subj) as c:
            self._ready.set()
            async for d in c:
                ev = d.event
                if isinstance(ev, RouteDecided) and not ev.shadow:
                    fut = self._waiting.get(ev.request)
                    if fut is not None and not fut.done():
                        fut.set_result(ev)

    def expect(self, request: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self._waiting[request] = fut
        return fut

    def forget(self, request: str) -> None:
        self._waiting.pop(request, None)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # shutting down
                await self._task


# --------------------------------------------------------------------------- body parsing
def _int_field(body: dict, name: str, lo: int, hi: int) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ApiError(400, f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}", name)
    return v


def parse_max_tokens(body: dict, default: int, limit: int) -> int:
    a = _int_field(body, "max_tokens", 0, limit)
    b = _int_field(body, "max_completion_tokens", 0, limit)
    v = b if b is not None else a
    return default if v is None else v


def parse_prompt(body: dict, tok: Tokenizer) -> tuple[list[int], str]:
    """Token ids of a /v1/completions ``prompt`` (a string, one-string list or token ids)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        return tok.encode(p), p
    if isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p):
        return list(p), ""
    raise ApiError(400, "'prompt' must be a string, a list with one string, or a non-empty list of "
                   "token ids (batched prompts are not supported)", "prompt")


async def read_json(request: web.Request) -> dict:
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", "body") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "body")
    return body


def _stream_flag(body: dict) -> bool:
    s = body.get("stream", False)
    if not isinstance(s, bool):
        raise ApiError(400, f"'stream' must be a boolean, got {s!r}", "stream")
    return s


# --------------------------------------------------------------------------- the gateway
GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")


class Gateway:
    """The HTTP app's state. ``bus``: NatsBus or InMemoryBus; ``tokens``: NatsTokens or
    MemoryTokens; ``clock`` gives event timestamps (seconds)."""

    def __init__(self, bus, tokens, config: GatewayConfig | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.bus, self.tokens = bus, tokens
        self.cfg = config or GatewayConfig()
        self.clock = clock or scaled_clock(self.cfg.time_scale, self.cfg.clock_epoch)
        self.tokenizer, self.tokenizer_note = load_tokenizer(self.cfg.tokenizer)
        self.table = BranchTable(src=self.cfg.src)
        self.metrics = Metrics()
        self.watcher = RouteWatcher(bus, self.cfg.partition)
        self.instance = uuid.uuid4().hex[:8]
        self._ids = itertools.count(1)
        self.in_flight = 0

    # ---------------------------------------------------------------- app wiring
    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_view)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        app[GATEWAY_KEY] = self
        return app

    async def _on_startup(self, _app) -> None:
        await self.watcher.start()
        log.info("gateway_ready", partition=self.cfg.partition, tokenizer=self.tokenizer_note)

    async def _on_cleanup(self, _app) -> None:
        await self.watcher.stop()

    # ---------------------------------------------------------------- small endpoints
    async def models(self, _req: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "evolving-infra"}]})

    async def health(self, _req: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "partition": self.cfg.partition,
                                  "bus": type(self.bus).__name__, "tokenizer": self.tokenizer_note,
                                  "open_branches": len(self.table.open), "in_flight": self.in_flight})

    async def metrics_view(self, _req: web.Request) -> web.Response:
        text = self.metrics.render({"ei_gateway_open_branches": len(self.table.open),
                                    "ei_gateway_in_flight_requests": self.in_flight})
        return web.Response(text=text, content_type="text/plain")

    # ---------------------------------------------------------------- completions
    async def chat_completions(self, req: web.Request) -> web.StreamResponse:
        self.metrics.inc("ei_gateway_requests_total", endpoint="chat")
        try:
            body = await read_json(req)
            if "messages" not in body:
                raise ApiError(400, "'messages' is required", "messages")
            try:
                prompt = render_chat(body["messages"])
            except TemplateError as exc:
                raise ApiError(400, exc.message, exc.field) from None
            return await self._serve(req, body, self.tokenizer.encode(prompt), chat=True)
        except ApiError as exc:
            return self._error(exc)

    async def completions(self, req: web.Request) -> web.StreamResponse:
        self.metrics.inc("ei_gateway_requests_total", endpoint="completions")
        try:
            body = await read_json(req)
            ids, _ = parse_prompt(body, self.tokenizer)
            return await self._serve(req, body, ids, chat=False)
        except ApiError as exc:
            return self._error(exc)

    def _error(self, exc: ApiError) -> web.Response:
        self.metrics.inc("ei_gateway_errors_total", status=str(exc.status))
        return exc.response()

    async def _publish(self, events: list[Event]) -> None:
        try:
            for e in events:
                await self.bus.publish(e)
        except Exception as exc:  # noqa: BLE001 - any bus failure is a 503 to the client
            log.error("publish_failed", error=str(exc))
            raise ApiError(503, f"the event bus is unavailable: {exc}", None, "service_unavailable") from None

    async def _serve(self, req: web.Request, body: dict, ids: list[int], chat: bool) -> web.StreamResponse:
        try:
            sig = parse_branch_headers(req.headers)
        except HeaderError as exc:
            raise ApiError(400, exc.message, exc.field) from None
        stream = _stream_flag(body)
        max_tokens = parse_max_tokens(body, self.cfg.default_max_tokens, self.cfg.max_tokens_limit)
        model = body.get("model") or self.cfg.model
        if not isinstance(model, str):
            raise ApiError(400, "'model' must be a string", "model")
        if max_tokens == 0:
            if sig.branch is None or not sig.end:
                raise ApiError(400, "'max_tokens' must be >= 1 (0 is only allowed on a branch-end "
                               "request: x-branch-end or x-dynamo-session-final true)", "max_tokens")
            return await self._end_only(sig, model, chat)
        if sig.branch is None:
            self.metrics.inc("ei_gateway_headerless_requests_total")
        n = next(self._ids)
        branch = sig.branch or f"gw-{self.instance}-{n}"
        request_id = f"{branch}/{self.instance}-{n}"
        blocks = block_hashes(ids, self.cfg.block_tokens)
        try:
            adm = self.table.admit(sig, branch, request_id, blocks, len(ids), max_tokens,
                                   self.cfg.block_tokens, self.clock())
        except BranchStateError as exc:
            raise ApiError(409, str(exc), "x-branch-id", "conflict") from None
        if adm.compaction:
            self.metrics.inc("ei_gateway_compactions_total", reason=adm.compaction)
        if adm.opened:
            self.metrics.inc("ei_gateway_branches_opened_total")
        fut = self.watcher.expect(request_id)
        tsub = await self.tokens.subscribe(request_id)
        self.in_flight += 1
        try:
            await self._publish([*adm.before, adm.request])
            try:
                route: RouteDecided = await asyncio.wait_for(fut, self.cfg.route_timeout_s)
            except TimeoutError:
                self.metrics.inc("ei_gateway_route_timeouts_total")
                raise ApiError(503, f"no RouteDecided for request {request_id!r} within "
                               f"{self.cfg.route_timeout_s:g} s: is the router of partition "
                               f"{self.cfg.partition!r} running?", None, "service_unavailable") from None
            meta = _Meta(request_id, branch, adm.request.version, route, len(ids), len(blocks), model, chat,
                         max_tokens, int(self.clock()))

            async def end_branch() -> None:
                await self._end_after(adm.end_after, branch)

            if stream:
                return await self._stream(req, tsub, meta, body, end_branch)
            return await self._collect(tsub, meta, end_branch)
        finally:
            self.in_flight -= 1
            self.watcher.forget(request_id)
            await tsub.close()
            await self._end_after(adm.end_after, branch)  # also after a failure; no-op if done

    async def _end_after(self, end_after: bool, branch: str) -> None:
        """Publish ``BranchEnded`` once, *before* the client sees the end of the response, so a
        harness that reacts to the response never races the branch's end on the stream."""
        if not end_after:
            return
        ended = self.table.end(branch, self.clock())
        if ended is not None:
            self.metrics.inc("ei_gateway_branches_ended_total")
            try:
                await self._publish([ended])
            except ApiError:
                pass  # already logged; the response is on its way

    async def _end_only(self, sig: BranchSignals, model: str, chat: bool) -> web.Response:
        ended = self.table.end(sig.branch, self.clock())
        if ended is not None:
            self.metrics.inc("ei_gateway_branches_ended_total")
            await self._publish([ended])
        meta = _Meta("", sig.branch, 0, None, 0, 0, model, chat, 0, int(self.clock()))
        return web.json_response(meta.full_body("", 0, "stop", False), headers=meta.headers())

    # ---------------------------------------------------------------- token relay
    async def _next(self, tsub, meta: _Meta) -> TokenMsg:
        try:
            return await tsub.get(self.cfg.token_timeout_s)
        except TimeoutError:
            raise ApiError(504, f"no tokens for request {meta.request!r} from node "
                           f"{meta.route.decode_node!r} within {self.cfg.token_timeout_s:g} s",
                           None, "timeout") from None

    async def _collect(self, tsub, meta: _Meta, before_done) -> web.Response:
        parts: list[str] = []
        got, simulated = 0, False
        while True:
            m = await self._next(tsub, meta)
            simulated |= m.simulated
            if m.kind == "error":
                raise ApiError(502, f"the engine failed request {meta.request!r}: {m.error}", None, "engine_error")
            parts.append(m.text)
            got += m.tokens
            if m.kind == "done":
                total = max(got, m.total)
                if total > got and simulated:  # a lost chunk (core NATS is at-most-once)
                    parts.append(sim_text(total - got))
                self.metrics.inc("ei_gateway_output_tokens_total", total)
                await before_done()
                return web.json_response(meta.full_body("".join(parts), total, m.finish_reason or "length",
                                                        simulated), headers=meta.headers())

    async def _stream(self, req: web.Request, tsub, meta: _Meta, body: dict, before_done) -> web.StreamResponse:
        m = await self._next(tsub, meta)  # errors before the first byte are plain JSON errors
        if m.kind == "error":
            raise ApiError(502, f"the engine failed request {meta.request!r}: {m.error}", None, "engine_error")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **meta.headers()})
        await resp.prepare(req)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) \
            if isinstance(body.get("stream_options"), dict) else False
        got, first = 0, True
        try:
            while True:
                if m.kind in ("first", "chunk"):
                    got += m.tokens
                    await resp.write(_sse(meta.chunk(m.text, None, first, m.simulated)))
                    first = False
                elif m.kind == "done":
                    got += m.tokens
                    total = max(got, m.total)
                    self.metrics.inc("ei_gateway_output_tokens_total", total)
                    text = m.text + (sim_text(total - got) if total > got and m.simulated else "")
                    await resp.write(_sse(meta.chunk(text, m.finish_reason or "length", first, m.simulated)))
                    if include_usage:
                        await resp.write(_sse(meta.usage_chunk(total)))
                    break
                elif m.kind == "error":
                    await resp.write(_sse({"error": {"message": m.error, "type": "engine_error", "code": 502}}))
                    self.metrics.inc("ei_gateway_errors_total", status="502")
                    break
                try:
                    m = await self._next(tsub, meta)
                except ApiError as exc:
                    self.metrics.inc("ei_gateway_errors_total", status=str(exc.status))
                    await resp.write(_sse({"error": {"message": exc.message, "type": exc.type,
                                                     "code": exc.status}}))
                    break
            await before_done()
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            log.info("client_gone", request=meta.request)
            raise
        await resp.write_eof()
        return resp


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


SIM_NOTE = "simulated engine: the text is 'tok ' per generated token, not model output"


@dataclass
class _Meta:
    request: str
    branch: str
    version: int
    route: RouteDecided | None
    prompt_tokens: int
    blocks: int
    model: str
    chat: bool
    max_tokens: int
    created: int

    def headers(self) -> dict[str, str]:
        h = {"x-branch-id": self.branch}
        if self.request:
            h["x-request-id"] = self.request
        if self.route is not None:
            h["x-prefill-node"] = self.route.prefill_node
            h["x-decode-node"] = self.route.decode_node
        return h

    def _id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + (self.request or self.branch)

    def extension(self, simulated: bool) -> dict:
        ext = {"request": self.request, "branch": self.branch, "version": self.version,
               "prompt_blocks": self.blocks, "simulated": simulated}
        if self.route is not None:
            ext.update(prefill_node=self.route.prefill_node, decode_node=self.route.decode_node,
                       policy=self.route.policy)
        if simulated:
            ext["note"] = SIM_NOTE
        return ext

    def usage(self, completion: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def full_body(self, text: str, completion: int, finish: str, simulated: bool) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {"id": self._id(), "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(completion), "evolving": self.extension(simulated)}

    def chunk(self, text: str, finish: str | None, first: bool, simulated: bool) -> dict:
        if self.chat:
            delta: dict = {"content": text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        out = {"id": self._id(), "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": [choice]}
        if first or finish:
            out["evolving"] = self.extension(simulated)
        return out

    def usage_chunk(self, completion: int) -> dict:
        return {"id": self._id(), "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [], "usage": self.usage(completion)}
