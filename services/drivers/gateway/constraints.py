"""Structured output at the gateway: a forcing ``tool_choice`` or a JSON response format becomes
the ``OutputConstraint`` the engines enforce (docs/gateway.md, "Structured output"). Pure:
stdlib, msgspec and ``events``; the schema check imports llguidance when it is installed.

What each request asks (:func:`for_chat`, :func:`for_messages`, :func:`for_responses`):

- a **forced call** - OpenAI ``tool_choice: "required"`` or ``{"type": "function", ...}``,
  Anthropic ``{"type": "any"}`` or ``{"type": "tool", "name"}``: exactly one call, of one of the
  request's tools (or the named one), its arguments valid against the tool's parameters, written
  in the tool-call format the gateway parses (:func:`tool_call`): ``hermes``
  ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``, ``llama3_json``
  ``{"name": N, "parameters": {...}}``, ``mistral`` ``[TOOL_CALLS][{"name": N, "arguments": {...}}]``.
  A model without a tool-call format (``--tool-call-parser`` none, e.g. SmolLM2's template) is
  given ``hermes``: the output is constrained, so its format is ours to choose, and the answer
  is parsed with it. The call then flows through the parser into ``tool_calls`` /
  ``tool_use`` / ``function_call`` as any call does.
- a **JSON answer** - OpenAI ``response_format`` / Responses ``text.format`` / Anthropic
  ``output_config.format`` of type ``json_schema`` (its ``schema``) or ``json_object``
  (``{"type": "object"}``): the text is one JSON value valid against it. A forced call wins over
  a response format.

Schemas are closed (:func:`closed`): an object schema that lists ``properties`` and says nothing
of ``additionalProperties`` gets ``false`` (xgrammar's strict mode, vLLM's default, does the
same). Every value valid under the closed schema is valid under the client's, and a small model
left free to add keys fills its budget with invented ones. Objects inside an ``allOf`` stay open
(closing each branch would forbid the other branches' keys).

Checked before anything is published (:func:`check`): a schema that is not a JSON object (or a
boolean), a tool name that no tool has, a forced call without tools, and - with llguidance
installed, the compiler the torch engine uses - a schema that does not compile are a 400 in the
API's shape naming the field, never an engine's failure. The last 256 answers are kept by
constraint (an agent sends the same tools every turn: 24 tool schemas take ~90 ms to compile).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from engine.structured import key, validate
from events.catalog import OutputConstraint
from services.drivers.gateway.api import ApiError, clip

#: the calls each tool-call format writes: (prefix, suffix, key of the arguments, a list of calls)
FORMATS = {"hermes": ("<tool_call>\n", "\n</tool_call>", "arguments", False),
           "llama3_json": ("", "", "parameters", False),
           "mistral": ("[TOOL_CALLS]", "", "arguments", True)}


#: the last checks' answers by constraint (engine/structured.key): an agent sends the same tools
#: with every request, and compiling 24 tool schemas (54 KB) takes ~90 ms of the event loop
_CHECKED: OrderedDict[str, str] = OrderedDict()
CHECKED_KEEP = 256


@dataclass(frozen=True)
class Structured:
    """A request's constraint and the tool-call parser that reads its answer (None: a JSON answer,
    read as text)."""

    constraint: OutputConstraint
    parser: str | None


def call_format(parser: str) -> str:
    """The format a forced call is written in: the gateway's parser, ``hermes`` when it has none."""
    return parser if parser in FORMATS else "hermes"


def closed(schema: Any, in_all_of: bool = False) -> Any:
    """``schema`` with its open object schemas closed (module docstring)."""
    if isinstance(schema, list):
        return [closed(s, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            out[k] = {n: closed(s) for n, s in v.items()} if isinstance(v, dict) else v
        elif k in ("items", "prefixItems", "anyOf", "oneOf", "additionalProperties", "contains", "not"):
            out[k] = closed(v)
        elif k == "allOf":
            out[k] = closed(v, True)
        else:
            out[k] = v
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out and not in_all_of \
            and "patternProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def rebased(schema: Any, base: str) -> Any:
    """``schema`` moved under the JSON pointer ``base`` of a larger schema: its local references
    (``#``, ``#/$defs/x``) made to point where it now is (``base``, ``base/$defs/x``)."""
    if isinstance(schema, list):
        return [rebased(s, base) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: rebased(v, base) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def tool_call(tools: list[dict[str, Any]], name: str | None, parser: str) -> Structured:
    """One call of ``name`` (or of any of ``tools``) in ``parser``'s format (module docstring).
    ``tools``: the ``{"name", "parameters"}`` function definitions the template renders. Each
    tool's parameters sit inside the call's schema, their local references rebased there."""
    fmt = call_format(parser)
    prefix, suffix, args_key, listed = FORMATS[fmt]
    chosen = [t for t in tools if name is None or t["name"] == name]
    top = "#/items" if listed else "#"
    calls = []
    for i, t in enumerate(chosen):
        where = f"{top}/properties/{args_key}" if len(chosen) == 1 else f"{top}/anyOf/{i}/properties/{args_key}"
        params = rebased(closed(t.get("parameters") or {"type": "object"}), where)
        calls.append({"type": "object", "properties": {"name": {"const": t["name"]}, args_key: params},
                      "required": ["name", args_key], "additionalProperties": False})
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if listed:
        schema = {"type": "array", "items": schema, "minItems": 1, "maxItems": 1}
    return Structured(OutputConstraint(json_schema=json.dumps(schema, ensure_ascii=False), prefix=prefix,
                                       suffix=suffix), fmt)


def json_answer(schema: Any) -> Structured:
    return Structured(OutputConstraint(json_schema=json.dumps(closed(schema), ensure_ascii=False)), None)


def check(s: Structured, param: str) -> Structured:
    """A 400 naming ``param`` when the constraint does not compile (llguidance, when installed)."""
    try:
        import llguidance  # noqa: F401  # lazy: only whether the compiler (the engine extra) is installed
    except ModuleNotFoundError:
        return s  # checked as far as the shape goes; an engine that cannot compile it fails the request
    k = key(s.constraint)
    why = _CHECKED.get(k)
    if why is None:
        why = _CHECKED[k] = validate(s.constraint)
        while len(_CHECKED) > CHECKED_KEEP:
            _CHECKED.popitem(last=False)
    _CHECKED.move_to_end(k)
    if why:
        raise ApiError(400, f"'{param}': the JSON schema cannot be enforced: {clip(why.strip(), 512)}", param,
                       code="invalid_value")
    return s


def _schema(value: Any, param: str) -> Any:
    if not isinstance(value, (dict, bool)):
        raise ApiError(400, f"'{param}' must be a JSON Schema (an object)", param, code="invalid_type")
    return value


def _forced(tools: list[dict[str, Any]] | None, name: str | None, parser: str, param: str) -> Structured:
    if not tools:
        raise ApiError(400, f"'{param}': a tool call is forced but the request has no tools", param,
                       code="invalid_value")
    if name is not None and all(t["name"] != name for t in tools):
        raise ApiError(400, f"'{param}': no tool is named {clip(name)!r}", param, code="invalid_value")
    for i, t in enumerate(tools):
        if t.get("parameters") is not None:
            _schema(t["parameters"], f"tools[{i}].parameters")
    return check(tool_call(tools, name, parser), param)


def _format(fmt: Any, param: str) -> Structured | None:
    """``response_format`` / ``text.format``: json_schema or json_object (None: text)."""
    if not isinstance(fmt, dict) or fmt.get("type", "text") == "text":
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return json_answer({"type": "object"})
    if kind != "json_schema":
        raise ApiError(400, f"'{param}.type': {clip(str(kind))!r} is not supported (text, json_object, json_schema)",
                       f"{param}.type", code="unsupported_parameter")
    spec = fmt.get("json_schema", fmt)  # chat: {"json_schema": {"schema"}}; Responses: {"schema"} in the format
    where = f"{param}.json_schema.schema" if "json_schema" in fmt else f"{param}.schema"
    schema = spec.get("schema", {}) if isinstance(spec, dict) else None
    return check(json_answer(_schema(schema, where)), where)


def for_chat(req, tools: list[dict[str, Any]] | None, parser: str) -> Structured | None:
    """A ``/v1/chat/completions`` request's constraint (``req``: api.ChatRequest)."""
    tc = req.tool_choice
    if tc == "required":
        return _forced(tools, None, parser, "tool_choice")
    if tc is not None and not isinstance(tc, str):
        return _forced(tools, tc.function.name, parser, "tool_choice.function.name")
    return _format(req.response_format, "response_format")


def for_messages(req, tools: list[dict[str, Any]] | None, parser: str) -> Structured | None:
    """A ``/v1/messages`` request's constraint (``req``: anthropic_api.MessagesRequest)."""
    tc = req.tool_choice
    if tc is None or tc.type in ("auto", "none"):
        return _format((req.output_config or {}).get("format"), "output_config.format")
    return _forced(tools, tc.name if tc.type == "tool" else None, parser,
                   "tool_choice.name" if tc.type == "tool" else "tool_choice")


def for_responses(req, tools: list[dict[str, Any]] | None, parser: str) -> Structured | None:
    """A ``/v1/responses`` request's constraint (``req``: responses_api.ResponsesRequest)."""
    tc = req.tool_choice
    if tc == "required":
        return _forced(tools, None, parser, "tool_choice")
    if isinstance(tc, dict) and tc.get("type") == "function":
        name, ns = tc.get("name"), tc.get("namespace")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'tool_choice.name': required when tool_choice.type is 'function'",
                           "tool_choice.name", code="missing_required_parameter")
        if isinstance(ns, str) and ns:  # a namespaced tool, rendered under its flat name (responses_api)
            name = f"{ns.rstrip('_')}__{name.lstrip('_')}"
        return _forced(tools, name, parser, "tool_choice.name")
    return _format((req.text or {}).get("format"), "text.format")
