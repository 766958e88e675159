"""The OpenAI Responses API on the gateway (``POST /v1/responses``): the request Struct, the
mapping onto the chat template, the response object, the ``response.*`` event sequence and the
bounded store behind ``previous_response_id`` (pure: msgspec + stdlib).

Routes (wired in ``services.drivers.gateway.app``): ``POST /v1/responses`` (non-streaming, or
``stream: true`` for the event sequence) and ``GET /v1/responses/{response_id}`` (a stored one).

Mapping (docs/gateway.md, "Responses API"): the request becomes OpenAI-style chat messages
rendered by the one chat template, the way ``/v1/chat/completions`` renders ``messages`` and
``tools``, so the same conversation costs the same tokens on either API:

- ``instructions`` -> a ``system`` message first (not carried over by ``previous_response_id``,
  as OpenAI documents);
- ``previous_response_id`` -> the stored conversation of that response (its input and its
  output), then this request's input;
- ``input``: a string is one ``user`` message; a list holds items: ``message`` (roles user,
  system, developer, assistant; content a string or parts: ``input_text`` / ``output_text`` /
  ``text`` as text, ``refusal`` as its text, any other part as ``[<type>]``), ``function_call``
  (an assistant's ``tool_calls`` entry, merged into the assistant message before it) and
  ``function_call_output`` (a ``tool`` message). ``reasoning`` items and every other item type
  are accepted and ignored, counted;
- ``tools``: ``function`` tools -> ``{"name", "description", "parameters"}`` (the chat route's
  shape); every other tool type (``namespace``, ``web_search``, ``file_search``, ``mcp``, ...)
  is accepted, not rendered, counted;
- ``prompt_cache_key`` -> the branch when the request has no branch header (the app):
  it acts as a session id header.

Unknown top-level fields and the fields that change nothing here (``reasoning``, ``include``,
``parallel_tool_calls``, ``client_metadata``, ``metadata``, ``text``, ``truncation``, ...) are
accepted and counted (``ignored``), never a 400; a known field of the wrong type still is.
A forcing ``tool_choice`` (``"required"``, ``{"type": "function", "name"}``) and a ``text.format``
``json_schema`` / ``json_object`` constrain the engine's output (``constraints``), as on the chat
route; ``temperature`` and ``top_p`` reach the engine.

Output: :class:`ResponseBuilder` holds the response's output items in order: one ``message``
item with one ``output_text`` part (the engine's text); with a tool-call parser (``toolcalls``:
the request has function tools, ``tool_choice`` is not ``none``) a ``function_call`` item per
call, in order with the text's messages (:meth:`ResponseBuilder.pieces`, :meth:`add_call`). ``status`` is ``incomplete`` (``incomplete_details.
reason: max_output_tokens``, event ``response.incomplete``) when the engine stopped at the
budget, else ``completed``. Errors are the gateway's OpenAI shape (``ApiError``); after the
stream started, an ``error`` event and then ``response.failed``.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from services.drivers.gateway.api import (
    UNSERVED_TOOL,
    ApiError,
    ChatRequest,
    NvExt,
    clip,
    decode_object,
    function_def,
    unserved_kind,
    validation_error,
)
from services.drivers.gateway.toolcalls import ToolCall

PATH = "/v1/responses"
MAX_ID_LEN = 256

# ----------------------------------------------------------------------------- the request
SessionKey = Annotated[str, Meta(min_length=1, max_length=MAX_ID_LEN, pattern="^[^\\x00-\\x1f]+$")]


class ResponsesRequest(Struct, kw_only=True):
    """The fields read or range-checked; any other top-level field is accepted and ignored."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=MAX_ID_LEN)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    prompt_cache_key: SessionKey | None = None
    nvext: NvExt | None = None
    # accepted, range-checked, not applied (unapplied)
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    text: dict[str, Any] | None = None
    # accepted, no effect here (ignored, counted)
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    background: bool | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    prompt_cache_retention: str | None = None
    stream_options: dict[str, Any] | None = None


#: Fields that change nothing in the response (counted as ignored when set).
NO_EFFECT = ("parallel_tool_calls", "reasoning", "include", "metadata", "client_metadata", "user",
             "safety_identifier", "service_tier", "truncation", "background", "max_tool_calls", "top_logprobs",
             "prompt_cache_retention", "stream_options")


@dataclass
class Parsed:
    """A validated request: the new input as chat messages (no instructions), the function
    definitions for the template, what was ignored (``(kind, name)``: kind ``field`` / ``tool``
    / ``item``) and what was not applied."""

    req: ResponsesRequest
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    ignored: list[tuple[str, str]] = field(default_factory=list)
    unapplied: list[str] = field(default_factory=list)
    #: the flat name of each namespaced tool (flat_name) -> (namespace, name): a call of it comes
    #: back as a ``function_call`` item naming both, as the client expects
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def unserved(self) -> list[str]:
        """The types of the tools left out of the prompt (hosted tools: ``web_search``, ...)."""
        return [name for kind, name in self.ignored if kind == "tool"]


class _MessageItem(Struct):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class _FunctionCallItem(Struct):
    call_id: Annotated[str, Meta(min_length=1)]
    name: Annotated[str, Meta(min_length=1)]
    arguments: str
    namespace: str | None = None  # a tool of a namespace tool (Codex's sub-agent tools): flat_name


class _FunctionCallOutputItem(Struct):
    output: str | list[dict[str, Any]]
    call_id: str | None = None


class _FunctionTool(Struct):
    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


def _convert(obj: Any, cls: type[Struct], at: str) -> Any:
    """``obj`` as ``cls``; a 400 whose ``param`` is the path under ``at``."""
    try:
        return msgspec.convert(obj, cls)
    except msgspec.ValidationError as exc:
        err = validation_error(exc)
        param = (at or "body") if err.param == "body" else f"{at}.{err.param}" if at else err.param
        raise ApiError(400, err.message.replace(f"'{err.param}'", f"'{param}'", 1), param, code=err.code) from None


def _parts(content: str | list[dict[str, Any]], at: str) -> str | list[dict[str, Any]]:
    """Content parts as the chat template's: text kinds as text, anything else as ``[<type>]``."""
    if isinstance(content, str):
        return content
    out: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if not isinstance(kind, str):
            raise ApiError(400, f"'{at}[{i}].type': a content part needs a string 'type'", f"{at}[{i}].type",
                           code="missing_required_parameter")
        key = ("text" if kind in ("input_text", "output_text", "text") else "refusal" if kind == "refusal"
               else "encrypted_content" if kind == "encrypted_content" else None)
        if key is None:
            out.append({"type": kind})
            continue
        text = part.get(key)
        if not isinstance(text, str):
            raise ApiError(400, f"'{at}[{i}].{key}': must be a string", f"{at}[{i}].{key}", code="invalid_type")
        out.append({"type": "text", "text": text})
    return out


def input_messages(items: str | list[dict[str, Any]] | None, at: str = "input",
                   ignored: list[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """Input items as chat messages (the module docstring has the mapping); items of other
    types go to ``ignored`` as ``("item", type)``."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{at}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            m = _convert(item, _MessageItem, where)
            out.append({"role": m.role, "content": _parts(m.content, f"{where}.content")})
        elif kind == "function_call":
            c = _convert(item, _FunctionCallItem, where)
            name = flat_name(c.namespace, c.name) if c.namespace else c.name
            call = {"id": c.call_id, "type": "function", "function": {"name": name, "arguments": c.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": [], "tool_calls": [call]})
        elif kind == "agent_message":  # Codex: a message from another agent of the session (a sub-agent's task)
            content = item.get("content")
            if not isinstance(content, list | str):
                raise ApiError(400, f"'{where}.content': must be a string or a list of parts", f"{where}.content",
                               code="invalid_type")
            out.append({"role": "user", "content": _parts(content, f"{where}.content")})
        elif kind == "function_call_output":
            o = _convert(item, _FunctionCallOutputItem, where)
            msg: dict[str, Any] = {"role": "tool", "content": _parts(o.output, f"{where}.output")}
            if o.call_id:
                msg["tool_call_id"] = o.call_id
            out.append(msg)
        elif kind == "additional_tools":
            continue  # its tools are the request's (parse_responses)
        elif ignored is not None:
            ignored.append(("item", kind if isinstance(kind, str) else "(none)"))
    return out


def flat_name(namespace: str, name: str) -> str:
    """A namespaced tool's name as the model sees and calls it: Codex's own flat form of a
    namespaced tool name (``ToolName::canonical_flat_name``), ``<namespace>__<name>`` with the
    underscores at the seam trimmed (``multi_agent_v1__spawn_agent``, ``collaboration__wait_agent``)."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


#: A namespace whose tools the client serves only from inside its own code tool (Codex 0.171's
#: ``functions`` in an ``additional_tools`` item: nested tools of its ``exec`` JavaScript tool; a
#: direct ``function_call`` of one is dropped by Codex, measured): not rendered, counted.
CODE_ONLY_NAMESPACES = ("functions",)


def _tools(tools: list[dict[str, Any]] | None, ignored: list[tuple[str, str]], at: str = "tools",
           namespaced: dict[str, tuple[str, str]] | None = None,
           skip: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Function tools as the template's definitions; a ``namespace`` tool's function tools as
    well, each under :func:`flat_name` (``namespaced``: flat name -> (namespace, name), so a call
    comes back as a ``function_call`` with its ``namespace``); any other type ignored and counted
    (``ignored``: ``("tool", type)``)."""
    out: list[dict[str, Any]] = []
    for i, t in enumerate(tools or ()):
        kind = t.get("type") if isinstance(t, dict) else None
        if not isinstance(kind, str):
            raise ApiError(400, f"'{at}[{i}].type': a tool needs a string 'type'", f"{at}[{i}].type",
                           code="missing_required_parameter")
        if kind == "function":
            f = _convert(t, _FunctionTool, f"{at}[{i}]")
            out.append(function_def(f.name, f.description, f.parameters))
        elif kind == "namespace" and isinstance(t.get("name"), str) and t["name"] and t["name"] not in skip:
            ns, inner = t["name"], t.get("tools")
            if not isinstance(inner, list):
                raise ApiError(400, f"'{at}[{i}].tools': a namespace needs a list of tools", f"{at}[{i}].tools",
                               code="invalid_type")
            sub = _tools(inner, ignored, f"{at}[{i}].tools")
            for d in sub:
                flat = flat_name(ns, d["name"])
                if namespaced is not None:
                    namespaced[flat] = (ns, d["name"])
                out.append({**d, "name": flat})
        else:
            ignored.append(("tool", unserved_kind(kind if kind != "namespace" else f"namespace:{t.get('name')}")))
    return out


def parse_responses(raw: bytes) -> Parsed:
    """The validated ``POST /v1/responses`` body (400 :class:`ApiError` naming the field)."""
    obj = decode_object(raw)
    fields = ResponsesRequest.__struct_fields__
    ignored: list[tuple[str, str]] = [("field", k) for k in sorted(obj) if k not in fields]
    req = _convert({k: v for k, v in obj.items() if k in fields}, ResponsesRequest, "")
    ignored += [("field", k) for k in NO_EFFECT if getattr(req, k) is not None]
    namespaced: dict[str, tuple[str, str]] = {}
    tools = _tools(req.tools, ignored, "tools", namespaced)
    # Codex's "additional_tools" input items (its default model's request): more tools, same shapes
    for i, item in enumerate(req.input if isinstance(req.input, list) else ()):
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            extra = item.get("tools")
            if not isinstance(extra, list):
                raise ApiError(400, f"'input[{i}].tools': must be a list of tools", f"input[{i}].tools",
                               code="invalid_type")
            tools += _tools(extra, ignored, f"input[{i}].tools", namespaced, skip=CODE_ONLY_NAMESPACES)
    messages = input_messages(req.input, "input", ignored)
    # temperature and top_p reach the engine (budget_request); a forcing tool_choice and a JSON
    # text.format constrain its output (constraints.py); an allowed_tools or hosted tool choice does not
    unapplied: list[str] = []
    if isinstance(req.tool_choice, dict) and req.tool_choice.get("type") != "function":
        unapplied.append("tool_choice")
    if req.text is not None and any(k != "format" for k in req.text):
        ignored.append(("field", "text"))  # verbosity: the engine writes what it writes
    return Parsed(req, messages, tools or None, ignored, unapplied, namespaced)


def ignored_names(ignored: list[tuple[str, str]]) -> list[str]:
    """The ignored things as the ignored-fields counter names them: a field by its name, a tool
    or an input item by its type (``tools[].type: web_search``, ``input[].type: reasoning``)."""
    where = {"tool": UNSERVED_TOOL, "item": "input[].type: "}
    return [where.get(kind, "") + name for kind, name in ignored]


@dataclass
class Call:
    """What the shared serving path needs of a Responses request: the parsed request, and
    ``keep``, which stores the finished response object (a no-op for ``store: false``)."""

    parsed: Parsed
    keep: Callable[[dict], None]

    @property
    def session(self) -> str | None:
        """``prompt_cache_key``: the branch when no branch header names one."""
        return self.parsed.req.prompt_cache_key

    @property
    def unapplied(self) -> list[str]:
        return self.parsed.unapplied


def prompt_messages(parsed: Parsed, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation the template renders: instructions, the stored history, the new input."""
    out = [{"role": "system", "content": parsed.req.instructions}] if parsed.req.instructions else []
    out += history + parsed.messages
    if not out:
        raise ApiError(400, "'input': nothing to respond to (no input, instructions or previous_response_id)",
                       "input", code="missing_required_parameter")
    return out


def budget_request(req: ResponsesRequest) -> ChatRequest:
    """The request as the gateway's budget and streaming logic sees it (``max_tokens``,
    ``stream``, ``nvext``); the prompt itself comes from :func:`prompt_messages`."""
    return ChatRequest(model=req.model, messages=[], max_tokens=req.max_output_tokens, stream=req.stream,
                       nvext=req.nvext, temperature=req.temperature, top_p=req.top_p)


def renamed(exc: ApiError) -> ApiError:
    """A budget error of the shared path in this API's names (``max_output_tokens``, ``input``)."""
    if exc.param in ("max_tokens", "max_completion_tokens"):
        exc.message = exc.message.replace(f"'{exc.param}'", "'max_output_tokens'")
        exc.param = "max_output_tokens"
    elif exc.param == "messages":
        exc.message = exc.message.replace("in the messages", "in the input").replace("the messages", "the input")
        exc.param = "input"
    return exc


# ----------------------------------------------------------------------------- the response
def usage(prompt: int, cached: int, output: int) -> dict[str, Any]:
    """``input_tokens`` counts the whole prompt; ``cached_tokens`` the part whose KV was reused."""
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": max(0, min(cached, prompt)), "cache_write_tokens": 0},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output}


def status_of(finish: str | None) -> str:
    """The engine's finish reason as the response's ``status``: the budget ran out, or it ended."""
    return "incomplete" if (finish or "length") == "length" else "completed"


@dataclass
class ResponseBuilder:
    """One response: its object, its output items in order, and its event sequence (each event
    numbered by ``sequence_number``). Streaming: :meth:`start`, then per item either
    :meth:`open_message` / :meth:`text_delta` / :meth:`close_message` or :meth:`add_item`, then
    :meth:`finish` (or :meth:`failed`)."""

    id: str
    created_at: int
    model: str
    req: ResponsesRequest
    extension: dict[str, Any]
    output: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    _open: dict[str, Any] | None = None  # the message item being streamed
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)  # Parsed.namespaced
    _text: list[str] = field(default_factory=list)

    def body(self, status: str, use: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict:
        """The response object (``status``: in_progress, completed, incomplete, failed)."""
        r = self.req
        choice = r.tool_choice if r.tool_choice is not None else "auto"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "background": False, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "max_tool_calls": None,
                "model": self.model, "output": list(self.output),
                "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
                "previous_response_id": r.previous_response_id, "prompt_cache_key": r.prompt_cache_key,
                "reasoning": {"effort": None, "summary": None}, "service_tier": "default",
                "store": r.store is not False, "temperature": r.temperature, "text": {"format": {"type": "text"}},
                "tool_choice": choice, "tools": list(r.tools or []), "top_p": r.top_p, "truncation": "disabled",
                "usage": use, "user": r.user, "metadata": r.metadata or {}, "evolving": self.extension}

    # ---- items
    def message_item(self, text: str, status: str) -> dict[str, Any]:
        n = sum(1 for it in self.output if it["type"] == "message")
        return {"id": f"msg_{self.id.removeprefix('resp_')}" + (f"_{n}" if n else ""), "type": "message",
                "status": status, "role": "assistant",
                "content": [] if status == "in_progress" else [_output_text(text)]}

    def add_message(self, text: str, status: str = "completed") -> dict[str, Any]:
        """A whole message item (the non-streaming answer)."""
        item = self.message_item(text, status)
        self.output.append(item)
        return item

    def add_item(self, item: dict[str, Any]) -> bytes:
        """A finished item of any type (a parser's ``function_call``): appended, and its
        ``output_item.added`` / ``output_item.done`` events."""
        index = len(self.output)
        self.output.append(item)
        return (self.event("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})
                + self.event("response.output_item.done", output_index=index, item=item))

    @property
    def message_open(self) -> bool:
        """A message item is being streamed (opened, not yet closed)."""
        return self._open is not None

    def call_item(self, c: ToolCall) -> dict[str, Any]:
        """A ``function_call`` item; a namespaced tool's carries its ``namespace`` and its own name
        (what Codex reads: ``{"type": "function_call", "namespace": "multi_agent_v1", "name":
        "spawn_agent", ...}``)."""
        item = {"id": "fc_" + c.id.removeprefix("call_"), "type": "function_call", "status": "completed",
                "call_id": c.id, "name": c.name, "arguments": c.arguments}
        if c.name in self.namespaced:
            item["namespace"], item["name"] = self.namespaced[c.name]
        return item

    def add_call(self, c: ToolCall) -> bytes:
        """A parsed tool call as a ``function_call`` item, with OpenAI's events: output_item.added
        (no arguments yet), function_call_arguments.delta (all of them) and .done, output_item.done."""
        item, index = self.call_item(c), len(self.output)
        self.output.append(item)
        return (self.event("response.output_item.added", output_index=index,
                           item={**item, "status": "in_progress", "arguments": ""})
                + self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=c.arguments)
                + self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=c.name, arguments=c.arguments)
                + self.event("response.output_item.done", output_index=index, item=item))

    def pieces(self, pieces: list, status: str = "completed") -> bytes:
        """Streamed text and calls in order: text into the open message (opened on demand), a call
        closes it and becomes its own item."""
        out = b""
        for p in pieces:
            if isinstance(p, ToolCall):
                if self._open is not None:
                    out += self.close_message(status)
                out += self.add_call(p)
            elif p:
                if self._open is None:
                    out += self.open_message()
                out += self.text_delta(p)
        return out

    # ---- events
    def event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return sse(kind, payload)

    def start(self) -> bytes:
        return (self.event("response.created", response=self.body("in_progress"))
                + self.event("response.in_progress", response=self.body("in_progress")))

    def open_message(self) -> bytes:
        self._open, self._text = self.message_item("", "in_progress"), []
        index = len(self.output)
        return (self.event("response.output_item.added", output_index=index, item=self._open)
                + self.event("response.content_part.added", item_id=self._open["id"], output_index=index,
                             content_index=0, part=_output_text("")))

    def text_delta(self, text: str) -> bytes:
        if not text or self._open is None:
            return b""
        self._text.append(text)
        return self.event("response.output_text.delta", item_id=self._open["id"], output_index=len(self.output),
                          content_index=0, delta=text, logprobs=[])

    def close_message(self, status: str = "completed") -> bytes:
        assert self._open is not None
        text, index, item_id = "".join(self._text), len(self.output), self._open["id"]
        item = {**self._open, "status": status, "content": [_output_text(text)]}
        self.output.append(item)
        self._open = None
        return (self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=[])
                + self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                             part=_output_text(text))
                + self.event("response.output_item.done", output_index=index, item=item))

    def finish(self, body: dict[str, Any]) -> bytes:
        """``response.completed`` (or ``response.incomplete``) carrying the final ``body``."""
        kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return self.event(kind, response=body)

    def failed(self, exc: ApiError) -> bytes:
        """An ``error`` event, then ``response.failed`` (what OpenAI sends when a stream fails)."""
        err = self.event("error", code=exc.code, message=exc.message, param=exc.param)
        return err + self.event("response.failed", response=self.body(
            "failed", error={"code": "server_error" if exc.status >= 500 else "invalid_prompt",
                             "message": exc.message}))


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as chat messages (output items are valid input items), for the
    history a later ``previous_response_id`` continues."""
    return input_messages([it for it in output if it.get("type") in ("message", "function_call")], "output")


def sse(event: str, data: dict) -> bytes:
    """One server-sent event as OpenAI sends them: ``event: <type>`` then ``data: <json>``."""
    return f"event: {event}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


# ----------------------------------------------------------------------------- the store
@dataclass
class Stored:
    body: dict[str, Any]  # the response object (GET /v1/responses/{id})
    history: list[dict[str, Any]]  # the conversation as chat messages, this response's output included
    size: int
    expires: float


class ResponseStore:
    """The responses ``previous_response_id`` and ``GET /v1/responses/{id}`` can name: in this
    process's memory, bounded by ``max_entries``, ``max_bytes`` (the JSON size of the bodies
    and histories) and ``ttl_s`` since the response was stored; the least recently used goes
    first. A restart forgets them all (a client then gets ``previous_response_not_found`` and
    must resend its input)."""

    def __init__(self, max_entries: int = 1024, max_bytes: int = 64 << 20, ttl_s: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.max_bytes, self.ttl_s, self.clock = max_entries, max_bytes, ttl_s, clock
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, body: dict[str, Any], history: list[dict[str, Any]]) -> bool:
        """Keep a response; False (and nothing kept) when it alone is over ``max_bytes``."""
        size = len(msgspec.json.encode(body)) + len(msgspec.json.encode(history))
        self._drop(rid)
        if size > self.max_bytes or self.max_entries <= 0:
            return False
        self._items[rid] = Stored(body, history, size, self.clock() + self.ttl_s)
        self.bytes += size
        while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))
            self.evicted += 1
        return True

    def get(self, rid: str) -> Stored | None:
        st = self._items.get(rid)
        if st is None:
            return None
        if st.expires <= self.clock():
            self._drop(rid)
            return None
        self._items.move_to_end(rid)
        return st

    def _drop(self, rid: str) -> None:
        st = self._items.pop(rid, None)
        if st is not None:
            self.bytes -= st.size


def not_found(rid: str, param: str | None = "previous_response_id") -> ApiError:
    """OpenAI's answer for a response id it does not hold (``store: false``, expired, evicted)."""
    if param is None:
        return ApiError(404, f"Response with id '{clip(rid)}' not found.", None, code="not_found")
    return ApiError(400, f"Previous response with id '{clip(rid)}' not found.", param,
                    code="previous_response_not_found")
