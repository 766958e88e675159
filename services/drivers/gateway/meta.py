"""What one request's responses carry, and the wait for its next token message (step 6 of app.py).

``Meta``: the request, its branch and route, the prompt and cached token counts, the
response headers, the ``evolving`` extension, usage, and the OpenAI bodies and chunks;
``next_token``: the next token message of the request, ``token_timeout_s`` of silence a 504.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from events.catalog import RouteDecided
from events.wire import TokenMsg
from services.drivers.gateway.api import ApiError
from services.drivers.gateway.metrics import RequestObserver
from services.drivers.gateway.toolcalls import Piece, ToolCall, ToolCallParser

SIM_NOTE = "simulated engine: the text cycles fixed words, one per generated token, not model output"

#: ``TokenMsg.finish_reason`` of an error the gateway made from the stream's ``RequestFinished``
#: (streamwatch.FailWatcher): answered 503 ``request_failed`` instead of the engine's own 502
STREAM_FAILURE = "stream_failure"


def failure_error(request: str, node: str, error: str) -> ApiError:
    """The control plane failed the request (e.g. its decode node was removed), or the gateway
    is stopping (``node`` empty): 503."""
    where = f" on node {node!r}" if node else ""
    return ApiError(503, f"request {request!r} failed{where}: {error}", None, "service_unavailable",
                    code="request_failed")


def engine_failure(meta: Meta, m: TokenMsg) -> ApiError:
    """The error of an ``error`` token message: the stream's failure (503) or the engine's (502)."""
    if m.finish_reason == STREAM_FAILURE:
        return failure_error(meta.request, m.node, m.error)
    return ApiError(502, f"the engine failed request {meta.request!r}: {m.error}", None, "engine_error",
                    code="engine_error")


@dataclass
class Meta:
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
    # prompt tokens whose KV was reused: the engine's count from its "first" token message when
    # it sends one, else the router's plan (RouteDecided.t_c); usage.prompt_tokens_details
    cached_tokens: int = 0
    obs: RequestObserver | None = None  # the frontend metrics of this request
    reply: list[str] = field(default_factory=list)  # the engine's text so far (conversations.py)
    #: seconds since the named node last showed progress on the stream (streamwatch.FailWatcher),
    #: None when it has not (or was removed): a request whose node is alive and working is waited
    #: for past ``token_timeout_s`` (a 246 K-token cold prefill queued behind others takes longer)
    node_quiet_s: Callable[[str], float | None] | None = None
    #: reads tool calls out of the engine's text (toolcalls.py); None: the text is all text (the
    #: request has no tools, tool_choice "none", or no parser for this model)
    tools: ToolCallParser | None = None
    calls: int = 0  # tool calls answered so far (their index in a stream)
    said: list[Piece] = field(default_factory=list)  # the parsed answer so far: text and calls, in order
    #: the types of the request's tools that cannot be served here and were left out of the prompt
    #: (hosted tools: web search, code execution, ...; api.UNSERVED_TOOL)
    unserved_tools: list[str] = field(default_factory=list)

    def split(self, text: str, end: bool = False) -> tuple[str, list[ToolCall]]:
        """The text and the completed tool calls in the engine's next ``text`` (``end``: its
        last, so everything held back comes out)."""
        pieces = self.pieces(text, end)
        return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]

    def pieces(self, text: str, end: bool = False) -> list[Piece]:
        """As :meth:`split`, in order (the Anthropic and Responses relays make one block or item of each)."""
        if self.tools is None:
            return [text]
        out: list[Piece] = self.tools.feed(text) + (self.tools.finish() if end else [])
        self.said += out
        self.calls += sum(isinstance(p, ToolCall) for p in out)
        return out

    def finish_reason(self, finish: str) -> str:
        """The engine's finish reason, ``tool_calls`` when the model ended its turn with calls."""
        return "tool_calls" if self.calls and finish != "length" else finish

    def observe(self, m: TokenMsg) -> None:
        """A token message arrived: the engine's cached count, the frontend metrics."""
        if m.text:
            self.reply.append(m.text)
        if m.kind == "first" and isinstance(m.cached_tokens, int):
            self.cached_tokens = max(0, min(m.cached_tokens, self.prompt_tokens))
        if self.obs is None:
            return
        if m.kind == "error":
            self.obs.fail()
            return
        n = max(m.tokens, m.total - self.obs.output) if m.kind == "done" else m.tokens  # a lost chunk
        self.obs.tokens(n, self.prompt_tokens, self.cached_tokens)

    def headers(self) -> dict[str, str]:
        h = {"x-branch-id": self.branch}
        if self.request:
            h["x-request-id"] = self.request
        if self.route is not None:
            h["x-prefill-node"] = self.route.prefill_node
            h["x-decode-node"] = self.route.decode_node
        if self.unapplied:
            h["x-evolving-unapplied"] = ",".join(self.unapplied)
        if self.unserved_tools:
            h["x-evolving-unserved-tools"] = ",".join(self.unserved_tools)
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
        if self.unserved_tools:
            ext["unserved_tools"] = list(self.unserved_tools)
        return ext

    def usage(self, completion: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def full_body(self, text: str, completion: int, finish: str, simulated: bool,
                  calls: list[ToolCall] | None = None) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if calls:
                message["content"] = text or None
                message["tool_calls"] = [openai_call(c) for c in calls]
            choice = {"index": 0, "message": message, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {"id": self._id(), "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self.usage(completion), "evolving": self.extension(simulated)}

    def chunk(self, text: str, finish: str | None, first: bool, simulated: bool,
              calls: list[ToolCall] | None = None) -> dict:
        if self.chat:
            delta: dict = {"content": text}
            if calls:  # each whole in one delta (a client accumulates the arguments of an index)
                if not text:
                    del delta["content"]
                base = self.calls - len(calls)
                delta["tool_calls"] = [{"index": base + i, **openai_call(c)} for i, c in enumerate(calls)]
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


def openai_call(c: ToolCall) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


#: however busy its node, a request that has had no token this many ``token_timeout_s`` ends
PROGRESS_WAIT_CAP = 10


def _working(meta: Meta, timeout_s: float) -> bool:
    """Whether a node of the request's route showed progress within ``timeout_s``: a busy node
    is not a dead one (liveness ends the requests of a removed node; the router re-routes them)."""
    if meta.node_quiet_s is None or meta.route is None:
        return False
    quiet = [meta.node_quiet_s(n) for n in {meta.route.prefill_node, meta.route.decode_node}]
    return any(q is not None and q < timeout_s for q in quiet)


async def next_token(tsub, meta: Meta, timeout_s: float) -> TokenMsg:
    """The request's next token message. ``timeout_s`` of silence ends it with a 504, unless a
    node of its route kept making progress meanwhile (then it is waited for, up to
    ``PROGRESS_WAIT_CAP`` x ``timeout_s``)."""
    m = None
    for _ in range(PROGRESS_WAIT_CAP):
        try:
            m = await tsub.get(timeout_s)
            break
        except TimeoutError:
            if not _working(meta, timeout_s):
                break
    if m is None:
        if meta.obs is not None:
            meta.obs.fail()
        raise ApiError(504, f"no tokens for request {meta.request!r} from node "
                       f"{meta.route.decode_node!r} within {timeout_s:g} s",
                       None, "timeout") from None
    meta.observe(m)
    return m
