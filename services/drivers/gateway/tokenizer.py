"""Tokenisers and the chat template of the gateway (pure, no I/O besides loading a file).

- :class:`ByteTokenizer` (default): the UTF-8 bytes of the text are the token ids (0..255),
  so one ASCII character is one token. Deterministic, dependency-free, and it makes prompt
  lengths and shared prefixes exact, which ``evolving drive`` relies on (docs/gateway.md).
- :class:`HfTokenizer`: a Hugging Face ``tokenizers`` tokenizer: the model's own, which
  ``--model`` / ``--tokenizer`` name (a GGUF file, a ``tokenizer.json`` or a model folder;
  :mod:`services.drivers.gateway.model` loads it with the model's Jinja chat template).

The simple chat template (:func:`render_chat`), kept for the byte tokenizer and the simulated
engines (a named model uses its own Jinja template, ``chat_template.py``): every message
becomes ``<|{role}|>\\n{content}<|end|>\\n`` and the prompt ends
with the generation prompt ``<|assistant|>\\n``. The generation prompt is a prefix of the
rendered assistant message, so the next turn's prompt extends this turn's prompt (the
gateway's compaction rule depends on that). Content may be a string or a list of parts;
text parts are joined, other parts become ``[<type>]``. An assistant's ``tool_calls`` are
appended as compact JSON; a tool message's ``tool_call_id`` is shown in its role tag. Tool
definitions (``tools``: OpenAI's ``function`` objects, or Anthropic's tools mapped to the same
``{"name", "description", "parameters"}`` shape) come first, as one ``<|tools|>\n[...]<|end|>\n``
block of compact JSON with sorted keys, so the same tools cost the same tokens on either API.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
GENERATION_PROMPT = "<|assistant|>\n"


class Tokenizer(Protocol):
    name: str
    vocab_size: int  # ids are below it

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes -> token ids 0..255 (one ASCII character = one token)."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i & 0xFF for i in ids).decode("utf-8", errors="replace")


class HfTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer (from a ``tokenizer.json``, or built from a GGUF
    file's metadata by :mod:`services.drivers.gateway.model`). ``encode`` adds no special
    tokens: a chat template writes its own (``apply_chat_template`` tokenises the same way)."""

    def __init__(self, tok, name: str) -> None:
        self._tok, self.name = tok, name
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | Path) -> HfTokenizer:
        from tokenizers import Tokenizer as _HfTok  # lazy: optional dependency (tokenizers)

        return cls(_HfTok.from_file(str(path)), f"hf:{Path(path).name}")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


class TemplateError(ValueError):
    """A malformed chat message; ``field`` names it (e.g. ``messages[2].role``)."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


def content_text(content: object, at: str) -> str:
    """A message's content as text: text parts joined, other parts as ``[<type>]``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise TemplateError(f"{at}[{i}]", "a content part must be an object with a 'type'")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise TemplateError(f"{at}[{i}].text", "must be a string")
                out.append(part["text"])
            else:
                out.append(f"[{part['type']}]")
        return "".join(out)
    raise TemplateError(at, "must be a string, a list of parts or null")


def render_tools(tools: Sequence[dict] | None) -> str:
    """The tools block (empty without tools): ``<|tools|>\n{compact JSON}<|end|>\n``."""
    if not tools:
        return ""
    return f"<|tools|>\n{json.dumps(list(tools), separators=(',', ':'), sort_keys=True)}<|end|>\n"


def checked_messages(messages: object) -> list[tuple[dict, str, str]]:
    """OpenAI chat ``messages`` validated (``TemplateError`` names the field): each as
    ``(message, role, content text)``. Both templates (this one and the model's) take them so."""
    if not isinstance(messages, list) or not messages:
        raise TemplateError("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise TemplateError(at, "must be an object")
        role = m.get("role")
        if role not in ROLES:
            raise TemplateError(f"{at}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        out.append((m, role, content_text(m.get("content"), f"{at}.content")))
    return out


def render_chat(messages: object, tools: Sequence[dict] | None = None) -> str:
    """Render OpenAI chat ``messages`` (after the ``tools`` block, if any) with the template
    above (see the module docstring)."""
    checked = checked_messages(messages)
    parts = [render_tools(tools)]
    for m, role, text in checked:
        if m.get("tool_calls"):
            text += json.dumps(m["tool_calls"], separators=(",", ":"), sort_keys=True)
        tag = role if role != "tool" or not m.get("tool_call_id") else f"tool:{m['tool_call_id']}"
        parts.append(f"<|{tag}|>\n{text}<|end|>\n")
    parts.append(GENERATION_PROMPT)
    return "".join(parts)
