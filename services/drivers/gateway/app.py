"""OpenAI- and Anthropic-compatible HTTP gateway (aiohttp): harness signals in, events out, tokens back.

Request lifecycle (one POST /v1/chat/completions or /v1/completions)
0. From the headers alone, before the body is read (``guard.Guard``: the middleware and the
   ``Expect: 100-continue`` handler): the API key on ``/v1/*`` (401) and the declared body
   size (413); a body without Content-Length is cut at the same limit while it is read.
1. Decode and validate the JSON body into msgspec Structs (``services.drivers.gateway.api``: 400
   naming the field, 400 for parameters it cannot honour, 404 ``model_not_found``) and parse
   the branch headers (``services.drivers.gateway.headers``; 400 on a bad value) and admit it to the
   branch table (``services.cores.branches``; 409 on a branch that
   has ended). Prompt + completion over ``context_length``: 400 ``context_length_exceeded``.
2. Render the prompt (the model's chat template, or the simple one: ``model``, ``chat_template``),
   tokenise it with the model's tokenizer and compute the chained block hashes of those ids
   (``events.hashing.block_hashes``; ``prefix_hashes``: the blocks a branch's previous prompt
   already hashed are reused, so an agent's turn hashes only its new tokens).
3. Register the request with the route watcher (``routewatch``) and subscribe to its token subject
   (``services.adapters.bus.tokens``) *before* publishing, so neither answer can be missed.
4. Put the token ids into the partition's prompt store when there is one (the engine that
   prefills reads them: docs/engines.md, "Prompts"), then publish ``BranchOpened`` (first
   sight), ``ContextCompacted`` (header or inferred) and ``RequestSubmitted`` on the
   partition's stream.
5. Wait for the non-shadow ``RouteDecided`` of the request (``route_timeout_s``, then 503).
6. Relay the engine's token messages (``openai_relay``, ``anthropic_relay``; ``meta``): SSE chunks
   (``stream: true``) or one JSON body. ``token_timeout_s`` of silence ends the request (504, or an error event in a stream).
7. When the response completes, before the client sees its end (and after a failure): ``BranchEnded`` when ``x-branch-end`` /
   ``x-dynamo-session-final`` was true, or when a completions request had no branch headers (it is
   then served as a one-request branch). Every headerless request is counted in
   ``ei_gateway_headerless_requests_total``; a headerless chat request continues the branch its
   messages extend or opens one that stays open (``conversations``: a hash chain over the messages).

Every error, including aiohttp's own 404/405/413 and an unexpected exception (500), is
OpenAI-style JSON ``{"error": {"message", "type", "param", "code"}}`` with a string ``code``
(Anthropic's ``{"type": "error", "error": {...}}`` on ``/v1/messages*``: ``anthropic_api``).

A request with ``max_tokens: 0`` and a branch-end header is a *branch-end request* (Dynamo's
"dedicated minimal request" when a session ends): it only publishes ``BranchEnded``.

This module is the app and steps 1-5 and 7 (``Gateway``); ``config`` holds ``GatewayConfig``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from collections.abc import Callable

import msgspec
from aiohttp import web

from events.catalog import Event, RouteDecided
from events.wire import token_key
from services.adapters.aio import wait_for
from services.adapters.bus import Bus
from services.adapters.bus.prompts import PromptStore
from services.adapters.bus.tokens import TokenChannel
from services.adapters.logging import get_logger
from services.cores.branches import BranchSignals, BranchStateError, BranchTable
from services.cores.partitions import session_index
from services.drivers.gateway import (
    anthropic_api,
    anthropic_relay,
    constraints,
    conversations,
    openai_relay,
    openapi,
    responses_api,
    responses_relay,
    toolcalls,
)
from services.drivers.gateway.api import (
    AgentHints,
    ApiError,
    ChatRequest,
    CompletionRequest,
    agent_hints,
    chat_tools,
    clip,
    context_error,
    parse_chat,
    parse_completion,
    requested_max_tokens,
    sampling_fields,
    unapplied,
    unserved_tool_names,
)
from services.drivers.gateway.auth import ApiKeys
from services.drivers.gateway.cancel import Cancels, Tracked
from services.drivers.gateway.config import GatewayConfig, scaled_clock
from services.drivers.gateway.consumers import ConsumerHealth
from services.drivers.gateway.guard import Guard
from services.drivers.gateway.headers import HeaderError, parse_branch_headers
from services.drivers.gateway.meta import Meta, openai_call
from services.drivers.gateway.metrics import CONTENT_TYPE, GatewayMetrics, RequestObserver
from services.drivers.gateway.model import PromptModel, load_model
from services.drivers.gateway.prefix_hashes import PrefixHashes
from services.drivers.gateway.routewatch import RouteWatcher
from services.drivers.gateway.streamwatch import FailWatcher, rebuild
from services.drivers.gateway.tokenizer import TemplateError

log = get_logger("gateway")

GATEWAY_KEY: web.AppKey[Gateway] = web.AppKey("gateway")
#: the longest model name served when any name is (a response repeats it; none is longer)
MAX_MODEL_NAME_CHARS = 256


class Gateway:
    """The HTTP app's state. ``bus``: NatsBus or InMemoryBus; ``tokens``: a token channel
    (NatsTokenMux, NatsTokens or MemoryTokens); ``clock`` gives event timestamps (seconds)."""

    def __init__(self, bus: Bus, tokens: TokenChannel, config: GatewayConfig | None = None,
                 clock: Callable[[], float] | None = None, lanes: dict[str, tuple[Bus, TokenChannel]] | None = None,
                 prompts: dict[str, PromptStore] | None = None, model: PromptModel | None = None) -> None:
        self.bus, self.tokens = bus, tokens
        self.cfg = config or GatewayConfig()
        # partition -> (bus, tokens) of that partition (docs/partitions.md); one partition by default.
        # A session goes to partition session_index(root branch, N) of the lanes, in order.
        self.lanes: dict[str, tuple[Bus, TokenChannel]] = dict(lanes) if lanes else {self.cfg.partition: (bus, tokens)}
        self.partitions = tuple(self.lanes)
        self.clock = clock or scaled_clock(self.cfg.time_scale, self.cfg.clock_epoch)
        # the model's tokenizer and chat template (model.py; a named model that cannot load raises ModelError)
        self.model = model or load_model(self.cfg.tokenizer)
        self.tokenizer, self.template, self.tokenizer_note = self.model.tokenizer, self.model.template, self.model.note
        # how tool calls are read from the model's text (toolcalls.py): the option, or the template's format
        self.tool_parser = (self.cfg.tool_call_parser if self.cfg.tool_call_parser != "auto"
                            else toolcalls.detect(getattr(self.template, "source", None)))
        if self.tool_parser not in toolcalls.PARSERS[1:]:
            raise ValueError(f"tool_call_parser {self.tool_parser!r}: one of {', '.join(toolcalls.PARSERS)}")
        # partition -> the prompt store its engines read the token ids from (None: ids not stored)
        self.prompts: dict[str, PromptStore] = dict(prompts or {})
        self.table = BranchTable(src=self.cfg.src, ttl_s=self.cfg.branch_ttl_s)
        self.prefix_hashes = PrefixHashes(self.cfg.block_tokens)  # a branch's next prompt rehashes only what is new
        # the responses previous_response_id can name (responses_api.ResponseStore: LRU + TTL)
        self.responses_store = responses_api.ResponseStore(self.cfg.responses_store_entries,
                                                           self.cfg.responses_store_mb * 1024 * 1024,
                                                           self.cfg.responses_ttl_s)
        # headerless chat requests: conversation prefixes -> their branch (conversations.py)
        self.conversations = conversations.ConversationIndex(ttl_s=self.cfg.branch_ttl_s)
        self._expiry_task: asyncio.Task | None = None
        self._hints_logged: set[str] = set()  # unknown agent hint names already logged
        self._ignored_logged: set[tuple[str, str]] = set()  # (api, field) ignored and logged once
        # the model names a request may ask for: any (empty) unless --served-model-name restricts them
        self.model_names: tuple[str, ...] = (
            (self.cfg.model, *[n for n in self.cfg.served_model_names if n != self.cfg.model])
            if self.cfg.served_model_names else ())
        self.keys = ApiKeys(self.cfg.api_keys)
        self.in_flight = 0
        self.metrics = GatewayMetrics(lambda: len(self.table.open), lambda: self.in_flight)
        # a client that leaves, a request timed out: RequestCancelled to its engine (cancel.py)
        self.cancels = Cancels(self._publish, self.clock, self.cfg.src, self.metrics.registry)
        self.guard = Guard(self.keys, self.cfg.max_body_bytes, self.metrics)
        self.watchers = {p: RouteWatcher(b, p) for p, (b, _) in self.lanes.items()}
        self.watcher = self.watchers[self.partitions[0]]
        # requests the stream says failed (RequestFinished with an error) end here too (streamwatch)
        self.failures = {p: FailWatcher(b, p) for p, (b, _) in self.lanes.items()}
        # every reader of each partition's stream as JetStream sees it (consumers.py): /health names
        # the stuck and the lagging ones, /metrics exports their pending counts
        self.consumer_health = {p: ConsumerHealth(b) for p, (b, _) in self.lanes.items()}
        self.metrics.watch_consumers(self._consumer_report, self._watch_states)
        self.rebuilt = 0  # harness events folded into the branch table at start (a restart)
        self.instance = uuid.uuid4().hex[:8]
        self._ids = itertools.count(1)
        self._openapi: bytes | None = None  # GET /openapi.json, built on first use

    # ---------------------------------------------------------------- app wiring
    def make_app(self) -> web.Application:
        # client_max_size bounds a body without Content-Length (chunked) while it is read;
        # a declared Content-Length over the limit is refused before reading (_admit).
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self.guard.middleware])
        app.router.add_post("/v1/chat/completions", self.chat_completions, expect_handler=self.guard.expect)
        app.router.add_post("/v1/completions", self.completions, expect_handler=self.guard.expect)
        app.router.add_post("/v1/messages", self.messages, expect_handler=self.guard.expect)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens, expect_handler=self.guard.expect)
        app.router.add_post(responses_api.PATH, self.responses, expect_handler=self.guard.expect)
        app.router.add_get(responses_api.PATH + "/{response_id}", self.response_view)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model_view)
        app.router.add_get("/health", self.health)
        app.router.add_get("/api/hello", self.hello)
        app.router.add_get("/metrics", self.metrics_view)
        app.router.add_get("/openapi.json", self.openapi_view)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        app[GATEWAY_KEY] = self
        return app

    async def _on_startup(self, _app) -> None:
        for _, tokens in self.lanes.values():
            await tokens.start()  # NatsTokenMux: its one subscription of the partition
        await self._rebuild()
        for w in self.watchers.values():
            await w.start()
        for f in self.failures.values():
            await f.start()
        for ch in self.consumer_health.values():
            ch.start()
        if self.table.ttl_s is not None:
            self._expiry_task = asyncio.create_task(self._expiry_loop(), name="branch-expiry")
        log.info("gateway_ready", partition=",".join(self.partitions), tokenizer=self.tokenizer_note,
                 auth=f"{len(self.keys)} API key(s)" if self.keys.enabled else "off", tool_call_parser=self.tool_parser,
                 context_length=self.cfg.context_length, max_body_bytes=self.cfg.max_body_bytes)

    async def _on_cleanup(self, _app) -> None:
        if self._expiry_task is not None:
            self._expiry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # shutting down
                await self._expiry_task
        for w in self.watchers.values():
            await w.stop()
        for f in self.failures.values():
            await f.stop()
        for ch in self.consumer_health.values():
            await ch.stop()
        for _, tokens in self.lanes.values():
            await tokens.stop()

    def fail_in_flight(self, error: str) -> int:
        """End every request in flight with a 503 / an error event naming ``error`` (a stopping
        gateway, after its grace period); how many."""
        return sum(f.fail_all(error) for f in self.failures.values())

    async def cancel_in_flight(self, reason: str = "gateway_stopping") -> int:
        """Cancel every request in flight on its engine (``RequestCancelled``), before
        :meth:`fail_in_flight` fails them to their clients: nobody will read their output, so
        their engines stop instead of decoding to the end; how many."""
        tracked = [t for f in self.failures.values() for t in f.in_flight() if isinstance(t, Tracked)]
        for t in tracked:
            await self.cancels.cancel_tracked(t, reason)
        return len(tracked)

    async def _rebuild(self) -> None:
        """The branch table from the stream (a restarted gateway: streamwatch.rebuild); the dead
        instance's one-request branches end (``BranchEnded(reason="gateway_restart")``)."""
        for part, (bus, _) in self.lanes.items():
            self.rebuilt += await rebuild(bus, self.table)
        orphans = self.table.orphans("gw-", self.instance)
        now = self.clock()
        for b in orphans:
            st = self.table.open[b]
            part = (self.partitions[0] if len(self.partitions) == 1
                    else self.partitions[session_index(st.session, len(self.partitions))])
            ended = self.table.end(b, now)
            if ended is not None:
                self.metrics.inc("ei_gateway_branches_ended_total")
                with contextlib.suppress(ApiError):  # logged; the branch is gone from the table either way
                    await self._publish([msgspec.structs.replace(ended, reason="gateway_restart")], part)
        if self.rebuilt:
            log.info("branches_rebuilt", events=self.rebuilt, open=len(self.table.open),
                     ended=len(self.table.ended), orphans_ended=len(orphans))

    # ---------------------------------------------------------------- idle expiry
    async def _expire(self, now: float) -> None:
        """Publish ``BranchEnded(reason="idle")`` for the branches idle past the TTL at ``now``
        (the table decides from event times only); each on its session's partition."""
        for x in self.table.expire(now):
            part = (self.partitions[0] if len(self.partitions) == 1
                    else self.partitions[session_index(x.session, len(self.partitions))])
            self.metrics.inc("ei_gateway_branches_expired_total")
            self.metrics.inc("ei_gateway_branches_ended_total")
            try:
                await self._publish([x.event], part)
            except ApiError:
                pass  # already logged; the branch is gone from the table either way

    async def _expiry_loop(self) -> None:
        """The periodic check, so branches expire while no request arrives: every quarter TTL
        (in wall seconds at the clock's scale), at most 30 s apart."""
        ttl = self.table.ttl_s or 0.0
        every = max(0.05, min(30.0, ttl / 4 / max(self.cfg.time_scale, 1e-9)))
        while True:
            await asyncio.sleep(every)
            try:
                await self._expire(self.clock())
            except Exception as exc:  # noqa: BLE001 - the loop must survive; the next tick retries
                log.error("branch_expiry_failed", error=str(exc))

    def _note_hints(self, unknown: list[str]) -> None:
        """Unknown ``nvext.agent_hints`` are ignored: counted, and each name logged once."""
        self.metrics.inc("ei_gateway_unknown_agent_hints_total", len(unknown))
        new = [h for h in unknown if h not in self._hints_logged]
        if new and len(self._hints_logged) < 1000:
            self._hints_logged.update(new)
            log.warning("unknown_agent_hints", hints=",".join(new)[:200],
                        known="priority,osl,speculative_prefill", note="ignored; logged once per name")

    #: distinct field names the ignored-field counter labels; past it they count as ``(other)``
    MAX_IGNORED_LABELS = 256

    def _note_ignored(self, api: str, names: list[str]) -> None:
        """Request fields (and ``anthropic-beta`` values) this gateway does not apply and ignores:
        ``ei_gateway_ignored_fields_total{api, field}``, and one log line per name."""
        for name in names:
            key = (api, name[:64])
            if key not in self._ignored_logged and len(self._ignored_logged) >= self.MAX_IGNORED_LABELS:
                key = (api, "(other)")
            self.metrics.inc("ei_gateway_ignored_fields_total", api=key[0], field=key[1])
            if key not in self._ignored_logged:
                self._ignored_logged.add(key)
                log.warning("ignored_field", api=api, field=key[1], note="not applied; logged once per name")

    def _note_betas(self, req: web.Request) -> None:
        betas = [b.strip() for v in req.headers.getall("anthropic-beta", []) for b in v.split(",") if b.strip()]
        if betas:
            self._note_ignored("anthropic", [f"anthropic-beta: {b}" for b in betas])

    def partition_of(self, branch: str) -> str:
        """The partition of ``branch``'s session: by its root branch id (the session the branch
        table gave it; a branch it does not know is its own root), one partition: that one."""
        if len(self.partitions) == 1:
            return self.partitions[0]
        st = self.table.open.get(branch)
        root = st.session if st is not None else branch
        return self.partitions[session_index(root, len(self.partitions))]


    # ---------------------------------------------------------------- small endpoints
    def _model_card(self, name: str | None = None) -> dict:
        """A model's card in OpenAI's shape and Anthropic's at once (each client reads its fields)."""
        name = name or self.cfg.model
        return {"id": name, "object": "model", "created": 0, "owned_by": "evolving-infra",
                "max_model_len": self.cfg.context_length,
                "type": "model", "display_name": name, "created_at": "1970-01-01T00:00:00Z"}

    def _model(self, name: str | None) -> str:
        """The model name the response carries: the one asked for (any name, unless
        ``--served-model-name`` restricts them: another is a 404), else ``--model``."""
        if not name:
            return self.cfg.model
        if name in self.model_names or (not self.model_names and len(name) <= MAX_MODEL_NAME_CHARS):
            return name
        served = (f"this gateway serves {', '.join(repr(n) for n in self.model_names)}" if self.model_names
                  else f"a model name is at most {MAX_MODEL_NAME_CHARS} characters")
        raise ApiError(404, f"The model '{clip(name)}' does not exist ({served})", "model", code="model_not_found")

    def _model_label(self, name: str) -> str:
        """The ``model`` label of the frontend metrics: a name the operator listed, else
        ``--model`` (a client's free choice of name never makes a new series)."""
        return name if name in self.model_names else self.cfg.model

    async def models(self, _req: web.Request) -> web.Response:
        cards = [self._model_card(n) for n in (self.model_names or (self.cfg.model,))]
        return web.json_response({"object": "list", "data": cards, "has_more": False,
                                  "first_id": cards[0]["id"], "last_id": cards[-1]["id"]})

    async def model_view(self, req: web.Request) -> web.Response:
        return web.json_response(self._model_card(self._model(req.match_info["model"])))

    def bus_state(self) -> dict:
        """Whether the gateway can reach the bus: a NATS connection that is down (the server
        died, a reconnect in progress) is not; the in-process bus always is."""
        c = self.bus.connection()
        return {"kind": type(self.bus).__name__, "connected": c.connected, "reconnecting": c.reconnecting,
                "server": c.server}

    def _watch_states(self) -> list:
        return [w.reader.state for w in [*self.watchers.values(), *self.failures.values()]]

    def _consumer_report(self) -> dict:
        """Every stream reader of every partition (consumers.py), merged: a consumer's name is
        prefixed with its partition when there are several."""
        if len(self.consumer_health) == 1:
            return next(iter(self.consumer_health.values())).report()
        out: dict = {"consumers": {}, "stuck": [], "lagging": []}
        for part, ch in self.consumer_health.items():
            rep = ch.report()
            out["consumers"].update({f"{part}/{k}": v for k, v in rep["consumers"].items()})
            out["stuck"] += [f"{part}/{k}" for k in rep["stuck"]]
            out["lagging"] += [f"{part}/{k}" for k in rep["lagging"]]
        return out

    async def hello(self, _req: web.Request) -> web.Response:
        """``GET`` / ``HEAD /api/hello``: the connectivity probe Claude Code sends to its base URL
        before its first request (and its preflight check wants a 2xx); no key, nothing read."""
        return web.json_response({"message": "hello"})

    async def health(self, _req: web.Request) -> web.Response:
        """200 while the bus is connected, 503 (``status: "bus_unavailable"``) while it is not:
        a load balancer then stops sending requests that could only time out. ``status`` is
        ``degraded`` (still 200: the gateway itself serves) while a reader of the stream is stuck
        or lagging (consumers.py: an engine whose input stopped, a service folding behind) or
        one of the gateway's own readers last failed; ``stuck`` and ``lagging`` name them."""
        bus = self.bus_state()
        rep = self._consumer_report()
        watches = {st.name: st.as_dict() for st in self._watch_states()}
        status = "ok"
        if not bus["connected"]:
            status = "bus_unavailable"
        elif rep["stuck"] or rep["lagging"]:
            status = "degraded"
        return web.json_response({"status": status,
                                  "partition": self.cfg.partition, "partitions": list(self.partitions),
                                  "bus": bus, "tokenizer": self.tokenizer_note,
                                  "tokenizer_name": self.tokenizer.name, "vocab_size": self.tokenizer.vocab_size,
                                  "auth": self.keys.enabled, "context_length": self.cfg.context_length,
                                  "max_body_bytes": self.cfg.max_body_bytes,
                                  "open_branches": len(self.table.open), "in_flight": self.in_flight,
                                  "stuck": rep["stuck"], "lagging": rep["lagging"], "consumers": rep["consumers"],
                                  "watches": watches},
                                 status=200 if bus["connected"] else 503)

    async def metrics_view(self, _req: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})

    async def openapi_view(self, _req: web.Request) -> web.Response:
        """The OpenAPI 3.1 description (services/drivers/gateway/openapi.py), built once."""
        if self._openapi is None:
            names = list(self.model_names) or None  # an enum only when the names are restricted
            self._openapi = json.dumps(openapi.build(names, self.cfg.max_tokens_limit)).encode()
        return web.Response(body=self._openapi, content_type="application/json")

    # ---------------------------------------------------------------- completions
    async def chat_completions(self, req: web.Request) -> web.StreamResponse:
        self.metrics.inc("ei_gateway_requests_total", endpoint="chat")
        ignored: list[str] = []
        creq, obj = parse_chat(await req.read(), ignored)
        model = self._model(creq.model)
        self._note_ignored("openai", ignored)
        structured = constraints.for_chat(creq, chat_tools(creq), self.tool_parser)
        try:
            prompt = self.template.render(obj["messages"], chat_tools(creq))
        except TemplateError as exc:
            raise ApiError(400, exc.message, exc.field, code="invalid_value") from None
        return await self._serve(req, creq, model, self.tokenizer.encode(prompt), chat=True,
                                 conversation=obj["messages"], tools=bool(creq.tools) and creq.tool_choice != "none",
                                 structured=structured)

    async def messages(self, req: web.Request) -> web.StreamResponse:
        """Anthropic's ``POST /v1/messages`` (services/drivers/gateway/anthropic_api.py)."""
        self.metrics.inc("ei_gateway_requests_total", endpoint="messages")
        ignored: list[str] = []
        unserved: list[str] = []  # server tools (web search, code execution, ...): left out, said so
        mreq = anthropic_api.parse_messages(await req.read(), ignored, unserved)
        model = self._model(mreq.model)
        self._note_ignored("anthropic", ignored + unserved_tool_names(unserved))
        self._note_betas(req)
        structured = constraints.for_messages(mreq, anthropic_api.tool_defs(mreq), self.tool_parser)
        ids = self.tokenizer.encode(anthropic_api.render_prompt(mreq, self.template))
        tools = bool(mreq.tools) and (mreq.tool_choice is None or mreq.tool_choice.type != "none")
        return await self._serve(req, anthropic_api.budget_request(mreq), model, ids, chat=True, anthropic=mreq,
                                 conversation=anthropic_api.chat_messages(mreq), tools=tools, structured=structured,
                                 unserved=unserved)

    async def count_tokens(self, req: web.Request) -> web.Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: the rendered prompt's tokens."""
        self.metrics.inc("ei_gateway_requests_total", endpoint="count_tokens")
        ignored: list[str] = []
        unserved: list[str] = []
        creq = anthropic_api.parse_count_tokens(await req.read(), ignored, unserved)
        self._model(creq.model)
        self._note_ignored("anthropic", ignored + unserved_tool_names(unserved))
        self._note_betas(req)
        return web.json_response({"input_tokens": len(self.tokenizer.encode(anthropic_api.render_prompt(creq, self.template)))})

    async def responses(self, req: web.Request) -> web.StreamResponse:
        """OpenAI's ``POST /v1/responses`` (services/drivers/gateway/responses_api.py): the
        conversation (``instructions``, the stored ``previous_response_id``, the input items)
        rendered by the chat template, served by the shared path; the finished response is
        stored unless ``store: false``."""
        self.metrics.inc("ei_gateway_requests_total", endpoint="responses")
        parsed = responses_api.parse_responses(await req.read())
        model = self._model(parsed.req.model)
        structured = constraints.for_responses(parsed.req, parsed.tools, self.tool_parser)
        self._note_ignored("responses", responses_api.ignored_names(parsed.ignored))
        history: list[dict] = []
        if parsed.req.previous_response_id is not None:
            stored = self.responses_store.get(parsed.req.previous_response_id)
            if stored is None:
                raise responses_api.not_found(parsed.req.previous_response_id)
            history = stored.history
        msgs = responses_api.prompt_messages(parsed, history)
        try:
            prompt = self.template.render(msgs, parsed.tools)
        except TemplateError as exc:
            raise ApiError(400, exc.message, "input", code="invalid_value") from None
        store, conversation = self.responses_store, history + parsed.messages

        def keep(body: dict) -> None:
            if parsed.req.store is not False:
                store.put(body["id"], body, conversation + responses_api.output_messages(body["output"]))

        return await self._serve(req, responses_api.budget_request(parsed.req), model, self.tokenizer.encode(prompt),
                                 chat=True, responses=responses_api.Call(parsed, keep),
                                 conversation=msgs, tools=bool(parsed.tools) and parsed.req.tool_choice != "none",
                                 structured=structured, unserved=parsed.unserved)

    async def response_view(self, req: web.Request) -> web.Response:
        """``GET /v1/responses/{response_id}``: a stored response (404 once evicted or expired,
        and for ``store: false``)."""
        rid = req.match_info["response_id"]
        stored = self.responses_store.get(rid)
        if stored is None:
            raise responses_api.not_found(rid, None)
        return web.json_response(stored.body)

    async def completions(self, req: web.Request) -> web.StreamResponse:
        self.metrics.inc("ei_gateway_requests_total", endpoint="completions")
        ignored: list[str] = []
        creq = parse_completion(await req.read(), ignored)
        model = self._model(creq.model)
        self._note_ignored("openai", ignored)
        ids = self.model.completion_ids(creq.prompt) if isinstance(creq.prompt, str) else list(creq.prompt)
        return await self._serve(req, creq, model, ids, chat=False)

    async def _publish(self, events: list[Event], partition: str | None = None) -> None:
        bus = self.bus if partition is None else self.lanes[partition][0]
        try:
            if len(events) == 1:
                await bus.publish(events[0])
            else:  # pipelined, in order: one round trip for BranchOpened + RequestSubmitted
                await bus.publish_many(events)
        except Exception as exc:  # noqa: BLE001 - any bus failure is a 503 to the client
            log.error("publish_failed", error=str(exc))
            raise ApiError(503, f"the event bus is unavailable: {exc}", None, "service_unavailable",
                           code="bus_unavailable") from None

    async def _store_prompt(self, partition: str, request_id: str, ids: list[int]) -> None:
        """The token ids into the partition's prompt store, before the request is published, so
        the engine a RouteDecided names finds them (docs/engines.md, "Prompts")."""
        store = self.prompts.get(partition)
        if store is None:
            return
        try:
            n = await store.put(request_id, ids)
        except Exception as exc:  # noqa: BLE001 - a store that cannot take the prompt: 503, nothing published
            log.error("prompt_store_failed", request=request_id, error=f"{type(exc).__name__}: {exc}")
            raise ApiError(503, f"the prompt store is unavailable: {exc}", None, "service_unavailable",
                           code="bus_unavailable") from None
        self.metrics.inc("ei_gateway_prompt_bytes_total", n)

    def _max_tokens(self, r: ChatRequest | CompletionRequest, prompt: int, chat: bool) -> int:
        """The completion budget: the requested one (checked against the limit and the context),
        or the default capped to what the context leaves."""
        param = "messages" if chat else "prompt"
        ctx = self.cfg.context_length
        asked = requested_max_tokens(r)
        if asked is None:
            if prompt >= ctx:
                raise context_error(ctx, prompt, 1, param)
            n = min(ctx - prompt, self.cfg.default_budget_cap, self.cfg.max_tokens_limit)
            if self.cfg.default_max_tokens > 0:
                n = min(n, self.cfg.default_max_tokens)
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
                     chat: bool, anthropic: anthropic_api.MessagesRequest | None = None,
                     conversation: list[dict] | None = None,
                     responses: responses_api.Call | None = None, tools: bool = False,
                     structured: constraints.Structured | None = None,
                     unserved: list[str] | None = None) -> web.StreamResponse:
        """:meth:`_serve_request` observed by the frontend metrics (``ei_frontend_*``, metrics.py).
        ``conversation``: a chat request's messages (OpenAI-style), for a headerless request's
        branch (conversations.py); ``tools``: read tool calls out of the answer (the request has
        tools and ``tool_choice`` is not none); ``structured``: what the output must be (a forced
        call, read with its parser; a JSON answer, read as text: constraints.py); ``unserved``: the
        types of the request's tools left out of the prompt (said in a header and the extension)."""
        endpoint = "anthropic_messages" if anthropic is not None else "chat_completions" if chat else "completions"
        if responses is not None:
            endpoint = "responses"
        obs = self.metrics.request(self._model_label(model), endpoint, bool(r.stream))
        ok = False
        try:
            work = self._serve_request(req, r, model, ids, chat, anthropic, obs, conversation, responses=responses,
                                       tools=tools, structured=structured, unserved=unserved)
            resp = await self.cancels.guard(req, work)  # a client that leaves cancels the request
            ok = True
            return resp
        finally:
            obs.finish(ok)

    async def _serve_request(self, req: web.Request, r: ChatRequest | CompletionRequest, model: str,
                             ids: list[int], chat: bool, anthropic: anthropic_api.MessagesRequest | None,
                             obs: RequestObserver, conversation: list[dict] | None = None,
                             responses: responses_api.Call | None = None, tools: bool = False,
                             structured: constraints.Structured | None = None,
                             unserved: list[str] | None = None) -> web.StreamResponse:
        """Admit, publish, await the route, relay the tokens; ``anthropic``: answer as
        ``/v1/messages`` (``r`` then carries only its budget and ``stream``); ``responses``: as
        ``/v1/responses`` (its ``prompt_cache_key`` names the branch when no header does)."""
        try:
            sig = parse_branch_headers(req.headers)
        except HeaderError as exc:
            raise ApiError(400, exc.message, exc.field, code="invalid_header") from None
        if sig.branch is None and responses is not None and responses.session:  # prompt_cache_key: a session id
            sig = BranchSignals(branch=responses.session, end=sig.end, compacted=sig.compacted,
                                source="prompt_cache_key")
        try:
            max_tokens = self._max_tokens(r, len(ids), chat)
        except ApiError as exc:
            if anthropic is not None and exc.code == "context_length_exceeded":  # Anthropic's wording
                raise anthropic_api.context_error(self.cfg.context_length, len(ids), requested_max_tokens(r)) from None
            if responses is not None:  # this API's field names
                raise responses_api.renamed(exc) from None
            raise
        if max_tokens == 0:
            if sig.branch is None or not sig.end:
                raise ApiError(400, "'max_tokens' must be >= 1 (0 is only allowed on a branch-end "
                               "request: x-branch-end or x-dynamo-session-final true)", "max_tokens",
                               code="invalid_value")
            return await self._end_only(sig, model, chat, anthropic is not None)
        hints, unknown_hints = agent_hints(r)
        if unknown_hints:
            self._note_hints(unknown_hints)
        now = self.clock()
        await self._expire(now)  # idle branches end before this request is admitted
        n = next(self._ids)
        chain: list[conversations.ChainHash] = []
        if sig.branch is None:
            self.metrics.inc("ei_gateway_headerless_requests_total")
            if conversation:  # a chat request: it continues the branch its messages extend, or opens one
                chain = conversations.chain(conversation)
                hit = self.conversations.find(chain, now, self.table.open.__contains__)
                branch = hit[0] if hit is not None else f"gw-{self.instance}-{n}"
                if hit is not None:
                    self.metrics.inc("ei_gateway_conversations_continued_total")
                sig = BranchSignals(branch=branch, end=sig.end, compacted=sig.compacted, source="conversation")
        branch = sig.branch or f"gw-{self.instance}-{n}"
        request_id = f"{branch}/{self.instance}-{n}"
        blocks = self.prefix_hashes.hashes(branch, ids)
        sampling, parser = sampling_fields(r), self.tool_parser
        if structured is not None:  # the engine enforces it; a call is read with the format it was written in
            sampling["constraint"] = structured.constraint
            tools, parser = structured.parser is not None, structured.parser or parser
        # whether a chat request has tools (a tool-less call unrelated to the agent's conversation is a
        # side request: branches.is_side); None for a completions request
        has_tools = (bool(anthropic.tools) if anthropic is not None else bool(responses.parsed.tools)
                     if responses is not None else bool(r.tools) if isinstance(r, ChatRequest) else None)
        try:
            adm = self.table.admit(sig, branch, request_id, blocks, len(ids), max_tokens,
                                   self.cfg.block_tokens, now, **_hint_fields(hints), sampling=sampling,
                                   tools=has_tools)
        except BranchStateError as exc:
            raise ApiError(409, str(exc), "x-branch-id", "conflict", code="branch_ended") from None
        if adm.compaction:
            self.metrics.inc("ei_gateway_compactions_total", reason=adm.compaction)
        if adm.opened:
            self.metrics.inc("ei_gateway_branches_opened_total")
        if adm.side:  # on its own child branch of the session, ended after the response
            self.metrics.inc("ei_gateway_side_requests_total")
            self.metrics.inc("ei_gateway_branches_opened_total")
            branch = adm.branch or branch
        if chain:
            self.conversations.remember(chain[-1], branch, now)
        part = self.partition_of(branch)
        watcher, tokens = self.watchers[part], self.lanes[part][1]
        fut = watcher.expect(request_id)
        tsub = self.cancels.track(req, await tokens.subscribe(request_id), request_id, branch, part)
        fails = self.failures[part]
        fails.watch(request_id, tsub, fut)
        self.in_flight += 1
        meta: Meta | None = None
        try:
            await self._store_prompt(part, request_id, ids)
            await self._publish([*adm.before, adm.request], part)
            try:
                route: RouteDecided = await wait_for(fut, self.cfg.route_timeout_s)
            except TimeoutError:
                self.metrics.inc("ei_gateway_route_timeouts_total")
                raise ApiError(503, f"no RouteDecided for request {request_id!r} within "
                               f"{self.cfg.route_timeout_s:g} s: is the router of partition "
                               f"{part!r} running?", None, "service_unavailable",
                               code="route_timeout") from None
            meta = Meta(request_id, branch, adm.request.version, route, len(ids), len(blocks), model, chat,
                         max_tokens, int(self.clock()),
                         responses.unapplied if responses is not None
                         else unapplied(r) if anthropic is None else anthropic_api.unapplied(anthropic),
                         cached_tokens=max(0, min(route.t_c, len(ids))), obs=obs, node_quiet_s=fails.quiet_s,
                         tools=toolcalls.make(parser, token_key(request_id)) if tools else None,
                         unserved_tools=list(unserved or ()))

            async def end_branch() -> None:
                await self._end_after(adm.end_after, branch)

            wait, metrics = self.cfg.token_timeout_s, self.metrics
            if responses is not None:  # the Responses API's object and event sequence (responses_relay)
                rreq, ns = responses.parsed.req, responses.parsed.namespaced
                if r.stream:
                    return await responses_relay.stream(req, tsub, meta, rreq, responses.keep, end_branch,
                                                        timeout_s=wait, metrics=metrics, namespaced=ns)
                return await responses_relay.collect(tsub, meta, rreq, responses.keep, end_branch,
                                                     timeout_s=wait, metrics=metrics, namespaced=ns)
            if anthropic is not None:  # Anthropic's body and event sequence (anthropic_relay)
                if r.stream:
                    return await anthropic_relay.stream(req, tsub, meta, end_branch,
                                                        timeout_s=wait, metrics=metrics)
                return await anthropic_relay.collect(tsub, meta, end_branch, timeout_s=wait, metrics=metrics)
            if r.stream:
                opts = r.stream_options
                include_usage = opts is not None and opts.include_usage
                return await openai_relay.stream(req, tsub, meta, include_usage, end_branch,
                                                 timeout_s=wait, metrics=metrics,
                                                 continuous_usage=include_usage and opts.continuous_usage_stats)
            return await openai_relay.collect(tsub, meta, end_branch, timeout_s=wait, metrics=metrics)
        finally:
            if chain and meta is not None and meta.reply:  # the reply the client will send back
                reply = _reply_message(meta, anthropic is not None)
                self.conversations.remember(conversations.link(chain[-1], reply), branch, now)
            self.in_flight -= 1
            watcher.forget(request_id)
            fails.forget(request_id)
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

    async def _end_only(self, sig: BranchSignals, model: str, chat: bool, anthropic: bool = False) -> web.Response:
        part = self.partition_of(sig.branch)
        ended = self.table.end(sig.branch, self.clock())
        if ended is not None:
            self.metrics.inc("ei_gateway_branches_ended_total")
            await self._publish([ended], part)
        meta = Meta("", sig.branch, 0, None, 0, 0, model, chat, 0, int(self.clock()), [])
        if anthropic:
            return web.json_response(anthropic_relay.make_reply(meta, False).message("", 0, "stop"), headers=meta.headers())
        return web.json_response(meta.full_body("", 0, "stop", False), headers=meta.headers())


def _reply_message(meta: Meta, anthropic: bool) -> dict:
    """The answer as the client will send it back (an OpenAI-style message, as both APIs' are
    hashed: conversations.py): the engine's text, or with tool calls the text without them and
    the calls as that API named them (Anthropic's tool_use id and input, as chat_messages maps them)."""
    if not meta.calls:
        return {"role": "assistant", "content": "".join(meta.reply)}
    calls = [p for p in meta.said if isinstance(p, toolcalls.ToolCall)]
    if anthropic:
        listed = [{"id": anthropic_api.tool_use(c)["id"], "type": "function",
                   "function": {"name": c.name, "arguments": anthropic_api.compact_json(c.input())}} for c in calls]
    else:
        listed = [openai_call(c) for c in calls]
    return {"role": "assistant", "content": "".join(p for p in meta.said if isinstance(p, str)), "tool_calls": listed}


def _hint_fields(hints: AgentHints | None) -> dict:
    """``RequestSubmitted``'s ``priority`` / ``osl`` from the agent hints (absent when not sent)."""
    if hints is None:
        return {}
    return {k: v for k, v in (("priority", hints.priority), ("osl", hints.osl)) if v is not None}

