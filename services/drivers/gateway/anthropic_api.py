"""The Anthropic Messages API on the gateway: request Structs, the mapping onto the chat
template, response bodies, the SSE event sequence and the error shape (pure: msgspec + stdlib).

Routes (wired in ``services.drivers.gateway.app``): ``POST /v1/messages`` (non-streaming, or
``stream: true`` for Anthropic's event sequence) and ``POST /v1/messages/count_tokens``.

Mapping (docs/gateway.md, "Anthropic Messages API"): the request becomes OpenAI-style chat
messages rendered by the one chat template (``services.drivers.gateway.tokenizer``), so a
conversation costs the same tokens and hashes to the same blocks on either API:

- ``system`` (a string or text blocks) and any ``system`` message inside ``messages`` -> one
  ``system`` message first: their texts in order, joined by a blank line (:func:`system_prompt`);
- ``tools`` (custom tools) -> ``{"name", "description", "parameters": input_schema}``, the shape
  OpenAI's function tools are rendered in;
- an assistant's ``tool_use`` blocks -> its ``tool_calls`` (``arguments``: the input as compact
  JSON with sorted keys); a user's ``tool_result`` blocks -> ``tool`` messages (tag
  ``tool:<tool_use_id>``, ``[error]`` before the content when ``is_error``), in order with the
  user's other blocks;
- text blocks are text; image, document and thinking blocks render as ``[<type>]``;
- a last ``assistant`` message is a prefill: the prompt ends inside it (no end tag), and the
  response continues it.

Responses: one ``text`` content block (the engine's text); with a tool-call parser
(``toolcalls``: the request has tools, ``tool_choice`` is not ``none``) the text and the calls
in it in order, a ``text`` block for the text, a ``tool_use`` block per call (streamed as
content_block_start, one ``input_json_delta``, content_block_stop). ``stop_reason``
``max_tokens`` when the engine stopped at the budget, ``tool_use`` when the answer holds calls,
else ``end_turn``; ``usage.cache_read_input_tokens`` is
what the router's decision says the chosen node already held (``RouteDecided.t_c``), and
``input_tokens`` the rest of the prompt (Anthropic's total input is their sum;
``cache_creation_input_tokens`` is always 0: there is no explicit cache write).

Errors on these routes are Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``
(the HTTP status is the gateway's, see :data:`ERROR_TYPES`); inside a started stream, an
``event: error`` with the same body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from services.drivers.gateway.api import (
    ApiError,
    ChatRequest,
    Message,
    convert,
    decode_object,
    function_def,
    unserved_kind,
)
from services.drivers.gateway.tokenizer import GENERATION_PROMPT, TemplateError, render_chat
from services.drivers.gateway.toolcalls import Piece, ToolCall

PREFIX = "/v1/messages"  # the routes (and their 404/405s) answered in Anthropic's error shape

# ----------------------------------------------------------------------------- request Structs


class TextBlock(Struct, tag_field="type", tag="text"):
    text: str


class ImageBlock(Struct, tag_field="type", tag="image"):
    source: dict[str, Any]


class DocumentBlock(Struct, tag_field="type", tag="document"):
    source: dict[str, Any]


class SearchResultBlock(Struct, tag_field="type", tag="search_result"):
    source: str
    title: str | None = None
    content: list[TextBlock] = []


class ThinkingBlock(Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Struct, tag_field="type", tag="redacted_thinking"):
    data: str


class ToolUseBlock(Struct, tag_field="type", tag="tool_use"):
    id: Annotated[str, Meta(min_length=1)]
    name: Annotated[str, Meta(min_length=1)]
    input: dict[str, Any]


class ToolResultBlock(Struct, tag_field="type", tag="tool_result"):
    tool_use_id: Annotated[str, Meta(min_length=1)]
    content: str | list[TextBlock | ImageBlock | DocumentBlock | SearchResultBlock] | None = None
    is_error: bool = False


Block = (TextBlock | ImageBlock | DocumentBlock | SearchResultBlock | ThinkingBlock | RedactedThinkingBlock
         | ToolUseBlock | ToolResultBlock)


class AMessage(Struct):
    role: Literal["user", "assistant", "system"]  # system: folded into the system prompt (chat_messages)
    content: str | list[Block]


class Tool(Struct):
    """A custom (client) tool, or an Anthropic-defined client tool as one (:func:`client_tool`);
    other fields (``cache_control``, ``strict``, ...) are ignored."""

    name: Annotated[str, Meta(min_length=1)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None


class ToolChoice(Struct):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _Base(Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[AMessage], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # automatic prefix caching happens anyway
    # its ``format`` (json_schema) constrains the output (constraints.py); anything else in it
    # (Claude Code's ``effort``) is ignored and counted as the field ``output_config``
    output_config: dict[str, Any] | None = None


class MessagesRequest(_Base, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=0)]
    stream: bool = False
    # sampling and stopping: carried to the engine (api.sampling_fields, via budget_request)
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stop_sequences: list[str] | None = None
    # not Anthropic's: vLLM's and SGLang's extension, for benchmarks (run to max_tokens)
    ignore_eos: bool | None = None
    # bookkeeping: no effect on the response
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


class CountTokensRequest(_Base, kw_only=True):
    pass


SAMPLING: tuple[str, ...] = ()  # every sampling parameter reaches the engine (budget_request)


# ----------------------------------------------------------------------------- Anthropic-defined tools
# Anthropic-defined *client* tools (the client runs them; the model calls them by name with the
# documented input): rendered as custom tools with their documented input schemas, so a model
# served here can call them and the call comes back as a tool_use with the tool's name. Schemas:
# Anthropic's tool-use docs ("Bash tool", "Text editor tool", "Computer use tool", "Memory tool"),
# as the @ai-sdk/anthropic 3.0 provider's input schemas write them.
_BASH = {"type": "object", "properties": {
    "command": {"type": "string", "description": "The bash command to run. Required unless the tool is being restarted."},
    "restart": {"type": "boolean", "description": "Specifying true will restart this tool. Otherwise, leave this unspecified."}}}


def _editor(undo: bool) -> dict[str, Any]:
    commands = ["view", "create", "str_replace", "insert"] + (["undo_edit"] if undo else [])
    return {"type": "object", "required": ["command", "path"], "properties": {
        "command": {"type": "string", "enum": commands},
        "path": {"type": "string", "description": "Absolute path to the file or directory."},
        "file_text": {"type": "string", "description": "create: the content of the new file."},
        "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2,
                       "description": "view: the first and last line to show (1-based; -1: to the end)."},
        "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
        "new_str": {"type": "string", "description": "str_replace: the new text; insert: the text to insert."},
        "insert_line": {"type": "integer", "description": "insert: the line after which to insert (0: the start)."}}}


_XY = {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}
_ACTIONS_2024 = ["key", "type", "mouse_move", "left_click", "left_click_drag", "right_click", "middle_click",
                 "double_click", "screenshot", "cursor_position"]
_ACTIONS_2025 = ["key", "hold_key", "type", "cursor_position", "mouse_move", "left_mouse_down", "left_mouse_up",
                 "left_click", "left_click_drag", "right_click", "middle_click", "double_click", "triple_click",
                 "scroll", "wait", "screenshot"]


def _computer(actions: list[str]) -> dict[str, Any]:
    props: dict[str, Any] = {"action": {"type": "string", "enum": actions},
                             "coordinate": {**_XY, "description": "(x, y) pixels from the top left"},
                             "text": {"type": "string", "description": "key / type: the keys or the text"}}
    if "scroll" in actions:
        props.update(start_coordinate=_XY, duration={"type": "number"}, scroll_amount={"type": "integer"},
                     scroll_direction={"type": "string", "enum": ["up", "down", "left", "right"]})
    return {"type": "object", "required": ["action"], "properties": props}


_MEMORY = {"type": "object", "required": ["command"], "properties": {
    "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "delete", "rename"]},
    "path": {"type": "string"}, "view_range": _XY, "file_text": {"type": "string"}, "old_str": {"type": "string"},
    "new_str": {"type": "string"}, "insert_line": {"type": "integer"}, "insert_text": {"type": "string"},
    "old_path": {"type": "string"}, "new_path": {"type": "string"}}}

#: type prefix -> (the tool's documented name, description, input schema by type). A version of
#: a family not listed (a newer ``bash_2026...``) gets the family's latest schema.
CLIENT_TOOLS: dict[str, tuple[str, str, dict[str, dict[str, Any]]]] = {
    "bash_": ("bash", "Run a command in a persistent bash shell; restart: true restarts the shell.",
              {"": _BASH}),
    "text_editor_": ("str_replace_based_edit_tool",
                     "View, create and edit text files: view (a file or a directory), create, str_replace, insert.",
                     {"text_editor_20241022": _editor(True), "text_editor_20250124": _editor(True), "": _editor(False)}),
    "computer_": ("computer", "Use the computer's mouse and keyboard and take screenshots.",
                  {"computer_20241022": _computer(_ACTIONS_2024), "": _computer(_ACTIONS_2025)}),
    "memory_": ("memory", "Read and write files in the /memories directory that persist between conversations.",
                {"": _MEMORY}),
}
_EDITOR_NAMES = {"text_editor_20241022": "str_replace_editor", "text_editor_20250124": "str_replace_editor"}


def client_tool(kind: str, tool: dict[str, Any]) -> dict[str, Any] | None:
    """An Anthropic-defined client tool (``{"type": "bash_20250124", "name": "bash"}``) as the
    custom tool the chat template renders (its name as the request gives it, else the documented
    one); None when ``kind`` is not a client tool's type (a server tool: web search, ...)."""
    for prefix, (name, description, schemas) in CLIENT_TOOLS.items():
        if kind.startswith(prefix):
            schema = schemas.get(kind, schemas[""])
            if prefix == "computer_" and tool.get("display_width_px") and tool.get("display_height_px"):
                description += f" The display is {tool['display_width_px']}x{tool['display_height_px']} pixels."
            given = tool.get("name")
            return {"name": given if isinstance(given, str) and given else _EDITOR_NAMES.get(kind, name),
                    "description": description, "input_schema": schema}
    return None


# ----------------------------------------------------------------------------- parsing
def _decode(raw: bytes, cls: type[Struct], ignored: list[str] | None = None,
            unserved: list[str] | None = None) -> Any:
    obj = decode_object(raw)
    tools = obj.get("tools")
    if isinstance(tools, list):  # Anthropic-defined tools: client ones rendered, server ones left out
        kept = []
        for t in tools:
            kind = t.get("type") if isinstance(t, dict) else None
            if kind in (None, "custom") or not isinstance(kind, str):
                kept.append(t)  # a custom tool (or not an object: the Struct says what is wrong)
            elif (tool := client_tool(kind, t)) is not None:
                kept.append(tool)
            elif unserved is not None:  # runs at Anthropic (web search, code execution, ...) or unknown
                unserved.append(unserved_kind(kind))
        obj["tools"] = kept
    try:
        req = convert(obj, cls, ignored)
    except ApiError as exc:
        if exc.param and exc.param.endswith(".role"):  # not OpenAI's list of roles
            exc.message = exc.message.split(" (expected", 1)[0] + " (expected 'user', 'assistant' or 'system')"
        raise
    oc = req.output_config
    if ignored is not None and oc is not None and any(k != "format" for k in oc):
        ignored.append("output_config")
        ignored.sort()
    tc = req.tool_choice
    if tc is not None and tc.type == "tool" and not tc.name:
        raise ApiError(400, "'tool_choice.name': required when tool_choice.type is 'tool'", "tool_choice.name",
                       code="missing_required_parameter")
    return req


def parse_messages(raw: bytes, ignored: list[str] | None = None, unserved: list[str] | None = None) -> MessagesRequest:
    """The validated ``POST /v1/messages`` body (400 :class:`ApiError` naming the field); the
    names of unknown top-level fields (dropped, never a 400) are appended to ``ignored``, the
    types of the tools that cannot be served (server tools, unknown types: left out) to ``unserved``."""
    return _decode(raw, MessagesRequest, ignored, unserved)


def parse_count_tokens(raw: bytes, ignored: list[str] | None = None,
                       unserved: list[str] | None = None) -> CountTokensRequest:
    return _decode(raw, CountTokensRequest, ignored, unserved)


def unapplied(req: MessagesRequest) -> list[str]:
    """Parameters set on the request that the engine does not apply (a forcing ``tool_choice`` is
    applied: the engine's output is constrained to a call, constraints.py)."""
    out = [name for name in SAMPLING if getattr(req, name) is not None]
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        out.append("thinking")  # no thinking blocks are produced
    return out


# ----------------------------------------------------------------------------- the chat template
def _part(block: Struct) -> dict[str, Any]:
    """A content part for ``render_chat``: text as text, anything else as ``[<type>]``."""
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    return {"type": type(block).__struct_config__.tag}


def compact_json(data: dict[str, Any]) -> str:
    """A tool_use input as its tool call's arguments: compact JSON, sorted keys."""
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


def _text(content: str | list[TextBlock] | list[Block]) -> str:
    """The text of a system prompt or a system message: its text blocks joined."""
    if isinstance(content, str):
        return content
    return "".join(b.text for b in content if isinstance(b, TextBlock))


def system_prompt(req: _Base) -> str:
    """The top-level ``system`` then every ``system`` message of ``messages``, in order, joined
    by a blank line: a system message is an instruction to the model wherever it stands, as the
    top-level field is (the chat templates we render take one system message, first)."""
    parts = [_text(req.system)] if req.system else []
    parts += [_text(m.content) for m in req.messages if m.role == "system"]
    return "\n\n".join(p for p in parts if p)


def chat_messages(req: _Base) -> list[dict[str, Any]]:
    """The request as OpenAI-style chat messages (the module docstring has the mapping)."""
    out: list[dict[str, Any]] = []
    system = system_prompt(req)
    if system:
        out.append({"role": "system", "content": system})
    for m in req.messages:
        if m.role == "system":
            continue  # folded into the system prompt above
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        if m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant",
                                   "content": [_part(b) for b in m.content if not isinstance(b, ToolUseBlock)]}
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": compact_json(b.input)}}
                     for b in m.content if isinstance(b, ToolUseBlock)]
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        run: list[dict[str, Any]] = []  # the user's blocks since the last tool_result
        for b in m.content:
            if isinstance(b, ToolResultBlock):
                if run:
                    out.append({"role": "user", "content": run})
                    run = []
                parts = [{"type": "error"}] if b.is_error else []
                if isinstance(b.content, str):
                    parts.append({"type": "text", "text": b.content})
                elif b.content:
                    parts += [_part(c) for c in b.content]
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": parts})
            else:
                run.append(_part(b))
        if run or not m.content:
            out.append({"role": "user", "content": run})
    return out


def tool_defs(req: _Base) -> list[dict[str, Any]] | None:
    """The custom tools as the ``{"name", "description", "parameters"}`` function definitions the
    chat template renders (and constraints.py forces a call of)."""
    return [function_def(t.name, t.description, t.input_schema) for t in req.tools] if req.tools else None


def render_prompt(req: _Base, template=None) -> str:
    """The prompt text: the chat template (``template.render``: the model's, or the simple
    :func:`render_chat` when None) over :func:`chat_messages` and the tools; a last assistant
    message is continued (prefill), so the prompt ends inside it."""
    tools = tool_defs(req)
    msgs = chat_messages(req)
    turns = [m for m in req.messages if m.role != "system"]
    prefill = bool(turns) and turns[-1].role == "assistant"
    try:
        if template is not None:
            return template.render(msgs, tools, continue_final=prefill)
        text = render_chat(msgs, tools)
    except TemplateError as exc:  # our mapping or the model's template refused it: a 400
        raise ApiError(400, exc.message, exc.field, code="invalid_value") from None
    if prefill:
        tail = "<|end|>\n" + GENERATION_PROMPT
        assert text.endswith(tail)
        text = text[: -len(tail)]
    return text


def budget_request(req: MessagesRequest) -> ChatRequest:
    """The request as the gateway's budget and streaming logic sees it (``max_tokens``,
    ``stream``, the sampling parameters, ``stop_sequences`` as ``stop``); the prompt itself
    comes from :func:`render_prompt`."""
    return ChatRequest(model=req.model, messages=msgspec.convert(chat_messages(req), list[Message]),
                       max_tokens=req.max_tokens, stream=req.stream, temperature=req.temperature,
                       top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences, ignore_eos=req.ignore_eos)


# ----------------------------------------------------------------------------- responses
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "eos": "end_turn", "tool_calls": "tool_use"}


def stop_reason(finish: str | None) -> str:
    """The engine's finish reason as Anthropic's ``stop_reason``."""
    return STOP_REASONS.get(finish or "length", "end_turn")


@dataclass(frozen=True)
class Reply:
    """What a ``/v1/messages`` answer says besides the text: ids, usage, our extension."""

    id: str
    model: str
    prompt_tokens: int
    cache_read: int  # prompt tokens the chosen node already held (RouteDecided.t_c), <= prompt_tokens
    extension: dict[str, Any]

    def usage(self, output_tokens: int) -> dict[str, Any]:
        cached = min(self.cache_read, self.prompt_tokens)
        return {"input_tokens": self.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": output_tokens}

    def message(self, text: str, output_tokens: int, finish: str | None, *, streaming: bool = False,
                pieces: list[Piece] | None = None) -> dict:
        """The ``message`` object: the full response, or (``streaming``) message_start's skeleton.
        ``pieces``: the text and tool calls in order (one block each), instead of ``text``."""
        content = content_blocks(pieces if pieces is not None else [text])
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": [] if streaming else content,
                "stop_reason": None if streaming else stop_reason(finish), "stop_sequence": None,
                "usage": self.usage(output_tokens), "evolving": self.extension}

    # the event sequence: start, the blocks (Blocks), end, then message_stop
    def start(self, output_tokens: int, blocks: Blocks) -> bytes:
        """message_start, then (unless ``blocks.lazy``: a tool-call parser decides what comes
        first) the first text block's start, then a ping."""
        head = sse("message_start", {"type": "message_start",
                                     "message": self.message("", output_tokens, None, streaming=True)})
        return head + (b"" if blocks.lazy else blocks.open_text()) + sse("ping", {"type": "ping"})

    def end(self, output_tokens: int, finish: str | None) -> bytes:
        return (sse("message_delta", {"type": "message_delta",
                                        "delta": {"stop_reason": stop_reason(finish), "stop_sequence": None},
                                        "usage": self.usage(output_tokens)}))

    @staticmethod
    def stop() -> bytes:
        return sse("message_stop", {"type": "message_stop"})


def tool_use(c: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + c.id.removeprefix("call_"), "name": c.name, "input": c.input()}


def content_blocks(pieces: list[Piece]) -> list[dict[str, Any]]:
    """Text and tool calls in order as content blocks: adjacent text one ``text`` block (none
    for empty text), each call a ``tool_use`` block."""
    out: list[dict[str, Any]] = []
    for p in pieces:
        if isinstance(p, ToolCall):
            out.append(tool_use(p))
        elif p and out and out[-1]["type"] == "text":
            out[-1]["text"] += p
        elif p:
            out.append({"type": "text", "text": p})
    return out


@dataclass
class Blocks:
    """The content blocks of a streamed answer, numbered in order: a text block opened by the
    first text after a call (or at the start), each tool call a whole block (start, one
    ``input_json_delta`` with its arguments, stop). ``lazy``: the first block opens with what
    comes first; an answer that ends with no block at all gets one empty text block."""

    lazy: bool = False
    index: int = 0
    open: bool = False

    def open_text(self) -> bytes:
        self.open = True
        return sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                           "content_block": {"type": "text", "text": ""}})

    def text(self, text: str) -> bytes:
        if not text:
            return b""
        head = b"" if self.open else self.open_text()
        return head + sse("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                                  "delta": {"type": "text_delta", "text": text}})

    def call(self, c: ToolCall) -> bytes:
        out, i = self.close(), self.index
        self.index += 1
        return out + (sse("content_block_start", {"type": "content_block_start", "index": i,
                                                  "content_block": {**tool_use(c), "input": {}}})
                      + sse("content_block_delta", {"type": "content_block_delta", "index": i,
                                                    "delta": {"type": "input_json_delta", "partial_json": c.arguments}})
                      + sse("content_block_stop", {"type": "content_block_stop", "index": i}))

    def pieces(self, pieces: list[Piece]) -> bytes:
        return b"".join(self.call(p) if isinstance(p, ToolCall) else self.text(p) for p in pieces)

    def close(self) -> bytes:
        if not self.open:
            return b""
        self.open = False
        self.index += 1
        return sse("content_block_stop", {"type": "content_block_stop", "index": self.index - 1})

    def end(self) -> bytes:
        """The last block's stop (an empty text block when there was none)."""
        return (self.open_text() if self.index == 0 and not self.open else b"") + self.close()


def sse(event: str, data: dict) -> bytes:
    """One server-sent event as Anthropic sends it: ``event: <type>`` then ``data: <json>``."""
    return f"event: {event}\ndata: ".encode() + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


# ----------------------------------------------------------------------------- errors
#: HTTP status -> Anthropic error type (any other 4xx: invalid_request_error, 5xx: api_error).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               502: "api_error", 503: "overloaded_error", 504: "api_error", 529: "overloaded_error"}


def context_error(context: int, prompt: int, max_tokens: int | None) -> ApiError:
    """Anthropic's context-limit errors (its API's wording), a 400 ``invalid_request_error``."""
    if not max_tokens or prompt >= context:
        return ApiError(400, f"prompt is too long: {prompt} tokens > {context - 1} maximum", "messages",
                        code="context_length_exceeded")
    return ApiError(400, f"input length and `max_tokens` exceed context limit: {prompt} + {max_tokens} > {context}, "
                         "decrease input length or `max_tokens` and try again", "messages",
                    code="context_length_exceeded")


def error_body(exc: ApiError) -> dict:
    kind = ERROR_TYPES.get(exc.status, "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_event(exc: ApiError) -> bytes:
    return sse("error", error_body(exc))
