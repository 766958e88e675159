"""The gateway's OpenAPI 3.1 description, served as ``GET /openapi.json`` (pure: msgspec + stdlib).

Generated, so it cannot drift from the code:

- **request bodies**: ``msgspec.json.schema_components`` of the Structs the routes decode into
  (``api.ChatRequest`` / ``api.CompletionRequest``, ``anthropic_api.MessagesRequest`` /
  ``anthropic_api.CountTokensRequest``);
- **response bodies**: the Structs below, which the app's dict builders are checked against
  (``tests/unit/drivers/gateway/test_openapi.py`` converts real responses into them with
  ``forbid_unknown_fields``, and the fuzz run checks live responses against the schema);
- **headers**: the names in ``headers.py`` (``FAMILIES``, ``END_HEADERS``, ...).

Hand-written, because the types cannot say it: a top-level unknown field is accepted and
ignored (``convert`` drops it and the app counts it; the request bodies allow additional
properties), the known ``nvext.agent_hints`` (``AgentHints``; other hints are ignored), the
served model names when ``--served-model-name`` restricts them and the ``max_tokens`` limit (an
``enum`` / a ``maximum`` from the configuration when the app builds the description: another
model is a 404, a larger budget a 400), the security schemes, the media types (SSE) and which
status codes each route answers.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

from services.drivers.gateway import anthropic_api, api, headers, responses_api

REF = "#/components/schemas/{name}"


# ----------------------------------------------------------------------------- response Structs
class PromptTokensDetails(Struct, forbid_unknown_fields=True):
    cached_tokens: int


class Usage(Struct, forbid_unknown_fields=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Evolving(Struct, forbid_unknown_fields=True):
    """Our extension on every response: the request, its branch and where it ran."""

    request: str
    branch: str
    version: int
    prompt_blocks: int
    simulated: bool
    prefill_node: str | UnsetType = UNSET
    decode_node: str | UnsetType = UNSET
    policy: str | UnsetType = UNSET
    note: str | UnsetType = UNSET
    unapplied: list[str] | UnsetType = UNSET  # accepted parameters the engine did not apply
    unserved_tools: list[str] | UnsetType = UNSET  # tool types left out of the prompt (hosted tools)


class AssistantMessage(Struct, forbid_unknown_fields=True):
    role: Literal["assistant"]
    content: str


class ChatChoice(Struct, forbid_unknown_fields=True):
    index: int
    message: AssistantMessage
    finish_reason: str


class ChatCompletion(Struct, forbid_unknown_fields=True):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    evolving: Evolving


class CompletionChoice(Struct, forbid_unknown_fields=True):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class Completion(Struct, forbid_unknown_fields=True):
    """``text_completion``: the full body, and (``finish_reason`` null until the last) a chunk."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | UnsetType = UNSET
    evolving: Evolving | UnsetType = UNSET


class ChunkDelta(Struct, forbid_unknown_fields=True):
    content: str
    role: Literal["assistant"] | UnsetType = UNSET


class ChunkChoice(Struct, forbid_unknown_fields=True):
    index: int
    delta: ChunkDelta
    finish_reason: str | None


class ChatCompletionChunk(Struct, forbid_unknown_fields=True):
    """One ``data:`` event of a streamed chat completion (``choices`` empty in the usage chunk)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | UnsetType = UNSET
    evolving: Evolving | UnsetType = UNSET


class ModelCard(Struct, forbid_unknown_fields=True):
    """OpenAI's model object and Anthropic's (``type``, ``display_name``, ``created_at``) at once."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    type: Literal["model"]
    display_name: str
    created_at: str


class ModelList(Struct, forbid_unknown_fields=True):
    """OpenAI's list and Anthropic's page (``has_more``, ``first_id``, ``last_id``) at once."""

    object: Literal["list"]
    data: list[ModelCard]
    has_more: bool
    first_id: str | None
    last_id: str | None


class BusState(Struct, forbid_unknown_fields=True):
    kind: str
    connected: bool
    reconnecting: bool | UnsetType = UNSET
    server: str | None | UnsetType = UNSET


class StreamConsumer(Struct, forbid_unknown_fields=True):
    """One reader of the stream as JetStream sees it (services/drivers/gateway/consumers.py)."""

    name: str
    durable: bool
    filter: str
    pending: int
    position: int
    delivered: int
    ack_floor: int
    state: Literal["ok", "stuck", "lagging"]
    unmoved_s: float


class GatewayWatch(Struct, forbid_unknown_fields=True):
    """One of the gateway's own stream readers: what it handled, refused, and its last error."""

    subjects: str
    last_seq: int
    handled: int
    refused: int
    restarts: int
    error: str | None
    last_refusal: str | None


class Hello(Struct, forbid_unknown_fields=True):
    """``/api/hello``: Claude Code's connectivity probe; any 2xx passes it."""
    message: str


class Health(Struct, forbid_unknown_fields=True):
    status: Literal["ok", "degraded", "bus_unavailable"]
    partition: str
    partitions: list[str]
    bus: BusState
    tokenizer: str  # a line: what the gateway tokenises with, and from where
    tokenizer_name: str  # "bytes" for the byte-level tokenizer, else the model's (e.g. gguf:<file>)
    vocab_size: int  # the tokenizer's ids are below it (256 for bytes)
    auth: bool
    context_length: int
    max_body_bytes: int
    open_branches: int
    in_flight: int
    stuck: list[str]  # stream readers with messages waiting that have not moved for 4 s
    lagging: list[str]  # stream readers with more than 5000 messages waiting
    consumers: dict[str, StreamConsumer]
    watches: dict[str, GatewayWatch]


class OpenAIErrorDetail(Struct, forbid_unknown_fields=True):
    message: str
    type: str
    param: str | None
    code: str


class OpenAIError(Struct, forbid_unknown_fields=True):
    """Every error on the OpenAI routes (and on ``/health``, ``/metrics``, unknown paths)."""

    error: OpenAIErrorDetail


class AnthropicText(Struct, forbid_unknown_fields=True):
    type: Literal["text"]
    text: str


class AnthropicUsage(Struct, forbid_unknown_fields=True):
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class AnthropicMessage(Struct, forbid_unknown_fields=True):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicText]
    stop_reason: Literal["end_turn", "max_tokens", "tool_use"] | None
    stop_sequence: None
    usage: AnthropicUsage
    evolving: Evolving


class CountTokensResponse(Struct, forbid_unknown_fields=True):
    input_tokens: int


AnthropicErrorType = Literal["invalid_request_error", "authentication_error", "permission_error",
                             "not_found_error", "request_too_large", "rate_limit_error", "api_error",
                             "overloaded_error"]


class AnthropicErrorDetail(Struct, forbid_unknown_fields=True):
    type: AnthropicErrorType
    message: str


class AnthropicError(Struct, forbid_unknown_fields=True, tag_field="type", tag="error"):
    """Every error on ``/v1/messages*``: Anthropic's shape (also the ``error`` event of a stream)."""

    error: AnthropicErrorDetail


# Anthropic's stream: one Struct per event type (the ``type`` field is the SSE ``event:`` name).
class MessageStart(Struct, forbid_unknown_fields=True, tag_field="type", tag="message_start"):
    message: AnthropicMessage


class ContentBlockStart(Struct, forbid_unknown_fields=True, tag_field="type", tag="content_block_start"):
    index: int
    content_block: AnthropicText


class Ping(Struct, forbid_unknown_fields=True, tag_field="type", tag="ping"):
    pass


class TextDelta(Struct, forbid_unknown_fields=True, tag_field="type", tag="text_delta"):
    text: str


class ContentBlockDelta(Struct, forbid_unknown_fields=True, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta


class ContentBlockStop(Struct, forbid_unknown_fields=True, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(Struct, forbid_unknown_fields=True):
    stop_reason: Literal["end_turn", "max_tokens", "tool_use"]
    stop_sequence: None


class MessageDelta(Struct, forbid_unknown_fields=True, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: AnthropicUsage


class MessageStop(Struct, forbid_unknown_fields=True, tag_field="type", tag="message_stop"):
    pass


AnthropicStreamEvent = (MessageStart | ContentBlockStart | Ping | ContentBlockDelta | ContentBlockStop
                        | MessageDelta | MessageStop | AnthropicError)
ANTHROPIC_EVENTS = [cls.__struct_config__.tag for cls in AnthropicStreamEvent.__args__]


# The Responses API (responses_api.py): the response object, its output items, its events.
class ResponsesInputTokensDetails(Struct, forbid_unknown_fields=True):
    cached_tokens: int
    cache_write_tokens: int


class ResponsesOutputTokensDetails(Struct, forbid_unknown_fields=True):
    reasoning_tokens: int


class ResponsesUsage(Struct, forbid_unknown_fields=True):
    input_tokens: int  # the whole prompt; cached_tokens of it had their KV reused
    input_tokens_details: ResponsesInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponsesOutputTokensDetails
    total_tokens: int


class OutputText(Struct, forbid_unknown_fields=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(Struct, forbid_unknown_fields=True, tag_field="type", tag="message"):
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(Struct, forbid_unknown_fields=True, tag_field="type", tag="function_call"):
    """An output item a tool-call parser adds (``ResponseBuilder.add_item``)."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus
    namespace: str | UnsetType = UNSET  # the call of a namespace tool's function (responses_api.flat_name)


OutputItem = OutputMessage | OutputFunctionCall


class ResponseErrorDetail(Struct, forbid_unknown_fields=True):
    code: str
    message: str


class IncompleteDetails(Struct, forbid_unknown_fields=True):
    reason: Literal["max_output_tokens"]


class ResponseObject(Struct, forbid_unknown_fields=True):
    """``POST /v1/responses`` (non-streaming), ``GET /v1/responses/{id}`` and every event that
    carries the response; the request's fields are echoed as OpenAI does."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: bool
    error: ResponseErrorDetail | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    max_tool_calls: None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    prompt_cache_key: str | None
    reasoning: dict[str, Any]
    service_tier: str
    store: bool
    temperature: float | None
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: str
    usage: ResponsesUsage | None
    user: str | None
    metadata: dict[str, Any]
    evolving: Evolving


class _ResponseEvent(Struct, forbid_unknown_fields=True, tag_field="type"):
    sequence_number: int
    response: ResponseObject


class ResponseCreated(_ResponseEvent, tag="response.created"):
    pass


class ResponseInProgress(_ResponseEvent, tag="response.in_progress"):
    pass


class ResponseCompleted(_ResponseEvent, tag="response.completed"):
    pass


class ResponseIncomplete(_ResponseEvent, tag="response.incomplete"):
    pass


class ResponseFailed(_ResponseEvent, tag="response.failed"):
    pass


class _ItemEvent(Struct, forbid_unknown_fields=True, tag_field="type"):
    sequence_number: int
    output_index: int
    item: OutputItem


class OutputItemAdded(_ItemEvent, tag="response.output_item.added"):
    pass


class OutputItemDone(_ItemEvent, tag="response.output_item.done"):
    pass


class _PartEvent(Struct, forbid_unknown_fields=True, tag_field="type"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class ContentPartAdded(_PartEvent, tag="response.content_part.added"):
    pass


class ContentPartDone(_PartEvent, tag="response.content_part.done"):
    pass


class OutputTextDelta(Struct, forbid_unknown_fields=True, tag_field="type", tag="response.output_text.delta"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]]


class OutputTextDone(Struct, forbid_unknown_fields=True, tag_field="type", tag="response.output_text.done"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]]


class ResponseErrorEvent(Struct, forbid_unknown_fields=True, tag_field="type", tag="error"):
    """A failure after the stream started (then ``response.failed``)."""

    sequence_number: int
    code: str
    message: str
    param: str | None


ResponsesStreamEvent = (ResponseCreated | ResponseInProgress | OutputItemAdded | ContentPartAdded | OutputTextDelta
                        | OutputTextDone | ContentPartDone | OutputItemDone | ResponseCompleted | ResponseIncomplete
                        | ResponseFailed | ResponseErrorEvent)
RESPONSES_EVENTS = [cls.__struct_config__.tag for cls in ResponsesStreamEvent.__args__]


REQUESTS: tuple[type[Struct], ...] = (api.ChatRequest, api.CompletionRequest, anthropic_api.MessagesRequest,
                                      anthropic_api.CountTokensRequest, responses_api.ResponsesRequest)
RESPONSES: tuple[type[Struct], ...] = (ChatCompletion, ChatCompletionChunk, Completion, ModelList, ModelCard,
                                       Health, Hello, OpenAIError, AnthropicMessage, CountTokensResponse,
                                       AnthropicError, ResponseObject)


# ----------------------------------------------------------------------------- headers
def _id_header(name: str, what: str) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": False, "description": what,
            "schema": {"type": "string", "minLength": 1, "maxLength": headers.MAX_ID_LEN,
                       "pattern": "^[^\\u0000-\\u001f]+$"}}


_BOOL = ["true", "false", "1", "0", "yes", "no", "on", "off"]


def _bool_header(name: str, what: str) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": False,
            "description": what + " Booleans: 1/true/yes/on, 0/false/no/off, any case; anything else is a 400.",
            "schema": {"type": "string", "enum": _BOOL}}


def branch_headers() -> list[dict[str, Any]]:
    """The branch signals of docs/gateway.md ("Branch headers"), first family first."""
    out: list[dict[str, Any]] = []
    for fam in headers.FAMILIES:
        out.append(_id_header(fam.branch, f"The branch (family `{fam.source}`; the first family present wins)."))
        if fam.child is not None:
            out.append(_id_header(fam.child, f"A sub-agent of the `{fam.branch}` session (family `{fam.source}`)."))
        if fam.parent is not None:
            out.append(_id_header(fam.parent, f"The parent branch (family `{fam.source}`); needs `{fam.branch}`."))
    out.append({"name": headers.H_MODE, "in": "header", "required": False,
                "description": "How a child starts: `fork` reuses the parent's context, `subagent` starts fresh "
                               "(the default). Needs a parent header.",
                "schema": {"type": "string", "enum": ["fork", "subagent"]}})
    for name in headers.END_HEADERS:
        out.append(_bool_header(name, "True: this request ends its branch (`BranchEnded` after the response)."))
    out.append(_bool_header(headers.H_COMPACTED, "True: the harness rewrote the context (a version bump)."))
    return out


ANTHROPIC_HEADERS = [
    {"name": "anthropic-version", "in": "header", "required": False,
     "description": "Sent by Anthropic's clients; accepted and not checked.", "schema": {"type": "string"}},
    {"name": "anthropic-beta", "in": "header", "required": False,
     "description": "Accepted and ignored.", "schema": {"type": "string"}},
]

_RESPONSE_HEADERS = {
    "x-branch-id": "The request's branch (also on a headerless request: `gw-<instance>-<n>`).",
    "x-request-id": "The request id, `<branch>/<gateway instance>-<n>` (absent on a branch-end request).",
    "x-prefill-node": "The node the router chose for the prefill.",
    "x-decode-node": "The node the router chose for the decode.",
    "x-evolving-unapplied": "Accepted parameters the engine did not apply, comma-separated.",
    "x-evolving-unserved-tools": "The types of the request's tools this gateway cannot serve (hosted tools: web "
                                 "search, code execution, ...), left out of the prompt, comma-separated.",
}


def _response_headers(anthropic: bool) -> dict[str, Any]:
    out = {name: {"description": what, "schema": {"type": "string"}} for name, what in _RESPONSE_HEADERS.items()}
    if anthropic:
        out["request-id"] = {"description": "As `x-request-id` (Anthropic's name).", "schema": {"type": "string"}}
    return out


# ----------------------------------------------------------------------------- responses
def _json(name: str) -> dict[str, Any]:
    return {"application/json": {"schema": {"$ref": REF.format(name=name)}}}


ERRORS = {
    400: "A bad or unreadable body, parameter or header (`error.param` names it), or "
         "`context_length_exceeded`.",
    401: "A missing or wrong API key (only when keys are configured).",
    404: "A model name `--served-model-name` does not list (`model_not_found`).",
    409: "The branch has ended (`branch_ended`): use a new id.",
    413: "The body is larger than `--max-body-mb`.",
    417: "An `Expect` header other than `100-continue`.",
    500: "A bug in the gateway (`internal_error`).",
    502: "The engine failed the request.",
    503: "No `RouteDecided` within `--route-timeout-s`, or the event bus is unavailable.",
    504: "No tokens from the engine within `--token-timeout-s`.",
}
SERVE = (400, 401, 404, 409, 413, 417, 500, 502, 503, 504)  # the routes that publish a request
COUNT = (400, 401, 404, 413, 417, 500)


def _errors(codes: tuple[int, ...], error: str) -> dict[str, Any]:
    return {str(c): {"description": ERRORS[c], "content": _json(error)} for c in codes}


def _json_data(*names: str) -> dict[str, Any]:
    """An SSE ``data`` field that holds JSON of one of the ``names`` schemas."""
    refs = [{"$ref": REF.format(name=n)} for n in names]
    return {"type": "string", "contentMediaType": "application/json",
            "contentSchema": refs[0] if len(refs) == 1 else {"anyOf": refs}}


def _sse_openai(chunk: str) -> dict[str, Any]:
    """OpenAI's stream: ``data: <chunk>`` (or an error body) events, then ``data: [DONE]``. The
    ``schema`` of an event stream describes one event (OpenAPI 3.1: ``data`` / ``event`` / ``id``)."""
    data = {"anyOf": [{"const": "[DONE]"}, _json_data(chunk, "OpenAIError")]}
    return {"text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                             "properties": {"data": data, "event": {"const": "message"}}}}}


def _sse_anthropic() -> dict[str, Any]:
    """Anthropic's stream: ``event: <type>`` / ``data: <json of that type>`` frames."""
    return _sse_named(ANTHROPIC_EVENTS, "AnthropicStreamEvent")


def _sse_named(events: list[str], union: str) -> dict[str, Any]:
    """A stream of ``event: <type>`` / ``data: <json of that type>`` frames (Anthropic's, and
    OpenAI's Responses API)."""
    return {"text/event-stream": {"schema": {
        "type": "object", "required": ["event", "data"],
        "properties": {"event": {"type": "string", "enum": events}, "data": _json_data(union)}}}}


_OPENAI_SSE = ("`stream: true`: `data: <chunk>` events (the `{chunk}` schema; with "
               "`stream_options.include_usage`, a last chunk with empty `choices` and `usage`), then "
               "`data: [DONE]`. An error after the first byte is a `data: {{\"error\": ...}}` event.")
_RESPONSES_SSE = ("`stream: true`: `event:`/`data:` frames: response.created, response.in_progress, then per "
                  "output item response.output_item.added, response.content_part.added, "
                  "response.output_text.delta..., response.output_text.done, response.content_part.done, "
                  "response.output_item.done, and last response.completed (response.incomplete when "
                  "`max_output_tokens` ran out); an error after the first byte is an `error` frame, then "
                  "response.failed.")
_ANTHROPIC_SSE = ("`stream: true`: Anthropic's `event:`/`data:` frames: message_start, content_block_start, "
                  "ping, content_block_delta..., content_block_stop, message_delta, message_stop; an error "
                  "after the first byte is an `event: error` frame.")


def _post(summary: str, body: str, ok: dict[str, Any], codes: tuple[int, ...], error: str, tag: str,
          params: list[dict[str, Any]], anthropic: bool) -> dict[str, Any]:
    return {"summary": summary, "tags": [tag], "parameters": params,
            "requestBody": {"required": True, "content": _json(body)},
            "responses": {"200": {"headers": _response_headers(anthropic), **ok},
                          **_errors(codes, error)}}


def _get(summary: str, content: dict[str, Any], extra: dict[str, Any] | None = None,
         security: bool = True, params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": summary, "tags": ["gateway" if not security else "openai"],
                          "responses": {"200": {"description": "OK", "content": content}, **(extra or {})}}
    if params:
        op["parameters"] = params
    if not security:
        op["security"] = []  # probes and Prometheus never need a key
    return op


# ----------------------------------------------------------------------------- the document
def _components() -> dict[str, Any]:
    (*_, anthropic_stream, responses_stream), comps = msgspec.json.schema_components((*REQUESTS, *RESPONSES, api.AgentHints,
                                                          AnthropicStreamEvent, ResponsesStreamEvent),
                                                         ref_template=REF)
    comps["AnthropicStreamEvent"] = {"title": "AnthropicStreamEvent", **anthropic_stream}
    comps["ResponsesStreamEvent"] = {"title": "ResponsesStreamEvent", **responses_stream}
    for cls in REQUESTS:  # convert() drops an unknown top-level field (counted, never a 400)
        comps[cls.__name__]["additionalProperties"] = True
    # a response needs something to respond to (responses_api.prompt_messages): an input, a
    # stored conversation or instructions; anything else is a 400 missing_required_parameter
    comps["ResponsesRequest"]["anyOf"] = [
        {"required": ["input"], "properties": {"input": {"type": ["string", "array"], "minItems": 1}}},
        {"required": ["instructions"], "properties": {"instructions": {"type": "string", "minLength": 1}}},
        {"required": ["previous_response_id"]}]
    comps["NvExt"]["properties"]["agent_hints"] = {
        "anyOf": [{"$ref": REF.format(name="AgentHints")}, {"type": "null"}], "default": None,
        "description": "Known hints are checked; any other hint name is ignored (and counted)."}
    return comps


def _served_model(comps: dict[str, Any], models: list[str]) -> None:
    """The model names this gateway serves when they are restricted: another is a 404 ``model_not_found``."""
    for name in ("ChatRequest", "CompletionRequest", "ResponsesRequest"):
        comps[name]["properties"]["model"] = {"anyOf": [{"type": "string", "enum": models}, {"type": "null"}],
                                              "default": None}
    for name in ("MessagesRequest", "CountTokensRequest"):
        comps[name]["properties"]["model"] = {"type": "string", "enum": models}


def _max_tokens_limit(comps: dict[str, Any], limit: int) -> None:
    """``max_tokens`` over the gateway's limit (``GatewayConfig.max_tokens_limit``) is a 400."""
    for name, fields in (("ChatRequest", ("max_tokens", "max_completion_tokens")),
                         ("CompletionRequest", ("max_tokens", "max_completion_tokens")),
                         ("MessagesRequest", ("max_tokens",)), ("ResponsesRequest", ("max_output_tokens",))):
        for f in fields:
            prop = comps[name]["properties"][f]
            for branch in prop.get("anyOf", [prop]):
                if branch.get("type") == "integer":
                    branch["maximum"] = limit


def build(model: str | list[str] | None = None, max_tokens_limit: int | None = None,
          version: str = "0.1.0") -> dict[str, Any]:
    """The OpenAPI 3.1 document; ``model``: the model names served when they are restricted (an
    ``enum`` in the bodies; None: any name), ``max_tokens_limit``: the largest ``max_tokens`` it
    accepts (a ``maximum``)."""
    comps = _components()
    if model is not None:
        _served_model(comps, [model] if isinstance(model, str) else list(model))
    if max_tokens_limit is not None:
        _max_tokens_limit(comps, max_tokens_limit)
    branch = branch_headers()
    chat = _post("OpenAI chat completions", "ChatRequest",
                 {"description": "The completion; " + _OPENAI_SSE.format(chunk="ChatCompletionChunk"),
                  "content": {**_json("ChatCompletion"), **_sse_openai("ChatCompletionChunk")}},
                 SERVE, "OpenAIError", "openai", branch, anthropic=False)
    completions = _post("OpenAI completions", "CompletionRequest",
                        {"description": "The completion; " + _OPENAI_SSE.format(chunk="Completion"),
                         "content": {**_json("Completion"), **_sse_openai("Completion")}},
                        SERVE, "OpenAIError", "openai", branch, anthropic=False)
    messages = _post("Anthropic Messages API", "MessagesRequest",
                     {"description": "The message; " + _ANTHROPIC_SSE,
                      "content": {**_json("AnthropicMessage"), **_sse_anthropic()}},
                     SERVE, "AnthropicError", "anthropic", branch + ANTHROPIC_HEADERS, anthropic=True)
    count = _post("The input tokens of the rendered prompt; nothing is published", "CountTokensRequest",
                  {"description": "The count.", "content": _json("CountTokensResponse")}, COUNT,
                  "AnthropicError", "anthropic", ANTHROPIC_HEADERS, anthropic=False)
    count["responses"]["200"].pop("headers")
    unauthorized = _errors((401,), "OpenAIError")
    responses = _post("OpenAI Responses API", "ResponsesRequest",
                      {"description": "The response; " + _RESPONSES_SSE,
                       "content": {**_json("ResponseObject"), **_sse_named(RESPONSES_EVENTS, "ResponsesStreamEvent")}},
                      SERVE, "OpenAIError", "openai", branch, anthropic=False)
    response_param = [{"name": "response_id", "in": "path", "required": True, "description": "A response's `id`.",
                       "schema": {"type": "string", "minLength": 1}}]
    stored = {"404": {"description": "Not stored: `store: false`, evicted or expired (`not_found`).",
                      "content": _json("OpenAIError")}}
    model_param = [{"name": "model", "in": "path", "required": True,
                    "description": "A model id (it may contain `/`).", "schema": {"type": "string", "minLength": 1}}]
    paths = {
        "/v1/chat/completions": {"post": chat},
        "/v1/completions": {"post": completions},
        "/v1/messages": {"post": messages},
        "/v1/messages/count_tokens": {"post": count},
        responses_api.PATH: {"post": responses},
        responses_api.PATH + "/{response_id}": {"get": _get("A stored response", _json("ResponseObject"),
                                                            {**unauthorized, **stored}, params=response_param)},
        "/v1/models": {"get": _get("The served model", _json("ModelList"), unauthorized)},
        "/v1/models/{model}": {"get": _get("One model's card", _json("ModelCard"),
                                           {**unauthorized, **_errors((404,), "OpenAIError")},
                                           params=model_param)},
        "/health": {"get": _get("Liveness and the bus connection", _json("Health"),
                                {"503": {"description": "The event bus is unreachable.",
                                         "content": _json("Health")}}, security=False)},
        "/api/hello": {"get": _get("Claude Code's connectivity probe (it sends HEAD before its first request)",
                                   _json("Hello"), security=False)},
        "/metrics": {"get": _get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}},
                                 security=False)},
        "/openapi.json": {"get": _get("This description", {"application/json": {"schema": {"type": "object"}}},
                                      security=False)},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "evolving-infra gateway", "version": version,
                 "description": "OpenAI- and Anthropic-compatible HTTP in, harness events out (docs/gateway.md). "
                                "Errors: OpenAI's shape, except Anthropic's on /v1/messages*."},
        "paths": paths,
        "components": {
            "schemas": comps,
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "`Authorization: Bearer KEY`."},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key",
                           "description": "Anthropic's clients send this; checked first when both are present."},
            },
        },
        # Keys are optional (`--api-keys-file`, `EI_API_KEYS`): without them every route is open.
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }
