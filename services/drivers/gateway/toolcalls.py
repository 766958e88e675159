"""Tool calls out of the model's text: one incremental parser per model family (pure: stdlib only,
no I/O, no clock, no randomness).

A parser is fed the engine's text deltas as they stream (:meth:`ToolCallParser.feed`) and
returns what can be said so far: plain-text pieces (``str``) and completed :class:`ToolCall`\\ s,
in order; :meth:`ToolCallParser.finish` says the rest at the end of the output. Invariants (the
property tests in ``tests/unit/drivers/gateway/test_toolcalls.py``):

- any split of a text into deltas gives the same pieces as feeding it whole (:func:`parse_all`;
  adjacent text pieces merged), so streamed and non-streamed answers agree;
- text that holds no marker comes out unchanged;
- text that may still turn out to start a marker is held back (the longest suffix of what was
  fed that is a prefix of the marker, as a stop string is held back), never emitted early;
- a marker whose body is not a valid call (malformed JSON, no ``name``, arguments that are not
  an object) comes out as plain text, marker included, once its end is seen;
- whitespace between a call and the text beside it is dropped (``"Sure.\\n\\n<tool_call>..."``
  gives the text ``"Sure."``), nothing else is.

Formats (vLLM's parser names, ``--tool-call-parser``):

- ``hermes`` (Hermes 2/3, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number, anywhere in the text; one left open at the end of the output is parsed if its
  body is complete JSON (a model stopped at end of turn before the close tag);
- ``mistral``: ``[TOOL_CALLS]`` then, to the end of the output, a JSON list (or object) of
  ``{"name", "arguments"}``, or the v11 form ``[TOOL_CALLS]name[ARGS]{...}`` (repeated per call);
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): an output that starts (after whitespace) with ``{`` or
  ``<|python_tag|>`` is held to its end and is calls if it is JSON objects with ``name`` and
  ``parameters`` (or ``arguments``), separated by ``;``; any other output is text.

:func:`detect` chooses the family from the chat template's source text.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

#: the ``--tool-call-parser`` choices; ``auto`` picks from the chat template (:func:`detect`)
PARSERS = ("auto", "hermes", "llama3_json", "mistral", "none")


@dataclass(frozen=True)
class ToolCall:
    """A completed call: ``arguments`` is a JSON object as text (OpenAI's ``arguments``; parse
    it for Anthropic's ``input``); ``id`` is ``call_<prefix>_<n>``, ``n`` counting from 0."""

    id: str
    name: str
    arguments: str

    def input(self) -> dict[str, Any]:
        return json.loads(self.arguments)


Piece = str | ToolCall


def detect(template_source: str | None) -> str:
    """The parser a chat template's text asks for: ``hermes`` (``<tool_call>``), ``mistral``
    (``[TOOL_CALLS]``), ``llama3_json`` (``<|python_tag|>``, or its instruction to answer with
    ``{"name": ..., "parameters": ...}``), else ``none``."""
    src = template_source or ""
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_tag|>" in src or ('"parameters"' in src and '"name"' in src):
        return "llama3_json"
    return "none"


def make(name: str, id_prefix: str) -> ToolCallParser | None:
    """A fresh parser of family ``name`` (None for ``none``); call ids ``call_<id_prefix>_<n>``."""
    cls = {"hermes": HermesParser, "mistral": MistralParser, "llama3_json": Llama3JsonParser}.get(name)
    if cls is None:
        assert name == "none", f"unknown tool-call parser {name!r} (one of {PARSERS[1:]})"
        return None
    return cls(id_prefix)


def parse_all(parser: ToolCallParser, deltas: list[str]) -> list[Piece]:
    """Feed every delta, then finish; adjacent text pieces merged, empty ones dropped."""
    out: list[Piece] = []
    for d in deltas:
        out += parser.feed(d)
    out += parser.finish()
    return merged(out)


def merged(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, str):
            if not p:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += p
                continue
        out.append(p)
    return out


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def call_fields(obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> tuple[str, str] | None:
    """``(name, arguments as JSON)`` of a decoded call object, or None if it is not one: a
    non-empty string ``name`` and arguments that are an object (or a string holding one), or
    absent (``{}``)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for k in args_keys:
        if k in obj:
            args = obj[k]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def json_values(text: str, sep: str = "") -> list[Any] | None:
    """The JSON values ``text`` holds one after another (whitespace and ``sep`` between them),
    or None if anything else is there."""
    dec, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (sep and text[i] == sep and out)):
            i += 1
        if i >= len(text):
            return out or None
        try:
            v, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(v)


class ToolCallParser(ABC):
    """Text deltas in, pieces out (the module docstring). Subclasses implement :meth:`_feed` and
    :meth:`_finish` over ``self._buf``; this base numbers the calls and drops the whitespace
    between a call and its neighbouring text."""

    def __init__(self, id_prefix: str) -> None:
        self.id_prefix = id_prefix
        self.calls = 0
        self._buf = ""
        self._ws = ""  # trailing whitespace of the text so far: emitted before more text, dropped before a call
        self._after_call = False

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        return self._shape(self._feed())

    def finish(self) -> list[Piece]:
        out = self._shape(self._finish())
        if self._ws and not self._after_call:
            out.append(self._ws)
        self._ws = ""
        return out

    @abstractmethod
    def _feed(self) -> list[str | tuple[str, str]]:
        """Consume what ``self._buf`` allows: text, or ``(name, arguments)`` calls."""

    @abstractmethod
    def _finish(self) -> list[str | tuple[str, str]]:
        """Everything left, at the end of the output."""

    def _call(self, name: str, arguments: str) -> ToolCall:
        c = ToolCall(f"call_{self.id_prefix}_{self.calls}", name, arguments)
        self.calls += 1
        return c

    def _shape(self, raw: list[str | tuple[str, str]]) -> list[Piece]:
        out: list[Piece] = []
        for p in raw:
            if isinstance(p, tuple):
                self._ws, self._after_call = "", True
                out.append(self._call(*p))
                continue
            body = p.rstrip()
            if not body:  # whitespace only (or nothing): pending until we see what follows it
                self._ws += p
                continue
            out.append(body.lstrip() if self._after_call else self._ws + body)
            self._ws, self._after_call = p[len(body):], False
        return out


class _MarkerParser(ToolCallParser):
    """Calls between ``START`` and ``END`` (``END`` None: to the end of the output)."""

    START: str = ""
    END: str | None = None

    def __init__(self, id_prefix: str) -> None:
        super().__init__(id_prefix)
        self._inside = False
        self._scanned = 0  # of a call's body: no END starts before this (a long call is not rescanned per delta)

    @abstractmethod
    def _parse(self, body: str) -> list[tuple[str, str]] | None:
        """The calls of a marker's body, or None if it is not valid."""

    def _close(self, body: str, closed: bool) -> list[str | tuple[str, str]]:
        calls = self._parse(body)
        if calls:
            return list(calls)
        return [self.START + body + (self.END if closed and self.END else "")]

    def _feed(self) -> list[str | tuple[str, str]]:
        out: list[str | tuple[str, str]] = []
        while True:
            if not self._inside:
                i = self._buf.find(self.START)
                if i < 0:
                    keep = held_prefix(self._buf, self.START)
                    out.append(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                out.append(self._buf[:i])
                self._buf, self._inside = self._buf[i + len(self.START):], True
            if self.END is None:
                return out
            j = self._buf.find(self.END, self._scanned)
            if j < 0:
                self._scanned = max(0, len(self._buf) - len(self.END) + 1)
                return out
            out += self._close(self._buf[:j], True)
            self._buf, self._inside, self._scanned = self._buf[j + len(self.END):], False, 0

    def _finish(self) -> list[str | tuple[str, str]]:
        body, self._buf = self._buf, ""
        if not self._inside:
            return [body]
        self._inside = False
        return self._close(body, False)


class HermesParser(_MarkerParser):
    START, END = "<tool_call>", "</tool_call>"

    def _parse(self, body: str) -> list[tuple[str, str]] | None:
        values = json_values(body)
        if values is None or len(values) != 1:
            return None
        call = call_fields(values[0])
        return [call] if call else None


class MistralParser(_MarkerParser):
    START, END = "[TOOL_CALLS]", None

    def _parse(self, body: str) -> list[tuple[str, str]] | None:
        out: list[tuple[str, str]] = []
        for part in body.split(self.START):
            if "[ARGS]" in part and not part.lstrip().startswith(("[", "{")):  # v11: name[ARGS]{...}
                name, _, args = part.partition("[ARGS]")
                values = json_values(args)
                if values is None or len(values) != 1:
                    return None
                call = call_fields({"name": name.strip(), "arguments": values[0]})
                if call is None:
                    return None
                out.append(call)
                continue
            values = json_values(part)
            if values is None:
                return None
            for v in values:
                for obj in v if isinstance(v, list) else [v]:
                    call = call_fields(obj)
                    if call is None:
                        return None
                    out.append(call)
        return out or None


class Llama3JsonParser(ToolCallParser):
    TAG = "<|python_tag|>"

    def __init__(self, id_prefix: str) -> None:
        super().__init__(id_prefix)
        self._mode: str | None = None  # None: undecided; "text" or "json"

    def _feed(self) -> list[str | tuple[str, str]]:
        if self._mode is None:
            s = self._buf.lstrip()
            if not s or (len(s) < len(self.TAG) and self.TAG.startswith(s)):
                return []  # nothing yet, or it may still be the tag
            self._mode = "json" if s.startswith(("{", self.TAG)) else "text"
        if self._mode == "json":
            return []
        text, self._buf = self._buf, ""
        return [text]

    def _finish(self) -> list[str | tuple[str, str]]:
        text, self._buf = self._buf, ""
        s = text.lstrip()
        if self._mode != "text" and s.startswith(("{", self.TAG)):
            values = json_values(s.removeprefix(self.TAG), ";")
            calls = [call_fields(v, ("parameters", "arguments")) for v in values or []]
            if calls and all(calls):
                return calls  # type: ignore[return-value]
        return [text]
