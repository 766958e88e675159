"""OpenAI-compatible HTTP gateway (aiohttp): harness signals in, events out, tokens back.

Request lifecycle (one POST /v1/chat/completions or /v1/completions)
0. From the headers alone, before the body is read (middleware ``_guard``, and the
   ``Expect: 100-continue`` handler): the API key on ``/v1/*`` (401) and the declared body
   size (413); a body without Content-Length is cut at the same limit while it is read.
1. Decode and validate the JSON body into msgspec Structs (``services.drivers.gateway.api``: 400
   naming the field, 400 for parameters it cannot honour, 404 ``model_not_found``) and parse
   the branch headers (``services.drivers.gateway.headers``; 400 on a bad value, 409 on a branch that
   has ended). Prompt + completion over ``context_length``: 400 ``context_length_exceeded``.
2. Render the prompt (chat template, ``services.drivers.gateway.tokenizer``), tokenise it and compute
   the chained block hashes (``events.hashing.block_hashes``).
3. Register the request with the route watcher and subscribe to its token subject
   (``services.adapters.bus.tokens``) *before* publishing, so neither answer can be missed.
4. Publish ``BranchOpened`` (first sight), ``ContextCompacted`` (header or inferred) and
   ``RequestSubmitted`` on the partition's stream.
5. Wait for the non-shadow ``RouteDecided`` of the request (``route_timeout_s``, then 503).
6. Relay the engine's token messages: SSE chunks (``stream: true``) or one JSON body.
   ``token_timeout_s`` of silence ends the request (504, or an error event in a stream).
7. When the response completes, before the client sees its end (and after a failure): ``BranchEnded`` when ``x-branch-end`` /
   ``x-dynamo-session-final`` was true, or when the request had no branch headers (it is then
   served as a one-request branch and counted in ``ei_gateway_headerless_requests_total``).

Every error, including aiohttp's own 404/405/413 and an unexpected exception (500), is
OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}`` with a string ``code``.

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
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from events.catalog import Event, RouteDecided
from events.hashing import block_hashes
from events.subjects import token
from events.wire import TokenMsg, sim_text
from services.adapters.bus import Bus
from services.adapters.logging import get_logger
from services.cores.partitions import session_index
from services.drivers.gateway.api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    context_error,
    parse_chat,
    parse_completion,
    requested_max_tokens,
    unapplied,
)
from services.drivers.gateway.auth import ApiKeys
from services.drivers.gateway.headers import (
    BranchSignals,
    BranchStateError,
    BranchTable,
    HeaderError,
    parse_branch_headers,
)
from services.drivers.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from services.drivers.gateway.tokenizer import TemplateError, load_tokenizer, render_chat

log = get_logger("gateway")

MiB = 1024 * 1024


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
    # Hardening (docs/gateway.md, "Limits and authentication"):
    context_length: int = 262_144  # prompt + completion tokens a request may ask for
    max_body_bytes: int = 8 * MiB  # larger bodies: 413 before a byte of them is read
    api_keys: frozenset[str] = field(default_factory=frozenset)  # empty: no authentication


def scaled_clock(time_scale: float, epoch: float | None) -> Callable[[], float]:
    """``epoch + (time.time() - epoch) * time_scale`` (plain ``time.time`` at scale 1)."""
    if time_scale == 1.0:
        return time.time
    e = time.time() if epoch is None else epoch
    return lambda: e + (time.time() - e) * time_scale


def error_response(exc: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    h = dict(headers or {})
    if exc.status == 401:
        h["WWW-Authenticate"] = "Bearer"
    return web.json_response(exc.body(), status=exc.status, headers=h)


def _http_error(exc: web.HTTPException, req: web.Request, max_body: int) -> ApiError:
    """aiohttp's own errors (no route, wrong method, body over client_max_size) as OpenAI JSON."""
    if exc.status == 404:
        return ApiError(404, f"no such endpoint: {req.method} {req.path}", None, code="not_found")
    if exc.status == 405:
        allowed = exc.headers.get("Allow", "")
        return ApiError(405, f"method {req.method} is not allowed on {req.path} (allowed: {allowed})", None,
                        code="method_not_allowed")
    if exc.status == 413:
        return ApiError(413, f"the request body is larger than the limit of {max_body} bytes (--max-body-mb)",
                        "body", code="request_too_large")
    return ApiError(exc.status, exc.text or exc.reason, None, code=exc.reason.lower().replace(" ", "_"))


class RouteWatcher:
    """One ephemeral consumer of ``ei.<p>.route`` from the head at start; resolves the future
    of each awaited request with its first non-shadow ``RouteDecided``."""

    def __init__(self, bus: Bus, partition: str) -> None:
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


# --------------------------------------------------------------------------- the gateway
GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
_STREAMING: web.RequestKey[bool] = web.RequestKey("ei_streaming")  # the SSE response is prepared


class Gateway:
    """The HTTP app's state. ``bus``: NatsBus or InMemoryBus; ``tokens``: NatsTokens or
    MemoryTokens; ``clock`` gives event timestamps (seconds)."""

    def __init__(self, bus: Bus, tokens, config: GatewayConfig | None = None,
                 clock: Callable[[], float] | None = None, lanes: dict[str, tuple[Bus, object]] | None = None) -> None:
        self.bus, self.tokens = bus, tokens
        self.cfg = config or GatewayConfig()
        # partition -> (bus, tokens) of that partition (docs/partitions.md); one partition by default.
        # A session goes to partition session_index(root branch, N) of the lanes, in order.
        self.lanes: dict[str, tuple[Bus, object]] = dict(lanes) if lanes else {self.cfg.partition: (bus, tokens)}
        self.partitions = tuple(self.lanes)
        self.clock = clock or scaled_clock(self.cfg.time_scale, self.cfg.clock_epoch)
        self.tokenizer, self.tokenizer_note = load_tokenizer(self.cfg.tokenizer)
        self.table = BranchTable(src=self.cfg.src)
        self.keys = ApiKeys(self.cfg.api_keys)
        self.in_flight = 0
        self.metrics = GatewayMetrics(lambda: len(self.table.open), lambda: self.in_flight)
        self.watchers = {p: RouteWatcher(b, p) for p, (b, _) in self.lanes.items()}
        self.watcher = self.watchers[self.partitions[0]]
        self.instance = uuid.uuid4().hex[:8]
        self._ids = itertools.count(1)

    # ---------------------------------------------------------------- app wiring
    def make_app(self) -> web.Application:
        # client_max_size bounds a body without Content-Length (chunked) while it is read;
        # a declared Content-Length over the limit is refused before reading (_admit).
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._guard])
        app.router.add_post("/v1/chat/completions", self.chat_completions, expect_handler=self._expect)
        app.router.add_post("/v1/completions", self.completions, expect_handler=self._expect)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model_view)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_view)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        app[GATEWAY_KEY] = self
        return app

    async def _on_startup(self, _app) -> None:
        for w in self.watchers.values():
            await w.start()
        log.info("gateway_ready", partition=",".join(self.partitions), tokenizer=self.tokenizer_note,
                 auth=f"{len(self.keys)} API key(s)" if self.keys.enabled else "off",
                 context_length=self.cfg.context_length, max_body_bytes=self.cfg.max_body_bytes)

    async def _on_cleanup(self, _app) -> None:
        for w in self.watchers.values():
            await w.stop()

    def partition_of(self, branch: str) -> str:
        """The partition of ``branch``'s session: by its root branch id (the session the branch
        table gave it; a branch it does not know is its own root), one partition: that one."""
        if len(self.partitions) == 1:
            return self.partitions[0]
        st = self.table.open.get(branch)
        root = st.session if st is not None else branch
        return self.partitions[session_index(root, len(self.partitions))]

    def _admit(self, req: web.Request) -> None:
        """Checks made from the headers alone, before a byte of the body is read: the API key
        (on ``/v1/*``), then the declared body size."""
        if req.path.startswith("/v1/"):
            self.keys.check(req.headers.get("Authorization"))
        if req.content_length is not None and req.content_length > self.cfg.max_body_bytes:
            raise ApiError(413, f"the request body ({req.content_length} bytes) is larger than the limit of "
                                f"{self.cfg.max_body_bytes} bytes (--max-body-mb)", "body",
                           code="request_too_large")

    async def _expect(self, req: web.Request) -> web.Response | None:
        """``Expect: 100-continue``: refuse (401/413) before the client sends the body."""
        try:
            self._admit(req)
        except ApiError as exc:
            return self._error(exc, {"Connection": "close"})
        if req.headers.get("Expect", "").lower() != "100-continue":
            return self._error(ApiError(417, f"unknown Expect: {req.headers.get('Expect')}", None,
                                        code="expectation_failed"))
        if req.version >= (1, 1):
            await req.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        return None

    @web.middleware
    async def _guard(self, req: web.Request, handler) -> web.StreamResponse:
        """Authentication and the body limit first; every error leaves as OpenAI JSON."""
        try:
            self._admit(req)
            return await handler(req)
        except ApiError as exc:
            if req.get(_STREAMING):
                raise
            return self._error(exc)
        except web.HTTPException as exc:
            if exc.status < 400 or req.get(_STREAMING):
                raise
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return self._error(_http_error(exc, req, self.cfg.max_body_bytes), allow)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            if req.get(_STREAMING):
                raise
            log.exception("internal_error", path=req.path, error=str(exc))
            return self._error(ApiError(500, f"internal error: {type(exc).__name__}", None,
                                        code="internal_error"))

    def _error(self, exc: ApiError, headers: dict[str, str] | None = None) -> web.Response:
        self.metrics.inc("ei_gateway_errors_total", status=str(exc.status), code=exc.code)
        return error_response(exc, headers)

    # ---------------------------------------------------------------- small endpoints
    def _model_card(self) -> dict:
        return {"id": self.cfg.model, "object": "model", "created": 0, "owned_by": "evolving-infra",
                "max_model_len": self.cfg.context_length}

    def _model(self, name: str | None) -> str:
        if not name or name == self.cfg.model:
            return self.cfg.model
        raise ApiError(404, f"The model '{name}' does not exist (this gateway serves '{self.cfg.model}')",
                       "model", code="model_not_found")

    async def models(self, _req: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model_view(self, req: web.Request) -> web.Response:
        self._model(req.match_info["model"])
        return web.json_response(self._model_card())

    def bus_state(self) -> dict:
        """Whether the gateway can reach the bus: a NATS connection that is down (the server
        died, a reconnect in progress) is not; the in-process bus always is."""
        nc = getattr(self.bus, "nc", None)
        if nc is None:
            return {"kind": type(self.bus).__name__, "connected": True}
        url = getattr(nc, "connected_url", None)
        return {"kind": type(self.bus).__name__, "connected": bool(nc.is_connected),
                "reconnecting": bool(getattr(nc, "is_reconnecting", False)),
                "server": f"{url.hostname}:{url.port}" if url is not None and nc.is_connected else None}

    async def health(self, _req: web.Request) -> web.Response:
        """200 while the bus is connected, 503 (``status: "bus_unavailable"``) while it is not:
        a load balancer then stops sending requests that could only time out."""
        bus = self.bus_state()
        return web.json_response({"status": "ok" if bus["connected"] else "bus_unavailable",
                                  "partition": self.cfg.partition, "partitions": list(self.partitions),
                                  "bus": bus, "tokenizer": self.tokenizer_note,
                                  "auth": self.keys.enabled, "context_length": self.cfg.context_length,
                                  "max_body_bytes": self.cfg.max_body_bytes,
                                  "open_branches": len(self.table.open), "in_flight": self.in_flight},
                                 status=200 if bus["connected"] else 503)

    async def metrics_view(self, _req: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    # ---------------------------------------------------------------- completions
    async def chat_completions(self, req: web.Request) -> web.StreamResponse:
        self.metrics.inc("ei_gateway_requests_total", endpoint="chat")
        creq, obj = parse_chat(await req.read())
        model = self._model(creq.model)
        try:
            prompt = render_chat(obj["messages"])
        except TemplateError as exc:
            raise ApiError(400, exc.message, exc.field, code="invalid_value") from None
        return await self._serve(req, creq, model, self.tokenizer.encode(prompt), chat=True)

    async def completions(self, req: web.Request) -> web.StreamResponse:
        self.metrics.inc("ei_gateway_requests_total", endpoint="completions")
        creq = parse_completion(await req.read())
        model = self._model(creq.model)
        ids = self.tokenizer.encode(creq.prompt) if isinstance(creq.prompt, str) else list(creq.prompt)
        return await self._serve(req, creq, model, ids, chat=False)

    async def _publish(self, events: list[Event], partition: str | None = None) -> None:
        bus = self.bus if partition is None else self.lanes[partition][0]
        try:
            for e in events:
                await bus.publish(e)
        except Exception as exc:  # noqa: BLE001 - any bus failure is a 503 to the client
            log.error("publish_failed", error=str(exc))
            raise ApiError(503, f"the event bus is unavailable: {exc}", None, "service_unavailable",
                           code="bus_unavailable") from None

    def _max_tokens(self, r: ChatRequest | CompletionRequest, prompt: int, chat: bool) -> int:
        """The completion budget: the requested one (checked against the limit and the context),
        or the default capped to what the context leaves."""
        param = "messages" if chat else "prompt"
        ctx = self.cfg.context_length
        asked = requested_max_tokens(r)
        if asked is None:
            if prompt >= ctx:
                raise context_error(ctx, prompt, 1, param)
            n = min(self.cfg.default_max_tokens, ctx - prompt)
        else:
            name = "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"
            if asked > self.cfg.max_tokens_limit:
                raise ApiError(400, f"'{name}' must be an integer in [0, {self.cfg.max_tokens_limit}], "
                                    f"got {asked}", name, code="invalid_value")
            if asked > 0 and prompt + asked > ctx:
                raise context_error(ctx, prompt, asked, param)
            n = asked
        if r.min_tokens is not None and n > 0 and r.min_tokens > n:
            raise ApiError(400, f"'min_tokens' ({r.min_tokens}) is larger than the completion budget ({n})",
                           "min_tokens", code="invalid_value")
        return n

    async def _serve(self, req: web.Request, r: ChatRequest | CompletionRequest, model: str, ids: list[int],
                     chat: bool) -> web.StreamResponse:
        try:
            sig = parse_branch_headers(req.headers)
        except HeaderError as exc:
            raise ApiError(400, exc.message, exc.field, code="invalid_header") from None
        max_tokens = self._max_tokens(r, len(ids), chat)
        if max_tokens == 0:
            if sig.branch is None or not sig.end:
                raise ApiError(400, "'max_tokens' must be >= 1 (0 is only allowed on a branch-end "
                               "request: x-branch-end or x-dynamo-session-final true)", "max_tokens",
                               code="invalid_value")
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
            raise ApiError(409, str(exc), "x-branch-id", "conflict", code="branch_ended") from None
        if adm.compaction:
            self.metrics.inc("ei_gateway_compactions_total", reason=adm.compaction)
        if adm.opened:
            self.metrics.inc("ei_gateway_branches_opened_total")
        part = self.partition_of(branch)
        watcher, tokens = self.watchers[part], self.lanes[part][1]
        fut = watcher.expect(request_id)
        tsub = await tokens.subscribe(request_id)
        self.in_flight += 1
        try:
            await self._publish([*adm.before, adm.request], part)
            try:
                route: RouteDecided = await asyncio.wait_for(fut, self.cfg.route_timeout_s)
            except TimeoutError:
                self.metrics.inc("ei_gateway_route_timeouts_total")
                raise ApiError(503, f"no RouteDecided for request {request_id!r} within "
                               f"{self.cfg.route_timeout_s:g} s: is the router of partition "
                               f"{part!r} running?", None, "service_unavailable",
                               code="route_timeout") from None
            meta = _Meta(request_id, branch, adm.request.version, route, len(ids), len(blocks), model, chat,
                         max_tokens, int(self.clock()), unapplied(r))

            async def end_branch() -> None:
                await self._end_after(adm.end_after, branch)

            if r.stream:
                include_usage = r.stream_options is not None and r.stream_options.include_usage
                return await self._stream(req, tsub, meta, include_usage, end_branch)
            return await self._collect(tsub, meta, end_branch)
        finally:
            self.in_flight -= 1
            watcher.forget(request_id)
            await tsub.close()
            await self._end_after(adm.end_after, branch)  # also after a failure; no-op if done

    async def _end_after(self, end_after: bool, branch: str) -> None:
        """Publish ``BranchEnded`` once, *before* the client sees the end of the response, so a
        harness that reacts to the response never races the branch's end on the stream."""
        if not end_after:
            return
        part = self.partition_of(branch)
        ended = self.table.end(branch, self.clock())
        if ended is not None:
            self.metrics.inc("ei_gateway_branches_ended_total")
            try:
                await self._publish([ended], part)
            except ApiError:
                pass  # already logged; the response is on its way

    async def _end_only(self, sig: BranchSignals, model: str, chat: bool) -> web.Response:
        part = self.partition_of(sig.branch)
        ended = self.table.end(sig.branch, self.clock())
        if ended is not None:
            self.metrics.inc("ei_gateway_branches_ended_total")
            await self._publish([ended], part)
        meta = _Meta("", sig.branch, 0, None, 0, 0, model, chat, 0, int(self.clock()), [])
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

    async def _stream(self, req: web.Request, tsub, meta: _Meta, include_usage: bool,
                      before_done) -> web.StreamResponse:
        m = await self._next(tsub, meta)  # errors before the first byte are plain JSON errors
        if m.kind == "error":
            raise ApiError(502, f"the engine failed request {meta.request!r}: {m.error}", None, "engine_error")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                           **meta.headers()})
        req[_STREAMING] = True  # from here on, errors are events inside the stream
        await resp.prepare(req)
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
                    err = ApiError(502, f"the engine failed request {meta.request!r}: {m.error}", None,
                                   "engine_error", code="engine_error")
                    await resp.write(_sse(err.body()))
                    self.metrics.inc("ei_gateway_errors_total", status="502", code=err.code)
                    break
                try:
                    m = await self._next(tsub, meta)
                except ApiError as exc:
                    self.metrics.inc("ei_gateway_errors_total", status=str(exc.status), code=exc.code)
                    await resp.write(_sse(exc.body()))
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
    unapplied: list[str]

    def headers(self) -> dict[str, str]:
        h = {"x-branch-id": self.branch}
        if self.request:
            h["x-request-id"] = self.request
        if self.route is not None:
            h["x-prefill-node"] = self.route.prefill_node
            h["x-decode-node"] = self.route.decode_node
        if self.unapplied:
            h["x-evolving-unapplied"] = ",".join(self.unapplied)
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
        if self.unapplied:  # accepted sampling parameters the engine did not apply (services/drivers/gateway/api.py)
            ext["unapplied"] = list(self.unapplied)
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
