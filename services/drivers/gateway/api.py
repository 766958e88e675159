"""The OpenAI request bodies as msgspec Structs, the error shape, and the request checks.

Pure (msgspec + stdlib): the aiohttp app (``services.drivers.gateway.app``) reads the bytes and calls
:func:`parse_chat` / :func:`parse_completion`; everything here raises :class:`ApiError`, which
the app answers as OpenAI-style JSON::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "invalid_value"}}

``code`` is always a string (OpenAI's clients switch on it); ``param`` names the field with
the path msgspec reports (``messages[2].role``, ``stream_options.include_usage``) or the
header (``x-branch-mode``), or is ``null`` when no single field is at fault.

Parameters fall in three groups (docs/gateway.md, "Parameters"):

- **honoured**: ``model``, ``messages`` / ``prompt``, ``max_tokens`` / ``max_completion_tokens``,
  ``stream``, ``stream_options.include_usage``, ``stream_options.continuous_usage_stats`` (vLLM's and
  SGLang's: usage on every chunk), ``n: 1``, ``ignore_eos``, ``min_tokens``,
  ``tools`` (function definitions, rendered into the prompt by the chat template),
  ``tool_choice`` (``"none"`` / ``"auto"``; ``"required"`` or a named function: the engine's
  output is constrained to one call, ``constraints``), ``response_format`` ``json_object`` /
  ``json_schema`` (constrained to a valid value), and the sampling parameters the engines apply,
  carried on ``RequestSubmitted`` (:func:`sampling_fields`): ``temperature``, ``top_p``,
  ``top_k``, ``seed``, ``stop``.
- **refused** with a 400 naming them when set to anything but their neutral value, because the
  gateway cannot honour them: ``n > 1``, ``best_of > 1``, ``logprobs``, ``top_logprobs``,
  ``echo``, ``suffix``, ``functions``, ``function_call`` (the legacy names of tools),
  ``response_format`` (other than text, json_object, json_schema), ``logit_bias``, ``modalities`` (other than text),
  ``audio``, ``prediction``, ``web_search_options``.
- **accepted, not applied**: the other sampling parameters (``min_p``, ``presence_penalty``,
  ``frequency_penalty``, ``repetition_penalty``) are range-checked, then listed in the response's
  ``evolving.unapplied`` and the ``x-evolving-unapplied`` header, since the engine generates its
  tokens without them; and
  bookkeeping fields with no effect on a response (``user``, ``metadata``, ``store``,
  ``service_tier``, ``parallel_tool_calls``, ``reasoning_effort``).

Any other top-level field is **ignored**: dropped before validation, its name counted in
``ei_gateway_ignored_fields_total{api, field}`` and logged once per name (``ignored_fields``),
never a 400: agent clients send fields newer than this gateway, and a 400 stops them at their
first request. So are vLLM's and SGLang's own request fields this gateway does not apply
(:data:`PEER_FIELDS`: ``skip_special_tokens``, ``add_special_tokens``, ``stop_token_ids``, ...: a
benchmark client written for those servers sends them), and unknown keys inside
``stream_options`` (counted as ``stream_options.<key>``). The known fields keep their strict type
and range checks.

Bad input (docs/gateway.md, "Bad input"): a body nested deeper than :data:`MAX_JSON_DEPTH` is a
400 ``json_too_deep`` before it is decoded (``events.jsondepth`` scans the bytes), and whatever
a client sent that an error repeats (a model name, a field name, a header value) is cut to
:data:`MAX_ECHO_CHARS` by :func:`clip`; no message is longer than :data:`MAX_MESSAGE_CHARS`.
"""

from __future__ import annotations

import array
import json
import re
import sys
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from events.jsondepth import too_deep

# ----------------------------------------------------------------------------- errors
#: The deepest JSON nesting a request body may have. Real clients stay far below it (a Claude
#: Code request with its tool schemas nests ~10-20 deep); Python's decoders and the recursive
#: code after them (the chat template, json.dumps of tool inputs) fail near 1,000.
MAX_JSON_DEPTH = 128
MAX_ECHO_CHARS = 256  # of one value a client sent, repeated in an error
MAX_MESSAGE_CHARS = 2048  # of any error message


def clip(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """``text`` as an error may repeat it: whole up to ``limit`` characters, else its first
    ``limit``, an ellipsis and its length (``'mmmm… (7000000 chars)'``)."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} chars)"

DEFAULT_CODES = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                 409: "conflict", 413: "request_too_large", 500: "internal_error", 502: "engine_error",
                 503: "service_unavailable", 504: "timeout"}
DEFAULT_TYPES = {401: "authentication_error", 404: "invalid_request_error", 500: "server_error",
                 502: "engine_error", 503: "service_unavailable", 504: "timeout"}


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` (code: a string)."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None) -> None:
        message = clip(message, MAX_MESSAGE_CHARS)
        super().__init__(message)
        self.status, self.message, self.param = status, message, None if param is None else clip(param)
        self.type = type_ or DEFAULT_TYPES.get(status, "invalid_request_error")
        self.code = code or DEFAULT_CODES.get(status, "error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ----------------------------------------------------------------------------- the Structs
NonNegInt = Annotated[int, Meta(ge=0)]
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class StreamOptions(Struct):
    """``stream_options``: ``include_usage`` (a last chunk with ``usage``, OpenAI) and
    ``continuous_usage_stats`` (vLLM's and SGLang's extension: with ``include_usage``, a ``usage``
    object on every chunk, its ``completion_tokens`` counting so far; vLLM's rule, which aiperf's
    ``--per-chunk-usage`` relies on). Other keys are ignored and counted (:func:`convert`)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(Struct):
    """``{"type": "text", "text": ...}``; other part types (images, audio) render as ``[<type>]``."""

    type: str
    text: str | None = None


class Message(Struct):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionDef(Struct):
    """A function tool's definition (OpenAI ``tools[].function``)."""

    name: Annotated[str, Meta(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Struct):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(Struct):
    name: Annotated[str, Meta(min_length=1)]


class NamedToolChoice(Struct):
    type: Literal["function"]
    function: ToolChoiceFunction


class AgentHints(Struct, kw_only=True):
    """Dynamo's ``nvext.agent_hints`` (docs.nvidia.com/dynamo, "Agent Hints"): ``priority``
    (higher is served earlier), ``osl`` (expected output tokens), ``speculative_prefill``
    (accepted, not applied). Other hint names are ignored (and counted): :func:`agent_hints`."""

    priority: int | None = None
    osl: NonNegInt | None = None
    speculative_prefill: bool | None = None


AGENT_HINTS = ("priority", "osl", "speculative_prefill")


class NvExt(Struct, forbid_unknown_fields=True):
    """The ``nvext`` extension object; only ``agent_hints`` (any other field is a 400)."""

    agent_hints: dict[str, Any] | None = None


class _Common(Struct, kw_only=True):
    model: str | None = None
    nvext: NvExt | None = None
    max_tokens: NonNegInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Meta(ge=1)] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool | None = None
    min_tokens: NonNegInt | None = None
    # sampling: carried to the engine (temperature, top_p, top_k, seed, stop) or accepted and
    # range-checked, not applied (the module docstring)
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0)] | None = None
    stop: str | list[str] | None = None


class ChatRequest(_Common, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool | None = None
    top_logprobs: NonNegInt | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[str | TokenId]
    max_completion_tokens: NonNegInt | None = None
    best_of: Annotated[int, Meta(ge=1)] | None = None
    logprobs: NonNegInt | None = None
    echo: bool | None = None
    suffix: str | None = None


#: Request fields of vLLM's (0.32, ``ChatCompletionRequest`` / ``CompletionRequest``) and SGLang's
#: (0.5.23) OpenAI servers that this gateway accepts and does not apply: dropped like any unknown
#: field (counted in ``ei_gateway_ignored_fields_total``), listed here so the docs and a test can
#: say that none of them is a 400. ``ignore_eos`` and ``min_tokens`` are honoured (fields above).
PEER_FIELDS = ("add_generation_prompt", "add_special_tokens", "allowed_token_ids", "bad_words", "cache_salt",
               "chat_template", "chat_template_kwargs", "continue_final_message", "documents",
               "include_reasoning", "include_stop_str_in_output", "kv_transfer_params", "length_penalty",
               "lora_path", "no_stop_trim", "priority", "prompt_logprobs", "regex", "ebnf", "rid",
               "request_id", "return_hidden_states", "return_token_ids", "return_tokens_as_token_ids",
               "separate_reasoning", "session_id", "session_params", "skip_special_tokens",
               "spaces_between_special_tokens", "stop_token_ids", "stream_interval", "stream_reasoning",
               "structured_outputs", "thinking_token_budget", "truncate_prompt_tokens", "truncation_side",
               "use_beam_search", "vllm_xargs")

#: sampling parameters accepted, range-checked and not applied (the others reach the engine)
SAMPLING = ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


# ----------------------------------------------------------------------------- decoding
_AT = re.compile(r" - at `\$(.*)`$")
_FIELD = re.compile(r"^Object (missing required|contains unknown) field `([^`]*)`")


def validation_error(exc: msgspec.ValidationError) -> ApiError:
    """msgspec's message, with the JSON path turned into OpenAI's ``param``."""
    msg = str(exc)
    m = _AT.search(msg)
    path, base = (m.group(1), msg[: m.start()]) if m else ("", msg)
    f = _FIELD.match(base)
    if f:
        path = f"{path}.{f.group(2)}"
        code = "missing_required_parameter" if f.group(1) == "missing required" else "unknown_parameter"
    elif base.startswith("Expected `") and ", got `" in base:
        code = "invalid_type"
    else:
        code = "invalid_value"
    param = clip(path.lstrip(".") or "body")
    base = clip(base, 2 * MAX_ECHO_CHARS)  # msgspec repeats a bad enum value or an unknown field name
    if base.startswith("Invalid enum value") and param.endswith(".role"):
        base += f" (expected one of {', '.join(ROLES)})"
    return ApiError(400, f"'{param}': {base}", param, code=code)


def _surrogate_path(obj: Any, path: str = "") -> str | None:
    """Path of the first string (or key) holding a lone UTF-16 surrogate, if any."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = _surrogate_path(k, path) or _surrogate_path(v, f"{path}.{k}" if path else k)
            if p:
                return p
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            p = _surrogate_path(v, f"{path}[{i}]")
            if p:
                return p
    return None


def decode_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; a 400 naming ``body`` (or the field with a lone surrogate).
    Nested deeper than :data:`MAX_JSON_DEPTH`: a 400 ``json_too_deep``, before decoding."""
    depth = too_deep(raw, MAX_JSON_DEPTH)
    if depth is not None:
        raise too_deep_error(depth)
    try:
        obj = msgspec.json.decode(raw)
    except RecursionError:  # unreachable behind the depth check; never a 500
        raise too_deep_error(None) from None
    except msgspec.DecodeError as exc:
        # msgspec rejects lone surrogates ("\ud800") that Python's json accepts: find the field.
        try:
            loose = json.loads(raw)
        except (ValueError, RecursionError):
            loose = None
        where = _surrogate_path(loose) if loose is not None else None
        if where is not None:
            raise ApiError(400, f"'{where}' contains a lone UTF-16 surrogate (a \\ud800-\\udfff escape "
                                "without its pair): not valid Unicode", where, code="invalid_value") from None
        raise ApiError(400, f"the request body is not valid JSON: {exc}", "body", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "the request body must be a JSON object", "body", code="invalid_type")
    return obj


def too_deep_error(depth: int | None) -> ApiError:
    """The 400 for a body nested deeper than :data:`MAX_JSON_DEPTH` (``depth``: how deep, when known)."""
    how = f"nested {depth} deep" if depth is not None else "nested too deeply to decode"
    return ApiError(400, f"the request body is {how}: JSON objects and arrays may nest at most "
                         f"{MAX_JSON_DEPTH} deep", "body", code="json_too_deep")


def convert(obj: dict[str, Any], cls: type[Struct], ignored: list[str] | None = None) -> Any:
    """``obj`` as ``cls``; a msgspec validation error of a known field is a 400. An unknown
    top-level field is dropped, its name appended to ``ignored`` (the app counts and logs it:
    clients such as Claude Code send fields newer than this gateway, and a 400 would stop them)."""
    fields = cls.__struct_fields__
    unknown = [k for k in obj if k not in fields]
    if unknown:
        obj = {k: v for k, v in obj.items() if k in fields}
        if ignored is not None:
            ignored.extend(sorted(unknown))
    opts = obj.get("stream_options")
    if isinstance(opts, dict) and "stream_options" in fields:  # a peer's newer stream option: ignored
        extra = sorted(k for k in opts if k not in StreamOptions.__struct_fields__)
        if extra:
            obj = {**obj, "stream_options": {k: v for k, v in opts.items() if k not in extra}}
            if ignored is not None:
                ignored.extend(f"stream_options.{clip(k, 64)}" for k in extra)
    try:
        return msgspec.convert(obj, cls)
    except msgspec.ValidationError as exc:
        raise validation_error(exc) from None


def _neutral_choice(v: Any) -> bool:
    return v is None or v in ("none", "auto")


def refused(req: ChatRequest | CompletionRequest) -> list[tuple[str, str]]:
    """``(param, why)`` for every parameter set to a value the gateway cannot honour."""
    out: list[tuple[str, str]] = []
    if req.n is not None and req.n > 1:
        out.append(("n", f"n={req.n}: only one choice per request (n=1) is supported"))
    if req.logit_bias:
        out.append(("logit_bias", "logit_bias is not supported"))
    if req.stream_options is not None and not req.stream:
        out.append(("stream_options", "stream_options is only allowed when stream is true"))
    if isinstance(req, ChatRequest):
        if req.logprobs:
            out.append(("logprobs", "logprobs are not supported"))
        if req.top_logprobs:
            out.append(("top_logprobs", "top_logprobs are not supported"))
        if req.functions:
            out.append(("functions", "'functions' (the legacy name) is not supported: use 'tools'"))
        if not _neutral_choice(req.function_call):
            out.append(("function_call", "function_call other than 'none'/'auto' is not supported"))
        kind = req.response_format.get("type", "text") if req.response_format is not None else "text"
        if kind not in ("text", "json_object", "json_schema"):
            why = f"response_format {clip(str(kind))!r} is not supported (text, json_object, json_schema)"
            out.append(("response_format", why))
        if req.modalities is not None and req.modalities != ["text"]:
            out.append(("modalities", "only the 'text' modality is supported"))
        for name in ("audio", "prediction", "web_search_options"):
            if getattr(req, name) is not None:
                out.append((name, f"{name} is not supported"))
    else:
        if req.best_of is not None and req.best_of > 1:
            out.append(("best_of", f"best_of={req.best_of}: only best_of=1 is supported"))
        if req.logprobs is not None:
            out.append(("logprobs", "logprobs are not supported"))
        if req.echo:
            out.append(("echo", "echo is not supported"))
        if req.suffix:
            out.append(("suffix", "suffix (insertion) is not supported"))
    return out


def _check(req: ChatRequest | CompletionRequest) -> None:
    bad = refused(req)
    if bad:
        names = ", ".join(p for p, _ in bad)
        raise ApiError(400, f"unsupported parameter(s): {names}: " + "; ".join(w for _, w in bad),
                       bad[0][0], code="unsupported_parameter")
    if req.max_completion_tokens is not None and req.max_tokens is not None \
            and req.max_completion_tokens != req.max_tokens:
        raise ApiError(400, "'max_tokens' and 'max_completion_tokens' disagree: give one of them",
                       "max_completion_tokens", code="invalid_value")


def parse_chat(raw: bytes, ignored: list[str] | None = None) -> tuple[ChatRequest, dict[str, Any]]:
    """The validated request and the decoded object (the chat template renders its messages);
    the names of unknown top-level fields (dropped) are appended to ``ignored``."""
    obj = decode_object(raw)
    req = convert(obj, ChatRequest, ignored)
    _check(req)
    return req, obj


#: the body's top level with each value left undecoded, and a token-id prompt decoded as a
#: ``list[int]`` in C (:func:`_parse_token_prompt`)
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_INTS = msgspec.json.Decoder(list[int])


#: bytes below 0x80, deleted by ``translate``: what is left of a uint32's most significant bytes
#: is the ids of 2**31 and more
_LOW_BYTES = bytes(range(0x80))
_MSB = 3 if sys.byteorder == "little" else 0


def _token_ids(raw: msgspec.Raw) -> list[int] | None:
    """A non-empty JSON list of :data:`TokenId` (0 <= id < 2**31), else ``None``. Not
    ``list[TokenId]``: msgspec's per-item constraint check doubles the decode (7.3 against 3.7
    ms per 100K ids); the range is checked in C on a uint32 copy instead (``array`` refuses a
    negative id or one of 2**32 and more; no most significant byte may have its top bit set),
    ~1 ms per 100K ids."""
    try:
        ids = _INTS.decode(raw)
        if not ids or array.array("I", ids).tobytes()[_MSB::4].translate(None, _LOW_BYTES):
            return None
    except (msgspec.DecodeError, msgspec.ValidationError, OverflowError):
        return None
    return ids


def _parse_token_prompt(raw: bytes, ignored: list[str] | None) -> CompletionRequest | None:
    """The request when its prompt is a non-empty list of token ids, parsed without a Python
    object per token: the top level with each value undecoded (one scan), the prompt straight
    into a checked ``list[int]``, the other fields as :func:`parse_completion` does. ``None``
    for anything else (a text prompt, a mixed or empty list, invalid JSON, a bad field), which
    the general path parses and, where it must, refuses with its own message. A 100K-token
    prompt: 7.1 -> 6.0 and 6.7 -> 5.5 ms against :func:`parse_completion_general` (1.2x, best
    of 25, 6 Dec 2026, load 9; both are mostly the decode of 100K JSON integers)."""
    try:
        top = _TOP.decode(raw)
        prompt = top.get("prompt")
        if prompt is None or memoryview(prompt)[:1] != b"[":
            return None
        ids = _token_ids(prompt)
        if ids is None:
            return None
        obj = {k: msgspec.json.decode(v) for k, v in top.items() if k != "prompt"}
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    obj["prompt"] = ""  # checked above; the Struct takes the ids after the other fields' checks
    try:
        req = convert(obj, CompletionRequest, ignored)
    except ApiError:
        return None
    _check(req)
    return msgspec.structs.replace(req, prompt=ids)


def parse_completion(raw: bytes, ignored: list[str] | None = None) -> CompletionRequest:
    if too_deep(raw, MAX_JSON_DEPTH) is None:
        mark = len(ignored) if ignored is not None else 0
        req = _parse_token_prompt(raw, ignored)
        if req is not None:
            return req
        if ignored is not None:
            del ignored[mark:]  # the general path below names them again
    return parse_completion_general(raw, ignored)


def parse_completion_general(raw: bytes, ignored: list[str] | None = None) -> CompletionRequest:
    """Any completion body (what :func:`parse_completion` falls back to; the tests hold the
    token-id path to it)."""
    req = convert(decode_object(raw), CompletionRequest, ignored)
    _check(req)
    p = req.prompt
    if isinstance(p, list):
        kinds = {type(x) for x in p}
        if kinds == {str} and len(p) == 1:
            return msgspec.structs.replace(req, prompt=p[0])
        if not p or kinds != {int}:
            raise ApiError(400, "'prompt' must be a string, a list with one string, or a non-empty list of "
                                "token ids (batched prompts are not supported)", "prompt", code="invalid_value")
    return req


def requested_max_tokens(req: ChatRequest | CompletionRequest) -> int | None:
    """``max_completion_tokens`` (the newer name) or ``max_tokens``; None when neither is set."""
    return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens


def agent_hints(req: ChatRequest | CompletionRequest) -> tuple[AgentHints | None, list[str]]:
    """The request's ``nvext.agent_hints`` and the hint names this gateway does not know (ignored,
    not a 400: a harness may send hints of a newer Dynamo). A known hint of the wrong type or
    range is a 400 naming it (``nvext.agent_hints.osl``)."""
    raw = req.nvext.agent_hints if req.nvext is not None else None
    if raw is None:
        return None, []
    unknown = sorted(k for k in raw if k not in AGENT_HINTS)
    try:
        hints = msgspec.convert({k: v for k, v in raw.items() if k in AGENT_HINTS}, AgentHints)
    except msgspec.ValidationError as exc:
        err = validation_error(exc)
        param = f"nvext.agent_hints.{err.param}" if err.param != "body" else "nvext.agent_hints"
        raise ApiError(400, err.message.replace(f"'{err.param}'", f"'{param}'", 1), param,
                       code=err.code) from None
    return hints, unknown


def unapplied(req: ChatRequest | CompletionRequest) -> list[str]:
    """The sampling parameters set on the request that no engine applies (:data:`SAMPLING`)."""
    return [name for name in SAMPLING if getattr(req, name) is not None]


#: the most ``stop`` strings a request may give, and the longest one (OpenAI allows 4; vLLM any)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256


def sampling_fields(req: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """``RequestSubmitted``'s sampling fields from the request (only those it sets): the engine
    samples with them and ends the output at a ``stop`` string or, unless ``ignore_eos``, at end
    of turn (docs/gateway.md, "Sampling and stopping"). Too many or too long ``stop`` strings
    are a 400."""
    out: dict[str, Any] = {"ignore_eos": bool(req.ignore_eos)}  # always said: a client's turn ends at EOS
    for name in ("temperature", "top_p", "top_k", "seed"):
        v = getattr(req, name)
        if v is not None:
            out[name] = v
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or ())
    stop = [s for s in stop if s]
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                       f"characters", "stop", code="invalid_value")
    if stop:
        out["stop"] = stop
    return out


def chat_tools(req: ChatRequest) -> list[dict[str, Any]] | None:
    """The function definitions for the chat template: ``{"name", "description", "parameters"}``
    (the keys that are set), the shape Anthropic's tools are mapped to as well."""
    if not req.tools:
        return None
    return [function_def(t.function.name, t.function.description, t.function.parameters) for t in req.tools]


#: How a tool this gateway cannot serve is counted in ``ei_gateway_ignored_fields_total`` (a hosted
#: tool that runs at OpenAI or Anthropic: web search, code execution, ...; on both the Responses
#: and the Messages API): ``tools[].type: <type>``; the response lists the types in the header
#: ``x-evolving-unserved-tools`` and ``evolving.unserved_tools`` (meta.Meta).
UNSERVED_TOOL = "tools[].type: "


def unserved_kind(kind: str) -> str:
    """A client's tool type as the header and the counter carry it: at most 64 characters of
    ``[A-Za-z0-9_.:-]``, any other character as ``?`` (a header value never holds a line break)."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "_.:-") else "?" for c in kind[:64]) or "?"


def unserved_tool_names(kinds: list[str]) -> list[str]:
    """The ignored-field names of the unserved tool types ``kinds`` (one per tool, in order)."""
    return [UNSERVED_TOOL + k for k in kinds]


def function_def(name: str, description: str | None, parameters: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name}
    if description is not None:
        out["description"] = description
    if parameters is not None:
        out["parameters"] = parameters
    return out


def context_error(context: int, prompt: int, completion: int, param: str) -> ApiError:
    """OpenAI's context-length error (same wording, code ``context_length_exceeded``)."""
    return ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                         f"{prompt + completion} tokens ({prompt} in the {'messages' if param == 'messages' else 'prompt'}, "
                         f"{completion} in the completion). Please reduce the length of the "
                         f"{'messages' if param == 'messages' else 'prompt'} or completion.",
                    param, code="context_length_exceeded")
